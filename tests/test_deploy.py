"""Deploying from an export folder: the translator over ONNX Runtime, the translate command on an
export folder (the same output as eager), its errors, and a torch-free install tested for real
in a fresh virtual environment."""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import rehash_export
from num2words import num2words  # the independent oracle of the demo task

from export import ManifestError
from transformer_ext.data import split_numbers
from transformer_ext.export_format import MANIFEST_NAME
from transformer_ext.runtimes import OrtRunner
from transformer_ext.tokenizer import load_tokenizer
from transformer_ext.translate import RuntimeNotAvailableError, TranslationError, Translator, main

REPO = Path(__file__).resolve().parents[1]
HELDOUT_SAMPLE = 40  # held-out numbers (never seen in training) compared between the runtimes
# What the deployment install needs of the repository (copied, so that the in-tree build writes
# its build/ and egg-info folders into the copy, not into the working tree).
INSTALL_FILES = ["pyproject.toml", "setup.py", "README.md", "requirements"]
INSTALL_PACKAGES = ["transformer_ext", "export"]


def demo_export_dir(tmp_path_factory) -> Path:
    """The bundled demo model exported once per test session (validation is export.onnx's own test)."""
    from export.onnx import export_onnx

    out = tmp_path_factory.getbasetemp() / "shared_exports" / "demo_export"
    if not (out / MANIFEST_NAME).is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        export_onnx(None, out, validate=False)
    return out


@pytest.fixture(scope="session")
def demo_export(tmp_path_factory) -> Path:
    return demo_export_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def eager():
    return Translator.from_model_dir()


@pytest.fixture(scope="module")
def heldout():
    numbers = sorted(random.Random(11).sample(split_numbers().heldout, HELDOUT_SAMPLE))
    return [num2words(n, lang="en") for n in numbers], [num2words(n, lang="de") for n in numbers]


@pytest.fixture(scope="module")
def heldout_sources(heldout):
    return heldout[0]


def _copy(export: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "export"
    shutil.copytree(export, folder)
    return folder


def _edit_manifest(folder: Path, **changes) -> None:
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    manifest.update(changes)
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))


class _Tty(io.StringIO):
    def isatty(self):
        return True


def run_main(args, capsys):
    code = main(args, stdin=_Tty())
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------------------------
# the translator over ONNX Runtime
# ------------------------------------------------------------------------------------------


def test_export_translates_like_eager(demo_export, eager, heldout):
    heldout_sources, references = heldout
    ort = Translator.from_export_dir(demo_export, threads=1)
    assert isinstance(ort.runner, OrtRunner)
    greedy = ort.translate(heldout_sources)
    assert greedy == eager.translate(heldout_sources)
    assert sum(g == r for g, r in zip(greedy, references)) >= 0.95 * len(references)  # it translates
    some = heldout_sources[:8]
    ours = ort.translate(some, beam_size=3, n_best=2)
    theirs = eager.translate(some, beam_size=3, n_best=2)
    assert [t.texts for t in ours] == [t.texts for t in theirs]
    np.testing.assert_allclose(
        [[h.score for h in t.hypotheses] for t in ours],
        [[h.score for h in t.hypotheses] for t in theirs],
        rtol=0,
        atol=1e-4,
    )


def test_translator_over_a_runner_built_by_hand(demo_export):
    """Translator(tokenizer, runner): any iterable, batched by length, results in input order."""
    translator = Translator(
        load_tokenizer(demo_export), OrtRunner(demo_export, intra_op_num_threads=1), batch_size=2
    )
    sources = ["seven thousand and seventeen", "one", "forty-two", "three hundred", "twelve"]
    assert translator.translate(s for s in sources) == [
        "siebentausendsiebzehn",
        "eins",
        "zweiundvierzig",
        "dreihundert",
        "zwölf",
    ]
    assert translator.translate([]) == []


