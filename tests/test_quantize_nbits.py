"""export.quantize's block-wise weight-only schemes (``--quantize int4`` and ``int8-nbits``:
com.microsoft ``MatMulNBits``): the graphs against a numpy dequantize-then-matmul oracle written
here, the manifest record, the quality gate on the demo model, the runners that load the folder,
bad input.

The oracle reads the quantized weights as ONNX Runtime's MatMulNBits contract documents them
(``B [N, K / block, block * bits / 8]`` uint8, 4-bit values two per byte, low nibble first;
``scales [N, K / block]``; ``zero_points`` packed the same way, ``2^(bits-1)`` when absent) and
multiplies in float64. The mechanics run on the tiny random-weight model (no gate: its tokenizer
cannot encode the demo task); the gate runs on the bundled demo model.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import DEMO_DIR, exported_dir, make_model_dir
from onnx import TensorProto, helper, numpy_helper

from export import quantize as quant
from export.onnx import export_onnx
from export.onnx import main as export_main
from export.quantize import QuantizationError, quantize_export
from transformer_ext.export_format import DECODER_FILE, ENCODER_FILE, manifest_quantization, read_manifest

SCHEMES = ["int4", "int8-nbits"]
BITS = {"int4": 4, "int8-nbits": 8}
GRAPHS = [ENCODER_FILE, DECODER_FILE]


@pytest.fixture(scope="module")
def tiny_float(tmp_path_factory) -> Path:
    return exported_dir(tmp_path_factory, "portable")


_MADE: dict = {}


def _quantized(tiny_float, tmp_path_factory, scheme: str, **options) -> Path:
    key = (scheme, tuple(sorted(options.items())))
    if key not in _MADE:
        out = tmp_path_factory.mktemp("nbits") / f"{scheme}"
        quantize_export(tiny_float, out, scheme, gate=False, options=options)
        _MADE[key] = out
    return _MADE[key]


# ------------------------------------------------------------------------------------------
# the oracle
# ------------------------------------------------------------------------------------------


def _unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """``count`` values per row of ``packed`` uint8 (two 4-bit values per byte, low nibble first)."""
    rows = packed.reshape(packed.shape[0], -1)
    if bits == 8:
        return rows[:, :count].astype(np.int64)
    values = np.empty((rows.shape[0], rows.shape[1] * 2), dtype=np.int64)
    values[:, 0::2] = rows & 0x0F
    values[:, 1::2] = rows >> 4
    return values[:, :count]


def _dequantized(node: onnx.NodeProto, inits: dict) -> np.ndarray:
    """The float64 ``[K, N]`` matrix a MatMulNBits node multiplies by, from its stored bytes."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    k, n, bits, block = attrs["K"], attrs["N"], attrs["bits"], attrs["block_size"]
    blocks = k // block
    q = _unpack(numpy_helper.to_array(inits[node.input[1]]), bits, k).reshape(n, blocks, block)
    scales = numpy_helper.to_array(inits[node.input[2]]).astype(np.float64).reshape(n, blocks)
    if len(node.input) > 3 and node.input[3]:
        zero = _unpack(numpy_helper.to_array(inits[node.input[3]]), bits, blocks)
    else:
        zero = np.full((n, blocks), 1 << (bits - 1))
    return ((q - zero[..., None]) * scales[..., None]).reshape(n, k).T


def _run_node(node: onnx.NodeProto, inits: dict, a: np.ndarray) -> np.ndarray:
    """The node alone, with its initializers, in ONNX Runtime."""
    k = helper.get_attribute_value(next(x for x in node.attribute if x.name == "K"))
    n = helper.get_attribute_value(next(x for x in node.attribute if x.name == "N"))
    alone = helper.make_node(
        "MatMulNBits", ["A", *node.input[1:]], ["Y"], domain="com.microsoft", name="alone"
    )
    alone.attribute.extend(node.attribute)
    graph = helper.make_graph(
        [alone],
        "alone",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [None, k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, n])],
        [inits[name] for name in node.input[1:] if name],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"A": a})[0]


def _bound(a: np.ndarray, deq: np.ndarray, accuracy_level: int) -> np.ndarray:
    """The largest difference float32 arithmetic (and, at accuracy_level 4, int8 activations)
    can make from the float64 product: float32 rounding of K-term sums, plus for int8
    activations half a quantization step of the row's absolute maximum / 127 per term (a bound
    for any per-block scale, which is never larger)."""
    k = a.shape[1]
    magnitude = np.abs(a).astype(np.float64) @ np.abs(deq)
    bound = 4 * k * np.finfo(np.float32).eps * magnitude + 1e-6
    if accuracy_level == 4:
        step = np.abs(a).max(axis=1, keepdims=True).astype(np.float64) / 127.0
        bound = bound + 1.01 * (step / 2) * np.abs(deq).sum(axis=0, keepdims=True)
    return bound


