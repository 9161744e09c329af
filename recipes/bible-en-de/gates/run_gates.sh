#!/bin/bash
# The bfloat16 and quantization quality gates on the Bible recipe (the results in this folder):
# the recipe's model trained twice for the same 1,800 steps (float32 and --amp bf16, seed 1, one
# thread each), then test BLEU on Acts of: both models (training gate, at most 0.5 apart), the
# float32 model decoded with bfloat16 weights (decode gate, at most 0.3 below float32), and its
# int4 and int8 exports (export.quantize's own BLEU gate: at most 1.0 / 0.5 below float32).
# Needs a CPU with native bfloat16 (transformer_ext.cpu_features.bf16_support()).
set -euo pipefail
WORK=${WORK:-/work/runs}
D=$WORK/bible-en-de-data
G=$WORK/gates
mkdir -p "$G"
[ -d "$D" ] || python -m transformer_ext.corpora bible --pair en-de --out "$D"
HERE=$(cd "$(dirname "$0")" && pwd)
for precision in fp32 bf16; do
  bash "$HERE/train_gate_model.sh" $precision 1
done
for precision in fp32 bf16; do
  for step in 1500 1800; do
    python -m transformer_ext.evaluate --model $WORK/gate-$precision/checkpoints/step-$step \
      --src $D/test.en --ref $D/test.de --json > $G/$precision-train-step$step.json
  done
done
F=$WORK/gate-fp32/checkpoints/step-1800
python -m transformer_ext.evaluate --model $F --src $D/test.en --ref $D/test.de --dtype bfloat16 \
  --json > $G/fp32-train-step1800.bf16decode.json
python -m export.onnx --model-dir $F --output-dir $WORK/gate-fp32-onnx
for scheme in int4 int8; do
  python -m export.quantize --export-dir $WORK/gate-fp32-onnx --output-dir $WORK/gate-fp32-$scheme \
    --scheme $scheme --gate-src $D/test.en --gate-ref $D/test.de
done
