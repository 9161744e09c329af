"""Greedy, sampling and beam search, written once against a small runner protocol.

This module imports only numpy: the ONNX Runtime runner must work without torch. A backend
(eager PyTorch, ONNX Runtime, TensorRT, a test double) implements :class:`Runner`; the search
never knows which one it drives. :func:`generate` is the one entry point for every setting
(greedy, sampling, beam search; always :class:`Hypothesis` lists); :func:`greedy_decode` and
:func:`beam_search` are the two searches behind it; :func:`score` is forced decoding (the
log-probabilities of given targets).

Conventions:

* The decoder is fed the start token first: ``decoder_start_id``, which defaults to
  ``bos_id`` (Marian starts with ``<pad>``, M2M100 / NLLB with ``</s>``). Every returned token
  list excludes the start token and the EOS; it includes the ``target_prefix`` tokens.
* ``max_new_tokens`` counts generated tokens, EOS included (a row that emits EOS as its
  ``max_new_tokens``-th token has ``max_new_tokens - 1`` tokens). It may be an int or one value
  per source (e.g. from :func:`max_new_tokens_for`). Prefix tokens count as generated tokens.
* Logit processors, applied at every step in this order to every search (the step's
  distribution before the choice): ``repetition_penalty`` (the logit ``l`` of a token already
  in the row's sequence, start token included, becomes ``l * p`` if ``l < 0``, else ``l / p``),
  ``no_repeat_ngram_size`` n (a token that would complete an n-gram already in the sequence is
  banned), ``banned_ids`` (never generated), ``min_new_tokens`` (EOS banned while fewer tokens
  than that have been generated), then the forced tokens: ``target_prefix`` (row b's first
  ``len(target_prefix[b])`` tokens are given), and with ``force_eos_at_budget`` the EOS as the
  last token a row's budget allows. A banned token's logit is -inf *before* the softmax, so
  the other tokens' probabilities are renormalised (as CTranslate2 does); a forced token keeps
  the log-probability the model gives it (so that :func:`score` of a result gives its log-prob).
  With ``length_penalty="hf"`` the beam search follows transformers' ``generate()`` instead
  (the processors act on the log-probabilities, nothing is renormalised, a forced token scores
  0: see :func:`beam_search`).
* Length penalties (:func:`length_penalty_factor`) divide a hypothesis' log-probability by a
  function of its length, which counts the generated tokens with the EOS (when it has one).
* The runner's self-attention cache must hold every fed token: the decoder feeds the start
  token and then all generated tokens but the last, so ``cache_len`` defaults to
  ``max(max_new_tokens)``.

The checks every runner makes on its arguments live here, once, so that every backend refuses
the same input with the same message (naming the argument, and for ids the row and value):
:func:`check_encode_args` (sources via :func:`check_sources`, ``cache_len``, ``num_beams``) at
encode, :func:`check_step_tokens` at a step, :func:`check_beam_index` at a reorder. A runner
checks limits of its own (an export's, an engine profile's) after them.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Protocol, Sequence, Union, runtime_checkable

import numpy as np

logger = logging.getLogger(__name__)

__all__ = [
    "Runner",
    "SearchMethods",
    "Hypothesis",
    "generate",
    "greedy_decode",
    "greedy_advance",
    "beam_search",
    "check_attention_runner",
    "score",
    "max_new_tokens_for",
    "length_penalty_factor",
    "log_softmax",
    "check_sources",
    "check_encode_args",
    "check_token_ids",
    "check_step_tokens",
    "check_beam_index",
    "check_select_index",
    "as_int64",
    "LENGTH_PENALTIES",
    "EARLY_STOPPING",
]

IntOrArray = Union[int, Sequence[int], np.ndarray]

LENGTH_PENALTIES = ("gnmt", "seed", "average", "none", "hf")
# transformers' ``early_stopping`` values, for ``length_penalty="hf"`` (see :func:`beam_search`).
EARLY_STOPPING = (False, True, "never")


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


# A runner may also implement ``step_top_k(state, tokens, k, columns)``: :meth:`Runner.step`
# (the same token feed and cache update) that returns, instead of the logits alone,
# ``(top_log_probs, top_ids, column_log_probs, logits)``: float32 ``[N, min(k, V)]`` each row's
# best log-probabilities under the softmax of its logits, best first, int64 their token ids,
# float32 ``[N, M]`` the log-probabilities at the int64 ``columns [N, M]`` (ids below V), and the
# float32 logits ``[N, V]`` themselves (possibly the runner's own buffer: read before the next
# step, never written). A row holding a NaN or +inf logit must have a NaN in its first top value.
# :func:`beam_search` uses it, when the logit processors only mask or force tokens, to read
# ``N x (2 * beam_size + a few)`` numbers from the runner instead of ``N x V``
# (transformer_ext/runtimes/search_head.py computes them in ONNX Runtime).
#
# A runner may also implement ``select(state, index)`` (int64 ``[M]``, ``1 <= M <= N``, checked
# by :func:`check_select_index`): the state keeps M rows, row ``r`` becoming old row
# ``index[r]`` in every per-row buffer (the self-attention caches over the valid prefix, the
# cross-attention K/V, the source lengths), so that later steps run on M rows. Both searches
# use it to drop the rows of finished sources (``remove_finished=True``, the default); a runner
# without it (or whose ``select`` is None) keeps feeding finished rows.


# Greedy search drops its finished rows from the runner's state once they are at least a quarter
# of the rows it holds, not at every step where one finishes: a drop copies every open row's
# caches and cross-attention K/V, which for a small model costs about as much as a step. On the
# bundled demo model (5,000 lines, token batches of 4,096, 1 thread, a 2-core Xeon) a quarter
# took 7.0 CPU seconds, an eighth 7.1, a half 7.3 and every finish 7.4 (medians of 6 rounds,
# benchmarks/ab_drop_finished.py, results/ab_drop_finished_xeon.json). Larger models lose less
# to the copy but also gain less from the dropped rows: their steps are mostly weight reads.
GREEDY_DROP_DIVISOR = 4


def _format_index(index: tuple) -> str:
    return ", ".join(str(int(i)) for i in index)


def check_token_ids(name: str, ids: Any, vocab_size: int | None, *, side: str = "target") -> np.ndarray:
    """``ids`` (any shape) as int64, every value in ``[0, vocab_size)``; the checks every runner
    makes on the token ids it feeds (source ids at encode, one token per row at a step).

    Raises TypeError for non-integer ids and ValueError naming the first offending entry
    (``tokens[2] = -1``) and the vocabulary range otherwise. ``vocab_size=None`` checks the dtype only.
    """
    raw = np.asarray(ids)
    if vocab_size is None or raw.size == 0 or not np.issubdtype(raw.dtype, np.integer):
        return as_int64(name, raw)
    # Compared in the caller's dtype, so that a value is named as given (uint64 max, not -1).
    bad = (raw < 0) | (raw >= int(vocab_size))
    if bad.any():
        where = np.argwhere(bad)
        first = tuple(where[0])
        more = f" ({len(where) - 1} more ids out of range)" if len(where) > 1 else ""
        row = f" (row {int(first[0])})" if raw.ndim >= 1 else ""
        raise ValueError(
            f"{name}[{_format_index(first)}] = {int(raw[first])}{row} is not a {side} token id: the {side} "
            f"vocabulary has ids 0 .. {int(vocab_size) - 1}{more}"
        )
    return as_int64(name, raw)


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
    """``array`` as a contiguous int64 numpy array; a TypeError naming ``name`` if it holds no
    integers, a ValueError naming the first value (as given) that int64 cannot hold (a uint64
    above 2**63 - 1 would wrap to a negative number)."""
    arr = np.asarray(array)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        first = tuple(np.argwhere(arr > np.iinfo(np.int64).max)[0])
        where = f"[{_format_index(first)}]" if arr.ndim else ""
        raise ValueError(f"{name}{where} = {int(arr[first])} is out of the int64 range")
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


def check_select_index(index: Any, num_rows: int) -> np.ndarray:
    """The checks every runner makes on the ``index`` of a ``select`` (the rows a state keeps);
    returns it as int64. ``index`` is 1-D with 1 to ``num_rows`` entries, each a current row;
    an out-of-range value is an IndexError naming its position and value."""
    index = as_int64("index", index)
    if index.ndim != 1 or not 1 <= index.shape[0] <= num_rows:
        raise ValueError(f"index must have shape (M,) with 1 <= M <= {num_rows}, got {index.shape}")
    bad = np.flatnonzero((index < 0) | (index >= num_rows))
    if bad.size:
        r = int(bad[0])
        raise IndexError(
            f"index[{r}] = {int(index[r])} is not a row of the decoding state: rows are 0 .. {num_rows - 1}"
        )
    return index


def _selector(runner: Any, remove_finished: Any) -> Any:
    """The runner's ``select`` when finished rows are to be removed and it has one, else None."""
    if not isinstance(remove_finished, (bool, np.bool_)):
        raise TypeError(f"remove_finished must be a bool, got {remove_finished!r}")
    return getattr(runner, "select", None) if remove_finished else None


