"""The export validation's bound on its own (export/validate.py): eager float32's own error is
measured with the fused kernels and with the standard-op attention that the graphs compute, the
larger counting, so an eager kernel more accurate than those ops (the position-bias kernels on
T5's unscaled scores) cannot pull the bound below ONNX Runtime's float32 rounding; a graph 1% off
still fails. The bound on real exports: tests/test_t5_export.py (the five T5 families with the
bias in the kernels, and the negative controls), tests/test_gates.py, tests/test_mbart_export.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from export import ParityError
from export import validate as validation
from transformer_ext import ops
from transformer_ext.config import TransformerConfig
from transformer_ext.model import MultiHeadAttention, Transformer

MAGNITUDE = 20.0  # the logits' largest |value|


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


def test_the_standard_ops_copy_computes_attention_without_the_kernels(monkeypatch):
    """``standard_ops_copy``: a copy (the model keeps its kernels) whose encoder and decoder steps
    never call the fused attention ops, and compute what the model computes."""
    model = _t5_like()
    standard = validation.standard_ops_copy(model)
    assert all(m.fused_attention for m in model.modules() if isinstance(m, MultiHeadAttention))
    assert not any(m.fused_attention for m in standard.modules() if isinstance(m, MultiHeadAttention))
    ids = torch.randint(4, model.config.src_vocab_size, (3, 7))
    lengths = torch.tensor([7, 4, 1])
    ids[1, 4:] = ids[2, 1:] = model.config.pad_id
    with torch.inference_mode():
        enc, ks, vs = model.encode(ids, lengths)
        n, h, d = model.config.n_decoder_layers, model.config.n_heads, model.config.d_k
        caches = [torch.randn(3, h, 5, d) for _ in range(2 * n)]
        positions = torch.tensor([4, 2, 0])
        tokens = torch.tensor([[5], [6], [7]])
        step = model.decode_step(tokens, positions, lengths, caches[:n], caches[n:], ks, vs)[0]

    def refuse(*args, **kwargs):
        raise AssertionError("a fused attention kernel was called")

    monkeypatch.setattr(ops, "attention", refuse)
    monkeypatch.setattr(ops, "decode_attention", refuse)
    with torch.inference_mode():
        enc_s, ks_s, vs_s = standard.encode(ids, lengths)
        step_s = standard.decode_step(tokens, positions, lengths, caches[:n], caches[n:], ks_s, vs_s)[0]
    torch.testing.assert_close(enc_s, enc, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step_s, step, rtol=1e-5, atol=1e-5)


class _Recorded:
    """What :class:`export.validate._Recorder` keeps: the logits of every step and what was fed."""

    def __init__(self, logits, fed):
        self.logits, self.fed = logits, fed
        self.encoded = ((), {})


class _Replaying:
    """A runner replaying fixed logits (the ``reference`` / ``standard`` of ``_compare_decodes``)."""

    def __init__(self, logits):
        self.logits = logits

    def encode(self):
        return {"step": 0}

    def step(self, state, tokens):
        out = self.logits[state["step"]]
        state["step"] += 1
        return out

    def reorder(self, state, beam_index):
        pass


def _decodes(onnx_offset, standard_offset):
    """Three steps of float64 logits of magnitude MAGNITUDE; eager float32 equal to them (a kernel
    as exact as float64), the standard-op attention's ``+ standard_offset`` and ONNX Runtime's
    ``+ onnx_offset(step, logits)``."""
    rng = np.random.default_rng(0)
    logits64 = [rng.uniform(-MAGNITUDE, MAGNITUDE, size=(2, 50)) for _ in range(3)]
    fed = [(np.array([1, 1]), None), (np.array([5, 6]), None), (np.array([7, 8]), None)]
    eager = _Recorded([x.copy() for x in logits64], fed)
    onnx_rec = _Recorded([x + onnx_offset(s, x) for s, x in enumerate(logits64)], fed)
    standard = _Replaying([x + standard_offset for x in logits64])
    return eager, onnx_rec, [[5, 7], [6, 8]], _Replaying(logits64), standard


def test_the_standard_ops_rounding_bounds_the_export_where_the_kernel_is_exact():
    """Eager's kernel exactly on float64, the standard-op attention 3e-4 off (T5's rounding of
    unscaled scores), ONNX Runtime 2e-3 off (within 8x that): passes, held to 8 x 3e-4; held to
    the kernel's error alone (no standard runner) it would fail."""
    eager, onnx_rec, tokens, reference, standard = _decodes(lambda s, x: np.full_like(x, 2e-3), 3e-4)
    report = validation.ValidationReport(tolerance=1e-4)
    result = validation._compare_decodes(
        report, "greedy", eager, onnx_rec, tokens, tokens, "case", reference, standard
    )
    assert result["standard_ops_error_per_step"] == pytest.approx([3e-4] * 3)
    assert result["float32_error_per_step"] == pytest.approx([3e-4] * 3)
    assert result["allowed"] == pytest.approx(validation.FLOAT32_ERROR_FACTOR * 3e-4)
    assert result["tokens_identical"]
    eager, onnx_rec, tokens, reference, _ = _decodes(lambda s, x: np.full_like(x, 2e-3), 3e-4)
    with pytest.raises(ParityError):  # the kernel's own error (0) alone: only the tolerance
        validation._compare_decodes(report, "greedy", eager, onnx_rec, tokens, tokens, "case", reference)


@pytest.mark.parametrize("step", [0, 2])
def test_logits_one_percent_off_still_fail(step):
    """One logit of one step off by 1% of the magnitude (a weight 1% off moves logits by about
    that) with the same float32 errors: a ParityError at that step, far beyond the bound."""

    def offset(s, x):
        out = np.zeros_like(x)
        if s == step:
            out[1, 3] = 0.01 * MAGNITUDE
        return out

    eager, onnx_rec, tokens, reference, standard = _decodes(offset, 3e-4)
    with pytest.raises(ParityError) as info:
        validation._compare_decodes(
            validation.ValidationReport(tolerance=1e-4),
            "greedy",
            eager,
            onnx_rec,
            tokens,
            tokens,
            "case",
            reference,
            standard,
        )
    err = info.value
    assert (err.output, err.step) == ("greedy decode logits", step)
    assert err.max_diff == pytest.approx(0.2) and err.tolerance == pytest.approx(8 * 3e-4)


def test_an_output_takes_the_larger_float32_error():
    """``_record``: eager's error and the standard-op attention's recorded; the larger sets the
    bound, and the table and error message say which errors were measured."""
    report = validation.ValidationReport(tolerance=1e-4)
    ref = np.full((2, 3), 10.0)
    validation._record(
        report, "encoder", "encoder_out", ref + 1e-3, ref + 1e-5, "c", reference=ref, standard=ref + 2e-4
    )
    assert report.standard_ops_error["encoder/encoder_out"] == pytest.approx(2e-4)
    assert report.float32_error["encoder/encoder_out"] == pytest.approx(2e-4)
    assert report.allowed["encoder/encoder_out"] == pytest.approx(1.6e-3)
    with pytest.raises(ParityError, match="standard-op attention"):
        validation._record(
            report, "encoder", "encoder_out", ref * 1.01, ref, "c", reference=ref, standard=ref + 2e-4
        )
    assert "standard-op attention" in report.table()
