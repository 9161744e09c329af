"""The logit processors: what happens to a step's ``[N, V]`` scores before a token is chosen.

One class per processor, applied at every step of every search in this order
(:data:`PROCESSOR_ORDER`):

1. :class:`RepetitionPenalty`: the score ``l`` of a token already in the row's sequence (start
   token included) becomes ``l * p`` if ``l < 0``, else ``l / p``;
2. :class:`NoRepeatNgram`: a token that would complete an n-gram already in the sequence is banned;
3. :class:`BannedTokens`: the given ids are never generated;
4. :class:`MinLength`: the EOS is banned while a row has fewer tokens than its minimum;
5. :class:`ForcedTokens`: a row's target-prefix tokens, then (``force_eos_at_budget``) the EOS
   as the last token its budget allows, are forced: the row keeps only that token.

A ban sets the score to -inf; the package docstring says how the searches normalise after them.
:class:`_Processors` composes the five for the rows of one search (per-row state: the minimum
lengths, the prefixes and budgets; :meth:`_Processors.select` follows the rows a search keeps).
The helpers after it build the requests of a step through a runner's ``step_top_k`` (the columns
the masking processors touch).
"""

from __future__ import annotations

import copy

import numpy as np

from .options import (
    _check_in_vocab,
    _Options,
)


class RepetitionPenalty:
    """Processor 1: a seen token's score ``l`` becomes ``l * p`` (``l < 0``) or ``l / p``."""

    needs_sequence = True

    def __init__(self, penalty: float):
        self.penalty = np.float32(penalty)

    def __bool__(self) -> bool:
        return bool(self.penalty != 1.0)

    def apply(self, y: np.ndarray, sequence: np.ndarray) -> None:
        r = np.arange(y.shape[0])[:, None]
        seen = y[r, sequence]
        y[r, sequence] = np.where(seen < 0, seen * self.penalty, seen / self.penalty)


class NoRepeatNgram:
    """Processor 2: bans each token that would complete an n-gram already in the sequence."""

    needs_sequence = True

    def __init__(self, n: int):
        self.n = int(n)

    def __bool__(self) -> bool:
        return self.n > 0

    def apply(self, y: np.ndarray, sequence: np.ndarray) -> None:
        _ban_repeated_ngrams(y, sequence, self.n)


class BannedTokens:
    """Processor 3: the ids ``banned`` (int64, unique) are never generated."""

    needs_sequence = False

    def __init__(self, banned: np.ndarray):
        self.ids = banned

    def __bool__(self) -> bool:
        return bool(self.ids.size)

    def apply(self, y: np.ndarray) -> None:
        y[:, self.ids] = -np.inf


class MinLength:
    """Processor 4: the EOS is banned at step ``t`` in the rows with ``t < min_decoding_length``."""

    needs_sequence = False

    def __init__(self, eos_id: int, min_decoding_length: np.ndarray):
        self.eos_id, self.min_decoding_length = eos_id, min_decoding_length

    def active(self, t: int) -> np.ndarray:
        return t < self.min_decoding_length

    def apply(self, y: np.ndarray, t: int) -> None:
        suppress = self.active(t)
        if suppress.any():
            y[suppress, self.eos_id] = -np.inf

    def select(self, rows: np.ndarray) -> MinLength:
        return MinLength(self.eos_id, self.min_decoding_length[rows])


