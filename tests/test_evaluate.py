"""Evaluation: scores equal sacrebleu's own command line; the evaluate CLI and its bad input."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sacrebleu")

from transformer_ext.evaluate import main, score_texts

DEMO_DIR = Path(__file__).resolve().parents[1] / "transformer_ext" / "demo_model"
HYPS = [
    "der Hund bellt laut .",
    "ich habe zwei Katzen",
    "Hallo Welt",
    "Ein völlig anderer Satz, mit Ümlauten.",
]
REFS = ["der Hund bellt .", "ich habe drei Katzen", "hallo Welt !", "Ein ganz anderer Satz mit Umlauten."]


def sacrebleu_cli(ref: Path, hyp: Path) -> list[dict]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "sacrebleu",
            str(ref),
            "-i",
            str(hyp),
            "-m",
            "bleu",
            "chrf",
            "--format",
            "json",
            "-w",
            "6",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out)


def write(path: Path, lines) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_scores_equal_sacrebleu_cli(tmp_path):
    cli = sacrebleu_cli(write(tmp_path / "ref", REFS), write(tmp_path / "hyp", HYPS))
    ours = score_texts(HYPS, REFS)
    assert ours["bleu"] == pytest.approx(cli[0]["score"], abs=1e-6)
    assert ours["chrf"] == pytest.approx(cli[1]["score"], abs=1e-6)
    assert ours["bleu_signature"] == cli[0]["signature"]
    assert ours["chrf_signature"] == cli[1]["signature"]


def test_evaluate_cli_model_folder(tmp_path, capsys):
    src = write(tmp_path / "src", ["forty-two", "one hundred and one", "seven", "three thousand and twelve"])
    ref = write(tmp_path / "ref", ["zweiundvierzig", "einhunderteins", "sieben", "dreitausendzwölf"])
    hyp = tmp_path / "hyp"
    assert (
        main(["--model", str(DEMO_DIR), "--src", str(src), "--ref", str(ref), "--output", str(hyp), "--json"])
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    # the printed scores are sacrebleu's on the written hypotheses
    cli = sacrebleu_cli(ref, hyp)
    assert report["bleu"] == pytest.approx(cli[0]["score"], abs=0.005)
    assert report["chrf"] == pytest.approx(cli[1]["score"], abs=0.005)
    assert report["bleu_signature"] == cli[0]["signature"]
    assert report["decoding"]["beam_size"] == 1 and report["runtime"] == "eager"
    # the hypotheses are the translator's own output
    from transformer_ext.translate import Translator

    expected = Translator.from_model_dir(DEMO_DIR).translate(src.read_text().splitlines())
    assert hyp.read_text().splitlines() == expected
    assert main(["--model", str(DEMO_DIR), "--src", str(src), "--ref", str(ref), "--beam", "4"]) == 0
    text = capsys.readouterr().out
    assert (
        "beam 4" in text
        and "BLEU = " in text
        and "nrefs:1|case:mixed|eff:no|tok:13a" in text
        and "chrF = " in text
    )


def test_reference_line_count_differs(tmp_path, capsys):
    src = write(tmp_path / "src", ["one", "two"])
    ref = write(tmp_path / "ref", ["eins"])
    hyp = tmp_path / "hyp"
    assert main(["--model", str(DEMO_DIR), "--src", str(src), "--ref", str(ref), "--output", str(hyp)]) == 1
    err = capsys.readouterr().err
    assert f"--src {src} has 2 lines but --ref {ref} has 1" in err
    assert not hyp.exists()


def test_non_utf8_source_line(tmp_path, capsys):
    src = tmp_path / "src"
    src.write_bytes(b"one\ntwo\n\xff\xfe three\n")
    ref = write(tmp_path / "ref", ["eins", "zwei", "drei"])
    assert main(["--model", str(DEMO_DIR), "--src", str(src), "--ref", str(ref)]) == 1
    assert f"{src}, line 3: not UTF-8" in capsys.readouterr().err


def test_output_is_a_folder(tmp_path, capsys):
    src = write(tmp_path / "src", ["one"])
    ref = write(tmp_path / "ref", ["eins"])
    assert (
        main(["--model", str(DEMO_DIR), "--src", str(src), "--ref", str(ref), "--output", str(tmp_path)]) == 1
    )
    assert "is a folder" in capsys.readouterr().err


def test_output_kept_when_translation_fails(tmp_path, capsys):
    src = write(tmp_path / "src", ["one", "zzz \u4e2d"])  # a character the demo tokenizer does not know
    ref = write(tmp_path / "ref", ["eins", "x"])
    hyp = write(tmp_path / "hyp", ["previous"])
    assert main(["--model", str(DEMO_DIR), "--src", str(src), "--ref", str(ref), "--output", str(hyp)]) == 1
    assert "error" in capsys.readouterr().err
    assert hyp.read_text() == "previous\n"  # written only once everything succeeded


REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("target", ["model.safetensors", "config.json", "new.txt"])
def test_output_inside_the_model_folder_is_refused(tmp_path, capsys, target):
    """--output M/model.safetensors used to overwrite the model's weights."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(DEMO_DIR, model)
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    src = write(tmp_path / "src", ["one"])
    ref = write(tmp_path / "ref", ["eins"])
    out = model / target
    assert main(["--model", str(model), "--src", str(src), "--ref", str(ref), "--output", str(out)]) == 1
    err = capsys.readouterr().err
    assert (
        f"--output {out} lies inside the model folder --model {model}" in err and len(err.splitlines()) == 1
    )
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before  # nothing written


