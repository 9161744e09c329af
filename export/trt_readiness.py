"""Can TensorRT build these graphs? A static check that needs no TensorRT and no GPU.

The check reads the exported ONNX graphs (``encoder.onnx``, ``decoder_step.onnx``) and checks
what our exporter emits, not every graph TensorRT could parse:

* the rules of the export contract (:mod:`export.contract`, the code :func:`export.validate.check_graphs`
  runs after every export): inputs and outputs as the manifest states them, no control flow,
  no custom domain (it would need a plugin), no zero-length dimension, the ``TensorScatter``
  rule (a 4-D cache that is a graph input read by no other node, ``linear`` mode, the literal
  ``axis=-2``, written into a graph output) and the cache-read rules of both flavours;
* every node is one of the op types ``python -m export.onnx`` emits (:data:`EMITTED_OPS`, the
  graphs TensorRT is built from in this project's tests), with the restrictions of TensorRT
  10.15's ONNX parser that apply to them (matrix products and normalizations on floating-point
  tensors, ``Squeeze``/``Unsqueeze`` axes resolvable to constants, ``LayerNormalization`` with
  its ``Y`` output only); the default-domain opset is one the parser reads (9 to 24);
* int8-quantized graphs (``python -m export.onnx --quantize``: ``MatMulInteger``,
  ``DynamicQuantizeLinear``, a manifest with a ``quantization`` section) are refused: they are
  for ONNX Runtime;
* dtypes: graph inputs and outputs of a type an engine binds, no float64 tensor anywhere
  (TensorRT clamps it to float32);
* the optimization profile: every dynamic axis of every input named and bounded
  (``1 <= min <= opt <= max``), sources no longer than the model's ``max_len``; in the
  ``tensorscatter`` flavour a static cache length (TensorRT's KV-cache update layer needs one).

:func:`check_export_dir` checks an export folder and returns a :class:`ReadinessReport`; unless
told otherwise it raises :class:`TensorRTReadinessError`, whose message lists every problem.
``python -m export.tensorrt --check-only`` runs it from the command line.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import onnx

from transformer_ext.export_format import (
    BATCH,
    CACHE_LEN,
    CUSTOM_OP_FLAVOUR,
    CUSTOM_OP_REFUSAL,
    DECODER_FILE,
    ENCODER_FILE,
    MANIFEST_NAME,
    SOURCES,
    SRC_LEN,
    manifest_max_cache_len,
    manifest_max_positions,
)
from transformer_ext.export_format import read_manifest as _read_manifest

from . import ExportError, ManifestError
from .contract import GraphIndex, contract_problems, onnx_dtype_name, tensor_dims

logger = logging.getLogger(__name__)

__all__ = [
    "TRT_TARGET_VERSION",
    "MIN_OPSET",
    "MAX_OPSET",
    "EMITTED_OPS",
    "AxisRange",
    "Problem",
    "GraphReadiness",
    "ReadinessReport",
    "TensorRTReadinessError",
    "default_axis_ranges",
    "parse_axis_range",
    "profile_shapes",
    "input_specs",
    "output_specs",
    "check_model",
    "check_export_dir",
    "manifest_max_positions",
    "manifest_max_cache_len",
    "decoder_flavour",
]

TRT_TARGET_VERSION = "10.15"
MIN_OPSET = 9  # "TensorRT 10.15 supports operators in the inclusive range of opset 9 to opset 24"
MAX_OPSET = 24
MANIFEST_FILE = MANIFEST_NAME

# ------------------------------------------------------------------------------------------
# What the exporter emits, and what TensorRT 10.15 requires of it
# ------------------------------------------------------------------------------------------

# Every op type in the graphs of ``python -m export.onnx`` (both flavours, every model variant,
# with and without the MatMul fusion), the ops of the custom-op lowerings (export.lowering) and
# the Cast nodes of the fp16/bf16 conversion (export.tensorrt.convert_precision). All of them are
# in TensorRT 10.15's ONNX operator support list. A new op in the exporter's output must be added
# here once an engine has been built from it (the T5 family's RMSNorm, tanh GELU and bias-table
# ops are in that list but no engine of a T5 graph has been built yet: no GPU in CI).
EMITTED_OPS: frozenset[str] = frozenset(
    {
        "Add",
        "And",
        "Cast",
        "CastLike",
        "Concat",
        "Constant",
        "Div",  # RMSNorm's x / sqrt(mean square + eps) (norm="rms", T5)
        "Erf",  # the gelu activation (activation="gelu")
        "Gather",
        "GatherND",
        "Gemm",
        "LayerNormalization",
        "Less",
        "LessOrEqual",
        "MatMul",
        "Mul",
        "Pow",  # RMSNorm's mean square (norm="rms", T5)
        "Range",
        "Reciprocal",
        "ReduceMean",  # RMSNorm's mean square
        "ReduceSum",  # the new token's attention score (export.lowering.decode_attention)
        "Relu",
        "Reshape",
        "Shape",
        "Sigmoid",  # the swish activation (activation="swish"), Sigmoid * Mul
        "Slice",
        "Softmax",
        "Split",
        "Sqrt",  # RMSNorm's sqrt(mean square + eps)
        "Squeeze",
        "Sub",
        "Tanh",  # the tanh approximation of gelu (activation="gelu_tanh", T5 v1.1)
        "TensorScatter",
        "Transpose",
        "Unsqueeze",
        "Where",
    }
)
# Emitted ops that TensorRT runs on floating-point tensors only (the support list: FP32 FP16 BF16).
FLOAT_ONLY_OPS = frozenset({"MatMul", "Gemm", "Softmax", "LayerNormalization"})
FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16"})
# What a TensorRT engine binds as input or output (uint8 is I/O-only in TensorRT).
IO_DTYPES = frozenset({"float32", "float16", "bfloat16", "int32", "int64", "bool", "uint8"})
# What any tensor may hold (int8 / float8 / int4 for quantized weights); float64 is not among them.
TENSOR_DTYPES = IO_DTYPES | {"int8", "float8_e4m3fn", "int4"}


def _ranges_text(names: Iterable[str]) -> str:
    return " ".join(sorted(names))


# ------------------------------------------------------------------------------------------
# Profiles
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AxisRange:
    """The optimization-profile range of one named dynamic axis: ``1 <= min <= opt <= max``."""

    min: int
    opt: int
    max: int

    def problems(self, axis: str) -> list[str]:
        out = []
        for name in ("min", "opt", "max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                out.append(f"axis {axis!r}: {name} must be an int, got {v!r}")
        if out:
            return out
        if self.min < 1:
            out.append(
                f"axis {axis!r}: min = {self.min} < 1 (TensorRT must never see a zero-length dimension)"
            )
        if not self.min <= self.opt <= self.max:
            out.append(f"axis {axis!r}: need min <= opt <= max, got {self.min}:{self.opt}:{self.max}")
        return out

    @property
    def static(self) -> bool:
        return self.min == self.opt == self.max

    def __str__(self) -> str:
        return f"{self.min}:{self.opt}:{self.max}"


def parse_axis_range(text: str) -> AxisRange:
    """``"MIN:OPT:MAX"`` or ``"N"`` (= ``1:N:N``, tuned for the largest size) -> :class:`AxisRange`."""
    parts = str(text).strip().split(":")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"expected MIN:OPT:MAX or N (integers), got {text!r}") from None
    if len(values) == 1:
        r = AxisRange(1, values[0], values[0])
    elif len(values) == 3:
        r = AxisRange(*values)
    else:
        raise ValueError(f"expected MIN:OPT:MAX or N, got {text!r}")
    problems = r.problems("value")
    if problems:
        raise ValueError(f"invalid range {text!r}: " + "; ".join(problems))
    return r


def default_axis_ranges(
    max_positions: Optional[int] = None,
    max_cache_len: Optional[int] = None,
    *,
    static_cache_len: Optional[int] = None,
) -> dict[str, AxisRange]:
    """The default profile: batch 1..64 (16 typical: 16 sources, or 4 sources x 4 beams), the
    decoder step's cross-attention rows (``sources``) as ``batch``, source lengths up to ``max_positions`` (the model's ``max_len``), caches up to ``max_cache_len``
    (the export's largest cache capacity, itself at most ``max_len``).

    ``static_cache_len``: pin ``cache_len`` (the ``tensorscatter`` flavour needs a static one).
    """
    mp = int(max_positions) if max_positions else 256
    mc = min(int(max_cache_len), mp) if max_cache_len else mp
    ranges = {
        BATCH: AxisRange(1, 16, 64),
        # The decoder step's cross-attention rows: one per source, or one per row (K = 1), so
        # the range of ``batch``.
        SOURCES: AxisRange(1, 16, 64),
        SRC_LEN: AxisRange(1, min(32, mp), mp),
        CACHE_LEN: AxisRange(1, min(64, mc), mc),
    }
    if static_cache_len is not None:
        n = int(static_cache_len)
        ranges[CACHE_LEN] = AxisRange(n, n, n)
    return ranges


@dataclass(frozen=True)
class TensorSpec:
    """A graph input or output: name, ONNX element type and dims (int, axis name or None)."""

    name: str
    elem_type: int
    dims: Optional[tuple[Union[int, str, None], ...]]  # None: rank unknown

    @property
    def dtype(self) -> str:
        return onnx_dtype_name(self.elem_type)


def _dims_of(type_proto: onnx.TypeProto) -> Optional[tuple[Union[int, str, None], ...]]:
    dims = tensor_dims(type_proto)
    return None if dims is None else tuple(dims)


def input_specs(model: onnx.ModelProto) -> list[TensorSpec]:
    """The graph inputs that are not initializers (what a runtime binds)."""
    inits = {i.name for i in model.graph.initializer}
    out = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        out.append(TensorSpec(vi.name, vi.type.tensor_type.elem_type, _dims_of(vi.type)))
    return out


def output_specs(model: onnx.ModelProto) -> list[TensorSpec]:
    """The graph outputs."""
    return [
        TensorSpec(vi.name, vi.type.tensor_type.elem_type, _dims_of(vi.type)) for vi in model.graph.output
    ]


def profile_shapes(
    inputs: Sequence[TensorSpec], axis_ranges: Mapping[str, AxisRange]
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """min/opt/max shape of every input: static dims as they are, named axes from ``axis_ranges``.

    Raises ``ValueError`` naming the input and axis for an unnamed dynamic dimension or an axis
    the profile does not bound (the readiness check reports the same as problems).
    """
    shapes = {}
    for spec in inputs:
        if spec.dims is None:
            raise ValueError(f"input {spec.name!r} has no shape (unknown rank); TensorRT needs the rank")
        lo, mid, hi = [], [], []
        for i, d in enumerate(spec.dims):
            if isinstance(d, int):
                lo.append(d), mid.append(d), hi.append(d)
            elif isinstance(d, str) and d in axis_ranges:
                r = axis_ranges[d]
                lo.append(r.min), mid.append(r.opt), hi.append(r.max)
            elif isinstance(d, str):
                raise ValueError(
                    f"input {spec.name!r} axis {i} is the dynamic axis {d!r}, which the profile does not "
                    f"bound (profile axes: {sorted(axis_ranges)}); pass --axis {d}=MIN:OPT:MAX"
                )
            else:
                raise ValueError(
                    f"input {spec.name!r} axis {i} is dynamic without a name; the exporter must name "
                    "every dynamic axis (docs/DESIGN.md section 3) so that a profile can bound it"
                )
        shapes[spec.name] = (tuple(lo), tuple(mid), tuple(hi))
    return shapes


# ------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One reason TensorRT would reject (or mis-build) a graph."""

    graph: str
    kind: str  # opset | unsupported_op | custom_domain | control_flow | op_restriction | dtype | zero_dim |
    #            unbounded_axis | profile | cache_aliasing | cache_read | manifest | load
    message: str
    node: Optional[str] = None

    def __str__(self) -> str:
        where = f" [node {self.node}]" if self.node else ""
        return f"{self.graph}: {self.kind}{where}: {self.message}"


@dataclass
class GraphReadiness:
    """The check of one graph."""

    name: str
    path: Optional[str]
    opset: Optional[int]
    ir_version: Optional[int]
    op_counts: dict[str, int] = field(default_factory=dict)
    inputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class ReadinessReport:
    """The check of an export folder: one :class:`GraphReadiness` per graph."""

    target: str
    axis_ranges: dict[str, AxisRange]
    graphs: list[GraphReadiness]
    flavour: Optional[str] = None
    extra_problems: list[Problem] = field(default_factory=list)

    @property
    def problems(self) -> list[Problem]:
        return list(self.extra_problems) + [p for g in self.graphs for p in g.problems]

    @property
    def warnings(self) -> list[Problem]:
        return [w for g in self.graphs for w in g.warnings]

    @property
    def ok(self) -> bool:
        return not self.problems

    def graph(self, name: str) -> GraphReadiness:
        for g in self.graphs:
            if g.name == name:
                return g
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": f"TensorRT {self.target}",
            "ok": self.ok,
            "flavour": self.flavour,
            "axis_ranges": {k: asdict(v) for k, v in self.axis_ranges.items()},
            "graphs": [
                {
                    "name": g.name,
                    "path": g.path,
                    "opset": g.opset,
                    "ir_version": g.ir_version,
                    "op_counts": dict(g.op_counts),
                    "inputs": g.inputs,
                    "outputs": g.outputs,
                    "problems": [str(p) for p in g.problems],
                    "warnings": [str(w) for w in g.warnings],
                }
                for g in self.graphs
            ],
            "problems": [str(p) for p in self.problems],
        }

    def format(self) -> str:
        """A human-readable summary: one line per graph, then every problem and warning."""
        lines = [
            f"TensorRT {self.target} readiness ({'OK' if self.ok else 'NOT READY'}), "
            f"flavour {self.flavour or '?'}, profile "
            + ", ".join(f"{k}={v}" for k, v in sorted(self.axis_ranges.items()))
        ]
        for g in self.graphs:
            n_nodes = sum(g.op_counts.values())
            lines.append(
                f"  {g.name}: opset {g.opset}, IR {g.ir_version}, {n_nodes} nodes, "
                f"{len(g.op_counts)} op types, {len(g.problems)} problem(s), {len(g.warnings)} warning(s)"
            )
        for p in self.problems:
            lines.append(f"  PROBLEM {p}")
        for w in self.warnings:
            lines.append(f"  warning {w}")
        return "\n".join(lines)


