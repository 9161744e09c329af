"""Every runner of the decoding protocol (:class:`transformer_ext.decoding.Runner`), in one place.

============================  ==========================================  ==========================
runner                        backend                                     needs
============================  ==========================================  ==========================
:class:`EagerRunner`          PyTorch with the compiled ops (the model)   torch
:class:`CatCacheRunner`       plain PyTorch, ``torch.cat`` cache          torch
                              (benchmark baseline)
:class:`OrtRunner`            ONNX Runtime, host buffers (export folder)  onnxruntime, numpy
:class:`OrtCudaRunner`        ONNX Runtime CUDA, device buffers           torch, onnxruntime-gpu
:class:`TensorRTRunner`       TensorRT engines (``export.tensorrt``)      torch, tensorrt
============================  ==========================================  ==========================

Every runner describes itself with one record, ``runner.info`` (:class:`RunnerInfo`, module
:mod:`.info`): the model's sizes and special ids, the runner's limits (positions, cache
capacity, an engine profile's batch and source ranges), its precision and graph flavour.
:func:`open_export_dir` (module :mod:`.factory`) is the one way to open an export folder: it
picks the runner for a runtime and an execution provider, and reads the manifest once.

Modules: :mod:`.eager`, :mod:`.baseline` (``CatCacheRunner``, ``greedy_decode_uncached``),
:mod:`.ort`, :mod:`.device` (``DeviceRunner``: buffers, stream order and cache writes shared by
the GPU runners), :mod:`.ort_cuda`, :mod:`.trt`, and :mod:`.kv_cache`: the self-attention cache
every cached runner keeps (``KVCache`` on torch for the eager and GPU runners, ``HostKVCache`` on
numpy for ``OrtRunner``: every layer stacked in one buffer per K / V, in-place append and
reorder, the CUDA error flag read without a per-step sync). :mod:`.pool`'s ``SourceParallel``
decodes the parts of a batch on several runners at once (data parallelism over sources), in
threads; :mod:`.procpool`'s ``ProcessSourceParallel`` in worker processes (no shared interpreter
lock), each making its runner; ``open_source_parallel`` builds either.
:mod:`.denormals` runs a call with denormal floats flushed to zero on the calling thread
(``OrtRunner`` runs its graphs so: the padding's ``-inf`` otherwise slows every padded softmax).

What every runner checks is written once in :mod:`transformer_ext.decoding`
(``check_encode_args`` / ``check_sources`` at encode, ``check_step_tokens`` at a step,
``check_beam_index`` at a reorder); what they need of the export format, of TensorRT and of
precision conversion is in :mod:`transformer_ext.export_format`,
:mod:`transformer_ext.tensorrt_support` and :mod:`transformer_ext.precision` (never ``export/``).

Every name here is imported on first use: ``import transformer_ext.runtimes`` loads nothing, and
``from transformer_ext.runtimes import OrtRunner`` loads onnxruntime and numpy, never torch, so a
deployment translates from an export folder without torch installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public name -> the submodule that defines it.
_EXPORTS = {
    "RunnerInfo": "info",
    "open_export_dir": "factory",
    "RUNTIMES": "factory",
    "RuntimeNotAvailableError": "factory",
    "RuntimeOptionError": "factory",
    "EagerRunner": "eager",
    "EagerState": "eager",
    "CompileError": "eager",
    "CatCacheRunner": "baseline",
    "CatCacheState": "baseline",
    "greedy_decode_uncached": "baseline",
    "OrtRunner": "ort",
    "OrtState": "ort",
    "OrtCudaRunner": "ort_cuda",
    "DeviceRunner": "device",
    "DeviceState": "device",
    "BindingError": "device",
    "TensorRTRunner": "trt",
    "KVCache": "kv_cache",
    "HostKVCache": "kv_cache",
    "CacheOverflowError": "kv_cache",
    "SourceParallel": "pool",
    "split_sources": "pool",
    "open_source_parallel": "pool",
    "ProcessSourceParallel": "procpool",
    "WorkerError": "procpool",
}

# Literal, so linters and IDEs see the public names; equal to _EXPORTS's keys (tests/test_runtimes.py).
__all__ = [
    "BindingError",
    "CacheOverflowError",
    "CatCacheRunner",
    "CatCacheState",
    "CompileError",
    "DeviceRunner",
    "DeviceState",
    "EagerRunner",
    "EagerState",
    "HostKVCache",
    "KVCache",
    "OrtCudaRunner",
    "OrtRunner",
    "OrtState",
    "ProcessSourceParallel",
    "RUNTIMES",
    "RunnerInfo",
    "RuntimeNotAvailableError",
    "RuntimeOptionError",
    "SourceParallel",
    "TensorRTRunner",
    "WorkerError",
    "greedy_decode_uncached",
    "open_export_dir",
    "open_source_parallel",
    "split_sources",
]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .baseline import CatCacheRunner, CatCacheState, greedy_decode_uncached
    from .device import BindingError, DeviceRunner, DeviceState
    from .eager import CompileError, EagerRunner, EagerState
    from .factory import RUNTIMES, RuntimeNotAvailableError, RuntimeOptionError, open_export_dir
    from .info import RunnerInfo
    from .kv_cache import CacheOverflowError, HostKVCache, KVCache
    from .ort import OrtRunner, OrtState
    from .ort_cuda import OrtCudaRunner
    from .pool import SourceParallel, open_source_parallel, split_sources
    from .procpool import ProcessSourceParallel, WorkerError
    from .trt import TensorRTRunner


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
