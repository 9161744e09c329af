"""The ``translate`` command: text through any runner, a model folder on eager PyTorch, an export
folder on ONNX Runtime (no torch needed) or TensorRT. The library behind it is
:mod:`transformer_ext.translator` (:class:`Translator`, re-exported here).

Command line::

    python -m transformer_ext.translate "three hundred and forty-two"     # dreihundertzweiundvierzig
    python -m transformer_ext.translate --input numbers.txt --beam 4 --output out.txt
    printf 'one\\ntwo\\n' | python -m transformer_ext.translate
    python -m transformer_ext.translate "forty-two" --beam 5 --n-best 3    # index, score, text
    python -m transformer_ext.translate --model onnx_export "forty-two"    # ONNX Runtime

``--model DIR`` is a model folder (``config.json``, ``model.safetensors``, ``tokenizer.json``:
eager PyTorch) or an export folder (``manifest.json``, written by ``python -m export.onnx``:
ONNX Runtime, or TensorRT with ``--runtime tensorrt``); without it, the bundled demo model.

This module imports no torch: translating from an export folder with ONNX Runtime needs only
onnxruntime and numpy.

Failures of the command: invalid options (a non-finite or negative ``--max-len-a``, ``--beam 0``,
options of another runtime...) are usage errors (exit code 2, argparse's message); bad input
text or files, a bad model or export folder, a runtime or provider that is not installed, an
unwritable ``--output`` and a full disk print one line
``python -m transformer_ext.translate: error: ...`` (exit code 1, ``--debug`` shows the
traceback); Ctrl-C exits with 130, SIGTERM with 143.

Input is read lazily, a window of ``--window`` lines at a time (fewer when a pipe stalls: what
has arrived is translated, so a program that writes a line and waits for its answer gets it
while the pipe stays open), and translated in token batches
(``--max-batch-tokens``, the window sorted by length, :meth:`Translator.translate_iterable`);
each translation is printed as soon
as it and every line before it are done, and a progress line goes to stderr
every few seconds (also when it is not a terminal). With ``--output FILE`` the file is written
atomically at the end; an interrupted run writes none and says how many lines were done. An
empty line gives an empty translation and characters outside the vocabulary the unknown token
(one warning for the input); ``--strict`` makes both an error naming the line. A line longer
than the model's positions is an error unless ``--long-lines truncate``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

from .batching import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_WINDOW
from .cli import Terminated, add_debug_flag, run_cli
from .demo import DEMO_MODEL_DIR
from .devices import DeviceUsageError, check_device_name, parse_device
from .export_format import MANIFEST_NAME
from .fsutil import atomic_write_text, check_output_path
from .text import StreamLines, check_argument_text, iter_stream_lines
from .translator import (
    DEFAULT_MAX_LEN_A,
    DEFAULT_MAX_LEN_B,
    LENGTH_PENALTIES,
    RUNTIMES,
    Hypothesis,
    RuntimeNotAvailableError,
    Translation,
    TranslationError,
    Translator,
    is_export_dir,
)

# Exit code of a command whose output pipe was closed by the reader (128 + SIGPIPE), as a shell
# reports a Unix tool killed by SIGPIPE.
EXIT_SIGPIPE = 141

__all__ = [
    # the library, re-exported from transformer_ext.translator
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
    # the command
    "build_parser",
    "main",
]


# ---------------------------------------------------------------------- command line
logger = logging.getLogger("transformer_ext.translate")  # also when run as __main__


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
    for add in (_add_model_options, _add_search_options, _add_decoding_controls, _add_input_options):
        add(parser)
    add_debug_flag(parser)
    return parser


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    """The sources, the output, the model folder and the runtime that runs it."""
    parser.add_argument(
        "text",
        nargs="*",
        help="source texts, one per argument (quote multi-word sources); '-' reads lines from stdin. "
        "Without text and --input, lines are read from stdin when it is not a terminal.",
    )
    parser.add_argument("--input", "-i", metavar="FILE", help="read sources from FILE, one per line")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="an export folder: check the graphs (and engines) against the SHA-256 its manifest records "
        "too; the tokenizer files and the generation config are always checked",
    )
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
        "--workers",
        type=int,
        default=None,
        metavar="W",
        help="ONNX Runtime: decode each batch in W parts at once, each on a runner of its own with "
        "--threads threads (default 1 runner). On a CPU, beam search over batches of 16 or more "
        "sources is faster as --workers 2 --threads 1 than as --threads 2 (README, Benchmarks)",
    )


def _add_search_options(parser: argparse.ArgumentParser) -> None:
    """Beam search, length budget and batch size."""
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
        "(default), seed ((5+len+1)/5)^alpha, average len^alpha (fairseq's), none, hf "
        "(transformers' generate(): len^alpha, its --early-stopping rule)",
    )
    parser.add_argument(
        "--early-stopping",
        choices=("true", "false", "never"),
        default=None,
        help="with --length-penalty hf: transformers' early_stopping (default false)",
    )
    parser.add_argument(
        "--alpha", type=float, default=None, help="length-penalty exponent (default 0.6); finite, >= 0"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        metavar="N",
        help="at most N sources decoded together (default: as many as --max-batch-tokens holds)",
    )


def _add_decoding_controls(parser: argparse.ArgumentParser) -> None:
    """Sampling, the target prefix, penalties, length limits and scores."""
    search = parser.add_argument_group("decoding controls")
    search.add_argument(
        "--sampling-topk",
        type=int,
        default=None,
        metavar="K",
        help="random sampling from the K most likely tokens (0: the whole vocabulary; 1, the default: greedy)",
    )
    search.add_argument(
        "--sampling-topp",
        type=float,
        default=None,
        metavar="P",
        help="sample from the top-p mass, P in (0, 1]",
    )
    search.add_argument(
        "--sampling-temperature", type=float, default=None, metavar="T", help="sampling temperature, > 0"
    )
    search.add_argument(
        "--seed", type=int, default=None, help="seed of the sampling (same seed, same tokens)"
    )
    search.add_argument(
        "--target-prefix",
        default=None,
        metavar="TEXT",
        help="every translation starts with TEXT (its tokens are forced first)",
    )
    search.add_argument(
        "--repetition-penalty", type=float, default=None, metavar="P", help="penalise repeated tokens, P > 0"
    )
    search.add_argument(
        "--no-repeat-ngram-size",
        type=int,
        default=None,
        metavar="N",
        help="never repeat an n-gram of N tokens",
    )
    search.add_argument(
        "--min-length", type=int, default=None, metavar="N", help="generate at least N tokens (EOS included)"
    )
    search.add_argument(
        "--max-length", type=int, default=None, metavar="N", help="generate at most N tokens (EOS included)"
    )
    search.add_argument(
        "--scores",
        action="store_true",
        help="print 'score<TAB>text' (the sum of the token log-probabilities; with --n-best: the n-best score)",
    )


def _add_input_options(parser: argparse.ArgumentParser) -> None:
    """Input and batching, the eager runtime's compile and dtype, the languages."""
    inputs = parser.add_argument_group("input and batching")
    inputs.add_argument(
        "--max-batch-tokens",
        type=int,
        default=DEFAULT_MAX_BATCH_TOKENS,
        metavar="N",
        help=f"padded source tokens per batch (default {DEFAULT_MAX_BATCH_TOKENS}); --batch-size also caps "
        "the sources",
    )
    inputs.add_argument(
        "--window",
        type=int,
        default=DEFAULT_WINDOW,
        metavar="N",
        help=f"lines read and sorted by length together (default {DEFAULT_WINDOW}; a window's batches are "
        "decoded in input order, so output starts after one batch; a pipe that stalls has the lines that "
        "arrived translated at once)",
    )
    inputs.add_argument(
        "--strict",
        action="store_true",
        help="an empty line or a character outside the vocabulary is an error (default: an empty "
        "translation, the unknown token, one warning)",
    )
    inputs.add_argument(
        "--long-lines",
        choices=("error", "truncate"),
        default="error",
        help="a line longer than the model's positions: an error (default) or truncated with a warning",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="eager runtime: run the decoder step through torch.compile: faster per token, but "
        "every new batch shape compiles first (seconds); pays off on large inputs. On CPU it "
        "needs a C++ compiler",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="eager runtime: decode with the model's weights in this dtype; bfloat16 keeps weights and "
        "caches in bfloat16 (half the bytes per step, float32 accumulation), on a GPU or on a CPU "
        "with native bfloat16 (AVX-512 BF16 or AMX; refused elsewhere) (default: the folder's float32)",
    )
    parser.add_argument(
        "--source-lang",
        default=None,
        help="source language code of a multilingual M2M100 / NLLB model (e.g. en, eng_Latn)",
    )
    parser.add_argument(
        "--target-lang",
        default=None,
        help="target language code of a multilingual model (Marian's >>xx<< code, M2M100 / NLLB's forced "
        "first token); an unknown code is an error listing the model's codes; without --source-lang / "
        "--target-lang an M2M100 / NLLB model uses its tokenizer_config.json's defaults (named on stderr)",
    )


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
    if (
        args.n_best is not None
        and args.beam is not None
        and args.n_best > args.beam
        and args.sampling_topk in (None, 1)
    ):
        parser.error(f"--n-best must be between 1 and --beam ({args.beam}), got {args.n_best}")
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    for option, value, low in (
        ("--max-batch-tokens", args.max_batch_tokens, 1),
        ("--window", args.window, 1),
        ("--sampling-topk", args.sampling_topk, 0),
        ("--seed", args.seed, 0),
        ("--no-repeat-ngram-size", args.no_repeat_ngram_size, 0),
        ("--min-length", args.min_length, 0),
        ("--max-length", args.max_length, 1),
    ):
        if value is not None and value < low:
            parser.error(f"{option} must be >= {low}, got {value}")
    if args.sampling_topp is not None and not 0 < args.sampling_topp <= 1:
        parser.error(f"--sampling-topp must be in (0, 1], got {args.sampling_topp}")
    for option, value in (
        ("--sampling-temperature", args.sampling_temperature),
        ("--repetition-penalty", args.repetition_penalty),
    ):
        if value is not None and not (math.isfinite(value) and value > 0):
            parser.error(f"{option} must be a finite number > 0, got {value}")
    sampling = args.sampling_topk not in (None, 1)
    if not sampling:
        for option, value in (
            ("--sampling-topp", args.sampling_topp),
            ("--sampling-temperature", args.sampling_temperature),
            ("--seed", args.seed),
        ):
            if value is not None:
                parser.error(f"{option} applies to random sampling: give --sampling-topk 0 (or K > 1)")
    if sampling and args.beam is not None and args.beam > 1:
        parser.error(f"random sampling (--sampling-topk) needs --beam 1, got --beam {args.beam}")
    if args.early_stopping is not None and args.length_penalty != "hf":
        parser.error("--early-stopping applies with --length-penalty hf (transformers' beam search)")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.workers is not None and args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.device is not None:
        try:
            check_device_name(args.device)
        except DeviceUsageError as exc:
            parser.error(str(exc))
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
        if getattr(args, "dtype", None) is not None:
            problems.append("--dtype applies to the eager runtime only")
    if runtime != "onnxruntime" and args.provider is not None:
        problems.append("--provider applies to the onnxruntime runtime only")
    if runtime == "tensorrt" and args.threads is not None:
        problems.append("--threads applies to the onnxruntime and eager runtimes only")
    if runtime != "onnxruntime" and getattr(args, "workers", None) is not None:
        problems.append("--workers applies to the onnxruntime runtime only")
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
    inputs = [("the model folder --model", Path(args.model) if args.model is not None else DEMO_MODEL_DIR)]
    if args.input is not None:
        inputs.append(("the --input file", Path(args.input)))
    check_output_path(out, inputs=inputs, managed_dirs=managed_dirs(out), what="--output")
    return out


