"""ONNX translations of the ``transformer_ext`` custom ops, written in onnxscript.

Each function here is a ``custom_translation_table`` entry for ``torch.onnx.export(dynamo=True)``:
the exporter calls it with symbolic ONNX values and records the standard ONNX ops it emits, so
the exported graphs run on ONNX Runtime (CPU/CUDA) and TensorRT without plugins.

* :func:`masked_softmax` -> ``Where`` / ``Softmax`` / ``Where`` (bool mask and/or a causal mask
  built from ``Range`` + ``LessOrEqual``; fully masked rows become zeros, never NaN).
* :func:`decode_attention` -> a ``MatMul`` for the scores over the cache (``q . K_cache^T``)
  and ``Mul`` + ``ReduceSum`` for the new token's own score (``q . k_new``), concatenated (the
  cache tensors never are); cache entries at or beyond ``lengths[b]`` get an additive ``-inf``
  bias built from one bool comparison (``Range(L) < lengths``), then ``Softmax``, a ``MatMul``
  over the cached values and a ``Mul`` for the new value.
* :func:`kv_cache_update` (the functional twin of ``kv_cache_append_``, registered here as the
  custom op ``transformer_ext_export::kv_cache_update``) -> opset-24 ``TensorScatter`` with
  the literal ``axis=-2``, for the ``tensorscatter`` flavour.

:func:`in_graph_cache_update` is the context manager the ``tensorscatter`` export traces under:
it routes the decoder self-attention's ``decode_attention(q, cache, cache, positions, scale,
k_new, v_new)`` call through ``kv_cache_update`` so that the attention reads the updated cache
(``positions[b]`` inclusive), and collects the updated caches as graph outputs.
:func:`position_bias_in_graph` routes a decode attention with T5's relative position bias to
:func:`decode_attention_bias_op`, lowered by :func:`decode_attention_tabled`: the bias read from
its table per step and added to the scores. :func:`in_graph_gqa` is the ``ort`` flavour's: the same call becomes one
``com.microsoft.GroupQueryAttention`` node, which appends the new K/V to the caches and attends
over them. :func:`in_graph_custom_attention` is the ``custom-op`` flavour's: the self- and
cross-attention each become one ``transformer_ext.DecodeAttention`` node of the folder's own
operator library. The model code traced is the same ``Transformer.decode_step`` that eager decoding runs.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Optional

import onnxscript
import torch
from onnxscript import ir
from onnxscript import opset18 as op

from transformer_ext import ops

from . import GraphContractError, contract

logger = logging.getLogger(__name__)

__all__ = [
    "masked_softmax",
    "decode_attention",
    "kv_cache_update",
    "kv_cache_update_op",
    "decode_attention_bias_op",
    "decode_attention_tabled",
    "position_bias_in_graph",
    "translation_table",
    "in_graph_cache_update",
    "in_graph_gqa",
    "in_graph_custom_attention",
    "CustomAttentionTrace",
    "GQA_OP",
    "CUSTOM_ATTENTION_OP",
    "share_shape_reads",
    "fuse_shared_input_matmuls",
    "flatten_rows",
]

# TensorScatter exists from opset 24 on; onnxscript ships no opset24 module.
op24 = onnxscript.values.Opset("", 24)

# The ort flavour's one contrib operator: (domain, op_type).
GQA_OP = (contract.GQA_DOMAIN, contract.GQA_OP_TYPE)
# The custom-op flavour's operator, of the folder's own library: (domain, op_type).
CUSTOM_ATTENTION_OP = (contract.CUSTOM_OP_DOMAIN, contract.CUSTOM_OP_TYPE)

_NEG_INF = float("-inf")
_INT64_MAX = 2**63 - 1


# ------------------------------------------------------------------------------------------
# helpers (all run at trace time, emitting nodes)
# ------------------------------------------------------------------------------------------


def _to_float(x):
    """Cast to float32 unless it already is (no node for float32 inputs)."""
    if x.dtype == ir.DataType.FLOAT:
        return x
    return op.Cast(x, to=ir.DataType.FLOAT)


def _like(x, ref):
    """Cast ``x`` back to the dtype of ``ref`` unless it already has it."""
    if ref.dtype == ir.DataType.FLOAT:
        return x
    return op.CastLike(x, ref)


def _scalar(value: float):
    return op.Constant(value_float=float(value))


def _scaled(x, scale: float):
    """``x * scale``; ``x`` itself for scale 1 (an export whose queries carry the scale,
    :func:`export.onnx.folded_query_scale`), so no ``Mul`` is left for ONNX Runtime to fuse into a
    ``FusedMatMul`` alpha."""
    return x if scale == 1.0 else op.Mul(x, _scalar(scale))


def _dim(x, axis: int):
    """``x.shape[axis]`` as a 1-D int64 tensor of one element."""
    return op.Shape(x, start=axis, end=axis + 1)


def _key_positions(cache):
    """``Range(0, L)`` over the key axis (-2) of a ``[B, H, L, D]`` cache, int64 ``[L]``."""
    length = op.Squeeze(_dim(cache, 2), op.Constant(value_ints=[0]))
    return op.Range(op.Constant(value_int=0), length, op.Constant(value_int=1))


# ------------------------------------------------------------------------------------------
# translations
# ------------------------------------------------------------------------------------------


def masked_softmax(scores, mask=None, scale: float = 1.0, causal: bool = False):
    """``transformer_ext::masked_softmax(scores [B,H,Q,K], mask?, scale, causal)`` in standard ops.

    Softmax of ``scale * scores`` over the allowed keys, in float32, returned in the input dtype;
    a row with no allowed key is zeros (``Where`` after the ``Softmax`` replaces its NaNs).
    """
    x = _scaled(_to_float(scores), scale)
    allowed = mask
    if causal:
        q_len = _dim(scores, 2)
        k_len = _dim(scores, 3)
        zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
        i = op.Range(zero, op.Squeeze(q_len, op.Constant(value_ints=[0])), one)  # [Q]
        j = op.Range(zero, op.Squeeze(k_len, op.Constant(value_ints=[0])), one)  # [K]
        offset = op.Sub(k_len, q_len)  # [1]: bottom-right alignment
        causal_mask = op.LessOrEqual(
            op.Unsqueeze(j, op.Constant(value_ints=[0])),  # [1, K]
            op.Unsqueeze(op.Add(i, offset), op.Constant(value_ints=[1])),  # [Q, 1]
        )  # [Q, K]
        allowed = causal_mask if allowed is None else op.And(allowed, causal_mask)
    if allowed is None:
        return _like(op.Softmax(x, axis=-1), scores)
    x = op.Where(allowed, x, _scalar(_NEG_INF))
    probs = op.Where(allowed, op.Softmax(x, axis=-1), _scalar(0.0))
    return _like(probs, scores)


def decode_attention(q, k_cache, v_cache, lengths, scale: float, k_new=None, v_new=None, position_bias=None):
    """``transformer_ext::decode_attention`` in standard ops.

    ``q [B,H,1,D]``, caches ``[B,H,L,D]``, ``lengths`` int64 ``[B]``, optional ``k_new``/``v_new``
    ``[B,H,1,D]``. The new token's score is concatenated to the cache scores (``[B,H,1,L+1]``);
    the caches themselves are only read by two ``MatMul`` s. Cache entries at or past
    ``lengths[b]`` get zero weight (the caller keeps them finite: 0 * NaN is NaN).
    ``position_bias`` (T5's relative bias, :func:`decode_attention_tabled`): float32
    ``[B,H,1,L+1]`` with ``k_new`` (``[B,H,1,L]`` without), added to the scaled scores.
    Scores and weights are float32; the output has the dtype of ``q``.
    """
    # [B, H, 1, L]: the scores over the cache, masked by position with one bool comparison turned
    # into an additive bias [B, 1, 1, L]. The mask and the bias depend only on the cache length and
    # ``lengths``, so every layer's are the same subgraph and ONNX Runtime computes them once per
    # step; adding a broadcast bias costs less than a ``Where`` over the scores.
    scores = _scaled(_to_float(op.MatMul(q, op.Transpose(k_cache, perm=[0, 1, 3, 2]))), scale)
    allowed = op.Less(_key_positions(k_cache), op.Reshape(lengths, op.Constant(value_ints=[-1, 1, 1, 1])))
    scores = op.Add(scores, op.Where(allowed, _scalar(0.0), _scalar(_NEG_INF)))
    if k_new is None:
        # Cross-attention (or any prefix-only call): a row with no key is all zeros.
        if position_bias is not None:
            scores = op.Add(scores, _to_float(position_bias))
        probs = op.Where(allowed, op.Softmax(scores, axis=-1), _scalar(0.0))
        return op.MatMul(_like(probs, q), v_cache)
    # [B, H, 1, 1]: the new token's own score, appended to the scores (not to the cache). An
    # elementwise product summed over D: as a MatMul it would be B * H one-by-one products, which
    # cost ONNX Runtime several times more at batch size.
    s_new = op.ReduceSum(op.Mul(_to_float(q), _to_float(k_new)), op.Constant(value_ints=[-1]), keepdims=1)
    s_new = _scaled(s_new, scale)  # [B, H, 1, 1]
    scores = op.Concat(scores, s_new, axis=-1)  # [B, H, 1, L + 1]
    if position_bias is not None:
        scores = op.Add(scores, _to_float(position_bias))
    probs = op.Softmax(scores, axis=-1)
    axis = op.Constant(value_ints=[3])
    p_cache = op.Slice(probs, op.Constant(value_ints=[0]), _dim(k_cache, 2), axis)  # [B, H, 1, L]
    p_new = op.Slice(probs, op.Constant(value_ints=[-1]), op.Constant(value_ints=[_INT64_MAX]), axis)
    out = op.Add(op.MatMul(_like(p_cache, q), v_cache), op.Mul(_like(p_new, q), v_new))
    return out  # [B, H, 1, D]


def kv_cache_update(cache, update, positions):
    """``transformer_ext_export::kv_cache_update`` -> ``TensorScatter`` (opset 24, linear mode).

    ``cache [B,H,L,D]``, ``update [B,H,T,D]``, ``positions`` int64 ``[B]``: the updated cache with
    ``update[b]`` at ``positions[b] .. positions[b]+T-1`` of axis -2. The literal ``axis=-2`` is
    the spelling TensorRT's parser accepts. No skip and no range check (the runner guarantees
    valid positions, docs/DESIGN.md section 3).
    """
    return op24.TensorScatter(cache, update, positions, axis=-2, mode="linear")


# ------------------------------------------------------------------------------------------
# the functional cache update as a torch op (traced by the tensorscatter export)
# ------------------------------------------------------------------------------------------


@torch.library.custom_op("transformer_ext_export::kv_cache_update", mutates_args=())
def kv_cache_update_op(cache: torch.Tensor, update: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Functional ``kv_cache_append_``: a copy of ``cache`` with ``update`` written at ``positions``."""
    out = cache.clone()
    ops.kv_cache_append_(out, update, positions)
    return out


