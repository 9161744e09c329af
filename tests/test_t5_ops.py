"""The additive position bias of ops.attention and ops.decode_attention (T5's relative bias), and
the relative-position buckets, against the pure-PyTorch reference, float64 and autograd."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import device_params

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
# the compiled kernels with a bias: float32 / bfloat16 / float16 kernels against float64, every
# bias layout, ragged lengths, causal, dropout, -inf entries, the dispatch, opcheck, bad input
# ------------------------------------------------------------------------------------------

DEVICES = device_params()
# (B, H, Q, K, D): query blocks (64) and key tiles crossed, Q != K both ways, D not a multiple of 8
BIAS_SHAPES = [(3, 2, 70, 70, 16), (2, 3, 9, 130, 12), (2, 2, 65, 33, 64)]
BIAS_KINDS = ["shared", "per_row", "one_for_all_heads"]


def _bias(kind, B, H, Q, K, device, seed=7):
    """The bias layouts a caller gives: T5's table lookup ([1, H, Q, K] as a permuted view, last
    dimension strided), one bias per batch row, one bias for every head."""
    g = torch.Generator().manual_seed(seed)
    if kind == "shared":
        return (
            (2 * torch.randn(Q, K, H, generator=g, dtype=torch.float64))
            .permute(2, 0, 1)
            .unsqueeze(0)
            .to(device)
        )
    if kind == "per_row":
        return (2 * torch.randn(B, H, Q, K, generator=g, dtype=torch.float64)).to(device)
    return (2 * torch.randn(1, 1, Q, K, generator=g, dtype=torch.float64)).to(device)


def _ragged(B, Q, K, device):
    kl = torch.tensor([K] + [max(1, K // (b + 2)) for b in range(1, B)])
    ql = torch.tensor([Q] + [max(1, Q - 3 * b) for b in range(1, B)])
    return kl.to(device), ql.to(device)


def _grads(fn, leaves, g):
    out = fn(*leaves)
    return out, torch.autograd.grad(out, leaves, g)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", BIAS_KINDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", BIAS_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attention_bias_kernel_against_float64_forward_and_backward(device, kind, causal, shape):
    """The float32 kernel (forward, backward, d(bias) summed over the broadcast dimensions) against
    the float64 reference differentiated by autograd, ragged keys and queries."""
    B, H, Q, K, D = shape
    q, k, v = (t.to(device) for t in _qkv(B, H, Q, K, D, seed=3))
    bias = _bias(kind, B, H, Q, K, device)
    kl, ql = _ragged(B, Q, K, device)
    g = torch.randn(B, H, Q, D, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(device)

    def ours(q, k, v, b):
        return ops.attention(
            q, k, v, key_lengths=kl, query_lengths=ql, scale=0.4, causal=causal, position_bias=b
        )

    def ref(q, k, v, b):
        return reference.attention(q, k, v, kl, ql, 0.4, causal, position_bias=b)

    leaves32 = [t.float().requires_grad_() for t in (q, k, v, bias)]
    leaves64 = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    out, grads = _grads(ours, leaves32, g.float())
    want, want_grads = _grads(ref, leaves64, g)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-5)
    for name, a, w in zip(("dq", "dk", "dv", "dbias"), grads, want_grads):
        assert a.shape == w.shape and a.dtype == torch.float32, name
        torch.testing.assert_close(a.double(), w, rtol=0, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
    # the bias is not ignored: its gradient is not zero and a different bias gives another result
    assert grads[3].abs().max() > 1e-3
    other = ops.attention(*leaves32[:3], key_lengths=kl, query_lengths=ql, scale=0.4, causal=causal)
    assert (other.double() - want).abs().max() > 1e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_bias_kernel_reduced_precision(device, dtype):
    """bfloat16 / float16 with a float32 bias: the kernel's error against float64 is at most twice
    that of the plain computation in the same precision (bfloat16 on an AMX CPU included, where the
    unbiased op runs other kernels)."""
    B, H, Q, K, D = 2, 2, 70, 70, 32
    q, k, v = (t.to(device) for t in _qkv(B, H, Q, K, D, seed=5))
    bias = _bias("shared", B, H, Q, K, device).float()
    kl, _ = _ragged(B, Q, K, device)
    want = reference.attention(q, k, v, kl, None, 0.2, True, position_bias=bias.double())
    qd, kd, vd = (t.to(dtype) for t in (q, k, v))
    out = ops.attention(qd, kd, vd, key_lengths=kl, scale=0.2, causal=True, position_bias=bias)
    assert out.dtype == dtype
    keep = (torch.arange(K, device=device).view(1, 1, 1, K) < kl.view(B, 1, 1, 1)) & reference.causal_mask(
        Q, K, device=device
    )
    s = (qd @ kd.transpose(-2, -1)) * 0.2 + bias.to(dtype)
    plain = s.masked_fill(~keep, float("-inf")).softmax(-1) @ vd
    err = (out.double() - want).abs().max().item()
    plain_err = (plain.double() - want).abs().max().item()
    assert err <= max(2 * plain_err, 1e-4), (err, plain_err)


@pytest.mark.parametrize("device", DEVICES)
def test_attention_bias_kernel_with_dropout_matches_the_reference(device):
    """Dropout inside the kernel with a bias: the reference's generator, forward and gradients."""
    B, H, Q, K, D = 2, 2, 40, 40, 8
    q, k, v = (t.to(device) for t in _qkv(B, H, Q, K, D, seed=13))
    bias = _bias("shared", B, H, Q, K, device)
    kl = torch.tensor([40, 17], device=device)
    g = torch.randn(B, H, Q, D, dtype=torch.float64).to(device)
    leaves32 = [t.float().requires_grad_() for t in (q, k, v, bias)]
    leaves64 = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    out, grads = _grads(
        lambda q, k, v, b: ops.attention(
            q, k, v, key_lengths=kl, causal=True, dropout_p=0.3, seed=21, position_bias=b
        ),
        leaves32,
        g.float(),
    )
    want, want_grads = _grads(
        lambda q, k, v, b: reference.attention(q, k, v, kl, None, None, True, 0.3, 21, position_bias=b),
        leaves64,
        g,
    )
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-5)
    for a, w in zip(grads, want_grads):
        torch.testing.assert_close(a.double(), w, rtol=0, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_attention_minus_inf_bias_masks_keys_and_an_all_masked_row_is_zeros(device, dtype):
    """A -inf bias entry is a masked key: the result equals key_lengths masking; a row whose every
    key has a -inf bias is zeros with zero gradients, never NaN (the reference's rule)."""
    B, H, Q, K, D = 2, 2, 6, 70, 8
    q, k, v = (t.to(device, dtype) for t in _qkv(B, H, Q, K, D, seed=17))
    bias = torch.zeros(1, H, Q, K, dtype=dtype, device=device)
    bias[..., 50:] = float("-inf")
    bias[:, 1, 2] = float("-inf")  # head 1, query 2: no key at all
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ops.attention(*leaves, position_bias=bias)
    out.sum().backward()
    assert torch.isfinite(out).all() and all(torch.isfinite(t.grad).all() for t in leaves)
    assert (out[:, 1, 2] == 0).all() and (leaves[0].grad[:, 1, 2] == 0).all()
    want = reference.attention(q.double(), k.double(), v.double(), position_bias=bias.double())
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5)
    lengths = torch.full((B,), 50, device=device)
    masked = ops.attention(q, k, v, key_lengths=lengths, position_bias=torch.zeros_like(bias))
    torch.testing.assert_close(out[:, 0], masked[:, 0], rtol=0, atol=1e-6)


