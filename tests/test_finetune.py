"""Fine-tuning a converted checkpoint: ``python -m transformer_ext.train --init-from MODEL_DIR``
(transformer_ext.training.tasks.FineTuneTask)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from hf_checkpoints import sample_lines, write_marian  # noqa: E402

from transformer_ext.checkpoint import load_model  # noqa: E402
from transformer_ext.convert import convert_transformers  # noqa: E402
from transformer_ext.tokenizer import load_tokenizer  # noqa: E402
from transformer_ext.training.errors import TrainingError  # noqa: E402
from transformer_ext.training.trainer import train  # noqa: E402


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    hf = write_marian(root / "hf", layers=1, seed=9)
    return convert_transformers(hf, root / "model")


def _parallel(tmp_path, n: int, seed: int, name: str):
    src = sample_lines(n, seed)
    tgt = [" ".join(reversed(line.split())) for line in src]  # a task the model can learn
    s, t = tmp_path / f"{name}.src", tmp_path / f"{name}.tgt"
    s.write_text("\n".join(src) + "\n", encoding="utf-8")
    t.write_text("\n".join(tgt) + "\n", encoding="utf-8")
    return str(s), str(t)


def test_fine_tuning_lowers_the_loss_and_keeps_the_architecture(converted, tmp_path):
    result = train(
        out_dir=str(tmp_path / "run"),
        init_from=str(converted),
        train_files=_parallel(tmp_path, 200, 1, "train"),
        valid_files=_parallel(tmp_path, 20, 2, "valid"),
        max_steps=40,
        eval_every=0,
        warmup=10,
        lr_factor=1.0,
        max_tokens=1500,
        best_metric="loss",
        progress=False,
        seed=3,
    )
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert last < 0.8 * first, result.losses
    best = load_model(tmp_path / "run" / "best")
    assert best.config == load_model(converted).config  # architecture and special ids unchanged
    assert load_tokenizer(tmp_path / "run" / "best").to_dict() == load_tokenizer(converted).to_dict()


@pytest.mark.parametrize(
    "extra, flags",
    [
        (dict(d_model=64), "--d-model (d_model)"),
        (
            dict(tokenizer="sentencepiece", vocab_size=100),
            "--tokenizer (tokenizer), --vocab-size (vocab_size)",
        ),
    ],
)
def test_architecture_options_with_init_from_are_errors(converted, tmp_path, extra, flags):
    message = f"takes the architecture and tokenizer from that model folder; drop {flags}"
    with pytest.raises(TrainingError, match=message.replace("(", r"\(").replace(")", r"\)")):
        train(
            out_dir=str(tmp_path / "run"),
            init_from=str(converted),
            train_files=_parallel(tmp_path, 10, 1, "train"),
            valid_files=_parallel(tmp_path, 5, 2, "valid"),
            **extra,
        )
    assert not (tmp_path / "run").exists()


def test_init_from_needs_parallel_text(converted, tmp_path):
    with pytest.raises(TrainingError, match="--init-from fine-tunes on parallel text"):
        train(out_dir=str(tmp_path / "run"), init_from=str(converted))


def test_fine_tuned_folders_carry_the_generation_defaults_and_the_init_model(converted, tmp_path):
    """best/, last/, checkpoints/step-N/, the --export copy and an average of the step folders hold
    the converted model's generation_defaults.json byte for byte and a provenance naming the init
    model (its folder, the SHA-256 of its config and weights, its own provenance.json), so that the
    translator decodes the fine-tuned model as the checkpoint's generate() does."""
    import hashlib
    import json

    from transformer_ext.average import average_checkpoints
    from transformer_ext.translator import Translator

    run, export = tmp_path / "run", tmp_path / "exported"
    train(
        out_dir=str(run),
        init_from=str(converted),
        train_files=_parallel(tmp_path, 40, 1, "train"),
        valid_files=_parallel(tmp_path, 8, 2, "valid"),
        max_steps=4,
        eval_every=2,
        keep_last=2,
        warmup=1,
        max_tokens=800,
        best_metric="loss",
        export_dir=str(export),
        progress=False,
        seed=3,
    )
    steps = sorted((run / "checkpoints").iterdir())
    assert len(steps) == 2
    average = average_checkpoints(steps, tmp_path / "average")
    defaults = (converted / "generation_defaults.json").read_bytes()
    own = json.loads((converted / "provenance.json").read_text())
    sha = {
        n: hashlib.sha256((converted / n).read_bytes()).hexdigest()
        for n in ("config.json", "model.safetensors")
    }
    for folder in [run / "best", run / "last", *steps, export, average]:
        assert (folder / "generation_defaults.json").read_bytes() == defaults, folder
        init = json.loads((folder / "provenance.json").read_text())["init_from"]
        assert init == {"model_dir": str(converted.resolve()), "files": sha, "provenance": own}, folder
    translator = Translator.from_model_dir(run / "best")
    banned = json.loads(defaults)["banned_ids"]
    assert banned and translator.pretrained.banned_ids == tuple(banned)


