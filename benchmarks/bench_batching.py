"""Token batches vs sentence batches for translating a file (issue 23's streaming target).

Translates the same lines twice with one translator: ``Translator.translate(lines,
batch_size=N)`` (sentence batches, every result at the end) and the streaming path
(``Translator.translate_iterable``: windows sorted by length, batches of at most
``--max-batch-tokens`` padded source tokens, results in input order as they complete),
interleaved over ``--repeats`` rounds. Reports lines per second, the time to the first result
and the agreement of the two outputs, with the machine, as JSON.

    python benchmarks/bench_batching.py --lines 5000 --out benchmarks/results/bench_batching.json
    python benchmarks/bench_batching.py --model onnx_export --lines 5000   # ONNX Runtime
    python benchmarks/bench_batching.py --lines 40 --repeats 1             # a smoke run

Without ``--input`` the lines are demo sources (English number words, ``num2words``) of random
numbers, which the bundled demo model translates; with ``--input FILE`` its first ``--lines``
lines.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import lscpu, write_json  # noqa: E402


def demo_lines(n: int, seed: int) -> list[str]:
    from transformer_ext import data

    rng = random.Random(seed)
    return [data.source_text(rng.randint(0, 9_999)) for _ in range(n)]


def load_translator(model: str | None, threads: int | None):
    from transformer_ext.translate import Translator, is_export_dir

    if model is not None and is_export_dir(model):
        return Translator.from_export_dir(model, threads=threads)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    return Translator.from_model_dir(model)


def sentence_batches(translator, lines, batch_size, beam):
    t0 = time.perf_counter()
    out = translator.translate(lines, batch_size=batch_size, beam_size=beam)
    total = time.perf_counter() - t0
    return out, total, total  # every result arrives at the end


def token_batches(translator, lines, max_batch_tokens, window, beam):
    t0 = time.perf_counter()
    first = None
    out = []
    stream = translator.translate_iterable(
        lines, max_batch_tokens=max_batch_tokens, window=window, beam_size=beam, batch_size=max_batch_tokens
    )
    for result in stream:
        if first is None:
            first = time.perf_counter() - t0
        out.append(result)
    return out, time.perf_counter() - t0, first


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model or export folder (default: the demo model)")
    p.add_argument("--input", default=None, help="a text file, one source per line (default: demo lines)")
    p.add_argument("--lines", type=int, default=5000, help="lines translated (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=64, help="sentence batch size (default: %(default)s)")
    p.add_argument(
        "--max-batch-tokens", type=int, default=2048, help="token batch budget (default: %(default)s)"
    )
    p.add_argument("--window", type=int, default=512, help="lines sorted together (default: %(default)s)")
    p.add_argument("--beam", type=int, default=1, help="beam size (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: the runtime's)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the demo lines (default: %(default)s)")
    p.add_argument("--out", default="benchmarks/results/bench_batching.json", help="JSON result file")
    args = p.parse_args(argv)
    for name in ("lines", "batch_size", "max_batch_tokens", "window", "beam", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")

    if args.input:
        lines = Path(args.input).read_text(encoding="utf-8").splitlines()[: args.lines]
    else:
        lines = demo_lines(args.lines, args.seed)
    translator = load_translator(args.model, args.threads)
    runs = {"sentence_batches": [], "token_batches": []}
    outputs = {}
    for _ in range(args.repeats):
        out, total, first = sentence_batches(translator, lines, args.batch_size, args.beam)
        runs["sentence_batches"].append((total, first))
        outputs["sentence_batches"] = out
        out, total, first = token_batches(translator, lines, args.max_batch_tokens, args.window, args.beam)
        runs["token_batches"].append((total, first))
        outputs["token_batches"] = out
    results = {}
    for name, samples in runs.items():
        total = statistics.median(s[0] for s in samples)
        results[name] = {
            "seconds": total,
            "lines_per_second": len(lines) / total,
            "first_result_seconds": statistics.median(s[1] for s in samples),
            "samples": [{"seconds": s[0], "first_result_seconds": s[1]} for s in samples],
        }
    a, b = outputs["sentence_batches"], outputs["token_batches"]
    payload = {
        "benchmark": "bench_batching",
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "runner": type(translator.runner).__name__,
        "lines": len(lines),
        "machine": {"lscpu": lscpu(), "cpu_count": os.cpu_count()},
        "results": results,
        "token_over_sentence_throughput": results["token_batches"]["lines_per_second"]
        / results["sentence_batches"]["lines_per_second"],
        "outputs_equal": sum(x == y for x, y in zip(a, b, strict=True)),
    }
    write_json(args.out, payload)
    for name, r in results.items():
        print(
            f"{name:17s} {r['lines_per_second']:9.1f} lines/s  first result after {r['first_result_seconds']:.3f} s"
        )
    print(f"outputs equal: {payload['outputs_equal']} of {len(lines)}; written {args.out}")
    return payload


if __name__ == "__main__":
    main()
