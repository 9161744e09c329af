"""The forms of a decoder step's self- and cross-attention that ONNX Runtime's CPU provider runs,
checked against float64 and timed side by side at 4-256 rows.

    python -m benchmarks probe_step_attention                 # base: 8 heads, d_k 64, 6 layers
    python -m benchmarks probe_step_attention --quick         # a smoke run of a few seconds

Each form is a small ONNX graph of ``--layers`` decoder layers' attention (every layer with
tensors of its own, so a step's data, not one layer's, meets the caches), fed the projected
queries, keys and values (the projections are the same in every form and are left out), with
the query scale folded in (scale 1, as the export traces it). Every tensor is bound by pointer
(IO binding), as ``OrtRunner`` binds them.

**Self-attention** over a cache of capacity ``L`` (``--cache-lens``), the new token at position
``L - 1`` (every form reads all ``L`` positions):

* ``ops``: the portable export's lowering of ``decode_attention`` (``MatMul`` over the cache with
  an additive mask, the new token's score by ``Mul`` + ``ReduceSum``, ``Concat``, ``Softmax``,
  two ``Slice`` s, ``MatMul`` + ``Mul`` + ``Add``) plus the runner's host append of the new K/V
  (``HostKVCache.append_``), which the other forms do inside the graph.
* ``folded``: the same with the heads folded into the batch axis: one ``MatMul`` over
  ``[R*H, 1, d] x [R*H, d, L]`` for the scores and one over ``[R*H, 1, L] x [R*H, L, d]``.
* ``gqa``: one ``com.microsoft.GroupQueryAttention`` per layer (the ``ort`` flavour's), its
  past and present K/V one bound buffer.
* ``dmmha``: one ``com.microsoft.DecoderMaskedMultiHeadAttention`` per layer,
  ``past_present_share_buffer=1``, ``past_sequence_length = L - 1``.
* ``dmmha_beams``: the same with ``beam_width = --beam-size`` and a random ``cache_indirection``
  (each beam reading earlier positions from another beam of its source), timed with the
  host update of the indirection table a search would make each step. It needs no cache
  reorder; ``host_reorder`` times the reorder the other forms need at a beam step
  (``HostKVCache.reorder_``, the fraction ``--moved-rows`` of the rows taking another beam of
  their source: 0.25 by default, as beam 4 on the demo model, where 24% of the rows move per
  step: ``--measure-moved-rows`` counts them), so ``gqa + host_reorder`` is the figure ``dmmha_beams`` competes with.

**Cross-attention** over ``--src-len`` source positions (ragged lengths), ``K`` rows per source
(1: greedy, and ``--beam-size``), K/V once per source unless named otherwise:

* ``ops``: the export's grouped form (queries regrouped ``[sources, heads, K, d]``, ``MatMul``
  with ``k^T``, additive mask, ``Softmax``, ``MatMul``, back).
* ``folded``: the same products as 3-D ``MatMul`` s over ``[sources*H, K, d]``.
* ``bcast``: no regrouping: ``q [sources, K, H, 1, d]`` against the keys broadcast over ``K``
  (``[sources, 1, H, d, S]``): one-row products, no ``Transpose`` of the queries or outputs.
* ``kt``: ``ops`` with the keys stored transposed by the encoder (``[sources, H, d, S]``).
* ``mha``: one ``com.microsoft.MultiHeadAttention`` per layer (the beams as its query sequence).
* ``dmmha``: one ``DecoderMaskedMultiHeadAttention`` per layer in its cross-attention form,
  which takes K/V per row (``[rows, H, S, d]``: repeated per beam, the older export contract).

Every form is first checked against a float64 numpy reference (max abs error of its output
and, for the forms that write the cache, of the written row); a form above ``--tolerance`` or
one ONNX Runtime refuses is reported and not timed. The rest are timed in one process, rounds
interleaved after a warm-up (``common.time_side_by_side``, medians), at each row count and
intra-op thread count (1 and 2). The JSON (``--out``) holds every time, error and ratio and a
``summary`` per thread count: the fastest valid form of each block and its speed-up over the
portable export's form (``ops``) and over the faster of the forms the export already has
(``ops`` or the ``ort`` flavour's ``gqa`` for self-attention, ``ops`` for cross-attention),
whether that reaches ``--win`` (1.15x) at 16 and 64 rows, the same for a beam step
(``dmmha_beams`` against the exported forms plus ``host_reorder``), and the whole attention of
a layer (``attention_part``: self plus cross). A PNG beside it plots each form's speed-up over ``ops``.

Finding (``benchmarks/results/probe_step_attention_cpu_clock_t1_xeon.json``: ONNX Runtime 1.32,
the 2-core Sapphire Rapids-class Xeon with 480 MiB L3, 1 intra-op thread, measured with
``python -m benchmarks probe_step_attention --clock cpu --threads 1 --runs 21 --min-time 0.02``
while other sessions loaded the machine to a load average of 10-13, hence the CPU clock: a
direction, to be confirmed by the default wall-clock command, 1 and 2 threads, on a quiet
machine). Every form agrees with float64 within 1.2e-6. **No form wins clearly** (1.15x at both
16 and 64 rows):

* Self-attention is bound by reading the cache: at 16-64 rows the fastest form is 1.00-1.14x the
  faster exported one (``ops`` or ``gqa``; ``dmmha`` leads at 16 rows, ``gqa`` or ``ops`` at 64,
  and at cache 72 ``ops`` beats ``gqa``); heads folded into the batch axis give 0.96-1.08x ``ops``.
* Cross-attention: ``mha`` leads ``ops`` by 1.12-1.17x at 4 beams and ``kt`` / ``bcast`` by
  1.08-1.11x in greedy steps at 16-64 rows, all 1.0-1.03x at 256; ``folded`` gives 0.84-1.07x,
  and ``dmmha`` (K/V per beam) is 1.7-2.4x slower at 4 beams. A layer's whole attention in its
  fastest forms is 1.01-1.13x the exported forms at 16-64 rows.
* ``cache_indirection`` (``dmmha_beams``) removes a beam step's cache reorder, but its kernel is
  1.4-1.7x slower than ``gqa``. With a quarter of the rows moving per step (beam 4 on the demo
  model moves 24% of them, 16% of the bytes: ``--measure-moved-rows``), the reorder costs
  0.25-0.56x the self-attention and the exported form plus the reorder is 1.05-1.3x faster than
  ``dmmha_beams`` at 16-64 rows. With three rows in four moving
  (``probe_step_attention_cpu_clock_t1_xeon_moved75.json``, the same command before
  ``--moved-rows`` existed, each row choosing a random beam of its source) the reorder costs
  1.9-3.6x the self-attention and ``dmmha_beams`` wins by 1.9-2.8x: the table pays only where
  most beams change parents at most steps.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import numpy as np

from benchmarks.common import save_figure
from benchmarks.probes import step_attention_harness as harness
from benchmarks.probes.probe_contrib_attention import _model, cross_graph, self_graph
from benchmarks.probes.step_attention_harness import (
    NEG_INF,
    Bound,
    build,
    caches,
    cross_reference,
    self_reference,
)

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (results/ lives here)

SELF_FORMS = ("ops", "folded", "gqa", "dmmha", "dmmha_beams")
CROSS_FORMS = ("ops", "folded", "bcast", "kt", "mha", "dmmha")
BEAM_STEP = "beam_step_exported_plus_reorder_over_dmmha_beams"
EXPORTED = {"self": ("ops", "gqa"), "cross": ("ops",)}  # the forms the export has (portable, ort flavour)


# ------------------------------------------------------------------------------------------
# graphs (the ``ops`` / ``gqa`` / ``mha`` ones are probe_contrib_attention's)
# ------------------------------------------------------------------------------------------


def _named(stem: str, i: int) -> str:
    """Layer ``i``'s name of a graph value."""
    return f"{stem}{i}"


