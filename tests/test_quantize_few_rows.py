"""The few-row decoder step of int8 exports (``decoder_step_few_rows.onnx``, export/quantize.py
``few_rows_graph``): written, listed and hashed; 8-bit MatMulNBits blocks of the size the model
allows; gated like the other graphs; chosen by ``OrtRunner`` by row count and threads; refused
options and malformed manifests. The demo model's gate of this graph: tests/test_quantize.py.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import exported_dir, quantized_dir

from export import quantize as quant
from export.quantize import QualityGateError, QuantizationError, quantize_export
from transformer_ext.export_format import (
    DECODER_FILE,
    FEW_ROWS_DECODER_FILE,
    ManifestError,
    manifest_few_rows,
    manifest_quantization,
    read_manifest,
)
from transformer_ext.runtimes import OrtRunner


@pytest.fixture(scope="module")
def tiny_float(tmp_path_factory) -> Path:
    return exported_dir(tmp_path_factory, "portable")


@pytest.fixture(scope="module")
def tiny_int8(tmp_path_factory) -> Path:
    return quantized_dir(tmp_path_factory, "int8")


def _sources(runner, rows: int):
    rng = np.random.default_rng(rows)
    ids = rng.integers(4, runner.info.src_vocab_size, size=(rows, 6))
    return ids, np.full(rows, 6)


def test_the_step_is_written_listed_hashed_and_8_bit(tiny_float, tiny_int8):
    manifest = read_manifest(tiny_int8, verify=True)  # every file's SHA-256 checked
    entry = manifest_few_rows(manifest)
    assert FEW_ROWS_DECODER_FILE in manifest["files"] and (tiny_int8 / FEW_ROWS_DECODER_FILE).is_file()
    assert (
        entry["max_rows"] == quant.FEW_ROWS["max_rows"]
        and entry["min_threads"] == quant.FEW_ROWS["min_threads"]
    )
    assert entry["bits"] == 8 and entry["kernel_compute"] == "int8" and entry["gate"] is None
    cfg = manifest["model_config"]
    # the largest power of two up to 256 dividing both input dimensions, found here by trial
    expected = max(b for b in (16, 32, 64, 128, 256) if cfg["d_model"] % b == 0 and cfg["d_ff"] % b == 0)
    assert entry["block_size"] == expected
    f32 = onnx.load(tiny_float / DECODER_FILE)
    inits = {t.name for t in f32.graph.initializer}
    weight_products = [n for n in f32.graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in inits]
    few = onnx.load(tiny_int8 / FEW_ROWS_DECODER_FILE)
    nbits = [n for n in few.graph.node if n.op_type == "MatMulNBits"]
    # the tied output projection is the int8 step's QGemm over the lookup's int8 rows
    tied = [n for n in few.graph.node if n.op_type == "QGemm"]
    assert len(tied) == 1 and len(nbits) + len(tied) == len(weight_products)
    assert len(nbits) == entry["graph"]["quantized_nodes"]
    for n in nbits:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert attrs["bits"] == 8 and attrs["block_size"] == expected and attrs["accuracy_level"] == 4
    # the same inputs and outputs as the step it stands in for
    step = onnx.load(tiny_int8 / DECODER_FILE, load_external_data=False)
    assert [i.name for i in few.graph.input] == [i.name for i in step.graph.input]
    assert [o.name for o in few.graph.output] == [o.name for o in step.graph.output]


def test_its_logits_are_near_float32_and_its_own(tiny_float, tiny_int8):
    """Every step through the few-row graph: logits near the float32 export's (quantization
    error, a few percent of their spread) and different from the dynamic int8 step's."""
    f32 = OrtRunner(tiny_float, intra_op_num_threads=1)
    few = OrtRunner(tiny_int8, intra_op_num_threads=1, few_rows="always")
    dyn = OrtRunner(tiny_int8, intra_op_num_threads=1, few_rows="never")
    ids, lengths = _sources(f32, 3)
    tokens = np.full(3, f32.info.bos_id)
    a, b, c = (np.asarray(r.step(r.encode(ids, lengths, cache_len=8), tokens)) for r in (f32, few, dyn))
    assert np.abs(a - b).max() <= 0.05 * (a.max() - a.min())
    assert not np.array_equal(b, c) and not np.array_equal(a, b)


def _external_regions(path: Path) -> tuple[dict, onnx.ModelProto]:
    """``{initializer name: (offset, length)}`` of a graph's initializers in the weights file."""
    proto = onnx.load(path, load_external_data=False)
    regions = {}
    for t in proto.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            regions[t.name] = (int(info["offset"]), int(info["length"]))
    return regions, proto


