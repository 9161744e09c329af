"""How an export folder stores its weights (docs/DESIGN.md section 3): tensors that merely hold
equal values are not "a weight stored twice", tied tensors are read as one."""

from __future__ import annotations

import string
from pathlib import Path

import onnx
import pytest
import torch

from export import GraphContractError
from export import validate as validation
from export.onnx import export_onnx
from transformer_ext.checkpoint import save_model
from transformer_ext.config import TransformerConfig
from transformer_ext.model import Transformer
from transformer_ext.tokenizer import SPECIAL_TOKENS, CharTokenizer


def initialised_like_transformers(directory: Path, **overrides) -> Path:
    """A model folder whose biases are all zero and LayerNorm gains all one, as transformers'
    ``_init_weights`` leaves a fresh checkpoint (``save_pretrained`` of an untrained MarianMT).
    ``d_ff`` 2048 (as opus-mt's): each feed-forward bias (8 KiB) is larger than what the exporter itself merges."""
    torch.manual_seed(0)
    options = dict(dropout=0.0, d_ff=2048, shared_vocab=True, src_vocab_size=40, tgt_vocab_size=40)
    options.update(overrides)
    config = TransformerConfig.preset("tiny", **options)
    model = Transformer(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
    save_model(model, directory)
    chars = list(SPECIAL_TOKENS) + list(
        (string.ascii_lowercase + string.digits + " .,'!?")[: config.src_vocab_size - len(SPECIAL_TOKENS)]
    )
    CharTokenizer(chars, chars, lowercase=True).save(directory)
    return directory


def test_equal_valued_tensors_are_not_a_weight_stored_twice(tmp_path):
    model_dir = initialised_like_transformers(tmp_path / "model")
    result = export_onnx(model_dir, tmp_path / "out", validate=False)
    encoder = onnx.load(result.encoder_path)
    names = {t.name for t in encoder.graph.initializer}
    # the two encoder layers' zero feed-forward biases are both in the graph (distinct tensors)
    assert {f"model.encoder.layers.{i}.feed_forward.w_1.bias" for i in range(2)} <= names


def test_a_tied_tensor_read_under_two_names_is_refused(tmp_path):
    """The negative control: one tensor of the model (the shared embedding) stored as two
    initializers is refused, while distinct tensors with the same values pass."""
    from export.onnx import load_model_dir

    model_dir = initialised_like_transformers(tmp_path / "model")
    result = export_onnx(model_dir, tmp_path / "out", validate=False)
    model = load_model_dir(model_dir)[0]
    tensors = validation.model_tensors(model)
    encoder, decoder = onnx.load(result.encoder_path), onnx.load(result.decoder_path)
    validation.check_graphs(encoder, decoder, model.config, "portable", tensors=tensors)

    # the shared embedding (source, target, output projection: one tensor under three names)
    tied = {"model.src_embed.lut.weight", "model.tgt_embed.lut.weight", "model.generator.proj.weight"}
    assert len({tensors[name] for name in tied}) == 1
    doubled = onnx.ModelProto.FromString(encoder.SerializeToString())
    (table,) = [t for t in doubled.graph.initializer if t.name in tied]
    copy = onnx.TensorProto.FromString(table.SerializeToString())
    copy.name = sorted(tied - {table.name})[0]  # the same tensor of the model under another name
    doubled.graph.initializer.append(copy)
    with pytest.raises(GraphContractError, match="one tensor of the model stored twice"):
        validation.check_graphs(doubled, decoder, model.config, "portable", tensors=tensors)


def _verdict(manifest):
    from types import SimpleNamespace

    from export.onnx import verdict_text

    validation = SimpleNamespace(tolerance=1e-4, worst=2.5e-6)
    return verdict_text(SimpleNamespace(validation=validation, manifest=manifest, output_dir=Path("OUT")))


@pytest.mark.parametrize("scheme", ["int8", "int4", "int8-nbits"])
def test_a_quantized_export_verdict_says_what_was_validated(scheme):
    """The logit tolerance describes the float32 graphs; the quantized graphs written are gated."""
    first = _verdict({"quantization": {"scheme": scheme}}).splitlines()[0]
    assert "every output within" not in first
    assert (
        "float32 graphs within 1e-04" in first
        and f"the {scheme} graphs written passed the quality gate" in first
    )


def test_a_float32_export_verdict_keeps_the_tolerance():
    first = _verdict({}).splitlines()[0]
    assert first.startswith("export OK: every output within 1e-04 of PyTorch (worst 2.5e-06)")


# ------------------------------------------------------------------------------------------
# The shared weights file
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tied_export(tmp_path_factory):
    """A tiny model with one vocabulary (source, target and output projection one tensor),
    exported (its parity with eager PyTorch is tests/test_export_onnx.py's)."""
    from helpers import make_model_dir

    base = tmp_path_factory.mktemp("tied")
    model_dir = make_model_dir(base / "model", shared_vocab=True, src_vocab_size=40, tgt_vocab_size=40)
    export_onnx(model_dir, base / "out", validate=False)
    return model_dir, base / "out"


def _regions(graph_path: Path) -> dict:
    """``{initializer name: (location, offset, length)}`` of a graph's external initializers, and
    ``None`` for the ones stored inside it."""
    proto = onnx.load(graph_path, load_external_data=False)
    out = {}
    for t in proto.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            out[t.name] = (info["location"], int(info["offset"]), int(info["length"]))
        else:
            out[t.name] = None
    return out, proto


def test_every_weight_is_stored_once_in_the_shared_weights_file(tied_export):
    from safetensors.numpy import load_file

    from transformer_ext.export_format import HASHES_KEY, WEIGHTS_FILE, read_manifest

    model_dir, out = tied_export
    manifest = read_manifest(out, verify=True)
    assert manifest["weights"]["file"] == WEIGHTS_FILE
    assert WEIGHTS_FILE in manifest["files"] and WEIGHTS_FILE in manifest[HASHES_KEY]
    data = (out / WEIGHTS_FILE).read_bytes()
    assert manifest["weights"]["bytes"] == len(data)

    reads = {}
    for graph in ("encoder.onnx", "decoder_step.onnx"):
        regions, proto = _regions(out / graph)
        for t in proto.graph.initializer:
            size = regions[t.name][2] if regions[t.name] else len(t.raw_data)
            # every initializer of 1 KiB or more lives in the shared file, none inside a graph
            assert (regions[t.name] is not None) == (size >= 1024), (graph, t.name)
        for node in proto.graph.node:
            if (
                node.op_type in ("Gather", "Gemm", "MatMul")
                and node.input[1 if node.op_type != "Gather" else 0] in regions
            ):
                table = node.input[0] if node.op_type == "Gather" else node.input[1]
                if regions.get(table) and regions[table][2] == 40 * 32 * 4:
                    reads[(graph, node.op_type)] = regions[table]
    # the encoder's lookup, the decoder's lookup and its output projection read one region
    assert set(reads) == {
        ("encoder.onnx", "Gather"),
        ("decoder_step.onnx", "Gather"),
        ("decoder_step.onnx", "Gemm"),
    }
    assert len(set(reads.values())) == 1
    # independently of the graphs: the embedding's bytes (from model.safetensors) are in the file once
    tensors = load_file(model_dir / "model.safetensors")
    (table,) = [v for k, v in tensors.items() if v.shape == (40, 32)]
    raw = table.astype("<f4").tobytes()
    first = data.find(raw)
    assert first >= 0 and data.find(raw, first + 1) == -1
    assert len(data) <= 1.05 * (model_dir / "model.safetensors").stat().st_size + 65536


def _as_earlier_layout(folder: Path, dst: Path) -> Path:
    """A copy of ``folder`` laid out as exports without a shared weights file were: every graph
    holding its own initializers, no ``weights`` section, no weights file."""
    import json
    import shutil

    from helpers import rehash_export

    from transformer_ext.export_format import MANIFEST_NAME, WEIGHTS_FILE

    shutil.copytree(folder, dst)
    for graph in ("encoder.onnx", "decoder_step.onnx"):
        proto = onnx.load(dst / graph)  # the external data read into the graph
        onnx.save(proto, dst / graph)
    (dst / WEIGHTS_FILE).unlink()
    manifest = json.loads((dst / MANIFEST_NAME).read_text())
    del manifest["weights"]
    manifest["files"].remove(WEIGHTS_FILE)
    (dst / MANIFEST_NAME).write_text(json.dumps(manifest))
    rehash_export(dst)
    return dst


def test_an_export_without_a_shared_weights_file_still_loads(tied_export, tmp_path):
    import numpy as np

    from transformer_ext.runtimes import OrtRunner

    _, out = tied_export
    old = _as_earlier_layout(out, tmp_path / "old")
    src = np.array([[5, 9, 12, 7, 2], [6, 8, 2, 0, 0]], dtype=np.int64)
    lengths = np.array([5, 3], dtype=np.int64)
    new_tokens = OrtRunner(out).greedy(src, lengths, max_decoding_length=8)
    old_tokens = OrtRunner(old).greedy(src, lengths, max_decoding_length=8)
    assert [list(r) for r in new_tokens] == [list(r) for r in old_tokens]


def _damage(folder: Path, how: str) -> None:
    from transformer_ext.export_format import WEIGHTS_FILE

    path = folder / WEIGHTS_FILE
    if how == "missing":
        path.unlink()
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:-100])
    else:  # replaced by a file of the same size
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["missing", "truncated", "replaced"])
def test_a_damaged_shared_weights_file_is_one_line_naming_it_and_nothing_loads(
    tied_export, tmp_path, monkeypatch, capsys, how
):
    import shutil

    import onnxruntime

    from export import ManifestError
    from transformer_ext import translate
    from transformer_ext.runtimes import OrtRunner

    _, out = tied_export
    folder = tmp_path / "copy"
    shutil.copytree(out, folder)
    _damage(folder, how)
    sessions = []
    real = onnxruntime.InferenceSession
    monkeypatch.setattr(onnxruntime, "InferenceSession", lambda *a, **k: sessions.append(a) or real(*a, **k))
    with pytest.raises(ManifestError, match=f"{folder}/weights.data"):
        OrtRunner(folder)
    code = translate.main(["hello", "--model", str(folder)])
    err = capsys.readouterr().err
    assert code == 1 and f"{folder}/weights.data" in err and len(err.strip().splitlines()) == 1, err
    assert sessions == []  # no graph was loaded


