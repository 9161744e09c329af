"""Helpers shared by several test modules (the shared pytest fixtures are in conftest.py).

Test modules import from here, never from each other: tiny random models and batches, model
folders and the session's exports, a numpy runner of the decoding protocol with known
probabilities, random log-probability functions and search options for property tests. The
stand-in TensorRT module and engines are in fake_tensorrt.py.
"""

from __future__ import annotations

import string
from pathlib import Path

import numpy as np
import torch
from hypothesis import strategies as st

from transformer_ext import decoding
from transformer_ext.checkpoint import save_model
from transformer_ext.config import TransformerConfig
from transformer_ext.decoding import check_select_index, log_softmax
from transformer_ext.export_format import MANIFEST_NAME
from transformer_ext.model import Transformer
from transformer_ext.tokenizer import SPECIAL_TOKENS, CharTokenizer

# ------------------------------------------------------------------------------------------
# models and batches
# ------------------------------------------------------------------------------------------


def make_model(norm_first: bool, seed: int = 0, **overrides) -> Transformer:
    """A tiny model with every parameter random (LayerNorm gains and biases included), eval mode."""
    torch.manual_seed(seed)
    model = Transformer(TransformerConfig.preset("tiny", norm_first=norm_first, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                base = 1.0 if name.endswith("norm.weight") else 0.0
                p.copy_(base + 0.2 * torch.randn_like(p))
    return model.eval()


def make_batch(config: TransformerConfig, seed: int = 1, B: int = 3, S: int = 7, T: int = 6):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, config.src_vocab_size, (B, S), generator=g)
    lengths = torch.tensor([S, 4, 1][:B] + [S] * max(0, B - 3), dtype=torch.int64)
    for b in range(B):
        src[b, lengths[b] :] = config.pad_id
    tgt = torch.randint(3, config.tgt_vocab_size, (B, T), generator=g)
    tgt[:, 0] = config.bos_id
    return src, lengths, tgt


# ------------------------------------------------------------------------------------------
# model folders and exports
# ------------------------------------------------------------------------------------------


FLAVOURS = ["portable", "tensorscatter", "ort"]  # the decoder graphs export.onnx writes
TOLERANCE = 1e-4  # parity tolerance of the session's exports
DEMO_DIR = Path(__file__).resolve().parents[1] / "transformer_ext" / "demo_model"


def make_model_dir(directory: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random-weight model folder with a matching character tokenizer."""
    torch.manual_seed(seed)
    config = TransformerConfig.preset("tiny", dropout=0.0, **overrides)
    save_model(Transformer(config).eval(), directory)
    chars = string.ascii_lowercase + string.digits + " -.,'!?#$%&*+/:;<=>@"
    source = list(SPECIAL_TOKENS) + list(chars[: config.src_vocab_size - len(SPECIAL_TOKENS)])
    target = list(SPECIAL_TOKENS) + list(chars[: config.tgt_vocab_size - len(SPECIAL_TOKENS)])
    CharTokenizer(source, target, lowercase=True).save(directory)
    return directory


def rehash_export(folder: Path) -> None:
    """Record the SHA-256 of ``folder``'s files in its manifest again: a test that edits a file of an
    export on purpose (its generation.json) makes an edit the manifest knows of."""
    import json

    from export.manifest import write_manifest

    write_manifest(folder, json.loads((folder / MANIFEST_NAME).read_text()))


def quantized_dir(tmp_path_factory, scheme: str = "int8") -> Path:
    """The tiny model's portable export quantized with ``scheme`` (no gate: its tokenizer cannot
    encode the demo task), once per test session."""
    from export.quantize import quantize_export

    out = tmp_path_factory.getbasetemp() / "shared_exports" / f"tiny_{scheme}"
    if not (out / MANIFEST_NAME).is_file():
        quantize_export(exported_dir(tmp_path_factory, "portable"), out, scheme, gate=False)
    return out


def exported_dir(tmp_path_factory, flavour: str) -> Path:
    """The tiny model exported (and validated) in ``flavour``, once per test session."""
    from export.onnx import export_onnx

    base = tmp_path_factory.getbasetemp() / "shared_exports"
    model_dir = base / "tiny_model"
    out = base / f"tiny_{flavour}"
    if not (out / MANIFEST_NAME).is_file():
        if not model_dir.is_dir():
            make_model_dir(model_dir)
        export_onnx(model_dir, out, flavour=flavour, tolerance=TOLERANCE)
    return out


def with_cross_per_row(folder: Path) -> Path:
    """Rewrite an export folder (in place) as format versions 1-3 declared their decoder step:
    the cross-attention K/V on the ``batch`` axis, one row per decoder row, format version 3.

    Only the declared axis changes: the step graph computes one cross-attention row per source
    with ``batch / sources`` rows each, so with as many K/V rows as decoder rows it is the
    per-row step those versions exported."""
    import json

    import onnx

    from transformer_ext.export_format import (
        BATCH,
        DECODER_FILE,
        HASHES_KEY,
        file_sha256,
        graph_specs,
        manifest_attention,
    )

    path = folder / DECODER_FILE
    graph = onnx.load(path)
    for value in graph.graph.input:
        if value.name.startswith("cross_"):
            value.type.tensor_type.shape.dim[0].dim_param = BATCH
    onnx.save(graph, path)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    manifest["format_version"] = 3
    manifest["graphs"] = graph_specs(
        manifest["model_config"], manifest["flavour"], manifest_attention(manifest), cross_per_source=False
    )
    if HASHES_KEY in manifest:
        manifest[HASHES_KEY][DECODER_FILE] = file_sha256(path)
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    return folder


# ------------------------------------------------------------------------------------------
# numpy runners of the decoding protocol, random log-probabilities, random search options
# ------------------------------------------------------------------------------------------


class FunctionRunner:
    """A numpy runner whose log-probabilities are a function of (source row, generated prefix).

    It keeps the fed tokens of every row, so a wrong ``reorder`` (or a missing one) gives a row
    the distribution of the wrong prefix. It also checks the protocol: beams never cross
    sources, the cache capacity is respected.
    """

    def __init__(self, vocab_size: int, fn):
        self.V = vocab_size
        self.fn = fn  # (source index, prefix tuple) -> log-probs [V]
        self.steps = 0

    def encode(self, input_ids, src_lengths, cache_len, beam_size=1):
        B = input_ids.shape[0]
        assert input_ids.dtype == np.int64 and src_lengths.dtype == np.int64
        return {
            "src": np.repeat(np.arange(B), beam_size),
            "K": beam_size,
            "fed": [[] for _ in range(B * beam_size)],
            "cache_len": cache_len,
        }

    def step(self, state, tokens):
        assert tokens.dtype == np.int64 and tokens.shape == (len(state["fed"]),)
        self.steps += 1
        out = np.empty((len(state["fed"]), self.V), dtype=np.float32)
        for r, tok in enumerate(tokens.tolist()):
            state["fed"][r].append(tok)
            assert len(state["fed"][r]) <= state["cache_len"], "cache overflow"
            out[r] = self.fn(int(state["src"][r]), tuple(state["fed"][r][1:]))
        return out

    def reorder(self, state, beam_index):
        src = state["src"]
        assert all(src[int(i)] == src[r] for r, i in enumerate(beam_index)), "beam crossed sources"
        state["fed"] = [list(state["fed"][int(i)]) for i in beam_index]

    def select(self, state, index):
        """Keep the rows ``index`` (a search dropping finished rows): row r becomes old row index[r]."""
        index = check_select_index(index, len(state["fed"]))
        state["src"] = state["src"][index]
        state["fed"] = [list(state["fed"][int(i)]) for i in index]


def sources(B=2, S=3):
    return np.ones((B, S), dtype=np.int64), np.full(B, S, dtype=np.int64)


def masked_random_fn(V: int, seed: int, sharp: float, p_masked: float):
    """Log-probabilities from a generator keyed by (seed, source, prefix); a fraction of the
    tokens (never all) get -inf, so impossible candidates appear at every step."""

    def fn(src, prefix):
        rng = np.random.default_rng(abs(hash((seed, src) + prefix)) % (2**32))
        logits = sharp * rng.standard_normal(V)
        masked = rng.random(V) < p_masked
        masked[rng.integers(V)] = False
        logits[masked] = -np.inf
        return log_softmax(logits)

    return fn


def draw_options(data, V, B, max_new, hf):
    """Random processor options: a ragged prefix of non-EOS tokens, banned ids, a repetition
    penalty, an n-gram size, a start token, the forced EOS (and transformers' rules)."""
    tokens = [i for i in range(V) if i != 2]  # 2 is the EOS of these tests
    prefix = [data.draw(st.lists(st.sampled_from(tokens), max_size=min(int(m), 3))) for m in max_new]
    options = dict(
        decoder_start_id=data.draw(st.sampled_from([None, 0, V - 1])),
        target_prefix=data.draw(st.sampled_from([None, prefix])),
        banned_ids=data.draw(st.lists(st.sampled_from(tokens), max_size=2, unique=True)),
        repetition_penalty=data.draw(st.sampled_from([1.0, 0.7, 1.6])),
        no_repeat_ngram_size=data.draw(st.sampled_from([0, 1, 2, 3])),
        force_eos_at_budget=data.draw(st.booleans()),
    )
    if hf:
        options["early_stopping"] = data.draw(st.sampled_from(decoding.EARLY_STOPPING))
        options["renormalize_logits"] = data.draw(st.booleans())
    return options


def bad_logit_fn(V: int, bad: float):
    """Logits of -7 everywhere, but ``bad`` (NaN or +inf) at token 5 for source 1 once it has
    generated two tokens: step 2, its first row."""

    def fn(src, prefix):
        out = np.full(V, -7.0)
        if len(prefix) == 2 and src == 1:
            out[5] = bad
        return out

    return fn


def shifted(fn, offset):
    """Logits with positive entries too (the repetition penalty divides those)."""
    return lambda src, prefix: fn(src, prefix) + offset
