"""Data parallelism over sources: several runners decode disjoint parts of one batch at once.

A batch of sources is split into contiguous parts, one per runner, and each part is searched on
its own runner in a thread of its own (ONNX Runtime releases the GIL while it runs a graph, and
so does numpy in the search's array work); the results are put back in source order. Each
runner should own its threads, for example ``OrtRunner(export_dir, intra_op_num_threads=1)``
twice on a 2-core machine instead of one runner with 2 threads.

Why: a decoder step at batch size is two kinds of work. The weight products are large GEMMs that
one runner spreads well over its threads; the attention products are thousands of tiny GEMMs
(one per row and head) that ONNX Runtime's thread pool spreads badly: on the 2-core Zen 4
measured here they took 0.97-1.46x as long with 2 threads as with 1 at 64-256 rows
(``benchmarks/probes/probe_contrib_attention.py``), and beam search at 16-64 sources spends a third of
its step there. Two 1-thread runners on half the sources each keep every attention product on
one thread and still use both cores. ``benchmarks/decode/bench_decode.py --threads 1,2,2x1`` measures it,
with CTranslate2 given the same split (``inter_threads``).

The search of a part is the one a single runner would make for those sources alone: float32
tokens equal those of one runner on the whole batch (padding and product shapes differ, so
logits may differ in the last bits). Random sampling splits too: each source draws from a stream
of its own, keyed by the seed and the source's index in the whole input (``source_index``,
docs/decoding.md "Sampling streams"), and each part is given its sources' indices, so a split
sample is the unsplit one.

When one part fails, or the caller is interrupted while the parts run (Ctrl-C raises
KeyboardInterrupt in the waiting thread), the other parts stop at their next decoder step
(raising :class:`PartCancelled` inside their threads) and :meth:`SourceParallel.run` re-raises the
first error once every part has stopped: an interrupted batch ends within one step.

The threads share the interpreter lock for the search's Python work (the beam bookkeeping
between two graph runs), which limits what two 1-thread runners gain at beam search:
:class:`~transformer_ext.runtimes.procpool.ProcessSourceParallel` runs each part in a worker
process instead (same results, same cancellation, the runner made in the worker), and
:func:`open_source_parallel` builds either from one runner factory (``pool="threads"`` or
``"processes"``).
"""

from __future__ import annotations

import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from transformer_ext import decoding

__all__ = [
    "SourceParallel",
    "PartCancelled",
    "split_sources",
    "open_source_parallel",
    "PER_SOURCE_OPTIONS",
    "POOLS",
]

# Search options that may hold one value per source (sliced with the sources); the others are
# passed to every part as they are.
PER_SOURCE_OPTIONS = ("max_decoding_length", "min_decoding_length", "target_prefix", "source_index")
POLL_SECONDS = 0.1  # the longest wait for the parts between two looks at pending signals
POOLS = ("threads", "processes")  # open_source_parallel's pool kinds


class PartCancelled(Exception):
    """Raised inside a part's search when another part failed or the caller was interrupted."""


class _StopFlag(Protocol):
    def is_set(self) -> bool: ...


class _StoppableRunner:
    """A runner as one part's search sees it: every step first checks the batch's stop flag
    (set when another part fails or the caller is interrupted, Ctrl-C included: a
    ``threading.Event`` in a thread, the worker's control channel in a process worker), so a
    part ends within one step instead of decoding to its end. Every other attribute is the
    runner's."""

    _STEPS = ("step", "step_top_k", "step_with_attention")

    def __init__(self, runner: Any, stop: _StopFlag):
        self._runner = runner
        for name in self._STEPS:
            method = getattr(runner, name, None)
            if method is not None:
                setattr(self, name, self._checked(method, stop))

    @staticmethod
    def _checked(method: Callable[..., Any], stop: _StopFlag) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if stop.is_set():
                raise PartCancelled("another part of the batch failed, or the decode was interrupted")
            return method(*args, **kwargs)

        return call

    def __getattr__(self, name: str) -> Any:
        if name in self._STEPS:  # not set in __init__: the runner has no such method
            raise AttributeError(name)
        return getattr(self._runner, name)


