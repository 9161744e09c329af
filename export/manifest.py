"""Writing an export folder's ``manifest.json`` and ``generation.json``, and the rules for
replacing an export folder.

What readers need of the format lives in :mod:`transformer_ext.export_format` (file names, axis
names, format marker and version, :func:`graph_specs`, the one manifest reader
:func:`read_manifest`, the one I/O comparator :func:`check_io`, :func:`tokenizer_files`) and is
imported from there only; this module holds what only a writer needs.
Imports only the standard library and ``transformer_ext``, never onnx or torch.

Ownership. The manifest carries a format marker (``"format": "transformer_ext.onnx_export"``),
a format version, and, from version 2 on, ``"files"``: every file of the folder, the manifest
and the generation config included (``python -m export.tensorrt`` adds the engines it writes
there). A tool of this package replaces an existing folder only when :func:`check_replaceable`
finds nothing in it but the files its manifest lists; version-1 folders (no list) are recognised
by the exact file names the version-1 exporter and TensorRT builder wrote (:func:`owned_files`).
Anything else is refused with the names of the files that would be lost.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from transformer_ext import export_format as ef
from transformer_ext.fsutil import atomic_write_json

from . import OutputFolderError

logger = logging.getLogger(__name__)

__all__ = [
    "write_manifest",
    "write_generation_config",
    "folder_files",
    "owned_files",
    "check_replaceable",
    "check_output_path",
    "make_parents",
    "remove_made_parents",
    "named_write_error",
]

# Every name a version-1 export folder could hold: the graphs (and their external weights, for
# graphs over 2 GiB), the manifest, and what the version-1 TensorRT builder added: engines per
# precision, the converted fp16/bf16 graphs, the timing cache. The tokenizer files come from the
# manifest itself.
_V1_GRAPHS = ("encoder", "decoder_step")
_V1_FILES = frozenset(
    {
        ef.ENCODER_FILE,
        ef.DECODER_FILE,
        ef.MANIFEST_NAME,
        ef.ENCODER_FILE + ".data",
        ef.DECODER_FILE + ".data",
        "tensorrt.timing.cache",
    }
    | {f"{g}.{p}.engine" for g in _V1_GRAPHS for p in ("fp32", "fp16", "bf16")}
    | {f"{g}.{p}.onnx" for g in _V1_GRAPHS for p in ("fp16", "bf16")}
)
_SHOWN = 5  # unexpected files named in a refusal


def write_manifest(directory: str | os.PathLike, manifest: Mapping[str, Any]) -> str:
    """Write ``manifest.json`` into ``directory`` atomically (:func:`transformer_ext.fsutil.atomic_write_json`);
    returns its path. NaN and infinities are refused (they are not JSON).

    The SHA-256 of every file of its ``files`` list that is in ``directory`` is recorded under
    ``"sha256"`` (computed now, so write the manifest after the files), which readers check
    (:func:`transformer_ext.export_format.verify_files`); the shared weights file's is also
    recorded per chunk of :data:`~transformer_ext.export_format.WEIGHTS_CHUNK_BYTES`
    (``weights.chunks``), which a runner checks before it makes a session
    (:func:`transformer_ext.export_format.verify_weights`)."""
    directory = os.fspath(directory)
    path = os.path.join(directory, ef.MANIFEST_NAME)
    manifest = dict(manifest)
    if isinstance(manifest.get("files"), list):
        manifest[ef.HASHES_KEY] = ef.file_hashes(directory, manifest["files"])
    weights = manifest.get("weights")
    data = os.path.join(directory, ef.WEIGHTS_FILE)
    if (
        isinstance(weights, Mapping)
        and weights.get("file") == ef.WEIGHTS_FILE
        and os.path.isfile(data)
        and os.path.getsize(data) == weights.get("bytes")
    ):
        step = ef.WEIGHTS_CHUNK_BYTES
        manifest["weights"] = dict(weights, chunks={"bytes": step, "sha256": ef.chunk_hashes(data, step)})
    atomic_write_json(path, manifest)
    return path


def write_generation_config(
    directory: str | os.PathLike, config: ef.GenerationConfig, name: str = ef.GENERATION_FILE
) -> str:
    """Write ``config`` as ``directory/name`` (default ``generation.json``) atomically; returns its path."""
    path = os.path.join(os.fspath(directory), name)
    atomic_write_json(path, config.to_dict())
    return path


# ------------------------------------------------------------------------------------------
# Export folders: which files are ours, and when a folder may be replaced
# ------------------------------------------------------------------------------------------


def folder_files(directory: str | os.PathLike) -> list[str]:
    """The sorted names in ``directory`` plus ``manifest.json``: the ``files`` entry of a manifest
    about to be written there."""
    return sorted(set(os.listdir(directory)) | {ef.MANIFEST_NAME})


def _plain_name(value: Any) -> Optional[str]:
    return value if isinstance(value, str) and value and os.path.basename(value) == value else None


def owned_files(manifest: Mapping[str, Any]) -> set[str]:
    """The names a folder with this (valid, our format) manifest may hold: the ``files`` list from
    version 2 on; for version 1 the exact names the version-1 tools wrote there."""
    if int(manifest.get("format_version", 0)) >= 2:
        return {f for f in manifest.get("files", []) if _plain_name(f)}
    names = set(_V1_FILES) | {f for f in ef.tokenizer_files(manifest) if _plain_name(f)}
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
    path = directory / ef.MANIFEST_NAME
    if not path.is_file():
        return None, f"it has no {ef.MANIFEST_NAME}"
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        return None, f"its {ef.MANIFEST_NAME} cannot be read ({exc})"
    if not isinstance(manifest, dict) or manifest.get("format") != ef.FORMAT:
        return None, f'its {ef.MANIFEST_NAME} was not written by this package (no "format": "{ef.FORMAT}")'
    version = manifest.get("format_version")
    if isinstance(version, bool) or version not in ef.READABLE_FORMAT_VERSIONS:
        return (
            None,
            f"its {ef.MANIFEST_NAME} has format_version {version!r}, which this version does not know",
        )
    if version >= 2 and not (
        isinstance(manifest.get("files"), list) and all(isinstance(f, str) for f in manifest["files"])
    ):
        return None, f"its {ef.MANIFEST_NAME} does not list the folder's files"
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
    unexpected = [
        e
        for e in entries
        if e not in owned or ((directory / e).is_dir() and not (directory / e).is_symlink())
    ]
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
