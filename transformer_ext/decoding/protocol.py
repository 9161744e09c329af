"""The runner contract of the searches and the checks every runner makes on its arguments.

:class:`Runner` is what a backend (eager PyTorch, ONNX Runtime, TensorRT, Triton, a test double)
implements to be driven by the searches; :class:`Hypothesis` is one search result. The checks
(:func:`check_encode_args`, :func:`check_sources`, :func:`check_step_tokens`,
:func:`check_beam_index`, :func:`check_select_index`) live here once, so that every backend
refuses the same input with the same message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence, Union, runtime_checkable

import numpy as np

IntOrArray = Union[int, Sequence[int], np.ndarray]


@runtime_checkable
class Runner(Protocol):
    """What a backend implements to be driven by :func:`greedy_decode` / :func:`beam_search`."""

    def encode(
        self, input_ids: np.ndarray, src_lengths: np.ndarray, cache_len: int, beam_size: int = 1
    ) -> Any:
        """Encode ``input_ids`` int64 ``[B, S]`` (right-padded) with ``src_lengths`` int64 ``[B]``.

        Returns an opaque state holding N = B * beam_size rows: every source row repeated
        ``beam_size`` times (source b's beams are rows ``b*beam_size .. b*beam_size+beam_size-1``),
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
    ``finished``: False for a hypothesis cut off at ``max_decoding_length`` without EOS.
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
    beam_size: Any,
    *,
    src_vocab_size: int | None = None,
    max_positions: int | None = None,
) -> tuple[np.ndarray, np.ndarray, int, int]:
    """The checks every runner's ``encode`` makes: the sources (:func:`check_sources`, source
    length at most ``max_positions``), ``cache_len`` a positive int of at most ``max_positions``
    (the model's ``max_len``: positions past it have no positional encoding) and ``beam_size``
    a positive int. Returns ``(input_ids, src_lengths, cache_len, beam_size)``; limits of a
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
    return ids, lengths, cache_len, _check_positive_int("beam_size", beam_size)


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
