"""The export folder as its readers see it (docs/DESIGN.md section 3): file names, axis names, format
marker, the one manifest reader, the one I/O comparator, the one dtype table, the generation config.

Everything that reads an export folder uses this module: the runners in
:mod:`transformer_ext.runtimes`, the translator, and ``export/`` itself (the exporters import it;
it never imports them). It imports only the standard library (checking a generation config
also loads numpy, through :mod:`transformer_ext.decoding`), so a deployment without torch or
onnx can read and check a folder.

Files of a folder written by ``python -m export.onnx`` (format version 3)::

    encoder.onnx, decoder_step.onnx   the graphs (inputs and outputs: :func:`graph_specs`)
    manifest.json                     the format marker, every file of the folder ("files"),
                                      model config, special ids, I/O specs, validation results
    tokenizer.json (+ its files)      named by "tokenizer_files"
    generation.json                   named by "generation_config": beam size, length penalty,
                                      maximum-length rule, special ids (:class:`GenerationConfig`)

Version 2 folders have no generation config (:func:`read_generation_config` then gives the
defaults); version 1 folders also lack the "files" list. Both still load.

dtypes. A tensor's dtype is named as numpy names it (``"float32"``, ``"int64"``, ``"bfloat16"``)
in the manifest, the runners and the Triton configs; :data:`DTYPES` is the single table from
those names to the spellings of each runtime (the ONNX element type, ONNX Runtime's type
string, TensorRT's ``DataType`` member, Triton's config type) and the size of an element.
Code that has ``onnx`` installed gets the names from ``onnx.helper`` (:mod:`export.manifest`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, Callable, Iterable, Mapping, Optional

from .cli import UserError
from .tokenizer import TOKENIZER_FILE

__all__ = [
    # errors
    "ExportError",
    "ManifestError",
    "InvalidGraphError",
    "GenerationConfigError",
    # names
    "MANIFEST_NAME",
    "ENCODER_FILE",
    "DECODER_FILE",
    "FEW_ROWS_DECODER_FILE",
    "WEIGHTS_FILE",
    "TOKENIZER_FILE",
    "GENERATION_FILE",
    "GRAPH_FILES",
    "FORMAT",
    "FORMAT_VERSION",
    "READABLE_FORMAT_VERSIONS",
    "FLAVOURS",
    "NEW_KV_FLAVOURS",
    "CUSTOM_OP_FLAVOUR",
    "CUSTOM_OPS_LIBRARY",
    "CUSTOM_OP_DOMAIN",
    "CUSTOM_OP_TYPE",
    "CUSTOM_OP_REFUSAL",
    "custom_ops_library",
    "QUANTIZATION_SCHEMES",
    "BATCH",
    "SOURCES",
    "SRC_LEN",
    "CACHE_LEN",
    "ATTENTION_OUTPUT",
    # dtypes
    "DType",
    "DTYPES",
    "dtype_from_onnx",
    "dtype_from_ort",
    "dtype_from_tensorrt",
    # manifest
    "graph_specs",
    "head_width",
    "manifest_attention",
    "cross_per_source",
    "CROSS_PER_SOURCE_VERSION",
    "read_manifest",
    "io_problems",
    "check_io",
    "tokenizer_files",
    "manifest_max_positions",
    "manifest_max_cache_len",
    "manifest_quantization",
    "manifest_few_rows",
    "manifest_weights",
    "verify_weights",
    "quantization_cpu_warning",
    "HASHES_KEY",
    "file_sha256",
    "file_hashes",
    "verify_files",
    # generation config
    "GENERATION_FORMAT",
    "GENERATION_FORMAT_VERSION",
    "GenerationConfig",
    "read_generation_config",
]


# ------------------------------------------------------------------------------------------
# Errors (export.ExportError and friends are these classes)
# ------------------------------------------------------------------------------------------


class ExportError(UserError):
    """Base class of every error about export artifacts: writing them (``export/``) or reading them
    (the runners). ``export.ExportError`` is this class."""


class ManifestError(ExportError):
    """``manifest.json`` is missing, invalid, or does not describe the graphs next to it."""


class InvalidGraphError(ExportError):
    """An ``.onnx`` file is missing, corrupt or cannot be loaded by the runtime."""


class GenerationConfigError(ManifestError):
    """The export folder's generation config (``generation.json``) is missing or invalid."""


# ------------------------------------------------------------------------------------------
# Names
# ------------------------------------------------------------------------------------------

