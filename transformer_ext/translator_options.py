"""How a :class:`~transformer_ext.translator.Translator` layers its options.

Every search option is a field of :class:`transformer_ext.decoding.SearchOptions`. A translator
starts from the package's defaults (with its own budget rule: ``max_len_a`` 1.5, ``max_len_b`` 10,
at most what the runner holds), lays over them the folder's values (an export folder's
generation config, :meth:`transformer_ext.export_format.GenerationConfig.to_search_options`;
then an imported model's generation defaults,
:meth:`transformer_ext.convert.GenerationDefaults.to_search_options`), then the options it was
built with, then a call's, each with ``dataclasses.replace`` (which checks the record again).

Besides the fields, a call takes the translator's own settings (:data:`SETTINGS`) and the older
spellings of :data:`ALIASES` (``n_best``, ``alpha``, ``min_length``, ``max_length``, and
``length_penalty`` given as a formula name), each with one ``FutureWarning`` per process naming
its new name (:func:`warn_renamed`); an older and a newer name of one option in one call are a
ValueError naming both. Three rules are the layering's own, since a record
does not know which of its values a user gave: random sampling asked for without a beam size
samples with beam size 1 (a folder's ``num_beams`` is the default of beam search only); a
``num_hypotheses`` not given is the folder's, at most the beam size; a length-penalty formula
other than transformers' drops the folder's ``early_stopping`` and ``renormalize_logits``, which
apply to that formula only.

This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping, Optional

from .decoding import SearchOptions

__all__ = [
    "ALIASES",
    "SETTINGS",
    "OPTION_NAMES",
    "TranslatorSettings",
    "OptionLayers",
    "OptionError",
    "lay_over",
]

# the older spelling of an option -> its SearchOptions field
ALIASES = {
    "n_best": "num_hypotheses",
    "alpha": "length_penalty",
    "min_length": "min_decoding_length",
    "max_length": "max_decoding_length",
}
LONG_LINES = ("error", "truncate")
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_WARNED: set[str] = set()  # the older spellings warned about in this process


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of a warning that points at the first caller outside this package."""
    level, frame = 2, sys._getframe(2)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        level, frame = level + 1, frame.f_back
    return level


def warn_renamed(old: str, field: str, value: Any) -> None:
    """One ``FutureWarning`` per process for the older option name ``old`` of ``field`` (the
    second and later uses are silent), pointing at the caller's line."""
    key = "length_penalty NAME" if old == field or old == "length_penalty" else old
    if key in _WARNED:
        return
    _WARNED.add(key)
    if key == "length_penalty NAME":
        text = f"length_penalty={value!r} (a formula's name) is deprecated; use length_penalty_type={value!r}"
    else:
        text = f"{old} is deprecated; use {field}"
    warnings.warn(text, FutureWarning, stacklevel=_caller_stacklevel())


@dataclass(frozen=True)
class TranslatorSettings:
    """What a translator decides beside the search: the sources decoded together
    (``batch_size``; None: 64 for :meth:`translate`, no cap besides ``max_batch_tokens`` for
    :meth:`translate_iterable`), empty sources and unknown characters (``strict``) and sources
    longer than the model's positions (``long_lines``)."""

    batch_size: Optional[int] = None
    strict: bool = False
    long_lines: str = "error"


SETTINGS = tuple(f.name for f in fields(TranslatorSettings))
OPTION_NAMES = SearchOptions.names() + SETTINGS + tuple(ALIASES)

# How a translator words a value out of range, where its messages always said it so (the
# check itself is the field's, SearchOptions.<field>.metadata["check"]).
_WORDING = {
    "beam_size": "a positive integer",
    "num_hypotheses": "a positive integer",
    "repetition_penalty": "> 0 (1 = no penalty)",
    "sampling_topp": "in (0, 1]",
    "sampling_temperature": "> 0",
    "sampling_topk": "an int >= 0 (1 = greedy, 0 = the whole vocabulary)",
}
_FIELDS = {f.name: f for f in fields(SearchOptions)}


class OptionError(ValueError):
    """A bad option (the translator raises it as its TranslationError)."""


