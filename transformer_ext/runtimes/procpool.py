"""Data parallelism over sources in worker processes: the parts of a batch decoded at once, each
in a process of its own, so that no part's host work waits on another's interpreter lock.

:class:`~transformer_ext.runtimes.pool.SourceParallel` runs the parts in threads of one process.
ONNX Runtime and numpy's bulk work release the GIL, but the search's Python work between two
graph runs (the beam bookkeeping, the logit processors, the cache views) does not, so two
threads' host work takes turns. :class:`ProcessSourceParallel` runs each part in a worker process that holds a runner of
its own (``make_runner()``, called once in the worker: e.g. ``functools.partial(OrtRunner,
export_dir, intra_op_num_threads=1)``). The workers are started once, with the ``spawn`` (default)
or ``forkserver`` start method, and reused by every call; a worker imports only what its runner
and the search need (numpy and onnxruntime for an ``OrtRunner``: never torch, recorded per worker
in ``workers_torch_imported``). The sources, the options and the results cross the process
boundary pickled, so the search (``decoding.generate``, ``greedy_decode``, ``beam_search``, or a
module-level function or ``functools.partial`` of one) must pickle; a lambda or closure is a
TypeError. :func:`transformer_ext.runtimes.pool.open_source_parallel` builds either pool from one
runner factory (``pool="threads"`` or ``"processes"``).

Results: a part's search is the one its worker's runner makes for those sources alone, exactly
as a thread of ``SourceParallel`` makes it: float32 tokens equal one runner's on the whole batch.

Cancellation. Every step of a part first looks at the worker's channel from the parent (one
``poll`` of a pipe), as ``SourceParallel``'s threads look at their stop event:

* A part that fails (its exception is pickled back and re-raised by :meth:`run`, with the
  worker's traceback as its cause), or a part that returns no list of one entry per source,
  makes the parent send every other busy worker a cancel; each stops at its next decoder step
  and answers, and :meth:`run` raises the first error once every part has stopped.
* Ctrl-C: the workers ignore SIGINT (a terminal sends it to the whole process group; the parent
  decides), the parent's wait raises KeyboardInterrupt within :data:`~.pool.POLL_SECONDS`, sends
  the cancels and waits for the answers (a second Ctrl-C stops that wait at once; the workers
  still stop at their next step and the pool stays usable: answers of an abandoned call are
  recognised by its call number and dropped). A Ctrl-C that lands inside the parent's write or
  read of a message (a few microseconds of a call) may leave that pipe mid-message: the pool is
  then closed at once, its workers terminated.
* A worker that dies (killed, or its interpreter crashed) is seen through its process
  sentinel while the parent waits: :meth:`run` raises :class:`WorkerError` naming the worker,
  its pid, how it ended and the sources it held, after stopping the other parts, and the pool
  is closed. A worker that does not answer a cancel within ``cancel_timeout`` seconds is
  terminated and the pool closed.
* A worker whose parent is gone (killed without closing the pool) sees the end of its pipe at
  its next step or while idle, and exits: no orphan processes.
* :meth:`close`, the context manager, garbage collection and interpreter exit (a
  ``weakref.finalize``) stop the workers: a stop message, then SIGTERM and SIGKILL for any that
  is still running after ``close_timeout`` seconds; every worker is joined (no zombies).

Memory: the export's ``weights.data`` is mapped by ONNX Runtime (external data, regions aligned
to pages), not read, so the pages of a tensor ONNX Runtime uses in place (embeddings, norms,
biases) are shared by every worker's mapping (page cache). What each session builds from the
weights is private to its process: the packed copies of the weight products, which ONNX Runtime
makes at session creation and after which it drops the mapping of those initializers; two
sessions in one process (the thread pool) pack twice as well. Measured with
:func:`process_memory` (``/proc/PID/smaps_rollup``) after a beam-4 decode of 16 sources, ``base``
float32 (``weights.data`` 200 MiB; ``probe_split_workers.py --memory``): one runner in a process
302 MiB PSS, 23 MiB of it the mapped file; two runners in threads 496 MiB; one worker process
333 MiB (the parent 32 MiB of it); two worker processes 559 MiB, each worker 270 MiB of which the
mapped file's 23 MiB is shared (11 MiB PSS each) and about 250 MiB private: the packed weight
products are per worker, as they are per runner in threads. ``OrtRunner(pack_weights=False)``
(ONNX Runtime's ``session.disable_prepacking``) leaves the products reading the mapped file, so
two such workers share the whole file: 368 MiB PSS for both, each mapping 206 MiB of it (99 MiB
PSS, its half) with 63 MiB private; but the split decoded 1.6x slower, greedy and beam 4 at batch
16 (one run on a loaded 2-core machine). ``base`` int8 (``weights.data`` 74 MiB): one runner 153
MiB, two in threads 211 MiB, two worker processes 274 MiB (121 MiB each).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import select
import signal
import sys
import threading
import time
import traceback
import weakref
from multiprocessing import connection as mp_connection
from typing import Any, Callable, Optional

from transformer_ext import decoding
from transformer_ext.export_format import WEIGHTS_FILE

from .pool import POLL_SECONDS, PartCancelled, _StoppableRunner, check_part_result, plan_parts

__all__ = ["ProcessSourceParallel", "WorkerError", "START_METHODS", "process_memory"]

logger = logging.getLogger(__name__)

START_METHODS = ("spawn", "forkserver")


class WorkerError(RuntimeError):
    """A worker process of a :class:`ProcessSourceParallel` died, or did not stop when told to:
    the message names the worker and its pid; the pool is closed (open a new one)."""


class _RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker (the ``__cause__`` of the re-raised one)."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text


# ---------------------------------------------------------------------------------- the worker


class _Exit(BaseException):
    """Raised in a worker's search when its parent is gone or told it to stop: the worker ends."""


