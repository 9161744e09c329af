"""Translate text with any runner: a model folder on eager PyTorch, an export folder on ONNX
Runtime (no torch needed) or TensorRT.

Command line::

    python -m transformer_ext.translate "three hundred and forty-two"     # dreihundertzweiundvierzig
    python -m transformer_ext.translate --input numbers.txt --beam 4 --output out.txt
    printf 'one\\ntwo\\n' | python -m transformer_ext.translate
    python -m transformer_ext.translate "forty-two" --beam 5 --n-best 3    # index, score, text
    python -m transformer_ext.translate --model onnx_export "forty-two"    # ONNX Runtime

``--model DIR`` is a model folder (``config.json``, ``model.safetensors``, ``tokenizer.json``:
eager PyTorch) or an export folder (``manifest.json``, written by ``python -m export.onnx``:
ONNX Runtime, or TensorRT with ``--runtime tensorrt``); without it, the bundled demo model.

Python::

    from transformer_ext.translate import Translator
    translator = Translator.from_export_dir("onnx_export")      # or .from_model_dir(None): the demo model
    translator.translate(["forty-two", "one thousand and one"])  # ['zweiundvierzig', 'eintausendeins']

Decoding is the project's single greedy / beam-search loop (:mod:`transformer_ext.decoding`)
over the runner protocol, so every runtime gives the same tokens. The maximum number of
generated tokens of a source of ``n`` tokens is ``a * n + b`` (``--max-len-a``, ``--max-len-b``),
capped by the model's ``max_len`` and the runner's cache capacity (with a warning when an ``a``
or ``b`` given explicitly asks for more). A generation config (beam size, length penalty, the
budget rule), when the translator is given one, sets the defaults of the generation options.

This module imports no torch: translating from an export folder with ONNX Runtime needs only
onnxruntime and numpy.

Failures of the command: invalid options (a non-finite or negative ``--max-len-a``, ``--beam 0``,
options of another runtime...) are usage errors (exit code 2, argparse's message); bad input
text or files, a bad model or export folder, a runtime or provider that is not installed, an
unwritable ``--output`` and a full disk print one line
``python -m transformer_ext.translate: error: ...`` (exit code 1, ``--debug`` shows the
traceback); Ctrl-C exits with 130, SIGTERM with 143. Translations are printed (or written to
``--output``, atomically) only once every source is translated, so an interrupted run writes none.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

import numpy as np

from .cli import UserError, add_debug_flag, run_cli
from .decoding import LENGTH_PENALTIES, Hypothesis, Runner
from .export_format import MANIFEST_NAME, read_generation_config, read_manifest, tokenizer_files
from .fsutil import atomic_write_text
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
    "DEMO_MODEL_DIR",
    "DEFAULT_MAX_LEN_A",
    "DEFAULT_MAX_LEN_B",
    "LENGTH_PENALTIES",
    "RUNTIMES",
    "TranslationError",
    "RuntimeNotAvailableError",
    "Hypothesis",
    "Translation",
    "Translator",
    "is_export_dir",
    "main",
]

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "demo_model"
DEFAULT_MAX_LEN_A = 1.5  # German number words are at most 6 characters longer than English ones
DEFAULT_MAX_LEN_B = 10
PROGRESS_MIN_BATCHES = 4  # a progress bar only for inputs of at least this many batches
RUNTIMES = ("eager", "onnxruntime", "tensorrt")
# ONNX Runtime execution providers by their short names.
PROVIDER_ALIASES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "rocm": "ROCMExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "dml": "DmlExecutionProvider",
}


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


class RuntimeNotAvailableError(ImportError, UserError):
    """The runtime or execution provider asked for is not installed here; the message says what to install."""


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
    """Surrounding whitespace removed and inner runs of whitespace collapsed to one space."""
    return " ".join(text.split())


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


def _config_value(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


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


# ---------------------------------------------------------------------- runners and their limits


@dataclass(frozen=True)
class _Limits:
    """What the translator must respect of a runner."""

    max_source_len: int  # tokens of one source
    max_new_tokens: int  # generated tokens of one source (positions and cache capacity)
    max_sources: Optional[int] = None  # sources per encode call
    max_rows: Optional[int] = None  # sources x beams per decode


def _runner_model_config(runner: Any) -> Any:
    """The model config a runner runs (a config object, or a manifest's ``model_config`` dict)."""
    config = getattr(runner, "config", None)
    if config is None:
        manifest = getattr(runner, "manifest", None)
        config = manifest.get("model_config") if isinstance(manifest, dict) else None
    return config


def _runner_limits(runner: Any, max_len: Optional[int]) -> _Limits:
    config = _runner_model_config(runner)
    dims = getattr(runner, "dims", None)
    limits = getattr(runner, "limits", None)
    if max_len is None:
        max_len = _config_value(config, "max_len") if config is not None else None
    if max_len is None:
        max_len = getattr(runner, "max_len", None) or getattr(dims, "max_positions", None)
    if max_len is None:
        raise TypeError(f"cannot tell the model's max_len from {type(runner).__name__}: pass max_len=")
    max_len = int(max_len)
    caps = [
        max_len,
        getattr(runner, "max_cache_len", None),
        getattr(limits, "max_cache_len", None),
        getattr(limits, "static_cache_len", None),
    ]
    source_caps = [max_len, getattr(limits, "max_src_len", None)]
    return _Limits(
        max_source_len=min(int(c) for c in source_caps if c is not None),
        max_new_tokens=min(int(c) for c in caps if c is not None),
        max_sources=getattr(limits, "max_sources", None),
        max_rows=getattr(limits, "max_rows", None),
    )


def _special_ids(tokenizer: Optional[Tokenizer], runner: Any) -> tuple[int, int, int]:
    """``(pad, bos, eos)``: the tokenizer's, else the runner's model config's."""
    if tokenizer is not None:
        return int(tokenizer.pad_id), int(tokenizer.bos_id), int(tokenizer.eos_id)
    config = _runner_model_config(runner)
    ids = []
    for key in ("pad_id", "bos_id", "eos_id"):
        value = _config_value(config, key) if config is not None else None
        value = getattr(runner, key, None) if value is None else value
        if value is None:
            raise TypeError(
                f"without a tokenizer the special ids come from the runner, and "
                f"{type(runner).__name__} does not know its {key}"
            )
        ids.append(int(value))
    return ids[0], ids[1], ids[2]


def _check_tokenizer(
    tokenizer: Tokenizer, config: Any, tokenizer_file: Optional[str] = None, config_file: Optional[str] = None
) -> None:
    try:
        check_model_config(tokenizer, config, tokenizer_file=tokenizer_file, config_file=config_file)
    except TokenizerError as exc:
        raise TranslationError(str(exc)) from None


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


def _resolve_provider(provider: Optional[str]) -> list[str]:
    """ONNX Runtime providers for a short or full provider name, checked against this installation."""
    import onnxruntime as ort

    if provider is None:
        return ["CPUExecutionProvider"]
    if not isinstance(provider, str) or not provider.strip():
        raise TranslationError(f"provider must be a name such as 'cpu' or 'cuda', got {provider!r}")
    name = PROVIDER_ALIASES.get(provider.strip().lower(), provider.strip())
    available = ort.get_available_providers()
    if name not in available:
        if name == "CUDAExecutionProvider":
            hint = (
                "; install onnxruntime-gpu in place of onnxruntime (`pip uninstall onnxruntime && pip install "
                "onnxruntime-gpu`, or the extra transformer_ext[onnx-gpu])"
            )
        else:
            hint = f"; short names: {', '.join(PROVIDER_ALIASES)}"
        raise RuntimeNotAvailableError(
            f"ONNX Runtime provider {provider!r} ({name}) is not available: this onnxruntime {ort.__version__} has "
            f"{', '.join(available)}{hint}"
        )
    return [name] if name == "CPUExecutionProvider" else [name, "CPUExecutionProvider"]


def _import_onnxruntime() -> None:
    try:
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        raise RuntimeNotAvailableError(
            f"ONNX Runtime is not installed ({exc}): `pip install onnxruntime` (or the deployment extra "
            "`pip install 'transformer_ext[deploy]'`)"
        ) from exc


def _device_buffers_available() -> tuple[bool, str]:
    """Whether :class:`~transformer_ext.runtimes.ort_cuda.OrtCudaRunner` (device-resident
    buffers) can run here: torch installed, a CUDA GPU visible to it, this package's CUDA
    kernels built. ``(False, why)`` otherwise; torch is imported only when it is installed."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return False, "torch is not installed"
    try:
        import torch
    except ImportError as exc:  # a broken install
        return False, f"torch cannot be imported ({exc})"
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA GPU"
    try:
        from . import ops
    except (ImportError, OSError) as exc:
        return False, f"this package's compiled ops cannot be loaded ({exc})"
    if not ops.cuda_kernels_built():
        return False, "this package was built without its CUDA kernels"
    return True, ""


def _import_tensorrt_runtime():
    """The TensorRT runner class, or a RuntimeNotAvailableError that says what to install."""
    import importlib.util

    if importlib.util.find_spec("tensorrt") is None:
        raise RuntimeNotAvailableError(
            "--runtime tensorrt needs TensorRT, which is not installed: on a machine with an NVIDIA GPU "
            "`pip install tensorrt-cu13` (CUDA 13; tensorrt-cu12 for CUDA 12) or "
            "`pip install 'transformer_ext[tensorrt]'`, plus torch with this package's CUDA kernels; "
            "then build the engines with `python -m export.tensorrt EXPORT_DIR`"
        )
    try:
        from .runtimes.trt import TensorRTRunner
    except ImportError as exc:
        raise RuntimeNotAvailableError(
            f"the TensorRT runtime needs torch and this package's compiled ops ({exc}); install transformer_ext "
            "with torch (not the TRANSFORMER_EXT_DEPLOY=1 deployment install)"
        ) from exc
    return TensorRTRunner


# ---------------------------------------------------------------------- the translator


class Translator:
    """Text in, text out over any runner of the decoding protocol.

    Args:
        tokenizer: a :class:`transformer_ext.tokenizer.Tokenizer` (``None``: the runner can
            still decode token ids, e.g. for benchmarks, but translating text is a
            :class:`TranslationError`).
        runner: any runner (:mod:`transformer_ext.runtimes`): ``EagerRunner``, ``OrtRunner``,
            ``OrtCudaRunner``, ``TensorRTRunner``...; its model config, when it exposes one, is
            checked against the tokenizer (vocabulary sizes, special ids).
        beam_size, n_best, max_len_a, max_len_b, length_penalty, alpha, batch_size: the
            generation options (see :meth:`translate`); ``None`` takes ``generation``'s value,
            else the default.
        generation: the defaults of those options: a
            :class:`transformer_ext.export_format.GenerationConfig` (an export folder's
            ``generation.json``) or any object with its fields ``beam_size``, ``length_penalty``,
            ``alpha``, ``max_len_a``, ``max_len_b`` (and optionally ``min_new_tokens``,
            ``max_new_tokens``, ``special_tokens``); ``None``: the defaults above.
        max_len: the model's maximum positions, for a runner that does not tell (a bare
            ``TensorRTRunner``).

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
        self.tokenizer = tokenizer
        self.runner = runner
        self.generation = generation if generation is not None else _GenerationDefaults()
        config = _runner_model_config(runner)
        if tokenizer is not None and config is not None:
            _check_tokenizer(tokenizer, config)
        _check_generation_ids(self.generation, tokenizer)
        self.limits = _runner_limits(runner, max_len)
        self.pad_id, self.bos_id, self.eos_id = _special_ids(tokenizer, runner)
        self.source_dir: Optional[Path] = None  # the folder it was loaded from, for messages
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

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_model_dir(
        cls, path: Union[str, os.PathLike, None] = None, device=None, compile: bool = False, **options
    ) -> "Translator":
        """A model folder (``config.json`` + ``model.safetensors`` + tokenizer files) on eager PyTorch.

        ``path=None`` is the bundled demo model (English number words to German number words);
        ``device``: ``"cpu"`` (default) or ``"cuda"``; ``compile``: the decoder step through
        ``torch.compile`` (see :class:`transformer_ext.runtimes.EagerRunner`): faster per token
        once compiled, at the cost of a compile (seconds) for every new batch shape.
        ``options``: generation options, as for the constructor.

        A folder without ``tokenizer.json`` loads (``tokenizer`` is then ``None``).

        Raises:
            FileNotFoundError: the folder, its config or weights file is missing.
            TokenizerError: ``tokenizer.json`` is corrupt or not a tokenizer description (names the file).
            TranslationError: the tokenizer does not belong to the model (vocabulary sizes or special
                ids differ; names both files and the id), or the folder is an export folder.
        """
        try:
            from .checkpoint import load_model
            from .runtimes.eager import EagerRunner
        except ImportError as exc:
            raise RuntimeNotAvailableError(
                f"a model folder runs on PyTorch, which this installation lacks ({exc}): translate an export "
                "folder instead (python -m export.onnx writes one; Translator.from_export_dir, or --model "
                "EXPORT_DIR), or install transformer_ext with torch"
            ) from exc

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
        tokenizer_path = model_dir / TOKENIZER_FILE
        tokenizer = _load_folder_tokenizer(model_dir)
        device = "cpu" if device is None else device
        model = load_model(model_dir, device)
        if tokenizer is not None:
            _check_tokenizer(
                tokenizer, model.config, os.fspath(tokenizer_path), os.fspath(model_dir / "config.json")
            )
        self = cls(tokenizer, EagerRunner(model, device, compile=compile), **options)
        self.source_dir = model_dir
        return self

    @classmethod
    def from_export_dir(
        cls,
        path: Union[str, os.PathLike],
        runtime: Optional[str] = None,
        provider: Optional[str] = None,
        threads: Optional[int] = None,
        *,
        precision: Optional[str] = None,
        **options,
    ) -> "Translator":
        """An export folder (``python -m export.onnx``): ONNX Runtime by default (needs only
        onnxruntime and numpy), TensorRT with ``runtime="tensorrt"`` once ``python -m
        export.tensorrt`` built its engines.

        ``provider``: the ONNX Runtime execution provider (``"cpu"``, default; ``"cuda"``, or a
        full name such as ``"CUDAExecutionProvider"``). With the CUDA provider the runner is
        :class:`~transformer_ext.runtimes.OrtCudaRunner` (every buffer on the GPU, the caches
        written in place there) when torch is installed, sees a CUDA GPU and this package has
        its CUDA kernels; otherwise :class:`~transformer_ext.runtimes.OrtRunner` with the CUDA
        provider (host buffers, which ONNX Runtime copies to the GPU at every step; the reason
        is logged), so a torch-free deployment with onnxruntime-gpu runs too. ``threads``: ONNX
        Runtime's intra-op threads; ``precision``: the TensorRT engines to run (default ``fp32`` when built, else
        the only precision built). ``options``: generation options, as for the constructor.

        Raises:
            ManifestError: no ``manifest.json``, one of another tool or of an unknown format version;
                ``GenerationConfigError`` (a ManifestError) for an invalid generation config.
            TranslationError: a tokenizer file the manifest lists is missing, the tokenizer does
                not belong to the model, an option that does not fit the runtime.
            RuntimeNotAvailableError: ONNX Runtime, the provider, or TensorRT is not installed
                (the message says what to install).
            InvalidGraphError: a graph is missing or corrupt.
        """
        runtime = "onnxruntime" if runtime is None else runtime
        if runtime not in RUNTIMES:
            raise TranslationError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
        if runtime == "eager":
            raise TranslationError(
                f"{path} is an export folder: it holds ONNX graphs, not PyTorch weights; use "
                "runtime='onnxruntime' or 'tensorrt', or the model folder with the eager runtime"
            )
        if threads is not None:
            threads = _check_positive_int("threads", threads)
        export_dir = Path(path)
        manifest = read_manifest(export_dir)
        tokenizer = _load_export_tokenizer(export_dir, manifest)
        config = manifest["model_config"]
        if tokenizer is not None:
            _check_tokenizer(
                tokenizer,
                config,
                os.fspath(export_dir / TOKENIZER_FILE),
                os.fspath(export_dir / MANIFEST_NAME),
            )
        generation = read_generation_config(export_dir, manifest)  # the defaults for folders without one
        if runtime == "onnxruntime":
            if precision not in (None, "fp32"):
                raise TranslationError(
                    f"precision {precision!r} applies to the TensorRT runtime; ONNX Runtime runs "
                    "the fp32 graphs"
                )
            _import_onnxruntime()
            providers = _resolve_provider(provider)
            device_buffers, why = (
                _device_buffers_available() if providers[0] == "CUDAExecutionProvider" else (False, "")
            )
            if device_buffers:
                from .runtimes.ort_cuda import OrtCudaRunner

                logger.info("CUDA provider with device-resident buffers (OrtCudaRunner)")
                runner = OrtCudaRunner(export_dir, device="cuda", intra_op_num_threads=threads)
            else:
                from .runtimes.ort import OrtRunner

                if why:
                    logger.info(
                        "CUDA provider on host buffers (OrtRunner): %s, so OrtCudaRunner cannot run", why
                    )
                runner = OrtRunner(export_dir, providers=providers, intra_op_num_threads=threads)
        else:
            if provider is not None or threads is not None:
                raise TranslationError(
                    "provider and threads are ONNX Runtime options; the TensorRT runtime takes neither"
                )
            TensorRTRunner = _import_tensorrt_runtime()
            built = sorted(((manifest.get("tensorrt") or {}).get("engines") or {}))
            if not built:
                raise TranslationError(
                    f"{export_dir} has no TensorRT engines: build them with "
                    f"`python -m export.tensorrt {export_dir}` (or use the onnxruntime runtime)"
                )
            if precision is None:
                precision = "fp32" if "fp32" in built or len(built) != 1 else built[0]
            runner = TensorRTRunner.from_export_dir(export_dir, precision)
        self = cls(tokenizer, runner, generation=generation, **options)
        self.source_dir = export_dir
        return self

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
        limit = self.limits.max_source_len
        for i, text in enumerate(sources):
            if not isinstance(text, str):
                raise TypeError(f"source {i} is a {type(text).__name__}, expected str")
            text = _normalize(text)
            if not text:
                raise _source_error(i, "empty source")
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
        cap = self.limits.max_new_tokens
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
            "batch_size", given["batch_size"] if given["batch_size"] is not None else 64
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
        limits = self.limits
        if limits.max_sources is not None:
            batch_size = min(batch_size, int(limits.max_sources))
        if limits.max_rows is not None:
            if beam_size > limits.max_rows:
                raise TranslationError(
                    f"beam size {beam_size} exceeds the {limits.max_rows} rows the runner's "
                    "decoder accepts per call (the TensorRT profile's maximum batch)"
                )
            batch_size = min(batch_size, int(limits.max_rows) // beam_size)
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
        from .decoding import beam_search, greedy_decode

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
        beam, n_best, a, b = opts["beam_size"], opts["n_best"], opts["max_len_a"], opts["max_len_b"]
        if isinstance(sources, (str, bytes)):
            raise TypeError("translate() takes a list (or any iterable) of source strings, not one string")
        sources = list(sources)  # a generator is consumed once; results refer back to it by index

        encoded = self.encode(sources)
        tok = self._require_tokenizer()
        if opts["explicit_budget"] and encoded:
            self._warn_if_capped([len(x) for x in encoded], a, b)
        size = self._batch_size(opts["batch_size"], beam)
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
                lengths = np.array([len(encoded[i]) for i in rows], dtype=np.int64)
                input_ids = np.full((len(rows), int(lengths.max())), self.pad_id, dtype=np.int64)
                for r, i in enumerate(rows):
                    input_ids[r, : lengths[r]] = encoded[i]
                budget = self.max_new_tokens(lengths, a, b)
                min_new = np.minimum(int(getattr(self.generation, "min_new_tokens", 0) or 0), budget)
                if beam == 1:
                    out = greedy_decode(
                        self.runner,
                        input_ids,
                        lengths,
                        bos_id=self.bos_id,
                        eos_id=self.eos_id,
                        max_new_tokens=budget,
                        min_new_tokens=min_new,
                    )
                    for r, i in enumerate(rows):
                        ids = [int(t) for t in out[r]]
                        # a row shorter than its budget stopped at an EOS
                        hyp = Hypothesis(ids, None, None, len(ids) < int(budget[r]))
                        results[i] = Translation(sources[i], [tok.decode_target(ids)], [hyp])
                else:
                    out = beam_search(
                        self.runner,
                        input_ids,
                        lengths,
                        bos_id=self.bos_id,
                        eos_id=self.eos_id,
                        beam_size=beam,
                        n_best=n_best,
                        max_new_tokens=budget,
                        min_new_tokens=min_new,
                        length_penalty=opts["length_penalty"],
                        alpha=opts["alpha"],
                    )
                    for r, i in enumerate(rows):
                        hyps = list(out[r][:n_best])
                        results[i] = Translation(
                            sources[i], [tok.decode_target(h.tokens) for h in hyps], hyps
                        )
                if bar is not None:
                    bar.update(len(rows))
        finally:
            if bar is not None:
                bar.close()
            if was_training:
                model.train()
        return results  # type: ignore[return-value]


class _DetailedTranslator(Translator):
    """:meth:`Translator.from_model`'s translator: ``translate`` returns :class:`Translation` objects."""

    def translate(self, sources: Iterable[str], *, progress: bool = False, **options) -> list[Translation]:
        return self.translate_detailed(sources, progress=progress, **options)


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


# ---------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m transformer_ext.translate",
        description=(
            "Translate with a trained transformer_ext model folder (eager PyTorch) or an export folder "
            "(ONNX Runtime or TensorRT). By default the bundled demo model translates English number words "
            "(0 to 9999) into German number words. Prints one translation per source line, in input order."
        ),
        epilog="Exit codes: 0 success, 1 bad input, model files or missing runtime, 2 invalid options, "
        "130 interrupted, 143 terminated.",
    )
    parser.add_argument(
        "text",
        nargs="*",
        help="source texts, one per argument (quote multi-word sources); '-' reads lines from stdin. "
        "Without text and --input, lines are read from stdin when it is not a terminal.",
    )
    parser.add_argument("--input", "-i", metavar="FILE", help="read sources from FILE, one per line")
    parser.add_argument(
        "--output",
        "-o",
        metavar="FILE",
        help="write the translations to FILE (atomically, once all are done) instead of stdout",
    )
    parser.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="a model folder (config.json, model.safetensors, tokenizer.json) or an export folder "
        "(manifest.json, from python -m export.onnx); default: the bundled demo model",
    )
    parser.add_argument(
        "--runtime",
        choices=RUNTIMES,
        default=None,
        help="eager (PyTorch, a model folder), onnxruntime or tensorrt (an export folder); "
        "default: onnxruntime for an export folder, eager otherwise",
    )
    parser.add_argument(
        "--provider",
        default=None,
        metavar="NAME",
        help="ONNX Runtime execution provider: cpu (default), cuda, or a full name "
        "such as CUDAExecutionProvider; cuda keeps every buffer on the GPU when torch "
        "with CUDA is installed, else ONNX Runtime copies them at every step",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="intra-op threads of ONNX Runtime, or of PyTorch for the eager runtime",
    )
    parser.add_argument(
        "--device", default=None, help="torch device of the eager runtime: cpu (default), cuda or cuda:N"
    )
    parser.add_argument(
        "--beam",
        type=int,
        default=None,
        metavar="N",
        help="beam size; 1 is greedy decoding (default: the export folder's generation config, else 1)",
    )
    parser.add_argument(
        "--n-best",
        type=int,
        default=None,
        metavar="K",
        help="print the K best hypotheses of each source as 'index<TAB>score<TAB>text' "
        "(needs a beam size >= K; greedy output gets no score)",
    )
    parser.add_argument(
        "--max-len-a",
        type=float,
        default=None,
        metavar="A",
        help=f"generate at most A * source_length + B tokens (default A={DEFAULT_MAX_LEN_A}); finite, >= 0",
    )
    parser.add_argument(
        "--max-len-b",
        type=float,
        default=None,
        metavar="B",
        help=f"see --max-len-a (default B={DEFAULT_MAX_LEN_B}); finite, >= 0. The budget is "
        "always capped by the model's max_len (with a warning when A or B ask for more)",
    )
    parser.add_argument(
        "--length-penalty",
        choices=LENGTH_PENALTIES,
        default=None,
        help="beam length penalty, len = generated tokens with the EOS: gnmt ((5+len)/6)^alpha "
        "(default), seed ((5+len+1)/5)^alpha, average len^alpha (fairseq's), none",
    )
    parser.add_argument(
        "--alpha", type=float, default=None, help="length-penalty exponent (default 0.6); finite, >= 0"
    )
    parser.add_argument("--batch-size", type=int, default=64, help="sources decoded together (default 64)")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="eager runtime: run the decoder step through torch.compile: faster per token, but "
        "every new batch shape compiles first (seconds); pays off on large inputs. On CPU it "
        "needs a C++ compiler",
    )
    add_debug_flag(parser)
    return parser


