"""The one text rule as the commands apply it: translate (arguments, --input, stdin) and evaluate.

The oracle is num2words (the demo task's own generator) and the rules of transformer_ext.text
spelled out in the tests: a lone CR is an error naming file and line, a leading BOM is removed,
bytes that are not UTF-8 are named by file, line and byte offset.
"""

import io

from num2words import num2words

from transformer_ext import evaluate
from transformer_ext.demo import DEMO_MODEL_DIR
from transformer_ext.translate import main


class _Stdin(io.TextIOWrapper):
    """sys.stdin as a pipe gives it: text on top of bytes, not a terminal."""

    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data), encoding="utf-8", errors="surrogateescape")

    def isatty(self):
        return False


def _translate(argv, capsys, stdin: bytes = b""):
    stdout = io.StringIO()
    code = main(argv, stdin=_Stdin(stdin), stdout=stdout)
    return code, stdout.getvalue(), capsys.readouterr().err


def _de(n: int) -> str:
    return num2words(n, lang="de")


def test_translate_input_with_a_lone_cr_is_an_error_not_three_lines(tmp_path, capsys):
    f = tmp_path / "in.txt"
    f.write_bytes(b"forty-two\rone\nseven\n")
    code, out, err = _translate(["--input", str(f)], capsys)
    assert code == 1 and out == ""
    assert f"{f}, line 1: a carriage return" in err and "Traceback" not in err
    code, out, err = _translate([], capsys, stdin=f.read_bytes())
    assert code == 1 and out == "" and "stdin, line 1: a carriage return" in err


def test_translate_crlf_lines_are_the_same_lines(tmp_path, capsys):
    f = tmp_path / "in.txt"
    f.write_bytes(b"forty-two\r\nseven\r\n")
    code, out, _ = _translate(["--input", str(f)], capsys)
    assert code == 0 and out.splitlines() == [_de(42), _de(7)]


def test_translate_a_leading_bom_is_not_an_unknown_character(tmp_path, capsys):
    f = tmp_path / "in.txt"
    f.write_bytes("\ufeffforty-two\nseven\n".encode("utf-8"))
    code, out, err = _translate(["--input", str(f)], capsys)
    assert code == 0 and out.splitlines() == [_de(42), _de(7)], err
    code, out, err = _translate([], capsys, stdin=f.read_bytes())
    assert code == 0 and out.splitlines() == [_de(42), _de(7)], err


def test_translate_invalid_utf8_names_the_line_and_byte_offset(tmp_path, capsys):
    data = b"seven\nfor\xffty-two\n"
    offset = data.index(b"\xff")
    code, out, err = _translate([], capsys, stdin=data)
    assert code == 1 and out == ""
    assert f"stdin, line 2: not UTF-8 text (byte 0xff) at byte offset {offset}" in err
    assert "'\\udcff'" not in err and "Traceback" not in err
    f = tmp_path / "in.txt"
    f.write_bytes(data)
    code, _, err = _translate(["--input", str(f)], capsys)
    assert code == 1 and f"{f}, line 2: not UTF-8 text (byte 0xff) at byte offset {offset}" in err
    argument = b"for\xffty".decode("utf-8", "surrogateescape")  # what sys.argv holds for those bytes
    code, _, err = _translate([argument], capsys)
    assert code == 1 and "argument 1, line 1: not UTF-8 text (byte 0xff) at byte offset 3" in err


def test_translate_tabs_are_spaces_as_in_training(capsys):
    code, out, _ = _translate(["three hundred\tand  forty-two", "seven"], capsys)
    assert code == 0 and out.splitlines() == [_de(342), _de(7)]


def test_evaluate_reads_sources_and_references_by_the_same_rule(tmp_path, capsys):
    src, ref = tmp_path / "src", tmp_path / "ref"
    src.write_bytes("\ufeffforty-two\r\nseven\n".encode("utf-8"))
    ref.write_bytes(f"{_de(42)}\n{_de(7)}\n".encode("utf-8"))
    hyp = tmp_path / "hyp"
    code = evaluate.main(
        ["--model", str(DEMO_MODEL_DIR), "--src", str(src), "--ref", str(ref), "--output", str(hyp)]
    )
    assert code == 0, capsys.readouterr().err
    assert hyp.read_text(encoding="utf-8").splitlines() == [_de(42), _de(7)]
    src.write_bytes(b"forty-two\rseven\n")
    assert evaluate.main(["--model", str(DEMO_MODEL_DIR), "--src", str(src), "--ref", str(ref)]) == 1
    assert f"{src}, line 1: a carriage return" in capsys.readouterr().err


def test_the_translator_refuses_a_lone_surrogate_instead_of_calling_it_unknown():
    import pytest

    from transformer_ext.translator import TranslationError, Translator

    translator = Translator.from_model_dir(DEMO_MODEL_DIR)
    with pytest.raises(
        TranslationError, match=r"source 1: not valid text: '\\udcff' at character 3 is a lone"
    ):
        translator.translate(["seven", b"for\xffty".decode("utf-8", "surrogateescape")])
