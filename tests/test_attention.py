"""ops.attention (fused attention for training and encoding) against reference.attention in
float64: lengths, causal alignment, Q != K, Q = 1, empty rows, dtypes, strides, the NaN rule,
the backward kernel, the counter-based dropout generator, bad input, opcheck and compile.

Reduced-precision rule: the kernel's error against the float64 reference is at most twice
that of the plain three-step PyTorch computation run in the same precision.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import device_params
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transformer_ext import ops, reference

DEVICES = device_params()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (B, H, Q, K, D): Q != K both ways, Q = 1, tiles of 64 crossed, head dims not a multiple of 8
SHAPES = [(2, 2, 1, 9, 8), (3, 2, 70, 130, 40), (2, 3, 130, 65, 64), (1, 1, 5, 5, 3), (2, 1, 64, 64, 17)]
LENGTHS = ["none", "keys", "queries", "both"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _inputs(B, H, Q, K, D, dtype=torch.float32, device="cpu", seed=0):
    g = _gen(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for n in (Q, K, K))
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))


def _lengths(kind, B, Q, K, device="cpu", seed=0):
    g = _gen(seed + 100)
    kl = ql = None
    if kind in ("keys", "both"):
        kl = torch.randint(0, K + 1, (B,), generator=g)
        kl[0] = K
        if B > 1:
            kl[-1] = 0  # a row with no key at all
        kl = kl.to(device)
    if kind in ("queries", "both"):
        ql = torch.randint(0, Q + 1, (B,), generator=g)
        ql[0] = Q
        ql = ql.to(device)
    return kl, ql


def _plain(q, k, v, kl, ql, scale, causal):
    """The three-step computation in the input's own precision (the tolerance baseline)."""
    B, H, Q, _ = q.shape
    K = k.shape[2]
    j = torch.arange(K, device=q.device).view(1, 1, 1, K)
    i = torch.arange(Q, device=q.device).view(1, 1, Q, 1)
    allowed = torch.ones(B, 1, Q, K, dtype=torch.bool, device=q.device)
    if kl is not None:
        allowed = allowed & (j < kl.view(B, 1, 1, 1))
    if ql is not None:
        allowed = allowed & (i < ql.view(B, 1, 1, 1))
    if causal:
        allowed = allowed & reference.causal_mask(Q, K, device=q.device)
    s = (q @ k.transpose(-2, -1)) * scale
    p = s.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
    return p @ v


def _assert_close(out, ref64, plain):
    assert out.dtype == plain.dtype
    err = (out.double() - ref64).abs().max().item()
    plain_err = (plain.double() - ref64).abs().max().item()
    floor = 1e-6 if out.dtype == torch.float32 else 1e-4
    assert err <= max(2 * plain_err, floor), f"{out.dtype}: error {err:.3g}, plain PyTorch {plain_err:.3g}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_reference(device, dtype, shape, lengths, causal):
    B, H, Q, K, D = shape
    q, k, v = _inputs(*shape, dtype=dtype, device=device)
    kl, ql = _lengths(lengths, B, Q, K, device)
    out = ops.attention(q, k, v, key_lengths=kl, query_lengths=ql, causal=causal)
    assert out.shape == (B, H, Q, D) and out.device == q.device
    ref64 = reference.attention(q.double(), k.double(), v.double(), kl, ql, None, causal)
    _assert_close(out, ref64, _plain(q, k, v, kl, ql, 1 / math.sqrt(D), causal))
    if ql is not None:
        rows = torch.arange(Q, device=device).view(1, Q) >= ql.view(B, 1)
        assert (out.transpose(1, 2)[rows] == 0).all(), "rows past query_lengths must be zeros"


