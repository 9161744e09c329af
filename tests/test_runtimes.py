"""transformer_ext.runtimes: every runner in one package, torch loaded only by the runners that
need it, one description record per runner (RunnerInfo) and one way to open an export folder
(open_export_dir)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import transformer_ext.runtimes as runtimes
from export import trt_readiness
from transformer_ext.export_format import MANIFEST_NAME

REPO = Path(__file__).resolve().parents[1]

RUNNERS = ["EagerRunner", "CatCacheRunner", "OrtRunner", "OrtCudaRunner", "TensorRTRunner"]
# Import paths that were aliases of the runtime modules, removed.
REMOVED_MODULES = [
    "export.ort_runner",
    "export.ort_cuda_runner",
    "export.trt_runner",
    "transformer_ext.runner",
]
# What every runner's info must give, from the model config the test reads itself.
CONFIG_FIELDS = {
    "n_layers": lambda c: c["n_decoder_layers"],
    "n_heads": lambda c: c["n_heads"],
    "d_k": lambda c: c["d_model"] // c["n_heads"],
    "d_model": lambda c: c["d_model"],
    "tgt_vocab_size": lambda c: c["tgt_vocab_size"],
    "src_vocab_size": lambda c: c["src_vocab_size"],
    "pad_id": lambda c: c["pad_id"],
    "bos_id": lambda c: c["bos_id"],
    "eos_id": lambda c: c["eos_id"],
    "max_positions": lambda c: c["max_len"],
}


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def exported(exported_portable) -> Path:
    return exported_portable


def _manifest(export_dir: Path) -> dict:
    return json.loads((export_dir / MANIFEST_NAME).read_text())


def _model(export_dir: Path):
    from transformer_ext.checkpoint import load_model

    return load_model(_manifest(export_dir)["export"]["source_model_dir"])


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
    """The package loads nothing on import; OrtRunner and the factory load onnxruntime and numpy,
    never torch (an `import torch` anywhere on the way would fail here)."""
    proc = _python(
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "import transformer_ext.runtimes as r\n"
        "assert 'onnxruntime' not in sys.modules and 'numpy' not in sys.modules, sorted(sys.modules)\n"
        "from transformer_ext.runtimes import RunnerInfo, open_export_dir\n"
        "assert 'onnxruntime' not in sys.modules, 'the factory imports onnxruntime only to open a folder'\n"
        "from transformer_ext.runtimes import OrtRunner\n"
        "assert OrtRunner.__module__ == 'transformer_ext.runtimes.ort'\n"
        "try:\n"
        "    r.EagerRunner\n"
        "except ImportError:\n"
        "    print('eager needs torch')\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "eager needs torch"


@pytest.mark.parametrize("old", REMOVED_MODULES)
def test_the_old_alias_modules_are_gone(old):
    """(An editable install of another checkout may still map the name to its own file.)"""
    spec = importlib.util.find_spec(old)
    assert spec is None or not Path(spec.origin).resolve().is_relative_to(REPO), spec.origin


def test_the_old_manifest_reader_alias_is_gone():
    assert not hasattr(trt_readiness, "read_manifest")  # transformer_ext.export_format.read_manifest


def test_no_module_warns_on_import():
    """Nothing in the runtime package or the translator warns when imported."""
    proc = _python(
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    import transformer_ext.runtimes as r\n"
        "    for name in r.__all__:\n"
        "        getattr(r, name)\n"
        "    import transformer_ext.translate, transformer_ext.translator, transformer_ext.tokenizer\n"
        "bad = [str(w.message) for w in seen if 'transformer_ext' in str(w.filename)]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


# ------------------------------------------------------------------------------------------
# one description record per runner
# ------------------------------------------------------------------------------------------


def _runner(kind: str, export_dir: Path):
    if kind == "eager":
        return runtimes.EagerRunner(_model(export_dir), "cpu")
    if kind == "catcache":
        return runtimes.CatCacheRunner(_model(export_dir), "cpu")
    if kind == "ort":
        return runtimes.OrtRunner(export_dir, intra_op_num_threads=1)
    if kind == "ort_cuda":
        return runtimes.OrtCudaRunner(export_dir, device="cpu", intra_op_num_threads=1)
    from fake_tensorrt import fake_engines

    model = _model(export_dir)
    enc, dec = fake_engines(
        model, "portable", torch.device("cpu"), [], max_rows=12, max_src=20, cache=(2, 30)
    )
    config = _manifest(export_dir)["model_config"]
    return runtimes.TensorRTRunner(enc, dec, config=config, device="cpu")


@pytest.mark.parametrize("kind", ["eager", "catcache", "ort", "ort_cuda", "tensorrt"])
def test_every_runner_describes_its_model_in_one_record(exported, kind):
    runner = _runner(kind, exported)
    info = runner.info
    assert isinstance(info, runtimes.RunnerInfo)
    config = _manifest(exported)["model_config"]  # read here, from the file
    for name, expected in CONFIG_FIELDS.items():
        assert getattr(info, name) == expected(config), (kind, name)
    assert info.precision == "fp32"
    assert info.runtime == {"eager": "eager", "catcache": "eager", "tensorrt": "tensorrt"}.get(
        kind, "onnxruntime"
    )
    assert info.flavour == (None if kind in ("eager", "catcache") else "portable")
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.max_positions = 1  # read-only
    with pytest.raises(TypeError):
        info.config["max_len"] = 1  # type: ignore[index]
    for old in ("bos_id", "eos_id", "pad_id", "max_len", "vocab_size", "dims", "limits", "config", "flavour"):
        assert not hasattr(runner, old), (kind, old)  # no second, ad-hoc description


def test_export_runners_report_the_export_cache_capacity(exported):
    manifest = _manifest(exported)
    for kind in ("ort", "ort_cuda"):
        info = _runner(kind, exported).info
        assert info.max_cache_len == manifest["max_cache_len"]
        assert info.config_file == str(exported / MANIFEST_NAME)
        assert info.generation_limit == min(manifest["max_cache_len"], manifest["model_config"]["max_len"])


def test_tensorrt_runner_reports_its_profile_limits(exported):
    info = _runner("tensorrt", exported).info
    assert (info.max_rows, info.max_sources) == (12, 12)  # the fake profiles' maximum batch
    assert (info.min_src_len, info.max_src_len) == (1, 20)
    assert (info.min_cache_len, info.max_cache_len, info.static_cache_len) == (2, 30, None)
    max_len = _manifest(exported)["model_config"]["max_len"]
    assert info.source_limit == min(20, max_len) and info.generation_limit == min(30, max_len)


def test_eager_runner_precision_follows_the_weights(exported):
    model = _model(exported).to(torch.float64)
    assert runtimes.EagerRunner(model, "cpu").info.precision == "float64"  # named as torch names it
    model = model.to(torch.bfloat16)
    assert runtimes.EagerRunner(model, "cpu").info.precision == "bf16"


def test_search_methods_take_the_special_ids_from_the_record(exported):
    from transformer_ext import decoding

    runner = runtimes.OrtRunner(exported, intra_op_num_threads=1)
    config = _manifest(exported)["model_config"]
    ids, lengths = np.array([[5, 6, 7]]), np.array([3])
    assert runner.greedy(ids, lengths, max_decoding_length=5) == decoding.greedy_decode(
        runner, ids, lengths, bos_id=config["bos_id"], eos_id=config["eos_id"], max_decoding_length=5
    )


# ------------------------------------------------------------------------------------------
# open_export_dir: one way to open an export folder
# ------------------------------------------------------------------------------------------


def test_open_export_dir_reads_the_manifest_once(exported, monkeypatch):
    """The translator reads manifest.json and hands it to the factory, which hands it to the
    runner: one read (it was three: translator, then the runner, each with its own reader)."""
    from transformer_ext import export_format, translator
    from transformer_ext.runtimes import factory, ort

    reads = []
    real = export_format.read_manifest

    def counting(path, **kwargs):
        reads.append(Path(path))
        return real(path, **kwargs)

    for module in (export_format, translator, factory, ort):
        monkeypatch.setattr(module, "read_manifest", counting)
    t = translator.Translator.from_export_dir(exported, threads=1)
    assert reads == [exported] and isinstance(t.runner, runtimes.OrtRunner)
    reads.clear()
    runner = runtimes.open_export_dir(exported, threads=1)
    assert reads == [exported] and isinstance(runner, runtimes.OrtRunner)
    assert runner.info == t.runner.info


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(runtime="ctranslate2"), "RuntimeOptionError", "runtime must be one of"),
        (dict(runtime="eager"), "RuntimeOptionError", "not PyTorch weights"),
        (dict(threads=0), "RuntimeOptionError", "threads must be a positive integer, got 0"),
        (dict(precision="fp16"), "RuntimeOptionError", "precision 'fp16' applies to the TensorRT runtime"),
        (dict(provider="npu9"), "RuntimeNotAvailableError", r"provider 'npu9' \(npu9\) is not available"),
    ],
)
def test_open_export_dir_refuses_options_that_do_not_fit(exported, kwargs, error, match):
    with pytest.raises(getattr(runtimes, error), match=match):
        runtimes.open_export_dir(exported, **kwargs)


@pytest.mark.parametrize("kind", ["eager", "catcache", "ort", "ort_cuda", "tensorrt"])
def test_token_checks_name_a_uint64_value_as_given(exported, kind):
    """uint64 max was reported as -1 (wrapped to int64 before the check)."""
    runner = _runner(kind, exported)
    big = int(np.iinfo(np.uint64).max)
    state = runner.encode(np.array([[5, 6, 7]]), np.array([3]), 4, 2)
    with pytest.raises(ValueError, match=rf"^tokens\[1\] = {big} \(row 1\) is not a target token id"):
        runner.step(state, np.array([1, big], dtype=np.uint64))
    with pytest.raises(ValueError, match=rf"^input_ids\[0, 2\] = {big} \(row 0\) is not a source token id"):
        runner.encode(np.array([[5, 6, big]], dtype=np.uint64), np.array([3]), 4, 1)
    runner.step(state, np.array([1, 1], dtype=np.uint64))  # in range: fed as int64
    with pytest.raises(ValueError, match=rf"^beam_index\[1\] = {big} is out of the int64 range"):
        runner.reorder(state, np.array([0, big], dtype=np.uint64))


# ------------------------------------------------------------------------------------------
# finished sources leave the batch (runner.select)
# ------------------------------------------------------------------------------------------

# Budgets that end the sources at very different steps (1 and 13 new tokens).
RAGGED_BUDGETS = np.array([1, 13, 4])


class _RowCounter:
    """Forwards the runner protocol and records the rows of every step."""

    def __init__(self, runner):
        self.runner, self.rows = runner, []
        if getattr(runner, "select", None) is not None:
            self.select = runner.select

    def encode(self, *args):
        return self.runner.encode(*args)

    def step(self, state, tokens):
        self.rows.append(len(tokens))
        return self.runner.step(state, tokens)

    def reorder(self, state, index):
        return self.runner.reorder(state, index)


def _ragged_sources(runner):
    rng = np.random.default_rng(11)
    lengths = np.array([5, 2, 7], dtype=np.int64)
    ids = np.zeros((3, 7), dtype=np.int64)
    for b, n in enumerate(lengths):
        ids[b, :n] = rng.integers(4, runner.info.src_vocab_size, size=n)
    return ids, lengths


def _assert_same_hyps(got, want, atol=1e-5):
    assert [[h.tokens for h in row] for row in got] == [[h.tokens for h in row] for row in want]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose([h.score for h in g], [h.score for h in w], rtol=0, atol=atol)


@pytest.mark.parametrize("search", ["beam", "greedy"])
@pytest.mark.parametrize("kind", ["eager", "catcache", "ort", "ort_tensorscatter", "ort_cuda", "tensorrt"])
def test_finished_sources_leave_the_batch_with_the_same_results(exported, tmp_path_factory, kind, search):
    """Every runner's ``select``: the search that drops finished sources gives the tokens and
    scores of the search that feeds them to the end, and of each source decoded alone (batch
    of 1, an independent oracle), while its later steps run on fewer rows."""
    if kind == "ort_tensorscatter":  # the caches bound as both input and output
        from helpers import exported_dir

        runner = runtimes.OrtRunner(exported_dir(tmp_path_factory, "tensorscatter"), intra_op_num_threads=1)
    else:
        runner = _runner(kind, exported)
    assert callable(runner.select)
    ids, lengths = _ragged_sources(runner)
    kw = dict(max_decoding_length=RAGGED_BUDGETS, min_decoding_length=np.array([0, 6, 2]))
    if search == "beam":
        kw.update(beam_size=4, num_hypotheses=2, length_penalty_type="average", length_penalty=1.0)
    counted = _RowCounter(runner)
    dropped = _generate(counted, runner, ids, lengths, kw, remove_finished=True)
    kept = _generate(runner, runner, ids, lengths, kw, remove_finished=False)
    alone = [
        _generate(
            runner,
            runner,
            ids[b : b + 1],
            lengths[b : b + 1],
            dict(
                kw,
                max_decoding_length=RAGGED_BUDGETS[b : b + 1],
                min_decoding_length=kw["min_decoding_length"][b : b + 1],
            ),
            remove_finished=False,
        )[0]
        for b in range(3)
    ]
    _assert_same_hyps(dropped, kept)
    _assert_same_hyps(dropped, alone)
    K = kw.get("beam_size", 1)
    assert counted.rows[0] == 3 * K and counted.rows[-1] < 3 * K  # the batch shrank
    assert counted.rows == sorted(counted.rows, reverse=True)
    assert len(counted.rows) > 1


def _generate(driven, runner, ids, lengths, kw, *, remove_finished):
    from transformer_ext.decoding import generate

    info = runner.info
    return generate(
        driven, ids, lengths, bos_id=info.bos_id, eos_id=info.eos_id, remove_finished=remove_finished, **kw
    )


def test_tensorrt_profile_with_a_minimum_batch_keeps_finished_rows(exported):
    """A decoder profile whose minimum batch is above one row takes no smaller state: the runner
    offers no ``select``, and the search feeds finished rows instead, with the same results."""
    from fake_tensorrt import fake_engines

    model = _model(exported)
    config = _manifest(exported)["model_config"]
    enc, dec = fake_engines(
        model, "portable", torch.device("cpu"), [], max_rows=12, max_src=20, cache=(2, 30), min_rows=4
    )
    runner = runtimes.TensorRTRunner(enc, dec, config=config, device="cpu")
    assert runner.select is None and callable(_runner("tensorrt", exported).select)
    ids, lengths = _ragged_sources(runner)
    kw = dict(
        max_decoding_length=RAGGED_BUDGETS, beam_size=4, num_hypotheses=2, length_penalty_type="average"
    )
    counted = _RowCounter(runner)
    got = _generate(counted, runner, ids, lengths, kw, remove_finished=True)
    assert set(counted.rows) == {12}  # every step on all rows
    want = _generate(_runner("tensorrt", exported), runner, ids, lengths, kw, remove_finished=True)
    _assert_same_hyps(got, want)
