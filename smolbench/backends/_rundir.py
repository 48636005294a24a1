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


TREE_DEPTH = 32  # folders below the one removed at most (deeper: left for the machine's delete)


def remove_tree(parent: int, name: str, depth: int = 0) -> None:
    """Remove the folder ``name`` of the folder ``parent`` (a descriptor) with what is in it,
    relative to descriptors only: a link is removed, never followed, and nothing but a folder
    is ever opened (``O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK``: a fifo put in a folder's place
    can't hold the delete up, as it held ``shutil.rmtree``'s first open). What a machine
    changes meanwhile is left."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
    except OSError:
        return
    try:
        found: list[tuple[str, bool]] = []
        if depth < TREE_DEPTH:
            with contextlib.suppress(OSError), os.scandir(fd) as entries:
                found = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
        for entry, folder in found:
            if folder:
                remove_tree(fd, entry, depth + 1)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry, dir_fd=fd)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(name, dir_fd=parent)
