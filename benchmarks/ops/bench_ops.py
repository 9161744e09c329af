"""Benchmarks of the compiled ops against the PyTorch paths they replace.

    python -m benchmarks.ops.bench_ops                 # CPU, 2 threads, writes results/bench_ops_cpu.{json,png}
    python -m benchmarks.ops.bench_ops --device cuda   # on a GPU machine
    python -m benchmarks.ops.bench_ops --quick         # a smoke run with small sizes

All engines of one case are timed side by side in one run (interleaved repeats, medians);
the outputs are compared against each other before any time is recorded.

Engines:
* masked_softmax: ours (scale fused) vs the eager composite
  ``(scores*scale).masked_fill(~mask, -inf).softmax(-1)`` vs ``torch._masked_softmax``
  (given pre-scaled scores and its own mask convention, True = masked: strictly less work).
* attention: matmul + our masked_softmax + matmul vs ``F.scaled_dot_product_attention``
  with the same bool mask.
* decode_attention: ours vs eager attention over the cache prefix (slice to the longest length,
  matmul, masked softmax, matmul).
* kv_cache_append_: one preallocated cache written in place vs growing with ``torch.cat``,
  per-step time against the step.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time

import torch
import torch.nn.functional as F

from benchmarks.common import environment, sync, time_side_by_side, write_json
from transformer_ext import ops, reference

logger = logging.getLogger("bench_ops")
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (results/ lives here)


def _padding_mask(B, K, device):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(K // 2, K + 1, (B,), generator=g)
    lengths[0] = K
    return (torch.arange(K).view(1, K) < lengths.view(B, 1)).to(device)  # [B, K] True = keep


def bench_masked_softmax(device, dtypes, sizes, B, H, repeats):
    rows = []
    for dtype in dtypes:
        for K in sizes:
            Q = K
            scale = 1 / math.sqrt(64)
            scores = torch.randn(B, H, Q, K, device=device, dtype=dtype)
            for mask_kind in ("padding", "causal"):
                if mask_kind == "padding":
                    keep = _padding_mask(B, K, device)
                    mask4 = keep.view(B, 1, 1, K)
                    causal = False
                    tm_mask, tm_type = ~keep, 1  # src_key_padding_mask [B, K]
                else:
                    mask4 = None
                    causal = True
                    keep_qk = reference.causal_mask(Q, K, device=device)
                    tm_mask, tm_type = ~keep_qk, 0  # src_mask [Q, K]
                full_keep = mask4 if mask4 is not None else reference.causal_mask(Q, K, device=device)
                pre_scaled = scores * scale

                fns = {
                    "ours": lambda: ops.masked_softmax(scores, mask4, scale, causal),
                    "eager": lambda: (scores * scale).masked_fill(~full_keep, float("-inf")).softmax(-1),
                    "torch._masked_softmax": lambda: torch._masked_softmax(pre_scaled, tm_mask, 3, tm_type),
                }
                a, b, c = fns["ours"](), fns["eager"](), fns["torch._masked_softmax"]()
                tol = 1e-5 if dtype == torch.float32 else 2e-2
                assert (a.float() - b.float()).abs().max() <= tol, "ours != eager"
                assert (a.float() - c.float()).abs().max() <= tol, "ours != torch._masked_softmax"
                t = time_side_by_side(fns, device, repeats=repeats)
                row = {
                    "op": "masked_softmax",
                    "dtype": str(dtype).replace("torch.", ""),
                    "mask": mask_kind,
                    "B": B,
                    "H": H,
                    "Q": Q,
                    "K": K,
                    "seconds": t,
                    "speedup_vs_eager": t["eager"] / t["ours"],
                    "speedup_vs_torch_masked_softmax": t["torch._masked_softmax"] / t["ours"],
                }
                rows.append(row)
                logger.info(
                    "masked_softmax %-8s %-7s K=%4d  ours %.3f ms  eager x%.2f  _masked_softmax x%.2f",
                    row["dtype"],
                    mask_kind,
                    K,
                    t["ours"] * 1e3,
                    row["speedup_vs_eager"],
                    row["speedup_vs_torch_masked_softmax"],
                )
    return rows


def bench_attention(device, dtypes, sizes, B, H, D, repeats):
    rows = []
    for dtype in dtypes:
        for K in sizes:
            q = torch.randn(B, H, K, D, device=device, dtype=dtype)
            k = torch.randn(B, H, K, D, device=device, dtype=dtype)
            v = torch.randn(B, H, K, D, device=device, dtype=dtype)
            keep = _padding_mask(B, K, device).view(B, 1, 1, K)
            scale = 1 / math.sqrt(D)

            def ours():
                p = ops.masked_softmax(torch.matmul(q, k.transpose(-2, -1)), keep, scale, True)
                return torch.matmul(p, v)

            causal_keep = keep & reference.causal_mask(K, K, device=device)

            def sdpa():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_keep, scale=scale)

            tol = 1e-4 if dtype == torch.float32 else 5e-2
            assert (ours().float() - sdpa().float()).abs().max() <= tol, "attention mismatch"
            t = time_side_by_side({"ours": ours, "sdpa": sdpa}, device, repeats=repeats)
            row = {
                "op": "attention",
                "dtype": str(dtype).replace("torch.", ""),
                "mask": "padding+causal",
                "B": B,
                "H": H,
                "Q": K,
                "K": K,
                "D": D,
                "seconds": t,
                "speedup_vs_sdpa": t["sdpa"] / t["ours"],
            }
            rows.append(row)
            logger.info(
                "attention      %-8s K=%4d  ours %.3f ms  sdpa x%.2f",
                row["dtype"],
                K,
                t["ours"] * 1e3,
                row["speedup_vs_sdpa"],
            )
    return rows


def bench_decode_attention(device, batch_sizes, lengths, H, D, repeats):
    rows = []
    for B in batch_sizes:
        for L in lengths:
            q = torch.randn(B, H, 1, D, device=device)
            kc = torch.randn(B, H, L, D, device=device)
            vc = torch.randn(B, H, L, D, device=device)
            kn = torch.randn(B, H, 1, D, device=device)
            vn = torch.randn(B, H, 1, D, device=device)
            lens = torch.full((B,), L - 1, dtype=torch.int64, device=device)
            lens[0] = max(0, L // 2)
            scale = 1 / math.sqrt(D)
            n = int(lens.max())
            keep = torch.arange(n, device=device).view(1, 1, 1, n) < lens.view(B, 1, 1, 1)
            keep = torch.cat([keep, torch.ones(B, 1, 1, 1, dtype=torch.bool, device=device)], -1)

            def eager():
                k = torch.cat([kc[:, :, :n], kn], dim=2)
                v = torch.cat([vc[:, :, :n], vn], dim=2)
                s = torch.matmul(q, k.transpose(-2, -1)) * scale
                return torch.matmul(s.masked_fill(~keep, float("-inf")).softmax(-1), v)

            def ours():
                return ops.decode_attention(q, kc, vc, lens, scale, kn, vn)

            assert (ours() - eager()).abs().max() <= 1e-5, "decode_attention mismatch"
            t = time_side_by_side({"ours": ours, "eager": eager}, device, repeats=repeats)
            row = {
                "op": "decode_attention",
                "dtype": "float32",
                "B": B,
                "H": H,
                "L": L,
                "D": D,
                "seconds": t,
                "speedup_vs_eager": t["eager"] / t["ours"],
            }
            rows.append(row)
            logger.info(
                "decode_attn    B=%2d L=%4d  ours %.3f ms  eager x%.2f",
                B,
                L,
                t["ours"] * 1e3,
                row["speedup_vs_eager"],
            )
    return rows


def bench_kv_append(device, B, H, D, steps, repeats):
    """Per-step time of writing one token's K/V: in place vs torch.cat growth."""
    upd = torch.randn(B, H, 1, D, device=device)
    per_step = {"ours": [[] for _ in range(steps)], "torch.cat": [[] for _ in range(steps)]}
    for _ in range(repeats):
        cache = torch.zeros(B, H, steps, D, device=device)
        grown = torch.empty(B, H, 0, D, device=device)
        for s in range(steps):
            pos = torch.full((B,), s, dtype=torch.int64, device=device)
            sync(device)
            t0 = time.perf_counter()
            ops.kv_cache_append_(cache, upd, pos)
            sync(device)
            t1 = time.perf_counter()
            grown = torch.cat([grown, upd], dim=2)
            sync(device)
            t2 = time.perf_counter()
            per_step["ours"][s].append(t1 - t0)
            per_step["torch.cat"][s].append(t2 - t1)
        assert torch.equal(cache, grown), "in-place cache differs from the concatenated one"
    med = {k: [sorted(v)[len(v) // 2] for v in vals] for k, vals in per_step.items()}
    q = max(1, steps // 8)
    summary = {k: {"first_steps_s": sum(v[:q]) / q, "last_steps_s": sum(v[-q:]) / q} for k, v in med.items()}
    for k, s in summary.items():
        logger.info(
            "kv append %-9s first %d steps %.2f us/step, last %d steps %.2f us/step",
            k,
            q,
            s["first_steps_s"] * 1e6,
            q,
            s["last_steps_s"] * 1e6,
        )
    return {
        "op": "kv_cache_append_",
        "B": B,
        "H": H,
        "D": D,
        "steps": steps,
        "per_step_s": med,
        "summary": summary,
    }


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    ax = axes[0][0]
    for dtype in sorted({r["dtype"] for r in results["masked_softmax"]}):
        for mask in ("padding", "causal"):
            rs = [r for r in results["masked_softmax"] if r["dtype"] == dtype and r["mask"] == mask]
            ax.plot(
                [r["K"] for r in rs],
                [r["speedup_vs_eager"] for r in rs],
                "o-",
                label=f"vs eager {dtype} {mask}",
            )
            ax.plot(
                [r["K"] for r in rs],
                [r["speedup_vs_torch_masked_softmax"] for r in rs],
                "s--",
                label=f"vs _masked_softmax {dtype} {mask}",
            )
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(xscale="log", xlabel="K (= Q)", ylabel="speed-up of ours", title="masked_softmax")
    ax.legend(fontsize=7)
    ax = axes[0][1]
    for dtype in sorted({r["dtype"] for r in results["attention"]}):
        rs = [r for r in results["attention"] if r["dtype"] == dtype]
        ax.plot([r["K"] for r in rs], [r["speedup_vs_sdpa"] for r in rs], "o-", label=dtype)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(
        xscale="log",
        xlabel="sequence length",
        ylabel="ours / SDPA speed",
        title="attention: matmul+masked_softmax+matmul vs SDPA",
    )
    ax.legend(fontsize=8)
    ax = axes[1][0]
    for B in sorted({r["B"] for r in results["decode_attention"]}):
        rs = [r for r in results["decode_attention"] if r["B"] == B]
        ax.plot([r["L"] for r in rs], [r["speedup_vs_eager"] for r in rs], "o-", label=f"B={B}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(xscale="log", xlabel="cache length L", ylabel="speed-up vs eager", title="decode_attention")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    kv = results["kv_cache_append_"]
    for k, v in kv["per_step_s"].items():
        ax.plot(range(1, len(v) + 1), [x * 1e6 for x in v], label=k)
    ax.set(
        xlabel="decode step",
        ylabel="µs per step (median)",
        title=f"KV cache growth, B={kv['B']} H={kv['H']} D={kv['D']}",
    )
    ax.legend(fontsize=8)
    fig.suptitle(
        f"transformer_ext ops on {results['device']} ({results['environment'].get('gpu', results['environment']['processor'] or 'cpu')}, {results['environment']['torch_threads']} threads)"
    )
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads on CPU (default: 2)")
    p.add_argument(
        "--repeats", type=int, default=7, help="repeats per case; medians are reported (default: 7)"
    )
    p.add_argument("--quick", action="store_true", help="small sizes and 3 repeats: a smoke test")
    p.add_argument(
        "--out",
        default=None,
        help="JSON path (default: benchmarks/results/bench_ops_<device>.json); the PNG goes beside it",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a visible CUDA GPU")
    if args.device == "cuda" and not ops.cuda_kernels_built():
        p.error("the library was built without its CUDA kernels; rebuild with TRANSFORMER_EXT_CUDA=1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    repeats = 3 if args.quick else args.repeats
    sizes = [32, 64] if args.quick else [32, 64, 128, 256, 512]
    dtypes = [torch.float32, torch.bfloat16]
    B, H = (4, 2) if args.quick else (16, 8)
    if args.device == "cuda":
        sizes = sizes + ([] if args.quick else [1024, 2048, 4096])
    dec_lengths = [16, 64] if args.quick else [16, 64, 128, 256, 512, 1024]
    if args.device == "cuda" and not args.quick:
        dec_lengths += [2048, 4096]
    results = {"device": args.device, "environment": environment()}
    results["masked_softmax"] = bench_masked_softmax(args.device, dtypes, sizes, B, H, repeats)
    results["attention"] = bench_attention(args.device, dtypes, sizes, B, H, 64, repeats)
    results["decode_attention"] = bench_decode_attention(args.device, [1, 16], dec_lengths, 8, 64, repeats)
    results["kv_cache_append_"] = bench_kv_append(args.device, 16, 8, 64, 64 if args.quick else 256, repeats)
    out = args.out or os.path.join(HERE, "results", f"bench_ops_{args.device}.json")
    write_json(out, results)
    plot(results, os.path.splitext(out)[0] + ".png")
    logger.info("wrote %s and %s", out, os.path.splitext(out)[0] + ".png")


if __name__ == "__main__":
    main()
