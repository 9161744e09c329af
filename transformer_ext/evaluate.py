"""Score translations with sacrebleu: BLEU and chrF of detokenized hypotheses against raw references.

``python -m transformer_ext.evaluate --model DIR --src FILE --ref FILE`` translates ``--src``
with the model folder (eager PyTorch) or an export folder (ONNX Runtime), and prints BLEU and
chrF with their sacrebleu signatures and the decoding settings (``--json``: one JSON object).
"""

from __future__ import annotations

import logging
from typing import Sequence

logger = logging.getLogger(__name__)

__all__ = ["score_texts"]


def _sacrebleu():
    try:
        import sacrebleu
    except ImportError as exc:  # pragma: no cover - depends on the environment
        from .cli import UserError

        raise UserError("scoring needs the sacrebleu package: pip install sacrebleu==2.6.0 (or the [eval] extra)") \
            from exc
    return sacrebleu


def score_texts(hypotheses: Sequence[str], references: Sequence[str]) -> dict:
    """Corpus BLEU (13a tokenization, exp smoothing) and chrF of ``hypotheses`` against one reference each.

    Returns ``{"bleu", "chrf", "bleu_signature", "chrf_signature", "n"}`` with sacrebleu's
    default settings, so the numbers equal those of the ``sacrebleu`` command on the same files.
    """
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    sacrebleu = _sacrebleu()
    bleu, chrf = sacrebleu.BLEU(), sacrebleu.CHRF()
    hyps, refs = list(hypotheses), [list(references)]
    b = bleu.corpus_score(hyps, refs)
    c = chrf.corpus_score(hyps, refs)
    return dict(bleu=float(b.score), chrf=float(c.score), bleu_signature=str(bleu.get_signature()),
                chrf_signature=str(chrf.get_signature()), n=len(hyps), bleu_detail=str(b))
