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
from typing import Iterable, Optional, Union

from .cli import UserError

__all__ = [
    "DataError",
    "normalize_text",
    "decode_text",
    "split_lines",
    "read_lines",
    "read_stream_lines",
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


def _stream_bytes(stream) -> Optional[bytes]:
    """The rest of ``stream`` as bytes when it has them (a binary stream, or a text stream's buffer)."""
    buffer = getattr(stream, "buffer", None)
    if buffer is not None:
        return buffer.read()
    if isinstance(stream, (bytes, bytearray)):
        return bytes(stream)
    try:
        data = stream.read()
    except AttributeError:
        data = "".join(stream)  # an iterable of lines
    if isinstance(data, (bytes, bytearray)):
        return bytes(data)
    return data  # type: ignore[return-value]  # already text


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


def read_stream_lines(
    stream: Union[Iterable[str], "object"], name: str, *, normalize: bool = False
) -> list[str]:
    """The lines of a stream (``sys.stdin``, a binary or text file object) by the module's rules.

    A text stream with a ``buffer`` (``sys.stdin``) is read as bytes, so the decoding is this
    module's strict UTF-8 whatever the locale; a stream of ``str`` is checked for undecodable bytes
    that arrived as surrogates.
    """
    data = _stream_bytes(stream)
    if isinstance(data, bytes):
        lines = split_lines(decode_text(data, name), name, offset_base=_bom_bytes(data))
    else:
        text = _text_from_str(data, name)
        lines = split_lines(text, name, offset_base=len(BOM.encode("utf-8")) if data.startswith(BOM) else 0)
    return [normalize_text(line) for line in lines] if normalize else lines


def check_argument_text(text: str, name: str) -> str:
    """A text given on the command line (``sys.argv`` keeps undecodable bytes as surrogates), checked.

    Returns ``text`` (a leading BOM removed); not UTF-8 is an error naming ``name`` and the byte offset.
    """
    return _text_from_str(text, name)
