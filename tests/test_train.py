"""Training: the loss, the warmup schedule, determinism, checkpoints and exact resume, and what
the command does with bad options, foreign folders, corrupt files, a full disk and signals."""

import dataclasses
import errno
import json
import logging
import math
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from transformer_ext import train as train_mod
from transformer_ext.checkpoint import load_model
from transformer_ext.tokenizer import CharTokenizer
from transformer_ext.training import (
    TrainingError,
    TrainOptions,
    make_optimizer,
    make_scheduler,
    noam_lr,
    optim,
    run_folder,
    token_loss,
    train,
    validation,
)
from transformer_ext.training import loss as loss_mod

# A tiny task: the numbers 0..99, the "tiny" model, a few dozen steps (seconds on 2 cores).
TINY = dict(
    preset="tiny",
    range_low=0,
    range_high=99,
    max_tokens=400,
    warmup=10,
    lr_factor=2.0,
    dropout=0.1,
    max_steps=24,
    eval_every=12,
    eval_examples=4,
    final_eval=False,
    progress=False,
    log_every=0,
    threads=1,
    oversample=(),
)


def tiny(tmp_path, name="run", **kw):
    return TrainOptions(out_dir=str(tmp_path / name), **{**TINY, **kw})


def resume_of(out, **kw):
    """Options that resume the run in ``out``: only ``kw`` (and quiet logging) given, the rest is the run's."""
    return TrainOptions(out_dir=str(out), resume=True, progress=False, log_every=0, **kw)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """One uninterrupted tiny run, shared by the tests that compare against it."""
    out = tmp_path_factory.mktemp("reference")
    return train(TrainOptions(out_dir=str(out / "run"), **TINY))


# ---------------------------------------------------------------------- schedule
def paper_rate(step, d_model, warmup, factor):
    """The schedule written out independently: d^-0.5 * min(step^-0.5, step * warmup^-1.5)."""
    return factor * (1.0 / math.sqrt(d_model)) * min(1.0 / math.sqrt(step), step / warmup**1.5)


@pytest.mark.parametrize("d_model, warmup, factor", [(512, 4000, 1.0), (128, 400, 0.5), (32, 10, 2.0)])
def test_noam_lr_matches_the_formula(d_model, warmup, factor):
    for step in (1, 2, warmup // 2, warmup - 1, warmup, warmup + 1, 3 * warmup, 10 * warmup):
        assert noam_lr(step, d_model, warmup, factor) == pytest.approx(
            paper_rate(step, d_model, warmup, factor), rel=1e-12
        )
    peak = noam_lr(warmup, d_model, warmup, factor)
    assert peak == pytest.approx(factor * d_model**-0.5 * warmup**-0.5)
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


# V = 1001: blocks of 261 rows, so 600 rows make three blocks, the last one short
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_smoothed_cross_entropy_value_and_gradient_against_float64(dtype, eps):
    g = torch.Generator().manual_seed(7)
    N, V = 600, 1001
    logits = (3 * torch.randn(N, V, generator=g, dtype=torch.float64)).to(dtype)
    target = torch.randint(0, V, (N,), generator=g)
    target[::5] = 0  # the pad id: ignored rows
    ours = logits.clone().requires_grad_()
    loss = loss_mod.smoothed_cross_entropy(ours, target, ignore_index=0, label_smoothing=eps)
    want_leaf = logits.double().requires_grad_()  # the same (rounded) logits, in float64
    want = F.cross_entropy(want_leaf, target, ignore_index=0, label_smoothing=eps, reduction="sum")
    (0.3 * loss).backward()
    (0.3 * want).backward()
    assert loss.dtype == torch.float32 and ours.grad.dtype == dtype
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    # float32: float32 rounding; bfloat16: the gradient rounded to bfloat16 (about 2^-9 relative)
    tol = 1e-6 if dtype == torch.float32 else 4e-3 * want_leaf.grad.abs().max().item()
    assert (ours.grad.double() - want_leaf.grad).abs().max().item() <= tol
    assert (ours.grad[::5] == 0).all()


def test_smoothed_cross_entropy_bad_input_is_named():
    with pytest.raises(ValueError, match="logits must be"):
        loss_mod.smoothed_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="label_smoothing"):
        loss_mod.smoothed_cross_entropy(
            torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), label_smoothing=2.0
        )


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
    assert last == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "training_state.json",
        "training_state.safetensors",
    }
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
    # run-defining options given again with the run's values are fine; another value is refused
    resumed = train(tiny(tmp_path, max_steps=3, eval_every=0, resume=True, warmup=TINY["warmup"]))
    assert resumed.step == 3 and resumed.learning_rates == [
        paper_rate(3, 32, TINY["warmup"], TINY["lr_factor"])
    ]
    with pytest.raises(TrainingError, match=r"--warmup 999 \(the run has --warmup 10\)"):
        train(tiny(tmp_path, max_steps=4, eval_every=0, resume=True, warmup=999))


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
        (dict(max_steps=None, epochs=None), "--max-steps or --epochs"),
        (dict(warmup=0), "warmup"),
        (dict(label_smoothing=1.0), "label_smoothing"),
        (dict(n_heads=5), "divisible"),
        (dict(device="cuda"), "cuda"),
        (dict(preset="huge"), "preset"),
        (dict(max_len=8), "max_len"),
        (dict(oversample=((-5, 2),)), "--oversample"),
        (dict(oversample=((100, 0),)), "--oversample"),
        (dict(adam_betas=(0.9, 1.0)), "adam_betas"),
        (dict(adam_eps=0.0), "adam_eps"),
        (dict(seed=True), "--seed"),
        (dict(threads=2.5), "--threads"),
        (dict(max_steps=-1), "--max-steps"),
        (dict(lr_factor=float("inf")), "--lr-factor"),
        (dict(resume=True, overwrite=True), "exclude each other"),
    ],
)
def test_bad_options(tmp_path, kwargs, match):
    if kwargs.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(TrainingError, match=match):
        train(tiny(tmp_path, **kwargs))
    assert not (tmp_path / "run").exists()


