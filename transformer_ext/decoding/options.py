"""Search options: :class:`SearchOptions`, the one record of every option with its default, help
text and range, and the checks the searches make on their keyword arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Union

import numpy as np

from .protocol import (
    IntOrArray,
    _check_positive_int,
    check_sources,
)
from .renamed import renamed_keywords, warn_renamed

if TYPE_CHECKING:  # annotations only
    from .sampling import _Sampler


LENGTH_PENALTIES = ("gnmt", "seed", "average", "none", "hf")


# transformers' ``early_stopping`` values, for ``length_penalty_type="hf"`` (see :func:`beam_search`).
EARLY_STOPPING = (False, True, "never")


def _check_budget_coefficient(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    return value


def max_decoding_length_for(
    src_lengths: IntOrArray, a: float, b: float, *, cap: int | None = None
) -> np.ndarray:
    """Per-source ``max_decoding_length`` ``floor(a * src_len + b)``, at least 1, at most ``cap``.

    ``a`` and ``b`` must be finite and >= 0 (a ValueError naming them otherwise: an infinite or
    NaN budget has no integer value). Without ``cap`` a budget must fit in int64.
    """
    a = _check_budget_coefficient("a (tokens per source token)", a)
    b = _check_budget_coefficient("b (extra tokens)", b)
    lengths = np.asarray(src_lengths, dtype=np.float64)
    budget = np.floor(a * lengths + b)  # float64: finite for finite a, b and lengths
    if cap is not None:
        budget = np.minimum(budget, float(int(cap)))
    elif budget.size and budget.max() >= 2.0**62:
        raise ValueError(f"generation budget {budget.max():.3g} = a * src_len + b is too large; give a cap")
    return np.maximum(budget.astype(np.int64), 1)


def max_new_tokens_for(src_lengths: IntOrArray, a: float, b: float, *, cap: int | None = None) -> np.ndarray:
    """The older name of :func:`max_decoding_length_for` (a deprecation warning, once per process)."""
    warn_renamed("max_new_tokens_for", "max_decoding_length_for", None)
    return max_decoding_length_for(src_lengths, a, b, cap=cap)


def _per_row(name: str, value: IntOrArray, n: int) -> np.ndarray:
    arr = np.asarray(value)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must be an int or an array of ints, got {value!r}")
    if arr.ndim == 0:
        arr = np.full(n, int(arr), dtype=np.int64)
    elif arr.shape != (n,):
        raise ValueError(f"{name} must be an int or have shape ({n},), got shape {arr.shape}")
    if arr.min() < 0:
        raise ValueError(f"{name} must be >= 0, got {arr.tolist()}")
    return arr.astype(np.int64)


def _check_cache_len(cache_len: int | None, steps: int) -> int:
    if cache_len is None:
        return steps
    if int(cache_len) < steps:
        raise ValueError(
            f"cache_len = {cache_len} is too small to generate {steps} tokens (needs >= {steps})"
        )
    return int(cache_len)


def _check_token_id(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a token id (an int >= 0), got {value!r}")
    return int(value)


def _check_real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


def _check_int_list(name: str, value: Any) -> np.ndarray:
    """``value`` (a list or 1-D array of ints >= 0, ``None`` or empty) as int64."""
    if value is None:
        return np.zeros(0, dtype=np.int64)
    if isinstance(value, (str, bytes)) or isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a list of token ids, got {value!r}")
    items = list(value)
    if not items:
        return np.zeros(0, dtype=np.int64)
    for i, v in enumerate(items):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name}[{i}] must be a token id (an int), got {v!r}")
        if v < 0:
            raise ValueError(f"{name}[{i}] = {int(v)} is not a token id (ids are >= 0)")
    return np.asarray(items, dtype=np.int64)


def _check_in_vocab(name: str, ids: np.ndarray, vocab_size: int) -> None:
    """Every entry of the 1-D ``ids`` (named ``name[i]`` in the error) is below ``vocab_size``."""
    bad = np.flatnonzero(ids >= vocab_size)
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{name}[{i}] = {int(ids[i])} is not a target token id: the target vocabulary has ids "
            f"0 .. {vocab_size - 1}"
        )


def _check_prefixes(
    target_prefix: Any, n_sources: int, max_decoding_length: np.ndarray, eos_id: int
) -> list[np.ndarray]:
    """One int64 array per source: the tokens forced first (empty without a prefix)."""
    if target_prefix is None:
        return [np.zeros(0, dtype=np.int64)] * n_sources
    if isinstance(target_prefix, (str, bytes)) or not hasattr(target_prefix, "__len__"):
        raise TypeError(
            f"target_prefix must be a list holding one list of token ids per source, got {target_prefix!r}"
        )
    if len(target_prefix) != n_sources:
        raise ValueError(
            f"target_prefix must hold one token list per source ({n_sources}), got {len(target_prefix)}"
        )
    out = []
    for b, prefix in enumerate(target_prefix):
        arr = _check_int_list(f"target_prefix[{b}]", prefix)
        at_eos = np.flatnonzero(arr == eos_id)
        if at_eos.size:
            raise ValueError(
                f"target_prefix[{b}][{int(at_eos[0])}] is the EOS id {eos_id}: a prefix is what comes "
                "before the end of the translation"
            )
        if len(arr) > max_decoding_length[b]:
            raise ValueError(
                f"target_prefix[{b}] has {len(arr)} tokens, more than the maximum length of that source "
                f"({int(max_decoding_length[b])} generated tokens, max_decoding_length): shorten the prefix or allow longer outputs"
            )
        out.append(arr)
    return out


@dataclass(frozen=True)
class _Options:
    """The checked logit-processor options of one search (see the module docstring)."""

    start_id: int
    banned: np.ndarray
    repetition_penalty: float
    no_repeat_ngram_size: int
    force_eos_at_budget: bool


def _check_options(
    *,
    bos_id: Any,
    eos_id: Any,
    decoder_start_id: Any,
    banned_ids: Any,
    repetition_penalty: Any,
    no_repeat_ngram_size: Any,
    force_eos_at_budget: Any,
) -> _Options:
    _check_token_id("bos_id", bos_id)
    eos_id = _check_token_id("eos_id", eos_id)
    start = bos_id if decoder_start_id is None else decoder_start_id
    start = _check_token_id("decoder_start_id" if decoder_start_id is not None else "bos_id", start)
    banned = np.unique(_check_int_list("banned_ids", banned_ids))
    if (banned == eos_id).any():
        raise ValueError(
            f"banned_ids holds the EOS id {eos_id}: a search that may never end is not defined "
            "(limit the length with max_decoding_length / min_decoding_length instead)"
        )
    penalty = _check_real("repetition_penalty", repetition_penalty)
    if penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0 (1 = no penalty), got {penalty}")
    ngram = no_repeat_ngram_size
    if isinstance(ngram, bool) or not isinstance(ngram, (int, np.integer)) or ngram < 0:
        raise ValueError(f"no_repeat_ngram_size must be an int >= 0 (0 = off), got {ngram!r}")
    if not isinstance(force_eos_at_budget, (bool, np.bool_)):
        raise TypeError(f"force_eos_at_budget must be a bool, got {force_eos_at_budget!r}")
    return _Options(start, banned, penalty, int(ngram), bool(force_eos_at_budget))


def _check_search_inputs(
    input_ids: Any,
    src_lengths: Any,
    max_decoding_length: IntOrArray,
    min_decoding_length: IntOrArray,
    target_prefix: Any,
    eos_id: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
    """``(ids, lengths, max_decoding_length, min_decoding_length, prefixes)``: the checked sources and per-source budgets."""
    ids, lengths = check_sources(input_ids, src_lengths)
    B = ids.shape[0]
    max_decoding_length = _per_row("max_decoding_length", max_decoding_length, B)
    min_decoding_length = _per_row("min_decoding_length", min_decoding_length, B)
    prefixes = _check_prefixes(target_prefix, B, max_decoding_length, eos_id)
    return ids, lengths, max_decoding_length, min_decoding_length, prefixes


def _check_num_hypotheses(num_hypotheses: Any, sampler: Optional[_Sampler]) -> int:
    n = _check_positive_int("num_hypotheses", num_hypotheses)
    if n > 1 and sampler is None:
        raise ValueError(
            f"num_hypotheses = {n} needs random sampling (sampling_topk != 1) or beam search "
            "(beam_size >= num_hypotheses): greedy decoding has a single hypothesis"
        )
    return n


def _check_beam_options(
    length_penalty_type: Any,
    beam_size: Any,
    num_hypotheses: Any,
    length_penalty: Any,
    early_stopping: Any,
    renormalize_logits: Any,
) -> tuple[float, Union[bool, str]]:
    """``(length_penalty, early_stopping)``: the checked beam-search options of :func:`beam_search`."""
    if length_penalty_type not in LENGTH_PENALTIES:
        raise ValueError(
            f"length_penalty_type must be one of {LENGTH_PENALTIES}, got {length_penalty_type!r}"
        )
    hf = length_penalty_type == "hf"
    if not isinstance(beam_size, (int, np.integer)) or beam_size < 1:
        raise ValueError(f"beam_size must be a positive int, got {beam_size!r}")
    if not isinstance(num_hypotheses, (int, np.integer)) or not 1 <= num_hypotheses <= beam_size:
        raise ValueError(f"num_hypotheses must be in [1, beam_size={beam_size}], got {num_hypotheses!r}")
    length_penalty = _check_real("length_penalty", length_penalty)
    if length_penalty < 0 and not hf:
        raise ValueError(f"length_penalty must be a finite number >= 0, got {length_penalty}")
    if early_stopping is not None and not hf:
        raise ValueError(
            "early_stopping is transformers' beam-search rule: it applies with length_penalty_type='hf' only"
        )
    if early_stopping is None:
        early_stopping = False
    if not (early_stopping is True or early_stopping is False or early_stopping == "never"):
        raise ValueError(f"early_stopping must be one of {EARLY_STOPPING}, got {early_stopping!r}")
    if not isinstance(renormalize_logits, (bool, np.bool_)):
        raise TypeError(f"renormalize_logits must be a bool, got {renormalize_logits!r}")
    if renormalize_logits and not hf:
        raise ValueError(
            "renormalize_logits applies with length_penalty_type='hf' (the other kinds always renormalise)"
        )
    return length_penalty, early_stopping


@renamed_keywords({"kind": "length_penalty_type", "alpha": "length_penalty"}, formula=False)
def length_penalty_factor(
    length: int, length_penalty_type: str = "gnmt", length_penalty: float = 0.6
) -> float:
    """The divisor of a hypothesis' log-probability under the formula ``length_penalty_type`` with
    the exponent ``a = length_penalty``.

    ``length`` counts generated tokens, EOS included (a finished hypothesis of n tokens has
    length n + 1, an unfinished one cut at the budget has length n), so it is >= 1.
    ``"gnmt"``: ``((5 + length) / 6) ** a`` (Wu et al. 2016).
    ``"seed"``: ``((5 + length + 1) / 5) ** a``: the seed tutorial's formula, whose length
    is that of the sequence with BOS.
    ``"average"``: ``length ** a``: the average log-probability per token for ``a = 1``.
    fairseq's ``--lenpen`` is this definition (its length counts the final EOS); CTranslate2's
    ``length_penalty`` is too when it runs with ``return_end_token=True`` (by default it
    leaves the EOS out of the length, so finished hypotheses there are divided by n ** a).
    ``"none"``: 1.
    ``"hf"``: ``length ** a``, the divisor of transformers' beam search (its
    ``length_penalty`` is ``a``, which may be negative there); the kind also selects
    transformers' search rules in :func:`beam_search`.
    """
    kind, a = length_penalty_type, length_penalty
    if kind == "gnmt":
        return ((5.0 + length) / 6.0) ** a
    if kind == "seed":
        return ((5.0 + length + 1) / 5.0) ** a
    if kind in ("average", "hf"):
        return float(length) ** a
    if kind == "none":
        return 1.0
    raise ValueError(f"length_penalty_type must be one of {LENGTH_PENALTIES}, got {kind!r}")


# ------------------------------------------------------------------------------------------
# SearchOptions: every search option in one record
# ------------------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def _int_at_least(low: int) -> Callable[[Any], Optional[str]]:
    def check(value: Any) -> Optional[str]:
        if not _is_int(value) or value < low:
            return f"an int >= {low}"
        return None

    return check


def _finite(value: Any) -> Optional[str]:
    return None if _is_real(value) and math.isfinite(float(value)) else "a finite number"


def _finite_at_least(low: float) -> Callable[[Any], Optional[str]]:
    def check(value: Any) -> Optional[str]:
        if not _is_real(value) or not math.isfinite(float(value)) or float(value) < low:
            return f"a finite number >= {low:g}"
        return None

    return check


def _positive(value: Any) -> Optional[str]:
    if not _is_real(value) or not math.isfinite(float(value)) or float(value) <= 0:
        return "a finite number > 0"
    return None


def _unit_interval(value: Any) -> Optional[str]:
    if not _is_real(value) or not 0.0 < float(value) <= 1.0:
        return "a number in (0, 1]"
    return None


def _one_of(choices: tuple) -> Callable[[Any], Optional[str]]:
    def check(value: Any) -> Optional[str]:
        if isinstance(value, (bool, np.bool_)) and not any(isinstance(c, bool) for c in choices):
            return f"one of {choices}"
        if not any(value is c or (type(value) is type(c) and value == c) for c in choices):
            return f"one of {choices}"
        return None

    return check


def _flag(value: Any) -> Optional[str]:
    return None if isinstance(value, (bool, np.bool_)) else "a bool"


def _seed(value: Any) -> Optional[str]:
    return None if value is None or (_is_int(value) and value >= 0) else "an int >= 0 or None"


def _early_stopping(value: Any) -> Optional[str]:
    return (
        None
        if value is None or value is True or value is False or value == "never"
        else ("None, True, False or 'never'")
    )


def _token_ids(value: Any) -> Optional[str]:
    if not isinstance(value, tuple) or not all(_is_int(v) and v >= 0 for v in value):
        return "a tuple of token ids (ints >= 0)"
    return None


def _option(default: Any, help: str, range: str, check: Callable[[Any], Optional[str]]) -> Any:
    """A :class:`SearchOptions` field: its default, its help text (the CLI's), a description of
    its range (for help and documentation) and its check (a description of what was expected
    when a value is refused, else None)."""
    return field(default=default, metadata={"help": help, "range": range, "check": check})


def expected_value(name: str, value: Any) -> Optional[str]:
    """What the option ``name`` (a :class:`SearchOptions` field) expects where ``value`` is out of
    its range, worded for a flag or a request field whose type is given already (``>= 1``, not
    ``an int >= 1``); None when ``value`` is within it. Every command line and the Triton
    translator word their range errors with it: ``NAME must be EXPECTED, got VALUE``."""
    expected = _FIELD_CHECKS[name](value)
    if expected is None:
        return None
    for word in ("an int ", "a number "):
        expected = expected.removeprefix(word)
    return expected.removesuffix(" or None")


@dataclass(frozen=True)
class SearchOptions:
    """Every option of one search, with its default, help text and range (field metadata
    ``"help"``, ``"range"``; ``"check"`` is the field's check). Names follow CTranslate2's
    ``translate_batch``. A value out of range is a ValueError naming the field, raised when the
    record is made (``SearchOptions(beam_size=0)``, ``dataclasses.replace(opts, beam_size=0)``).

    The budget of a source of ``n`` tokens (:meth:`budget`) is ``max_decoding_length`` generated
    tokens (EOS included); with ``max_len_a`` or ``max_len_b`` given (not both 0) it is
    ``floor(max_len_a * n + max_len_b)``, at least 1, capped by ``max_decoding_length``.
    ``length_penalty`` is the exponent of the length penalty whose formula ``length_penalty_type``
    names (:func:`length_penalty_factor`). :meth:`generate_kwargs` gives the keyword arguments of
    :func:`transformer_ext.decoding.generate`.
    """

    beam_size: int = _option(
        1, "beam width; 1 is greedy decoding or random sampling", ">= 1", _int_at_least(1)
    )
    num_hypotheses: int = _option(
        1,
        "hypotheses returned per source (at most beam_size; or independent samples)",
        ">= 1",
        _int_at_least(1),
    )
    length_penalty: float = _option(
        0.6,
        "exponent of the length penalty (a hypothesis' log-probability is divided by a function of its length)",
        "finite; >= 0 unless length_penalty_type is 'hf'",
        _finite,
    )
    length_penalty_type: str = _option(
        "gnmt",
        "length penalty formula: gnmt ((5+len)/6)^a, seed ((5+len+1)/5)^a, average len^a, none, "
        "hf (transformers' beam search)",
        " | ".join(LENGTH_PENALTIES),
        _one_of(LENGTH_PENALTIES),
    )
    early_stopping: Union[bool, str, None] = _option(
        None,
        "transformers' beam-search stop rule (length_penalty_type 'hf' only); None is False",
        "None | True | False | 'never'",
        _early_stopping,
    )
    renormalize_logits: bool = _option(
        False,
        "renormalise after the logit processors (length_penalty_type 'hf' only; the others always do)",
        "bool",
        _flag,
    )
    max_decoding_length: int = _option(
        256, "the most tokens generated per source, EOS included", ">= 1", _int_at_least(1)
    )
    max_len_a: float = _option(
        0.0,
        "with max_len_b: at most floor(a * source length + b) generated tokens (0 and 0: max_decoding_length only)",
        "finite, >= 0",
        _finite_at_least(0.0),
    )
    max_len_b: float = _option(0.0, "see max_len_a", "finite, >= 0", _finite_at_least(0.0))
    min_decoding_length: int = _option(
        0, "EOS is suppressed before this many tokens are generated (EOS included)", ">= 0", _int_at_least(0)
    )
    repetition_penalty: float = _option(
        1.0, "penalty of tokens already in the sequence (1 is none)", "> 0", _positive
    )
    no_repeat_ngram_size: int = _option(
        0, "never repeat an n-gram of this size (0 is off)", ">= 0", _int_at_least(0)
    )
    banned_ids: tuple = _option((), "token ids never generated", "token ids", _token_ids)
    force_eos_at_budget: bool = _option(
        False,
        "the EOS is the last token a source's budget allows (transformers' forced_eos_token_id)",
        "bool",
        _flag,
    )
    sampling_topk: int = _option(
        1,
        "sample from the k most likely tokens (1 is greedy, 0 the whole vocabulary)",
        ">= 0",
        _int_at_least(0),
    )
    sampling_topp: float = _option(
        1.0, "sample from the smallest set of tokens whose probability reaches p", "(0, 1]", _unit_interval
    )
    sampling_temperature: float = _option(1.0, "temperature of random sampling", "> 0", _positive)
    seed: Optional[int] = _option(
        None, "seed of random sampling (None: fresh entropy)", ">= 0 or None", _seed
    )
    return_scores: bool = _option(
        False, "greedy hypotheses with scores (beam search always has them)", "bool", _flag
    )
    return_attention: bool = _option(
        False, "each hypothesis' cross-attention, one row per token", "bool", _flag
    )

    def __post_init__(self) -> None:
        if isinstance(self.banned_ids, list):  # a list is accepted and kept as a tuple (hashable)
            object.__setattr__(self, "banned_ids", tuple(self.banned_ids))
        for f in fields(self):
            value = getattr(self, f.name)
            expected = f.metadata["check"](value)
            if expected is not None:
                raise ValueError(f"{f.name} must be {expected}, got {value!r}")
        self._check_combinations()

    def _check_combinations(self) -> None:
        hf = self.length_penalty_type == "hf"
        if self.length_penalty < 0 and not hf:
            raise ValueError(
                f"length_penalty must be >= 0 with length_penalty_type {self.length_penalty_type!r}, "
                f"got {self.length_penalty}"
            )
        for name, what in (
            ("early_stopping", "transformers' beam-search rule"),
            ("renormalize_logits", "a rule of transformers' beam search"),
        ):
            if getattr(self, name) not in (None, False) and not hf:
                raise ValueError(
                    f"{name} is {what}: it applies with length_penalty_type 'hf' only, got {getattr(self, name)!r}"
                )
        if self.beam_size > 1:
            if self.num_hypotheses > self.beam_size:
                raise ValueError(
                    f"num_hypotheses must be at most beam_size = {self.beam_size}, got {self.num_hypotheses}"
                )
            if self.sampling:
                raise ValueError(
                    "random sampling (sampling_topk / sampling_topp / sampling_temperature) needs beam size 1, "
                    f"got {self.beam_size}"
                )
            if self.seed is not None:
                raise ValueError(
                    f"seed applies to random sampling, which needs beam_size = 1, got {self.beam_size}"
                )
        elif self.sampling_topk == 1:
            for name in ("sampling_topp", "sampling_temperature"):
                if getattr(self, name) != 1.0:
                    raise ValueError(
                        f"{name} applies to random sampling, which sampling_topk = 1 (greedy) turns off: "
                        "give sampling_topk = 0 (the whole vocabulary) or k > 1"
                    )
            if self.num_hypotheses > 1:
                raise ValueError(
                    f"num_hypotheses ({self.num_hypotheses}) cannot exceed the beam size ({self.beam_size}) "
                    "(greedy decoding has one hypothesis; random sampling may return several)"
                )
            if self.seed is not None:
                raise ValueError("seed applies to random sampling (sampling_topk != 1)")

    @property
    def sampling(self) -> bool:
        """Whether the options ask for random sampling."""
        return self.sampling_topk != 1 or self.sampling_topp != 1.0 or self.sampling_temperature != 1.0

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], base: Optional[SearchOptions] = None) -> SearchOptions:
        """``base`` (default: the defaults) with ``values`` laid over it; an unknown name is a
        ValueError naming it."""
        unknown = sorted(set(values) - set(cls.names()))
        if unknown:
            raise ValueError(
                f"unknown search option(s) {', '.join(unknown)}: the options are {', '.join(cls.names())}"
            )
        return replace(base if base is not None else cls(), **dict(values))

    def budget(self, src_lengths: IntOrArray) -> np.ndarray:
        """int64 per-source budgets (generated tokens, EOS included) for ``src_lengths``."""
        lengths = np.asarray(src_lengths, dtype=np.int64)
        if self.max_len_a == 0.0 and self.max_len_b == 0.0:
            return np.full(lengths.shape, self.max_decoding_length, dtype=np.int64)
        return max_decoding_length_for(lengths, self.max_len_a, self.max_len_b, cap=self.max_decoding_length)

    def generate_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`transformer_ext.decoding.generate` these options give
        (all but the budget, ``max_decoding_length`` per source: see :meth:`budget`)."""
        return dict(
            beam_size=self.beam_size,
            num_hypotheses=self.num_hypotheses,
            length_penalty_type=self.length_penalty_type,
            length_penalty=float(self.length_penalty),
            early_stopping=self.early_stopping,
            renormalize_logits=bool(self.renormalize_logits),
            sampling_topk=int(self.sampling_topk),
            sampling_topp=float(self.sampling_topp),
            sampling_temperature=float(self.sampling_temperature),
            seed=self.seed,
            return_attention=bool(self.return_attention),
            min_decoding_length=int(self.min_decoding_length),
            banned_ids=list(self.banned_ids),
            repetition_penalty=float(self.repetition_penalty),
            no_repeat_ngram_size=int(self.no_repeat_ngram_size),
            force_eos_at_budget=bool(self.force_eos_at_budget),
        )


_FIELD_CHECKS = {f.name: f.metadata["check"] for f in fields(SearchOptions)}
