"""Translate with a trained model directory (the bundled demo model by default).

Command line::

    python -m transformer_ext.translate "three hundred and forty-two"     # dreihundertzweiundvierzig
    python -m transformer_ext.translate --input numbers.txt --beam 4
    printf 'one\\ntwo\\n' | python -m transformer_ext.translate
    python -m transformer_ext.translate "forty-two" --beam 5 --n-best 3    # index, score, text

Python::

    from transformer_ext.translate import Translator
    translator = Translator()                      # the bundled demo model, on the CPU
    [t.text for t in translator.translate(["forty-two", "one thousand and one"])]

Decoding is the project's single greedy / beam-search loop (:mod:`transformer_ext.decoding`)
driving the eager runner; the maximum number of generated tokens of a source of ``n``
tokens is ``a * n + b`` (``--max-len-a``, ``--max-len-b``), capped by the model's ``max_len``
(with a warning when an ``a`` or ``b`` given explicitly asks for more).

Failures of the command: invalid options (a non-finite or negative ``--max-len-a``, ``--beam 0``...)
are usage errors (exit code 2, argparse's message); bad input text or files, a bad model folder
and a full disk print one line ``python -m transformer_ext.translate: error: ...`` (exit code 1,
``--debug`` shows the traceback); Ctrl-C exits with 130, SIGTERM with 143. Translations are
printed only once every source is translated, so an interrupted run prints none.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

from .cli import UserError, add_debug_flag, run_cli
from .decoding import LENGTH_PENALTIES
from .tokenizer import TOKENIZER_FILE, CharTokenizer, TokenizerError, UnknownCharacterError, check_model_config

logger = logging.getLogger(__name__)

__all__ = [
    "DEMO_MODEL_DIR",
    "DEFAULT_MAX_LEN_A",
    "DEFAULT_MAX_LEN_B",
    "TranslationError",
    "Hypothesis",
    "Translation",
    "Translator",
    "main",
]

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "demo_model"
DEFAULT_MAX_LEN_A = 1.5  # German number words are at most 6 characters longer than English ones
DEFAULT_MAX_LEN_B = 10
PROGRESS_MIN_BATCHES = 4  # a progress bar only for inputs of at least this many batches


class TranslationError(ValueError, UserError):
    """A source cannot be translated (empty, unknown characters, too long) or a bad option.

    ``index`` is the position of the offending source in the input (``None`` for an option) and
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
class Hypothesis:
    """One candidate translation: its text, beam score (length-penalised) and total log-probability."""

    text: str
    score: Optional[float]
    log_prob: Optional[float]
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Translation:
    """The translation of one source: ``text`` is the best hypothesis, ``hypotheses`` the n-best."""

    source: str
    hypotheses: list[Hypothesis] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.hypotheses[0].text

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


