"""Continuous batching (``--batching continuous``): one running batch per model, driven step by step.

The scheduler owns the model's runner through a step-wise search state
(:class:`transformer_ext.decoding.SearchState`). Between two decoder steps it

* admits waiting sources while the running batch stays within ``max_batch_rows`` decoder rows
  (sources x beam) and ``max_batch_tokens`` padded source tokens: their encoder runs and their
  rows join the running batch (:meth:`SearchState.admit`);
* removes the sources of cancelled requests (timeout, client gone: :meth:`SearchState.cancel`);
* runs one decoder step for every open source (:meth:`SearchState.step`), whose finished
  sources leave the batch and are delivered at once;
* streams the tokens generated so far of sources whose request asked for them
  (:meth:`SearchState.partial`).

Each source carries its own options, target prefix (an M2M100 / NLLB target-language token,
so one batch mixes language pairs) and sampling stream, so each result is what
``Translator.translate`` gives for that source alone. A step or an admission that raises fails
the sources of the running batch (500) and the scheduler starts a new one.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import numpy as np

from ..translator import Translation, TranslationError
from .scheduler import Job, JobError, Scheduler

logger = logging.getLogger(__name__)

__all__ = ["ContinuousScheduler", "StepwiseUnavailable", "stepwise_api"]


class StepwiseUnavailable(RuntimeError):
    """This version's decoding package has no step-wise search state."""


def stepwise_api():
    """``(SearchOptions, SearchState, SourceRequest)`` of :mod:`transformer_ext.decoding`."""
    try:
        from ..decoding import SearchOptions, SearchState, SourceRequest
    except ImportError:
        raise StepwiseUnavailable(
            "--batching continuous needs the step-wise search state (transformer_ext.decoding.SearchState), "
            "which this installation's decoding package lacks: use --batching static"
        ) from None
    return SearchOptions, SearchState, SourceRequest


