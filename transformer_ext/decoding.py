"""Greedy and beam search, written once against a small runner protocol.

This module imports only numpy: the ONNX Runtime runner must work without torch. A backend
(eager PyTorch, ONNX Runtime, TensorRT, a test double) implements :class:`Runner`; the search
never knows which one it drives.

Conventions:

* Every returned token list excludes BOS and EOS.
* ``max_new_tokens`` counts generated tokens, EOS included (a row that emits EOS as its
  ``max_new_tokens``-th token has ``max_new_tokens - 1`` tokens). It may be an int or one value
  per source (e.g. from :func:`max_new_tokens_for`).
* ``min_new_tokens``: EOS is suppressed while fewer tokens than that have been generated: its
  logit is set to -inf before the softmax, so the other tokens' probabilities are renormalised
  over the vocabulary without EOS (as CTranslate2's ``min_decoding_length`` does). Beam scores
  and ``Hypothesis.log_prob`` are sums of these renormalised log-probabilities; greedy picks the
  same token either way.
* Length penalties (:func:`length_penalty_factor`) divide a hypothesis' log-probability by a
  function of its length, which counts the generated tokens with the EOS (when it has one).
* The runner's self-attention cache must hold every fed token: the decoder feeds BOS and then
  all generated tokens but the last, so ``cache_len`` defaults to ``max(max_new_tokens)``.

The checks every runner makes on its arguments live here, once, so that every backend refuses
the same input with the same message (naming the argument, and for ids the row and value):
:func:`check_encode_args` (sources via :func:`check_sources`, ``cache_len``, ``num_beams``) at
encode, :func:`check_step_tokens` at a step, :func:`check_beam_index` at a reorder. A runner
checks limits of its own (an export's, an engine profile's) after them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence, Union, runtime_checkable

import numpy as np

logger = logging.getLogger(__name__)

__all__ = [
    "Runner",
    "SearchMethods",
    "Hypothesis",
    "greedy_decode",
    "greedy_advance",
    "beam_search",
    "max_new_tokens_for",
    "length_penalty_factor",
    "log_softmax",
    "check_sources",
    "check_encode_args",
    "check_token_ids",
    "check_step_tokens",
    "check_beam_index",
    "as_int64",
    "LENGTH_PENALTIES",
]

IntOrArray = Union[int, Sequence[int], np.ndarray]

LENGTH_PENALTIES = ("gnmt", "seed", "average", "none")


@runtime_checkable
class Runner(Protocol):
    """What a backend implements to be driven by :func:`greedy_decode` / :func:`beam_search`."""

    def encode(
        self, input_ids: np.ndarray, src_lengths: np.ndarray, cache_len: int, num_beams: int = 1
    ) -> Any:
        """Encode ``input_ids`` int64 ``[B, S]`` (right-padded) with ``src_lengths`` int64 ``[B]``.

        Returns an opaque state holding N = B * num_beams rows: every source row repeated
        ``num_beams`` times (source b's beams are rows ``b*num_beams .. b*num_beams+num_beams-1``),
        its cross-attention K/V (never reordered afterwards), zero-filled self-attention caches
        of capacity ``cache_len`` and the current position 0.
        """
        ...

    def step(self, state: Any, tokens: np.ndarray) -> np.ndarray:
        """Feed one token per row (int64 ``[N]``) at the current position; append its K/V to the
        cache in place, advance the position by one, return float32 logits ``[N, V]``."""
        ...

    def reorder(self, state: Any, beam_index: np.ndarray) -> None:
        """Row ``r`` of the self-attention caches becomes old row ``beam_index[r]`` (int64 ``[N]``),
        over the valid prefix; cross K/V are untouched."""
        ...


def _format_index(index: tuple) -> str:
    return ", ".join(str(int(i)) for i in index)


def check_token_ids(name: str, ids: Any, vocab_size: int | None, *, side: str = "target") -> np.ndarray:
    """``ids`` (any shape) as int64, every value in ``[0, vocab_size)``; the checks every runner
    makes on the token ids it feeds (source ids at encode, one token per row at a step).

    Raises TypeError for non-integer ids and ValueError naming the first offending entry
    (``tokens[2] = -1``) and the vocabulary range otherwise. ``vocab_size=None`` checks the dtype only.
    """
    arr = as_int64(name, ids)
    if vocab_size is None or arr.size == 0:
        return arr
    bad = (arr < 0) | (arr >= int(vocab_size))
    if bad.any():
        where = np.argwhere(bad)
        first = tuple(where[0])
        more = f" ({len(where) - 1} more ids out of range)" if len(where) > 1 else ""
        row = f" (row {int(first[0])})" if arr.ndim >= 1 else ""
        raise ValueError(
            f"{name}[{_format_index(first)}] = {int(arr[first])}{row} is not a {side} token id: the {side} "
            f"vocabulary has ids 0 .. {int(vocab_size) - 1}{more}"
        )
    return arr


def check_step_tokens(
    position: int,
    cache_len: int,
    max_positions: int | None,
    tokens: Any,
    num_rows: int,
    vocab_size: int | None = None,
) -> np.ndarray:
    """The checks every runner makes before feeding one token per row at ``position``: room in
    the cache and the positional encodings, shape ``(num_rows,)``, integer ids in
    ``[0, vocab_size)`` (the target vocabulary; ``None`` skips the range check). Returns int64."""
    if position >= cache_len or (max_positions is not None and position >= max_positions):
        raise IndexError(
            f"cannot feed a token at position {position}: the self-attention cache holds {cache_len} "
            f"positions and the model has {max_positions} positional encodings; encode with a larger "
            "cache_len or generate fewer tokens"
        )
    tok = np.asarray(tokens)
    if tok.shape != (num_rows,):
        raise ValueError(f"tokens must have shape ({num_rows},), got {tok.shape}")
    if not np.issubdtype(tok.dtype, np.integer):
        raise TypeError(f"tokens must hold integers, got dtype {tok.dtype}")
    return check_token_ids("tokens", tok, vocab_size, side="target")


def as_int64(name: str, array: Any) -> np.ndarray:
    """``array`` as a contiguous int64 numpy array; a TypeError naming ``name`` if it holds no integers."""
    arr = np.asarray(array)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def check_beam_index(beam_index: Any, num_rows: int) -> np.ndarray:
    """The checks every runner makes on the ``beam_index`` of a reorder; returns it as int64.

    An out-of-range value is an IndexError naming its row and value in the caller's
    ``beam_index`` (``beam_index[3] = 7``), never an index into a runner's internal buffers.
    """
    index = as_int64("beam_index", beam_index)
    if index.shape != (num_rows,):
        raise ValueError(f"beam_index must have shape ({num_rows},), got {index.shape}")
    bad = np.flatnonzero((index < 0) | (index >= num_rows))
    if bad.size:
        r = int(bad[0])
        more = f" ({bad.size - 1} more out of range)" if bad.size > 1 else ""
        raise IndexError(
            f"beam_index[{r}] = {int(index[r])} is not a row of the decoding state: rows are 0 .. {num_rows - 1}{more}"
        )
    return index


@dataclass(frozen=True)
class Hypothesis:
    """One beam search result.

    ``tokens``: generated ids without BOS/EOS. ``log_prob``: sum of the log-probabilities of
    every generated token, the EOS included when the hypothesis finished with one (at steps
    before ``min_new_tokens``, of the distribution renormalised without EOS).
    ``score``: ``log_prob / length_penalty_factor(...)``, what the n-best list is sorted by.
    ``finished``: False for a hypothesis cut off at ``max_new_tokens`` without EOS.
    Greedy decoding computes no probabilities: the translator's greedy hypotheses have
    ``score`` and ``log_prob`` ``None``.
    """

    tokens: list[int]
    score: Optional[float]
    log_prob: Optional[float]
    finished: bool = True


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Stable log-softmax over the last axis in float64 (``x - max - log(sum(exp(x - max)))``)."""
    x = np.asarray(logits, dtype=np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    shifted = x - m
    with np.errstate(divide="ignore", invalid="ignore"):
        out = shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))
    return np.where(np.isneginf(x), -np.inf, out)  # a row of only -inf stays -inf, not NaN


