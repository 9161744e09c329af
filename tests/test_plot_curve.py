"""recipes/plot_curve.py: one run or several runs' validation curves from their summary.json."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "recipes", "plot_curve.py")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_summary(folder, bleus, seconds_per_validation=60.0):
    os.makedirs(folder)
    history = [{"step": 100, "loss": 5.0}]  # a loss-only entry (no BLEU) is skipped
    history += [
        {"step": 150 * (i + 1), "elapsed_s": seconds_per_validation * (i + 1), "bleu": b, "chrf": 3 * b}
        for i, b in enumerate(bleus)
    ]
    path = os.path.join(folder, "summary.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"parameters": 6_554_624, "history": history}, f)
    return path


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120)


def test_one_run_writes_a_png(tmp_path):
    summary = write_summary(tmp_path / "run", [1.0, 4.0, 9.0])
    out = tmp_path / "curve.png"
    res = run(summary, str(out))
    assert res.returncode == 0, res.stderr
    assert out.read_bytes().startswith(PNG_MAGIC)
    assert "3 validations" in res.stdout


def test_several_runs_with_labels_on_a_minutes_axis(tmp_path):
    a = write_summary(tmp_path / "a", [1.0, 4.0])
    b = write_summary(tmp_path / "b", [2.0, 6.0, 11.0], seconds_per_validation=30.0)
    out = tmp_path / "both.png"
    res = run("--minutes", "--label", "float32", a, "--label", "bf16", b, str(out))
    assert res.returncode == 0, res.stderr
    assert out.read_bytes().startswith(PNG_MAGIC)
    assert "float32: 2 validations" in res.stdout and "bf16: 3 validations" in res.stdout
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]


@pytest.mark.parametrize(
    "args, message",
    [
        (["only.png"], "at least one summary.json"),
        (["--label", "x", "--label", "y", "SUMMARY", "out.png"], "2 --label for 1 summaries"),
        (["SUMMARY", "out.jpg"], "must end in .png"),
    ],
)
def test_bad_arguments_are_usage_errors_and_write_nothing(tmp_path, args, message):
    summary = write_summary(tmp_path / "run", [1.0])
    args = [
        summary if a == "SUMMARY" else str(tmp_path / a) if a.endswith((".png", ".jpg")) else a for a in args
    ]
    res = run(*args)
    assert res.returncode == 2
    assert message in res.stderr
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_a_summary_without_bleu_is_one_line_and_exit_1(tmp_path):
    folder = tmp_path / "empty"
    os.makedirs(folder)
    (folder / "summary.json").write_text(json.dumps({"history": [{"step": 1, "loss": 3.0}]}))
    res = run(str(folder / "summary.json"), str(tmp_path / "out.png"))
    assert res.returncode == 1
    assert res.stderr.strip().endswith("no validation with BLEU yet")
    assert not (tmp_path / "out.png").exists()


def test_an_unwritable_output_is_one_line_and_exit_1(tmp_path):
    summary = write_summary(tmp_path / "run", [1.0, 2.0])
    res = run(summary, str(tmp_path / "missing-folder" / "out.png"))
    assert res.returncode == 1
    assert len(res.stderr.strip().splitlines()) == 1 and "cannot write the plot" in res.stderr
    assert sorted(os.listdir(tmp_path)) == ["run"]