def split_sources(n: int, parts: int) -> list[slice]:
    """``n`` sources in at most ``parts`` contiguous, non-empty slices whose sizes differ by at most one."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if isinstance(parts, bool) or not isinstance(parts, (int, np.integer)) or parts < 1:
        raise ValueError(f"parts must be a positive int, got {parts!r}")
    parts = min(int(parts), int(n))
    size, extra = divmod(int(n), parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + size + (1 if i < extra else 0))
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def plan_parts(
    input_ids: Any, src_lengths: Any, n_parts: int, options: dict
) -> tuple[np.ndarray, np.ndarray, list[slice], Callable[[slice], dict]]:
    """The checked batch of a split search: ``(ids, lengths, parts, part_options)``, ``parts``
    the sources' slices (:func:`split_sources`) and ``part_options(slice)`` the options of one
    part (those of :data:`PER_SOURCE_OPTIONS` that hold one value per source sliced with it).
    Random sampling over several parts gives each part its sources' ``source_index`` (default
    ``0 .. batch-1``), so every source draws from the stream it has in the unsplit batch.

    Raises ValueError for a batch that is not ``[batch, src_len]`` / ``[batch]`` with batch >= 1
    and for a per-source option of another length."""
    ids = np.asarray(input_ids)
    lengths = np.asarray(src_lengths)
    if ids.ndim != 2 or lengths.ndim != 1 or lengths.shape[0] != ids.shape[0] or ids.shape[0] == 0:
        raise ValueError(
            f"input_ids must be [batch, src_len] and src_lengths [batch] with batch >= 1, got "
            f"{ids.shape} and {lengths.shape}"
        )
    parts = split_sources(ids.shape[0], n_parts)
    n = ids.shape[0]
    if len(parts) > 1:
        sampling = (
            options.get("sampling_topk", 1) != 1
            or options.get("sampling_topp", 1.0) != 1.0
            or options.get("sampling_temperature", 1.0) != 1.0
        )
        if sampling and options.get("source_index") is None:
            options = dict(options, source_index=np.arange(n, dtype=np.int64))
        for name in PER_SOURCE_OPTIONS:
            value = options.get(name)
            if value is not None and not np.isscalar(value) and len(value) != n:
                raise ValueError(f"{name} holds {len(value)} values for {n} sources")

    def part_options(sl: slice) -> dict:
        out = dict(options)
        for name in PER_SOURCE_OPTIONS:
            value = options.get(name)
            if value is not None and not np.isscalar(value):
                out[name] = value[sl]
        return out

    return ids, lengths, parts, part_options


def check_part_result(search: Any, part: Any, sl: slice) -> list:
    """A part's result as :meth:`SourceParallel.run` joins it: a list with one entry per source
    of ``sl`` (TypeError otherwise)."""
    if not isinstance(part, list) or len(part) != sl.stop - sl.start:
        raise TypeError(f"{search!r} must return a list with one entry per source")
    return part


class SourceParallel:
    """Runs a search (:func:`transformer_ext.decoding.generate`, ``greedy_decode`` or
    ``beam_search``) over a batch with several runners at once, each on a contiguous part of the
    sources.

    Args:
        runners: one runner per part, each of the same model (their ``info`` must be equal);
            at least one. A runner's state is only ever touched by the thread running its part.

    Use as a context manager, or call :meth:`close` to stop the threads.
    """

    def __init__(self, runners: Sequence[Any]):
        self.runners = list(runners)
        if not self.runners:
            raise ValueError("SourceParallel needs at least one runner")
        infos = [getattr(r, "info", None) for r in self.runners]
        if any(info != infos[0] for info in infos[1:]):
            raise ValueError("every runner of a SourceParallel must run the same model (their info differs)")
        self.info = infos[0]
        self._threads = ThreadPoolExecutor(len(self.runners), thread_name_prefix="source-parallel")

    def __enter__(self) -> "SourceParallel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._threads.shutdown(wait=True)

    def run(self, search: Callable[..., list], input_ids: Any, src_lengths: Any, **options: Any) -> list:
        """``search(runner, input_ids, src_lengths, **options)`` on every part at once -> one
        result per source, in source order (the concatenation of the parts' lists).

        ``options`` named in :data:`PER_SOURCE_OPTIONS` are sliced with the sources when they
        hold one value per source; random sampling (``sampling_topk``, ``sampling_topp``,
        ``sampling_temperature`` other than greedy) gives the samples of the unsplit batch, each
        part getting its sources' ``source_index`` (:func:`plan_parts`).
        """
        ids, lengths, parts, part_options = plan_parts(input_ids, src_lengths, len(self.runners), options)
        if len(parts) == 1:
            return search(self.runners[0], ids, lengths, **options)
        stop = threading.Event()
        futures = [
            self._threads.submit(
                search, _StoppableRunner(runner, stop), ids[sl], lengths[sl], **part_options(sl)
            )
            for runner, sl in zip(self.runners, parts)
        ]
        results: list = []
        try:
            # Waits of at most POLL_SECONDS: between them this thread runs its signal handlers,
            # so Ctrl-C is seen within one even when the OS delivered it to a worker thread.
            pending = set(futures)
            while pending:
                done, pending = wait(pending, timeout=POLL_SECONDS, return_when=FIRST_EXCEPTION)
                for future in done:
                    if future.exception() is not None:
                        raise future.exception()
            for sl, future in zip(parts, futures):
                results.extend(check_part_result(search, future.result(), sl))
        except BaseException:  # a part failed, or the caller was interrupted (KeyboardInterrupt)
            stop.set()  # the other parts stop at their next step
            wait(futures)
            raise
        return results

    def generate(self, input_ids: Any, src_lengths: Any, **options: Any) -> list[list[decoding.Hypothesis]]:
        """:func:`transformer_ext.decoding.generate` over the parts."""
        return self.run(decoding.generate, input_ids, src_lengths, **options)


def open_source_parallel(make_runner: Callable[[], Any], workers: int, *, pool: str, **process_options: Any):
    """``workers`` runners of ``make_runner()`` decoding the parts of each batch at once:
    ``pool="threads"``: a :class:`SourceParallel` over runners made here, one thread each;
    ``pool="processes"``: a :class:`~transformer_ext.runtimes.procpool.ProcessSourceParallel`,
    each runner made in a worker process of its own (``make_runner`` must pickle;
    ``process_options`` are its keyword arguments). Both have ``info``, ``run``, ``generate``,
    ``close`` and the context manager."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive int, got {workers!r}")
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {list(POOLS)}, got {pool!r}")
    if pool == "processes":
        from .procpool import ProcessSourceParallel

        return ProcessSourceParallel(make_runner, workers, **process_options)
    if process_options:
        raise TypeError(f"pool='threads' takes no {sorted(process_options)} (options of the process pool)")
    return SourceParallel([make_runner() for _ in range(workers)])
