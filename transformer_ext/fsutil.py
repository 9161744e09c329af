"""Safe writes to the user's disk: atomic files and folders, recognisable temporaries, cleanup.

Every writer of the package (config, tokenizer, manifest, checkpoints, training state, export
folders, engines) goes through this module, so the rules hold everywhere:

* Nothing is written in place. A file is written to a temporary sibling and renamed over the
  target (``atomic_write_bytes`` / ``atomic_write_text`` / ``atomic_write_json``); a folder is
  built in a temporary sibling (``StagedDir``) and swapped in by ``replace_dir``, which keeps the
  old folder until the new one is in place.
* Temporaries are named ``.{target}.tmp-{host}-{pid}-{random}`` (backups ``.old-``), so a later
  run can tell whose they are. They are removed on any exception, on SIGINT, and on SIGTERM
  when the process runs under ``transformer_ext.cli.run_cli`` (which turns SIGTERM into an
  exception). After SIGKILL they stay; the next write to the same target removes those written
  by this host whose process is gone (``remove_stale_temporaries``) and logs each removal. A
  temporary of another host is never touched: run folders may sit on a file system shared by
  several machines under torchrun.
* Permissions follow the umask, as for every other tool.
* An output never overlaps what the command reads or a folder that a command manages
  (:func:`check_output_path`): it is not an input file, not inside an input folder (a model or
  export folder in use), does not contain an input, and is not inside (nor contains) a managed
  folder (a training run's ``best/``, ``last/``, ``checkpoints/``). Symlinks are resolved first.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import secrets
import shutil
import socket
from pathlib import Path
from typing import Any, Iterable, Tuple, Union

from .cli import UserError

logger = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]
# a path, or ``(description, path)`` where the description names it in messages ("--input", "the
# model folder --model")
LabelledPath = Union[PathLike, Tuple[str, PathLike]]

_KINDS = ("tmp", "old")
_HOST = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def temporary_name(target: PathLike, kind: str = "tmp") -> str:
    """The name of a temporary sibling of ``target``: ``.{name}.{kind}-{host}-{pid}-{random}``."""
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
    return f".{Path(target).name}.{kind}-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temporaries(target: PathLike) -> list[Path]:
    """Remove temporaries of ``target`` left by killed processes of this host; return them.

    Only names of the form :func:`temporary_name` makes are considered, only those whose host is
    this host and whose process id is no longer running are removed, and each removal is logged.
    """
    target = Path(target)
    parent = target.parent if str(target.parent) else Path(".")
    pattern = re.compile(
        r"^\." + re.escape(target.name) + r"\.(tmp|old)-(?P<host>[A-Za-z0-9_.]+)-(?P<pid>\d+)-[0-9a-f]{8}$"
    )
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        m = pattern.match(entry.name)
        if not m or m.group("host") != _HOST:
            continue
        pid = int(m.group("pid"))
        if pid == os.getpid() or _pid_alive(pid):
            continue
        path = Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                path.unlink()
            except OSError:
                continue
        logger.warning("removed %s, left behind by process %d of this host that was interrupted", path, pid)
        removed.append(path)
    return removed


def resolve_target(target: PathLike) -> Path:
    """``target`` with a symlink in its last component followed (so the link is kept, its folder replaced)."""
    target = Path(target)
    return Path(os.path.realpath(target)) if target.is_symlink() else target


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: a reader sees the old file or the new one, never a part."""
    path = resolve_target(path)
    remove_stale_temporaries(path)
    tmp = path.with_name(temporary_name(path))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_write_text(path: PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: PathLike, obj: Any) -> None:
    """``obj`` as indented JSON (NaN and infinities refused: they are not JSON) plus a newline."""
    atomic_write_text(path, json.dumps(obj, indent=2, allow_nan=False) + "\n")


