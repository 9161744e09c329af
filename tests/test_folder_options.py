"""One spelling for folders in every command: ``--model`` for the folder read, ``--output-dir``
for the folder written. The old spellings still parse to the same value with one warning line;
an old and the new spelling in one command line are a usage error (exit 2) naming both."""

from __future__ import annotations

import importlib

import pytest

# (module, parser function, arguments before the folder option, old spelling, new spelling, dest)
RENAMED = [
    ("transformer_ext.train", "build_parser", [], "--out", "--output-dir", "out_dir"),
    (
        "transformer_ext.average",
        "build_parser",
        ["--last", "2", "RUN"],
        "--out",
        "--output-dir",
        "output_dir",
    ),
    (
        "transformer_ext.corpora",
        "build_parser",
        ["bible", "--pair", "en-de"],
        "--out",
        "--output-dir",
        "output_dir",
    ),
    (
        "transformer_ext.convert.__main__",
        "build_parser",
        ["transformers", "--model", "HF"],
        "--out",
        "--output-dir",
        "output_dir",
    ),
    ("export.onnx", "_parser", [], "--model-dir", "--model", "model"),
    ("export.quantize", "_parser", ["--output-dir", "Q"], "--export-dir", "--model", "model"),
    ("export.triton", "_parser", [], "--export-dir", "--model", "model"),
    ("export.triton", "_parser", [], "--out", "--output-dir", "output_dir"),
]
IDS = [f"{case[0]} {case[3]}" for case in RENAMED]


def _parser(module: str, function: str):
    return getattr(importlib.import_module(module), function)()


def _owner(parser, before: list[str]):
    """The (sub)parser that holds the folder options: a subcommand's, where ``before`` names one."""
    if before and before[0] in ("bible", "transformers"):
        return parser._subparsers._group_actions[0].choices[before[0]]
    return parser


@pytest.mark.parametrize("module, function, before, old, new, dest", RENAMED, ids=IDS)
def test_the_old_spelling_gives_the_same_value_and_warns(module, function, before, old, new, dest, capsys):
    parser = _parser(module, function)
    new_args = parser.parse_args([*before, new, "FOLDER"])
    assert capsys.readouterr().err == ""
    old_args = _parser(module, function).parse_args([*before, old, "FOLDER"])
    assert getattr(old_args, dest) == getattr(new_args, dest) == "FOLDER"
    assert vars(old_args) == vars(new_args)
    err = capsys.readouterr().err.splitlines()
    assert err == [f"{_owner(parser, before).prog}: warning: {old} is deprecated; use {new}"]


@pytest.mark.parametrize("module, function, before, old, new, dest", RENAMED, ids=IDS)
def test_the_old_and_the_new_spelling_together_are_a_usage_error(
    module, function, before, old, new, dest, capsys
):
    with pytest.raises(SystemExit) as info:
        _parser(module, function).parse_args([*before, new, "A", old, "B"])
    assert info.value.code == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if ": error: " in x]
    assert old in line and new in line


@pytest.mark.parametrize("module, function, before, old, new, dest", RENAMED, ids=IDS)
def test_help_shows_the_new_spelling_first(module, function, before, old, new, dest):
    parser = _owner(_parser(module, function), before)
    (action,) = [a for a in parser._actions if old in a.option_strings]
    assert action.option_strings == [new, old] and action.dest == dest
    assert f"{old}: deprecated spelling" in action.help


# The positional folders of convert and export.tensorrt: now --model.


def test_convert_takes_the_checkpoint_as_positional_with_a_warning(tmp_path, capsys):
    from transformer_ext.convert.__main__ import main

    missing = tmp_path / "no_checkpoint"
    assert main(["transformers", str(missing), "--output-dir", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        "transformer-ext-convert: warning: the positional HF_DIR is deprecated; use --model HF_DIR"
    )
    assert len(err) == 2 and f"checkpoint folder not found: {missing}" in err[1]
    assert main(["transformers", "--model", str(missing), "--output-dir", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"checkpoint folder not found: {missing}" in err[0]
    assert not (tmp_path / "m").exists()


def test_convert_refuses_the_positional_and_model_together_and_needs_one(tmp_path, capsys):
    from transformer_ext.convert.__main__ import main

    out = str(tmp_path / "m")
    with pytest.raises(SystemExit) as info:
        main(["transformers", "A", "--model", "B", "--output-dir", out])
    assert info.value.code == 2
    line = capsys.readouterr().err.splitlines()[-1]
    assert ": error: " in line and "HF_DIR" in line and "--model" in line
    with pytest.raises(SystemExit) as info:
        main(["transformers", "--output-dir", out])
    assert info.value.code == 2
    assert "the following arguments are required: --model" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_tensorrt_takes_the_export_as_positional_with_a_warning(tmp_path, capsys):
    from export.tensorrt import main

    missing = tmp_path / "no_export"
    assert main([str(missing), "--check-only"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        "python -m export.tensorrt: warning: the positional EXPORT_DIR is deprecated; use --model EXPORT_DIR"
    )
    assert str(missing) in err[-1] and ": error: " in err[-1]
    assert main(["--model", str(missing), "--check-only"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert not any("deprecated" in x for x in err) and str(missing) in err[-1]
    with pytest.raises(SystemExit) as info:
        main([str(missing), "--model", str(missing), "--check-only"])
    assert info.value.code == 2
    assert "EXPORT_DIR and --model are one option" in capsys.readouterr().err


def test_tensorrt_reads_onnx_export_by_default(tmp_path, monkeypatch, capsys):
    from export.tensorrt import main

    monkeypatch.chdir(tmp_path)  # no onnx_export here
    assert main(["--check-only"]) == 1
    assert "onnx_export" in capsys.readouterr().err
