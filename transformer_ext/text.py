"""The one text reader of the package: every command that reads text goes through it.

``translate`` (``--input``, stdin, text arguments), ``evaluate`` (``--src``, ``--ref``), ``train``
(``--train``, ``--valid``, ``--*-tsv``), ``corpora`` and the quantizer's BLEU gate read text with
these functions, so one file means the same lines, the same characters and the same error
everywhere. Torch-free: the deployment install imports it.

The rules:

* **Encoding.** Strict UTF-8. A byte sequence that is not UTF-8 is an error naming the file, the
  line and the byte offset in the file (and the byte). A leading UTF-8 byte order mark is
  removed (as Python's ``utf-8-sig`` does); a BOM anywhere else is an ordinary character.
* **Lines.** ``\\n`` and ``\\r\\n`` end a line; the last line needs no line ending. A lone ``\\r``
  (a carriage return not followed by ``\\n``, as in old Mac files) is an error naming the file,
  the line and the byte offset: a reader that took it for a line ending would see more lines
  than a reader that did not, and text meant as two sentences would become one. Other Unicode
  separators (``\\v``, ``\\f``, ``\\x1c``-``\\x1e``, ``\\x85``, ``\\u2028``, ``\\u2029``) are
  characters inside a line (whitespace, see the next rule).
* **Whitespace.** :func:`normalize_text` turns every run of whitespace (``str.isspace``: space,
  TAB, the separators above, no-break spaces ...) into one space and removes it at both ends.
  It is applied to every source and target the same way in training (the text the vocabulary is
  built from included), validation, evaluation and translation, so a model is never trained on
  characters it will not see when translating (a TAB is a space everywhere).
"""

from __future__ import annotations

import os
import select
from collections import deque
from typing import Iterable, Iterator, Optional, Union

from .cli import UserError

__all__ = [
    "DataError",
    "normalize_text",
    "decode_text",
    "split_lines",
    "read_lines",
    "read_stream_lines",
    "iter_stream_lines",
    "StreamLines",
    "check_argument_text",
]

BOM = "\ufeff"


class DataError(UserError, ValueError):
    """Text that cannot be used (unreadable, not UTF-8, a lone carriage return, misaligned, empty)."""


def normalize_text(text: str) -> str:
    """``text`` with each run of whitespace (TAB included) one space and none at either end."""
    return " ".join(text.split())


def _line_of(raw: bytes, offset: int) -> int:
    return raw.count(b"\n", 0, offset) + 1


def _bom_bytes(raw: bytes) -> int:
    return 3 if raw.startswith(BOM.encode("utf-8")) else 0


def decode_text(raw: bytes, name: str) -> str:
    """``raw`` decoded as strict UTF-8, a leading BOM removed; an error names ``name``, line and byte offset."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{name}, line {_line_of(raw, exc.start)}: not UTF-8 text (byte 0x{raw[exc.start]:02x}) at byte "
            f"offset {exc.start}; the text must be UTF-8"
        ) from None
    return text[1:] if text.startswith(BOM) else text


def split_lines(text: str, name: str, *, offset_base: int = 0) -> list[str]:
    """The lines of ``text`` without their endings (``\\n`` or ``\\r\\n``); a lone ``\\r`` is an error.

    ``offset_base``: the bytes before ``text`` in its file (3 for a removed BOM), for the offsets.
    """
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    out = []
    for number, line in enumerate(lines, start=1):
        if line.endswith("\r"):
            line = line[:-1]
        if "\r" in line:
            before = "\n".join(lines[: number - 1])
            offset = offset_base + len(before.encode("utf-8", "surrogatepass")) + (1 if number > 1 else 0)
            offset += len(line[: line.index("\r")].encode("utf-8", "surrogatepass"))
            raise DataError(
                f"{name}, line {number}: a carriage return (\\r) not followed by a line feed at byte offset "
                f"{offset}; lines must end with \\n or \\r\\n (convert old Mac line endings, e.g. with "
                "tr '\\r' '\\n')"
            )
        out.append(line)
    return out


def read_lines(path: Union[str, os.PathLike], *, normalize: bool = False) -> list[str]:
    """The lines of the UTF-8 text file ``path`` by the module's rules (``normalize``: :func:`normalize_text`)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise DataError(f"{path} is a folder, expected a text file with one sentence per line") from None
    lines = split_lines(decode_text(raw, path), path, offset_base=_bom_bytes(raw))
    return [normalize_text(line) for line in lines] if normalize else lines


