"""Can TensorRT build these graphs? A static check that needs no TensorRT and no GPU.

The check reads the exported ONNX graphs (``encoder.onnx``, ``decoder_step.onnx``) and compares
them with what the ONNX parser of the targeted TensorRT version documents (onnx-tensorrt
``docs/operators.md`` of TensorRT 10.15, which parses opsets 9 to 24), plus the rules of our own
export contract (DESIGN.md section 3) that TensorRT depends on:

* every node is a default-domain ONNX op listed as supported (no custom domain: it would need a
  plugin), with the documented restrictions that can be checked without building (for example
  ``TensorScatter``: 4-D, literal ``axis=-2``; reductions: ``axes`` an initializer; ``TopK``:
  ``sorted=1``; ``LayerNormalization``: only output ``Y``);
* the node's data type is in the op's supported-type list, and no graph input, output or
  initializer is float64 (TensorRT clamps it to float32) or another type TensorRT cannot bind;
* no control flow (``If``, ``Loop``, ``Scan``, or any graph-valued attribute): one decoder
  graph for every step;
* no zero-length dimension in any input, output, initializer, constant or inferred tensor;
* every dynamic axis of every input is named and bounded by the optimization profile
  (``1 <= min <= opt <= max``), sources no longer than the model's ``max_len``;
* ``tensorscatter`` flavour: the cache read by ``TensorScatter`` is a graph input read by no other
  node, its output is a graph output, and the cache length is static or pinned by the profile
  (TensorRT's KV-cache update layer needs a static sequence length and writes in place).

:func:`check_export_dir` checks an export folder and returns a :class:`ReadinessReport`; unless
told otherwise it raises :class:`TensorRTReadinessError`, whose message lists every problem.
``python -m export.tensorrt --check-only`` runs it from the command line.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import onnx
from onnx import TensorProto

logger = logging.getLogger(__name__)

__all__ = [
    "TRT_TARGET_VERSION",
    "MIN_OPSET",
    "MAX_OPSET",
    "SUPPORTED_OPS",
    "UNSUPPORTED_OPS",
    "AxisRange",
    "Problem",
    "GraphReadiness",
    "ReadinessReport",
    "TensorRTReadinessError",
    "default_axis_ranges",
    "parse_axis_range",
    "profile_shapes",
    "input_specs",
    "check_model",
    "check_export_dir",
    "read_manifest",
    "manifest_max_positions",
    "manifest_max_cache_len",
    "decoder_flavour",
]

TRT_TARGET_VERSION = "10.15"
MIN_OPSET = 9  # "TensorRT 10.15 supports operators in the inclusive range of opset 9 to opset 24"
MAX_OPSET = 24

ENCODER_FILE = "encoder.onnx"
DECODER_FILE = "decoder_step.onnx"
MANIFEST_FILE = "manifest.json"

# The axis names of DESIGN.md section 3.
BATCH, SRC_LEN, CACHE_LEN = "batch", "src_len", "cache_len"

# ------------------------------------------------------------------------------------------
# The operator support matrix of TensorRT 10.15 (onnx-tensorrt docs/operators.md)
# ------------------------------------------------------------------------------------------

_F = "FP32 FP16 BF16"
_FI = "FP32 FP16 BF16 INT32 INT64"
_FIB = "FP32 FP16 BF16 INT32 INT64 BOOL"
_CONST = "FP32 FP16 BF16 FP8 FP4 INT4 INT32 INT64 BOOL"

# op -> supported data types (short names, see _TYPE_NAMES)
_SUPPORTED_TABLE: dict[str, str] = {
    "Abs": _FI, "Acos": _F, "Acosh": _F, "Add": _FI, "And": "BOOL", "ArgMax": _FI, "ArgMin": _FI,
    "Asin": _F, "Asinh": _F, "Atan": _F, "Atanh": _F, "Attention": "FP32 FP16 BF16 INT8 FP8",
    "AveragePool": _F, "BatchNormalization": _F, "BlackmanWindow": "FP32 FP16",
    "Cast": "FP32 FP16 BF16 INT32 INT64 UINT8 BOOL", "CastLike": "FP32 FP16 BF16 INT32 INT64 UINT8 BOOL",
    "Ceil": _F, "Celu": _F, "Clip": _F, "Concat": _FIB, "Constant": _CONST, "ConstantOfShape": _CONST,
    "Conv": _F, "ConvTranspose": _F, "Cos": _F, "Cosh": _F, "CumSum": _F, "DeformConv": "FP32 FP16",
    "DepthToSpace": _FI, "DequantizeLinear": "INT8 FP8 FP4 INT4", "Div": _FI, "Dropout": _F,
    "Einsum": _F, "Elu": _F, "Equal": _FI, "Erf": _F, "Exp": _F, "Expand": _FIB, "EyeLike": _FIB,
    "Flatten": _FIB, "Floor": _F, "Gather": _FIB, "GatherElements": _FIB, "GatherND": _FIB,
    "Gelu": "FP32 FP16 BF16 INT8 INT32 INT64", "Gemm": _F, "GlobalAveragePool": _F,
    "GlobalLpPool": _F, "GlobalMaxPool": _F, "Greater": _FI, "GreaterOrEqual": _FI,
    "GridSample": "FP32 FP16", "GroupNormalization": _F, "GRU": _F, "HammingWindow": "FP32 FP16",
    "HannWindow": "FP32 FP16", "HardSigmoid": _F, "HardSwish": _F, "Hardmax": _F, "Identity": _FIB,
    "If": _FIB, "ImageScaler": _F, "InstanceNormalization": _F, "IsInf": _F, "IsNaN": _FI,
    "LayerNormalization": _F, "LeakyRelu": _F, "Less": _FI, "LessOrEqual": _FI, "Log": _F,
    "LogSoftmax": _F, "Loop": _FIB, "LRN": _F, "LSTM": _F, "LpNormalization": _F, "LpPool": _F,
    "MatMul": _F, "Max": _FI, "MaxPool": _F, "Mean": "FP32 FP16 BF16 FP8 INT32 INT64",
    "MeanVarianceNormalization": _F, "Min": _FI, "Mish": "FP32 FP16", "Mod": _FI, "Mul": _FI,
    "Neg": _FI, "NonMaxSuppression": "FP32 FP16", "NonZero": "FP32 FP16", "Not": "BOOL",
    "OneHot": _FIB, "Or": "BOOL", "Pad": _FI, "ParametricSoftplus": _F, "Pow": _FI, "PRelu": _F,
    "QuantizeLinear": _F, "RandomNormal": _F, "RandomNormalLike": _F, "RandomUniform": _F,
    "RandomUniformLike": _F, "Range": _FI, "Reciprocal": _F, "ReduceL1": _FI, "ReduceL2": _FI,
    "ReduceLogSum": _FI, "ReduceLogSumExp": _FI, "ReduceMax": _FI, "ReduceMean": _FI,
    "ReduceMin": _FI, "ReduceProd": _FI, "ReduceSum": _FI, "ReduceSumSquare": _FI, "Relu": _FI,
    "Reshape": _FIB, "Resize": _F, "ReverseSequence": _FIB, "RMSNormalization": _F, "RNN": _F,
    "RoiAlign": "FP32 FP16", "RotaryEmbedding": _F, "Round": _F, "STFT": "FP32", "ScaledTanh": _F,
    "Scan": _F, "Scatter": _FI, "ScatterElements": _FI, "ScatterND": _FI, "Selu": _F, "Shape": _FIB,
    "Shrink": _FI, "Sigmoid": _F, "Sign": _FI, "Sin": _F, "Sinh": _F, "Size": _FIB, "Slice": _FIB,
    "Softmax": _F, "Softplus": _F, "Softsign": _F, "SpaceToDepth": _FI, "Split": _FIB, "Sqrt": _F,
    "Squeeze": _FIB, "Sub": _FI, "Sum": _FI, "Tan": _F, "Tanh": _F,
    "TensorScatter": "FP32 FP16 BF16 INT32", "ThresholdedRelu": _F, "Tile": _FIB, "TopK": _FI,
    "Transpose": _FIB, "Trilu": _FIB, "Unsqueeze": _FIB, "Upsample": _F, "Where": _FIB, "Xor": "BOOL",
}
SUPPORTED_OPS: dict[str, frozenset[str]] = {k: frozenset(v.split()) for k, v in _SUPPORTED_TABLE.items()}

# Listed as "N" in the matrix.
UNSUPPORTED_OPS: frozenset[str] = frozenset(
    """AffineGrid Bernoulli BitShift BitwiseAnd BitwiseNot BitwiseOr BitwiseXor Col2Im CenterCropPad
    Compress ConcatFromSequence ConvInteger DFT Det DynamicQuantizeLinear ImageDecoder MatMulInteger
    MaxRoiPool MaxUnpool MelWeightMatrix Multinomial NegativeLogLikelihoodLoss Optional
    OptionalGetElement OptionalHasElement QLinearConv QLinearMatMul RegexFullMatch SequenceAt
    SequenceConstruct SequenceEmpty SequenceErase SequenceInsert SequenceLength SequenceMap
    SoftmaxCrossEntropyLoss SplitToSequence StringConcat StringNormalizer StringSplit
    TfIdfVectorizer Unique""".split()
)

# Supported by TensorRT, forbidden by our contract: one decoder graph for every step.
CONTROL_FLOW_OPS = frozenset({"If", "Loop", "Scan"})

_TYPE_NAMES = {
    TensorProto.FLOAT: "FP32", TensorProto.FLOAT16: "FP16", TensorProto.BFLOAT16: "BF16",
    TensorProto.DOUBLE: "FP64", TensorProto.INT32: "INT32", TensorProto.INT64: "INT64",
    TensorProto.INT8: "INT8", TensorProto.UINT8: "UINT8", TensorProto.BOOL: "BOOL",
    TensorProto.INT16: "INT16", TensorProto.UINT16: "UINT16", TensorProto.UINT32: "UINT32",
    TensorProto.UINT64: "UINT64", TensorProto.STRING: "STRING", TensorProto.COMPLEX64: "COMPLEX64",
    TensorProto.COMPLEX128: "COMPLEX128", TensorProto.FLOAT8E4M3FN: "FP8", TensorProto.INT4: "INT4",
}
# Types a TensorRT engine can take or return (network I/O); UINT8 is I/O-only in TensorRT.
IO_TYPES = frozenset({"FP32", "FP16", "BF16", "INT32", "INT64", "BOOL", "UINT8"})
# Types an initializer may hold (quantized types are for Q/DQ weights; FP64 is clamped to FP32).
INITIALIZER_TYPES = frozenset({"FP32", "FP16", "BF16", "INT32", "INT64", "BOOL", "UINT8", "INT8", "FP8", "INT4"})


def _type_name(elem_type: int) -> str:
    return _TYPE_NAMES.get(elem_type, TensorProto.DataType.Name(elem_type) if elem_type else "UNDEFINED")


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
            out.append(f"axis {axis!r}: min = {self.min} < 1 (TensorRT must never see a zero-length dimension)")
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
    """The default profile: batch 1..64 (16 typical: 16 sources, or 4 sources x 4 beams),
    sources up to ``max_positions`` (the model's ``max_len``), caches up to ``max_cache_len``
    (the export's largest cache capacity, itself at most ``max_len``).

    ``static_cache_len``: pin ``cache_len`` (the ``tensorscatter`` flavour needs a static one).
    """
    mp = int(max_positions) if max_positions else 256
    mc = min(int(max_cache_len), mp) if max_cache_len else mp
    ranges = {
        BATCH: AxisRange(1, 16, 64),
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
        return onnx.helper.tensor_dtype_to_np_dtype(self.elem_type).name if self.elem_type else "undefined"


def _dims_of(type_proto: onnx.TypeProto) -> Optional[tuple[Union[int, str, None], ...]]:
    if not type_proto.HasField("tensor_type") or not type_proto.tensor_type.HasField("shape"):
        return None
    dims: list[Union[int, str, None]] = []
    for d in type_proto.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param:
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return tuple(dims)


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
    return [TensorSpec(vi.name, vi.type.tensor_type.elem_type, _dims_of(vi.type)) for vi in model.graph.output]


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
                    "every dynamic axis (DESIGN.md section 3) so that a profile can bound it"
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
    kind: str  # opset | unsupported_op | custom_domain | control_flow | op_restriction | dtype |
    #            zero_dim | unbounded_axis | profile | cache_aliasing | manifest | load
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
                    "name": g.name, "path": g.path, "opset": g.opset, "ir_version": g.ir_version,
                    "op_counts": dict(g.op_counts), "inputs": g.inputs, "outputs": g.outputs,
                    "problems": [str(p) for p in g.problems], "warnings": [str(w) for w in g.warnings],
                }
                for g in self.graphs
            ],
            "problems": [str(p) for p in self.problems],
        }

    def format(self) -> str:
        """A human-readable summary: one line per graph, then every problem and warning."""
        lines = [f"TensorRT {self.target} readiness ({'OK' if self.ok else 'NOT READY'}), "
                 f"flavour {self.flavour or '?'}, profile "
                 + ", ".join(f"{k}={v}" for k, v in sorted(self.axis_ranges.items()))]
        for g in self.graphs:
            n_nodes = sum(g.op_counts.values())
            lines.append(f"  {g.name}: opset {g.opset}, IR {g.ir_version}, {n_nodes} nodes, "
                         f"{len(g.op_counts)} op types, {len(g.problems)} problem(s), {len(g.warnings)} warning(s)")
        for p in self.problems:
            lines.append(f"  PROBLEM {p}")
        for w in self.warnings:
            lines.append(f"  warning {w}")
        return "\n".join(lines)


class TensorRTReadinessError(RuntimeError):
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


# ------------------------------------------------------------------------------------------
# Per-op restrictions that can be checked statically
# ------------------------------------------------------------------------------------------


class _GraphIndex:
    """Producers, consumers, constants and types of one graph's tensors."""

    def __init__(self, model: onnx.ModelProto, inferred: onnx.ModelProto):
        g = model.graph
        self.initializers = {t.name: t for t in g.initializer}
        self.graph_inputs = {vi.name for vi in g.input if vi.name not in self.initializers}
        self.graph_outputs = {vi.name for vi in g.output}
        self.producers: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in g.node:
            for o in node.output:
                if o:
                    self.producers[o] = node
            for i in node.input:
                if i:
                    self.consumers.setdefault(i, []).append(node)
        self.types: dict[str, int] = {}
        self.shapes: dict[str, tuple] = {}
        for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
            if vi.type.HasField("tensor_type"):
                if vi.type.tensor_type.elem_type:
                    self.types[vi.name] = vi.type.tensor_type.elem_type
                dims = _dims_of(vi.type)
                if dims is not None:
                    self.shapes[vi.name] = dims
        for t in g.initializer:
            self.types[t.name] = t.data_type
            self.shapes[t.name] = tuple(int(d) for d in t.dims)

    def is_constant(self, name: str) -> bool:
        """An initializer or the output of a Constant node (what the parser turns into weights)."""
        if name in self.initializers:
            return True
        prod = self.producers.get(name)
        return prod is not None and prod.op_type == "Constant"

    def is_constant_foldable(self, name: str, depth: int = 0) -> bool:
        """Computed only from constants and tensor shapes (the parser folds such subgraphs)."""
        if self.is_constant(name):
            return True
        prod = self.producers.get(name)
        if prod is None or depth > 32:
            return False
        if prod.op_type in ("Shape", "Size"):
            return True
        return all(self.is_constant_foldable(i, depth + 1) for i in prod.input if i)

    def constant_value(self, name: str):
        from onnx import numpy_helper

        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        prod = self.producers.get(name)
        if prod is not None and prod.op_type == "Constant":
            for a in prod.attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t)
                if a.name in ("value_int", "value_float"):
                    return a.i if a.name == "value_int" else a.f
                if a.name in ("value_ints", "value_floats"):
                    return list(a.ints) if a.name == "value_ints" else list(a.floats)
        return None


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _input(node: onnx.NodeProto, i: int) -> str:
    return node.input[i] if len(node.input) > i else ""


def _output(node: onnx.NodeProto, i: int) -> str:
    return node.output[i] if len(node.output) > i else ""


RestrictionCheck = Callable[[onnx.NodeProto, _GraphIndex], list[tuple[str, str]]]  # (severity, message)


def _needs_initializer(index: int, what: str) -> RestrictionCheck:
    def check(node, g):
        name = _input(node, index)
        if name and not g.is_constant(name):
            return [("problem", f"`{what}` must be an initializer (TensorRT 10.15), but {name!r} is computed")]
        return []
    return check


def _needs_constant(index: int, what: str) -> RestrictionCheck:
    def check(node, g):
        name = _input(node, index)
        if not name or g.is_constant(name):
            return []
        if g.is_constant_foldable(name):
            return [("warning", f"`{what}` ({name!r}) is computed from shapes/constants; the parser must fold it")]
        return [("problem", f"`{what}` must be resolvable to a constant, but {name!r} depends on runtime data")]
    return check


def _check_tensor_scatter(node, g):
    out = []
    axis = _attr(node, "axis", None)
    if axis is None:
        out.append(("warning", "no `axis` attribute (ONNX default -2); write the literal axis=-2, the spelling "
                               "TensorRT's parser is documented to accept"))
    elif axis != -2:
        out.append(("problem", f"`axis` must be the literal -2 (TensorRT 10.15), got axis={axis}"))
    mode = _attr(node, "mode", b"linear")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode != "linear":
        out.append(("problem", f"`mode` must be 'linear' (TensorRT's KV-cache update supports only linear), got {mode!r}"))
    for i, what in ((0, "past_cache"), (1, "update")):
        name = _input(node, i)
        shape = g.shapes.get(name)
        if shape is not None and len(shape) != 4:
            out.append(("problem", f"`{what}` ({name!r}) must be 4-D, got rank {len(shape)}"))
    cache = _input(node, 0)
    if cache and cache not in g.graph_inputs:
        out.append(("problem", f"`past_cache` ({cache!r}) must be a graph input: TensorRT's KV-cache update "
                               "writes the bound input buffer in place"))
    elif cache:
        others = [n.name or n.op_type for n in g.consumers.get(cache, []) if list(n.output) != list(node.output)]
        if others:
            out.append(("problem", f"cache input {cache!r} is also read by {others}: with the cache updated in "
                                   "place, only the TensorScatter may read it (DESIGN.md section 3)"))
    present = _output(node, 0)
    if present and present not in g.graph_outputs:
        out.append(("problem", f"the updated cache {present!r} must be a graph output (it aliases the input buffer)"))
    return out


def _check_attention(node, g):
    out = []
    for i, what in ((4, "past_key"), (5, "past_value"), (6, "nonpad_kv_seqlen")):
        if _input(node, i):
            out.append(("problem", f"input `{what}` is unsupported by TensorRT 10.15"))
    for i, what in ((1, "present_key"), (2, "present_value"), (3, "qk_matmul_output")):
        if _output(node, i):
            out.append(("problem", f"output `{what}` is unsupported by TensorRT 10.15"))
    for a in ("qk_matmul_output_mode", "softcap"):
        if _attr(node, a, None) not in (None, 0, 0.0):
            out.append(("problem", f"attribute `{a}` is unsupported by TensorRT 10.15"))
    for i, what in ((0, "Q"), (1, "K"), (2, "V"), (3, "attn_mask")):
        shape = g.shapes.get(_input(node, i))
        if _input(node, i) and shape is not None and len(shape) != 4:
            out.append(("problem", f"`{what}` must be 4-D, got rank {len(shape)}"))
    return out


def _check_topk(node, g):
    out = []
    if _attr(node, "sorted", 1) != 1:
        out.append(("problem", "`sorted` must be 1"))
    k = g.constant_value(_input(node, 1))
    if k is not None:
        import numpy as np

        if int(np.max(np.asarray(k))) >= 3840:
            out.append(("problem", f"`K` must be less than 3840, got {int(np.max(np.asarray(k)))}"))
    return out


def _check_layer_norm(node, g):
    if any(o for o in node.output[1:]):
        return [("problem", "only the first output `Y` is supported (Mean / InvStdDev outputs are not)")]
    return []


def _check_dropout(node, g):
    name = _input(node, 2)
    if not name:
        return []
    value = g.constant_value(name)
    if value is None:
        return [("problem", "`is_training` must be an initializer")]
    import numpy as np

    if bool(np.asarray(value).any()):
        return [("problem", "`is_training` must evaluate to False")]
    return []


def _check_scatter_nd(node, g):
    reduction = _attr(node, "reduction", b"none")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    if reduction != "none":
        return [("problem", f"`reduction` other than 'none' is not supported, got {reduction!r}")]
    return []


def _check_pool(node, g):
    out = []
    dil = _attr(node, "dilations", None)
    if dil and any(int(d) != 1 for d in dil):
        out.append(("problem", "`dilations` must be empty or all ones"))
    if node.op_type == "MaxPool" and _output(node, 1):
        out.append(("problem", "the `Indices` output is unsupported"))
    return out


def _check_lstm(node, g):
    out = []
    if _attr(node, "input_forget", 0) != 0:
        out.append(("problem", "`input_forget` must be 0"))
    if _attr(node, "layout", 0) != 0:
        out.append(("problem", "`layout` must be 0"))
    return out


def _check_constant(node, g):
    for a in node.attribute:
        if a.name in ("sparse_value", "value_string", "value_strings"):
            return [("problem", f"attribute `{a.name}` is unsupported")]
    return []


def _check_resize(node, g):
    out = []
    mode = _attr(node, "mode", b"nearest")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode not in ("nearest", "linear"):
        out.append(("problem", f"resize mode {mode!r} is unsupported (nearest, linear)"))
    ctm = _attr(node, "coordinate_transformation_mode", b"half_pixel")
    ctm = ctm.decode() if isinstance(ctm, bytes) else ctm
    if ctm not in ("half_pixel", "pytorch_half_pixel", "tf_half_pixel_for_nn", "asymmetric", "align_corners"):
        out.append(("problem", f"coordinate_transformation_mode {ctm!r} is unsupported"))
    if _attr(node, "antialias", 0):
        out.append(("problem", "antialiasing is unsupported"))
    return out


_RESTRICTIONS: dict[str, list[RestrictionCheck]] = {
    "TensorScatter": [_check_tensor_scatter],
    "Attention": [_check_attention],
    "TopK": [_check_topk],
    "LayerNormalization": [_check_layer_norm],
    "Dropout": [_check_dropout],
    "ScatterND": [_check_scatter_nd],
    "AveragePool": [_check_pool], "MaxPool": [_check_pool], "LpPool": [_check_pool],
    "LSTM": [_check_lstm],
    "Constant": [_check_constant],
    "Resize": [_check_resize],
    "CumSum": [_needs_constant(1, "axis")],
    "OneHot": [_needs_constant(1, "depth")],
    "Squeeze": [_needs_constant(1, "axes")],
    "Unsqueeze": [_needs_constant(1, "axes")],
    **{op: [_needs_initializer(1, "axes")] for op in (
        "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean",
        "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare")},
}

# Which tensor's type is checked against the op's supported types: input 0 unless listed here.
_TYPED_BY_OUTPUT = {"Constant", "ConstantOfShape", "RandomNormal", "RandomUniform", "EyeLike"}
_TYPED_BY_INPUT = {"Where": 1}


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


def check_model(
    model_or_path: Union[onnx.ModelProto, str, os.PathLike],
    name: Optional[str] = None,
    axis_ranges: Optional[Mapping[str, AxisRange]] = None,
    *,
    max_positions: Optional[int] = None,
) -> GraphReadiness:
    """Check one ONNX graph against TensorRT 10.15's parser and our contract; never raises for
    a graph problem (they are collected in the returned :class:`GraphReadiness`)."""
    try:
        model, path = _load(model_or_path)
    except Exception as exc:  # noqa: BLE001 - a corrupt file is a reportable problem
        gname = name or os.path.basename(os.fspath(model_or_path))
        r = GraphReadiness(gname, os.fspath(model_or_path), None, None)
        r.problems.append(Problem(gname, "load", f"cannot load the ONNX file: {exc}"))
        return r
    gname = name or (os.path.basename(path) if path else model.graph.name or "graph")
    report = GraphReadiness(gname, path, _default_opset(model), int(model.ir_version))

    def problem(kind, message, node=None):
        report.problems.append(Problem(gname, kind, message, node))

    def warning(kind, message, node=None):
        report.warnings.append(Problem(gname, kind, message, node))

    # ---- opsets and domains
    if report.opset is None:
        problem("opset", "the model imports no default-domain ('ai.onnx') opset")
    elif not MIN_OPSET <= report.opset <= MAX_OPSET:
        problem("opset", f"opset {report.opset} is outside the range TensorRT {TRT_TARGET_VERSION} parses "
                         f"({MIN_OPSET}..{MAX_OPSET}); re-export with --opset {min(max(report.opset, MIN_OPSET), MAX_OPSET)}")
    for imp in model.opset_import:
        if imp.domain not in ("", "ai.onnx"):
            warning("custom_domain", f"imports opset domain {imp.domain!r} v{imp.version}")
    local_functions = {(f.domain, f.name) for f in model.functions}

    # ---- shape/type inference (types of intermediate tensors)
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    except Exception as exc:  # noqa: BLE001
        warning("dtype", f"ONNX shape inference failed ({exc}); intermediate types are not checked")
        inferred = model
    g = _GraphIndex(model, inferred)

    # ---- nodes
    counts: Counter[str] = Counter()
    for idx, node in enumerate(model.graph.node):
        label = node.name or f"#{idx} {node.op_type}"
        op_key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
        counts[op_key] += 1
        if node.domain not in ("", "ai.onnx"):
            if (node.domain, node.op_type) in local_functions:
                warning("custom_domain", f"model-local function {op_key}: the parser inlines it", label)
            else:
                problem("custom_domain", f"{op_key} is not a standard ONNX op; TensorRT would need a plugin "
                                         "(every custom op must be lowered to standard ops)", label)
            continue
        if node.op_type in CONTROL_FLOW_OPS:
            problem("control_flow", f"{node.op_type} node: control flow is forbidden in the exported graphs "
                                    "(one decoder graph for every step, DESIGN.md section 3)", label)
            continue
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            problem("control_flow", f"{node.op_type} node carries a subgraph attribute", label)
            continue
        if node.op_type in UNSUPPORTED_OPS:
            problem("unsupported_op", f"{node.op_type} is listed as unsupported by TensorRT {TRT_TARGET_VERSION}", label)
            continue
        if node.op_type not in SUPPORTED_OPS:
            problem("unsupported_op", f"{node.op_type} is not in TensorRT {TRT_TARGET_VERSION}'s ONNX operator "
                                      "support list", label)
            continue
        for check in _RESTRICTIONS.get(node.op_type, []):
            for severity, message in check(node, g):
                (problem if severity == "problem" else warning)("op_restriction", f"{node.op_type}: {message}", label)
        # data type of the op
        allowed = SUPPORTED_OPS[node.op_type]
        typed: list[str] = []
        if node.op_type in _TYPED_BY_OUTPUT:
            typed = [_output(node, 0)]
        elif node.op_type in ("Cast", "CastLike"):
            typed = [_input(node, 0), _output(node, 0)]
        else:
            typed = [_input(node, _TYPED_BY_INPUT.get(node.op_type, 0))]
        for t in typed:
            if t and t in g.types:
                tname = _type_name(g.types[t])
                if tname not in allowed:
                    problem("dtype", f"{node.op_type} on {tname} tensor {t!r}: TensorRT {TRT_TARGET_VERSION} "
                                     f"supports {' '.join(sorted(allowed))} for this op", label)
        # zero-length constants
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value" and any(int(d) == 0 for d in a.t.dims):
                    problem("zero_dim", f"constant {_output(node, 0)!r} has a zero-length dimension {list(a.t.dims)}", label)
    report.op_counts = dict(sorted(counts.items()))

    # ---- graph inputs / outputs / initializers: dtypes and zero-length dims
    inits = g.initializers
    for spec in input_specs(model):
        report.inputs[spec.name] = {"dtype": spec.dtype, "shape": list(spec.dims) if spec.dims is not None else None}
        tname = _type_name(spec.elem_type)
        if tname not in IO_TYPES:
            problem("dtype", f"input {spec.name!r} is {tname}; TensorRT engines bind "
                             f"{' '.join(sorted(IO_TYPES))}" + (" (float64 is clamped to float32)" if tname == "FP64" else ""))
    for spec in output_specs(model):
        report.outputs[spec.name] = {"dtype": spec.dtype, "shape": list(spec.dims) if spec.dims is not None else None}
        tname = _type_name(spec.elem_type)
        if tname not in IO_TYPES:
            problem("dtype", f"output {spec.name!r} is {tname}; TensorRT engines bind {' '.join(sorted(IO_TYPES))}")
    for t in inits.values():
        tname = _type_name(t.data_type)
        if tname not in INITIALIZER_TYPES:
            problem("dtype", f"initializer {t.name!r} is {tname}" + (
                " (TensorRT casts float64 down to float32, clamping to +-FLT_MAX)" if tname == "FP64" else
                f"; TensorRT supports {' '.join(sorted(INITIALIZER_TYPES))}"))
        if any(int(d) == 0 for d in t.dims):
            problem("zero_dim", f"initializer {t.name!r} has a zero-length dimension {list(t.dims)}")
    seen = set()
    for vi in list(model.graph.input) + list(model.graph.output) + list(inferred.graph.value_info):
        if vi.name in seen or vi.name in inits:
            continue
        seen.add(vi.name)
        dims = _dims_of(vi.type)
        if dims and any(d == 0 for d in dims):
            problem("zero_dim", f"tensor {vi.name!r} has a zero-length dimension {list(dims)} (TensorRT and the "
                                "contract forbid empty tensors: no zero-length past, no empty first step)")

    # ---- profile: every dynamic axis named and bounded
    ranges = dict(axis_ranges) if axis_ranges is not None else None
    if ranges is not None:
        for axis, r in ranges.items():
            for msg in r.problems(axis):
                problem("profile", msg)
    specs = input_specs(model)
    static_cache_axes: dict[str, set[str]] = {}
    for node in model.graph.node:
        if node.op_type == "TensorScatter" and _input(node, 0) in g.graph_inputs:
            dims = next((s.dims for s in specs if s.name == _input(node, 0)), None)
            if dims and len(dims) >= 2:
                static_cache_axes.setdefault(str(dims[-2]), set()).add(_input(node, 0))
    for spec in specs:
        if spec.dims is None:
            problem("unbounded_axis", f"input {spec.name!r} has no shape (rank unknown): TensorRT needs the rank")
            continue
        for i, d in enumerate(spec.dims):
            if isinstance(d, int):
                continue
            if d is None:
                problem("unbounded_axis", f"input {spec.name!r} axis {i} is dynamic without a name: no profile can "
                                          "bound it (the exporter must name every dynamic axis)")
                continue
            if ranges is not None and d not in ranges:
                problem("unbounded_axis", f"input {spec.name!r} axis {i} ({d!r}) is not bounded by the optimization "
                                          f"profile (profile axes: {sorted(ranges)}); pass --axis {d}=MIN:OPT:MAX")
    for axis, names in static_cache_axes.items():
        if axis.lstrip("-").isdigit():
            continue
        if ranges is not None and axis in ranges and not ranges[axis].static:
            problem("cache_aliasing", f"TensorScatter caches {sorted(names)}: TensorRT's KV-cache update layer needs a "
                                      f"static cache length, but axis {axis!r} ranges {ranges[axis]}; pass "
                                      f"--cache-len N (the builder then fixes {axis} = N)")
    if ranges is not None and max_positions is not None and SRC_LEN in ranges and ranges[SRC_LEN].max > max_positions:
        problem("profile", f"src_len max {ranges[SRC_LEN].max} > the model's max_len {max_positions} "
                           "(positional-encoding rows; DESIGN.md section 3)")
    if ranges is not None and max_positions is not None and CACHE_LEN in ranges and ranges[CACHE_LEN].max > max_positions:
        warning("profile", f"cache_len max {ranges[CACHE_LEN].max} > max_len {max_positions}: positions beyond "
                           "max_len are never written, the extra capacity is wasted")
    return report


# ------------------------------------------------------------------------------------------
# Export folders
# ------------------------------------------------------------------------------------------


def read_manifest(export_dir: Union[str, os.PathLike]) -> dict[str, Any]:
    """``manifest.json`` of an export folder as a dict (``{}`` when absent)."""
    path = Path(export_dir) / MANIFEST_FILE
    if not path.exists():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def manifest_max_positions(manifest: Mapping[str, Any]) -> Optional[int]:
    """The model's ``max_len`` (positional-encoding rows) as the manifest states it."""
    for key in ("max_positions", "max_len"):
        if isinstance(manifest.get(key), int):
            return int(manifest[key])
    config = manifest.get("config") or manifest.get("model_config") or {}
    if isinstance(config, dict) and isinstance(config.get("max_len"), int):
        return int(config["max_len"])
    return None


def manifest_max_cache_len(manifest: Mapping[str, Any]) -> Optional[int]:
    """The largest cache capacity the export supports (``max_cache_len``), if stated."""
    value = manifest.get("max_cache_len")
    return int(value) if isinstance(value, int) else None


def decoder_flavour(decoder: Union[onnx.ModelProto, Iterable[str]]) -> str:
    """``"tensorscatter"`` when the decoder step returns ``present_key.*`` caches, else ``"portable"``."""
    names = [o.name for o in decoder.graph.output] if isinstance(decoder, onnx.ModelProto) else list(decoder)
    return "tensorscatter" if any(n.startswith("present_key.") for n in names) else "portable"


def _manifest_io(manifest: Mapping[str, Any], graph_key: str) -> dict[str, Any]:
    """Best-effort ``{name: {"dtype":..., "axes"/"shape": [...]}}`` of a graph in the manifest."""
    graphs = manifest.get("graphs")
    entry = None
    if isinstance(graphs, dict):
        entry = graphs.get(graph_key) or graphs.get(f"{graph_key}.onnx")
    if entry is None:
        entry = manifest.get(graph_key)
    out: dict[str, Any] = {}
    if not isinstance(entry, dict):
        return out
    for side in ("inputs", "outputs"):
        items = entry.get(side)
        if isinstance(items, dict):
            out.update({k: v for k, v in items.items() if isinstance(v, dict)})
        elif isinstance(items, list):
            out.update({v["name"]: v for v in items if isinstance(v, dict) and "name" in v})
    return out


def _check_manifest_against_graph(manifest, graph_key: str, model: onnx.ModelProto, gname: str) -> list[Problem]:
    """Names/dtypes/axes the manifest states must be those of the graph."""
    stated = _manifest_io(manifest, graph_key)
    if not stated:
        return []
    actual = {s.name: s for s in input_specs(model) + output_specs(model)}
    problems = []
    for name, info in stated.items():
        if name not in actual:
            problems.append(Problem(gname, "manifest", f"manifest lists {name!r}, which the graph does not have"))
            continue
        spec = actual[name]
        dtype = info.get("dtype")
        if isinstance(dtype, str) and dtype not in (spec.dtype, spec.dtype.replace("float", "fp")):
            problems.append(Problem(gname, "manifest", f"{name!r}: manifest dtype {dtype} != graph dtype {spec.dtype}"))
        axes = info.get("axes", info.get("shape"))
        if spec.dims is None:
            continue
        if isinstance(axes, list) and len(axes) == len(spec.dims):
            for a, d in zip(axes, spec.dims):
                if isinstance(d, str) and isinstance(a, str) and a != d:
                    problems.append(Problem(gname, "manifest", f"{name!r}: manifest axes {axes} != graph axes {list(spec.dims)}"))
                    break
        elif isinstance(axes, list):
            problems.append(Problem(gname, "manifest", f"{name!r}: manifest rank {len(axes)} != graph rank {len(spec.dims)}"))
    return problems


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
            graphs' (off for converted copies, whose dtypes differ on purpose).

    Returns:
        the :class:`ReadinessReport` (also attached to the error).
    """
    export_dir = Path(export_dir)
    extra: list[Problem] = []
    if not export_dir.is_dir():
        raise FileNotFoundError(f"export folder not found: {export_dir} (write one with `python -m export.onnx`)")
    try:
        manifest = read_manifest(export_dir)
    except ValueError as exc:
        manifest = {}
        extra.append(Problem(MANIFEST_FILE, "manifest", str(exc)))
    if not manifest and not (export_dir / MANIFEST_FILE).exists():
        extra.append(Problem(MANIFEST_FILE, "manifest", f"{export_dir / MANIFEST_FILE} is missing"))
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
            loaded[key] = src if isinstance(src, onnx.ModelProto) else onnx.load(os.fspath(src), load_external_data=False)
        except Exception as exc:  # noqa: BLE001
            extra.append(Problem(f"{key}.onnx", "load", f"cannot load {src}: {exc}"))
    if "decoder_step" in loaded:
        flavour = decoder_flavour(loaded["decoder_step"])
    ranges = default_axis_ranges(max_positions, max_cache_len)
    if flavour == "tensorscatter" and not (axis_ranges and CACHE_LEN in axis_ranges):
        # TensorRT's KV-cache update layer needs a static cache length: default to the longest.
        ranges = default_axis_ranges(max_positions, max_cache_len, static_cache_len=ranges[CACHE_LEN].max)
        logger.warning("tensorscatter flavour: cache_len pinned to %d (max_cache_len); choose the capacity your "
                       "requests need with --cache-len N, every step reads the whole cache", ranges[CACHE_LEN].max)
    if axis_ranges:
        ranges.update(axis_ranges)
    for key, model in loaded.items():
        gname = f"{key}.onnx"
        r = check_model(model, gname, ranges, max_positions=max_positions)
        r.path = os.fspath(sources[key]) if not isinstance(sources[key], onnx.ModelProto) else None
        if compare_manifest:
            r.problems.extend(_check_manifest_against_graph(manifest, key, model, gname))
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
