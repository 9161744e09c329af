"""The Translator API, the translate CLI and the bundled demo model's accuracy."""

import io
import json
import logging
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
from num2words import num2words  # the independent oracle of the demo task

from transformer_ext.data import split_numbers
from transformer_ext.demo import DEMO_MODEL_DIR
from transformer_ext.tokenizer import TokenizerError
from transformer_ext.translate import Translation, TranslationError, Translator, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELDOUT_SAMPLE = 200  # fixed sample of the held-out numbers (never seen in training)
MIN_EXACT_MATCH = 0.98


@pytest.fixture(scope="module")
def translator():
    return Translator.from_model_dir()  # the bundled demo model, CPU


@pytest.fixture(scope="module")
def heldout_sample():
    return sorted(random.Random(0).sample(split_numbers().heldout, HELDOUT_SAMPLE))


def test_bundled_model_is_a_small_model_directory():
    files = set(os.listdir(DEMO_MODEL_DIR))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    size = sum(os.path.getsize(os.path.join(DEMO_MODEL_DIR, f)) for f in files)
    assert size <= 10 * 2**20


def test_bundled_model_greedy_exact_match_on_heldout(translator, heldout_sample):
    sources = [num2words(n, lang="en") for n in heldout_sample]
    references = [num2words(n, lang="de") for n in heldout_sample]
    outputs = translator.translate(sources)
    wrong = [(s, o, r) for s, o, r in zip(sources, outputs, references) if o != r]
    exact = 1 - len(wrong) / len(sources)
    assert exact >= MIN_EXACT_MATCH, f"greedy exact match {exact:.3f}; first errors: {wrong[:5]}"


def test_examples(translator):
    sources = ["three hundred and forty-two", "forty-two", "  One   Thousand and one "]
    out = translator.translate(sources)
    assert out == ["dreihundertzweiundvierzig", "zweiundvierzig", "eintausendeins"]
    assert all(isinstance(t, Translation) and isinstance(t, str) for t in out)  # one result type, a str
    plain = translator.translate_text(sources)
    assert plain == out and all(type(t) is str for t in plain)  # the plain-string convenience
    detailed = translator.translate_detailed(sources)
    assert [t.text for t in detailed] == out and detailed[0].source == "three hundred and forty-two"
    assert detailed[0].score is None and detailed[0].hypotheses[0].log_prob is None  # greedy: no beam score
    assert detailed[1].hypotheses[0].finished  # ended with an EOS within its budget


def test_beam_n_best(translator):
    (one,) = translator.translate(["seven thousand and seventeen"], beam_size=4, n_best=3)
    assert one == "siebentausendsiebzehn" == one.texts[0]  # the best text, with the n-best behind it
    scores = [h.score for h in one.hypotheses]
    assert len(one.texts) == 3 and all(isinstance(s, float) for s in scores)
    assert scores == sorted(scores, reverse=True)
    assert len(set(one.texts)) == 3
    (detailed,) = translator.translate_detailed(["seven thousand and seventeen"], beam_size=4, n_best=3)
    assert detailed.texts == one.texts and [h.score for h in detailed.hypotheses] == scores
    assert all(h.log_prob <= 0 for h in one.hypotheses)
    assert [translator.tokenizer.decode_target(h.tokens) for h in one.hypotheses] == one.texts


def test_beam_search_of_one_equals_greedy(translator):
    """Beam size 1 through the beam-search code path (not the greedy shortcut) gives the greedy output."""
    from transformer_ext.decoding import beam_search

    sources = ["nine thousand, nine hundred and ninety-nine", "zero", "eleven", "six hundred and six"]
    greedy = translator.translate_detailed(sources)
    ids = translator.encode(sources)
    lengths = np.array([len(x) for x in ids])
    padded = np.zeros((len(ids), lengths.max()), dtype=np.int64)
    for i, x in enumerate(ids):
        padded[i, : len(x)] = x
    beams = beam_search(
        translator.runner,
        padded,
        lengths,
        bos_id=1,
        eos_id=2,
        beam_size=1,
        max_decoding_length=translator.max_decoding_length(lengths, 1.5, 10),
    )
    assert [list(b[0].tokens) for b in beams] == [list(t.hypotheses[0].tokens) for t in greedy]
    assert [t.text for t in greedy] == translator.translate(sources, beam_size=3)