@kv_cache_update_op.register_fake
def _kv_cache_update_fake(cache, update, positions):
    if cache.dim() != 4 or update.dim() != 4:
        raise RuntimeError("cache and update must have 4 dimensions")
    return torch.empty_like(cache)


# The eager decode attention, whatever the tracing contexts below put in its place.
_eager_decode_attention = ops.decode_attention


@torch.library.custom_op("transformer_ext_export::decode_attention_tabled", mutates_args=())
def decode_attention_bias_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    k_new: Optional[torch.Tensor],
    v_new: Optional[torch.Tensor],
    table: torch.Tensor,
    positions: torch.Tensor,
    offset: int,
) -> torch.Tensor:
    """``ops.decode_attention`` with a relative position bias read from ``table [R, H]``: key ``j``
    of the cache gets row ``j - positions[b] + offset``, the new key (with ``k_new``) row
    ``offset``. One op of the traced graph, lowered by :func:`decode_attention_tabled`: what
    :func:`position_bias_in_graph` routes the biased calls to."""
    B, L = q.shape[0], k_cache.shape[2]
    index = torch.arange(L, device=q.device).view(1, L) - positions.view(B, 1) + offset  # [B, L]
    if k_new is not None:
        index = torch.cat([index, torch.full_like(index[:, :1], offset)], 1)
    bias = table[index].permute(0, 2, 1).unsqueeze(2)  # [B, H, 1, L (+ 1)]
    return _eager_decode_attention(q, k_cache, v_cache, lengths, scale, k_new, v_new, bias)


