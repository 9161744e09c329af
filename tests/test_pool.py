"""transformer_ext.runtimes.pool: the parts of a batch decoded on several runners at once."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import exported_dir

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
        max_new_tokens=budgets,
        beam_size=beam_size,
        num_hypotheses=min(beam_size, 2),
    )
    used = []

    def search(runner, src, ln, **kw):
        used.append(runner)
        return decoding.generate(runner, src, ln, **kw)

    with SourceParallel(runners) as parallel:
        got = parallel.run(search, ids, lengths, **options)
    assert sorted(map(id, used)) == sorted(map(id, runners))  # each part on a runner of its own
    want = []
    for runner, sl in zip(runners, split_sources(7, 3)):
        part = {**options, "max_new_tokens": budgets[sl]}
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
        out = parallel.generate(ids, lengths, bos_id=info.bos_id, eos_id=info.eos_id, max_new_tokens=6)
    assert out == decoding.generate(
        runners[0], ids, lengths, bos_id=info.bos_id, eos_id=info.eos_id, max_new_tokens=6
    )


def test_bad_uses_are_refused(runners, tmp_path_factory):
    info = runners[0].info
    ids, lengths = _sources(info, batch=4)
    with pytest.raises(ValueError, match="at least one runner"):
        SourceParallel([])
    other = OrtRunner(exported_dir(tmp_path_factory, "tensorscatter"), intra_op_num_threads=1)
    with pytest.raises(ValueError, match="same model"):
        SourceParallel([runners[0], other])
    common = dict(bos_id=info.bos_id, eos_id=info.eos_id, max_new_tokens=4)
    with SourceParallel(runners[:2]) as parallel:
        with pytest.raises(ValueError, match="sampling cannot be split"):
            parallel.generate(ids, lengths, sampling_topk=5, seed=1, **common)
        with pytest.raises(ValueError, match="max_new_tokens holds 3 values for 4 sources"):
            parallel.generate(ids, lengths, **{**common, "max_new_tokens": np.array([4, 4, 4])})
        with pytest.raises(ValueError, match=r"input_ids must be \[batch, src_len\]"):
            parallel.generate(ids[0], lengths, **common)
        with pytest.raises(TypeError, match="one entry per source"):
            parallel.run(lambda r, s, ln: [], ids, lengths)
