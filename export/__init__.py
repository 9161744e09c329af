"""Export of transformer_ext models to ONNX (and the runtimes that run the exported graphs).

* ``python -m export.onnx`` / :func:`export.onnx.export_onnx`: ``encoder.onnx``,
  ``decoder_step.onnx`` and ``manifest.json`` (DESIGN.md section 3), validated against eager
  PyTorch before the folder appears.
* :class:`export.ort_runner.OrtRunner`: the ONNX Runtime runner; it needs only numpy and
  onnxruntime (no torch).

This module defines the typed errors shared by all of them and imports nothing heavy, so that
``import export.ort_runner`` works where torch is not installed. Every error here is a
:class:`transformer_ext.cli.UserError`: the command line tools report it as one line.
"""

from __future__ import annotations

from transformer_ext.cli import UserError

__all__ = [
    "ExportError",
    "ModelDirectoryError",
    "OutputFolderError",
    "GraphContractError",
    "InvalidGraphError",
    "ManifestError",
    "ParityError",
]


class ExportError(UserError):
    """Base class of every error raised by the export package."""


class ModelDirectoryError(ExportError, FileNotFoundError):
    """The model folder to export is missing, or is not a model folder (config.json + weights)."""


class OutputFolderError(ExportError):
    """The output path cannot be written or replaced: it is a file, it holds files this package did
    not write, or it overlaps the input."""


class GraphContractError(ExportError):
    """An exported graph breaks the contract of DESIGN.md section 3 (names, axes, forbidden ops...)."""


class InvalidGraphError(ExportError):
    """An ``.onnx`` file is missing, corrupt or cannot be loaded by the runtime."""


class ManifestError(ExportError):
    """``manifest.json`` is missing, invalid, or does not describe the graphs next to it."""


class ParityError(ExportError):
    """An exported graph disagrees with eager PyTorch by more than the tolerance.

    Attributes:
        output: the name of the output (``logits``, ``cross_key.1``, ``greedy tokens``...).
        step: the decoding step (``None`` for a single forward pass).
        max_diff: the largest absolute difference found.
        tolerance: the tolerance it exceeded.
        case: a short description of the inputs (shapes, lengths).
    """

    def __init__(self, output: str, step: int | None, max_diff: float, tolerance: float, case: str = ""):
        self.output = output
        self.step = step
        self.max_diff = float(max_diff)
        self.tolerance = float(tolerance)
        self.case = case
        where = f" at step {step}" if step is not None else ""
        on = f" on {case}" if case else ""
        super().__init__(
            f"ONNX output {output!r}{where} differs from eager PyTorch by {self.max_diff:.3g} "
            f"> tolerance {self.tolerance:.3g}{on}"
        )

    def __reduce__(self):  # keep the attributes through pickling (pytest-xdist, multiprocessing)
        return (type(self), (self.output, self.step, self.max_diff, self.tolerance, self.case))
