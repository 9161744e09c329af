"""``python -m export.tensorrt``: TensorRT engines from an ONNX export folder.

Reads the folder written by ``python -m export.onnx`` (``encoder.onnx``, ``decoder_step.onnx``,
``manifest.json``; docs/DESIGN.md section 3) and writes, next to them (or into ``--output-dir``):

* ``encoder.<precision>.engine`` and ``decoder_step.<precision>.engine``: serialized engines,
  each with one optimization profile whose min/opt/max for ``batch``, ``src_len`` and
  ``cache_len`` come from the command line, else from the manifest (``max_len``) and defaults;
* for fp16/bf16, ``encoder.<precision>.onnx`` / ``decoder_step.<precision>.onnx``: the
  reduced-precision graphs the engines were built from (see below; ONNX Runtime runs them too);
* ``manifest.json`` updated with a ``tensorrt`` section: engines (file, size, sha256), precision,
  typing, the cache dtype of every precision, the profile, I/O dtypes, TensorRT version, GPU;
* a timing cache (``--timing-cache``, default ``tensorrt.timing.cache``) that makes rebuilds fast;
* into an ``--output-dir`` apart from the export: a copy of the tokenizer files and the
  generation config, so that the engine folder holds everything a deployment needs besides the
  engines (an export of format version 1 or 2, which has no generation config, gets one with
  the defaults, :class:`transformer_ext.export_format.GenerationConfig`).

Files. Options, the export folder and the output folder are checked before anything is built,
and nothing is written until every engine is built. Into an existing folder (the export folder,
or an ``--output-dir`` with an engine manifest of ours) all files are written to temporaries
first (named ``.NAME.tmp-{host}-{pid}-{random}``, see :mod:`transformer_ext.fsutil`), then renamed
into place with the manifest last; if anything fails, including SIGINT and SIGTERM, the folder
is put back as it was. A new ``--output-dir`` is built as a whole in a temporary folder
(:class:`transformer_ext.fsutil.StagedDir`). The manifest's ``files`` list names every file the
builder adds, so ``python -m export.onnx`` may later replace the folder. An existing file the
builder would overwrite must be one the manifest lists (the timing cache excepted: it is read
and extended), and an ``--output-dir`` that is neither new, empty, nor one of ours is refused.
Temporaries of a killed earlier run are removed by the next one.

Precision. ``fp32``: a strongly typed network over the float32 graphs, TF32 off (parity with
eager float32; ``--tf32`` turns it on). ``fp16`` / ``bf16`` (``--typing strong``, the default):
the graphs are converted to that precision before parsing
(:func:`transformer_ext.precision.convert_precision`: weights, caches and activations in
fp16/bf16) with softmax, normalizations, reductions, ``Exp``/``Log``/``Pow``/``Sqrt`` kept in
float32 by explicit ``Cast`` nodes, and ``logits`` returned in float32; the network is strongly
typed, so TensorRT runs exactly those types (TensorRT 11 removes the weakly-typed builder flags).
``--typing weak`` (TensorRT 10.x only) instead sets ``BuilderFlag.FP16``/``BF16`` with
``OBEY_PRECISION_CONSTRAINTS`` and pins softmax / reduce / normalization layers to float32.
Either way the self- and cross-attention caches have the precision's dtype
(:data:`CACHE_DTYPES`), stated in the manifest; matrix products accumulate in float32 (TensorRT's
GEMM kernels for fp16/bf16 inputs accumulate in float32).

Before anything is built, :func:`export.trt_readiness.check_export_dir` checks the graphs, the
original and the converted ones, against what the exporter emits and TensorRT 10.15's parser
requires of it (``--check-only`` runs only this check and needs no TensorRT). Parser errors are
logged one by one and end in :class:`TensorRTParseError`.

TensorRT itself is imported only when building (:func:`transformer_ext.tensorrt_support.import_tensorrt`):
``pip install tensorrt-cu13`` (CUDA 13; or ``tensorrt-cu12``), or ``pip install 'transformer_ext[tensorrt]'``.
"""

from __future__ import annotations

if __name__ == "__main__":  # before the imports: one line, not a traceback, where they are missing
    from transformer_ext.commands import require

    require("export.tensorrt")

import argparse
import copy
import datetime as _dt
import hashlib
import json
import logging
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import onnx

from transformer_ext.cli import add_debug_flag, run_cli, take_positional_spelling
from transformer_ext.export_format import (
    BATCH,
    CACHE_LEN,
    CROSS_PER_SOURCE_VERSION,
    CUSTOM_OP_FLAVOUR,
    CUSTOM_OP_REFUSAL,
    DECODER_FILE,
    ENCODER_FILE,
    FORMAT_VERSION,
    GENERATION_FILE,
    HASHES_KEY,
    MANIFEST_NAME,
    SRC_LEN,
    GenerationConfig,
    cross_per_source,
    dtype_from_tensorrt,
    file_sha256,
    read_generation_config,
    read_manifest,
    tokenizer_files,
)
from transformer_ext.fsutil import StagedDir, atomic_write_bytes, remove_stale_temporaries, temporary_name
from transformer_ext.precision import (
    CACHE_DTYPES,
    FLOAT32_OPS,
    FLOAT32_OUTPUTS,
    PRECISIONS,
    PrecisionConversionError,
    convert_precision,
)
from transformer_ext.tensorrt_support import (
    INSTALL_HINT,
    MIN_TENSORRT_VERSION,
    TensorRTNotAvailableError,
    import_tensorrt,
)
from transformer_ext.tensorrt_support import TrtLogger as _TrtLogger

