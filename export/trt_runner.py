"""Deprecated alias of :mod:`transformer_ext.runtimes.trt` (``TensorRTRunner``) and
:mod:`transformer_ext.runtimes.device` (``DeviceRunner`` and its buffers); warns on import."""

from transformer_ext.runtimes import _moved, device, trt

_moved.alias_module(__name__, globals(), device, trt)
