"""The engine-independent part of the GPU runners: buffers, stream order, in-place cache writes.

:class:`DeviceRunner` is the base of :class:`~transformer_ext.runtimes.trt.TensorRTRunner` and
:class:`~transformer_ext.runtimes.ort_cuda.OrtCudaRunner`; a subclass only runs the graphs.
Data path of one decoding (DESIGN.md sections 1 and 3), everything on one CUDA stream:

* :meth:`DeviceRunner.encode`: every buffer is a torch CUDA tensor allocated once: token ids,
  positions, source lengths, the self-attention caches ``[N, H, L, d_k]`` (zero-filled: the
  graph reads the whole buffer, so it must hold finite values), cross K/V, logits, the new K/V.
  The encoder runs once per source; its cross K/V are repeated per beam on the device.
* :meth:`DeviceRunner.step`: the token ids are copied in, ``positions`` filled, the decoder
  step enqueued on the runner's stream (the subclass binds the buffers once per decoding: no
  step binds anything); the new K/V are then written into the caches in place by
  ``transformer_ext.ops.kv_cache_append_`` on the same stream (``tensorscatter`` flavour: the
  graph's cache update writes them, the cache buffer bound as both ``self_key.{i}`` and
  ``present_key.{i}``); the logits are copied to pinned host memory and the stream is
  synchronised once: the decoding loop needs them on the host. On CUDA the append gets an
  ``error_flag`` (so the op never syncs to check positions on the host); the flag is copied back
  with the logits and checked after that one sync, at no extra cost. Positions are checked on the
  host before the step (``0 <= position < min(cache capacity, max_len)``, DESIGN.md section 3),
  so the flag only guards against a broken invariant.
* :meth:`DeviceRunner.reorder`: ``kv_cache_reorder_`` on the valid prefix, same stream.

Needs torch (and this project's compiled ops for the cache writes).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from transformer_ext import decoding
from transformer_ext.export_format import DTYPES

logger = logging.getLogger(__name__)

__all__ = [
    "TORCH_DTYPES",
    "BindingError",
    "ModelDims",
    "ProfileLimits",
    "DeviceState",
    "DeviceRunner",
    "encoder_bindings",
    "decoder_bindings",
]

# Our dtype names (export_format.DTYPES) -> torch dtypes.
TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}


class BindingError(RuntimeError):
    """The buffers a runner binds do not fit the engine / session (names, dtypes, shapes)."""


def _dtype_name(t: torch.dtype) -> str:
    return str(t).replace("torch.", "")


@dataclass(frozen=True)
class ModelDims:
    """What a runner needs to know of the model to size its buffers."""

    n_layers: int
    n_heads: int
    d_k: int
    d_model: int
    vocab_size: int
    max_positions: Optional[int] = None  # the model's max_len: positions must stay below it
    src_vocab_size: Optional[int] = None  # source ids must be below it; None: not checked


@dataclass(frozen=True)
class ProfileLimits:
    """Sizes the engines accept (their optimization profile); ``None`` = unbounded."""

    max_rows: Optional[int] = None  # decoder batch (sources x beams)
    max_sources: Optional[int] = None  # encoder batch
    min_src_len: int = 1
    max_src_len: Optional[int] = None
    min_cache_len: int = 1
    max_cache_len: Optional[int] = None
    static_cache_len: Optional[int] = None  # tensorscatter: the engine's fixed capacity


@dataclass
class DeviceState:
    """Decoding state of a :class:`DeviceRunner` for N = batch x num_beams rows; all tensors on
    the runner's device, allocated once by :meth:`DeviceRunner.encode`."""

    batch: int
    num_beams: int
    src_len: int
    cache_len: int  # allocated capacity L (>= the requested cache_len)
    input_ids: torch.Tensor  # [N, 1] int64, refilled every step
    positions: torch.Tensor  # [N] int64, filled with `position` every step
    src_lengths: torch.Tensor  # [N] int64
    self_keys: list[torch.Tensor]  # per layer [N, H, L, d_k], cache dtype, zero-filled
    self_values: list[torch.Tensor]
    cross_keys: list[torch.Tensor]  # per layer [N, H, S, d_k]
    cross_values: list[torch.Tensor]
    logits: torch.Tensor  # [N, V] float32
    logits_host: torch.Tensor  # [N, V] float32, pinned when the device is CUDA
    tokens_host: torch.Tensor  # [N] int64, pinned when the device is CUDA
    new_keys: list[torch.Tensor] = field(default_factory=list)  # portable: per layer [N, H, 1, d_k]
    new_values: list[torch.Tensor] = field(default_factory=list)
    error_flag: Optional[torch.Tensor] = None  # CUDA: int32 [1], set by kv_cache_append_ on a bad row
    error_flag_host: Optional[torch.Tensor] = None
    position: int = 0  # tokens already in the caches (the same for every row)
    backend: dict[str, Any] = field(default_factory=dict)  # the backend's per-decoding objects

    @property
    def num_rows(self) -> int:
        return int(self.src_lengths.shape[0])


