"""The additive position bias of ops.attention and ops.decode_attention (T5's relative bias), and
the relative-position buckets, against the pure-PyTorch reference, float64 and autograd."""

from __future__ import annotations

import math

import pytest
import torch

from transformer_ext import ops, reference
from transformer_ext.model import relative_position_bucket


def _qkv(B, H, Q, K, D, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(shape, generator=g, dtype=dtype) for shape in ((B, H, Q, D), (B, H, K, D), (B, H, K, D))
    )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias_shape", ["per_head", "per_row"])
def test_attention_with_position_bias_matches_the_reference(causal, bias_shape):
    B, H, Q, K, D = 3, 2, 5, 5, 4
    q, k, v = _qkv(B, H, Q, K, D, torch.float32)
    shape = (1, H, Q, K) if bias_shape == "per_head" else (B, H, Q, K)
    bias = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([5, 2, 4])
    got = ops.attention(q, k, v, key_lengths=lengths, scale=1.0, causal=causal, position_bias=bias)
    want = reference.attention(q, k, v, key_lengths=lengths, scale=1.0, causal=causal, position_bias=bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # the bias matters: without it the result is different
    plain = ops.attention(q, k, v, key_lengths=lengths, scale=1.0, causal=causal)
    assert (plain - want).abs().max() > 1e-2
    # a zero bias is the kernel's result exactly up to rounding
    zero = ops.attention(
        q, k, v, key_lengths=lengths, scale=0.5, causal=causal, position_bias=torch.zeros(shape)
    )
    torch.testing.assert_close(zero, ops.attention(q, k, v, key_lengths=lengths, scale=0.5, causal=causal))


def test_attention_with_position_bias_float64_against_a_direct_formula():
    """An independent spelling: softmax(q k^T * s + bias + mask) v in float64."""
    B, H, Q, K, D = 2, 3, 4, 6, 5
    q, k, v = _qkv(B, H, Q, K, D)
    bias = torch.randn(1, H, Q, K, dtype=torch.float64)
    lengths = torch.tensor([6, 3])
    got = ops.attention(q, k, v, key_lengths=lengths, scale=0.3, position_bias=bias)
    mask = torch.where(torch.arange(K)[None, :] < lengths[:, None], 0.0, -math.inf).view(B, 1, 1, K)
    want = torch.softmax(q @ k.transpose(-1, -2) * 0.3 + bias + mask, -1) @ v
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_gradients_with_position_bias(causal):
    """gradcheck in float64 on tiny shapes, the bias differentiated too (it is a trained table)."""
    B, H, Q, K, D = 2, 2, 3, 4 if not causal else 3, 3
    q, k, v = (t.requires_grad_() for t in _qkv(B, H, Q, K, D))
    bias = torch.randn(1, H, Q, K, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([K, 2])

    def f(q, k, v, bias):
        return ops.attention(q, k, v, key_lengths=lengths, scale=1.0, causal=causal, position_bias=bias)

    assert torch.autograd.gradcheck(f, (q, k, v, bias))
    # and the gradients agree with the reference's (autograd through the spelled-out ops)
    out = f(q, k, v, bias)
    grads = torch.autograd.grad(out.sum(), (q, k, v, bias))
    ref = reference.attention(q, k, v, key_lengths=lengths, scale=1.0, causal=causal, position_bias=bias)
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v, bias))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_attention_with_bias_keeps_the_kernels_dropout_mask():
    """The same seed drops the same probabilities with and without a (zero) bias."""
    q, k, v = _qkv(2, 2, 4, 4, 3, torch.float32)
    a = ops.attention(q, k, v, dropout_p=0.3, seed=11)
    b = ops.attention(q, k, v, dropout_p=0.3, seed=11, position_bias=torch.zeros(1, 2, 4, 4))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_bias_of_the_wrong_shape_is_refused():
    q, k, v = _qkv(2, 2, 4, 5, 3, torch.float32)
    with pytest.raises(ValueError, match=r"position_bias must be broadcastable to \[2, 2, 4, 5\]"):
        ops.attention(q, k, v, position_bias=torch.zeros(1, 2, 5, 4))


