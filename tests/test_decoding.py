"""Greedy and beam search: cached vs uncached decoding on the model, and the search itself on
hand-written numpy runners whose probabilities are known exactly."""

from __future__ import annotations

import itertools
import math
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import FunctionRunner, make_batch, make_model, sources

from transformer_ext import decoding
from transformer_ext.decoding import (
    Hypothesis,
    Runner,
    beam_search,
    check_beam_index,
    check_encode_args,
    check_sources,
    check_step_tokens,
    check_token_ids,
    greedy_decode,
    length_penalty_factor,
    log_softmax,
    max_decoding_length_for,
)
from transformer_ext.runtimes import CatCacheRunner, EagerRunner, greedy_decode_uncached

NORM_FIRST = [False, True]
RUNNERS = {"eager": EagerRunner, "catcache": CatCacheRunner}
LENGTH_PENALTIES = ["gnmt", "seed", "average", "none"]
ATOL = 1e-5


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


class Recorder:
    """Wraps a runner and keeps a copy of every step's logits (and every reorder)."""

    def __init__(self, inner):
        self.inner = inner
        self.logits: list[np.ndarray] = []
        self.reorders: list[np.ndarray] = []

    def encode(self, *args, **kwargs):
        return self.inner.encode(*args, **kwargs)

    def step(self, state, tokens):
        out = self.inner.step(state, tokens)
        self.logits.append(np.array(out, copy=True))
        return out

    def reorder(self, state, beam_index):
        self.reorders.append(np.array(beam_index, copy=True))
        self.inner.reorder(state, beam_index)


def table_fn(table: dict, V: int, default_eos: int):
    """Log-probs from ``{prefix: {token: prob}}``; unlisted prefixes emit EOS with certainty."""

    def fn(src, prefix):
        probs = table.get(prefix, {default_eos: 1.0})
        out = np.full(V, -np.inf)
        for tok, p in probs.items():
            out[tok] = math.log(p)
        return out

    return fn


def random_fn(V: int, seed: int = 0, sharp: float = 1.5):
    def fn(src, prefix):
        rng = np.random.default_rng(abs(hash((seed, src) + prefix)) % (2**32))
        return log_softmax(sharp * rng.standard_normal(V))

    return fn


# ------------------------------------------------------------------------------------------
# module hygiene
# ------------------------------------------------------------------------------------------


def test_decoding_imports_without_torch():
    code = (
        "import sys; import transformer_ext, transformer_ext.decoding, transformer_ext.config; "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_runners_implement_the_protocol():
    model = make_model(False)
    assert isinstance(EagerRunner(model), Runner)
    assert isinstance(CatCacheRunner(model), Runner)
    assert isinstance(FunctionRunner(4, None), Runner)


def test_log_softmax_is_stable():
    x = np.array([[1000.0, 1001.0, -np.inf], [-1e30, 0.0, 3.0]], dtype=np.float32)
    y = log_softmax(x)
    assert y.dtype == np.float64 and np.all(np.isfinite(y[:, :2]))
    np.testing.assert_allclose(np.exp(y).sum(-1), 1.0)
    np.testing.assert_allclose(y[0, :2], [-1.0 - math.log1p(math.exp(-1.0)), -math.log1p(math.exp(-1.0))])


def test_log_softmax_of_a_fully_masked_row_is_minus_inf():
    y = log_softmax(np.array([[-np.inf, -np.inf], [0.0, -np.inf]]))
    assert np.all(np.isneginf(y[0])) and y[1, 0] == 0.0 and np.isneginf(y[1, 1])


def test_max_new_tokens_for():
    np.testing.assert_array_equal(max_decoding_length_for([1, 10, 24], 1.5, 10), [11, 25, 46])
    np.testing.assert_array_equal(max_decoding_length_for([1, 10, 24], 1.5, 10, cap=30), [11, 25, 30])
    np.testing.assert_array_equal(max_decoding_length_for([2], 0.0, 0), [1])


@pytest.mark.parametrize("a,b", [(1e20, 0), (1e30, 10), (1.5, 1e300), (2.0**70, 0)])
def test_max_new_tokens_for_huge_finite_budget_is_capped(a, b):
    """A finite budget beyond int64 or the cap is the cap (it used to wrap around to 1)."""
    np.testing.assert_array_equal(max_decoding_length_for([1, 7], a, b, cap=64), [64, 64])
    with pytest.raises(ValueError, match="too large"):
        max_decoding_length_for([1, 7], a, b)


@pytest.mark.parametrize(
    "a,b,name",
    [
        (math.inf, 10, "a "),
        (math.nan, 10, "a "),
        (-1.0, 10, "a "),
        (1.5, math.inf, "b "),
        (1.5, math.nan, "b "),
        (1.5, -5, "b "),
    ],
)
def test_max_new_tokens_for_rejects_non_finite_or_negative(a, b, name):
    with pytest.raises(ValueError, match=f"^{name}.*finite number >= 0"):
        max_decoding_length_for([3], a, b, cap=64)


def penalty_oracle(kind: str, length: int, alpha: float) -> float:
    """The length-penalty divisors written out from their definitions (length counts the EOS)."""
    return {
        "gnmt": ((5 + length) / (5 + 1)) ** alpha,  # Wu et al. 2016
        "seed": ((5 + (length + 1)) / 5) ** alpha,  # the seed tutorial, length with BOS
        "average": length**alpha,  # fairseq: score / (tokens incl. EOS) ** lenpen
        "none": 1.0,
    }[kind]


@pytest.mark.parametrize(
    "kind,length,alpha,want",
    [
        ("gnmt", 1, 0.6, 1.0),
        ("gnmt", 7, 0.6, 2.0**0.6),
        ("gnmt", 3, 1.0, 8 / 6),
        ("seed", 4, 0.6, 2.0**0.6),
        ("seed", 1, 1.0, 7 / 5),
        ("none", 9, 0.6, 1.0),
        ("average", 4, 0.5, 2.0),
        ("average", 3, 1.0, 3.0),
        ("average", 1, 2.0, 1.0),
        ("average", 9, 0.0, 1.0),
    ],
)
def test_length_penalty_factor(kind, length, alpha, want):
    assert length_penalty_factor(length, kind, alpha) == pytest.approx(want)


# ------------------------------------------------------------------------------------------
# greedy on the model: cached == uncached
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("runner_name", list(RUNNERS))
@pytest.mark.parametrize("norm_first", NORM_FIRST)
def test_cached_greedy_equals_uncached(norm_first, runner_name):
    model = make_model(norm_first)
    src, lengths, _ = make_batch(model.config)
    n = 12
    want, want_logits = greedy_decode_uncached(
        model,
        src,
        lengths,
        bos_id=1,
        eos_id=2,
        max_decoding_length=n,
        min_decoding_length=n,
        return_logits=True,
    )
    rec = Recorder(RUNNERS[runner_name](model))
    got = greedy_decode(
        rec, src.numpy(), lengths.numpy(), bos_id=1, eos_id=2, max_decoding_length=n, min_decoding_length=n
    )
    assert got == want
    assert all(len(row) == n for row in got)
    assert len(rec.logits) == len(want_logits) == n
    for step, (a, b) in enumerate(zip(rec.logits, want_logits)):
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0, err_msg=f"step {step}")