def test_export_and_time_budget(tmp_path):
    result = train(
        tiny(tmp_path, max_steps=50, max_minutes=1e-6, eval_every=0, export_dir=str(tmp_path / "exported"))
    )
    assert result.stop_reason == "max_minutes" and result.step < 50
    assert {"config.json", "model.safetensors", "tokenizer.json", "training_summary.json"} <= set(
        os.listdir(tmp_path / "exported")
    )
    load_model(tmp_path / "exported")


def test_cli(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        train_mod.main(["--help"])
    assert info.value.code == 0
    help_text = capsys.readouterr().out
    for flag in (
        "--resume",
        "--seed",
        "--device",
        "--preset",
        "--max-minutes",
        "--max-tokens",
        "--warmup",
        "--label-smoothing",
        "--clip-norm",
        "--eval-every",
        "--export",
    ):
        assert flag in help_text
    out = str(tmp_path / "cli")

    def args(steps, *extra):
        return [
            "--output-dir",
            out,
            "--preset",
            "tiny",
            "--range",
            "0",
            "99",
            "--max-steps",
            str(steps),
            "--eval-every",
            "0",
            "--eval-examples",
            "2",
            "--no-final-eval",
            "--no-progress",
            "--quiet",
            "--threads",
            "1",
            "--oversample",
            *extra,
        ]

    assert train_mod.main(args(2)) == 0
    assert "trained 2 steps" in capsys.readouterr().out
    assert train_mod.main(args(2)) == 1  # the run exists: refuse without --resume
    assert "--resume" in capsys.readouterr().err
    assert train_mod.main(args(4, "--resume")) == 0
    assert "trained 4 steps" in capsys.readouterr().out
    assert (
        train_mod.main(
            ["--output-dir", str(tmp_path / "x"), "--preset", "tiny", "--d-model", "30", "--n-heads", "4"]
        )
        == 2  # a usage error
    )
    assert "divisible" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------- bad input, interruptions, full disk
def snapshot(folder) -> dict:
    """Every path under ``folder`` (hidden ones included) with its bytes (None for a folder)."""
    folder = Path(folder)
    return {
        str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(folder.rglob("*"))
    }


def temporaries(root) -> list[str]:
    """Leftovers of interrupted writes anywhere under ``root``."""
    return [str(p) for p in Path(root).rglob("*") if re.search(r"\.(tmp|old)(-|$)", p.name)]


def cli(out, *extra, steps=2):
    return [
        "--output-dir",
        str(out),
        "--preset",
        "tiny",
        "--range",
        "0",
        "99",
        "--max-steps",
        str(steps),
        "--eval-every",
        "0",
        "--eval-examples",
        "2",
        "--no-final-eval",
        "--no-progress",
        "--quiet",
        "--threads",
        "1",
        "--max-tokens",
        "400",
        "--oversample",
        *extra,
    ]


@pytest.fixture(scope="module")
def old_run(tmp_path_factory):
    """A finished two-step run made by the command line; tests copy it."""
    out = tmp_path_factory.mktemp("old") / "run"
    assert train_mod.main(cli(out)) == 0
    return out


@pytest.fixture
def run_copy(tmp_path, old_run):
    out = tmp_path / "run"
    shutil.copytree(old_run, out)
    return out


def state_step(out) -> int:
    return json.loads((Path(out) / "last" / "training_state.json").read_text())["step"]


# (extra command-line options, a fragment of the one-line error, the exit code: 2 for a value out of
# range or options that exclude each other, 1 for data that do not fit): each leaves the old run alone
BAD_CLI = [
    (["--d-model", "30"], "divisible", 2),
    (["--n-heads", "0"], "--n-heads", 2),
    (["--encoder-layers", "0", "--layers", "3"], "--encoder-layers", 2),
    (["--max-len", "8"], "max_len=8", 1),
    (["--range", "50", "10"], "--range LOW HIGH must satisfy 0 <= LOW <= HIGH, got 50 10", 2),
    (["--range", "0", "9"], "--range 0 9 holds too few numbers", 2),
    (["--lr-factor", "-1"], "--lr-factor (lr_factor) must be a finite number > 0, got -1.0", 2),
    (["--lr-factor", "nan"], "--lr-factor", 2),
    (["--clip-norm", "nan"], "--clip-norm (clip_norm) must be a finite number >= 0", 2),
    (["--clip-norm", "-1"], "--clip-norm", 2),
    (["--max-minutes", "nan"], "--max-minutes", 2),
    (["--max-minutes", "0"], "--max-minutes", 2),
    (["--final-beam", "-3"], "--final-beam (final_beam) must be an integer in [0, 128]", 2),
    (["--threads", "0"], "--threads (threads) must be an integer in [1, 1024]", 2),
    (["--dropout", "1.0"], "--dropout (dropout) must be a number in [0, 1)", 2),
    (["--dropout", "-0.5"], "--dropout", 2),
    (["--dropout", "inf"], "--dropout", 2),
    (["--label-smoothing", "1"], "--label-smoothing (label_smoothing) must be a number in [0, 1)", 2),
    (["--label-smoothing", "-0.1"], "--label-smoothing", 2),
    (["--warmup", "0"], "--warmup", 2),
    (["--max-tokens", "0"], "--max-tokens", 2),
    (["--eval-every", "-1"], "--eval-every", 2),
    (["--eval-examples", "-1"], "--eval-examples", 2),
    (["--log-every", "-1"], "--log-every", 2),
    (["--seed", "-1"], "--seed", 2),
    (["--split-seed", "-1"], "--split-seed", 2),
    (["--epochs", "-2"], "--epochs", 2),
    (["--device", "tpu"], "--device 'tpu' is not a device name; use cpu or cuda", 2),
    (["--device", "meta"], "unsupported device 'meta'", 2),
]


@pytest.mark.parametrize("extra, message, code", BAD_CLI, ids=[" ".join(e) for e, _, _ in BAD_CLI])
def test_bad_options_leave_the_old_run_untouched(run_copy, capsys, extra, message, code):
    before = snapshot(run_copy.parent)
    assert train_mod.main(cli(run_copy, "--overwrite", *extra)) == code
    err = capsys.readouterr().err
    assert err.startswith("python -m transformer_ext.train: error: ") and message in err, err
    assert "Traceback" not in err and err.count("\n") == 1
    assert snapshot(run_copy.parent) == before  # nothing deleted, nothing written


def test_debug_shows_the_traceback(run_copy):
    with pytest.raises(TrainingError, match="--lr-factor"):
        train_mod.main(cli(run_copy, "--overwrite", "--lr-factor", "-1", "--debug"))


def test_overwrite_replaces_the_old_run_only_when_the_new_one_has_a_checkpoint(run_copy, monkeypatch):
    old_weights = (run_copy / "last" / "model.safetensors").read_bytes()
    seen = []
    real = run_folder.save_checkpoint

    def spy(run_dir, name, *args, **kwargs):
        seen.append(
            (Path(run_dir) == run_copy, (run_copy / "last" / "model.safetensors").read_bytes() == old_weights)
        )
        return real(run_dir, name, *args, **kwargs)

    monkeypatch.setattr(run_folder, "save_checkpoint", spy)
    result = train(tiny(run_copy.parent, max_steps=4, eval_every=2, overwrite=True))
    assert result.step == 4 and result.first_step == 1
    # steps 2 (best + last, in the new run's temporary folder: the old run still in place), 4 (in --output-dir)
    assert seen[:2] == [(False, True), (False, True)] and all(in_out for in_out, _ in seen[2:])
    assert (
        state_step(run_copy) == 4 and json.loads((run_copy / "run.json").read_text())["format_version"] == 1
    )
    assert sorted(os.listdir(run_copy.parent)) == ["run"] and not temporaries(run_copy.parent)


def test_refuses_folders_it_did_not_create(tmp_path, run_copy):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    (foreign / "summary.json").write_text("{}")
    for kwargs in (dict(), dict(overwrite=True)):
        with pytest.raises(TrainingError, match="is not a training run of this program"):
            train(tiny(tmp_path, "mine", **kwargs))
    with pytest.raises(TrainingError, match="cannot resume: .* holds no training run of this program"):
        train(tiny(tmp_path, "mine", resume=True))
    assert snapshot(foreign) == {"notes.txt": b"mine", "summary.json": b"{}"}
    # a run folder with a file of the user's in it: --overwrite would delete that file
    (run_copy / "notes.txt").write_text("mine")
    before = snapshot(run_copy)
    with pytest.raises(TrainingError, match=r"holds files this program did not write \(notes.txt\)"):
        train(tiny(tmp_path, overwrite=True))
    assert snapshot(run_copy) == before
    resumed = train(resume_of(run_copy, max_steps=3, eval_every=0))  # resuming does not delete anything
    assert resumed.step == 3 and (run_copy / "notes.txt").read_text() == "mine"


def test_run_of_the_version_before_run_json_is_recognised(tmp_path, run_copy):
    (run_copy / "run.json").unlink()  # what the previous version wrote: no marker
    resumed = train(resume_of(run_copy, max_steps=3, eval_every=0))
    assert resumed.step == 3 and (run_copy / "run.json").is_file()
    (run_copy / "run.json").unlink()
    again = train(tiny(tmp_path, max_steps=1, eval_every=0, overwrite=True))
    assert again.step == 1 and state_step(run_copy) == 1


def test_an_empty_folder_is_used_and_kept(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    inode = out.stat().st_ino
    train(tiny(tmp_path, max_steps=1, eval_every=0))
    assert out.stat().st_ino == inode
    assert sorted(os.listdir(out)) == ["best", "last", "run.json", "summary.json", "train_options.json"]
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_out_that_is_a_file(tmp_path, capsys):
    path = tmp_path / "file"
    path.write_text("x")
    assert train_mod.main(cli(path)) == 1
    assert f"--output-dir {path} is a file, not a folder" in capsys.readouterr().err
    assert path.read_text() == "x" and sorted(os.listdir(tmp_path)) == ["file"]


def test_export_folder_is_checked_before_training(tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    assert train_mod.main(cli(tmp_path / "run", "--export", str(tmp_path / "notes"))) == 1
    assert "is not a model folder" in capsys.readouterr().err
    assert train_mod.main(cli(tmp_path / "run", "--export", str(tmp_path / "run" / "best"))) == 1
    assert "inside the run folder" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["notes"] and os.listdir(tmp_path / "notes") == ["a.txt"]


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _set_json(path, **changes):
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            del data[key]
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def _nan_in_optimizer_state(path):
    tensors = load_file(str(path))
    name = sorted(k for k in tensors if k.endswith("exp_avg_sq"))[0]
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, str(path))


def _wrong_shape_optimizer_state(path):
    tensors = load_file(str(path))
    name = sorted(k for k in tensors if k.endswith(".exp_avg"))[0]
    tensors[name] = torch.zeros(3)
    save_file(tensors, str(path))


# (what is done to the saved run, the file named in the error, a fragment of the error)
CORRUPTIONS = {
    "truncated state tensors": (
        lambda r: _truncate(r / "last" / "training_state.safetensors"),
        "last/training_state.safetensors",
        "corrupt or truncated",
    ),
    "truncated state json": (
        lambda r: _truncate(r / "last" / "training_state.json"),
        "last/training_state.json",
        "corrupt or truncated",
    ),
    "state json without step": (
        lambda r: _set_json(r / "last" / "training_state.json", step=None),
        "last/training_state.json",
        "has no 'step'",
    ),
    "negative step": (
        lambda r: _set_json(r / "last" / "training_state.json", step=-4),
        "last/training_state.json",
        "'step' is -4",
    ),
    "non-finite optimizer state": (
        lambda r: _nan_in_optimizer_state(r / "last" / "training_state.safetensors"),
        "last/training_state.safetensors",
        "non-finite",
    ),
    "optimizer state of another shape": (
        lambda r: _wrong_shape_optimizer_state(r / "last" / "training_state.safetensors"),
        "last/training_state.safetensors",
        "has shape (3,)",
    ),
    "options not json": (
        lambda r: (r / "train_options.json").write_bytes(b"\xff\xfe{"),
        "train_options.json",
        "corrupt or truncated",
    ),
    "options out of range": (
        lambda r: _set_json(r / "train_options.json", lr_factor=-1.0),
        "train_options.json",
        "--lr-factor",
    ),
    "config without n_heads": (
        lambda r: _set_json(r / "last" / "config.json", n_heads=None),
        "last/config.json",
        "missing key 'n_heads'",
    ),
    "truncated weights": (
        lambda r: _truncate(r / "last" / "model.safetensors"),
        "last/model.safetensors",
        "not a readable safetensors file",
    ),
    "state missing": (
        lambda r: (r / "last" / "training_state.json").unlink(),
        "last/training_state.json",
        "cannot resume",
    ),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_resume_files_are_one_line_errors(run_copy, capsys, kind):
    corrupt, named, fragment = CORRUPTIONS[kind]
    corrupt(run_copy)
    before = snapshot(run_copy.parent)
    assert train_mod.main(cli(run_copy, "--resume", steps=4)) == 1
    err = capsys.readouterr().err
    assert str(run_copy / named) in err and fragment in err, err
    assert "Traceback" not in err and err.count("\n") == 1
    assert snapshot(run_copy.parent) == before


def _enospc_on(monkeypatch, predicate):
    """os.replace raises ENOSPC (a full disk) for the destinations ``predicate`` picks."""
    real = os.replace

    def replace(src, dst, *args, **kwargs):
        if predicate(Path(dst)):
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)


def test_full_disk_at_the_first_checkpoint_keeps_the_old_run(run_copy, monkeypatch, capsys):
    before = snapshot(run_copy.parent)
    _enospc_on(monkeypatch, lambda dst: dst.name == "model.safetensors")
    assert train_mod.main(cli(run_copy, "--overwrite", steps=3)) == 1
    err = capsys.readouterr().err
    assert "no space left on the device" in err and "Traceback" not in err
    monkeypatch.undo()
    assert snapshot(run_copy.parent) == before  # old run intact, no temporary folder of the new one


def test_full_disk_at_a_later_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch, capsys):
    calls = []

    def second_last_checkpoint(dst):
        if dst.name == "model.safetensors" and dst.parent.name.startswith(".last.tmp-"):
            calls.append(dst)
            return len(calls) >= 2
        return False

    _enospc_on(monkeypatch, second_last_checkpoint)
    out = tmp_path / "run"
    assert train_mod.main(cli(out, "--eval-every", "1", steps=3)) == 1
    assert "no space left on the device" in capsys.readouterr().err
    monkeypatch.undo()
    assert state_step(out) == 1 and not temporaries(tmp_path)
    resumed = train(resume_of(out, max_steps=3, eval_every=0))
    assert resumed.first_step == 2 and resumed.step == 3


@pytest.mark.parametrize(
    "sig, code, word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
def test_signal_at_the_first_checkpoint_keeps_the_old_run(run_copy, monkeypatch, capsys, sig, code, word):
    before = snapshot(run_copy.parent)
    real = run_folder.save_model_dir

    def save_then_signal(*args, **kwargs):
        real(*args, **kwargs)  # the new checkpoint's files are written, the folder is not in place yet
        os.kill(os.getpid(), sig)

    monkeypatch.setattr(run_folder, "save_model_dir", save_then_signal)
    assert train_mod.main(cli(run_copy, "--overwrite", steps=3)) == code
    err = capsys.readouterr().err
    assert err.endswith(f"\npython -m transformer_ext.train: {word}; resume with --resume\n"), err
    assert "stopped before the first checkpoint of the new run (nothing to resume)" in err
    assert "Traceback" not in err
    assert snapshot(run_copy.parent) == before


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_during_a_resumed_run_keeps_the_last_checkpoint(run_copy, monkeypatch, capsys, sig, code):
    real = run_folder.save_model_dir

    def save_then_signal(*args, **kwargs):
        real(*args, **kwargs)
        os.kill(os.getpid(), sig)

    monkeypatch.setattr(run_folder, "save_model_dir", save_then_signal)
    assert train_mod.main(cli(run_copy, "--resume", "--eval-every", "1", steps=4)) == code
    assert "resume with --resume" in capsys.readouterr().err
    monkeypatch.undo()
    assert state_step(run_copy) == 2 and not temporaries(run_copy.parent)
    assert train_mod.main(cli(run_copy, "--resume", steps=4)) == 0
    assert state_step(run_copy) == 4


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_temporaries_of_a_killed_run_are_removed(tmp_path, caplog):
    from transformer_ext import fsutil

    stale = (
        tmp_path / f".run.tmp-{fsutil._HOST}-{_dead_pid()}-0123abcd"
    )  # a run killed before its first checkpoint
    stale.mkdir()
    (stale / "run.json").write_text("{}")
    other_host = (
        tmp_path / f".run.tmp-otherhost-{_dead_pid()}-0123abcd"
    )  # may belong to a live process elsewhere
    other_host.mkdir()
    train(tiny(tmp_path, max_steps=1, eval_every=0))
    assert not stale.exists() and other_host.is_dir()
    assert f"removed {stale}" in caplog.text


def test_resume_after_a_kill_between_the_two_renames_of_a_checkpoint(tmp_path, run_copy):
    from transformer_ext import fsutil

    # fsutil.replace_dir renames last/ to a backup, then the new folder to last/: killed in between
    (run_copy / "last").rename(run_copy / f".last.old-{fsutil._HOST}-{_dead_pid()}-0123abcd")
    resumed = train(resume_of(run_copy, max_steps=3, eval_every=0))
    assert resumed.first_step == 3 and resumed.step == 3
    assert state_step(run_copy) == 3 and not temporaries(run_copy)


# ---------------------------------------------------------------------- parallel text
def test_inverse_sqrt_lr_matches_fairseq():
    from transformer_ext.training import inverse_sqrt_lr

    for step in (1, 50, 99, 100, 101, 400, 10000):
        expected = 5e-4 * step / 100 if step <= 100 else 5e-4 * (100 / step) ** 0.5
        assert inverse_sqrt_lr(step, 100, 5e-4) == pytest.approx(expected, rel=1e-12)


def test_update_freq_equals_one_larger_batch():
    """N accumulated batches give the gradient of the one batch holding all their examples."""
    from transformer_ext.config import TransformerConfig
    from transformer_ext.data import collate
    from transformer_ext.model import Transformer
    from transformer_ext.training.optim import accumulate_gradients

    torch.manual_seed(0)
    model = Transformer(TransformerConfig.preset("tiny", dropout=0.0))
    g = torch.Generator().manual_seed(1)
    pairs = [
        (
            torch.randint(4, 48, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist(),
            torch.randint(4, 40, (int(torch.randint(1, 15, (1,), generator=g)),), generator=g).tolist(),
        )
        for _ in range(9)
    ]
    ids = dict(pad_id=0, bos_id=1, eos_id=2)

    def grads(micro):
        model.zero_grad(set_to_none=True)
        value, n = accumulate_gradients(model, micro, pad_id=0, label_smoothing=0.1)
        return value, n, {k: p.grad.detach().clone() for k, p in model.named_parameters()}

    one_value, one_n, one = grads([collate(pairs, **ids)])
    acc_value, acc_n, acc = grads(
        [collate(pairs[:2], **ids), collate(pairs[2:7], **ids), collate(pairs[7:], **ids)]
    )
    assert acc_n == one_n == sum(len(t) + 1 for _, t in pairs)
    assert acc_value == pytest.approx(one_value, rel=1e-5)
    for name in one:
        torch.testing.assert_close(acc[name], one[name], rtol=1e-4, atol=1e-6, msg=name)
    # and it is not simply the mean of the per-batch mean losses (batches differ in size)
    model.zero_grad(set_to_none=True)
    for micro in (pairs[:2], pairs[2:7], pairs[7:]):
        b = collate(micro, **ids)
        (token_loss(model(b.src_ids, b.src_lengths, b.tgt_in), b.tgt_out, 0, 0.1)[0] / 3).backward()
    naive = {k: p.grad for k, p in model.named_parameters()}
    assert any(not torch.allclose(naive[k], one[k], rtol=1e-3, atol=1e-5) for k in one)


SENTS_EN = [
    "the man went to the city",
    "the woman saw the house",
    "a child ran in the field",
    "he spoke to them",
    "they went up to the mountain",
    "she gave bread to the poor",
    "the king sat on the throne",
    "the people heard the word",
    "he wrote a letter to the church",
    "the sheep were in the field",
]
SENTS_DE = [
    "der Mann ging in die Stadt",
    "die Frau sah das Haus",
    "ein Kind lief auf dem Feld",
    "er redete zu ihnen",
    "sie gingen hinauf auf den Berg",
    "sie gab den Armen Brot",
    "der König saß auf dem Thron",
    "das Volk hörte das Wort",
    "er schrieb einen Brief an die Gemeinde",
    "die Schafe waren auf dem Feld",
]


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def text_opts(tmp_path, name="run", **kw):
    src = write_lines(tmp_path / "train.en", SENTS_EN * 3)
    tgt = write_lines(tmp_path / "train.de", SENTS_DE * 3)
    vsrc = write_lines(tmp_path / "valid.en", SENTS_EN[:3])
    vtgt = write_lines(tmp_path / "valid.de", SENTS_DE[:3])
    base = dict(
        TINY,
        train_files=(src, tgt),
        valid_files=(vsrc, vtgt),
        tokenizer="char",
        max_steps=6,
        eval_every=3,
        eval_examples=3,
    )
    base.update(kw)
    return TrainOptions(out_dir=str(tmp_path / name), **base)


def test_text_training_with_char_tokenizer_and_keep_last(tmp_path):
    opts = text_opts(
        tmp_path, keep_last=1, best_metric="chrf", update_freq=2, max_steps=4, eval_every=2, max_len_ratio=1.5
    )
    result = train(opts)
    out = Path(result.out_dir)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-4"]  # --keep-last 1
    assert {"bleu", "chrf", "loss"} <= set(result.history[-1])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best_metric"] == "chrf"
    assert summary["data"]["train"]["total"] == 30
    assert summary["data"]["train"]["ratio"] == sum(
        max(len(a), len(b)) > 1.5 * min(len(a), len(b))
        for a, b in zip(SENTS_EN * 3, SENTS_DE * 3, strict=True)
    )
    assert load_model(out / "best").config.max_len == 64


def test_patience_stops_early(tmp_path, monkeypatch):
    # a metric that never improves after the first validation: the run stops after `patience` more
    monkeypatch.setattr(validation, "metric_key", lambda record, metric: (0.0,))
    result = train(text_opts(tmp_path, patience=2, max_steps=12, eval_every=2))
    assert result.stop_reason == "patience"
    assert [h["step"] for h in result.history] == [2, 4, 6]
    assert result.best["step"] == 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(valid_files=None), "--train needs a validation set"),
        (dict(amp="fp16"), r"--amp fp16 is CUDA only \(measured here: .* GFLOP/s"),
        (dict(lr_schedule="inverse-sqrt"), "needs --lr"),
        (dict(update_freq=0), "--update-freq"),
        (dict(keep_last=-1), "--keep-last"),
        (dict(best_metric="rouge"), "--best-metric"),
        (dict(vocab_size=2), "--vocab-size"),
    ],
)
def test_text_bad_options(tmp_path, kwargs, match):
    with pytest.raises(TrainingError, match=match):
        train(text_opts(tmp_path, **kwargs))
    assert not (tmp_path / "run").exists()