# ------------------------------------------------------------------------------------------
# Quantized exports: 8-bit embedding tables, their bytes shared with the output projection
# ------------------------------------------------------------------------------------------


def _table_reads(folder: Path) -> dict:
    """``{(graph, op): (region, dims)}`` of what each embedding lookup and each weight product
    of a quantized folder reads as its quantized table / weight, external regions only."""
    import glob

    reads = {}
    for path in sorted(glob.glob(str(folder / "*.onnx"))):
        regions, proto = _regions(Path(path))
        dims = {t.name: list(t.dims) for t in proto.graph.initializer}
        for node in proto.graph.node:
            if node.op_type in ("GatherBlockQuantized", "MatMulNBits"):
                name = node.input[0 if node.op_type == "GatherBlockQuantized" else 1]
                if name not in regions:  # computed in the graph (the few-row step's layer weights)
                    continue
                reads.setdefault((Path(path).name, node.op_type), []).append((regions[name], dims[name]))
    return reads


def _dequantized_table(graph_path: Path, block: int):
    """The decoder's 8-bit lookup table read back as floats: ``(q - zero point) * scale`` per block."""
    import numpy as np
    from onnx import numpy_helper

    proto = onnx.load(graph_path)  # with the external data
    arrays = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    (gather,) = [n for n in proto.graph.node if n.op_type == "GatherBlockQuantized"]
    q, scales, zero = (arrays[name] for name in (gather.input[0], gather.input[2], gather.input[3]))
    rows, cols = q.shape
    blocks = q.astype(np.float32).reshape(rows, cols // block, block)
    return ((blocks - zero.reshape(rows, -1, 1).astype(np.float32)) * scales.reshape(rows, -1, 1)).reshape(
        rows, cols
    )


@pytest.mark.parametrize("scheme", ["int4"])
def test_quantized_embedding_tables_are_8_bit_and_shared_with_the_projection(tmp_path_factory, scheme):
    import numpy as np
    from helpers import quantized_dir
    from safetensors.numpy import load_file

    from transformer_ext.export_format import DECODER_FILE, FEW_ROWS_DECODER_FILE, WEIGHTS_FILE, read_manifest

    folder = quantized_dir(tmp_path_factory, scheme)
    manifest = read_manifest(folder, verify=True)
    section = manifest["quantization"]
    assert section["lookups"]["bits"] == 8 and manifest["weights"]["file"] == WEIGHTS_FILE
    block = section["lookups"]["block_size"]
    # the choice per tensor, in the manifest
    decoder_tensors = section["graphs"]["decoder_step"]["tensors"]
    table = "model.generator.proj.weight"
    assert decoder_tensors[table] == f"GatherBlockQuantized 8-bit, blocks of {block}"
    assert decoder_tensors[table + ".product"] == f"MatMulNBits 8-bit, blocks of {block}"
    assert section["graphs"]["encoder"]["tensors"]["model.src_embed.lut.weight"].startswith(
        "GatherBlockQuantized 8-bit"
    )

    # no float32 table or weight matrix is left in any graph
    for graph in [g for g in ("encoder.onnx", DECODER_FILE, FEW_ROWS_DECODER_FILE) if (folder / g).exists()]:
        _, proto = _regions(folder / graph)
        consumers = {i: n.op_type for n in proto.graph.node for i in n.input}
        for t in proto.graph.initializer:
            if len(t.dims) == 2 and t.data_type == onnx.TensorProto.FLOAT:
                assert consumers.get(t.name) not in ("Gather", "MatMul", "Gemm"), (graph, t.name)

    # the decoder's lookup and its output projection (and the few-row step's) read one region
    reads = _table_reads(folder)
    target_rows = 40  # the tiny model's target vocabulary
    tied = {
        region
        for (graph, op), entries in reads.items()
        if graph != "encoder.onnx"
        for region, dims in entries
        if dims[0] == target_rows and (op == "GatherBlockQuantized" or len(dims) == 3)
    }
    ops = {(graph, op) for (graph, op), entries in reads.items() for r, d in entries if r in tied}
    assert len(tied) == 1, tied
    expected = {(DECODER_FILE, "GatherBlockQuantized"), (DECODER_FILE, "MatMulNBits")}
    if section.get("few_rows"):
        expected |= {(FEW_ROWS_DECODER_FILE, "GatherBlockQuantized"), (FEW_ROWS_DECODER_FILE, "MatMulNBits")}
    assert ops == expected

    # the stored 8-bit table is the float32 table to within one quantization step
    deq = _dequantized_table(folder / DECODER_FILE, block)
    (float32,) = [
        v
        for v in load_file(folder.parent / "tiny_model" / "model.safetensors").values()
        if v.shape == (40, 32)
    ]
    step = (float32.max() - float32.min()) / 255
    assert np.abs(deq - float32).max() <= step


def _row_reads(folder: Path) -> dict:
    """``{(graph, op): [(region, dims)]}`` of the int8 tables an int8 folder's lookups (``Gather``
    of an int8 initializer) and tied projections (``QGemm``'s weight) read, external regions only."""
    import glob

    reads = {}
    for path in sorted(glob.glob(str(folder / "*.onnx"))):
        regions, proto = _regions(Path(path))
        inits = {t.name: t for t in proto.graph.initializer}
        for node in proto.graph.node:
            if node.op_type == "Gather" and node.input[0] in inits:
                name = node.input[0]
            elif node.op_type == "QGemm":
                name = node.input[3]
            else:
                continue
            if inits[name].data_type == onnx.TensorProto.INT8 and regions.get(name):
                reads.setdefault((Path(path).name, node.op_type), []).append(
                    (regions[name], list(inits[name].dims))
                )
    return reads


def test_int8_embedding_tables_are_int8_rows_shared_with_the_projection(tmp_path_factory):
    """An int8 folder stores each embedding table once as int8 rows with one scale per row: the
    lookups gather rows, the tied output projection is a QGemm (transB) over the same region,
    in the int8 step and in the few-row step; the rows are the float32 table rounded on a per-row
    7-bit grid, and the projection's kernel on them is the float64 product of the dequantized
    rows, up to the rounding of its uint8 activations."""
    import numpy as np
    import onnxruntime as ort
    from helpers import quantized_dir
    from onnx import TensorProto, helper, numpy_helper
    from safetensors.numpy import load_file

    from transformer_ext.export_format import DECODER_FILE, FEW_ROWS_DECODER_FILE, WEIGHTS_FILE, read_manifest

    folder = quantized_dir(tmp_path_factory, "int8")
    manifest = read_manifest(folder, verify=True)
    section = manifest["quantization"]
    assert section["lookups"]["per_row"] is True and section["lookups"]["bits"] == 8
    assert manifest["weights"]["file"] == WEIGHTS_FILE
    # the choice per tensor, in the manifest
    decoder_tensors = section["graphs"]["decoder_step"]["tensors"]
    table = "model.generator.proj.weight"
    assert decoder_tensors[table].startswith("int8 rows (7-bit range), one scale per row")
    assert decoder_tensors[table + ".product"].startswith("QGemm int8 (transB)")
    assert section["graphs"]["encoder"]["tensors"]["model.src_embed.lut.weight"].startswith("int8 rows")

    graphs = [g for g in ("encoder.onnx", DECODER_FILE, FEW_ROWS_DECODER_FILE) if (folder / g).exists()]
    assert FEW_ROWS_DECODER_FILE in graphs
    for graph in graphs:  # no float32 table or weight matrix is left, no block-wise table either
        _, proto = _regions(folder / graph)
        consumers = {i: n.op_type for n in proto.graph.node for i in n.input}
        assert not [n.name for n in proto.graph.node if n.op_type == "GatherBlockQuantized"]
        for t in proto.graph.initializer:  # (the row scales, [V, 1], are gathered)
            if len(t.dims) == 2 and t.dims[1] > 1 and t.data_type == onnx.TensorProto.FLOAT:
                assert consumers.get(t.name) not in ("Gather", "MatMul", "Gemm"), (graph, t.name)

    # the decoder's lookup, its output projection and the few-row step's read one region
    reads = _row_reads(folder)
    tied = {
        region
        for (graph, _), entries in reads.items()
        if graph != "encoder.onnx"
        for region, dims in entries
        if dims[0] == 40
    }
    ops = {(graph, op) for (graph, op), entries in reads.items() for region, _ in entries if region in tied}
    assert len(tied) == 1, tied
    assert ops == {
        (DECODER_FILE, "Gather"),
        (DECODER_FILE, "QGemm"),
        (FEW_ROWS_DECODER_FILE, "Gather"),
        (FEW_ROWS_DECODER_FILE, "QGemm"),
    }

    # the stored rows: per row, no more squared error than rounding on the row's full 7-bit range
    proto = onnx.load(folder / DECODER_FILE)  # with the external data
    arrays = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    (projection,) = [n for n in proto.graph.node if n.op_type == "QGemm"]
    rows, scales, zeros = (arrays[name] for name in projection.input[3:6])
    (float32,) = [
        v
        for v in load_file(folder.parent / "tiny_model" / "model.safetensors").values()
        if v.shape == (40, 32)
    ]
    deq = rows.astype(np.float64) * scales.astype(np.float64)[:, None]
    full_step = np.abs(float32).max(axis=1).astype(np.float64) / 63
    assert np.abs(rows.astype(np.int32)).max() <= 63 and not zeros.any()
    assert (np.square(deq - float32).sum(axis=1) <= 32 * np.square(full_step / 2) * (1 + 1e-6)).all()
    # the lookup's scales are the projection's: a Gather of the same rows reads [V, 1] of the same bytes
    gathers = [n for n in proto.graph.node if n.op_type == "Gather" and n.input[0] in arrays]
    lookup_scales = [arrays[n.input[0]] for n in gathers if arrays[n.input[0]].shape == (40, 1)]
    assert lookup_scales and all(np.array_equal(s.reshape(-1), scales) for s in lookup_scales)

    # the projection's kernel on those bytes, alone, against float64
    x = np.random.default_rng(0).standard_normal((5, 32)).astype(np.float32)
    node = helper.make_node(
        "QGemm", ["xq", "xs", "xz", "B", "S", "Z"], ["y"], domain="com.microsoft", transB=1
    )
    model = helper.make_model(
        helper.make_graph(
            [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]), node],
            "projection",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 32])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 40])],
            [numpy_helper.from_array(a, n) for a, n in ((rows, "B"), (scales, "S"), (zeros, "Z"))],
        ),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )
    (y,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )
    x_step = (max(x.max(), 0) - min(x.min(), 0)) / 255  # DynamicQuantizeLinear's uint8 grid
    bound = 0.5 * x_step * np.abs(deq).sum(axis=1) + 1e-5
    assert (np.abs(y - x.astype(np.float64) @ deq.T) <= bound).all()
