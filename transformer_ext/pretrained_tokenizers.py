"""Tokenizers of imported model families behind the tokenizer protocol of :mod:`transformer_ext.tokenizer`.

Both need only ``sentencepiece`` at deploy time and reproduce the ids of the Hugging Face
tokenizers of those checkpoints (the parity tests compare them with transformers'):

* :class:`MarianTokenizer` (``"type": "marian"``, MarianMT / opus-mt): ``source.spm`` pieces
  mapped to ids through ``vocab.json`` (not SentencePiece's own ids; a piece missing from the
  vocabulary is ``<unk>``), ``</s>`` appended, no BOS; a leading ``>>xx<<`` target-language token
  of a multilingual model is kept whole. Targets use ``target.spm`` and, for a model with separate
  vocabularies, ``target_vocab.json``. Decoding maps ids back to pieces through the (target)
  vocabulary and joins them with the SentencePiece model transformers uses (the source model for a
  shared vocabulary, the target model otherwise). transformers normalises punctuation with
  sacremoses' ``MosesPunctNormalizer`` when that package is installed; this tokenizer does not
  (the same as transformers without sacremoses).
* :class:`FairseqTokenizer` (``"type": "fairseq"``, M2M100 and NLLB-200): SentencePiece pieces with
  fairseq's ids (``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3; M2M100 maps pieces through
  ``vocab.json``, NLLB adds 1 to SentencePiece's id), then one token per language. A source is
  ``[src_lang] pieces </s>`` (NLLB's legacy mode: ``pieces </s> [src_lang]``); the decoder starts
  from ``</s>`` and the target language is forced as the first generated token
  (:meth:`FairseqTokenizer.forced_target_prefix`).

The source language (fairseq) or the target language (multilingual Marian, fairseq) is chosen with
:meth:`with_languages`; an unknown or missing code is a :class:`~transformer_ext.tokenizer.TokenizerError`
that lists the codes the model knows. :meth:`encode_source` returns exactly the ids the encoder
reads (special tokens included); :meth:`encode_target` the ids a target is trained on before the
training code appends ``</s>`` and prepends the decoder start (for fairseq: the target language token
first, as transformers labels a target).

Files in a model folder: ``tokenizer.json`` (this package's description: kind, special ids,
languages, SHA-256 of each file) next to the original files, copied unchanged by the converter
(:mod:`transformer_ext.convert`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from typing import Any, Iterable, Mapping, Optional, Sequence

from .fsutil import atomic_write_bytes, atomic_write_text
from .spm_tokenizer import _processor
from .tokenizer import TOKENIZER_FILE, TokenizerError, _read_description, check_description

logger = logging.getLogger(__name__)

__all__ = [
    "MarianTokenizer",
    "FairseqTokenizer",
    "T5Tokenizer",
    "M2M100_LANGUAGE_CODES",
    "WMT21_LANGUAGE_CODES",
]

SPIECE_UNDERLINE = "\u2581"

# The language lists of fairseq's M2M-100 releases (the order gives the ids: after the vocabulary).
M2M100_LANGUAGE_CODES = tuple(
    "af am ar ast az ba be bg bn br bs ca ceb cs cy da de el en es et fa ff fi fr fy ga gd gl gu ha he "
    "hi hr ht hu hy id ig ilo is it ja jv ka kk km kn ko lb lg ln lo lt lv mg mk ml mn mr ms my ne nl no "
    "ns oc or pa pl ps pt ro ru sd si sk sl so sq sr ss su sv sw ta th tl tn tr uk ur uz vi wo xh yi yo "
    "zh zu".split()
)
WMT21_LANGUAGE_CODES = ("en", "ha", "is", "ja", "cs", "ru", "zh", "de")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_files(directory: str, expected: Mapping[str, str]) -> dict[str, bytes]:
    """The bytes of each file named by ``expected`` (name -> SHA-256), checked against its hash."""
    blobs = {}
    for name in sorted(expected):
        path = os.path.join(directory, name)
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            raise FileNotFoundError(f"tokenizer file not found: {path} (named by {TOKENIZER_FILE})") from None
        digest = _sha256(blob)
        if digest != expected[name]:
            raise TokenizerError(
                f"{path} does not match {TOKENIZER_FILE} (SHA-256 {digest[:12]}..., expected "
                f"{str(expected[name])[:12]}...): the files come from different tokenizers"
            )
        blobs[name] = blob
    return blobs


def _vocab_from_json(blob: bytes, name: str) -> dict[str, int]:
    try:
        vocab = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{name} is not a JSON vocabulary: {exc}") from None
    if not isinstance(vocab, dict) or not vocab:
        raise TokenizerError(f"{name} must map tokens to ids (a non-empty JSON object)")
    for token, i in vocab.items():
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise TokenizerError(f"{name}: token {token!r} has id {i!r}, expected an integer >= 0"[:300])
    if len(set(vocab.values())) != len(vocab):
        raise TokenizerError(f"{name}: two tokens share one id")
    return vocab


def _known(codes: Iterable[str], limit: int = 30) -> str:
    codes = list(codes)
    shown = ", ".join(codes[:limit])
    return shown + (f", ... ({len(codes)} in all)" if len(codes) > limit else "")


def _check_text(text: Any, side: str) -> str:
    if not isinstance(text, str):
        raise TypeError(f"expected a str {side} text, got {type(text).__name__}")
    return text


# ------------------------------------------------------------------------------------------
# Marian
# ------------------------------------------------------------------------------------------

MARIAN_FILES = ("source.spm", "target.spm", "vocab.json", "target_vocab.json")
_MARIAN_FORMAT = "transformer_ext.MarianTokenizer"
_MARIAN_FIELDS = {
    "format": str,
    "version": int,
    "type": str,
    "separate_vocabs": bool,
    "special_tokens": dict,
    "src_vocab_size": int,
    "tgt_vocab_size": int,
    "target_lang": (str, type(None)),
    "files": dict,
}


def _surface(piece: str) -> str:
    """A SentencePiece piece as the text it stands for (the word-boundary mark removed)."""
    return piece.replace("\u2581", " ").strip()


class _FolderLoader:
    """``load(directory)``: the tokenizer described by the folder's ``tokenizer.json``."""

    @classmethod
    def load(cls, directory: str | os.PathLike):
        path, data = _read_description(directory)
        try:
            return cls.from_dict(data, os.path.dirname(path))
        except TokenizerError as exc:
            raise TokenizerError(f"invalid tokenizer file {path}: {exc}") from exc