@pytest.mark.parametrize("norm_first", NORM_FIRST)
def test_cached_greedy_stops_like_uncached(norm_first):
    """Per-row EOS and per-row budgets: an EOS id the model actually produces early."""
    model = make_model(norm_first, seed=3)
    src, lengths, _ = make_batch(model.config)
    free = greedy_decode_uncached(
        model, src, lengths, bos_id=1, eos_id=2, max_decoding_length=10, min_decoding_length=10
    )
    eos = free[0][2]  # row 0 will stop after at most 2 tokens with this EOS id
    budget = np.array([10, 10, 4])
    want = greedy_decode_uncached(model, src, lengths, bos_id=1, eos_id=eos, max_decoding_length=budget)
    got = greedy_decode(
        EagerRunner(model), src.numpy(), lengths.numpy(), bos_id=1, eos_id=eos, max_decoding_length=budget
    )
    assert got == want
    assert len(got[0]) <= 2 and eos not in got[0] and len(got[2]) <= 4


def test_runner_sees_optimizer_updates_between_decodes():
    """A decode after a (fused) Adam step uses the updated weights: the runner copies the fused
    Q/K/V per decode, it does not cache it across parameter updates (fused Adam does not bump
    version counters)."""
    model = make_model(False, seed=2)
    src, lengths, tgt = make_batch(model.config)
    runner = EagerRunner(model)
    n = 6
    greedy_decode(
        runner, src.numpy(), lengths.numpy(), bos_id=1, eos_id=2, max_decoding_length=n, min_decoding_length=n
    )
    opt = torch.optim.Adam(model.parameters(), lr=0.05, fused=True)
    model.train()
    loss = model(src, lengths, tgt).logsumexp(-1).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    model.eval()
    want, want_logits = greedy_decode_uncached(
        model,
        src,
        lengths,
        bos_id=1,
        eos_id=2,
        max_decoding_length=n,
        min_decoding_length=n,
        return_logits=True,
    )
    rec = Recorder(runner)
    got = greedy_decode(
        rec, src.numpy(), lengths.numpy(), bos_id=1, eos_id=2, max_decoding_length=n, min_decoding_length=n
    )
    assert got == want
    for step, (a, b) in enumerate(zip(rec.logits, want_logits)):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0, err_msg=f"step {step}")


