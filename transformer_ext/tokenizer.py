"""A character-level tokenizer with separate (or one shared) source and target vocabularies.

Every character seen in the training text is one token; ids 0-3 are reserved for the
special tokens ``<pad>``, ``<s>`` (bos), ``</s>`` (eos) and ``<unk>``, and the characters
follow in sorted order, so building a tokenizer from the same text always gives the same ids.

Characters never seen in training are an error by default (:class:`UnknownCharacterError`
names them and their positions): a character-level model cannot translate a letter it has
never seen, and silently mapping it to ``<unk>`` would produce a confident wrong answer.
``unknown="unk"`` maps them to the ``<unk>`` id instead, for callers that prefer that.

The tokenizer is stored as ``tokenizer.json`` in a model directory (docs/DESIGN.md section 5),
next to ``config.json`` and ``model.safetensors``, and copied into every export folder.

Every tokenizer kind implements :class:`Tokenizer` (what the translator, the training code and
the exporters use) and is described by a ``tokenizer.json`` whose ``"type"`` field names the
kind; :func:`load_tokenizer` reads that file and dispatches on the type (:data:`TOKENIZER_TYPES`).
A kind that needs more files (a SentencePiece model) lists them in :attr:`Tokenizer.files`.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Iterable, Optional, Protocol, Sequence, Union, runtime_checkable

from .cli import UserError
from .fsutil import atomic_write_text

logger = logging.getLogger(__name__)

__all__ = [
    "PAD_ID",
    "BOS_ID",
    "EOS_ID",
    "UNK_ID",
    "SPECIAL_TOKENS",
    "TOKENIZER_FILE",
    "TOKENIZER_TYPES",
    "TokenizerError",
    "UnknownCharacterError",
    "Tokenizer",
    "CharTokenizer",
    "load_tokenizer",
    "check_model_config",
]

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
UNK_ID = 3
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")  # index = id
TOKENIZER_FILE = "tokenizer.json"
_FORMAT = "transformer_ext.CharTokenizer"
_FORMAT_VERSION = 1
# Every field of a version-1 tokenizer.json and its JSON type.
_FIELDS = {
    "format": str,
    "version": int,
    "type": str,
    "shared": bool,
    "lowercase": bool,
    "special_tokens": dict,
    "source_vocab": list,
    "target_vocab": list,
}
_KIND_NAMES = {
    str: "string",
    int: "integer",
    bool: "boolean (true or false)",
    dict: "JSON object",
    list: "JSON list",
}


def check_description(data: Any, fmt: str, version: int, fields: dict[str, type]) -> None:
    """Check a tokenizer file's JSON against its schema: an object with ``format == fmt``, version
    ``version``, exactly the keys of ``fields``, each of its type (bools are not integers). The
    one schema check of every tokenizer kind; a TokenizerError names the field."""
    if not isinstance(data, dict):
        raise TokenizerError(f"not a {fmt} description: expected a JSON object, got {type(data).__name__}")
    if data.get("format") != fmt:
        raise TokenizerError(
            f"not a {fmt} description (missing or wrong 'format' field: {data.get('format')!r})"
        )
    found = data.get("version")
    if isinstance(found, bool) or found != version:
        raise TokenizerError(f"unsupported tokenizer format version {found!r} (this code reads {version})")
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise TokenizerError(f"unknown fields {unknown} (a version {version} tokenizer has {list(fields)})")
    missing = [key for key in fields if key not in data]
    if missing:
        raise TokenizerError(f"missing fields {missing}")
    for key, kind in fields.items():
        value = data[key]
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise TokenizerError(f"field {key!r} must be a {_KIND_NAMES[kind]}, got {value!r}"[:300])


class TokenizerError(ValueError, UserError):
    """A tokenizer file is missing or invalid, or a text cannot be encoded."""


@runtime_checkable
class Tokenizer(Protocol):
    """What every tokenizer kind provides.

    Ids: ``pad_id``, ``bos_id``, ``eos_id``, ``unk_id`` (they must agree with the model's
    config, see :func:`check_model_config`) and the two vocabulary sizes. Text: a source is
    normalised (:meth:`normalize_source`) and encoded without bos/eos; generated target ids are
    decoded up to the first eos. Files: :meth:`save` writes :attr:`files` into a folder (the
    first is always ``tokenizer.json``, whose ``"type"`` field is :attr:`type`), :meth:`load`
    reads them back; :func:`load_tokenizer` loads any registered kind.
    """

    type: str  # the "type" field of tokenizer.json, a key of TOKENIZER_TYPES
    pad_id: int
    bos_id: int
    eos_id: int
    unk_id: int

    @property
    def src_vocab_size(self) -> int: ...

    @property
    def tgt_vocab_size(self) -> int: ...

    @property
    def files(self) -> tuple[str, ...]:
        """The file names this tokenizer reads from and writes into a folder, ``tokenizer.json`` first."""
        ...

    def normalize_source(self, text: str) -> str: ...

    def encode_source(self, text: str) -> list[int]:
        """Source ids of ``text`` (no bos/eos); :class:`TokenizerError` for text it cannot encode."""
        ...

    def encode_target(self, text: str) -> list[int]:
        """Target ids of ``text`` without bos/eos (training adds them)."""
        ...

    def decode_target(self, ids: Iterable[int]) -> str:
        """Text of generated target ids, up to the first eos (special ids skipped)."""
        ...

    def save(self, directory: str | os.PathLike) -> str:
        """Write :attr:`files` into ``directory`` (atomically each); returns the ``tokenizer.json`` path."""
        ...

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "Tokenizer":
        """Read a saved tokenizer from a folder (or its ``tokenizer.json`` path)."""
        ...


_EXCERPT_CONTEXT = 20  # characters shown on each side of the first unknown character
_SHOWN_UNKNOWN = 5  # unknown characters listed by position


def excerpt(text: str, position: int, context: int = _EXCERPT_CONTEXT) -> str:
    """``text`` around ``position``, at most ``2 * context + 1`` characters, "..." where cut."""
    start, end = max(0, position - context), min(len(text), position + context + 1)
    return ("..." if start > 0 else "") + text[start:end] + ("..." if end < len(text) else "")


class UnknownCharacterError(TokenizerError):
    """The text contains characters that are not in the vocabulary.

    The message lists the first few unknown characters with their positions and an excerpt of
    the text around the first one: never the whole text (a line may be megabytes long).
    """

    def __init__(self, text: str, side: str, unknown: list[tuple[int, str]]):
        self.text = text
        self.side = side
        self.unknown = unknown  # [(position, character)]
        shown = ", ".join(f"{ch!r} at {pos}" for pos, ch in unknown[:_SHOWN_UNKNOWN])
        more = f" (and {len(unknown) - _SHOWN_UNKNOWN} more)" if len(unknown) > _SHOWN_UNKNOWN else ""
        first = unknown[0][0] if unknown else 0
        count = "1 character" if len(unknown) == 1 else f"{len(unknown)} characters"
        super().__init__(
            f"the {side} text ({len(text)} characters) has {count} outside the {side} vocabulary: "
            f"{shown}{more}; near {excerpt(text, first)!r}. The model only knows the characters it was trained on."
        )


def _build_vocab(texts: Iterable[str]) -> list[str]:
    chars: set[str] = set()
    for text in texts:
        chars.update(text)
    return list(SPECIAL_TOKENS) + sorted(chars)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _check_vocab(vocab: Sequence[str], name: str) -> list[str]:
    vocab = list(vocab)
    if tuple(vocab[: len(SPECIAL_TOKENS)]) != SPECIAL_TOKENS:
        raise TokenizerError(
            f"{name} must start with the special tokens {list(SPECIAL_TOKENS)}, "
            f"got {_short(vocab[: len(SPECIAL_TOKENS)], 200)}"
        )
    chars = vocab[len(SPECIAL_TOKENS) :]
    for i, ch in enumerate(chars, start=len(SPECIAL_TOKENS)):
        if not isinstance(ch, str) or len(ch) != 1:
            raise TokenizerError(
                f"{name} entries after the specials must be single characters, got {_short(ch)} at id {i}"
            )
    if len(set(chars)) != len(chars):
        seen: set[str] = set()
        dup = next(ch for ch in chars if ch in seen or seen.add(ch))
        raise TokenizerError(f"{name} contains duplicate characters ({dup!r})")
    return vocab


class CharTokenizer:
    """Character-level tokenizer: one id per character, plus pad/bos/eos/unk.

    Args:
        source_vocab: the source tokens, index = id; must start with :data:`SPECIAL_TOKENS`.
        target_vocab: the target tokens; ``None`` (or ``shared=True``) uses the source
            vocabulary for both sides.
        shared: one vocabulary for source and target (for a model with
            ``shared_vocab=True``, where all embeddings are tied).
        lowercase: lower-case texts before encoding a source (the demo task is lower case).

    Use :meth:`build` to make one from training text and :meth:`load` to read a saved one.
    """

    type = "char"
    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID
    unk_id = UNK_ID

    def __init__(
        self,
        source_vocab: Sequence[str],
        target_vocab: Sequence[str] | None = None,
        *,
        shared: bool = False,
        lowercase: bool = False,
    ):
        self.source_vocab = _check_vocab(source_vocab, "source vocabulary")
        if shared or target_vocab is None:
            if target_vocab is not None and list(target_vocab) != self.source_vocab:
                raise TokenizerError("shared=True but the source and target vocabularies differ")
            self.target_vocab = self.source_vocab
            self.shared = True
        else:
            self.target_vocab = _check_vocab(target_vocab, "target vocabulary")
            self.shared = False
        self.lowercase = bool(lowercase)
        self._src_index = {tok: i for i, tok in enumerate(self.source_vocab) if i >= len(SPECIAL_TOKENS)}
        self._tgt_index = {tok: i for i, tok in enumerate(self.target_vocab) if i >= len(SPECIAL_TOKENS)}

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(
        cls,
        sources: Iterable[str],
        targets: Iterable[str],
        *,
        shared: bool = False,
        lowercase: bool = False,
    ) -> "CharTokenizer":
        """Vocabularies of every character in ``sources`` and ``targets`` (sorted, after the specials)."""
        sources = [s.lower() if lowercase else s for s in sources]
        targets = list(targets)
        if shared:
            return cls(_build_vocab(sources + targets), shared=True, lowercase=lowercase)
        return cls(_build_vocab(sources), _build_vocab(targets), lowercase=lowercase)

    # ------------------------------------------------------------------ sizes
    @property
    def src_vocab_size(self) -> int:
        return len(self.source_vocab)

    @property
    def tgt_vocab_size(self) -> int:
        return len(self.target_vocab)

    @property
    def files(self) -> tuple[str, ...]:
        """Everything is in ``tokenizer.json``."""
        return (TOKENIZER_FILE,)

    # ------------------------------------------------------------------ encode / decode
    def _encode(self, text: str, index: dict[str, int], side: str, unknown: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"expected a str {side} text, got {type(text).__name__}")
        if unknown not in ("error", "unk"):
            raise ValueError(f"unknown must be 'error' or 'unk', got {unknown!r}")
        ids = [index.get(ch, UNK_ID) for ch in text]
        if unknown == "error" and UNK_ID in ids:
            bad = [(pos, text[pos]) for pos, i in enumerate(ids) if i == UNK_ID]
            raise UnknownCharacterError(text, side, bad)
        return ids

    def normalize_source(self, text: str) -> str:
        """The source text as the model sees it (lower-cased when ``lowercase`` is set)."""
        if not isinstance(text, str):
            raise TypeError(f"expected a str source text, got {type(text).__name__}")
        return text.lower() if self.lowercase else text

    def encode_source(self, text: str, *, unknown: str = "error") -> list[int]:
        """Source ids of ``text`` (no bos/eos).

        ``unknown="error"`` (default) raises :class:`UnknownCharacterError` for characters
        outside the source vocabulary; ``unknown="unk"`` maps them to ``unk_id``.
        """
        return self._encode(self.normalize_source(text), self._src_index, "source", unknown)

    def encode_target(self, text: str, *, unknown: str = "error") -> list[int]:
        """Target ids of ``text`` without bos/eos (the training code adds them)."""
        return self._encode(text, self._tgt_index, "target", unknown)

    def decode_target(self, ids: Iterable[int]) -> str:
        """Text of target ids: stops at the first eos, skips pad/bos/unk and out-of-range ids."""
        out = []
        n = len(self.target_vocab)
        for i in ids:
            i = int(i)
            if i == EOS_ID:
                break
            if len(SPECIAL_TOKENS) <= i < n:
                out.append(self.target_vocab[i])
        return "".join(out)

    def decode_source(self, ids: Iterable[int]) -> str:
        """Text of source ids (specials skipped), mainly for debugging."""
        n = len(self.source_vocab)
        return "".join(self.source_vocab[int(i)] for i in ids if len(SPECIAL_TOKENS) <= int(i) < n)

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict:
        return {
            "format": _FORMAT,
            "version": _FORMAT_VERSION,
            "type": "char",
            "shared": self.shared,
            "lowercase": self.lowercase,
            "special_tokens": {"pad": PAD_ID, "bos": BOS_ID, "eos": EOS_ID, "unk": UNK_ID},
            "source_vocab": self.source_vocab,
            "target_vocab": self.target_vocab,
        }

    @classmethod
    def from_dict(cls, data: Any) -> "CharTokenizer":
        """A tokenizer from its :meth:`to_dict` description; every field is required and checked
        (type and value), unknown fields are refused: a TokenizerError names the field."""
        check_description(data, _FORMAT, _FORMAT_VERSION, _FIELDS)
        if data["type"] != "char":
            raise TokenizerError(f"field 'type' must be 'char', got {data['type']!r}")
        expected = {"pad": PAD_ID, "bos": BOS_ID, "eos": EOS_ID, "unk": UNK_ID}
        if data["special_tokens"] != expected:
            raise TokenizerError(
                f"special token ids must be {expected}, got {data['special_tokens']!r}"[:300]
            )
        shared = data["shared"]
        if shared and data["target_vocab"] != data["source_vocab"]:
            raise TokenizerError("'shared' is true but 'source_vocab' and 'target_vocab' differ")
        return cls(
            data["source_vocab"],
            None if shared else data["target_vocab"],
            shared=shared,
            lowercase=data["lowercase"],
        )

    def save(self, directory: str | os.PathLike) -> str:
        """Write ``tokenizer.json`` into ``directory`` (created if needed) atomically; returns its path."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, TOKENIZER_FILE)
        atomic_write_text(path, json.dumps(self.to_dict(), ensure_ascii=False, indent=1) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "CharTokenizer":
        """Read ``tokenizer.json`` from a model directory (or the file path itself).

        Raises:
            FileNotFoundError: the directory or its ``tokenizer.json`` does not exist.
            TokenizerError: the file is not valid JSON or not a character tokenizer description.
        """
        path, data = _read_description(directory)
        try:
            return cls.from_dict(data)
        except TokenizerError as exc:
            raise TokenizerError(f"invalid tokenizer file {path}: {exc}") from exc

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CharTokenizer):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return (
            f"CharTokenizer(src_vocab_size={self.src_vocab_size}, tgt_vocab_size={self.tgt_vocab_size}, "
            f"shared={self.shared}, lowercase={self.lowercase})"
        )


