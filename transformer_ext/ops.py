"""Typed Python wrappers of the compiled ``transformer_ext`` ops.

This is the only module that touches ``torch.ops.transformer_ext``. Each op has a fake
(meta) kernel so that ``torch.library.opcheck``, ``torch.compile(fullgraph=True)`` and the
ONNX exporter can trace it, and ``masked_softmax`` has an autograd formula backed by its
own backward kernel. The semantics are those of :mod:`transformer_ext.reference`.
"""

from __future__ import annotations

import logging
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
    return torch._C._dispatch_has_kernel_for_dispatch_key(
        "transformer_ext::masked_softmax", "CUDA"
    )


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

    Returns:
        ``[B, H, 1, D]`` in the dtype of ``q``; zeros for a row with no key. A NaN in ``q``, in
        an attended key or in ``k_new`` makes the row NaN (as ``torch.softmax`` would); cache
        entries at or past ``lengths[b]`` are never read.
    """
    return _ops.decode_attention(q, k_cache, v_cache, lengths, float(scale), k_new, v_new)


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
    ``at::linear``. Not differentiable: the model uses it only where autograd is off.

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
    _check(grad_probs.shape == probs.shape,
           f"grad_probs must have the shape of probs {tuple(probs.shape)}, got {tuple(grad_probs.shape)}")
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
    _check(x.dim() >= 1 and x.shape[-1] == weight.shape[1],
           f"x.size(-1) must be weight.size(1) = {weight.shape[1]}, got x of shape {tuple(x.shape)}")
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
