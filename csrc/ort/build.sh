#!/usr/bin/env bash
# Build the ONNX Runtime custom-operator library build/ort/libtransformer_ext_ort.so
# (transformer_ext.DecodeAttention, csrc/ort/custom_op.cc).
#
#   csrc/ort/build.sh [--portable] [OUT_DIR]     # OUT_DIR defaults to build/ort
#
# Needs ONNX Runtime's C/C++ API headers: scripts/fetch_ort_headers.sh puts them in
# build/ort-headers/include (or set ORT_HEADERS to a folder holding onnxruntime_cxx_api.h).
# Links no ONNX Runtime (the API table comes from RegisterCustomOps), so one build loads into
# any ONNX Runtime whose C API version is the headers' or newer.
#
# ISA: the kernel (decode_attention_kernel.cc) is compiled with -O3 -mavx2 -mfma, with no
# run-time dispatch; the registration code is compiled for baseline x86-64 and refuses, with a
# message, a CPU without AVX2 + FMA. --portable compiles the kernel without those flags (plain
# C++ loops). -march=native is never used: the library must run on other machines than the
# one that built it. CXX (default c++) and CXXFLAGS are honoured.
set -euo pipefail

prog=build.sh
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
isa=(-mavx2 -mfma)
out=""
for arg in "$@"; do
  case "$arg" in
    --portable) isa=() ;;
    -*) echo "$prog: error: unknown option $arg (expected --portable or OUT_DIR)" >&2; exit 2 ;;
    *) [ -z "$out" ] || { echo "$prog: error: expected one OUT_DIR, got $out and $arg" >&2; exit 2; }; out=$arg ;;
  esac
done
out=${out:-$repo/build/ort}
headers=${ORT_HEADERS:-$repo/build/ort-headers/include}
cxx=${CXX:-c++}
if [ ! -f "$headers/onnxruntime_cxx_api.h" ]; then
  echo "$prog: error: no onnxruntime_cxx_api.h in $headers; run scripts/fetch_ort_headers.sh first (or set ORT_HEADERS)" >&2
  exit 1
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/ort-build.XXXXXX")
trap 'rm -rf "$work"' EXIT INT TERM
flags=(-std=c++17 -O3 -fPIC -fvisibility=hidden -fno-math-errno -Wall -Wextra ${CXXFLAGS:-})
"$cxx" "${flags[@]}" "${isa[@]}" -c "$here/decode_attention_kernel.cc" -o "$work/kernel.o"
"$cxx" "${flags[@]}" -isystem "$headers" -c "$here/custom_op.cc" -o "$work/custom_op.o"
"$cxx" -shared -Wl,-z,defs -o "$work/libtransformer_ext_ort.so" "$work/kernel.o" "$work/custom_op.o"
mkdir -p "$out"
mv -f "$work/libtransformer_ext_ort.so" "$out/libtransformer_ext_ort.so"
echo "$prog: wrote $out/libtransformer_ext_ort.so (kernel ISA: ${isa[*]:-baseline})"
