"""The run folder ``--output-dir``: marker, staged first checkpoint, best/last/step-N, resume state, --export.

A run folder holds ``run.json`` (the format marker), ``train_options.json``, ``summary.json``,
``best/``, ``last/`` and, with ``--keep-last``, ``checkpoints/step-N/``. Only a folder with that
marker, or one of the version before it recognised by its exact file set, is resumed or
(``--overwrite``) replaced; any other non-empty folder is refused (:func:`inspect_out`,
:func:`check_out`). A new run is built in a temporary sibling of ``--output-dir`` and takes its place
when its first checkpoint is complete (:func:`commit_run`). Checkpoints are model folders
(docs/DESIGN.md section 5: ``config.json`` + ``model.safetensors`` + tokenizer files); ``last/`` also
holds the training state (:func:`save_checkpoint`, :func:`load_state`): optimiser tensors and RNG
states in ``training_state.safetensors``, everything else in ``training_state.json``. No pickle
anywhere. Every write is atomic (:mod:`transformer_ext.fsutil`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

from .. import __version__, fsutil
from ..convert.generation import GENERATION_DEFAULTS_FILE
from ..fsutil import _HOST, StagedDir, _pid_alive, atomic_write_bytes, atomic_write_json, parse_temporary_name
from ..tokenizer import TOKENIZER_FILE
from .errors import TrainingError

logger = logging.getLogger(__name__)

__all__ = [
    "RUN_MARKER",
    "RUN_FORMAT",
    "RUN_FORMAT_VERSION",
    "CHECKPOINTS_DIR",
    "OPTIONS_JSON",
    "SUMMARY_JSON",
    "STATE_JSON",
    "STATE_TENSORS",
    "RunFolder",
    "inspect_out",
    "check_out",
    "commit_run",
    "save_checkpoint",
    "save_step_checkpoint",
    "step_checkpoints",
    "last_dir",
    "load_state",
    "read_json_file",
    "check_export_dir",
    "export_model",
    "MANAGED_DIRS",
    "managed_dirs",
    "RunLock",
    "disk_errors",
]

STATE_JSON = "training_state.json"
STATE_TENSORS = "training_state.safetensors"
OPTIONS_JSON = "train_options.json"
SUMMARY_JSON = "summary.json"
MODEL_FILES = ("config.json", "model.safetensors", TOKENIZER_FILE)
PROVENANCE_FILE = "provenance.json"  # where the corpus came from (corpus, editions, licence, split)
# Copied with a model folder when it has them (GENERATION_DEFAULTS_FILE: how a model imported by
# transformer_ext.convert decodes; the folders of a run fine-tuning it carry it).
OPTIONAL_MODEL_FILES = (PROVENANCE_FILE, GENERATION_DEFAULTS_FILE)
CHECKPOINTS_DIR = "checkpoints"  # <out>/checkpoints/step-N/: the models of the last --keep-last validations

# <out>/run.json marks a folder as a training run of this program: only such a folder (or one
# written before the marker existed, recognised by its exact file set) is resumed or replaced.
RUN_MARKER = "run.json"
RUN_FORMAT = "transformer_ext.train-run"
RUN_FORMAT_VERSION = 1
_RUN_ENTRIES = frozenset({RUN_MARKER, OPTIONS_JSON, SUMMARY_JSON, "best", "last", "checkpoints"})
# What a run folder of the version before run.json could hold: its files, and the temporaries of
# its own writers (`best.tmp`, `last.old`, `summary.json.tmp`, ...).
_UNMARKED_RUN_ENTRIES = frozenset(
    {OPTIONS_JSON, SUMMARY_JSON, "best", "last"}
    | {f"{name}.{kind}" for name in ("best", "last") for kind in ("tmp", "old")}
    | {f"{name}.tmp" for name in (OPTIONS_JSON, SUMMARY_JSON)}
)


@dataclass(frozen=True)
class RunFolder:
    """What ``--output-dir`` holds: ``kind`` is "absent", "empty", "run" (this program's) or "foreign"."""

    path: Path
    kind: str
    marked: bool = False  # a run with run.json (False: a run of the version before the marker)
    others: tuple[str, ...] = ()  # entries this program did not write
    reason: str = ""  # why a non-empty folder is not a run of this program


def _ours(name: str, known: frozenset) -> bool:
    """``name`` is one of ``known``, or a temporary of one (transformer_ext.fsutil's one rule)."""
    t = parse_temporary_name(name)
    return name in known or (t is not None and t.root in known)


def inspect_out(out: Path) -> RunFolder:
    """Classify ``out`` without writing anything (errors for a path that cannot be a run folder)."""
    if not out.exists():
        if out.is_symlink():
            raise TrainingError(
                f"--output-dir {out} is a symbolic link to nothing; remove it or choose another folder"
            )
        return RunFolder(out, "absent")
    if not out.is_dir():
        raise TrainingError(
            f"--output-dir {out} is a file, not a folder; give the path of a folder for the run"
        )
    entries = sorted(os.listdir(out))
    if not entries:
        return RunFolder(out, "empty")
    if RUN_MARKER in entries:
        marker = out / RUN_MARKER
        try:
            data = json.loads(marker.read_bytes().decode("utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            return RunFolder(
                out, "foreign", reason=f"its {RUN_MARKER} is not a run marker of this program ({exc})"
            )
        if not isinstance(data, dict) or data.get("format") != RUN_FORMAT:
            return RunFolder(out, "foreign", reason=f"its {RUN_MARKER} is not a run marker of this program")
        version = data.get("format_version")
        if version != RUN_FORMAT_VERSION:
            raise TrainingError(
                f"{marker}: run format_version {version!r}; this version of transformer_ext "
                f"reads {RUN_FORMAT_VERSION} (was the run written by a newer version?)"
            )
        others = tuple(e for e in entries if not _ours(e, _RUN_ENTRIES))
        return RunFolder(out, "run", marked=True, others=others)
    others = tuple(e for e in entries if not _ours(e, _UNMARKED_RUN_ENTRIES))
    if others or not {OPTIONS_JSON, "last", "best"} & set(entries):
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        return RunFolder(out, "foreign", reason=f"it has no {RUN_MARKER} and holds {shown or 'other files'}")
    return RunFolder(out, "run", marked=False)


def check_out(folder: RunFolder, *, resume: bool, overwrite: bool) -> None:
    """Refuse a ``--output-dir`` that cannot be used as asked (resume, overwrite or a new run)."""
    out = folder.path
    if resume:
        if folder.kind != "run":
            raise TrainingError(
                f"cannot resume: {out} holds no training run of this program"
                + (f" ({folder.reason})" if folder.reason else "")
            )
    elif folder.kind == "foreign":
        raise TrainingError(
            f"--output-dir {out} is not a training run of this program ({folder.reason}); nothing in it "
            "is touched: choose a new or empty folder"
        )
    elif folder.kind == "run" and not overwrite:
        raise TrainingError(
            f"{out} already holds a training run; pass --resume to continue it, --overwrite to start "
            "afresh, or choose another --output-dir"
        )
    elif folder.kind == "run" and folder.others:
        raise TrainingError(
            f"--overwrite replaces the whole run folder {out}, but it also holds files this program did "
            f"not write ({', '.join(folder.others[:5])}{' ...' if len(folder.others) > 5 else ''}); move "
            "them away or choose another --output-dir"
        )


def marker() -> dict:
    return dict(
        format=RUN_FORMAT, format_version=RUN_FORMAT_VERSION, producer=f"transformer_ext {__version__}"
    )


def commit_run(stage: StagedDir, folder: RunFolder) -> None:
    """Put the staged run folder in place of ``--output-dir`` (the moment an old run is replaced).

    ``--output-dir`` is inspected again first: what it holds now must still be what was checked at the
    start (nothing, an empty folder, or a run of this program that may be replaced).
    """
    target = stage.target
    now = inspect_out(target)
    if now.kind == "absent":
        os.rename(stage.path, target)
        stage.committed = True
    elif now.kind == "empty":
        # The user's empty folder is kept (its permissions, a mount point): the entries move into it.
        for entry in sorted(os.listdir(stage.path), key=lambda name: name == RUN_MARKER):  # the marker last
            os.rename(stage.path / entry, target / entry)
        os.rmdir(stage.path)
        stage.committed = True
    elif now.kind == "run" and folder.kind == "run" and not now.others:
        stage.commit()  # the old run is moved aside, the new one renamed in, then the old one deleted
    else:
        raise TrainingError(
            f"--output-dir {folder.path} changed while the new run was training (it now holds "
            f"{', '.join(sorted(os.listdir(target))[:5])}); it was left as it is and the new run "
            "was not put in place"
        )
    logger.info(
        "the run folder %s is in place%s", target, " (the old run was replaced)" if now.kind == "run" else ""
    )


# ---------------------------------------------------------------------- checkpoints and state
def save_model_dir(
    model,
    tokenizer,
    directory: Path,
    provenance: Optional[bytes] = None,
    extra_files: Optional[Mapping[str, bytes]] = None,
) -> None:
    """A model folder: config, weights, tokenizer, ``provenance.json`` when given, and
    ``extra_files`` (name -> content, e.g. a fine-tuned model's ``generation_defaults.json``)."""
    from ..checkpoint import save_model

    save_model(model, directory)
    tokenizer.save(directory)
    if provenance is not None:
        atomic_write_bytes(directory / PROVENANCE_FILE, provenance)
    for name, content in (extra_files or {}).items():
        atomic_write_bytes(directory / name, content)


def save_step_checkpoint(
    run_dir: Path,
    step: int,
    model,
    tokenizer,
    keep: int,
    provenance: Optional[bytes] = None,
    extra_files: Optional[Mapping[str, bytes]] = None,
) -> None:
    """``<run_dir>/checkpoints/step-N/`` (a model folder), keeping the ``keep`` newest step folders."""
    folder = run_dir / CHECKPOINTS_DIR
    folder.mkdir(exist_ok=True)
    new = save_checkpoint(
        folder, f"step-{step}", model, tokenizer, provenance=provenance, extra_files=extra_files
    )
    ours = set(os.listdir(new))
    own, kept = [], []
    for path in step_checkpoints(folder):
        (kept if _foreign_entries(path, ours) else own).append(path)
    for path in kept:  # never deleted, never counted among the --keep-last newest
        if str(path) not in _warned_steps:
            _warned_steps.add(str(path))
            logger.warning(
                "kept %s: it holds files the trainer did not write (%s), so --keep-last leaves it alone",
                path,
                ", ".join(_foreign_entries(path, ours)[:5]),
            )
    for old in own[:-keep]:
        shutil.rmtree(old)
        logger.info("removed %s (--keep-last %d)", old, keep)


_warned_steps: set[str] = set()  # step folders already reported as kept (one warning per process)


def step_checkpoints(folder: Path) -> list[Path]:
    """The ``step-N`` model folders this program wrote in ``folder``, oldest (smallest N) first."""
    found = []
    if folder.is_dir():
        for entry in folder.iterdir():
            m = re.fullmatch(r"step-(\d+)", entry.name)
            if m and entry.is_dir() and (entry / "config.json").is_file():
                found.append((int(m.group(1)), entry))
    return [p for _, p in sorted(found)]


def _optimizer_to_flat(optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, st in sd["state"].items():
        for key, value in st.items():
            if torch.is_tensor(value):
                tensors[f"optimizer.{pid}.{key}"] = value.detach().to("cpu").contiguous()
            else:
                scalars.setdefault(str(pid), {})[key] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_from_flat(optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        if not name.startswith("optimizer."):
            continue
        _, pid, key = name.split(".", 2)
        pid = int(pid)
        if not 0 <= pid < len(params):
            raise ValueError(f"tensor {name}: the model has {len(params)} parameters")
        if key in ("exp_avg", "exp_avg_sq") and tuple(value.shape) != tuple(params[pid].shape):
            raise ValueError(
                f"tensor {name} has shape {tuple(value.shape)}, its parameter {tuple(params[pid].shape)}"
            )
        state.setdefault(pid, {})[key] = value
    for pid, extra in meta.get("scalars", {}).items():
        state.setdefault(int(pid), {}).update(extra)
    groups = []
    for g in meta["param_groups"]:
        g = dict(g)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def save_checkpoint(
    run_dir: Path,
    name: str,
    model,
    tokenizer,
    optimizer=None,
    scheduler=None,
    state: Optional[dict] = None,
    provenance: Optional[bytes] = None,
    extra_files: Optional[Mapping[str, bytes]] = None,
) -> Path:
    """Write ``<run_dir>/<name>/`` (model directory, plus the training state when given).

    Built in a temporary sibling and swapped in (:class:`~transformer_ext.fsutil.StagedDir`):
    the previous checkpoint stays until the new one is complete, and an interruption or a full
    disk leaves the previous one and no temporary folder.
    """
    from safetensors.torch import save_file

    with StagedDir(run_dir / name) as stage:
        save_model_dir(model, tokenizer, stage.path, provenance, extra_files)
        if state is not None:
            tensors, opt_meta = _optimizer_to_flat(optimizer)
            tensors["rng.torch"] = torch.get_rng_state()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                for i, s in enumerate(torch.cuda.get_rng_state_all()):
                    tensors[f"rng.cuda.{i}"] = s
            save_file(tensors, str(stage.path / STATE_TENSORS))
            sched = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas" and _jsonable(v)}
            atomic_write_json(stage.path / STATE_JSON, dict(state, optimizer=opt_meta, scheduler=sched))
        _keep_foreign_entries(stage.target, stage.path)
        return stage.commit()


def _foreign_entries(folder: Path, ours: Iterable[str]) -> list[str]:
    """The entries of ``folder`` that are neither in ``ours`` nor temporaries of them."""
    known = frozenset(ours)
    try:
        entries = sorted(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [e for e in entries if not _ours(e, known)]


def _keep_foreign_entries(target: Path, staged: Path) -> None:
    """Copy into the staged checkpoint what ``target`` holds besides a checkpoint's files (a file the
    user put in best/, say), so replacing the checkpoint never deletes it. The originals stay in
    ``target`` until the new folder has taken its place."""
    foreign = _foreign_entries(target, os.listdir(staged))
    for entry in foreign:
        src, dst = target / entry, staged / entry
        if src.is_dir() and not src.is_symlink():
            shutil.copytree(src, dst, symlinks=True)
        else:
            shutil.copy2(src, dst, follow_symlinks=False)
    if foreign:
        logger.warning(
            "%s holds files the trainer did not write (%s); they are kept in the new checkpoint",
            target,
            ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else ""),
        )


def last_dir(out: Path) -> Path:
    """``<out>/last``, or the copy of it that an interrupted replacement left (then ``last`` is missing)."""
    last = out / "last"
    if last.exists():
        return last
    if (out / "last.old").is_dir():  # the writer before fsutil, interrupted between two renames
        return out / "last.old"
    backups = sorted(
        (p for p in out.glob(".last.old-*") if p.is_dir() and _is_backup_of(p.name, "last")),
        key=lambda p: p.stat().st_mtime,
    )
    if backups:
        logger.warning(
            "%s is missing; resuming from %s, left by an interrupted checkpoint write", last, backups[-1]
        )
        return backups[-1]
    return last


def _is_backup_of(name: str, target: str) -> bool:
    t = parse_temporary_name(name)
    return t is not None and t.kind == "old" and t.target == target


def read_json_file(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise TrainingError(f"cannot resume: {path} ({what}) is missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TrainingError(f"cannot resume: {path} ({what}) is corrupt or truncated: {exc}") from None


_STATE_KEYS = dict(
    step=int,
    epoch=int,
    batch_in_epoch=int,
    history=list,
    best=(dict, type(None)),
    total_elapsed_s=(int, float),
    optimizer=dict,
    scheduler=dict,
)


def load_state(last: Path, optimizer, scheduler) -> dict:
    """The saved training state of ``last``, loaded into ``optimizer``, ``scheduler`` and torch's RNG.

    Every problem (a missing, corrupt or truncated file, a state of another model) is a
    :class:`TrainingError` naming the file.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from ..checkpoint import check_finite

    json_path, tensors_path = last / STATE_JSON, last / STATE_TENSORS
    for path in (json_path, tensors_path):
        if not path.is_file():
            raise TrainingError(f"cannot resume: {path} is missing (was the run saved with this version?)")
    payload = read_json_file(json_path, "training state")
    if not isinstance(payload, dict):
        raise TrainingError(f"cannot resume: {json_path} is not a training state (not a JSON object)")
    for key, kind in _STATE_KEYS.items():
        if key not in payload:
            raise TrainingError(
                f"cannot resume: {json_path} has no {key!r} (not a training state of this program)"
            )
        value = payload[key]
        if isinstance(value, bool) or not isinstance(value, kind) or (kind is int and value < 0):
            raise TrainingError(f"cannot resume: {json_path}: {key!r} is {value!r}, not a valid value")
    try:
        tensors = load_file(str(tensors_path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise TrainingError(f"cannot resume: {tensors_path} is corrupt or truncated: {exc}") from None
    try:
        check_finite(tensors, str(tensors_path))
    except ValueError as exc:
        raise TrainingError(f"cannot resume: {exc}") from None
    if "rng.torch" not in tensors:
        raise TrainingError(f"cannot resume: {tensors_path} has no 'rng.torch' tensor")
    try:
        _optimizer_from_flat(optimizer, tensors, payload.pop("optimizer"))
        sched = payload.pop("scheduler")
        sched["lr_lambdas"] = [None] * len(
            optimizer.param_groups
        )  # the schedule function is rebuilt, not stored
        scheduler.load_state_dict(sched)
        torch.set_rng_state(tensors["rng.torch"])
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as exc:
        raise TrainingError(
            f"cannot resume: {json_path} and {tensors_path} are not a training state of this model: {exc}"
        ) from None
    cuda_states = [tensors[k] for k in sorted(tensors) if k.startswith("rng.cuda.")]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states)
    return payload


def check_export_dir(export_dir, out: Path) -> Optional[Path]:
    """The ``--export`` folder, checked: not a file, outside the run, and empty or a model folder already."""
    if export_dir is None:
        return None
    target = Path(export_dir)
    if target.exists() and not target.is_dir():
        raise TrainingError(f"--export {target} is a file, not a folder")
    resolved, run = Path(os.path.realpath(target)), Path(os.path.realpath(out))
    if resolved == run or run in resolved.parents:
        raise TrainingError(f"--export {target} is inside the run folder {out}; choose a folder outside it")
    if target.is_dir() and any(target.iterdir()):
        from ..config import TransformerConfig

        config = target / MODEL_FILES[0]
        if not config.is_file():
            raise TrainingError(
                f"--export {target} is not empty and holds no {MODEL_FILES[0]}: it is not a model "
                "folder, and the export would write into it; choose an empty or new folder"
            )
        try:
            TransformerConfig.load_json(config)
        except ValueError as exc:
            raise TrainingError(
                f"--export {target} does not hold a model of this program ({exc}); choose an empty "
                "or new folder"
            ) from None
    return target


def export_model(
    best: Path, target: Path, summary: dict, tokenizer_files: Sequence[str] = (TOKENIZER_FILE,)
) -> None:
    """Copy the model directory ``best`` (config, weights, tokenizer, provenance and generation
    defaults when it has them) to ``target`` with a summary.

    ``target`` was checked before training (:func:`check_export_dir`); each file is replaced
    atomically, other files in ``target`` are kept.
    """
    target.mkdir(parents=True, exist_ok=True)
    names = list(MODEL_FILES[:2]) + list(tokenizer_files)
    names += [name for name in OPTIONAL_MODEL_FILES if (best / name).is_file()]
    for name in names:
        atomic_write_bytes(target / name, (best / name).read_bytes())
    atomic_write_json(target / "training_summary.json", summary)
    logger.info("exported the best model to %s", target)


# ---------------------------------------------------------------------- where other commands must not write
MANAGED_DIRS = ("best", "last", CHECKPOINTS_DIR)  # the trainer replaces and deletes what is in them


def _is_marked_run(folder: Path) -> bool:
    try:
        data = json.loads((folder / RUN_MARKER).read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and data.get("format") == RUN_FORMAT


def managed_dirs(path, *, include_self: bool = True) -> list[tuple[str, Path]]:
    """The folders of training runs around ``path`` that the trainer manages: ``best/``, ``last/`` and
    ``checkpoints/`` of every run folder (one with this program's ``run.json``) that is ``path``
    (unless ``include_self`` is False) or one of its parents.

    Hand them to :func:`transformer_ext.fsutil.check_output_path` as ``managed_dirs``: an output of
    another command there would be replaced or deleted by the next ``--resume``, or taken for a
    training checkpoint.
    """
    real = Path(os.path.realpath(os.path.abspath(path)))
    candidates = list(real.parents) if not include_self else [real, *real.parents]
    return [
        (f"the {name}/ folder of the training run", run / name)
        for run in candidates
        if _is_marked_run(run)
        for name in MANAGED_DIRS
    ]


# ---------------------------------------------------------------------- the lock of a run folder
class RunLock:
    """An advisory lock on a run folder, held while a session trains it.

    The lock file ``.NAME.lock`` beside the run folder (where its temporaries go too) is locked
    with ``flock`` and names its holder (host and process id). A second session on the same folder
    is refused, naming the holder. A lock file left by a process that is gone (killed) is taken
    over with a warning when it was written on this host; one written on another host is never
    taken over (its process may be alive there), the message says how to remove it. Where the file
    system has no ``flock``, a holder of this host counts as gone when its process id no longer runs.
    """

    def __init__(self, out: Path):
        real = Path(os.path.realpath(os.path.abspath(out)))
        self.out = out
        self.path = real.parent / f".{real.name}.lock"
        self.fd: Optional[int] = None

    def _holder(self, fd: int) -> dict:
        try:
            data = json.loads(os.pread(fd, 4096, 0).decode("utf-8") or "{}")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return {}
        return data if isinstance(data, dict) else {}

    def _refuse(self, holder: dict, how: str) -> TrainingError:
        who = f"process {holder.get('pid', '?')} on host {holder.get('host', '?')}"
        return TrainingError(
            f"--output-dir {self.out} is in use: {who} {how} (lock file {self.path}); wait until that run has "
            "finished, or stop it, then resume with --resume"
            + (f"; if {who} is gone, remove {self.path}" if "another host" in how else "")
        )

    def _open_locked(self) -> tuple[int, bool]:
        """The lock file, open and flock-ed (False: the file system has no flock)."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self._holder(fd)
                os.close(fd)
                raise self._refuse(holder, "is training this run") from None
            except OSError as exc:
                if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    os.close(fd)
                    raise
                return fd, False
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:  # removed by its holder between our open and flock
                same = False
            if same:
                return fd, True
            os.close(fd)

    def acquire(self) -> None:
        if self.fd is not None:
            return
        fd, flocked = self._open_locked()
        try:
            holder = self._holder(fd)
            pid = holder.get("pid")
            if holder and (holder.get("host"), pid) != (_HOST, os.getpid()):
                if holder.get("host") != _HOST:
                    raise self._refuse(holder, "of another host holds its lock and may still be training it")
                if not flocked and isinstance(pid, int) and _pid_alive(pid):
                    raise self._refuse(holder, "is training this run")
                logger.warning(
                    "took over the lock %s of process %s of this host, which is gone (it was interrupted)",
                    self.path,
                    pid,
                )
            record = json.dumps(dict(host=_HOST, pid=os.getpid(), out=str(self.out))).encode("utf-8")
            os.ftruncate(fd, 0)
            os.pwrite(fd, record, 0)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


# ---------------------------------------------------------------------- a failing disk
def disk_errors(option: str, path: Path):
    """Turn an OSError of a failing disk (full, read-only, no permission) into a TrainingError that
    names the output the user gave (``option path``), what is wrong and the file being written
    (:func:`transformer_ext.fsutil.disk_errors`)."""
    return fsutil.disk_errors(option, path, TrainingError)
