"""The step-wise search state: sources admitted between steps, handed back when finished.

The guarantee: a source's hypotheses are the same whether it is searched alone, in a fixed batch,
or admitted into a running batch at a later step. Oracles: the same source searched alone by
:func:`generate` (the searches the beam-reference and transformers tests check), and the three
ways of batching against each other, on every runner kind with ``select`` and ``append``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import FunctionRunner, exported_dir, masked_random_fn

from transformer_ext.checkpoint import load_model
from transformer_ext.decoding import Hypothesis, SearchOptions, SearchState, SourceRequest, generate
from transformer_ext.runtimes import EagerRunner, OrtRunner

BUDGET = 9

GREEDY = SearchOptions(max_decoding_length=BUDGET, return_scores=True)
BEAM = SearchOptions(beam_size=4, num_hypotheses=2, max_decoding_length=BUDGET, length_penalty=1.0)
# A mixed batch: greedy, beam search, sampling and processors side by side, budgets per source.
MIXED = [
    GREEDY,
    BEAM,
    SearchOptions(sampling_topk=0, sampling_temperature=0.8, seed=5, num_hypotheses=2, max_decoding_length=7),
    SearchOptions(
        min_decoding_length=4, no_repeat_ngram_size=2, max_len_a=1.0, max_len_b=2, max_decoding_length=8
    ),
    SearchOptions(
        beam_size=2,
        length_penalty_type="hf",
        length_penalty=1.2,
        repetition_penalty=1.3,
        max_decoding_length=6,
    ),
    dataclasses.replace(BEAM, beam_size=3, banned_ids=(5, 6), max_decoding_length=5),
]


@pytest.fixture(scope="module", params=["eager", "ort_portable", "ort_tensorscatter", "ort_ort"])
def runner(request, tmp_path_factory):
    if request.param == "eager":
        exported_dir(tmp_path_factory, "portable")  # writes the shared tiny model folder
        return EagerRunner(load_model(tmp_path_factory.getbasetemp() / "shared_exports" / "tiny_model"))
    return OrtRunner(exported_dir(tmp_path_factory, request.param.split("_", 1)[1]), intra_op_num_threads=1)


def _sources(runner, n=6):
    rng = np.random.default_rng(7)
    lengths = [5, 2, 9, 3, 7, 1][:n]
    return [rng.integers(4, runner.info.src_vocab_size, size=k).astype(np.int64) for k in lengths]


def _requests(sources, options, prefixes=None):
    prefixes = prefixes or [None] * len(sources)
    return [
        SourceRequest(src, opts, target_prefix=p, key=f"s{i}", index=i)
        for i, (src, opts, p) in enumerate(zip(sources, options, prefixes))
    ]


def _new_state(runner):
    return SearchState(runner, bos_id=runner.info.bos_id, eos_id=runner.info.eos_id)


def _drain(state, results):
    while not state.empty:
        for key, hyps in state.step():
            assert key not in results
            results[key] = hyps
    return results


def _searched(runner, requests, schedule):
    """Each request's hypotheses when the requests join the search in groups: ``schedule`` is
    a list of ``(admit this many next, then run this many steps)``."""
    state, results, i = _new_state(runner), {}, 0
    for count, steps in schedule:
        state.admit(requests[i : i + count])
        i += count
        for _ in range(steps):
            results.update(state.step())
    assert i == len(requests)
    return _drain(state, results)


def _assert_same(got: dict, want: dict, exact: bool):
    assert got.keys() == want.keys()
    for key in want:
        g, w = got[key], want[key]
        assert [h.tokens for h in g] == [h.tokens for h in w], key
        assert [h.finished for h in g] == [h.finished for h in w], key
        if exact:
            assert [(h.score, h.log_prob, h.token_log_probs) for h in g] == [
                (h.score, h.log_prob, h.token_log_probs) for h in w
            ], key
        else:  # the eager runner's GEMM kernels round differently for different row counts
            assert [h.score is None for h in g] == [h.score is None for h in w]
            scored = [(a.score, b.score) for a, b in zip(g, w) if b.score is not None]
            np.testing.assert_allclose(*zip(*scored), rtol=0, atol=2e-5) if scored else None


@pytest.mark.parametrize("options", ["greedy", "beam", "mixed"])
def test_a_source_is_searched_alike_alone_in_a_batch_and_admitted_later(runner, options):
    sources = _sources(runner)
    opts = {"greedy": [GREEDY] * 6, "beam": [BEAM] * 6, "mixed": MIXED}[options]
    prefixes = [None, [7], None, [8, 9], None, None] if options == "mixed" else None
    requests = _requests(sources, opts, prefixes)
    alone = {}
    for r in requests:
        alone.update(_searched(runner, [r], [(1, 0)]))
    batch = _searched(runner, requests, [(6, 0)])
    later = _searched(runner, requests, [(2, 2), (1, 1), (2, 3), (1, 0)])
    exact = not isinstance(runner, EagerRunner)
    _assert_same(batch, alone, exact)
    _assert_same(later, alone, exact)
    # every source finished within its budget, prefixes first
    for r in requests:
        for h in alone[r.key]:
            assert len(h.tokens) <= BUDGET
            if r.target_prefix:
                assert h.tokens[: len(r.target_prefix)] == list(r.target_prefix)


@pytest.mark.parametrize("opts", [GREEDY, BEAM, MIXED[4]], ids=["greedy", "beam", "hf"])
def test_a_source_alone_is_what_generate_gives(runner, opts):
    """The state's search is the searches' own: a source alone gives generate()'s hypotheses
    (the searches the beam-reference and transformers tests check)."""
    info = runner.info
    for i, src in enumerate(_sources(runner, 3)):
        (key, got), *rest = _searched(runner, [SourceRequest(src, opts, key=i)], [(1, 0)]).items()
        want = generate(
            runner,
            src[None, :],
            np.array([src.shape[0]]),
            bos_id=info.bos_id,
            eos_id=info.eos_id,
            **opts.generate_kwargs(),
            max_decoding_length=opts.budget([src.shape[0]]),
        )[0]
        assert not rest and key == i
        # ONNX Runtime: generate() lays out its fixed batch as it likes (a beam search's
        # cross-attention once per source, caches of the capacity it needs), the state as any
        # batch can be laid out (OrtRunner.batch_invariant), which rounds differently
        _assert_same({i: got}, {i: want}, exact=isinstance(runner, EagerRunner))


def test_rows_leave_and_join_the_runners_state(runner):
    """Finished sources' rows leave through select, new ones join through append."""
    sources = _sources(runner)
    state = _new_state(runner)
    state.admit(_requests(sources[:2], [BEAM, GREEDY]))
    assert (state.num_sources, state.num_rows) == (2, 5)
    state.step()
    state.admit([SourceRequest(sources[2], BEAM, key="late", index=2)])
    assert (state.num_sources, state.num_rows) == (3, 9)
    rows = []
    while not state.empty:
        state.step()
        rows.append(state.num_rows)
    assert rows[-1] == 0 and rows == sorted(rows, reverse=True)