def test_batching_does_not_change_outputs(translator):
    sources = [num2words(n, lang="en") for n in (5, 1234, 77, 9001, 300)]
    assert translator.translate(sources, batch_size=2) == translator.translate(sources)


def test_max_length_limits_output(translator):
    (t,) = translator.translate(["seven thousand, seven hundred and seventy-seven"], max_len_a=0, max_len_b=5)
    assert len(t) <= 5


@pytest.mark.parametrize(
    "sources, kwargs, match",
    [
        ([""], dict(strict=True), "source 0: empty source"),
        (["one", "   "], dict(strict=True), "source 1: empty source"),
        (["forty-two!"], dict(strict=True), "'!'"),
        (["one " * 40], {}, "max_len"),
        (["one"], dict(beam_size=0), "beam size"),
        (["one"], dict(beam_size=2, n_best=3), "n_best"),
        (["one"], dict(length_penalty="bogus"), "length_penalty"),
        (["one"], dict(max_len_a=float("inf")), "max_len_a must be a finite number >= 0, got inf"),
        (["one"], dict(max_len_a=float("nan")), "max_len_a must be a finite number >= 0, got nan"),
        (["one"], dict(max_len_a=-1.0), "max_len_a must be a finite number >= 0"),
        (["one"], dict(max_len_b=float("inf")), "max_len_b must be a finite number >= 0, got inf"),
        (["one"], dict(max_len_b=-2), "max_len_b must be a finite number >= 0"),
        (["one"], dict(beam_size=2, alpha=float("nan")), "alpha must be a finite number >= 0"),
        (["one"], dict(batch_size=0), "batch_size must be a positive integer"),
    ],
)
def test_bad_input(translator, sources, kwargs, match):
    with pytest.raises(TranslationError, match=match):
        translator.translate(sources, **kwargs)


def test_translate_takes_a_list(translator):
    with pytest.raises(TypeError, match="list"):
        translator.translate("forty-two")


def test_translate_takes_any_iterable_in_order(translator):
    """A generator used to be decoded in full and then fail (sources[i] on a generator)."""
    sources = ["forty-two", "seven thousand and seventeen", "one", "twelve", "three hundred"]
    want = translator.translate(sources)
    assert want[0] == "zweiundvierzig" and want[2] == "eins"
    assert translator.translate(s for s in sources) == want
    got = translator.translate_detailed(iter(sources), beam_size=2, batch_size=2)
    assert [t.text for t in got] == want and [t.source for t in got] == sources
    assert translator.translate(iter([])) == []


def test_huge_budget_is_capped_with_a_warning(translator, caplog):
    """max_len_a = 1e30 used to become a budget of one token (an int64 overflow wrapped to 1)."""
    sources = ["seven thousand, seven hundred and seventy-seven", "one"]
    want = translator.translate(sources)
    for kwargs in (dict(max_len_a=1e30), dict(max_len_b=1e20), dict(max_len_a=2.0**70, max_len_b=1e300)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="transformer_ext.translator"):
            assert translator.translate(sources, **kwargs) == want
        (record,) = [r for r in caplog.records if r.name == "transformer_ext.translator"]
        assert "exceeds the model's max_len = 64" in record.getMessage()
        assert "capped at 64 tokens for 2 of 2 sources" in record.getMessage()


def test_default_budget_is_capped_silently(translator, caplog):
    long = "nine thousand, nine hundred and ninety-nine"  # 1.5 * 43 + 10 > max_len: capped, no warning
    with caplog.at_level(logging.WARNING):
        (t,) = translator.translate([long])
    assert t == "neuntausendneunhundertneunundneunzig"
    assert not [r for r in caplog.records if r.name == "transformer_ext.translator"]


