"""Training an encoder-decoder Transformer the paper's way; ``python -m transformer_ext.train`` is its CLI.

One concern per module:

* :mod:`.options`: :class:`TrainOptions`, every option check, the presets' model config.
* :mod:`.tasks`: a :class:`~.tasks.Task` per kind of run (the demo number task, parallel text):
  its data, tokenizer, model, default metric and final check.
* :mod:`.optim`: schedules, the optimiser, the label-smoothed loss, gradient accumulation.
* :mod:`.validation`: what a validation measures (:func:`validate`), which record is the best.
* :mod:`.run_folder`: the run folder ``--output-dir`` (marker, staged first checkpoint, best/last/step-N,
  resume state, the ``--export`` copy).
* :mod:`.trainer`: :func:`train` and the :class:`~.trainer.Trainer` that runs a session.
* :mod:`.progress`: the progress display (against the budget that binds) and ``--tensorboard``.
* :mod:`.errors`: :class:`TrainingError` (exit 1 in the CLI), :class:`~.errors.TrainingUsageError`
  (an option out of range or options that exclude each other: exit 2).
* :mod:`.distributed`: multi-process training under ``torchrun`` (DistributedDataParallel).
"""

from .errors import TrainingDiverged, TrainingError
from .optim import inverse_sqrt_lr, make_optimizer, make_scheduler, noam_lr, token_loss
from .options import TrainOptions, build_config
from .trainer import TrainResult, train
from .validation import validate

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
    "validate",
    "train",
]