class MarianTokenizer(_FolderLoader):
    """The MarianMT (opus-mt) tokenizer: see the module docstring.

    Args:
        source_spm, target_spm: the serialized SentencePiece models (``source.spm``, ``target.spm``).
        vocab: ``vocab.json`` as bytes (token -> id; the source vocabulary, and the target one too
            unless ``target_vocab`` is given).
        target_vocab: ``target_vocab.json`` as bytes, for a model with separate vocabularies.
        target_lang: the ``>>xx<<`` code put in front of every source that has none (a
            multilingual model's target language), e.g. ``"fra"`` or ``">>fra<<"``.
    """

    type = "marian"

    def __init__(
        self,
        source_spm: bytes,
        target_spm: bytes,
        vocab: bytes,
        target_vocab: Optional[bytes] = None,
        *,
        target_lang: Optional[str] = None,
    ):
        self._blobs = {
            "source.spm": bytes(source_spm),
            "target.spm": bytes(target_spm),
            "vocab.json": bytes(vocab),
        }
        if target_vocab is not None:
            self._blobs["target_vocab.json"] = bytes(target_vocab)
        self.separate_vocabs = target_vocab is not None
        self._src = _processor(self._blobs["source.spm"], "source.spm")
        self._tgt = _processor(self._blobs["target.spm"], "target.spm")
        self.encoder = _vocab_from_json(self._blobs["vocab.json"], "vocab.json")
        self.target_encoder = (
            _vocab_from_json(self._blobs["target_vocab.json"], "target_vocab.json")
            if self.separate_vocabs
            else self.encoder
        )
        self.decoder = {i: t for t, i in self.target_encoder.items()}
        for name, table in (("vocab.json", self.encoder), ("the target vocabulary", self.target_encoder)):
            for token in ("</s>", "<unk>"):
                if token not in table:
                    raise TokenizerError(
                        f"{name} has no {token} token (a Marian vocabulary has </s> and <unk>)"
                    )
        if "<pad>" not in self.target_encoder:
            raise TokenizerError("the target vocabulary has no <pad> token (Marian decoding starts from it)")
        self.eos_id = self.target_encoder["</s>"]
        self.unk_id = self.target_encoder["<unk>"]
        self.pad_id = self.target_encoder["<pad>"]
        self.bos_id = self.pad_id  # the decoder starts from <pad>: Marian has no BOS token
        if self.encoder["</s>"] != self.eos_id:
            raise TokenizerError(
                f"vocab.json has </s> = {self.encoder['</s>']} but the target vocabulary {self.eos_id}"
            )
        self._src_unk = self.encoder["<unk>"]
        # the >>xx<< codes of a multilingual model (transformers lists them from the shared vocabulary)
        self.languages = tuple(t for t in self.encoder if t.startswith(">>") and t.endswith("<<"))
        self.target_lang = None if target_lang is None else self._code(target_lang)

    # ------------------------------------------------------------------ languages
    def _code(self, lang: str) -> str:
        if not isinstance(lang, str) or not lang:
            raise TokenizerError(f"a target language is a code such as 'fra' or '>>fra<<', got {lang!r}")
        code = lang if lang.startswith(">>") and lang.endswith("<<") else f">>{lang}<<"
        if code not in self.encoder:
            if not self.languages:
                raise TokenizerError(
                    f"this Marian model translates into one language and knows no target-language codes "
                    f"(got {lang!r}); translate without --target-lang"
                )
            raise TokenizerError(
                f"unknown target language {lang!r}; this model knows {_known(self.languages)}"
            )
        return code

    def with_languages(self, source_lang: Optional[str] = None, target_lang: Optional[str] = None):
        """A copy that prepends ``>>target_lang<<`` to sources without a code. Marian models have no
        source-language token: ``source_lang`` is accepted only when it is None."""
        if source_lang is not None:
            raise TokenizerError(
                f"a Marian model reads no source-language code (got --source-lang {source_lang!r}); "
                "its source language is fixed by the model"
            )
        other = copy.copy(self)
        other.target_lang = None if target_lang is None else self._code(target_lang)
        return other

    def forced_target_prefix(self) -> list[int]:
        """Tokens forced at the start of every translation: none for Marian."""
        return []

    # ------------------------------------------------------------------ sizes and files
    @property
    def src_vocab_size(self) -> int:
        return len(self.encoder)

    @property
    def tgt_vocab_size(self) -> int:
        return len(self.target_encoder)

    @property
    def files(self) -> tuple[str, ...]:
        return (TOKENIZER_FILE, *sorted(self._blobs))

    # ------------------------------------------------------------------ encode / decode
    def normalize_source(self, text: str) -> str:
        return _check_text(text, "source")

    def _split_code(self, text: str) -> tuple[list[str], str]:
        if text.startswith(">>"):
            end = text.find("<<")
            if end != -1:
                return [text[: end + 2]], text[end + 2 :]
        return [], text

    def source_pieces(self, text: str) -> list[str]:
        code, rest = self._split_code(_check_text(text, "source"))
        if not code and self.target_lang is not None:
            code = [self.target_lang]
        if code and code[0] not in self.encoder:
            raise TokenizerError(
                f"unknown target language {code[0]!r}; this model knows {_known(self.languages)}"
            )
        if not code and self.languages:
            raise TokenizerError(
                "this multilingual Marian model needs a target language: start the source with >>xx<< "
                f"or pass --target-lang; it knows {_known(self.languages)}"
            )
        return code + list(self._src.encode(rest, out_type=str))

    def encode_source(self, text: str) -> list[int]:
        """The encoder's ids of ``text``: [``>>xx<<``] pieces ``</s>``."""
        return [self.encoder.get(p, self._src_unk) for p in self.source_pieces(text)] + [self.encoder["</s>"]]

    def encode_sources(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode_source(t) for t in texts]

    def unknown_pieces(self, text: str) -> list[str]:
        """The source pieces of ``text`` outside the vocabulary (``<unk>`` in :meth:`encode_source`)."""
        return [_surface(p) for p in self.source_pieces(text) if p not in self.encoder]

    def encode_target(self, text: str) -> list[int]:
        """Target ids of ``text`` (target SentencePiece model and vocabulary) without ``</s>``; a
        leading ``>>xx<<`` is kept whole, as transformers does on both sides."""
        code, rest = self._split_code(_check_text(text, "target"))
        pieces = code + list(self._tgt.encode(rest, out_type=str))
        return [self.target_encoder.get(p, self.unk_id) for p in pieces]

    def encode_targets(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode_target(t) for t in texts]

    def decode_target(self, ids: Iterable[int]) -> str:
        """Text of generated target ids, up to the first ``</s>``; ``<pad>`` and ``<unk>`` skipped."""
        pieces = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i in (self.pad_id, self.unk_id) or i not in self.decoder:
                continue
            pieces.append(self.decoder[i])
        sp = self._tgt if self.separate_vocabs else self._src  # as transformers decodes
        return sp.decode_pieces(pieces).replace(SPIECE_UNDERLINE, " ").strip()

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict:
        return {
            "format": _MARIAN_FORMAT,
            "version": 1,
            "type": self.type,
            "separate_vocabs": self.separate_vocabs,
            "special_tokens": {
                "pad": self.pad_id,
                "bos": self.bos_id,
                "eos": self.eos_id,
                "unk": self.unk_id,
            },
            "src_vocab_size": self.src_vocab_size,
            "tgt_vocab_size": self.tgt_vocab_size,
            "target_lang": self.target_lang,
            "files": {name: _sha256(blob) for name, blob in sorted(self._blobs.items())},
        }

    def save(self, directory: str | os.PathLike) -> str:
        os.makedirs(directory, exist_ok=True)
        for name, blob in self._blobs.items():
            atomic_write_bytes(os.path.join(directory, name), blob)
        path = os.path.join(directory, TOKENIZER_FILE)
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: Any, directory: str | os.PathLike) -> "MarianTokenizer":
        _check(data, _MARIAN_FORMAT, _MARIAN_FIELDS, cls.type)
        expected = {"source.spm", "target.spm", "vocab.json"} | (
            {"target_vocab.json"} if data["separate_vocabs"] else set()
        )
        if set(data["files"]) != expected:
            raise TokenizerError(f"field 'files' must name {sorted(expected)}, got {sorted(data['files'])}")
        blobs = _read_files(os.fspath(directory), data["files"])
        tok = cls(
            blobs["source.spm"],
            blobs["target.spm"],
            blobs["vocab.json"],
            blobs.get("target_vocab.json"),
            target_lang=data["target_lang"],
        )
        _check_same(tok.to_dict(), data)
        return tok

    def __repr__(self) -> str:
        return (
            f"MarianTokenizer(src_vocab_size={self.src_vocab_size}, tgt_vocab_size={self.tgt_vocab_size}, "
            f"separate_vocabs={self.separate_vocabs}, languages={len(self.languages)})"
        )


