"""Where a decode's time goes: ONNX Runtime's own profiler per operator type, and the split
between the runner's graph runs and the host-side search.

    python -m benchmarks.profiles.profile_decode --export DIR                  # beam 4 and greedy, batch 1 and 16
    python -m benchmarks.profiles.profile_decode --export DIR --modes beam4 --batch-sizes 1 --threads 2

``DIR`` is an export folder (``python -m export.onnx``; ``bench_decode.py --artifacts A`` leaves
the benchmark's in ``A/base/onnx``). The decode is the benchmark's: random sources of length 24
(seed 0), exactly ``--new-tokens`` tokens (EOS suppressed), beam search without length penalty.

Two passes per case, in this process (ONNX Runtime only, no torch):

* **split** (no profiler): wall time of whole decodes (median of ``--repeats``) divided into the
  encoder run, the decoder steps (the graph run plus the cache append, through ``runner.step``
  or ``runner.step_top_k``), the search head (the rest of ``step_top_k``: the log-softmax and
  top-k graph, where the search takes it), the beam reorders and the rest (the search's host
  work);
* **operators**: one decode with ONNX Runtime's profiler on; the kernel time of every node,
  summed per operator type and divided by the steps. The profiler adds a fixed cost per node,
  so its total is larger than the split's step time: compare operator types with each other
  and across cases, not with the split. Every step session the runner may run is profiled (an
  int8 export's few-row step too); ``step_runs_by_graph`` counts the steps each one ran.

Writes JSON (``--out``, default ``benchmarks/results/profile_decode.json``) and prints a table.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (results/ lives here)

from benchmarks.common import environment, machine_info, write_json

logger = logging.getLogger("profile_decode")

SRC_LEN = 24
BEAM = 4


class _Timed:
    """A runner wrapper that adds up the wall time of each protocol call."""

    def __init__(self, runner):
        self.runner = runner
        self.seconds = collections.Counter()
        run_step = runner._run_step

        def timed_run_step(*args):  # the graph run inside step_top_k, counted as "step"
            t0 = time.perf_counter()
            run_step(*args)
            self.seconds["step"] += time.perf_counter() - t0
            self.seconds["head"] -= time.perf_counter() - t0  # (step_top_k's total counts as "head")

        self._timed_run_step = timed_run_step

    def _timed(self, name, *args, method=None):
        t0 = time.perf_counter()
        out = getattr(self.runner, method or name)(*args)
        self.seconds[name] += time.perf_counter() - t0
        return out

    def encode(self, *args):
        return self._timed("encode", *args)

    def step(self, *args):
        return self._timed("step", *args)

    def step_top_k(self, *args):
        """The runner's step_top_k: its graph run counted as "step", the search head as "head"."""
        self.runner._run_step = self._timed_run_step
        try:
            return self._timed("head", *args, method="step_top_k")
        finally:
            del self.runner._run_step

    def reorder(self, *args):
        return self._timed("reorder", *args)

    def select(self, *args):  # dropping finished sources (none finish early in these decodes)
        return self._timed("select", *args)


def _decode(runner, mode, src, lengths, n_tokens):
    from transformer_ext.decoding import beam_search, greedy_decode

    inner = runner.runner if isinstance(runner, _Timed) else runner
    bos, eos = inner.info.bos_id, inner.info.eos_id
    if mode == "greedy":
        return greedy_decode(
            runner,
            src,
            lengths,
            bos_id=bos,
            eos_id=eos,
            max_decoding_length=n_tokens,
            min_decoding_length=n_tokens,
        )
    return beam_search(
        runner,
        src,
        lengths,
        bos_id=bos,
        eos_id=eos,
        beam_size=BEAM,
        max_decoding_length=n_tokens,
        min_decoding_length=n_tokens,
        length_penalty_type="none",
    )