def test_output_that_is_the_reference_file_is_refused(tmp_path, capsys):
    src = write(tmp_path / "src", ["one"])
    ref = write(tmp_path / "ref", ["eins"])
    assert main(["--model", str(DEMO_DIR), "--src", str(src), "--ref", str(ref), "--output", str(ref)]) == 1
    assert f"--output {ref} is the --ref file" in capsys.readouterr().err
    assert ref.read_text() == "eins\n"


@pytest.mark.parametrize(
    "device, code, match",
    [
        ("foo", 2, "--device 'foo' is not a device name; use cpu or cuda (or cuda:N)"),
        ("meta", 2, "unsupported device 'meta'"),
        ("cuda:99", 1, "cuda"),
    ],
)
def test_bad_device_is_one_line_not_a_torch_error(tmp_path, capsys, device, code, match):
    """`evaluate --device foo` / `--device cuda` without a GPU were raw torch
    RuntimeErrors; the same parser as train's now (usage error 2, or 1 for a missing GPU)."""
    src = write(tmp_path / "src", ["one"])
    ref = write(tmp_path / "ref", ["eins"])
    argv = ["--model", str(DEMO_DIR), "--src", str(src), "--ref", str(ref), "--device", device]
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == code and match in err and "Traceback" not in err, err


def test_evaluate_an_export_folder_without_torch(tmp_path, exported_demo):
    """The torch-free install evaluates an export folder (it failed with
    `No module named 'torch'`); a model folder there says what to install."""
    src = write(tmp_path / "src", ["forty-two", "seven"])
    ref = write(tmp_path / "ref", ["zweiundvierzig", "sieben"])
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "from transformer_ext.evaluate import main\n"
        "rc = main(sys.argv[1:])\n"
        "assert 'torch' not in sys.modules or sys.modules['torch'] is None\n"
        "sys.exit(rc)\n"
    )
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    run = lambda model: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code, "--model", str(model), "--src", str(src), "--ref", str(ref), "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    ok = run(exported_demo)
    assert ok.returncode == 0, ok.stderr
    report = json.loads(ok.stdout)
    assert report["runtime"] == "onnxruntime" and report["n"] == 2
    assert report["bleu"] == pytest.approx(
        score_texts(["zweiundvierzig", "sieben"], ["zweiundvierzig", "sieben"])["bleu"]
    )
    folder = run(DEMO_DIR)
    assert folder.returncode == 1 and "Traceback" not in folder.stderr
    assert "runs on PyTorch" in folder.stderr and "install transformer_ext with torch" in folder.stderr


@pytest.fixture(scope="module")
def exported_demo(tmp_path_factory) -> Path:
    from export.onnx import export_onnx

    out = tmp_path_factory.getbasetemp() / "shared_exports" / "demo_export"
    if not (out / "manifest.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        export_onnx(None, out, validate=False)
    return out
