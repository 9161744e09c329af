"""The vectorised beam search against the loop it replaced (``tests/beam_reference.py``), on
random runners, and its top-k helper against a full sort."""

from __future__ import annotations

import math

import numpy as np
import pytest
from beam_reference import loop_beam_search
from helpers import FunctionRunner, bad_logit_fn, draw_options, masked_random_fn, shifted, sources
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_ext import decoding
from transformer_ext.decoding import beam_search, greedy_decode


def run_both(V, fn, B, **kwargs):
    src, lengths = sources(B)
    runners = FunctionRunner(V, fn), FunctionRunner(V, fn)
    got = beam_search(runners[0], src, lengths, bos_id=1, eos_id=2, **kwargs)
    want = loop_beam_search(runners[1], src, lengths, bos_id=1, eos_id=2, **kwargs)
    return got, want, runners


def assert_same(got, want, atol=1e-9):
    """Equal hypotheses; ``atol``: 1e-6 for length_penalty="hf", whose log-probabilities are
    float32 (transformers' precision) where the loop's are float64."""
    assert len(got) == len(want)
    for g_hyps, w_hyps in zip(got, want, strict=True):
        assert [h.tokens for h in g_hyps] == [h.tokens for h in w_hyps]
        assert [h.finished for h in g_hyps] == [h.finished for h in w_hyps]
        np.testing.assert_allclose([h.score for h in g_hyps], [h.score for h in w_hyps], rtol=1e-6, atol=atol)
        np.testing.assert_allclose(
            [h.log_prob for h in g_hyps], [h.log_prob for h in w_hyps], rtol=1e-6, atol=atol
        )
        for g, w in zip(g_hyps, w_hyps, strict=True):
            np.testing.assert_allclose(g.token_log_probs, w.token_log_probs, rtol=1e-6, atol=atol)
            if math.isfinite(g.log_prob):  # -inf: no possible hypothesis (the fallback has no tokens)
                assert math.isclose(sum(g.token_log_probs), g.log_prob, rel_tol=1e-9, abs_tol=1e-9)


@settings(max_examples=60, deadline=None)
@given(
    V=st.sampled_from([3, 5, 9, 40, 600, 1100]),
    B=st.integers(1, 4),
    K=st.integers(1, 5),
    data=st.data(),
    seed=st.integers(0, 10_000),
    sharp=st.sampled_from([0.5, 1.5, 4.0]),
    p_masked=st.sampled_from([0.0, 0.3]),
    kind=st.sampled_from(decoding.LENGTH_PENALTIES),
)
def test_vectorised_beam_equals_loop_beam(V, B, K, data, seed, sharp, p_masked, kind):
    n_best = data.draw(st.integers(1, K))
    max_new = np.array(data.draw(st.lists(st.integers(0, 7), min_size=B, max_size=B)))
    min_new = np.array(data.draw(st.lists(st.integers(0, 4), min_size=B, max_size=B)))
    fn = masked_random_fn(V, seed, sharp, p_masked)
    extra = {}
    if kind == "hf":
        extra["early_stopping"] = data.draw(st.sampled_from(decoding.EARLY_STOPPING))
    got, want, runners = run_both(
        V,
        fn,
        B,
        beam_size=K,
        num_hypotheses=n_best,
        max_decoding_length=max_new,
        min_decoding_length=min_new,
        length_penalty_type=kind,
        length_penalty=0.7,
        **extra,
    )
    assert_same(got, want, atol=1e-6 if kind == "hf" else 1e-9)
    assert runners[0].steps == runners[1].steps  # the same early stops


