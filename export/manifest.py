"""The I/O contract of the exported graphs and the ``manifest.json`` that records it.

Imports only the standard library, so the ONNX Runtime runner can read and check a manifest
without torch or onnx installed. :func:`graph_specs` is the single definition of every input
and output of ``encoder.onnx`` and ``decoder_step.onnx`` (DESIGN.md section 3): the exporter
names the graphs from it, validation checks them against it, and the runner checks the loaded
sessions against the copy stored in the manifest.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Iterable, Mapping

from . import ManifestError

logger = logging.getLogger(__name__)

__all__ = [
    "MANIFEST_NAME",
    "ENCODER_FILE",
    "DECODER_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "FLAVOURS",
    "graph_specs",
    "write_manifest",
    "read_manifest",
    "check_io",
]

MANIFEST_NAME = "manifest.json"
ENCODER_FILE = "encoder.onnx"
DECODER_FILE = "decoder_step.onnx"
FORMAT = "transformer_ext.onnx_export"
FORMAT_VERSION = 1
FLAVOURS = ("portable", "tensorscatter")

# Named (dynamic) axes of the graphs.
BATCH, SRC_LEN, CACHE_LEN = "batch", "src_len", "cache_len"

_REQUIRED_KEYS = ("format", "format_version", "flavour", "opset", "ir_version", "files", "model_config", "graphs")
_CONFIG_KEYS = ("d_model", "n_heads", "n_decoder_layers", "tgt_vocab_size", "max_len", "bos_id", "eos_id", "pad_id")


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
    """Write ``manifest.json`` into ``directory`` (temp file + rename); returns its path."""
    path = os.path.join(os.fspath(directory), MANIFEST_NAME)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2, sort_keys=False, ensure_ascii=False, allow_nan=True)
        f.write("\n")
    os.replace(tmp, path)
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
    if manifest["format"] != FORMAT or manifest["format_version"] != FORMAT_VERSION:
        raise ManifestError(
            f"{path} is not a {FORMAT} v{FORMAT_VERSION} manifest "
            f"(format={manifest['format']!r}, version={manifest['format_version']!r})"
        )
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
