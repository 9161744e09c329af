#!/usr/bin/env bash
# Creates (or reuses) the virtual environment .venv in the repository root, installs the pinned
# dependencies and builds the compiled op library in place (an editable install).
# Idempotent: a second run rebuilds only when csrc/ or setup.py changed. Environment knobs:
#   VENV=path                 where the environment lives (default: .venv)
#   TRANSFORMER_EXT_CUDA=...  auto (default) | 1 (require the CUDA kernels) | 0 (CPU only)
#   TORCH_CUDA_ARCH_LIST      defaults to "8.0;9.0" when no GPU is visible (set in setup.py)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${VENV:-$root/.venv}"
py="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  echo "[bootstrap] creating $venv"
  "$py" -m venv "$venv"
fi
stamp="$venv/.requirements.sha"
want="$(sha256sum requirements/dev.txt requirements/runtime.txt | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[bootstrap] installing requirements (torch is a large download the first time)"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -r requirements/dev.txt
  echo "$want" > "$stamp"
fi

export MAX_JOBS="${MAX_JOBS:-2}"
so="$(ls transformer_ext/_C*.so 2>/dev/null | head -n1 || true)"
if [ -n "$so" ] && [ -z "$(find csrc setup.py -newer "$so" -type f | head -n1)" ] \
   && "$venv/bin/python" -m pip show -q transformer_ext >/dev/null 2>&1; then
  echo "[bootstrap] transformer_ext._C is up to date ($so)"
else
  echo "[bootstrap] building transformer_ext._C (TRANSFORMER_EXT_CUDA=${TRANSFORMER_EXT_CUDA:-auto}, MAX_JOBS=$MAX_JOBS)"
  # The documented developer install; setup.py maps it to pip install --no-build-isolation -e .
  "$venv/bin/python" setup.py -q develop
fi
"$venv/bin/python" -c "import transformer_ext.ops as o; print('[bootstrap] ops loaded; CUDA kernels built:', o.cuda_kernels_built())"
