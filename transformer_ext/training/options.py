"""The options of a training run: :class:`TrainOptions`, every check of them, the model config they make.

Every option is checked here before anything touches the disk (:func:`check_options`); the
error names the command-line flag and the field. The model sizes come from the presets of
:data:`transformer_ext.config.PRESETS` ("demo" is the bundled translator's), with the flags'
overrides and the tokenizer's vocabularies (:func:`build_config`). On ``--resume`` the
run-defining options (:data:`RUN_DEFINING`) come from the saved run (:func:`merge_resume_options`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..cli import option, option_flag
from ..config import PRESETS, TransformerConfig
from ..data import DEMO_OVERSAMPLE, DEMO_RANGE, SPLIT_SEED
from .errors import TrainingError, TrainingUsageError

logger = logging.getLogger(__name__)

__all__ = [
    "TrainOptions",
    "RUN_DEFINING",
    "BEST_METRICS",
    "TOKENIZERS",
    "AMP_DTYPES",
    "check_options",
    "parse_device",
    "is_text_run",
    "options_dict",
    "merge_resume_options",
    "saved_options",
    "given_fields",
    "build_config",
]

BEST_METRICS = ("bleu", "chrf", "loss", "exact")
TOKENIZERS = ("char", "sentencepiece")
AMP_DTYPES = ("bf16", "fp16")


def _oversample_rule(text: str) -> tuple[int, int]:
    """One ``--oversample`` rule, ``BELOW=TIMES``."""
    try:
        below, times = (int(x) for x in text.split("="))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BELOW=TIMES with two integers, got {text!r}") from None
    if times < 1:
        raise argparse.ArgumentTypeError(f"TIMES must be >= 1, got {text!r}")
    return below, times


@dataclass
class TrainOptions:
    """Every option of a training run. Each field declares its command-line option (flag, help,
    ``--help`` group) with :func:`transformer_ext.cli.option`; the parser of
    ``python -m transformer_ext.train`` is generated from these fields."""

    # run
    out_dir: str = option(
        "out/demo",
        flag="--output-dir",
        deprecated=("--out",),
        group="run",
        metavar="OUTPUT_DIR",
        help="output folder of the run: best/, last/, run.json, train_options.json, summary.json "
        "(default for the demo task: %(default)s; required with --train)",
    )
    resume: bool = option(
        False,
        group="run",
        action="store_true",
        help="continue the run saved in OUTPUT_DIR/last/ exactly where it stopped: the options not given "
        "come from the run, an option given again replaces the run's (budgets such as --max-steps); the "
        "model, data and schedule options cannot change",
    )
    overwrite: bool = option(
        False,
        group="run",
        action="store_true",
        help="start afresh even if OUTPUT_DIR already holds a run of this program: the old run is replaced "
        "when the new one has written its first checkpoint",
    )
    export_dir: Optional[str] = option(
        None,
        flag="--export",
        group="run",
        metavar="DIR",
        help="at the end, copy the best model folder (config, weights, tokenizer) to DIR, "
        "e.g. transformer_ext/demo_model",
    )
    seed: int = option(1, group="run", type=int, help="seed of initialisation, dropout and batch order")
    device: str = option("cpu", group="run", help="cpu or cuda")
    threads: Optional[int] = option(
        None, group="run", type=int, help="torch CPU threads (default: torch's choice)"
    )
    # model
    preset: str = option(
        "demo",
        group="model",
        choices=sorted(PRESETS),
        help="model size: demo (d_model 64, 3+3 layers, 4 heads, d_ff 256, Post-LN, no dropout), "
        "tiny, small, base (the paper's)",
    )
    d_model: Optional[int] = option(
        None, group="model", type=int, help="width of the model (overrides the preset)"
    )
    n_heads: Optional[int] = option(
        None, group="model", type=int, help="attention heads (overrides the preset)"
    )
    n_encoder_layers: Optional[int] = option(
        None, flag="--encoder-layers", group="model", type=int, help="encoder layers"
    )
    n_decoder_layers: Optional[int] = option(
        None, flag="--decoder-layers", group="model", type=int, help="decoder layers"
    )
    d_ff: Optional[int] = option(
        None, group="model", type=int, help="feed-forward inner width (overrides the preset)"
    )
    dropout: Optional[float] = option(
        None, group="model", type=float, help="dropout probability (overrides the preset)"
    )
    max_len: Optional[int] = option(
        None, group="model", type=int, help="longest source/target in tokens (overrides the preset)"
    )
    norm_first: Optional[bool] = option(
        None,
        flag="--pre-ln",
        group="model",
        action="store_const",
        const=True,
        help="Pre-LN layers (default: the preset's, Post-LN for demo)",
    )
    shared_vocab: bool = option(
        False,
        group="model",
        action="store_true",
        help="one vocabulary (character or SentencePiece) for both languages; the source embedding, "
        "target embedding and output projection are then one matrix",
    )
    # fine-tuning
    init_from: Optional[str] = option(
        None,
        group="text",
        metavar="MODEL_DIR",
        help="fine-tune the model in MODEL_DIR (its weights, architecture and tokenizer; e.g. a checkpoint "
        "converted with python -m transformer_ext.convert) on --train / --valid; architecture and "
        "tokenizer options are then errors",
    )
    # data: the demo task (default), or parallel text (train_files / train_tsv with a validation set)
    train_files: Optional[tuple[str, str]] = option(
        None,
        flag="--train",
        group="text",
        nargs=2,
        metavar=("SRC_FILE", "TGT_FILE"),
        help="training pairs: two line-aligned UTF-8 files (e.g. from python -m transformer_ext.corpora); a "
        "provenance.json next to SRC_FILE is copied into every model folder",
    )
    valid_files: Optional[tuple[str, str]] = option(
        None,
        flag="--valid",
        group="text",
        nargs=2,
        metavar=("SRC_FILE", "TGT_FILE"),
        help="validation pairs (loss, BLEU and chrF with sacrebleu, best-checkpoint selection)",
    )
    train_tsv: Optional[str] = option(
        None, group="text", metavar="FILE", help="training pairs as source<TAB>target lines"
    )
    valid_tsv: Optional[str] = option(
        None, group="text", metavar="FILE", help="validation pairs as source<TAB>target lines"
    )
    tokenizer: Optional[str] = option(
        None,
        group="text",
        choices=TOKENIZERS,
        help="char, or sentencepiece (the default with --train: learnt from the training split only, "
        "special ids equal to the model's); default char for the demo task",
    )
    vocab_size: int = option(
        8000, group="text", type=int, help="SentencePiece pieces per model, special tokens included"
    )
    spm_model_type: str = option(
        "unigram", group="text", choices=("unigram", "bpe"), help="SentencePiece algorithm"
    )
    max_len_ratio: Optional[float] = option(
        None,
        group="text",
        type=float,
        metavar="R",
        help="drop training pairs whose longer side has more than R times the tokens of the shorter "
        "(pairs longer than --max-len tokens, BOS/EOS included, and empty lines are always dropped; "
        "the counts are logged)",
    )
    # the demo task's numbers (the command line gives both as --range LOW HIGH)
    range_low: int = option(DEMO_RANGE[0], cli=False, help="lowest number of the demo task")
    range_high: int = option(DEMO_RANGE[1], cli=False, help="highest number of the demo task")
    split_seed: int = option(
        SPLIT_SEED,
        group="demo",
        type=int,
        help="seed of the train / valid (5%%) / held-out (5%%) split",
    )
    max_tokens: int = option(
        3000, group="batches", type=int, help="padded tokens per batch (about 80 examples of the demo task)"
    )
    oversample: tuple[tuple[int, int], ...] = option(
        DEMO_OVERSAMPLE,
        group="demo",
        nargs="*",
        metavar="BELOW=TIMES",
        type=_oversample_rule,
        help="repeat training numbers below BELOW TIMES per epoch, first matching rule wins; "
        "no value: no oversampling (default: " + " ".join(f"{b}={t}" for b, t in DEMO_OVERSAMPLE) + ")",
    )
    # optimisation
    max_steps: Optional[int] = option(
        2500,
        group="optimisation",
        type=int,
        help="optimiser steps to train (0 or negative: no step limit, use --epochs)",
    )
    epochs: Optional[int] = option(
        None, group="optimisation", type=int, help="epochs to train (whichever limit comes first)"
    )
    max_minutes: Optional[float] = option(
        None,
        group="optimisation",
        type=float,
        help="time budget of this session in minutes; training stops (and saves) when it is spent",
    )
    lr_factor: float = option(
        0.3,  # demo: peak lr 0.3 * 64^-0.5 * 200^-0.5 = 2.7e-3 at step 200, 7.5e-4 at 2500
        group="optimisation",
        type=float,
        help="factor of the schedule lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)",
    )
    warmup: int = option(200, group="optimisation", type=int, help="warmup steps of the schedule")
    label_smoothing: float = option(0.1, group="optimisation", type=float, help="label smoothing epsilon")
    clip_norm: float = option(1.0, group="optimisation", type=float, help="max gradient norm, 0: no clipping")
    lr_schedule: str = option(
        "noam",
        group="optimisation",
        choices=("noam", "inverse-sqrt"),
        help="noam: the paper's formula scaled by --lr-factor; inverse-sqrt: fairseq's, a linear warmup "
        "to --lr over --warmup steps, then lr * sqrt(warmup / step)",
    )
    lr: Optional[float] = option(
        None, group="optimisation", type=float, help="peak learning rate of --lr-schedule inverse-sqrt"
    )
    update_freq: int = option(
        1,
        group="optimisation",
        type=int,
        metavar="N",
        help="accumulate the gradients of N batches into one optimiser step (the gradient of one N-times "
        "larger batch)",
    )
    amp: Optional[str] = option(
        None,
        group="optimisation",
        choices=AMP_DTYPES,
        help="mixed precision (autocast; float32 weights, optimiser state, loss and checkpoints): on CUDA "
        "bf16 or fp16 (with a gradient scaler); on the CPU bf16 only, where the CPU has native bfloat16 "
        "matrix products (AVX-512 BF16 or AMX: Intel Sapphire Rapids and newer, AMD Zen 4 and newer; "
        "elsewhere they are about 100x slower than float32 and --amp is refused)",
    )
    adam_betas: tuple[float, float] = option((0.9, 0.98), cli=False, help="Adam's beta1 and beta2")
    adam_eps: float = option(1e-9, cli=False, help="Adam's epsilon")
    # validation and logging
    eval_every: int = option(
        250,
        group="validation",
        type=int,
        help="steps between validations and checkpoints (0: only at the end)",
    )
    eval_examples: int = option(
        500,
        group="validation",
        type=int,
        help="validation sources decoded greedily for the exact-match score (demo: all of them)",
    )
    final_eval: bool = option(
        True,
        flag="--no-final-eval",
        group="validation",
        action="store_false",
        help="skip the final check of the best model (the demo's held-out numbers, or --test)",
    )
    final_beam: int = option(
        4, group="validation", type=int, help="beam size of the final check, besides greedy (1: greedy only)"
    )
    best_metric: Optional[str] = option(
        None,
        group="validation",
        choices=BEST_METRICS,
        help="what selects OUTPUT_DIR/best/: validation BLEU, chrF, loss, or exact match (default: exact "
        "for the demo, bleu for parallel text)",
    )
    patience: Optional[int] = option(
        None,
        group="validation",
        type=int,
        metavar="N",
        help="stop early after N validations without a new best",
    )
    keep_last: int = option(
        0,
        group="validation",
        type=int,
        metavar="K",
        help="also keep the models of the last K validations in OUTPUT_DIR/checkpoints/step-N/ (for "
        "python -m transformer_ext.average)",
    )
    log_every: int = option(100, group="validation", type=int, help="steps between log lines")
    progress: bool = option(
        True,
        flag="--no-progress",
        group="run",
        action="store_false",
        help="no progress display (a bar on a terminal, else a log line a minute; its estimate is the "
        "binding budget's: --max-steps/--epochs or --max-minutes)",
    )
    tensorboard: Optional[str] = option(
        None,
        group="run",
        metavar="DIR",
        help="write TensorBoard scalars to DIR: training loss, learning rate, target tokens/s, validation "
        "loss, BLEU, chrF, exact match (needs the tensorboard package: the [tensorboard] extra)",
    )
    # parallel text: a held-out test set, scored with the best checkpoint at the end (as evaluate does)
    test_files: Optional[tuple[str, str]] = option(
        None,
        flag="--test",
        group="text",
        nargs=2,
        metavar=("SRC_FILE", "TGT_FILE"),
        help="a held-out test set: at the end the best model is scored on it, greedy and with --final-beam "
        "(BLEU, chrF: the numbers of python -m transformer_ext.evaluate), into summary.json",
    )


# The --help sections of the generated parser, in order.
OPTION_GROUPS = (
    ("run", "run"),
    ("model", "model"),
    ("text", "parallel text (instead of the demo task)"),
    ("batches", "batches"),
    ("demo", "the demo task (without --train: English to German number words)"),
    ("optimisation", "optimisation"),
    ("validation", "validation"),
)


# Options that define a run: a resumed run keeps them (given again with another value: an error).
RUN_DEFINING = (
    "seed",
    "preset",
    "d_model",
    "n_heads",
    "n_encoder_layers",
    "n_decoder_layers",
    "d_ff",
    "dropout",
    "max_len",
    "norm_first",
    "shared_vocab",
    "range_low",
    "range_high",
    "split_seed",
    "max_tokens",
    "lr_factor",
    "warmup",
    "label_smoothing",
    "clip_norm",
    "adam_betas",
    "adam_eps",
    "oversample",
    "train_files",
    "valid_files",
    "train_tsv",
    "valid_tsv",
    "tokenizer",
    "vocab_size",
    "spm_model_type",
    "max_len_ratio",
    "lr_schedule",
    "lr",
    "update_freq",
    "best_metric",
    "init_from",
)


def options_dict(opts: TrainOptions) -> dict:
    d = dataclasses.asdict(opts)
    d["adam_betas"] = list(d["adam_betas"])
    d["oversample"] = [list(rule) for rule in d["oversample"]]
    return d


# What a session gives about itself, never taken from the saved run: where the run is, how it is opened.
SESSION_FIELDS = ("out_dir", "resume", "overwrite")


def _from_json(name: str, value: Any) -> Any:
    """A value of train_options.json in the type of its TrainOptions field."""
    if name in ("adam_betas", "train_files", "valid_files", "test_files") and isinstance(value, list):
        return tuple(value)
    if name == "oversample" and isinstance(value, list):
        return tuple(tuple(rule) if isinstance(rule, list) else rule for rule in value)
    return value


def saved_options(saved: dict) -> tuple[TrainOptions, frozenset]:
    """The options stored in a run's train_options.json (checked), and the fields it holds."""
    names = {f.name for f in dataclasses.fields(TrainOptions)} - set(SESSION_FIELDS)
    present = frozenset(name for name in saved if name in names)
    opts = TrainOptions(**{name: _from_json(name, saved[name]) for name in present})
    check_options(opts)
    return opts, present


