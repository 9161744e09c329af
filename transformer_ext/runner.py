"""Deprecated alias of :mod:`transformer_ext.runtimes.eager` (``EagerRunner``) and
:mod:`transformer_ext.runtimes.baseline` (``CatCacheRunner``, ``greedy_decode_uncached``);
warns on import."""

from .runtimes import _moved, baseline, eager

_moved.alias_module(__name__, globals(), eager, baseline)
