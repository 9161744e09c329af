"""The Translator's decoding controls, result type, scoring, streaming and robust input, on the
demo model (eager) and its ONNX export (ONNX Runtime). The searches themselves are checked
against plain loops in test_decoding_options.py; here each option must reach them (the same
tokens as the search called on the runner directly), give equal tokens on both runtimes, and
fail with a clear error when it conflicts."""

from __future__ import annotations

import logging
import math
import re

import numpy as np
import pytest
from helpers import exported_dir

from transformer_ext import decoding
from transformer_ext.translate import Translation, TranslationError, Translator

SOURCES = ["three hundred and forty-two", "forty-two", "one thousand and one", "seven"]


@pytest.fixture(scope="module")
def translator():
    return Translator.from_model_dir(None)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The tiny test model on eager PyTorch and its export on ONNX Runtime."""
    export = exported_dir(tmp_path_factory, "portable")
    ort = Translator.from_export_dir(export, threads=1)
    eager = Translator.from_model_dir(tmp_path_factory.getbasetemp() / "shared_exports" / "tiny_model")
    return eager, ort


def encoded(translator, sources):
    ids = translator.encode(sources)
    lengths = np.array([len(x) for x in ids], dtype=np.int64)
    batch = np.full((len(ids), int(lengths.max())), translator.pad_id, dtype=np.int64)
    for r, x in enumerate(ids):
        batch[r, : len(x)] = x
    return batch, lengths, translator.max_decoding_length(lengths, 1.5, 10)


def test_every_setting_returns_translations(translator):
    for options in (
        dict(),
        dict(beam_size=3, num_hypotheses=2),
        dict(sampling_topk=0, seed=1, num_hypotheses=2),
    ):
        out = translator.translate(SOURCES, **options)
        assert all(isinstance(t, Translation) for t in out)
        assert [t.source for t in out] == SOURCES
        n = options.get("num_hypotheses", 1)
        assert all(len(t.hypotheses) == n and len(t.texts) == n and str(t) == t.texts[0] for t in out)
        for t in out:
            assert [translator.tokenizer.decode_target(h.tokens) for h in t.hypotheses] == t.texts
    greedy = translator.translate(SOURCES, return_scores=True)
    assert all(
        t.score is not None and t.score == pytest.approx(sum(t.hypotheses[0].token_log_probs)) for t in greedy
    )


def test_sampling_reaches_the_search_and_is_seeded(translator):
    # the translator decodes its batch sorted by length; each source draws from the stream of
    # its index in the input
    order = sorted(range(len(SOURCES)), key=lambda i: len(translator.encode([SOURCES[i]])[0]))
    ids, lengths, budget = encoded(translator, [SOURCES[i] for i in order])
    got = translator.translate(SOURCES, sampling_topk=0, sampling_temperature=1.5, seed=3, n_best=2)
    want = decoding.generate(
        translator.runner,
        ids,
        lengths,
        bos_id=translator.bos_id,
        eos_id=translator.eos_id,
        max_decoding_length=budget,
        sampling_topk=0,
        sampling_temperature=1.5,
        seed=3,
        num_hypotheses=2,
        source_index=order,
    )
    assert [[h.tokens for h in got[i].hypotheses] for i in order] == [[h.tokens for h in row] for row in want]
    again = translator.translate(SOURCES, sampling_topk=0, sampling_temperature=1.5, seed=3, n_best=2)
    assert [t.texts for t in again] == [t.texts for t in got]


def test_penalties_and_min_length_reach_the_search(translator):
    ids, lengths, budget = encoded(translator, SOURCES)
    got = translator.translate(
        SOURCES, repetition_penalty=1.7, no_repeat_ngram_size=2, min_length=12, max_length=20
    )
    want = decoding.greedy_decode(
        translator.runner,
        ids,
        lengths,
        bos_id=translator.bos_id,
        eos_id=translator.eos_id,
        max_decoding_length=np.minimum(budget, 20),
        min_decoding_length=np.minimum(12, np.minimum(budget, 20)),
        repetition_penalty=1.7,
        no_repeat_ngram_size=2,
    )
    assert [t.tokens for t in got] == want
    assert all(len(t.tokens) >= 11 for t in got)  # min_length counts the EOS


def test_target_prefix_is_forced(translator):
    out = translator.translate(SOURCES, target_prefix="neun")
    assert all(t.startswith("neun") for t in out)
    out = translator.translate(SOURCES[:2], target_prefix=["dreihundert", "zwei"], beam_size=3)
    assert out[0].startswith("dreihundert") and out[1].startswith("zwei")
    with pytest.raises(
        TranslationError,
        match=r"source 1: the target prefix has 30 tokens, more than the 23 this source may generate",
    ):
        translator.translate(SOURCES[:2], target_prefix=["e", "e" * 30])
    with pytest.raises(
        TranslationError, match=r"target_prefix must be one text or one per source \(2\), got 3"
    ):
        translator.translate(SOURCES[:2], target_prefix=["a", "b", "c"])


def test_score_is_forced_decoding_of_the_search_results(translator):
    beams = translator.translate(SOURCES, beam_size=4, n_best=2, length_penalty="none")
    for t in beams:
        scored = translator.score([t.source] * 2, t.texts)
        for s, h in zip(scored, t.hypotheses, strict=True):
            assert s.tokens == h.tokens
            if h.finished:
                assert math.isclose(s.log_prob, h.log_prob, rel_tol=1e-5, abs_tol=1e-5)
                np.testing.assert_allclose(s.token_log_probs, h.token_log_probs, atol=1e-5)
    with pytest.raises(TranslationError, match=r"target 1: "):
        translator.score(["one", "two"], ["eins", "zwei€"])
    with pytest.raises(TranslationError, match="one target per source: 2 sources, 1 targets"):
        translator.score(["one", "two"], ["eins"])


def test_translate_iterable_streams_in_order(translator):
    lines = SOURCES * 5
    read = []

    def source():
        for line in lines:
            read.append(line)
            yield line

    stream = translator.translate_iterable(source(), max_batch_tokens=60, window=6)
    first = next(stream)
    assert len(read) <= 6
    out = [first] + list(stream)
    assert out == translator.translate(lines)


def test_robust_input_when_not_strict(translator, caplog):
    with pytest.raises(TranslationError, match="source 1: empty source"):
        translator.translate(["one", "  "], strict=True)
    with caplog.at_level(logging.WARNING):
        out = translator.translate(["one", "", "forty-two€", "seven€€"], strict=False)
    assert out[1] == "" and out[0] == "eins"
    warnings = [r for r in caplog.records if "outside the vocabulary" in r.getMessage()]
    assert len(warnings) == 1 and "2 input lines" in warnings[0].getMessage()  # one warning, with the count
    long = " ".join(["seven"] * 20)
    with pytest.raises(TranslationError, match="more than the model's max_len"):
        translator.translate([long])
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        (cut,) = translator.translate([long], long_lines="truncate")
    assert isinstance(cut, str) and any("truncated" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "options, fragment",
    [
        (
            dict(beam_size=2, sampling_topk=0),
            "random sampling (sampling_topk / sampling_topp / sampling_temperature) needs beam size 1",
        ),
        (dict(sampling_topk=0, sampling_topp=1.5), "sampling_topp must be in (0, 1]"),
        (dict(sampling_topp=0.5), "sampling_topk = 1 (greedy) turns off"),
        (dict(seed=4), "seed applies to random sampling"),
        (dict(n_best=2), "n_best (2) cannot exceed the beam size (1)"),
        (dict(beam_size=2, early_stopping=True), "early_stopping is transformers' beam-search rule"),
        (dict(repetition_penalty=0), "repetition_penalty must be > 0"),
        (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size must be an int >= 0"),
        (dict(min_length=-1), "min_length must be an int >= 0"),
        (dict(long_lines="drop"), "long_lines must be one of"),
    ],
)
def test_conflicting_options_are_clear_errors(translator, options, fragment):
    with pytest.raises(TranslationError, match=re.escape(fragment)):
        translator.translate(["one"], **options)


def test_unknown_option_is_a_type_error(translator):
    with pytest.raises(TypeError, match=r"unknown generation option\(s\) \['beam'\]"):
        translator.translate(["one"], beam=2)


@pytest.mark.parametrize(
    "options",
    [
        dict(sampling_topk=0, seed=11, num_hypotheses=2),
        dict(beam_size=3, repetition_penalty=1.3, no_repeat_ngram_size=2),
        dict(target_prefix="ab", min_length=5, return_scores=True),
        dict(beam_size=3, length_penalty="hf", alpha=1.0, early_stopping=False),
    ],
    ids=lambda o: ",".join(o),
)
def test_eager_and_onnx_runtime_translators_give_equal_tokens(pair, options):
    eager, ort = pair
    sources = ["abc", "hello world", "a", "zz top"]
    a = eager.translate(sources, **options)
    b = ort.translate(sources, **options)
    assert [[h.tokens for h in t.hypotheses] for t in a] == [[h.tokens for h in t.hypotheses] for t in b]
    sa = eager.score(sources, [t.text for t in a])
    sb = ort.score(sources, [t.text for t in a])
    for x, y in zip(sa, sb, strict=True):
        np.testing.assert_allclose(x.token_log_probs, y.token_log_probs, atol=1e-4)


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(beam_size=3, num_hypotheses=2, length_penalty_type="hf", length_penalty=1.0),
        dict(target_prefix="ab", min_length=5, return_scores=True),
        dict(sampling_topk=0, seed=11),
    ],
    ids=lambda o: ",".join(o) or "greedy",
)
def test_workers_split_a_batch_and_translate_as_one_runner(pair, tmp_path_factory, options):
    """from_export_dir(workers=3): every batch decoded in 3 parts at once gives the tokens of one
    runner (sampling too: each part samples its sources' streams)."""
    _, ort = pair
    export = exported_dir(tmp_path_factory, "portable")
    split = Translator.from_export_dir(export, threads=1, workers=3)
    assert split._parallel is not None and len(split._parallel.runners) == 3
    sources = ["abc", "hello world", "a", "zz top", "q", "the end"]
    a = ort.translate(sources, **options)
    b = split.translate(sources, **options)
    assert [[h.tokens for h in t.hypotheses] for t in a] == [[h.tokens for h in t.hypotheses] for t in b]
    for bad in (0, 1.5, True):
        with pytest.raises(TranslationError, match="workers must be a positive integer"):
            Translator.from_export_dir(export, workers=bad)