def given_fields(opts: TrainOptions) -> frozenset:
    """The fields of ``opts`` that differ from TrainOptions' defaults (what a library caller gave)."""
    defaults = TrainOptions()
    return frozenset(
        f.name
        for f in dataclasses.fields(TrainOptions)
        if f.name not in SESSION_FIELDS and getattr(opts, f.name) != getattr(defaults, f.name)
    )


def _effective(opts: TrainOptions, name: str) -> Any:
    """The value an option has in effect: a model flag left unset is its preset's value."""
    value = getattr(opts, name)
    if value is None and name in MODEL_FLAGS and opts.preset in PRESETS:
        default = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}[name]
        return PRESETS[opts.preset].get(name, default)
    return value


def _show(name: str, value: Any) -> str:
    flag = _FLAGS.get(name, name)
    if isinstance(value, bool):
        return f"{flag}={value}"
    if isinstance(value, (tuple, list)):
        return f"{flag} {' '.join(map(str, value)) if value else '(none)'}"
    return f"{flag} {value}"


def merge_resume_options(
    opts: TrainOptions, run: TrainOptions, present: frozenset, given: frozenset, out
) -> TrainOptions:
    """The options of a resumed session: the run's (``run``, from its train_options.json), with the
    options given again for this session (``given``: field names) taking the place of the run's.

    A run-defining option (:data:`RUN_DEFINING`) given with a value other than the run's is an
    error naming each such option with both values: the run cannot change what it is. Fields the
    run does not record (``present``: those it does) keep the session's value. The log line says
    which options were given again and what they replace.
    """
    merged = dataclasses.replace(opts)
    conflicts, overrides = [], []
    for f in dataclasses.fields(TrainOptions):
        name = f.name
        if name in SESSION_FIELDS or name not in present:
            continue
        value, current = getattr(run, name), getattr(opts, name)
        if name in given and _effective(opts, name) != _effective(run, name):
            current, value = _effective(opts, name), _effective(run, name)
            if name in RUN_DEFINING:
                conflicts.append(f"{_show(name, current)} (the run has {_show(name, value)})")
                continue
            overrides.append(f"{_show(name, current)} (the run had {_show(name, value)})")
            continue
        setattr(merged, name, value)
    if conflicts:
        raise TrainingUsageError(
            f"cannot resume {out} with options that differ from the run's: {'; '.join(conflicts)}. A resumed "
            "run keeps its model, data and schedule: leave these options out, or start a new run "
            "(another --output-dir, or --overwrite)"
        )
    if overrides:
        logger.info(
            "resuming %s with the run's options, except these given again: %s", out, "; ".join(overrides)
        )
    else:
        logger.info("resuming %s with the run's options", out)
    return merged


