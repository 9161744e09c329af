"""The T5 family (T5 v1.0, T5 v1.1, mT5, UMT5, MADLAD-400) exported to ONNX from converted
transformers checkpoints: the export's own float64 validation, ONNX Runtime's per-step logits
against transformers', text translated from the export folder alone (torch unimportable) against
transformers' tokenizer + generate(), the relative bias as a table (negative controls: a wrong
bucket, the wrong direction), the tensorscatter flavour, int8 / int4 with their BLEU gate, the
TensorRT readiness check and the refusal of the ort flavour."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from hf_checkpoints import MADLAD_TEST_CODES, sample_lines, transformers_t5_tokenizer, write_t5  # noqa: E402
from pretrained_exports import (  # noqa: E402
    generate,
    ort_step_logits,
    transformers_reference,
    translate_without_torch,
)

from export import ExportError, ParityError  # noqa: E402
from export import position_bias as position_bias_module  # noqa: E402
from export.onnx import export_onnx  # noqa: E402
from transformer_ext.convert import convert_transformers  # noqa: E402
from transformer_ext.export_format import read_manifest  # noqa: E402

FAMILIES = {  # the checkpoints of tests/test_t5.py
    "t5_v1_0": dict(variant="t5", seed=1),
    "t5_v1_1": dict(variant="t5_v1_1", seed=2),
    "mt5": dict(variant="mt5", seed=3),
    "umt5": dict(variant="umt5", seed=4),
    "madlad": dict(variant="t5_v1_1", madlad=True, seed=5),
}
NAMES = sorted(FAMILIES)
CACHE_LEN = 48  # the exports' largest cache: the 40 positions of the logits test
T = 40  # decoder positions of the logits test (beyond max_distance 20: the far buckets are used)
N_SOURCES = 32
EOS = 1


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> (transformers folder, converted folder, validated export folder)."""
    root = tmp_path_factory.mktemp("t5_export")
    out = {}
    for name, kwargs in FAMILIES.items():
        hf = write_t5(root / f"{name}_hf", **kwargs)
        ours = convert_transformers(hf, root / f"{name}_ours")
        export = export_onnx(ours, root / f"{name}_onnx", cache_len=CACHE_LEN)  # validation on
        out[name] = (hf, ours, export.output_dir)
    return out


@functools.lru_cache(maxsize=None)
def _hf_model(path: str):
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(path).eval()


def _texts(name: str, n: int = N_SOURCES, seed: int = 400) -> list[str]:
    lines = sample_lines(n, seed=seed + len(name))
    if name == "madlad":  # MADLAD-400: the target language token first
        lines = [f"<2{MADLAD_TEST_CODES[i % 4]}> {line}" for i, line in enumerate(lines)]
    return lines


def _until_eos(rows: list[list[int]]) -> list[list[int]]:
    # T5 may generate <pad> itself: only what follows </s> is padding
    return [row[: row.index(EOS)] if EOS in row else row for row in rows]


def test_exports_validate_and_record_it(folders):
    """Every family exported with the float64 validation on; the relative bias is a table lookup
    (no bucket arithmetic in the graphs), UMT5 reads one table per layer."""
    for name in NAMES:
        _, ours, export = folders[name]
        manifest = read_manifest(export)
        validation = manifest["validation"]
        assert validation is not None and validation["greedy"] and validation["beam"], name
        assert max(validation["max_abs_diff"].values()) <= max(validation["allowed"].values())
        assert manifest["model_config"]["d_kv"] == 12
        assert manifest["graphs"]["decoder_step"]["inputs"][3]["shape"][3] == 12  # self_key.0: d_kv
        for graph in ("encoder.onnx", "decoder_step.onnx"):
            ops = {n.op_type for n in onnx.load(export / graph, load_external_data=False).graph.node}
            assert "Log" not in ops, (name, graph, sorted(ops))


@pytest.mark.parametrize("name", NAMES)
def test_onnx_step_logits_match_transformers(folders, name):
    """ONNX Runtime's decoder steps on a ragged batch, every position up to the last, against
    transformers' teacher-forced logits in float64, within the export validator's bound (float32
    rounding measured on transformers itself)."""
    hf, _, export = folders[name]
    config = read_manifest(export)["model_config"]
    g = torch.Generator().manual_seed(len(name))
    lengths = torch.tensor([45, 17, 3, 9])
    ids = torch.randint(3, config["src_vocab_size"], (4, 45), generator=g)
    mask = torch.arange(45)[None, :] < lengths[:, None]
    ids = ids.masked_fill(~mask, config["pad_id"])
    tgt = torch.randint(3, config["tgt_vocab_size"], (4, T), generator=g)
    tgt[:, 0] = config["bos_id"]
    ref, allowed = transformers_reference(str(hf), ids, mask, tgt)
    got = ort_step_logits(export, ids.numpy(), lengths.numpy(), tgt.numpy())
    assert np.abs(ref).max() > 1.0
    diff = np.abs(got - ref)
    assert diff.max() <= allowed, (
        f"{name}: max |diff| {diff.max():.3g} > {allowed:.3g} at {np.unravel_index(diff.argmax(), diff.shape)}"
    )


