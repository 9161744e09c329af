"""The search options (decoder start token, target prefix, banned ids, repetition penalty,
no-repeat n-grams, forced EOS, sampling, several hypotheses, scores, forced-decoding scoring)
against plain loops written here, on random numpy runners; their argument errors; and equal
tokens on the eager and the ONNX Runtime runner."""

from __future__ import annotations

import math
import re
import types

import numpy as np
import pytest
from beam_reference import BOS, EOS, loop_greedy, loop_sample, loop_score
from helpers import FunctionRunner, draw_options, masked_random_fn, shifted, sources
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_ext import decoding
from transformer_ext.decoding import beam_search, generate, greedy_decode, score


def draw_budgets(data, B, low=0, high=7):
    max_new = np.array(data.draw(st.lists(st.integers(low, high), min_size=B, max_size=B)))
    min_new = np.array(data.draw(st.lists(st.integers(0, 4), min_size=B, max_size=B)))
    return max_new, min_new


# ------------------------------------------------------------------------------------------
# greedy, sampling, scores
# ------------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    V=st.sampled_from([4, 9, 40, 1100]),
    B=st.integers(1, 4),
    data=st.data(),
    seed=st.integers(0, 10_000),
    p_masked=st.sampled_from([0.0, 0.3]),
)
def test_greedy_with_processors_equals_loop(V, B, data, seed, p_masked):
    max_new, min_new = draw_budgets(data, B)
    options = draw_options(data, V, B, max_new, hf=False)
    fn = shifted(masked_random_fn(V, seed, 1.5, p_masked), 1.0)
    src, lengths = sources(B)
    kw = dict(bos_id=BOS, eos_id=EOS, max_decoding_length=max_new, min_decoding_length=min_new, **options)
    tokens = greedy_decode(FunctionRunner(V, fn), src, lengths, **kw)
    hyps = greedy_decode(FunctionRunner(V, fn), src, lengths, return_scores=True, **kw)
    want = loop_greedy(fn, B, max_new, min_new, options)
    assert tokens == [w[0] for w in want]
    for (h,), (w_tokens, w_lps, w_finished) in zip(hyps, want, strict=True):
        assert h.tokens == w_tokens
        assert h.finished == w_finished
        np.testing.assert_allclose(h.token_log_probs, w_lps, rtol=1e-6, atol=1e-7)
        assert h.log_prob == h.score
        if w_lps and math.isfinite(sum(w_lps)):
            assert math.isclose(h.log_prob, sum(w_lps), rel_tol=1e-6, abs_tol=1e-7)


@settings(max_examples=60, deadline=None)
@given(
    V=st.sampled_from([4, 9, 40, 300]),
    B=st.integers(1, 3),
    n=st.integers(1, 3),
    data=st.data(),
    seed=st.integers(0, 10_000),
    topk=st.sampled_from([0, 2, 5]),
    topp=st.sampled_from([1.0, 0.9, 0.4]),
    temperature=st.sampled_from([1.0, 0.5, 2.0]),
)
def test_sampling_equals_loop(V, B, n, data, seed, topk, topp, temperature):
    max_new, min_new = draw_budgets(data, B, low=1)
    options = draw_options(data, V, B, max_new, hf=False)
    fn = shifted(masked_random_fn(V, seed, 1.5, 0.2), 1.0)
    src, lengths = sources(B)
    got = greedy_decode(
        FunctionRunner(V, fn),
        src,
        lengths,
        bos_id=BOS,
        eos_id=EOS,
        max_decoding_length=max_new,
        min_decoding_length=min_new,
        sampling_topk=topk,
        sampling_topp=topp,
        sampling_temperature=temperature,
        seed=seed,
        num_hypotheses=n,
        return_scores=True,
        **options,
    )
    rows = loop_sample(fn, B, n, max_new, min_new, options, topk, topp, temperature, seed)
    for b in range(B):
        want = rows[b * n : (b + 1) * n]
        assert sorted(tuple(h.tokens) for h in got[b]) == sorted(tuple(r["gen"]) for r in want)
        scores = [h.score for h in got[b]]
        assert scores == sorted(scores, reverse=True)  # best first
        for h in got[b]:
            match = next(r for r in want if r["gen"] == h.tokens)
            assert h.finished == match["finished"]
            np.testing.assert_allclose(h.token_log_probs, match["lps"], rtol=1e-6, atol=1e-7)


