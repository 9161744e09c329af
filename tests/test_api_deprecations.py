"""The Translator's older option names (n_best, alpha, min_length, max_length, and length_penalty
given as a formula's name): each works as its SearchOptions name with one FutureWarning per process
naming the new name, pointing at the caller's line; an old and a new name of one option in one call
are a ValueError naming both."""

from __future__ import annotations

import warnings

import pytest

from transformer_ext import translator_options
from transformer_ext.translate import TranslationError, Translator

SOURCES = ["forty-two", "seven thousand and seventeen"]
RENAMED = [
    ("n_best", "num_hypotheses", dict(beam_size=3), 2),
    ("alpha", "length_penalty", dict(beam_size=3), 1.5),
    ("min_length", "min_decoding_length", {}, 12),
    ("max_length", "max_decoding_length", {}, 4),
    ("length_penalty", "length_penalty_type", dict(beam_size=3), "average"),
]


@pytest.fixture(scope="module")
def demo():
    return Translator.from_model_dir(None)


@pytest.fixture
def fresh(monkeypatch):
    """A process in which no older name has warned yet."""
    monkeypatch.setattr(translator_options, "_WARNED", set())


def _tokens(translations):
    return [[list(h.tokens) for h in t.hypotheses] for t in translations]


def _call(method, demo, **options):
    if method == "translate":
        return _tokens(demo.translate_detailed(SOURCES, **options))
    if method == "resolve_options":
        return demo.resolve_options(**options)
    return [s.log_prob for s in demo.score(SOURCES, ["zweiundvierzig", "siebentausendsiebzehn"], **options)]


@pytest.mark.parametrize("old, new, base, value", RENAMED, ids=[r[0] for r in RENAMED])
@pytest.mark.parametrize("method", ["translate", "resolve_options", "score"])
def test_an_old_name_works_as_the_new_one_with_one_warning(demo, fresh, old, new, base, value, method):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = _call(method, demo, **base, **{old: value})
        again = _call(method, demo, **base, **{old: value})  # the second use is silent
        want = _call(method, demo, **base, **{new: value})
    assert got == again == want
    renamed = [w for w in seen if issubclass(w.category, FutureWarning)]
    assert len(renamed) == 1, [str(w.message) for w in seen]
    message = str(renamed[0].message)
    assert "\n" not in message and old in message and f"use {new}" in message
    assert renamed[0].filename == __file__  # the caller's line, not the package's


def test_translate_iterable_and_the_constructor_warn_too(fresh):
    with pytest.warns(FutureWarning, match="n_best is deprecated; use num_hypotheses"):
        translator = Translator.from_model_dir(None, beam_size=2, n_best=2)
    assert translator.search_defaults.num_hypotheses == 2
    with pytest.warns(FutureWarning, match="max_length is deprecated; use max_decoding_length"):
        out = list(translator.translate_iterable(iter(SOURCES), max_length=3, num_hypotheses=1))
    assert len(out) == len(SOURCES)


def test_the_new_names_do_not_warn(demo, fresh):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        demo.translate(
            SOURCES,
            beam_size=3,
            num_hypotheses=2,
            length_penalty=1.0,
            length_penalty_type="average",
            min_decoding_length=1,
            max_decoding_length=20,
        )


@pytest.mark.parametrize(
    "options, names",
    [
        (dict(beam_size=3, n_best=2, num_hypotheses=2), ("n_best", "num_hypotheses")),
        (dict(alpha=1.0, length_penalty=1.0), ("alpha", "length_penalty")),
        (dict(min_length=2, min_decoding_length=2), ("min_length", "min_decoding_length")),
        (dict(max_decoding_length=5, max_length=5), ("max_decoding_length", "max_length")),
        (dict(length_penalty="hf", length_penalty_type="hf"), ("length_penalty", "length_penalty_type")),
    ],
)
def test_an_old_and_a_new_name_together_are_a_value_error_naming_both(demo, fresh, options, names):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for method in ("translate", "resolve_options", "score"):
            with pytest.raises(ValueError) as exc:
                _call(method, demo, **options)
            assert isinstance(exc.value, TranslationError)
            assert all(name in str(exc.value) for name in names), str(exc.value)
