"""Token batches vs sentence batches for translating a file (the streaming target).

Translates the same lines twice with one translator: ``Translator.translate(lines,
batch_size=N)`` (sentence batches, every result at the end) and the streaming path
(``Translator.translate_iterable``: windows sorted by length, batches of at most
``--max-batch-tokens`` padded source tokens, results in input order as they complete),
interleaved over ``--repeats`` rounds. Reports lines per second, the time to the first result
and the agreement of the two outputs, with the machine, as JSON.

Before the timed rounds, one untimed pass of each path counts its work through a counting
runner (the numbers depend on the batching and the model's outputs, not on the machine):
``batches`` (encoder calls), ``runner_calls`` (decoder steps: each batch runs until its longest
output ends), ``rows_x_steps`` (the rows of each step summed: finished rows keep stepping),
``padded_source_tokens``, and the distribution of rows and steps per batch. ``--work-only``
records only these (no timing: for a loaded machine).

    python -m benchmarks.decode.bench_batching --lines 5000 --out benchmarks/results/bench_batching.json
    python -m benchmarks.decode.bench_batching --model onnx_export --lines 5000   # ONNX Runtime
    python -m benchmarks.decode.bench_batching --lines 5000 --work-only           # the work counts only
    python -m benchmarks.decode.bench_batching --lines 40 --repeats 1             # a smoke run

Without ``--input`` the lines are demo sources (English number words, ``num2words``) of random
numbers, which the bundled demo model translates; with ``--input FILE`` its first ``--lines``
lines.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

from benchmarks.common import lscpu, write_json
from transformer_ext.batching import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_WINDOW
from transformer_ext.cli import add_option


class CountingRunner:
    """A runner that forwards to another and counts the work of a decode (see the module docstring)."""

    def __init__(self, runner):
        self.runner = runner
        self.info = runner.info
        self.batches: list[dict] = []  # per encode: rows (sources x beams), source length, steps

    def __getattr__(self, name):  # model, step_with_attention ...: the wrapped runner's
        return getattr(self.runner, name)

    def encode(self, input_ids, src_lengths, cache_len, beam_size=1):
        B, S = input_ids.shape
        self.batches.append({"rows": B * beam_size, "src_len": S, "sources": B, "steps": 0, "row_steps": 0})
        return self.runner.encode(input_ids, src_lengths, cache_len, beam_size)

    def step(self, state, tokens):
        self.batches[-1]["steps"] += 1
        self.batches[-1]["row_steps"] += len(tokens)
        return self.runner.step(state, tokens)

    def reorder(self, state, beam_index):
        return self.runner.reorder(state, beam_index)

    def summary(self) -> dict:
        b = self.batches
        rows = [x["rows"] for x in b]
        steps = [x["steps"] for x in b]
        return {
            "batches": len(b),
            "runner_calls": sum(steps),
            "rows_x_steps": sum(x["row_steps"] for x in b),
            "padded_source_tokens": sum(x["sources"] * x["src_len"] for x in b),
            "rows_per_batch": {"min": min(rows), "mean": sum(rows) / len(rows), "max": max(rows)}
            if b
            else None,
            "steps_per_batch": {"min": min(steps), "mean": sum(steps) / len(steps), "max": max(steps)}
            if b
            else None,
        }


def count_work(translator, run) -> tuple[list, dict]:
    """``run(translator)`` with the translator's runner counted: ``(its output, the work)``."""
    counting = CountingRunner(translator.runner)
    translator.runner = counting
    try:
        out = run(translator)
    finally:
        translator.runner = counting.runner
    return out, counting.summary()


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
        lines, max_batch_tokens=max_batch_tokens, window=window, beam_size=beam
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
        "--max-batch-tokens",
        type=int,
        default=DEFAULT_MAX_BATCH_TOKENS,
        help="token batch budget (default: %(default)s, the translator's)",
    )
    p.add_argument(
        "--window", type=int, default=DEFAULT_WINDOW, help="lines sorted together (default: %(default)s)"
    )
    p.add_argument("--work-only", action="store_true", help="count the work of both paths, time nothing")
    add_option(
        p,
        "--beam-size",
        deprecated=("--beam",),
        dest="beam",
        type=int,
        default=1,
        help="beam size (default: %(default)s)",
    )
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
    paths = {
        "sentence_batches": lambda t: sentence_batches(t, lines, args.batch_size, args.beam)[0],
        "token_batches": lambda t: token_batches(t, lines, args.max_batch_tokens, args.window, args.beam)[0],
    }
    work, outputs = {}, {}
    for name, run in paths.items():  # untimed: the work counts (and a warm-up)
        outputs[name], work[name] = count_work(translator, run)
    runs = {"sentence_batches": [], "token_batches": []}
    for _ in range(0 if args.work_only else args.repeats):
        out, total, first = sentence_batches(translator, lines, args.batch_size, args.beam)
        runs["sentence_batches"].append((total, first))
        outputs["sentence_batches"] = out
        out, total, first = token_batches(translator, lines, args.max_batch_tokens, args.window, args.beam)
        runs["token_batches"].append((total, first))
        outputs["token_batches"] = out
    results = {}
    for name, samples in runs.items():
        results[name] = {"work": work[name]}
        if not samples:
            continue
        total = statistics.median(s[0] for s in samples)
        results[name].update(
            seconds=total,
            lines_per_second=len(lines) / total,
            first_result_seconds=statistics.median(s[1] for s in samples),
            samples=[{"seconds": s[0], "first_result_seconds": s[1]} for s in samples],
        )
    a, b = outputs["sentence_batches"], outputs["token_batches"]
    payload = {
        "benchmark": "bench_batching",
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "runner": type(translator.runner).__name__,
        "lines": len(lines),
        "machine": {"lscpu": lscpu(), "cpu_count": os.cpu_count()},
        "results": results,
        "token_over_sentence_throughput": None
        if args.work_only
        else results["token_batches"]["lines_per_second"] / results["sentence_batches"]["lines_per_second"],
        "token_over_sentence_work": {
            k: work["token_batches"][k] / work["sentence_batches"][k]
            for k in ("runner_calls", "rows_x_steps")
        },
        "outputs_equal": sum(x == y for x, y in zip(a, b, strict=True)),
    }
    write_json(args.out, payload)
    for name, r in results.items():
        w = r["work"]
        timing = (
            f"{r['lines_per_second']:9.1f} lines/s  first result after {r['first_result_seconds']:.3f} s  "
            if "seconds" in r
            else ""
        )
        print(
            f"{name:17s} {timing}{w['batches']} batches, {w['runner_calls']} runner calls, "
            f"{w['rows_x_steps']} rows x steps"
        )
    print(f"outputs equal: {payload['outputs_equal']} of {len(lines)}; written {args.out}")
    return payload


if __name__ == "__main__":
    main()
