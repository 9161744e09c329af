"""The options of a training run: :class:`TrainOptions`, every check of them, the model config they make.

Every option is checked here before anything touches the disk (:func:`check_options`); the
error names the command-line flag and the field. The model sizes come from the presets of
:data:`transformer_ext.config.PRESETS` ("demo" is the bundled translator's), with the flags'
overrides and the tokenizer's vocabularies (:func:`build_config`). On ``--resume`` the
run-defining options (:data:`RUN_DEFINING`) come from the saved run (:func:`merge_resume_options`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

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


@dataclass
class TrainOptions:
    """Every option of a training run (the command line's flags, one to one)."""

    out_dir: str = "out/demo"  # where best/, last/, run.json, train_options.json and summary.json go
    resume: bool = False  # continue from <out_dir>/last/ (run-defining options come from the saved run)
    overwrite: bool = False  # start afresh even if <out_dir> already holds a run
    export_dir: Optional[str] = None  # at the end, copy the best model directory here
    seed: int = 1  # model initialisation, dropout and batch order
    device: str = "cpu"  # "cpu" or "cuda"
    threads: Optional[int] = None  # torch.set_num_threads; None keeps torch's default
    # model
    preset: str = "demo"  # one of transformer_ext.config.PRESETS
    d_model: Optional[int] = None
    n_heads: Optional[int] = None
    n_encoder_layers: Optional[int] = None
    n_decoder_layers: Optional[int] = None
    d_ff: Optional[int] = None
    dropout: Optional[float] = None
    max_len: Optional[int] = None
    norm_first: Optional[bool] = None
    shared_vocab: bool = False  # one character vocabulary for source and target, all embeddings tied
    # fine-tuning: start from this model folder (weights, architecture and tokenizer; e.g. a
    # checkpoint converted by python -m transformer_ext.convert); needs parallel text
    init_from: Optional[str] = None
    # data: the demo task (default), or parallel text (train_files / train_tsv with a validation set)
    train_files: Optional[tuple[str, str]] = None  # (source file, target file), line-aligned UTF-8
    valid_files: Optional[tuple[str, str]] = None
    train_tsv: Optional[str] = None  # source<TAB>target lines
    valid_tsv: Optional[str] = None
    # "char" or "sentencepiece"; None: char for the demo, sentencepiece for text
    tokenizer: Optional[str] = None
    vocab_size: int = 8000  # SentencePiece pieces per model (specials included)
    spm_model_type: str = "unigram"  # "unigram" or "bpe"
    # drop pairs whose longer side has more than ratio x the shorter's tokens
    max_len_ratio: Optional[float] = None
    range_low: int = DEMO_RANGE[0]
    range_high: int = DEMO_RANGE[1]
    split_seed: int = SPLIT_SEED
    max_tokens: int = 3000  # padded tokens per batch (about 80 examples of the demo task)
    # (below, times): training numbers < below are repeated `times` per epoch (first rule that matches)
    oversample: tuple[tuple[int, int], ...] = DEMO_OVERSAMPLE
    # optimisation
    max_steps: Optional[int] = 2500  # stop after this many optimiser steps (None: use epochs)
    epochs: Optional[int] = None  # stop after this many epochs (when max_steps is None)
    max_minutes: Optional[float] = None  # stop when this much training time has passed
    lr_factor: float = 0.3  # demo: peak lr 0.3 * 64^-0.5 * 200^-0.5 = 2.7e-3 at step 200, 7.5e-4 at 2500
    warmup: int = 200
    label_smoothing: float = 0.1
    clip_norm: float = 1.0  # max gradient norm; 0 disables clipping
    lr_schedule: str = "noam"  # "noam" (the paper's, --lr-factor) or "inverse-sqrt" (fairseq's, peak --lr)
    lr: Optional[float] = None  # peak learning rate of inverse-sqrt (reached after --warmup steps)
    update_freq: int = 1  # batches whose gradients are accumulated into one optimiser step
    amp: Optional[str] = (
        None  # "bf16"/"fp16" autocast on CUDA (fp16 with a GradScaler); CPU: bf16 where native
    )
    adam_betas: tuple[float, float] = (0.9, 0.98)
    adam_eps: float = 1e-9
    # validation and logging
    eval_every: int = 250  # steps between validations (and checkpoints); 0: only at the end
    eval_examples: int = 500  # validation sources decoded greedily for exact match (demo: all of them)
    final_eval: bool = True  # evaluate the best model on the held-out split at the end
    final_beam: int = 4  # beam size of the final held-out evaluation (0 or 1: greedy only)
    best_metric: Optional[str] = None  # "bleu", "chrf", "loss" or "exact"; None: exact (demo) / bleu (text)
    patience: Optional[int] = None  # stop after this many validations without a new best (None: never)
    keep_last: int = 0  # also keep the model of the last K validations in <out>/checkpoints/step-N/
    log_every: int = 100  # steps between log lines
    progress: bool = True  # a progress bar on a terminal, a log line a minute otherwise
    tensorboard: Optional[str] = None  # a folder for TensorBoard scalars (losses, lr, validation)
    # parallel text: a held-out test set, scored with the best checkpoint at the end (as evaluate does)
    test_files: Optional[tuple[str, str]] = None


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
            "(another --out, or --overwrite)"
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
    "out_dir": "--out",
    "export_dir": "--export",
    "seed": "--seed",
    "device": "--device",
    "threads": "--threads",
    "preset": "--preset",
    "d_model": "--d-model",
    "n_heads": "--n-heads",
    "n_encoder_layers": "--encoder-layers",
    "n_decoder_layers": "--decoder-layers",
    "d_ff": "--d-ff",
    "dropout": "--dropout",
    "max_len": "--max-len",
    "norm_first": "--pre-ln",
    "shared_vocab": "--shared-vocab",
    "init_from": "--init-from",
    "range_low": "--range LOW",
    "range_high": "--range HIGH",
    "split_seed": "--split-seed",
    "max_tokens": "--max-tokens",
    "oversample": "--oversample",
    "max_steps": "--max-steps",
    "epochs": "--epochs",
    "max_minutes": "--max-minutes",
    "lr_factor": "--lr-factor",
    "warmup": "--warmup",
    "label_smoothing": "--label-smoothing",
    "clip_norm": "--clip-norm",
    "eval_every": "--eval-every",
    "eval_examples": "--eval-examples",
    "final_eval": "--no-final-eval",
    "final_beam": "--final-beam",
    "log_every": "--log-every",
    "progress": "--no-progress",
    "resume": "--resume",
    "overwrite": "--overwrite",
    "train_files": "--train",
    "valid_files": "--valid",
    "train_tsv": "--train-tsv",
    "valid_tsv": "--valid-tsv",
    "tokenizer": "--tokenizer",
    "vocab_size": "--vocab-size",
    "spm_model_type": "--spm-model-type",
    "max_len_ratio": "--max-len-ratio",
    "lr_schedule": "--lr-schedule",
    "lr": "--lr",
    "update_freq": "--update-freq",
    "amp": "--amp",
    "best_metric": "--best-metric",
    "patience": "--patience",
    "keep_last": "--keep-last",
    "tensorboard": "--tensorboard",
    "test_files": "--test",
}
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
