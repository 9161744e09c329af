"""The ``custom-op`` export flavour: each decoder self- and cross-attention one
``transformer_ext.DecodeAttention`` node of the operator library of csrc/ort/, which the export
copies into its folder and ``OrtRunner`` registers.

The flavour's parity with eager PyTorch (every output on ragged shapes against float64, whole
greedy and beam decodes) is the export's own validation, which every export here runs; a
negative control shows that the validation reads the operator's output. The other oracles are the
portable export of the same weights (standard-op attention, the same runner) and, for int8, the
portable int8 export (the same int8 products). The tests that need the library skip, saying why,
where it cannot be built (no ONNX Runtime headers): the fixture of tests/test_ort_custom_op.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import TOLERANCE, exported_dir, make_model_dir
from test_ort_custom_op import library  # noqa: F401  (the fixture: built, or the test skips)

from export import ExportError, ParityError, contract
from export.onnx import CUSTOM_OPS_LIBRARY_ENV, export_onnx, main
from export.quantize import quantize_export
from transformer_ext.export_format import (
    CUSTOM_OPS_LIBRARY,
    DECODER_FILE,
    MANIFEST_NAME,
    ManifestError,
    file_sha256,
)
from transformer_ext.runtimes import OrtRunner

FLAVOUR = "custom-op"


@pytest.fixture(scope="module")
def op_dir(tmp_path_factory, library) -> Path:  # noqa: F811
    return exported_dir(tmp_path_factory, FLAVOUR)


@pytest.fixture(scope="module")
def portable_dir(tmp_path_factory) -> Path:
    return exported_dir(tmp_path_factory, "portable")


def _sources(runner, batch: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    S = 7
    ids = rng.integers(4, runner.info.src_vocab_size, size=(batch, S))
    lengths = np.array([S, 4, 1, 6, 2, 5][:batch])
    for b, n in enumerate(lengths):
        ids[b, n:] = runner.info.pad_id
    return ids, lengths


def _tokens(rows):
    return [[h.tokens for h in row] for row in rows]


def test_every_decoder_attention_is_one_custom_node(op_dir):
    decoder = onnx.load(op_dir / DECODER_FILE)
    manifest = json.loads((op_dir / MANIFEST_NAME).read_text())
    n = manifest["model_config"]["n_decoder_layers"]
    nodes = [node for node in decoder.graph.node if contract.is_custom_attention(node)]
    assert len(nodes) == 2 * n  # self- and cross-attention of every layer
    for node in nodes:  # the query scale is folded into the query projections
        assert {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute} == {"scale": 1.0}
    # the caches and the cross K/V are read by one of those nodes (and Shape) only: no standard-op
    # attention is left
    for name in [i.name for i in decoder.graph.input if i.name.startswith(("self_", "cross_"))]:
        readers = [node for node in decoder.graph.node if name in node.input and node.op_type != "Shape"]
        assert len(readers) == 1 and contract.is_custom_attention(readers[0]), name
    assert {"MatMul"} & {node.op_type for node in decoder.graph.node}  # projections only
    assert not any(node.op_type == "Softmax" for node in decoder.graph.node)
    # the library travels with the folder, its hash recorded
    assert manifest["flavour"] == FLAVOUR and CUSTOM_OPS_LIBRARY in manifest["files"]
    assert manifest["custom_ops"]["sha256"] == file_sha256(op_dir / CUSTOM_OPS_LIBRARY)
    assert manifest["validation"]["beam"]["tokens_identical"]
    assert contract.contract_problems(decoder, flavour=FLAVOUR) == []
    # without the flavour named (TensorRT's readiness check) the custom domain is a problem
    assert "custom_domain" in {p.kind for p in contract.contract_problems(decoder)}


def test_steps_match_the_portable_export(op_dir, portable_dir):
    """Step by step on a ragged batch with beams sharing a source's cross K/V: the logits and the
    appended caches equal the portable export's, through a reorder and a select."""
    a_runner = OrtRunner(op_dir, intra_op_num_threads=1)
    b_runner = OrtRunner(portable_dir, intra_op_num_threads=1)
    ids, lengths = _sources(a_runner, batch=3)
    a = a_runner.encode(ids, lengths, cache_len=10, beam_size=2)
    b = b_runner.encode(ids, lengths, cache_len=10, beam_size=2)
    rng = np.random.default_rng(1)
    for p in range(6):
        N = a.num_rows
        tokens = rng.integers(4, a_runner.info.tgt_vocab_size, size=N)
        np.testing.assert_allclose(a_runner.step(a, tokens), b_runner.step(b, tokens), rtol=0, atol=1e-5)
        for i in range(a_runner.info.n_layers):
            np.testing.assert_allclose(a.self_keys[i], b.self_keys[i], rtol=0, atol=1e-5)
        if p == 2:
            index = rng.integers(0, N, size=N)
            a_runner.reorder(a, index)
            b_runner.reorder(b, index)
        if p == 4:  # the middle source leaves: its two beams
            keep = np.array([0, 1, 4, 5])
            a_runner.select(a, keep)
            b_runner.select(b, keep)


