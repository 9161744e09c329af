"""The errors of a training run."""

from __future__ import annotations

from ..cli import UsageError, UserError

__all__ = ["TrainingError", "TrainingDiverged", "TrainingUsageError"]


class TrainingError(UserError, ValueError):
    """Bad training options, a run folder that cannot be used as asked, or saved files that cannot
    be resumed."""


class TrainingDiverged(TrainingError, FloatingPointError):
    """The training loss became NaN or infinite (the options, typically the learning rate, do not work)."""


class TrainingUsageError(TrainingError, UsageError):
    """An option value out of its range, or options that exclude each other (exit code 2 in the CLI)."""