def replace_dir(tmp_dir: PathLike, target: PathLike) -> None:
    """Move the finished ``tmp_dir`` (a sibling of ``target``) to ``target``.

    An existing ``target`` is renamed to a backup until the move succeeded and put back if it
    fails, so a reader never sees a half-written folder and a good folder is never lost. Whether
    ``target`` may be replaced at all is the caller's decision, made before anything is written.
    """
    tmp_dir, target = Path(tmp_dir), resolve_target(target)
    os.chmod(tmp_dir, 0o777 & ~_umask())
    if not target.exists():
        os.rename(tmp_dir, target)
        return
    backup = target.with_name(temporary_name(target, "old"))
    os.rename(target, backup)
    try:
        os.rename(tmp_dir, target)
    except BaseException:
        os.rename(backup, target)  # put the good folder back
        raise
    shutil.rmtree(backup, ignore_errors=True)


class StagedDir:
    """A folder written in a temporary sibling of ``target`` and swapped in by :meth:`commit`.

    ::

        with StagedDir(out) as stage:
            write_files(stage.path)
            stage.commit()          # replaces ``out`` atomically

    Leaving the block without ``commit`` (an exception, SIGINT, SIGTERM under ``run_cli``)
    removes the temporary folder. Stale temporaries of ``target`` from killed runs of this host
    are removed on entry. A symlink ``target`` stays a symlink: the folder it points to is replaced.
    """

    def __init__(self, target: PathLike):
        self.target = resolve_target(target)
        self.path: Path | None = None
        self.committed = False

    def __enter__(self) -> "StagedDir":
        parent = self.target.parent
        if not parent.is_dir():
            raise FileNotFoundError(
                errno.ENOENT, "the folder that should contain the output does not exist", str(parent)
            )
        remove_stale_temporaries(self.target)
        path = parent / temporary_name(self.target)
        os.mkdir(path)
        self.path = path
        return self

    def commit(self) -> Path:
        if self.path is None:
            raise RuntimeError("StagedDir.commit() called outside its with block")
        replace_dir(self.path, self.target)
        self.committed = True
        return self.target

    def __exit__(self, *exc) -> None:
        if not self.committed and self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)


class OutputConflictError(UserError, ValueError):
    """An output that is, contains or lies inside an input or a managed folder."""


def _labelled(item: LabelledPath, default: str) -> tuple[str, Path]:
    if isinstance(item, tuple):
        label, path = item
        return str(label), Path(path)
    return default, Path(item)


def _real(path: Path) -> Path:
    return Path(os.path.realpath(os.path.abspath(path)))


def _same(a: Path, b: Path) -> bool:
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)  # hard links, bind mounts
    except OSError:
        return False


def _within(inner: Path, outer: Path) -> bool:
    return inner != outer and outer in inner.parents


def check_output_path(
    output: PathLike,
    *,
    inputs: Iterable[LabelledPath] = (),
    managed_dirs: Iterable[LabelledPath] = (),
    what: str = "--output",
) -> Path:
    """Refuse an ``output`` that overlaps an input or a managed folder; return it resolved.

    ``output`` (a file or a folder the command will write or replace) must not be any of
    ``inputs`` (files or folders the command reads), lie inside one of them or contain one, and
    must not be, lie inside or contain any of ``managed_dirs`` (folders another part of the
    package owns and replaces). Symlinks are resolved (and hard links compared by identity)
    before comparing. Each entry is a path or ``(description, path)``; the error names ``what``
    (the option), the output, the description and the path of the conflict. Touches nothing.
    """
    out = _real(Path(output))
    for item in inputs:
        label, path = _labelled(item, "the input")
        real = _real(path)
        if _same(out, real):
            raise OutputConflictError(f"{what} {output} is {label} {path}; write the output to another file")
        if _within(out, real):
            raise OutputConflictError(
                f"{what} {output} lies inside {label} {path}; choose an output outside it"
            )
        if _within(real, out):
            raise OutputConflictError(
                f"{what} {output} contains {label} {path}; choose an output that does not contain it"
            )
    for item in managed_dirs:
        label, path = _labelled(item, "a managed folder")
        real = _real(path)
        if _same(out, real) or _within(out, real):
            raise OutputConflictError(
                f"{what} {output} lies inside {label} {path}, which the program manages (its contents are "
                "replaced or deleted); choose an output outside it"
            )
        if _within(real, out):
            raise OutputConflictError(
                f"{what} {output} contains {label} {path}, which the program manages; choose an output that "
                "does not contain it"
            )
    return out
