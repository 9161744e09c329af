"""TensorRT runner: the runner protocol of :mod:`transformer_ext.decoding` on TensorRT engines.

Built by ``python -m export.tensorrt`` (``encoder.<precision>.engine``,
``decoder_step.<precision>.engine``); greedy and beam search are the project's own
(:func:`transformer_ext.decoding.greedy_decode` / :func:`~transformer_ext.decoding.beam_search`).

Data path of one decoding (DESIGN.md sections 1 and 3), everything on one CUDA stream:

* :meth:`DeviceRunner.encode`: every buffer is a torch CUDA tensor allocated once: token ids,
  positions, source lengths, the self-attention caches ``[N, H, L, d_k]`` (zero-filled: the
  graph reads the whole buffer, so it must hold finite values), cross K/V, logits, the new K/V.
  The encoder engine runs once per source; its cross K/V are repeated per beam on the device.
* :meth:`DeviceRunner.step`: the token ids are copied in, ``positions`` filled, the decoder
  engine enqueued with ``execute_async_v3(stream)`` (tensor addresses are set once per
  decoding: no step binds anything); the new K/V are then written into the caches in place by
  ``transformer_ext.ops.kv_cache_append_`` on the same stream (``tensorscatter`` flavour: the
  engine's KV-cache update layer writes them, the cache buffer bound as both ``self_key.{i}`` and
  ``present_key.{i}``); the logits are copied to pinned host memory and the stream is
  synchronised once: the decoding loop needs them on the host. On CUDA the append gets an
  ``error_flag`` (so the op never syncs to check positions on the host); the flag is copied back
  with the logits and checked after that one sync, at no extra cost. Positions are checked on the
  host before the step (``0 <= position < min(cache capacity, max_len)``, DESIGN.md section 3),
  so the flag only guards against a broken invariant.
* :meth:`DeviceRunner.reorder`: ``kv_cache_reorder_`` on the valid prefix, same stream.

:class:`DeviceRunner` holds everything that does not depend on the engine (buffers, stream
order, cache writes, checks) and is shared with the ONNX Runtime CUDA runner
(:mod:`export.ort_cuda_runner`); :class:`TensorRTRunner` adds the engines: binding plans checked
against the engines' I/O (names, dtypes, profile ranges), ``set_input_shape`` /
``set_tensor_address`` / ``execute_async_v3``.

TensorRT is imported only by :meth:`TensorRTRunner.from_export_dir`; the class itself works with
any objects that have the engine / execution-context API, which is how it is tested without a GPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from transformer_ext import decoding

logger = logging.getLogger(__name__)

__all__ = [
    "TORCH_DTYPES",
    "TRT_DTYPE_NAMES",
    "BindingError",
    "ModelDims",
    "ProfileLimits",
    "DeviceState",
    "DeviceRunner",
    "TensorRTRunner",
    "encoder_bindings",
    "decoder_bindings",
    "engine_io",
]

TORCH_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8,
}
# TensorRT DataType member names -> our dtype names.
TRT_DTYPE_NAMES = {
    "FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT64": "int64", "INT32": "int32",
    "BOOL": "bool", "UINT8": "uint8", "INT8": "int8",
}


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


# ------------------------------------------------------------------------------------------
# TensorRT
# ------------------------------------------------------------------------------------------


def _enum_name(value: Any) -> str:
    name = getattr(value, "name", None)
    return str(name if name is not None else value).split(".")[-1]


def engine_io(engine: Any) -> dict[str, dict[str, Any]]:
    """``{name: {"mode": "input"|"output", "dtype": "float16"..., "shape": [...] (-1 dynamic)}}``."""
    out = {}
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        trt_dtype = _enum_name(engine.get_tensor_dtype(name))
        out[name] = {
            "mode": _enum_name(engine.get_tensor_mode(name)).lower(),
            "dtype": TRT_DTYPE_NAMES.get(trt_dtype, trt_dtype.lower()),
            "shape": [int(d) for d in engine.get_tensor_shape(name)],
        }
    return out


def _profile_dim(engine: Any, name: str, axis: int) -> tuple[int, int]:
    """(min, max) of one axis of an input in profile 0."""
    lo, _opt, hi = engine.get_tensor_profile_shape(name, 0)
    return int(lo[axis]), int(hi[axis])


class TensorRTRunner(DeviceRunner):
    """Runs an encoder and a decoder-step TensorRT engine (one optimization profile each).

    Args:
        encoder_engine, decoder_engine: deserialized ``tensorrt.ICudaEngine`` objects (or objects
            with the same API).
        max_positions: the model's ``max_len`` (positions must stay below it); ``None``: only the
            cache capacity is checked.
        src_vocab_size: the model's source vocabulary size (source ids must be below it; the
            engines do not record it); ``None``: source ids are not range-checked.
        device, stream: see :class:`DeviceRunner`.

    Use :meth:`from_export_dir` to load the engines ``python -m export.tensorrt`` wrote.
    """

    def __init__(self, encoder_engine: Any, decoder_engine: Any, *, max_positions: Optional[int] = None,
                 src_vocab_size: Optional[int] = None, device: Union[str, torch.device] = "cuda",
                 stream: Optional[Any] = None):
        super().__init__(device, stream)
        self.encoder_engine, self.decoder_engine = encoder_engine, decoder_engine
        self.encoder_io = engine_io(encoder_engine)
        self.decoder_io = engine_io(decoder_engine)
        dec, enc = self.decoder_io, self.encoder_io
        for need, io, what in ((("input_ids", "src_lengths", "encoder_out", "cross_key.0"), enc, "encoder"),
                               (("input_ids", "positions", "src_lengths", "self_key.0", "logits"), dec, "decoder")):
            missing = [n for n in need if n not in io]
            if missing:
                raise BindingError(f"the {what} engine lacks the tensors {missing} (has {sorted(io)}); "
                                   "was it built from an export of DESIGN.md section 3?")
        self.flavour = "tensorscatter" if "present_key.0" in dec else "portable"
        n_layers = sum(1 for n in dec if n.startswith("self_key."))
        _, heads, cache_dim, d_k = dec["self_key.0"]["shape"]
        self.dims = ModelDims(
            n_layers=n_layers, n_heads=heads, d_k=d_k, d_model=enc["encoder_out"]["shape"][-1],
            vocab_size=dec["logits"]["shape"][-1], max_positions=max_positions,
            src_vocab_size=None if src_vocab_size is None else int(src_vocab_size),
        )
        self.cache_dtype = TORCH_DTYPES[dec["self_key.0"]["dtype"]]
        self.encoder_out_dtype = TORCH_DTYPES[enc["encoder_out"]["dtype"]]
        if TORCH_DTYPES[enc["cross_key.0"]["dtype"]] != self.cache_dtype:
            raise BindingError(f"encoder cross_key dtype {enc['cross_key.0']['dtype']} != decoder cache dtype "
                               f"{dec['self_key.0']['dtype']}: engines of different precisions?")
        rows = _profile_dim(decoder_engine, "input_ids", 0)
        sources = _profile_dim(encoder_engine, "input_ids", 0)
        src = _profile_dim(encoder_engine, "input_ids", 1)
        cross_src = _profile_dim(decoder_engine, "cross_key.0", 2)
        cache = (cache_dim, cache_dim) if cache_dim > 0 else _profile_dim(decoder_engine, "self_key.0", 2)
        static = cache[0] if cache[0] == cache[1] and (cache_dim > 0 or self.flavour == "tensorscatter") else None
        self.limits = ProfileLimits(
            max_rows=rows[1], max_sources=sources[1],
            min_src_len=max(src[0], cross_src[0]), max_src_len=min(src[1], cross_src[1]),
            min_cache_len=cache[0], max_cache_len=cache[1], static_cache_len=static,
        )
        self.encoder_context = encoder_engine.create_execution_context()
        self.decoder_context = decoder_engine.create_execution_context()
        if self.encoder_context is None or self.decoder_context is None:
            raise RuntimeError("TensorRT could not create an execution context (out of device memory?)")
        self._bound_token: Optional[object] = None  # the decoding whose buffers the decoder context holds
        logger.info("TensorRT runner: %s flavour, %d layers, cache %s, limits %s", self.flavour, n_layers,
                    _dtype_name(self.cache_dtype), self.limits)

    # ---------------------------------------------------------------- loading

    @classmethod
    def from_export_dir(cls, export_dir: Union[str, os.PathLike], precision: str = "fp32", *,
                        device: Union[str, torch.device] = "cuda", verify: bool = True) -> "TensorRTRunner":
        """Load ``<graph>.<precision>.engine`` as recorded in ``manifest.json`` by ``python -m export.tensorrt``."""
        from .tensorrt import _TrtLogger, import_tensorrt
        from .trt_readiness import manifest_max_positions, read_manifest

        export_dir = Path(export_dir)
        manifest = read_manifest(export_dir)
        built = (manifest.get("tensorrt") or {}).get("engines") or {}
        if precision not in built:
            raise FileNotFoundError(
                f"{export_dir / 'manifest.json'} records no {precision} TensorRT engines (built: {sorted(built) or 'none'}); "
                f"run `python -m export.tensorrt {export_dir} --precision {precision}`"
            )
        trt = import_tensorrt()
        trt_logger = _TrtLogger.create(trt)
        runtime = trt.Runtime(trt_logger)
        engines = {}
        for graph in ("encoder", "decoder_step"):
            entry = built[precision]["engines"][graph]
            data = (export_dir / entry["file"]).read_bytes()
            if verify and hashlib.sha256(data).hexdigest() != entry["sha256"]:
                raise RuntimeError(f"{export_dir / entry['file']} does not match the sha256 in the manifest "
                                   "(a build was interrupted, or the file was replaced); rebuild the engines")
            engine = runtime.deserialize_cuda_engine(data)
            if engine is None:
                raise RuntimeError(f"TensorRT could not deserialize {entry['file']} (built with TensorRT "
                                   f"{built[precision].get('tensorrt_version')} on {built[precision].get('device')}; "
                                   f"this is TensorRT {trt.__version__}: engines are tied to both)")
            engines[graph] = engine
        src_vocab = (manifest.get("model_config") or {}).get("src_vocab_size")
        runner = cls(engines["encoder"], engines["decoder_step"], max_positions=manifest_max_positions(manifest),
                     src_vocab_size=src_vocab, device=device)
        runner._runtime = runtime  # keep the runtime alive as long as its engines
        return runner

    # ---------------------------------------------------------------- binding

    def _bind(self, context: Any, io: Mapping[str, Mapping[str, Any]], bindings: Mapping[str, torch.Tensor],
              what: str) -> None:
        missing = sorted(set(io) - set(bindings))
        extra = sorted(set(bindings) - set(io))
        if missing or extra:
            raise BindingError(f"{what}: engine tensors without a buffer {missing}, buffers without a tensor {extra}")
        for name, t in bindings.items():
            want = io[name]["dtype"]
            if _dtype_name(t.dtype) != want:
                raise BindingError(f"{what}: {name} is {want} in the engine, the buffer is {_dtype_name(t.dtype)}")
            if t.device != self.device or not t.is_contiguous():
                raise BindingError(f"{what}: {name} must be a contiguous tensor on {self.device}")
        for name, t in bindings.items():
            if io[name]["mode"] == "input" and not context.set_input_shape(name, tuple(t.shape)):
                raise BindingError(f"{what}: shape {tuple(t.shape)} of {name} is outside the engine's profile")
        for name, t in bindings.items():
            if not context.set_tensor_address(name, t.data_ptr()):
                raise BindingError(f"{what}: TensorRT refused the address of {name}")
        for name, t in bindings.items():
            if io[name]["mode"] == "output":
                shape = tuple(int(d) for d in context.get_tensor_shape(name))
                if shape != tuple(t.shape):
                    raise BindingError(f"{what}: the engine computes {name} as {shape}, the buffer is {tuple(t.shape)}")

    def _execute(self, context: Any, what: str) -> None:
        if not context.execute_async_v3(self.stream_handle):
            raise RuntimeError(f"TensorRT failed to enqueue the {what} (see TensorRT's log)")

    def _run_encoder(self, bindings: Mapping[str, torch.Tensor]) -> None:
        self._bind(self.encoder_context, self.encoder_io, bindings, "encoder")
        self._execute(self.encoder_context, "encoder")

    def _run_decoder(self, state: DeviceState) -> None:
        token = state.backend.setdefault("tensorrt_token", object())
        if self._bound_token is not token:  # addresses and shapes are set once per decoding
            self._bind(self.decoder_context, self.decoder_io, decoder_bindings(state, self.flavour), "decoder")
            self._bound_token = token
        self._execute(self.decoder_context, "decoder step")
