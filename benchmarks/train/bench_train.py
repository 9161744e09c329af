"""Training-step throughput of our Transformer (attention through ops.attention) against a
plain-PyTorch ``nn.Transformer`` of the same dimensions (SDPA inside).

    python -m benchmarks.train.bench_train                 # CPU, 2 threads -> results/bench_train_cpu.json
    python -m benchmarks.train.bench_train --quick         # a smoke run

One step = forward, label-smoothed (0.1) cross-entropy (ours: the trainer's ``token_loss``;
``nn_transformer``: ``F.cross_entropy`` on the float32 logits), backward, Adam. ``ours_bf16`` is our model
trained as ``--amp bf16`` trains it (``torch.autocast("cpu", torch.bfloat16)``, float32 weights,
Adam state and loss); it runs only where the CPU has native bfloat16 matrix products
(``transformer_ext.cpu_features``; the JSON records the flags either way). d_model 256, 8 heads,
3 + 3 layers, d_ff 1024, 8,000-token vocabularies, B * T ~ 4096 target tokens, source lengths
uniform in [T/2, T] (targets full length), T in {32, 128, 256}, dropout 0 and 0.1. Every
measurement runs in its own process (no shared allocator or thread-pool state), the engines
alternate within each round, and the median over rounds is reported as target tokens per second.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.common import environment, machine_info, write_json

logger = logging.getLogger("bench_train")
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (results/ lives here)
ENGINES = ("ours", "nn_transformer", "ours_bf16")
# Profiler event names (lower-cased substrings) that make up attention, forward and backward, in
# each engine; "three_step" is our model with the fused op switched off (today's path before
# ops.attention): its 4-D batched matmuls (aten::bmm) are the attention products, the projections
# are 2-D (addmm/mm). A custom op with register_autograd runs its CPU kernel inside an event named
# "GeneratedBackwardFor_transformer_ext_<op>_default" (the forward; "...Backward" is the backward
# node), so the op's own name alone would leave its forward time out.
ATTENTION_OPS = {
    "ours": ("transformer_ext::attention", "generatedbackwardfor_transformer_ext_attention"),
    "ours_bf16": ("transformer_ext::attention", "generatedbackwardfor_transformer_ext_attention"),
    "three_step": (
        "transformer_ext::masked_softmax",
        "generatedbackwardfor_transformer_ext_masked_softmax",
        "aten::bmm",
    ),
    "nn_transformer": ("scaled_dot_product", "scaleddotproduct", "flash_attention"),
}
D_MODEL, HEADS, LAYERS, D_FF, VOCAB = 256, 8, 3, 1024, 8000


class PlainTransformer(nn.Module):
    """nn.Transformer with embeddings, sinusoidal positions and a tied output projection."""

    def __init__(self, dropout: float, max_len: int):
        super().__init__()
        self.src_embed = nn.Embedding(VOCAB, D_MODEL)
        self.tgt_embed = nn.Embedding(VOCAB, D_MODEL)
        pos = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, D_MODEL, 2) * (-math.log(10000.0) / D_MODEL))
        pe = torch.zeros(max_len, D_MODEL)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe, persistent=False)
        self.dropout = nn.Dropout(dropout)
        self.core = nn.Transformer(D_MODEL, HEADS, LAYERS, LAYERS, D_FF, dropout, batch_first=True)
        self.proj = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.proj.weight = self.tgt_embed.weight

    def forward(self, src, src_lengths, tgt_in):
        S, T = src.shape[1], tgt_in.shape[1]
        pad = torch.arange(S).view(1, S) >= src_lengths.view(-1, 1)
        x = self.dropout(self.src_embed(src) * math.sqrt(D_MODEL) + self.pe[:S])
        y = self.dropout(self.tgt_embed(tgt_in) * math.sqrt(D_MODEL) + self.pe[:T])
        causal = nn.Transformer.generate_square_subsequent_mask(T, dtype=x.dtype)
        h = self.core(
            x, y, tgt_mask=causal, src_key_padding_mask=pad, memory_key_padding_mask=pad, tgt_is_causal=True
        )
        return self.proj(h)


def build(engine: str, dropout: float, max_len: int) -> nn.Module:
    if engine == "ours_bf16":  # the same model; the step runs under autocast
        return build("ours", dropout, max_len)
    if engine == "three_step":
        from transformer_ext.model import MultiHeadAttention

        model = build("ours", dropout, max_len)
        for m in model.modules():
            if isinstance(m, MultiHeadAttention):
                m.fused_attention = False
        return model
    if engine == "ours":
        from transformer_ext.config import TransformerConfig
        from transformer_ext.model import Transformer

        config = TransformerConfig(
            src_vocab_size=VOCAB,
            tgt_vocab_size=VOCAB,
            d_model=D_MODEL,
            n_heads=HEADS,
            n_encoder_layers=LAYERS,
            n_decoder_layers=LAYERS,
            d_ff=D_FF,
            dropout=dropout,
            max_len=max_len,
        )
        return Transformer(config)
    if engine == "nn_transformer":
        return PlainTransformer(dropout, max_len)
    raise ValueError(f"unknown engine {engine!r}; expected one of {ENGINES}")


def worker(engine: str, T: int, dropout: float, steps: int, threads: int, profile: bool = False) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    B = max(1, 4096 // T)
    model = build(engine, dropout, T + 1).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(T)
    src = torch.randint(3, VOCAB, (B, T), generator=g)
    src_lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    src_lengths[0] = T
    src = src.masked_fill(torch.arange(T).view(1, T) >= src_lengths.view(-1, 1), 0)
    tgt = torch.randint(3, VOCAB, (B, T + 1), generator=g)
    tgt[:, 0] = 1

    amp = engine.endswith("_bf16")
    from transformer_ext.training.optim import token_loss

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            logits = model(src, src_lengths, tgt[:, :-1])
        if engine == "nn_transformer":  # plain PyTorch
            loss = F.cross_entropy(
                logits.float().reshape(-1, VOCAB), tgt[:, 1:].reshape(-1), label_smoothing=0.1
            )
        else:  # float32, as the trainer computes it (no target is the pad id 0)
            loss = token_loss(logits, tgt[:, 1:], 0, 0.1)[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(1):  # warm-up (first-step allocations)
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    result = {
        "engine": engine,
        "T": T,
        "B": B,
        "dropout": dropout,
        "step_s": med,
        "tokens_per_s": B * T / med,
    }
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        names = ATTENTION_OPS[engine]
        attn = sum(e.self_cpu_time_total for e in events if any(n in e.key.lower() for n in names))
        result["attention_share"] = attn / total if total else float("nan")
    return result


def run_worker(engine, T, dropout, steps, threads, profile=False):
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.train.bench_train",
        "--worker",
        engine,
        "--T",
        str(T),
        "--dropout",
        str(dropout),
        "--steps",
        str(steps),
        "--threads",
        str(threads),
    ] + (["--profile"] if profile else [])
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"worker {engine} T={T} p={dropout} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _attention_share(sizes, engines, threads, out) -> None:
    """Attention's share of one profiled step (dropout 0) per engine, added to the JSON at ``out``."""
    shares = {}
    for T in sizes:
        for engine in ["ours", "three_step", "nn_transformer"] + [e for e in engines if e == "ours_bf16"]:
            res = run_worker(engine, T, 0.0, 1, threads, profile=True)
            shares.setdefault(str(T), {})[engine] = res["attention_share"]
            logger.info(
                "T=%3d %-15s attention share of a step %.1f%%", T, engine, 100 * res["attention_share"]
            )
    results = {}
    if os.path.exists(out):
        with open(out, encoding="utf-8") as f:
            results = json.load(f)
    results["attention_share_dropout0"] = shares
    write_json(out, results)
    logger.info("updated %s", out)


