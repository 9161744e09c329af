"""The eager PyTorch runner of :mod:`transformer_ext.decoding`: the project's data path.

:class:`EagerRunner` (DESIGN.md section 1): ``model.encode`` once, cross-attention K/V repeated
per beam once, zero-filled preallocated self-attention caches, ``model.decode_step`` per token,
new K/V written in place with ``ops.kv_cache_append_``, beams reordered in place with
``ops.kv_cache_reorder_``. The plain-PyTorch baselines on the same weights are in
:mod:`transformer_ext.runtimes.baseline`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch

from transformer_ext import decoding, ops
from transformer_ext.cli import UserError
from transformer_ext.model import Transformer

logger = logging.getLogger(__name__)

__all__ = ["CompileError", "EagerRunner", "EagerState"]

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
