"""A decoder step's attention in standard ONNX ops (the portable export) against ONNX Runtime's CPU
contrib attention operators, timed at the size of a whole step's attention.

    python -m benchmarks.probes.probe_contrib_attention                # base: 6 layers, 8 heads, d_k 64

Two blocks of ``--layers`` layers, each layer with tensors of its own (so a step's data, not one
layer's, meets the caches), every variant fed the same values:

* **Self-attention over the cache** at ``--position`` tokens already cached (capacity
  ``--cache-len``). ``ops``: what ``export/lowering.py`` emits for ``decode_attention`` with the
  new token's K/V (a ``MatMul`` over the cache plus an additive mask, the new token's score by
  ``Mul`` + ``ReduceSum``, ``Concat``, ``Softmax``, two ``Slice`` s, ``MatMul`` + ``Mul`` +
  ``Add``); the runner's append of the new K/V is not timed. ``gqa``: one
  ``com.microsoft.GroupQueryAttention`` per layer (``kv_num_heads = num_heads``), its past and
  present K/V bound to one buffer (IO binding), so the append happens inside the operator.
* **Cross-attention** over ``--src-len`` source positions with K/V once per source and
  ``--beam-size`` rows per source. ``ops``: the export's grouped form (``Reshape`` / ``Transpose``
  of the queries, ``MatMul``, additive mask, ``Softmax``, ``MatMul``, back). ``mha``: one
  ``com.microsoft.MultiHeadAttention`` per layer, the beams as the query sequence, the K/V in
  the ``[B, H, S, D]`` layout it takes as precomputed keys, the padding as ``key_padding_mask``.

Both forms of each block are checked to agree, then timed in rounds interleaved after a warm-up
(``common.time_side_by_side``, medians) per row count and thread count; the ratio is ``ops``
time over the contrib time (above 1: the contrib operator is faster). It measures whether an
``ort`` flavour built on these operators would pay before building one. JSON at ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import numpy as np

from transformer_ext.cli import add_option

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (results/ lives here)

from benchmarks.common import lscpu, time_side_by_side, write_json

NEG_INF = float("-inf")


def _model(nodes, inputs, outputs, inits, name: str) -> bytes:
    from onnx import helper

    model = helper.make_model(
        helper.make_graph(nodes, name, inputs, outputs, initializer=inits),
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)],
    )
    model.ir_version = 9
    return model.SerializeToString()


def self_graph(contrib: bool, layers: int, R: int, H: int, L: int, D: int) -> bytes:
    """Per layer: ``q``/``k``/``v`` ``[R, H, 1, D]`` (``[R, 1, H*D]`` for the contrib form), the
    caches ``[R, H, L, D]`` and the positions; output ``[R, H, 1, D]`` (``[R, 1, H*D]``)."""
    from onnx import TensorProto, helper

    f, i64, i32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
    nodes, inputs, outputs, inits = [], [], [], []
    if contrib:
        inputs += [
            helper.make_tensor_value_info("seqlens_k", i32, [R]),
            helper.make_tensor_value_info("total_len", i32, []),
        ]
    else:
        inputs.append(helper.make_tensor_value_info("positions", i64, [R]))
        inits += [
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
        ]
        nodes += [  # the shared additive mask [R, 1, 1, L]: position j < positions[r]
            helper.make_node("Range", ["r0", "rL", "r1"], ["key_pos"]),
            helper.make_node("Reshape", ["positions", "col"], ["pos_col"]),
            helper.make_node("Less", ["key_pos", "pos_col"], ["allowed"]),
            helper.make_node("Where", ["allowed", "zero", "neg_inf"], ["bias"]),
        ]
    for i in range(layers):
        names = [f"{n}{i}" for n in ("q", "k", "v", "kc", "vc")]
        q, k, v, kc, vc = names
        if contrib:
            inputs += [helper.make_tensor_value_info(n, f, [R, 1, H * D]) for n in (q, k, v)]
            inputs += [helper.make_tensor_value_info(n, f, [R, H, L, D]) for n in (kc, vc)]
            nodes.append(
                helper.make_node(
                    "GroupQueryAttention",
                    [q, k, v, kc, vc, "seqlens_k", "total_len"],
                    [f"out{i}", f"present_k{i}", f"present_v{i}"],
                    domain="com.microsoft",
                    num_heads=H,
                    kv_num_heads=H,
                    scale=1.0,
                )
            )
            outputs += [
                helper.make_tensor_value_info(f"out{i}", f, [R, 1, H * D]),
                helper.make_tensor_value_info(f"present_k{i}", f, [R, H, L, D]),
                helper.make_tensor_value_info(f"present_v{i}", f, [R, H, L, D]),
            ]
            continue
        inputs += [helper.make_tensor_value_info(n, f, [R, H, 1, D]) for n in (q, k, v)]
        inputs += [helper.make_tensor_value_info(n, f, [R, H, L, D]) for n in (kc, vc)]
        nodes += [
            helper.make_node("Transpose", [kc], [f"kt{i}"], perm=[0, 1, 3, 2]),
            helper.make_node("MatMul", [q, f"kt{i}"], [f"s{i}"]),
            helper.make_node("Add", [f"s{i}", "bias"], [f"sb{i}"]),
            helper.make_node("Mul", [q, k], [f"qk{i}"]),
            helper.make_node("ReduceSum", [f"qk{i}", "last"], [f"sn{i}"], keepdims=1),
            helper.make_node("Concat", [f"sb{i}", f"sn{i}"], [f"sa{i}"], axis=-1),
            helper.make_node("Softmax", [f"sa{i}"], [f"p{i}"], axis=-1),
            helper.make_node("Slice", [f"p{i}", "start0", "keys", "axis3"], [f"pc{i}"]),
            helper.make_node("Slice", [f"p{i}", "start_last", "end_max", "axis3"], [f"pn{i}"]),
            helper.make_node("MatMul", [f"pc{i}", vc], [f"oc{i}"]),
            helper.make_node("Mul", [f"pn{i}", v], [f"on{i}"]),
            helper.make_node("Add", [f"oc{i}", f"on{i}"], [f"out{i}"]),
        ]
        outputs.append(helper.make_tensor_value_info(f"out{i}", f, [R, H, 1, D]))
    return _model(nodes, inputs, outputs, inits, "self_attention")


def cross_graph(contrib: bool, layers: int, B: int, K: int, H: int, S: int, D: int) -> bytes:
    """Per layer: ``q`` ``[R, H, 1, D]`` (``[B, K, H*D]`` for the contrib form), K/V once per
    source ``[B, H, S, D]``; the source mask from ``lengths``."""
    from onnx import TensorProto, helper

    f, i64, i32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
    R = B * K
    nodes, inputs, outputs, inits = [], [], [], []
    if contrib:
        inputs.append(helper.make_tensor_value_info("key_padding_mask", i32, [B, S]))
    else:
        inputs.append(helper.make_tensor_value_info("lengths", i64, [R]))
        inits += [
            helper.make_tensor("zero", f, [], [0.0]),
            helper.make_tensor("neg_inf", f, [], [NEG_INF]),
            helper.make_tensor("col", i64, [2], [-1, 1]),
            helper.make_tensor("grouped", i64, [4], [B, K, H, D]),
            helper.make_tensor("flat", i64, [4], [R, H, 1, D]),
            helper.make_tensor("bias_shape", i64, [4], [B, 1, K, S]),
            helper.make_tensor("r0", i64, [], [0]),
            helper.make_tensor("rS", i64, [], [S]),
            helper.make_tensor("r1", i64, [], [1]),
        ]
        nodes += [
            helper.make_node("Range", ["r0", "rS", "r1"], ["src_pos"]),
            helper.make_node("Reshape", ["lengths", "col"], ["len_col"]),
            helper.make_node("Less", ["src_pos", "len_col"], ["allowed"]),
            helper.make_node("Where", ["allowed", "zero", "neg_inf"], ["bias_rows"]),
            helper.make_node("Reshape", ["bias_rows", "bias_shape"], ["bias"]),
        ]
    for i in range(layers):
        q, k, v = f"q{i}", f"k{i}", f"v{i}"
        inputs += [helper.make_tensor_value_info(n, f, [B, H, S, D]) for n in (k, v)]
        if contrib:
            inputs.append(helper.make_tensor_value_info(q, f, [B, K, H * D]))
            nodes.append(
                helper.make_node(
                    "MultiHeadAttention",
                    [q, k, v, "", "key_padding_mask"],
                    [f"out{i}"],
                    domain="com.microsoft",
                    num_heads=H,
                    scale=1.0,
                )
            )
            outputs.append(helper.make_tensor_value_info(f"out{i}", f, [B, K, H * D]))
            continue
        inputs.append(helper.make_tensor_value_info(q, f, [R, H, 1, D]))
        nodes += [
            helper.make_node("Reshape", [q, "grouped"], [f"qg{i}"]),
            helper.make_node("Transpose", [f"qg{i}"], [f"qr{i}"], perm=[0, 2, 1, 3]),
            helper.make_node("Transpose", [k], [f"kt{i}"], perm=[0, 1, 3, 2]),
            helper.make_node("MatMul", [f"qr{i}", f"kt{i}"], [f"s{i}"]),
            helper.make_node("Add", [f"s{i}", "bias"], [f"sb{i}"]),
            helper.make_node("Softmax", [f"sb{i}"], [f"p{i}"], axis=-1),
            helper.make_node("MatMul", [f"p{i}", v], [f"o{i}"]),
            helper.make_node("Transpose", [f"o{i}"], [f"ot{i}"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", [f"ot{i}", "flat"], [f"out{i}"]),
        ]
        outputs.append(helper.make_tensor_value_info(f"out{i}", f, [R, H, 1, D]))
    return _model(nodes, inputs, outputs, inits, "cross_attention")


def _session(model: bytes, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _bound_run(session, binding):
    session.run_with_iobinding(binding)


def self_case(args, R: int, threads: int, rng) -> dict:
    L, H, D, layers, p = args.cache_len, args.heads, args.head_size, args.layers, args.position
    q = [rng.standard_normal((R, H, 1, D), dtype=np.float32) * 0.125 for _ in range(layers)]
    k = [rng.standard_normal((R, H, 1, D), dtype=np.float32) for _ in range(layers)]
    v = [rng.standard_normal((R, H, 1, D), dtype=np.float32) for _ in range(layers)]
    kc = [rng.standard_normal((R, H, L, D), dtype=np.float32) for _ in range(layers)]
    vc = [rng.standard_normal((R, H, L, D), dtype=np.float32) for _ in range(layers)]
    ops = _session(self_graph(False, layers, R, H, L, D), threads)
    feeds = {"positions": np.full(R, p, np.int64)}
    for i in range(layers):
        feeds |= {f"q{i}": q[i], f"k{i}": k[i], f"v{i}": v[i], f"kc{i}": kc[i], f"vc{i}": vc[i]}
    want = ops.run(None, feeds)

    gqa = _session(self_graph(True, layers, R, H, L, D), threads)
    binding = gqa.io_binding()
    kept = []  # the arrays the binding points at stay alive

    def bind_in(name, a):
        a = np.ascontiguousarray(a)
        kept.append(a)
        binding.bind_input(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
        return a

    bind_in("seqlens_k", np.full(R, p, np.int32))  # total length - 1: the new token's index
    bind_in("total_len", np.array(p + 1, np.int32))
    outs = []
    for i in range(layers):
        bind_in(f"q{i}", q[i].reshape(R, 1, H * D))
        bind_in(f"k{i}", k[i].reshape(R, 1, H * D))
        bind_in(f"v{i}", v[i].reshape(R, 1, H * D))
        for name, cache in ((f"kc{i}", kc[i]), (f"vc{i}", vc[i])):
            buf = bind_in(name, cache.copy())
            present = name.replace("kc", "present_k").replace("vc", "present_v")
            binding.bind_output(present, "cpu", 0, buf.dtype, list(buf.shape), buf.ctypes.data)
        out = np.empty((R, 1, H * D), np.float32)
        kept.append(out)
        outs.append(out)
        binding.bind_output(f"out{i}", "cpu", 0, out.dtype, list(out.shape), out.ctypes.data)
    gqa.run_with_iobinding(binding)
    for a, b in zip(want, outs):
        np.testing.assert_allclose(a.reshape(R, H * D), b.reshape(R, H * D), rtol=1e-4, atol=1e-5)
    fns = {"ops": functools.partial(ops.run, None, feeds), "gqa": functools.partial(_bound_run, gqa, binding)}
    ms = {name: t * 1e3 for name, t in time_side_by_side(fns, "cpu", repeats=args.runs, min_time=0.0).items()}
    return {
        "block": "self",
        "rows": R,
        "threads": threads,
        "milliseconds": ms,
        "ops_over_contrib": ms["ops"] / ms["gqa"],
    }


def cross_case(args, B: int, threads: int, rng) -> dict:
    K, H, S, D, layers = args.beams, args.heads, args.src_len, args.head_size, args.layers
    R = B * K
    lengths = rng.integers(1, S + 1, size=B)
    lengths[0] = S
    q = [rng.standard_normal((R, H, 1, D), dtype=np.float32) * 0.125 for _ in range(layers)]
    kv = [rng.standard_normal((B, H, S, D), dtype=np.float32) for _ in range(2 * layers)]
    ops = _session(cross_graph(False, layers, B, K, H, S, D), threads)
    feeds = {"lengths": np.repeat(lengths, K).astype(np.int64)}
    contrib_feeds = {"key_padding_mask": (np.arange(S)[None, :] < lengths[:, None]).astype(np.int32)}
    for i in range(layers):
        feeds |= {f"q{i}": q[i], f"k{i}": kv[2 * i], f"v{i}": kv[2 * i + 1]}
        contrib_feeds |= {f"q{i}": q[i].reshape(B, K, H * D), f"k{i}": kv[2 * i], f"v{i}": kv[2 * i + 1]}
    mha = _session(cross_graph(True, layers, B, K, H, S, D), threads)
    for a, b in zip(ops.run(None, feeds), mha.run(None, contrib_feeds)):
        np.testing.assert_allclose(a.reshape(R, H * D), b.reshape(R, H * D), rtol=1e-4, atol=1e-5)
    fns = {
        "ops": functools.partial(ops.run, None, feeds),
        "mha": functools.partial(mha.run, None, contrib_feeds),
    }
    ms = {name: t * 1e3 for name, t in time_side_by_side(fns, "cpu", repeats=args.runs, min_time=0.0).items()}
    return {
        "block": "cross",
        "rows": R,
        "sources": B,
        "threads": threads,
        "milliseconds": ms,
        "ops_over_contrib": ms["ops"] / ms["mha"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,4,64,256", help="comma-separated decoder rows (sources x beams)")
    add_option(
        p,
        "--beam-size",
        deprecated=("--beams",),
        dest="beams",
        type=int,
        default=4,
        help="rows per source in the cross-attention block",
    )
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--cache-len", type=int, default=48, help="self-attention cache capacity")
    p.add_argument("--position", type=int, default=40, help="tokens already in the cache")
    p.add_argument("--src-len", type=int, default=24)
    p.add_argument("--threads", default="2,1", help="comma-separated intra-op thread counts")
    p.add_argument("--runs", type=int, default=30, help="timed runs per graph (median)")
    p.add_argument(
        "--out", default=os.path.join(HERE, "results", "probe_contrib_attention.json"), help="JSON path"
    )
    args = p.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",") if r]
        threads = [int(t) for t in args.threads.split(",") if t]
    except ValueError:
        p.error("--rows and --threads take comma-separated integers")
    sizes = [args.beams, args.layers, args.heads, args.head_size, args.cache_len, args.src_len, args.runs]
    if not rows or not threads or min(rows + threads + sizes) < 1:
        p.error("every size, --rows, --threads and --runs must be at least 1")
    if not 0 <= args.position < args.cache_len:
        p.error("--position must be in [0, --cache-len)")

    out = {
        "machine": lscpu(),
        "layers": args.layers,
        "heads": args.heads,
        "head_size": args.head_size,
        "cache_len": args.cache_len,
        "position": args.position,
        "src_len": args.src_len,
        "beams": args.beams,
        "runs": args.runs,
        "load_average_before": os.getloadavg(),
        "results": [],
    }
    import onnxruntime as ort

    out["onnxruntime"] = ort.__version__
    rng = np.random.default_rng(0)
    for n in threads:
        for R in rows:
            rec = self_case(args, R, n, rng)
            out["results"].append(rec)
            ms = rec["milliseconds"]
            print(
                f"self  {R:4d} rows, {n} thread(s): ops {ms['ops']:7.3f} ms, GroupQueryAttention "
                f"{ms['gqa']:7.3f} ms ({rec['ops_over_contrib']:.2f}x)",
                flush=True,
            )
            if R % args.beams == 0 or R == 1:
                B = max(1, R // args.beams)
                rec = cross_case(args, B, n, rng)
                out["results"].append(rec)
                ms = rec["milliseconds"]
                print(
                    f"cross {rec['rows']:4d} rows ({B} sources), {n} thread(s): ops {ms['ops']:7.3f} ms, "
                    f"MultiHeadAttention {ms['mha']:7.3f} ms ({rec['ops_over_contrib']:.2f}x)",
                    flush=True,
                )
    out["load_average_after"] = os.getloadavg()
    write_json(args.out, out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
