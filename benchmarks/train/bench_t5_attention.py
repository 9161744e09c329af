"""T5 training step on the fused attention with a relative position bias, against the same model
with every attention on PyTorch SDPA and the bias as an additive mask.

    python -m benchmarks bench_t5_attention                # CPU, 2 threads -> results/bench_t5_attention_cpu.{json,png}
    python -m benchmarks bench_t5_attention --quick        # a smoke run (tiny model, T = 16, 32)
    python -m benchmarks bench_t5_attention --device cuda  # on a GPU machine

The model is our Transformer with the T5 options (RMS norm, no linear biases, unscaled scores,
64-wide heads, a relative bias table of 32 buckets and max distance 128 shared by the layers,
gated-GELU FFN, untied output), d_model 256, 4 heads, d_ff 1024, 2 + 2 layers, 8,000-token
vocabularies, B * T = 2048 tokens, source lengths uniform in [T/2, T], targets full length, T in
{128, 256}, dropout 0 (``--dropout``: T5's 0.1, attention included). Two engines, one model each
(the same initial weights), timed side by side in one process (interleaved repeats, medians):

* ``fused``: the model as it is: ``ops.attention(..., position_bias=...)`` (the compiled kernels,
  d(bias) from the backward kernel);
* ``sdpa``: every ``ops.attention`` call of the model replaced by
  ``F.scaled_dot_product_attention`` with one additive float mask: the bias plus ``-inf`` for
  padded keys and, in the decoder, for the causal future (the bias table gets its gradient through
  the mask).

One step = forward, cross-entropy, backward, Adam (the fused Adam the trainer runs). Before
timing, both engines' losses and the bias table's gradients are compared on one step (dropout
off). ``attention_only`` rows time one
attention call (forward + backward, d(bias) included) of the encoder's shape on its own. At this
shape attention is a small part of a step (the FFN, the projections and the 8,000-way output
dominate), so the step's speed-up is much smaller than the attention's.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import os
import sys

import torch
import torch.nn.functional as F

from benchmarks.common import environment, machine_info, save_figure, time_side_by_side, write_json

logger = logging.getLogger("bench_t5_attention")
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (results/ lives here)
ENGINES = ("fused", "sdpa")
FULL = dict(d_model=256, n_heads=4, d_kv=64, d_ff=1024, layers=2, vocab=8000, tokens=2048)
QUICK = dict(d_model=32, n_heads=2, d_kv=16, d_ff=64, layers=1, vocab=64, tokens=64)


def sdpa_attention(
    q,
    k,
    v,
    *,
    key_lengths=None,
    query_lengths=None,
    scale=None,
    causal=False,
    dropout_p=0.0,
    seed=None,
    position_bias=None,
):
    """``ops.attention``'s semantics on ``F.scaled_dot_product_attention`` with one additive float
    mask (bias + ``-inf`` for padded keys and the causal future); query_lengths is not used by
    the model's training path."""
    if query_lengths is not None:
        raise ValueError("the SDPA engine does not take query_lengths")
    B, H, Q, _ = q.shape
    K = k.shape[2]
    neg = torch.tensor(float("-inf"), dtype=q.dtype, device=q.device)
    mask = torch.zeros((), dtype=q.dtype, device=q.device)
    if position_bias is not None:
        mask = mask + position_bias.to(q.dtype)
    if key_lengths is not None:
        keep = torch.arange(K, device=q.device).view(1, 1, 1, K) < key_lengths.view(B, 1, 1, 1)
        mask = mask + torch.where(keep, 0.0, neg)
    if causal:
        i = torch.arange(Q, device=q.device).view(Q, 1) + (K - Q)
        mask = mask + torch.where(torch.arange(K, device=q.device).view(1, K) <= i, 0.0, neg)
    if mask.dim() == 0:
        mask = None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)


class _EngineSwitch:
    """Stands in for ``transformer_ext.ops`` inside ``transformer_ext.model``: ``attention`` goes to
    the kernels or to SDPA by ``engine``, every other op to ``transformer_ext.ops`` unchanged."""

    def __init__(self, ops_module):
        self._ops = ops_module
        self.engine = "fused"

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def attention(self, q, k, v, **kw):
        if self.engine == "sdpa":
            return sdpa_attention(q, k, v, **kw)
        return self._ops.attention(q, k, v, **kw)


@contextlib.contextmanager
def engine_switch():
    """``transformer_ext.model`` calls its attention through an :class:`_EngineSwitch` inside the
    context (restored after)."""
    from transformer_ext import model as model_module
    from transformer_ext import ops

    switch = _EngineSwitch(ops)
    model_module.ops = switch
    try:
        yield switch
    finally:
        model_module.ops = ops


