"""PyTorch runners for :mod:`transformer_ext.decoding`, and the seed's uncached greedy loop.

* :class:`EagerRunner`: the project's data path (DESIGN.md section 1): ``model.encode`` once,
  cross-attention K/V repeated per beam once, zero-filled preallocated self-attention caches,
  ``model.decode_step`` per token, new K/V written in place with ``ops.kv_cache_append_``,
  beams reordered in place with ``ops.kv_cache_reorder_``.
* :class:`CatCacheRunner`: a plain-PyTorch cached decoder (``torch.cat``-grown self-attention
  cache, cross K/V cached once, eager masked softmax) on the same weights: the benchmark
  baseline that corresponds to the seed's KV-cache decoder.
* :func:`greedy_decode_uncached`: the seed's re-decode loop (the full decoder over the whole
  prefix at every step, no cache), the reference the cached decoders are checked against.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch

from . import decoding, ops
from .cli import UserError
from .model import Transformer, padding_mask

logger = logging.getLogger(__name__)

__all__ = ["CompileError", "EagerRunner", "EagerState", "CatCacheRunner", "CatCacheState", "greedy_decode_uncached"]

Device = Union[str, torch.device]


class CompileError(RuntimeError, UserError):
    """``torch.compile`` of the decoder step failed (on CPU, usually a missing C++ compiler)."""


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A checked int64 numpy array (see :mod:`transformer_ext.decoding`'s checks) on ``device``."""
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device)


def _check_encode_args(model: Transformer, cache_len: int, num_beams: int) -> None:
    if not isinstance(cache_len, (int, np.integer)) or cache_len < 1:
        raise ValueError(f"cache_len must be a positive int, got {cache_len!r}")
    if cache_len > model.config.max_len:
        raise ValueError(
            f"cache_len = {cache_len} exceeds the model's max_len = {model.config.max_len} "
            "(positions past it have no positional encoding); generate fewer tokens"
        )
    if not isinstance(num_beams, (int, np.integer)) or num_beams < 1:
        raise ValueError(f"num_beams must be a positive int, got {num_beams!r}")


def _encode_sources(model: Transformer, device: torch.device, input_ids: np.ndarray, src_lengths: np.ndarray,
                    cache_len: int, num_beams: int):
    """The shared encode prologue of the PyTorch runners: checks, ``model.encode`` once, and
    the cross-attention K/V and source lengths repeated per beam (row ``b * num_beams + k``).

    Returns ``(src_lengths [N], cross_keys, cross_values, source_length S)``, N = batch * beams.
    """
    _check_encode_args(model, cache_len, num_beams)
    src = _to_device(decoding.check_token_ids("input_ids", input_ids, model.config.src_vocab_size, side="source"),
                     device)
    lengths = _to_device(decoding.as_int64("src_lengths", src_lengths), device)
    with torch.inference_mode():
        _, cross_keys, cross_values = model.encode(src, lengths)
        if num_beams > 1:
            cross_keys = [k.repeat_interleave(num_beams, dim=0) for k in cross_keys]
            cross_values = [v.repeat_interleave(num_beams, dim=0) for v in cross_values]
            lengths = lengths.repeat_interleave(num_beams, dim=0)
    return lengths, cross_keys, cross_values, int(src.shape[1])


# ------------------------------------------------------------------------------------------
# EagerRunner: compiled ops, preallocated caches
# ------------------------------------------------------------------------------------------