def test_attention_bias_without_its_gradient():
    """A bias that does not require grad: q, k, v get their gradients, the bias none."""
    q, k, v = (t.float().requires_grad_() for t in _qkv(2, 2, 9, 9, 8, seed=19))
    bias = _bias("shared", 2, 2, 9, 9, "cpu").float()
    ops.attention(q, k, v, causal=True, position_bias=bias).sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    reference.attention(q64, k64, v64, causal=True, position_bias=bias.double()).sum().backward()
    for a, w in zip((q, k, v), (q64, k64, v64)):
        torch.testing.assert_close(a.grad.double(), w.grad, rtol=0, atol=1e-5)


def _called_ops(fn) -> list[str]:
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return seen


def test_the_bias_runs_the_compiled_kernels_not_a_composition():
    q, k, v = (t.float().requires_grad_() for t in _qkv(2, 2, 5, 5, 4, seed=23))
    bias = torch.randn(1, 2, 5, 5, requires_grad=True)
    called = _called_ops(lambda: ops.attention(q, k, v, causal=True, position_bias=bias).sum().backward())
    assert "transformer_ext.attention_with_bias.default" in called
    assert "transformer_ext.attention_with_bias_backward.default" in called
    assert not any("softmax" in name for name in called), called
    kc = torch.randn(2, 2, 6, 4)
    step = (q[:, :, :1].detach(), kc, kc, torch.tensor([6, 2]), 1.0, kc[:, :, :1], kc[:, :, :1])
    step_bias = torch.randn(1, 2, 1, 7)
    called = _called_ops(lambda: ops.decode_attention(*step, position_bias=step_bias))
    assert called == ["transformer_ext.decode_attention_with_bias.default"], called


