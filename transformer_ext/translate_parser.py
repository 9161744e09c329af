"""The ``translate`` command's options and their checks.

The decoding flags are generated from :class:`transformer_ext.decoding.SearchOptions`
(:mod:`transformer_ext.search_flags`, which ``evaluate`` and ``export.quantize`` use too): each is
a field's name with dashes (CTranslate2's ``translate_batch`` names), with the field's help text
and range, checked by the field's own check before anything is loaded. Older spellings are
accepted with a one-line deprecation warning (:func:`transformer_ext.cli.add_option`): ``--beam``,
``--n-best``, ``--alpha``, ``--max-length``, ``--min-length``, ``--scores``, ``--batch-size``,
and ``--length-penalty NAME`` for ``--length-penalty-type NAME`` (``--length-penalty`` takes the
exponent, as CTranslate2's ``length_penalty``). An old and a new spelling of one option in one
command line are a usage error naming both.

This module imports no torch.
"""

from __future__ import annotations

import argparse

from .batching import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_WINDOW
from .cli import add_debug_flag, add_option
from .devices import DeviceUsageError, check_device_name
from .runtimes.factory import RUNTIMES
from .search_flags import add_decoding_flags, check_decoding_flags, decoding_values, given_flag

__all__ = ["DECODING_FLAGS", "build_parser", "check_args", "runtime_conflicts", "search_options"]

# The SearchOptions fields translate takes, in --help order: (field, old spellings, metavar).
DECODING_FLAGS = (
    ("beam_size", ("--beam",), "N"),
    ("num_hypotheses", ("--n-best",), "K"),
    ("length_penalty", ("--alpha",), "A"),
    ("length_penalty_type", (), None),
    ("early_stopping", (), None),
    ("max_decoding_length", ("--max-length",), "N"),
    ("min_decoding_length", ("--min-length",), "N"),
    ("max_len_a", (), "A"),
    ("max_len_b", (), "B"),
    ("repetition_penalty", (), "P"),
    ("no_repeat_ngram_size", (), "N"),
    ("sampling_topk", (), "K"),
    ("sampling_topp", (), "P"),
    ("sampling_temperature", (), "T"),
    ("seed", (), "N"),
    ("return_scores", ("--scores",), None),
)


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
    _add_model_options(parser)
    add_decoding_flags(
        parser.add_argument_group("search (the names of CTranslate2's translate_batch)"), DECODING_FLAGS
    )
    _add_input_options(parser.add_argument_group("input and batching"))
    _add_language_options(parser)
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
    parser.add_argument(
        "--device", default=None, help="torch device of the eager runtime: cpu (default), cuda or cuda:N"
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


def _add_input_options(inputs) -> None:
    """Batching, the target prefix, strict input and long lines."""
    add_option(
        inputs,
        "--max-batch-size",
        deprecated=("--batch-size",),
        type=int,
        default=None,
        metavar="N",
        help="at most N sources decoded together (default: as many as --max-batch-tokens holds; "
        "with --batch-type examples, 64)",
    )
    inputs.add_argument(
        "--batch-type",
        choices=("tokens", "examples"),
        default="tokens",
        help="tokens: batches of at most --max-batch-tokens padded source tokens (default); examples: "
        "batches of --max-batch-size sources",
    )
    inputs.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        metavar="N",
        help=f"padded source tokens per batch (default {DEFAULT_MAX_BATCH_TOKENS}); --max-batch-size also "
        "caps the sources",
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
        "--target-prefix",
        default=None,
        metavar="TEXT",
        help="every translation starts with TEXT (its tokens are forced first)",
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


def _add_language_options(parser: argparse.ArgumentParser) -> None:
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


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace, stdin) -> None:
    """Every option checked before anything is read or loaded; a usage error (exit 2) names it."""
    check_decoding_flags(parser, args, DECODING_FLAGS)
    for option, value in (
        (given_flag(args, "max_batch_size"), args.max_batch_size),
        ("--max-batch-tokens", args.max_batch_tokens),
        ("--window", args.window),
        ("--threads", args.threads),
        ("--workers", args.workers),
    ):
        if value is not None and value < 1:
            parser.error(f"{option} must be >= 1, got {value}")
    if args.batch_type == "examples" and args.max_batch_tokens is not None:
        parser.error("--max-batch-tokens applies to --batch-type tokens (examples: --max-batch-size)")
    if args.device is not None:
        try:
            check_device_name(args.device)
        except DeviceUsageError as exc:
            parser.error(str(exc))
    if args.provider is not None and not args.provider.strip():
        parser.error("--provider must name an ONNX Runtime execution provider, e.g. cpu or cuda")
    if args.runtime is not None:
        for problem in runtime_conflicts(args, args.runtime):
            parser.error(f"{problem}, not to --runtime {args.runtime}")
    if not args.text and args.input is None and (stdin is None or stdin.isatty()):
        parser.error("nothing to translate: give a text, --input FILE, or pipe lines on stdin")


def runtime_conflicts(args: argparse.Namespace, runtime: str) -> list[str]:
    """Options given that ``runtime`` does not take, each as a phrase naming the option."""
    problems = []
    if runtime != "eager":
        if args.device is not None:
            problems.append("--device applies to the eager runtime only (ONNX Runtime: --provider)")
        if args.compile:
            problems.append("--compile applies to the eager runtime only")
        if args.dtype is not None:
            problems.append("--dtype applies to the eager runtime only")
    if runtime != "onnxruntime" and args.provider is not None:
        problems.append("--provider applies to the onnxruntime runtime only")
    if runtime == "tensorrt" and args.threads is not None:
        problems.append("--threads applies to the onnxruntime and eager runtimes only")
    if runtime != "onnxruntime" and args.workers is not None:
        problems.append("--workers applies to the onnxruntime runtime only")
    return problems


def search_options(args: argparse.Namespace) -> dict:
    """The Translator options of a parsed command line: the decoding flags under their
    SearchOptions names (None: not given), the batch size, ``strict`` and ``long_lines``."""
    options = decoding_values(args, DECODING_FLAGS)
    batch_size = args.max_batch_size
    if batch_size is None and args.batch_type == "examples":
        batch_size = 64
    return dict(options, batch_size=batch_size, strict=args.strict, long_lines=args.long_lines)
