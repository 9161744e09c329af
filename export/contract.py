"""The structural rules of the export contract (docs/DESIGN.md section 3), checked on ONNX graphs.

One implementation, used by both checkers of exported graphs: :func:`export.validate.check_graphs`
(after every export; a problem is a :class:`export.GraphContractError`) and
:func:`export.trt_readiness.check_model` (before a TensorRT build; a problem is listed in the
readiness report). The rules:

* inputs and outputs as :func:`transformer_ext.export_format.graph_specs` states them (names,
  order, dtypes, named axes), no zero-length dimension;
* one graph for every step: no control flow (``If``, ``Loop``, ``Scan``), no sequence ops, no
  graph-valued attribute, no model-local function, only default-domain ONNX ops (a custom op
  would need a TensorRT plugin), except in the ``ort`` flavour ONNX Runtime's
  ``com.microsoft.GroupQueryAttention`` and in the ``custom-op`` flavour the folder library's
  ``transformer_ext.DecodeAttention``;
* every ``TensorScatter`` writes a 4-D cache that is a graph input read by no other node, in
  ``linear`` mode, with the literal ``axis=-2`` (the only spelling TensorRT's parser accepts),
  into a graph output;
* the self-attention caches (``self_key.{i}``, ``self_value.{i}``) are read only by that
  ``TensorScatter`` in the ``tensorscatter`` flavour, only by one ``GroupQueryAttention`` (as its
  past key / value, its present key / value a graph output) in the ``ort`` flavour, only by one
  ``DecodeAttention`` (as its ``k_cache`` / ``v_cache``) or ``Shape`` in the ``custom-op`` flavour, and in the
  portable flavour only by ``MatMul`` (keys through a ``Transpose``) or ``Shape``, never copied
  (``Concat``).

Also here: dtype names of ONNX element types (from ``onnx.helper``) and a graph's inputs and
outputs in the manifest's ``{"name", "dtype", "shape"}`` form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import onnx
from onnx import helper, numpy_helper

from transformer_ext.export_format import CUSTOM_OP_DOMAIN as _CUSTOM_OP_DOMAIN
from transformer_ext.export_format import CUSTOM_OP_FLAVOUR, io_problems
from transformer_ext.export_format import CUSTOM_OP_TYPE as _CUSTOM_OP_TYPE

__all__ = [
    "FORBIDDEN_OPS",
    "ContractProblem",
    "GraphIndex",
    "onnx_dtype_name",
    "tensor_dims",
    "value_info",
    "graph_io",
    "tensor_scatter_problems",
    "contract_problems",
    "graph_flavour",
    "is_gqa",
]

FORBIDDEN_OPS = frozenset(
    {
        "If",
        "Loop",
        "Scan",
        "SequenceConstruct",
        "SequenceInsert",
        "SequenceAt",
        "SequenceEmpty",
        "SequenceErase",
        "SequenceLength",
        "SplitToSequence",
        "ConcatFromSequence",
    }
)
DEFAULT_DOMAINS = ("", "ai.onnx")
# The ort flavour's one contrib operator (export.lowering traces it).
GQA_DOMAIN, GQA_OP_TYPE = "com.microsoft", "GroupQueryAttention"
# The custom-op flavour's operator, of the export folder's own library (csrc/ort/).
CUSTOM_OP_DOMAIN, CUSTOM_OP_TYPE = _CUSTOM_OP_DOMAIN, _CUSTOM_OP_TYPE


def is_custom_attention(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is the custom-op flavour's ``transformer_ext.DecodeAttention``."""
    return node.domain == CUSTOM_OP_DOMAIN and node.op_type == CUSTOM_OP_TYPE