def _check(data: Any, fmt: str, fields: dict, kind: str) -> None:
    plain = {k: (v if isinstance(v, type) else object) for k, v in fields.items()}
    check_description(data, fmt, 1, plain)
    for key, types in fields.items():
        if not isinstance(types, type) and not isinstance(data[key], types):
            raise TokenizerError(f"field {key!r} has the wrong type: {data[key]!r}"[:300])
    if data["type"] != kind:
        raise TokenizerError(f"field 'type' must be {kind!r}, got {data['type']!r}")


def _check_same(ours: dict, data: dict) -> None:
    for key, value in ours.items():
        if data.get(key) != value:
            raise TokenizerError(
                f"field {key!r} is {data.get(key)!r} but the tokenizer files give {value!r}"[:400]
            )


# ------------------------------------------------------------------------------------------
# fairseq: M2M100 and NLLB
# ------------------------------------------------------------------------------------------

FAIRSEQ_SPECIALS = {"bos": 0, "pad": 1, "eos": 2, "unk": 3}
FLAVOURS = ("m2m100", "nllb")
_FAIRSEQ_FORMAT = "transformer_ext.FairseqTokenizer"
_FAIRSEQ_FIELDS = {
    "format": str,
    "version": int,
    "type": str,
    "flavour": str,
    "legacy": bool,
    "special_tokens": dict,
    "vocab_size": int,
    "languages": dict,
    "source_lang": (str, type(None)),
    "target_lang": (str, type(None)),
    "files": dict,
}