class TensorRTReadinessError(ExportError, RuntimeError):
    """The exported graphs would not build (or not build correctly) with TensorRT.

    Attributes:
        report: the :class:`ReadinessReport`; ``report.problems`` lists every problem.
    """

    def __init__(self, report: ReadinessReport):
        self.report = report
        problems = report.problems
        body = "\n".join(f"  {i + 1}. {p}" for i, p in enumerate(problems))
        super().__init__(
            f"the exported graphs are not ready for TensorRT {report.target}: {len(problems)} problem(s)\n{body}"
        )

    def __reduce__(self):
        return (type(self), (self.report,))


# Op types of quantized graphs (export.quantize writes MatMulInteger + DynamicQuantizeLinear).
INT8_OP_TYPES = frozenset(
    {
        "MatMulInteger",
        "DynamicQuantizeLinear",
        "QLinearMatMul",
        "ConvInteger",
        "MatMulIntegerToFloat",
        "DynamicQuantizeMatMul",
    }
)
INT8_REFUSAL = (
    "{folder} is an int8-quantized export (its manifest has a quantization section): int8 exports are "
    "for ONNX Runtime (OrtRunner, the translator, Triton's onnxruntime backend); build TensorRT engines "
    "from a float32 export (python -m export.onnx without --quantize)"
)