def _read_description(directory: str | os.PathLike) -> tuple[str, Any]:
    """``(path, parsed JSON)`` of the ``tokenizer.json`` in ``directory`` (or at that path).

    Raises FileNotFoundError (folder or file missing) and TokenizerError (not UTF-8, empty,
    not JSON), both naming the file.
    """
    path = os.fspath(directory)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model directory not found: {path}")
    if os.path.isdir(path):
        path = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"tokenizer file not found: {path} (a model directory holds config.json, "
            f"model.safetensors and {TOKENIZER_FILE})"
        )
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as exc:
        raise TokenizerError(
            f"corrupt tokenizer file {path}: not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from exc
    if not text.strip():
        raise TokenizerError(f"corrupt tokenizer file {path}: the file is empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        truncated = " (truncated?)" if exc.pos >= len(text.rstrip()) else ""
        raise TokenizerError(f"corrupt tokenizer file {path}: not valid JSON{truncated}: {exc}") from exc
    except RecursionError as exc:
        raise TokenizerError(f"corrupt tokenizer file {path}: JSON nested too deeply") from exc
    return path, data


# Tokenizer kinds by the "type" field of their tokenizer.json: the class, or "module:Class" for a
# kind imported only when a file of that type is loaded (its package is optional).
TOKENIZER_TYPES: dict[str, Union[type, str]] = {
    "char": CharTokenizer,
    "sentencepiece": "transformer_ext.spm_tokenizer:SentencePieceTokenizer",
    # imported model families (transformer_ext.convert)
    "marian": "transformer_ext.pretrained_tokenizers:MarianTokenizer",
    "fairseq": "transformer_ext.pretrained_tokenizers:FairseqTokenizer",
    "t5": "transformer_ext.pretrained_tokenizers:T5Tokenizer",
}


def _tokenizer_class(kind: str) -> type:
    entry = TOKENIZER_TYPES[kind]
    if isinstance(entry, str):
        import importlib

        module, _, name = entry.partition(":")
        entry = getattr(importlib.import_module(module), name)
    return entry


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """The tokenizer saved in ``directory`` (or at the ``tokenizer.json`` path given), of whichever
    kind its ``"type"`` field names (:data:`TOKENIZER_TYPES`), loaded by that kind's ``load``
    (which reads the kind's other files from the same folder).

    Raises:
        FileNotFoundError: the folder or its ``tokenizer.json`` does not exist.
        TokenizerError: the file is corrupt, is not a description written by this package (a
            Hugging Face ``tokenizer.json``, say), names a kind this version does not know, or
            is an invalid description of its kind; the message names the file.
    """
    path, data = _read_description(directory)
    kind = data.get("type") if isinstance(data, dict) else None
    format_ = data.get("format") if isinstance(data, dict) else None
    if not (isinstance(format_, str) and format_.startswith("transformer_ext.")):
        raise TokenizerError(
            f'invalid tokenizer file {path}: not a transformer_ext tokenizer description (its "format" '
            f"field is {_short(format_)}, expected one like {_FORMAT!r}); was it written by another tool?"
        )
    if not isinstance(kind, str) or kind not in TOKENIZER_TYPES:
        raise TokenizerError(
            f"invalid tokenizer file {path}: unknown tokenizer type {_short(kind)} (this version reads "
            f"{', '.join(repr(t) for t in sorted(TOKENIZER_TYPES))}); a newer version of transformer_ext may read it"
        )
    return _tokenizer_class(kind).load(path)


def _config_value(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def check_model_config(
    tokenizer: Tokenizer,
    config: Any,
    *,
    tokenizer_file: Optional[str] = None,
    config_file: Optional[str] = None,
) -> None:
    """Check that ``tokenizer`` belongs to the model described by ``config``.

    ``config`` is a model config object or the ``model_config`` dict of a manifest (fields
    ``src_vocab_size``, ``tgt_vocab_size``, ``pad_id``, ``bos_id``, ``eos_id``). The vocabulary
    sizes and every special id must agree; a :class:`TokenizerError` names both files (the
    given names, or "the tokenizer" / "the model config") and the first id that differs.
    """
    tok_name = tokenizer_file or "the tokenizer"
    cfg_name = config_file or "the model config"
    for key, ours in (
        ("src_vocab_size", tokenizer.src_vocab_size),
        ("tgt_vocab_size", tokenizer.tgt_vocab_size),
    ):
        theirs = _config_value(config, key)
        if theirs != ours:
            side = "source" if key.startswith("src") else "target"
            raise TokenizerError(
                f"{tok_name} has a {side} vocabulary of {ours} tokens but {cfg_name} has {key} = {theirs!r}: "
                "the tokenizer belongs to another model"
            )
    for key, ours in (
        ("pad_id", tokenizer.pad_id),
        ("bos_id", tokenizer.bos_id),
        ("eos_id", tokenizer.eos_id),
    ):
        theirs = _config_value(config, key)
        if theirs != ours:
            raise TokenizerError(
                f"special id mismatch: {cfg_name} has {key} = {theirs!r} but {tok_name} has "
                f"{key[:-3]} = {ours}; the tokenizer and the model were not trained together"
            )
