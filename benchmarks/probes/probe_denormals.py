"""What denormal floats cost ONNX Runtime's CPU Softmax, and what flushing them to zero saves.

    python -m benchmarks.probes.probe_denormals                       # [104, 4, 40, 40], a quarter padded
    python -m benchmarks.probes.probe_denormals --batch 16 --heads 8 --src-len 24 --threads 2

One ``Softmax`` over float32 ``[batch, heads, S, S]`` scores (``--batch``, ``--heads``,
``--src-len``), in a session of ONNX Runtime's CPU provider with ``--threads`` intra-op threads,
on random scores and on the same scores with the last ``--padded`` fraction of every row at
``-inf`` (an additive padding bias: ``exp(-inf - max)`` passes through a denormal), each with and
without FTZ / DAZ: ``flushed`` variants run inside
:func:`transformer_ext.runtimes.denormals.call` in a session made the way ``OrtRunner`` makes
its own (inside that call, with ``session.set_denormal_as_zero``, so its pool threads flush
too). Timed interleaved in one process (``common.time_side_by_side``, medians); the outputs of
the flushed and plain runs are compared. The encoder of an export, flushed or not:
``benchmarks/probes/ab_encoder.py``. JSON at ``--out`` with the machine and the load average before
and after.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (results/ lives here)

from benchmarks.common import lscpu, time_side_by_side, write_json


def _softmax_session(threads: int, flush: bool):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from transformer_ext.runtimes import denormals

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, None)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], "softmax", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if flush:
        for key, value in denormals.session_config().items():
            options.add_session_config_entry(key, value)
    make = ort.InferenceSession
    args = (model.SerializeToString(), options, ["CPUExecutionProvider"])
    return denormals.call(make, *args) if flush else make(*args)


def probe_softmax(batch: int, heads: int, src_len: int, padded: float, threads: int, repeats: int) -> dict:
    from transformer_ext.runtimes import denormals

    sessions = {False: _softmax_session(threads, False), True: _softmax_session(threads, True)}
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((batch, heads, src_len, src_len)).astype(np.float32)
    masked = scores.copy()
    masked[..., src_len - int(round(padded * src_len)) :] = -np.inf
    fns = {}
    differences = {}
    for label, x in (("random", scores), ("padded", masked)):
        feed = {"x": x}
        fns[label] = lambda feed=feed: sessions[False].run(None, feed)
        fns[f"{label}_flushed"] = lambda feed=feed: denormals.call(sessions[True].run, None, feed)
        differences[label] = float(np.abs(fns[label]()[0] - fns[f"{label}_flushed"]()[0]).max())
    ms = {k: v * 1e3 for k, v in time_side_by_side(fns, "cpu", repeats=repeats).items()}
    return {
        "shape": [batch, heads, src_len, src_len],
        "padded_fraction": padded,
        "milliseconds": ms,
        "padded_over_flushed": ms["padded"] / ms["padded_flushed"],
        "padded_over_random": ms["padded"] / ms["random"],
        "max_abs_difference_flushed": differences,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 2)[2],
    )
    p.add_argument("--batch", type=int, default=104, help="sources in the batch (default: %(default)s)")
    p.add_argument("--heads", type=int, default=4, help="heads of the Softmax probe (default: %(default)s)")
    p.add_argument("--src-len", type=int, default=40, help="source length (default: %(default)s)")
    p.add_argument(
        "--padded",
        type=float,
        default=0.25,
        help="padded fraction of each Softmax row (default: %(default)s)",
    )
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=15, help="interleaved timings (default: %(default)s)")
    p.add_argument("--out", default="benchmarks/results/probe_denormals.json", help="JSON result file")
    args = p.parse_args(argv)
    for name in ("batch", "heads", "src_len", "threads", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0.0 <= args.padded < 1.0:
        p.error(f"--padded must be in [0, 1), got {args.padded}")

    from transformer_ext.runtimes import denormals

    if not denormals.AVAILABLE:
        print("denormals.AVAILABLE is False on this platform: nothing to compare", file=sys.stderr)
        return 1
    load_before = os.getloadavg()
    softmax = probe_softmax(args.batch, args.heads, args.src_len, args.padded, args.threads, args.repeats)
    payload = {
        "benchmark": "probe_denormals",
        "threads": args.threads,
        "machine": {"lscpu": lscpu(), "cpu_count": os.cpu_count()},
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "softmax": softmax,
    }
    write_json(args.out, payload)
    for k, v in softmax["milliseconds"].items():
        print(f"softmax {k:>16}: {v:7.3f} ms")
    print(f"softmax padded / padded_flushed: {softmax['padded_over_flushed']:.2f}x")
    print(f"load average before {load_before[0]:.2f}, after {payload['load_average']['after'][0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