ORT_FLAVOUR_REFUSAL = (
    "{folder} is an export of the ort flavour: its decoder step uses ONNX Runtime's contrib operator "
    "com.microsoft.GroupQueryAttention, which TensorRT does not parse; build TensorRT engines from a "
    "portable or tensorscatter export (python -m export.onnx --flavour portable)"
)


def decoder_flavour(decoder: Union[onnx.ModelProto, Iterable[str]]) -> str:
    """``"tensorscatter"`` when the decoder step returns ``present_key.*`` caches, else ``"portable"``."""
    names = [o.name for o in decoder.graph.output] if isinstance(decoder, onnx.ModelProto) else list(decoder)
    return "tensorscatter" if any(n.startswith("present_key.") for n in names) else "portable"


# ------------------------------------------------------------------------------------------
# Per-op restrictions of the emitted ops that can be checked statically
# ------------------------------------------------------------------------------------------


def _input(node: onnx.NodeProto, i: int) -> str:
    return node.input[i] if len(node.input) > i else ""


def _needs_constant(node: onnx.NodeProto, g: GraphIndex, index: int, what: str) -> list[tuple[str, str]]:
    name = _input(node, index)
    if not name or g.is_constant(name):
        return []
    if g.is_constant_foldable(name):
        return [
            ("warning", f"`{what}` ({name!r}) is computed from shapes/constants; the parser must fold it")
        ]
    return [("problem", f"`{what}` must be resolvable to a constant, but {name!r} depends on runtime data")]