@pytest.mark.parametrize("device", DEVICES)
def test_attention_with_bias_opcheck(device):
    q, k, v = (t.float().to(device) for t in _qkv(2, 2, 5, 7, 8, seed=29))
    bias = torch.randn(1, 2, 5, 7, device=device)
    kl = torch.tensor([7, 2], device=device)
    ql = torch.tensor([5, 3], device=device)
    seed = torch.tensor([11], device=device)
    op = torch.ops.transformer_ext
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    torch.library.opcheck(op.attention_with_bias.default, (*leaves, kl, ql, 0.4, True, 0.25, seed))
    torch.library.opcheck(op.attention_with_bias.default, (q, k, v, bias, None, None, 1.0, False, 0.0, None))
    out, lse = op.attention_with_bias(q, k, v, bias, kl, ql, 0.4, True, 0.25, seed)
    for bias_grad in (True, False):
        torch.library.opcheck(
            op.attention_with_bias_backward.default,
            (torch.randn_like(out), q, k, v, bias, out, lse, kl, ql, 0.4, True, 0.25, seed, bias_grad),
        )
    kc = torch.randn(2, 2, 6, 8, device=device)
    torch.library.opcheck(
        op.decode_attention_with_bias.default,
        (
            q[:, :, :1].contiguous(),
            kc,
            kc,
            torch.tensor([6, 2], device=device),
            0.5,
            torch.randn(2, 1, 1, 6, device=device),
        ),
    )


def test_attention_with_bias_bad_input_names_the_bias():
    q, k, v = (t.float() for t in _qkv(2, 2, 4, 5, 3))
    op = torch.ops.transformer_ext
    with pytest.raises(RuntimeError, match=r"position_bias must be broadcastable to \[2, 2, 4, 5\]"):
        op.attention_with_bias(q, k, v, torch.zeros(1, 2, 4, 6), None, None, 1.0, False, 0.0, None)
    with pytest.raises(RuntimeError, match="position_bias must be a floating-point tensor"):
        op.attention_with_bias(
            q, k, v, torch.zeros(1, 2, 4, 5, dtype=torch.int64), None, None, 1.0, False, 0.0, None
        )
    with pytest.raises(ValueError, match="position_bias must be a floating-point tensor"):
        ops.attention(q, k, v, position_bias=torch.zeros(1, 2, 4, 5, dtype=torch.int64))
    kc = torch.zeros(2, 2, 6, 3)
    with pytest.raises(RuntimeError, match=r"position_bias must have shape \[2 or 1, 2 or 1, 1, 7\]"):
        op.decode_attention_with_bias(
            q[:, :, :1],
            kc,
            kc,
            torch.tensor([1, 1]),
            1.0,
            torch.zeros(2, 2, 1, 6),
            kc[:, :, :1],
            kc[:, :, :1],
        )
    with pytest.raises(ValueError, match=r"position_bias must be broadcastable to \[2, 2, 1, 6\]"):
        ops.decode_attention(
            q[:, :, :1], kc, kc, torch.tensor([1, 1]), 1.0, position_bias=torch.zeros(2, 2, 2, 6)
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("with_new", [False, True])
def test_decode_attention_bias_kernel_against_float64(device, dtype, with_new):
    """Every bias layout of a step ([B or 1, H or 1, 1, n], strided), ragged lengths, an empty
    row, a -inf entry, NaN past the lengths: the kernel (float64: the composite) against float64."""
    B, H, L, D = 3, 4, 37, 20
    g = torch.Generator().manual_seed(31)
    q = torch.randn(B, H, 1, D, generator=g, dtype=torch.float64)
    kc, vc = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64) for _ in range(2))
    kn, vn = (torch.randn(B, H, 1, D, generator=g, dtype=torch.float64) for _ in range(2))
    lengths = torch.tensor([37, 11, 0])
    n = L + (1 if with_new else 0)
    biases = [
        torch.randn(B, H, 1, n, generator=g, dtype=torch.float64),
        torch.randn(n, H, generator=g, dtype=torch.float64).t().unsqueeze(0).unsqueeze(2),  # strided last dim
        torch.randn(B, 1, 1, n, generator=g, dtype=torch.float64),
    ]
    biases[0][0, 1, 0, 3] = float("-inf")
    dev = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    kc_d, vc_d = dev(kc), dev(vc)
    kc_d[1, :, 11:] = float("nan")  # past the length: never read
    vc_d[1, :, 11:] = float("nan")
    new = (dev(kn), dev(vn)) if with_new else (None, None)
    # the oracle sees the inputs the kernel sees (rounded to dtype), in float64
    as64 = lambda t: None if t is None else t.double().cpu()  # noqa: E731
    bias_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    for bias in biases:
        bias_d = bias.to(device=device, dtype=bias_dtype)
        got = ops.decode_attention(dev(q), kc_d, vc_d, lengths.to(device), 0.3, *new, position_bias=bias_d)
        want = reference.decode_attention(
            as64(dev(q)), as64(kc_d), as64(vc_d), lengths, 0.3, *map(as64, new), position_bias=as64(bias_d)
        )
        assert got.dtype == dtype and torch.isfinite(got).all()
        tol = {torch.float32: 1e-5, torch.float16: 5e-3, torch.float64: 1e-12}[dtype]
        torch.testing.assert_close(got.double().cpu(), want, rtol=0, atol=tol)
        if not with_new:
            assert (got[2] == 0).all()  # no key at all: zeros