def test_bad_export_folders(demo_export, tmp_path):
    folder = _copy(demo_export, tmp_path)
    _edit_manifest(folder, format="another.tool")
    with pytest.raises(ManifestError, match=r"is not a transformer_ext.onnx_export manifest"):
        Translator.from_export_dir(folder)
    _edit_manifest(folder, format="transformer_ext.onnx_export", format_version=99)
    with pytest.raises(ManifestError, match=r"version=99"):
        Translator.from_export_dir(folder)

    folder = _copy(demo_export, tmp_path / "b")
    os.remove(folder / "tokenizer.json")
    with pytest.raises(
        TranslationError,
        match=r"tokenizer.json is missing: manifest.json lists it among the "
        r"tokenizer files, so the export folder is incomplete",
    ):
        Translator.from_export_dir(folder)

    _edit_manifest(folder, tokenizer_files=[], files=sorted(os.listdir(folder)))
    untokenized = Translator.from_export_dir(folder)  # token ids still decode
    with pytest.raises(TranslationError, match=r"has no tokenizer .*a tokenizer is needed to translate text"):
        untokenized.translate(["one"])

    with pytest.raises(TranslationError, match="export folder: it holds ONNX graphs, not PyTorch weights"):
        Translator.from_export_dir(demo_export, runtime="eager")
    with pytest.raises(TranslationError, match="load it with Translator.from_export_dir"):
        Translator.from_model_dir(demo_export)
    with pytest.raises(TranslationError, match="threads must be a positive integer"):
        Translator.from_export_dir(demo_export, threads=0)


def test_the_export_generation_config_sets_the_defaults(demo_export, tmp_path):
    manifest = json.loads((demo_export / MANIFEST_NAME).read_text())
    if not manifest.get("generation_config"):
        pytest.skip("this export format has no generation config")
    folder = _copy(demo_export, tmp_path)
    path = folder / manifest["generation_config"]
    config = json.loads(path.read_text())
    config.update(beam_size=3, max_new_tokens=4)
    path.write_text(json.dumps(config))
    rehash_export(folder)  # an edit the manifest knows of (it records every file's SHA-256)
    translator = Translator.from_export_dir(folder)
    (one,) = translator.translate_detailed(["seven thousand, seven hundred and seventy-seven"])
    assert one.score is not None  # beam search, from the folder's config
    assert len(one.hypotheses[0].tokens) == 4 and not one.hypotheses[0].finished  # its budget cap
    assert translator.translate(["one"], beam_size=1, max_len_a=0, max_len_b=2) == [
        "ei"
    ]  # a call overrides it


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("tensorrt") is not None, reason="TensorRT is installed"
)
def test_tensorrt_runtime_without_tensorrt_says_what_to_install(demo_export):
    with pytest.raises(
        RuntimeNotAvailableError,
        match=r"needs TensorRT, which is not installed: .*pip install "
        r"tensorrt-cu13",
    ):
        Translator.from_export_dir(demo_export, runtime="tensorrt")


def test_unavailable_provider(demo_export):
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(
            RuntimeNotAvailableError,
            match=r"provider 'cuda' \(CUDAExecutionProvider\) is not "
            r"available: .*install onnxruntime-gpu",
        ):
            Translator.from_export_dir(demo_export, provider="cuda")
    with pytest.raises(
        RuntimeNotAvailableError, match=r"provider 'npu9' \(npu9\) is not available.*short names: cpu"
    ):
        Translator.from_export_dir(demo_export, provider="npu9")
    assert Translator.from_export_dir(demo_export, provider="CPUExecutionProvider").translate(["one"]) == [
        "eins"
    ]