def test_sampling_is_reproducible_and_seeded():
    V = 50
    fn = masked_random_fn(V, 3, 0.3, 0.0)  # flat: many tokens have a real chance
    src, lengths = sources(4)
    kw = dict(bos_id=BOS, eos_id=EOS, max_decoding_length=12, min_decoding_length=12, sampling_topk=0)
    a = greedy_decode(FunctionRunner(V, fn), src, lengths, seed=5, **kw)
    b = greedy_decode(FunctionRunner(V, fn), src, lengths, seed=5, **kw)
    c = greedy_decode(FunctionRunner(V, fn), src, lengths, seed=6, **kw)
    assert a == b
    assert a != c
    greedy = greedy_decode(
        FunctionRunner(V, fn), src, lengths, bos_id=BOS, eos_id=EOS, max_decoding_length=12
    )
    assert a != greedy


def test_sampling_top_k_one_token_is_greedy_and_top_p_tiny_is_greedy():
    V = 40
    fn = masked_random_fn(V, 11, 1.5, 0.0)
    src, lengths = sources(3)
    kw = dict(bos_id=BOS, eos_id=EOS, max_decoding_length=8)
    greedy = greedy_decode(FunctionRunner(V, fn), src, lengths, **kw)
    # top-p keeps at least the most likely token: a tiny p is greedy whatever the draws
    tiny_p = greedy_decode(
        FunctionRunner(V, fn), src, lengths, sampling_topk=0, sampling_topp=1e-9, seed=1, **kw
    )
    assert tiny_p == greedy


def test_target_prefix_is_kept_and_scored_as_the_model_scores_it():
    V = 30
    fn = masked_random_fn(V, 4, 1.5, 0.0)
    src, lengths = sources(3)
    prefix = [[5, 6, 7], [], [9]]
    hyps = greedy_decode(
        FunctionRunner(V, fn),
        src,
        lengths,
        bos_id=BOS,
        eos_id=EOS,
        max_decoding_length=9,
        target_prefix=prefix,
        return_scores=True,
    )
    beams = beam_search(
        FunctionRunner(V, fn),
        src,
        lengths,
        bos_id=BOS,
        eos_id=EOS,
        max_decoding_length=9,
        beam_size=3,
        num_hypotheses=3,
        target_prefix=prefix,
    )
    for b in range(3):
        (h,) = hyps[b]
        assert h.tokens[: len(prefix[b])] == prefix[b]
        for bh in beams[b]:
            assert bh.tokens[: len(prefix[b])] == prefix[b]
    # forced decoding of each result gives back its log-probability (no processor changed it)
    for results in ([h[0] for h in hyps], [h[0] for h in beams]):
        scored = score(
            FunctionRunner(V, fn), src, lengths, [h.tokens for h in results], bos_id=BOS, eos_id=EOS
        )
        for h, s in zip(results, scored, strict=True):
            if h.finished:
                np.testing.assert_allclose(s.token_log_probs, h.token_log_probs, rtol=1e-6, atol=1e-7)


@settings(max_examples=40, deadline=None)
@given(
    V=st.sampled_from([4, 40, 1100]),
    B=st.integers(1, 4),
    data=st.data(),
    seed=st.integers(0, 1000),
    include_eos=st.booleans(),
)
def test_score_equals_loop(V, B, data, seed, include_eos):
    tokens = [i for i in range(V) if i != EOS]
    targets = [data.draw(st.lists(st.sampled_from(tokens), max_size=6)) for _ in range(B)]
    fn = masked_random_fn(V, seed, 1.5, 0.0)
    src, lengths = sources(B)
    runner = FunctionRunner(V, fn)
    got = score(runner, src, lengths, targets, bos_id=BOS, eos_id=EOS, include_eos=include_eos)
    want = loop_score(fn, targets, include_eos)
    for h, t, w in zip(got, targets, want, strict=True):
        assert h.tokens == t
        np.testing.assert_allclose(h.token_log_probs, w, rtol=1e-6, atol=1e-7)
        assert math.isclose(h.log_prob, sum(w), rel_tol=1e-6, abs_tol=1e-7)
    assert runner.steps == max(len(t) + include_eos for t in targets)


