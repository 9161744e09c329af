"""export.triton: the model repository, its configs (Triton's protobuf vs the graphs), the
Python-backend translator's decoding over a stand-in Triton, bad input.

Tritonserver cannot run here. :class:`FakeTriton` stands in for it: it loads every
``onnxruntime_onnx`` model of a generated repository with ONNX Runtime and serves requests with
the semantics its ``config.pbtxt`` states (parsed with Triton's own protobuf): input names,
dtypes and dims with the batch axis owned by Triton up to ``max_batch_size``, ``reshape``,
and the sequence batcher's implicit state (zero-filled at START, output state of step t fed as
input state of step t+1, dropped at END, batch 1 per sequence request). A fake
``triton_python_backend_utils`` module routes the translator's BLS calls to it.

The tiny model is exported once per flavour for the module (or the session's validated exports
of test_export_onnx.py are reused when they exist).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from helpers import make_model_dir, rehash_export

from export import ManifestError, OutputFolderError
from export import triton as triton_export
from export.triton import (
    DECODER_MODEL,
    ENCODER_MODEL,
    MARKER_FILE,
    STATEFUL_DECODER_MODEL,
    TRANSLATOR_MODEL,
    TritonConfigError,
    TritonExportError,
    cache_bytes_per_step,
    export_triton,
    main,
    validate_repository,
)
from export.triton_models.translator import model as translator_module
from transformer_ext import decoding
from transformer_ext.checkpoint import load_model
from transformer_ext.export_format import MANIFEST_NAME
from transformer_ext.runtimes import EagerRunner

model_config_pb2 = pytest.importorskip(
    "tritonclient.grpc.model_config_pb2",
    reason="tritonclient[grpc] is needed to parse config.pbtxt with Triton's protobuf",
)
from google.protobuf import json_format, text_format  # noqa: E402  (installed with tritonclient)

FLAVOURS = ["portable", "tensorscatter"]
TYPES = {"TYPE_INT64": np.int64, "TYPE_FP32": np.float32, "TYPE_FP16": np.float16}
MAX_NEW = 12


# ------------------------------------------------------------------------------------------
# fixtures
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    """flavour -> export folder of the tiny model (the session's shared export when present)."""
    shared = tmp_path_factory.getbasetemp() / "shared_exports"
    own = tmp_path_factory.mktemp("triton_exports")
    out = {}
    for flavour in FLAVOURS:
        if (shared / f"tiny_{flavour}" / MANIFEST_NAME).is_file():
            out[flavour] = shared / f"tiny_{flavour}"
            continue
        from export.onnx import export_onnx

        model_dir = own / "tiny_model"
        if not model_dir.is_dir():
            make_model_dir(model_dir)
        # parity with eager is what this module checks itself, through the translator
        export_onnx(model_dir, own / flavour, flavour=flavour, validate=False)
        out[flavour] = own / flavour
    return out


@pytest.fixture(scope="module")
def repos(exports, tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("triton_repos")
    return {flavour: export_triton(exports[flavour], base / flavour).repo_dir for flavour in FLAVOURS}


@pytest.fixture(scope="module")
def eager(exports) -> EagerRunner:
    manifest = json.loads((exports["portable"] / MANIFEST_NAME).read_text())
    return EagerRunner(load_model(manifest["export"]["source_model_dir"]), "cpu")


def parse(path: Path) -> dict:
    message = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def sources(batch: int = 3, src_len: int = 7, seed: int = 0, vocab: int = 48, pad: int = 0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, vocab, size=(batch, src_len)).astype(np.int64)
    lengths = np.array(
        [src_len] + [int(x) for x in rng.integers(1, src_len + 1, size=batch - 1)], dtype=np.int64
    )
    for row, n in enumerate(lengths):
        ids[row, n:] = pad
    return ids, lengths


# ------------------------------------------------------------------------------------------
# a stand-in Triton server over ONNX Runtime
# ------------------------------------------------------------------------------------------


class FakeTritonError(RuntimeError):
    pass


class FakeTriton:
    """Serves the onnxruntime_onnx models of a repository with the semantics of their configs."""

    def __init__(self, repo: Path):
        self.models = {}
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.log_severity_level = (
            3  # TensorScatter's per-call "in-place optimization not activated" warning
        )
        for path in sorted(repo.glob("*/config.pbtxt")):
            config = parse(path)
            if config.get("platform") == "onnxruntime_onnx":
                session = ort.InferenceSession(
                    os.fspath(path.parent / "1" / "model.onnx"), options, providers=["CPUExecutionProvider"]
                )
                self.models[config["name"]] = (config, session)
        self.states: dict = {}  # (model, correlation id) -> {state input name: array without batch}
        self.log: list[dict] = []

    def infer(self, model: str, inputs: dict, outputs, correlation_id: int = 0, flags: int = 0) -> dict:
        if model not in self.models:
            raise FakeTritonError(f"unknown model {model!r}")
        config, session = self.models[model]
        mbs = int(config.get("max_batch_size", 0))
        entries = {e["name"]: e for e in config.get("input", [])}
        unknown = set(inputs) - set(entries)
        if unknown:
            raise FakeTritonError(f"{model}: unexpected inputs {sorted(unknown)}")
        feeds, batch = {}, None
        for name, entry in entries.items():
            if name not in inputs:
                if entry.get("optional"):
                    continue
                raise FakeTritonError(f"{model}: input {name!r} is missing")
            arr = np.asarray(inputs[name])
            if arr.dtype != TYPES[entry["data_type"]]:
                raise FakeTritonError(f"{model}: {name} has dtype {arr.dtype}, expected {entry['data_type']}")
            shape = arr.shape
            if mbs > 0:
                if batch is None:
                    batch = shape[0]
                if shape[0] != batch or not 1 <= batch <= mbs:
                    raise FakeTritonError(f"{model}: batch {shape[0]} of {name} (max_batch_size {mbs})")
                shape = shape[1:]
            dims = [int(d) for d in entry["dims"]]
            if len(shape) != len(dims) or any(d not in (-1, s) for d, s in zip(dims, shape)):
                raise FakeTritonError(f"{model}: {name} has shape {list(shape)}, config dims {dims}")
            if "reshape" in entry:
                arr = arr.reshape(
                    ((batch,) if mbs > 0 else ()) + tuple(int(d) for d in entry["reshape"].get("shape", []))
                )
            feeds[name] = arr
        sequence = config.get("sequence_batching")
        states = sequence.get("state", []) if sequence else []
        key = (model, correlation_id)
        if sequence:
            if correlation_id == 0:
                raise FakeTritonError(f"{model}: a sequence request needs a correlation id")
            if batch != 1:
                raise FakeTritonError(
                    f"{model}: must specify batch-size 1 due to requirements of sequence batcher"
                )
            if flags & 1:
                self.states[key] = {
                    st["input_name"]: np.zeros(
                        [int(d) for d in st["initial_state"][0]["dims"]], TYPES[st["data_type"]]
                    )
                    for st in states
                }
            elif key not in self.states:
                raise FakeTritonError(f"{model}: sequence {correlation_id} was not started (START flag)")
            for st in states:
                feeds[st["input_name"]] = self.states[key][st["input_name"]][None]
        elif correlation_id or flags:
            raise FakeTritonError(f"{model}: sequence flags for a model without a sequence batcher")
        needed = [i.name for i in session.get_inputs()]
        if sorted(needed) != sorted(feeds):
            raise FakeTritonError(
                f"{model}: the graph needs {sorted(needed)}, the request fed {sorted(feeds)}"
            )
        out_entries = {e["name"]: e for e in config.get("output", [])}
        for name in outputs:
            if name not in out_entries:
                raise FakeTritonError(f"{model}: {name!r} is not an output of the config")
        run = list(outputs) + [st["output_name"] for st in states]
        results = dict(zip(run, session.run(run, feeds)))
        for name in outputs:
            entry, arr = out_entries[name], results[name]
            dims = [int(d) for d in entry["dims"]]
            if (
                arr.dtype != TYPES[entry["data_type"]]
                or len(arr.shape) != len(dims) + (mbs > 0)
                or any(d not in (-1, s) for d, s in zip(dims, arr.shape[1:] if mbs > 0 else arr.shape))
            ):
                raise FakeTritonError(
                    f"{model}: output {name} {arr.dtype}{list(arr.shape)} breaks its config {entry}"
                )
        for st in states:
            new = results[st["output_name"]][0]
            if list(new.shape) != [int(d) for d in st["dims"]]:
                raise FakeTritonError(f"{model}: state {st['output_name']} has shape {new.shape}")
            self.states[key][st["input_name"]] = new
        if sequence and flags & 2:
            del self.states[key]
        self.log.append(
            {
                "model": model,
                "batch": batch,
                "flags": flags,
                "bytes": {n: np.asarray(a).nbytes for n, a in inputs.items()},
            }
        )
        return {name: results[name] for name in outputs}

    def infer_many(self, calls):
        return [
            self.infer(c.model, dict(c.inputs), list(c.outputs), c.correlation_id, c.flags) for c in calls
        ]

    def calls(self, model: str) -> list[dict]:
        return [entry for entry in self.log if entry["model"] == model]


def fake_pb_utils(server: FakeTriton) -> types.ModuleType:
    """The parts of ``triton_python_backend_utils`` the translator uses, backed by ``server``."""
    m = types.ModuleType("triton_python_backend_utils")

    class TritonError:
        def __init__(self, message):
            self._message = message

        def message(self):
            return self._message

    class Tensor:
        def __init__(self, name, array):
            self._name, self._array = name, np.asarray(array)

        def name(self):
            return self._name

        def as_numpy(self):
            return self._array

    class InferenceResponse:
        def __init__(self, output_tensors=(), error=None):
            self._tensors, self._error = list(output_tensors), error

        def output_tensors(self):
            return self._tensors

        def has_error(self):
            return self._error is not None

        def error(self):
            return self._error

    class InferenceRequest:
        def __init__(
            self, model_name="", requested_output_names=(), inputs=(), correlation_id=0, flags=0, **_
        ):
            self.model_name, self.outputs, self._inputs = (
                model_name,
                list(requested_output_names),
                list(inputs),
            )
            self.correlation_id, self.flags = correlation_id, flags

        def inputs(self):
            return self._inputs

        def exec(self):
            try:
                out = server.infer(
                    self.model_name,
                    {t.name(): t.as_numpy() for t in self._inputs},
                    self.outputs,
                    self.correlation_id,
                    self.flags,
                )
            except FakeTritonError as exc:
                return InferenceResponse([], TritonError(str(exc)))
            return InferenceResponse([Tensor(n, a) for n, a in out.items()])

        async def async_exec(self):
            return self.exec()

    def by_name(tensors, name):
        return next((t for t in tensors if t.name() == name), None)

    m.TritonError, m.Tensor, m.InferenceRequest, m.InferenceResponse = (
        TritonError,
        Tensor,
        InferenceRequest,
        InferenceResponse,
    )
    m.get_input_tensor_by_name = lambda request, name: by_name(request.inputs(), name)
    m.get_output_tensor_by_name = lambda response, name: by_name(response.output_tensors(), name)
    m.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START, m.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 1, 2
    return m


def settings_of(repo: Path) -> translator_module.Settings:
    return translator_module.Settings.from_parameters(
        parse(repo / TRANSLATOR_MODEL / "config.pbtxt")["parameters"]
    )


def eager_decodes(eager: EagerRunner, ids, lengths, beam: int, max_new=MAX_NEW, min_new=0):
    c = eager.info
    common = dict(bos_id=c.bos_id, eos_id=c.eos_id, max_decoding_length=max_new, min_decoding_length=min_new)
    if beam == 1:
        return decoding.greedy_decode(eager, ids, lengths, **common), None
    hyps = decoding.beam_search(eager, ids, lengths, beam_size=beam, num_hypotheses=1, **common)
    return [h[0].tokens for h in hyps], [h[0].score for h in hyps]


def unpack(result: dict) -> list[list[int]]:
    return [row[:n].tolist() for row, n in zip(result["output_ids"], result["output_lengths"])]


# ------------------------------------------------------------------------------------------
# the repository and its configurations
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_configs_parse_with_tritons_protobuf_and_match_the_graphs(repos, exports, flavour):
    repo = repos[flavour]
    names = sorted(p.name for p in repo.iterdir())
    expected = [DECODER_MODEL, ENCODER_MODEL, TRANSLATOR_MODEL, MARKER_FILE] + (
        [STATEFUL_DECODER_MODEL] if flavour == "tensorscatter" else []
    )
    assert names == sorted(expected)
    assert not [p for p in repo.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert validate_repository(repo, require_protobuf=True) is True

    manifest = json.loads((exports[flavour] / MANIFEST_NAME).read_text())
    cfg = manifest["model_config"]
    H, d_k, V = cfg["n_heads"], cfg["d_model"] // cfg["n_heads"], cfg["tgt_vocab_size"]
    enc, dec = parse(repo / ENCODER_MODEL / "config.pbtxt"), parse(repo / DECODER_MODEL / "config.pbtxt")
    for c in (enc, dec):
        assert c["platform"] == "onnxruntime_onnx" and c["max_batch_size"] == 64
        assert "max_queue_delay_microseconds" in c["dynamic_batching"]
        assert c["instance_group"] == [{"count": 1}]  # KIND_AUTO: Triton picks GPU or CPU
    inputs = {e["name"]: e for e in dec["input"]}
    assert [e["name"] for e in dec["input"]] == [
        t["name"] for t in manifest["graphs"]["decoder_step"]["inputs"]
    ]
    assert (
        inputs["positions"]["dims"] == ["1"] and inputs["positions"]["reshape"] == {}
    )  # [batch] in the graph
    assert inputs["input_ids"]["dims"] == ["1"] and "reshape" not in inputs["input_ids"]  # [batch, 1]
    assert inputs["self_key.0"]["data_type"] == "TYPE_FP32" and inputs["self_key.0"]["dims"] == [
        str(H),
        "-1",
        str(d_k),
    ]
    outputs = {e["name"]: e for e in dec["output"]}
    assert outputs["logits"]["dims"] == [str(V)]
    new = "new_key.1" if flavour == "portable" else "present_key.1"
    assert outputs[new]["dims"] == [str(H), "1" if flavour == "portable" else "-1", str(d_k)]
    for name in (ENCODER_MODEL, DECODER_MODEL):  # the served graph is the exported one, byte for byte
        src = exports[flavour] / f"{name}.onnx"
        assert (repo / name / "1" / "model.onnx").read_bytes() == src.read_bytes()

    translator = parse(repo / TRANSLATOR_MODEL / "config.pbtxt")
    assert (
        translator["backend"] == "python" and translator.get("max_batch_size", 0) == 0
    )  # proto3: 0 is not listed
    assert translator["instance_group"] == [{"count": 1, "kind": "KIND_CPU"}]
    # the real decoding package, every module byte for byte (not a copy of its code that could drift)
    package = Path(decoding.__file__).parent
    vendored = repo / TRANSLATOR_MODEL / "1" / "_vendor" / "transformer_ext" / "decoding"
    assert sorted(p.name for p in vendored.glob("*.py")) == sorted(p.name for p in package.glob("*.py"))
    for module in package.glob("*.py"):
        assert (vendored / module.name).read_bytes() == module.read_bytes()
    settings = settings_of(repo)
    assert settings.stateful_decoder_model == (STATEFUL_DECODER_MODEL if flavour == "tensorscatter" else "")

    if flavour == "tensorscatter":
        st = parse(repo / STATEFUL_DECODER_MODEL / "config.pbtxt")
        assert "dynamic_batching" not in st
        assert {e["name"] for e in st["input"]} == {"input_ids", "positions", "src_lengths"} | {
            f"cross_{k}.{i}" for i in range(cfg["n_decoder_layers"]) for k in ("key", "value")
        }
        assert [e["name"] for e in st["output"]] == ["logits"]
        seq = st["sequence_batching"]
        assert seq["oldest"]["max_candidate_sequences"] == 64
        pairs = [(s["input_name"], s["output_name"]) for s in seq["state"]]
        assert pairs == [
            (f"self_{k}.{i}", f"present_{k}.{i}")
            for i in range(cfg["n_decoder_layers"])
            for k in ("key", "value")
        ]
        L = manifest["max_cache_len"]
        for s in seq["state"]:
            assert s["dims"] == [str(H), str(L), str(d_k)] and s["data_type"] == "TYPE_FP32"
            assert s["initial_state"] == [
                {
                    "name": f"zeros_{s['input_name']}",
                    "data_type": "TYPE_FP32",
                    "dims": s["dims"],
                    "zero_data": True,
                }
            ]
            assert "use_same_buffer_for_input_output" not in s  # ONNX Runtime backend: not supported there
        a, b = repo / DECODER_MODEL / "1" / "model.onnx", repo / STATEFUL_DECODER_MODEL / "1" / "model.onnx"
        assert a.read_bytes() == b.read_bytes()
        assert settings.state_cache_len == L and settings.stateful_max_sequences == 64


def test_options_reach_the_configs(exports, tmp_path):
    repo = export_triton(
        exports["portable"],
        tmp_path / "r",
        instance_kind="gpu",
        instances=2,
        gpus=[0, 1],
        translator_instances=3,
        max_batch_size=8,
        max_queue_delay_us=500,
        ort_threads=2,
    ).repo_dir
    dec = parse(repo / DECODER_MODEL / "config.pbtxt")
    assert dec["max_batch_size"] == 8 and dec["dynamic_batching"] == {"max_queue_delay_microseconds": "500"}
    assert dec["instance_group"] == [{"count": 2, "kind": "KIND_GPU", "gpus": [0, 1]}]
    assert dec["parameters"] == {"intra_op_thread_count": {"string_value": "2"}}
    assert parse(repo / TRANSLATOR_MODEL / "config.pbtxt")["instance_group"] == [
        {"count": 3, "kind": "KIND_CPU"}
    ]
    assert settings_of(repo).decoder_max_batch_size == 8
    cpu = export_triton(
        exports["tensorscatter"],
        tmp_path / "c",
        instance_kind="cpu",
        instances=2,
        translator_instances=3,
        max_batch_size=8,
        state_cache_len=20,
    ).repo_dir
    st = parse(cpu / STATEFUL_DECODER_MODEL / "config.pbtxt")
    assert st["instance_group"] == [{"count": 2, "kind": "KIND_CPU"}]
    assert st["sequence_batching"]["state"][0]["dims"][1] == "20"
    s = settings_of(cpu)
    # 2 instances x 8 candidate sequences shared by 3 translator instances
    assert s.state_cache_len == 20 and s.stateful_max_sequences == 16 // 3


def test_validation_catches_configs_that_do_not_match_the_graph(repos, tmp_path):
    repo = tmp_path / "r"
    shutil.copytree(repos["tensorscatter"], repo)
    path = repo / DECODER_MODEL / "config.pbtxt"
    good = path.read_text()
    path.write_text(
        good.replace('name: "logits"\n    data_type: TYPE_FP32', 'name: "logits"\n    data_type: TYPE_FP16')
    )
    with pytest.raises(
        TritonConfigError, match=r"decoder_step: output 'logits' is TYPE_FP16 in config.pbtxt, float32"
    ):
        validate_repository(repo)
    path.write_text(good.replace("dims: [ 4, -1, 8 ]", "dims: [ 4, 8 ]", 1))
    with pytest.raises(
        TritonConfigError, match=r"input 'self_key.0' has rank 3 in config.pbtxt .*, 4 in the graph"
    ):
        validate_repository(repo)
    path.write_text(good.replace("dims: [ 4, -1, 8 ]", "dims: [ 5, -1, 8 ]", 1))
    with pytest.raises(
        TritonConfigError, match=r"input 'self_key.0' axis 1 is 5 in config.pbtxt, 4 in the graph"
    ):
        validate_repository(repo)
    path.write_text(good.replace("max_batch_size: 64", "max_batch_sise: 64"))
    with pytest.raises(TritonConfigError, match="not a valid Triton model configuration"):
        validate_repository(repo)
    path.write_text(good)
    st = repo / STATEFUL_DECODER_MODEL / "config.pbtxt"
    st.write_text(st.read_text().replace('input_name: "self_value.1"', 'input_name: "self_value.7"'))
    with pytest.raises(
        TritonConfigError,
        match=r"state input 'self_value.7' is not a tensor of the graph[\s\S]*"
        r"graph inputs \['self_value.1'\] are neither",
    ):
        validate_repository(repo)


# ------------------------------------------------------------------------------------------
# decoding through the translator, Triton replaced by ONNX Runtime sessions
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_translator_greedy_and_beam_match_eager(repos, eager, flavour):
    server = FakeTriton(repos[flavour])
    translator = translator_module.Translator(settings_of(repos[flavour]))
    ids, lengths = sources(batch=3)
    request = {
        "input_ids": ids,
        "src_lengths": lengths,
        "max_decoding_length": np.array([MAX_NEW]),
        "min_decoding_length": np.array([3]),
    }
    greedy = translator.translate(request, server.infer_many)
    want, _ = eager_decodes(eager, ids, lengths, 1, min_new=3)
    assert unpack(greedy) == want and all(len(t) >= 3 for t in want)
    assert np.isnan(greedy["scores"]).all() and greedy["output_ids"].dtype == np.int64

    stateful = flavour == "tensorscatter"
    steps = server.calls(STATEFUL_DECODER_MODEL if stateful else DECODER_MODEL)
    assert steps and not server.calls(DECODER_MODEL if stateful else STATEFUL_DECODER_MODEL)
    if stateful:  # one sequence per row, the cache never crosses the BLS boundary, every sequence ended
        assert all(c["batch"] == 1 and not any(n.startswith("self_") for n in c["bytes"]) for c in steps)
        assert sum(1 for c in steps if c["flags"] & 1) == 3 and sum(1 for c in steps if c["flags"] & 2) == 3
        assert server.states == {}

    server.log.clear()
    beam = translator.translate({**request, "beam_size": np.array([3])}, server.infer_many)
    want, scores = eager_decodes(eager, ids, lengths, 3, min_new=3)
    assert unpack(beam) == want
    np.testing.assert_allclose(beam["scores"], scores, rtol=0, atol=1e-4)
    assert server.calls(DECODER_MODEL) and not server.calls(
        STATEFUL_DECODER_MODEL
    )  # beams need reordering here


def test_translator_defaults_chunks_and_fixed_cache_len(repos, eager, exports, tmp_path):
    # max_batch_size 2: the 4 sources (12 rows with 3 beams) go out in chunks; the default budget
    repo = export_triton(exports["tensorscatter"], tmp_path / "small", max_batch_size=2).repo_dir
    server = FakeTriton(repo)
    settings = settings_of(repo)
    assert settings.stateful_max_sequences == 2
    ids, lengths = sources(batch=4, seed=1)
    budget = decoding.max_decoding_length_for(lengths, 1.5, 10, cap=settings.state_cache_len)
    translator = translator_module.Translator(settings)
    greedy = translator.translate({"input_ids": ids}, server.infer_many)  # src_lengths from the padding
    assert unpack(greedy) == eager_decodes(eager, ids, lengths, 1, max_new=budget)[0]
    assert max(c["batch"] for c in server.log) <= 2 and server.states == {}
    beam = translator.translate(
        {"input_ids": ids, "beam_size": np.array([3]), "max_decoding_length": np.array([8])},
        server.infer_many,
    )
    assert unpack(beam) == eager_decodes(eager, ids, lengths, 3, max_new=8)[0]
    # a decoder with a static cache axis (TensorRT tensorscatter engines): larger buffers, same tokens
    fixed = translator_module.Translator(
        dataclasses.replace(settings_of(repos["portable"]), fixed_cache_len=20)
    )
    server = FakeTriton(repos["portable"])
    out = fixed.translate({"input_ids": ids, "max_decoding_length": np.array([8])}, server.infer_many)
    assert unpack(out) == eager_decodes(eager, ids, lengths, 1, max_new=8)[0]
    assert server.calls(DECODER_MODEL)[0]["bytes"]["self_key.0"] == 4 * 4 * 20 * 8 * 4


def test_bytes_per_step_sent_to_the_decoder(repos, exports):
    """What crosses the BLS boundary per step: the whole cache (stateless) or none of it (stateful)."""
    manifest = json.loads((exports["portable"] / MANIFEST_NAME).read_text())
    cfg = manifest["model_config"]
    ids, lengths = sources(batch=2)
    request = {
        "input_ids": ids,
        "src_lengths": lengths,
        "max_decoding_length": np.array([10]),
        "min_decoding_length": np.array([10]),
    }
    portable = FakeTriton(repos["portable"])
    translator_module.Translator(settings_of(repos["portable"])).translate(request, portable.infer_many)
    steps = portable.calls(DECODER_MODEL)
    assert len(steps) == 10
    sent = sum(v for n, v in steps[0]["bytes"].items() if n.startswith("self_"))
    assert sent == cache_bytes_per_step(cfg, rows=2, cache_len=10) == 2 * 2 * 2 * 4 * 10 * 8 * 4
    stateful = FakeTriton(repos["tensorscatter"])
    translator_module.Translator(settings_of(repos["tensorscatter"])).translate(request, stateful.infer_many)
    steps = stateful.calls(STATEFUL_DECODER_MODEL)
    assert len(steps) == 2 * 10 and all(not any(n.startswith("self_") for n in c["bytes"]) for c in steps)


def test_bad_requests_are_refused_with_a_message(repos):
    server = FakeTriton(repos["tensorscatter"])
    translator = translator_module.Translator(settings_of(repos["tensorscatter"]))
    ids, lengths = sources(batch=2)
    cases = [
        # the search's and the runners' own checks (transformer_ext.decoding), as the client sees them
        ({"input_ids": ids.astype(np.float32)}, "input_ids must hold integer token ids, got dtype float32"),
        ({"input_ids": ids[0]}, r"input_ids must be a non-empty \[batch, src_len\] array"),
        (
            {"input_ids": ids + 100},
            r"input_ids\[0, 0\] = \d+ \(row 0\) is not a source token id: the source "
            r"vocabulary has ids 0 \.\. 47",
        ),
        ({"input_ids": ids, "src_lengths": np.array([0, 3])}, r"src_lengths must be in \[1, 7\]"),
        ({"input_ids": ids, "src_lengths": np.array([3])}, r"src_lengths must have shape \(2,\)"),
        ({"input_ids": ids, "max_new_tokens": np.array([65])}, "max_new_tokens must be at most 64"),
        ({"input_ids": ids, "beam_size": np.array([17])}, "beam_size must be at most 16"),
        ({"input_ids": ids, "beam_size": np.array([0])}, "beam_size must be >= 1"),
    ]
    for arrays, message in cases:
        with pytest.raises(translator_module.TranslationRequestError, match=message):
            translator.translate(arrays, server.infer_many)
    assert server.log == []


def test_failing_step_still_ends_the_sequences(repos):
    server = FakeTriton(repos["tensorscatter"])
    translator = translator_module.Translator(settings_of(repos["tensorscatter"]))
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 4:  # encoder, step 0, step 1, then the server fails
            raise RuntimeError("decoder_step_stateful: the server went away")
        return server.infer_many(batch)

    ids, lengths = sources(batch=2)
    with pytest.raises(RuntimeError, match="went away"):
        translator.translate({"input_ids": ids, "max_decoding_length": np.array([8])}, flaky)
    assert server.states == {}  # END sent for both sequences


def test_translator_runners_use_the_shared_checks(repos):
    """A bad step token or beam index is refused with transformer_ext.decoding's own message (the
    vendored module's checks, not a copy in model.py)."""
    settings = settings_of(repos["portable"])
    server = FakeTriton(repos["portable"])
    runner = translator_module.StatelessRunner(settings, server.infer_many)
    ids, lengths = sources(batch=2)
    state = runner.encode(ids, lengths, 4, 2)  # 4 rows
    with pytest.raises(
        ValueError,
        match=r"tokens\[1\] = 40 \(row 1\) is not a target token id: the target vocabulary "
        r"has ids 0 \.\. 39",
    ):
        runner.step(state, np.array([1, 40, 1, 1]))
    runner.step(state, np.ones(4, dtype=np.int64))
    with pytest.raises(
        IndexError, match=r"beam_index\[2\] = 4 is not a row of the decoding state: rows are 0 \.\. 3"
    ):
        runner.reorder(state, np.array([0, 1, 4, 3]))
    state.position = settings.max_positions  # past the positional encodings (and the cache)
    with pytest.raises(IndexError, match="cannot feed a token at position"):
        runner.step(state, np.ones(4, dtype=np.int64))


def test_generation_config_of_the_export_sets_the_translators_defaults(exports, eager, tmp_path):
    folder = tmp_path / "export"
    shutil.copytree(exports["portable"], folder)
    generation = json.loads((folder / "generation.json").read_text())
    generation.update(
        beam_size=3,
        length_penalty="average",
        alpha=1.0,
        max_len_a=0.0,
        max_len_b=5,
        min_new_tokens=2,
        max_new_tokens=4,
    )
    (folder / "generation.json").write_text(json.dumps(generation))
    rehash_export(folder)  # an edit the manifest knows of (it records every file's SHA-256)
    repo = export_triton(folder, tmp_path / "repo").repo_dir
    settings = settings_of(repo)
    assert (
        settings.beam_size,
        settings.length_penalty_type,
        settings.length_penalty,
        settings.max_len_a,
        settings.max_len_b,
        settings.min_decoding_length,
        settings.max_decoding_length,
    ) == (3, "average", 1.0, 0.0, 5.0, 2, 4)
    server = FakeTriton(repo)
    ids, lengths = sources(batch=2)
    out = translator_module.Translator(settings).translate(
        {"input_ids": ids, "src_lengths": lengths}, server.infer_many
    )
    c = eager.info
    hyps = decoding.beam_search(
        eager,
        ids,
        lengths,
        bos_id=c.bos_id,
        eos_id=c.eos_id,
        beam_size=3,
        num_hypotheses=1,
        max_decoding_length=4,
        min_decoding_length=2,
        length_penalty_type="average",
        length_penalty=1.0,
    )
    assert unpack(out) == [h[0].tokens for h in hyps]  # min(floor(0 * n + 5), 4) = 4 tokens, beam 3
    np.testing.assert_allclose(out["scores"], [h[0].score for h in hyps], rtol=0, atol=1e-4)
    (folder / "generation.json").write_text(json.dumps({**generation, "beam_size": 0}))
    rehash_export(folder)
    with pytest.raises(ManifestError, match=r"generation.json: beam_size must be >= 1, got 0"):
        export_triton(folder, tmp_path / "repo2")
    assert not (tmp_path / "repo2").exists()


def test_validation_refuses_a_vendored_module_that_is_not_the_packages(repos, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(repos["portable"], repo)
    vendored = repo / TRANSLATOR_MODEL / "1" / "_vendor" / "transformer_ext" / "decoding" / "beam.py"
    vendored.write_bytes(vendored.read_bytes() + b"\n# edited\n")
    with pytest.raises(
        TritonConfigError,
        match=r"_vendor/transformer_ext/decoding/beam.py is not a copy of transformer_ext.decoding.beam",
    ):
        validate_repository(repo)


# ------------------------------------------------------------------------------------------
# the Python-backend model itself (TritonPythonModel over the fake pb_utils)
# ------------------------------------------------------------------------------------------


def load_repo_model(repo: Path, server: FakeTriton, monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_pb_utils(server))
    monkeypatch.setattr(sys, "path", list(sys.path))  # the model adds its _vendor folder
    spec = importlib.util.spec_from_file_location(
        "translator_model_under_test", repo / TRANSLATOR_MODEL / "1" / "model.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_triton_python_model_executes_requests_through_bls(repos, eager, monkeypatch):
    repo = repos["tensorscatter"]
    server = FakeTriton(repo)
    module = load_repo_model(repo, server, monkeypatch)
    pb = module.pb_utils
    config = parse(repo / TRANSLATOR_MODEL / "config.pbtxt")
    model = module.TritonPythonModel()
    model.initialize(
        {"model_config": json.dumps(config), "model_name": TRANSLATOR_MODEL, "model_version": "1"}
    )
    ids, lengths = sources(batch=3, seed=2)
    good = pb.InferenceRequest(
        inputs=[
            pb.Tensor("input_ids", ids),
            pb.Tensor("src_lengths", lengths),
            pb.Tensor("max_new_tokens", np.array([MAX_NEW])),
        ]
    )
    beam = pb.InferenceRequest(
        inputs=[
            pb.Tensor("input_ids", ids),
            pb.Tensor("max_new_tokens", np.array([MAX_NEW])),
            pb.Tensor("beam_size", np.array([2])),
        ]
    )
    bad = pb.InferenceRequest(
        inputs=[pb.Tensor("input_ids", ids), pb.Tensor("max_new_tokens", np.array([1000]))]
    )
    responses = asyncio.run(model.execute([good, bad, beam]))
    assert len(responses) == 3
    assert not responses[0].has_error() and not responses[2].has_error()
    out = {t.name(): t.as_numpy() for t in responses[0].output_tensors()}
    assert set(out) == {"output_ids", "output_lengths", "scores"}
    assert unpack(out) == eager_decodes(eager, ids, lengths, 1)[0]
    out = {t.name(): t.as_numpy() for t in responses[2].output_tensors()}
    assert unpack(out) == eager_decodes(eager, ids, lengths, 2)[0]
    assert responses[1].has_error() and "max_new_tokens must be at most 64" in responses[1].error().message()
    assert server.states == {}


def test_repository_translator_imports_its_vendored_decoding(repos, tmp_path):
    """In a clean interpreter (as in Triton's Python backend) model.py finds the decoding code
    copied next to it, not the source tree's."""
    folder = repos["portable"] / TRANSLATOR_MODEL / "1"
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import model; "
        "print(model.decoding.__file__); print(model.pb_utils)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", code, os.fspath(folder)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    path, pb = done.stdout.split()
    assert (
        Path(path).resolve()
        == (folder / "_vendor" / "transformer_ext" / "decoding" / "__init__.py").resolve()
    )
    assert pb == "None"  # triton_python_backend_utils exists only inside Triton


# ------------------------------------------------------------------------------------------
# TensorRT plans (engines described in the manifest; no TensorRT needed to write the repository)
# ------------------------------------------------------------------------------------------


def with_fake_engines(
    export_dir: Path,
    out: Path,
    precision: str = "fp32",
    batch_max: int = 8,
    cache_max: int = 16,
    src_max: int = 32,
) -> Path:
    """A copy of ``export_dir`` whose manifest lists engines like ``python -m export.tensorrt`` writes."""
    shutil.copytree(export_dir, out)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    flavour = manifest["flavour"]
    cache_dtype = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[precision]
    pinned = {"cache_len": cache_max} if flavour == "tensorscatter" else {}
    engines = {}
    for graph, spec in manifest["graphs"].items():
        data = f"fake {precision} engine of {graph}".encode()
        (out / f"{graph}.{precision}.engine").write_bytes(data)
        io = {}
        for mode, tensors in (("input", spec["inputs"]), ("output", spec["outputs"])):
            for t in tensors:
                dtype = cache_dtype if t["dtype"] == "float32" and t["name"] != "logits" else t["dtype"]
                shape = [pinned.get(d, -1) if isinstance(d, str) else d for d in t["shape"]]
                io[t["name"]] = {"mode": mode, "dtype": dtype, "shape": shape}
        profile = {
            "input_ids": {
                "min": [1, 1],
                "opt": [4, 8],
                "max": [batch_max, src_max if graph == "encoder" else 1],
            }
        }
        if graph == "decoder_step":
            H, d_k = io["self_key.0"]["shape"][1], io["self_key.0"]["shape"][3]
            profile["self_key.0"] = {
                "min": [1, H, cache_max if pinned else 1, d_k],
                "opt": [4, H, cache_max, d_k],
                "max": [batch_max, H, cache_max, d_k],
            }
        engines[graph] = {
            "file": f"{graph}.{precision}.engine",
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "profile": profile,
            "io_dtypes": {n: v["dtype"] for n, v in io.items()},
            "io": io,
            "pinned_axes": pinned if graph == "decoder_step" else {},
        }
    manifest["tensorrt"] = {
        "cache_dtypes": {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"},
        "engines": {
            precision: {
                "precision": precision,
                "cache_dtype": cache_dtype,
                "flavour": flavour,
                "engines": engines,
            }
        },
    }
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))
    return out


def test_tensorrt_plans_when_engines_exist(exports, tmp_path):
    folder = with_fake_engines(exports["tensorscatter"], tmp_path / "e", precision="fp16")
    result = export_triton(folder, tmp_path / "repo")
    repo = result.repo_dir
    assert (result.backend, result.precision) == ("tensorrt", "fp16") and result.protobuf_checked
    for name in (ENCODER_MODEL, DECODER_MODEL, STATEFUL_DECODER_MODEL):
        c = parse(repo / name / "config.pbtxt")
        assert c["platform"] == "tensorrt_plan" and c["max_batch_size"] == 8  # capped by the profile
        assert c["instance_group"] == [{"count": 1, "kind": "KIND_GPU"}]
        assert (repo / name / "1" / "model.plan").read_bytes() == (
            folder / f"{c['name'].replace('_stateful', '')}.fp16.engine"
        ).read_bytes()
    dec = parse(repo / DECODER_MODEL / "config.pbtxt")
    inputs = {e["name"]: e for e in dec["input"]}
    assert inputs["self_key.0"]["data_type"] == "TYPE_FP16" and inputs["self_key.0"]["dims"] == [
        "4",
        "16",
        "8",
    ]
    assert {e["name"]: e for e in dec["output"]}["logits"]["data_type"] == "TYPE_FP32"
    state = parse(repo / STATEFUL_DECODER_MODEL / "config.pbtxt")["sequence_batching"]["state"][0]
    assert state["dims"] == ["4", "16", "8"] and state["data_type"] == "TYPE_FP16"
    assert state["use_same_buffer_for_input_output"] is True
    s = settings_of(repo)
    assert (s.fixed_cache_len, s.state_cache_len, s.max_cache_len, s.max_src_len, s.cache_dtype) == (
        16,
        16,
        16,
        32,
        "float16",
    )
    assert s.encoder_max_batch_size == s.decoder_max_batch_size == 8
    # the same folder served by ONNX Runtime on CPUs
    cpu = export_triton(folder, tmp_path / "cpu", instance_kind="cpu")
    assert cpu.backend == "onnxruntime" and (cpu.repo_dir / ENCODER_MODEL / "1" / "model.onnx").is_file()


def test_tensorrt_bad_input(exports, tmp_path):
    with pytest.raises(TritonExportError, match="lists no TensorRT engines.*export.tensorrt"):
        export_triton(exports["portable"], tmp_path / "a", backend="tensorrt")
    folder = with_fake_engines(exports["portable"], tmp_path / "e")
    with pytest.raises(TritonExportError, match="TensorRT plans run on GPUs only"):
        export_triton(folder, tmp_path / "b", backend="tensorrt", instance_kind="cpu")
    with pytest.raises(TritonExportError, match=r"no fp16 engines .*\['fp32'\]"):
        export_triton(folder, tmp_path / "c", precision="fp16")
    (folder / "decoder_step.fp32.engine").write_bytes(b"tampered")
    with pytest.raises(TritonExportError, match="does not match the sha256"):
        export_triton(folder, tmp_path / "d")
    bf16 = with_fake_engines(exports["portable"], tmp_path / "bf", precision="bf16")
    with pytest.raises(TritonExportError, match="numpy has no bfloat16"):
        export_triton(bf16, tmp_path / "f")
    assert not any((tmp_path / n).exists() for n in "abcdf")


# ------------------------------------------------------------------------------------------
# bad input: no manifest, an occupied target, a failure midway, the CLI
# ------------------------------------------------------------------------------------------


def test_export_folder_without_manifest(exports, tmp_path, capsys):
    folder = tmp_path / "no_manifest"
    shutil.copytree(exports["portable"], folder)
    (folder / MANIFEST_NAME).unlink()
    with pytest.raises(ManifestError, match=r"manifest.json not found: an export folder holds encoder.onnx"):
        export_triton(folder, tmp_path / "repo")
    with pytest.raises(ManifestError, match="export folder not found"):
        export_triton(tmp_path / "nowhere", tmp_path / "repo")
    assert main(["--model", os.fspath(folder), "--output-dir", os.fspath(tmp_path / "repo")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("python -m export.triton: error: ") and "manifest.json not found" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["no_manifest"]  # nothing written


def test_existing_repository_is_refused_unless_forced(exports, tmp_path, capsys):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "mine.txt").write_text("not yours")
    with pytest.raises(TritonExportError, match="not empty; refusing to overwrite it.*--force"):
        export_triton(exports["portable"], repo)
    assert main(["--model", os.fspath(exports["portable"]), "--output-dir", os.fspath(repo)]) == 1
    assert "--force" in capsys.readouterr().err
    # --force replaces only a repository this tool wrote: not a folder of the user's
    assert main(["--model", os.fspath(exports["portable"]), "--output-dir", os.fspath(repo), "--force"]) == 1
    assert "not a model repository written by python -m export.triton" in capsys.readouterr().err
    assert sorted(p.name for p in repo.iterdir()) == ["mine.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputFolderError, match="is not a folder"):
        export_triton(exports["portable"], tmp_path / "file", force=True)
    (repo / "mine.txt").unlink()
    assert (
        main(["--model", os.fspath(exports["portable"]), "--output-dir", os.fspath(repo)]) == 0
    )  # empty: used
    assert main(["--model", os.fspath(exports["portable"]), "--output-dir", os.fspath(repo), "--force"]) == 0
    out = capsys.readouterr().out
    assert f"tritonserver --model-repository={repo}" in out
    assert sorted(p.name for p in repo.iterdir()) == [
        DECODER_MODEL,
        ENCODER_MODEL,
        MARKER_FILE,
        TRANSLATOR_MODEL,
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "repo"]  # no temp or backup folder left


def test_a_failure_midway_leaves_no_repository(exports, tmp_path, monkeypatch):
    def broken(model_dir):
        (model_dir / "1").mkdir(parents=True)
        raise OSError("disk full")

    monkeypatch.setattr(triton_export, "_write_translator", broken)
    with pytest.raises(OSError, match="disk full"):
        export_triton(exports["portable"], tmp_path / "repo")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    good = export_triton(exports["portable"], tmp_path / "repo").repo_dir
    before = sorted(str(p.relative_to(good)) for p in good.rglob("*"))
    monkeypatch.setattr(triton_export, "_write_translator", broken)
    with pytest.raises(OSError, match="disk full"):
        export_triton(exports["tensorscatter"], good, force=True)
    assert sorted(str(p.relative_to(good)) for p in good.rglob("*")) == before  # the old one is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]


def test_bad_options(exports, tmp_path):
    with pytest.raises(TritonExportError, match="needs the tensorscatter flavour"):
        export_triton(exports["portable"], tmp_path / "a", stateful=True)
    with pytest.raises(TritonExportError, match=r"--state-cache-len must be in \[1, 64\]"):
        export_triton(exports["tensorscatter"], tmp_path / "b", state_cache_len=65)
    with pytest.raises(ValueError, match="max_batch_size must be an int >= 1"):
        export_triton(exports["portable"], tmp_path / "c", max_batch_size=0)
    with pytest.raises(ValueError, match="backend must be one of"):
        export_triton(exports["portable"], tmp_path / "d", backend="tensorflow")
    with pytest.raises(TritonExportError, match="--precision selects TensorRT engines"):
        export_triton(exports["portable"], tmp_path / "e", backend="onnxruntime", precision="fp16")
    no_state = export_triton(
        exports["tensorscatter"], tmp_path / "f", stateful=False, translator=False
    ).repo_dir
    assert sorted(p.name for p in no_state.iterdir()) == [DECODER_MODEL, ENCODER_MODEL, MARKER_FILE]
    assert not any((tmp_path / n).exists() for n in "abcde")
    with pytest.raises(
        TritonExportError, match="3 translator instances cannot share 2 stateful sequence slots"
    ):
        export_triton(exports["tensorscatter"], tmp_path / "g", max_batch_size=2, translator_instances=3)


# ------------------------------------------------------------------------------------------
# models converted from transformers: their generation defaults reach the translator
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["marian", "m2m100"])
def test_translator_of_an_imported_model_decodes_as_generate(tmp_path, family):
    """A checkpoint written by transformers, converted, exported and put in a repository: the
    translator bans Marian's <pad>, forces M2M100's target language (sent as target_prefix),
    forces EOS at max_length and gives every source max_length - 1 new tokens, so that its greedy
    and beam tokens (the checkpoint's num_beams, transformers' length penalty and early stopping)
    equal transformers' generate() on the same source ids. Without the prefix an M2M100 request
    is refused."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("sentencepiece")
    import torch
    from hf_checkpoints import sample_lines, write_m2m100, write_marian

    from export.onnx import export_onnx
    from transformer_ext.convert import convert_transformers
    from transformer_ext.tokenizer import load_tokenizer

    if family == "marian":
        hf = write_marian(tmp_path / "hf", seed=2)
    else:
        hf = write_m2m100(tmp_path / "hf", seed=3)
    ours = convert_transformers(hf, tmp_path / "ours")
    export = export_onnx(ours, tmp_path / "export", cache_len=64, validate=False).output_dir
    repo = export_triton(export, tmp_path / "repo").repo_dir
    settings = settings_of(repo)
    tok = load_tokenizer(ours)
    if family == "m2m100":
        tok = tok.with_languages("fr", "es")
    rows = [tok.encode_source(t) for t in sample_lines(12, seed=31)]
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    ids = np.full((len(rows), int(lengths.max())), settings.pad_id, dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    request = {"input_ids": ids, "src_lengths": lengths}
    hf_options = {}
    if family == "m2m100":
        prefix = list(tok.forced_target_prefix())
        request["target_prefix"] = np.array([prefix], dtype=np.int64)
        hf_options["forced_bos_token_id"] = prefix[0]
    else:
        assert settings.banned == [settings.pad_id]  # Marian's <pad> is banned
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(hf).eval()
    mask = torch.from_numpy(np.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    server = FakeTriton(repo)
    translator = translator_module.Translator(settings)
    for beam in (settings.beam_size, 1):
        with torch.no_grad():
            out = model.generate(
                input_ids=torch.from_numpy(ids), attention_mask=mask, num_beams=beam, **hf_options
            )
        eos, pad = model.config.eos_token_id, model.config.pad_token_id
        want = []
        for row in out[:, 1:].tolist():
            row = row[: row.index(eos)] if eos in row else row
            want.append([t for t in row if t != pad])
        got = unpack(translator.translate({**request, "beam_size": np.array([beam])}, server.infer_many))
        assert got == want, (family, beam)
    assert (
        settings.beam_size == 4 and len({tuple(w) for w in want}) > 1
    )  # the checkpoint's beams; outputs vary
    if family == "m2m100":
        del request["target_prefix"]
        with pytest.raises(translator_module.TranslationRequestError, match="send target_prefix"):
            translator.translate(request, server.infer_many)


def test_settings_of_a_repository_without_the_imported_model_parameters(repos):
    """A translator config.pbtxt written before the generation-defaults parameters existed still
    loads: nothing banned or forced."""
    params = parse(repos["portable"] / TRANSLATOR_MODEL / "config.pbtxt")["parameters"]
    for name in ("banned_ids", "force_eos_at_budget", "early_stopping", "forced_target_prefix"):
        params.pop(name, None)
    settings = translator_module.Settings.from_parameters(params)
    assert (settings.banned, settings.force_eos_at_budget, settings.early_stopping_rule) == ([], 0, None)
    assert settings.forced_target_prefix == 0
