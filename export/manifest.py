"""The I/O contract of the exported graphs, the ``manifest.json`` that records it, and the rules
for replacing an export folder.

Imports only the standard library (and :mod:`transformer_ext.fsutil`, which does too), so the
ONNX Runtime runner can read and check a manifest without torch or onnx installed.
:func:`graph_specs` is the single definition of every input and output of ``encoder.onnx`` and
``decoder_step.onnx`` (DESIGN.md section 3): the exporter names the graphs from it, validation
checks them against it, and the runner checks the loaded sessions against the copy stored in
the manifest.

Ownership. The manifest carries a format marker (``"format": "transformer_ext.onnx_export"``),
a format version, and, from version 2 on, ``"files"``: every file of the folder, the manifest
included (``python -m export.tensorrt`` adds the engines it writes there). A tool of this package
replaces an existing folder only when :func:`check_replaceable` finds nothing in it but the files
its manifest lists; version-1 folders (no list) are recognised by the exact file names the
version-1 exporter and TensorRT builder wrote (:func:`owned_files`). Anything else is refused
with the names of the files that would be lost.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from transformer_ext.fsutil import atomic_write_json

from . import ManifestError, OutputFolderError

logger = logging.getLogger(__name__)

__all__ = [
    "MANIFEST_NAME",
    "ENCODER_FILE",
    "DECODER_FILE",
    "TOKENIZER_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "READABLE_FORMAT_VERSIONS",
    "FLAVOURS",
    "graph_specs",
    "write_manifest",
    "read_manifest",
    "check_io",
    "folder_files",
    "tokenizer_files",
    "owned_files",
    "check_replaceable",
    "check_output_path",
    "make_parents",
    "remove_made_parents",
    "named_write_error",
]

MANIFEST_NAME = "manifest.json"
ENCODER_FILE = "encoder.onnx"
DECODER_FILE = "decoder_step.onnx"
TOKENIZER_FILE = "tokenizer.json"
FORMAT = "transformer_ext.onnx_export"
# 2: "files" lists every file of the folder, "tokenizer_files" names the tokenizer's.
# 1: "files" was {"encoder", "decoder_step", "tokenizer"}; still read, and replaced by file set.
FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)
FLAVOURS = ("portable", "tensorscatter")

# Named (dynamic) axes of the graphs.
BATCH, SRC_LEN, CACHE_LEN = "batch", "src_len", "cache_len"

_REQUIRED_KEYS = ("format", "format_version", "flavour", "opset", "ir_version", "files", "model_config", "graphs")
_CONFIG_KEYS = ("d_model", "n_heads", "n_decoder_layers", "tgt_vocab_size", "max_len", "bos_id", "eos_id", "pad_id")

# Every name a version-1 export folder could hold: the graphs (and their external weights, for
# graphs over 2 GiB), the manifest, and what the version-1 TensorRT builder added: engines per
# precision, the converted fp16/bf16 graphs, the timing cache. The tokenizer files come from the
# manifest itself.
_V1_GRAPHS = ("encoder", "decoder_step")
_V1_FILES = frozenset(
    {ENCODER_FILE, DECODER_FILE, MANIFEST_NAME, ENCODER_FILE + ".data", DECODER_FILE + ".data", "tensorrt.timing.cache"}
    | {f"{g}.{p}.engine" for g in _V1_GRAPHS for p in ("fp32", "fp16", "bf16")}
    | {f"{g}.{p}.onnx" for g in _V1_GRAPHS for p in ("fp16", "bf16")}
)
_SHOWN = 5  # unexpected files named in a refusal


def _tensor(name: str, dtype: str, shape: Iterable[Any]) -> dict:
    return {"name": name, "dtype": dtype, "shape": list(shape)}


def graph_specs(config: Mapping[str, Any], flavour: str = "portable") -> dict:
    """Every input and output of both graphs: ``{"encoder": {"inputs": [...], "outputs": [...]},
    "decoder_step": {...}}``, each tensor ``{"name", "dtype", "shape"}`` where a shape entry is an
    int (static) or an axis name (``batch``, ``src_len``, ``cache_len``).

    ``config`` is a model config as a dict (``TransformerConfig.to_dict()``).
    """
    if flavour not in FLAVOURS:
        raise ValueError(f"flavour must be one of {FLAVOURS}, got {flavour!r}")
    d_model, heads = int(config["d_model"]), int(config["n_heads"])
    d_k = d_model // heads
    layers, vocab = int(config["n_decoder_layers"]), int(config["tgt_vocab_size"])
    cross = [BATCH, heads, SRC_LEN, d_k]
    cache = [BATCH, heads, CACHE_LEN, d_k]

    encoder = {
        "inputs": [_tensor("input_ids", "int64", [BATCH, SRC_LEN]), _tensor("src_lengths", "int64", [BATCH])],
        "outputs": [_tensor("encoder_out", "float32", [BATCH, SRC_LEN, d_model])]
        + [_tensor(f"cross_{kind}.{i}", "float32", cross) for i in range(layers) for kind in ("key", "value")],
    }
    inputs = [
        _tensor("input_ids", "int64", [BATCH, 1]),
        _tensor("positions", "int64", [BATCH]),
        _tensor("src_lengths", "int64", [BATCH]),
    ]
    inputs += [_tensor(f"self_{kind}.{i}", "float32", cache) for i in range(layers) for kind in ("key", "value")]
    inputs += [_tensor(f"cross_{kind}.{i}", "float32", cross) for i in range(layers) for kind in ("key", "value")]
    outputs = [_tensor("logits", "float32", [BATCH, vocab])]
    if flavour == "portable":
        outputs += [
            _tensor(f"new_{kind}.{i}", "float32", [BATCH, heads, 1, d_k]) for i in range(layers) for kind in ("key", "value")
        ]
    else:
        outputs += [_tensor(f"present_{kind}.{i}", "float32", cache) for i in range(layers) for kind in ("key", "value")]
    return {"encoder": encoder, "decoder_step": {"inputs": inputs, "outputs": outputs}}


def write_manifest(directory: str | os.PathLike, manifest: Mapping[str, Any]) -> str:
    """Write ``manifest.json`` into ``directory`` atomically (:func:`transformer_ext.fsutil.atomic_write_json`);
    returns its path. NaN and infinities are refused (they are not JSON)."""
    path = os.path.join(os.fspath(directory), MANIFEST_NAME)
    atomic_write_json(path, dict(manifest))
    return path


def read_manifest(directory: str | os.PathLike) -> dict:
    """Read and sanity-check ``directory/manifest.json``; raises :class:`ManifestError`."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise ManifestError(f"export folder not found: {directory} (run `python -m export.onnx` first)")
    path = os.path.join(directory, MANIFEST_NAME)
    if not os.path.isfile(path):
        raise ManifestError(f"{path} not found: an export folder holds {ENCODER_FILE}, {DECODER_FILE} and {MANIFEST_NAME}")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(manifest, dict):
        raise ManifestError(f"{path} must hold a JSON object")
    missing = [k for k in _REQUIRED_KEYS if k not in manifest]
    if missing:
        raise ManifestError(f"{path} lacks the keys {missing}")
    if manifest["format"] != FORMAT or manifest["format_version"] not in READABLE_FORMAT_VERSIONS:
        raise ManifestError(
            f"{path} is not a {FORMAT} manifest of version {' or '.join(map(str, READABLE_FORMAT_VERSIONS))} "
            f"(format={manifest['format']!r}, version={manifest['format_version']!r})"
        )
    files = manifest["files"]
    if manifest["format_version"] >= 2:
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            raise ManifestError(f"{path}: files must list the names of the folder's files")
        if not isinstance(manifest.get("tokenizer_files"), list):
            raise ManifestError(f"{path}: tokenizer_files must list the tokenizer's files (an empty list for none)")
    elif not isinstance(files, dict):
        raise ManifestError(f"{path}: files must be an object in a version-1 manifest")
    if manifest["flavour"] not in FLAVOURS:
        raise ManifestError(f"{path}: unknown flavour {manifest['flavour']!r}, expected one of {FLAVOURS}")
    config = manifest["model_config"]
    if not isinstance(config, dict) or any(k not in config for k in _CONFIG_KEYS):
        raise ManifestError(f"{path}: model_config must hold at least {list(_CONFIG_KEYS)}")
    graphs = manifest["graphs"]
    for graph in ("encoder", "decoder_step"):
        if not isinstance(graphs, dict) or graph not in graphs or not {"inputs", "outputs"} <= set(graphs[graph]):
            raise ManifestError(f"{path}: graphs.{graph} must list its inputs and outputs")
    expected = graph_specs(config, manifest["flavour"])
    if graphs != expected:
        raise ManifestError(
            f"{path}: the graphs it lists do not follow from its model_config and flavour "
            f"{manifest['flavour']!r} (edited by hand, or written by another version?)"
        )
    return manifest