def _restrictions(node: onnx.NodeProto, g: GraphIndex) -> list[tuple[str, str]]:
    """``(severity, message)`` for each restriction of TensorRT 10.15's parser this node breaks."""
    if node.op_type in ("Squeeze", "Unsqueeze"):
        return _needs_constant(node, g, 1, "axes")
    if node.op_type == "LayerNormalization" and any(o for o in node.output[1:]):
        return [("problem", "only the first output `Y` is supported (Mean / InvStdDev outputs are not)")]
    return []


# ------------------------------------------------------------------------------------------
# The check of one graph
# ------------------------------------------------------------------------------------------


def _load(model_or_path: Union[onnx.ModelProto, str, os.PathLike]) -> tuple[onnx.ModelProto, Optional[str]]:
    if isinstance(model_or_path, onnx.ModelProto):
        return model_or_path, None
    path = os.fspath(model_or_path)
    # Weights are not needed: shapes and types of initializers live in the proto itself.
    return onnx.load(path, load_external_data=False), path


def _default_opset(model: onnx.ModelProto) -> Optional[int]:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    return None


class _Collector:
    """Appends the problems and warnings of one graph to its :class:`GraphReadiness`."""

    def __init__(self, report: GraphReadiness):
        self.report = report

    def problem(self, kind: str, message: str, node: Optional[str] = None) -> None:
        self.report.problems.append(Problem(self.report.name, kind, message, node))

    def warning(self, kind: str, message: str, node: Optional[str] = None) -> None:
        self.report.warnings.append(Problem(self.report.name, kind, message, node))