MANIFEST_NAME = "manifest.json"
ENCODER_FILE = "encoder.onnx"
DECODER_FILE = "decoder_step.onnx"
GENERATION_FILE = "generation.json"
GRAPH_FILES = {"encoder": ENCODER_FILE, "decoder_step": DECODER_FILE}
FORMAT = "transformer_ext.onnx_export"
# 3: "generation_config" names the generation config file (generation.json).
# 2: "files" lists every file of the folder, "tokenizer_files" names the tokenizer's.
# 1: "files" was {"encoder", "decoder_step", "tokenizer"}.
FORMAT_VERSION = 4
READABLE_FORMAT_VERSIONS = (1, 2, 3, 4)
# "portable": standard ONNX ops, the runner appends each step's new K/V to the caches.
# "tensorscatter": the cache update inside the graph (opset-24 TensorScatter, in place).
# "ort": ONNX Runtime's CPU contrib operator com.microsoft.GroupQueryAttention for the decoder's
# self-attention, which appends to the bound caches in place and attends over them in one node;
# same inputs and outputs as "tensorscatter"; ONNX Runtime only (no TensorRT, no Triton).
# "custom-op": the inputs and outputs of "portable"; each decoder self- and cross-attention one
# transformer_ext.DecodeAttention node of the folder's own ONNX Runtime operator library
# (CUSTOM_OPS_LIBRARY, csrc/ort/; the manifest's "custom_ops" section); ONNX Runtime's CPU
# provider only.
FLAVOURS = ("portable", "tensorscatter", "ort", "custom-op")
# The flavours whose decoder step outputs the new token's K/V for the runner to append.
NEW_KV_FLAVOURS = ("portable", "custom-op")
CUSTOM_OP_FLAVOUR = "custom-op"
# The custom-op flavour's operator library, copied into the export folder, and its one operator.
CUSTOM_OPS_LIBRARY = "libtransformer_ext_ort.so"
CUSTOM_OP_DOMAIN, CUSTOM_OP_TYPE = "transformer_ext", "DecodeAttention"
# What the runners and tools that cannot run it say of a custom-op export ({folder}, {what}).
CUSTOM_OP_REFUSAL = (
    "{folder} is an export of the custom-op flavour (transformer_ext.DecodeAttention, a CPU operator of the "
    "folder's own ONNX Runtime library), which only OrtRunner on the CPU provider runs: export with "
    "--flavour portable for {what}"
)
# Quantized exports (python -m export.onnx --quantize SCHEME): same files, graph inputs and
# outputs as float32 ones; the manifest's optional "quantization" section says how (scheme,
# its settings, per-graph node counts, the quality gate). "int8": dynamic quantization
# (MatMulInteger); "int4", "int8-nbits": block-wise weight-only MatMulNBits (com.microsoft).
QUANTIZATION_SCHEMES = ("int8", "int4", "int8-nbits")
# An int8 export's second decoder step for steps of few rows (the manifest's
# "quantization.few_rows" section, :func:`manifest_few_rows`): the same inputs and outputs, its
# weight products as 8-bit MatMulNBits, whose kernel outruns the dynamic int8 products at one or
# two rows with two or more threads (export/quantize.py, FEW_ROWS).
FEW_ROWS_DECODER_FILE = "decoder_step_few_rows.onnx"

# The shared weights file: every initializer of at least 1 KiB of every graph of the folder, as
# ONNX external data (``location`` / ``offset`` / ``length``), each distinct tensor once, each
# region page-aligned (the manifest's "weights" section, :func:`manifest_weights`; docs/DESIGN.md
# section 3.2). Folders without the section keep their weights inside their graphs.
WEIGHTS_FILE = "weights.data"

# Named (dynamic) axes of the graphs.
BATCH, SRC_LEN, CACHE_LEN = "batch", "src_len", "cache_len"
# The decoder step's cross-attention K/V come once per source (format version 4 on): ``batch`` is
# a multiple of ``sources``, a source's rows consecutive (docs/DESIGN.md section 3.1).
SOURCES = "sources"
# The first format version whose decoder step takes its cross-attention K/V once per source.
CROSS_PER_SOURCE_VERSION = 4

_REQUIRED_KEYS = (
    "format",
    "format_version",
    "flavour",
    "opset",
    "ir_version",
    "files",
    "model_config",
    "graphs",
)
_CONFIG_KEYS = (
    "d_model",
    "n_heads",
    "n_decoder_layers",
    "tgt_vocab_size",
    "max_len",
    "bos_id",
    "eos_id",
    "pad_id",
)


# ------------------------------------------------------------------------------------------
# dtypes
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DType:
    """One tensor element type under every spelling the package meets."""

    name: str  # numpy's name, used by manifests, runners and reports
    onnx: int  # onnx.TensorProto.DataType value
    ort: str  # ONNX Runtime's NodeArg.type
    tensorrt: Optional[str]  # tensorrt.DataType member name (None: TensorRT has no such type)
    triton: str  # data_type in a Triton config.pbtxt
    itemsize: int  # bytes per element


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("float32", 1, "tensor(float)", "FLOAT", "TYPE_FP32", 4),
        DType("float16", 10, "tensor(float16)", "HALF", "TYPE_FP16", 2),
        DType("bfloat16", 16, "tensor(bfloat16)", "BF16", "TYPE_BF16", 2),
        DType("float64", 11, "tensor(double)", None, "TYPE_FP64", 8),
        DType("int64", 7, "tensor(int64)", "INT64", "TYPE_INT64", 8),
        DType("int32", 6, "tensor(int32)", "INT32", "TYPE_INT32", 4),
        DType("int8", 3, "tensor(int8)", "INT8", "TYPE_INT8", 1),
        DType("uint8", 2, "tensor(uint8)", "UINT8", "TYPE_UINT8", 1),
        DType("bool", 9, "tensor(bool)", "BOOL", "TYPE_BOOL", 1),
    )
}
_BY_ONNX = {d.onnx: d.name for d in DTYPES.values()}
_BY_ORT = {d.ort: d.name for d in DTYPES.values()}
_BY_TENSORRT = {d.tensorrt: d.name for d in DTYPES.values() if d.tensorrt}


def dtype_from_onnx(elem_type: int) -> str:
    """The dtype name of an ONNX element type; ``"onnx:<n>"`` for a type outside :data:`DTYPES`."""
    return _BY_ONNX.get(int(elem_type), f"onnx:{int(elem_type)}")


def dtype_from_ort(type_string: str) -> str:
    """The dtype name of an ONNX Runtime type string (``"tensor(float)"`` -> ``"float32"``); an
    unknown string is returned as it is."""
    return _BY_ORT.get(type_string, type_string)