@decode_attention_bias_op.register_fake
def _decode_attention_bias_fake(q, k_cache, v_cache, lengths, scale, k_new, v_new, table, positions, offset):
    return torch.empty_like(q)


def decode_attention_tabled(
    q,
    k_cache,
    v_cache,
    lengths,
    scale: float,
    k_new=None,
    v_new=None,
    table=None,
    positions=None,
    offset: int = 0,
):
    """``transformer_ext_export::decode_attention_tabled`` in standard ops: the bias
    ``[B, H, 1, L (+ 1)]`` gathered from ``table`` at ``Range(L) - positions + offset`` (``L`` the
    length of the cache read, from its shape) and, for the new key, at ``offset``; then
    :func:`decode_attention` with it."""
    keys = op.Unsqueeze(_key_positions(k_cache), op.Constant(value_ints=[0]))  # [1, L]
    queries = op.Unsqueeze(positions, op.Constant(value_ints=[1]))  # [B, 1]
    shift = op.Constant(value_int=int(offset))
    index = op.Add(op.Sub(keys, queries), shift)  # [B, L]
    if k_new is not None:  # the new key: relative position 0
        index = op.Concat(index, op.Add(op.Mul(queries, op.Constant(value_int=0)), shift), axis=1)
    bias = op.Unsqueeze(
        op.Transpose(op.Gather(table, index, axis=0), perm=[0, 2, 1]), op.Constant(value_ints=[2])
    )
    return decode_attention(q, k_cache, v_cache, lengths, scale, k_new, v_new, position_bias=bias)


@contextlib.contextmanager
def position_bias_in_graph() -> Iterator[None]:
    """Trace ``decode_step`` with its biased decode attention as one lowered op.

    Inside the context, ``ops.decode_attention(..., position_bias)`` (T5's self-attention, with
    the relative bias of :mod:`export.position_bias`) is traced as
    :func:`decode_attention_bias_op`, whose lowering reads the caches as the unbiased one does
    (``MatMul`` s only, never a ``Concat``) and adds the bias to the scores. Calls without a bias
    reach whatever ``ops.decode_attention`` was before. Enter it before a flavour's own context
    (:func:`in_graph_cache_update`), whose calls then come here.
    """
    original = ops.decode_attention

    def decode_attention_routed(
        q, k_cache, v_cache, lengths, scale, k_new=None, v_new=None, position_bias=None
    ):
        if position_bias is None:
            return original(q, k_cache, v_cache, lengths, scale, k_new, v_new)
        if not hasattr(position_bias, "table"):
            raise GraphContractError(
                "a decode attention's position bias is exported as a table read per step: trace the model "
                "under export.position_bias.tabled_relative_bias"
            )
        table, positions, offset = position_bias.table(), position_bias.positions, position_bias.offset
        return decode_attention_bias_op(
            q, k_cache, v_cache, lengths, float(scale), k_new, v_new, table, positions, int(offset)
        )

    ops.decode_attention = decode_attention_routed
    try:
        yield
    finally:
        ops.decode_attention = original


def translation_table(flavour: str = "portable") -> dict:
    """The ``custom_translation_table`` for ``torch.onnx.export`` of the given flavour."""
    table = {
        torch.ops.transformer_ext.masked_softmax.default: masked_softmax,
        torch.ops.transformer_ext.decode_attention.default: decode_attention,
        torch.ops.transformer_ext_export.decode_attention_tabled.default: decode_attention_tabled,
    }
    if flavour == "tensorscatter":
        table[torch.ops.transformer_ext_export.kv_cache_update.default] = kv_cache_update
    return table


