"""The compiled ops against their pure-PyTorch references, computed in float64.

Every test runs on CPU here and on CUDA where a GPU is visible (skipped with a reason
otherwise). Tolerances for reduced precision follow the house rule: the kernel's error
against the float64 reference may be at most twice that of plain PyTorch run in the
same precision.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import HAS_CUDA, device_params
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transformer_ext import ops, reference

DEVICES = device_params()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
KEY_LENGTHS = [1, 7, 33, 1000, 5000]
QUERY_LENGTHS = [1, 5]
HEAD_DIMS = [1, 7, 64]
MASK_KINDS = ["none", "padding", "full", "causal", "padding+causal"]


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _randn(*shape, seed=0, device="cpu", dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=_gen(seed), dtype=torch.float64) * scale).to(
        device=device, dtype=dtype
    )


def _make_mask(kind, B, H, Q, K, device, seed=0):
    """Returns (mask or None, causal flag)."""
    g = _gen(seed + 1)
    if kind in ("none", "causal"):
        return None, kind == "causal"
    if kind.startswith("padding"):
        lengths = torch.randint(1, K + 1, (B,), generator=g)
        if B > 1:
            lengths[-1] = max(1, K // 2)
        mask = (torch.arange(K).view(1, 1, 1, K) < lengths.view(B, 1, 1, 1)).to(device)
        return mask, kind.endswith("causal")
    mask = torch.rand(B, H, Q, K, generator=g) < 0.7
    mask[0, 0, 0] = False  # one row with no allowed key at all
    return mask.to(device), False


def _plain_softmax(scores, mask, scale, causal):
    """The eager composite in the input's own precision (the baseline for tolerances)."""
    x = scores * scale
    allowed = torch.ones_like(x, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & mask
    if causal:
        allowed = allowed & reference.causal_mask(x.shape[-2], x.shape[-1], device=x.device)
    return x.masked_fill(~allowed, float("-inf")).softmax(-1), allowed


def _check_close_to_reference(out, ref64, plain, allowed_rows):
    """out vs the float64 reference, with the reduced-precision rule for 16-bit dtypes."""
    assert out.dtype == plain.dtype
    assert torch.isfinite(out).all(), "kernel produced inf/NaN"
    err = (out.double() - ref64).abs()
    if out.dtype == torch.float32:
        assert err.max().item() <= 2e-6, f"max error {err.max().item():.3g} vs float64 reference"
        return
    plain_err = (plain.double() - ref64).abs()[allowed_rows]
    budget = 2 * plain_err.max().item() + 1e-7
    assert err[allowed_rows].max().item() <= budget, (
        f"{out.dtype}: kernel error {err.max().item():.3g} exceeds twice the plain PyTorch error "
        f"{plain_err.max().item():.3g}"
    )


# --------------------------------------------------------------------------- masked_softmax


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", KEY_LENGTHS)
@pytest.mark.parametrize("Q", QUERY_LENGTHS)
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
def test_masked_softmax_matches_reference(device, dtype, K, Q, mask_kind):
    if K >= 1000 and dtype != torch.float32 and mask_kind in ("full",):
        pytest.skip("covered by the float32 case; keeps the suite fast")
    B, H = 2, 3
    scale = 1 / math.sqrt(64)
    scores = _randn(B, H, Q, K, seed=K * 10 + Q, device=device, dtype=dtype, scale=4.0)
    mask, causal = _make_mask(mask_kind, B, H, Q, K, device)
    out = ops.masked_softmax(scores, mask, scale, causal)
    ref64 = reference.masked_softmax(scores.double(), mask, scale, causal)
    plain, allowed = _plain_softmax(scores, mask, scale, causal)
    rows_with_key = allowed.any(-1, keepdim=True).expand_as(allowed)
    assert out.shape == scores.shape
    _check_close_to_reference(out, ref64, plain, rows_with_key)
    # Keys that may not be attended get exactly zero; empty rows are all zeros.
    assert (out[~allowed] == 0).all()
    sums = out.double().sum(-1)
    has_key = allowed.any(-1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(sums[has_key], torch.ones_like(sums[has_key]), atol=tol)
    assert (sums[~has_key] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_masked_softmax_causal_alignment_bottom_right(device):
    # Q < K: query i sees keys 0 .. i + (K - Q); the last query sees every key.
    Q, K = 3, 6
    scores = torch.zeros(1, 1, Q, K, device=device)
    out = ops.masked_softmax(scores, None, 1.0, True)
    for i in range(Q):
        visible = i + (K - Q) + 1
        expected = torch.zeros(K)
        expected[:visible] = 1.0 / visible
        torch.testing.assert_close(out[0, 0, i].cpu(), expected)
    # Q > K: the first Q - K queries see no key and are all zeros.
    out = ops.masked_softmax(torch.zeros(1, 1, 5, 2, device=device), None, 1.0, True)
    assert (out[0, 0, :3] == 0).all()
    torch.testing.assert_close(out[0, 0, 3].cpu(), torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(out[0, 0, 4].cpu(), torch.tensor([0.5, 0.5]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_masked_softmax_large_scores_stay_finite(device, dtype):
    scores = _randn(2, 2, 4, 300, seed=3, device=device, dtype=dtype, scale=1e4)
    scores[0, 0, 0, 5] = 6.0e4 if dtype == torch.float16 else 1e30
    mask, _ = _make_mask("padding", 2, 2, 4, 300, device)
    for scale in (1.0, 0.125, 4.0):
        out = ops.masked_softmax(scores, mask, scale, False)
        assert torch.isfinite(out).all()
        ref = reference.masked_softmax(scores.double(), mask, scale, False)
        assert (out.double() - ref).abs().max() < 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_masked_softmax_non_contiguous_inputs(device):
    base = _randn(2, 40, 3, 5, seed=5, device=device)
    scores = base.permute(0, 2, 3, 1)  # [2, 3, 5, 40], non-contiguous
    assert not scores.is_contiguous()
    mask = (torch.rand(2, 40, 5, 1, generator=_gen(6)) < 0.8).to(device).permute(0, 3, 2, 1)
    out = ops.masked_softmax(scores, mask, 0.3, False)
    ref = reference.masked_softmax(scores.double(), mask, 0.3, False)
    assert (out.double() - ref).abs().max() < 2e-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_kind", ["padding", "full", "causal"])
def test_masked_softmax_gradcheck_float64(device, mask_kind):
    B, H, Q, K = 2, 2, 3, 5
    scores = _randn(B, H, Q, K, seed=7, device=device, dtype=torch.float64).requires_grad_()
    mask, causal = _make_mask(mask_kind, B, H, Q, K, device)
    assert torch.autograd.gradcheck(lambda s: ops.masked_softmax(s, mask, 0.7, causal), (scores,))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_softmax_backward_matches_autograd_of_reference(device, dtype):
    B, H, Q, K = 2, 3, 4, 33
    scores = _randn(B, H, Q, K, seed=8, device=device, dtype=dtype, scale=2.0)
    mask, causal = _make_mask("padding+causal", B, H, Q, K, device)
    grad = _randn(B, H, Q, K, seed=9, device=device, dtype=dtype)
    s1 = scores.clone().requires_grad_()
    ops.masked_softmax(s1, mask, 0.5, causal).backward(grad)
    s2 = scores.double().clone().requires_grad_()
    reference.masked_softmax(s2, mask, 0.5, causal).backward(grad.double())
    tol = 1e-6 if dtype == torch.float32 else 3e-2
    assert (s1.grad.double() - s2.grad).abs().max() <= tol
    assert s1.grad.dtype == dtype


# --------------------------------------------------------------------------- decode_attention


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("with_new", [False, True])
def test_decode_attention_all_lengths(device, dtype, D, with_new):
    L = 9
    B, H = L + 1, 2  # one row for every length 0 .. L
    q = _randn(B, H, 1, D, seed=11, device=device, dtype=dtype)
    k = _randn(B, H, L, D, seed=12, device=device, dtype=dtype)
    v = _randn(B, H, L, D, seed=13, device=device, dtype=dtype)
    lengths = torch.arange(B, device=device)
    kn = _randn(B, H, 1, D, seed=14, device=device, dtype=dtype) if with_new else None
    vn = _randn(B, H, 1, D, seed=15, device=device, dtype=dtype) if with_new else None
    scale = 1 / math.sqrt(D)
    out = ops.decode_attention(q, k, v, lengths, scale, kn, vn)
    ref = reference.decode_attention(
        q.double(),
        k.double(),
        v.double(),
        lengths,
        scale,
        None if kn is None else kn.double(),
        None if vn is None else vn.double(),
    )
    assert out.shape == (B, H, 1, D) and out.dtype == dtype
    plain = reference.decode_attention(q, k, v, lengths, scale, kn, vn) if dtype == torch.float32 else None
    tol = 2e-6 if dtype == torch.float32 else (4e-3 if dtype == torch.float16 else 3e-2)
    assert (out.double() - ref).abs().max() <= tol
    if not with_new:
        assert (out[0] == 0).all(), "a row with no key must be zeros"
    del plain


@pytest.mark.parametrize("device", DEVICES)
def test_decode_attention_never_reads_past_length(device):
    B, H, L, D = 3, 2, 16, 8
    q = _randn(B, H, 1, D, seed=21, device=device)
    k = _randn(B, H, L, D, seed=22, device=device)
    v = _randn(B, H, L, D, seed=23, device=device)
    lengths = torch.tensor([0, 5, 16], device=device)
    ref = ops.decode_attention(q, k, v, lengths, 0.3)
    # Poison everything past each row's length: the result must not change at all.
    k2, v2 = k.clone(), v.clone()
    for b, n in enumerate(lengths.tolist()):
        k2[b, :, n:] = float("nan")
        v2[b, :, n:] = float("inf")
    out = ops.decode_attention(q, k2, v2, lengths, 0.3)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_attention_long_cache_and_strided_views(device):
    B, H, L, D = 2, 4, 1500, 32
    q = _randn(B, H, 1, D, seed=31, device=device)
    # Caches as transposed views of [B, L, H, D] buffers (what a linear projection produces).
    k = _randn(B, L, H, D, seed=32, device=device).transpose(1, 2)
    v = _randn(B, L, H, D, seed=33, device=device).transpose(1, 2)
    assert not k.is_contiguous()
    lengths = torch.tensor([1500, 777], device=device)
    out = ops.decode_attention(q, k, v, lengths, 0.2)
    ref = reference.decode_attention(q.double(), k.double(), v.double(), lengths, 0.2)
    assert (out.double() - ref).abs().max() <= 2e-6


# --------------------------------------------------------------------------- kv cache ops


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 3])
def test_kv_cache_append_per_row_positions(device, dtype, T):
    B, H, L, D = 4, 2, 10, 5
    cache = _randn(B, H, L, D, seed=41, device=device, dtype=dtype)
    update = _randn(B, H, T, D, seed=42, device=device, dtype=dtype)
    positions = torch.tensor([0, 4, -1, L - T], device=device)
    expected = cache.clone()
    reference.kv_cache_append_(expected, update, positions)
    ops.kv_cache_append_(cache, update, positions)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)
    # Independent of the reference: row 2 untouched, row 1 holds the update at 4..4+T.
    torch.testing.assert_close(cache[1, :, 4 : 4 + T], update[1], rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu"])
def test_kv_cache_append_out_of_range_raises_and_leaves_cache_untouched(device):
    cache = _randn(3, 2, 6, 4, seed=43, device=device)
    before = cache.clone()
    update = _randn(3, 2, 2, 4, seed=44, device=device)
    with pytest.raises(RuntimeError, match=r"positions\[2\]"):
        ops.kv_cache_append_(cache, update, torch.tensor([0, 1, 5], device=device))
    torch.testing.assert_close(cache, before, rtol=0, atol=0)


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU visible on this machine")
def test_kv_cache_append_cuda_error_flag_skips_bad_rows_without_sync():
    cache = _randn(3, 2, 6, 4, seed=45, device="cuda")
    before = cache.clone()
    update = _randn(3, 2, 2, 4, seed=46, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    ops.kv_cache_append_(cache, update, torch.tensor([0, 5, -1], device="cuda"), flag)
    assert flag.item() == 1
    torch.testing.assert_close(cache[0, :, 0:2], update[0])
    torch.testing.assert_close(cache[1:], before[1:])
    with pytest.raises(RuntimeError, match=r"positions\[1\]"):
        ops.kv_cache_append_(cache, update, torch.tensor([0, 5, -1], device="cuda"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_cache_reorder_repeated_indices_and_prefix(device, dtype):
    B, H, L, D = 5, 2, 8, 3
    cache = _randn(B, H, L, D, seed=51, device=device, dtype=dtype)
    original = cache.clone()
    index = torch.tensor([2, 2, 0, 4, 2], device=device)
    length = 5
    ops.kv_cache_reorder_(cache, index, length)
    for b, src in enumerate(index.tolist()):
        torch.testing.assert_close(cache[b, :, :length], original[src, :, :length], rtol=0, atol=0)
    # Entries past the valid prefix are never moved.
    torch.testing.assert_close(cache[:, :, length:], original[:, :, length:], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_kv_cache_reorder_length_zero_and_full(device):
    cache = _randn(3, 1, 4, 2, seed=52, device=device)
    original = cache.clone()
    ops.kv_cache_reorder_(cache, torch.tensor([2, 1, 0], device=device), 0)
    torch.testing.assert_close(cache, original, rtol=0, atol=0)
    ops.kv_cache_reorder_(cache, torch.tensor([2, 1, 0], device=device), 4)
    torch.testing.assert_close(cache, original.flip(0), rtol=0, atol=0)


# --------------------------------------------------------------------------- linear


def _linear_errors(x, w, b):
    """(our error, plain float32/16 PyTorch's error) against float64, relative to the output scale."""
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    plain = torch.nn.functional.linear(x, w, b).double()
    ours = ops.linear(x, w, b)
    assert ours.dtype == x.dtype and ours.shape == ref.shape
    scale = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
    return (ours.double() - ref).abs().max().item() / scale if ref.numel() else 0.0, (
        plain - ref
    ).abs().max().item() / scale if ref.numel() else 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16])  # <= 4: the matrix-vector kernel on the CPU
@pytest.mark.parametrize("K", [1, 7, 16, 33, 512])
@pytest.mark.parametrize("N", [1, 9, 100])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_float64_reference(device, rows, K, N, bias):
    g = _gen(rows * 1000 + K * 10 + N)
    x = torch.randn(rows, K, generator=g).to(device)
    w = torch.randn(N, K, generator=g).to(device)
    b = torch.randn(N, generator=g).to(device) if bias else None
    ours, plain = _linear_errors(x, w, b)
    assert ours <= 2 * plain + 1e-6, (ours, plain)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_linear_other_dtypes(device, dtype):
    g = _gen(5)
    x = torch.randn(2, 1, 48, generator=g).to(device, dtype)
    w = torch.randn(24, 48, generator=g).to(device, dtype)
    b = torch.randn(24, generator=g).to(device, dtype)
    ours, plain = _linear_errors(x, w, b)
    assert ours <= 2 * plain + 1e-12


@pytest.mark.parametrize("device", DEVICES)
def test_linear_shapes_and_strided_inputs(device):
    g = _gen(9)
    w = torch.randn(40, 64, generator=g).to(device)
    b = torch.randn(40, generator=g).to(device)
    x = torch.randn(64, generator=g).to(device)
    torch.testing.assert_close(ops.linear(x, w, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 1, 64, generator=g).to(device)
    assert ops.linear(x3, w, b).shape == (2, 1, 40)
    xt = torch.randn(64, 3, generator=g).to(device).t()  # non-contiguous rows
    wt = torch.randn(64, 40, generator=g).to(device).t()  # non-contiguous weight
    for xi, wi in ((xt, w), (xt, wt), (x3, wt)):
        torch.testing.assert_close(
            ops.linear(xi, wi, b), torch.nn.functional.linear(xi, wi, b), rtol=1e-5, atol=1e-5
        )
    empty = torch.empty(0, 64, device=device)
    assert ops.linear(empty, w, b).shape == (0, 40)


def test_linear_fallback_env_gives_at_linear(tmp_path):
    """TRANSFORMER_EXT_CPU_FALLBACK=1 switches the kernel off: at::linear, bit for bit."""
    import subprocess
    import sys

    code = (
        "import torch; from transformer_ext import ops; g = torch.Generator().manual_seed(0); "
        "x = torch.randn(1, 512, generator=g); w = torch.randn(300, 512, generator=g); b = torch.randn(300, generator=g); "
        "assert torch.equal(ops.linear(x, w, b), torch.nn.functional.linear(x, w, b)); print('same')"
    )
    env = {**__import__("os").environ, "TRANSFORMER_EXT_CPU_FALLBACK": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "same" in out.stdout, out.stderr


def test_linear_bad_inputs_name_the_argument():
    x, w = torch.randn(1, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight must have 2 dimensions"):
        ops.linear(x, torch.randn(8))
    with pytest.raises(RuntimeError, match=r"x.size\(-1\) must be weight.size\(1\) = 8"):
        ops.linear(torch.randn(1, 7), w)
    with pytest.raises(RuntimeError, match=r"bias.size\(0\) must be 4"):
        ops.linear(x, w, torch.randn(5))
    with pytest.raises(RuntimeError, match="weight must have the dtype of x"):
        ops.linear(x, w.double())
    with pytest.raises(RuntimeError, match="x must be float32"):
        ops.linear(torch.ones(1, 8, dtype=torch.int64), torch.ones(4, 8, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="x must have at least 1 dimension"):
        ops.linear(torch.tensor(1.0), w)


# --------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_clear_errors():
    s = torch.randn(2, 2, 3, 4)
    with pytest.raises(RuntimeError, match="mask must be Bool"):
        ops.masked_softmax(s, torch.ones(2, 1, 1, 4), 1.0, False)
    with pytest.raises(RuntimeError, match="not broadcastable"):
        ops.masked_softmax(s, torch.ones(2, 1, 1, 5, dtype=torch.bool), 1.0, False)
    with pytest.raises(RuntimeError, match="scores must have 4 dimensions"):
        ops.masked_softmax(torch.randn(3, 4), None, 1.0, False)
    with pytest.raises(RuntimeError, match="scores must be float32"):
        ops.masked_softmax(torch.ones(1, 1, 1, 2, dtype=torch.int64), None, 1.0, False)
    q, k = torch.randn(2, 2, 1, 4), torch.randn(2, 2, 6, 4)
    with pytest.raises(RuntimeError, match="lengths must be Long"):
        ops.decode_attention(q, k, k, torch.tensor([1, 2], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match=r"lengths\[1\] = 7"):
        ops.decode_attention(q, k, k, torch.tensor([1, 7]), 1.0)
    with pytest.raises(RuntimeError, match="k_cache must have shape"):
        ops.decode_attention(q, torch.randn(2, 3, 6, 4), k, torch.tensor([1, 2]), 1.0)
    with pytest.raises(RuntimeError, match="k_new and v_new must be given together"):
        ops.decode_attention(q, k, k, torch.tensor([1, 2]), 1.0, q, None)
    cache = torch.zeros(2, 2, 6, 4)
    with pytest.raises(RuntimeError, match="positions must be Long"):
        ops.kv_cache_append_(cache, torch.zeros(2, 2, 1, 4), torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="update must have shape"):
        ops.kv_cache_append_(cache, torch.zeros(2, 3, 1, 4), torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="update must have the dtype"):
        ops.kv_cache_append_(cache, torch.zeros(2, 2, 1, 4, dtype=torch.float16), torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match=r"index\[0\] = 2"):
        ops.kv_cache_reorder_(cache, torch.tensor([2, 0]), 3)
    with pytest.raises(RuntimeError, match="length must be in"):
        ops.kv_cache_reorder_(cache, torch.tensor([1, 0]), 7)
    assert (cache == 0).all(), "a failed call must not write"


# --------------------------------------------------------------------------- opcheck / compile


def _opcheck_cases(device):
    g = _gen(61)
    s = torch.randn(2, 3, 4, 5, generator=g).to(device)
    m = (torch.rand(2, 1, 1, 5, generator=g) < 0.8).to(device)
    q = torch.randn(2, 3, 1, 8, generator=g).to(device)
    kc = torch.randn(2, 3, 6, 8, generator=g).to(device)
    lengths = torch.tensor([3, 6], device=device)
    cache = torch.randn(2, 3, 6, 8, generator=g).to(device)
    return [
        (torch.ops.transformer_ext.masked_softmax.default, (s.clone().requires_grad_(), m, 0.5, True)),
        (torch.ops.transformer_ext.masked_softmax.default, (s, None, 1.0, False)),
        (
            torch.ops.transformer_ext.masked_softmax_backward.default,
            (torch.randn_like(s), s.softmax(-1), 0.5),
        ),
        (torch.ops.transformer_ext.decode_attention.default, (q, kc, kc.clone(), lengths, 0.3, None, None)),
        (
            torch.ops.transformer_ext.decode_attention.default,
            (q, kc, kc.clone(), lengths, 0.3, q.clone(), q.clone()),
        ),
        (
            torch.ops.transformer_ext.kv_cache_append_.default,
            (cache.clone(), q.clone(), torch.tensor([0, 4], device=device), None),
        ),
        (
            torch.ops.transformer_ext.kv_cache_reorder_.default,
            (cache.clone(), torch.tensor([1, 1], device=device), 4),
        ),
        (torch.ops.transformer_ext.linear.default, (q.view(6, 8), kc[0, 0], kc[1, 0, :, 0].contiguous())),
        (torch.ops.transformer_ext.linear.default, (q[0, 0], kc[0, 1], None)),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_every_op(device):
    for op, args in _opcheck_cases(device):
        torch.library.opcheck(op, args)


def test_torch_compile_fullgraph_smoke():
    def step(scores, mask, q, k, v, lengths, cache, upd, pos):
        p = ops.masked_softmax(scores, mask, 0.5, True)
        o = ops.decode_attention(q, k, v, lengths, 0.3, q, q)
        ops.kv_cache_append_(cache, upd, pos)
        return p.sum() + o.sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    g = _gen(71)
    s = torch.randn(2, 2, 3, 4, generator=g)
    mask = torch.rand(2, 1, 1, 4, generator=g) < 0.8
    q, k = torch.randn(2, 2, 1, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
    lengths = torch.tensor([2, 5])
    c1, c2 = torch.zeros(2, 2, 5, 8), torch.zeros(2, 2, 5, 8)
    upd, pos = torch.randn(2, 2, 1, 8, generator=g), torch.tensor([1, 3])
    v1, v2 = c1._version, c2._version
    out = compiled(s, mask, q, k, k, lengths, c1, upd, pos)
    expected = step(s, mask, q, k, k, lengths, c2, upd, pos)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(c1, c2)
    assert c1.abs().sum() > 0
    # The compiled graph, like the eager op, bumps the version of the cache it writes.
    assert c1._version > v1 and c2._version > v2


# --------------------------------------------------------------------------- fuzz

_fuzz_settings = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@_fuzz_settings
@given(
    B=st.integers(1, 3),
    H=st.integers(1, 3),
    Q=st.integers(1, 9),
    K=st.integers(1, 70),
    dtype=st.sampled_from(DTYPES),
    mask_kind=st.sampled_from(MASK_KINDS),
    scale=st.floats(0.01, 4.0),
    seed=st.integers(0, 10_000),
)
def test_fuzz_masked_softmax(B, H, Q, K, dtype, mask_kind, scale, seed):
    scores = _randn(B, H, Q, K, seed=seed, dtype=dtype, scale=3.0)
    mask, causal = _make_mask(mask_kind, B, H, Q, K, "cpu", seed=seed)
    out = ops.masked_softmax(scores, mask, scale, causal)
    ref64 = reference.masked_softmax(scores.double(), mask, scale, causal)
    plain, allowed = _plain_softmax(scores, mask, scale, causal)
    _check_close_to_reference(out, ref64, plain, allowed.any(-1, keepdim=True).expand_as(allowed))
    assert (out[~allowed] == 0).all()


@_fuzz_settings
@given(
    B=st.integers(1, 4),
    H=st.integers(1, 3),
    L=st.integers(0, 40),
    D=st.integers(1, 40),
    with_new=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 10_000),
)
def test_fuzz_decode_attention(B, H, L, D, with_new, dtype, seed):
    q = _randn(B, H, 1, D, seed=seed, dtype=dtype)
    k = _randn(B, H, L, D, seed=seed + 1, dtype=dtype)
    v = _randn(B, H, L, D, seed=seed + 2, dtype=dtype)
    lengths = torch.randint(0, L + 1, (B,), generator=_gen(seed))
    kn = _randn(B, H, 1, D, seed=seed + 3, dtype=dtype) if with_new else None
    vn = _randn(B, H, 1, D, seed=seed + 4, dtype=dtype) if with_new else None
    out = ops.decode_attention(q, k, v, lengths, 0.5, kn, vn)
    ref = reference.decode_attention(
        q.double(),
        k.double(),
        v.double(),
        lengths,
        0.5,
        None if kn is None else kn.double(),
        None if vn is None else vn.double(),
    )
    tol = 2e-6 if dtype == torch.float32 else (4e-3 if dtype == torch.float16 else 3e-2)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max().item() <= tol * max(1.0, math.sqrt(D) / 4)


@_fuzz_settings
@given(
    B=st.integers(1, 4),
    L=st.integers(1, 12),
    T=st.integers(1, 4),
    seed=st.integers(0, 10_000),
)
def test_fuzz_kv_cache_append(B, L, T, seed):
    g = _gen(seed)
    cache = torch.randn(B, 2, L, 3, generator=g)
    update = torch.randn(B, 2, T, 3, generator=g)
    positions = torch.randint(-2, L + 2, (B,), generator=g)
    expected = cache.clone()
    try:
        reference.kv_cache_append_(expected, update, positions)
        raised = False
    except IndexError:
        raised = True
    before = cache.clone()
    if raised:
        with pytest.raises(RuntimeError, match="positions"):
            ops.kv_cache_append_(cache, update, positions)
        torch.testing.assert_close(cache, before, rtol=0, atol=0)
    else:
        ops.kv_cache_append_(cache, update, positions)
        torch.testing.assert_close(cache, expected, rtol=0, atol=0)
