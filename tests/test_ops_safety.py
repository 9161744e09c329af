"""Safety contract of the compiled ops (docs/DESIGN.md section 2), beyond their numerics.

* the in-place ops bump the version counter of what they write and refuse what autograd
  would refuse (a cache that requires grad in grad mode, an inference tensor outside
  inference mode);
* every argument of every op is on one device, meta included;
* kv_cache_append_ refuses an update that shares memory with the cache;
* the NaN rule of every attention kernel: a NaN in an allowed position makes the whole row
  NaN, as torch.softmax does, and masked positions (cache entries past the lengths) never
  matter;
* error messages name the argument and print the values the caller passed.

The oracles are torch.softmax on the allowed entries and the same op run on the input
without the NaN (masked positions must not change a single bit).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import device_params

from transformer_ext import ops, reference

DEVICES = device_params()
# float64 runs the ATen composites (the code TRANSFORMER_EXT_CPU_FALLBACK=1 selects) in-process.
NAN_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
NAN_KEY_LENGTHS = [5, 20, 33]  # all-tail, vector + tail, and more than one CUDA lane per key
NAN = float("nan")
INF = float("inf")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0, device="cpu", dtype=torch.float32):
    return torch.randn(*shape, generator=_gen(seed), dtype=torch.float64).to(device=device, dtype=dtype)


def _cache_args(device, B=2, H=2, L=6, D=4, T=1):
    cache = torch.zeros(B, H, L, D, device=device)
    update = _randn(B, H, T, D, seed=1, device=device)
    positions = torch.tensor([0, 3][:B], device=device)
    return cache, update, positions


# --------------------------------------------------------------------------- 11: autograd


@pytest.mark.parametrize("device", DEVICES)
def test_kv_cache_append_bumps_version_so_a_stale_backward_raises(device):
    """z saved c for its backward; writing c afterwards must make backward raise, as c.add_(1) does."""
    cache, update, positions = _cache_args(device)
    w = torch.ones_like(cache, requires_grad=True)
    z = (cache * w).sum()
    before = cache._version
    ops.kv_cache_append_(cache, update, positions)
    assert cache._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()


@pytest.mark.parametrize("device", DEVICES)
def test_kv_cache_reorder_bumps_version_so_a_stale_backward_raises(device):
    cache = _randn(2, 2, 6, 4, seed=2, device=device)
    w = torch.ones_like(cache, requires_grad=True)
    z = (cache * w).sum()
    before = cache._version
    ops.kv_cache_reorder_(cache, torch.tensor([1, 0], device=device), 4)
    assert cache._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()


def test_versions_of_every_written_tensor_bump_on_meta_and_error_flag():
    """The fake (meta) path bumps like the real kernels, and the error flag is a written tensor too."""
    cache, update, positions = (t.to("meta") for t in _cache_args("cpu"))
    flag = torch.zeros(1, dtype=torch.int32, device="meta")
    v_cache, v_flag = cache._version, flag._version
    ops.kv_cache_append_(cache, update, positions, flag)
    assert cache._version > v_cache and flag._version > v_flag
    v_cache = cache._version
    ops.kv_cache_reorder_(cache, torch.tensor([1, 1], device="meta"), 3)
    assert cache._version > v_cache


def test_a_refused_call_does_not_bump_the_version():
    cache, update, _ = _cache_args("cpu")
    before = cache._version
    with pytest.raises(RuntimeError, match=r"positions\[1\] = 6"):
        ops.kv_cache_append_(cache, update, torch.tensor([0, 6]))
    assert cache._version == before and (cache == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_ops_refuse_a_cache_that_requires_grad_in_grad_mode(device):
    cache, update, positions = _cache_args(device)
    leaf = cache.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="cache requires grad"):
        ops.kv_cache_append_(leaf, update, positions)
    with pytest.raises(RuntimeError, match="cache requires grad"):
        ops.kv_cache_append_(leaf * 1.0, update, positions)  # a non-leaf: no history either
    with pytest.raises(RuntimeError, match="cache requires grad"):
        ops.kv_cache_reorder_(leaf, torch.tensor([1, 0], device=device), 3)
    assert (leaf == 0).all() and (cache == 0).all(), "a refused call must not write"
    # Without grad mode, as for ATen's in-place ops on leaves, the write is allowed.
    with torch.no_grad():
        ops.kv_cache_append_(leaf, update.clone().requires_grad_(), positions)
        ops.kv_cache_reorder_(leaf, torch.tensor([0, 0], device=device), 6)
    expected = torch.zeros_like(cache)
    reference.kv_cache_append_(expected, update, positions)
    reference.kv_cache_reorder_(expected, torch.tensor([0, 0], device=device), 6)
    torch.testing.assert_close(leaf.detach(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_ops_refuse_inference_tensors_outside_inference_mode(device):
    with torch.inference_mode():
        cache, update, positions = _cache_args(device)
        flag = torch.zeros(1, dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="cache is an inference tensor"):
        ops.kv_cache_append_(cache, update, positions)
    with pytest.raises(RuntimeError, match="cache is an inference tensor"):
        ops.kv_cache_reorder_(cache, torch.tensor([1, 0], device=device), 3)
    normal_cache = torch.zeros_like(cache)
    with pytest.raises(RuntimeError, match="error_flag is an inference tensor"):
        ops.kv_cache_append_(normal_cache, update, positions, flag)
    assert (cache == 0).all() and (normal_cache == 0).all(), "refused before anything is written"
    with torch.inference_mode():  # where they were made, they may be written
        ops.kv_cache_append_(cache, update, positions, flag)
    expected = torch.zeros_like(normal_cache)
    reference.kv_cache_append_(expected, update, positions)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)


# --------------------------------------------------------------------------- 12: one device


def _op_cases():
    """(name, op, argument names, argument builder, index of the argument the others are checked
    against); every argument a tensor, on the device given to the builder."""

    def softmax(d):
        return [_randn(1, 2, 3, 4, device=d), torch.ones(1, 1, 3, 4, dtype=torch.bool, device=d)]

    def softmax_bwd(d):
        return [_randn(1, 2, 3, 4, device=d), _randn(1, 2, 3, 4, seed=1, device=d).softmax(-1)]

    def decode(d):
        q = _randn(2, 2, 1, 4, device=d)
        k = _randn(2, 2, 5, 4, seed=1, device=d)
        return [q, k, k.clone(), torch.tensor([2, 5], device=d), q.clone(), q.clone()]

    def append(d):
        return [*_cache_args(d), torch.zeros(1, dtype=torch.int32, device=d)]

    def reorder(d):
        return [torch.zeros(2, 2, 6, 4, device=d), torch.tensor([1, 0], device=d)]

    def linear(d):
        return [_randn(3, 4, device=d), _randn(5, 4, seed=1, device=d), _randn(5, seed=2, device=d)]

    def attention(d):
        q = _randn(2, 2, 3, 4, device=d)
        k = _randn(2, 2, 5, 4, seed=1, device=d)
        return [q, k, k.clone(), torch.tensor([2, 5], device=d), torch.tensor([3, 1], device=d)]

    return [
        (
            "attention",
            lambda a: ops.attention(a[0], a[1], a[2], key_lengths=a[3], query_lengths=a[4]),
            ["q", "k", "v", "key_lengths", "query_lengths"],
            attention,
            0,
        ),
        (
            "masked_softmax",
            lambda a: ops.masked_softmax(a[0], a[1], 1.0, False),
            ["scores", "mask"],
            softmax,
            0,
        ),
        (
            "masked_softmax_backward",
            lambda a: torch.ops.transformer_ext.masked_softmax_backward(a[0], a[1], 1.0),
            ["grad_probs", "probs"],
            softmax_bwd,
            1,
        ),
        (
            "decode_attention",
            lambda a: ops.decode_attention(a[0], a[1], a[2], a[3], 0.5, a[4], a[5]),
            ["q", "k_cache", "v_cache", "lengths", "k_new", "v_new"],
            decode,
            0,
        ),
        (
            "kv_cache_append_",
            lambda a: ops.kv_cache_append_(*a),
            ["cache", "update", "positions", "error_flag"],
            append,
            0,
        ),
        ("kv_cache_reorder_", lambda a: ops.kv_cache_reorder_(a[0], a[1], 3), ["cache", "index"], reorder, 0),
        ("linear", lambda a: ops.linear(*a), ["x", "weight", "bias"], linear, 0),
    ]


_ARG_CASES = [(case[0], i) for case in _op_cases() for i in range(len(case[2]))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op_name,moved", _ARG_CASES, ids=[f"{n}-{i}" for n, i in _ARG_CASES])
def test_every_argument_must_share_the_device_meta_included(device, op_name, moved):
    """One argument on meta, the rest on `device`: refused, naming an argument and both devices."""
    _, call, arg_names, build, ref = next(c for c in _op_cases() if c[0] == op_name)
    args = build(device)
    args[moved] = args[moved].to("meta")
    ref_name = arg_names[ref]
    if moved == ref:  # the reference argument itself moved: the first other one is named
        first_other = next(n for i, n in enumerate(arg_names) if i != ref)
        pattern = rf"{first_other} must be on meta \(the device of {ref_name}\), got {device}"
    else:
        pattern = rf"{arg_names[moved]} must be on {device}(:0)? \(the device of {ref_name}\), got meta"
    with pytest.raises(RuntimeError, match=pattern):
        call(args)


def test_all_meta_arguments_still_trace():
    """The fake kernels keep working when every argument is on meta (shapes only)."""
    for name, call, _, build, _ in _op_cases():
        args = [a.to("meta") for a in build("cpu")]
        out = call(args)
        if out is not None:
            assert out.device.type == "meta", name


# --------------------------------------------------------------------------- 13: overlap


@pytest.mark.parametrize("device", DEVICES)
def test_kv_cache_append_refuses_an_update_that_overlaps_the_cache(device):
    cache = _randn(2, 1, 8, 2, seed=3, device=device)
    before = cache.clone()
    pos = torch.tensor([0, 0], device=device)
    # A strided view of the cache itself (the layout ATen's helper cannot decide).
    with pytest.raises(RuntimeError, match="update shares memory with cache"):
        ops.kv_cache_append_(cache, cache[:, :, 1:5], pos)
    # The cache itself as its own update.
    with pytest.raises(RuntimeError, match="update shares memory with cache"):
        ops.kv_cache_append_(cache, cache, pos)
    # Two dense views of one buffer that partially overlap.
    base = torch.zeros(48, device=device)
    with pytest.raises(RuntimeError, match="update shares memory with cache"):
        ops.kv_cache_append_(base[:32].view(2, 1, 8, 2), base[24:40].view(2, 1, 4, 2), pos)
    torch.testing.assert_close(cache, before, rtol=0, atol=0)
    assert (base == 0).all(), "a refused call must not write"
    # Disjoint parts of one buffer are fine.
    base[32:48] = torch.arange(16, dtype=base.dtype, device=device)
    c, u = base[:32].view(2, 1, 8, 2), base[32:48].view(2, 1, 4, 2)
    expected = c.clone()
    reference.kv_cache_append_(expected, u, torch.tensor([1, 4]))
    ops.kv_cache_append_(c, u, torch.tensor([1, 4], device=device))
    torch.testing.assert_close(c, expected, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_ops_refuse_a_cache_whose_elements_share_memory(device):
    cache = torch.zeros(1, 1, 6, 4, device=device).expand(2, 1, 6, 4)  # batch stride 0
    update = _randn(2, 1, 1, 4, device=device)
    with pytest.raises(RuntimeError, match="cache has elements that share memory"):
        ops.kv_cache_append_(cache, update, torch.tensor([0, 1], device=device))
    with pytest.raises(RuntimeError, match="cache has elements that share memory"):
        ops.kv_cache_reorder_(cache, torch.tensor([1, 0], device=device), 3)


# --------------------------------------------------------------------------- 14: NaN rule


def _softmax_oracle(scores, allowed, scale):
    """torch.softmax over the allowed entries, in float64, with empty rows as zeros."""
    x = (scores.double() * scale).masked_fill(~allowed, -INF)
    p = torch.softmax(x, dim=-1)
    return torch.where(allowed.any(-1, keepdim=True), p, 0.0)


def _allowed(mask, causal, shape):
    allowed = torch.ones(shape, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & mask.cpu()
    if causal:
        allowed = allowed & reference.causal_mask(shape[-2], shape[-1])
    return allowed


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", NAN_DTYPES)
@pytest.mark.parametrize("K", NAN_KEY_LENGTHS)
@pytest.mark.parametrize("poison", [NAN, INF])
def test_masked_softmax_nan_in_an_allowed_position_makes_the_row_nan(device, dtype, K, poison):
    """A NaN (or +inf: inf - inf) allowed score: that row all NaN, like torch.softmax; other rows untouched."""
    B, H, Q = 2, 1, 3
    scores = _randn(B, H, Q, K, seed=K, dtype=dtype)
    mask = torch.ones(B, H, Q, K, dtype=torch.bool)
    mask[1, 0, 0, :] = False  # a fully masked row, NaN inside it below
    mask[0, 0, 1, 1] = False
    # Poisoned allowed keys: the first key, the last one (a tail element), one in the middle.
    rows = [(0, 0, 0, 0), (0, 0, 1, K - 1), (1, 0, 2, K // 2)]
    clean = scores.clone()
    for r in rows:
        scores[r] = poison
    scores[1, 0, 0, 2] = NAN
    out = ops.masked_softmax(scores.to(device), mask.to(device), 0.5, False).cpu()
    oracle = _softmax_oracle(scores, mask, 0.5)
    for b, h, q, _ in rows:
        assert torch.isnan(oracle[b, h, q]).all()  # what torch.softmax does
        assert torch.isnan(out[b, h, q]).all(), f"row {(b, h, q)}: {out[b, h, q]}"
        assert torch.isnan(reference.masked_softmax(scores, mask, 0.5, False)[b, h, q]).all()
    assert (out[1, 0, 0] == 0).all(), "a fully masked row stays zeros, whatever its scores"
    # Every other row equals the result without the poison, bit for bit.
    base = ops.masked_softmax(clean.to(device), mask.to(device), 0.5, False).cpu()
    keep = torch.ones(B, H, Q, dtype=torch.bool)
    for b, h, q, _ in rows:
        keep[b, h, q] = False
    assert torch.equal(out[keep], base[keep])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", NAN_DTYPES)
@pytest.mark.parametrize("K", NAN_KEY_LENGTHS)
@pytest.mark.parametrize("mask_kind", ["bool", "causal", "broadcast"])
def test_masked_softmax_nan_in_a_masked_position_changes_nothing(device, dtype, K, mask_kind):
    B, H, Q = 2, 2, 4
    scores = _randn(B, H, Q, K, seed=K + 1, dtype=dtype)
    causal = mask_kind == "causal"
    if mask_kind == "bool":
        mask = torch.rand(B, H, Q, K, generator=_gen(K)) < 0.6
        mask[..., 0] = True
    elif mask_kind == "broadcast":  # [B, 1, 1, K] padding mask, a stride-0 view in the kernels
        mask = torch.arange(K).view(1, 1, 1, K) < torch.tensor([K, K // 2]).view(B, 1, 1, 1)
    else:
        mask = None
    allowed = _allowed(mask, causal, scores.shape)
    poisoned = scores.masked_fill(~allowed, NAN)
    m = None if mask is None else mask.to(device)
    out = ops.masked_softmax(poisoned.to(device), m, 0.7, causal).cpu()
    base = ops.masked_softmax(scores.to(device), m, 0.7, causal).cpu()
    assert torch.equal(out, base)
    assert not torch.isnan(out).any()
    ref = reference.masked_softmax(poisoned, mask, 0.7, causal)
    assert torch.equal(ref, reference.masked_softmax(scores, mask, 0.7, causal))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masked_softmax_backward_follows_the_nan_rule(device, dtype):
    """NaN row: NaN gradients where torch.softmax's are NaN; masked NaN: the same gradient as without."""
    B, H, Q, K = 1, 2, 3, 20
    scores = _randn(B, H, Q, K, seed=9, dtype=dtype)
    mask = torch.ones(B, H, Q, K, dtype=torch.bool)
    mask[0, 1, :, 10:] = False
    grad = _randn(B, H, Q, K, seed=10, dtype=dtype)

    def grads(x):
        x = x.to(device).clone().requires_grad_()  # .to() of a CPU tensor is the tensor itself
        ops.masked_softmax(x, mask.to(device), 0.5, False).backward(grad.to(device))
        return x.grad.cpu()

    poisoned = scores.clone()
    poisoned[0, 0, 1, 17] = NAN  # allowed (a tail element of the vectorized CPU loop)
    poisoned[0, 1, 2, 15] = NAN  # masked
    g = grads(poisoned)
    x = poisoned.clone().requires_grad_()
    torch.softmax((x * 0.5).masked_fill(~mask, -INF), -1).backward(grad)
    assert torch.isnan(x.grad[0, 0, 1]).all() and torch.isnan(g[0, 0, 1]).all()
    clean_rows = torch.ones(B, H, Q, dtype=torch.bool)
    clean_rows[0, 0, 1] = False
    assert torch.equal(g[clean_rows], grads(scores)[clean_rows])
    torch.testing.assert_close(g[clean_rows], x.grad[clean_rows])