@pytest.mark.parametrize(
    "env",
    [{"TRANSFORMER_EXT_CPU_FALLBACK": "1"}, {"TRANSFORMER_EXT_CPU_ISA": "avx2"}],
    ids=["composite", "avx2"],
)
def test_attention_bias_other_cpu_paths_match_the_reference(env):
    """The ATen composite (CPUs without AVX2) and the AVX2 kernels (on a CPU with AVX-512) with a
    bias: forward, gradients with d(bias), and a decode step, against float64."""
    import os
    import subprocess
    import sys

    code = """
import torch
from transformer_ext import ops, reference
from test_t5_ops import _bias, _qkv, _ragged
B, H, Q, K, D = 3, 2, 70, 45, 12
q, k, v = _qkv(B, H, Q, K, D, seed=3)
bias = _bias("shared", B, H, Q, K, "cpu")
kl, ql = _ragged(B, Q, K, "cpu")
a = [t.float().requires_grad_() for t in (q, k, v, bias)]
r = [t.clone().requires_grad_() for t in (q, k, v, bias)]
out = ops.attention(*a[:3], key_lengths=kl, query_lengths=ql, causal=True, dropout_p=0.2, seed=4, position_bias=a[3])
ref = reference.attention(*r[:3], kl, ql, None, True, 0.2, 4, position_bias=r[3])
out.sum().backward()
ref.sum().backward()
assert (out.double() - ref).abs().max() < 2e-5
for x, y in zip(a, r):
    assert (x.grad.double() - y.grad).abs().max() < 1e-4, (x.grad.double() - y.grad).abs().max()
kc = torch.randn(B, H, 9, D, dtype=torch.float64)
lengths = torch.tensor([9, 4, 0])
sb = torch.randn(1, H, 1, 10, dtype=torch.float64)
got = ops.decode_attention(q[:, :, :1].float(), kc.float(), kc.float(), lengths, 0.5, kc[:, :, :1].float(), kc[:, :, :1].float(), sb.float())
want = reference.decode_attention(q[:, :, :1], kc, kc, lengths, 0.5, kc[:, :, :1], kc[:, :, :1], sb)
assert (got.double() - want).abs().max() < 1e-5
print("ok")
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, **env, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests")]))
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=root, timeout=120
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_bench_t5_attention_quick(tmp_path):
    """The benchmark's smoke run: both engines agree before timing, JSON and plot are written, and
    the model's attention is its own again afterwards (speed is not asserted)."""
    import json

    from benchmarks.train import bench_t5_attention
    from transformer_ext import model as model_module

    out = tmp_path / "t5.json"
    assert bench_t5_attention.main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["T"] for r in result["steps"]] == [16, 32] and len(result["attention_only"]) == 2
    for row in result["steps"]:
        assert set(row["seconds_per_step"]) == set(bench_t5_attention.ENGINES)
        assert row["loss_rel_diff"] < 1e-4 and row["bias_grad_rel_diff"] < 1e-3
    assert all(r["max_abs_diff_out_and_grads"] < 1e-3 for r in result["attention_only"])
    assert (tmp_path / "t5.png").stat().st_size > 0
    assert model_module.ops is ops


