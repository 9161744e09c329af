"""The translator: text in, text out over any runner of :mod:`transformer_ext.runtimes`.

::

    from transformer_ext.translator import Translator      # also: from transformer_ext.translate
    translator = Translator.from_export_dir("onnx_export")      # or .from_model_dir(None): the demo model
    translator.translate(["forty-two", "one thousand and one"])  # ['zweiundvierzig', 'eintausendeins']

A :class:`Translator` takes a tokenizer and a runner; it reads what it must respect of the
runner (positions, cache capacity, batch limits, special ids) from the runner's description
record ``runner.info`` (:class:`transformer_ext.runtimes.RunnerInfo`) and checks the tokenizer
against it once. :meth:`Translator.from_model_dir` runs a model folder on eager PyTorch,
:meth:`Translator.from_export_dir` an export folder through
:func:`transformer_ext.runtimes.open_export_dir` (ONNX Runtime, no torch needed, or TensorRT).

Decoding is the project's single greedy / beam-search loop (:mod:`transformer_ext.decoding`)
over the runner protocol, so every runtime gives the same tokens. Sources are sorted by length
into batches; results come back in input order. The maximum number of generated tokens of a
source of ``n`` tokens is ``a * n + b`` (``max_len_a``, ``max_len_b``), capped by the model's
``max_len`` and the runner's cache capacity (with a warning when an ``a`` or ``b`` given
explicitly asks for more). A generation config (beam size, length penalty, the budget rule),
when the translator is given one, sets the defaults of the generation options.

This module imports no torch: translating from an export folder with ONNX Runtime needs only
onnxruntime and numpy.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

import numpy as np

from .cli import UserError
from .decoding import LENGTH_PENALTIES, Hypothesis, Runner
from .demo import DEMO_MODEL_DIR
from .export_format import MANIFEST_NAME, read_generation_config, read_manifest, tokenizer_files
from .runtimes.factory import (
    RUNTIMES,
    RuntimeNotAvailableError,
    RuntimeOptionError,
    check_open_options,
    open_export_dir,
)
from .runtimes.info import RunnerInfo
from .text import normalize_text
from .tokenizer import (
    TOKENIZER_FILE,
    Tokenizer,
    TokenizerError,
    UnknownCharacterError,
    check_model_config,
    load_tokenizer,
)

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_LEN_A",
    "DEFAULT_MAX_LEN_B",
    "DEFAULT_BATCH_SIZE",
    "LENGTH_PENALTIES",
    "RUNTIMES",
    "TranslationError",
    "RuntimeNotAvailableError",
    "Hypothesis",
    "Translation",
    "Translator",
    "is_export_dir",
]

DEFAULT_MAX_LEN_A = 1.5  # German number words are at most 6 characters longer than English ones
DEFAULT_MAX_LEN_B = 10
DEFAULT_BATCH_SIZE = 64
PROGRESS_MIN_BATCHES = 4  # a progress bar only for inputs of at least this many batches


class TranslationError(ValueError, UserError):
    """A source cannot be translated (empty, unknown characters, too long), a bad option, or a
    model / export folder that cannot translate text.

    ``index`` is the position of the offending source in the input (``None`` otherwise) and
    ``detail`` the message without the "source i: " prefix, so that a caller can name the source
    its own way (the command line names the file and line).
    """

    def __init__(self, message: str, *, index: Optional[int] = None, detail: Optional[str] = None):
        super().__init__(message)
        self.index = index
        self.detail = message if detail is None else detail


def _source_error(index: int, detail: str) -> TranslationError:
    return TranslationError(f"source {index}: {detail}", index=index, detail=detail)


@dataclass(frozen=True)
class Translation:
    """The translation of one source.

    ``texts``: the n-best translations, best first; ``hypotheses``: the search results behind
    them (:class:`transformer_ext.decoding.Hypothesis`: tokens, score, log-probability; greedy
    decoding gives no score, so both are ``None`` there).
    """

    source: str
    texts: list[str] = field(default_factory=list)
    hypotheses: list[Hypothesis] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.texts[0]

    @property
    def score(self) -> Optional[float]:
        return self.hypotheses[0].score


def _normalize(text: str) -> str:
    """The package's one whitespace rule (:func:`transformer_ext.text.normalize_text`), as in training."""
    return normalize_text(text)


