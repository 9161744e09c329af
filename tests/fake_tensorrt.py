"""Stand-ins for TensorRT, shared by the tests of the builder and of the runners.

:func:`fake_tensorrt` is a module with the slice of the TensorRT 10 Python API that
``export.tensorrt`` uses (builder, parser, network, serialised engines); :func:`fake_engines` are
an encoder and a decoder engine whose execution contexts compute with the eager model through the
raw buffer addresses they are given (CPU tensors stand in for CUDA ones), with the I/O of
docs/DESIGN.md section 3.
"""

from __future__ import annotations

import json
import types

import numpy as np
import onnx
import torch
from onnx import TensorProto


class FakeEnum:
    def __init__(self, name, value=0):
        self.name, self.value = name, value

    def __int__(self):
        return self.value

    def __repr__(self):
        return f"<{self.name}>"


def fake_tensorrt(calls: list, parse_errors=None, fail_build=False):
    """A module with the slice of the TensorRT 10 Python API that export.tensorrt uses."""
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "10.15.1"
    trt.NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=FakeEnum("STRONGLY_TYPED", 0))
    trt.BuilderFlag = types.SimpleNamespace(
        **{n: FakeEnum(n) for n in ("FP16", "BF16", "TF32", "OBEY_PRECISION_CONSTRAINTS")}
    )
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE=FakeEnum("WORKSPACE"))
    trt.LayerType = types.SimpleNamespace(
        SOFTMAX=FakeEnum("SOFTMAX"), REDUCE=FakeEnum("REDUCE"), NORMALIZATION=FakeEnum("NORMALIZATION")
    )
    trt.float32, trt.float16, trt.bfloat16 = FakeEnum("FLOAT"), FakeEnum("HALF"), FakeEnum("BF16")
    trt.int64, trt.int32, trt.bool = FakeEnum("INT64"), FakeEnum("INT32"), FakeEnum("BOOL")
    _types = {
        TensorProto.FLOAT: "FLOAT",
        TensorProto.FLOAT16: "HALF",
        TensorProto.BFLOAT16: "BF16",
        TensorProto.INT64: "INT64",
    }

    class ILogger:
        Severity = types.SimpleNamespace(INTERNAL_ERROR=0, ERROR=1, WARNING=2, INFO=3, VERBOSE=4)

        def __init__(self):
            pass

    class TimingCache:
        def __init__(self, data):
            self.data = bytes(data)

        def serialize(self):
            return self.data + b"+timing"

    class Config:
        def __init__(self):
            self.flags, self.cleared, self.profiles, self.builder_optimization_level = [], [], [], 3

        def set_memory_pool_limit(self, pool, size):
            calls.append(("workspace", size))

        def set_flag(self, f):
            self.flags.append(f.name)

        def clear_flag(self, f):
            self.cleared.append(f.name)

        def create_timing_cache(self, data):
            calls.append(("create_timing_cache", bytes(data)))
            return TimingCache(data)

        def set_timing_cache(self, cache, ignore_mismatch):
            calls.append(("set_timing_cache", cache.data))

        def add_optimization_profile(self, p):
            self.profiles.append(p)
            return len(self.profiles) - 1

    class Profile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, lo, opt, hi):
            self.shapes[name] = (tuple(lo), tuple(opt), tuple(hi))

    class Tensor:
        def __init__(self, name, dtype):
            self.name, self.dtype = name, dtype

    class Network:
        def __init__(self, flags):
            self.flags, self.inputs, self.outputs = flags, [], []
            self.num_layers = 0

        @property
        def num_inputs(self):
            return len(self.inputs)

        @property
        def num_outputs(self):
            return len(self.outputs)

        def get_input(self, i):
            return self.inputs[i]

        def get_output(self, i):
            return self.outputs[i]

    class ParserError:
        def __init__(self, desc, node):
            self._desc, self._node = desc, node

        def code(self):
            return FakeEnum("UNSUPPORTED_NODE")

        def desc(self):
            return self._desc

        def node(self):
            return self._node

    class OnnxParser:
        def __init__(self, network, logger):
            self.network = network
            self.errors = []

        def parse(self, data, path=None):
            model = onnx.load_from_string(data)
            inits = {t.name for t in model.graph.initializer}
            self.network.inputs = [
                Tensor(i.name, FakeEnum(_types[i.type.tensor_type.elem_type]))
                for i in model.graph.input
                if i.name not in inits
            ]
            self.network.outputs = [
                Tensor(o.name, FakeEnum(_types[o.type.tensor_type.elem_type])) for o in model.graph.output
            ]
            calls.append(
                ("parse", path, [(t.name, t.dtype.name) for t in self.network.inputs + self.network.outputs])
            )
            if parse_errors:
                self.errors = [ParserError(d, n) for d, n in parse_errors]
                return False
            return True

        @property
        def num_errors(self):
            return len(self.errors)

        def get_error(self, i):
            return self.errors[i]

    class Builder:
        def __init__(self, logger):
            pass

        def create_network(self, flags):
            calls.append(("create_network", flags))
            return Network(flags)

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            calls.append(("build", config.flags, config.cleared, [p.shapes for p in config.profiles]))
            if fail_build:
                return None
            io = {t.name: ["input", t.dtype.name] for t in network.inputs}
            io.update({t.name: ["output", t.dtype.name] for t in network.outputs})
            return json.dumps(io).encode()

    class Engine:
        def __init__(self, io):
            self.io = io
            self.names = list(io)

        @property
        def num_io_tensors(self):
            return len(self.names)

        def get_tensor_name(self, i):
            return self.names[i]

        def get_tensor_mode(self, name):
            return FakeEnum(self.io[name][0].upper())

        def get_tensor_dtype(self, name):
            return FakeEnum(self.io[name][1])

        def get_tensor_shape(self, name):
            return [-1]

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, data):
            return Engine(json.loads(bytes(data)))

    trt.ILogger, trt.Builder, trt.OnnxParser, trt.Runtime = ILogger, Builder, OnnxParser, Runtime
    return trt


