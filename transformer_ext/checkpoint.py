"""Model directories: ``config.json`` + ``model.safetensors`` (DESIGN.md section 5).

No pickle anywhere: weights are read with ``safetensors`` only. Tied weights (target
embedding = output projection, and with ``shared_vocab`` the source embedding too) are stored
once, under the first name ``state_dict()`` gives them, and re-tied on load by building the
model from its config. Other files in the directory (the tokenizer's) are left alone.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from typing import Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from . import __version__
from .config import TransformerConfig
from .model import Transformer

logger = logging.getLogger(__name__)

__all__ = ["save_model", "load_model", "canonical_state_dict", "CONFIG_NAME", "WEIGHTS_NAME"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"

PathLike = Union[str, os.PathLike]


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def canonical_state_dict(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors, aliases)``: the state dict with each shared tensor under its first name only,
    and ``alias name -> canonical name`` for the names that were dropped."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in model.state_dict().items():
        key = _storage_key(tensor)
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = tensor
    return tensors, aliases


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_files(model: Transformer, directory: str) -> None:
    """Write config.json and model.safetensors into an existing (private) directory."""
    tensors, aliases = canonical_state_dict(model)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    metadata = {
        "format": "pt",
        "producer": f"transformer_ext {__version__}",
        "tied": json.dumps(aliases, sort_keys=True),
    }
    weights_path = os.path.join(directory, WEIGHTS_NAME)
    save_file(tensors, weights_path, metadata=metadata)
    model.config.save_json(os.path.join(directory, CONFIG_NAME))
    for name in (WEIGHTS_NAME, CONFIG_NAME):
        with open(os.path.join(directory, name), "rb") as f:
            os.fsync(f.fileno())


def save_model(model: Transformer, directory: PathLike) -> None:
    """Write ``config.json`` and ``model.safetensors`` of ``model`` into ``directory``.

    A new directory appears atomically: the files are written into a temporary directory next
    to it, which is then renamed. If ``directory`` already exists (e.g. it holds tokenizer files)
    each of the two files is replaced atomically (written to a temporary name in the same
    directory, then ``os.replace``), weights first; other files are kept. No half-written file is
    ever visible under the final names.
    """
    if not isinstance(model, Transformer):
        raise TypeError(f"save_model expects a transformer_ext Transformer, got {type(model).__name__}")
    directory = os.path.abspath(os.fspath(directory))
    parent = os.path.dirname(directory) or "."
    os.makedirs(parent, exist_ok=True)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(f"cannot save a model to {directory}: it exists and is not a directory")

    tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(directory)}.tmp-", dir=parent)
    try:
        _write_files(model, tmp_dir)
        if not os.path.exists(directory):
            try:
                os.rename(tmp_dir, directory)
                _fsync_dir(parent)
                logger.info("saved model to %s", directory)
                return
            except OSError:
                if not os.path.isdir(directory):  # a real failure, not a concurrent mkdir
                    raise
        # The directory exists: replace the two files one by one, each atomically. The temporary
        # files must live on the directory's file system for os.replace to be atomic.
        staged = {}
        for name in (WEIGHTS_NAME, CONFIG_NAME):
            fd, staged_path = tempfile.mkstemp(prefix=f".{name}.tmp-", dir=directory)
            os.close(fd)
            shutil.copyfile(os.path.join(tmp_dir, name), staged_path)
            with open(staged_path, "rb") as f:
                os.fsync(f.fileno())
            staged[name] = staged_path
        try:
            for name in (WEIGHTS_NAME, CONFIG_NAME):
                os.replace(staged[name], os.path.join(directory, name))
        finally:
            for path in staged.values():
                if os.path.exists(path):
                    os.remove(path)
        _fsync_dir(directory)
        logger.info("saved model to existing directory %s", directory)
    finally:
        if os.path.isdir(tmp_dir):
            shutil.rmtree(tmp_dir, ignore_errors=True)


def load_model(directory: PathLike, device: Union[str, torch.device] = "cpu") -> Transformer:
    """Build the model described by ``directory/config.json`` and load ``model.safetensors``.

    Returns the model on ``device`` in eval mode. Raises ``FileNotFoundError`` for a missing
    directory or file, ``ValueError`` (naming the file) for an invalid config, a corrupted
    weights file, or weights that do not match the config (missing, unexpected and mis-shaped
    tensors are all listed).
    """
    directory = os.fspath(directory)
    if not os.path.exists(directory):
        raise FileNotFoundError(f"model directory not found: {directory}")
    if not os.path.isdir(directory):
        raise NotADirectoryError(f"not a model directory (expected a directory): {directory}")
    config_path = os.path.join(directory, CONFIG_NAME)
    weights_path = os.path.join(directory, WEIGHTS_NAME)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{config_path} not found: a model directory needs {CONFIG_NAME} and {WEIGHTS_NAME}")
    if not os.path.isfile(weights_path):
        raise FileNotFoundError(f"{weights_path} not found: a model directory needs {CONFIG_NAME} and {WEIGHTS_NAME}")

    config = TransformerConfig.load_json(config_path)
    try:
        tensors = load_file(weights_path, device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{weights_path} is not a readable safetensors file: {exc}") from exc

    model = Transformer(config)
    expected, aliases = canonical_state_dict(model)
    problems = []
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected) - set(aliases))
    if missing:
        problems.append(f"missing tensors {missing}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected}")
    misshaped = [
        f"{name}: file {tuple(tensors[name].shape)} vs config {tuple(expected[name].shape)}"
        for name in sorted(set(expected) & set(tensors))
        if tuple(tensors[name].shape) != tuple(expected[name].shape)
    ]
    if misshaped:
        problems.append("mis-shaped tensors [" + "; ".join(misshaped) + "]")
    for alias, canonical in aliases.items():
        # A file written without de-duplication may hold the tied copy too: it must agree.
        if alias in tensors and canonical in tensors and not torch.equal(tensors[alias], tensors[canonical]):
            problems.append(
                f"{alias} differs from {canonical}, but the config ties them "
                "(tie_target_embeddings / shared_vocab)"
            )
    nonfloat = [name for name in sorted(set(expected) & set(tensors)) if not tensors[name].is_floating_point()]
    if nonfloat:
        problems.append(f"non-floating-point tensors {nonfloat}")
    if problems:
        raise ValueError(f"{weights_path} does not match {config_path}: " + "; ".join(problems))

    with torch.no_grad():
        for name, param in expected.items():
            param.copy_(tensors[name])
    model.to(device)
    model.eval()
    logger.info("loaded model from %s (%d tensors)", directory, len(expected))
    return model
