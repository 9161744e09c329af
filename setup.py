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
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

from setuptools import Command, setup

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

if not DEPLOY:
    import torch  # noqa: E402  (after CUDA_HOME is fixed: cpp_extension reads it at import)
    from torch.utils import cpp_extension  # noqa: E402


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


def _extension():
    # the schemas, the backend-independent autograd kernels of the in-place ops, the CPU kernels
    sources = [os.path.join("csrc", "torch_bindings.cpp"), os.path.join("csrc", "inplace.cpp")]
    sources += sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
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


# The metadata (name, version, extras, console scripts) is in pyproject.toml; what is computed
# here: the extension, the commands, and the run-time dependencies (none for the deployment).
setup(
    ext_modules=[] if DEPLOY else [_extension()],
    cmdclass={"develop": develop}
    if DEPLOY
    else {"build_ext": cpp_extension.BuildExtension, "develop": develop},
    install_requires=[] if DEPLOY else _requirements("requirements/runtime.txt"),
)
