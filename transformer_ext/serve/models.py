"""The models a server serves: loading, their languages, and per-language views of their translators.

``--model DIR`` (or ``NAME=DIR``, repeatable) is an export folder (ONNX Runtime, no torch needed)
or a model folder (eager PyTorch). A multilingual model (a converted M2M100 / NLLB, or a Marian
with ``>>xx<<`` codes) knows its language codes: each request names its pair, and
:meth:`ServedModel.translator_for` gives a translator for it that shares the model's runner. A
model that knows no languages (the bundled demo model, models trained here) serves the one pair
it was trained on: ``--languages SRC-TGT`` names that pair for the LibreTranslate API.

This module imports no torch (a model folder imports it when it loads).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..cli import UsageError
from ..demo import DEMO_MODEL_DIR
from ..tokenizer import TOKENIZER_FILE, load_tokenizer
from ..translator import TranslationError, Translator, is_export_dir

logger = logging.getLogger(__name__)

__all__ = ["LanguageError", "ModelSpec", "ServedModel", "load_model", "parse_languages", "parse_model_spec"]


class LanguageError(TranslationError):
    """A language code the model does not know, or codes for a model without languages; ``field``
    names the request field."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ModelSpec:
    """One ``--model`` argument: the name requests use, the folder."""

    name: str
    path: Path


def parse_model_spec(text: str) -> ModelSpec:
    """``DIR`` or ``NAME=DIR`` (the name defaults to the folder's name); UsageError otherwise."""
    name, sep, path = text.partition("=")
    if not sep:
        name, path = "", text
    if not path:
        raise UsageError(f"--model {text!r}: expected DIR or NAME=DIR")
    folder = Path(path)
    name = name or folder.resolve().name
    if not name or any(c.isspace() or c in "/=" for c in name):
        raise UsageError(f"--model {text!r}: a model name is a word without spaces, '/' or '='")
    return ModelSpec(name, folder)


def parse_languages(text: str) -> tuple[Optional[str], tuple[str, str]]:
    """``SRC-TGT`` or ``NAME=SRC-TGT``: (model name or None, (source, target))."""
    name, sep, pair = text.partition("=")
    if not sep:
        name, pair = "", text
    source, dash, target = pair.partition("-")
    if not dash or not source or not target or "-" in target:
        raise UsageError(f"--languages {text!r}: expected SRC-TGT or NAME=SRC-TGT, e.g. en-de")
    return (name or None), (source, target)


def _codes(tokenizer) -> tuple[str, ...]:
    """The language codes a tokenizer knows (``fra`` for Marian's ``>>fra<<``), or ()."""
    if tokenizer is None or not callable(getattr(tokenizer, "with_languages", None)):
        return ()
    languages = getattr(tokenizer, "languages", ()) or ()
    return tuple(code[2:-2] if code.startswith(">>") and code.endswith("<<") else code for code in languages)


