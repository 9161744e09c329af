"""ONNX Runtime on the GPU: the CUDA execution provider with every buffer bound on the device.

:class:`~transformer_ext.runtimes.ort.OrtRunner` keeps its buffers in host memory (it must work
with only numpy and onnxruntime installed); with the CUDA provider ONNX Runtime would then copy
every cache to the device and back at every step. :class:`OrtCudaRunner` is the device path: the same
export folder, the same runner protocol, but every buffer (token ids, positions, caches, cross
K/V, logits, new K/V) is a torch CUDA tensor bound by pointer through IO binding::

    binding.bind_input(name, "cuda", device_id, element_type, shape, tensor.data_ptr())

so a step copies only the token ids in and the logits out. Buffers, stream order and cache
writes are those of the GPU runners' base (:class:`~transformer_ext.runtimes.device.DeviceRunner`):
the new K/V are appended in place with ``transformer_ext.ops.kv_cache_append_``, beams reordered with
``kv_cache_reorder_``, on the runner's CUDA stream, which ONNX Runtime also computes on
(provider option ``user_compute_stream``). The ``tensorscatter`` flavour binds each cache as both
``self_key.{i}`` and ``present_key.{i}``, so ONNX Runtime's ``TensorScatter`` updates it in place.

Needs torch with this project's compiled ops and ``onnxruntime-gpu`` (never installed together
with ``onnxruntime``: they overwrite each other; extra ``transformer_ext[onnx-gpu]``). With
``device="cpu"`` it runs on the CPU provider with the same bindings (how it is tested here).

Precision: ``fp32`` runs ``encoder.onnx`` / ``decoder_step.onnx``; ``fp16`` runs the converted
graphs ``python -m export.tensorrt --precision fp16`` writes (``encoder.fp16.onnx``...), or
converts them in memory (:func:`transformer_ext.precision.convert_precision`, the conversion the
builder uses) when they are absent.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import numpy as np
import onnxruntime as ort
import torch

from transformer_ext.export_format import (
    CUSTOM_OP_FLAVOUR,
    CUSTOM_OP_REFUSAL,
    DECODER_FILE,
    DTYPES,
    ENCODER_FILE,
    MANIFEST_NAME,
    InvalidGraphError,
    ManifestError,
    dtype_from_ort,
    io_problems,
    manifest_max_cache_len,
    manifest_quantization,
    read_manifest,
    verify_weights,
)

from .device import (
    TORCH_DTYPES,
    BindingError,
    DeviceRunner,
    DeviceState,
    _dtype_name,
    decoder_bindings,
)
from .info import RunnerInfo
from .ort import GRAPH_OPTIMIZATION_LEVELS, _io

logger = logging.getLogger(__name__)

__all__ = ["OrtCudaRunner", "ORT_TYPES", "ort_element_type", "session_io"]

ORT_FLAVOUR_DEVICE_REFUSAL = (
    "{folder} is an export of the ort flavour (ONNX Runtime's CPU contrib operator GroupQueryAttention, "
    "float32), which runs on the CPU only: use OrtRunner, or export with --flavour portable or tensorscatter "
    "for the device runner"
)

# ONNX Runtime type strings -> our dtype names (a view of export_format.DTYPES).
ORT_TYPES = {d.ort: d.name for d in DTYPES.values()}


def ort_element_type(dtype: torch.dtype):
    """The ``element_type`` IO binding takes for a torch dtype: the numpy type, or the ONNX
    element type for bfloat16 (numpy has none)."""
    name = _dtype_name(dtype)
    return DTYPES[name].onnx if name == "bfloat16" else np.dtype(name).type


def session_io(session: Any) -> dict[str, dict[str, Any]]:
    """``{name: {"mode", "dtype", "shape"}}`` of a session's inputs and outputs."""
    out = {}
    for mode, values in (("input", session.get_inputs()), ("output", session.get_outputs())):
        for v in values:
            out[v.name] = {
                "mode": mode,
                "dtype": dtype_from_ort(v.type),
                "shape": [d if isinstance(d, int) else str(d) for d in v.shape],
            }
    return out


