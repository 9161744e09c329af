"""What a batch split over two 1-thread workers costs each engine: one worker on half the batch
against two workers on the whole batch at once, timed side by side in each engine's process.

    python -m benchmarks.probes.probe_split_workers --artifacts A            # int8, greedy and beam 4, batch 16
    python -m benchmarks.probes.probe_split_workers --artifacts A --dtype float32 --batch 64

``A`` is a ``bench_decode.py --artifacts`` folder (``A/base/onnx_int8`` and ``A/base/ct2_int8``,
or the float32 ``onnx`` and ``ct2``). The split is bench_decode's ``2x1`` setting, built by the
same code (``decode_worker.py``): ours two ``OrtRunner`` s of 1 thread under
``runtimes.pool.SourceParallel`` (two threads of one Python process), CTranslate2
``inter_threads=2, intra_threads=1`` with ``max_batch_size`` half the batch. Two workers on two
cores that did not disturb each other would take as long for the whole batch as one worker for
its half: ``split_over_half`` (split time over one worker's half time) is 1.0 then, and what it
exceeds 1.0 by is what running the two at once costs (shared caches and memory bandwidth, and
for ours the interpreter lock the two threads' host work shares). Each engine runs in a process
of its own (this file with ``--child``), the decodes of bench_decode (random sources of length
24, seed 0, exactly ``--new-tokens`` tokens, no length penalty), medians of ``--rounds``
interleaved rounds. JSON at ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (results/ lives here)

ENGINES = {"onnxrt": "onnx", "ctranslate2": "ct2"}
BOS, EOS, SRC_LEN = 1, 2, 24


def child(
    engine: str,
    model: str,
    dtype: str,
    modes: list[str],
    batch: int,
    new_tokens: int,
    rounds: int,
    vocab: int,
) -> dict:
    """Both settings of one engine in this process: ``{mode: {"half_ms", "split_ms", ...}}``."""
    import numpy as np

    from benchmarks.decode import decode_worker

    build = decode_worker._onnxrt if engine == "onnxrt" else decode_worker._ctranslate2
    base = {"engine": engine, "model": model, "compute_type": dtype, "bos": BOS, "eos": EOS}
    one = build({**base, "threads": 1, "workers": 1})
    split = build({**base, "threads": 2, "workers": 2})
    rng = np.random.default_rng(0)
    src = rng.integers(4, vocab, size=(batch, SRC_LEN))
    lengths = np.full(batch, SRC_LEN)
    half = batch // 2
    out = {}
    for mode in modes:
        runs = {
            "half": lambda m=mode: one(m, src[:half], lengths[:half], new_tokens),
            "split": lambda m=mode: split(m, src, lengths, new_tokens),
        }
        tokens = {name: fn() for name, fn in runs.items()}  # warm-up, and the tokens compared
        samples = {name: [] for name in runs}
        for r in range(rounds):
            for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
                t0 = time.perf_counter()
                runs[name]()
                samples[name].append(time.perf_counter() - t0)
        half_s, split_s = (statistics.median(samples[n]) for n in ("half", "split"))
        out[mode] = {
            "half_ms": 1e3 * half_s,
            "split_ms": 1e3 * split_s,
            "split_over_half": split_s / half_s,
            "half_tokens_equal_split": [list(t) for t in tokens["half"]]
            == [list(t) for t in tokens["split"][:half]],
            "samples_ms": {n: [1e3 * s for s in v] for n, v in samples.items()},
        }
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifacts", required=True, help="a bench_decode.py --artifacts folder")
    p.add_argument("--dtype", choices=("int8", "float32"), default="int8")
    p.add_argument("--modes", default="greedy,beam4", help="comma-separated subset of greedy,beam4")
    p.add_argument("--batch", type=int, default=16, help="sources per decode (even)")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=7, help="interleaved timed rounds (median)")
    p.add_argument(
        "--src-vocab", type=int, default=8000, help="source ids are drawn below this (base: 8,000)"
    )
    p.add_argument(
        "--engines", default="onnxrt,ctranslate2", help="comma-separated subset of onnxrt,ctranslate2"
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--out", default=os.path.join(HERE, "results", "probe_split_workers.json"), help="JSON path"
    )
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    engines = [e for e in args.engines.split(",") if e]
    if not modes or set(modes) - {"greedy", "beam4"}:
        p.error(f"--modes: expected a comma-separated subset of greedy,beam4, got {args.modes!r}")
    if not engines or set(engines) - set(ENGINES):
        p.error(f"--engines: expected a comma-separated subset of {','.join(ENGINES)}, got {args.engines!r}")
    if args.batch < 2 or args.batch % 2 or args.new_tokens < 1 or args.rounds < 1 or args.src_vocab < 5:
        p.error("--batch must be even and at least 2; --new-tokens and --rounds at least 1, --src-vocab 5")
    models = {}
    for e in engines:
        models[e] = os.path.join(
            args.artifacts, "base", ENGINES[e] + ("_int8" if args.dtype == "int8" else "")
        )
        if not os.path.isdir(models[e]):
            p.error(
                f"--artifacts: no {models[e]} (run bench_decode.py --artifacts {args.artifacts} --prepare-only)"
            )
    if args.child:
        result = child(
            args.child,
            models[args.child],
            args.dtype,
            modes,
            args.batch,
            args.new_tokens,
            args.rounds,
            args.src_vocab,
        )
        json.dump(result, sys.stdout)
        return 0

    from benchmarks.common import lscpu, write_json

    out = {
        "command": " ".join(["probe_split_workers.py"] + (sys.argv[1:] if argv is None else list(argv))),
        "dtype": args.dtype,
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "machine": lscpu(),
        "load_average_before": os.getloadavg(),
        "engines": {},
    }
    for e in engines:
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.probes.probe_split_workers",
            "--child",
            e,
            "--engines",
            e,
            "--artifacts",
            args.artifacts,
        ]
        cmd += ["--dtype", args.dtype, "--modes", ",".join(modes), "--batch", str(args.batch)]
        cmd += [
            "--new-tokens",
            str(args.new_tokens),
            "--rounds",
            str(args.rounds),
            "--src-vocab",
            str(args.src_vocab),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(
                f"probe_split_workers.py: error: the {e} process failed:\n{proc.stderr[-2000:]}",
                file=sys.stderr,
            )
            return 1
        out["engines"][e] = json.loads(proc.stdout)
        for mode, r in out["engines"][e].items():
            print(
                f"{e:<12} {mode:<6} one worker, {args.batch // 2} sources {r['half_ms']:8.1f} ms   "
                f"two workers, {args.batch} sources {r['split_ms']:8.1f} ms   split / half {r['split_over_half']:.3f}"
            )
    out["load_average_after"] = os.getloadavg()
    write_json(args.out, out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