def managed_dirs(path: Path) -> list:
    """The training runs' managed folders around ``path`` (``best/``, ``last/``, ``checkpoints/``);
    none without torch (the run folder module needs it, and a deployment trains nothing)."""
    try:
        from .training.run_folder import managed_dirs as run_managed_dirs
    except ImportError:
        return []
    return run_managed_dirs(path)


STALL_SECONDS = 0.05  # input that brings no new line for this long has stalled: translate what arrived


class _Sources:
    """The sources in input order with where each came from (for error messages), read lazily:
    a line is read when the translator asks for it, by the package's one text rule
    (:func:`transformer_ext.text.iter_stream_lines`: strict UTF-8, a leading BOM removed, ``\\n``
    or ``\\r\\n`` line endings, a lone ``\\r`` an error). Empty lines are kept (an empty
    translation, or an error naming the line with ``--strict``). :meth:`ready` says whether the
    next line has arrived (a pipe that stalls for :data:`STALL_SECONDS` has not)."""

    def __init__(self, args, stdin):
        self.args, self.stdin = args, stdin
        self.stream: Optional[StreamLines] = None  # the stream being read

    def ready(self) -> bool:
        return self.stream is None or self.stream.ready(STALL_SECONDS)

    def _lines(self, stream, name: str) -> Iterator[tuple[str, str]]:
        self.stream = iter_stream_lines(stream, name)
        for n, line in enumerate(self.stream, start=1):
            yield line, f"{name}, line {n}"
        self.stream = None

    def _file(self, path: str) -> Iterator[tuple[str, str]]:
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise TranslationError(f"input file not found: {path}") from None
        except IsADirectoryError:
            raise TranslationError(f"--input {path} is a directory, expected a text file") from None
        with f:
            yield from self._lines(f, path)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        args = self.args
        for n, text in enumerate(args.text, start=1):
            if text == "-":
                yield from self._lines(self.stdin, "stdin")
            else:
                yield check_argument_text(text, f"argument {n}"), f"argument {n}"
        if args.input is not None:
            yield from self._file(args.input)
        if not args.text and args.input is None:
            yield from self._lines(self.stdin, "stdin")