def test_compiled_runner_matches_uncached_and_eager_beams():
    """EagerRunner(compile=True): decode_step through torch.compile gives the uncached tokens and
    logits (greedy), and the eager runner's beams (reordered caches, rows = batch * beams)."""
    model = make_model(True, seed=5)
    src, lengths, _ = make_batch(model.config)
    n = 8
    want, want_logits = greedy_decode_uncached(
        model,
        src,
        lengths,
        bos_id=1,
        eos_id=2,
        max_decoding_length=n,
        min_decoding_length=n,
        return_logits=True,
    )
    compiled = EagerRunner(model, compile=True)
    rec = Recorder(compiled)
    got = greedy_decode(
        rec, src.numpy(), lengths.numpy(), bos_id=1, eos_id=2, max_decoding_length=n, min_decoding_length=n
    )
    assert got == want
    for step, (a, b) in enumerate(zip(rec.logits, want_logits)):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0, err_msg=f"step {step}")
    kwargs = dict(bos_id=1, eos_id=7, beam_size=2, max_decoding_length=6, num_hypotheses=2)
    eager_beams = beam_search(EagerRunner(model), src.numpy(), lengths.numpy(), **kwargs)
    compiled_beams = beam_search(compiled, src.numpy(), lengths.numpy(), **kwargs)
    assert [[h.tokens for h in row] for row in compiled_beams] == [
        [h.tokens for h in row] for row in eager_beams
    ]
    for row_c, row_e in zip(compiled_beams, eager_beams):
        np.testing.assert_allclose([h.score for h in row_c], [h.score for h in row_e], atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------
# beam search on the model
# ------------------------------------------------------------------------------------------


def teacher_forced_log_prob(model, src_row, length, tokens, eos_id, finished):
    """Sum of log-probs of ``tokens`` (+ EOS) under the full decoder, no cache."""
    seq = [1] + list(tokens)
    with torch.no_grad():
        logits = model(src_row.view(1, -1), length.view(1), torch.tensor([seq]))[0].double()
    logp = torch.log_softmax(logits, -1)
    total = sum(float(logp[t, tok]) for t, tok in enumerate(tokens))
    if finished:
        total += float(logp[len(tokens), eos_id])
    return total


@pytest.mark.parametrize("norm_first", NORM_FIRST)
def test_beam_size_one_equals_greedy(norm_first):
    model = make_model(norm_first, seed=5)
    src, lengths, _ = make_batch(model.config)
    runner = EagerRunner(model)
    for eos in (2, 7):
        greedy = greedy_decode(
            runner, src.numpy(), lengths.numpy(), bos_id=1, eos_id=eos, max_decoding_length=9
        )
        beams = beam_search(
            runner,
            src.numpy(),
            lengths.numpy(),
            bos_id=1,
            eos_id=eos,
            beam_size=1,
            max_decoding_length=9,
            length_penalty_type="none",
        )
        assert [h[0].tokens for h in beams] == greedy


@pytest.mark.parametrize("norm_first", NORM_FIRST)
def test_beam_hypotheses_match_uncached_rescoring(norm_first):
    """Reordered caches must carry each hypothesis' own prefix: re-score every returned
    hypothesis with the full decoder (no cache) and compare log-probabilities."""
    model = make_model(norm_first, seed=7)
    src, lengths, _ = make_batch(model.config)
    rec = Recorder(EagerRunner(model))
    free = greedy_decode_uncached(
        model, src, lengths, bos_id=1, eos_id=2, max_decoding_length=6, min_decoding_length=6
    )
    eos = free[1][3]  # an id the model likes: a mix of finished and unfinished hypotheses
    results = beam_search(
        rec,
        src.numpy(),
        lengths.numpy(),
        bos_id=1,
        eos_id=eos,
        beam_size=4,
        num_hypotheses=4,
        max_decoding_length=8,
        length_penalty_type="gnmt",
        length_penalty=0.6,
    )
    assert any(not np.array_equal(r, np.arange(len(r))) for r in rec.reorders), "no reorder happened"
    for b, hyps in enumerate(results):
        assert len(hyps) == 4
        for h in hyps:
            want = teacher_forced_log_prob(model, src[b], lengths[b], h.tokens, eos, h.finished)
            assert h.log_prob == pytest.approx(want, abs=1e-4)
            n = len(h.tokens) + (1 if h.finished else 0)
            assert h.score == pytest.approx(h.log_prob / length_penalty_factor(n, "gnmt", 0.6))
            assert eos not in h.tokens
    other = beam_search(
        CatCacheRunner(model),
        src.numpy(),
        lengths.numpy(),
        bos_id=1,
        eos_id=eos,
        beam_size=4,
        num_hypotheses=4,
        max_decoding_length=8,
        length_penalty_type="gnmt",
        length_penalty=0.6,
    )
    assert [[h.tokens for h in hs] for hs in other] == [[h.tokens for h in hs] for hs in results]


# ------------------------------------------------------------------------------------------
# the search itself, on numpy runners
# ------------------------------------------------------------------------------------------

EOS, BOS, A, B_ = 2, 1, 3, 4


def test_beam_finds_better_sequence_than_greedy():
    # Greedy takes A (0.5) then EOS (0.4): p = 0.20. Beam keeps B (0.4), then EOS (0.9): p = 0.36.
    table = {(): {A: 0.5, B_: 0.4, EOS: 0.1}, (A,): {EOS: 0.4, A: 0.3, B_: 0.3}, (B_,): {EOS: 0.9, A: 0.1}}
    fn = table_fn(table, 5, EOS)
    src, lengths = sources(1)
    greedy = greedy_decode(FunctionRunner(5, fn), src, lengths, bos_id=BOS, eos_id=EOS, max_decoding_length=5)
    assert greedy == [[A]]
    (hyps,) = beam_search(
        FunctionRunner(5, fn),
        src,
        lengths,
        bos_id=BOS,
        eos_id=EOS,
        beam_size=2,
        num_hypotheses=2,
        max_decoding_length=5,
        length_penalty_type="none",
    )
    assert isinstance(hyps[0], Hypothesis)
    assert hyps[0].tokens == [B_] and hyps[0].log_prob == pytest.approx(math.log(0.36))
    assert hyps[1].tokens == [A] and hyps[1].log_prob == pytest.approx(math.log(0.20))
    assert hyps[0].finished and hyps[0].score > hyps[1].score


def brute_force(fn, V, eos, max_new, kind, alpha, src=0, min_new=0):
    """Every hypothesis up to max_new tokens with its score, best first: ``(score, tokens,
    finished, log_prob)``.

    Before ``min_new`` tokens, EOS is impossible and the other tokens' probabilities are
    renormalised over the vocabulary without it: ``p(tok) / (1 - p(EOS))``, computed here from
    the probabilities in float64 (CTranslate2's ``min_decoding_length`` semantics)."""

    def logp(prefix, tok):
        p = np.exp(np.asarray(fn(src, prefix), dtype=np.float64))
        p = p / p.sum()
        if p[tok] == 0 or (tok == eos and len(prefix) < min_new):
            return -math.inf
        if len(prefix) < min_new:
            return math.log(p[tok]) - math.log(1.0 - p[eos])
        return math.log(p[tok])

    hyps = []
    non_eos = [t for t in range(V) if t != eos]
    for n in range(min_new, max_new):
        for prefix in itertools.product(non_eos, repeat=n):
            lp = sum(logp(prefix[:i], prefix[i]) for i in range(n)) + logp(prefix, eos)
            hyps.append((lp / penalty_oracle(kind, n + 1, alpha), list(prefix), True, lp))
    for prefix in itertools.product(non_eos, repeat=max_new):
        lp = sum(logp(prefix[:i], prefix[i]) for i in range(max_new))
        hyps.append((lp / penalty_oracle(kind, max_new, alpha), list(prefix), False, lp))
    hyps.sort(key=lambda h: -h[0])
    return hyps


@pytest.mark.parametrize("kind", LENGTH_PENALTIES)
def test_exhaustive_beam_equals_brute_force(kind):
    """With a beam wide enough to keep every candidate, the n-best list is the exact one."""
    V, eos, max_new = 4, 0, 4
    fn = random_fn(V, seed=11, sharp=1.0)
    src, lengths = sources(2)
    (got0, got1) = beam_search(
        FunctionRunner(V, fn),
        src,
        lengths,
        bos_id=3,
        eos_id=eos,
        beam_size=V**max_new,
        num_hypotheses=10,
        max_decoding_length=max_new,
        length_penalty_type=kind,
        length_penalty=0.8,
    )
    for b, got in enumerate((got0, got1)):
        want = brute_force(fn, V, eos, max_new, kind, 0.8, src=b)[:10]
        assert [h.tokens for h in got] == [w[1] for w in want]
        np.testing.assert_allclose([h.score for h in got], [w[0] for w in want], rtol=1e-6)
        assert [h.finished for h in got] == [w[2] for w in want]


@pytest.mark.parametrize("kind", LENGTH_PENALTIES)
def test_exhaustive_beam_with_min_new_tokens_equals_renormalised_brute_force(kind):
    """EOS suppressed before min_new_tokens: masked before the softmax, so every other token's
    probability is renormalised; scores and n-best order equal the brute-force enumeration."""
    V, eos, max_new, min_new = 4, 0, 4, 2
    fn = random_fn(V, seed=5, sharp=1.0)
    src, lengths = sources(2)
    results = beam_search(
        FunctionRunner(V, fn),
        src,
        lengths,
        bos_id=3,
        eos_id=eos,
        beam_size=V**max_new,
        num_hypotheses=8,
        max_decoding_length=max_new,
        min_decoding_length=min_new,
        length_penalty_type=kind,
        length_penalty=0.8,
    )
    for b, got in enumerate(results):
        want = brute_force(fn, V, eos, max_new, kind, 0.8, src=b, min_new=min_new)[:8]
        assert [h.tokens for h in got] == [w[1] for w in want]
        np.testing.assert_allclose([h.score for h in got], [w[0] for w in want], rtol=1e-5)
        np.testing.assert_allclose([h.log_prob for h in got], [w[3] for w in want], rtol=1e-5)
        assert all(len(h.tokens) >= min_new for h in got)


def test_min_new_tokens_renormalises_instead_of_dropping_eos_mass():
    """A case where the two rules disagree. min_new_tokens = 2: at step 0 EOS has half the mass;
    after A, EOS would take 0.9 but is forbidden. Renormalised: A A = 0.52 * 1.0 beats
    B A = 0.48 * 0.5. Masking EOS after the softmax (the old rule) scored A A = 0.26 * 0.1 and
    B A = 0.24 * 0.5, and ranked B A first."""
    table = {
        (): {EOS: 0.5, A: 0.26, B_: 0.24},
        (A,): {EOS: 0.9, A: 0.1},
        (B_,): {A: 0.5, B_: 0.5},
    }
    fn = table_fn(table, 5, EOS)
    src, lengths = sources(1)
    want = brute_force(fn, 5, EOS, 4, "none", 0.0, min_new=2)
    assert want[0][1] == [A, A] and want[0][3] == pytest.approx(math.log(0.52))
    for beam_size in (2, 3):
        (hyps,) = beam_search(
            FunctionRunner(5, fn),
            src,
            lengths,
            bos_id=BOS,
            eos_id=EOS,
            beam_size=beam_size,
            num_hypotheses=2,
            max_decoding_length=4,
            min_decoding_length=2,
            length_penalty_type="none",
        )
        assert [h.tokens for h in hyps] == [w[1] for w in want[:2]]
        np.testing.assert_allclose([h.log_prob for h in hyps], [w[3] for w in want[:2]], rtol=1e-6)
        assert hyps[0].tokens == [A, A] and hyps[0].log_prob == pytest.approx(math.log(0.52), rel=1e-6)


def test_average_length_penalty_changes_the_winner():
    """score / length ** alpha (fairseq's, EOS counted): with alpha = 1 the longer hypothesis with
    the better average log-probability wins, the shorter one with the better total does not.
    [] + EOS: log 0.55 = -0.598 over 1 token; [A, A] + EOS: log(0.45 * 0.9 * 0.9) = -1.009
    over 3 tokens = -0.336 on average."""
    table = {(): {EOS: 0.55, A: 0.45}, (A,): {A: 0.9, EOS: 0.1}, (A, A): {EOS: 0.9, A: 0.1}}
    fn = table_fn(table, 5, EOS)
    src, lengths = sources(1)
    runs = {
        kind: beam_search(
            FunctionRunner(5, fn),
            src,
            lengths,
            bos_id=BOS,
            eos_id=EOS,
            beam_size=3,
            num_hypotheses=2,
            max_decoding_length=5,
            length_penalty_type=kind,
            length_penalty=1.0,
        )[0]
        for kind in ("none", "average")
    }
    short_lp, long_lp = math.log(0.55), math.log(0.45 * 0.9 * 0.9)
    assert runs["none"][0].tokens == [] and runs["none"][0].score == pytest.approx(short_lp)
    assert runs["average"][0].tokens == [A, A] and runs["average"][0].score == pytest.approx(long_lp / 3)
    assert runs["average"][1].tokens == [] and runs["average"][1].score == pytest.approx(short_lp / 1)


@pytest.mark.parametrize("kind", LENGTH_PENALTIES)
def test_n_best_sorted_and_scored(kind):
    V = 7
    fn = random_fn(V, seed=2)
    src, lengths = sources(3)
    results = beam_search(
        FunctionRunner(V, fn),
        src,
        lengths,
        bos_id=1,
        eos_id=2,
        beam_size=5,
        num_hypotheses=3,
        max_decoding_length=6,
        length_penalty_type=kind,
        length_penalty=0.6,
    )
    for b, hyps in enumerate(results):
        assert len(hyps) == 3
        scores = [h.score for h in hyps]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(h.tokens) for h in hyps}) == 3
        for h in hyps:
            prefix = tuple(h.tokens)
            lp = sum(fn(b, prefix[:i])[prefix[i]] for i in range(len(prefix)))
            if h.finished:
                lp += fn(b, prefix)[2]
            assert h.log_prob == pytest.approx(lp, abs=1e-5)  # float32 logits
            assert h.score == pytest.approx(h.log_prob / penalty_oracle(kind, len(prefix) + h.finished, 0.6))


