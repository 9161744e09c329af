"""Build transformer_ext's compiled op library ``transformer_ext._C`` (the package metadata is in
pyproject.toml).

Build options (environment variables, read once here):

``TRANSFORMER_EXT_CUDA``      ``auto`` (default): compile the CUDA kernels when torch is a CUDA
                              build and nvcc is found; ``1``: require them (fail otherwise);
                              ``0``: CPU kernels only.
``TORCH_CUDA_ARCH_LIST``      GPU architectures; defaults to ``8.0;9.0`` (A100, H100/H200)
                              when no GPU is visible. nvcc 13 accepts 7.5 and newer.
``CUDA_HOME``                 CUDA toolkit; defaults to ``/usr/local/cuda`` when that exists.
``TRANSFORMER_EXT_DEBUG``     ``1``: build with ``-O0 -g`` and host-side assertions.
``MAX_JOBS``                  parallel compile jobs (torch's own variable).
``TRANSFORMER_EXT_DEPLOY``    ``1``: the deployment install: no compiled ops, no torch imported
                              here or required (``pip install .[deploy]`` adds ONNX Runtime
                              and numpy). Translating from an export folder needs nothing else.

The full build compiles against the torch already installed (``pip install
--no-build-isolation``, ``python -m build --no-isolation``); its wheel is a binary wheel that
links against the torch it was compiled with and requires exactly that torch release. Where torch
or a C++ compiler is missing, building the extension stops with one message that says what to
install and names the torch-free deployment install, which needs neither.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Command, Extension, setup
from setuptools.command.build_ext import build_ext as _plain_build_ext
from setuptools.command.dist_info import dist_info as _dist_info

ROOT = os.path.dirname(os.path.abspath(__file__))
CUDA_MODE = os.environ.get("TRANSFORMER_EXT_CUDA", "auto").strip().lower()
DEBUG = os.environ.get("TRANSFORMER_EXT_DEBUG", "0") == "1"
DEPLOY = os.environ.get("TRANSFORMER_EXT_DEPLOY", "0").strip()

if DEPLOY not in ("0", "1"):
    sys.exit(f"TRANSFORMER_EXT_DEPLOY must be '0' or '1', got {DEPLOY!r}")
DEPLOY = DEPLOY == "1"

if CUDA_MODE not in ("auto", "0", "1"):
    sys.exit(f"TRANSFORMER_EXT_CUDA must be 'auto', '0' or '1', got {CUDA_MODE!r}")

# /usr/local/bin/nvcc may be a wrapper script, which makes torch guess CUDA_HOME=/usr/local.
if "CUDA_HOME" not in os.environ and "CUDA_PATH" not in os.environ:
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"

DEPLOY_HINT = (
    "the torch-free deployment install needs neither torch nor a compiler: "
    "TRANSFORMER_EXT_DEPLOY=1 pip install 'transformer_ext[deploy]' (docs/install.md)"
)
torch = cpp_extension = None
TORCH_MISSING = ""
if not DEPLOY:
    try:  # after CUDA_HOME is fixed: cpp_extension reads it at import
        import torch  # noqa: E402
        from torch.utils import cpp_extension  # noqa: E402
    except ImportError as exc:  # an isolated build environment, or no torch installed
        TORCH_MISSING = str(exc).strip().splitlines()[0] if str(exc).strip() else "no module named 'torch'"


def _nvcc_found() -> bool:
    home = cpp_extension.CUDA_HOME
    return bool(home) and os.path.exists(os.path.join(home, "bin", "nvcc"))


def _want_cuda() -> bool:
    has_cuda_torch = torch.version.cuda is not None
    if CUDA_MODE == "0":
        return False
    if CUDA_MODE == "1":
        if not has_cuda_torch:
            sys.exit(
                "TRANSFORMER_EXT_CUDA=1 but torch is a CPU-only build "
                f"({torch.__version__}); install a CUDA build of torch."
            )
        if not _nvcc_found():
            sys.exit("TRANSFORMER_EXT_CUDA=1 but nvcc was not found; set CUDA_HOME to the toolkit.")
        return True
    return has_cuda_torch and _nvcc_found()


def _extra_cuda_includes() -> list[str]:
    """ATen/cuda headers include cusparse.h; partial toolkits lack it, the nvidia wheels have it."""
    home = cpp_extension.CUDA_HOME or ""
    if os.path.exists(os.path.join(home, "include", "cusparse.h")):
        return []
    found = []
    for base in sys.path:
        for sub in ("nvidia/cu13/include", "nvidia/cusparse/include", "nvidia/cu12/include"):
            cand = os.path.join(base, sub)
            if os.path.exists(os.path.join(cand, "cusparse.h")):
                found.append(os.path.abspath(cand))
    return found[:1]


def _cpu_sources() -> list[str]:
    # the schemas, the backend-independent autograd kernels of the in-place ops, the CPU kernels
    sources = [os.path.join("csrc", "torch_bindings.cpp"), os.path.join("csrc", "inplace.cpp")]
    return sources + sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))


def _extension():
    if torch is None:  # the build command stops with what to install (_MissingTorchBuild)
        return Extension("transformer_ext._C", _cpu_sources())
    sources = _cpu_sources()
    opt = ["-O0", "-g"] if DEBUG else ["-O3"]
    cxx = opt + ["-fopenmp"]
    include_dirs = [os.path.join(ROOT, "csrc")]
    if _want_cuda():
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        include_dirs += _extra_cuda_includes()
        nvcc = opt + ["--expt-relaxed-constexpr", "-lineinfo"]
        return cpp_extension.CUDAExtension(
            "transformer_ext._C",
            sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            extra_link_args=["-fopenmp"],
        )
    return cpp_extension.CppExtension(
        "transformer_ext._C",
        sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx},
        extra_link_args=["-fopenmp"],
    )


def _cxx_compiler() -> str:
    """The C++ compiler the extension build runs (``CXX``, else Python's configured one)."""
    return os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"


def _check_compiler() -> None:
    cxx = _cxx_compiler()
    words = shlex.split(cxx) or ["c++"]
    if shutil.which(words[0]) is None:
        sys.exit(
            f"building transformer_ext._C, the compiled op library, needs a C++ compiler: {words[0]!r} "
            "(CXX, else Python's configured compiler) was not found; install one (Debian/Ubuntu: "
            f"apt-get install g++) or set CXX. Otherwise, {DEPLOY_HINT}"
        )


def _exit_torch_missing() -> None:
    sys.exit(
        f"building transformer_ext._C, the compiled op library, needs PyTorch in the build "
        f"environment ({TORCH_MISSING}): install torch first (pip install 'torch>=2.11'), then "
        "build without isolation so that the build sees it (pip install --no-build-isolation "
        f"..., python -m build --no-isolation). Otherwise, {DEPLOY_HINT}"
    )


class _MissingTorchBuild(_plain_build_ext):
    """The extension build where torch does not import: one message instead of a traceback."""

    def run(self):
        _exit_torch_missing()


class _MissingTorchWheelMetadata(_dist_info):
    """The wheel metadata where torch does not import (pip's isolated build of the sdist): the
    same message at once, before pip resolves (downloads) the dependencies of a build that would
    fail. The sdist itself needs no torch (``egg_info``, not this command)."""

    def run(self):
        _exit_torch_missing()


def _build_ext_class():
    if torch is None:
        return _MissingTorchBuild

    class build_ext(cpp_extension.BuildExtension):
        """torch's extension build, after checking that a C++ compiler is there."""

        def run(self):
            _check_compiler()
            super().run()

    return build_ext


class develop(Command):
    """``python setup.py develop``: an editable install that builds against the installed torch.

    setuptools >= 80 turned ``develop`` into ``pip install -e .`` *with* build isolation, which
    builds a torch extension against a second, freshly downloaded torch (or fails offline).
    This command runs the modern equivalent that builds against the torch already installed:
    ``pip install --no-build-isolation -e .``.
    """

    description = "editable install (pip install --no-build-isolation -e .)"
    user_options: list = []

    def initialize_options(self):
        pass

    def finalize_options(self):
        pass

    def run(self):
        cmd = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "-e", ROOT]
        self.announce("running " + " ".join(cmd), level=2)
        subprocess.check_call(cmd)


