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
tokens is ``a * n + b`` (``--max-len-a``, ``--max-len-b``), capped by the model's ``max_len``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

from .tokenizer import CharTokenizer, TokenizerError, UnknownCharacterError

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
LENGTH_PENALTIES = ("gnmt", "seed", "none")


class TranslationError(ValueError):
    """A source cannot be translated (empty, unknown characters, too long) or a bad option."""


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


class Translator:
    """A model directory (``config.json`` + ``model.safetensors`` + ``tokenizer.json``) ready to translate.

    Args:
        model_dir: the model directory; ``None`` is the bundled demo model
            (English number words to German number words).
        device: ``"cpu"`` or ``"cuda"`` (or a ``torch.device``).
        compile: run the decoder step through ``torch.compile`` (see
            :class:`transformer_ext.runner.EagerRunner`): faster per token once compiled, at the
            cost of a compile (seconds) for every new batch shape; worth it for long jobs.

    Raises:
        FileNotFoundError: the directory, its config, weights or tokenizer file is missing.
        TranslationError / ValueError: the files do not fit together (vocabulary sizes).
    """

    def __init__(self, model_dir: str | os.PathLike | None = None, device="cpu", compile: bool = False):
        from .checkpoint import load_model

        model_dir = Path(model_dir) if model_dir is not None else DEMO_MODEL_DIR
        if not model_dir.is_dir():
            raise FileNotFoundError(
                f"model directory not found: {model_dir} (expected a folder with config.json, "
                "model.safetensors and tokenizer.json, as written by `python -m transformer_ext.train`)"
            )
        tokenizer = CharTokenizer.load(model_dir)
        model = load_model(model_dir, device)
        self._setup(model, tokenizer, device, compile)
        self.model_dir = model_dir

    @classmethod
    def from_model(cls, model, tokenizer: CharTokenizer, device="cpu") -> "Translator":
        """A translator over an in-memory model (training uses this for validation)."""
        self = cls.__new__(cls)
        self._setup(model, tokenizer, device)
        self.model_dir = None
        return self

    def _setup(self, model, tokenizer: CharTokenizer, device, compile: bool = False) -> None:
        from .runner import EagerRunner

        config = model.config
        if tokenizer.src_vocab_size != config.src_vocab_size or tokenizer.tgt_vocab_size != config.tgt_vocab_size:
            raise TranslationError(
                f"the tokenizer's vocabularies (source {tokenizer.src_vocab_size}, target "
                f"{tokenizer.tgt_vocab_size}) do not match the model's (source {config.src_vocab_size}, "
                f"target {config.tgt_vocab_size}); the tokenizer.json belongs to another model"
            )
        if (config.pad_id, config.bos_id, config.eos_id) != (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id):
            raise TranslationError(
                f"special ids differ between model config (pad/bos/eos {config.pad_id}/{config.bos_id}/"
                f"{config.eos_id}) and tokenizer ({tokenizer.pad_id}/{tokenizer.bos_id}/{tokenizer.eos_id})"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.device = device
        self.runner = EagerRunner(model, device, compile=compile)

    # ------------------------------------------------------------------ helpers
    def encode(self, sources: Sequence[str]) -> list[list[int]]:
        """Token ids of each source, with every bad input reported as a :class:`TranslationError`."""
        if isinstance(sources, str):
            raise TypeError("translate() takes a list of source strings, not one string")
        encoded = []
        for i, text in enumerate(sources):
            if not isinstance(text, str):
                raise TypeError(f"source {i} is a {type(text).__name__}, expected str")
            text = _normalize(text)
            if not text:
                raise TranslationError(f"source {i} is empty")
            try:
                ids = self.tokenizer.encode_source(text)
            except UnknownCharacterError as exc:
                raise TranslationError(f"source {i}: {exc}") from None
            if len(ids) > self.config.max_len:
                raise TranslationError(
                    f"source {i} has {len(ids)} tokens, more than the model's max_len ({self.config.max_len})"
                )
            encoded.append(ids)
        return encoded

    def max_new_tokens(self, src_lengths: np.ndarray, max_len_a: float, max_len_b: float) -> np.ndarray:
        """Per-row budget ``floor(a * src_len + b)`` (EOS included), at least 1, at most ``max_len``."""
        from .decoding import max_new_tokens_for

        return max_new_tokens_for(src_lengths, max_len_a, max_len_b, cap=self.config.max_len)

    # ------------------------------------------------------------------ translate
    def translate(
        self,
        sources: Sequence[str],
        beam_size: int = 1,
        n_best: int = 1,
        *,
        max_len_a: float = DEFAULT_MAX_LEN_A,
        max_len_b: float = DEFAULT_MAX_LEN_B,
        length_penalty: str = "gnmt",
        alpha: float = 0.6,
        batch_size: int = 64,
    ) -> list[Translation]:
        """Translate each source; returns one :class:`Translation` per source, in order.

        ``beam_size=1`` is greedy decoding (hypothesis scores are then ``None``); with
        ``beam_size > 1`` each translation holds the ``n_best`` best hypotheses with their
        length-penalised scores (``length_penalty`` "gnmt": ((5+len)/6)^alpha, "seed":
        ((5+len)/5)^alpha, "none"). Sources are normalised (whitespace collapsed, lower-cased
        for the demo tokenizer) before encoding.
        """
        from .decoding import beam_search, greedy_decode

        if isinstance(beam_size, bool) or not isinstance(beam_size, int) or beam_size < 1:
            raise TranslationError(f"beam size must be a positive integer, got {beam_size!r}")
        if isinstance(n_best, bool) or not isinstance(n_best, int) or n_best < 1:
            raise TranslationError(f"n_best must be a positive integer, got {n_best!r}")
        if n_best > beam_size:
            raise TranslationError(f"n_best ({n_best}) cannot exceed the beam size ({beam_size})")
        if length_penalty not in LENGTH_PENALTIES:
            raise TranslationError(f"length_penalty must be one of {LENGTH_PENALTIES}, got {length_penalty!r}")
        if not (max_len_a >= 0 and max_len_b >= 0):
            raise TranslationError(f"max_len_a and max_len_b must be >= 0, got {max_len_a}, {max_len_b}")
        if batch_size < 1:
            raise TranslationError(f"batch_size must be >= 1, got {batch_size}")

        encoded = self.encode(sources)
        results: list[Optional[Translation]] = [None] * len(encoded)
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))  # similar lengths together
        tok = self.tokenizer
        was_training = getattr(self.model, "training", False)
        if was_training:
            self.model.eval()
        try:
            for start in range(0, len(order), batch_size):
                rows = order[start : start + batch_size]
                lengths = np.array([len(encoded[i]) for i in rows], dtype=np.int64)
                input_ids = np.full((len(rows), int(lengths.max())), tok.pad_id, dtype=np.int64)
                for r, i in enumerate(rows):
                    input_ids[r, : lengths[r]] = encoded[i]
                budget = self.max_new_tokens(lengths, max_len_a, max_len_b)
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
        finally:
            if was_training:
                self.model.train()
        return results  # type: ignore[return-value]


