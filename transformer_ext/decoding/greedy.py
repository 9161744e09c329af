"""Greedy decoding and random sampling: :func:`greedy_decode` (and :func:`greedy_advance`, the
bookkeeping of one step for loops of other runners).

Options of :func:`greedy_decode` (the package docstring describes the processors):

* ``decoder_start_id``: the first token fed (default ``bos_id``).
* ``target_prefix``: one list of token ids per source (ragged, possibly empty), forced as
  the first generated tokens; no EOS in it, at most the source's ``max_decoding_length``.
* ``banned_ids``: tokens never generated (transformers' single-token ``bad_words_ids``).
* ``repetition_penalty`` (> 0, 1 = off), ``no_repeat_ngram_size`` (0 = off),
  ``min_decoding_length``, ``force_eos_at_budget`` (transformers' ``forced_eos_token_id``).
* Sampling: ``sampling_topk`` (1: greedy, the default; 0: the whole vocabulary; k: the k
  most likely tokens), ``sampling_topp`` in (0, 1], ``sampling_temperature`` > 0 and
  ``seed`` (None: fresh entropy) as in :class:`_Sampler`: each source draws from a stream of
  its own, picked by the seed and its index (:meth:`_Sampler.streams_for`; ``source_index``,
  int64 ``[B]``: each source's index in the caller's whole input, default ``0 .. B-1``), so its
  samples do not depend on the batch it is decoded in; ``num_hypotheses`` independent
  samples per source (several need sampling: greedy has one hypothesis). The scores are
  log-probabilities of the processed distribution before temperature, top-k and top-p.
* ``return_attention``: :class:`Hypothesis` lists whose ``attention`` holds each token's
  cross-attention (the runner must have ``step_with_attention``: :func:`check_attention_runner`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from .numerics import (
    _check_finite_logits,
    _checked_logits,
    _log_sum_exp,
    _Scratch,
    _step_attention,
)
from .options import (
    _check_cache_len,
    _check_num_hypotheses,
    _check_options,
    _check_search_inputs,
    _per_row,
)
from .processors import (
    HEAD_MIN_ENTRIES,
    _head_masked,
    _head_request,
    _masked_mass,
    _Processors,
)
from .protocol import (
    Hypothesis,
    IntOrArray,
    Runner,
    _selector,
    check_attention_runner,
)
from .renamed import renamed_keywords
from .sampling import (
    _check_sampling,
    _Sampler,
)

# Greedy search drops its finished rows from the runner's state once they are at least a quarter
# of the rows it holds, not at every step where one finishes: a drop copies every open row's
# caches and cross-attention K/V, which for a small model costs about as much as a step. On the
# bundled demo model (5,000 lines, token batches of 4,096, 1 thread, a 2-core Xeon) a quarter
# took 7.0 CPU seconds, an eighth 7.1, a half 7.3 and every finish 7.4 (medians of 6 rounds,
# benchmarks/probes/ab_drop_finished.py, results/ab_drop_finished_xeon.json). Larger models lose less
# to the copy but also gain less from the dropped rows: their steps are mostly weight reads.
GREEDY_DROP_DIVISOR = 4


@renamed_keywords()
def greedy_decode(
    runner: Runner,
    input_ids: np.ndarray,
    src_lengths: np.ndarray,
    *,
    bos_id: int,
    eos_id: int,
    max_decoding_length: IntOrArray,
    min_decoding_length: IntOrArray = 0,
    cache_len: int | None = None,
    decoder_start_id: int | None = None,
    target_prefix: Sequence[Sequence[int]] | None = None,
    banned_ids: Sequence[int] = (),
    repetition_penalty: float = 1.0,
    no_repeat_ngram_size: int = 0,
    force_eos_at_budget: bool = False,
    sampling_topk: int = 1,
    sampling_topp: float = 1.0,
    sampling_temperature: float = 1.0,
    seed: int | None = None,
    num_hypotheses: int = 1,
    return_scores: bool = False,
    remove_finished: bool = True,
    return_attention: bool = False,
    source_index: IntOrArray | None = None,
) -> list[list[int]] | list[list[Hypothesis]]:
    """Batched greedy decoding (or random sampling); each row stops at its EOS or its budget.

    Returns the token ids of each source (``list[list[int]]``); with ``return_scores`` or
    ``num_hypotheses > 1``, for each source a list of :class:`Hypothesis` (score = log_prob, the
    sum of the token log-probabilities, and ``token_log_probs``), best score first.

    The options are described in this module's docstring.

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
    ids, lengths, max_decoding_length, min_decoding_length, prefixes = _check_search_inputs(
        input_ids, src_lengths, max_decoding_length, min_decoding_length, target_prefix, eos_id
    )
    B = ids.shape[0]
    if sampler is not None:
        index = np.arange(B) if source_index is None else _per_row("source_index", source_index, B)
        sampler = sampler.streams_for(index.tolist(), n, [sampler.seed] * B)
    if return_attention:
        check_attention_runner(runner)
    with_scores = bool(return_scores) or n > 1 or bool(return_attention)
    steps = int(max_decoding_length.max())
    if steps == 0:
        empty = [] if return_attention else None
        hyps = [[Hypothesis([], 0.0, 0.0, False, [], empty) for _ in range(n)] for _ in range(B)]
        return hyps if with_scores else [[] for _ in range(B)]
    group = _GreedyGroup(
        _Processors(
            options,
            eos_id=eos_id,
            rows_per_source=n,
            min_decoding_length=min_decoding_length,
            max_decoding_length=max_decoding_length,
            prefixes=prefixes,
        ),
        sampler,
        n=n,
        row_budget=np.repeat(max_decoding_length, n),
        src_len=np.repeat(lengths, n),
        start_id=options.start_id,
        eos_id=eos_id,
        with_scores=with_scores,
        attention=bool(return_attention),
        drop=select is not None,
    )
    results = _run_alone(
        runner,
        group,
        ids,
        lengths,
        _check_cache_len(cache_len, steps),
        n,
        remove_finished,
    )
    return results if with_scores else [hyps[0].tokens for hyps in results]


