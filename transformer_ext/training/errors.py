"""The errors of a training run."""

from __future__ import annotations

from ..cli import UserError

__all__ = ["TrainingError", "TrainingDiverged"]


class TrainingError(UserError, ValueError):
    """Bad training options, a run folder that cannot be used as asked, or saved files that cannot
    be resumed."""


class TrainingDiverged(TrainingError, FloatingPointError):
    """The training loss became NaN or infinite (the options, typically the learning rate, do not work)."""
