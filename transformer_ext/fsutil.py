"""Safe writes to the user's disk: atomic files and folders, recognisable temporaries, cleanup.

Every writer of the package (config, tokenizer, manifest, checkpoints, training state, export
folders, engines) goes through this module, so the rules hold everywhere:

* Nothing is written in place. A file is written to a temporary sibling and renamed over the
  target (``atomic_write_bytes`` / ``atomic_write_text`` / ``atomic_write_json``); a folder is
  built in a temporary sibling (``StagedDir``) and swapped in by ``replace_dir``: one atomic
  exchange where the file system has it, else two renames with the old folder kept as a backup
  until the new one is in place (and put back by the next write if the process dies between).
* Temporaries are named ``.{target}.tmp-{host}-{pid}-{random}`` (backups ``.old-``), so a later
  run can tell whose they are. They are removed on any exception, on SIGINT, and on SIGTERM
  when the process runs under ``transformer_ext.cli.run_cli`` (which turns SIGTERM into an
  exception). After SIGKILL they stay; the next write to the same target removes those written
  by this host whose process is gone (``remove_stale_temporaries``, one rule for every
  temporary, those of temporaries included: ``parse_temporary_name``) and logs each removal;
  a complete backup of a target that is missing is put back instead. A
  temporary of another host is never touched: run folders may sit on a file system shared by
  several machines under torchrun.
* Permissions follow the umask, as for every other tool.
* An output never overlaps what the command reads or a folder that a command manages
  (:func:`check_output_path`): it is not an input file, not inside an input folder (a model or
  export folder in use), does not contain an input, and is not inside (nor contains) a managed
  folder (a training run's ``best/``, ``last/``, ``checkpoints/``). Symlinks are resolved first.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import secrets
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Tuple, Union

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


# ``.{target}.{kind}-{host}-{pid}-{token}``: what :func:`temporary_name` makes
_TEMPORARY = re.compile(
    r"^\.(?P<target>.+)\.(?P<kind>tmp|old)-(?P<host>[A-Za-z0-9_.]+)-(?P<pid>\d+)-(?P<token>[0-9a-f]{8})$"
)
# a name derived from a temporary: ``.{target}.tmp-{host}-{pid}-{token}.{suffix}`` (a scratch folder
# beside a staged folder is the target of temporaries of its own)
_DERIVED = re.compile(r"^(?P<temporary>\..+\.(?:tmp|old)-[A-Za-z0-9_.]+-\d+-[0-9a-f]{8})\.[^/]+$")


@dataclass(frozen=True)
class TemporaryName:
    """What a name made by :func:`temporary_name` says: whose temporary (``root``) it is and whose process."""

    target: str  # the name it is a temporary of (itself maybe derived from a temporary)
    root: str  # the output it ultimately belongs to: ``target`` with every temporary layer removed
    kind: str  # "tmp" (being written) or "old" (a complete backup of the target)
    host: str
    pid: int


def parse_temporary_name(name: str) -> Optional[TemporaryName]:
    """The parts of a temporary's ``name``, or None when :func:`temporary_name` did not make it.

    A temporary of a temporary (``..out.tmp-H-1-0123abcd.quantize.tmp-H-1-89abcdef``, the
    quantizer's scratch folder beside a staged export) has the outermost output as its ``root``.
    This is the one rule by which every temporary is found and cleaned up.
    """
    m = _TEMPORARY.match(name)
    if m is None:
        return None
    target = m.group("target")
    root = target
    derived = _DERIVED.match(target)
    if derived is not None:
        inner = parse_temporary_name(derived.group("temporary"))
        if inner is not None:
            root = inner.root
    return TemporaryName(target, root, m.group("kind"), m.group("host"), int(m.group("pid")))


def is_temporary_name(name: str) -> bool:
    return parse_temporary_name(name) is not None


def remove_stale_temporaries(target: PathLike) -> list[Path]:
    """Clean up the temporaries of ``target`` left by killed processes of this host; return them.

    Only names of the form :func:`temporary_name` makes are considered (those of temporaries of
    ``target``'s temporaries included, :func:`parse_temporary_name`), only those whose host is
    this host and whose process id is no longer running are touched, and each one is logged.
    When ``target`` itself is missing, a stale backup (``.old-``: the complete old folder or
    file, which a process killed between the two renames of :func:`replace_dir` left) is put
    back at ``target`` instead of deleted; the other stale temporaries are removed.
    """
    target = Path(target)
    parent = target.parent if str(target.parent) else Path(".")
    removed: list[Path] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    stale: list[tuple[os.DirEntry, TemporaryName]] = []
    for entry in entries:
        info = parse_temporary_name(entry.name)
        if info is None or target.name not in (info.target, info.root) or info.host != _HOST:
            continue
        if info.pid == os.getpid() or _pid_alive(info.pid):
            continue
        stale.append((entry, info))
    if not os.path.lexists(target):
        backups = [(e, i) for e, i in stale if i.kind == "old" and i.target == target.name]
        if backups:
            entry, info = max(backups, key=lambda item: item[0].stat(follow_symlinks=False).st_ctime)
            try:
                os.rename(entry.path, target)
            except OSError as exc:
                logger.warning("could not put back %s (%s) at %s", entry.path, exc, target)
            else:
                logger.warning(
                    "put back %s at %s: process %d of this host was interrupted while replacing it",
                    entry.path,
                    target,
                    info.pid,
                )
                stale.remove((entry, info))
    for entry, info in stale:
        path = Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                path.unlink()
            except OSError:
                continue
        logger.warning(
            "removed %s, left behind by process %d of this host that was interrupted", path, info.pid
        )
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
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError) and exc.filename is None:  # a failed write(): name the file
            exc.filename = os.fspath(path)
        raise


def atomic_write_text(path: PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: PathLike, obj: Any) -> None:
    """``obj`` as indented JSON (NaN and infinities refused: they are not JSON) plus a newline."""
    atomic_write_text(path, json.dumps(obj, indent=2, allow_nan=False) + "\n")


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_renameat2_function: Any = None


def _renameat2():
    """glibc's ``renameat2``, or None (not Linux, an old glibc)."""
    global _renameat2_function
    if _renameat2_function is None:
        function = False
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            function = getattr(libc, "renameat2", False)
            if function:
                function.argtypes = [
                    ctypes.c_int,
                    ctypes.c_char_p,
                    ctypes.c_int,
                    ctypes.c_char_p,
                    ctypes.c_uint,
                ]
                function.restype = ctypes.c_int
        except (OSError, AttributeError, ImportError):
            function = False
        _renameat2_function = function
    return _renameat2_function or None


def exchange_paths(a: PathLike, b: PathLike) -> bool:
    """Swap ``a`` and ``b`` in one atomic step (``renameat2(RENAME_EXCHANGE)``); False where unsupported.

    Both must exist. Returns False, changing nothing, when the system or the file system has no
    atomic exchange; any other failure raises ``OSError``.
    """
    function = _renameat2()
    if function is None:
        return False
    import ctypes

    if function(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), os.fspath(b))


_RENAME_NOREPLACE = 1


def rename_noreplace(src: PathLike, dst: PathLike) -> None:
    """Rename ``src`` to ``dst``, which must not exist: ``FileExistsError`` (naming ``dst``) if it does.

    Race-free where the file system can (``renameat2(RENAME_NOREPLACE)``: Linux ext4, xfs,
    btrfs, tmpfs ...): the kernel checks and renames in one step, so whatever appears at ``dst``
    (a file, a folder, empty or not, another process's output) is never replaced. Elsewhere
    ``dst`` is checked and then renamed to; ``rename`` itself refuses an existing file and a
    folder that is not empty, so the one thing that can still be replaced is an empty folder
    created between the check and the rename.
    """
    src, dst = os.fspath(src), os.fspath(dst)
    function = _renameat2()
    if function is not None:
        import ctypes

        if function(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(errno.EEXIST, "the output appeared while it was being written", dst)
        if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), dst)
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, "the output appeared while it was being written", dst)
    try:
        os.rename(src, dst)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise FileExistsError(
                errno.EEXIST, "the output appeared while it was being written", dst
            ) from None
        raise