class _ControlChannel:
    """A worker's stop flag for one part (``_StoppableRunner`` asks ``is_set()`` before each
    step): reads what the parent sent since, without waiting. A cancel of this call sets it; a
    stop, or the end of the pipe (the parent is gone), ends the worker; a cancel of an earlier
    call is dropped."""

    def __init__(self, conn: mp_connection.Connection, job: int, deferred: list):
        self.conn, self.job, self.cancelled = conn, job, False
        self.deferred = deferred  # a call's request read here, for the worker's loop
        self._poll = select.poll()  # one poll(2) per step
        self._poll.register(conn.fileno(), select.POLLIN)

    def is_set(self) -> bool:
        while not self.cancelled and not self.deferred and self._poll.poll(0):
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                raise _Exit from None
            if message[0] == "stop":
                raise _Exit
            if message[0] == "cancel" and message[1] == self.job:
                self.cancelled = True
            elif message[0] == "run":  # (the parent cancels a call before it sends the next)
                self.deferred.append(message)
        return self.cancelled


def _pack_error(exc: BaseException) -> tuple:
    """An exception as a worker sends it: (pickled exception or None, type name, message, traceback)."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)  # some exceptions pickle but do not unpickle (required arguments)
    except Exception:
        data = None
    return data, f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), text


def _send_quietly(conn: mp_connection.Connection, message: tuple) -> bool:
    """Send ``message``; False when the parent is gone."""
    try:
        conn.send(message)
        return True
    except OSError:
        return False


def _worker_main(conn: mp_connection.Connection, make_runner: Callable[[], Any], index: int) -> None:
    """A worker's life: make the runner, say ready (or send the error), then run parts until
    told to stop or the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle (module docstring)
    try:
        runner = make_runner()
        ready = {
            "pid": os.getpid(),
            "info": getattr(runner, "info", None),
            "torch_imported": "torch" in sys.modules,
        }
    except BaseException as exc:
        _send_quietly(conn, ("error", 0, _pack_error(exc)))
        return
    try:
        conn.send(("ready", 0, ready))
    except OSError:
        return  # the parent is gone
    except Exception as exc:  # (pickling: nothing was sent)
        error = TypeError(f"the runner's info cannot be sent to the parent: {exc}")
        _send_quietly(conn, ("error", 0, _pack_error(error)))
        return
    deferred: list = []
    while True:
        try:
            message = deferred.pop(0) if deferred else conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if message[0] == "stop":
            return
        if message[0] == "cancel":  # of a part answered already: answered again, so a parent
            _send_quietly(conn, ("cancelled", message[1], None))  # that lost the answer still gets one
            continue
        job = message[1]
        try:
            search, ids, lengths, options = pickle.loads(message[2])
            stop = _ControlChannel(conn, job, deferred)
            result = search(_StoppableRunner(runner, stop), ids, lengths, **options)
            reply = ("done", job, result)
        except PartCancelled:
            reply = ("cancelled", job, None)
        except _Exit:
            return
        except BaseException as exc:
            reply = ("error", job, _pack_error(exc))
        try:
            try:
                conn.send(reply)  # pickles first: a result that does not pickle sends nothing
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                error = TypeError(f"the search's result cannot be sent back from the worker: {exc}")
                conn.send(("error", job, _pack_error(error)))
        except OSError:
            return  # the parent is gone


