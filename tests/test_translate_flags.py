"""translate's decoding flags, generated from SearchOptions with CTranslate2's names, and the
older spellings: each works as its new name with a one-line warning; an old and a new spelling of
one option together are a usage error naming both."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import pytest

from transformer_ext import translate
from transformer_ext.decoding import SearchOptions
from transformer_ext.translate import main
from transformer_ext.translate_parser import DECODING_FLAGS, build_parser

SOURCES = ["forty-two", "seven thousand and seventeen"]
PROG = "python -m transformer_ext.translate"


def run(args, capsys):
    stdout = io.StringIO()
    code = main(list(args) + SOURCES, stdout=stdout)
    return code, stdout.getvalue(), capsys.readouterr().err


@pytest.mark.parametrize(
    "old, new, warning",
    [
        (["--beam", "3"], ["--beam-size", "3"], "--beam is deprecated; use --beam-size"),
        (
            ["--beam", "3", "--n-best", "2"],
            ["--beam-size", "3", "--num-hypotheses", "2"],
            "--n-best is deprecated; use --num-hypotheses",
        ),
        (
            ["--beam", "3", "--alpha", "1.5"],
            ["--beam-size", "3", "--length-penalty", "1.5"],
            "--alpha is deprecated; use --length-penalty",
        ),
        (
            ["--beam", "3", "--length-penalty", "hf", "--alpha", "1.0"],
            ["--beam-size", "3", "--length-penalty-type", "hf", "--length-penalty", "1.0"],
            "--length-penalty hf is deprecated; use --length-penalty-type hf",
        ),
        (["--max-length", "5"], ["--max-decoding-length", "5"], "--max-length is deprecated"),
        (["--min-length", "30"], ["--min-decoding-length", "30"], "--min-length is deprecated"),
        (["--scores"], ["--return-scores"], "--scores is deprecated; use --return-scores"),
        (
            ["--batch-size", "1"],
            ["--max-batch-size", "1"],
            "--batch-size is deprecated; use --max-batch-size",
        ),
    ],
)
def test_an_old_spelling_works_as_the_new_one_with_one_warning(old, new, warning, capsys):
    code, out_old, err_old = run(old, capsys)
    assert code == 0
    lines = [line for line in err_old.splitlines() if "deprecated" in line]
    assert f"{PROG}: warning: {warning}" in err_old and all(
        line.startswith(f"{PROG}: warning: ") for line in lines
    )
    assert len([line for line in lines if warning in line]) == 1
    code, out_new, err_new = run(new, capsys)
    assert code == 0 and out_new == out_old and "deprecated" not in err_new


@pytest.mark.parametrize(
    "args, names",
    [
        (["--beam", "2", "--beam-size", "2"], ("--beam", "--beam-size")),
        (["--num-hypotheses", "1", "--n-best", "1"], ("--num-hypotheses", "--n-best")),
        (["--alpha", "1", "--length-penalty", "1"], ("--alpha", "--length-penalty")),
        (
            ["--length-penalty-type", "hf", "--length-penalty", "hf"],
            ("--length-penalty-type", "--length-penalty"),
        ),
        (["--scores", "--return-scores"], ("--scores", "--return-scores")),
        (["--max-batch-size", "2", "--batch-size", "2"], ("--max-batch-size", "--batch-size")),
    ],
)
def test_an_old_and_a_new_spelling_together_are_a_usage_error_naming_both(args, names, capsys):
    with pytest.raises(SystemExit) as exc:
        main(args + ["one"], stdout=io.StringIO())
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"{PROG}: error: ") and all(name in err for name in names), err


def test_the_decoding_flags_are_the_search_options_fields_with_their_help():
    parser = build_parser()
    flags = {s: a for a in parser._actions for s in a.option_strings}
    fields = {f.name: f for f in dataclasses.fields(SearchOptions)}
    for name, _, _ in DECODING_FLAGS:
        action = flags["--" + name.replace("_", "-")]
        assert action.dest == name, name
        if name != "early_stopping":  # its help names the command line's choices
            assert fields[name].metadata["help"] in action.help, name
    ctranslate2 = (
        "beam_size num_hypotheses max_decoding_length min_decoding_length length_penalty repetition_penalty "
        "no_repeat_ngram_size sampling_topk sampling_temperature return_scores target_prefix max_batch_size "
        "batch_type"
    )
    for name in ctranslate2.split():
        assert "--" + name.replace("_", "-") in flags, name


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--beam-size", "0"], "--beam-size must be >= 1, got 0"),
        (["--num-hypotheses", "0"], "--num-hypotheses must be >= 1, got 0"),
        (["--length-penalty", "nan"], "--length-penalty must be a finite number >= 0"),
        (["--length-penalty", "-1"], "--length-penalty must be a finite number >= 0"),
        (["--length-penalty", "bogus"], "argument --length-penalty: invalid choice: 'bogus'"),
        (["--max-decoding-length", "0"], "--max-decoding-length must be >= 1, got 0"),
        (
            ["--sampling-topk", "0", "--sampling-temperature", "0"],
            "--sampling-temperature must be a finite number > 0",
        ),
        (
            ["--sampling-topk", "0", "--beam-size", "2"],
            "random sampling (--sampling-topk) needs --beam-size 1",
        ),
        (
            ["--beam-size", "2", "--num-hypotheses", "3"],
            "--num-hypotheses must be between 1 and --beam-size (2)",
        ),
        (["--max-batch-size", "0"], "--max-batch-size must be >= 1, got 0"),
        (
            ["--batch-type", "examples", "--max-batch-tokens", "9"],
            "--max-batch-tokens applies to --batch-type tokens",
        ),
    ],
)
def test_new_flags_are_checked_before_anything_is_loaded(args, fragment, capsys, monkeypatch):
    def no_loading(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(translate.Translator, "from_model_dir", no_loading)
    with pytest.raises(SystemExit) as exc:
        main(args + ["one"], stdout=io.StringIO())
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err


def test_a_negative_exponent_needs_the_hf_formula(capsys):
    code, out, _ = run(
        ["--beam-size", "2", "--length-penalty-type", "hf", "--length-penalty", "-0.5"], capsys
    )
    assert code == 0 and len(out.splitlines()) == len(SOURCES)


def test_batch_type_examples_translates_the_same(capsys):
    code, by_examples, _ = run(["--batch-type", "examples", "--max-batch-size", "1"], capsys)
    assert code == 0
    code, by_tokens, _ = run([], capsys)
    assert code == 0 and by_examples == by_tokens


def test_the_command_module_is_short():
    text = Path(translate.__file__).read_text(encoding="utf-8")
    assert len(text.splitlines()) < 300 and "nonlocal" not in text