def _finite_non_negative(value: float) -> bool:
    return math.isfinite(value) and value >= 0


def _check_options(parser: argparse.ArgumentParser, args, stdin) -> None:
    """Every option checked before anything is read or loaded; a usage error (exit 2) names it."""
    for option, value in (
        ("--max-len-a", args.max_len_a),
        ("--max-len-b", args.max_len_b),
        ("--alpha", args.alpha),
    ):
        if value is not None and not _finite_non_negative(value):
            parser.error(f"{option} must be a finite number >= 0, got {value}")
    if args.beam is not None and args.beam < 1:
        parser.error(f"--beam must be >= 1, got {args.beam}")
    if args.n_best is not None and args.n_best < 1:
        parser.error(f"--n-best must be >= 1, got {args.n_best}")
    if args.n_best is not None and args.beam is not None and args.n_best > args.beam:
        parser.error(f"--n-best must be between 1 and --beam ({args.beam}), got {args.n_best}")
    if args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.device is not None:
        device = args.device.strip().lower()
        if not (device == "cpu" or device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
            parser.error(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if args.provider is not None and not args.provider.strip():
        parser.error("--provider must name an ONNX Runtime execution provider, e.g. cpu or cuda")
    if args.runtime is not None:
        for problem in _runtime_conflicts(args, args.runtime):
            parser.error(f"{problem}, not to --runtime {args.runtime}")
    if not args.text and args.input is None and (stdin is None or stdin.isatty()):
        parser.error("nothing to translate: give a text, --input FILE, or pipe lines on stdin")


def _runtime_conflicts(args, runtime: str) -> list[str]:
    """Options given that ``runtime`` does not take, each as a phrase naming the option."""
    problems = []
    if runtime != "eager":
        if args.device is not None:
            problems.append("--device applies to the eager runtime only (ONNX Runtime: --provider)")
        if args.compile:
            problems.append("--compile applies to the eager runtime only")
    if runtime != "onnxruntime" and args.provider is not None:
        problems.append("--provider applies to the onnxruntime runtime only")
    if runtime == "tensorrt" and args.threads is not None:
        problems.append("--threads applies to the onnxruntime and eager runtimes only")
    return problems


def _check_output(args) -> Optional[Path]:
    """``--output`` checked before anything is read: a file path in an existing folder, not the input."""
    if args.output is None:
        return None
    if not args.output.strip():
        raise TranslationError("--output must name a file")
    out = Path(args.output)
    if out.is_dir():
        raise TranslationError(f"--output {out} is a directory; give a file path")
    if out.exists() and not out.is_file():
        raise TranslationError(f"--output {out} exists and is not a regular file")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise TranslationError(f"--output {out}: the folder {parent} {what}")
    if (
        args.input is not None
        and out.exists()
        and os.path.exists(args.input)
        and os.path.samefile(out, args.input)
    ):
        raise TranslationError(f"--output {out} is the --input file; write the translations to another file")
    return out


def _read_lines(stream: Iterable[str], name: str) -> list[tuple[str, str]]:
    """``(line, "NAME line N")`` for every line; an empty line is an error naming it."""
    lines = []
    for n, line in enumerate(stream, start=1):
        line = line.rstrip("\r\n")
        if not line.strip():
            raise TranslationError(f"{name}, line {n}: empty source")
        lines.append((line, f"{name}, line {n}"))
    return lines


def _gather_sources(args, stdin) -> tuple[list[str], list[str]]:
    """The sources in input order, and for each where it came from (for error messages)."""
    entries: list[tuple[str, str]] = []
    for n, text in enumerate(args.text, start=1):
        if text == "-":
            entries.extend(_read_lines(stdin, "stdin"))
        else:
            entries.append((text, f"argument {n}"))
    if args.input is not None:
        try:
            with open(args.input, encoding="utf-8") as f:
                entries.extend(_read_lines(f, args.input))
        except FileNotFoundError:
            raise TranslationError(f"input file not found: {args.input}") from None
        except IsADirectoryError:
            raise TranslationError(f"--input {args.input} is a directory, expected a text file") from None
        except UnicodeDecodeError as exc:
            raise TranslationError(
                f"input file {args.input} is not UTF-8 text ({exc.reason} at byte {exc.start})"
            ) from None
    if not args.text and args.input is None:
        entries.extend(_read_lines(stdin, "stdin"))
    if not entries:
        raise TranslationError("nothing to translate: the input is empty")
    return [text for text, _ in entries], [origin for _, origin in entries]


def _load_translator(args) -> Translator:
    """The translator ``--model`` / ``--runtime`` ask for (a model folder: eager; an export folder: ONNX Runtime)."""
    export = args.model is not None and is_export_dir(args.model)
    runtime = args.runtime or ("onnxruntime" if export else "eager")
    problems = _runtime_conflicts(args, runtime)
    if (
        problems
    ):  # only reachable with the runtime chosen by the folder (an explicit one is checked at parsing)
        folder = (
            f"--model {args.model} is an export folder, run by ONNX Runtime"
            if export
            else "the model folder runs on the eager runtime"
        )
        raise TranslationError(f"{problems[0]}, and {folder}")
    if runtime == "eager":
        if export:
            raise TranslationError(
                f"--model {args.model} is an export folder (it has {MANIFEST_NAME}, no PyTorch "
                "weights): --runtime eager needs a model folder; use --runtime onnxruntime "
                "or tensorrt"
            )
        device = args.device or "cpu"
        if device.strip().lower().startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise TranslationError(
                    f"--device {args.device}: torch sees no CUDA GPU on this machine; use --device cpu"
                )
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        return Translator.from_model_dir(args.model, device=device, compile=args.compile)
    if args.model is None:
        raise TranslationError(
            f"--runtime {runtime} needs --model EXPORT_DIR, a folder written by `python -m export.onnx`"
        )
    if not export:
        what = (
            "does not exist"
            if not os.path.exists(args.model)
            else f"is not an export folder (no {MANIFEST_NAME})"
        )
        raise TranslationError(
            f"--model {args.model} {what}: --runtime {runtime} runs an export folder, written by "
            "`python -m export.onnx --model-dir MODEL_DIR --output-dir EXPORT_DIR`; a model "
            "folder runs with --runtime eager"
        )
    return Translator.from_export_dir(
        args.model, runtime=runtime, provider=args.provider, threads=args.threads
    )


def _run(args, stdin, stdout) -> int:
    output = _check_output(args)
    sources, origins = _gather_sources(args, stdin)
    translator = _load_translator(args)
    try:
        translations = translator.translate_detailed(
            sources,
            beam_size=args.beam,
            n_best=args.n_best,
            max_len_a=args.max_len_a,
            max_len_b=args.max_len_b,
            length_penalty=args.length_penalty,
            alpha=args.alpha,
            batch_size=args.batch_size,
            progress=sys.stderr.isatty(),
        )
    except TranslationError as exc:
        if exc.index is None:
            raise
        raise TranslationError(f"{origins[exc.index]}: {exc.detail}") from None
    lines = []
    for index, translation in enumerate(translations):
        if args.n_best is None:
            lines.append(translation.text)
        else:
            for text, hyp in zip(translation.texts, translation.hypotheses):
                score = "-" if hyp.score is None else f"{hyp.score:.4f}"
                lines.append(f"{index}\t{score}\t{text}")
    text = "".join(line + "\n" for line in lines)
    if output is not None:
        try:
            atomic_write_text(output, text)
        except OSError as exc:  # name the file asked for, not the temporary it was written to
            if exc.errno is None:
                raise
            raise OSError(exc.errno, exc.strerror or os.strerror(exc.errno), os.fspath(output)) from exc
    else:
        stdout.write(text)
        stdout.flush()
    return 0


def main(argv: Optional[Sequence[str]] = None, stdin=None, stdout=None) -> int:
    """Entry point of ``python -m transformer_ext.translate``; returns the exit code.

    Invalid options exit through argparse (SystemExit 2, before anything is loaded); every other
    failure is a one-line error and exit code 1 (see the module docstring).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    stdin = sys.stdin if stdin is None else stdin
    stdout = sys.stdout if stdout is None else stdout
    _check_options(parser, args, stdin)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run_cli(parser.prog, lambda: _run(args, stdin, stdout), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