def test_text_bad_data_is_named(tmp_path, capsys):
    opts = text_opts(tmp_path)
    src, tgt = opts.train_files
    vsrc, vtgt = opts.valid_files
    args = [
        "--output-dir",
        str(tmp_path / "run"),
        "--preset",
        "tiny",
        "--max-steps",
        "2",
        "--no-progress",
        "--tokenizer",
        "char",
    ]
    short = write_lines(tmp_path / "short.de", SENTS_DE[:4])
    assert train_mod.main(args + ["--train", src, short, "--valid", vsrc, vtgt]) == 1
    assert f"{src} has 30 lines but {short} has 4" in capsys.readouterr().err
    bad = tmp_path / "bad.en"
    bad.write_bytes(("\n".join(SENTS_EN * 3)).encode().replace(b"city", b"cit\xe9", 1) + b"\n")
    assert train_mod.main(args + ["--train", str(bad), tgt, "--valid", vsrc, vtgt]) == 1
    assert f"{bad}, line 1: not UTF-8" in capsys.readouterr().err
    empty = write_lines(tmp_path / "empty.en", [])
    empty2 = write_lines(tmp_path / "empty.de", [])
    assert train_mod.main(args + ["--train", src, tgt, "--valid", empty, empty2]) == 1
    assert "has no lines" in capsys.readouterr().err
    assert train_mod.main(args + ["--train", src, tgt, "--valid", vsrc, vtgt, "--max-len", "4"]) == 1
    err = capsys.readouterr().err
    assert "no training pair is left after filtering" in err and "30 as longer than max_len" in err
    blanks = write_lines(tmp_path / "blank.en", [" "] * 30)
    assert train_mod.main(args + ["--train", blanks, tgt, "--valid", vsrc, vtgt]) == 1
    assert "30 removed as empty" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_text_tsv_and_impossible_vocab(tmp_path, capsys):
    pytest.importorskip("sentencepiece")
    tsv = write_lines(tmp_path / "train.tsv", [f"{a}\t{b}" for a, b in zip(SENTS_EN, SENTS_DE, strict=True)])
    vtsv = write_lines(
        tmp_path / "valid.tsv", [f"{a}\t{b}" for a, b in zip(SENTS_EN[:2], SENTS_DE[:2], strict=True)]
    )
    args = [
        "--output-dir",
        str(tmp_path / "run"),
        "--preset",
        "tiny",
        "--max-steps",
        "2",
        "--no-progress",
        "--train-tsv",
        tsv,
        "--valid-tsv",
        vtsv,
        "--shared-vocab",
    ]
    assert train_mod.main(args + ["--vocab-size", "8000"]) == 1
    err = capsys.readouterr().err
    assert "--vocab-size 8000 is more than the source and target training text supports" in err
    assert "lower --vocab-size" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
    bad = write_lines(tmp_path / "bad.tsv", ["one\ttwo\tthree"])
    assert (
        train_mod.main(["--output-dir", str(tmp_path / "run"), "--train-tsv", bad, "--valid-tsv", vtsv]) == 1
    )
    assert f"{bad}, line 1: expected source<TAB>target (2 fields), got 3" in capsys.readouterr().err