def test_bench_t5_attention_bad_arguments(capsys):
    from benchmarks.train import bench_t5_attention

    with pytest.raises(SystemExit) as exc:
        bench_t5_attention.main(["--sizes", "128,x"])
    assert exc.value.code == 2 and "--sizes must be comma-separated integers" in capsys.readouterr().err


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


@pytest.mark.parametrize("threads", [1, 3], ids=["d(bias)_per_head", "d(bias)_per_worker"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["keys_by_queries", "table_lookup"])
def test_attention_bias_layouts_and_gradient_modes_against_float64(threads, causal, layout):
    """A bias shared by the batch, in the layout the forward kernel reads in place ([1, H, Q, K]
    with the queries contiguous, Q a multiple of 16: no copy) and as a table lookup's view, with
    d(bias) written by one task per head (heads >= threads) and through per-thread accumulators
    (threads > heads): forward, dq, dk, dv and d(bias) against float64 autograd."""
    B, H, Q, K, D = 4, 2, 80, 70, 16
    q, k, v = _qkv(B, H, Q, K, D, seed=5)
    g = torch.Generator().manual_seed(11)
    if layout == "keys_by_queries":
        bias = (2 * torch.randn(H, K, Q, generator=g, dtype=torch.float64)).transpose(1, 2).unsqueeze(0)
        assert bias.float().stride(2) == 1
    else:
        bias = _bias("shared", B, H, Q, K, "cpu")
    kl, ql = _ragged(B, Q, K, "cpu")
    grad = torch.randn(B, H, Q, D, generator=g, dtype=torch.float64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        leaves32 = [t.float().requires_grad_() for t in (q, k, v, bias)]
        out, grads = _grads(
            lambda q, k, v, b: ops.attention(
                q, k, v, key_lengths=kl, query_lengths=ql, scale=0.3, causal=causal, position_bias=b
            ),
            leaves32,
            grad.float(),
        )
    finally:
        torch.set_num_threads(before)
    leaves64 = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    want, want_grads = _grads(
        lambda q, k, v, b: reference.attention(q, k, v, kl, ql, 0.3, causal, position_bias=b), leaves64, grad
    )
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-5)
    for name, a, w in zip(("dq", "dk", "dv", "dbias"), grads, want_grads):
        assert a.shape == w.shape, name
        torch.testing.assert_close(a.double(), w, rtol=0, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
    assert grads[3].abs().max() > 1e-3


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("q_len, k_len", [(7, 7), (1, 9), (5, 12), (64, 64)])
def test_relative_bias_module_equals_one_lookup_per_pair(bidirectional, q_len, k_len):
    """RelativePositionBias's eager bias (one lookup per distance, laid out keys x queries) equals
    the table entry of each (query, key) pair's bucket, worked out by hand, and its table gets
    the gradient of the per-pair lookup."""
    from transformer_ext.model import RelativePositionBias

    torch.manual_seed(0)
    module = RelativePositionBias(8, 20, 3, bidirectional).double()
    bias = module(q_len, k_len)
    assert bias.shape == (1, 3, q_len, k_len)
    table = module.relative_attention_bias.weight
    want = torch.empty(1, 3, q_len, k_len, dtype=torch.float64)
    for i in range(q_len):
        for j in range(k_len):
            rel = j - (i + k_len - q_len)
            want[0, :, i, j] = table[_bucket_by_hand(rel, bidirectional, 8, 20)]
    assert torch.equal(bias, want)
    g = torch.randn(1, 3, q_len, k_len, dtype=torch.float64)
    (got,) = torch.autograd.grad(bias, table, g)
    (expected,) = torch.autograd.grad(want, table, g)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