# The command-line flag of each option, for messages (library callers see the field name too).
_FLAGS = {
    f.name: option_flag(TrainOptions, f.name) for f in dataclasses.fields(TrainOptions) if f.metadata["cli"]
}
_FLAGS.update(range_low="--range LOW", range_high="--range HIGH")
_SEED_MAX = 2**63 - 1
# The largest value of each size option: beyond these a model (or one batch) of this package does
# not fit in the memory of any machine it runs on (the positional-encoding table alone is
# max_len x d_model floats); a model within them is also checked against this machine's memory
# before it is built (transformer_ext.training.tasks.check_model_memory).
SIZE_LIMITS = dict(
    d_model=16384,
    n_heads=1024,
    n_encoder_layers=256,
    n_decoder_layers=256,
    d_ff=65536,
    max_len=65536,
    max_tokens=1 << 22,
    vocab_size=1 << 20,
    final_beam=128,
)
MAX_RANGE_NUMBERS = 1_000_000  # numbers of the demo task's --range
_THREADS_MAX = 1024


def _option(name: str) -> str:
    flag = _FLAGS.get(name)
    return f"{flag} ({name})" if flag else name


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(
    opts: TrainOptions,
    name: str,
    low: int,
    high: Optional[int] = None,
    *,
    optional: bool = False,
    note: str = "",
) -> None:
    value = getattr(opts, name)
    if optional and value is None:
        return
    if not _is_int(value) or value < low or (high is not None and value > high):
        allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        raise TrainingUsageError(f"{_option(name)} must be {allowed}{note}, got {value!r}")


