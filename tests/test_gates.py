"""The quantized exports' quality gates on models that are not the demo model: a converted
transformers checkpoint (Marian, multilingual Marian, M2M100) must be given gate data, the BLEU gate
takes the languages of a multilingual model and names a gate source too long for the model, and a
gate fed with a deliberately broken quantization fails (exit 1, nothing written).

The checkpoints are written by transformers (tests/hf_checkpoints.py: small configs, random
weights) and converted; their exports skip the parity validation (tests/test_export_onnx.py).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")
pytest.importorskip("sacrebleu")

sys.path.insert(0, os.path.dirname(__file__))
from hf_checkpoints import sample_lines, write_m2m100, write_marian  # noqa: E402

from export import quantize as quant  # noqa: E402
from export.onnx import export_onnx  # noqa: E402
from export.onnx import main as export_main  # noqa: E402
from export.quantize import QualityGateError, quantize_export  # noqa: E402
from export.quantize import main as quantize_main  # noqa: E402
from transformer_ext.convert import convert_transformers  # noqa: E402
from transformer_ext.export_format import manifest_quantization, read_manifest  # noqa: E402

SMALL = dict(layers=1, d_model=16, heads=4, d_ff=16)
M2M_MAX_POS = 48
CASES = {  # name -> (checkpoint writer, --source-lang, --target-lang)
    "marian_multilingual": (
        lambda p: write_marian(p, **SMALL, languages=("fra", "spa"), seed=2),
        None,
        "spa",
    ),
    "m2m100": (lambda p: write_m2m100(p, **SMALL, max_positions=M2M_MAX_POS, seed=3), "fr", "es"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (converted model folder, its float32 export)."""
    root = tmp_path_factory.mktemp("gates")
    out = {}
    for name, (make, _, _) in CASES.items():
        ours = convert_transformers(make(root / f"{name}_hf"), root / f"{name}_model")
        export = export_onnx(ours, root / f"{name}_export", validate=False).output_dir
        out[name] = (Path(ours), Path(export))
    return out


def _files(tmp_path, name, lines):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _one_line_error(capsys, prog):
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{prog}: error: ") and "\n" not in err, err
    return err


# ------------------------------------------------------------------------------------------
# without gate data: the demo task's exact-match gate only gates a model of the demo task
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["marian_multilingual", "m2m100"])
def test_a_converted_model_must_be_given_gate_data(models, tmp_path, capsys, name):
    """Without --gate-src the demo number words would score 0% in both precisions, a gate that
    cannot fail: refused with one line naming the gate and what to give, before anything is
    exported, and nothing is written."""
    model, export = models[name]
    with pytest.raises(
        QualityGateError, match=r"quality gate needs gate data .*--gate-src FILE --gate-ref FILE"
    ):
        quantize_export(export, tmp_path / "q")
    assert not (tmp_path / "q").exists()
    code = export_main(["--model", str(model), "--output-dir", str(tmp_path / "e"), "--quantize", "int8"])
    err = _one_line_error(capsys, "python -m export.onnx")
    assert code == 1 and "quality gate needs gate data" in err and "--no-validate" in err
    assert sorted(os.listdir(tmp_path)) == []


def test_a_char_model_of_another_task_must_be_given_gate_data(tmp_path, exported_portable):
    """A character-tokenizer model whose vocabulary holds every character of the demo task but that
    was not trained on it (the tiny random-weight model, float32 exact match 0%): the gate could
    not fail, so it is refused, saying so; nothing written."""
    from helpers import DEMO_DIR, rehash_export

    from transformer_ext.tokenizer import CharTokenizer

    demo = json.loads((DEMO_DIR / "tokenizer.json").read_text())
    cfg = read_manifest(exported_portable)["model_config"]
    fill = list("0123456789#$%&*+/:;<=>@!?.jkmpqbc")

    def vocab(base, size):
        extra = [c for c in fill if c not in base]
        return base + extra[: size - len(base)]

    export = tmp_path / "f32"
    shutil.copytree(exported_portable, export)
    CharTokenizer(
        vocab(demo["source_vocab"], cfg["src_vocab_size"]),
        vocab(demo["target_vocab"], cfg["tgt_vocab_size"]),
        lowercase=True,
    ).save(export)
    generation = json.loads((export / "generation.json").read_text())
    (export / "generation.json").write_text(json.dumps({**generation, "max_new_tokens": 4}))
    rehash_export(export)
    with pytest.raises(QualityGateError, match=r"float32 graphs get 0.00% of the demo task's 500 held-out"):
        quantize_export(export, tmp_path / "q")
    assert sorted(os.listdir(tmp_path)) == ["f32"]


