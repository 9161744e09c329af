"""Model directories: round trip, tied weights stored once, and every kind of bad checkpoint."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from transformer_ext.checkpoint import CONFIG_NAME, WEIGHTS_NAME, load_model, save_model

from test_model import make_batch, make_model

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
    with pytest.raises(ValueError, match="unknown TransformerConfig keys"):
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
    with pytest.raises(ValueError, match=r"missing tensors \['generator.proj.bias', 'generator.proj.weight'\]"):
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