# ---------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m transformer_ext.translate",
        description=(
            "Translate with a trained transformer_ext model. By default the bundled demo model "
            "translates English number words (0 to 9999) into German number words. Prints one "
            "translation per source line, in input order."
        ),
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
    parser.add_argument("--device", default="cpu", help="torch device: cpu (default) or cuda")
    parser.add_argument("--beam", type=int, default=1, metavar="N",
                        help="beam size; 1 (default) is greedy decoding")
    parser.add_argument("--n-best", type=int, default=None, metavar="K",
                        help="print the K best hypotheses of each source as 'index<TAB>score<TAB>text' "
                             "(needs --beam >= K; with --beam 1 the greedy output gets no score)")
    parser.add_argument("--max-len-a", type=float, default=DEFAULT_MAX_LEN_A, metavar="A",
                        help=f"generate at most A * source_length + B tokens (default A={DEFAULT_MAX_LEN_A})")
    parser.add_argument("--max-len-b", type=float, default=DEFAULT_MAX_LEN_B, metavar="B",
                        help=f"see --max-len-a (default B={DEFAULT_MAX_LEN_B}); always capped by the model's max_len")
    parser.add_argument("--length-penalty", choices=LENGTH_PENALTIES, default="gnmt",
                        help="beam length penalty: gnmt ((5+len)/6)^alpha (default), seed ((5+len)/5)^alpha, none")
    parser.add_argument("--alpha", type=float, default=0.6, help="length-penalty exponent (default 0.6)")
    parser.add_argument("--batch-size", type=int, default=64, help="sources decoded together (default 64)")
    parser.add_argument("--compile", action="store_true",
                        help="run the decoder step through torch.compile: faster per token, but every new "
                             "batch shape compiles first (seconds); pays off on large inputs. On CPU it "
                             "needs a C++ compiler")
    return parser


