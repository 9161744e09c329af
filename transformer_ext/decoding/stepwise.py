"""The step-wise search state: a search advanced one decoder step at a time, which admits new
sources between steps and hands back each source as soon as it is finished.

::

    from transformer_ext.decoding import SearchOptions, SearchState, SourceRequest

    state = SearchState(runner, bos_id=runner.info.bos_id, eos_id=runner.info.eos_id)
    state.admit([SourceRequest(ids, SearchOptions(beam_size=4), key="a", index=0)])
    while not state.empty:
        for key, hypotheses in state.step():     # the sources finished at this step
            ...
        state.admit([...])                         # more sources, between any two steps

* :class:`SourceRequest`: one encoded source (int64 ids, no padding), its
  :class:`~transformer_ext.decoding.options.SearchOptions` (a batch may mix them: greedy, beam
  and sampling sources side by side), an optional target prefix (forced first tokens), the
  caller's ``key`` for it, and its ``index`` (with the options' ``seed``, the source's sampling
  stream).
* :meth:`SearchState.admit` encodes the sources and appends their rows to the runner's running
  state (``runner.append``, which keeps every row at its own position), before the first step or
  between any two steps. Its sources form groups of equal search settings (search kind, beam
  size, hypotheses, length penalty, processors); each group is searched by the vectorised code of
  its kind (:class:`~transformer_ext.decoding.greedy._GreedyGroup`,
  :class:`~transformer_ext.decoding.beam._BeamGroup`), with per-source budgets, minimum lengths,
  prefixes and sampling streams.
* :meth:`SearchState.step` runs one decoder step for every open row, lets every group choose its
  tokens from its rows' logits, returns ``[(key, [Hypothesis, ...]), ...]`` for the sources that
  finished, and moves the runner's rows in one call: a beam reorder (``runner.reorder``), or,
  where rows leave (finished sources and groups, ``runner.select``), one gather that also
  reorders.
* :meth:`SearchState.cancel` drops a source without a result; :meth:`SearchState.partial` is the
  tokens its best open hypothesis holds so far.

**Row slots.** On a runner that can put rows into its running state in place (``runner.insert
(state, other, rows)`` and ``runner.release(state, rows)``: the ONNX Runtime runner) with the
batch-invariant layout, the runner's rows are slots: each group holds the runner rows of its
rows (``slots``), in any order. Rows that leave (finished sources, complete groups) free their
slots without moving any other row (``runner.release``); admitted sources take free slots first
and new rows at the end only for the rest (``runner.insert`` writes just those rows); a beam
split copies a row into a slot its own source no longer needs (``runner.reorder`` of the rows
that change). So an arrival or a departure costs the rows it concerns, not the whole batch, and
every group's rows share one decoder run. A step feeds free slots the start token and ignores
their outputs; once they are more than a quarter of the rows (:data:`FREE_SLOTS_DIVISOR`), one
``select`` moves the open rows to the front before the step. Without both methods (the eager
runner), or with ``batch_invariant=False``, the groups' rows are consecutive and every
departure is a ``select``, every admission an ``append``.

A source's hypotheses depend only on its own rows' logits, so on a runner whose step gives a row
the same logits whatever the other rows are, a source gets the same tokens and scores whether it
was searched alone, in a fixed batch, or admitted into a running batch. With
``batch_invariant=True`` (the default) the state asks for that: every step is computed on the
host from the logits (never through the search head, ``runner.step_top_k``, whose use depends on
the batch's size), and a runner with ``batch_invariant(state)`` lays out every state it encodes
so that a row's logits do not depend on the other rows. ONNX Runtime in float32 then gives
identical results (see ``OrtRunner.batch_invariant``); the eager runner gives the same
tokens, with scores that differ in the last float32 digits, since its matrix products round
differently for different row counts. :func:`~transformer_ext.decoding.greedy_decode` and
:func:`~transformer_ext.decoding.beam_search`, which search one fixed batch, use
``batch_invariant=False``: the search head where it pays and the runner's own layout.

A SearchState is used by one thread at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Optional, Sequence

import numpy as np

from .beam import _BeamGroup, _BeamState
from .greedy import _GreedyGroup
from .options import (
    SearchOptions,
    _check_options,
    _check_prefixes,
    _check_token_id,
)
from .processors import _Processors
from .protocol import Hypothesis, _selector, as_int64, check_attention_runner
from .sampling import _Sampler

__all__ = ["SearchState", "SourceRequest", "FREE_SLOTS_DIVISOR"]

# Row slots: the free slots leave the runner's state (one compaction) before a step once they
# are more than this fraction of its rows (they are fed a token at every step until then).
FREE_SLOTS_DIVISOR = 4


@dataclass(frozen=True)
class SourceRequest:
    """One source for :meth:`SearchState.admit`.

    ``input_ids``: the encoded source, 1-D integer ids, no padding. ``options``: its search
    options. ``target_prefix``: token ids forced as its first generated tokens (no EOS; at most its
    budget), or None. ``key``: the caller's hashable handle, unique among the open sources
    (default: ``index``). ``index``: the source's index in the caller's input (>= 0), which with
    ``options.seed`` picks its sampling stream.
    """

    input_ids: Any
    options: SearchOptions = field(default_factory=SearchOptions)
    target_prefix: Optional[Sequence[int]] = None
    key: Hashable = None
    index: int = 0


def _group_key(o: SearchOptions) -> tuple:
    """The settings a group of sources shares (everything but budgets, minimum lengths,
    prefixes and seeds, which are per source)."""
    processors = (
        tuple(sorted(set(o.banned_ids))),
        o.repetition_penalty,
        o.no_repeat_ngram_size,
        o.force_eos_at_budget,
    )
    if o.beam_size > 1:
        search = ("beam", o.beam_size, o.num_hypotheses, o.length_penalty_type, float(o.length_penalty))
        search += (o.early_stopping, o.renormalize_logits)
    elif o.sampling:
        search = ("sampling", o.sampling_topk, o.sampling_topp, o.sampling_temperature, o.num_hypotheses)
    else:
        search = ("greedy", o.num_hypotheses)
    return (*search, bool(o.return_scores), bool(o.return_attention), *processors)


class SearchState:
    """A search over a changing batch of sources, advanced one decoder step at a time (the module
    docstring describes the protocol).

    ``runner``: any :class:`~transformer_ext.decoding.Runner`; admitting sources into a running
    search needs its ``append(state, other)`` (the eager and ONNX Runtime runners have it), and
    rows leave its state through ``select`` (without one, finished rows are fed EOS until every
    source is done). ``bos_id`` / ``eos_id`` / ``decoder_start_id``: the model's ids (the start
    token defaults to ``bos_id``). ``remove_finished=False`` never drops rows (for comparison).
    ``batch_invariant``: see the module docstring.
    """

    def __init__(
        self,
        runner: Any,
        *,
        bos_id: int,
        eos_id: int,
        decoder_start_id: Optional[int] = None,
        remove_finished: bool = True,
        batch_invariant: bool = True,
    ):
        base = _check_options(
            bos_id=bos_id,
            eos_id=eos_id,
            decoder_start_id=decoder_start_id,
            banned_ids=(),
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            force_eos_at_budget=False,
        )
        self.runner = runner
        self.eos_id = _check_token_id("eos_id", eos_id)
        self.start_id = base.start_id
        self._select = _selector(runner, remove_finished)
        self.batch_invariant = bool(batch_invariant)
        self._state: Any = None
        self._groups: list[Any] = []
        self._where: dict[Hashable, tuple[Any, int]] = {}  # key -> (group, its source there)
        # Row slots (the module docstring): with a batch-invariant layout and a runner that can
        # insert rows into released ones, each group holds ``slots`` (its rows' runner rows)
        self.slots = bool(
            self.batch_invariant
            and self._select is not None
            and callable(getattr(runner, "insert", None))
            and callable(getattr(runner, "release", None))
        )
        self._num_slots = 0  # the runner state's rows
        self._free: list[int] = []  # runner rows no group holds, ascending
        self._slot_source = np.zeros(0, dtype=np.int64)  # runner row -> its source's serial number
        self._sources_seen = 0

    # ------------------------------------------------------------------ the batch

    @property
    def num_sources(self) -> int:
        """Sources admitted and neither finished nor cancelled."""
        return len(self._where)

    @property
    def num_rows(self) -> int:
        """Rows the sources hold in the runner's state (sources times their beams or samples,
        finished rows not yet dropped included; free row slots not included)."""
        return sum(g.rows for g in self._groups)

    @property
    def num_slots(self) -> int:
        """Rows of the runner's state: :attr:`num_rows` and the free row slots (0 without slots)."""
        return self._num_slots if self._state is not None else 0

    @property
    def empty(self) -> bool:
        """True when no source is open (every admitted source was handed back or cancelled)."""
        return not self._where

    # ------------------------------------------------------------------ admission

    def admit(self, requests: Sequence[SourceRequest]) -> None:
        """Encode ``requests`` and append their rows to the running batch (before the first step
        or between any two steps). Every request is checked before anything is encoded: a
        ValueError or TypeError names the request (``requests[2].input_ids``) and what was expected."""
        requests = list(requests)
        checked = [self._check_request(i, r) for i, r in enumerate(requests)]
        keys = [c[0] for c in checked]
        if len(set(keys)) != len(keys):
            dup = next(k for k in keys if keys.count(k) > 1)
            raise ValueError(f"requests: the key {dup!r} is given to more than one source")
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(_group_key(r.options), []).append(i)
        if (self._state is not None or len(groups) > 1) and not callable(
            getattr(self.runner, "append", None)
        ):
            raise TypeError(
                f"the {type(self.runner).__name__} runner cannot admit sources into a running search (it has "
                "no append(state, other)): admit sources of one search setting, before the first step"
            )
        built = [
            self._build_group([requests[i] for i in members], [checked[i] for i in members])
            for members in groups.values()
        ]
        for (group, ids, lengths, cache_len, per_source), members in zip(built, groups.values()):
            self.admit_group(group, ids, lengths, cache_len, per_source, keys=[keys[i] for i in members])

    def _check_request(self, i: int, r: Any) -> tuple[Hashable, np.ndarray, int, np.ndarray]:
        """``(key, input_ids, budget, prefix)`` of request ``i``, checked."""
        name = f"requests[{i}]"
        if not isinstance(r, SourceRequest):
            raise TypeError(f"{name} must be a SourceRequest, got {type(r).__name__}")
        if not isinstance(r.options, SearchOptions):
            raise TypeError(f"{name}.options must be a SearchOptions, got {type(r.options).__name__}")
        ids = as_int64(f"{name}.input_ids", r.input_ids)
        if ids.ndim != 1 or ids.shape[0] < 1:
            raise ValueError(
                f"{name}.input_ids must be a non-empty 1-D array of token ids, got shape {ids.shape}"
            )
        if isinstance(r.index, bool) or not isinstance(r.index, (int, np.integer)) or r.index < 0:
            raise ValueError(f"{name}.index must be an int >= 0, got {r.index!r}")
        key = r.index if r.key is None else r.key
        try:
            hash(key)
        except TypeError:
            raise TypeError(f"{name}.key must be hashable, got {type(key).__name__}") from None
        if key in self._where:
            raise ValueError(f"{name}.key {key!r} is the key of a source that is still open")
        if r.options.return_attention:
            check_attention_runner(self.runner)
        budget = min(int(r.options.budget([ids.shape[0]])[0]), self._limits())
        prefix = [] if r.target_prefix is None else r.target_prefix
        try:
            (prefix,) = _check_prefixes([prefix], 1, np.array([budget]), self.eos_id)
        except (TypeError, ValueError) as exc:  # named as the request's
            raise type(exc)(str(exc).replace("target_prefix[0]", f"{name}.target_prefix", 1)) from None
        return key, ids, budget, prefix

    def _limits(self) -> int:
        """The most tokens a source may generate here: the runner's positions and cache capacity."""
        info = getattr(self.runner, "info", None)
        limits = [getattr(info, "max_positions", None), getattr(info, "max_cache_len", None)]
        return min([int(v) for v in limits if v is not None], default=1 << 30)

    def _build_group(self, requests: list[SourceRequest], checked: list[tuple]) -> tuple:
        """``(group, ids, lengths, cache_len, rows_per_source)`` of requests of one group key."""
        o = requests[0].options
        B = len(requests)
        lengths = np.array([c[1].shape[0] for c in checked], dtype=np.int64)
        padded = np.zeros((B, int(lengths.max())), dtype=np.int64)
        for b, c in enumerate(checked):
            padded[b, : c[1].shape[0]] = c[1]
        max_new = np.array([c[2] for c in checked], dtype=np.int64)
        min_new = np.array([r.options.min_decoding_length for r in requests], dtype=np.int64)
        prefixes = [c[3] for c in checked]
        options = _check_options(
            bos_id=self.start_id,
            eos_id=self.eos_id,
            decoder_start_id=self.start_id,
            banned_ids=list(o.banned_ids),
            repetition_penalty=o.repetition_penalty,
            no_repeat_ngram_size=o.no_repeat_ngram_size,
            force_eos_at_budget=o.force_eos_at_budget,
        )
        steps = int(max_new.max())
        if o.beam_size > 1:
            K = o.beam_size
            procs = _Processors(
                options,
                eos_id=self.eos_id,
                rows_per_source=K,
                min_decoding_length=min_new,
                max_decoding_length=max_new,
                prefixes=prefixes,
            )
            s = _BeamState.start(
                K=K,
                num_hypotheses=o.num_hypotheses,
                eos_id=self.eos_id,
                start_id=self.start_id,
                length_penalty_type=o.length_penalty_type,
                length_penalty=float(o.length_penalty),
                early_stopping=False if o.early_stopping is None else o.early_stopping,
                renormalize=bool(o.renormalize_logits),
                max_decoding_length=max_new,
                steps=steps,
            )
            if o.return_attention:
                s.src_len = np.repeat(lengths, K)
            group = _BeamGroup(s, procs, start_id=self.start_id, steps=steps, drop=self._select is not None)
            return group, padded, lengths, steps, K
        n = o.num_hypotheses
        sampler = None
        if o.sampling:
            sampler = _Sampler(o.sampling_topk, o.sampling_topp, o.sampling_temperature, None).streams_for(
                [r.index for r in requests], n, [r.options.seed for r in requests]
            )
        procs = _Processors(
            options,
            eos_id=self.eos_id,
            rows_per_source=n,
            min_decoding_length=min_new,
            max_decoding_length=max_new,
            prefixes=prefixes,
        )
        group = _GreedyGroup(
            procs,
            sampler,
            n=n,
            row_budget=np.repeat(max_new, n),
            src_len=np.repeat(lengths, n),
            start_id=self.start_id,
            eos_id=self.eos_id,
            with_scores=bool(o.return_scores or o.return_attention or n > 1),
            attention=bool(o.return_attention),
            drop=self._select is not None,
        )
        return group, padded, lengths, steps, n

    def admit_group(
        self,
        group: Any,
        ids: np.ndarray,
        lengths: np.ndarray,
        cache_len: int,
        rows_per_source: int,
        *,
        keys: Sequence[Hashable],
    ) -> None:
        """Encode the sources of a group built by a search (``ids`` ``[B, S]`` right-padded) and
        append its rows. The searches' own entry point (:func:`greedy_decode`, :func:`beam_search`
        admit their whole batch as one group); callers use :meth:`admit`."""
        keys = list(keys)
        state = self.runner.encode(ids, lengths, cache_len, rows_per_source)
        layout = getattr(self.runner, "batch_invariant", None)
        if self.batch_invariant and callable(layout):
            layout(state)
        if self.slots:
            self._admit_into_slots(group, state, ids.shape[0], rows_per_source)
        elif self._state is None:
            self._state = state
        else:
            append = getattr(self.runner, "append", None)
            if not callable(append):
                raise TypeError(
                    f"the {type(self.runner).__name__} runner cannot admit sources into a running search "
                    "(it has no append(state, other)); admit every source before the first step"
                )
            append(self._state, state)
        group.keys = keys
        self._groups.append(group)
        for b, key in enumerate(keys):
            self._where[key] = (group, b)

    def _admit_into_slots(self, group: Any, state: Any, sources: int, rows_per_source: int) -> None:
        """``state``'s rows (a new encode) into free row slots of the running state, the rest
        into new rows at its end (``runner.insert``: only those rows are written)."""
        serial = self._sources_seen + np.repeat(np.arange(sources, dtype=np.int64), rows_per_source)
        self._sources_seen += sources
        n = int(serial.shape[0])
        if self._state is None:
            self._state, self._num_slots, self._free = state, n, []
            slots = np.arange(n, dtype=np.int64)
            self._slot_source = serial
        else:
            taken = self._free[:n]
            extra = n - len(taken)
            slots = np.array(taken + list(range(self._num_slots, self._num_slots + extra)), dtype=np.int64)
            self.runner.insert(self._state, state, slots)
            self._free = self._free[len(taken) :]
            if extra:
                self._num_slots += extra
                self._slot_source = np.concatenate([self._slot_source, np.zeros(extra, dtype=np.int64)])
            self._slot_source[slots] = serial
        group.slots = slots

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[tuple[Hashable, list[Hypothesis]]]:
        """One decoder step for every open row; returns ``(key, hypotheses)`` for each source that
        finished at this step (best first, ``num_hypotheses`` of them), in the order of admission."""
        groups = self._groups
        if not groups:
            return []
        if self.slots:
            return self._slot_step(groups)
        before = [g.rows for g in groups]
        if len(groups) == 1:
            indices = [groups[0].step_alone(self.runner, self._state, not self.batch_invariant)]
        else:
            indices = self._shared_step(groups, before)
        finished = []
        for g in groups:
            for b, hyps in g.newly_finished():
                key = g.keys[b]
                if self._where.pop(key, None) is not None:
                    finished.append((key, hyps))
        self._move_rows(groups, before, indices)
        return finished

    def _shared_step(self, groups: list[Any], before: list[int]) -> list[Optional[np.ndarray]]:
        tokens = np.concatenate([g.tokens for g in groups])
        N = tokens.shape[0]
        attention = None
        if any(g.want_attention and not g.complete for g in groups):
            logits, attention = self.runner.step_with_attention(self._state, tokens)
            attention = np.asarray(attention, dtype=np.float32)
        else:
            logits = self.runner.step(self._state, tokens)
        logits = np.asarray(logits)
        if logits.ndim != 2 or logits.shape[0] != N:
            raise RuntimeError(f"runner.step returned logits of shape {logits.shape}, expected ({N}, V)")
        indices: list[Optional[np.ndarray]] = []
        lo = 0
        for g, rows in zip(groups, before):
            if g.complete:  # its rows wait for a select (or are fed EOS without one)
                indices.append(None)
            else:
                attn = attention[lo : lo + rows] if attention is not None and g.want_attention else None
                indices.append(g.consume(logits[lo : lo + rows], attn))
            lo += rows
        return indices

    def _move_rows(self, groups: list[Any], before: list[int], indices: list[Optional[np.ndarray]]) -> None:
        """One reorder or select of the runner's rows for every group's choice; complete groups
        leave (with a select)."""
        parts, lo, changed = [], 0, False
        for g, rows, index in zip(groups, before, indices):
            if g.complete and self._select is not None:
                changed = True
            elif index is None:
                parts.append(np.arange(lo, lo + rows, dtype=np.int64))
            else:
                parts.append(index + lo)
                changed = True
            lo += rows
        if self._select is not None:
            self._groups = [g for g in groups if not g.complete]
        elif all(g.complete for g in groups):
            self._groups = []
        if not self._groups:
            self._state = None
            return
        if not changed:
            return
        keep = np.concatenate(parts)
        if keep.shape[0] == lo:
            if not np.array_equal(keep, np.arange(lo)):
                self.runner.reorder(self._state, keep)
        else:
            self._select(self._state, keep)

    # ------------------------------------------------------------------ row slots

    def _slot_step(self, groups: list[Any]) -> list[tuple[Hashable, list[Hypothesis]]]:
        """:meth:`step` over row slots: one decoder run for every runner row (free ones fed the
        start token, their outputs ignored), each group reading its own rows' logits."""
        if len(self._free) * FREE_SLOTS_DIVISOR > self._num_slots:
            self._compact(groups)
        R = self._num_slots
        tokens = np.full(R, self.start_id, dtype=np.int64)
        for g in groups:
            tokens[g.slots] = g.tokens
        attention = None
        if any(g.want_attention and not g.complete for g in groups):
            logits, attention = self.runner.step_with_attention(self._state, tokens)
            attention = np.asarray(attention, dtype=np.float32)
        else:
            logits = self.runner.step(self._state, tokens)
        logits = np.asarray(logits)
        if logits.ndim != 2 or logits.shape[0] != R:
            raise RuntimeError(f"runner.step returned logits of shape {logits.shape}, expected ({R}, V)")
        indices: list[Optional[np.ndarray]] = []
        for g in groups:
            if g.complete:
                indices.append(None)
            else:
                attn = attention[g.slots] if attention is not None and g.want_attention else None
                indices.append(g.consume(logits[g.slots], attn))
        finished = []
        for g in groups:
            for b, hyps in g.newly_finished():
                key = g.keys[b]
                if self._where.pop(key, None) is not None:
                    finished.append((key, hyps))
        self._move_slots(groups, indices)
        return finished

    def _move_slots(self, groups: list[Any], indices: list[Optional[np.ndarray]]) -> None:
        """Each group's choice of rows, in the runner rows it already holds: a kept row stays in
        its slot, a beam split copies a row into a slot its source no longer needs (one
        ``runner.reorder`` of the rows that change), the slots of rows that left and of complete
        groups become free (``runner.release``)."""
        R = self._num_slots
        full = np.arange(R, dtype=np.int64)
        moved = cross_source = False
        freed: list[int] = []
        for g, index in zip(groups, indices):
            if g.complete:
                freed.extend(g.slots.tolist())
                continue
            if index is None:
                continue
            old = g.slots
            src = old[np.asarray(index, dtype=np.int64)]
            referenced = set(src.tolist())
            spare: dict[int, list[int]] = {}
            for s in old.tolist():
                if s not in referenced:
                    spare.setdefault(int(self._slot_source[s]), []).append(s)
            dest = src.copy()
            used: set[int] = set()
            for r, s in enumerate(src.tolist()):
                if s not in used:
                    used.add(s)
                    continue
                pool = spare.get(int(self._slot_source[s]))
                if not pool:  # no slot of its own source is free: any of the group's
                    pool = next(p for p in spare.values() if p)
                    cross_source = True
                d = pool.pop()
                dest[r] = d
                full[d] = s
                moved = True
            for p in spare.values():
                freed.extend(p)
            g.slots = dest
        self._groups = [g for g in groups if not g.complete]
        if not self._groups:
            self._state, self._num_slots, self._free = None, 0, []
            return
        if moved:
            if cross_source:  # rows of other sources: their cross-attention rows move too
                self._select(self._state, full)
            else:
                self.runner.reorder(self._state, full)
            self._slot_source = self._slot_source[full]
        if freed:
            self._free = sorted(self._free + freed)
        if self._free:
            self.runner.release(self._state, np.array(self._free, dtype=np.int64))

    def _compact(self, groups: list[Any]) -> None:
        """The groups' rows move to the front of the runner's state (one ``select``), the free
        slots leave it."""
        live = np.sort(np.concatenate([g.slots for g in groups]))
        where = np.full(self._num_slots, -1, dtype=np.int64)
        where[live] = np.arange(live.shape[0], dtype=np.int64)
        self._select(self._state, live)
        for g in groups:
            g.slots = where[g.slots]
        self._slot_source = self._slot_source[live]
        self._num_slots, self._free = int(live.shape[0]), []

    # ------------------------------------------------------------------ one source

    def _lookup(self, key: Hashable) -> tuple[Any, int]:
        try:
            return self._where[key]
        except (KeyError, TypeError):
            raise KeyError(f"no open source has the key {key!r}") from None

    def cancel(self, key: Hashable) -> None:
        """The source ``key`` leaves without a result (its rows leave the runner's state at the
        next step). A KeyError when no open source has that key."""
        group, b = self._lookup(key)
        group.cancel(b)
        del self._where[key]
        if all(g.complete for g in self._groups) and self._groups:
            self._groups = []
            self._state, self._num_slots, self._free = None, 0, []

    def partial(self, key: Hashable) -> list[int]:
        """The tokens the source ``key``'s best open hypothesis has generated so far (prefix
        tokens included, no start token). A KeyError when no open source has that key."""
        group, b = self._lookup(key)
        return group.partial(b)