def test_torch_free_translation_equals_generate(folders):
    """Text in, tokens out from each export folder alone (ONNX Runtime, its tokenizer and generation
    config; torch unimportable), on 32 sources per family: the source ids equal transformers'
    tokenizer's, the beam (the checkpoint's 4 beams) and greedy tokens equal generate()'s."""
    # MADLAD's sources carry their <2xx> tokens; its translator still needs a default language
    specs = [
        {
            "dir": str(folders[name][2]),
            "texts": _texts(name),
            "target_lang": "de" if name == "madlad" else None,
        }
        for name in NAMES
    ]
    results = translate_without_torch(specs)
    for name, result in zip(NAMES, results):
        hf = folders[name][0]
        theirs = transformers_t5_tokenizer(hf)
        sources = [theirs(text)["input_ids"] for text in _texts(name)]
        assert result["encoded"] == sources, f"{name}: source ids differ from transformers' tokenizer"
        model = _hf_model(str(hf))
        greedy = _until_eos(generate(model, sources, pad=0, num_beams=1))
        beam = _until_eos(generate(model, sources, pad=0))  # the checkpoint's generation config: 4 beams
        assert len({tuple(g) for g in greedy}) >= N_SOURCES // 4, f"{name}: the outputs do not vary"
        for kind, expected in (("greedy", greedy), ("beam", beam)):
            wrong = [i for i in range(N_SOURCES) if result[kind][i] != expected[i]]
            assert not wrong, f"{name} {kind}: sources {wrong} differ from generate()"


# ------------------------------------------------------------------------------------------
# negative controls: the export's validation catches a wrong table
# ------------------------------------------------------------------------------------------


def _wrong_buckets(monkeypatch, edit):
    real = position_bias_module.relative_buckets

    def wrong(module, max_len):
        return edit(real(module, max_len), module, max_len)

    monkeypatch.setattr(position_bias_module, "relative_buckets", wrong)


def test_validation_fails_on_one_wrong_bucket(folders, tmp_path, monkeypatch):
    """The decoder's distance 5 (a far bucket of the 8-bucket model) moved one bucket up in the
    graph's table: the export's validation fails on the decoder step and writes nothing."""

    def shift(buckets, module, max_len):
        if module.bidirectional:
            return buckets
        buckets = buckets.clone()
        buckets[max_len - 1 - 5] = min(int(buckets[max_len - 1 - 5]) + 1, module.num_buckets - 1)
        return buckets

    _wrong_buckets(monkeypatch, shift)
    out = tmp_path / "onnx"
    with pytest.raises(ParityError, match="decoder_step|greedy|beam"):
        export_onnx(folders["t5_v1_0"][1], out, cache_len=16)
    assert not out.exists()


def test_validation_fails_on_the_wrong_bias_direction(folders, tmp_path, monkeypatch):
    """The encoder's table read as query minus key: the export's validation fails on the encoder."""

    def flip(buckets, module, max_len):
        return buckets.flip(0) if module.bidirectional else buckets

    _wrong_buckets(monkeypatch, flip)
    with pytest.raises(ParityError, match="encoder_out"):
        export_onnx(folders["umt5"][1], tmp_path / "onnx", cache_len=16)
    assert not (tmp_path / "onnx").exists()


@pytest.mark.parametrize("where", ["encoder", "decoder"])
def test_validation_fails_on_a_norm_gain_one_percent_off(folders, where):
    """mT5 (whose beam decode ONNX Runtime computes less exactly than the position-bias kernels
    do eager float32): the export validated against the model with the last layer's last RMS norm
    gain 1% off (in the encoder, in the decoder) is refused, naming an output of that graph."""
    from export import validate as validation
    from transformer_ext.checkpoint import load_model

    model = load_model(folders["mt5"][1])
    layers = model.encoder.layers if where == "encoder" else model.decoder.layers
    with torch.no_grad():
        layers[-1].sublayer[-1].norm.weight.mul_(1.01)
    with pytest.raises(ParityError) as info:
        validation.validate_export(folders["mt5"][2], model, tolerance=1e-4)
    assert info.value.output.startswith("encoder/" if where == "encoder" else "decoder_step/")
    assert info.value.max_diff > info.value.tolerance


# ------------------------------------------------------------------------------------------
# the other flavours, TensorRT readiness
# ------------------------------------------------------------------------------------------


def test_tensorscatter_flavour_validates(folders, tmp_path):
    """The cache update inside the graph: the bias over the updated cache (the new key at its
    position), validated against eager float64 like the portable graphs."""
    result = export_onnx(folders["umt5"][1], tmp_path / "ts", flavour="tensorscatter", cache_len=16)
    assert result.manifest["flavour"] == "tensorscatter" and result.manifest["validation"]["beam"]


def test_ort_flavour_is_refused_in_one_line(folders, tmp_path):
    out = tmp_path / "ort"
    with pytest.raises(ExportError) as info:
        export_onnx(folders["t5_v1_1"][1], out, flavour="ort")
    message = str(info.value)
    assert "GroupQueryAttention (the ort flavour) takes no relative position bias" in message
    assert "--flavour portable or tensorscatter" in message and "\n" not in message
    assert not out.exists()