class ForcedTokens:
    """Processor 5: row ``r``'s first ``prefix_len[r]`` tokens are ``prefix[r]``; with
    ``at_budget`` its EOS is forced as the last token ``max_decoding_length[r]`` allows."""

    needs_sequence = False

    def __init__(
        self,
        eos_id: int,
        prefix: np.ndarray,
        prefix_len: np.ndarray,
        max_decoding_length: np.ndarray,
        at_budget: bool,
    ):
        self.eos_id, self.at_budget = eos_id, at_budget
        self.prefix, self.prefix_len, self.max_decoding_length = prefix, prefix_len, max_decoding_length

    @classmethod
    def of_prefixes(
        cls,
        eos_id: int,
        prefixes: list[np.ndarray],
        rows_per_source: int,
        max_decoding_length: np.ndarray,
        at_budget: bool,
    ) -> ForcedTokens:
        """The table of one prefix per source (ragged), each repeated for the source's rows."""
        R = rows_per_source
        plen = np.array([len(p) for p in prefixes], dtype=np.int64)
        table = np.full((len(prefixes), max(1, int(plen.max(initial=0)))), -1, dtype=np.int64)
        for b, p in enumerate(prefixes):
            table[b, : len(p)] = p
        return cls(
            eos_id,
            np.repeat(table, R, axis=0),
            np.repeat(plen, R),
            np.repeat(max_decoding_length, R),
            at_budget,
        )

    def forced(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """``(rows, tokens)`` forced at step ``t``: prefix tokens, then the EOS at a row's budget."""
        rows = np.flatnonzero(t < self.prefix_len)
        tokens = self.prefix[rows, t] if rows.size else np.zeros(0, dtype=np.int64)
        if self.at_budget:
            at_end = np.flatnonzero((t == self.max_decoding_length - 1) & (t >= self.prefix_len))
            if at_end.size:
                rows = np.concatenate([rows, at_end])
                tokens = np.concatenate([tokens, np.full(at_end.size, self.eos_id, dtype=np.int64)])
        return rows, tokens

    def active(self, t: int) -> bool:
        return bool(
            (t < self.prefix_len).any() or (self.at_budget and (t == self.max_decoding_length - 1).any())
        )

    def apply(
        self, y: np.ndarray, t: int, raw: np.ndarray, *, log_probs: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        rows, tokens = self.forced(t)
        if rows.size:
            keep = np.float32(0.0) if log_probs else raw[rows, tokens]
            y[rows] = -np.inf
            y[rows, tokens] = keep
        return rows, tokens

    def select(self, rows: np.ndarray) -> ForcedTokens:
        return ForcedTokens(
            self.eos_id,
            self.prefix[rows],
            self.prefix_len[rows],
            self.max_decoding_length[rows],
            self.at_budget,
        )


PROCESSOR_ORDER = (
    RepetitionPenalty,
    NoRepeatNgram,
    BannedTokens,
    MinLength,
    ForcedTokens,
)


class _Processors:
    """The five processors of one search over ``N = n_sources * rows_per_source`` rows (the
    rows of a source are consecutive), in :data:`PROCESSOR_ORDER`. Everything is vectorised
    over the rows. ``o`` holds the checked options; ``min_decoding_length`` / ``max_decoding_length`` / ``prefix_len``
    are per row."""

    def __init__(
        self,
        options: _Options,
        *,
        eos_id: int,
        rows_per_source: int,
        min_decoding_length: np.ndarray,
        max_decoding_length: np.ndarray,
        prefixes: list[np.ndarray],
    ):
        self.o = options
        self.eos_id = eos_id
        self.prefixes = prefixes
        self.repetition = RepetitionPenalty(options.repetition_penalty)
        self.ngram = NoRepeatNgram(options.no_repeat_ngram_size)
        self.banned = BannedTokens(options.banned)
        self.eos_ban = MinLength(eos_id, np.repeat(min_decoding_length, rows_per_source))
        self.forcing = ForcedTokens.of_prefixes(
            eos_id, prefixes, rows_per_source, max_decoding_length, options.force_eos_at_budget
        )
        self.needs_sequence = bool(self.repetition) or bool(self.ngram)

    @property
    def min_decoding_length(self) -> np.ndarray:
        return self.eos_ban.min_decoding_length

    @property
    def max_decoding_length(self) -> np.ndarray:
        return self.forcing.max_decoding_length

    @property
    def prefix_len(self) -> np.ndarray:
        return self.forcing.prefix_len

    def select(self, rows: np.ndarray) -> _Processors:
        """The processors of the rows ``rows`` (int64 indices of the current rows), in that order:
        what a search uses after dropping finished rows."""
        new = copy.copy(self)
        new.eos_ban = self.eos_ban.select(rows)
        new.forcing = self.forcing.select(rows)
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
        return self.forcing.forced(t)

    def active(self, t: int) -> bool:
        """Whether :meth:`apply` changes anything at step ``t``."""
        return bool(
            self.needs_sequence or self.banned or self.eos_ban.active(t).any() or self.forcing.active(t)
        )

    def apply(
        self,
        y: np.ndarray,
        t: int,
        sequence: np.ndarray | None,
        raw: np.ndarray,
        *,
        log_probs: bool,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The processors on ``y`` (float32 ``[N, V]``, modified in place) at step ``t``, in
        :data:`PROCESSOR_ORDER`.

        ``sequence``: int64 ``[N, t + 1]``, each row's fed tokens (start token first), needed by
        the repetition penalty and the n-gram ban. A forced row keeps only its token, whose value
        becomes 0 with ``log_probs`` (``y`` holds log-probabilities: transformers' rule), else the
        row's raw logit from ``raw`` (the caller normalises it over the raw logits).
        Returns the forced ``(rows, tokens)``.
        """
        if self.repetition:
            self.repetition.apply(y, sequence)
        if self.ngram:
            self.ngram.apply(y, sequence)
        if self.banned:
            self.banned.apply(y)
        self.eos_ban.apply(y, t)
        return self.forcing.apply(y, t, raw, log_probs=log_probs)


def _ban_repeated_ngrams(y: np.ndarray, sequence: np.ndarray, n: int) -> None:
    """``y[r, tok] = -inf`` for every token that would complete an n-gram already in row r's
    sequence (the last ``n - 1`` tokens followed by ``tok`` occurred before)."""
    L = sequence.shape[1]
    if L < n:  # no complete n-gram yet
        return
    windows = np.lib.stride_tricks.sliding_window_view(sequence, n, axis=1)  # [N, L - n + 1, n]
    last = sequence[:, L - n + 1 :]  # [N, n - 1]
    match = (windows[:, :, :-1] == last[:, None, :]).all(axis=2)
    r, i = np.nonzero(match)
    y[r, windows[r, i, -1]] = -np.inf


# The smallest ``rows x V`` a step goes through ``runner.step_top_k`` at: below it the host
# search is as fast or faster (the search head's run costs about 50 us, and numpy's argmax, all
# that greedy search without scores needs, is one pass over the logits where the head makes
# three). Measured with benchmarks/decode/bench_search_head.py, the search alone over fixed logits
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
    masked &= (t < procs.min_decoding_length)[:, None]
    if procs.o.banned.size:
        masked |= np.isin(ids, procs.o.banned)
    return masked


def _masked_mass(picked: np.ndarray, procs: _Processors, t: int) -> np.ndarray:
    """float64 ``[N]``: each row's probability (under the unprocessed softmax) of the tokens
    :func:`_head_masked` removes, from the column log-probabilities of :func:`_head_request`."""
    nb = procs.o.banned.shape[0]
    p = np.exp(picked[:, : nb + 1].astype(np.float64))
    return p[:, :nb].sum(axis=1) + np.where(t < procs.min_decoding_length, p[:, nb], 0.0)
