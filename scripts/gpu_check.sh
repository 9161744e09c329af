#!/usr/bin/env bash
# GPU verification in one call (a lent GPU machine gives 15 minutes in all, its start included):
#   1. builds transformer_ext._C from source with its CUDA kernels (in place, for the local GPU's arch);
#   2. runs every CUDA test (tests whose id or markers say cuda, in every test file);
#   3. the CUDA op benchmark (benchmarks/ops/bench_ops.py --device cuda: masked_softmax vs the eager
#      composite and torch._masked_softmax, attention vs SDPA, decode_attention vs eager);
#   3b. the fused attention benchmark (benchmarks/ops/bench_attention.py --device cuda, T = 256 and 1024);
#   3c. the T5 training step with relative bias, fused kernels vs SDPA (benchmarks/train/bench_t5_attention.py);
#   4. the decode benchmark on CUDA (benchmarks/decode/bench_decode.py --device cuda, torch engines);
#   5. prints one summary table (also written to summary.txt) with the GPU targets.
# Everything is bounded to GPU_CHECK_BUDGET seconds of run time (default 290, under 5 minutes):
# each stage gets what is left, the op benchmark falls back to --quick when time is short.
#
# Usage:  bash scripts/gpu_check.sh            # outputs under $OUT if set, else ./gpu_check_out
# Knobs:  GPU_CHECK_BUDGET=seconds  PYTHON=python3  MAX_JOBS=N  TORCH_CUDA_ARCH_LIST=9.0
#         GPU_CHECK_DRY_RUN=1: no build, CPU, smoke-sized benchmarks: checks this script's plumbing
#         anywhere (the CUDA tests are then all skipped).
# Offline machines: pytest / hypothesis are installed from ./.whl (pip --no-index) when missing there.
# At most 8 files are written to the output folder (what a lent machine sends back).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${OUT:-$root/gpu_check_out}"
mkdir -p "$out"
py="${PYTHON:-python3}"
budget="${GPU_CHECK_BUDGET:-290}"
dry="${GPU_CHECK_DRY_RUN:-0}"
device=cuda
[ "$dry" = 1 ] && device=cpu
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
SECONDS=0
left() { echo $(( budget - SECONDS )); }
note() { printf '[gpu_check %3ds] %s\n' "$SECONDS" "$*"; }
status_file="$scratch/status"
: >"$status_file"
record() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$status_file"; }  # stage, status, seconds

# ------------------------------------------------------------------ environment
note "machine: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n1 || echo 'nvidia-smi not found')"
"$py" - <<'EOF' 2>&1 | sed 's/^/[gpu_check] /'
import platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"GPU visible: {torch.cuda.is_available()}" + (f" ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else ""))
EOF
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' ')"
  export TORCH_CUDA_ARCH_LIST="${cap:-9.0}"
fi
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi

missing="$("$py" -c 'import importlib.util as u; print(" ".join(m for m in ("pytest", "hypothesis") if u.find_spec(m) is None))')"
if [ -n "$missing" ] && [ -d .whl ]; then
  note "installing $missing from ./.whl (offline)"
  "$py" -m pip install -q --no-index --find-links .whl $missing >/dev/null 2>&1 || note "offline install of $missing failed"
  missing="$("$py" -c 'import importlib.util as u; print(" ".join(m for m in ("pytest", "hypothesis") if u.find_spec(m) is None))')"
fi

# ------------------------------------------------------------------ 1. build
t0=$SECONDS
if [ "$dry" = 1 ]; then
  note "dry run: no build, the existing transformer_ext._C is used"
  echo "dry run: not built" >"$out/build.log"
  record build "skipped (dry run)" 0
  built=1