def _nodes(folder: Path, graph: str):
    model = onnx.load(folder / graph)
    return model, {t.name: t for t in model.graph.initializer}


# ------------------------------------------------------------------------------------------
# the graphs against the oracle
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("accuracy_level", [1, 4])
@pytest.mark.parametrize("graph", GRAPHS)
def test_every_matmulnbits_matches_a_numpy_dequantize_then_matmul_oracle(
    tiny_float, tmp_path_factory, scheme, accuracy_level, graph
):
    folder = _quantized(tiny_float, tmp_path_factory, scheme, accuracy_level=accuracy_level)
    q = manifest_quantization(read_manifest(folder))
    model, inits = _nodes(folder, graph)
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert nodes and all(n.domain == "com.microsoft" for n in nodes)
    rng = np.random.default_rng(7)
    int8_moved = []
    for node in nodes:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        # the tied output projection reads the 8-bit lookup table's bytes (tests/test_export_weights.py)
        tied = ".product.q" in node.input[1]
        assert attrs["bits"] == (q["lookups"]["bits"] if tied else BITS[scheme]) and BITS[scheme] == q["bits"]
        assert attrs["block_size"] == q["block_size"] == 32 and attrs["accuracy_level"] == accuracy_level
        deq = _dequantized(node, inits)
        a = rng.standard_normal((5, attrs["K"])).astype(np.float32)  # 5 rows: not an export shape
        ref = a.astype(np.float64) @ deq
        got = _run_node(node, inits, a).astype(np.float64)
        assert np.all(np.abs(got - ref) <= _bound(a, deq, accuracy_level)), node.name
        float_bound = _bound(a, deq, 1)
        int8_moved.append(bool(np.any(np.abs(got - ref) > float_bound)))
    # what the manifest says the kernel computes in is what it did: int8 activations move the
    # results beyond float32 rounding, float32 compute never does
    assert any(int8_moved) == (q["kernel_compute"] == "int8")
    if accuracy_level == 1:
        assert q["kernel_compute"] == "float32"


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("graph", GRAPHS)
def test_every_weight_product_is_quantized_close_to_its_float32_weight(
    tiny_float, tmp_path_factory, scheme, graph
):
    """Each float32 weight product became a MatMulNBits whose dequantized weight is within the
    per-block error of plain rounding to nearest over the block's full range (computed here),
    the output projection included (8-bit, on the bytes of the 8-bit tied embedding lookup)."""
    folder = _quantized(tiny_float, tmp_path_factory, scheme)
    bits = BITS[scheme]
    before, init_before = _nodes(tiny_float, graph)
    after, init_after = _nodes(folder, graph)
    products = {
        n.name: n for n in before.graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in init_before
    }
    assert products
    left = [n.name for n in after.graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in init_after]
    assert not left
    quantized = [n for n in after.graph.node if n.op_type == "MatMulNBits"]
    lookup_bits = read_manifest(folder)["quantization"]["lookups"]["bits"]

    def node_bits(node) -> int:  # the tied output projection: the 8-bit lookup table's bytes
        return lookup_bits if ".product.q" in node.input[1] else BITS[scheme]

    assert sorted(n.name for n in quantized) == sorted(
        f"{name}_Q{lookup_bits if n.input[1].endswith('.product') else bits}" for name, n in products.items()
    )
    for node in quantized:
        bits = node_bits(node)
        original = products[node.name[: -len(f"_Q{bits}")]]
        w = numpy_helper.to_array(init_before[original.input[1]]).astype(np.float64)
        trans_b = any(a.name == "transB" and a.i == 1 for a in original.attribute)
        w = w.T if trans_b else w  # [K, N]
        deq = _dequantized(node, init_after)
        assert deq.shape == w.shape
        # plain rounding to nearest over [min(v, 0), max(v, 0)] of each block, in float64
        block = 32
        k, n = w.shape
        v = w.T.reshape(n, k // block, block)
        low, high = np.minimum(v.min(axis=2), 0), np.maximum(v.max(axis=2), 0)
        scale = np.where(high > low, (high - low) / (2**bits - 1), 1.0)
        zero = np.clip(np.round(-low / scale), 0, 2**bits - 1)
        rtn = (
            np.clip(np.round(v / scale[..., None]) + zero[..., None], 0, 2**bits - 1) - zero[..., None]
        ) * (scale[..., None])
        ours = deq.T.reshape(n, k // block, block)
        err_ours = np.square(ours - v).sum(axis=2)
        err_rtn = np.square(rtn - v).sum(axis=2)
        assert np.all(err_ours <= err_rtn * (1 + 1e-4) + 1e-12), node.name
    if graph == DECODER_FILE:
        cfg = read_manifest(folder)["model_config"]
        shapes = set()
        for node in quantized:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            shapes.add((attrs["K"], attrs["N"]))
        assert (cfg["d_model"], cfg["tgt_vocab_size"]) in shapes  # the output projection (K, N)
        # the tied embedding lookup: an 8-bit table, one byte per weight
        gathers = [
            n for n in after.graph.node if n.op_type == "GatherBlockQuantized" and n.input[0] in init_after
        ]
        table = init_after[gathers[0].input[0]]
        assert table.data_type == TensorProto.UINT8
        assert list(table.dims) == [cfg["tgt_vocab_size"], cfg["d_model"]]


def test_gemm_with_bias_and_both_weight_layouts(tmp_path):
    """A Gemm with transB = 1 and a bias, a Gemm with transB = 0 and a MatMul sharing one weight:
    each becomes a MatMulNBits (the shared weight quantized once), equal to the oracle plus bias."""
    rng = np.random.default_rng(3)
    k, n = 64, 24
    w_nk = rng.standard_normal((n, k)).astype(np.float32)
    w_kn = rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    nodes = [
        helper.make_node("Gemm", ["x", "w_nk", "bias"], ["y0"], name="g0", transB=1),
        helper.make_node("Gemm", ["x", "w_kn"], ["y1"], name="g1"),
        helper.make_node("MatMul", ["x", "w_kn"], ["y2"], name="m2"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
        [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [None, n]) for i in range(3)],
        [
            numpy_helper.from_array(w_nk, "w_nk"),
            numpy_helper.from_array(w_kn, "w_kn"),
            numpy_helper.from_array(bias, "bias"),
        ],
    )
    src, dst = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), src)
    settings = quant.resolve_settings("int4", {"accuracy_level": 1, "block_size": 16})
    record = quant._quantize_nbits_one(src, dst, settings)
    assert record["quantized_nodes"] == 3 and record["quantized_weights"] == 2
    model = onnx.load(dst)
    inits = {t.name: t for t in model.graph.initializer}
    assert {"w_nk", "w_kn"}.isdisjoint(inits)  # the float32 weights are gone
    x = rng.standard_normal((3, k)).astype(np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    outs = session.run(None, {"x": x})
    by_output = {nd.output[0]: nd for nd in model.graph.node}
    for i, extra in ((0, bias), (1, 0.0), (2, 0.0)):
        deq = _dequantized(by_output[f"y{i}"], inits)
        ref = x.astype(np.float64) @ deq + extra
        assert np.all(np.abs(outs[i] - ref) <= _bound(x, deq, 1) + 1e-5)
    # and close to the float32 products (4-bit error, not garbage)
    assert np.abs(outs[0] - (x @ w_nk.T + bias)).max() < 0.15 * np.abs(x @ w_nk.T).max()


# ------------------------------------------------------------------------------------------
# the folder, its manifest, the runners
# ------------------------------------------------------------------------------------------


def _cpu_flags() -> set:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return set()
    return {
        f
        for line in text.splitlines()
        if line.lower().startswith(("flags", "features"))
        for f in line.split(":", 1)[1].split()
    }


@pytest.mark.parametrize("scheme", SCHEMES)
def test_manifest_records_what_was_chosen(tiny_float, tmp_path_factory, scheme):
    folder = _quantized(tiny_float, tmp_path_factory, scheme)
    manifest = read_manifest(folder)
    assert sorted(os.listdir(folder)) == sorted(os.listdir(tiny_float)) == sorted(manifest["files"])
    assert manifest["graphs"] == read_manifest(tiny_float)["graphs"]
    q = manifest_quantization(manifest)
    assert q["scheme"] == scheme and q["bits"] == BITS[scheme]
    assert q["block_size"] == 32 and q["accuracy_level"] == 4 and q["symmetric"] is False
    assert q["onnxruntime"] == ort.__version__ and q["gate"] is None
    assert q["kernel_compute"] in ("int8", "float32")
    flags = _cpu_flags()
    for flag in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "asimddp"):
        assert (flag in q["cpu"]["isa"]) == (flag in flags), flag
    for name in ("encoder", "decoder_step"):
        counts = q["graphs"][name]["op_counts"]
        assert counts.get("MatMulNBits") == q["graphs"][name]["quantized_nodes"] > 0
        assert "MatMulInteger" not in counts


