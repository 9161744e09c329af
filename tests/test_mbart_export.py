"""mBART-50 exported to ONNX from a converted transformers checkpoint (learned positions with
offset 2, layernorm_embedding, GELU, final_logits_bias): the export's own float64 validation,
ONNX Runtime's per-step logits against transformers', text translated from the export folder
alone (torch unimportable, the target language forced first) against transformers' tokenizer +
generate(), int8 / int4 with their BLEU gate and the TensorRT readiness check."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from hf_checkpoints import sample_lines, transformers_mbart50_tokenizer, write_mbart50  # noqa: E402
from pretrained_exports import (  # noqa: E402
    generate,
    ort_step_logits,
    transformers_reference,
    translate_without_torch,
)

from export.onnx import export_onnx  # noqa: E402
from transformer_ext.convert import convert_transformers  # noqa: E402
from transformer_ext.export_format import manifest_quantization, read_manifest  # noqa: E402

MAX_POS = 64  # max_position_embeddings of the test checkpoint
T = 40
N_SOURCES = 32
PAD, EOS = 1, 2
SRC, TGT = "en_XX", "fr_XX"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(transformers folder, converted folder, validated export folder)."""
    root = tmp_path_factory.mktemp("mbart_export")
    hf = write_mbart50(root / "hf", seed=6)
    ours = convert_transformers(hf, root / "ours")
    return hf, ours, export_onnx(ours, root / "onnx").output_dir  # validation on


@functools.lru_cache(maxsize=None)
def _hf_model(path: str):
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(path).eval()


def _strip(rows: list[list[int]]) -> list[list[int]]:
    rows = [row[: row.index(EOS)] if EOS in row else row for row in rows]
    return [[t for t in row if t != PAD] for row in rows]


def _expected(hf, texts: list[str], **kwargs) -> tuple[list[list[int]], list[list[int]]]:
    """(transformers' source ids, its generate() tokens with the target language forced first)."""
    theirs = transformers_mbart50_tokenizer(hf, SRC, TGT)
    sources = [theirs(t)["input_ids"] for t in texts]
    forced = theirs.convert_tokens_to_ids(TGT)
    return sources, _strip(
        generate(_hf_model(str(hf)), sources, pad=PAD, forced_bos_token_id=forced, **kwargs)
    )


def test_export_validates_and_records_it(folders):
    manifest = read_manifest(folders[2])
    validation = manifest["validation"]
    assert validation is not None and validation["greedy"] and validation["beam"]
    config = manifest["model_config"]
    assert (config["positions"], config["pos_offset"], config["embedding_norm"]) == ("learned", 2, True)


def test_onnx_step_logits_match_transformers(folders):
    hf, _, export = folders
    config = read_manifest(export)["model_config"]
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([45, 17, 3, 9])
    ids = torch.randint(4, config["src_vocab_size"], (4, 45), generator=g)
    mask = torch.arange(45)[None, :] < lengths[:, None]
    ids = ids.masked_fill(~mask, config["pad_id"])
    tgt = torch.randint(4, config["tgt_vocab_size"], (4, T), generator=g)
    tgt[:, 0] = config["bos_id"]
    ref, allowed = transformers_reference(str(hf), ids, mask, tgt)
    got = ort_step_logits(export, ids.numpy(), lengths.numpy(), tgt.numpy())
    assert np.abs(ref).max() > 1.0
    diff = np.abs(got - ref)
    assert diff.max() <= allowed, f"max |diff| {diff.max():.3g} > {allowed:.3g}"


@pytest.mark.parametrize("where", ["encoder", "decoder"])
def test_validation_fails_on_a_norm_gain_one_percent_off(folders, where):
    """Negative control: the export validated against the model with the last layer's final
    LayerNorm gain 1% off (in the encoder, in the decoder) is refused, naming an output of that
    graph, beyond its bound (the tolerance, eager float32's error, the rounding floor)."""
    from export import ParityError
    from export import validate as validation
    from transformer_ext.checkpoint import load_model

    model = load_model(folders[1])
    layers = model.encoder.layers if where == "encoder" else model.decoder.layers
    with torch.no_grad():
        layers[-1].sublayer[-1].norm.weight.mul_(1.01)
    with pytest.raises(ParityError) as info:
        validation.validate_export(folders[2], model, tolerance=1e-4)
    assert info.value.output.startswith("encoder/" if where == "encoder" else "decoder_step/")
    assert info.value.max_diff > info.value.tolerance


def test_torch_free_translation_equals_generate(folders):
    """32 sources translated from the export folder alone with --source-lang / --target-lang:
    the source ids equal MBart50Tokenizer's, the beam and greedy tokens (fr_XX first) generate()'s."""
    hf, _, export = folders
    texts = sample_lines(N_SOURCES, seed=300)
    [result] = translate_without_torch(
        [{"dir": str(export), "texts": texts, "source_lang": SRC, "target_lang": TGT}]
    )
    sources, greedy = _expected(hf, texts, num_beams=1)
    _, beam = _expected(hf, texts)  # the checkpoint's generation config: 4 beams
    assert result["encoded"] == sources
    assert len({tuple(g) for g in greedy}) >= N_SOURCES // 4  # the outputs vary
    for kind, expected in (("greedy", greedy), ("beam", beam)):
        wrong = [i for i in range(N_SOURCES) if result[kind][i] != expected[i]]
        assert not wrong, f"{kind}: sources {wrong} differ from generate()"


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_exports_and_their_bleu_gate(folders, tmp_path, scheme):
    """int8 and int4, gated by BLEU against references written by transformers' generate(). The
    random-weight checkpoint is no trained model: quantization changes some greedy tokens, so the
    default gate (0.5 / 1.0 points) refuses it, writing nothing; with the drop allowed, the folder
    is written and its recorded BLEU is sacrebleu's of its own translations."""
    import sacrebleu

    from export.quantize import GateData, QualityGateError, quantize_export
    from transformer_ext.translator import Translator

    hf, _, export = folders
    texts = sample_lines(N_SOURCES, seed=301)
    _, greedy = _expected(hf, texts, num_beams=1)
    theirs = transformers_mbart50_tokenizer(hf, SRC, TGT)
    references = [theirs.decode(g, skip_special_tokens=True) for g in greedy]
    src, ref = tmp_path / "gate.src", tmp_path / "gate.ref"
    src.write_text("\n".join(texts) + "\n", encoding="utf-8")
    ref.write_text("\n".join(references) + "\n", encoding="utf-8")
    gate_data = GateData(src, ref, source_lang=SRC, target_lang=TGT)
    refused = tmp_path / "refused"
    with pytest.raises(QualityGateError, match=rf"{scheme} graphs fail the BLEU gate: BLEU .* vs 100\.00"):
        quantize_export(export, refused, scheme, gate_data=gate_data)
    assert not refused.exists()
    out = tmp_path / scheme
    quantize_export(export, out, scheme, gate_data=gate_data, max_bleu_drop=100.0)
    gate = manifest_quantization(read_manifest(out))["gate"]
    assert gate["examples"] == N_SOURCES and gate["bleu_float32"] == 100.0, gate
    translator = Translator.from_export_dir(out, source_lang=SRC, target_lang=TGT)
    hyps = translator.translate(texts, beam_size=1)
    assert gate[f"bleu_{scheme}"] == pytest.approx(round(sacrebleu.corpus_bleu(hyps, [references]).score, 2))


def test_tensorrt_readiness_check_passes(folders):
    from export.trt_readiness import check_export_dir

    report = check_export_dir(folders[2])
    assert report.ok, report