def split(export_dir, mode, batch, threads, n_tokens, repeats):
    from transformer_ext.runtimes.ort import OrtRunner

    runner = OrtRunner(export_dir, intra_op_num_threads=threads)
    rng = np.random.default_rng(0)
    src = rng.integers(4, runner.info.src_vocab_size, size=(batch, SRC_LEN))
    lengths = np.full(batch, SRC_LEN)
    _decode(runner, mode, src, lengths, n_tokens)  # warm-up
    runs = []
    for _ in range(repeats):
        timed = _Timed(runner)
        t0 = time.perf_counter()
        _decode(timed, mode, src, lengths, n_tokens)
        total = time.perf_counter() - t0
        parts = {k: timed.seconds[k] for k in ("encode", "step", "head", "reorder", "select")}
        runs.append({"total": total, **parts, "search": total - sum(parts.values())})
    runs.sort(key=lambda r: r["total"])
    med = runs[len(runs) // 2]
    return {k: round(v * 1e3, 3) for k, v in med.items()} | {
        "step_ms_per_step": round(med["step"] * 1e3 / n_tokens, 3)
    }


def operators(export_dir, mode, batch, threads, n_tokens):
    import onnxruntime as ort

    from transformer_ext.runtimes.ort import OrtRunner

    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(tmp, "ort")
        runner = OrtRunner(export_dir, session_options=so)
        rng = np.random.default_rng(0)
        src = rng.integers(4, runner.info.src_vocab_size, size=(batch, SRC_LEN))
        _decode(runner, mode, src, np.full(batch, SRC_LEN), n_tokens)
        events, runs = [], {}
        # every step session the runner may run (an int8 export's few-row step as well)
        for name, session in runner.step_sessions.items():
            with open(session.end_profiling(), encoding="utf-8") as f:
                mine = json.load(f)
            runs[name] = sum(1 for e in mine if e.get("name") == "model_run")
            events += mine
        runner.encoder.end_profiling()
    per_op, count = collections.Counter(), collections.Counter()
    run_us = 0
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            op = e["args"].get("op_name", "?")
            per_op[op] += e["dur"]
            count[op] += 1
        elif e.get("name") == "model_run":
            run_us += e["dur"]
    return {
        "step_runs_by_graph": runs,
        "model_run_ms_per_step": round(run_us / n_tokens / 1e3, 3),
        "nodes_per_step": round(sum(count.values()) / n_tokens, 1),
        "ops": {
            op: {
                "ms_per_step": round(us / n_tokens / 1e3, 3),
                "nodes_per_step": round(count[op] / n_tokens, 1),
            }
            for op, us in per_op.most_common()
        },
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--export", required=True, help="an export folder (python -m export.onnx)")
    p.add_argument("--modes", default="greedy,beam4", help="comma-separated subset of greedy,beam4")
    p.add_argument("--batch-sizes", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    p.add_argument("--new-tokens", type=int, default=48, help="tokens generated per sequence")
    p.add_argument(
        "--repeats", type=int, default=5, help="decodes timed for the split; the median is reported"
    )
    p.add_argument("--out", default=os.path.join(HERE, "results", "profile_decode.json"), help="JSON path")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= {"greedy", "beam4"}:
        p.error(f"--modes must be a subset of greedy,beam4, got {args.modes!r}")
    try:
        batches = [int(b) for b in args.batch_sizes.split(",") if b]
    except ValueError:
        p.error(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}")
    if not os.path.isfile(os.path.join(args.export, "manifest.json")):
        p.error(f"--export {args.export} is not an export folder (no manifest.json)")
    if args.new_tokens < 1 or args.repeats < 1 or args.threads < 1 or any(b < 1 for b in batches):
        p.error("--new-tokens, --repeats, --threads and the batch sizes must be positive")
    results = {
        "machine": machine_info(threads=(args.threads,)),
        "environment": environment(),
        "export": os.path.abspath(args.export),
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "src_len": SRC_LEN,
        "load_average_start": os.getloadavg(),
        "cases": [],
    }
    for mode in modes:
        for batch in batches:
            case = {
                "mode": mode,
                "batch": batch,
                "split_ms": split(args.export, mode, batch, args.threads, args.new_tokens, args.repeats),
                "operators": operators(args.export, mode, batch, args.threads, args.new_tokens),
            }
            results["cases"].append(case)
            s, o = case["split_ms"], case["operators"]
            logger.info(
                "%s batch %d, %d threads: total %.1f ms = encode %.1f + steps %.1f (%.2f/step) + search head "
                "%.1f + reorder %.1f + search %.1f",
                mode,
                batch,
                args.threads,
                s["total"],
                s["encode"],
                s["step"],
                s["step_ms_per_step"],
                s["head"],
                s["reorder"],
                s["search"],
            )
            top = list(o["ops"].items())[:8]
            logger.info(
                "  profiler: %.2f ms/step over %.0f nodes; %s",
                o["model_run_ms_per_step"],
                o["nodes_per_step"],
                ", ".join(f"{k} {v['ms_per_step']:.2f}" for k, v in top),
            )
    results["load_average_end"] = os.getloadavg()
    write_json(args.out, results)
    logger.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
