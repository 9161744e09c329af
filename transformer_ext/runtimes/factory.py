"""One way to open an export folder: :func:`open_export_dir` picks the runner for a runtime and
an execution provider, reads ``manifest.json`` once and hands it to the runner.

The policy:

* ``runtime="onnxruntime"`` (the default): the CPU provider runs :class:`~.ort.OrtRunner` (host
  buffers, needs only onnxruntime and numpy). The CUDA provider runs
  :class:`~.ort_cuda.OrtCudaRunner` (every buffer on the GPU, the caches written in place there)
  when torch is installed, sees a CUDA GPU and this package has its CUDA kernels
  (:func:`device_buffers_available`); otherwise ``OrtRunner`` with the CUDA provider (host
  buffers that ONNX Runtime copies at every step; the reason is logged), so a torch-free
  deployment with onnxruntime-gpu runs too.
* ``runtime="tensorrt"``: :class:`~.trt.TensorRTRunner` on the engines ``python -m
  export.tensorrt`` built (default precision fp32 when built, else the only one built).
* ``runtime="eager"`` runs a model folder, never an export folder.

A runtime or provider that is not installed is a :class:`RuntimeNotAvailableError` saying what
to install; an option that does not fit the runtime or the folder is a
:class:`RuntimeOptionError`. Importing this module loads neither onnxruntime nor torch.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from transformer_ext.cli import UserError
from transformer_ext.export_format import read_manifest

logger = logging.getLogger(__name__)

__all__ = [
    "RUNTIMES",
    "PROVIDER_ALIASES",
    "RuntimeNotAvailableError",
    "RuntimeOptionError",
    "open_export_dir",
    "check_open_options",
    "resolve_provider",
    "device_buffers_available",
    "import_tensorrt_runtime",
]

RUNTIMES = ("eager", "onnxruntime", "tensorrt")
# ONNX Runtime execution providers by their short names.
PROVIDER_ALIASES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "rocm": "ROCMExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "dml": "DmlExecutionProvider",
}


class RuntimeNotAvailableError(ImportError, UserError):
    """The runtime or execution provider asked for is not installed here; the message says what to install."""


class RuntimeOptionError(ValueError, UserError):
    """An option of :func:`open_export_dir` that does not fit the runtime or the export folder."""


def _import_onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise RuntimeNotAvailableError(
            f"ONNX Runtime is not installed ({exc}): `pip install onnxruntime` (or the deployment extra "
            "`pip install 'transformer_ext[deploy]'`)"
        ) from exc
    return onnxruntime


def resolve_provider(provider: Optional[str]) -> list[str]:
    """ONNX Runtime providers for a short or full provider name, checked against this installation."""
    ort = _import_onnxruntime()
    if provider is None:
        return ["CPUExecutionProvider"]
    if not isinstance(provider, str) or not provider.strip():
        raise RuntimeOptionError(f"provider must be a name such as 'cpu' or 'cuda', got {provider!r}")
    name = PROVIDER_ALIASES.get(provider.strip().lower(), provider.strip())
    available = ort.get_available_providers()
    if name not in available:
        if name == "CUDAExecutionProvider":
            hint = (
                "; install onnxruntime-gpu in place of onnxruntime (`pip uninstall onnxruntime && pip install "
                "onnxruntime-gpu`, or the extra transformer_ext[onnx-gpu])"
            )
        else:
            hint = f"; short names: {', '.join(PROVIDER_ALIASES)}"
        raise RuntimeNotAvailableError(
            f"ONNX Runtime provider {provider!r} ({name}) is not available: this onnxruntime {ort.__version__} has "
            f"{', '.join(available)}{hint}"
        )
    return [name] if name == "CPUExecutionProvider" else [name, "CPUExecutionProvider"]


def device_buffers_available() -> tuple[bool, str]:
    """Whether :class:`~transformer_ext.runtimes.ort_cuda.OrtCudaRunner` (device-resident
    buffers) can run here: torch installed, a CUDA GPU visible to it, this package's CUDA
    kernels built. ``(False, why)`` otherwise; torch is imported only when it is installed."""
    if importlib.util.find_spec("torch") is None:
        return False, "torch is not installed"
    try:
        import torch
    except ImportError as exc:  # a broken install
        return False, f"torch cannot be imported ({exc})"
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA GPU"
    try:
        from transformer_ext import ops
    except (ImportError, OSError) as exc:
        return False, f"this package's compiled ops cannot be loaded ({exc})"
    if not ops.cuda_kernels_built():
        return False, "this package was built without its CUDA kernels"
    return True, ""


def import_tensorrt_runtime() -> type:
    """The TensorRT runner class, or a RuntimeNotAvailableError that says what to install."""
    if importlib.util.find_spec("tensorrt") is None:
        raise RuntimeNotAvailableError(
            "--runtime tensorrt needs TensorRT, which is not installed: on a machine with an NVIDIA GPU "
            "`pip install tensorrt-cu13` (CUDA 13; tensorrt-cu12 for CUDA 12) or "
            "`pip install 'transformer_ext[tensorrt]'`, plus torch with this package's CUDA kernels; "
            "then build the engines with `python -m export.tensorrt --model EXPORT_DIR`"
        )
    try:
        from .trt import TensorRTRunner
    except ImportError as exc:
        raise RuntimeNotAvailableError(
            f"the TensorRT runtime needs torch and this package's compiled ops ({exc}); install transformer_ext "
            "with torch (not the TRANSFORMER_EXT_DEPLOY=1 deployment install)"
        ) from exc
    return TensorRTRunner


def check_open_options(
    path: Union[str, os.PathLike], runtime: Optional[str], threads: Any
) -> tuple[str, Optional[int]]:
    """``(runtime, threads)`` of :func:`open_export_dir` checked before anything is read:
    ``runtime`` one of :data:`RUNTIMES` but not ``"eager"`` (default ``"onnxruntime"``),
    ``threads`` a positive int or ``None``. RuntimeOptionError otherwise."""
    runtime = "onnxruntime" if runtime is None else runtime
    if runtime not in RUNTIMES:
        raise RuntimeOptionError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
    if runtime == "eager":
        raise RuntimeOptionError(
            f"{path} is an export folder: it holds ONNX graphs, not PyTorch weights; use "
            "runtime='onnxruntime' or 'tensorrt', or the model folder with the eager runtime"
        )
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise RuntimeOptionError(f"threads must be a positive integer, got {threads!r}")
    return runtime, None if threads is None else int(threads)


def open_export_dir(
    path: Union[str, os.PathLike],
    runtime: Optional[str] = None,
    provider: Optional[str] = None,
    threads: Optional[int] = None,
    *,
    precision: Optional[str] = None,
    manifest: Optional[Mapping[str, Any]] = None,
):
    """The runner of an export folder (see the module docstring for which one).

    ``runtime``: ``"onnxruntime"`` (default) or ``"tensorrt"``; ``provider``: the ONNX Runtime
    execution provider (``"cpu"``, default; ``"cuda"``, or a full name such as
    ``"CUDAExecutionProvider"``); ``threads``: ONNX Runtime's intra-op threads; ``precision``:
    the TensorRT engines to run. ``manifest``: the folder's manifest when the caller has read it
    already (:func:`transformer_ext.export_format.read_manifest`), else it is read here.

    Raises:
        RuntimeOptionError: an unknown runtime, the eager runtime, an option of another runtime,
            no TensorRT engines built.
        RuntimeNotAvailableError: ONNX Runtime, the provider, or TensorRT is not installed.
        ManifestError, InvalidGraphError: the folder is not a valid export folder.
    """
    runtime, threads = check_open_options(path, runtime, threads)
    export_dir = Path(path)
    manifest = dict(read_manifest(export_dir) if manifest is None else manifest)
    if runtime == "onnxruntime":
        if precision not in (None, "fp32"):
            raise RuntimeOptionError(
                f"precision {precision!r} applies to the TensorRT runtime; ONNX Runtime runs the fp32 graphs"
            )
        providers = resolve_provider(provider)
        device_buffers, why = (
            device_buffers_available() if providers[0] == "CUDAExecutionProvider" else (False, "")
        )
        if device_buffers:
            from . import ort_cuda

            logger.info("CUDA provider with device-resident buffers (OrtCudaRunner)")
            return ort_cuda.OrtCudaRunner(
                export_dir, manifest=manifest, device="cuda", intra_op_num_threads=threads
            )
        from . import ort

        if why:
            logger.info("CUDA provider on host buffers (OrtRunner): %s, so OrtCudaRunner cannot run", why)
        return ort.OrtRunner(export_dir, manifest=manifest, providers=providers, intra_op_num_threads=threads)
    if provider is not None or threads is not None:
        raise RuntimeOptionError(
            "provider and threads are ONNX Runtime options; the TensorRT runtime takes neither"
        )
    TensorRTRunner = import_tensorrt_runtime()
    built = sorted(((manifest.get("tensorrt") or {}).get("engines") or {}))
    if not built:
        raise RuntimeOptionError(
            f"{export_dir} has no TensorRT engines: build them with "
            f"`python -m export.tensorrt --model {export_dir}` (or use the onnxruntime runtime)"
        )
    if precision is None:
        precision = "fp32" if "fp32" in built or len(built) != 1 else built[0]
    return TensorRTRunner.from_export_dir(export_dir, precision, manifest=manifest)