def test_beam_early_stop_when_no_open_beam_can_win():
    fn = table_fn({(): {EOS: 0.99, A: 0.005, B_: 0.005}}, 5, EOS)
    runner = FunctionRunner(5, lambda s, p: fn(s, p) if p == () else log_softmax(np.zeros(5)))
    src, lengths = sources(2)
    (h0, h1) = beam_search(runner, src, lengths, bos_id=BOS, eos_id=EOS, beam_size=2, max_decoding_length=10)
    assert runner.steps == 1
    assert h0[0].tokens == [] and h0[0].log_prob == pytest.approx(math.log(0.99))


def test_beam_keeps_searching_while_a_longer_hypothesis_can_win():
    """With a strong length penalty a longer hypothesis can overtake a finished short one: the
    stop rule must bound open beams at their maximum length, not their current one."""

    def fn(src, prefix):
        if prefix == ():
            return np.log([1e-9, 1e-9, 0.5, 0.5 - 2e-9, 1e-9])  # EOS or A
        p_eos = 0.99 if len(prefix) >= 5 else 0.01
        return np.log([1e-9, 1e-9, p_eos, 1 - p_eos - 3e-9, 1e-9])

    src, lengths = sources(1)
    (hyps,) = beam_search(
        FunctionRunner(5, fn),
        src,
        lengths,
        bos_id=BOS,
        eos_id=EOS,
        beam_size=2,
        max_decoding_length=10,
        length_penalty_type="gnmt",
        length_penalty=2.0,
    )
    assert hyps[0].tokens == [A] * 5 and hyps[0].finished
    assert hyps[0].score == pytest.approx(hyps[0].log_prob / (11 / 6) ** 2)