def test_sources_take_the_row_slots_of_sources_that_left(runner):
    """Row slots (a runner with insert / release, the ONNX Runtime one): a source admitted after
    another left takes its rows of the runner's state in place (no new buffers, no other row
    moved), more rows than are free grow the state, many free rows are compacted away; every
    source still gets exactly its solo result."""

    def exactly(opts, n):  # n tokens: the schedule below does not depend on the model
        return dataclasses.replace(opts, max_decoding_length=n, min_decoding_length=n)

    sources = _sources(runner)
    opts = [exactly(GREEDY, 2), exactly(GREEDY, 9), exactly(GREEDY, 8), exactly(GREEDY, 4)]
    opts += [exactly(BEAM, 3), exactly(GREEDY, 3)]
    requests = _requests(sources, opts)
    alone = {}
    for r in requests:
        alone.update(_searched(runner, [r], [(1, 0)]))
    state, got = _new_state(runner), {}
    slots = state.slots
    assert slots == (not isinstance(runner, EagerRunner))
    for r in requests[:3]:  # three groups
        state.admit([r])
    got.update(state.step())
    got.update(state.step())
    assert list(got) == ["s0"] and state.num_rows == 2
    if slots:
        assert state.num_slots == 3  # s0's row is free, nothing moved
        cross = state._state.cross_keys[0]
        state.admit([requests[3]])
        assert state.num_slots == 3 and state._state.cross_keys[0] is cross  # written in place
    else:
        state.admit([requests[3]])
    got.update(state.step())
    state.admit([requests[4]])  # 4 beams: no free row, 4 new ones
    state.admit([requests[5]])
    assert state.num_rows == 3 + 4 + 1
    if slots:
        assert state.num_slots == 8
        # the running state's long-lived buffers are its own, not the runner's buffer pool's
        # (which would keep buffers of every size the batch ever had)
        run = state._state
        arrays = [run.cache.keys, run.cache.values, *run.cross_keys, *run.cross_values]
        pooled = [] if runner._pool is None else runner._pool._buffers
        assert not any(np.shares_memory(a, b) for a in arrays for b in pooled)
    seen = []
    while not state.empty:
        got.update(state.step())
        seen.append((state.num_rows, state.num_slots))
    _assert_same(got, alone, exact=slots)
    if slots:  # free rows leave the state (one compaction) once they are more than a quarter
        assert min(s for r, s in seen if s) < 8
        for (r0, s0), (_, s1) in zip(seen, seen[1:]):
            if s1 and (s0 - r0) * 4 > s0:
                assert s1 == r0, seen


# ------------------------------------------------------------------------------------------
# cancel, partial, bad input (a numpy runner: no model needed)
# ------------------------------------------------------------------------------------------