def _check_float(
    opts: TrainOptions,
    name: str,
    low: float,
    high: Optional[float] = None,
    *,
    low_open: bool = False,
    high_open: bool = True,
    optional: bool = False,
    note: str = "",
) -> None:
    value = getattr(opts, name)
    if optional and value is None:
        return
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value > low if low_open else value >= low)
        and (high is None or (value < high if high_open else value <= high))
    )
    if not ok:
        if high is None:
            allowed = f"a finite number {'>' if low_open else '>='} {low:g}"
        else:
            allowed = f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise TrainingUsageError(f"{_option(name)} must be {allowed}{note}, got {value!r}")


def check_options(opts: TrainOptions) -> None:
    """Every option's type and range (the checks that need no data); the error names the option."""
    for name in ("resume", "overwrite", "shared_vocab", "final_eval", "progress"):
        if not isinstance(getattr(opts, name), bool):
            raise TrainingUsageError(f"{_option(name)} must be true or false, got {getattr(opts, name)!r}")
    if opts.norm_first is not None and not isinstance(opts.norm_first, bool):
        raise TrainingUsageError(
            f"{_option('norm_first')} must be true, false or None, got {opts.norm_first!r}"
        )
    if opts.resume and opts.overwrite:
        raise TrainingUsageError("--resume and --overwrite exclude each other")
    for name in ("out_dir", "export_dir", "tensorboard"):
        value = getattr(opts, name)
        if name != "out_dir" and value is None:
            continue
        if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
            raise TrainingUsageError(f"{_option(name)} must be a folder path, got {value!r}")
    if not isinstance(opts.device, str):
        raise TrainingUsageError(
            f"{_option('device')} must be a device name such as cpu or cuda, got {opts.device!r}"
        )
    if opts.preset not in PRESETS:
        raise TrainingUsageError(f"unknown preset {opts.preset!r}; choose one of {sorted(PRESETS)}")
    _check_int(opts, "seed", 0, _SEED_MAX)
    _check_int(opts, "split_seed", 0, _SEED_MAX)
    _check_int(opts, "threads", 1, _THREADS_MAX, optional=True)
    for name in ("d_model", "n_heads", "n_encoder_layers", "n_decoder_layers", "d_ff", "max_len"):
        _check_int(opts, name, 1, SIZE_LIMITS[name], optional=True)
    _check_float(opts, "dropout", 0.0, 1.0, optional=True)
    _check_int(opts, "range_low", 0)
    _check_int(opts, "range_high", 0)
    if opts.range_high < opts.range_low:
        raise TrainingUsageError(
            f"--range LOW HIGH must satisfy 0 <= LOW <= HIGH, got {opts.range_low} {opts.range_high}"
        )
    if opts.range_high - opts.range_low + 1 > MAX_RANGE_NUMBERS:
        raise TrainingUsageError(
            f"--range {opts.range_low} {opts.range_high} holds {opts.range_high - opts.range_low + 1:,} "
            f"numbers; the demo task takes at most {MAX_RANGE_NUMBERS:,} (every one is written out in words)"
        )
    _check_int(opts, "max_tokens", 1, SIZE_LIMITS["max_tokens"])
    rules = opts.oversample
    if not isinstance(rules, (tuple, list)):
        raise TrainingUsageError(
            f"{_option('oversample')} must be a list of (BELOW, TIMES) rules, got {rules!r}"
        )
    for rule in rules:
        if (
            not isinstance(rule, (tuple, list))
            or len(rule) != 2
            or not all(_is_int(x) for x in rule)
            or rule[0] < 0
            or rule[1] < 1
        ):
            raise TrainingUsageError(
                f"{_option('oversample')} rules are BELOW=TIMES with integers BELOW >= 0 and "
                f"TIMES >= 1, got {rule!r}"
            )
    _check_int(opts, "max_steps", 0, optional=True)
    _check_int(opts, "epochs", 0, optional=True)
    if opts.max_steps is None and opts.epochs is None:
        raise TrainingUsageError("give --max-steps or --epochs (or both: whichever comes first)")
    _check_float(opts, "max_minutes", 0.0, low_open=True, optional=True)
    _check_float(opts, "lr_factor", 0.0, low_open=True)
    _check_int(opts, "warmup", 1)
    _check_float(opts, "label_smoothing", 0.0, 1.0)
    _check_float(opts, "clip_norm", 0.0, note=" (0 disables clipping)")
    betas = opts.adam_betas
    if (
        not isinstance(betas, (tuple, list))
        or len(betas) != 2
        or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0 for b in betas)
    ):
        raise TrainingUsageError(f"adam_betas must be two numbers in [0, 1), got {betas!r}")
    _check_float(opts, "adam_eps", 0.0, low_open=True)
    _check_int(opts, "eval_every", 0, note=" (0: validate only at the end)")
    _check_int(opts, "eval_examples", 0)
    _check_int(opts, "log_every", 0)
    _check_int(opts, "final_beam", 0, SIZE_LIMITS["final_beam"], note=" (0 or 1: greedy only)")
    check_text_options(opts)