def replace_dir(tmp_dir: PathLike, target: PathLike) -> None:
    """Move the finished ``tmp_dir`` (a sibling of ``target``) to ``target``.

    An existing ``target`` is exchanged with ``tmp_dir`` in one atomic step where the file system
    can (``renameat2(RENAME_EXCHANGE)``: Linux ext4, xfs, btrfs, tmpfs ...), then the old folder,
    now at the temporary name, is deleted. Elsewhere it is renamed to a backup
    (``.NAME.old-...``) until the new folder is in; a failure puts it back, and a process killed
    between the two renames leaves the complete backup, which the next write of ``target``
    puts back (:func:`remove_stale_temporaries`). A reader never sees a half-written folder and
    a good folder is never lost. Whether ``target`` may be replaced at all is the caller's
    decision, made before anything is written.
    """
    tmp_dir, target = Path(tmp_dir), resolve_target(target)
    os.chmod(tmp_dir, 0o777 & ~_umask())
    if not target.exists():
        os.rename(tmp_dir, target)
        return
    if exchange_paths(tmp_dir, target):
        shutil.rmtree(tmp_dir, ignore_errors=True)  # the old folder; a stale temporary if this is cut short
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
    With ``replace=False`` the target must not exist when :meth:`commit` renames the folder there:
    whatever appeared at ``target`` meanwhile is kept and ``FileExistsError`` is raised
    (:func:`rename_noreplace`; the temporary folder is then removed as on any error).
    """

    def __init__(self, target: PathLike, *, replace: bool = True):
        self.target = resolve_target(target) if replace else Path(target)
        self.replace = replace
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
        if self.replace:
            replace_dir(self.path, self.target)
        else:
            os.chmod(self.path, 0o777 & ~_umask())
            rename_noreplace(self.path, self.target)
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


# What a failing disk means to the user (the errno of the OSError), for :func:`disk_errors`.
DISK_PROBLEMS = {
    errno.ENOSPC: "no space left on the device; free some space and run the command again",
    errno.EDQUOT: "disk quota exceeded; free some space and run the command again",
    errno.EROFS: "the file system is read-only; choose a folder you can write to",
    errno.EACCES: "permission denied; choose a folder you can write to",
    errno.EPERM: "operation not permitted; choose a folder you can write to",
}


def as_given(filename: PathLike) -> Path:
    """``filename`` with each temporary component (:func:`temporary_name`) replaced by the output it
    becomes: ``/d/.out.tmp-H-1-0123abcd/model.safetensors`` is ``/d/out/model.safetensors``."""
    parts = []
    for part in Path(filename).parts:
        t = parse_temporary_name(part)
        parts.append(t.root if t is not None else part)
    return Path(*parts)


@contextlib.contextmanager
def disk_errors(option: str, path: PathLike, error: type[Exception] = UserError) -> Iterator[None]:
    """Turn an OSError of a failing disk (full, read-only, no permission: :data:`DISK_PROBLEMS`)
    into ``error`` naming the output the user gave (``option path``), what is wrong and the file
    being written, as the user will know it (:func:`as_given`: never a temporary's name)."""
    try:
        yield
    except OSError as exc:
        problem = DISK_PROBLEMS.get(exc.errno)
        if problem is None:
            raise
        where = f" (writing {as_given(exc.filename)})" if exc.filename else ""
        raise error(f"{option} {path}: {problem}{where}") from exc
