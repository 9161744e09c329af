"""transformer_ext.commands: in an installation without torch (the deployment install) or onnx,
every command that needs them prints one line naming what to install, --help included, as
``python -m`` and as a console script; with them installed the commands start as before."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from transformer_ext import commands

REPO = Path(__file__).resolve().parents[1]
TORCH_COMMANDS = [m for m, needs in commands.COMMANDS.items() if "torch" in needs.modules]
ONNX_ONLY_COMMANDS = [m for m, needs in commands.COMMANDS.items() if needs.modules == ("onnx",)]
# console script function -> its python -m module (pyproject.toml [project.scripts])
SCRIPTS = {
    "train": "transformer_ext.train",
    "translate": "transformer_ext.translate",
    "export_onnx": "export.onnx",
    "evaluate": "transformer_ext.evaluate",
    "average": "transformer_ext.average",
    "convert": "transformer_ext.convert",
}


def _blocked(tmp_path: Path, *names: str) -> Path:
    """A folder that, first on PYTHONPATH, makes each of ``names`` unimportable (as if missing)."""
    root = tmp_path / "blocked"
    for name in names:
        (root / name).mkdir(parents=True)
        message = f"No module named {name!r}"
        (root / name / "__init__.py").write_text(f"raise ImportError({message!r})\n")
    return root


def _run(args: list[str], blocked: Path | None):
    path = ([str(blocked)] if blocked else []) + [str(REPO), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=300
    )


def _check_one_line(proc, install: str) -> None:
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "error: this command needs" in lines[0] and install in lines[0], lines[0]


def test_the_table_names_every_command_that_needs_torch():
    assert set(TORCH_COMMANDS) == {
        "transformer_ext.train",
        "transformer_ext.average",
        "transformer_ext.convert",
        "export.onnx",
    }


@pytest.mark.parametrize("module", TORCH_COMMANDS)
@pytest.mark.parametrize("args", [["--help"], []])
def test_without_torch_a_torch_command_prints_one_line(module, args, tmp_path):
    proc = _run(["-m", module, *args], _blocked(tmp_path, "torch"))
    _check_one_line(proc, "pip install 'torch>=2.11'")
    assert f"python -m {module}: error: this command needs PyTorch" in proc.stderr
    if module == "export.onnx":
        assert "'.[onnx]'" in proc.stderr  # the extra it needs besides torch


@pytest.mark.parametrize("module", ONNX_ONLY_COMMANDS)
def test_without_onnx_an_onnx_command_prints_one_line(module, tmp_path):
    proc = _run(["-m", module, "--help"], _blocked(tmp_path, "torch", "onnx"))
    _check_one_line(proc, "pip install 'transformer_ext[")


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_console_scripts_check_before_importing(script, tmp_path):
    """The console script functions: one line without torch for a torch command; the
    command's own --help for the others (translate, evaluate run export folders without torch)."""
    code = f"import sys; from transformer_ext.commands import {script}; sys.exit({script}())"
    proc = _run(["-c", code, "--help"], _blocked(tmp_path, "torch"))
    if SCRIPTS[script] in TORCH_COMMANDS:
        _check_one_line(proc, "pip install 'torch>=2.11'")
    else:
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stdout.startswith("usage:"), proc.stdout[:200]


@pytest.mark.parametrize("script", ["train", "export_onnx", "convert"])
def test_with_torch_the_console_scripts_show_the_commands_help(script):
    proc = _run(
        ["-c", f"import sys; from transformer_ext.commands import {script}; sys.exit({script}())", "--help"],
        None,
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.startswith("usage:"), proc.stdout[:200]


def test_missing_reports_a_broken_module_too(monkeypatch):
    """A module that is installed but fails to import counts as missing (its error's first line)."""
    monkeypatch.setitem(sys.modules, "a_broken_module_of_the_test", None)
    needs = commands.Needs(("os", "a_broken_module_of_the_test"), "x", "y")
    assert "a_broken_module_of_the_test" in commands.missing(needs)
    assert commands.missing(commands.Needs(("os", "json"), "x", "y")) is None
