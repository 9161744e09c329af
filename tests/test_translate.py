"""The Translator API, the translate CLI and the bundled demo model's accuracy."""

import io
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
from num2words import num2words  # the independent oracle of the demo task

from transformer_ext.data import split_numbers
from transformer_ext.translate import DEMO_MODEL_DIR, TranslationError, Translator, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELDOUT_SAMPLE = 200  # fixed sample of the held-out numbers (never seen in training)
MIN_EXACT_MATCH = 0.98


@pytest.fixture(scope="module")
def translator():
    return Translator()  # the bundled demo model, CPU


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
    outputs = [t.text for t in translator.translate(sources)]
    wrong = [(s, o, r) for s, o, r in zip(sources, outputs, references) if o != r]
    exact = 1 - len(wrong) / len(sources)
    assert exact >= MIN_EXACT_MATCH, f"greedy exact match {exact:.3f}; first errors: {wrong[:5]}"


def test_examples(translator):
    out = translator.translate(["three hundred and forty-two", "forty-two", "  One   Thousand and one "])
    assert [t.text for t in out] == ["dreihundertzweiundvierzig", "zweiundvierzig", "eintausendeins"]
    assert out[0].source == "three hundred and forty-two"
    assert out[0].score is None  # greedy: no beam score


def test_beam_n_best(translator):
    (one,) = translator.translate(["seven thousand and seventeen"], beam_size=4, n_best=3)
    assert len(one.hypotheses) == 3
    scores = [h.score for h in one.hypotheses]
    assert scores == sorted(scores, reverse=True)
    assert len({h.text for h in one.hypotheses}) == 3
    assert one.text == "siebentausendsiebzehn"
    assert all(h.log_prob <= 0 for h in one.hypotheses)


def test_beam_search_of_one_equals_greedy(translator):
    """Beam size 1 through the beam-search code path (not the greedy shortcut) gives the greedy output."""
    from transformer_ext.decoding import beam_search

    sources = ["nine thousand, nine hundred and ninety-nine", "zero", "eleven", "six hundred and six"]
    greedy = translator.translate(sources)
    ids = translator.encode(sources)
    lengths = np.array([len(x) for x in ids])
    padded = np.zeros((len(ids), lengths.max()), dtype=np.int64)
    for i, x in enumerate(ids):
        padded[i, : len(x)] = x
    beams = beam_search(translator.runner, padded, lengths, bos_id=1, eos_id=2, beam_size=1,
                        max_new_tokens=translator.max_new_tokens(lengths, 1.5, 10))
    assert [list(b[0].tokens) for b in beams] == [list(t.hypotheses[0].tokens) for t in greedy]
    assert [t.text for t in greedy] == [t.text for t in translator.translate(sources, beam_size=3)]


def test_batching_does_not_change_outputs(translator):
    sources = [num2words(n, lang="en") for n in (5, 1234, 77, 9001, 300)]
    assert [t.text for t in translator.translate(sources, batch_size=2)] == [
        t.text for t in translator.translate(sources)]


def test_max_length_limits_output(translator):
    (t,) = translator.translate(["seven thousand, seven hundred and seventy-seven"], max_len_a=0, max_len_b=5)
    assert len(t.text) <= 5


@pytest.mark.parametrize(
    "sources, kwargs, match",
    [
        ([""], {}, "source 0 is empty"),
        (["one", "   "], {}, "source 1 is empty"),
        (["forty-two!"], {}, "'!'"),
        (["one " * 40], {}, "max_len"),
        (["one"], dict(beam_size=0), "beam size"),
        (["one"], dict(beam_size=2, n_best=3), "n_best"),
        (["one"], dict(length_penalty="bogus"), "length_penalty"),
    ],
)
def test_bad_input(translator, sources, kwargs, match):
    with pytest.raises(TranslationError, match=match):
        translator.translate(sources, **kwargs)


def test_translate_takes_a_list(translator):
    with pytest.raises(TypeError, match="list"):
        translator.translate("forty-two")


def test_missing_model_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        Translator(tmp_path / "nope")
    partial = tmp_path / "no_tokenizer"
    shutil.copytree(DEMO_MODEL_DIR, partial)
    os.remove(partial / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Translator(partial)


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
    code, out, _ = run_main(["seven thousand, seven hundred and seventy-seven", "--max-len-a", "0",
                             "--max-len-b", "4", "--beam", "2", "--model", str(DEMO_MODEL_DIR),
                             "--device", "cpu"], capsys=capsys)
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
        ([""], None, "empty"),
        (["forty-two?"], None, "'?'"),
        (["one " * 40], None, "max_len"),
        ([], None, "nothing to translate"),
        ([], "one\n\ntwo\n", "line 2: empty"),
        (["--input", "/nonexistent/file.txt"], None, "input file not found"),
        (["one", "--model", "/nonexistent/model"], None, "model directory not found"),
        (["one", "--beam", "2", "--n-best", "3"], None, "--n-best"),
        (["one", "--beam", "0"], None, "--beam"),
    ],
)
def test_cli_errors_exit_2_without_traceback(args, stdin_text, match, capsys):
    code, out, err = run_main(args, stdin_text=stdin_text, capsys=capsys)
    assert code == 2
    assert match in err and "Traceback" not in err
    assert out == ""


def test_cli_missing_tokenizer_exit_2(tmp_path, capsys):
    partial = tmp_path / "model"
    shutil.copytree(DEMO_MODEL_DIR, partial)
    os.remove(partial / "tokenizer.json")
    code, _, err = run_main(["one", "--model", str(partial)], capsys=capsys)
    assert code == 2 and "tokenizer.json" in err


def test_cli_subprocess():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ok = subprocess.run([sys.executable, "-m", "transformer_ext.translate", "three hundred and forty-two"],
                        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert ok.returncode == 0 and ok.stdout == "dreihundertzweiundvierzig\n", ok.stderr
    bad = subprocess.run([sys.executable, "-m", "transformer_ext.translate", "forty-two!"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "'!'" in bad.stderr
