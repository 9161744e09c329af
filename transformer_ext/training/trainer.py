"""The training loop: :func:`train` checks everything and builds a :class:`Trainer`, which runs it.

:func:`train` reads top to bottom: check the options and the output folder, set up the process
group (:mod:`.distributed`), take a resumed run's options from the run, let the task
(:mod:`.tasks`) load its data and build (or the run folder give back) the tokenizer and the
model, encode the data, then hand everything to a :class:`Trainer`. Nothing is written before
that point. :meth:`Trainer.run` stages a new run folder, trains step by step
(:meth:`Trainer.step`), validates and saves every ``eval_every`` steps (:meth:`Trainer.validate`),
stops at the first budget spent (steps, epochs, minutes, patience), and at the end validates
once more if needed, runs the task's final check, writes ``summary.json`` and the ``--export``
copy. The counters that a checkpoint saves live in one :class:`TrainState`.

**Determinism**: the model is initialised after ``torch.manual_seed(seed)``, dropout draws from
torch's global generator (saved and restored on resume), the batch order from a generator seeded
with ``seed + epoch``. On the CPU with a fixed thread count, the same options give bit-identical
losses, and a resumed run continues with the losses of an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from ..data import TokenBatchSampler, collate
from ..fsutil import StagedDir, atomic_write_json, check_output_path
from . import distributed, optim, run_folder, validation
from .errors import TrainingDiverged, TrainingError
from .options import (
    TrainOptions,
    check_options,
    given_fields,
    merge_resume_options,
    options_dict,
    parse_device,
    saved_options,
)
from .progress import Progress, TensorBoardLog, format_duration, have_tensorboard
from .run_folder import OPTIONS_JSON, RUN_MARKER, STATE_JSON, SUMMARY_JSON, RunFolder
from .tasks import Task, TrainingData, task_for

logger = logging.getLogger(__name__)

__all__ = ["TrainResult", "TrainState", "Trainer", "train"]


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
    model: Any = field(default=None, repr=False, compare=False)  # the trained model (this rank's copy)


@dataclass
class TrainState:
    """The counters of a run that ``last/training_state.json`` saves (besides optimiser and scheduler)."""

    step: int = 0  # optimiser steps done
    epoch: int = 0  # epochs completed
    batch_in_epoch: int = 0  # batches of the current epoch consumed (this rank's; saved as global)
    history: list = field(default_factory=list)  # every validation record
    best: Optional[dict] = None  # the record that selected best/
    total_elapsed_s: float = 0.0  # training wall time of the sessions before this one
    evals_since_best: int = 0  # validations since the last new best (--patience)

    def restore(self, saved: dict) -> None:
        for f in dataclasses.fields(self):
            if f.name in saved:
                setattr(self, f.name, saved[f.name])


@dataclass
class _LogWindow:
    """Loss and target tokens since the last log line."""

    loss: float = 0.0  # summed over tokens
    tokens: int = 0
    start: float = field(default_factory=time.monotonic)


def _out_of_memory(exc: BaseException) -> bool:
    """A failed allocation of torch (CUDA's OutOfMemoryError, or the CPU allocator's error)."""
    oom = getattr(torch, "OutOfMemoryError", None)
    return (oom is not None and isinstance(exc, oom)) or "can't allocate memory" in str(exc)


def _load_average() -> Optional[list[float]]:
    """1/5/15-minute load averages (where the OS has them): how shared the CPU was."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


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


