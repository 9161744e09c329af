"""Deprecated alias of :mod:`transformer_ext.runtimes.ort_cuda` (``OrtCudaRunner``); warns on import."""

from transformer_ext.runtimes import _moved, ort_cuda

_moved.alias_module(__name__, globals(), ort_cuda)
