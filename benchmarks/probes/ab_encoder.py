"""A/B of export folders or ``OrtRunner`` options on the encoder: one padded batch, time per run.

    python -m benchmarks.probes.ab_encoder --variant rows3d=DIR_NO_FLATTEN --variant rows2d=DIR
    python -m benchmarks.probes.ab_encoder --variant plain=DIR:flush_denormals=0 --variant flushed=DIR --batch 16 --src-len 24

Each ``--variant LABEL=DIR[:OPTION=0|1...]`` is an export folder and boolean ``OrtRunner``
options (:data:`ab_exports.RUNNER_OPTIONS`); ``DIR`` may be ``demo`` (the bundled demo model,
exported once into a temporary folder, untimed). Two or more variants, the first the baseline;
they must be exports of the same model. Every variant's runner encodes the same batch:
``--batch`` sources of ``--src-len`` positions whose lengths are drawn (seed 0) between half of
``--src-len`` and ``--src-len``, so that rows are padded as in a batch of a file translation
before length sorting. Timed is ``OrtRunner.encode`` (the encoder graph's run, and the state it
allocates for the decode), interleaved in rotating order after a warm-up
(``common.time_side_by_side``), medians. Each variant's ratio is the baseline's median over its
own (above 1: faster than the baseline); the largest absolute difference of its cross-attention
keys and values from the baseline's is recorded. JSON at ``--out``, with the machine and the load
average before and after.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (results/ lives here)

from benchmarks.common import lscpu, time_side_by_side, write_json
from benchmarks.probes.ab_drop_finished import _positive
from benchmarks.probes.ab_exports import parse_variants
from benchmarks.probes.ab_file_translation import variant_folders

logger = logging.getLogger("ab_encoder")


def run(variants: dict, batch: int, src_len: int, threads: int, repeats: int) -> dict:
    from transformer_ext.runtimes.ort import OrtRunner

    labels = list(variants)
    with tempfile.TemporaryDirectory() as scratch:
        runners = {
            label: OrtRunner(folder, intra_op_num_threads=threads, **variants[label]["options"])
            for label, folder in variant_folders(variants, scratch).items()
        }
        info = runners[labels[0]].info
        if src_len > info.max_positions:
            raise SystemExit(f"--src-len {src_len} exceeds the model's {info.max_positions} positions")
        rng = np.random.default_rng(0)
        lengths = rng.integers(max(1, src_len // 2), src_len + 1, size=batch).astype(np.int64)
        lengths[0] = src_len
        low = min(4, info.src_vocab_size - 1)
        ids = rng.integers(low, info.src_vocab_size, size=(batch, src_len)).astype(np.int64)
        ids[np.arange(src_len)[None, :] >= lengths[:, None]] = info.pad_id

        def encode(label):
            return runners[label].encode(ids, lengths, cache_len=1)

        states = {label: encode(label) for label in labels}
        base = states[labels[0]]
        differences = {}
        for label in labels:
            s = states[label]
            differences[label] = max(
                float(np.abs(a - b).max())
                for a, b in zip(s.cross_keys + s.cross_values, base.cross_keys + base.cross_values)
            )
        del states, base
        load_before = os.getloadavg()
        seconds = time_side_by_side(
            {label: (lambda label=label: encode(label)) for label in labels}, "cpu", repeats
        )
        load_after = os.getloadavg()
    first = seconds[labels[0]]
    return {
        "benchmark": "ab_encoder",
        "settings": {
            "variants": variants,
            "batch": batch,
            "src_len": src_len,
            "threads": threads,
            "repeats": repeats,
            "lengths": {"min": int(lengths.min()), "max": int(lengths.max()), "mean": float(lengths.mean())},
        },
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"lscpu": lscpu(), "cpu_count": os.cpu_count()},
        "load_average": {"before": list(load_before), "after": list(load_after)},
        "milliseconds": {label: seconds[label] * 1e3 for label in labels},
        "speedup_over_first": {label: first / seconds[label] for label in labels},
        "max_abs_difference_from_first": differences,
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
    p.add_argument("--batch", type=_positive, default=104, help="sources in the batch (default: %(default)s)")
    p.add_argument(
        "--src-len", type=_positive, default=40, help="positions per source (default: %(default)s)"
    )
    p.add_argument("--threads", type=_positive, default=1, help="ONNX Runtime threads (default: %(default)s)")
    p.add_argument("--repeats", type=_positive, default=15, help="interleaved timings (default: %(default)s)")
    p.add_argument("--out", default="benchmarks/results/ab_encoder.json", help="JSON result file")
    args = p.parse_args(argv)
    variants = parse_variants(p, args.variant, names=("demo",))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    payload = run(variants, args.batch, args.src_len, args.threads, args.repeats)
    write_json(args.out, payload)
    for label in variants:
        print(
            f"{label:>16}: {payload['milliseconds'][label]:8.2f} ms  "
            f"({payload['speedup_over_first'][label]:.3f}x the first; largest difference "
            f"{payload['max_abs_difference_from_first'][label]:.1e})"
        )
    print(
        f"load average before {payload['load_average']['before'][0]:.2f}, after {payload['load_average']['after'][0]:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