def test_beam_hypotheses_score_as_forced_decoding():
    V = 60
    fn = masked_random_fn(V, 8, 1.5, 0.0)
    src, lengths = sources(3)
    beams = beam_search(
        FunctionRunner(V, fn),
        src,
        lengths,
        bos_id=BOS,
        eos_id=EOS,
        beam_size=4,
        num_hypotheses=4,
        max_decoding_length=8,
    )
    for b, hyps in enumerate(beams):
        targets = [h.tokens for h in hyps]
        scored = score(
            FunctionRunner(V, lambda _row, prefix, b=b: fn(b, prefix)),  # every row is source b
            np.repeat(src[b : b + 1], len(hyps), 0),
            np.repeat(lengths[b : b + 1], len(hyps)),
            targets,
            bos_id=BOS,
            eos_id=EOS,
            include_eos=True,
        )
        for h, s in zip(hyps, scored, strict=True):
            if h.finished:
                assert math.isclose(s.log_prob, h.log_prob, rel_tol=1e-6, abs_tol=1e-7)


def test_generate_dispatches_to_the_searches():
    V = 40
    fn = masked_random_fn(V, 2, 1.5, 0.0)
    src, lengths = sources(3)
    kw = dict(bos_id=BOS, eos_id=EOS, max_decoding_length=7, banned_ids=[5], no_repeat_ngram_size=2)
    g = generate(FunctionRunner(V, fn), src, lengths, **kw)
    assert g == greedy_decode(FunctionRunner(V, fn), src, lengths, return_scores=True, **kw)
    beams = generate(FunctionRunner(V, fn), src, lengths, beam_size=3, num_hypotheses=2, **kw)
    assert beams == beam_search(FunctionRunner(V, fn), src, lengths, beam_size=3, num_hypotheses=2, **kw)
    sampled = generate(FunctionRunner(V, fn), src, lengths, sampling_topk=0, seed=3, num_hypotheses=2, **kw)
    assert [len(h) for h in sampled] == [2, 2, 2]


def test_search_methods_pass_the_options():
    class Runner(FunctionRunner, decoding.SearchMethods):
        info = types.SimpleNamespace(bos_id=BOS, eos_id=EOS)  # the special ids SearchMethods reads

    V = 40
    fn = masked_random_fn(V, 2, 1.5, 0.0)
    src, lengths = sources(2)
    r = Runner(V, fn)
    assert r.generate(src, lengths, max_decoding_length=5, target_prefix=[[3], [4]])[0][0].tokens[0] == 3
    assert r.score(src, lengths, [[3], []])[1].tokens == []


# ------------------------------------------------------------------------------------------
# argument errors
# ------------------------------------------------------------------------------------------

BAD_OPTIONS = [
    (
        dict(target_prefix=[[3, 4, 5, 6]]),
        ValueError,
        "target_prefix[0] has 4 tokens, more than the maximum length",
    ),
    (dict(target_prefix=[[3, EOS]]), ValueError, "target_prefix[0][1] is the EOS id"),
    (
        dict(target_prefix=[[3], [4]]),
        ValueError,
        "target_prefix must hold one token list per source (1), got 2",
    ),
    (dict(target_prefix=[[-1]]), ValueError, "target_prefix[0][0] = -1 is not a token id"),
    (dict(target_prefix=[[99]]), ValueError, "target_prefix[0][0] = 99"),
    (dict(target_prefix="abc"), TypeError, "target_prefix must be a list"),
    (dict(banned_ids=[EOS]), ValueError, "banned_ids holds the EOS id"),
    (dict(banned_ids=[1000]), ValueError, "banned_ids[0] = 1000"),
    (dict(banned_ids=3), TypeError, "banned_ids must be a list of token ids"),
    (dict(repetition_penalty=0.0), ValueError, "repetition_penalty must be > 0"),
    (dict(repetition_penalty=math.nan), ValueError, "repetition_penalty must be a finite number"),
    (dict(no_repeat_ngram_size=-1), ValueError, "no_repeat_ngram_size must be an int >= 0"),
    (dict(decoder_start_id=-2), ValueError, "decoder_start_id must be a token id"),
    (dict(force_eos_at_budget=1), TypeError, "force_eos_at_budget must be a bool"),
]