def _load_translator(args) -> Translator:
    """The translator ``--model`` / ``--runtime`` ask for (a model folder: eager; an export folder: ONNX Runtime)."""
    export = args.model is not None and is_export_dir(args.model)
    languages = dict(source_lang=args.source_lang, target_lang=args.target_lang)
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
        try:
            device = parse_device(args.device or "cpu")
        except ImportError:  # no torch: from_model_dir says what to install
            device = args.device or "cpu"
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        if args.dtype is not None:  # refused here, before the folder is read, naming the option
            import torch

            from .runtimes.eager import check_dtype

            check_dtype(args.dtype, torch.device(device), what="--dtype")
        if args.model is None:
            logger.warning(
                "no --model given: translating with the bundled demo model %s (English number words "
                "to German); give --model DIR to translate with another model",
                DEMO_MODEL_DIR,
            )
        return Translator.from_model_dir(
            args.model, device=device, compile=args.compile, dtype=args.dtype, **languages
        )
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
        args.model,
        runtime=runtime,
        provider=args.provider,
        threads=args.threads,
        verify=args.verify,
        workers=args.workers or 1,
        **languages,
    )


PROGRESS_SECONDS = 5.0  # a progress line on stderr at most this often


class _Progress:
    """A line on stderr every :data:`PROGRESS_SECONDS` (lines done, lines per second), also
    when stderr is not a terminal."""

    def __init__(self, stream):
        self.stream = stream
        self.start = self.last = time.monotonic()
        self.done = 0

    def update(self) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self.last >= PROGRESS_SECONDS:
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            self.stream.write(f"translated {self.done} lines ({rate:.1f} lines/s)\n")
            self.stream.flush()


