"""T5's relative position bias in the exported graphs: a bucket table read per step.

The eager model (:class:`transformer_ext.model.RelativePositionBias`) buckets every key-minus-query
distance with :func:`transformer_ext.model.relative_position_bucket` (a float32 logarithm,
truncated) and looks the bucket's per-head bias up. The graphs do not recompute that function:
the bucket of every distance a graph can meet, ``-(max_len - 1) .. max_len - 1``, is computed
here by that same PyTorch function before tracing and stored as a constant int64 index
``[2 * max_len - 1]``. The traced code then gathers the learned bias through it (one ``Gather``
of the ``[buckets, heads]`` weight, which the exporter folds into a ``[2 * max_len - 1, heads]``
table) and reads that table at ``key - query + max_len - 1``:

* the encoder: a ``[1, H, S, S]`` bias from ``Range(S)`` (every layer shares it; UMT5 gathers
  from its own layer's table with the same indices);
* the decoder step: row ``b``'s bias over cache entries ``j < cache_len`` at ``j - positions[b]``
  and over the new key at 0, ``[B, H, 1, cache_len + 1]``, read from the table inside the
  decode-attention lowering (:class:`StepBias`, :func:`export.lowering.decode_attention_tabled`)
  and added to the scores.

So a graph holds no transcendental bucket arithmetic whose last bit ONNX Runtime or TensorRT
could compute differently from PyTorch (a distance on a bucket boundary, such as 16 with the
default 32 buckets and max distance 128, would otherwise depend on ``log``'s rounding), and a
step costs one ``Sub``, one ``Add`` and one ``Gather`` per distinct table instead of the bucket
function's dozen ops over ``[B, cache_len]``. ``benchmarks/probes/probe_position_bias.py``
measures both forms. The index has ``2 * max_len - 1`` entries (8 KiB at ``max_len`` 512).

Parity stays proven against the eager bucket function: :func:`tabled_relative_bias` replaces the
bias modules' methods only while a graph is traced, and validation runs the untouched model.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from transformer_ext.model import RelativePositionBias

__all__ = [
    "StepBias",
    "bias_modules",
    "relative_buckets",
    "bucket_index",
    "tabled_relative_bias",
    "flavour_problems",
]


def bias_modules(model) -> list[RelativePositionBias]:
    """Every relative position bias module of ``model`` (the stacks' shared ones, or one per layer)."""
    return [m for m in model.modules() if isinstance(m, RelativePositionBias)]


def relative_buckets(module: RelativePositionBias, max_len: int) -> torch.Tensor:
    """The bucket of every relative position ``-(max_len - 1) .. max_len - 1`` (key minus query)
    of ``module``'s direction, computed by the eager bucket function: int64 ``[2 * max_len - 1]``,
    entry ``r + max_len - 1`` for relative position ``r``."""
    from transformer_ext import model as model_module

    relative = torch.arange(-(max_len - 1), max_len, dtype=torch.int64)
    return model_module.relative_position_bucket(
        relative, module.bidirectional, module.num_buckets, module.max_distance
    )


def bucket_index(model, bidirectional: bool) -> Optional[torch.Tensor]:
    """The :func:`relative_buckets` of ``model``'s bias modules of one direction (the encoder's:
    bidirectional; the decoder's: causal), or None when it has none. Every module of one
    direction has the same bucket count and distance, so one index serves them all."""
    modules = [m for m in bias_modules(model) if m.bidirectional == bidirectional]
    if not modules:
        return None
    return relative_buckets(modules[0], model.config.max_len)


def _table(module: RelativePositionBias, buckets: torch.Tensor) -> torch.Tensor:
    """``[2 * max_len - 1, H]``: the module's learned bias at each relative position."""
    return F.embedding(buckets, module.relative_attention_bias.weight)


def _tabled_forward(module: RelativePositionBias, buckets: torch.Tensor, max_len: int):
    def forward(q_len: int, k_len: int, device=None) -> torch.Tensor:
        i = torch.arange(q_len, device=buckets.device).view(q_len, 1) + (k_len - q_len)
        j = torch.arange(k_len, device=buckets.device).view(1, k_len)
        bias = F.embedding(j - i + (max_len - 1), _table(module, buckets))  # [Q, K, H]
        return bias.permute(2, 0, 1).unsqueeze(0)  # [1, H, Q, K]

    return forward


class StepBias:
    """The relative bias of one decoder step of ``positions [B]``: the module's table and where to
    read it, handed to the decode attention that adds it (:func:`export.lowering.position_bias_in_graph`).
    Its lowering (:func:`export.lowering.decode_attention_tabled`) reads row ``j - positions[b] +
    offset`` for every key ``j`` of the cache it attends and row ``offset`` (relative position 0)
    for the new token's key, taking the cache length from that cache's shape: the cache input in
    the portable flavour, the updated cache (a ``TensorScatter`` output, the new key at
    ``positions[b]``) in the tensorscatter flavour, where no other node may read a cache input."""

    def __init__(
        self, module: RelativePositionBias, buckets: torch.Tensor, max_len: int, positions: torch.Tensor
    ):
        self.module, self.buckets, self.positions = module, buckets, positions
        self.offset = max_len - 1  # the table's row of relative position 0
        self._table: Optional[torch.Tensor] = None

    def table(self) -> torch.Tensor:
        """``[2 * max_len - 1, H]``, made once per step (T5's one module serves every layer)."""
        if self._table is None:
            self._table = _table(self.module, self.buckets)
        return self._table


def _tabled_step(module: RelativePositionBias, buckets: torch.Tensor, max_len: int):
    def step(positions: torch.Tensor, cache_len: int) -> StepBias:
        return StepBias(module, buckets, max_len, positions)

    return step


@contextlib.contextmanager
def tabled_relative_bias(model, buckets: Optional[torch.Tensor], bidirectional: bool) -> Iterator[None]:
    """While inside, ``model``'s bias modules of one direction compute their bias from ``buckets``
    (:func:`bucket_index`, a buffer of the traced module, so it becomes one initializer) by table
    lookups, as the module docstring says; on exit their own methods are back. Nothing happens
    for a model without such modules (``buckets`` None)."""
    if buckets is None:
        yield
        return
    max_len = model.config.max_len
    patched = [m for m in bias_modules(model) if m.bidirectional == bidirectional]
    try:
        for m in patched:
            m.forward = _tabled_forward(m, buckets, max_len)
            m.step = _tabled_step(m, buckets, max_len)
        yield
    finally:
        for m in patched:
            m.__dict__.pop("forward", None)
            m.__dict__.pop("step", None)


def flavour_problems(config, flavour: str) -> list[str]:
    """What of ``config`` the graph ``flavour`` cannot express (empty: exportable): the ``ort``
    flavour's ``GroupQueryAttention`` takes no position bias, nor does the ``custom-op`` flavour's
    export of its ``DecodeAttention``."""
    if flavour == "ort" and config.relative_attention_buckets:
        return [
            f"relative_attention_buckets = {config.relative_attention_buckets}: ONNX Runtime's "
            "GroupQueryAttention (the ort flavour) takes no relative position bias; export with "
            "--flavour portable or tensorscatter"
        ]
    if flavour == "custom-op" and config.relative_attention_buckets:
        return [
            f"relative_attention_buckets = {config.relative_attention_buckets}: the custom-op flavour's "
            "DecodeAttention nodes are exported without a relative position bias; export with "
            "--flavour portable or tensorscatter"
        ]
    return []
