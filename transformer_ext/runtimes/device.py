"""The engine-independent part of the GPU runners: buffers, stream order, in-place cache writes.

:class:`DeviceRunner` is the base of :class:`~transformer_ext.runtimes.trt.TensorRTRunner` and
:class:`~transformer_ext.runtimes.ort_cuda.OrtCudaRunner`; a subclass only runs the graphs.
Data path of one decoding (docs/DESIGN.md sections 1 and 3), everything on one CUDA stream:

* :meth:`DeviceRunner.encode`: every buffer is a torch CUDA tensor allocated once: token ids,
  source lengths, cross K/V, logits and the self-attention cache, a
  :class:`~transformer_ext.runtimes.kv_cache.KVCache` (every layer's K in one zero-filled buffer
  ``[n_layers * N, H, L, d_k]``, V in another, bound per layer through views: the graph reads the
  whole buffer, so it must hold finite values; with it the write positions and, for the portable
  flavour, the stacked staging buffers the graph writes the new K/V into). The encoder runs once
  per source; its cross K/V are repeated per beam on the device.
* :meth:`DeviceRunner.step`: the token ids are copied in, ``positions`` filled, the decoder
  step enqueued on the runner's stream (the subclass binds the buffers once per decoding: no
  step binds anything); the new K/V of every layer are then written into the caches in place by
  one ``transformer_ext.ops.kv_cache_append_`` per buffer on the same stream (``tensorscatter``
  flavour: the graph's cache update writes them, the cache buffer bound as both
  ``self_key.{i}`` and ``present_key.{i}``); the logits are copied to pinned host memory and the
  stream is synchronised once: the decoding loop needs them on the host. On CUDA the append gets
  the cache's ``error_flag`` (so the op never syncs to check positions on the host); the flag is
  copied back behind the appends and checked after that one sync, at no extra cost. Positions are
  checked on the host before the step (``0 <= position < min(cache capacity, max_len)``,
  docs/DESIGN.md section 3), so the flag only guards against a broken invariant.
* :meth:`DeviceRunner.reorder`: one ``kv_cache_reorder_`` per buffer on the valid prefix, same stream.

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
from transformer_ext.decoding.renamed import renamed_keywords
from transformer_ext.export_format import ATTENTION_OUTPUT, DTYPES, ExportError

from .info import RunnerInfo
from .kv_cache import CacheStateViews, KVCache

logger = logging.getLogger(__name__)

__all__ = [
    "TORCH_DTYPES",
    "BindingError",
    "DeviceState",
    "DeviceRunner",
    "encoder_bindings",
    "decoder_bindings",
]

# Our dtype names (export_format.DTYPES) -> torch dtypes.
TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}


class BindingError(ExportError, RuntimeError):
    """The buffers a runner binds do not fit the engine / session (names, dtypes, shapes): the
    export folder or engine does not match what the runner was given."""


def _dtype_name(t: torch.dtype) -> str:
    return str(t).replace("torch.", "")


@dataclass
class DeviceState(CacheStateViews):
    """Decoding state of a :class:`DeviceRunner` for N = batch x beam_size rows; all tensors on
    the runner's device, allocated once by :meth:`DeviceRunner.encode`."""

    batch: int
    beam_size: int
    src_len: int
    input_ids: torch.Tensor  # [N, 1] int64, refilled every step
    src_lengths: torch.Tensor  # [N] int64
    # The self-attention caches, stacked over layers (zero-filled), their write positions, the
    # staging buffers of the new K/V (portable flavour) and the device error flag.
    cache: KVCache
    cross_keys: list[torch.Tensor]  # per layer [N, H, S, d_k]
    cross_values: list[torch.Tensor]
    logits: torch.Tensor  # [N, V] float32
    logits_host: torch.Tensor  # [N, V] float32, pinned when the device is CUDA
    tokens_host: torch.Tensor  # [N] int64, pinned when the device is CUDA
    backend: dict[str, Any] = field(default_factory=dict)  # the backend's per-decoding objects

    @property
    def positions(self) -> torch.Tensor:
        """``[N]`` int64, the decoder step's ``positions`` (filled with ``position`` every step)."""
        return self.cache.step_positions


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
    """Tensor name -> buffer for one encoder call (docs/DESIGN.md section 3 names)."""
    b = {"input_ids": input_ids, "src_lengths": src_lengths, "encoder_out": encoder_out}
    for i, (k, v) in enumerate(zip(cross_keys, cross_values)):
        b[f"cross_key.{i}"] = k
        b[f"cross_value.{i}"] = v
    return b


