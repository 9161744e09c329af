"""The label-smoothed cross-entropy of the trainer, computed over blocks of rows on the CPU.

``smoothed_cross_entropy(logits, target, ignore_index=..., label_smoothing=...)`` is
``F.cross_entropy(logits.float(), target, ignore_index=..., label_smoothing=..., reduction="sum")``
with the same value and gradient (up to float32 rounding). On the CPU it works through blocks of
about a megabyte of rows: each block is widened to float32, reduced to its log-sum-exp and loss, and
in the backward pass turned into its gradient, written straight into the dtype of ``logits``. The
full ``[N, V]`` logits are never copied to float32 nor read more than twice per pass, where
``F.cross_entropy`` after ``.float()`` makes a float32 copy, a log-softmax and the gradients of its
two terms (the target's and the smoothing's), each a full pass over memory: at an 8,000-token
vocabulary and 4,096 target tokens that is 128 MiB per pass, a large share of a CPU training step.
Other devices call ``F.cross_entropy`` as above.

Per row with target ``y`` (not ``ignore_index``), ``eps = label_smoothing``, ``V`` classes:
``loss = lse(x) - (1 - eps) x[y] - eps mean(x)``,
``d loss / d x = softmax(x) - (1 - eps) onehot(y) - eps / V``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["smoothed_cross_entropy"]

BLOCK_FLOATS = 1 << 18  # float32 elements per block (1 MiB: stays in a core's L2 cache)


def _block_rows(V: int) -> int:
    return max(1, BLOCK_FLOATS // max(V, 1))


class _SmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, eps: float):
        N, V = logits.shape
        keep = target != ignore_index
        safe = torch.where(keep, target, torch.zeros_like(target))
        lse = torch.empty(N, dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float64, device=logits.device)
        step = _block_rows(V)
        for r0 in range(0, N, step):
            x = logits[r0 : r0 + step].float()
            s = torch.logsumexp(x, dim=-1)
            lse[r0 : r0 + step] = s
            row = s - (1.0 - eps) * x.gather(1, safe[r0 : r0 + step, None]).squeeze(1)
            if eps != 0.0:
                row = row - eps * x.mean(dim=-1)
            total += row.masked_fill(~keep[r0 : r0 + step], 0.0).sum(dtype=torch.float64)
        ctx.save_for_backward(logits, safe, keep, lse)
        ctx.eps = eps
        return total.float()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, safe, keep, lse = ctx.saved_tensors
        eps = ctx.eps
        N, V = logits.shape
        out = torch.empty_like(logits, memory_format=torch.contiguous_format)
        g = grad.float()
        # per row: g * keep (0 for ignored rows)
        w = keep.float() * g
        step = _block_rows(V)
        for r0 in range(0, N, step):
            wr = w[r0 : r0 + step, None]
            p = logits[r0 : r0 + step].to(torch.float32, copy=True).sub_(lse[r0 : r0 + step, None]).exp_()
            if eps != 0.0:
                p.sub_(eps / V)
            p.mul_(wr)
            p.scatter_add_(1, safe[r0 : r0 + step, None], -(1.0 - eps) * wr)
            out[r0 : r0 + step].copy_(p)
        return out, None, None, None


def smoothed_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Summed label-smoothed cross-entropy of ``logits [N, V]`` (any float dtype) against ``target [N]``,
    rows whose target is ``ignore_index`` left out; a float32 scalar (see the module docstring)."""
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(
            f"logits must be [N, V] and target [N], got {tuple(logits.shape)} and {tuple(target.shape)}"
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if logits.device.type != "cpu":
        return F.cross_entropy(
            logits.float(),
            target,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            reduction="sum",
        )
    return _SmoothedCrossEntropy.apply(logits, target, ignore_index, float(label_smoothing))