@dataclass
class EagerState:
    """Decoding state of :class:`EagerRunner` (N = batch * num_beams rows)."""

    src_lengths: torch.Tensor  # [N] int64
    cross_keys: list[torch.Tensor]  # per layer [N, H, S, d_k]
    cross_values: list[torch.Tensor]
    self_keys: list[torch.Tensor]  # per layer [N, H, cache_len, d_k]: views into key_buffer
    self_values: list[torch.Tensor]  # views into value_buffer
    position: int  # tokens already in the caches (the same for every row)
    cache_len: int
    error_flag: Optional[torch.Tensor] = None  # CUDA: int32 [1], set by kv_cache_append_ on overflow
    # Every layer's cache in one zero-filled tensor [n_layers * N, H, cache_len, d_k] (layer i =
    # rows i*N .. (i+1)*N-1), so that a step appends all layers' K (and V) in one op call and a
    # beam reorder is one call too: 2 instead of 2 * n_layers kernel calls (launches on CUDA).
    key_buffer: Optional[torch.Tensor] = None
    value_buffer: Optional[torch.Tensor] = None
    # Per layer (W_QKV, b_QKV), copied from the parameters at encode (model.fused_qkv()): one
    # Q/K/V GEMM per layer per step; a decode never sees a later parameter update.
    fused_qkv: Optional[list] = None

    @property
    def num_rows(self) -> int:
        return int(self.src_lengths.shape[0])


class EagerRunner:
    """Runs a :class:`Transformer` through ``encode`` / ``decode_step`` and the in-place cache ops."""

    def __init__(self, model: Transformer, device: Optional[Device] = None, compile: bool = False):
        """``compile=True`` runs ``model.decode_step`` through ``torch.compile`` (fullgraph, static
        shapes): the preallocated cache gives every step of a decode the same shapes, so one
        graph serves all of them, with the Python-level module overhead gone. The first step of
        each new shape (rows, cache length, source length) compiles (seconds; cached on disk by
        Inductor); Inductor on CPU needs a C++ compiler."""
        if device is None:
            device = next(model.parameters()).device
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.config = model.config
        self.compiled = bool(compile)
        self._decode_step = (torch.compile(model.decode_step, fullgraph=True, dynamic=False)
                             if self.compiled else model.decode_step)

    def _run_decode_step(self, *args):
        if not self.compiled:
            return self._decode_step(*args)
        try:
            return self._decode_step(*args)
        except Exception as exc:  # compile errors surface at the first call of each shape
            raise CompileError(
                f"torch.compile of decode_step failed ({type(exc).__name__}: {exc}); on CPU Inductor needs a "
                "working C++ compiler. Run without compile (EagerRunner(..., compile=False), no --compile)"
            ) from exc

    def encode(self, input_ids: np.ndarray, src_lengths: np.ndarray, cache_len: int, num_beams: int = 1) -> EagerState:
        lengths, cross_keys, cross_values, _ = _encode_sources(
            self.model, self.device, input_ids, src_lengths, cache_len, num_beams)
        c = self.config
        with torch.inference_mode():
            N = lengths.shape[0]
            dtype = cross_keys[0].dtype
            shape = (c.n_decoder_layers * N, c.n_heads, int(cache_len), c.d_k)
            key_buffer = torch.zeros(shape, dtype=dtype, device=self.device)
            value_buffer = torch.zeros(shape, dtype=dtype, device=self.device)
            self_keys, self_values = list(key_buffer.split(N)), list(value_buffer.split(N))
            fused_qkv = self.model.fused_qkv()
        # On CUDA the append op reports out-of-range rows through a device flag instead of a host
        # sync per call; the capacity is checked on the host before every step anyway.
        flag = torch.zeros(1, dtype=torch.int32, device=self.device) if self.device.type == "cuda" else None
        return EagerState(lengths, cross_keys, cross_values, self_keys, self_values, 0, int(cache_len), flag,
                          key_buffer, value_buffer, fused_qkv)

    def step(self, state: EagerState, tokens: np.ndarray) -> np.ndarray:
        N = state.num_rows
        ids = _to_device(decoding.check_step_tokens(state.position, state.cache_len, self.config.max_len, tokens, N,
                                                    self.config.tgt_vocab_size), self.device)
        with torch.inference_mode():
            # Every row and every layer's cache rows are at the same position: one tensor for
            # the stacked caches [n_layers * N], its first N entries for the step itself.
            stacked_positions = torch.full((len(state.self_keys) * N,), state.position, dtype=torch.int64,
                                           device=self.device)
            positions = stacked_positions[:N]
            logits, new_keys, new_values = self._run_decode_step(
                ids.view(N, 1), positions, state.src_lengths,
                state.self_keys, state.self_values, state.cross_keys, state.cross_values, state.fused_qkv,
            )
            ops.kv_cache_append_(state.key_buffer, torch.cat(new_keys), stacked_positions, state.error_flag)
            ops.kv_cache_append_(state.value_buffer, torch.cat(new_values), stacked_positions, state.error_flag)
            out = logits.cpu().numpy()  # synchronises, so reading the flag below costs nothing more
            if state.error_flag is not None and int(state.error_flag.item()) != 0:
                raise RuntimeError(f"kv_cache_append_ skipped rows at position {state.position}: cache overflow")
        state.position += 1
        return out

    def reorder(self, state: EagerState, beam_index: np.ndarray) -> None:
        # Checked here, in the caller's terms: the op below sees the stacked per-layer index.
        index = _to_device(decoding.check_beam_index(beam_index, state.num_rows), self.device)
        with torch.inference_mode():
            N, n_layers = state.num_rows, len(state.self_keys)
            # Layer i's rows are i*N .. (i+1)*N-1 of the buffers: offset the index per layer.
            offsets = torch.arange(n_layers, dtype=torch.int64, device=self.device).view(n_layers, 1) * N
            stacked_index = (index.view(1, N) + offsets).reshape(-1)
            for buffer in (state.key_buffer, state.value_buffer):
                ops.kv_cache_reorder_(buffer, stacked_index, state.position)