def test_beam_runs_to_budget_without_eos():
    """Beams that never finish are returned unfinished at max_new_tokens (per-source budgets)."""
    V = 6
    fn = lambda s, p: np.log(np.array([0.01, 0.01, 1e-9, 0.5, 0.3, 0.18 - 1e-9]))  # noqa: E731
    src, lengths = sources(2)
    runner = FunctionRunner(V, fn)
    h = beam_search(
        runner,
        src,
        lengths,
        bos_id=1,
        eos_id=2,
        beam_size=3,
        num_hypotheses=2,
        max_decoding_length=np.array([3, 5]),
        length_penalty_type="none",
    )
    assert [x.tokens for x in h[0]] == [[3, 3, 3], [3, 3, 4]] and not h[0][0].finished
    assert h[1][0].tokens == [3] * 5
    assert runner.steps == 5


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_min_new_tokens_suppresses_eos(search):
    fn = lambda s, p: np.log(np.array([0.05, 0.05, 0.6, 0.2, 0.1]))  # noqa: E731  EOS most likely
    src, lengths = sources(2)
    if search == "greedy":
        out = greedy_decode(
            FunctionRunner(5, fn),
            src,
            lengths,
            bos_id=1,
            eos_id=2,
            max_decoding_length=8,
            min_decoding_length=np.array([3, 0]),
        )
        assert out == [[3, 3, 3], []]
    else:
        out = beam_search(
            FunctionRunner(5, fn),
            src,
            lengths,
            bos_id=1,
            eos_id=2,
            beam_size=2,
            max_decoding_length=8,
            min_decoding_length=3,
            length_penalty_type="none",
        )
        assert [h[0].tokens for h in out] == [[3, 3, 3], [3, 3, 3]]


