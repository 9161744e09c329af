"""What the export tests of converted transformers checkpoints share (tests/test_t5_export.py,
tests/test_mbart_export.py): step logits through ONNX Runtime, transformers' generate() on given
ids, and text translated from an export folder in a process where torch cannot be imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

_TORCH_FREE = """
import json, sys
sys.modules["torch"] = None  # a deployment without torch
from transformer_ext.translator import Translator

out = []
for spec in json.loads(sys.argv[1]):
    translator = Translator.from_export_dir(
        spec["dir"], source_lang=spec.get("source_lang"), target_lang=spec.get("target_lang")
    )
    encoded = translator.encode(spec["texts"])
    beam = [t.hypotheses[0].tokens for t in translator.translate_detailed(spec["texts"])]
    greedy = [t.hypotheses[0].tokens for t in translator.translate_detailed(spec["texts"], beam_size=1)]
    out.append({"encoded": encoded, "beam": beam, "greedy": greedy})
print(json.dumps(out))
assert "torch" not in [m.split(".")[0] for m in sys.modules if sys.modules[m] is not None]
"""


def translate_without_torch(specs: list[dict]) -> list[dict]:
    """For each ``{"dir", "texts", "source_lang"?, "target_lang"?}``: the sources' ids, the beam
    (the folder's generation config) and greedy tokens of ``Translator.from_export_dir``, run in a
    child process where ``import torch`` fails."""
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run(
        [sys.executable, "-c", _TORCH_FREE, json.dumps(specs)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def padded(sources: list[list[int]], pad: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.full((len(sources), max(len(s) for s in sources)), pad, dtype=np.int64)
    for i, s in enumerate(sources):
        ids[i, : len(s)] = s
    return ids, np.array([len(s) for s in sources], dtype=np.int64)


def generate(hf_model, sources: list[list[int]], pad: int, **kwargs) -> list[list[int]]:
    """transformers' ``generate()`` on the right-padded ``sources``: the rows without the decoder start."""
    ids, lengths = padded(sources, pad)
    mask = torch.arange(ids.shape[1])[None, :] < torch.from_numpy(lengths)[:, None]
    with torch.no_grad():
        out = hf_model.generate(input_ids=torch.from_numpy(ids), attention_mask=mask.long(), **kwargs)
    return out[:, 1:].tolist()


def transformers_reference(hf_dir: str, ids, mask, tgt) -> tuple[np.ndarray, float]:
    """transformers' teacher-forced logits in float64 and the validator's bound on a float32
    implementation's distance from them (:func:`export.validate.allowed_difference`: 1e-4 of the
    logits' range, or 8 times transformers' own float32 distance from its float64 where larger)."""
    from transformers import AutoModelForSeq2SeqLM

    from export.validate import allowed_difference

    model = AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval()
    feeds = dict(input_ids=ids, attention_mask=mask.long(), decoder_input_ids=tgt)
    with torch.no_grad():
        ref32 = model(**feeds).logits.numpy()
        ref64 = model.double()(**feeds).logits.numpy()
    scale = max(1.0, float(np.abs(ref64).max()))
    return ref64, allowed_difference(1e-4 * scale, float(np.abs(ref32 - ref64).max()))


def ort_step_logits(export_dir, ids: np.ndarray, lengths: np.ndarray, tgt: np.ndarray) -> np.ndarray:
    """``[B, T, V]``: ONNX Runtime's logits of each decoder step of the export, fed ``tgt [B, T]``."""
    from transformer_ext.runtimes import OrtRunner

    runner = OrtRunner(export_dir, intra_op_num_threads=2)
    state = runner.encode(ids, lengths, tgt.shape[1], 1)
    return np.stack([np.asarray(runner.step(state, tgt[:, t])) for t in range(tgt.shape[1])], axis=1)
