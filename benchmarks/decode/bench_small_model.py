"""A small model's file translation against CTranslate2: CPU time per engine (the small-model comparison).

    python -m benchmarks.decode.bench_small_model                        # 5,000 demo lines, 1 thread, 5 rounds
    python -m benchmarks.decode.bench_small_model --lines 200 --repeats 1  # a smoke run
    python -m benchmarks.decode.bench_small_model --engines onnxrt         # ours only
    python -m benchmarks.decode.bench_small_model --engines onnxrt,onnxrt_gqa,ctranslate2   # both flavours

Translates the bundled demo model's ``--lines`` demo sources (the lines benchmarks/decode/bench_batching.py
uses: English number words of random numbers, seed ``--seed``) greedy with ``--threads`` threads,
text in and text out, through two engines on the same weights, each in a process of its own that
loads only its engine (benchmarks/decode/decode_worker.py, ``"task": "lines"``; neither imports torch):

* ``onnxrt``: ours, the demo model exported with ``python -m export.onnx`` (untimed, once; or
  ``--export DIR``), ``Translator.from_export_dir(DIR, threads=N).translate_iterable`` (the
  translate CLI's path: windows sorted by length, token batches of ``--max-batch-tokens``);
* ``onnxrt_gqa`` (not in the default set): the same with the demo model exported in the ``ort``
  flavour (``python -m export.onnx --flavour ort``: each decoder self-attention one ONNX Runtime
  ``GroupQueryAttention``; or ``--export-gqa DIR``);
* ``ctranslate2``: the same weights converted with ``ctranslate2.specs`` (bench_decode's
  conversion, float32), ``translate_iterable`` in token batches (``batch_type="tokens"``,
  ``--ct2-max-batch-tokens``), ``intra_threads=N``; our tokenizer turns the lines into tokens and
  the tokens back into text in the same process and in the timed call, as ours does.

Each worker translates the lines once untimed (a warm-up, and the outputs compared), then
``--repeats`` interleaved rounds in a rotating order. A sample is the process CPU time
(``time.process_time`` in the worker: every thread of it) and the wall time of one whole call;
the JSON (``--out``, a PNG beside it) holds the medians, every sample, the load average before
and after, the machine (``lscpu``) and the outputs' agreement: the number of lines whose tokens
are equal, and the first mismatches (source and both texts). Without CTranslate2 installed
(``pip install -r requirements/bench.txt``) the benchmark says so and times ours only.

Where the time goes: ``--split`` also times our workers' two graph sessions per call (process
CPU time around each ``run``), so each of our samples splits into the encoder graph, the
decoder step graph and the host (the rest); ``--max-decoding-length 1`` times the encoder and one
step per line for every engine, CTranslate2 included, so a full run minus it is the rest of
the decode.

    python -m benchmarks.decode.bench_small_model --engines onnxrt_gqa,ctranslate2 --split
    python -m benchmarks.decode.bench_small_model --engines onnxrt_gqa,ctranslate2 --split --max-decoding-length 1
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import pickle
import statistics
import sys
import tempfile
import time

from transformer_ext.cli import add_option

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (results/ lives here)

from benchmarks.common import lscpu, save_figure, write_json

logger = logging.getLogger("bench_small_model")

ENGINE_NAMES = ("onnxrt", "ctranslate2")  # the default set
ALL_ENGINES = ("onnxrt", "onnxrt_gqa", "ctranslate2")
OURS = ("onnxrt", "onnxrt_gqa")
ARTIFACT = {"onnxrt": "onnx", "onnxrt_gqa": "onnx_gqa", "ctranslate2": "ct2"}
CT2_MISSING = "ctranslate2 is not installed (pip install -r requirements/bench.txt): timing ours only"
MISMATCHES_KEPT = 10


def demo_lines(n: int, seed: int) -> list[str]:
    """bench_batching's demo sources."""
    from benchmarks.decode.bench_batching import demo_lines as lines

    return lines(n, seed)