def check_io(graph: str, spec: Mapping[str, Any], actual_inputs: list[dict], actual_outputs: list[dict]) -> None:
    """Compare a loaded graph's inputs/outputs (``[{"name", "dtype", "shape"}]``, in order) with
    ``spec``; raises :class:`ManifestError` listing every difference."""
    problems = []
    for kind, want, have in (("input", spec["inputs"], actual_inputs), ("output", spec["outputs"], actual_outputs)):
        want_names = [t["name"] for t in want]
        have_names = [t["name"] for t in have]
        if want_names != have_names:
            missing = [n for n in want_names if n not in have_names]
            extra = [n for n in have_names if n not in want_names]
            problems.append(
                f"{kind} names differ (missing {missing}, unexpected {extra})" if missing or extra
                else f"{kind}s are in another order: {have_names}"
            )
            continue
        for w, h in zip(want, have):
            if w["dtype"] != h["dtype"]:
                problems.append(f"{kind} {w['name']}: dtype {h['dtype']} != {w['dtype']}")
            if list(w["shape"]) != list(h["shape"]):
                problems.append(f"{kind} {w['name']}: shape {list(h['shape'])} != {list(w['shape'])}")
    if problems:
        raise ManifestError(f"{graph} does not match the manifest: " + "; ".join(problems))