def _helpers():
    from onnx import TensorProto, helper

    return TensorProto, helper


def self_folded_graph(layers: int, R: int, H: int, L: int, D: int) -> bytes:
    """``ops`` with the two products over ``[R*H, ...]``; the same inputs and outputs."""
    TensorProto, helper = _helpers()
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [helper.make_tensor_value_info("positions", i64, [R])]
    outputs = []
    inits = [
        helper.make_tensor("zero", f, [], [0.0]),
        helper.make_tensor("neg_inf", f, [], [NEG_INF]),
        helper.make_tensor("last", i64, [1], [-1]),
        helper.make_tensor("col", i64, [4], [-1, 1, 1, 1]),
        helper.make_tensor("keys", i64, [1], [L]),
        helper.make_tensor("start0", i64, [1], [0]),
        helper.make_tensor("start_last", i64, [1], [-1]),
        helper.make_tensor("end_max", i64, [1], [2**62]),
        helper.make_tensor("axis3", i64, [1], [3]),
        helper.make_tensor("r0", i64, [], [0]),
        helper.make_tensor("rL", i64, [], [L]),
        helper.make_tensor("r1", i64, [], [1]),
        helper.make_tensor("shape_q", i64, [3], [R * H, 1, D]),
        helper.make_tensor("shape_cache", i64, [3], [R * H, L, D]),
        helper.make_tensor("shape_scores", i64, [4], [R, H, 1, L]),
        helper.make_tensor("shape_probs", i64, [3], [R * H, 1, L]),
        helper.make_tensor("shape_out", i64, [4], [R, H, 1, D]),
    ]
    nodes = [
        helper.make_node("Range", ["r0", "rL", "r1"], ["key_pos"]),
        helper.make_node("Reshape", ["positions", "col"], ["pos_col"]),
        helper.make_node("Less", ["key_pos", "pos_col"], ["allowed"]),
        helper.make_node("Where", ["allowed", "zero", "neg_inf"], ["bias"]),
    ]
    for i in range(layers):
        q, k, v, kc, vc = (f"{n}{i}" for n in ("q", "k", "v", "kc", "vc"))
        inputs += [helper.make_tensor_value_info(n, f, [R, H, 1, D]) for n in (q, k, v)]
        inputs += [helper.make_tensor_value_info(n, f, [R, H, L, D]) for n in (kc, vc)]
        n = functools.partial(_named, i=i)
        nodes += [
            helper.make_node("Reshape", [q, "shape_q"], [n("qf")]),
            helper.make_node("Reshape", [kc, "shape_cache"], [n("kf")]),
            helper.make_node("Reshape", [vc, "shape_cache"], [n("vf")]),
            helper.make_node("Transpose", [n("kf")], [n("kt")], perm=[0, 2, 1]),
            helper.make_node("MatMul", [n("qf"), n("kt")], [n("sf")]),
            helper.make_node("Reshape", [n("sf"), "shape_scores"], [n("s")]),
            helper.make_node("Add", [n("s"), "bias"], [n("sb")]),
            helper.make_node("Mul", [q, k], [n("qk")]),
            helper.make_node("ReduceSum", [n("qk"), "last"], [n("sn")], keepdims=1),
            helper.make_node("Concat", [n("sb"), n("sn")], [n("sa")], axis=-1),
            helper.make_node("Softmax", [n("sa")], [n("p")], axis=-1),
            helper.make_node("Slice", [n("p"), "start0", "keys", "axis3"], [n("pc")]),
            helper.make_node("Slice", [n("p"), "start_last", "end_max", "axis3"], [n("pn")]),
            helper.make_node("Reshape", [n("pc"), "shape_probs"], [n("pcf")]),
            helper.make_node("MatMul", [n("pcf"), n("vf")], [n("ocf")]),
            helper.make_node("Reshape", [n("ocf"), "shape_out"], [n("oc")]),
            helper.make_node("Mul", [n("pn"), v], [n("on")]),
            helper.make_node("Add", [n("oc"), n("on")], [f"out{i}"]),
        ]
        outputs.append(helper.make_tensor_value_info(f"out{i}", f, [R, H, 1, D]))
    return _model(nodes, inputs, outputs, inits, "self_folded")


