"""Checkpoint averaging: the result is the mean of the parameters and a normal model folder."""

import json

import pytest
import torch
from safetensors.torch import load_file

from transformer_ext.average import AverageError, average_checkpoints, main
from transformer_ext.checkpoint import WEIGHTS_NAME, load_model, save_model
from transformer_ext.config import TransformerConfig
from transformer_ext.fsutil import OutputConflictError
from transformer_ext.model import Transformer
from transformer_ext.tokenizer import CharTokenizer

TOKENIZER = CharTokenizer.build(["abc de"], ["xyz uv"], shared=True)


def make_folder(path, seed, shared=True, **overrides):
    torch.manual_seed(seed)
    config = TransformerConfig.preset(
        "tiny",
        src_vocab_size=TOKENIZER.src_vocab_size,
        tgt_vocab_size=TOKENIZER.tgt_vocab_size,
        shared_vocab=shared,
        **overrides,
    )
    save_model(Transformer(config), path)
    TOKENIZER.save(path)
    return path


def test_mean_of_parameters(tmp_path):
    folders = [make_folder(tmp_path / f"step-{i}", seed=i) for i in range(3)]
    average_checkpoints(folders, tmp_path / "avg")
    tensors = [load_file(str(f / WEIGHTS_NAME)) for f in folders]
    averaged = load_file(str(tmp_path / "avg" / WEIGHTS_NAME))
    assert set(averaged) == set(tensors[0])
    for name, value in averaged.items():
        expected = sum(t[name].double() for t in tensors) / 3  # independent float64 mean
        torch.testing.assert_close(value.double(), expected, rtol=0, atol=1e-7)
    model = load_model(tmp_path / "avg")  # a normal model folder: loads, ties kept
    assert (
        model.src_embed.lut.weight.data_ptr() == model.tgt_embed.lut.weight.data_ptr()
    )  # shared_vocab: tied
    assert model.generator.proj.weight.data_ptr() == model.tgt_embed.lut.weight.data_ptr()
    assert CharTokenizer.load(tmp_path / "avg") == TOKENIZER


def test_last_k_of_a_run(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for step in (100, 200, 300, 1000):
        make_folder(run / "checkpoints" / f"step-{step}", seed=step)
    (run / "checkpoints" / "step-5000").mkdir()  # no config.json: not a checkpoint of the run
    assert main(["--last", "2", str(run), "--output-dir", str(tmp_path / "avg")]) == 0
    assert "step-300, step-1000" in capsys.readouterr().out  # numeric order, not text order
    a = load_file(str(run / "checkpoints" / "step-300" / WEIGHTS_NAME))
    b = load_file(str(run / "checkpoints" / "step-1000" / WEIGHTS_NAME))
    avg = load_file(str(tmp_path / "avg" / WEIGHTS_NAME))
    for name in avg:
        torch.testing.assert_close(
            avg[name].double(), (a[name].double() + b[name].double()) / 2, rtol=0, atol=1e-7
        )


def test_different_models_refused(tmp_path):
    a = make_folder(tmp_path / "a", seed=0)
    b = make_folder(tmp_path / "b", seed=1, d_ff=128)
    with pytest.raises(AverageError, match="differs from"):
        average_checkpoints([a, b], tmp_path / "avg")
    assert not (tmp_path / "avg").exists()


def test_out_not_empty_refused(tmp_path, capsys):
    a = make_folder(tmp_path / "a", seed=0)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main([str(a), "--output-dir", str(out)]) == 1
    assert "not an empty folder" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_too_few_checkpoints(tmp_path, capsys):
    run = tmp_path / "run"
    make_folder(run / "checkpoints" / "step-10", seed=0)
    assert main(["--last", "3", str(run), "--output-dir", str(tmp_path / "avg")]) == 1
    assert "holds only 1 checkpoints" in capsys.readouterr().err


def make_run(path):
    """A training run folder as train writes it: run.json (the format marker) and step checkpoints."""
    (path / "checkpoints").mkdir(parents=True)
    (path / "run.json").write_text(json.dumps({"format": "transformer_ext.train-run", "format_version": 1}))
    for step in (100, 200):
        make_folder(path / "checkpoints" / f"step-{step}", seed=step)
    make_folder(path / "best", seed=1)
    make_folder(path / "last", seed=2)
    return path


@pytest.mark.parametrize("inside", ["checkpoints/step-9999", "last/avg", "best/avg", "checkpoints", "."])
def test_average_refuses_an_output_in_a_runs_managed_folders(tmp_path, capsys, inside):
    run = make_run(tmp_path / "run")
    out = run / inside
    before = sorted(str(p) for p in run.rglob("*"))
    assert main(["--last", "2", str(run), "--output-dir", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"--output-dir {out}" in err and "Traceback" not in err, err
    assert sorted(str(p) for p in run.rglob("*")) == before  # nothing written
    # the library refuses it too, for checkpoints named one by one
    with pytest.raises(OutputConflictError, match=f"--output-dir {out}"):
        average_checkpoints([run / "checkpoints" / "step-100", run / "checkpoints" / "step-200"], out)


def test_last_refuses_an_average_among_the_checkpoints(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    assert (
        main(
            [str(run / "checkpoints" / "step-100"), str(run / "best"), "--output-dir", str(tmp_path / "avg")]
        )
        == 0
    )
    (tmp_path / "avg").rename(run / "checkpoints" / "step-9999")  # put there by hand: not a training step
    assert main(["--last", "2", str(run), "--output-dir", str(tmp_path / "avg2")]) == 1
    assert "step-9999 is an average of checkpoints" in capsys.readouterr().err
    assert not (tmp_path / "avg2").exists()
