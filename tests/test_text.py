"""transformer_ext.text: the one text reader (encoding, BOM, line endings, whitespace) of every command."""

import io

import pytest

from transformer_ext.text import (
    DataError,
    check_argument_text,
    iter_stream_lines,
    normalize_text,
    read_lines,
    read_stream_lines,
    split_lines,
)


def _plain_lines(raw: bytes) -> list[str]:
    """The oracle: a plain loop over the bytes, with the documented rules spelled out."""
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    lines, current = [], bytearray()
    i = 0
    while i < len(raw):
        if raw[i : i + 2] == b"\r\n":
            lines.append(bytes(current).decode("utf-8"))
            current = bytearray()
            i += 2
        elif raw[i : i + 1] == b"\n":
            lines.append(bytes(current).decode("utf-8"))
            current = bytearray()
            i += 1
        else:
            current += raw[i : i + 1]
            i += 1
    if current:
        lines.append(bytes(current).decode("utf-8"))
    return lines


CASES = [
    b"one\ntwo\n",
    b"one\ntwo",
    b"one\r\ntwo\r\n",
    b"\xef\xbb\xbfone\r\n\r\nthree",
    "dreißig\u2028x\n\x85y\n".encode("utf-8"),
    b"",
    b"\n\n",
]


@pytest.mark.parametrize("raw", CASES)
def test_file_and_stream_lines_agree_with_a_plain_loop(tmp_path, raw):
    path = tmp_path / "a.txt"
    path.write_bytes(raw)
    expected = _plain_lines(raw)
    assert read_lines(path) == expected
    assert read_stream_lines(io.BytesIO(raw), "stdin") == expected
    assert read_stream_lines(io.TextIOWrapper(io.BytesIO(raw), encoding="latin-1"), "stdin") == expected


def test_a_lone_carriage_return_is_an_error_naming_file_line_and_offset(tmp_path):
    path = tmp_path / "mac.txt"
    path.write_bytes(b"seven\r\nforty-two\rone\nseven\n")
    with pytest.raises(DataError, match=r"mac.txt, line 2: a carriage return .* at byte offset 16"):
        read_lines(path)
    with pytest.raises(DataError, match=r"stdin, line 2: .* at byte offset 16"):
        read_stream_lines(io.BytesIO(path.read_bytes()), "stdin")


def test_a_lone_carriage_return_after_a_bom_counts_the_bom_bytes(tmp_path):
    path = tmp_path / "b.txt"
    path.write_bytes(b"\xef\xbb\xbfab\rc\n")
    with pytest.raises(DataError, match=r"line 1: .* at byte offset 5"):
        read_lines(path)


def test_invalid_utf8_names_file_line_and_byte_offset(tmp_path):
    raw = b"one\ntwo\nthr\xffee\n"
    path = tmp_path / "bad.txt"
    path.write_bytes(raw)
    offset = raw.index(b"\xff")
    with pytest.raises(
        DataError, match=rf"bad.txt, line 3: not UTF-8 text \(byte 0xff\) at byte offset {offset}"
    ):
        read_lines(path)
    with pytest.raises(
        DataError, match=rf"stdin, line 3: not UTF-8 text \(byte 0xff\) at byte offset {offset}"
    ):
        read_stream_lines(io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8"), "stdin")


def test_undecodable_bytes_smuggled_as_surrogates_are_refused():
    # what sys.argv and a surrogateescape stdin hold for the bytes b"ab\xffc"
    text = b"ab\xffc".decode("utf-8", "surrogateescape")
    with pytest.raises(DataError, match=r"argument 1, line 1: not UTF-8 text \(byte 0xff\) at byte offset 2"):
        check_argument_text(text, "argument 1")
    with pytest.raises(DataError, match=r"stdin, line 2: not UTF-8"):
        read_stream_lines(io.StringIO("ok\n" + text + "\n"), "stdin")
    with pytest.raises(DataError, match="lone surrogate"):
        check_argument_text("a\ud800b", "argument 2")


def test_a_leading_bom_is_removed_everywhere(tmp_path):
    path = tmp_path / "bom.txt"
    path.write_bytes("\ufeffforty-two\n".encode("utf-8"))
    assert read_lines(path) == ["forty-two"]
    assert read_stream_lines(io.StringIO("\ufeffforty-two\n"), "stdin") == ["forty-two"]
    assert check_argument_text("\ufeffforty-two", "argument 1") == "forty-two"
    # only a leading one: inside a line it is a character
    assert split_lines("a\ufeffb\n", "x") == ["a\ufeffb"]


WHITESPACE = ["\t", " ", "\u00a0", "\u2028", "\x0b", "\x0c", "\u3000"]


@pytest.mark.parametrize("space", WHITESPACE)
def test_normalize_text_makes_every_whitespace_run_one_space(space):
    text = f"{space}forty{space}{space}two {space}x{space}"
    expected_words = []
    word = ""
    for ch in text:  # plain loop: split at characters str.isspace() calls whitespace
        if ch.isspace():
            if word:
                expected_words.append(word)
            word = ""
        else:
            word += ch
    if word:
        expected_words.append(word)
    assert normalize_text(text) == " ".join(expected_words) == "forty two x"


def test_read_lines_normalize_applies_the_same_rule(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(b"a\tb\r\n  c  d \n")
    assert read_lines(path, normalize=True) == ["a b", "c d"]
    assert read_stream_lines(io.BytesIO(path.read_bytes()), "stdin", normalize=True) == ["a b", "c d"]


def test_missing_file_and_folder_are_named(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_lines(tmp_path / "missing.txt")
    with pytest.raises(DataError, match="is a folder"):
        read_lines(tmp_path)


class _OneLineAtATime(io.RawIOBase):
    """A pipe: hands out one line per read and records how many it handed out."""

    def __init__(self, lines):
        self.lines, self.handed = list(lines), 0

    def readable(self):
        return True

    def readinto(self, b):
        if self.handed == len(self.lines):
            return 0
        data = self.lines[self.handed]
        self.handed += 1
        b[: len(data)] = data
        return len(data)


def test_stream_lines_are_read_one_at_a_time():
    pipe = _OneLineAtATime([b"one\n", b"two\r\n", b"thr\xffee\n"])
    lines = iter_stream_lines(io.BufferedReader(pipe), "stdin")
    assert next(lines) == "one" and pipe.handed == 1
    assert next(lines) == "two" and pipe.handed == 2
    with pytest.raises(DataError, match=r"stdin, line 3: not UTF-8 text \(byte 0xff\) at byte offset 12"):
        next(lines)


@pytest.mark.parametrize("raw", CASES)
def test_stream_lines_in_any_pieces_agree_with_a_plain_loop(raw):
    """The same lines however the stream cuts them (pieces of 1, 2 and 3 bytes, or of text)."""
    expected = _plain_lines(raw)
    for size in (1, 2, 3):
        pieces = [raw[i : i + size] for i in range(0, len(raw), size)]
        assert list(iter_stream_lines(pieces, "stdin")) == expected
    text = raw.decode("utf-8")
    assert list(iter_stream_lines([text[i : i + 2] for i in range(0, len(text), 2)], "stdin")) == expected