# ------------------------------------------------------------------------------------------
# CatCacheRunner: plain PyTorch, torch.cat-grown cache (benchmark baseline)
# ------------------------------------------------------------------------------------------


@dataclass
class CatCacheState:
    """Decoding state of :class:`CatCacheRunner`."""

    src_mask: torch.Tensor  # [N, 1, 1, S] bool, True = real source token
    cross_keys: list[torch.Tensor]  # per layer [N, H, S, d_k]
    cross_values: list[torch.Tensor]
    self_keys: list[Optional[torch.Tensor]]  # per layer [N, H, position, d_k], None before step 0
    self_values: list[Optional[torch.Tensor]]
    position: int
    cache_len: int


class CatCacheRunner:
    """The seed's KV-cache decoder in plain PyTorch, batched, on a :class:`Transformer`'s weights.

    The encoder (``model.encode``) is shared with :class:`EagerRunner`; every decoder step is
    plain PyTorch: the self-attention cache grows with ``torch.cat`` and attention is
    ``(scores * scale).masked_fill(~mask, -inf).softmax(-1)``.
    """

    def __init__(self, model: Transformer, device: Optional[Device] = None):
        if device is None:
            device = next(model.parameters()).device
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.config = model.config

    def encode(self, input_ids: np.ndarray, src_lengths: np.ndarray, cache_len: int, num_beams: int = 1) -> CatCacheState:
        lengths, cross_keys, cross_values, src_len = _encode_sources(
            self.model, self.device, input_ids, src_lengths, cache_len, num_beams)
        with torch.inference_mode():
            src_mask = padding_mask(lengths, src_len)
        n = self.config.n_decoder_layers
        return CatCacheState(src_mask, cross_keys, cross_values, [None] * n, [None] * n, 0, int(cache_len))

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # [N, H, 1, K]
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(scores.softmax(-1), v)  # [N, H, 1, d_k]

    def step(self, state: CatCacheState, tokens: np.ndarray) -> np.ndarray:
        N = state.src_mask.shape[0]
        ids = _to_device(decoding.check_step_tokens(state.position, state.cache_len, self.config.max_len, tokens, N,
                                                    self.config.tgt_vocab_size), self.device)
        model = self.model
        with torch.inference_mode():
            x = model.tgt_embed(ids.view(N, 1)) + model.tgt_pe.pe[state.position]  # [N, 1, d_model]
            for i, layer in enumerate(model.decoder.layers):
                attn = layer.self_attn
                h = layer.sublayer[0].sublayer_input(x)
                q = attn.split_heads(attn.W_Q(h))
                k = attn.split_heads(attn.W_K(h))
                v = attn.split_heads(attn.W_V(h))
                if state.self_keys[i] is not None:
                    k = torch.cat([state.self_keys[i], k], dim=2)
                    v = torch.cat([state.self_values[i], v], dim=2)
                state.self_keys[i], state.self_values[i] = k, v
                out = self._attend(q, k, v, attn.scale)
                x = layer.sublayer[0].residual(x, attn.W_O(attn.merge_heads(out)))

                src_attn = layer.src_attn
                h = layer.sublayer[1].sublayer_input(x)
                q = src_attn.split_heads(src_attn.W_Q(h))
                out = self._attend(q, state.cross_keys[i], state.cross_values[i], src_attn.scale, state.src_mask)
                x = layer.sublayer[1].residual(x, src_attn.W_O(src_attn.merge_heads(out)))

                x = layer.sublayer[2](x, layer.feed_forward)
            logits = model.generator(model.decoder.norm(x)[:, 0]).float()
        state.position += 1
        return logits.cpu().numpy()

    def reorder(self, state: CatCacheState, beam_index: np.ndarray) -> None:
        index = _to_device(decoding.check_beam_index(beam_index, int(state.src_mask.shape[0])), self.device)
        with torch.inference_mode():
            for i in range(len(state.self_keys)):
                if state.self_keys[i] is not None:
                    state.self_keys[i] = state.self_keys[i].index_select(0, index)
                    state.self_values[i] = state.self_values[i].index_select(0, index)


