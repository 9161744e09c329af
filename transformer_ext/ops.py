"""Typed Python wrappers of the compiled ``transformer_ext`` ops.

This is the only module that touches ``torch.ops.transformer_ext``. Each op has a fake
(meta) kernel so that ``torch.library.opcheck``, ``torch.compile(fullgraph=True)`` and the
ONNX exporter can trace it, and ``masked_softmax`` has an autograd formula backed by its
own backward kernel. The semantics are those of :mod:`transformer_ext.reference`.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import torch

logger = logging.getLogger(__name__)

try:
    from . import _C  # noqa: F401  (loading the library registers the ops)
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "transformer_ext._C, the compiled op library, could not be loaded "
        f"({exc}). Build it first: `pip install --no-build-isolation -e .` or "
        "`python setup.py build_ext --inplace` from the repository root (see README.md)."
    ) from exc

_ops = torch.ops.transformer_ext

__all__ = [
    "masked_softmax",
    "decode_attention",
    "kv_cache_append_",
    "kv_cache_reorder_",
    "linear",
    "cuda_kernels_built",
]


def cuda_kernels_built() -> bool:
    """True when the library was compiled with its CUDA kernels."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("transformer_ext::masked_softmax", "CUDA")


def masked_softmax(
    scores: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    scale: float = 1.0,
    causal: bool = False,
) -> torch.Tensor:
    """Softmax of ``scale * scores`` over the keys each query may attend to.

    Args:
        scores: ``[B, H, Q, K]`` float32, float16 or bfloat16.
        mask: optional bool tensor broadcastable to ``scores``; True = may attend
            (e.g. a padding mask ``[B, 1, 1, K]``).
        scale: multiplier applied to the scores before the softmax (``1/sqrt(d_k)``).
        causal: query ``i`` sees key ``j`` iff ``j <= i + (K - Q)`` (bottom-right aligned).

    Returns:
        Probabilities of the shape and dtype of ``scores``, computed in float32. A row with
        no allowed key is all zeros, never NaN. A NaN (or +inf) score in an allowed position
        makes its whole row NaN, as in ``torch.softmax``; scores in masked positions are never
        used, so a NaN there changes nothing. Differentiable with respect to ``scores``.
    """
    return _ops.masked_softmax(scores, mask, float(scale), bool(causal))


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
    """Fused single-query attention over a cache prefix.

    Row ``b`` attends to keys ``0 .. lengths[b]-1`` of ``k_cache``/``v_cache`` and, when given,
    to the one extra key/value ``k_new``/``v_new`` (the new token itself).

    Args:
        q: ``[B, H, 1, D]``.
        k_cache, v_cache: ``[B, H, L, D]``, the dtype and device of ``q``.
        lengths: int64 ``[B]``, ``0 <= lengths[b] <= L``. On CUDA, values outside that range
            are clamped on the device (checking them would force a host sync).
        scale: score multiplier (``1/sqrt(D)``).
        k_new, v_new: optional ``[B, H, 1, D]``, given together.
        position_bias: optional additive bias of the scaled scores, ``[B or 1, H or 1, 1, L]``,
            or ``[B or 1, H or 1, 1, L + 1]`` with ``k_new`` (the last entry is the new key's):
            T5's relative position bias, any floating dtype (added in float32). It runs the
            compiled kernel (``decode_attention_with_bias``); while a graph is traced for export
            it runs :func:`_decode_attention_with_bias`, the same semantics in standard PyTorch
            ops, which every exporter knows.

    Returns:
        ``[B, H, 1, D]`` in the dtype of ``q``; zeros for a row with no key. A NaN in ``q``, in
        an attended key or in ``k_new`` makes the row NaN (as ``torch.softmax`` would); cache
        entries at or past ``lengths[b]`` are never read. Not differentiable (decoding only):
        with an input that requires grad, the backward pass raises.
    """
    if position_bias is not None:
        _check_decode_bias(q, k_cache, k_new, v_new, position_bias)
        if _is_tracing_for_export():
            return _decode_attention_with_bias(
                q, k_cache, v_cache, lengths, float(scale), k_new, v_new, position_bias
            )
        return _ops.decode_attention_with_bias(
            q, k_cache, v_cache, lengths, float(scale), position_bias, k_new, v_new
        )
    return _ops.decode_attention(q, k_cache, v_cache, lengths, float(scale), k_new, v_new)


