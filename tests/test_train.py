"""Training: the loss, the warmup schedule, determinism, checkpoints and exact resume."""

import json
import math
import os

import pytest
import torch

from transformer_ext import train as train_mod
from transformer_ext.checkpoint import load_model
from transformer_ext.tokenizer import CharTokenizer
from transformer_ext.train import (
    TrainingError,
    TrainOptions,
    make_optimizer,
    make_scheduler,
    noam_lr,
    token_loss,
    train,
)

# A tiny task: the numbers 0..99, the "tiny" model, a few dozen steps (seconds on 2 cores).
TINY = dict(
    preset="tiny", range_low=0, range_high=99, max_tokens=400, warmup=10, lr_factor=2.0, dropout=0.1,
    max_steps=24, eval_every=12, eval_examples=4, final_eval=False, progress=False, log_every=0, threads=1,
    oversample=(),
)


def tiny(tmp_path, name="run", **kw):
    return TrainOptions(out_dir=str(tmp_path / name), **{**TINY, **kw})


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """One uninterrupted tiny run, shared by the tests that compare against it."""
    out = tmp_path_factory.mktemp("reference")
    return train(TrainOptions(out_dir=str(out / "run"), **TINY))


# ---------------------------------------------------------------------- schedule
def paper_rate(step, d_model, warmup, factor):
    """The schedule written out independently: d^-0.5 * min(step^-0.5, step * warmup^-1.5)."""
    return factor * (1.0 / math.sqrt(d_model)) * min(1.0 / math.sqrt(step), step / warmup ** 1.5)


@pytest.mark.parametrize("d_model, warmup, factor", [(512, 4000, 1.0), (128, 400, 0.5), (32, 10, 2.0)])
def test_noam_lr_matches_the_formula(d_model, warmup, factor):
    for step in (1, 2, warmup // 2, warmup - 1, warmup, warmup + 1, 3 * warmup, 10 * warmup):
        assert noam_lr(step, d_model, warmup, factor) == pytest.approx(paper_rate(step, d_model, warmup, factor),
                                                                        rel=1e-12)
    peak = noam_lr(warmup, d_model, warmup, factor)
    assert peak == pytest.approx(factor * d_model ** -0.5 * warmup ** -0.5)
    assert noam_lr(warmup - 1, d_model, warmup, factor) < peak > noam_lr(warmup + 1, d_model, warmup, factor)


def test_noam_lr_counts_steps_from_one():
    with pytest.raises(ValueError, match="from 1"):
        noam_lr(0, 512, 4000)


def test_scheduler_drives_the_optimizer_with_the_formula():
    model = torch.nn.Linear(4, 4)
    opt = make_optimizer(model, TrainOptions())
    assert opt.defaults["betas"] == (0.9, 0.98) and opt.defaults["eps"] == 1e-9
    sched = make_scheduler(opt, d_model=64, warmup=5, factor=1.5)
    for step in range(1, 20):  # the lr used by optimiser step `step`
        assert opt.param_groups[0]["lr"] == pytest.approx(paper_rate(step, 64, 5, 1.5), rel=1e-12)
        opt.step()
        sched.step()


def test_training_uses_the_schedule(reference_run):
    expected = [paper_rate(s, 32, TINY["warmup"], TINY["lr_factor"]) for s in range(1, TINY["max_steps"] + 1)]
    assert reference_run.learning_rates == pytest.approx(expected, rel=1e-12)


# ---------------------------------------------------------------------- loss
def test_token_loss_is_the_mean_over_non_pad_tokens():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    target = torch.tensor([[3, 4, 2, 0, 0], [5, 6, 4, 3, 2]])
    loss, n = token_loss(logits, target, pad_id=0, label_smoothing=0.0)
    assert n == 8
    logp = logits.log_softmax(-1)
    manual = -sum(logp[b, t, target[b, t]] for b in range(2) for t in range(5) if target[b, t] != 0) / 8
    assert loss.item() == pytest.approx(manual.item(), rel=1e-6)
    # more padding does not change it
    padded_logits = torch.cat([logits, torch.randn(2, 3, 7)], dim=1)
    padded_target = torch.cat([target, torch.zeros(2, 3, dtype=torch.long)], dim=1)
    loss2, n2 = token_loss(padded_logits, padded_target, pad_id=0, label_smoothing=0.0)
    assert n2 == 8 and loss2.item() == pytest.approx(loss.item(), rel=1e-6)


def test_token_loss_label_smoothing():
    torch.manual_seed(1)
    logits = torch.randn(1, 4, 6)
    target = torch.tensor([[3, 4, 2, 0]])
    eps = 0.1
    loss, _ = token_loss(logits, target, pad_id=0, label_smoothing=eps)
    logp = logits.log_softmax(-1)[0, :3]
    nll = -logp[torch.arange(3), target[0, :3]]
    uniform = -logp.mean(-1)
    assert loss.item() == pytest.approx(((1 - eps) * nll + eps * uniform).mean().item(), rel=1e-6)


# ---------------------------------------------------------------------- training
def test_training_reduces_the_loss(reference_run):
    losses = reference_run.losses
    assert len(losses) == TINY["max_steps"] and reference_run.first_step == 1
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-4:]) / 4 < 0.9 * sum(losses[:4]) / 4
    history = reference_run.history
    assert [h["step"] for h in history] == [12, 24]
    assert history[-1]["loss"] < history[0]["loss"]
    assert 0.0 <= history[-1]["exact_match"] <= 1.0 and history[-1]["n_exact"] == 4


