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
    assert _requires(meta) == _requirement_lines("runtime.txt")
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
