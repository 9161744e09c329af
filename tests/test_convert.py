"""transformer_ext.convert: checkpoints written by transformers convert, and match transformers.

transformers is the oracle: every checkpoint here is written by ``save_pretrained`` from a config
with the real checkpoints' field values (scaled down) and random weights (tests/hf_checkpoints.py).
Checked: per-step logits of our eager model and of the ONNX Runtime export against transformers'
forward pass (ragged batches, the last position), greedy tokens against ``generate()``, tokenizer
ids and decoded text against transformers' tokenizers, a negative control, and the bad inputs of the
converter (one line, nothing written).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from hf_checkpoints import NLLB_TEST_CODES, sample_lines, write_m2m100, write_marian  # noqa: E402

from transformer_ext.checkpoint import load_model  # noqa: E402
from transformer_ext.convert import (  # noqa: E402
    ConversionError,
    convert_transformers,
    read_generation_defaults,
)
from transformer_ext.decoding import beam_search, greedy_decode  # noqa: E402
from transformer_ext.runtimes import EagerRunner  # noqa: E402
from transformer_ext.tokenizer import load_tokenizer  # noqa: E402

TOL = 1e-4
MAX_POS = 64  # max_position_embeddings of the test configs

FAMILIES = {
    "marian": lambda p: write_marian(p),
    "marian_separate": lambda p: write_marian(p, separate=True, seed=1),
    "marian_multilingual": lambda p: write_marian(p, languages=("fra", "deu", "spa"), seed=2),
    "m2m100": lambda p: write_m2m100(p, seed=3),
    "nllb": lambda p: write_m2m100(p, nllb=True, seed=4),
}
NAMES = sorted(FAMILIES)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> (transformers folder, our converted model folder)."""
    root = tmp_path_factory.mktemp("convert")
    out = {}
    for name, make in FAMILIES.items():
        hf = make(root / f"{name}_hf")
        ours = convert_transformers(hf, root / f"{name}_ours")
        out[name] = (hf, ours)
    return out


class _Exports(dict):
    """name -> export folder (portable flavour) of the converted model, made on first use."""

    def __init__(self, folders, root):
        super().__init__()
        self.folders, self.root = folders, root

    def __missing__(self, name):
        from export.onnx import export_onnx

        # validate=False: the tests compare the exports with transformers themselves
        out = export_onnx(self.folders[name][1], self.root / name, cache_len=MAX_POS, validate=False)
        self[name] = out.output_dir
        return self[name]


@pytest.fixture(scope="module")
def exports(folders, tmp_path_factory):
    return _Exports(folders, tmp_path_factory.mktemp("convert_export"))


@functools.lru_cache(maxsize=None)
def _hf_model_at(hf_dir: str):
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval()


def _hf_model(hf_dir):
    """transformers' model of a folder (loaded once; the tests never modify it)."""
    return _hf_model_at(str(hf_dir))


def _ragged_batch(config, seed: int, lengths=(MAX_POS, 17, 3, 9)):
    """Right-padded random sources (the first of the maximum length) and a decoder input of
    ``MAX_POS`` tokens starting with the decoder start id."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    B, S = len(lengths), int(lengths.max())
    low = 4  # above every special id of both families
    ids = torch.randint(low, config.src_vocab_size - 1, (B, S), generator=g)
    mask = torch.arange(S)[None, :] < lengths[:, None]
    ids = ids.masked_fill(~mask, config.pad_id)
    tgt = torch.randint(low, config.tgt_vocab_size - 1, (B, MAX_POS), generator=g)
    tgt[:, 0] = config.bos_id
    return ids, lengths, mask, tgt


def _reference_logits(hf_dir, ids, mask, tgt):
    with torch.no_grad():
        return _hf_model(hf_dir)(
            input_ids=ids, attention_mask=mask.long(), decoder_input_ids=tgt
        ).logits.numpy()


def _step_logits(runner, ids, lengths, tgt) -> np.ndarray:
    """``[B, T, V]``: the runner's logits of each step, fed the decoder input token by token."""
    state = runner.encode(ids.numpy(), lengths.numpy(), tgt.shape[1], 1)
    return np.stack([np.asarray(runner.step(state, tgt[:, t].numpy())) for t in range(tgt.shape[1])], axis=1)