def test_training_is_deterministic(tmp_path, reference_run):
    again = train(tiny(tmp_path, max_steps=12))
    assert again.losses == reference_run.losses[:12]  # bit-identical, not approximately
    other_seed = train(tiny(tmp_path, "seed2", max_steps=12, seed=2))
    assert other_seed.losses != again.losses


def test_checkpoints_are_model_directories(reference_run):
    out = reference_run.out_dir
    for name in ("best", "last"):
        files = set(os.listdir(os.path.join(out, name)))
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
        model = load_model(os.path.join(out, name))
        tok = CharTokenizer.load(os.path.join(out, name))
        assert model.config.src_vocab_size == tok.src_vocab_size
        assert model.config.tgt_vocab_size == tok.tgt_vocab_size
    # the training state is safetensors + json: nothing that needs pickle
    last = set(os.listdir(os.path.join(out, "last")))
    assert last == {"config.json", "model.safetensors", "tokenizer.json", "training_state.json",
                    "training_state.safetensors"}
    assert not any(f.endswith((".pt", ".pth", ".pkl", ".bin")) for f in last)
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["steps"] == TINY["max_steps"] and summary["best"]["step"] in (12, 24)


def test_resume_continues_identically(tmp_path, reference_run):
    first = train(tiny(tmp_path, max_steps=12))
    assert first.step == 12
    resumed = train(tiny(tmp_path, max_steps=TINY["max_steps"], resume=True))
    assert resumed.first_step == 13
    assert resumed.losses == reference_run.losses[12:]  # bit-identical continuation
    assert resumed.learning_rates == reference_run.learning_rates[12:]
    assert [h["step"] for h in resumed.history] == [12, 24]
    assert resumed.history[-1]["loss"] == reference_run.history[-1]["loss"]


def test_resume_in_the_middle_of_an_epoch_and_off_the_eval_grid(tmp_path, reference_run):
    # stop at step 7 (not a validation step, mid-epoch), resume to 24
    train(tiny(tmp_path, max_steps=7))
    resumed = train(tiny(tmp_path, max_steps=TINY["max_steps"], resume=True))
    assert resumed.losses == reference_run.losses[7:]


def test_resume_keeps_the_saved_run_options(tmp_path, caplog):
    train(tiny(tmp_path, max_steps=2, eval_every=0))
    resumed = train(tiny(tmp_path, max_steps=3, eval_every=0, resume=True, warmup=999))
    assert resumed.step == 3
    assert "ignoring warmup=999" in caplog.text


def test_epochs_limit(tmp_path):
    result = train(tiny(tmp_path, max_steps=None, epochs=1, eval_every=0))
    assert result.stop_reason == "epochs" and result.epoch == 1 and result.step == len(result.losses)


def test_refuses_to_overwrite_or_resume_nothing(tmp_path):
    train(tiny(tmp_path, max_steps=1, eval_every=0))
    with pytest.raises(TrainingError, match="--resume"):
        train(tiny(tmp_path, max_steps=1))
    again = train(tiny(tmp_path, max_steps=1, eval_every=0, overwrite=True))
    assert again.step == 1
    with pytest.raises(TrainingError, match="cannot resume"):
        train(tiny(tmp_path, "fresh", resume=True))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_steps=None, epochs=None), "max_steps or epochs"),
        (dict(warmup=0), "warmup"),
        (dict(label_smoothing=1.0), "label_smoothing"),
        (dict(n_heads=5), "divisible"),
        (dict(device="cuda"), "cuda"),
        (dict(preset="huge"), "preset"),
        (dict(max_len=8), "max_len"),
    ],
)
def test_bad_options(tmp_path, kwargs, match):
    if kwargs.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(TrainingError, match=match):
        train(tiny(tmp_path, **kwargs))


def test_export_and_time_budget(tmp_path):
    result = train(tiny(tmp_path, max_steps=50, max_minutes=1e-6, eval_every=0,
                        export_dir=str(tmp_path / "exported")))
    assert result.stop_reason == "max_minutes" and result.step < 50
    assert {"config.json", "model.safetensors", "tokenizer.json", "training_summary.json"} <= set(
        os.listdir(tmp_path / "exported"))
    load_model(tmp_path / "exported")


def test_cli(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        train_mod.main(["--help"])
    assert info.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--resume", "--seed", "--device", "--preset", "--max-minutes", "--max-tokens", "--warmup",
                 "--label-smoothing", "--clip-norm", "--eval-every", "--export"):
        assert flag in help_text
    out = str(tmp_path / "cli")

    def args(steps, *extra):
        return ["--out", out, "--preset", "tiny", "--range", "0", "99", "--max-steps", str(steps), "--eval-every",
                "0", "--eval-examples", "2", "--no-final-eval", "--no-progress", "--quiet", "--threads", "1",
                "--oversample", *extra]

    assert train_mod.main(args(2)) == 0
    assert "trained 2 steps" in capsys.readouterr().out
    assert train_mod.main(args(2)) == 2  # the run exists: refuse without --resume
    assert "--resume" in capsys.readouterr().err
    assert train_mod.main(args(4, "--resume")) == 0
    assert "trained 4 steps" in capsys.readouterr().out
    assert train_mod.main(["--out", str(tmp_path / "x"), "--preset", "tiny", "--d-model", "30", "--n-heads", "4"]) == 2
    assert "divisible" in capsys.readouterr().err