# ---------------------------------------------------------------------------------- the parent


class _Worker:
    """The parent's handle on one worker process."""

    def __init__(self, index: int, process: Any, conn: mp_connection.Connection):
        self.index, self.process, self.conn = index, process, conn
        self.pid: int = process.pid
        self.info: Any = None
        self.torch_imported: Optional[bool] = None

    def name(self) -> str:
        return f"source-parallel worker {self.index} (pid {self.pid})"

    def ended(self) -> str:
        """How the (dead) process ended, in words."""
        self.process.join(1.0)
        code = self.process.exitcode
        if code is None:
            return "stopped answering"
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with status {code}"


def _shutdown(workers: list, timeout: float) -> None:
    """Stop every worker: a stop message, a join of at most ``timeout`` s, then SIGTERM, then
    SIGKILL; every process joined and every pipe closed."""
    for w in workers:
        try:
            w.conn.send(("stop",))  # a busy worker reads it at its next step
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + timeout
    for w in workers:
        w.process.join(max(0.0, deadline - time.monotonic()))
    for w in workers:
        if w.process.is_alive():
            logger.warning("%s did not stop within %.1f s: terminating it", w.name(), timeout)
            w.process.terminate()
            w.process.join(2.0)
        if w.process.is_alive():
            w.process.kill()
            w.process.join()
        w.conn.close()
    workers.clear()


def _unpack_error(payload: tuple, where: str) -> BaseException:
    """The exception a worker sent, to re-raise here: the original when it unpickles (else a
    RuntimeError with its type and message), its traceback as ``__cause__``, ``where`` in a note."""
    data, type_name, message, text = payload
    exc: Optional[BaseException] = None
    if data is not None:
        try:
            exc = pickle.loads(data)
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = RuntimeError(f"{type_name}: {message}")
    exc.__cause__ = _RemoteTraceback(text)
    exc.add_note(f"(raised in {where})")
    return exc


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