def test_options_are_recorded(tiny_float, tmp_path_factory):
    folder = _quantized(tiny_float, tmp_path_factory, "int4", block_size=16, symmetric=True, accuracy_level=0)
    q = manifest_quantization(read_manifest(folder))
    assert (q["block_size"], q["symmetric"], q["accuracy_level"], q["kernel_compute"]) == (
        16,
        True,
        0,
        "float32",
    )
    model, inits = _nodes(folder, DECODER_FILE)
    for node in (n for n in model.graph.node if n.op_type == "MatMulNBits"):
        assert len([i for i in node.input if i]) == 3  # symmetric: no zero points
        assert helper.get_attribute_value(next(a for a in node.attribute if a.name == "block_size")) == 16


@pytest.mark.parametrize("scheme", SCHEMES)
def test_ort_runner_and_translator_load_it(tiny_float, tmp_path_factory, scheme):
    """OrtRunner and Translator.from_export_dir load the folder unchanged; its first-step logits
    stay near the float32 ones (quantization error, not garbage)."""
    from transformer_ext.runtimes import OrtRunner
    from transformer_ext.translate import Translator

    folder = _quantized(tiny_float, tmp_path_factory, scheme)
    f32, qnt = OrtRunner(tiny_float, intra_op_num_threads=1), OrtRunner(folder, intra_op_num_threads=1)
    rng = np.random.default_rng(0)
    ids = rng.integers(4, f32.info.src_vocab_size, size=(3, 7))
    lengths = np.array([7, 5, 2])
    tokens = np.full(3, f32.info.bos_id)
    a = np.asarray(f32.step(f32.encode(ids, lengths, cache_len=8, beam_size=1), tokens))
    b = np.asarray(qnt.step(qnt.encode(ids, lengths, cache_len=8, beam_size=1), tokens))
    assert not np.array_equal(a, b)
    assert np.abs(a - b).max() <= (0.15 if scheme == "int4" else 0.05) * (a.max() - a.min())
    assert len(Translator.from_export_dir(folder).translate(["abc", "de f"], beam_size=2)) == 2


