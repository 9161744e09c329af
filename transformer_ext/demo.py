"""The demo: the bundled demo model folder (:data:`DEMO_MODEL_DIR`, English number words to
German number words, what ``Translator.from_model_dir()`` and the commands load without
``--model``), and example sentences of the demo task (:mod:`transformer_ext.data`) for the
commands that show a few translations (``python -m export.onnx`` prints some after exporting
the demo model).

Held-out sources come from the demo split, which needs ``num2words`` (and torch, through
:mod:`transformer_ext.data`); without them a short fixed list of sources, without references.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

__all__ = ["DEMO_MODEL_DIR", "FALLBACK_SOURCES", "heldout_examples"]

# Installed as package data, produced by the project's own training command.
DEMO_MODEL_DIR = Path(__file__).resolve().parent / "demo_model"

# Shown when the demo split cannot be computed; the demo model translates them.
FALLBACK_SOURCES = (
    "forty-two",
    "three hundred and seven",
    "one thousand and one",
    "nineteen",
    "five thousand",
)


def heldout_examples(n: int) -> list[tuple[str, Optional[str]]]:
    """``n`` ``(source, reference)`` pairs spread over the demo task's held-out numbers (never
    trained on); ``(source, None)`` pairs of :data:`FALLBACK_SOURCES` when ``num2words`` or torch
    is not installed. ``n <= 0`` gives none."""
    if n <= 0:
        return []
    try:
        from . import data

        numbers = data.split_numbers().heldout
        step = max(1, len(numbers) // n)
        picked = numbers[::step][:n]
        return [(data.source_text(x), data.target_text(x)) for x in picked]
    except ImportError:
        return [(s, None) for s in FALLBACK_SOURCES[:n]]
