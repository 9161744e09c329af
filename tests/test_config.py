"""TransformerConfig: defaults, presets, validation errors, (de)serialisation."""

from __future__ import annotations

import dataclasses
import json

import pytest

from transformer_ext.config import (
    CONFIG_FORMAT_VERSION,
    PRESETS,
    V1_FIELDS,
    V2_FIELDS,
    V3_FIELDS,
    ConfigError,
    TransformerConfig,
    migrate_config,
)

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
    (dict(pad_id=2), ValueError, "pad_id and eos_id must be distinct"),
    # bos_id is the decoder start: Marian starts from <pad>, fairseq models from </s>
    (dict(bos_id=2, eos_id=2), None, None),
    (dict(pad_id=1), None, None),
    (dict(activation="silu"), ValueError, "activation must be one of ['relu', 'gelu', 'swish', 'gelu_tanh']"),
    (dict(activation=None), TypeError, "activation must be a string"),
    (dict(pos_layout="split"), ValueError, "pos_layout must be one of ['interleaved', 'halves']"),
    (dict(pos_frequency="t2t"), ValueError, "pos_frequency must be one of ['paper', 'fairseq']"),
    (dict(pos_offset=-1), ValueError, "pos_offset must be >= 0"),
    (dict(pos_offset=2.0), TypeError, "pos_offset must be an int"),
    (dict(scale_embeddings=1), TypeError, "scale_embeddings must be a bool"),
    (dict(output_bias=True, tie_target_embeddings=False), ValueError, "output_bias=True"),
    (dict(output_bias=True), None, None),
    (dict(pos_frequency="fairseq", d_model=2, n_heads=1), ValueError, "d_model >= 4"),
    (dict(shared_vocab=True), ValueError, "must equal tgt_vocab_size"),
    (
        dict(shared_vocab=True, src_vocab_size=40, tie_target_embeddings=False),
        ValueError,
        "tie_target_embeddings",
    ),
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
    assert (tiny.n_encoder_layers, tiny.n_decoder_layers, tiny.d_model, tiny.n_heads, tiny.d_ff) == (
        2,
        2,
        32,
        4,
        64,
    )
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
    with pytest.raises(ConfigError, match=r"^src.json: unknown key 'n_layer'"):
        TransformerConfig.from_dict(d, source="src.json")


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


# ---------------------------------------------------------------------- the config.json contract
# The seventeen fields written out by hand (not taken from the code under test): what the writer
# before format_version always wrote, and what format_version 1 requires.
FIELDS_WRITTEN_BEFORE_VERSIONING = [
    "bias",
    "bos_id",
    "d_ff",
    "d_model",
    "dropout",
    "eos_id",
    "layer_norm_eps",
    "max_len",
    "n_decoder_layers",
    "n_encoder_layers",
    "n_heads",
    "norm_first",
    "pad_id",
    "shared_vocab",
    "src_vocab_size",
    "tgt_vocab_size",
    "tie_target_embeddings",
]
# The fields format_version 2 added, and the values version 1 implied (today's behaviour),
# written out by hand.
FIELDS_ADDED_IN_V2 = {
    "activation": "relu",
    "scale_embeddings": True,
    "pos_layout": "interleaved",
    "pos_frequency": "paper",
    "pos_offset": 0,
    "output_bias": False,
}
FIELDS_ADDED_IN_V3 = {
    "norm": "layer",
    "scale_attention": True,
    "d_kv": 0,
    "relative_attention_buckets": 0,
    "relative_attention_max_distance": 128,
    "relative_attention_per_layer": False,
    "positions": "sinusoidal",
    "gated_ffn": False,
    "scale_decoder_output": False,
    "embedding_norm": False,
}
# A config.json exactly as the writer before format_version wrote it (json.dump(sort_keys=True)).
UNVERSIONED_TINY = {
    "bias": True,
    "bos_id": 1,
    "d_ff": 64,
    "d_model": 32,
    "dropout": 0.1,
    "eos_id": 2,
    "layer_norm_eps": 1e-05,
    "max_len": 64,
    "n_decoder_layers": 2,
    "n_encoder_layers": 2,
    "n_heads": 4,
    "norm_first": False,
    "pad_id": 0,
    "shared_vocab": False,
    "src_vocab_size": 48,
    "tgt_vocab_size": 40,
    "tie_target_embeddings": True,
}


