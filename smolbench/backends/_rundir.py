"""Run folders (``$TMPDIR/smolbench-*``): made with their owner recorded, swept when it is gone.

A folder holds a machine's socket, log and workspace. It is removed when its
machine is deleted; a kernel killed with ``kill -9`` can't do that, so each
folder records its owner (pid and start time) in ``owner``, and the next
``%smol up`` removes folders whose owner is no longer running. A live owner's
folder is never touched, nor another user's, nor one without a readable ``owner`` record.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from ..gate.archive import read_small
from ._procs import start_time

PREFIX = "smolbench-"
OWNER = "owner"


def make(base: str | None = None, prefix: str = PREFIX) -> Path:
    """A new private run folder under ``base`` (default: $TMPDIR), owned by this process."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    os.chmod(path, 0o700)
    (path / OWNER).write_text(f"{os.getpid()} {start_time(os.getpid())}\n")
    return path


def owner_alive(path: Path) -> bool | None:
    """True/False for a folder's owner; None when the folder has no owner record."""
    try:  # the machine can write in its run folder: read_small follows no link, opens no fifo
        pid, started = (read_small(path / OWNER, 256) or "").split()
        return start_time(int(pid)) == started
    except ValueError:
        return None


def sweep(base: str | None = None) -> list[Path]:
    """Remove run folders of owners that are gone; returns what was removed."""
    removed = []
    root = Path(base or tempfile.gettempdir())
    with contextlib.suppress(OSError):
        for path in root.iterdir():
            if not path.name.startswith(PREFIX) or path.is_symlink() or not path.is_dir():
                continue
            if path.lstat().st_uid != os.getuid():  # never another user's
                continue
            if owner_alive(path) is False:
                shutil.rmtree(path, ignore_errors=True)
                if not path.exists():
                    removed.append(path)
    return removed
