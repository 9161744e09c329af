"""Fine-tuning converted T5 and mBART-50 checkpoints with ``python -m transformer_ext.train
--init-from MODEL_DIR``: a few steps on parallel text, the validation loss falls, the model keeps
its architecture, and the result loads and decodes."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from hf_checkpoints import sample_lines, write_mbart50, write_t5  # noqa: E402

from transformer_ext.checkpoint import load_model  # noqa: E402
from transformer_ext.convert import convert_transformers  # noqa: E402
from transformer_ext.train import main as train_main  # noqa: E402

CHECKPOINTS = {
    "t5_v1_1": lambda p: write_t5(p, variant="t5_v1_1", seed=12, layers=1),
    "mbart50": lambda p: write_mbart50(p, seed=13, layers=1),
}


def _parallel(tmp_path, n: int, seed: int, name: str) -> list[str]:
    src = sample_lines(n, seed)
    tgt = [" ".join(reversed(line.split())) for line in src]  # a task the model can learn
    s, t = tmp_path / f"{name}.src", tmp_path / f"{name}.tgt"
    s.write_text("\n".join(src) + "\n", encoding="utf-8")
    t.write_text("\n".join(tgt) + "\n", encoding="utf-8")
    return [str(s), str(t)]


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_fine_tuning_from_the_command_line_lowers_the_loss(tmp_path, name):
    model_dir = convert_transformers(CHECKPOINTS[name](tmp_path / "hf"), tmp_path / "model")
    run = tmp_path / "run"
    argv = ["--init-from", str(model_dir), "--out", str(run)]
    argv += [
        "--train",
        *_parallel(tmp_path, 200, 1, "train"),
        "--valid",
        *_parallel(tmp_path, 20, 2, "valid"),
    ]
    argv += ["--max-steps", "30", "--eval-every", "10", "--warmup", "5", "--lr-factor", "1.0"]
    argv += [
        "--max-tokens",
        "1500",
        "--best-metric",
        "loss",
        "--no-progress",
        "--no-final-eval",
        "--seed",
        "3",
    ]
    assert train_main(argv) == 0
    history = json.loads((run / "summary.json").read_text())["history"]
    losses = [h["loss"] for h in history]
    assert len(losses) >= 3 and all(b < a for a, b in zip(losses, losses[1:])), (
        losses
    )  # every validation lower
    assert losses[-1] < 0.95 * losses[0], losses
    best = load_model(run / "best")
    assert best.config == load_model(model_dir).config  # architecture and special ids unchanged
