"""cli.add_option: an option's one spelling, with old spellings that still work and warn."""

import argparse

import pytest

from transformer_ext.cli import add_option


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prog")
    group = parser.add_argument_group("search")
    add_option(group, "--beam-size", deprecated=("--beam", "--beams"), type=int, default=2, help="beams")
    add_option(parser, "--return-scores", deprecated=("--scores",), action="store_true", help="scores")
    add_option(parser, "--output-dir", help="where to write")
    return parser


def test_new_spelling_is_silent(capsys):
    args = _parser().parse_args(["--beam-size", "3", "--return-scores"])
    assert (args.beam_size, args.return_scores, args.output_dir) == (3, True, None)
    assert capsys.readouterr().err == ""


def test_old_spelling_works_and_warns_once_per_use(capsys):
    args = _parser().parse_args(["--beam", "5", "--scores"])
    assert (args.beam_size, args.return_scores) == (5, True)
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "prog: warning: --beam is deprecated; use --beam-size",
        "prog: warning: --scores is deprecated; use --return-scores",
    ]


def test_defaults_and_repeats_keep_argparse_rules():
    assert _parser().parse_args([]).beam_size == 2
    assert _parser().parse_args(["--beam-size", "3", "--beam-size", "4"]).beam_size == 4


@pytest.mark.parametrize("argv", [["--beam", "3", "--beam-size", "4"], ["--beam-size", "4", "--beams", "3"]])
def test_old_and_new_spelling_together_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(argv)
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("prog: error: ")
    assert argv[0] in last and argv[2] in last


def test_each_parse_starts_afresh():
    parser = _parser()
    parser.parse_args(["--beam", "3"])
    assert parser.parse_args(["--beam-size", "4"]).beam_size == 4


def test_help_names_the_old_spelling():
    text = _parser().format_help()
    assert "--beam-size" in text and "--beam: deprecated" not in text
    assert "--beam, --beams: deprecated spelling" in text