def test_greedy_per_row_budgets_and_early_exit():
    fn = lambda s, p: np.log(np.array([0.1, 0.1, 0.3 if len(p) >= 2 * s + 1 else 0.0 + 1e-12, 0.5, 0.1]))  # noqa: E731
    src, lengths = sources(3)
    runner = FunctionRunner(5, fn)
    out = greedy_decode(runner, src, lengths, bos_id=1, eos_id=2, max_decoding_length=[4, 2, 9])
    assert out == [[3, 3, 3, 3], [3, 3], [3] * 9]
    runner = FunctionRunner(5, lambda s, p: np.log(np.array([0.1, 0.1, 0.6, 0.1, 0.1])))
    out = greedy_decode(runner, src, lengths, bos_id=1, eos_id=2, max_decoding_length=50)
    assert out == [[], [], []] and runner.steps == 1


def test_zero_budget():
    src, lengths = sources(2)
    runner = FunctionRunner(5, None)
    assert greedy_decode(runner, src, lengths, bos_id=1, eos_id=2, max_decoding_length=0) == [[], []]
    h = beam_search(runner, src, lengths, bos_id=1, eos_id=2, beam_size=2, max_decoding_length=0)
    assert [x[0].tokens for x in h] == [[], []] and runner.steps == 0


@pytest.mark.parametrize(
    "kwargs,exc,fragment",
    [
        (dict(beam_size=0), ValueError, "beam_size"),
        (dict(num_hypotheses=3), ValueError, "num_hypotheses"),
        (dict(length_penalty_type="wu"), ValueError, "length_penalty"),
        (dict(cache_len=3), ValueError, "cache_len = 3 is too small"),
        (dict(max_decoding_length=[4, 4, 4]), ValueError, "max_decoding_length"),
        (dict(max_decoding_length=-1), ValueError, "max_decoding_length must be >= 0"),
    ],
)
def test_beam_search_argument_errors(kwargs, exc, fragment):
    src, lengths = sources(2)
    args = {**dict(bos_id=1, eos_id=2, beam_size=2, max_decoding_length=4), **kwargs}
    with pytest.raises(exc, match=fragment):
        beam_search(FunctionRunner(5, random_fn(5)), src, lengths, **args)