def dtype_from_tensorrt(member_name: str) -> str:
    """The dtype name of a ``tensorrt.DataType`` member name (``"HALF"`` -> ``"float16"``); an
    unknown name is returned in lower case."""
    return _BY_TENSORRT.get(member_name, member_name.lower())


# ------------------------------------------------------------------------------------------
# The graphs' inputs and outputs
# ------------------------------------------------------------------------------------------


def _tensor(name: str, dtype: str, shape: Iterable[Any]) -> dict:
    return {"name": name, "dtype": dtype, "shape": list(shape)}


# The decoder step's optional output (python -m export.onnx --attention): the last decoder
# layer's cross-attention averaged over its heads, [batch, src_len] float32.
ATTENTION_OUTPUT = "attention"


def cross_per_source(graphs: Mapping[str, Any]) -> bool:
    """Whether a decoder step (the manifest's ``graphs``) takes its cross-attention K/V once per
    source (axis :data:`SOURCES`) rather than once per row."""
    for t in graphs["decoder_step"]["inputs"]:
        if t["name"] == "cross_key.0":
            return t["shape"][0] == SOURCES
    return False


def manifest_attention(manifest: Mapping[str, Any]) -> bool:
    """Whether the export's decoder step has the :data:`ATTENTION_OUTPUT` (the manifest's
    ``"attention"``; absent in exports made without it and before it existed)."""
    value = manifest.get("attention", False)
    if not isinstance(value, bool):
        raise ManifestError(f"attention must be true or false, got {value!r}")
    return value


def head_width(config: Mapping[str, Any]) -> int:
    """``d_k``, the width of one attention head, of a model config as a dict: its ``d_kv``, or
    ``d_model / n_heads`` where that is 0 or absent (configs before format version 3)."""
    return int(config.get("d_kv", 0) or 0) or int(config["d_model"]) // int(config["n_heads"])


def graph_specs(
    config: Mapping[str, Any],
    flavour: str = "portable",
    attention: bool = False,
    cross_per_source: bool = True,
) -> dict:
    """Every input and output of both graphs: ``{"encoder": {"inputs": [...], "outputs": [...]},
    "decoder_step": {...}}``, each tensor ``{"name", "dtype", "shape"}`` where a shape entry is an
    int (static) or an axis name (``batch``, ``sources``, ``src_len``, ``cache_len``).

    ``cross_per_source`` (exports of format version 4 on): the decoder step's ``cross_key.{i}`` /
    ``cross_value.{i}`` are ``[sources, heads, src_len, d_k]``, one row per source, ``batch`` a
    multiple of ``sources``; False: ``[batch, ...]``, one per row (versions 1-3).

    ``config`` is a model config as a dict (``TransformerConfig.to_dict()``). The exporter names
    the graphs from it, validation checks them against it, and the runners check the loaded
    sessions against the copy in the manifest. ``attention``: the decoder step also outputs
    :data:`ATTENTION_OUTPUT` ``[batch, src_len]``, last.
    """
    if flavour not in FLAVOURS:
        raise ValueError(f"flavour must be one of {FLAVOURS}, got {flavour!r}")
    d_model, heads = int(config["d_model"]), int(config["n_heads"])
    d_k = head_width(config)
    layers, vocab = int(config["n_decoder_layers"]), int(config["tgt_vocab_size"])
    cross = [BATCH, heads, SRC_LEN, d_k]
    step_cross = [SOURCES if cross_per_source else BATCH, heads, SRC_LEN, d_k]
    cache = [BATCH, heads, CACHE_LEN, d_k]

    encoder = {
        "inputs": [_tensor("input_ids", "int64", [BATCH, SRC_LEN]), _tensor("src_lengths", "int64", [BATCH])],
        "outputs": [_tensor("encoder_out", "float32", [BATCH, SRC_LEN, d_model])]
        + [
            _tensor(f"cross_{kind}.{i}", "float32", cross) for i in range(layers) for kind in ("key", "value")
        ],
    }
    inputs = [
        _tensor("input_ids", "int64", [BATCH, 1]),
        _tensor("positions", "int64", [BATCH]),
        _tensor("src_lengths", "int64", [BATCH]),
    ]
    inputs += [
        _tensor(f"self_{kind}.{i}", "float32", cache) for i in range(layers) for kind in ("key", "value")
    ]
    inputs += [
        _tensor(f"cross_{kind}.{i}", "float32", step_cross)
        for i in range(layers)
        for kind in ("key", "value")
    ]
    outputs = [_tensor("logits", "float32", [BATCH, vocab])]
    if flavour in NEW_KV_FLAVOURS:
        outputs += [
            _tensor(f"new_{kind}.{i}", "float32", [BATCH, heads, 1, d_k])
            for i in range(layers)
            for kind in ("key", "value")
        ]
    else:
        outputs += [
            _tensor(f"present_{kind}.{i}", "float32", cache)
            for i in range(layers)
            for kind in ("key", "value")
        ]
    if attention:
        outputs.append(_tensor(ATTENTION_OUTPUT, "float32", [BATCH, SRC_LEN]))
    return {"encoder": encoder, "decoder_step": {"inputs": inputs, "outputs": outputs}}