def has_ctranslate2() -> bool:
    return importlib.util.find_spec("ctranslate2") is not None


def prepare(scratch: str, engines: list[str], export: str | None, export_gqa: str | None = None) -> dict:
    """The artifacts the engines read, built once (untimed): ``{"onnx": DIR, "onnx_gqa": DIR,
    "ct2": DIR}`` (those the engines need; ``onnx`` always: the tokenizer and CTranslate2's budget
    are read from it)."""
    from transformer_ext.demo import DEMO_MODEL_DIR

    paths = {}
    if engines:  # CTranslate2's budget is read from an export too
        if export is None:
            from export.onnx import export_onnx

            export = os.path.join(scratch, "onnx")
            logger.info("exporting the demo model to ONNX (untimed) ...")
            export_onnx(str(DEMO_MODEL_DIR), export, validate=False)
        paths["onnx"] = export
    if "onnxrt_gqa" in engines:
        if export_gqa is None:
            from export.onnx import export_onnx

            export_gqa = os.path.join(scratch, "onnx_gqa")
            logger.info("exporting the demo model to ONNX, ort flavour (untimed) ...")
            export_onnx(str(DEMO_MODEL_DIR), export_gqa, validate=False, flavour="ort")
        paths["onnx_gqa"] = export_gqa
    if "ctranslate2" in engines:
        import torch

        from benchmarks.decode.bench_decode import _ct2_spec
        from transformer_ext.checkpoint import load_model

        model = load_model(str(DEMO_MODEL_DIR), torch.device("cpu")).eval()
        c = model.config
        if (c.pad_id, c.bos_id, c.eos_id) != (0, 1, 2):
            raise ValueError("the CTranslate2 conversion assumes pad/bos/eos ids 0/1/2")
        spec = _ct2_spec(model)
        spec.validate()
        spec.optimize(quantization="float32")
        paths["ct2"] = os.path.join(scratch, "ct2")
        os.makedirs(paths["ct2"])
        spec.save(paths["ct2"])
    return paths


def budget_cap(lines: list[str], export: str) -> int:
    """The largest greedy budget ours gives any of ``lines`` (the export's ``max_len_a``,
    ``max_len_b`` and cap): CTranslate2's ``max_decoding_length``, one number for every line."""
    from transformer_ext.translator import Translator

    translator = Translator.from_export_dir(export, threads=1)
    opts = translator.resolve_options()
    lengths = [len(ids) for ids in translator.encode(lines)]
    budget = translator.max_decoding_length(lengths, opts["max_len_a"], opts["max_len_b"])
    if opts.get("max_decoding_length") is not None:
        budget = [min(int(b), int(opts["max_decoding_length"])) for b in budget]
    return int(max(budget))


class LinesWorker:
    """One engine's worker process (bench_decode's :class:`EngineProcess`) translating lines."""

    def __init__(self, name: str, model: str, threads: int, tokenizer: str, split: bool = False):
        from benchmarks.decode.bench_decode import ENGINES, EngineProcess

        engine = next(e for e in ENGINES if e.name == name)
        self.name = name
        extra = {"task": "lines", "tokenizer": tokenizer}
        if split:
            extra["split"] = True
        self.process = EngineProcess(engine, model, threads, {"bos_id": 1, "eos_id": 2}, extra=extra)
        self.info = self.process.info

    def __call__(self, lines: list[str], options: dict):
        """``(outputs, cpu seconds, wall seconds, split)``: ``split`` the graphs' CPU seconds
        and calls (decode_worker's ``_onnxrt_lines``) for one of ours started with ``split``, else None."""
        proc = self.process.proc
        pickle.dump(("translate", lines, options), proc.stdin)
        proc.stdin.flush()
        reply = self.process._reply()
        return tuple(reply) if len(reply) == 4 else (*reply, None)

    def close(self) -> None:
        self.process.close()


