"""The schedulers: one per served model, each owning the model's translator on a thread of its own.

A request becomes a :class:`Job` (its sources, their options, its deadline) that the HTTP layer
submits to the model's scheduler and waits for on the event loop. A scheduler takes jobs from a
bounded queue (:class:`QueueFull` when it holds ``max_queue`` sources: the server answers 429) and
delivers each source's :class:`~transformer_ext.translator.Translation` back to the event loop
as soon as it is done (:meth:`Job.deliver`), then the job's end (:meth:`Job.finish`).

* :class:`SoloScheduler` (``--batching none``): each job alone through
  :meth:`Translator.translate <transformer_ext.translator.Translator.translate>`, in arrival order.
* :class:`StaticScheduler` (``--batching static``): waits ``batch_wait`` seconds after the first
  waiting job for more, takes jobs up to ``max_batch_rows`` / ``max_batch_tokens``, and
  translates the sources that share options in one call, each batch run to its end.

A cancelled job (timeout, client gone, shutdown) is skipped when it has not started; a batch that
already runs finishes, and its result is dropped. A model run that raises fails the jobs of that
batch only (:class:`JobError` with status 500); the scheduler goes on with the next batch.

The schedulers import no torch.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from ..translator import TranslationError, Translator

logger = logging.getLogger(__name__)

__all__ = [
    "BATCHING",
    "Job",
    "JobError",
    "QueueFull",
    "Scheduler",
    "SoloScheduler",
    "StaticScheduler",
]

BATCHING = ("continuous", "static", "none")
CANCEL_REASONS = {499: "disconnect", 504: "timeout", 503: "shutdown"}
DEFAULT_BATCH_WAIT = 0.005  # seconds a static batch waits for more requests after its first


class QueueFull(Exception):
    """The scheduler's queue holds ``max_queue`` sources: try again later (HTTP 429)."""

    def __init__(self, waiting: int, limit: int):
        super().__init__(f"the queue is full ({waiting} sources waiting, at most {limit}); retry later")
        self.waiting = waiting
        self.limit = limit