def _run_alone(
    runner: Runner,
    group: Any,
    ids: np.ndarray,
    lengths: np.ndarray,
    cache_len: int,
    rows_per_source: int,
    remove_finished: bool,
) -> list[list[Hypothesis]]:
    """The results of one group of sources searched by itself: a loop over a
    :class:`~transformer_ext.decoding.stepwise.SearchState` holding it alone (the search head
    allowed, as a fixed batch uses it)."""
    from .stepwise import SearchState

    state = SearchState(
        runner,
        bos_id=group.start_id,
        eos_id=group.eos_id,
        remove_finished=remove_finished,
        batch_invariant=False,
    )
    state.admit_group(group, ids, lengths, cache_len, rows_per_source, keys=range(ids.shape[0]))
    results: dict[Any, list[Hypothesis]] = {}
    while not state.empty:
        results.update(state.step())
    return [results[b] for b in range(ids.shape[0])]


class _GreedyGroup:
    """The greedy decoding (or sampling) of a batch of sources inside a search state: ``n`` rows
    per source (independent samples), a source's rows consecutive, ``N`` rows in all.

    Each step's bookkeeping is vectorised over the rows: an open row at step ``t`` holds ``t``
    tokens, so its token goes to column ``t`` of ``generated`` and its log-probability to
    column ``t`` of ``chosen_lp`` (its attention to ``attn_table``). With ``drop`` the rows that
    finished leave the runner's state once they are a quarter of its rows
    (:data:`GREEDY_DROP_DIVISOR`): ``active`` maps the open rows to the group's rows, and
    ``open_budget`` / ``sequence`` / ``procs`` / ``tokens`` hold the runner's rows only. A
    source's hypotheses are handed back (:meth:`newly_finished`) at the step its last row finishes.
    """

    def __init__(
        self,
        procs: _Processors,
        sampler: _Sampler | None,
        *,
        n: int,
        row_budget: np.ndarray,
        src_len: np.ndarray,
        start_id: int,
        eos_id: int,
        with_scores: bool,
        attention: bool,
        drop: bool,
    ):
        N = row_budget.shape[0]
        steps = int(row_budget.max())
        self.procs, self.sampler, self.n, self.N = procs, sampler, n, N
        self.row_budget, self.src_len = row_budget, src_len
        self.start_id, self.eos_id, self.steps = start_id, eos_id, steps
        self.with_scores, self.want_attention, self.drop = with_scores, attention, drop
        self.tokens = np.full(N, start_id, dtype=np.int64)
        self.sequence = np.full((N, steps + 1), eos_id, dtype=np.int64)  # fed tokens, start token first
        self.sequence[:, 0] = start_id
        self.generated = np.zeros((N, steps), dtype=np.int64)
        self.n_tokens = np.zeros(N, dtype=np.int64)  # tokens of each row
        self.n_scored = np.zeros(N, dtype=np.int64)  # log-probabilities of each row (its EOS's included)
        self.chosen_lp = np.zeros((N, steps)) if with_scores else None
        self.attn_table: np.ndarray | None = None  # [N, steps, S] with ``attention``
        self.finished = row_budget == 0
        self.row_done = self.finished.copy()  # over the group's N rows
        self.reported = np.zeros(N // n, dtype=bool)  # sources handed back (or cancelled)
        self.active = np.arange(N)
        self.open_budget = row_budget
        self.scratch = _Scratch()
        self.t = 0
        self.vocab_size = 0
        self.complete = False
        self.keys: list[Any] = []

    @property
    def rows(self) -> int:
        """The group's rows in the runner's state."""
        return int(self.active.shape[0])

    @property
    def num_sources(self) -> int:
        return int(np.count_nonzero(~self.reported))

    def _head_usable(self, runner: Runner) -> Any:
        if (
            self.sampler is not None
            or self.want_attention
            or not self.with_scores
            or self.procs.needs_sequence
        ):
            return None
        step_top_k = getattr(runner, "step_top_k", None)
        if step_top_k is None or self.rows * self.vocab_size < HEAD_MIN_ENTRIES["greedy_scores"]:
            return None  # step 0 runs on the host: it checks the ids against the vocabulary, and learns V
        return step_top_k

    def step_alone(self, runner: Runner, state: Any, use_head: bool) -> np.ndarray | None:
        """One step of the runner for this group's rows only (through ``step_top_k`` where it
        pays, with ``use_head``); returns what :meth:`consume` returns."""
        step_top_k = self._head_usable(runner) if use_head else None
        if step_top_k is not None:
            next_tokens, lp, x = _greedy_head(step_top_k, state, self.tokens, self.procs, self.t, self.eos_id)
            return self._advance(x, None, next_tokens, lp)
        x, attn = _step_attention(runner, state, self.tokens, self.t, self.procs, self.want_attention)
        return self._advance(x, attn, None, None)

    def consume(self, logits: np.ndarray, attention: np.ndarray | None) -> np.ndarray | None:
        """The group's rows of a step's logits (and attention): chooses the tokens. Returns the
        group's rows (indices into its current rows) the runner's state keeps for the next
        step, or None to keep them all as they are."""
        x = _checked_logits(np.asarray(logits), self.rows, self.t, self.procs)
        return self._advance(x, attention, None, None)

    def _advance(
        self,
        x: np.ndarray,
        attn: np.ndarray | None,
        next_tokens: np.ndarray | None,
        lp: np.ndarray | None,
    ) -> np.ndarray | None:
        t, N, active = self.t, self.N, self.active
        self.vocab_size = x.shape[1]
        if next_tokens is None:  # the host search on the logits
            dropped = None if active.shape[0] == N else (active, N)
            y, next_tokens, forced_rows = _greedy_choose(
                self.procs,
                self.sampler,
                x,
                t,
                self.sequence[:, : t + 1],
                dropped,
                self.scratch,
            )
            if self.chosen_lp is not None:
                lp = _chosen_log_probs(y, x, next_tokens, forced_rows, self.scratch)
        is_open = ~self.finished
        rows = active[is_open]
        if self.chosen_lp is not None:
            self.chosen_lp[rows, t] = lp[is_open]
            self.n_scored[rows] = t + 1
        if attn is not None:
            if self.attn_table is None:  # the source length is known at the first step
                self.attn_table = np.zeros((N, self.steps, attn.shape[1]), dtype=np.float32)
            self.attn_table[rows, t] = attn[is_open]
        appended = is_open & (next_tokens != self.eos_id)
        self.generated[active[appended], t] = next_tokens[appended]
        self.n_tokens[active[appended]] = t + 1
        finished = self.finished | (is_open & ~appended) | (appended & (t + 1 >= self.open_budget))
        self.finished = finished
        self.row_done[active[finished]] = True
        self.tokens = np.where(finished, self.eos_id, next_tokens).astype(np.int64)
        self.sequence[:, t + 1] = self.tokens
        self.t = t + 1
        if finished.all() or self.t >= self.steps:
            self.complete = True
            return None
        if self.drop and _drop_now(finished):
            keep = np.flatnonzero(~finished)
            self._keep(keep)
            return keep
        return None

    def _keep(self, keep: np.ndarray) -> None:
        self.active, self.finished, self.open_budget = (
            self.active[keep],
            self.finished[keep],
            self.open_budget[keep],
        )
        self.tokens, self.sequence, self.procs = (
            self.tokens[keep],
            self.sequence[keep],
            self.procs.select(keep),
        )

    def newly_finished(self) -> list[tuple[int, list[Hypothesis]]]:
        """``(source, hypotheses)`` for each source whose rows have all finished since the last call."""
        n = self.n
        ready = self.row_done.reshape(-1, n).all(axis=1) & ~self.reported
        out = []
        for b in np.flatnonzero(ready).tolist():
            self.reported[b] = True
            out.append((b, self._hypotheses(b)))
        return out

    def _hypotheses(self, b: int) -> list[Hypothesis]:
        hyps = []
        for r in range(b * self.n, (b + 1) * self.n):
            tokens = self.generated[r, : self.n_tokens[r]].tolist()
            if not self.with_scores:
                hyps.append(Hypothesis(tokens, None, None, len(tokens) < int(self.row_budget[r])))
                continue
            lps = self.chosen_lp[r, : self.n_scored[r]].tolist()
            total = float(sum(lps))
            done = len(tokens) < int(self.row_budget[r])  # shorter than its budget: it stopped at an EOS
            weights = None
            if self.want_attention:
                table = [] if self.attn_table is None else list(self.attn_table[r, : self.n_tokens[r]])
                weights = _attention_rows(table, tokens, self.src_len[r])
            hyps.append(Hypothesis(tokens, total, total, done, lps, weights))
        if self.with_scores:
            hyps.sort(key=lambda h: h.score, reverse=True)
        return hyps

    def cancel(self, b: int) -> None:
        """Source ``b`` leaves without a result: its rows count as finished."""
        self.reported[b] = True
        rows = np.arange(b * self.n, (b + 1) * self.n)
        self.row_done[rows] = True
        mine = np.isin(self.active, rows)
        self.finished = self.finished | mine
        self.tokens = np.where(self.finished, self.eos_id, self.tokens).astype(np.int64)
        if self.finished.all():
            self.complete = True

    def partial(self, b: int) -> list[int]:
        """The tokens generated so far by source ``b``'s first row (its best open hypothesis:
        greedy search has one; sampling's rows are independent)."""
        r = b * self.n
        return self.generated[r, : self.n_tokens[r]].tolist()


def _greedy_head(
    step_top_k: Any,
    state: Any,
    tokens: np.ndarray,
    procs: _Processors,
    t: int,
    eos_id: int,
) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray]:
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


