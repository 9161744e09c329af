"""TensorRT runner: the runner protocol of :mod:`transformer_ext.decoding` on TensorRT engines.

Built by ``python -m export.tensorrt`` (``encoder.<precision>.engine``,
``decoder_step.<precision>.engine``); greedy and beam search are the project's own
(:func:`transformer_ext.decoding.greedy_decode` / :func:`~transformer_ext.decoding.beam_search`).
Buffers, stream order and cache writes are those of
:class:`~transformer_ext.runtimes.device.DeviceRunner`; :class:`TensorRTRunner` adds the engines:
binding plans checked against the engines' I/O (names, dtypes, profile ranges),
``set_input_shape`` / ``set_tensor_address`` (once per decoding) / ``execute_async_v3(stream)``.

TensorRT is imported only by :meth:`TensorRTRunner.from_export_dir` (through
:func:`transformer_ext.tensorrt_support.import_tensorrt`, which the engine builder uses too: the
runner imports nothing of ``export/``); the class itself works with
any objects that have the engine / execution-context API, which is how it is tested without a GPU.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch

from transformer_ext.export_format import DTYPES, dtype_from_tensorrt

from .device import (
    TORCH_DTYPES,
    BindingError,
    DeviceRunner,
    DeviceState,
    _dtype_name,
    decoder_bindings,
)
from .info import PRECISION_NAMES, RunnerInfo

logger = logging.getLogger(__name__)

__all__ = ["TRT_DTYPE_NAMES", "TensorRTRunner", "engine_io"]

# TensorRT DataType member names -> our dtype names (a view of export_format.DTYPES).
TRT_DTYPE_NAMES = {d.tensorrt: d.name for d in DTYPES.values() if d.tensorrt}


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
            "dtype": dtype_from_tensorrt(trt_dtype),
            "shape": [int(d) for d in engine.get_tensor_shape(name)],
        }
    return out


def _optional_id(config: Mapping[str, Any], key: str) -> Optional[int]:
    value = config.get(key)
    return None if value is None else int(value)


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
        config: the model config the engines were built from (a manifest's ``model_config``):
            special ids, and ``max_len`` / ``src_vocab_size`` when those two are not given.
        config_file: where ``config`` was read from (named in messages).
        precision: the engines' precision name (``fp32``, ``fp16``...); default: named after
            the cache dtype.
        device, stream: see :class:`DeviceRunner`.

    ``info`` (:class:`~transformer_ext.runtimes.info.RunnerInfo`) holds the model's sizes read
    from the engines, the profile's limits (batch, source and cache ranges), the precision and
    the flavour.

    Use :meth:`from_export_dir` to load the engines ``python -m export.tensorrt`` wrote.
    """

    def __init__(
        self,
        encoder_engine: Any,
        decoder_engine: Any,
        *,
        max_positions: Optional[int] = None,
        src_vocab_size: Optional[int] = None,
        config: Optional[Mapping[str, Any]] = None,
        config_file: Optional[str] = None,
        precision: Optional[str] = None,
        device: Union[str, torch.device] = "cuda",
        stream: Optional[Any] = None,
    ):
        super().__init__(device, stream)
        self.encoder_engine, self.decoder_engine = encoder_engine, decoder_engine
        self.encoder_io = engine_io(encoder_engine)
        self.decoder_io = engine_io(decoder_engine)
        dec, enc = self.decoder_io, self.encoder_io
        for need, io, what in (
            (("input_ids", "src_lengths", "encoder_out", "cross_key.0"), enc, "encoder"),
            (("input_ids", "positions", "src_lengths", "self_key.0", "logits"), dec, "decoder"),
        ):
            missing = [n for n in need if n not in io]
            if missing:
                raise BindingError(
                    f"the {what} engine lacks the tensors {missing} (has {sorted(io)}); "
                    "was it built from an export of docs/DESIGN.md section 3?"
                )
        flavour = "tensorscatter" if "present_key.0" in dec else "portable"
        n_layers = sum(1 for n in dec if n.startswith("self_key."))
        _, heads, cache_dim, d_k = dec["self_key.0"]["shape"]
        self.cache_dtype = TORCH_DTYPES[dec["self_key.0"]["dtype"]]
        self.encoder_out_dtype = TORCH_DTYPES[enc["encoder_out"]["dtype"]]
        if TORCH_DTYPES[enc["cross_key.0"]["dtype"]] != self.cache_dtype:
            raise BindingError(
                f"encoder cross_key dtype {enc['cross_key.0']['dtype']} != decoder cache dtype "
                f"{dec['self_key.0']['dtype']}: engines of different precisions?"
            )
        rows = _profile_dim(decoder_engine, "input_ids", 0)
        self._min_rows = rows[0]  # the decoder profile's minimum batch
        sources = _profile_dim(encoder_engine, "input_ids", 0)
        src = _profile_dim(encoder_engine, "input_ids", 1)
        cross_src = _profile_dim(decoder_engine, "cross_key.0", 2)
        cache = (cache_dim, cache_dim) if cache_dim > 0 else _profile_dim(decoder_engine, "self_key.0", 2)
        static = cache[0] if cache[0] == cache[1] and (cache_dim > 0 or flavour == "tensorscatter") else None
        config = dict(config or {})
        if max_positions is None:
            max_positions = config.get("max_len")
        if src_vocab_size is None:
            src_vocab_size = config.get("src_vocab_size")
        cache_name = _dtype_name(self.cache_dtype)
        self.info = RunnerInfo(
            runtime="tensorrt",
            n_layers=n_layers,
            n_heads=heads,
            d_k=d_k,
            d_model=enc["encoder_out"]["shape"][-1],
            tgt_vocab_size=dec["logits"]["shape"][-1],
            src_vocab_size=None if src_vocab_size is None else int(src_vocab_size),
            pad_id=_optional_id(config, "pad_id"),
            bos_id=_optional_id(config, "bos_id"),
            eos_id=_optional_id(config, "eos_id"),
            max_positions=None if max_positions is None else int(max_positions),
            max_rows=rows[1],
            max_sources=sources[1],
            min_src_len=max(src[0], cross_src[0]),
            max_src_len=min(src[1], cross_src[1]),
            min_cache_len=cache[0],
            max_cache_len=cache[1],
            static_cache_len=static,
            precision=precision or PRECISION_NAMES.get(cache_name, cache_name),
            flavour=flavour,
            config=config or None,
            config_file=config_file,
        )
        self.encoder_context = encoder_engine.create_execution_context()
        self.decoder_context = decoder_engine.create_execution_context()
        if self.encoder_context is None or self.decoder_context is None:
            raise RuntimeError("TensorRT could not create an execution context (out of device memory?)")
        self._bound_token: Optional[object] = None  # the decoding whose buffers the decoder context holds
        logger.info(
            "TensorRT runner: %s flavour, %d layers, cache %s, %s",
            flavour,
            n_layers,
            cache_name,
            self.info,
        )

    # ---------------------------------------------------------------- loading

    @classmethod
    def from_export_dir(
        cls,
        export_dir: Union[str, os.PathLike],
        precision: str = "fp32",
        *,
        device: Union[str, torch.device] = "cuda",
        verify: bool = True,
        manifest: Optional[Mapping[str, Any]] = None,
    ) -> "TensorRTRunner":
        """Load ``<graph>.<precision>.engine`` as recorded in ``manifest.json`` by ``python -m
        export.tensorrt``; ``manifest``: the folder's manifest when the caller has read it."""
        from transformer_ext.export_format import MANIFEST_NAME, manifest_max_positions, read_manifest
        from transformer_ext.tensorrt_support import TrtLogger, import_tensorrt

        export_dir = Path(export_dir)
        manifest = read_manifest(export_dir) if manifest is None else manifest
        built = (manifest.get("tensorrt") or {}).get("engines") or {}
        if precision not in built:
            raise FileNotFoundError(
                f"{export_dir / 'manifest.json'} records no {precision} TensorRT engines (built: {sorted(built) or 'none'}); "
                f"run `python -m export.tensorrt --model {export_dir} --precision {precision}`"
            )
        trt = import_tensorrt()
        trt_logger = TrtLogger.create(trt)
        runtime = trt.Runtime(trt_logger)
        engines = {}
        for graph in ("encoder", "decoder_step"):
            entry = built[precision]["engines"][graph]
            data = (export_dir / entry["file"]).read_bytes()
            if verify and hashlib.sha256(data).hexdigest() != entry["sha256"]:
                raise RuntimeError(
                    f"{export_dir / entry['file']} does not match the sha256 in the manifest "
                    "(a build was interrupted, or the file was replaced); rebuild the engines"
                )
            engine = runtime.deserialize_cuda_engine(data)
            if engine is None:
                raise RuntimeError(
                    f"TensorRT could not deserialize {entry['file']} (built with TensorRT "
                    f"{built[precision].get('tensorrt_version')} on {built[precision].get('device')}; "
                    f"this is TensorRT {trt.__version__}: engines are tied to both)"
                )
            engines[graph] = engine
        config = manifest.get("model_config") or {}
        runner = cls(
            engines["encoder"],
            engines["decoder_step"],
            max_positions=manifest_max_positions(manifest),
            src_vocab_size=config.get("src_vocab_size"),
            config=config,
            config_file=str(export_dir / MANIFEST_NAME),
            precision=precision,
            device=device,
        )
        runner._runtime = runtime  # keep the runtime alive as long as its engines
        return runner

    @property
    def select(self):
        """:meth:`DeviceRunner.select`, or None when the decoder profile's minimum batch exceeds
        one row (a state of fewer rows would not fit it: the searches then feed finished rows)."""
        return None if self._min_rows > 1 else super().select

    # ---------------------------------------------------------------- binding

    def _bind(
        self,
        context: Any,
        io: Mapping[str, Mapping[str, Any]],
        bindings: Mapping[str, torch.Tensor],
        what: str,
    ) -> None:
        missing = sorted(set(io) - set(bindings))
        extra = sorted(set(bindings) - set(io))
        if missing or extra:
            raise BindingError(
                f"{what}: engine tensors without a buffer {missing}, buffers without a tensor {extra}"
            )
        for name, t in bindings.items():
            want = io[name]["dtype"]
            if _dtype_name(t.dtype) != want:
                raise BindingError(
                    f"{what}: {name} is {want} in the engine, the buffer is {_dtype_name(t.dtype)}"
                )
            if t.device != self.device or not t.is_contiguous():
                raise BindingError(f"{what}: {name} must be a contiguous tensor on {self.device}")
        for name, t in bindings.items():
            if io[name]["mode"] == "input" and not context.set_input_shape(name, tuple(t.shape)):
                raise BindingError(
                    f"{what}: shape {tuple(t.shape)} of {name} is outside the engine's profile"
                )
        for name, t in bindings.items():
            if not context.set_tensor_address(name, t.data_ptr()):
                raise BindingError(f"{what}: TensorRT refused the address of {name}")
        for name, t in bindings.items():
            if io[name]["mode"] == "output":
                shape = tuple(int(d) for d in context.get_tensor_shape(name))
                if shape != tuple(t.shape):
                    raise BindingError(
                        f"{what}: the engine computes {name} as {shape}, the buffer is {tuple(t.shape)}"
                    )

    def _execute(self, context: Any, what: str) -> None:
        if not context.execute_async_v3(self.stream_handle):
            raise RuntimeError(f"TensorRT failed to enqueue the {what} (see TensorRT's log)")

    def _run_encoder(self, bindings: Mapping[str, torch.Tensor]) -> None:
        self._bind(self.encoder_context, self.encoder_io, bindings, "encoder")
        self._execute(self.encoder_context, "encoder")

    def _run_decoder(self, state: DeviceState) -> None:
        token = state.backend.setdefault("tensorrt_token", object())
        if self._bound_token is not token:  # addresses and shapes are set once per decoding
            self._bind(
                self.decoder_context,
                self.decoder_io,
                decoder_bindings(state, self.info.flavour, self.decoder_io),
                "decoder",
            )
            self._bound_token = token
        self._execute(self.decoder_context, "decoder step")