@pytest.mark.parametrize("device", DEVICES)
def test_attention_causal_bottom_right_and_empty_rows(device):
    # Q > K: the first Q - K queries see no key (zeros); the last query sees every key.
    q, k, v = _inputs(1, 2, 9, 4, 8, device=device, seed=3)
    out = ops.attention(q, k, v, causal=True, scale=0.7)
    assert (out[:, :, :5] == 0).all()
    last = torch.softmax((q[:, :, -1:] @ k.transpose(-2, -1)).double() * 0.7, -1) @ v.double()
    torch.testing.assert_close(out[:, :, -1:].double(), last, atol=1e-6, rtol=1e-6)
    ref = reference.attention(q.double(), k.double(), v.double(), None, None, 0.7, True)
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_attention_strided_views_and_output_layout(device):
    B, T, H, D = 2, 33, 4, 16
    g = _gen(5)
    proj = torch.randn(B, T, 3 * H * D, generator=g).to(device)  # a fused QKV projection output
    q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in proj.split(H * D, dim=-1))
    assert not q.is_contiguous() and q.stride(-1) == 1
    kl = torch.tensor([33, 20], device=device)
    out = ops.attention(q, k, v, key_lengths=kl, causal=True)
    ref = reference.attention(q.double(), k.double(), v.double(), kl, None, None, True)
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=1e-6)
    assert out.transpose(1, 2).is_contiguous(), "out must have the memory layout of [B, Q, H, D]"
    # a last dimension that is not dense is accepted too (copied)
    kt = k.transpose(-1, -2).contiguous().transpose(-1, -2)
    torch.testing.assert_close(ops.attention(q, kt, v, key_lengths=kl, causal=True), out)


@pytest.mark.parametrize("device", DEVICES)
def test_attention_never_reads_past_lengths(device):
    B, H, Q, K, D = 2, 2, 20, 80, 16
    q, k, v = _inputs(B, H, Q, K, D, device=device, seed=7)
    kl = torch.tensor([70, 3], device=device)
    ql = torch.tensor([20, 11], device=device)
    clean = ops.attention(q, k, v, key_lengths=kl, query_lengths=ql)
    k2, v2, q2 = k.clone(), v.clone(), q.clone()
    k2[0, :, 70:] = float("nan")
    v2[0, :, 70:] = float("inf")
    k2[1, :, 3:] = float("nan")
    v2[1, :, 3:] = float("nan")
    q2[1, :, 11:] = float("nan")
    dirty = ops.attention(q2, k2, v2, key_lengths=kl, query_lengths=ql)
    assert torch.isfinite(dirty).all()
    assert torch.equal(clean, dirty)


def _poisoned_backward_grads(device, dtype=torch.float32):
    """Gradients of the same attention with and without NaN/inf in the rows past the lengths
    (keys and values past key_lengths, queries and output gradients past query_lengths)."""
    B, H, Q, K, D = 2, 2, 20, 80, 16
    q, k, v = _inputs(B, H, Q, K, D, dtype=dtype, device=device, seed=8)
    g = torch.randn(B, H, Q, D, generator=_gen(9), dtype=torch.float64).to(device=device, dtype=dtype)
    kl = torch.tensor([70, 3], device=device)
    ql = torch.tensor([20, 11], device=device)
    grads = []
    for poison in (False, True):
        q2, k2, v2, g2 = q.clone(), k.clone(), v.clone(), g.clone()
        if poison:
            k2[0, :, 70:] = float("nan")
            v2[0, :, 70:] = float("inf")
            k2[1, :, 3:] = float("nan")
            v2[1, :, 3:] = float("nan")
            q2[1, :, 11:] = float("nan")
            g2[1, :, 11:] = float("nan")
        leaves = [t.requires_grad_() for t in (q2, k2, v2)]
        ops.attention(*leaves, key_lengths=kl, query_lengths=ql, dropout_p=0.2, seed=3).backward(g2)
        grads.append([t.grad for t in leaves])
    return grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # float64: the ATen composite
def test_attention_backward_never_reads_past_lengths(device, dtype):
    clean, dirty = _poisoned_backward_grads(device, dtype)
    for c, d in zip(clean, dirty):
        assert torch.isfinite(d).all()
        assert torch.equal(c, d)


