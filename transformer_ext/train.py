"""Train a Transformer on the demo task (English to German number words), the paper's way.

``python -m transformer_ext.train`` trains the bundled demo model; ``--help`` explains every
option. The command line is a thin layer over :func:`train`, which tests call directly.

What a training run does:

* **Data**: :mod:`transformer_ext.data` (num2words, a deterministic train / valid / held-out
  split, batches of at most ``max_tokens`` padded tokens, bucketed by length, shuffled every
  epoch with a seeded generator). The character tokenizer is built from the training split.
* **Objective**: teacher forcing (the decoder reads ``[bos] + y`` and predicts ``y + [eos]``),
  cross-entropy with label smoothing, padding ignored, summed and divided by the number of
  non-pad target tokens of the batch.
* **Optimiser**: Adam (betas 0.9/0.98, eps 1e-9) with the warmup schedule
  ``lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)`` (steps counted from 1),
  gradient-norm clipping.
* **Validation** every ``eval_every`` steps: loss over the validation split and exact match of
  greedy decoding on a fixed subset of it; the best checkpoint (by exact match, then loss) is
  kept in ``<out>/best/``, the latest in ``<out>/last/``.
* **Checkpoints** follow docs/DESIGN.md section 5: ``config.json`` + ``model.safetensors`` +
  ``tokenizer.json``. ``<out>/last/`` also holds the training state for ``--resume``:
  optimiser tensors and RNG states in ``training_state.safetensors``, everything else
  (step, epoch, position in the epoch, scheduler, history) in ``training_state.json``.
  No pickle anywhere. Resuming continues exactly where the run stopped: on the CPU the
  losses after a resume equal those of an uninterrupted run.
* **Determinism**: the model is initialised after ``torch.manual_seed(seed)``, dropout draws
  from torch's global generator (saved and restored on resume), the batch order from a
  generator seeded with ``seed + epoch``. On the CPU with a fixed thread count, the same
  options give bit-identical losses.
* **Multi-process**: under ``torchrun`` the same function trains with DistributedDataParallel
  (:mod:`transformer_ext.distributed`: sharded batches, the loss normalised by the target
  tokens of all ranks, rank 0 validates and writes). Without the torchrun environment
  nothing of it runs.
* **The run folder** ``<out>`` holds ``run.json`` (a format marker), ``train_options.json``,
  ``summary.json``, ``best/`` and ``last/``. Only a folder with that marker, or one of the
  version before it recognised by its exact file set, is resumed or (``--overwrite``) replaced;
  any other non-empty folder is refused. Every option, the data split and the model config are
  checked before anything is written. A new run is built in a temporary sibling of ``<out>``
  and takes its place when its first checkpoint is complete: an old run is moved aside and
  deleted only then, so a run that fails or is interrupted before that leaves ``<out>`` as it
  was. Checkpoints and JSON files are written atomically (:mod:`transformer_ext.fsutil`): a
  full disk, Ctrl-C or SIGTERM keep the previous checkpoint and leave no temporary files.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from . import __version__, distributed
from .cli import UserError, add_debug_flag, run_cli
from .data import (
    DEMO_OVERSAMPLE,
    DEMO_RANGE,
    SPLIT_SEED,
    Example,
    TokenBatchSampler,
    collate,
    encode_examples,
    example_cost,
    make_examples,
    oversample,
    split_numbers,
)
from .fsutil import StagedDir, atomic_write_bytes, atomic_write_json
from .tokenizer import TOKENIZER_FILE, CharTokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "MODEL_PRESETS",
    "TrainOptions",
    "TrainResult",
    "TrainingError",
    "TrainingDiverged",
    "noam_lr",
    "token_loss",
    "make_optimizer",
    "make_scheduler",
    "build_config",
    "evaluate",
    "train",
    "build_parser",
    "main",
]

# Model presets of the training command: name -> (config preset, overrides). "demo" is the
# bundled translator: Post-LN as in the paper, 3+3 layers, small enough to train on one CPU
# core in minutes. No dropout: the task is noise-free, every training example is exact, and on
# the CPU dropout's random numbers cost a quarter to a third of a training step.
MODEL_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "demo": (
        "base",
        dict(
            d_model=64,
            n_heads=4,
            n_encoder_layers=3,
            n_decoder_layers=3,
            d_ff=256,
            dropout=0.0,
            max_len=64,
            norm_first=False,
        ),
    ),
    "tiny": ("tiny", {}),
    "small": ("small", {}),
    "base": ("base", {}),
}

STATE_JSON = "training_state.json"
STATE_TENSORS = "training_state.safetensors"
OPTIONS_JSON = "train_options.json"
SUMMARY_JSON = "summary.json"
MODEL_FILES = ("config.json", "model.safetensors", TOKENIZER_FILE)
PROVENANCE_FILE = "provenance.json"  # where the corpus came from (corpus, editions, licence, split)
CHECKPOINTS_DIR = "checkpoints"  # <out>/checkpoints/step-N/: the models of the last --keep-last validations
BEST_METRICS = ("bleu", "chrf", "loss", "exact")
TOKENIZERS = ("char", "sentencepiece")
AMP_DTYPES = ("bf16", "fp16")


class TrainingError(UserError, ValueError):
    """Bad training options, a run folder that cannot be used as asked, or saved files that cannot be resumed."""


class TrainingDiverged(TrainingError, FloatingPointError):
    """The training loss became NaN or infinite (the options, typically the learning rate, do not work)."""


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
    preset: str = "demo"  # one of MODEL_PRESETS
    d_model: Optional[int] = None
    n_heads: Optional[int] = None
    n_encoder_layers: Optional[int] = None
    n_decoder_layers: Optional[int] = None
    d_ff: Optional[int] = None
    dropout: Optional[float] = None
    max_len: Optional[int] = None
    norm_first: Optional[bool] = None
    shared_vocab: bool = False  # one character vocabulary for source and target, all embeddings tied
    # data: the demo task (default), or parallel text (train_files / train_tsv with a validation set)
    train_files: Optional[tuple[str, str]] = None  # (source file, target file), line-aligned UTF-8
    valid_files: Optional[tuple[str, str]] = None
    train_tsv: Optional[str] = None  # source<TAB>target lines
    valid_tsv: Optional[str] = None
    tokenizer: Optional[str] = (
        None  # "char" or "sentencepiece"; None: char for the demo, sentencepiece for text
    )
    vocab_size: int = 8000  # SentencePiece pieces per model (specials included)
    spm_model_type: str = "unigram"  # "unigram" or "bpe"
    max_len_ratio: Optional[float] = (
        None  # drop pairs whose longer side has more than ratio x the shorter's tokens
    )
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
    amp: Optional[str] = None  # "bf16" or "fp16" autocast on CUDA (fp16 with a GradScaler); CPU: float32 only
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
    progress: bool = True  # tqdm progress bar


# Options that define a run: on --resume they are taken from the saved run.
_RUN_DEFINING = (
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
)


@dataclass
class TrainResult:
    """What :func:`train` returns."""

    out_dir: str
    config: dict
    step: int  # optimiser steps done in total (all sessions)
    first_step: int  # step number of losses[0] (1 for a fresh run)
    epoch: int  # epochs completed
    losses: list[float]  # training loss of every step of this session
    learning_rates: list[float]  # learning rate used at every step of this session
    history: list[dict]  # every validation of the run (all sessions)
    best: Optional[dict]  # the validation that selected <out>/best/
    heldout: Optional[dict]  # final held-out evaluation of the best model
    elapsed_s: float  # training wall time of this session
    total_elapsed_s: float  # training wall time of all sessions
    stop_reason: str
    world_size: int = 1  # processes that trained together (torchrun's WORLD_SIZE)
    model: Any = field(
        default=None, repr=False, compare=False
    )  # the trained model in memory (this rank's copy)


# ---------------------------------------------------------------------- schedule and optimiser
def noam_lr(step: int, d_model: int, warmup: int, factor: float = 1.0) -> float:
    """``factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)``; steps start at 1."""
    if step < 1:
        raise ValueError(f"the schedule counts steps from 1, got step={step}")
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1, got {warmup}")
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def make_optimizer(model: torch.nn.Module, opts: TrainOptions) -> torch.optim.Adam:
    """Adam with base lr 1.0 (the scheduler's factor is the learning rate itself), fused kernel."""
    return torch.optim.Adam(
        model.parameters(), lr=1.0, betas=tuple(opts.adam_betas), eps=opts.adam_eps, fused=True
    )


def inverse_sqrt_lr(step: int, warmup: int, peak: float) -> float:
    """fairseq's inverse_sqrt: ``peak * step / warmup`` up to ``warmup``, then ``peak * sqrt(warmup / step)``."""
    if step < 1:
        raise ValueError(f"the schedule counts steps from 1, got step={step}")
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1, got {warmup}")
    return peak * min(step / warmup, math.sqrt(warmup / step))


def make_scheduler(
    optimizer,
    d_model: int,
    warmup: int,
    factor: float,
    schedule: str = "noam",
    peak_lr: Optional[float] = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR of :func:`noam_lr` (or :func:`inverse_sqrt_lr` with ``peak_lr``); its internal counter
    starts at 0, the schedule's step at 1."""
    if schedule == "inverse-sqrt":
        if peak_lr is None:
            raise TrainingError("--lr-schedule inverse-sqrt needs --lr (the peak learning rate)")
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda=lambda s: inverse_sqrt_lr(s + 1, warmup, peak_lr)
        )
    if schedule != "noam":
        raise TrainingError(f"--lr-schedule must be noam or inverse-sqrt, got {schedule!r}")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda=lambda s: noam_lr(s + 1, d_model, warmup, factor)
    )