def test_triton_onnxruntime_repository_of_an_int4_export(tiny_float, tmp_path_factory, tmp_path):
    pytest.importorskip("tritonclient.grpc.model_config_pb2")
    from export.triton import export_triton, validate_repository

    folder = _quantized(tiny_float, tmp_path_factory, "int4")
    result = export_triton(folder, tmp_path / "repo", backend="onnxruntime", instance_kind="cpu")
    assert validate_repository(result.repo_dir, require_protobuf=True) is True
    copied = list(Path(result.repo_dir).rglob("*.onnx"))
    assert any(any(n.op_type == "MatMulNBits" for n in onnx.load(p).graph.node) for p in copied)


def test_tensorrt_refuses_int4(tiny_float, tmp_path_factory):
    from export.trt_readiness import TensorRTReadinessError, check_export_dir

    with pytest.raises(TensorRTReadinessError, match="for ONNX Runtime"):
        check_export_dir(_quantized(tiny_float, tmp_path_factory, "int4"))


# ------------------------------------------------------------------------------------------
# the quality gate on the demo model
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_float(tmp_path_factory) -> Path:
    if not (DEMO_DIR / "model.safetensors").is_file():
        pytest.skip("the bundled demo model is not in this checkout")
    out = tmp_path_factory.mktemp("demo") / "float32"
    export_onnx(DEMO_DIR, out, validate=False)
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
def test_demo_gate_passes_and_matches_an_independent_count(demo_float, tmp_path, scheme):
    """The default settings pass the demo's exact-match gate; the recorded exact match equals a
    count made here from the translator's texts against data.target_text."""
    from transformer_ext import data
    from transformer_ext.translate import Translator

    out = tmp_path / scheme
    quantize_export(demo_float, out, scheme)
    label = "int4" if scheme == "int4" else "int8"
    gate = manifest_quantization(read_manifest(out))["gate"]
    numbers = data.split_numbers().heldout
    assert gate["examples"] == len(numbers) and gate["max_drop_points"] == 0.2
    assert gate["exact_match_float32"] - gate[f"exact_match_{label}"] <= 0.2
    outputs = Translator.from_export_dir(out).translate([data.source_text(n) for n in numbers], beam_size=1)
    hits = sum(text == data.target_text(n) for text, n in zip(outputs, numbers, strict=True))
    assert 100.0 * hits / len(numbers) == pytest.approx(gate[f"exact_match_{label}"], abs=1e-3)
    assert gate[f"exact_match_{label}"] >= 95.0


