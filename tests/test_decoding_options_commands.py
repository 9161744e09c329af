"""The decoding options of every command that decodes besides translate: evaluate, export.quantize's
quality gate and the Triton translator's request. Each takes the SearchOptions names (generated from
the record's metadata by transformer_ext.search_flags, or for Triton's request from its table of
inputs), words a value out of range as translate does, accepts the older spellings with one
warning, and refuses an old and a new spelling of one option together, naming both."""

from __future__ import annotations

import io
import logging

import numpy as np
import pytest
from helpers import DEMO_DIR

from export import quantize
from export.triton_models.translator import model as triton_model
from transformer_ext import evaluate, translate

PROGS = {
    "evaluate": "python -m transformer_ext.evaluate",
    "quantize": "python -m export.quantize",
}
# a flag out of its range, for each field every one of these commands takes
OUT_OF_RANGE = [
    ["--beam-size", "0"],
    ["--max-decoding-length", "0"],
    ["--min-decoding-length", "-1"],
    ["--length-penalty", "-1"],
    ["--length-penalty", "nan"],
    ["--max-len-a", "-1"],
    ["--repetition-penalty", "0"],
    ["--no-repeat-ngram-size", "-2"],
]


def _usage_error(main, argv, capsys) -> str:
    """The message of the usage error (exit 2) ``main(argv)`` stops with, without its prefix."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert ": error: " in last, last
    return last.split(": error: ", 1)[1]


def _translate(argv):
    return translate.main(argv + ["one"], stdout=io.StringIO())


def _evaluate(tmp_path):
    src = tmp_path / "src.txt"
    src.write_text("forty-two\nseven\n", encoding="utf-8")
    return lambda argv: evaluate.main(["--model", str(DEMO_DIR), "--src", str(src), "--ref", str(src), *argv])


def _quantize(tmp_path):
    out = tmp_path / "out"
    return lambda argv: quantize.main(["--model", str(tmp_path / "none"), "--output-dir", str(out), *argv])


@pytest.mark.parametrize("flag", OUT_OF_RANGE, ids=lambda f: " ".join(f))
def test_a_range_error_reads_as_translates(flag, tmp_path, monkeypatch, capsys):
    def no_loading(*a, **k):
        raise AssertionError("something was loaded before the options were checked")

    monkeypatch.setattr(evaluate, "load_translator", no_loading)
    monkeypatch.setattr(quantize, "quantize_export", no_loading)
    expected = _usage_error(_translate, flag, capsys)
    assert flag[0] in expected and "must be" in expected
    assert _usage_error(_evaluate(tmp_path), flag, capsys) == expected
    assert _usage_error(_quantize(tmp_path), flag, capsys) == expected
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "command, args, names",
    [
        ("evaluate", ["--beam", "2", "--beam-size", "2"], ("--beam", "--beam-size")),
        ("evaluate", ["--length-penalty", "1", "--alpha", "1"], ("--length-penalty", "--alpha")),
        (
            "evaluate",
            ["--length-penalty-type", "gnmt", "--length-penalty", "gnmt"],
            ("--length-penalty-type", "--length-penalty"),
        ),
        ("evaluate", ["--batch-size", "2", "--max-batch-size", "2"], ("--batch-size", "--max-batch-size")),
        ("quantize", ["--beam-size", "2", "--beam", "2"], ("--beam-size", "--beam")),
        ("quantize", ["--alpha", "1", "--length-penalty", "1"], ("--alpha", "--length-penalty")),
        (
            "quantize",
            ["--max-length", "9", "--max-decoding-length", "9"],
            ("--max-length", "--max-decoding-length"),
        ),
    ],
)
def test_an_old_and_a_new_spelling_together_are_a_usage_error_naming_both(
    command, args, names, tmp_path, capsys
):
    main = _evaluate(tmp_path) if command == "evaluate" else _quantize(tmp_path)
    message = _usage_error(main, args, capsys)
    assert "are one option" in message and all(name in message for name in names), message


@pytest.mark.parametrize(
    "command, old, new, field, value",
    [
        ("evaluate", ["--beam", "3"], ["--beam-size", "3"], "beam_size", 3),
        ("evaluate", ["--alpha", "1.5"], ["--length-penalty", "1.5"], "length_penalty", 1.5),
        (
            "evaluate",
            ["--length-penalty", "average"],
            ["--length-penalty-type", "average"],
            "length_penalty_type",
            "average",
        ),
        ("evaluate", ["--batch-size", "3"], ["--max-batch-size", "3"], "max_batch_size", 3),
        ("quantize", ["--beam", "3"], ["--beam-size", "3"], "beam_size", 3),
        ("quantize", ["--min-length", "2"], ["--min-decoding-length", "2"], "min_decoding_length", 2),
    ],
)
def test_an_old_spelling_parses_as_the_new_one_with_one_warning(command, old, new, field, value, capsys):
    parser = evaluate.build_parser() if command == "evaluate" else quantize._parser()
    required = (
        ["--model", "m", "--src", "s", "--ref", "r"]
        if command == "evaluate"
        else ["--model", "m", "--output-dir", "o"]
    )
    got = parser.parse_args(required + old)
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "deprecated" in line]
    assert len(warnings) == 1 and warnings[0].startswith(f"{PROGS[command]}: warning: "), err
    assert getattr(got, field) == value
    assert getattr(parser.parse_args(required + new), field) == value
    assert "deprecated" not in capsys.readouterr().err


def test_evaluate_decodes_with_the_generated_flags(tmp_path, capsys):
    """--beam-size 3 --length-penalty 1.0 decode as the translator with those options does, and
    evaluate's default stays greedy search."""
    from transformer_ext.translate import Translator

    sources = ["forty-two", "one hundred and one", "seven"]
    src, hyp = tmp_path / "src", tmp_path / "hyp"
    src.write_text("".join(s + "\n" for s in sources), encoding="utf-8")
    argv = ["--model", str(DEMO_DIR), "--src", str(src), "--ref", str(src), "--output", str(hyp)]
    flags = ["--beam-size", "3", "--length-penalty", "1.0", "--length-penalty-type", "average"]
    assert evaluate.main(argv + flags + ["--max-decoding-length", "6"]) == 0
    translator = Translator.from_model_dir(DEMO_DIR)
    options = dict(beam_size=3, length_penalty=1.0, length_penalty_type="average", max_decoding_length=6)
    assert hyp.read_text(encoding="utf-8").splitlines() == translator.translate(sources, **options)
    assert "beam 3 (length penalty average, exponent 1)" in capsys.readouterr().out
    assert evaluate.main(argv) == 0
    assert hyp.read_text(encoding="utf-8").splitlines() == translator.translate(sources, beam_size=1)
    assert "greedy" in capsys.readouterr().out