def self_dmmha_graph(layers: int, R: int, H: int, L: int, D: int, beams: bool) -> bytes:
    """Per layer ``q``/``k``/``v`` ``[R, 1, H*D]`` and the caches ``[R, H, L, D]`` (bound as
    past and present); ``past_sequence_length`` int32 ``[1]``; with ``beams``, ``beam_width``
    int32 ``[1]`` and ``cache_indirection`` int32 ``[R // K, K, L]``."""
    TensorProto, helper = _helpers()
    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    inputs = [helper.make_tensor_value_info("past_len", i32, [1])]
    if beams:
        inputs += [
            helper.make_tensor_value_info("beam_width", i32, [1]),
            helper.make_tensor_value_info("cache_indirection", i32, None),
        ]
    nodes, outputs = [], []
    for i in range(layers):
        q, k, v, kc, vc = (f"{n}{i}" for n in ("q", "k", "v", "kc", "vc"))
        inputs += [helper.make_tensor_value_info(n, f, [R, 1, H * D]) for n in (q, k, v)]
        inputs += [helper.make_tensor_value_info(n, f, [R, H, L, D]) for n in (kc, vc)]
        extra = ["beam_width", "cache_indirection"] if beams else []
        nodes.append(
            helper.make_node(
                "DecoderMaskedMultiHeadAttention",
                [q, k, v, "", "", kc, vc, "past_len", *extra],
                [f"out{i}", f"present_k{i}", f"present_v{i}"],
                domain="com.microsoft",
                num_heads=H,
                past_present_share_buffer=1,
                scale=1.0,
            )
        )
        outputs += [
            helper.make_tensor_value_info(f"out{i}", f, [R, 1, H * D]),
            helper.make_tensor_value_info(f"present_k{i}", f, [R, H, L, D]),
            helper.make_tensor_value_info(f"present_v{i}", f, [R, H, L, D]),
        ]
    return _model(nodes, inputs, [*outputs], [], "self_dmmha")


