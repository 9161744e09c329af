"""What a training session shows of its progress, and TensorBoard logging.

* :func:`time_left`: the time a session still needs, measured against the budget that binds:
  the steps left (``--max-steps``/``--epochs``) at this session's rate, or what is left of
  ``--max-minutes``, whichever ends first.
* :class:`Progress`: on a terminal a tqdm bar whose length is the number of steps the session
  will reach (with ``--max-minutes``: the steps that fit in the time left), so its estimate is
  the binding budget's; when stderr is not a terminal (a log file, a pipe, a batch job) no bar
  frames at all, a plain log line every ``interval_s`` seconds instead.
* :class:`TensorBoardLog`: ``--tensorboard DIR``: training loss, learning rate and target tokens per
  second, and every validation metric, as TensorBoard scalars (``torch.utils.tensorboard``, which
  needs the ``tensorboard`` package: the ``tensorboard`` extra).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Optional

logger = logging.getLogger(__name__)

__all__ = ["time_left", "format_duration", "Progress", "TensorBoardLog", "have_tensorboard"]


def time_left(
    step: int, first_step: int, total_steps: int, elapsed_s: float, max_minutes: Optional[float]
) -> tuple[Optional[float], str]:
    """``(seconds left, the binding budget: "steps" or "minutes")`` after ``step`` of a session that
    started at ``first_step`` and has run ``elapsed_s`` seconds; None seconds while nothing tells
    (no step done yet and no time budget)."""
    by_minutes = None if max_minutes is None else max(0.0, 60.0 * max_minutes - elapsed_s)
    done = step - first_step + 1
    if done <= 0 or elapsed_s <= 0:
        return (by_minutes, "minutes") if by_minutes is not None else (None, "steps")
    by_steps = max(0, total_steps - step) * elapsed_s / done
    if by_minutes is not None and by_minutes < by_steps:
        return by_minutes, "minutes"
    return by_steps, "steps"


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """The progress of one session: a bar on a terminal, log lines otherwise (see the module docstring)."""

    def __init__(
        self,
        total_steps: int,
        initial_step: int,
        max_minutes: Optional[float],
        *,
        enabled: bool,
        interactive: Optional[bool] = None,
        interval_s: float = 60.0,
    ):
        self.total_steps, self.first_step, self.max_minutes = total_steps, initial_step + 1, max_minutes
        self.started = time.monotonic()
        self.interval_s = interval_s
        self.last_line = self.started
        if interactive is None:
            interactive = sys.stderr.isatty()
        self.bar = None
        self.plain = enabled and not interactive
        if enabled and interactive:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=total_steps,
                initial=initial_step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                leave=False,
            )

    def time_left(self, step: int) -> tuple[Optional[float], str]:
        return time_left(step, self.first_step, self.total_steps, self.elapsed(), self.max_minutes)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def describe(self, step: int) -> str:
        """``step 23/2500 (0.9%), 1:51 elapsed, about 10:09 left (--max-minutes 12 binds)``."""
        left, binding = self.time_left(step)
        text = (
            f"step {step}/{self.total_steps} ({100.0 * step / max(self.total_steps, 1):.1f}%), "
            f"{format_duration(self.elapsed())} elapsed"
        )
        if left is not None:
            budget = f"--max-minutes {self.max_minutes:g}" if binding == "minutes" else "the step budget"
            text += f", about {format_duration(left)} left ({budget} binds)"
        return text

    def update(self, step: int, **postfix: str) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if self.max_minutes is not None:
                left, binding = self.time_left(step)
                done = step - self.first_step + 1
                if binding == "minutes" and left is not None and done > 0:
                    reachable = step + int(left * done / max(self.elapsed(), 1e-9))
                    self.bar.total = min(self.total_steps, max(reachable, step))
            if postfix:
                self.bar.set_postfix(**postfix)
            else:
                self.bar.refresh()
        elif self.plain and time.monotonic() - self.last_line >= self.interval_s:
            self.last_line = time.monotonic()
            logger.info("progress: %s", self.describe(step))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def have_tensorboard() -> bool:
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return False
    return True


class TensorBoardLog:
    """Scalars of a session in ``log_dir`` (``train/*`` per step, ``valid/*`` per validation)."""

    VALID_METRICS = ("loss", "nll", "exact_match", "bleu", "chrf")

    def __init__(self, log_dir):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def step(self, step: int, loss: float, lr: float) -> None:
        self.writer.add_scalar("train/loss", loss, step)
        self.writer.add_scalar("train/lr", lr, step)

    def throughput(self, step: int, tokens_per_s: float) -> None:
        self.writer.add_scalar("train/target_tokens_per_s", tokens_per_s, step)

    def validation(self, record: dict) -> None:
        for name in self.VALID_METRICS:
            if name in record:
                self.writer.add_scalar(f"valid/{name}", record[name], record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