class OptionLayers:
    """One layer of options as a caller gave them: ``values`` holds the SearchOptions fields
    (older spellings mapped), ``settings`` the translator's own, ``spelled`` how the caller
    named each field (for messages). A value of None is an option not given."""

    def __init__(self, options: Mapping[str, Any]):
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise TypeError(f"unknown generation option(s) {unknown}; the options are {list(OPTION_NAMES)}")
        self.values: dict[str, Any] = {}
        self.settings: dict[str, Any] = {}
        self.spelled: dict[str, str] = {"beam_size": "beam size"}
        for name, value in options.items():
            if value is None:
                continue
            if name in SETTINGS:
                self.settings[name] = value
                continue
            field = ALIASES.get(name, name)
            if name == "length_penalty" and isinstance(value, str):
                field = "length_penalty_type"  # the formula, as length_penalty="hf" always named it
            if field == "banned_ids" and isinstance(value, list):
                value = tuple(value)  # as SearchOptions keeps it
            if field in self.values:
                raise OptionError(f"{self.spelled[field]} and {name} are one option: give one of them")
            self.values[field] = value
            self.spelled[field] = name if field != "beam_size" else "beam size"
        for field, name in self.spelled.items():
            if name in ALIASES or (name == "length_penalty" and field == "length_penalty_type"):
                warn_renamed(name, field, self.values[field])

    def name(self, field: str) -> str:
        return self.spelled.get(field, field)

    def check_values(self, under: SearchOptions) -> None:
        """Each given value within its field's range (the field's own check), in the caller's words."""
        for field, value in self.values.items():
            expected = _FIELDS[field].metadata["check"](value)
            if expected is None:
                continue
            if field == "length_penalty":
                hf = self.values.get("length_penalty_type", under.length_penalty_type) == "hf"
                expected = "a finite number" if hf else "a finite number >= 0"
            else:
                expected = _WORDING.get(field, expected)
            raise OptionError(f"{self.name(field)} must be {expected}, got {value!r}")


def lay_over(
    under: SearchOptions, layer: OptionLayers, explicit: frozenset[str] = frozenset()
) -> SearchOptions:
    """``layer``'s values laid over ``under`` with ``dataclasses.replace``, with the layering's
    three rules (the module docstring); ``explicit``: the fields earlier layers of the caller
    (the translator's own options) gave. An :class:`OptionError` in the caller's words."""
    layer.check_values(under)
    values = dict(layer.values)
    given = explicit | frozenset(values)
    sampling = any(
        values.get(name, default) != default
        for name, default in (("sampling_topk", 1), ("sampling_topp", 1.0), ("sampling_temperature", 1.0))
    )
    if sampling and "beam_size" not in given:
        values["beam_size"] = 1  # the folder's num_beams is the default of beam search only
    if "num_hypotheses" not in given:  # the folder's num_return_sequences, within the beam
        values["num_hypotheses"] = min(under.num_hypotheses, values.get("beam_size", under.beam_size))
    if values.get("length_penalty_type", under.length_penalty_type) != "hf":
        for name, off in (("early_stopping", None), ("renormalize_logits", False)):
            if name not in given:
                values[name] = off
    try:
        return replace(under, **values)
    except ValueError as exc:
        raise OptionError(_in_caller_words(str(exc), layer)) from None


def _in_caller_words(message: str, layer: OptionLayers) -> str:
    """A SearchOptions message with the field it starts with spelled as the caller spelled it."""
    for field in sorted(_FIELDS, key=len, reverse=True):
        if message.startswith(field):
            return layer.name(field) + message[len(field) :]
    return message


def settings_over(under: TranslatorSettings, layer: OptionLayers) -> TranslatorSettings:
    """``layer``'s settings over ``under``, checked (an :class:`OptionError` naming the setting)."""
    values = layer.settings
    size = values.get("batch_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise OptionError(f"batch_size must be a positive integer, got {size!r}")
    strict = values.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise OptionError(f"strict must be True or False, got {strict!r}")
    long_lines = values.get("long_lines")
    if long_lines is not None and long_lines not in LONG_LINES:
        raise OptionError(f"long_lines must be one of {LONG_LINES}, got {long_lines!r}")
    return dataclasses.replace(under, **values)


def settings_view(options: SearchOptions, settings: TranslatorSettings, batch_size: int) -> dict:
    """A call's resolved options as one dictionary (what :meth:`Translator.resolve_options`
    returns): the SearchOptions fields under their names, the budget as ``a * n + b`` (``max_len_a`` 0 and ``max_len_b`` the budget when it is one number for every
    source), ``sampling`` (the sampling options, or None) and the settings."""
    view = dataclasses.asdict(options)
    one_budget = options.max_len_a == 0.0 and options.max_len_b == 0.0
    sampling = None
    if options.sampling:
        sampling = {k: view[k] for k in ("sampling_topk", "sampling_topp", "sampling_temperature", "seed")}
    view.update(
        max_len_b=float(options.max_decoding_length) if one_budget else options.max_len_b,
        sampling=sampling,
        search=dict(
            decoder_start_id=None,
            banned_ids=list(options.banned_ids),
            repetition_penalty=options.repetition_penalty,
            no_repeat_ngram_size=options.no_repeat_ngram_size,
            force_eos_at_budget=options.force_eos_at_budget,
        ),
        batch_size=batch_size,
        strict=settings.strict,
        long_lines=settings.long_lines,
    )
    return view
