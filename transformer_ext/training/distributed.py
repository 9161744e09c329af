"""Multi-process training with ``torchrun``: process group, batch sharding, reductions.

:func:`transformer_ext.training.train` runs unchanged in a single process. Started by
``torchrun`` (which sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` for every worker), it trains with DistributedDataParallel; everything it
needs for that lives here, behind one object, :class:`Context`, whose single-process form
does nothing at all (so a run without the torchrun environment is bit-identical to one
before multi-process training existed):

* **Process group** (:func:`setup`): from the torchrun environment (``env://``), NCCL with
  one GPU per process (``cuda:LOCAL_RANK``) on CUDA, gloo on the CPU. A partial or invalid
  environment is a :class:`DistributedError` that says what is missing and how to launch.
* **Data** (:class:`DistributedBatchSampler`): every rank builds the same seeded batch list
  of the epoch (:class:`~transformer_ext.data.TokenBatchSampler`, seed + epoch), drops the
  last ``len % world_size`` batches and takes batches ``rank, rank + N, rank + 2N, ...``:
  distinct shards whose union is the epoch, the same number of steps on every rank.
  The batch order is reshuffled every epoch, so a dropped batch is a different one each epoch.
* **Loss** (:func:`scale_loss`, :meth:`Context.reduce_loss`): batches are made by token count,
  so ranks hold different numbers of target tokens. The token count and the summed loss are
  all-reduced before backward, and each rank back-propagates
  ``summed_loss * world_size / global_tokens``; DDP averages gradients over ranks, so the
  update is exactly that of the single-process loss over the union of the ranks' batches.
  The logged loss is the global one, the same on every rank.
* **Rank 0** writes checkpoints, logs and shows progress; validation runs on rank 0 while
  the others wait, and its record is broadcast so every rank keeps the same history. Before
  each validation the ranks' parameters are compared with rank 0's (a warning if they differ).
* **Resume** with any world size: a checkpoint holds rank 0's state, which is every rank's
  (step count, optimiser, scheduler, rank 0's RNG), and the position in the epoch counted in
  global batches. Re-derived at resume: each rank's shard (from the seed, the epoch and the new
  world size), the position in steps of the new world size (rounded up: at most
  ``world_size - 1`` batches of that epoch are skipped, none repeated), the step budget of an
  epoch limit, and the dropout generators of ranks > 0 (from seed, step and rank).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping, Optional

import torch

from ..cli import UserError

logger = logging.getLogger(__name__)

__all__ = [
    "ENV_VARS",
    "DistributedError",
    "DistEnv",
    "read_env",
    "env_rank",
    "DistributedBatchSampler",
    "scale_loss",
    "Context",
    "DistributedContext",
    "setup",
]

# What torchrun sets for every worker; the first three say "this process is one of several".
ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_LAUNCHER_VARS = ENV_VARS[:3]
_LAUNCH_HINT = (
    "launch multi-process training with torchrun, which sets all of them for every process, e.g. "
    "`torchrun --nproc_per_node 2 -m transformer_ext.train ...`; for a single process unset RANK, "
    "WORLD_SIZE and LOCAL_RANK"
)


class DistributedError(UserError, RuntimeError):
    """A multi-process run that cannot work as launched (environment, ranks, devices, data).

    A :class:`~transformer_ext.cli.UserError`: the command line reports it in one line.
    """


@dataclass(frozen=True)
class DistEnv:
    """The rendezvous variables of one worker, parsed and checked."""

    rank: int  # global rank, 0..world_size-1
    world_size: int  # processes in all
    local_rank: int  # rank on this node: the GPU index under NCCL
    master_addr: str  # host of the rendezvous store
    master_port: int


def read_env(environ: Optional[Mapping[str, str]] = None) -> Optional[DistEnv]:
    """The torchrun environment of this process, or None for a plain single-process run.

    The run is multi-process as soon as one of ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` is
    set (``MASTER_ADDR``/``MASTER_PORT`` alone are often exported cluster-wide and mean
    nothing by themselves); then all five must be set and valid, or :class:`DistributedError`
    names what is wrong.
    """
    env = os.environ if environ is None else environ
    present = [name for name in ENV_VARS if env.get(name, "").strip()]
    if not any(name in present for name in _LAUNCHER_VARS):
        return None
    missing = [name for name in ENV_VARS if name not in present]
    if missing:
        raise DistributedError(
            f"incomplete torch.distributed environment: {', '.join(present)} "
            f"{'is' if len(present) == 1 else 'are'} set but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing; {_LAUNCH_HINT}"
        )

    def integer(name: str) -> int:
        value = env[name].strip()
        try:
            return int(value)
        except ValueError:
            raise DistributedError(f"{name} must be an integer, got {value!r}; {_LAUNCH_HINT}") from None

    rank, world_size, local_rank, port = (
        integer(n) for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    )
    if world_size < 1:
        raise DistributedError(f"WORLD_SIZE must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise DistributedError(f"RANK must be in 0..WORLD_SIZE-1 = 0..{world_size - 1}, got {rank}")
    if not 0 <= local_rank < world_size:
        raise DistributedError(f"LOCAL_RANK must be in 0..{world_size - 1}, got {local_rank}")
    if not 1 <= port <= 65535:
        raise DistributedError(f"MASTER_PORT must be a TCP port in 1..65535, got {port}")
    return DistEnv(rank, world_size, local_rank, env["MASTER_ADDR"].strip(), port)


def env_rank(environ: Optional[Mapping[str, str]] = None) -> int:
    """``RANK`` when it parses, else 0: for entry points that set up logging before :func:`setup`."""
    env = os.environ if environ is None else environ
    try:
        return max(int(env.get("RANK", "0")), 0)
    except ValueError:
        return 0


# ---------------------------------------------------------------------- data
class DistributedBatchSampler:
    """One rank's shard of the batches of a :class:`~transformer_ext.data.TokenBatchSampler`.

    Every rank computes the same batch list of an epoch (the wrapped sampler is seeded),
    keeps the first ``world_size * (len // world_size)`` batches and takes every
    ``world_size``-th one starting at ``rank``. Same interface as the wrapped sampler
    (``len``, ``batches(epoch)``); ``len`` is the number of steps per epoch on every rank.
    """

    def __init__(self, sampler, rank: int, world_size: int):
        if world_size < 1 or not 0 <= rank < world_size:
            raise DistributedError(f"rank {rank} is not one of world_size={world_size} ranks")
        n = len(sampler)
        if n < world_size:
            raise DistributedError(
                f"{world_size} ranks but only {n} batch{'es' if n != 1 else ''} per epoch: every rank needs a batch "
                f"at every step. Start at most {n} processes, lower --max-tokens (smaller batches, more of them), "
                "or train on more data"
            )
        self.sampler = sampler
        self.rank = rank
        self.world_size = world_size
        self.steps_per_epoch = n // world_size
        self.dropped = (
            n - self.steps_per_epoch * world_size
        )  # batches left out of each epoch (reshuffled each epoch)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of ``epoch``, in training order: global batches rank, rank+N, ..."""
        return self.sampler.batches(epoch)[
            self.rank : self.steps_per_epoch * self.world_size : self.world_size
        ]


# ---------------------------------------------------------------------- loss
def scale_loss(loss: torch.Tensor, n_tokens: int, global_tokens: int, world_size: int) -> torch.Tensor:
    """What one rank back-propagates so that DDP's gradient *average* is the global token mean.

    ``loss`` is this rank's mean over its ``n_tokens`` non-pad target tokens; the result is
    ``loss * n_tokens * world_size / global_tokens`` (this rank's summed loss, times
    ``world_size`` to undo DDP's division, over the tokens of all ranks).
    """
    if global_tokens < 1:
        raise ValueError(f"global_tokens must be >= 1, got {global_tokens}")
    return loss * (n_tokens * world_size / global_tokens)


# ---------------------------------------------------------------------- contexts
class Context:
    """A single-process run: every method is the identity or does nothing."""

    rank = 0
    world_size = 1
    local_rank = 0
    backend: Optional[str] = None

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    @property
    def is_main(self) -> bool:
        """True on the rank that writes files, logs and shows progress (rank 0)."""
        return self.rank == 0

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module to run the training forward pass through (DDP when distributed)."""
        return model

    def shard(self, sampler):
        """This rank's view of the epoch's batches."""
        return sampler

    def reduce_loss(self, loss: torch.Tensor, n_tokens: int) -> tuple[torch.Tensor, float, int]:
        """``(loss to back-propagate, global loss per target token, global target tokens)``."""
        return loss, float(loss.detach()), n_tokens

    def any(self, flag: bool) -> bool:
        """True when ``flag`` is true on any rank (so all ranks stop at the same step)."""
        return bool(flag)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        return obj

    def replica_difference(self, model: torch.nn.Module) -> float:
        """Largest absolute difference between any rank's parameters and rank 0's."""
        return 0.0

    def seed_rank_rng(self, seed: int, step: int) -> None:
        """Give ranks other than 0 their own dropout generator (rank 0 keeps the saved/seeded one)."""

    def local_position(self, global_batches: int, saved_world_size: int = 1) -> int:
        """Steps into the epoch for ``global_batches`` batches already consumed (a saved position)."""
        return global_batches

    def global_position(self, local_steps: int) -> int:
        """Global batches consumed after ``local_steps`` steps of an epoch (what a checkpoint stores)."""
        return local_steps

    def close(self) -> None:
        """Leave the process group (when this context created it)."""


class DistributedContext(Context):
    """One rank of a torchrun job; created by :func:`setup`."""

    def __init__(self, env: DistEnv, device: torch.device, backend: str, owns_group: bool):
        super().__init__(device)
        self.env = env
        self.rank = env.rank
        self.world_size = env.world_size
        self.local_rank = env.local_rank
        self.backend = backend
        self._owns_group = owns_group

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        import inspect

        from torch.nn.parallel import DistributedDataParallel

        # No buffer broadcast before every forward: the only buffers (positional encodings) are constants.
        # (Newer torch spells it forward_sync_buffers and deprecates broadcast_buffers.)
        no_buffer_sync = (
            "forward_sync_buffers"
            if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
            else "broadcast_buffers"
        )
        return DistributedDataParallel(
            model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            **{no_buffer_sync: False},
        )

    def shard(self, sampler):
        sharded = DistributedBatchSampler(sampler, self.rank, self.world_size)
        if self.is_main:
            logger.info(
                "%d batches per epoch over %d ranks: %d steps per epoch on every rank%s",
                len(sampler),
                self.world_size,
                len(sharded),
                f"; the last {sharded.dropped} batch(es) of each (reshuffled) epoch are left out"
                if sharded.dropped
                else "",
            )
        return sharded

    def reduce_loss(self, loss: torch.Tensor, n_tokens: int) -> tuple[torch.Tensor, float, int]:
        import torch.distributed as dist

        stats = torch.tensor(
            [float(loss.detach()) * n_tokens, float(n_tokens)], dtype=torch.float64, device=self.device
        )
        dist.all_reduce(stats)
        loss_sum, global_tokens = stats.tolist()
        global_tokens = int(round(global_tokens))
        return (
            scale_loss(loss, n_tokens, global_tokens, self.world_size),
            loss_sum / max(global_tokens, 1),
            global_tokens,
        )

    def any(self, flag: bool) -> bool:
        import torch.distributed as dist

        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def broadcast(self, obj: Any) -> Any:
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def replica_difference(self, model: torch.nn.Module) -> float:
        import torch.distributed as dist

        with torch.no_grad():
            mine = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
            reference = mine.clone()
            dist.broadcast(reference, src=0)
            diff = (mine - reference).abs().max().reshape(1).to(torch.float64)
            dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        return float(diff.item())

    def seed_rank_rng(self, seed: int, step: int) -> None:
        if self.rank == 0:
            return
        # A seed of (seed, step at session start, rank): distinct dropout masks on every rank,
        # reproducible for the same launch. (Only rank 0's generator is checkpointed.)
        derived = (int(seed) * 1_000_003 + int(step)) * 65_537 + self.rank
        torch.manual_seed(derived % (2**63))

    def local_position(self, global_batches: int, saved_world_size: int = 1) -> int:
        steps = math.ceil(global_batches / self.world_size)
        skipped = steps * self.world_size - global_batches
        if skipped and self.is_main:
            logger.warning(
                "resuming %d batches into the epoch with %d ranks (saved with %d): the next %d "
                "batch%s of this epoch %s skipped",
                global_batches,
                self.world_size,
                saved_world_size,
                skipped,
                "es" if skipped > 1 else "",
                "are" if skipped > 1 else "is",
            )
        return steps

    def global_position(self, local_steps: int) -> int:
        return local_steps * self.world_size

    def close(self) -> None:
        import torch.distributed as dist

        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False


def setup(device: torch.device | str, *, timeout_s: Optional[float] = None) -> Context:
    """The :class:`Context` of this process: single-process, or one rank of a torchrun job.

    Under torchrun: checks the environment (:func:`read_env`), picks the backend (NCCL for
    ``cuda``, each process on ``cuda:LOCAL_RANK``; gloo for ``cpu``) and joins the default
    process group (``env://``), or reuses it when the caller already created one.
    """
    device = torch.device(device)
    env = read_env()
    if env is None:
        return Context(device)
    import torch.distributed as dist

    if not dist.is_available():
        raise DistributedError("this PyTorch build has no torch.distributed; multi-process training needs it")
    if device.type == "cuda":
        if device.index is not None and device.index != env.local_rank:
            raise DistributedError(
                f"under torchrun each process uses cuda:LOCAL_RANK (cuda:{env.local_rank} "
                f"here); pass --device cuda, not {device}"
            )
        n_gpus = torch.cuda.device_count()
        if env.local_rank >= n_gpus:
            raise DistributedError(
                f"LOCAL_RANK={env.local_rank} but this node sees {n_gpus} CUDA device(s): start "
                f"at most {n_gpus} processes per node (--nproc_per_node {n_gpus})"
            )
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    elif device.type == "cpu":
        backend = "gloo"
    else:
        raise DistributedError(f"multi-process training runs on cpu (gloo) or cuda (nccl), not {device.type}")

    if dist.is_initialized():
        if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
            raise DistributedError(
                f"a process group already exists as rank {dist.get_rank()} of {dist.get_world_size()}, but the "
                f"environment says rank {env.rank} of {env.world_size}"
            )
        return DistributedContext(env, device, dist.get_backend(), owns_group=False)
    kwargs: dict[str, Any] = {}
    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    if backend == "nccl":
        kwargs["device_id"] = device
    try:
        dist.init_process_group(
            backend, init_method="env://", rank=env.rank, world_size=env.world_size, **kwargs
        )
    except (RuntimeError, ValueError, OSError) as exc:
        raise DistributedError(
            f"rank {env.rank} of {env.world_size} could not join the process group at "
            f"{env.master_addr}:{env.master_port} ({backend}): {exc}"
        ) from exc
    if env.rank == 0:
        logger.info(
            "process group: %d ranks, backend %s, rendezvous %s:%d",
            env.world_size,
            backend,
            env.master_addr,
            env.master_port,
        )
    return DistributedContext(env, device, backend, owns_group=True)