def decoder_bindings(
    state: DeviceState, flavour: str, io: Optional[Mapping[str, Any]] = None
) -> dict[str, torch.Tensor]:
    """Tensor name -> buffer for every decoder step of ``state``.

    ``portable``: the new token's K/V go to ``new_key.{i}`` / ``new_value.{i}`` buffers that the
    runner appends to the caches. ``tensorscatter``: ``present_key.{i}`` is bound to the very
    buffer bound as ``self_key.{i}`` (TensorRT's KV-cache update layer and ONNX Runtime's
    in-place ``TensorScatter`` require one buffer for both). ``io``: the graph's tensors; when it
    has the optional ``attention`` output (an export made with ``--attention``), a scratch buffer
    ``[N, S]`` receives it (these runners do not return attention).
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
    if io is not None and ATTENTION_OUTPUT in io:
        N, _, S, _ = state.cross_keys[0].shape
        b[ATTENTION_OUTPUT] = state.backend.setdefault(
            ATTENTION_OUTPUT, torch.zeros(N, S, dtype=torch.float32, device=state.logits.device)
        )
    return b


# ------------------------------------------------------------------------------------------
# The engine-independent part
# ------------------------------------------------------------------------------------------


class DeviceRunner(decoding.SearchMethods):
    """Buffers, stream order and cache writes of a device runner; subclasses run the graphs.

    Subclasses set :attr:`info` (the model's sizes, the graph flavour and the engines' profile
    limits: :class:`~transformer_ext.runtimes.info.RunnerInfo`) and the dtypes, and implement
    :meth:`_run_encoder` (run the encoder on the given bindings, enqueued on :attr:`stream`) and
    :meth:`_run_decoder` (one decoder step on ``decoder_bindings(state)``).

    Args:
        device: ``"cuda"``, ``"cuda:1"``... (``"cpu"`` only for tests with stand-in engines).
        stream: a ``torch.cuda.Stream``; default: a new one (not the default stream: ONNX
            Runtime treats stream 0 as "no stream", and TensorRT syncs extra on it).
    """

    info: RunnerInfo
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
            raise RuntimeError(
                "transformer_ext was built without its CUDA kernels; rebuild with TRANSFORMER_EXT_CUDA=1"
            )
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
        """The capacity to allocate for a checked ``cache_len`` under the engines' profile."""
        lim = self.info
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

    def _check_sources(
        self, input_ids: Any, src_lengths: Any, cache_len: Any, beam_size: Any
    ) -> tuple[np.ndarray, np.ndarray, int, int]:
        """The checks every runner makes (:func:`transformer_ext.decoding.check_encode_args`),
        then the engines' profile limits."""
        d = self.info
        ids, lengths, cache_len, beam_size = decoding.check_encode_args(
            input_ids,
            src_lengths,
            cache_len,
            beam_size,
            src_vocab_size=d.src_vocab_size,
            max_positions=d.max_positions,
        )
        B, S = ids.shape
        lim = self.info
        if lim.max_src_len is not None and S > lim.max_src_len:
            raise ValueError(
                f"source length {S} exceeds the engine profile's maximum {lim.max_src_len}; rebuild "
                "with a larger --src-len or split the input"
            )
        if S < lim.min_src_len:
            raise ValueError(f"source length {S} is below the engine profile's minimum {lim.min_src_len}")
        if lim.max_sources is not None and B > lim.max_sources:
            raise ValueError(
                f"{B} sources exceed the encoder profile's maximum batch {lim.max_sources}; "
                "decode in smaller batches or rebuild with a larger --batch"
            )
        if lim.max_rows is not None and B * beam_size > lim.max_rows:
            raise ValueError(
                f"{B} sources x {beam_size} beams = {B * beam_size} rows exceed the decoder profile's "
                f"maximum batch {lim.max_rows}; decode in smaller batches or rebuild with --batch"
            )
        return ids, lengths, cache_len, beam_size

    # ---------------------------------------------------------------- subclass hooks

    def _run_encoder(self, bindings: Mapping[str, torch.Tensor]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _run_decoder(self, state: DeviceState) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    # ---------------------------------------------------------------- runner protocol

    @renamed_keywords({"num_beams": "beam_size"}, formula=False)
    def encode(self, input_ids: Any, src_lengths: Any, cache_len: int, beam_size: int = 1) -> DeviceState:
        """Encode ``input_ids [B, S]`` once; allocate every buffer of the decoding; repeat the
        cross K/V per beam on the device. See :class:`transformer_ext.decoding.Runner`."""
        ids, lengths, cache_len, K = self._check_sources(input_ids, src_lengths, cache_len, beam_size)
        L = self._cache_capacity(cache_len)
        B, S = ids.shape
        N = B * K
        d = self.info
        dev = self.device
        with self._on_stream(), torch.inference_mode():
            ids_dev = torch.from_numpy(ids).to(dev)
            lens_dev = torch.from_numpy(lengths).to(dev)
            encoder_out = torch.empty((B, S, d.d_model), dtype=self.encoder_out_dtype, device=dev)
            cross_shape = (B, d.n_heads, S, d.d_k)
            cross_keys = [
                torch.empty(cross_shape, dtype=self.cache_dtype, device=dev) for _ in range(d.n_layers)
            ]
            cross_values = [
                torch.empty(cross_shape, dtype=self.cache_dtype, device=dev) for _ in range(d.n_layers)
            ]
            self._run_encoder(encoder_bindings(ids_dev, lens_dev, encoder_out, cross_keys, cross_values))
            if K > 1:  # source b's beams are rows b*K .. b*K+K-1
                cross_keys = [k.repeat_interleave(K, dim=0) for k in cross_keys]
                cross_values = [v.repeat_interleave(K, dim=0) for v in cross_values]
                lens_dev = lens_dev.repeat_interleave(K, dim=0)
            # portable: the graph writes the new K/V into stacked staging buffers that one append
            # per buffer reads; tensorscatter: the graph updates the bound caches itself.
            cache = KVCache.allocate(
                d.n_layers,
                N,
                d.n_heads,
                L,
                d.d_k,
                dtype=self.cache_dtype,
                device=dev,
                staging=d.flavour == "portable",
                append_op=self._kv_append,
                reorder_op=self._kv_reorder,
            )
            state = DeviceState(
                batch=B,
                beam_size=K,
                src_len=S,
                input_ids=torch.zeros((N, 1), dtype=torch.int64, device=dev),
                src_lengths=lens_dev.contiguous(),
                cache=cache,
                cross_keys=[k.contiguous() for k in cross_keys],
                cross_values=[v.contiguous() for v in cross_values],
                logits=torch.empty((N, d.tgt_vocab_size), dtype=torch.float32, device=dev),
                logits_host=self._host((N, d.tgt_vocab_size), torch.float32),
                tokens_host=self._host((N,), torch.int64),
            )
        return state

    def step(self, state: DeviceState, tokens: Any) -> np.ndarray:
        """Feed one token per row at the current position; append its K/V in place; return the
        float32 logits ``[N, V]`` on the host."""
        cache = state.cache
        N = state.num_rows
        vocab = self.info.tgt_vocab_size if self.info.tgt_vocab_size > 0 else None
        tok = decoding.check_step_tokens(
            cache.length, cache.capacity, self.info.max_positions, tokens, N, vocab
        )
        with self._on_stream(), torch.inference_mode():
            state.tokens_host.copy_(torch.from_numpy(np.ascontiguousarray(tok, dtype=np.int64)))
            state.input_ids.view(N).copy_(state.tokens_host, non_blocking=True)
            cache.begin_step()
            self._run_decoder(state)
            if self.info.flavour == "portable":
                cache.append_()  # from the staging buffers the graph wrote; the flag copy behind it
            state.logits_host.copy_(state.logits, non_blocking=True)
        self._synchronize()
        cache.end_step()  # the flag's host copy is complete after the sync
        return state.logits_host.numpy().copy()

    def reorder(self, state: DeviceState, beam_index: Any) -> None:
        """Row ``r`` of every self-attention cache becomes old row ``beam_index[r]`` over the valid
        prefix, in place on the runner's stream; cross K/V are untouched."""
        with self._on_stream(), torch.inference_mode():
            state.cache.reorder_(beam_index)

    def select(self, state: DeviceState, index: Any) -> None:
        """Keep the rows ``index`` (row ``r`` becomes old row ``index[r]``; see
        :class:`transformer_ext.decoding.Runner`), on the runner's stream: the caches in place
        (:meth:`KVCache.select_`), the cross K/V and source lengths gathered into smaller
        tensors, the step's buffers as views of their first rows; the graph's buffers are bound
        again at the next step."""
        index = decoding.check_select_index(index, state.num_rows)
        M = int(index.shape[0])
        with self._on_stream(), torch.inference_mode():
            rows = torch.from_numpy(index).to(self.device)
            state.cache.select_(index)
            state.src_lengths = state.src_lengths.index_select(0, rows)
            state.cross_keys = [k.index_select(0, rows) for k in state.cross_keys]
            state.cross_values = [v.index_select(0, rows) for v in state.cross_values]
            state.input_ids = state.input_ids[:M]
            state.logits = state.logits[:M]
            state.logits_host, state.tokens_host = state.logits_host[:M], state.tokens_host[:M]
        state.backend.clear()  # the backend binds the new buffers at the next step
