"""``ops.linear`` (the CPU matrix-vector kernel) against ``torch.nn.functional.linear``.

    python -m benchmarks.ops.bench_linear            # base decoder shapes, rows 1/2/4, 2 threads
    python -m benchmarks.ops.bench_linear --quick    # a smoke run

Two measurements, both float32, medians of interleaved repeats (``common.time_side_by_side``):

* ``step``: the 37 projections of one ``base`` decoder step in their order (per layer the fused
  Q/K/V [1536, 512], W_O, the cross-attention W_Q and W_O [512, 512], the feed-forward [2048, 512]
  and [512, 2048]; then the output projection [8000, 512]): 104 MB of weights, so each product
  streams its weights from the cache hierarchy as in a real decode, not from L1/L2;
* ``shape``: each distinct shape alone, called repeatedly (its weights stay cache-resident).

Writes ``benchmarks/results/bench_linear.json`` and a PNG beside it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
import torch.nn.functional as F

from benchmarks.common import environment, time_side_by_side, write_json
from transformer_ext import ops

logger = logging.getLogger("bench_linear")
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (results/ lives here)


def decoder_step_shapes(d_model: int = 512, d_ff: int = 2048, layers: int = 6, vocab: int = 8000):
    """``(out_features, in_features)`` of one decoder step's projections, in order."""
    per_layer = [
        (3 * d_model, d_model),
        (d_model, d_model),
        (d_model, d_model),
        (d_model, d_model),
        (d_ff, d_model),
        (d_model, d_ff),
    ]
    return per_layer * layers + [(vocab, d_model)]


def run(rows_list, repeats: int, threads: int, quick: bool, out: str) -> dict:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    shapes = decoder_step_shapes(128, 512, 2, 1000) if quick else decoder_step_shapes()
    weights = [(torch.randn(n, k, generator=g) / k**0.5, torch.randn(n, generator=g)) for n, k in shapes]
    results = {
        "environment": environment(),
        "dtype": "float32",
        "repeats": repeats,
        "weight_bytes_per_step": sum(w.numel() * 4 for w, _ in weights),
        "step": [],
        "shape": [],
    }
    for rows in rows_list:
        inputs = {k: torch.randn(rows, k, generator=g) for k in {k for _, k in shapes}}
        for w, b in weights:  # same results before timing
            x = inputs[w.shape[1]]
            torch.testing.assert_close(ops.linear(x, w, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)

        def step(fn):
            def call():
                for w, b in weights:
                    fn(inputs[w.shape[1]], w, b)

            return call

        with torch.inference_mode():
            t = time_side_by_side(
                {"ops.linear": step(ops.linear), "F.linear": step(F.linear)}, "cpu", repeats=repeats
            )
        entry = {"rows": rows, "seconds": t, "speedup": t["F.linear"] / t["ops.linear"]}
        results["step"].append(entry)
        logger.info(
            "step (%d products), rows %d: ops.linear %.2f ms, F.linear %.2f ms -> x%.2f",
            len(weights),
            rows,
            t["ops.linear"] * 1e3,
            t["F.linear"] * 1e3,
            entry["speedup"],
        )
        for n, k in sorted(set(shapes)):
            w, b = next(wb for wb in weights if tuple(wb[0].shape) == (n, k))
            x = inputs[k]
            with torch.inference_mode():
                t = time_side_by_side(
                    {"ops.linear": lambda: ops.linear(x, w, b), "F.linear": lambda: F.linear(x, w, b)},
                    "cpu",
                    repeats=repeats,
                )
            entry = {
                "rows": rows,
                "out_features": n,
                "in_features": k,
                "seconds": t,
                "speedup": t["F.linear"] / t["ops.linear"],
            }
            results["shape"].append(entry)
            logger.info(
                "  [%5d, %4d] rows %d: ops.linear %6.1f us, F.linear %6.1f us -> x%.2f",
                n,
                k,
                rows,
                t["ops.linear"] * 1e6,
                t["F.linear"] * 1e6,
                entry["speedup"],
            )
    write_json(out, results)
    plot(results, os.path.splitext(out)[0] + ".png")
    logger.info("wrote %s and %s", out, os.path.splitext(out)[0] + ".png")
    return results


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels, values = [], []
    for e in results["step"]:
        labels.append(f"step\nrows {e['rows']}")
        values.append(e["speedup"])
    for e in results["shape"]:
        labels.append(f"{e['out_features']}x{e['in_features']}\nrows {e['rows']}")
        values.append(e["speedup"])
    bars = ax.bar(range(len(values)), values)
    ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(values)), labels, fontsize=6)
    ax.set(
        ylabel="speed-up of ops.linear over F.linear",
        title=f"decoder-step projections, float32, {results['environment']['torch_threads']} threads",
    )
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4", help="comma-separated input rows (default: 1,2,4)")
    p.add_argument("--repeats", type=int, default=9, help="repeats; medians reported (default: 9)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default: 2)")
    p.add_argument("--quick", action="store_true", help="a smaller model, rows 1, 3 repeats: a smoke test")
    p.add_argument(
        "--out",
        default=None,
        help="JSON path (default: benchmarks/results/bench_linear.json, "
        "bench_linear_quick.json with --quick)",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = [1] if args.quick else [int(r) for r in args.rows.split(",")]
    out = args.out or os.path.join(
        HERE, "results", "bench_linear_quick.json" if args.quick else "bench_linear.json"
    )
    run(rows, 3 if args.quick else args.repeats, args.threads, args.quick, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
