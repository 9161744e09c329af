"""Convert pretrained checkpoints of other tools into model folders of this package.

``python -m transformer_ext.convert transformers --model HF_DIR --output-dir MODEL_DIR`` (console script
``transformer-ext-convert``) reads a local Hugging Face checkpoint folder of a MarianMT (opus-mt)
or M2M100 / NLLB-200 model without importing transformers (:mod:`transformer_ext.convert.hf`)
and writes an ordinary model folder (docs/DESIGN.md sections 5 and 7): ``config.json``, float32
``model.safetensors``, the tokenizer (``tokenizer.json`` and the original tokenizer files),
``generation_defaults.json`` and ``provenance.json`` (source folder, model type, SHA-256 of every
file read, the dtype the weights were upcast from). Everything is read and checked before anything
is written, and the folder appears atomically: on any error nothing is left behind.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Optional

from .. import __version__
from ..fsutil import StagedDir, atomic_write_json, disk_errors
from .generation import GENERATION_DEFAULTS_FILE, GenerationDefaults, read_generation_defaults
from .hf import SUPPORTED_MODEL_TYPES, Checkpoint, ConversionError, read_checkpoint
from .hub import resolve as resolve_hub_id

logger = logging.getLogger(__name__)

__all__ = [
    "convert_transformers",
    "ConversionError",
    "SUPPORTED_MODEL_TYPES",
    "PROVENANCE_FILE",
    "GENERATION_DEFAULTS_FILE",
    "GenerationDefaults",
    "read_generation_defaults",
    "build_model",
]

PROVENANCE_FILE = "provenance.json"
PROVENANCE_FORMAT = "transformer_ext.provenance"


def _shapes(model) -> dict:
    """Name -> tensor of ``model``'s state dict, each tied tensor under its first name only (as
    :func:`~transformer_ext.checkpoint.canonical_state_dict` keeps it; a model on the meta device has no
    storage to tell tied tensors by, so they are told by identity)."""
    seen: set = set()
    out = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor
    return out


def build_model(checkpoint: Checkpoint):
    """Our :class:`~transformer_ext.model.Transformer` holding the checkpoint's weights (eval mode)."""
    import torch

    from ..checkpoint import canonical_state_dict, check_finite
    from ..model import Transformer

    with torch.device("meta"):  # the shapes, checked against the weights before any allocation
        expected = _shapes(Transformer(checkpoint.config))
    missing = sorted(set(expected) - set(checkpoint.tensors))
    unexpected = sorted(set(checkpoint.tensors) - set(expected))
    if missing or unexpected:  # a bug of the name map, not of the input
        raise RuntimeError(f"weight map incomplete: missing {missing[:5]}, unexpected {unexpected[:5]}")
    misshaped = [
        f"{name}: checkpoint {tuple(checkpoint.tensors[name].shape)} vs config {tuple(t.shape)}"
        for name, t in expected.items()
        if tuple(checkpoint.tensors[name].shape) != tuple(t.shape)
    ]
    if misshaped:
        raise ConversionError(
            f"{checkpoint.source}: tensors disagree with config.json (a vocabulary or dimension mismatch): "
            + "; ".join(misshaped[:5])
        )
    check_finite(checkpoint.tensors, str(checkpoint.source))
    model = Transformer(checkpoint.config)
    expected, _ = canonical_state_dict(model)
    with torch.no_grad():
        for name, param in expected.items():
            param.copy_(checkpoint.tensors[name])
    model.eval()
    return model


def _provenance(checkpoint: Checkpoint) -> dict:
    return {
        "format": PROVENANCE_FORMAT,
        "format_version": 1,
        "converter": f"transformer_ext {__version__}",
        "importer": "transformers",
        "source": str(checkpoint.source),
        "model_type": checkpoint.model_type,
        "architecture": checkpoint.architecture,
        "weights_dtype": checkpoint.upcast_from or "float32",
        "upcast_to_float32": checkpoint.upcast_from is not None,
        "files": dict(sorted(checkpoint.files.items())),
        "notes": list(checkpoint.notes),
    }


def convert_transformers(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    before_commit: Optional[Callable[[], None]] = None,
) -> Path:
    """Convert the transformers checkpoint folder ``hf_dir`` into the new model folder ``out_dir``.

    ``hf_dir`` may be a Hugging Face hub id (``ORG/NAME``) where no such local path exists: it is
    read from the hub cache, downloaded unless ``HF_HUB_OFFLINE=1`` (:mod:`.hub`), and
    ``provenance.json`` records the commit it resolved to.

    ``out_dir`` must not exist (nothing is ever overwritten), neither when the conversion starts
    nor when the finished folder is renamed into place: something that appears there meanwhile
    (a folder of the user's, the output of a second conversion) is kept and the conversion fails
    (:func:`~transformer_ext.fsutil.rename_noreplace`). Raises :class:`ConversionError` (one line
    naming the file, field or tensor) for input that cannot be converted, and for a failing disk
    (naming ``--output-dir`` and the file). ``before_commit`` is called just before that rename (the
    command line uses it to let Ctrl-C no longer undo a complete folder).
    """
    from ..checkpoint import save_model

    out = Path(os.path.abspath(os.fspath(out_dir)))
    if out.exists() or out.is_symlink():
        raise ConversionError(
            f"--output-dir {out} already exists; choose a new folder (nothing is overwritten)"
        )
    if Path(os.path.abspath(os.fspath(hf_dir))) == out:
        raise ConversionError("--output-dir must differ from the checkpoint folder --model")
    snapshot = resolve_hub_id(hf_dir)  # None for a local folder
    checkpoint = read_checkpoint(snapshot.folder if snapshot else hf_dir)
    provenance = _provenance(checkpoint)
    if snapshot:
        provenance["hub"] = snapshot.provenance()
    model = build_model(checkpoint)
    with disk_errors("--output-dir", out, ConversionError):
        out.parent.mkdir(parents=True, exist_ok=True)
        with StagedDir(out, replace=False) as stage:
            save_model(model, stage.path)
            checkpoint.tokenizer.save(stage.path)
            checkpoint.generation.save(stage.path)
            atomic_write_json(os.path.join(stage.path, PROVENANCE_FILE), provenance)
            if before_commit is not None:
                before_commit()
            try:
                stage.commit()
            except FileExistsError:
                raise ConversionError(
                    f"--output-dir {out} appeared while the checkpoint was being converted (another program wrote "
                    "it); it was left as it is and this conversion discarded: choose a new folder"
                ) from None
    if checkpoint.upcast_from:
        logger.info("weights upcast from %s to float32", checkpoint.upcast_from)
    for note in checkpoint.notes:
        logger.warning("%s", note)
    logger.info("converted %s (%s) into %s", checkpoint.source, checkpoint.model_type, out)
    return out