from . import ExportError, ManifestError, OutputFolderError
from . import manifest as export_manifest
from .trt_readiness import (
    INT8_REFUSAL,
    ORT_FLAVOUR_REFUSAL,
    TRT_TARGET_VERSION,
    AxisRange,
    ReadinessReport,
    TensorRTReadinessError,
    check_export_dir,
    decoder_flavour,
    input_specs,
    output_specs,
    parse_axis_range,
    profile_shapes,
)

logger = logging.getLogger(__name__)

TYPINGS = ("strong", "weak")

__all__ = [
    "MIN_TENSORRT_VERSION",
    "PRECISIONS",
    "CACHE_DTYPES",
    "FLOAT32_OPS",
    "TensorRTNotAvailableError",
    "TensorRTParseError",
    "TensorRTBuildError",
    "PrecisionConversionError",
    "BuildOptions",
    "EnginePlan",
    "BuildPlan",
    "BuildResult",
    "import_tensorrt",
    "precision_flags",
    "convert_precision",
    "pin_axes",
    "plan_build",
    "build_engines",
    "describe_parser_error",
    "build_parser",
    "main",
]


class TensorRTParseError(ExportError, RuntimeError):
    """TensorRT's ONNX parser rejected a graph; ``errors`` holds one line per parser error."""

    def __init__(self, graph: str, errors: Sequence[str]):
        self.graph = graph
        self.errors = list(errors)
        body = (
            "\n".join(f"  {i + 1}. {e}" for i, e in enumerate(self.errors))
            or "  (the parser reported no detail)"
        )
        super().__init__(
            f"TensorRT's ONNX parser rejected {graph} with {len(self.errors)} error(s):\n{body}\n"
            "Run `python -m export.tensorrt --check-only` for the static readiness report, and check "
            f"that TensorRT is {MIN_TENSORRT_VERSION} or newer."
        )

    def __reduce__(self):
        return (type(self), (self.graph, self.errors))


class TensorRTBuildError(ExportError, RuntimeError):
    """TensorRT parsed a graph but could not build an engine from it."""


# ------------------------------------------------------------------------------------------
# Options and plans (no TensorRT needed)
# ------------------------------------------------------------------------------------------


