"""The export validation's memory (export/validate.py): it holds one copy of the model, the float64
reference, made tensor by tensor; the standard-op attention (the graphs' float32 rounding) runs on
the validated model itself, switched on around each call and restored after."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from export import validate as validation
from transformer_ext import ops
from transformer_ext.checkpoint import load_model
from transformer_ext.config import TransformerConfig
from transformer_ext.export_format import MANIFEST_NAME
from transformer_ext.model import MultiHeadAttention, Transformer


def _t5_like(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    config = TransformerConfig.preset(
        "tiny",
        dropout=0.0,
        norm="rms",
        bias=False,
        scale_attention=False,
        relative_attention_buckets=8,
        relative_attention_max_distance=20,
        positions="none",
        norm_first=True,
    )
    return Transformer(config).eval()


def _attention_modules(model):
    return [m for m in model.modules() if isinstance(m, MultiHeadAttention)]


def test_standard_ops_attention_runs_the_model_without_kernels_and_restores_it(monkeypatch):
    """Inside the context the model's encoder and decoder steps never call a fused attention op
    and compute what the kernels compute; after it (an exception included) every attention
    module is as it was, a per-instance setting included."""
    model = _t5_like()
    ids = torch.randint(4, model.config.src_vocab_size, (3, 7))
    lengths = torch.tensor([7, 4, 1])
    ids[1, 4:] = ids[2, 1:] = model.config.pad_id
    n, h, d = model.config.n_decoder_layers, model.config.n_heads, model.config.d_k
    caches = [torch.randn(3, h, 5, d) for _ in range(2 * n)]
    positions, tokens = torch.tensor([4, 2, 0]), torch.tensor([[5], [6], [7]])
    with torch.inference_mode():
        enc, ks, vs = model.encode(ids, lengths)
        step = model.decode_step(tokens, positions, lengths, caches[:n], caches[n:], ks, vs)[0]
    odd = _attention_modules(model)[1]
    odd.fused_attention = True  # set on the instance: restored as an instance attribute

    def refuse(*args, **kwargs):
        raise AssertionError("a fused attention kernel was called")

    with monkeypatch.context() as m:
        m.setattr(ops, "attention", refuse)
        m.setattr(ops, "decode_attention", refuse)
        with torch.inference_mode(), validation.standard_ops_attention(model):
            enc_s, ks_s, vs_s = model.encode(ids, lengths)
            step_s = model.decode_step(tokens, positions, lengths, caches[:n], caches[n:], ks_s, vs_s)[0]
    torch.testing.assert_close(enc_s, enc, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step_s, step, rtol=1e-5, atol=1e-5)
    assert all(a.fused_attention for a in _attention_modules(model))
    assert [("fused_attention" in a.__dict__) for a in _attention_modules(model)] == [
        a is odd for a in _attention_modules(model)
    ]
    with pytest.raises(RuntimeError, match="inside"):
        with validation.standard_ops_attention(model):
            assert not any(a.fused_attention for a in _attention_modules(model))
            raise RuntimeError("inside")
    assert all(a.fused_attention for a in _attention_modules(model))


def test_float64_copy_is_exact_and_keeps_tied_weights():
    """The reference: every parameter float64 with the float32 values exactly, tied weights one
    tensor, the model itself unchanged."""
    config = TransformerConfig.preset("tiny", dropout=0.0, tie_target_embeddings=True)
    torch.manual_seed(1)
    model = Transformer(config).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model64 = validation.float64_copy(model)
    assert all(p.dtype == torch.float64 for p in model64.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ours, theirs = dict(model.named_parameters()), dict(model64.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        assert torch.equal(theirs[name], p.double()), name
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]), name
    n_ours = len({id(p) for p in model.parameters()})
    assert len({id(p) for p in model64.parameters()}) == n_ours  # ties kept, nothing shared with model
    assert not {id(p) for p in model64.parameters()} & {id(p) for p in model.parameters()}


def test_validation_copies_the_model_once(monkeypatch, exported_portable):
    """A whole validation deep-copies the model once (the float64 reference) and measures the
    standard-op attention all the same (its errors are in the report); the model keeps its
    kernels after."""
    manifest = json.loads((exported_portable / MANIFEST_NAME).read_text())
    model = load_model(manifest["export"]["source_model_dir"])
    copies, depth = [], [0]
    real_deepcopy = copy.deepcopy

    def counting(x, memo=None, *args):  # copy's own recursion goes through here too: top level only
        if depth[0] == 0 and isinstance(x, torch.nn.Module):
            copies.append(type(x).__name__)
        depth[0] += 1
        try:
            return real_deepcopy(x, memo, *args)
        finally:
            depth[0] -= 1

    monkeypatch.setattr(copy, "deepcopy", counting)
    report = validation.validate_export(
        exported_portable, model, tolerance=1e-4, seed=3, decode_batch=2, max_new_tokens=4, beam_size=2
    )
    assert copies == ["Transformer"]
    assert report.standard_ops_error and report.greedy["standard_ops_error_per_step"]
    assert report.beam["standard_ops_error_per_step"]
    assert all(a.fused_attention for a in _attention_modules(model))
    assert not any("fused_attention" in a.__dict__ for a in _attention_modules(model))