# ------------------------------------------------------------------------------------------
# the BLEU gate: languages, lengths, and a negative control
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["marian_multilingual", "m2m100"])
def test_the_bleu_gate_of_a_multilingual_model_takes_its_languages(models, tmp_path, capsys, name):
    """export.quantize --gate-src/--gate-ref --source-lang/--target-lang gates a multilingual model;
    the float32 BLEU it records is sacrebleu's on the translator's output in those languages.
    Without the languages: one line naming the flag (exit 2), nothing written."""
    import sacrebleu

    from transformer_ext.translate import Translator

    _, export = models[name]
    _, source_lang, target_lang = CASES[name]
    sources, references = sample_lines(6, seed=41), sample_lines(6, seed=42)
    src, ref = _files(tmp_path, "gate.src", sources), _files(tmp_path, "gate.ref", references)
    base = ["--model", str(export), "--gate-src", str(src), "--gate-ref", str(ref)]
    if name == "marian_multilingual":  # M2M100's tokenizer_config.json has default languages
        code = quantize_main([*base, "--output-dir", str(tmp_path / "none"), "--max-bleu-drop", "100"])
        err = _one_line_error(capsys, "python -m export.quantize")
        assert code == 2 and "BLEU gate (--gate-src" in err and "--target-lang" in err
        assert not (tmp_path / "none").exists()

    languages = ["--target-lang", target_lang] + (["--source-lang", source_lang] if source_lang else [])
    out = tmp_path / "q"
    code = quantize_main([*base, *languages, "--output-dir", str(out), "--max-bleu-drop", "100"])
    assert code == 0, capsys.readouterr().err
    gate = manifest_quantization(read_manifest(out))["gate"]
    hyps = Translator.from_export_dir(export, source_lang=source_lang, target_lang=target_lang).translate(
        sources, beam_size=1
    )
    assert gate["bleu_float32"] == pytest.approx(round(sacrebleu.corpus_bleu(hyps, [references]).score, 2))
    assert gate["examples"] == 6


def test_a_gate_source_longer_than_the_model_is_named(models, tmp_path, capsys):
    """M2M100 of 48 positions and a gate line of more tokens: the gate, the file, the line and
    the limit named, before anything is quantized; nothing written."""
    _, export = models["m2m100"]
    long_line = " ".join(["hello world translation model"] * 20)
    src = _files(tmp_path, "gate.src", ["hello world", long_line])
    ref = _files(tmp_path, "gate.ref", ["hola", "hola"])
    args = ["--model", str(export), "--gate-src", str(src), "--gate-ref", str(ref)]
    code = quantize_main(
        [*args, "--source-lang", "fr", "--target-lang", "es", "--output-dir", str(tmp_path / "q")]
    )
    err = _one_line_error(capsys, "python -m export.quantize")
    assert code == 1 and f"BLEU gate (--gate-src {src}), line 2" in err
    assert f"max_len = {M2M_MAX_POS}" in err and "shorten or split" in err
    assert sorted(os.listdir(tmp_path)) == ["gate.ref", "gate.src"]


def test_languages_without_gate_files_are_a_usage_error(models, tmp_path, capsys):
    _, export = models["m2m100"]
    code = quantize_main(["--model", str(export), "--output-dir", str(tmp_path / "q"), "--target-lang", "es"])
    err = _one_line_error(capsys, "python -m export.quantize")
    assert code == 2 and "--target-lang" in err and "need --gate-src and --gate-ref" in err
    assert not (tmp_path / "q").exists()


def _break_int8_weights(monkeypatch):
    """Quantize as usual, then negate every int8 weight of the written graph: a wrong quantization."""
    real = quant._quantize_one

    def broken(src, dst, settings, lookups=None):
        result = real(src, dst, settings, lookups)
        model = onnx.load(os.fspath(dst))
        for t in model.graph.initializer:
            if t.data_type == onnx.TensorProto.INT8:
                t.CopyFrom(onnx.numpy_helper.from_array(-onnx.numpy_helper.to_array(t), t.name))
        onnx.save(model, os.fspath(dst))
        return result

    monkeypatch.setattr(quant, "_quantize_one", broken)