# ---------------------------------------------------------------------- model config
def build_config(opts: TrainOptions, tokenizer: CharTokenizer):
    """The model config of ``opts.preset`` with the flags' overrides and the tokenizer's vocabularies."""
    from .config import TransformerConfig

    if opts.preset not in MODEL_PRESETS:
        raise TrainingError(f"unknown preset {opts.preset!r}; choose one of {sorted(MODEL_PRESETS)}")
    base, overrides = MODEL_PRESETS[opts.preset]
    overrides = dict(overrides)
    for name in (
        "d_model",
        "n_heads",
        "n_encoder_layers",
        "n_decoder_layers",
        "d_ff",
        "dropout",
        "max_len",
        "norm_first",
    ):
        value = getattr(opts, name)
        if value is not None:
            overrides[name] = value
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
        return TransformerConfig.preset(base, **overrides)
    except (TypeError, ValueError) as exc:
        raise TrainingError(f"invalid model options: {exc}") from exc


# ---------------------------------------------------------------------- loss and evaluation
def accumulate_gradients_of(
    model, micro: Sequence, *, pad_id: int, label_smoothing: float, ctx=None, scaler=None, autocast_dtype=None
) -> tuple[float, int]:
    """Back-propagate the loss of one optimiser step made of the batches ``micro``.

    The loss is summed over every target token of all the batches and divided by their number,
    so N batches give the gradient of one N-times larger batch (``--update-freq``). Under
    torchrun (``ctx``) the count is that of all ranks, and DDP synchronises the gradients only
    at the last batch. Returns (loss per target token, target tokens), over all ranks.
    """
    ctx = ctx or distributed.Context(torch.device("cpu"))
    local_tokens = sum(b.n_target_tokens(pad_id) for b in micro)
    loss_value, n_tokens = 0.0, 0
    for k, batch in enumerate(micro):
        sync = k == len(micro) - 1 or not hasattr(model, "no_sync")
        with contextlib.nullcontext() if sync else model.no_sync():
            with (
                torch.autocast(batch.src_ids.device.type, dtype=autocast_dtype)
                if autocast_dtype is not None
                else contextlib.nullcontext()
            ):
                logits = model(batch.src_ids, batch.src_lengths, batch.tgt_in)
            loss, n = token_loss(logits, batch.tgt_out, pad_id, label_smoothing)
            # under torchrun: loss summed over this rank / target tokens of all ranks (x world_size, as DDP
            # averages); the value and the count returned are then the global batch's
            loss, value, n_tokens = ctx.reduce_loss(loss * (n / max(local_tokens, 1)), local_tokens)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_value += value
    return loss_value, n_tokens


def token_loss(logits: torch.Tensor, tgt_out: torch.Tensor, pad_id: int, label_smoothing: float):
    """(loss per non-pad target token, number of non-pad target tokens)."""
    V = logits.shape[-1]
    total = F.cross_entropy(
        logits.reshape(-1, V).float(),
        tgt_out.reshape(-1),
        ignore_index=pad_id,
        label_smoothing=label_smoothing,
        reduction="sum",
    )
    n_tokens = int((tgt_out != pad_id).sum())
    return total / max(n_tokens, 1), n_tokens


