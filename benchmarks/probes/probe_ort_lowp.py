"""Does ONNX Runtime's CPU provider run the decoder step's products in float16 or bfloat16, and how fast?

    python -m benchmarks.probes.probe_ort_lowp            # the base decoder's shapes, 1 and 2 threads
    python -m benchmarks.probes.probe_ort_lowp --quick    # a smoke run (tiny shapes, one repeat)

For each element type (float32, float16, bfloat16) and each op a low-precision step graph
would hold between the float32 softmax and normalisations (``MatMul`` with a weight
initializer, ``Gemm``, ``Add``, ``Relu``), a one-node graph behind ``Cast`` nodes (float32 in and
out, so numpy feeds it; numpy has no bfloat16) is handed to an ``InferenceSession`` on the CPU
provider at optimisation level ``all``: accepted, or the provider's error (no kernel for the
type). Where ``MatMul`` is accepted it is timed against float32 at 1, 16 and 64 rows by the
base decoder's weight shapes ([512, 2048], [2048, 512], [512, 8000]), interleaved repeats,
medians, the casts included in every type (they are in the float32 graph too), and checked
against a float64 product of the same (rounded) operands.

Imports numpy, onnx and onnxruntime only (no torch). Writes
``benchmarks/results/probe_ort_lowp.json``, with the machine record (CPU flags, native bfloat16).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import numpy as np

from benchmarks.common import bf16_record, lscpu, time_side_by_side, write_json

logger = logging.getLogger("probe_ort_lowp")
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (results/ lives here)
TYPES = ("float32", "float16", "bfloat16")
OPS = ("MatMul", "Gemm", "Add", "Relu")
ROWS = (1, 16, 64)
SHAPES = ((512, 2048), (2048, 512), (512, 8000))  # (in, out) of the base decoder's products
QUICK_SHAPES = ((64, 128),)


def _elem(name: str) -> int:
    from onnx import TensorProto

    return {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}[
        name
    ]


def _rounded(a: np.ndarray, name: str) -> np.ndarray:
    """``a`` rounded to ``name`` and back to float32 (bfloat16: nearest even on the top 16 bits)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if name == "float16":
        return a.astype(np.float16).astype(np.float32)
    if name == "bfloat16":
        bits = a.view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
        return bits.astype(np.uint32).view(np.float32)
    return a


def _initializer(name: str, array: np.ndarray, elem: str):
    """An initializer of element type ``elem`` holding ``array`` (rounded)."""
    from onnx import TensorProto, helper, numpy_helper

    if elem == "float32":
        return numpy_helper.from_array(np.asarray(array, dtype=np.float32), name)
    if elem == "float16":
        return numpy_helper.from_array(np.asarray(array, dtype=np.float16), name)
    raw = (_rounded(array, "bfloat16").view(np.uint32) >> 16).astype(np.uint16)
    return helper.make_tensor(name, TensorProto.BFLOAT16, list(array.shape), raw.tobytes(), raw=True)


def one_node_graph(op: str, elem: str, k: int, n: int, seed: int = 0):
    """``y = Cast<float32>(op(Cast<elem>(x), W))`` with x float32 ``[rows, k]`` (rows dynamic)."""
    import onnx
    from onnx import TensorProto, helper

    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    low = _elem(elem)
    nodes = [helper.make_node("Cast", ["x"], ["xl"], to=low)]
    inits = []
    out_dim = n
    if op == "MatMul":
        inits.append(_initializer("W", weight, elem))
        nodes.append(helper.make_node("MatMul", ["xl", "W"], ["yl"]))
    elif op == "Gemm":
        inits += [_initializer("W", weight, elem), _initializer("b", np.zeros(n, np.float32), elem)]
        nodes.append(helper.make_node("Gemm", ["xl", "W", "b"], ["yl"]))
    elif op == "Add":
        inits.append(_initializer("b", rng.standard_normal(k).astype(np.float32), elem))
        nodes.append(helper.make_node("Add", ["xl", "b"], ["yl"]))
        out_dim = k
    elif op == "Relu":
        nodes.append(helper.make_node("Relu", ["xl"], ["yl"]))
        out_dim = k
    else:
        raise ValueError(f"unknown op {op!r}")
    nodes.append(helper.make_node("Cast", ["yl"], ["y"], to=TensorProto.FLOAT))
    graph = helper.make_graph(
        nodes,
        f"{op}_{elem}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", out_dim])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    return model, weight


