"""SentencePiece subword tokenizer behind the tokenizer protocol of :mod:`transformer_ext.tokenizer`.

One SentencePiece model for both languages (``shared=True``: the model's source embedding,
target embedding and output projection are then tied) or one per side. The special ids are
those of the model config and of :class:`~transformer_ext.tokenizer.CharTokenizer` (pad 0,
bos 1, eos 2, unk 3): SentencePiece is trained with exactly these ids, so no id is remapped
between the tokenizer and the model.

Files in a model folder: ``tokenizer.json`` (``"type": "sentencepiece"``, the model type, the
vocabulary sizes, the special ids and the SHA-256 of each model file) and ``spm.model`` (shared)
or ``spm.src.model`` + ``spm.tgt.model``. Loading checks every field and the checksums, so a
model file from another tokenizer is an error naming the file, never a silent wrong vocabulary.

:meth:`SentencePieceTokenizer.train` learns the vocabularies from training text only (unigram or
BPE) and rephrases SentencePiece's errors (a vocabulary larger than the text supports) as a
:class:`~transformer_ext.tokenizer.TokenizerError` saying what to change.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
from typing import Any, Iterable, Optional, Sequence

from .fsutil import atomic_write_bytes, atomic_write_text
from .tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TOKENIZER_FILE,
    UNK_ID,
    TokenizerError,
    _read_description,
    check_description,
)

logger = logging.getLogger(__name__)

__all__ = [
    "SentencePieceTokenizer",
    "MODEL_TYPES",
    "SHARED_MODEL_FILE",
    "SOURCE_MODEL_FILE",
    "TARGET_MODEL_FILE",
    "load_any_tokenizer",
]

MODEL_TYPES = ("unigram", "bpe")
SHARED_MODEL_FILE = "spm.model"
SOURCE_MODEL_FILE = "spm.src.model"
TARGET_MODEL_FILE = "spm.tgt.model"
_FORMAT = "transformer_ext.SentencePieceTokenizer"
_FORMAT_VERSION = 1
_FIELDS = {
    "format": str,
    "version": int,
    "type": str,
    "shared": bool,
    "model_type": str,
    "special_tokens": dict,
    "src_vocab_size": int,
    "tgt_vocab_size": int,
    "files": dict,
}
_SPECIALS = {"pad": PAD_ID, "bos": BOS_ID, "eos": EOS_ID, "unk": UNK_ID}
_MIN_VOCAB = 8  # the 4 specials and a few pieces


def _spm():
    try:
        import sentencepiece
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise TokenizerError(
            "the SentencePiece tokenizer needs the sentencepiece package: pip install sentencepiece==0.2.3"
        ) from exc
    return sentencepiece


def _processor(model_bytes: bytes, name: str):
    sp = _spm().SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(model_bytes)
    except (RuntimeError, OSError, TypeError) as exc:
        raise TokenizerError(f"{name} is not a SentencePiece model: {exc}") from None
    return sp


def _check_processor_ids(sp, name: str) -> None:
    ids = {"pad": sp.pad_id(), "bos": sp.bos_id(), "eos": sp.eos_id(), "unk": sp.unk_id()}
    if ids != _SPECIALS:
        raise TokenizerError(
            f"{name} has special ids {ids}, the model's are {_SPECIALS}: it was not trained by "
            "transformer_ext (the ids would need remapping)"
        )


class SentencePieceTokenizer:
    """Subword tokenizer over one shared or two SentencePiece models (see the module docstring).

    Build one with :meth:`train` or :meth:`load`; ``src_model`` / ``tgt_model`` are serialized
    SentencePiece models (``tgt_model`` is None when ``shared``).
    """

    type = "sentencepiece"
    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID
    unk_id = UNK_ID

    def __init__(self, src_model: bytes, tgt_model: Optional[bytes] = None, *, model_type: str = "unigram"):
        if model_type not in MODEL_TYPES:
            raise TokenizerError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
        self.shared = tgt_model is None
        self.model_type = model_type
        self._src_bytes = bytes(src_model)
        self._tgt_bytes = self._src_bytes if self.shared else bytes(tgt_model)
        self._src = _processor(self._src_bytes, "the source SentencePiece model")
        self._tgt = (
            self._src if self.shared else _processor(self._tgt_bytes, "the target SentencePiece model")
        )
        _check_processor_ids(self._src, "the source SentencePiece model")
        _check_processor_ids(self._tgt, "the target SentencePiece model")

    # ------------------------------------------------------------------ training
    @classmethod
    def train(
        cls,
        sources: Sequence[str],
        targets: Sequence[str],
        *,
        vocab_size: int,
        model_type: str = "unigram",
        shared: bool = True,
        character_coverage: float = 1.0,
        seed_sentences: int = 2_000_000,
        threads: int = 1,
    ) -> "SentencePieceTokenizer":
        """Learn SentencePiece vocabularies of ``vocab_size`` pieces (specials included) from the texts.

        ``shared``: one model trained on sources and targets together; otherwise one per side,
        each of ``vocab_size`` pieces. A size the text cannot support is a TokenizerError that
        says the largest size SentencePiece would accept.
        """
        if model_type not in MODEL_TYPES:
            raise TokenizerError(
                f"--spm-model-type must be one of {', '.join(MODEL_TYPES)}, got {model_type!r}"
            )
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < _MIN_VOCAB:
            raise TokenizerError(f"--vocab-size must be an integer >= {_MIN_VOCAB}, got {vocab_size!r}")
        if shared:
            return cls(
                _train_one(
                    list(sources) + list(targets),
                    vocab_size,
                    model_type,
                    "source and target",
                    character_coverage,
                    seed_sentences,
                    threads,
                ),
                model_type=model_type,
            )
        return cls(
            _train_one(
                sources, vocab_size, model_type, "source", character_coverage, seed_sentences, threads
            ),
            _train_one(
                targets, vocab_size, model_type, "target", character_coverage, seed_sentences, threads
            ),
            model_type=model_type,
        )

    # ------------------------------------------------------------------ sizes and files
    @property
    def src_vocab_size(self) -> int:
        return int(self._src.get_piece_size())

    @property
    def tgt_vocab_size(self) -> int:
        return int(self._tgt.get_piece_size())

    @property
    def files(self) -> tuple[str, ...]:
        if self.shared:
            return (TOKENIZER_FILE, SHARED_MODEL_FILE)
        return (TOKENIZER_FILE, SOURCE_MODEL_FILE, TARGET_MODEL_FILE)

    # ------------------------------------------------------------------ encode / decode
    def normalize_source(self, text: str) -> str:
        """The source text with whitespace runs collapsed (SentencePiece normalises the rest, NFKC)."""
        if not isinstance(text, str):
            raise TypeError(f"expected a str source text, got {type(text).__name__}")
        return " ".join(text.split())

    def encode_source(self, text: str) -> list[int]:
        """Source piece ids of ``text`` (no bos/eos); characters SentencePiece never saw map to ``unk_id``."""
        return list(self._src.encode(self.normalize_source(text), out_type=int))

    def encode_target(self, text: str) -> list[int]:
        """Target piece ids of ``text`` without bos/eos (training adds them)."""
        if not isinstance(text, str):
            raise TypeError(f"expected a str target text, got {type(text).__name__}")
        return list(self._tgt.encode(" ".join(text.split()), out_type=int))

    def encode_sources(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode_source` of many texts in one call (SentencePiece's batch encoder)."""
        return self._src.encode([" ".join(t.split()) for t in texts], out_type=int)

    def encode_targets(self, texts: Sequence[str]) -> list[list[int]]:
        return self._tgt.encode([" ".join(t.split()) for t in texts], out_type=int)

    def decode_target(self, ids: Iterable[int]) -> str:
        """Detokenized text of target ids: up to the first eos, special and out-of-range ids skipped."""
        out = []
        n = self.tgt_vocab_size
        for i in ids:
            i = int(i)
            if i == EOS_ID:
                break
            if i in (PAD_ID, BOS_ID, UNK_ID) or not 0 <= i < n:
                continue
            out.append(i)
        return self._tgt.decode(out)

    def decode_source(self, ids: Iterable[int]) -> str:
        n = self.src_vocab_size
        return self._src.decode(
            [int(i) for i in ids if int(i) not in (PAD_ID, BOS_ID, EOS_ID) and 0 <= int(i) < n]
        )

    def source_pieces(self, text: str) -> list[str]:
        return list(self._src.encode(self.normalize_source(text), out_type=str))

    def unknown_pieces(self, text: str) -> list[str]:
        """The pieces of ``text`` that :meth:`encode_source` maps to ``unk_id`` (their text, the
        word-boundary mark removed), in order."""
        pieces = self.source_pieces(text)
        ids = self.encode_source(text)
        return [p.replace("\u2581", " ").strip() for p, i in zip(pieces, ids) if i == UNK_ID]

    # ------------------------------------------------------------------ persistence
    def _model_files(self) -> dict[str, bytes]:
        if self.shared:
            return {SHARED_MODEL_FILE: self._src_bytes}
        return {SOURCE_MODEL_FILE: self._src_bytes, TARGET_MODEL_FILE: self._tgt_bytes}

    def to_dict(self) -> dict:
        return {
            "format": _FORMAT,
            "version": _FORMAT_VERSION,
            "type": self.type,
            "shared": self.shared,
            "model_type": self.model_type,
            "special_tokens": dict(_SPECIALS),
            "src_vocab_size": self.src_vocab_size,
            "tgt_vocab_size": self.tgt_vocab_size,
            "files": {name: hashlib.sha256(data).hexdigest() for name, data in self._model_files().items()},
        }

    def save(self, directory: str | os.PathLike) -> str:
        """Write the SentencePiece model file(s), then ``tokenizer.json``, each atomically; returns its path."""
        os.makedirs(directory, exist_ok=True)
        for name, data in self._model_files().items():
            atomic_write_bytes(os.path.join(directory, name), data)
        path = os.path.join(directory, TOKENIZER_FILE)
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: Any, directory: str | os.PathLike | None = None) -> "SentencePieceTokenizer":
        """The tokenizer described by ``data`` (a tokenizer.json), reading its model files from ``directory``.

        Every field is required and checked; the model files must exist and match their SHA-256.
        """
        if directory is None:
            raise TokenizerError("a SentencePiece tokenizer.json needs the folder that holds its model files")
        check_description(data, _FORMAT, _FORMAT_VERSION, _FIELDS)
        if data["type"] != cls.type:
            raise TokenizerError(f"field 'type' must be {cls.type!r}, got {data['type']!r}")
        if data["model_type"] not in MODEL_TYPES:
            raise TokenizerError(
                f"field 'model_type' must be one of {MODEL_TYPES}, got {data['model_type']!r}"
            )
        if data["special_tokens"] != _SPECIALS:
            raise TokenizerError(
                f"special token ids must be {_SPECIALS}, got {data['special_tokens']!r}"[:300]
            )
        expected = {SHARED_MODEL_FILE} if data["shared"] else {SOURCE_MODEL_FILE, TARGET_MODEL_FILE}
        if set(data["files"]) != expected:
            raise TokenizerError(
                f"field 'files' must name {sorted(expected)} (shared={data['shared']}), got "
                f"{sorted(data['files'])}"
            )
        blobs = {}
        for name in sorted(expected):
            path = os.path.join(os.fspath(directory), name)
            try:
                with open(path, "rb") as f:
                    blob = f.read()
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"SentencePiece model file not found: {path} (named by {TOKENIZER_FILE})"
                ) from None
            digest = hashlib.sha256(blob).hexdigest()
            if digest != data["files"][name]:
                raise TokenizerError(
                    f"{path} does not match {TOKENIZER_FILE} (SHA-256 {digest[:12]}..., expected "
                    f"{str(data['files'][name])[:12]}...): the files come from different tokenizers"
                )
            blobs[name] = blob
        if data["shared"]:
            tok = cls(blobs[SHARED_MODEL_FILE], model_type=data["model_type"])
        else:
            tok = cls(blobs[SOURCE_MODEL_FILE], blobs[TARGET_MODEL_FILE], model_type=data["model_type"])
        for key, ours in (("src_vocab_size", tok.src_vocab_size), ("tgt_vocab_size", tok.tgt_vocab_size)):
            if data[key] != ours:
                raise TokenizerError(
                    f"field {key!r} is {data[key]} but the SentencePiece model has {ours} pieces"
                )
        return tok

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "SentencePieceTokenizer":
        """Read ``tokenizer.json`` and the model files from a folder (or the tokenizer.json path)."""
        path, data = _read_description(directory)
        try:
            return cls.from_dict(data, os.path.dirname(path))
        except TokenizerError as exc:
            raise TokenizerError(f"invalid tokenizer file {path}: {exc}") from exc

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SentencePieceTokenizer):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return (
            f"SentencePieceTokenizer({self.model_type}, src_vocab_size={self.src_vocab_size}, "
            f"tgt_vocab_size={self.tgt_vocab_size}, shared={self.shared})"
        )