_TYPESTR = {"float32": "<f4", "float16": "<f2", "int64": "<i8", "int32": "<i4"}
_TRT_NAME = {"float32": "FLOAT", "float16": "HALF", "int64": "INT64", "int32": "INT32"}
_TORCH = {"float32": torch.float32, "float16": torch.float16, "int64": torch.int64, "int32": torch.int32}


class _Raw:
    """A buffer seen only through its address, as TensorRT sees it."""

    def __init__(self, ptr, shape, dtype, device):
        iface = {"shape": tuple(shape), "typestr": _TYPESTR[dtype], "data": (ptr, False), "version": 3}
        if device.type == "cuda":
            self.__cuda_array_interface__ = {**iface, "strides": None}
        else:
            self.__array_interface__ = iface


def _tensor_at(ptr, shape, dtype, device):
    raw = _Raw(ptr, shape, dtype, device)
    if device.type == "cuda":
        return torch.as_tensor(raw, device=device)
    return torch.from_numpy(np.asarray(raw))


class FakeContext:
    def __init__(self, engine):
        self.engine, self.shapes, self.addresses, self.calls = engine, {}, {}, engine.calls

    def set_input_shape(self, name, shape):
        self.calls.append(("set_input_shape", self.engine.kind, name, tuple(shape)))
        lo, _, hi = self.engine.get_tensor_profile_shape(name, 0)
        if len(shape) != len(lo) or any(not a <= s <= b for a, s, b in zip(lo, shape, hi)):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name, ptr):
        self.calls.append(("set_tensor_address", self.engine.kind, name, ptr))
        self.addresses[name] = ptr
        return True

    def get_tensor_shape(self, name):
        return self.engine.output_shape(name, self.shapes)

    def execute_async_v3(self, stream_handle):
        self.calls.append(("execute_async_v3", self.engine.kind, stream_handle))
        dev = self.engine.device
        views = {}
        for name in self.engine.names:
            shape = (
                self.shapes[name]
                if self.engine.io[name][0] == "INPUT"
                else self.engine.output_shape(name, self.shapes)
            )
            views[name] = _tensor_at(self.addresses[name], shape, self.engine.io[name][1], dev)
        ctx = (
            torch.cuda.stream(torch.cuda.ExternalStream(stream_handle))
            if dev.type == "cuda"
            else _nullcontext()
        )
        with ctx, torch.inference_mode():
            self.engine.compute(views)
        return True


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeEngine:
    """Engine API (names, modes, dtypes, static dims, profile 0) + an eager computation."""

    def __init__(self, kind, io, profile, compute, device, calls):
        self.kind, self.io, self.profile, self.compute, self.device, self.calls = (
            kind,
            io,
            profile,
            compute,
            device,
            calls,
        )
        self.names = list(io)

    @property
    def num_io_tensors(self):
        return len(self.names)

    def get_tensor_name(self, i):
        return self.names[i]

    def get_tensor_mode(self, name):
        return FakeEnum(self.io[name][0])

    def get_tensor_dtype(self, name):
        return FakeEnum(_TRT_NAME[self.io[name][1]])

    def get_tensor_shape(self, name):
        return list(self.io[name][2])

    def get_tensor_profile_shape(self, name, index):
        return self.profile[name]

    def output_shape(self, name, shapes):
        return self.io[name][3](shapes)

    def create_execution_context(self):
        return FakeContext(self)