@torch.no_grad()
def evaluate(
    model,
    tokenizer: CharTokenizer,
    examples: Sequence[Example],
    *,
    device,
    max_tokens: int = 4000,
    label_smoothing: float = 0.0,
    exact_examples: Optional[int] = None,
    beam_size: int = 1,
    with_loss: bool = True,
    pairs=None,
    bleu: bool = False,
) -> dict:
    """Loss and exact match of ``model`` on ``examples``.

    Returns ``{"loss", "nll", "exact_match", "n_exact", "n_loss"}``: ``loss`` is the
    label-smoothed training objective, ``nll`` the plain cross-entropy (both per target token,
    over all examples); ``exact_match`` is the fraction of ``exact_examples``
    examples, evenly spread over them (all when None), whose decoded translation equals
    the reference exactly. ``pairs``: the examples' token ids when already encoded (parallel
    text). ``bleu``: also ``bleu``, ``chrf`` and their sacrebleu signatures over the same decoded
    examples (detokenized hypotheses against the raw reference texts).
    """
    from .translate import Translator

    was_training = model.training
    model.eval()
    result: dict[str, Any] = {}
    try:
        if with_loss:
            if pairs is None:
                pairs = encode_examples(tokenizer, examples)
            sampler = TokenBatchSampler(
                [example_cost(len(s), len(t)) for s, t in pairs], max_tokens, shuffle=False
            )
            ls_sum = nll_sum = 0.0
            n_tok = 0
            for idx in sampler.batches(0):
                batch = collate(
                    [pairs[i] for i in idx],
                    pad_id=tokenizer.pad_id,
                    bos_id=tokenizer.bos_id,
                    eos_id=tokenizer.eos_id,
                ).to(device)
                logits = model(batch.src_ids, batch.src_lengths, batch.tgt_in)
                ls, n = token_loss(logits, batch.tgt_out, tokenizer.pad_id, label_smoothing)
                nll, _ = token_loss(logits, batch.tgt_out, tokenizer.pad_id, 0.0)
                ls_sum += float(ls) * n
                nll_sum += float(nll) * n
                n_tok += n
            result.update(loss=ls_sum / n_tok, nll=nll_sum / n_tok, n_loss=len(examples))
        if exact_examples is None or exact_examples >= len(examples):
            subset = list(examples)
        else:  # evenly spread over the (sorted) examples, not just the smallest numbers
            subset = [examples[i * len(examples) // exact_examples] for i in range(exact_examples)]
        if subset:
            translator = Translator.from_model(model, tokenizer, device)
            outputs = translator.translate([ex.source for ex in subset], beam_size=beam_size, n_best=1)
            correct = sum(out.text == ex.target for out, ex in zip(outputs, subset))
            if bleu:
                from .evaluate import score_texts

                scores = score_texts([out.text for out in outputs], [ex.target for ex in subset])
                result.update(
                    bleu=scores["bleu"],
                    chrf=scores["chrf"],
                    bleu_signature=scores["bleu_signature"],
                    chrf_signature=scores["chrf_signature"],
                )
            result.update(
                exact_match=correct / len(subset),
                n_exact=len(subset),
                errors=[
                    (ex.source, out.text, ex.target)
                    for out, ex in zip(outputs, subset)
                    if out.text != ex.target
                ][:20],
            )
    finally:
        if was_training:
            model.train()
    return result


# ---------------------------------------------------------------------- the run folder
# <out>/run.json marks a folder as a training run of this program: only such a folder (or one
# written before the marker existed, recognised by its exact file set) is resumed or replaced.
RUN_MARKER = "run.json"
RUN_FORMAT = "transformer_ext.train-run"
RUN_FORMAT_VERSION = 1
_RUN_ENTRIES = frozenset({RUN_MARKER, OPTIONS_JSON, SUMMARY_JSON, "best", "last", "checkpoints"})
# What a run folder of the version before run.json could hold: its files, and the temporaries of
# its own writers (`best.tmp`, `last.old`, `summary.json.tmp`, ...).
_UNMARKED_RUN_ENTRIES = frozenset(
    {OPTIONS_JSON, SUMMARY_JSON, "best", "last"}
    | {f"{name}.{kind}" for name in ("best", "last") for kind in ("tmp", "old")}
    | {f"{name}.tmp" for name in (OPTIONS_JSON, SUMMARY_JSON)}
)
# A temporary or backup of transformer_ext.fsutil: `.{name}.tmp-{host}-{pid}-{hex}` / `.old-`.
_FSUTIL_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(tmp|old)-[A-Za-z0-9_.]+-\d+-[0-9a-f]{8}$")


@dataclass(frozen=True)
class _RunFolder:
    """What ``--out`` holds: ``kind`` is "absent", "empty", "run" (this program's) or "foreign"."""

    path: Path
    kind: str
    marked: bool = False  # a run with run.json (False: a run of the version before the marker)
    others: tuple[str, ...] = ()  # entries this program did not write
    reason: str = ""  # why a non-empty folder is not a run of this program


def _ours(name: str, known: frozenset) -> bool:
    m = _FSUTIL_TEMPORARY.match(name)
    return name in known or (m is not None and m.group("name") in known)


def _inspect_out(out: Path) -> _RunFolder:
    """Classify ``out`` without writing anything (errors for a path that cannot be a run folder)."""
    if not out.exists():
        if out.is_symlink():
            raise TrainingError(
                f"--out {out} is a symbolic link to nothing; remove it or choose another folder"
            )
        return _RunFolder(out, "absent")
    if not out.is_dir():
        raise TrainingError(f"--out {out} is a file, not a folder; give the path of a folder for the run")
    entries = sorted(os.listdir(out))
    if not entries:
        return _RunFolder(out, "empty")
    if RUN_MARKER in entries:
        marker = out / RUN_MARKER
        try:
            data = json.loads(marker.read_bytes().decode("utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            return _RunFolder(
                out, "foreign", reason=f"its {RUN_MARKER} is not a run marker of this program ({exc})"
            )
        if not isinstance(data, dict) or data.get("format") != RUN_FORMAT:
            return _RunFolder(out, "foreign", reason=f"its {RUN_MARKER} is not a run marker of this program")
        version = data.get("format_version")
        if version != RUN_FORMAT_VERSION:
            raise TrainingError(
                f"{marker}: run format_version {version!r}; this version of transformer_ext "
                f"reads {RUN_FORMAT_VERSION} (was the run written by a newer version?)"
            )
        others = tuple(e for e in entries if not _ours(e, _RUN_ENTRIES))
        return _RunFolder(out, "run", marked=True, others=others)
    others = tuple(e for e in entries if not _ours(e, _UNMARKED_RUN_ENTRIES))
    if others or not {OPTIONS_JSON, "last", "best"} & set(entries):
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        return _RunFolder(out, "foreign", reason=f"it has no {RUN_MARKER} and holds {shown or 'other files'}")
    return _RunFolder(out, "run", marked=False)


def _marker() -> dict:
    return dict(
        format=RUN_FORMAT, format_version=RUN_FORMAT_VERSION, producer=f"transformer_ext {__version__}"
    )


def _commit_run(stage: StagedDir, folder: _RunFolder) -> None:
    """Put the staged run folder in place of ``--out`` (the moment an old run is replaced).

    ``--out`` is inspected again first: what it holds now must still be what was checked at the
    start (nothing, an empty folder, or a run of this program that may be replaced).
    """
    target = stage.target
    now = _inspect_out(target)
    if now.kind == "absent":
        os.rename(stage.path, target)
        stage.committed = True
    elif now.kind == "empty":
        # The user's empty folder is kept (its permissions, a mount point): the entries move into it.
        for entry in sorted(os.listdir(stage.path), key=lambda name: name == RUN_MARKER):  # the marker last
            os.rename(stage.path / entry, target / entry)
        os.rmdir(stage.path)
        stage.committed = True
    elif now.kind == "run" and folder.kind == "run" and not now.others:
        stage.commit()  # the old run is moved aside, the new one renamed in, then the old one deleted
    else:
        raise TrainingError(
            f"--out {folder.path} changed while the new run was training (it now holds "
            f"{', '.join(sorted(os.listdir(target))[:5])}); it was left as it is and the new run "
            "was not put in place"
        )
    logger.info(
        "the run folder %s is in place%s", target, " (the old run was replaced)" if now.kind == "run" else ""
    )


# ---------------------------------------------------------------------- checkpoints and state
def _save_model_dir(model, tokenizer, directory: Path, provenance: Optional[bytes] = None) -> None:
    from .checkpoint import save_model

    save_model(model, directory)
    tokenizer.save(directory)
    if provenance is not None:
        atomic_write_bytes(directory / PROVENANCE_FILE, provenance)


def _save_step_checkpoint(
    run_dir: Path, step: int, model, tokenizer, keep: int, provenance: Optional[bytes] = None
) -> None:
    """``<run_dir>/checkpoints/step-N/`` (a model folder), keeping the ``keep`` newest step folders."""
    folder = run_dir / CHECKPOINTS_DIR
    folder.mkdir(exist_ok=True)
    _save_checkpoint(folder, f"step-{step}", model, tokenizer, provenance=provenance)
    for old in step_checkpoints(folder)[:-keep]:
        shutil.rmtree(old)
        logger.info("removed %s (--keep-last %d)", old, keep)


def step_checkpoints(folder: Path) -> list[Path]:
    """The ``step-N`` model folders this program wrote in ``folder``, oldest (smallest N) first."""
    found = []
    if folder.is_dir():
        for entry in folder.iterdir():
            m = re.fullmatch(r"step-(\d+)", entry.name)
            if m and entry.is_dir() and (entry / "config.json").is_file():
                found.append((int(m.group(1)), entry))
    return [p for _, p in sorted(found)]


def _optimizer_to_flat(optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, st in sd["state"].items():
        for key, value in st.items():
            if torch.is_tensor(value):
                tensors[f"optimizer.{pid}.{key}"] = value.detach().to("cpu").contiguous()
            else:
                scalars.setdefault(str(pid), {})[key] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_from_flat(optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        if not name.startswith("optimizer."):
            continue
        _, pid, key = name.split(".", 2)
        pid = int(pid)
        if not 0 <= pid < len(params):
            raise ValueError(f"tensor {name}: the model has {len(params)} parameters")
        if key in ("exp_avg", "exp_avg_sq") and tuple(value.shape) != tuple(params[pid].shape):
            raise ValueError(
                f"tensor {name} has shape {tuple(value.shape)}, its parameter {tuple(params[pid].shape)}"
            )
        state.setdefault(pid, {})[key] = value
    for pid, extra in meta.get("scalars", {}).items():
        state.setdefault(int(pid), {}).update(extra)
    groups = []
    for g in meta["param_groups"]:
        g = dict(g)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def _save_checkpoint(
    run_dir: Path,
    name: str,
    model,
    tokenizer,
    optimizer=None,
    scheduler=None,
    state: Optional[dict] = None,
    provenance: Optional[bytes] = None,
) -> Path:
    """Write ``<run_dir>/<name>/`` (model directory, plus the training state when given).

    Built in a temporary sibling and swapped in (:class:`~transformer_ext.fsutil.StagedDir`):
    the previous checkpoint stays until the new one is complete, and an interruption or a full
    disk leaves the previous one and no temporary folder.
    """
    from safetensors.torch import save_file

    with StagedDir(run_dir / name) as stage:
        _save_model_dir(model, tokenizer, stage.path, provenance)
        if state is not None:
            tensors, opt_meta = _optimizer_to_flat(optimizer)
            tensors["rng.torch"] = torch.get_rng_state()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                for i, s in enumerate(torch.cuda.get_rng_state_all()):
                    tensors[f"rng.cuda.{i}"] = s
            save_file(tensors, str(stage.path / STATE_TENSORS))
            sched = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas" and _jsonable(v)}
            atomic_write_json(stage.path / STATE_JSON, dict(state, optimizer=opt_meta, scheduler=sched))
        return stage.commit()


def _last_dir(out: Path) -> Path:
    """``<out>/last``, or the copy of it that an interrupted replacement left (then ``last`` is missing)."""
    last = out / "last"
    if last.exists():
        return last
    if (out / "last.old").is_dir():  # the writer before fsutil, interrupted between two renames
        return out / "last.old"
    backups = sorted(
        (p for p in out.glob(".last.old-*") if p.is_dir() and _FSUTIL_TEMPORARY.match(p.name)),
        key=lambda p: p.stat().st_mtime,
    )
    if backups:
        logger.warning(
            "%s is missing; resuming from %s, left by an interrupted checkpoint write", last, backups[-1]
        )
        return backups[-1]
    return last


def _read_json_file(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise TrainingError(f"cannot resume: {path} ({what}) is missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TrainingError(f"cannot resume: {path} ({what}) is corrupt or truncated: {exc}") from None


_STATE_KEYS = dict(
    step=int,
    epoch=int,
    batch_in_epoch=int,
    history=list,
    best=(dict, type(None)),
    total_elapsed_s=(int, float),
    optimizer=dict,
    scheduler=dict,
)


def _load_state(last: Path, optimizer, scheduler) -> dict:
    """The saved training state of ``last``, loaded into ``optimizer``, ``scheduler`` and torch's RNG.

    Every problem (a missing, corrupt or truncated file, a state of another model) is a
    :class:`TrainingError` naming the file.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from .checkpoint import check_finite

    json_path, tensors_path = last / STATE_JSON, last / STATE_TENSORS
    for path in (json_path, tensors_path):
        if not path.is_file():
            raise TrainingError(f"cannot resume: {path} is missing (was the run saved with this version?)")
    payload = _read_json_file(json_path, "training state")
    if not isinstance(payload, dict):
        raise TrainingError(f"cannot resume: {json_path} is not a training state (not a JSON object)")
    for key, kind in _STATE_KEYS.items():
        if key not in payload:
            raise TrainingError(
                f"cannot resume: {json_path} has no {key!r} (not a training state of this program)"
            )
        value = payload[key]
        if isinstance(value, bool) or not isinstance(value, kind) or (kind is int and value < 0):
            raise TrainingError(f"cannot resume: {json_path}: {key!r} is {value!r}, not a valid value")
    try:
        tensors = load_file(str(tensors_path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise TrainingError(f"cannot resume: {tensors_path} is corrupt or truncated: {exc}") from None
    try:
        check_finite(tensors, str(tensors_path))
    except ValueError as exc:
        raise TrainingError(f"cannot resume: {exc}") from None
    if "rng.torch" not in tensors:
        raise TrainingError(f"cannot resume: {tensors_path} has no 'rng.torch' tensor")
    try:
        _optimizer_from_flat(optimizer, tensors, payload.pop("optimizer"))
        sched = payload.pop("scheduler")
        sched["lr_lambdas"] = [None] * len(
            optimizer.param_groups
        )  # the schedule function is rebuilt, not stored
        scheduler.load_state_dict(sched)
        torch.set_rng_state(tensors["rng.torch"])
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as exc:
        raise TrainingError(
            f"cannot resume: {json_path} and {tensors_path} are not a training state of this model: {exc}"
        ) from None
    cuda_states = [tensors[k] for k in sorted(tensors) if k.startswith("rng.cuda.")]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states)
    return payload


def _options_dict(opts: TrainOptions) -> dict:
    d = dataclasses.asdict(opts)
    d["adam_betas"] = list(d["adam_betas"])
    d["oversample"] = [list(rule) for rule in d["oversample"]]
    return d


def _merge_resume_options(opts: TrainOptions, saved: dict) -> TrainOptions:
    """Run-defining options from the saved run; the others (budget, logging, device) from ``opts``."""
    merged = dataclasses.replace(opts)
    ignored = []
    for name in _RUN_DEFINING:
        if name not in saved:
            continue
        value = saved[name]
        if name in ("adam_betas", "train_files", "valid_files") and value is not None:
            value = tuple(value)
        elif name == "oversample":
            value = tuple(tuple(rule) for rule in value)
        current = getattr(opts, name)
        if current != value and current != getattr(TrainOptions, name, None):
            ignored.append(f"{name}={current!r} (saved run: {value!r})")
        setattr(merged, name, value)
    if ignored:
        logger.warning("resuming: keeping the saved run's options, ignoring %s", ", ".join(ignored))
    return merged


# ---------------------------------------------------------------------- option checks
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
}
_SEED_MAX = 2**63 - 1
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
        raise TrainingError(f"{_option(name)} must be {allowed}{note}, got {value!r}")


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
        raise TrainingError(f"{_option(name)} must be {allowed}{note}, got {value!r}")


def _check_options(opts: TrainOptions) -> None:
    """Every option's type and range (the checks that need no data); the error names the option."""
    for name in ("resume", "overwrite", "shared_vocab", "final_eval", "progress"):
        if not isinstance(getattr(opts, name), bool):
            raise TrainingError(f"{_option(name)} must be true or false, got {getattr(opts, name)!r}")
    if opts.norm_first is not None and not isinstance(opts.norm_first, bool):
        raise TrainingError(f"{_option('norm_first')} must be true, false or None, got {opts.norm_first!r}")
    if opts.resume and opts.overwrite:
        raise TrainingError("--resume and --overwrite exclude each other")
    for name in ("out_dir", "export_dir"):
        value = getattr(opts, name)
        if name == "export_dir" and value is None:
            continue
        if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
            raise TrainingError(f"{_option(name)} must be a folder path, got {value!r}")
    if not isinstance(opts.device, str):
        raise TrainingError(
            f"{_option('device')} must be a device name such as cpu or cuda, got {opts.device!r}"
        )
    if opts.preset not in MODEL_PRESETS:
        raise TrainingError(f"unknown preset {opts.preset!r}; choose one of {sorted(MODEL_PRESETS)}")
    _check_int(opts, "seed", 0, _SEED_MAX)
    _check_int(opts, "split_seed", 0, _SEED_MAX)
    _check_int(opts, "threads", 1, _THREADS_MAX, optional=True)
    for name in ("d_model", "n_heads", "n_encoder_layers", "n_decoder_layers", "d_ff", "max_len"):
        _check_int(opts, name, 1, optional=True)
    _check_float(opts, "dropout", 0.0, 1.0, optional=True)
    _check_int(opts, "range_low", 0)
    _check_int(opts, "range_high", 0)
    if opts.range_high < opts.range_low:
        raise TrainingError(
            f"--range LOW HIGH must satisfy 0 <= LOW <= HIGH, got {opts.range_low} {opts.range_high}"
        )
    _check_int(opts, "max_tokens", 1)
    rules = opts.oversample
    if not isinstance(rules, (tuple, list)):
        raise TrainingError(f"{_option('oversample')} must be a list of (BELOW, TIMES) rules, got {rules!r}")
    for rule in rules:
        if (
            not isinstance(rule, (tuple, list))
            or len(rule) != 2
            or not all(_is_int(x) for x in rule)
            or rule[0] < 0
            or rule[1] < 1
        ):
            raise TrainingError(
                f"{_option('oversample')} rules are BELOW=TIMES with integers BELOW >= 0 and "
                f"TIMES >= 1, got {rule!r}"
            )
    _check_int(opts, "max_steps", 0, optional=True)
    _check_int(opts, "epochs", 0, optional=True)
    if opts.max_steps is None and opts.epochs is None:
        raise TrainingError("give --max-steps or --epochs (or both: whichever comes first)")
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
        raise TrainingError(f"adam_betas must be two numbers in [0, 1), got {betas!r}")
    _check_float(opts, "adam_eps", 0.0, low_open=True)
    _check_int(opts, "eval_every", 0, note=" (0: validate only at the end)")
    _check_int(opts, "eval_examples", 0)
    _check_int(opts, "log_every", 0)
    _check_int(opts, "final_beam", 0, note=" (0 or 1: greedy only)")
    _check_text_options(opts)


def _check_text_options(opts: TrainOptions) -> None:
    """The options of parallel-text training, mixed precision, schedules and checkpoint selection."""
    for name in ("train_files", "valid_files"):
        value = getattr(opts, name)
        if value is not None and (
            not isinstance(value, (tuple, list))
            or len(value) != 2
            or not all(isinstance(v, (str, os.PathLike)) and os.fspath(v) for v in value)
        ):
            raise TrainingError(
                f"{_option(name)} takes two file paths, SOURCE_FILE TARGET_FILE, got {value!r}"
            )
    for name in ("train_tsv", "valid_tsv"):
        value = getattr(opts, name)
        if value is not None and (not isinstance(value, (str, os.PathLike)) or not os.fspath(value)):
            raise TrainingError(f"{_option(name)} must be a file path, got {value!r}")
    if opts.train_files is not None and opts.train_tsv is not None:
        raise TrainingError("give the training data once: --train SRC TGT or --train-tsv FILE, not both")
    if opts.valid_files is not None and opts.valid_tsv is not None:
        raise TrainingError("give the validation data once: --valid SRC TGT or --valid-tsv FILE, not both")
    has_train = _text_mode(opts)
    has_valid = opts.valid_files is not None or opts.valid_tsv is not None
    if has_train and not has_valid:
        raise TrainingError("--train needs a validation set: --valid SRC_FILE TGT_FILE or --valid-tsv FILE")
    if has_valid and not has_train:
        raise TrainingError("--valid is given without --train (the demo task has its own validation split)")
    if opts.tokenizer is not None and opts.tokenizer not in TOKENIZERS:
        raise TrainingError(f"--tokenizer must be one of {', '.join(TOKENIZERS)}, got {opts.tokenizer!r}")
    if opts.tokenizer == "sentencepiece" and not has_train:
        raise TrainingError(
            "--tokenizer sentencepiece needs parallel text (--train / --valid); the demo task uses "
            "the character tokenizer"
        )
    _check_int(opts, "vocab_size", 8, note=" (SentencePiece pieces, the 4 special tokens included)")
    if opts.spm_model_type not in ("unigram", "bpe"):
        raise TrainingError(f"--spm-model-type must be unigram or bpe, got {opts.spm_model_type!r}")
    _check_float(opts, "max_len_ratio", 1.0, optional=True, note=" (longer side / shorter side, in tokens)")
    if opts.lr_schedule not in ("noam", "inverse-sqrt"):
        raise TrainingError(f"--lr-schedule must be noam or inverse-sqrt, got {opts.lr_schedule!r}")
    _check_float(opts, "lr", 0.0, low_open=True, optional=True)
    if opts.lr_schedule == "inverse-sqrt" and opts.lr is None:
        raise TrainingError("--lr-schedule inverse-sqrt needs --lr (the peak learning rate, e.g. 5e-4)")
    if opts.lr_schedule == "noam" and opts.lr is not None:
        raise TrainingError(
            "--lr is the peak of --lr-schedule inverse-sqrt; the noam schedule is scaled by --lr-factor"
        )
    _check_int(opts, "update_freq", 1, 4096)
    if opts.amp is not None:
        if opts.amp not in AMP_DTYPES:
            raise TrainingError(f"--amp must be bf16 or fp16, got {opts.amp!r}")
        if not (isinstance(opts.device, str) and opts.device.startswith("cuda")):
            raise TrainingError(
                f"--amp {opts.amp} needs --device cuda: on the CPU training runs in float32, since "
                "bfloat16/float16 matrix products on CPUs without native bf16 instructions are about "
                "100x slower than float32"
            )
    if opts.best_metric is not None and opts.best_metric not in BEST_METRICS:
        raise TrainingError(
            f"--best-metric must be one of {', '.join(BEST_METRICS)}, got {opts.best_metric!r}"
        )
    _check_int(opts, "patience", 1, optional=True, note=" (validations without a new best before stopping)")
    _check_int(opts, "keep_last", 0)


def _check_export_dir(opts: TrainOptions, out: Path) -> Optional[Path]:
    """The export folder, checked: not a file, outside the run, and empty or a model folder already."""
    if opts.export_dir is None:
        return None
    target = Path(opts.export_dir)
    if target.exists() and not target.is_dir():
        raise TrainingError(f"--export {target} is a file, not a folder")
    resolved, run = Path(os.path.realpath(target)), Path(os.path.realpath(out))
    if resolved == run or run in resolved.parents:
        raise TrainingError(f"--export {target} is inside the run folder {out}; choose a folder outside it")
    if target.is_dir() and any(target.iterdir()):
        from .config import TransformerConfig

        config = target / MODEL_FILES[0]
        if not config.is_file():
            raise TrainingError(
                f"--export {target} is not empty and holds no {MODEL_FILES[0]}: it is not a model "
                "folder, and the export would write into it; choose an empty or new folder"
            )
        try:
            TransformerConfig.load_json(config)
        except ValueError as exc:
            raise TrainingError(
                f"--export {target} does not hold a model of this program ({exc}); choose an empty "
                "or new folder"
            ) from None
    return target


def _device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise TrainingError(f"--device {name!r} is not a device name; use cpu or cuda (or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainingError("device 'cuda' was requested but no CUDA GPU is available; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise TrainingError(f"unsupported device {name!r}: use cpu or cuda")
    return device


def _text_mode(opts: TrainOptions) -> bool:
    return opts.train_files is not None or opts.train_tsv is not None


def _data_name(files, tsv) -> str:
    return f"{files[0]} / {files[1]}" if files is not None else str(tsv)


def _read_pairs(files, tsv, flag: str) -> tuple[list[str], list[str]]:
    from .data import DataError, read_parallel, read_tsv

    try:
        return read_parallel(*files) if files is not None else read_tsv(tsv)
    except DataError as exc:
        raise TrainingError(f"{flag}: {exc}") from None


def _find_provenance(opts: TrainOptions) -> Optional[bytes]:
    """The corpus's provenance.json (written by transformer_ext.corpora) next to the training data, if any."""
    first = opts.train_files[0] if opts.train_files is not None else opts.train_tsv
    path = Path(first).parent / PROVENANCE_FILE
    if not path.is_file():
        return None
    data = path.read_bytes()
    try:
        json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TrainingError(
            f"{path} is not a provenance file (not UTF-8 JSON: {exc}); remove it or fix it"
        ) from None
    logger.info("corpus provenance from %s goes into every model folder", path)
    return data


def _build_text_tokenizer(opts: TrainOptions, sources: list[str], targets: list[str], ctx):
    """The tokenizer of a parallel-text run, learnt from the training split only.

    SentencePiece under torchrun: rank 0 trains it, the other ranks wait and receive the same model files.
    """
    from .tokenizer import TokenizerError

    kind = opts.tokenizer or "sentencepiece"
    if kind == "char":
        return CharTokenizer.build(sources, targets, shared=opts.shared_vocab)
    from .spm_tokenizer import SentencePieceTokenizer

    payload = None
    if ctx.is_main:
        t0 = time.monotonic()
        try:
            tok = SentencePieceTokenizer.train(
                sources,
                targets,
                vocab_size=opts.vocab_size,
                model_type=opts.spm_model_type,
                shared=opts.shared_vocab,
                threads=opts.threads or 1,
            )
        except TokenizerError as exc:
            ctx.broadcast(None)
            raise TrainingError(f"--vocab-size / --tokenizer: {exc}") from None
        logger.info("trained %s in %.1f s on %d training pairs", tok, time.monotonic() - t0, len(sources))
        payload = (tok._src_bytes, None if tok.shared else tok._tgt_bytes, tok.model_type)
    payload = ctx.broadcast(payload)
    if payload is None:
        raise TrainingError("rank 0 could not train the SentencePiece model (see its error)")
    if ctx.is_main:
        return tok
    return SentencePieceTokenizer(payload[0], payload[1], model_type=payload[2])


def _tokenizer_info(tokenizer) -> dict:
    info = dict(
        type=tokenizer.type,
        src_vocab_size=tokenizer.src_vocab_size,
        tgt_vocab_size=tokenizer.tgt_vocab_size,
        files=list(tokenizer.files),
    )
    if hasattr(tokenizer, "model_type"):
        info.update(model_type=tokenizer.model_type, shared=tokenizer.shared)
    return info


def _metric_key(record: dict, metric: str) -> tuple:
    """Larger is better: the chosen metric, then the negated validation loss."""
    if metric == "loss":
        return (-record["loss"],)
    return (record.get({"exact": "exact_match"}.get(metric, metric), 0.0), -record["loss"])


def train(options: Optional[TrainOptions] = None, **overrides: Any) -> TrainResult:
    """Train (or resume) a model as described by ``options`` (plus keyword overrides).

    Returns a :class:`TrainResult`; writes ``<out>/best/``, ``<out>/last/``, ``<out>/run.json``,
    ``<out>/train_options.json`` and ``<out>/summary.json`` (and the export directory when
    ``export_dir`` is set).

    Every option, the output folder, the data and the model config are checked before anything
    is written (:class:`TrainingError` naming the option or file). A new run is built in a
    temporary sibling of ``<out>`` and takes its place when its first checkpoint is complete; an
    old run there (``overwrite``) is deleted only then. Only a folder that holds a run of this
    program is resumed or replaced. Checkpoints are written atomically, so an interruption or a
    full disk leaves the previous checkpoint and no temporary files.
    """
    from tqdm.auto import tqdm

    from .checkpoint import load_model
    from .model import Transformer

    opts = dataclasses.replace(options or TrainOptions(), **overrides)
    _check_options(opts)
    out = Path(opts.out_dir)
    folder = _inspect_out(out)
    if opts.resume:
        if folder.kind != "run":
            raise TrainingError(
                f"cannot resume: {out} holds no training run of this program"
                + (f" ({folder.reason})" if folder.reason else "")
            )
    elif folder.kind == "foreign":
        raise TrainingError(
            f"--out {out} is not a training run of this program ({folder.reason}); nothing in it "
            "is touched: choose a new or empty folder"
        )
    elif folder.kind == "run" and not opts.overwrite:
        raise TrainingError(
            f"{out} already holds a training run; pass --resume to continue it, --overwrite to start "
            "afresh, or choose another --out"
        )
    elif folder.kind == "run" and folder.others:
        raise TrainingError(
            f"--overwrite replaces the whole run folder {out}, but it also holds files this program did not write "
            f"({', '.join(folder.others[:5])}{' ...' if len(folder.others) > 5 else ''}); move them away or choose "
            "another --out"
        )
    export_dir = _check_export_dir(opts, out)
    device = _device(opts.device)
    ctx = distributed.setup(
        device
    )  # single process, or one rank of a torchrun job (nccl on cuda, gloo on cpu)
    device = ctx.device
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)

    last = _last_dir(out)
    if opts.resume:
        if not (last / STATE_JSON).is_file():
            raise TrainingError(
                f"cannot resume: no saved checkpoint in {out} ({last / STATE_JSON} not found)"
            )
        saved_options = _read_json_file(out / OPTIONS_JSON, "the options of the run")
        try:
            if not isinstance(saved_options, dict):
                raise TrainingError("not a JSON object")
            opts = _merge_resume_options(opts, saved_options)
            _check_options(opts)
        except (TrainingError, TypeError, ValueError) as exc:
            raise TrainingError(
                f"cannot resume: {out / OPTIONS_JSON} does not hold valid options: {exc}"
            ) from None

    text_mode = _text_mode(opts)
    provenance: Optional[bytes] = None
    data_report: dict[str, Any] = {}
    if text_mode:
        # Parallel text: read and checked before anything is written; the tokenizer (trained on the
        # training split only) and the filters come next.
        train_src, train_tgt = _read_pairs(opts.train_files, opts.train_tsv, "--train")
        valid_src, valid_tgt = _read_pairs(opts.valid_files, opts.valid_tsv, "--valid")
        if not valid_src:
            raise TrainingError(
                f"the validation set {_data_name(opts.valid_files, opts.valid_tsv)} has no lines"
            )
        if not train_src:
            raise TrainingError(
                f"the training set {_data_name(opts.train_files, opts.train_tsv)} has no lines"
            )
        provenance = _find_provenance(opts)
        splits = None
    else:
        # Data: the split is fixed by (range, split_seed); the tokenizer comes from the training split.
        try:
            splits = split_numbers(opts.range_low, opts.range_high, seed=opts.split_seed)
        except ValueError as exc:
            raise TrainingError(f"--range {opts.range_low} {opts.range_high}: {exc}") from None
        if not splits.valid or not splits.heldout:
            raise TrainingError(
                f"--range {opts.range_low} {opts.range_high} holds too few numbers: its validation "
                "and held-out splits (5% of the numbers each) are empty; widen the range"
            )
        train_examples = make_examples(oversample(splits.train, opts.oversample))
        valid_examples = make_examples(splits.valid)
        if not train_examples:
            raise TrainingError("the training split is empty; widen the number range")

    if opts.resume:
        from .spm_tokenizer import load_any_tokenizer

        tokenizer = load_any_tokenizer(last)
        model = load_model(last, device)
        config = model.config
    else:
        if text_mode:
            tokenizer = _build_text_tokenizer(opts, train_src, train_tgt, ctx)
        else:
            tokenizer = CharTokenizer.build(
                [e.source for e in train_examples],
                [e.target for e in train_examples],
                shared=opts.shared_vocab,
                lowercase=True,
            )
        config = build_config(opts, tokenizer)
        torch.manual_seed(opts.seed)
        model = Transformer(config).to(device)
    valid_pairs = None
    if text_mode:
        from .data import encode_parallel

        train_pairs, train_report = encode_parallel(
            tokenizer, train_src, train_tgt, max_len=config.max_len, max_len_ratio=opts.max_len_ratio
        )
        logger.info(
            "training data %s: %s", _data_name(opts.train_files, opts.train_tsv), train_report.describe()
        )
        if train_report.kept == 0:
            raise TrainingError(
                f"no training pair is left after filtering "
                f"{_data_name(opts.train_files, opts.train_tsv)}: {train_report.describe()}"
            )
        valid_ids, valid_report = encode_parallel(
            tokenizer, valid_src, valid_tgt, max_len=config.max_len, max_len_ratio=None
        )
        logger.info(
            "validation data %s: %s", _data_name(opts.valid_files, opts.valid_tsv), valid_report.describe()
        )
        if valid_report.kept == 0:
            raise TrainingError(
                f"no validation pair is left after filtering "
                f"{_data_name(opts.valid_files, opts.valid_tsv)}: {valid_report.describe()}"
            )
        valid_examples = [Example(int(i), valid_src[i], valid_tgt[i]) for i in valid_report.kept_index]
        valid_pairs = [valid_ids[i] for i in range(len(valid_ids))]
        data_report = dict(train=dataclasses.asdict(train_report), valid=dataclasses.asdict(valid_report))
        for r in data_report.values():
            r.pop("kept_index", None)
        del train_src, train_tgt
        costs = train_pairs.costs
    else:
        train_pairs = encode_examples(tokenizer, train_examples)
        longest = max(max(len(s), len(t) + 1) for s, t in train_pairs)
        if longest > config.max_len:
            raise TrainingError(
                f"the longest training sequence has {longest} tokens, more than max_len={config.max_len}"
            )
        costs = [example_cost(len(s), len(t)) for s, t in train_pairs]
    best_metric = opts.best_metric or ("bleu" if text_mode else "exact")
    sampler = TokenBatchSampler(costs, opts.max_tokens, seed=opts.seed)
    sampler = ctx.shard(sampler)  # under torchrun: this rank's batches r, r+N, r+2N, ... of each epoch
    steps_per_epoch = math.ceil(len(sampler) / opts.update_freq)
    limits = []
    if opts.max_steps is not None:
        limits.append(opts.max_steps)
    if opts.epochs is not None:
        limits.append(opts.epochs * steps_per_epoch)
    total_steps = min(limits)

    train_model = ctx.wrap(model)  # DDP under torchrun (gradients all-reduced during backward)
    optimizer = make_optimizer(model, opts)
    scheduler = make_scheduler(
        optimizer, config.d_model, opts.warmup, opts.lr_factor, opts.lr_schedule, opts.lr
    )
    scaler = torch.amp.GradScaler("cuda") if opts.amp == "fp16" else None
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(opts.amp or "")

    state: dict[str, Any] = dict(
        step=0, epoch=0, batch_in_epoch=0, history=[], best=None, total_elapsed_s=0.0, evals_since_best=0
    )
    if opts.resume:
        saved = _load_state(last, optimizer, scheduler)
        state.update({k: saved[k] for k in state if k in saved})
        # a checkpoint stores global batches into the epoch; a resume may use another world size
        state["batch_in_epoch"] = ctx.local_position(state["batch_in_epoch"], saved.get("world_size", 1))
        if (
            opts.epochs is not None and saved.get("world_size", 1) != ctx.world_size
        ):  # epochs left, in new steps
            limits[-1] = state["step"] + max(
                0, (opts.epochs - state["epoch"]) * steps_per_epoch - state["batch_in_epoch"]
            )
            total_steps = min(limits)
        logger.info(
            "resumed %s at step %d (epoch %d, batch %d)",
            last,
            state["step"],
            state["epoch"],
            state["batch_in_epoch"],
        )

    # Everything is checked: from here on the disk is written (by rank 0 only under torchrun).
    run_dir = out  # where checkpoints go: a new run's temporary folder until its first checkpoint
    stage: Optional[StagedDir] = None
    if ctx.is_main and not opts.resume:
        out.absolute().parent.mkdir(parents=True, exist_ok=True)
        stage = StagedDir(out)
        stage.__enter__()
        run_dir = stage.path
    try:
        if ctx.is_main:
            if stage is not None:
                atomic_write_json(run_dir / RUN_MARKER, _marker())
                atomic_write_json(run_dir / OPTIONS_JSON, _options_dict(opts))
            elif not folder.marked:  # resuming a run of the version before run.json
                atomic_write_json(out / RUN_MARKER, _marker())
        n_params = sum(p.numel() for p in model.parameters())
        logger.info("model: %s parameters, config %s", f"{n_params:,}", config.to_dict())
        if text_mode:
            logger.info(
                "data: %d training pairs (%d target tokens), %d validation pairs; %d batches of <= %d tokens "
                "per epoch, %d optimiser steps per epoch (--update-freq %d)",
                len(train_pairs),
                train_pairs.n_target_tokens(),
                len(valid_examples),
                len(sampler),
                opts.max_tokens,
                steps_per_epoch,
                opts.update_freq,
            )
        else:
            logger.info(
                "data: %d train / %d valid / %d held-out numbers in %d..%d; %d training examples per epoch "
                "(oversampling %s), %d batches of <= %d tokens",
                len(splits.train),
                len(splits.valid),
                len(splits.heldout),
                opts.range_low,
                opts.range_high,
                len(train_examples),
                list(opts.oversample) or "none",
                steps_per_epoch,
                opts.max_tokens,
            )

        ctx.seed_rank_rng(opts.seed, state["step"])  # ranks > 0: their own dropout masks
        model.train()
        first_step = state["step"] + 1
        losses: list[float] = []
        lrs: list[float] = []
        started = time.monotonic()
        cpu_started = time.process_time()
        load_start = _load_average()
        stop_reason = (
            "max_steps" if opts.max_steps is not None and total_steps == opts.max_steps else "epochs"
        )
        window_loss = 0.0
        window_tokens = 0
        window_start = time.monotonic()
        last_eval_step = state["history"][-1]["step"] if state["history"] else -1

        def elapsed() -> float:
            return time.monotonic() - started

        def partial_summary() -> dict:
            return dict(
                running=True,
                options=_options_dict(opts),
                config=config.to_dict(),
                parameters=n_params,
                steps=state["step"],
                steps_per_epoch=steps_per_epoch,
                best_metric=best_metric,
                best=state["best"],
                history=state["history"],
                data=data_report,
                tokenizer=_tokenizer_info(tokenizer),
                world_size=ctx.world_size,
                torch=torch.__version__,
                threads=torch.get_num_threads(),
                load_average=_load_average(),
            )

        def validate_and_save() -> None:
            nonlocal last_eval_step, run_dir
            t0 = time.monotonic()
            metrics = evaluate(
                model,
                tokenizer,
                valid_examples,
                device=device,
                max_tokens=max(opts.max_tokens, 4000),
                label_smoothing=opts.label_smoothing,
                exact_examples=opts.eval_examples,
                pairs=valid_pairs,
                bleu=text_mode or best_metric in ("bleu", "chrf"),
            )
            errors = metrics.pop("errors", [])
            signatures = {k: metrics.pop(k) for k in ("bleu_signature", "chrf_signature") if k in metrics}
            record = dict(
                step=state["step"],
                epoch=state["epoch"] + state["batch_in_epoch"] / steps_per_epoch,
                elapsed_s=round(state["total_elapsed_s"] + elapsed(), 1),
                validation_s=round(time.monotonic() - t0, 1),
                **metrics,
            )
            state["history"].append(record)
            last_eval_step = state["step"]
            best = state["best"]
            improved = best is None or _metric_key(record, best_metric) > _metric_key(best, best_metric)
            if signatures and not any("bleu_signature" in h for h in state["history"][:-1]):
                record.update(signatures)
                logger.info(
                    "validation scores: sacrebleu BLEU %s, chrF %s",
                    signatures.get("bleu_signature"),
                    signatures.get("chrf_signature"),
                )
            bleu_text = f", BLEU {record['bleu']:.2f}, chrF {record['chrf']:.2f}" if "bleu" in record else ""
            logger.info(
                "validation at step %d: loss %.4f, nll %.4f, exact match %.3f (%d)%s%s",
                record["step"],
                record["loss"],
                record["nll"],
                record.get("exact_match", float("nan")),
                record.get("n_exact", 0),
                bleu_text,
                " (best so far)" if improved else "",
            )
            for src, hyp, ref in errors[:3]:
                logger.debug("  %r -> %r (reference %r)", src, hyp, ref)
            if improved:
                state["best"] = record
                state["evals_since_best"] = 0
                _save_checkpoint(run_dir, "best", model, tokenizer, provenance=provenance)
            else:
                state["evals_since_best"] += 1
            if opts.keep_last:
                _save_step_checkpoint(run_dir, state["step"], model, tokenizer, opts.keep_last, provenance)
            snapshot = dict(
                state,
                total_elapsed_s=state["total_elapsed_s"] + elapsed(),
                batch_in_epoch=ctx.global_position(state["batch_in_epoch"]),
                world_size=ctx.world_size,
            )
            _save_checkpoint(
                run_dir, "last", model, tokenizer, optimizer, scheduler, snapshot, provenance=provenance
            )
            if (
                stage is not None and not stage.committed
            ):  # the first checkpoint of a new run: it replaces --out
                _commit_run(stage, folder)
                run_dir = out
            atomic_write_json(
                run_dir / SUMMARY_JSON, partial_summary()
            )  # an interrupted run keeps its numbers

        def validate_and_save_on_rank0() -> None:
            """validate_and_save() on rank 0 while the others wait; then every rank holds its record."""
            nonlocal last_eval_step
            diff = ctx.replica_difference(model)
            if diff:
                logger.warning(
                    "the ranks' parameters differ from rank 0's by up to %.3g at step %d", diff, state["step"]
                )
            if ctx.is_main:
                validate_and_save()
            state["history"], state["best"], last_eval_step, state["evals_since_best"] = ctx.broadcast(
                (state["history"], state["best"], last_eval_step, state["evals_since_best"])
            )

        def accumulate_gradients(micro: list) -> tuple[float, int]:
            return accumulate_gradients_of(
                train_model,
                micro,
                pad_id=tokenizer.pad_id,
                label_smoothing=opts.label_smoothing,
                ctx=ctx,
                scaler=scaler,
                autocast_dtype=autocast_dtype,
            )

        bar = tqdm(
            total=total_steps,
            initial=state["step"],
            disable=not opts.progress or not ctx.is_main,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            leave=False,
        )
        try:
            done = state["step"] >= total_steps
            while not done:
                batches = sampler.batches(state["epoch"])
                while state["batch_in_epoch"] < len(batches):
                    if state["step"] >= total_steps:
                        done = True
                        break
                    if opts.max_minutes is not None and ctx.any(elapsed() >= 60.0 * opts.max_minutes):
                        stop_reason = "max_minutes"
                        done = True
                        break
                    group = batches[state["batch_in_epoch"] : state["batch_in_epoch"] + opts.update_freq]
                    micro = [
                        collate(
                            [train_pairs[i] for i in idx],
                            pad_id=tokenizer.pad_id,
                            bos_id=tokenizer.bos_id,
                            eos_id=tokenizer.eos_id,
                        ).to(device)
                        for idx in group
                    ]
                    lr = optimizer.param_groups[0]["lr"]
                    optimizer.zero_grad(set_to_none=True)
                    loss_value, n_tokens = accumulate_gradients(micro)
                    if scaler is not None:
                        scaler.unscale_(optimizer)
                    if opts.clip_norm > 0:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), opts.clip_norm)
                    if scaler is not None:
                        scaler.step(optimizer)
                        scaler.update()
                    else:
                        optimizer.step()
                    scheduler.step()
                    state["step"] += 1
                    state["batch_in_epoch"] += len(group)
                    if not math.isfinite(loss_value):
                        raise TrainingDiverged(
                            f"training loss became {loss_value} at step {state['step']}; "
                            "try a smaller --lr-factor or a longer --warmup"
                        )
                    losses.append(loss_value)
                    lrs.append(lr)
                    window_loss += loss_value * n_tokens
                    window_tokens += n_tokens
                    bar.update(1)
                    if opts.log_every and state["step"] % opts.log_every == 0:
                        dt = time.monotonic() - window_start
                        logger.info(
                            "step %d/%d epoch %d loss %.4f lr %.2e %.0f target tokens/s",
                            state["step"],
                            total_steps,
                            state["epoch"] + 1,
                            window_loss / window_tokens,
                            lr,
                            window_tokens / max(dt, 1e-9),
                        )
                        bar.set_postfix(loss=f"{window_loss / window_tokens:.3f}", lr=f"{lr:.1e}")
                        window_loss, window_tokens, window_start = 0.0, 0, time.monotonic()
                    if opts.eval_every and state["step"] % opts.eval_every == 0:
                        validate_and_save_on_rank0()
                        if opts.patience is not None and state["evals_since_best"] >= opts.patience:
                            stop_reason = "patience"
                            done = True
                            break
                else:
                    state["epoch"] += 1
                    state["batch_in_epoch"] = 0
        finally:
            bar.close()

        if ctx.broadcast(last_eval_step != state["step"] or not (run_dir / "last").exists()):
            validate_and_save_on_rank0()
        session_s = elapsed()
        session_cpu_s = time.process_time() - cpu_started
        state["total_elapsed_s"] += session_s
        logger.info(
            "training stopped (%s) at step %d after %.1f s wall, %.1f s process CPU (%.1f s wall in all "
            "sessions; load average %s)",
            stop_reason,
            state["step"],
            session_s,
            session_cpu_s,
            state["total_elapsed_s"],
            _load_average(),
        )

        heldout = None
        if opts.final_eval and ctx.is_main and not text_mode:
            heldout = _evaluate_heldout(out / "best", splits.heldout, device, opts.final_beam)
        result = TrainResult(
            out_dir=str(out),
            config=config.to_dict(),
            step=state["step"],
            first_step=first_step,
            epoch=state["epoch"],
            losses=losses,
            learning_rates=lrs,
            history=state["history"],
            best=state["best"],
            heldout=heldout,
            elapsed_s=session_s,
            total_elapsed_s=state["total_elapsed_s"],
            stop_reason=stop_reason,
            world_size=ctx.world_size,
            model=model,
        )
        summary = dict(
            options=_options_dict(opts),
            config=result.config,
            parameters=n_params,
            steps=result.step,
            epochs=result.epoch + state["batch_in_epoch"] / steps_per_epoch,
            steps_per_epoch=steps_per_epoch,
            train_seconds=round(result.total_elapsed_s, 1),
            stop_reason=stop_reason,
            best=result.best,
            heldout=heldout,
            world_size=ctx.world_size,
            torch=torch.__version__,
            threads=torch.get_num_threads(),
            best_metric=best_metric,
            history=state["history"],
            data=data_report,
            tokenizer=_tokenizer_info(tokenizer),
            last_session=dict(
                wall_seconds=round(session_s, 1),
                process_cpu_seconds=round(session_cpu_s, 1),
                load_average_start=load_start,
                load_average_end=_load_average(),
                cpu_count=os.cpu_count(),
            ),
        )
        if ctx.is_main:
            atomic_write_json(out / SUMMARY_JSON, summary)
            if export_dir is not None:
                _export(out / "best", export_dir, summary, tokenizer.files)
        ctx.close()
        return result

    except BaseException:
        if stage is not None and not stage.committed:
            logger.warning(
                "stopped before the first checkpoint of the new run (nothing to resume): %s was left as "
                "it was",
                out,
            )
        raise
    finally:
        if stage is not None:
            stage.__exit__(None, None, None)  # removes the temporary folder unless it was committed


def _load_average() -> Optional[list[float]]:
    """1/5/15-minute load averages (where the OS has them): how shared the CPU was."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _evaluate_heldout(model_dir: Path, numbers: Sequence[int], device, beam: int) -> dict:
    """Exact match of the model in ``model_dir`` on the held-out numbers, greedy and (optionally) beam."""
    from .checkpoint import load_model

    model = load_model(model_dir, device)
    tokenizer = CharTokenizer.load(model_dir)
    examples = make_examples(numbers)
    t0 = time.monotonic()
    greedy = evaluate(model, tokenizer, examples, device=device, with_loss=False)
    report: dict[str, Any] = dict(
        n=len(examples),
        greedy_exact_match=greedy["exact_match"],
        greedy_seconds=round(time.monotonic() - t0, 1),
        greedy_errors=greedy["errors"],
    )
    logger.info(
        "held-out (%d numbers never trained on): greedy exact match %.4f",
        len(examples),
        greedy["exact_match"],
    )
    if beam and beam > 1:
        t0 = time.monotonic()
        beamed = evaluate(model, tokenizer, examples, device=device, with_loss=False, beam_size=beam)
        report.update(
            beam_size=beam,
            beam_exact_match=beamed["exact_match"],
            beam_seconds=round(time.monotonic() - t0, 1),
            beam_errors=beamed["errors"],
        )
        logger.info("held-out: beam %d exact match %.4f", beam, beamed["exact_match"])
    return report


def _export(
    best: Path, target: Path, summary: dict, tokenizer_files: Sequence[str] = (TOKENIZER_FILE,)
) -> None:
    """Copy the model directory ``best`` (config, weights, tokenizer) to ``target`` with a summary.

    ``target`` was checked before training (:func:`_check_export_dir`); each file is replaced
    atomically, other files in ``target`` are kept.
    """
    target.mkdir(parents=True, exist_ok=True)
    names = list(MODEL_FILES[:2]) + list(tokenizer_files)
    if (best / PROVENANCE_FILE).is_file():
        names.append(PROVENANCE_FILE)
    for name in names:
        atomic_write_bytes(target / name, (best / name).read_bytes())
    atomic_write_json(target / "training_summary.json", summary)
    logger.info("exported the best model to %s", target)


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
        "--out", dest="out_dir", default=d.out_dir, help="output directory of the run (default: %(default)s)"
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue the run saved in OUT/last/ exactly where it stopped (model, data, schedule "
        "options are the saved run's; budgets such as --max-steps may be raised)",
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
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm progress bar")
    g.add_argument("--quiet", action="store_true", help="log warnings only")
    add_debug_flag(g)

    g = p.add_argument_group("model")
    g.add_argument(
        "--preset",
        choices=sorted(MODEL_PRESETS),
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
        "--valid",
        dest="valid_files",
        nargs=2,
        metavar=("SRC_FILE", "TGT_FILE"),
        help="validation pairs (loss, BLEU and chrF with sacrebleu, best-checkpoint selection)",
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

    g = p.add_argument_group("data")
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
    g.add_argument(
        "--max-tokens", type=int, default=d.max_tokens, help="padded tokens per batch (default: %(default)s)"
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
        help="mixed precision on CUDA (fp16 with a gradient scaler). Not on the CPU: there training runs "
        "float32, because bfloat16/float16 matrix products on CPUs without native bf16 instructions "
        "are about 100x slower than float32",
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
        help="skip the held-out evaluation of the best model at the end",
    )
    g.add_argument(
        "--final-beam",
        type=int,
        default=d.final_beam,
        help="beam size of the final held-out evaluation (1: greedy only) (default: %(default)s)",
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
    for name in ("train_files", "valid_files"):
        if values.get(name) is not None:
            values[name] = tuple(values[name])
    return TrainOptions(range_low=low, range_high=high, **values)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m transformer_ext.train``; returns the exit code.

    Bad options are reported by argparse (exit code 2) or, for values out of range, by
    :func:`train` before anything is written; every expected failure is one line on stderr and
    exit code 1 (``--debug`` shows the traceback); Ctrl-C and SIGTERM print one line and return
    130 and 143, with the temporary files removed and the last checkpoint kept for ``--resume``.
    """
    from tqdm.contrib.logging import logging_redirect_tqdm

    parser = build_parser()
    args = parser.parse_args(argv)
    rank = distributed.env_rank()  # under torchrun only rank 0 logs progress and prints the result
    logging.basicConfig(
        level=logging.WARNING if args.quiet or rank > 0 else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )

    def work() -> int:
        opts = options_from_args(args)
        with logging_redirect_tqdm():
            result = train(opts)
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
        if result.heldout:
            h = result.heldout
            line = f"held-out ({h['n']} numbers): greedy exact match {h['greedy_exact_match']:.4f}"
            if "beam_exact_match" in result.heldout:
                line += f", beam {result.heldout['beam_size']} {result.heldout['beam_exact_match']:.4f}"
            print(line)
        print(f"model directories: {Path(result.out_dir) / 'best'} and {Path(result.out_dir) / 'last'}")
        return 0

    return run_cli(parser.prog, work, debug=args.debug, interrupted_hint="resume with --resume")


if __name__ == "__main__":
    sys.exit(main())
