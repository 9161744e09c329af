"""Pure-PyTorch twins of the compiled ops, with exactly the semantics of docs/DESIGN.md section 2.

These are the oracles the tests compare the kernels against, and they are written to be
obviously right rather than fast: every computation is spelled out with standard tensor
operations and float32 (or wider) arithmetic. Functions ending in ``_`` write in place.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = [
    "causal_mask",
    "masked_softmax",
    "masked_softmax_backward",
    "decode_attention",
    "kv_cache_append_",
    "kv_cache_reorder_",
    "attention",
    "attention_dropout_keep",
    "dropout_threshold",
]


def causal_mask(q_len: int, k_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Bool ``[q_len, k_len]``: query ``i`` may see key ``j`` iff ``j <= i + (k_len - q_len)``.

    The diagonal is aligned bottom-right, so the last query sees every key.
    """
    i = torch.arange(q_len, device=device).unsqueeze(1)
    j = torch.arange(k_len, device=device).unsqueeze(0)
    return j <= i + (k_len - q_len)


def masked_softmax(
    scores: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    scale: float = 1.0,
    causal: bool = False,
) -> torch.Tensor:
    """Softmax of ``scale * scores`` over allowed keys; rows without an allowed key are zeros.

    ``scores`` is ``[B, H, Q, K]``; ``mask`` is bool and broadcastable to it (True = attend).
    The math runs in float32 (float64 stays float64) and the result has the input dtype.
    NaN rule: a NaN (or +inf) score in an allowed position makes the whole row NaN, as in
    ``torch.softmax``; scores in masked positions are replaced before any arithmetic, so they
    never matter.
    """
    compute = torch.float64 if scores.dtype == torch.float64 else torch.float32
    x = scores.to(compute) * scale
    allowed = torch.ones_like(x, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & mask
    if causal:
        allowed = allowed & causal_mask(x.shape[-2], x.shape[-1], device=x.device)
    x = x.masked_fill(~allowed, float("-inf"))
    row_max = x.amax(dim=-1, keepdim=True)  # NaN if an allowed score is NaN
    # A fully masked row has max -inf; shift by 0 there so exp gives exact zeros, not NaN.
    # A NaN or +inf max is kept: every exp, the sum and so the whole row become NaN.
    row_max = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)
    e = torch.exp(x - row_max)
    denom = e.sum(dim=-1, keepdim=True)
    probs = torch.where(denom == 0, 0.0, e / denom.clamp_min(torch.finfo(compute).tiny))
    return probs.to(scores.dtype)