class ProcessSourceParallel:
    """Runs a search over a batch in several worker processes at once, each on a contiguous part
    of the sources with a runner of its own (the module docstring says how and why).

    Args:
        make_runner: a picklable callable without arguments that returns a runner, called once
            in each worker (``functools.partial(OrtRunner, export_dir, intra_op_num_threads=1)``);
            every worker's runner must have the same ``info``.
        workers: the number of worker processes (at least 1).
        start_method: ``"spawn"`` (default) or ``"forkserver"``: a fresh interpreter either way
            (never ``fork``: the parent may hold threads and ONNX Runtime or torch thread pools).
            With ``spawn`` the workers import the parent's ``__main__`` module as
            ``__mp_main__``: a script that opens a pool needs the ``if __name__ == "__main__":``
            guard.
        start_timeout: seconds the workers may take to make their runners (a WorkerError after).
        cancel_timeout: seconds a cancelled worker may take to stop before it is terminated.
        close_timeout: seconds :meth:`close` waits for the workers before terminating them.

    Raises:
        ValueError: a bad argument, or runners of different models.
        TypeError: ``make_runner`` does not pickle.
        WorkerError: a worker died or did not start in time; whatever ``make_runner`` raised in a
            worker is re-raised as it is (its worker named in a note).

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        make_runner: Callable[[], Any],
        workers: int,
        *,
        start_method: str = "spawn",
        start_timeout: float = 600.0,
        cancel_timeout: float = 60.0,
        close_timeout: float = 10.0,
    ):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive int, got {workers!r}")
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {list(START_METHODS)}, got {start_method!r}")
        if not callable(make_runner):
            raise TypeError(f"make_runner must be a callable that returns a runner, got {make_runner!r}")
        start_timeout = _positive("start_timeout", start_timeout)
        self.cancel_timeout = _positive("cancel_timeout", cancel_timeout)
        close_timeout = _positive("close_timeout", close_timeout)
        try:
            pickle.dumps(make_runner)
        except Exception as exc:
            raise TypeError(
                f"make_runner must pickle (a module-level function, a class, or a functools.partial "
                f"of one), got {make_runner!r}: {exc}"
            ) from None
        self._workers: list[_Worker] = []
        self._job = 0  # the call number: answers of an abandoned call are dropped
        self._lock = threading.Lock()  # one call at a time (the workers hold one part each)
        self._closed: Optional[str] = None  # why the pool is closed
        self._finalizer = weakref.finalize(self, _shutdown, self._workers, close_timeout)
        context = multiprocessing.get_context(start_method)
        try:
            for index in range(workers):
                parent_conn, child_conn = context.Pipe(duplex=True)
                process = context.Process(
                    target=_worker_main,
                    args=(child_conn, make_runner, index),
                    name=f"source-parallel-{index}",
                    daemon=True,
                )
                process.start()
                child_conn.close()  # the worker's end lives in the worker only: EOF when it dies
                self._workers.append(_Worker(index, process, parent_conn))
            self._await_ready(start_timeout)
        except BaseException:
            self.close()
            raise
        infos = [w.info for w in self._workers]
        if any(info != infos[0] for info in infos[1:]):
            self.close()
            raise ValueError("every worker's runner must run the same model (their info differs)")
        self.info = infos[0]

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> "ProcessSourceParallel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers (idempotent); :meth:`run` is a RuntimeError afterwards."""
        if self._closed is None:
            self._closed = "it was closed"
        self._finalizer()

    @property
    def worker_pids(self) -> list[int]:
        """The workers' process ids, in part order (empty once closed)."""
        return [w.pid for w in self._workers]

    @property
    def workers_torch_imported(self) -> list[bool]:
        """Whether each worker's interpreter had imported torch once its runner was made."""
        return [bool(w.torch_imported) for w in self._workers]

    def memory(self, mapped_name: Optional[str] = WEIGHTS_FILE) -> list[dict[str, int]]:
        """:func:`process_memory` of every worker (Linux), in part order."""
        return [process_memory(pid, mapped_name) for pid in self.worker_pids]

    def _check_open(self) -> None:
        if self._closed is not None:
            raise RuntimeError(f"this ProcessSourceParallel is closed ({self._closed}): open a new one")

    def _await_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = list(self._workers)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                names = ", ".join(w.name() for w in pending)
                raise WorkerError(f"{names} did not make their runners within {timeout:g} s (start_timeout)")
            for w, kind, payload in self._replies(pending, min(POLL_SECONDS, left), job=0):
                pending.remove(w)
                if kind == "ready":
                    w.info, w.torch_imported = payload["info"], payload["torch_imported"]
                elif kind == "error":
                    raise _unpack_error(payload, f"{w.name()}, making its runner")
                else:
                    raise WorkerError(f"{w.name()} {w.ended()} while making its runner")

    # ------------------------------------------------------------------ messages
    def _replies(self, workers: list[_Worker], timeout: float, job: int) -> list[tuple[_Worker, str, Any]]:
        """Waits at most ``timeout`` s for an answer of any of ``workers`` to call ``job`` ->
        ``(worker, kind, payload)`` for each that answered (``kind`` "died" for one whose pipe
        ended or whose process exited without answering)."""
        objects = [w.conn for w in workers] + [w.process.sentinel for w in workers]
        ready = set(mp_connection.wait(objects, timeout))
        out = []
        for w in workers:
            if w.conn not in ready and w.process.sentinel not in ready:
                continue
            answer = None
            while answer is None:
                try:
                    if not w.conn.poll():
                        break
                    data = w.conn.recv_bytes()
                except (EOFError, OSError):
                    answer = (w, "died", None)
                    break
                except BaseException:  # interrupted inside a read: the pipe may be left mid-message
                    self._abort(f"a message from {w.name()} was interrupted")
                    raise
                try:
                    kind, number, payload = pickle.loads(data)
                except Exception as exc:  # (a result of a class this process cannot import)
                    error = TypeError(f"the answer of {w.name()} cannot be unpickled here: {exc}")
                    kind, number, payload = "error", job, _pack_error(error)
                if number == job:
                    answer = (w, kind, payload)  # (else the answer of an abandoned call)
            if answer is None and w.process.sentinel in ready:
                answer = (w, "died", None)
            if answer is not None:
                out.append(answer)
        return out

    def _send(self, w: _Worker, message: tuple, where: str) -> None:
        try:
            w.conn.send(message)
        except OSError:
            self._closed = f"{w.name()} {w.ended()}"
            raise WorkerError(
                f"{w.name()} {w.ended()} before {where}; the pool is closed: open a new one"
            ) from None
        except BaseException:  # interrupted inside a write: the pipe may hold half a message
            self._abort(f"a message to {w.name()} was interrupted")
            raise

    def _abort(self, why: str) -> None:
        """Close the pool at once (SIGTERM, no stop message waited for): a pipe may be mid-message."""
        self._closed = why
        _shutdown(self._workers, 0.0)
        self._finalizer()

    # ------------------------------------------------------------------ searching
    def run(self, search: Callable[..., list], input_ids: Any, src_lengths: Any, **options: Any) -> list:
        """``search(runner, input_ids, src_lengths, **options)`` on every part at once, each in
        its worker -> one result per source, in source order (as :meth:`SourceParallel.run
        <transformer_ext.runtimes.pool.SourceParallel.run>`: per-source options sliced, each part
        sampling its sources' streams). ``search`` and the options must pickle (TypeError). Calls
        from several threads take turns."""
        with self._lock:
            return self._run(search, input_ids, src_lengths, options)

    def _run(self, search: Callable[..., list], input_ids: Any, src_lengths: Any, options: dict) -> list:
        self._check_open()
        ids, lengths, parts, part_options = plan_parts(input_ids, src_lengths, len(self._workers), options)
        try:
            payloads = [
                pickle.dumps((search, ids[sl], lengths[sl], part_options(sl)), pickle.HIGHEST_PROTOCOL)
                for sl in parts
            ]
        except Exception as exc:
            raise TypeError(
                f"the search and its options must pickle to reach the worker processes (a module-level "
                f"function or a functools.partial of one, not a lambda or a closure): {exc}"
            ) from None
        self._job += 1
        job, n = self._job, ids.shape[0]
        busy: dict[int, slice] = {}
        results: dict[int, list] = {}
        try:
            for w, sl, payload in zip(self._workers, parts, payloads):
                busy[w.index] = sl  # (before the send: an interrupted send is cancelled too)
                self._send(w, ("run", job, payload), f"sources {sl.start}-{sl.stop - 1} were sent to it")
            while busy:
                for w, kind, payload in self._replies([self._workers[i] for i in busy], POLL_SECONDS, job):
                    sl = busy.pop(w.index)
                    where = f"{w.name()} on sources {sl.start}-{sl.stop - 1} of {n}"
                    if kind == "done":
                        results[w.index] = check_part_result(search, payload, sl)
                    elif kind == "error":
                        raise _unpack_error(payload, where)
                    elif kind == "died":
                        self._closed = f"{w.name()} {w.ended()}"
                        raise WorkerError(
                            f"{where}: the worker {w.ended()}; the pool is closed: open a new one"
                        )
                    else:
                        raise WorkerError(f"{where}: unexpected answer {kind!r}")
        except BaseException:  # a part failed, a worker died, or the caller was interrupted
            self._stop_parts(job, busy)
            raise
        return [r for index in sorted(results) for r in results[index]]

    def _stop_parts(self, job: int, busy: dict[int, slice]) -> None:
        """Cancel call ``job`` in the ``busy`` workers and wait until each answered (a second
        KeyboardInterrupt ends the wait; the workers still stop at their next step); a worker
        that died or does not answer within ``cancel_timeout`` closes the pool."""
        if not self._workers:
            return  # aborted: every worker is gone already
        for index in busy:
            try:
                self._workers[index].conn.send(("cancel", job))
            except OSError:
                pass  # dead: seen below
        deadline = time.monotonic() + self.cancel_timeout
        while busy:
            left = deadline - time.monotonic()
            if left <= 0:
                names = ", ".join(self._workers[i].name() for i in busy)
                logger.warning(
                    "%s did not stop within %g s of a cancel: closing the pool", names, self.cancel_timeout
                )
                self._closed = f"{names} did not stop within cancel_timeout"
                break
            for w, kind, _ in self._replies([self._workers[i] for i in busy], min(POLL_SECONDS, left), job):
                busy.pop(w.index)
                if kind == "died":
                    self._closed = f"{w.name()} {w.ended()}"
        if self._closed is not None:
            self.close()

    def generate(self, input_ids: Any, src_lengths: Any, **options: Any) -> list[list[decoding.Hypothesis]]:
        """:func:`transformer_ext.decoding.generate` over the parts."""
        return self.run(decoding.generate, input_ids, src_lengths, **options)


