"""The ``translate`` command: text through any runner, a model folder on eager PyTorch, an export
folder on ONNX Runtime (no torch needed) or TensorRT. The library behind it is
:mod:`transformer_ext.translator` (:class:`Translator`, re-exported here); the options are
:mod:`transformer_ext.translate_parser`'s (the decoding flags generated from
:class:`~transformer_ext.decoding.SearchOptions`, CTranslate2's names), the input and output
:mod:`transformer_ext.translate_io`'s.

Command line::

    python -m transformer_ext.translate "three hundred and forty-two"     # dreihundertzweiundvierzig
    python -m transformer_ext.translate --input numbers.txt --beam-size 4 --output out.txt
    printf 'one\\ntwo\\n' | python -m transformer_ext.translate
    python -m transformer_ext.translate "forty-two" --beam-size 5 --num-hypotheses 3   # index, score, text
    python -m transformer_ext.translate --model onnx_export "forty-two"    # ONNX Runtime

``--model DIR`` is a model folder (``config.json``, ``model.safetensors``, ``tokenizer.json``:
eager PyTorch) or an export folder (``manifest.json``, written by ``python -m export.onnx``:
ONNX Runtime, or TensorRT with ``--runtime tensorrt``); without it, the bundled demo model.

This module imports no torch: translating from an export folder with ONNX Runtime needs only
onnxruntime and numpy.

Failures of the command: invalid options (a non-finite or negative ``--max-len-a``,
``--beam-size 0``, options of another runtime...) are usage errors (exit code 2, argparse's
message); bad input text or files, a bad model or export folder, a runtime or provider that is
not installed, an unwritable ``--output`` and a full disk print one line
``python -m transformer_ext.translate: error: ...`` (exit code 1, ``--debug`` shows the
traceback); Ctrl-C exits with 130, SIGTERM with 143.

Input is read lazily, a window of ``--window`` lines at a time (fewer when a pipe stalls: what
has arrived is translated, so a program that writes a line and waits for its answer gets it
while the pipe stays open), and translated in token batches (``--max-batch-tokens``, the window
sorted by length, :meth:`Translator.translate_iterable`); each translation is printed as soon
as it and every line before it are done, and a progress line goes to stderr every few seconds
(also when it is not a terminal). With ``--output FILE`` the file is written atomically at the
end; an interrupted run writes none and says how many lines were done. An empty line gives an
empty translation and characters outside the vocabulary the unknown token (one warning for the
input); ``--strict`` makes both an error naming the line. A line longer than the model's
positions is an error unless ``--long-lines truncate``. Random sampling draws each line from
the stream of the seed and the line's index in the whole input, so ``--max-batch-size``,
``--max-batch-tokens`` and ``--window`` do not change what is sampled.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional, Sequence

from .batching import DEFAULT_MAX_BATCH_TOKENS
from .cli import Terminated, run_cli
from .demo import DEMO_MODEL_DIR
from .devices import parse_device
from .export_format import MANIFEST_NAME
from .translate_io import Progress, Sources, check_output, format_lines, managed_dirs, silence, write_output
from .translate_parser import build_parser, check_args, runtime_conflicts, search_options
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
PROGRESS_SECONDS = 5.0  # a progress line on stderr at most this often

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
    "managed_dirs",
]

logger = logging.getLogger("transformer_ext.translate")  # also when run as __main__


def _load_translator(args) -> Translator:
    """The translator ``--model`` / ``--runtime`` ask for (a model folder: eager; an export folder: ONNX Runtime)."""
    export = args.model is not None and is_export_dir(args.model)
    languages = dict(source_lang=args.source_lang, target_lang=args.target_lang)
    runtime = args.runtime or ("onnxruntime" if export else "eager")
    # only reachable with the runtime chosen by the folder (an explicit one is checked at parsing)
    problems = runtime_conflicts(args, runtime)
    if problems:
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
            "`python -m export.onnx --model MODEL_DIR --output-dir EXPORT_DIR`; a model "
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


def _run(args, stdin, stdout, stderr=None) -> int:
    stderr = sys.stderr if stderr is None else stderr
    output = check_output(args)
    translator = _load_translator(args)
    options = search_options(args)
    translator.resolve_options(**options)  # every option checked before any line is read
    inputs = _Sources(args, stdin, translator)
    progress = Progress(stderr, PROGRESS_SECONDS)
    collected: list[str] = []
    tokens = args.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS
    try:
        stream = translator.translate_iterable(
            inputs.checked(),
            max_batch_tokens=sys.maxsize if args.batch_type == "examples" else tokens,
            window=args.window,
            target_prefix=args.target_prefix,
            ready=inputs.ready,
            **options,
        )
        for index, translation in enumerate(stream):
            lines = format_lines(index, translation, args)
            if output is not None:
                collected.extend(lines)
            else:
                try:
                    stdout.write("".join(line + "\n" for line in lines))
                    stdout.flush()
                except BrokenPipeError:  # the reader went away (`translate ... | head -1`): stop quietly
                    silence(stdout)
                    return EXIT_SIGPIPE
            progress.update()
    except KeyboardInterrupt as exc:
        if not isinstance(exc, Terminated):  # Ctrl-C: say how far it got (SIGTERM: run_cli's one line)
            where = f"; nothing written to {output}" if output is not None else ""
            stderr.write(f"interrupted after {progress.done} translated lines{where}\n")
            stderr.flush()
        raise
    if inputs.read == 0:
        raise TranslationError("nothing to translate: the input is empty")
    if output is not None:
        write_output(output, collected)
    return 0


class _Sources(Sources):
    """The command's sources, each checked as it is read, so that an input error names its line
    (the batches do not know lines); ``read`` counts them."""

    def __init__(self, args, stdin, translator: Translator):
        super().__init__(args, stdin)
        self.translator, self.read = translator, 0

    def checked(self):
        args = self.args
        for text, origin in self:
            self.read += 1
            try:
                self.translator.encode([text], strict=args.strict, long_lines=args.long_lines)
            except TranslationError as exc:
                raise TranslationError(f"{origin}: {exc.detail}") from None
            yield text


def main(argv: Optional[Sequence[str]] = None, stdin=None, stdout=None) -> int:
    """Entry point of ``python -m transformer_ext.translate``; returns the exit code.

    Invalid options exit through argparse (SystemExit 2, before anything is loaded); every other
    failure is a one-line error and exit code 1 (see the module docstring).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    stdin = sys.stdin if stdin is None else stdin
    stdout = sys.stdout if stdout is None else stdout
    check_args(parser, args, stdin)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run_cli(parser.prog, lambda: _run(args, stdin, stdout), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