def share_shape_reads(model) -> int:
    """Graph pass: every ``Shape`` of a graph input reads the first input declared with the same
    shape instead.

    The decoder step reads the length of each layer's cache (``Shape(self_key.i)``) to build that
    layer's key mask; the contract declares every cache ``[batch, H, cache_len, d_k]`` (and every
    cross K/V ``[batch, H, src_len, d_k]``), so those shapes are equal by construction. Reading one
    input's shape makes the per-layer mask subgraphs identical, and ONNX Runtime's
    common-subexpression elimination then computes each mask once per step instead of once per
    layer (about 40 fewer nodes in a 6-layer decoder). Inputs whose shape is not fully declared
    (a dimension with neither a value nor a name) are left alone. Works in place on an
    ``onnx.ModelProto``; returns the number of ``Shape`` nodes rewired.
    """

    def declared(value_info):
        t = value_info.type.tensor_type
        if not t.HasField("shape"):
            return None
        dims = []
        for d in t.shape.dim:
            if d.HasField("dim_value"):
                dims.append(("value", d.dim_value))
            elif d.HasField("dim_param") and d.dim_param:
                dims.append(("name", d.dim_param))
            else:
                return None
        return t.elem_type, tuple(dims)

    first_with: dict = {}
    canonical: dict[str, str] = {}
    for value_info in model.graph.input:
        key = declared(value_info)
        if key is not None:
            canonical[value_info.name] = first_with.setdefault(key, value_info.name)
    rewired = 0
    for node in model.graph.node:
        if node.op_type == "Shape" and node.domain in ("", "ai.onnx") and node.input:
            target = canonical.get(node.input[0])
            if target is not None and target != node.input[0]:
                node.input[0] = target
                rewired += 1
    logger.debug("share_shape_reads: %d Shape nodes rewired", rewired)
    return rewired


def fuse_shared_input_matmuls(model) -> int:
    """Graph pass: merge ``MatMul`` s that read the same input with constant weights into one.

    ``x @ W_q + b_q``, ``x @ W_k + b_k``, ``x @ W_v + b_v`` (the Q/K/V projections of a layer; in
    the encoder, the cross-attention K/V projections of every decoder layer, which all read the
    encoder output) become ``Split(x @ [W_q | W_k | W_v] + [b_q | b_k | b_v])``: one larger
    matrix product instead of several, so fewer passes over ``x`` and fewer thread-pool rounds per
    step. Weights are moved, not copied (each is still stored once), and the outputs keep their
    names. Only weights read by no other node are merged; bias ``Add`` s are merged when every
    member of the group has one. Works in place on an ``onnx.ModelProto``; returns the number of
    groups merged.
    """
    import collections

    import numpy as np
    from onnx import helper, numpy_helper

    g = model.graph
    inits = {t.name: t for t in g.initializer}
    consumers = collections.defaultdict(list)
    for node in g.node:
        for name in node.input:
            consumers[name].append(node)
    outputs = {o.name for o in g.output}

    def constant_matrix(name):
        t = inits.get(name)
        return t is not None and len(t.dims) == 2 and len(consumers[name]) == 1 and name not in outputs

    groups = collections.defaultdict(list)  # (input, K) -> [(matmul, bias add or None)]
    for node in g.node:
        if node.op_type != "MatMul" or not constant_matrix(node.input[1]) or node.output[0] in outputs:
            continue
        users = consumers[node.output[0]]
        add = users[0] if len(users) == 1 and users[0].op_type == "Add" else None
        if add is not None and not (
            add.input[0] == node.output[0]
            and add.input[1] in inits
            and len(inits[add.input[1]].dims) == 1
            and len(consumers[add.input[1]]) == 1
        ):
            add = None
        groups[(node.input[0], inits[node.input[1]].dims[0])].append((node, add))

    replace: dict[int, list] = {}
    dropped_nodes: set[int] = set()
    dropped_inits: set[str] = set()
    new_inits = []
    for (x, _), members in groups.items():
        if len(members) < 2:
            continue
        with_bias = all(add is not None for _, add in members)
        dtype = {inits[mm.input[1]].data_type for mm, _ in members}
        if len(dtype) != 1:
            continue
        first = members[0][0]
        prefix = f"{first.name or first.output[0]}_fused"
        weights = [numpy_helper.to_array(inits[mm.input[1]]) for mm, _ in members]
        new_inits.append(numpy_helper.from_array(np.concatenate(weights, axis=1), f"{prefix}.weight"))
        new_inits.append(
            numpy_helper.from_array(np.array([w.shape[1] for w in weights], np.int64), f"{prefix}.split")
        )
        nodes = [
            helper.make_node("MatMul", [x, f"{prefix}.weight"], [f"{prefix}.matmul"], name=f"{prefix}_MatMul")
        ]
        result = f"{prefix}.matmul"
        if with_bias:
            biases = [numpy_helper.to_array(inits[add.input[1]]) for _, add in members]
            new_inits.append(numpy_helper.from_array(np.concatenate(biases, axis=0), f"{prefix}.bias"))
            nodes.append(
                helper.make_node("Add", [result, f"{prefix}.bias"], [f"{prefix}.add"], name=f"{prefix}_Add")
            )
            result = f"{prefix}.add"
        split_outputs = [(add.output[0] if with_bias else mm.output[0]) for mm, add in members]
        nodes.append(
            helper.make_node(
                "Split", [result, f"{prefix}.split"], split_outputs, axis=-1, name=f"{prefix}_Split"
            )
        )
        replace[id(first)] = nodes
        for mm, add in members:
            dropped_nodes.add(id(mm))
            dropped_inits.add(mm.input[1])
            if with_bias:
                dropped_nodes.add(id(add))
                dropped_inits.add(add.input[1])
    if not replace:
        return 0
    new_nodes = []
    for node in g.node:  # the fused nodes take the place of the group's first MatMul
        new_nodes += replace.get(id(node), [])
        if id(node) not in dropped_nodes:
            new_nodes.append(node)
    del g.node[:]
    g.node.extend(new_nodes)
    kept = [t for t in g.initializer if t.name not in dropped_inits]
    del g.initializer[:]
    g.initializer.extend(kept + new_inits)
    logger.debug("fused %d groups of MatMuls sharing an input", len(replace))
    return len(replace)


