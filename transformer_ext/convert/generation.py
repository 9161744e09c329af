"""Generation defaults of an imported model: ``generation_defaults.json`` in its model folder.

The converter records how the source checkpoint decodes (its ``generation_config.json``): beam size,
``max_length``, transformers' length penalty and early-stopping rule, the banned tokens
(``bad_words_ids`` of one token each), whether ``</s>`` is forced at ``max_length``, and whether the
target language is forced as the first token. Translation reads them as the defaults of its
options; every field is required and checked, as for every file of a model folder.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence, Union

from ..cli import UserError
from ..fsutil import atomic_write_json

__all__ = [
    "GENERATION_DEFAULTS_FILE",
    "GenerationDefaults",
    "GenerationDefaultsError",
    "read_generation_defaults",
]

GENERATION_DEFAULTS_FILE = "generation_defaults.json"
_FORMAT = "transformer_ext.generation_defaults"
_VERSION = 1


class GenerationDefaultsError(UserError, ValueError):
    """A generation_defaults.json that cannot be read as one."""


@dataclass(frozen=True)
class GenerationDefaults:
    num_beams: int = 1  # transformers' num_beams (1: greedy)
    max_length: int = 256  # transformers' max_length: the decoder start plus every generated token
    length_penalty: float = 1.0  # transformers' exponent: a hypothesis scores sum(logp) / len**length_penalty
    early_stopping: Union[bool, str] = False  # transformers' early_stopping: True, False or "never"
    banned_ids: tuple[int, ...] = field(default_factory=tuple)  # never generated (bad_words_ids)
    force_eos_at_max_length: bool = False  # forced_eos_token_id: </s> is the token at max_length
    force_target_language: bool = False  # the target-language token is the first generated token

    def to_dict(self) -> dict:
        body = asdict(self)
        body["banned_ids"] = list(self.banned_ids)
        return {"format": _FORMAT, "format_version": _VERSION, **body}

    def save(self, directory: str | os.PathLike) -> str:
        path = os.path.join(os.fspath(directory), GENERATION_DEFAULTS_FILE)
        atomic_write_json(path, self.to_dict())
        return path

    @classmethod
    def from_dict(cls, data: Any, source: str = GENERATION_DEFAULTS_FILE) -> "GenerationDefaults":
        def fail(message: str) -> GenerationDefaultsError:
            return GenerationDefaultsError(f"{source}: {message}")

        if not isinstance(data, dict):
            raise fail("must hold a JSON object")
        if data.get("format") != _FORMAT or data.get("format_version") != _VERSION:
            raise fail(f"not a {_FORMAT} version {_VERSION} file")
        names = [f for f in cls.__dataclass_fields__]
        missing = [n for n in names if n not in data]
        unknown = sorted(k for k in data if k not in names and k not in ("format", "format_version"))
        if missing or unknown:
            raise fail(f"missing fields {missing}, unknown fields {unknown}")
        for name in ("num_beams", "max_length"):
            v = data[name]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise fail(f"{name} must be an integer >= 1, got {v!r}")
        lp = data["length_penalty"]
        if isinstance(lp, bool) or not isinstance(lp, (int, float)):
            raise fail(f"length_penalty must be a number, got {lp!r}")
        for name in ("force_eos_at_max_length", "force_target_language"):
            if not isinstance(data[name], bool):
                raise fail(f"{name} must be true or false, got {data[name]!r}")
        if not (isinstance(data["early_stopping"], bool) or data["early_stopping"] == "never"):
            raise fail(f'early_stopping must be true, false or "never", got {data["early_stopping"]!r}')
        banned = data["banned_ids"]
        if not isinstance(banned, list) or any(
            isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in banned
        ):
            raise fail(f"banned_ids must be a list of token ids, got {banned!r}"[:300])
        return cls(
            num_beams=data["num_beams"],
            max_length=data["max_length"],
            length_penalty=float(lp),
            early_stopping=data["early_stopping"],
            banned_ids=tuple(banned),
            force_eos_at_max_length=data["force_eos_at_max_length"],
            force_target_language=data["force_target_language"],
        )

    def search_options(self, tokenizer: Any, n_sources: int, *, beam: Optional[bool] = None) -> dict:
        """Keyword arguments of :func:`transformer_ext.decoding.greedy_decode` (``beam=False``) or
        :func:`~transformer_ext.decoding.beam_search` (``beam=True``; default: ``num_beams > 1``)
        that decode as transformers' ``generate()`` does with this configuration: the decoder
        start, ``max_new_tokens = max_length - 1``, the banned tokens, the forced target language
        (``tokenizer.forced_target_prefix()``), the forced EOS, and for beam search ``num_beams``
        with transformers' length penalty and early-stopping rule."""
        prefix: Sequence[int] = tokenizer.forced_target_prefix() if self.force_target_language else []
        options: dict = dict(
            bos_id=int(tokenizer.bos_id),
            eos_id=int(tokenizer.eos_id),
            max_new_tokens=self.max_length - 1,
            banned_ids=list(self.banned_ids),
            force_eos_at_budget=self.force_eos_at_max_length,
        )
        if prefix:
            options["target_prefix"] = [list(prefix)] * n_sources
        if beam if beam is not None else self.num_beams > 1:
            options.update(
                beam_size=self.num_beams,
                length_penalty="hf",
                alpha=self.length_penalty,
                early_stopping=self.early_stopping,
            )
        return options


def read_generation_defaults(directory: str | os.PathLike) -> Optional[GenerationDefaults]:
    """The generation defaults of a model folder, or None when it has none (a model of ours)."""
    path = os.path.join(os.fspath(directory), GENERATION_DEFAULTS_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GenerationDefaultsError(f"{path} is not valid JSON: {exc}") from None
    return GenerationDefaults.from_dict(data, path)