@dataclass
class BuildOptions:
    """What to build.

    ``axis_ranges``: profile per named axis (``batch``, ``src_len``, ``cache_len``...); missing
    ones default to :func:`export.trt_readiness.default_axis_ranges` with the manifest's
    ``max_len``. ``batch`` counts decoder rows: sources x beams.
    """

    precision: str = "fp32"
    typing: str = "strong"
    axis_ranges: dict[str, AxisRange] = field(default_factory=dict)
    output_dir: Optional[Union[str, os.PathLike]] = None  # default: the export folder
    timing_cache: Optional[Union[str, os.PathLike]] = None  # default: <output_dir>/tensorrt.timing.cache
    workspace_mib: int = 4096
    tf32: bool = False
    optimization_level: Optional[int] = None  # TensorRT's builder_optimization_level (0..5; default 3)
    keep_onnx: bool = True  # write the converted fp16/bf16 graphs next to the engines

    def validate(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {self.precision!r}")
        if self.typing not in TYPINGS:
            raise ValueError(f"typing must be one of {TYPINGS}, got {self.typing!r}")
        if self.workspace_mib < 1:
            raise ValueError(f"workspace_mib must be >= 1, got {self.workspace_mib}")
        if self.optimization_level is not None and not 0 <= self.optimization_level <= 5:
            raise ValueError(f"optimization_level must be in 0..5, got {self.optimization_level}")
        for axis, r in self.axis_ranges.items():
            problems = r.problems(axis)
            if problems:
                raise ValueError("; ".join(problems))


def precision_flags(precision: str, typing: str = "strong", tf32: bool = False) -> dict[str, list[str]]:
    """Network-creation flags, builder flags to set and to clear, by name (resolved against
    ``tensorrt`` at build time)::

        fp32 strong -> network [STRONGLY_TYPED], set [],                                clear [TF32]
        fp16 strong -> network [STRONGLY_TYPED], set [],                                clear [TF32]
        fp16 weak   -> network [],               set [FP16, OBEY_PRECISION_CONSTRAINTS], clear [TF32]
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    if typing not in TYPINGS:
        raise ValueError(f"typing must be one of {TYPINGS}, got {typing!r}")
    network = ["STRONGLY_TYPED"] if typing == "strong" else []
    set_flags: list[str] = []
    if typing == "weak" and PRECISIONS[precision]["weak_flag"]:
        set_flags += [PRECISIONS[precision]["weak_flag"], "OBEY_PRECISION_CONSTRAINTS"]
    clear = [] if tf32 else ["TF32"]
    if tf32:
        set_flags.append("TF32")
    return {"network": network, "set": set_flags, "clear": clear}


@dataclass
class EnginePlan:
    """One engine: its graph, files, profile shapes and I/O dtypes."""

    graph: str  # "encoder" | "decoder_step"
    onnx_path: str  # the original graph
    engine_file: str
    converted_onnx_file: Optional[str]
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]
    io_dtypes: dict[str, str]
    pinned_axes: dict[str, int] = field(default_factory=dict)


@dataclass
class BuildPlan:
    """Everything :func:`build_engines` will do, decided without TensorRT."""

    export_dir: str
    output_dir: str
    precision: str
    typing: str
    cache_dtype: str
    flavour: str
    flags: dict[str, list[str]]
    axis_ranges: dict[str, AxisRange]
    timing_cache: str
    workspace_bytes: int
    optimization_level: Optional[int]
    engines: list[EnginePlan]
    readiness: ReadinessReport

    def engine(self, graph: str) -> EnginePlan:
        for e in self.engines:
            if e.graph == graph:
                return e
        raise KeyError(graph)


@dataclass
class BuildResult:
    plan: BuildPlan
    engine_paths: dict[str, str]
    manifest_path: str
    timing_cache_path: str
    tensorrt_version: str


# ------------------------------------------------------------------------------------------
# Graph rewrites: pin axes (the precision conversion is transformer_ext.precision.convert_precision)
# ------------------------------------------------------------------------------------------


def pin_axes(model: onnx.ModelProto, values: Mapping[str, int]) -> onnx.ModelProto:
    """A copy of ``model`` whose named dims in ``values`` are fixed (inputs, outputs, value_info).

    TensorRT's KV-cache update layer (``TensorScatter``) needs a static cache length, so the
    ``tensorscatter`` flavour is built with ``cache_len`` pinned to the engine's capacity.
    """
    out = copy.deepcopy(model)
    for vi in list(out.graph.input) + list(out.graph.output) + list(out.graph.value_info):
        if not vi.type.HasField("tensor_type"):
            continue
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param") and d.dim_param in values:
                v = int(values[d.dim_param])
                d.ClearField("dim_param")
                d.dim_value = v
    return out


# ------------------------------------------------------------------------------------------
# Planning
# ------------------------------------------------------------------------------------------


def _io_dtypes(model: onnx.ModelProto) -> dict[str, str]:
    return {s.name: s.dtype for s in input_specs(model) + output_specs(model)}


def _weak_io_dtypes(model: onnx.ModelProto, precision: str) -> dict[str, str]:
    """I/O dtypes the weakly-typed path gives the network: float I/O in the cache dtype, logits float32."""
    cache = CACHE_DTYPES[precision]
    out = {}
    for name, dtype in _io_dtypes(model).items():
        out[name] = cache if dtype == "float32" and name not in FLOAT32_OUTPUTS else dtype
    return out


def _load_full(path: Path) -> onnx.ModelProto:
    try:
        return onnx.load(os.fspath(path))
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"cannot load {path}: {exc}") from exc


def _checked_export_dir(export_dir: Union[str, os.PathLike]) -> Path:
    """The resolved export folder; refuses a missing folder."""
    export_dir = Path(export_dir).resolve()
    if not export_dir.is_dir():
        raise FileNotFoundError(
            f"export folder not found: {export_dir} (write one with `python -m export.onnx`)"
        )
    return export_dir


def _static_cache_ranges(export_dir: Path, axis_ranges: Mapping[str, AxisRange]) -> dict[str, AxisRange]:
    """The user's axis ranges, with a dynamic cache_len fixed to its max when the decoder is of the
    tensorscatter flavour (TensorRT's KV-cache update layer needs a static cache length)."""
    user_ranges = dict(axis_ranges)
    if (
        CACHE_LEN in user_ranges
        and not user_ranges[CACHE_LEN].static
        and (export_dir / DECODER_FILE).is_file()
    ):
        try:
            dec_outputs = [
                o.name
                for o in onnx.load(
                    os.fspath(export_dir / DECODER_FILE), load_external_data=False
                ).graph.output
            ]
        except Exception:  # noqa: BLE001 - the readiness check reports a corrupt graph
            dec_outputs = []
        if decoder_flavour(dec_outputs) == "tensorscatter":
            n = user_ranges[CACHE_LEN].max
            logger.warning(
                "tensorscatter flavour: TensorRT's KV-cache update layer needs a static cache length; "
                "cache_len %s -> %d:%d:%d",
                user_ranges[CACHE_LEN],
                n,
                n,
                n,
            )
            user_ranges[CACHE_LEN] = AxisRange(n, n, n)
    return user_ranges


def _engine_plans(
    export_dir: Path,
    options: BuildOptions,
    graphs: Mapping[str, onnx.ModelProto],
    originals: Mapping[str, onnx.ModelProto],
    ranges: Mapping[str, AxisRange],
    pinned: Mapping[str, int],
) -> list[EnginePlan]:
    """One :class:`EnginePlan` per graph TensorRT will parse: file names, profile shapes, dtypes."""
    suffix = options.precision
    engines = []
    for key, m in graphs.items():
        engines.append(
            EnginePlan(
                graph=key,
                onnx_path=os.fspath(export_dir / f"{key}.onnx"),
                engine_file=f"{key}.{suffix}.engine",
                converted_onnx_file=f"{key}.{suffix}.onnx"
                if (options.keep_onnx and m is not originals[key] and options.precision != "fp32")
                else None,
                shapes=profile_shapes(input_specs(m), ranges),
                io_dtypes=_io_dtypes(m)
                if options.typing == "strong"
                else _weak_io_dtypes(m, options.precision),
                pinned_axes=dict(pinned) if key == "decoder_step" else {},
            )
        )
    return engines


def plan_build(
    export_dir: Union[str, os.PathLike], options: Optional[BuildOptions] = None
) -> tuple[BuildPlan, dict[str, onnx.ModelProto]]:
    """Decide everything about a build without TensorRT: readiness, axis ranges, graph rewrites,
    profile shapes, flags, file names. Returns the plan and the graphs to parse.

    Raises:
        FileNotFoundError: no export folder.
        TensorRTReadinessError: the (rewritten) graphs would not build; lists every problem.
    """
    options = options or BuildOptions()
    options.validate()
    export_dir = _checked_export_dir(export_dir)
    output_dir = Path(options.output_dir).resolve() if options.output_dir else export_dir
    manifest = read_manifest(export_dir)
    if manifest.get("quantization"):
        raise ExportError(INT8_REFUSAL.format(folder=export_dir))
    if manifest.get("flavour") == "ort":
        raise ExportError(ORT_FLAVOUR_REFUSAL.format(folder=export_dir))
    if manifest.get("flavour") == CUSTOM_OP_FLAVOUR:
        raise ExportError(CUSTOM_OP_REFUSAL.format(folder=export_dir, what="TensorRT"))

    user_ranges = _static_cache_ranges(export_dir, options.axis_ranges)
    # The original graphs are checked first (manifest included): problems there are the exporter's.
    readiness_original = check_export_dir(export_dir, user_ranges or None, raise_on_error=True)
    flavour = readiness_original.flavour or "portable"
    ranges = dict(readiness_original.axis_ranges)

    originals = {
        "encoder": _load_full(export_dir / ENCODER_FILE),
        "decoder_step": _load_full(export_dir / DECODER_FILE),
    }
    pinned: dict[str, int] = {}
    if flavour == "tensorscatter":
        # TensorRT's KV-cache update layer needs a static cache length (and aliases in/out).
        pinned[CACHE_LEN] = ranges[CACHE_LEN].max
        ranges[CACHE_LEN] = AxisRange(pinned[CACHE_LEN], pinned[CACHE_LEN], pinned[CACHE_LEN])

    graphs: dict[str, onnx.ModelProto] = {}
    for key, model in originals.items():
        m = pin_axes(model, pinned) if pinned and key == "decoder_step" else model
        if options.typing == "strong" and options.precision != "fp32":
            m = convert_precision(m, options.precision)
        graphs[key] = m
    # The graphs TensorRT will parse are checked too (types after conversion, pinned axes).
    readiness = check_export_dir(
        export_dir, ranges, raise_on_error=True, graphs=graphs, compare_manifest=False
    )
    engines = _engine_plans(export_dir, options, graphs, originals, ranges, pinned)
    timing_cache = (
        Path(options.timing_cache).resolve() if options.timing_cache else output_dir / "tensorrt.timing.cache"
    )
    plan = BuildPlan(
        export_dir=os.fspath(export_dir),
        output_dir=os.fspath(output_dir),
        precision=options.precision,
        typing=options.typing,
        cache_dtype=CACHE_DTYPES[options.precision],
        flavour=flavour,
        flags=precision_flags(options.precision, options.typing, options.tf32),
        axis_ranges=ranges,
        timing_cache=os.fspath(timing_cache),
        workspace_bytes=int(options.workspace_mib) << 20,
        optimization_level=options.optimization_level,
        engines=engines,
        readiness=readiness,
    )
    logger.info(
        "plan: %s %s-typed, cache dtype %s, flavour %s, profile %s",
        plan.precision,
        plan.typing,
        plan.cache_dtype,
        plan.flavour,
        ", ".join(f"{k}={v}" for k, v in sorted(ranges.items())),
    )
    return plan, graphs


# ------------------------------------------------------------------------------------------
# Building (TensorRT)
# ------------------------------------------------------------------------------------------


def describe_parser_error(error: Any) -> str:
    """One line for a TensorRT ``ParserError``: code, description, node index, name and op."""

    def get(attr):
        fn = getattr(error, attr, None)
        if fn is None:
            return None
        try:
            return fn() if callable(fn) else fn
        except Exception:  # noqa: BLE001 - older parsers lack some accessors
            return None

    code = get("code")
    code = getattr(code, "name", code)
    parts = [f"{code}: {get('desc')}"]
    node = get("node")
    if node is not None and node != -1:
        name, op = get("node_name"), get("node_operator")
        parts.append(f"at node {node}" + (f" {name!r}" if name else "") + (f" ({op})" if op else ""))
    where = get("file"), get("line"), get("func")
    if where[0]:
        parts.append(f"[{where[2]} {os.path.basename(str(where[0]))}:{where[1]}]")
    return " ".join(parts)


def _float32_layer_types(trt) -> set:
    return {
        t
        for t in (getattr(trt.LayerType, n, None) for n in ("SOFTMAX", "REDUCE", "NORMALIZATION"))
        if t is not None
    }


def apply_weak_precision(trt, network, precision: str, io_dtypes: Mapping[str, str]) -> int:
    """Weakly-typed reduced precision: pin softmax / reduce / normalization layers (and their
    outputs) to float32, give the network I/O the planned dtypes. Returns the layers pinned."""
    trt_dtypes = {
        "float32": trt.float32,
        "float16": trt.float16,
        "bfloat16": trt.bfloat16,
        "int64": trt.int64,
        "int32": trt.int32,
        "bool": trt.bool,
    }
    pinned = 0
    kinds = _float32_layer_types(trt)
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type in kinds:
            layer.precision = trt.float32
            for j in range(layer.num_outputs):
                layer.set_output_type(j, trt.float32)
            pinned += 1
    for i in range(network.num_inputs):
        t = network.get_input(i)
        if t.name in io_dtypes:
            t.dtype = trt_dtypes[io_dtypes[t.name]]
    for i in range(network.num_outputs):
        t = network.get_output(i)
        if t.name in io_dtypes:
            t.dtype = trt_dtypes[io_dtypes[t.name]]
    logger.info("weak typing: %d softmax/reduce/normalization layers pinned to float32", pinned)
    return pinned


def _build_one(
    trt, trt_logger, plan: BuildPlan, eplan: EnginePlan, model: onnx.ModelProto, timing_cache
) -> bytes:
    builder = trt.Builder(trt_logger)
    flags = 0
    for name in plan.flags["network"]:
        flags |= 1 << int(getattr(trt.NetworkDefinitionCreationFlag, name))
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, trt_logger)
    logger.info("parsing %s (%s)", eplan.graph, eplan.converted_onnx_file or eplan.onnx_path)
    if model.ByteSize() >= 2**31:
        raise TensorRTBuildError(
            f"{eplan.graph}: the graph with its weights exceeds 2 GiB, the protobuf limit of "
            "an in-memory parse; export with external weights and build from files"
        )
    if not parser.parse(model.SerializeToString(), eplan.onnx_path):
        errors = [describe_parser_error(parser.get_error(i)) for i in range(parser.num_errors)]
        for i, e in enumerate(errors):
            logger.error("%s: parser error %d/%d: %s", eplan.graph, i + 1, len(errors), e)
        raise TensorRTParseError(f"{eplan.graph}.onnx", errors)
    names = {network.get_input(i).name for i in range(network.num_inputs)}
    if names != set(eplan.shapes):
        raise TensorRTBuildError(
            f"{eplan.graph}: the parsed network's inputs {sorted(names)} differ from the planned profile's "
            f"{sorted(eplan.shapes)}"
        )
    if plan.typing == "weak":
        apply_weak_precision(trt, network, plan.precision, eplan.io_dtypes)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, plan.workspace_bytes)
    for f in plan.flags["set"]:
        config.set_flag(getattr(trt.BuilderFlag, f))
    for f in plan.flags["clear"]:
        config.clear_flag(getattr(trt.BuilderFlag, f))
    if plan.optimization_level is not None:
        config.builder_optimization_level = plan.optimization_level
    config.set_timing_cache(timing_cache, False)
    profile = builder.create_optimization_profile()
    for name, (lo, mid, hi) in eplan.shapes.items():
        profile.set_shape(name, lo, mid, hi)
    config.add_optimization_profile(profile)
    logger.info(
        "building %s engine (%s, %s typing); this takes a while", eplan.graph, plan.precision, plan.typing
    )
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise TensorRTBuildError(
            f"TensorRT could not build the {eplan.graph} engine ({plan.precision}); the TensorRT errors above "
            "say why (raise the log level with -v)"
        )
    return bytes(memoryview(serialized))