def _check_opsets(model: onnx.ModelProto, out: _Collector) -> None:
    """The default-domain opset is in TensorRT's range; other domains are warned about."""
    opset = out.report.opset
    if opset is None:
        out.problem("opset", "the model imports no default-domain ('ai.onnx') opset")
    elif not MIN_OPSET <= opset <= MAX_OPSET:
        out.problem(
            "opset",
            f"opset {opset} is outside the range TensorRT {TRT_TARGET_VERSION} parses "
            f"({MIN_OPSET}..{MAX_OPSET}); re-export with --opset {min(max(opset, MIN_OPSET), MAX_OPSET)}",
        )
    for imp in model.opset_import:
        if imp.domain not in ("", "ai.onnx"):
            out.warning("custom_domain", f"imports opset domain {imp.domain!r} v{imp.version}")


def _infer_shapes(model: onnx.ModelProto, out: _Collector) -> onnx.ModelProto:
    """The model with inferred types and shapes of intermediate tensors (the model itself, with a
    warning, when inference fails)."""
    try:
        return onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    except Exception as exc:  # noqa: BLE001
        out.warning("dtype", f"ONNX shape inference failed ({exc}); intermediate types are not checked")
        return model


def _check_node(node: onnx.NodeProto, label: str, g: GraphIndex, out: _Collector) -> None:
    """The restrictions of one emitted default-domain node: attributes, dtypes, empty constants."""
    for severity, message in _restrictions(node, g):
        (out.problem if severity == "problem" else out.warning)(
            "op_restriction", f"{node.op_type}: {message}", label
        )
    if node.op_type in FLOAT_ONLY_OPS and node.input and node.input[0] in g.types:
        dtype = onnx_dtype_name(g.types[node.input[0]])
        if dtype not in FLOAT_DTYPES:
            out.problem(
                "dtype",
                f"{node.op_type} on {dtype} tensor {node.input[0]!r}: TensorRT {TRT_TARGET_VERSION} "
                f"runs it on {_ranges_text(FLOAT_DTYPES)} only",
                label,
            )
    if node.op_type == "Constant":
        for a in node.attribute:
            if a.name == "value" and any(int(d) == 0 for d in a.t.dims):
                out.problem(
                    "zero_dim",
                    f"constant {node.output[0]!r} has a zero-length dimension {list(a.t.dims)}",
                    label,
                )


