"""Random sampling draws per source: a stream keyed by the seed and the source's index in the whole
input, so the same seed gives the same samples whatever the batching (the batch size, token
batches, the window of the command line, the order of the batches).

The oracle is tests/beam_reference.py's ``loop_sample`` (one source at a time, its own
``SeedSequence([seed, index])`` stream); the Translator and the command line are checked against
the search run on each source alone with its index."""

from __future__ import annotations

import io

import numpy as np
import pytest
from beam_reference import BOS, EOS, loop_sample
from helpers import FunctionRunner, masked_random_fn, shifted

from transformer_ext import decoding
from transformer_ext.decoding import greedy_decode
from transformer_ext.translate import Translator, main

V = 40
SEED = 7
SAMPLING = dict(sampling_topk=0, sampling_temperature=2.0, seed=SEED)


def _batch(keys):
    """Token ids of the sources ``keys`` (each source a row of its key, the function's source id)."""
    ids = np.array([[4 + k, 5 + k, 6 + k] for k in keys], dtype=np.int64)
    return ids, np.full(len(keys), 3, dtype=np.int64)


class _KeyedRunner(FunctionRunner):
    """A FunctionRunner whose logits follow the source's first id (not its row), so that a
    source gets the same logits in any batch."""

    def encode(self, input_ids, src_lengths, cache_len, beam_size=1):
        state = super().encode(input_ids, src_lengths, cache_len, beam_size)
        state["src"] = np.repeat(input_ids[:, 0] - 4, beam_size)
        return state


def _sample(keys, n, budget, source_index=None, fn=None):
    fn = fn or shifted(masked_random_fn(V, 3, 1.0, 0.1), 1.0)
    ids, lengths = _batch(keys)
    return greedy_decode(
        _KeyedRunner(V, fn),
        ids,
        lengths,
        bos_id=BOS,
        eos_id=EOS,
        max_decoding_length=np.array([budget[k] for k in keys]),
        num_hypotheses=n,
        return_scores=True,
        source_index=source_index,
        **SAMPLING,
    )


def _tokens(hyps):
    return [[h.tokens for h in row] for row in hyps]


def test_greedy_decode_samples_each_source_from_its_own_stream():
    budget = [9, 4, 12, 7, 10]
    keys = list(range(5))
    fn = shifted(masked_random_fn(V, 3, 1.0, 0.1), 1.0)
    batch = _tokens(_sample(keys, 2, budget, fn=fn))  # the default index: 0 .. B-1
    for k in keys:  # each source alone, with its index
        assert _tokens(_sample([k], 2, budget, source_index=[k], fn=fn)) == [batch[k]]
    part = _tokens(_sample([3, 1], 2, budget, source_index=[3, 1], fn=fn))
    assert part == [batch[3], batch[1]]

    # the oracle: one source at a time, stream SeedSequence([seed, index])
    def keyed(b, prefix):
        return fn([3, 1][b], prefix)

    rows = loop_sample(
        keyed, 2, 2, np.array([budget[3], budget[1]]), np.zeros(2), {}, 0, 1.0, 2.0, SEED, [3, 1]
    )
    for b in range(2):
        assert sorted(part[b]) == sorted(r["gen"] for r in rows[2 * b : 2 * b + 2])
    # the index picks the stream: source 0's logits drawn with index 1's stream differ
    assert _tokens(_sample([0], 2, budget, source_index=[1], fn=fn)) != [batch[0]]


@pytest.fixture(scope="module")
def demo():
    return Translator.from_model_dir(None)


SOURCES = [
    "three hundred and forty-two",
    "seven",
    "one thousand and one",
    "forty-two",
    "nine thousand, nine hundred and ninety-nine",
    "twelve",
    "six hundred",
]


def _samples(translations):
    """Each source's sampled token lists, sorted (two samples of near-equal scores may rank
    either way when the runner's rounding differs with the batch's row count)."""
    return [sorted(h.tokens for h in t.hypotheses) for t in translations]


def test_translator_samples_do_not_depend_on_the_batching(demo):
    """translate(S, sampling_topk=0, seed=7, n_best=2) gives the same samples at every batch size
    and in token batches, and each source's are those of the search on it alone with its index."""
    options = dict(beam_size=1, num_hypotheses=2, **SAMPLING)
    base = _samples(demo.translate(SOURCES, **options))
    for batch_size in (1, 2, 3):
        assert _samples(demo.translate(SOURCES, batch_size=batch_size, **options)) == base, batch_size
    for max_batch_tokens, window in ((16, 8192), (4096, 1), (40, 3)):
        stream = demo.translate_iterable(SOURCES, max_batch_tokens=max_batch_tokens, window=window, **options)
        assert _samples(stream) == base, (max_batch_tokens, window)
    for i, text in enumerate(SOURCES):  # the oracle: the search on the source alone, index i
        ids = np.array([demo.encode([text])[0]], dtype=np.int64)
        lengths = np.array([ids.shape[1]], dtype=np.int64)
        alone = decoding.generate(
            demo.runner,
            ids,
            lengths,
            bos_id=demo.bos_id,
            eos_id=demo.eos_id,
            max_decoding_length=demo.max_decoding_length(lengths, 1.5, 10),
            num_hypotheses=2,
            source_index=[i],
            **SAMPLING,
        )
        assert sorted(h.tokens for h in alone[0]) == base[i], i
    assert len({tuple(map(tuple, s)) for s in base}) > 1  # sampling did draw different tokens


def test_cli_samples_do_not_depend_on_batch_size_tokens_or_window():
    def run(*extra):
        """Each source's sampled texts (``index<TAB>score<TAB>text`` lines), sorted per source."""
        stdout = io.StringIO()
        args = ["--sampling-topk", "0", "--sampling-temperature", "2.0", "--seed", "7", "--n-best", "2"]
        assert main(args + list(extra) + SOURCES, stdout=stdout) == 0
        texts: dict[int, list[str]] = {}
        for line in stdout.getvalue().splitlines():
            index, _, text = line.split("\t")
            texts.setdefault(int(index), []).append(text)
        return [sorted(texts[i]) for i in sorted(texts)]

    base = run()
    assert len(base) == len(SOURCES) and all(len(t) == 2 for t in base)
    for extra in (
        ["--batch-size", "1"],
        ["--batch-size", "2"],
        ["--max-batch-tokens", "16"],
        ["--window", "1"],
    ):
        assert run(*extra) == base, extra
    assert run("--window", "3", "--max-batch-tokens", "40") == base