class Translator:
    """A model directory (``config.json`` + ``model.safetensors`` + ``tokenizer.json``) ready to translate.

    Args:
        model_dir: the model directory; ``None`` is the bundled demo model
            (English number words to German number words).
        device: ``"cpu"`` or ``"cuda"`` (or a ``torch.device``).
        compile: run the decoder step through ``torch.compile`` (see
            :class:`transformer_ext.runtimes.EagerRunner`): faster per token once compiled, at the
            cost of a compile (seconds) for every new batch shape; worth it for long jobs.

    A model directory without ``tokenizer.json`` loads (``tokenizer`` is then ``None``; the
    runner still decodes token ids, e.g. for benchmarks), but translating text from it is a
    :class:`TranslationError` that says a tokenizer is needed.

    Raises:
        FileNotFoundError: the directory, its config or weights file is missing.
        TokenizerError: ``tokenizer.json`` is corrupt or not a tokenizer description (names the file).
        TranslationError: the tokenizer does not belong to the model (vocabulary sizes or special
            ids differ; names both files and the id).
    """

    def __init__(self, model_dir: str | os.PathLike | None = None, device="cpu", compile: bool = False):
        from .checkpoint import load_model

        model_dir = Path(model_dir) if model_dir is not None else DEMO_MODEL_DIR
        if not model_dir.is_dir():
            raise FileNotFoundError(
                f"model directory not found: {model_dir} (expected a folder with config.json, "
                "model.safetensors and tokenizer.json, as written by `python -m transformer_ext.train`)"
            )
        tokenizer_path = model_dir / TOKENIZER_FILE
        if tokenizer_path.exists():
            tokenizer = CharTokenizer.load(model_dir)  # a corrupt file is an error, not "no tokenizer"
        else:
            tokenizer = None
            logger.warning("%s has no %s: it can decode token ids, but not translate text", model_dir, TOKENIZER_FILE)
        model = load_model(model_dir, device)
        self.model_dir = model_dir
        self._setup(model, tokenizer, device, compile,
                    files=(os.fspath(tokenizer_path), os.fspath(model_dir / "config.json")))

    @classmethod
    def from_model(cls, model, tokenizer: Optional[CharTokenizer], device="cpu") -> "Translator":
        """A translator over an in-memory model (training uses this for validation)."""
        self = cls.__new__(cls)
        self.model_dir = None
        self._setup(model, tokenizer, device)
        return self

    def _setup(self, model, tokenizer: Optional[CharTokenizer], device, compile: bool = False,
               files: tuple[Optional[str], Optional[str]] = (None, None)) -> None:
        from .runtimes.eager import EagerRunner

        config = model.config
        if tokenizer is not None:
            try:
                check_model_config(tokenizer, config, tokenizer_file=files[0], config_file=files[1])
            except TokenizerError as exc:
                raise TranslationError(str(exc)) from None
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.device = device
        self.runner = EagerRunner(model, device, compile=compile)

    # ------------------------------------------------------------------ helpers
    def _require_tokenizer(self) -> CharTokenizer:
        if self.tokenizer is None:
            where = f"{self.model_dir} has no {TOKENIZER_FILE}" if self.model_dir is not None else "no tokenizer was given"
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
            if len(ids) > self.config.max_len:
                raise _source_error(
                    i, f"{len(ids)} tokens, more than the model's max_len ({self.config.max_len}); split the source")
            encoded.append(ids)
        return encoded

    def max_new_tokens(self, src_lengths: np.ndarray, max_len_a: float, max_len_b: float) -> np.ndarray:
        """Per-row budget ``floor(a * src_len + b)`` (EOS included), at least 1, at most ``max_len``."""
        from .decoding import max_new_tokens_for

        a = _check_number("max_len_a", max_len_a)
        b = _check_number("max_len_b", max_len_b)
        return max_new_tokens_for(src_lengths, a, b, cap=self.config.max_len)

    def _warn_if_capped(self, lengths: Sequence[int], a: float, b: float) -> None:
        """One warning when ``a * n + b`` asks for more tokens than the model's ``max_len`` allows."""
        cap = self.config.max_len
        wanted = [a * n + b for n in lengths]
        over = sum(1 for w in wanted if math.floor(w) > cap)
        if over:
            logger.warning(
                "max_len_a * source_length + max_len_b = %.6g tokens (longest source) exceeds the model's "
                "max_len = %d: generation is capped at %d tokens for %d of %d sources",
                max(wanted), cap, cap, over, len(wanted),
            )

    # ------------------------------------------------------------------ translate
    def translate(
        self,
        sources: Iterable[str],
        beam_size: int = 1,
        n_best: int = 1,
        *,
        max_len_a: Optional[float] = None,
        max_len_b: Optional[float] = None,
        length_penalty: str = "gnmt",
        alpha: float = 0.6,
        batch_size: int = 64,
        progress: bool = False,
    ) -> list[Translation]:
        """Translate each source; returns one :class:`Translation` per source, in input order.

        ``sources``: a list or any iterable of strings (a generator is read once, up front).
        ``beam_size=1`` is greedy decoding (hypothesis scores are then ``None``); with
        ``beam_size > 1`` each translation holds the ``n_best`` best hypotheses with their
        length-penalised scores (``length_penalty`` "gnmt": ((5+len)/6)^alpha, "seed":
        ((5+len+1)/5)^alpha, "average": len^alpha as in fairseq, "none"; len counts the
        generated tokens with the EOS, see :func:`transformer_ext.decoding.length_penalty_factor`).
        ``max_len_a`` / ``max_len_b``: at most ``a * n + b`` generated tokens for a source of n
        tokens (defaults :data:`DEFAULT_MAX_LEN_A` and :data:`DEFAULT_MAX_LEN_B`); finite and
        >= 0; capped by the model's ``max_len``, with a warning when a value given here asks for
        more. ``progress``: a progress bar (tqdm, on stderr) for inputs of at least
        :data:`PROGRESS_MIN_BATCHES` batches. Sources are normalised (whitespace collapsed,
        lower-cased for the demo tokenizer) before encoding.
        """
        from .decoding import beam_search, greedy_decode

        beam_size = _check_positive_int("beam size", beam_size)
        n_best = _check_positive_int("n_best", n_best)
        if n_best > beam_size:
            raise TranslationError(f"n_best ({n_best}) cannot exceed the beam size ({beam_size})")
        if length_penalty not in LENGTH_PENALTIES:
            raise TranslationError(f"length_penalty must be one of {LENGTH_PENALTIES}, got {length_penalty!r}")
        alpha = _check_number("alpha", alpha)
        explicit_budget = max_len_a is not None or max_len_b is not None
        a = _check_number("max_len_a", max_len_a, default=DEFAULT_MAX_LEN_A)
        b = _check_number("max_len_b", max_len_b, default=DEFAULT_MAX_LEN_B)
        batch_size = _check_positive_int("batch_size", batch_size)
        if isinstance(sources, (str, bytes)):
            raise TypeError("translate() takes a list (or any iterable) of source strings, not one string")
        sources = list(sources)  # a generator is consumed once; results refer back to it by index

        encoded = self.encode(sources)
        tok = self.tokenizer
        if explicit_budget and encoded:
            self._warn_if_capped([len(x) for x in encoded], a, b)
        results: list[Optional[Translation]] = [None] * len(encoded)
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))  # similar lengths together
        batches = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
        bar = _progress_bar(len(encoded)) if progress and len(batches) >= PROGRESS_MIN_BATCHES else None
        was_training = getattr(self.model, "training", False)
        if was_training:
            self.model.eval()
        try:
            for rows in batches:
                lengths = np.array([len(encoded[i]) for i in rows], dtype=np.int64)
                input_ids = np.full((len(rows), int(lengths.max())), tok.pad_id, dtype=np.int64)
                for r, i in enumerate(rows):
                    input_ids[r, : lengths[r]] = encoded[i]
                budget = self.max_new_tokens(lengths, a, b)
                if beam_size == 1:
                    out = greedy_decode(
                        self.runner, input_ids, lengths, bos_id=tok.bos_id, eos_id=tok.eos_id,
                        max_new_tokens=budget,
                    )
                    for r, i in enumerate(rows):
                        ids = tuple(int(t) for t in out[r])
                        results[i] = Translation(sources[i], [Hypothesis(tok.decode_target(ids), None, None, ids)])
                else:
                    out = beam_search(
                        self.runner, input_ids, lengths, bos_id=tok.bos_id, eos_id=tok.eos_id,
                        beam_size=beam_size, n_best=n_best, max_new_tokens=budget,
                        length_penalty=length_penalty, alpha=alpha,
                    )
                    for r, i in enumerate(rows):
                        hyps = []
                        for h in out[r][:n_best]:
                            ids = tuple(int(t) for t in h.tokens)
                            hyps.append(Hypothesis(tok.decode_target(ids), float(h.score), float(h.log_prob), ids))
                        results[i] = Translation(sources[i], hyps)
                if bar is not None:
                    bar.update(len(rows))
        finally:
            if bar is not None:
                bar.close()
            if was_training:
                self.model.train()
        return results  # type: ignore[return-value]


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
            "Translate with a trained transformer_ext model. By default the bundled demo model "
            "translates English number words (0 to 9999) into German number words. Prints one "
            "translation per source line, in input order."
        ),
        epilog="Exit codes: 0 success, 1 bad input or model files, 2 invalid options, 130 interrupted, "
               "143 terminated.",
    )
    parser.add_argument(
        "text", nargs="*",
        help="source texts, one per argument (quote multi-word sources); '-' reads lines from stdin. "
             "Without text and --input, lines are read from stdin when it is not a terminal.",
    )
    parser.add_argument("--input", "-i", metavar="FILE", help="read sources from FILE, one per line")
    parser.add_argument("--model", metavar="DIR", default=None,
                        help="model directory (config.json, model.safetensors, tokenizer.json); "
                             "default: the bundled demo model")
    parser.add_argument("--device", default="cpu", help="torch device: cpu (default), cuda or cuda:N")
    parser.add_argument("--beam", type=int, default=1, metavar="N",
                        help="beam size; 1 (default) is greedy decoding")
    parser.add_argument("--n-best", type=int, default=None, metavar="K",
                        help="print the K best hypotheses of each source as 'index<TAB>score<TAB>text' "
                             "(needs --beam >= K; with --beam 1 the greedy output gets no score)")
    parser.add_argument("--max-len-a", type=float, default=None, metavar="A",
                        help=f"generate at most A * source_length + B tokens (default A={DEFAULT_MAX_LEN_A}); "
                             "finite, >= 0")
    parser.add_argument("--max-len-b", type=float, default=None, metavar="B",
                        help=f"see --max-len-a (default B={DEFAULT_MAX_LEN_B}); finite, >= 0. The budget is "
                             "always capped by the model's max_len (with a warning when A or B ask for more)")
    parser.add_argument("--length-penalty", choices=LENGTH_PENALTIES, default="gnmt",
                        help="beam length penalty, len = generated tokens with the EOS: gnmt ((5+len)/6)^alpha "
                             "(default), seed ((5+len+1)/5)^alpha, average len^alpha (fairseq's), none")
    parser.add_argument("--alpha", type=float, default=0.6, help="length-penalty exponent (default 0.6); finite, >= 0")
    parser.add_argument("--batch-size", type=int, default=64, help="sources decoded together (default 64)")
    parser.add_argument("--compile", action="store_true",
                        help="run the decoder step through torch.compile: faster per token, but every new "
                             "batch shape compiles first (seconds); pays off on large inputs. On CPU it "
                             "needs a C++ compiler")
    add_debug_flag(parser)
    return parser