def io_problems(
    spec: Mapping[str, Any],
    actual_inputs: list[dict],
    actual_outputs: list[dict],
    *,
    compare_dtypes: bool = True,
) -> list[str]:
    """Every difference between a graph's inputs/outputs (``[{"name", "dtype", "shape"}]``, in
    order; a shape entry is an int, an axis name, or ``None`` for an unnamed dynamic axis) and
    ``spec`` (an entry of :func:`graph_specs`). ``compare_dtypes=False`` compares names, order and
    shapes only (graphs converted to another precision differ in dtype on purpose)."""
    problems = []
    for kind, want, have in (
        ("input", spec["inputs"], actual_inputs),
        ("output", spec["outputs"], actual_outputs),
    ):
        want_names = [t["name"] for t in want]
        have_names = [t["name"] for t in have]
        if want_names != have_names:
            missing = [n for n in want_names if n not in have_names]
            extra = [n for n in have_names if n not in want_names]
            problems.append(
                f"{kind} names differ (missing {missing}, unexpected {extra})"
                if missing or extra
                else f"{kind}s are in another order: {have_names}"
            )
            continue
        for w, h in zip(want, have):
            if compare_dtypes and w["dtype"] != h["dtype"]:
                problems.append(f"{kind} {w['name']}: dtype {h['dtype']} != {w['dtype']}")
            if h["shape"] is None or list(w["shape"]) != list(h["shape"]):
                shape = None if h["shape"] is None else list(h["shape"])
                problems.append(f"{kind} {w['name']}: shape {shape} != {list(w['shape'])}")
    return problems


def check_io(
    graph: str,
    spec: Mapping[str, Any],
    actual_inputs: list[dict],
    actual_outputs: list[dict],
    *,
    compare_dtypes: bool = True,
) -> None:
    """:func:`io_problems`, raised as one :class:`ManifestError` naming ``graph`` and listing every difference."""
    problems = io_problems(spec, actual_inputs, actual_outputs, compare_dtypes=compare_dtypes)
    if problems:
        raise ManifestError(f"{graph} does not match the manifest: " + "; ".join(problems))


# ------------------------------------------------------------------------------------------
# The manifest
# ------------------------------------------------------------------------------------------


def _plain_name(value: Any) -> bool:
    return (
        isinstance(value, str)
        and bool(value)
        and os.path.basename(value) == value
        and value not in (".", "..")
    )


def _check_file_lists(path: str, manifest: Mapping[str, Any], version: int) -> None:
    """The manifest's ``files``, ``tokenizer_files`` and ``generation_config`` as its version has them."""
    files = manifest["files"]
    if version >= 2:
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            raise ManifestError(f"{path}: files must list the names of the folder's files")
        if not isinstance(manifest.get("tokenizer_files"), list) or not all(
            _plain_name(f) for f in manifest["tokenizer_files"]
        ):
            raise ManifestError(
                f"{path}: tokenizer_files must list the tokenizer's files (an empty list for none)"
            )
    elif not isinstance(files, dict):
        raise ManifestError(f"{path}: files must be an object in a version-1 manifest")
    if version >= 3:
        name = manifest.get("generation_config")
        if not _plain_name(name):
            raise ManifestError(
                f"{path}: generation_config must name the generation config file "
                f"(e.g. {GENERATION_FILE!r}), got {name!r}"
            )
        unlisted = [f for f in [*manifest["tokenizer_files"], name] if f not in files]
        if unlisted:
            raise ManifestError(f"{path}: {unlisted} are named by the manifest but not in its files list")