def make_session(model, threads: int):
    """A CPU session (level ``all``), or ``(None, the provider's first error line)``."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    try:
        return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]), None
    except Exception as exc:  # noqa: BLE001 - the provider's refusal is the finding
        return None, str(exc).strip().splitlines()[0][:300]


def probe_support(k: int, n: int) -> dict:
    """Per op and type: accepted by the CPU provider, and a run on 2 rows that gives finite values."""
    support = {}
    for op in OPS:
        for elem in TYPES:
            model, _ = one_node_graph(op, elem, k, n)
            sess, error = make_session(model, 1)
            entry = {"accepted": sess is not None, "error": error}
            if sess is not None:
                try:
                    y = sess.run(None, {"x": np.ones((2, k), np.float32)})[0]
                    entry["runs"] = bool(np.isfinite(y).all())
                except Exception as exc:  # noqa: BLE001
                    entry.update(runs=False, error=str(exc).strip().splitlines()[0][:300])
            support[f"{op}/{elem}"] = entry
            logger.info("%-8s %-8s %s", op, elem, "accepted" if sess is not None else f"refused: {error}")
    return support


def time_matmuls(shapes, rows_list, threads_list, repeats: int) -> list:
    """MatMul per accepted type, timed side by side at each (shape, rows, threads)."""
    cases = []
    for threads in threads_list:
        for k, n in shapes:
            graphs = {}
            for elem in TYPES:
                model, weight = one_node_graph("MatMul", elem, k, n)
                sess, _ = make_session(model, threads)
                if sess is not None:
                    graphs[elem] = (sess, _rounded(weight, elem).astype(np.float64))
            for rows in rows_list:
                x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
                errors = {}
                for elem, (sess, w64) in graphs.items():
                    want = _rounded(x, elem).astype(np.float64) @ w64
                    got = sess.run(None, {"x": x})[0]
                    errors[elem] = float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))
                fns = {
                    elem: (lambda s=sess, x=x: s.run(None, {"x": x})) for elem, (sess, _) in graphs.items()
                }
                seconds = time_side_by_side(fns, "cpu", repeats=repeats)
                case = {
                    "threads": threads,
                    "k": k,
                    "n": n,
                    "rows": rows,
                    "seconds": seconds,
                    "gflops": {e: 2.0 * rows * k * n / s / 1e9 for e, s in seconds.items()},
                    "speedup_vs_float32": {e: seconds["float32"] / s for e, s in seconds.items()},
                    "relative_error_vs_float64": errors,
                }
                cases.append(case)
                logger.info(
                    "%d threads  [%d, %d] x [%d, %d]  %s",
                    threads,
                    rows,
                    k,
                    k,
                    n,
                    "  ".join(f"{e} {g:.1f} GFLOP/s" for e, g in case["gflops"].items()),
                )
    return cases


def run(quick: bool, threads_list, repeats: int, out: str) -> dict:
    import onnx
    import onnxruntime as ort

    shapes = QUICK_SHAPES if quick else SHAPES
    k, n = shapes[0]
    results = {
        "onnxruntime": ort.__version__,
        "onnx": onnx.__version__,
        "providers": ort.get_available_providers(),
        "machine": lscpu(),
        "bf16": bf16_record(),
        "support": probe_support(k, n),
        "matmul": time_matmuls(shapes, (1, 2) if quick else ROWS, threads_list, repeats),
        "torch_imported": "torch" in sys.modules,
    }
    write_json(out, results)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes, 1 repeat: checks that the script works")
    p.add_argument("--threads", default="1,2", help="comma-separated intra-op thread counts (default 1,2)")
    p.add_argument("--repeats", type=int, default=7, help="interleaved timing rounds (default 7)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "probe_ort_lowp.json"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        threads = [int(t) for t in args.threads.split(",") if t.strip()]
    except ValueError:
        p.error(f"--threads must be comma-separated integers, got {args.threads!r}")
    if not threads or min(threads) < 1 or args.repeats < 1:
        p.error("--threads values and --repeats must be >= 1")
    run(args.quick, threads, 1 if args.quick else args.repeats, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
