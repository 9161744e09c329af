"""Deprecated alias of :mod:`transformer_ext.runtimes.ort` (``OrtRunner``); warns on import."""

from transformer_ext.runtimes import _moved, ort

_moved.alias_module(__name__, globals(), ort)