def test_int4_bleu_gate_defaults_to_one_point(tiny_float, tmp_path, monkeypatch):
    import transformer_ext.evaluate as evaluate

    src, ref = tmp_path / "g.src", tmp_path / "g.ref"
    src.write_text("abc\nde f\n", encoding="utf-8")
    ref.write_text("x\ny\n", encoding="utf-8")
    scores = iter([30.0, 29.1, 30.0, 28.9])  # float32 first, then int4; twice
    monkeypatch.setattr(evaluate, "score_texts", lambda h, r: {"bleu": next(scores), "bleu_signature": "sig"})
    ok = tmp_path / "ok"
    quantize_export(tiny_float, ok, "int4", gate_data=quant.GateData(src, ref))
    gate = manifest_quantization(read_manifest(ok))["gate"]
    assert gate["bleu_int4"] == 29.1 and gate["max_drop_points"] == 1.0
    with pytest.raises(quant.QualityGateError, match=r"int4 graphs fail the BLEU gate.*1.10 points lower"):
        quantize_export(tiny_float, tmp_path / "bad", "int4", gate_data=quant.GateData(src, ref))
    assert not (tmp_path / "bad").exists()


# ------------------------------------------------------------------------------------------
# bad input: one line, nothing written
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, fragment",
    [
        ({"block_size": 8}, "--quant-block-size must be one of"),
        ({"block_size": 24}, "--quant-block-size must be one of"),
        ({"block_size": 512}, "--quant-block-size must be one of"),
        ({"block_size": "32"}, "--quant-block-size must be one of"),
        ({"block_size": True}, "--quant-block-size must be one of"),
        ({"accuracy_level": 5}, "--quant-accuracy-level must be one of"),
        ({"accuracy_level": -1}, "--quant-accuracy-level must be one of"),
        ({"accuracy_level": 1.0}, "--quant-accuracy-level must be one of"),
        ({"symmetric": "yes"}, "--quant-symmetric must be true or false"),
        ({"bits": 3}, "unknown quantization option"),
    ],
)
def test_options_out_of_range_before_the_disk(tiny_float, tmp_path, options, fragment):
    with pytest.raises(QuantizationError, match=fragment):
        quantize_export(tiny_float, tmp_path / "out", "int4", gate=False, options=options)
    assert not (tmp_path / "out").exists()


def test_block_options_with_dynamic_int8_are_refused(tiny_float, tmp_path):
    with pytest.raises(QuantizationError, match="--quant-block-size set the blocks of a MatMulNBits scheme"):
        quantize_export(tiny_float, tmp_path / "out", "int8", gate=False, options={"block_size": 32})
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "d_model, d_ff, preferred, expected",
    [
        (512, 2048, 128, 128),  # base, opus-mt
        (1024, 4096, 128, 128),  # NLLB-600M
        (64, 256, 128, 32),  # the demo model: 64 would fit, the narrow size is 32
        (32, 64, 128, 32),  # the tiny test model
        (96, 384, 128, 32),
        (48, 96, 128, 16),
        (512, 2048, 32, 32),  # the preferred size when it fits
        (40, 160, 128, 128),  # nothing fits: check_block_dimensions names the matrices
    ],
)
def test_default_block_size_is_the_preferred_or_a_narrow_one(d_model, d_ff, preferred, expected):
    config = {"d_model": d_model, "d_ff": d_ff}
    assert quant.default_block_size(config, preferred) == expected


def test_a_given_block_size_is_kept_and_a_default_one_fits_the_model():
    config = {"d_model": 64, "d_ff": 256}
    default = quant.SCHEMES["int4"]["block_size"]
    assert quant.resolve_settings("int4", {}, config)["block_size"] == quant.NARROW_BLOCK_SIZE
    assert quant.resolve_settings("int4", {"block_size": 16}, config)["block_size"] == 16
    assert quant.resolve_settings("int4", {})["block_size"] == default  # no model: the scheme's size
    with pytest.raises(QuantizationError, match="128 does not divide d_model = 64"):
        quant.check_quantize_arguments("int4", {"block_size": 128}, model_config=config)