def _finite_non_negative(value: float) -> bool:
    return math.isfinite(value) and value >= 0


def _check_options(parser: argparse.ArgumentParser, args, stdin) -> None:
    """Every option checked before anything is read or loaded; a usage error (exit 2) names it."""
    for option, value in (("--max-len-a", args.max_len_a), ("--max-len-b", args.max_len_b), ("--alpha", args.alpha)):
        if value is not None and not _finite_non_negative(value):
            parser.error(f"{option} must be a finite number >= 0, got {value}")
    if args.beam < 1:
        parser.error(f"--beam must be >= 1, got {args.beam}")
    if args.n_best is not None and not 1 <= args.n_best <= args.beam:
        parser.error(f"--n-best must be between 1 and --beam ({args.beam}), got {args.n_best}")
    if args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    device = args.device.strip().lower()
    if not (device == "cpu" or device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        parser.error(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if not args.text and args.input is None and (stdin is None or stdin.isatty()):
        parser.error("nothing to translate: give a text, --input FILE, or pipe lines on stdin")


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
                f"input file {args.input} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not args.text and args.input is None:
        entries.extend(_read_lines(stdin, "stdin"))
    if not entries:
        raise TranslationError("nothing to translate: the input is empty")
    return [text for text, _ in entries], [origin for _, origin in entries]


def _run(args, stdin, stdout) -> int:
    sources, origins = _gather_sources(args, stdin)
    if args.device.strip().lower().startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise TranslationError(f"--device {args.device}: torch sees no CUDA GPU on this machine; use --device cpu")
    translator = Translator(args.model, device=args.device, compile=args.compile)
    try:
        translations = translator.translate(
            sources, beam_size=args.beam, n_best=args.n_best or 1, max_len_a=args.max_len_a,
            max_len_b=args.max_len_b, length_penalty=args.length_penalty, alpha=args.alpha,
            batch_size=args.batch_size, progress=sys.stderr.isatty(),
        )
    except TranslationError as exc:
        if exc.index is None:
            raise
        raise TranslationError(f"{origins[exc.index]}: {exc.detail}") from None
    for index, translation in enumerate(translations):
        if args.n_best is None:
            print(translation.text, file=stdout)
        else:
            for hyp in translation.hypotheses:
                score = "-" if hyp.score is None else f"{hyp.score:.4f}"
                print(f"{index}\t{score}\t{hyp.text}", file=stdout)
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
