"""Greedy decoding and random sampling: :func:`greedy_decode` (and :func:`greedy_advance`, the
bookkeeping of one step for loops of other runners).
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence, Union

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
from .sampling import (
    _check_sampling,
    _Sampler,
)

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
    ``1 / GREEDY_DROP_DIVISOR`` of the rows the runner holds (with that many rows or fewer, one).

    The divisor is read from the package (``transformer_ext.decoding.GREEDY_DROP_DIVISOR``) at
    every call, so that setting it there tunes the search (benchmarks/ab_drop_finished.py)."""
    divisor = getattr(sys.modules.get(__package__), "GREEDY_DROP_DIVISOR", GREEDY_DROP_DIVISOR)
    n = int(np.count_nonzero(finished))
    return n > 0 and n * divisor >= finished.shape[0]


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