class ContinuousScheduler(Scheduler):
    """Sources join and leave one running batch between decoder steps (module docstring)."""

    kind = "continuous"

    def __init__(self, model: Any, *, api: Optional[tuple] = None, **kwargs: Any):
        super().__init__(model.name, **kwargs)
        self.model = model
        self._api = api if api is not None else stepwise_api()
        self._state = None
        self._open: dict[tuple, tuple[Job, int, int]] = {}  # key -> (job, source index, beam)
        self._lengths: dict[tuple, int] = {}  # key -> source tokens
        self._partial: dict[tuple, int] = {}  # key -> tokens already streamed
        self._rows = 0

    # ------------------------------------------------------------------ the state
    def _new_state(self):
        _, SearchState, _ = self._api
        t = self.model.translator
        return SearchState(
            t.runner,
            bos_id=t.bos_id,
            eos_id=t.eos_id,
            decoder_start_id=getattr(t.generation, "decoder_start_id", None),
        )

    def _requests(self, job: Job) -> list:
        """The :class:`SourceRequest` of each source of ``job``: the translator's options resolved
        exactly as :meth:`Translator.translate` resolves them for that source alone (the budget
        ``a * n + b`` capped as the translator caps it, the generation config's banned tokens and
        forced target-language prefix, the request's target prefix)."""
        SearchOptions, _, SourceRequest = self._api
        t = job.translator
        opts = t._resolve(dict(job.options))
        encoded = t.encode(job.sources, strict=opts["strict"], long_lines=opts["long_lines"])
        given = job.target_prefix if any(p is not None for p in job.target_prefix) else None
        prefixes = t._prefixes(given, len(job.sources), opts)
        search = opts["search"]
        hf = opts["length_penalty_type"] == "hf"
        sampling = opts["sampling"] or {}
        out = []
        for i, ids in enumerate(encoded):
            budget = int(t.max_decoding_length(np.array([len(ids)]), opts["max_len_a"], opts["max_len_b"])[0])
            if opts["max_decoding_length"] is not None:
                budget = min(budget, opts["max_decoding_length"])
            if len(prefixes[i]) > budget:
                raise TranslationError(
                    f"source {i}: the target prefix has {len(prefixes[i])} tokens, more than the {budget} "
                    "this source may generate (max_decoding_length)"
                )
            options = SearchOptions(
                beam_size=opts["beam_size"],
                num_hypotheses=opts["num_hypotheses"],
                length_penalty=opts["length_penalty"],
                length_penalty_type=opts["length_penalty_type"],
                early_stopping=opts["early_stopping"] if hf else None,
                renormalize_logits=bool(opts["renormalize_logits"] and hf and opts["beam_size"] > 1),
                max_decoding_length=budget,
                min_decoding_length=min(opts["min_decoding_length"], budget),
                repetition_penalty=search["repetition_penalty"],
                no_repeat_ngram_size=search["no_repeat_ngram_size"],
                banned_ids=tuple(search["banned_ids"]),
                force_eos_at_budget=search["force_eos_at_budget"],
                return_scores=opts["return_scores"],
                **sampling,
            )
            out.append(
                SourceRequest(
                    input_ids=np.asarray(ids, dtype=np.int64),
                    options=options,
                    target_prefix=prefixes[i] or None,
                    key=(id(job), i),
                    index=i,
                )
            )
        return out

    # ------------------------------------------------------------------ the loop
    def _fits(self, job: Job) -> bool:
        """Whether ``job``'s sources fit the running batch: at most ``max_batch_rows`` decoder
        rows and ``max_batch_tokens`` padded source tokens (an empty batch takes any job)."""
        if not self._open:
            return True
        beam = int(job.options.get("beam_size") or self.model.translator.resolve_options()["beam_size"])
        rows = self._rows + beam * len(job.sources)
        width = max(max(job.lengths), max(self._lengths.values()))
        return (
            rows <= self.max_batch_rows
            and (len(self._open) + len(job.sources)) * width <= self.max_batch_tokens
        )

    def _admit(self) -> None:
        """Every waiting job that fits joins the running batch in one admission: the sources
        of equal search settings are encoded in one encoder run and searched as one group."""
        taken: list[tuple[Job, list]] = []
        while True:
            nxt = self._peek_sources()
            if nxt is None or not self._fits(nxt):
                break
            job = self._take(block=False)
            if job is None:
                break
            try:
                requests = self._requests(job)
            except (TranslationError, ValueError, TypeError) as exc:  # this request's options or sources
                job.finish(JobError(400, str(exc)))
                continue
            for r in requests:  # counted at once: the next job's _fits sees them
                beam = int(r.options.beam_size)
                self._open[r.key] = (job, r.index, beam)
                self._lengths[r.key] = job.lengths[r.index]
                self._rows += beam
            taken.append((job, requests))
        if not taken:
            return
        try:
            if self._state is None:
                self._state = self._new_state()
            self._state.admit([r for _, requests in taken for r in requests])
        except Exception as exc:
            sources = sum(len(job.sources) for job, _ in taken)
            logger.exception("model %s failed admitting %d sources", self.name, sources)
            self._fail_all(f"the model failed on this batch ({type(exc).__name__})")

    def _cancel_gone(self) -> None:
        """Sources of cancelled, ended or expired requests leave the batch before the next step."""
        now = time.monotonic()
        for key, (job, _, _) in list(self._open.items()):
            if job.cancelled or job.ended or job.expired(now):
                self._state.cancel(key)
                self._leave(key, job)
                if self.metrics is not None:
                    self.metrics.cancelled(self.name, 1, job.cancel_reason)
                job.finish(JobError(504, "the request timed out"))  # no-op when it already ended

    def _leave(self, key: tuple, job: Job) -> None:
        _, _, beam = self._open.pop(key)
        self._lengths.pop(key, None)
        self._partial.pop(key, None)
        self._rows -= beam

    def _fail_all(self, message: str) -> None:
        for job, _, _ in list(self._open.values()):
            job.finish(JobError(500, message))
        self._open.clear()
        self._lengths.clear()
        self._partial.clear()
        self._rows = 0
        self._state = None

    def _work(self) -> None:
        if not self._open:
            job = self._take(block=True, timeout=0.5)
            if job is None:
                return
            with self._cond:  # back to the front: _admit takes it through the same checks
                self._queue.appendleft(job)
                self._waiting += len(job.sources)
        self._admit()
        if not self._open:
            return
        self._cancel_gone()
        if not self._open:
            return
        state = self._state
        if self.metrics is not None:
            self.metrics.batch(self.name, int(state.num_rows), int(state.num_sources))
        try:
            finished = state.step()
        except Exception as exc:
            logger.exception("model %s failed on a step of %d sources", self.name, len(self._open))
            self._fail_all(f"the model failed on this batch ({type(exc).__name__})")
            return
        generated = 0
        for key, hypotheses in finished:
            entry = self._open.get(key)
            if entry is None:
                continue
            job, i, _ = entry
            self._leave(key, job)
            tok = job.translator.tokenizer
            n_best = int(job.options.get("num_hypotheses") or 1)
            hyps = list(hypotheses[:n_best])
            generated += sum(len(h.tokens) for h in hyps)
            job.deliver(i, Translation(job.sources[i], [tok.decode_target(h.tokens) for h in hyps], hyps))
        for key, (job, i, _) in self._open.items():
            if job.stream_tokens:
                tokens = [int(t) for t in state.partial(key)]
                if len(tokens) > self._partial.get(key, 0):
                    self._partial[key] = len(tokens)
                    job.token(i, tokens)
        if self.metrics is not None and generated:
            self.metrics.tokens(self.name, generated)
        if state.empty:
            self._state = None

    def stop(self, timeout: float = 10.0) -> None:
        super().stop(timeout)
        if self._thread is None or not self._thread.is_alive():
            for job, _, _ in list(self._open.values()):
                job.finish(JobError(503, "the server shut down before this request finished"))
            self._open.clear()


def check_continuous(model: Any) -> Optional[str]:
    """Why ``model`` cannot be batched continuously (None when it can)."""
    try:
        stepwise_api()
    except StepwiseUnavailable as exc:
        return str(exc)
    if not callable(getattr(model.translator.runner, "select", None)):
        return f"model {model.name}: its runner has no select (rows cannot leave a running batch): use --batching static"
    return None