class Trainer:
    """One session of a training run, from checked options, data, tokenizer and model."""

    def __init__(
        self,
        opts: TrainOptions,
        task: Task,
        ctx: distributed.Context,
        model,
        tokenizer,
        data: TrainingData,
        folder: RunFolder,
        export_dir: Optional[Path] = None,
    ):
        self.opts, self.task, self.ctx = opts, task, ctx
        self.model, self.tokenizer, self.data = model, tokenizer, data
        self.config = model.config
        self.device = ctx.device
        self.out, self.folder, self.export_dir = folder.path, folder, export_dir
        self.best_metric = task.best_metric
        # validation BLEU and chrF: what the metric needs, and a text task's report where sacrebleu is
        self.scores_text = self.best_metric in ("bleu", "chrf") or (task.scores_text and have_sacrebleu())
        self.n_params = sum(p.numel() for p in model.parameters())
        # under torchrun: this rank's batches r, r+N, r+2N, ... of each epoch
        self.sampler = ctx.shard(TokenBatchSampler(data.costs, opts.max_tokens, seed=opts.seed))
        self.steps_per_epoch = math.ceil(len(self.sampler) / opts.update_freq)
        self.step_limit = opts.max_steps
        self.epoch_limit = None if opts.epochs is None else opts.epochs * self.steps_per_epoch
        self.train_model = ctx.wrap(model)  # DDP under torchrun (gradients all-reduced during backward)
        self.optimizer = optim.make_optimizer(model, opts)
        self.scheduler = optim.make_scheduler(
            self.optimizer, self.config.d_model, opts.warmup, opts.lr_factor, opts.lr_schedule, opts.lr
        )
        self.scaler = torch.amp.GradScaler("cuda") if opts.amp == "fp16" else None
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(opts.amp or "")
        if self.autocast_dtype is not None and self.device.type == "cpu" and ctx.is_main:
            from ..cpu_features import bf16_support

            logger.info("--amp %s on the CPU: %s", opts.amp, bf16_support().reason)
        self.state = TrainState()
        self.run_dir = self.out  # where checkpoints go: a new run's staged folder until its first one
        self.stage: Optional[StagedDir] = None
        self.losses: list[float] = []
        self.learning_rates: list[float] = []
        self.last_eval_step = -1
        self.stop_reason = ""
        self.started = time.monotonic()
        self.lock: Optional[run_folder.RunLock] = None  # held by train() around the session
        self.tensorboard: Optional[TensorBoardLog] = None  # --tensorboard, on rank 0

    @property
    def total_steps(self) -> int:
        return min(limit for limit in (self.step_limit, self.epoch_limit) if limit is not None)

    def elapsed(self) -> float:
        """Training wall time of this session."""
        return time.monotonic() - self.started

    # ------------------------------------------------------------------ resume
    def restore(self, last: Path) -> None:
        """Continue from the checkpoint ``last``: optimiser, scheduler, RNG and counters."""
        saved = run_folder.load_state(last, self.optimizer, self.scheduler)
        state = self.state
        state.restore(saved)
        # a checkpoint stores global batches into the epoch; a resume may use another world size
        saved_world = saved.get("world_size", 1)
        state.batch_in_epoch = self.ctx.local_position(state.batch_in_epoch, saved_world)
        if self.epoch_limit is not None and saved_world != self.ctx.world_size:  # epochs left, in new steps
            left = (self.opts.epochs - state.epoch) * self.steps_per_epoch - state.batch_in_epoch
            self.epoch_limit = state.step + max(0, left)
        logger.info(
            "resumed %s at step %d (epoch %d, batch %d)", last, state.step, state.epoch, state.batch_in_epoch
        )

    # ------------------------------------------------------------------ the session
    def run(self) -> TrainResult:
        """Train until a budget is spent; returns the session's :class:`TrainResult`."""
        with run_folder.disk_errors("--output-dir", self.out):
            return self._run()

    def _run(self) -> TrainResult:
        self._open_stage()  # from here on the disk is written (by rank 0 only under torchrun)
        try:
            self._write_run_files()
            self._log_start()
            self._train()
            if self.ctx.broadcast(
                self.last_eval_step != self.state.step or not (self.run_dir / "last").exists()
            ):
                self.validate()
            return self._finish()
        except BaseException:
            if self.stage is not None and not self.stage.committed:
                logger.warning(
                    "stopped before the first checkpoint of the new run (nothing to resume): %s was left "
                    "as it was",
                    self.out,
                )
            raise
        finally:
            if self.tensorboard is not None:
                self.tensorboard.close()
            if self.stage is not None:
                self.stage.__exit__(None, None, None)  # removes the staged folder unless it was committed

    def _open_stage(self) -> None:
        if self.ctx.is_main and not self.opts.resume:
            self.out.absolute().parent.mkdir(parents=True, exist_ok=True)
            if self.lock is not None:
                self.lock.acquire()  # a no-op when train() could take it before (the parent existed)
            self.stage = StagedDir(self.out)
            self.stage.__enter__()
            self.run_dir = self.stage.path

    def _write_run_files(self) -> None:
        if not self.ctx.is_main:
            return
        if self.stage is not None:
            atomic_write_json(self.run_dir / RUN_MARKER, run_folder.marker())
        elif not self.folder.marked:  # resuming a run of the version before run.json
            atomic_write_json(self.out / RUN_MARKER, run_folder.marker())
        # a resumed session records the options it continues with (those given again included)
        atomic_write_json(self.run_dir / OPTIONS_JSON, options_dict(self.opts))

    def _log_start(self) -> None:
        logger.info("model: %s parameters, config %s", f"{self.n_params:,}", self.config.to_dict())
        self.task.describe(self.data, len(self.sampler), self.steps_per_epoch)

    def _train(self) -> None:
        opts, state = self.opts, self.state
        self.ctx.seed_rank_rng(opts.seed, state.step)  # ranks > 0: their own dropout masks
        self.model.train()
        self.first_step = state.step + 1
        self.started = time.monotonic()
        self.cpu_started = time.process_time()
        self.load_start = _load_average()
        self.stop_reason = (
            "max_steps" if opts.max_steps is not None and self.total_steps == opts.max_steps else "epochs"
        )
        self.window = _LogWindow()
        self.last_eval_step = state.history[-1]["step"] if state.history else -1
        self.progress = Progress(
            self.total_steps, state.step, opts.max_minutes, enabled=opts.progress and self.ctx.is_main
        )
        if opts.tensorboard is not None and self.ctx.is_main:
            self.tensorboard = TensorBoardLog(opts.tensorboard)
        try:
            self._epochs()
        finally:
            self.progress.close()

    def _epochs(self) -> None:
        """Epoch after epoch, step after step, until :meth:`_should_stop` or the patience runs out."""
        opts, state = self.opts, self.state
        if state.step >= self.total_steps:
            return
        while True:
            batches = self.sampler.batches(state.epoch)
            while state.batch_in_epoch < len(batches):
                if self._should_stop():
                    return
                self.step(batches[state.batch_in_epoch : state.batch_in_epoch + opts.update_freq])
                self._log_progress()
                if opts.eval_every and state.step % opts.eval_every == 0:
                    self.validate()
                    if opts.patience is not None and state.evals_since_best >= opts.patience:
                        self.stop_reason = "patience"
                        return
            state.epoch += 1
            state.batch_in_epoch = 0

    def _should_stop(self) -> bool:
        if self.state.step >= self.total_steps:
            return True
        minutes = self.opts.max_minutes
        if minutes is not None and self.ctx.any(self.elapsed() >= 60.0 * minutes):
            self.stop_reason = "max_minutes"
            return True
        return False

    def step(self, group: list[list[int]]) -> None:
        """One optimiser step over the batches ``group`` (``--update-freq`` of them)."""
        tok = self.tokenizer
        micro = [
            collate(
                [self.data.train_pairs[i] for i in idx],
                pad_id=tok.pad_id,
                bos_id=tok.bos_id,
                eos_id=tok.eos_id,
            ).to(self.device)
            for idx in group
        ]
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.zero_grad(set_to_none=True)
        try:
            loss_value, n_tokens = optim.accumulate_gradients(
                self.train_model,
                micro,
                pad_id=tok.pad_id,
                label_smoothing=self.opts.label_smoothing,
                ctx=self.ctx,
                scaler=self.scaler,
                autocast_dtype=self.autocast_dtype,
            )
        except RuntimeError as exc:  # torch.OutOfMemoryError (CUDA) is one too
            if not _out_of_memory(exc):
                raise
            longest = max(int(b.tgt_in.shape[1]) for b in micro)
            raise TrainingError(
                f"out of memory at step {self.state.step + 1} ({self.device.type}) on a batch of "
                f"--max-tokens {self.opts.max_tokens} padded tokens (targets up to {longest} tokens): lower "
                "--max-tokens, --max-len or the model size (raise --update-freq to keep the batch)"
            ) from None
        optim.optimizer_step(
            self.model, self.optimizer, self.scheduler, clip_norm=self.opts.clip_norm, scaler=self.scaler
        )
        self.state.step += 1
        self.state.batch_in_epoch += len(group)
        if not math.isfinite(loss_value):
            raise TrainingDiverged(
                f"training loss became {loss_value} at step {self.state.step}; "
                "try a smaller --lr-factor or a longer --warmup"
            )
        self.losses.append(loss_value)
        self.learning_rates.append(lr)
        self.window.loss += loss_value * n_tokens
        self.window.tokens += n_tokens

    def _log_progress(self) -> None:
        """The step's TensorBoard scalars, the log line every --log-every steps, the progress bar."""
        step, loss, lr = self.state.step, self.losses[-1], self.learning_rates[-1]
        if self.tensorboard is not None:
            self.tensorboard.step(step, loss, lr)
        if not (self.opts.log_every and step % self.opts.log_every == 0):
            self.progress.update(step)
            return
        window = self.window
        tokens_per_s = window.tokens / max(time.monotonic() - window.start, 1e-9)
        left, binding = self.progress.time_left(step)
        logger.info(
            "step %d/%d epoch %d loss %.4f lr %.2e %.0f target tokens/s%s",
            step,
            self.total_steps,
            self.state.epoch + 1,
            window.loss / window.tokens,
            lr,
            tokens_per_s,
            "" if left is None else f", about {format_duration(left)} left ({binding} budget)",
        )
        if self.tensorboard is not None:
            self.tensorboard.throughput(step, tokens_per_s)
        self.progress.update(step, loss=f"{window.loss / window.tokens:.3f}", lr=f"{lr:.1e}")
        self.window = _LogWindow()

    # ------------------------------------------------------------------ validation and checkpoints
    def validate(self) -> None:
        """Validate and save on rank 0 while the others wait; then every rank holds its record."""
        state = self.state
        diff = self.ctx.replica_difference(self.model)
        if diff:
            logger.warning(
                "the ranks' parameters differ from rank 0's by up to %.3g at step %d", diff, state.step
            )
        if self.ctx.is_main:
            improved = self._validation_record()
            self._save_checkpoints(improved)
        state.history, state.best, self.last_eval_step, state.evals_since_best = self.ctx.broadcast(
            (state.history, state.best, self.last_eval_step, state.evals_since_best)
        )

    def _validation_record(self) -> bool:
        """Validate the model, add the record to the history; whether it is a new best."""
        opts, state = self.opts, self.state
        t0 = time.monotonic()
        metrics = validation.validate(
            self.model,
            self.tokenizer,
            self.data.valid_examples,
            device=self.device,
            max_tokens=max(opts.max_tokens, 4000),
            label_smoothing=opts.label_smoothing,
            exact_examples=opts.eval_examples,
            pairs=self.data.valid_pairs,
            bleu=self.scores_text,
        )
        errors = metrics.pop("errors", [])
        signatures = {k: metrics.pop(k) for k in ("bleu_signature", "chrf_signature") if k in metrics}
        record = dict(
            step=state.step,
            epoch=state.epoch + state.batch_in_epoch / self.steps_per_epoch,
            elapsed_s=round(state.total_elapsed_s + self.elapsed(), 1),
            validation_s=round(time.monotonic() - t0, 1),
            **metrics,
        )
        state.history.append(record)
        self.last_eval_step = state.step
        improved = validation.is_improvement(record, state.best, self.best_metric)
        if signatures and not any("bleu_signature" in h for h in state.history[:-1]):
            record.update(signatures)
            logger.info(
                "validation scores: sacrebleu BLEU %s, chrF %s",
                signatures.get("bleu_signature"),
                signatures.get("chrf_signature"),
            )
        validation.log_validation(record, improved, errors)
        if self.tensorboard is not None:
            self.tensorboard.validation(record)
        if improved:
            state.best = record
            state.evals_since_best = 0
        else:
            state.evals_since_best += 1
        return improved

    def _save_checkpoints(self, improved: bool) -> None:
        """best/ (when ``improved``), checkpoints/step-N/ (``--keep-last``), last/, then summary.json."""
        state, provenance, extra = self.state, self.task.provenance, self.task.model_files
        if improved:
            run_folder.save_checkpoint(
                self.run_dir, "best", self.model, self.tokenizer, provenance=provenance, extra_files=extra
            )
        if self.opts.keep_last:
            run_folder.save_step_checkpoint(
                self.run_dir,
                state.step,
                self.model,
                self.tokenizer,
                self.opts.keep_last,
                provenance,
                extra_files=extra,
            )
        snapshot = dict(
            dataclasses.asdict(state),
            total_elapsed_s=state.total_elapsed_s + self.elapsed(),
            batch_in_epoch=self.ctx.global_position(state.batch_in_epoch),
            world_size=self.ctx.world_size,
        )
        run_folder.save_checkpoint(
            self.run_dir,
            "last",
            self.model,
            self.tokenizer,
            self.optimizer,
            self.scheduler,
            snapshot,
            provenance=provenance,
            extra_files=extra,
        )
        if (
            self.stage is not None and not self.stage.committed
        ):  # a new run's first checkpoint: --output-dir now
            run_folder.commit_run(self.stage, self.folder)
            self.run_dir = self.out
        atomic_write_json(
            self.run_dir / SUMMARY_JSON, self._running_summary()
        )  # an interrupted run keeps its numbers

    # ------------------------------------------------------------------ the end
    def _running_summary(self) -> dict:
        state = self.state
        return dict(
            running=True,
            options=options_dict(self.opts),
            config=self.config.to_dict(),
            parameters=self.n_params,
            steps=state.step,
            steps_per_epoch=self.steps_per_epoch,
            best_metric=self.best_metric,
            best=state.best,
            history=state.history,
            data=self.data.report,
            tokenizer=_tokenizer_info(self.tokenizer),
            world_size=self.ctx.world_size,
            torch=torch.__version__,
            threads=torch.get_num_threads(),
            load_average=_load_average(),
        )

    def _finish(self) -> TrainResult:
        """Log the session, run the task's final check, write summary.json and the --export copy."""
        state, ctx = self.state, self.ctx
        session_s = self.elapsed()
        session_cpu_s = time.process_time() - self.cpu_started
        state.total_elapsed_s += session_s
        logger.info(
            "training stopped (%s) at step %d after %.1f s wall, %.1f s process CPU (%.1f s wall in all "
            "sessions; load average %s)",
            self.stop_reason,
            state.step,
            session_s,
            session_cpu_s,
            state.total_elapsed_s,
            _load_average(),
        )
        heldout = None
        if self.opts.final_eval and ctx.is_main:
            heldout = self.task.final_check(self.out / "best", self.device)
        result = TrainResult(
            out_dir=str(self.out),
            config=self.config.to_dict(),
            step=state.step,
            first_step=self.first_step,
            epoch=state.epoch,
            losses=self.losses,
            learning_rates=self.learning_rates,
            history=state.history,
            best=state.best,
            heldout=heldout,
            elapsed_s=session_s,
            total_elapsed_s=state.total_elapsed_s,
            stop_reason=self.stop_reason,
            world_size=ctx.world_size,
            model=self.model,
        )
        if ctx.is_main:
            summary = self._final_summary(result, session_s, session_cpu_s)
            atomic_write_json(self.out / SUMMARY_JSON, summary)
            if self.export_dir is not None:
                with run_folder.disk_errors("--export", self.export_dir):
                    run_folder.export_model(self.out / "best", self.export_dir, summary, self.tokenizer.files)
        ctx.close()
        return result

    def _final_summary(self, result: TrainResult, session_s: float, session_cpu_s: float) -> dict:
        return dict(
            options=options_dict(self.opts),
            config=result.config,
            parameters=self.n_params,
            steps=result.step,
            epochs=result.epoch + self.state.batch_in_epoch / self.steps_per_epoch,
            steps_per_epoch=self.steps_per_epoch,
            train_seconds=round(result.total_elapsed_s, 1),
            stop_reason=result.stop_reason,
            best=result.best,
            heldout=result.heldout,
            world_size=self.ctx.world_size,
            torch=torch.__version__,
            threads=torch.get_num_threads(),
            best_metric=self.best_metric,
            history=self.state.history,
            data=self.data.report,
            tokenizer=_tokenizer_info(self.tokenizer),
            last_session=dict(
                wall_seconds=round(session_s, 1),
                process_cpu_seconds=round(session_cpu_s, 1),
                load_average_start=self.load_start,
                load_average_end=_load_average(),
                cpu_count=os.cpu_count(),
            ),
        )