# ------------------------------------------------------------------------------------------
# logits
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_eager_logits_match_transformers(folders, name):
    hf, ours = folders[name]
    model = load_model(ours)
    ids, lengths, mask, tgt = _ragged_batch(model.config, seed=len(name))
    ref = _reference_logits(hf, ids, mask, tgt)
    with torch.no_grad():
        teacher = model(ids, lengths, tgt).numpy()  # the training path (fused attention)
    steps = _step_logits(EagerRunner(model), ids, lengths, tgt)  # incremental decoding, our ops
    assert np.abs(ref).max() > 1.0  # logits that say something
    for what, ours_logits in (("teacher forcing", teacher), ("decode steps", steps)):
        diff = np.abs(ours_logits - ref)
        worst = np.unravel_index(diff.argmax(), diff.shape)
        assert diff.max() <= TOL, f"{name} {what}: max |diff| {diff.max():.3g} at (row, step, token) {worst}"


@pytest.mark.parametrize("name", NAMES)
def test_onnx_runtime_logits_match_transformers(folders, exports, name):
    from transformer_ext.runtimes import OrtRunner

    hf, ours = folders[name]
    config = load_model(ours).config
    ids, lengths, mask, tgt = _ragged_batch(config, seed=7 + len(name), lengths=(5, MAX_POS, 12))
    ref = _reference_logits(hf, ids, mask, tgt)
    steps = _step_logits(OrtRunner(exports[name]), ids, lengths, tgt)
    diff = np.abs(steps - ref)
    assert diff.max() <= TOL, (
        f"{name}: max |diff| {diff.max():.3g} at {np.unravel_index(diff.argmax(), diff.shape)}"
    )


def test_a_perturbed_weight_breaks_parity(folders, tmp_path):
    """Negative control: the parity check above fails when one weight differs by 0.01."""
    hf, ours = folders["marian"]
    model = load_model(ours)
    with torch.no_grad():
        model.decoder.layers[1].feed_forward.w_2.weight[3, 5] += 0.01
    ids, lengths, mask, tgt = _ragged_batch(model.config, seed=3)
    ref = _reference_logits(hf, ids, mask, tgt)
    steps = _step_logits(EagerRunner(model), ids, lengths, tgt)
    assert np.abs(steps - ref).max() > TOL


# ------------------------------------------------------------------------------------------
# whole decodes
# ------------------------------------------------------------------------------------------

N_SOURCES = 32


def _sources(name: str, tokenizer) -> list[list[int]]:
    lines = sample_lines(N_SOURCES, seed=100 + len(name))
    if name == "marian_multilingual":
        codes = ("fra", "deu", "spa")
        lines = [f">>{codes[i % 3]}<< {line}" for i, line in enumerate(lines)]
    return [tokenizer.encode_source(line) for line in lines]


def _hf_generate(hf_dir, sources, pad_id, eos_id, **kwargs) -> list[list[int]]:
    model = _hf_model(hf_dir)
    S = max(len(s) for s in sources)
    ids = torch.full((len(sources), S), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(sources), S), dtype=torch.int64)
    for i, s in enumerate(sources):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    result = []
    for row in out[:, 1:].tolist():  # without the decoder start
        row = row[: row.index(eos_id)] if eos_id in row else row
        result.append([t for t in row if t != pad_id])
    return result


def _padded(sources, pad_id):
    S = max(len(s) for s in sources)
    ids = np.full((len(sources), S), pad_id, dtype=np.int64)
    for i, s in enumerate(sources):
        ids[i, : len(s)] = s
    return ids, np.array([len(s) for s in sources], dtype=np.int64)