def test_versions_list_every_field():
    assert CONFIG_FORMAT_VERSION == 3
    assert sorted(V1_FIELDS) == FIELDS_WRITTEN_BEFORE_VERSIONING
    assert sorted(V2_FIELDS) == sorted(FIELDS_WRITTEN_BEFORE_VERSIONING + list(FIELDS_ADDED_IN_V2))
    assert sorted(V3_FIELDS) == sorted(list(V2_FIELDS) + list(FIELDS_ADDED_IN_V3))
    # a field added to the dataclass without a new format version (and migration) fails here
    assert sorted(f.name for f in dataclasses.fields(TransformerConfig)) == sorted(V3_FIELDS)
    d = TransformerConfig.preset("tiny").to_dict()
    assert list(d)[0] == "format_version" and d["format_version"] == 3
    assert sorted(k for k in d if k != "format_version") == sorted(V3_FIELDS)
    # the new fields default to the behaviour older files had
    assert {k: d[k] for k in FIELDS_ADDED_IN_V3} == FIELDS_ADDED_IN_V3


def test_migration_of_the_unversioned_form():
    migrated = migrate_config(dict(UNVERSIONED_TINY), "old.json")
    assert migrated == {"format_version": 3, **UNVERSIONED_TINY, **FIELDS_ADDED_IN_V2, **FIELDS_ADDED_IN_V3}
    assert TransformerConfig.from_dict(dict(UNVERSIONED_TINY)) == TransformerConfig.preset("tiny")


def test_migration_of_version_1():
    migrated = migrate_config({"format_version": 1, **UNVERSIONED_TINY}, "v1.json")
    assert migrated == {"format_version": 3, **UNVERSIONED_TINY, **FIELDS_ADDED_IN_V2, **FIELDS_ADDED_IN_V3}
    # a version-1 file cannot hold a version-2 field
    with pytest.raises(ConfigError, match=r"^v1.json: unknown key 'activation'"):
        migrate_config({"format_version": 1, **UNVERSIONED_TINY, "activation": "gelu"}, "v1.json")


@pytest.mark.parametrize("key", sorted(FIELDS_ADDED_IN_V2))
def test_version_2_requires_its_new_fields(key):
    d = {"format_version": 2, **UNVERSIONED_TINY, **FIELDS_ADDED_IN_V2}
    del d[key]
    with pytest.raises(ConfigError, match=rf"^v2.json: missing key '{key}'; a config of format_version 2"):
        TransformerConfig.from_dict(d, "v2.json")


def test_version_2_round_trip_of_the_new_fields(tmp_path):
    c = TransformerConfig.preset(
        "tiny",
        activation="swish",
        scale_embeddings=False,
        pos_layout="halves",
        pos_frequency="fairseq",
        pos_offset=2,
        output_bias=True,
    )
    c.save_json(tmp_path / "config.json")
    assert TransformerConfig.load_json(tmp_path / "config.json") == c


@pytest.mark.parametrize("key", FIELDS_WRITTEN_BEFORE_VERSIONING)
def test_a_missing_key_is_an_error_in_both_forms(key):
    old = {k: v for k, v in UNVERSIONED_TINY.items() if k != key}
    with pytest.raises(
        ConfigError, match=rf"^old.json: missing key '{key}'; a config without format_version"
    ):
        migrate_config(old, "old.json")
    new = {"format_version": 1, **old}
    with pytest.raises(ConfigError, match=rf"^new.json: missing key '{key}'; a config of format_version 1"):
        TransformerConfig.from_dict(new, "new.json")
    v2 = {"format_version": 2, **old, **FIELDS_ADDED_IN_V2}
    with pytest.raises(ConfigError, match=rf"^v2.json: missing key '{key}'; a config of format_version 2"):
        TransformerConfig.from_dict(v2, "v2.json")