BAD_SAMPLING = [
    (dict(sampling_topk=0, sampling_topp=0.0), "sampling_topp must be in (0, 1]"),
    (dict(sampling_topk=0, sampling_topp=1.5), "sampling_topp must be in (0, 1]"),
    (dict(sampling_topk=-1), "sampling_topk must be an int >= 0"),
    (dict(sampling_topk=0, sampling_temperature=0), "sampling_temperature must be > 0"),
    (dict(sampling_topp=0.9), "sampling_topp apply to random sampling, which sampling_topk = 1"),
    (dict(sampling_temperature=0.7), "sampling_temperature apply to random sampling"),
    (dict(sampling_topk=0, seed=-1), "seed must be an int >= 0"),
    (dict(num_hypotheses=2), "num_hypotheses = 2 needs random sampling"),
]


@pytest.mark.parametrize("search", ["greedy", "beam"])
@pytest.mark.parametrize("kwargs, exc, fragment", BAD_OPTIONS)
def test_bad_options_are_clear_errors(search, kwargs, exc, fragment):
    src, lengths = sources(1)
    runner = FunctionRunner(30, masked_random_fn(30, 0, 1.0, 0.0))
    common = dict(bos_id=BOS, eos_id=EOS, max_decoding_length=3, **kwargs)
    with pytest.raises(exc, match="^" + re.escape(fragment)):
        if search == "greedy":
            greedy_decode(runner, src, lengths, **common)
        else:
            beam_search(runner, src, lengths, beam_size=2, **common)


@pytest.mark.parametrize("kwargs, fragment", BAD_SAMPLING)
def test_bad_sampling_options_are_clear_errors(kwargs, fragment):
    src, lengths = sources(1)
    runner = FunctionRunner(30, masked_random_fn(30, 0, 1.0, 0.0))
    with pytest.raises(ValueError, match=re.escape(fragment)):
        greedy_decode(runner, src, lengths, bos_id=BOS, eos_id=EOS, max_decoding_length=3, **kwargs)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (
            dict(beam_size=2, sampling_topk=0),
            "random sampling (sampling_topk / sampling_topp / sampling_temperature) needs beam_size = 1",
        ),
        (dict(beam_size=2, sampling_topp=0.5), "needs beam_size = 1, got beam_size = 2"),
        (dict(beam_size=2, seed=3), "seed applies to random sampling"),
        (dict(beam_size=2, early_stopping=True), "early_stopping is transformers' beam-search rule"),
        (
            dict(beam_size=2, length_penalty_type="hf", early_stopping="sometimes"),
            "early_stopping must be one of",
        ),
        (
            dict(beam_size=2, renormalize_logits=True),
            "renormalize_logits applies with length_penalty_type='hf'",
        ),
        (dict(beam_size=2, length_penalty=-1.0), "length_penalty must be a finite number >= 0"),
        (dict(beam_size=2, num_hypotheses=3), "num_hypotheses must be in [1, beam_size=2]"),
    ],
)
def test_conflicting_generate_options_are_clear_errors(kwargs, fragment):
    src, lengths = sources(1)
    runner = FunctionRunner(30, masked_random_fn(30, 0, 1.0, 0.0))
    with pytest.raises(ValueError, match=re.escape(fragment)):
        generate(runner, src, lengths, bos_id=BOS, eos_id=EOS, max_decoding_length=3, **kwargs)


def test_score_argument_errors():
    src, lengths = sources(2)
    runner = FunctionRunner(30, masked_random_fn(30, 0, 1.0, 0.0))
    with pytest.raises(ValueError, match=r"targets must hold one token list per source \(2\), got 1"):
        score(runner, src, lengths, [[3]], bos_id=BOS, eos_id=EOS)
    with pytest.raises(ValueError, match=r"targets\[1\]\[0\] = 77 is not a target token id"):
        score(runner, src, lengths, [[3], [77]], bos_id=BOS, eos_id=EOS)
    with pytest.raises(TypeError, match=r"targets\[0\]\[1\] must be a token id"):
        score(runner, src, lengths, [[3, "x"], []], bos_id=BOS, eos_id=EOS)