class JobError(Exception):
    """Why a job ended without its translations: ``status`` is the HTTP status it answers."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(eq=False)
class Job:
    """One request's sources on their way through a scheduler.

    ``translator``: the translator (or the language view of a multilingual model's translator,
    sharing its runner) that translates them; ``options``: :meth:`Translator.translate` options;
    ``target_prefix``: one text (or ``None``) per source; ``lengths``: each source's token count
    (admission by ``max_batch_tokens``); ``stream_tokens``: the job wants each generated token
    (continuous batching, greedy search). ``on_event`` is called on the event loop with
    ``("result", index, translation)``, ``("token", index, token_ids)`` and ``("end", error)``.
    """

    translator: Translator
    sources: list[str]
    options: dict
    target_prefix: list[Optional[str]]
    lengths: list[int]
    loop: asyncio.AbstractEventLoop
    on_event: Callable[..., None]
    stream_tokens: bool = False
    deadline: Optional[float] = None  # time.monotonic() after which the job is cancelled
    cancelled: bool = False
    cancel_status: Optional[int] = None  # why it was cancelled: 499 client gone, 504 timeout, 503 shutdown
    ended: bool = False
    submitted: float = field(default_factory=time.monotonic)
    remaining: int = 0

    def __post_init__(self):
        self.remaining = len(self.sources)
        self._lock = threading.Lock()

    @property
    def options_key(self) -> str:
        """Sources of jobs with equal keys may share one ``translate`` call."""
        return json.dumps([id(self.translator), self.options], sort_keys=True, default=str)

    def deliver(self, index: int, translation: Any) -> None:
        """Hand the translation of source ``index`` to the event loop (any thread)."""
        with self._lock:
            if self.ended:
                return
            self.remaining -= 1
            last = self.remaining == 0
        self._post(("result", index, translation))
        if last:
            self.finish(None)

    def token(self, index: int, tokens: list[int]) -> None:
        if not self.ended:
            self._post(("token", index, tokens))

    def finish(self, error: Optional[JobError]) -> None:
        """End the job (``error`` None: every result was delivered); only the first call counts."""
        with self._lock:
            if self.ended:
                return
            self.ended = True
        self._post(("end", error))

    def _post(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.on_event, *event)
        except RuntimeError:  # the event loop is closed: nobody waits any more
            pass

    @property
    def cancel_reason(self) -> str:
        """The ``reason`` label of the cancelled-sources metric."""
        return CANCEL_REASONS.get(self.cancel_status or 504, "timeout")

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline


class Scheduler:
    """The queue and thread shared by every scheduler; subclasses implement :meth:`_work`.

    ``metrics``: an object with ``batch(model, rows, sources)``, ``tokens(model, n)`` and
    ``queue(model, depth)`` (the server's :class:`~transformer_ext.serve.metrics.Metrics`), or None.
    """

    kind = "base"

    def __init__(
        self,
        name: str,
        *,
        max_queue: int,
        max_batch_rows: int,
        max_batch_tokens: int,
        metrics: Any = None,
    ):
        self.name = name
        self.max_queue = max_queue
        self.max_batch_rows = max_batch_rows
        self.max_batch_tokens = max_batch_tokens
        self.metrics = metrics
        self._queue: collections.deque[Job] = collections.deque()
        self._waiting = 0  # sources in the queue
        self._cond = threading.Condition()
        self._stop = False
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ the event loop's side
    def submit(self, job: Job) -> None:
        """Queue ``job``; :class:`QueueFull` when its sources do not fit."""
        with self._cond:
            if self._stop:
                raise JobError(503, "the server is shutting down")
            if self._waiting + len(job.sources) > self.max_queue:
                raise QueueFull(self._waiting, self.max_queue)
            self._queue.append(job)
            self._waiting += len(job.sources)
            self._report_queue()
            self._cond.notify_all()

    def cancel(self, job: Job) -> None:
        """``job`` leaves: skipped if waiting, its rows dropped at the next step if running."""
        job.cancelled = True
        with self._cond:
            self._cond.notify_all()

    @property
    def waiting(self) -> int:
        return self._waiting

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"serve-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread: the jobs still waiting end with 503."""
        with self._cond:
            self._stop = True
            left = list(self._queue)
            self._queue.clear()
            self._waiting = 0
            self._cond.notify_all()
        for job in left:
            job.finish(JobError(503, "the server shut down before this request ran"))
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the scheduler's thread
    def _report_queue(self) -> None:
        if self.metrics is not None:
            self.metrics.queue(self.name, self._waiting)

    def _take(self, block: bool, timeout: Optional[float] = None) -> Optional[Job]:
        """The next live job of the queue (cancelled and expired ones end here), or None."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                while self._queue:
                    job = self._queue.popleft()
                    self._waiting -= len(job.sources)
                    self._report_queue()
                    if job.cancelled:
                        self._skip(job, JobError(499, "cancelled"))
                        continue
                    if job.expired(time.monotonic()):
                        self._skip(job, JobError(504, "the request timed out before it ran"))
                        continue
                    return job
                if self._stop or not block:
                    return None
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)

    def _skip(self, job: Job, error: JobError) -> None:
        """``job`` leaves without being run (cancelled, or past its deadline)."""
        job.finish(error)
        if self.metrics is not None:
            self.metrics.cancelled(self.name, len(job.sources), job.cancel_reason)

    def _peek_sources(self) -> Optional[Job]:
        with self._cond:
            return self._queue[0] if self._queue else None

    def _run(self) -> None:
        while not self._stop:
            try:
                self._work()
            except Exception:  # a bug of the scheduler itself: logged, the thread goes on
                logger.exception("scheduler of model %s failed", self.name)
                time.sleep(0.01)

    def _work(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ running a batch
    def _translate(self, jobs_rows: Sequence[tuple[Job, int]]) -> None:
        """Translate the given (job, source index) pairs in one call (they share options) and
        deliver the results; a failure fails these jobs only."""
        first = jobs_rows[0][0]
        texts = [job.sources[i] for job, i in jobs_rows]
        prefixes = [job.target_prefix[i] for job, i in jobs_rows]
        options = dict(first.options)
        options["batch_size"] = max(1, len(texts))
        if self.metrics is not None:
            rows = len(texts) * int(options.get("beam_size") or 1)
            self.metrics.batch(self.name, rows, len(texts))
        try:
            out = first.translator.translate(
                texts, target_prefix=prefixes if any(p is not None for p in prefixes) else None, **options
            )
        except TranslationError as exc:  # an input the request checks could not see (a prefix too long)
            for job in {job for job, _ in jobs_rows}:
                job.finish(JobError(400, str(exc)))
            return
        except Exception as exc:
            logger.exception("model %s failed on a batch of %d sources", self.name, len(texts))
            for job in {job for job, _ in jobs_rows}:
                job.finish(JobError(500, f"the model failed on this batch ({type(exc).__name__})"))
            return
        generated = 0
        for (job, i), translation in zip(jobs_rows, out):
            generated += sum(len(h.tokens) for h in translation.hypotheses)
            job.deliver(i, translation)
        if self.metrics is not None:
            self.metrics.tokens(self.name, generated)


class SoloScheduler(Scheduler):
    """``--batching none``: each request alone through ``Translator.translate``."""

    kind = "none"

    def _work(self) -> None:
        job = self._take(block=True)
        if job is None:
            return
        self._translate([(job, i) for i in range(len(job.sources))])


class StaticScheduler(Scheduler):
    """``--batching static``: requests collected for ``batch_wait`` seconds, each batch run to its end."""

    kind = "static"

    def __init__(self, name: str, *, batch_wait: float = DEFAULT_BATCH_WAIT, **kwargs: Any):
        super().__init__(name, **kwargs)
        self.batch_wait = batch_wait

    def _work(self) -> None:
        job = self._take(block=True)
        if job is None:
            return
        jobs = [job]
        rows = len(job.sources)
        longest = max(job.lengths)
        end = time.monotonic() + self.batch_wait
        while rows < self.max_batch_rows:
            nxt = self._peek_sources()
            if nxt is None:
                left = end - time.monotonic()
                if left <= 0:
                    break
                with self._cond:
                    if not self._queue and not self._stop:
                        self._cond.wait(left)
                continue
            width = max(longest, max(nxt.lengths))
            if (
                rows + len(nxt.sources) > self.max_batch_rows
                or (rows + len(nxt.sources)) * width > self.max_batch_tokens
            ):
                break
            taken = self._take(block=False)
            if taken is None:
                continue
            jobs.append(taken)
            rows += len(taken.sources)
            longest = max(longest, max(taken.lengths))
        groups: dict[str, list[tuple[Job, int]]] = {}
        for j in jobs:
            groups.setdefault(j.options_key, []).extend((j, i) for i in range(len(j.sources)))
        now = time.monotonic()
        for j in jobs:
            if j.cancelled or j.expired(now):
                j.cancelled = True
                self._skip(j, JobError(499, "cancelled"))
        for pairs in groups.values():
            live = [(j, i) for j, i in pairs if not j.cancelled and not j.ended]
            if live:
                self._translate(live)
