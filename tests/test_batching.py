"""Token batches and the lazy, in-order streaming of transformer_ext.batching, against plain
checks written here."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_ext.batching import token_batches, translate_iterable


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), max_size=60),
    max_tokens=st.integers(1, 120),
    max_size=st.one_of(st.none(), st.integers(1, 8)),
)
def test_token_batches_are_sorted_greedy_runs_within_the_budget(lengths, max_tokens, max_size):
    batches = token_batches(lengths, max_tokens, max_size)
    flat = [i for b in batches for i in b]
    assert flat == sorted(range(len(lengths)), key=lambda i: (lengths[i], i))  # shortest first, all once
    for k, b in enumerate(batches):
        cost = len(b) * max(max(1, lengths[i]) for i in b)
        assert len(b) == 1 or cost <= max_tokens
        assert max_size is None or len(b) <= max_size
        if k + 1 < len(batches):  # greedy: the next entry did not fit
            grown = b + [batches[k + 1][0]]
            too_big = len(grown) * max(max(1, lengths[i]) for i in grown) > max_tokens
            assert too_big or (max_size is not None and len(b) == max_size)


def test_token_batches_argument_errors():
    with pytest.raises(ValueError, match="max_batch_tokens must be a positive int, got 0"):
        token_batches([1, 2], 0)
    with pytest.raises(ValueError, match="max_batch_size must be a positive int"):
        token_batches([1, 2], 10, 0)


class Lines:
    """An input that records how many lines were read."""

    def __init__(self, lines):
        self.lines, self.read = lines, 0

    def __iter__(self):
        for line in self.lines:
            self.read += 1
            yield line


@pytest.mark.parametrize("window", [1, 3, 7, 100])
def test_translate_iterable_yields_in_input_order_lazily(window):
    words = [("x" * n) for n in [5, 1, 9, 3, 3, 0, 12, 2, 7, 4, 6, 8, 1]]
    calls = []

    def translate_batch(batch):
        calls.append(list(batch))
        return [w.upper() for w in batch]

    source = Lines(words)
    stream = translate_iterable(translate_batch, source, length=len, max_batch_tokens=12, window=window)
    first = next(stream)
    assert first == words[0].upper()
    assert source.read <= window  # the first result came before the rest was read
    rest = list(stream)
    assert [first] + rest == [w.upper() for w in words]
    for batch in calls:
        assert len(batch) == 1 or len(batch) * max(max(1, len(w)) for w in batch) <= 12


def test_translate_iterable_first_result_before_the_window_is_done():
    calls = []

    def translate_batch(batch):
        calls.append(list(batch))
        return list(batch)

    lines = ["a", "bbbbbbbb", "cccccccc", "dddddddd"]  # the short first line is batched first
    stream = translate_iterable(translate_batch, lines, length=len, max_batch_tokens=8, window=4)
    assert next(stream) == "a"
    assert len(calls) == 1  # one batch decoded so far out of four


def test_translate_iterable_rejects_a_string():
    with pytest.raises(TypeError, match="not one string"):
        list(translate_iterable(lambda b: b, "abc", length=len))


@pytest.mark.parametrize("window", [3, 5, 100])
def test_translate_iterable_decodes_the_batch_of_the_next_line_first(window):
    """Each batch decoded holds the first line (in input order) still without a result, so the
    first result comes after one batch however large the window."""
    words = [("x" * n) for n in [9, 1, 2, 8, 1, 7, 3, 9, 2, 1, 6]]
    done: set[int] = set()
    calls = []

    def translate_batch(batch):
        calls.append(list(batch))
        return list(batch)

    indexed = [f"{w}:{i}" for i, w in enumerate(words)]  # each line names its index
    stream = translate_iterable(
        translate_batch, indexed, length=lambda s: s.index(":"), max_batch_tokens=9, window=window
    )
    assert next(stream) == indexed[0] and len(calls) == 1
    rest = list(stream)
    assert [indexed[0]] + rest == indexed
    for batch in calls:
        ids = [int(s.split(":")[1]) for s in batch]
        start = min(ids) // window * window  # the batch's window
        pending = [i for i in range(start, min(start + window, len(words))) if i not in done]
        assert pending[0] in ids  # the first line of the window still without a result
        done.update(ids)