def check_text_options(opts: TrainOptions) -> None:
    """The options of parallel-text training, mixed precision, schedules and checkpoint selection."""
    for name in ("train_files", "valid_files", "test_files"):
        value = getattr(opts, name)
        if value is not None and (
            not isinstance(value, (tuple, list))
            or len(value) != 2
            or not all(isinstance(v, (str, os.PathLike)) and os.fspath(v) for v in value)
        ):
            raise TrainingUsageError(
                f"{_option(name)} takes two file paths, SOURCE_FILE TARGET_FILE, got {value!r}"
            )
    for name in ("train_tsv", "valid_tsv"):
        value = getattr(opts, name)
        if value is not None and (not isinstance(value, (str, os.PathLike)) or not os.fspath(value)):
            raise TrainingUsageError(f"{_option(name)} must be a file path, got {value!r}")
    if opts.train_files is not None and opts.train_tsv is not None:
        raise TrainingUsageError("give the training data once: --train SRC TGT or --train-tsv FILE, not both")
    if opts.valid_files is not None and opts.valid_tsv is not None:
        raise TrainingUsageError(
            "give the validation data once: --valid SRC TGT or --valid-tsv FILE, not both"
        )
    has_train = is_text_run(opts)
    has_valid = opts.valid_files is not None or opts.valid_tsv is not None
    if has_train and not has_valid:
        raise TrainingUsageError(
            "--train needs a validation set: --valid SRC_FILE TGT_FILE or --valid-tsv FILE"
        )
    if opts.test_files is not None and not has_train:
        raise TrainingUsageError(
            "--test is given without --train (the demo task scores its own held-out split at the end)"
        )
    if has_valid and not has_train:
        raise TrainingUsageError(
            "--valid is given without --train (the demo task has its own validation split)"
        )
    if opts.tokenizer is not None and opts.tokenizer not in TOKENIZERS:
        raise TrainingUsageError(
            f"--tokenizer must be one of {', '.join(TOKENIZERS)}, got {opts.tokenizer!r}"
        )
    if opts.tokenizer == "sentencepiece" and not has_train:
        raise TrainingUsageError(
            "--tokenizer sentencepiece needs parallel text (--train / --valid); the demo task uses "
            "the character tokenizer"
        )
    _check_int(
        opts,
        "vocab_size",
        8,
        SIZE_LIMITS["vocab_size"],
        note=" (SentencePiece pieces, the 4 special tokens included)",
    )
    if opts.spm_model_type not in ("unigram", "bpe"):
        raise TrainingUsageError(f"--spm-model-type must be unigram or bpe, got {opts.spm_model_type!r}")
    _check_float(opts, "max_len_ratio", 1.0, optional=True, note=" (longer side / shorter side, in tokens)")
    if opts.lr_schedule not in ("noam", "inverse-sqrt"):
        raise TrainingUsageError(f"--lr-schedule must be noam or inverse-sqrt, got {opts.lr_schedule!r}")
    _check_float(opts, "lr", 0.0, low_open=True, optional=True)
    if opts.lr_schedule == "inverse-sqrt" and opts.lr is None:
        raise TrainingUsageError("--lr-schedule inverse-sqrt needs --lr (the peak learning rate, e.g. 5e-4)")
    if opts.lr_schedule == "noam" and opts.lr is not None:
        raise TrainingUsageError(
            "--lr is the peak of --lr-schedule inverse-sqrt; the noam schedule is scaled by --lr-factor"
        )
    _check_int(opts, "update_freq", 1, 4096)
    if opts.amp is not None:
        if opts.amp not in AMP_DTYPES:
            raise TrainingUsageError(f"--amp must be bf16 or fp16, got {opts.amp!r}")
        if not (isinstance(opts.device, str) and opts.device.startswith("cuda")):
            _check_cpu_amp(opts.amp)
    if opts.best_metric is not None and opts.best_metric not in BEST_METRICS:
        raise TrainingUsageError(
            f"--best-metric must be one of {', '.join(BEST_METRICS)}, got {opts.best_metric!r}"
        )
    _check_int(opts, "patience", 1, optional=True, note=" (validations without a new best before stopping)")
    _check_int(opts, "keep_last", 0)
    check_init_from(opts)


