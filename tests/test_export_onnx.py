"""export.onnx: the graphs of docs/DESIGN.md section 3, their validation, the atomic output folder, the CLI.

Tiny random-weight models (``TransformerConfig.preset("tiny")``) are exported once per flavour
per session (``exported``); tests that only need the export machinery around the tracing
replace the tracing by a copy of those graphs (``fast_export``) so that they take milliseconds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from helpers import DEMO_DIR, FLAVOURS, TOLERANCE, exported_dir, make_model_dir

from export import ExportError, GraphContractError, ModelDirectoryError, ParityError
from export import validate as validation
from export.onnx import IR_VERSION, export_onnx, main
from transformer_ext.checkpoint import load_model
from transformer_ext.config import TransformerConfig
from transformer_ext.export_format import DECODER_FILE, ENCODER_FILE, MANIFEST_NAME, WEIGHTS_FILE, graph_specs
from transformer_ext.model import Transformer

# ------------------------------------------------------------------------------------------
# fixtures (exported_portable, fast_export: conftest.py)
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="session", params=FLAVOURS)
def exported(request, tmp_path_factory) -> Path:
    return exported_dir(tmp_path_factory, request.param)


def load_graphs(directory: Path) -> tuple[onnx.ModelProto, onnx.ModelProto, dict]:
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    return onnx.load(directory / ENCODER_FILE), onnx.load(directory / DECODER_FILE), manifest


def axes(value: onnx.ValueInfoProto) -> list:
    return [d.dim_param if d.HasField("dim_param") else d.dim_value for d in value.type.tensor_type.shape.dim]


# ------------------------------------------------------------------------------------------
# the graphs
# ------------------------------------------------------------------------------------------


def test_folder_and_manifest(exported):
    encoder, decoder, manifest = load_graphs(exported)
    flavour = manifest["flavour"]
    assert sorted(os.listdir(exported)) == sorted(
        [ENCODER_FILE, DECODER_FILE, MANIFEST_NAME, "tokenizer.json", "generation.json", WEIGHTS_FILE]
    )
    assert not [p for p in exported.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    config = TransformerConfig.from_dict(manifest["model_config"])
    assert config == TransformerConfig.preset("tiny", dropout=0.0)
    assert manifest["opset"] == {"portable": 18, "tensorscatter": 24, "ort": 18}[flavour]
    assert manifest["ir_version"] == IR_VERSION
    assert manifest["special_tokens"] == {"pad": 0, "bos": 1, "eos": 2, "unk": 3}
    assert (manifest["format"], manifest["format_version"]) == ("transformer_ext.onnx_export", 4)
    assert manifest["files"] == sorted(os.listdir(exported))  # every file of the folder, the manifest too
    assert manifest["tokenizer_files"] == ["tokenizer.json"]
    assert manifest["generation_config"] == "generation.json"
    # the defaults of the translator, the model's special ids, the export's cache capacity
    assert json.loads((exported / "generation.json").read_text()) == {
        "format": "transformer_ext.generation_config",
        "format_version": 1,
        "beam_size": 1,
        "length_penalty": "gnmt",
        "alpha": 0.6,
        "max_len_a": 1.5,
        "max_len_b": 10.0,
        "min_new_tokens": 0,
        "max_new_tokens": config.max_len,
        "special_tokens": {"pad": 0, "bos": 1, "eos": 2, "unk": 3},
    }
    assert manifest["max_positions"] == config.max_len == manifest["max_cache_len"]
    assert manifest["graphs"] == graph_specs(config.to_dict(), flavour)
    assert set(manifest["versions"]) >= {"torch", "onnx", "onnxruntime"}
    report = manifest["validation"]
    assert report["tolerance"] == TOLERANCE
    assert report["max_abs_diff"] and max(report["max_abs_diff"].values()) <= TOLERANCE
    assert report["greedy"]["tokens_identical"] and report["beam"]["tokens_identical"]
    assert len(report["greedy"]["logits_max_diff_per_step"]) == report["greedy"]["steps"] > 0
    batches = {c["batch"] for c in report["cases"]}
    assert {1, 3, 8} <= batches and 2 not in batches  # unlike the export dummies (batch 2)
    for proto in (encoder, decoder):
        assert proto.ir_version == IR_VERSION
        contrib = {"com.microsoft": 1} if flavour == "ort" and proto is decoder else {}
        assert {o.domain or "ai.onnx": o.version for o in proto.opset_import} == {
            "ai.onnx": manifest["opset"],
            **contrib,
        }
        if not contrib:  # onnx's checker knows no contrib operator schemas
            onnx.checker.check_model(proto, full_check=True)


def test_io_names_dtypes_and_named_axes(exported):
    encoder, decoder, manifest = load_graphs(exported)
    c = manifest["model_config"]
    H, dk, n = c["n_heads"], c["d_model"] // c["n_heads"], c["n_decoder_layers"]
    enc_in = {v.name: axes(v) for v in encoder.graph.input}
    assert enc_in == {"input_ids": ["batch", "src_len"], "src_lengths": ["batch"]}
    enc_out = [v.name for v in encoder.graph.output]
    assert enc_out == ["encoder_out"] + [f"cross_{k}.{i}" for i in range(n) for k in ("key", "value")]
    assert axes(encoder.graph.output[1]) == ["batch", H, "src_len", dk]

    dec_in = {v.name: axes(v) for v in decoder.graph.input}
    assert dec_in["input_ids"] == ["batch", 1]
    assert dec_in["positions"] == dec_in["src_lengths"] == ["batch"]
    assert dec_in["self_key.1"] == ["batch", H, "cache_len", dk]
    assert dec_in["cross_value.0"] == ["sources", H, "src_len", dk]  # once per source
    assert len(decoder.graph.input) == 3 + 4 * n  # a fixed number of inputs
    out = {v.name: axes(v) for v in decoder.graph.output}
    assert out["logits"] == ["batch", c["tgt_vocab_size"]]
    assert decoder.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    if manifest["flavour"] == "portable":
        assert out["new_key.0"] == out["new_value.1"] == ["batch", H, 1, dk]
    else:
        assert out["present_key.0"] == out["present_value.1"] == ["batch", H, "cache_len", dk]


def test_one_step_graph_without_control_flow(exported):
    encoder, decoder, manifest = load_graphs(exported)
    for proto in (encoder, decoder):
        ops = {n.op_type for n in proto.graph.node}
        assert not ops & {"If", "Loop", "Scan"}
        contrib = [(n.domain, n.op_type) for n in proto.graph.node if n.domain]
        if manifest["flavour"] == "ort" and proto is decoder:  # one GroupQueryAttention per layer
            assert (
                contrib
                == [("com.microsoft", "GroupQueryAttention")] * manifest["model_config"]["n_decoder_layers"]
            )
        else:
            assert contrib == []  # standard ops only, no plugin
        assert len(proto.functions) == 0
        for v in list(proto.graph.input) + list(proto.graph.output):
            assert 0 not in axes(v)


def test_cache_is_read_by_matmul_or_tensorscatter_only(exported):
    _, decoder, manifest = load_graphs(exported)
    users: dict[str, list[onnx.NodeProto]] = {}
    for node in decoder.graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    for i in range(manifest["model_config"]["n_decoder_layers"]):
        for kind in ("key", "value"):
            readers = users[f"self_{kind}.{i}"]
            if manifest["flavour"] == "tensorscatter":
                assert [r.op_type for r in readers] == ["TensorScatter"]
                assert [a.i for a in readers[0].attribute if a.name == "axis"] == [-2]
            elif manifest["flavour"] == "ort":  # past key (3) / value (4), its present a graph output
                assert [r.op_type for r in readers] == ["GroupQueryAttention"]
                slot = list(readers[0].input).index(f"self_{kind}.{i}")
                assert slot == {"key": 3, "value": 4}[kind]
                assert readers[0].output[slot - 2] == f"present_{kind}.{i}"
            else:
                assert {r.op_type for r in readers} <= {"MatMul", "Transpose", "Shape"}
                assert "Concat" not in {
                    u.op_type for r in readers for o in r.output for u in users.get(o, [])
                }


def test_tied_embedding_stored_once(exported):
    _, decoder, manifest = load_graphs(exported)
    c = manifest["model_config"]
    assert c["tie_target_embeddings"]
    # what the graph stores: each region of the shared weights file once (a tied table read under
    # a second name by the output projection is one region), and what it holds inside itself
    stored = {}
    for t in onnx.load(exported / DECODER_FILE, load_external_data=False).graph.initializer:
        where = tuple(e.value for e in t.external_data if e.key in ("location", "offset")) or t.name
        stored[where] = int(np.prod(t.dims))
    sizes = list(stored.values())
    assert sizes.count(c["tgt_vocab_size"] * c["d_model"]) == 1
    total = sum(sizes)
    model = Transformer(TransformerConfig.from_dict(c))
    decoder_params = sum(
        p.numel()
        for name, p in model.named_parameters()
        if not name.startswith(("src_embed", "encoder"))
        and "src_attn.W_K" not in name
        and "src_attn.W_V" not in name
    )
    pe = c["max_len"] * c["d_model"]
    assert total <= decoder_params + pe + 1024  # + small constants


def test_export_matches_eager_on_new_shapes(exported):
    """The recorded validation can be re-run from the folder on other random inputs."""
    manifest = json.loads((exported / MANIFEST_NAME).read_text())
    model = load_model(manifest["export"]["source_model_dir"])
    report = validation.validate_export(
        exported, model, tolerance=TOLERANCE, seed=7, decode_batch=3, max_new_tokens=10, beam_size=2
    )
    assert report.worst <= TOLERANCE
    assert report.greedy["tokens_identical"] and report.beam["tokens_identical"]
    assert "logits per step" in report.table()


def test_fuse_shared_input_matmuls_keeps_values(exported_portable):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from export.lowering import fuse_shared_input_matmuls

    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, n)).astype(np.float32), f"w{i}")
        for i, n in enumerate((8, 8, 4, 8))
    ]
    inits += [
        numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), f"b{i}")
        for i, n in enumerate((8, 8, 4))
    ]
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"m{i}"]) for i in range(3)]
    nodes += [helper.make_node("Add", [f"m{i}", f"b{i}"], [f"y{i}"]) for i in range(3)]
    nodes += [
        helper.make_node("MatMul", ["x", "w3"], ["m3"]),
        helper.make_node("Relu", ["w3"], ["y3"]),
    ]  # w3 read twice
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 1, 8])],
        [
            helper.make_tensor_value_info(n, TensorProto.FLOAT, shape)
            for n, shape in (
                ("y0", [2, 1, 8]),
                ("y1", [2, 1, 8]),
                ("y2", [2, 1, 4]),
                ("m3", [2, 1, 8]),
                ("y3", [8, 8]),
            )
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = IR_VERSION
    x = rng.standard_normal((2, 1, 8)).astype(np.float32)
    before = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )
    assert fuse_shared_input_matmuls(model) == 1
    onnx.checker.check_model(model, full_check=True)
    assert [n.op_type for n in model.graph.node].count("MatMul") == 2  # the fused one and the one on w3
    assert {t.name for t in model.graph.initializer} >= {"w3"} and "w0" not in {
        t.name for t in model.graph.initializer
    }
    after = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )
    for a, b in zip(before, after):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # in the real export: one Q/K/V product per decoder layer
    manifest = json.loads((exported_portable / MANIFEST_NAME).read_text())
    assert manifest["export"]["graph_passes"] == [
        "folded_query_scale",
        "fuse_shared_input_matmuls",
        "share_shape_reads",
        "flatten_rows",
    ]
    decoder = onnx.load(exported_portable / DECODER_FILE)
    assert [n.op_type for n in decoder.graph.node].count("Split") == manifest["model_config"][
        "n_decoder_layers"
    ]


def test_flatten_rows_keeps_the_step_values(exported_portable):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from export.lowering import flatten_rows

    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 12)).astype(np.float32)
    b = rng.standard_normal(12).astype(np.float32)
    gamma = rng.standard_normal(4).astype(np.float32)
    beta = rng.standard_normal(4).astype(np.float32)
    inits = [
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(b, "b"),
        numpy_helper.from_array(gamma, "gamma"),
        numpy_helper.from_array(beta, "beta"),
        numpy_helper.from_array(np.array([4, 4, 4], np.int64), "sizes"),
        numpy_helper.from_array(np.array([-1, 2, 1, 2], np.int64), "heads"),
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Split", ["r", "sizes"], ["s0", "s1", "s2"], axis=2),
        helper.make_node("Add", ["s0", "s1"], ["t"]),
        helper.make_node("LayerNormalization", ["t", "gamma", "beta"], ["n"], axis=-1),
        helper.make_node("Reshape", ["n", "heads"], ["by_head"]),  # a constant target: reads 2-D
        helper.make_node("Gather", ["n", "zero"], ["row"], axis=1),  # x[:, 0]: dropped
        helper.make_node("Softmax", ["row"], ["row_soft"], axis=-1),
        helper.make_node("Softmax", ["s2"], ["soft"], axis=-1),  # any other reader: 3-D again
    ]

    def info(name, dims):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)

    graph = helper.make_graph(
        nodes,
        "g",
        [info("x", ["batch", 1, 8])],
        [info("by_head", ["batch", 2, 1, 2]), info("row_soft", ["batch", 4]), info("soft", ["batch", 1, 4])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = IR_VERSION
    assert flatten_rows(model) == 6  # MatMul, Add, Relu, Split, Add, LayerNormalization
    onnx.checker.check_model(model, full_check=True)
    assert "Gather" not in [n.op_type for n in model.graph.node]
    assert "zero" not in {t.name for t in model.graph.initializer}  # the Gather's index: no reader left
    x = rng.standard_normal((3, 1, 8)).astype(np.float32)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )
    # the oracle: the same computation in float64 numpy
    r = np.maximum(x.astype(np.float64) @ w + b, 0)
    t = r[..., 0:4] + r[..., 4:8]
    n = (t - t.mean(-1, keepdims=True)) / np.sqrt(t.var(-1, keepdims=True) + 1e-5) * gamma + beta
    e = np.exp(r[..., 8:] - r[..., 8:].max(-1, keepdims=True))
    row = np.exp(n[:, 0] - n[:, 0].max(-1, keepdims=True))
    want = [n.reshape(3, 2, 1, 2), row / row.sum(-1, keepdims=True), e / e.sum(-1, keepdims=True)]
    for a, b_ in zip(got, want):
        assert a.shape == b_.shape
        np.testing.assert_allclose(a, b_, rtol=1e-4, atol=1e-4)
    # in the real export: every weight product of the step reads a 2-D value
    decoder = onnx.load(exported_portable / DECODER_FILE)
    inferred = onnx.shape_inference.infer_shapes(decoder)
    ranks = {
        vi.name: len(vi.type.tensor_type.shape.dim)
        for vi in [*inferred.graph.value_info, *inferred.graph.input]
        if vi.type.tensor_type.HasField("shape")
    }
    weights = {t.name for t in decoder.graph.initializer}
    products = [n for n in decoder.graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in weights]
    assert products and all(ranks.get(n.input[0]) == 2 for n in products)


def test_flatten_rows_keeps_the_encoder_values(exported_portable):
    """The encoder's rows are [batch, src_len, F]: the same pass with the source axis named."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from export.lowering import flatten_rows

    rng = np.random.default_rng(1)
    table = rng.standard_normal((11, 8)).astype(np.float32)
    w = rng.standard_normal((8, 12)).astype(np.float32)
    b = rng.standard_normal(12).astype(np.float32)
    gamma = rng.standard_normal(4).astype(np.float32)
    beta = rng.standard_normal(4).astype(np.float32)
    inits = [
        numpy_helper.from_array(table, "table"),
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(b, "b"),
        numpy_helper.from_array(gamma, "gamma"),
        numpy_helper.from_array(beta, "beta"),
        numpy_helper.from_array(np.array([4, 4, 4], np.int64), "sizes"),
        numpy_helper.from_array(np.array([-1, 2, 2], np.int64), "halves"),
    ]
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["x"], axis=0),  # [batch, src_len, 8]
        helper.make_node("MatMul", ["x", "w"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Split", ["r", "sizes"], ["s0", "s1", "s2"], axis=-1),
        helper.make_node("Add", ["s0", "s1"], ["t"]),
        helper.make_node("LayerNormalization", ["t", "gamma", "beta"], ["n"], axis=-1),
        helper.make_node("Reshape", ["n", "halves"], ["by_half"]),  # a constant target: reads 2-D
        helper.make_node("Softmax", ["s2"], ["over_source"], axis=1),  # across rows: 3-D again
    ]
    graph = helper.make_graph(
        nodes,
        "encoder_like",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "src_len"])],
        [
            helper.make_tensor_value_info("by_half", TensorProto.FLOAT, [None, 2, 2]),
            helper.make_tensor_value_info("over_source", TensorProto.FLOAT, ["batch", "src_len", 4]),
            helper.make_tensor_value_info("n", TensorProto.FLOAT, ["batch", "src_len", 4]),  # an output
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = IR_VERSION
    # MatMul, Add, Relu, Split, Add; the LayerNormalization writes a graph output, so it stays
    # 3-D and reads its input through a Reshape back to the shape of `ids` followed by F
    assert flatten_rows(model) == 5
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for shape in [(3, 5), (1, 1), (2, 7)]:
        ids = rng.integers(0, 11, size=shape).astype(np.int64)
        got = dict(zip(["by_half", "over_source", "n"], session.run(None, {"ids": ids})))
        # the oracle: the same computation in float64 numpy
        x = table.astype(np.float64)[ids]
        r = np.maximum(x @ w + b, 0)
        t = r[..., 0:4] + r[..., 4:8]
        n = (t - t.mean(-1, keepdims=True)) / np.sqrt(t.var(-1, keepdims=True) + 1e-5) * gamma + beta
        e = np.exp(r[..., 8:] - r[..., 8:].max(1, keepdims=True))
        want = {"by_half": n.reshape(-1, 2, 2), "over_source": e / e.sum(1, keepdims=True), "n": n}
        for name, value in want.items():
            assert got[name].shape == value.shape, name
            np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-4, err_msg=name)
    # in the real export: every weight product of the encoder reads a 2-D value
    encoder = onnx.load(exported_portable / ENCODER_FILE)
    inferred = onnx.shape_inference.infer_shapes(encoder)
    ranks = {
        vi.name: len(vi.type.tensor_type.shape.dim)
        for vi in [*inferred.graph.value_info, *inferred.graph.input]
        if vi.type.tensor_type.HasField("shape")
    }
    weights = {t.name for t in encoder.graph.initializer}
    products = [n for n in encoder.graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in weights]
    assert products and all(ranks.get(n.input[0]) == 2 for n in products)