def _decode_inputs(dtype, D, with_new, L=13):
    B, H = 3, 2
    q = _randn(B, H, 1, D, seed=31, dtype=dtype)
    k = _randn(B, H, L, D, seed=32, dtype=dtype)
    v = _randn(B, H, L, D, seed=33, dtype=dtype)
    lengths = torch.tensor([L, 5, 0])
    kn = _randn(B, H, 1, D, seed=34, dtype=dtype) if with_new else None
    vn = _randn(B, H, 1, D, seed=35, dtype=dtype) if with_new else None
    return q, k, v, lengths, kn, vn


def _decode(device, q, k, v, lengths, kn, vn):
    to = lambda t: None if t is None else t.to(device)
    return ops.decode_attention(to(q), to(k), to(v), to(lengths), 0.4, to(kn), to(vn)).cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", NAN_DTYPES)
@pytest.mark.parametrize("D", [7, 64])
@pytest.mark.parametrize("with_new", [False, True])
def test_decode_attention_nan_rule(device, dtype, D, with_new):
    """NaN in q, in an attended key or in k_new: that (b, h) row is NaN; past the lengths: no effect."""
    q, k, v, lengths, kn, vn = _decode_inputs(dtype, D, with_new)
    base = _decode(device, q, k, v, lengths, kn, vn)
    assert not torch.isnan(base).any()

    def check_nan_row(out, b, h):
        assert torch.isnan(out[b, h]).all(), f"row {(b, h)}: {out[b, h]}"
        others = torch.ones(out.shape[:2], dtype=torch.bool)
        others[b, h] = False
        assert torch.equal(out[others], base[others])

    q2 = q.clone()
    q2[1, 0, 0, D - 1] = NAN
    check_nan_row(_decode(device, q2, k, v, lengths, kn, vn), 1, 0)
    assert torch.isnan(reference.decode_attention(q2, k, v, lengths, 0.4, kn, vn)[1, 0]).all()
    k2 = k.clone()
    k2[0, 1, 12, 0] = NAN  # the last attended key of row 0 (length 13): a tail element
    k2[1, 1, 2, 3] = NAN  # inside row 1's prefix of 5
    out = _decode(device, q, k2, v, lengths, kn, vn)
    assert torch.isnan(out[0, 1]).all() and torch.isnan(out[1, 1]).all()
    assert torch.equal(out[:, 0], base[:, 0])
    if with_new:
        kn2 = kn.clone()
        kn2[2, 1, 0, 0] = NAN  # row 2 has no cache keys: only the new one
        check_nan_row(_decode(device, q, k, v, lengths, kn2, vn), 2, 1)
    # Past the lengths, NaN keys and values are never read.
    k3, v3 = k.clone(), v.clone()
    for b, n in enumerate(lengths.tolist()):
        k3[b, :, n:] = NAN
        v3[b, :, n:] = NAN
    assert torch.equal(_decode(device, q, k3, v3, lengths, kn, vn), base)
    assert torch.equal(
        reference.decode_attention(q, k3, v3, lengths, 0.4, kn, vn),
        reference.decode_attention(q, k, v, lengths, 0.4, kn, vn),
    )