@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("remove_finished", [True, False])
def test_whole_decodes_equal_the_portable_export(op_dir, portable_dir, beam, remove_finished):
    a = OrtRunner(op_dir, intra_op_num_threads=1)
    b = OrtRunner(portable_dir, intra_op_num_threads=1)
    ids, lengths = _sources(a, batch=5, seed=2)
    kw = dict(max_decoding_length=12, remove_finished=remove_finished)
    if beam == 1:
        assert a.greedy(ids, lengths, **kw) == b.greedy(ids, lengths, **kw)
    else:
        got = _tokens(a.beam_search(ids, lengths, beam_size=beam, **kw))
        assert got == _tokens(b.beam_search(ids, lengths, beam_size=beam, **kw))


def test_validation_reads_the_operator(op_dir, tmp_path):
    """Negative control: the same folder with one DecodeAttention's scale 1% off fails the
    export's validation, naming a decoder step output."""
    from export.validate import validate_export
    from transformer_ext.checkpoint import load_model

    bad = tmp_path / "bad"
    shutil.copytree(op_dir, bad)
    decoder = onnx.load(bad / DECODER_FILE)
    node = next(n for n in decoder.graph.node if contract.is_custom_attention(n))
    node.attribute[0].f = 1.01
    onnx.save(decoder, bad / DECODER_FILE)
    model = load_model(json.loads((op_dir / MANIFEST_NAME).read_text())["export"]["source_model_dir"])
    with pytest.raises(ParityError, match="decoder_step"):
        validate_export(bad, model, tolerance=TOLERANCE)


def test_int8_keeps_the_operator(op_dir, portable_dir, tmp_path):
    out, ref = tmp_path / "op_int8", tmp_path / "portable_int8"
    quantize_export(op_dir, out, "int8", gate=False)
    quantize_export(portable_dir, ref, "int8", gate=False)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["flavour"] == FLAVOUR and manifest["quantization"]["scheme"] == "int8"
    assert manifest["custom_ops"]["sha256"] == file_sha256(out / CUSTOM_OPS_LIBRARY)
    decoder = onnx.load(out / DECODER_FILE)
    n = manifest["model_config"]["n_decoder_layers"]
    assert sum(contract.is_custom_attention(node) for node in decoder.graph.node) == 2 * n
    a, b = OrtRunner(out, intra_op_num_threads=1), OrtRunner(ref, intra_op_num_threads=1)
    ids, lengths = _sources(a, batch=3)
    tokens = np.full(6, a.info.bos_id)
    la = a.step(a.encode(ids, lengths, cache_len=8, beam_size=2), tokens)
    lb = b.step(b.encode(ids, lengths, cache_len=8, beam_size=2), tokens)
    np.testing.assert_allclose(la, lb, rtol=0, atol=1e-4)  # the same int8 products
    kw = dict(max_decoding_length=10, beam_size=3)
    assert _tokens(a.beam_search(ids, lengths, **kw)) == _tokens(b.beam_search(ids, lengths, **kw))


def test_demo_model_int8_passes_the_gate(library, tmp_path):  # noqa: F811
    """The bundled demo model in the flavour: float32 validation, int8 with its exact-match gate."""
    result = export_onnx(None, tmp_path / "demo", flavour=FLAVOUR, quantize="int8")
    manifest = result.manifest
    assert manifest["flavour"] == FLAVOUR and manifest["validation"]["greedy"]["tokens_identical"]
    gate = manifest["quantization"]["gate"]
    assert gate["drop_points"] <= gate["max_drop_points"]
    runner = OrtRunner(result.output_dir, intra_op_num_threads=1)
    assert runner.info.precision == "int8"