def split_of(cpu_seconds: float, parts: dict) -> dict:
    """One translation's CPU seconds split into the encoder graph, the decoder step graph and the
    host (the rest: tokenization, batching, the search, the caches), with the graphs' calls."""
    encoder, step = parts["encoder_cpu_seconds"], parts["step_cpu_seconds"]
    return {
        "encoder_graph_cpu_seconds": encoder,
        "step_graph_cpu_seconds": step,
        "host_cpu_seconds": cpu_seconds - encoder - step,
        "encoder_calls": parts["encoder_calls"],
        "step_calls": parts["step_calls"],
    }


def compare(lines: list[str], ours: list, theirs: list) -> dict:
    """How many lines have equal tokens, and the first mismatches."""
    bad = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if list(a[0]) != list(b[0])]
    return {
        "lines_equal": len(lines) - len(bad),
        "lines": len(lines),
        "mismatches": [
            {"line": i, "source": lines[i], "onnxrt": ours[i][1], "ctranslate2": theirs[i][1]}
            for i in bad[:MISMATCHES_KEPT]
        ],
    }


def plot(payload: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(payload["results"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.38
    for j, what in enumerate(("cpu_seconds", "wall_seconds")):
        med = [payload["results"][n][what] for n in names]
        lo = [m - min(s[what] for s in payload["results"][n]["samples"]) for n, m in zip(names, med)]
        hi = [max(s[what] for s in payload["results"][n]["samples"]) - m for n, m in zip(names, med)]
        xs = [i + (j - 0.5) * width for i in range(len(names))]
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, label=what.replace("_", " "))
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("seconds (median, min-max)")
    s = payload["settings"]
    ax.set_title(f"demo model, {payload['lines']} lines, greedy, {s['threads']} thread(s)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def _usable_engines(engines) -> tuple[list[str], str | None]:
    """The engines asked for that can run here, and why CTranslate2 was left out (or None)."""
    engines = list(engines or ENGINE_NAMES)
    unknown = sorted(set(engines) - set(ALL_ENGINES))
    if unknown:
        raise ValueError(f"unknown engine(s) {unknown}: choose from {list(ALL_ENGINES)}")
    missing = None
    if "ctranslate2" in engines and not has_ctranslate2():
        missing = CT2_MISSING
        logger.warning("%s", CT2_MISSING)
        engines.remove("ctranslate2")
    if not engines:
        raise ValueError("no engine left to time")
    return engines, missing


def _medians(engines, samples, options, workers) -> dict:
    """Per engine: the median CPU and wall seconds over the rounds, its options and worker."""
    results = {}
    for n in engines:
        results[n] = {
            "cpu_seconds": statistics.median(s["cpu_seconds"] for s in samples[n]),
            "wall_seconds": statistics.median(s["wall_seconds"] for s in samples[n]),
            "options": options[n],
            "worker": workers[n].info,
            "samples": samples[n],
        }
        if samples[n] and "split" in samples[n][0]:
            results[n]["split"] = {
                k: statistics.median(s["split"][k] for s in samples[n]) for k in samples[n][0]["split"]
            }
    return results


def _time_engines(workers, engines, lines, options, repeats):
    """The outputs of each engine (an untimed first run) and its timed rounds, interleaved."""
    outputs, samples = {}, {n: [] for n in engines}
    for n in engines:  # untimed: a warm-up and the outputs
        outputs[n] = workers[n](lines, options[n])[0]
    for r in range(repeats):
        order = engines[r % len(engines) :] + engines[: r % len(engines)]
        for n in order:
            _, cpu, wall, parts = workers[n](lines, options[n])
            sample = {"cpu_seconds": cpu, "wall_seconds": wall, "load_1min": os.getloadavg()[0]}
            if parts is not None:
                sample["split"] = split_of(cpu, parts)
            samples[n].append(sample)
            logger.info("round %d %s: %.3f CPU s, %.3f s", r, n, cpu, wall)
    return outputs, samples


def run(
    *,
    lines_n: int = 5000,
    seed: int = 0,
    threads: int = 1,
    repeats: int = 5,
    max_batch_tokens: int | None = None,
    ct2_max_batch_tokens: int | None = None,
    engines: list[str] | None = None,
    export: str | None = None,
    export_gqa: str | None = None,
    out: str = "benchmarks/results/bench_small_model.json",
    plot_png: bool = True,
    max_new_tokens: int | None = None,
    split: bool = False,
) -> dict:
    from transformer_ext.batching import DEFAULT_MAX_BATCH_TOKENS

    engines, missing = _usable_engines(engines)
    max_batch_tokens = max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS
    ct2_max_batch_tokens = ct2_max_batch_tokens or max_batch_tokens
    lines = demo_lines(lines_n, seed)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_small_model_") as scratch:
        paths = prepare(scratch, engines, export, export_gqa)
        tokenizer = paths["onnx"]  # the export holds the demo model's tokenizer
        options = {}
        for n in OURS:
            options[n] = {"max_batch_tokens": max_batch_tokens}
            if max_new_tokens is not None:
                options[n]["max_decoding_length"] = max_new_tokens
        if "ctranslate2" in engines:
            cap = budget_cap(lines, paths["onnx"])
            options["ctranslate2"] = {
                "max_batch_tokens": ct2_max_batch_tokens,
                "max_decoding_length": cap if max_new_tokens is None else min(cap, max_new_tokens),
            }
        workers = {
            n: LinesWorker(n, paths[ARTIFACT[n]], threads, tokenizer, split=split and n in OURS)
            for n in engines
        }
        try:
            outputs, samples = _time_engines(workers, engines, lines, options, repeats)
        finally:
            for w in workers.values():
                w.close()
    results = _medians(engines, samples, options, workers)
    payload = {
        "benchmark": "bench_small_model",
        "settings": {
            "lines": lines_n,
            "seed": seed,
            "threads": threads,
            "repeats": repeats,
            "max_batch_tokens": max_batch_tokens,
            "ct2_max_batch_tokens": ct2_max_batch_tokens,
            "max_new_tokens": max_new_tokens,
            "export": export,
            "export_gqa": export_gqa,
            "split": split,
        },
        "lines": len(lines),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"lscpu": lscpu(), "cpu_count": os.cpu_count()},
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "ctranslate2_missing": missing,
        "results": results,
        "agreement": compare(lines, outputs["onnxrt"], outputs["ctranslate2"])
        if {"onnxrt", "ctranslate2"} <= set(engines)
        else None,
        "onnxrt_over_ctranslate2_cpu": results["onnxrt"]["cpu_seconds"]
        / results["ctranslate2"]["cpu_seconds"]
        if {"onnxrt", "ctranslate2"} <= set(engines)
        else None,
        # every engine of ours against CTranslate2: CPU time ratio and token agreement
        "over_ctranslate2_cpu": {
            n: results[n]["cpu_seconds"] / results["ctranslate2"]["cpu_seconds"]
            for n in engines
            if n in OURS and "ctranslate2" in engines
        },
        "agreement_by_engine": {
            n: compare(lines, outputs[n], outputs["ctranslate2"])
            for n in engines
            if n in OURS and "ctranslate2" in engines
        },
    }
    write_json(out, payload)
    if plot_png:
        plot(payload, os.path.splitext(out)[0] + ".png")
    payload["outputs"] = outputs  # returned, not written: per engine one (token ids, text) per line
    return payload


def _print_summary(payload: dict, repeats: int) -> None:
    """The medians per engine and the ratios against CTranslate2, as a table on stdout."""
    for name, r in payload["results"].items():
        print(f"{name:12s} {r['cpu_seconds']:8.3f} CPU s  {r['wall_seconds']:8.3f} s  (medians of {repeats})")
        if "split" in r:
            sp = r["split"]
            print(
                f"{'':12s} encoder graph {sp['encoder_graph_cpu_seconds']:.3f} s ({sp['encoder_calls']} calls), "
                f"step graph {sp['step_graph_cpu_seconds']:.3f} s ({sp['step_calls']} calls), "
                f"host {sp['host_cpu_seconds']:.3f} s"
            )
    for name, ratio in payload["over_ctranslate2_cpu"].items():
        if name != "onnxrt":
            a = payload["agreement_by_engine"][name]
            print(
                f"{name} / ctranslate2 CPU time: {ratio:.3f}; tokens equal on {a['lines_equal']} of {a['lines']} lines"
            )
    if payload["onnxrt_over_ctranslate2_cpu"] is not None:
        a = payload["agreement"]
        print(
            f"onnxrt / ctranslate2 CPU time: {payload['onnxrt_over_ctranslate2_cpu']:.3f}; "
            f"tokens equal on {a['lines_equal']} of {a['lines']} lines"
        )
        for m in a["mismatches"]:
            print(
                f"  line {m['line']}: {m['source']!r}: ours {m['onnxrt']!r}, CTranslate2 {m['ctranslate2']!r}"
            )
    elif payload["ctranslate2_missing"]:
        print(payload["ctranslate2_missing"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=5000, help="demo lines translated (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the demo lines (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="threads of each engine (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved timed rounds (default: %(default)s)")
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        help="our token batch budget (default: the translator's)",
    )
    p.add_argument(
        "--ct2-max-batch-tokens",
        type=int,
        default=None,
        help="CTranslate2's max_batch_size in tokens (default: --max-batch-tokens)",
    )
    add_option(
        p,
        "--max-decoding-length",
        deprecated=("--max-new-tokens",),
        dest="max_new_tokens",
        type=int,
        default=None,
        help="stop every translation after this many tokens, both engines (default: the model's budget); "
        "1 times the encoder plus one step, so a full run minus it is the decoder's share",
    )
    p.add_argument(
        "--engines",
        default=",".join(ENGINE_NAMES),
        help=f"comma-separated subset of {','.join(ALL_ENGINES)} (default: %(default)s)",
    )
    p.add_argument("--export", default=None, help="an export folder of the demo model (default: export one)")
    p.add_argument(
        "--export-gqa",
        default=None,
        help="an export folder of the demo model in the ort flavour, for onnxrt_gqa (default: export one)",
    )
    p.add_argument(
        "--split",
        action="store_true",
        help="also time our engines' encoder and decoder step graphs per call: each translation's CPU "
        "time split into encoder graph, step graph and host (the rest)",
    )
    p.add_argument("--out", default="benchmarks/results/bench_small_model.json", help="JSON result file")
    args = p.parse_args(argv)
    for name in ("lines", "threads", "repeats", "max_batch_tokens", "ct2_max_batch_tokens", "max_new_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            flag = "--max-decoding-length" if name == "max_new_tokens" else f"--{name.replace('_', '-')}"
            p.error(f"{flag} must be >= 1, got {value}")
    for flag, folder in (("--export", args.export), ("--export-gqa", args.export_gqa)):
        if folder is not None and not os.path.isfile(os.path.join(folder, "manifest.json")):
            p.error(f"{flag} {folder}: not an export folder (no manifest.json)")
    engines = [e for e in args.engines.split(",") if e]
    bad = sorted(set(engines) - set(ALL_ENGINES))
    if bad:
        p.error(f"--engines: unknown {bad}; choose from {list(ALL_ENGINES)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if "ctranslate2" in engines and not has_ctranslate2():
        print(CT2_MISSING, file=sys.stderr)
    payload = run(
        lines_n=args.lines,
        seed=args.seed,
        threads=args.threads,
        repeats=args.repeats,
        max_batch_tokens=args.max_batch_tokens,
        ct2_max_batch_tokens=args.ct2_max_batch_tokens,
        engines=engines,
        export=args.export,
        export_gqa=args.export_gqa,
        out=args.out,
        max_new_tokens=args.max_new_tokens,
        split=args.split,
    )
    _print_summary(payload, args.repeats)
    load = payload["load_average"]
    print(f"load average before {load['before'][0]:.2f}, after {load['after'][0]:.2f}; written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