def read_manifest(directory: str | os.PathLike, *, verify: bool = False) -> dict:
    """Read and check ``directory/manifest.json``: the format marker and a readable version, the
    keys every reader relies on, and graphs that follow from its model config and flavour.

    The files whose SHA-256 the manifest records (``"sha256"``, written by every exporter of this
    version) are checked against it (:func:`verify_files`): the small ones (tokenizer files,
    generation config) always, the graphs and engines too with ``verify=True``. A folder
    written before the hashes were recorded has none to check and loads as before.

    Raises:
        ManifestError: the folder or its manifest is missing, not JSON, of another tool or of an
            unknown version, or inconsistent, or a file differs from its recorded SHA-256; the
            message names the file and what is wrong.
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise ManifestError(f"export folder not found: {directory} (run `python -m export.onnx` first)")
    path = os.path.join(directory, MANIFEST_NAME)
    if not os.path.isfile(path):
        raise ManifestError(
            f"{path} not found: an export folder holds {ENCODER_FILE}, {DECODER_FILE} and {MANIFEST_NAME}"
        )
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
    version = manifest["format_version"]
    if manifest["format"] != FORMAT or isinstance(version, bool) or version not in READABLE_FORMAT_VERSIONS:
        newer = (
            manifest["format"] == FORMAT
            and isinstance(version, int)
            and not isinstance(version, bool)
            and version > FORMAT_VERSION
        )
        hint = "; it was written by a newer transformer_ext: upgrade it" if newer else ""
        raise ManifestError(
            f"{path} is not a {FORMAT} manifest of version {' or '.join(map(str, READABLE_FORMAT_VERSIONS))} "
            f"(format={manifest['format']!r}, version={version!r}){hint}"
        )
    _check_file_lists(path, manifest, version)
    if manifest["flavour"] not in FLAVOURS:
        raise ManifestError(f"{path}: unknown flavour {manifest['flavour']!r}, expected one of {FLAVOURS}")
    config = manifest["model_config"]
    if not isinstance(config, dict) or any(k not in config for k in _CONFIG_KEYS):
        raise ManifestError(f"{path}: model_config must hold at least {list(_CONFIG_KEYS)}")
    graphs = manifest["graphs"]
    for graph in GRAPH_FILES:
        if (
            not isinstance(graphs, dict)
            or graph not in graphs
            or not isinstance(graphs[graph], dict)
            or not {"inputs", "outputs"} <= set(graphs[graph])
        ):
            raise ManifestError(f"{path}: graphs.{graph} must list its inputs and outputs")
    try:
        attention = manifest_attention(manifest)
    except ManifestError as exc:
        raise ManifestError(f"{path}: {exc}") from None
    try:
        expected = graph_specs(
            config, manifest["flavour"], attention, cross_per_source=version >= CROSS_PER_SOURCE_VERSION
        )
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        raise ManifestError(f"{path}: model_config is invalid ({exc})") from exc
    if graphs != expected:
        raise ManifestError(
            f"{path}: the graphs it lists do not follow from its model_config and flavour "
            f"{manifest['flavour']!r} (edited by hand, or written by another version?)"
        )
    try:
        manifest_quantization(manifest)
        manifest_weights(manifest)
    except ManifestError as exc:
        raise ManifestError(f"{path}: {exc}") from None
    verify_files(directory, manifest, graphs=verify)
    verify_weights(directory, manifest, sha256=False)
    return manifest


# ``"sha256": {file name: hex digest}`` for every listed file but the manifest itself.
HASHES_KEY = "sha256"
# Files checked only on request (large: hashing them costs a read of the whole file).
_LARGE_SUFFIXES = (".onnx", ".data", ".engine", ".plan", ".cache")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, as lower-case hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_hashes(directory: str | os.PathLike, names: Iterable[str]) -> dict:
    """``{name: SHA-256}`` of the files ``names`` in ``directory`` (the manifest itself excluded)."""
    directory = os.fspath(directory)
    return {
        name: file_sha256(os.path.join(directory, name))
        for name in sorted(set(names))
        if name != MANIFEST_NAME and os.path.isfile(os.path.join(directory, name))
    }


def verify_files(directory: str | os.PathLike, manifest: Mapping[str, Any], *, graphs: bool = False) -> None:
    """Check the files of ``directory`` against the SHA-256 the manifest records.

    The small files always; graphs, external weights and engines (``.onnx``, ``.data``,
    ``.engine``, ``.plan``, ``.cache``) only with ``graphs=True``. A manifest without hashes (a
    folder of an earlier version) passes, and so does a missing file (its reader reports it).
    Raises :class:`ManifestError` naming the file.
    """
    directory = os.fspath(directory)
    path = os.path.join(directory, MANIFEST_NAME)
    hashes = manifest.get(HASHES_KEY)
    if hashes is None:
        return
    if not isinstance(hashes, dict) or not all(
        _plain_name(k) and isinstance(v, str) and _HEX64.match(v) for k, v in hashes.items()
    ):
        raise ManifestError(f"{path}: {HASHES_KEY} must map file names to SHA-256 hex digests")
    for name, expected in sorted(hashes.items()):
        if not graphs and name.endswith(_LARGE_SUFFIXES):
            continue
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
            continue  # a missing file is reported by what needs it, with what to do
        actual = file_sha256(file)
        if actual != expected:
            raise ManifestError(
                f"{file} is not the file this export was written with: its SHA-256 is {actual}, "
                f"{MANIFEST_NAME} records {expected} (the file was changed or replaced; export the model "
                "again, or restore the file)"
            )


def tokenizer_files(manifest: Mapping[str, Any]) -> list[str]:
    """The tokenizer's file names in an export folder, for manifests of every readable version."""
    if int(manifest.get("format_version", 0)) >= 2:
        return list(manifest.get("tokenizer_files") or [])
    files = manifest.get("files")
    return list(files.get("tokenizer") or []) if isinstance(files, dict) else []


def _int_field(value: Any) -> Optional[int]:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def manifest_max_positions(manifest: Mapping[str, Any]) -> Optional[int]:
    """The model's ``max_len`` (positional-encoding rows): ``max_positions``, else the config's."""
    value = _int_field(manifest.get("max_positions"))
    if value is not None:
        return value
    config = manifest.get("model_config")
    return _int_field(config.get("max_len")) if isinstance(config, Mapping) else None


def manifest_max_cache_len(manifest: Mapping[str, Any]) -> Optional[int]:
    """The largest cache capacity the export supports (``max_cache_len``), else :func:`manifest_max_positions`."""
    value = _int_field(manifest.get("max_cache_len"))
    return value if value is not None else manifest_max_positions(manifest)


def manifest_quantization(manifest: Mapping[str, Any]) -> Optional[dict]:
    """The manifest's ``"quantization"`` section (a dict with at least ``"scheme"``), or ``None``
    for a float32 export. Raises :class:`ManifestError` for a section of another shape or an
    unknown scheme (a reader must not run graphs whose quantization it does not know)."""
    section = manifest.get("quantization")
    if section is None:
        return None
    if not isinstance(section, Mapping) or section.get("scheme") not in QUANTIZATION_SCHEMES:
        raise ManifestError(
            f"{MANIFEST_NAME}: quantization must be null or an object whose scheme is one of "
            f"{list(QUANTIZATION_SCHEMES)}, got {_show(section)}"
        )
    return dict(section)


def manifest_few_rows(manifest: Mapping[str, Any]) -> Optional[dict]:
    """The quantization section's ``"few_rows"`` entry (an int8 export's decoder step for steps of
    at most ``max_rows`` rows run with at least ``min_threads`` intra-op threads, in the file
    ``file``), or ``None`` when the export has none. Raises :class:`ManifestError` for an entry
    of another shape, naming the key."""
    section = manifest_quantization(manifest)
    entry = section.get("few_rows") if section else None
    if entry is None:
        return None
    if not isinstance(entry, Mapping):
        raise ManifestError(
            f"{MANIFEST_NAME}: quantization.few_rows must be null or an object, got {_show(entry)}"
        )
    if entry.get("file") != FEW_ROWS_DECODER_FILE:
        raise ManifestError(
            f"{MANIFEST_NAME}: quantization.few_rows.file must be {FEW_ROWS_DECODER_FILE!r}, got {_show(entry.get('file'))}"
        )
    for key in ("max_rows", "min_threads"):
        value = entry.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ManifestError(
                f"{MANIFEST_NAME}: quantization.few_rows.{key} must be an integer >= 1, got {_show(value)}"
            )
    files = manifest.get("files")
    if isinstance(files, list) and FEW_ROWS_DECODER_FILE not in files:
        raise ManifestError(
            f"{MANIFEST_NAME}: quantization.few_rows names {FEW_ROWS_DECODER_FILE}, which is not in its files list"
        )
    return dict(entry)


