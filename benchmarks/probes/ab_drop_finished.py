"""When greedy search should drop its finished rows: CPU time of a file translation per setting.

    python -m benchmarks.probes.ab_drop_finished                          # the demo model, 1 thread
    python -m benchmarks.probes.ab_drop_finished --divisors 1000000,8,4,2 --rounds 8

Greedy search drops the rows that finished from the runner's state (``runner.select``: every
open row's caches and cross-attention K/V copied) once they are at least ``1 / divisor`` of its
rows (``transformer_ext.decoding.GREEDY_DROP_DIVISOR``); a divisor larger than any batch drops at
every step where a row finishes. This translates ``--lines`` demo sources (bench_batching's: English
number words, seed 0) with the bundled demo model through ``Translator.from_export_dir``'s
ONNX Runtime runner (the translate CLI's path: length-sorted windows, token batches of
``--max-batch-tokens``), once per divisor and round, the divisors in a rotating order, in this
one process, and reports the medians of the process CPU time per divisor and their ratio to the
first divisor's. Every setting must give the same translations (checked; a difference is an
error). JSON at ``--out``, with the machine and the load average before and after.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (results/ lives here)

from benchmarks.common import lscpu, write_json

logger = logging.getLogger("ab_drop_finished")


def _divisors(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--divisors must be comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--divisors must be integers >= 1, got {text!r}")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def run(
    lines: int, divisors: list[int], rounds: int, threads: int, max_batch_tokens: int, export: str | None
) -> dict:
    from benchmarks.decode.bench_batching import demo_lines
    from transformer_ext import decoding
    from transformer_ext.translator import Translator

    sources = demo_lines(lines, 0)
    with tempfile.TemporaryDirectory() as scratch:
        if export is None:
            from export.onnx import export_onnx
            from transformer_ext.demo import DEMO_MODEL_DIR

            export = os.path.join(scratch, "onnx")
            logger.info("exporting the demo model to ONNX (untimed) ...")
            export_onnx(str(DEMO_MODEL_DIR), export, validate=False)
        translator = Translator.from_export_dir(export, threads=threads)
        default = decoding.GREEDY_DROP_DIVISOR
        load_before = os.getloadavg()
        samples: dict[int, list[float]] = {d: [] for d in divisors}
        reference = None
        try:
            for r in range(rounds + 1):  # round 0: warm-up and the outputs compared
                shift = r % len(divisors)
                for d in divisors[shift:] + divisors[:shift]:
                    decoding.GREEDY_DROP_DIVISOR = d
                    start = time.process_time()
                    out = list(translator.translate_iterable(sources, max_batch_tokens=max_batch_tokens))
                    seconds = time.process_time() - start
                    if reference is None:
                        reference = out
                    elif out != reference:
                        raise RuntimeError(f"divisor {d} changed the translations")
                    if r:
                        samples[d].append(seconds)
                logger.info("round %d/%d done", r, rounds)
        finally:
            decoding.GREEDY_DROP_DIVISOR = default
    medians = {d: statistics.median(v) for d, v in samples.items()}
    first = medians[divisors[0]]
    return {
        "benchmark": "ab_drop_finished",
        "settings": {
            "lines": lines,
            "divisors": divisors,
            "rounds": rounds,
            "threads": threads,
            "max_batch_tokens": max_batch_tokens,
        },
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"lscpu": lscpu(), "cpu_count": os.cpu_count()},
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "cpu_seconds": {str(d): {"median": medians[d], "samples": samples[d]} for d in divisors},
        "speedup_over_first": {str(d): first / medians[d] for d in divisors},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--lines", type=_positive, default=5000, help="demo lines translated (default: %(default)s)"
    )
    p.add_argument(
        "--divisors",
        type=_divisors,
        default=[1_000_000, 8, 4, 3, 2],
        help="GREEDY_DROP_DIVISOR values, the first the baseline (default: 1000000,8,4,3,2)",
    )
    p.add_argument("--rounds", type=_positive, default=6, help="timed rounds (default: %(default)s)")
    p.add_argument("--threads", type=_positive, default=1, help="ONNX Runtime threads (default: %(default)s)")
    p.add_argument(
        "--max-batch-tokens", type=_positive, default=4096, help="token batch size (default: %(default)s)"
    )
    p.add_argument("--export", default=None, help="an export folder of the demo model (default: export one)")
    p.add_argument("--out", default="benchmarks/results/ab_drop_finished.json", help="JSON result file")
    args = p.parse_args(argv)
    if args.export is not None and not os.path.isfile(os.path.join(args.export, "manifest.json")):
        p.error(f"--export {args.export}: not an export folder (no manifest.json)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    payload = run(args.lines, args.divisors, args.rounds, args.threads, args.max_batch_tokens, args.export)
    write_json(args.out, payload)
    for d in args.divisors:
        c = payload["cpu_seconds"][str(d)]["median"]
        print(f"divisor {d:>9}: {c:7.3f} CPU s  ({payload['speedup_over_first'][str(d)]:.3f}x the first)")
    print(
        f"load average before {payload['load_average']['before'][0]:.2f}, after {payload['load_average']['after'][0]:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