def _hf_kwargs(tokenizer, defaults) -> dict:
    """What a transformers user passes to generate() for a translation (the target language)."""
    if defaults.force_target_language:
        return {"forced_bos_token_id": tokenizer.forced_target_prefix()[0]}
    return {}


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_equal_generate(folders, exports, name):
    from transformer_ext.runtimes import OrtRunner

    hf, ours = folders[name]
    tokenizer = load_tokenizer(ours)
    defaults = read_generation_defaults(ours)
    sources = _sources(name, tokenizer)
    expected = _hf_generate(
        hf, sources, tokenizer.pad_id, tokenizer.eos_id, num_beams=1, **_hf_kwargs(tokenizer, defaults)
    )
    assert len({tuple(e) for e in expected}) >= N_SOURCES // 5  # the outputs vary
    ids, lengths = _padded(sources, tokenizer.pad_id)
    for runner in (EagerRunner(load_model(ours)), OrtRunner(exports[name])):
        got = greedy_decode(runner, ids, lengths, **defaults.search_options(tokenizer, N_SOURCES, beam=False))
        mismatched = [i for i in range(N_SOURCES) if got[i] != expected[i]]
        assert not mismatched, f"{name} {type(runner).__name__}: sources {mismatched} differ"


@pytest.mark.parametrize("name", NAMES)
def test_beam_tokens_equal_generate(folders, exports, name):
    """Beam search with the model's generation config (num_beams 4, transformers' length penalty
    and early stopping) against generate() with the same config."""
    from transformer_ext.runtimes import OrtRunner

    hf, ours = folders[name]
    tokenizer = load_tokenizer(ours)
    defaults = read_generation_defaults(ours)
    assert defaults.num_beams == 4
    sources = _sources(name, tokenizer)
    expected = _hf_generate(
        hf, sources, tokenizer.pad_id, tokenizer.eos_id, **_hf_kwargs(tokenizer, defaults)
    )
    ids, lengths = _padded(sources, tokenizer.pad_id)
    for runner in (EagerRunner(load_model(ours)), OrtRunner(exports[name])):
        got = beam_search(runner, ids, lengths, **defaults.search_options(tokenizer, N_SOURCES))
        tokens = [h[0].tokens for h in got]
        mismatched = [i for i in range(N_SOURCES) if tokens[i] != expected[i]]
        assert not mismatched, f"{name} {type(runner).__name__}: sources {mismatched} differ"


# ------------------------------------------------------------------------------------------
# tokenizers
# ------------------------------------------------------------------------------------------


def _tokenizer_lines(n: int = 300) -> list[str]:
    lines = sample_lines(n, seed=11)
    lines[::37] = [""] * len(lines[::37])  # empty lines
    lines[5::41] = ["  Ünïcödé  ‘quotes’ — 東京 ½ ① ﬁ  "] * len(lines[5::41])
    lines[7::43] = ["12345 67.89 0x1F 3,14159 -0"] * len(lines[7::43])
    return lines


@pytest.mark.parametrize("name", ["marian", "marian_separate", "marian_multilingual"])
def test_marian_tokenizer_matches_transformers(folders, name):
    from transformers import MarianTokenizer as HFMarian

    hf, ours = folders[name]
    theirs = HFMarian.from_pretrained(hf)
    tok = load_tokenizer(ours)
    lines = _tokenizer_lines()
    if name == "marian_multilingual":
        lines = [f">>{('fra', 'deu', 'spa')[i % 3]}<< {line}" for i, line in enumerate(lines)]
    for line in lines:
        assert tok.encode_source(line) == theirs(line).input_ids, line
        target = theirs(text_target=line).input_ids
        assert tok.encode_target(line) + [tok.eos_id] == target, line
        assert tok.decode_target(target) == theirs.decode(target, skip_special_tokens=True), line
    rng = np.random.default_rng(0)
    for _ in range(100):  # arbitrary generated ids (unk included)
        ids = rng.integers(0, tok.tgt_vocab_size, size=rng.integers(1, 20)).tolist()
        # without </s>, and without <pad> (never generated: banned): with separate vocabularies
        # transformers 5.24 takes <pad>'s id from the source vocabulary and decodes the target's
        # <pad> as the text "<pad>"
        ids = [i for i in ids if i not in (tok.eos_id, tok.pad_id)]
        assert tok.decode_target(ids) == theirs.decode(ids, skip_special_tokens=True), ids