# Ops that act on each row of a [batch, T, F] tensor alone (with rank <= 1 constants), so they give
# the same values on [batch * T, F]: what flatten_rows moves to two dimensions.
_ROW_OPS = frozenset(
    {
        "MatMul",
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Relu",
        "Sigmoid",
        "Erf",
        "Tanh",
        "Pow",
        "Sqrt",
        "Reciprocal",
        "ReduceMean",
        "LayerNormalization",
        "Split",
        "Cast",
    }
)


def flatten_rows(model) -> int:
    """Graph pass: the per-row part of a graph runs on ``[rows, F]`` instead of ``[batch, T, F]``.

    The rows are those of the graph's first input, ``[batch, T]`` token ids: in the decoder step
    ``T`` is 1 (one token per row), in the encoder it is the named source axis. Every op that
    treats each row alone (``_ROW_OPS`` with constant weights, biases and norms: the projections,
    feed-forward, residuals and layer norms, ``LayerNormalization`` or an RMS norm's ``Pow``,
    ``ReduceMean`` over the last axis, ``Sqrt`` and ``Div``) gives the same values on ``[batch * T, F]``, since
    that is the same memory read in the same order. On two dimensions ONNX Runtime fuses each
    ``MatMul`` + bias ``Add`` into one ``Gemm`` (and the ``Relu`` after it into that ``Gemm``), and
    leaves the residual ``Add`` + ``LayerNormalization`` unfused (its ``SkipLayerNormalization``
    CPU kernel is the slower one, see ``transformer_ext.runtimes.ort.DISABLED_OPTIMIZERS``).
    Where a 3-D value enters, a ``Reshape`` with a constant target now targets ``[-1, F]`` (or one
    is added); where a 2-D value leaves, a ``Reshape`` with a constant target reads it as it is;
    in the decoder step the ``Gather`` of row 0 on axis 1 (the ``x[:, 0]`` before the output
    projection) is dropped; any other reader gets the 3-D value back through a ``Reshape`` (to
    ``[-1, 1, F]``, or in the encoder to the first input's shape followed by ``F``). The
    attention itself (scores over ``T``) stays as it is. Graph inputs and outputs keep their
    names and shapes. Needs ``onnx.shape_inference`` to know the shapes (values it cannot type
    are left alone). Works in place on an ``onnx.ModelProto``; returns the number of nodes moved
    to two dimensions.
    """
    g = model.graph
    shapes = _value_shapes(model)
    first_input = shapes.get(g.input[0].name) if g.input else None
    if not first_input or len(first_input) < 2 or not isinstance(first_input[0], str):
        return 0
    batch, steps = first_input[:2]  # the named batch axis of the first input, then 1 or a named axis
    if steps != 1 and not (isinstance(steps, str) and len(first_input) == 2):
        return 0  # (the way back to 3-D reads the first input's shape: it must be [batch, T])
    moved = _RowFlattener(g, shapes, batch, steps).run()
    if moved:
        logger.debug("flatten_rows: %d nodes on [rows, F]", moved)
    return moved


def _value_shapes(model) -> dict[str, list]:
    """The shape of every value ``onnx.shape_inference`` can type: ints, axis names, or None."""
    from onnx import shape_inference

    inferred = shape_inference.infer_shapes(model, data_prop=True)
    shapes: dict[str, list] = {}
    for vi in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        t = vi.type.tensor_type
        if t.HasField("shape"):
            shapes[vi.name] = [
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim
            ]
    return shapes


def _last_axis(node) -> bool:
    axis = [a for a in node.attribute if a.name == "axis"]
    return not axis or axis[0].i in (-1, 2)


