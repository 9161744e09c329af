"""The search head: a step's ``[rows, V]`` logits reduced to what a search reads, in ONNX Runtime.

A beam search reads, per row, the log-probabilities of its best ``2 * beam_size`` tokens and,
where a logit processor masks or forces tokens, those of a few named columns. Computed on the
host with numpy that is several single-threaded passes over ``rows x V`` floats (a softmax
normalisation and a top-k): at opus-mt's vocabulary of 58,101 and 64 rows, 6 ms of a 25 ms
step. ONNX Runtime's CPU kernels do it in one vectorised, multi-threaded graph over the logits
the step has just written, so the host copies ``rows x k`` numbers instead of ``rows x V``.

The graph (``LogSoftmax`` over the last axis, opset 17)::

    inputs   logits   float32 [N, V]      the step's logits, unchanged
             k        int64   [1]         how many tokens per row (1 <= k <= V)
             columns  int64   [N, M]      column ids per row to read back (M >= 1)
    outputs  top_log_probs     float32 [N, k]   each row's k best log-probabilities, best first
             top_ids           int64   [N, k]   their token ids
             column_log_probs  float32 [N, M]   the log-probabilities at ``columns``

It is built here as ONNX protobuf bytes (a few messages: :func:`search_head_model`), so a
runner needs only numpy and onnxruntime (no ``onnx`` package at run time);
tests/test_search_head.py parses the bytes with ``onnx``, checks them with its checker, and
compares the outputs with a float64 numpy reference.

A row holding a NaN or +inf logit has no log-probabilities: ``LogSoftmax`` makes the whole row
NaN, which the search detects in ``top_log_probs`` (and then reads the logits themselves).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

__all__ = ["SearchHead", "search_head_model", "OPSET", "INPUTS", "OUTPUTS"]

OPSET = 17
IR_VERSION = 8
INPUTS = ("logits", "k", "columns")
OUTPUTS = ("top_log_probs", "top_ids", "column_log_probs")

# onnx.proto's TensorProto.DataType and AttributeProto.AttributeType values used here
_FLOAT, _INT64 = 1, 7
_ATTR_INT = 2


# ------------------------------------------------------------------------------------------
# Protobuf wire format (https://protobuf.dev/programming-guides/encoding/): each field is a key
# ``field_number << 3 | wire_type`` followed by a varint (type 0) or a length and bytes (type 2)
# ------------------------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64 values: their two's complement, ten bytes
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _int_field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _bytes_field(number: int, payload: bytes | str) -> bytes:
    data = payload.encode() if isinstance(payload, str) else payload
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _tensor_value_info(name: str, elem_type: int, dims: tuple[Any, ...]) -> bytes:
    """ValueInfoProto {name = 1, type = 2: TypeProto {tensor_type = 1: {elem_type = 1, shape = 2}}};
    a dimension is ``dim_value`` (1) when an int, else ``dim_param`` (2)."""
    shape = b"".join(
        _bytes_field(1, _int_field(1, d) if isinstance(d, int) else _bytes_field(2, d)) for d in dims
    )
    tensor_type = _int_field(1, elem_type) + _bytes_field(2, shape)
    return _bytes_field(1, name) + _bytes_field(2, _bytes_field(1, tensor_type))


def _node(op_type: str, inputs: tuple[str, ...], outputs: tuple[str, ...], **int_attributes: int) -> bytes:
    """NodeProto {input = 1, output = 2, name = 3, op_type = 4, attribute = 5: AttributeProto
    {name = 1, i = 3, type = 20}}."""
    body = b"".join(_bytes_field(1, i) for i in inputs) + b"".join(_bytes_field(2, o) for o in outputs)
    body += _bytes_field(3, outputs[0]) + _bytes_field(4, op_type)
    for name, value in int_attributes.items():
        body += _bytes_field(5, _bytes_field(1, name) + _int_field(3, value) + _int_field(20, _ATTR_INT))
    return body


def search_head_model() -> bytes:
    """The search head graph (module docstring) as a serialized ONNX ModelProto."""
    nodes = [
        _node("LogSoftmax", ("logits",), ("log_probs",), axis=-1),
        _node("TopK", ("log_probs", "k"), ("top_log_probs", "top_ids"), axis=-1, largest=1, sorted=1),
        _node("GatherElements", ("log_probs", "columns"), ("column_log_probs",), axis=1),
    ]
    inputs = [
        _tensor_value_info("logits", _FLOAT, ("rows", "vocab")),
        _tensor_value_info("k", _INT64, (1,)),
        _tensor_value_info("columns", _INT64, ("rows", "columns")),
    ]
    outputs = [
        _tensor_value_info("top_log_probs", _FLOAT, ("rows", "k")),
        _tensor_value_info("top_ids", _INT64, ("rows", "k")),
        _tensor_value_info("column_log_probs", _FLOAT, ("rows", "columns")),
    ]
    # GraphProto {node = 1, name = 2, input = 11, output = 12}
    graph = b"".join(_bytes_field(1, n) for n in nodes) + _bytes_field(2, "search_head")
    graph += b"".join(_bytes_field(11, i) for i in inputs) + b"".join(_bytes_field(12, o) for o in outputs)
    # ModelProto {ir_version = 1, producer_name = 2, graph = 7, opset_import = 8: {domain = 1, version = 2}}
    return (
        _int_field(1, IR_VERSION)
        + _bytes_field(2, "transformer_ext")
        + _bytes_field(7, graph)
        + _bytes_field(8, _bytes_field(1, "") + _int_field(2, OPSET))
    )


class SearchHead:
    """The search head graph in an ONNX Runtime CPU session whose idle threads sleep.

    Args:
        threads: the session's intra-op threads (the decoder's; None or 0: ONNX Runtime's default).
        flush_denormals: set FTZ / DAZ on the session's pool threads (:mod:`.denormals`); ONNX
            Runtime sets them on the creating thread too, so make it inside ``denormals.call``.

    The decoder's session has a thread pool of its own whose threads spin for a while after each
    step (ONNX Runtime's default), and the head's threads, spinning too, would compete with them
    for the cores: the head's do not spin. Measured on a 2-core EPYC (opus-mt dimensions, int8,
    beam 4, batch 16, decoder on 2 threads, milliseconds a step over two runs): a head of 2
    threads that do not spin 21.4 and 23.5, of one thread 23.3 and 24.8, of 2 spinning threads
    36.1 and 36.8; at batch 1 and 4 the first two are equal.
    """

    def __init__(self, threads: Optional[int] = None, flush_denormals: bool = False) -> None:
        import onnxruntime as ort

        from .denormals import session_config

        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = int(threads)
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if flush_denormals:  # on its pool threads; the caller sets its own (OrtRunner.step_top_k)
            for key, value in session_config().items():
                options.add_session_config_entry(key, value)
        self.session = ort.InferenceSession(
            search_head_model(), sess_options=options, providers=["CPUExecutionProvider"]
        )
        self._k = np.zeros(1, dtype=np.int64)

    def __call__(
        self, logits: np.ndarray, k: int, columns: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(top_log_probs [N, k] float32, top_ids [N, k] int64, column_log_probs [N, M]
        float32)`` of float32 C-contiguous ``logits [N, V]`` (read in place); ``columns`` int64
        ``[N, M]`` with ids in ``[0, V)``, ``1 <= k <= V`` (the caller checks both)."""
        self._k[0] = k
        top, ids, picked = self.session.run(None, {"logits": logits, "k": self._k, "columns": columns})
        return top, ids, picked