@pytest.mark.parametrize("with_new", [False, True])
def test_decode_attention_with_position_bias_matches_the_reference(with_new):
    B, H, L, D = 3, 2, 6, 4
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, H, 1, D, generator=g)
    kc, vc = torch.randn(B, H, L, D, generator=g), torch.randn(B, H, L, D, generator=g)
    kc[1, :, 3:] = float("nan")  # past the length: never read
    kn, vn = (torch.randn(B, H, 1, D, generator=g) for _ in range(2)) if with_new else (None, None)
    lengths = torch.tensor([6, 3, 0])
    bias = torch.randn(B, H, 1, L + (1 if with_new else 0), generator=g)
    got = ops.decode_attention(q, kc, vc, lengths, 1.0, kn, vn, position_bias=bias)
    want = reference.decode_attention(q, kc, vc, lengths, 1.0, kn, vn, position_bias=bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(got).all()
    if not with_new:
        assert (got[2] == 0).all()  # no key at all: zeros


# ------------------------------------------------------------------------------------------
# buckets
# ------------------------------------------------------------------------------------------


def _bucket_by_hand(rel: int, bidirectional: bool, n: int, max_distance: int) -> int:
    """T5's bucketing written out for one integer (Python floats, not the tensor code)."""
    out = 0
    if bidirectional:
        n //= 2
        out = n if rel > 0 else 0
        d = abs(rel)
    else:
        d = max(-rel, 0)
    exact = n // 2
    if d < exact:
        return out + d
    far = exact + int(math.log(d / exact) / math.log(max_distance / exact) * (n - exact))
    return out + min(far, n - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("n, max_distance", [(32, 128), (8, 20)])
def test_relative_position_buckets(bidirectional, n, max_distance):
    rel = torch.arange(-300, 301)
    got = relative_position_bucket(rel, bidirectional, n, max_distance).tolist()
    want = [_bucket_by_hand(int(r), bidirectional, n, max_distance) for r in rel]
    # float32 against float64 logarithms may round a boundary differently: allow none here
    assert got == want
    assert min(got) == 0 and max(got) == n - 1


# ------------------------------------------------------------------------------------------
# the model with the T5 and mBART options
# ------------------------------------------------------------------------------------------

T5_OPTIONS = dict(
    norm="rms",
    bias=False,
    scale_attention=False,
    d_kv=6,
    relative_attention_buckets=8,
    relative_attention_max_distance=12,
    positions="none",
    activation="gelu_tanh",
    gated_ffn=True,
    scale_embeddings=False,
    scale_decoder_output=True,
    norm_first=True,
)
MBART_OPTIONS = dict(
    positions="learned", pos_offset=2, embedding_norm=True, norm_first=True, activation="gelu"
)


@pytest.mark.parametrize(
    "options",
    [T5_OPTIONS, dict(T5_OPTIONS, relative_attention_per_layer=True), MBART_OPTIONS],
    ids=["t5", "umt5", "mbart"],
)
def test_decode_steps_equal_teacher_forcing_and_training_reaches_every_parameter(options):
    from transformer_ext.config import TransformerConfig
    from transformer_ext.model import Transformer

    torch.manual_seed(0)
    config = TransformerConfig.preset("tiny", dropout=0.1, **options)
    model = Transformer(config)
    src = torch.randint(3, 40, (3, 15))
    lengths = torch.tensor([15, 6, 9])
    tgt = torch.randint(3, 40, (3, 14))
    tgt[:, 0] = config.bos_id
    model.eval()
    with torch.no_grad():
        full = model(src, lengths, tgt)
        _, cross_k, cross_v = model.encode(src, lengths)
        L = tgt.shape[1]
        keys = [torch.zeros(3, config.n_heads, L, config.d_k) for _ in range(config.n_decoder_layers)]
        values = [torch.zeros_like(k) for k in keys]
        steps = []
        for t in range(L):
            logits, new_k, new_v = model.decode_step(
                tgt[:, t : t + 1],
                torch.full((3,), t),
                lengths,
                keys,
                values,
                cross_k,
                cross_v,
                model.fused_qkv(),
            )
            for i in range(config.n_decoder_layers):
                keys[i][:, :, t] = new_k[i][:, :, 0]
                values[i][:, :, t] = new_v[i][:, :, 0]
            steps.append(logits)
    torch.testing.assert_close(torch.stack(steps, 1), full, rtol=1e-4, atol=1e-5)
    # training: the loss of a copy task falls, and every parameter (the bias tables too) gets a gradient
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(12):
        out = model(src, lengths, tgt[:, :-1])
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), tgt[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses
