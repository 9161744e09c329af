"""Multi-process training: environment checks, batch sharding, loss normalisation, and real
two-process runs (torchrun, gloo, loopback only) compared with a single process."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from transformer_ext import train as train_mod
from transformer_ext.data import (
    TokenBatchSampler,
    collate,
    encode_examples,
    example_cost,
    make_examples,
    split_numbers,
)
from transformer_ext.model import Transformer
from transformer_ext.tokenizer import CharTokenizer
from transformer_ext.training import (
    TrainOptions,
    build_config,
    make_optimizer,
    make_scheduler,
    noam_lr,
    token_loss,
    train,
)
from transformer_ext.training.distributed import (
    ENV_VARS,
    DistEnv,
    DistributedBatchSampler,
    DistributedContext,
    DistributedError,
    read_env,
    scale_loss,
)

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "distributed_worker.py"
LAUNCH_TIMEOUT_S = 150  # per torchrun launch; a run takes seconds, this only stops a hang

WORLD_SIZES = [1, 2, 3, 4, 5]
EPOCHS = [0, 1, 2]
FULL_ENV = dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")

# The tiny task of test_train.py with 7 batches per epoch (3 steps per epoch on 2 ranks, one batch
# left out) and no dropout, so that two ranks and one process can be compared step by step.
TINY = dict(
    preset="tiny",
    range_low=0,
    range_high=99,
    max_tokens=200,
    warmup=10,
    lr_factor=2.0,
    dropout=0.0,
    seed=3,
    max_steps=4,
    eval_every=2,
    eval_examples=2,
    final_eval=False,
    progress=False,
    log_every=1,
    threads=1,
    max_minutes=60.0,  # never reached, but the ranks agree on it at every step
    oversample=(),  # the single-process references below batch the plain training split
)


# ---------------------------------------------------------------------- environment
@pytest.mark.parametrize("env", [{}, dict(MASTER_ADDR="10.0.0.1", MASTER_PORT="29500"), dict(RANK="")])
def test_no_launcher_variables_is_a_single_process_run(env):
    assert read_env(env) is None


def test_complete_environment():
    assert read_env(FULL_ENV) == DistEnv(
        rank=1, world_size=2, local_rank=1, master_addr="127.0.0.1", master_port=29500
    )


@pytest.mark.parametrize(
    "missing", [[name] for name in ENV_VARS if name != "RANK"] + [["MASTER_ADDR", "MASTER_PORT"]]
)
def test_partial_environment_names_what_is_missing(missing):
    env = {k: v for k, v in FULL_ENV.items() if k not in missing}
    with pytest.raises(DistributedError) as info:
        read_env(env)
    message = str(info.value)
    assert f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing" in message
    assert "torchrun --nproc_per_node" in message


@pytest.mark.parametrize(
    "override, match",
    [
        (dict(RANK="one"), "RANK must be an integer, got 'one'"),
        (dict(MASTER_PORT="http"), "MASTER_PORT must be an integer"),
        (dict(RANK="2"), r"RANK must be in 0..WORLD_SIZE-1 = 0..1, got 2"),
        (dict(RANK="-1"), "RANK must be in"),
        (dict(WORLD_SIZE="0", RANK="0"), "WORLD_SIZE must be >= 1"),
        (dict(LOCAL_RANK="-1"), "LOCAL_RANK must be in"),
        (dict(MASTER_PORT="70000"), "MASTER_PORT must be a TCP port"),
    ],
)
def test_invalid_environment(override, match):
    with pytest.raises(DistributedError, match=match):
        read_env({**FULL_ENV, **override})


def test_training_refuses_a_partial_environment(tmp_path, monkeypatch, capsys):
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "run"
    with pytest.raises(DistributedError, match="LOCAL_RANK, MASTER_ADDR, MASTER_PORT are missing"):
        train(TrainOptions(out_dir=str(out), **TINY))
    assert not out.exists()  # nothing written
    assert (
        train_mod.main(["--output-dir", str(out), "--preset", "tiny", "--range", "0", "99", "--no-progress"])
        == 1
    )
    assert "MASTER_ADDR, MASTER_PORT are missing" in capsys.readouterr().err
    assert not out.exists()


# ---------------------------------------------------------------------- sharding
def token_sampler(n_examples=157, max_tokens=60, seed=5):
    g = torch.Generator().manual_seed(11)
    lengths = torch.randint(1, 20, (n_examples,), generator=g).tolist()
    return TokenBatchSampler(lengths, max_tokens, seed=seed)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("epoch", EPOCHS)
def test_shards_are_distinct_equal_and_cover_the_epoch(world_size, epoch):
    sampler = token_sampler()
    everything = sampler.batches(epoch)
    shards = [DistributedBatchSampler(sampler, r, world_size) for r in range(world_size)]
    per_rank = [s.batches(epoch) for s in shards]
    steps = len(everything) // world_size
    # every rank runs the same number of steps, which is its len()
    assert all(len(s) == steps and len(b) == steps for s, b in zip(shards, per_rank, strict=True))
    # rank r's batch at step k is global batch k * world_size + r of the shared seeded order
    for r, batches in enumerate(per_rank):
        assert batches == [everything[k * world_size + r] for k in range(steps)]
    # distinct shards: no example on two ranks in one epoch
    examples = [{i for b in batches for i in b} for batches in per_rank]
    for a in range(world_size):
        for b in range(a + 1, world_size):
            assert not examples[a] & examples[b]
    # union: all batches except the remainder (fewer than world_size), which is left out
    used = sorted(tuple(b) for batches in per_rank for b in batches)
    assert used == sorted(tuple(b) for b in everything[: steps * world_size])
    assert len(everything) - len(used) == len(everything) % world_size == shards[0].dropped < world_size


def test_left_out_batches_change_from_epoch_to_epoch():
    sampler = token_sampler()
    assert len(sampler) % 4 != 0
    seen: set[int] = set()
    for epoch in range(4):
        for r in range(4):
            seen |= {i for b in DistributedBatchSampler(sampler, r, 4).batches(epoch) for i in b}
    assert seen == set(range(len(sampler.lengths)))  # over a few epochs every example is trained on


def test_more_ranks_than_batches_is_an_error():
    sampler = TokenBatchSampler([5, 6, 7, 8, 9, 10], max_tokens=20, seed=0)
    assert len(sampler) == 3
    with pytest.raises(DistributedError, match="4 ranks but only 3 batches per epoch"):
        DistributedBatchSampler(sampler, 0, 4)
    # the same through the context the training loop uses (no process group needed to shard)
    ctx = DistributedContext(
        DistEnv(3, 4, 3, "127.0.0.1", 29500), torch.device("cpu"), "gloo", owns_group=False
    )
    with pytest.raises(DistributedError, match="--max-tokens"):
        ctx.shard(sampler)
    assert len(DistributedBatchSampler(sampler, 2, 3)) == 1


def test_resume_position_is_world_size_independent():
    ctx = DistributedContext(
        DistEnv(0, 2, 0, "127.0.0.1", 29500), torch.device("cpu"), "gloo", owns_group=False
    )
    assert ctx.global_position(3) == 6
    assert ctx.local_position(6, saved_world_size=4) == 3
    assert ctx.local_position(7, saved_world_size=1) == 4  # one batch skipped, never one repeated


# ---------------------------------------------------------------------- loss normalisation
def test_scaled_rank_losses_average_to_the_global_token_mean():
    """What DDP computes (the mean over ranks of each rank's gradient) equals the gradient of the
    loss over all target tokens of the global batch, while the mean of per-rank means does not."""
    torch.manual_seed(0)
    V, pad = 7, 0
    weight = torch.randn(V, 5, requires_grad=True)
    features = [torch.randn(2, 6, 5), torch.randn(3, 4, 5)]
    targets = [torch.randint(1, V, (2, 6)), torch.randint(1, V, (3, 4))]
    targets[0][0, 2:] = pad  # the ranks hold different numbers of target tokens: 8 and 12
    targets[1][:, 2:] = pad
    world_size = len(features)

    def rank_loss(r):
        return token_loss(features[r] @ weight.T, targets[r], pad, label_smoothing=0.1)

    counts = [rank_loss(r)[1] for r in range(world_size)]
    assert counts == [8, 6]
    ddp_grad = torch.zeros_like(weight)
    for r in range(world_size):
        loss, n = rank_loss(r)
        (grad,) = torch.autograd.grad(scale_loss(loss, n, sum(counts), world_size), weight)
        ddp_grad += grad / world_size  # DDP averages the ranks' gradients
    # the single process: one batch holding every target token (different padding does not matter)
    all_logits = torch.cat([(f @ weight.T).reshape(-1, V) for f in features])
    all_targets = torch.cat([t.reshape(-1) for t in targets])
    global_loss, n_global = token_loss(all_logits, all_targets, pad, label_smoothing=0.1)
    assert n_global == sum(counts)
    (expected,) = torch.autograd.grad(global_loss, weight)
    torch.testing.assert_close(ddp_grad, expected, rtol=1e-5, atol=1e-7)
    naive = sum(torch.autograd.grad(rank_loss(r)[0], weight)[0] for r in range(world_size)) / world_size
    assert (naive - expected).abs().max() > 1e-3


def test_scale_loss_needs_tokens():
    with pytest.raises(ValueError, match="global_tokens"):
        scale_loss(torch.tensor(1.0), 0, 0, 2)


# ---------------------------------------------------------------------- two real processes
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(args, nproc=2):
    """Run ``torchrun --nproc_per_node nproc args`` on 127.0.0.1; returns (returncode, output)."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    for attempt in range(3):  # the free port may be taken between bind(0) and torchrun's bind
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--nnodes",
            "1",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            "--max_restarts",
            "0",
            *map(str, args),
        ]
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: the session started above
            output, _ = proc.communicate()
            pytest.fail(f"torchrun did not finish within {LAUNCH_TIMEOUT_S} s:\n{output[-4000:]}")
        if proc.returncode != 0 and "address already in use" in output.lower() and attempt < 2:
            continue
        return proc.returncode, output
    raise AssertionError("unreachable")