@pytest.fixture
def cuda_provider_listed(monkeypatch):
    """ONNX Runtime reports the CUDA provider (as onnxruntime-gpu does); what each runner is
    built with is recorded, and the runner built is a CPU OrtRunner, so the selection logic runs
    without a GPU."""
    import onnxruntime as ort

    import transformer_ext.runtimes.ort as ort_module
    import transformer_ext.runtimes.ort_cuda as ort_cuda_module

    monkeypatch.setattr(
        ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"]
    )
    built = []
    real = ort_module.OrtRunner

    def fake(kind):
        def make(export_dir, *, manifest, **kwargs):
            assert manifest["model_config"], "the factory hands the runner the manifest it read"
            built.append((kind, kwargs))
            return real(export_dir)

        return make

    monkeypatch.setattr(ort_module, "OrtRunner", fake("OrtRunner"))
    monkeypatch.setattr(ort_cuda_module, "OrtCudaRunner", fake("OrtCudaRunner"))
    return built


@pytest.mark.parametrize("provider", ["cuda", "CUDAExecutionProvider"])
def test_cuda_provider_selects_the_device_runner_when_torch_has_cuda(
    demo_export, cuda_provider_listed, monkeypatch, provider
):
    from transformer_ext.runtimes import factory

    monkeypatch.setattr(factory, "device_buffers_available", lambda: (True, ""))
    t = Translator.from_export_dir(demo_export, provider=provider, threads=2)
    assert cuda_provider_listed == [("OrtCudaRunner", {"device": "cuda", "intra_op_num_threads": 2})]
    assert t.translate(["one"]) == ["eins"]


def test_cuda_provider_without_device_buffers_runs_ort_runner_on_cuda(
    demo_export, cuda_provider_listed, monkeypatch, caplog
):
    from transformer_ext.runtimes import factory

    monkeypatch.setattr(factory, "device_buffers_available", lambda: (False, "torch is not installed"))
    with caplog.at_level("INFO", logger="transformer_ext.runtimes.factory"):
        Translator.from_export_dir(demo_export, provider="cuda")
    assert cuda_provider_listed == [
        (
            "OrtRunner",
            {"providers": ["CUDAExecutionProvider", "CPUExecutionProvider"], "intra_op_num_threads": None},
        )
    ]
    assert any("torch is not installed" in r.getMessage() for r in caplog.records)
    cuda_provider_listed.clear()
    Translator.from_export_dir(demo_export, provider="cpu")  # never the device runner, nothing probed
    assert cuda_provider_listed == [
        ("OrtRunner", {"providers": ["CPUExecutionProvider"], "intra_op_num_threads": None})
    ]