def manifest_weights(manifest: Mapping[str, Any]) -> Optional[dict]:
    """The manifest's ``"weights"`` section (``{"file": WEIGHTS_FILE, "bytes": size, ...}``: the
    shared weights file every graph reads its large initializers from), or ``None`` for a folder
    whose graphs hold their own weights. Raises :class:`ManifestError` for a section of another
    shape, naming the key."""
    section = manifest.get("weights")
    if section is None:
        return None
    if not isinstance(section, Mapping) or section.get("file") != WEIGHTS_FILE:
        raise ManifestError(
            f"{MANIFEST_NAME}: weights must be null or an object whose file is {WEIGHTS_FILE!r}, "
            f"got {_show(section)}"
        )
    size = section.get("bytes")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ManifestError(
            f"{MANIFEST_NAME}: weights.bytes must be the size of {WEIGHTS_FILE}, got {_show(size)}"
        )
    files = manifest.get("files")
    if isinstance(files, list) and WEIGHTS_FILE not in files:
        if any(graph in files for graph in (ENCODER_FILE, DECODER_FILE)):
            raise ManifestError(
                f"{MANIFEST_NAME}: weights names {WEIGHTS_FILE}, which is not in its files list"
            )
        return None  # a folder of engines beside the export (python -m export.tensorrt): no graphs here
    return dict(section)


def verify_weights(directory: str | os.PathLike, manifest: Mapping[str, Any], *, sha256: bool = True) -> None:
    """Check the shared weights file of the export ``directory`` before any graph reads it: it
    exists, has the size the manifest records and (``sha256``) the SHA-256 it records. A folder
    without a shared weights file passes.

    Raises :class:`ManifestError`, one line naming the file and what to do."""
    section = manifest_weights(manifest)
    if section is None:
        return
    path = os.path.join(os.fspath(directory), WEIGHTS_FILE)
    if not os.path.isfile(path):
        raise ManifestError(
            f"{path} not found: the graphs of this export read their weights from it "
            "(copy the whole export folder, or export the model again)"
        )
    size = os.path.getsize(path)
    if size != section["bytes"]:
        raise ManifestError(
            f"{path} holds {size} bytes, {MANIFEST_NAME} records {section['bytes']} (truncated or replaced; "
            "copy the whole export folder again, or export the model again)"
        )
    expected = (manifest.get(HASHES_KEY) or {}).get(WEIGHTS_FILE)
    if sha256 and isinstance(expected, str):
        actual = file_sha256(path)
        if actual != expected:
            raise ManifestError(
                f"{path} is not the file this export was written with: its SHA-256 is {actual}, "
                f"{MANIFEST_NAME} records {expected} (the file was changed or replaced; export the model "
                "again, or restore the file)"
            )


def custom_ops_library(directory: str | os.PathLike, manifest: Mapping[str, Any]) -> Optional[str]:
    """The path of the operator library an export of the custom-op flavour runs with (the
    manifest's ``custom_ops`` section), checked: it exists and has the SHA-256 the manifest
    records. None for the other flavours.

    Raises :class:`ManifestError`, one line naming the file and what to do."""
    if manifest.get("flavour") != CUSTOM_OP_FLAVOUR:
        return None
    section = manifest.get("custom_ops")
    name = section.get("library") if isinstance(section, dict) else None
    expected = section.get("sha256") if isinstance(section, dict) else None
    if name != CUSTOM_OPS_LIBRARY or not isinstance(expected, str) or not _HEX64.match(expected):
        raise ManifestError(
            f"{os.path.join(os.fspath(directory), MANIFEST_NAME)}: a custom-op export's manifest must name its "
            f"operator library in custom_ops ({{'library': {CUSTOM_OPS_LIBRARY!r}, 'sha256': ...}}); export it again"
        )
    path = os.path.join(os.fspath(directory), name)
    if not os.path.isfile(path):
        raise ManifestError(
            f"{path} not found: this custom-op export runs its attention with that operator library "
            "(copy the whole export folder, or export the model again)"
        )
    if file_sha256(path) != expected:
        raise ManifestError(
            f"{path} is not the operator library this export was written with (its SHA-256 differs from "
            f"the one {MANIFEST_NAME} records): copy the whole export folder again, or export the model again"
        )
    return path


# The instruction-set extensions whose absence makes ONNX Runtime run other quantized kernels
# (int8 dot products: VNNI, AVX-512, AMX on x86; dot product / int8 matrix multiply on ARM).
QUANTIZED_KERNEL_FLAGS = (
    "avx2",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx_vnni",
    "amx_int8",
    "asimddp",
    "i8mm",
)