# ------------------------------------------------------------------------------------------
# int8 and int4 with their BLEU gate
# ------------------------------------------------------------------------------------------


def _gate_files(hf, root, name):
    texts = _texts(name, seed=500)
    theirs = transformers_t5_tokenizer(hf)
    greedy = _until_eos(
        generate(_hf_model(str(hf)), [theirs(t)["input_ids"] for t in texts], pad=0, num_beams=1)
    )
    src, ref = root / f"{name}.src", root / f"{name}.ref"
    src.write_text("\n".join(texts) + "\n", encoding="utf-8")
    ref.write_text(
        "\n".join(theirs.decode(g, skip_special_tokens=True) for g in greedy) + "\n", encoding="utf-8"
    )
    return texts, src, ref


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_exports_and_their_bleu_gate(folders, tmp_path, scheme):
    """int8 and int4 (MatMulNBits; blocks of 16: the attention output's input is 4 x 12 = 48 wide)
    of T5 v1.1, gated by BLEU against references written by transformers' generate(). These
    random-weight checkpoints are no trained model: quantization changes some greedy tokens, so
    the default gate (0.5 / 1.0 points) refuses them, writing nothing; with the drop allowed, the
    folder is written and its recorded BLEU is sacrebleu's of its own translations."""
    import sacrebleu

    from export.quantize import GateData, QualityGateError, quantize_export
    from transformer_ext.export_format import manifest_quantization
    from transformer_ext.translator import Translator

    hf, _, export = folders["t5_v1_1"]
    texts, src, ref = _gate_files(hf, tmp_path, "t5_v1_1")
    refused = tmp_path / "refused"
    with pytest.raises(QualityGateError, match=rf"{scheme} graphs fail the BLEU gate: BLEU .* vs 100\.00"):
        quantize_export(export, refused, scheme, gate_data=GateData(src, ref))
    assert not refused.exists()
    out = tmp_path / scheme
    quantize_export(export, out, scheme, gate_data=GateData(src, ref), max_bleu_drop=100.0)
    gate = manifest_quantization(read_manifest(out))["gate"]
    assert gate["examples"] == N_SOURCES and gate["bleu_float32"] == 100.0, gate
    hyps = Translator.from_export_dir(out).translate(texts, beam_size=1)
    refs = [ref.read_text(encoding="utf-8").splitlines()]
    assert gate[f"bleu_{scheme}"] == pytest.approx(round(sacrebleu.corpus_bleu(hyps, refs).score, 2))


def test_tensorrt_readiness_check_passes(folders):
    from export.trt_readiness import check_export_dir

    for name in ("t5_v1_0", "umt5"):
        report = check_export_dir(folders[name][2])
        assert report.ok, report


_NORM_PARTS = {"Pow", "ReduceMean", "Sqrt", "Reciprocal"}


def _optimized_ops(graph_path, tmp_path) -> list[str]:
    """The op types of ``graph_path`` as ONNX Runtime's CPU session runs it (the runner's
    optimization level and disabled optimizers)."""
    import onnxruntime as ort

    from transformer_ext.runtimes.ort import DISABLED_OPTIMIZERS

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / f"optimized_{graph_path.name}")
    ort.InferenceSession(
        str(graph_path),
        options,
        providers=["CPUExecutionProvider"],
        disabled_optimizers=list(DISABLED_OPTIMIZERS),
    )
    return [
        n.op_type for n in onnx.load(options.optimized_model_filepath, load_external_data=False).graph.node
    ]


@pytest.mark.parametrize("name", ["t5_v1_1", "umt5"])
def test_rms_norms_run_fused_on_rows(folders, name, tmp_path):
    """Every RMS norm of the decoder step reaches ONNX Runtime in the form it fuses into one
    ``SimplifiedLayerNormalization`` (none of the norm's six nodes left), as does every norm of
    the encoder's layers (its final norm writes the graph output ``encoder_out``, which stays
    3-D), and in the decoder step the norms run on ``[rows, d_model]`` with the projections
    around them: no ``Reshape`` between a norm's nodes."""
    _, _, export = folders[name]
    config = read_manifest(export)["model_config"]
    step_norms = 3 * config["n_decoder_layers"] + 1
    ops = _optimized_ops(export / "decoder_step.onnx", tmp_path)
    assert ops.count("SimplifiedLayerNormalization") == step_norms, sorted(set(ops))
    assert not _NORM_PARTS & set(ops), sorted(_NORM_PARTS & set(ops))
    ops = _optimized_ops(export / "encoder.onnx", tmp_path)
    assert ops.count("SimplifiedLayerNormalization") >= 2 * config["n_encoder_layers"], sorted(set(ops))
    step = onnx.load(export / "decoder_step.onnx", load_external_data=False).graph
    producer = {o: n.op_type for n in step.node for o in n.output}
    reshaped = [producer.get(n.input[0]) for n in step.node if n.op_type == "Reshape"]
    assert not _NORM_PARTS & set(reshaped), sorted(set(reshaped))