def test_progress_bar_only_for_many_batches(translator, monkeypatch):
    err = _Tty()
    monkeypatch.setattr(sys, "stderr", err)
    sources = ["one", "two", "three", "four", "five"]
    translator.translate(sources, batch_size=2, progress=True)  # 3 batches: no bar
    assert err.getvalue() == ""
    out = translator.translate(sources, batch_size=1, progress=True)
    assert "translating" in err.getvalue() and "source" in err.getvalue()
    assert out == ["eins", "zwei", "drei", "vier", "fünf"]


def test_missing_model_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        Translator.from_model_dir(tmp_path / "nope")


def test_model_without_tokenizer_loads_but_cannot_translate_text(tmp_path):
    from transformer_ext.decoding import greedy_decode

    partial = tmp_path / "no_tokenizer"
    shutil.copytree(DEMO_MODEL_DIR, partial)
    os.remove(partial / "tokenizer.json")
    translator = Translator.from_model_dir(partial)
    assert translator.tokenizer is None
    with pytest.raises(
        TranslationError,
        match=r"no_tokenizer has no tokenizer.json: a tokenizer is needed to "
        r"translate text",
    ):
        translator.translate(["one"])
    ids = np.array([[5, 6, 7]], dtype=np.int64)  # token ids still decode (benchmarks)
    (out,) = greedy_decode(translator.runner, ids, np.array([3]), bos_id=1, eos_id=2, max_decoding_length=4)
    assert len(out) <= 4


def _model_copy(tmp_path, name="model"):
    folder = tmp_path / name
    shutil.copytree(DEMO_MODEL_DIR, folder)
    return folder