def test_int4_export_of_a_model_wide_enough_takes_blocks_of_128(tmp_path):
    """The scheme's default block size reaches the graphs: every MatMulNBits of a d_model 128
    model has block_size 128, and the manifest says so."""
    model_dir = make_model_dir(tmp_path / "model", d_model=128, d_ff=256)
    export_onnx(model_dir, tmp_path / "out", quantize="int4", validate=False)
    q = manifest_quantization(read_manifest(tmp_path / "out"))
    assert q["block_size"] == 128 and "blocks of 128 weights" in q["weights"]
    sizes = {
        helper.get_attribute_value(a)
        for name in GRAPHS
        for n in onnx.load(tmp_path / "out" / name).graph.node
        if n.op_type == "MatMulNBits"
        for a in n.attribute
        if a.name == "block_size"
    }
    assert sizes == {128}


def test_block_size_that_does_not_divide_d_model_names_the_matrices(tiny_float, tmp_path):
    # the tiny model: d_model 32
    with pytest.raises(
        QuantizationError, match=r"64 does not divide d_model = 32.*output projection"
    ) as info:
        quantize_export(tiny_float, tmp_path / "out", "int4", gate=False, options={"block_size": 64})
    assert "block sizes that fit this model: [16, 32]" in str(info.value)
    assert not (tmp_path / "out").exists()
    assert os.listdir(tmp_path) == []


def test_export_refuses_a_block_size_that_does_not_divide_d_ff_before_tracing(tmp_path, monkeypatch):
    from export import onnx as export_mod

    model_dir = make_model_dir(tmp_path / "model", d_ff=48)  # d_model 32, d_ff 48
    monkeypatch.setattr(export_mod, "_write_export", lambda *a, **k: pytest.fail("traced"))
    with pytest.raises(QuantizationError, match=r"32 does not divide d_ff = 48.*second feed-forward matrix"):
        export_onnx(model_dir, tmp_path / "out", quantize="int4", quantize_options={"block_size": 32})
    with pytest.raises(QuantizationError, match=r"block sizes that fit this model: \[16\]"):
        export_onnx(model_dir, tmp_path / "out", quantize="int8-nbits", quantize_options={"block_size": 32})
    assert sorted(os.listdir(tmp_path)) == ["model"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_already_quantized_folder_is_refused(tiny_float, tmp_path_factory, tmp_path, scheme):
    folder = _quantized(tiny_float, tmp_path_factory, scheme)
    for again in ("int8", "int4"):
        with pytest.raises(QuantizationError, match=f"already quantized \\({scheme}\\)"):
            quantize_export(folder, tmp_path / "twice", again, gate=False)
    assert not (tmp_path / "twice").exists()


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--quantize", "int4", "--quant-block-size", "24"], "--quant-block-size must be one of"),
        (["--quantize", "int4", "--quant-accuracy-level", "7"], "--quant-accuracy-level must be one of"),
        (["--quantize", "int8", "--quant-block-size", "32"], "set the blocks of a MatMulNBits scheme"),
        (["--quant-block-size", "32"], "they need --quantize int4 or int8-nbits"),
        (["--quantize", "int4", "--max-bleu-drop", "-1"], "max_bleu_drop must be a finite number >= 0"),
        (["--quantize", "int3"], "unknown quantization scheme 'int3'"),
    ],
)
def test_export_cli_bad_options_are_one_line_and_write_nothing(tmp_path, capsys, argv, fragment):
    out = tmp_path / "out"
    assert export_main([*argv, "--output-dir", str(out)]) == 2  # usage errors
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err
    assert not out.exists()


