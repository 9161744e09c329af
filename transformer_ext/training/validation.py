"""What a validation measures, and which validation record is the best.

:func:`validate` runs the model on the validation examples: the label-smoothed loss and the
plain cross-entropy per target token, exact match of greedy decoding on a fixed subset (evenly
spread over the examples), and for parallel text BLEU and chrF (sacrebleu) of the same decoded
examples. A record is better than another by the run's ``--best-metric``, ties broken by the
lower validation loss (:func:`metric_key`, :func:`is_improvement`). (``python -m
transformer_ext.evaluate`` is the scoring command for a finished model.)
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch

from ..data import Example, TokenBatchSampler, collate, encode_examples, example_cost
from .optim import token_loss

logger = logging.getLogger(__name__)

__all__ = ["validate", "metric_key", "is_improvement", "log_validation"]


@torch.no_grad()
def validate(
    model,
    tokenizer,
    examples: Sequence[Example],
    *,
    device,
    max_tokens: int = 4000,
    label_smoothing: float = 0.0,
    exact_examples: Optional[int] = None,
    beam_size: int = 1,
    with_loss: bool = True,
    pairs=None,
    bleu: bool = False,
) -> dict:
    """Loss and exact match of ``model`` on ``examples``.

    Returns ``{"loss", "nll", "exact_match", "n_exact", "n_loss"}``: ``loss`` is the
    label-smoothed training objective, ``nll`` the plain cross-entropy (both per target token,
    over all examples); ``exact_match`` is the fraction of ``exact_examples``
    examples, evenly spread over them (all when None), whose decoded translation equals
    the reference exactly. ``pairs``: the examples' token ids when already encoded (parallel
    text). ``bleu``: also ``bleu``, ``chrf`` and their sacrebleu signatures over the same decoded
    examples (detokenized hypotheses against the raw reference texts).
    """
    was_training = model.training
    model.eval()
    result: dict[str, Any] = {}
    try:
        if with_loss:
            if pairs is None:
                pairs = encode_examples(tokenizer, examples)
            result.update(_losses(model, tokenizer, pairs, device, max_tokens, label_smoothing))
            result.update(n_loss=len(examples))
        if exact_examples is None or exact_examples >= len(examples):
            subset = list(examples)
        else:  # evenly spread over the (sorted) examples, not just the smallest numbers
            subset = [examples[i * len(examples) // exact_examples] for i in range(exact_examples)]
        if subset:
            result.update(_decoded_scores(model, tokenizer, subset, device, beam_size, bleu))
    finally:
        if was_training:
            model.train()
    return result


def _losses(model, tokenizer, pairs, device, max_tokens: int, label_smoothing: float) -> dict:
    """The label-smoothed loss and the plain cross-entropy per target token over ``pairs``."""
    sampler = TokenBatchSampler([example_cost(len(s), len(t)) for s, t in pairs], max_tokens, shuffle=False)
    ls_sum = nll_sum = 0.0
    n_tok = 0
    for idx in sampler.batches(0):
        batch = collate(
            [pairs[i] for i in idx], pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id
        ).to(device)
        logits = model(batch.src_ids, batch.src_lengths, batch.tgt_in)
        ls, n = token_loss(logits, batch.tgt_out, tokenizer.pad_id, label_smoothing)
        nll, _ = token_loss(logits, batch.tgt_out, tokenizer.pad_id, 0.0)
        ls_sum += float(ls) * n
        nll_sum += float(nll) * n
        n_tok += n
    return dict(loss=ls_sum / n_tok, nll=nll_sum / n_tok)


def _decoded_scores(model, tokenizer, subset: Sequence[Example], device, beam_size: int, bleu: bool) -> dict:
    """Exact match (and BLEU, chrF) of the model's translations of ``subset``, with the first errors."""
    from ..translator import Translator

    translator = Translator.from_model(model, tokenizer, device)
    outputs = translator.translate([ex.source for ex in subset], beam_size=beam_size, num_hypotheses=1)
    result: dict[str, Any] = {}
    if bleu:
        from ..evaluate import score_texts

        scores = score_texts([out.text for out in outputs], [ex.target for ex in subset])
        result.update({k: scores[k] for k in ("bleu", "chrf", "bleu_signature", "chrf_signature")})
    pairs = list(zip(outputs, subset, strict=True))
    result.update(
        exact_match=sum(out.text == ex.target for out, ex in pairs) / len(subset),
        n_exact=len(subset),
        errors=[(ex.source, out.text, ex.target) for out, ex in pairs if out.text != ex.target][:20],
    )
    return result


def metric_key(record: dict, metric: str) -> tuple:
    """Larger is better: the chosen metric, then the negated validation loss."""
    if metric == "loss":
        return (-record["loss"],)
    return (record.get({"exact": "exact_match"}.get(metric, metric), 0.0), -record["loss"])


def is_improvement(record: dict, best: Optional[dict], metric: str) -> bool:
    """Whether ``record`` replaces ``best`` (None: the first validation) as the best by ``metric``."""
    return best is None or metric_key(record, metric) > metric_key(best, metric)


def log_validation(record: dict, improved: bool, errors: Sequence[tuple[str, str, str]]) -> None:
    """One log line for a validation record, and a few of its errors at debug level."""
    bleu_text = f", BLEU {record['bleu']:.2f}, chrF {record['chrf']:.2f}" if "bleu" in record else ""
    logger.info(
        "validation at step %d: loss %.4f, nll %.4f, exact match %.3f (%d)%s%s",
        record["step"],
        record["loss"],
        record["nll"],
        record.get("exact_match", float("nan")),
        record.get("n_exact", 0),
        bleu_text,
        " (best so far)" if improved else "",
    )
    for src, hyp, ref in errors[:3]:
        logger.debug("  %r -> %r (reference %r)", src, hyp, ref)