class _RowFlattener:
    """One :func:`flatten_rows` pass over the graph ``g``, whose first input is ``[batch, steps]``:
    which nodes move to ``[rows, F]``, how their inputs get there, how their readers get back."""

    def __init__(self, g, shapes: dict[str, list], batch: str, steps):
        self.g, self.shapes, self.batch, self.steps = g, shapes, batch, steps
        self.one_step = steps == 1
        self.inits = {t.name: t for t in g.initializer}
        self.graph_outputs = {o.name for o in g.output}
        self.new_inits: list = []
        self.unread: set[str] = set()  # initializers this pass may leave without a reader
        self.after: dict[int, list] = {}  # id(node) -> nodes to insert after it (0: before everything)
        self.restored: set[str] = set()  # moved values read on 3-D by a node that stays
        self.dropped: set[int] = set()  # id(node) of the nodes removed
        self.back_shapes: dict[int, str] = {}  # F -> the name of [batch, T, F] (a graph with a T axis)
        self._last_axis_name: Optional[str] = None  # the [-1] axes of the moved ReduceMeans

    def row3(self, name: str) -> bool:
        s = self.shapes.get(name)
        return (
            s is not None
            and len(s) == 3
            and s[0] == self.batch
            and s[1] == self.steps
            and isinstance(s[2], int)
            and s[2] > 0
        )

    def small_constant(self, name: str) -> bool:
        t = self.inits.get(name)
        return t is not None and len(t.dims) <= 1

    def constant_value(self, name: str):
        from onnx import numpy_helper

        return numpy_helper.to_array(self.inits[name]) if name in self.inits else None

    def moves(self, node) -> bool:
        if node.op_type not in _ROW_OPS or node.domain not in ("", "ai.onnx") or not node.output:
            return False
        if not all(self.row3(o) and o not in self.graph_outputs for o in node.output):
            return False
        first, rest = node.input[0], [i for i in node.input[1:] if i]
        if node.op_type == "MatMul":
            w = self.inits.get(node.input[1])
            return self.row3(first) and w is not None and len(w.dims) == 2
        if node.op_type in ("LayerNormalization", "Split"):
            return self.row3(first) and _last_axis(node) and all(self.small_constant(i) for i in rest)
        if node.op_type == "ReduceMean":  # an RMS norm's mean square: over the last axis, kept
            return self.row3(first) and self._reduces_last_axis(node)
        return all(self.row3(i) or self.small_constant(i) for i in node.input if i)

    def _reduces_last_axis(self, node) -> bool:
        """A ``ReduceMean`` over the last axis alone with ``keepdims`` (opset 18: the axes an
        initializer input), which gives the same values on ``[rows, F]`` once its axes read -1."""
        keep = [a.i for a in node.attribute if a.name == "keepdims"]
        if keep and keep[0] != 1 or len(node.input) < 2 or not self.small_constant(node.input[1]):
            return False
        axes = self.constant_value(node.input[1])
        return axes is not None and [int(a) for a in axes.reshape(-1)] in ([-1], [2])

    def last_axis_constant(self) -> str:
        """The name of a new int64 ``[-1]`` initializer (made once per pass)."""
        if self._last_axis_name is None:
            self._last_axis_name = self.shape_constant("flatten_rows.last_axis", [-1])
        return self._last_axis_name

    def shape_constant(self, name: str, dims: list[int]) -> str:
        import numpy as np
        from onnx import numpy_helper

        self.new_inits.append(numpy_helper.from_array(np.array(dims, np.int64), name))
        return name

    def run(self) -> int:
        """Rewrite the graph in place; the number of nodes moved to two dimensions."""
        g = self.g
        self.moved = [n for n in g.node if self.moves(n)]
        if not self.moved:
            return 0
        self.moved_ids = {id(n) for n in self.moved}
        self.moved_values = {o for n in self.moved for o in n.output}
        self.producer = {o: n for n in g.node for o in n.output}
        self.readers: dict[str, list] = {}
        for n in g.node:
            for name in n.input:
                self.readers.setdefault(name, []).append(n)
        self.flat: dict[str, str] = {o: f"{o}.rows" for o in self.moved_values}  # 3-D name -> 2-D name
        self._flatten_inputs()
        for n in self.moved:
            n.input[:] = [self.flat[i] if i in self.flat and self.row3(i) else i for i in n.input]
            n.output[:] = [self.flat[o] for o in n.output]
            for a in n.attribute:
                if a.name == "axis":
                    a.i = -1
            if n.op_type == "ReduceMean":  # the last axis of [rows, F]
                self.unread.add(n.input[1])
                n.input[1] = self.last_axis_constant()
        self._route_readers()
        for name in sorted(self.restored | (self.moved_values & self.graph_outputs)):
            back = _make_node(
                "Reshape", [self.flat[name], self.back_shape(name)], [name], name=f"{name}_back"
            )
            self.after.setdefault(id(self.producer[name]), []).append(back)
        self._rebuild()
        return len(self.moved)

    def _flatten_inputs(self) -> None:
        """Every 3-D input of a moved node gets its 2-D name: a ``Reshape`` before it retargeted,
        the ``[batch, F]`` value an ``Unsqueeze`` read, or a new ``Reshape``."""
        for n in self.moved:
            for name in n.input:
                if not name or name in self.flat or not self.row3(name):
                    continue
                width = self.shapes[name][2]
                p = self.producer.get(name)
                if (
                    p is not None
                    and p.op_type == "Reshape"
                    and p.input[1] in self.inits
                    and name not in self.graph_outputs
                    and all(id(r) in self.moved_ids for r in self.readers[name])
                ):  # its only readers move: reshape straight to [-1, F]
                    self.unread.add(p.input[1])
                    p.input[1] = self.shape_constant(f"{name}.rows_shape", [-1, width])
                    p.output[0] = self.flat[name] = f"{name}.rows"
                elif (
                    self.one_step
                    and p is not None
                    and p.op_type == "Unsqueeze"
                    and len(p.input) == 2
                    and self.constant_value(p.input[1]) is not None
                    and self.constant_value(p.input[1]).tolist() in (1, [1])
                    and self.shapes.get(p.input[0]) == [self.batch, width]
                ):  # x.unsqueeze(1) of a [batch, F] value: read that value
                    self.flat[name] = p.input[0]
                else:
                    self.flat[name] = f"{name}.rows"
                    reshape = _make_node(
                        "Reshape",
                        [name, self.shape_constant(f"{name}.rows_shape", [-1, width])],
                        [self.flat[name]],
                        name=f"{name}_rows",
                    )
                    self.after.setdefault(id(p) if p is not None else 0, []).append(reshape)

    def _route_readers(self) -> None:
        """The nodes that stay and read a moved value: a constant ``Reshape`` reads the 2-D value,
        the decoder step's ``x[:, 0]`` is dropped, any other reader is noted in ``restored``."""
        for n in list(self.g.node):
            if id(n) in self.moved_ids:
                continue
            for k, name in enumerate(n.input):
                if name not in self.moved_values:
                    continue
                gather = n.op_type == "Gather" and len(n.input) > 1
                index = self.constant_value(n.input[1]) if gather else None
                target = self.constant_value(n.input[1]) if n.op_type == "Reshape" and k == 0 else None
                if target is not None and not (target == 0).any():
                    # a constant target without 0 (copy a dim) reads [batch, F] as well
                    n.input[0] = self.flat[name]
                elif (
                    self.one_step
                    and n.op_type == "Gather"
                    and k == 0
                    and [a.i for a in n.attribute if a.name == "axis"] == [1]
                    and index is not None
                    and index.ndim == 0
                    and int(index) == 0
                    and n.output[0] not in self.graph_outputs
                ):  # x[:, 0] of [batch, 1, F] is the [batch, F] value itself
                    for r in self.readers.get(n.output[0], []):
                        r.input[:] = [self.flat[name] if i == n.output[0] else i for i in r.input]
                    self.dropped.add(id(n))
                    self.unread.add(n.input[1])
                elif name not in self.restored:
                    self.restored.add(name)

    def back_shape(self, name: str) -> str:
        """The target of the ``Reshape`` that gives the moved value ``name`` back its 3-D shape."""
        width = self.shapes[name][2]
        if self.one_step:
            return self.shape_constant(f"{name}.back_shape", [-1, 1, width])
        if width not in self.back_shapes:
            rows = f"rows_shape.{width}"
            first = self.g.input[0].name
            self.after.setdefault(0, []).extend(
                [
                    _make_node("Shape", [first], [f"{rows}.rows"], name=f"{rows}_Shape"),
                    _make_node(
                        "Concat",
                        [f"{rows}.rows", self.shape_constant(f"{rows}.width", [width])],
                        [rows],
                        axis=0,
                        name=f"{rows}_Concat",
                    ),
                ]
            )
            self.back_shapes[width] = rows
        return self.back_shapes[width]

    def _rebuild(self) -> None:
        """The node list with the inserted and without the dropped nodes; initializers and
        ``value_info`` of what is still read."""
        g = self.g
        nodes = list(self.after.get(0, []))
        for n in g.node:
            if id(n) not in self.dropped:
                nodes.append(n)
            nodes += self.after.get(id(n), [])
        del g.node[:]
        g.node.extend(nodes)
        still_read = {i for n in g.node for i in n.input} | self.graph_outputs
        kept_inits = [t for t in g.initializer if t.name not in self.unread or t.name in still_read]
        del g.initializer[:]
        g.initializer.extend(kept_inits + self.new_inits)
        kept = [vi for vi in g.value_info if vi.name not in self.moved_values or vi.name in self.restored]
        del g.value_info[:]
        g.value_info.extend(kept)