def test_quantize_cli_int4(tiny_float, tmp_path, capsys):
    out = tmp_path / "o"
    argv = ["--model", str(tiny_float), "--output-dir", str(out), "--no-validate", "--scheme", "int4"]
    assert quant.main([*argv, "--quant-block-size", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not divide d_model = 32" in err[0]
    assert not out.exists()
    assert quant.main([*argv, "--quant-block-size", "16", "--quant-symmetric"]) == 0
    text = capsys.readouterr().out
    assert "int4: 4-bit weights, MatMulNBits, block size 16" in text and "symmetric" in text
    q = manifest_quantization(read_manifest(out))
    assert (q["scheme"], q["block_size"], q["symmetric"]) == ("int4", 16, True)
    shutil.rmtree(out)


def test_a_cpu_without_the_exporting_cpus_kernels_gets_a_warning(
    tiny_float, tmp_path_factory, monkeypatch, caplog
):
    """Loaded on a CPU that lacks kernel-deciding flags the exporting CPU had (here: one with
    AVX2 only), the runner says which and still runs (ONNX Runtime falls back itself); on the
    exporting CPU, or for a float32 export, it says nothing."""
    import logging

    from transformer_ext import cpu_features
    from transformer_ext.cpu_features import CpuFlags
    from transformer_ext.export_format import quantization_cpu_warning
    from transformer_ext.runtimes import OrtRunner

    folder = _quantized(tiny_float, tmp_path_factory, "int4")
    manifest = read_manifest(folder)
    assert quantization_cpu_warning(manifest, folder) is None  # the CPU it was made on
    assert quantization_cpu_warning(read_manifest(tiny_float)) is None
    edited = dict(manifest, quantization=dict(manifest["quantization"]))
    edited["quantization"]["cpu"] = dict(
        edited["quantization"]["cpu"], isa=["avx2", "avx512f", "avx512_vnni"]
    )
    avx2_only = CpuFlags("x86", "an AVX2 CPU", frozenset({"avx2", "fma"}), "test")
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: avx2_only)
    message = quantization_cpu_warning(edited, "E")
    assert message.startswith(
        "E: its int4 graphs were exported and gated on a CPU with avx512f, avx512_vnni,"
    )
    assert "an AVX2 CPU" in message and "float32 where no int8 kernel exists" in message
    if "avx512f" in manifest["quantization"]["cpu"]["isa"]:  # this machine's export, read on the AVX2 CPU
        with caplog.at_level(logging.WARNING, logger="transformer_ext.runtimes.ort"):
            runner = OrtRunner(folder, intra_op_num_threads=1)
        assert any("avx512f" in r.getMessage() and "lacks" in r.getMessage() for r in caplog.records)
        assert runner.greedy(np.array([[5, 6, 7]]), np.array([3]), max_decoding_length=3)


# ------------------------------------------------------------------------------------------
# int4's embedding tables: 4 or 8 bits
# ------------------------------------------------------------------------------------------


def _torch_table_share(config) -> float:
    """The tables' share of the weights of the model built from ``config``, counted from its
    parameters: the lookup tables' elements over those of every weight matrix (2-D parameters,
    each tensor once: a tied projection is its table)."""
    import torch

    from transformer_ext.model import Transformer

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(config)
    seen, tables, weights = set(), 0, 0
    for name, p in model.named_parameters(remove_duplicate=True):
        if p.dim() != 2 or id(p) in seen:
            continue
        seen.add(id(p))
        weights += p.numel()
        if "embed" in name:
            tables += p.numel()
    return tables / weights


@pytest.mark.parametrize(
    "overrides, bits",
    [
        # opus-mt-en-de's dimensions: one 58,101-row table, 6+6 layers of 512
        (dict(src_vocab_size=58101, tgt_vocab_size=58101, shared_vocab=True), 4),
        (dict(), 8),  # base: two 8,000-row tables
        (dict(src_vocab_size=26, tgt_vocab_size=25, d_model=64, d_ff=256, n_heads=4), 8),  # the demo's shape
    ],
)
def test_int4_table_bits_follow_the_tables_share_of_the_weights(overrides, bits):
    from transformer_ext.config import TransformerConfig

    config = TransformerConfig.preset("base", **overrides)
    share = quant.table_share(config.to_dict())
    assert share == pytest.approx(_torch_table_share(config), rel=0.02)
    assert quant.default_table_bits(config.to_dict()) == bits
    assert quant.resolve_settings("int4", None, config.to_dict())["table_bits"] == bits
    assert quant.resolve_settings("int4", {"table_bits": 8}, config.to_dict())["table_bits"] == 8


def test_4_bit_tables_are_the_projections_bytes_and_match_the_oracle(tiny_float, tmp_path_factory):
    """``table_bits`` 4: the lookup (GatherBlockQuantized, bits 4) and the tied output projection
    (MatMulNBits, 4 bits) read one region; the rows ONNX Runtime looks up are the oracle's
    dequantized matrix of that projection, within a quantization step of the float32 table."""
    from safetensors.numpy import load_file

    folder = _quantized(tiny_float, tmp_path_factory, "int4", table_bits=4)
    section = manifest_quantization(read_manifest(folder, verify=True))
    assert section["table_bits"] == 4 and section["lookups"]["bits"] == 4
    block = section["lookups"]["block_size"]
    tensors = section["graphs"]["decoder_step"]["tensors"]
    assert tensors["model.generator.proj.weight"] == f"GatherBlockQuantized 4-bit, blocks of {block}"
    assert tensors["model.generator.proj.weight.product"] == f"MatMulNBits 4-bit, blocks of {block}"
    assert section["graphs"]["encoder"]["tensors"]["model.src_embed.lut.weight"].startswith(
        "GatherBlockQuantized 4-bit"
    )

    model, inits = _nodes(folder, DECODER_FILE)
    (gather,) = [n for n in model.graph.node if n.op_type == "GatherBlockQuantized"]
    assert {a.name: helper.get_attribute_value(a) for a in gather.attribute}["bits"] == 4
    rows = list(inits[gather.input[0]].dims)[0]
    (tied,) = [
        n for n in model.graph.node if n.op_type == "MatMulNBits" and list(inits[n.input[1]].dims)[0] == rows
    ]
    assert (
        numpy_helper.to_array(inits[tied.input[1]]).tobytes()
        == numpy_helper.to_array(inits[gather.input[0]]).tobytes()
    )
    raw = onnx.load(folder / DECODER_FILE, load_external_data=False)
    where = {
        t.name: tuple((e.key, e.value) for e in t.external_data)
        for t in raw.graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
    }
    assert where.get(tied.input[1]) == where.get(gather.input[0])  # one region (or both inside: small)

    alone = helper.make_node(
        "GatherBlockQuantized", [gather.input[0], "ids", *gather.input[2:]], ["rows"], domain="com.microsoft"
    )
    alone.attribute.extend(gather.attribute)
    graph = helper.make_graph(
        [alone],
        "alone",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [None])],
        [helper.make_tensor_value_info("rows", TensorProto.FLOAT, [None, None])],
        [inits[name] for name in (gather.input[0], *gather.input[2:]) if name],
    )
    session = ort.InferenceSession(
        helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
        ).SerializeToString(),
        providers=["CPUExecutionProvider"],
    )
    looked_up = session.run(None, {"ids": np.arange(rows, dtype=np.int64)})[0]
    oracle = _dequantized(tied, inits).T  # [rows, d_model]
    assert np.allclose(looked_up, oracle, rtol=0, atol=1e-6)
    weights = load_file(tiny_float.parent / "tiny_model" / "model.safetensors")
    (table,) = {  # the target table (the tied projection), stored once under one of its names
        v.tobytes(): v for k, v in weights.items() if "tgt_embed" in k or "generator" in k
    }.values()
    steps = numpy_helper.to_array(inits[tied.input[2]]).reshape(rows, -1).repeat(block, axis=1)
    assert (np.abs(oracle - table) <= steps + 1e-7).all()