@dataclass(eq=False)
class ServedModel:
    """One served model: ``translator`` (the model's default languages), its folder, its codes.

    ``codes``: the language codes of a multilingual model (empty for a model without languages);
    ``marian``: its target code is a ``>>xx<<`` token (no source code); ``pair``: the one
    (source, target) of a model without languages, when ``--languages`` names it.
    """

    name: str
    path: Path
    translator: Translator
    kind: str  # "export" or "model"
    codes: tuple[str, ...] = ()
    marian: bool = False
    pair: Optional[tuple[str, str]] = None
    _views: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def multilingual(self) -> bool:
        return bool(self.codes)

    def languages(self) -> list[dict]:
        """``[{"code", "targets"}]``: what ``GET /languages`` lists for this model."""
        if self.multilingual:
            sources = self.codes if not self.marian else ()
            targets = list(self.codes)
            if self.marian:  # the source language is fixed by the model, and not known here
                return [{"code": "auto", "targets": targets}]
            return [{"code": code, "targets": [t for t in targets if t != code]} for code in sources]
        if self.pair is not None:
            return [{"code": self.pair[0], "targets": [self.pair[1]]}]
        return []

    def check_pair(
        self, source: Optional[str], target: Optional[str], *, fields=("source_lang", "target_lang")
    ) -> None:
        """A pair a model without languages accepts (any, or ``--languages``'s); LanguageError otherwise."""
        if self.pair is None:
            return
        for value, expected, name in ((source, self.pair[0], fields[0]), (target, self.pair[1], fields[1])):
            if value is not None and value != "auto" and value != expected:
                raise LanguageError(
                    f"{name}: the model {self.name!r} translates {self.pair[0]} to {self.pair[1]}, got {value!r}",
                    name,
                )

    def translator_for(
        self, source: Optional[str], target: Optional[str], *, fields=("source_lang", "target_lang")
    ) -> Translator:
        """The translator of this language pair (codes None: the model's default languages).

        A model without languages takes any codes (unless ``--languages`` names its pair); a
        multilingual one checks them (LanguageError listing the codes it knows)."""
        if source == "auto":
            source = None
        if not self.multilingual:
            self.check_pair(source, target, fields=fields)
            return self.translator
        known = ", ".join(self.codes)
        if self.marian and source is not None:
            source = None  # Marian reads no source code: its source language is fixed
        for value, name in ((source, fields[0]), (target, fields[1])):
            if value is not None and value not in self.codes:
                raise LanguageError(
                    f"{name}: unknown language {value!r}; the model {self.name!r} knows {known}", name
                )
        if source is None and target is None:
            return self.translator
        key = (source, target)
        with self._lock:
            view = self._views.get(key)
        if view is not None:
            return view
        base = self.translator
        generation = base.generation  # the folder's own config (the imported defaults are `pretrained`)
        try:
            view = Translator(
                base.tokenizer,
                base.runner,
                generation=generation,
                source_dir=base.source_dir,
                pretrained=base.pretrained,
                source_lang=source,
                target_lang=target,
            )
        except TranslationError as exc:
            raise LanguageError(
                f"{fields[1] if target else fields[0]}: {exc}", fields[1] if target else fields[0]
            ) from None
        view._parallel = base._parallel  # several runners (--workers) are shared too
        with self._lock:
            self._views[key] = view
        return view


def load_model(
    spec: ModelSpec,
    *,
    threads: Optional[int] = None,
    workers: int = 1,
    pair: Optional[tuple[str, str]] = None,
) -> ServedModel:
    """Load ``spec``'s folder: an export folder through ONNX Runtime (``threads`` intra-op
    threads, ``workers`` runners), a model folder on eager PyTorch."""
    path = spec.path
    if not path.is_dir():
        raise FileNotFoundError(
            f"--model {spec.name}={path}: no such folder (an export folder of python -m export.onnx, or a model folder)"
        )
    tokenizer = None
    if (path / TOKENIZER_FILE).is_file():
        tokenizer = load_tokenizer(path)
    codes = _codes(tokenizer)
    marian = getattr(tokenizer, "type", "") == "marian" or (
        bool(codes) and not hasattr(tokenizer, "source_lang")
    )
    languages: dict = {}
    if codes and not marian:
        # M2M100 / NLLB cannot load without a pair: the tokenizer's own, else its first codes
        source = getattr(tokenizer, "source_lang", None) or codes[0]
        target = getattr(tokenizer, "target_lang", None) or (codes[1] if len(codes) > 1 else codes[0])
        languages = dict(source_lang=source, target_lang=target)
    if pair is not None and codes:
        raise UsageError(
            f"--languages names the pair of a model without languages; {spec.name!r} knows {', '.join(codes)} "
            "and each request names its own"
        )
    if is_export_dir(path) and not (path / "config.json").exists():
        translator = Translator.from_export_dir(path, threads=threads, workers=workers, **languages)
        kind = "export"
    else:
        if workers != 1:
            raise UsageError(f"--workers applies to export folders; {path} is a model folder (eager PyTorch)")
        if threads is not None:
            try:
                import torch

                torch.set_num_threads(threads)
            except ImportError:
                pass
        translator = Translator.from_model_dir(path, **languages)
        kind = "model"
    logger.info("model %s: %s folder %s", spec.name, kind, path)
    return ServedModel(spec.name, path, translator, kind, codes=codes, marian=marian, pair=pair)


def demo_spec() -> ModelSpec:
    """The bundled demo model (English number words to German; eager PyTorch)."""
    return ModelSpec("demo", DEMO_MODEL_DIR)
