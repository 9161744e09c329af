"""Two ways to write a decoder step's one-row attention scores in standard ONNX ops, timed in ONNX Runtime.

    python -m benchmarks.probes.probe_score_products                 # the shapes below, 1 and 2 threads

A step's scores over the cache are ``q [R, H, 1, D]`` against ``k [R, H, L, D]``: one row per
beam and head. The export writes them as ``MatMul(q, Transpose(k))`` (ONNX Runtime fuses the
transpose: one small GEMM per row and head). The alternative without a GEMM is
``ReduceSum(Mul(q, k), axis=-1)``, a broadcast product and a reduction, which the step graph
already uses for the new token's own score. This builds a two-node graph of each, runs both on
the same random inputs (``--runs`` interleaved timed runs after a warm-up, medians, microseconds) for each
shape (rows R, heads H, cache L, head size D: the demo model's ~100-row batches and ``base`` at
64 and 256 rows) and thread count, and checks that they agree. JSON at ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (results/ lives here)

from benchmarks.common import lscpu, time_side_by_side, write_json

SHAPES = [(104, 4, 32, 16), (64, 8, 32, 64), (256, 8, 32, 64)]  # (rows, heads, cache, head size)


def graph(kind: str, R: int, H: int, L: int, D: int) -> bytes:
    from onnx import TensorProto, helper

    q = helper.make_tensor_value_info("q", TensorProto.FLOAT, [R, H, 1, D])
    k = helper.make_tensor_value_info("k", TensorProto.FLOAT, [R, H, L, D])
    out = helper.make_tensor_value_info("scores", TensorProto.FLOAT, None)
    if kind == "matmul":
        inits = []
        nodes = [
            helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
            helper.make_node("MatMul", ["q", "kt"], ["scores"]),  # [R, H, 1, L]
        ]
    else:
        inits = [helper.make_tensor("axis", TensorProto.INT64, [1], [-1])]
        nodes = [
            helper.make_node("Mul", ["q", "k"], ["products"]),  # [R, H, L, D]
            helper.make_node("ReduceSum", ["products", "axis"], ["scores"], keepdims=1),  # [R, H, L, 1]
        ]
    model = helper.make_model(
        helper.make_graph(nodes, kind, [q, k], [out], initializer=inits),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    model.ir_version = 9
    return model.SerializeToString()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2", help="comma-separated intra-op thread counts")
    p.add_argument("--runs", type=int, default=200, help="timed runs per graph (median)")
    p.add_argument(
        "--out", default=os.path.join(HERE, "results", "probe_score_products.json"), help="JSON path"
    )
    args = p.parse_args(argv)
    try:
        threads = [int(t) for t in args.threads.split(",") if t]
    except ValueError:
        p.error(f"--threads: expected comma-separated integers, got {args.threads!r}")
    if not threads or min(threads) < 1 or args.runs < 1:
        p.error("--threads and --runs must be at least 1")

    import onnxruntime as ort

    out = {"machine": lscpu(), "runs": args.runs, "load_average_before": os.getloadavg(), "results": []}
    rng = np.random.default_rng(0)
    for R, H, L, D in SHAPES:
        q = rng.standard_normal((R, H, 1, D), dtype=np.float32)
        k = rng.standard_normal((R, H, L, D), dtype=np.float32)
        for n in threads:
            so = ort.SessionOptions()
            so.intra_op_num_threads = n
            sessions = {
                kind: ort.InferenceSession(graph(kind, R, H, L, D), so, providers=["CPUExecutionProvider"])
                for kind in ("matmul", "mul_reducesum")
            }
            got = {kind: s.run(None, {"q": q, "k": k})[0] for kind, s in sessions.items()}
            np.testing.assert_allclose(
                got["matmul"].reshape(R, H, L), got["mul_reducesum"].reshape(R, H, L), rtol=1e-4, atol=1e-4
            )
            feed = {"q": q, "k": k}
            fns = {kind: functools.partial(s.run, None, feed) for kind, s in sessions.items()}
            seconds = time_side_by_side(fns, "cpu", repeats=args.runs, min_time=0.0)
            us = {kind: t * 1e6 for kind, t in seconds.items()}
            rec = {"rows": R, "heads": H, "cache": L, "head_size": D, "threads": n, "microseconds": us}
            rec["mul_reducesum_over_matmul"] = us["mul_reducesum"] / us["matmul"]
            out["results"].append(rec)
            print(
                f"R={R:3d} H={H} L={L} D={D:2d} {n} thread(s): MatMul {us['matmul']:8.1f} us, "
                f"Mul+ReduceSum {us['mul_reducesum']:8.1f} us ({rec['mul_reducesum_over_matmul']:.2f}x the time)",
                flush=True,
            )
    out["load_average_after"] = os.getloadavg()
    write_json(args.out, out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