else
note "building transformer_ext._C (TRANSFORMER_EXT_CUDA=1, arch $TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS)"
if TRANSFORMER_EXT_CUDA=1 timeout "$(( $(left) - 60 ))" "$py" setup.py build_ext --inplace >"$out/build.log" 2>&1 \
   && "$py" -c "import transformer_ext.ops as o, sys; sys.exit(0 if o.cuda_kernels_built() else 1)" >>"$out/build.log" 2>&1; then
  record build ok $(( SECONDS - t0 ))
  built=1
else
  record build FAILED $(( SECONDS - t0 ))
  built=0
  note "build failed; last lines of build.log:"
  tail -n 25 "$out/build.log"
fi
fi

# ------------------------------------------------------------------ 2. CUDA tests
if [ "$built" = 1 ] && [ -z "$missing" ]; then
  t0=$SECONDS
  budget_tests=$(( $(left) * 35 / 100 ))
  note "CUDA tests (pytest -k cuda, every test file; ${budget_tests}s at most)"
  timeout "$budget_tests" "$py" -m pytest tests -k cuda -q -rs -p no:cacheprovider --continue-on-collection-errors \
      --junitxml="$scratch/pytest.xml" >"$out/tests.log" 2>&1
  rc=$?
  tail -n 15 "$out/tests.log"
  case $rc in
    0) record tests ok $(( SECONDS - t0 ));;
    5) record tests "no tests selected" $(( SECONDS - t0 ));;
    124) record tests TIMEOUT $(( SECONDS - t0 ));;
    *) record tests FAILED $(( SECONDS - t0 ));;
  esac
else
  record tests "not run (${missing:+missing $missing, }build $([ "$built" = 1 ] && echo ok || echo failed))" 0
fi

# ------------------------------------------------------------------ 3. op benchmark
if [ "$built" = 1 ]; then
  t0=$SECONDS
  quick=""
  { [ "$(left)" -lt 150 ] || [ "$dry" = 1 ]; } && quick="--quick"
  budget_ops=$(( $(left) * 60 / 100 ))
  note "op benchmark on $device ${quick:-full} (${budget_ops}s at most)"
  if timeout "$budget_ops" "$py" benchmarks/ops/bench_ops.py --device "$device" $quick --out "$out/bench_ops_cuda.json" \
      >"$scratch/bench_ops.log" 2>&1; then
    record bench_ops "ok${quick:+ (quick)}" $(( SECONDS - t0 ))
  else
    record bench_ops FAILED $(( SECONDS - t0 ))
    tail -n 15 "$scratch/bench_ops.log"
  fi
fi

# ------------------------------------------------------------------ 3b. fused attention benchmark
if [ "$built" = 1 ] && [ -f benchmarks/ops/bench_attention.py ]; then
  t0=$SECONDS
  budget_att=$(( $(left) * 30 / 100 ))
  att_sizes="256,1024"
  [ "$dry" = 1 ] && att_sizes="32"
  note "fused attention benchmark on $device (T in $att_sizes, ${budget_att}s at most)"
  # the PNG stays in the scratch folder (at most 8 files come back)
  if timeout "$budget_att" "$py" benchmarks/ops/bench_attention.py --device "$device" --sizes "$att_sizes" --repeats 3 \
      --out "$scratch/bench_attention_cuda.json" >"$scratch/bench_attention.log" 2>&1; then
    cp "$scratch/bench_attention_cuda.json" "$out/bench_attention_cuda.json"
    record bench_attention ok $(( SECONDS - t0 ))
  else
    record bench_attention FAILED $(( SECONDS - t0 ))
    tail -n 15 "$scratch/bench_attention.log"
  fi
fi