class _AppendingRunner(FunctionRunner):
    """The tests' numpy runner with ``append`` (rows of a later encode join, each at its own
    position: the runner keeps every row's fed tokens)."""

    def append(self, state, other):
        state["src"] = np.concatenate([state["src"], other["src"] + 100])  # a source of its own
        state["fed"] = state["fed"] + other["fed"]
        state["cache_len"] = max(state["cache_len"], other["cache_len"])


def _numpy_runner(appends=True):
    return (_AppendingRunner if appends else FunctionRunner)(11, masked_random_fn(11, 3, 2.0, 0.0))


def _ids(k):
    return np.arange(3, 3 + k, dtype=np.int64)


def test_cancel_drops_a_source_without_a_result_and_leaves_the_others_alone():
    opts = [dataclasses.replace(o, min_decoding_length=3) for o in (GREEDY, BEAM, GREEDY)]
    requests = [SourceRequest(_ids(2), o, key=k) for k, o in zip("abc", opts)]
    want = _drain(_state_of(requests), {})
    state = _state_of(requests)
    state.step()
    state.cancel("b")
    assert state.num_sources == 2
    with pytest.raises(KeyError, match="no open source has the key 'b'"):
        state.cancel("b")
    got = _drain(state, {})
    assert sorted(got) == ["a", "c"]
    assert got["a"] == want["a"] and got["c"] == want["c"]


def _state_of(requests):
    state = SearchState(_numpy_runner(), bos_id=1, eos_id=2)
    state.admit(requests)
    return state


@pytest.mark.parametrize("opts", [GREEDY, BEAM], ids=["greedy", "beam"])
def test_partial_is_a_prefix_of_the_result_growing_by_one_token(opts):
    state = _state_of([SourceRequest(_ids(3), dataclasses.replace(opts, min_decoding_length=6), key="x")])
    seen, result = [], None
    while not state.empty:
        for _, hyps in state.step():
            result = hyps
        if not state.empty:
            seen.append(state.partial("x"))
    assert [len(p) for p in seen] == list(range(1, len(seen) + 1))
    if opts.beam_size == 1:  # greedy: each partial is the final prefix
        assert all(result[0].tokens[: len(p)] == p for p in seen)
    assert isinstance(result[0], Hypothesis)
    with pytest.raises(KeyError):
        state.partial("x")  # handed back: no longer open


def test_admission_checks_every_request_before_encoding():
    state = SearchState(_numpy_runner(), bos_id=1, eos_id=2)
    with pytest.raises(ValueError, match=r"requests\[1\]\.input_ids must be a non-empty 1-D array"):
        state.admit([SourceRequest(_ids(2)), SourceRequest(np.zeros((1, 2), dtype=np.int64), index=1)])
    with pytest.raises(TypeError, match=r"requests\[0\]\.input_ids must hold integers"):
        state.admit([SourceRequest(np.array([1.5]))])
    with pytest.raises(TypeError, match=r"requests\[0\]\.options must be a SearchOptions"):
        state.admit([SourceRequest(_ids(2), {"beam_size": 2})])
    with pytest.raises(ValueError, match=r"the key 'k' is given to more than one source"):
        state.admit([SourceRequest(_ids(2), key="k"), SourceRequest(_ids(2), key="k", index=1)])
    with pytest.raises(ValueError, match=r"requests\[0\]\.index must be an int >= 0"):
        state.admit([SourceRequest(_ids(2), index=-1)])
    with pytest.raises(ValueError, match=r"requests\[1\]\.target_prefix\[0\] is the EOS id 2"):
        state.admit([SourceRequest(_ids(2), key=0), SourceRequest(_ids(2), target_prefix=[2], key=1)])
    assert state.empty and state.num_rows == 0  # nothing was admitted
    state.admit([SourceRequest(_ids(2), key="k")])
    with pytest.raises(ValueError, match="the key of a source that is still open"):
        state.admit([SourceRequest(_ids(2), key="k")])


def test_a_runner_without_append_admits_one_group_before_the_first_step():
    slow = dataclasses.replace(GREEDY, min_decoding_length=3)
    state = SearchState(_numpy_runner(appends=False), bos_id=1, eos_id=2)
    state.admit([SourceRequest(_ids(2), slow, key=0), SourceRequest(_ids(3), slow, key=1)])
    state.step()
    with pytest.raises(TypeError, match="FunctionRunner runner cannot admit sources into a running search"):
        state.admit([SourceRequest(_ids(2), GREEDY, key=2)])
    fresh = SearchState(_numpy_runner(appends=False), bos_id=1, eos_id=2)
    with pytest.raises(TypeError, match="cannot admit sources into a running search"):
        fresh.admit([SourceRequest(_ids(2), GREEDY, key=0), SourceRequest(_ids(2), BEAM, key=1)])
