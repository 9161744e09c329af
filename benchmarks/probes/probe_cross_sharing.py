"""A decoder step's cross-attention with its keys and values once per beam (the export format
before version 4) or once per source (version 4 on), in standard ONNX ops, timed in ONNX Runtime
at the size of a whole step.

    python -m benchmarks.probes.probe_cross_sharing                    # base: 6 layers, 8 heads, S 24, d_k 64

Beam search decodes ``R = B * K`` rows (``B`` sources, ``K`` beams). Taken once per beam, the
step graph's ``cross_key.i`` / ``cross_value.i`` inputs are ``[R, H, S, D]``: each source's encoder
keys and values repeated for each of its beams, so a step reads them K times. Kept once per source
(``[B, H, S, D]``), a source's beams become the query rows of one product: ``q [R, H, 1, D]`` ->
``[B, H, K, D]``, ``MatMul`` with ``k^T`` -> ``[B, H, K, S]``, softmax, ``MatMul`` with ``v``,
back to ``[R, H, 1, D]``. This builds one graph of ``--layers`` such blocks for each layout, every
layer with keys and values of its own (so the data of a step, not one layer's, meets the caches),
runs both on the same values (``--runs`` interleaved timed runs after a warm-up, medians), checks that they
agree, and prints the time of each and their ratio per batch size and thread count. It measures
what an export-contract change would buy before making it. JSON at ``--out``.
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


def graph(shared: bool, layers: int, B: int, K: int, H: int, S: int, D: int) -> bytes:
    from onnx import TensorProto, helper

    R = B * K
    rows = B if shared else R
    inputs = [helper.make_tensor_value_info("q", TensorProto.FLOAT, [R, H, 1, D])]
    inits, nodes, outputs = [], [], []
    q = "q"
    if shared:  # [R, H, 1, D] -> [B, K, H, D] -> [B, H, K, D]
        inits += [
            helper.make_tensor("grouped", TensorProto.INT64, [4], [B, K, H, D]),
            helper.make_tensor("flat", TensorProto.INT64, [4], [R, H, 1, D]),
        ]
        nodes += [
            helper.make_node("Reshape", ["q", "grouped"], ["q_grouped"]),
            helper.make_node("Transpose", ["q_grouped"], ["q_rows"], perm=[0, 2, 1, 3]),
        ]
        q = "q_rows"
    for i in range(layers):
        k, v = f"k{i}", f"v{i}"
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [rows, H, S, D]) for n in (k, v)]
        nodes += [
            helper.make_node("Transpose", [k], [f"kt{i}"], perm=[0, 1, 3, 2]),
            helper.make_node("MatMul", [q, f"kt{i}"], [f"s{i}"]),
            helper.make_node("Softmax", [f"s{i}"], [f"p{i}"], axis=-1),
            helper.make_node("MatMul", [f"p{i}", v], [f"o{i}"]),
        ]
        out = f"o{i}"
        if shared:  # [B, H, K, D] -> [B, K, H, D] -> [R, H, 1, D]
            nodes += [
                helper.make_node("Transpose", [out], [f"ot{i}"], perm=[0, 2, 1, 3]),
                helper.make_node("Reshape", [f"ot{i}", "flat"], [f"out{i}"]),
            ]
            out = f"out{i}"
        outputs.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, None))
    model = helper.make_model(
        helper.make_graph(nodes, "cross", inputs, outputs, initializer=inits),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    model.ir_version = 9
    return model.SerializeToString()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="16,64", help="comma-separated sources per step")
    add_option(
        p, "--beam-size", deprecated=("--beams",), dest="beams", type=int, default=4, help="rows per source"
    )
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--src-len", type=int, default=24)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--threads", default="1,2", help="comma-separated intra-op thread counts")
    p.add_argument("--runs", type=int, default=30, help="timed runs per graph (median)")
    p.add_argument(
        "--out", default=os.path.join(HERE, "results", "probe_cross_sharing.json"), help="JSON path"
    )
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batch_sizes.split(",") if b]
        threads = [int(t) for t in args.threads.split(",") if t]
    except ValueError:
        p.error("--batch-sizes and --threads take comma-separated integers")
    sizes = (args.beams, args.layers, args.heads, args.src_len, args.head_size, args.runs)
    if not batches or not threads or min(batches + threads + list(sizes)) < 1:
        p.error("every size, --batch-sizes, --threads and --runs must be at least 1")

    import onnxruntime as ort

    K, L, H, S, D = args.beams, args.layers, args.heads, args.src_len, args.head_size
    out = {
        "machine": lscpu(),
        "beams": K,
        "layers": L,
        "heads": H,
        "src_len": S,
        "head_size": D,
        "runs": args.runs,
        "load_average_before": os.getloadavg(),
        "results": [],
    }
    rng = np.random.default_rng(0)
    for B in batches:
        R = B * K
        q = rng.standard_normal((R, H, 1, D), dtype=np.float32) * 0.125
        per_source = [rng.standard_normal((B, H, S, D), dtype=np.float32) for _ in range(2 * L)]
        feeds = {
            True: {"q": q} | {f"{'kv'[j % 2]}{j // 2}": a for j, a in enumerate(per_source)},
            False: {"q": q}
            | {f"{'kv'[j % 2]}{j // 2}": np.repeat(a, K, axis=0) for j, a in enumerate(per_source)},
        }
        for n in threads:
            so = ort.SessionOptions()
            so.intra_op_num_threads = n
            sessions = {
                shared: ort.InferenceSession(
                    graph(shared, L, B, K, H, S, D), so, providers=["CPUExecutionProvider"]
                )
                for shared in (False, True)
            }
            results = {shared: s.run(None, feeds[shared]) for shared, s in sessions.items()}
            for a, b in zip(results[False], results[True]):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
            fns = {
                ("per_source" if shared else "per_beam"): functools.partial(s.run, None, feeds[shared])
                for shared, s in sessions.items()
            }
            ms = {
                k: t * 1e3 for k, t in time_side_by_side(fns, "cpu", repeats=args.runs, min_time=0.0).items()
            }
            rec = {"batch": B, "rows": R, "threads": n, "milliseconds": ms}
            rec["per_beam_over_per_source"] = ms["per_beam"] / ms["per_source"]
            rec["bytes_read_per_beam"] = 2 * L * R * H * S * D * 4
            out["results"].append(rec)
            print(
                f"batch {B:3d} ({R} rows), {n} thread(s): K/V per beam {ms['per_beam']:7.2f} ms, "
                f"per source {ms['per_source']:7.2f} ms ({rec['per_beam_over_per_source']:.2f}x); "
                f"per-beam K/V {rec['bytes_read_per_beam'] / 1e6:.0f} MB",
                flush=True,
            )
    out["load_average_after"] = os.getloadavg()
    write_json(args.out, out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