def test_no_flatten_rows_keeps_the_traced_rows(exported_portable, tmp_path):
    """``flatten_rows=False`` (``--no-flatten-rows``): the weight products read the traced 3-D
    values, and the export validates against the same eager model."""
    model_dir = exported_portable.parent / "tiny_model"
    result = export_onnx(model_dir, tmp_path / "rows3d", flatten_rows=False, tolerance=TOLERANCE)
    assert result.validation.worst <= TOLERANCE
    assert "flatten_rows" not in result.manifest["export"]["graph_passes"]
    for name in (ENCODER_FILE, DECODER_FILE):
        graph = onnx.load(tmp_path / "rows3d" / name)
        inferred = onnx.shape_inference.infer_shapes(graph)
        ranks = {
            vi.name: len(vi.type.tensor_type.shape.dim)
            for vi in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]
            if vi.type.tensor_type.HasField("shape")
        }
        weights = {t.name for t in graph.graph.initializer}
        products = [n for n in graph.graph.node if n.op_type == "MatMul" and n.input[1] in weights]
        assert products and all(ranks.get(n.input[0]) == 3 for n in products), name
    with pytest.raises(ValueError, match="flatten_rows must be True or False"):
        export_onnx(model_dir, tmp_path / "bad", flatten_rows="no")
    assert not (tmp_path / "bad").exists()


