"""The Translator's options are one SearchOptions, layered with dataclasses.replace: the package's
defaults (with the translator's budget rule), the folder's generation config, the translator's
own options, then the call's. The SearchOptions names and the older ones decode alike."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from transformer_ext.decoding import SearchOptions
from transformer_ext.export_format import GenerationConfig
from transformer_ext.translate import TranslationError, Translator

SOURCES = ["three hundred and forty-two", "forty-two", "one thousand and one", "seven"]


@pytest.fixture(scope="module")
def demo():
    return Translator.from_model_dir(None)


def _tokens(translations):
    return [[h.tokens for h in t.hypotheses] for t in translations]


def test_the_defaults_are_the_package_defaults_with_the_translators_budget(demo):
    limit = demo.info.generation_limit
    assert demo.search_defaults == SearchOptions(max_len_a=1.5, max_len_b=10.0, max_decoding_length=limit)
    built = Translator(demo.tokenizer, demo.runner, beam_size=3, num_hypotheses=2, length_penalty_type="none")
    assert built.search_defaults == dataclasses.replace(
        demo.search_defaults, beam_size=3, num_hypotheses=2, length_penalty_type="none"
    )
    search, settings = built.search_options(beam_size=2)  # the call's over the translator's
    assert (search.beam_size, search.num_hypotheses, search.length_penalty_type) == (2, 2, "none")
    with pytest.raises(TranslationError, match=r"num_hypotheses \(2\) cannot exceed the beam size \(1\)"):
        built.search_options(beam_size=1)  # the translator's num_hypotheses was given: it stays
    assert settings.batch_size is None and not settings.strict


def test_a_generation_config_is_the_folder_layer(demo):
    config = SimpleNamespace(
        beam_size=3,
        length_penalty="average",
        alpha=1.0,
        max_len_a=0.0,
        max_len_b=6.0,
        min_new_tokens=2,
        max_new_tokens=4,
        special_tokens={"pad": 0, "bos": 1, "eos": 2},
    )
    configured = Translator(demo.tokenizer, demo.runner, generation=config, beam_size=2)
    folder = GenerationConfig(**vars(config)).to_search_options(demo.search_defaults)
    assert configured.search_defaults == dataclasses.replace(folder, beam_size=2)  # the translator's over it


@pytest.mark.parametrize(
    "old, new",
    [
        (dict(beam_size=4, n_best=3), dict(beam_size=4, num_hypotheses=3)),
        (
            dict(beam_size=4, length_penalty="average", alpha=1.2),
            dict(beam_size=4, length_penalty_type="average", length_penalty=1.2),
        ),
        (dict(min_length=14, max_length=20), dict(min_decoding_length=14, max_decoding_length=20)),
        (dict(sampling_topk=0, seed=3, n_best=2), dict(sampling_topk=0, seed=3, num_hypotheses=2)),
    ],
)
def test_the_older_names_decode_as_the_search_options_names(demo, old, new):
    assert demo.search_options(**old)[0] == demo.search_options(**new)[0]
    assert _tokens(demo.translate(SOURCES, **old)) == _tokens(demo.translate(SOURCES, **new))


def test_one_option_given_under_two_names_is_an_error_naming_both(demo):
    with pytest.raises(TranslationError, match="n_best and num_hypotheses are one option"):
        demo.translate(["one"], beam_size=2, n_best=2, num_hypotheses=2)
    with pytest.raises(TranslationError, match="alpha and length_penalty are one option"):
        demo.translate(["one"], alpha=1.0, length_penalty=1.0)


def test_sampling_without_a_beam_samples_with_beam_1_over_a_folders_beam(demo):
    beam = Translator(demo.tokenizer, demo.runner, generation=_config(beam_size=4))
    assert beam.search_defaults.beam_size == 4
    search, _ = beam.search_options(sampling_topk=0, seed=1)
    assert search.beam_size == 1
    with pytest.raises(TranslationError, match="needs beam size 1, got 4"):
        beam.search_options(sampling_topk=0, beam_size=4)


def test_a_formula_other_than_hf_drops_the_folders_early_stopping(demo):
    hf = Translator(
        demo.tokenizer,
        demo.runner,
        beam_size=3,
        length_penalty_type="hf",
        length_penalty=-1.0,
        early_stopping=True,
    )
    assert hf.search_defaults.early_stopping is True
    # given to the translator, early_stopping is explicit: another formula with it is an error
    with pytest.raises(TranslationError, match="early_stopping is transformers' beam-search rule"):
        hf.search_options(length_penalty_type="gnmt", length_penalty=0.6)
    folder = Translator(demo.tokenizer, demo.runner, generation=_config(beam_size=3))
    layered = dataclasses.replace(folder.search_defaults, length_penalty_type="hf", early_stopping=True)
    folder.search_defaults = layered  # as an imported model's defaults set it
    search, _ = folder.search_options(length_penalty_type="gnmt")
    assert search.early_stopping is None


def _config(**values):
    base = dict(
        beam_size=1,
        length_penalty="gnmt",
        alpha=0.6,
        max_len_a=1.5,
        max_len_b=10.0,
        min_new_tokens=0,
        max_new_tokens=40,
        special_tokens={"pad": 0, "bos": 1, "eos": 2},
    )
    return GenerationConfig(**{**base, **values})