def _int8_sources(proto) -> dict[str, str]:
    """``{MatMulNBits node: the initializer its weight is made from}`` of the few-row step's layer
    products, whose weight input is ``BitwiseXor(Transpose(initializer))``."""
    producers = {o: n for n in proto.graph.node for o in n.output}
    inits = {t.name for t in proto.graph.initializer}
    sources = {}
    for node in proto.graph.node:
        if node.op_type != "MatMulNBits" or node.input[1] in inits:
            continue
        xor = producers[node.input[1]]
        transpose = producers[xor.input[0]]
        assert (xor.op_type, transpose.op_type) == ("BitwiseXor", "Transpose")
        assert transpose.input[0] in inits
        sources[node.name] = transpose.input[0]
    return sources


def test_its_layer_weights_are_the_int8_steps_bytes(tiny_int8):
    """The few-row step stores no weight of its own: each layer product reads the region of
    weights.data that the int8 step's MatMulInteger reads (the tied table's region is the
    lookup's: tests/test_export_weights.py); what only it reads are its per-block scales."""
    step_regions, step = _external_regions(tiny_int8 / DECODER_FILE)
    few_regions, few = _external_regions(tiny_int8 / FEW_ROWS_DECODER_FILE)
    int8_weights = {
        step_regions[n.input[1]]
        for n in step.graph.node
        if n.op_type == "MatMulInteger" and n.input[1] in step_regions
    }
    sources = _int8_sources(few)
    products = [n for n in few.graph.node if n.op_type == "MatMulNBits"]
    assert len(sources) == len(products)  # (the tied output projection is a QGemm on the lookup's rows)
    assert {few_regions[name] for name in sources.values()} == int8_weights
    encoder_regions, _ = _external_regions(tiny_int8 / "encoder.onnx")
    others = set(step_regions.values()) | set(encoder_regions.values())
    own = sorted(name for name, region in few_regions.items() if region not in others)
    assert all(name.endswith(".scales") for name in own), own  # (the tiny model's are inside the graph)


