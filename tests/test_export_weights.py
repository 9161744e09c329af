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