def _drop_now(finished: np.ndarray) -> bool:
    """Whether greedy search drops its finished rows now: once they are at least
    ``1 / GREEDY_DROP_DIVISOR`` of the rows the runner holds (with that many rows or fewer, one).

    The divisor is read from the package (``transformer_ext.decoding.GREEDY_DROP_DIVISOR``) at
    every call, so that setting it there tunes the search (benchmarks/probes/ab_drop_finished.py)."""
    divisor = getattr(sys.modules.get(__package__), "GREEDY_DROP_DIVISOR", GREEDY_DROP_DIVISOR)
    n = int(np.count_nonzero(finished))
    return n > 0 and n * divisor >= finished.shape[0]


def _greedy_choose(
    procs: _Processors,
    sampler: _Sampler | None,
    x: np.ndarray,
    t: int,
    sequence: np.ndarray,
    dropped: tuple[np.ndarray, int] | None = None,
    scratch: _Scratch | None = None,
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
            y[np.arange(y.shape[0]), next_tokens],
            t,
            None if dropped is None else dropped[0],
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


def _chosen_log_probs(
    y: np.ndarray,
    raw: np.ndarray,
    chosen: np.ndarray,
    forced_rows: np.ndarray,
    scratch: _Scratch | None = None,
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


@renamed_keywords()
def greedy_advance(
    outputs: list[list[int]],
    finished: np.ndarray,
    next_tokens: np.ndarray,
    *,
    eos_id: int,
    max_decoding_length: np.ndarray,
) -> np.ndarray:
    """One greedy step's bookkeeping, in place: every open row ``b`` either finishes (its token is
    the EOS, which is not appended) or appends its token to ``outputs[b]`` and finishes when it
    holds ``max_decoding_length[b]`` tokens. ``finished`` (bool ``[B]``) is updated.

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
            if len(outputs[b]) >= max_decoding_length[b]:
                finished[b] = True
    return np.where(finished, eos_id, next_tokens).astype(np.int64)
