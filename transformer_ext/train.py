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

from .cli import add_debug_flag, run_cli
from .config import PRESETS
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
from .training.options import AMP_DTYPES, BEST_METRICS, TOKENIZERS, init_from_conflicts

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
def build_parser() -> argparse.ArgumentParser:
    d = TrainOptions()
    p = argparse.ArgumentParser(
        prog="python -m transformer_ext.train",
        description=(
            "Train an encoder-decoder Transformer with the paper's recipe: teacher forcing, label smoothing, "
            "Adam with a warmup schedule, gradient clipping, batches by token count bucketed by length. "
            "Without options it trains the demo model (English to German number words, num2words, character "
            "tokenizer); with --train SRC TGT --valid SRC TGT it trains on parallel text with a SentencePiece "
            "vocabulary and selects checkpoints by validation BLEU. Checkpoints go to OUT/best/ and OUT/last/ "
            "(config.json, model.safetensors, tokenizer files; OUT/last/ also holds the state for --resume). "
            "Multi-process training: torchrun --nproc-per-node N -m transformer_ext.train ... (data-parallel, "
            "gloo on the CPU, nccl on CUDA; rank 0 trains the tokenizer, validates and writes)."
        ),
    )
    g = p.add_argument_group("run")
    g.add_argument(
        "--out",
        dest="out_dir",
        default=d.out_dir,
        help="output directory of the run (default for the demo task: %(default)s; required with --train)",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue the run saved in OUT/last/ exactly where it stopped: the options not given come "
        "from the run, an option given again replaces the run's (budgets such as --max-steps); the model, "
        "data and schedule options cannot change",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh even if OUT already holds a run of this program: the old run is replaced "
        "when the new one has written its first checkpoint",
    )
    g.add_argument(
        "--export",
        dest="export_dir",
        default=None,
        metavar="DIR",
        help="at the end, copy the best model directory (config, weights, tokenizer) to DIR, "
        "e.g. transformer_ext/demo_model",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="seed of initialisation, dropout and batch order (default: %(default)s)",
    )
    g.add_argument("--device", default=d.device, help="cpu or cuda (default: %(default)s)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress display (a bar on a terminal, else a log line a minute; its estimate is the "
        "binding budget's: --max-steps/--epochs or --max-minutes)",
    )
    g.add_argument(
        "--tensorboard",
        metavar="DIR",
        default=None,
        help="write TensorBoard scalars to DIR: training loss, learning rate, target tokens/s, validation "
        "loss, BLEU, chrF, exact match (needs the tensorboard package: the [tensorboard] extra)",
    )
    g.add_argument("--quiet", action="store_true", help="log warnings only")
    add_debug_flag(g)

    g = p.add_argument_group("model")
    g.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=d.preset,
        help="model size: demo (d_model 64, 3+3 layers, 4 heads, d_ff 256, Post-LN, no dropout), "
        "tiny, small, base (the paper's) (default: %(default)s)",
    )
    g.add_argument("--d-model", type=int, help="width of the model (overrides the preset)")
    g.add_argument("--n-heads", type=int, help="attention heads (overrides the preset)")
    g.add_argument("--layers", type=int, help="encoder and decoder layers (overrides the preset)")
    g.add_argument("--encoder-layers", dest="n_encoder_layers", type=int, help="encoder layers")
    g.add_argument("--decoder-layers", dest="n_decoder_layers", type=int, help="decoder layers")
    g.add_argument("--d-ff", type=int, help="feed-forward inner width (overrides the preset)")
    g.add_argument("--dropout", type=float, help="dropout probability (overrides the preset)")
    g.add_argument("--max-len", type=int, help="longest source/target in tokens (overrides the preset)")
    g.add_argument(
        "--pre-ln",
        dest="norm_first",
        action="store_const",
        const=True,
        default=None,
        help="Pre-LN layers (default: the preset's, Post-LN for demo)",
    )
    g.add_argument(
        "--shared-vocab",
        action="store_true",
        help="one vocabulary (character or SentencePiece) for both languages; the source embedding, "
        "target embedding and output projection are then one matrix",
    )

    g = p.add_argument_group("parallel text (instead of the demo task)")
    g.add_argument(
        "--train",
        dest="train_files",
        nargs=2,
        metavar=("SRC_FILE", "TGT_FILE"),
        help="training pairs: two line-aligned UTF-8 files (e.g. from python -m transformer_ext.corpora); a "
        "provenance.json next to SRC_FILE is copied into every model folder",
    )
    g.add_argument(
        "--init-from",
        metavar="MODEL_DIR",
        help="fine-tune the model in MODEL_DIR (its weights, architecture and tokenizer; e.g. a checkpoint "
        "converted with python -m transformer_ext.convert) on --train / --valid; architecture and "
        "tokenizer options are then errors",
    )
    g.add_argument(
        "--valid",
        dest="valid_files",
        nargs=2,
        metavar=("SRC_FILE", "TGT_FILE"),
        help="validation pairs (loss, BLEU and chrF with sacrebleu, best-checkpoint selection)",
    )
    g.add_argument(
        "--test",
        dest="test_files",
        nargs=2,
        metavar=("SRC_FILE", "TGT_FILE"),
        help="a held-out test set: at the end the best model is scored on it, greedy and with --final-beam "
        "(BLEU, chrF: the numbers of python -m transformer_ext.evaluate), into summary.json",
    )
    g.add_argument("--train-tsv", metavar="FILE", help="training pairs as source<TAB>target lines")
    g.add_argument("--valid-tsv", metavar="FILE", help="validation pairs as source<TAB>target lines")
    g.add_argument(
        "--tokenizer",
        choices=TOKENIZERS,
        default=None,
        help="char, or sentencepiece (the default with --train: learnt from the training split only, "
        "special ids equal to the model's)",
    )
    g.add_argument(
        "--vocab-size",
        type=int,
        default=d.vocab_size,
        help="SentencePiece pieces per model, special tokens included (default: %(default)s)",
    )
    g.add_argument(
        "--spm-model-type",
        choices=("unigram", "bpe"),
        default=d.spm_model_type,
        help="SentencePiece algorithm (default: %(default)s)",
    )
    g.add_argument(
        "--max-len-ratio",
        type=float,
        default=None,
        metavar="R",
        help="drop training pairs whose longer side has more than R times the tokens of the shorter "
        "(pairs longer than --max-len tokens, BOS/EOS included, and empty lines are always dropped; "
        "the counts are logged)",
    )

    g = p.add_argument_group("batches")
    g.add_argument(
        "--max-tokens", type=int, default=d.max_tokens, help="padded tokens per batch (default: %(default)s)"
    )

    g = p.add_argument_group("the demo task (without --train: English to German number words)")
    g.add_argument(
        "--range",
        dest="number_range",
        nargs=2,
        type=int,
        metavar=("LOW", "HIGH"),
        default=[d.range_low, d.range_high],
        help=f"numbers of the task, inclusive (default: {d.range_low} {d.range_high})",
    )
    g.add_argument(
        "--split-seed",
        type=int,
        default=d.split_seed,
        help="seed of the train / valid (5%%) / held-out (5%%) split (default: %(default)s)",
    )
    g.add_argument(
        "--oversample",
        nargs="*",
        metavar="BELOW=TIMES",
        type=_oversample_rule,
        default=list(d.oversample),
        help="repeat training numbers below BELOW TIMES per epoch, first matching rule wins; "
        "no value: no oversampling (default: " + " ".join(f"{b}={t}" for b, t in d.oversample) + ")",
    )

    g = p.add_argument_group("optimisation")
    g.add_argument(
        "--max-steps",
        type=int,
        default=d.max_steps,
        help="optimiser steps to train (0 or negative: no step limit, use --epochs) (default: %(default)s)",
    )
    g.add_argument("--epochs", type=int, default=None, help="epochs to train (whichever limit comes first)")
    g.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="time budget of this session in minutes; training stops (and saves) when it is spent",
    )
    g.add_argument(
        "--lr-factor",
        type=float,
        default=d.lr_factor,
        help="factor of the schedule lr = factor * d_model^-0.5 * min(step^-0.5, "
        "step * warmup^-1.5) (default: %(default)s)",
    )
    g.add_argument(
        "--warmup", type=int, default=d.warmup, help="warmup steps of the schedule (default: %(default)s)"
    )
    g.add_argument(
        "--label-smoothing",
        type=float,
        default=d.label_smoothing,
        help="label smoothing epsilon (default: %(default)s)",
    )
    g.add_argument(
        "--clip-norm",
        type=float,
        default=d.clip_norm,
        help="max gradient norm, 0: no clipping (default: %(default)s)",
    )
    g.add_argument(
        "--lr-schedule",
        choices=("noam", "inverse-sqrt"),
        default=d.lr_schedule,
        help="noam: the paper's formula scaled by --lr-factor; inverse-sqrt: fairseq's, a linear warmup "
        "to --lr over --warmup steps, then lr * sqrt(warmup / step) (default: %(default)s)",
    )
    g.add_argument("--lr", type=float, default=None, help="peak learning rate of --lr-schedule inverse-sqrt")
    g.add_argument(
        "--update-freq",
        type=int,
        default=d.update_freq,
        metavar="N",
        help="accumulate the gradients of N batches into one optimiser step (the gradient of one N-times "
        "larger batch) (default: %(default)s)",
    )
    g.add_argument(
        "--amp",
        choices=AMP_DTYPES,
        default=None,
        help="mixed precision (autocast; float32 weights, optimiser state, loss and checkpoints): on CUDA "
        "bf16 or fp16 (with a gradient scaler); on the CPU bf16 only, where the CPU has native bfloat16 "
        "matrix products (AVX-512 BF16 or AMX: Intel Sapphire Rapids and newer, AMD Zen 4 and newer; "
        "elsewhere they are about 100x slower than float32 and --amp is refused)",
    )

    g = p.add_argument_group("validation")
    g.add_argument(
        "--eval-every",
        type=int,
        default=d.eval_every,
        help="steps between validations and checkpoints (0: only at the end) (default: %(default)s)",
    )
    g.add_argument(
        "--eval-examples",
        type=int,
        default=d.eval_examples,
        help="validation sources decoded greedily for the exact-match score (default: %(default)s)",
    )
    g.add_argument(
        "--no-final-eval",
        dest="final_eval",
        action="store_false",
        help="skip the final check of the best model (the demo's held-out numbers, or --test)",
    )
    g.add_argument(
        "--final-beam",
        type=int,
        default=d.final_beam,
        help="beam size of the final check, besides greedy (1: greedy only) (default: %(default)s)",
    )
    g.add_argument(
        "--best-metric",
        choices=BEST_METRICS,
        default=None,
        help="what selects OUT/best/: validation BLEU, chrF, loss, or exact match (default: exact for the "
        "demo, bleu for parallel text)",
    )
    g.add_argument(
        "--patience",
        type=int,
        default=None,
        metavar="N",
        help="stop early after N validations without a new best",
    )
    g.add_argument(
        "--keep-last",
        type=int,
        default=d.keep_last,
        metavar="K",
        help="also keep the models of the last K validations in OUT/checkpoints/step-N/ (for "
        "python -m transformer_ext.average) (default: %(default)s)",
    )
    g.add_argument(
        "--log-every", type=int, default=d.log_every, help="steps between log lines (default: %(default)s)"
    )
    return p


def _oversample_rule(text: str) -> tuple[int, int]:
    try:
        below, times = (int(x) for x in text.split("="))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BELOW=TIMES with two integers, got {text!r}") from None
    if times < 1:
        raise argparse.ArgumentTypeError(f"TIMES must be >= 1, got {text!r}")
    return below, times


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
        parser.error("--out is required with --train / --train-tsv (the default out/demo is the demo task's)")
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