def _engine_io(trt, trt_logger, data: bytes) -> dict[str, dict[str, Any]]:
    """Names, modes, dtypes and shapes of a serialized engine's I/O tensors."""
    runtime = trt.Runtime(trt_logger)
    engine = runtime.deserialize_cuda_engine(data)
    if engine is None:
        raise TensorRTBuildError("TensorRT could not deserialize the engine it just built")
    out = {}
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        out[name] = {
            "mode": engine.get_tensor_mode(name).name.lower(),
            "dtype": dtype_from_tensorrt(engine.get_tensor_dtype(name).name),
            "shape": list(engine.get_tensor_shape(name)),
        }
    return out


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_new_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _commit_files(directory: Path, files: Mapping[str, bytes]) -> None:
    """Write ``files`` (name -> data, the manifest last) into the existing ``directory``: all or none.

    Every file is first written to a temporary sibling; then, in order, an existing file is moved
    to a backup and the new one renamed into place. When anything fails (an error, SIGINT, SIGTERM
    under ``run_cli``) the new files are removed and the backups put back; once every file is in
    place the backups are deleted. Temporaries and backups use :func:`transformer_ext.fsutil.temporary_name`,
    so those of a killed run are removed by the next write (:func:`remove_stale_temporaries`).
    """
    staged: dict[str, Path] = {}
    moved: list[tuple[Path, Optional[Path], Path]] = []  # (target, backup, temporary)
    try:
        for name, data in files.items():
            target = directory / name
            remove_stale_temporaries(target)
            staged[name] = directory / temporary_name(target)
            _write_new_file(staged[name], data)
        for name, tmp in staged.items():
            target = directory / name
            backup = directory / temporary_name(target, "old") if os.path.lexists(target) else None
            moved.append((target, backup, tmp))
            if backup is not None:
                os.rename(target, backup)
            os.rename(tmp, target)
    except BaseException:
        for target, backup, tmp in reversed(moved):
            try:
                if not os.path.lexists(tmp) and os.path.lexists(target):
                    os.unlink(target)  # the new file was in place
                if backup is not None and os.path.lexists(backup):
                    os.rename(backup, target)
            except OSError as exc:  # keep restoring the others
                logger.error("could not restore %s from %s: %s", target, backup, exc)
        for tmp in staged.values():
            try:
                os.unlink(tmp)
            except OSError:
                pass
        raise
    for _, backup, _ in moved:
        if backup is not None:
            try:
                os.unlink(backup)
            except OSError as exc:
                logger.warning("could not remove the backup %s: %s", backup, exc)


