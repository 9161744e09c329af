"""End to end on parallel text: train with SentencePiece, evaluate, average, export to ONNX and
translate text through ONNX Runtime (a few hundred pairs, a small vocabulary, a few dozen steps)."""

import json
import random

import pytest

pytest.importorskip("sentencepiece")
pytest.importorskip("sacrebleu")

from transformer_ext import average, evaluate
from transformer_ext import train as train_mod

NOUNS = {
    "man": "Mann",
    "woman": "Frau",
    "king": "König",
    "child": "Kind",
    "servant": "Knecht",
    "prophet": "Prophet",
}
VERBS = {"saw": "sah", "called": "rief", "blessed": "segnete", "heard": "hörte", "followed": "folgte"}
PLACES = {"city": "Stadt", "house": "Haus", "field": "Feld", "temple": "Tempel"}


def make_pairs(n, seed):
    rng = random.Random(seed)
    src, tgt = [], []
    for _ in range(n):
        a, b = rng.sample(sorted(NOUNS), 2)
        v = rng.choice(sorted(VERBS))
        p = rng.choice(sorted(PLACES))
        src.append(f"The {a} {v} the {b} in the {p}.")
        tgt.append(f"Der {NOUNS[a]} {VERBS[v]} den {NOUNS[b]} in der {PLACES[p]}.")
    return src, tgt


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    src, tgt = make_pairs(300, seed=0)
    vsrc, vtgt = make_pairs(20, seed=1)
    files = dict(
        train=(write(root / "train.en", src), write(root / "train.de", tgt)),
        valid=(write(root / "valid.en", vsrc), write(root / "valid.de", vtgt)),
        test=(write(root / "test.en", vsrc[:8]), write(root / "test.de", vtgt[:8])),
    )
    (root / "provenance.json").write_text(
        json.dumps({"corpus": "synthetic test sentences", "licence": "none"})
    )
    argv = [
        "--train",
        *files["train"],
        "--valid",
        *files["valid"],
        "--output-dir",
        str(root / "run"),
        "--vocab-size",
        "60",
        "--shared-vocab",
        "--preset",
        "tiny",
        "--max-len",
        "48",
        "--dropout",
        "0",
        "--lr-schedule",
        "inverse-sqrt",
        "--lr",
        "3e-3",
        "--warmup",
        "10",
        "--max-tokens",
        "600",
        "--max-steps",
        "30",
        "--eval-every",
        "10",
        "--keep-last",
        "2",
        "--no-progress",
        "--threads",
        "1",
        "--quiet",
    ]
    assert train_mod.main(argv) == 0
    return root, files


def test_run_folder(trained):
    root, _ = trained
    run = root / "run"
    best = run / "best"
    assert {"config.json", "model.safetensors", "tokenizer.json", "spm.model", "provenance.json"} <= {
        p.name for p in best.iterdir()
    }
    assert json.loads((best / "provenance.json").read_text())["corpus"] == "synthetic test sentences"
    config = json.loads((best / "config.json").read_text())
    assert config["shared_vocab"] and config["src_vocab_size"] == config["tgt_vocab_size"] == 60
    summary = json.loads((run / "summary.json").read_text())
    assert [h["step"] for h in summary["history"]] == [10, 20, 30]
    assert summary["history"][0]["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    assert summary["best_metric"] == "bleu" and summary["tokenizer"]["type"] == "sentencepiece"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-20", "step-30"]
    # the model has learnt something in 30 steps: validation loss went down
    assert summary["history"][-1]["loss"] < summary["history"][0]["loss"]


def test_evaluate_average_export_and_onnx_runtime(trained, tmp_path, capsys):
    from export.onnx import main as export_main
    from transformer_ext.translate import Translator

    root, files = trained
    src, ref = files["test"]
    assert average.main(["--last", "2", str(root / "run"), "--output-dir", str(tmp_path / "avg")]) == 0
    capsys.readouterr()
    reports = {}
    for name, model in (("best", root / "run" / "best"), ("avg", tmp_path / "avg")):
        assert (
            evaluate.main(
                [
                    "--model",
                    str(model),
                    "--src",
                    src,
                    "--ref",
                    ref,
                    "--json",
                    "--output",
                    str(tmp_path / f"{name}.hyp"),
                ]
            )
            == 0
        )
        reports[name] = json.loads(capsys.readouterr().out)
    assert reports["best"]["runtime"] == "eager" and 0 <= reports["best"]["bleu"] <= 100

    out = tmp_path / "onnx"
    assert (
        export_main(["--model", str(root / "run" / "best"), "--output-dir", str(out), "--examples", "0"]) == 0
    )
    capsys.readouterr()
    assert {"tokenizer.json", "spm.model"} <= {p.name for p in out.iterdir()}
    sources = open(src, encoding="utf-8").read().splitlines()
    eager = Translator.from_model_dir(root / "run" / "best").translate(sources)
    ort = Translator.from_export_dir(out).translate(sources)
    assert ort == eager  # text translated by ONNX Runtime, detokenized by SentencePiece
    assert evaluate.main(["--model", str(out), "--src", src, "--ref", ref, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["runtime"] == "onnxruntime"
    assert report["bleu"] == reports["best"]["bleu"] and report["chrf"] == reports["best"]["chrf"]