def _format(index: int, translation, args) -> list[str]:
    if args.n_best is None:
        if args.scores:
            score = translation.score
            return [f"{'-' if score is None else f'{score:.4f}'}\t{translation.text}"]
        return [translation.text]
    lines = []
    for text, hyp in zip(translation.texts, translation.hypotheses):
        score = "-" if hyp.score is None else f"{hyp.score:.4f}"
        lines.append(f"{index}\t{score}\t{text}")
    return lines


def _run(args, stdin, stdout, stderr=None) -> int:
    stderr = sys.stderr if stderr is None else stderr
    output = _check_output(args)
    translator = _load_translator(args)
    early = {"true": True, "false": False, "never": "never"}.get(args.early_stopping)
    options = dict(
        beam_size=args.beam,
        n_best=args.n_best,
        max_len_a=args.max_len_a,
        max_len_b=args.max_len_b,
        length_penalty=args.length_penalty,
        alpha=args.alpha,
        early_stopping=early,
        batch_size=args.batch_size,
        sampling_topk=args.sampling_topk,
        sampling_topp=args.sampling_topp,
        sampling_temperature=args.sampling_temperature,
        seed=args.seed,
        repetition_penalty=args.repetition_penalty,
        no_repeat_ngram_size=args.no_repeat_ngram_size,
        min_length=args.min_length,
        max_length=args.max_length,
        return_scores=True if args.scores else None,
        strict=args.strict,
        long_lines=args.long_lines,
    )
    translator.resolve_options(**options)  # every option checked before any line is read
    count = {"read": 0}

    inputs = _Sources(args, stdin)

    def sources():
        for text, origin in inputs:
            count["read"] += 1
            try:  # an input error names its line (the batches do not know lines)
                translator.encode([text], strict=args.strict, long_lines=args.long_lines)
            except TranslationError as exc:
                raise TranslationError(f"{origin}: {exc.detail}") from None
            yield text

    progress = _Progress(stderr)
    collected: list[str] = []
    done = 0
    try:
        stream = translator.translate_iterable(
            sources(),
            max_batch_tokens=args.max_batch_tokens,
            window=args.window,
            target_prefix=args.target_prefix,
            ready=inputs.ready,
            **options,
        )
        for index, translation in enumerate(stream):
            lines = _format(index, translation, args)
            if output is not None:
                collected.extend(lines)
            else:
                try:
                    stdout.write("".join(line + "\n" for line in lines))
                    stdout.flush()
                except BrokenPipeError:  # the reader went away (`translate ... | head -1`): stop quietly
                    _silence(stdout)
                    return EXIT_SIGPIPE
            done += 1
            progress.update()
    except KeyboardInterrupt as exc:
        if not isinstance(exc, Terminated):  # Ctrl-C: say how far it got (SIGTERM: run_cli's one line)
            where = f"; nothing written to {output}" if output is not None else ""
            stderr.write(f"interrupted after {done} translated lines{where}\n")
            stderr.flush()
        raise
    if count["read"] == 0:
        raise TranslationError("nothing to translate: the input is empty")
    if output is not None:
        try:
            atomic_write_text(output, "".join(line + "\n" for line in collected))
        except OSError as exc:  # name the file asked for, not the temporary it was written to
            if exc.errno is None:
                raise
            raise OSError(exc.errno, exc.strerror or os.strerror(exc.errno), os.fspath(output)) from exc
    return 0


def _silence(stream) -> None:
    """Point ``stream``'s file descriptor at /dev/null, so that the interpreter's final flush of
    what is still buffered for a closed pipe raises nothing (a second "Broken pipe")."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a StringIO in a test)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


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