def _gpu_info() -> dict[str, Any]:
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            return {"name": p.name, "compute_capability": f"{p.major}.{p.minor}"}
    except Exception:  # noqa: BLE001 - torch is optional here
        pass
    return {}


def manifest_section(
    plan: BuildPlan, engine_bytes: Mapping[str, bytes], engine_io: Mapping[str, Any], trt_version: str
) -> dict[str, Any]:
    """The ``tensorrt.engines[<precision>]`` entry of the manifest."""
    return {
        "precision": plan.precision,
        "typing": plan.typing,
        "cache_dtype": plan.cache_dtype,
        "flavour": plan.flavour,
        "tensorrt_version": trt_version,
        "target_parser": f"TensorRT {TRT_TARGET_VERSION}+",
        "flags": plan.flags,
        "axes": {k: asdict(v) for k, v in sorted(plan.axis_ranges.items())},
        "engines": {
            e.graph: {
                "file": e.engine_file,
                "bytes": len(engine_bytes[e.graph]),
                "sha256": _sha256(engine_bytes[e.graph]),
                "onnx": e.converted_onnx_file or os.path.relpath(e.onnx_path, plan.output_dir),
                "profile": {
                    name: {"min": list(lo), "opt": list(mid), "max": list(hi)}
                    for name, (lo, mid, hi) in e.shapes.items()
                },
                "io_dtypes": e.io_dtypes,
                "io": engine_io.get(e.graph, {}),
                "pinned_axes": e.pinned_axes,
            }
            for e in plan.engines
        },
        "timing_cache": os.path.relpath(plan.timing_cache, plan.output_dir),
        "device": _gpu_info(),
        "built_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "readiness_warnings": [str(w) for w in plan.readiness.warnings],
    }