@pytest.mark.parametrize("device", DEVICES)
def test_attention_nan_score_makes_its_row_nan(device):
    q, k, v = _inputs(1, 1, 6, 6, 8, device=device, seed=9)
    q[0, 0, 1, 2] = float("nan")  # row 1 has NaN scores
    k[0, 0, 4, 0] = float("nan")  # key 4: NaN for every row that may see it
    out = ops.attention(q, k, v, causal=True)
    nan_rows = torch.isnan(out[0, 0]).all(-1)
    assert nan_rows.tolist() == [False, True, False, False, True, True]
    assert torch.isfinite(out[0, 0, [0, 2, 3]]).all()


# --------------------------------------------------------------------------- backward


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_attention_backward_matches_reference(device, dtype, causal, dropout_p):
    B, H, Q, K, D = 3, 2, 70, 130, 24
    q, k, v = _inputs(B, H, Q, K, D, device=device, seed=11)
    kl = torch.tensor([130, 5, 0], device=device)
    ql = torch.tensor([70, 3, 40], device=device)
    grad = torch.randn(B, H, Q, D, generator=_gen(12)).to(device)
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = ops.attention(
        *leaves, key_lengths=kl, query_lengths=ql, causal=causal, dropout_p=dropout_p, seed=99
    )
    out.backward(grad.to(dtype))
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = reference.attention(*ref_leaves, kl, ql, None, causal, dropout_p, 99)
    ref.backward(grad.double())
    plain_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    plain = _plain(*plain_leaves, kl, ql, 1 / math.sqrt(D), causal) if dropout_p == 0 else None
    if plain is not None:
        plain.backward(grad.to(dtype))
    for name, a, r, p in zip("qkv", leaves, ref_leaves, plain_leaves):
        err = (a.grad.double() - r.grad).abs().max().item()
        scale = r.grad.abs().max().item()
        if dtype == torch.float32:
            assert err <= 1e-5 * max(1.0, scale), f"d{name}: error {err:.3g}"
        elif plain is not None:
            plain_err = (p.grad.double() - r.grad).abs().max().item()
            assert err <= 2 * plain_err + 1e-3, f"d{name}: error {err:.3g}, plain {plain_err:.3g}"
        else:
            assert err <= (2e-2 if dtype == torch.bfloat16 else 4e-3) * max(1.0, scale), f"d{name}: {err:.3g}"
    # no gradient flows to padding: keys past key_lengths and queries past query_lengths
    assert (leaves[1].grad[2] == 0).all() and (leaves[2].grad[1, :, 5:] == 0).all()
    assert (leaves[0].grad[1, :, 3:] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_attention_gradcheck_float64(device):
    g = _gen(13)
    q, k, v = (
        torch.randn(2, 2, n, 5, generator=g, dtype=torch.float64).to(device).requires_grad_()
        for n in (6, 9, 9)
    )
    kl = torch.tensor([9, 4], device=device)
    ql = torch.tensor([5, 6], device=device)

    def fn(a, b, c):
        return ops.attention(a, b, c, key_lengths=kl, query_lengths=ql, causal=True, dropout_p=0.2, seed=5)

    assert torch.autograd.gradcheck(fn, (q, k, v))


# --------------------------------------------------------------------------- dropout


def test_dropout_debug_mask_matches_reference_generator():
    for seed in (0, 1, -1, 2**62 + 12345, -(2**63)):
        got = ops.attention_dropout_mask(seed, 2, 3, 5, 70, 0.3)
        expected = reference.attention_dropout_keep(seed, 2, 3, 5, 70, 0.3)
        assert torch.equal(got, expected), f"seed {seed}"
    assert ops.attention_dropout_mask(3, 1, 1, 4, 4, 0.0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_output_uses_the_debug_mask(device):
    B, H, Q, K, D, p = 2, 2, 9, 70, 8, 0.4
    q, k, v = _inputs(B, H, Q, K, D, device=device, seed=17)
    out = ops.attention(q, k, v, causal=True, dropout_p=p, seed=42)
    keep = ops.attention_dropout_mask(42, B, H, Q, K, p).to(device)
    s = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(D)
    probs = s.masked_fill(~reference.causal_mask(Q, K, device=device), float("-inf")).softmax(-1)
    manual = (probs * keep / (1 - p)) @ v.double()
    torch.testing.assert_close(out.double(), manual, atol=2e-6, rtol=1e-5)
    assert not torch.equal(out, ops.attention(q, k, v, causal=True, dropout_p=p, seed=43))


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_same_seed_same_output_at_1_and_2_threads(device):
    q, k, v = _inputs(4, 2, 130, 130, 32, device=device, seed=19)
    kl = torch.tensor([130, 64, 1, 100], device=device)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = ops.attention(*leaves, key_lengths=kl, causal=True, dropout_p=0.1, seed=1234)
            out.sum().backward()
            results.append([out.detach()] + [t.grad for t in leaves])
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_kept_fraction_within_binomial_bound(p):
    B, H, Q, K = 4, 8, 64, 128
    n = B * H * Q * K
    kept = ops.attention_dropout_mask(2024, B, H, Q, K, p)
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(kept.sum().item() - n * (1 - p)) <= 5 * sigma
    # rows and heads are not copies of one another, and per-row fractions spread binomially
    rows = kept.view(-1, K).float().mean(1)
    assert rows.std().item() == pytest.approx(math.sqrt(p * (1 - p) / K), rel=0.2)
    assert not torch.equal(kept[0, 0], kept[0, 1]) and not torch.equal(kept[0], kept[1])


def test_dropout_seed_comes_from_torch_generator():
    q, k, v = _inputs(1, 2, 8, 8, 8, seed=23)
    torch.manual_seed(7)
    a = ops.attention(q, k, v, dropout_p=0.5)
    b = ops.attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(7)
    c = ops.attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, c) and not torch.equal(a, b)


# --------------------------------------------------------------------------- bad input


def test_attention_bad_inputs_name_the_argument():
    q, k, v = _inputs(2, 2, 4, 6, 8)
    cases = [
        (dict(q=q[0]), "q must have 4 dimensions"),
        (dict(k=k.half()), "k must have the dtype of q"),
        (dict(v=v[:, :, :5]), "v must have the shape of k"),
        (dict(k=k[:, :1]), "k must have shape"),
        (dict(q=q.int()), "q must be float32"),
        (dict(key_lengths=torch.tensor([6, 7])), "key_lengths[1] = 7 is out of range"),
        (dict(key_lengths=torch.tensor([6, -1])), "key_lengths[1] = -1"),
        (dict(query_lengths=torch.tensor([5, 1])), "query_lengths[0] = 5"),
        (dict(key_lengths=torch.tensor([6, 6], dtype=torch.int32)), "key_lengths must be int64"),
        (dict(key_lengths=torch.tensor([6])), "key_lengths must have shape [2]"),
        (dict(key_lengths=torch.tensor([6, 6], device="meta")), "key_lengths must be on cpu"),
        (dict(v=v.to("meta")), "v must be on cpu"),
    ]
    for kwargs, message in cases:
        args = dict(q=q, k=k, v=v)
        args.update({n: kwargs.pop(n) for n in ("q", "k", "v") if n in kwargs})
        with pytest.raises(RuntimeError) as info:
            ops.attention(args["q"], args["k"], args["v"], **kwargs)
        assert message in str(info.value), (message, str(info.value))
    for p in (1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="dropout_p must be in"):
            ops.attention(q, k, v, dropout_p=p)
    for seed in (1.5, "3", True, torch.tensor(3)):
        with pytest.raises(TypeError, match="seed must be a Python int"):
            ops.attention(q, k, v, dropout_p=0.1, seed=seed)
    with pytest.raises(RuntimeError, match="seed is required"):
        torch.ops.transformer_ext.attention(q, k, v, None, None, 1.0, False, 0.1, None)
    with pytest.raises(RuntimeError, match="seed must be an int64 tensor"):
        torch.ops.transformer_ext.attention(q, k, v, None, None, 1.0, False, 0.1, torch.ones(2))


# --------------------------------------------------------------------------- opcheck / compile


@pytest.mark.parametrize("device", DEVICES)
def test_attention_opcheck(device):
    q, k, v = _inputs(2, 2, 5, 7, 8, device=device, seed=29)
    kl = torch.tensor([7, 2], device=device)
    ql = torch.tensor([5, 3], device=device)
    seed = torch.tensor([11], device=device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    op = torch.ops.transformer_ext
    torch.library.opcheck(op.attention.default, (*leaves, kl, ql, 0.4, True, 0.25, seed))
    torch.library.opcheck(op.attention.default, (q, k, v, None, None, 0.4, False, 0.0, None))
    out, lse = op.attention(q, k, v, kl, ql, 0.4, True, 0.25, seed)
    torch.library.opcheck(
        op.attention_backward.default,
        (torch.randn_like(out), q, k, v, out, lse, kl, ql, 0.4, True, 0.25, seed),
    )
    torch.library.opcheck(op.attention_dropout_mask.default, (seed.cpu(), 2, 2, 3, 4, 0.3))


def test_attention_torch_compile_fullgraph_forward_and_backward():
    def loss(q, k, v, kl):
        out = ops.attention(q, k, v, key_lengths=kl, causal=True, dropout_p=0.2, seed=3)
        return (out * out).sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    q, k, v = _inputs(2, 2, 9, 9, 8, seed=31)
    kl = torch.tensor([9, 4])
    a = [t.clone().requires_grad_() for t in (q, k, v)]
    b = [t.clone().requires_grad_() for t in (q, k, v)]
    la, lb = compiled(*a, kl), loss(*b, kl)
    la.backward()
    lb.backward()
    torch.testing.assert_close(la, lb)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.grad, y.grad)


# --------------------------------------------------------------------------- fuzz


@settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    B=st.integers(1, 3),
    H=st.integers(1, 2),
    Q=st.integers(1, 70),
    K=st.integers(0, 70),
    D=st.integers(1, 20),
    causal=st.booleans(),
    dropout_p=st.sampled_from([0.0, 0.2]),
    with_lengths=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_fuzz_attention(B, H, Q, K, D, causal, dropout_p, with_lengths, seed):
    q, k, v = _inputs(B, H, Q, K, D, seed=seed)
    g = _gen(seed)
    kl = torch.randint(0, K + 1, (B,), generator=g) if with_lengths else None
    ql = torch.randint(0, Q + 1, (B,), generator=g) if with_lengths else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ops.attention(
        *leaves, key_lengths=kl, query_lengths=ql, causal=causal, dropout_p=dropout_p, seed=seed
    )
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = reference.attention(*ref_leaves, kl, ql, None, causal, dropout_p, seed)
    if out.numel():
        assert (out.double() - ref).abs().max().item() <= 2e-6
    grad = torch.randn(out.shape, generator=g)
    out.backward(grad)
    ref.backward(grad.double())
    for a, r in zip(leaves, ref_leaves):
        rg = r.grad if r.grad is not None else torch.zeros_like(r)  # K = 0: k, v unused
        if rg.numel():
            assert (a.grad.double() - rg).abs().max().item() <= 1e-5 * max(1.0, rg.abs().max().item())


# --------------------------------------------------------------------------- the model


def _batch(config, B=4, S=11, T=9, seed=1):
    g = _gen(seed)
    src = torch.randint(3, config.src_vocab_size, (B, S), generator=g)
    lengths = torch.tensor([S, 6, 1, 9][:B], dtype=torch.int64)
    for b in range(B):
        src[b, lengths[b] :] = config.pad_id
    tgt = torch.randint(3, config.tgt_vocab_size, (B, T + 1), generator=g)
    tgt[:, 0] = config.bos_id
    tgt[1, 5:] = config.pad_id
    return src, lengths, tgt[:, :-1], tgt[:, 1:]


def _set_fused(model, fused: bool) -> None:
    from transformer_ext.model import MultiHeadAttention

    for m in model.modules():
        if isinstance(m, MultiHeadAttention):
            m.fused_attention = fused


def _train_losses(fused: bool, dropout: float, steps: int = 4, norm_first: bool = False):
    from transformer_ext.config import TransformerConfig
    from transformer_ext.model import Transformer

    torch.manual_seed(0)
    config = TransformerConfig.preset("tiny", dropout=dropout, norm_first=norm_first)
    model = Transformer(config)
    _set_fused(model, fused)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    src, lengths, tgt_in, tgt_out = _batch(config)
    losses = []
    model.train()
    for _ in range(steps):
        logits = model(src, lengths, tgt_in)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            tgt_out.reshape(-1),
            ignore_index=config.pad_id,
            label_smoothing=0.1,
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("norm_first", [False, True])
def test_training_loss_curve_matches_three_step_path(norm_first):
    fused, m_fused = _train_losses(True, 0.0, norm_first=norm_first)
    plain, m_plain = _train_losses(False, 0.0, norm_first=norm_first)
    assert fused[-1] < fused[0], "the loss must go down"
    assert fused == pytest.approx(plain, rel=1e-4, abs=1e-5)
    for (name, a), (_, b) in zip(m_fused.named_parameters(), m_plain.named_parameters()):
        # The key bias adds the same q.b_k to every score of a row, so softmax cancels it: its
        # gradient is rounding noise, which Adam scales up to full-size steps of random sign.
        if not name.endswith("W_K.bias"):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-3, msg=name)