def test_average_refuses_checkpoints_with_different_generation_defaults(converted, tmp_path):
    import shutil

    from transformer_ext.average import AverageError, average_checkpoints

    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(converted, a)
    shutil.copytree(converted, b)
    (b / "generation_defaults.json").unlink()
    with pytest.raises(AverageError, match="generation_defaults.json .*differ"):
        average_checkpoints([a, b], tmp_path / "avg")
    assert not (tmp_path / "avg").exists()


def _short_run(converted, tmp_path, init_from, **extra):
    return train(
        out_dir=str(tmp_path / "run"),
        init_from=str(init_from),
        train_files=_parallel(tmp_path, 40, 1, "train"),
        valid_files=_parallel(tmp_path, 8, 2, "valid"),
        max_steps=2,
        eval_every=1,
        warmup=1,
        max_tokens=800,
        best_metric="loss",
        progress=False,
        seed=3,
        **extra,
    )


def test_resume_needs_only_the_run_folder(converted, tmp_path):
    """The run folder holds the model, tokenizer, generation defaults and provenance: resuming
    works after the --init-from folder moved, and the model folders keep what they had."""
    import shutil

    init = tmp_path / "init"
    shutil.copytree(converted, init)
    _short_run(converted, tmp_path, init)
    last = tmp_path / "run" / "last"
    before = {n: (last / n).read_bytes() for n in ("generation_defaults.json", "provenance.json")}
    init.rename(tmp_path / "moved")
    result = train(out_dir=str(tmp_path / "run"), resume=True, max_steps=4, progress=False)
    assert result.step == 4 and result.first_step == 3
    for name, content in before.items():
        assert (last / name).read_bytes() == content, name
        assert (tmp_path / "run" / "best" / name).read_bytes() == content, name


def test_resume_with_init_from_names_the_run_s_model(converted, tmp_path):
    """--resume with --init-from: the run's own folder is accepted (the data come from the run),
    another one is refused naming both."""
    from transformer_ext.training.errors import TrainingUsageError

    _short_run(converted, tmp_path, converted)
    train(out_dir=str(tmp_path / "run"), resume=True, init_from=str(converted), max_steps=3, progress=False)
    with pytest.raises(TrainingUsageError) as info:
        train(out_dir=str(tmp_path / "run"), resume=True, init_from=str(tmp_path / "other"), progress=False)
    text = str(info.value)
    assert f"--init-from {tmp_path / 'other'} (the run has --init-from {converted})" in text
    assert "--train SRC TGT" not in text


def test_init_from_an_unconverted_transformers_folder_points_to_convert(converted, tmp_path):
    hf = converted.parent / "hf"  # the transformers checkpoint the fixture converted
    with pytest.raises(TrainingError) as info:
        _short_run(converted, tmp_path, hf)
    text = str(info.value)
    assert f"{hf} is a transformers checkpoint folder" in text
    assert f"python -m transformer_ext.convert transformers --model {hf} --output-dir MODEL_DIR" in text
    assert "missing keys" not in text and "\n" not in text
    assert not (tmp_path / "run").exists()
