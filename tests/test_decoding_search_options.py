"""SearchOptions: one record of every search option, its defaults, metadata and checks."""

from __future__ import annotations

import dataclasses
import math

import pytest
from helpers import FunctionRunner, masked_random_fn, sources

from transformer_ext import decoding
from transformer_ext.decoding import SearchOptions, generate

CTRANSLATE2_NAMES = (
    "beam_size",
    "num_hypotheses",
    "length_penalty",
    "max_decoding_length",
    "min_decoding_length",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "sampling_topk",
    "sampling_temperature",
    "seed",
    "return_scores",
)


def test_every_field_has_a_default_help_range_and_check():
    opts = SearchOptions()
    assert set(CTRANSLATE2_NAMES) <= set(SearchOptions.names())
    for f in dataclasses.fields(SearchOptions):
        assert f.default is not dataclasses.MISSING, f.name
        assert isinstance(f.metadata["help"], str) and f.metadata["help"], f.name
        assert isinstance(f.metadata["range"], str) and f.metadata["range"], f.name
        assert f.metadata["check"](getattr(opts, f.name)) is None, f.name  # the default is valid
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.beam_size = 2  # type: ignore[misc]


def test_package_stays_torch_free():
    import subprocess
    import sys

    code = "import sys, transformer_ext.decoding; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("beam_size", 0),
        ("beam_size", 2.0),
        ("beam_size", True),
        ("num_hypotheses", 0),
        ("length_penalty", math.nan),
        ("length_penalty", math.inf),
        ("length_penalty", "0.6"),
        ("length_penalty_type", "wu"),
        ("early_stopping", "sometimes"),
        ("renormalize_logits", 1),
        ("max_decoding_length", 0),
        ("max_len_a", -1.0),
        ("max_len_b", math.nan),
        ("min_decoding_length", -1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("no_repeat_ngram_size", -1),
        ("banned_ids", (1, -2)),
        ("banned_ids", "12"),
        ("force_eos_at_budget", "yes"),
        ("sampling_topk", -1),
        ("sampling_topp", 0.0),
        ("sampling_topp", 1.5),
        ("sampling_temperature", 0.0),
        ("seed", -1),
        ("seed", 1.5),
        ("return_scores", None),
        ("return_attention", "no"),
    ],
)
def test_a_value_out_of_range_is_a_value_error_naming_the_field(name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        SearchOptions(**{name: value})
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        dataclasses.replace(SearchOptions(), **{name: value})


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (dict(beam_size=2, num_hypotheses=3), "num_hypotheses"),
        (dict(beam_size=2, sampling_topk=0), "sampling_topk"),
        (dict(beam_size=2, seed=1), "seed"),
        (dict(sampling_temperature=0.5), "sampling_temperature"),
        (dict(sampling_topp=0.5), "sampling_topp"),
        (dict(num_hypotheses=2), "num_hypotheses"),
        (dict(length_penalty=-1.0), "length_penalty"),
        (dict(early_stopping=True), "early_stopping"),
        (dict(renormalize_logits=True), "renormalize_logits"),
    ],
)
def test_combinations_that_do_not_apply_are_refused(options, named):
    with pytest.raises(ValueError, match=named):
        SearchOptions(**options)


def test_valid_combinations():
    SearchOptions(
        beam_size=4, num_hypotheses=4, length_penalty=-0.5, length_penalty_type="hf", early_stopping="never"
    )
    SearchOptions(sampling_topk=0, sampling_topp=0.9, sampling_temperature=0.7, seed=3, num_hypotheses=5)
    assert SearchOptions(banned_ids=[3, 4]).banned_ids == (3, 4)  # a list is kept as a tuple


def test_from_mapping_layers_and_names_unknown_options():
    base = SearchOptions(beam_size=4)
    assert SearchOptions.from_mapping({"num_hypotheses": 2}, base) == SearchOptions(
        beam_size=4, num_hypotheses=2
    )
    with pytest.raises(ValueError, match="unknown search option.*num_beams"):
        SearchOptions.from_mapping({"num_beams": 2})


def test_budget():
    assert SearchOptions(max_decoding_length=9).budget([1, 20]).tolist() == [9, 9]
    assert SearchOptions(max_len_a=1.5, max_len_b=2, max_decoding_length=20).budget([1, 4, 30]).tolist() == [
        3,
        8,
        20,
    ]
    # floor(a * n + b) at least 1
    assert SearchOptions(max_len_a=0.1).budget([2]).tolist() == [1]


@pytest.mark.parametrize(
    "options",
    [
        SearchOptions(),
        SearchOptions(beam_size=3, num_hypotheses=2, length_penalty=1.0, length_penalty_type="average"),
        SearchOptions(beam_size=2, length_penalty_type="hf", length_penalty=1.2, early_stopping=True),
        SearchOptions(sampling_topk=0, seed=5, num_hypotheses=2, repetition_penalty=1.3),
        SearchOptions(
            no_repeat_ngram_size=2, banned_ids=(4,), min_decoding_length=2, force_eos_at_budget=True
        ),
    ],
)
def test_generate_kwargs_are_the_searches_arguments(options):
    """The options give the keyword arguments of generate() spelled as its parameters."""
    V = 9
    src, lengths = sources(3, 4)
    got = generate(
        FunctionRunner(V, masked_random_fn(V, 3, 2.0, 0.0)),
        src,
        lengths,
        bos_id=1,
        eos_id=2,
        max_decoding_length=6,
        **options.generate_kwargs(),
    )
    kw = options.generate_kwargs()
    want = generate(
        FunctionRunner(V, masked_random_fn(V, 3, 2.0, 0.0)),
        src,
        lengths,
        bos_id=1,
        eos_id=2,
        max_decoding_length=6,
        beam_size=options.beam_size,
        num_hypotheses=options.num_hypotheses,
        length_penalty_type=options.length_penalty_type,
        length_penalty=options.length_penalty,
        early_stopping=options.early_stopping,
        sampling_topk=options.sampling_topk,
        seed=options.seed,
        repetition_penalty=options.repetition_penalty,
        no_repeat_ngram_size=options.no_repeat_ngram_size,
        banned_ids=list(options.banned_ids),
        min_decoding_length=options.min_decoding_length,
        force_eos_at_budget=options.force_eos_at_budget,
    )
    assert (
        kw["length_penalty_type"] == options.length_penalty_type
        and kw["length_penalty"] == options.length_penalty
    )
    assert got == want
    assert decoding.SearchOptions is SearchOptions