_READ_SIZE = 1 << 16  # bytes asked of a file or pipe at once (it returns what has arrived)


def _selectable(stream) -> tuple[object, Optional[int]]:
    """``(binary stream, file descriptor)``: a text stream's ``buffer`` (``sys.stdin``'s, so that
    the decoding is this module's strict UTF-8 whatever the locale), and the descriptor when the
    stream is a buffered file or pipe of the operating system (None otherwise)."""
    buffer = getattr(stream, "buffer", None)
    if buffer is not None:
        stream = buffer
    if not callable(getattr(stream, "read1", None)):
        return stream, None
    try:
        return stream, int(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return stream, None


def _stream_chunks(stream) -> Iterator[Union[bytes, str]]:
    """The pieces of ``stream`` as it delivers them, without waiting for more than has arrived:
    what a file or pipe holds (``read1``), else a line at a time (``readline``), bytes or ``str``,
    or the items of an iterable of strings."""
    stream, fd = _selectable(stream)
    if isinstance(stream, (bytes, bytearray, str)):
        yield bytes(stream) if not isinstance(stream, str) else stream
        return
    read = stream.read1 if fd is not None else getattr(stream, "readline", None)
    if callable(read):
        while True:
            piece = read(_READ_SIZE) if fd is not None else read()
            if not piece:
                return
            yield piece
    else:
        yield from stream  # an iterable of lines


def _line_bytes(line: Union[bytes, str]) -> int:
    return len(line) if isinstance(line, bytes) else len(line.encode("utf-8", "surrogateescape"))


def _decode_line(line: Union[bytes, str], name: str, number: int, offset: int) -> str:
    """One line (its ending removed) as text; an error names ``name``, the line and the byte
    offset in the whole stream (``offset``: where the line starts)."""
    if isinstance(line, str):
        try:
            line.encode("utf-8")
            return line
        except UnicodeEncodeError:
            try:  # bytes that arrived as surrogates (surrogateescape): name the original byte
                line = line.encode("utf-8", "surrogateescape")
            except UnicodeEncodeError as exc:
                raise DataError(
                    f"{name}, line {number}: not valid text (a lone surrogate {line[exc.start]!r})"
                ) from None
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{name}, line {number}: not UTF-8 text (byte 0x{line[exc.start]:02x}) at byte "
            f"offset {offset + exc.start}; the text must be UTF-8"
        ) from None


