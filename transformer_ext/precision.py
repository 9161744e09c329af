"""Conversion of exported float32 graphs to fp16 / bf16, for the TensorRT builder
(``python -m export.tensorrt``) and the runners that run reduced-precision graphs
(:class:`transformer_ext.runtimes.OrtCudaRunner` converts in memory when the converted graphs are
not in the export folder). Needs onnx and numpy, not torch.

Every float32 tensor becomes the low precision (weights, caches, activations), except the ops
in :data:`FLOAT32_OPS` (softmax, normalizations, reductions, ``Exp``/``Log``/``Pow``/``Sqrt``),
which compute in float32 behind explicit ``Cast`` nodes, and the outputs in
:data:`FLOAT32_OUTPUTS` (``logits``, float32 in every precision, docs/DESIGN.md section 3). The caches
have the dtype :data:`CACHE_DTYPES` names.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .export_format import DTYPES, ExportError

logger = logging.getLogger(__name__)

__all__ = [
    "PRECISIONS",
    "CACHE_DTYPES",
    "FLOAT32_OPS",
    "FLOAT32_OUTPUTS",
    "PrecisionConversionError",
    "convert_precision",
]

# Each precision: the dtype of its caches (self- and cross-attention K/V), its ONNX element type
# and the builder flag of the weakly-typed path.
PRECISIONS: dict[str, dict[str, Any]] = {
    "fp32": {"cache_dtype": "float32", "onnx_type": DTYPES["float32"].onnx, "weak_flag": None},
    "fp16": {"cache_dtype": "float16", "onnx_type": DTYPES["float16"].onnx, "weak_flag": "FP16"},
    "bf16": {"cache_dtype": "bfloat16", "onnx_type": DTYPES["bfloat16"].onnx, "weak_flag": "BF16"},
}
CACHE_DTYPES: dict[str, str] = {p: v["cache_dtype"] for p, v in PRECISIONS.items()}

# Ops computed in float32 whatever the precision: softmax, normalizations, reductions and the
# transcendental steps of decomposed softmax / normalization.
FLOAT32_OPS = frozenset(
    {
        "Softmax",
        "LogSoftmax",
        "LayerNormalization",
        "RMSNormalization",
        "GroupNormalization",
        "InstanceNormalization",
        "BatchNormalization",
        "MeanVarianceNormalization",
        "LpNormalization",
        "ReduceMean",
        "ReduceSum",
        "ReduceSumSquare",
        "ReduceL1",
        "ReduceL2",
        "ReduceLogSum",
        "ReduceLogSumExp",
        "ReduceProd",
        "Exp",
        "Log",
        "Pow",
        "Sqrt",
        "Reciprocal",
        "Erf",
        "CumSum",
    }
)
# Outputs that stay float32 in every precision (docs/DESIGN.md section 3: logits are float32).
FLOAT32_OUTPUTS = ("logits",)
# Ops whose float inputs may have any float type (no cast needed in front of them).
_TYPE_AGNOSTIC_INPUTS = frozenset({"Cast", "Shape", "Size"})


class PrecisionConversionError(ExportError, ValueError):
    """A graph could not be converted to fp16/bf16 with consistent types."""


def _tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    except Exception as exc:  # noqa: BLE001
        raise PrecisionConversionError(f"ONNX shape inference failed on {model.graph.name!r}: {exc}") from exc
    types: dict[str, int] = {}
    for vi in list(inferred.graph.input) + list(inferred.graph.output) + list(inferred.graph.value_info):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
    for t in inferred.graph.initializer:
        types[t.name] = t.data_type
    for node in inferred.graph.node:  # Constant outputs are not always in value_info
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    types.setdefault(node.output[0], a.t.data_type)
                elif a.name in ("value_float", "value_floats"):
                    types.setdefault(node.output[0], TensorProto.FLOAT)
    return types


def _to_low(array: np.ndarray, low: int) -> onnx.TensorProto:
    np_dtype = helper.tensor_dtype_to_np_dtype(low)
    return numpy_helper.from_array(np.asarray(array, dtype=np.float32).astype(np_dtype))


def _copied_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """Copies of the graph's nodes (protobuf wrappers have no stable identity, so the conversion
    works on copies addressed by index); refuses custom ops and subgraphs."""
    nodes: list[onnx.NodeProto] = []
    for n in graph.node:
        clone = onnx.NodeProto()
        clone.CopyFrom(n)
        nodes.append(clone)
    for n in nodes:
        if n.domain not in ("", "ai.onnx"):
            raise PrecisionConversionError(f"cannot convert custom op {n.domain}::{n.op_type}")
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
            raise PrecisionConversionError(f"cannot convert {n.op_type}: subgraphs are not supported")
    return nodes


def _float32_only_names(nodes: Sequence[onnx.NodeProto], keep: set[int], graph_outputs: set[str]) -> set[str]:
    """The tensors that only kept (float32) nodes read and that are no graph output."""
    consumers: dict[str, list[int]] = {}
    for k, n in enumerate(nodes):
        for i in n.input:
            if i:
                consumers.setdefault(i, []).append(k)
    return {
        name for name, cons in consumers.items() if all(c in keep for c in cons) and name not in graph_outputs
    }


def _convert_initializers(
    graph: onnx.GraphProto, low: int, float32_only: set[str], new_type: dict[str, int]
) -> None:
    """float32 initializers become ``low`` except those only float32 nodes read."""
    for t in graph.initializer:
        if t.data_type != TensorProto.FLOAT:
            continue
        if t.name in float32_only:
            new_type[t.name] = TensorProto.FLOAT
            continue
        conv = _to_low(numpy_helper.to_array(t), low)
        conv.name = t.name
        t.CopyFrom(conv)
        new_type[t.name] = low


def _convert_constant_nodes(
    nodes: Sequence[onnx.NodeProto],
    low: int,
    float_names: set[str],
    float32_only: set[str],
    float32_outputs: Sequence[str],
    graph_outputs: set[str],
    new_type: dict[str, int],
) -> None:
    """float32 ``Constant`` / ``ConstantOfShape`` values and ``Cast(to=FLOAT)`` targets become ``low``
    (except constants only float32 nodes read and the final float32 output casts)."""
    FLOAT = TensorProto.FLOAT
    for n in nodes:
        if n.op_type == "Constant" and n.output[0] in float_names:
            if n.output[0] in float32_only:
                new_type[n.output[0]] = FLOAT
                continue
            value = None
            for a in n.attribute:
                if a.name == "value":
                    value = numpy_helper.to_array(a.t)
                elif a.name == "value_float":
                    value = np.array(a.f, dtype=np.float32)
                elif a.name == "value_floats":
                    value = np.array(list(a.floats), dtype=np.float32)
            if value is not None:
                del n.attribute[:]
                n.attribute.append(helper.make_attribute("value", _to_low(value, low)))
        elif n.op_type == "ConstantOfShape" and n.output[0] in float_names:
            for a in n.attribute:
                if a.name == "value":
                    a.t.CopyFrom(_to_low(numpy_helper.to_array(a.t), low))
            if not any(a.name == "value" for a in n.attribute):  # default value: float32 zero
                n.attribute.append(helper.make_attribute("value", _to_low(np.zeros(1, np.float32), low)))
        elif n.op_type == "Cast" and any(a.name == "to" and a.i == FLOAT for a in n.attribute):
            if n.output[0] in float32_outputs and n.output[0] in graph_outputs:
                new_type[n.output[0]] = FLOAT  # already the float32 output cast
                continue
            for a in n.attribute:
                if a.name == "to":
                    a.i = low


def _with_input_casts(
    nodes: Sequence[onnx.NodeProto], keep: set[int], new_type: dict[str, int], low: int, precision: str
) -> list[onnx.NodeProto]:
    """The nodes with a ``Cast`` inserted in front of each input that has the other precision (one
    cast per tensor and target type, shared by its readers)."""
    FLOAT = TensorProto.FLOAT
    cast_cache: dict[tuple[str, int], str] = {}
    rebuilt: list[onnx.NodeProto] = []
    for k, n in enumerate(nodes):
        kept = k in keep
        for idx, i in enumerate(n.input):
            if not i or i not in new_type:
                continue
            want = None
            if kept and new_type[i] == low:
                want = FLOAT
            elif not kept and new_type[i] == FLOAT and n.op_type not in _TYPE_AGNOSTIC_INPUTS:
                want = low
            if want is None:
                continue
            key = (i, want)
            if key not in cast_cache:
                cast_cache[key] = f"{i}__{'fp32' if want == FLOAT else precision}"
                rebuilt.append(
                    helper.make_node(
                        "Cast", [i], [cast_cache[key]], to=want, name=f"precision_cast_{len(cast_cache)}"
                    )
                )
            n.input[idx] = cast_cache[key]
        rebuilt.append(n)
    return rebuilt


def _output_casts(
    graph: onnx.GraphProto,
    rebuilt: Sequence[onnx.NodeProto],
    new_type: dict[str, int],
    float32_outputs: Sequence[str],
    low: int,
    precision: str,
) -> list[onnx.NodeProto]:
    """Sets the graph outputs' types (float32 for ``float32_outputs``, else ``low``) and returns the
    final ``Cast`` nodes for those computed in the other precision (renaming their producers)."""
    FLOAT = TensorProto.FLOAT
    tail: list[onnx.NodeProto] = []
    renames: dict[str, str] = {}
    for o in graph.output:
        if o.name not in new_type:
            continue
        want = FLOAT if o.name in float32_outputs else low
        if new_type[o.name] != want:
            inner = f"{o.name}__{'fp32' if new_type[o.name] == FLOAT else precision}_value"
            renames[o.name] = inner
            tail.append(
                helper.make_node("Cast", [inner], [o.name], to=want, name=f"precision_output_cast_{o.name}")
            )
        o.type.tensor_type.elem_type = want
    if renames:
        for n in rebuilt:
            for idx, o in enumerate(n.output):
                if o in renames:
                    n.output[idx] = renames[o]
            for idx, i in enumerate(n.input):
                if i in renames:
                    n.input[idx] = renames[i]
    return tail


def convert_precision(
    model: onnx.ModelProto,
    precision: str,
    *,
    float32_ops: frozenset[str] = FLOAT32_OPS,
    float32_outputs: Sequence[str] = FLOAT32_OUTPUTS,
) -> onnx.ModelProto:
    """A copy of a float32 graph in fp16 or bf16, for a strongly typed TensorRT network.

    * float32 initializers, constants and graph inputs/outputs become the low precision (so the
      self- and cross-attention caches and ``new_key``/``present_key`` outputs have the dtype of
      :data:`CACHE_DTYPES`), except the outputs in ``float32_outputs`` (``logits``), which get a
      final ``Cast`` to float32;
    * nodes in ``float32_ops`` (softmax, normalizations, reductions...) compute in float32: a
      ``Cast`` up in front of each low-precision float input, a ``Cast`` down behind each output
      that a low-precision node reads; initializers read only by such nodes stay float32;
    * ``Cast(to=FLOAT)`` / ``ConstantOfShape`` of float32 produce the low precision instead.

    The result passes ``onnx.checker`` and strict type inference, or
    :class:`PrecisionConversionError` is raised. ``fp32`` returns an unchanged copy.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    out = copy.deepcopy(model)
    if precision == "fp32":
        return out
    low = PRECISIONS[precision]["onnx_type"]
    FLOAT = TensorProto.FLOAT
    g = out.graph
    types = _tensor_types(out)
    nodes = _copied_nodes(g)
    float_names = {name for name, t in types.items() if t == FLOAT}
    keep = {k for k, n in enumerate(nodes) if n.op_type in float32_ops}
    graph_outputs = {o.name for o in g.output}
    float32_only = _float32_only_names(nodes, keep, graph_outputs)

    # New type of every float32 tensor: FLOAT when computed by a kept node (or a float32-only
    # constant), else the low precision.
    new_type: dict[str, int] = {name: low for name in float_names}
    for k in keep:
        for o in nodes[k].output:
            if o in float_names:
                new_type[o] = FLOAT
    _convert_initializers(g, low, float32_only, new_type)
    _convert_constant_nodes(nodes, low, float_names, float32_only, float32_outputs, graph_outputs, new_type)
    rebuilt = _with_input_casts(nodes, keep, new_type, low, precision)
    tail = _output_casts(g, rebuilt, new_type, float32_outputs, low, precision)
    del g.node[:]
    g.node.extend(rebuilt + tail)
    for vi in g.input:
        if vi.name in new_type and vi.type.tensor_type.elem_type == FLOAT:
            vi.type.tensor_type.elem_type = new_type[vi.name]
    del g.value_info[:]  # stale types; strict inference below recomputes them
    try:
        onnx.checker.check_model(out)
        onnx.shape_inference.infer_shapes(out, check_type=True, strict_mode=True)
    except Exception as exc:  # noqa: BLE001
        raise PrecisionConversionError(
            f"the {precision} conversion of {model.graph.name!r} is not type-consistent: {exc}"
        ) from exc
    n_casts = sum(1 for n in out.graph.node if n.name.startswith("precision_"))
    logger.info(
        "converted %s to %s: %d nodes kept in float32, %d casts inserted, outputs %s stay float32",
        model.graph.name,
        precision,
        len(keep),
        n_casts,
        [o for o in float32_outputs if o in graph_outputs],
    )
    return out
