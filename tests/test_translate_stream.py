"""The translate command's streaming, robust input and decoding controls, on the bundled demo model."""

from __future__ import annotations

import io
import os
import selectors
import subprocess
import sys
from pathlib import Path

import pytest

from transformer_ext import translate
from transformer_ext.translate import main


class Stdin(io.StringIO):
    """Piped lines (not a terminal)."""

    def __init__(self, lines):
        super().__init__("".join(line + "\n" for line in lines))

    def isatty(self):
        return False


class Stdout(io.StringIO):
    """Records how many batches had been decoded at the first write."""

    def __init__(self, batches):
        super().__init__()
        self.batches, self.batches_at_first_write = batches, None

    def write(self, text):
        if self.batches_at_first_write is None:
            self.batches_at_first_write = len(self.batches)
        return super().write(text)


REPO = Path(__file__).resolve().parents[1]

LINES = ["seven", "forty-two", "one thousand and one", "three hundred", "nineteen", "five", "eighty", "two"]


def _count_batches(monkeypatch) -> list:
    """The sizes of the batches the translator decodes, appended as each is decoded."""
    batches = []
    decode = translate.Translator._decode_batch

    def counted(self, encoded, *args, **kwargs):
        batches.append(len(encoded))
        return decode(self, encoded, *args, **kwargs)

    monkeypatch.setattr(translate.Translator, "_decode_batch", counted)
    return batches


def test_first_line_is_printed_before_the_last_batch_is_decoded(monkeypatch):
    batches = _count_batches(monkeypatch)
    stdout = Stdout(batches)
    assert main(["--window", "2"], stdin=Stdin(LINES), stdout=stdout) == 0
    assert stdout.getvalue().splitlines() == translate.Translator.from_model_dir(None).translate_text(LINES)
    assert stdout.batches_at_first_write <= 2 < len(batches)


def test_a_5000_line_input_prints_after_its_first_batch_with_the_default_settings(monkeypatch):
    """The streaming target: with the CLI's defaults (one window holding the whole input, token
    batches), the first line is written after one decoded batch of many."""
    import random

    from transformer_ext import data

    rng = random.Random(0)
    lines = [data.source_text(rng.randint(0, 9_999)) for _ in range(5000)]
    batches = _count_batches(monkeypatch)
    stdout = Stdout(batches)
    assert main([], stdin=Stdin(lines), stdout=stdout) == 0
    out = stdout.getvalue().splitlines()
    assert len(out) == 5000 and sum(batches) == 5000
    assert stdout.batches_at_first_write == 1 < len(batches), (stdout.batches_at_first_write, len(batches))
    # spot-check lines against a translator decoding them on their own
    picks = [0, 1, 2499, 4999]
    assert [out[i] for i in picks] == translate.Translator.from_model_dir(None).translate_text(
        [lines[i] for i in picks]
    )


def test_progress_lines_on_stderr_when_piped(monkeypatch, capsys):
    monkeypatch.setattr(translate, "PROGRESS_SECONDS", 0.0)
    stdin = Stdin(LINES[:3])
    assert main([], stdin=stdin, stdout=io.StringIO()) == 0
    err = capsys.readouterr().err
    assert "translated 3 lines" in err


def test_empty_line_and_unknown_characters(capsys, caplog):
    stdout = io.StringIO()
    assert main([], stdin=Stdin(["one", "", "seven€"]), stdout=stdout) == 0
    assert stdout.getvalue().splitlines() == ["eins", "", "sieben"]
    (warning,) = [r.getMessage() for r in caplog.records if "outside the vocabulary" in r.getMessage()]
    assert "source 2:" in warning  # the line's index in the whole input
    assert main(["--strict"], stdin=Stdin(["one", "", "two"]), stdout=io.StringIO()) == 1
    assert "stdin, line 2: empty source" in capsys.readouterr().err
    assert main(["--strict"], stdin=Stdin(["one", "seven€"]), stdout=io.StringIO()) == 1
    assert "stdin, line 2: the source text" in capsys.readouterr().err


def test_long_lines_error_or_truncate(capsys, caplog):
    long = " ".join(["seven"] * 20)
    assert main([], stdin=Stdin(["one", long]), stdout=io.StringIO()) == 1
    assert "stdin, line 2: " in capsys.readouterr().err
    stdout = io.StringIO()
    assert main(["--long-lines", "truncate"], stdin=Stdin(["one", long]), stdout=stdout) == 0
    assert len(stdout.getvalue().splitlines()) == 2
    assert any("truncated" in r.getMessage() for r in caplog.records)


