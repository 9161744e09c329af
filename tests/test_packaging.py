"""Packaging (docs/DESIGN.md section 6): the metadata in pyproject.toml, what setup.py computes
(run-time dependencies, none for the deployment install), and the requirement files the extras
mirror.

The metadata is prepared for real by setuptools' build backend in a copy of the files an install
reads, in a subprocess, and read back from the METADATA file it writes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from email.parser import Parser
from pathlib import Path

import pytest

import transformer_ext

tomllib = pytest.importorskip("tomllib")

REPO = Path(__file__).resolve().parents[1]
# The files the build backend reads to prepare the metadata (setup.py reads requirements/).
METADATA_FILES = ["pyproject.toml", "setup.py", "README.md", "requirements", "transformer_ext/__init__.py"]
# Extras that mirror a requirement file (pip install -r FILE installs the same).
EXTRA_FILES = {"deploy": "deploy.txt", "corpus": "corpus.txt", "eval": "eval.txt", "serve": "serve.txt"}
# Each console script goes through transformer_ext.commands (what the command needs is checked
# before it is imported) to the main() of its python -m module.
SCRIPTS = {
    "transformer-ext-train": "transformer_ext.commands:train",
    "transformer-ext-translate": "transformer_ext.commands:translate",
    "transformer-ext-export-onnx": "transformer_ext.commands:export_onnx",
    "transformer-ext-evaluate": "transformer_ext.commands:evaluate",
    "transformer-ext-average": "transformer_ext.commands:average",
    "transformer-ext-convert": "transformer_ext.commands:convert",
    "transformer-ext-serve": "transformer_ext.commands:serve",
}


def _pyproject() -> dict:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _requirement_lines(name: str) -> list[str]:
    """The requirements of requirements/NAME: one a line, comments and pip options left out."""
    lines = (REPO / "requirements" / name).read_text(encoding="utf-8").splitlines()
    out = []
    for line in lines:
        text = line.split("#", 1)[0].strip()
        if text and not text.startswith("-"):
            out.append(text)
    return out


def _metadata(tmp_path: Path, deploy: bool):
    """METADATA as setuptools prepares it for a wheel, from a copy of the install's files."""
    src = tmp_path / "src"
    for name in METADATA_FILES:
        target = src / name
        target.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy2)(REPO / name, target)
    out = tmp_path / "meta"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TRANSFORMER_EXT_DEPLOY"] = "1" if deploy else "0"
    env["TRANSFORMER_EXT_CUDA"] = "0"
    # The deployment build must not need torch: importing it fails in that subprocess.
    block = "import sys; sys.modules['torch'] = None\n" if deploy else ""
    code = block + (
        "from setuptools import build_meta\n"
        f"print(build_meta.prepare_metadata_for_build_wheel({str(out)!r}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=src, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    dist_info = out / proc.stdout.strip().splitlines()[-1]
    meta = Parser().parsestr((dist_info / "METADATA").read_text(encoding="utf-8"))
    entry_points = (dist_info / "entry_points.txt").read_text(encoding="utf-8")
    return meta, entry_points


def _requires(meta, extra=None) -> list[str]:
    """Requires-Dist of the base install (extra None) or of one extra, markers removed."""
    out = []
    for value in meta.get_all("Requires-Dist") or []:
        req, _, marker = value.partition(";")
        got = re.search(r"extra == \"([^\"]+)\"", marker)
        if (got.group(1) if got else None) == extra:
            out.append(req.strip())
    return out


def test_extras_mirror_their_requirement_files():
    extras = _pyproject()["project"]["optional-dependencies"]
    for extra, name in EXTRA_FILES.items():
        assert extras[extra] == _requirement_lines(name), f"[{extra}] differs from requirements/{name}"


def test_metadata_of_the_development_install(tmp_path):
    meta, entry_points = _metadata(tmp_path, deploy=False)
    assert meta["Name"] == "transformer_ext" and meta["Version"] == transformer_ext.__version__
    assert meta["Requires-Python"] == ">=3.10"
    # requirements/runtime.txt, its torch floor pinned to the torch the ops are built against
    # (test_the_full_metadata_pins_the_torch_the_ops_are_built_against)
    runtime = _requirement_lines("runtime.txt")
    assert [r for r in _requires(meta) if not r.startswith("torch")] == [
        r for r in runtime if not r.startswith("torch")
    ]
    assert any(r.startswith("torch") for r in _requires(meta))
    extras = _pyproject()["project"]["optional-dependencies"]
    assert set(meta.get_all("Provides-Extra")) == set(extras)
    for extra, reqs in extras.items():
        assert _requires(meta, extra) == reqs, extra
    for script, target in SCRIPTS.items():
        assert re.search(rf"^{re.escape(script)} = {re.escape(target)}$", entry_points, re.M), script
    assert meta.get_payload().startswith((REPO / "README.md").read_text(encoding="utf-8")[:200])


def test_metadata_of_the_deployment_install_needs_no_torch(tmp_path):
    meta, entry_points = _metadata(tmp_path, deploy=True)
    assert meta["Name"] == "transformer_ext" and meta["Version"] == transformer_ext.__version__
    assert _requires(meta) == []  # nothing, torch least of all
    assert _requires(meta, "deploy") == _requirement_lines("deploy.txt")
    assert "transformer-ext-translate = transformer_ext.commands:translate" in entry_points


# ------------------------------------------------------------------------------------------
# The version, --version, the build's own errors, the sdist
# ------------------------------------------------------------------------------------------

# Every command line of the package (python -m MODULE; the console scripts call the same main()).
CLI_MODULES = [
    "transformer_ext.train",
    "transformer_ext.translate",
    "transformer_ext.evaluate",
    "transformer_ext.average",
    "transformer_ext.corpora",
    "transformer_ext.convert.__main__",
    "export.onnx",
    "export.quantize",
    "export.tensorrt",
    "export.triton",
]


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(extra)
    return env


def test_version_is_a_pep440_release_named_by_the_changelog():
    from packaging.version import Version

    assert str(Version(transformer_ext.__version__)) == transformer_ext.__version__
    headings = re.findall(r"^## (\S+)", (REPO / "CHANGELOG.md").read_text(encoding="utf-8"), re.M)
    assert headings and headings[0] == transformer_ext.__version__, headings[:1]


@pytest.mark.parametrize("module", CLI_MODULES)
def test_every_cli_prints_its_version(module, capsys):
    import importlib

    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert re.fullmatch(rf"\S.* {re.escape(transformer_ext.__version__)}\n", out), out


def test_version_works_where_the_command_needs_missing_torch(tmp_path):
    """The deployment install: a command that needs torch still answers --version (and only that)."""
    code = (
        "import runpy, sys\n"
        "sys.modules['torch'] = None\n"
        "sys.argv = ['train'] + sys.argv[1:]\n"
        "runpy.run_module('transformer_ext.train', run_name='__main__')\n"
    )
    env = _clean_env(PYTHONPATH=str(REPO))
    run = [sys.executable, "-c", code]
    got = subprocess.run(
        run + ["--version"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    assert got.returncode == 0, got.stderr
    assert got.stdout == f"python -m transformer_ext.train {transformer_ext.__version__}\n"
    refused = subprocess.run(
        run + ["--help"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    assert refused.returncode == 1 and refused.stdout == "", refused.stdout
    assert "needs PyTorch" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1, refused.stderr


def test_the_full_metadata_pins_the_torch_the_ops_are_built_against(tmp_path):
    """A wheel's _C loads only into the torch release it was compiled against; the floor of
    requirements/runtime.txt is what that release must satisfy."""
    import torch
    from packaging.requirements import Requirement

    meta, _ = _metadata(tmp_path, deploy=False)
    release = torch.__version__.split("+")[0]
    torch_reqs = [r for r in _requires(meta) if Requirement(r).name == "torch"]
    assert torch_reqs == [f"torch=={release}"]
    floor = [Requirement(r) for r in _requirement_lines("runtime.txt") if Requirement(r).name == "torch"]
    assert floor and floor[0].specifier.contains(release), (floor, release)


def _setup_copy(tmp_path: Path) -> Path:
    """The files a build reads, csrc/ included, copied (the build writes into its source tree)."""
    src = tmp_path / "src"
    for name in METADATA_FILES + ["csrc", "MANIFEST.in", "LICENSE", "CHANGELOG.md"]:
        target = src / name
        target.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy2)(REPO / name, target)
    return src


def _build_ext(src: Path, env: dict, block_torch: bool = False):
    code = (
        ("import sys; sys.modules['torch'] = None\n" if block_torch else "")
        + "import sys; sys.argv = ['setup.py', 'build_ext', '--build-temp', 'tmp', '--build-lib', 'lib']\n"
        + "import runpy; runpy.run_path('setup.py', run_name='__main__')\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=src, env=env, capture_output=True, text=True, timeout=300
    )


def test_a_build_without_a_compiler_names_it_and_the_deploy_install(tmp_path):
    src = _setup_copy(tmp_path)
    env = _clean_env(TRANSFORMER_EXT_CUDA="0", CXX="no-such-c++-compiler")
    got = _build_ext(src, env)
    assert got.returncode != 0
    last = got.stderr.strip().splitlines()[-1]
    assert "needs a C++ compiler" in last and "'no-such-c++-compiler'" in last, got.stderr[-2000:]
    assert "transformer_ext[deploy]" in last and "TRANSFORMER_EXT_DEPLOY=1" in last, last
    assert "Traceback" not in got.stderr, got.stderr[-2000:]
    assert not (src / "lib").exists()


def test_a_build_without_torch_says_to_install_it_or_use_the_deploy_install(tmp_path):
    src = _setup_copy(tmp_path)
    got = _build_ext(src, _clean_env(TRANSFORMER_EXT_CUDA="0"), block_torch=True)
    assert got.returncode != 0
    last = got.stderr.strip().splitlines()[-1]
    assert "needs PyTorch" in last and "--no-build-isolation" in last, got.stderr[-2000:]
    assert "transformer_ext[deploy]" in last and "Traceback" not in got.stderr, got.stderr[-2000:]


def test_the_wheel_metadata_without_torch_says_so_before_any_download(tmp_path):
    """pip's isolated build of the sdist has no torch: the metadata step (before pip resolves and
    downloads the dependencies) already stops with the one line."""
    src = _setup_copy(tmp_path)
    (tmp_path / "meta").mkdir()
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from setuptools import build_meta\n"
        f"build_meta.prepare_metadata_for_build_wheel({str(tmp_path / 'meta')!r})\n"
    )
    got = subprocess.run(
        [sys.executable, "-c", code],
        cwd=src,
        env=_clean_env(TRANSFORMER_EXT_CUDA="0"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert got.returncode != 0
    last = got.stderr.strip().splitlines()[-1]
    assert "needs PyTorch" in last and "transformer_ext[deploy]" in last, got.stderr[-2000:]
    assert not list((tmp_path / "meta").glob("*.dist-info"))


def test_the_sdist_carries_the_sources_of_the_compiled_ops(tmp_path):
    """What a build from the sdist needs: csrc/, setup.py, the requirement files, the license."""
    import tarfile

    src = _setup_copy(tmp_path)
    for name in ("transformer_ext", "export"):
        shutil.copytree(REPO / name, src / name, dirs_exist_ok=True)
    (src / "transformer_ext" / "_C.so").write_bytes(b"not a library")  # never shipped
    env = _clean_env(TRANSFORMER_EXT_DEPLOY="1")
    got = subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            "--sdist",
            "--no-isolation",
            "--outdir",
            str(tmp_path / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert got.returncode == 0, got.stdout[-2000:] + got.stderr[-2000:]
    (sdist,) = (tmp_path / "dist").glob("transformer_ext-*.tar.gz")
    assert sdist.name == f"transformer_ext-{transformer_ext.__version__}.tar.gz"
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    csrc = {str(p.relative_to(REPO)) for p in (REPO / "csrc").rglob("*") if p.is_file()}
    assert csrc and csrc <= names, sorted(csrc - names)
    want = {"setup.py", "pyproject.toml", "LICENSE", "CHANGELOG.md", "requirements/runtime.txt"}
    want |= {
        f"transformer_ext/demo_model/{p.name}" for p in (REPO / "transformer_ext" / "demo_model").iterdir()
    }
    assert want <= names, sorted(want - names)
    assert not [n for n in names if n.endswith((".so", ".pyc"))]