def update_manifest(manifest: dict[str, Any], plan: BuildPlan, section: Mapping[str, Any]) -> dict[str, Any]:
    """``manifest`` with ``tensorrt.engines[precision] = section`` and the cache dtype table."""
    out = copy.deepcopy(manifest)
    trt_section = out.setdefault("tensorrt", {})
    trt_section["cache_dtypes"] = dict(CACHE_DTYPES)
    trt_section.setdefault("engines", {})[plan.precision] = dict(section)
    if plan.output_dir != plan.export_dir:
        out.setdefault("onnx_dir", os.path.relpath(plan.export_dir, plan.output_dir))
    return out


def build_engines(export_dir: Union[str, os.PathLike], options: Optional[BuildOptions] = None) -> BuildResult:
    """Build the encoder and decoder-step engines of an export folder (see the module docstring).

    Raises:
        TensorRTReadinessError: the graphs fail the static check (nothing is built).
        TensorRTNotAvailableError: TensorRT is not installed (after the readiness check passed).
        TensorRTParseError / TensorRTBuildError: TensorRT rejected a graph (nothing is written).
        ManifestError / OutputFolderError: the export folder is not one, or the output folder may
            not be written (see :func:`_check_output_folder`); checked before building.
        OSError: writing failed (full disk, read-only file system); the output folder is as it was.
    """
    options = options or BuildOptions()
    plan, graphs = plan_build(export_dir, options)
    target = _check_output_folder(plan)
    trt = import_tensorrt()
    trt_logger = _TrtLogger.create(trt)
    out_dir = Path(plan.output_dir)
    timing_path = Path(plan.timing_cache)

    # One timing cache object, created from the file (if any), shared by every engine's config;
    # the builder and config that created it stay alive until the end of the build.
    cache_builder = trt.Builder(trt_logger)
    cache_config = cache_builder.create_builder_config()
    cache_bytes = timing_path.read_bytes() if timing_path.exists() else b""
    timing_cache = cache_config.create_timing_cache(cache_bytes)
    if cache_bytes:
        logger.info("timing cache: %s (%d bytes)", timing_path, len(cache_bytes))

    engine_bytes: dict[str, bytes] = {}
    engine_io: dict[str, Any] = {}
    for eplan in plan.engines:
        engine_bytes[eplan.graph] = _build_one(
            trt, trt_logger, plan, eplan, graphs[eplan.graph], timing_cache
        )
        engine_io[eplan.graph] = _engine_io(trt, trt_logger, engine_bytes[eplan.graph])
        built = {name: info["dtype"] for name, info in engine_io[eplan.graph].items()}
        if built != eplan.io_dtypes:
            diff = sorted(
                n for n in set(built) | set(eplan.io_dtypes) if built.get(n) != eplan.io_dtypes.get(n)
            )
            raise TensorRTBuildError(
                f"the {eplan.graph} engine's I/O differs from the plan at {diff}: engine "
                f"{ {n: built.get(n) for n in diff} }, plan { {n: eplan.io_dtypes.get(n) for n in diff} }"
            )

    # Everything built: the converted graphs, engines, timing cache and, last, the manifest.
    files: dict[str, bytes] = {}
    paths = {}
    for eplan in plan.engines:
        if eplan.converted_onnx_file:
            files[eplan.converted_onnx_file] = graphs[eplan.graph].SerializeToString()
        files[eplan.engine_file] = engine_bytes[eplan.graph]
        paths[eplan.graph] = os.fspath(out_dir / eplan.engine_file)
    files.update(
        target.carried
    )  # an engine folder apart from the export: its tokenizer and generation config
    timing_data = bytes(memoryview(timing_cache.serialize()))
    timing_inside = timing_path.parent == out_dir
    if timing_inside:
        files[timing_path.name] = timing_data
    trt_version = getattr(trt, "__version__", "?")
    section = manifest_section(plan, engine_bytes, engine_io, trt_version)
    manifest = update_manifest(target.base_manifest, plan, section)
    # An older folder keeps the version its graphs follow (one cross-attention row per row).
    manifest["format_version"] = (
        FORMAT_VERSION if cross_per_source(manifest["graphs"]) else CROSS_PER_SOURCE_VERSION - 1
    )
    manifest["tokenizer_files"] = tokenizer_files(target.base_manifest)
    manifest["generation_config"] = target.generation_config
    manifest["files"] = sorted(set(target.listed_files) | set(files) | {MANIFEST_NAME})
    manifest[HASHES_KEY] = {
        name: hashlib.sha256(files[name]).hexdigest() if name in files else file_sha256(out_dir / name)
        for name in manifest["files"]
        if name != MANIFEST_NAME and (name in files or (out_dir / name).is_file())
    }
    files[MANIFEST_NAME] = (json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False) + "\n").encode()
    manifest_path = out_dir / MANIFEST_NAME
    made: list[Path] = []
    try:
        if not timing_inside:  # a cache file of the user's choice, read above and extended
            export_manifest.make_parents(timing_path, made)
            atomic_write_bytes(timing_path, timing_data)
        if target.existing:
            _commit_files(out_dir, files)
        else:
            export_manifest.make_parents(out_dir, made)
            with StagedDir(out_dir) as stage:
                for name, data in files.items():
                    _write_new_file(stage.path / name, data)
                stage.commit()
    except BaseException as exc:
        export_manifest.remove_made_parents(made)
        named = export_manifest.named_write_error(exc, out_dir)
        if named is not None:
            raise named from exc
        raise
    logger.info("wrote %s, %s and %s", paths["encoder"], paths["decoder_step"], manifest_path)
    return BuildResult(plan, paths, os.fspath(manifest_path), os.fspath(timing_path), trt_version)