def test_interrupted_run_says_how_far_it_got_and_writes_no_output(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out.txt"
    decode = translate.Translator._decode_batch
    calls = []

    def interrupted(self, encoded, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return decode(self, encoded, *args, **kwargs)

    monkeypatch.setattr(translate.Translator, "_decode_batch", interrupted)
    code = main(["--output", str(out), "--window", "2"], stdin=Stdin(LINES), stdout=io.StringIO())
    assert code == 130
    assert not out.exists()
    assert "interrupted after 4 translated lines; nothing written to" in capsys.readouterr().err


def test_output_file_is_written_at_the_end(tmp_path):
    out = tmp_path / "out.txt"
    assert main(["--output", str(out)], stdin=Stdin(LINES[:3]), stdout=io.StringIO()) == 0
    assert out.read_text().splitlines() == ["sieben", "zweiundvierzig", "eintausendeins"]


def test_decoding_controls_on_the_command_line(capsys):
    def run(*args):
        stdout = io.StringIO()
        assert main(list(args) + ["forty-two", "seven"], stdout=stdout) == 0
        return stdout.getvalue().splitlines()

    sampled = run("--sampling-topk", "0", "--sampling-temperature", "2.0", "--seed", "5")
    assert sampled == run("--sampling-topk", "0", "--sampling-temperature", "2.0", "--seed", "5")
    assert all(line.startswith("zwei") for line in run("--target-prefix", "zwei"))
    scored = run("--scores", "--no-repeat-ngram-size", "3", "--repetition-penalty", "1.2")
    assert all(float(line.split("\t")[0]) <= 0 for line in scored)
    assert (
        len(run("--beam", "3", "--length-penalty", "hf", "--alpha", "1.0", "--early-stopping", "true")) == 2
    )


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--sampling-topp", "0.5"], "--sampling-topp applies to random sampling"),
        (["--sampling-topk", "0", "--sampling-topp", "0"], "--sampling-topp must be in (0, 1]"),
        (["--sampling-topk", "0", "--beam", "2"], "random sampling (--sampling-topk) needs --beam 1"),
        (["--early-stopping", "true"], "--early-stopping applies with --length-penalty hf"),
        (["--repetition-penalty", "0"], "--repetition-penalty must be a finite number > 0"),
        (["--max-batch-tokens", "0"], "--max-batch-tokens must be >= 1"),
        (["--min-length", "-1"], "--min-length must be >= 0"),
    ],
)
def test_conflicting_options_are_usage_errors(args, fragment, capsys):
    with pytest.raises(SystemExit) as exc:
        main(args + ["one"], stdout=io.StringIO())
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err


def _read_lines(stream, n: int, timeout: float) -> list[str]:
    """At least the first ``n`` lines of a pipe, read from its file descriptor (no buffer hides what has
    arrived), or a failure after ``timeout`` seconds without new output (never a hang)."""
    data = b""
    with selectors.DefaultSelector() as sel:
        sel.register(stream, selectors.EVENT_READ)
        while data.count(b"\n") < n:
            if not sel.select(timeout):
                pytest.fail(f"no output within {timeout} s (so far: {data!r})")
            chunk = os.read(stream.fileno(), 65536)
            if not chunk:
                pytest.fail(f"the output ended after {data!r}")
            data += chunk
    return data.decode("utf-8").splitlines()


def test_an_open_pipe_gets_its_first_translations_before_the_writer_closes_it():
    """stdin is read lazily: with --window 2 the first window is translated and printed while
    the writer still holds the pipe open (the old reader waited for the end of the input)."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "transformer_ext.translate", "--window", "2"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=REPO,
    )
    try:
        proc.stdin.write(b"seven\nforty-two\nnineteen\n")  # a whole window and one more line
        proc.stdin.flush()
        first = _read_lines(proc.stdout, 2, timeout=300)
        assert proc.poll() is None  # still running: the pipe is open
        proc.stdin.write(b"five\n")
        proc.stdin.close()
        rest = proc.stdout.read().decode("utf-8")
        assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            stream.close()
    expected = translate.Translator.from_model_dir(None).translate_text(
        ["seven", "forty-two", "nineteen", "five"]
    )
    assert first[:2] == expected[:2]
    assert first + rest.splitlines() == expected


def test_a_stalled_pipe_gets_each_answer_while_it_stays_open():
    """With the default window (8,192 lines), a writer that sends one line and waits for its
    answer gets it: when the input stalls, what has arrived is translated."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "transformer_ext.translate"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=REPO,
    )
    answers = []
    try:
        for line in (b"seven\n", b"forty-two\n"):
            proc.stdin.write(line)
            proc.stdin.flush()
            answers.append(_read_lines(proc.stdout, 1, timeout=120))
            assert proc.poll() is None  # the pipe is still open, the command still running
        proc.stdin.close()
        rest = proc.stdout.read().decode("utf-8")
        assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            stream.close()
    assert answers == [["sieben"], ["zweiundvierzig"]] and rest == ""


def test_flowing_pipe_input_is_still_batched_by_the_window():
    """Lines that have arrived are read as one window (one batch here); a stall ends a window early."""
    from transformer_ext.batching import translate_iterable
    from transformer_ext.text import iter_stream_lines

    read_end, write_end = os.pipe()
    batches = []

    def translate_batch(batch):
        batches.append(list(batch))
        return [line.upper() for line in batch]

    with os.fdopen(read_end, "rb") as reader, os.fdopen(write_end, "wb") as writer:
        writer.write(b"".join(f"line {i}\n".encode() for i in range(50)))
        writer.flush()
        lines = iter_stream_lines(reader, "stdin")
        out = translate_iterable(
            translate_batch, lines, length=len, max_batch_tokens=10_000, window=100, ready=lines.ready
        )
        first = [next(out) for _ in range(50)]  # the 50 lines that arrived, before the writer closes
        assert len(batches) == 1 and len(batches[0]) == 50
        writer.write(b"last\n")
        writer.close()
        rest = list(out)
    assert first == [f"LINE {i}" for i in range(50)] and rest == ["LAST"]
    assert len(batches) == 2
