"""export.quantize / ``python -m export.onnx --quantize int8``: a complete int8 export folder, its
manifest section, the quality gate, the runtimes that accept it, the ones that refuse it, bad input,
an output inside the export it reads, a SIGKILL mid-way (the block-wise schemes int4 and int8-nbits:
tests/test_quantize_nbits.py).

The mechanics run on the tiny random-weight model (whose tokenizer cannot encode the demo task,
so its gate cannot run: ``validate=False``); the quality gate runs once on the bundled demo model
(about 40 s: the float32 export, its validation, the quantization, greedy decodes of the 500
held-out examples by the float32 step, the dynamic int8 step and the few-row step).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import DEMO_DIR, exported_dir, make_model_dir, quantized_dir

from export import quantize as quant
from export.onnx import export_onnx, main
from export.quantize import QualityGateError, QuantizationError, quantize_export
from transformer_ext.export_format import (
    DECODER_FILE,
    ENCODER_FILE,
    FEW_ROWS_DECODER_FILE,
    MANIFEST_NAME,
    WEIGHTS_FILE,
    ManifestError,
    manifest_quantization,
    read_manifest,
)
from transformer_ext.fsutil import parse_temporary_name

FLOAT32_FILES = {ENCODER_FILE, DECODER_FILE, MANIFEST_NAME, "generation.json", "tokenizer.json", WEIGHTS_FILE}


@pytest.fixture(scope="module")
def tiny_float(tmp_path_factory) -> Path:
    return exported_dir(tmp_path_factory, "portable")


@pytest.fixture(scope="module")
def tiny_int8(tmp_path_factory) -> Path:
    return quantized_dir(tmp_path_factory, "int8")


@pytest.fixture(scope="module")
def demo_int8(tmp_path_factory) -> Path:
    if not (DEMO_DIR / "model.safetensors").is_file():
        pytest.skip("the bundled demo model is not in this checkout")
    out = tmp_path_factory.mktemp("demo") / "int8"
    export_onnx(DEMO_DIR, out, quantize="int8")
    return out


def _initializers(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in model.graph.initializer}


# ------------------------------------------------------------------------------------------
# the folder and its graphs
# ------------------------------------------------------------------------------------------


def test_folder_is_complete_with_the_float32_file_names(tiny_float, tiny_int8):
    assert set(os.listdir(tiny_float)) == FLOAT32_FILES
    assert set(os.listdir(tiny_int8)) == FLOAT32_FILES | {FEW_ROWS_DECODER_FILE}
    manifest = read_manifest(tiny_int8)
    assert sorted(manifest["files"]) == sorted(os.listdir(tiny_int8))
    assert manifest["graphs"] == read_manifest(tiny_float)["graphs"]  # same inputs and outputs
    q = manifest_quantization(manifest)
    assert q["scheme"] == "int8" and q["per_channel"] is True and q["reduce_range"] is True
    assert q["weight_type"] == "int8" and q["op_types"] == ["MatMul", "Gemm"] and q["gate"] is None
    assert manifest_quantization(read_manifest(tiny_float)) is None


@pytest.mark.parametrize("graph", [ENCODER_FILE, DECODER_FILE])
def test_every_weight_product_is_int8_per_output_channel(tiny_float, tiny_int8, graph):
    before, after = onnx.load(tiny_float / graph), onnx.load(tiny_int8 / graph)
    init_before, init_after = _initializers(before), _initializers(after)
    weights = [n for n in before.graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in init_before]
    assert weights, "the float32 graph has weight products"
    # no float32 weight product is left ...
    assert not [
        n.name for n in after.graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in init_after
    ]
    products = [n for n in after.graph.node if n.op_type == "MatMulInteger"]
    # with int8 embedding tables, the tied output projection reads the lookup's rows (QGemm)
    lookups = read_manifest(tiny_int8)["quantization"]["lookups"]
    assert lookups["per_row"] is True and lookups["bits"] == 8
    tied = [n for n in after.graph.node if n.op_type == "QGemm"]
    assert not [n for n in after.graph.node if n.op_type in ("MatMulNBits", "GatherBlockQuantized")]
    assert len(tied) == (1 if lookups and graph == DECODER_FILE else 0)
    assert len(products) + len(tied) == len(weights)
    for n in products:
        w, w_zero = init_after[n.input[1]], init_after[n.input[3]]
        assert w.data_type == onnx.TensorProto.INT8
        values = onnx.numpy_helper.to_array(w)
        assert np.abs(values.astype(np.int32)).max() <= 64  # reduce_range: 7-bit weights
        assert list(w_zero.dims) == [w.dims[1]]  # one zero point (and scale) per output channel
    if (
        graph == DECODER_FILE and not lookups
    ):  # ... the output projection included: a [d_model, vocab] int8 weight
        cfg = read_manifest(tiny_int8)["model_config"]
        shapes = {tuple(init_after[n.input[1]].dims) for n in products}
        assert (cfg["d_model"], cfg["tgt_vocab_size"]) in shapes
    elif (
        graph == DECODER_FILE
    ):  # ... the output projection: int8 [vocab, d_model] rows, transB, one scale per vocab entry
        cfg = read_manifest(tiny_int8)["model_config"]
        (projection,) = tied
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in projection.attribute}
        assert attrs["transB"] == 1 and projection.domain == "com.microsoft"
        rows, scales, zeros = (init_after[name] for name in projection.input[3:6])
        assert rows.data_type == onnx.TensorProto.INT8
        assert list(rows.dims) == [cfg["tgt_vocab_size"], cfg["d_model"]]
        assert np.abs(onnx.numpy_helper.to_array(rows).astype(np.int32)).max() <= 64  # reduce_range
        assert list(scales.dims) == list(zeros.dims) == [cfg["tgt_vocab_size"]]
        assert not onnx.numpy_helper.to_array(zeros).any()  # symmetric


def test_int8_decodes_close_to_float32(tiny_float, tiny_int8):
    """OrtRunner loads the folder unchanged; its first-step logits stay near the float32 ones
    (quantization error, not garbage: the tolerance is a few percent of the logits' spread)."""
    from transformer_ext.runtimes import OrtRunner

    f32, i8 = OrtRunner(tiny_float, intra_op_num_threads=1), OrtRunner(tiny_int8, intra_op_num_threads=1)
    rng = np.random.default_rng(0)
    ids = rng.integers(4, f32.info.src_vocab_size, size=(3, 7))
    lengths = np.array([7, 5, 2])
    tokens = np.full(3, f32.info.bos_id)
    a = f32.step(f32.encode(ids, lengths, cache_len=8, beam_size=1), tokens)
    b = i8.step(i8.encode(ids, lengths, cache_len=8, beam_size=1), tokens)
    a, b = np.asarray(a), np.asarray(b)
    assert not np.array_equal(a, b)  # really different graphs
    assert np.abs(a - b).max() <= 0.05 * (a.max() - a.min())


# ------------------------------------------------------------------------------------------
# the quality gate on the demo model
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("few_rows", ["never", "always"])
def test_demo_gate_passes_and_matches_an_independent_count(demo_int8, few_rows):
    """The gate's recorded exact match equals a count made here from texts: the int8 folder
    translated by Translator.from_export_dir, compared with data.target_text; for the dynamic
    int8 step and for the few-row step (every step through it)."""
    from transformer_ext import data
    from transformer_ext.runtimes import OrtRunner
    from transformer_ext.translate import Translator

    q = manifest_quantization(read_manifest(demo_int8))
    gate = q["few_rows"]["gate"] if few_rows == "always" else q["gate"]
    assert gate.get("graph") == (FEW_ROWS_DECODER_FILE if few_rows == "always" else None)
    numbers = data.split_numbers().heldout
    assert gate["examples"] == len(numbers)
    assert gate["drop_points"] <= 0.2 and gate["exact_match_float32"] - gate["exact_match_int8"] <= 0.2
    translator = Translator.from_export_dir(demo_int8)
    translator.runner = OrtRunner(demo_int8, few_rows=few_rows)
    outputs = translator.translate([data.source_text(n) for n in numbers], beam_size=1)
    hits = sum(out == data.target_text(n) for out, n in zip(outputs, numbers))
    assert 100.0 * hits / len(numbers) == pytest.approx(gate["exact_match_int8"], abs=1e-3)
    assert gate["exact_match_int8"] >= 95.0  # the demo model is that good in float32 (99.8%)


def test_failing_gate_says_by_how_much_and_writes_nothing(tiny_float, tmp_path, monkeypatch):
    """int8 decodes that lose 10% of the exact matches: refused, the drop named, nothing written."""
    shutil.copytree(tiny_float, tmp_path / "float")
    refs = [[5, 6, 7]] * 10
    monkeypatch.setattr(quant, "_heldout_batch", lambda folder: (np.full((10, 2), 5), np.full(10, 2), refs))
    monkeypatch.setattr(
        quant,
        "_greedy_all",
        lambda folder, ids, lengths, few_rows="never", search=None: [
            [5, 6, 7] if quant.manifest_quantization(read_manifest(folder)) is None or i else [5, 6]
            for i in range(10)
        ],
    )
    good = tmp_path / "kept"
    quantize_export(tmp_path / "float", good, gate=False)
    before = {p: (good / p).read_bytes() for p in os.listdir(good)}
    for out in (tmp_path / "new", good):
        with pytest.raises(QualityGateError, match=r"exact match 90.00% vs 100.00%.*10.00 points lower"):
            quantize_export(tmp_path / "float", out)
    assert not (tmp_path / "new").exists()
    assert {p: (good / p).read_bytes() for p in os.listdir(good)} == before
    assert sorted(os.listdir(tmp_path)) == ["float", "kept"]  # no temporary left


def test_gate_needs_the_demo_task(tiny_float, tmp_path):
    """The tiny model's tokenizer cannot encode the demo task: the gate says so, nothing written."""
    with pytest.raises(QualityGateError, match="--no-validate"):
        quantize_export(tiny_float, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------
# runtimes that accept and refuse it
# ------------------------------------------------------------------------------------------


def test_tensorrt_refuses_int8(tiny_int8, tiny_float):
    from export import ExportError
    from export.tensorrt import plan_build
    from export.trt_readiness import TensorRTReadinessError, check_export_dir, check_model

    with pytest.raises(TensorRTReadinessError, match="for ONNX Runtime") as info:
        check_export_dir(tiny_int8)
    kinds = {(p.graph, p.kind) for p in info.value.report.problems}
    assert {(MANIFEST_NAME, "int8"), (ENCODER_FILE, "int8"), (DECODER_FILE, "int8")} <= kinds
    # the graph alone (without the manifest) is refused too
    assert any(p.kind == "int8" for p in check_model(tiny_int8 / DECODER_FILE).problems)
    assert not any(p.kind == "int8" for p in check_model(tiny_float / DECODER_FILE).problems)
    with pytest.raises(ExportError, match="int8 exports are for ONNX Runtime"):
        plan_build(tiny_int8)


def test_triton_onnxruntime_repository_of_an_int8_export(tiny_int8, tmp_path):
    pytest.importorskip("tritonclient.grpc.model_config_pb2")
    from export.triton import export_triton, validate_repository

    result = export_triton(tiny_int8, tmp_path / "repo", backend="onnxruntime", instance_kind="cpu")
    assert validate_repository(result.repo_dir, require_protobuf=True) is True
    copied = [p for p in Path(result.repo_dir).rglob("*.onnx")]
    assert any(any(n.op_type == "MatMulInteger" for n in onnx.load(p).graph.node) for p in copied)


# ------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------


def test_already_quantized_folder_is_refused(tiny_int8, tmp_path):
    with pytest.raises(QuantizationError, match="already quantized"):
        quantize_export(tiny_int8, tmp_path / "twice", gate=False)
    assert not (tmp_path / "twice").exists()


@pytest.mark.parametrize("scheme", ["int3", "INT8", "int4-nbits", "", None])
def test_unknown_scheme_before_the_disk(tiny_float, tmp_path, scheme):
    with pytest.raises(QuantizationError, match="unknown quantization scheme"):
        quantize_export(tiny_float, tmp_path / "out", scheme, gate=False)
    assert not (tmp_path / "out").exists()


def test_bad_max_drop_and_same_folder(tiny_float, tmp_path):
    with pytest.raises(ValueError, match="max_em_drop"):
        quantize_export(tiny_float, tmp_path / "out", max_em_drop=-1)
    with pytest.raises(QuantizationError, match="must differ"):
        quantize_export(tiny_float, tiny_float, gate=False)
    assert not (tmp_path / "out").exists()


def test_unknown_scheme_in_a_manifest_is_refused_by_readers(tiny_int8, tmp_path):
    copy = tmp_path / "edited"
    shutil.copytree(tiny_int8, copy)
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    manifest["quantization"]["scheme"] = "int3"
    (copy / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="quantization"):
        read_manifest(copy)


def test_cli_unknown_scheme_is_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["--quantize", "int3", "--output-dir", str(out)]) == 2  # a usage error
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "int3" in err[0] and "int8" in err[0] and "int4" in err[0]
    assert not out.exists()


def test_quantize_cli(tiny_float, tiny_int8, tmp_path, capsys):
    assert quant.main(["--model", str(tiny_int8), "--output-dir", str(tmp_path / "o"), "--no-validate"]) == 1
    assert "already quantized" in capsys.readouterr().err
    assert quant.main(["--model", str(tiny_float), "--output-dir", str(tmp_path / "o"), "--no-validate"]) == 0
    assert "MatMulInteger" in capsys.readouterr().out
    assert manifest_quantization(read_manifest(tmp_path / "o"))["scheme"] == "int8"


# ------------------------------------------------------------------------------------------
# the BLEU gate (--gate-src / --gate-ref)
# ------------------------------------------------------------------------------------------


def _parallel(tmp_path, sources, references):
    src, ref = tmp_path / "gate.src", tmp_path / "gate.ref"
    src.write_text("".join(s + "\n" for s in sources), encoding="utf-8")
    ref.write_text("".join(r + "\n" for r in references), encoding="utf-8")
    return src, ref


GATE_SOURCES = ["a cab", "dead beef", "face bad", "bead", "add a fee"]


def test_bleu_gate_records_the_scores_of_an_independent_scoring(tiny_float, tmp_path):
    """The recorded BLEU of both folders equals sacrebleu run here on the translator's outputs."""
    import sacrebleu

    from transformer_ext.translate import Translator

    src, ref = _parallel(tmp_path, GATE_SOURCES, ["ab cd", "ef", "a b c", "dd", "e a"])
    out = tmp_path / "int8"
    quantize_export(tiny_float, out, gate_data=quant.GateData(src, ref), max_bleu_drop=100.0)
    gate = manifest_quantization(read_manifest(out))["gate"]
    refs = [["ab cd", "ef", "a b c", "dd", "e a"]]
    for name, folder in (("float32", tiny_float), ("int8", out)):
        hyps = Translator.from_export_dir(folder).translate(GATE_SOURCES, beam_size=1)
        assert gate[f"bleu_{name}"] == pytest.approx(round(sacrebleu.corpus_bleu(hyps, refs).score, 2))
    assert gate["examples"] == 5 and gate["max_drop_points"] == 100.0
    assert gate["bleu_signature"].startswith("nrefs:1|")


def test_failing_bleu_gate_says_by_how_much_and_writes_nothing(tiny_float, tmp_path, monkeypatch):
    import transformer_ext.evaluate as evaluate

    src, ref = _parallel(tmp_path, GATE_SOURCES, GATE_SOURCES)
    scores = iter([30.0, 29.2])  # float32 first, then int8
    monkeypatch.setattr(evaluate, "score_texts", lambda h, r: {"bleu": next(scores), "bleu_signature": "sig"})
    out = tmp_path / "out"
    with pytest.raises(
        QualityGateError, match=r"BLEU 29.20 vs 30.00 .*0.80 points lower \(at most 0.5 allowed\)"
    ):
        quantize_export(tiny_float, out, gate_data=quant.GateData(src, ref))
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gate.ref", "gate.src"]  # no temporary left


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("counts", "has 2 lines but --gate-ref"),
        ("missing", "no such file"),
        ("blank", "line 2 is empty"),
        ("empty", "has no lines"),
    ],
)
def test_bad_gate_files_are_refused_naming_the_flag(tmp_path, case, fragment):
    sources = {"counts": ["a", "b"], "missing": ["a"], "blank": ["a", " ", "c"], "empty": []}[case]
    refs = {"counts": ["a", "b", "c"], "missing": ["a"], "blank": ["a", "b", "c"], "empty": []}[case]
    src, ref = _parallel(tmp_path, sources, refs)
    if case == "missing":
        ref = tmp_path / "nope.ref"
    with pytest.raises(QuantizationError, match=fragment):
        quant.GateData(src, ref)