def test_imported_marian_exports_and_validates(library, tmp_path):  # noqa: F811
    """A tiny MarianMT written by transformers, converted, exported in the flavour: the export's
    validation against eager float64 (steps, greedy and beam decodes), then int8 with a BLEU gate."""
    pytest.importorskip("transformers")
    from hf_checkpoints import sample_lines, write_marian

    from export.quantize import GateData
    from transformer_ext.convert import convert_transformers

    ours = convert_transformers(
        write_marian(tmp_path / "hf", layers=2, d_model=32, heads=4), tmp_path / "model"
    )
    result = export_onnx(ours, tmp_path / "export", flavour=FLAVOUR)
    report = result.validation
    assert report.greedy["tokens_identical"] and report.beam["tokens_identical"]
    lines = sample_lines(8, 7)
    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    src.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    ref.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    out = tmp_path / "int8"
    manifest = quantize_export(
        result.output_dir, out, "int8", gate_data=GateData(src, ref), max_bleu_drop=100.0
    )
    assert manifest["flavour"] == FLAVOUR and "gate" in manifest["quantization"]


def test_folder_without_its_library_is_refused_in_one_line(op_dir, tmp_path):
    missing = tmp_path / "missing"
    shutil.copytree(op_dir, missing)
    (missing / CUSTOM_OPS_LIBRARY).unlink()
    with pytest.raises(ManifestError) as info:
        OrtRunner(missing)
    message = str(info.value)
    assert CUSTOM_OPS_LIBRARY in message and "\n" not in message

    changed = tmp_path / "changed"
    shutil.copytree(op_dir, changed)
    with open(changed / CUSTOM_OPS_LIBRARY, "ab") as f:
        f.write(b"\0")
    with pytest.raises(ManifestError) as info:
        OrtRunner(changed)
    message = str(info.value)
    assert CUSTOM_OPS_LIBRARY in message and "SHA-256" in message and "\n" not in message

    with pytest.raises(ValueError, match="custom-op flavour .* CPUExecutionProvider only"):
        OrtRunner(op_dir, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])


def test_export_without_the_library_fails_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(CUSTOM_OPS_LIBRARY_ENV, str(tmp_path / "none.so"))
    model_dir = make_model_dir(tmp_path / "model")
    out = tmp_path / "out"
    with pytest.raises(ExportError, match="csrc/ort/build.sh"):
        export_onnx(model_dir, out, flavour=FLAVOUR)
    assert not out.exists()
    assert main(["--model", str(model_dir), "--output-dir", str(out), "--flavour", FLAVOUR]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m export.onnx: error: ") and "\n" not in err
    assert "fetch_ort_headers.sh" in err and "none.so" in err
    assert not out.exists()


def test_attention_output_is_refused(tmp_path):
    model_dir = make_model_dir(tmp_path / "model")
    with pytest.raises(ExportError, match="without --attention"):
        export_onnx(model_dir, tmp_path / "out", flavour=FLAVOUR, attention=True)


def test_tensorrt_and_triton_refuse_the_flavour(op_dir, tmp_path):
    from export.tensorrt import plan_build
    from export.triton import TritonExportError, export_triton
    from export.trt_readiness import TensorRTReadinessError, check_export_dir

    with pytest.raises(TensorRTReadinessError) as info:
        check_export_dir(op_dir)
    problems = info.value.report.problems
    assert (MANIFEST_NAME, "flavour") in {(p.graph, p.kind) for p in problems}
    with pytest.raises(ExportError, match="custom-op flavour.*for TensorRT"):
        plan_build(op_dir)
    repo = tmp_path / "repo"
    with pytest.raises(TritonExportError, match="custom-op flavour.*Triton repository"):
        export_triton(op_dir, repo)
    assert not repo.exists()


def test_runners_sharing_session_options_register_the_library_once(op_dir, portable_dir):
    """ONNX Runtime takes a custom domain once per options object: a second runner (and a
    portable one) on the same options must still load."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    a = OrtRunner(op_dir, session_options=options)
    b = OrtRunner(op_dir, session_options=options)
    OrtRunner(portable_dir, session_options=options)
    ids, lengths = _sources(a, batch=2)
    assert a.greedy(ids, lengths, max_decoding_length=6) == b.greedy(ids, lengths, max_decoding_length=6)