def _graph_source(export_dir: Path, filename: str, precision: str) -> Union[str, bytes]:
    """The path (fp32, or a converted graph on disk) or serialized bytes (converted in memory)."""
    if precision == "fp32":
        return os.fspath(export_dir / filename)
    stem = filename[: -len(".onnx")]
    converted = export_dir / f"{stem}.{precision}.onnx"
    if converted.is_file():
        return os.fspath(converted)
    import onnx

    from transformer_ext.precision import convert_precision

    logger.info("%s not found: converting %s to %s in memory", converted.name, filename, precision)
    return convert_precision(onnx.load(os.fspath(export_dir / filename)), precision).SerializeToString()


class OrtCudaRunner(DeviceRunner):
    """ONNX Runtime runner with device-resident buffers (CUDA provider + IO binding).

    Args:
        export_dir: a folder written by ``python -m export.onnx``.
        precision: ``"fp32"`` or ``"fp16"`` (``"bf16"`` needs an ONNX Runtime build with bfloat16
            kernels for every op; the CPU and CUDA providers lack some).
        device: ``"cuda"`` / ``"cuda:N"``; ``"cpu"`` runs the CPU provider with the same bindings.
        stream: the torch CUDA stream to run on (default: a new one).
        graph_optimization_level, intra_op_num_threads: session options (see ``OrtRunner``).
        provider_options: extra options of the CUDA provider.
        session_factory: ``(model path or bytes, SessionOptions, providers) -> session``;
            default ``onnxruntime.InferenceSession`` (tests pass stand-ins that record calls).
        manifest: the folder's manifest, when the caller has read it already; else it is read here.

    ``info`` (:class:`~transformer_ext.runtimes.info.RunnerInfo`) describes the model, the
    export's cache capacity, the precision run and the flavour.
    """

    def __init__(
        self,
        export_dir: Union[str, os.PathLike],
        *,
        precision: str = "fp32",
        device: Union[str, torch.device] = "cuda",
        stream: Optional[Any] = None,
        graph_optimization_level: str = "all",
        intra_op_num_threads: Optional[int] = None,
        provider_options: Optional[Mapping[str, Any]] = None,
        session_factory: Optional[Callable[..., Any]] = None,
        manifest: Optional[Mapping[str, Any]] = None,
    ):
        super().__init__(device, stream)
        if precision not in ("fp32", "fp16", "bf16"):
            raise ValueError(f"precision must be fp32, fp16 or bf16, got {precision!r}")
        self.export_dir = Path(export_dir)
        self.manifest = dict(read_manifest(self.export_dir) if manifest is None else manifest)
        verify_weights(self.export_dir, self.manifest)  # the shared weights file, before any session
        self._graph_precision = precision  # which graphs run: encoder.onnx or encoder.<precision>.onnx
        if self.manifest.get("flavour") == "ort":
            raise ValueError(ORT_FLAVOUR_DEVICE_REFUSAL.format(folder=self.export_dir))
        if self.manifest.get("flavour") == CUSTOM_OP_FLAVOUR:
            raise ValueError(CUSTOM_OP_REFUSAL.format(folder=self.export_dir, what="the device runner"))
        quantization = manifest_quantization(self.manifest)
        self.info = RunnerInfo.from_config(
            self.manifest["model_config"],
            runtime="onnxruntime",
            config_file=os.fspath(self.export_dir / MANIFEST_NAME),
            max_cache_len=manifest_max_cache_len(self.manifest),
            precision=quantization["scheme"] if quantization and precision == "fp32" else precision,
            flavour=self.manifest["flavour"],
        )

        options = ort.SessionOptions()
        if graph_optimization_level not in GRAPH_OPTIMIZATION_LEVELS:
            raise ValueError(
                f"graph_optimization_level must be one of {sorted(GRAPH_OPTIMIZATION_LEVELS)}, "
                f"got {graph_optimization_level!r}"
            )
        options.graph_optimization_level = GRAPH_OPTIMIZATION_LEVELS[graph_optimization_level]
        if intra_op_num_threads is not None:
            options.intra_op_num_threads = int(intra_op_num_threads)
        self.providers = self.provider_list(provider_options)
        factory = session_factory or (
            lambda src, opts, providers: ort.InferenceSession(src, sess_options=opts, providers=providers)
        )
        self.encoder = self._session(factory, ENCODER_FILE, options)
        self.decoder = self._session(factory, DECODER_FILE, options)
        if self.device.type == "cuda":
            used = self.decoder.get_providers()
            if not used or used[0] != "CUDAExecutionProvider":
                raise RuntimeError(
                    f"ONNX Runtime did not enable the CUDA provider (providers {used}); install onnxruntime-gpu "
                    "(not together with onnxruntime) built for this CUDA version"
                )
        self.encoder_io = session_io(self.encoder)
        self.decoder_io = session_io(self.decoder)
        self._check_io()
        self.cache_dtype = TORCH_DTYPES[self.decoder_io["self_key.0"]["dtype"]]
        self.encoder_out_dtype = TORCH_DTYPES[self.encoder_io["encoder_out"]["dtype"]]
        logger.info(
            "ONNX Runtime device runner on %s (%s, %s flavour, providers %s, cache %s)",
            self.export_dir,
            self.device,
            self.info.flavour,
            self.decoder.get_providers(),
            _dtype_name(self.cache_dtype),
        )

    def provider_list(self, provider_options: Optional[Mapping[str, Any]] = None) -> list:
        """The execution providers: CUDA on the runner's device and stream (CPU for ``device="cpu"``)."""
        if self.device.type != "cuda":
            return ["CPUExecutionProvider"]
        opts = {"device_id": int(self.device.index or 0), "user_compute_stream": str(self.stream_handle)}
        opts.update(provider_options or {})
        return [("CUDAExecutionProvider", opts), "CPUExecutionProvider"]

    def _session(self, factory, filename: str, options) -> Any:
        path = self.export_dir / filename
        if not path.is_file():
            raise InvalidGraphError(f"{path} not found (the export folder is incomplete; export it again)")
        try:
            return factory(
                _graph_source(self.export_dir, filename, self._graph_precision), options, self.providers
            )
        except Exception as exc:  # ORT raises its own Fail / InvalidGraph types
            raise InvalidGraphError(
                f"ONNX Runtime cannot load {path} ({self._graph_precision}): {exc}"
            ) from exc

    def _check_io(self) -> None:
        """Names, order and shapes against the manifest; dtypes too for fp32 (converted graphs
        differ on purpose): the one comparator of :mod:`transformer_ext.export_format`."""
        problems = []
        for graph, session in (("encoder", self.encoder), ("decoder_step", self.decoder)):
            problems += [
                f"{graph}: {p}"
                for p in io_problems(
                    self.manifest["graphs"][graph],
                    _io(session.get_inputs()),
                    _io(session.get_outputs()),
                    compare_dtypes=self._graph_precision == "fp32",
                )
            ]
        if problems:
            raise ManifestError("the graphs do not match the manifest: " + "; ".join(problems))

    # ---------------------------------------------------------------- binding

    def _bind(
        self,
        binding: Any,
        io: Mapping[str, Mapping[str, Any]],
        bindings: Mapping[str, torch.Tensor],
        what: str,
    ) -> None:
        missing = sorted(set(io) - set(bindings))
        extra = sorted(set(bindings) - set(io))
        if missing or extra:
            raise BindingError(
                f"{what}: graph tensors without a buffer {missing}, buffers without a tensor {extra}"
            )
        device_type = self.device.type
        device_id = int(self.device.index or 0)
        for name, t in bindings.items():
            if _dtype_name(t.dtype) != io[name]["dtype"]:
                raise BindingError(
                    f"{what}: {name} is {io[name]['dtype']} in the graph, the buffer is {_dtype_name(t.dtype)}"
                )
            if t.device != self.device or not t.is_contiguous():
                raise BindingError(f"{what}: {name} must be a contiguous tensor on {self.device}")
            args = (name, device_type, device_id, ort_element_type(t.dtype), list(t.shape), t.data_ptr())
            if io[name]["mode"] == "input":
                binding.bind_input(*args)
            else:
                binding.bind_output(*args)

    def _run_encoder(self, bindings: Mapping[str, torch.Tensor]) -> None:
        binding = self.encoder.io_binding()
        self._bind(binding, self.encoder_io, bindings, "encoder")
        self.encoder.run_with_iobinding(binding)

    def _run_decoder(self, state: DeviceState) -> None:
        binding = state.backend.get("ort_binding")
        if binding is None:  # bound once per decoding: every step reuses the same buffers
            binding = self.decoder.io_binding()
            self._bind(
                binding,
                self.decoder_io,
                decoder_bindings(state, self.info.flavour, self.decoder_io),
                "decoder",
            )
            state.backend["ort_binding"] = binding
        self.decoder.run_with_iobinding(binding)