def test_onnx_runtime_folds_them_into_matmulnbits_weights(tiny_int8, tmp_path):
    """ONNX Runtime folds each Transpose / BitwiseXor pair when it loads the graph; the
    folded weight is the int8 step's weight transposed, plus 128 (MatMulNBits' zero point)."""
    import onnxruntime as ort
    from onnx import numpy_helper

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(tmp_path / "folded.onnx")
    ort.InferenceSession(str(tiny_int8 / FEW_ROWS_DECODER_FILE), options, providers=["CPUExecutionProvider"])
    # its unchanged initializers still point into the export's weights.data; the folded ones are new
    folded = onnx.load(tmp_path / "folded.onnx", load_external_data=False)
    assert not [n for n in folded.graph.node if n.op_type == "BitwiseXor"]
    few = onnx.load(tiny_int8 / FEW_ROWS_DECODER_FILE)  # with the external data
    arrays = {t.name: numpy_helper.to_array(t) for t in few.graph.initializer}
    folded_inits = {t.name: t for t in folded.graph.initializer}
    sources = _int8_sources(few)
    checked = 0
    for node in folded.graph.node:
        if node.name not in sources:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        k, n, block = attrs["K"], attrs["N"], attrs["block_size"]
        int8 = arrays[sources[node.name]].view(np.int8).reshape(k, n)  # the int8 step's bytes
        expected = (int8.T.astype(np.int16) + 128).astype(np.uint8).reshape(n, k // block, block)
        assert folded_inits[node.input[1]].data_location != onnx.TensorProto.EXTERNAL  # a folded tensor
        weight = numpy_helper.to_array(folded_inits[node.input[1]])
        assert weight.dtype == np.uint8 and np.array_equal(weight, expected), node.name
        checked += 1
    assert checked == len(sources) > 0


def test_the_runner_chooses_by_rows_and_threads(tiny_int8):
    two = OrtRunner(tiny_int8, intra_op_num_threads=2)
    assert two.encode(*_sources(two, 1), cache_len=8).session is not two.decoder
    assert two.encode(*_sources(two, 2), cache_len=8).session is not two.decoder
    state = two.encode(*_sources(two, 3), cache_len=8)
    assert state.session is two.decoder
    two.step(state, np.full(3, two.info.bos_id))
    two.select(state, np.array([0, 2]))  # finished rows removed: two left, the few-row step
    assert state.session is not two.decoder
    assert np.isfinite(two.step(state, np.full(2, 5))).all()
    beams = two.encode(*_sources(two, 1), cache_len=8, beam_size=4)
    assert beams.session is two.decoder  # four rows
    for runner in (
        OrtRunner(tiny_int8, intra_op_num_threads=1),  # fewer threads than the entry's min_threads
        OrtRunner(tiny_int8, intra_op_num_threads=2, few_rows="never"),
    ):
        assert runner.encode(*_sources(runner, 1), cache_len=8).session is runner.decoder
    always = OrtRunner(tiny_int8, intra_op_num_threads=1, few_rows="always")
    assert always.encode(*_sources(always, 5), cache_len=8).session is not always.decoder
    # the sessions a profiler reads (benchmarks/profiles/profile_decode.py)
    assert list(two.step_sessions) == [DECODER_FILE, FEW_ROWS_DECODER_FILE]
    assert two.step_sessions[FEW_ROWS_DECODER_FILE] is state.session
    assert list(OrtRunner(tiny_int8, intra_op_num_threads=1).step_sessions) == [DECODER_FILE]


def test_bad_runner_option_and_always_without_the_graph(tiny_float, tiny_int8):
    with pytest.raises(ValueError, match="few_rows must be one of"):
        OrtRunner(tiny_int8, few_rows="sometimes")
    with pytest.raises(
        ValueError, match=f"few_rows='always'.*no few-row decoder step.*{FEW_ROWS_DECODER_FILE}"
    ):
        OrtRunner(tiny_float, few_rows="always")
    assert OrtRunner(tiny_float).encode(*_sources(OrtRunner(tiny_float), 1), cache_len=8).session is not None


def test_without_the_graph_and_refused_options(tiny_float, tmp_path, capsys):
    out = tmp_path / "no_few"
    assert (
        quant.main(
            [
                "--model",
                str(tiny_float),
                "--output-dir",
                str(out),
                "--no-validate",
                "--no-few-rows-graph",
            ]
        )
        == 0
    )
    assert not (out / FEW_ROWS_DECODER_FILE).exists()
    manifest = read_manifest(out, verify=True)
    assert manifest_quantization(manifest)["few_rows"] is None and manifest_few_rows(manifest) is None
    capsys.readouterr()
    # another scheme: one line naming the flag, nothing written
    bad = tmp_path / "int4"
    code = quant.main(
        ["--model", str(tiny_float), "--output-dir", str(bad), "--scheme", "int4", "--no-few-rows-graph"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "--no-few-rows-graph applies to --quantize int8" in err and "Traceback" not in err
    assert not bad.exists()
    with pytest.raises(QuantizationError, match="few_rows must be true or false"):
        quantize_export(tiny_float, tmp_path / "x", "int8", gate=False, options={"few_rows": "yes"})
    assert not (tmp_path / "x").exists()
    # export.onnx: the flag without --quantize
    from export.onnx import main as export_main

    code = export_main(["--output-dir", str(tmp_path / "y"), "--no-few-rows-graph"])
    err = capsys.readouterr().err
    assert code == 2 and "--no-few-rows-graph" in err and "needs --quantize int8" in err
    assert not (tmp_path / "y").exists()


def test_a_failing_few_row_step_is_refused_naming_it(tiny_float, tmp_path, monkeypatch):
    """The gate runs for both steps; the few-row one losing 10% of the exact matches is refused,
    its file and the flag that leaves it out named, and nothing is written."""
    refs = [[5, 6, 7]] * 10
    monkeypatch.setattr(quant, "_heldout_batch", lambda folder: (np.full((10, 2), 5), np.full(10, 2), refs))
    calls = []

    def greedy(folder, ids, lengths, few_rows="never", search=None):
        calls.append(few_rows)
        return [[5, 6] if few_rows == "always" and i == 0 else [5, 6, 7] for i in range(10)]

    monkeypatch.setattr(quant, "_greedy_all", greedy)
    with pytest.raises(
        QualityGateError,
        match=rf"int8 few-row decoder step \({FEW_ROWS_DECODER_FILE}.*--no-few-rows-graph.*exact match 90.00% vs 100.00%",
    ):
        quantize_export(tiny_float, tmp_path / "new")
    assert "always" in calls and not (tmp_path / "new").exists()
    assert os.listdir(tmp_path) == []  # no temporary left
    # both pass: each record kept, the few-row one naming its graph
    monkeypatch.setattr(
        quant, "_greedy_all", lambda folder, ids, lengths, few_rows="never", search=None: [[5, 6, 7]] * 10
    )
    q = manifest_quantization(quantize_export(tiny_float, tmp_path / "ok"))
    assert q["gate"]["exact_match_int8"] == 100.0 and "graph" not in q["gate"]
    assert q["few_rows"]["gate"]["graph"] == FEW_ROWS_DECODER_FILE


def test_malformed_entries_are_refused(tiny_int8):
    manifest = read_manifest(tiny_int8)
    for key, value, fragment in (
        ("max_rows", 0, "quantization.few_rows.max_rows must be an integer >= 1"),
        ("min_threads", True, "quantization.few_rows.min_threads must be an integer >= 1"),
        ("file", "other.onnx", "quantization.few_rows.file must be"),
    ):
        bad = copy.deepcopy(manifest)
        bad["quantization"]["few_rows"][key] = value
        with pytest.raises(ManifestError, match=fragment):
            manifest_few_rows(bad)
    unlisted = copy.deepcopy(manifest)
    unlisted["files"].remove(FEW_ROWS_DECODER_FILE)
    with pytest.raises(ManifestError, match="not in its files list"):
        manifest_few_rows(unlisted)
    shaped = copy.deepcopy(manifest)
    shaped["quantization"]["few_rows"] = [1]
    with pytest.raises(ManifestError, match="few_rows must be null or an object"):
        manifest_few_rows(shaped)


def test_ab_exports_takes_the_option_as_a_word(tiny_int8):
    import argparse

    from benchmarks.probes import ab_exports

    p = argparse.ArgumentParser()
    variants = ab_exports.parse_variants(
        p, [f"a={tiny_int8}:few_rows=never", f"b={tiny_int8}:few_rows=always"]
    )
    assert variants["a"]["options"] == {"few_rows": "never"} and variants["b"]["options"] == {
        "few_rows": "always"
    }
    with pytest.raises(SystemExit):
        ab_exports.parse_variants(p, [f"a={tiny_int8}:few_rows=1", f"b={tiny_int8}"])


def test_not_written_without_an_int8_kernel_and_not_used_on_a_lesser_cpu(
    tiny_float, tiny_int8, tmp_path, monkeypatch
):
    """Where ONNX Runtime would run 8-bit MatMulNBits in float32, no few-row step is written; a
    runner on a CPU lacking an int8-kernel flag of the exporting CPU does not use one (auto)."""
    import transformer_ext.runtimes.ort as ort_module

    with monkeypatch.context() as m:
        m.setattr(quant, "kernel_compute", lambda bits, block, level: "float32")
        out = tmp_path / "no_kernel"
        q = manifest_quantization(quantize_export(tiny_float, out, "int8", gate=False))
    assert q["few_rows"] is None and not (out / FEW_ROWS_DECODER_FILE).exists()
    monkeypatch.setattr(
        ort_module, "quantization_cpu_warning", lambda manifest, folder="": "lacks avx512_vnni"
    )
    runner = OrtRunner(tiny_int8, intra_op_num_threads=2)
    assert runner.encode(*_sources(runner, 1), cache_len=8).session is runner.decoder
    always = OrtRunner(tiny_int8, intra_op_num_threads=2, few_rows="always")  # asked for: used
    assert always.encode(*_sources(always, 1), cache_len=8).session is not always.decoder


def test_not_written_for_a_step_with_external_weights(tiny_float, tiny_int8, tmp_path):
    """A float32 step over 2 GiB keeps its weights in decoder_step.onnx.data: no few-row step."""
    import shutil

    src = tmp_path / "f32"
    shutil.copytree(tiny_float, src)
    (src / (DECODER_FILE + ".data")).write_bytes(b"")
    dst = tmp_path / "out"
    dst.mkdir()
    assert quant.few_rows_graph(src, dst, read_manifest(tiny_float)["model_config"]) is None
    assert os.listdir(dst) == []
    step = tiny_int8 / DECODER_FILE  # the int8 step whose weight bytes the few-row step reads
    assert (
        quant.few_rows_graph(tiny_float, dst, read_manifest(tiny_float)["model_config"], int8_step=step)[
            "file"
        ]
        == FEW_ROWS_DECODER_FILE
    )
    # without the int8 step there are no bytes to share: one message naming it
    with pytest.raises(QuantizationError, match="reads the weights of the int8 decoder step"):
        quant.few_rows_graph(tiny_float, tmp_path / "empty", read_manifest(tiny_float)["model_config"])


def test_bench_decode_records_the_step(tiny_float, tiny_int8):
    from benchmarks.decode import bench_decode

    q = bench_decode.export_quantization(str(tiny_int8))
    assert (
        q["few_rows"]["file"] == FEW_ROWS_DECODER_FILE
        and q["few_rows"]["max_rows"] == quant.FEW_ROWS["max_rows"]
    )
    assert bench_decode.export_quantization(str(tiny_float)) is None
