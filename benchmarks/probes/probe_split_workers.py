"""What a batch split over two 1-thread workers costs each engine: one worker on half the batch
against two workers on the whole batch at once, timed side by side in each engine's process;
for ours, the split with its workers in threads of one process against workers in processes.

    python -m benchmarks.probes.probe_split_workers --artifacts A            # int8, greedy and beam 4, batch 16
    python -m benchmarks.probes.probe_split_workers --artifacts A --dtype float32 --batch 64
    python -m benchmarks.probes.probe_split_workers --artifacts A --engines onnxrt --memory

``A`` is a ``bench_decode.py --artifacts`` folder (``A/base/onnx_int8`` and ``A/base/ct2_int8``,
or the float32 ``onnx`` and ``ct2``). The split is bench_decode's ``2x1`` setting, built by the
same code (``decode_worker.py``): ours two ``OrtRunner`` s of 1 thread, under
``runtimes.procpool.ProcessSourceParallel`` (each in a worker process: ``processes``, bench_decode's
default) and under ``runtimes.pool.SourceParallel`` (two threads of one Python process, sharing
its interpreter lock: ``threads``) and, with ``--pools ...,processes_shared``, in worker processes
whose runners leave the weight products unpacked on the shared mapping of ``weights.data``
(``OrtRunner(pack_weights=False)``); CTranslate2 ``inter_threads=2,
intra_threads=1`` with ``max_batch_size`` half the batch. Two workers on two cores that did not
disturb each other would take as long for the whole batch as one worker for its half:
``split_over_half`` (split time over one worker's half time) is 1.0 then, and what it exceeds 1.0
by is what running the two at once costs (shared caches and memory bandwidth, and for ours in
threads the interpreter lock the two threads' host work shares). Per pool of ours: ``by_pool``
(``split_ms``, ``split_over_half``, whether the first half's tokens equal the single worker's),
``processes_over_threads`` (the two splits' time ratio) and ``round_trip_ms``: a call of the pool
whose search does nothing but return ``--new-tokens`` tokens per source (what handing the parts
to the workers and their results back costs: pickling and pipes for processes). The top-level
``split_ms`` / ``split_over_half`` / ``half_tokens_equal_split`` are the first of ``--pools``
(``processes`` by default); ``round_trip_ms`` is at the top level. Each engine runs in a process of its own (this file with
``--child``), the decodes of bench_decode (random sources of length 24, seed 0, exactly
``--new-tokens`` tokens, no length penalty), medians of ``--rounds`` interleaved rounds in a
rotating order.

``--memory``: the memory of ours in each setting, each measured in a process of its own after one
beam-4 decode of the batch (``runtimes.procpool.process_memory``: ``/proc/PID/smaps_rollup`` of
the process and of its workers, KiB; ``mapped_rss`` / ``mapped_pss``: the pages of the export's
``weights.data`` mapped there): one runner in the process (``inprocess1``), two runners in threads
(``threads2``), one and two worker processes (``processes1``, ``processes2``), two worker
processes with unpacked weights (``processes2_shared``); ``total_pss_kib``
sums the process's and its workers' PSS (shared pages counted once over them). JSON at ``--out``.
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
POOLS = ("processes", "threads", "processes_shared")  # processes_shared: OrtRunner(pack_weights=False)
MEMORY_SETTINGS = {"inprocess1": ("inprocess", 1), "threads2": ("threads", 2)}
MEMORY_SETTINGS.update(processes1=("processes", 1), processes2=("processes", 2))
MEMORY_SETTINGS.update(processes2_shared=("processes_shared", 2))
BOS, EOS, SRC_LEN = 1, 2, 24
ROUND_TRIPS = 21


def _tokens_only(runner, src, lengths, n):
    """A search that decodes nothing: ``n`` tokens per source (the round trip's payload)."""
    return [[EOS] * n for _ in range(len(src))]


def _pool_spec(pool: str) -> dict:
    """decode_worker's spec keys of one of :data:`POOLS` ("" for CTranslate2: none)."""
    if not pool:
        return {}
    if pool == "processes_shared":
        return {"pool": "processes", "pack_weights": False}
    return {"pool": pool}


def _sources(batch: int, vocab: int):
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.integers(4, vocab, size=(batch, SRC_LEN)), np.full(batch, SRC_LEN)


def child(
    engine: str,
    model: str,
    dtype: str,
    modes: list[str],
    batch: int,
    new_tokens: int,
    rounds: int,
    vocab: int,
    pools: list[str],
) -> dict:
    """Every setting of one engine in this process: ``{mode: {"half_ms", "split_ms", ...}}``."""
    from benchmarks.decode import decode_worker

    build = decode_worker._onnxrt if engine == "onnxrt" else decode_worker._ctranslate2
    base = {"engine": engine, "model": model, "compute_type": dtype, "bos": BOS, "eos": EOS}
    one = build({**base, "threads": 1, "workers": 1})
    names = [f"split_{pool}" for pool in pools] if engine == "onnxrt" else ["split"]
    splits = {name: build({**base, "threads": 2, "workers": 2, **_pool_spec(name[6:])}) for name in names}
    src, lengths = _sources(batch, vocab)
    half = batch // 2
    out: dict = {}
    try:
        for mode in modes:
            runs = {"half": lambda m=mode: one(m, src[:half], lengths[:half], new_tokens)}
            runs.update(
                {name: (lambda m=mode, f=f: f(m, src, lengths, new_tokens)) for name, f in splits.items()}
            )
            tokens = {name: fn() for name, fn in runs.items()}  # warm-up, and the tokens compared
            samples: dict = {name: [] for name in runs}
            order = list(runs)
            for r in range(rounds):
                for name in order[r % len(order) :] + order[: r % len(order)]:
                    t0 = time.perf_counter()
                    runs[name]()
                    samples[name].append(time.perf_counter() - t0)
            median = {name: statistics.median(v) for name, v in samples.items()}
            by = {
                name: {
                    "split_ms": 1e3 * median[name],
                    "split_over_half": median[name] / median["half"],
                    "half_tokens_equal_split": [list(t) for t in tokens["half"]]
                    == [list(t) for t in tokens[name][:half]],
                }
                for name in splits
            }
            first = by[names[0]]
            out[mode] = {"half_ms": 1e3 * median["half"], **first}
            if engine == "onnxrt":
                out[mode]["by_pool"] = {name[6:]: r for name, r in by.items()}
                if {"split_processes", "split_threads"} <= set(median):
                    out[mode]["processes_over_threads"] = median["split_processes"] / median["split_threads"]
            out[mode]["samples_ms"] = {n: [1e3 * s for s in v] for n, v in samples.items()}
        if engine == "onnxrt":
            out["round_trip_ms"] = {}
            for name, f in splits.items():
                calls = []
                for _ in range(ROUND_TRIPS):
                    t0 = time.perf_counter()
                    f.parallel.run(_tokens_only, src, lengths, n=new_tokens)
                    calls.append(time.perf_counter() - t0)
                out["round_trip_ms"][name[6:]] = 1e3 * statistics.median(calls)
    finally:
        for f in splits.values():
            getattr(f, "close", lambda: None)()
    return out


def memory_child(model: str, setting: str, batch: int, new_tokens: int, vocab: int) -> dict:
    """One setting of ours (:data:`MEMORY_SETTINGS`) in this process: its memory and its
    workers' after one beam-4 decode of the batch."""
    import functools

    from benchmarks.decode import decode_worker
    from transformer_ext.export_format import WEIGHTS_FILE
    from transformer_ext.runtimes.ort import OrtRunner
    from transformer_ext.runtimes.pool import open_source_parallel
    from transformer_ext.runtimes.procpool import process_memory

    pool, workers = MEMORY_SETTINGS[setting]
    search = functools.partial(
        decode_worker._decode_part, mode="beam4", n=new_tokens, bos=BOS, eos=EOS, banned=[]
    )
    src, lengths = _sources(batch, vocab)
    parallel = None
    if pool == "inprocess":
        runner = OrtRunner(model, intra_op_num_threads=1)
        search(runner, src, lengths)
    else:
        spec = _pool_spec(pool)
        make = functools.partial(
            OrtRunner, model, intra_op_num_threads=1, pack_weights=spec.get("pack_weights", True)
        )
        parallel = open_source_parallel(make, workers, pool=spec["pool"])
        parallel.run(search, src, lengths)
    try:
        me = process_memory(os.getpid(), WEIGHTS_FILE)
        theirs = parallel.memory() if pool.startswith("processes") else []
    finally:
        if parallel is not None:
            parallel.close()
    keys = ("rss", "pss", "pss_anon", "pss_file", "mapped_rss", "mapped_pss", "mapped_regions")
    weights = os.path.join(model, WEIGHTS_FILE)
    return {
        "process": {k: me.get(k) for k in keys},
        "workers": [{k: m.get(k) for k in keys} for m in theirs],
        "total_pss_kib": me["pss"] + sum(m["pss"] for m in theirs),
        "weights_file_kib": os.path.getsize(weights) // 1024 if os.path.exists(weights) else 0,
    }


def _run_child(cmd: list[str], what: str):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(
            f"probe_split_workers.py: error: the {what} process failed:\n{proc.stderr[-2000:]}",
            file=sys.stderr,
        )
        return None
    return json.loads(proc.stdout)


def _parser() -> argparse.ArgumentParser:
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
    p.add_argument(
        "--pools",
        default="processes,threads",
        help="our split's pools, comma-separated subset of processes,threads,processes_shared (the "
        "first gives split_ms; processes_shared: workers whose runners read the mapped weights, unpacked)",
    )
    p.add_argument("--memory", action="store_true", help="also measure our memory in each setting")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-memory", default=None, choices=sorted(MEMORY_SETTINGS), help=argparse.SUPPRESS)
    p.add_argument(
        "--out", default=os.path.join(HERE, "results", "probe_split_workers.json"), help="JSON path"
    )
    return p


def _checked(p: argparse.ArgumentParser, args) -> tuple[list, list, list, dict]:
    """``(modes, engines, pools, models)`` of the arguments (a usage error when one is bad)."""
    modes = [m for m in args.modes.split(",") if m]
    engines = [e for e in args.engines.split(",") if e]
    pools = [m for m in args.pools.split(",") if m]
    if not modes or set(modes) - {"greedy", "beam4"}:
        p.error(f"--modes: expected a comma-separated subset of greedy,beam4, got {args.modes!r}")
    if not engines or set(engines) - set(ENGINES):
        p.error(f"--engines: expected a comma-separated subset of {','.join(ENGINES)}, got {args.engines!r}")
    if not pools or set(pools) - set(POOLS) or len(set(pools)) != len(pools):
        p.error(f"--pools: expected a comma-separated subset of {','.join(POOLS)}, got {args.pools!r}")
    if args.batch < 2 or args.batch % 2 or args.new_tokens < 1 or args.rounds < 1 or args.src_vocab < 5:
        p.error("--batch must be even and at least 2; --new-tokens and --rounds at least 1, --src-vocab 5")
    if args.memory and "onnxrt" not in engines:
        p.error("--memory measures ours: --engines must name onnxrt")
    models = {}
    for e in engines:
        models[e] = os.path.join(
            args.artifacts, "base", ENGINES[e] + ("_int8" if args.dtype == "int8" else "")
        )
        if not os.path.isdir(models[e]):
            p.error(
                f"--artifacts: no {models[e]} (run bench_decode.py --artifacts {args.artifacts} --prepare-only)"
            )
    return modes, engines, pools, models


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    modes, engines, pools, models = _checked(p, args)
    if args.child_memory:
        result = memory_child(
            models["onnxrt"], args.child_memory, args.batch, args.new_tokens, args.src_vocab
        )
        json.dump(result, sys.stdout)
        return 0
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
            pools,
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
        "pools": pools,
        "machine": lscpu(),
        "load_average_before": os.getloadavg(),
        "engines": {},
    }
    common = ["--artifacts", args.artifacts, "--dtype", args.dtype, "--modes", ",".join(modes)]
    common += ["--batch", str(args.batch), "--new-tokens", str(args.new_tokens), "--rounds", str(args.rounds)]
    common += ["--src-vocab", str(args.src_vocab), "--pools", ",".join(pools)]
    here = [sys.executable, "-m", "benchmarks.probes.probe_split_workers"]
    for e in engines:
        result = _run_child(here + ["--child", e, "--engines", e] + common, e)
        if result is None:
            return 1
        if "round_trip_ms" in result:
            out["round_trip_ms"] = result.pop("round_trip_ms")
        out["engines"][e] = result
        for mode in modes:
            r = result[mode]
            print(
                f"{e:<12} {mode:<6} one worker, {args.batch // 2} sources {r['half_ms']:8.1f} ms   "
                f"two workers, {args.batch} sources {r['split_ms']:8.1f} ms   split / half {r['split_over_half']:.3f}"
            )
            for pool, b in r.get("by_pool", {}).items():
                print(
                    f"{'':<12} {'':<6} {pool:<9} split {b['split_ms']:8.1f} ms   split / half {b['split_over_half']:.3f}"
                )
    if args.memory:
        out["memory"] = {}
        for setting in MEMORY_SETTINGS:
            result = _run_child(here + ["--child-memory", setting, "--engines", "onnxrt"] + common, setting)
            if result is None:
                return 1
            out["memory"][setting] = result
            print(
                f"memory {setting:<11} total PSS {result['total_pss_kib'] / 1024:8.1f} MiB   "
                f"weights.data {result['weights_file_kib'] / 1024:.1f} MiB"
            )
    out["load_average_after"] = os.getloadavg()
    write_json(args.out, out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