# What --init-from takes from its model folder: these options may not be given with it.
_INIT_FROM_DEFINES = ("preset", "shared_vocab", "tokenizer", "vocab_size", "spm_model_type")


def init_from_conflicts(given) -> list[str]:
    """The flags among the option names ``given`` on a command line that ``--init-from`` excludes
    (its model folder defines the architecture and the tokenizer), in the order they are defined."""
    return [_option(n) for n in (*MODEL_FLAGS, *_INIT_FROM_DEFINES) if n in given]


def check_init_from(opts: TrainOptions) -> None:
    """``--init-from MODEL_DIR``: a model folder, parallel text, and no architecture or tokenizer
    option (the model folder defines them; each one given is named)."""
    if opts.init_from is None:
        return
    if not isinstance(opts.init_from, (str, os.PathLike)) or not os.fspath(opts.init_from):
        raise TrainingError(f"--init-from must be a model folder, got {opts.init_from!r}")
    if not is_text_run(opts) and not opts.resume:  # a resumed run takes its data from the run
        raise TrainingError(
            "--init-from fine-tunes on parallel text: give --train SRC TGT and --valid SRC TGT"
        )
    defaults = TrainOptions()
    given = [name for name in MODEL_FLAGS if getattr(opts, name) is not None]
    given += [name for name in _INIT_FROM_DEFINES if getattr(opts, name) != getattr(defaults, name)]
    if given:
        raise TrainingError(
            f"--init-from {opts.init_from} takes the architecture and tokenizer from that model folder; "
            f"drop {', '.join(_option(n) for n in given)}"
        )


