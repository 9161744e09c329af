"""Beam search: :func:`beam_search`, its state over a batch of sources (``_BeamState``) and the
step-wise group a :class:`~transformer_ext.decoding.stepwise.SearchState` drives (``_BeamGroup``).

``length_penalty_type="hf"`` is transformers' ``generate()`` beam search (its ``num_beams`` is
``beam_size``, its ``length_penalty`` the exponent ``length_penalty``, its ``early_stopping``
``early_stopping``), for imported models to give the tokens transformers gives: the score is
``log_prob / length ** length_penalty`` (any finite ``length_penalty``); the
processors act on the float32 log-probabilities after the softmax (nothing renormalised
unless ``renormalize_logits``, transformers' option of that name; the repetition penalty
multiplies a seen token's log-probability; a forced token scores 0); the n-best come from
the best ``beam_size`` finished hypotheses, and a source stops by ``early_stopping``:
``True`` once ``beam_size`` hypotheses finished; ``False`` (the default) once, in addition,
the best open beam's log-probability divided by ``L ** length_penalty`` is at most the
``beam_size``-th finished score, ``L`` the number of tokens generated so far; ``"never"``
the same with ``L`` the maximum length when ``length_penalty > 0``. transformers' own
``max_length`` counts the decoder start token (``max_decoding_length = max_length - 1``), as does its
``min_length`` (``min_decoding_length = min_length - 1``); ``forced_bos_token_id`` is a
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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence, Union

import numpy as np

from .numerics import (
    _check_finite_logits,
    _checked_logits,
    _log_sum_exp,
    _row_top_k,
    _Scratch,
    _step_attention,
)
from .options import (
    _check_beam_options,
    _check_cache_len,
    _check_options,
    _check_search_inputs,
    length_penalty_factor,
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


@renamed_keywords()
def beam_search(
    runner: Runner,
    input_ids: np.ndarray,
    src_lengths: np.ndarray,
    *,
    bos_id: int,
    eos_id: int,
    beam_size: int,
    num_hypotheses: int = 1,
    max_decoding_length: IntOrArray,
    min_decoding_length: IntOrArray = 0,
    length_penalty_type: str = "gnmt",
    length_penalty: float = 0.6,
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
    """Batched beam search -> for every source its ``num_hypotheses`` hypotheses, best score first.

    Each step expands all ``beam_size`` open beams of a source, ranks the ``beam_size * V``
    candidates by cumulative log-probability and looks at the best ``2 * beam_size``: an EOS
    candidate ranked within the first ``beam_size`` becomes a finished hypothesis (scored with
    the length penalty), and the best non-EOS candidates become the next open beams. A source
    stops when it has ``num_hypotheses`` finished hypotheses and no open beam can beat the
    ``num_hypotheses``-th of them even at its maximum length (log-probabilities only fall as a
    hypothesis grows, and the penalty divisor is largest at the maximum length), or when it
    reaches ``max_decoding_length``; then its open beams join the candidates as unfinished hypotheses.
    Candidates of equal score are ranked by beam, then token id.

    ``length_penalty_type``: one of :data:`LENGTH_PENALTIES` (see :func:`length_penalty_factor`),
    with exponent ``length_penalty``. The logit-processor options (``decoder_start_id``,
    ``target_prefix``, ``banned_ids``, ``repetition_penalty``, ``no_repeat_ngram_size``,
    ``min_decoding_length``, ``force_eos_at_budget``) are those of :func:`greedy_decode`.
    ``return_attention``: each hypothesis carries the cross-attention of its tokens
    (:class:`Hypothesis`), reordered with the beams.

    ``length_penalty_type="hf"``: transformers' rules, and the vectorised step: see the module docstring.

    ``remove_finished`` (default True): when the runner has ``select`` (see :class:`Runner`),
    the rows of the sources that stopped are dropped from the runner's state (with the beam
    reorder of the same step: one gather), so later steps run on the open sources only;
    otherwise they are fed EOS to the end. The results are the same either way.
    """
    select = _selector(runner, remove_finished)
    length_penalty, early_stopping = _check_beam_options(
        length_penalty_type, beam_size, num_hypotheses, length_penalty, early_stopping, renormalize_logits
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
    ids, lengths, max_decoding_length, min_decoding_length, prefixes = _check_search_inputs(
        input_ids, src_lengths, max_decoding_length, min_decoding_length, target_prefix, eos_id
    )
    if return_attention:
        check_attention_runner(runner)
    B, K = ids.shape[0], int(beam_size)
    steps = int(max_decoding_length.max())
    if steps == 0:
        empty = [] if return_attention else None
        return [[Hypothesis([], 0.0, 0.0, False, [], empty)] for _ in range(B)]
    procs = _Processors(
        options,
        eos_id=eos_id,
        rows_per_source=K,
        min_decoding_length=min_decoding_length,
        max_decoding_length=max_decoding_length,
        prefixes=prefixes,
    )
    s = _BeamState.start(
        K=K,
        num_hypotheses=int(num_hypotheses),
        eos_id=eos_id,
        start_id=options.start_id,
        length_penalty_type=length_penalty_type,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        renormalize=bool(renormalize_logits),
        max_decoding_length=max_decoding_length,
        steps=steps,
    )
    if return_attention:
        s.src_len = np.repeat(lengths, K)
    group = _BeamGroup(s, procs, start_id=options.start_id, steps=steps, drop=select is not None)
    from .greedy import _run_alone  # noqa: PLC0415 - one loop for both searches

    return _run_alone(runner, group, ids, lengths, _check_cache_len(cache_len, steps), K, remove_finished)


class _Recorder:
    """Stands in for the runner in :meth:`_BeamState.advance` / :meth:`_BeamState.drop_done`:
    keeps the row index of the reorder or select they ask for (the search state makes the call)."""

    def __init__(self) -> None:
        self.index: Optional[np.ndarray] = None

    def reorder(self, state: Any, index: np.ndarray) -> None:
        self.index = np.asarray(index, dtype=np.int64)

    select = reorder


class _BeamGroup:
    """The beam search of a batch of sources inside a search state (``_BeamState`` and the
    processors of its rows), one step at a time: the group interface of
    :class:`~transformer_ext.decoding.stepwise.SearchState` (as :class:`_GreedyGroup`'s)."""

    want_attention: bool

    def __init__(self, s: _BeamState, procs: _Processors, *, start_id: int, steps: int, drop: bool):
        self.s, self.procs = s, procs
        self.start_id, self.eos_id, self.steps, self.drop = start_id, s.eos_id, steps, drop
        self.tokens = np.full(s.identity.shape[0], start_id, dtype=np.int64)
        self.want_attention = s.src_len is not None
        self.reported = np.zeros(s.max_decoding_length.shape[0], dtype=bool)
        self.t = 0
        self.complete = False
        self.keys: list[Any] = []

    @property
    def rows(self) -> int:
        return int(self.s.identity.shape[0])

    @property
    def num_sources(self) -> int:
        return int(np.count_nonzero(~self.reported))

    def step_alone(self, runner: Runner, state: Any, use_head: bool) -> Optional[np.ndarray]:
        """One step of the runner for this group's rows only (through ``step_top_k`` where it
        pays, with ``use_head``); returns what :meth:`consume` returns."""
        s, t = self.s, self.t
        step_top_k = getattr(runner, "step_top_k", None) if use_head and not self.want_attention else None
        if step_top_k is not None and s.head_usable(self.procs, self.tokens.shape[0]):
            cols, logp, V = s.head_log_probs(step_top_k, state, self.tokens, self.procs, t)
            return self._finish(cols, logp, V, None)
        x, attn = _step_attention(runner, state, self.tokens, t, self.procs, self.want_attention)
        return self._host(x, attn)

    def consume(self, logits: np.ndarray, attention: Optional[np.ndarray]) -> Optional[np.ndarray]:
        """The group's rows of a step's logits (and attention). Returns the group's rows (indices
        into its current rows, repeated where beams split) the runner's state holds for the next
        step, or None to keep them as they are."""
        x = _checked_logits(np.asarray(logits), self.rows, self.t, self.procs)
        return self._host(x, attention)

    def _host(self, x: np.ndarray, attn: Optional[np.ndarray]) -> Optional[np.ndarray]:
        s = self.s
        if attn is not None and s.history_attn is None:
            s.history_attn = np.zeros((attn.shape[0], self.steps, attn.shape[1]), dtype=np.float32)
        cols, logp = s.log_probs(self.procs, x, self.t)
        s.vocab_size = x.shape[1]
        return self._finish(cols, logp, x.shape[1], attn)

    def _finish(
        self, cols: np.ndarray, logp: np.ndarray, V: int, attn: Optional[np.ndarray]
    ) -> Optional[np.ndarray]:
        s, t = self.s, self.t
        ranked = s.rank(cols, logp, V)
        beams = s.next_beams(ranked)
        s.finish_eos(ranked, t)
        stop, at_budget = s.stop_test(beams.scores, t + 1)
        s.close(beams, stop, at_budget, t, attn)
        self.t = t + 1
        if s.done.all() or self.t >= self.steps:
            self._complete()
            return None
        recorder = _Recorder()
        if self.drop and s.done.any():
            rows = s.drop_done(beams, recorder.select, None, t, attn)
            self.procs = self.procs.select(rows)
            self.tokens = beams.tokens[rows]
        else:
            s.advance(beams, recorder, None, t, attn)
            self.tokens = beams.tokens
        return recorder.index

    def _complete(self) -> None:
        self.s.final_results()
        self.complete = True
        self.tokens = np.full(self.rows, self.eos_id, dtype=np.int64)

    def newly_finished(self) -> list[tuple[int, list[Hypothesis]]]:
        """``(source, hypotheses)`` for each source that stopped since the last call."""
        out = []
        for b in np.flatnonzero(~self.reported).tolist():
            if self.s.results[b]:
                self.reported[b] = True
                out.append((b, self.s.results[b]))
        return out

    def _position(self, b: int) -> Optional[int]:
        where = np.flatnonzero(self.s.source_of == b)
        return int(where[0]) if where.size else None

    def cancel(self, b: int) -> None:
        """Source ``b`` leaves without a result (its beams stop at the next step)."""
        self.reported[b] = True
        pos = self._position(b)
        if pos is not None:
            self.s.done[pos] = True
            self.s.results[b] = [_no_hypothesis()]
        if self.s.done.all():
            self._complete()

    def partial(self, b: int) -> list[int]:
        """The tokens of source ``b``'s best open beam so far (its best result once it stopped)."""
        s = self.s
        pos = self._position(b)
        if pos is None or s.done[pos]:
            return list(s.results[b][0].tokens) if s.results[b] else []
        row = pos * s.K + int(np.argmax(s.beam_scores[pos]))
        return s.history[row, : self.t].tolist()


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
    num_hypotheses: int
    eos_id: int
    length_penalty_type: str
    length_penalty: float
    early_stopping: Union[bool, str]
    renormalize: bool
    max_decoding_length: np.ndarray  # [B] budgets
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
    def start(
        cls, *, K: int, max_decoding_length: np.ndarray, steps: int, start_id: int, **options
    ) -> _BeamState:
        B = max_decoding_length.shape[0]
        N = B * K
        # Only beam 0 is live at the start (all beams of a source are identical then, expanding
        # them all would give K copies).
        beam_scores = np.full((B, K), -np.inf, dtype=np.float64)
        beam_scores[:, 0] = 0.0
        identity = np.arange(N, dtype=np.int64)
        s = cls(
            K=K,
            max_decoding_length=max_decoding_length,
            max_penalty=np.zeros(B),
            beam_scores=beam_scores,
            history=np.zeros((N, steps), dtype=np.int64),
            history_lp=np.zeros((N, steps), dtype=np.float64),
            finished=[[] for _ in range(B)],
            n_finished=np.zeros(B, dtype=np.int64),
            kth_best=np.full(B, -np.inf),
            done=max_decoding_length == 0,
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
        s.max_penalty = np.array([s.penalty(int(m)) for m in np.maximum(max_decoding_length, 1)])
        for b in np.flatnonzero(s.done):
            s.results[b] = [Hypothesis([], 0.0, 0.0, False, [])]
        return s

    @property
    def hf(self) -> bool:
        return self.length_penalty_type == "hf"

    @property
    def keep(self) -> int:
        """The stop rule compares the open beams with the keep-th finished score."""
        return self.K if self.hf else self.num_hypotheses

    def penalty(self, length: int) -> float:
        return length_penalty_factor(length, self.length_penalty_type, self.length_penalty)

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
        renormalises after masking (all but ``length_penalty_type="hf"``), a row's log-probabilities
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
        done, length_penalty = self.done, self.length_penalty
        at_budget = ~done & (length >= self.max_decoding_length)
        best_open = new_scores.max(axis=1)
        open_finite = np.isfinite(best_open)
        enough = ~done & ~at_budget & (self.n_finished >= self.keep)
        if self.hf and self.early_stopping is True:
            stop = enough
        else:
            if self.hf:  # transformers' heuristic: the best open beam at the current or maximum length
                if self.early_stopping == "never" and length_penalty > 0:
                    horizon = self.max_decoding_length
                else:
                    horizon = np.full(done.shape[0], length)
                divisor = horizon.astype(np.float64) ** length_penalty
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
            self.results[int(self.source_of[b])] = self.finished[b][: self.num_hypotheses] or [
                _no_hypothesis()
            ]
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
        for name in ("max_decoding_length", "max_penalty", "n_finished", "kth_best", "done", "source_of"):
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
                self.results[g] = self.finished[b][: self.num_hypotheses] or [_no_hypothesis()]
        return self.results
