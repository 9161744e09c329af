"""A/B of export folders or ``OrtRunner`` options on a file translation: CPU time per variant.

    python -m benchmarks.probes.ab_file_translation --variant plain=DIR:flush_denormals=0 --variant flushed=DIR
    python -m benchmarks.probes.ab_file_translation --variant old=OLD_EXPORT --variant new=NEW_EXPORT --rounds 8

Each ``--variant LABEL=DIR[:OPTION=0|1...]`` is an export folder of the demo model and boolean
``OrtRunner`` options (:data:`ab_exports.RUNNER_OPTIONS`); ``DIR`` may be ``demo`` (the bundled demo
model, exported once into a temporary folder, untimed). Two or more variants, the first the
baseline. This translates ``--lines`` demo sources (bench_batching's: English number words,
seed 0) through ``Translator.from_export_dir`` with the variant's runner (the translate CLI's
path: length-sorted windows, token batches of ``--max-batch-tokens``, greedy), once per variant
and round, the variants in a rotating order, in this one process, and reports the medians of the
process CPU time per variant and the baseline's median over each variant's (above 1: faster than
the baseline). Every variant must give the baseline's translations (checked; a difference is an
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
from benchmarks.probes.ab_drop_finished import _positive
from benchmarks.probes.ab_exports import parse_variants

logger = logging.getLogger("ab_file_translation")


def variant_folders(variants: dict, scratch: str) -> dict[str, str]:
    """Each variant's export folder; ``demo`` becomes the bundled demo model, exported (untimed,
    once, without validation) into ``scratch``."""
    folders = {}
    for label, variant in variants.items():
        folder = variant["export"]
        if folder == "demo":
            folder = os.path.join(scratch, "onnx")
            if not os.path.isdir(folder):
                from export.onnx import export_onnx
                from transformer_ext.demo import DEMO_MODEL_DIR

                logger.info("exporting the demo model to ONNX (untimed) ...")
                export_onnx(str(DEMO_MODEL_DIR), folder, validate=False)
        folders[label] = folder
    return folders


def run(variants: dict, lines: int, rounds: int, threads: int, max_batch_tokens: int) -> dict:
    from benchmarks.decode.bench_batching import demo_lines
    from transformer_ext.runtimes.ort import OrtRunner
    from transformer_ext.translator import Translator

    sources = demo_lines(lines, 0)
    labels = list(variants)
    with tempfile.TemporaryDirectory() as scratch:
        translators = {}
        for label, folder in variant_folders(variants, scratch).items():
            translator = Translator.from_export_dir(folder, threads=threads)
            translator.runner = OrtRunner(folder, intra_op_num_threads=threads, **variants[label]["options"])
            translators[label] = translator
        load_before = os.getloadavg()
        samples: dict[str, list[float]] = {label: [] for label in labels}
        reference = None
        for r in range(rounds + 1):  # round 0: warm-up and the outputs compared
            shift = r % len(labels)
            for label in labels[shift:] + labels[:shift]:
                start = time.process_time()
                out = list(translators[label].translate_iterable(sources, max_batch_tokens=max_batch_tokens))
                seconds = time.process_time() - start
                if reference is None:
                    reference = out
                elif out != reference:
                    raise RuntimeError(f"variant {label} changed the translations")
                if r:
                    samples[label].append(seconds)
            logger.info("round %d/%d done", r, rounds)
    medians = {label: statistics.median(v) for label, v in samples.items()}
    first = medians[labels[0]]
    return {
        "benchmark": "ab_file_translation",
        "settings": {
            "lines": lines,
            "variants": variants,
            "rounds": rounds,
            "threads": threads,
            "max_batch_tokens": max_batch_tokens,
        },
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"lscpu": lscpu(), "cpu_count": os.cpu_count()},
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "cpu_seconds": {label: {"median": medians[label], "samples": samples[label]} for label in labels},
        "speedup_over_first": {label: first / medians[label] for label in labels},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 2)[2],
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=DIR[:OPTION=0|1...]",
        help="an export folder (or 'demo') and OrtRunner options; two or more, the first the baseline",
    )
    p.add_argument(
        "--lines", type=_positive, default=5000, help="demo lines translated (default: %(default)s)"
    )
    p.add_argument("--rounds", type=_positive, default=6, help="timed rounds (default: %(default)s)")
    p.add_argument("--threads", type=_positive, default=1, help="ONNX Runtime threads (default: %(default)s)")
    p.add_argument(
        "--max-batch-tokens", type=_positive, default=4096, help="token batch size (default: %(default)s)"
    )
    p.add_argument("--out", default="benchmarks/results/ab_file_translation.json", help="JSON result file")
    args = p.parse_args(argv)
    variants = parse_variants(p, args.variant, names=("demo",))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    payload = run(variants, args.lines, args.rounds, args.threads, args.max_batch_tokens)
    write_json(args.out, payload)
    for label in variants:
        c = payload["cpu_seconds"][label]["median"]
        print(f"{label:>16}: {c:7.3f} CPU s  ({payload['speedup_over_first'][label]:.3f}x the first)")
    print(
        f"load average before {payload['load_average']['before'][0]:.2f}, after {payload['load_average']['after'][0]:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