def length_penalty_factor(length: int, kind: str = "gnmt", alpha: float = 0.6) -> float:
    """The divisor of a hypothesis' log-probability.

    ``length`` counts generated tokens, EOS included (a finished hypothesis of n tokens has
    length n + 1, an unfinished one cut at the budget has length n), so it is >= 1.
    ``"gnmt"``: ``((5 + length) / 6) ** alpha`` (Wu et al. 2016).
    ``"seed"``: ``((5 + length + 1) / 5) ** alpha``: the seed tutorial's formula, whose length
    is that of the sequence with BOS.
    ``"average"``: ``length ** alpha``: the average log-probability per token for ``alpha = 1``.
    fairseq's ``--lenpen`` is this definition (its length counts the final EOS); CTranslate2's
    ``length_penalty`` is too when it runs with ``return_end_token=True`` (by default it
    leaves the EOS out of the length, so finished hypotheses there are divided by n ** alpha).
    ``"none"``: 1.
    """
    if kind == "gnmt":
        return ((5.0 + length) / 6.0) ** alpha
    if kind == "seed":
        return ((5.0 + length + 1) / 5.0) ** alpha
    if kind == "average":
        return float(length) ** alpha
    if kind == "none":
        return 1.0
    raise ValueError(f"length_penalty must be one of {LENGTH_PENALTIES}, got {kind!r}")


