"""Atomic replacement of output folders, shared by training checkpoints and the exporters."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def replace_dir(tmp_dir: Path, target: Path) -> None:
    """Move the finished ``tmp_dir`` (a sibling of ``target``) to ``target``.

    An existing ``target`` is kept until the move succeeded and put back if it fails, so a
    reader never sees a half-written folder and a good folder is never lost.
    """
    tmp_dir, target = Path(tmp_dir), Path(target)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_dir, 0o777 & ~umask)  # mkdtemp makes it private
    if not target.exists():
        os.rename(tmp_dir, target)
        return
    backup = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.rmdir(backup)
    os.rename(target, backup)
    try:
        os.rename(tmp_dir, target)
    except BaseException:
        os.rename(backup, target)  # put the good folder back
        raise
    shutil.rmtree(backup, ignore_errors=True)
