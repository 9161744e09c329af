"""The training command: ``python -m transformer_ext.train`` (and ``torchrun -m transformer_ext.train``).

The command line is a thin layer over :func:`transformer_ext.training.train`, which tests call
directly; ``--help`` explains every option. Without ``--train`` it trains the demo model (English
to German number words); with ``--train SRC TGT --valid SRC TGT`` it trains on parallel text.
What a run does and writes is described in :mod:`transformer_ext.training`.
"""

from __future__ import annotations

if __name__ == "__main__":  # before the imports: one line, not a traceback, where they are missing
    from transformer_ext.commands import require

    require("transformer_ext.train")

import argparse
import logging
import sys
from pathlib import Path
from typing import Optional, Sequence

from .cli import DefaultsHelpFormatter, add_debug_flag, add_options, run_cli
from .training import (
    TrainingDiverged,
    TrainingError,
    TrainOptions,
    TrainResult,
    build_config,
    distributed,
    inverse_sqrt_lr,
    make_optimizer,
    make_scheduler,
    noam_lr,
    token_loss,
    train,
)
from .training.options import OPTION_GROUPS, init_from_conflicts

__all__ = [
    "TrainOptions",
    "TrainResult",
    "TrainingError",
    "TrainingDiverged",
    "noam_lr",
    "inverse_sqrt_lr",
    "token_loss",
    "make_optimizer",
    "make_scheduler",
    "build_config",
    "train",
    "build_parser",
    "options_from_args",
    "main",
]


# ---------------------------------------------------------------------- command line
DESCRIPTION = (
    "Train an encoder-decoder Transformer with the paper's recipe: teacher forcing, label smoothing, "
    "Adam with a warmup schedule, gradient clipping, batches by token count bucketed by length. "
    "Without options it trains the demo model (English to German number words, num2words, character "
    "tokenizer); with --train SRC TGT --valid SRC TGT it trains on parallel text with a SentencePiece "
    "vocabulary and selects checkpoints by validation BLEU. Checkpoints go to OUTPUT_DIR/best/ and "
    "OUTPUT_DIR/last/ (config.json, model.safetensors, tokenizer files; OUTPUT_DIR/last/ also holds the "
    "state for --resume). Multi-process training: torchrun --nproc-per-node N -m transformer_ext.train ... "
    "(data-parallel, gloo on the CPU, nccl on CUDA; rank 0 trains the tokenizer, validates and writes)."
)


def build_parser() -> argparse.ArgumentParser:
    """The command line, generated from :class:`TrainOptions`' fields, plus the options that are
    not one field each (``--layers``, ``--range``, ``--quiet``, ``--debug``)."""
    p = argparse.ArgumentParser(
        prog="python -m transformer_ext.train", description=DESCRIPTION, formatter_class=DefaultsHelpFormatter
    )
    groups = add_options(p, TrainOptions, OPTION_GROUPS)
    groups["run"].add_argument("--quiet", action="store_true", help="log warnings only")
    add_debug_flag(groups["run"])
    groups["model"].add_argument(
        "--layers", type=int, help="encoder and decoder layers (overrides the preset)"
    )
    d = TrainOptions()
    groups["demo"].add_argument(
        "--range",
        dest="number_range",
        nargs=2,
        type=int,
        metavar=("LOW", "HIGH"),
        default=[d.range_low, d.range_high],
        help=f"numbers of the task, inclusive (default: {d.range_low} {d.range_high})",
    )
    return p


def options_from_args(args: argparse.Namespace) -> TrainOptions:
    values = vars(args).copy()
    values["oversample"] = tuple(sorted(values["oversample"]))
    values.pop("quiet", None)
    values.pop("debug", None)
    low, high = values.pop("number_range")
    layers = values.pop("layers", None)
    if layers is not None:
        for name in ("n_encoder_layers", "n_decoder_layers"):
            if values[name] is None:
                values[name] = layers
    if values.get("max_steps") is not None and values["max_steps"] <= 0:
        values["max_steps"] = None
    for name in ("train_files", "valid_files", "test_files"):
        if values.get(name) is not None:
            values[name] = tuple(values[name])
    return TrainOptions(range_low=low, range_high=high, **values)