@pytest.mark.parametrize("form", ["unversioned", "v1"])
def test_unknown_keys_are_errors_in_both_forms(form):
    d = (
        dict(UNVERSIONED_TINY, n_layers=2)
        if form == "unversioned"
        else dict(UNVERSIONED_TINY, format_version=1, n_layers=2)
    )
    with pytest.raises(ConfigError, match=r"^f.json: unknown key 'n_layers'"):
        TransformerConfig.from_dict(d, "f.json")


# (key, JSON value of the wrong type, what the message says is expected)
WRONG_TYPES = [
    ("n_heads", True, "an integer"),
    ("d_model", 32.0, "an integer"),
    ("d_ff", "64", "an integer"),
    ("pad_id", None, "an integer"),
    ("dropout", "0.1", "a number"),
    ("dropout", False, "a number"),
    ("layer_norm_eps", [1e-5], "a number"),
    ("norm_first", 0, "true or false"),
    ("bias", "true", "true or false"),
    ("activation", 1, "a string"),
    ("pos_offset", 2.0, "an integer"),
    ("output_bias", 0, "true or false"),
]


@pytest.mark.parametrize("key, value, expected", WRONG_TYPES)
def test_wrong_json_types_name_the_key_and_the_file(key, value, expected):
    forms = [{**UNVERSIONED_TINY, "format_version": 2, **FIELDS_ADDED_IN_V2, key: value}]
    if key in UNVERSIONED_TINY:
        forms += [
            dict(UNVERSIONED_TINY, **{key: value}),
            dict(UNVERSIONED_TINY, format_version=1, **{key: value}),
        ]
    for d in forms:
        with pytest.raises(ConfigError) as info:
            TransformerConfig.from_dict(d, "dir/config.json")
        assert str(info.value).startswith(f"dir/config.json: key '{key}' must be {expected}, got "), (
            info.value
        )


def test_an_integer_is_a_valid_float():
    c = TransformerConfig.from_dict(dict(UNVERSIONED_TINY, format_version=1, dropout=0))
    assert c.dropout == 0.0 and isinstance(c.dropout, float)


@pytest.mark.parametrize(
    "version, match",
    [
        (4, "format_version 4 was written by a newer transformer_ext"),
        (0, "unsupported format_version 0"),
        ("1", "key 'format_version' must be an integer"),
        (True, "key 'format_version' must be an integer"),
        (1.0, "key 'format_version' must be an integer"),
    ],
)
def test_unsupported_versions(version, match):
    with pytest.raises(ConfigError, match=match):
        TransformerConfig.from_dict(dict(UNVERSIONED_TINY, format_version=version), "f.json")


def test_value_errors_name_the_source():
    with pytest.raises(ConfigError, match=r"^f.json: d_model \(30\) must be divisible by n_heads"):
        TransformerConfig.from_dict(dict(UNVERSIONED_TINY, d_model=30), "f.json")
    with pytest.raises(ConfigError, match=r"^f.json: a model config is a JSON object, got list"):
        TransformerConfig.from_dict([1, 2], "f.json")


def test_save_json_writes_version_3(tmp_path):
    path = tmp_path / "config.json"
    TransformerConfig.preset("tiny").save_json(path)
    data = json.loads(path.read_text())
    assert data == {"format_version": 3, **UNVERSIONED_TINY, **FIELDS_ADDED_IN_V2, **FIELDS_ADDED_IN_V3}


def test_migration_of_version_2():
    v2 = {"format_version": 2, **UNVERSIONED_TINY, **FIELDS_ADDED_IN_V2, "activation": "gelu"}
    migrated = migrate_config(v2, "v2.json")
    assert migrated == {**v2, "format_version": 3, **FIELDS_ADDED_IN_V3}
    assert TransformerConfig.from_dict(v2) == TransformerConfig.preset("tiny", activation="gelu")
    with pytest.raises(ConfigError, match=r"^v2.json: unknown key 'norm'"):
        migrate_config({**v2, "norm": "rms"}, "v2.json")