def test_device_buffers_need_torch_a_gpu_and_the_cuda_kernels(monkeypatch):
    import importlib.util

    import torch

    from transformer_ext import ops
    from transformer_ext.runtimes import factory

    real_find_spec = importlib.util.find_spec
    with monkeypatch.context() as m:
        m.setattr(
            importlib.util,
            "find_spec",
            lambda name, *a: None if name == "torch" else real_find_spec(name, *a),
        )
        assert factory.device_buffers_available() == (False, "torch is not installed")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert factory.device_buffers_available() == (False, "torch sees no CUDA GPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ops, "cuda_kernels_built", lambda: False)
    assert factory.device_buffers_available() == (False, "this package was built without its CUDA kernels")
    monkeypatch.setattr(ops, "cuda_kernels_built", lambda: True)
    assert factory.device_buffers_available() == (True, "")


# ------------------------------------------------------------------------------------------
# the command line on an export folder
# ------------------------------------------------------------------------------------------


def test_cli_on_the_export_prints_what_the_eager_cli_prints(demo_export, heldout_sources, capsys):
    for sources, extra in ((heldout_sources, []), (heldout_sources[::3], ["--beam", "4"])):
        code, eager_out, _ = run_main(sources + extra, capsys)
        assert code == 0 and len(eager_out.splitlines()) == len(sources)
        code, export_out, err = run_main(
            sources + extra + ["--model", str(demo_export), "--threads", "1"], capsys
        )
        assert code == 0, err
        assert export_out == eager_out


def test_cli_forty_two_through_onnx_runtime(demo_export):
    """The documented deploy command, and the same with torch made unimportable: the export folder is run
    by ONNX Runtime alone."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    plain = subprocess.run(
        [sys.executable, "-m", "transformer_ext.translate", "--model", str(demo_export), "forty-two"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert plain.returncode == 0 and plain.stdout == "zweiundvierzig\n", plain.stderr
    code = (
        "import runpy, sys\n"
        "sys.modules['torch'] = None\n"
        f"sys.argv = ['translate', '--model', {str(demo_export)!r}, 'forty-two', 'three hundred and forty-two']\n"
        "try:\n"
        "    runpy.run_module('transformer_ext.translate', run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "assert 'onnxruntime' in sys.modules\n"
    )
    no_torch = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    )
    assert no_torch.returncode == 0, no_torch.stderr
    assert no_torch.stdout == "zweiundvierzig\ndreihundertzweiundvierzig\n"


@pytest.mark.parametrize(
    "args, match",
    [
        (
            ["--runtime", "eager"],
            "is an export folder (it has manifest.json, no PyTorch weights): --runtime eager "
            "needs a model folder",
        ),
        (
            ["--compile"],
            "--compile applies to the eager runtime only, and --model EXPORT is an export folder",
        ),
        (["--device", "cpu"], "--device applies to the eager runtime only (ONNX Runtime: --provider)"),
        (["--provider", "npu9"], "ONNX Runtime provider 'npu9' (npu9) is not available"),
    ],
)
def test_cli_export_errors_are_one_line(demo_export, capsys, args, match):
    code, out, err = run_main(["one", "--model", str(demo_export)] + args, capsys)
    assert code == 1 and out == ""
    assert err.startswith("python -m transformer_ext.translate: error: ")
    assert match.replace("EXPORT", str(demo_export)) in err and len(err.splitlines()) == 1


def test_cli_export_folder_errors(demo_export, tmp_path, capsys):
    folder = _copy(demo_export, tmp_path)
    os.remove(folder / "tokenizer.json")
    code, out, err = run_main(["one", "--model", str(folder)], capsys)
    assert (
        code == 1
        and out == ""
        and f"{folder}/tokenizer.json is missing" in err
        and len(err.splitlines()) == 1
    )
    _edit_manifest(folder, format_version=7)
    code, _, err = run_main(["one", "--model", str(folder)], capsys)
    assert code == 1 and "version=7" in err and "Traceback" not in err
    code, _, err = run_main(["one", "--runtime", "onnxruntime"], capsys)  # the demo model folder
    assert code == 1 and "--runtime onnxruntime needs --model EXPORT_DIR" in err
    code, _, err = run_main(["one", "--runtime", "onnxruntime", "--model", str(tmp_path)], capsys)
    assert (
        code == 1
        and "is not an export folder (no manifest.json)" in err
        and "a model folder runs with --runtime eager" in err
    )


@pytest.mark.parametrize(
    "args, match",
    [
        (
            ["--runtime", "onnxruntime", "--compile"],
            "--compile applies to the eager runtime only, not to --runtime onnxruntime",
        ),
        (["--runtime", "eager", "--provider", "cpu"], "--provider applies to the onnxruntime runtime only"),
        (
            ["--runtime", "tensorrt", "--threads", "2"],
            "--threads applies to the onnxruntime and eager runtimes only",
        ),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--runtime", "ctranslate2"], "invalid choice"),
    ],
)
def test_cli_runtime_option_errors_are_usage_errors(args, match, capsys):
    with pytest.raises(SystemExit) as info:
        main(["one"] + args, stdin=_Tty())
    _, err = capsys.readouterr()
    assert info.value.code == 2 and match in err and "usage:" in err


# ------------------------------------------------------------------------------------------
# the torch-free install, for real
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_deployment_install_translates_without_torch(demo_export, tmp_path):
    """A fresh virtual environment (no system site-packages), ``TRANSFORMER_EXT_DEPLOY=1 pip
    install <repo>[deploy]`` (not editable), then text from the demo export through the Python
    API and the command line; torch is neither installed nor imported."""
    venv = tmp_path / "venv"
    made = subprocess.run(
        [sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True, timeout=300
    )
    if made.returncode != 0:
        pytest.skip(f"cannot create a virtual environment here: {made.stderr.strip()[-500:]}")
    python = venv / "bin" / "python"
    source = tmp_path / "src"
    source.mkdir()
    for name in INSTALL_FILES:
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy2)(REPO / name, source / name)
    for name in INSTALL_PACKAGES:
        shutil.copytree(
            REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
        )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["TRANSFORMER_EXT_DEPLOY"] = "1"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", f"{source}[deploy]"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-3000:]

    script = (
        "import importlib.util, sys\n"
        "from transformer_ext.translate import Translator\n"
        f"translator = Translator.from_export_dir({str(demo_export)!r})\n"
        "print(translator.translate(['forty-two', 'three hundred and forty-two']))\n"
        "import transformer_ext\n"
        "assert 'site-packages' in transformer_ext.__file__, transformer_ext.__file__\n"
        "assert 'torch' not in sys.modules\n"
        "assert importlib.util.find_spec('torch') is None, 'torch is installed in the deployment venv'\n"
    )
    api = subprocess.run(
        [str(python), "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    assert api.returncode == 0, api.stderr
    assert api.stdout == "['zweiundvierzig', 'dreihundertzweiundvierzig']\n"
    cli = subprocess.run(
        [str(python), "-m", "transformer_ext.translate", "--model", str(demo_export), "forty-two"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert cli.returncode == 0 and cli.stdout == "zweiundvierzig\n", cli.stderr
    eager = subprocess.run(
        [str(python), "-m", "transformer_ext.translate", "forty-two"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert eager.returncode == 1 and "Traceback" not in eager.stderr and "torch" in eager.stderr, eager.stderr


# ------------------------------------------------------------------------------------------
# export.onnx's closing lines
# ------------------------------------------------------------------------------------------


def test_export_of_another_model_shows_no_demo_examples_and_ends_with_the_verdict(tmp_path, capsys):
    """A model that is not the demo gets no number-word examples (they looked like a broken
    export); the output ends with the verdict and the next command."""
    from helpers import make_model_dir

    from export.onnx import main as export_main

    model = make_model_dir(tmp_path / "model")
    out = tmp_path / "out"
    assert export_main(["--model", str(model), "--output-dir", str(out), "--no-validate"]) == 0
    text = capsys.readouterr().out
    assert "forty" not in text and "reference:" not in text
    assert "example translations: none (the model folder records no example pairs" in text
    last = text.strip().splitlines()[-2:]
    assert last[0].startswith("exported, not validated (--no-validate)")
    assert last[1] == f'next: python -m transformer_ext.translate --model {out} "SOURCE TEXT"'


def test_demo_export_labels_its_examples_and_ends_with_the_verdict(tmp_path, capsys):
    from export.onnx import main as export_main

    out = tmp_path / "demo"
    assert export_main(["--output-dir", str(out), "--examples", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    (header,) = [i for i, line in enumerate(lines) if line.startswith("translations decoded by ONNX Runtime")]
    assert "held-out numbers of the demo task" in lines[header]
    examples = lines[header + 1 : header + 4]
    assert all(" -> " in line for line in examples)
    for line in examples:  # each checked against num2words, the independent oracle
        source, text = (part.strip().strip("'") for part in line.split(" -> "))
        number = next(n for n in range(10000) if num2words(n, lang="en") == source)
        assert text.split("  (")[0].strip("'") == num2words(number, lang="de")
    assert lines[-2].startswith("export OK: every output within")
    assert lines[-1] == f'next: python -m transformer_ext.translate --model {out} "SOURCE TEXT"'