def fake_engines(
    model,
    flavour,
    device,
    calls,
    *,
    max_rows=16,
    max_src=32,
    cache=(1, 64),
    static_cache=None,
    cache_dtype="float32",
    min_rows=1,
):
    """Encoder + decoder stand-ins for ``model``, with the I/O of docs/DESIGN.md section 3;
    ``min_rows``: the decoder profile's minimum batch."""
    c = model.config
    H, D, n = c.n_heads, c.d_k, c.n_decoder_layers
    L = static_cache or -1
    f = cache_dtype
    enc_io = {
        "input_ids": ("INPUT", "int64", [-1, -1]),
        "src_lengths": ("INPUT", "int64", [-1]),
        "encoder_out": ("OUTPUT", "float32", [-1, -1, c.d_model], lambda s: (*s["input_ids"], c.d_model)),
    }
    for i in range(n):
        for kind in ("key", "value"):
            enc_io[f"cross_{kind}.{i}"] = (
                "OUTPUT",
                f,
                [-1, H, -1, D],
                lambda s: (s["input_ids"][0], H, s["input_ids"][1], D),
            )
    enc_profile = {
        "input_ids": ((1, 1), (4, 8), (max_rows, max_src)),
        "src_lengths": ((1,), (4,), (max_rows,)),
    }

    dec_io = {
        "input_ids": ("INPUT", "int64", [-1, 1]),
        "positions": ("INPUT", "int64", [-1]),
        "src_lengths": ("INPUT", "int64", [-1]),
    }
    lo, hi = (static_cache, static_cache) if static_cache else cache
    dec_profile = {
        "input_ids": ((min_rows, 1), (4, 1), (max_rows, 1)),
        "positions": ((min_rows,), (4,), (max_rows,)),
        "src_lengths": ((min_rows,), (4,), (max_rows,)),
    }
    for i in range(n):
        for kind in ("key", "value"):
            dec_io[f"self_{kind}.{i}"] = ("INPUT", f, [-1, H, L, D])
            dec_profile[f"self_{kind}.{i}"] = ((min_rows, H, lo, D), (4, H, hi, D), (max_rows, H, hi, D))
            dec_io[f"cross_{kind}.{i}"] = ("INPUT", f, [-1, H, -1, D])
            dec_profile[f"cross_{kind}.{i}"] = ((min_rows, H, 1, D), (4, H, 8, D), (max_rows, H, max_src, D))
    dec_io["logits"] = (
        "OUTPUT",
        "float32",
        [-1, c.tgt_vocab_size],
        lambda s: (s["input_ids"][0], c.tgt_vocab_size),
    )
    for i in range(n):
        for kind in ("key", "value"):
            if flavour == "portable":
                dec_io[f"new_{kind}.{i}"] = (
                    "OUTPUT",
                    f,
                    [-1, H, 1, D],
                    lambda s: (s["input_ids"][0], H, 1, D),
                )
            else:
                dec_io[f"present_{kind}.{i}"] = (
                    "OUTPUT",
                    f,
                    [-1, H, L, D],
                    lambda s, k=kind, j=i: s[f"self_{k}.{j}"],
                )

    def encode(v):
        enc_out, keys, values = model.encode(v["input_ids"], v["src_lengths"])
        v["encoder_out"].copy_(enc_out)
        for i in range(n):
            v[f"cross_key.{i}"].copy_(keys[i])
            v[f"cross_value.{i}"].copy_(values[i])

    def decode(v):
        get = lambda k: [v[f"{k}.{i}"].float() for i in range(n)]  # noqa: E731
        logits, new_k, new_v = model.decode_step(
            v["input_ids"],
            v["positions"],
            v["src_lengths"],
            get("self_key"),
            get("self_value"),
            get("cross_key"),
            get("cross_value"),
        )
        v["logits"].copy_(logits)
        for i in range(n):
            if flavour == "portable":
                v[f"new_key.{i}"].copy_(new_k[i])
                v[f"new_value.{i}"].copy_(new_v[i])
            else:  # the KV-cache update layer: in place, present aliases the input cache
                assert v[f"present_key.{i}"].data_ptr() == v[f"self_key.{i}"].data_ptr()
                for b, p in enumerate(v["positions"].tolist()):
                    v[f"present_key.{i}"][b, :, p] = new_k[i][b, :, 0]
                    v[f"present_value.{i}"][b, :, p] = new_v[i][b, :, 0]

    return (
        FakeEngine("encoder", enc_io, enc_profile, encode, device, calls),
        FakeEngine("decoder", dec_io, dec_profile, decode, device, calls),
    )
