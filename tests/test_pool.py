"""transformer_ext.runtimes.pool: the parts of a batch decoded on several runners at once."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from helpers import FunctionRunner, exported_dir

from transformer_ext import decoding
from transformer_ext.runtimes import OrtRunner, SourceParallel, split_sources


def test_split_sources_is_contiguous_balanced_and_never_empty():
    for n in range(1, 12):
        for parts in range(1, 6):
            slices = split_sources(n, parts)
            assert len(slices) == min(n, parts)
            assert slices[0].start == 0 and slices[-1].stop == n
            assert all(a.stop == b.start for a, b in zip(slices, slices[1:]))
            sizes = [s.stop - s.start for s in slices]
            assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="n must be a positive int"):
            split_sources(bad, 2)
        with pytest.raises(ValueError, match="parts must be a positive int"):
            split_sources(4, bad)


def _sources(info, batch: int, src_len: int = 9, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, info.src_vocab_size, size=(batch, src_len)).astype(np.int64)
    lengths = rng.integers(1, src_len + 1, size=batch).astype(np.int64)
    lengths[0] = src_len
    for row, n in enumerate(lengths):
        ids[row, n:] = info.pad_id
    return ids, lengths


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    export = exported_dir(tmp_path_factory, "portable")
    return [OrtRunner(export, intra_op_num_threads=1) for _ in range(3)]


@pytest.mark.parametrize("beam_size", [1, 3])
def test_parts_decode_as_each_part_alone_and_as_the_whole_batch(runners, beam_size):
    """Every part's hypotheses are those its runner gives for those sources alone (the oracle: one
    runner, part by part, no threads), in source order; float32 tokens also equal one runner's
    over the whole batch. Per-source budgets are sliced with the sources."""
    info = runners[0].info
    ids, lengths = _sources(info, batch=7)
    budgets = np.array([5, 9, 3, 12, 7, 4, 10])
    options = dict(
        bos_id=info.bos_id,
        eos_id=info.eos_id,
        max_decoding_length=budgets,
        beam_size=beam_size,
        num_hypotheses=min(beam_size, 2),
    )
    used = []

    def search(runner, src, ln, **kw):
        used.append(runner._runner)  # (each part sees its runner through a stoppable view)
        return decoding.generate(runner, src, ln, **kw)

    with SourceParallel(runners) as parallel:
        got = parallel.run(search, ids, lengths, **options)
    assert sorted(map(id, used)) == sorted(map(id, runners))  # each part on a runner of its own
    want = []
    for runner, sl in zip(runners, split_sources(7, 3)):
        part = {**options, "max_decoding_length": budgets[sl]}
        want += decoding.generate(runner, ids[sl], lengths[sl], **part)
    assert [[h.tokens for h in row] for row in got] == [[h.tokens for h in row] for row in want]
    assert [[h.score for h in row] for row in got] == [[h.score for h in row] for row in want]
    whole = decoding.generate(runners[0], ids, lengths, **options)
    assert [[h.tokens for h in row] for row in got] == [[h.tokens for h in row] for row in whole]
    assert all(len(row[0].tokens) <= b for row, b in zip(got, budgets))


def test_one_source_or_one_runner_runs_in_place(runners):
    info = runners[0].info
    ids, lengths = _sources(info, batch=1)
    with SourceParallel(runners) as parallel:
        out = parallel.generate(ids, lengths, bos_id=info.bos_id, eos_id=info.eos_id, max_decoding_length=6)
    assert out == decoding.generate(
        runners[0], ids, lengths, bos_id=info.bos_id, eos_id=info.eos_id, max_decoding_length=6
    )


@pytest.mark.parametrize("parts", [2, 3])
def test_a_split_sample_is_the_unsplit_one(runners, parts):
    """Random sampling over the parts (same seed) gives every source the tokens and scores of one
    runner on the whole batch: each part samples its sources' streams (their source_index); a
    caller's source_index is sliced with the sources too."""
    info = runners[0].info
    ids, lengths = _sources(info, batch=7, seed=4)
    options = dict(
        bos_id=info.bos_id,
        eos_id=info.eos_id,
        max_decoding_length=np.array([6, 9, 4, 12, 7, 5, 10]),
        sampling_topk=0,
        sampling_temperature=1.5,
        num_hypotheses=2,
        seed=11,
    )

    def samples(rows):
        return [[(list(h.tokens), round(h.score, 4)) for h in row] for row in rows]

    whole = samples(decoding.generate(runners[0], ids, lengths, **options))
    assert len({str(row) for row in whole}) == 7  # the sources were sampled differently
    with SourceParallel(runners[:parts]) as parallel:
        assert samples(parallel.generate(ids, lengths, **options)) == whole
        shifted = dict(options, source_index=np.arange(7) + 20)
        want = samples(decoding.generate(runners[0], ids, lengths, **shifted))
        assert want != whole and samples(parallel.generate(ids, lengths, **shifted)) == want


