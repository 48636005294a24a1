"""Run folders (``$TMPDIR/smolbench-*``): made with their owner recorded, swept when it is gone.

A folder holds a machine's socket, log and workspace. It is removed when its
machine is deleted; a kernel killed with ``kill -9`` can't do that, so each
folder records its owner (pid and start time) in ``owner``, and the next
``%smol up`` removes folders whose owner is no longer running. A folder is made
under a name that says its owner (``smolbench-making.PID.START.xxxx``), its
``owner`` written, then renamed into place: a kernel killed at any point between
leaves nothing its next sweep can't attribute. A live owner's folder is never
touched, nor another user's, nor one without an owner record (made by a version
before this one).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import string
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from ..gate.archive import read_small
from ._procs import start_time

PREFIX = "smolbench-"
OWNER = "owner"
MAKING = PREFIX + "making."  # + PID.START. + random: a folder being made, its owner in its name
_NAME = string.ascii_lowercase + string.digits


def make(base: str | None = None, prefix: str = PREFIX) -> Path:
    """A new private run folder under ``base`` (default: $TMPDIR), owned by this process."""
    root = base or tempfile.gettempdir()
    me = f"{os.getpid()} {start_time(os.getpid())}"
    making = Path(tempfile.mkdtemp(prefix=MAKING + me.replace(" ", ".") + ".", dir=root))
    try:
        os.chmod(making, 0o700)
        (making / OWNER).write_text(me + "\n")
        while True:
            path = Path(root) / (prefix + "".join(secrets.choice(_NAME) for _ in range(8)))
            try:
                _rename_new(making, path)
                return path
            except FileExistsError:
                continue
    except BaseException:
        with _folder(Path(root)) as fd:
            remove_tree(fd, making.name)
        raise


def _rename_new(old: Path, new: Path) -> None:
    """Rename ``old`` to ``new``, which must not exist: a rename onto an empty folder (another
    kernel's, made an instant ago) would take its place. ``renameat2(RENAME_NOREPLACE)``, else
    a look first where the kernel or the C library has none."""
    func = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if func is not None:
        at_cwd, noreplace = -100, 1
        if func(at_cwd, os.fsencode(old), at_cwd, os.fsencode(new), noreplace) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS):
            raise OSError(err, os.strerror(err), str(new))
    if os.path.lexists(new):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(new))
    os.rename(old, new)


def owner_alive(path: Path) -> bool | None:
    """True/False for a folder's owner; None when the folder has no owner record. A folder
    being made is its name's (the machine never saw it, and its owner file may not be there yet)."""
    if path.name.startswith(MAKING):
        pid, started = (path.name[len(MAKING):].split(".") + ["", ""])[:2]
        return start_time(int(pid)) == started if pid.isdigit() and started.isdigit() else None
    try:  # the machine can write in its run folder: read_small follows no link, opens no fifo
        pid, started = (read_small(path / OWNER, 256) or "").split()
        return start_time(int(pid)) == started
    except ValueError:
        return None


def sweep(base: str | None = None, prefix: str = PREFIX, before: Callable[[Path], None] | None = None) -> list[Path]:
    """Remove run folders (named ``prefix``...) of owners that are gone; returns what was removed.
    ``before(path)`` runs first for each (a Ray cluster's: its processes still dying)."""
    removed = []
    root = Path(base or tempfile.gettempdir())
    with contextlib.suppress(OSError):
        for path in root.iterdir():
            if not path.name.startswith(prefix) or path.is_symlink() or not path.is_dir():
                continue
            if path.lstat().st_uid != os.getuid():  # never another user's
                continue
            if owner_alive(path) is False:
                if before is not None:
                    before(path)
                with _folder(root) as fd:  # no link followed, no fifo opened, however deep
                    remove_tree(fd, path.name)
                if not path.exists():
                    removed.append(path)
    return removed


@contextlib.contextmanager
def _folder(path: Path) -> Iterator[int]:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


OPEN_MOST = 32  # folders of the walk held open at once (one above them is reopened as "..")
DEPTH_MOST = 100_000  # folders below the one removed, at most (deeper: left for the machine's delete)


def remove_tree(parent: int, name: str) -> None:
    """Remove the folder ``name`` of the folder ``parent`` (a descriptor) with what is in it,
    relative to descriptors only: a link is removed, never followed, and nothing but a folder
    is ever opened (``O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK``: a fifo put in a folder's place
    can't hold the delete up, as it held ``shutil.rmtree``'s first open). However deep, to
    DEPTH_MOST: the walk stopped 32 folders down, the rest stayed, and the next branch given
    the same folder saw it (third audit). At most OPEN_MOST folders are held open; one above
    them is reopened as ``..`` only if it is the very folder the walk came down through (its
    device and inode), else the walk stops. What a live machine changes meanwhile may be left."""
    top = _open_folder(parent, name)
    if top is None:
        return
    levels = [_level(top, name)]
    try:
        _walk(levels)
    finally:
        for level in levels:
            if level.fd is not None:
                os.close(level.fd)
    with contextlib.suppress(OSError):
        os.rmdir(name, dir_fd=parent)


def _open_folder(parent: int, name: str) -> int | None:
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
    except OSError:
        return None


class _Level:
    """A folder on the walk's way down: its descriptor (None once closed), which folder it is,
    its name in the one above, and its folders not walked yet (all else in it is removed at once)."""

    __slots__ = ("fd", "ident", "name", "todo")

    def __init__(self, fd: int, name: str) -> None:
        st = os.fstat(fd)
        self.fd: int | None = fd
        self.ident = (st.st_dev, st.st_ino)
        self.name = name
        self.todo: list[str] = []


def _level(fd: int, name: str) -> _Level:
    level = _Level(fd, name)
    with contextlib.suppress(OSError), os.scandir(fd) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                level.todo.append(entry.name)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.name, dir_fd=fd)
    return level


def _walk(levels: list[_Level]) -> None:
    """Depth first: into the next folder not walked, else remove this one and go up."""
    while True:
        here = levels[-1]
        assert here.fd is not None
        if here.todo and len(levels) <= DEPTH_MOST:
            sub = here.todo.pop()
            fd = _open_folder(here.fd, sub)
            if fd is not None:
                levels.append(_level(fd, sub))
                if len(levels) > OPEN_MOST + 1:  # the top one stays open
                    far = levels[-OPEN_MOST - 1]
                    if far.fd is not None:
                        os.close(far.fd)
                        far.fd = None
            continue
        if len(levels) == 1:
            return
        levels.pop()
        up = levels[-1]
        if up.fd is None:
            fd = _open_folder(here.fd, "..")
            st = os.fstat(fd) if fd is not None else None
            if st is None or (st.st_dev, st.st_ino) != up.ident:  # moved meanwhile: stop
                if fd is not None:
                    os.close(fd)
                os.close(here.fd)
                return
            up.fd = fd
        os.close(here.fd)
        with contextlib.suppress(OSError):
            os.rmdir(here.name, dir_fd=up.fd)