def _scalar_mul_constants(model: onnx.ModelProto) -> list[float]:
    """The scalar constants (initializers or ``Constant`` nodes) that some ``Mul`` multiplies by."""
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            consts[node.output[0]] = onnx.numpy_helper.to_array(node.attribute[0].t)
    return [
        float(consts[name].reshape(()))
        for node in model.graph.node
        if node.op_type == "Mul"
        for name in node.input
        if name in consts and consts[name].size == 1
    ]


def _step_inputs(model, batch=3, cache=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = model.config
    H, d_k, S = c.n_heads, c.d_model // c.n_heads, 7
    src = torch.randint(4, c.src_vocab_size, (batch, S), generator=g)
    src_lengths = torch.tensor([S, 4, 1][:batch])
    _, cross_keys, cross_values = model.encode(src, src_lengths)
    kv = [torch.randn(batch, H, cache, d_k, generator=g) for _ in range(2 * c.n_decoder_layers)]
    ids = torch.randint(4, c.tgt_vocab_size, (batch, 1), generator=g)
    positions = torch.tensor([cache, 2, 0][:batch])
    return ids, positions, src_lengths, kv[0::2], kv[1::2], cross_keys, cross_values


@pytest.mark.parametrize("d_model, n_heads, exact", [(64, 4, True), (32, 4, False)])
def test_folded_query_scale_is_the_same_step_and_restores_the_model(d_model, n_heads, exact):
    """d_k = 16: the scale is 1/4, a power of two, and the folded step is bit-identical; d_k = 8:
    equal up to rounding. On exit (and after an exception) the model's parameter objects, values
    and scales are its own again."""
    from export.onnx import folded_query_scale

    torch.manual_seed(0)
    config = TransformerConfig.preset("tiny", dropout=0.0, d_model=d_model, n_heads=n_heads)
    model = Transformer(config).eval()
    before = {k: (v, v.detach().clone()) for k, v in model.named_parameters()}
    scale = 1.0 / (d_model // n_heads) ** 0.5
    with torch.no_grad():
        args = _step_inputs(model)
        ref_logits, *_, ref_attention = model.decode_step(*args, return_attention=True)
        with folded_query_scale(model):
            layer = model.decoder.layers[0]
            assert layer.self_attn.scale == 1.0 and layer.src_attn.scale == 1.0
            assert torch.equal(
                layer.src_attn.W_Q.weight, before["decoder.layers.0.src_attn.W_Q.weight"][1] * scale
            )
            logits, *_, attention = model.decode_step(*args, return_attention=True)
        with pytest.raises(RuntimeError, match="inside"):
            with folded_query_scale(model):
                raise RuntimeError("inside")
    if exact:
        assert torch.equal(logits, ref_logits) and torch.equal(attention, ref_attention)
    else:
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(attention, ref_attention, rtol=1e-5, atol=1e-6)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, (obj, value) in before.items():
        assert after[name] is obj and torch.equal(obj, value), name
    for layer in model.decoder.layers:
        assert layer.self_attn.scale == scale and layer.src_attn.scale == scale


def test_step_graph_scores_carry_no_scale_mul(exported_portable, tmp_path):
    """The default export folds 1/sqrt(d_k) into the queries: no ``Mul`` by it is left in the step
    graph (it would become a ``FusedMatMul`` alpha in ONNX Runtime). ``fold_query_scale=False``
    keeps it, and both validate against the same eager model."""
    manifest = json.loads((exported_portable / MANIFEST_NAME).read_text())
    c = manifest["model_config"]
    scale = np.float32(1.0 / np.sqrt(c["d_model"] // c["n_heads"]))
    folded = onnx.load(exported_portable / DECODER_FILE)
    assert scale not in np.float32(_scalar_mul_constants(folded))
    assert manifest["export"]["graph_passes"][0] == "folded_query_scale"
    model_dir = exported_portable.parent / "tiny_model"
    result = export_onnx(model_dir, tmp_path / "unfolded", fold_query_scale=False, tolerance=TOLERANCE)
    assert result.validation.worst <= TOLERANCE
    assert "folded_query_scale" not in result.manifest["export"]["graph_passes"]
    unfolded = onnx.load(tmp_path / "unfolded" / DECODER_FILE)
    # the self-attention's cache scores and new-token score, and the cross-attention's, per layer
    assert list(np.float32(_scalar_mul_constants(unfolded))).count(scale) == 3 * c["n_decoder_layers"]


def test_share_shape_reads_rewires_only_equally_declared_inputs(exported_portable):
    from onnx import TensorProto, helper

    from export.lowering import share_shape_reads

    def inp(name, dims):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)

    inputs = [inp("a", ["n", 3]), inp("b", ["n", 3]), inp("c", ["m", 3]), inp("d", [None, 3])]
    nodes = [helper.make_node("Shape", [x], [f"s_{x}"]) for x in "abcd"]
    outputs = [helper.make_tensor_value_info(f"s_{x}", TensorProto.INT64, [2]) for x in "abcd"]
    model = helper.make_model(
        helper.make_graph(nodes, "g", inputs, outputs), opset_imports=[helper.make_opsetid("", 18)]
    )
    assert share_shape_reads(model) == 1
    assert [n.input[0] for n in model.graph.node] == ["a", "a", "c", "d"]  # only b shares a's declared shape
    # in the real export: the decoder reads one self-attention cache shape and one cross K/V shape
    decoder = onnx.load(exported_portable / DECODER_FILE)
    read = {
        n.input[0]
        for n in decoder.graph.node
        if n.op_type == "Shape" and n.input[0] in {i.name for i in decoder.graph.input}
    }
    assert read <= {"self_key.0", "cross_key.0", "self_value.0", "cross_value.0"}, read


# ------------------------------------------------------------------------------------------
# validation failures are typed and name the output, the step and the difference
# ------------------------------------------------------------------------------------------


def test_parity_error_names_output(exported_portable):
    manifest = json.loads((exported_portable / MANIFEST_NAME).read_text())
    model = load_model(manifest["export"]["source_model_dir"])
    with torch.no_grad():
        model.decoder.layers[-1].sublayer[2].norm.weight.mul_(1.01)  # the decoder only
    with pytest.raises(ParityError) as info:
        validation.validate_export(exported_portable, model, tolerance=TOLERANCE)
    err = info.value
    assert err.output == "decoder_step/logits" and err.step is None
    assert err.max_diff > TOLERANCE and err.tolerance == TOLERANCE
    assert "decoder_step/logits" in str(err) and "batch" in err.case


class _FakeRecorder:
    def __init__(self, logits):
        self.logits = logits


def test_parity_error_names_decode_step():
    report = validation.ValidationReport(tolerance=TOLERANCE)
    eager = _FakeRecorder([np.zeros((2, 5), np.float32)] * 4)
    onnx_logits = [np.zeros((2, 5), np.float32) for _ in range(4)]
    onnx_logits[2][1, 3] = 0.5
    with pytest.raises(ParityError) as info:
        validation._compare_decodes(report, "greedy", eager, _FakeRecorder(onnx_logits), [[1]], [[1]], "case")
    assert (info.value.output, info.value.step, info.value.max_diff) == ("greedy decode logits", 2, 0.5)
    # logits within tolerance but different tokens: still an error, at the first differing step
    with pytest.raises(ParityError) as info:
        validation._compare_decodes(
            report,
            "greedy",
            eager,
            _FakeRecorder([x * 0 for x in onnx_logits]),
            [[1, 2, 3]],
            [[1, 2, 4]],
            "case",
        )
    assert info.value.output == "greedy decode tokens" and info.value.step == 2


def test_check_graphs_rejects_contract_breaks(exported_portable):
    encoder, decoder, manifest = load_graphs(exported_portable)
    config = TransformerConfig.from_dict(manifest["model_config"])
    validation.check_graphs(encoder, decoder, config, "portable")  # the real graphs pass

    renamed = onnx.ModelProto.FromString(decoder.SerializeToString())
    renamed.graph.output[0].name = "scores"
    with pytest.raises(GraphContractError, match="output names"):
        validation.check_graphs(encoder, renamed, config, "portable")

    concat = onnx.ModelProto.FromString(decoder.SerializeToString())
    concat.graph.node.append(
        onnx.helper.make_node("Concat", ["self_key.0", "self_key.0"], ["copied"], axis=2)
    )
    with pytest.raises(GraphContractError, match="Concat"):
        validation.check_graphs(encoder, concat, config, "portable")

    branchy = onnx.ModelProto.FromString(decoder.SerializeToString())
    branch = onnx.helper.make_graph(
        [], "b", [], [onnx.helper.make_tensor_value_info("positions", onnx.TensorProto.INT64, None)]
    )
    branchy.graph.node.append(
        onnx.helper.make_node("If", ["cond"], ["x"], then_branch=branch, else_branch=branch)
    )
    with pytest.raises(GraphContractError, match="If"):
        validation.check_graphs(encoder, branchy, config, "portable")

    doubled = onnx.ModelProto.FromString(decoder.SerializeToString())
    big = max(doubled.graph.initializer, key=lambda t: int(np.prod(t.dims)))
    copy = onnx.TensorProto.FromString(big.SerializeToString())
    copy.name = big.name + "_copy"
    doubled.graph.initializer.append(copy)
    with pytest.raises(GraphContractError, match="stored"):
        validation.check_graphs(encoder, doubled, config, "portable")

    with pytest.raises(GraphContractError, match="TensorScatter"):
        validation.check_graphs(
            encoder, decoder, config, "tensorscatter", graph_specs(config.to_dict(), "portable")
        )


# ------------------------------------------------------------------------------------------
# the output folder is written atomically
# ------------------------------------------------------------------------------------------


def test_failed_export_leaves_nothing_and_keeps_a_good_export(tmp_path, fast_export, monkeypatch):
    model_dir = make_model_dir(tmp_path / "model")
    out = tmp_path / "out"
    result = export_onnx(model_dir, out, tolerance=TOLERANCE)
    assert fast_export == [ENCODER_FILE, DECODER_FILE]
    good = {p.name: p.read_bytes() for p in out.iterdir()}
    assert result.validation.worst <= TOLERANCE

    def broken(*args, **kwargs):
        raise ParityError("decoder_step/logits", None, 1.0, TOLERANCE, "injected")

    monkeypatch.setattr(validation, "validate_export", broken)
    with pytest.raises(ParityError):
        export_onnx(model_dir, out, tolerance=TOLERANCE)  # over a good export: kept as it was
    assert {p.name: p.read_bytes() for p in out.iterdir()} == good
    with pytest.raises(ParityError):
        export_onnx(model_dir, tmp_path / "fresh", tolerance=TOLERANCE)  # nothing left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]


def test_replaces_a_previous_export(tmp_path, fast_export):
    model_dir = make_model_dir(tmp_path / "model")
    out = tmp_path / "out"
    export_onnx(model_dir, out, validate=False)
    assert json.loads((out / MANIFEST_NAME).read_text())["validation"] is None
    export_onnx(model_dir, out, validate=True, tolerance=TOLERANCE)
    assert json.loads((out / MANIFEST_NAME).read_text())["validation"]["tolerance"] == TOLERANCE
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]
    assert oct(out.stat().st_mode & 0o777) != oct(0o700)  # not left private like a temp folder


def test_refuses_to_replace_a_folder_that_is_not_an_export(tmp_path, fast_export):
    model_dir = make_model_dir(tmp_path / "model")
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match="not an ONNX export"):
        export_onnx(model_dir, out)
    assert (out / "notes.txt").read_text() == "keep me"
    assert fast_export == []  # refused before any work


# ------------------------------------------------------------------------------------------
# bad inputs
# ------------------------------------------------------------------------------------------


def test_missing_or_wrong_model_folder(tmp_path, fast_export):
    with pytest.raises(ModelDirectoryError, match="not found"):
        export_onnx(tmp_path / "nowhere", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelDirectoryError, match="config.json"):
        export_onnx(tmp_path / "empty", tmp_path / "out")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelDirectoryError, match="directory"):
        export_onnx(tmp_path / "file", tmp_path / "out")
    broken = make_model_dir(tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelDirectoryError, match="cannot load"):
        export_onnx(broken, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert isinstance(ModelDirectoryError("x"), FileNotFoundError)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(flavour="merged"), "flavour"),
        (dict(opset=16), "opset 16"),
        (dict(flavour="tensorscatter", opset=18), "opset 18"),
        (dict(tolerance=0.0), "tolerance"),
        (dict(cache_len=10_000), "cache_len"),
    ],
)
def test_bad_options(tmp_path, fast_export, kwargs, match):
    model_dir = make_model_dir(tmp_path / "model")
    with pytest.raises(ValueError, match=match):
        export_onnx(model_dir, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------
# the command line
# ------------------------------------------------------------------------------------------


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for option in (
        "--model",
        "--output-dir",
        "--flavour",
        "--opset",
        "--cache-len",
        "--tolerance",
        "--no-validate",
    ):
        assert option in text


def test_cli_prints_parity_table_and_translations(tmp_path, fast_export, capsys):
    model_dir = make_model_dir(tmp_path / "model")
    code = main(
        [
            "--model",
            str(model_dir),
            "--output-dir",
            str(tmp_path / "out"),
            "--cache-len",
            "32",
            "--examples",
            "2",
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "parity with eager PyTorch" in text and "decoder_step" in text and "identical" in text
    assert "example translations: none (the model folder records no example pairs" in text  # not the demo
    assert json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())["max_cache_len"] == 32


def test_cli_reports_errors(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "nowhere"), "--output-dir", str(tmp_path / "out")]) == 1
    assert "model folder not found" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------