def test_the_bleu_gate_fails_a_broken_quantization(models, tmp_path, capsys, monkeypatch):
    """Negative control on a converted model: references that float32 translates exactly (BLEU
    100), an int8 quantization with its weights negated: the gate fails, exit 1, nothing written;
    the same quantization unbroken passes."""
    from transformer_ext.translate import Translator

    _, export = models["marian_multilingual"]
    sources = sample_lines(12, seed=43)
    references = Translator.from_export_dir(export, target_lang="spa").translate(sources, beam_size=1)
    assert sum(bool(r.strip()) for r in references) >= 6  # a text for BLEU to measure
    src, ref = _files(tmp_path, "gate.src", sources), _files(tmp_path, "gate.ref", references)
    args = [
        *("--model", str(export), "--gate-src", str(src), "--gate-ref", str(ref)),
        "--target-lang",
        "spa",
    ]
    args.append("--no-few-rows-graph")
    _break_int8_weights(monkeypatch)
    code = quantize_main([*args, "--output-dir", str(tmp_path / "broken")])
    err = _one_line_error(capsys, "python -m export.quantize")
    assert code == 1 and "fail the BLEU gate" in err and "vs 100.00 for float32" in err
    broken = float(re.search(r"BLEU ([0-9.]+) vs 100.00", err).group(1))
    assert sorted(os.listdir(tmp_path)) == ["gate.ref", "gate.src"]
    monkeypatch.undo()
    assert quantize_main([*args, "--output-dir", str(tmp_path / "ok"), "--max-bleu-drop", "100"]) == 0
    gate = manifest_quantization(read_manifest(tmp_path / "ok"))["gate"]
    assert gate["bleu_float32"] == 100.0 and gate["bleu_int8"] > broken


# ------------------------------------------------------------------------------------------
# the parity validator: a bound that scales with the model, token flips and near ties
# ------------------------------------------------------------------------------------------

# Activations of order 10 over 128 positions: eager float32 itself is up to 1.5e-3 off float64,
# more than the 1e-4 tolerance, and so is any correct float32 export of it.
LARGE = dict(layers=2, d_model=32, heads=4, d_ff=64, std=1.0, gain=4.0, max_positions=128, seed=5)


@pytest.fixture(scope="module")
def large(tmp_path_factory):
    """(converted model folder, its validated export) of a Marian checkpoint with large activations."""
    root = tmp_path_factory.mktemp("large")
    ours = convert_transformers(write_marian(root / "hf", **LARGE), root / "model")
    return Path(ours), export_onnx(ours, root / "export", tolerance=1e-4)


def test_a_correct_export_with_large_activations_passes(large):
    """Each output is measured against float64 eager PyTorch and allowed 8x eager float32's own
    distance from it (never less than the tolerance): the export passes, with bounds above the
    tolerance where float32 rounding is, and its verdict says so."""
    from export import validate as validation
    from export.onnx import verdict_text

    report = large[1].validation
    assert report.tolerance == 1e-4 and report.widened
    assert max(report.float32_error.values()) > 1e-4  # eager float32 alone misses the tolerance
    for key, diff in report.max_abs_diff.items():
        f32 = report.float32_error[key]
        assert diff <= report.allowed[key] == pytest.approx(max(1e-4, validation.FLOAT32_ERROR_FACTOR * f32))
    assert report.greedy["tokens_identical"] and report.beam["tokens_identical"]
    assert "8x eager float32's own rounding error against float64" in verdict_text(large[1]).splitlines()[0]


@pytest.mark.parametrize("where", ["encoder", "decoder"])
def test_a_wrong_graph_of_that_model_still_fails(large, where):
    """Negative controls at that scale: the export against the model with one LayerNorm gain
    1% off (in the encoder, in the decoder) is refused, naming an output of that graph."""
    import torch

    from export import ParityError
    from export import validate as validation
    from transformer_ext.checkpoint import load_model

    model = load_model(large[0])
    layers = model.encoder.layers if where == "encoder" else model.decoder.layers
    with torch.no_grad():
        layers[-1].sublayer[-1].norm.weight.mul_(1.01)
    with pytest.raises(ParityError) as info:
        validation.validate_export(large[1].output_dir, model, tolerance=1e-4)
    assert info.value.output.startswith("encoder/" if where == "encoder" else "decoder_step/")
    assert info.value.max_diff > info.value.tolerance


class _Recorded:
    def __init__(self, logits, fed):
        self.logits, self.fed = logits, fed


def _hyp(tokens, log_probs):
    from types import SimpleNamespace

    return SimpleNamespace(tokens=tokens, token_log_probs=log_probs, score=sum(log_probs))