# ------------------------------------------------------------------------------------------
# Binding plans: which buffer goes to which tensor name
# ------------------------------------------------------------------------------------------


def encoder_bindings(
    input_ids: torch.Tensor,
    src_lengths: torch.Tensor,
    encoder_out: torch.Tensor,
    cross_keys: Sequence[torch.Tensor],
    cross_values: Sequence[torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Tensor name -> buffer for one encoder call (DESIGN.md section 3 names)."""
    b = {"input_ids": input_ids, "src_lengths": src_lengths, "encoder_out": encoder_out}
    for i, (k, v) in enumerate(zip(cross_keys, cross_values)):
        b[f"cross_key.{i}"] = k
        b[f"cross_value.{i}"] = v
    return b


def decoder_bindings(state: DeviceState, flavour: str) -> dict[str, torch.Tensor]:
    """Tensor name -> buffer for every decoder step of ``state``.

    ``portable``: the new token's K/V go to ``new_key.{i}`` / ``new_value.{i}`` buffers that the
    runner appends to the caches. ``tensorscatter``: ``present_key.{i}`` is bound to the very
    buffer bound as ``self_key.{i}`` (TensorRT's KV-cache update layer and ONNX Runtime's
    in-place ``TensorScatter`` require one buffer for both).
    """
    if flavour not in ("portable", "tensorscatter"):
        raise ValueError(f"flavour must be 'portable' or 'tensorscatter', got {flavour!r}")
    b = {
        "input_ids": state.input_ids,
        "positions": state.positions,
        "src_lengths": state.src_lengths,
        "logits": state.logits,
    }
    for i in range(len(state.self_keys)):
        b[f"self_key.{i}"] = state.self_keys[i]
        b[f"self_value.{i}"] = state.self_values[i]
        b[f"cross_key.{i}"] = state.cross_keys[i]
        b[f"cross_value.{i}"] = state.cross_values[i]
        if flavour == "portable":
            b[f"new_key.{i}"] = state.new_keys[i]
            b[f"new_value.{i}"] = state.new_values[i]
        else:
            b[f"present_key.{i}"] = state.self_keys[i]
            b[f"present_value.{i}"] = state.self_values[i]
    return b


_int64 = decoding.as_int64


# ------------------------------------------------------------------------------------------
# The engine-independent part
# ------------------------------------------------------------------------------------------


class DeviceRunner(decoding.SearchMethods):
    """Buffers, stream order and cache writes of a device runner; subclasses run the graphs.

    Subclasses set :attr:`dims`, :attr:`flavour`, :attr:`limits` and the dtypes, and implement
    :meth:`_run_encoder` (run the encoder on the given bindings, enqueued on :attr:`stream`) and
    :meth:`_run_decoder` (one decoder step on ``decoder_bindings(state)``).

    Args:
        device: ``"cuda"``, ``"cuda:1"``... (``"cpu"`` only for tests with stand-in engines).
        stream: a ``torch.cuda.Stream``; default: a new one (not the default stream: ONNX
            Runtime treats stream 0 as "no stream", and TensorRT syncs extra on it).
    """

    dims: ModelDims
    flavour: str
    limits: ProfileLimits
    cache_dtype: torch.dtype
    encoder_out_dtype: torch.dtype

    def __init__(self, device: Union[str, torch.device] = "cuda", stream: Optional[Any] = None):
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("a CUDA device was asked for, but torch sees no CUDA GPU")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self.stream = stream if stream is not None else torch.cuda.Stream(self.device)
            self.stream_handle = int(self.stream.cuda_stream)
        else:
            self.stream = None
            self.stream_handle = 0
        from transformer_ext import ops  # the compiled library (CUDA kernels for a CUDA device)

        if self.device.type == "cuda" and not ops.cuda_kernels_built():
            raise RuntimeError("transformer_ext was built without its CUDA kernels; rebuild with TRANSFORMER_EXT_CUDA=1")
        # Indirections so that tests can observe the order of cache writes.
        self._kv_append: Callable[..., None] = ops.kv_cache_append_
        self._kv_reorder: Callable[..., None] = ops.kv_cache_reorder_

    # ---------------------------------------------------------------- helpers

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        """Every torch op of the runner (allocation included) is enqueued on the runner's stream."""
        if self.stream is None:
            yield
        else:
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                yield

    def _synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def _host(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self.device.type == "cuda")

    def _cache_capacity(self, cache_len: int) -> int:
        lim = self.limits
        if not isinstance(cache_len, (int, np.integer)) or cache_len < 1:
            raise ValueError(f"cache_len must be a positive int, got {cache_len!r}")
        cache_len = int(cache_len)
        if lim.static_cache_len is not None:
            if cache_len > lim.static_cache_len:
                raise ValueError(
                    f"cache_len = {cache_len} exceeds the engine's static cache capacity {lim.static_cache_len} "
                    "(tensorscatter flavour); rebuild with `python -m export.tensorrt --cache-len N`"
                )
            return lim.static_cache_len
        if lim.max_cache_len is not None and cache_len > lim.max_cache_len:
            raise ValueError(
                f"cache_len = {cache_len} exceeds the engine profile's maximum {lim.max_cache_len}; rebuild with "
                f"`python -m export.tensorrt --cache-len MIN:OPT:{cache_len}` or generate fewer tokens"
            )
        return max(cache_len, lim.min_cache_len)  # capacity only: unused positions are never read

    def _check_sources(self, ids: np.ndarray, lengths: np.ndarray, num_beams: int) -> None:
        if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
            raise ValueError(f"input_ids must be a non-empty [batch, src_len] array, got shape {ids.shape}")
        B, S = ids.shape
        if lengths.shape != (B,):
            raise ValueError(f"src_lengths must have shape ({B},), got {lengths.shape}")
        if lengths.min() < 1 or lengths.max() > S:
            raise ValueError(f"src_lengths must be in [1, {S}], got {lengths.tolist()}")
        if not isinstance(num_beams, (int, np.integer)) or num_beams < 1:
            raise ValueError(f"num_beams must be a positive int, got {num_beams!r}")
        decoding.check_token_ids("input_ids", ids, self.dims.src_vocab_size, side="source")
        lim = self.limits
        mp = self.dims.max_positions
        if mp is not None and S > mp:
            raise ValueError(f"source length {S} exceeds the model's max_len = {mp}")
        if lim.max_src_len is not None and S > lim.max_src_len:
            raise ValueError(f"source length {S} exceeds the engine profile's maximum {lim.max_src_len}; rebuild "
                             "with a larger --src-len or split the input")
        if S < lim.min_src_len:
            raise ValueError(f"source length {S} is below the engine profile's minimum {lim.min_src_len}")
        if lim.max_sources is not None and B > lim.max_sources:
            raise ValueError(f"{B} sources exceed the encoder profile's maximum batch {lim.max_sources}; "
                             "decode in smaller batches or rebuild with a larger --batch")
        if lim.max_rows is not None and B * num_beams > lim.max_rows:
            raise ValueError(f"{B} sources x {num_beams} beams = {B * num_beams} rows exceed the decoder profile's "
                             f"maximum batch {lim.max_rows}; decode in smaller batches or rebuild with --batch")

    # ---------------------------------------------------------------- subclass hooks

    def _run_encoder(self, bindings: Mapping[str, torch.Tensor]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _run_decoder(self, state: DeviceState) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    # ---------------------------------------------------------------- runner protocol

    def encode(self, input_ids: Any, src_lengths: Any, cache_len: int, num_beams: int = 1) -> DeviceState:
        """Encode ``input_ids [B, S]`` once; allocate every buffer of the decoding; repeat the
        cross K/V per beam on the device. See :class:`transformer_ext.decoding.Runner`."""
        ids = _int64("input_ids", input_ids)
        lengths = _int64("src_lengths", src_lengths)
        self._check_sources(ids, lengths, num_beams)
        L = self._cache_capacity(cache_len)
        B, S = ids.shape
        K = int(num_beams)
        N = B * K
        d = self.dims
        dev = self.device
        with self._on_stream(), torch.inference_mode():
            ids_dev = torch.from_numpy(ids).to(dev)
            lens_dev = torch.from_numpy(lengths).to(dev)
            encoder_out = torch.empty((B, S, d.d_model), dtype=self.encoder_out_dtype, device=dev)
            cross_shape = (B, d.n_heads, S, d.d_k)
            cross_keys = [torch.empty(cross_shape, dtype=self.cache_dtype, device=dev) for _ in range(d.n_layers)]
            cross_values = [torch.empty(cross_shape, dtype=self.cache_dtype, device=dev) for _ in range(d.n_layers)]
            self._run_encoder(encoder_bindings(ids_dev, lens_dev, encoder_out, cross_keys, cross_values))
            if K > 1:  # source b's beams are rows b*K .. b*K+K-1
                cross_keys = [k.repeat_interleave(K, dim=0) for k in cross_keys]
                cross_values = [v.repeat_interleave(K, dim=0) for v in cross_values]
                lens_dev = lens_dev.repeat_interleave(K, dim=0)
            cache_shape = (N, d.n_heads, L, d.d_k)
            state = DeviceState(
                batch=B, num_beams=K, src_len=S, cache_len=L,
                input_ids=torch.zeros((N, 1), dtype=torch.int64, device=dev),
                positions=torch.zeros(N, dtype=torch.int64, device=dev),
                src_lengths=lens_dev.contiguous(),
                self_keys=[torch.zeros(cache_shape, dtype=self.cache_dtype, device=dev) for _ in range(d.n_layers)],
                self_values=[torch.zeros(cache_shape, dtype=self.cache_dtype, device=dev) for _ in range(d.n_layers)],
                cross_keys=[k.contiguous() for k in cross_keys],
                cross_values=[v.contiguous() for v in cross_values],
                logits=torch.empty((N, d.vocab_size), dtype=torch.float32, device=dev),
                logits_host=self._host((N, d.vocab_size), torch.float32),
                tokens_host=self._host((N,), torch.int64),
            )
            if self.flavour == "portable":
                new_shape = (N, d.n_heads, 1, d.d_k)
                state.new_keys = [torch.empty(new_shape, dtype=self.cache_dtype, device=dev) for _ in range(d.n_layers)]
                state.new_values = [torch.empty(new_shape, dtype=self.cache_dtype, device=dev) for _ in range(d.n_layers)]
            if dev.type == "cuda":
                state.error_flag = torch.zeros(1, dtype=torch.int32, device=dev)
                state.error_flag_host = self._host((1,), torch.int32)
        return state

    def step(self, state: DeviceState, tokens: Any) -> np.ndarray:
        """Feed one token per row at the current position; append its K/V in place; return the
        float32 logits ``[N, V]`` on the host."""
        p = state.position
        N = state.num_rows
        vocab = self.dims.vocab_size if self.dims.vocab_size > 0 else None
        tok = decoding.check_step_tokens(p, state.cache_len, self.dims.max_positions, tokens, N, vocab)
        with self._on_stream(), torch.inference_mode():
            state.tokens_host.copy_(torch.from_numpy(np.ascontiguousarray(tok, dtype=np.int64)))
            state.input_ids.view(N).copy_(state.tokens_host, non_blocking=True)
            state.positions.fill_(p)
            self._run_decoder(state)
            if self.flavour == "portable":
                for caches, news in ((state.self_keys, state.new_keys), (state.self_values, state.new_values)):
                    for cache, new in zip(caches, news):
                        if state.error_flag is not None:
                            self._kv_append(cache, new, state.positions, state.error_flag)
                        else:
                            self._kv_append(cache, new, state.positions)
            state.logits_host.copy_(state.logits, non_blocking=True)
            if state.error_flag is not None:
                state.error_flag_host.copy_(state.error_flag, non_blocking=True)
        self._synchronize()
        if state.error_flag_host is not None and int(state.error_flag_host[0]) != 0:
            raise RuntimeError(f"kv_cache_append_ skipped rows whose position {p} + 1 exceeds the cache capacity "
                               f"{state.cache_len} (reported by the CUDA kernel's error flag)")
        state.position = p + 1
        return state.logits_host.numpy().copy()

    def reorder(self, state: DeviceState, beam_index: Any) -> None:
        """Row ``r`` of every self-attention cache becomes old row ``beam_index[r]`` over the valid
        prefix, in place on the runner's stream; cross K/V are untouched."""
        index = decoding.check_beam_index(beam_index, state.num_rows)
        p = state.position
        if p == 0:
            return
        with self._on_stream(), torch.inference_mode():
            idx = torch.from_numpy(index).to(self.device)
            for cache in (*state.self_keys, *state.self_values):
                self._kv_reorder(cache, idx, p)