class StreamLines:
    """The lines of a stream by the module's rules, an iterator that reads only what it needs:
    the next line is read when it is asked for, and :meth:`ready` says whether one is at hand
    without waiting (so that a reader of an interactive pipe can act on what has arrived)."""

    def __init__(self, stream: Union[Iterable[str], "object"], name: str, *, normalize: bool = False):
        self.name, self.normalize = name, normalize
        self.number = 0  # lines handed out
        self._offset = 0  # bytes before the next line in the stream
        self._pending: Union[bytes, str, None] = None  # the start of a line not yet ended
        self._lines: deque = deque()  # complete raw lines not yet handed out
        self._fd = _selectable(stream)[1]
        self._chunks = _stream_chunks(stream)
        self._ended = False

    def __iter__(self) -> "StreamLines":
        return self

    def __next__(self) -> str:
        while not self._lines:
            if self._ended:
                raise StopIteration
            self._read()
        return self._finish(self._lines.popleft())

    def ready(self, timeout: float = 0.0) -> bool:
        """Whether :func:`next` returns without waiting for the stream (a line read already, the
        end reached, or data arrived within ``timeout`` seconds); True for a stream that is no
        file or pipe, since reading it never waits for a writer."""
        if self._lines or self._ended or self._fd is None:
            return True
        try:
            readable, _, _ = select.select([self._fd], [], [], timeout)
        except (OSError, ValueError):  # a descriptor select does not take: reading will tell
            return True
        return bool(readable)

    def _read(self) -> None:
        piece = next(self._chunks, None)
        if piece is None:
            self._ended = True
            if self._pending:  # the last line needs no line ending
                self._lines.append(self._pending)
            self._pending = None
            return
        if isinstance(piece, (bytearray, memoryview)):
            piece = bytes(piece)
        if self._pending is not None and type(piece) is not type(self._pending):
            raise TypeError(f"{self.name}: a stream of mixed bytes and text")
        newline = b"\n" if isinstance(piece, bytes) else "\n"
        parts = (piece if self._pending is None else self._pending + piece).split(newline)
        self._pending = parts.pop()  # what follows the last line ending: the start of the next line
        self._lines.extend(parts)

    def _finish(self, raw: Union[bytes, str]) -> str:
        self.number += 1
        number, start, skip = self.number, self._offset, 0
        self._offset += _line_bytes(raw) + 1
        bom = b"\xef\xbb\xbf" if isinstance(raw, bytes) else BOM
        if number == 1 and raw.startswith(bom):
            raw, skip = raw[len(bom) :], 3
        line = _decode_line(raw, self.name, number, start + skip)
        if line.endswith("\r"):
            line = line[:-1]
        if "\r" in line:
            at = start + skip + len(line[: line.index("\r")].encode("utf-8", "surrogatepass"))
            raise DataError(
                f"{self.name}, line {number}: a carriage return (\\r) not followed by a line feed at byte "
                f"offset {at}; lines must end with \\n or \\r\\n (convert old Mac line endings, e.g. with "
                "tr '\\r' '\\n')"
            )
        return normalize_text(line) if self.normalize else line


def iter_stream_lines(
    stream: Union[Iterable[str], "object"], name: str, *, normalize: bool = False
) -> StreamLines:
    """The lines of a stream (``sys.stdin``, a binary or text file object, an iterable of
    strings) by the module's rules, one at a time as the stream delivers them: nothing is read
    before the caller asks for the next line, so an endless pipe is translated as it comes
    (:meth:`StreamLines.ready`: whether the next line has arrived). An error (not UTF-8, a lone
    carriage return) is raised when its line is reached, naming the line and the byte offset in
    the stream."""
    return StreamLines(stream, name, normalize=normalize)


def read_stream_lines(
    stream: Union[Iterable[str], "object"], name: str, *, normalize: bool = False
) -> list[str]:
    """The lines of a stream (``sys.stdin``, a binary or text file object) by the module's rules
    (all of them: :func:`iter_stream_lines` reads one at a time).

    A text stream with a ``buffer`` (``sys.stdin``) is read as bytes, so the decoding is this
    module's strict UTF-8 whatever the locale; a stream of ``str`` is checked for undecodable bytes
    that arrived as surrogates.
    """
    return list(iter_stream_lines(stream, name, normalize=normalize))


def _text_from_str(text: str, name: str) -> str:
    """Decoded text given as ``str``: bytes smuggled in as surrogates (``surrogateescape``) are refused."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        try:
            raw = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError as exc:
            raise DataError(f"{name}: not valid text (a lone surrogate {text[exc.start]!r})") from None
        return decode_text(raw, name)  # raises, naming the original byte
    return text[1:] if text.startswith(BOM) else text


def check_argument_text(text: str, name: str) -> str:
    """A text given on the command line (``sys.argv`` keeps undecodable bytes as surrogates), checked.

    Returns ``text`` (a leading BOM removed); not UTF-8 is an error naming ``name`` and the byte offset.
    """
    return _text_from_str(text, name)