# ------------------------------------------------------------------ 3c. T5 attention with relative bias
if [ "$built" = 1 ] && [ -f benchmarks/train/bench_t5_attention.py ]; then
  t0=$SECONDS
  budget_t5=$(( $(left) * 25 / 100 ))
  t5_args="--repeats 3"
  [ "$dry" = 1 ] && t5_args="--quick"
  note "T5 attention benchmark on $device ($t5_args, ${budget_t5}s at most)"
  if timeout "$budget_t5" "$py" -m benchmarks bench_t5_attention --device "$device" $t5_args \
      --out "$scratch/bench_t5_attention_cuda.json" >"$scratch/bench_t5.log" 2>&1; then
    cp "$scratch/bench_t5_attention_cuda.json" "$out/bench_t5_attention_cuda.json"
    record bench_t5_attention ok $(( SECONDS - t0 ))
  else
    record bench_t5_attention FAILED $(( SECONDS - t0 ))
    tail -n 15 "$scratch/bench_t5.log"
  fi
fi

# ------------------------------------------------------------------ 4. decode benchmark
if [ "$built" = 1 ] && [ -f benchmarks/decode/bench_decode.py ] && grep -q -- "--device" benchmarks/decode/bench_decode.py; then
  t0=$SECONDS
  engines="$("$py" - <<'EOF' 2>/dev/null
import sys
sys.path.insert(0, "benchmarks")
import bench_decode
# CPU-only engines, and compiled_ops (an Inductor/Triton compile would eat the time budget)
cpu_only = ("ort", "onnx", "ctranslate", "ct2", "tensorrt", "compiled")
print(",".join(e.name for e in bench_decode.ENGINES if not any(k in e.name.lower() for k in cpu_only)))
EOF
)"
  budget_dec=$(( $(left) - 15 ))
  if [ "$budget_dec" -gt 20 ] && [ -n "$engines" ]; then
    size="--models base --repeats 3"
    [ "$dry" = 1 ] && size="--quick --engines eager_ops"
    [ "$dry" = 1 ] || size="$size --engines $engines"
    note "decode benchmark on $device: $size (${budget_dec}s at most)"
    if timeout "$budget_dec" "$py" benchmarks/decode/bench_decode.py --device "$device" $size \
        --out "$out/bench_decode_cuda.json" >"$scratch/bench_decode.log" 2>&1; then
      record bench_decode ok $(( SECONDS - t0 ))
    else
      record bench_decode "FAILED or tokens differ" $(( SECONDS - t0 ))
      tail -n 15 "$scratch/bench_decode.log"
    fi
  else
    record bench_decode "skipped (no time left or no CUDA engine)" 0
  fi
else
  record bench_decode "skipped (no benchmarks/decode/bench_decode.py with --device)" 0
fi

# ------------------------------------------------------------------ 5. summary
"$py" - "$status_file" "$scratch/pytest.xml" "$out/bench_ops_cuda.json" "$out/bench_decode_cuda.json" "$SECONDS" "$out/bench_attention_cuda.json" <<'EOF' | tee "$out/summary.txt"
import json, os, sys
import xml.etree.ElementTree as ET

status_file, junit, ops_json, dec_json, seconds, att_json = sys.argv[1:7]
lines = []
def row(*cells):
    lines.append("  ".join(str(c) for c in cells))

lines.append(f"GPU check summary ({int(seconds)} s of run time)")
lines.append("-" * 78)
for line in open(status_file):
    stage, status, secs = line.rstrip("\n").split("\t")
    row(f"{stage:13s}", f"{status:42s}", f"{secs:>4s} s")
if os.path.exists(junit):
    suites = ET.parse(junit).getroot()
    suites = [suites] if suites.tag == "testsuite" else list(suites)
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    row(f"{'cuda tests':13s}", f"{n['tests'] - n['failures'] - n['errors'] - n['skipped']} passed, {n['failures']} failed, "
        f"{n['errors']} errors, {n['skipped']} skipped")
    for s in suites:
        for case in s.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                row("  FAILED", f"{case.get('classname')}::{case.get('name')}")
