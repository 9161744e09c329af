"""The ``translate`` command's input and output: the sources in input order, read lazily; the
``--output`` file checked before anything is read and written atomically at the end; the
progress lines on stderr; the lines printed for each translation.

This module imports no torch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterator, Optional

from .demo import DEMO_MODEL_DIR
from .fsutil import atomic_write_text, check_output_path
from .text import StreamLines, check_argument_text, iter_stream_lines
from .translator import TranslationError

__all__ = ["STALL_SECONDS", "Sources", "Progress", "format_lines", "check_output", "write_output", "silence"]

STALL_SECONDS = 0.05  # input that brings no new line for this long has stalled: translate what arrived


class Sources:
    """The sources in input order with where each came from (for error messages), read lazily:
    a line is read when the translator asks for it, by the package's one text rule
    (:func:`transformer_ext.text.iter_stream_lines`: strict UTF-8, a leading BOM removed, ``\\n``
    or ``\\r\\n`` line endings, a lone ``\\r`` an error). Empty lines are kept (an empty
    translation, or an error naming the line with ``--strict``). :meth:`ready` says whether the
    next line has arrived (a pipe that stalls for :data:`STALL_SECONDS` has not)."""

    def __init__(self, args, stdin):
        self.args, self.stdin = args, stdin
        self.stream: Optional[StreamLines] = None  # the stream being read

    def ready(self) -> bool:
        return self.stream is None or self.stream.ready(STALL_SECONDS)

    def _lines(self, stream, name: str) -> Iterator[tuple[str, str]]:
        self.stream = iter_stream_lines(stream, name)
        for n, line in enumerate(self.stream, start=1):
            yield line, f"{name}, line {n}"
        self.stream = None

    def _file(self, path: str) -> Iterator[tuple[str, str]]:
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise TranslationError(f"input file not found: {path}") from None
        except IsADirectoryError:
            raise TranslationError(f"--input {path} is a directory, expected a text file") from None
        with f:
            yield from self._lines(f, path)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        args = self.args
        for n, text in enumerate(args.text, start=1):
            if text == "-":
                yield from self._lines(self.stdin, "stdin")
            else:
                yield check_argument_text(text, f"argument {n}"), f"argument {n}"
        if args.input is not None:
            yield from self._file(args.input)
        if not args.text and args.input is None:
            yield from self._lines(self.stdin, "stdin")


class Progress:
    """A line on stderr every ``interval`` seconds (lines done, lines per second), also when
    stderr is not a terminal."""

    def __init__(self, stream, interval: float):
        self.stream, self.interval = stream, interval
        self.start = self.last = time.monotonic()
        self.done = 0

    def update(self) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            self.stream.write(f"translated {self.done} lines ({rate:.1f} lines/s)\n")
            self.stream.flush()


def format_lines(index: int, translation, args) -> list[str]:
    """The lines printed for one translation: its text; ``score<TAB>text`` with
    ``--return-scores``; ``index<TAB>score<TAB>text`` for each hypothesis with ``--num-hypotheses``."""
    if args.num_hypotheses is None:
        if args.return_scores:
            score = translation.score
            return [f"{'-' if score is None else f'{score:.4f}'}\t{translation.text}"]
        return [translation.text]
    lines = []
    for text, hyp in zip(translation.texts, translation.hypotheses):
        score = "-" if hyp.score is None else f"{hyp.score:.4f}"
        lines.append(f"{index}\t{score}\t{text}")
    return lines


def check_output(args) -> Optional[Path]:
    """``--output`` checked before anything is read: a file path in an existing folder, not the input."""
    if args.output is None:
        return None
    if not args.output.strip():
        raise TranslationError("--output must name a file")
    out = Path(args.output)
    if out.is_dir():
        raise TranslationError(f"--output {out} is a directory; give a file path")
    if out.exists() and not out.is_file():
        raise TranslationError(f"--output {out} exists and is not a regular file")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise TranslationError(f"--output {out}: the folder {parent} {what}")
    inputs = [("the model folder --model", Path(args.model) if args.model is not None else DEMO_MODEL_DIR)]
    if args.input is not None:
        inputs.append(("the --input file", Path(args.input)))
    check_output_path(out, inputs=inputs, managed_dirs=managed_dirs(out), what="--output")
    return out


def managed_dirs(path: Path) -> list:
    """The training runs' managed folders around ``path`` (``best/``, ``last/``, ``checkpoints/``);
    none without torch (the run folder module needs it, and a deployment trains nothing)."""
    try:
        from .training.run_folder import managed_dirs as run_managed_dirs
    except ImportError:
        return []
    return run_managed_dirs(path)


def write_output(output: Path, lines: list[str]) -> None:
    """The translations written to ``output`` atomically; an error names ``output``, not the
    temporary file it was written to."""
    try:
        atomic_write_text(output, "".join(line + "\n" for line in lines))
    except OSError as exc:
        if exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror or os.strerror(exc.errno), os.fspath(output)) from exc


def silence(stream) -> None:
    """Point ``stream``'s file descriptor at /dev/null, so that the interpreter's final flush of
    what is still buffered for a closed pipe raises nothing (a second "Broken pipe")."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a StringIO in a test)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