# Flags whose destination is not a TrainOptions field, and the fields each one sets.
_DEST_FIELDS = {
    "number_range": ("range_low", "range_high"),
    "layers": ("n_encoder_layers", "n_decoder_layers"),
}


def given_options(argv: Optional[Sequence[str]]) -> frozenset:
    """The TrainOptions fields that ``argv`` gives explicitly (a resumed run takes the others from the run)."""
    probe = build_parser()
    probe.quiet_renamed = True  # main() has parsed argv already and said what is deprecated
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    given = set()
    for dest in vars(probe.parse_args(argv)):
        given.update(_DEST_FIELDS.get(dest, (dest,)))
    return frozenset(given)


def _run(args: argparse.Namespace, given: frozenset, rank: int) -> int:
    """Train as the parsed ``args`` say and print the result (rank 0)."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    opts = options_from_args(args)
    with logging_redirect_tqdm():
        result = train(opts, given_options=given)
    if rank > 0:
        return 0
    best = result.best or {}
    if "bleu" in best:
        print(
            f"trained {result.step} steps in {result.total_elapsed_s:.0f} s ({result.stop_reason}); best "
            f"validation BLEU {best['bleu']:.2f}, chrF {best['chrf']:.2f} at step {best.get('step')}"
        )
    else:
        print(
            f"trained {result.step} steps in {result.total_elapsed_s:.0f} s ({result.stop_reason}); "
            f"best validation exact match {best.get('exact_match', float('nan')):.4f} at step {best.get('step')}"
        )
    h = result.heldout or {}
    if "greedy_exact_match" in h:
        line = f"held-out ({h['n']} numbers): greedy exact match {h['greedy_exact_match']:.4f}"
        if "beam_exact_match" in h:
            line += f", beam {h['beam_size']} {h['beam_exact_match']:.4f}"
        print(line)
    elif "greedy_bleu" in h:
        line = f"test {h['src']} ({h['n']} pairs): greedy BLEU {h['greedy_bleu']:.2f}"
        line += f", chrF {h['greedy_chrf']:.2f}"
        if "beam_bleu" in h:
            line += f"; beam {h['beam_size']} BLEU {h['beam_bleu']:.2f}, chrF {h['beam_chrf']:.2f}"
        print(line)
    print(f"model directories: {Path(result.out_dir) / 'best'} and {Path(result.out_dir) / 'last'}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m transformer_ext.train``; returns the exit code.

    Bad options are reported by argparse (exit code 2) or, for values out of range, by
    :func:`train` before anything is written; every expected failure is one line on stderr and
    exit code 1 (``--debug`` shows the traceback); Ctrl-C and SIGTERM print one line and return
    130 and 143, with the temporary files removed and the last checkpoint kept for ``--resume``.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    given = given_options(argv)
    if given & {"train_files", "train_tsv"} and "out_dir" not in given:
        parser.error(
            "--output-dir is required with --train / --train-tsv (the default out/demo is the demo task's)"
        )
    clash = init_from_conflicts(given) if "init_from" in given else []
    if clash:  # options that exclude each other: a usage error (exit 2), before anything is read
        parser.error(
            f"--init-from {args.init_from} takes the architecture and tokenizer from that model folder; "
            f"drop {', '.join(clash)}"
        )
    rank = distributed.env_rank()  # under torchrun only rank 0 logs progress and prints the result
    logging.basicConfig(
        level=logging.WARNING if args.quiet or rank > 0 else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )

    return run_cli(
        parser.prog,
        lambda: _run(args, given, rank),
        debug=args.debug,
        interrupted_hint="resume with --resume",
    )


if __name__ == "__main__":
    sys.exit(main())