def test_m2m100_tokenizer_matches_transformers(folders):
    from transformers import M2M100Tokenizer as HFM2M

    hf, ours = folders["m2m100"]
    tok = load_tokenizer(ours)
    for src, tgt in (("en", "de"), ("fr", "zh"), ("zu", "af")):
        theirs = HFM2M.from_pretrained(hf, src_lang=src, tgt_lang=tgt)
        mine = tok.with_languages(src, tgt)
        assert mine.forced_target_prefix() == [theirs.get_lang_id(tgt)]
        for line in _tokenizer_lines(200):
            assert mine.encode_source(line) == theirs(line).input_ids, line
            target = theirs(text_target=line).input_ids
            assert mine.encode_target(line) + [tok.eos_id] == target, line
            # transformers 5.24 keeps the language token ("__de__") in the decoded text (its
            # language tokens are not registered as special); ours drops it, as fairseq does
            assert mine.decode_target(target) == theirs.decode(target[1:], skip_special_tokens=True), line


@pytest.mark.parametrize("legacy", [False, True])
def test_nllb_tokenizer_follows_fairseq_ids(folders, tmp_path, legacy):
    """transformers' NllbTokenizer (a tokenizers-library tokenizer in 5.x) cannot read a
    SentencePiece file here, so the oracle is fairseq's rule written out with sentencepiece:
    piece id + 1, <s> 0 <pad> 1 </s> 2 <unk> 3, languages after the pieces in the listed order;
    ``[lang] pieces </s>`` (legacy: ``pieces </s> [lang]``)."""
    import sentencepiece as spm

    hf, ours = folders["nllb"]
    if legacy:
        hf2 = tmp_path / "nllb_legacy"
        shutil.copytree(hf, hf2)
        cfg = json.loads((hf2 / "tokenizer_config.json").read_text())
        cfg["legacy_behaviour"] = True
        (hf2 / "tokenizer_config.json").write_text(json.dumps(cfg))
        ours = convert_transformers(hf2, tmp_path / "ours")
    sp = spm.SentencePieceProcessor(model_file=str(hf / "sentencepiece.bpe.model"))
    lang = {c: sp.get_piece_size() + 1 + i for i, c in enumerate(NLLB_TEST_CODES)}
    tok = load_tokenizer(ours).with_languages("deu_Latn", "zho_Hans")
    for line in _tokenizer_lines(200):
        pieces = [sp.piece_to_id(p) for p in sp.encode(line, out_type=str)]
        body = [p + 1 if p > 2 else 3 for p in pieces]
        expected = body + [2, lang["deu_Latn"]] if legacy else [lang["deu_Latn"]] + body + [2]
        assert tok.encode_source(line) == expected, line
        assert tok.encode_target(line) == [lang["zho_Hans"]] + body
        expected_text = sp.decode([p for p in pieces if p != sp.unk_id()]).strip()  # <unk> skipped
        assert tok.decode_target([lang["zho_Hans"]] + body + [2, 9, 9]) == expected_text


def test_language_selection_errors_list_the_codes(folders):
    from transformer_ext.tokenizer import TokenizerError

    multi = load_tokenizer(folders["marian_multilingual"][1])
    with pytest.raises(TokenizerError, match=r"needs a target language.*>>fra<<, >>deu<<, >>spa<<"):
        multi.encode_source("hello world")
    with pytest.raises(TokenizerError, match=r"unknown target language 'ita'; this model knows >>fra<<"):
        multi.with_languages(target_lang="ita")
    assert multi.with_languages(target_lang="deu").encode_source("hello")[0] == multi.encoder[">>deu<<"]
    single = load_tokenizer(folders["marian"][1])
    with pytest.raises(TokenizerError, match="knows no target-language codes"):
        single.with_languages(target_lang="fra")
    m2m = load_tokenizer(folders["m2m100"][1])
    with pytest.raises(TokenizerError, match=r"unknown source language 'xx'; this model knows af, am, ar"):
        m2m.with_languages(source_lang="xx")
    nllb = load_tokenizer(folders["nllb"][1])
    with pytest.raises(
        TokenizerError, match=r"unknown target language 'fr'; this model knows eng_Latn, fra_Latn"
    ):
        nllb.with_languages(target_lang="fr")


