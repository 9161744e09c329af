"""The T5 family (T5 v1.0, T5 v1.1, mT5, UMT5, MADLAD-400) converted from transformers checkpoints:
eager logits, greedy and beam tokens, tokenizer ids, all against transformers itself (checkpoints
written by transformers from small configs with the real models' field values, random weights,
SentencePiece models trained here), negative controls, and the refusals."""

from __future__ import annotations

import functools
import json
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from hf_checkpoints import MADLAD_TEST_CODES, sample_lines, transformers_t5_tokenizer, write_t5  # noqa: E402

from transformer_ext import model as model_module  # noqa: E402
from transformer_ext.checkpoint import load_model  # noqa: E402
from transformer_ext.convert import ConversionError, convert_transformers, read_generation_defaults  # noqa: E402
from transformer_ext.decoding import beam_search, greedy_decode  # noqa: E402
from transformer_ext.runtimes import EagerRunner  # noqa: E402
from transformer_ext.tokenizer import TokenizerError, load_tokenizer  # noqa: E402

FAMILIES = {
    "t5_v1_0": dict(variant="t5", seed=1),
    "t5_v1_1": dict(variant="t5_v1_1", seed=2),
    "mt5": dict(variant="mt5", seed=3),
    "umt5": dict(variant="umt5", seed=4),
    "madlad": dict(variant="t5_v1_1", madlad=True, seed=5),
}
NAMES = sorted(FAMILIES)
T = 40  # decoder positions of the logits tests (beyond max_distance 20: the far buckets are used)
N_SOURCES = 8


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("t5")
    out = {}
    for name, kwargs in FAMILIES.items():
        hf = write_t5(root / f"{name}_hf", **kwargs)
        out[name] = (hf, convert_transformers(hf, root / f"{name}_ours"))
    return out


@functools.lru_cache(maxsize=None)
def _hf_model_at(path: str, dtype=torch.float32):
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(path).eval().to(dtype)


def _batch(config, seed: int, lengths=(45, 17, 3, 9)):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    B, S = len(lengths), int(lengths.max())
    ids = torch.randint(3, config.src_vocab_size, (B, S), generator=g)
    mask = torch.arange(S)[None, :] < lengths[:, None]
    ids = ids.masked_fill(~mask, config.pad_id)
    tgt = torch.randint(3, config.tgt_vocab_size, (B, T), generator=g)
    tgt[:, 0] = config.bos_id
    return ids, lengths, mask, tgt


def _reference(hf, ids, mask, tgt, dtype=torch.float32):
    with torch.no_grad():
        return _hf_model_at(str(hf), dtype)(
            input_ids=ids, attention_mask=mask.long(), decoder_input_ids=tgt
        ).logits


def _steps(model, ids, lengths, tgt) -> np.ndarray:
    runner = EagerRunner(model)
    state = runner.encode(ids.numpy(), lengths.numpy(), tgt.shape[1], 1)
    return np.stack([np.asarray(runner.step(state, tgt[:, t].numpy())) for t in range(tgt.shape[1])], axis=1)


def _tol(ref) -> float:
    """float32 rounding of two implementations of a random network: 1e-4 of the logits' range
    (float64 agrees to 1e-9: test_float64_logits_equal_transformers)."""
    return 1e-4 * max(1.0, float(np.abs(np.asarray(ref)).max()))


# ------------------------------------------------------------------------------------------
# the converted models
# ------------------------------------------------------------------------------------------


def test_converted_configs(folders):
    configs = {name: load_model(folders[name][1]).config for name in NAMES}
    for c in configs.values():
        assert (c.norm, c.bias, c.scale_attention, c.positions, c.d_k, c.d_model // c.n_heads) == (
            "rms",
            False,
            False,
            "none",
            12,
            8,
        )
        assert (c.pad_id, c.bos_id, c.eos_id, c.relative_attention_buckets) == (0, 0, 1, 8)
    v10 = configs["t5_v1_0"]
    assert (v10.tie_target_embeddings, v10.scale_decoder_output, v10.gated_ffn, v10.activation) == (
        True,
        True,
        False,
        "relu",
    )
    for name in ("t5_v1_1", "mt5", "umt5", "madlad"):
        c = configs[name]
        assert (c.tie_target_embeddings, c.scale_decoder_output, c.gated_ffn, c.activation) == (
            False,
            False,
            True,
            "gelu_tanh",
        )
        assert c.relative_attention_per_layer == (name == "umt5")
        # transformers keeps the checkpoint's own lm_head (the untied head is what is compared)
        hf = _hf_model_at(str(folders[name][0]))
        assert not torch.equal(hf.lm_head.weight, hf.shared.weight)