def _check_cpu_amp(amp: str) -> None:
    """``--amp`` on the CPU: bf16 where the CPU has native bfloat16 matrix products
    (:func:`transformer_ext.cpu_features.bf16_support`), never fp16; the one-line refusal names the
    missing instructions and the rate measured on this machine."""
    from .. import cpu_features

    if amp == "fp16":
        raise TrainingError(
            str(
                cpu_features.refuse_cpu_float16(
                    "--amp fp16",
                    "on the CPU use --amp bf16 where bfloat16 is native, else float32 (no --amp)",
                )
            )
        )
    try:
        cpu_features.require_native_bf16(
            "--amp bf16", "train in float32 (no --amp), or on CUDA (--device cuda)"
        )
    except cpu_features.NotNativeError as exc:
        raise TrainingError(str(exc)) from None


def parse_device(name: str) -> torch.device:
    """``--device``: the package's one device parser (:func:`transformer_ext.devices.parse_device`),
    its errors raised as the training errors they are (a bad name is a usage error, exit 2)."""
    from ..cli import UsageError
    from ..devices import DeviceError
    from ..devices import parse_device as _parse_device

    try:
        return _parse_device(name, "--device")
    except DeviceError as exc:
        kind = TrainingUsageError if isinstance(exc, UsageError) else TrainingError
        raise kind(str(exc)) from None


