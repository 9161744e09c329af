"""Fused attention (ops.attention) against SDPA and the three-step path it replaces.

    python -m benchmarks.ops.bench_attention                # CPU, 2 threads -> results/bench_attention_cpu.{json,png}
    python -m benchmarks.ops.bench_attention --quick        # a smoke run
    python -m benchmarks.ops.bench_attention --device cuda  # on a GPU machine

Cases: T in {64, 128, 256, 512, 1024} with B = 4096 / T, H = 8, D = 64, float32; full-length
rows or ragged ones (key lengths uniform in [T/2, T], one seed); attention dropout 0 or 0.1;
forward alone or forward + backward. Engines, timed side by side (interleaved repeats, medians):

* ``ours``: ``ops.attention(q, k, v, key_lengths=...)`` (dropout inside the kernel);
* ``sdpa``: ``F.scaled_dot_product_attention`` with the bool padding mask ``[B, 1, 1, T]``;
* ``three_step``: matmul, ``ops.masked_softmax``, ``F.dropout``, matmul (today's training path).

Outputs are compared (dropout 0) before anything is timed. Peak memory of forward + backward at
the largest T, in a fresh process per engine: the growth of the peak RSS (inputs and a small
same-style warm-up first) and the peak of torch's allocator (torch.profiler).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

from benchmarks.common import environment, save_figure, time_side_by_side, write_json
from transformer_ext import ops

logger = logging.getLogger("bench_attention")
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (results/ lives here)
ENGINES = ("ours", "sdpa", "three_step")


def make_inputs(B, H, T, D, ragged, device, dtype=torch.float32, grad=False):
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(B, H, T, D, generator=g).to(device=device, dtype=dtype) for _ in range(3))
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    lengths = (torch.randint(T // 2, T + 1, (B,), generator=g) if ragged else torch.full((B,), T)).to(device)
    mask = torch.arange(T, device=device).view(1, 1, 1, T) < lengths.view(B, 1, 1, 1)
    return q, k, v, (lengths if ragged else None), (mask if ragged else None)


def engine_fn(name, q, k, v, lengths, mask, p):
    scale = 1.0 / math.sqrt(q.shape[-1])
    if name == "ours":
        return lambda: ops.attention(q, k, v, key_lengths=lengths, scale=scale, dropout_p=p)
    if name == "sdpa":
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=scale)
    if name == "three_step":

        def three():
            probs = ops.masked_softmax(q @ k.transpose(-2, -1), mask, scale, False)
            if p > 0:
                probs = F.dropout(probs, p)
            return probs @ v

        return three
    raise ValueError(f"unknown engine {name!r}; expected one of {ENGINES}")


def with_backward(fn, grad_out):
    def run():
        out = fn()
        out.backward(grad_out)
        return out

    return run


def bench(device, sizes, repeats, min_time):
    H, D = 8, 64
    rows = []
    for T in sizes:
        B = max(1, 4096 // T)
        for ragged in (False, True):
            for p in (0.0, 0.1):
                for mode in ("fwd", "fwd+bwd"):
                    q, k, v, lengths, mask = make_inputs(B, H, T, D, ragged, device, grad=mode != "fwd")
                    fns = {e: engine_fn(e, q, k, v, lengths, mask, p) for e in ENGINES}
                    if p == 0 and mode == "fwd":
                        ref = fns["three_step"]()
                        for e in ("ours", "sdpa"):
                            err = (fns[e]() - ref).abs().max().item()
                            if err > 1e-4:
                                raise RuntimeError(f"{e} differs from three_step by {err:.3g} at T={T}")
                    if mode == "fwd+bwd":
                        grad_out = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(1)).to(
                            device
                        )
                        fns = {e: with_backward(f, grad_out) for e, f in fns.items()}
                        ctx = torch.enable_grad()
                    else:
                        ctx = torch.no_grad()
                    with ctx:
                        t = time_side_by_side(fns, device, repeats=repeats, min_time=min_time)
                    row = {
                        "T": T,
                        "B": B,
                        "H": H,
                        "D": D,
                        "ragged": ragged,
                        "dropout_p": p,
                        "mode": mode,
                        "seconds": t,
                        "speedup_vs_sdpa": t["sdpa"] / t["ours"],
                        "speedup_vs_three_step": t["three_step"] / t["ours"],
                    }
                    rows.append(row)
                    logger.info(
                        "T=%4d B=%3d %-6s p=%.1f %-7s ours %8.2f ms  sdpa %8.2f ms (%.2fx)  three-step %8.2f ms (%.2fx)",
                        T,
                        B,
                        "ragged" if ragged else "full",
                        p,
                        mode,
                        t["ours"] * 1e3,
                        t["sdpa"] * 1e3,
                        row["speedup_vs_sdpa"],
                        t["three_step"] * 1e3,
                        row["speedup_vs_three_step"],
                    )
    return rows


def _rss_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def _head_views(q, k, v):
    """q, k, v as head views of [B, T, H * D] projections, as in the model (gradients land in
    the contiguous bases, which are returned too)."""
    bases = [t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
    return bases, [t.transpose(1, 2) for t in bases]


def _allocator_peak(run) -> int:
    """Peak of the bytes live in torch's CPU allocator during ``run()``, above what was live when
    it started (torch.profiler's memory events, summed in time order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def memory_probe(engine, T, ragged, threads):
    """Memory of one forward + backward at length T in this fresh process, two ways:

    * ``peak_rss_growth_bytes``: the growth of the peak RSS (``VmHWM``, reset through
      ``/proc/self/clear_refs`` once the inputs exist, so start-up peaks do not count);
    * ``allocator_peak_bytes``: the peak of the bytes live in torch's allocator (torch.profiler,
      ``profile_memory=True``) during a second, identical forward + backward.

    Before either, a small warm-up runs the same engine the same way (head views of projections,
    ``backward`` with an explicit gradient): the first explicit-gradient ``backward`` of a process
    imports torch.fx's symbolic-shape helpers (sympy, mpmath: about 34 MiB of Python objects),
    which would otherwise land in the measured RSS of every engine alike.
    """
    torch.set_num_threads(threads)
    wq, wk, wv, wl, wm = make_inputs(2, 2, 8, 64, ragged, "cpu")
    _, views = _head_views(wq, wk, wv)
    warm_out = engine_fn(engine, *views, wl, wm, 0.0)()
    warm_out.backward(torch.ones_like(warm_out))
    del warm_out, views
    B = max(1, 4096 // T)
    q, k, v, lengths, mask = make_inputs(B, 8, T, 64, ragged, "cpu")
    bases, (q, k, v) = _head_views(q, k, v)
    grad_out = torch.randn_like(q)
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _rss_kib("VmRSS")
    fn = engine_fn(engine, q, k, v, lengths, mask, 0.0)
    fn().backward(grad_out)
    rss = (_rss_kib("VmHWM") - before) * 1024
    for t in bases:
        t.grad = None
    return {
        "peak_rss_growth_bytes": rss,
        "allocator_peak_bytes": _allocator_peak(lambda: fn().backward(grad_out)),
    }


def peak_memory(T, threads):
    rss, alloc = {}, {}
    for engine in ENGINES:
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.ops.bench_attention",
            "--memory-probe",
            engine,
            "--memory-T",
            str(T),
            "--threads",
            str(threads),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        probe = json.loads(res.stdout.strip().splitlines()[-1])
        rss[engine], alloc[engine] = probe["peak_rss_growth_bytes"], probe["allocator_peak_bytes"]
        logger.info(
            "fwd+bwd at T=%d (full rows): %-10s peak RSS growth %7.1f MiB, allocator peak %7.1f MiB",
            T,
            engine,
            rss[engine] / 2**20,
            alloc[engine] / 2**20,
        )
    return {
        "T": T,
        "bytes": rss,
        "allocator_peak_bytes": alloc,
        "ratio_ours_vs_three_step": {
            "rss": rss["ours"] / rss["three_step"],
            "allocator": alloc["ours"] / alloc["three_step"],
        },
        "method": "fresh process per engine; inputs (head views of [B, T, H*D] projections) and a small "
        "warm-up of the same engine with an explicit-gradient backward first (it imports torch.fx's "
        "sympy helpers, ~34 MiB, once per process); bytes: growth of the peak RSS over one "
        "forward + backward; allocator_peak_bytes: peak of torch's allocator (torch.profiler "
        "profile_memory) over a second one. The irreducible part is the output and dq, dk, dv: "
        "4 * B*H*T*D float32 = 32 MiB at T = 1024.",
    }


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        for ragged in (False, True):
            for p in (0.0, 0.1):
                rs = [
                    r
                    for r in results["cases"]
                    if r["mode"] == mode and r["ragged"] == ragged and r["dropout_p"] == p
                ]
                label = f"{'ragged' if ragged else 'full'}, dropout {p}"
                ax.plot(
                    [r["T"] for r in rs], [r["speedup_vs_sdpa"] for r in rs], "o-", label=f"vs SDPA, {label}"
                )
                ax.plot(
                    [r["T"] for r in rs],
                    [r["speedup_vs_three_step"] for r in rs],
                    "s--",
                    label=f"vs three-step, {label}",
                )
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set(
            xscale="log", xlabel="T (B = 4096 / T), H=8, D=64", ylabel="speed-up of ops.attention", title=mode
        )
        ax.legend(fontsize=7)
    env = results["environment"]
    fig.suptitle(
        f"ops.attention on {results['device']} ({env.get('gpu', env.get('cpu_model', 'cpu'))}, {env['torch_threads']} threads)"
    )
    fig.tight_layout()
    save_figure(fig, path)


def cpu_description() -> dict:
    info = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "L2 cache", "L3 cache", "CPU(s)"):
                info[
                    {"Model name": "cpu_model", "L2 cache": "l2", "L3 cache": "l3", "CPU(s)": "cpus"}[
                        key.strip()
                    ]
                ] = value.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads on CPU (default: 2)")
    p.add_argument(
        "--repeats", type=int, default=7, help="repeats per case; medians are reported (default: 7)"
    )
    p.add_argument("--sizes", default="64,128,256,512,1024", help="comma-separated T values")
    p.add_argument(
        "--quick", action="store_true", help="T in {32, 64}, 2 repeats, no memory probe: a smoke test"
    )
    p.add_argument(
        "--out", default=None, help="JSON path (default: benchmarks/results/bench_attention_<device>.json)"
    )
    p.add_argument(
        "--memory-only",
        action="store_true",
        help="only measure the peak memory (at the largest --sizes) and add it to the existing --out JSON",
    )
    p.add_argument("--memory-probe", default=None, help=argparse.SUPPRESS)
    p.add_argument("--memory-T", type=int, default=1024, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.memory_probe:
        print(json.dumps(memory_probe(args.memory_probe, args.memory_T, False, args.threads)))
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a visible CUDA GPU")
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        p.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    if not sizes or min(sizes) < 1:
        p.error("--sizes must list positive integers")
    if args.repeats < 1 or args.threads < 1:
        p.error("--repeats and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    out = args.out or os.path.join(HERE, "results", f"bench_attention_{args.device}.json")
    if args.memory_only:
        if not os.path.isfile(out):
            p.error(
                f"--memory-only adds to an existing result file, and {out} does not exist: run without it first"
            )
        with open(out, encoding="utf-8") as f:
            results = json.load(f)
        results["peak_memory_fwd_bwd"] = peak_memory(max(sizes), args.threads)
        write_json(out, results)
        logger.info("updated %s", out)
        return
    if args.quick:
        sizes, repeats, min_time = [32, 64], 2, 0.005
    else:
        repeats, min_time = args.repeats, 0.05
    load_before = os.getloadavg()  # other processes on the machine skew every ratio: recorded
    results = {
        "device": args.device,
        "environment": {**environment(), **cpu_description()},
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "cases": bench(args.device, sizes, repeats, min_time),
    }
    results["load_average_1_5_15min"] = {"before": load_before, "after": os.getloadavg()}
    if args.device == "cpu" and not args.quick:
        results["peak_memory_fwd_bwd"] = peak_memory(max(sizes), args.threads)
    write_json(out, results)
    plot(results, os.path.splitext(out)[0] + ".png")
    logger.info("wrote %s and %s", out, os.path.splitext(out)[0] + ".png")


if __name__ == "__main__":
    main()