# other model variants, and the bundled demo model
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    [
        dict(norm_first=True, tie_target_embeddings=False),
        dict(shared_vocab=True, src_vocab_size=40, bias=False),
    ],
)
def test_model_variants(tmp_path, variant):
    model_dir = make_model_dir(tmp_path / "model", seed=3, **variant)
    result = export_onnx(model_dir, tmp_path / "out", flavour="tensorscatter", tolerance=TOLERANCE)
    assert result.validation.worst <= TOLERANCE


@pytest.mark.skipif(not (DEMO_DIR / "config.json").is_file(), reason="the bundled demo model is not present")
def test_demo_model(tmp_path, capsys):
    out = tmp_path / "demo_onnx"
    code = main(["--output-dir", str(out), "--examples", "3"])
    assert code == 0
    text = capsys.readouterr().out
    assert "translations decoded by ONNX Runtime" in text
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert Path(manifest["export"]["source_model_dir"]).resolve() == DEMO_DIR.resolve()
    assert manifest["validation"]["greedy"]["tokens_identical"]


# ------------------------------------------------------------------------------------------
# --quantize (the int8 scheme itself: tests/test_quantize.py)
# ------------------------------------------------------------------------------------------


def test_quantize_unknown_scheme_before_the_disk(tmp_path, fast_export):
    from export.quantize import QuantizationError

    model_dir = make_model_dir(tmp_path / "model")
    with pytest.raises(QuantizationError, match="unknown quantization scheme 'int3'"):
        export_onnx(model_dir, tmp_path / "out", quantize="int3")
    assert not (tmp_path / "out").exists() and fast_export == []  # nothing traced either


def test_quantize_int8_writes_the_same_files_with_a_quantization_section(tmp_path, fast_export):
    from transformer_ext.export_format import manifest_quantization, read_manifest

    model_dir = make_model_dir(tmp_path / "model")
    plain = export_onnx(model_dir, tmp_path / "f32", validate=False)
    result = export_onnx(model_dir, tmp_path / "int8", validate=False, quantize="int8")
    # the float32 files, and the int8 export's few-row decoder step
    assert sorted(os.listdir(tmp_path / "int8")) == sorted(
        [*os.listdir(tmp_path / "f32"), "decoder_step_few_rows.onnx"]
    )
    assert manifest_quantization(read_manifest(tmp_path / "int8"))["scheme"] == "int8"
    assert result.manifest["quantization"]["gate"] is None  # validation off: no gate
    assert manifest_quantization(plain.manifest) is None
    ops = {n.op_type for n in onnx.load(tmp_path / "int8" / DECODER_FILE).graph.node}
    assert "MatMulInteger" in ops and "Gemm" not in ops
    assert sorted(os.listdir(tmp_path)) == ["f32", "int8", "model"]  # no temporary left