def _check_nodes(model: onnx.ModelProto, g: GraphIndex, out: _Collector) -> None:
    """Counts the op types (into ``report.op_counts``) and checks every node: emitted ops only, their
    restrictions, no int8 quantization (reported once per graph)."""
    report = out.report
    counts: Counter[str] = Counter()
    int8_nodes: Counter[str] = Counter()
    for idx, node in enumerate(model.graph.node):
        label = node.name or f"#{idx} {node.op_type}"
        default_domain = node.domain in ("", "ai.onnx")
        counts[node.op_type if default_domain else f"{node.domain}::{node.op_type}"] += 1
        if not default_domain or any(p.node == label for p in report.problems if p.kind == "control_flow"):
            continue  # reported by the contract check
        if node.op_type in INT8_OP_TYPES:
            int8_nodes[node.op_type] += 1  # reported once per graph below
            continue
        if node.op_type not in EMITTED_OPS:
            out.problem(
                "unsupported_op",
                f"{node.op_type} is not an op python -m export.onnx emits; TensorRT "
                f"{TRT_TARGET_VERSION} engines are built from {_ranges_text(EMITTED_OPS)} only",
                label,
            )
            continue
        _check_node(node, label, g, out)
    report.op_counts = dict(sorted(counts.items()))
    if int8_nodes:
        out.problem(
            "int8",
            "an int8-quantized graph ("
            + ", ".join(f"{n} {op}" for op, n in sorted(int8_nodes.items()))
            + "; python -m export.onnx --quantize): int8 exports are for ONNX Runtime, build TensorRT engines "
            "from a float32 export",
        )


def _check_io(model: onnx.ModelProto, out: _Collector) -> None:
    """Records the inputs and outputs (into the report) and checks their dtypes."""
    report = out.report
    for kind, specs in (("input", input_specs(model)), ("output", output_specs(model))):
        for s in specs:
            (report.inputs if kind == "input" else report.outputs)[s.name] = {
                "dtype": s.dtype,
                "shape": list(s.dims) if s.dims is not None else None,
            }
            if s.dtype not in IO_DTYPES:
                out.problem(
                    "dtype",
                    f"{kind} {s.name!r} is {s.dtype}; TensorRT engines bind {_ranges_text(IO_DTYPES)}"
                    + (" (float64 is clamped to float32)" if s.dtype == "float64" else ""),
                )


def _check_tensors(model: onnx.ModelProto, inferred: onnx.ModelProto, g: GraphIndex, out: _Collector) -> None:
    """Dtypes and zero-length dimensions of the initializers and the inferred intermediate tensors."""
    for t in g.initializers.values():
        dtype = onnx_dtype_name(t.data_type)
        if dtype not in TENSOR_DTYPES:
            out.problem(
                "dtype",
                f"initializer {t.name!r} is {dtype}"
                + (
                    " (TensorRT casts float64 down to float32, clamping to +-FLT_MAX)"
                    if dtype == "float64"
                    else f"; TensorRT supports {_ranges_text(TENSOR_DTYPES)}"
                ),
            )
        if any(int(d) == 0 for d in t.dims):
            out.problem("zero_dim", f"initializer {t.name!r} has a zero-length dimension {list(t.dims)}")
    io_names = {vi.name for vi in list(model.graph.input) + list(model.graph.output)}
    for vi in inferred.graph.value_info:
        if vi.name in io_names or vi.name in g.initializers:
            continue
        dims = g.shapes.get(vi.name)
        if dims and any(d == 0 for d in dims):
            out.problem(
                "zero_dim",
                f"tensor {vi.name!r} has a zero-length dimension {list(dims)} (TensorRT and the "
                "contract forbid empty tensors: no zero-length past, no empty first step)",
            )
        dtype = onnx_dtype_name(vi.type.tensor_type.elem_type)
        if vi.type.tensor_type.elem_type and dtype not in TENSOR_DTYPES:
            out.problem(
                "dtype", f"tensor {vi.name!r} is {dtype}; TensorRT supports {_ranges_text(TENSOR_DTYPES)}"
            )


def _check_input_axes(specs: list, ranges: Optional[dict[str, AxisRange]], out: _Collector) -> None:
    """Every input has a rank, and every dynamic axis is named and (with a profile) bounded."""
    for spec_ in specs:
        if spec_.dims is None:
            out.problem(
                "unbounded_axis", f"input {spec_.name!r} has no shape (rank unknown): TensorRT needs the rank"
            )
            continue
        for i, d in enumerate(spec_.dims):
            if isinstance(d, int):
                continue
            if d is None:
                out.problem(
                    "unbounded_axis",
                    f"input {spec_.name!r} axis {i} is dynamic without a name: no profile can "
                    "bound it (the exporter must name every dynamic axis)",
                )
                continue
            if ranges is not None and d not in ranges:
                out.problem(
                    "unbounded_axis",
                    f"input {spec_.name!r} axis {i} ({d!r}) is not bounded by the optimization "
                    f"profile (profile axes: {sorted(ranges)}); pass --axis {d}=MIN:OPT:MAX",
                )