def test_training_with_attention_dropout_is_reproducible_and_uses_it():
    a, _ = _train_losses(True, 0.1, steps=2)
    b, _ = _train_losses(True, 0.1, steps=2)
    assert a == b  # torch.manual_seed fixes the attention dropout seeds too
    c, _ = _train_losses(True, 0.0, steps=2)
    assert a[0] != c[0]


def test_model_attention_goes_through_the_op_except_when_exporting(monkeypatch):
    from transformer_ext import model as model_mod
    from transformer_ext.config import TransformerConfig

    config = TransformerConfig.preset("tiny", dropout=0.0)
    model = model_mod.Transformer(config).eval()
    src, lengths, tgt_in, _ = _batch(config)
    calls = []
    original = ops.attention

    def counting(*args, **kwargs):
        calls.append(kwargs.get("causal", False))
        return original(*args, **kwargs)

    monkeypatch.setattr(ops, "attention", counting)
    with torch.no_grad():
        logits = model(src, lengths, tgt_in)
        model.encode(src, lengths)
    # encoder self-attention (2 layers), decoder self (causal) + cross (2 layers each), encode again
    assert sorted(calls) == [False] * 6 + [True] * 2
    calls.clear()
    monkeypatch.setattr(model_mod, "_is_exporting", lambda: True)
    with torch.no_grad():
        exported_path = model(src, lengths, tgt_in)
    assert calls == []
    torch.testing.assert_close(exported_path, logits, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- the ATen composite


def test_attention_float64_and_empty_shapes():
    # float64 runs the ATen composite (as CPUs without AVX2 do): same semantics, empty shapes too
    for B, H, Q, K in [(2, 2, 3, 0), (2, 2, 0, 4), (0, 2, 3, 4)]:
        q, k, v = (t.requires_grad_() for t in _inputs(B, H, Q, K, 4, dtype=torch.float64))
        out = ops.attention(q, k, v, causal=True, dropout_p=0.5, seed=1)
        assert out.shape == (B, H, Q, 4) and (out == 0).all()
        out.sum().backward()
        assert all(t.grad.shape == t.shape and (t.grad == 0).all() for t in (q, k, v))
    q, k, v = _inputs(2, 2, 9, 70, 6, dtype=torch.float64, seed=37)
    kl, ql = torch.tensor([70, 9]), torch.tensor([9, 4])
    out = ops.attention(q, k, v, key_lengths=kl, query_lengths=ql, causal=True, dropout_p=0.3, seed=8)
    ref = reference.attention(q, k, v, kl, ql, None, True, 0.3, 8)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)