# ------------------------------------------------------------------------------------------
# the folder written
# ------------------------------------------------------------------------------------------


def test_converted_folder_contents(folders):
    hf, ours = folders["marian_separate"]
    names = sorted(os.listdir(ours))
    assert names == sorted(
        [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "source.spm",
            "target.spm",
            "vocab.json",
            "target_vocab.json",
            "generation_defaults.json",
            "provenance.json",
        ]
    )
    prov = json.loads((ours / "provenance.json").read_text())
    assert prov["model_type"] == "marian" and prov["source"] == str(Path(hf).resolve())
    assert prov["upcast_to_float32"] is False and "model.safetensors" in prov["files"]
    import hashlib

    assert prov["files"]["vocab.json"] == hashlib.sha256((hf / "vocab.json").read_bytes()).hexdigest()
    gen = read_generation_defaults(ours)
    pad = json.loads((hf / "config.json").read_text())["pad_token_id"]
    assert gen.num_beams == 4 and gen.banned_ids == (pad,) and gen.force_eos_at_max_length
    config = json.loads((ours / "config.json").read_text())
    assert (config["activation"], config["pos_layout"], config["output_bias"], config["bos_id"]) == (
        "swish",
        "halves",
        True,
        pad,
    )


def test_float16_pickle_checkpoint_is_upcast(tmp_path):
    """An older layout: pytorch_model.bin in float16, read with weights_only=True and upcast."""
    hf = write_marian(tmp_path / "hf16", dtype=torch.float16, weights="bin", seed=5)
    assert (hf / "pytorch_model.bin").is_file() and not (hf / "model.safetensors").exists()
    ours = convert_transformers(hf, tmp_path / "ours")
    prov = json.loads((ours / "provenance.json").read_text())
    assert prov["weights_dtype"] == "float16" and prov["upcast_to_float32"] is True
    model = load_model(ours)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    from transformers import AutoModelForSeq2SeqLM

    ref = AutoModelForSeq2SeqLM.from_pretrained(hf).eval().float()
    with torch.no_grad():  # the stored float16 sinusoids, recomputed in float32 by transformers itself
        for stack in (ref.model.encoder, ref.model.decoder):
            stack.embed_positions.weight.copy_(stack.embed_positions.create_weight())
    ids, lengths, mask, tgt = _ragged_batch(model.config, seed=1, lengths=(6, 3))
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask.long(), decoder_input_ids=tgt[:, :8]).logits.numpy()
        got = model(ids, lengths, tgt[:, :8]).numpy()
    assert np.abs(got - expected).max() <= TOL


# ------------------------------------------------------------------------------------------
# bad input: one line, nothing written
# ------------------------------------------------------------------------------------------


def _edit_json(path: Path, **changes):
    data = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    path.write_text(json.dumps(data))


def _drop_tensor(hf: Path, name: str, add: str | None = None):
    from safetensors.torch import load_file, save_file

    tensors = load_file(hf / "model.safetensors")
    if add:
        tensors[add] = torch.zeros(3)
    else:
        del tensors[name]
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})