@settings(max_examples=80, deadline=None)
@given(
    V=st.sampled_from([4, 9, 40, 1100]),
    B=st.integers(1, 3),
    K=st.integers(1, 4),
    data=st.data(),
    seed=st.integers(0, 10_000),
    p_masked=st.sampled_from([0.0, 0.3]),
    kind=st.sampled_from(["gnmt", "average", "hf"]),
)
def test_vectorised_beam_with_processors_equals_loop_beam(V, B, K, data, seed, p_masked, kind):
    n_best = data.draw(st.integers(1, K))
    max_new = np.array(data.draw(st.lists(st.integers(0, 7), min_size=B, max_size=B)))
    min_new = np.array(data.draw(st.lists(st.integers(0, 4), min_size=B, max_size=B)))
    options = draw_options(data, V, B, max_new, kind == "hf")
    fn = shifted(masked_random_fn(V, seed, 1.5, p_masked), 1.0)
    alpha = data.draw(st.sampled_from([0.7, 1.0, -0.5])) if kind == "hf" else 0.7
    got, want, runners = run_both(
        V,
        fn,
        B,
        beam_size=K,
        num_hypotheses=n_best,
        max_decoding_length=max_new,
        min_decoding_length=min_new,
        length_penalty_type=kind,
        length_penalty=alpha,
        **options,
    )
    assert_same(got, want, atol=1e-6 if kind == "hf" else 1e-9)
    assert runners[0].steps == runners[1].steps
    prefix = options["target_prefix"]
    for b, hyps in enumerate(got):
        n_forced = 0 if prefix is None else len(prefix[b])
        for h in hyps:
            if n_forced and math.isfinite(h.log_prob):
                assert h.tokens[:n_forced] == list(prefix[b])
            assert not set(h.tokens[n_forced:]) & set(options["banned_ids"])  # a prefix may hold them


@pytest.mark.parametrize("V", [100, 1000, 1024, 1025, 1087, 8000, 58101])
@pytest.mark.parametrize("k", [1, 2, 8])
def test_row_top_k_holds_the_largest_entries(V, k):
    rng = np.random.default_rng(V * 10 + k)
    x = rng.standard_normal((8, V)).astype(np.float32)
    x[1, :] = -np.inf  # a row of only -inf
    x[2, rng.random(V) < 0.9] = -np.inf
    x[3, -3:] += 10.0  # the largest entries in the tail after the last whole group
    x[4, :5] = 10.0  # ties among the largest
    groups = V // decoding._TOPK_GROUP
    x[5, 3 : groups * decoding._TOPK_GROUP : groups] += 10.0  # the largest entries all in one group
    x[6, 7::13] += 5.0  # many large entries spread over the groups
    idx, row_max = decoding._row_top_k(x, k)
    assert idx.shape == (8, k)
    np.testing.assert_array_equal(row_max, x.max(axis=1))
    for r in range(8):
        assert len(set(idx[r].tolist())) == k  # no entry twice
        want = np.sort(x[r])[::-1][:k]
        np.testing.assert_array_equal(np.sort(x[r, idx[r]])[::-1], want)


def test_row_top_k_row_max_is_nan_for_a_row_with_a_nan():
    x = np.random.default_rng(0).standard_normal((3, 8000)).astype(np.float32)
    x[1, 4321] = np.nan
    _, row_max = decoding._row_top_k(x, 8)
    assert np.isnan(row_max[1]) and np.isfinite(row_max[[0, 2]]).all()


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_or_inf_logits_are_an_error_naming_step_and_row(bad):
    V = 1100
    fn = bad_logit_fn(V, bad)
    src, lengths = sources(2)
    with pytest.raises(RuntimeError, match=r"NaN or \+inf logit at step 2 \(row 2"):
        beam_search(
            FunctionRunner(V, fn),
            src,
            lengths,
            bos_id=1,
            eos_id=2,
            beam_size=2,
            max_decoding_length=5,
            min_decoding_length=5,
        )
    with pytest.raises(RuntimeError, match=r"NaN or \+inf logit at step 2 \(row 1"):
        greedy_decode(
            FunctionRunner(V, fn),
            src,
            lengths,
            bos_id=1,
            eos_id=2,
            max_decoding_length=5,
            min_decoding_length=5,
        )
