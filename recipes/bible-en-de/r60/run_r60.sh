#!/bin/bash
# The recipe's 60-minute training command (run.sh, step 2) twice on an otherwise idle machine: float32,
# then --amp bf16 (a CPU with native bfloat16: transformer_ext.cpu_features.bf16_support()), each with
# 2 threads and the machine to itself, then test BLEU on Acts of each run's best checkpoint, greedy and
# beam 4. Produces the files in this folder (summary_*.json is each run's summary.json). Run from the
# repository root; WORK is outside the repository. Nothing else may run meanwhile: the comparison is
# what each precision reaches in the same hour of wall time.
set -euo pipefail
WORK=${WORK:-/work/runs}
D=$WORK/bible-en-de-data
R=$WORK/r60
mkdir -p "$R"
[ -d "$D" ] || python -m transformer_ext.corpora bible --pair en-de --out "$D"
for precision in fp32 bf16; do
  amp=""; [ $precision = bf16 ] && amp="--amp bf16"
  echo "[$(date -u +%FT%TZ)] start $precision; load $(cat /proc/loadavg)" >> $R/r60.log
  python -m transformer_ext.train \
    --train $D/train.en $D/train.de --valid $D/valid.en $D/valid.de \
    --tokenizer sentencepiece --vocab-size 4000 --shared-vocab \
    --preset small --pre-ln --dropout 0 --max-len 256 --max-tokens 2000 \
    --lr-schedule inverse-sqrt --lr 1e-3 --warmup 200 --label-smoothing 0.1 \
    --max-steps 100000 --max-minutes 60 --eval-every 150 --keep-last 3 --best-metric bleu \
    --threads 2 --seed 1 --log-every 25 --device cpu $amp --out $WORK/r60-$precision \
    > $R/$precision.train.log 2>&1
  echo "[$(date -u +%FT%TZ)] trained $precision; load $(cat /proc/loadavg)" >> $R/r60.log
  cp $WORK/r60-$precision/summary.json $R/summary_$precision.json
done
for precision in fp32 bf16; do
  python -m transformer_ext.evaluate --model $WORK/r60-$precision/best --src $D/test.en --ref $D/test.de \
    --output $R/$precision.best.greedy.de --json > $R/test_$precision.best.greedy.json
  python -m transformer_ext.evaluate --model $WORK/r60-$precision/best --src $D/test.en --ref $D/test.de --beam-size 4 \
    --output $R/$precision.best.beam4.de --json > $R/test_$precision.best.beam4.json
done
python recipes/plot_curve.py --minutes --label float32 $R/summary_fp32.json --label "bfloat16 (--amp bf16)" \
  $R/summary_bf16.json $R/valid_bleu_r60.png
