"""Proof that exported graphs match eager PyTorch (docs/DESIGN.md section 3).

Two levels, both raising typed errors that are never swallowed:

* :func:`check_graphs` (structure, no runtime): the rules of :mod:`export.contract` (the same
  code the TensorRT readiness check runs): input/output names, dtypes and named axes as in
  :func:`transformer_ext.export_format.graph_specs`; no control flow, local function, custom
  domain or zero-length dimension; in the portable flavour the caches are only read by
  ``MatMul`` (through a ``Transpose`` for keys, never a ``Concat``); in the ``tensorscatter``
  flavour only a ``TensorScatter`` with the literal ``axis=-2`` reads a cache input, in the ``ort``
  flavour only one ``GroupQueryAttention`` (its one allowed contrib operator). Also: shared
  weights stored once, ``onnx.checker``. Raises :class:`export.GraphContractError`.
* :func:`validate_export` (values, ONNX Runtime vs eager): every output of both graphs on
  shapes different from the export dummies (batch 1, 3, 8; source lengths from 1 to the
  maximum; ragged batches; ragged positions; cache entries past the prefix filled with random
  finite values, which must get zero weight), then whole greedy and beam decodes over a batch
  through :class:`transformer_ext.runtimes.OrtRunner` and :class:`transformer_ext.runtimes.EagerRunner`,
  token-identical, with the logits difference of every step. The reference is eager PyTorch in
  float64 (a float64 copy of the model; the decodes replayed on eager's tokens): each output may
  differ from it by the tolerance, or by :data:`FLOAT32_ERROR_FACTOR` times eager float32's own
  difference from it where that is larger (:func:`allowed_difference`), eager float32 measured
  twice: with its fused attention kernels and with the standard-op compositions of attention that
  the graphs compute (:func:`standard_ops_attention`), the larger counting. A value beyond that
  raises :class:`export.ParityError` naming the output, the step and the largest difference;
  decodes whose tokens part at a near tie are recorded (``near_tie``), other partings raise
  :class:`TokenFlipError`.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np
import onnx
import onnxruntime as ort
import torch

from transformer_ext import decoding, ops
from transformer_ext.export_format import ATTENTION_OUTPUT, NEW_KV_FLAVOURS, cross_per_source, graph_specs
from transformer_ext.model import MultiHeadAttention
from transformer_ext.runtimes import EagerRunner, OrtRunner

from . import GraphContractError, ParityError, contract
from .weights import PRODUCT_SUFFIX, is_product_view

logger = logging.getLogger(__name__)

__all__ = [
    "FLOAT32_ERROR_FACTOR",
    "TokenFlipError",
    "ValidationReport",
    "allowed_difference",
    "check_graphs",
    "model_tensors",
    "float64_copy",
    "standard_ops_attention",
    "standard_ops_copy",
    "validate_export",
]

_DEDUP_MIN_BYTES = 1024  # initializers smaller than this (scalars, shapes) may repeat


# ------------------------------------------------------------------------------------------
# Structure
# ------------------------------------------------------------------------------------------


def _initializer_bytes(t: onnx.TensorProto) -> int:
    itemsize = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return int(np.prod(t.dims, dtype=np.int64)) * itemsize


def _initializer_digest(t: onnx.TensorProto) -> str:
    return hashlib.sha1(onnx.numpy_helper.to_array(t).tobytes()).hexdigest()


def model_tensors(model: torch.nn.Module, prefix: str = "model.") -> dict[str, tuple]:
    """``{initializer name: identity}`` for every parameter and buffer of ``model`` under every
    name it has (tied parameters: one tensor, several names), as the exporter names them (the
    traced wrappers hold the model as ``model``). Names with one identity are one tensor."""
    tensors = {}
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for name, t in named:
        tensors[prefix + name] = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
    return tensors


def _check_one(
    graph_name: str,
    proto: onnx.ModelProto,
    spec: dict,
    flavour: str,
    tensors: Optional[dict] = None,
) -> dict:
    g = proto.graph
    problems = [p.message for p in contract.contract_problems(proto, spec, flavour)]
    op_types = sorted({n.op_type for n in g.node})

    # Shared weights stored once. With the model's tensors known (``tensors``): no two
    # initializers named after one tensor of the model (tied parameters); distinct tensors that
    # hold equal values (zero biases, unit LayerNorm gains) are distinct weights, and the shared
    # weights file stores equal bytes once anyway (export.weights). Without: no two large
    # initializers with the same bytes.
    seen: dict[Any, str] = {}
    total = 0
    for t in g.initializer:
        size = _initializer_bytes(t)
        total += size
        if tensors is not None:
            key = tensors.get(t.name)
            if key is not None and key in seen:
                problems.append(
                    f"initializers {seen[key]} and {t.name} are one tensor of the model stored twice "
                    "(tied parameters must be one initializer)"
                )
        elif size >= _DEDUP_MIN_BYTES and not is_product_view(g, t.name, t.name.removesuffix(PRODUCT_SUFFIX)):
            key = _initializer_digest(t)
            if key in seen:
                problems.append(
                    f"initializers {seen[key]} and {t.name} hold the same data (a weight stored twice)"
                )
        else:
            key = None
        if key is not None:
            seen.setdefault(key, t.name)

    if problems:
        raise GraphContractError(f"{graph_name}.onnx breaks the export contract: " + "; ".join(problems))
    return {
        "nodes": len(g.node),
        "op_types": op_types,
        "initializers": len(g.initializer),
        "initializer_bytes": total,
        "opset": {(o.domain or "ai.onnx"): int(o.version) for o in proto.opset_import},
        "ir_version": int(proto.ir_version),
    }


# Ops that pass a tensor through (a view, a cast, a copy): a weight read through them is still that weight.
_PASS_THROUGH = frozenset({"Identity", "Cast", "Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten"})


def _trace_back(name: str, producers: dict, initializers: set) -> Optional[str]:
    """The initializer that ``name`` is (through pass-through ops), or None when it is computed."""
    seen = set()
    while name not in initializers:
        node = producers.get(name)
        if node is None or node.op_type not in _PASS_THROUGH or name in seen:
            return None
        seen.add(name)
        name = node.input[0]
    return name


def _reads_input(name: str, producers: dict, graph_input: str) -> bool:
    seen = set()
    while name != graph_input:
        node = producers.get(name)
        if node is None or node.op_type not in _PASS_THROUGH or name in seen:
            return False
        seen.add(name)
        name = node.input[0]
    return True


def _check_tied_projection(graph: onnx.GraphProto) -> None:
    """The decoder's target embedding and its output projection are one initializer.

    Found by tracing, never by shape: the embedding is the table of the ``Gather`` that reads
    ``input_ids``; the projection is the weight of the ``MatMul`` / ``Gemm`` that ``logits`` comes
    from (through a bias ``Add`` and pass-through ops); each traced back through pass-through
    ops to its initializer. Other constants of the same size (feed-forward weights, the
    positional table) play no part.
    """
    producers = {out: node for node in graph.node for out in node.output}
    initializers = {t.name for t in graph.initializer}
    tables = sorted(
        {
            _trace_back(node.input[0], producers, initializers) or f"<computed {node.input[0]}>"
            for node in graph.node
            if node.op_type == "Gather" and _reads_input(node.input[1], producers, "input_ids")
        }
    )
    name, projection, seen = "logits", None, set()
    while projection is None and name not in seen:
        seen.add(name)
        node = producers.get(name)
        if node is None:
            break
        if node.op_type in ("MatMul", "Gemm"):
            weight = node.input[1]
            if node.op_type == "MatMul" and _trace_back(weight, producers, initializers) is None:
                weight = node.input[0]  # logits = W x written the other way round
            projection = _trace_back(weight, producers, initializers) or f"<computed {weight}>"
        elif node.op_type == "Add":  # the output bias: follow the operand that is not a constant
            computed = [i for i in node.input if _trace_back(i, producers, initializers) is None]
            if len(computed) != 1:
                break
            name = computed[0]
        elif node.op_type in _PASS_THROUGH:
            name = node.input[0]
        else:
            break
    what = "the tied target embedding / output projection"
    if len(tables) != 1:
        raise GraphContractError(
            f"decoder_step.onnx: {what}: expected one embedding table read by a Gather of input_ids, "
            f"found {tables or 'none'}"
        )
    if projection is None:
        raise GraphContractError(
            f"decoder_step.onnx: {what}: logits do not come from a MatMul or Gemm with a weight"
        )
    if tables[0] != projection and not is_product_view(graph, projection, tables[0]):
        raise GraphContractError(
            f"decoder_step.onnx: {what} must be stored once: the embedding table is {tables[0]} but the "
            f"projection that logits come from reads {projection}"
        )


def check_graphs(
    encoder: onnx.ModelProto,
    decoder: onnx.ModelProto,
    config,
    flavour: str,
    specs: Optional[dict] = None,
    *,
    tensors: Optional[dict] = None,
) -> dict:
    """Check both graphs against the contract; returns a summary per graph (nodes, weights...).

    Also checks that a tied target embedding / output projection is stored once in the decoder.
    ``tensors``: the exported model's tensors (:func:`model_tensors`), so that a weight stored
    twice means one tensor of the model under two initializers, never two tensors that happen to
    hold equal values; without it, two large initializers with equal bytes are refused.
    Raises :class:`GraphContractError` listing every problem.
    """
    specs = specs or graph_specs(config.to_dict(), flavour)
    summary = {
        "encoder": _check_one("encoder", encoder, specs["encoder"], flavour, tensors),
        "decoder_step": _check_one("decoder_step", decoder, specs["decoder_step"], flavour, tensors),
    }
    if config.tie_target_embeddings:
        _check_tied_projection(decoder.graph)
    for name, proto in (("encoder", encoder), ("decoder_step", decoder)):
        try:
            onnx.checker.check_model(proto, full_check=True)
        except onnx.checker.ValidationError as exc:
            raise GraphContractError(f"{name}.onnx fails onnx.checker: {exc}") from exc
    return summary


# ------------------------------------------------------------------------------------------
# Values
# ------------------------------------------------------------------------------------------


# How far the export may be from the float64 reference, in units of eager float32's own distance
# from it (the float32 rounding of this model on these inputs, which grows with the activations'
# size and the sequence length); never less than the tolerance. Eager float32 is measured with its
# fused kernels and with the standard-op compositions of attention (scores, bias, softmax, weighted
# sum: the ops the graphs hold), the larger counting: a fused kernel more accurate than those ops
# (the position-bias kernels keep T5's large unscaled scores exact to a few units in the last place)
# must not pull the bound below the rounding that ONNX Runtime's evaluation of the graph's ops has.
# A wrong graph (a weight off by 1%, a mask that lets padding in, one wrong relative-bias bucket)
# is off by orders of magnitude more.
FLOAT32_ERROR_FACTOR = 8.0
REFERENCE = "eager PyTorch in float64"


def allowed_difference(tolerance: float, float32_error: float) -> float:
    """The largest difference from the float64 reference an output may have: ``tolerance``, or
    :data:`FLOAT32_ERROR_FACTOR` times eager float32's own difference from it when that is larger
    (``float32_error``: the larger of eager's with its kernels and with the standard-op attention)."""
    return max(float(tolerance), FLOAT32_ERROR_FACTOR * float(float32_error))


def standard_ops_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` (its dtype and device) whose attention runs the standard-op compositions
    instead of the fused kernels (``MultiHeadAttention.fused_attention`` False: the three-step
    whole-sequence path and :func:`transformer_ext.reference.decode_attention` in decoder steps):
    eager float32 computing attention as the exported graphs do. :func:`standard_ops_attention`
    does the same on ``model`` itself, without a copy."""
    copied = copy.deepcopy(model)
    for m in copied.modules():
        if isinstance(m, MultiHeadAttention):
            m.fused_attention = False
    return copied.eval()


_UNSET = object()


@contextlib.contextmanager
def standard_ops_attention(model: torch.nn.Module):
    """Inside the context every attention of ``model`` runs the standard-op compositions (as in
    :func:`standard_ops_copy`, on the model itself: no copy of its weights); on exit each
    attention module is as it was."""
    saved = [
        (m, m.__dict__.get("fused_attention", _UNSET))
        for m in model.modules()
        if isinstance(m, MultiHeadAttention)
    ]
    try:
        for m, _ in saved:
            m.fused_attention = False
        yield model
    finally:
        for m, value in saved:
            if value is _UNSET:
                m.__dict__.pop("fused_attention", None)  # back to the class's default
            else:
                m.fused_attention = value


class _StandardOps:
    """``model`` with :func:`standard_ops_attention` around each ``encode`` / ``decode_step``: what
    the checks of single graph runs call (every other attribute is the model's)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __getattr__(self, name):
        return getattr(self.model, name)

    def encode(self, *args, **kwargs):
        with standard_ops_attention(self.model):
            return self.model.encode(*args, **kwargs)

    def decode_step(self, *args, **kwargs):
        with standard_ops_attention(self.model):
            return self.model.decode_step(*args, **kwargs)


class _StandardOpsRunner:
    """A runner of the validated model whose every call runs inside :func:`standard_ops_attention`:
    whole decodes with the standard-op attention, on the model's own weights."""

    def __init__(self, runner, model: torch.nn.Module):
        self.runner, self.model = runner, model

    def encode(self, *args, **kwargs):
        with standard_ops_attention(self.model):
            return self.runner.encode(*args, **kwargs)

    def step(self, state, tokens):
        with standard_ops_attention(self.model):
            return self.runner.step(state, tokens)

    def reorder(self, state, beam_index):
        with standard_ops_attention(self.model):
            self.runner.reorder(state, beam_index)


def float64_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of ``model`` on the CPU, made tensor by tensor (no intermediate float32 copy
    of the whole model): the validation's reference. Tied weights stay tied."""
    memo: dict = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in memo:
            continue
        dtype = torch.float64 if t.is_floating_point() else t.dtype
        value = t.detach().to("cpu", dtype, copy=True)
        memo[id(t)] = (
            torch.nn.Parameter(value, t.requires_grad) if isinstance(t, torch.nn.Parameter) else value
        )
    return copy.deepcopy(model, memo).to("cpu", torch.float64)  # any other floating tensor too


def _standard_ops_model(model: torch.nn.Module):
    """What the checks call for the standard-op attention: ``model`` itself under
    :func:`standard_ops_attention` when it is float32 on the CPU, else a float32 CPU copy."""
    if all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters()):
        return _StandardOps(model)
    return standard_ops_copy(model).to("cpu", torch.float32)


def _standard_runner(standard) -> Any:
    """The runner of whole decodes with the standard-op attention (see :func:`_standard_ops_model`)."""
    if isinstance(standard, _StandardOps):
        return _StandardOpsRunner(EagerRunner(standard.model, "cpu"), standard.model)
    return EagerRunner(standard, "cpu")


@dataclass
class ValidationReport:
    """What :func:`validate_export` measured (all differences are max absolute differences).

    ``max_abs_diff``: per ``graph/output``, the export's worst difference from the float64 eager
    reference over all cases; ``float32_error``: eager float32's own worst difference from it (the
    larger of eager with its kernels and with the standard-op attention, :func:`standard_ops_copy`);
    ``standard_ops_error``: that of the standard-op attention alone; ``allowed``: the bound each output was held to (:func:`allowed_difference`). The decodes'
    per-step logits are compared with eager float32 (same tokens fed), within ``greedy`` /
    ``beam`` ``["allowed"]``; a decode whose tokens part at a near tie records it as ``near_tie``.
    """

    tolerance: float
    max_abs_diff: dict = field(default_factory=dict)  # "graph/output" -> worst over all cases
    cases: list = field(default_factory=list)  # the shapes tried
    greedy: dict = field(default_factory=dict)
    beam: dict = field(default_factory=dict)
    float32_error: dict = field(default_factory=dict)  # "graph/output" -> eager float32 vs float64
    allowed: dict = field(default_factory=dict)  # "graph/output" -> the bound it was held to
    standard_ops_error: dict = field(default_factory=dict)  # "graph/output" -> standard-op attention
    reference: str = REFERENCE

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def widened(self) -> bool:
        """Whether some output was held to more than the tolerance (float32 rounding above it)."""
        return any(a > self.tolerance for a in self.allowed.values())

    def parity_text(self) -> str:
        """One phrase: the bound every output met and what the decodes gave (the export's verdict)."""
        if self.widened:
            key = max(self.allowed, key=self.allowed.get)
            bound = (
                f"within {self.tolerance:.0e} of PyTorch or {FLOAT32_ERROR_FACTOR:g}x eager float32's own "
                f"rounding error against float64 (with its kernels or the graphs' standard-op attention, the "
                f"larger; worst {self.worst:.1e}; largest bound {self.allowed[key]:.1e}, {key})"
            )
        else:
            bound = f"within {self.tolerance:.0e} of PyTorch (worst {self.worst:.1e})"
        ties = [
            (name, d["near_tie"])
            for name, d in (("greedy", self.greedy), ("beam", self.beam))
            if d.get("near_tie")
        ]
        if not ties:
            return f"{bound}, greedy and beam tokens identical"
        said = "; ".join(f"{name} tokens part at a near tie ({tie['what']})" for name, tie in ties)
        return f"{bound}; {said}"

    @property
    def worst(self) -> float:
        values = (
            list(self.max_abs_diff.values())
            + list(self.greedy.get("logits_max_diff_per_step", []))
            + list(self.beam.get("logits_max_diff_per_step", []))
        )
        return float(max(values)) if values else 0.0

    def table(self) -> str:
        """A human-readable parity table."""
        lines = [
            f"parity with {self.reference}: max |onnxruntime - float64| per output, allowed: the tolerance "
            f"{self.tolerance:.0e} or {FLOAT32_ERROR_FACTOR:g}x eager float32's own max |float32 - float64| "
            "(with its kernels or the standard-op attention, the larger)",
            f"  {'graph':<15}{'output':<20}{'max diff':>10}{'float32':>10}{'allowed':>10}  status",
        ]
        for key, diff in self.max_abs_diff.items():
            graph, output = key.split("/", 1)
            allowed = self.allowed.get(key, self.tolerance)
            status = "ok" if diff <= allowed else "FAIL"
            f32 = self.float32_error.get(key, 0.0)
            lines.append(f"  {graph:<15}{output:<20}{diff:>10.2e}{f32:>10.2e}{allowed:>10.2e}  {status}")
        for name, d in (("greedy", self.greedy), ("beam", self.beam)):
            if not d:
                continue
            per_step = d["logits_max_diff_per_step"]
            worst_step = int(np.argmax(per_step)) if per_step else -1
            what = f"beam {d['beam_size']}, " if name == "beam" else ""
            tokens = "identical" if d["tokens_identical"] else "near tie" if d.get("near_tie") else "DIFFER"
            lines.append(
                f"  {name + ' decode':<15}{'tokens':<20}{tokens:>10}  "
                f"({what}{d['batch']} sources, {d['steps']} steps, {d['tokens_generated']} tokens)"
            )
            if d.get("near_tie"):
                lines.append(f"  {'':<15}{'':<20}{'':>10}  {d['near_tie']['what']}")
            lines.append(
                f"  {'':<15}{'logits per step':<20}{max(per_step) if per_step else 0.0:>10.2e}  "
                f"(vs eager float32, allowed {d.get('allowed', self.tolerance):.1e}) worst at step {worst_step}; per step: "
                + " ".join(f"{x:.1e}" for x in per_step[:10])
                + (" ..." if len(per_step) > 10 else "")
            )
        lines.append("  shapes tried:")
        lines += [f"    {c['case']}" for c in self.cases]
        return "\n".join(lines)


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return float("inf")
    if a.size == 0:
        return 0.0
    diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return float(np.nan_to_num(diff, nan=np.inf).max())


def _record(
    report: ValidationReport,
    graph: str,
    output: str,
    onnx_value: np.ndarray,
    eager_value: np.ndarray,
    case: str,
    step: Optional[int] = None,
    reference: Optional[np.ndarray] = None,
    standard: Optional[np.ndarray] = None,
) -> None:
    """Check one output: ``onnx_value`` against the float64 ``reference`` within
    :func:`allowed_difference` of eager float32's own error, the larger of ``eager_value``'s (the
    kernels) and ``standard``'s (the standard-op attention, when given); without a reference,
    against ``eager_value`` within the tolerance."""
    if onnx_value.shape != eager_value.shape:
        raise ParityError(
            f"{graph}/{output}",
            step,
            float("inf"),
            report.tolerance,
            f"{case}: shape {onnx_value.shape} != eager {eager_value.shape}",
        )
    key = f"{graph}/{output}"
    if reference is None:
        diff, allowed = _max_diff(onnx_value, eager_value), report.tolerance
    else:
        float32_error = _max_diff(eager_value, reference)
        if standard is not None:
            standard_error = _max_diff(standard, reference)
            report.standard_ops_error[key] = max(report.standard_ops_error.get(key, 0.0), standard_error)
            float32_error = max(float32_error, standard_error)
        report.float32_error[key] = max(report.float32_error.get(key, 0.0), float32_error)
        diff, allowed = _max_diff(onnx_value, reference), allowed_difference(report.tolerance, float32_error)
    report.max_abs_diff[key] = max(report.max_abs_diff.get(key, 0.0), diff)
    report.allowed[key] = max(report.allowed.get(key, 0.0), allowed)
    if not diff <= allowed:
        what = (
            case
            if allowed == report.tolerance
            else (
                f"{case}; allowed {allowed:.3g} = {FLOAT32_ERROR_FACTOR:g}x eager float32's own difference from "
                "float64 (with its kernels or the standard-op attention, the larger), which is above the "
                "tolerance"
            )
        )
        raise ParityError(key, step, diff, allowed, what)


def _ragged_lengths(rng: np.random.Generator, batch: int, src_len: int) -> np.ndarray:
    lengths = rng.integers(1, src_len + 1, size=batch)
    lengths[0] = src_len  # the longest row fills the padded length
    if batch > 1:
        lengths[-1] = 1  # and the shortest is a single token
    return lengths.astype(np.int64)


def _source_ids(rng: np.random.Generator, config, lengths: np.ndarray, src_len: int) -> np.ndarray:
    low = 4 if config.src_vocab_size > 4 else 0
    ids = rng.integers(low, config.src_vocab_size, size=(len(lengths), src_len)).astype(np.int64)
    for row, n in enumerate(lengths):
        ids[row, n:] = config.pad_id
    return ids


def _encoder_cases(config) -> list[tuple[int, int]]:
    """(batch, padded source length): batch 1, 3, 8; lengths 1, the maximum, and one between."""
    max_len = config.max_len
    mid = max(1, min(max_len, 11))
    return [(1, 1), (3, max_len), (8, mid), (1, max_len)]


def _decoder_cases(config, max_cache_len: int) -> list[tuple[int, int, int, int]]:
    """(rows, sources, padded source length, cache length): one row per source, and a source's
    K/V serving 4 rows (beams) at 2 sources and at 1."""
    max_len = config.max_len
    mid_src = max(1, min(max_len, 9))
    mid_cache = max(1, min(max_cache_len, 13))
    return [
        (1, 1, 1, 1),
        (3, 3, max_len, max_cache_len),
        (8, 2, mid_src, mid_cache),
        (4, 1, mid_src, max_cache_len),
    ]


def _check_encoder(report, runner: OrtRunner, model, rng, model64=None, standard=None) -> None:
    config = model.config
    names = [o["name"] for o in runner.manifest["graphs"]["encoder"]["outputs"]]
    for batch, src_len in _encoder_cases(config):
        lengths = _ragged_lengths(rng, batch, src_len)
        ids = _source_ids(rng, config, lengths, src_len)
        case = f"encoder batch {batch} src_len {src_len} lengths {_short(lengths)}"
        onnx_out = runner.encoder.run(names, {"input_ids": ids, "src_lengths": lengths})
        references: list = [None] * len(names)
        standards: list = [None] * len(names)
        with torch.inference_mode():
            enc, ks, vs = model.encode(torch.from_numpy(ids), torch.from_numpy(lengths))
            if model64 is not None:
                enc64, ks64, vs64 = model64.encode(torch.from_numpy(ids), torch.from_numpy(lengths))
                references = [enc64.numpy()] + [t.numpy() for kv in zip(ks64, vs64) for t in kv]
            if standard is not None:
                enc_s, ks_s, vs_s = standard.encode(torch.from_numpy(ids), torch.from_numpy(lengths))
                standards = [enc_s.numpy()] + [t.numpy() for kv in zip(ks_s, vs_s) for t in kv]
        eager = [enc] + [t for kv in zip(ks, vs) for t in kv]
        for name, a, b, r, s in zip(names, onnx_out, eager, references, standards):
            _record(report, "encoder", name, a, b.numpy(), case, reference=r, standard=s)
        report.cases.append({"graph": "encoder", "batch": batch, "src_len": src_len, "case": case})


def _run_in_place(session, feeds: dict, out_names: list[str]) -> list[np.ndarray]:
    """One run with every ``present_*`` output bound to the buffer of its ``self_*`` input, as
    :class:`OrtRunner` binds them: the ``ort`` flavour's ``GroupQueryAttention`` then writes the
    new K/V in place and leaves the rest of each cache as it was (with separate buffers it writes
    only each row's prefix). The caches are copies; ``feeds`` is not modified."""
    binding = session.io_binding()
    arrays = {}
    for name, value in feeds.items():
        a = arrays[name] = np.array(value, order="C", copy=True)
        binding.bind_input(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
    for name in out_names:
        if name.startswith("present_"):
            a = arrays["self_" + name[len("present_") :]]
            binding.bind_output(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
        else:
            binding.bind_output(name, "cpu")
    session.run_with_iobinding(binding)
    outputs = binding.get_outputs()
    return [
        arrays["self_" + name[len("present_") :]] if name.startswith("present_") else out.numpy()
        for name, out in zip(out_names, outputs)
    ]


def _eager_decode_step(model, t: dict, n: int, beams: int, flavour: str, attention: bool) -> list:
    """Eager ``decode_step`` on the feeds ``t`` (tensors of the model's dtype): the outputs in the
    graph's order (the portable flavour's new K/V, else the caches after the in-place append)."""
    t = dict(t)
    # The eager reference: the fused decode_attention over the cross K/V repeated per row.
    for i in range(n):
        for kind in ("key", "value"):
            t[f"cross_{kind}.{i}"] = t[f"cross_{kind}.{i}"].repeat_interleave(beams, dim=0)
    self_keys = [t[f"self_key.{i}"] for i in range(n)]
    self_values = [t[f"self_value.{i}"] for i in range(n)]
    with torch.inference_mode():
        logits, new_keys, new_values, *weights = model.decode_step(
            t["input_ids"],
            t["positions"],
            t["src_lengths"],
            self_keys,
            self_values,
            [t[f"cross_key.{i}"] for i in range(n)],
            [t[f"cross_value.{i}"] for i in range(n)],
            return_attention=attention,
        )
        if flavour in NEW_KV_FLAVOURS:
            eager = [logits] + [x for kv in zip(new_keys, new_values) for x in kv]
        else:  # the caches after the eager runner's in-place append
            for cache, new in zip(self_keys + self_values, new_keys + new_values):
                ops.kv_cache_append_(cache, new, t["positions"])
            eager = [logits] + [x for kv in zip(self_keys, self_values) for x in kv]
    return eager + list(weights)


def _check_decoder(
    report, runner: OrtRunner, model, rng, max_cache_len: int, model64=None, standard=None
) -> None:
    config = model.config
    n = config.n_decoder_layers
    spec = runner.manifest["graphs"]["decoder_step"]
    in_names = [t["name"] for t in spec["inputs"]]
    out_names = [t["name"] for t in spec["outputs"]]
    per_source = cross_per_source(runner.manifest["graphs"])
    for batch, sources, src_len, cache_len in _decoder_cases(config, max_cache_len):
        if not per_source:
            sources = batch
        beams = batch // sources
        source_lengths = _ragged_lengths(rng, sources, src_len)
        lengths = np.repeat(source_lengths, beams)  # the rows of a source share its length
        # Ragged positions: the first row at the last slot, the last row at 0, the rest random.
        positions = rng.integers(0, min(cache_len, config.max_len), size=batch).astype(np.int64)
        positions[0] = min(cache_len, config.max_len) - 1
        if batch > 1:
            positions[-1] = 0
        ids = rng.integers(0, config.tgt_vocab_size, size=(batch, 1)).astype(np.int64)
        self_shape = (batch, config.n_heads, cache_len, config.d_k)
        cross_shape = (sources, config.n_heads, src_len, config.d_k)
        # Random finite values everywhere, past the prefix too: those must get zero weight.
        caches = [rng.standard_normal(self_shape, dtype=np.float32) for _ in range(2 * n)]
        cross = [rng.standard_normal(cross_shape, dtype=np.float32) for _ in range(2 * n)]
        feeds = dict(zip(in_names, [ids, positions, lengths, *caches, *cross]))
        case = (
            f"decoder_step batch {batch} ({sources} sources) src_len {src_len} cache_len {cache_len} "
            f"positions {_short(positions)} src_lengths {_short(lengths)}"
        )
        if runner.info.flavour == "ort":
            onnx_out = _run_in_place(runner.decoder, feeds, out_names)
        else:
            # Without IO binding the tensorscatter graph copies each cache (ORT warns): expected here.
            quiet = ort.RunOptions()
            quiet.log_severity_level = 3
            onnx_out = runner.decoder.run(out_names, feeds, quiet)

        attention = out_names[-1] == ATTENTION_OUTPUT  # an export made with --attention
        flavour = runner.info.flavour
        t = {k: torch.from_numpy(v.copy()) for k, v in feeds.items()}
        eager = _eager_decode_step(model, t, n, beams, flavour, attention)
        if len(eager) != len(out_names):
            raise GraphContractError(
                f"decoder_step has outputs {out_names}, eager decode_step gives {len(eager)}"
            )
        references: list = [None] * len(out_names)
        if model64 is not None:
            t64 = {
                k: torch.from_numpy(v.astype(np.float64) if v.dtype == np.float32 else v.copy())
                for k, v in feeds.items()
            }
            references = [x.numpy() for x in _eager_decode_step(model64, t64, n, beams, flavour, attention)]
        standards: list = [None] * len(out_names)
        if standard is not None:
            t_std = {k: torch.from_numpy(v.copy()) for k, v in feeds.items()}
            standards = [x.numpy() for x in _eager_decode_step(standard, t_std, n, beams, flavour, attention)]
        for name, a, b, r, s in zip(out_names, onnx_out, eager, references, standards):
            _record(report, "decoder_step", name, a, b.numpy(), case, reference=r, standard=s)
        report.cases.append(
            {
                "graph": "decoder_step",
                "batch": batch,
                "sources": sources,
                "src_len": src_len,
                "cache_len": cache_len,
                "case": case,
            }
        )


def _short(a: np.ndarray) -> str:
    values = a.tolist()
    return str(values) if len(values) <= 8 else str(values[:8])[:-1] + ", ...]"


class TokenFlipError(ParityError):
    """A decode through the export chose other tokens than eager PyTorch, and not at a near tie:
    eager's choice beat the export's by more than the logits' allowed difference can explain.
    ``step``: the generated position where the tokens part; ``max_diff``: the score margin;
    ``tolerance``: the bound a near tie stays within."""

    def __init__(
        self, output: str, step: int | None, margin: float, bound: float, case: str = "", detail: str = ""
    ):
        super().__init__(output, step, margin, bound, case)
        self.detail = detail
        self.args = (
            f"ONNX output {output!r}: a token flip at generated position {step}: {detail}; score margin "
            f"{self.max_diff:.3g} > {self.tolerance:.3g}, more than the allowed logit differences explain "
            f"(a near tie is not a failure) on {case}",
        )

    def __reduce__(self):
        return (type(self), (self.output, self.step, self.max_diff, self.tolerance, self.case, self.detail))


class _Recorder:
    """Wraps a runner and keeps a copy of the logits of every step and of what was fed to it
    (the tokens, and the beam reorder before the step)."""

    def __init__(self, runner):
        self.runner = runner
        self.logits: list[np.ndarray] = []
        self.fed: list[tuple] = []
        self._reorder = None

    def encode(self, *args, **kwargs):
        self.logits, self.fed, self._reorder = [], [], None
        self.encoded = (args, kwargs)
        return self.runner.encode(*args, **kwargs)

    def step(self, state, tokens):
        self.fed.append((np.array(tokens, copy=True), self._reorder))
        self._reorder = None
        out = self.runner.step(state, tokens)
        self.logits.append(np.array(out, dtype=np.float32, copy=True))
        return out

    def reorder(self, state, beam_index):
        self._reorder = np.array(beam_index, copy=True)
        self.runner.reorder(state, beam_index)


def _same_inputs(a, b) -> bool:
    return all(
        (x is None and y is None) or (x is not None and y is not None and np.array_equal(x, y))
        for x, y in zip(a, b)
    )


def _replay(runner, recorder: _Recorder, steps: int) -> list[np.ndarray]:
    """The logits ``runner`` gives for the first ``steps`` steps of what ``recorder`` recorded
    (the same sources, tokens and beam reorders): the float64 reference of a decode."""
    args, kwargs = recorder.encoded
    state = runner.encode(*args, **kwargs)
    out = []
    for tokens, beam_index in recorder.fed[:steps]:
        if beam_index is not None:
            runner.reorder(state, beam_index)
        out.append(np.asarray(runner.step(state, tokens), dtype=np.float64))
    return out


def _steps_fed_alike(eager, onnx_rec) -> int:
    """How many leading steps both decodes were fed the same tokens (and beam reorders): the
    steps whose logits are comparable. Recorders that kept no inputs: every recorded step."""
    fed_a, fed_b = getattr(eager, "fed", None), getattr(onnx_rec, "fed", None)
    n = min(len(eager.logits), len(onnx_rec.logits))
    if fed_a is None or fed_b is None:
        return n
    return next((s for s in range(n) if not _same_inputs(fed_a[s], fed_b[s])), n)


def _tokens_of(hyp) -> list[int]:
    return list(hyp.tokens) if hasattr(hyp, "tokens") else list(hyp)


def _token_flip(kind: str, eager_out, onnx_out, allowed: float) -> Optional[dict]:
    """Where the two decodes' outputs first part (source, rank, generated position, the tokens
    there) and the score margin there, with the bound a near tie stays within: greedy, the
    log-probabilities of the two chosen tokens (each moves by at most twice the logits' largest
    difference); beam, the two hypotheses' scores (at most twice that per token, EOS included).
    ``None`` when the outputs are equal; ``margin`` None when the outputs carry no scores."""
    for source, (rows_e, rows_o) in enumerate(zip(eager_out, onnx_out)):
        if kind == "greedy":
            rows_e, rows_o = [rows_e], [rows_o]
        for rank, (a, b) in enumerate(zip(rows_e, rows_o)):
            ta, tb = _tokens_of(a), _tokens_of(b)
            if ta == tb:
                continue
            pos = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
            flip = {
                "source": source,
                "rank": rank,
                "step": pos,
                "eager": ta[pos] if pos < len(ta) else "EOS",
                "onnxruntime": tb[pos] if pos < len(tb) else "EOS",
            }
            lp_a, lp_b = getattr(a, "token_log_probs", None), getattr(b, "token_log_probs", None)
            if (
                kind == "greedy"
                and lp_a is not None
                and lp_b is not None
                and pos < len(lp_a)
                and pos < len(lp_b)
            ):
                flip.update(margin=abs(float(lp_a[pos]) - float(lp_b[pos])), bound=2.0 * allowed)
                what = "log-probability margin"
            elif (
                kind == "beam"
                and getattr(a, "score", None) is not None
                and getattr(b, "score", None) is not None
            ):
                length = max(len(ta), len(tb)) + 1
                flip.update(margin=abs(float(a.score) - float(b.score)), bound=2.0 * allowed * length)
                what = "score margin"
            else:
                flip.update(margin=None, bound=2.0 * allowed)
                what = "margin unknown"
            rank_text = f" hypothesis {rank}" if kind == "beam" else ""
            flip["what"] = (
                f"source {source}{rank_text} at generated position {pos}: eager token {flip['eager']}, "
                f"onnxruntime token {flip['onnxruntime']}"
                + (
                    f", {what} {flip['margin']:.2e} <= {flip['bound']:.2e}"
                    if flip["margin"] is not None and flip["margin"] <= flip["bound"]
                    else ""
                )
            )
            return flip
    return None


def _compare_decodes(
    report,
    kind: str,
    eager: _Recorder,
    onnx_rec: _Recorder,
    eager_tokens,
    onnx_tokens,
    case: str,
    reference: Optional[Any] = None,
    standard: Optional[Any] = None,
) -> dict:
    """The logits of every step fed alike against the float64 ``reference`` runner (replayed on
    eager's inputs, :func:`_replay`) within :func:`allowed_difference` of eager float32's own error
    (the larger of eager's and of the ``standard`` runner's, the standard-op attention replayed on
    the same inputs), or without a reference against eager's within the tolerance; the outputs (token lists, or
    :class:`Hypothesis` lists with scores) equal, or parting at a near tie (recorded as
    ``near_tie``). Raises :class:`ParityError` for logits beyond the bound,
    :class:`TokenFlipError` for tokens that part where no near tie explains it."""
    alike = _steps_fed_alike(eager, onnx_rec)
    per_step, float32_error, tie = [], [], report.tolerance  # tie: the largest |onnx - eager float32| allowed
    allowed = report.tolerance
    references = _replay(reference, eager, alike) if reference is not None else None
    standards = _replay(standard, eager, alike) if standard is not None and reference is not None else None
    standard_error = []
    for step in range(alike):
        if references is None:
            diff, bound, f32 = _max_diff(onnx_rec.logits[step], eager.logits[step]), report.tolerance, 0.0
        else:
            f32 = _max_diff(eager.logits[step], references[step])
            if standards is not None:
                standard_error.append(_max_diff(standards[step], references[step]))
                f32 = max(f32, standard_error[-1])
            diff, bound = (
                _max_diff(onnx_rec.logits[step], references[step]),
                allowed_difference(report.tolerance, f32),
            )
        per_step.append(diff)
        float32_error.append(f32)
        allowed, tie = max(allowed, bound), max(tie, bound + f32)
        if not diff <= bound:
            raise ParityError(f"{kind} decode logits", step, diff, bound, case)
    result = {
        "steps": len(per_step),
        "logits_max_diff_per_step": per_step,
        "float32_error_per_step": float32_error,
        "standard_ops_error_per_step": standard_error,
        "tokens_identical": True,
        "allowed": allowed,
    }
    allowed = tie
    flip = _token_flip(kind, eager_tokens, onnx_tokens, allowed)
    if flip is None and len(onnx_rec.logits) == len(eager.logits):
        return result
    if flip is None:  # equal outputs from a different number of steps
        raise TokenFlipError(
            f"{kind} decode tokens",
            len(per_step),
            float("inf"),
            2.0 * allowed,
            case,
            f"equal outputs from {len(eager.logits)} eager steps and {len(onnx_rec.logits)} onnxruntime steps",
        )
    if flip["margin"] is None or not flip["margin"] <= flip["bound"]:
        margin = float("inf") if flip["margin"] is None else flip["margin"]
        detail = (
            f"{flip['what']}; eager {_short_tokens(eager_tokens)} vs onnxruntime {_short_tokens(onnx_tokens)}"
        )
        raise TokenFlipError(f"{kind} decode tokens", flip["step"], margin, flip["bound"], case, detail)
    logger.warning("%s decode: the tokens part at a near tie, not a failure: %s", kind, flip["what"])
    result.update(tokens_identical=False, near_tie=flip)
    return result


def _short_tokens(out) -> str:
    rows = [
        [_tokens_of(h) for h in row]
        if isinstance(row, list) and row and hasattr(row[0], "tokens")
        else _tokens_of(row)
        for row in out
    ]
    text = str(rows)
    return text if len(text) <= 300 else text[:300] + " ..."


def _check_decodes(
    report,
    runner: OrtRunner,
    model,
    rng,
    max_cache_len: int,
    batch: int,
    max_new_tokens: int,
    beam_size: int,
    model64=None,
    standard=None,
) -> None:
    config = model.config
    src_len = max(1, min(config.max_len, 12))
    lengths = _ragged_lengths(rng, batch, src_len)
    ids = _source_ids(rng, config, lengths, src_len)
    steps = max(1, min(max_new_tokens, max_cache_len, config.max_len))
    case = f"batch {batch} src_len {src_len} src_lengths {_short(lengths)} max_new_tokens {steps}"
    eager, onnx_rec = _Recorder(EagerRunner(model, "cpu")), _Recorder(runner)
    reference = None if model64 is None else EagerRunner(model64, "cpu")
    standard_runner = None if standard is None else _standard_runner(standard)
    common = dict(bos_id=config.bos_id, eos_id=config.eos_id, max_decoding_length=steps)

    eager_out = decoding.greedy_decode(eager, ids, lengths, return_scores=True, **common)
    onnx_out = decoding.greedy_decode(onnx_rec, ids, lengths, return_scores=True, **common)
    eager_out, onnx_out = [row[0] for row in eager_out], [row[0] for row in onnx_out]
    report.greedy = _compare_decodes(
        report, "greedy", eager, onnx_rec, eager_out, onnx_out, "greedy " + case, reference, standard_runner
    )
    report.greedy.update(batch=batch, tokens_generated=sum(len(h.tokens) for h in onnx_out))

    eager_hyps = decoding.beam_search(
        eager, ids, lengths, beam_size=beam_size, num_hypotheses=beam_size, **common
    )
    onnx_hyps = decoding.beam_search(
        onnx_rec, ids, lengths, beam_size=beam_size, num_hypotheses=beam_size, **common
    )
    report.beam = _compare_decodes(
        report,
        "beam",
        eager,
        onnx_rec,
        eager_hyps,
        onnx_hyps,
        f"beam {beam_size} " + case,
        reference,
        standard_runner,
    )
    report.beam.update(
        batch=batch,
        beam_size=beam_size,
        tokens_generated=sum(len(h.tokens) for row in onnx_hyps for h in row),
    )


def validate_export(
    export_dir: str | os.PathLike,
    model,
    *,
    tolerance: float,
    seed: int = 0,
    max_cache_len: Optional[int] = None,
    decode_batch: int = 4,
    max_new_tokens: int = 24,
    beam_size: int = 3,
    intra_op_num_threads: int = 2,
) -> ValidationReport:
    """Run the export in ``export_dir`` with ONNX Runtime and compare it with ``model`` (eager).

    Returns a :class:`ValidationReport`; raises :class:`ParityError` at the first output, step
    or decode beyond its bound (:func:`allowed_difference` of ``tolerance``, absolute, against a
    float64 copy of ``model``, widened by eager float32's own error with its kernels or with the
    standard-op attention, :func:`standard_ops_copy`), :class:`TokenFlipError` where the decodes' tokens part other than
    at a near tie.
    """
    model.eval()
    runner = OrtRunner(export_dir, intra_op_num_threads=intra_op_num_threads)
    max_cache_len = int(max_cache_len or runner.info.max_cache_len)
    rng = np.random.default_rng(seed)
    report = ValidationReport(tolerance=float(tolerance))
    model64 = float64_copy(model)  # the reference: the one copy of the weights validation holds
    # float32 attention as the graphs compute it: the model itself with the standard-op attention
    # switched on around each call (a copy only for a model that is not float32 on the CPU)
    standard = _standard_ops_model(model)
    _check_encoder(report, runner, model, rng, model64, standard)
    _check_decoder(report, runner, model, rng, max_cache_len, model64, standard)
    _check_decodes(
        report, runner, model, rng, max_cache_len, decode_batch, max_new_tokens, beam_size, model64, standard
    )
    logger.info("validated %s: worst difference %.2e (tolerance %.0e)", export_dir, report.worst, tolerance)
    return report