_TOO_BIG = re.compile(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)")
_TOO_SMALL = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")


def _train_one(
    texts: Iterable[str],
    vocab_size: int,
    model_type: str,
    side: str,
    character_coverage: float,
    seed_sentences: int,
    threads: int,
) -> bytes:
    spm = _spm()
    lines = [" ".join(t.split()) for t in texts]
    lines = [t for t in lines if t]
    if not lines:
        raise TokenizerError(f"no {side} text to train SentencePiece on")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            pad_id=PAD_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            unk_id=UNK_ID,
            pad_piece="<pad>",
            bos_piece="<s>",
            eos_piece="</s>",
            unk_piece="<unk>",
            character_coverage=character_coverage,
            input_sentence_size=seed_sentences,
            shuffle_input_sentence=True,
            num_threads=threads,
            max_sentence_length=1 << 16,
            minloglevel=2,
        )
    except RuntimeError as exc:
        message = str(exc)
        m = _TOO_BIG.search(message)
        if m:
            raise TokenizerError(
                f"--vocab-size {vocab_size} is more than the {side} training text supports for a {model_type} "
                f"model: SentencePiece can make at most {m.group(2)} pieces from it; lower --vocab-size to "
                f"{m.group(2)} or less, or train on more text"
            ) from None
        m = _TOO_SMALL.search(message)
        if m:
            raise TokenizerError(
                f"--vocab-size {vocab_size} is too small for the {side} training text: its characters alone "
                f"need {m.group(2)} pieces; raise --vocab-size above {m.group(2)}"
            ) from None
        raise TokenizerError(
            f"SentencePiece could not train a {model_type} model of {vocab_size} pieces on the "
            f"{side} text: {message.strip().splitlines()[-1] if message.strip() else message}"
        ) from None
    return model.getvalue()


def load_any_tokenizer(directory: str | os.PathLike):
    """The tokenizer of a model folder, of any kind, by the ``type`` of its tokenizer.json (a file
    without a known type is read as a character tokenizer, whose loader names what is wrong)."""
    from .tokenizer import TOKENIZER_TYPES, CharTokenizer, load_tokenizer

    path, data = _read_description(directory)
    kind = data.get("type") if isinstance(data, dict) else None
    if kind == SentencePieceTokenizer.type:
        return SentencePieceTokenizer.load(path)
    if isinstance(kind, str) and kind in TOKENIZER_TYPES and kind != CharTokenizer.type:
        return load_tokenizer(path)
    return CharTokenizer.load(path)