# ------------------------------------------------------------------------------------------
# Export folders: which files are ours, and when a folder may be replaced
# ------------------------------------------------------------------------------------------


def folder_files(directory: str | os.PathLike) -> list[str]:
    """The sorted names in ``directory`` plus ``manifest.json``: the ``files`` entry of a manifest
    about to be written there."""
    return sorted(set(os.listdir(directory)) | {MANIFEST_NAME})


def tokenizer_files(manifest: Mapping[str, Any]) -> list[str]:
    """The tokenizer's file names in an export folder, for manifests of every readable version."""
    if int(manifest.get("format_version", 0)) >= 2:
        return list(manifest.get("tokenizer_files") or [])
    files = manifest.get("files")
    return list(files.get("tokenizer") or []) if isinstance(files, dict) else []


def _plain_name(value: Any) -> Optional[str]:
    return value if isinstance(value, str) and value and os.path.basename(value) == value else None


def owned_files(manifest: Mapping[str, Any]) -> set[str]:
    """The names a folder with this (valid, our format) manifest may hold: the ``files`` list from
    version 2 on; for version 1 the exact names the version-1 tools wrote there."""
    if int(manifest.get("format_version", 0)) >= 2:
        return {f for f in manifest.get("files", []) if _plain_name(f)}
    names = set(_V1_FILES) | {f for f in tokenizer_files(manifest) if _plain_name(f)}
    for section in ((manifest.get("tensorrt") or {}).get("engines") or {}).values():
        if not isinstance(section, Mapping):
            continue
        for entry in (section.get("engines") or {}).values():
            if isinstance(entry, Mapping):
                names |= {n for n in (_plain_name(entry.get("file")), _plain_name(entry.get("onnx"))) if n}
        timing = _plain_name(section.get("timing_cache"))
        if timing:
            names.add(timing)
    return names


