"""The older keyword names of the searches, accepted with a deprecation warning.

The searches take CTranslate2's names (``num_hypotheses``, ``length_penalty`` the exponent,
``length_penalty_type`` the formula, ``max_decoding_length``, ``min_decoding_length``,
``beam_size``). Their older spellings (:data:`RENAMED`, and ``length_penalty`` given as a formula's
name) still work: each gives one ``FutureWarning`` per process, pointing at the caller's line
(:func:`transformer_ext.translator_options.warn_renamed`, the translator's warning); an older and a
newer name of one option in one call are a TypeError naming both.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Mapping, TypeVar

# the older keyword name -> the name the searches take
RENAMED = {
    "n_best": "num_hypotheses",
    "alpha": "length_penalty",
    "max_new_tokens": "max_decoding_length",
    "min_new_tokens": "min_decoding_length",
    "num_beams": "beam_size",
}

F = TypeVar("F", bound=Callable[..., Any])


def _formula_name(value: Any) -> bool:
    from .options import LENGTH_PENALTIES  # noqa: PLC0415 - options imports this module's users

    return isinstance(value, str) and value in LENGTH_PENALTIES


def warn_renamed(old: str, new: str, value: Any) -> None:
    """The translator's warning (:func:`transformer_ext.translator_options.warn_renamed`: once per
    process, at the caller's line); where the package is only partly present (the copy of
    ``decoding`` in a Triton repository) a plain ``FutureWarning``."""
    try:
        from ..translator_options import warn_renamed as warn  # noqa: PLC0415 - it imports this package
    except ImportError:
        warnings.warn(f"{old} is deprecated; use {new}", FutureWarning, stacklevel=4)
        return
    warn(old, new, value)


def new_names(
    where: str, kwargs: dict[str, Any], renamed: Mapping[str, str], formula: bool
) -> dict[str, Any]:
    """``kwargs`` under the new names (a warning per older name, once per process); ``formula``:
    ``length_penalty`` given as a formula's name is the older spelling of ``length_penalty_type``."""
    out = dict(kwargs)
    if formula and _formula_name(out.get("length_penalty")):
        if "length_penalty_type" in out:
            raise TypeError(
                f"{where}() got length_penalty={out['length_penalty']!r} (a formula's name) and "
                "length_penalty_type: they are one option (give only length_penalty_type)"
            )
        warn_renamed("length_penalty", "length_penalty_type", out["length_penalty"])
        out["length_penalty_type"] = out.pop("length_penalty")
    for old, new in renamed.items():
        if old not in out:
            continue
        if new in out:
            raise TypeError(f"{where}() got {old} and {new}: they are one option (give only {new})")
        warn_renamed(old, new, out[old])
        out[new] = out.pop(old)
    return out


def renamed_keywords(renamed: Mapping[str, str] = RENAMED, *, formula: bool = True) -> Callable[[F], F]:
    """A decorator: the function also takes the older keyword names of ``renamed`` (and, with
    ``formula``, ``length_penalty`` as a formula's name), each with its deprecation warning.
    ``inspect.signature`` of the result shows the new names only."""

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if any(old in kwargs for old in renamed) or (
                formula and _formula_name(kwargs.get("length_penalty"))
            ):
                kwargs = new_names(function.__name__, kwargs, renamed, formula)
            return function(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