def reference_run(opts: TrainOptions, tokenizer: CharTokenizer, world_size: int, naive: bool = False):
    """One process, the recipe of train() written out: each optimiser step sees the union of the
    ``world_size`` batches the ranks see at that step (global batches k*N .. k*N+N-1 of the seeded
    order); the loss is the mean over all their target tokens (or, ``naive``, the mean of the
    per-batch means). Returns (model, losses, target tokens per rank and step)."""
    splits = split_numbers(opts.range_low, opts.range_high, seed=opts.split_seed)
    pairs = encode_examples(tokenizer, make_examples(splits.train))
    config = build_config(opts, tokenizer)
    torch.manual_seed(opts.seed)
    model = Transformer(config)
    model.train()
    optimizer = make_optimizer(model, opts)
    scheduler = make_scheduler(optimizer, config.d_model, opts.warmup, opts.lr_factor)
    sampler = TokenBatchSampler(
        [example_cost(len(s), len(t)) for s, t in pairs], opts.max_tokens, seed=opts.seed
    )
    steps_per_epoch = len(sampler) // world_size
    ids = dict(pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
    losses, counts = [], []
    for step in range(opts.max_steps):
        epoch, k = divmod(step, steps_per_epoch)
        group = sampler.batches(epoch)[k * world_size : (k + 1) * world_size]
        counts.append(
            [collate([pairs[i] for i in b], **ids).n_target_tokens(tokenizer.pad_id) for b in group]
        )
        if naive:
            per_batch = []
            for b in group:
                batch = collate([pairs[i] for i in b], **ids)
                logits = model(batch.src_ids, batch.src_lengths, batch.tgt_in)
                per_batch.append(token_loss(logits, batch.tgt_out, tokenizer.pad_id, opts.label_smoothing)[0])
            loss = sum(per_batch) / world_size
        else:
            batch = collate([pairs[i] for b in group for i in b], **ids)
            logits = model(batch.src_ids, batch.src_lengths, batch.tgt_in)
            loss, _ = token_loss(logits, batch.tgt_out, tokenizer.pad_id, opts.label_smoothing)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opts.clip_norm)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
    return model, losses, counts


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """The worker run by torchrun on two CPU processes (gloo): each rank's parameters and result."""
    base = tmp_path_factory.mktemp("ddp")
    out, results = base / "run", base / "results"
    results.mkdir()
    code, output = torchrun([WORKER, out, results, json.dumps(TINY)])
    assert code == 0, output[-6000:]
    ranks = [
        dict(
            params=load_file(str(results / f"rank{r}.safetensors")),
            **json.loads((results / f"rank{r}.json").read_text()),
        )
        for r in range(2)
    ]
    return out, ranks, output


def test_two_ranks_hold_identical_parameters(two_rank_run):
    out, ranks, _ = two_rank_run
    a, b = ranks[0]["params"], ranks[1]["params"]
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert ranks[0]["losses"] == ranks[1]["losses"]  # the logged loss is the global one on both ranks
    saved = load_file(str(out / "last" / "model.safetensors"))  # rank 0 wrote the checkpoint
    for name in a:
        if name in saved:
            assert torch.equal(saved[name], a[name]), name


def test_two_ranks_equal_one_process_on_the_global_batch(two_rank_run):
    out, ranks, _ = two_rank_run
    opts = TrainOptions(out_dir=str(out), **TINY)
    tokenizer = CharTokenizer.load(out / "last")
    model, losses, counts = reference_run(opts, tokenizer, world_size=2)
    assert any(a != b for a, b in counts), counts  # unequal token counts: per-rank means would be wrong
    assert ranks[0]["step"] == TINY["max_steps"] and ranks[0]["world_size"] == 2
    assert ranks[0]["losses"] == pytest.approx(losses, rel=1e-5)
    # Every weight equal, except the attention key biases: softmax over keys ignores a shift shared by
    # all keys, so their true gradient is zero and Adam's updates of them (gradient noise / its own
    # magnitude) are noise in any two implementations. They do not change the function (checked below).
    compared = {n: p.detach() for n, p in model.named_parameters() if not n.endswith("W_K.bias")}
    assert len(compared) > 20
    worst = 0.0
    for name, expected in compared.items():
        got = ranks[0]["params"][name]
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=name)
        worst = max(worst, float((got - expected).abs().max()))
    # the same function: logits of the ranks' weights equal the single process's
    splits = split_numbers(opts.range_low, opts.range_high, seed=opts.split_seed)
    batch = collate(
        encode_examples(tokenizer, make_examples(splits.valid)),
        pad_id=tokenizer.pad_id,
        bos_id=tokenizer.bos_id,
        eos_id=tokenizer.eos_id,
    )
    inputs = (batch.src_ids, batch.src_lengths, batch.tgt_in)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            torch.func.functional_call(model, ranks[0]["params"], inputs),
            model(*inputs),
            rtol=1e-4,
            atol=1e-5,
        )
    # the check can fail: normalising by each rank's own tokens gives measurably different weights
    naive_model, _, _ = reference_run(opts, tokenizer, world_size=2, naive=True)
    naive = max(
        float((p.detach() - ranks[0]["params"][n]).abs().max())
        for n, p in naive_model.named_parameters()
        if n in compared
    )
    assert naive > 100 * max(worst, 1e-6)


def test_rank_zero_writes_validates_and_logs(two_rank_run):
    out, ranks, output = two_rank_run
    assert ranks[0]["history_steps"] == ranks[1]["history_steps"] == [2, 4]  # rank 0's validations, broadcast
    assert sorted(os.listdir(out)) == [
        "best",
        "last",
        "run.json",
        "summary.json",
        "train_options.json",
    ]  # no .tmp
    assert sorted(os.listdir(out.parent)) == ["results", "run"]  # the run's temporary folder is gone
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps_per_epoch"] == 3 and summary["steps"] == 4
    state = json.loads((out / "last" / "training_state.json").read_text())
    assert state["world_size"] == 2 and state["epoch"] == 1
    assert state["batch_in_epoch"] == 2  # global batches into the epoch: 1 step on 2 ranks
    assert output.count("validation at step 4") == 1  # rank 0 logs, the other rank does not
    assert output.count("step 3/4 epoch") == 1
    assert "differ from rank 0" not in output and "Traceback" not in output


def test_resume_with_another_world_size(tmp_path):
    """1 process (3 steps) -> 2 processes via the command line (to step 5) -> 1 process (to 2 epochs)."""
    out = tmp_path / "run"
    opts = dict(TINY, eval_every=0, log_every=0)
    first = train(TrainOptions(out_dir=str(out), **{**opts, "max_steps": 3}))
    assert first.step == 3 and first.world_size == 1
    cli = [
        "-m",
        "transformer_ext.train",
        "--output-dir",
        out,
        "--resume",
        "--max-steps",
        5,
        "--eval-every",
        0,
        "--eval-examples",
        2,
        "--no-final-eval",
        "--no-progress",
        "--threads",
        1,
    ]
    code, output = torchrun(cli)
    assert code == 0, output[-6000:]
    assert output.count("trained 5 steps") == 1  # printed by rank 0 only
    assert "the next 1 batch of this epoch is skipped" in output  # 3 global batches: position 2 of 2 ranks
    state = json.loads((out / "last" / "training_state.json").read_text())
    # 2-rank steps 4, 5 are positions 2, 3 of the 3-step epoch 0: the epoch ends after one of them
    assert (state["step"], state["epoch"], state["batch_in_epoch"], state["world_size"]) == (5, 1, 2, 2)
    assert [h["step"] for h in state["history"]] == [3, 5]
    # back to one process (7 steps per epoch) with an epoch budget: 2 global batches of epoch 1 are done,
    # so 2 epochs end after 5 more steps (the budget is re-derived in this world size's steps)
    again = train(TrainOptions(out_dir=str(out), **{**opts, "max_steps": None, "epochs": 2, "resume": True}))
    assert (again.first_step, again.step, again.epoch, again.world_size) == (6, 10, 2, 1)
    assert again.stop_reason == "epochs"
    d_model = build_config(TrainOptions(**TINY), CharTokenizer.load(out / "last")).d_model
    assert again.learning_rates == pytest.approx(
        [noam_lr(s, d_model, TINY["warmup"], TINY["lr_factor"]) for s in range(6, 11)], rel=1e-12
    )  # the schedule went on
    assert [h["step"] for h in again.history] == [3, 5, 10]


def test_more_ranks_than_batches_fails_cleanly(tmp_path):
    out = tmp_path / "run"
    code, output = torchrun(
        [
            "-m",
            "transformer_ext.train",
            "--output-dir",
            out,
            "--preset",
            "tiny",
            "--range",
            "0",
            "99",
            "--max-tokens",
            "100000",
            "--max-steps",
            2,
            "--no-progress",
            "--threads",
            1,
        ]
    )
    assert code != 0
    assert "2 ranks but only 1 batch per epoch" in output
    assert not out.exists()