def is_gqa(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is ONNX Runtime's ``com.microsoft.GroupQueryAttention``."""
    return node.domain == GQA_DOMAIN and node.op_type == GQA_OP_TYPE


def onnx_dtype_name(elem_type: int) -> str:
    """numpy's name of an ONNX element type (``onnx.helper.tensor_dtype_to_np_dtype``):
    ``"float32"``, ``"bfloat16"``...; ``"undefined"`` for 0, ``"onnx:<n>"`` for a value ONNX does not know."""
    if not elem_type:
        return "undefined"
    try:
        name = helper.tensor_dtype_to_np_dtype(int(elem_type)).name
    except (KeyError, ValueError, TypeError):
        return f"onnx:{int(elem_type)}"
    if name == "object":  # strings
        return onnx.TensorProto.DataType.Name(int(elem_type)).lower()
    return name


def tensor_dims(type_proto: onnx.TypeProto) -> Optional[list]:
    """The dims of a tensor type: ints, axis names, ``None`` for an unnamed dynamic axis;
    ``None`` when the rank is unknown."""
    if not type_proto.HasField("tensor_type") or not type_proto.tensor_type.HasField("shape"):
        return None
    dims: list = []
    for d in type_proto.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param:
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return dims


def value_info(v: onnx.ValueInfoProto) -> dict:
    """``{"name", "dtype", "shape"}`` of a graph input/output; a shape entry is an int, an axis
    name, or ``None`` (dynamic without a name); ``shape`` is ``None`` when the rank is unknown."""
    return {
        "name": v.name,
        "dtype": onnx_dtype_name(v.type.tensor_type.elem_type),
        "shape": tensor_dims(v.type),
    }


def graph_io(model: onnx.ModelProto) -> tuple[list[dict], list[dict]]:
    """The graph's inputs (those a runtime binds: initializers excluded) and outputs, in order."""
    inits = {t.name for t in model.graph.initializer}
    inputs = [value_info(v) for v in model.graph.input if v.name not in inits]
    return inputs, [value_info(v) for v in model.graph.output]


@dataclass(frozen=True)
class ContractProblem:
    """One broken rule: ``kind`` (io, zero_dim, control_flow, custom_domain, op_restriction,
    cache_aliasing, cache_read), what is wrong, and the node, if one is to blame."""

    kind: str
    message: str
    node: Optional[str] = None


class GraphIndex:
    """Producers, consumers, initializers and (with an inferred model) types and shapes of a graph's tensors."""

    def __init__(self, model: onnx.ModelProto, inferred: Optional[onnx.ModelProto] = None):
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
        source = inferred if inferred is not None else model
        for vi in list(source.graph.value_info) + list(source.graph.input) + list(source.graph.output):
            if vi.type.HasField("tensor_type"):
                if vi.type.tensor_type.elem_type:
                    self.types[vi.name] = vi.type.tensor_type.elem_type
                dims = tensor_dims(vi.type)
                if dims is not None:
                    self.shapes[vi.name] = tuple(dims)
        for t in g.initializer:
            self.types[t.name] = t.data_type
            self.shapes[t.name] = tuple(int(d) for d in t.dims)

    def is_constant(self, name: str) -> bool:
        """An initializer or the output of a Constant node (what a parser turns into weights)."""
        if name in self.initializers:
            return True
        prod = self.producers.get(name)
        return prod is not None and prod.op_type == "Constant"

    def is_constant_foldable(self, name: str, depth: int = 0) -> bool:
        """Computed only from constants and tensor shapes (a parser folds such subgraphs)."""
        if self.is_constant(name):
            return True
        prod = self.producers.get(name)
        if prod is None or depth > 32:
            return False
        if prod.op_type in ("Shape", "Size"):
            return True
        return all(self.is_constant_foldable(i, depth + 1) for i in prod.input if i)

    def constant_value(self, name: str) -> Any:
        """The value of an initializer or Constant output, else ``None``."""
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        prod = self.producers.get(name)
        if prod is not None and prod.op_type == "Constant":
            for a in prod.attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t)
                if a.name in ("value_int", "value_float", "value_ints", "value_floats"):
                    return helper.get_attribute_value(a)
        return None