@pytest.mark.parametrize("key", sorted(FIELDS_ADDED_IN_V3))
def test_version_3_requires_its_new_fields(key):
    d = {"format_version": 3, **UNVERSIONED_TINY, **FIELDS_ADDED_IN_V2, **FIELDS_ADDED_IN_V3}
    del d[key]
    with pytest.raises(ConfigError, match=rf"^v3.json: missing key '{key}'; a config of format_version 3"):
        TransformerConfig.from_dict(d, "v3.json")


def test_version_3_round_trip_of_the_t5_and_mbart_fields(tmp_path):
    t5 = TransformerConfig.preset(
        "tiny",
        norm="rms",
        bias=False,
        scale_attention=False,
        d_kv=6,
        relative_attention_buckets=8,
        relative_attention_max_distance=20,
        relative_attention_per_layer=True,
        positions="none",
        activation="gelu_tanh",
        gated_ffn=True,
        scale_embeddings=False,
        scale_decoder_output=True,
    )
    assert t5.d_k == 6 and t5.d_attention == 24
    mbart = TransformerConfig.preset(
        "tiny", positions="learned", pos_offset=2, embedding_norm=True, norm_first=True
    )
    for i, c in enumerate((t5, mbart)):
        c.save_json(tmp_path / f"{i}.json")
        assert TransformerConfig.load_json(tmp_path / f"{i}.json") == c


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(norm="batch"), "norm must be one of"),
        (dict(positions="rotary"), "positions must be one of"),
        (dict(activation="gelu_new"), "activation must be one of"),
        (dict(d_kv=-1), "d_kv must be >= 0"),
        (dict(relative_attention_buckets=7), "even number >= 4"),
        (dict(relative_attention_buckets=-2), "relative_attention_buckets must be >= 0"),
        (dict(relative_attention_buckets=32, relative_attention_max_distance=8), "must exceed"),
        (dict(relative_attention_per_layer=True), "needs relative_attention_buckets > 0"),
        (dict(scale_attention=1), "scale_attention must be a bool"),
    ],
)
def test_invalid_t5_and_mbart_fields(overrides, match):
    with pytest.raises((TypeError, ValueError), match=match):
        TransformerConfig.preset("tiny", **overrides)


def test_head_width_independent_of_d_model():
    # 30 is not divisible by 4 heads, but an explicit d_kv makes it a valid T5-style config
    c = TransformerConfig.preset("tiny", d_model=30, d_kv=8, positions="none")
    assert (c.d_k, c.d_attention) == (8, 32)


def test_load_json_file_errors(tmp_path):
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes(json.dumps(UNVERSIONED_TINY).encode()[:-1] + b', "x": "\xe9"}')
    with pytest.raises(ConfigError, match=r"latin1.json is not UTF-8 text \(byte 0xe9 at offset \d+\)"):
        TransformerConfig.load_json(latin1)
    dup = tmp_path / "dup.json"
    dup.write_text(json.dumps(UNVERSIONED_TINY)[:-1] + ', "n_heads": 8}')
    with pytest.raises(ConfigError, match=r"dup.json: key 'n_heads' appears more than once"):
        TransformerConfig.load_json(dup)
    missing = tmp_path / "missing.json"
    missing.write_text(json.dumps({k: v for k, v in UNVERSIONED_TINY.items() if k != "n_heads"}))
    with pytest.raises(ConfigError, match=r"missing.json: missing key 'n_heads'"):
        TransformerConfig.load_json(missing)
    empty = tmp_path / "empty.json"
    empty.write_bytes(b"")
    with pytest.raises(ConfigError, match="empty.json is not valid JSON"):
        TransformerConfig.load_json(empty)


def test_unversioned_manifest_config_still_loads():
    """Export manifests of the version before format_version embed the unversioned dict as model_config."""
    manifest = {"format": "transformer_ext-onnx", "model_config": dict(UNVERSIONED_TINY)}
    assert TransformerConfig.from_dict(manifest["model_config"], "manifest.json") == TransformerConfig.preset(
        "tiny"
    )