class FairseqTokenizer(_FolderLoader):
    """The M2M100 / NLLB-200 tokenizer: see the module docstring.

    Args:
        flavour: ``"m2m100"`` (pieces mapped through ``vocab``) or ``"nllb"`` (SentencePiece id + 1).
        spm_model: ``sentencepiece.bpe.model`` as bytes.
        languages: language code -> token id (M2M100's codes are ``en``, written ``__en__`` as
            tokens; NLLB's ``eng_Latn``).
        vocab_size: the model's vocabulary (its embedding rows, at least every id above).
        vocab: ``vocab.json`` as bytes (M2M100 only).
        legacy: NLLB's legacy mode (source ``pieces </s> [src_lang]``).
        source_lang, target_lang: the default languages (see :meth:`with_languages`).
    """

    type = "fairseq"
    pad_id = FAIRSEQ_SPECIALS["pad"]
    eos_id = FAIRSEQ_SPECIALS["eos"]
    unk_id = FAIRSEQ_SPECIALS["unk"]
    bos_id = FAIRSEQ_SPECIALS["eos"]  # the decoder starts from </s> (fairseq's decoder start)

    def __init__(
        self,
        flavour: str,
        spm_model: bytes,
        languages: Mapping[str, int],
        vocab_size: int,
        *,
        vocab: Optional[bytes] = None,
        legacy: bool = False,
        source_lang: Optional[str] = None,
        target_lang: Optional[str] = None,
    ):
        if flavour not in FLAVOURS:
            raise TokenizerError(f"flavour must be one of {list(FLAVOURS)}, got {flavour!r}")
        self.flavour = flavour
        self.legacy = bool(legacy)
        self._blobs = {"sentencepiece.bpe.model": bytes(spm_model)}
        self._sp = _processor(self._blobs["sentencepiece.bpe.model"], "sentencepiece.bpe.model")
        if flavour == "m2m100":
            if vocab is None:
                raise TokenizerError("an M2M100 tokenizer needs vocab.json")
            self._blobs["vocab.json"] = bytes(vocab)
            self.encoder = _vocab_from_json(self._blobs["vocab.json"], "vocab.json")
            for token, i in (("<s>", 0), ("<pad>", 1), ("</s>", 2), ("<unk>", 3)):
                if self.encoder.get(token) != i:
                    raise TokenizerError(
                        f"vocab.json must map {token} to {i} (fairseq's ids), got {self.encoder.get(token)!r}"
                    )
            self._piece_to_id = self.encoder
            self._id_to_piece = {i: t for t, i in self.encoder.items()}
        else:
            self.encoder = None
            n = int(self._sp.get_piece_size())
            self._piece_to_id = None
            self._id_to_piece = {i + 1: self._sp.id_to_piece(i) for i in range(3, n)}
        if not languages:
            raise TokenizerError("a fairseq multilingual tokenizer needs its language codes")
        self.languages = {str(k): int(v) for k, v in languages.items()}
        self.vocab_size = int(vocab_size)
        top = max(max(self._id_to_piece, default=0), max(self.languages.values()))
        if top >= self.vocab_size:
            raise TokenizerError(
                f"the tokenizer uses id {top} but the model's vocabulary has {self.vocab_size} tokens"
            )
        clash = set(self.languages.values()) & set(self._id_to_piece)
        if clash:
            raise TokenizerError(f"language ids {sorted(clash)[:5]} are also piece ids")
        self._lang_ids = frozenset(self.languages.values())
        self.source_lang = None if source_lang is None else self._lang("source", source_lang)
        self.target_lang = None if target_lang is None else self._lang("target", target_lang)

    # ------------------------------------------------------------------ languages
    def _lang(self, side: str, code: str) -> str:
        if (
            isinstance(code, str)
            and self.flavour == "m2m100"
            and code.startswith("__")
            and code.endswith("__")
        ):
            code = code[2:-2]
        if code not in self.languages:
            raise TokenizerError(
                f"unknown {side} language {code!r}; this model knows {_known(self.languages)}"
            )
        return code

    def with_languages(self, source_lang: Optional[str] = None, target_lang: Optional[str] = None):
        """A copy with these languages (None keeps the current one); unknown codes are errors."""
        other = copy.copy(self)
        if source_lang is not None:
            other.source_lang = self._lang("source", source_lang)
        if target_lang is not None:
            other.target_lang = self._lang("target", target_lang)
        return other

    def _require(self, side: str) -> int:
        code = self.source_lang if side == "source" else self.target_lang
        if code is None:
            flag = "--source-lang" if side == "source" else "--target-lang"
            raise TokenizerError(
                f"this model needs a {side} language ({flag}); it knows {_known(self.languages)}"
            )
        return self.languages[code]

    def forced_target_prefix(self) -> list[int]:
        """The target-language token, forced as the first generated token (transformers'
        ``forced_bos_token_id``)."""
        return [self._require("target")]

    # ------------------------------------------------------------------ sizes and files
    @property
    def src_vocab_size(self) -> int:
        return self.vocab_size

    @property
    def tgt_vocab_size(self) -> int:
        return self.vocab_size

    @property
    def files(self) -> tuple[str, ...]:
        return (TOKENIZER_FILE, *sorted(self._blobs))

    # ------------------------------------------------------------------ encode / decode
    def normalize_source(self, text: str) -> str:
        return _check_text(text, "source")

    def _piece_ids(self, text: str) -> list[int]:
        pieces = self._sp.encode(text, out_type=str)
        if self._piece_to_id is not None:
            return [self._piece_to_id.get(p, self.unk_id) for p in pieces]
        out = []
        for p in pieces:
            i = self._sp.piece_to_id(p)
            out.append(i + 1 if i > 2 else self.unk_id)  # SentencePiece's <unk>/<s>/</s> are 0/1/2
        return out

    def unknown_pieces(self, text: str) -> list[str]:
        """The source pieces of ``text`` outside the vocabulary (``<unk>`` in :meth:`encode_source`)."""
        text = _check_text(text, "source")
        pieces = self._sp.encode(text, out_type=str)
        return [_surface(p) for p, i in zip(pieces, self._piece_ids(text)) if i == self.unk_id]

    def encode_source(self, text: str) -> list[int]:
        """The encoder's ids: ``[src_lang] pieces </s>`` (NLLB legacy: ``pieces </s> [src_lang]``)."""
        lang = self._require("source")
        ids = self._piece_ids(_check_text(text, "source"))
        if self.legacy:
            return ids + [self.eos_id, lang]
        return [lang] + ids + [self.eos_id]

    def encode_sources(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode_source(t) for t in texts]

    def encode_target(self, text: str) -> list[int]:
        """``[tgt_lang] pieces`` (the training code appends ``</s>`` and prepends the decoder start)."""
        return [self._require("target")] + self._piece_ids(_check_text(text, "target"))

    def encode_targets(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode_target(t) for t in texts]

    def decode_target(self, ids: Iterable[int]) -> str:
        """Text of generated ids up to the first ``</s>``; special and language tokens skipped."""
        pieces = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i in self._lang_ids or i not in self._id_to_piece or i <= 3:
                continue
            pieces.append(self._id_to_piece[i])
        return self._sp.decode(pieces).strip()

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict:
        return {
            "format": _FAIRSEQ_FORMAT,
            "version": 1,
            "type": self.type,
            "flavour": self.flavour,
            "legacy": self.legacy,
            "special_tokens": {
                "pad": self.pad_id,
                "bos": self.bos_id,
                "eos": self.eos_id,
                "unk": self.unk_id,
            },
            "vocab_size": self.vocab_size,
            "languages": dict(self.languages),
            "source_lang": self.source_lang,
            "target_lang": self.target_lang,
            "files": {name: _sha256(blob) for name, blob in sorted(self._blobs.items())},
        }

    def save(self, directory: str | os.PathLike) -> str:
        os.makedirs(directory, exist_ok=True)
        for name, blob in self._blobs.items():
            atomic_write_bytes(os.path.join(directory, name), blob)
        path = os.path.join(directory, TOKENIZER_FILE)
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: Any, directory: str | os.PathLike) -> "FairseqTokenizer":
        _check(data, _FAIRSEQ_FORMAT, _FAIRSEQ_FIELDS, cls.type)
        if data["flavour"] not in FLAVOURS:
            raise TokenizerError(f"field 'flavour' must be one of {list(FLAVOURS)}, got {data['flavour']!r}")
        expected = {"sentencepiece.bpe.model"} | ({"vocab.json"} if data["flavour"] == "m2m100" else set())
        if set(data["files"]) != expected:
            raise TokenizerError(f"field 'files' must name {sorted(expected)}, got {sorted(data['files'])}")
        blobs = _read_files(os.fspath(directory), data["files"])
        tok = cls(
            data["flavour"],
            blobs["sentencepiece.bpe.model"],
            data["languages"],
            data["vocab_size"],
            vocab=blobs.get("vocab.json"),
            legacy=data["legacy"],
            source_lang=data["source_lang"],
            target_lang=data["target_lang"],
        )
        _check_same(tok.to_dict(), data)
        return tok

    def __repr__(self) -> str:
        return (
            f"FairseqTokenizer({self.flavour}, vocab_size={self.vocab_size}, "
            f"languages={len(self.languages)}, "
            f"legacy={self.legacy})"
        )


