"""Command-line flags generated from :class:`transformer_ext.decoding.SearchOptions`.

Every command that decodes (``translate``, ``evaluate``, ``export.quantize``'s quality gate)
declares which fields it takes as a spec, a tuple of ``(field, old spellings, metavar)``, and
:func:`add_decoding_flags` makes one flag per field: the field's name with dashes (CTranslate2's
``translate_batch`` names), with the field's help text and range. :func:`check_decoding_flags`
checks the values given with the field's own check before anything is loaded, so each command
words a value out of range the same way (``--beam-size must be >= 1, got 0``), and
:func:`decoding_values` gives the values under their field names (None: not given).

Older spellings are accepted with a one-line deprecation warning (:func:`transformer_ext.cli.add_option`);
an old and a new spelling of one option in one command line are a usage error naming both.
``--length-penalty`` takes the exponent (CTranslate2's ``length_penalty``); given one of the
formulas' names it is the deprecated spelling of ``--length-penalty-type NAME``, and ``--alpha``
that of ``--length-penalty``.

This module imports no torch.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from typing import Any, Mapping, Optional, Sequence

from .cli import add_option, spelling_given
from .decoding import LENGTH_PENALTIES, SearchOptions, expected_value

__all__ = [
    "FlagSpec",
    "EARLY_STOPPING_CHOICES",
    "add_decoding_flags",
    "check_decoding_flags",
    "decoding_values",
    "flag_of",
    "given_flag",
]

# One generated flag: (SearchOptions field, old spellings, metavar or None).
FlagSpec = Sequence[tuple[str, tuple[str, ...], Optional[str]]]
FIELDS = {f.name: f for f in fields(SearchOptions)}
EARLY_STOPPING_CHOICES = {"true": True, "false": False, "never": "never"}
_NOT_RANGED = ("return_scores", "early_stopping", "length_penalty_type")  # choices or flags


def flag_of(name: str) -> str:
    """The flag of field ``name``: ``beam_size`` -> ``--beam-size``."""
    return "--" + name.replace("_", "-")


def given_flag(args: argparse.Namespace, name: str) -> str:
    """The spelling the command line gave for the option of field ``name`` (else the new one)."""
    penalty = vars(args).get("_length_penalty_spellings", {}).get(name)
    if penalty is not None:
        return penalty.split()[0]  # "--length-penalty NAME": --length-penalty
    return spelling_given(args, name) or flag_of(name)


def _help(name: str, source: str, shown: Mapping[str, str]) -> str:
    meta = FIELDS[name].metadata
    default = FIELDS[name].default
    if name == "return_scores":
        return f"print 'score<TAB>text': {meta['help']} (with --num-hypotheses: the n-best scores)"
    if name == "early_stopping":
        return (
            "transformers' beam-search stop rule, with --length-penalty-type hf: true, false or never "
            f"(default: {source}, else false)"
        )
    if name == "num_hypotheses":
        return (
            f"{meta['help']}, printed as 'index<TAB>score<TAB>text' ({meta['range']}; default: "
            f"{source}, else {default})"
        )
    if name in shown:
        text = f"{meta['help']} ({meta['range']}; default: {shown[name]})"
    else:
        value = "fresh entropy" if default is None else default
        text = f"{meta['help']} ({meta['range']}; default: {source}, else {value})"
    if name == "length_penalty":
        text += (
            "; --alpha A is its deprecated spelling, --length-penalty NAME that of --length-penalty-type NAME"
        )
    return text


class _LengthPenalty(argparse.Action):
    """``--length-penalty A`` (the exponent) and ``--length-penalty-type NAME`` (the formula),
    with their old spellings ``--alpha A`` and ``--length-penalty NAME``."""

    OLD = ("--alpha", "--length-penalty NAME")

    def __call__(self, parser, namespace, values, option_string=None):
        seen = namespace.__dict__.setdefault("_length_penalty_spellings", {})
        if option_string == "--length-penalty-type":
            dest, spelled, value = "length_penalty_type", option_string, values
        elif option_string == "--length-penalty" and values in LENGTH_PENALTIES:
            dest, spelled, value = "length_penalty_type", "--length-penalty NAME", values
        else:
            dest, spelled = "length_penalty", option_string
            try:
                value = float(values)
            except ValueError:
                parser.error(
                    f"argument {option_string}: invalid choice: {values!r} (a number, the exponent"
                    + (f"; or one of {LENGTH_PENALTIES}, the formula)" if option_string != "--alpha" else ")")
                )
        before = seen.setdefault(dest, spelled)
        if (before in self.OLD) != (spelled in self.OLD):
            parser.error(f"{before} and {spelled} are one option (give only {flag_of(dest)})")
        if spelled in self.OLD and not getattr(parser, "quiet_renamed", False):
            new = flag_of(dest) + (f" {value}" if dest == "length_penalty_type" else "")
            old = f"--length-penalty {value}" if spelled == "--length-penalty NAME" else spelled
            print(f"{parser.prog}: warning: {old} is deprecated; use {new}", file=sys.stderr)
        setattr(namespace, dest, value)


def add_decoding_flags(
    group: Any,
    spec: FlagSpec,
    *,
    source: str = "the model's generation config",
    shown_defaults: Optional[Mapping[str, str]] = None,
) -> None:
    """One flag per field of ``spec`` on ``group`` (a parser or an argument group), with the
    field's help and range; every value defaults to None (not given). ``source`` names where a
    value not given comes from (in ``--help``); ``shown_defaults`` replaces that text for the
    fields it names (a command whose default is its own, such as a greedy gate)."""
    shown = dict(shown_defaults or {})
    names = {name for name, _, _ in spec}
    for name, old, metavar in spec:
        flag, default = flag_of(name), FIELDS[name].default
        text = _help(name, source, shown)
        if name in ("length_penalty", "length_penalty_type"):
            if not {"length_penalty", "length_penalty_type"} <= names:
                raise ValueError("add_decoding_flags: length_penalty and length_penalty_type go together")
            kwargs: dict[str, Any] = dict(metavar=metavar) if metavar else dict(choices=LENGTH_PENALTIES)
            group.add_argument(
                flag, *old, dest=name, action=_LengthPenalty, default=None, help=text, **kwargs
            )
        elif name == "early_stopping":
            add_option(group, flag, choices=tuple(EARLY_STOPPING_CHOICES), default=None, help=text)
        elif isinstance(default, bool):
            add_option(group, flag, deprecated=old, action="store_true", help=text)
        else:
            kind = float if isinstance(default, float) else int
            add_option(group, flag, deprecated=old, type=kind, default=None, metavar=metavar, help=text)


def _value(args: argparse.Namespace, name: str) -> Any:
    return getattr(args, name, None)


def expected_of_flag(name: str, value: Any, length_penalty_type: Optional[str]) -> Optional[str]:
    """What the flag of field ``name`` expects where ``value`` is out of its range, else None."""
    expected = expected_value(name, value)
    if name == "length_penalty" and length_penalty_type != "hf" and (expected or value < 0):
        return "a finite number >= 0 (negative exponents: --length-penalty-type hf)"
    return expected


def check_decoding_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, spec: FlagSpec) -> None:
    """The decoding flags of ``spec`` given, each within its field's range, and their
    combinations; a usage error (exit 2) naming the flag as the command line spelled it."""
    for name, _, _ in spec:
        value = _value(args, name)
        if value is None or name in _NOT_RANGED:
            continue
        expected = expected_of_flag(name, value, _value(args, "length_penalty_type"))
        if expected is not None:
            parser.error(f"{given_flag(args, name)} must be {expected}, got {value}")
    beam, n = _value(args, "beam_size"), _value(args, "num_hypotheses")
    sampling = _value(args, "sampling_topk") not in (None, 1)
    if n is not None and beam is not None and n > beam and not sampling:
        beam_flag = given_flag(args, "beam_size")
        parser.error(
            f"{given_flag(args, 'num_hypotheses')} must be between 1 and {beam_flag} ({beam}), got {n}"
        )
    names = {name for name, _, _ in spec}  # a command's own flags of other names are not these
    if not sampling:
        for name in ("sampling_topp", "sampling_temperature", "seed"):
            if name in names and _value(args, name) is not None:
                parser.error(f"{flag_of(name)} applies to random sampling: give --sampling-topk 0 (or K > 1)")
    if sampling and beam is not None and beam > 1:
        beam_flag = given_flag(args, "beam_size")
        parser.error(f"random sampling (--sampling-topk) needs {beam_flag} 1, got {beam_flag} {beam}")
    if (
        "early_stopping" in names
        and _value(args, "early_stopping") is not None
        and _value(args, "length_penalty_type") != "hf"
    ):
        parser.error(
            "--early-stopping applies with --length-penalty hf / --length-penalty-type hf (transformers' "
            "beam search)"
        )


def decoding_values(args: argparse.Namespace, spec: FlagSpec) -> dict[str, Any]:
    """The values of ``spec``'s flags under their field names (None: not given)."""
    values = {name: _value(args, name) for name, _, _ in spec}
    if "early_stopping" in values:
        values["early_stopping"] = EARLY_STOPPING_CHOICES.get(values["early_stopping"])
    if "return_scores" in values:
        values["return_scores"] = True if values["return_scores"] else None
    return values
