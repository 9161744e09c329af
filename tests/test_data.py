"""The demo task's data: num2words pairs, the fixed split, token-count batches and padding."""

import pytest
import torch
from num2words import num2words

from transformer_ext.data import (
    DEMO_RANGE,
    Example,
    TokenBatchSampler,
    collate,
    demo_splits,
    example_cost,
    make_examples,
    oversample,
    source_text,
    split_numbers,
    target_text,
)

PAD, BOS, EOS = 0, 1, 2


def test_pairs_are_num2words():
    assert source_text(342) == "three hundred and forty-two"
    assert target_text(342) == "dreihundertzweiundvierzig"
    assert make_examples([42, 7]) == [Example(42, "forty-two", "zweiundvierzig"), Example(7, "seven", "sieben")]
    for n in (0, 16, 1001, 9999):
        assert source_text(n) == num2words(n, lang="en") and target_text(n) == num2words(n, lang="de")


def test_demo_split_sizes_and_disjointness():
    s = split_numbers()
    low, high = DEMO_RANGE
    assert (low, high) == (0, 9999)
    assert len(s.heldout) == len(s.valid) == 500 and len(s.train) == 9000
    train, valid, heldout = set(s.train), set(s.valid), set(s.heldout)
    assert not train & heldout, "held-out numbers must never be trained on"
    assert not train & valid and not valid & heldout
    assert train | valid | heldout == set(range(low, high + 1))
    assert s.train == sorted(s.train) and s.heldout == sorted(s.heldout)


def test_lexicon_numbers_are_always_trained_on():
    """0-20, the tens, 100 and 1000 carry words no other number teaches ("elf", "dreißig"): they
    are in training for every seed and never held out or used for validation."""
    from transformer_ext.data import DEMO_LEXICON

    for seed in (0, 1, 7):
        s = split_numbers(seed=seed)
        assert set(DEMO_LEXICON) <= set(s.train)
        assert not set(DEMO_LEXICON) & (set(s.valid) | set(s.heldout))
    with pytest.raises(ValueError, match="outside always_train"):
        split_numbers(0, 30, heldout_fraction=0.3, valid_fraction=0.3)


def test_split_is_deterministic_and_seeded():
    a, b = split_numbers(), split_numbers()
    assert a == b
    other = split_numbers(seed=1)
    assert other.heldout != a.heldout
    # the held-out set is a spread-out random sample, not a block of the range
    assert min(a.heldout) < 1000 and max(a.heldout) > 9000


def test_split_of_a_small_range():
    s = split_numbers(0, 99, heldout_fraction=0.1, valid_fraction=0.1)
    assert (len(s.train), len(s.valid), len(s.heldout)) == (80, 10, 10)
    assert not set(s.train) & set(s.heldout)


@pytest.mark.parametrize(
    "kwargs", [dict(low=5, high=4), dict(low=-1, high=4), dict(heldout_fraction=0.6, valid_fraction=0.5)]
)
def test_split_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        split_numbers(**kwargs)


def test_demo_splits_examples_match_the_split():
    train, valid, heldout = demo_splits(0, 199)
    s = split_numbers(0, 199)
    assert [e.number for e in heldout] == s.heldout and [e.number for e in train] == s.train
    assert all(e.target == num2words(e.number, lang="de") for e in heldout)


def test_collate_pads_and_shifts():
    pairs = [([5, 6, 7], [8, 9]), ([5], [8, 9, 10, 11])]
    b = collate(pairs, pad_id=PAD, bos_id=BOS, eos_id=EOS)
    assert b.src_ids.tolist() == [[5, 6, 7], [5, PAD, PAD]]
    assert b.src_lengths.tolist() == [3, 1]
    assert b.tgt_in.tolist() == [[BOS, 8, 9, PAD, PAD], [BOS, 8, 9, 10, 11]]
    assert b.tgt_out.tolist() == [[8, 9, EOS, PAD, PAD], [8, 9, 10, 11, EOS]]
    assert all(t.dtype == torch.int64 for t in (b.src_ids, b.src_lengths, b.tgt_in, b.tgt_out))
    assert b.n_target_tokens(PAD) == 3 + 5
    assert b.size == 2


def test_collate_rejects_empty():
    with pytest.raises(ValueError):
        collate([], pad_id=PAD, bos_id=BOS, eos_id=EOS)
    with pytest.raises(ValueError, match="empty source"):
        collate([([], [4])], pad_id=PAD, bos_id=BOS, eos_id=EOS)


LENGTHS = [example_cost(len(source_text(n)), len(target_text(n))) for n in range(0, 3000, 7)]


@pytest.mark.parametrize("max_tokens", [40, 300, 2000])
def test_token_batches_cover_every_example_within_budget(max_tokens):
    sampler = TokenBatchSampler(LENGTHS, max_tokens, seed=3)
    for epoch in range(2):
        batches = sampler.batches(epoch)
        flat = sorted(i for b in batches for i in b)
        assert flat == list(range(len(LENGTHS)))
        for b in batches:
            padded = len(b) * max(LENGTHS[i] for i in b)
            assert padded <= max_tokens or len(b) == 1
        assert len(batches) == len(sampler)


def _padding(batches):
    return sum(len(b) * max(LENGTHS[i] for i in b) - sum(LENGTHS[i] for i in b) for b in batches)


def test_token_batches_are_bucketed_by_length():
    batches = TokenBatchSampler(LENGTHS, 2000, seed=3).batches(0)
    # the same batch sizes over a random order: what batching without buckets would pad
    order = torch.randperm(len(LENGTHS), generator=torch.Generator().manual_seed(0)).tolist()
    unbucketed, start = [], 0
    for b in batches:
        unbucketed.append(order[start : start + len(b)])
        start += len(b)
    assert _padding(batches) < 0.25 * _padding(unbucketed)
    assert _padding(batches) / sum(LENGTHS) < 0.1


def test_token_batches_are_shuffled_per_epoch_with_a_seed():
    a = TokenBatchSampler(LENGTHS, 500, seed=3)
    b = TokenBatchSampler(LENGTHS, 500, seed=3)
    assert a.batches(0) == b.batches(0) and a.batches(5) == b.batches(5)
    assert a.batches(0) != a.batches(1)
    assert TokenBatchSampler(LENGTHS, 500, seed=4).batches(0) != a.batches(0)


def test_unshuffled_batches_are_sorted_and_fixed():
    s = TokenBatchSampler(LENGTHS, 500, shuffle=False)
    assert s.batches(0) == s.batches(1)
    order = [i for b in s.batches(0) for i in b]
    assert [LENGTHS[i] for i in order] == sorted(LENGTHS)


def test_max_batch_size():
    s = TokenBatchSampler(LENGTHS, 10**6, max_batch_size=16)
    assert max(len(b) for b in s.batches(0)) == 16


def test_sampler_rejects_bad_arguments():
    with pytest.raises(ValueError):
        TokenBatchSampler(LENGTHS, 0)
    with pytest.raises(ValueError):
        TokenBatchSampler([], 100)


def test_oversample_repeats_short_numbers_only():
    assert oversample([5, 50, 500, 5000], ((100, 4), (1000, 2))) == [5] * 4 + [50] * 4 + [500] * 2 + [5000]
    assert oversample([5, 5000], ()) == [5, 5000]
    train = split_numbers().train
    weighted = oversample(train)
    assert set(weighted) == set(train)  # reweights the training split, never adds a number
    short = [n for n in train if n < 100]
    assert short and all(weighted.count(n) == 20 for n in short[:5])
    assert weighted.count(train[-1]) == 1