def _read_lines(stream: Iterable[str], name: str) -> list[str]:
    lines = [line.rstrip("\r\n") for line in stream]
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            raise TranslationError(f"{name}, line {n}: empty source")
    return lines


def _gather_sources(args, stdin) -> list[str]:
    sources: list[str] = []
    for text in args.text:
        if text == "-":
            sources.extend(_read_lines(stdin, "stdin"))
        else:
            sources.append(text)
    if args.input is not None:
        try:
            with open(args.input, encoding="utf-8") as f:
                sources.extend(_read_lines(f, args.input))
        except FileNotFoundError:
            raise TranslationError(f"input file not found: {args.input}") from None
        except UnicodeDecodeError as exc:
            raise TranslationError(f"input file {args.input} is not UTF-8 text: {exc}") from None
    if not args.text and args.input is None:
        if stdin is None or stdin.isatty():
            raise TranslationError("nothing to translate: give a text, --input FILE, or pipe lines on stdin")
        sources.extend(_read_lines(stdin, "stdin"))
    if not sources:
        raise TranslationError("nothing to translate: the input is empty")
    return sources


def main(argv: Optional[Sequence[str]] = None, stdin=None, stdout=None) -> int:
    """Entry point of ``python -m transformer_ext.translate``; returns the exit code (2 on bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    stdin = sys.stdin if stdin is None else stdin
    stdout = sys.stdout if stdout is None else stdout
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    prog = parser.prog
    try:
        n_best = args.n_best if args.n_best is not None else 1
        if args.beam < 1:
            raise TranslationError(f"--beam must be >= 1, got {args.beam}")
        if n_best < 1 or n_best > args.beam:
            raise TranslationError(f"--n-best must be between 1 and --beam ({args.beam}), got {n_best}")
        sources = _gather_sources(args, stdin)
        translator = Translator(args.model, device=args.device, compile=args.compile)
        translations = translator.translate(
            sources, beam_size=args.beam, n_best=n_best, max_len_a=args.max_len_a, max_len_b=args.max_len_b,
            length_penalty=args.length_penalty, alpha=args.alpha, batch_size=args.batch_size,
        )
    except (OSError, ValueError, TypeError, RuntimeError) as exc:
        # Bad input or a bad model directory: a message, no traceback.
        logger.debug("translation failed", exc_info=True)
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    for index, translation in enumerate(translations):
        if args.n_best is None:
            print(translation.text, file=stdout)
        else:
            for hyp in translation.hypotheses:
                score = "-" if hyp.score is None else f"{hyp.score:.4f}"
                print(f"{index}\t{score}\t{hyp.text}", file=stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
