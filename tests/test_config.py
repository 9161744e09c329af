"""TransformerConfig: defaults, presets, validation errors, (de)serialisation."""

from __future__ import annotations

import dataclasses
import json

import pytest

from transformer_ext.config import PRESETS, TransformerConfig

PRESET_NAMES = sorted(PRESETS)

# (overrides, exception type, a fragment the message must contain)
INVALID = [
    (dict(d_model=30, n_heads=4), ValueError, "divisible by n_heads"),
    (dict(d_model=9, n_heads=3), ValueError, "even"),
    (dict(n_heads=0), ValueError, "n_heads must be positive"),
    (dict(d_ff=0), ValueError, "d_ff must be positive"),
    (dict(n_encoder_layers=0), ValueError, "n_encoder_layers"),
    (dict(n_decoder_layers=-1), ValueError, "n_decoder_layers"),
    (dict(max_len=0), ValueError, "max_len"),
    (dict(src_vocab_size=0), ValueError, "src_vocab_size"),
    (dict(dropout=1.0), ValueError, "dropout"),
    (dict(dropout=-0.1), ValueError, "dropout"),
    (dict(layer_norm_eps=0.0), ValueError, "layer_norm_eps"),
    (dict(eos_id=40), ValueError, "eos_id = 40 is outside the target vocabulary"),
    (dict(bos_id=-1), ValueError, "bos_id"),
    (dict(pad_id=45, src_vocab_size=50, tgt_vocab_size=50, bos_id=1, eos_id=2), None, None),
    (dict(pad_id=45, src_vocab_size=40, tgt_vocab_size=50), ValueError, "source vocabulary"),
    (dict(bos_id=2, eos_id=2), ValueError, "distinct"),
    (dict(pad_id=1), ValueError, "distinct"),
    (dict(shared_vocab=True), ValueError, "must equal tgt_vocab_size"),
    (dict(shared_vocab=True, src_vocab_size=40, tie_target_embeddings=False), ValueError,
     "tie_target_embeddings"),
    (dict(d_model=32.0), TypeError, "d_model must be an int"),
    (dict(n_heads=True), TypeError, "n_heads must be an int"),
    (dict(norm_first=1), TypeError, "norm_first must be a bool"),
    (dict(dropout="0.1"), TypeError, "dropout must be a float"),
]


def test_defaults_are_the_paper_base_model():
    c = TransformerConfig()
    assert (c.d_model, c.n_heads, c.n_encoder_layers, c.n_decoder_layers, c.d_ff) == (512, 8, 6, 6, 2048)
    assert c.dropout == 0.1 and c.norm_first is False and c.d_k == 64


def test_every_field_has_a_default():
    for f in dataclasses.fields(TransformerConfig):
        assert f.default is not dataclasses.MISSING, f.name


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_presets_are_valid(name):
    c = TransformerConfig.preset(name)
    assert c.to_dict() == {**TransformerConfig().to_dict(), **PRESETS[name]}


def test_preset_base_and_tiny():
    base = TransformerConfig.preset("base")
    assert (base.src_vocab_size, base.tgt_vocab_size, base.d_model, base.d_ff) == (8000, 8000, 512, 2048)
    tiny = TransformerConfig.preset("tiny", norm_first=True)
    assert (tiny.n_encoder_layers, tiny.n_decoder_layers, tiny.d_model, tiny.n_heads, tiny.d_ff) == (2, 2, 32, 4, 64)
    assert tiny.norm_first is True and tiny.d_k == 8


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        TransformerConfig.preset("huge")


@pytest.mark.parametrize("overrides,exc,fragment", INVALID)
def test_validation(overrides, exc, fragment):
    if exc is None:
        TransformerConfig.preset("tiny", **overrides)  # a valid corner case
        return
    with pytest.raises(exc) as info:
        TransformerConfig.preset("tiny", **overrides)
    assert fragment in str(info.value)


def test_validate_catches_later_mutation():
    c = TransformerConfig.preset("tiny")
    c.n_heads = 5
    with pytest.raises(ValueError, match="divisible"):
        c.validate()


def test_dict_round_trip():
    c = TransformerConfig.preset("tiny", norm_first=True, dropout=0.0, bias=False)
    d = c.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert TransformerConfig.from_dict(d) == c


def test_from_dict_rejects_unknown_keys():
    d = TransformerConfig.preset("tiny").to_dict()
    d["n_layer"] = 3
    with pytest.raises(ValueError, match=r"unknown TransformerConfig keys \['n_layer'\]"):
        TransformerConfig.from_dict(d)


def test_json_round_trip(tmp_path):
    c = TransformerConfig.preset("tiny", shared_vocab=True, src_vocab_size=40)
    path = tmp_path / "config.json"
    c.save_json(path)
    assert TransformerConfig.load_json(path) == c
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left


def test_load_json_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.json"):
        TransformerConfig.load_json(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json is not valid JSON"):
        TransformerConfig.load_json(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({**TransformerConfig.preset("tiny").to_dict(), "n_heads": 5}))
    with pytest.raises(ValueError, match="wrong.json.*divisible"):
        TransformerConfig.load_json(wrong)