# ------------------------------------------------------------------------------------------
# T5 family: T5, mT5, UMT5, MADLAD-400
# ------------------------------------------------------------------------------------------

_T5_FORMAT = "transformer_ext.T5Tokenizer"
_T5_FIELDS = {
    "format": str,
    "version": int,
    "type": str,
    "special_tokens": dict,
    "vocab_size": int,
    "languages": dict,
    "target_lang": (str, type(None)),
    "files": dict,
}


def _is_language_piece(piece: str) -> bool:
    """MADLAD-400's target-language tokens: ``<2xx>`` pieces of the SentencePiece model."""
    return piece.startswith("<2") and piece.endswith(">") and len(piece) > 3 and " " not in piece


class T5Tokenizer(_FolderLoader):
    """The T5 / mT5 / UMT5 / MADLAD-400 tokenizer (``"type": "t5"``).

    SentencePiece's own ids (``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2), ``</s>`` appended to a source,
    no BOS; the decoder starts from ``<pad>``. The model's vocabulary may be larger than the
    SentencePiece model (T5's ``<extra_id_N>`` sentinels); those ids decode to nothing.

    A model whose SentencePiece model has ``<2xx>`` pieces (MADLAD-400) is multilingual: a source
    starts with the target-language token. :meth:`with_languages` (``--target-lang xx``) puts it
    there; a source that already starts with a ``<2xx>`` token is taken as it is, and a source with
    neither is an error that says how to give the language.
    """

    type = "t5"
    pad_id = 0
    eos_id = 1
    unk_id = 2
    bos_id = 0  # the decoder starts from <pad>

    def __init__(self, spm_model: bytes, vocab_size: int, *, target_lang: Optional[str] = None):
        self._blobs = {"spiece.model": bytes(spm_model)}
        self._sp = _processor(self._blobs["spiece.model"], "spiece.model")
        ids = {"pad": self._sp.pad_id(), "eos": self._sp.eos_id(), "unk": self._sp.unk_id()}
        if ids != {"pad": 0, "eos": 1, "unk": 2}:
            raise TokenizerError(f"spiece.model has special ids {ids}; a T5 model has pad 0, eos 1, unk 2")
        self.n_pieces = int(self._sp.get_piece_size())
        self.vocab_size = int(vocab_size)
        if self.n_pieces > self.vocab_size:
            raise TokenizerError(
                f"spiece.model has {self.n_pieces} pieces but the model's vocabulary has {self.vocab_size} tokens"
            )
        self.languages = {
            p[2:-1]: i for i in range(self.n_pieces) if _is_language_piece(p := self._sp.id_to_piece(i))
        }
        self.target_lang = None if target_lang is None else self._lang(target_lang)

    def _lang(self, code: str) -> str:
        if isinstance(code, str) and _is_language_piece(code):
            code = code[2:-1]
        if not self.languages:
            raise TokenizerError(
                "this T5 model has no target-language tokens (<2xx>): it translates as its sources say"
            )
        if code not in self.languages:
            raise TokenizerError(
                f"unknown target language {code!r}; this model knows {_known(self.languages)}"
            )
        return code

    def with_languages(self, source_lang: Optional[str] = None, target_lang: Optional[str] = None):
        """A copy with this target language (MADLAD-400); a T5 model has no source-language token."""
        other = copy.copy(self)
        if target_lang is not None:
            other.target_lang = self._lang(target_lang)
        return other

    def forced_target_prefix(self) -> list[int]:
        return []

    @property
    def src_vocab_size(self) -> int:
        return self.vocab_size

    @property
    def tgt_vocab_size(self) -> int:
        return self.vocab_size

    @property
    def files(self) -> tuple[str, ...]:
        return (TOKENIZER_FILE, *sorted(self._blobs))

    def normalize_source(self, text: str) -> str:
        return _check_text(text, "source")

    def encode_source(self, text: str) -> list[int]:
        """``pieces </s>``; for MADLAD-400 ``<2xx> pieces </s>`` (see the class docstring)."""
        text = _check_text(text, "source")
        if self.languages:
            first = text.split(maxsplit=1)[0] if text.split() else ""
            if self.target_lang is not None and not _is_language_piece(first):
                text = f"<2{self.target_lang}> {text}"
            elif not _is_language_piece(first):
                raise TokenizerError(
                    "this model needs the target language: give --target-lang (one of "
                    f"{_known(self.languages, 10)}) or start each source with its <2xx> token"
                )
        return list(self._sp.encode(text, out_type=int)) + [self.eos_id]

    def encode_sources(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode_source(t) for t in texts]

    def encode_target(self, text: str) -> list[int]:
        """The target's pieces (the training code appends ``</s>`` and prepends the decoder start)."""
        return list(self._sp.encode(_check_text(text, "target"), out_type=int))

    def encode_targets(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode_target(t) for t in texts]

    def decode_target(self, ids: Iterable[int]) -> str:
        """Text of generated ids up to the first ``</s>``; pad, unk and sentinel ids skipped."""
        kept = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i in (self.pad_id, self.unk_id) or not 0 <= i < self.n_pieces:
                continue
            kept.append(i)
        return self._sp.decode(kept).strip()

    def to_dict(self) -> dict:
        return {
            "format": _T5_FORMAT,
            "version": 1,
            "type": self.type,
            "special_tokens": {
                "pad": self.pad_id,
                "bos": self.bos_id,
                "eos": self.eos_id,
                "unk": self.unk_id,
            },
            "vocab_size": self.vocab_size,
            "languages": dict(self.languages),
            "target_lang": self.target_lang,
            "files": {name: _sha256(blob) for name, blob in sorted(self._blobs.items())},
        }

    def save(self, directory: str | os.PathLike) -> str:
        os.makedirs(directory, exist_ok=True)
        for name, blob in self._blobs.items():
            atomic_write_bytes(os.path.join(directory, name), blob)
        path = os.path.join(directory, TOKENIZER_FILE)
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: Any, directory: str | os.PathLike) -> "T5Tokenizer":
        _check(data, _T5_FORMAT, _T5_FIELDS, cls.type)
        if set(data["files"]) != {"spiece.model"}:
            raise TokenizerError(f"field 'files' must name ['spiece.model'], got {sorted(data['files'])}")
        blobs = _read_files(os.fspath(directory), data["files"])
        tok = cls(blobs["spiece.model"], data["vocab_size"], target_lang=data["target_lang"])
        _check_same(tok.to_dict(), data)
        return tok

    def __repr__(self) -> str:
        return f"T5Tokenizer(vocab_size={self.vocab_size}, languages={len(self.languages)})"