def masked_softmax_backward(grad_probs: torch.Tensor, probs: torch.Tensor, scale: float) -> torch.Tensor:
    """``d scores = scale * p * (g - sum(g * p))``; masked keys have ``p = 0`` and get no gradient."""
    compute = torch.float64 if probs.dtype == torch.float64 else torch.float32
    g = grad_probs.to(compute)
    p = probs.to(compute)
    dot = (g * p).sum(dim=-1, keepdim=True)
    return (scale * p * (g - dot)).to(probs.dtype)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    k_new: Optional[torch.Tensor] = None,
    v_new: Optional[torch.Tensor] = None,
    position_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One query per row attends to ``cache[b, :, :lengths[b]]`` and, if given, ``k_new``/``v_new``.

    ``position_bias`` (optional, broadcastable to ``[B, H, 1, L]``, or ``[B, H, 1, L + 1]`` with
    ``k_new``, whose score takes the last entry) is added to the scaled scores before the softmax.

    ``q``, ``k_new``, ``v_new`` are ``[B, H, 1, D]``, caches ``[B, H, L, D]``, ``lengths`` int64
    ``[B]``. Cache entries at or beyond ``lengths[b]`` get exactly zero weight and never matter,
    even when they are NaN. A row with no key at all is zeros; a NaN in ``q``, in an attended key
    or in ``k_new`` makes the row NaN (the NaN rule of :func:`masked_softmax`). Returns
    ``[B, H, 1, D]`` in the dtype of ``q``.
    """
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together")
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = q.to(compute), k_cache.to(compute), v_cache.to(compute)
    L = k_cache.shape[2]
    scores = torch.matmul(qf, kf.transpose(-2, -1))  # [B, H, 1, L]
    allowed = torch.arange(L, device=q.device).view(1, 1, 1, L) < lengths.view(-1, 1, 1, 1)
    allowed = allowed.expand_as(scores)
    if k_new is not None:
        scores = torch.cat([scores, torch.matmul(qf, k_new.to(compute).transpose(-2, -1))], dim=-1)
        B, H = q.shape[0], q.shape[1]
        allowed = torch.cat([allowed, torch.ones(B, H, 1, 1, dtype=torch.bool, device=q.device)], dim=-1)
        vf = torch.cat([vf, v_new.to(compute)], dim=2)
    if scores.shape[-1] == 0:  # no cache and no new key: every row is empty
        return torch.zeros_like(qf).to(q.dtype)
    if position_bias is not None:
        scores = scores * scale + position_bias.to(compute)
        scale = 1.0
    probs = masked_softmax(scores, allowed, scale, False)
    # Zero the values that get no weight so that a non-finite entry past the prefix cannot leak.
    vf = vf.masked_fill(~allowed.transpose(-2, -1), 0.0)
    return torch.matmul(probs, vf).to(q.dtype)


def kv_cache_append_(cache: torch.Tensor, update: torch.Tensor, positions: torch.Tensor) -> None:
    """``cache[b, :, p:p+T] = update[b]`` for every row with ``p = positions[b] >= 0``.

    Raises ``IndexError`` before writing anything when a row would run past the capacity.
    """
    L, T = cache.shape[2], update.shape[2]
    pos = positions.tolist()
    for b, p in enumerate(pos):
        if p >= 0 and p + T > L:
            raise IndexError(f"positions[{b}] = {p} + T = {T} exceeds the cache capacity L = {L}")
    for b, p in enumerate(pos):
        if p >= 0:
            cache[b, :, p : p + T] = update[b]


def kv_cache_reorder_(cache: torch.Tensor, index: torch.Tensor, length: int) -> None:
    """``cache[b, :, :length] = old_cache[index[b], :, :length]``; entries past ``length`` stay."""
    B = cache.shape[0]
    idx = index.tolist()
    if any(i < 0 or i >= B for i in idx):
        raise IndexError(f"index values must be in [0, {B}), got {idx}")
    cache[:, :, :length] = cache[index, :, :length].clone()


# ------------------------------------------------------------------------------------------
# Fused attention (ops.attention) and its dropout generator
# ------------------------------------------------------------------------------------------

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for int64 tensors holding uint32 values, without int64 overflow:
    the product is split at 16 bits of ``c``."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The generator's 32-bit finalizer (xor-shift, multiply; a bijection on uint32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    return int(_mix32(torch.tensor([x & _MASK32], dtype=torch.int64))[0])


def dropout_threshold(p: float) -> int:
    """Keys whose 32-bit draw is ``>= floor(p * 2**32)`` are kept (probability ``1 - p``)."""
    if not p > 0.0:
        return 0
    return int(min(math.floor(p * 4294967296.0), 4294967295))


def attention_dropout_keep(seed: int, B: int, H: int, Q: int, K: int, p: float) -> torch.Tensor:
    """Bool ``[B, H, Q, K]``: True where ``ops.attention``'s dropout keeps key ``j`` of query
    ``i`` in head ``(b, h)`` for ``seed``. The counter-based generator, in int64 tensor ops:

    * per ``(b, h)``: two chains ``s = mix(s + x)`` over ``(seed mod 2**32, seed >> 32 mod 2**32,
      b, h)`` starting from ``0x243F6A88`` and ``0x85A308D3``;
    * per row ``i``: ``r1 = mix(s1 + i)``, ``r2 = mix(s2 + i)``;
    * per key ``j``: ``u = mix(mix(j + r1) ^ r2)``, kept iff ``u >= floor(p * 2**32)``;

    all arithmetic modulo ``2**32``.
    """
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    words = [s & _MASK32, s >> 32]
    b = torch.arange(B, dtype=torch.int64).view(B, 1)
    h = torch.arange(H, dtype=torch.int64).view(1, H)
    chains = []
    for start in (0x243F6A88, 0x85A308D3):
        st = start
        for w in words:
            st = _mix32_int(st + w)
        x = _mix32((st + b) & _MASK32)  # [B, 1]
        x = _mix32((x + h) & _MASK32)  # [B, H]
        chains.append(x)
    i = torch.arange(Q, dtype=torch.int64).view(1, 1, Q)
    r1 = _mix32((chains[0].unsqueeze(-1) + i) & _MASK32).unsqueeze(-1)  # [B, H, Q, 1]
    r2 = _mix32((chains[1].unsqueeze(-1) + i) & _MASK32).unsqueeze(-1)
    j = torch.arange(K, dtype=torch.int64).view(1, 1, 1, K)
    u = _mix32(_mix32((j + r1) & _MASK32) ^ r2)
    return u >= dropout_threshold(p)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_lengths: Optional[torch.Tensor] = None,
    query_lengths: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    causal: bool = False,
    dropout_p: float = 0.0,
    seed: Optional[int] = None,
    position_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``ops.attention`` spelled out: ``q [B,H,Q,D]``, ``k, v [B,H,K,D]``; ``position_bias``
    (optional, broadcastable to ``[B, H, Q, K]``) is added to the scaled scores.

    Query ``i`` of row ``b`` may attend key ``j`` iff ``j < key_lengths[b]``, ``i <
    query_lengths[b]`` and (causal) ``j <= i + (K - Q)``. Softmax of ``scale * q.k`` over the
    allowed keys (``scale`` defaults to ``1/sqrt(D)``), then dropout (kept entries divided by
    ``1 - p``, the mask of :func:`attention_dropout_keep`), then the weighted sum of the values.
    A row with no allowed key is zeros; values of keys that are not allowed never enter the sum.
    Math in float32 (float64 stays float64); the result has the dtype of ``q``.
    """
    B, H, Q, D = q.shape
    K = k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = q.to(compute), k.to(compute), v.to(compute)
    dev = q.device
    kl = torch.full((B,), K, device=dev) if key_lengths is None else key_lengths.to(dev)
    ql = torch.full((B,), Q, device=dev) if query_lengths is None else query_lengths.to(dev)
    j = torch.arange(K, device=dev).view(1, 1, 1, K)
    i = torch.arange(Q, device=dev).view(1, 1, Q, 1)
    allowed = (j < kl.view(B, 1, 1, 1)) & (i < ql.view(B, 1, 1, 1))
    if causal:
        allowed = allowed & causal_mask(Q, K, device=dev)
    allowed = allowed.expand(B, H, Q, K)
    if K == 0:  # no key at all: every row is empty
        return torch.where(torch.zeros_like(qf, dtype=torch.bool), qf, 0.0).to(q.dtype)
    scores = torch.matmul(qf, kf.transpose(-2, -1)) * scale
    if position_bias is not None:
        scores = scores + position_bias.to(compute)
    probs = masked_softmax(scores, allowed, 1.0, False)  # zeros for empty rows
    if dropout_p > 0.0:
        if seed is None:
            raise ValueError("the reference needs the seed when dropout_p > 0")
        keep = attention_dropout_keep(seed, B, H, Q, K, dropout_p).to(dev)
        probs = torch.where(keep, probs / (1.0 - dropout_p), 0.0)
    # Zero-weight keys contribute exactly nothing, even where a value is not finite.
    terms = torch.where(allowed.unsqueeze(-1), probs.unsqueeze(-1) * vf.unsqueeze(2), 0.0)
    return terms.sum(dim=3).to(q.dtype)  # [B, H, Q, D]
