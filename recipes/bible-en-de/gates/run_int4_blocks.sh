#!/bin/bash
# int4 block sizes against the BLEU gate on the Bible recipe: the 1,800-step float32 model of
# run_gates.sh (trained here with --threads 2), exported once, then quantized with
# `python -m export.quantize --scheme int4` at block sizes 32, 64 and 128 (asymmetric) and 128
# symmetric, each through export.quantize's own BLEU gate on the 1,007 test sentences (greedy,
# at most 1.0 below float32). A failing gate is recorded, not fatal. Output: int4_blocks.txt.
set -uo pipefail
WORK=${WORK:-/work/runs}
HERE=$(cd "$(dirname "$0")" && pwd)
D=$WORK/bible-en-de-data
F=$WORK/gate-fp32/checkpoints/step-1800
[ -d "$F" ] || { echo "train the model first (run_gates.sh's float32 training): $F is missing" >&2; exit 2; }
[ -d "$WORK/gate-fp32-onnx" ] || python -m export.onnx --model-dir "$F" --output-dir "$WORK/gate-fp32-onnx" || exit 1
OUT=$HERE/int4_blocks.txt
trap 'rm -f "$OUT.tmp"' EXIT
: > "$OUT.tmp"
for v in "b32:--quant-block-size 32" "b64:--quant-block-size 64" "b128:--quant-block-size 128" \
         "b128-symmetric:--quant-block-size 128 --quant-symmetric"; do
  name=${v%%:*}
  # shellcheck disable=SC2086
  python -m export.quantize --export-dir "$WORK/gate-fp32-onnx" --output-dir "$WORK/gate-fp32-int4-$name" \
    --scheme int4 ${v#*:} --gate-src "$D/test.en" --gate-ref "$D/test.de" > "$WORK/int4-$name.log" 2>&1
  echo "$name (exit $?): $(grep -h -o 'BLEU gate.*\|quality gate.*' "$WORK/int4-$name.log" | tail -1)" >> "$OUT.tmp"
done
mv "$OUT.tmp" "$OUT"
cat "$OUT"
