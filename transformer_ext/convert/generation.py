"""Generation defaults of an imported model: ``generation_defaults.json`` in its model folder.

The converter records how the source checkpoint decodes (its ``generation_config.json``): beam size,
``max_length``, transformers' length penalty and early-stopping rule, the banned tokens
(``bad_words_ids`` of one token each), the least number of generated tokens, the repetition
penalty and n-gram ban, whether ``</s>`` is forced at ``max_length``, and whether the target
language (or a fixed token) is forced as the first token. Translation reads them as the defaults
of its options; every field is required and checked, as for every file of a model folder (a
version 1 file, which predates the minimum length and the repetition options, reads with those
off).
"""

from __future__ import annotations

import json
import math
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
_VERSION = 2
_READABLE_VERSIONS = (1, 2)
# Fields a version 1 file lacks, with the value that leaves decoding unchanged.
_ADDED_IN_2 = dict(
    min_new_tokens=0,
    repetition_penalty=1.0,
    no_repeat_ngram_size=0,
    forced_first_token=None,
    num_return_sequences=1,
    renormalize_logits=False,
)


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
    min_new_tokens: int = 0  # EOS banned while fewer tokens have been generated (min_length - 1)
    repetition_penalty: float = 1.0  # transformers' repetition_penalty (1: off)
    no_repeat_ngram_size: int = 0  # transformers' no_repeat_ngram_size (0: off)
    forced_first_token: Optional[int] = None  # forced_bos_token_id: the first generated token
    num_return_sequences: int = 1  # hypotheses per source of beam search (at most num_beams)
    renormalize_logits: bool = False  # beam search: log-softmax again after the processors

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
        version = data.get("format_version")
        if data.get("format") != _FORMAT or isinstance(version, bool) or version not in _READABLE_VERSIONS:
            raise fail(f"not a {_FORMAT} file of version {' or '.join(map(str, _READABLE_VERSIONS))}")
        if version == 1:
            data = {**_ADDED_IN_2, **data}
        names = [f for f in cls.__dataclass_fields__]
        missing = [n for n in names if n not in data]
        unknown = sorted(k for k in data if k not in names and k not in ("format", "format_version"))
        if missing or unknown:
            raise fail(f"missing fields {missing}, unknown fields {unknown}")
        for name in ("num_beams", "max_length", "num_return_sequences"):
            v = data[name]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise fail(f"{name} must be an integer >= 1, got {v!r}")
        for name in ("min_new_tokens", "no_repeat_ngram_size"):
            v = data[name]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise fail(f"{name} must be an integer >= 0, got {v!r}")
        lp = data["length_penalty"]
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise fail(f"length_penalty must be a finite number, got {lp!r}")
        rp = data["repetition_penalty"]
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not math.isfinite(rp) or rp <= 0:
            raise fail(f"repetition_penalty must be a finite number > 0, got {rp!r}")
        first = data["forced_first_token"]
        if first is not None and (isinstance(first, bool) or not isinstance(first, int) or first < 0):
            raise fail(f"forced_first_token must be a token id or null, got {first!r}")
        for name in ("force_eos_at_max_length", "force_target_language", "renormalize_logits"):
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
            min_new_tokens=data["min_new_tokens"],
            repetition_penalty=float(rp),
            no_repeat_ngram_size=data["no_repeat_ngram_size"],
            forced_first_token=first,
            num_return_sequences=data["num_return_sequences"],
            renormalize_logits=data["renormalize_logits"],
        )

    def to_search_options(self, base: Any = None) -> Any:
        """These defaults as a :class:`transformer_ext.decoding.SearchOptions` laid over ``base``
        (default: the package's defaults) with ``dataclasses.replace``: ``num_beams``,
        ``num_return_sequences``, transformers' length penalty ("hf") and early-stopping rule,
        ``renormalize_logits``, ``max_length - 1`` new tokens for every source, the least number
        of new tokens, the repetition penalty and n-gram ban, the banned tokens and the forced
        EOS. The forced first tokens depend on the tokenizer (:meth:`forced_prefix`)."""
        from dataclasses import replace

        from ..decoding import SearchOptions

        budget = self.max_length - 1
        return replace(
            base if base is not None else SearchOptions(),
            beam_size=self.num_beams,
            num_hypotheses=self.num_return_sequences,
            length_penalty=float(self.length_penalty),
            length_penalty_type="hf",
            early_stopping=self.early_stopping,
            renormalize_logits=self.renormalize_logits,
            max_decoding_length=budget,
            max_len_a=0.0,
            max_len_b=0.0,
            min_decoding_length=min(self.min_new_tokens, budget),
            repetition_penalty=float(self.repetition_penalty),
            no_repeat_ngram_size=self.no_repeat_ngram_size,
            banned_ids=tuple(self.banned_ids),
            force_eos_at_budget=self.force_eos_at_max_length,
        )

    def forced_prefix(self, tokenizer: Any) -> list[int]:
        """The tokens every decode starts with: the target language's (M2M100 / NLLB:
        ``tokenizer.forced_target_prefix()``), else ``forced_first_token``, else none."""
        if self.force_target_language:
            return [int(t) for t in tokenizer.forced_target_prefix()]
        return [] if self.forced_first_token is None else [self.forced_first_token]

    def search_options(self, tokenizer: Any, n_sources: int, *, beam: Optional[bool] = None) -> dict:
        """Keyword arguments of :func:`transformer_ext.decoding.greedy_decode` (``beam=False``) or
        :func:`~transformer_ext.decoding.beam_search` (``beam=True``; default: ``num_beams > 1``)
        that decode as transformers' ``generate()`` does with this configuration: the decoder
        start, ``max_decoding_length = max_length - 1``, the least number of new tokens, the banned
        tokens, the repetition penalty and n-gram ban, the forced first tokens
        (:meth:`forced_prefix`), the forced EOS, and for beam search ``num_beams`` with
        transformers' length penalty and early-stopping rule."""
        prefix: Sequence[int] = self.forced_prefix(tokenizer)
        options: dict = dict(
            bos_id=int(tokenizer.bos_id),
            eos_id=int(tokenizer.eos_id),
            max_decoding_length=self.max_length - 1,
            min_decoding_length=min(self.min_new_tokens, self.max_length - 1),
            banned_ids=list(self.banned_ids),
            repetition_penalty=self.repetition_penalty,
            no_repeat_ngram_size=self.no_repeat_ngram_size,
            force_eos_at_budget=self.force_eos_at_max_length,
        )
        if prefix:
            options["target_prefix"] = [list(prefix)] * n_sources
        if beam if beam is not None else self.num_beams > 1:
            options.update(
                beam_size=self.num_beams,
                length_penalty_type="hf",
                length_penalty=self.length_penalty,
                early_stopping=self.early_stopping,
                renormalize_logits=self.renormalize_logits,
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


# ------------------------------------------------------------------------------------------
# The fields of transformers' GenerationConfig, as the converter reads them
# ------------------------------------------------------------------------------------------

# Reproduced: recorded above (or checked against config.json) so that decoding equals generate().
REPRODUCED_FIELDS = frozenset(
    {
        "max_length",
        "max_new_tokens",
        "min_length",
        "min_new_tokens",
        "num_beams",
        "length_penalty",
        "early_stopping",
        "bad_words_ids",
        "repetition_penalty",
        "no_repeat_ngram_size",
        "forced_eos_token_id",
        "forced_bos_token_id",
        "decoder_start_token_id",
        "eos_token_id",
        "pad_token_id",
        "bos_token_id",
        "num_return_sequences",
        "do_sample",
        "renormalize_logits",
    }
)
# No effect on the tokens generate() returns for a translation model called without an assistant
# model: the sampling knobs (read only with do_sample), what generate() returns besides the tokens,
# caching and compilation, the assistant settings, bookkeeping.
NO_EFFECT_FIELDS = frozenset(
    {
        "temperature",
        "top_k",
        "top_p",
        "typical_p",
        "min_p",
        "top_h",
        "epsilon_cutoff",
        "eta_cutoff",
        "output_attentions",
        "output_hidden_states",
        "output_scores",
        "output_logits",
        "return_dict_in_generate",
        "use_cache",
        "cache_implementation",
        "cache_config",
        "max_cache_len",
        "compile_config",
        "disable_compile",
        "prefill_chunk_size",
        "continuous_batching_config",
        "num_assistant_tokens",
        "num_assistant_tokens_schedule",
        "assistant_confidence_threshold",
        "assistant_lookbehind",
        "target_lookbehind",
        "is_assistant",
        "transformers_version",
        "_from_model_config",
        "_commit_hash",
        "_original_object_hash",
    }
)
# Fields that change generate()'s output, which this package does not reproduce: accepted only
# with a value that turns them off (absent, null, or the listed value).
REFUSED_FIELDS: dict[str, tuple] = {
    "suppress_tokens": ([],),
    "begin_suppress_tokens": ([],),
    "sequence_bias": ({}, []),
    "remove_invalid_values": (False,),
    "constraints": ([],),
    "force_words_ids": ([],),
    "forced_decoder_ids": ([],),
    "diversity_penalty": (0, 0.0),
    "num_beam_groups": (1,),
    "stop_strings": ([],),
    "max_time": (),
    "exponential_decay_length_penalty": (),
    "encoder_repetition_penalty": (1, 1.0),
    "encoder_no_repeat_ngram_size": (0,),
    "guidance_scale": (1, 1.0),
    "penalty_alpha": (),
    "low_memory": (False,),
    "dola_layers": (),
    "watermarking_config": (),
    "token_healing": (False,),
    "prompt_lookup_num_tokens": (),
    "max_matching_ngram_size": (),
    "assistant_early_exit": (),
    "assistant_ensemble_weight": (),
    "speculation_type": (),
    "use_mtp": (False,),
}
KNOWN_FIELDS = REPRODUCED_FIELDS | NO_EFFECT_FIELDS | frozenset(REFUSED_FIELDS)
# transformers' length budget when no max_length is configured: 20 new tokens, at most
# max_position_embeddings - 1 (generate()'s max_length counts the decoder start token).
DEFAULT_NEW_TOKENS = 20


def refused_value(key: str, value: Any) -> bool:
    """Whether ``value`` of the field ``key`` of :data:`REFUSED_FIELDS` changes generate()'s output."""
    return value is not None and value not in REFUSED_FIELDS[key]
