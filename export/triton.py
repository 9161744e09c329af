"""``python -m export.triton``: a Triton Inference Server model repository from an export folder.

Command line::

    python -m export.triton --model onnx_export --output-dir triton_repository
    python -m export.triton --model onnx_export --output-dir repo --instance-kind gpu --max-batch-size 32
    python -m export.triton --help

Python::

    from export.triton import export_triton
    result = export_triton("onnx_export", "triton_repository")
    result.models            # {"encoder": Path, "decoder_step": Path, ...}

Reads the folder written by ``python -m export.onnx`` (``encoder.onnx``, ``decoder_step.onnx``,
``manifest.json``; docs/DESIGN.md section 3), optionally with TensorRT engines listed in its manifest
(``python -m export.tensorrt``), and writes a model repository::

    <repo>/encoder/config.pbtxt                  1/model.onnx  (or 1/model.plan)
    <repo>/decoder_step/config.pbtxt             1/model.onnx  stateless: the caches travel with every request
    <repo>/decoder_step_stateful/config.pbtxt    1/model.onnx  tensorscatter flavour only: sequence batcher,
                                                               the caches are Triton implicit state
    <repo>/translator/config.pbtxt               1/model.py    Python backend (BLS): greedy / beam search
                                                 1/_vendor/transformer_ext/decoding/*.py  (the shared decoding package)

Every ``config.pbtxt`` is generated from the manifest (names, dtypes, dims) and, before the
repository appears, parsed with Triton's own model-config protobuf (``tritonclient``, when
installed) and checked against the ONNX graphs or the TensorRT engines' I/O
(:func:`validate_repository`).

Batch dimension. The encoder and decoder models use ``max_batch_size > 0``: Triton owns the
leading ``batch`` axis of every tensor (each graph's first axis is ``batch``, docs/DESIGN.md section 3),
so the dynamic batcher may merge the rows of concurrent requests whose other dims agree, and the
sequence batcher may run one cache row per sequence. ``dims`` therefore omit the batch axis;
tensors whose full shape is ``[batch]`` (``src_lengths``, ``positions``) are declared as
``dims: [1]`` with ``reshape: { shape: [] }`` (Triton's documented form), so a client sends them
as ``[batch, 1]``. Named dynamic axes (``src_len``, ``cache_len``) become ``-1``. The translator
(Python backend) uses ``max_batch_size: 0``: one request carries a whole batch of sources.

Files. Every option is checked, and the export folder's graphs are read, before anything is
written. The repository is built in a temporary sibling of the target
(:class:`transformer_ext.fsutil.StagedDir`), validated there, then swapped into place; a failure
or an interruption (SIGINT, SIGTERM) leaves no partial repository and an existing one intact,
and the temporary folder of a killed earlier run is removed by the next one. The repository
holds a marker, ``transformer_ext.repository.json``, listing every file written (Triton ignores
files at the top of a repository). An existing non-empty target is refused unless
``force=True``, and even then it is replaced only when its marker is ours and it holds nothing
but the files the marker lists (a repository of the version before the marker: nothing but the
files that version wrote). A target equal to, inside, or containing the export folder is
always refused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from transformer_ext.cli import DefaultsHelpFormatter, add_debug_flag, add_option, run_cli
from transformer_ext.convert.generation import read_generation_defaults
from transformer_ext.export_format import (
    CUSTOM_OP_FLAVOUR,
    CUSTOM_OP_REFUSAL,
    DECODER_FILE,
    DTYPES,
    ENCODER_FILE,
    SOURCES,
    WEIGHTS_FILE,
    head_width,
    io_problems,
    read_generation_config,
    read_manifest,
)
from transformer_ext.fsutil import StagedDir, atomic_write_json

from . import ExportError, InvalidGraphError, ManifestError, OutputFolderError
from .manifest import check_output_path, make_parents, named_write_error, remove_made_parents

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_REPO_DIR",
    "BACKENDS",
    "INSTANCE_KINDS",
    "ENCODER_MODEL",
    "DECODER_MODEL",
    "STATEFUL_DECODER_MODEL",
    "TRANSLATOR_MODEL",
    "TritonExportError",
    "TritonConfigError",
    "TritonExportResult",
    "export_triton",
    "validate_repository",
    "cache_bytes_per_step",
    "render_pbtxt",
    "main",
]

DEFAULT_EXPORT_DIR = "onnx_export"  # export.onnx's default output folder
DEFAULT_REPO_DIR = "triton_repository"
BACKENDS = ("auto", "onnxruntime", "tensorrt")
INSTANCE_KINDS = ("auto", "cpu", "gpu")
ENCODER_MODEL = "encoder"
DECODER_MODEL = "decoder_step"
STATEFUL_DECODER_MODEL = "decoder_step_stateful"
TRANSLATOR_MODEL = "translator"
DEFAULT_MAX_BATCH_SIZE = 64  # rows (sources x beams) per model execution
DEFAULT_QUEUE_DELAY_US = 100  # how long the batchers wait for more requests to merge
SEQUENCE_IDLE_US = 5_000_000  # a sequence idle this long is freed by Triton (default would be 1 s)
MAX_BEAM_SIZE = 16
# The marker of a repository written by this tool: format, version and every file it wrote.
MARKER_FILE = "transformer_ext.repository.json"
REPOSITORY_FORMAT = "transformer_ext.triton_repository"
REPOSITORY_FORMAT_VERSION = 1
_MODEL_NAMES = ("encoder", "decoder_step", "decoder_step_stateful", "translator")
# What the version before the marker wrote (recognised by these exact paths, for --force).
_UNMARKED_FILES = frozenset(
    {f"{m}/config.pbtxt" for m in _MODEL_NAMES}
    | {
        f"{m}/1/{f}"
        for m in _MODEL_NAMES[:3]
        for f in ("model.onnx", "model.plan", ENCODER_FILE + ".data", DECODER_FILE + ".data")
    }
    | {
        "translator/1/model.py",
        "translator/1/_vendor/transformer_ext/__init__.py",
        "translator/1/_vendor/transformer_ext/decoding.py",
    }
)

_TRANSLATOR_SOURCE = Path(__file__).resolve().parent / "triton_models" / "translator" / "model.py"
# The packages the translator imports from transformer_ext, every module of them copied into
# 1/_vendor/transformer_ext/ unchanged (transformer_ext.decoding needs only numpy: the search and
# the runners' checks).
VENDORED_PACKAGES = ("transformer_ext.decoding",)

# manifest dtype -> (Triton data type, bytes per element), from transformer_ext.export_format.DTYPES
TRITON_DTYPES = {name: (d.triton, d.itemsize) for name, d in DTYPES.items()}


class TritonExportError(ExportError):
    """The model repository cannot be written (bad options, an occupied target, missing engines)."""


class TritonConfigError(TritonExportError):
    """A generated ``config.pbtxt`` is invalid or does not match the graph it serves."""


@dataclass
class TritonExportResult:
    """What :func:`export_triton` produced."""

    repo_dir: Path
    backend: str  # "onnxruntime" | "tensorrt"
    precision: Optional[str]  # the TensorRT precision, None for ONNX Runtime
    flavour: str
    models: dict[str, Path]  # model name -> its folder
    configs: dict[str, str]  # model name -> config.pbtxt text
    protobuf_checked: bool  # parsed with tritonclient's model_config_pb2
    cache_bytes: dict[str, int] = field(default_factory=dict)  # see cache_bytes_per_step


# ------------------------------------------------------------------------------------------
# config.pbtxt rendering (no protobuf needed to write; tritonclient's protobuf checks it)
# ------------------------------------------------------------------------------------------


class Enum(str):
    """A protobuf enum value, rendered bare (``TYPE_FP32``, ``KIND_GPU``)."""


def _scalar(value: Any) -> str:
    if isinstance(value, Enum):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    raise TypeError(f"cannot render {value!r} ({type(value).__name__}) in a config.pbtxt")


def render_pbtxt(message: Mapping[str, Any], indent: int = 0) -> str:
    """Protobuf text format of ``message``: a dict whose values are scalars, :class:`Enum`,
    lists of scalars (``dims: [ 4, -1 ]``), dicts (sub-messages) or lists of dicts (repeated
    messages)."""
    pad = "  " * indent
    lines = []
    for key, value in message.items():
        if isinstance(value, Mapping):
            body = render_pbtxt(value, indent + 1)
            lines.append(f"{pad}{key} {{\n{body}{pad}}}\n" if body else f"{pad}{key} {{ }}\n")
        elif isinstance(value, (list, tuple)):
            if value and all(isinstance(v, Mapping) for v in value) and key == "parameters":
                # a map field: one `parameters { key: .. value { .. } }` block per entry, the form
                # Triton's documentation uses
                lines += [f"{pad}{key} {{\n{render_pbtxt(v, indent + 1)}{pad}}}\n" for v in value]
            elif value and all(isinstance(v, Mapping) for v in value):
                items = [f"{pad}  {{\n{render_pbtxt(v, indent + 2)}{pad}  }}" for v in value]
                lines.append(f"{pad}{key} [\n" + ",\n".join(items) + f"\n{pad}]\n")
            else:
                inner = ", ".join(_scalar(v) for v in value)
                lines.append(f"{pad}{key}: [ {inner} ]\n" if inner else f"{pad}{key}: [ ]\n")
        else:
            lines.append(f"{pad}{key}: {_scalar(value)}\n")
    return "".join(lines)


def _tensor_config(name: str, dtype: str, dims: Sequence[int], *, optional: bool = False) -> dict:
    """One ``input``/``output`` entry; ``dims`` without the batch axis (``[]``: a ``[batch]`` tensor)."""
    if dtype not in TRITON_DTYPES:
        raise TritonExportError(f"tensor {name!r} has dtype {dtype!r}, which has no Triton data type here")
    entry: dict[str, Any] = {"name": name, "data_type": Enum(TRITON_DTYPES[dtype][0])}
    if len(dims) == 0:  # a [batch] tensor: Triton needs a non-empty dims, the model sees [batch]
        entry["dims"] = [1]
        entry["reshape"] = {"shape": []}
    else:
        entry["dims"] = [int(d) for d in dims]
    if optional:
        entry["optional"] = True
    return entry


def _instance_group(kind: str, count: int, gpus: Optional[Sequence[int]]) -> list[dict]:
    group: dict[str, Any] = {"count": int(count)}
    if kind != "auto":
        group["kind"] = Enum({"cpu": "KIND_CPU", "gpu": "KIND_GPU"}[kind])
    if gpus and kind != "cpu":
        group["gpus"] = [int(g) for g in gpus]
    return [group]


def _parameters(values: Mapping[str, Any]) -> list[dict]:
    return [{"key": k, "value": {"string_value": str(v)}} for k, v in values.items()]


# ------------------------------------------------------------------------------------------
# Tensor specs of the served graphs (from the manifest, or the engines' I/O)
# ------------------------------------------------------------------------------------------


@dataclass
class _Tensor:
    name: str
    dtype: str
    shape: list  # full shape, batch first: ints (-1 dynamic) from engines, ints or axis names from specs

    @property
    def dims(self) -> list[int]:
        """Dims without the batch axis, named axes as -1."""
        return [d if isinstance(d, int) else -1 for d in self.shape[1:]]


@dataclass
class _Graph:
    inputs: list[_Tensor]
    outputs: list[_Tensor]

    def input(self, name: str) -> _Tensor:
        return next(t for t in self.inputs if t.name == name)

    def output(self, name: str) -> _Tensor:
        return next(t for t in self.outputs if t.name == name)


def _graph_from_spec(spec: Mapping[str, Any], pinned: Mapping[str, int] | None = None) -> _Graph:
    """The graph as Triton sees it. The decoder step's cross-attention K/V, whose leading axis is
    ``sources`` (one row per source, shared by its beams), are batched like every other input:
    the translator sends one cross-attention row per decoder row (the step's ``K = 1`` case), so
    the rows of concurrent requests stay aligned when Triton merges them."""

    def conv(t):
        shape = [pinned.get(d, d) if (pinned and isinstance(d, str)) else d for d in t["shape"]]
        if shape and shape[0] == SOURCES:
            shape[0] = "batch"
        return _Tensor(t["name"], t["dtype"], shape)

    graph = _Graph([conv(t) for t in spec["inputs"]], [conv(t) for t in spec["outputs"]])
    for t in graph.inputs + graph.outputs:
        if not t.shape or t.shape[0] != "batch":
            raise ManifestError(f"tensor {t.name!r} does not start with the batch axis: {t.shape}")
    return graph


def _graph_from_engine(
    spec: Mapping[str, Any], entry: Mapping[str, Any], pinned: Mapping[str, int]
) -> _Graph:
    """The graph spec with the dtypes and shapes of the built engine (``io`` in the manifest)."""
    graph = _graph_from_spec(spec, pinned)
    io = entry.get("io") or {}
    dtypes = entry.get("io_dtypes") or {}
    for t in graph.inputs + graph.outputs:
        if t.name in io:
            t.dtype = io[t.name]["dtype"]
            shape = [int(d) for d in io[t.name]["shape"]]
            if len(shape) != len(t.shape):
                raise ManifestError(
                    f"engine tensor {t.name!r} has rank {len(shape)}, the graph {len(t.shape)}"
                )
            t.shape = ["batch"] + shape[1:]
        elif t.name in dtypes:
            t.dtype = dtypes[t.name]
    return graph


# ------------------------------------------------------------------------------------------
# Memory traffic
# ------------------------------------------------------------------------------------------


def cache_bytes_per_step(config: Mapping[str, Any], rows: int, cache_len: int, dtype_bytes: int = 4) -> int:
    """Bytes of the self-attention K and V caches of every decoder layer for ``rows`` rows:
    ``2 * layers * rows * heads * cache_len * d_k * dtype_bytes``: what a path that sends the
    cache with every step request copies per step (per direction)."""
    heads = int(config["n_heads"])
    d_k = head_width(config)
    return 2 * int(config["n_decoder_layers"]) * int(rows) * heads * int(cache_len) * d_k * int(dtype_bytes)


# ------------------------------------------------------------------------------------------
# Choosing the backend
# ------------------------------------------------------------------------------------------


def _tensorrt_section(manifest: Mapping[str, Any], precision: Optional[str]) -> tuple[str, dict]:
    engines = (manifest.get("tensorrt") or {}).get("engines") or {}
    if not engines:
        raise TritonExportError(
            "the export folder's manifest lists no TensorRT engines: build them first with "
            "`python -m export.tensorrt`, or use --backend onnxruntime"
        )
    if precision is None:
        precision = "fp32" if "fp32" in engines else (next(iter(engines)) if len(engines) == 1 else None)
        if precision is None:
            raise TritonExportError(
                f"the manifest lists engines for {sorted(engines)}: choose one with --precision"
            )
    if precision not in engines:
        raise TritonExportError(
            f"no {precision} engines in the manifest (it lists {sorted(engines)}); build them with "
            f"`python -m export.tensorrt --precision {precision}`"
        )
    return precision, engines[precision]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------
# Output folder handling (the same rules as export.onnx)
# ------------------------------------------------------------------------------------------


def _repository_files(repo_dir: Path) -> list[str]:
    """Every file (and symlink) below ``repo_dir``, as sorted relative POSIX paths."""
    out = []
    for root, dirs, files in os.walk(repo_dir):
        rel = Path(root).relative_to(repo_dir)
        out += [(rel / f).as_posix() for f in files]
        out += [(rel / d).as_posix() for d in dirs if (Path(root) / d).is_symlink()]
    return sorted(out)


def _is_bytecode_of(path: str, owned: set[str]) -> bool:
    """``a/__pycache__/b.cpython-311.pyc`` next to an owned ``a/b.py``: what Python writes when
    Triton's Python backend imports the translator."""
    p = Path(path)
    if p.parent.name != "__pycache__" or p.suffix != ".pyc":
        return False
    source = (p.parent.parent / (p.name.split(".", 1)[0] + ".py")).as_posix()
    return source in owned


def _owned_repository_files(repo_dir: Path) -> tuple[Optional[set[str]], str]:
    """``(files this tool wrote, "")`` for a repository of ours, else ``(None, why not)``."""
    marker = repo_dir / MARKER_FILE
    if marker.is_file():
        try:
            data = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return None, f"its {MARKER_FILE} cannot be read ({exc})"
        if not isinstance(data, dict) or data.get("format") != REPOSITORY_FORMAT:
            return None, f"its {MARKER_FILE} was not written by python -m export.triton"
        if data.get("format_version") != REPOSITORY_FORMAT_VERSION or not isinstance(data.get("files"), list):
            return None, f"its {MARKER_FILE} has a format version this version does not know"
        return {f for f in data["files"] if isinstance(f, str)}, ""
    if any((repo_dir / f).is_file() for f in _UNMARKED_FILES if f.endswith("config.pbtxt")):
        return set(_UNMARKED_FILES), ""
    return None, f"it has no {MARKER_FILE} (the marker python -m export.triton writes)"


def _check_overlap(export_dir: Path, repo_dir: Path, others: Iterable[Path] = ()) -> None:
    """Refuse a repository folder equal to, inside, or containing the export folder (real paths)."""
    repo = Path(os.path.realpath(repo_dir))
    for source in (export_dir, *others):
        src = Path(os.path.realpath(source))
        if repo == src or repo.is_relative_to(src) or src.is_relative_to(repo):
            relation = "is" if repo == src else ("is inside" if repo.is_relative_to(src) else "contains")
            raise OutputFolderError(
                f"--output-dir {repo_dir} {relation} the export folder {source}: the repository would replace "
                "or mix with the export it is made from; choose an --output-dir outside it"
            )


def _check_target(repo_dir: Path, force: bool) -> None:
    """Refuse a target that is a file, a non-empty folder without ``force``, or (with ``force``) a
    folder holding anything this tool did not write. Touches nothing."""
    check_output_path(repo_dir, "--output-dir")
    if not repo_dir.exists() or not any(repo_dir.iterdir()):
        return
    if not force:
        raise TritonExportError(
            f"output folder {repo_dir} exists and is not empty; refusing to overwrite it: "
            "choose another --output-dir, or pass --force to replace a repository written by python -m export.triton"
        )
    owned, why = _owned_repository_files(repo_dir)
    if owned is None:
        raise OutputFolderError(
            f"--output-dir {repo_dir} is not a model repository written by python -m export.triton: {why}; "
            "refusing to replace it even with --force: choose another --output-dir, or move its contents away"
        )
    unexpected = [f for f in _repository_files(repo_dir) if f not in owned and not _is_bytecode_of(f, owned)]
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (
            f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        )
        raise OutputFolderError(
            f"--output-dir {repo_dir} is a repository of python -m export.triton, but it also holds files this "
            f"tool did not write: {shown}. Refusing to replace it (they would be lost): move them away, or choose "
            "another --output-dir"
        )


def _check_onnx_file(path: Path, spec: Mapping[str, Any]) -> None:
    """``path`` parses as an ONNX graph with the inputs and outputs ``spec`` names; reads only."""
    try:
        graph = _onnx_io(path)
    except Exception as exc:  # noqa: BLE001 - any parse failure means the user's file is unusable
        raise InvalidGraphError(
            f"{path} is not a valid ONNX graph ({type(exc).__name__}: {str(exc).strip() or 'unreadable'}); "
            "export the folder again with python -m export.onnx"
        ) from exc
    as_dicts = [
        [{"name": t.name, "dtype": t.dtype, "shape": t.shape} for t in ts]
        for ts in (graph.inputs, graph.outputs)
    ]
    problems = io_problems(spec, *as_dicts)
    if problems:
        raise InvalidGraphError(
            f"{path} does not have the inputs and outputs its manifest lists ({'; '.join(problems)}); "
            "export the folder again with python -m export.onnx"
        )


def _copy_model_file(
    src: Path, version_dir: Path, model_file: str, *, data_name: str, link: bool = False
) -> None:
    """Copy (``link=True``: hard-link, so the weights are not twice on disk) a model file as
    ``version_dir/model_file``.

    An ONNX graph over 2 GiB keeps its weights in ``<graph>.onnx.data`` (export.onnx), referenced
    by that relative name from inside the graph: when ``src``'s folder has ``data_name``, it goes
    next to ``model.onnx`` under that name, which is where ONNX Runtime looks for it. The export's
    shared weights file (``weights.data``, read by every graph) goes there the same way.
    """
    version_dir.mkdir(parents=True, exist_ok=True)
    pairs = [(src, version_dir / model_file)]
    for name in (data_name, WEIGHTS_FILE):
        if (src.parent / name).is_file():
            pairs.append((src.parent / name, version_dir / name))
    for a, b in pairs:
        if link:
            try:
                os.link(a, b)
                continue
            except OSError:  # another file system, or links not allowed: copy
                pass
        shutil.copy2(a, b)


# ------------------------------------------------------------------------------------------
# The model configurations
# ------------------------------------------------------------------------------------------


@dataclass
class _Plan:
    """Everything decided before writing: backend, dims, limits."""

    manifest: dict
    flavour: str
    backend: str
    precision: Optional[str]
    encoder: _Graph
    decoder: _Graph
    encoder_file: Path
    decoder_file: Path
    instance_kind: str
    encoder_max_batch: int
    decoder_max_batch: int
    max_src_len: int
    max_positions: int  # the model's max_len: positions stay below it
    max_cache_len: int
    fixed_cache_len: int  # 0 = the cache_len axis is dynamic
    cache_dtype: str
    stateful: bool
    state_cache_len: int


def _model_config(
    name: str,
    plan: _Plan,
    graph: _Graph,
    max_batch: int,
    *,
    instances: int,
    gpus: Optional[Sequence[int]],
    queue_delay_us: int,
    ort_threads: Optional[int],
    inputs: Optional[Iterable[str]] = None,
    outputs: Optional[Iterable[str]] = None,
) -> dict:
    if plan.backend == "tensorrt":
        config: dict[str, Any] = {"name": name, "platform": "tensorrt_plan", "backend": "tensorrt"}
    else:
        config = {"name": name, "platform": "onnxruntime_onnx", "backend": "onnxruntime"}
    config["max_batch_size"] = int(max_batch)
    in_names = list(inputs) if inputs is not None else [t.name for t in graph.inputs]
    out_names = list(outputs) if outputs is not None else [t.name for t in graph.outputs]
    config["input"] = [_tensor_config(n, graph.input(n).dtype, graph.input(n).dims) for n in in_names]
    config["output"] = [_tensor_config(n, graph.output(n).dtype, graph.output(n).dims) for n in out_names]
    config["dynamic_batching"] = {"max_queue_delay_microseconds": int(queue_delay_us)}
    config["instance_group"] = _instance_group(plan.instance_kind, instances, gpus)
    if plan.backend == "onnxruntime" and ort_threads:
        config["parameters"] = _parameters({"intra_op_thread_count": int(ort_threads)})
    return config


def _stateful_config(plan: _Plan, **kwargs: Any) -> dict:
    """The tensorscatter decoder step under the sequence batcher: ``self_*`` inputs and
    ``present_*`` outputs become implicit state (kept by Triton between the steps of a sequence,
    zero-filled at its start), one sequence per cache row."""
    n = int(plan.manifest["model_config"]["n_decoder_layers"])
    state_pairs = [(f"self_{kind}.{i}", f"present_{kind}.{i}") for i in range(n) for kind in ("key", "value")]
    state_inputs = {a for a, _ in state_pairs}
    inputs = [t.name for t in plan.decoder.inputs if t.name not in state_inputs]
    config = _model_config(
        STATEFUL_DECODER_MODEL,
        plan,
        plan.decoder,
        plan.decoder_max_batch,
        inputs=inputs,
        outputs=["logits"],
        **kwargs,
    )
    del config["dynamic_batching"]
    states = []
    for in_name, out_name in state_pairs:
        t = plan.decoder.input(in_name)
        dims = [
            plan.state_cache_len if i == 1 else d for i, d in enumerate(t.dims)
        ]  # [heads, cache_len, d_k]
        dtype = Enum(TRITON_DTYPES[t.dtype][0])
        state: dict[str, Any] = {
            "input_name": in_name,
            "output_name": out_name,
            "data_type": dtype,
            "dims": dims,
            # zero-filled once per sequence: the contract requires finite cache values
            "initial_state": {
                "name": f"zeros_{in_name}",
                "data_type": dtype,
                "dims": dims,
                "zero_data": True,
            },
        }
        if plan.backend == "tensorrt":
            # TensorRT's KV-cache update aliases input and output: one buffer per state
            state["use_same_buffer_for_input_output"] = True
        states.append(state)
    config["sequence_batching"] = {
        "max_sequence_idle_microseconds": SEQUENCE_IDLE_US,
        "oldest": {
            "max_candidate_sequences": int(plan.decoder_max_batch),
            "max_queue_delay_microseconds": int(kwargs["queue_delay_us"]),
        },
        "state": states,
    }
    # the sequence batcher replaces the dynamic batcher; keep the key order readable
    ordered = {
        k: config[k]
        for k in (
            "name",
            "platform",
            "backend",
            "max_batch_size",
            "input",
            "output",
            "sequence_batching",
            "instance_group",
        )
        if k in config
    }
    ordered.update({k: v for k, v in config.items() if k not in ordered})
    return ordered


def _pretrained_parameters(pretrained) -> dict:
    """The translator's parameters from an imported model's generation defaults
    (``generation_defaults.json``, :mod:`transformer_ext.convert`), as the Python translator lays
    them over the generation config: banned tokens, EOS forced at the budget, the early-stopping
    rule, the forced target language (sent by the client as ``target_prefix``) and ``max_length -
    1`` new tokens per source whatever its length; {} for a model of ours."""
    if pretrained is None:
        return {}
    unsupported = [
        f"{name} = {value}"
        for name, value, off in (
            ("repetition_penalty", pretrained.repetition_penalty, 1.0),
            ("no_repeat_ngram_size", pretrained.no_repeat_ngram_size, 0),
            ("forced_first_token", pretrained.forced_first_token, None),
            ("renormalize_logits", pretrained.renormalize_logits, False),
        )
        if value != off
    ]
    if unsupported:
        raise TritonExportError(
            f"generation_defaults.json: {', '.join(unsupported)} (from the checkpoint's generation config) "
            "is not applied by the Triton translator; serve this model with transformer_ext.translate "
            "or an ONNX Runtime export instead"
        )
    return {
        "banned_ids": ",".join(str(int(t)) for t in pretrained.banned_ids),
        "force_eos_at_budget": int(pretrained.force_eos_at_max_length),
        "early_stopping": str(pretrained.early_stopping).lower(),
        "forced_target_prefix": int(pretrained.force_target_language),
        "max_len_a": 0.0,
        "max_len_b": float(pretrained.max_length - 1),
    }


def _translator_config(
    plan: _Plan,
    generation,
    *,
    instances: int,
    decoder_instances: int,
    stateful_model: Optional[str],
    pretrained=None,
) -> dict:
    """The translator's config; its decoding defaults are the export's generation config and,
    for a model converted from transformers, its generation defaults (``pretrained``)."""
    cfg = plan.manifest["model_config"]
    heads = int(cfg["n_heads"])
    stateful_rows = 0
    if stateful_model:
        # Every sequence of a step must hold a candidate slot at once, or the step waits forever:
        # split the sequence batcher's capacity between the translator instances.
        stateful_rows = (plan.decoder_max_batch * int(decoder_instances)) // int(instances)
    params = {
        "encoder_model": ENCODER_MODEL,
        "decoder_model": DECODER_MODEL,
        "stateful_decoder_model": stateful_model or "",
        "flavour": plan.flavour,
        "n_layers": int(cfg["n_decoder_layers"]),
        "n_heads": heads,
        "d_k": head_width(cfg),
        "src_vocab_size": int(cfg.get("src_vocab_size", 0)),
        "tgt_vocab_size": int(cfg["tgt_vocab_size"]),
        "max_positions": plan.max_positions,
        "bos_id": int(cfg["bos_id"]),
        "eos_id": int(cfg["eos_id"]),
        "pad_id": int(cfg["pad_id"]),
        "max_src_len": plan.max_src_len,
        "max_cache_len": plan.max_cache_len,
        "fixed_cache_len": plan.fixed_cache_len,
        "state_cache_len": plan.state_cache_len if stateful_model else 0,
        "cache_dtype": plan.cache_dtype,
        "encoder_max_batch_size": plan.encoder_max_batch,
        "decoder_max_batch_size": plan.decoder_max_batch,
        "stateful_max_sequences": stateful_rows,
        "beam_size": generation.beam_size,
        "max_len_a": generation.max_len_a,
        "max_len_b": generation.max_len_b,
        "min_decoding_length": generation.min_new_tokens,
        "max_decoding_length": generation.max_new_tokens,
        "max_beam_size": max(MAX_BEAM_SIZE, generation.beam_size),
        "length_penalty_type": generation.length_penalty,
        "length_penalty": generation.alpha,
        **_pretrained_parameters(pretrained),
    }
    i64, f32 = "int64", "float32"
    return {
        "name": TRANSLATOR_MODEL,
        "backend": "python",
        "max_batch_size": 0,
        "input": [
            _tensor_config("input_ids", i64, [-1, -1]),
            _tensor_config("src_lengths", i64, [-1], optional=True),
            *(_tensor_config(name, i64, [1], optional=True) for name in _request_option_inputs()),
            _tensor_config("target_prefix", i64, [-1, -1], optional=True),
        ],
        "output": [
            _tensor_config("output_ids", i64, [-1, -1]),
            _tensor_config("output_lengths", i64, [-1]),
            _tensor_config("scores", f32, [-1]),
        ],
        "instance_group": [{"count": int(instances), "kind": Enum("KIND_CPU")}],
        "parameters": _parameters(params),
    }


def _request_option_inputs() -> list[str]:
    """The translator's optional search-option inputs: every name of its ``REQUEST_OPTIONS``
    (the SearchOptions field's, then the older ones a client may still send)."""
    from .triton_models.translator.model import REQUEST_OPTIONS

    return [n for name, old in REQUEST_OPTIONS for n in (name, *old)]


# ------------------------------------------------------------------------------------------
# Planning
# ------------------------------------------------------------------------------------------


def _resolve_backend(manifest: dict, backend: str, precision: Optional[str], instance_kind: str) -> str:
    """``auto`` becomes TensorRT when the manifest lists engines and the instances may run on GPUs."""
    if backend == "auto":
        backend = (
            "tensorrt"
            if (manifest.get("tensorrt") or {}).get("engines") and instance_kind != "cpu"
            else "onnxruntime"
        )
    if backend == "onnxruntime" and precision is not None:
        raise TritonExportError(
            "--precision selects TensorRT engines; it has no meaning with --backend onnxruntime"
        )
    return backend


def _engine_files(export_dir: Path, precision: str, entries: Mapping[str, Any]) -> dict[str, Path]:
    """The encoder and decoder_step engines the manifest lists, each present and matching its sha256."""
    files = {}
    for graph in ("encoder", "decoder_step"):
        if graph not in entries:
            raise TritonExportError(f"the manifest's {precision} engines lack the {graph} engine")
        path = export_dir / entries[graph]["file"]
        if not path.is_file():
            raise TritonExportError(f"{path} is listed in the manifest but missing; rebuild the engines")
        want = entries[graph].get("sha256")
        if want and _sha256(path) != want:
            raise TritonExportError(f"{path} does not match the sha256 in the manifest (rebuilt or corrupt?)")
        files[graph] = path
    return files


def _tensorrt_models(
    export_dir: Path,
    manifest: dict,
    precision: Optional[str],
    instance_kind: str,
    max_batch_size: int,
    max_positions: int,
    max_cache_len: int,
) -> dict:
    """The :class:`_Plan` fields of the manifest's TensorRT engines: graphs, files, and the limits
    their optimization profiles set."""
    if instance_kind == "cpu":
        raise TritonExportError(
            "TensorRT plans run on GPUs only: use --instance-kind gpu (or auto) with --backend tensorrt"
        )
    precision, section = _tensorrt_section(manifest, precision)
    if section.get("cache_dtype") == "bfloat16":
        raise TritonExportError(
            "bf16 engines cannot be driven by the Python-backend translator (numpy has no bfloat16 "
            "for the caches it holds); build fp32 or fp16 engines"
        )
    entries = section["engines"]
    files = _engine_files(export_dir, precision, entries)
    specs = manifest["graphs"]
    pinned = {k: int(v) for k, v in (entries["decoder_step"].get("pinned_axes") or {}).items()}
    encoder = _graph_from_engine(specs["encoder"], entries["encoder"], {})
    decoder = _graph_from_engine(specs["decoder_step"], entries["decoder_step"], pinned)

    def profile_max(graph: str, tensor: str, axis: int, default: int) -> int:
        prof = (entries[graph].get("profile") or {}).get(tensor)
        return int(prof["max"][axis]) if prof else default

    def profile_min(graph: str, tensor: str, axis: int) -> int:
        prof = (entries[graph].get("profile") or {}).get(tensor)
        return int(prof["min"][axis]) if prof else 1

    enc_batch = min(max_batch_size, profile_max("encoder", "input_ids", 0, max_batch_size))
    dec_batch = min(max_batch_size, profile_max("decoder_step", "input_ids", 0, max_batch_size))
    for graph in ("encoder", "decoder_step"):
        if profile_min(graph, "input_ids", 0) > 1:
            logger.warning(
                "the %s engine's profile starts at batch %d: smaller batches will fail",
                graph,
                profile_min(graph, "input_ids", 0),
            )
    if (enc_batch, dec_batch) != (max_batch_size, max_batch_size):
        logger.info(
            "max_batch_size capped by the engines' profiles: encoder %d, decoder %d", enc_batch, dec_batch
        )
    return dict(
        instance_kind="gpu",
        precision=precision,
        encoder=encoder,
        decoder=decoder,
        encoder_file=files["encoder"],
        decoder_file=files["decoder_step"],
        encoder_max_batch=enc_batch,
        decoder_max_batch=dec_batch,
        max_src_len=min(max_positions, profile_max("encoder", "input_ids", 1, max_positions)),
        max_cache_len=min(max_cache_len, profile_max("decoder_step", "self_key.0", 2, max_cache_len)),
        fixed_cache_len=int(pinned.get("cache_len", 0)),
        cache_dtype=decoder.input("self_key.0").dtype,
    )


def _onnx_models(export_dir: Path, manifest: dict, max_batch_size: int, max_positions: int) -> dict:
    """The :class:`_Plan` fields of the export's ONNX graphs (each file present and the graph the
    manifest lists)."""
    specs = manifest["graphs"]
    onnx_dir = (export_dir / manifest["onnx_dir"]).resolve() if manifest.get("onnx_dir") else export_dir
    encoder = _graph_from_spec(specs["encoder"])
    decoder = _graph_from_spec(specs["decoder_step"])
    encoder_file, decoder_file = onnx_dir / ENCODER_FILE, onnx_dir / DECODER_FILE
    for path, spec in ((encoder_file, specs["encoder"]), (decoder_file, specs["decoder_step"])):
        if not path.is_file():
            raise ManifestError(f"{path} not found (the export folder is incomplete; export it again)")
        _check_onnx_file(path, spec)
    return dict(
        encoder=encoder,
        decoder=decoder,
        encoder_file=encoder_file,
        decoder_file=decoder_file,
        encoder_max_batch=max_batch_size,
        decoder_max_batch=max_batch_size,
        max_src_len=max_positions,
        fixed_cache_len=0,
        cache_dtype="float32",
    )


def _resolve_state(
    flavour: str,
    stateful: Optional[bool],
    state_cache_len: Optional[int],
    fixed_cache_len: int,
    max_cache_len: int,
) -> tuple[bool, int]:
    """Whether to write the stateful decoder, and the cache capacity of each of its sequences."""
    if stateful is None:
        stateful = flavour == "tensorscatter"
    if stateful and flavour != "tensorscatter":
        raise TritonExportError(
            "the stateful decoder (sequence batcher with implicit state) needs the tensorscatter flavour, "
            "whose present_* outputs become the next step's cache inputs; export with "
            "`python -m export.onnx --flavour tensorscatter`, or drop --stateful"
        )
    if fixed_cache_len:
        if state_cache_len is not None and int(state_cache_len) != fixed_cache_len:
            raise TritonExportError(
                f"the decoder engine was built with a fixed cache_len of {fixed_cache_len}; "
                f"--state-cache-len {state_cache_len} cannot differ from it"
            )
        state_cache_len = fixed_cache_len
    if state_cache_len is None:
        state_cache_len = max_cache_len
    state_cache_len = int(state_cache_len)
    if not 1 <= state_cache_len <= max_cache_len:
        raise TritonExportError(
            f"--state-cache-len must be in [1, {max_cache_len}] for this export, got {state_cache_len}"
        )
    return bool(stateful), state_cache_len


def _plan(
    export_dir: Path,
    manifest: dict,
    *,
    backend: str,
    precision: Optional[str],
    instance_kind: str,
    max_batch_size: int,
    stateful: Optional[bool],
    state_cache_len: Optional[int],
) -> _Plan:
    flavour = manifest["flavour"]
    if flavour == "ort":
        raise TritonExportError(
            f"{export_dir} is an export of the ort flavour (ONNX Runtime's CPU contrib operator "
            "GroupQueryAttention, bound in place by OrtRunner): the repository's models need the portable "
            "or tensorscatter flavour; export with `python -m export.onnx --flavour portable` (or tensorscatter)"
        )
    if flavour == CUSTOM_OP_FLAVOUR:
        raise TritonExportError(CUSTOM_OP_REFUSAL.format(folder=export_dir, what="a Triton repository"))
    cfg = manifest["model_config"]
    max_positions = int(manifest.get("max_positions", cfg["max_len"]))
    max_cache_len = min(int(manifest.get("max_cache_len", max_positions)), max_positions)
    backend = _resolve_backend(manifest, backend, precision, instance_kind)
    if backend == "tensorrt":
        models = _tensorrt_models(
            export_dir, manifest, precision, instance_kind, max_batch_size, max_positions, max_cache_len
        )
    else:
        models = _onnx_models(export_dir, manifest, max_batch_size, max_positions)
        models.update(instance_kind=instance_kind, precision=None, max_cache_len=max_cache_len)
    stateful, state_cache_len = _resolve_state(
        flavour, stateful, state_cache_len, models["fixed_cache_len"], models["max_cache_len"]
    )
    return _Plan(
        manifest=manifest,
        flavour=flavour,
        backend=backend,
        precision=models["precision"],
        encoder=models["encoder"],
        decoder=models["decoder"],
        encoder_file=models["encoder_file"],
        decoder_file=models["decoder_file"],
        instance_kind=models["instance_kind"],
        encoder_max_batch=int(models["encoder_max_batch"]),
        decoder_max_batch=int(models["decoder_max_batch"]),
        max_src_len=int(models["max_src_len"]),
        max_positions=int(max_positions),
        max_cache_len=int(models["max_cache_len"]),
        fixed_cache_len=models["fixed_cache_len"],
        cache_dtype=models["cache_dtype"],
        stateful=stateful,
        state_cache_len=state_cache_len,
    )


# ------------------------------------------------------------------------------------------
# The library function
# ------------------------------------------------------------------------------------------


def _module_file(module: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        raise TritonExportError(f"cannot find {module} to copy into the repository")
    return Path(spec.origin)


def vendored_modules() -> tuple[str, ...]:
    """Every module of :data:`VENDORED_PACKAGES` (each package's ``__init__`` first)."""
    import pkgutil

    modules: list[str] = []
    for package in VENDORED_PACKAGES:
        modules.append(package)
        folder = _module_file(package).parent
        modules += sorted(f"{package}.{m.name}" for m in pkgutil.iter_modules([str(folder)]) if not m.ispkg)
    return tuple(modules)


def _vendored_path(module: str) -> str:
    """``transformer_ext.decoding.beam`` -> ``1/_vendor/transformer_ext/decoding/beam.py``, a
    package's ``__init__`` -> ``.../decoding/__init__.py`` (relative to the model folder)."""
    origin = _module_file(module)
    parts = module.split(".")
    if origin.name == "__init__.py":
        parts.append("__init__")
    return "1/_vendor/" + "/".join(parts) + ".py"


def _write_translator(model_dir: Path) -> None:
    """``1/model.py`` and the modules of transformer_ext it imports (:func:`vendored_modules`),
    copied byte for byte under ``1/_vendor`` (the package's ``__init__`` is a stub, so that
    nothing else of transformer_ext is imported in Triton's Python backend)."""
    version = model_dir / "1"
    version.mkdir(parents=True, exist_ok=True)
    shutil.copy2(_TRANSLATOR_SOURCE, version / "model.py")
    vendor = version / "_vendor" / "transformer_ext"
    vendor.mkdir(parents=True)
    (vendor / "__init__.py").write_text(
        '"""The part of transformer_ext the Triton translator needs (copied by python -m export.triton)."""\n',
        encoding="utf-8",
    )
    for module in vendored_modules():
        target = model_dir / _vendored_path(module)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(_module_file(module), target)


def _check_options(
    *,
    backend: str,
    instance_kind: str,
    max_batch_size: int,
    instances: int,
    translator_instances: int,
    max_queue_delay_us: int,
    ort_threads: Optional[int],
    state_cache_len: Optional[int],
    gpus: Optional[Sequence[int]],
) -> None:
    """A ValueError naming the first bad option of :func:`export_triton`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if instance_kind not in INSTANCE_KINDS:
        raise ValueError(f"instance_kind must be one of {INSTANCE_KINDS}, got {instance_kind!r}")
    for name, value, low in (
        ("max_batch_size", max_batch_size, 1),
        ("instances", instances, 1),
        ("translator_instances", translator_instances, 1),
        ("max_queue_delay_us", max_queue_delay_us, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if ort_threads is not None and (
        isinstance(ort_threads, bool) or not isinstance(ort_threads, int) or ort_threads < 1
    ):
        raise ValueError(f"ort_threads must be a positive int, got {ort_threads!r}")
    if state_cache_len is not None and (
        isinstance(state_cache_len, bool) or not isinstance(state_cache_len, int)
    ):
        raise ValueError(f"state_cache_len must be an int, got {state_cache_len!r}")
    if gpus is not None and any(isinstance(g, bool) or not isinstance(g, int) or g < 0 for g in gpus):
        raise ValueError(f"gpus must be GPU ids (ints >= 0), got {list(gpus)!r}")


def _model_configs(
    plan: _Plan,
    export_dir: Path,
    common: Mapping[str, Any],
    *,
    translator: bool,
    translator_instances: int,
) -> dict[str, dict]:
    """The configuration of every model of the repository, by model name. ``common`` holds the
    instance and batching options of the encoder and decoder models."""
    instances = common["instances"]
    configs: dict[str, dict] = {
        ENCODER_MODEL: _model_config(ENCODER_MODEL, plan, plan.encoder, plan.encoder_max_batch, **common),
        DECODER_MODEL: _model_config(DECODER_MODEL, plan, plan.decoder, plan.decoder_max_batch, **common),
    }
    if plan.stateful:
        configs[STATEFUL_DECODER_MODEL] = _stateful_config(plan, **common)
        if translator and plan.decoder_max_batch * instances < translator_instances:
            raise TritonExportError(
                f"{translator_instances} translator instances cannot share {plan.decoder_max_batch * instances} "
                "stateful sequence slots (max_batch_size x instances): every translator needs at least one, "
                "or its steps would wait for a slot forever; raise --max-batch-size or lower --translator-instances"
            )
    if translator:
        configs[TRANSLATOR_MODEL] = _translator_config(
            plan,
            read_generation_config(export_dir, plan.manifest),
            instances=translator_instances,
            decoder_instances=instances,
            stateful_model=STATEFUL_DECODER_MODEL if plan.stateful else None,
            pretrained=read_generation_defaults(export_dir),
        )
    return configs


def _fill_repository(
    tmp_dir: Path,
    export_dir: Path,
    plan: _Plan,
    configs: Mapping[str, dict],
    texts: Mapping[str, str],
    *,
    translator: bool,
    validate: bool,
) -> bool:
    """Write the models' folders, then (when ``validate``) check them, then the marker file, into
    the staging folder ``tmp_dir``; whether tritonclient's protobuf parser checked the configs."""
    model_file = "model.plan" if plan.backend == "tensorrt" else "model.onnx"
    protobuf_checked = False
    for name, text in texts.items():
        (tmp_dir / name).mkdir()
        (tmp_dir / name / "config.pbtxt").write_text(text, encoding="utf-8")
    enc_data, dec_data = plan.encoder_file.name + ".data", plan.decoder_file.name + ".data"
    _copy_model_file(plan.encoder_file, tmp_dir / ENCODER_MODEL / "1", model_file, data_name=enc_data)
    _copy_model_file(plan.decoder_file, tmp_dir / DECODER_MODEL / "1", model_file, data_name=dec_data)
    if plan.stateful:  # the same graph under the sequence batcher
        _copy_model_file(
            tmp_dir / DECODER_MODEL / "1" / model_file,
            tmp_dir / STATEFUL_DECODER_MODEL / "1",
            model_file,
            data_name=dec_data,
            link=True,
        )
    if translator:
        _write_translator(tmp_dir / TRANSLATOR_MODEL)
    if validate:
        engines = (
            {
                ENCODER_MODEL: plan.encoder,
                DECODER_MODEL: plan.decoder,
                STATEFUL_DECODER_MODEL: plan.decoder,
            }
            if plan.backend == "tensorrt"
            else None
        )
        protobuf_checked = validate_repository(tmp_dir, engine_graphs=engines, configs=configs)
    atomic_write_json(
        tmp_dir / MARKER_FILE,
        {
            "format": REPOSITORY_FORMAT,
            "format_version": REPOSITORY_FORMAT_VERSION,
            "export_dir": os.fspath(export_dir),
            "files": sorted(set(_repository_files(tmp_dir)) | {MARKER_FILE}),
        },
    )
    return protobuf_checked


def _write_repository(
    repo_dir: Path,
    force: bool,
    export_dir: Path,
    plan: _Plan,
    configs: Mapping[str, dict],
    texts: Mapping[str, str],
    *,
    translator: bool,
    validate: bool,
) -> bool:
    """Fill a staging folder (:func:`_fill_repository`) and move it to ``repo_dir`` in one step;
    on failure nothing is left behind (an OSError names ``repo_dir``)."""
    made: list[Path] = []
    try:
        make_parents(repo_dir, made)
        with StagedDir(repo_dir) as stage:
            protobuf_checked = _fill_repository(
                stage.path, export_dir, plan, configs, texts, translator=translator, validate=validate
            )
            _check_target(repo_dir, force)  # nothing of someone else's appeared there meanwhile
            stage.commit()
    except BaseException as exc:
        remove_made_parents(made)
        named = named_write_error(exc, repo_dir)
        if named is not None:
            raise named from exc
        raise
    return protobuf_checked


def _export_result(
    repo_dir: Path, plan: _Plan, texts: dict[str, str], protobuf_checked: bool
) -> TritonExportResult:
    cfg = plan.manifest["model_config"]
    dtype_bytes = TRITON_DTYPES[plan.cache_dtype][1]
    rows, length = 1, plan.state_cache_len
    result = TritonExportResult(
        repo_dir=repo_dir,
        backend=plan.backend,
        precision=plan.precision,
        flavour=plan.flavour,
        models={name: repo_dir / name for name in texts},
        configs=texts,
        protobuf_checked=protobuf_checked,
        cache_bytes={
            "rows": rows,
            "cache_len": length,
            "self_cache": cache_bytes_per_step(cfg, rows, length, dtype_bytes),
        },
    )
    logger.info(
        "wrote the Triton model repository %s (%s, %s flavour): %s",
        repo_dir,
        plan.backend,
        plan.flavour,
        ", ".join(texts),
    )
    return result


def export_triton(
    export_dir: str | os.PathLike = DEFAULT_EXPORT_DIR,
    repo_dir: str | os.PathLike = DEFAULT_REPO_DIR,
    *,
    backend: str = "auto",
    precision: Optional[str] = None,
    instance_kind: str = "auto",
    instances: int = 1,
    gpus: Optional[Sequence[int]] = None,
    translator_instances: int = 1,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    max_queue_delay_us: int = DEFAULT_QUEUE_DELAY_US,
    stateful: Optional[bool] = None,
    state_cache_len: Optional[int] = None,
    translator: bool = True,
    ort_threads: Optional[int] = None,
    force: bool = False,
    validate: bool = True,
) -> TritonExportResult:
    """Write a Triton model repository for the export folder ``export_dir`` into ``repo_dir``.

    Args:
        export_dir: a folder written by ``python -m export.onnx`` (optionally with TensorRT engines
            listed in its manifest by ``python -m export.tensorrt``).
        repo_dir: the repository folder to create.
        backend: ``"onnxruntime"`` (``onnxruntime_onnx`` models), ``"tensorrt"`` (``tensorrt_plan``
            models from the manifest's engines) or ``"auto"`` (TensorRT when engines exist and the
            instance kind is not CPU).
        precision: which TensorRT engines (``fp32``/``fp16``); default fp32, or the only one built.
        instance_kind: ``"cpu"`` (KIND_CPU), ``"gpu"`` (KIND_GPU) or ``"auto"`` (Triton's choice:
            one instance per GPU, or CPU without GPUs) for the encoder and decoder models.
        instances: instances per GPU (or on the CPU) of the encoder and decoder models.
        gpus: restrict KIND_GPU instances to these device ids.
        translator_instances: instances of the Python-backend translator (decoding loops run in parallel).
        max_batch_size: the most rows (sources x beams) one execution of the encoder/decoder takes;
            capped by the engines' profiles for TensorRT.
        max_queue_delay_us: how long the dynamic / sequence batcher waits to merge requests.
        stateful: generate ``decoder_step_stateful`` (sequence batcher with implicit state); default:
            yes for the tensorscatter flavour (required for it), no for portable.
        state_cache_len: the cache capacity of every stateful sequence (implicit state needs fixed
            dims); default the export's ``max_cache_len``; fixed by the engine for TensorRT
            tensorscatter engines.
        translator: write the Python-backend translator (BLS) model.
        ort_threads: ``intra_op_thread_count`` of the ONNX Runtime models (default: ONNX Runtime's).
        force: replace a non-empty ``repo_dir`` (atomically, once the new one is complete), which
            must be a repository this tool wrote that holds nothing else.
        validate: check every config.pbtxt against the graphs (and with tritonclient's protobuf
            parser when installed) before the repository is moved into place.

    Raises:
        ManifestError: ``export_dir`` has no (valid) manifest.json, or an ONNX file is missing.
        InvalidGraphError: an ``.onnx`` file of the export is corrupt or not the graph the manifest lists.
        TritonExportError: bad options, an occupied ``repo_dir``, missing or mismatching engines.
        OutputFolderError: ``repo_dir`` is a file, overlaps the export folder, or (with ``force``)
            is not a repository of this tool holding only its files.
        TritonConfigError: a generated configuration does not match its graph.
        OSError: the repository cannot be written (full disk, read-only file system), naming ``repo_dir``.
    """
    _check_options(
        backend=backend,
        instance_kind=instance_kind,
        max_batch_size=max_batch_size,
        instances=instances,
        translator_instances=translator_instances,
        max_queue_delay_us=max_queue_delay_us,
        ort_threads=ort_threads,
        state_cache_len=state_cache_len,
        gpus=gpus,
    )
    export_dir = Path(export_dir).absolute()
    repo_dir = Path(repo_dir).absolute()
    manifest = read_manifest(export_dir)  # ManifestError with a clear message when absent
    onnx_dirs = [(export_dir / manifest["onnx_dir"]).resolve()] if manifest.get("onnx_dir") else []
    _check_overlap(export_dir, repo_dir, onnx_dirs)
    _check_target(repo_dir, force)
    plan = _plan(
        export_dir,
        manifest,
        backend=backend,
        precision=precision,
        instance_kind=instance_kind,
        max_batch_size=max_batch_size,
        stateful=stateful,
        state_cache_len=state_cache_len,
    )
    common = dict(instances=instances, gpus=gpus, queue_delay_us=max_queue_delay_us, ort_threads=ort_threads)
    configs = _model_configs(
        plan, export_dir, common, translator=translator, translator_instances=translator_instances
    )
    texts = {name: render_pbtxt(cfg) for name, cfg in configs.items()}
    protobuf_checked = _write_repository(
        repo_dir, force, export_dir, plan, configs, texts, translator=translator, validate=validate
    )
    return _export_result(repo_dir, plan, texts, protobuf_checked)


# ------------------------------------------------------------------------------------------
# Validation: Triton's protobuf + the graphs
# ------------------------------------------------------------------------------------------


def _load_model_config_pb2():
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError:
        return None, None
    return model_config_pb2, text_format


def parse_config(text: str, path: str = "config.pbtxt"):
    """``text`` parsed into Triton's ``ModelConfig`` protobuf (needs ``tritonclient[grpc]``)."""
    pb2, text_format = _load_model_config_pb2()
    if pb2 is None:
        raise ImportError("tritonclient is not installed: `pip install 'tritonclient[grpc]'`")
    try:
        return text_format.Parse(text, pb2.ModelConfig())
    except text_format.ParseError as exc:
        raise TritonConfigError(f"{path} is not a valid Triton model configuration: {exc}") from exc


def _onnx_io(path: Path) -> _Graph:
    """A graph file's inputs (initializers excluded) and outputs (:func:`export.contract.graph_io`)."""
    import onnx

    from .contract import graph_io

    inputs, outputs = graph_io(onnx.load(os.fspath(path), load_external_data=False))

    def conv(t: dict) -> _Tensor:
        return _Tensor(t["name"], t["dtype"], [-1 if d is None else d for d in (t["shape"] or [])])

    return _Graph([conv(t) for t in inputs], [conv(t) for t in outputs])


def _normalize(config: Mapping[str, Any]) -> dict:
    """One of our config dicts in the shape ``json_format.MessageToDict`` gives a parsed config
    (enums as strings, ``parameters`` as a map, ``initial_state`` as a list)."""

    def conv(v):
        if isinstance(v, Mapping):
            return {k: conv(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        return str(v) if isinstance(v, Enum) else v

    out = conv(config)
    if isinstance(out.get("parameters"), list):
        out["parameters"] = {p["key"]: p["value"] for p in out["parameters"]}
    for st in out.get("sequence_batching", {}).get("state", []):
        if isinstance(st.get("initial_state"), dict):
            st["initial_state"] = [st["initial_state"]]
    return out


def _check_model(name: str, config: Mapping[str, Any], graph: _Graph) -> list[str]:
    """Problems of one model's configuration (``MessageToDict`` form) against its graph's I/O."""
    problems = []
    batched = int(config.get("max_batch_size", 0)) > 0
    by_type = {v: k for k, (v, _) in TRITON_DTYPES.items()}

    def compare(
        kind: str, tname: str, data_type: Any, shape: Sequence[Any], tensors: Mapping[str, _Tensor]
    ) -> None:
        t = tensors.get(tname)
        if t is None:
            problems.append(
                f"{name}: {kind} {tname!r} is not a tensor of the graph (it has {sorted(tensors)})"
            )
            return
        if by_type.get(str(data_type)) != t.dtype:
            problems.append(
                f"{name}: {kind} {tname!r} is {data_type} in config.pbtxt, {t.dtype} in the graph"
            )
        full = (["batch"] if batched else []) + [int(d) for d in shape]
        if len(full) != len(t.shape):
            problems.append(
                f"{name}: {kind} {tname!r} has rank {len(full)} in config.pbtxt (batch axis "
                f"{'included' if batched else 'none'}), {len(t.shape)} in the graph"
            )
            return
        for axis, (c, g) in enumerate(zip(full, t.shape)):
            if axis == 0 and batched:
                if isinstance(g, int) and g >= 0:
                    problems.append(f"{name}: {kind} {tname!r} has a static batch axis ({g}) in the graph")
            elif isinstance(g, int) and g >= 0 and c != -1 and c != g:
                problems.append(
                    f"{name}: {kind} {tname!r} axis {axis} is {c} in config.pbtxt, {g} in the graph"
                )

    def model_shape(entry: Mapping[str, Any]) -> list:
        # what the model sees: the reshape when there is one, else dims
        return list(entry["reshape"].get("shape", [])) if "reshape" in entry else list(entry.get("dims", []))

    g_in = {t.name: t for t in graph.inputs}
    g_out = {t.name: t for t in graph.outputs}
    for entry in config.get("input", []):
        compare("input", entry["name"], entry.get("data_type"), model_shape(entry), g_in)
    for entry in config.get("output", []):
        compare("output", entry["name"], entry.get("data_type"), model_shape(entry), g_out)
    states = config.get("sequence_batching", {}).get("state", [])
    for st in states:
        compare("state input", st["input_name"], st.get("data_type"), st.get("dims", []), g_in)
        compare("state output", st["output_name"], st.get("data_type"), st.get("dims", []), g_out)
        for init in st.get("initial_state", []):
            dims = [int(d) for d in init.get("dims", [])]
            if dims != [int(d) for d in st.get("dims", [])] or any(d < 0 for d in dims):
                problems.append(
                    f"{name}: the initial state of {st['input_name']!r} needs the state's fixed dims "
                    f"{st.get('dims')}, got {init.get('dims')}"
                )
            if init.get("data_type") != st.get("data_type"):
                problems.append(f"{name}: the initial state of {st['input_name']!r} has another data type")
    covered = {e["name"] for e in config.get("input", [])} | {s["input_name"] for s in states}
    missing = [n for n in g_in if n not in covered]
    if missing:
        problems.append(f"{name}: graph inputs {missing} are neither config inputs nor implicit state")
    return problems


def validate_repository(
    repo_dir: str | os.PathLike,
    *,
    engine_graphs: Optional[Mapping[str, _Graph]] = None,
    configs: Optional[Mapping[str, Mapping[str, Any]]] = None,
    require_protobuf: bool = False,
) -> bool:
    """Check every model of a repository written by :func:`export_triton`.

    Each ``config.pbtxt`` is parsed with Triton's own ``ModelConfig`` protobuf (from
    ``tritonclient``) and its inputs, outputs and implicit states are compared with the model
    file: names, dtypes, ranks (the batch axis included when ``max_batch_size > 0``) and static
    dims; every graph input must be a config input or a state. ONNX models are read with
    ``onnx``; TensorRT plans are compared with ``engine_graphs`` (the engines' I/O from the
    manifest). The translator's files and the models it calls must be there.

    Without ``tritonclient`` the text cannot be parsed: then ``configs`` (the dicts the files were
    rendered from), when given, are checked against the graphs instead, a warning is logged and
    ``False`` is returned (``require_protobuf=True`` raises ImportError instead). Returns ``True``
    when the files were parsed with the protobuf.

    Raises:
        TritonConfigError: listing every problem found.
    """
    repo = Path(repo_dir)
    pb2, _ = _load_model_config_pb2()
    if pb2 is None:
        if require_protobuf:
            raise ImportError("tritonclient is not installed: `pip install 'tritonclient[grpc]'`")
        logger.warning(
            "tritonclient is not installed: the config.pbtxt files are not parsed with Triton's "
            "protobuf, only checked against the graphs (pip install 'tritonclient[grpc]')"
        )
    parsed: dict[str, dict] = {}
    for cfg_path in sorted(repo.glob("*/config.pbtxt")):
        name = cfg_path.parent.name
        if pb2 is not None:
            from google.protobuf import json_format

            message = parse_config(cfg_path.read_text(encoding="utf-8"), os.fspath(cfg_path))
            parsed[name] = json_format.MessageToDict(message, preserving_proto_field_name=True)
        elif configs is not None and name in configs:
            parsed[name] = _normalize(configs[name])
    problems: list[str] = []
    for name, config in parsed.items():
        folder = repo / name
        if config.get("name") != name:
            problems.append(f"{name}: config name {config.get('name')!r} differs from its folder")
        platform = config.get("platform", "")
        if platform == "onnxruntime_onnx":
            path = folder / "1" / "model.onnx"
            if not path.is_file():
                problems.append(f"{name}: {path} is missing")
                continue
            try:
                graph = _onnx_io(path)
            except Exception as exc:  # noqa: BLE001 - a corrupt model file is a problem to report
                problems.append(f"{name}: {path} is not a valid ONNX graph ({type(exc).__name__}: {exc})")
                continue
            problems += _check_model(name, config, graph)
        elif platform == "tensorrt_plan":
            if not (folder / "1" / "model.plan").is_file():
                problems.append(f"{name}: 1/model.plan is missing")
            for group in config.get("instance_group", []):
                if group.get("kind") == "KIND_CPU":
                    problems.append(f"{name}: a TensorRT plan cannot run in a KIND_CPU instance")
            if engine_graphs is None or name not in engine_graphs:
                problems.append(f"{name}: no engine I/O to check the TensorRT configuration against")
                continue
            problems += _check_model(name, config, engine_graphs[name])
        elif config.get("backend") == "python":
            if not (folder / "1" / "model.py").is_file():
                problems.append(f"{name}: 1/model.py is missing")
            for module in vendored_modules():
                copy = folder / _vendored_path(module)
                if not copy.is_file():
                    problems.append(f"{name}: the vendored {_vendored_path(module)} is missing")
                elif copy.read_bytes() != _module_file(module).read_bytes():
                    problems.append(
                        f"{name}: {_vendored_path(module)} is not a copy of {module} ({_module_file(module)})"
                    )
            params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
            for key in ("encoder_model", "decoder_model", "stateful_decoder_model"):
                if params.get(key) and params[key] not in parsed:
                    problems.append(
                        f"{name}: parameter {key} names {params[key]!r}, which is not in the repository"
                    )
        else:
            problems.append(f"{name}: unexpected platform/backend {platform or config.get('backend')!r}")
    if problems:
        raise TritonConfigError("the model repository is inconsistent:\n  " + "\n  ".join(problems))
    return pb2 is not None


# ------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m export.triton",
        description=(
            "Write a Triton Inference Server model repository (encoder, decoder step, stateful decoder "
            "step for the tensorscatter flavour, and a Python-backend translator running greedy/beam "
            "search) from an export folder of `python -m export.onnx` (and `python -m export.tensorrt`)."
        ),
        formatter_class=DefaultsHelpFormatter,
    )
    add_option(
        p,
        "--model",
        deprecated=("--export-dir",),
        default=DEFAULT_EXPORT_DIR,
        help="export folder (encoder.onnx, decoder_step.onnx, manifest.json)",
    )
    add_option(
        p,
        "--output-dir",
        deprecated=("--out",),
        default=DEFAULT_REPO_DIR,
        help="model repository folder to create",
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="onnxruntime (onnxruntime_onnx), tensorrt (tensorrt_plan, from the manifest's engines), "
        "auto: tensorrt when engines exist and --instance-kind is not cpu",
    )
    p.add_argument(
        "--precision",
        default=None,
        help="TensorRT engines to serve (fp32, fp16); default fp32 or the only one",
    )
    p.add_argument(
        "--instance-kind",
        choices=INSTANCE_KINDS,
        default="auto",
        help="KIND_CPU / KIND_GPU for the encoder and decoder models (auto: Triton decides)",
    )
    p.add_argument(
        "--instances", type=int, default=1, help="instances of each encoder/decoder model (per GPU)"
    )
    p.add_argument(
        "--gpus", type=_gpu_ids, default=None, help="comma-separated GPU ids for KIND_GPU instances, e.g. 0,1"
    )
    p.add_argument(
        "--translator-instances", type=int, default=1, help="instances of the Python-backend translator"
    )
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=DEFAULT_MAX_BATCH_SIZE,
        help="rows (sources x beams) per execution of the encoder / decoder models",
    )
    p.add_argument(
        "--max-queue-delay-us",
        type=int,
        default=DEFAULT_QUEUE_DELAY_US,
        help="how long the dynamic / sequence batcher waits to merge requests (microseconds)",
    )
    _add_state_arguments(p)
    p.add_argument(
        "--no-translator", dest="translator", action="store_false", help="skip the Python-backend translator"
    )
    p.add_argument(
        "--ort-threads", type=int, default=None, help="intra_op_thread_count of the ONNX Runtime models"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace a non-empty --output-dir folder, if it is a repository written by this tool holding nothing else",
    )
    p.add_argument(
        "--no-validate",
        dest="validate",
        action="store_false",
        help="skip checking the configurations against Triton's protobuf and the graphs",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO) to stderr")
    add_debug_flag(p)
    return p


def _add_state_arguments(p: argparse.ArgumentParser) -> None:
    """Whether the repository has a stateful decoder step, and its cache capacity."""
    state = p.add_mutually_exclusive_group()
    state.add_argument(
        "--stateful",
        dest="stateful",
        action="store_true",
        default=None,
        help="write decoder_step_stateful (default for the tensorscatter flavour)",
    )
    state.add_argument(
        "--no-stateful",
        dest="stateful",
        action="store_false",
        help="no stateful decoder: greedy decoding sends the cache with every step",
    )
    p.add_argument(
        "--state-cache-len",
        type=int,
        default=None,
        help="cache capacity of each stateful sequence (default: the export's max_cache_len)",
    )


def summary_text(result: TritonExportResult) -> str:
    lines = [
        f"wrote {result.repo_dir} ({result.backend}"
        + (f" {result.precision}" if result.precision else "")
        + f", {result.flavour} flavour)"
    ]
    for name, folder in result.models.items():
        lines.append(f"  {name}/  {', '.join(sorted(p.name for p in (folder / '1').iterdir()))}")
    lines.append(
        "configurations "
        + (
            "parsed with Triton's model_config protobuf and checked against the graphs"
            if result.protobuf_checked
            else "not validated with tritonclient (not installed)"
        )
    )
    c = result.cache_bytes
    lines.append(
        f"self-attention cache of one row at cache_len {c['cache_len']}: {c['self_cache']} bytes "
        "(what a stateless decoder step request carries per row)"
    )
    lines += [
        "",
        "serve it (Triton is not part of this package):",
        f"  tritonserver --model-repository={result.repo_dir}",
    ]
    return "\n".join(lines)


def _gpu_ids(text: str) -> list[int]:
    try:
        ids = [int(g) for g in text.split(",") if g.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated GPU ids such as 0,1, got {text!r}"
        ) from None
    if not ids or any(g < 0 for g in ids):
        raise argparse.ArgumentTypeError(f"expected comma-separated GPU ids >= 0 such as 0,1, got {text!r}")
    return ids


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line: exit code 0, 1 for an error (one line on stderr; ``--debug`` shows the
    traceback), 2 for a bad option, 130 / 143 when interrupted by SIGINT / SIGTERM."""
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    return run_cli(parser.prog, lambda: _run(args), debug=args.debug)


def _run(args) -> int:
    result = export_triton(
        args.model,
        args.output_dir,
        backend=args.backend,
        precision=args.precision,
        instance_kind=args.instance_kind,
        instances=args.instances,
        gpus=args.gpus,
        translator_instances=args.translator_instances,
        max_batch_size=args.max_batch_size,
        max_queue_delay_us=args.max_queue_delay_us,
        stateful=args.stateful,
        state_cache_len=args.state_cache_len,
        translator=args.translator,
        ort_threads=args.ort_threads,
        force=args.force,
        validate=args.validate,
    )
    print(summary_text(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