def test_cli_gate_flags_checked_before_anything_is_written(tiny_float, tmp_path, capsys):
    src, ref = _parallel(tmp_path, ["a", "b"], ["a"])
    out = tmp_path / "out"
    # options that need another option: a usage error (exit 2)
    assert main(["--output-dir", str(out), "--gate-src", str(src), "--gate-ref", str(ref)]) == 2
    assert "need --quantize int8" in capsys.readouterr().err
    assert (
        main(["--output-dir", str(out), "--quantize", "int8", "--gate-src", str(src), "--gate-ref", str(ref)])
        == 1
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has 2 lines but --gate-ref" in err[0]
    assert quant.main(["--model", str(tiny_float), "--output-dir", str(out), "--gate-src", str(src)]) == 2
    assert "--gate-src and --gate-ref go together" in capsys.readouterr().err
    assert main(["--output-dir", str(out), "--quantize", "int8", "--max-bleu-drop", "-1"]) == 2
    assert "max_bleu_drop must be a finite number >= 0" in capsys.readouterr().err
    assert not out.exists()


# ------------------------------------------------------------------------------------------
# outputs that overlap the input; SIGKILL leftovers
# ------------------------------------------------------------------------------------------


def test_output_inside_the_export_folder_is_refused(tiny_float, tmp_path, capsys):
    """``--output-dir E/int8`` inside ``--model E`` (and a folder holding E): refused naming
    both, before anything is written."""
    export = tmp_path / "E"
    shutil.copytree(tiny_float, export)
    before = sorted(os.listdir(export))
    with pytest.raises(ValueError, match=r"--output-dir .*E/int8 lies inside the export folder --model"):
        quantize_export(export, export / "int8", gate=False)
    argv = ["--model", str(export), "--output-dir", str(export / "int8"), "--no-validate"]
    assert quant.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and "lies inside the export folder --model" in err[0] and "Is a directory" not in err[0]
    )
    with pytest.raises(ValueError, match="contains the export folder --model"):
        quantize_export(export, tmp_path, gate=False)
    assert sorted(os.listdir(export)) == before and sorted(os.listdir(tmp_path)) == ["E"]