@dataclass
class _OutputFolder:
    """Where a build writes, decided before building: ``existing`` (files are added) or a new
    folder; the manifest the new one extends and the files already listed in it."""

    existing: bool
    base_manifest: dict
    listed_files: list[str]
    carried: dict[str, bytes] = field(default_factory=dict)  # see _deployment_files
    generation_config: str = GENERATION_FILE


def _deployment_files(
    export_dir: Path, out_dir: Path, manifest: Mapping[str, Any]
) -> tuple[dict[str, bytes], str]:
    """``(files to add besides the engines, the name of the generation config)``.

    An export folder of format version 1 or 2 has no generation config: the build adds one with
    the defaults (the manifest it writes is of the current version). An engine folder apart from
    the export (``--output-dir``) gets a copy of the tokenizer files and the generation config,
    so that it holds everything a deployment needs besides the engines.
    """
    out: dict[str, bytes] = {}
    name = manifest.get("generation_config")
    names = list(tokenizer_files(manifest))
    if name is None:
        name = GENERATION_FILE
        default = GenerationConfig.defaults_for(manifest).to_dict()
        out[name] = (json.dumps(default, indent=2, allow_nan=False) + "\n").encode()
    else:
        read_generation_config(export_dir, manifest)  # a bad one is refused before building
        names.append(name)
    if out_dir != export_dir:
        for n in names:
            path = export_dir / n
            if not path.is_file():
                raise ManifestError(
                    f"{path} is named by {export_dir / MANIFEST_NAME} but missing (export the model again)"
                )
            out[n] = path.read_bytes()
    return out, name


def _check_output_folder(plan: "BuildPlan") -> _OutputFolder:
    """Decide (reading only) whether and how the build may write to ``plan.output_dir``.

    Raises:
        ManifestError: the export folder's manifest is missing or invalid.
        OutputFolderError: ``--output-dir`` is a file, or a non-empty folder without an engine
            manifest of ours, or a file the build would overwrite is not one this package wrote.
    """
    export_dir, out_dir = Path(plan.export_dir), Path(plan.output_dir)
    export_meta = read_manifest(export_dir)
    carried, generation_name = _deployment_files(export_dir, out_dir, export_meta)
    export_manifest.check_output_path(out_dir)
    timing = Path(plan.timing_cache)
    if timing.is_dir():
        raise OutputFolderError(f"--timing-cache {timing} is a folder; give the path of a file")
    export_manifest.check_output_path(timing.parent, "--timing-cache")
    if out_dir.exists() and os.listdir(out_dir):
        if out_dir == export_dir:
            base = export_meta
        else:
            try:
                base = read_manifest(out_dir)
            except ExportError as exc:
                raise OutputFolderError(
                    f"--output-dir {out_dir} is not empty and holds no engine manifest of this package ({exc}); "
                    "refusing to write into it: choose a new or empty folder"
                ) from None
            onnx_dir = base.get("onnx_dir")
            if not isinstance(onnx_dir, str) or (out_dir / onnx_dir).resolve() != export_dir:
                what = (
                    "the graphs of another export"
                    if not onnx_dir
                    else f"the engines of the export {onnx_dir}"
                )
                raise OutputFolderError(
                    f"--output-dir {out_dir} holds {what}: adding the engines of {export_dir} to its manifest "
                    "would make it describe two exports; choose a new or empty folder"
                )
        owned = export_manifest.owned_files(base)
        present = set(os.listdir(out_dir))
        timing_name = Path(plan.timing_cache).name if Path(plan.timing_cache).parent == out_dir else None
        writes = {e.engine_file for e in plan.engines} | {
            e.converted_onnx_file for e in plan.engines if e.converted_onnx_file
        }
        writes |= set(carried)
        foreign = sorted(n for n in writes & present if n not in owned)
        if foreign:
            raise OutputFolderError(
                f"{out_dir} holds {', '.join(foreign)}, which its manifest does not list: refusing to overwrite "
                "files this package did not write; move them away or choose another --output-dir"
            )
        listed = sorted((owned & present) | ({timing_name} & present if timing_name else set()))
        return _OutputFolder(True, base, listed, carried, generation_name)
    return _OutputFolder(False, export_meta, [], carried, generation_name)


# ------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------