def quantization_cpu_warning(manifest: Mapping[str, Any], folder: Any = "") -> Optional[str]:
    """What differs between the CPU a quantized export was made (and gated) on and this one, as
    a warning to log, or ``None``: the kernel-deciding flags of :data:`QUANTIZED_KERNEL_FLAGS` the
    export's CPU had (the manifest's ``quantization.cpu.isa``) and this CPU lacks. ONNX Runtime
    then runs other kernels (MatMulNBits without an int8 kernel: float32), so the speed differs
    and the results may differ slightly from the gate's; the folder still runs."""
    section = manifest_quantization(manifest)
    cpu = section.get("cpu") if section else None
    if not isinstance(cpu, Mapping) or not isinstance(cpu.get("isa"), list):
        return None
    from .cpu_features import cpu_flags

    here = cpu_flags()
    if not here.flags:  # nothing known about this CPU: nothing to compare
        return None
    missing = [f for f in QUANTIZED_KERNEL_FLAGS if f in cpu["isa"] and f not in here.flags]
    if not missing:
        return None
    where = f"{folder}: " if folder else ""
    fallback = " (MatMulNBits: float32 where no int8 kernel exists)" if "bits" in section else ""
    return (
        f"{where}its {section['scheme']} graphs were exported and gated on a CPU with {', '.join(missing)}, "
        f"which this CPU ({here.model or here.arch}) lacks: ONNX Runtime runs other kernels here{fallback}, "
        "so the speed differs and results may differ slightly from the gate's; to check, quantize the "
        "float32 export again on this machine (python -m export.quantize), which reruns the gate"
    )


# ------------------------------------------------------------------------------------------
# The generation config
# ------------------------------------------------------------------------------------------

GENERATION_FORMAT = "transformer_ext.generation_config"
GENERATION_FORMAT_VERSION = 1
_SPECIAL_REQUIRED = ("pad", "bos", "eos")
_SPECIAL_ALLOWED = ("pad", "bos", "eos", "unk")


@dataclass(frozen=True)
class GenerationConfig:
    """How a deployment decodes with an export folder, as ``generation.json`` records it.

    The generation budget of a source of ``n`` tokens is ``min(floor(max_len_a * n + max_len_b),
    max_new_tokens)`` tokens, at least 1, EOS included (a model converted from transformers has
    ``max_len_a`` 0 and ``max_len_b`` = ``max_new_tokens``: the same budget for every source); EOS is suppressed before
    ``min_new_tokens`` tokens (:mod:`transformer_ext.decoding`). ``beam_size`` 1 is greedy search.
    ``special_tokens`` are the ids of the model and its tokenizer (``pad``, ``bos``, ``eos`` and,
    with a tokenizer, ``unk``); they must equal the manifest's.
    """

    special_tokens: Mapping[str, int]
    max_new_tokens: int  # the largest budget; at most the export's max_cache_len
    beam_size: int = 1
    length_penalty: str = "gnmt"  # one of transformer_ext.decoding.LENGTH_PENALTIES
    alpha: float = 0.6
    max_len_a: float = 1.5  # the budget of transformer_ext.translate's defaults
    max_len_b: float = 10.0
    min_new_tokens: int = 0

    def to_dict(self) -> dict:
        """The content of ``generation.json``: format marker and version first, then every field."""
        body = asdict(self)
        body["special_tokens"] = dict(self.special_tokens)
        order = (
            "beam_size",
            "length_penalty",
            "alpha",
            "max_len_a",
            "max_len_b",
            "min_new_tokens",
            "max_new_tokens",
            "special_tokens",
        )
        ordered = {k: body.pop(k) for k in order}
        return {"format": GENERATION_FORMAT, "format_version": GENERATION_FORMAT_VERSION, **ordered, **body}

    def to_search_options(self, base: Any = None) -> Any:
        """This config as a :class:`transformer_ext.decoding.SearchOptions` laid over ``base``
        (default: the package's defaults) with ``dataclasses.replace``: the beam size, the length
        penalty (``length_penalty`` is its formula, ``alpha`` its exponent), the budget
        (``max_new_tokens`` the cap of ``floor(max_len_a * n + max_len_b)``) and ``min_new_tokens``."""
        from dataclasses import replace

        from .decoding import SearchOptions

        return replace(
            base if base is not None else SearchOptions(),
            beam_size=self.beam_size,
            length_penalty=float(self.alpha),
            length_penalty_type=self.length_penalty,
            max_decoding_length=self.max_new_tokens,
            max_len_a=float(self.max_len_a),
            max_len_b=float(self.max_len_b),
            min_decoding_length=min(self.min_new_tokens, self.max_new_tokens),
        )

    @classmethod
    def defaults_for(cls, manifest: Mapping[str, Any], **overrides: Any) -> "GenerationConfig":
        """The default config of an export: its special ids, ``max_new_tokens`` = its largest cache
        capacity; ``overrides`` replace fields. Checked as :meth:`from_dict` checks a file."""
        special = manifest.get("special_tokens")
        if not isinstance(special, Mapping):
            config = manifest.get("model_config") or {}
            special = {k: config.get(f"{k}_id") for k in _SPECIAL_REQUIRED}
        values = {f.name: f.default for f in fields(cls) if f.default is not MISSING}
        values.update(special_tokens=dict(special), max_new_tokens=manifest_max_cache_len(manifest) or 1)
        values.update(overrides)
        data = {"format": GENERATION_FORMAT, "format_version": GENERATION_FORMAT_VERSION, **values}
        return cls.from_dict(data, "the generation options", manifest=manifest)

    @classmethod
    def from_dict(
        cls, data: Any, source: str = GENERATION_FILE, *, manifest: Optional[Mapping[str, Any]] = None
    ) -> "GenerationConfig":
        """Check ``data`` (the parsed ``generation.json``) field by field: every field present and
        of its JSON type, no unknown field, values in range; with ``manifest``, ``max_new_tokens``
        within its cache capacity and the special ids equal to its own.

        Raises:
            GenerationConfigError: naming ``source``, the field and what was expected.
        """
        from .decoding import LENGTH_PENALTIES  # numpy: imported only where a config is checked

        def fail(message: str) -> GenerationConfigError:
            return GenerationConfigError(f"{source}: {message}")

        if not isinstance(data, dict):
            raise fail(f"must hold a JSON object, got {type(data).__name__}")
        if data.get("format") != GENERATION_FORMAT:
            raise fail(f"format must be {GENERATION_FORMAT!r}, got {data.get('format')!r}")
        version = data.get("format_version")
        if isinstance(version, bool) or version != GENERATION_FORMAT_VERSION:
            raise fail(
                f"unsupported format_version {version!r} (this version reads {GENERATION_FORMAT_VERSION})"
            )
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in data]
        if missing:
            raise fail(f"missing fields {missing}")
        unknown = sorted(k for k in data if k not in names and k not in ("format", "format_version"))
        if unknown:
            raise fail(
                f"unknown fields {unknown} (a version {GENERATION_FORMAT_VERSION} generation config has {names})"
            )

        def integer(name: str, low: int) -> int:
            value = data[name]
            if isinstance(value, bool) or not isinstance(value, int):
                raise fail(f"{name} must be an integer, got {_show(value)}")
            if value < low:
                raise fail(f"{name} must be >= {low}, got {value}")
            return value

        def number(name: str) -> float:
            value = data[name]
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
            ):
                raise fail(f"{name} must be a finite number >= 0, got {_show(value)}")
            return float(value)

        beam_size = integer("beam_size", 1)
        if data["length_penalty"] not in LENGTH_PENALTIES:
            raise fail(
                f"length_penalty must be one of {list(LENGTH_PENALTIES)}, got {_show(data['length_penalty'])}"
            )
        if data["length_penalty"] == "hf":  # transformers' exponent may be negative
            alpha = data["alpha"]
            if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
                raise fail(f"alpha must be a finite number, got {_show(alpha)}")
            alpha = float(alpha)
        else:
            alpha = number("alpha")
        a, b = number("max_len_a"), number("max_len_b")
        min_new, max_new = integer("min_new_tokens", 0), integer("max_new_tokens", 1)
        if min_new > max_new:
            raise fail(f"min_new_tokens ({min_new}) must be <= max_new_tokens ({max_new})")
        special = data["special_tokens"]
        if (
            not isinstance(special, dict)
            or any(k not in special for k in _SPECIAL_REQUIRED)
            or any(k not in _SPECIAL_ALLOWED for k in special)
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in special.values())
        ):
            raise fail(
                f"special_tokens must map {list(_SPECIAL_REQUIRED)} (and optionally 'unk') to ids >= 0, "
                f"got {_show(special)}"
            )
        if manifest is not None:
            _check_generation_against_manifest(manifest, max_new, special, fail)
        return cls(
            beam_size=beam_size,
            length_penalty=data["length_penalty"],
            alpha=alpha,
            max_len_a=a,
            max_len_b=b,
            min_new_tokens=min_new,
            max_new_tokens=max_new,
            special_tokens=dict(special),
        )