def _check_profile(
    model: onnx.ModelProto,
    g: GraphIndex,
    axis_ranges: Optional[Mapping[str, AxisRange]],
    max_positions: Optional[int],
    out: _Collector,
) -> None:
    """The optimization profile: valid ranges, every dynamic axis bounded, a static cache length for
    TensorScatter caches, and ranges within the model's positional-encoding rows."""
    ranges = dict(axis_ranges) if axis_ranges is not None else None
    if ranges is not None:
        for axis, r in ranges.items():
            for msg in r.problems(axis):
                out.problem("profile", msg)
    specs = input_specs(model)
    static_cache_axes: dict[str, set[str]] = {}
    for node in model.graph.node:
        if node.op_type == "TensorScatter" and _input(node, 0) in g.graph_inputs:
            dims = next((s.dims for s in specs if s.name == _input(node, 0)), None)
            if dims and len(dims) >= 2:
                static_cache_axes.setdefault(str(dims[-2]), set()).add(_input(node, 0))
    _check_input_axes(specs, ranges, out)
    for axis, names in static_cache_axes.items():
        if axis.lstrip("-").isdigit():
            continue
        if ranges is not None and axis in ranges and not ranges[axis].static:
            out.problem(
                "cache_aliasing",
                f"TensorScatter caches {sorted(names)}: TensorRT's KV-cache update layer needs a "
                f"static cache length, but axis {axis!r} ranges {ranges[axis]}; pass "
                f"--cache-len N (the builder then fixes {axis} = N)",
            )
    if ranges is None or max_positions is None:
        return
    if SRC_LEN in ranges and ranges[SRC_LEN].max > max_positions:
        out.problem(
            "profile",
            f"src_len max {ranges[SRC_LEN].max} > the model's max_len {max_positions} "
            "(positional-encoding rows; docs/DESIGN.md section 3)",
        )
    if CACHE_LEN in ranges and ranges[CACHE_LEN].max > max_positions:
        out.warning(
            "profile",
            f"cache_len max {ranges[CACHE_LEN].max} > max_len {max_positions}: positions beyond "
            "max_len are never written, the extra capacity is wasted",
        )


def check_model(
    model_or_path: Union[onnx.ModelProto, str, os.PathLike],
    name: Optional[str] = None,
    axis_ranges: Optional[Mapping[str, AxisRange]] = None,
    *,
    max_positions: Optional[int] = None,
    spec: Optional[Mapping[str, Any]] = None,
) -> GraphReadiness:
    """Check one ONNX graph (see the module docstring); never raises for a graph problem (they
    are collected in the returned :class:`GraphReadiness`). ``spec``: the graph's inputs and
    outputs as the manifest states them (compared when given)."""
    try:
        model, path = _load(model_or_path)
    except Exception as exc:  # noqa: BLE001 - a corrupt file is a reportable problem
        gname = name or os.path.basename(os.fspath(model_or_path))
        r = GraphReadiness(gname, os.fspath(model_or_path), None, None)
        r.problems.append(Problem(gname, "load", f"cannot load the ONNX file: {exc}"))
        return r
    gname = name or (os.path.basename(path) if path else model.graph.name or "graph")
    report = GraphReadiness(gname, path, _default_opset(model), int(model.ir_version))
    out = _Collector(report)
    _check_opsets(model, out)
    inferred = _infer_shapes(model, out)
    g = GraphIndex(model, inferred)
    # The export contract (shared with export.validate) comes before the node checks, which skip
    # the nodes it reported.
    for p in contract_problems(model, spec, index=g):
        out.problem("manifest" if p.kind == "io" else p.kind, p.message, p.node)
    _check_nodes(model, g, out)
    _check_io(model, out)
    _check_tensors(model, inferred, g, out)
    _check_profile(model, g, axis_ranges, max_positions, out)
    return report


# ------------------------------------------------------------------------------------------
# Export folders
# ------------------------------------------------------------------------------------------