@pytest.mark.parametrize("name", NAMES)
def test_eager_logits_match_transformers(folders, name):
    """Teacher forcing (fused attention with the bias) and decode steps (decode attention with the
    bias) on a ragged batch, every position up to the last."""
    hf, ours = folders[name]
    model = load_model(ours)
    ids, lengths, mask, tgt = _batch(model.config, seed=len(name))
    ref = _reference(hf, ids, mask, tgt).numpy()
    with torch.no_grad():
        teacher = model(ids, lengths, tgt).numpy()
    steps = _steps(model, ids, lengths, tgt)
    assert np.abs(ref).max() > 1.0
    for what, got in (("teacher forcing", teacher), ("decode steps", steps)):
        diff = np.abs(got - ref)
        assert diff.max() <= _tol(ref), (
            f"{name} {what}: max |diff| {diff.max():.3g} at {np.unravel_index(diff.argmax(), diff.shape)}"
        )


@pytest.mark.parametrize("name", ["t5_v1_0", "umt5"])
def test_float64_logits_equal_transformers(folders, name):
    """In float64 the two implementations agree to rounding: the same function, not a near one."""
    hf, ours = folders[name]
    model = load_model(ours).double()
    ids, lengths, mask, tgt = _batch(model.config, seed=9)
    ref = _reference(hf, ids, mask, tgt, torch.float64)
    with torch.no_grad():
        got = model(ids, lengths, tgt)
    assert (got - ref).abs().max() < 1e-9


def _control_diff(folders, monkeypatch, patch) -> tuple[float, float]:
    hf, ours = folders["t5_v1_0"]
    patch(monkeypatch)
    model = load_model(ours)
    ids, lengths, mask, tgt = _batch(model.config, seed=3)
    ref = _reference(hf, ids, mask, tgt).numpy()
    with torch.no_grad():
        got = model(ids, lengths, tgt).numpy()
    return float(np.abs(got - ref).max()), _tol(ref)


def test_negative_control_one_wrong_bucket(folders, monkeypatch):
    """Distance 5 (a far bucket of the 8-bucket model) moved one bucket up: parity fails."""
    real = model_module.relative_position_bucket

    def shifted(rel, bidirectional, n, max_distance):
        out = real(rel, bidirectional, n, max_distance)
        return torch.where(
            rel == -5, torch.clamp(out + 1, max=n - 1 if not bidirectional else n // 2 - 1), out
        )

    diff, tol = _control_diff(
        folders, monkeypatch, lambda m: m.setattr(model_module, "relative_position_bucket", shifted)
    )
    assert diff > 100 * tol


def test_negative_control_wrong_bias_direction(folders, monkeypatch):
    """The relative position taken as query minus key (the other direction): parity fails."""
    real = model_module.relative_position_bucket

    def flipped(rel, bidirectional, n, max_distance):
        return real(-rel, bidirectional, n, max_distance)

    diff, tol = _control_diff(
        folders, monkeypatch, lambda m: m.setattr(model_module, "relative_position_bucket", flipped)
    )
    assert diff > 100 * tol


# ------------------------------------------------------------------------------------------
# whole decodes
# ------------------------------------------------------------------------------------------


def _sources(name, tokenizer) -> list[list[int]]:
    lines = sample_lines(N_SOURCES, seed=200 + len(name))
    if name == "madlad":
        lines = [f"<2{MADLAD_TEST_CODES[i % 4]}> {line}" for i, line in enumerate(lines)]
    return [tokenizer.encode_source(line) for line in lines]


def _generate(hf, sources, **kwargs) -> list[list[int]]:
    S = max(len(s) for s in sources)
    ids = torch.zeros((len(sources), S), dtype=torch.int64)
    mask = torch.zeros((len(sources), S), dtype=torch.int64)
    for i, s in enumerate(sources):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    with torch.no_grad():
        out = _hf_model_at(str(hf)).generate(input_ids=ids, attention_mask=mask, **kwargs)
    # without the decoder start, up to </s> (T5 may generate <pad> itself: only what follows </s> is padding)
    return [row[: row.index(1)] if 1 in row else row for row in out[:, 1:].tolist()]


def _padded(sources):
    S = max(len(s) for s in sources)
    ids = np.zeros((len(sources), S), dtype=np.int64)
    for i, s in enumerate(sources):
        ids[i, : len(s)] = s
    return ids, np.array([len(s) for s in sources], dtype=np.int64)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_and_beam_tokens_equal_generate(folders, name):
    hf, ours = folders[name]
    tokenizer = load_tokenizer(ours)
    defaults = read_generation_defaults(ours)
    assert defaults.num_beams == 4
    sources = _sources(name, tokenizer)
    ids, lengths = _padded(sources)
    runner = EagerRunner(load_model(ours))
    greedy = _generate(hf, sources, num_beams=1)
    assert len({tuple(e) for e in greedy}) >= N_SOURCES // 2  # the outputs vary
    got = greedy_decode(runner, ids, lengths, **defaults.search_options(tokenizer, N_SOURCES, beam=False))
    assert [list(g) for g in got] == greedy, f"{name}: greedy tokens differ"
    beams = _generate(hf, sources)
    got = beam_search(runner, ids, lengths, **defaults.search_options(tokenizer, N_SOURCES))
    assert [h[0].tokens for h in got] == beams, f"{name}: beam tokens differ"


# ------------------------------------------------------------------------------------------
# tokenizers
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["t5_v1_0", "madlad"])
def test_tokenizer_ids_equal_transformers(folders, name):
    hf, ours = folders[name]
    theirs = transformers_t5_tokenizer(hf)
    tokenizer = load_tokenizer(ours)
    lines = sample_lines(200, seed=7)
    if name == "madlad":
        lines = [f"<2{MADLAD_TEST_CODES[i % 4]}> {line}" for i, line in enumerate(lines)]
    for line in lines:
        assert tokenizer.encode_source(line) == theirs(line)["input_ids"], line
        ids = theirs(line)["input_ids"]
        assert tokenizer.decode_target(ids) == theirs.decode(ids, skip_special_tokens=True), line