def _is_tracing_for_export() -> bool:
    """True while a graph is traced for export (torch.jit / torch.onnx / torch.export)."""
    if torch.jit.is_tracing() or torch.onnx.is_in_onnx_export():
        return True
    compiler = getattr(torch, "compiler", None)
    return compiler is not None and getattr(compiler, "is_exporting", lambda: False)()


def _check_decode_bias(q, k_cache, k_new, v_new, position_bias) -> None:
    """The shape rule of decode_attention's position bias, as a ValueError naming it."""
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together")
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"q must be [B, H, 1, D], got {tuple(q.shape)}")
    B, H = q.shape[0], q.shape[1]
    n_keys = k_cache.shape[2] + (0 if k_new is None else 1)
    shape = tuple(position_bias.shape)
    if (
        position_bias.dim() != 4
        or shape[0] not in (1, B)
        or shape[1] not in (1, H)
        or shape[2] != 1
        or shape[3] != n_keys
    ):
        raise ValueError(
            f"position_bias must be broadcastable to [{B}, {H}, 1, {n_keys}] (the cache length"
            f"{' + 1 for k_new' if k_new is not None else ''}), got {shape}"
        )


def _decode_attention_with_bias(q, k_cache, v_cache, lengths, scale, k_new, v_new, position_bias):
    """:func:`decode_attention` with an additive position bias, in standard PyTorch ops (the form
    export traces)."""
    B = q.shape[0]
    L = k_cache.shape[2]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    keep = torch.arange(L, device=q.device).view(1, 1, 1, L) < lengths.clamp(0, L).view(-1, 1, 1, 1)
    keys, values = k_cache, v_cache
    if k_new is not None:
        keys, values = torch.cat([k_cache, k_new], 2), torch.cat([v_cache, v_new], 2)
        keep = torch.cat([keep, keep.new_ones(B, 1, 1, 1)], -1)
    scores = torch.matmul(q.to(compute), keys.to(compute).transpose(-2, -1)) * scale + position_bias.to(
        compute
    )
    scores = scores.masked_fill(~keep, float("-inf"))
    empty = ~keep.any(-1, keepdim=True)  # no key at all: zeros, not NaN
    probs = torch.softmax(torch.where(empty, 0.0, scores), -1).masked_fill(empty, 0.0)
    values = values.to(compute).masked_fill(~keep.transpose(-2, -1), 0.0)
    return torch.matmul(probs, values).to(q.dtype)


def kv_cache_append_(
    cache: torch.Tensor,
    update: torch.Tensor,
    positions: torch.Tensor,
    error_flag: Optional[torch.Tensor] = None,
) -> None:
    """Write ``update[b]`` into ``cache[b, :, positions[b] : positions[b] + T]`` in place.

    Args:
        cache: ``[B, H, L, D]``, written in place.
        update: ``[B, H, T, D]``, same dtype and device.
        positions: int64 ``[B]``; a negative position skips the row (finished or padding).
        error_flag: optional int32 tensor with one element on the cache's device.

    A row with ``positions[b] + T > L`` is never written. Without ``error_flag`` the op raises
    before writing anything (on CUDA this reads ``positions`` on the host: one sync). With
    ``error_flag`` on CUDA, such rows are skipped on the device and ``error_flag`` is set to 1,
    with no sync; the caller checks the flag when it synchronises anyway (e.g. at the end of a
    decode). On CPU the op always raises.

    Like ATen's in-place ops, it bumps the version counter of ``cache`` (and ``error_flag``), so
    a backward pass that saved the old values raises; it refuses, before writing, a ``cache``
    that requires grad while grad mode is on (the op has no derivative), an inference tensor
    outside ``torch.inference_mode()``, and an ``update`` (or ``positions``) that shares memory
    with ``cache``. Every argument must be on the cache's device.
    """
    _ops.kv_cache_append_(cache, update, positions, error_flag)