@dataclass(frozen=True)
class Hypothesis:
    """One search result.

    ``tokens``: generated ids without the start token and EOS (prefix tokens included).
    ``log_prob``: sum of the log-probabilities of every generated token, the EOS included when
    the hypothesis finished with one (of the distributions after the logit processors: see the
    module docstring). ``score``: ``log_prob / length_penalty_factor(...)`` for beam search,
    what the n-best list is sorted by; ``log_prob`` for greedy decoding and sampling.
    ``finished``: False for a hypothesis cut off at ``max_new_tokens`` without EOS.
    ``token_log_probs``: the log-probability of each token (the EOS's last, when finished), whose
    sum is ``log_prob``. A greedy search run without ``return_scores`` computes no probabilities:
    its hypotheses (as the translator builds them) have ``score``, ``log_prob`` and
    ``token_log_probs`` ``None``.
    ``attention`` (``return_attention``, else None): one row per token of ``tokens``, the
    cross-attention of the step that chose it over the source's positions (``src_lengths[b]``
    values): the last decoder layer's probabilities averaged over its heads, each row summing to 1
    (see :func:`check_attention_runner`).
    """

    tokens: list[int]
    score: Optional[float]
    log_prob: Optional[float]
    finished: bool = True
    token_log_probs: Optional[list[float]] = None
    attention: Optional[list[list[float]]] = None


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
    ``"hf"``: ``length ** alpha``, the divisor of transformers' beam search (its
    ``length_penalty`` is ``alpha``, which may be negative there); the kind also selects
    transformers' search rules in :func:`beam_search`.
    """
    if kind == "gnmt":
        return ((5.0 + length) / 6.0) ** alpha
    if kind == "seed":
        return ((5.0 + length + 1) / 5.0) ** alpha
    if kind in ("average", "hf"):
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
# search options and the logit processors every search applies
# ------------------------------------------------------------------------------------------


def _check_token_id(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a token id (an int >= 0), got {value!r}")
    return int(value)


def _check_real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


def _check_int_list(name: str, value: Any) -> np.ndarray:
    """``value`` (a list or 1-D array of ints >= 0, ``None`` or empty) as int64."""
    if value is None:
        return np.zeros(0, dtype=np.int64)
    if isinstance(value, (str, bytes)) or isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a list of token ids, got {value!r}")
    items = list(value)
    if not items:
        return np.zeros(0, dtype=np.int64)
    for i, v in enumerate(items):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name}[{i}] must be a token id (an int), got {v!r}")
        if v < 0:
            raise ValueError(f"{name}[{i}] = {int(v)} is not a token id (ids are >= 0)")
    return np.asarray(items, dtype=np.int64)


def _check_in_vocab(name: str, ids: np.ndarray, vocab_size: int) -> None:
    """Every entry of the 1-D ``ids`` (named ``name[i]`` in the error) is below ``vocab_size``."""
    bad = np.flatnonzero(ids >= vocab_size)
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{name}[{i}] = {int(ids[i])} is not a target token id: the target vocabulary has ids "
            f"0 .. {vocab_size - 1}"
        )


def _check_prefixes(target_prefix: Any, n_sources: int, max_new: np.ndarray, eos_id: int) -> list[np.ndarray]:
    """One int64 array per source: the tokens forced first (empty without a prefix)."""
    if target_prefix is None:
        return [np.zeros(0, dtype=np.int64)] * n_sources
    if isinstance(target_prefix, (str, bytes)) or not hasattr(target_prefix, "__len__"):
        raise TypeError(
            f"target_prefix must be a list holding one list of token ids per source, got {target_prefix!r}"
        )
    if len(target_prefix) != n_sources:
        raise ValueError(
            f"target_prefix must hold one token list per source ({n_sources}), got {len(target_prefix)}"
        )
    out = []
    for b, prefix in enumerate(target_prefix):
        arr = _check_int_list(f"target_prefix[{b}]", prefix)
        at_eos = np.flatnonzero(arr == eos_id)
        if at_eos.size:
            raise ValueError(
                f"target_prefix[{b}][{int(at_eos[0])}] is the EOS id {eos_id}: a prefix is what comes "
                "before the end of the translation"
            )
        if len(arr) > max_new[b]:
            raise ValueError(
                f"target_prefix[{b}] has {len(arr)} tokens, more than the maximum length of that source "
                f"({int(max_new[b])} generated tokens, max_new_tokens): shorten the prefix or allow longer outputs"
            )
        out.append(arr)
    return out


@dataclass(frozen=True)
class _Options:
    """The checked logit-processor options of one search (see the module docstring)."""

    start_id: int
    banned: np.ndarray
    repetition_penalty: float
    no_repeat_ngram_size: int
    force_eos_at_budget: bool


def _check_options(
    *,
    bos_id: Any,
    eos_id: Any,
    decoder_start_id: Any,
    banned_ids: Any,
    repetition_penalty: Any,
    no_repeat_ngram_size: Any,
    force_eos_at_budget: Any,
) -> _Options:
    _check_token_id("bos_id", bos_id)
    eos_id = _check_token_id("eos_id", eos_id)
    start = bos_id if decoder_start_id is None else decoder_start_id
    start = _check_token_id("decoder_start_id" if decoder_start_id is not None else "bos_id", start)
    banned = np.unique(_check_int_list("banned_ids", banned_ids))
    if (banned == eos_id).any():
        raise ValueError(
            f"banned_ids holds the EOS id {eos_id}: a search that may never end is not defined "
            "(limit the length with max_new_tokens / min_new_tokens instead)"
        )
    penalty = _check_real("repetition_penalty", repetition_penalty)
    if penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0 (1 = no penalty), got {penalty}")
    ngram = no_repeat_ngram_size
    if isinstance(ngram, bool) or not isinstance(ngram, (int, np.integer)) or ngram < 0:
        raise ValueError(f"no_repeat_ngram_size must be an int >= 0 (0 = off), got {ngram!r}")
    if not isinstance(force_eos_at_budget, (bool, np.bool_)):
        raise TypeError(f"force_eos_at_budget must be a bool, got {force_eos_at_budget!r}")
    return _Options(start, banned, penalty, int(ngram), bool(force_eos_at_budget))


class _Processors:
    """The logit processors of one search over ``N = n_sources * rows_per_source`` rows (the
    rows of a source are consecutive): what happens to a step's ``[N, V]`` scores before a
    token is chosen. Everything is vectorised over the rows."""

    def __init__(
        self,
        options: _Options,
        *,
        eos_id: int,
        rows_per_source: int,
        min_new: np.ndarray,
        max_new: np.ndarray,
        prefixes: list[np.ndarray],
    ):
        R = rows_per_source
        self.o = options
        self.eos_id = eos_id
        self.min_new = np.repeat(min_new, R)
        self.max_new = np.repeat(max_new, R)
        plen = np.array([len(p) for p in prefixes], dtype=np.int64)
        table = np.full((len(prefixes), max(1, int(plen.max(initial=0)))), -1, dtype=np.int64)
        for b, p in enumerate(prefixes):
            table[b, : len(p)] = p
        self.prefix = np.repeat(table, R, axis=0)
        self.prefix_len = np.repeat(plen, R)
        self.prefixes = prefixes
        self.needs_sequence = options.repetition_penalty != 1.0 or options.no_repeat_ngram_size > 0

    def select(self, rows: np.ndarray) -> _Processors:
        """The processors of the rows ``rows`` (int64 indices of the current rows), in that order:
        what a search uses after dropping finished rows."""
        new = copy.copy(self)
        new.min_new, new.max_new = self.min_new[rows], self.max_new[rows]
        new.prefix, new.prefix_len = self.prefix[rows], self.prefix_len[rows]
        return new

    def check_vocab(self, V: int) -> None:
        """The ids the options name must be target token ids (known at the first step)."""
        _check_in_vocab("banned_ids", self.o.banned, V)
        for b, p in enumerate(self.prefixes):
            if p.size:
                _check_in_vocab(f"target_prefix[{b}]", p, V)
        if self.o.start_id >= V:
            raise ValueError(
                f"the decoder start id {self.o.start_id} is not a target token id: the target vocabulary "
                f"has ids 0 .. {V - 1}"
            )

    def forced(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """``(rows, tokens)`` forced at step ``t``: prefix tokens, then the EOS at a row's budget."""
        rows = np.flatnonzero(t < self.prefix_len)
        tokens = self.prefix[rows, t] if rows.size else np.zeros(0, dtype=np.int64)
        if self.o.force_eos_at_budget:
            at_end = np.flatnonzero((t == self.max_new - 1) & (t >= self.prefix_len))
            if at_end.size:
                rows = np.concatenate([rows, at_end])
                tokens = np.concatenate([tokens, np.full(at_end.size, self.eos_id, dtype=np.int64)])
        return rows, tokens

    def active(self, t: int) -> bool:
        """Whether :meth:`apply` changes anything at step ``t``."""
        o = self.o
        return bool(
            self.needs_sequence
            or o.banned.size
            or (t < self.min_new).any()
            or (t < self.prefix_len).any()
            or (o.force_eos_at_budget and (t == self.max_new - 1).any())
        )

    def apply(
        self, y: np.ndarray, t: int, sequence: Optional[np.ndarray], raw: np.ndarray, *, log_probs: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """The processors on ``y`` (float32 ``[N, V]``, modified in place) at step ``t``.

        ``sequence``: int64 ``[N, t + 1]``, each row's fed tokens (start token first), needed by
        the repetition penalty and the n-gram ban. A forced row keeps only its token, whose value
        becomes 0 with ``log_probs`` (``y`` holds log-probabilities: transformers' rule), else the
        row's raw logit from ``raw`` (the caller normalises it over the raw logits).
        Returns the forced ``(rows, tokens)``.
        """
        o = self.o
        N = y.shape[0]
        if o.repetition_penalty != 1.0:
            r = np.arange(N)[:, None]
            seen = y[r, sequence]
            y[r, sequence] = np.where(
                seen < 0, seen * np.float32(o.repetition_penalty), seen / np.float32(o.repetition_penalty)
            )
        if o.no_repeat_ngram_size:
            _ban_repeated_ngrams(y, sequence, o.no_repeat_ngram_size)
        if o.banned.size:
            y[:, o.banned] = -np.inf
        suppress = t < self.min_new
        if suppress.any():
            y[suppress, self.eos_id] = -np.inf
        rows, tokens = self.forced(t)
        if rows.size:
            keep = np.float32(0.0) if log_probs else raw[rows, tokens]
            y[rows] = -np.inf
            y[rows, tokens] = keep
        return rows, tokens


def _ban_repeated_ngrams(y: np.ndarray, sequence: np.ndarray, n: int) -> None:
    """``y[r, tok] = -inf`` for every token that would complete an n-gram already in row r's
    sequence (the last ``n - 1`` tokens followed by ``tok`` occurred before)."""
    N, L = sequence.shape
    if L < n:  # no complete n-gram yet
        return
    windows = np.lib.stride_tricks.sliding_window_view(sequence, n, axis=1)  # [N, L - n + 1, n]
    last = sequence[:, L - n + 1 :]  # [N, n - 1]
    match = (windows[:, :, :-1] == last[:, None, :]).all(axis=2)
    r, i = np.nonzero(match)
    y[r, windows[r, i, -1]] = -np.inf


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


class _Sampler:
    """Random sampling of one token per row: the ``topk`` most likely tokens (0: all), scaled by
    ``1 / temperature``, then the smallest set of them, most likely first, whose probability
    reaches ``topp``; one draw per row and step from a numpy Generator seeded once per search.

    The draw is an inverse-CDF pick over the kept tokens in id order (the first token whose
    cumulative probability exceeds ``u * total`` for ``u = rng.random()``), so the same seed and
    the same logits give the same tokens on every runner.
    """

    def __init__(self, topk: int, topp: float, temperature: float, seed: Optional[int]):
        self.topk, self.topp, self.temperature = topk, topp, temperature
        self.rng = np.random.default_rng(seed)

    def draw(self, y: np.ndarray, step: int, rows: Optional[np.ndarray] = None, total: int = 0) -> np.ndarray:
        """One token per row of ``y``; ``rows`` (with ``total``, the search's number of rows):
        the search's row of each row of ``y``, when finished rows were dropped."""
        N, V = y.shape
        u = self.rng.random(N if rows is None else total)  # one draw per row and step, finished included
        if rows is not None:
            u = u[rows]
        rows = np.arange(N)[:, None]
        k = V if self.topk == 0 else min(self.topk, V)
        if k < V:
            cols, row_max = _row_top_k(y, k)
            cols = np.sort(cols, axis=1)
            z = y[rows, cols].astype(np.float64)
        else:
            cols = None
            row_max = y.max(axis=1)
            z = y.astype(np.float64)
        _check_finite_logits(row_max, step, rows)
        m = np.where(np.isfinite(row_max), row_max, 0.0).astype(np.float64)
        p = np.exp((z - m[:, None]) / self.temperature)
        if self.topp < 1.0:
            order = np.argsort(-p, axis=1, kind="stable")
            ranked = np.take_along_axis(p, order, axis=1)
            cum = np.cumsum(ranked, axis=1)
            before = np.concatenate([np.zeros((N, 1)), cum[:, :-1]], axis=1)
            keep_ranked = before < self.topp * cum[:, -1:]
            keep = np.empty_like(keep_ranked)
            np.put_along_axis(keep, order, keep_ranked, axis=1)
            p = np.where(keep, p, 0.0)
        cum = np.cumsum(p, axis=1)
        pick = (cum <= (u * cum[:, -1])[:, None]).sum(axis=1)
        last_positive = p.shape[1] - 1 - np.argmax(p[:, ::-1] > 0, axis=1)
        pick = np.minimum(pick, last_positive)
        chosen = cols[np.arange(N), pick] if cols is not None else pick
        impossible = ~(cum[:, -1] > 0)  # every token banned: the first, as greedy decoding picks
        if impossible.any():
            chosen = np.where(impossible, np.argmax(y, axis=1), chosen)
        return chosen.astype(np.int64)


def _check_sampling(
    sampling_topk: Any, sampling_topp: Any, sampling_temperature: Any, seed: Any
) -> Optional[_Sampler]:
    """The sampler the options ask for; ``None`` for plain greedy decoding (``sampling_topk=1``)."""
    topk = sampling_topk
    if isinstance(topk, bool) or not isinstance(topk, (int, np.integer)) or topk < 0:
        raise ValueError(
            f"sampling_topk must be an int >= 0 (1 = greedy, 0 = the whole vocabulary), got {topk!r}"
        )
    topp = _check_real("sampling_topp", sampling_topp)
    if not 0.0 < topp <= 1.0:
        raise ValueError(f"sampling_topp must be in (0, 1], got {topp}")
    temperature = _check_real("sampling_temperature", sampling_temperature)
    if temperature <= 0:
        raise ValueError(f"sampling_temperature must be > 0, got {temperature}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
        raise ValueError(f"seed must be an int >= 0 or None, got {seed!r}")
    if topk == 1:
        given = [
            n
            for n, v, d in (("sampling_topp", topp, 1.0), ("sampling_temperature", temperature, 1.0))
            if v != d
        ]
        if given:
            raise ValueError(
                f"{' and '.join(given)} apply to random sampling, which sampling_topk = 1 (greedy) turns off: "
                "give sampling_topk = 0 (the whole vocabulary) or k > 1"
            )
        return None
    return _Sampler(int(topk), topp, temperature, None if seed is None else int(seed))


# ------------------------------------------------------------------------------------------
# greedy decoding and sampling
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
    decoder_start_id: Optional[int] = None,
    target_prefix: Optional[Sequence[Sequence[int]]] = None,
    banned_ids: Sequence[int] = (),
    repetition_penalty: float = 1.0,
    no_repeat_ngram_size: int = 0,
    force_eos_at_budget: bool = False,
    sampling_topk: int = 1,
    sampling_topp: float = 1.0,
    sampling_temperature: float = 1.0,
    seed: Optional[int] = None,
    num_hypotheses: int = 1,
    return_scores: bool = False,
    remove_finished: bool = True,
    return_attention: bool = False,
) -> Union[list[list[int]], list[list[Hypothesis]]]:
    """Batched greedy decoding (or random sampling); each row stops at its EOS or its budget.

    Returns the token ids of each source (``list[list[int]]``); with ``return_scores`` or
    ``num_hypotheses > 1``, for each source a list of :class:`Hypothesis` (score = log_prob, the
    sum of the token log-probabilities, and ``token_log_probs``), best score first.

    Options (the module docstring describes the processors):

    * ``decoder_start_id``: the first token fed (default ``bos_id``).
    * ``target_prefix``: one list of token ids per source (ragged, possibly empty), forced as
      the first generated tokens; no EOS in it, at most the source's ``max_new_tokens``.
    * ``banned_ids``: tokens never generated (transformers' single-token ``bad_words_ids``).
    * ``repetition_penalty`` (> 0, 1 = off), ``no_repeat_ngram_size`` (0 = off),
      ``min_new_tokens``, ``force_eos_at_budget`` (transformers' ``forced_eos_token_id``).
    * Sampling: ``sampling_topk`` (1: greedy, the default; 0: the whole vocabulary; k: the k
      most likely tokens), ``sampling_topp`` in (0, 1], ``sampling_temperature`` > 0 and
      ``seed`` (None: fresh entropy) as in :class:`_Sampler`; ``num_hypotheses`` independent
      samples per source (several need sampling: greedy has one hypothesis). The scores are
      log-probabilities of the processed distribution before temperature, top-k and top-p.
    * ``return_attention``: :class:`Hypothesis` lists whose ``attention`` holds each token's
      cross-attention (the runner must have ``step_with_attention``: :func:`check_attention_runner`).

    A NaN or +inf logit is a RuntimeError naming the step and row. Stops as soon as every row
    is finished. Every step is one batched call: with ``remove_finished`` (the default) and a
    runner that has ``select`` (see :class:`Runner`) the rows that finished are dropped from the
    runner's state once they are a quarter of its rows (``GREEDY_DROP_DIVISOR``), so later
    steps run on fewer rows; until then, and without ``select``, finished rows are fed EOS
    (their outputs are ignored). The results are the same either way.
    """
    select = _selector(runner, remove_finished)
    options = _check_options(
        bos_id=bos_id,
        eos_id=eos_id,
        decoder_start_id=decoder_start_id,
        banned_ids=banned_ids,
        repetition_penalty=repetition_penalty,
        no_repeat_ngram_size=no_repeat_ngram_size,
        force_eos_at_budget=force_eos_at_budget,
    )
    sampler = _check_sampling(sampling_topk, sampling_topp, sampling_temperature, seed)
    n = _check_num_hypotheses(num_hypotheses, sampler)
    ids, lengths, max_new, min_new, prefixes = _check_search_inputs(
        input_ids, src_lengths, max_new_tokens, min_new_tokens, target_prefix, eos_id
    )
    if return_attention:
        check_attention_runner(runner)
    attention: Optional[list[list[np.ndarray]]] = (
        [[] for _ in range(ids.shape[0] * n)] if return_attention else None
    )
    with_scores = bool(return_scores) or n > 1 or bool(return_attention)
    steps = int(max_new.max())
    N = ids.shape[0] * n
    outputs: list[list[int]] = [[] for _ in range(N)]
    log_probs: list[list[float]] = [[] for _ in range(N)]
    row_budget = np.repeat(max_new, n)
    if steps > 0:
        cache_len = _check_cache_len(cache_len, steps)
        procs = _Processors(
            options, eos_id=eos_id, rows_per_source=n, min_new=min_new, max_new=max_new, prefixes=prefixes
        )
        state = runner.encode(ids, lengths, cache_len, n)
        _greedy_steps(
            runner,
            state,
            procs,
            sampler,
            outputs,
            log_probs if with_scores else None,
            row_budget,
            start_id=options.start_id,
            eos_id=eos_id,
            steps=steps,
            select=select,
            attention=attention,
        )
    if not with_scores:
        return outputs
    return _greedy_results(outputs, log_probs, row_budget, n, attention, np.repeat(lengths, n))


def _check_num_hypotheses(num_hypotheses: Any, sampler: Optional[_Sampler]) -> int:
    n = _check_positive_int("num_hypotheses", num_hypotheses)
    if n > 1 and sampler is None:
        raise ValueError(
            f"num_hypotheses = {n} needs random sampling (sampling_topk != 1) or beam search "
            "(beam_size >= num_hypotheses): greedy decoding has a single hypothesis"
        )
    return n


def check_attention_runner(runner: Any) -> None:
    """Whether ``runner`` can give the cross-attention of each step (``return_attention``): it
    has ``step_with_attention(state, tokens) -> (logits [N, V], attention [N, S])``, and no
    ``attention_unavailable`` reason (an ONNX export without the attention output says which
    flag exports one). A ValueError in one line otherwise."""
    if not callable(getattr(runner, "step_with_attention", None)):
        raise ValueError(
            f"return_attention: the {type(runner).__name__} runner cannot return attention weights (the eager "
            "runner and ONNX Runtime on an export made with `python -m export.onnx --attention` can)"
        )
    reason = getattr(runner, "attention_unavailable", None)
    if reason:
        raise ValueError(f"return_attention: {reason}")


def _check_search_inputs(
    input_ids: Any,
    src_lengths: Any,
    max_new_tokens: IntOrArray,
    min_new_tokens: IntOrArray,
    target_prefix: Any,
    eos_id: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
    """``(ids, lengths, max_new, min_new, prefixes)``: the checked sources and per-source budgets."""
    ids, lengths = check_sources(input_ids, src_lengths)
    B = ids.shape[0]
    max_new = _per_row("max_new_tokens", max_new_tokens, B)
    min_new = _per_row("min_new_tokens", min_new_tokens, B)
    prefixes = _check_prefixes(target_prefix, B, max_new, eos_id)
    return ids, lengths, max_new, min_new, prefixes


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


# The smallest ``rows x V`` a step goes through ``runner.step_top_k`` at: below it the host
# search is as fast or faster (the search head's run costs about 50 us, and numpy's argmax, all
# that greedy search without scores needs, is one pass over the logits where the head makes
# three). Measured with benchmarks/bench_search_head.py, the search alone over fixed logits
# (benchmarks/results/bench_search_head_epyc.json, a 2-core EPYC), host time / head time: beam 4
# 0.5-0.6 at V 25, 0.8-1.3 from 4 to 232 thousand entries at 4 rows, 1.1-1.2 at 64-128 thousand
# from 16 rows on, 1.2-2.0 above; greedy with scores 0.4-0.96 up to 64 thousand entries, 0.9-1.1
# from 58 to 232 thousand, 1.2-1.7 from 512 thousand. Cells of a few hundred microseconds vary by
# up to 0.4 between runs (4 rows of V 58,101 gave 1.20 in a run before the committed one).
HEAD_MIN_ENTRIES = {"beam": 1 << 15, "greedy_scores": 1 << 17}


def _head_request(
    procs: _Processors, t: int, N: int, eos_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(columns, forced_rows, forced_tokens)`` of a step through ``runner.step_top_k``: the
    int64 ``columns [N, nb + 2]`` whose log-probabilities the search reads, the ``nb`` banned
    ids, the EOS (masked below a row's minimum length), then the row's forced token (or the EOS)."""
    banned = procs.o.banned
    nb = banned.shape[0]
    forced_rows, forced_tokens = procs.forced(t)
    columns = np.empty((N, nb + 2), dtype=np.int64)
    columns[:, :nb] = banned
    columns[:, nb:] = eos_id
    columns[forced_rows, nb + 1] = forced_tokens
    return columns, forced_rows, forced_tokens


def _head_masked(ids: np.ndarray, procs: _Processors, t: int, eos_id: int) -> np.ndarray:
    """bool, ``ids``' shape: the token ids a masking processor removes at step ``t`` (banned
    ids; the EOS of a row below its minimum length)."""
    masked = ids == eos_id
    masked &= (t < procs.min_new)[:, None]
    if procs.o.banned.size:
        masked |= np.isin(ids, procs.o.banned)
    return masked


def _masked_mass(picked: np.ndarray, procs: _Processors, t: int) -> np.ndarray:
    """float64 ``[N]``: each row's probability (under the unprocessed softmax) of the tokens
    :func:`_head_masked` removes, from the column log-probabilities of :func:`_head_request`."""
    nb = procs.o.banned.shape[0]
    p = np.exp(picked[:, : nb + 1].astype(np.float64))
    return p[:, :nb].sum(axis=1) + np.where(t < procs.min_new, p[:, nb], 0.0)


def _greedy_head(
    step_top_k: Any, state: Any, tokens: np.ndarray, procs: _Processors, t: int, eos_id: int
) -> tuple[Optional[np.ndarray], Optional[np.ndarray], np.ndarray]:
    """One greedy step through ``runner.step_top_k`` (processors that mask or force only):
    ``(next_tokens, their float64 log-probabilities, logits)``. Each row's token is its best one
    not masked (ties: the lowest id, as ``argmax``), a forced row's its forced token; its
    log-probability renormalised over what is not masked (``-log(1 - q)``, as
    :meth:`_BeamState.head_log_probs`). ``(None, None, logits)`` when the step is to be
    computed on the host from its logits: a NaN or +inf logit, a vocabulary too small, a best
    token of probability 0, or a row whose masked tokens hold more than half the probability."""
    N = tokens.shape[0]
    columns, forced_rows, forced_tokens = _head_request(procs, t, N, eos_id)
    k = columns.shape[1]
    top, ids, picked, logits = step_top_k(state, tokens, k, columns)
    logits = _checked_logits(np.asarray(logits), N, t, procs)
    if top.shape[1] < k or not np.isfinite(top[:, 0]).all():
        return None, None, logits
    first = np.argmin(_head_masked(ids, procs, t, eos_id), axis=1)  # the first not masked
    rows = np.arange(N)
    value = top[rows, first]
    is_forced = np.zeros(N, dtype=bool)
    is_forced[forced_rows] = True
    q = _masked_mass(picked, procs, t)
    if not np.isfinite(value[~is_forced]).all() or (q[~is_forced] > 0.5).any():
        return None, None, logits
    next_tokens = ids[rows, first]
    next_tokens[forced_rows] = forced_tokens
    lp = value.astype(np.float64) - np.log1p(-np.minimum(q, 0.5))
    lp[forced_rows] = picked[forced_rows, -1]
    return next_tokens, lp, logits


def _greedy_steps(
    runner: Runner,
    state: Any,
    procs: _Processors,
    sampler: Optional[_Sampler],
    outputs: list[list[int]],
    log_probs: Optional[list[list[float]]],
    row_budget: np.ndarray,
    *,
    start_id: int,
    eos_id: int,
    steps: int,
    select: Any = None,
    attention: Optional[list[list[np.ndarray]]] = None,
) -> None:
    """The decoding steps of :func:`greedy_decode`: fills ``outputs`` (and ``log_probs``, the
    chosen tokens' log-probabilities, and ``attention``, each step's cross-attention rows, unless
    None) in place until every row is finished.

    A step's bookkeeping is vectorised over the rows (:func:`greedy_advance`'s rules): an open
    row at step ``t`` holds ``t`` tokens, so its token goes to column ``t`` of ``generated``
    and its log-probability to column ``t`` of ``chosen_lp`` (its attention to ``attn_table``);
    the lists are filled at the end.
    With ``select`` (the runner's), the rows that finish are dropped from the runner's state
    after the step they finish at: ``active`` maps the open rows to the search's rows, and
    ``open_budget`` / ``sequence`` / ``procs`` hold the open rows only."""
    N = len(outputs)
    tokens = np.full(N, start_id, dtype=np.int64)
    sequence = np.full((N, steps + 1), eos_id, dtype=np.int64)  # fed tokens, start token first
    sequence[:, 0] = start_id
    generated = np.zeros((N, steps), dtype=np.int64)
    n_tokens = np.zeros(N, dtype=np.int64)  # tokens of each row
    n_scored = np.zeros(N, dtype=np.int64)  # log-probabilities of each row (its EOS's included)
    chosen_lp = np.zeros((N, steps)) if log_probs is not None else None
    attn_table: Optional[np.ndarray] = None  # [N, steps, S] with ``attention``
    finished = row_budget == 0
    active = np.arange(N)
    open_budget = row_budget
    scratch = _Scratch()
    step_top_k, V = None, 0
    if sampler is None and attention is None and chosen_lp is not None and not procs.needs_sequence:
        step_top_k = getattr(runner, "step_top_k", None)
    for t in range(steps):
        attn, lp = None, None
        # step 0 runs on the host: it checks the ids against the vocabulary, and learns V
        if step_top_k is not None and tokens.shape[0] * V >= HEAD_MIN_ENTRIES["greedy_scores"]:
            next_tokens, lp, x = _greedy_head(step_top_k, state, tokens, procs, t, eos_id)
        else:
            x, attn = _step_attention(runner, state, tokens, t, procs, attention is not None)
            next_tokens = None
        V = x.shape[1]
        if next_tokens is None:  # the host search on the logits
            y, next_tokens, forced_rows = _greedy_choose(
                procs,
                sampler,
                x,
                t,
                sequence[:, : t + 1],
                None if active.shape[0] == N else (active, N),
                scratch,
            )
            if chosen_lp is not None:
                lp = _chosen_log_probs(y, x, next_tokens, forced_rows, scratch)
        is_open = ~finished
        rows = active[is_open]
        if chosen_lp is not None:
            chosen_lp[rows, t] = lp[is_open]
            n_scored[rows] = t + 1
        if attn is not None:
            if attn_table is None:  # the source length is known at the first step
                attn_table = np.zeros((N, steps, attn.shape[1]), dtype=np.float32)
            attn_table[rows, t] = attn[is_open]
        appended = is_open & (next_tokens != eos_id)
        generated[active[appended], t] = next_tokens[appended]
        n_tokens[active[appended]] = t + 1
        finished = finished | (is_open & ~appended) | (appended & (t + 1 >= open_budget))
        tokens = np.where(finished, eos_id, next_tokens).astype(np.int64)
        sequence[:, t + 1] = tokens
        if finished.all():
            break
        if select is not None and _drop_now(finished):
            keep = np.flatnonzero(~finished)
            select(state, keep)
            active, finished, open_budget = active[keep], finished[keep], open_budget[keep]
            tokens, sequence, procs = tokens[keep], sequence[keep], procs.select(keep)
    for r in range(N):
        outputs[r].extend(generated[r, : n_tokens[r]].tolist())
        if log_probs is not None:
            log_probs[r].extend(chosen_lp[r, : n_scored[r]].tolist())
        if attention is not None and attn_table is not None:
            attention[r].extend(attn_table[r, : n_tokens[r]])


def _drop_now(finished: np.ndarray) -> bool:
    """Whether greedy search drops its finished rows now: once they are at least
    ``1 / GREEDY_DROP_DIVISOR`` of the rows the runner holds (with that many rows or fewer, one)."""
    n = int(np.count_nonzero(finished))
    return n > 0 and n * GREEDY_DROP_DIVISOR >= finished.shape[0]


def _greedy_choose(
    procs: _Processors,
    sampler: Optional[_Sampler],
    x: np.ndarray,
    t: int,
    sequence: np.ndarray,
    dropped: Optional[tuple[np.ndarray, int]] = None,
    scratch: Optional[_Scratch] = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One step's choice from the float32 logits ``x``: ``(y, next_tokens, forced_rows)``, ``y``
    the processed scores (``x`` itself when no processor is active; else a copy, in the
    ``scratch`` buffer ``"y"`` when given). ``dropped``: ``(active, total)`` when finished rows
    were dropped (the sampler draws for all ``total`` rows)."""
    forced_rows = np.zeros(0, dtype=np.int64)
    y = x
    if procs.active(t):
        y = np.array(x, copy=True) if scratch is None else scratch.copy("y", x)
        forced_rows, forced_tokens = procs.apply(y, t, sequence, x, log_probs=False)
    if sampler is None:
        next_tokens = np.argmax(y, axis=-1).astype(np.int64)
        _check_finite_logits(  # argmax picks a NaN or +inf if there is one
            y[np.arange(y.shape[0]), next_tokens], t, None if dropped is None else dropped[0]
        )
    elif dropped is None:
        next_tokens = sampler.draw(y, t)
    else:
        next_tokens = sampler.draw(y, t, *dropped)
    if forced_rows.size:  # the forced token even where the model gives it no probability
        next_tokens[forced_rows] = forced_tokens
    return y, next_tokens, forced_rows


def _attention_rows(rows: Sequence[np.ndarray], tokens: Sequence[int], src_len: int) -> list[list[float]]:
    """The attention of ``tokens`` (one row each, the EOS's step left out) over the source's
    ``src_len`` positions, as lists of floats."""
    return [[float(v) for v in row[: int(src_len)]] for row in rows[: len(tokens)]]


def _greedy_results(
    outputs: list[list[int]],
    log_probs: list[list[float]],
    row_budget: np.ndarray,
    n: int,
    attention: Optional[list[list[np.ndarray]]] = None,
    src_len: Optional[np.ndarray] = None,
) -> list[list[Hypothesis]]:
    """For each source its ``n`` rows as hypotheses, best score first (with their attention
    over the ``src_len`` source positions of each row, when ``attention`` is given)."""
    results = []
    for b in range(len(outputs) // n):
        hyps = []
        for r in range(b * n, (b + 1) * n):
            total = float(sum(log_probs[r]))
            done = len(outputs[r]) < int(row_budget[r])  # shorter than its budget: it stopped at an EOS
            weights = None if attention is None else _attention_rows(attention[r], outputs[r], src_len[r])
            hyps.append(Hypothesis(outputs[r], total, total, done, log_probs[r], weights))
        hyps.sort(key=lambda h: h.score, reverse=True)
        results.append(hyps)
    return results


def _chosen_log_probs(
    y: np.ndarray,
    raw: np.ndarray,
    chosen: np.ndarray,
    forced_rows: np.ndarray,
    scratch: Optional[_Scratch] = None,
) -> np.ndarray:
    """float64 log-probability of each row's chosen token under ``y``'s distribution; a forced
    row's under the raw logits (its token kept its raw logit, see :meth:`_Processors.apply`).
    ``scratch``: its buffer ``"exp"`` holds the exponentials."""
    rows = np.arange(y.shape[0])
    log_z = _log_sum_exp(y, y.max(axis=1), None if scratch is None else scratch.get("exp", y.shape))
    if forced_rows.size:
        f = raw[forced_rows]
        log_z[forced_rows] = _log_sum_exp(f, f.max(axis=1))
    value = y[rows, chosen].astype(np.float64)
    with np.errstate(invalid="ignore"):
        return np.where(np.isneginf(value), -np.inf, value - log_z)


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
    decoder_start_id: Optional[int] = None,
    target_prefix: Optional[Sequence[Sequence[int]]] = None,
    banned_ids: Sequence[int] = (),
    repetition_penalty: float = 1.0,
    no_repeat_ngram_size: int = 0,
    force_eos_at_budget: bool = False,
    early_stopping: Union[bool, str, None] = None,
    renormalize_logits: bool = False,
    remove_finished: bool = True,
    return_attention: bool = False,
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
    with exponent ``alpha``. The logit-processor options (``decoder_start_id``,
    ``target_prefix``, ``banned_ids``, ``repetition_penalty``, ``no_repeat_ngram_size``,
    ``min_new_tokens``, ``force_eos_at_budget``) are those of :func:`greedy_decode`.
    ``return_attention``: each hypothesis carries the cross-attention of its tokens
    (:class:`Hypothesis`), reordered with the beams.

    ``length_penalty="hf"`` is transformers' ``generate()`` beam search (``num_beams``,
    ``length_penalty`` = ``alpha``, ``early_stopping``), for imported models to give the tokens
    transformers gives: the score is ``log_prob / length ** alpha`` (any finite ``alpha``); the
    processors act on the float32 log-probabilities after the softmax (nothing renormalised
    unless ``renormalize_logits``, transformers' option of that name; the repetition penalty
    multiplies a seen token's log-probability; a forced token scores 0); the n-best come from
    the best ``beam_size`` finished hypotheses, and a source stops by ``early_stopping``:
    ``True`` once ``beam_size`` hypotheses finished; ``False`` (the default) once, in addition,
    the best open beam's log-probability divided by ``L ** alpha`` is at most the
    ``beam_size``-th finished score, ``L`` the number of tokens generated so far; ``"never"``
    the same with ``L`` the maximum length when ``alpha > 0``. transformers' ``max_length``
    counts the decoder start token (``max_new_tokens = max_length - 1``), as does its
    ``min_length`` (``min_new_tokens = min_length - 1``); ``forced_bos_token_id`` is a
    one-token ``target_prefix``; ``forced_eos_token_id`` is ``force_eos_at_budget``;
    ``bad_words_ids`` of single tokens are ``banned_ids``.

    A step's host work is vectorised over all sources: the logits stay float32 ``[rows, V]``
    (each row's best ``2 * beam_size`` tokens found by block maxima, its log-sum-exp from one
    float32 exponential pass summed in float64); only the ``rows x 2 * beam_size`` candidates
    are scored in float64. Python loops run only over the hypotheses that finish. A NaN or +inf
    logit is a RuntimeError naming the step and row (it has no log-probability). A runner with
    ``step_top_k`` (see :class:`Runner`) hands over those best tokens' float32 log-probabilities
    instead, where the processors only mask or force tokens and the step has at least
    ``HEAD_MIN_ENTRIES["beam"]`` logits (:meth:`_BeamState.head_log_probs`).

    ``remove_finished`` (default True): when the runner has ``select`` (see :class:`Runner`),
    the rows of the sources that stopped are dropped from the runner's state (with the beam
    reorder of the same step: one gather), so later steps run on the open sources only;
    otherwise they are fed EOS to the end. The results are the same either way.
    """
    select = _selector(runner, remove_finished)
    alpha, early_stopping = _check_beam_options(
        length_penalty, beam_size, n_best, alpha, early_stopping, renormalize_logits
    )
    options = _check_options(
        bos_id=bos_id,
        eos_id=eos_id,
        decoder_start_id=decoder_start_id,
        banned_ids=banned_ids,
        repetition_penalty=repetition_penalty,
        no_repeat_ngram_size=no_repeat_ngram_size,
        force_eos_at_budget=force_eos_at_budget,
    )
    ids, lengths, max_new, min_new, prefixes = _check_search_inputs(
        input_ids, src_lengths, max_new_tokens, min_new_tokens, target_prefix, eos_id
    )
    if return_attention:
        check_attention_runner(runner)
    B, K = ids.shape[0], int(beam_size)
    steps = int(max_new.max())
    if steps == 0:
        empty = [] if return_attention else None
        return [[Hypothesis([], 0.0, 0.0, False, [], empty)] for _ in range(B)]
    cache_len = _check_cache_len(cache_len, steps)
    procs = _Processors(
        options, eos_id=eos_id, rows_per_source=K, min_new=min_new, max_new=max_new, prefixes=prefixes
    )
    state = runner.encode(ids, lengths, cache_len, K)
    s = _BeamState.start(
        K=K,
        n_best=int(n_best),
        eos_id=eos_id,
        start_id=options.start_id,
        length_penalty=length_penalty,
        alpha=alpha,
        early_stopping=early_stopping,
        renormalize=bool(renormalize_logits),
        max_new=max_new,
        steps=steps,
    )
    if return_attention:
        s.src_len = np.repeat(lengths, K)
    return s.run(runner, state, procs, start_id=options.start_id, steps=steps, select=select)


def _check_beam_options(
    length_penalty: Any,
    beam_size: Any,
    n_best: Any,
    alpha: Any,
    early_stopping: Any,
    renormalize_logits: Any,
) -> tuple[float, Union[bool, str]]:
    """``(alpha, early_stopping)``: the checked beam-search options of :func:`beam_search`."""
    if length_penalty not in LENGTH_PENALTIES:
        raise ValueError(f"length_penalty must be one of {LENGTH_PENALTIES}, got {length_penalty!r}")
    hf = length_penalty == "hf"
    if not isinstance(beam_size, (int, np.integer)) or beam_size < 1:
        raise ValueError(f"beam_size must be a positive int, got {beam_size!r}")
    if not isinstance(n_best, (int, np.integer)) or not 1 <= n_best <= beam_size:
        raise ValueError(f"n_best must be in [1, beam_size={beam_size}], got {n_best!r}")
    alpha = _check_real("alpha", alpha)
    if alpha < 0 and not hf:
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha}")
    if early_stopping is not None and not hf:
        raise ValueError(
            "early_stopping is transformers' beam-search rule: it applies with length_penalty='hf' only"
        )
    if early_stopping is None:
        early_stopping = False
    if not (early_stopping is True or early_stopping is False or early_stopping == "never"):
        raise ValueError(f"early_stopping must be one of {EARLY_STOPPING}, got {early_stopping!r}")
    if not isinstance(renormalize_logits, (bool, np.bool_)):
        raise TypeError(f"renormalize_logits must be a bool, got {renormalize_logits!r}")
    if renormalize_logits and not hf:
        raise ValueError(
            "renormalize_logits applies with length_penalty='hf' (the other kinds always renormalise)"
        )
    return alpha, early_stopping


def _no_hypothesis() -> Hypothesis:
    """The result of a source none of whose candidates was possible (every one -inf)."""
    return Hypothesis([], -math.inf, -math.inf, False, [])


class _Ranked(NamedTuple):
    """A step's best ``n_cand`` candidates of every source, ``[B, n_cand]``, best first."""

    score: np.ndarray  # cumulative log-probability
    lp: np.ndarray  # the candidate token's log-probability
    beam: np.ndarray  # the beam it extends
    tok: np.ndarray  # its token
    is_eos: np.ndarray


class _NextBeams(NamedTuple):
    """The open beams after a step, ``[N]`` per row (``scores`` ``[B, K]``)."""

    index: np.ndarray  # the row each new beam extends (the argument of ``runner.reorder``)
    tokens: np.ndarray
    lp: np.ndarray
    scores: np.ndarray


@dataclass
class _BeamState:
    """The state of one :func:`beam_search` over ``B`` sources of ``K`` beams (``N = B * K``
    rows, a source's rows consecutive), and the parts of one step.

    The per-source arrays and lists cover the sources still in the runner's state: when the
    sources that stopped are dropped (:meth:`drop_done`) they are sliced, and ``source_of``
    maps them to the search's sources (whose ``results`` are kept)."""

    K: int
    n_best: int
    eos_id: int
    length_penalty: str
    alpha: float
    early_stopping: Union[bool, str]
    renormalize: bool
    max_new: np.ndarray  # [B] budgets
    max_penalty: np.ndarray  # [B] penalty divisor at the budget
    beam_scores: np.ndarray  # [B, K] cumulative log-probabilities of the open beams
    history: np.ndarray  # [N, steps] generated tokens of every open beam
    history_lp: np.ndarray  # [N, steps] and their log-probabilities
    finished: list[list[Hypothesis]]  # per source, its finished hypotheses
    n_finished: np.ndarray  # [B]
    kth_best: np.ndarray  # [B] the keep-th finished score (-inf while fewer finished)
    done: np.ndarray  # [B] bool
    results: list[list[Hypothesis]]  # per source of the search (indexed by ``source_of``)
    source_of: np.ndarray  # [B] the search's source of each source here (arange until one is dropped)
    start_column: np.ndarray  # [N, 1] the start token
    identity: np.ndarray  # [N] arange
    beam_of_row: np.ndarray  # [N] identity % K
    row_ids: np.ndarray  # [N, 1] identity
    source_ids: np.ndarray  # [B, 1] arange
    scratch: _Scratch  # [N, V] work buffers of the steps
    search_rows: Optional[np.ndarray] = None  # [N] the search's row of each row (None: identity)
    vocab_size: int = 0  # V, known after the first step (which runs through runner.step)
    # return_attention: each row's source length [N]; history_attn [N, steps, S] the attention
    # rows of every open beam's tokens (allocated at the first step, reordered with the beams)
    src_len: Optional[np.ndarray] = None
    history_attn: Optional[np.ndarray] = None

    @classmethod
    def start(cls, *, K: int, max_new: np.ndarray, steps: int, start_id: int, **options) -> _BeamState:
        B = max_new.shape[0]
        N = B * K
        # Only beam 0 is live at the start (all beams of a source are identical then, expanding
        # them all would give K copies).
        beam_scores = np.full((B, K), -np.inf, dtype=np.float64)
        beam_scores[:, 0] = 0.0
        identity = np.arange(N, dtype=np.int64)
        s = cls(
            K=K,
            max_new=max_new,
            max_penalty=np.zeros(B),
            beam_scores=beam_scores,
            history=np.zeros((N, steps), dtype=np.int64),
            history_lp=np.zeros((N, steps), dtype=np.float64),
            finished=[[] for _ in range(B)],
            n_finished=np.zeros(B, dtype=np.int64),
            kth_best=np.full(B, -np.inf),
            done=max_new == 0,
            results=[[] for _ in range(B)],
            source_of=np.arange(B),
            start_column=np.full((N, 1), start_id, dtype=np.int64),
            identity=identity,
            beam_of_row=identity % K,
            row_ids=identity[:, None],
            source_ids=np.arange(B)[:, None],
            scratch=_Scratch(),
            **options,
        )
        s.max_penalty = np.array([s.penalty(int(m)) for m in np.maximum(max_new, 1)])
        for b in np.flatnonzero(s.done):
            s.results[b] = [Hypothesis([], 0.0, 0.0, False, [])]
        return s

    def run(
        self, runner: Runner, state: Any, procs: _Processors, *, start_id: int, steps: int, select: Any = None
    ) -> list[list[Hypothesis]]:
        """The search steps (at most ``steps``) -> for every source its ``n_best`` hypotheses.
        With ``select`` (the runner's) the sources that stopped leave the runner's state."""
        tokens = np.full(self.identity.shape[0], start_id, dtype=np.int64)
        step_top_k = getattr(runner, "step_top_k", None) if self.src_len is None else None
        for t in range(steps):
            if step_top_k is not None and self.head_usable(procs, tokens.shape[0]):
                cols, logp, V = self.head_log_probs(step_top_k, state, tokens, procs, t)
                attn = None
            else:
                x, attn = _step_attention(runner, state, tokens, t, procs, self.src_len is not None)
                if attn is not None and self.history_attn is None:
                    self.history_attn = np.zeros((attn.shape[0], steps, attn.shape[1]), dtype=np.float32)
                cols, logp = self.log_probs(procs, x, t)
                V = self.vocab_size = x.shape[1]
            ranked = self.rank(cols, logp, V)
            beams = self.next_beams(ranked)
            self.finish_eos(ranked, t)
            stop, at_budget = self.stop_test(beams.scores, t + 1)
            self.close(beams, stop, at_budget, t, attn)
            if self.done.all():
                break
            if select is not None and self.done.any():
                rows = self.drop_done(beams, select, state, t, attn)
                procs = procs.select(rows)
                tokens = beams.tokens[rows]
            else:
                self.advance(beams, runner, state, t, attn)
                tokens = beams.tokens
        return self.final_results()

    @property
    def hf(self) -> bool:
        return self.length_penalty == "hf"

    @property
    def keep(self) -> int:
        """The stop rule compares the open beams with the keep-th finished score."""
        return self.K if self.hf else self.n_best

    def penalty(self, length: int) -> float:
        return length_penalty_factor(length, self.length_penalty, self.alpha)

    def log_probs(
        self, procs: _Processors, x: np.ndarray, t: int, rows: Optional[np.ndarray] = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(cols, logp)`` ``[N, k2]``: each row's best ``k2 = min(2K, V)`` tokens (they hold
        every candidate of the source's best 2K) and their float64 log-probabilities, computed
        on the host from the float32 logits ``x [N, V]``. ``rows``: those of the rows only
        (``[len(rows), k2]``; not with the processors that read the sequence)."""
        sequence = None
        row_ids, search_rows = self.row_ids, self.search_rows
        if rows is not None:
            x, procs, row_ids = x[rows], procs.select(rows), np.arange(rows.shape[0])[:, None]
            search_rows = rows if search_rows is None else search_rows[rows]
        elif procs.needs_sequence:
            sequence = np.concatenate([self.start_column, self.history[:, :t]], axis=1)
        k2 = min(2 * self.K, x.shape[1])
        exp_buf = self.scratch.get("exp", x.shape)
        if self.hf:  # transformers: the processors act on the log-probabilities
            raw_max = x.max(axis=1)
            _check_finite_logits(raw_max, t, search_rows)
            log_z = _log_sum_exp(x, raw_max, exp_buf)
            y = np.subtract(
                x,
                np.where(np.isfinite(log_z), log_z, 0.0).astype(np.float32)[:, None],
                out=self.scratch.get("y", x.shape),
            )
            procs.apply(y, t, sequence, x, log_probs=True)
            if self.renormalize:
                z = _log_sum_exp(y, y.max(axis=1), exp_buf)
                y -= np.where(np.isfinite(z), z, 0.0).astype(np.float32)[:, None]
            cols, _ = _row_top_k(y, k2)
            return cols, y[row_ids, cols].astype(np.float64)
        # the processors act on the logits, the softmax renormalises
        y, forced_rows = x, np.zeros(0, dtype=np.int64)
        if procs.active(t):
            y = self.scratch.copy("y", x)
            forced_rows, _ = procs.apply(y, t, sequence, x, log_probs=False)
        cols, row_max = _row_top_k(y, k2)
        _check_finite_logits(row_max, t, search_rows)
        log_z = _log_sum_exp(y, row_max, exp_buf)  # -inf for a row of only -inf
        if forced_rows.size:  # a forced token keeps its log-probability under the raw logits
            f = x[forced_rows]
            log_z[forced_rows] = _log_sum_exp(f, f.max(axis=1))
        values = y[row_ids, cols].astype(np.float64)
        with np.errstate(invalid="ignore"):
            return cols, np.where(np.isneginf(values), -np.inf, values - log_z[:, None])

    def head_usable(self, procs: _Processors, rows: int) -> bool:
        """Whether to use :meth:`head_log_probs`: the processors allow it (they mask or force
        tokens only, and nothing is renormalised after them) and the step is large enough
        (:data:`HEAD_MIN_ENTRIES`; V is known after the first step)."""
        return (
            self.vocab_size > 0
            and rows * self.vocab_size >= HEAD_MIN_ENTRIES["beam"]
            and not procs.needs_sequence
            and not (self.hf and self.renormalize)
        )

    def head_log_probs(
        self, step_top_k: Any, state: Any, tokens: np.ndarray, procs: _Processors, t: int
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """``(cols, logp, V)`` of :meth:`log_probs` from one ``runner.step_top_k`` (see
        :class:`Runner`), which returns each row's best log-probabilities under the unprocessed
        softmax and those of the columns the processors touch: the banned ids, the EOS (masked
        while a row is below its minimum length) and a forced token.

        The masked tokens are dropped from a row's candidates (``2 * beam_size`` + the number of
        banned ids + 1 are asked for, so at least ``2 * beam_size`` stay). Where the softmax
        renormalises after masking (all but ``length_penalty="hf"``), a row's log-probabilities
        are shifted by ``-log(1 - q)``, ``q`` the masked probability, summed in float64; a row
        with ``q > 1/2`` (where the float32 inputs of ``1 - q`` would lose digits) is computed
        on the host from its logits instead. A forced row's only candidate is its token, with
        its log-probability under the raw logits (``hf``: 0), as in :meth:`log_probs`. A step
        with a NaN or +inf logit, or a vocabulary too small for the request, is computed on the
        host (which names the bad row)."""
        K, V = self.K, self.vocab_size
        N = tokens.shape[0]
        k2 = min(2 * K, V)
        columns, forced_rows, forced_tokens = _head_request(procs, t, N, self.eos_id)
        nb = columns.shape[1] - 2
        top, ids, picked, logits = step_top_k(state, tokens, k2 + nb + 1, columns)
        logits = _checked_logits(np.asarray(logits), N, t, procs)
        if top.shape[1] < k2 + nb + 1 or not np.isfinite(top[:, 0]).all():
            cols, logp = self.log_probs(procs, logits, t)
            return cols, logp, logits.shape[1]
        masked = _head_masked(ids, procs, t, self.eos_id)
        order = np.argsort(masked, axis=1, kind="stable")[:, :k2]  # the best k2 not masked
        cols = np.take_along_axis(ids, order, axis=1)
        logp = np.take_along_axis(top, order, axis=1).astype(np.float64)
        exact = np.zeros(0, dtype=np.int64)
        if not self.hf:  # the softmax renormalises over what is not masked
            q = _masked_mass(picked, procs, t)
            with np.errstate(divide="ignore"):
                logp -= np.log1p(-np.minimum(q, 0.5))[:, None]
            is_forced = np.zeros(N, dtype=bool)
            is_forced[forced_rows] = True
            exact = np.flatnonzero((q > 0.5) & ~is_forced)
        if forced_rows.size:
            cols[forced_rows, 0] = forced_tokens
            logp[forced_rows, 0] = 0.0 if self.hf else picked[forced_rows, nb + 1]
            logp[forced_rows, 1:] = -np.inf
        if exact.size:
            cols[exact], logp[exact] = self.log_probs(procs, logits, t, rows=exact)
        return cols, logp, V

    def rank(self, cols: np.ndarray, logp: np.ndarray, V: int) -> _Ranked:
        """Each source's best ``min(2K, K * V)`` candidates; ties by beam, then token id."""
        B, K = self.beam_scores.shape
        N = B * K
        k2 = cols.shape[1]
        cand = (self.beam_scores.reshape(N, 1) + logp).reshape(B, K * k2)
        cand_lp = logp.reshape(B, K * k2)
        flat = (self.beam_of_row[:, None] * V + cols).reshape(B, K * k2)
        n_cand = min(2 * K, K * V)
        order = np.lexsort((flat, -cand), axis=1)[:, :n_cand]  # best first; ties by beam, token
        source_ids = self.source_ids
        s_beam, s_tok = np.divmod(flat[source_ids, order], V)
        return _Ranked(
            cand[source_ids, order], cand_lp[source_ids, order], s_beam, s_tok, s_tok == self.eos_id
        )

    def next_beams(self, ranked: _Ranked) -> _NextBeams:
        """The best K non-EOS candidates of every open source become its next open beams."""
        K, N = self.K, self.identity.shape[0]
        open_rank = np.cumsum(~ranked.is_eos, axis=1) - 1
        take_b, take_c = np.nonzero(~ranked.is_eos & (open_rank < K) & ~self.done[:, None])
        slot = take_b * K + open_rank[take_b, take_c]
        beam_index = self.identity.copy()
        beam_index[slot] = take_b * K + ranked.beam[take_b, take_c]
        new_tokens = np.full(N, self.eos_id, dtype=np.int64)
        new_tokens[slot] = ranked.tok[take_b, take_c]
        new_lp = np.zeros(N)
        new_lp[slot] = ranked.lp[take_b, take_c]
        new_scores = np.full(N, -np.inf)
        new_scores[slot] = ranked.score[take_b, take_c]
        return _NextBeams(beam_index, new_tokens, new_lp, new_scores.reshape(-1, K))

    def finish_eos(self, ranked: _Ranked, t: int) -> None:
        """An EOS candidate within the best K finishes a hypothesis."""
        K = self.K
        length = t + 1  # generated tokens after this step, the candidate included
        within = np.arange(ranked.score.shape[1]) < K
        live = ~self.done[:, None]
        fin_b, fin_c = np.nonzero(ranked.is_eos & within & np.isfinite(ranked.score) & live)
        for b, c in zip(fin_b.tolist(), fin_c.tolist(), strict=True):
            total = float(ranked.score[b, c])
            row = b * K + int(ranked.beam[b, c])
            token_lps = self.history_lp[row, :t].tolist() + [float(ranked.lp[b, c])]
            weights = None
            if self.history_attn is not None:  # the EOS's step has no token, so no row
                weights = self.history_attn[row, :t, : self.src_len[row]].tolist()
            self.finished[b].append(
                Hypothesis(
                    self.history[row, :t].tolist(),
                    total / self.penalty(length),
                    total,
                    True,
                    token_lps,
                    weights,
                )
            )
        keep = self.keep
        for b in set(fin_b.tolist()):
            self.finished[b].sort(key=lambda h: h.score, reverse=True)
            self.n_finished[b] = len(self.finished[b])
            if self.n_finished[b] >= keep:
                self.kth_best[b] = self.finished[b][keep - 1].score

    def stop_test(self, new_scores: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
        """``(stop, at_budget)`` per source: at its budget, or no open beam can win (the rule of
        the length penalty kind), or every continuation is impossible (-inf)."""
        done, alpha = self.done, self.alpha
        at_budget = ~done & (length >= self.max_new)
        best_open = new_scores.max(axis=1)
        open_finite = np.isfinite(best_open)
        enough = ~done & ~at_budget & (self.n_finished >= self.keep)
        if self.hf and self.early_stopping is True:
            stop = enough
        else:
            if self.hf:  # transformers' heuristic: the best open beam at the current or maximum length
                if self.early_stopping == "never" and alpha > 0:
                    horizon = self.max_new
                else:
                    horizon = np.full(done.shape[0], length)
                divisor = horizon.astype(np.float64) ** alpha
            else:  # ours: an upper bound at the maximum length
                divisor = self.max_penalty
            bound = np.where(open_finite, best_open / divisor, -np.inf)
            stop = enough & (bound <= self.kth_best)
        stop |= ~done & ~open_finite & (self.n_finished > 0)
        return stop, at_budget

    def close(
        self,
        beams: _NextBeams,
        stop: np.ndarray,
        at_budget: np.ndarray,
        t: int,
        attn: Optional[np.ndarray] = None,
    ) -> None:
        """Ends the sources that stop: at the budget their open beams join the candidates as
        unfinished hypotheses; their results are set and their rows emptied (in ``beams``)."""
        K, length = self.K, t + 1
        history, history_lp = self.history, self.history_lp
        for b in np.flatnonzero(at_budget).tolist():
            for k in np.flatnonzero(np.isfinite(beams.scores[b])).tolist():
                r = b * K + k
                toks = history[beams.index[r], :t].tolist() + [int(beams.tokens[r])]
                token_lps = history_lp[beams.index[r], :t].tolist() + [float(beams.lp[r])]
                s = float(beams.scores[b, k])
                weights = None
                if attn is not None:  # the new token's row: this step's, of the beam it extends
                    src = self.src_len[r]
                    weights = self.history_attn[beams.index[r], :t, :src].tolist()
                    weights.append(attn[beams.index[r], :src].tolist())
                self.finished[b].append(
                    Hypothesis(toks, s / self.penalty(length), s, False, token_lps, weights)
                )
        for b in np.flatnonzero(stop | at_budget).tolist():
            self.finished[b].sort(key=lambda h: h.score, reverse=True)
            # no hypothesis at all: only reachable if every candidate was -inf throughout
            self.results[int(self.source_of[b])] = self.finished[b][: self.n_best] or [_no_hypothesis()]
            rows = slice(b * K, (b + 1) * K)
            beams.scores[b, :] = -np.inf
            beams.index[rows] = self.identity[rows]
            beams.tokens[rows] = self.eos_id
            beams.lp[rows] = 0.0
            self.done[b] = True

    def advance(
        self, beams: _NextBeams, runner: Runner, state: Any, t: int, attn: Optional[np.ndarray] = None
    ) -> None:
        """The open beams become ``beams``: histories (and the runner's state) reordered."""
        self.beam_scores = beams.scores
        if not np.array_equal(beams.index, self.identity):
            self.history[:, :t] = self.history[beams.index, :t]
            self.history_lp[:, :t] = self.history_lp[beams.index, :t]
            if attn is not None:
                self.history_attn[:, :t] = self.history_attn[beams.index, :t]
            runner.reorder(state, beams.index)
        self.history[:, t] = beams.tokens
        self.history_lp[:, t] = beams.lp
        if attn is not None:  # each new token's row: the step's attention of the beam it extends
            self.history_attn[:, t] = attn[beams.index]

    def drop_done(
        self, beams: _NextBeams, select: Any, state: Any, t: int, attn: Optional[np.ndarray] = None
    ) -> np.ndarray:
        """:meth:`advance` for the sources that are not done, whose rows alone stay in the
        runner's state: one ``select`` moves the open beams (the beam reorder) and drops the
        rows of the sources that are done. Returns the rows of ``beams`` that stay."""
        K = self.K
        keep = np.flatnonzero(~self.done)
        rows = (keep[:, None] * K + np.arange(K)).reshape(-1)
        index = beams.index[rows]
        select(state, index)
        self.history = self.history[index]
        self.history_lp = self.history_lp[index]
        self.history[:, t] = beams.tokens[rows]
        self.history_lp[:, t] = beams.lp[rows]
        if attn is not None:  # as in advance, for the rows that stay
            self.history_attn = self.history_attn[index]
            self.history_attn[:, t] = attn[index]
            self.src_len = self.src_len[index]
        self.beam_scores = beams.scores[keep]
        for name in ("max_new", "max_penalty", "n_finished", "kth_best", "done", "source_of"):
            setattr(self, name, getattr(self, name)[keep])
        self.finished = [self.finished[b] for b in keep.tolist()]
        self.search_rows = rows if self.search_rows is None else self.search_rows[rows]
        N = rows.shape[0]
        self.identity = np.arange(N, dtype=np.int64)
        self.beam_of_row = self.identity % K
        self.row_ids = self.identity[:, None]
        self.start_column = self.start_column[:N]
        self.source_ids = np.arange(keep.shape[0])[:, None]
        return rows

    def final_results(self) -> list[list[Hypothesis]]:
        for b, g in enumerate(self.source_of.tolist()):
            if not self.results[g]:  # only reachable if every candidate was -inf throughout
                self.finished[b].sort(key=lambda h: h.score, reverse=True)
                self.results[g] = self.finished[b][: self.n_best] or [_no_hypothesis()]
        return self.results


# ------------------------------------------------------------------------------------------
# one entry point, and forced decoding
# ------------------------------------------------------------------------------------------


def generate(
    runner: Runner,
    input_ids: np.ndarray,
    src_lengths: np.ndarray,
    *,
    bos_id: int,
    eos_id: int,
    max_new_tokens: IntOrArray,
    beam_size: int = 1,
    num_hypotheses: int = 1,
    length_penalty: str = "gnmt",
    alpha: float = 0.6,
    early_stopping: Union[bool, str, None] = None,
    renormalize_logits: bool = False,
    sampling_topk: int = 1,
    sampling_topp: float = 1.0,
    sampling_temperature: float = 1.0,
    seed: Optional[int] = None,
    return_attention: bool = False,
    **options: Any,
) -> list[list[Hypothesis]]:
    """For every source its ``num_hypotheses`` hypotheses, best first, whatever the search:
    beam search (:func:`beam_search` with ``n_best = num_hypotheses``) when ``beam_size > 1``,
    else greedy decoding or sampling (:func:`greedy_decode` with ``return_scores``).

    ``options``: the processor options both searches take (``min_new_tokens``, ``cache_len``,
    ``decoder_start_id``, ``target_prefix``, ``banned_ids``, ``repetition_penalty``,
    ``no_repeat_ngram_size``, ``force_eos_at_budget``). Sampling with ``beam_size > 1`` is an
    error (beam sampling is not defined here). The beam-search options (``length_penalty``,
    ``alpha``, ``early_stopping``, ``renormalize_logits``) do not apply to greedy decoding, whose
    hypotheses have no length penalty (its tokens are transformers' greedy tokens either way).
    """
    if not isinstance(beam_size, (int, np.integer)) or isinstance(beam_size, bool) or beam_size < 1:
        raise ValueError(f"beam_size must be a positive int, got {beam_size!r}")
    sampling = sampling_topk != 1 or sampling_topp != 1.0 or sampling_temperature != 1.0
    if beam_size > 1:
        if sampling:
            raise ValueError(
                f"random sampling (sampling_topk / sampling_topp / sampling_temperature) needs beam_size = 1, "
                f"got beam_size = {beam_size}"
            )
        if seed is not None:
            raise ValueError("seed applies to random sampling, which needs beam_size = 1")
        return beam_search(
            runner,
            input_ids,
            src_lengths,
            bos_id=bos_id,
            eos_id=eos_id,
            beam_size=beam_size,
            n_best=num_hypotheses,
            max_new_tokens=max_new_tokens,
            length_penalty=length_penalty,
            alpha=alpha,
            early_stopping=early_stopping,
            renormalize_logits=renormalize_logits,
            return_attention=return_attention,
            **options,
        )
    if length_penalty not in LENGTH_PENALTIES:
        raise ValueError(f"length_penalty must be one of {LENGTH_PENALTIES}, got {length_penalty!r}")
    _check_real("alpha", alpha)
    return greedy_decode(
        runner,
        input_ids,
        src_lengths,
        bos_id=bos_id,
        eos_id=eos_id,
        max_new_tokens=max_new_tokens,
        num_hypotheses=num_hypotheses,
        sampling_topk=sampling_topk,
        sampling_topp=sampling_topp,
        sampling_temperature=sampling_temperature,
        seed=seed,
        return_scores=True,
        return_attention=return_attention,
        **options,
    )


def score(
    runner: Runner,
    input_ids: np.ndarray,
    src_lengths: np.ndarray,
    targets: Sequence[Sequence[int]],
    *,
    bos_id: int,
    eos_id: int,
    decoder_start_id: Optional[int] = None,
    include_eos: bool = True,
) -> list[Hypothesis]:
    """Forced decoding: the log-probability the model gives each source's target.

    ``targets``: one list of target token ids per source (ragged, without start token and EOS;
    empty allowed). Returns one :class:`Hypothesis` per source: its ``tokens``, the
    ``token_log_probs`` of each token under the model's raw distribution (no processors), then
    the EOS's when ``include_eos``, and their sum as ``log_prob`` and ``score`` (CTranslate2's
    ``score_batch``). One batched step per target position; rows whose target ended are fed EOS.
    """
    _check_token_id("bos_id", bos_id)
    eos_id = _check_token_id("eos_id", eos_id)
    start = _check_token_id(
        "decoder_start_id" if decoder_start_id is not None else "bos_id",
        bos_id if decoder_start_id is None else decoder_start_id,
    )
    ids, lengths = check_sources(input_ids, src_lengths)
    B = ids.shape[0]
    if isinstance(targets, (str, bytes)) or not hasattr(targets, "__len__"):
        raise TypeError(f"targets must be a list holding one list of token ids per source, got {targets!r}")
    if len(targets) != B:
        raise ValueError(f"targets must hold one token list per source ({B}), got {len(targets)}")
    rows = [_check_int_list(f"targets[{b}]", t) for b, t in enumerate(targets)]
    n_tok = np.array([len(r) for r in rows], dtype=np.int64)
    wanted = n_tok + (1 if include_eos else 0)  # scored positions per row
    steps = int(wanted.max())
    token_lps: list[list[float]] = [[] for _ in range(B)]
    if steps > 0:
        table = np.full((B, steps), eos_id, dtype=np.int64)  # the token scored at each step
        for b, r in enumerate(rows):
            table[b, : len(r)] = r
        state = runner.encode(ids, lengths, steps, 1)
        fed = np.full(B, start, dtype=np.int64)
        all_rows = np.arange(B)
        for t in range(steps):
            logits = np.asarray(runner.step(state, fed))
            if logits.ndim != 2 or logits.shape[0] != B:
                raise RuntimeError(f"runner.step returned logits of shape {logits.shape}, expected ({B}, V)")
            if t == 0:
                for b, r in enumerate(rows):
                    _check_in_vocab(f"targets[{b}]", r, logits.shape[1])
            x = logits if logits.dtype == np.float32 else logits.astype(np.float32)
            row_max = x.max(axis=1)
            _check_finite_logits(row_max, t)
            lp = x[all_rows, table[:, t]].astype(np.float64) - _log_sum_exp(x, row_max)
            for b in np.flatnonzero(t < wanted).tolist():
                token_lps[b].append(float(lp[b]))
            fed = table[:, t]
    out = []
    for b in range(B):
        total = float(sum(token_lps[b]))
        out.append(Hypothesis(rows[b].tolist(), total, total, True, token_lps[b]))
    return out


# ------------------------------------------------------------------------------------------
# search as runner methods
# ------------------------------------------------------------------------------------------


class SearchMethods:
    """``runner.greedy(...)``, ``runner.beam_search(...)``, ``runner.generate(...)`` and
    ``runner.score(...)`` for any runner class that mixes this in.

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

    def greedy(self, input_ids, src_lengths, *, max_new_tokens: IntOrArray, **kwargs):
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

    def generate(
        self, input_ids, src_lengths, *, max_new_tokens: IntOrArray, **kwargs
    ) -> list[list[Hypothesis]]:
        """:func:`generate` with this runner (keyword arguments as there)."""
        return generate(
            self, input_ids, src_lengths, max_new_tokens=max_new_tokens, **self._search_kwargs(kwargs)
        )

    def score(self, input_ids, src_lengths, targets, **kwargs) -> list[Hypothesis]:
        """:func:`score` (forced decoding) with this runner (keyword arguments as there)."""
        return score(self, input_ids, src_lengths, targets, **self._search_kwargs(kwargs))