def process_memory(pid: int, mapped_name: Optional[str] = None) -> dict[str, int]:
    """The memory of process ``pid`` in KiB, from ``/proc/PID/smaps_rollup`` (Linux): its keys in
    lower case (``rss``, ``pss``, ``pss_anon``, ``pss_file``, ``shared_clean``, ``private_dirty``,
    ...); with ``mapped_name``, also ``mapped_rss`` / ``mapped_pss``: the resident and
    proportional size of the process's mappings of files whose path ends with that name
    (``/proc/PID/smaps``), and ``mapped_regions``, how many mappings there are.

    Raises OSError where ``/proc`` has no such file (not Linux, or no such process)."""
    out: dict[str, int] = {}
    with open(f"/proc/{int(pid)}/smaps_rollup", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            fields = rest.split()
            if len(fields) == 2 and fields[1] == "kB":
                out[key.strip().lower()] = int(fields[0])
    if mapped_name is not None:
        rss = pss = regions = 0
        inside = False
        with open(f"/proc/{int(pid)}/smaps", encoding="utf-8", errors="replace") as f:
            for line in f:
                head = line.split()
                if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                    inside = len(head) >= 6 and head[-1].endswith(mapped_name)
                    regions += inside
                elif inside and head and head[0] in ("Rss:", "Pss:"):
                    if head[0] == "Rss:":
                        rss += int(head[1])
                    else:
                        pss += int(head[1])
        out.update(mapped_rss=rss, mapped_pss=pss, mapped_regions=regions)
    return out