def _requirements(name: str) -> list[str]:
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        lines = [ln.split("#")[0].strip() for ln in f]
    return [ln for ln in lines if ln and not ln.startswith("-")]


def _install_requires() -> list[str]:
    """The run-time dependencies: none for the deployment install; else requirements/runtime.txt
    with its torch floor replaced by the torch the ops are compiled against (``torch==2.14.1`` for
    ``2.14.1+cu130``: the C++ ABI of torch changes between releases, so a wheel's ``_C`` loads
    only into that release). Where torch is missing the floor stays, and the build stops with
    what to install."""
    if DEPLOY:
        return []
    reqs = _requirements("requirements/runtime.txt")
    if torch is None:
        return reqs
    built_against = str(torch.__version__).split("+", 1)[0]
    return [f"torch=={built_against}" if _requirement_name(r) == "torch" else r for r in reqs]


def _requirement_name(req: str) -> str:
    """The project name a requirement line starts with (PEP 508), lower case."""
    return re.match(r"\s*([A-Za-z0-9._-]*)", req).group(1).lower()


def _cmdclass() -> dict:
    if DEPLOY:
        return {"develop": develop}
    if torch is None:
        return {"build_ext": _MissingTorchBuild, "dist_info": _MissingTorchWheelMetadata, "develop": develop}
    return {"build_ext": _build_ext_class(), "develop": develop}


# The metadata (name, version, extras, console scripts) is in pyproject.toml; what is computed
# here: the extension, the commands, and the run-time dependencies (none for the deployment).
setup(
    ext_modules=[] if DEPLOY else [_extension()],
    cmdclass=_cmdclass(),
    install_requires=_install_requires(),
)