def test_the_quality_gate_decodes_with_its_search_options(exported_portable):
    """The gate's search: without options greedy search with the export's budget, with
    ``beam_size`` the best beam hypothesis of that beam search."""
    from transformer_ext import decoding
    from transformer_ext.export_format import read_generation_config
    from transformer_ext.runtimes import OrtRunner

    runner = OrtRunner(exported_portable, intra_op_num_threads=2)  # as the gate's
    info = runner.info
    rng = np.random.default_rng(3)
    lengths = np.array([5, 3, 7], dtype=np.int64)
    ids = np.full((3, 7), info.pad_id, dtype=np.int64)
    for row, n in enumerate(lengths):
        ids[row, :n] = rng.integers(4, info.src_vocab_size, n)
    gen = read_generation_config(exported_portable, runner.manifest)
    budget = decoding.max_decoding_length_for(lengths, gen.max_len_a, gen.max_len_b, cap=gen.max_new_tokens)
    greedy = quantize._greedy_all(exported_portable, ids, lengths)
    assert (
        quantize._greedy_all(exported_portable, ids, lengths, search={"max_len_a": gen.max_len_a}) == greedy
    )
    beam = quantize._greedy_all(exported_portable, ids, lengths, search={"beam_size": 3})
    want = decoding.beam_search(
        runner,
        ids,
        lengths,
        bos_id=info.bos_id,
        eos_id=info.eos_id,
        beam_size=3,
        num_hypotheses=1,
        max_decoding_length=budget,
        length_penalty_type=gen.length_penalty,
        length_penalty=gen.alpha,
    )
    assert beam == [list(row[0].tokens) for row in want]