def test_attention_cpu_fallback_composite_matches_reference():
    """TRANSFORMER_EXT_CPU_FALLBACK=1 (and CPUs without AVX2) run the composite for every dtype."""
    import os
    import subprocess
    import sys

    code = """
import torch
from transformer_ext import ops, reference
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, 2, n, 8, generator=g, dtype=torch.float64) for n in (9, 70, 70))
kl, ql = torch.tensor([70, 5]), torch.tensor([9, 7])
leaves = [t.float().requires_grad_() for t in (q, k, v)]
out = ops.attention(*leaves, key_lengths=kl, query_lengths=ql, causal=True, dropout_p=0.3, seed=4)
out.sum().backward()
refs = [t.clone().requires_grad_() for t in (q, k, v)]
ref = reference.attention(*refs, kl, ql, None, True, 0.3, 4)
ref.sum().backward()
assert (out.double() - ref).abs().max() < 2e-6
for a, r in zip(leaves, refs):
    assert (a.grad.double() - r.grad).abs().max() < 1e-5
from test_attention import _poisoned_backward_grads
for dtype in (torch.float32, torch.float64):
    clean, dirty = _poisoned_backward_grads("cpu", dtype)
    for c, d in zip(clean, dirty):
        assert torch.isfinite(d).all() and torch.equal(c, d), "composite backward read past the lengths"
print("ok")
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(
        os.environ,
        TRANSFORMER_EXT_CPU_FALLBACK="1",
        PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests")]),
    )
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=root, timeout=120
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_bench_attention_smoke():
    """The benchmark runs (and cross-checks ours, SDPA and the three-step path); speed is not asserted."""
    from benchmarks.ops import bench_attention

    rows = bench_attention.bench("cpu", [16], repeats=1, min_time=0.0)
    assert len(rows) == 8 and all(set(r["seconds"]) == set(bench_attention.ENGINES) for r in rows)


def test_bench_attention_memory_only_needs_an_existing_result(tmp_path, capsys):
    """--memory-only adds to a result file: a missing one is an argument error, not a traceback."""
    from benchmarks.ops import bench_attention

    with pytest.raises(SystemExit) as exc:
        bench_attention.main(["--memory-only", "--out", str(tmp_path / "missing.json")])
    assert exc.value.code == 2 and "run without it first" in capsys.readouterr().err
    assert not (tmp_path / "missing.json").exists()


# --------------------------------------------------------------------------- bfloat16 kernels
# bfloat16 runs one of two CPU kernels: brgemm products (AMX, where ATen's ukernel runs) or the
# float32-widening tile kernels (TRANSFORMER_EXT_CPU_AMX=0, and every CPU without AMX). Both are
# checked against a float64 oracle written here, dropout through the op's debug mask; the
# tolerance is the suite's rule (at most twice the error of the same computation in bfloat16).
BF16_KERNELS = ["brgemm", "widening"]
# (B, H, Q, K, D): several query blocks, key counts off the 32-key padding, odd head dims
BF16_SHAPES = [(3, 2, 70, 130, 24), (2, 3, 130, 65, 17), (1, 1, 5, 5, 3), (2, 1, 64, 64, 33)]


def _oracle_attention(q, k, v, kl, ql, causal, keep, p):
    """Softmax attention over the allowed keys, dropout by `keep` [B, H, Q, K] (or None), rows
    past the query lengths zero, in the dtype of q."""
    B, H, Q, D = q.shape
    K = k.shape[2]
    j = torch.arange(K).view(1, 1, 1, K)
    i = torch.arange(Q).view(1, 1, Q, 1)
    allowed = (j < kl.view(B, 1, 1, 1)) & (i < ql.view(B, 1, 1, 1))
    if causal:
        allowed = allowed & (j <= i + (K - Q))
    s = (q @ k.transpose(-2, -1)) / math.sqrt(D)
    probs = s.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
    if keep is not None:
        probs = probs * keep.to(probs.dtype) / (1 - p)
    return probs @ v


@pytest.mark.parametrize("kernel", BF16_KERNELS)
@pytest.mark.parametrize("shape", BF16_SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_attention_bfloat16_kernels_forward_and_backward_against_float64(
    monkeypatch, kernel, shape, causal, dropout_p
):
    monkeypatch.setenv("TRANSFORMER_EXT_CPU_AMX", "1" if kernel == "brgemm" else "0")
    B, H, Q, K, D = shape
    q, k, v = _inputs(B, H, Q, K, D, dtype=torch.float64, seed=21)
    g = _gen(22)
    grad = torch.randn(B, H, Q, D, generator=g, dtype=torch.float64)
    kl = torch.randint(1, K + 1, (B,), generator=g)
    ql = torch.randint(1, Q + 1, (B,), generator=g)
    kl[0], ql[0] = K, Q
    if B > 2:
        kl[-1] = 0  # a batch row with no key at all
    seed = 1234
    keep = ops.attention_dropout_mask(seed, B, H, Q, K, dropout_p) if dropout_p > 0 else None
    low = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    out = ops.attention(*low, key_lengths=kl, query_lengths=ql, causal=causal, dropout_p=dropout_p, seed=seed)
    out.backward(grad.bfloat16())
    assert out.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in low)
    # the oracle sees the same bfloat16 inputs, in float64
    want_leaves = [t.detach().double().requires_grad_() for t in low]
    want = _oracle_attention(*want_leaves, kl, ql, causal, keep, dropout_p)
    want.backward(grad.bfloat16().double())
    plain_leaves = [t.detach().clone().requires_grad_() for t in low]
    plain = _oracle_attention(*plain_leaves, kl, ql, causal, keep, dropout_p)
    plain.backward(grad.bfloat16())

    def err(a, b):
        return (a.double() - b).abs().max().item()

    assert err(out, want.detach()) <= 2 * err(plain, want.detach()) + 1e-3
    for name, a, w, p in zip("qkv", low, want_leaves, plain_leaves):
        # the backward takes the bfloat16-rounded output (rowsum(dO * O)): a few bfloat16 steps of
        # the gradient's size on top of the rule (the 5 x 5 x 3 case: 0.010 where plain has 0.004)
        e, pe, size = err(a.grad, w.grad), err(p.grad, w.grad), w.grad.abs().max().item()
        assert e <= 2 * pe + 1e-2 * max(1.0, size), f"d{name}: error {e:.3g}, plain bfloat16 {pe:.3g}"
    rows = torch.arange(Q).view(1, Q) >= ql.view(B, 1)
    assert (out.detach().transpose(1, 2)[rows] == 0).all(), "rows past query_lengths must be zeros"
    assert (low[0].grad.transpose(1, 2)[rows] == 0).all()
    past = torch.arange(K).view(1, K) >= kl.view(B, 1)
    assert (low[1].grad.transpose(1, 2)[past] == 0).all() and (low[2].grad.transpose(1, 2)[past] == 0).all()


@pytest.mark.parametrize("kernel", BF16_KERNELS)
def test_attention_bfloat16_kernels_never_read_past_lengths(monkeypatch, kernel):
    monkeypatch.setenv("TRANSFORMER_EXT_CPU_AMX", "1" if kernel == "brgemm" else "0")
    clean, dirty = _poisoned_backward_grads("cpu", torch.bfloat16)
    for c, d in zip(clean, dirty):
        assert torch.isfinite(d).all()
        assert torch.equal(c, d)