# The real main() of a module in a subprocess; it prints READY and waits on stdin once the
# quantized graphs are written into the quantizer's scratch folder (the export's tracing is a
# copy of the session's graphs, as in tests/test_export_safety.py).
KILL_CHILD = r"""
import importlib, os, sys
module, src = sys.argv[1], sys.argv[2]
from export import onnx as export_mod, quantize as quant
real = quant.quantize_graphs

def fast_export_graph(module_, args, spec, n_positional, opset, flavour, path, **kwargs):
    import onnx
    proto = onnx.load(os.path.join(src, path.name))
    onnx.save(proto, path)
    return proto

def stop_here(*args, **kwargs):
    result = real(*args, **kwargs)
    print("READY", flush=True)
    sys.stdin.readline()
    return result

export_mod._export_graph = fast_export_graph
quant.quantize_graphs = stop_here
sys.exit(importlib.import_module(module).main(sys.argv[3:]))
"""


@pytest.mark.parametrize("command", ["export.onnx", "export.quantize"])
def test_sigkill_mid_quantize_leaves_temporaries_the_next_export_removes(
    tiny_float, tmp_path, command, caplog
):
    root = Path(__file__).resolve().parents[1]
    model_dir = make_model_dir(tmp_path / "model")
    out = tmp_path / "out"
    if command == "export.onnx":
        argv = [
            "--model",
            str(model_dir),
            "--output-dir",
            str(out),
            "--quantize",
            "int8",
            "--no-validate",
        ]
    else:
        argv = [
            "--model",
            str(tiny_float),
            "--output-dir",
            str(out),
            "--scheme",
            "int4",
            "--no-validate",
        ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_CHILD, command, str(tiny_float), *argv],
        cwd=root,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if line.strip() != "READY":
        proc.kill()
        pytest.fail(f"the child stopped before quantizing: {line!r}\n{proc.communicate()[1]}")
    proc.kill()  # SIGKILL: nothing of the child's cleanup runs
    proc.communicate(timeout=60)
    left = sorted(n for n in os.listdir(tmp_path) if n not in ("model",))
    assert len(left) == 2 and not out.exists(), left  # the staged export and the quantizer's scratch
    scratch = [n for n in left if n.startswith("..out.tmp-") and ".quantize.tmp-" in n]
    assert len(scratch) == 1 and f"-{proc.pid}-" in scratch[0]
    assert parse_temporary_name(scratch[0]).root == "out"  # traced to the output by fsutil's one rule
    with caplog.at_level(logging.WARNING, logger="transformer_ext.fsutil"):
        quantize_export(tiny_float, out, "int8", gate=False)  # the next export of the same output
    assert sorted(os.listdir(tmp_path)) == ["model", "out"]
    removed = " ".join(r.getMessage() for r in caplog.records)
    assert all(name in removed for name in left)