def test_source_argument_errors():
    runner = FunctionRunner(5, random_fn(5))
    with pytest.raises(ValueError, match="src_lengths must be in"):
        greedy_decode(
            runner, np.ones((2, 3), np.int64), np.array([3, 0]), bos_id=1, eos_id=2, max_decoding_length=2
        )
    with pytest.raises(ValueError, match="src_lengths must have shape"):
        greedy_decode(
            runner, np.ones((2, 3), np.int64), np.array([3]), bos_id=1, eos_id=2, max_decoding_length=2
        )
    with pytest.raises(ValueError, match="input_ids must be a non-empty"):
        greedy_decode(
            runner, np.ones((3,), np.int64), np.array([3]), bos_id=1, eos_id=2, max_decoding_length=2
        )


# ------------------------------------------------------------------------------------------
# runner errors
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("runner_name", list(RUNNERS))
def test_runner_capacity_errors(runner_name):
    model = make_model(False)
    runner = RUNNERS[runner_name](model)
    src, lengths, _ = make_batch(model.config)
    with pytest.raises(ValueError, match="exceeds the model's max_len = 64"):
        runner.encode(src.numpy(), lengths.numpy(), 65)
    state = runner.encode(src.numpy(), lengths.numpy(), 2)
    tokens = np.ones(3, dtype=np.int64)
    runner.step(state, tokens)
    runner.step(state, tokens)
    with pytest.raises(IndexError, match="cache holds 2 positions"):
        runner.step(state, tokens)
    with pytest.raises(ValueError, match=r"input_ids\[0, 0\] = 99 \(row 0\) is not a source token id"):
        runner.encode(np.full((1, 2), 99), np.array([2]), 4)


@pytest.mark.parametrize("runner_name", list(RUNNERS))
def test_runner_token_checks_name_row_and_value(runner_name):
    """One shared check (decoding.check_step_tokens / check_token_ids): an id outside the
    vocabulary is a ValueError naming its row and value, before anything is fed or written."""
    model = make_model(False)
    runner = RUNNERS[runner_name](model)
    src, lengths, _ = make_batch(model.config)
    V = model.config.tgt_vocab_size
    state = runner.encode(src.numpy(), lengths.numpy(), 4)
    for bad, row in ((-1, 1), (V, 2)):
        tokens = np.ones(3, np.int64)
        tokens[row] = bad
        with pytest.raises(
            ValueError,
            match=rf"tokens\[{row}\] = {bad} \(row {row}\) is not a target token id: "
            rf"the target vocabulary has ids 0 \.\. {V - 1}",
        ):
            runner.step(state, tokens)
    assert state.position == 0
    assert np.isfinite(runner.step(state, np.ones(3, np.int64))).all()  # the state is still usable
    ids = src.numpy().copy()
    ids[0, 1] = model.config.src_vocab_size
    ids[2, 0] = -3
    with pytest.raises(
        ValueError,
        match=r"input_ids\[0, 1\] = \d+ \(row 0\) is not a source token id.*"
        r"\(1 more ids out of range\)",
    ):
        runner.encode(ids, lengths.numpy(), 4)


@pytest.mark.parametrize("runner_name", list(RUNNERS))
def test_runner_reorder_reports_the_callers_row_and_value(runner_name):
    """EagerRunner reorders a buffer stacked over layers; a bad beam_index is reported in the
    caller's terms (row 4, value 6), never as an index into that buffer (nor applied to it)."""
    model = make_model(False)
    runner = RUNNERS[runner_name](model)
    src, lengths, _ = make_batch(model.config)
    state = runner.encode(src.numpy(), lengths.numpy(), 4, 2)  # N = 6 rows
    runner.step(state, np.ones(6, np.int64))
    with pytest.raises(
        IndexError, match=r"^beam_index\[4\] = 6 is not a row of the decoding state: rows are 0 \.\. 5$"
    ):
        runner.reorder(state, np.array([0, 1, 2, 3, 6, 5]))
    with pytest.raises(IndexError, match=r"beam_index\[0\] = -1 .*\(1 more out of range\)"):
        runner.reorder(state, np.array([-1, 1, 2, 3, 4, 9]))


def test_shared_id_checks():
    assert check_token_ids("x", np.array([[0, 4]]), 5).dtype == np.int64
    with pytest.raises(TypeError, match="x must hold integers"):
        check_token_ids("x", np.array([0.5]), 5)
    with pytest.raises(ValueError, match=r"^tokens\[0\] = -1 \(row 0\)"):
        check_step_tokens(0, 4, 64, np.array([-1, 2]), 2, vocab_size=5)
    check_step_tokens(0, 4, 64, np.array([-1, 2]), 2)  # no vocabulary given: the range is not checked
    with pytest.raises(IndexError, match=r"beam_index\[1\] = 2 "):
        check_beam_index([0, 2], 2)