BAD = [
    (
        "no_config",
        lambda hf: (hf / "config.json").unlink(),
        "is not a transformers checkpoint folder: it has no config.json",
    ),
    (
        "bart",
        lambda hf: _edit_json(hf / "config.json", model_type="bart"),
        "model type 'bart' is not supported; supported: marian, m2m_100",
    ),
    (
        "causal",
        lambda hf: _edit_json(hf / "config.json", architectures=["MarianForCausalLM"]),
        "a marian translation model is MarianMTModel",
    ),
    (
        "activation",
        lambda hf: _edit_json(hf / "config.json", activation_function="tanh"),
        'unsupported architecture option activation_function = "tanh"',
    ),
    (
        "pre_ln_marian",
        lambda hf: _edit_json(hf / "config.json", normalize_before=True),
        "unsupported architecture option normalize_before = true",
    ),
    (
        "heads",
        lambda hf: _edit_json(hf / "config.json", decoder_attention_heads=2),
        "encoder_attention_heads = 4 and decoder_attention_heads = 2 differ",
    ),
    ("missing_field", lambda hf: _edit_json(hf / "config.json", d_model=None), "missing field 'd_model'"),
    (
        "no_weights",
        lambda hf: (hf / "model.safetensors").unlink(),
        "holds no weights: expected one of model.safetensors",
    ),
    (
        "missing_tensor",
        lambda hf: _drop_tensor(hf, "model.decoder.layers.0.fc2.weight"),
        "missing tensors ['model.decoder.layers.0.fc2.weight']",
    ),
    (
        "unexpected_tensor",
        lambda hf: _drop_tensor(hf, "", add="model.encoder.layernorm_embedding.weight"),
        "unexpected tensors ['model.encoder.layernorm_embedding.weight']",
    ),
    ("no_spm", lambda hf: (hf / "source.spm").unlink(), "source.spm not found"),
    (
        "vocab_size",
        lambda hf: _edit_json(hf / "vocab.json", **{"extra▁piece": 10_000}),
        "the tokenizer has a vocabulary of",
    ),
    (
        "config_vocab",
        lambda hf: _edit_json(hf / "config.json", vocab_size=200, decoder_vocab_size=200),
        "vocabulary",
    ),
    (
        "beam_sampling",
        lambda hf: _edit_json(hf / "generation_config.json", do_sample=True),
        "unsupported generation option do_sample",
    ),
]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return write_marian(tmp_path_factory.mktemp("pristine") / "hf", layers=1, d_model=16, heads=4, d_ff=16)