def _check_generation_against_manifest(
    manifest: Mapping[str, Any],
    max_new: int,
    special: Mapping[str, int],
    fail: Callable[[str], GenerationConfigError],
) -> None:
    """A generation config's ``max_new_tokens`` within the export's cache capacity, its special
    ids equal to the manifest's and to the model config's."""
    capacity = manifest_max_cache_len(manifest)
    if capacity is not None and max_new > capacity:
        raise fail(f"max_new_tokens {max_new} exceeds the export's cache capacity max_cache_len = {capacity}")
    theirs = manifest.get("special_tokens")
    if isinstance(theirs, Mapping) and dict(theirs) != dict(special):
        raise fail(f"special_tokens {dict(special)} differ from the manifest's {dict(theirs)}")
    config = manifest.get("model_config") or {}
    for key in _SPECIAL_REQUIRED:
        if f"{key}_id" in config and config[f"{key}_id"] != special[key]:
            raise fail(
                f"special_tokens.{key} = {special[key]} differs from the model config's "
                f"{key}_id = {config[f'{key}_id']}"
            )


def _show(value: Any) -> str:
    """``value`` as JSON when it is JSON, else its repr (NaN, infinities, Python objects)."""
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return repr(value)


def read_generation_config(
    directory: str | os.PathLike, manifest: Optional[Mapping[str, Any]] = None
) -> GenerationConfig:
    """The generation config of an export folder.

    Format version 3 folders name the file in their manifest (``"generation_config"``); it is
    read and checked against the manifest (:meth:`GenerationConfig.from_dict`). Folders of
    versions 1 and 2 have none: the defaults for the folder (:meth:`GenerationConfig.defaults_for`).
    ``manifest``: the folder's manifest if already read (else :func:`read_manifest` reads it).

    Raises:
        ManifestError: the manifest is missing or invalid.
        GenerationConfigError: the file is missing, not JSON or invalid (naming the file and field).
    """
    directory = os.fspath(directory)
    if manifest is None:
        manifest = read_manifest(directory)
    name = manifest.get("generation_config")
    if name is None:
        return GenerationConfig.defaults_for(manifest)
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        raise GenerationConfigError(
            f"{path} not found: the manifest names it as the folder's generation config "
            "(export the model again)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GenerationConfigError(f"{path} is not valid JSON: {exc}") from exc
    return GenerationConfig.from_dict(data, path, manifest=manifest)