def check_export_dir(
    export_dir: Union[str, os.PathLike],
    axis_ranges: Optional[Mapping[str, AxisRange]] = None,
    *,
    raise_on_error: bool = True,
    graphs: Mapping[str, Union[str, os.PathLike, onnx.ModelProto]] | None = None,
    compare_manifest: bool = True,
) -> ReadinessReport:
    """Check ``encoder.onnx`` and ``decoder_step.onnx`` of an export folder.

    Args:
        export_dir: the folder written by ``python -m export.onnx``.
        axis_ranges: the optimization profile per named axis; missing axes take the defaults of
            :func:`default_axis_ranges` (``max_len`` from the manifest; for the ``tensorscatter``
            flavour ``cache_len`` must be pinned, see there).
        raise_on_error: raise :class:`TensorRTReadinessError` when any problem is found.
        graphs: override the graphs checked (``{"encoder": path_or_model, "decoder_step": ...}``),
            e.g. precision-converted copies.
        compare_manifest: check that the names, dtypes and axes the manifest states are the
            graphs' (off for converted copies, whose dtypes and pinned axes differ on purpose).

    Returns:
        the :class:`ReadinessReport` (also attached to the error).
    """
    export_dir = Path(export_dir)
    extra: list[Problem] = []
    if not export_dir.is_dir():
        raise FileNotFoundError(
            f"export folder not found: {export_dir} (write one with `python -m export.onnx`)"
        )
    try:
        manifest = _read_manifest(export_dir)
    except ManifestError as exc:
        manifest = {}
        extra.append(Problem(MANIFEST_NAME, "manifest", str(exc)))
    if manifest.get("quantization"):
        extra.append(Problem(MANIFEST_NAME, "int8", INT8_REFUSAL.format(folder=export_dir)))
    if manifest.get("flavour") == "ort":
        extra.append(Problem(MANIFEST_NAME, "flavour", ORT_FLAVOUR_REFUSAL.format(folder=export_dir)))
    if manifest.get("flavour") == CUSTOM_OP_FLAVOUR:
        extra.append(
            Problem(MANIFEST_NAME, "flavour", CUSTOM_OP_REFUSAL.format(folder=export_dir, what="TensorRT"))
        )
    max_positions = manifest_max_positions(manifest)
    max_cache_len = manifest_max_cache_len(manifest)
    sources = {"encoder": export_dir / ENCODER_FILE, "decoder_step": export_dir / DECODER_FILE}
    if graphs:
        sources.update(graphs)
    reports = []
    flavour = None
    loaded: dict[str, onnx.ModelProto] = {}
    for key, src in sources.items():
        if not isinstance(src, onnx.ModelProto) and not Path(src).exists():
            extra.append(Problem(f"{key}.onnx", "load", f"{src} is missing"))
            continue
        try:
            loaded[key] = (
                src
                if isinstance(src, onnx.ModelProto)
                else onnx.load(os.fspath(src), load_external_data=False)
            )
        except Exception as exc:  # noqa: BLE001
            extra.append(Problem(f"{key}.onnx", "load", f"cannot load {src}: {exc}"))
    if "decoder_step" in loaded:
        flavour = decoder_flavour(loaded["decoder_step"])
    ranges = default_axis_ranges(max_positions, max_cache_len)
    if flavour == "tensorscatter" and not (axis_ranges and CACHE_LEN in axis_ranges):
        # TensorRT's KV-cache update layer needs a static cache length: default to the longest.
        ranges = default_axis_ranges(max_positions, max_cache_len, static_cache_len=ranges[CACHE_LEN].max)
        logger.warning(
            "tensorscatter flavour: cache_len pinned to %d (max_cache_len); choose the capacity your "
            "requests need with --cache-len N, every step reads the whole cache",
            ranges[CACHE_LEN].max,
        )
    if axis_ranges:
        ranges.update(axis_ranges)
        if BATCH in axis_ranges and SOURCES not in axis_ranges:
            ranges[SOURCES] = ranges[BATCH]  # runners may feed one cross-attention row per row
    for key, model in loaded.items():
        gname = f"{key}.onnx"
        spec = (manifest.get("graphs") or {}).get(key) if compare_manifest else None
        r = check_model(model, gname, ranges, max_positions=max_positions, spec=spec)
        r.path = os.fspath(sources[key]) if not isinstance(sources[key], onnx.ModelProto) else None
        reports.append(r)
    report = ReadinessReport(TRT_TARGET_VERSION, ranges, reports, flavour, extra)
    for w in report.warnings:
        logger.warning("TensorRT readiness: %s", w)
    if not report.ok:
        for p in report.problems:
            logger.error("TensorRT readiness: %s", p)
        if raise_on_error:
            raise TensorRTReadinessError(report)
    else:
        logger.info("TensorRT readiness: %s is ready for TensorRT %s", export_dir, TRT_TARGET_VERSION)
    return report
