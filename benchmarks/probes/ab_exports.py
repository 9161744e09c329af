"""A/B of export folders of the same model, or of ``OrtRunner`` options, through ``OrtRunner``.

    python -m benchmarks.probes.ab_exports --variant scaled=A/base/onnx_unfolded --variant folded=A/base/onnx
    python -m benchmarks.probes.ab_exports --variant fresh=A/base/onnx_int8:reuse_buffers=0 --variant pooled=A/base/onnx_int8

Each ``--variant LABEL=DIR[:OPTION=VALUE...]`` is an export folder and ``OrtRunner`` options:
boolean ones as 0 or 1 (``grow_cache``, ``reuse_buffers``, ``flush_denormals``,
``stop_spinning_after_run``) and ``few_rows=auto|never|always``, as in
``--variant dynamic=A/base/onnx_int8:few_rows=never --variant auto=A/base/onnx_int8``; two or
more, the first is the baseline. Every
variant gets an ``OrtRunner`` in this one process, with the same threads; each case is timed in
rounds interleaved in rotating order after a warm-up (``common.time_side_by_side``), medians:
greedy at batch 1 and beam 4 (no length penalty) at batch 1, 16 and 64, exactly ``--new-tokens`` tokens from random sources of length 24. Each
variant's ratio is the baseline's median time over its own (above 1: faster than the baseline),
and the sources whose best tokens equal the baseline's are counted. JSON at ``--out``.

For example, the attention scale folded into the step graph's query projections (the default
export) against the scale as a ``Mul`` on the scores (``python -m export.onnx
--no-fold-query-scale``), the same model and quantization otherwise.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (results/ lives here)

from benchmarks.common import lscpu, time_side_by_side, write_json

CASES = [("greedy", 1), ("beam4", 1), ("beam4", 16), ("beam4", 64)]


def decode(runner, mode, src, lengths, n):
    """The best hypothesis' tokens per source: profile_decode's decode (exactly ``n`` new tokens)."""
    from benchmarks.profiles.profile_decode import _decode

    rows = _decode(runner, mode, src, lengths, n)
    return [list(r) for r in rows] if mode == "greedy" else [list(h[0].tokens) for h in rows]


RUNNER_OPTIONS = ("grow_cache", "reuse_buffers", "flush_denormals", "stop_spinning_after_run")
# OrtRunner options that take one of several words rather than 0 / 1.
WORD_OPTIONS = {"few_rows": ("auto", "never", "always")}


def timed_decodes(runners: dict, mode, src, lengths, n: int, rounds: int) -> tuple[dict, dict, dict]:
    """Whole decodes through every runner, ``rounds`` interleaved after a warm-up
    (``common.time_side_by_side``): ``(median seconds, every sample, best tokens)`` per runner.
    Every call keeps its tokens (the same each time: a fixed decode), so none is decoded extra."""
    tokens: dict = {}
    samples: dict = {}

    def run(k):
        tokens[k] = decode(runners[k], mode, src, lengths, n)

    fns = {k: functools.partial(run, k) for k in runners}
    med = time_side_by_side(fns, "cpu", repeats=rounds, min_time=0.0, samples=samples)
    return med, samples, tokens


def parse_variants(p: argparse.ArgumentParser, values: list[str], names: tuple = ()) -> dict[str, dict]:
    """``{label: {"export": DIR, "options": {name: value}}}`` from ``LABEL=DIR[:OPTION=VALUE...]``
    (0 or 1 for :data:`RUNNER_OPTIONS`, a word of :data:`WORD_OPTIONS` for those);
    a ``DIR`` in ``names`` (such as ``demo``) is taken as it is, for the caller to resolve."""
    variants: dict[str, dict] = {}
    for v in values:
        label, sep, rest = v.partition("=")
        folder, *opts = rest.split(":")
        if not sep or not label or not folder:
            p.error(f"--variant: expected LABEL=DIR[:OPTION=0|1...], got {v!r}")
        if label in variants:
            p.error(f"--variant: the label {label!r} is given twice")
        if folder not in names and not os.path.isfile(os.path.join(folder, "manifest.json")):
            p.error(f"--variant {label}: {folder} is not an export folder (no manifest.json)")
        options = {}
        for o in opts:
            name, _, value = o.partition("=")
            if name in WORD_OPTIONS:
                if value not in WORD_OPTIONS[name]:
                    p.error(f"--variant {label}: {name} must be one of {WORD_OPTIONS[name]}, got {value!r}")
                options[name] = value
                continue
            if name not in RUNNER_OPTIONS or value not in ("0", "1"):
                p.error(
                    f"--variant {label}: expected OPTION=0 or OPTION=1 with OPTION one of {RUNNER_OPTIONS}, "
                    f"or one of {list(WORD_OPTIONS)}=WORD, got {o!r}"
                )
            options[name] = value == "1"
        variants[label] = {"export": folder, "options": options}
    if len(variants) < 2:
        p.error("--variant: give at least two (LABEL=DIR), the first is the baseline")
    return variants


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="an export folder (repeat; first: baseline)",
    )
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per case and variant (median)")
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    p.add_argument("--new-tokens", type=int, default=48, help="tokens generated per source")
    p.add_argument(
        "--cases",
        default=",".join(f"{m}:{b}" for m, b in CASES),
        help="comma-separated MODE:BATCH (MODE greedy or beam4); default %(default)s",
    )
    p.add_argument("--out", default=os.path.join(HERE, "results", "ab_exports.json"), help="JSON path")
    args = p.parse_args(argv)
    variants = parse_variants(p, args.variant)
    if args.rounds < 1 or args.threads < 1 or args.new_tokens < 1:
        p.error("--rounds, --threads and --new-tokens must be at least 1")
    cases = []
    for c in args.cases.split(","):
        mode, _, batch = c.partition(":")
        if mode not in ("greedy", "beam4") or not batch.isdigit() or int(batch) < 1:
            p.error(f"--cases: expected MODE:BATCH with MODE greedy or beam4, got {c!r}")
        cases.append((mode, int(batch)))

    from transformer_ext.runtimes.ort import OrtRunner

    runners = {
        label: OrtRunner(v["export"], intra_op_num_threads=args.threads, **v["options"])
        for label, v in variants.items()
    }
    labels = list(runners)
    base = labels[0]
    out = {
        "variants": variants,
        "baseline": base,
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "machine": lscpu(),
        "load_average_before": os.getloadavg(),
        "results": [],
    }
    for mode, batch in cases:
        rng = np.random.default_rng(0)
        src = rng.integers(4, runners[base].info.src_vocab_size, size=(batch, 24))
        lengths = np.full(batch, 24)
        med, samples, tokens = timed_decodes(runners, mode, src, lengths, args.new_tokens, args.rounds)
        rec = {
            "mode": mode,
            "batch": batch,
            "seconds": med,
            "samples": samples,
            "speedup_vs_baseline": {k: med[base] / med[k] for k in labels},
            "same_tokens_as_baseline": {
                k: f"{sum(a == b for a, b in zip(tokens[base], tokens[k]))}/{batch}" for k in labels
            },
        }
        cells = ", ".join(
            f"{k} {med[k] * 1e3:.1f} ms ({rec['speedup_vs_baseline'][k]:.2f}x, tokens {rec['same_tokens_as_baseline'][k]})"
            for k in labels
        )
        print(f"{mode:6s} batch {batch:3d}: {cells}", flush=True)
        out["results"].append(rec)
    out["load_average_after"] = os.getloadavg()
    write_json(args.out, out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