def test_nan_rule_of_the_cpu_fallback_composites():
    """TRANSFORMER_EXT_CPU_FALLBACK=1 (the ATen composites) follows the same rule for float32."""
    code = r"""
import torch
from transformer_ext import ops
nan = float("nan")
s = torch.randn(1, 1, 3, 20, generator=torch.Generator().manual_seed(0))
m = torch.ones(1, 1, 3, 20, dtype=torch.bool); m[0, 0, 2, 7] = False
clean = ops.masked_softmax(s, m, 1.0, False)
s[0, 0, 0, 19] = nan; s[0, 0, 2, 7] = nan
out = ops.masked_softmax(s, m, 1.0, False)
assert torch.isnan(out[0, 0, 0]).all(), out
assert torch.equal(out[0, 0, 1:], clean[0, 0, 1:]), out
q = torch.randn(2, 1, 1, 8); k = torch.randn(2, 1, 6, 8); lengths = torch.tensor([6, 2])
base = ops.decode_attention(q, k, k, lengths, 0.5)
k[0, 0, 5, 0] = nan; k[1, 0, 4, 0] = nan
out = ops.decode_attention(q, k, k, lengths, 0.5)
assert torch.isnan(out[0]).all() and torch.equal(out[1], base[1]), out
print("nan rule ok")
"""
    env = {**os.environ, "TRANSFORMER_EXT_CPU_FALLBACK": "1"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "nan rule ok" in res.stdout, res.stderr


# --------------------------------------------------------------------------- 17: messages


@pytest.mark.parametrize("device", DEVICES)
def test_position_overflow_message_prints_the_position_not_a_wrapped_sum(device):
    cache = torch.zeros(1, 1, 4, 2, device=device)
    big = 2**63 - 1
    with pytest.raises(RuntimeError) as info:
        ops.kv_cache_append_(cache, torch.ones(1, 1, 2, 2, device=device), torch.tensor([big], device=device))
    msg = str(info.value)
    assert f"positions[0] = {big} leaves no room for T = 2 new tokens" in msg and "L = 4" in msg
    assert f"-{big}" not in msg and str(-(2**63) + 1) not in msg
    with pytest.raises(
        RuntimeError, match=r"positions\[0\] = 0 cannot be written: update holds T = 5 tokens"
    ):
        ops.kv_cache_append_(cache, torch.ones(1, 1, 5, 2, device=device), torch.tensor([0], device=device))
    assert (cache == 0).all()


@pytest.mark.parametrize("device", [*DEVICES, "meta"])
def test_error_flag_dtype_message_names_the_argument_and_int32(device):
    cache, update, positions = _cache_args(device)
    with pytest.raises(RuntimeError, match=r"error_flag must be .*int32.*, got .*float32"):
        ops.kv_cache_append_(cache, update, positions, torch.zeros(1, device=device))


# --------------------------------------------------------------------------- inference-only ops
def _linear_args(requires_grad):
    g = _gen(5)
    x = torch.randn(3, 4, generator=g).requires_grad_(requires_grad)
    w = torch.randn(5, 4, generator=g).requires_grad_(requires_grad)
    b = torch.randn(5, generator=g).requires_grad_(requires_grad)
    return x, w, b


def _decode_args(requires_grad):
    g = _gen(6)
    q = torch.randn(2, 2, 1, 8, generator=g).requires_grad_(requires_grad)
    k = torch.randn(2, 2, 5, 8, generator=g).requires_grad_(requires_grad)
    v = torch.randn(2, 2, 5, 8, generator=g).requires_grad_(requires_grad)
    kn = torch.randn(2, 2, 1, 8, generator=g).requires_grad_(requires_grad)
    vn = torch.randn(2, 2, 1, 8, generator=g).requires_grad_(requires_grad)
    return q, k, v, torch.tensor([3, 5]), 0.35, kn, vn


INFERENCE_OPS = [
    ("linear", lambda a: ops.linear(*a), lambda a: torch.nn.functional.linear(*a), _linear_args),
    (
        "decode_attention",
        lambda a: ops.decode_attention(*a),
        lambda a: reference.decode_attention(*a),
        _decode_args,
    ),
]


@pytest.mark.parametrize("name, op, oracle, make", INFERENCE_OPS, ids=[c[0] for c in INFERENCE_OPS])
def test_backward_through_an_inference_op_raises_instead_of_leaving_grads_none(name, op, oracle, make):
    args = make(True)
    out = op(args)
    torch.testing.assert_close(out, oracle(args).detach())  # the forward is unchanged in grad mode
    with pytest.raises(RuntimeError, match=rf"ops\.{name} is not differentiable"):
        out.sum().backward()
    assert all(a.grad is None for a in args if isinstance(a, torch.Tensor))
    with torch.no_grad():  # where the package uses them: no autograd, no error
        assert not op(args).requires_grad
    plain = make(False)
    assert not op(plain).requires_grad