def _load_own_manifest(directory: Path) -> tuple[Optional[dict], str]:
    """``(manifest, "")`` when ``directory/manifest.json`` is one of ours, else ``(None, why not)``."""
    path = directory / MANIFEST_NAME
    if not path.is_file():
        return None, f"it has no {MANIFEST_NAME}"
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        return None, f"its {MANIFEST_NAME} cannot be read ({exc})"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None, f"its {MANIFEST_NAME} was not written by this package (no \"format\": \"{FORMAT}\")"
    version = manifest.get("format_version")
    if version not in READABLE_FORMAT_VERSIONS:
        return None, f"its {MANIFEST_NAME} has format_version {version!r}, which this version does not know"
    if version >= 2 and not (isinstance(manifest.get("files"), list) and all(isinstance(f, str) for f in manifest["files"])):
        return None, f"its {MANIFEST_NAME} does not list the folder's files"
    return manifest, ""


def _names(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" (and {len(names) - _SHOWN} more)" if len(names) > _SHOWN else "")


def check_output_path(path: str | os.PathLike, option: str = "--output-dir") -> None:
    """Refuse an output path that is an existing file, or lies below a file. Touches nothing."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputFolderError(f"{option} {path} exists and is not a folder; choose a folder path")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise OutputFolderError(f"{option} {path}: {parent} is a file, not a folder")


def check_replaceable(directory: str | os.PathLike, *, option: str = "--output-dir") -> Optional[dict]:
    """Refuse, with the reason, to replace ``directory`` unless it is missing, empty, or an export
    folder of this package holding nothing but the files its manifest lists.

    Returns the folder's manifest (``None`` for a missing or empty folder). A symlink is judged by
    the folder it points to. Touches nothing.

    Raises:
        OutputFolderError: naming the unexpected files (at most a few), or why the folder is not ours.
    """
    directory = Path(directory)
    check_output_path(directory, option)
    if not directory.exists():
        return None
    entries = os.listdir(directory)
    if not entries:
        return None
    manifest, why = _load_own_manifest(directory)
    if manifest is None:
        raise OutputFolderError(
            f"{option} {directory} is not empty and not an ONNX export: {why}; it holds {_names(entries)}. "
            "Refusing to replace it: choose another folder, or move its contents away"
        )
    owned = owned_files(manifest)
    unexpected = [e for e in entries
                  if e not in owned or ((directory / e).is_dir() and not (directory / e).is_symlink())]
    if unexpected:
        raise OutputFolderError(
            f"{option} {directory} is an ONNX export, but it also holds files this package did not write "
            f"there: {_names(unexpected)}. Refusing to replace it (they would be lost): move them away, "
            "or choose another folder"
        )
    return manifest


def make_parents(path: str | os.PathLike, made: list[Path]) -> None:
    """Create the missing parent folders of ``path`` (the umask applies), appending each one to
    ``made`` as soon as it exists (outermost first), for :func:`remove_made_parents`."""
    missing = []
    parent = Path(path).parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    for folder in reversed(missing):
        os.mkdir(folder)
        made.append(folder)


def remove_made_parents(made: Iterable[Path]) -> None:
    """Remove the folders :func:`make_parents` created, innermost first, if they are still empty."""
    for folder in reversed(list(made)):
        try:
            os.rmdir(folder)
        except OSError:
            return


_WRITE_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EFBIG, errno.EIO}


def named_write_error(exc: BaseException, target: str | os.PathLike) -> Optional[OSError]:
    """For a failed write (full disk, read-only file system, no permission): the same error naming
    ``target`` (the folder or file the user asked for) instead of a temporary path; ``None`` for
    any other exception. ``err = named_write_error(exc, out); if err: raise err from exc``."""
    if isinstance(exc, OSError) and exc.errno in _WRITE_ERRNOS:
        return OSError(exc.errno, exc.strerror or os.strerror(exc.errno), os.fspath(target))
    return None