@pytest.mark.parametrize(
    "scheme, options, fragment",
    [
        ("int4", {"table_bits": 5}, "--quant-table-bits must be one of"),
        ("int4", {"table_bits": True}, "--quant-table-bits must be one of"),
        ("int8", {"table_bits": 4}, "--quant-table-bits applies to --quantize int4"),
        ("int8-nbits", {"table_bits": 4}, "--quant-table-bits applies to --quantize int4"),
    ],
)
def test_table_bits_out_of_range_or_for_another_scheme(tiny_float, tmp_path, scheme, options, fragment):
    with pytest.raises(QuantizationError, match=fragment):
        quantize_export(tiny_float, tmp_path / "out", scheme, gate=False, options=options)
    assert not (tmp_path / "out").exists()


def test_a_gate_failed_with_4_bit_tables_names_the_flag_that_keeps_8(tiny_float, tmp_path, monkeypatch):
    """The gate's verdict as it is, with 4-bit tables the flag that keeps them at 8 bits added."""
    calls = []

    def gate(float_dir, q_dir, max_em_drop, *, scheme, few_rows, search=None):
        calls.append(scheme)
        raise quant.QualityGateError("the int4 graphs fail the quality gate: exact match 50.00% vs 100.00%")

    monkeypatch.setattr(quant, "quality_gate", gate)
    with pytest.raises(quant.QualityGateError, match="tables were 4-bit: --quant-table-bits 8 keeps them"):
        quantize_export(tiny_float, tmp_path / "t4", "int4", options={"table_bits": 4})
    with pytest.raises(quant.QualityGateError) as exc:
        quantize_export(tiny_float, tmp_path / "t8", "int4", options={"table_bits": 8})
    assert "--quant-table-bits" not in str(exc.value) and calls == ["int4", "int4"]
    assert not (tmp_path / "t4").exists() and not (tmp_path / "t8").exists()
