"""Model directories: round trip, tied weights stored once, and every kind of bad checkpoint."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from transformer_ext.checkpoint import CONFIG_NAME, WEIGHTS_NAME, load_model, save_model
from transformer_ext.config import ConfigError

DEMO_DIR = Path(__file__).resolve().parents[1] / "transformer_ext" / "demo_model"

from helpers import make_batch, make_model

NORM_FIRST = [False, True]
TYING = {
    "tied": dict(),
    "untied": dict(tie_target_embeddings=False),
    "shared_vocab": dict(shared_vocab=True, src_vocab_size=40),
}


def stored_keys(directory) -> set[str]:
    with safe_open(os.path.join(directory, WEIGHTS_NAME), framework="pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("tying", list(TYING))
@pytest.mark.parametrize("norm_first", NORM_FIRST)
def test_round_trip_identical_logits(tmp_path, norm_first, tying):
    model = make_model(norm_first, **TYING[tying])
    directory = tmp_path / "model"
    save_model(model, directory)
    assert sorted(os.listdir(directory)) == [CONFIG_NAME, WEIGHTS_NAME]
    assert sorted(os.listdir(tmp_path)) == ["model"]  # no temporary directory left behind
    loaded = load_model(directory)
    assert not loaded.training
    assert loaded.config == model.config
    src, lengths, tgt = make_batch(model.config)
    with torch.no_grad():
        assert torch.equal(loaded(src, lengths, tgt), model(src, lengths, tgt))
    # tied weights are still one tensor, and stored once
    keys = stored_keys(directory)
    if tying != "untied":
        assert loaded.generator.proj.weight is loaded.tgt_embed.lut.weight
        assert "generator.proj.weight" not in keys
    else:
        assert loaded.generator.proj.weight is not loaded.tgt_embed.lut.weight
        assert "generator.proj.weight" in keys
    if tying == "shared_vocab":
        assert loaded.src_embed.lut.weight is loaded.tgt_embed.lut.weight
        assert keys.isdisjoint({"tgt_embed.lut.weight", "generator.proj.weight"})
    assert not any(k.endswith(".pe") for k in keys)  # the positional table is not saved


def test_save_into_existing_directory_keeps_other_files(tmp_path):
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "tokenizer.json").write_text("{}")
    save_model(make_model(False, seed=1), directory)
    second = make_model(True, seed=2)
    save_model(second, directory)  # overwrite
    assert sorted(os.listdir(directory)) == [CONFIG_NAME, WEIGHTS_NAME, "tokenizer.json"]
    assert sorted(os.listdir(tmp_path)) == ["model"]
    loaded = load_model(directory)
    assert loaded.config.norm_first is True
    assert torch.equal(loaded.tgt_embed.lut.weight, second.tgt_embed.lut.weight)


def test_save_to_a_file_path_raises(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(NotADirectoryError):
        save_model(make_model(False), path)


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        load_model(tmp_path / "nope")
    directory = tmp_path / "m"
    save_model(make_model(False), directory)
    os.remove(directory / WEIGHTS_NAME)
    with pytest.raises(FileNotFoundError, match=WEIGHTS_NAME):
        load_model(directory)
    save_model(make_model(False), directory)
    os.remove(directory / CONFIG_NAME)
    with pytest.raises(FileNotFoundError, match=CONFIG_NAME):
        load_model(directory)


def test_corrupted_safetensors(tmp_path):
    directory = tmp_path / "m"
    save_model(make_model(False), directory)
    path = directory / WEIGHTS_NAME
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        load_model(directory)
    path.write_bytes(b"\x00" * 64)  # garbage header
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_model(directory)


def test_invalid_config_json(tmp_path):
    directory = tmp_path / "m"
    save_model(make_model(False), directory)
    (directory / CONFIG_NAME).write_text("{")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_model(directory)
    cfg = make_model(False).config.to_dict()
    cfg["d_modle"] = 32
    (directory / CONFIG_NAME).write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"config.json: unknown key 'd_modle'"):
        load_model(directory)


def _rewrite_config(directory, **changes):
    path = directory / CONFIG_NAME
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_config_that_does_not_match_the_weights(tmp_path):
    directory = tmp_path / "m"
    save_model(make_model(False), directory)
    _rewrite_config(directory, d_ff=48)
    with pytest.raises(ValueError) as info:
        load_model(directory)
    msg = str(info.value)
    assert "does not match" in msg and "config.json" in msg
    assert "encoder.layers.0.feed_forward.w_1.weight: file (64, 32) vs config (48, 32)" in msg

    _rewrite_config(directory, d_ff=64, n_decoder_layers=3)
    with pytest.raises(ValueError, match=r"missing tensors \['decoder.layers.2"):
        load_model(directory)

    _rewrite_config(directory, n_decoder_layers=1)
    with pytest.raises(ValueError, match=r"unexpected tensors \['decoder.layers.1"):
        load_model(directory)

    _rewrite_config(directory, n_decoder_layers=2, norm_first=True)  # Pre-LN has final norms
    with pytest.raises(ValueError, match=r"missing tensors \['decoder.norm.bias', 'decoder.norm.weight'"):
        load_model(directory)

    _rewrite_config(directory, norm_first=False, tie_target_embeddings=False)
    with pytest.raises(
        ValueError, match=r"missing tensors \['generator.proj.bias', 'generator.proj.weight'\]"
    ):
        load_model(directory)


def test_untied_copy_that_disagrees_with_tied_config(tmp_path):
    directory = tmp_path / "m"
    model = make_model(False)
    save_model(model, directory)
    tensors = {k: v.contiguous().clone() for k, v in model.state_dict().items()}
    tensors["generator.proj.weight"] += 1.0
    save_file(tensors, str(directory / WEIGHTS_NAME))
    with pytest.raises(ValueError, match="generator.proj.weight differs from tgt_embed.lut.weight"):
        load_model(directory)


def test_load_never_unpickles(tmp_path, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("torch.load must not be used")

    monkeypatch.setattr(torch, "load", forbidden)
    directory = tmp_path / "m"
    save_model(make_model(False), directory)
    load_model(directory)


# ---------------------------------------------------------------------- the config contract at load
@pytest.mark.parametrize("key", ["d_ff", "n_heads", "norm_first", "layer_norm_eps", "eos_id"])
def test_a_missing_config_key_is_reported_as_such(tmp_path, key):
    directory = tmp_path / "m"
    save_model(make_model(False), directory)
    cfg = json.loads((directory / CONFIG_NAME).read_text())
    del cfg[key]
    (directory / CONFIG_NAME).write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as info:
        load_model(directory)
    message = str(info.value)
    assert message.startswith(f"{directory / CONFIG_NAME}: missing key '{key}'"), message
    assert "mis-shaped" not in message


def test_non_utf8_config_names_the_file(tmp_path):
    directory = tmp_path / "m"
    save_model(make_model(False), directory)
    path = directory / CONFIG_NAME
    path.write_bytes(path.read_bytes().replace(b'"d_model"', b'"d_m\xf6del"'))
    with pytest.raises(ConfigError, match=rf"^{path} is not UTF-8 text"):
        load_model(directory)


def test_bundled_demo_config_is_version_1_with_every_field():
    data = json.loads((DEMO_DIR / CONFIG_NAME).read_text(encoding="utf-8"))
    assert data["format_version"] == 1
    assert sorted(data) == sorted(
        [
            "format_version",
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
    )
    model = load_model(DEMO_DIR)
    assert model.config.n_heads == data["n_heads"] == 4


def test_old_form_demo_config_without_n_heads_is_an_error(tmp_path):
    """The reported case: with "n_heads" deleted the demo model loaded with 8 heads and translated badly."""
    directory = tmp_path / "demo"
    shutil.copytree(DEMO_DIR, directory)
    old_form = json.loads((directory / CONFIG_NAME).read_text())
    del old_form["format_version"]  # the form written before versioning
    (directory / CONFIG_NAME).write_text(json.dumps(old_form, sort_keys=True))
    assert load_model(directory).config.n_heads == 4  # the complete old form loads (migrated)
    del old_form["n_heads"]
    (directory / CONFIG_NAME).write_text(json.dumps(old_form, sort_keys=True))
    with pytest.raises(ConfigError, match=rf"^{directory / CONFIG_NAME}: missing key 'n_heads'"):
        load_model(directory)


# ---------------------------------------------------------------------- non-finite weights
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", ["encoder.layers.1.self_attn.W_Q.weight", "tgt_embed.lut.weight"])
def test_non_finite_weights_are_rejected_naming_the_tensor(tmp_path, bad, name):
    directory = tmp_path / "m"
    save_model(make_model(False), directory)
    tensors = load_file(str(directory / WEIGHTS_NAME))
    assert name in tensors
    tensors[name][0, 1] = bad
    save_file(tensors, str(directory / WEIGHTS_NAME))
    with pytest.raises(ValueError, match="non-finite") as info:
        load_model(directory)
    message = str(info.value)
    assert f"{name} (" in message and str(directory / WEIGHTS_NAME) in message
    assert sum(n in message for n in tensors) == 1  # only the bad tensor is named


# ---------------------------------------------------------------------- permissions and failures
@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_save_model_follows_the_umask(tmp_path, umask_022):
    directory = tmp_path / "new" / "m"
    save_model(make_model(False), directory)
    assert mode(directory) == 0o755 and mode(directory.parent) == 0o755
    assert mode(directory / CONFIG_NAME) == 0o644 and mode(directory / WEIGHTS_NAME) == 0o644
    existing = tmp_path / "existing"
    existing.mkdir()
    save_model(make_model(False), existing)
    assert mode(existing / CONFIG_NAME) == 0o644 and mode(existing / WEIGHTS_NAME) == 0o644


@pytest.mark.parametrize("exists", [False, True])
def test_full_disk_leaves_no_partial_model(tmp_path, monkeypatch, exists):
    directory = tmp_path / "m"
    if exists:
        save_model(make_model(False, seed=1), directory)
        before = {n: (directory / n).read_bytes() for n in os.listdir(directory)}
    real_replace = os.replace

    def full(src, dst, *args, **kwargs):
        if os.path.basename(dst) == CONFIG_NAME:  # the weights were written, the config is not
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError) as info:
        save_model(make_model(False, seed=2), directory)
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert os.listdir(tmp_path) == (["m"] if exists else [])  # no temporary folder
    if exists:  # the weights were replaced (a complete file), no temporary file is left
        assert sorted(os.listdir(directory)) == sorted(before)
        assert (directory / CONFIG_NAME).read_bytes() == before[CONFIG_NAME]


def test_saving_into_an_existing_folder_logs_no_internal_path(tmp_path, caplog):
    """Commands save into their own temporary staging folders; a user-facing log line must not
    show those paths (what a command says it wrote is the final folder)."""
    import logging

    from transformer_ext.checkpoint import save_model
    from transformer_ext.config import TransformerConfig
    from transformer_ext.model import Transformer

    stage = tmp_path / ".OUT.tmp-host-1"
    stage.mkdir()
    model = Transformer(TransformerConfig.preset("tiny", src_vocab_size=12, tgt_vocab_size=12))
    with caplog.at_level(logging.INFO):
        save_model(model, stage)
    assert (stage / "model.safetensors").is_file()
    assert not [r for r in caplog.records if r.levelno >= logging.INFO and str(stage) in r.getMessage()]