def test_madlad_target_language(folders):
    _, ours = folders["madlad"]
    tokenizer = load_tokenizer(ours)
    assert sorted(tokenizer.languages) == sorted(MADLAD_TEST_CODES)
    with pytest.raises(
        TokenizerError, match=r"give --target-lang \(one of de, fr, es, zh\) or start each source"
    ):
        tokenizer.encode_source("the house")
    de = tokenizer.with_languages(target_lang="de")
    assert de.encode_source("the house") == tokenizer.encode_source("<2de> the house")
    assert de.encode_source("<2fr> the house") == tokenizer.encode_source("<2fr> the house")
    with pytest.raises(TokenizerError, match="unknown target language 'xx'"):
        tokenizer.with_languages(target_lang="xx")
    plain = load_tokenizer(folders["t5_v1_0"][1])
    assert plain.encode_source("the house")[-1] == 1  # </s> appended, no language needed


# ------------------------------------------------------------------------------------------
# refusals
# ------------------------------------------------------------------------------------------


def _edited_copy(folders, tmp_path, edit_config=None, edit_tensors=None):
    src = folders["t5_v1_1"][0]
    dst = tmp_path / "hf"
    shutil.copytree(src, dst)
    if edit_config:
        data = json.loads((dst / "config.json").read_text())
        edit_config(data)
        (dst / "config.json").write_text(json.dumps(data))
    if edit_tensors:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(dst / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda d: d.update(feed_forward_proj="gated-silu", dense_act_fn="silu"),
            'unsupported architecture option feed_forward_proj = "gated-silu"',
        ),
        (lambda d: d.update(model_type="t5gemma"), "model type 't5gemma' is not supported"),
    ],
)
def test_unsupported_options_are_one_line_and_write_nothing(folders, tmp_path, edit, message):
    hf = _edited_copy(folders, tmp_path, edit_config=edit)
    out = tmp_path / "out"
    with pytest.raises(ConversionError) as info:
        convert_transformers(hf, out)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert not out.exists()


def test_a_relative_bias_table_of_the_wrong_shape_is_named(folders, tmp_path):
    name = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"

    def cut(tensors):
        tensors[name] = tensors[name][:6].contiguous()

    hf = _edited_copy(folders, tmp_path, edit_tensors=cut)
    with pytest.raises(
        ConversionError, match=rf"tensor {name} has shape \[6, 4\], expected \[relative_attention_num_buckets"
    ):
        convert_transformers(hf, tmp_path / "out")
    assert not (tmp_path / "out").exists()
