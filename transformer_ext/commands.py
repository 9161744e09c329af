"""What each command needs installed, checked before the command imports it (torch-free).

The torch-free deployment install (``TRANSFORMER_EXT_DEPLOY=1 pip install '.[deploy]'``:
ONNX Runtime, numpy, SentencePiece) runs ``translate`` and ``evaluate`` on export folders.
The other commands cannot start without PyTorch (training, averaging, converting, exporting)
or the ``onnx`` package (quantizing, building TensorRT engines); there, every invocation,
``--help`` included, prints one line naming what to install and exits with 1 instead of an
import traceback (``--version`` alone still prints the version). ``python -m MODULE`` checks
through :func:`require` at the top of the module, before its imports; the console scripts
(``transformer-ext-train`` ...) point at the functions here, which check and then import the
command.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

__all__ = ["COMMANDS", "Needs", "missing", "require"]

EXIT_MISSING = 1  # as every command's "missing runtime" failure


# torch is a run-time requirement of the package (requirements/runtime.txt) that only the
# deployment install leaves out; the full install builds the compiled ops against it.
def _full_install(extra: str = "") -> str:
    return (
        "install PyTorch (pip install 'torch>=2.11') and the full package, without TRANSFORMER_EXT_DEPLOY=1 "
        f"(from the source: pip install --no-build-isolation '.{extra}')"
    )


@dataclass(frozen=True)
class Needs:
    """The importable modules a command cannot start without, and what installs them."""

    modules: tuple[str, ...]
    what: str  # "PyTorch", "PyTorch and onnx"...
    install: str


TORCH = Needs(("torch",), "PyTorch", _full_install())
TORCH_ONNX = Needs(("torch", "onnx"), "PyTorch and onnx", _full_install("[onnx]"))
ONNX = Needs(("onnx",), "the onnx package", "pip install 'transformer_ext[onnx]' (or: pip install onnx)")
TENSORRT = Needs(
    ("onnx",),
    "the onnx package",
    "pip install 'transformer_ext[tensorrt]' (onnx and TensorRT; --check-only needs only onnx)",
)

SERVE = Needs(
    ("fastapi", "uvicorn", "prometheus_client"),
    "the serve extra (fastapi, uvicorn, prometheus-client)",
    "pip install 'transformer_ext[serve]' (or: pip install -r requirements/serve.txt)",
)

# python -m name -> what it needs. translate, evaluate, corpora and export.triton start without
# torch (they run export folders, or need no model), so they are not listed.
COMMANDS: dict[str, Needs] = {
    "transformer_ext.train": TORCH,
    "transformer_ext.average": TORCH,
    "transformer_ext.convert": TORCH,
    "export.onnx": TORCH_ONNX,
    "export.quantize": ONNX,
    "export.tensorrt": TENSORRT,
    "transformer_ext.serve": SERVE,
}


def missing(needs: Needs) -> Optional[str]:
    """The first line of the ImportError of the first module of ``needs`` that does not import
    (not installed, or installed and broken), else None."""
    for name in needs.modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            return (str(exc).strip().splitlines() or [f"No module named {name!r}"])[0]
    return None


def require(module: str, prog: Optional[str] = None) -> None:
    """Exit with one line on stderr (exit code 1) when ``module``'s command cannot start here
    (see :data:`COMMANDS`); return when it can. ``prog`` names the command (default
    ``python -m MODULE``)."""
    needs = COMMANDS[module]
    problem = missing(needs)
    if problem is None:
        return
    prog = prog or f"python -m {module}"
    if sys.argv[1:] == ["--version"]:  # the version needs nothing the command needs
        from . import __version__

        print(f"{prog} {__version__}")
        raise SystemExit(0)
    print(
        f"{prog}: error: this command needs {needs.what}, which this installation lacks ({problem}): "
        f"{needs.install}",
        file=sys.stderr,
    )
    raise SystemExit(EXIT_MISSING)


def _entry(module: str, main_module: Optional[str] = None) -> Callable[[Optional[Sequence[str]]], int]:
    def run(argv: Optional[Sequence[str]] = None) -> int:
        if module in COMMANDS:
            require(module, prog=_script_name())
        return importlib.import_module(main_module or module).main(argv)

    run.__name__ = module.rsplit(".", 1)[-1]
    run.__doc__ = f"The console script of ``python -m {module}`` (checks what it needs first)."
    return run


def _script_name() -> str:
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "transformer_ext"


# The console scripts (pyproject.toml [project.scripts]).
train = _entry("transformer_ext.train")
translate = _entry("transformer_ext.translate")
export_onnx = _entry("export.onnx")
evaluate = _entry("transformer_ext.evaluate")
average = _entry("transformer_ext.average")
convert = _entry("transformer_ext.convert", "transformer_ext.convert.__main__")
serve = _entry("transformer_ext.serve", "transformer_ext.serve.cli")