def _make_node(*args, **kwargs):
    from onnx import helper

    return helper.make_node(*args, **kwargs)


@contextlib.contextmanager
def in_graph_cache_update() -> Iterator[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Trace ``decode_step`` with the self-attention cache update inside the graph.

    Inside the context, ``ops.decode_attention(q, k_cache, v_cache, positions, scale, k_new,
    v_new)`` (the self-attention form, with the new token) becomes::

        present_k = kv_cache_update(k_cache, k_new, positions)   # TensorScatter
        present_v = kv_cache_update(v_cache, v_new, positions)
        decode_attention(q, present_k, present_v, positions + 1, scale)

    which is the same attention (prefix plus the new token), but the only node that reads a
    cache input is the ``TensorScatter`` (so ONNX Runtime can update the bound buffer in place).
    Yields ``(present_keys, present_values)``, filled in call order (= layer order) while
    tracing. Calls without ``k_new`` (cross-attention) are unchanged.
    """
    original = ops.decode_attention
    present_keys: list[torch.Tensor] = []
    present_values: list[torch.Tensor] = []

    def decode_attention_in_graph(
        q, k_cache, v_cache, lengths, scale, k_new=None, v_new=None, position_bias=None
    ):
        if k_new is None:
            return original(q, k_cache, v_cache, lengths, scale)
        present_k = kv_cache_update_op(k_cache, k_new, lengths)
        present_v = kv_cache_update_op(v_cache, v_new, lengths)
        present_keys.append(present_k)
        present_values.append(present_v)
        if position_bias is None:
            return original(q, present_k, present_v, lengths + 1, scale)
        # T5's relative bias (export.position_bias.StepBias), read for the keys of the updated
        # cache, whose entry lengths[b] is the new key (relative position 0)
        return original(q, present_k, present_v, lengths + 1, scale, None, None, position_bias)

    ops.decode_attention = decode_attention_in_graph
    try:
        yield present_keys, present_values
    finally:
        ops.decode_attention = original


@contextlib.contextmanager
def in_graph_gqa() -> Iterator[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Trace ``decode_step`` with each self-attention as one ONNX Runtime ``GroupQueryAttention``.

    Inside the context, ``ops.decode_attention(q, k_cache, v_cache, positions, scale, k_new,
    v_new)`` (the self-attention form, with the new token; ``q`` ``[B, H, 1, d_k]``, caches
    ``[B, H, L, d_k]``) is traced as::

        out, present_k, present_v = com.microsoft.GroupQueryAttention(
            q as [B, 1, H*d_k], k_new as [B, 1, H*d_k], v_new as [B, 1, H*d_k], k_cache, v_cache,
            seqlens_k = int32(positions), total_sequence_length = int32(max(positions) + 1),
            num_heads = kv_num_heads = H, scale = scale)

    ONNX Runtime's CPU kernel writes row ``b``'s new K/V at position ``positions[b]`` and attends
    causally over positions ``0 .. positions[b]``: the same attention as the portable graph's
    (prefix plus the new token). When ``present_k`` is bound to the very buffer of ``k_cache``
    (the runner does), the kernel appends in place, and the whole layer's attention is one node
    instead of the portable graph's dozen. Yields ``(present_keys, present_values)``, filled in
    call order (= layer order) while tracing. Calls without ``k_new`` (cross-attention) are
    unchanged. Outside ``torch.onnx.export`` the call runs the eager op: the symbolic node only
    exists in a trace.
    """
    original = ops.decode_attention
    present_keys: list[torch.Tensor] = []
    present_values: list[torch.Tensor] = []

    def decode_attention_gqa(q, k_cache, v_cache, lengths, scale, k_new=None, v_new=None):
        if k_new is None or not torch.onnx.is_in_onnx_export():
            return original(q, k_cache, v_cache, lengths, scale, k_new, v_new)
        B, H, _, d_k = q.shape
        flat = (B, 1, H * d_k)  # [B, H, 1, d_k] is [B, H * d_k] in memory: a reshape, no transpose
        total = (lengths.max() + 1).to(torch.int32)
        out, present_k, present_v = torch.onnx.ops.symbolic_multi_out(
            "::".join(GQA_OP),
            [
                q.reshape(flat),
                k_new.reshape(flat),
                v_new.reshape(flat),
                k_cache,
                v_cache,
                lengths.to(torch.int32),
                total,
            ],
            {"num_heads": int(H), "kv_num_heads": int(H), "scale": float(scale)},
            dtypes=[q.dtype, k_cache.dtype, v_cache.dtype],
            shapes=[list(flat), list(k_cache.shape), list(v_cache.shape)],
            version=1,
        )
        present_keys.append(present_k)
        present_values.append(present_v)
        return out.reshape(B, H, 1, d_k)

    ops.decode_attention = decode_attention_gqa
    try:
        yield present_keys, present_values
    finally:
        ops.decode_attention = original


class CustomAttentionTrace:
    """What :func:`in_graph_custom_attention` needs of the step being traced: ``source_lengths``,
    int64 ``[sources]``, the cross-attention lengths of each K/V row (set before the step)."""

    def __init__(self) -> None:
        self.source_lengths: Optional[torch.Tensor] = None
        self.nodes = 0  # DecodeAttention nodes traced


def _custom_attention(q, k_cache, v_cache, lengths, scale: float, k_new=None, v_new=None) -> torch.Tensor:
    """One ``transformer_ext.DecodeAttention`` node -> ``[rows, H * d_k]`` (csrc/ort/README.md)."""
    B, H, _, d_k = q.shape
    inputs = [q, k_cache, v_cache, lengths] + ([k_new, v_new] if k_new is not None else [])
    return torch.onnx.ops.symbolic(
        "::".join(CUSTOM_ATTENTION_OP),
        inputs,
        {"scale": float(scale)},
        dtype=q.dtype,
        shape=[B, H * d_k],
        version=1,
    )


@contextlib.contextmanager
def in_graph_custom_attention() -> Iterator[CustomAttentionTrace]:
    """Trace ``decode_step`` with each decoder attention as one ``transformer_ext.DecodeAttention``
    node, the operator of the custom-op flavour's library (csrc/ort/).

    Inside the context, while ``torch.onnx.export`` traces:

    * the self-attention ``ops.decode_attention(q, k_cache, v_cache, positions, scale, k_new,
      v_new)`` becomes ``DecodeAttention(q, k_cache, v_cache, positions, k_new, v_new)``: the
      cached positions ``0 .. positions[b]-1`` and the new token, the caches only read (the runner
      appends the new K/V, as for the portable flavour);
    * the cross-attention with K/V once per source (``decode_step(cross_per_source=True)``)
      becomes ``DecodeAttention(q, cross_key, cross_value, source_lengths)``: a source's rows
      (its beams, consecutive) read its K/V, over its ``source_lengths`` positions
      (:attr:`CustomAttentionTrace.source_lengths`, which the caller sets before the step).

    Outside a trace the eager ops run. Models with a position bias or an attention output are
    refused before tracing (:func:`export.position_bias.flavour_problems`).
    """
    from transformer_ext import model as model_module

    original = ops.decode_attention
    original_cross = model_module._cross_attention_per_source
    trace = CustomAttentionTrace()

    def decode_attention_custom(
        q, k_cache, v_cache, lengths, scale, k_new=None, v_new=None, position_bias=None
    ):
        if position_bias is not None or not torch.onnx.is_in_onnx_export():
            return original(q, k_cache, v_cache, lengths, scale, k_new, v_new, position_bias)
        trace.nodes += 1
        B, H, _, d_k = q.shape
        return _custom_attention(q, k_cache, v_cache, lengths, scale, k_new, v_new).reshape(B, H, 1, d_k)

    def cross_attention_custom(q, cross_key, cross_value, cross_bias, scale, attention):
        if attention is not None or trace.source_lengths is None or not torch.onnx.is_in_onnx_export():
            return original_cross(q, cross_key, cross_value, cross_bias, scale, attention)
        trace.nodes += 1
        B = q.shape[0]
        out = _custom_attention(q, cross_key, cross_value, trace.source_lengths, scale)
        return out.reshape(B, 1, out.shape[1])

    ops.decode_attention = decode_attention_custom
    model_module._cross_attention_per_source = cross_attention_custom
    try:
        yield trace
    finally:
        ops.decode_attention = original
        model_module._cross_attention_per_source = original_cross
