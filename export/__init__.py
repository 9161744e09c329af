"""What produces and checks export artifacts of transformer_ext models.

* ``python -m export.onnx`` / :func:`export.onnx.export_onnx`: ``encoder.onnx``,
  ``decoder_step.onnx``, ``manifest.json``, the tokenizer files and ``generation.json``
  (docs/DESIGN.md section 3), validated against eager PyTorch before the folder appears.
* ``python -m export.tensorrt``: TensorRT engines of an export folder; ``python -m export.triton``:
  a Triton model repository.

The runners that run the exported graphs live in :mod:`transformer_ext.runtimes`; what they and
this package both need of the folder's format (names, the manifest reader, dtypes, the errors
below that readers raise) is :mod:`transformer_ext.export_format`. This module defines the typed
errors of the package and imports nothing heavy. Every error here is a
:class:`transformer_ext.cli.UserError`: the command line tools report it as one line.
"""

from __future__ import annotations

# Raised by readers of export folders too, so defined next to the format (the same classes).
from transformer_ext.export_format import ExportError, GenerationConfigError, InvalidGraphError, ManifestError

__all__ = [
    "ExportError",
    "ModelDirectoryError",
    "OutputFolderError",
    "GraphContractError",
    "InvalidGraphError",
    "ManifestError",
    "GenerationConfigError",
    "ParityError",
]


class ModelDirectoryError(ExportError, FileNotFoundError):
    """The model folder to export is missing, or is not a model folder (config.json + weights)."""


class OutputFolderError(ExportError):
    """The output path cannot be written or replaced: it is a file, it holds files this package did
    not write, or it overlaps the input."""


class GraphContractError(ExportError):
    """An exported graph breaks the contract of docs/DESIGN.md section 3 (names, axes, forbidden ops...)."""


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