def _greedy_pair(onnx_second_log_prob):
    """Eager and ONNX Runtime greedy decodes of one source fed alike for two steps, parting at the
    third token: eager 7 (log-prob -0.5), ONNX Runtime 8 (``onnx_second_log_prob``)."""
    logits = [np.zeros((1, 10), np.float32) for _ in range(3)]
    fed = [(np.array([1]), None), (np.array([5]), None), (np.array([6]), None)]
    eager = _Recorded(logits, fed)
    onnx_rec = _Recorded([x + 1e-5 for x in logits], fed)
    eager_out = [_hyp([5, 6, 7], [-0.1, -0.2, -0.5, -0.1])]
    onnx_out = [_hyp([5, 6, 8], [-0.1, -0.2, onnx_second_log_prob, -0.1])]
    return eager, onnx_rec, eager_out, onnx_out


def test_tokens_that_part_at_a_near_tie_are_not_a_failure():
    """Logits within the tolerance and the chosen tokens' log-probabilities 3e-5 apart (within
    twice the tolerance): recorded as a near tie naming the source, position and tokens."""
    from export import validate as validation

    report = validation.ValidationReport(tolerance=1e-4)
    eager, onnx_rec, eager_out, onnx_out = _greedy_pair(-0.50003)
    result = validation._compare_decodes(report, "greedy", eager, onnx_rec, eager_out, onnx_out, "case")
    assert result["tokens_identical"] is False and result["steps"] == 3
    tie = result["near_tie"]
    assert (tie["source"], tie["step"], tie["eager"], tie["onnxruntime"]) == (0, 2, 7, 8)
    assert tie["margin"] == pytest.approx(3e-5) and tie["bound"] == pytest.approx(2e-4)
    report.greedy = dict(result, batch=1, tokens_generated=3)
    assert "near tie" in report.table() and "greedy tokens part at a near tie" in report.parity_text()


def test_a_token_flip_beyond_a_near_tie_is_reported_as_one():
    """The same decodes with ONNX Runtime's token 0.3 below eager's: a token flip, reported as
    one (position, both tokens, the margin), not as a logit difference."""
    from export import ParityError
    from export import validate as validation

    report = validation.ValidationReport(tolerance=1e-4)
    eager, onnx_rec, eager_out, onnx_out = _greedy_pair(-0.8)
    with pytest.raises(ParityError) as info:
        validation._compare_decodes(report, "greedy", eager, onnx_rec, eager_out, onnx_out, "case")
    err = info.value
    assert isinstance(err, validation.TokenFlipError)
    assert (err.output, err.step) == ("greedy decode tokens", 2) and err.max_diff == pytest.approx(0.3)
    text = str(err)
    assert "token flip at generated position 2" in text and "eager token 7, onnxruntime token 8" in text
    assert "differs from eager PyTorch" not in text
    assert pickle.loads(pickle.dumps(err)).args == err.args


@pytest.mark.parametrize("onnx_score, tie", [(-1.0003, True), (-1.5, False)])
def test_beam_hypotheses_that_part_are_judged_by_their_scores(onnx_score, tie):
    """Beam: the first hypothesis that differs is compared by score; 3e-4 apart over 3 tokens and
    EOS is within twice the tolerance per token (a near tie), 0.5 apart is a token flip."""
    from types import SimpleNamespace

    from export import validate as validation

    report = validation.ValidationReport(tolerance=1e-4)
    logits = [np.zeros((2, 10), np.float32) for _ in range(2)]
    fed = [(np.array([1, 1]), None), (np.array([5, 4]), np.array([0, 0]))]
    same = SimpleNamespace(tokens=[5, 6], score=-0.7)
    eager_hyps = [[SimpleNamespace(tokens=[5, 6, 7], score=-1.0), same]]
    onnx_hyps = [[SimpleNamespace(tokens=[5, 6, 9], score=onnx_score), same]]
    args = (report, "beam", _Recorded(logits, fed), _Recorded(logits, fed), eager_hyps, onnx_hyps, "case")
    if tie:
        near = validation._compare_decodes(*args)["near_tie"]
        assert (near["rank"], near["step"], near["eager"], near["onnxruntime"]) == (0, 2, 7, 9)
        assert near["bound"] == pytest.approx(2e-4 * 4)
    else:
        with pytest.raises(validation.TokenFlipError, match="source 0 hypothesis 0 at generated position 2"):
            validation._compare_decodes(*args)