def test_corrupt_tokenizer_is_an_error_naming_the_file(tmp_path):
    folder = _model_copy(tmp_path)
    text = (folder / "tokenizer.json").read_text(encoding="utf-8")
    (folder / "tokenizer.json").write_text(text[: len(text) // 2], encoding="utf-8")
    with pytest.raises(
        TokenizerError, match=rf"corrupt tokenizer file {folder}/tokenizer.json: not valid JSON"
    ):
        Translator.from_model_dir(folder)


def test_special_ids_checked_against_the_config(tmp_path):
    folder = _model_copy(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["eos_id"] = 3
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        TranslationError,
        match=rf"special id mismatch: {folder}/config.json has eos_id = 3 but "
        rf"{folder}/tokenizer.json has eos = 2",
    ):
        Translator.from_model_dir(folder)


# ---------------------------------------------------------------------- command line
def run_main(args, stdin_text=None, capsys=None):
    stdin = io.StringIO(stdin_text) if stdin_text is not None else _Tty()
    code = main(args, stdin=stdin)
    out, err = capsys.readouterr()
    return code, out, err


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_cli_text_file_and_stdin(tmp_path, capsys):
    code, out, _ = run_main(["three hundred and forty-two", "forty-two"], capsys=capsys)
    assert code == 0 and out == "dreihundertzweiundvierzig\nzweiundvierzig\n"
    f = tmp_path / "in.txt"
    f.write_text("one\ntwelve\n", encoding="utf-8")
    code, out, _ = run_main(["--input", str(f)], capsys=capsys)
    assert code == 0 and out == "eins\nzwölf\n"
    code, out, _ = run_main([], stdin_text="two\nthree\n", capsys=capsys)
    assert code == 0 and out == "zwei\ndrei\n"
    code, out, _ = run_main(["-"], stdin_text="four\n", capsys=capsys)
    assert code == 0 and out == "vier\n"


def test_cli_n_best_prints_scores(capsys):
    code, out, _ = run_main(["forty-two", "seven", "--beam", "3", "--n-best", "2"], capsys=capsys)
    assert code == 0
    lines = [line.split("\t") for line in out.splitlines()]
    assert [line[0] for line in lines] == ["0", "0", "1", "1"]
    assert lines[0][2] == "zweiundvierzig" and lines[2][2] == "sieben"
    assert float(lines[0][1]) >= float(lines[1][1])


def test_cli_options_reach_the_decoder(capsys):
    code, out, _ = run_main(
        [
            "seven thousand, seven hundred and seventy-seven",
            "--max-len-a",
            "0",
            "--max-len-b",
            "4",
            "--beam",
            "2",
            "--model",
            str(DEMO_MODEL_DIR),
            "--device",
            "cpu",
        ],
        capsys=capsys,
    )
    assert code == 0 and len(out.strip()) <= 4


def test_cli_compile_translates_like_eager(capsys):
    """--compile (decoder step through torch.compile) prints what the eager decoder prints."""
    sources = ["forty-two", "three hundred and forty-two", "seven"]
    code, eager, _ = run_main(sources, capsys=capsys)
    assert code == 0
    code, compiled, _ = run_main(sources + ["--compile"], capsys=capsys)
    assert code == 0 and compiled == eager
    assert eager.splitlines()[0] == "zweiundvierzig"


@pytest.mark.parametrize(
    "args, stdin_text, match",
    [
        (["--strict", ""], None, "argument 1: empty source"),
        (
            ["--strict", "one", "forty-two?"],
            None,
            "argument 2: the source text (10 characters) has 1 character outside",
        ),
        (["one " * 40], None, "max_len"),
        (["--strict"], "one\n\ntwo\n", "stdin, line 2: empty"),
        (["--input", "/nonexistent/file.txt"], None, "input file not found"),
        (["one", "--model", "/nonexistent/model"], None, "model directory not found"),
    ],
)
def test_cli_input_errors_exit_1_without_traceback(args, stdin_text, match, capsys):
    code, out, err = run_main(args, stdin_text=stdin_text, capsys=capsys)
    assert code == 1
    assert err.startswith("python -m transformer_ext.translate: error: ") and match in err
    assert "Traceback" not in err and len(err.splitlines()) == 1
    assert out == ""


def test_cli_names_the_file_and_line_of_a_bad_source(tmp_path, capsys):
    f = tmp_path / "in.txt"
    f.write_text("one\ntwo!\n", encoding="utf-8")
    code, _, err = run_main(["--strict", "--input", str(f)], capsys=capsys)
    assert code == 1 and f"{f}, line 2: the source text" in err and "'!' at 3" in err


@pytest.mark.parametrize(
    "args, match",
    [
        (["one", "--max-len-a", "inf"], "--max-len-a must be a finite number >= 0, got inf"),
        (["one", "--max-len-a", "nan"], "--max-len-a must be a finite number >= 0, got nan"),
        (["one", "--max-len-a", "-1"], "--max-len-a must be a finite number >= 0, got -1.0"),
        (["one", "--max-len-b", "1e999"], "--max-len-b must be a finite number >= 0, got inf"),
        (["one", "--alpha", "nan"], "--alpha must be a finite number >= 0"),
        (["one", "--beam", "2", "--n-best", "3"], "--n-best must be between 1 and --beam (2), got 3"),
        (["one", "--beam", "0"], "--beam must be >= 1"),
        (["one", "--batch-size", "0"], "--batch-size must be >= 1"),
        (["one", "--workers", "0"], "--workers must be >= 1, got 0"),
        (
            ["one", "--workers", "2", "--runtime", "eager"],
            "--workers applies to the onnxruntime runtime only",
        ),
        (["one", "--device", "tpu"], "--device 'tpu' is not a device name; use cpu or cuda (or cuda:N)"),
        (["one", "--length-penalty", "wu"], "invalid choice"),
        ([], "nothing to translate"),
    ],
)
def test_cli_option_errors_are_usage_errors(args, match, capsys):
    """Checked before anything is read or loaded: argparse's exit code 2 and message."""
    with pytest.raises(SystemExit) as info:
        main(args, stdin=_Tty())
    out, err = capsys.readouterr()
    assert info.value.code == 2 and match in err and "usage:" in err and "Traceback" not in err and out == ""


def test_cli_huge_budget_translates_with_a_capped_warning(capsys, caplog):
    with caplog.at_level(logging.WARNING, logger="transformer_ext.translator"):
        code, out, _ = run_main(["forty-two", "--max-len-a", "1e30"], capsys=capsys)
    assert code == 0 and out == "zweiundvierzig\n"  # used to print one character
    assert any("capped at 64 tokens" in r.getMessage() for r in caplog.records)


def test_cli_average_length_penalty(capsys):
    code, out, _ = run_main(
        ["forty-two", "--beam", "3", "--n-best", "2", "--length-penalty", "average", "--alpha", "1"],
        capsys=capsys,
    )
    assert code == 0
    lines = [line.split("\t") for line in out.splitlines()]
    assert lines[0][2] == "zweiundvierzig" and float(lines[0][1]) >= float(lines[1][1])


def test_cli_debug_shows_the_traceback(capsys):
    with pytest.raises(TranslationError, match="'!'"):
        main(["forty-two!", "--strict", "--debug"], stdin=_Tty())


def test_cli_interrupt_exits_130_and_prints_nothing(monkeypatch, capsys):
    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Translator, "translate_detailed", interrupted)
    code, out, err = run_main(["one"], capsys=capsys)
    assert code == 130 and out == ""
    assert err == "interrupted after 0 translated lines\npython -m transformer_ext.translate: interrupted\n"


def test_cli_progress_lines_on_stderr(monkeypatch):
    """A progress line every PROGRESS_SECONDS, on a terminal and when piped alike."""
    from transformer_ext import translate

    for err in (_Tty(), io.StringIO()):
        monkeypatch.setattr(sys, "stderr", err)
        monkeypatch.setattr(translate, "PROGRESS_SECONDS", 0.0)
        out = io.StringIO()
        assert main(["one", "two", "three", "four", "--batch-size", "1"], stdin=_Tty(), stdout=out) == 0
        assert out.getvalue() == "eins\nzwei\ndrei\nvier\n" and "translated 4 lines" in err.getvalue()
    quiet = io.StringIO()
    monkeypatch.setattr(sys, "stderr", quiet)
    monkeypatch.setattr(translate, "PROGRESS_SECONDS", 3600.0)
    assert main(["one", "two"], stdin=_Tty(), stdout=io.StringIO()) == 0
    assert quiet.getvalue() == ""  # a short run: no progress line


def test_cli_missing_tokenizer_exit_1(tmp_path, capsys):
    partial = tmp_path / "model"
    shutil.copytree(DEMO_MODEL_DIR, partial)
    os.remove(partial / "tokenizer.json")
    code, out, err = run_main(["one", "--model", str(partial)], capsys=capsys)
    assert code == 1 and "a tokenizer is needed to translate text" in err and out == ""


def test_cli_subprocess():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ok = subprocess.run(
        [sys.executable, "-m", "transformer_ext.translate", "three hundred and forty-two"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert ok.returncode == 0 and ok.stdout == "dreihundertzweiundvierzig\n", ok.stderr
    unknown = subprocess.run(  # a character outside the vocabulary: the unknown token and a warning
        [sys.executable, "-m", "transformer_ext.translate", "forty-two!"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert unknown.returncode == 0 and "'!'" in unknown.stderr and unknown.stdout.count("\n") == 1
    bad = subprocess.run(
        [sys.executable, "-m", "transformer_ext.translate", "--strict", "forty-two!"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert bad.returncode == 1 and "Traceback" not in bad.stderr and "'!'" in bad.stderr


# ---------------------------------------------------------------------- the Translator API
def test_translator_takes_a_tokenizer_and_a_runner(translator):
    from transformer_ext.runtimes import EagerRunner

    direct = Translator(translator.tokenizer, EagerRunner(translator.model, "cpu"), beam_size=2)
    assert direct.translate(["forty-two", "seven"]) == ["zweiundvierzig", "sieben"]
    assert direct.translate_detailed(["seven"])[0].score is not None  # the translator's beam size 2
    assert direct.translate_detailed(["seven"], beam_size=1)[0].score is None  # overridden per call
    with pytest.raises(TypeError, match=r"Translator.from_model_dir\(path\)"):
        Translator(str(DEMO_MODEL_DIR))
    with pytest.raises(TypeError, match=r"Translator.from_model_dir\(path\)"):
        Translator()
    with pytest.raises(TypeError, match="runner must implement encode / step / reorder"):
        Translator(translator.tokenizer, object())
    with pytest.raises(TranslationError, match="beam size must be a positive integer, got 0"):
        Translator(translator.tokenizer, direct.runner, beam_size=0)  # checked when built


def test_from_model_gives_translation_objects(translator):
    """The form transformer_ext.train reads (`.text` of each result)."""
    detailed = Translator.from_model(translator.model, translator.tokenizer, "cpu")
    (out,) = detailed.translate(["forty-two"], beam_size=2, n_best=1)
    assert out.text == "zweiundvierzig" and out.source == "forty-two"


def test_generation_defaults_come_from_a_generation_config(translator):
    from types import SimpleNamespace

    from transformer_ext.runtimes import EagerRunner

    runner = EagerRunner(translator.model, "cpu")
    config = SimpleNamespace(
        beam_size=3,
        length_penalty="none",
        alpha=0.6,
        max_len_a=0.0,
        max_len_b=6.0,
        min_new_tokens=0,
        max_new_tokens=4,
        special_tokens={"pad": 0, "bos": 1, "eos": 2},
    )
    configured = Translator(translator.tokenizer, runner, generation=config)
    (hyp,) = configured.translate_detailed(["seven thousand, seven hundred and seventy-seven"])[0].hypotheses
    assert hyp.score is not None  # beam search, from the config
    assert len(hyp.tokens) == 4 and not hyp.finished  # max_new_tokens 4 caps the budget of 6
    assert configured.translate(["seven"], max_len_b=2) == ["si"]  # a call still overrides it
    forced = Translator(
        translator.tokenizer,
        runner,
        generation=SimpleNamespace(
            **{**vars(config), "min_new_tokens": 3, "max_new_tokens": 64, "max_len_b": 10.0}
        ),
    )
    (short,) = forced.translate_detailed(["one"], beam_size=1)
    assert len(short.hypotheses[0].tokens) >= 3  # EOS suppressed before 3 tokens ("eins" has 4 anyway)
    assert len(forced.translate(["zero"], beam_size=1)[0]) >= 3
    bad = SimpleNamespace(**{**vars(config), "special_tokens": {"pad": 0, "bos": 1, "eos": 5}})
    with pytest.raises(
        TranslationError,
        match="special id mismatch: the generation config has eos = 5 but the tokenizer has eos = 2",
    ):
        Translator(translator.tokenizer, runner, generation=bad)


# ---------------------------------------------------------------------- --output
def test_cli_output_file_is_written_atomically(tmp_path, capsys):
    out = tmp_path / "out.txt"
    code, stdout, _ = run_main(["forty-two", "seven", "--output", str(out)], capsys=capsys)
    assert code == 0 and stdout == "" and out.read_text(encoding="utf-8") == "zweiundvierzig\nsieben\n"
    code, _, _ = run_main(["one", "--output", str(out)], capsys=capsys)  # a file it wrote is replaced
    assert code == 0 and out.read_text(encoding="utf-8") == "eins\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]  # no temporaries left


@pytest.mark.parametrize(
    "case", ["directory", "missing folder", "parent is a file", "same as input", "empty"]
)
def test_cli_bad_output_is_refused_before_reading_or_loading(tmp_path, capsys, monkeypatch, case):
    src = tmp_path / "in.txt"
    src.write_text("one\n", encoding="utf-8")
    (tmp_path / "file").write_text("x", encoding="utf-8")
    output, match = {
        "directory": (str(tmp_path), "is a directory; give a file path"),
        "missing folder": (str(tmp_path / "no" / "out.txt"), f"the folder {tmp_path / 'no'} does not exist"),
        "parent is a file": (str(tmp_path / "file" / "out.txt"), "is not a directory"),
        "same as input": (str(src), "is the --input file"),
        "empty": ("", "--output must name a file"),
    }[case]

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before --output was checked")

    monkeypatch.setattr(Translator, "from_model_dir", no_loading)
    code, out, err = run_main(["--input", str(src), "--output", output], capsys=capsys)
    assert code == 1 and out == "" and match in err and len(err.splitlines()) == 1
    assert src.read_text(encoding="utf-8") == "one\n"


def test_cli_output_interrupted_or_disk_full_leaves_the_old_file(tmp_path, capsys, monkeypatch):
    import errno

    out = tmp_path / "out.txt"
    out.write_text("previous\n", encoding="utf-8")

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(Translator, "translate_detailed", interrupted)
        code, stdout, _ = run_main(["one", "--output", str(out)], capsys=capsys)
    assert code == 130 and stdout == "" and out.read_text(encoding="utf-8") == "previous\n"

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    code, stdout, err = run_main(["one", "--output", str(out)], capsys=capsys)
    assert code == 1 and stdout == "" and len(err.splitlines()) == 1
    assert (
        err
        == f"python -m transformer_ext.translate: error: no space left on the device; free some space and run "
        f"the command again: {out}\n"
    )
    assert out.read_text(encoding="utf-8") == "previous\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]  # the temporary is gone


def test_the_tokenizer_is_checked_against_the_model_once(monkeypatch):
    """One check of the tokenizer against the runner's description record (there were two: the
    loader's, naming the files, then the constructor's)."""
    from transformer_ext import translator as translator_module

    calls = []
    real = translator_module.check_model_config

    def counting(tokenizer, config, **names):
        calls.append(names)
        return real(tokenizer, config, **names)

    monkeypatch.setattr(translator_module, "check_model_config", counting)
    loaded = Translator.from_model_dir()
    assert calls == [
        {
            "tokenizer_file": os.fspath(DEMO_MODEL_DIR / "tokenizer.json"),
            "config_file": os.fspath(DEMO_MODEL_DIR / "config.json"),
        }
    ]
    calls.clear()
    Translator(loaded.tokenizer, loaded.runner)
    assert calls == [{"tokenizer_file": None, "config_file": None}]


def test_translator_reads_its_limits_from_the_runner_record(translator):
    """A runner whose record says fewer positions than the model has: the translator respects
    the record (sources longer are refused, budgets capped), whatever the runner object holds."""
    import dataclasses

    from transformer_ext.runtimes import EagerRunner

    short, long = "seven", "seven thousand and seven"
    n_short = len(translator.tokenizer.encode_source(short))
    n_long = len(translator.tokenizer.encode_source(long))
    runner = EagerRunner(translator.model, "cpu")
    runner.info = dataclasses.replace(runner.info, max_cache_len=3, max_src_len=n_short)
    limited = Translator(translator.tokenizer, runner)
    (one,) = limited.translate_detailed([short], max_len_b=50)
    assert len(one.hypotheses[0].tokens) <= 3  # at most 3 fed tokens
    with pytest.raises(
        TranslationError, match=rf"source 0: {n_long} tokens, more than the model's max_len \({n_short}\)"
    ):
        limited.translate([long])
    bare = type("Bare", (), {"encode": lambda *a: None, "step": lambda *a: None, "reorder": lambda *a: None})
    with pytest.raises(
        TypeError, match="runner must describe itself with a transformer_ext.runtimes.RunnerInfo"
    ):
        Translator(translator.tokenizer, bare())


# ---------------------------------------------------------------------- outputs, pipes, signals
def test_cli_workers_translate_like_one_runner(exported_portable, capsys):
    lines = ["one", "two", "three", "four"]
    code, one, _ = run_main(["--model", str(exported_portable), "--beam", "2", *lines], capsys=capsys)
    assert code == 0
    code, split, _ = run_main(
        ["--model", str(exported_portable), "--beam", "2", "--workers", "2", "--threads", "1", *lines],
        capsys=capsys,
    )
    assert code == 0 and split == one and len(one.splitlines()) == 4


@pytest.mark.parametrize("target", ["encoder.onnx", "manifest.json", "new.txt"])
def test_output_inside_the_export_folder_in_use_is_refused(exported_portable, tmp_path, capsys, target):
    """`--model EXP --output EXP/encoder.onnx` used to overwrite the export's encoder."""
    export = tmp_path / "export"
    shutil.copytree(exported_portable, export)
    before = {p.name: p.read_bytes() for p in export.iterdir()}
    out = export / target
    code, stdout, err = run_main(["--model", str(export), "--output", str(out), "one"], capsys=capsys)
    assert code == 1 and stdout == ""
    assert (
        f"--output {out} lies inside the model folder --model {export}" in err and len(err.splitlines()) == 1
    )
    assert {p.name: p.read_bytes() for p in export.iterdir()} == before


def test_output_inside_the_bundled_demo_model_is_refused(capsys):
    out = DEMO_MODEL_DIR / "hyp.txt"
    code, _, err = run_main(["--output", str(out), "one"], capsys=capsys)
    assert code == 1 and "lies inside the model folder --model" in err and not out.exists()


def test_output_in_a_training_runs_managed_folder_is_refused(tmp_path, capsys):
    from transformer_ext.training.run_folder import RUN_FORMAT, RUN_MARKER

    run = tmp_path / "run"
    (run / "best").mkdir(parents=True)
    (run / RUN_MARKER).write_text(json.dumps({"format": RUN_FORMAT}))
    out = run / "best" / "hyp.txt"
    code, _, err = run_main(["--output", str(out), "one"], capsys=capsys)
    assert code == 1 and "which the program manages" in err and not out.exists()


ROOT_ENV = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_a_reader_that_goes_away_stops_translate_quietly(tmp_path):
    """`translate ... | head -1` printed `error: Broken pipe` and exited 1; now it
    stops like a Unix tool: no message, exit 0 or 141. The reader here closes its end before
    anything is written, so the write fails whatever the size of the pipe's buffer."""
    src = tmp_path / "in.txt"
    src.write_text("".join(f"{w}\n" for w in ["forty-two", "seven", "one"] * 20), encoding="utf-8")
    read_end, write_end = os.pipe()
    os.close(read_end)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "transformer_ext.translate",
            "--model",
            str(DEMO_MODEL_DIR),
            "--input",
            str(src),
        ],
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
        env=ROOT_ENV,
        cwd=ROOT,
        timeout=300,
    )
    os.close(write_end)
    assert proc.returncode in (0, 141) and proc.stderr == "", (proc.returncode, proc.stderr)


@pytest.mark.parametrize("when", ["first batch", "last batch"])
def test_sigterm_during_translate_output_exits_143_and_keeps_the_old_file(tmp_path, when):
    """SIGTERM while `translate --input MANY --output O --beam-size 4` runs: exit 143, the
    old O kept, no temporary left. The child sends SIGTERM to itself from inside a beam search."""
    src = tmp_path / "in.txt"
    src.write_text("".join(f"{w}\n" for w in ["forty-two", "seven thousand and seven", "one"] * 4), "utf-8")
    out = tmp_path / "out.txt"
    out.write_text("old\n", encoding="utf-8")
    kill_at = 1 if when == "first batch" else 6  # 12 sources, batches of 2
    code = (
        "import os, signal, sys\n"
        "from transformer_ext import decoding\n"
        "from transformer_ext.translate import main\n"
        "real, calls = decoding.beam_search, []\n"
        "def beam_search(*a, **k):\n"
        "    calls.append(1)\n"
        f"    if len(calls) == {kill_at}:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return real(*a, **k)\n"
        "decoding.beam_search = beam_search\n"
        f"sys.exit(main(['--model', {str(DEMO_MODEL_DIR)!r}, '--input', {str(src)!r}, '--output', {str(out)!r},"
        " '--beam-size', '4', '--max-batch-size', '2']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=ROOT_ENV, cwd=ROOT, timeout=300
    )
    assert proc.returncode == 143, proc.stderr
    *progress, last = proc.stderr.strip().splitlines()  # progress lines may come first (slow machine)
    assert last == "python -m transformer_ext.translate: terminated"
    assert all(line.startswith("translated ") for line in progress)
    assert out.read_text(encoding="utf-8") == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.txt"]