def is_text_run(opts: TrainOptions) -> bool:
    """Parallel text (``--train``/``--train-tsv``) rather than the demo task."""
    return opts.train_files is not None or opts.train_tsv is not None


# The model fields a flag may set (None: the preset's value).
MODEL_FLAGS = (
    "d_model",
    "n_heads",
    "n_encoder_layers",
    "n_decoder_layers",
    "d_ff",
    "dropout",
    "max_len",
    "norm_first",
)


def build_config(opts: TrainOptions, tokenizer) -> TransformerConfig:
    """The model config of ``opts.preset`` with the flags' overrides and the tokenizer's vocabularies."""
    if opts.preset not in PRESETS:
        raise TrainingUsageError(f"unknown preset {opts.preset!r}; choose one of {sorted(PRESETS)}")
    overrides = {name: getattr(opts, name) for name in MODEL_FLAGS if getattr(opts, name) is not None}
    overrides.update(
        src_vocab_size=tokenizer.src_vocab_size,
        tgt_vocab_size=tokenizer.tgt_vocab_size,
        shared_vocab=bool(opts.shared_vocab),
        tie_target_embeddings=True,
        pad_id=tokenizer.pad_id,
        bos_id=tokenizer.bos_id,
        eos_id=tokenizer.eos_id,
    )
    try:
        return TransformerConfig.preset(opts.preset, **overrides)
    except (TypeError, ValueError) as exc:
        raise TrainingUsageError(f"invalid model options: {exc}") from exc
