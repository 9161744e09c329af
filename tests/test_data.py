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
    assert make_examples([42, 7]) == [
        Example(42, "forty-two", "zweiundvierzig"),
        Example(7, "seven", "sieben"),
    ]
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


# ---------------------------------------------------------------------- parallel text
from transformer_ext.data import DataError, ParallelIds, encode_parallel, read_lines, read_parallel, read_tsv  # noqa: E402
from transformer_ext.tokenizer import CharTokenizer  # noqa: E402


def test_parallel_ids_hold_every_pair_once():
    pairs = [([5, 6, 7], [8]), ([9], [10, 11, 12, 13]), ([4, 4], [5, 5])]
    corpus = ParallelIds.from_pairs(pairs)
    assert len(corpus) == 3
    assert [(s.tolist(), t.tolist()) for s, t in (corpus[i] for i in range(3))] == pairs
    assert corpus.src_ids.tolist() == [5, 6, 7, 9, 4, 4] and corpus.tgt_ids.tolist() == [
        8,
        10,
        11,
        12,
        13,
        5,
        5,
    ]
    assert corpus.costs == [max(len(s), len(t) + 1) for s, t in pairs]
    assert corpus.n_target_tokens() == sum(len(t) + 1 for _, t in pairs)
    batch = collate([corpus[0], corpus[1]], pad_id=0, bos_id=1, eos_id=2)
    assert batch.tgt_out[1].tolist() == [10, 11, 12, 13, 2] and batch.src_ids[1].tolist() == [9, 0, 0]


def test_encode_parallel_filters_and_counts():
    tok = CharTokenizer.build(["abcdefgh"], ["abcdefgh"])
    sources = ["abc", "", "abcdefgh", "a", "ab", "  "]
    targets = ["ab", "abc", "ab", "abcdef", "ba", "cd"]
    corpus, report = encode_parallel(tok, sources, targets, max_len=6, max_len_ratio=2.0)
    # empty: lines 1 and 5; too long: "abcdefgh" (8 > 6) and "abcdef" (6 + 1 > 6); ratio: none left
    assert (report.total, report.empty, report.too_long, report.ratio, report.kept) == (6, 2, 2, 0, 2)
    assert report.kept_index == [0, 4]
    assert [tok.decode_source(corpus[i][0].tolist()) for i in range(2)] == ["abc", "ab"]
    _, report = encode_parallel(tok, ["a", "abcd"], ["abcd", "abcd"], max_len=10, max_len_ratio=3.0)
    assert (report.ratio, report.kept) == (1, 1)
    assert (
        "2 pairs read: 0 removed as empty, 0 as longer than max_len, 1 by the length ratio; 1 kept"
        == report.describe()
    )


def test_read_lines_utf8_crlf_bom(tmp_path):
    p = tmp_path / "a.txt"
    p.write_bytes("\ufeffeins\r\nzwei\r\n\r\ndrei".encode("utf-8"))
    assert read_lines(p) == ["eins", "zwei", "", "drei"]
    p.write_bytes(b"ok\nok\nbad \xc3\x28 line\n")
    with pytest.raises(DataError, match=r"a.txt, line 3: not UTF-8 text \(byte 0xc3\)"):
        read_lines(p)


def test_read_parallel_line_counts_named(tmp_path):
    a, b = tmp_path / "x.en", tmp_path / "x.de"
    a.write_text("one\ntwo\nthree\n")
    b.write_text("eins\nzwei\n")
    with pytest.raises(DataError, match=f"{a} has 3 lines but {b} has 2"):
        read_parallel(a, b)
    with pytest.raises(DataError, match="no such file"):
        read_parallel(a, tmp_path / "missing")


def test_read_tsv(tmp_path):
    p = tmp_path / "x.tsv"
    p.write_text("one\teins\n\ntwo\tzwei\n")
    assert read_tsv(p) == (["one", "", "two"], ["eins", "", "zwei"])
    p.write_text("one\teins\ntwo zwei\n")
    with pytest.raises(DataError, match="line 2: expected source<TAB>target"):
        read_tsv(p)


def test_corpus_sampler_is_deterministic_and_bucketed():
    lengths = [(i * 7919) % 50 + 1 for i in range(500)]
    corpus = ParallelIds.from_pairs([([4] * n, [5] * n) for n in lengths])
    a = TokenBatchSampler(corpus.costs, 300, seed=3)
    b = TokenBatchSampler(corpus.costs, 300, seed=3)
    assert a.batches(2) == b.batches(2) and a.batches(1) != a.batches(2)
    assert sorted(i for batch in a.batches(0) for i in batch) == list(range(500))
    ranges = []
    for batch in a.batches(0):
        costs = [corpus.costs[i] for i in batch]
        assert len(batch) * max(costs) <= 300 or len(batch) == 1
        ranges.append((min(costs), max(costs)))
    ranges.sort()
    # length bucketing: the batches cut the sorted lengths into consecutive ranges (they overlap at most at an edge)
    assert all(hi <= next_lo for (_, hi), (next_lo, _) in zip(ranges, ranges[1:]))


def test_training_text_with_tabs_puts_no_tab_in_the_vocabulary(tmp_path):
    from transformer_ext.tokenizer import CharTokenizer

    a, b, tsv = tmp_path / "x.en", tmp_path / "x.de", tmp_path / "x.tsv"
    a.write_bytes(b"forty\ttwo\n  one \t\n")
    b.write_bytes(b"zwei\tund\tvierzig\neins\n")
    tsv.write_bytes(b"forty  two\tzwei\xc2\xa0und\n")
    sources, targets = read_parallel(a, b)
    # the rule the translator applies to its sources: every whitespace run one space, none at the ends
    assert sources == ["forty two", "one"] and targets == ["zwei und vierzig", "eins"]
    assert read_tsv(tsv) == (["forty two"], ["zwei und"])
    tok = CharTokenizer.build(sources, targets)
    assert "\t" not in tok.source_vocab and "\t" not in tok.target_vocab
