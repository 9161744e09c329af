"""The model against an independent float64 implementation, padding invariance, decode_step,
weight tying, and input validation."""

from __future__ import annotations

import pytest
import torch
from helpers import make_batch, make_model
from reference_model import ReferenceTransformer, sinusoid_table

from transformer_ext import ops
from transformer_ext.config import TransformerConfig

NORM_FIRST = [False, True]
VARIANTS = {
    "tied": dict(),
    "untied": dict(tie_target_embeddings=False),
    "shared_vocab": dict(shared_vocab=True, src_vocab_size=40),
    "no_bias": dict(bias=False),
}
ATOL = 1e-5


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("norm_first", NORM_FIRST)
def test_forward_matches_independent_reference(norm_first, variant):
    model = make_model(norm_first, **VARIANTS[variant])
    ref = ReferenceTransformer(model.config, model.state_dict())
    src, lengths, tgt = make_batch(model.config)
    with torch.no_grad():
        got = model(src, lengths, tgt)
    want = ref(src, lengths, tgt)
    assert got.dtype == torch.float32 and got.shape == (3, 6, model.config.tgt_vocab_size)
    torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=0)


def test_reference_is_sensitive():
    """The oracle can fail: a perturbed weight changes its logits by far more than ATOL."""
    model = make_model(False)
    src, lengths, tgt = make_batch(model.config)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["decoder.layers.1.src_attn.W_V.bias"] += 0.01
    with torch.no_grad():
        got = model(src, lengths, tgt).double()
    assert (got - ReferenceTransformer(model.config, sd)(src, lengths, tgt)).abs().max() > 10 * ATOL


def test_positional_encoding_table():
    model = make_model(False)
    c = model.config
    torch.testing.assert_close(
        model.tgt_pe.pe.double(), sinusoid_table(c.max_len, c.d_model), atol=2e-5, rtol=0
    )
    assert torch.equal(model.src_pe.pe, model.tgt_pe.pe)
    assert not any("pe" == k.split(".")[-1] for k in model.state_dict())  # non-persistent


@pytest.mark.parametrize("norm_first", NORM_FIRST)
def test_source_padding_never_changes_outputs(norm_first):
    model = make_model(norm_first)
    src, lengths, tgt = make_batch(model.config)
    garbage = torch.randint(
        0, model.config.src_vocab_size, (src.shape[0], 5), generator=torch.Generator().manual_seed(9)
    )
    src_long = torch.cat([src, garbage], dim=1)
    src_long[1, lengths[1] :] = torch.randint(3, 40, (src_long.shape[1] - lengths[1],))  # garbage inside too
    with torch.no_grad():
        a = model(src, lengths, tgt)
        b = model(src_long, lengths, tgt)
        enc_a, ka, va = model.encode(src, lengths)
        enc_b, kb, vb = model.encode(src_long, lengths)
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    for i in range(src.shape[0]):
        n = int(lengths[i])
        torch.testing.assert_close(enc_a[i, :n], enc_b[i, :n], atol=ATOL, rtol=0)
        torch.testing.assert_close(ka[0][i, :, :n], kb[0][i, :, :n], atol=ATOL, rtol=0)


@pytest.mark.parametrize("norm_first", NORM_FIRST)
def test_target_padding_never_changes_real_positions(norm_first):
    model = make_model(norm_first)
    src, lengths, tgt = make_batch(model.config)
    tgt_long = torch.cat([tgt, torch.randint(0, model.config.tgt_vocab_size, (tgt.shape[0], 4))], dim=1)
    with torch.no_grad():
        a = model(src, lengths, tgt)
        b = model(src_ids=src, src_lengths=lengths, tgt_in=tgt_long)[:, : tgt.shape[1]]
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("norm_first", NORM_FIRST)
def test_encode_returns_cross_kv_once_per_layer(norm_first):
    model = make_model(norm_first)
    c = model.config
    src, lengths, _ = make_batch(model.config)
    with torch.no_grad():
        enc, keys, values = model.encode(src, lengths)
    assert enc.shape == (3, 7, c.d_model)
    assert len(keys) == len(values) == c.n_decoder_layers
    for i, (k, v) in enumerate(zip(keys, values)):
        assert k.shape == v.shape == (3, c.n_heads, 7, c.d_k)
        assert k.is_contiguous() and v.is_contiguous()
        layer = model.decoder.layers[i].src_attn
        want = layer.W_K(enc).view(3, 7, c.n_heads, c.d_k).transpose(1, 2)
        torch.testing.assert_close(k, want)