def _cross_bias(helper, TensorProto, R: int, S: int, shape: list[int]):
    """Nodes and initializers of the additive source mask from ``lengths [R]``, as ``shape``."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    inits = [
        helper.make_tensor("zero", f, [], [0.0]),
        helper.make_tensor("neg_inf", f, [], [NEG_INF]),
        helper.make_tensor("col", i64, [2], [-1, 1]),
        helper.make_tensor("bias_shape", i64, [len(shape)], shape),
        helper.make_tensor("r0", i64, [], [0]),
        helper.make_tensor("rS", i64, [], [S]),
        helper.make_tensor("r1", i64, [], [1]),
    ]
    nodes = [
        helper.make_node("Range", ["r0", "rS", "r1"], ["src_pos"]),
        helper.make_node("Reshape", ["lengths", "col"], ["len_col"]),
        helper.make_node("Less", ["src_pos", "len_col"], ["allowed"]),
        helper.make_node("Where", ["allowed", "zero", "neg_inf"], ["bias_rows"]),
        helper.make_node("Reshape", ["bias_rows", "bias_shape"], ["bias"]),
    ]
    return nodes, inits


def cross_layout_graph(form: str, layers: int, B: int, K: int, H: int, S: int, D: int) -> bytes:
    """``folded``, ``bcast`` or ``kt`` (the module docstring): ``q [R, H, 1, D]``, K/V per source
    (``kt``: keys ``[B, H, D, S]``), ``lengths`` int64 ``[R]``; output ``[R, H, 1, D]``."""
    TensorProto, helper = _helpers()
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    R = B * K
    bias_shape = [B, K, 1, 1, S] if form == "bcast" else [B, 1, K, S]
    nodes, inits = _cross_bias(helper, TensorProto, R, S, bias_shape)
    inits += [
        helper.make_tensor("grouped", i64, [4], [B, K, H, D]),
        helper.make_tensor("flat", i64, [4], [R, H, 1, D]),
        helper.make_tensor("shape_q5", i64, [5], [B, K, H, 1, D]),
        helper.make_tensor("shape_q", i64, [3], [B * H, K, D]),
        helper.make_tensor("shape_kv", i64, [3], [B * H, S, D]),
        helper.make_tensor("shape_scores", i64, [4], [B, H, K, S]),
        helper.make_tensor("shape_probs", i64, [3], [B * H, K, S]),
        helper.make_tensor("shape_out", i64, [4], [B, H, K, D]),
        helper.make_tensor("axis1", i64, [1], [1]),
    ]
    inputs = [helper.make_tensor_value_info("lengths", i64, [R])]
    outputs = []
    for i in range(layers):
        q, k, v = f"q{i}", f"k{i}", f"v{i}"
        n = functools.partial(_named, i=i)
        inputs.append(helper.make_tensor_value_info(q, f, [R, H, 1, D]))
        inputs.append(helper.make_tensor_value_info(k, f, [B, H, D, S] if form == "kt" else [B, H, S, D]))
        inputs.append(helper.make_tensor_value_info(v, f, [B, H, S, D]))
        if form == "bcast":
            nodes += [
                helper.make_node("Reshape", [q, "shape_q5"], [n("qb")]),
                helper.make_node("Unsqueeze", [k, "axis1"], [n("kb")]),
                helper.make_node("Transpose", [n("kb")], [n("kt")], perm=[0, 1, 2, 4, 3]),
                helper.make_node("MatMul", [n("qb"), n("kt")], [n("s")]),  # [B, K, H, 1, S]
                helper.make_node("Add", [n("s"), "bias"], [n("sb")]),
                helper.make_node("Softmax", [n("sb")], [n("p")], axis=-1),
                helper.make_node("Unsqueeze", [v, "axis1"], [n("vb")]),
                helper.make_node("MatMul", [n("p"), n("vb")], [n("o")]),  # [B, K, H, 1, D]
                helper.make_node("Reshape", [n("o"), "flat"], [f"out{i}"]),
            ]
        else:
            nodes += [
                helper.make_node("Reshape", [q, "grouped"], [n("qg")]),
                helper.make_node("Transpose", [n("qg")], [n("qr")], perm=[0, 2, 1, 3]),  # [B, H, K, D]
            ]
            if form == "kt":
                nodes += [
                    helper.make_node("MatMul", [n("qr"), k], [n("s")]),
                    helper.make_node("Add", [n("s"), "bias"], [n("sb")]),
                    helper.make_node("Softmax", [n("sb")], [n("p")], axis=-1),
                    helper.make_node("MatMul", [n("p"), v], [n("o")]),
                ]
            else:  # folded
                nodes += [
                    helper.make_node("Reshape", [n("qr"), "shape_q"], [n("qf")]),
                    helper.make_node("Reshape", [k, "shape_kv"], [n("kf")]),
                    helper.make_node("Reshape", [v, "shape_kv"], [n("vf")]),
                    helper.make_node("Transpose", [n("kf")], [n("kt")], perm=[0, 2, 1]),
                    helper.make_node("MatMul", [n("qf"), n("kt")], [n("sf")]),
                    helper.make_node("Reshape", [n("sf"), "shape_scores"], [n("s")]),
                    helper.make_node("Add", [n("s"), "bias"], [n("sb")]),
                    helper.make_node("Softmax", [n("sb")], [n("p")], axis=-1),
                    helper.make_node("Reshape", [n("p"), "shape_probs"], [n("pf")]),
                    helper.make_node("MatMul", [n("pf"), n("vf")], [n("of")]),
                    helper.make_node("Reshape", [n("of"), "shape_out"], [n("o")]),
                ]
            nodes += [
                helper.make_node("Transpose", [n("o")], [n("ot")], perm=[0, 2, 1, 3]),
                helper.make_node("Reshape", [n("ot"), "flat"], [f"out{i}"]),
            ]
        outputs.append(helper.make_tensor_value_info(f"out{i}", f, [R, H, 1, D]))
    used = {name for node in nodes for name in node.input}
    return _model(nodes, inputs, outputs, [t for t in inits if t.name in used], f"cross_{form}")


def cross_dmmha_graph(layers: int, R: int, H: int, S: int, D: int) -> bytes:
    """Per layer ``q [R, 1, H*D]``, K/V per row ``[R, H, S, D]``; ``mask`` int32 ``[R, S]``."""
    TensorProto, helper = _helpers()
    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    inputs = [helper.make_tensor_value_info("mask", i32, [R, S])]
    nodes, outputs = [], []
    for i in range(layers):
        q, k, v = f"q{i}", f"k{i}", f"v{i}"
        inputs.append(helper.make_tensor_value_info(q, f, [R, 1, H * D]))
        inputs += [helper.make_tensor_value_info(n, f, [R, H, S, D]) for n in (k, v)]
        nodes.append(
            helper.make_node(
                "DecoderMaskedMultiHeadAttention",
                [q, k, v, "mask"],
                [f"out{i}"],
                domain="com.microsoft",
                num_heads=H,
                scale=1.0,
            )
        )
        outputs.append(helper.make_tensor_value_info(f"out{i}", f, [R, 1, H * D]))
    return _model(nodes, inputs, outputs, [], "cross_dmmha")


def self_forms(args, R: int, L: int, threads: int, data: dict, indirection: np.ndarray) -> dict:
    """``{form: (run, outputs [layers x [R, H, D]], written cache row or None)}``; a form ONNX
    Runtime refuses maps to its error message."""
    layers, H, D, K = args.layers, args.heads, args.head_size, args.beams
    p = L - 1
    forms: dict = {}

    def portable(model: bytes):
        s = Bound(model, threads)
        cache = caches(data, layers, R, H, L, D, staging=True)
        s.bind_in("positions", np.full(R, p, np.int64))
        outs = []
        for i in range(layers):
            cache.new_key_layers[i][...] = data["k"][i][:, :, None]
            cache.new_value_layers[i][...] = data["v"][i][:, :, None]
            s.bind_in(f"q{i}", data["q"][i].reshape(R, H, 1, D))
            s.bind_in(f"k{i}", cache.new_key_layers[i])
            s.bind_in(f"v{i}", cache.new_value_layers[i])
            s.bind_in(f"kc{i}", cache.key_layers[i])
            s.bind_in(f"vc{i}", cache.value_layers[i])
            outs.append(s.bind_out(f"out{i}", np.empty((R, H, 1, D), np.float32)))

        def run():
            s.run()
            cache.append_()

        return run, outs, cache

    def contrib(kind: str):
        if kind == "gqa":
            s = Bound(self_graph(True, layers, R, H, L, D), threads)
            s.bind_in("seqlens_k", np.full(R, p, np.int32))
            s.bind_in("total_len", np.array(p + 1, np.int32))
        else:
            s = Bound(self_dmmha_graph(layers, R, H, L, D, beams=kind == "dmmha_beams"), threads)
            s.bind_in("past_len", np.array([p], np.int32))
        cache = caches(data, layers, R, H, L, D, staging=False)
        indir = None
        if kind == "dmmha_beams":
            s.bind_in("beam_width", np.array([K], np.int32))
            indir = s.bind_in("cache_indirection", indirection.astype(np.int32).reshape(R // K, K, L).copy())
        outs = []
        for i in range(layers):
            for name in ("q", "k", "v"):
                s.bind_in(f"{name}{i}", np.ascontiguousarray(data[name][i]).reshape(R, 1, H * D))
            for name, buf in ((f"kc{i}", cache.key_layers[i]), (f"vc{i}", cache.value_layers[i])):
                s.bind_in(name, buf)
                s.bind_out(name.replace("kc", "present_k").replace("vc", "present_v"), buf)
            outs.append(s.bind_out(f"out{i}", np.empty((R, 1, H * D), np.float32)))
        if indir is None:
            return s.run, outs, cache
        # A search's bookkeeping per step: every row's table becomes its parent beam's, and the
        # new position is its own. Timed with the step (the parents are the identity here, so
        # the table and the check stay valid).
        parents = np.arange(R).reshape(R // K, K) % K
        flat = indir.reshape(R // K, K, L)

        def run():
            s.run()
            flat[:, :, : p + 1] = np.take_along_axis(flat[:, :, : p + 1], parents[:, :, None], axis=1)
            flat[:, :, p] = np.arange(K, dtype=np.int32)[None, :]

        return run, outs, cache

    build(forms, "ops", lambda: portable(self_graph(False, layers, R, H, L, D)))
    build(forms, "folded", lambda: portable(self_folded_graph(layers, R, H, L, D)))
    build(forms, "gqa", lambda: contrib("gqa"))
    build(forms, "dmmha", lambda: contrib("dmmha"))
    if R % K == 0 and K > 1:
        build(forms, "dmmha_beams", lambda: contrib("dmmha_beams"))
    return forms


def cross_forms(args, B: int, K: int, threads: int, data: dict) -> dict:
    layers, H, D, S = args.layers, args.heads, args.head_size, args.src_len
    R = B * K
    lengths = data["lengths"]
    forms: dict = {}

    def grouped(form: str):
        model = cross_graph(False, layers, B, K, H, S, D) if form == "ops" else None
        model = model or cross_layout_graph(form, layers, B, K, H, S, D)
        s = Bound(model, threads)
        s.bind_in("lengths", np.repeat(lengths, K).astype(np.int64))
        outs = []
        for i in range(layers):
            s.bind_in(f"q{i}", data["q"][i].reshape(R, H, 1, D))
            key = data["k"][i]
            s.bind_in(f"k{i}", np.ascontiguousarray(key.transpose(0, 1, 3, 2)) if form == "kt" else key)
            s.bind_in(f"v{i}", data["v"][i])
            outs.append(s.bind_out(f"out{i}", np.empty((R, H, 1, D), np.float32)))
        return s.run, outs, None

    def mha():
        s = Bound(cross_graph(True, layers, B, K, H, S, D), threads)
        s.bind_in("key_padding_mask", (np.arange(S)[None, :] < lengths[:, None]).astype(np.int32))
        outs = []
        for i in range(layers):
            s.bind_in(f"q{i}", data["q"][i].reshape(B, K, H * D))
            s.bind_in(f"k{i}", data["k"][i])
            s.bind_in(f"v{i}", data["v"][i])
            outs.append(s.bind_out(f"out{i}", np.empty((B, K, H * D), np.float32)))
        return s.run, outs, None

    def dmmha():
        s = Bound(cross_dmmha_graph(layers, R, H, S, D), threads)
        rows = np.repeat(lengths, K)
        s.bind_in("mask", (np.arange(S)[None, :] < rows[:, None]).astype(np.int32))
        outs = []
        for i in range(layers):
            s.bind_in(f"q{i}", data["q"][i].reshape(R, 1, H * D))
            s.bind_in(f"k{i}", np.repeat(data["k"][i], K, axis=0))
            s.bind_in(f"v{i}", np.repeat(data["v"][i], K, axis=0))
            outs.append(s.bind_out(f"out{i}", np.empty((R, 1, H * D), np.float32)))
        return s.run, outs, None

    for form in ("ops", "folded", "bcast", "kt"):
        build(forms, form, functools.partial(grouped, form))
    build(forms, "mha", mha)
    build(forms, "dmmha", dmmha)
    return forms


def self_case(args, R: int, L: int, threads: int, rng) -> dict:
    layers, H, D, K = args.layers, args.heads, args.head_size, args.beams
    p = L - 1
    data = harness.self_data(rng, layers, R, H, L, D)
    beams = K > 1 and R % K == 0
    # row (b, k) reads cache position j < p from beam indirection[b*K + k, j] of source b
    indirection = rng.integers(0, K, size=(R, L)) if beams else np.zeros((R, L), np.int64)
    if beams:
        indirection[:, p] = np.tile(np.arange(K), R // K)
    forms = self_forms(args, R, L, threads, data, indirection)

    def reference(source_row: np.ndarray) -> list:
        return [
            self_reference(*(data[n][i] for n in ("q", "k", "v", "kc", "vc")), p, source_row)
            for i in range(layers)
        ]

    cache_check = harness.cache_write_check(data, layers, p)
    beam_forms = {k: forms.pop(k) for k in ("dmmha_beams",) if k in forms}
    errors, refused, fns = harness.check(args, forms, reference(harness.own_rows(R, L)), cache_check)
    if beam_forms:
        source_row = (np.arange(R) // K * K)[:, None] + indirection
        e, r, f = harness.check(args, beam_forms, reference(source_row), cache_check)
        errors, refused, fns = errors | e, refused | r, fns | f
    if beams:  # the reorder the cache-reading forms need at a beam step (the runner's HostKVCache)
        reorder_cache = caches(data, layers, R, H, L, D, staging=False)
        choice = np.arange(R)
        movers = rng.choice(R, size=int(round(args.moved_rows * R)), replace=False)
        # each moved row takes another beam of its source
        choice[movers] = movers // K * K + (movers % K + rng.integers(1, K, size=movers.size)) % K
        fns["host_reorder"] = functools.partial(reorder_cache.reorder_, choice)
    result = harness.timed(args, fns, errors, refused)
    rec = {"block": "self", "rows": R, "cache_len": L, "position": p, "threads": threads, **result}
    if beams:
        rec["moved_rows"] = int((choice != np.arange(R)).sum())
    return rec


def cross_case(args, B: int, K: int, threads: int, rng) -> dict:
    layers, H, D, S = args.layers, args.heads, args.head_size, args.src_len
    data = harness.cross_data(rng, layers, B, K, H, S, D)
    lengths = data["lengths"]
    want = [cross_reference(data["q"][i], data["k"][i], data["v"][i], lengths, K) for i in range(layers)]
    forms = cross_forms(args, B, K, threads, data)
    errors, refused, fns = harness.check(args, forms, want, None)
    result = harness.timed(args, fns, errors, refused)
    return {"block": "cross", "rows": B * K, "sources": B, "beams": K, "threads": threads, **result}


# ------------------------------------------------------------------------------------------
# summary, plot, main
# ------------------------------------------------------------------------------------------


def summarize(results: list, win: float) -> dict:
    """Per thread count and block: at each row count the fastest valid form, its speed-up over
    ``ops`` and over the faster of the forms the export has (:data:`EXPORTED`), and the verdict
    at 16-64 rows; for self-attention also the beam step (the exported forms plus the cache
    reorder they need, against ``dmmha_beams``, which needs none)."""
    summary = {}
    for rec in results:
        ms = rec["milliseconds"]
        forms = {k: v for k, v in ms.items() if k not in ("host_reorder", "dmmha_beams")}
        exported = [ms[k] for k in EXPORTED[rec["block"]] if k in ms]
        if not forms or not exported:
            continue
        best = min(forms, key=forms.get)
        key = f"{rec['block']}/threads={rec['threads']}"
        key += f"/cache_len={rec['cache_len']}" if rec["block"] == "self" else f"/beams={rec['beams']}"
        row = {
            "rows": rec["rows"],
            "fastest": best,
            "fastest_over_ops": ms["ops"] / ms[best] if "ops" in ms else None,
            "fastest_over_exported": min(exported) / ms[best],
        }
        if "dmmha_beams" in ms and "host_reorder" in ms:
            row[BEAM_STEP] = (min(exported) + ms["host_reorder"]) / ms["dmmha_beams"]
        summary.setdefault(key, []).append(row)
    verdicts = {}
    for key, rows in summary.items():
        mid = [r for r in rows if 16 <= r["rows"] <= 64]
        if not mid:
            continue
        fastest = {r["fastest"] for r in mid}
        least = min(r["fastest_over_exported"] for r in mid)
        verdict = {
            "fastest_at_16_64_rows": sorted(fastest),
            "min_speedup_over_exported_at_16_64_rows": least,
            "wins": least >= win and not fastest & set(EXPORTED[key.split("/")[0]]),
        }
        beam = [r[BEAM_STEP] for r in mid if BEAM_STEP in r]
        if beam:
            verdict["min_beam_step_speedup_of_dmmha_beams_at_16_64_rows"] = min(beam)
            verdict["beam_step_wins"] = min(beam) >= win
        verdicts[key] = verdict
    return {"by_rows": summary, "verdicts": verdicts, "attention_part": attention_part(results)}


def attention_part(results: list) -> list:
    """A layer's whole attention (self at each cache capacity + cross at each ``K``), per thread
    count and row count: the portable export's forms (``ops`` + ``ops``), the ``ort`` flavour's
    (``gqa`` + ``ops``) and the fastest valid form of each block, in milliseconds, and the
    speed-up of the fastest over each. At ``K > 1`` (a beam step) every self-attention form but
    ``dmmha_beams`` carries the measured ``host_reorder``."""
    parts = []
    selfs = [r for r in results if r["block"] == "self"]
    for s in selfs:
        for c in results:
            if c["block"] != "cross" or (c["threads"], c["rows"]) != (s["threads"], s["rows"]):
                continue
            ms, cc = s["milliseconds"], c["milliseconds"]
            if c["beams"] == 1:  # greedy: no reorder, no indirection
                ss = {k: v for k, v in ms.items() if k not in ("host_reorder", "dmmha_beams")}
            else:  # a beam step: every form but the indirection one also reorders the cache
                reorder = ms.get("host_reorder", 0.0)
                ss = {k: v + (0.0 if k == "dmmha_beams" else reorder) for k, v in ms.items()}
                ss.pop("host_reorder", None)
            if not ss or not cc or "ops" not in ss or "ops" not in cc:
                continue
            best_self, best_cross = min(ss, key=ss.get), min(cc, key=cc.get)
            fastest = ss[best_self] + cc[best_cross]
            rec = {
                "threads": s["threads"],
                "rows": s["rows"],
                "cache_len": s["cache_len"],
                "beams": c["beams"],
                "fastest_forms": [best_self, best_cross],
                "ms_portable": ss["ops"] + cc["ops"],
                "ms_fastest": fastest,
                "fastest_over_portable": (ss["ops"] + cc["ops"]) / fastest,
            }
            if "gqa" in ss:
                rec["ms_ort_flavour"] = ss["gqa"] + cc["ops"]
                rec["fastest_over_ort_flavour"] = rec["ms_ort_flavour"] / fastest
            rec["fastest_over_exported"] = (
                min(rec["ms_portable"], rec.get("ms_ort_flavour", np.inf)) / fastest
            )
            parts.append(rec)
    return parts


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted(
        {(r["block"], r["threads"], r.get("cache_len") or r.get("beams")) for r in out["results"]}
    )
    cols = min(4, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), squeeze=False)
    for ax, (block, threads, extra) in zip(axes.flat, panels):
        recs = [
            r
            for r in out["results"]
            if (r["block"], r["threads"], r.get("cache_len") or r.get("beams")) == (block, threads, extra)
        ]
        names = sorted({k for r in recs for k in r["milliseconds"]} - {"host_reorder", "ops"})
        for name in names:
            # speed-up over the portable form; dmmha_beams against ops plus the reorder it saves
            pts = [
                (
                    r["rows"],
                    (ms["ops"] + (ms.get("host_reorder", 0.0) if name == "dmmha_beams" else 0.0)) / ms[name],
                )
                for r in recs
                if name in (ms := r["milliseconds"]) and "ops" in ms
            ]
            label = "dmmha_beams vs ops + reorder" if name == "dmmha_beams" else name
            ax.plot(*zip(*pts), marker="o", label=label, lw=1.2)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        what = f"cache {extra}" if block == "self" else f"{extra} row(s)/source"
        ax.set(
            title=f"{block}-attention, {what}, {threads} thread(s)",
            xlabel="rows",
            ylabel="speed-up over ops (portable)",
        )
        ax.title.set_fontsize(8)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(
        f"{out['layers']} layers x {out['heads']} heads x d_k {out['head_size']}, "
        f"source {out['src_len']}, ONNX Runtime {out['onnxruntime']}, {out.get('clock', 'wall')} clock",
        fontsize=9,
    )
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def demo_moved_rows(sources: int = 64, beams: int = 4, new_tokens: int = 48) -> dict:
    """How many rows a beam step's reorder moves in real decodes: beam search on the bundled demo
    model (``EagerRunner``, its held-out sources), every ``reorder`` call counted: the fraction
    of rows that take another row's cache, and the same weighted by the prefix length (the
    bytes a reorder moves)."""
    import torch

    from transformer_ext import demo
    from transformer_ext.checkpoint import load_model
    from transformer_ext.decoding.beam import beam_search
    from transformer_ext.runtimes.eager import EagerRunner
    from transformer_ext.tokenizer import load_tokenizer

    folder = os.path.join(os.path.dirname(HERE), "transformer_ext", "demo_model")
    model, tok = load_model(folder).eval(), load_tokenizer(folder)
    runner, calls = EagerRunner(model), []
    reorder = runner.reorder

    def counted(state, beam_index):
        index = np.asarray(beam_index)
        calls.append((index.size, int((index != np.arange(index.size)).sum()), state.cache.length))
        return reorder(state, beam_index)

    runner.reorder = counted
    ids = [tok.encode_source(s) for s, _ in demo.heldout_examples(sources)]
    src = np.zeros((len(ids), max(map(len, ids))), np.int64)
    for i, x in enumerate(ids):
        src[i, : len(x)] = x
    lengths = np.array([len(x) for x in ids], np.int64)
    with torch.inference_mode():
        beam_search(
            runner, src, lengths, bos_id=tok.bos_id, eos_id=tok.eos_id, beam_size=beams,
            max_decoding_length=new_tokens, remove_finished=False,
        )  # fmt: skip
    rows = sum(c[0] for c in calls)
    return {
        "steps": len(calls),
        "moved_rows": sum(c[1] for c in calls) / rows,
        "moved_bytes": sum(c[1] * c[2] for c in calls) / max(1, sum(c[0] * c[2] for c in calls)),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_arguments(
        p,
        name="probe_step_attention",
        beams_help="beams per source (cross-attention and dmmha_beams)",
        cache_lens="24,72",
        threads="1,2",
        win_help="speed-up that counts as a clear win",
        quick_help="a smoke run: rows 4,16, five layers, cache 24, 1 thread, 3 runs",
    )
    p.add_argument(
        "--moved-rows",
        type=float,
        default=0.25,
        help="fraction of rows whose cache host_reorder moves (beam 4 on the demo model: 0.24 a step)",
    )
    p.add_argument(
        "--measure-moved-rows",
        action="store_true",
        help="only count the rows beam search's reorder moves on the demo model (beam 4, 64 sources), print it",
    )
    args = p.parse_args(argv)
    if args.measure_moved_rows:
        print(demo_moved_rows(beams=args.beams))
        return 0
    if args.quick:
        args.rows, args.layers, args.threads, args.runs, args.cache_lens = "4,16", 5, "1", 3, "24"
        args.min_time = 0.0
    rows, threads, cache_lens = harness.checked_lists(p, args)
    if not 0.0 <= args.moved_rows <= 1.0:
        p.error(f"--moved-rows: expected a fraction in [0, 1], got {args.moved_rows}")
    out = {
        **harness.header(args, cache_lens),
        "moved_rows": args.moved_rows,
        "load_average_before": list(os.getloadavg()),
    }
    out["results"] = harness.run_cases(args, rows, threads, cache_lens, self_case, cross_case)
    harness.finish(out, args.out, summarize(out["results"], args.win), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
