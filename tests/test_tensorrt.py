"""TensorRT path: readiness check, builder logic, TensorRT runner and ONNX Runtime device runner.

Everything that needs no TensorRT and no GPU runs here: the readiness check on real small
exports and on hand-made bad graphs, the builder's decisions (profiles, precision conversion,
flags, files, manifest) against a stand-in ``tensorrt`` module, and the binding logic of both
device runners against stand-in engines / recording sessions that compute with the eager model
through the raw buffer addresses they are given (CPU tensors stand in for CUDA ones; the same
stand-in runs on CUDA where a GPU is visible). Engine tests need TensorRT and a GPU and are
skipped without them, with the reason.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from conftest import HAS_CUDA, device_params
from fake_tensorrt import FakeEnum, fake_engines, fake_tensorrt
from onnx import TensorProto, helper, numpy_helper

from export import tensorrt as trtb
from export import trt_readiness as rd
from export.trt_readiness import AxisRange, TensorRTReadinessError, check_export_dir, check_model
from transformer_ext.export_format import read_manifest
from transformer_ext.runtimes.device import BindingError, DeviceState, decoder_bindings, encoder_bindings
from transformer_ext.runtimes.kv_cache import KVCache
from transformer_ext.runtimes.trt import TensorRTRunner

FLAVOURS = ["portable", "tensorscatter"]
HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None
# Decided at collection, so that skipped engine tests do not export graphs first.
needs_tensorrt_gpu = pytest.mark.skipif(
    not (HAS_TENSORRT and HAS_CUDA),
    reason=(
        "TensorRT is not installed (pip install tensorrt-cu13)"
        if not HAS_TENSORRT
        else "TensorRT engines need a CUDA GPU; none is visible"
    ),
)


def _has_ort_cuda() -> bool:
    import onnxruntime as ort

    return HAS_CUDA and "CUDAExecutionProvider" in ort.get_available_providers()


PRECISIONS = ["fp16", "bf16"]
DEVICES = device_params()

# ------------------------------------------------------------------------------------------
# fixtures: a tiny random model and its exports (both flavours), made once
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from transformer_ext.checkpoint import save_model
    from transformer_ext.config import TransformerConfig
    from transformer_ext.model import Transformer

    torch.manual_seed(0)
    model = Transformer(TransformerConfig.preset("tiny")).eval()
    path = tmp_path_factory.mktemp("tiny_model")
    save_model(model, path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from transformer_ext.checkpoint import load_model

    return load_model(tiny_model_dir).eval()


@pytest.fixture(scope="session")
def exports(tiny_model_dir, tmp_path_factory):
    """{flavour: export folder}, exported without the (slow) parity validation: the exporter's
    own tests prove parity; here the graphs are inputs."""
    onnx_export = pytest.importorskip(
        "export.onnx", reason="the ONNX exporter (export/onnx.py) is not available"
    )
    out = {}
    for flavour in FLAVOURS:
        path = tmp_path_factory.mktemp(f"export_{flavour}") / "export"
        onnx_export.export_onnx(tiny_model_dir, path, flavour=flavour, validate=False)
        out[flavour] = path
    return out


def _copy_export(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------------------------------
# hand-made graphs
# ------------------------------------------------------------------------------------------


def _model(nodes, inputs, outputs, initializers=(), opset=18):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    return m


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def _kinds(report):
    return sorted({p.kind for p in report.problems})


def _simple(op="Relu", elem=TensorProto.FLOAT, shape=("batch", 4), **attrs):
    return _model(
        [helper.make_node(op, ["x"], ["y"], **attrs)], [_vi("x", elem, list(shape))], [_vi("y", elem, None)]
    )


RANGES = {"batch": AxisRange(1, 2, 4), "cache_len": AxisRange(1, 8, 16), "src_len": AxisRange(1, 8, 16)}


def _scatter_graph(axis=-2, cache_dims=("batch", 2, "cache_len", 4), extra_reader=False, mode=None):
    attrs = {} if axis is None else {"axis": axis}
    if mode is not None:
        attrs["mode"] = mode
    nodes = [helper.make_node("TensorScatter", ["cache", "update", "pos"], ["present"], **attrs)]
    outputs = [_vi("present", TensorProto.FLOAT, list(cache_dims))]
    if extra_reader:
        nodes.append(helper.make_node("ReduceSum", ["cache", "axes"], ["s"]))
        outputs.append(_vi("s", TensorProto.FLOAT, None))
    inits = [numpy_helper.from_array(np.array([2], np.int64), "axes")] if extra_reader else []
    return _model(
        nodes,
        [
            _vi("cache", TensorProto.FLOAT, list(cache_dims)),
            _vi("update", TensorProto.FLOAT, ["batch", 2, 1, 4]),
            _vi("pos", TensorProto.INT64, ["batch"]),
        ],
        outputs,
        inits,
        opset=24,
    )


def test_good_hand_made_graph_has_no_problem():
    report = check_model(_simple(), "g", RANGES)
    assert report.ok, report.problems
    assert report.op_counts == {"Relu": 1}


def test_if_node_is_rejected_as_control_flow():
    then = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["t"])], "then", [], [_vi("t", TensorProto.FLOAT, None)]
    )
    other = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["e"])], "else", [], [_vi("e", TensorProto.FLOAT, None)]
    )
    m = _model(
        [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
        [_vi("c", TensorProto.BOOL, []), _vi("x", TensorProto.FLOAT, ["batch", 4])],
        [_vi("y", TensorProto.FLOAT, None)],
    )
    report = check_model(m, "g", RANGES)
    assert _kinds(report) == ["control_flow"]
    assert "If" in report.problems[0].message


def test_loop_and_scan_are_rejected_too():
    body = helper.make_graph(
        [helper.make_node("Identity", ["c_in"], ["c_out"])],
        "body",
        [_vi("i", TensorProto.INT64, []), _vi("c_in", TensorProto.BOOL, [])],
        [_vi("c_out", TensorProto.BOOL, [])],
    )
    m = _model(
        [helper.make_node("Loop", ["n", "c"], [], body=body)],
        [_vi("n", TensorProto.INT64, []), _vi("c", TensorProto.BOOL, [])],
        [],
    )
    assert "control_flow" in _kinds(check_model(m, "g", RANGES))


def test_zero_length_dimension_in_input_and_initializer():
    m = _model(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        [_vi("x", TensorProto.FLOAT, ["batch", 0])],
        [_vi("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.zeros((1, 0), np.float32), "w")],
    )
    report = check_model(m, "g", RANGES)
    zero = [p for p in report.problems if p.kind == "zero_dim"]
    assert any("'x'" in p.message for p in zero) and any("'w'" in p.message for p in zero)


def test_unbounded_and_unnamed_dynamic_axes():
    m = _model(
        [helper.make_node("Add", ["x", "z"], ["y"])],
        [_vi("x", TensorProto.FLOAT, ["batch", "mystery"]), _vi("z", TensorProto.FLOAT, ["batch", None])],
        [_vi("y", TensorProto.FLOAT, None)],
    )
    report = check_model(m, "g", RANGES)
    messages = [p.message for p in report.problems if p.kind == "unbounded_axis"]
    assert any("'mystery'" in msg for msg in messages)
    assert any("without a name" in msg for msg in messages)
    # bounded once the profile names it
    report = check_model(m, "g", {**RANGES, "mystery": AxisRange(1, 2, 3)})
    assert all("mystery" not in p.message for p in report.problems)


def test_invalid_profile_range_is_a_problem():
    report = check_model(_simple(), "g", {"batch": AxisRange(0, 2, 4)})
    assert _kinds(report) == ["profile"]


@pytest.mark.parametrize("axis, ok", [(-2, True), (2, False), (None, False)])
def test_tensor_scatter_axis_must_be_the_literal_minus_two(axis, ok):
    # the ONNX default is -2, but the literal is the only spelling TensorRT's parser accepts
    report = check_model(_scatter_graph(axis=axis), "g", {**RANGES, "cache_len": AxisRange(8, 8, 8)})
    assert report.ok is ok, report.problems
    if not ok:
        assert report.problems[0].kind == "op_restriction" and "axis" in report.problems[0].message


def test_tensor_scatter_needs_a_static_cache_and_a_private_cache_input():
    dynamic = check_model(_scatter_graph(), "g", RANGES)  # cache_len 1:8:16
    assert _kinds(dynamic) == ["cache_aliasing"]
    assert "--cache-len" in dynamic.problems[0].message
    shared = check_model(_scatter_graph(extra_reader=True), "g", {**RANGES, "cache_len": AxisRange(8, 8, 8)})
    assert any("also read by" in p.message for p in shared.problems)
    circular = check_model(_scatter_graph(mode="circular"), "g", {**RANGES, "cache_len": AxisRange(8, 8, 8)})
    assert any("linear" in p.message for p in circular.problems)
    rank3 = check_model(
        _scatter_graph(cache_dims=("batch", "cache_len", 4)), "g", {**RANGES, "cache_len": AxisRange(8, 8, 8)}
    )
    assert any("4-D" in p.message for p in rank3.problems)


# Unsupported by TensorRT, supported but never emitted by export.onnx, not an ONNX op at all.
@pytest.mark.parametrize("op", ["Unique", "StringNormalizer", "Ceil", "HardSigmoid", "NoSuchOp"])
def test_ops_the_exporter_does_not_emit_are_refused(op):
    report = check_model(_simple(op), "g", RANGES)
    assert _kinds(report) == ["unsupported_op"]
    assert op in str(report.problems[0]) and "export.onnx emits" in str(report.problems[0])


def test_every_emitted_op_is_in_the_allowlist(exports):
    """The allowlist covers the real graphs of both flavours and their fp16/bf16 conversions."""
    for folder in exports.values():
        for name in ("encoder.onnx", "decoder_step.onnx"):
            model = onnx.load(folder / name, load_external_data=False)
            for graph in (model, trtb.convert_precision(onnx.load(folder / name), "fp16")):
                assert {n.op_type for n in graph.graph.node} <= rd.EMITTED_OPS


def test_custom_domain_op_needs_a_plugin():
    m = _model(
        [helper.make_node("decode_attention", ["x"], ["y"], domain="transformer_ext")],
        [_vi("x", TensorProto.FLOAT, ["batch", 4])],
        [_vi("y", TensorProto.FLOAT, None)],
    )
    m.opset_import.append(helper.make_opsetid("transformer_ext", 1))
    report = check_model(m, "g", RANGES)
    assert _kinds(report) == ["custom_domain"]
    assert "plugin" in report.problems[0].message


@pytest.mark.parametrize("opset, ok", [(8, False), (9, True), (24, True), (25, False)])
def test_opset_range(opset, ok):
    m = _model(
        [helper.make_node("Relu", ["x"], ["y"])],
        [_vi("x", TensorProto.FLOAT, ["batch", 4])],
        [_vi("y", TensorProto.FLOAT, None)],
        opset=opset,
    )
    report = check_model(m, "g", RANGES)
    assert report.ok is ok
    if not ok:
        assert _kinds(report) == ["opset"]


def test_dtypes_float64_input_and_int64_matmul():
    report = check_model(_simple("Relu", TensorProto.DOUBLE), "g", RANGES)
    assert "dtype" in _kinds(report)
    assert any("float64" in p.message for p in report.problems)
    matmul = _model(
        [helper.make_node("MatMul", ["x", "x"], ["y"])],
        [_vi("x", TensorProto.INT64, [4, 4])],
        [_vi("y", TensorProto.INT64, None)],
    )
    report = check_model(matmul, "g", RANGES)
    assert any(p.kind == "dtype" and "MatMul on int64" in p.message for p in report.problems)
    # int64 where TensorRT supports it is fine (token ids, positions, Gather indices, Add)
    assert check_model(_simple("Relu", TensorProto.INT64), "g", RANGES).ok


def test_unsqueeze_axes_must_resolve_to_a_constant():
    runtime = _model(
        [helper.make_node("Unsqueeze", ["x", "axes"], ["y"])],
        [_vi("x", TensorProto.FLOAT, ["batch", 4]), _vi("axes", TensorProto.INT64, [1])],
        [_vi("y", TensorProto.FLOAT, None)],
    )
    report = check_model(runtime, "g", RANGES)
    assert any(p.kind == "op_restriction" and "axes" in p.message for p in report.problems)
    from_shape = _model(
        [
            helper.make_node("Shape", ["x"], ["s"], start=1, end=2),
            helper.make_node("Unsqueeze", ["x", "s"], ["y"]),
        ],
        [_vi("x", TensorProto.FLOAT, ["batch", 1])],
        [_vi("y", TensorProto.FLOAT, None)],
    )
    report = check_model(from_shape, "g", RANGES)
    assert report.ok and any("axes" in w.message for w in report.warnings)  # the parser folds it


def test_every_problem_is_listed_in_the_error(exports, tmp_path):
    folder = _copy_export(exports["portable"], tmp_path / "bad")
    bad = _model(
        [helper.make_node("Unique", ["input_ids"], ["u"]), helper.make_node("Relu", ["x"], ["y"])],
        [
            _vi("input_ids", TensorProto.INT64, ["batch", 0]),
            _vi("x", TensorProto.DOUBLE, ["batch", "mystery"]),
        ],
        [_vi("y", TensorProto.DOUBLE, None)],
        opset=25,
    )
    onnx.save(bad, folder / "encoder.onnx")
    with pytest.raises(TensorRTReadinessError) as info:
        check_export_dir(folder)
    kinds = {p.kind for p in info.value.report.problems}
    assert {"opset", "unsupported_op", "zero_dim", "unbounded_axis", "dtype", "manifest"} <= kinds
    message = str(info.value)
    for p in info.value.report.problems:
        assert str(p) in message
    assert info.value.report.graph("decoder_step.onnx").ok  # the other graph is still checked


def test_corrupt_graph_is_a_load_problem(exports, tmp_path):
    folder = _copy_export(exports["portable"], tmp_path / "corrupt")
    (folder / "decoder_step.onnx").write_bytes(b"not a protobuf at all")
    report = check_export_dir(folder, raise_on_error=False)
    assert any(p.kind == "load" for p in report.problems)


# ------------------------------------------------------------------------------------------
# readiness on real exports
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_real_export_is_ready(exports, flavour):
    report = check_export_dir(exports[flavour])
    assert report.ok and report.flavour == flavour
    assert {g.name for g in report.graphs} == {"encoder.onnx", "decoder_step.onnx"}
    for g in report.graphs:
        assert not set(g.op_counts) & {"If", "Loop", "Scan"}
        assert rd.MIN_OPSET <= g.opset <= rd.MAX_OPSET
    dec = report.graph("decoder_step.onnx")
    assert ("TensorScatter" in dec.op_counts) == (flavour == "tensorscatter")
    manifest = json.loads((exports[flavour] / "manifest.json").read_text())
    assert report.axis_ranges["src_len"].max == manifest["model_config"]["max_len"]
    if flavour == "tensorscatter":  # defaults pin the cache length (TensorRT's KV-cache update layer)
        assert report.axis_ranges["cache_len"].static


def test_check_only_cli_needs_no_tensorrt(exports, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # even where TensorRT is installed
    assert trtb.main([str(exports["portable"]), "--check-only", "--precision", "fp16", "--json"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out[: out.rindex("}") + 1])
    assert report["ok"] and report["problems"] == []
    assert "decoder_step.fp16.engine" in out


def test_help_works_without_tensorrt(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(SystemExit) as info:
        trtb.main(["--help"])
    assert info.value.code == 0
    assert "--check-only" in capsys.readouterr().out


def test_build_without_tensorrt_says_how_to_install(exports, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    folder = _copy_export(exports["portable"], tmp_path / "e")
    before = sorted(os.listdir(folder))
    with pytest.raises(
        trtb.TensorRTNotAvailableError, match=r"pip install tensorrt-cu13.*transformer_ext\[tensorrt\]"
    ):
        trtb.build_engines(folder)
    assert sorted(os.listdir(folder)) == before  # nothing written
    assert trtb.main([str(folder)]) == 1
    assert "pip install tensorrt-cu13" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------
# builder logic without an engine: ranges, profiles, flags, precision
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [("1:8:32", AxisRange(1, 8, 32)), ("16", AxisRange(1, 16, 16)), (" 4:4:4 ", AxisRange(4, 4, 4))],
)
def test_parse_axis_range(text, expected):
    assert rd.parse_axis_range(text) == expected


@pytest.mark.parametrize("text", ["0:1:2", "4:2:8", "1:2", "a:b:c", "-3"])
def test_parse_axis_range_rejects(text):
    with pytest.raises(ValueError):
        rd.parse_axis_range(text)


def test_cli_ranges_become_options():
    args = trtb.build_parser().parse_args(
        [
            "x",
            "--batch",
            "2:4:8",
            "--cache-len",
            "16",
            "--axis",
            "foo=1:1:2",
            "--precision",
            "bf16",
            "--typing",
            "weak",
            "--tf32",
        ]
    )
    opts = trtb._options_from_args(args)
    assert opts.axis_ranges == {
        "batch": AxisRange(2, 4, 8),
        "cache_len": AxisRange(1, 16, 16),
        "foo": AxisRange(1, 1, 2),
    }
    assert (opts.precision, opts.typing, opts.tf32) == ("bf16", "weak", True)
    with pytest.raises(SystemExit):
        trtb.build_parser().parse_args(["x", "--batch", "0:1:2"])


def test_default_ranges_follow_the_manifest(exports):
    manifest = read_manifest(exports["portable"])
    ranges = rd.default_axis_ranges(rd.manifest_max_positions(manifest), rd.manifest_max_cache_len(manifest))
    max_len = manifest["model_config"]["max_len"]
    assert ranges["src_len"].max == max_len and ranges["cache_len"].max == min(
        max_len, manifest["max_cache_len"]
    )
    assert all(r.min >= 1 for r in ranges.values())


def test_profile_shapes_of_the_decoder(exports):
    dec = onnx.load(exports["portable"] / "decoder_step.onnx", load_external_data=False)
    ranges = {"batch": AxisRange(1, 4, 8), "src_len": AxisRange(2, 5, 9), "cache_len": AxisRange(3, 6, 12)}
    ranges["sources"] = AxisRange(1, 2, 8)
    shapes = rd.profile_shapes(rd.input_specs(dec), ranges)
    assert shapes["input_ids"] == ((1, 1), (4, 1), (8, 1))
    assert shapes["positions"] == ((1,), (4,), (8,))
    assert shapes["self_key.0"] == ((1, 4, 3, 8), (4, 4, 6, 8), (8, 4, 12, 8))  # tiny: 4 heads, d_k 8
    assert shapes["cross_value.1"] == ((1, 4, 2, 8), (2, 4, 5, 8), (8, 4, 9, 8))  # one row per source
    with pytest.raises(ValueError, match="'sources'.*--axis sources=MIN:OPT:MAX"):
        rd.profile_shapes(rd.input_specs(dec), {k: v for k, v in ranges.items() if k != "sources"})
    with pytest.raises(ValueError, match="cache_len"):
        rd.profile_shapes(rd.input_specs(dec), {"batch": AxisRange(1, 1, 1), "src_len": AxisRange(1, 1, 1)})


@pytest.mark.parametrize(
    "precision, typing, expected",
    [
        ("fp32", "strong", {"network": ["STRONGLY_TYPED"], "set": [], "clear": ["TF32"]}),
        ("fp16", "strong", {"network": ["STRONGLY_TYPED"], "set": [], "clear": ["TF32"]}),
        ("fp16", "weak", {"network": [], "set": ["FP16", "OBEY_PRECISION_CONSTRAINTS"], "clear": ["TF32"]}),
        ("bf16", "weak", {"network": [], "set": ["BF16", "OBEY_PRECISION_CONSTRAINTS"], "clear": ["TF32"]}),
    ],
)
def test_precision_flags(precision, typing, expected):
    assert trtb.precision_flags(precision, typing) == expected
    assert "TF32" in trtb.precision_flags(precision, typing, tf32=True)["set"]


def test_cache_dtype_of_every_precision():
    assert trtb.CACHE_DTYPES == {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_plan_converts_graphs_and_keeps_logits_float32(exports, flavour, precision):
    plan, graphs = trtb.plan_build(exports[flavour], trtb.BuildOptions(precision=precision))
    assert plan.readiness.ok and plan.cache_dtype == trtb.CACHE_DTYPES[precision]
    dec = plan.engine("decoder_step")
    assert dec.engine_file == f"decoder_step.{precision}.engine" and dec.converted_onnx_file
    assert dec.io_dtypes["logits"] == "float32"
    assert dec.io_dtypes["input_ids"] == "int64"
    out_name = "present_key.0" if flavour == "tensorscatter" else "new_key.0"
    for name in ("self_key.0", "cross_value.1", out_name):
        assert dec.io_dtypes[name] == plan.cache_dtype
    assert plan.engine("encoder").io_dtypes["cross_key.0"] == plan.cache_dtype
    # softmax / layer norm compute in float32 in the converted graph
    inferred = onnx.shape_inference.infer_shapes(graphs["decoder_step"])
    types = {vi.name: vi.type.tensor_type.elem_type for vi in inferred.graph.value_info}
    for node in inferred.graph.node:
        if node.op_type in ("Softmax", "LayerNormalization"):
            assert types.get(node.input[0], TensorProto.FLOAT) == TensorProto.FLOAT, node.name


def test_plan_pins_the_tensorscatter_cache(exports):
    plan, graphs = trtb.plan_build(
        exports["tensorscatter"], trtb.BuildOptions(axis_ranges={"cache_len": AxisRange(1, 8, 24)})
    )
    dec = plan.engine("decoder_step")
    assert dec.pinned_axes == {"cache_len": 24}
    assert dec.shapes["self_key.0"][0][2] == dec.shapes["self_key.0"][2][2] == 24
    cache_input = next(i for i in graphs["decoder_step"].graph.input if i.name == "self_key.0")
    assert cache_input.type.tensor_type.shape.dim[2].dim_value == 24
    portable, _ = trtb.plan_build(
        exports["portable"], trtb.BuildOptions(axis_ranges={"cache_len": AxisRange(1, 8, 24)})
    )
    assert portable.engine("decoder_step").shapes["self_key.0"][0][2] == 1  # dynamic for the portable flavour


def _run(model, feeds):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def test_fp16_conversion_matches_float32_in_onnx_runtime(exports):
    """The converted graphs compute what the float32 ones do, within fp16 rounding (ORT CPU)."""
    folder = exports["portable"]
    rng = np.random.default_rng(3)
    enc32 = onnx.load(folder / "encoder.onnx")
    dec32 = onnx.load(folder / "decoder_step.onnx")
    enc16, dec16 = trtb.convert_precision(enc32, "fp16"), trtb.convert_precision(dec32, "fp16")
    ids = rng.integers(3, 48, (3, 7)).astype(np.int64)
    lens = np.array([7, 2, 5], np.int64)
    e32 = _run(enc32, {"input_ids": ids, "src_lengths": lens})
    e16 = _run(enc16, {"input_ids": ids, "src_lengths": lens})
    for name, ref in e32.items():
        assert e16[name].dtype == np.float16
        np.testing.assert_allclose(e16[name].astype(np.float32), ref, atol=2e-2)
    feeds = {
        "input_ids": rng.integers(3, 40, (3, 1)).astype(np.int64),
        "positions": np.full(3, 4, np.int64),
        "src_lengths": lens,
    }
    for i in range(2):
        feeds[f"cross_key.{i}"], feeds[f"cross_value.{i}"] = e32[f"cross_key.{i}"], e32[f"cross_value.{i}"]
        feeds[f"self_key.{i}"] = rng.standard_normal((3, 4, 6, 8)).astype(np.float32)
        feeds[f"self_value.{i}"] = rng.standard_normal((3, 4, 6, 8)).astype(np.float32)
    d32 = _run(dec32, feeds)
    d16 = _run(dec16, {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in feeds.items()})
    assert d16["logits"].dtype == np.float32 and d16["new_key.0"].dtype == np.float16
    for name, ref in d32.items():
        np.testing.assert_allclose(d16[name].astype(np.float32), ref, atol=2e-2)


def test_conversion_keeps_float32_islands_and_casts_output():
    """LayerNormalization in float32 between fp16 MatMuls; scale/bias stay float32; logits float32."""
    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")
    scale = numpy_helper.from_array(np.ones(4, np.float32), "scale")
    m = _model(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"]),
            helper.make_node("LayerNormalization", ["h", "scale"], ["n"]),
            helper.make_node("Softmax", ["n"], ["p"]),
            helper.make_node("MatMul", ["p", "w"], ["logits"]),
        ],
        [_vi("x", TensorProto.FLOAT, ["batch", 4])],
        [_vi("logits", TensorProto.FLOAT, ["batch", 4])],
        [w, scale],
    )
    out = trtb.convert_precision(m, "fp16")
    inits = {t.name: t.data_type for t in out.graph.initializer}
    assert inits == {"w": TensorProto.FLOAT16, "scale": TensorProto.FLOAT}
    assert out.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    assert out.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    ops = [n.op_type for n in out.graph.node]
    # cast up before the float32 island (LayerNorm -> Softmax stays float32), down after it, up at the end
    assert ops == ["MatMul", "Cast", "LayerNormalization", "Softmax", "Cast", "MatMul", "Cast"]
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    ref = _run(m, {"x": x})["logits"]
    np.testing.assert_allclose(_run(out, {"x": x.astype(np.float16)})["logits"], ref, atol=5e-3)


def test_conversion_rejects_custom_ops():
    m = _model(
        [helper.make_node("Foo", ["x"], ["y"], domain="custom")],
        [_vi("x", TensorProto.FLOAT, [2])],
        [_vi("y", TensorProto.FLOAT, [2])],
    )
    m.opset_import.append(helper.make_opsetid("custom", 1))
    with pytest.raises(trtb.PrecisionConversionError):
        trtb.convert_precision(m, "fp16")


def test_describe_parser_error():
    class Err:
        def code(self):
            return types.SimpleNamespace(name="UNSUPPORTED_NODE")

        def desc(self):
            return "no importer for op Foo"

        def node(self):
            return 7

        def node_name(self):
            return "/decoder/Foo_3"

        def node_operator(self):
            return "Foo"

        def file(self):
            return "/src/ModelImporter.cpp"

        def line(self):
            return 42

        def func(self):
            return "parseNode"

    text = trtb.describe_parser_error(Err())
    assert (
        text
        == "UNSUPPORTED_NODE: no importer for op Foo at node 7 '/decoder/Foo_3' (Foo) [parseNode ModelImporter.cpp:42]"
    )


# ------------------------------------------------------------------------------------------
# builds against a stand-in `tensorrt` module (tests/fake_tensorrt.py)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flavour, precision, typing",
    [
        ("portable", "fp32", "strong"),
        ("portable", "fp16", "strong"),
        ("tensorscatter", "bf16", "strong"),
        ("portable", "fp16", "weak"),
    ],
)
def test_build_engines_with_a_stand_in_tensorrt(exports, tmp_path, monkeypatch, flavour, precision, typing):
    calls: list = []
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(calls))
    folder = _copy_export(exports[flavour], tmp_path / "e")
    (folder / "tensorrt.timing.cache").write_bytes(b"previous")
    ranges = {"batch": AxisRange(1, 4, 8), "cache_len": AxisRange(2, 8, 16)}
    result = trtb.build_engines(
        folder, trtb.BuildOptions(precision=precision, typing=typing, axis_ranges=ranges)
    )

    builds = [c for c in calls if c[0] == "build"]
    assert len(builds) == 2
    weak_flags = ["FP16", "OBEY_PRECISION_CONSTRAINTS"] if typing == "weak" else []
    for _, flags, cleared, profiles in builds:
        assert flags == weak_flags and cleared == ["TF32"] and len(profiles) == 1
    # 1 << STRONGLY_TYPED for strong typing, no flag for weak typing
    assert [c[1] for c in calls if c[0] == "create_network"] == [1, 1] if typing == "strong" else [0, 0]
    enc_profile, dec_profile = builds[0][3][0], builds[1][3][0]
    assert enc_profile["input_ids"] == ((1, 1), (4, 32), (8, 64))
    cache = 16 if flavour == "tensorscatter" else None
    assert dec_profile["self_key.0"] == (((1, 4, cache or 2, 8)), (4, 4, cache or 8, 8), (8, 4, 16, 8))
    parsed_types = dict(next(c for c in calls if c[0] == "parse" and "decoder_step" in c[1])[2])
    low = {"fp32": "FLOAT", "fp16": "HALF", "bf16": "BF16"}[precision]
    # strong typing parses the converted graph; weak typing parses float32 and retypes the network I/O
    assert (
        parsed_types["self_key.0"] == (low if typing == "strong" else "FLOAT")
        and parsed_types["logits"] == "FLOAT"
    )
    assert ("create_timing_cache", b"previous") in calls
    assert (folder / "tensorrt.timing.cache").read_bytes() == b"previous+timing"

    manifest = json.loads((folder / "manifest.json").read_text())
    section = manifest["tensorrt"]["engines"][precision]
    assert manifest["tensorrt"]["cache_dtypes"] == trtb.CACHE_DTYPES
    assert section["cache_dtype"] == trtb.CACHE_DTYPES[precision] and section["flavour"] == flavour
    for graph in ("encoder", "decoder_step"):
        entry = section["engines"][graph]
        data = (folder / entry["file"]).read_bytes()
        import hashlib

        assert entry["sha256"] == hashlib.sha256(data).hexdigest() and entry["bytes"] == len(data)
        assert entry["io"]["input_ids"]["mode"] == "input"
    assert section["engines"]["decoder_step"]["io"]["self_key.0"]["dtype"] == trtb.CACHE_DTYPES[precision]
    assert (folder / f"decoder_step.{precision}.onnx").exists() == (
        precision != "fp32" and typing == "strong"
    )
    assert not [p for p in os.listdir(folder) if p.endswith(".tmp")]
    read_manifest(folder)  # still a valid export manifest for the ONNX side
    assert result.engine_paths["encoder"].endswith(f"encoder.{precision}.engine")


def test_parser_errors_are_reported_one_by_one_and_nothing_is_written(exports, tmp_path, monkeypatch, caplog):
    calls: list = []
    errors = [("no importer for Foo", 3), ("bad shape", 9)]
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(calls, parse_errors=errors))
    folder = _copy_export(exports["portable"], tmp_path / "e")
    before = {p: (folder / p).stat().st_mtime_ns for p in os.listdir(folder)}
    with caplog.at_level("ERROR", logger="export.tensorrt"), pytest.raises(trtb.TensorRTParseError) as info:
        trtb.build_engines(folder)
    assert info.value.errors == [
        "UNSUPPORTED_NODE: no importer for Foo at node 3",
        "UNSUPPORTED_NODE: bad shape at node 9",
    ]
    assert "2 error(s)" in str(info.value) and "--check-only" in str(info.value)
    logged = [r.getMessage() for r in caplog.records]
    assert any("parser error 1/2" in m for m in logged) and any("parser error 2/2" in m for m in logged)
    assert {p: (folder / p).stat().st_mtime_ns for p in os.listdir(folder)} == before


def test_failed_build_writes_nothing(exports, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt([], fail_build=True))
    folder = _copy_export(exports["portable"], tmp_path / "e")
    before = sorted(os.listdir(folder))
    with pytest.raises(trtb.TensorRTBuildError):
        trtb.build_engines(folder)
    assert sorted(os.listdir(folder)) == before


def test_old_tensorrt_is_refused(monkeypatch):
    fake = types.ModuleType("tensorrt")
    fake.__version__ = "10.3.0"
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    with pytest.raises(trtb.TensorRTNotAvailableError, match="10.15"):
        trtb.import_tensorrt()


def test_weak_typing_pins_float32_layers():
    trt = fake_tensorrt([])

    class Layer:
        def __init__(self, kind):
            self.type, self.precision, self.num_outputs, self.output_types = kind, None, 2, {}

        def set_output_type(self, j, dtype):
            self.output_types[j] = dtype

    class Net:
        def __init__(self):
            self.layers = [
                Layer(trt.LayerType.SOFTMAX),
                Layer(FakeEnum("MATRIX_MULTIPLY")),
                Layer(trt.LayerType.REDUCE),
            ]
            self.ins = [
                types.SimpleNamespace(name="self_key.0", dtype=trt.float32),
                types.SimpleNamespace(name="input_ids", dtype=trt.int64),
            ]
            self.outs = [
                types.SimpleNamespace(name="logits", dtype=trt.float32),
                types.SimpleNamespace(name="new_key.0", dtype=trt.float32),
            ]
            self.num_layers, self.num_inputs, self.num_outputs = 3, 2, 2

        def get_layer(self, i):
            return self.layers[i]

        def get_input(self, i):
            return self.ins[i]

        def get_output(self, i):
            return self.outs[i]

    net = Net()
    io = {"self_key.0": "float16", "input_ids": "int64", "logits": "float32", "new_key.0": "float16"}
    assert trtb.apply_weak_precision(trt, net, "fp16", io) == 2
    assert net.layers[0].precision is trt.float32 and net.layers[0].output_types == {
        0: trt.float32,
        1: trt.float32,
    }
    assert net.layers[1].precision is None
    assert [t.dtype for t in net.ins] == [trt.float16, trt.int64]
    assert [t.dtype for t in net.outs] == [trt.float32, trt.float16]


# ------------------------------------------------------------------------------------------
# TensorRT runner against stand-in engines that compute with the eager model (tests/fake_tensorrt.py)
# ------------------------------------------------------------------------------------------


def _sources(seed=0, B=3, S=9):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 48, (B, S)).astype(np.int64)
    lengths = np.array([S, 4, 6][:B], np.int64)
    for b, n in enumerate(lengths):
        ids[b, n:] = 0
    return ids, lengths


def _eager(model, device):
    from transformer_ext.runtimes import EagerRunner

    return EagerRunner(model, device)


def _decode_all(runner, ids, lengths, cache_len=None):
    """Greedy tokens, beam tokens and beam scores of a batch (tokens compare exactly, scores by tolerance)."""
    from transformer_ext import decoding

    kw = dict(bos_id=1, eos_id=2, max_decoding_length=10, cache_len=cache_len)
    greedy = decoding.greedy_decode(runner, ids, lengths, **kw)
    beams = decoding.beam_search(runner, ids, lengths, beam_size=3, num_hypotheses=2, **kw)
    return (
        greedy,
        [[h.tokens for h in hyps] for hyps in beams],
        np.array([[h.score for h in hyps] for hyps in beams]),
    )


def _assert_same_decodes(ours, ref, atol=1e-4):
    assert ours[0] == ref[0], "greedy tokens differ"
    assert ours[1] == ref[1], "beam tokens differ"
    np.testing.assert_allclose(ours[2], ref[2], atol=atol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_tensorrt_runner_decodes_like_eager_with_stand_in_engines(tiny_model, flavour, device):
    dev = torch.device(device)
    model = tiny_model.to(dev)
    try:
        static = 32 if flavour == "tensorscatter" else None
        enc, dec = fake_engines(model, flavour, dev, [], static_cache=static)
        runner = TensorRTRunner(enc, dec, max_positions=model.config.max_len, device=dev)
        assert runner.info.flavour == flavour and runner.info.static_cache_len == static
        ids, lengths = _sources()
        _assert_same_decodes(
            _decode_all(runner, ids, lengths), _decode_all(_eager(model, dev), ids, lengths), atol=1e-5
        )
    finally:
        tiny_model.to("cpu")


def test_tensorrt_runner_binds_once_and_appends_after_each_step(tiny_model):
    calls: list = []
    enc, dec = fake_engines(tiny_model, "portable", torch.device("cpu"), calls)
    runner = TensorRTRunner(enc, dec, max_positions=64, device="cpu")
    real_append = runner._kv_append

    def append(cache, update, positions, *flag):
        calls.append(("kv_cache_append_", cache.data_ptr(), update.data_ptr(), positions.tolist()))
        real_append(cache, update, positions, *flag)

    runner._kv_append = append
    ids, lengths = _sources(B=2)
    state = runner.encode(ids, lengths, cache_len=5, beam_size=2)
    assert state.num_rows == 4 and state.cache_len == 5
    encoder_calls = [c for c in calls if c[1] == "encoder"]
    assert ("set_input_shape", "encoder", "input_ids", (2, 9)) in encoder_calls  # B sources, not B x beams
    calls.clear()
    for _ in range(3):
        runner.step(state, np.array([1, 1, 5, 6]))
    kinds = [c[0] for c in calls]
    # bound once (first step), then per step: execute, then one append for K and one for V,
    # each over the caches of every layer (stacked: [n_layers * N, H, L, d_k])
    assert kinds.count("set_tensor_address") == len(dec.names) and kinds.count("execute_async_v3") == 3
    n_layers = tiny_model.config.n_decoder_layers
    n_append = 2
    first_exec = kinds.index("execute_async_v3")
    assert kinds[first_exec + 1 : first_exec + 1 + n_append] == ["kv_cache_append_"] * n_append
    assert kinds.count("kv_cache_append_") == 3 * n_append
    shapes = {c[2]: c[3] for c in calls if c[0] == "set_input_shape"}
    assert shapes["self_key.0"] == (4, tiny_model.config.n_heads, 5, tiny_model.config.d_k)
    assert shapes["input_ids"] == (4, 1) and shapes["cross_key.1"][2] == 9
    addresses = {c[2]: c[3] for c in calls if c[0] == "set_tensor_address"}
    assert addresses["self_key.0"] == state.self_keys[0].data_ptr()
    assert addresses["new_value.1"] == state.new_values[1].data_ptr()
    appends = [c for c in calls if c[0] == "kv_cache_append_"]
    # the stacked buffers start at layer 0's views: the K append reads the new K of every layer
    assert appends[0][1:3] == (state.self_keys[0].data_ptr(), state.new_keys[0].data_ptr())
    assert appends[1][1:3] == (state.self_values[0].data_ptr(), state.new_values[0].data_ptr())
    assert state.self_keys[1].data_ptr() == state.self_keys[0].data_ptr() + state.self_keys[0].nbytes
    assert addresses["new_key.1"] == state.new_keys[0].data_ptr() + state.new_keys[0].nbytes
    # third step writes position 2, in every layer's 4 rows
    assert [c[3] for c in appends[-n_append:]] == [[2] * (4 * n_layers)] * n_append
    # a second decoding rebinds (new buffers)
    state2 = runner.encode(ids, lengths, cache_len=5)
    calls.clear()
    runner.step(state2, np.array([1, 1]))
    assert any(c[0] == "set_tensor_address" for c in calls)


def test_tensorscatter_binds_one_buffer_as_input_and_output(tiny_model):
    calls: list = []
    enc, dec = fake_engines(tiny_model, "tensorscatter", torch.device("cpu"), calls, static_cache=16)
    runner = TensorRTRunner(enc, dec, device="cpu")
    runner._kv_append = lambda *a: pytest.fail("the tensorscatter flavour must not append outside the engine")
    ids, lengths = _sources(B=2)
    state = runner.encode(ids, lengths, cache_len=4)
    assert state.cache_len == 16 and not state.new_keys  # the engine's static capacity
    runner.step(state, np.array([1, 1]))
    addresses = {c[2]: c[3] for c in calls if c[0] == "set_tensor_address"}
    for i in range(tiny_model.config.n_decoder_layers):
        assert addresses[f"present_key.{i}"] == addresses[f"self_key.{i}"] == state.self_keys[i].data_ptr()
        assert addresses[f"present_value.{i}"] == addresses[f"self_value.{i}"]
    with pytest.raises(ValueError, match="static cache capacity 16"):
        runner.encode(ids, lengths, cache_len=17)


def test_binding_plans():
    t = lambda *s: torch.zeros(s)  # noqa: E731
    cache = KVCache.allocate(1, 2, 1, 4, 2, dtype=torch.float32, device="cpu", staging=True)
    state = DeviceState(
        batch=1,
        beam_size=2,
        src_len=3,
        input_ids=t(2, 1),
        src_lengths=t(2),
        cache=cache,
        cross_keys=[t(2, 1, 3, 2)],
        cross_values=[t(2, 1, 3, 2)],
        logits=t(2, 5),
        logits_host=t(2, 5),
        tokens_host=t(2),
    )
    portable = decoder_bindings(state, "portable")
    assert sorted(portable) == sorted(
        [
            "input_ids",
            "positions",
            "src_lengths",
            "logits",
            "self_key.0",
            "self_value.0",
            "cross_key.0",
            "cross_value.0",
            "new_key.0",
            "new_value.0",
        ]
    )
    assert portable["new_key.0"] is state.new_keys[0]
    scatter = decoder_bindings(state, "tensorscatter")
    assert scatter["present_key.0"] is scatter["self_key.0"] is state.self_keys[0]
    assert "new_key.0" not in scatter
    enc = encoder_bindings(t(1, 3), t(1), t(1, 3, 2), [t(1)], [t(2)])
    assert sorted(enc) == ["cross_key.0", "cross_value.0", "encoder_out", "input_ids", "src_lengths"]
    with pytest.raises(ValueError):
        decoder_bindings(state, "merged")


def test_tensorrt_runner_checks_profile_limits(tiny_model):
    enc, dec = fake_engines(
        tiny_model, "portable", torch.device("cpu"), [], max_rows=4, max_src=12, cache=(2, 20)
    )
    runner = TensorRTRunner(enc, dec, max_positions=64, device="cpu")
    ids, lengths = _sources(B=2)
    with pytest.raises(ValueError, match="rows exceed"):
        runner.encode(ids, lengths, cache_len=5, beam_size=3)
    with pytest.raises(ValueError, match="--cache-len"):
        runner.encode(ids, lengths, cache_len=21)
    long_ids = np.ones((1, 13), np.int64)
    with pytest.raises(ValueError, match="profile's maximum 12"):
        runner.encode(long_ids, np.array([13]), cache_len=5)
    state = runner.encode(ids, lengths, cache_len=1)
    assert state.cache_len == 2  # rounded up to the profile's minimum capacity
    runner.step(state, np.array([1, 1]))
    runner.step(state, np.array([1, 1]))
    with pytest.raises(IndexError, match="position 2"):
        runner.step(state, np.array([1, 1]))


def test_tensorrt_runner_rejects_mismatched_engines(tiny_model):
    enc, _ = fake_engines(tiny_model, "portable", torch.device("cpu"), [], cache_dtype="float32")
    _, dec16 = fake_engines(tiny_model, "portable", torch.device("cpu"), [], cache_dtype="float16")
    with pytest.raises(BindingError, match="different precisions"):
        TensorRTRunner(enc, dec16, device="cpu")
    enc.io.pop("encoder_out")
    enc.names.remove("encoder_out")
    with pytest.raises(BindingError, match="lacks"):
        TensorRTRunner(enc, dec16, device="cpu")


def test_fp16_engines_get_fp16_buffers(tiny_model):
    calls: list = []
    enc, dec = fake_engines(tiny_model, "portable", torch.device("cpu"), calls, cache_dtype="float16")
    runner = TensorRTRunner(enc, dec, device="cpu")
    ids, lengths = _sources(B=1)
    state = runner.encode(ids, lengths, cache_len=4)
    assert state.self_keys[0].dtype == torch.float16 and state.cross_keys[0].dtype == torch.float16
    assert state.logits.dtype == torch.float32
    logits = runner.step(state, np.array([1]))
    assert logits.dtype == np.float32 and np.isfinite(logits).all()


# ------------------------------------------------------------------------------------------
# ONNX Runtime device runner (CUDA path; its bindings run on the CPU provider here)
# ------------------------------------------------------------------------------------------


def _ort_cuda_runner(folder, **kw):
    from transformer_ext.runtimes import OrtCudaRunner

    return OrtCudaRunner(folder, device="cpu", intra_op_num_threads=1, **kw)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_ort_device_runner_decodes_like_eager(exports, tiny_model, flavour):
    runner = _ort_cuda_runner(exports[flavour])
    ids, lengths = _sources(1)
    _assert_same_decodes(
        _decode_all(runner, ids, lengths), _decode_all(_eager(tiny_model, "cpu"), ids, lengths)
    )


def test_ort_device_runner_fp16_graphs(exports, tiny_model):
    r32 = _ort_cuda_runner(exports["portable"])
    r16 = _ort_cuda_runner(exports["portable"], precision="fp16")  # converted in memory
    assert r16.cache_dtype == torch.float16
    ids, lengths = _sources(2)
    s32, s16 = r32.encode(ids, lengths, 6), r16.encode(ids, lengths, 6)
    tokens = np.ones(3, np.int64)
    for _ in range(4):
        a, b = r32.step(s32, tokens), r16.step(s16, tokens)
        np.testing.assert_allclose(b, a, atol=3e-2)
        tokens = a.argmax(-1)


def test_ort_device_runner_converts_graphs_without_export(exports, monkeypatch):
    """The in-memory fp16 conversion is transformer_ext.precision's (the builder's too): a
    deployment without export/ runs it."""
    monkeypatch.setitem(sys.modules, "export", None)
    monkeypatch.setitem(sys.modules, "export.tensorrt", None)
    runner = _ort_cuda_runner(exports["portable"], precision="fp16")
    assert runner.cache_dtype == torch.float16
    ids, lengths = _sources(1)
    assert np.isfinite(runner.step(runner.encode(ids, lengths, 4), np.ones(len(ids), np.int64))).all()


class _RecordingSession:
    """A real ONNX Runtime session whose IO bindings record every call."""

    def __init__(self, session, log):
        self._s, self.log = session, log

    def __getattr__(self, name):
        return getattr(self._s, name)

    def io_binding(self):
        log, inner = self.log, self._s.io_binding()

        class Binding:
            def bind_input(self, *args):
                log.append(("bind_input", *args))
                inner.bind_input(*args)

            def bind_output(self, *args):
                log.append(("bind_output", *args))
                inner.bind_output(*args)

        b = Binding()
        b.inner = inner
        return b

    def run_with_iobinding(self, binding):
        self.log.append(("run",))
        self._s.run_with_iobinding(binding.inner)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_ort_device_runner_binds_device_buffers_once(exports, flavour):
    import onnxruntime as ort

    log: list = []

    def factory(src, options, providers):
        return _RecordingSession(ort.InferenceSession(src, sess_options=options, providers=providers), log)

    runner = _ort_cuda_runner(exports[flavour], session_factory=factory)
    ids, lengths = _sources(B=2)
    state = runner.encode(ids, lengths, 6, beam_size=2)
    log.clear()
    for _ in range(3):
        runner.step(state, np.array([1, 1, 4, 4]))
    binds = [c for c in log if c[0].startswith("bind")]
    assert len(binds) == len(runner.decoder_io) and [c for c in log if c[0] == "run"] == [("run",)] * 3
    by_name = {c[1]: c for c in binds}
    for c in binds:
        assert c[2:4] == ("cpu", 0)  # device_type, device_id (cuda on a GPU)
    assert by_name["self_key.0"][5] == [4, runner.info.n_heads, 6, runner.info.d_k]
    assert by_name["self_key.0"][6] == state.self_keys[0].data_ptr()
    assert by_name["input_ids"][4] is np.int64 and by_name["logits"][0] == "bind_output"
    if flavour == "tensorscatter":
        assert by_name["present_key.1"][0] == "bind_output"
        assert by_name["present_key.1"][6] == by_name["self_key.1"][6]
    else:
        assert by_name["new_key.1"][6] == state.new_keys[1].data_ptr()


def test_ort_device_runner_providers_use_the_runner_stream():
    from transformer_ext.runtimes import OrtCudaRunner

    fake = types.SimpleNamespace(device=torch.device("cuda", 1), stream_handle=123456)
    providers = OrtCudaRunner.provider_list(fake, {"arena_extend_strategy": "kSameAsRequested"})
    assert providers[0] == (
        "CUDAExecutionProvider",
        {"device_id": 1, "user_compute_stream": "123456", "arena_extend_strategy": "kSameAsRequested"},
    )
    assert OrtCudaRunner.provider_list(types.SimpleNamespace(device=torch.device("cpu"))) == [
        "CPUExecutionProvider"
    ]


# ------------------------------------------------------------------------------------------
# engine tests: TensorRT + a GPU
# ------------------------------------------------------------------------------------------


def _need_tensorrt_gpu():
    trt = pytest.importorskip("tensorrt", reason="TensorRT is not installed (pip install tensorrt-cu13)")
    from transformer_ext import ops

    if not ops.cuda_kernels_built():
        pytest.skip("transformer_ext was built without its CUDA kernels (TRANSFORMER_EXT_CUDA=1)")
    return trt


@pytest.mark.cuda
@needs_tensorrt_gpu
@pytest.mark.parametrize(
    "flavour, precision", [("portable", "fp32"), ("tensorscatter", "fp32"), ("portable", "fp16")]
)
def test_engines_decode_like_eager(exports, tiny_model, tmp_path, flavour, precision):
    _need_tensorrt_gpu()
    folder = _copy_export(exports[flavour], tmp_path / "e")
    ranges = {"batch": AxisRange(1, 8, 16), "cache_len": AxisRange(1, 16, 32)}
    trtb.build_engines(folder, trtb.BuildOptions(precision=precision, axis_ranges=ranges))
    runner = TensorRTRunner.from_export_dir(folder, precision, device="cuda")
    model = tiny_model.to("cuda")
    ids, lengths = _sources()
    try:
        eager = _eager(model, "cuda")
        s_trt, s_ref = runner.encode(ids, lengths, 12), eager.encode(ids, lengths, 12)
        tokens = np.ones(3, np.int64)
        tol = 1e-4 if precision == "fp32" else 3e-2
        for _ in range(8):
            a, b = runner.step(s_trt, tokens), eager.step(s_ref, tokens)
            np.testing.assert_allclose(a, b, atol=tol)
            tokens = b.argmax(-1)
        if precision == "fp32":
            _assert_same_decodes(_decode_all(runner, ids, lengths), _decode_all(eager, ids, lengths))
    finally:
        tiny_model.to("cpu")


@pytest.mark.cuda
@pytest.mark.skipif(
    not _has_ort_cuda(), reason="needs a CUDA GPU and onnxruntime-gpu (CUDAExecutionProvider)"
)
def test_ort_cuda_provider_decodes_like_eager(exports, tiny_model):
    from transformer_ext.runtimes import OrtCudaRunner

    runner = OrtCudaRunner(exports["portable"], device="cuda")
    ids, lengths = _sources()
    try:
        _assert_same_decodes(
            _decode_all(runner, ids, lengths),
            _decode_all(_eager(tiny_model.to("cuda"), "cuda"), ids, lengths),
        )
    finally:
        tiny_model.to("cpu")


def test_precisions_accumulate_in_one_manifest_and_engines_are_verified(exports, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt([]))
    out = tmp_path / "engines"
    for precision in ("fp32", "fp16"):
        trtb.build_engines(exports["portable"], trtb.BuildOptions(precision=precision, output_dir=out))
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(manifest["tensorrt"]["engines"]) == ["fp16", "fp32"]
    assert manifest["onnx_dir"] == os.path.relpath(exports["portable"], out)
    assert not (Path(exports["portable"]) / "encoder.fp32.engine").exists()  # the export folder is untouched
    with pytest.raises(FileNotFoundError, match="--precision bf16"):
        TensorRTRunner.from_export_dir(out, "bf16", device="cpu")
    (out / "decoder_step.fp16.engine").write_bytes(b"tampered")
    # the runner loads TensorRT through transformer_ext.tensorrt_support: nothing of export/
    monkeypatch.setitem(sys.modules, "export", None)
    monkeypatch.setitem(sys.modules, "export.tensorrt", None)
    with pytest.raises(RuntimeError, match="sha256"):
        TensorRTRunner.from_export_dir(out, "fp16", device="cpu")