def kv_cache_reorder_(cache: torch.Tensor, index: torch.Tensor, length: int) -> None:
    """In place ``cache[b, :, :length] = old_cache[index[b], :, :length]`` (beam search).

    Args:
        cache: ``[B, H, L, D]``, written in place; entries at or past ``length`` are untouched.
        index: int64 ``[B]`` with values in ``[0, B)``; repeats are allowed.
        length: number of valid positions to move, ``0 <= length <= L``.

    Bumps the version counter of ``cache`` and refuses what :func:`kv_cache_append_` refuses
    (a cache that requires grad in grad mode, an inference tensor outside inference mode).
    """
    _ops.kv_cache_reorder_(cache, index, int(length))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T + bias``, the semantics of ``torch.nn.functional.linear``, for inference.

    On the CPU, float32 inputs with at most 4 rows (``x.numel() // in_features``) run a
    matrix-vector kernel (AVX-512F or AVX2+FMA) that avoids a BLAS call's fixed cost, which
    dominates the one-row projections of a batch-1 decoder step; everything else is
    ``at::linear``. Not differentiable: the model uses it only where autograd is off; with an
    input that requires grad, the backward pass raises (no gradient is silently dropped).

    Args:
        x: ``[..., in_features]``.
        weight: ``[out_features, in_features]``, the dtype and device of ``x``.
        bias: optional ``[out_features]``.

    Returns:
        ``[..., out_features]`` in the dtype of ``x``.
    """
    return _ops.linear(x, weight, bias)


# ---------------------------------------------------------------------------------------
# Fake kernels: shapes and dtypes only, the same argument checks as the C++ prologues
# (csrc/checks.h) where they are shape-level. A fake kernel is also what runs when any
# argument is on the "meta" device, so each one checks that every argument is on the
# device of the first: a meta tensor mixed with real ones is refused, naming it.
# ---------------------------------------------------------------------------------------


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)


def _check_same_device(ref_name: str, ref: torch.Tensor, **others: Optional[torch.Tensor]) -> None:
    """Every tensor in ``others`` (None: not given) on ``ref.device``; the C++ CHECK_DEVICE message."""
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise RuntimeError(f"{name} must be on {ref.device} (the device of {ref_name}), got {t.device}")


def _check_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    _check(t.dtype == dtype, f"{name} must be {dtype}, got {t.dtype}")


@torch.library.register_fake("transformer_ext::masked_softmax")
def _masked_softmax_fake(scores, mask, scale, causal):
    _check_same_device("scores", scores, mask=mask)
    _check(scores.dim() == 4, f"scores must have 4 dimensions, got shape {tuple(scores.shape)}")
    if mask is not None:
        _check_dtype("mask", mask, torch.bool)
    return scores.new_empty(scores.shape)  # the kernels return a contiguous tensor


@torch.library.register_fake("transformer_ext::masked_softmax_backward")
def _masked_softmax_backward_fake(grad_probs, probs, scale):
    _check_same_device("probs", probs, grad_probs=grad_probs)
    _check(
        grad_probs.shape == probs.shape,
        f"grad_probs must have the shape of probs {tuple(probs.shape)}, got {tuple(grad_probs.shape)}",
    )
    return probs.new_empty(probs.shape)


@torch.library.register_fake("transformer_ext::decode_attention")
def _decode_attention_fake(q, k_cache, v_cache, lengths, scale, k_new=None, v_new=None):
    _check_same_device("q", q, k_cache=k_cache, v_cache=v_cache, lengths=lengths, k_new=k_new, v_new=v_new)
    _check(q.dim() == 4 and q.shape[2] == 1, f"q must be [B, H, 1, D], got {tuple(q.shape)}")
    _check_dtype("lengths", lengths, torch.int64)
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.register_fake("transformer_ext::kv_cache_append_")
def _kv_cache_append__fake(cache, update, positions, error_flag=None):
    _check_same_device("cache", cache, update=update, positions=positions, error_flag=error_flag)
    _check(cache.dim() == 4 and update.dim() == 4, "cache and update must have 4 dimensions")
    _check_dtype("positions", positions, torch.int64)
    if error_flag is not None:
        _check_dtype("error_flag", error_flag, torch.int32)
    return None


@torch.library.register_fake("transformer_ext::kv_cache_reorder_")
def _kv_cache_reorder__fake(cache, index, length):
    _check_same_device("cache", cache, index=index)
    _check(cache.dim() == 4, "cache must have 4 dimensions")
    _check_dtype("index", index, torch.int64)
    return None


@torch.library.register_fake("transformer_ext::linear")
def _linear_fake(x, weight, bias=None):
    _check_same_device("x", x, weight=weight, bias=bias)
    _check(weight.dim() == 2, f"weight must have 2 dimensions, got shape {tuple(weight.shape)}")
    _check(
        x.dim() >= 1 and x.shape[-1] == weight.shape[1],
        f"x.size(-1) must be weight.size(1) = {weight.shape[1]}, got x of shape {tuple(x.shape)}",
    )
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# ---------------------------------------------------------------------------------------
# Autograd: masked_softmax differentiates through its own backward kernel.
# ---------------------------------------------------------------------------------------


def _masked_softmax_setup_context(ctx, inputs, output):
    _scores, _mask, scale, _causal = inputs
    ctx.scale = scale
    ctx.save_for_backward(output)


def _masked_softmax_backward(ctx, grad_probs):
    (probs,) = ctx.saved_tensors
    grad_scores = _ops.masked_softmax_backward(grad_probs.contiguous(), probs, ctx.scale)
    return grad_scores, None, None, None


torch.library.register_autograd(
    "transformer_ext::masked_softmax",
    _masked_softmax_backward,
    setup_context=_masked_softmax_setup_context,
)


# ---------------------------------------------------------------------------------------
# The inference-only ops: a backward through them raises (as PyTorch's ops without a
# derivative do) instead of leaving the gradients of their inputs None.
# ---------------------------------------------------------------------------------------

_NOT_DIFFERENTIABLE = {
    "linear": "torch.nn.functional.linear",
    "decode_attention": "transformer_ext.ops.attention or transformer_ext.reference.decode_attention",
}


def _not_differentiable(name: str):
    def backward(ctx, *grads):
        raise RuntimeError(
            f"transformer_ext.ops.{name} is not differentiable (an inference op): its inputs get no "
            f"gradient; use {_NOT_DIFFERENTIABLE[name]} where a gradient is needed, or run the op "
            "under torch.no_grad() / torch.inference_mode()"
        )

    return backward


for _name in _NOT_DIFFERENTIABLE:
    torch.library.register_autograd(f"transformer_ext::{_name}", _not_differentiable(_name))
# decode_attention with a position bias: the same public function
torch.library.register_autograd(
    "transformer_ext::decode_attention_with_bias", _not_differentiable("decode_attention")
)


# ---------------------------------------------------------------------------------------
# Fused attention for training and encoding
# ---------------------------------------------------------------------------------------

__all__ += ["attention", "attention_dropout_mask"]

_SEED_HIGH = 2**62  # seeds drawn from torch's generator lie in [0, 2**62)


def _seed_tensor(seed: Optional[int], device: torch.device) -> torch.Tensor:
    """The op's seed argument: ``seed`` as an int64 tensor, or one drawn from torch's default
    generator of ``device`` (so ``torch.manual_seed`` makes dropout reproducible)."""
    if seed is None:
        return torch.randint(0, _SEED_HIGH, (1,), dtype=torch.int64, device=device)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be a Python int or None, got {type(seed).__name__}")
    if not -(2**63) <= seed < 2**63:
        raise ValueError(f"seed must fit in int64, got {seed}")
    return torch.tensor([seed], dtype=torch.int64, device=device)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_lengths: Optional[torch.Tensor] = None,
    query_lengths: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    causal: bool = False,
    dropout_p: float = 0.0,
    seed: Optional[int] = None,
    position_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Fused attention over whole sequences (training and encoding), differentiable.

    Args:
        q: ``[B, H, Q, D]`` float32, float16, bfloat16 (float64 for gradcheck); any strides
            with a dense last dimension (e.g. a view of a projection output).
        k, v: ``[B, H, K, D]``, the dtype and device of ``q``.
        key_lengths: optional int64 ``[B]``: row ``b`` attends keys ``0 .. key_lengths[b]-1``
            only; the others are never read and cost no work.
        query_lengths: optional int64 ``[B]``: query rows at or past ``query_lengths[b]`` are
            zeros (and get zero gradients) and cost no work.
        scale: score multiplier, default ``1/sqrt(D)``.
        causal: query ``i`` sees key ``j`` iff ``j <= i + (K - Q)`` (bottom-right aligned; the
            lengths mask, they do not move the diagonal).
        dropout_p: dropout rate on the attention probabilities, in ``[0, 1)``.
        seed: the dropout generator's seed (an int); by default drawn from torch's generator.
            The mask is a function of ``(seed, b, h, i, j)`` only (not of threads or tiling),
            and the backward pass regenerates it.
        position_bias: optional additive bias of the scaled scores, broadcastable to ``[B, H, Q,
            K]`` (each dimension 1 or that size; T5's relative position bias is ``[1, H, Q, K]``),
            any floating dtype, any strides. It runs the compiled kernels
            (``attention_with_bias`` and its backward) and is differentiable: its gradient is
            summed over the dimensions it broadcasts (a bias shared by the batch gets the sum
            over the batch). A ``-inf`` entry masks its key; a row whose allowed keys all have a
            ``-inf`` bias is zeros, as a row with no key. On the CPU a float32 bias laid out keys
            x queries (``stride(2) == 1``, as :class:`~transformer_ext.model.RelativePositionBias`
            returns it) with ``Q`` a multiple of 16 is read in place by the forward kernel (other
            layouts are copied once per call); with at least as many heads as threads, the
            backward kernel writes the gradient of a ``[1, H, Q, K]`` bias one head per task.

    Returns:
        ``[B, H, Q, D]`` in the dtype of ``q`` (under ``torch.autocast``: q, k and v are cast to
        the autocast dtype first, float64 excepted), with the memory layout of ``[B, Q, H, D]`` (so
        ``out.transpose(1, 2).reshape(B, Q, H * D)`` is a view). A row with no allowed key is
        zeros; a NaN score in an allowed position makes its row NaN.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if q.dim() == 4 and q.shape[-1] > 0 else 1.0
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    seed_t = _seed_tensor(seed, q.device) if p > 0.0 else None
    if position_bias is not None:
        _check_attention_bias(q, k, v, position_bias)
        q, k, v = _autocast_inputs(q, k, v)  # the bias keeps its dtype: the kernels add it in float32
        out, _lse = _ops.attention_with_bias(
            q, k, v, position_bias, key_lengths, query_lengths, float(scale), bool(causal), p, seed_t
        )
        return out
    q, k, v = _autocast_inputs(q, k, v)
    out, _lse = _ops.attention(q, k, v, key_lengths, query_lengths, float(scale), bool(causal), p, seed_t)
    return out


def _check_attention_bias(q, k, v, position_bias) -> None:
    """The shape rule of attention's position bias, as a ValueError naming it."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(
            f"q, k, v must be [B, H, Q, D], [B, H, K, D] twice, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, H, Q, _ = q.shape
    K = k.shape[2]
    if position_bias.dim() != 4 or any(s not in (1, n) for s, n in zip(position_bias.shape, (B, H, Q, K))):
        raise ValueError(
            f"position_bias must be broadcastable to [{B}, {H}, {Q}, {K}], got {tuple(position_bias.shape)}"
        )
    if not position_bias.is_floating_point():
        raise ValueError(f"position_bias must be a floating-point tensor, got {position_bias.dtype}")


def _autocast_inputs(*tensors: torch.Tensor) -> tuple:
    """Under ``torch.autocast`` (CPU or CUDA), floating tensors in the autocast dtype, as autocast
    treats ``F.scaled_dot_product_attention``: the dispatcher hands a custom op its inputs as they
    are, and the kernels need one dtype for q, k and v. Outside autocast: unchanged."""
    device = tensors[0].device.type
    if device not in ("cpu", "cuda") or not torch.is_autocast_enabled(device):
        return tensors
    low = torch.get_autocast_dtype(device)
    return tuple(t.to(low) if t.is_floating_point() and t.dtype != torch.float64 else t for t in tensors)


def attention_dropout_mask(seed: int, B: int, H: int, Q: int, K: int, dropout_p: float) -> torch.Tensor:
    """Debug view of :func:`attention`'s dropout generator: bool ``[B, H, Q, K]``, True where
    key ``j`` of query ``i`` in head ``(b, h)`` is kept for ``seed`` at rate ``dropout_p``."""
    return _ops.attention_dropout_mask(
        _seed_tensor(int(seed), torch.device("cpu")), B, H, Q, K, float(dropout_p)
    )


def _bthd_empty_like(x: torch.Tensor, T: int) -> torch.Tensor:
    B, H, _, D = x.shape
    return x.new_empty((B, T, H, D)).transpose(1, 2)


@torch.library.register_fake("transformer_ext::attention")
def _attention_fake(q, k, v, key_lengths, query_lengths, scale, causal, dropout_p, seed):
    _check(q.dim() == 4, f"q must have 4 dimensions [B, H, Q, D], got shape {tuple(q.shape)}")
    _check(k.dim() == 4, f"k must have 4 dimensions [B, H, K, D], got shape {tuple(k.shape)}")
    _check(v.shape == k.shape, f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    B, H, Q, D = q.shape
    _check(
        k.shape[0] == B and k.shape[1] == H and k.shape[3] == D,
        f"k must have shape [{B}, {H}, K, {D}] to match q {tuple(q.shape)}, got {tuple(k.shape)}",
    )
    _check(k.dtype == q.dtype and v.dtype == q.dtype, f"k and v must have the dtype of q ({q.dtype})")
    _check_same_device("q", q, k=k, v=v, key_lengths=key_lengths, query_lengths=query_lengths, seed=seed)
    for name, t in (("key_lengths", key_lengths), ("query_lengths", query_lengths)):
        if t is not None:
            _check(t.dtype == torch.int64, f"{name} must be int64, got {t.dtype}")
    _check(0.0 <= dropout_p < 1.0, f"dropout_p must be in [0, 1), got {dropout_p}")
    _check(dropout_p == 0.0 or seed is not None, "seed is required when dropout_p > 0")
    return _bthd_empty_like(q, Q), q.new_empty((B, H, Q), dtype=torch.float32)


@torch.library.register_fake("transformer_ext::attention_backward")
def _attention_backward_fake(
    grad_out, q, k, v, out, lse, key_lengths, query_lengths, scale, causal, dropout_p, seed
):
    _check_same_device(
        "q",
        q,
        grad_out=grad_out,
        k=k,
        v=v,
        out=out,
        lse=lse,
        key_lengths=key_lengths,
        query_lengths=query_lengths,
        seed=seed,
    )
    return _bthd_empty_like(q, q.shape[2]), _bthd_empty_like(k, k.shape[2]), _bthd_empty_like(v, v.shape[2])


@torch.library.register_fake("transformer_ext::attention_dropout_mask")
def _attention_dropout_mask_fake(seed, B, H, Q, K, dropout_p):
    return seed.new_empty((B, H, Q, K), dtype=torch.bool)


def _attention_setup_context(ctx, inputs, output):
    q, k, v, key_lengths, query_lengths, scale, causal, dropout_p, seed = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.scale, ctx.causal, ctx.dropout_p = scale, causal, dropout_p
    ctx.save_for_backward(q, k, v, out, lse, key_lengths, query_lengths, seed)


def _attention_backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, key_lengths, query_lengths, seed = ctx.saved_tensors
    dq, dk, dv = _ops.attention_backward(
        grad_out, q, k, v, out, lse, key_lengths, query_lengths, ctx.scale, ctx.causal, ctx.dropout_p, seed
    )
    return dq, dk, dv, None, None, None, None, None, None


torch.library.register_autograd(
    "transformer_ext::attention", _attention_backward, setup_context=_attention_setup_context
)


@torch.library.register_fake("transformer_ext::attention_with_bias")
def _attention_with_bias_fake(
    q, k, v, position_bias, key_lengths, query_lengths, scale, causal, dropout_p, seed
):
    _check_same_device("q", q, position_bias=position_bias)
    B, H, Q, _ = q.shape
    K = k.shape[2] if k.dim() == 4 else 0
    _check(
        position_bias.dim() == 4 and all(s in (1, n) for s, n in zip(position_bias.shape, (B, H, Q, K))),
        f"position_bias must be broadcastable to [{B}, {H}, {Q}, {K}] (each dimension 1 or that size), "
        f"got shape {tuple(position_bias.shape)}",
    )
    return _attention_fake(q, k, v, key_lengths, query_lengths, scale, causal, dropout_p, seed)


@torch.library.register_fake("transformer_ext::attention_with_bias_backward")
def _attention_with_bias_backward_fake(
    grad_out,
    q,
    k,
    v,
    position_bias,
    out,
    lse,
    key_lengths,
    query_lengths,
    scale,
    causal,
    dropout_p,
    seed,
    bias_grad,
):
    dq, dk, dv = _attention_backward_fake(
        grad_out, q, k, v, out, lse, key_lengths, query_lengths, scale, causal, dropout_p, seed
    )
    dbias = position_bias.new_empty(position_bias.shape) if bias_grad else q.new_empty((0,))
    return dq, dk, dv, dbias


@torch.library.register_fake("transformer_ext::decode_attention_with_bias")
def _decode_attention_with_bias_fake(
    q, k_cache, v_cache, lengths, scale, position_bias, k_new=None, v_new=None
):
    _check_same_device("q", q, position_bias=position_bias)
    return _decode_attention_fake(q, k_cache, v_cache, lengths, scale, k_new, v_new)


def _attention_with_bias_setup_context(ctx, inputs, output):
    q, k, v, bias, key_lengths, query_lengths, scale, causal, dropout_p, seed = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.scale, ctx.causal, ctx.dropout_p = scale, causal, dropout_p
    ctx.save_for_backward(q, k, v, bias, out, lse, key_lengths, query_lengths, seed)


def _attention_with_bias_backward(ctx, grad_out, _grad_lse):
    q, k, v, bias, out, lse, key_lengths, query_lengths, seed = ctx.saved_tensors
    bias_grad = ctx.needs_input_grad[3]
    dq, dk, dv, dbias = _ops.attention_with_bias_backward(
        grad_out,
        q,
        k,
        v,
        bias,
        out,
        lse,
        key_lengths,
        query_lengths,
        ctx.scale,
        ctx.causal,
        ctx.dropout_p,
        seed,
        bias_grad,
    )
    return dq, dk, dv, (dbias if bias_grad else None), None, None, None, None, None, None


torch.library.register_autograd(
    "transformer_ext::attention_with_bias",
    _attention_with_bias_backward,
    setup_context=_attention_with_bias_setup_context,
)