lines.append("-" * 78)
if os.path.exists(ops_json):
    r = json.load(open(ops_json))
    ms = [x for x in r.get("masked_softmax", []) if x["dtype"] == "float32"]
    lines.append(f"masked_softmax float32 vs torch._masked_softmax (speed-up of ours; >= 1 is the target for K <= 1024), {r['environment'].get('gpu', '')}")
    for mask in ("padding", "causal"):
        xs = sorted((x for x in ms if x["mask"] == mask), key=lambda x: x["K"])
        row(f"  {mask:8s}", " ".join(f"K={x['K']}:{x['speedup_vs_torch_masked_softmax']:.2f}x" for x in xs))
    small = [x["speedup_vs_torch_masked_softmax"] for x in r.get("masked_softmax", []) if x["K"] <= 1024]
    big = [x for x in r.get("masked_softmax", []) if x["K"] > 1024]
    if small:
        row("  target", f"min over K<=1024 (all dtypes, masks) = {min(small):.2f}x -> {'MET' if min(small) >= 1 else 'NOT MET'};"
            f" K>1024 cases run: {len(big)}")
    da = r.get("decode_attention", [])
    lines.append("decode_attention vs eager attention over the cache (target >= 2x at L >= 256)")
    for B in sorted({x["B"] for x in da}):
        xs = sorted((x for x in da if x["B"] == B), key=lambda x: x["L"])
        row(f"  B={B:<3d}", " ".join(f"L={x['L']}:{x['speedup_vs_eager']:.2f}x" for x in xs))
    long = [x["speedup_vs_eager"] for x in da if x["L"] >= 256]
    if long:
        row("  target", f"min over L>=256 = {min(long):.2f}x -> {'MET' if min(long) >= 2 else 'NOT MET'}")
    att = r.get("attention", [])
    if att:
        row("attention", "ours/SDPA " + " ".join(f"{x['dtype']}@{x['K']}:{x['speedup_vs_sdpa']:.2f}x" for x in att))
    kv = r.get("kv_cache_append_", {}).get("summary", {})
    if kv:
        row("kv append", " ".join(f"{k}: first {v['first_steps_s'] * 1e6:.1f} us, last {v['last_steps_s'] * 1e6:.1f} us/step"
                                  for k, v in kv.items()))
if os.path.exists(att_json):
    r = json.load(open(att_json))
    lines.append("ops.attention vs SDPA (speed-up of ours; fwd / fwd+bwd, full / ragged, dropout 0 / 0.1)")
    for c in r.get("cases", []):
        row(f"  T={c['T']:<5d}", f"{c['mode']:8s}", "ragged" if c["ragged"] else "full  ", f"p={c['dropout_p']}",
            f"{c['speedup_vs_sdpa']:.2f}x (three-step {c['speedup_vs_three_step']:.2f}x)")
t5_json = os.path.join(os.path.dirname(ops_json), "bench_t5_attention_cuda.json")
if os.path.exists(t5_json):
    r = json.load(open(t5_json))
    lines.append("T5 training step with relative bias, fused vs SDPA + additive mask (target >= 1.1x at T = 128, 256)")
    for c in r.get("steps", []):
        row(f"  T={c['T']:<5d}", f"step {c['speedup_vs_sdpa']:.2f}x")
    for c in r.get("attention_only", []):
        row(f"  T={c['T']:<5d}", f"attention fwd+bwd {c['speedup_vs_sdpa']:.2f}x")
if os.path.exists(dec_json):
    r = json.load(open(dec_json))
    lines.append("decode (greedy, 48 tokens, source 24, float32) tokens/s on " + r.get("device", "?"))
    for model, entry in r.get("models", {}).items():
        for case in entry["cases"]:
            cells = [f"{name}: {e['tokens_per_second']:.0f}" + ("" if e.get("tokens_match", True) else " (TOKENS DIFFER)")
                     for name, e in case["engines"].items() if "tokens_per_second" in e]
            row(f"  {model} b={case['batch']:<3d}", ", ".join(cells))
print("\n".join(lines))
EOF
note "outputs in $out: $(ls "$out" | tr '\n' ' ')"
grep -q "FAILED" "$status_file" && exit 1
exit 0