# ---------------------------------------------------------------------- the entry point
def have_sacrebleu() -> bool:
    try:
        import sacrebleu  # noqa: F401
    except ImportError:
        return False
    return True


def _check_metric_available(task: Task) -> None:
    """Refuse, before anything is done, options whose packages are not installed (sacrebleu for
    --best-metric bleu/chrf and --test, tensorboard for --tensorboard)."""
    if task.opts.tensorboard is not None and not have_tensorboard():
        raise TrainingError(
            f"--tensorboard {task.opts.tensorboard} needs the tensorboard package, which is not installed: "
            "pip install tensorboard (or the [tensorboard] extra)"
        )
    if task.opts.test_files is not None and not have_sacrebleu():
        raise TrainingError(
            "--test scores the best model with BLEU and chrF and needs the sacrebleu package, which is "
            "not installed: pip install sacrebleu==2.6.0 (or the [eval] extra)"
        )
    metric = task.best_metric
    if metric in ("bleu", "chrf") and not have_sacrebleu():
        default = "" if task.opts.best_metric else f" (the default of a {task.name} run)"
        raise TrainingError(
            f"--best-metric {metric}{default} needs the sacrebleu package, which is not installed: "
            "pip install sacrebleu==2.6.0 (or the [eval] extra), or choose --best-metric loss"
        )


