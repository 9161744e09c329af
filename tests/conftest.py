import os
import signal
import threading
from pathlib import Path

import pytest
import torch

# Two cores on CI: keep intra-op threads bounded so parallel kernels are exercised but not oversubscribed.
torch.set_num_threads(min(2, os.cpu_count() or 1))

HAS_CUDA = torch.cuda.is_available()


def cuda_built() -> bool:
    from transformer_ext import ops

    return ops.cuda_kernels_built()


def device_params():
    """CPU always; CUDA as a skipped case with a reason when it cannot run here."""
    return [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU visible on this machine"),
        ),
    ]


@pytest.fixture(scope="session")
def exported_portable(tmp_path_factory) -> Path:
    """The tiny model exported in the portable flavour, once per session (helpers.exported_dir)."""
    from helpers import exported_dir

    return exported_dir(tmp_path_factory, "portable")


@pytest.fixture
def fast_export(monkeypatch, exported_portable):
    """Replace export.onnx's tracing by a copy of the session's portable graphs (the rest runs for real)."""
    import onnx

    from export import onnx as export_mod

    calls = []

    def fake_export_graph(module, args, spec, n_positional, opset, flavour, path, **kwargs):
        proto = onnx.load(exported_portable / path.name)
        onnx.save(proto, path)
        calls.append(path.name)
        return proto

    monkeypatch.setattr(export_mod, "_export_graph", fake_export_graph)
    return calls


@pytest.fixture(autouse=True)
def _sigint_deliverable():
    """SIGINT raises KeyboardInterrupt in every test, even when pytest was started with it ignored.

    A shell that runs pytest in the background, ``nohup`` and some CI runners start it with SIGINT
    ignored; the tests that interrupt a command with SIGINT (in this process or in a child, which
    inherits the disposition) need it delivered. The disposition is restored after each test.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if previous is signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
