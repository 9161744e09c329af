#!/bin/bash
# The gate model of the Bible recipe: 1,800 steps of the `small` Pre-LN preset on the recipe's
# data, seed 1, at $WORK/gate-PRECISION. Usage: train_gate_model.sh fp32|bf16 THREADS
# (run_gates.sh trains both precisions with 1 thread; run_int8_few_rows.sh fp32 with 2).
set -euo pipefail
precision=$1 threads=$2
WORK=${WORK:-/work/runs}
D=$WORK/bible-en-de-data
amp=""; [ "$precision" = bf16 ] && amp="--amp bf16"
# shellcheck disable=SC2086
python -m transformer_ext.train \
  --train $D/train.en $D/train.de --valid $D/valid.en $D/valid.de \
  --tokenizer sentencepiece --vocab-size 4000 --shared-vocab \
  --preset small --pre-ln --dropout 0 --max-len 256 --max-tokens 2000 \
  --lr-schedule inverse-sqrt --lr 1e-3 --warmup 200 --label-smoothing 0.1 \
  --max-steps 1800 --eval-every 300 --keep-last 3 --best-metric bleu \
  --threads "$threads" --seed 1 --log-every 50 $amp --out $WORK/gate-$precision
