#!/usr/bin/env bash
# Configure, build and run the C++ tests (ctest) of the op library from a fresh build folder,
# against the LibTorch inside the pip-installed torch wheel, with the system gcc and cmake.
#
#   bash scripts/ctest.sh                         # CPU kernels, Release
#   TRANSFORMER_EXT_ASAN=1 bash scripts/ctest.sh  # the same under AddressSanitizer
#   bash scripts/ctest.sh -DCMAKE_CXX_FLAGS=...   # extra arguments go to the cmake configure
#
# Environment: PYTHON (default: python3, the interpreter that has torch), BUILD_DIR (default:
# build/cmake, or build/cmake-asan; deleted and recreated), MAX_JOBS (default 2),
# TRANSFORMER_EXT_CUDA=1 to compile csrc/cuda as well (needs nvcc; tests still run on CPU).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
PYTHON="$(command -v "$PYTHON")"
ASAN="${TRANSFORMER_EXT_ASAN:-0}"
CUDA="${TRANSFORMER_EXT_CUDA:-0}"
JOBS="${MAX_JOBS:-2}"
if [[ "$ASAN" == "1" ]]; then
  BUILD_DIR="${BUILD_DIR:-$ROOT/build/cmake-asan}"
  BUILD_TYPE=RelWithDebInfo
else
  BUILD_DIR="${BUILD_DIR:-$ROOT/build/cmake}"
  BUILD_TYPE=Release
fi
onoff() { [[ "$1" == "1" ]] && echo ON || echo OFF; }

GENERATOR=()
if command -v ninja >/dev/null 2>&1; then GENERATOR=(-G Ninja); fi

rm -rf "$BUILD_DIR"
cmake -S "$ROOT" -B "$BUILD_DIR" "${GENERATOR[@]}" \
  -DCMAKE_BUILD_TYPE="$BUILD_TYPE" \
  -DPython3_EXECUTABLE="$PYTHON" \
  -DTRANSFORMER_EXT_ASAN="$(onoff "$ASAN")" \
  -DTRANSFORMER_EXT_CUDA="$(onoff "$CUDA")" \
  "$@"
cmake --build "$BUILD_DIR" --parallel "$JOBS"
cd "$BUILD_DIR"
ctest --output-on-failure --timeout 600