def _resumed_options(opts: TrainOptions, out: Path, last: Path, given: frozenset) -> TrainOptions:
    """``opts`` completed from the run saved in ``out`` (see :func:`.options.merge_resume_options`)."""
    if not (last / STATE_JSON).is_file():
        raise TrainingError(f"cannot resume: no saved checkpoint in {out} ({last / STATE_JSON} not found)")
    path = out / OPTIONS_JSON
    saved = run_folder.read_json_file(path, "the options of the run")
    try:
        if not isinstance(saved, dict):
            raise TrainingError("not a JSON object")
        run_opts, present = saved_options(saved)
    except (TrainingError, TypeError, ValueError) as exc:
        raise TrainingError(f"cannot resume: {path} does not hold valid options: {exc}") from None
    opts = merge_resume_options(opts, run_opts, present, given, out)
    check_options(opts)
    return opts


def train(
    options: Optional[TrainOptions] = None, *, given_options: Optional[Iterable[str]] = None, **overrides: Any
) -> TrainResult:
    """Train (or resume) a model as described by ``options`` (plus keyword overrides).

    Resuming (``resume=True``) continues the run as it was started: the options that are not
    given for this session come from the run's ``train_options.json``; an option given again
    replaces the run's (a run-defining one, such as the model size or the data, only with the
    run's own value). ``given_options`` names the fields given (the command line's flags); when
    None, a field counts as given when it differs from :class:`TrainOptions`' default, and every
    keyword override counts as given.

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
    opts = dataclasses.replace(options or TrainOptions(), **overrides)
    given = frozenset(given_fields(opts) if given_options is None else given_options) | frozenset(overrides)
    check_options(opts)
    out = Path(opts.out_dir)
    folder = run_folder.inspect_out(out)
    run_folder.check_out(folder, resume=opts.resume, overwrite=opts.overwrite)
    if opts.resume:
        opts = _resumed_options(opts, out, run_folder.last_dir(out), given)
    _check_outputs(opts, out)
    export_dir = run_folder.check_export_dir(opts.export_dir, out)
    # single process, or one rank of a torchrun job (nccl on cuda, gloo on cpu)
    ctx = distributed.setup(parse_device(opts.device))
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    lock = _lock_run(out, ctx)
    try:
        trainer = _prepare(opts, ctx, folder, export_dir)
        trainer.lock = lock
        return trainer.run()
    finally:
        lock.release()


def _check_outputs(opts: TrainOptions, out: Path) -> None:
    """--output-dir, --export and --tensorboard overlap no input, and lie in no training run's managed folders."""
    inputs = [
        (f"the {flag} file", path)
        for flag, paths in (
            ("--train", opts.train_files),
            ("--valid", opts.valid_files),
            ("--train-tsv", opts.train_tsv and (opts.train_tsv,)),
            ("--valid-tsv", opts.valid_tsv and (opts.valid_tsv,)),
            ("--test", opts.test_files),
        )
        for path in paths or ()
    ]
    check_output_path(
        out, inputs=inputs, managed_dirs=run_folder.managed_dirs(out, include_self=False), what="--output-dir"
    )
    own = [(f"the run folder's {name}/", out / name) for name in run_folder.MANAGED_DIRS]
    for flag, path in (("--export", opts.export_dir), ("--tensorboard", opts.tensorboard)):
        if path is not None:
            check_output_path(
                path, inputs=inputs, managed_dirs=own + run_folder.managed_dirs(path), what=flag
            )
    if (
        opts.tensorboard is not None
        and Path(opts.tensorboard).exists()
        and not Path(opts.tensorboard).is_dir()
    ):
        raise TrainingError(f"--tensorboard {opts.tensorboard} is a file; give a folder for the event files")