def test_interrupted_run_keeps_its_numbers(tmp_path, monkeypatch):
    """summary.json is written at every validation, so a run killed later still has its curve."""
    real = optim.accumulate_gradients
    calls = []

    def interrupt_at_step_5(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(optim, "accumulate_gradients", interrupt_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        train(text_opts(tmp_path, max_steps=8, eval_every=3))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["running"] is True
    assert [h["step"] for h in summary["history"]] == [3]
    assert {"bleu", "chrf", "loss"} <= set(summary["history"][0])


# ---------------------------------------------------------------------- run folders, resume, limits
def test_resume_keeps_files_the_user_put_in_best_last_and_step_folders(tmp_path, caplog):
    train(tiny(tmp_path, max_steps=2, eval_every=1, keep_last=1, dropout=0.0))
    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2"]
    mine = {
        run / "best" / "hyp.txt": b"my translations",
        run / "last" / "notes" / "todo.txt": b"look at step 2",
        run / "checkpoints" / "step-2" / "score.txt": b"BLEU 1.0",
        # a model folder of the user's named like a later step: neither deleted nor counted as one
        run / "checkpoints" / "step-9999" / "config.json": b"{}",
        run / "checkpoints" / "step-9999" / "averaged.json": b"{}",
    }
    for path, data in mine.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    resumed = train(tiny(tmp_path, max_steps=4, eval_every=1, keep_last=1, dropout=0.0, resume=True))
    assert resumed.step == 4 and state_step(run) == 4
    for path, data in mine.items():
        assert path.read_bytes() == data, path
    # step-2 holds a file of the user's, so --keep-last 1 keeps it; step-3 (only the trainer's) is removed
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2", "step-4", "step-9999"]
    assert "they are kept in the new checkpoint" in caplog.text
    assert "kept " + str(run / "checkpoints" / "step-2") in caplog.text
    assert not temporaries(tmp_path)


def _hold_lock(out):
    """A process of this host that holds the run folder's lock, as a training session does."""
    import subprocess
    import sys

    code = (
        "import sys; from pathlib import Path; from transformer_ext.training.run_folder import RunLock; "
        f"lock = RunLock(Path({str(out)!r})); lock.acquire(); print('locked', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(os.environ)
    )
    assert proc.stdout.readline().strip() == b"locked"
    return proc


def test_a_second_session_on_a_run_in_use_is_refused(run_copy, capsys, caplog):
    holder = _hold_lock(run_copy)
    try:
        before = snapshot(run_copy)
        assert train_mod.main(cli(run_copy, "--resume", steps=4)) == 1
        err = capsys.readouterr().err
        assert (
            f"--output-dir {run_copy} is in use: process {holder.pid} on host" in err
            and "Traceback" not in err
        )
        assert snapshot(run_copy) == before and state_step(run_copy) == 2
    finally:
        holder.kill()  # SIGKILL: its lock file stays behind, naming a process that is gone
        holder.wait()
    lock_file = run_copy.parent / ".run.lock"
    assert json.loads(lock_file.read_text())["pid"] == holder.pid
    assert train_mod.main(cli(run_copy, "--resume", steps=4)) == 0
    assert (
        f"took over the lock {lock_file} of process {holder.pid} of this host, which is gone" in caplog.text
    )
    assert state_step(run_copy) == 4 and not lock_file.exists()


def test_a_lock_of_another_host_is_never_taken_over(run_copy, capsys):
    lock_file = run_copy.parent / ".run.lock"
    lock_file.write_text(json.dumps(dict(host="otherhost", pid=_dead_pid())))
    assert train_mod.main(cli(run_copy, "--resume", steps=4)) == 1
    err = capsys.readouterr().err
    assert "on host otherhost" in err and f"remove {lock_file}" in err
    assert state_step(run_copy) == 2 and lock_file.is_file()


# (flags, the bound the message must name): sizes no model or machine can hold are usage errors
SIZE_LIMITS = [
    (["--max-len", "1000000000000"], "--max-len (max_len) must be an integer in [1, 65536]"),
    (["--d-model", "1000000000"], "--d-model (d_model) must be an integer in [1, 16384]"),
    (["--d-ff", "1000000000"], "--d-ff (d_ff) must be an integer in [1, 65536]"),
    (["--layers", "100000"], "--encoder-layers (n_encoder_layers) must be an integer in [1, 256]"),
    (["--n-heads", "100000"], "--n-heads (n_heads) must be an integer in [1, 1024]"),
    (["--max-tokens", "1000000000000"], "--max-tokens (max_tokens) must be an integer in [1, 4194304]"),
    (["--vocab-size", "1000000000"], "--vocab-size (vocab_size) must be an integer in [8, 1048576]"),
    (["--final-beam", "100000"], "--final-beam (final_beam) must be an integer in [0, 128]"),
    (["--range", "0", "1000000000000"], "the demo task takes at most 1,000,000"),
]


@pytest.mark.parametrize("extra, message", SIZE_LIMITS, ids=[" ".join(e) for e, _ in SIZE_LIMITS])
def test_size_options_are_bounded_with_the_bound_in_the_message(tmp_path, capsys, extra, message):
    assert train_mod.main(cli(tmp_path / "run", *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1, err
    assert os.listdir(tmp_path) == []


def test_a_model_larger_than_the_memory_is_refused_before_it_is_built(tmp_path, capsys):
    d_model, d_ff, layers = 16384, 65536, 64
    # an independent lower bound: the attention and feed-forward weights of the layers, 16 bytes each in training
    lower_bound = 2 * layers * (4 * d_model * d_model + 2 * d_model * d_ff) * 16
    assert lower_bound > os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    argv = cli(tmp_path / "run", "--d-model", str(d_model), "--d-ff", str(d_ff), "--layers", str(layers))
    assert train_mod.main(argv) == 2
    err = capsys.readouterr().err
    assert "GiB for its weights, gradients and Adam state, more than the" in err and "Traceback" not in err
    assert os.listdir(tmp_path) == []


def test_resume_with_run_defining_options_that_differ_names_them_and_both_values(run_copy, capsys):
    before = snapshot(run_copy)
    assert train_mod.main(cli(run_copy, "--resume", "--d-model", "64", "--seed", "5", steps=4)) == 2
    err = capsys.readouterr().err
    assert f"cannot resume {run_copy} with options that differ from the run's" in err, err
    assert "--d-model 64 (the run has --d-model 32)" in err and "--seed 5 (the run has --seed 1)" in err
    assert snapshot(run_copy) == before
    # the run's own value, given again (here the tiny preset's d_model), is not a difference
    assert train_mod.main(cli(run_copy, "--resume", "--d-model", "32", steps=3)) == 0
    assert state_step(run_copy) == 3


def test_best_metric_bleu_without_sacrebleu_is_refused_before_training(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "sacrebleu", None)  # import sacrebleu raises ImportError
    steps = []
    real = optim.accumulate_gradients
    monkeypatch.setattr(optim, "accumulate_gradients", lambda *a, **k: steps.append(1) or real(*a, **k))
    for metric, shown in (
        ("bleu", "--best-metric bleu "),
        ("chrf", "--best-metric chrf "),
        (None, "default"),
    ):
        with pytest.raises(TrainingError, match=f"{shown}.*needs the sacrebleu package"):
            train(text_opts(tmp_path, best_metric=metric))
        assert steps == [] and not (tmp_path / "run").exists()
    # a metric without sacrebleu trains, and validation reports no BLEU
    result = train(text_opts(tmp_path, best_metric="loss", max_steps=2, eval_every=2))
    assert result.step == 2 and "bleu" not in result.history[-1]


@pytest.mark.parametrize(
    "err_no, problem",
    [(errno.ENOSPC, "no space left on the device"), (errno.EROFS, "the file system is read-only")],
)
def test_a_failing_disk_names_the_output_the_user_gave(tmp_path, monkeypatch, capsys, err_no, problem):
    out = tmp_path / "run"
    real = os.replace

    def replace(src, dst, *args, **kwargs):
        if Path(dst).name == "model.safetensors":
            raise OSError(err_no, os.strerror(err_no), str(dst))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    assert train_mod.main(cli(out, steps=1)) == 1
    err = capsys.readouterr().err
    assert f"error: --output-dir {out}: {problem}" in err, err
    assert f"(writing {out / 'best' / 'model.safetensors'})" in err and ".tmp-" not in err
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


def test_a_read_only_parent_names_the_output_the_user_gave(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    real = os.mkdir

    def mkdir(path, *args, **kwargs):
        if Path(path).parent == tmp_path:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    assert train_mod.main(cli(out, steps=1)) == 1
    err = capsys.readouterr().err
    assert f"error: --output-dir {out}: the file system is read-only" in err and ".tmp-" not in err, err


def test_resume_takes_the_options_not_given_from_the_run(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    out = tmp_path / "run"
    real = optim.accumulate_gradients
    calls = []

    def interrupt_at_step_3(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(optim, "accumulate_gradients", interrupt_at_step_3)
    assert train_mod.main(cli(out, "--eval-every", "2", "--keep-last", "1", steps=4)) == 130
    monkeypatch.undo()
    assert state_step(out) == 2
    # nothing but --output-dir and --resume: the budget, validation interval and --keep-last are the run's
    assert train_mod.main(["--output-dir", str(out), "--resume", "--no-progress"]) == 0
    state = json.loads((out / "last" / "training_state.json").read_text())
    assert state["step"] == 4 and [h["step"] for h in state["history"]] == [2, 4]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-4"]
    assert f"resuming {out} with the run's options" in caplog.text
    # an option given again overrides the run's, and the log says so
    caplog.clear()
    assert train_mod.main(["--output-dir", str(out), "--resume", "--no-progress", "--max-steps", "6"]) == 0
    assert state_step(out) == 6
    assert "except these given again: --max-steps 6 (the run had --max-steps 4)" in caplog.text


# ---------------------------------------------------------------------- training output
def test_time_left_is_measured_against_the_budget_that_binds():
    from transformer_ext.training.progress import time_left

    # 23 of 100000 steps in 111 s with a 12-minute budget: the minutes bind, 720 - 111 s are left
    assert time_left(23, 1, 100_000, 111.0, 12.0) == (720.0 - 111.0, "minutes")
    # 50 of 100 steps in 100 s, no time budget: 50 more steps at 2 s each
    assert time_left(50, 1, 100, 100.0, None) == (100.0, "steps")
    # the same with a generous time budget: the steps bind
    assert time_left(50, 1, 100, 100.0, 60.0) == (100.0, "steps")
    # a resumed session (first step 51) measures its own rate: 10 steps in 20 s, 40 left
    assert time_left(60, 51, 100, 20.0, None) == (80.0, "steps")
    # nothing done yet: only a time budget tells
    assert time_left(0, 1, 100, 0.0, None) == (None, "steps")
    assert time_left(0, 1, 100, 0.0, 2.0) == (120.0, "minutes")


def test_the_progress_bar_is_as_long_as_the_time_budget_allows(monkeypatch, capsys):
    from transformer_ext.training import progress

    now = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    bar = progress.Progress(100_000, 0, 1.0, enabled=True, interactive=True)
    for step in range(1, 11):
        now[0] += 0.5
        bar.update(step)
    # 10 steps in 5 s, 55 s of the minute left: 110 more steps fit, the bar is 120 steps long
    assert bar.bar.total == 10 + 55 * 10 // 5
    bar.close()


def test_progress_is_plain_log_lines_when_stderr_is_not_a_terminal(tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO)
    argv = [
        a for a in cli(tmp_path / "run", "--log-every", "1", steps=3) if a not in ("--no-progress", "--quiet")
    ]
    assert train_mod.main(argv) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "train:" not in err  # no bar frames
    step_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(step_lines) == 3 and all("left (steps budget)" in line for line in step_lines), step_lines
    # between the log lines, a plain progress line every interval_s seconds
    from transformer_ext.training.progress import Progress

    caplog.clear()
    plain = Progress(10, 0, None, enabled=True, interactive=False, interval_s=0.0)
    plain.update(1)
    assert "progress: step 1/10 (10.0%)" in caplog.text and plain.bar is None


def test_tensorboard_logs_losses_learning_rates_and_validations(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = train(tiny(tmp_path, max_steps=6, eval_every=3, tensorboard=str(tmp_path / "tb")))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    lr = events.Scalars("train/lr")
    assert [e.step for e in lr] == list(range(1, 7))
    expected = [paper_rate(s, 32, TINY["warmup"], TINY["lr_factor"]) for s in range(1, 7)]
    assert [e.value for e in lr] == pytest.approx(expected, rel=1e-6)  # stored as float32
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(result.losses, rel=1e-6)
    valid = events.Scalars("valid/loss")
    assert [e.step for e in valid] == [3, 6]
    assert [e.value for e in valid] == pytest.approx([h["loss"] for h in result.history], rel=1e-6)
    assert [e.step for e in events.Scalars("valid/exact_match")] == [3, 6]


def test_tensorboard_inside_a_managed_folder_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    assert train_mod.main(cli(out, "--tensorboard", str(out / "last" / "tb"))) == 1
    assert (
        f"--tensorboard {out / 'last' / 'tb'} lies inside the run folder's last/" in capsys.readouterr().err
    )
    assert os.listdir(tmp_path) == []


def test_demo_only_options_have_their_own_group_and_text_runs_need_out(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_mod.main(["--help"])
    help_text = capsys.readouterr().out
    demo = help_text.index("the demo task (without --train")
    following = help_text.index("\n\n", demo)
    for flag in ("--range", "--split-seed", "--oversample"):
        assert demo < help_text.index(f"  {flag} ") < following, flag
    opts = text_opts(tmp_path)
    with pytest.raises(SystemExit) as info:
        train_mod.main(["--train", *opts.train_files, "--valid", *opts.valid_files])
    assert info.value.code == 2
    assert "--output-dir is required with --train" in capsys.readouterr().err


def test_the_test_set_is_scored_with_the_best_checkpoint_as_evaluate_does(tmp_path, capsys):
    from transformer_ext import evaluate

    opts = text_opts(tmp_path, final_eval=True, final_beam=2)
    test_src = write_lines(tmp_path / "test.en", SENTS_EN[3:6])
    test_tgt = write_lines(tmp_path / "test.de", SENTS_DE[3:6])
    result = train(dataclasses.replace(opts, test_files=(test_src, test_tgt)))
    best = Path(result.out_dir) / "best"
    for name, beam in (("greedy", 1), ("beam", 2)):
        capsys.readouterr()
        assert (
            evaluate.main(
                ["--model", str(best), "--src", test_src, "--ref", test_tgt, "--beam", str(beam), "--json"]
            )
            == 0
        )
        report = json.loads(capsys.readouterr().out)
        assert (result.heldout[f"{name}_bleu"], result.heldout[f"{name}_chrf"]) == (
            report["bleu"],
            report["chrf"],
        )
    assert result.heldout["n"] == 3 and result.heldout["beam_size"] == 2
    summary = json.loads((Path(result.out_dir) / "summary.json").read_text())
    assert summary["heldout"] == result.heldout


def test_a_bad_test_set_is_refused_before_training(tmp_path, capsys):
    opts = text_opts(tmp_path)
    short = write_lines(tmp_path / "test.de", SENTS_DE[:2])
    argv = ["--output-dir", str(tmp_path / "run"), "--preset", "tiny", "--tokenizer", "char", "--no-progress"]
    argv += ["--train", *opts.train_files, "--valid", *opts.valid_files, "--test", opts.valid_files[0], short]
    assert train_mod.main(argv) == 1
    assert "--test: " in capsys.readouterr().err and not (tmp_path / "run").exists()
    assert train_mod.main(cli(tmp_path / "demo", "--test", opts.valid_files[0], short)) == 2
    assert "--test is given without --train" in capsys.readouterr().err


def test_running_out_of_memory_in_a_step_is_one_line(tmp_path, monkeypatch, capsys):
    def no_memory(*args, **kwargs):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 128000000000000 bytes. Error code 12 (Cannot allocate memory)"
        )

    monkeypatch.setattr(optim, "accumulate_gradients", no_memory)
    assert train_mod.main(cli(tmp_path / "run", steps=2)) == 1
    err = capsys.readouterr().err
    assert "error: out of memory at step 1 (cpu) on a batch of --max-tokens 400 padded tokens" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()
