"""Streaming translation in token batches: read lazily, sort a window by length, batch by tokens,
yield results in input order as soon as they are complete (CTranslate2's ``translate_iterable``
with ``batch_type="tokens"``).

The defaults are chosen by the work a decode does, counted on benchmarks/decode/bench_batching.py's
5,000 demo lines (greedy; the counts do not depend on the machine): a decode costs one runner
call per step of each batch (the batch's longest output) and ``rows x steps`` row-steps.
Sentence batches of 64 over the whole input sorted by length take 79 batches and 2,915 runner
calls; token batches of 2,048 tokens in windows of 512 lines took 104 batches and 3,941 calls:
the demo's lines are long (38 tokens on average, at most 47), so 2,048 tokens held about 45
rows, and a window of 512 lines sorts (and ends in a part batch) every 512 lines. With windows
of :data:`DEFAULT_WINDOW` lines and :data:`DEFAULT_MAX_BATCH_TOKENS` tokens (no row cap): 48
batches and 1,826 calls (2,560 tokens: 76 and 2,863). Row-steps: a runner with ``select`` drops
finished rows, so every batching costs each row its own steps (165,217 here); without it the
rows of a batch all step until its longest output ends (184,152 for the sentence batches). Timed
on a quiet 2-core Xeon (benchmarks/results/bench_batching*.json), 4,096-token batches translate
those lines 1.32x faster than sentence batches of 64 on the eager runner and 1.09x through ONNX
Runtime (2,560 tokens: 0.98x eager), so fewer, larger batches win on the CPU. A window's batches
are decoded in input order (the batch holding the window's first line first), so the first
results come after one batch however large the window.

This module imports no torch: it drives any :class:`~transformer_ext.translator.Translator`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_BATCH_TOKENS", "DEFAULT_WINDOW", "token_batches", "translate_iterable"]

DEFAULT_MAX_BATCH_TOKENS = 4096  # padded source tokens per batch (the module docstring says why)
DEFAULT_WINDOW = 8192  # lines read, sorted and batched together


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def token_batches(
    lengths: Sequence[int], max_batch_tokens: int, max_batch_size: Optional[int] = None
) -> list[list[int]]:
    """Indices into ``lengths`` grouped into batches, shortest first: each batch is a run of the
    sorted order whose padded size (rows times its longest length) is at most
    ``max_batch_tokens`` and whose row count is at most ``max_batch_size``; a single longer
    entry is a batch of its own."""
    max_batch_tokens = _check_positive_int("max_batch_tokens", max_batch_tokens)
    if max_batch_size is not None:
        max_batch_size = _check_positive_int("max_batch_size", max_batch_size)
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        n = max(1, int(lengths[i]))
        width = max(longest, n)
        full = max_batch_size is not None and len(current) >= max_batch_size
        if current and (full or (len(current) + 1) * width > max_batch_tokens):
            batches.append(current)
            current, width = [], n
        current.append(i)
        longest = width
    if current:
        batches.append(current)
    return batches


def _read_window(
    it: Iterator[str], window: int, ready: Optional[Callable[[], bool]]
) -> tuple[list[str], bool]:
    """Up to ``window`` lines of ``it``, fewer when ``ready()`` says the next one has not arrived;
    and whether ``it`` may hold more."""
    chunk: list[str] = []
    for line in it:
        chunk.append(line)
        if len(chunk) >= window or (ready is not None and not ready()):
            return chunk, True
    return chunk, False


def translate_iterable(
    translate_batch: Callable[[list[str]], list[Any]],
    lines: Iterable[str],
    *,
    length: Callable[[str], int],
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
    max_batch_size: Optional[int] = None,
    window: int = DEFAULT_WINDOW,
    ready: Optional[Callable[[], bool]] = None,
) -> Iterator[Any]:
    """Translate ``lines`` lazily and yield one result per line, in input order.

    Reads ``window`` lines at a time, measures each (``length``: its number of source tokens),
    groups the window into :func:`token_batches` and calls ``translate_batch`` (a list of lines
    -> one result per line) on each batch, in input order (first the batch that holds the
    window's first line, then the one holding the first line still without a result...); a
    result is yielded as soon as every line before it has its result, so the first lines come
    out after one batch while the rest of the window is still being translated, and nothing of
    the input is read before it is needed. ``ready``: whether the next line has arrived
    (:meth:`transformer_ext.text.StreamLines.ready`); when it has not, the window read so far
    is translated before waiting for more, so a program that feeds a pipe a line at a time and
    waits for each answer gets it, while input that flows freely fills whole windows.
    """
    window = _check_positive_int("window", window)
    max_batch_tokens = _check_positive_int("max_batch_tokens", max_batch_tokens)
    if isinstance(lines, (str, bytes)):
        raise TypeError("translate_iterable() takes an iterable of lines, not one string")
    it = iter(lines)
    more = True
    while more:
        chunk, more = _read_window(it, window, ready)
        if not chunk:
            return
        results: dict[int, Any] = {}
        next_out = 0
        batches = token_batches([length(x) for x in chunk], max_batch_tokens, max_batch_size)
        for batch in sorted(batches, key=min):  # the batch of the next line to yield first
            for i, result in zip(batch, translate_batch([chunk[i] for i in batch]), strict=True):
                results[i] = result
            while next_out in results:
                yield results.pop(next_out)
                next_out += 1
