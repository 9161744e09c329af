"""Schedules, the optimiser, the label-smoothed loss and gradient accumulation.

* **Objective**: teacher forcing (the decoder reads ``[bos] + y`` and predicts ``y + [eos]``),
  cross-entropy with label smoothing, padding ignored, summed and divided by the number of
  non-pad target tokens of the step (:func:`token_loss`, :func:`accumulate_gradients`).
* **Optimiser**: Adam (betas 0.9/0.98, eps 1e-9) with the warmup schedule
  ``lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)`` (steps counted from 1,
  :func:`noam_lr`) or fairseq's inverse square root (:func:`inverse_sqrt_lr`), gradient-norm
  clipping (:func:`optimizer_step`).
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional, Sequence

import torch

from . import distributed
from .errors import TrainingError
from .loss import smoothed_cross_entropy

__all__ = [
    "noam_lr",
    "inverse_sqrt_lr",
    "make_optimizer",
    "make_scheduler",
    "token_loss",
    "accumulate_gradients",
    "optimizer_step",
]


def noam_lr(step: int, d_model: int, warmup: int, factor: float = 1.0) -> float:
    """``factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)``; steps start at 1."""
    if step < 1:
        raise ValueError(f"the schedule counts steps from 1, got step={step}")
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1, got {warmup}")
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def make_optimizer(model: torch.nn.Module, opts) -> torch.optim.Adam:
    """Adam with base lr 1.0 (the scheduler's factor is the learning rate itself), fused kernel."""
    return torch.optim.Adam(
        model.parameters(), lr=1.0, betas=tuple(opts.adam_betas), eps=opts.adam_eps, fused=True
    )


def inverse_sqrt_lr(step: int, warmup: int, peak: float) -> float:
    """fairseq's inverse_sqrt: ``peak * step / warmup`` up to ``warmup``, then
    ``peak * sqrt(warmup / step)``."""
    if step < 1:
        raise ValueError(f"the schedule counts steps from 1, got step={step}")
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1, got {warmup}")
    return peak * min(step / warmup, math.sqrt(warmup / step))


def make_scheduler(
    optimizer,
    d_model: int,
    warmup: int,
    factor: float,
    schedule: str = "noam",
    peak_lr: Optional[float] = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR of :func:`noam_lr` (or :func:`inverse_sqrt_lr` with ``peak_lr``); its internal counter
    starts at 0, the schedule's step at 1."""
    if schedule == "inverse-sqrt":
        if peak_lr is None:
            raise TrainingError("--lr-schedule inverse-sqrt needs --lr (the peak learning rate)")
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda=lambda s: inverse_sqrt_lr(s + 1, warmup, peak_lr)
        )
    if schedule != "noam":
        raise TrainingError(f"--lr-schedule must be noam or inverse-sqrt, got {schedule!r}")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda=lambda s: noam_lr(s + 1, d_model, warmup, factor)
    )


def accumulate_gradients(
    model, micro: Sequence, *, pad_id: int, label_smoothing: float, ctx=None, scaler=None, autocast_dtype=None
) -> tuple[float, int]:
    """Back-propagate the loss of one optimiser step made of the batches ``micro``.

    The loss is summed over every target token of all the batches and divided by their number,
    so N batches give the gradient of one N-times larger batch (``--update-freq``). Under
    torchrun (``ctx``) the count is that of all ranks, and DDP synchronises the gradients only
    at the last batch. Returns (loss per target token, target tokens), over all ranks.
    """
    ctx = ctx or distributed.Context(torch.device("cpu"))
    local_tokens = sum(b.n_target_tokens(pad_id) for b in micro)
    loss_value, n_tokens = 0.0, 0
    for k, batch in enumerate(micro):
        sync = k == len(micro) - 1 or not hasattr(model, "no_sync")
        with contextlib.nullcontext() if sync else model.no_sync():
            with (
                torch.autocast(batch.src_ids.device.type, dtype=autocast_dtype)
                if autocast_dtype is not None
                else contextlib.nullcontext()
            ):
                logits = model(batch.src_ids, batch.src_lengths, batch.tgt_in)
            loss, n = token_loss(logits, batch.tgt_out, pad_id, label_smoothing)
            # under torchrun: loss summed over this rank / target tokens of all ranks (x world_size, as DDP
            # averages); the value and the count returned are then the global batch's
            loss, value, n_tokens = ctx.reduce_loss(loss * (n / max(local_tokens, 1)), local_tokens)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_value += value
    return loss_value, n_tokens


def token_loss(logits: torch.Tensor, tgt_out: torch.Tensor, pad_id: int, label_smoothing: float):
    """(loss per non-pad target token, number of non-pad target tokens), in float32 whatever the dtype
    of ``logits`` (:func:`.loss.smoothed_cross_entropy`: blocks of rows on the CPU)."""
    V = logits.shape[-1]
    total = smoothed_cross_entropy(
        logits.reshape(-1, V), tgt_out.reshape(-1), ignore_index=pad_id, label_smoothing=label_smoothing
    )
    n_tokens = int((tgt_out != pad_id).sum())
    return total / max(n_tokens, 1), n_tokens


def optimizer_step(model, optimizer, scheduler, *, clip_norm: float, scaler=None) -> None:
    """One update from the accumulated gradients: unscale (fp16), clip to ``clip_norm`` (0: no
    clipping), step the optimiser and the schedule."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    if clip_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    scheduler.step()