def _axis_arg(text: str) -> tuple[str, AxisRange]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected NAME=MIN:OPT:MAX, got {text!r}")
    name, value = text.split("=", 1)
    try:
        return name.strip(), parse_axis_range(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _range_arg(text: str) -> AxisRange:
    try:
        return parse_axis_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m export.tensorrt",
        description="Build TensorRT engines (encoder + decoder step) from a `python -m export.onnx` folder.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "Ranges are MIN:OPT:MAX or N (= 1:N:N). Defaults: batch 1:16:64, src_len 1:32:max_len, "
            "cache_len 1:64:max_len (max_len from the manifest).\n"
            "Examples:\n"
            "  python -m export.tensorrt --model onnx_export --check-only\n"
            "  python -m export.tensorrt --model onnx_export --precision fp16 --batch 1:16:64 --cache-len 1:64:128\n"
            f"TensorRT >= {MIN_TENSORRT_VERSION} is needed to build: {INSTALL_HINT}."
        ),
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="EXPORT_DIR",
        help="folder written by `python -m export.onnx` (default: onnx_export; EXPORT_DIR as a positional "
        "argument: deprecated spelling)",
    )
    # the old spelling of --model (take_positional_spelling)
    p.add_argument("export_dir", nargs="?", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--precision",
        choices=sorted(PRECISIONS),
        default="fp32",
        help="engine precision; caches are float32 / float16 / bfloat16 accordingly; softmax, "
        "normalizations and reductions stay float32 (default: fp32)",
    )
    p.add_argument(
        "--typing",
        choices=TYPINGS,
        default="strong",
        help="strong: convert the graphs to the precision and build a strongly typed network "
        "(default); weak: TensorRT 10.x builder flags with float32 layer constraints",
    )
    p.add_argument(
        "--batch",
        type=_range_arg,
        metavar="MIN:OPT:MAX",
        help="decoder rows per call (sources x beams); also the encoder batch",
    )
    p.add_argument("--src-len", type=_range_arg, metavar="MIN:OPT:MAX", help="source length in tokens")
    p.add_argument(
        "--cache-len",
        type=_range_arg,
        metavar="MIN:OPT:MAX",
        help="self-attention cache capacity (the tensorscatter flavour uses a static one: N)",
    )
    p.add_argument(
        "--axis",
        type=_axis_arg,
        action="append",
        default=[],
        metavar="NAME=MIN:OPT:MAX",
        help="range of any other named dynamic axis (repeatable)",
    )
    p.add_argument(
        "--output-dir", help="where engines and the updated manifest go (default: the export folder)"
    )
    p.add_argument(
        "--timing-cache",
        help="timing cache file, read if present and updated (default: <output-dir>/tensorrt.timing.cache)",
    )
    p.add_argument(
        "--workspace-mib", type=int, default=4096, help="builder workspace limit in MiB (default: 4096)"
    )
    p.add_argument(
        "--optimization-level",
        type=int,
        choices=range(6),
        metavar="0..5",
        help="TensorRT builder optimization level (TensorRT's default: 3)",
    )
    p.add_argument(
        "--tf32", action="store_true", help="allow TF32 math in float32 layers (off: parity with eager)"
    )
    p.add_argument("--no-keep-onnx", action="store_true", help="do not write the converted fp16/bf16 graphs")
    p.add_argument(
        "--check-only",
        action="store_true",
        help="only run the TensorRT readiness check over the graphs (no TensorRT needed)",
    )
    p.add_argument("--json", action="store_true", help="with --check-only: print the report as JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging (TensorRT's own log included)")
    add_debug_flag(p)
    return p


def _options_from_args(args) -> BuildOptions:
    ranges: dict[str, AxisRange] = {}
    for name, value in args.axis:
        ranges[name] = value
    for name, value in ((BATCH, args.batch), (SRC_LEN, args.src_len), (CACHE_LEN, args.cache_len)):
        if value is not None:
            ranges[name] = value
    return BuildOptions(
        precision=args.precision,
        typing=args.typing,
        axis_ranges=ranges,
        output_dir=args.output_dir,
        timing_cache=args.timing_cache,
        workspace_mib=args.workspace_mib,
        tf32=args.tf32,
        optimization_level=args.optimization_level,
        keep_onnx=not args.no_keep_onnx,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line: exit code 0, 1 for an error (one line on stderr, after the readiness report
    when the graphs are not ready; ``--debug`` shows the traceback), 2 for a bad option, 130 / 143
    when interrupted by SIGINT / SIGTERM."""
    parser = build_parser()
    args = parser.parse_args(argv)
    take_positional_spelling(
        parser, args, "export_dir", "--model", metavar="EXPORT_DIR", default="onnx_export"
    )
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    expected = (TensorRTReadinessError, TensorRTNotAvailableError, TensorRTParseError, TensorRTBuildError)
    return run_cli(parser.prog, lambda: _run(args), debug=args.debug, expected=expected)


def _run(args) -> int:
    options = _options_from_args(args)
    options.validate()
    try:
        if args.check_only:
            plan, _ = plan_build(args.model, options)
            report = plan.readiness
            print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
            print(
                f"engines would be: {', '.join(e.engine_file for e in plan.engines)} "
                f"({plan.precision}, cache dtype {plan.cache_dtype})"
            )
            return 0
        result = build_engines(args.model, options)
    except TensorRTReadinessError as exc:
        print(exc.report.format(), file=sys.stderr)
        raise
    plan = result.plan
    print(
        f"TensorRT {result.tensorrt_version}: built {plan.precision} engines ({plan.typing} typing, "
        f"cache dtype {plan.cache_dtype}, flavour {plan.flavour})"
    )
    for graph, path in result.engine_paths.items():
        print(f"  {graph:13s} {path} ({os.path.getsize(path) / 2**20:.1f} MiB)")
    print(f"  manifest      {result.manifest_path}\n  timing cache  {result.timing_cache_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
