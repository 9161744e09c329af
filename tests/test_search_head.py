"""The search head (transformer_ext/runtimes/search_head.py): its hand-encoded ONNX bytes against
the model ``onnx.helper`` builds, its outputs against a float64 torch softmax, and the beam search
that reads it (``runner.step_top_k``) against the loop reference search (tests/beam_reference.py)."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
import torch
from beam_reference import loop_beam_search
from helpers import (
    FunctionRunner,
    bad_logit_fn,
    draw_options,
    exported_dir,
    masked_random_fn,
    shifted,
    sources,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from transformer_ext import decoding
from transformer_ext.runtimes import OrtRunner
from transformer_ext.runtimes.search_head import IR_VERSION, OPSET, SearchHead, search_head_model

# ------------------------------------------------------------------------------------------
# the graph
# ------------------------------------------------------------------------------------------


def helper_model() -> onnx.ModelProto:
    """The search head as the module docstring describes it, built by onnx.helper."""
    nodes = [
        helper.make_node("LogSoftmax", ["logits"], ["log_probs"], name="log_probs", axis=-1),
        helper.make_node(
            "TopK",
            ["log_probs", "k"],
            ["top_log_probs", "top_ids"],
            name="top_log_probs",
            axis=-1,
            largest=1,
            sorted=1,
        ),
        helper.make_node(
            "GatherElements", ["log_probs", "columns"], ["column_log_probs"], name="column_log_probs", axis=1
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "search_head",
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["rows", "vocab"]),
            helper.make_tensor_value_info("k", TensorProto.INT64, [1]),
            helper.make_tensor_value_info("columns", TensorProto.INT64, ["rows", "columns"]),
        ],
        [
            helper.make_tensor_value_info("top_log_probs", TensorProto.FLOAT, ["rows", "k"]),
            helper.make_tensor_value_info("top_ids", TensorProto.INT64, ["rows", "k"]),
            helper.make_tensor_value_info("column_log_probs", TensorProto.FLOAT, ["rows", "columns"]),
        ],
    )
    model = helper.make_model(
        graph, producer_name="transformer_ext", opset_imports=[helper.make_opsetid("", OPSET)]
    )
    model.ir_version = IR_VERSION
    return model


def test_model_bytes_are_the_model_onnx_helper_builds():
    ours = onnx.load_from_string(search_head_model())
    onnx.checker.check_model(ours, full_check=True)
    assert ours == helper_model()  # every field, as the protobuf library parses them
    assert search_head_model() == helper_model().SerializeToString()  # and byte for byte


def reference(logits: np.ndarray, k: int, columns: np.ndarray):
    lp = torch.log_softmax(torch.from_numpy(logits).double(), dim=-1)
    top = torch.topk(lp, k, dim=-1)
    return top.values.numpy(), top.indices.numpy(), torch.gather(lp, 1, torch.from_numpy(columns)).numpy()


@pytest.mark.parametrize("shape,k", [((1, 7), 7), ((5, 1100), 9), ((64, 8000), 8), ((3, 58101), 12)])
def test_outputs_match_a_float64_softmax(shape, k):
    rng = np.random.default_rng(shape[1])
    logits = (4 * rng.standard_normal(shape)).astype(np.float32)
    logits[0, rng.random(shape[1]) < 0.3] = -np.inf  # masked entries (never all: one kept)
    logits[0, 0] = 1.0
    columns = rng.integers(0, shape[1], (shape[0], 3))
    top, ids, picked = SearchHead()(logits, k, columns)
    want_top, want_ids, want_picked = reference(logits, k, columns)
    assert top.dtype == np.float32 and ids.dtype == np.int64 and picked.dtype == np.float32
    ranked = np.isfinite(want_top)  # random floats: no ties but among the -inf entries
    np.testing.assert_array_equal(ids[ranked], want_ids[ranked])
    # ONNX Runtime sums the exponentials in float32: an error of up to about 1e-5 in a row's
    # normaliser at a vocabulary of 58,101 (as torch's and CTranslate2's float32 softmax)
    atol = 2e-6 if shape[1] < 10_000 else 3e-5
    np.testing.assert_allclose(top, want_top, rtol=1e-6, atol=atol)
    finite = np.isfinite(want_picked)
    np.testing.assert_allclose(picked[finite], want_picked[finite], rtol=1e-6, atol=atol)
    assert np.isneginf(picked[~finite]).all()


@pytest.mark.parametrize("bad", ["nan", "inf", "all_neg_inf"])
def test_a_row_without_log_probabilities_is_nan_first(bad):
    """The search's fallback rests on this: a row with a NaN or +inf logit (or only -inf) has a
    NaN best value, wherever the bad entry is."""
    V = 5000
    logits = np.random.default_rng(0).standard_normal((4, V)).astype(np.float32)
    for row, col in ((1, 0), (2, V - 1), (3, 2345)):
        if bad == "all_neg_inf":
            logits[row] = -np.inf
        else:
            logits[row, col] = np.nan if bad == "nan" else np.inf
    top, _, _ = SearchHead()(logits, 8, np.zeros((4, 1), dtype=np.int64))
    assert np.isfinite(top[0]).all()
    assert np.isnan(top[1:, 0]).all()


# ------------------------------------------------------------------------------------------
# the beam search through step_top_k
# ------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def every_step_through_the_head(monkeypatch):
    """The searches take the head at any size here (by default only where it pays,
    ``decoding.HEAD_MIN_ENTRIES``; test_thresholds checks those)."""
    monkeypatch.setitem(decoding.HEAD_MIN_ENTRIES, "beam", 0)
    monkeypatch.setitem(decoding.HEAD_MIN_ENTRIES, "greedy_scores", 0)


class HeadRunner(FunctionRunner):
    """FunctionRunner with ``step_top_k``: the search head over the logits of ``step``."""

    def __init__(self, vocab_size, fn):
        super().__init__(vocab_size, fn)
        self.head = SearchHead()
        self.head_steps = 0

    def step_top_k(self, state, tokens, k, columns):
        self.head_steps += 1
        logits = self.step(state, tokens)
        assert columns.dtype == np.int64 and columns.shape[0] == len(tokens)
        return (*self.head(logits, min(k, self.V), columns), logits)


def run_both(V, fn, B, **kwargs):
    src, lengths = sources(B)
    head, loop = HeadRunner(V, fn), FunctionRunner(V, fn)
    got = decoding.beam_search(head, src, lengths, bos_id=1, eos_id=2, **kwargs)
    want = loop_beam_search(loop, src, lengths, bos_id=1, eos_id=2, **kwargs)
    return got, want, head, loop


def assert_close(got, want):
    """Equal tokens; scores to float32 precision (the head's log-probabilities are float32)."""
    for g_hyps, w_hyps in zip(got, want, strict=True):
        assert [h.tokens for h in g_hyps] == [h.tokens for h in w_hyps]
        assert [h.finished for h in g_hyps] == [h.finished for h in w_hyps]
        np.testing.assert_allclose([h.score for h in g_hyps], [h.score for h in w_hyps], rtol=1e-5, atol=2e-5)
        for g, w in zip(g_hyps, w_hyps, strict=True):
            np.testing.assert_allclose(g.token_log_probs, w.token_log_probs, rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(
    V=st.sampled_from([9, 600, 1100]),
    B=st.integers(1, 3),
    K=st.integers(1, 4),
    data=st.data(),
    seed=st.integers(0, 10_000),
    p_masked=st.sampled_from([0.0, 0.3]),
    kind=st.sampled_from(["gnmt", "none", "hf"]),
    mask_only=st.booleans(),
)
def test_head_beam_equals_loop_beam(V, B, K, data, seed, p_masked, kind, mask_only):
    n_best = data.draw(st.integers(1, K))
    max_new = np.array(data.draw(st.lists(st.integers(0, 7), min_size=B, max_size=B)))
    min_new = np.array(data.draw(st.lists(st.integers(0, 4), min_size=B, max_size=B)))
    options = draw_options(data, V, B, max_new, kind == "hf")
    if mask_only:  # only processors the head serves (the others run the search on the host)
        options.update(repetition_penalty=1.0, no_repeat_ngram_size=0, renormalize_logits=False)
        if kind != "hf":
            del options["renormalize_logits"]
    fn = shifted(masked_random_fn(V, seed, 1.5, p_masked), 1.0)
    got, want, head, loop = run_both(
        V, fn, B, beam_size=K, num_hypotheses=n_best, max_decoding_length=max_new, min_decoding_length=min_new,
        length_penalty_type=kind, length_penalty=0.7, **options,
    )  # fmt: skip
    assert_close(got, want)
    assert head.steps == loop.steps
    if mask_only and V > 9 and max_new.max() > 1:
        assert head.head_steps == head.steps - 1  # all but the first step (which learns V)


def peaked_fn(V: int, seed: int, hot: tuple[int, ...]):
    """Logits where the tokens ``hot`` hold most of the probability (+8 over the rest)."""

    def fn(src, prefix):
        rng = np.random.default_rng(abs(hash((seed, src) + prefix)) % (2**32))
        logits = rng.standard_normal(V)
        logits[list(hot)] += 8.0
        return logits

    return fn


@pytest.mark.parametrize("kind", ["gnmt", "hf"])
@pytest.mark.parametrize("hot", [(2,), (7,), (2, 7)])
def test_rows_whose_masked_tokens_hold_most_probability(kind, hot, monkeypatch):
    """EOS (2, masked below the minimum length) and a banned id (7) with nearly all the
    probability: those rows are computed on the host (not ``-log(1 - q)``, q near 1)."""
    exact_rows = []
    host_log_probs = decoding._BeamState.log_probs

    def spy(self, procs, x, t, rows=None):
        if rows is not None:
            exact_rows.append(rows.size)
        return host_log_probs(self, procs, x, t, rows)

    monkeypatch.setattr(decoding._BeamState, "log_probs", spy)
    got, want, head, _ = run_both(
        600,
        peaked_fn(600, 3, hot),
        3,
        beam_size=3,
        num_hypotheses=2,
        max_decoding_length=6,
        min_decoding_length=6,
        banned_ids=[7],
        length_penalty_type=kind,
    )
    assert_close(got, want)
    assert head.head_steps == 5
    if kind != "hf":  # hf masks after the softmax: nothing to renormalise
        assert exact_rows and sum(exact_rows) > 0
    else:
        assert not exact_rows


@pytest.mark.parametrize(
    "mode,V,batch,through_head",
    [
        ("beam", 8000, 1, False),
        ("beam", 8192, 1, True),
        ("greedy", 58101, 2, False),
        ("greedy", 58101, 3, True),
    ],
)
def test_thresholds(monkeypatch, mode, V, batch, through_head):
    """At the default HEAD_MIN_ENTRIES: beam search from 2**15 rows x V (4 rows of 8,192, not
    of 8,000), greedy with scores from 2**17 (3 rows of 58,101 but not 2)."""
    monkeypatch.undo()  # the module's own thresholds, not the fixture's zeros
    runner = HeadRunner(V, masked_random_fn(V, 0, 1.5, 0.0))
    src, lengths = sources(batch)
    kwargs = dict(bos_id=1, eos_id=2, max_decoding_length=3, min_decoding_length=3)
    if mode == "beam":
        decoding.beam_search(runner, src, lengths, beam_size=4, **kwargs)
    else:
        decoding.greedy_decode(runner, src, lengths, return_scores=True, **kwargs)
    assert runner.head_steps == (2 if through_head else 0)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_or_inf_logit_is_an_error_naming_step_and_row(bad):
    V = 1100
    src, lengths = sources(2)
    runner = HeadRunner(V, bad_logit_fn(V, bad))
    with pytest.raises(RuntimeError, match=r"NaN or \+inf logit at step 2 \(row 2"):
        decoding.beam_search(
            runner,
            src,
            lengths,
            bos_id=1,
            eos_id=2,
            beam_size=2,
            max_decoding_length=5,
            min_decoding_length=5,
        )
    assert runner.head_steps == 2  # steps 1 and 2 ran through the head


@settings(max_examples=60, deadline=None)
@given(
    V=st.sampled_from([9, 600, 1100]),
    B=st.integers(1, 4),
    data=st.data(),
    seed=st.integers(0, 10_000),
    p_masked=st.sampled_from([0.0, 0.3]),
    mask_only=st.booleans(),
    hot=st.sampled_from([(), (2,), (2, 5)]),
)
def test_head_greedy_equals_host_greedy(V, B, data, seed, p_masked, mask_only, hot):
    """Greedy search through ``step_top_k`` against the same search on the host (a runner
    without it): the same tokens, log-probabilities to float32 precision. ``hot``: tokens with
    most of the probability (the EOS 2, a token 5 that may be banned)."""
    max_new = np.array(data.draw(st.lists(st.integers(0, 7), min_size=B, max_size=B)))
    min_new = np.array(data.draw(st.lists(st.integers(0, 4), min_size=B, max_size=B)))
    options = draw_options(data, V, B, max_new, False)
    if mask_only:
        options.update(repetition_penalty=1.0, no_repeat_ngram_size=0)
    if hot:
        options["banned_ids"] = sorted(set(options["banned_ids"]) | {5})
    fn = shifted(masked_random_fn(V, seed, 1.5, p_masked), 1.0)
    if hot:
        base = fn
        fn = lambda src, prefix: base(src, prefix) + np.isin(np.arange(V), hot) * 9.0  # noqa: E731
    src, lengths = sources(B)
    head, host = HeadRunner(V, fn), FunctionRunner(V, fn)
    kwargs = dict(bos_id=1, eos_id=2, max_decoding_length=max_new, min_decoding_length=min_new, **options)
    got = decoding.greedy_decode(head, src, lengths, **kwargs)
    assert got == decoding.greedy_decode(host, src, lengths, **kwargs)
    assert head.head_steps == 0  # without scores an argmax on the host is all it takes
    got = decoding.greedy_decode(head, src, lengths, return_scores=True, **kwargs)
    want = decoding.greedy_decode(host, src, lengths, return_scores=True, **kwargs)
    for g, w in zip(got, want, strict=True):
        assert g[0].tokens == w[0].tokens and g[0].finished == w[0].finished
        np.testing.assert_allclose(g[0].token_log_probs, w[0].token_log_probs, rtol=1e-5, atol=1e-5)
    if mask_only and V > 9 and max_new.max() > 1 and not hot:
        assert head.head_steps > 0


# ------------------------------------------------------------------------------------------
# OrtRunner.step_top_k
# ------------------------------------------------------------------------------------------


class HostSearch:
    """An OrtRunner without ``step_top_k``: the search runs on the host."""

    def __init__(self, runner):
        self.runner = runner

    def encode(self, *args):
        return self.runner.encode(*args)

    def step(self, *args):
        return self.runner.step(*args)

    def reorder(self, *args):
        return self.runner.reorder(*args)

    def select(self, *args):
        return self.runner.select(*args)


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return OrtRunner(exported_dir(tmp_path_factory, "portable"), intra_op_num_threads=1)


@pytest.mark.parametrize(
    "options", [{}, {"banned_ids": [5, 9], "min_decoding_length": 4}, {"length_penalty_type": "hf"}]
)
def test_ort_beam_through_the_head_equals_the_host_search(runner, options):
    rng = np.random.default_rng(1)
    ids = rng.integers(4, runner.info.src_vocab_size, (5, 7)).astype(np.int64)
    lengths = np.array([7, 3, 5, 7, 1], dtype=np.int64)
    kwargs = dict(
        bos_id=runner.info.bos_id,
        eos_id=runner.info.eos_id,
        beam_size=4,
        num_hypotheses=2,
        max_decoding_length=12,
    )
    kwargs.update(options)
    got = decoding.beam_search(runner, ids, lengths, **kwargs)
    want = decoding.beam_search(HostSearch(runner), ids, lengths, **kwargs)
    for g_hyps, w_hyps in zip(got, want, strict=True):
        assert [h.tokens for h in g_hyps] == [h.tokens for h in w_hyps]
        np.testing.assert_allclose([h.score for h in g_hyps], [h.score for h in w_hyps], rtol=1e-5, atol=1e-5)
    if options.get("length_penalty_type") == "hf":
        return
    del kwargs["beam_size"], kwargs["num_hypotheses"]
    got = decoding.greedy_decode(runner, ids, lengths, return_scores=True, **kwargs)
    want = decoding.greedy_decode(HostSearch(runner), ids, lengths, return_scores=True, **kwargs)
    for g, w in zip(got, want, strict=True):
        assert g[0].tokens == w[0].tokens
        np.testing.assert_allclose(g[0].token_log_probs, w[0].token_log_probs, rtol=1e-5, atol=1e-5)


def test_step_top_k_arguments(runner):
    V = runner.info.tgt_vocab_size
    state = runner.encode(np.array([[5, 6, 7]]), np.array([3]), 4, 2)
    tokens = np.array([runner.info.bos_id] * 2)
    for k in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="k must be an int >= 1"):
            runner.step_top_k(state, tokens, k, np.zeros((2, 1), dtype=np.int64))
    for columns in (
        np.zeros((3, 1), dtype=np.int64),
        np.zeros((2, 0), dtype=np.int64),
        np.zeros(2, dtype=np.int64),
        [[1.5], [2.0]],  # floats are not token ids (never truncated)
    ):
        with pytest.raises(ValueError, match=r"columns must be int64 \[2, M >= 1\]"):
            runner.step_top_k(state, tokens, 4, columns)
    with pytest.raises(ValueError, match=f"columns must hold target token ids 0 .. {V - 1}"):
        runner.step_top_k(state, tokens, 4, np.full((2, 1), V, dtype=np.int64))
    assert state.cache.length == 0  # nothing ran
    top, ids, picked, logits = runner.step_top_k(state, tokens, V + 5, np.array([[0], [V - 1]]))
    assert top.shape == ids.shape == (2, V) and picked.shape == (2, 1) and logits.shape == (2, V)
    want = torch.log_softmax(torch.from_numpy(logits).double(), -1).numpy()
    np.testing.assert_allclose(top, np.sort(want, axis=1)[:, ::-1], atol=2e-6)
    np.testing.assert_allclose(picked[:, 0], [want[0, 0], want[1, V - 1]], atol=2e-6)
    assert state.cache.length == 1 and math.isfinite(float(top[0, 0]))
    options = runner._head.session.get_session_options()  # the decoder's threads, not spinning
    assert options.intra_op_num_threads == 1
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