@pytest.mark.parametrize("case, spoil, message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_and_writes_nothing(pristine, tmp_path, capsys, case, spoil, message):
    from transformer_ext.convert.__main__ import main

    hf = tmp_path / "hf"
    shutil.copytree(pristine, hf)
    spoil(hf)
    out = tmp_path / "out" / "model"
    with pytest.raises(ConversionError) as info:
        convert_transformers(hf, out)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert main(["transformers", "--model", str(hf), "--output-dir", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("transformer-ext-convert: error: ") and message in err
    assert not out.exists() and (not out.parent.exists() or not os.listdir(out.parent))


def test_an_existing_output_folder_is_never_touched(pristine, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="already exists"):
        convert_transformers(pristine, out)
    assert os.listdir(out) == ["keep.txt"]


def test_cli_converts(pristine, tmp_path, capsys):
    from transformer_ext.convert.__main__ import main

    assert main(["transformers", "--model", str(pristine), "--output-dir", str(tmp_path / "m")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    assert load_model(tmp_path / "m").config.activation == "swish"


# ------------------------------------------------------------------------------------------
# translating text without torch
# ------------------------------------------------------------------------------------------

_TORCH_FREE = """
import json, sys
sys.modules["torch"] = None  # a deployment without torch
import numpy as np
from transformer_ext.convert.generation import read_generation_defaults
from transformer_ext.decoding import beam_search
from transformer_ext.runtimes import OrtRunner
from transformer_ext.tokenizer import load_tokenizer

folder, src_lang, tgt_lang, texts = sys.argv[1], sys.argv[2] or None, sys.argv[3] or None, json.loads(sys.argv[4])
tok = load_tokenizer(folder).with_languages(src_lang, tgt_lang)
gen = read_generation_defaults(folder)
sources = [tok.encode_source(t) for t in texts]
ids = np.full((len(sources), max(map(len, sources))), tok.pad_id, dtype=np.int64)
for i, s in enumerate(sources):
    ids[i, : len(s)] = s
lengths = np.array([len(s) for s in sources], dtype=np.int64)
hyps = beam_search(OrtRunner(folder), ids, lengths, **gen.search_options(tok, len(sources)))
print(json.dumps([tok.decode_target(h[0].tokens) for h in hyps], ensure_ascii=False))
assert "torch" not in [m.split(".")[0] for m in sys.modules if sys.modules[m] is not None]
"""


@pytest.mark.parametrize("name, src, tgt", [("m2m100", "fr", "de"), ("marian_multilingual", "", "spa")])
def test_torch_free_translation_equals_transformers(folders, exports, name, src, tgt):
    """Text in, text out from the export folder alone (ONNX Runtime, the tokenizer, the generation
    defaults; torch unimportable) equals transformers' tokenizer + generate() + decode."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    hf, _ = folders[name]
    texts = sample_lines(8, seed=77)
    theirs = AutoTokenizer.from_pretrained(hf, **({"src_lang": src, "tgt_lang": tgt} if src else {}))
    hf_texts = [f">>{tgt}<< {t}" for t in texts] if not src else texts
    enc = theirs(hf_texts, return_tensors="pt", padding=True)
    kwargs = {"forced_bos_token_id": theirs.get_lang_id(tgt)} if src else {}
    with torch.no_grad():
        out = _hf_model(hf).generate(**enc, **kwargs)

    # without the decoder start; for M2M100 only the ids of vocab.json: transformers 5.24 prints
    # the language tokens ("__de__") and the made-up words ("<unk>") that ours leave out
    def kept(t: int) -> bool:
        return t in theirs.decoder if src else True

    expected = [
        theirs.decode([t for t in row[1:] if kept(t)], skip_special_tokens=True) for row in out.tolist()
    ]
    assert any(expected)
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run(
        [sys.executable, "-c", _TORCH_FREE, str(exports[name]), src, tgt, json.dumps(texts)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout) == expected


@pytest.mark.parametrize("activation, op", [("gelu", "Erf"), ("swish", "Sigmoid")])
def test_activations_export_as_standard_ops(tmp_path, activation, op):
    """gelu and swish in the portable graphs: Erf / Sigmoid with Mul (no Gelu, no contrib op), and
    ONNX Runtime's step logits equal to the eager model's (torch's F.gelu / F.silu)."""
    import onnx

    from export.onnx import export_onnx
    from transformer_ext.checkpoint import save_model
    from transformer_ext.config import TransformerConfig
    from transformer_ext.model import Transformer
    from transformer_ext.runtimes import OrtRunner

    config = TransformerConfig.preset(
        "tiny", activation=activation, dropout=0.0, pos_layout="halves", pos_frequency="fairseq", pos_offset=2
    )
    torch.manual_seed(0)
    model = Transformer(config).eval()
    save_model(model, tmp_path / "model")
    out = export_onnx(tmp_path / "model", tmp_path / "onnx", validate=False).output_dir
    for name in ("encoder.onnx", "decoder_step.onnx"):
        ops = {n.op_type for n in onnx.load(out / name).graph.node}
        assert "Gelu" not in ops and all(
            n.domain in ("", "ai.onnx") for n in onnx.load(out / name).graph.node
        )
    assert op in {n.op_type for n in onnx.load(out / "decoder_step.onnx").graph.node}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, config.src_vocab_size, (2, 7), generator=g)
    lengths = torch.tensor([7, 4])
    tgt = torch.randint(4, config.tgt_vocab_size, (2, 9), generator=g)
    eager = _step_logits(EagerRunner(model), ids, lengths, tgt)
    ort_logits = _step_logits(OrtRunner(out), ids, lengths, tgt)
    assert np.abs(eager - ort_logits).max() <= 1e-5