def _check_budget_coefficient(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    return value


def max_new_tokens_for(src_lengths: IntOrArray, a: float, b: float, *, cap: int | None = None) -> np.ndarray:
    """Per-source generation budget ``floor(a * src_len + b)``, at least 1, at most ``cap``.

    ``a`` and ``b`` must be finite and >= 0 (a ValueError naming them otherwise: an infinite or
    NaN budget has no integer value). Without ``cap`` a budget must fit in int64.
    """
    a = _check_budget_coefficient("a (tokens per source token)", a)
    b = _check_budget_coefficient("b (extra tokens)", b)
    lengths = np.asarray(src_lengths, dtype=np.float64)
    budget = np.floor(a * lengths + b)  # float64: finite for finite a, b and lengths
    if cap is not None:
        budget = np.minimum(budget, float(int(cap)))
    elif budget.size and budget.max() >= 2.0**62:
        raise ValueError(f"generation budget {budget.max():.3g} = a * src_len + b is too large; give a cap")
    return np.maximum(budget.astype(np.int64), 1)


def check_sources(
    input_ids: Any, src_lengths: Any, *, src_vocab_size: int | None = None, max_src_len: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The checks every runner and both searches make on a batch of sources; returns
    ``(input_ids, src_lengths)`` as contiguous int64 arrays.

    ``input_ids``: a non-empty ``[batch, src_len]`` integer array (right-padded);
    ``src_lengths``: ``[batch]`` integers in ``[1, src_len]``; ``src_len`` at most
    ``max_src_len`` (the model's ``max_len``: sources longer have no positional encoding);
    every id in ``[0, src_vocab_size)`` (:func:`check_token_ids`, naming row and value).
    ``None`` skips the length / vocabulary check. TypeError for non-integer arrays, ValueError
    otherwise, each naming the argument and what was expected.
    """
    ids = np.asarray(input_ids)
    lengths = np.asarray(src_lengths)
    if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
        raise ValueError(f"input_ids must be a non-empty [batch, src_len] array, got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"input_ids must hold integer token ids, got dtype {ids.dtype}")
    B, S = ids.shape
    if lengths.shape != (B,):
        raise ValueError(f"src_lengths must have shape ({B},), got {lengths.shape}")
    if not np.issubdtype(lengths.dtype, np.integer):
        raise TypeError(f"src_lengths must be integers, got dtype {lengths.dtype}")
    if lengths.min() < 1 or lengths.max() > S:
        raise ValueError(
            f"src_lengths must be in [1, {S}] (the padded source length), got {lengths.tolist()}"
        )
    if max_src_len is not None and S > max_src_len:
        raise ValueError(f"source length {S} exceeds the model's max_len = {int(max_src_len)}")
    ids = check_token_ids("input_ids", ids, src_vocab_size, side="source")
    return ids, np.ascontiguousarray(lengths, dtype=np.int64)


# The searches' name of check_sources, which the Triton translator's vendored copy of this
# module also calls.
_check_sources = check_sources


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def check_encode_args(
    input_ids: Any,
    src_lengths: Any,
    cache_len: Any,
    num_beams: Any,
    *,
    src_vocab_size: int | None = None,
    max_positions: int | None = None,
) -> tuple[np.ndarray, np.ndarray, int, int]:
    """The checks every runner's ``encode`` makes: the sources (:func:`check_sources`, source
    length at most ``max_positions``), ``cache_len`` a positive int of at most ``max_positions``
    (the model's ``max_len``: positions past it have no positional encoding) and ``num_beams``
    a positive int. Returns ``(input_ids, src_lengths, cache_len, num_beams)``; limits of a
    runner's own (an export's or an engine profile's) are checked by the runner after these.
    """
    ids, lengths = check_sources(
        input_ids, src_lengths, src_vocab_size=src_vocab_size, max_src_len=max_positions
    )
    cache_len = _check_positive_int("cache_len", cache_len)
    if max_positions is not None and cache_len > max_positions:
        raise ValueError(
            f"cache_len = {cache_len} exceeds the model's max_len = {int(max_positions)} "
            "(positions past it have no positional encoding); generate fewer tokens"
        )
    return ids, lengths, cache_len, _check_positive_int("num_beams", num_beams)


def _per_row(name: str, value: IntOrArray, n: int) -> np.ndarray:
    arr = np.asarray(value)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must be an int or an array of ints, got {value!r}")
    if arr.ndim == 0:
        arr = np.full(n, int(arr), dtype=np.int64)
    elif arr.shape != (n,):
        raise ValueError(f"{name} must be an int or have shape ({n},), got shape {arr.shape}")
    if arr.min() < 0:
        raise ValueError(f"{name} must be >= 0, got {arr.tolist()}")
    return arr.astype(np.int64)


def _check_cache_len(cache_len: int | None, steps: int) -> int:
    if cache_len is None:
        return steps
    if int(cache_len) < steps:
        raise ValueError(
            f"cache_len = {cache_len} is too small to generate {steps} tokens (needs >= {steps})"
        )
    return int(cache_len)


# ------------------------------------------------------------------------------------------
# greedy
# ------------------------------------------------------------------------------------------


def greedy_decode(
    runner: Runner,
    input_ids: np.ndarray,
    src_lengths: np.ndarray,
    *,
    bos_id: int,
    eos_id: int,
    max_new_tokens: IntOrArray,
    min_new_tokens: IntOrArray = 0,
    cache_len: int | None = None,
) -> list[list[int]]:
    """Batched greedy decoding; each row stops at its EOS (not returned) or its budget.
    A NaN or +inf logit is a RuntimeError naming the step and row.

    Stops as soon as every row is finished. Rows that finished keep being fed EOS (their
    outputs are ignored) so that every step is one batched call.
    """
    ids, lengths = check_sources(input_ids, src_lengths)
    B = ids.shape[0]
    max_new = _per_row("max_new_tokens", max_new_tokens, B)
    min_new = _per_row("min_new_tokens", min_new_tokens, B)
    steps = int(max_new.max())
    outputs: list[list[int]] = [[] for _ in range(B)]
    if steps == 0:
        return outputs
    cache_len = _check_cache_len(cache_len, steps)

    state = runner.encode(ids, lengths, cache_len, 1)
    tokens = np.full(B, bos_id, dtype=np.int64)
    finished = max_new == 0
    rows = np.arange(B)
    for t in range(steps):
        logits = np.asarray(runner.step(state, tokens))
        if logits.shape[0] != B:
            raise RuntimeError(f"runner.step returned logits of shape {logits.shape}, expected ({B}, V)")
        suppress = t < min_new
        if suppress.any():
            logits = np.array(logits, dtype=np.float32, copy=True)
            logits[rows[suppress], eos_id] = -np.inf
        next_tokens = np.argmax(logits, axis=-1).astype(np.int64)
        _check_finite_logits(logits[rows, next_tokens], t)  # argmax picks a NaN or +inf if there is one
        tokens = greedy_advance(outputs, finished, next_tokens, eos_id=eos_id, max_new_tokens=max_new)
        if finished.all():
            break
    return outputs


def greedy_advance(
    outputs: list[list[int]],
    finished: np.ndarray,
    next_tokens: np.ndarray,
    *,
    eos_id: int,
    max_new_tokens: np.ndarray,
) -> np.ndarray:
    """One greedy step's bookkeeping, in place: every open row ``b`` either finishes (its token is
    the EOS, which is not appended) or appends its token to ``outputs[b]`` and finishes when it
    holds ``max_new_tokens[b]`` tokens. ``finished`` (bool ``[B]``) is updated.

    Returns the tokens to feed at the next step (int64 ``[B]``): each row's new token, the EOS for
    finished rows (their outputs are ignored, so that every step stays one batched call).
    """
    for b in range(len(outputs)):
        if finished[b]:
            continue
        tok = int(next_tokens[b])
        if tok == eos_id:
            finished[b] = True
        else:
            outputs[b].append(tok)
            if len(outputs[b]) >= max_new_tokens[b]:
                finished[b] = True
    return np.where(finished, eos_id, next_tokens).astype(np.int64)


# ------------------------------------------------------------------------------------------
# beam search
# ------------------------------------------------------------------------------------------


# Top-k over the vocabulary by blocks: the k largest entries of a row lie in the k blocks with
# the largest maxima, so one pass computes block maxima and only k blocks are partitioned.
_TOPK_BLOCK = 64
_TOPK_OFFSETS = np.arange(_TOPK_BLOCK)


def _row_top_k(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(indices, row_max)`` for ``x [N, V]``: ``indices [N, min(k, V)]`` of each row's largest
    entries (in no particular order; ties broken arbitrarily) and each row's maximum (NaN when
    the row holds a NaN)."""
    N, V = x.shape
    k = min(k, V)
    full = V - V % _TOPK_BLOCK
    n_blocks = full // _TOPK_BLOCK
    if k == V:
        return np.broadcast_to(np.arange(V), (N, V)), x.max(axis=1)
    if n_blocks < 4 * k:  # a small vocabulary or a wide beam: partition the whole rows
        return np.argpartition(x, V - k, axis=1)[:, V - k :], x.max(axis=1)
    block_max = x[:, :full].reshape(N, n_blocks, _TOPK_BLOCK).max(axis=2)  # NaN propagates
    top_blocks = np.argpartition(block_max, n_blocks - k, axis=1)[:, n_blocks - k :]
    cols = (top_blocks[:, :, None] * _TOPK_BLOCK + _TOPK_OFFSETS).reshape(N, k * _TOPK_BLOCK)
    if full < V:  # the entries after the last whole block are always candidates
        cols = np.concatenate([cols, np.broadcast_to(np.arange(full, V), (N, V - full))], axis=1)
    rows = np.arange(N)[:, None]
    values = x[rows, cols]
    pick = np.argpartition(values, values.shape[1] - k, axis=1)[:, values.shape[1] - k :]
    return cols[rows, pick], values.max(axis=1)


def _check_finite_logits(row_max: np.ndarray, step: int) -> None:
    bad = np.flatnonzero(~(row_max < np.inf))  # NaN or +inf somewhere in the row
    if bad.size:
        raise RuntimeError(
            f"runner.step returned a NaN or +inf logit at step {step} (row {int(bad[0])}"
            f"{f' and {bad.size - 1} more rows' if bad.size > 1 else ''}); logits must be finite or -inf"
        )


def beam_search(
    runner: Runner,
    input_ids: np.ndarray,
    src_lengths: np.ndarray,
    *,
    bos_id: int,
    eos_id: int,
    beam_size: int,
    n_best: int = 1,
    max_new_tokens: IntOrArray,
    min_new_tokens: IntOrArray = 0,
    length_penalty: str = "gnmt",
    alpha: float = 0.6,
    cache_len: int | None = None,
) -> list[list[Hypothesis]]:
    """Batched beam search -> for every source its ``n_best`` hypotheses, best score first.

    Each step expands all ``beam_size`` open beams of a source, ranks the ``beam_size * V``
    candidates by cumulative log-probability and looks at the best ``2 * beam_size``: an EOS
    candidate ranked within the first ``beam_size`` becomes a finished hypothesis (scored with
    the length penalty), and the best non-EOS candidates become the next open beams. A source
    stops when it has ``n_best`` finished hypotheses and no open beam can beat the
    ``n_best``-th of them even at its maximum length (log-probabilities only fall as a
    hypothesis grows, and the penalty divisor is largest at the maximum length), or when it
    reaches ``max_new_tokens``; then its open beams join the candidates as unfinished hypotheses.
    Candidates of equal score are ranked by beam, then token id.

    ``length_penalty``: one of :data:`LENGTH_PENALTIES` (see :func:`length_penalty_factor`),
    with exponent ``alpha``. ``min_new_tokens``: EOS masked before the softmax (module docstring).

    A step's host work is vectorised over all sources: the logits stay float32 ``[rows, V]``
    (each row's best ``2 * beam_size`` tokens found by block maxima, its log-sum-exp from one
    float32 exponential pass summed in float64); only the ``rows x 2 * beam_size`` candidates are scored in float64. Python loops run
    only over the hypotheses that finish. A NaN or +inf logit is a RuntimeError naming the step
    and row (it has no log-probability).
    """
    if length_penalty not in LENGTH_PENALTIES:
        raise ValueError(f"length_penalty must be one of {LENGTH_PENALTIES}, got {length_penalty!r}")
    if not isinstance(beam_size, (int, np.integer)) or beam_size < 1:
        raise ValueError(f"beam_size must be a positive int, got {beam_size!r}")
    if not isinstance(n_best, (int, np.integer)) or not 1 <= n_best <= beam_size:
        raise ValueError(f"n_best must be in [1, beam_size={beam_size}], got {n_best!r}")
    if alpha < 0 or not math.isfinite(alpha):
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha}")
    ids, lengths = check_sources(input_ids, src_lengths)
    B, K = ids.shape[0], int(beam_size)
    max_new = _per_row("max_new_tokens", max_new_tokens, B)
    min_new = _per_row("min_new_tokens", min_new_tokens, B)
    steps = int(max_new.max())
    results: list[list[Hypothesis]] = [[] for _ in range(B)]
    if steps == 0:
        return [[Hypothesis([], 0.0, 0.0, False)] for _ in range(B)]
    cache_len = _check_cache_len(cache_len, steps)

    def penalty(length: int) -> float:
        return length_penalty_factor(length, length_penalty, alpha)

    N = B * K
    state = runner.encode(ids, lengths, cache_len, K)
    # Cumulative log-probabilities of the open beams; only beam 0 is live at the start (all
    # beams of a source are identical then, expanding them all would give K copies).
    beam_scores = np.full((B, K), -np.inf, dtype=np.float64)
    beam_scores[:, 0] = 0.0
    history = np.zeros((N, steps), dtype=np.int64)  # generated tokens of every open beam
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    n_finished = np.zeros(B, dtype=np.int64)
    nth_best = np.full(B, -np.inf)  # score of each source's n_best-th finished hypothesis
    max_penalty = np.array([penalty(int(m)) for m in np.maximum(max_new, 1)])  # divisor at the budget
    done = max_new == 0
    for b in np.flatnonzero(done):
        results[b] = [Hypothesis([], 0.0, 0.0, False)]
    tokens = np.full(N, bos_id, dtype=np.int64)
    identity = np.arange(N, dtype=np.int64)
    beam_of_row = identity % K
    row_ids = identity[:, None]
    source_ids = np.arange(B)[:, None]

    for t in range(steps):
        logits = np.asarray(runner.step(state, tokens))
        if logits.ndim != 2 or logits.shape[0] != N:
            raise RuntimeError(f"runner.step returned logits of shape {logits.shape}, expected ({N}, V)")
        V = logits.shape[1]
        x = logits if logits.dtype == np.float32 else logits.astype(np.float32)
        suppress = t < min_new  # [B]: EOS masked before the softmax, the rest renormalised
        if suppress.any():
            x = np.array(x, copy=True).reshape(B, K, V)
            x[suppress, :, eos_id] = -np.inf
            x = x.reshape(N, V)
        # Each row's best k2 tokens hold every candidate of the source's best 2K.
        k2 = min(2 * K, V)
        cols, row_max = _row_top_k(x, k2)
        _check_finite_logits(row_max, t)
        shift = np.where(np.isfinite(row_max), row_max, np.float32(0.0))
        scaled = np.subtract(x, shift[:, None])
        np.exp(scaled, out=scaled)
        sums = scaled.sum(axis=1, dtype=np.float64)
        with np.errstate(divide="ignore"):
            log_z = shift.astype(np.float64) + np.log(sums)  # -inf for a row of only -inf
        values = x[row_ids, cols].astype(np.float64)
        with np.errstate(invalid="ignore"):
            logp = np.where(np.isneginf(values), -np.inf, values - log_z[:, None])
        cand = (beam_scores.reshape(N, 1) + logp).reshape(B, K * k2)
        flat = (beam_of_row[:, None] * V + cols).reshape(B, K * k2)
        n_cand = min(2 * K, K * V)
        order = np.lexsort((flat, -cand), axis=1)[:, :n_cand]  # best first; ties by beam, token
        s_score = cand[source_ids, order]
        s_flat = flat[source_ids, order]
        s_beam, s_tok = np.divmod(s_flat, V)
        live = ~done[:, None]

        # The best K non-EOS candidates are the next open beams.
        is_eos = s_tok == eos_id
        open_rank = np.cumsum(~is_eos, axis=1) - 1
        take_b, take_c = np.nonzero(~is_eos & (open_rank < K) & live)
        slot = take_b * K + open_rank[take_b, take_c]
        beam_index = identity.copy()
        beam_index[slot] = take_b * K + s_beam[take_b, take_c]
        new_tokens = np.full(N, eos_id, dtype=np.int64)
        new_tokens[slot] = s_tok[take_b, take_c]
        new_scores = np.full(N, -np.inf)
        new_scores[slot] = s_score[take_b, take_c]
        new_scores = new_scores.reshape(B, K)

        # An EOS candidate within the best K finishes a hypothesis.
        length = t + 1  # generated tokens after this step, the candidate included
        fin_b, fin_c = np.nonzero(is_eos & (np.arange(n_cand) < K) & np.isfinite(s_score) & live)
        for b, c in zip(fin_b.tolist(), fin_c.tolist()):
            score = float(s_score[b, c])
            row = b * K + int(s_beam[b, c])
            finished[b].append(Hypothesis(history[row, :t].tolist(), score / penalty(length), score, True))
        for b in set(fin_b.tolist()):
            finished[b].sort(key=lambda h: h.score, reverse=True)
            n_finished[b] = len(finished[b])
            if n_finished[b] >= n_best:
                nth_best[b] = finished[b][n_best - 1].score

        # Done? At this source's budget, or when no open beam can beat the n-th best even at
        # its maximum length, or when every continuation is impossible (-inf).
        at_budget = ~done & (length >= max_new)
        best_open = new_scores.max(axis=1)
        open_finite = np.isfinite(best_open)
        bound = np.where(open_finite, best_open / max_penalty, -np.inf)
        stop = ~done & ~at_budget & (n_finished >= n_best) & (bound <= nth_best)
        stop |= ~done & ~open_finite & (n_finished > 0)
        for b in np.flatnonzero(at_budget).tolist():
            for k in np.flatnonzero(np.isfinite(new_scores[b])).tolist():
                r = b * K + k
                toks = history[beam_index[r], :t].tolist() + [int(new_tokens[r])]
                s = float(new_scores[b, k])
                finished[b].append(Hypothesis(toks, s / penalty(length), s, False))
        for b in np.flatnonzero(stop | at_budget).tolist():
            finished[b].sort(key=lambda h: h.score, reverse=True)
            results[b] = finished[b][:n_best]
            rows = slice(b * K, (b + 1) * K)
            new_scores[b, :] = -np.inf
            beam_index[rows] = identity[rows]
            new_tokens[rows] = eos_id
            done[b] = True
        if done.all():
            break
        beam_scores = new_scores
        if not np.array_equal(beam_index, identity):
            history[:, :t] = history[beam_index, :t]
            runner.reorder(state, beam_index)
        history[:, t] = new_tokens
        tokens = new_tokens

    for b in range(B):
        if not results[b]:  # only reachable if every candidate was -inf throughout
            finished[b].sort(key=lambda h: h.score, reverse=True)
            results[b] = finished[b][:n_best] or [Hypothesis([], -math.inf, -math.inf, False)]
    return results


# ------------------------------------------------------------------------------------------
# search as runner methods
# ------------------------------------------------------------------------------------------


class SearchMethods:
    """``runner.greedy(...)`` and ``runner.beam_search(...)`` for any runner class that mixes this in.

    ``bos_id`` / ``eos_id`` default to those of the runner's description record ``info``
    (:class:`transformer_ext.runtimes.info.RunnerInfo`; the ONNX Runtime runners read them from
    the export manifest); a runner that does not know them needs them passed.
    """

    def _search_kwargs(self, kwargs: dict) -> dict:
        for name in ("bos_id", "eos_id"):
            if kwargs.get(name) is None:
                value = getattr(getattr(self, "info", None), name, None)
                if value is None:
                    raise TypeError(f"{type(self).__name__} does not know the model's {name}: pass {name}=")
                kwargs[name] = int(value)
        return kwargs

    def greedy(self, input_ids, src_lengths, *, max_new_tokens: IntOrArray, **kwargs) -> list[list[int]]:
        """:func:`greedy_decode` with this runner (keyword arguments as there)."""
        return greedy_decode(
            self, input_ids, src_lengths, max_new_tokens=max_new_tokens, **self._search_kwargs(kwargs)
        )

    def beam_search(
        self, input_ids, src_lengths, *, beam_size: int, max_new_tokens: IntOrArray, **kwargs
    ) -> list[list[Hypothesis]]:
        """:func:`beam_search` with this runner (keyword arguments as there)."""
        return beam_search(
            self,
            input_ids,
            src_lengths,
            beam_size=beam_size,
            max_new_tokens=max_new_tokens,
            **self._search_kwargs(kwargs),
        )
