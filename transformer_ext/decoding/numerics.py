"""The numerics of one search step: log-softmax, log-sum-exp (float32 exponentials summed in
float64), the row top-k by group maxima, work buffers, and the checked step of a runner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from .protocol import (
    Runner,
)

if TYPE_CHECKING:  # annotations only
    from .processors import _Processors


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Stable log-softmax over the last axis in float64 (``x - max - log(sum(exp(x - max)))``)."""
    x = np.asarray(logits, dtype=np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    shifted = x - m
    with np.errstate(divide="ignore", invalid="ignore"):
        out = shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))
    return np.where(np.isneginf(x), -np.inf, out)  # a row of only -inf stays -inf, not NaN


class _Scratch:
    """Float32 work buffers of one search, reused at every step instead of a new ``[rows, V]``
    temporary per step; ``get(name, shape)`` is a C-contiguous view of the first rows of one
    (so that a search whose rows shrink keeps its buffers)."""

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, int]) -> np.ndarray:
        N, V = shape
        buf = self._buffers.get(name)
        if buf is None or buf.shape[1] != V or buf.shape[0] < N:
            buf = self._buffers[name] = np.empty((N, V), dtype=np.float32)
        return buf[:N]

    def copy(self, name: str, x: np.ndarray) -> np.ndarray:
        """``x`` copied into the buffer ``name``."""
        out = self.get(name, x.shape)
        np.copyto(out, x)
        return out


def _log_sum_exp(x: np.ndarray, row_max: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    """``log(sum(exp(x)))`` per row of float32 ``x [N, V]``, with the exponentials in float32 and
    their sum in float64; -inf for a row of only -inf. ``out``: a float32 buffer of ``x``'s shape
    for the exponentials (default: a new one)."""
    shift = np.where(np.isfinite(row_max), row_max, np.float32(0.0)).astype(np.float32)
    scaled = np.subtract(x, shift[:, None], out=out)
    np.exp(scaled, out=scaled)
    sums = scaled.sum(axis=1, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return shift.astype(np.float64) + np.log(sums)


# Top-k over the vocabulary by groups: the k largest entries of a row lie in the k groups with
# the largest maxima, so one pass computes group maxima and only the members of k groups are
# partitioned. Group g of a row holds the columns g, g + G, g + 2G, ... (G groups of
# _TOPK_GROUP members): the maxima are an elementwise maximum of _TOPK_GROUP contiguous slices
# of G columns, far cheaper in numpy than a reduction over many short contiguous blocks.
_TOPK_GROUP = 16


def _row_top_k(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(indices, row_max)`` for ``x [N, V]``: ``indices [N, min(k, V)]`` of each row's largest
    entries (in no particular order; ties broken arbitrarily) and each row's maximum (NaN when
    the row holds a NaN)."""
    N, V = x.shape
    k = min(k, V)
    n_groups = V // _TOPK_GROUP
    full = n_groups * _TOPK_GROUP
    if k == V:
        return np.broadcast_to(np.arange(V), (N, V)), x.max(axis=1)
    if n_groups < 4 * k:  # a small vocabulary or a wide beam: partition the whole rows
        return np.argpartition(x, V - k, axis=1)[:, V - k :], x.max(axis=1)
    group_max = x[:, :full].reshape(N, _TOPK_GROUP, n_groups).max(axis=1)  # NaN propagates
    top_groups = np.argpartition(group_max, n_groups - k, axis=1)[:, n_groups - k :]
    members = np.arange(_TOPK_GROUP) * n_groups
    cols = (top_groups[:, :, None] + members).reshape(N, k * _TOPK_GROUP)
    if full < V:  # the entries after the last whole row of groups are always candidates
        cols = np.concatenate([cols, np.broadcast_to(np.arange(full, V), (N, V - full))], axis=1)
    values = np.take_along_axis(x, cols, axis=1)
    pick = np.argpartition(values, values.shape[1] - k, axis=1)[:, values.shape[1] - k :]
    return np.take_along_axis(cols, pick, axis=1), values.max(axis=1)


def _check_finite_logits(row_max: np.ndarray, step: int, rows: Optional[np.ndarray] = None) -> None:
    """A RuntimeError naming the step and the first row whose ``row_max`` is NaN or +inf;
    ``rows``: the search's row of each entry (when finished rows were dropped from the state)."""
    bad = np.flatnonzero(~(row_max < np.inf))  # NaN or +inf somewhere in the row
    if bad.size:
        first = int(bad[0]) if rows is None else int(rows[bad[0]])
        raise RuntimeError(
            f"runner.step returned a NaN or +inf logit at step {step} (row {first}"
            f"{f' and {bad.size - 1} more rows' if bad.size > 1 else ''}); logits must be finite or -inf"
        )


def _step_logits(runner: Runner, state: Any, tokens: np.ndarray, t: int, procs: _Processors) -> np.ndarray:
    """One ``runner.step`` -> float32 logits ``[N, V]`` (checked; the vocabulary checked at step 0)."""
    return _checked_logits(np.asarray(runner.step(state, tokens)), tokens.shape[0], t, procs)


def _checked_logits(logits: np.ndarray, N: int, t: int, procs: _Processors) -> np.ndarray:
    if logits.ndim != 2 or logits.shape[0] != N:
        raise RuntimeError(f"runner.step returned logits of shape {logits.shape}, expected ({N}, V)")
    if t == 0:
        procs.check_vocab(logits.shape[1])
    return logits if logits.dtype == np.float32 else logits.astype(np.float32)


def _step_attention(
    runner: Runner, state: Any, tokens: np.ndarray, t: int, procs: _Processors, want: bool
) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """``(logits, attention)``: one step; with ``want`` through ``runner.step_with_attention``
    (attention float32 ``[N, S]``), else ``runner.step`` (attention None)."""
    if not want:
        return _step_logits(runner, state, tokens, t, procs), None
    logits, attention = runner.step_with_attention(state, tokens)
    N = tokens.shape[0]
    attention = np.asarray(attention, dtype=np.float32)
    if attention.ndim != 2 or attention.shape[0] != N:
        raise RuntimeError(
            f"runner.step_with_attention returned attention of shape {attention.shape}, expected ({N}, S)"
        )
    return _checked_logits(np.asarray(logits), N, t, procs), attention