def _cases(samples: dict) -> list[dict]:
    """Per (T, dropout): the median tokens/s of each engine and the ratios, logged."""
    cases = []
    for (T, dropout), per in samples.items():
        med = {e: statistics.median(v) for e, v in per.items()}
        case = {"T": T, "dropout": dropout, "tokens_per_s": med, "samples": per}
        if "nn_transformer" in med:
            case["speedup_vs_nn_transformer"] = med["ours"] / med["nn_transformer"]
            logger.info(
                "T=%3d p=%.1f ours %8.0f tokens/s, nn.Transformer %8.0f tokens/s: %.2fx",
                T,
                dropout,
                med["ours"],
                med["nn_transformer"],
                case["speedup_vs_nn_transformer"],
            )
        if "ours_bf16" in med:
            case["speedup_bf16_vs_float32"] = med["ours_bf16"] / med["ours"]
            logger.info(
                "T=%3d p=%.1f ours --amp bf16 %8.0f tokens/s: %.2fx float32",
                T,
                dropout,
                med["ours_bf16"],
                case["speedup_bf16_vs_float32"],
            )
        cases.append(case)
    return cases


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default: 2)")
    p.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds; medians are reported (default: 3)"
    )
    p.add_argument("--steps", type=int, default=5, help="timed steps per process (default: 5)")
    p.add_argument("--sizes", default="32,128,256", help="comma-separated target lengths T")
    p.add_argument("--quick", action="store_true", help="T = 32, 1 round, 2 steps: a smoke test")
    p.add_argument(
        "--engines",
        default=",".join(ENGINES),
        help="comma-separated engines (default: %(default)s; ours_bf16 is left out where bfloat16 is not "
        "native)",
    )
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/bench_train_cpu.json)")
    p.add_argument(
        "--attention-share",
        action="store_true",
        help="instead: attention's share of one profiled step (dropout 0) for ours, the three-step "
        "path and nn.Transformer, added to the existing --out JSON",
    )
    p.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--T", type=int, default=32, help=argparse.SUPPRESS)
    p.add_argument("--dropout", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.T, args.dropout, args.steps, args.threads, args.profile)))
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        p.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    if not sizes or min(sizes) < 2 or args.rounds < 1 or args.steps < 1 or args.threads < 1:
        p.error("--sizes must be integers >= 2 and --rounds, --steps, --threads >= 1")
    rounds, steps = (1, 2) if args.quick else (args.rounds, args.steps)
    if args.quick:
        sizes = [32]
    engines = [e for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown or "ours" not in engines:
        p.error(f"--engines must include ours and name only {', '.join(ENGINES)}, got {args.engines!r}")
    from transformer_ext.cpu_features import bf16_support

    support = bf16_support()
    if "ours_bf16" in engines and not support.native:
        logger.warning("ours_bf16 left out: %s", support.reason)
        engines.remove("ours_bf16")
    out = args.out or os.path.join(HERE, "results", "bench_train_cpu.json")
    if args.attention_share:
        _attention_share(sizes, engines, args.threads, out)
        return
    samples: dict = {}
    load_before = os.getloadavg()  # other processes on the machine skew every ratio: recorded
    for r in range(rounds):
        for T in sizes:
            for dropout in (0.0, 0.1):
                order = engines if r % 2 == 0 else engines[::-1]
                for engine in order:
                    res = run_worker(engine, T, dropout, steps, args.threads)
                    samples.setdefault((T, dropout), {}).setdefault(engine, []).append(res["tokens_per_s"])
                    logger.info(
                        "round %d T=%3d p=%.1f %-15s %8.0f tokens/s",
                        r,
                        T,
                        dropout,
                        engine,
                        res["tokens_per_s"],
                    )
    cases = _cases(samples)
    from benchmarks.ops.bench_attention import cpu_description

    torch.set_num_threads(args.threads)
    results = {
        "environment": {**environment(), **cpu_description()},
        # ISA flags, caches and the measured memory bandwidth, taken after the timed rounds
        "machine": machine_info((args.threads,)),
        "rounds": rounds,
        "steps": steps,
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "engines": engines,
        "cases": cases,
        "load_average_1_5_15min": {"before": load_before, "after": os.getloadavg()},
    }
    write_json(out, results)
    logger.info("wrote %s", out)


if __name__ == "__main__":
    main()
