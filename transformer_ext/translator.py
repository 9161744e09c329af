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
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import numpy as np

from . import decoding
from .batching import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_WINDOW
from .cli import UserError
from .decoding import LENGTH_PENALTIES, Hypothesis, Runner, SearchOptions
from .demo import DEMO_MODEL_DIR
from .export_format import (
    MANIFEST_NAME,
    GenerationConfig,
    read_generation_config,
    read_manifest,
    tokenizer_files,
)
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
from .translator_options import (
    LONG_LINES,
    OPTION_NAMES,
    OptionError,
    OptionLayers,
    TranslatorSettings,
    lay_over,
    settings_over,
    settings_view,
    warn_renamed,
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
    "TargetScore",
    "LONG_LINES",
    "OPTION_NAMES",
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


class Translation(str):
    """The translation of one source, the one result type of every setting: a ``str`` (the best
    text, so code that wants plain strings uses it as one) that also holds the n-best.

    ``source``: the source text; ``texts``: the n-best translations, best first;
    ``hypotheses``: the search results behind them (:class:`transformer_ext.decoding.Hypothesis`:
    tokens, score, log-probability, per-token log-probabilities; greedy decoding computes them
    with ``return_scores`` or sampling, else they are ``None``). An empty source (unless
    ``strict=True``) has the empty translation with one hypothesis of no tokens.
    """

    source: str
    texts: list[str]
    hypotheses: list[Hypothesis]

    def __new__(cls, source: str = "", texts: Sequence[str] = (), hypotheses: Sequence[Hypothesis] = ()):
        texts = [str(t) for t in texts]
        self = super().__new__(cls, texts[0] if texts else "")
        self.source = source
        self.texts = texts
        self.hypotheses = list(hypotheses)
        return self

    def __reduce__(self):
        return (Translation, (self.source, self.texts, self.hypotheses))

    def with_source(self, source: str) -> "Translation":
        return Translation(source, self.texts, self.hypotheses)

    @property
    def text(self) -> str:
        return self.texts[0]

    @property
    def tokens(self) -> list[int]:
        return self.hypotheses[0].tokens

    @property
    def score(self) -> Optional[float]:
        return self.hypotheses[0].score

    @property
    def attention(self) -> Optional[list[list[float]]]:
        """The best hypothesis' attention (``return_attention``), else None."""
        return self.hypotheses[0].attention


@dataclass(frozen=True)
class TargetScore:
    """:meth:`Translator.score` of one ``(source, target)`` pair: the target's token ids, the
    log-probability the model gives each of them and the EOS (``token_log_probs``), and their
    sum ``log_prob``."""

    source: str
    target: str
    tokens: list[int]
    token_log_probs: list[float]
    log_prob: float


class _InputReport:
    """What non-strict encoding changed (unknown characters, truncated sources): one warning for
    a whole input, with a count and the first examples."""

    SHOWN = 3

    def __init__(self):
        self.unknown: list[tuple[int, str]] = []
        self.truncated: list[tuple[int, int]] = []

    def warn(self, what: str = "input") -> None:
        if self.unknown:
            shown = "; ".join(f"source {i}: {detail}" for i, detail in self.unknown[: self.SHOWN])
            logger.warning(
                "%d %s lines hold characters or pieces outside the vocabulary, translated as the unknown "
                "token (strict=True / --strict makes this an error): %s",
                len(self.unknown),
                what,
                shown,
            )
        if self.truncated:
            shown = ", ".join(f"source {i} ({n} tokens)" for i, n in self.truncated[: self.SHOWN])
            logger.warning(
                "%d %s lines are longer than the model's positions and were truncated: %s",
                len(self.truncated),
                what,
                shown,
            )
        self.unknown, self.truncated = [], []


def _normalize(text: str) -> str:
    """The package's one whitespace rule (:func:`transformer_ext.text.normalize_text`), as in training."""
    return normalize_text(text)


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise TranslationError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _memory_headroom() -> Optional[int]:
    """The bytes this process can still allocate: the smaller of what its address-space limit
    (``ulimit -v``) leaves and the machine's available memory; None where neither can be told."""
    room = []
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            with open("/proc/self/statm") as f:
                used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            room.append(max(0, soft - used))
    except (ImportError, OSError, ValueError, IndexError):
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    room.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    return min(room) if room else None


_SHOWN_PIECES = 5  # unknown pieces a message lists


def _unknown_pieces(tokenizer: Tokenizer, text: str, ids: Sequence[int], unk: int) -> str:
    """What a subword tokenizer mapped to its unknown token in ``text``: the pieces (the
    tokenizer's ``unknown_pieces``), else their count."""
    finder = getattr(tokenizer, "unknown_pieces", None)
    pieces = [p for p in finder(text) if p] if callable(finder) else []
    count = len(pieces) or list(ids).count(unk)
    what = "1 piece" if count == 1 else f"{count} pieces"
    if not pieces:
        return f"{what} outside the source vocabulary (the unknown token)"
    shown = ", ".join(repr(p) for p in pieces[:_SHOWN_PIECES])
    more = f" (and {len(pieces) - _SHOWN_PIECES} more)" if len(pieces) > _SHOWN_PIECES else ""
    return f"{what} outside the source vocabulary: {shown}{more}"


def is_export_dir(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` is an export folder (it holds ``manifest.json``) rather than a model folder."""
    return os.path.isfile(os.path.join(os.fspath(path), MANIFEST_NAME))


# ---------------------------------------------------------------------- generation options


def _generation_config(generation: Any) -> GenerationConfig:
    """``generation`` as a :class:`GenerationConfig` (an object with its fields is copied into one)."""
    if isinstance(generation, GenerationConfig):
        return generation
    values = {
        f.name: getattr(generation, f.name) for f in fields(GenerationConfig) if hasattr(generation, f.name)
    }
    try:
        return GenerationConfig(**values)
    except TypeError as exc:
        raise TypeError(
            f"generation must be a GenerationConfig or an object with its fields: {exc}"
        ) from None


def _folder_options(info: RunnerInfo, generation: Any, pretrained: Any) -> SearchOptions:
    """The search options of a translator before its own and a call's: the package's defaults
    with the translator's budget rule (``a * n + b`` with :data:`DEFAULT_MAX_LEN_A`,
    :data:`DEFAULT_MAX_LEN_B`, at most what the runner holds), then an export folder's
    generation config, then an imported model's generation defaults."""
    options = SearchOptions(
        max_len_a=DEFAULT_MAX_LEN_A,
        max_len_b=float(DEFAULT_MAX_LEN_B),
        max_decoding_length=int(info.generation_limit),
    )
    try:
        if generation is not None:
            options = _generation_config(generation).to_search_options(options)
        if pretrained is not None:
            options = pretrained.to_search_options(options)
    except ValueError as exc:
        raise TranslationError(f"the folder's generation options: {exc}") from None
    return options


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
        options: the generation options (see :meth:`translate`), laid over ``generation``'s
            and ``pretrained``'s; a value of ``None`` is an option not given.
        generation: the folder's defaults of those options: a
            :class:`transformer_ext.export_format.GenerationConfig` (an export folder's
            ``generation.json``) or any object with its fields ``beam_size``, ``length_penalty``,
            ``alpha``, ``max_len_a``, ``max_len_b`` (and optionally ``min_new_tokens``,
            ``max_new_tokens``, ``special_tokens``); ``None``: the defaults above.
        max_len: the model's maximum positions, for a runner that does not know them (a bare
            ``TensorRTRunner``); given, it replaces the runner's.
        source_dir: the folder tokenizer and runner were loaded from (named in messages).
        source_lang, target_lang: the language codes of a multilingual model (the tokenizer's
            ``with_languages``: Marian's ``>>xx<<`` target token, M2M100 / NLLB's source token and
            forced target token); a code not given is the tokenizer's default (M2M100 / NLLB:
            the checkpoint's ``tokenizer_config.json``; one warning names it); an unknown code,
            or a missing one without a default, is a :class:`TranslationError` listing the codes
            the model knows, and so is a code for a model without languages.
        pretrained: the :class:`transformer_ext.convert.GenerationDefaults` of a model converted
            from transformers (its ``generation_defaults.json``): every decode bans its banned
            tokens, forces the target-language token first when it says so, budgets
            ``max_length - 1`` new tokens per source whatever its length (unless ``max_len_a`` /
            ``max_len_b`` are given) and, beam search, applies transformers' early-stopping rule,
            as ``generate()``; without a ``generation`` config it also sets the beam size
            (``num_beams``) and the length penalty ("hf" with its exponent).

    Most callers build one with :meth:`from_model_dir` or :meth:`from_export_dir`.
    """

    def __init__(
        self,
        tokenizer: Optional[Tokenizer] = None,
        runner: Optional[Runner] = None,
        *,
        generation: Optional[Any] = None,
        max_len: Optional[int] = None,
        source_dir: Union[str, os.PathLike, None] = None,
        source_lang: Optional[str] = None,
        target_lang: Optional[str] = None,
        pretrained: Optional[Any] = None,
        **options: Any,
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
        _say_default_languages(tokenizer, source_lang, target_lang)
        self.tokenizer = tokenizer
        self.runner = runner
        self._parallel = None  # a SourceParallel over several runners (from_export_dir(workers=N))
        self.info = _runner_info(runner, max_len)
        self.source_dir: Optional[Path] = None if source_dir is None else Path(source_dir)
        if tokenizer is not None:
            self._check_tokenizer(tokenizer)
        self.pretrained = pretrained
        self.generation = generation  # the folder's generation config, as given
        if generation is not None:
            _check_generation_ids(generation, tokenizer)
        self._forced_prefix = _forced_prefix(pretrained, tokenizer) if pretrained is not None else []
        self.pad_id, self.bos_id, self.eos_id = self._special_ids()
        layer = self._layer(options)
        folder = _folder_options(self.info, generation, pretrained)
        self.search_defaults: SearchOptions = self._lay_over(folder, layer)
        self.settings: TranslatorSettings = self._settings_over(TranslatorSettings(), layer)
        self._explicit = frozenset(layer.values)  # fields the translator was given
        self._explicit_budget = bool({"max_len_a", "max_len_b"} & self._explicit)

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
        workers: int = 1,
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
        tokenizer files and generation config (always checked). ``workers``: decode each batch
        in that many parts at once, each part on a runner of its own with ``threads`` threads
        (default 1: one runner; :class:`transformer_ext.runtimes.SourceParallel` says when
        several pay: beam search at batch size on ONNX Runtime's CPU provider, with
        ``threads=1`` each); random sampling splits too, each source drawing from its own
        stream, so the samples are those of one runner.

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
            if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
                raise RuntimeOptionError(f"workers must be a positive integer, got {workers!r}")
            manifest = read_manifest(export_dir, verify=verify)
            _check_export_tokenizer(export_dir, manifest)
            generation = read_generation_config(export_dir, manifest)  # defaults for folders without one
            pretrained = _read_pretrained(export_dir)
            runners = [
                open_export_dir(
                    export_dir, runtime, provider, threads, precision=precision, manifest=manifest
                )
                for _ in range(workers)
            ]
            # Built after the sessions: making a session holds, for a moment, far more than it
            # keeps (docs/footprint.md), and the tokenizer's tables (18 MiB at opus-mt's
            # vocabulary) would be held under that peak.
            tokenizer = _load_export_tokenizer(export_dir, manifest)
        except RuntimeOptionError as exc:
            raise TranslationError(str(exc)) from None
        translator = cls(
            tokenizer,
            runners[0],
            generation=generation,
            source_dir=export_dir,
            pretrained=pretrained,
            **options,
        )
        if workers > 1:
            from .runtimes.pool import SourceParallel

            translator._parallel = SourceParallel(runners)
        return translator

    def _search(self, search, input_ids: np.ndarray, lengths: np.ndarray, **options) -> list:
        """``search(runner, input_ids, lengths, **options)`` on this translator's runner, or on
        its several runners at once, each on a part of the sources (``workers``)."""
        if self._parallel is None:
            return search(self.runner, input_ids, lengths, **options)
        return self._parallel.run(search, input_ids, lengths, **options)

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

    def encode(
        self,
        sources: Iterable[str],
        *,
        strict: bool = True,
        long_lines: str = "error",
        report: Optional[_InputReport] = None,
    ) -> list[list[int]]:
        """Token ids of each source, with every bad input reported as a :class:`TranslationError`.

        ``strict=False``: an empty source gets no ids (its translation is empty), characters or
        pieces outside the vocabulary become the unknown token (noted in ``report``: one warning
        for the input). ``long_lines="truncate"``: a source longer than the model's positions is
        cut to them (noted in ``report``) instead of an error.
        """
        if isinstance(sources, (str, bytes)):
            raise TypeError("translate() takes a list (or any iterable) of source strings, not one string")
        tokenizer = self._require_tokenizer()
        encoded = []
        limit = self.info.source_limit
        report = _InputReport() if report is None else report
        unk = getattr(tokenizer, "unk_id", None)
        for i, text in enumerate(sources):
            if not isinstance(text, str):
                raise TypeError(f"source {i} is a {type(text).__name__}, expected str")
            text = _normalize(text)
            if not text:
                if strict:
                    raise _source_error(i, "empty source")
                encoded.append([])
                continue
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
                if strict:
                    raise _source_error(i, str(exc)) from None
                ids = tokenizer.encode_source(text, unknown="unk")
                report.unknown.append((i, str(exc)))
            else:
                if unk is not None and unk in ids:  # a subword tokenizer maps them to <unk>
                    detail = _unknown_pieces(tokenizer, text, ids, int(unk))
                    if strict:
                        raise _source_error(i, detail)
                    report.unknown.append((i, detail))
            if len(ids) > limit:
                if long_lines != "truncate":
                    raise _source_error(
                        i,
                        f"{len(ids)} tokens, more than the model's max_len ({limit}); split the source "
                        "(or truncate it: long_lines='truncate', --long-lines truncate)",
                    )
                report.truncated.append((i, len(ids)))
                ids = ids[:limit]
            encoded.append(ids)
        return encoded

    def encode_targets(self, targets: Sequence[str], what: str = "target") -> list[list[int]]:
        """Target token ids of each text (for :meth:`score` and target prefixes); characters
        outside the target vocabulary are a :class:`TranslationError` naming the target."""
        tokenizer = self._require_tokenizer()
        out = []
        for i, text in enumerate(targets):
            if not isinstance(text, str):
                raise TypeError(f"{what} {i} is a {type(text).__name__}, expected str")
            try:
                out.append(list(tokenizer.encode_target(_normalize(text))))
            except UnknownCharacterError as exc:
                raise TranslationError(f"{what} {i}: {exc}", index=i, detail=str(exc)) from None
        return out

    def max_new_tokens(self, src_lengths: np.ndarray, max_len_a: float, max_len_b: float) -> np.ndarray:
        """The older name of :meth:`max_decoding_length` (one deprecation warning per process)."""
        warn_renamed("Translator.max_new_tokens()", "Translator.max_decoding_length()", None)
        return self.max_decoding_length(src_lengths, max_len_a, max_len_b)

    def max_decoding_length(self, src_lengths: np.ndarray, max_len_a: float, max_len_b: float) -> np.ndarray:
        """Per-row budget ``floor(a * src_len + b)`` (EOS included), at least 1, at most what the
        model's positions and the runner's cache hold and the translator's ``max_decoding_length``."""
        from .decoding import max_decoding_length_for

        for name, value in (("max_len_a", max_len_a), ("max_len_b", max_len_b)):
            if SearchOptions.__dataclass_fields__[name].metadata["check"](value) is not None:
                raise TranslationError(f"{name} must be a finite number >= 0, got {value!r}")
        return max_decoding_length_for(
            src_lengths, float(max_len_a), float(max_len_b), cap=self._budget_cap()
        )

    def _budget_cap(self, options: Optional[SearchOptions] = None) -> int:
        """The most tokens one source may generate: the runner's limit and ``max_decoding_length``."""
        options = self.search_defaults if options is None else options
        return min(int(self.info.generation_limit), int(options.max_decoding_length))

    def budget(self, src_lengths: Sequence[int], options: Optional[SearchOptions] = None) -> np.ndarray:
        """int64 per-source budgets (generated tokens, EOS included) of ``options`` (default: the
        translator's) for sources of ``src_lengths`` tokens, capped by what the runner holds."""
        options = self.search_defaults if options is None else options
        return np.minimum(options.budget(np.asarray(src_lengths, dtype=np.int64)), self._budget_cap(options))

    def _warn_if_capped(self, lengths: Sequence[int], options: SearchOptions) -> None:
        """One warning when ``a * n + b`` asks for more tokens than the model's ``max_len`` allows."""
        cap = self._budget_cap(options)
        a, b = options.max_len_a, options.max_len_b
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

    @staticmethod
    def _layer(options: dict) -> OptionLayers:
        try:
            return OptionLayers(options)
        except OptionError as exc:
            raise TranslationError(str(exc)) from None

    def _lay_over(self, under: SearchOptions, layer: OptionLayers, explicit=frozenset()) -> SearchOptions:
        """``layer`` over ``under`` (:func:`transformer_ext.translator_options.lay_over`), then
        what the translator itself bounds: the beam and the hypotheses by the target vocabulary,
        attention by the runner."""
        try:
            options = lay_over(under, layer, explicit)
        except OptionError as exc:
            raise TranslationError(str(exc)) from None
        vocab = int(self.info.tgt_vocab_size)
        for field, value in (("beam_size", options.beam_size), ("num_hypotheses", options.num_hypotheses)):
            if value > vocab:
                name = layer.name(field) if field in layer.spelled else field
                raise TranslationError(
                    f"{name} {value} is more than the target vocabulary's {vocab} tokens; give at most {vocab}"
                )
        if options.return_attention:
            try:
                decoding.check_attention_runner(self.runner)
            except ValueError as exc:
                raise TranslationError(str(exc)) from None
        return options

    @staticmethod
    def _settings_over(under: TranslatorSettings, layer: OptionLayers) -> TranslatorSettings:
        try:
            return settings_over(under, layer)
        except OptionError as exc:
            raise TranslationError(str(exc)) from None

    def search_options(self, **options) -> tuple[SearchOptions, TranslatorSettings]:
        """The search options and the settings a call with ``options`` decodes with: the
        translator's, with ``options`` laid over them (each checked; :class:`TranslationError`
        naming a bad one)."""
        layer = self._layer(options)
        search = self._lay_over(self.search_defaults, layer, self._explicit)
        return search, self._settings_over(self.settings, layer)

    def resolve_options(self, **options) -> dict:
        """The generation settings a call with ``options`` decodes with, as one dictionary
        (:func:`transformer_ext.translator_options.settings_view`: every SearchOptions field,
        the older names beside them, ``batch_size``, ``strict``, ``long_lines``)."""
        search, settings = self.search_options(**options)
        size = DEFAULT_BATCH_SIZE if settings.batch_size is None else settings.batch_size
        return settings_view(search, settings, size)

    def _resolve(self, options: dict) -> dict:
        """:meth:`resolve_options` with whether the call or the translator gave ``max_len_a`` or
        ``max_len_b`` (``explicit_budget``)."""
        view = self.resolve_options(**options)
        view["explicit_budget"] = self._explicit_budget or bool(
            {"max_len_a", "max_len_b"} & {k for k, v in options.items() if v is not None}
        )
        view["forced_prefix"] = list(self._forced_prefix)
        return view

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
        self,
        sources: Iterable[str],
        *,
        progress: bool = False,
        target_prefix: Union[str, Sequence[str], None] = None,
        **options,
    ) -> list[Translation]:
        """Translate each source: one :class:`Translation` per source, in input order, for every
        setting (a ``str`` subclass: the best text; ``.texts`` and ``.hypotheses`` hold the
        n-best with tokens and scores).

        ``sources``: a list or any iterable of strings (a generator is read once, up front).
        ``target_prefix``: a text every translation starts with, or one per source (forced
        decoding of its tokens first; a prefix longer than the source's budget is an error).
        ``options`` override the translator's generation options for this call:

        * every field of :class:`transformer_ext.decoding.SearchOptions` (CTranslate2's names):
          ``beam_size`` (1 is greedy decoding or sampling, more is beam search);
          ``num_hypotheses`` (hypotheses per source, at most ``beam_size``, or samples);
          ``length_penalty`` (the exponent) and ``length_penalty_type`` (the formula: "gnmt"
          ((5+len)/6)^a, "seed" ((5+len+1)/5)^a, "average" len^a, "none", "hf" transformers'
          beam search with ``early_stopping``; len counts the generated tokens with the EOS);
          ``max_len_a``, ``max_len_b`` (at most ``a * n + b`` generated tokens for a source of n
          tokens, defaults :data:`DEFAULT_MAX_LEN_A` and :data:`DEFAULT_MAX_LEN_B`, with a
          warning when a value given explicitly asks for more than the model's ``max_len``);
          ``max_decoding_length`` (the cap of that budget), ``min_decoding_length`` (EOS
          suppressed before that many tokens; both count the EOS); ``sampling_topk`` (1
          greedy, 0 the whole vocabulary), ``sampling_topp``, ``sampling_temperature``,
          ``seed`` (random sampling, beam size 1; each source draws from the stream of the seed
          and its index in ``sources``, so the batching does not change what is sampled);
          ``repetition_penalty``, ``no_repeat_ngram_size``; ``return_scores`` (greedy
          hypotheses with scores; beam search and sampling always have them);
          ``return_attention`` (each hypothesis' ``attention``, one row per token over the
          encoded source, the last decoder layer's cross-attention averaged over its heads, as
          CTranslate2's: the eager runner, and ONNX Runtime on an export made with ``python -m
          export.onnx --attention``; other runners refuse it);
        * the older spellings ``n_best`` (``num_hypotheses``), ``alpha`` (``length_penalty``),
          ``length_penalty`` given as a formula's name (``length_penalty_type``), ``min_length``
          and ``max_length`` (``min_decoding_length``, ``max_decoding_length``);
        * ``strict`` (False, the command line's rule): an empty source has the empty
          translation, characters or pieces outside the vocabulary become the unknown token
          (one warning for the input, naming them); True makes both an error naming the source
          and the characters or pieces (every tokenizer: characters, SentencePiece, converted);
          ``long_lines``: "error" (default) or "truncate" for sources longer than the model's positions;
        * ``batch_size``: sources decoded together (64); sources are sorted by length into batches.

        ``progress``: a progress bar (tqdm, on stderr) for inputs of at least
        :data:`PROGRESS_MIN_BATCHES` batches. Sources are normalised (whitespace collapsed,
        lower-cased for the demo tokenizer) before encoding.
        """
        return self.translate_detailed(sources, progress=progress, target_prefix=target_prefix, **options)

    def translate_text(self, sources: Iterable[str], **options) -> list[str]:
        """:meth:`translate` as plain strings (the best translation of each source)."""
        return [str(t) for t in self.translate(sources, **options)]

    def translate_detailed(
        self,
        sources: Iterable[str],
        *,
        progress: bool = False,
        target_prefix: Union[str, Sequence[str], None] = None,
        _report: Optional[_InputReport] = None,
        _indices: Optional[Sequence[int]] = None,
        **options,
    ) -> list[Translation]:
        """:meth:`translate` (the same :class:`Translation` objects). ``_indices``: each source's
        index in the caller's whole input (default its position in ``sources``), which with
        ``seed`` picks its sampling stream."""
        search, settings = self.search_options(**options)
        if isinstance(sources, (str, bytes)):
            raise TypeError("translate() takes a list (or any iterable) of source strings, not one string")
        sources = list(sources)  # a generator is consumed once; results refer back to it by index
        report = _InputReport() if _report is None else _report
        encoded = self.encode(sources, strict=settings.strict, long_lines=settings.long_lines, report=report)
        if _report is None:
            report.warn()
        prefixes = self._prefixes(target_prefix, len(sources))
        self._require_tokenizer()
        given = {k for k, v in options.items() if v is not None}
        explicit_budget = self._explicit_budget or bool({"max_len_a", "max_len_b"} & given)
        if explicit_budget and encoded:
            self._warn_if_capped([len(x) for x in encoded], search)
        batch_size = DEFAULT_BATCH_SIZE if settings.batch_size is None else settings.batch_size
        size = self._batch_size(batch_size, search.beam_size)
        results: list[Optional[Translation]] = [None] * len(encoded)
        for i, ids in enumerate(encoded):
            if not ids:  # an empty source (strict=False): the empty translation
                attention = [] if search.return_attention else None
                results[i] = Translation(
                    sources[i], [""], [Hypothesis([], None, None, True, None, attention)]
                )
        todo = [i for i in range(len(encoded)) if encoded[i]]
        order = sorted(todo, key=lambda i: len(encoded[i]))  # similar lengths together
        batches = [order[start : start + size] for start in range(0, len(order), size)]
        bar = _progress_bar(len(encoded)) if progress and len(batches) >= PROGRESS_MIN_BATCHES else None
        model = self.model
        was_training = getattr(model, "training", False)
        if was_training:
            model.eval()
        try:
            for rows in batches:
                try:
                    out = self._decode_batch(
                        [encoded[i] for i in rows],
                        search,
                        [prefixes[i] for i in rows],
                        [i if _indices is None else int(_indices[i]) for i in rows],
                    )
                except _PrefixError as exc:
                    i = rows[exc.row]
                    raise _source_error(i, exc.detail) from None
                for i, translation in zip(rows, out):
                    results[i] = translation.with_source(sources[i])
                if bar is not None:
                    bar.update(len(rows))
        finally:
            if bar is not None:
                bar.close()
            if was_training:
                model.train()
        return results  # type: ignore[return-value]

    def _prefixes(self, target_prefix, n: int, opts: Optional[dict] = None) -> list[list[int]]:
        """The forced first target tokens of each of ``n`` sources: an imported model's (e.g. a
        target-language token), then ``target_prefix``'s. (``opts`` is not read.)"""
        if target_prefix is None:
            texts = [None] * n
        elif isinstance(target_prefix, str):
            texts = [target_prefix] * n
        else:
            texts = list(target_prefix)
            if len(texts) != n:
                raise TranslationError(
                    f"target_prefix must be one text or one per source ({n}), got {len(texts)}"
                )
        given = [t for t in texts if t is not None]
        encoded = iter(self.encode_targets(given, "target prefix")) if given else iter(())
        forced = self._forced_prefix
        out = []
        for t in texts:
            ids = next(encoded) if t is not None else []
            if forced and ids[: len(forced)] == forced:  # M2M100 / NLLB targets start with the language
                ids = ids[len(forced) :]
            out.append(forced + ids)
        return out

    def _decode_batch(
        self,
        encoded: list[list[int]],
        search: SearchOptions,
        prefixes: Optional[list[list[int]]] = None,
        indices: Optional[list[int]] = None,
    ) -> list[Translation]:
        """One batch of encoded sources through greedy decoding, sampling or beam search
        (``source`` left empty); ``indices``: each source's index in the whole input (its
        sampling stream; default ``0 .. B-1``)."""
        tok = self._require_tokenizer()
        lengths = np.array([len(ids) for ids in encoded], dtype=np.int64)
        input_ids = np.full((len(encoded), int(lengths.max())), self.pad_id, dtype=np.int64)
        for r, ids in enumerate(encoded):
            input_ids[r, : lengths[r]] = ids
        budget = self.budget(lengths, search)
        prefix = None if prefixes is None or not any(prefixes) else prefixes
        if prefix is not None:
            for r, p in enumerate(prefix):
                if len(p) > int(budget[r]):
                    raise _PrefixError(
                        r,
                        f"the target prefix has {len(p)} tokens, more than the {int(budget[r])} this source may "
                        "generate (max_len_a, max_len_b, max_decoding_length)",
                    )
        hypotheses = max(search.beam_size, search.num_hypotheses) if search.sampling else search.beam_size
        self._check_memory(len(encoded), hypotheses, int(lengths.max()), int(budget.max()))
        kwargs = search.generate_kwargs()
        kwargs.update(
            bos_id=self.bos_id,
            eos_id=self.eos_id,
            max_decoding_length=budget,
            min_decoding_length=np.minimum(search.min_decoding_length, budget),
            target_prefix=prefix,
        )
        n = search.num_hypotheses
        if search.beam_size == 1 and not (search.sampling or search.return_scores or search.return_attention):
            plain = {k: kwargs[k] for k in _GREEDY_KWARGS}
            out = self._search(decoding.greedy_decode, input_ids, lengths, **plain)
            # a row shorter than its budget stopped at an EOS
            hyps = [
                Hypothesis([int(t) for t in row], None, None, len(row) < int(budget[r]))
                for r, row in enumerate(out)
            ]
            return [Translation("", [tok.decode_target(h.tokens)], [h]) for h in hyps]
        if not search.sampling:
            out = self._search(decoding.generate, input_ids, lengths, **kwargs)
        else:  # each source's stream is picked by the seed and its index in the whole input
            out = self._search(decoding.generate, input_ids, lengths, source_index=indices, **kwargs)
        return [Translation("", [tok.decode_target(h.tokens) for h in row[:n]], list(row[:n])) for row in out]

    def _check_memory(self, sources: int, hypotheses: int, src_len: int, steps: int) -> None:
        """Refuse, before anything is allocated, a batch whose search state alone (the decoder's
        self- and cross-attention caches, a step's scores and the token history of every row)
        exceeds the memory this process can still allocate."""
        have = _memory_headroom()
        if have is None:
            return
        info = self.info
        rows = sources * hypotheses
        item = 2 if info.precision in ("fp16", "bf16") else 4
        cache = 2 * info.n_layers * (steps + 1 + src_len) * info.d_model * item
        need = rows * (cache + 3 * 4 * info.tgt_vocab_size + 3 * 8 * (steps + 1))
        if need > have:
            raise TranslationError(
                f"a batch of {sources} sources x {hypotheses} hypotheses ({src_len} source tokens, up to "
                f"{steps} generated) needs about {need / 2**30:.2f} GiB for its search state, more than "
                f"the {have / 2**30:.2f} GiB this process can still allocate; lower beam_size (--beam-size) "
                "or batch_size (--max-batch-size, --max-batch-tokens)"
            )

    # ------------------------------------------------------------------ streaming and scoring
    def translate_iterable(
        self,
        lines: Iterable[str],
        *,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        window: int = DEFAULT_WINDOW,
        target_prefix: Optional[str] = None,
        ready: Optional[Callable[[], bool]] = None,
        **options,
    ):
        """Translate ``lines`` lazily: read ``window`` lines at a time, sort them by length, decode
        batches of at most ``max_batch_tokens`` padded source tokens, and yield one
        :class:`Translation` per line in input order as soon as it and every line before it are
        done (:func:`transformer_ext.batching.translate_iterable`). ``options`` as for
        :meth:`translate`; ``batch_size`` (given here or to the translator) caps the sources of a
        batch, which are otherwise bounded only by ``max_batch_tokens`` and the runner's limits;
        one warning for the whole input when ``strict=False`` or ``long_lines="truncate"``
        changed lines. ``ready``: whether the next line has arrived
        (:meth:`transformer_ext.text.StreamLines.ready`); when it has not, the lines read so far
        are translated before waiting (an interactive pipe gets each answer).
        """
        from .batching import translate_iterable

        search, settings = self.search_options(**options)
        report = _InputReport()  # what non-strict encoding changed, by index in the whole input
        quiet = _InputReport()

        def length(item: tuple[int, str]) -> int:  # called once per line, in input order
            i, line = item
            one = _InputReport()
            ids = self.encode([line], strict=False, long_lines="truncate", report=one)[0]
            if not settings.strict:
                report.unknown += [(i, detail) for _, detail in one.unknown]
            if settings.long_lines == "truncate":
                report.truncated += [(i, n) for _, n in one.truncated]
            return len(ids)

        def translate_batch(batch: list[tuple[int, str]]) -> list[Translation]:
            # a batch is a run of the window sorted by length: each line decodes with its own
            # index in the whole input (its sampling stream)
            return self.translate_detailed(
                [line for _, line in batch],
                target_prefix=target_prefix,
                _report=quiet,
                _indices=[i for i, _ in batch],
                **{**options, "batch_size": len(batch)},
            )

        capped = settings.batch_size is not None
        size = self._batch_size(settings.batch_size if capped else sys.maxsize, search.beam_size)
        if isinstance(lines, (str, bytes)):
            raise TypeError("translate_iterable() takes an iterable of lines, not one string")
        try:
            yield from translate_iterable(
                translate_batch,
                enumerate(lines),
                length=length,
                max_batch_tokens=max_batch_tokens,
                max_batch_size=size if size < sys.maxsize else None,
                window=window,
                ready=ready,
            )
        finally:
            report.warn()

    def score(self, sources: Sequence[str], targets: Sequence[str], **options) -> list[TargetScore]:
        """Forced decoding: the log-probability the model gives each target as the translation
        of its source (per token and summed; the EOS included), in batches sorted by length
        (``batch_size``). A target with characters outside the target vocabulary is a
        :class:`TranslationError` naming it, as a source is."""
        _, settings = self.search_options(**options)
        sources, targets = list(sources), list(targets)
        if len(sources) != len(targets):
            raise TranslationError(
                f"score() needs one target per source: {len(sources)} sources, {len(targets)} targets"
            )
        encoded = self.encode(sources, strict=True, long_lines=settings.long_lines)
        wanted = self.encode_targets(targets)
        cap = self.info.generation_limit
        for i, ids in enumerate(wanted):
            if len(ids) + 1 > cap:
                raise TranslationError(
                    f"target {i}: {len(ids)} tokens and the EOS, more than the {cap} the model can score"
                )
        size = self._batch_size(DEFAULT_BATCH_SIZE if settings.batch_size is None else settings.batch_size, 1)
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
        results: list[Optional[TargetScore]] = [None] * len(encoded)
        for begin in range(0, len(order), size):
            rows = order[begin : begin + size]
            lengths = np.array([len(encoded[i]) for i in rows], dtype=np.int64)
            input_ids = np.full((len(rows), int(lengths.max())), self.pad_id, dtype=np.int64)
            for r, i in enumerate(rows):
                input_ids[r, : lengths[r]] = encoded[i]
            scored = decoding.score(
                self.runner,
                input_ids,
                lengths,
                [wanted[i] for i in rows],
                bos_id=self.bos_id,
                eos_id=self.eos_id,
            )
            for i, h in zip(rows, scored):
                results[i] = TargetScore(sources[i], targets[i], h.tokens, h.token_log_probs, h.log_prob)
        return results  # type: ignore[return-value]


# the keyword arguments of greedy_decode among those Translator._decode_batch passes generate()
_GREEDY_KWARGS = (
    "bos_id",
    "eos_id",
    "max_decoding_length",
    "min_decoding_length",
    "target_prefix",
    "banned_ids",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "force_eos_at_budget",
)


class _PrefixError(Exception):
    def __init__(self, row: int, detail: str):
        super().__init__(detail)
        self.row, self.detail = row, detail


class _DetailedTranslator(Translator):
    """:meth:`Translator.from_model`'s translator: ``translate`` returns :class:`Translation` objects."""

    def translate(self, sources: Iterable[str], *, progress: bool = False, **options) -> list[Translation]:
        return self.translate_detailed(sources, progress=progress, **options)


def _read_pretrained(folder: Path):
    """The generation defaults of a model converted from transformers (``generation_defaults.json``
    in its model folder, copied into its export folder by ``python -m export.onnx``), or None."""
    from .convert.generation import read_generation_defaults

    return read_generation_defaults(folder)


def _forced_prefix(pretrained: Any, tokenizer: Optional[Tokenizer]) -> list[int]:
    """The tokens an imported model's every decode starts with (the target language's, or the
    checkpoint's forced first token), checking that its source language is known (M2M100 / NLLB):
    a missing language is a TranslationError listing the codes."""
    if tokenizer is None:
        return []
    try:
        forced = [int(t) for t in pretrained.forced_prefix(tokenizer)]
    except TokenizerError as exc:  # a missing target language, the codes listed
        raise TranslationError(str(exc)) from None
    if callable(getattr(tokenizer, "with_languages", None)) and getattr(tokenizer, "type", "") != "marian":
        try:  # a Marian source may carry its own >>xx<<; M2M100 / NLLB need the source language
            tokenizer.encode_source("a")
        except UnknownCharacterError:
            pass
        except TokenizerError as exc:
            raise TranslationError(str(exc)) from None
    return forced


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


def _say_default_languages(
    tokenizer: Optional[Tokenizer], source_lang: Optional[str], target_lang: Optional[str]
) -> None:
    """One warning naming the languages a multilingual tokenizer uses by default (M2M100 / NLLB:
    the ``src_lang`` / ``tgt_lang`` of the checkpoint's ``tokenizer_config.json``) for the codes
    not given."""
    used, flags = [], []
    for side, given in (("source", source_lang), ("target", target_lang)):
        default = getattr(tokenizer, f"{side}_lang", None)
        if given is None and isinstance(default, str):
            used.append(f"the {side} language {default!r}")
            flags.append(f"--{side}-lang")
    if used:
        logger.warning(
            "no %s given: translating with %s, the defaults of the checkpoint's tokenizer_config.json "
            "(give %s, or %s= to the Translator, to choose)",
            " / ".join(flags),
            " and ".join(used),
            " / ".join(flags),
            " / ".join(f.lstrip("-").replace("-", "_") for f in flags),
        )


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
    _check_export_tokenizer(export_dir, manifest)
    return load_tokenizer(export_dir)


def _check_export_tokenizer(export_dir: Path, manifest: dict) -> None:
    """Raise TranslationError when the manifest names tokenizer files this version cannot read
    or the folder lacks one of them (checked before any session is made)."""
    names = tokenizer_files(manifest)
    if not names:
        return
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


def _progress_bar(total: int):
    """A tqdm bar on stderr counting sources, or None without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a runtime dependency; a bare environment just shows no bar
        return None
    return tqdm(total=total, unit="source", desc="translating", file=sys.stderr, leave=False)
