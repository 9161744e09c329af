"""The search options on real runners: the tiny model on the eager runner and its ONNX export on
ONNX Runtime give equal tokens for every option, and both give the tokens of the plain loops of
tests/test_decoding_options.py and tests/beam_reference.py (run here over the model itself,
one source and one prefix at a time)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from beam_reference import BOS, EOS, loop_beam_search, loop_greedy, loop_sample, loop_score
from helpers import exported_dir

from transformer_ext.checkpoint import load_model
from transformer_ext.decoding import beam_search, generate, greedy_decode, score
from transformer_ext.export_format import MANIFEST_NAME
from transformer_ext.runtimes import EagerRunner, OrtRunner

B = 4
MAX_NEW = np.array([9, 6, 11, 4])


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    export = exported_dir(tmp_path_factory, "portable")
    manifest = json.loads((export / MANIFEST_NAME).read_text())
    ort = OrtRunner(export, intra_op_num_threads=1)
    eager = EagerRunner(load_model(manifest["export"]["source_model_dir"]), "cpu")
    assert (ort.info.bos_id, ort.info.eos_id) == (BOS, EOS)  # the ids the plain loops use
    return eager, ort


@pytest.fixture(scope="module")
def batch(runners):
    rng = np.random.default_rng(3)
    vocab = runners[1].info.src_vocab_size
    lengths = np.array([7, 3, 5, 6], dtype=np.int64)
    ids = np.zeros((B, 7), dtype=np.int64)
    for b, n in enumerate(lengths):
        ids[b, :n] = rng.integers(4, vocab, size=n)
    return ids, lengths


def model_fn(runner, ids, lengths):
    """``fn(source, prefix) -> logits``: the model re-run on one source and one fed prefix."""
    cache = {}

    def fn(b, prefix, start=None):
        key = (b, prefix, start)
        if key not in cache:
            state = runner.encode(ids[b : b + 1], lengths[b : b + 1], len(prefix) + 1, 1)
            out = None
            for tok in (BOS if start is None else start,) + tuple(prefix):
                out = runner.step(state, np.array([tok], dtype=np.int64))
            cache[key] = out[0]
        return cache[key]

    return fn


class FnRunner:
    """The runner protocol over ``model_fn`` (one model call per row and step), for the loop
    beam search."""

    def __init__(self, fn, start):
        self.fn, self.start = fn, start

    def encode(self, input_ids, src_lengths, cache_len, beam_size=1):
        return dict(
            src=np.repeat(np.arange(len(input_ids)), beam_size),
            fed=[[] for _ in range(len(input_ids) * beam_size)],
        )

    def step(self, state, tokens):
        rows = []
        for r, tok in enumerate(tokens.tolist()):
            state["fed"][r].append(tok)
            rows.append(self.fn(int(state["src"][r]), tuple(state["fed"][r][1:]), self.start))
        return np.stack(rows)

    def reorder(self, state, beam_index):
        state["fed"] = [list(state["fed"][int(i)]) for i in beam_index]


OPTIONS = [
    dict(),
    dict(target_prefix=[[5, 6], [], [7], [8, 9, 10]], banned_ids=[4, 11]),
    dict(repetition_penalty=1.5, no_repeat_ngram_size=2, force_eos_at_budget=True),
    dict(decoder_start_id=3, no_repeat_ngram_size=1, min_decoding_length=3),
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "defaults")
def test_greedy_options_equal_on_eager_and_onnx_runtime_and_the_loop(runners, batch, options):
    eager, ort = runners
    ids, lengths = batch
    opts = dict(options)
    min_new = np.full(B, opts.pop("min_decoding_length", 0))
    kw = dict(
        bos_id=BOS,
        eos_id=EOS,
        max_decoding_length=MAX_NEW,
        min_decoding_length=min_new,
        return_scores=True,
        **opts,
    )
    a = greedy_decode(eager, ids, lengths, **kw)
    b = greedy_decode(ort, ids, lengths, **kw)
    assert [h[0].tokens for h in a] == [h[0].tokens for h in b]
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x[0].token_log_probs, y[0].token_log_probs, rtol=0, atol=1e-4)
    fn = model_fn(eager, ids, lengths)
    start = opts.get("decoder_start_id")
    want = loop_greedy(lambda s, p: fn(s, p, start), B, MAX_NEW, min_new, opts)
    assert [h[0].tokens for h in a] == [w[0] for w in want]


@pytest.mark.parametrize("kind", ["gnmt", "hf"])
@pytest.mark.parametrize(
    "options", [OPTIONS[1], {**OPTIONS[2], **OPTIONS[3]}], ids=lambda o: ",".join(o) or "defaults"
)
def test_beam_options_equal_on_eager_and_onnx_runtime_and_the_loop(runners, batch, options, kind):
    eager, ort = runners
    ids, lengths = batch
    kw = dict(
        bos_id=BOS,
        eos_id=EOS,
        beam_size=3,
        num_hypotheses=2,
        max_decoding_length=MAX_NEW,
        length_penalty_type=kind,
        **options,
    )
    if kind == "hf":
        kw.update(length_penalty=1.0, early_stopping=False)
    a = beam_search(eager, ids, lengths, **kw)
    b = beam_search(ort, ids, lengths, **kw)
    assert [[h.tokens for h in row] for row in a] == [[h.tokens for h in row] for row in b]
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose([h.score for h in x], [h.score for h in y], rtol=0, atol=1e-4)
    fn = model_fn(eager, ids, lengths)
    want = loop_beam_search(FnRunner(fn, options.get("decoder_start_id")), ids, lengths, **kw)
    assert [[h.tokens for h in row] for row in a] == [[h.tokens for h in row] for row in want]


@pytest.mark.parametrize(
    "sampling",
    [
        dict(sampling_topk=0),
        dict(sampling_topk=5, sampling_temperature=1.5),
        dict(sampling_topk=0, sampling_topp=0.8),
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_sampling_equal_on_eager_and_onnx_runtime_and_the_loop(runners, batch, sampling):
    eager, ort = runners
    ids, lengths = batch
    kw = dict(bos_id=BOS, eos_id=EOS, max_decoding_length=MAX_NEW, num_hypotheses=2, seed=7, **sampling)
    a = generate(eager, ids, lengths, **kw)
    b = generate(ort, ids, lengths, **kw)
    assert [[h.tokens for h in row] for row in a] == [[h.tokens for h in row] for row in b]
    fn = model_fn(eager, ids, lengths)
    rows = loop_sample(
        fn,
        B,
        2,
        MAX_NEW,
        np.zeros(B, dtype=np.int64),
        {},
        sampling.get("sampling_topk", 1),
        sampling.get("sampling_topp", 1.0),
        sampling.get("sampling_temperature", 1.0),
        7,
    )
    for s in range(B):
        assert sorted(tuple(h.tokens) for h in a[s]) == sorted(
            tuple(r["gen"]) for r in rows[2 * s : 2 * s + 2]
        )


def test_score_equal_on_eager_and_onnx_runtime_and_the_loop(runners, batch):
    eager, ort = runners
    ids, lengths = batch
    targets = [[5, 6, 7], [], [9, 9, 9, 9, 9], [12]]
    a = score(eager, ids, lengths, targets, bos_id=BOS, eos_id=EOS)
    b = ort.score(ids, lengths, targets)
    want = loop_score(model_fn(eager, ids, lengths), targets)
    for x, y, w in zip(a, b, want, strict=True):
        np.testing.assert_allclose(x.token_log_probs, w, rtol=0, atol=1e-5)
        np.testing.assert_allclose(y.token_log_probs, w, rtol=0, atol=1e-4)


@pytest.mark.parametrize("sampling", [dict(sampling_topk=0), dict(sampling_topk=4, sampling_topp=0.9)])
def test_sampling_draws_the_same_tokens_when_finished_rows_leave(runners, batch, sampling):
    """Dropping finished rows (the default) leaves the random stream as it is: one draw per row
    of the search and step, so the same seed samples the same tokens as feeding them to the end."""
    ids, lengths = batch
    kw = dict(bos_id=BOS, eos_id=EOS, max_decoding_length=MAX_NEW, num_hypotheses=3, seed=11, **sampling)
    for runner in runners:
        a = generate(runner, ids, lengths, remove_finished=True, **kw)
        b = generate(runner, ids, lengths, remove_finished=False, **kw)
        assert [[h.tokens for h in row] for row in a] == [[h.tokens for h in row] for row in b]
        for x, y in zip(a, b, strict=True):
            np.testing.assert_allclose([h.log_prob for h in x], [h.log_prob for h in y], rtol=0, atol=1e-5)
