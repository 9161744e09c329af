"""The ``ort`` export flavour: each decoder self-attention one ONNX Runtime ``GroupQueryAttention``.

The flavour's parity with eager PyTorch (every output on ragged shapes, whole greedy and beam
decodes) is proven by the export's own validation, which the shared fixture runs
(``helpers.exported_dir(..., "ort")``); tests/test_export_onnx.py and tests/test_ort_runner.py run
their per-flavour tests on it too. Here: what is particular to it. The oracles are the portable
export of the same weights (a separately lowered graph: standard ops, the runner's append) and
the eager model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import exported_dir

from export import ExportError, contract
from export.quantize import quantize_export
from transformer_ext.export_format import DECODER_FILE, MANIFEST_NAME
from transformer_ext.runtimes import OrtRunner


@pytest.fixture(scope="module")
def ort_dir(tmp_path_factory) -> Path:
    return exported_dir(tmp_path_factory, "ort")


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


def test_one_gqa_per_layer_with_the_folded_scale(ort_dir):
    decoder = onnx.load(ort_dir / DECODER_FILE)
    config = json.loads((ort_dir / MANIFEST_NAME).read_text())["model_config"]
    gqa = [n for n in decoder.graph.node if contract.is_gqa(n)]
    assert len(gqa) == config["n_decoder_layers"]
    H = config["n_heads"]
    for node in gqa:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        # the query scale is folded into the query projections: the operator must not scale again
        assert attrs == {"num_heads": H, "kv_num_heads": H, "scale": 1.0}
    # nothing else of the self-attention is left: no score MatMul reads a self cache
    readers = {i for n in decoder.graph.node if not contract.is_gqa(n) for i in n.input}
    assert not [name for name in readers if name.startswith("self_")]


def test_steps_match_the_portable_export_and_write_the_caches_in_place(ort_dir, portable_dir):
    """Step by step on a ragged batch: logits and the bound caches of the ort export equal the
    portable export's (whose runner appends the new K/V itself), and nothing past each step's
    position is written."""
    ort_runner = OrtRunner(ort_dir, intra_op_num_threads=1)
    ref_runner = OrtRunner(portable_dir, intra_op_num_threads=1)
    ids, lengths = _sources(ort_runner, batch=3)
    a = ort_runner.encode(ids, lengths, cache_len=10)
    b = ref_runner.encode(ids, lengths, cache_len=10)
    rng = np.random.default_rng(1)
    for p in range(6):
        tokens = rng.integers(4, ort_runner.info.tgt_vocab_size, size=3)
        la, lb = ort_runner.step(a, tokens), ref_runner.step(b, tokens)
        np.testing.assert_allclose(la, lb, rtol=0, atol=1e-5)
        for i in range(ort_runner.info.n_layers):
            for got, want in ((a.self_keys[i], b.self_keys[i]), (a.self_values[i], b.self_values[i])):
                np.testing.assert_allclose(got[:, :, : p + 1], want[:, :, : p + 1], rtol=0, atol=1e-5)
                assert not got[:, :, p + 1 :].any()  # the rest of the (zero-filled) cache untouched
    assert a.cache.new_keys is None  # no staging buffers: the graph appends itself


@pytest.mark.parametrize("beam_size", [1, 4])
def test_whole_decodes_equal_the_portable_export(ort_dir, portable_dir, beam_size):
    ort_runner = OrtRunner(ort_dir, intra_op_num_threads=1)
    ref_runner = OrtRunner(portable_dir, intra_op_num_threads=1)
    ids, lengths = _sources(ort_runner, batch=5, seed=2)
    kw = dict(max_decoding_length=12)
    if beam_size == 1:
        got, want = ort_runner.greedy(ids, lengths, **kw), ref_runner.greedy(ids, lengths, **kw)
    else:
        got = [
            [h.tokens for h in row] for row in ort_runner.beam_search(ids, lengths, beam_size=beam_size, **kw)
        ]
        want = [
            [h.tokens for h in row] for row in ref_runner.beam_search(ids, lengths, beam_size=beam_size, **kw)
        ]
    assert got == want


def test_int8_quantization_keeps_the_gqa(ort_dir, portable_dir, tmp_path):
    out = tmp_path / "ort_int8"
    quantize_export(ort_dir, out, "int8", gate=False)
    decoder = onnx.load(out / DECODER_FILE)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["flavour"] == "ort" and manifest["quantization"]["scheme"] == "int8"
    assert sum(contract.is_gqa(n) for n in decoder.graph.node) == manifest["model_config"]["n_decoder_layers"]
    ref = tmp_path / "portable_int8"
    quantize_export(portable_dir, ref, "int8", gate=False)
    a, b = OrtRunner(out, intra_op_num_threads=1), OrtRunner(ref, intra_op_num_threads=1)
    ids, lengths = _sources(a, batch=3)
    tokens = np.full(3, a.info.bos_id)
    la = a.step(a.encode(ids, lengths, cache_len=8), tokens)
    lb = b.step(b.encode(ids, lengths, cache_len=8), tokens)
    np.testing.assert_allclose(la, lb, rtol=0, atol=1e-4)  # the same int8 products


def test_other_providers_tensorrt_and_triton_are_refused(ort_dir, tmp_path):
    with pytest.raises(ValueError, match="ort flavour .* CPUExecutionProvider only"):
        OrtRunner(ort_dir, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])

    from export.tensorrt import plan_build
    from export.trt_readiness import TensorRTReadinessError, check_export_dir

    with pytest.raises(TensorRTReadinessError) as info:
        check_export_dir(ort_dir)
    problems = info.value.report.problems
    assert (MANIFEST_NAME, "flavour") in {(p.graph, p.kind) for p in problems}
    assert any("GroupQueryAttention" in p.message for p in problems if p.graph == DECODER_FILE)
    with pytest.raises(ExportError, match="ort flavour.*TensorRT does not parse"):
        plan_build(ort_dir)

    from export.triton import TritonExportError, export_triton

    repo = tmp_path / "repo"
    with pytest.raises(TritonExportError, match="ort flavour"):
        export_triton(ort_dir, repo)
    assert not repo.exists()


def _gqa_decoder(extra_reader: bool = False, present_out: bool = True) -> onnx.ModelProto:
    """A one-layer decoder-like graph around one GroupQueryAttention, for the contract rules."""
    from onnx import TensorProto, helper

    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    inputs = [helper.make_tensor_value_info(n, f, ["batch", 1, 8]) for n in ("q", "k", "v")]
    inputs += [
        helper.make_tensor_value_info(n, f, ["batch", 2, "cache_len", 4])
        for n in ("self_key.0", "self_value.0")
    ]
    inputs += [
        helper.make_tensor_value_info("seqlens_k", i32, ["batch"]),
        helper.make_tensor_value_info("total", i32, []),
    ]
    present_k = "present_key.0" if present_out else "kept_key"
    nodes = [
        helper.make_node(
            "GroupQueryAttention",
            ["q", "k", "v", "self_key.0", "self_value.0", "seqlens_k", "total"],
            ["out", present_k, "present_value.0"],
            domain="com.microsoft",
            num_heads=2,
            kv_num_heads=2,
        )
    ]
    outputs = [
        helper.make_tensor_value_info("out", f, None),
        helper.make_tensor_value_info("present_value.0", f, None),
    ]
    if present_out:
        outputs.append(helper.make_tensor_value_info("present_key.0", f, None))
    if extra_reader:
        nodes.append(helper.make_node("Shape", ["self_key.0"], ["shape"]))
        outputs.append(helper.make_tensor_value_info("shape", TensorProto.INT64, None))
    return helper.make_model(
        helper.make_graph(nodes, "g", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)],
    )


def test_contract_rules_of_the_ort_flavour():
    good = _gqa_decoder()
    assert contract.graph_flavour(good) == "ort"
    assert contract.contract_problems(good, flavour="ort") == []
    # No flavour named (TensorRT's readiness check): the contrib operator is a problem, the caches
    # follow the rule of the flavour read off the graph
    assert [p.kind for p in contract.contract_problems(good)] == ["custom_domain"]
    # the same graph under the portable rules: a contrib operator, and caches read by it
    kinds = {p.kind for p in contract.contract_problems(good, flavour="portable")}
    assert {"custom_domain", "cache_read"} <= kinds
    # a second reader of a cache breaks the aliasing the in-place update needs
    problems = contract.contract_problems(_gqa_decoder(extra_reader=True), flavour="ort")
    assert [p.kind for p in problems] == ["cache_aliasing"] and "self_key.0" in problems[0].message
    # the updated cache must come out as a graph output
    problems = contract.contract_problems(_gqa_decoder(present_out=False), flavour="ort")
    assert [p.kind for p in problems] == ["cache_aliasing"] and "kept_key" in problems[0].message


def test_cli_exports_the_flavour_and_checks_the_opset_first(ort_dir, tmp_path, capsys):
    from export.onnx import main

    model_dir = ort_dir.parent / "tiny_model"
    bad = tmp_path / "bad"
    assert (
        main(["--model", str(model_dir), "--output-dir", str(bad), "--flavour", "ort", "--opset", "24"]) == 2
    )
    err = capsys.readouterr().err
    assert "opset 24 is not supported for the ort flavour" in err and len(err.strip().splitlines()) == 1
    assert not bad.exists()
    out = tmp_path / "cli"
    code = main(["--model", str(model_dir), "--output-dir", str(out), "--flavour", "ort", "--no-validate"])
    assert code == 0
    assert json.loads((out / MANIFEST_NAME).read_text())["flavour"] == "ort"
    shutil.rmtree(out)