def test_shared_source_and_encode_checks():
    """check_sources / check_encode_args: the one copy every runner (and both searches) call."""
    ids, lengths = check_sources(np.array([[3, 4, 0]], np.int32), [2])
    assert ids.dtype == lengths.dtype == np.int64 and ids.flags.c_contiguous and lengths.tolist() == [2]
    assert decoding._check_sources is check_sources  # the name the Triton translator's vendored copy calls
    with pytest.raises(ValueError, match=r"^input_ids\[0, 1\] = 4 \(row 0\) is not a source token id"):
        check_sources(np.array([[3, 4]]), np.array([2]), src_vocab_size=4)
    with pytest.raises(ValueError, match=r"^source length 3 exceeds the model's max_len = 2$"):
        check_sources(np.ones((1, 3), np.int64), np.array([3]), max_src_len=2)
    with pytest.raises(ValueError, match=r"^src_lengths must have shape \(1,\), got \(\)$"):
        check_sources(np.ones((1, 3), np.int64), None)
    assert check_encode_args(np.ones((2, 3), np.int64), np.array([3, 1]), np.int64(5), 2, max_positions=5)[
        2:
    ] == (5, 2)
    for cache_len, beam_size, fragment in (
        (True, 1, "cache_len must be a positive int, got True"),
        (6, 1, "cache_len = 6 exceeds the model's max_len = 5"),
        (5, -1, "beam_size must be a positive int, got -1"),
    ):
        with pytest.raises(ValueError, match=fragment):
            check_encode_args(
                np.ones((2, 3), np.int64), np.array([3, 1]), cache_len, beam_size, max_positions=5
            )


def _nan_at(src_row: int, step: int, V: int = 6):
    """Log-probabilities that favour token 3 (never EOS), NaN for source ``src_row`` at ``step``."""

    def fn(src, prefix):
        out = np.log(np.full(V, 0.5 / (V - 1)))
        out[3] = np.log(0.5)
        if src == src_row and len(prefix) == step:
            out[4] = np.nan
        return out

    return fn


@pytest.mark.parametrize("remove_finished", [True, False])
@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_a_nan_logit_names_the_searchs_row_after_rows_left(search, remove_finished):
    """Source 0 stops after one token, so its rows leave the state (remove_finished); a NaN of
    source 2 at step 3 is still named by the search's row (2 greedy, 4 = 2 * beam_size with
    two beams), not by its row in the smaller state."""
    src, lengths = sources(3)
    runner = FunctionRunner(6, _nan_at(2, 3))
    kw = dict(bos_id=1, eos_id=2, max_decoding_length=np.array([1, 6, 6]), remove_finished=remove_finished)
    row = 2
    with pytest.raises(RuntimeError, match=r"NaN or \+inf logit at step 3 \(row \d+") as err:
        if search == "greedy":
            greedy_decode(runner, src, lengths, **kw)
        else:
            row = 4
            beam_search(runner, src, lengths, beam_size=2, **kw)
    assert re.search(rf"\(row {row}\b", str(err.value)), str(err.value)


class _SelectSpy(FunctionRunner):
    """A FunctionRunner that records how many rows each ``select`` keeps."""

    def __init__(self, vocab_size, fn):
        super().__init__(vocab_size, fn)
        self.kept: list[int] = []

    def select(self, state, index):
        super().select(state, index)
        self.kept.append(len(index))


def _no_eos(src, prefix):
    out = np.full(6, -5.0)
    out[3 + (src + len(prefix)) % 3] = -0.1  # never EOS (2): each row runs to its budget
    return out


@pytest.mark.parametrize(("divisor", "kept"), [(4, [6, 4, 3, 2, 1]), (1_000_000, [7, 6, 5, 4, 3, 2, 1])])
def test_greedy_drops_finished_rows_once_they_are_a_quarter(monkeypatch, divisor, kept):
    """Eight rows whose budgets are 1..8 finish one per step. With the default divisor 4 the
    finished rows leave once they are at least a quarter of the rows held (2 of 8, 2 of 6, then
    1 of 4 or fewer); with a divisor above the batch size at every finish. The tokens are those
    of a search that keeps every row."""
    monkeypatch.setattr(decoding, "GREEDY_DROP_DIVISOR", divisor)
    src, lengths = sources(8)
    kw = dict(bos_id=1, eos_id=2, max_decoding_length=np.arange(1, 9))
    spy = _SelectSpy(6, _no_eos)
    got = greedy_decode(spy, src, lengths, **kw)
    want = greedy_decode(FunctionRunner(6, _no_eos), src, lengths, remove_finished=False, **kw)
    assert spy.kept == kept
    assert got == want
    assert [len(t) for t in got] == list(range(1, 9))


def test_greedy_drop_divisor_default():
    assert decoding.GREEDY_DROP_DIVISOR == 4
