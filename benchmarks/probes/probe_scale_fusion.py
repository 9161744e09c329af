"""A/B of one ONNX Runtime graph optimisation on our decoder step: ``MatMulScaleFusion`` on (what
``OrtRunner`` does today) and off.

    python -m benchmarks.probes.probe_scale_fusion --exports A/base/onnx,A/base/onnx_int8 --rounds 3

ONNX Runtime folds the step graph's score scale ``Mul(MatMul(q, k^T), 1/sqrt(d_k))`` into the
``alpha`` of a ``FusedMatMul``. MLAS runs a one-row product without packing its second operand
only when ``alpha == 1`` (``MlasSgemmOperation``'s M == 1 path), so with the fusion every
``q k^T`` of a decoder step (one query row per beam and head) packs its key block first; without
it the scale is a separate ``Mul`` over the scores. This times both on the same export folders
(``bench_decode.py --artifacts A --prepare-only`` builds ``A/base/onnx`` and ``A/base/onnx_int8``),
in one process, rounds interleaved after a warm-up (``common.time_side_by_side``), medians: greedy at batch 1 and beam 4
(no length penalty) at batch 1, 16 and 64, exactly ``--new-tokens`` tokens from random sources of
length 24, and counts the sources whose tokens agree between the two. JSON at ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (results/ lives here)

from benchmarks.common import lscpu, write_json
from benchmarks.probes.ab_exports import timed_decodes

VARIANTS = {
    "today": ("SkipLayerNormFusion",),
    "no_scale_fusion": ("SkipLayerNormFusion", "MatMulScaleFusion"),
}
CASES = [("greedy", 1), ("beam4", 1), ("beam4", 16), ("beam4", 64)]


def open_runners(export_dir, threads):
    import transformer_ext.runtimes.ort as ort_runtime

    runners, saved = {}, ort_runtime.DISABLED_OPTIMIZERS
    try:
        for name, disabled in VARIANTS.items():
            ort_runtime.DISABLED_OPTIMIZERS = disabled  # read when a session is created
            runners[name] = ort_runtime.OrtRunner(export_dir, intra_op_num_threads=threads)
    finally:
        ort_runtime.DISABLED_OPTIMIZERS = saved
    return runners


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exports", required=True, help="comma-separated export folders")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per case and variant (median)")
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    p.add_argument("--new-tokens", type=int, default=48, help="tokens generated per source")
    p.add_argument(
        "--out", default=os.path.join(HERE, "results", "probe_scale_fusion.json"), help="JSON path"
    )
    args = p.parse_args(argv)
    exports = [e for e in args.exports.split(",") if e]
    for e in exports:
        if not os.path.isfile(os.path.join(e, "manifest.json")):
            p.error(f"--exports: {e} is not an export folder (no manifest.json)")
    if args.rounds < 1 or args.threads < 1 or args.new_tokens < 1:
        p.error("--rounds, --threads and --new-tokens must be at least 1")
    out = {
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "machine": lscpu(),
        "load_average_before": os.getloadavg(),
        "results": [],
    }
    for export_dir in exports:
        runners = open_runners(export_dir, args.threads)
        for mode, batch in CASES:
            rng = np.random.default_rng(0)
            src = rng.integers(4, runners["today"].info.src_vocab_size, size=(batch, 24))
            lengths = np.full(batch, 24)
            med, samples, tokens = timed_decodes(runners, mode, src, lengths, args.new_tokens, args.rounds)
            same = sum(a == b for a, b in zip(tokens["today"], tokens["no_scale_fusion"]))
            rec = {
                "export": export_dir,
                "mode": mode,
                "batch": batch,
                "seconds": med,
                "samples": samples,
                "speedup_no_scale_fusion": med["today"] / med["no_scale_fusion"],
                "same_tokens": f"{same}/{batch}",
            }
            print(
                f"{os.path.basename(export_dir):12s} {mode:6s} batch {batch:3d}: fusion on {med['today'] * 1e3:8.1f} ms, "
                f"off {med['no_scale_fusion'] * 1e3:8.1f} ms, {rec['speedup_no_scale_fusion']:.2f}x; "
                f"tokens equal {rec['same_tokens']}",
                flush=True,
            )
            out["results"].append(rec)
    out["load_average_after"] = os.getloadavg()
    write_json(args.out, out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