def test_an_int8_folder_of_the_block_wise_table_layout_still_loads(tiny_float, tiny_int8, tmp_path):
    """int8 folders written before the per-row tables hold a decoder step whose lookups are
    8-bit ``GatherBlockQuantized`` blocks of 32 and whose tied output projection is an 8-bit
    ``MatMulNBits`` over the same bytes: such a step (made here from the float32 one with those
    functions) loads in the folder and decodes near float32."""
    from helpers import rehash_export
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from transformer_ext.runtimes import OrtRunner

    old = tmp_path / "old_int8"
    shutil.copytree(tiny_int8, old)
    model = onnx.load(tiny_float / DECODER_FILE)
    tied = set(quant._tied_products(model).values())
    blocks = {"bits": 8, "block_size": 32, "symmetric": False, "accuracy_level": 4}
    assert quant._nbits_products(model, blocks, DECODER_FILE, only=tied)
    assert quant.quantize_lookups(model, 8, 32, False)
    onnx.save(model, tmp_path / "blocks.onnx")
    quantize_dynamic(
        str(tmp_path / "blocks.onnx"),
        str(old / DECODER_FILE),
        op_types_to_quantize=["MatMul", "Gemm"],
        per_channel=True,
        reduce_range=True,
        weight_type=QuantType.QInt8,
    )
    ops = {n.op_type for n in onnx.load(old / DECODER_FILE).graph.node}
    assert {"GatherBlockQuantized", "MatMulNBits", "MatMulInteger"} <= ops and "QGemm" not in ops
    manifest = json.loads((old / MANIFEST_NAME).read_text())
    manifest["quantization"]["lookups"] = {"method": "GatherBlockQuantized", "bits": 8, "block_size": 32}
    (old / MANIFEST_NAME).write_text(json.dumps(manifest))
    rehash_export(old)

    f32, i8 = OrtRunner(tiny_float, intra_op_num_threads=1), OrtRunner(old, intra_op_num_threads=1)
    rng = np.random.default_rng(1)
    ids = rng.integers(4, f32.info.src_vocab_size, size=(2, 6))
    lengths = np.array([6, 4])
    tokens = np.full(2, f32.info.bos_id)
    a = np.asarray(f32.step(f32.encode(ids, lengths, cache_len=8, beam_size=1), tokens))
    b = np.asarray(i8.step(i8.encode(ids, lengths, cache_len=8, beam_size=1), tokens))
    assert np.abs(a - b).max() <= 0.05 * (a.max() - a.min())
    assert len(i8.greedy(ids, lengths, max_decoding_length=4)) == 2