def _lock_run(out: Path, ctx: distributed.Context) -> run_folder.RunLock:
    """Rank 0 locks the run folder (where its parent exists: else when it is created); every rank
    raises when that fails."""
    lock = run_folder.RunLock(out)
    error: Optional[BaseException] = None
    if ctx.is_main and out.absolute().parent.is_dir():
        try:
            with run_folder.disk_errors("--output-dir", out):
                lock.acquire()
        except TrainingError as exc:
            error = exc
    message = ctx.broadcast(None if error is None else str(error))
    if error is not None:
        raise error
    if message is not None:
        raise TrainingError(message)
    return lock


def _prepare(opts: TrainOptions, ctx: distributed.Context, folder: RunFolder, export_dir) -> Trainer:
    """The task's data, the tokenizer and model (new, or the run's), checked: a Trainer ready to run."""
    from ..checkpoint import load_model
    from ..spm_tokenizer import load_any_tokenizer

    last = run_folder.last_dir(folder.path)
    task = task_for(opts)
    _check_metric_available(task)
    task.load_data(ctx)
    if opts.resume:
        tokenizer, model = load_any_tokenizer(last), load_model(last, ctx.device)
    else:
        tokenizer = task.build_tokenizer(ctx)
        model = task.build_model(tokenizer, ctx.device)
    data = task.encode(tokenizer, model.config)
    trainer = Trainer(opts, task, ctx, model, tokenizer, data, folder, export_dir)
    if opts.resume:
        trainer.restore(last)
    return trainer