def test_a_bad_gate_search_is_refused_before_anything_is_read(tmp_path):
    with pytest.raises(quantize.QuantizationUsageError, match="beam_size must be an int >= 1, got 0"):
        quantize.quantize_export(tmp_path / "none", tmp_path / "out", gate_search={"beam_size": 0})
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------
# the Triton translator's request
# ------------------------------------------------------------------------------------------

SETTINGS = dict(
    encoder_model="encoder",
    decoder_model="decoder_step",
    stateful_decoder_model="",
    flavour="portable",
    n_layers=1,
    n_heads=1,
    d_k=4,
    src_vocab_size=20,
    tgt_vocab_size=20,
    max_positions=64,
    bos_id=1,
    eos_id=2,
    pad_id=0,
    max_src_len=32,
    max_cache_len=64,
    fixed_cache_len=0,
    state_cache_len=0,
    cache_dtype="float32",
    encoder_max_batch_size=8,
    decoder_max_batch_size=8,
    stateful_max_sequences=0,
    beam_size=1,
    max_len_a=1.5,
    max_len_b=10.0,
    min_decoding_length=0,
    max_decoding_length=64,
    max_beam_size=16,
    length_penalty_type="gnmt",
    length_penalty=0.6,
)
IDS = np.array([[5, 6, 7], [8, 9, 0]], dtype=np.int64)


@pytest.fixture
def searches(monkeypatch):
    """The keyword arguments of every search the Triton translator starts (none runs)."""
    calls = []

    def fake_run(runner, search, ids, lengths, **kwargs):
        assert search is triton_model.decoding.greedy_decode
        calls.append(kwargs)
        return [[3] for _ in ids]

    monkeypatch.setattr(triton_model, "_run", fake_run)
    return calls


def _request(**options):
    translator = triton_model.Translator(triton_model.Settings(**SETTINGS))
    arrays = {"input_ids": IDS, **{k: np.array([v], dtype=np.int64) for k, v in options.items()}}
    return translator.translate(arrays, infer=None)


@pytest.mark.parametrize(
    "option, value",
    [("beam_size", 0), ("max_decoding_length", 0), ("min_decoding_length", -1), ("max_new_tokens", 0)],
)
def test_a_triton_request_option_out_of_range_reads_as_translates(option, value, searches, capsys):
    field = "max_decoding_length" if option == "max_new_tokens" else option
    flag = "--" + field.replace("_", "-")
    expected = _usage_error(_translate, [flag, str(value)], capsys)
    with pytest.raises(triton_model.TranslationRequestError) as exc:
        _request(**{option: value})
    assert str(exc.value) == expected.replace(flag, option)
    assert not searches


@pytest.mark.parametrize(
    "old, new", [("max_new_tokens", "max_decoding_length"), ("min_new_tokens", "min_decoding_length")]
)
def test_a_triton_request_takes_the_old_input_names_with_one_warning(old, new, searches, caplog, monkeypatch):
    monkeypatch.setattr(triton_model, "_WARNED_OLD_INPUTS", set())
    with caplog.at_level(logging.WARNING, logger=triton_model.logger.name):
        for _ in range(2):
            _request(**{old: 4})
        _request(**{new: 4})
    warnings = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert warnings == [f"request input {old} is deprecated; send {new}"]
    key = new  # the search keyword the request option feeds
    values = [np.asarray(call[key]).tolist() for call in searches]
    assert values[0] == values[1] == values[2] and 4 in np.ravel(values[0])


@pytest.mark.parametrize(
    "old, new", [("max_new_tokens", "max_decoding_length"), ("min_new_tokens", "min_decoding_length")]
)
def test_a_triton_request_with_an_old_and_a_new_name_is_refused_naming_both(old, new, searches):
    with pytest.raises(triton_model.TranslationRequestError) as exc:
        _request(**{old: 4, new: 4})
    assert old in str(exc.value) and new in str(exc.value)
    assert not searches


def test_the_triton_config_declares_every_request_option(exported_portable, tmp_path):
    from export.triton import TRANSLATOR_MODEL, export_triton

    export_triton(exported_portable, tmp_path / "repo", validate=False)
    config = (tmp_path / "repo" / TRANSLATOR_MODEL / "config.pbtxt").read_text(encoding="utf-8")
    for name, old in triton_model.REQUEST_OPTIONS:
        for spelling in (name, *old):
            assert f'name: "{spelling}"' in config, spelling
        assert name in triton_model._INPUTS and all(o in triton_model._INPUTS for o in old)