def _check_number(name: str, value, *, default: Optional[float] = None) -> float:
    """``value`` as a float that is finite and >= 0 (``None`` -> ``default``); TranslationError naming ``name``."""
    if value is None and default is not None:
        return float(default)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TranslationError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(float(value)) or value < 0:
        raise TranslationError(f"{name} must be a finite number >= 0, got {value}")
    return float(value)


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise TranslationError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def is_export_dir(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` is an export folder (it holds ``manifest.json``) rather than a model folder."""
    return os.path.isfile(os.path.join(os.fspath(path), MANIFEST_NAME))


# ---------------------------------------------------------------------- generation options


@dataclass(frozen=True)
class _GenerationDefaults:
    """The generation options of a translator given no generation config (the fields of
    :class:`transformer_ext.export_format.GenerationConfig` that the translator reads)."""

    beam_size: int = 1
    length_penalty: str = "gnmt"
    alpha: float = 0.6
    max_len_a: float = DEFAULT_MAX_LEN_A
    max_len_b: float = DEFAULT_MAX_LEN_B
    min_new_tokens: int = 0
    max_new_tokens: Optional[int] = None  # None: what the model and the runner hold
    special_tokens: Optional[dict] = None


def _check_generation_ids(generation: Any, tokenizer: Optional[Tokenizer]) -> None:
    """The special ids of a generation config (``special_tokens``) equal the tokenizer's."""
    special = getattr(generation, "special_tokens", None)
    if not special or tokenizer is None:
        return
    for key, value in special.items():
        ours = getattr(tokenizer, f"{key}_id", None)
        if ours is not None and int(ours) != int(value):
            raise TranslationError(
                f"special id mismatch: the generation config has {key} = {value} but the "
                f"tokenizer has {key} = {ours}"
            )


def _runner_info(runner: Any, max_len: Optional[int]) -> RunnerInfo:
    """The runner's description record; ``max_len`` (when given) replaces its model positions."""
    info = getattr(runner, "info", None)
    if not isinstance(info, RunnerInfo):
        raise TypeError(
            f"runner must describe itself with a transformer_ext.runtimes.RunnerInfo as runner.info, "
            f"{type(runner).__name__} has {type(info).__name__}"
        )
    if max_len is not None:
        info = dataclasses.replace(info, max_positions=_check_positive_int("max_len", max_len))
    if info.max_positions is None:
        raise TypeError(f"cannot tell the model's max_len from {type(runner).__name__}: pass max_len=")
    return info


# ---------------------------------------------------------------------- the translator


class Translator:
    """Text in, text out over any runner of the decoding protocol.

    Args:
        tokenizer: a :class:`transformer_ext.tokenizer.Tokenizer` (``None``: the runner can
            still decode token ids, e.g. for benchmarks, but translating text is a
            :class:`TranslationError`).
        runner: any runner (:mod:`transformer_ext.runtimes`): ``EagerRunner``, ``OrtRunner``,
            ``OrtCudaRunner``, ``TensorRTRunner``...; its description record ``runner.info``
            gives the limits and special ids, and its model config is checked against the
            tokenizer (vocabulary sizes, special ids).
        beam_size, n_best, max_len_a, max_len_b, length_penalty, alpha, batch_size: the
            generation options (see :meth:`translate`); ``None`` takes ``generation``'s value,
            else the default.
        generation: the defaults of those options: a
            :class:`transformer_ext.export_format.GenerationConfig` (an export folder's
            ``generation.json``) or any object with its fields ``beam_size``, ``length_penalty``,
            ``alpha``, ``max_len_a``, ``max_len_b`` (and optionally ``min_new_tokens``,
            ``max_new_tokens``, ``special_tokens``); ``None``: the defaults above.
        max_len: the model's maximum positions, for a runner that does not know them (a bare
            ``TensorRTRunner``); given, it replaces the runner's.
        source_dir: the folder tokenizer and runner were loaded from (named in messages).
        source_lang, target_lang: the language codes of a multilingual model (the tokenizer's
            ``with_languages``: Marian's ``>>xx<<`` target token, M2M100 / NLLB's source token and
            forced target token); an unknown or missing code is a :class:`TranslationError`
            listing the codes the model knows, and so is a code for a model without languages.
        pretrained: the :class:`transformer_ext.convert.GenerationDefaults` of a model converted
            from transformers (its ``generation_defaults.json``): every decode bans its banned
            tokens, forces the target-language token first when it says so, and (unless
            ``max_len_a`` / ``max_len_b`` are given) budgets ``max_length - 1`` new tokens per
            source, as transformers' ``generate()``; a model folder without a generation config
            also takes its beam size and length penalty ("hf").

    Most callers build one with :meth:`from_model_dir` or :meth:`from_export_dir`.
    """

    def __init__(
        self,
        tokenizer: Optional[Tokenizer] = None,
        runner: Optional[Runner] = None,
        *,
        beam_size: Optional[int] = None,
        n_best: Optional[int] = None,
        max_len_a: Optional[float] = None,
        max_len_b: Optional[float] = None,
        length_penalty: Optional[str] = None,
        alpha: Optional[float] = None,
        batch_size: Optional[int] = None,
        generation: Optional[Any] = None,
        max_len: Optional[int] = None,
        source_dir: Union[str, os.PathLike, None] = None,
        source_lang: Optional[str] = None,
        target_lang: Optional[str] = None,
        pretrained: Optional[Any] = None,
    ):
        if isinstance(tokenizer, (str, os.PathLike)) or runner is None:
            raise TypeError(
                "Translator(tokenizer, runner): to load a folder use Translator.from_model_dir(path) "
                "or Translator.from_export_dir(path)"
            )
        if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
            raise TypeError(
                f"tokenizer must implement transformer_ext.tokenizer.Tokenizer, "
                f"got {type(tokenizer).__name__}"
            )
        if not all(callable(getattr(runner, m, None)) for m in ("encode", "step", "reorder")):
            raise TypeError(
                f"runner must implement encode / step / reorder (transformer_ext.decoding.Runner), "
                f"got {type(runner).__name__}"
            )
        if source_lang is not None or target_lang is not None:
            tokenizer = _with_languages(tokenizer, source_lang, target_lang, source_dir)
        self.tokenizer = tokenizer
        self.runner = runner
        self.pretrained = pretrained
        self.info = _runner_info(runner, max_len)
        self.source_dir: Optional[Path] = None if source_dir is None else Path(source_dir)
        if tokenizer is not None:
            self._check_tokenizer(tokenizer)
        if generation is None and pretrained is not None:
            generation = _GenerationDefaults(
                beam_size=pretrained.num_beams,
                length_penalty="hf",
                alpha=max(0.0, float(pretrained.length_penalty)),
                max_new_tokens=pretrained.max_length - 1,
            )
        self.generation = generation if generation is not None else _GenerationDefaults()
        _check_generation_ids(self.generation, tokenizer)
        if pretrained is not None and tokenizer is not None:
            _check_languages(tokenizer, pretrained)
        self.pad_id, self.bos_id, self.eos_id = self._special_ids()
        self._options = dict(
            beam_size=beam_size,
            n_best=n_best,
            max_len_a=max_len_a,
            max_len_b=max_len_b,
            length_penalty=length_penalty,
            alpha=alpha,
            batch_size=batch_size,
        )
        self._resolve({})  # every option checked now, not at the first translate()

    def _check_tokenizer(self, tokenizer: Tokenizer) -> None:
        """The tokenizer belongs to the runner's model (vocabulary sizes, special ids): the one
        check, naming the tokenizer file and the config file when they are known."""
        info = self.info
        if info.config is None:  # a runner built without a model config (bare TensorRT engines)
            return
        folder = self.source_dir
        tokenizer_file = os.fspath(folder / TOKENIZER_FILE) if folder is not None else None
        config_file = info.config_file or (os.fspath(folder / "config.json") if folder is not None else None)
        try:
            check_model_config(tokenizer, info, tokenizer_file=tokenizer_file, config_file=config_file)
        except TokenizerError as exc:
            raise TranslationError(str(exc)) from None

    def _special_ids(self) -> tuple[int, int, int]:
        """``(pad, bos, eos)``: the tokenizer's, else the runner's."""
        tokenizer = self.tokenizer
        if tokenizer is not None:
            return int(tokenizer.pad_id), int(tokenizer.bos_id), int(tokenizer.eos_id)
        ids = (self.info.pad_id, self.info.bos_id, self.info.eos_id)
        for key, value in zip(("pad_id", "bos_id", "eos_id"), ids):
            if value is None:
                raise TypeError(
                    f"without a tokenizer the special ids come from the runner, and "
                    f"{type(self.runner).__name__} does not know its {key}"
                )
        return int(ids[0]), int(ids[1]), int(ids[2])

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_model_dir(
        cls,
        path: Union[str, os.PathLike, None] = None,
        device=None,
        compile: bool = False,
        dtype: Optional[str] = None,
        **options,
    ) -> "Translator":
        """A model folder (``config.json`` + ``model.safetensors`` + tokenizer files) on eager PyTorch.

        ``path=None`` is the bundled demo model (English number words to German number words);
        ``device``: ``"cpu"`` (default) or ``"cuda"``; ``compile``: the decoder step through
        ``torch.compile`` (see :class:`transformer_ext.runtimes.EagerRunner`): faster per token
        once compiled, at the cost of a compile (seconds) for every new batch shape; ``dtype``:
        ``"bfloat16"`` decodes with bfloat16 weights and caches (float32 accumulation; see
        :class:`~transformer_ext.runtimes.EagerRunner`), checked before the folder is read.
        ``options``: generation options, as for the constructor.

        A folder without ``tokenizer.json`` loads (``tokenizer`` is then ``None``).

        Raises:
            NotNativeError: ``dtype="bfloat16"`` on a CPU without native bfloat16 matrix products
                (:mod:`transformer_ext.cpu_features`; the message names the missing instructions).
            ValueError: ``dtype`` is not ``"float32"``, ``"bfloat16"`` or None.
            FileNotFoundError: the folder, its config or weights file is missing.
            TokenizerError: ``tokenizer.json`` is corrupt or not a tokenizer description (names the file).
            TranslationError: the tokenizer does not belong to the model (vocabulary sizes or special
                ids differ; names both files and the id), or the folder is an export folder.
        """
        try:
            import torch

            from .checkpoint import load_model
            from .runtimes.eager import EagerRunner, check_dtype
        except ImportError as exc:
            raise RuntimeNotAvailableError(
                f"a model folder runs on PyTorch, which this installation lacks ({exc}): translate an export "
                "folder instead (python -m export.onnx writes one; Translator.from_export_dir, or --model "
                "EXPORT_DIR), or install transformer_ext with torch"
            ) from exc

        device = "cpu" if device is None else device
        check_dtype(dtype, torch.device(device))
        model_dir = Path(path) if path is not None else DEMO_MODEL_DIR
        if not model_dir.is_dir():
            raise FileNotFoundError(
                f"model directory not found: {model_dir} (expected a folder with config.json, "
                "model.safetensors and tokenizer.json, as written by `python -m transformer_ext.train`)"
            )
        if is_export_dir(model_dir) and not (model_dir / "config.json").exists():
            raise TranslationError(
                f"{model_dir} is an export folder (it has {MANIFEST_NAME}, no PyTorch weights): "
                "load it with Translator.from_export_dir (ONNX Runtime or TensorRT)"
            )
        tokenizer = _load_folder_tokenizer(model_dir)
        pretrained = _read_pretrained(model_dir)
        runner = EagerRunner(load_model(model_dir, device), device, compile=compile, dtype=dtype)
        return cls(tokenizer, runner, source_dir=model_dir, pretrained=pretrained, **options)

    @classmethod
    def from_export_dir(
        cls,
        path: Union[str, os.PathLike],
        runtime: Optional[str] = None,
        provider: Optional[str] = None,
        threads: Optional[int] = None,
        *,
        precision: Optional[str] = None,
        verify: bool = False,
        **options,
    ) -> "Translator":
        """An export folder (``python -m export.onnx``): ONNX Runtime by default (needs only
        onnxruntime and numpy), TensorRT with ``runtime="tensorrt"`` once ``python -m
        export.tensorrt`` built its engines.

        The runner is :func:`transformer_ext.runtimes.open_export_dir`'s (which says which one
        a runtime and a provider get): ``provider``: the ONNX Runtime execution provider
        (``"cpu"``, default; ``"cuda"``, or a full name such as ``"CUDAExecutionProvider"``);
        ``threads``: ONNX Runtime's intra-op threads; ``precision``: the TensorRT engines to run
        (default ``fp32`` when built, else the only precision built). ``options``: generation
        options, as for the constructor; the folder's generation config sets their defaults.
        ``verify``: check the graphs against the SHA-256 the manifest records, not only the
        tokenizer files and generation config (always checked).

        Raises:
            ManifestError: no ``manifest.json``, one of another tool or of an unknown format version;
                ``GenerationConfigError`` (a ManifestError) for an invalid generation config.
            TranslationError: a tokenizer file the manifest lists is missing, the tokenizer does
                not belong to the model, an option that does not fit the runtime.
            RuntimeNotAvailableError: ONNX Runtime, the provider, or TensorRT is not installed
                (the message says what to install).
            InvalidGraphError: a graph is missing or corrupt.
        """
        export_dir = Path(path)
        try:
            check_open_options(export_dir, runtime, threads)  # before anything is read
            manifest = read_manifest(export_dir, verify=verify)
            tokenizer = _load_export_tokenizer(export_dir, manifest)
            generation = read_generation_config(export_dir, manifest)  # defaults for folders without one
            pretrained = _read_pretrained(export_dir)
            runner = open_export_dir(
                export_dir, runtime, provider, threads, precision=precision, manifest=manifest
            )
        except RuntimeOptionError as exc:
            raise TranslationError(str(exc)) from None
        return cls(
            tokenizer, runner, generation=generation, source_dir=export_dir, pretrained=pretrained, **options
        )

    @classmethod
    def from_model(cls, model, tokenizer: Optional[Tokenizer], device="cpu") -> "Translator":
        """A translator over an in-memory model on an ``EagerRunner`` (training validates with it).

        Its :meth:`translate` returns :class:`Translation` objects (as :meth:`translate_detailed`),
        the form ``transformer_ext.train`` reads; ``Translator(tokenizer, EagerRunner(model))``
        gives the plain one.
        """
        from .runtimes.eager import EagerRunner

        return _DetailedTranslator(tokenizer, EagerRunner(model, device))

    # ------------------------------------------------------------------ helpers
    @property
    def model(self):
        """The PyTorch model of an eager runner (``None`` for the other runtimes)."""
        return getattr(self.runner, "model", None)

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            if self.source_dir is not None and is_export_dir(self.source_dir):
                where = f"the export folder {self.source_dir} has no tokenizer (its model folder had none)"
            elif self.source_dir is not None:
                where = f"{self.source_dir} has no {TOKENIZER_FILE}"
            else:
                where = "no tokenizer was given"
            raise TranslationError(
                f"{where}: a tokenizer is needed to translate text (copy the {TOKENIZER_FILE} the model was "
                "trained with into the model directory); without one the model only decodes token ids"
            )
        return self.tokenizer

    def encode(self, sources: Iterable[str]) -> list[list[int]]:
        """Token ids of each source, with every bad input reported as a :class:`TranslationError`."""
        if isinstance(sources, (str, bytes)):
            raise TypeError("translate() takes a list (or any iterable) of source strings, not one string")
        tokenizer = self._require_tokenizer()
        encoded = []
        limit = self.info.source_limit
        for i, text in enumerate(sources):
            if not isinstance(text, str):
                raise TypeError(f"source {i} is a {type(text).__name__}, expected str")
            text = _normalize(text)
            if not text:
                raise _source_error(i, "empty source")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:  # e.g. bytes decoded with surrogateescape
                raise _source_error(
                    i,
                    f"not valid text: {text[exc.start]!r} at character {exc.start} is a lone surrogate, not a "
                    "character (decode the input as strict UTF-8)",
                ) from None
            try:
                ids = tokenizer.encode_source(text)
            except UnknownCharacterError as exc:
                raise _source_error(i, str(exc)) from None
            if len(ids) > limit:
                raise _source_error(
                    i, f"{len(ids)} tokens, more than the model's max_len ({limit}); split the source"
                )
            encoded.append(ids)
        return encoded

    def max_new_tokens(self, src_lengths: np.ndarray, max_len_a: float, max_len_b: float) -> np.ndarray:
        """Per-row budget ``floor(a * src_len + b)`` (EOS included), at least 1, at most what the
        model's positions and the runner's cache hold."""
        from .decoding import max_new_tokens_for

        a = _check_number("max_len_a", max_len_a)
        b = _check_number("max_len_b", max_len_b)
        return max_new_tokens_for(src_lengths, a, b, cap=self._budget_cap())

    def _budget_cap(self) -> int:
        """The most tokens one source may generate: the runner's limit, and the generation config's."""
        cap = self.info.generation_limit
        configured = getattr(self.generation, "max_new_tokens", None)
        return cap if configured is None else min(cap, int(configured))

    def _warn_if_capped(self, lengths: Sequence[int], a: float, b: float) -> None:
        """One warning when ``a * n + b`` asks for more tokens than the model's ``max_len`` allows."""
        cap = self._budget_cap()
        wanted = [a * n + b for n in lengths]
        over = sum(1 for w in wanted if math.floor(w) > cap)
        if over:
            logger.warning(
                "max_len_a * source_length + max_len_b = %.6g tokens (longest source) exceeds the model's "
                "max_len = %d: generation is capped at %d tokens for %d of %d sources",
                max(wanted),
                cap,
                cap,
                over,
                len(wanted),
            )

    def resolve_options(self, **options) -> dict:
        """The generation settings a call with ``options`` decodes with (each checked;
        :class:`TranslationError` naming a bad one): ``beam_size``, ``n_best``,
        ``length_penalty``, ``alpha``, ``max_len_a``, ``max_len_b``, ``batch_size``."""
        settings = self._resolve(options)
        settings.pop("explicit_budget")
        return settings

    def _resolve(self, overrides: dict) -> dict:
        """The generation options of one call: the call's, else the translator's, else the
        generation config's; each checked (TranslationError naming it)."""
        given = {
            k: (overrides.get(k) if overrides.get(k) is not None else self._options[k]) for k in self._options
        }
        g = self.generation
        beam_size = _check_positive_int(
            "beam size", given["beam_size"] if given["beam_size"] is not None else g.beam_size
        )
        n_best = _check_positive_int("n_best", given["n_best"] if given["n_best"] is not None else 1)
        if n_best > beam_size:
            raise TranslationError(f"n_best ({n_best}) cannot exceed the beam size ({beam_size})")
        length_penalty = given["length_penalty"] if given["length_penalty"] is not None else g.length_penalty
        if length_penalty not in LENGTH_PENALTIES:
            raise TranslationError(
                f"length_penalty must be one of {LENGTH_PENALTIES}, got {length_penalty!r}"
            )
        alpha = _check_number("alpha", given["alpha"] if given["alpha"] is not None else g.alpha)
        a = _check_number("max_len_a", given["max_len_a"], default=g.max_len_a)
        b = _check_number("max_len_b", given["max_len_b"], default=g.max_len_b)
        batch_size = _check_positive_int(
            "batch_size", given["batch_size"] if given["batch_size"] is not None else DEFAULT_BATCH_SIZE
        )
        explicit_budget = given["max_len_a"] is not None or given["max_len_b"] is not None
        return dict(
            beam_size=beam_size,
            n_best=n_best,
            length_penalty=length_penalty,
            alpha=alpha,
            max_len_a=a,
            max_len_b=b,
            batch_size=batch_size,
            explicit_budget=explicit_budget,
        )

    def _batch_size(self, batch_size: int, beam_size: int) -> int:
        """``batch_size`` within what the runner accepts per call (a TensorRT profile's maximum batch)."""
        info = self.info
        if info.max_sources is not None:
            batch_size = min(batch_size, int(info.max_sources))
        if info.max_rows is not None:
            if beam_size > info.max_rows:
                raise TranslationError(
                    f"beam size {beam_size} exceeds the {info.max_rows} rows the runner's "
                    "decoder accepts per call (the TensorRT profile's maximum batch)"
                )
            batch_size = min(batch_size, int(info.max_rows) // beam_size)
        return batch_size

    # ------------------------------------------------------------------ translate
    def translate(
        self, sources: Iterable[str], *, progress: bool = False, **options
    ) -> Union[list[str], list[list[tuple[str, Optional[float]]]]]:
        """Translate each source: one string per source, in input order; with ``n_best > 1`` a
        list of ``(text, score)`` pairs per source, best first.

        ``sources``: a list or any iterable of strings (a generator is read once, up front).
        ``options`` override the translator's generation options for this call:

        * ``beam_size``: 1 is greedy decoding (no scores), more is beam search;
        * ``n_best``: hypotheses per source, at most ``beam_size``;
        * ``length_penalty``, ``alpha``: "gnmt" ((5+len)/6)^alpha (default), "seed"
          ((5+len+1)/5)^alpha, "average" len^alpha (fairseq's), "none"; len counts the
          generated tokens with the EOS (:func:`transformer_ext.decoding.length_penalty_factor`);
        * ``max_len_a``, ``max_len_b``: at most ``a * n + b`` generated tokens for a source of n
          tokens (defaults :data:`DEFAULT_MAX_LEN_A` and :data:`DEFAULT_MAX_LEN_B`); finite and
          >= 0; capped by the model's ``max_len``, with a warning when a value given explicitly
          asks for more;
        * ``batch_size``: sources decoded together (64); sources are sorted by length into batches.

        ``progress``: a progress bar (tqdm, on stderr) for inputs of at least
        :data:`PROGRESS_MIN_BATCHES` batches. Sources are normalised (whitespace collapsed,
        lower-cased for the demo tokenizer) before encoding.
        """
        results = self.translate_detailed(sources, progress=progress, **options)
        n_best = self._resolve(options)["n_best"]
        if n_best == 1:
            return [t.text for t in results]
        return [[(text, h.score) for text, h in zip(t.texts, t.hypotheses)] for t in results]

    def translate_detailed(
        self,
        sources: Iterable[str],
        *,
        progress: bool = False,
        beam_size: Optional[int] = None,
        n_best: Optional[int] = None,
        max_len_a: Optional[float] = None,
        max_len_b: Optional[float] = None,
        length_penalty: Optional[str] = None,
        alpha: Optional[float] = None,
        batch_size: Optional[int] = None,
    ) -> list[Translation]:
        """:meth:`translate`, returning a :class:`Translation` per source (texts, token ids,
        scores and log-probabilities of the n-best hypotheses)."""
        opts = self._resolve(
            dict(
                beam_size=beam_size,
                n_best=n_best,
                max_len_a=max_len_a,
                max_len_b=max_len_b,
                length_penalty=length_penalty,
                alpha=alpha,
                batch_size=batch_size,
            )
        )
        if isinstance(sources, (str, bytes)):
            raise TypeError("translate() takes a list (or any iterable) of source strings, not one string")
        sources = list(sources)  # a generator is consumed once; results refer back to it by index

        encoded = self.encode(sources)
        self._require_tokenizer()
        if opts["explicit_budget"] and encoded:
            self._warn_if_capped([len(x) for x in encoded], opts["max_len_a"], opts["max_len_b"])
        size = self._batch_size(opts["batch_size"], opts["beam_size"])
        results: list[Optional[Translation]] = [None] * len(encoded)
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))  # similar lengths together
        batches = [order[start : start + size] for start in range(0, len(order), size)]
        bar = _progress_bar(len(encoded)) if progress and len(batches) >= PROGRESS_MIN_BATCHES else None
        model = self.model
        was_training = getattr(model, "training", False)
        if was_training:
            model.eval()
        try:
            for rows in batches:
                for i, translation in zip(rows, self._decode_batch([encoded[i] for i in rows], opts)):
                    results[i] = dataclasses.replace(translation, source=sources[i])
                if bar is not None:
                    bar.update(len(rows))
        finally:
            if bar is not None:
                bar.close()
            if was_training:
                model.train()
        return results  # type: ignore[return-value]

    def _decode_batch(self, encoded: list[list[int]], opts: dict) -> list[Translation]:
        """One batch of encoded sources through greedy or beam search (``source`` left empty)."""
        from .decoding import beam_search, greedy_decode

        tok = self._require_tokenizer()
        lengths = np.array([len(ids) for ids in encoded], dtype=np.int64)
        input_ids = np.full((len(encoded), int(lengths.max())), self.pad_id, dtype=np.int64)
        for r, ids in enumerate(encoded):
            input_ids[r, : lengths[r]] = ids
        pretrained = self.pretrained
        if pretrained is not None and not opts["explicit_budget"]:
            # transformers' rule: max_length - 1 new tokens whatever the source length
            budget = self.max_new_tokens(lengths, 0.0, float(pretrained.max_length - 1))
        else:
            budget = self.max_new_tokens(lengths, opts["max_len_a"], opts["max_len_b"])
        min_new = np.minimum(int(getattr(self.generation, "min_new_tokens", 0) or 0), budget)
        common = dict(bos_id=self.bos_id, eos_id=self.eos_id, max_new_tokens=budget, min_new_tokens=min_new)
        if pretrained is not None:
            common.update(
                banned_ids=list(pretrained.banned_ids), force_eos_at_budget=pretrained.force_eos_at_max_length
            )
            prefix = tok.forced_target_prefix() if pretrained.force_target_language else []
            if prefix:
                common["target_prefix"] = [list(prefix)] * len(encoded)
        if opts["beam_size"] == 1:
            out = greedy_decode(self.runner, input_ids, lengths, **common)
            # a row shorter than its budget stopped at an EOS
            hyps = [
                Hypothesis([int(t) for t in row], None, None, len(row) < int(budget[r]))
                for r, row in enumerate(out)
            ]
            return [Translation("", [tok.decode_target(h.tokens)], [h]) for h in hyps]
        extra = {}
        if pretrained is not None and opts["length_penalty"] == "hf":
            extra["early_stopping"] = pretrained.early_stopping
        out = beam_search(
            self.runner,
            input_ids,
            lengths,
            beam_size=opts["beam_size"],
            n_best=opts["n_best"],
            length_penalty=opts["length_penalty"],
            alpha=opts["alpha"],
            **common,
            **extra,
        )
        n_best = opts["n_best"]
        return [
            Translation("", [tok.decode_target(h.tokens) for h in row[:n_best]], list(row[:n_best]))
            for row in out
        ]


class _DetailedTranslator(Translator):
    """:meth:`Translator.from_model`'s translator: ``translate`` returns :class:`Translation` objects."""

    def translate(self, sources: Iterable[str], *, progress: bool = False, **options) -> list[Translation]:
        return self.translate_detailed(sources, progress=progress, **options)


def _read_pretrained(folder: Path):
    """The generation defaults of a model converted from transformers (``generation_defaults.json``
    in its model folder, copied into its export folder), or None."""
    from .convert.generation import read_generation_defaults

    return read_generation_defaults(folder)


def _with_languages(
    tokenizer: Optional[Tokenizer],
    source_lang: Optional[str],
    target_lang: Optional[str],
    source_dir: Union[str, os.PathLike, None],
) -> Tokenizer:
    """``tokenizer`` with these language codes; a one-line TranslationError for a model without
    languages or a code the model does not know (the tokenizer's message lists the known ones)."""
    given = ", ".join(
        f"{flag} {value!r}"
        for flag, value in (("--source-lang", source_lang), ("--target-lang", target_lang))
        if value is not None
    )
    where = f"the model {source_dir}" if source_dir is not None else "this model"
    if tokenizer is None or not callable(getattr(tokenizer, "with_languages", None)):
        raise TranslationError(
            f"{given}: {where} has no language codes (only models converted from a multilingual "
            "transformers checkpoint, Marian >>xx<< or M2M100 / NLLB, take --source-lang / --target-lang)"
        )
    try:
        return tokenizer.with_languages(source_lang, target_lang)
    except TokenizerError as exc:
        raise TranslationError(str(exc)) from None


def _check_languages(tokenizer: Tokenizer, pretrained: Any) -> None:
    """A multilingual model's languages are known before anything is decoded: the forced target
    language, and M2M100 / NLLB's source language (a Marian source may carry its own >>xx<<)."""
    try:
        if pretrained.force_target_language:
            tokenizer.forced_target_prefix()
        if (
            callable(getattr(tokenizer, "with_languages", None))
            and getattr(tokenizer, "type", "") != "marian"
        ):
            tokenizer.encode_source("a")
    except UnknownCharacterError:
        pass
    except TokenizerError as exc:
        raise TranslationError(str(exc)) from None


def _load_folder_tokenizer(model_dir: Path) -> Optional[Tokenizer]:
    """A model folder's tokenizer; ``None`` (with a warning) when it has no ``tokenizer.json``."""
    if not (model_dir / TOKENIZER_FILE).exists():
        logger.warning(
            "%s has no %s: it can decode token ids, but not translate text", model_dir, TOKENIZER_FILE
        )
        return None
    return load_tokenizer(model_dir)  # a corrupt file is an error, not "no tokenizer"


def _load_export_tokenizer(export_dir: Path, manifest: dict) -> Optional[Tokenizer]:
    """The tokenizer the manifest names; ``None`` when it names none (exported without one)."""
    names = tokenizer_files(manifest)
    if not names:
        logger.warning(
            "%s holds no tokenizer (its model folder had none): it can decode token ids, not translate text",
            export_dir,
        )
        return None
    if TOKENIZER_FILE not in names:
        raise TranslationError(
            f"{export_dir / MANIFEST_NAME} names the tokenizer files {names}, which this version "
            f"cannot read (a tokenizer is described by {TOKENIZER_FILE})"
        )
    for name in names:
        if not (export_dir / name).is_file():
            raise TranslationError(
                f"{export_dir / name} is missing: {MANIFEST_NAME} lists it among the tokenizer files, so the export "
                "folder is incomplete; export it again (python -m export.onnx) or copy the file from the model folder"
            )
    return load_tokenizer(export_dir)


def _progress_bar(total: int):
    """A tqdm bar on stderr counting sources, or None without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a runtime dependency; a bare environment just shows no bar
        return None
    return tqdm(total=total, unit="source", desc="translating", file=sys.stderr, leave=False)