def _label(node: onnx.NodeProto, index: int) -> str:
    return node.name or f"#{index} {node.op_type}"


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def tensor_scatter_problems(node: onnx.NodeProto, g: GraphIndex) -> list[str]:
    """What breaks the ``TensorScatter`` rule in this node (empty: nothing)."""
    out = []
    axis = _attr(node, "axis", None)
    if axis != -2:
        out.append(
            f"`axis` must be the literal -2 (the only spelling TensorRT's parser accepts), got "
            f"{'no axis attribute (the ONNX default)' if axis is None else f'axis={axis}'}"
        )
    mode = _attr(node, "mode", b"linear")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode != "linear":
        out.append(f"`mode` must be 'linear' (TensorRT's KV-cache update supports only linear), got {mode!r}")
    for i, what in ((0, "past_cache"), (1, "update")):
        name = node.input[i] if len(node.input) > i else ""
        shape = g.shapes.get(name)
        if shape is not None and len(shape) != 4:
            out.append(f"`{what}` ({name!r}) must be 4-D, got rank {len(shape)}")
    cache = node.input[0] if node.input else ""
    if cache and cache not in g.graph_inputs:
        out.append(
            f"`past_cache` ({cache!r}) must be a graph input: the cache is updated in the buffer the "
            "runtime binds"
        )
    elif cache:
        others = [
            n.name or n.op_type for n in g.consumers.get(cache, []) if list(n.output) != list(node.output)
        ]
        if others:
            out.append(
                f"cache input {cache!r} is also read by {others}: with the cache updated in place, only "
                "the TensorScatter may read it"
            )
    present = node.output[0] if node.output else ""
    if present and present not in g.graph_outputs:
        out.append(f"the updated cache {present!r} must be a graph output (it aliases the input buffer)")
    return out


def _cache_problems(name: str, g: GraphIndex, flavour: str) -> list[ContractProblem]:
    users = g.consumers.get(name, [])
    if flavour == CUSTOM_OP_FLAVOUR:
        attends = [u for u in users if is_custom_attention(u) and list(u.input).index(name) in (1, 2)]
        others = [u for u in users if u not in attends and u.op_type != "Shape"]
        if len(attends) != 1 or others:
            return [
                ContractProblem(
                    "cache_read",
                    f"{name} must be read by exactly one DecodeAttention node, as its k_cache (1) or "
                    f"v_cache (2), and otherwise only by Shape (found {[u.op_type for u in users]})",
                )
            ]
        return []
    if flavour == "ort":
        if len(users) != 1 or not is_gqa(users[0]):
            return [
                ContractProblem(
                    "cache_aliasing",
                    f"{name} must be read by exactly one GroupQueryAttention node "
                    f"(found {[u.op_type for u in users]})",
                )
            ]
        node = users[0]
        slot = list(node.input).index(name)
        if slot not in (3, 4):
            return [
                ContractProblem(
                    "cache_aliasing",
                    f"{name} is GroupQueryAttention input {slot}, expected past_key (3) or past_value (4)",
                    node.name or None,
                )
            ]
        present = node.output[slot - 2] if len(node.output) > slot - 2 else ""
        if present not in g.graph_outputs:
            return [
                ContractProblem(
                    "cache_aliasing",
                    f"the updated cache of {name} ({present!r}) must be a graph output (it aliases the input buffer)",
                    node.name or None,
                )
            ]
        return []
    if flavour == "tensorscatter":
        if len(users) != 1 or users[0].op_type != "TensorScatter":
            return [
                ContractProblem(
                    "cache_aliasing",
                    f"{name} must be read by exactly one TensorScatter node "
                    f"(found {[u.op_type for u in users]})",
                )
            ]
        return []
    problems = []
    for u in users:
        if u.op_type == "Transpose":
            later = {c.op_type for out in u.output for c in g.consumers.get(out, [])}
            if not later <= {"MatMul"}:
                problems.append(
                    ContractProblem(
                        "cache_read",
                        f"the transposed {name} feeds {sorted(later)}, expected MatMul only",
                        u.name or None,
                    )
                )
        elif u.op_type not in ("MatMul", "Shape"):
            problems.append(
                ContractProblem(
                    "cache_read",
                    f"{name} is read by a {u.op_type} node (expected MatMul, Transpose->MatMul, Shape)",
                    u.name or None,
                )
            )
    return problems