def test_bad_uses_are_refused(runners, tmp_path_factory):
    info = runners[0].info
    ids, lengths = _sources(info, batch=4)
    with pytest.raises(ValueError, match="at least one runner"):
        SourceParallel([])
    other = OrtRunner(exported_dir(tmp_path_factory, "tensorscatter"), intra_op_num_threads=1)
    with pytest.raises(ValueError, match="same model"):
        SourceParallel([runners[0], other])
    common = dict(bos_id=info.bos_id, eos_id=info.eos_id, max_decoding_length=4)
    with SourceParallel(runners[:2]) as parallel:
        with pytest.raises(ValueError, match="max_decoding_length holds 3 values for 4 sources"):
            parallel.generate(ids, lengths, **{**common, "max_decoding_length": np.array([4, 4, 4])})
        with pytest.raises(ValueError, match=r"input_ids must be \[batch, src_len\]"):
            parallel.generate(ids[0], lengths, **common)
        with pytest.raises(TypeError, match="one entry per source"):
            parallel.run(lambda r, s, ln: [], ids, lengths)


class SlowRunner(FunctionRunner):
    """A FunctionRunner whose steps take ``delay`` seconds; ``fail_at``: the step that raises ``error``."""

    def __init__(self, delay: float, fail_at: int = -1, error: type = RuntimeError):
        super().__init__(50, lambda src, prefix: np.zeros(50))
        self.info = "same model"
        self.delay, self.fail_at, self.error = delay, fail_at, error

    def step(self, state, tokens):
        if self.steps == self.fail_at:
            raise self.error("stopped by the test")
        time.sleep(self.delay)
        return super().step(state, tokens)


def _greedy(runner, src, ln):
    return decoding.greedy_decode(
        runner, src, ln, bos_id=1, eos_id=2, max_decoding_length=400, min_decoding_length=400
    )


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_failing_part_stops_the_others_within_a_step(error):
    """One part fails at its 3rd step: the others stop at their next step (not after 400 steps
    of 10 ms), and run() raises that part's error once every part has stopped."""
    runners = [SlowRunner(0.01, fail_at=3, error=error), SlowRunner(0.01), SlowRunner(0.01)]
    src, lengths = np.ones((6, 3), dtype=np.int64), np.full(6, 3, dtype=np.int64)
    with SourceParallel(runners) as parallel:
        with pytest.raises(error, match="stopped by the test"):
            parallel.run(_greedy, src, lengths)
        counts = [r.steps for r in runners]
        assert max(counts) < 100, counts
        time.sleep(0.1)
        assert [r.steps for r in runners] == counts  # nothing runs on after run() returned


def test_ctrl_c_while_the_parts_run_stops_them():
    """SIGINT to the process while run() waits (whichever thread the OS gives it to): the main
    thread raises KeyboardInterrupt within a poll, the parts stop at their next step."""
    runners = [SlowRunner(0.01), SlowRunner(0.01)]
    src, lengths = np.ones((4, 3), dtype=np.int64), np.full(4, 3, dtype=np.int64)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # (a background shell ignores it)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    try:
        with SourceParallel(runners) as parallel:
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                parallel.run(_greedy, src, lengths)
            counts = [r.steps for r in runners]
            assert max(counts) < 200, counts
            time.sleep(0.1)
            assert [r.steps for r in runners] == counts
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)


def test_a_part_sees_its_runners_methods_only():
    """The view a part's search gets has the runner's optional methods exactly when the runner has them."""
    from transformer_ext.runtimes.pool import _StoppableRunner

    plain = _StoppableRunner(FunctionRunner(5, lambda s, p: np.zeros(5)), threading.Event())
    assert getattr(plain, "step_top_k", None) is None and getattr(plain, "step_with_attention", None) is None
    assert callable(plain.select) and callable(plain.step) and plain.V == 5
