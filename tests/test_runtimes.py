"""transformer_ext.runtimes: every runner in one package, torch loaded only by the runners that
need it, and the old import paths as warning aliases of the same objects."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import transformer_ext.runtimes as runtimes

REPO = Path(__file__).resolve().parents[1]

RUNNERS = ["EagerRunner", "CatCacheRunner", "OrtRunner", "OrtCudaRunner", "TensorRTRunner"]
# old module -> (new module, names that must be the very same objects)
OLD_PATHS = {
    "export.ort_runner": (
        "transformer_ext.runtimes.ort",
        ["OrtRunner", "OrtState", "GRAPH_OPTIMIZATION_LEVELS"],
    ),
    "export.ort_cuda_runner": (
        "transformer_ext.runtimes.ort_cuda",
        ["OrtCudaRunner", "session_io", "ORT_TYPES"],
    ),
    "export.trt_runner": ("transformer_ext.runtimes.trt", ["TensorRTRunner", "engine_io", "TRT_DTYPE_NAMES"]),
    "transformer_ext.runner": (
        "transformer_ext.runtimes.eager",
        ["EagerRunner", "EagerState", "CompileError"],
    ),
}
# names the old modules held that now live in a second new module
OLD_EXTRA = {
    "export.trt_runner": (
        "transformer_ext.runtimes.device",
        [
            "DeviceRunner",
            "DeviceState",
            "BindingError",
            "ModelDims",
            "ProfileLimits",
            "TORCH_DTYPES",
            "decoder_bindings",
            "encoder_bindings",
            "_dtype_name",
        ],
    ),
    "transformer_ext.runner": (
        "transformer_ext.runtimes.baseline",
        ["CatCacheRunner", "CatCacheState", "greedy_decode_uncached"],
    ),
}
MOVED_MESSAGE = "is deprecated and will be removed: import from transformer_ext.runtimes"


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_every_runner_from_one_package():
    from transformer_ext.decoding import Runner
    from transformer_ext.runtimes import CatCacheRunner, EagerRunner, OrtCudaRunner, OrtRunner, TensorRTRunner

    for cls in (EagerRunner, CatCacheRunner, OrtRunner, OrtCudaRunner, TensorRTRunner):
        assert cls.__module__.startswith("transformer_ext.runtimes."), cls
        for method in ("encode", "step", "reorder"):
            assert callable(getattr(cls, method, None)), (cls, method)
    assert issubclass(OrtCudaRunner, runtimes.DeviceRunner) and issubclass(
        TensorRTRunner, runtimes.DeviceRunner
    )
    assert runtimes.DeviceRunner.__module__ == "transformer_ext.runtimes.device"  # its own module
    assert set(RUNNERS) <= set(runtimes.__all__) and set(RUNNERS) <= set(dir(runtimes))
    assert sorted(runtimes.__all__) == sorted(runtimes._EXPORTS)  # the literal list names every export
    for name in runtimes.__all__:
        assert getattr(runtimes, name) is not None
    assert Runner is not None
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchRunner'"):
        runtimes.NoSuchRunner  # noqa: B018


def test_package_and_ort_runner_load_no_torch():
    """The package loads nothing on import; OrtRunner loads onnxruntime and numpy, never torch
    (an `import torch` anywhere on the way would fail here)."""
    proc = _python(
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "import transformer_ext.runtimes as r\n"
        "assert 'onnxruntime' not in sys.modules and 'numpy' not in sys.modules, sorted(sys.modules)\n"
        "from transformer_ext.runtimes import OrtRunner\n"
        "assert OrtRunner.__module__ == 'transformer_ext.runtimes.ort'\n"
        "try:\n"
        "    r.EagerRunner\n"
        "except ImportError:\n"
        "    print('eager needs torch')\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "eager needs torch"


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_old_path_warns_and_reexports_the_same_objects(old, monkeypatch):
    new, names = OLD_PATHS[old]
    new_module = importlib.import_module(new)
    monkeypatch.delitem(sys.modules, old, raising=False)  # import it afresh (restored afterwards)
    with pytest.warns(DeprecationWarning, match=rf"^{old} {MOVED_MESSAGE}") as record:
        module = importlib.import_module(old)
    assert all(Path(w.filename).name != "_moved.py" for w in record)  # attributed to the importer
    for name in names:
        assert getattr(module, name) is getattr(new_module, name), name
    if old in OLD_EXTRA:
        extra, extra_names = OLD_EXTRA[old]
        extra_module = importlib.import_module(extra)
        for name in extra_names:
            assert getattr(module, name) is getattr(extra_module, name), name
    assert set(names) <= set(module.__all__)


def test_isinstance_across_old_and_new_paths(monkeypatch):
    monkeypatch.delitem(sys.modules, "transformer_ext.runner", raising=False)
    with pytest.warns(DeprecationWarning):
        old = importlib.import_module("transformer_ext.runner")
    from transformer_ext.config import TransformerConfig
    from transformer_ext.model import Transformer

    runner = old.EagerRunner(Transformer(TransformerConfig.preset("tiny", dropout=0.0)), "cpu")
    assert isinstance(runner, runtimes.EagerRunner)


def test_new_paths_emit_no_deprecation_warning():
    """Nothing in the runtime package or the translator goes through an old path."""
    proc = _python(
        "import warnings\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    import transformer_ext.runtimes as r\n"
        "    for name in r.__all__:\n"
        "        getattr(r, name)\n"
        "    import transformer_ext.translate, transformer_ext.tokenizer\n"
        f"bad = [str(w.message) for w in seen if {MOVED_MESSAGE!r} in str(w.message)]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