def graph_flavour(model: onnx.ModelProto, outputs: Optional[list[dict]] = None) -> str:
    """The flavour a decoder step graph was exported in, read off the graph: ``"ort"`` when it
    holds a ``GroupQueryAttention``, ``"tensorscatter"`` when it returns ``present_*`` caches,
    else ``"portable"`` (an encoder reads as ``"portable"``)."""
    if any(is_gqa(n) for n in model.graph.node):
        return "ort"
    if any(is_custom_attention(n) for n in model.graph.node):
        return CUSTOM_OP_FLAVOUR
    names = [o["name"] for o in outputs] if outputs is not None else [o.name for o in model.graph.output]
    return "tensorscatter" if any(n.startswith("present_") for n in names) else "portable"


def contract_problems(
    model: onnx.ModelProto,
    spec: Optional[Mapping[str, Any]] = None,
    flavour: Optional[str] = None,
    index: Optional[GraphIndex] = None,
    *,
    compare_dtypes: bool = True,
) -> list[ContractProblem]:
    """Every broken rule of the module docstring in ``model``.

    ``spec``: the graph's entry of :func:`graph_specs` (inputs and outputs are compared with it
    when given; ``compare_dtypes=False`` for graphs converted to another precision). ``flavour``:
    which cache rule applies to the ``self_*`` inputs, and whether ``GroupQueryAttention`` is
    allowed (``"ort"``); default: :func:`graph_flavour` for the cache rule, and no contrib
    operator allowed (what TensorRT's readiness check needs). ``index``: a :class:`GraphIndex` of
    ``model`` if one exists.
    """
    g = index or GraphIndex(model)
    problems: list[ContractProblem] = []
    inputs, outputs = graph_io(model)
    if spec is not None:
        problems += [
            ContractProblem("io", p)
            for p in io_problems(spec, inputs, outputs, compare_dtypes=compare_dtypes)
        ]
    for kind, tensors in (("input", inputs), ("output", outputs)):
        for t in tensors:
            if t["shape"] and any(d == 0 for d in t["shape"]):
                problems.append(
                    ContractProblem(
                        "zero_dim",
                        f"{kind} {t['name']!r} has a zero-length dimension "
                        f"{t['shape']} (no zero-length past, no empty first step)",
                    )
                )
    if len(model.functions):
        problems.append(
            ContractProblem(
                "custom_domain",
                f"model-local functions {[f.name for f in model.functions]} (expected plain nodes)",
            )
        )
    for i, node in enumerate(model.graph.node):
        label = _label(node, i)
        if node.domain not in DEFAULT_DOMAINS:
            if flavour == "ort" and is_gqa(node):
                continue  # the ort flavour's one contrib operator
            if flavour == CUSTOM_OP_FLAVOUR and is_custom_attention(node):
                continue  # the custom-op flavour's operator
            problems.append(
                ContractProblem(
                    "custom_domain",
                    f"{node.domain}::{node.op_type} is not a standard ONNX op (every custom op must be "
                    "lowered to standard ops; TensorRT would need a plugin)",
                    label,
                )
            )
        elif node.op_type in FORBIDDEN_OPS:
            problems.append(
                ContractProblem(
                    "control_flow",
                    f"{node.op_type} node: control flow and sequences are forbidden in the exported "
                    "graphs (one decoder graph for every step)",
                    label,
                )
            )
        elif any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            problems.append(ContractProblem("control_flow", f"{node.op_type} node holds a subgraph", label))
        elif node.op_type == "TensorScatter":
            problems += [
                ContractProblem("op_restriction", f"TensorScatter: {m}", label)
                for m in tensor_scatter_problems(node, g)
            ]
    if flavour is None:
        flavour = graph_flavour(model, outputs)
    for t in inputs:
        if t["name"].startswith(("self_key.", "self_value.")):
            problems += _cache_problems(t["name"], g, flavour)
    return problems
