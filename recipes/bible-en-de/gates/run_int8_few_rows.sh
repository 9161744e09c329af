#!/bin/bash
# The int8 export's two decoder steps against the BLEU gate on the Bible recipe: the 1,800-step
# float32 model of run_gates.sh (trained with --threads 2 when missing), exported once, then
# `python -m export.quantize --scheme int8` with the recipe's test set as the gate: the dynamic
# int8 step and the few-row step (decoder_step_few_rows.onnx, every step through it) each at
# most 0.5 BLEU below float32 on the 1,007 test sentences, greedy. Output: int8_few_rows.txt,
# the two gate records from the int8 folder's manifest.
set -euo pipefail
WORK=${WORK:-/work/runs}
HERE=$(cd "$(dirname "$0")" && pwd)
D=$WORK/bible-en-de-data
F=$WORK/gate-fp32/checkpoints/step-1800
[ -d "$D" ] || python -m transformer_ext.corpora bible --pair en-de --out "$D"
[ -d "$F" ] || bash "$HERE/train_gate_model.sh" fp32 2
[ -d "$WORK/gate-fp32-onnx" ] || python -m export.onnx --model-dir "$F" --output-dir "$WORK/gate-fp32-onnx"
python -m export.quantize --export-dir "$WORK/gate-fp32-onnx" --output-dir "$WORK/gate-fp32-int8" \
  --scheme int8 --gate-src "$D/test.en" --gate-ref "$D/test.de"
trap 'rm -f "$HERE/int8_few_rows.txt.tmp"' EXIT
python - "$WORK/gate-fp32-int8/manifest.json" > "$HERE/int8_few_rows.txt.tmp" <<'PY'
import json, sys
q = json.load(open(sys.argv[1]))["quantization"]
print("dynamic int8 step (decoder_step.onnx):", json.dumps(q["gate"]))
print("few-row step (decoder_step_few_rows.onnx):", json.dumps(q["few_rows"]["gate"]))
PY
mv "$HERE/int8_few_rows.txt.tmp" "$HERE/int8_few_rows.txt"
cat "$HERE/int8_few_rows.txt"
