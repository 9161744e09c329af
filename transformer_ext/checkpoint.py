"""Model directories: ``config.json`` + ``model.safetensors`` (docs/DESIGN.md section 5).

No pickle anywhere: weights are read with ``safetensors`` only. Tied weights (target
embedding = output projection, and with ``shared_vocab`` the source embedding too) are stored
once, under the first name ``state_dict()`` gives them, and re-tied on load by building the
model from its config. Other files in the directory (the tokenizer's) are left alone.
Loading refuses what would give a silently wrong model: a config.json that breaks the contract
of :mod:`transformer_ext.config` (missing, unknown or mistyped key), tensors that do not match
it, and non-finite weights. Writes go through :mod:`transformer_ext.fsutil`.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from typing import Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from . import __version__
from .config import TransformerConfig
from .fsutil import StagedDir, atomic_write_bytes
from .model import Transformer

logger = logging.getLogger(__name__)

__all__ = ["save_model", "load_model", "canonical_state_dict", "check_finite", "CONFIG_NAME", "WEIGHTS_NAME"]

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


def _write_files(model: Transformer, directory: str) -> None:
    """Write model.safetensors, then config.json, into the folder ``directory``, each atomically."""
    tensors, aliases = canonical_state_dict(model)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    metadata = {
        "format": "pt",
        "producer": f"transformer_ext {__version__}",
        "tied": json.dumps(aliases, sort_keys=True),
    }
    atomic_write_bytes(os.path.join(directory, WEIGHTS_NAME), save(tensors, metadata=metadata))
    model.config.save_json(os.path.join(directory, CONFIG_NAME))


def save_model(model: Transformer, directory: PathLike) -> None:
    """Write ``config.json`` and ``model.safetensors`` of ``model`` into ``directory``.

    A new directory (and any missing parent) appears atomically, complete: it is built in a
    temporary sibling (:class:`~transformer_ext.fsutil.StagedDir`) and renamed. In an existing
    directory (e.g. one that holds tokenizer files) each of the two files is replaced atomically,
    weights first; other files are kept. Folders and files get the permissions of the umask.
    """
    if not isinstance(model, Transformer):
        raise TypeError(f"save_model expects a transformer_ext Transformer, got {type(model).__name__}")
    directory = os.path.abspath(os.fspath(directory))
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(
            errno.ENOTDIR, "cannot save a model here: it exists and is not a directory", directory
        )
    if os.path.isdir(directory):
        _write_files(model, directory)
        # often a caller's temporary staging folder: its name is no news to a user
        logger.debug("wrote %s and %s into %s", WEIGHTS_NAME, CONFIG_NAME, directory)
        return
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    with StagedDir(directory) as stage:
        _write_files(model, str(stage.path))
        stage.commit()
    logger.info("saved model to %s", directory)


def check_finite(tensors: dict[str, torch.Tensor], source: str) -> None:
    """Raise ``ValueError`` naming every floating-point tensor of ``tensors`` with a NaN or infinity."""
    bad = []
    for name in sorted(tensors):
        t = tensors[name]
        if not t.is_floating_point() or bool(torch.isfinite(t).all()):
            continue
        n_nan = int(torch.isnan(t).sum())
        n_inf = int(torch.isinf(t).sum())
        bad.append(f"{name} ({n_nan} NaN, {n_inf} infinite of {t.numel()})")
    if bad:
        raise ValueError(
            f"{source} holds non-finite values (weights must be finite numbers): " + "; ".join(bad)
        )


def _refuse_transformers_folder(directory: str, config_path: str) -> None:
    """A Hugging Face checkpoint folder (its config.json has ``model_type`` and none of our
    ``format_version``) is not a model folder of ours: say how to convert it, rather than listing
    the fields its config lacks."""
    try:
        with open(config_path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return  # the config reader names what is wrong
    if isinstance(data, dict) and "model_type" in data and "format_version" not in data:
        raise ValueError(
            f"{directory} is a transformers checkpoint folder (config.json has model_type "
            f"{json.dumps(data['model_type'])[:60]}), not a model folder of this package: convert it first "
            f"with python -m transformer_ext.convert transformers --model {directory} --output-dir MODEL_DIR"
        )


def load_model(directory: PathLike, device: Union[str, torch.device] = "cpu") -> Transformer:
    """Build the model described by ``directory/config.json`` and load ``model.safetensors``.

    Returns the model on ``device`` in eval mode. Raises ``FileNotFoundError`` for a missing
    directory or file, ``ValueError`` (naming the file) for an invalid config (a
    :class:`~transformer_ext.config.ConfigError` naming the key: see
    :func:`~transformer_ext.config.migrate_config`), a corrupted weights file, weights that do
    not match the config (missing, unexpected and mis-shaped tensors are all listed), or
    weights with a NaN or an infinity (the tensors are named).
    """
    directory = os.fspath(directory)
    if not os.path.exists(directory):
        raise FileNotFoundError(f"model directory not found: {directory}")
    if not os.path.isdir(directory):
        raise NotADirectoryError(f"not a model directory (expected a directory): {directory}")
    config_path = os.path.join(directory, CONFIG_NAME)
    weights_path = os.path.join(directory, WEIGHTS_NAME)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(
            f"{config_path} not found: a model directory needs {CONFIG_NAME} and {WEIGHTS_NAME}"
        )
    _refuse_transformers_folder(directory, config_path)
    if not os.path.isfile(weights_path):
        raise FileNotFoundError(
            f"{weights_path} not found: a model directory needs {CONFIG_NAME} and {WEIGHTS_NAME}"
        )

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
    nonfloat = [
        name for name in sorted(set(expected) & set(tensors)) if not tensors[name].is_floating_point()
    ]
    if nonfloat:
        problems.append(f"non-floating-point tensors {nonfloat}")
    if problems:
        raise ValueError(f"{weights_path} does not match {config_path}: " + "; ".join(problems))
    check_finite(tensors, weights_path)

    with torch.no_grad():
        for name, param in expected.items():
            param.copy_(tensors[name])
    model.to(device)
    model.eval()
    logger.info("loaded model from %s (%d tensors)", directory, len(expected))
    return model