# ------------------------------------------------------------------------------------------
# The seed's uncached greedy loop
# ------------------------------------------------------------------------------------------


def greedy_decode_uncached(
    model: Transformer,
    src_ids: torch.Tensor,
    src_lengths: torch.Tensor,
    *,
    bos_id: int,
    eos_id: int,
    max_new_tokens: Union[int, np.ndarray],
    min_new_tokens: Union[int, np.ndarray] = 0,
    return_logits: bool = False,
) -> Union[list[list[int]], tuple[list[list[int]], list[np.ndarray]]]:
    """Greedy decoding by re-running the full decoder on the whole prefix at every step.

    The seed tutorial's loop, batched: the same stopping rules as
    :func:`transformer_ext.decoding.greedy_decode` (EOS excluded, per-row budgets, EOS suppressed
    before ``min_new_tokens``). With ``return_logits`` it also returns the float32 logits
    ``[B, V]`` of every step (before EOS suppression).
    """
    B = src_ids.shape[0]
    max_new = np.broadcast_to(np.asarray(max_new_tokens, dtype=np.int64), (B,))
    min_new = np.broadcast_to(np.asarray(min_new_tokens, dtype=np.int64), (B,))
    steps = int(max_new.max()) if B else 0
    outputs: list[list[int]] = [[] for _ in range(B)]
    step_logits: list[np.ndarray] = []
    finished = max_new == 0
    model.eval()
    with torch.inference_mode():
        memory, _, _ = model.encode(src_ids, src_lengths)
        src_mask = padding_mask(src_lengths, src_ids.shape[1])
        ys = torch.full((B, 1), bos_id, dtype=torch.int64, device=src_ids.device)
        for t in range(steps):
            if finished.all():
                break
            hidden = model.decoder(model.embed_target(ys), memory, src_mask)  # [B, t+1, d_model]
            logits = model.generator(hidden[:, -1]).float().cpu().numpy()  # [B, V], last position only
            if return_logits:
                step_logits.append(logits.copy())
            logits = logits.copy()
            logits[t < min_new, eos_id] = -np.inf
            next_tokens = logits.argmax(-1)
            for b in range(B):
                if finished[b]:
                    continue
                tok = int(next_tokens[b])
                if tok == eos_id:
                    finished[b] = True
                else:
                    outputs[b].append(tok)
                    if len(outputs[b]) >= max_new[b]:
                        finished[b] = True
            fed = np.where(finished, eos_id, next_tokens)
            ys = torch.cat([ys, torch.from_numpy(fed.astype(np.int64)).view(B, 1).to(ys.device)], dim=1)
    if return_logits:
        return outputs, step_logits
    return outputs