def build_model(size: dict, T: int, device: str, dropout: float = 0.0):
    from transformer_ext.config import TransformerConfig
    from transformer_ext.model import Transformer

    config = TransformerConfig(
        src_vocab_size=size["vocab"],
        tgt_vocab_size=size["vocab"],
        d_model=size["d_model"],
        n_heads=size["n_heads"],
        n_encoder_layers=size["layers"],
        n_decoder_layers=size["layers"],
        d_ff=size["d_ff"],
        dropout=dropout,
        max_len=T + 1,
        norm="rms",
        bias=False,
        scale_attention=False,
        d_kv=size["d_kv"],
        relative_attention_buckets=32,
        relative_attention_max_distance=128,
        positions="none",
        activation="gelu_tanh",
        gated_ffn=True,
        scale_embeddings=False,
        norm_first=True,
        tie_target_embeddings=False,
    )
    return Transformer(config).to(device).train()


def batch(size: dict, T: int, device: str):
    B = max(1, size["tokens"] // T)
    g = torch.Generator().manual_seed(T)
    src = torch.randint(3, size["vocab"], (B, T), generator=g)
    src_lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    src_lengths[0] = T
    src = src.masked_fill(torch.arange(T).view(1, T) >= src_lengths.view(-1, 1), 0)
    tgt = torch.randint(3, size["vocab"], (B, T + 1), generator=g)
    tgt[:, 0] = 1  # the config's decoder start id
    return src.to(device), src_lengths.to(device), tgt.to(device)


def bias_tables(model):
    return [
        m.relative_attention_bias.weight for m in model.modules() if hasattr(m, "relative_attention_bias")
    ]


def step_fn(switch, engine, model, data, vocab):
    src, src_lengths, tgt = data
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)  # as the trainer's (training/optim.py)

    def step():
        switch.engine = engine
        logits = model(src, src_lengths, tgt[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), tgt[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    return step


def compare_one_step(switch, models, data, vocab):
    """Loss and bias-table gradients of each engine on one step from the same weights (no update;
    dropout off, so that both compute the same function)."""
    src, src_lengths, tgt = data
    out = {}
    for engine, model in models.items():
        switch.engine = engine
        model.eval()
        model.zero_grad(set_to_none=True)
        logits = model(src, src_lengths, tgt[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), tgt[:, 1:].reshape(-1))
        loss.backward()
        out[engine] = (loss.detach(), [w.grad.detach().clone() for w in bias_tables(model)])
    (l0, g0), (l1, g1) = out["fused"], out["sdpa"]
    grad_err = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in zip(g0, g1))
    loss_err = float((l0 - l1).abs() / l1.abs())
    for model in models.values():
        model.zero_grad(set_to_none=True)
        model.train()
    return {"loss_rel_diff": loss_err, "bias_grad_rel_diff": grad_err}


def attention_only(size: dict, T: int, device: str, repeats: int, min_time: float) -> dict:
    """One encoder-shaped attention call, forward + backward (d(bias) included)."""
    from transformer_ext import ops

    B, H, D = max(1, size["tokens"] // T), size["n_heads"], size["d_kv"]
    g = torch.Generator().manual_seed(T + 1)
    q, k, v = (torch.randn(B, H, T, D, generator=g).to(device).requires_grad_() for _ in range(3))
    bias = torch.randn(H, T, T, generator=g).to(device).transpose(1, 2).unsqueeze(0)
    bias = bias.detach().requires_grad_()  # [1, H, T, T] laid out keys x queries, as the model's
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g).to(device)
    grad = torch.randn(B, H, T, D, generator=g).to(device)
    calls = {
        "fused": lambda: ops.attention(q, k, v, key_lengths=lengths, scale=1.0, position_bias=bias),
        "sdpa": lambda: sdpa_attention(q, k, v, key_lengths=lengths, scale=1.0, position_bias=bias),
    }
    outs = {}
    for name, call in calls.items():
        out = call()
        outs[name] = (out.detach(), *torch.autograd.grad(out, (q, k, v, bias), grad))
    diff = max(float((a - b).abs().max()) for a, b in zip(outs["fused"], outs["sdpa"]))

    def fwd_bwd(call):
        return lambda: torch.autograd.grad(call(), (q, k, v, bias), grad)

    seconds = time_side_by_side({n: fwd_bwd(c) for n, c in calls.items()}, device, repeats, min_time)
    return {
        "T": T,
        "B": B,
        "seconds": seconds,
        "speedup_vs_sdpa": seconds["sdpa"] / seconds["fused"],
        "max_abs_diff_out_and_grads": diff,
    }


def bench(
    device: str, sizes: list[int], size: dict, repeats: int, min_time: float, dropout: float = 0.0
) -> dict:
    """Steps (one call per timing) and attention-only calls (``min_time`` per timing) per T."""
    with engine_switch() as switch:
        return _bench(switch, device, sizes, size, repeats, min_time, dropout)


def _bench(switch, device, sizes, size, repeats, min_time, dropout) -> dict:
    steps, attention = [], []
    for T in sizes:
        torch.manual_seed(0)
        base = build_model(size, T, device, dropout)
        models = {"fused": base, "sdpa": copy.deepcopy(base)}
        data = batch(size, T, device)
        check = compare_one_step(switch, models, data, size["vocab"])
        fns = {e: step_fn(switch, e, m, data, size["vocab"]) for e, m in models.items()}
        seconds = time_side_by_side(fns, device, repeats, 0.0)
        row = {
            "T": T,
            "B": data[0].shape[0],
            "seconds_per_step": seconds,
            "target_tokens_per_second": {e: data[0].shape[0] * T / s for e, s in seconds.items()},
            "speedup_vs_sdpa": seconds["sdpa"] / seconds["fused"],
            **check,
        }
        logger.info(
            "T=%d B=%d  fused %.1f ms  sdpa %.1f ms  speed-up %.2fx  (loss diff %.1e, bias grad diff %.1e)",
            T, row["B"], 1e3 * seconds["fused"], 1e3 * seconds["sdpa"], row["speedup_vs_sdpa"],
            check["loss_rel_diff"], check["bias_grad_rel_diff"],
        )  # fmt: skip
        steps.append(row)
        att = attention_only(size, T, device, repeats, min_time)
        logger.info("  attention only: speed-up %.2fx", att["speedup_vs_sdpa"])
        attention.append(att)
    return {"steps": steps, "attention_only": attention}


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key, title in (
        (axes[0], "steps", "training step (forward, backward, Adam)"),
        (axes[1], "attention_only", "one attention call (forward + backward)"),
    ):
        rows = results[key]
        xs = range(len(rows))
        secs = [r.get("seconds_per_step", r.get("seconds")) for r in rows]
        for off, engine in ((-0.2, "fused"), (0.2, "sdpa")):
            ax.bar([x + off for x in xs], [1e3 * s[engine] for s in secs], width=0.4, label=engine)
        for x, r in zip(xs, rows):
            ax.annotate(
                f"{r['speedup_vs_sdpa']:.2f}x", (x, 1e3 * max(secs[x].values())), ha="center", va="bottom"
            )
        ax.set_xticks(list(xs), [f"T={r['T']} (B={r['B']})" for r in rows])
        ax.set_ylabel("ms (median)")
        ax.set_title(title, fontsize=10)
        ax.legend()
    fig.suptitle(
        f"T5 attention with relative bias: fused kernels vs SDPA + additive mask ({results['device']})"
    )
    fig.tight_layout()
    save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads on CPU (default: 2)")
    p.add_argument(
        "--repeats", type=int, default=7, help="repeats per case; medians are reported (default: 7)"
    )
    p.add_argument(
        "--dropout", type=float, default=0.0, help="dropout of the model, attention included (default: 0)"
    )
    p.add_argument("--sizes", default="128,256", help="comma-separated T values (default: 128,256)")
    p.add_argument(
        "--quick", action="store_true", help="a tiny model, T in {16, 32}, 2 repeats: a smoke test"
    )
    p.add_argument(
        "--out", default=None, help="JSON path (default: benchmarks/results/bench_t5_attention_<device>.json)"
    )
    args = p.parse_args(argv)
    if args.device not in ("cpu", "cuda"):
        p.error(f"--device must be cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a visible CUDA GPU")
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        p.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    if not sizes or min(sizes) < 2:
        p.error("--sizes must list integers >= 2")
    if args.repeats < 1 or args.threads < 1:
        p.error("--repeats and --threads must be >= 1")
    if not 0.0 <= args.dropout < 1.0:
        p.error(f"--dropout must be in [0, 1), got {args.dropout}")
    out = args.out or os.path.join(HERE, "results", f"bench_t5_attention_{args.device}.json")
    if not out.endswith(".json"):
        p.error(f"--out must name a .json file, got {out!r}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    # a training step lasts long enough to be timed one call at a time (min_time 0 there); the
    # attention-only calls are repeated for at least 50 ms per timing
    size, repeats, min_time = (QUICK, 2, 0.0) if args.quick else (FULL, args.repeats, 0.05)
    if args.quick:
        sizes = [16, 32]
    load_before = os.getloadavg()  # other processes on the machine skew every ratio: recorded
    results = {
        "device": args.device,
        "model": {**size, "dropout": args.dropout},
        "environment": environment(),
        "machine": machine_info(threads=(args.threads,)) if not args.quick else {},
        "command": " ".join(
            [
                os.path.basename(sys.executable),
                "-m",
                "benchmarks",
                "bench_t5_attention",
                *(argv or sys.argv[1:]),
            ]
        ),
        **bench(args.device, sizes, size, repeats, min_time, args.dropout),
    }
    results["load_average_1_5_15min"] = {"before": load_before, "after": os.getloadavg()}
    write_json(out, results)
    plot(results, os.path.splitext(out)[0] + ".png")
    logger.info("wrote %s and %s", out, os.path.splitext(out)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