def _fill_cache(model, tgt, src, lengths, L, fused_qkv=None):
    """Teacher-force decode_step over tgt, appending K/V, returning the logits of every step."""
    c = model.config
    B, T = tgt.shape
    _, ck, cv = model.encode(src, lengths)
    sk = [torch.zeros(B, c.n_heads, L, c.d_k) for _ in range(c.n_decoder_layers)]
    sv = [torch.zeros(B, c.n_heads, L, c.d_k) for _ in range(c.n_decoder_layers)]
    out = []
    for t in range(T):
        pos = torch.full((B,), t, dtype=torch.int64)
        logits, nk, nv = model.decode_step(tgt[:, t : t + 1], pos, lengths, sk, sv, ck, cv, fused_qkv)
        for i in range(c.n_decoder_layers):
            ops.kv_cache_append_(sk[i], nk[i], pos)
            ops.kv_cache_append_(sv[i], nv[i], pos)
        out.append(logits)
    return torch.stack(out, dim=1), sk, sv, ck, cv


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("norm_first", NORM_FIRST)
def test_decode_step_matches_teacher_forcing(norm_first, variant):
    """The functional decode step (fused Q/K/V under no_grad; separate projections with autograd
    on) against the module-based teacher-forcing forward."""
    model = make_model(norm_first, **VARIANTS[variant])
    src, lengths, tgt = make_batch(model.config)
    with torch.no_grad():
        want = model(src, lengths, tgt)
        got, *_ = _fill_cache(model, tgt, src, lengths, L=9)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    with torch.no_grad():
        fused, *_ = _fill_cache(model, tgt, src, lengths, L=9, fused_qkv=model.fused_qkv())
    torch.testing.assert_close(fused, want, atol=ATOL, rtol=0)
    with torch.enable_grad():  # F.linear and the separate projections
        unfused, *_ = _fill_cache(model, tgt, src, lengths, L=9)
    torch.testing.assert_close(unfused.detach(), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("norm_first", NORM_FIRST)
def test_decode_step_ragged_positions_ignore_cache_past_position(norm_first):
    """Rows at different positions; cache entries at/after positions[b] hold finite garbage."""
    model = make_model(norm_first)
    src, lengths, tgt = make_batch(model.config)
    with torch.no_grad():
        want = model(src, lengths, tgt)
        _, sk, sv, ck, cv = _fill_cache(model, tgt, src, lengths, L=9)
        positions = torch.tensor([5, 2, 0])
        g = torch.Generator().manual_seed(3)
        for cache in sk + sv:
            for b, p in enumerate(positions.tolist()):
                cache[b, :, p:] = 100 * torch.randn(cache[b, :, p:].shape, generator=g)
        ids = tgt[torch.arange(3), positions].view(3, 1)
        snapshot = [t.clone() for t in sk + sv + ck + cv]
        logits, nk, nv = model.decode_step(ids, positions, lengths, sk, sv, ck, cv)
    for b, p in enumerate(positions.tolist()):
        torch.testing.assert_close(logits[b], want[b, p], atol=ATOL, rtol=0)
    # pure: nothing written
    for before, after in zip(snapshot, sk + sv + ck + cv):
        assert torch.equal(before, after)
    assert all(k.shape == (3, model.config.n_heads, 1, model.config.d_k) for k in nk + nv)


@pytest.mark.parametrize("norm_first", NORM_FIRST)
def test_decode_step_with_cross_kv_once_per_source(norm_first):
    """cross_per_source: 3 sources' K/V serve 2 rows each (each row its own target prefix);
    every step's logits against the teacher-forcing forward of the repeated sources, and the
    attention probabilities against those of the per-row step."""
    model = make_model(norm_first)
    c = model.config
    src, lengths, _ = make_batch(c)
    K, T, L = 2, 6, 9
    rows_src, rows_len = src.repeat_interleave(K, 0), lengths.repeat_interleave(K)
    _, _, tgt = make_batch(c, seed=4, B=3 * K, T=T)
    with torch.no_grad():
        want = model(rows_src, rows_len, tgt)
        _, ck, cv = model.encode(src, lengths)
        sk = [torch.zeros(3 * K, c.n_heads, L, c.d_k) for _ in range(c.n_decoder_layers)]
        sv = [torch.zeros(3 * K, c.n_heads, L, c.d_k) for _ in range(c.n_decoder_layers)]
        for t in range(T):
            pos = torch.full((3 * K,), t, dtype=torch.int64)
            ids = tgt[:, t : t + 1]
            logits, nk, nv, probs = model.decode_step(
                ids, pos, rows_len, sk, sv, ck, cv, return_attention=True, cross_per_source=True
            )
            per_row = model.decode_step(
                ids,
                pos,
                rows_len,
                sk,
                sv,
                [k.repeat_interleave(K, 0) for k in ck],
                [v.repeat_interleave(K, 0) for v in cv],
                return_attention=True,
            )
            torch.testing.assert_close(logits, want[:, t], atol=ATOL, rtol=0)
            torch.testing.assert_close(probs, per_row[3], atol=1e-6, rtol=0)
            assert probs.shape == (3 * K, src.shape[1]) and not probs[rows_len.argmin(), 1:].any()
            for i in range(c.n_decoder_layers):
                ops.kv_cache_append_(sk[i], nk[i], pos)
                ops.kv_cache_append_(sv[i], nv[i], pos)


def test_fused_qkv_is_a_snapshot_ignored_where_gradients_must_flow():
    model = make_model(False, dropout=0.0)  # training mode below must not add randomness
    src, lengths, tgt = make_batch(model.config)
    c = model.config
    fused = model.fused_qkv()
    assert len(fused) == c.n_decoder_layers
    assert fused[0][0].shape == (3 * c.d_model, c.d_model) and fused[0][1].shape == (3 * c.d_model,)
    assert not fused[0][0].requires_grad
    # With autograd on (or in training mode) decode_step ignores the copy and runs the separate
    # projections: a wrong copy changes nothing there, and everything in inference.
    wrong = [(torch.zeros_like(w), None if b is None else torch.zeros_like(b)) for w, b in fused]
    with torch.no_grad():
        want, *_ = _fill_cache(model, tgt, src, lengths, L=9)
        used, *_ = _fill_cache(model, tgt, src, lengths, L=9, fused_qkv=wrong)
        model.train()
        ignored_in_training, *_ = _fill_cache(model, tgt, src, lengths, L=9, fused_qkv=wrong)
        model.eval()
    ignored_with_grad, *_ = _fill_cache(model, tgt, src, lengths, L=9, fused_qkv=wrong)
    assert not torch.allclose(used, want, atol=1e-3)
    torch.testing.assert_close(ignored_with_grad.detach(), want, atol=ATOL, rtol=0)
    torch.testing.assert_close(ignored_in_training, want, atol=ATOL, rtol=0)
    # The copy does not follow later updates: a stale copy gives other logits.
    with torch.no_grad():
        for layer in model.decoder.layers:
            layer.self_attn.W_K.weight.mul_(1.5)
        want, *_ = _fill_cache(model, tgt, src, lengths, L=9)
        stale, *_ = _fill_cache(model, tgt, src, lengths, L=9, fused_qkv=fused)
        fresh, *_ = _fill_cache(model, tgt, src, lengths, L=9, fused_qkv=model.fused_qkv())
    assert not torch.allclose(stale, want, atol=1e-3)
    torch.testing.assert_close(fresh, want, atol=ATOL, rtol=0)


def test_weight_tying():
    tied = make_model(False)
    assert tied.generator.proj.weight is tied.tgt_embed.lut.weight
    assert tied.generator.proj.bias is None
    assert tied.src_embed.lut.weight is not tied.tgt_embed.lut.weight
    shared = make_model(False, shared_vocab=True, src_vocab_size=40)
    assert shared.src_embed.lut.weight is shared.tgt_embed.lut.weight is shared.generator.proj.weight
    untied = make_model(False, tie_target_embeddings=False)
    assert untied.generator.proj.weight is not untied.tgt_embed.lut.weight
    assert untied.generator.proj.bias is not None
    n_tied = sum(p.numel() for p in tied.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == 40 * 32 + 40


def test_dropout_only_in_training():
    model = make_model(False)
    src, lengths, tgt = make_batch(model.config)
    model.train()
    torch.manual_seed(0)
    a = model(src, lengths, tgt)
    b = model(src, lengths, tgt)
    assert not torch.allclose(a, b)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(src, lengths, tgt), model(src, lengths, tgt))


@pytest.mark.parametrize("norm_first", NORM_FIRST)
def test_gradients_reach_every_parameter(norm_first):
    model = make_model(norm_first).train()
    src, lengths, tgt = make_batch(model.config)
    model(src, lengths, tgt).logsumexp(-1).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def _bad(kind):
    """(src, lengths, tgt) with one defect, plus the argument name the error must mention."""
    src, lengths, tgt = make_batch(TransformerConfig.preset("tiny"))
    if kind == "src_oov":
        src[0, 0] = 48
        return (src, lengths, tgt), ValueError, "src_ids contains token id 48"
    if kind == "src_negative":
        src[1, 0] = -1
        return (src, lengths, tgt), ValueError, "src_ids contains token id -1"
    if kind == "tgt_oov":
        tgt[2, 3] = 40
        return (src, lengths, tgt), ValueError, "tgt_in contains token id 40"
    if kind == "src_too_long":
        src = torch.full((1, 65), 5)
        return (src, torch.tensor([65]), tgt[:1]), ValueError, "src_ids has length 65 > max_len = 64"
    if kind == "tgt_too_long":
        return (src, lengths, torch.full((3, 65), 5)), ValueError, "tgt_in has length 65 > max_len"
    if kind == "empty_source":
        return (src, torch.tensor([7, 0, 1]), tgt), ValueError, "src_lengths must be >= 1"
    if kind == "length_past_src":
        return (src, torch.tensor([8, 4, 1]), tgt), ValueError, "src_lengths contains 8 > src_ids length 7"
    if kind == "lengths_shape":
        return (src, torch.tensor([7, 4]), tgt), ValueError, "src_lengths must have shape [3]"
    if kind == "lengths_dtype":
        return (src, lengths.int(), tgt), TypeError, "src_lengths must be int64"
    if kind == "src_dtype":
        return (src.float(), lengths, tgt), TypeError, "src_ids must be int64"
    if kind == "src_1d":
        return (src[0], lengths, tgt), ValueError, "src_ids must have shape [batch, length]"
    if kind == "batch_mismatch":
        return (src, lengths, tgt[:2]), ValueError, "tgt_in has batch size 2"
    if kind == "zero_width":
        return (src[:, :0], lengths, tgt), ValueError, "src_ids must not be empty"
    raise AssertionError(kind)


BAD_INPUTS = [
    "src_oov",
    "src_negative",
    "tgt_oov",
    "src_too_long",
    "tgt_too_long",
    "empty_source",
    "length_past_src",
    "lengths_shape",
    "lengths_dtype",
    "src_dtype",
    "src_1d",
    "batch_mismatch",
    "zero_width",
]


@pytest.mark.parametrize("kind", BAD_INPUTS)
def test_bad_inputs_raise_naming_the_argument(kind):
    model = make_model(False)
    (src, lengths, tgt), exc, fragment = _bad(kind)
    with pytest.raises(exc) as info:
        model(src, lengths, tgt)
    assert fragment in str(info.value)
    if not kind.startswith("tgt") and kind != "batch_mismatch":
        with pytest.raises(exc):
            model.encode(src, lengths)
