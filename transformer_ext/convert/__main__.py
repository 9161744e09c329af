"""``python -m transformer_ext.convert transformers --model HF_DIR --output-dir MODEL_DIR``: the converter CLI."""

from __future__ import annotations

if __name__ == "__main__":  # before the imports: one line, not a traceback, where they are missing
    from transformer_ext.commands import require

    require("transformer_ext.convert")

import argparse
import logging
import signal
import sys
import threading
from typing import Optional, Sequence

from ..cli import add_debug_flag, add_option, add_version_flag, run_cli, take_positional_spelling


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="transformer-ext-convert",
        description="Convert a pretrained checkpoint folder into a transformer_ext model folder.",
    )
    add_version_flag(parser)
    sub = parser.add_subparsers(dest="source", required=True, metavar="SOURCE")
    hf = sub.add_parser(
        "transformers",
        help="a local Hugging Face checkpoint folder (MarianMT / opus-mt, M2M100, NLLB-200)",
        description="Read a local Hugging Face checkpoint folder (config.json, weights, generation config, "
        "tokenizer files) without transformers and write a model folder of ours.",
    )
    hf.add_argument(
        "--model",
        default=None,
        metavar="HF_DIR",
        help="the checkpoint folder (as save_pretrained writes it), or a Hugging Face hub id (ORG/NAME) "
        "where no such folder exists: read from the hub cache, downloaded unless HF_HUB_OFFLINE=1 "
        "(needs huggingface_hub); required (HF_DIR as a positional argument: deprecated spelling)",
    )
    # the old spelling of --model (take_positional_spelling)
    hf.add_argument("hf_dir", nargs="?", default=None, help=argparse.SUPPRESS)
    add_option(
        hf,
        "--output-dir",
        deprecated=("--out",),
        required=True,
        metavar="MODEL_DIR",
        help="the model folder to create (must not exist)",
    )
    add_debug_flag(hf)
    return parser


class _CommitShield:
    """From :meth:`activate` (just before the finished folder is renamed into place) until
    :meth:`release`, SIGINT and SIGTERM are recorded instead of raised: the rename cannot be
    undone, so an interruption then must not report a failure for a complete folder. A signal
    the process ignores (a background job's SIGINT) stays ignored."""

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self._previous: dict = {}

    def _record(self, signum, frame) -> None:
        self.received = signum

    def activate(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous = signal.getsignal(signum)
            if previous is not signal.SIG_IGN:
                self._previous[signum] = previous
                signal.signal(signum, self._record)

    def release(self) -> None:
        """Put back the handlers replaced, where nobody replaced ours since (run_cli restores
        SIGTERM's own on its way out)."""
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._record:
                signal.signal(signum, previous)
        self._previous = {}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    take_positional_spelling(parser, args, "hf_dir", "--model", metavar="HF_DIR", required=True)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    shield = _CommitShield()

    def work() -> int:
        from . import convert_transformers

        out = convert_transformers(args.model, args.output_dir, before_commit=shield.activate)
        print(out, flush=True)
        if shield.received is not None:
            logging.getLogger(__name__).warning(
                "%s arrived after the conversion finished: the model folder %s is complete",
                signal.Signals(shield.received).name,
                out,
            )
        return 0

    try:
        return run_cli(parser.prog, work, debug=args.debug)
    finally:
        shield.release()


if __name__ == "__main__":
    sys.exit(main())
