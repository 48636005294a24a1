"""The one rule for which checkpoint file the host may read or delete.

A path the host is told about (a ledger row, a file found in the checkpoint folder, a
server request, a backend's reply) is data: a shared or copied folder carries someone
else's ledger, and a kernel's ledger is written by code that ran machines. The host
uses such a path only when it names a file that

- is named ``NAME.smolcheckpoint`` (NAME: letters, digits, ``.``, ``_``, ``-``),
- lies directly in this folder's checkpoint folder (``.smolbench/checkpoints/``),
  reached from the folder without following any link (each component opened with
  ``O_NOFOLLOW`` relative to the one above it),
- is a regular file (not a link, folder, fifo or device), checked on the descriptor
  that is then used, never on the name again,
- and, to be read, has one name only: a hard link's other name may be someone else's
  file (``st_nlink > 1`` is refused). Deleting one removes this folder's name only,
  which never touches the content under its other names.

A row's path is kept relative to the ledger's folder (``checkpoints/NAME.smolcheckpoint``).
Rows from older ledgers hold absolute paths; such a path is read as the file of that
name in *this* folder's checkpoint folder, so a copied folder acts on its own copy,
never on the original's.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import sys
import time
from collections.abc import Container, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..backends import _procs
from ..errors import SmolbenchError

SUFFIX = ".smolcheckpoint"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
MAX_PATH = 4096
# Tests weaken the rule here to show what it stops (never set outside tests).
TEST_WEAKEN: set[str] = set()


class PathRefused(SmolbenchError):
    """A path the rule refuses: the host neither reads nor deletes what it names.

    ``reason`` says why without naming the path (for views that must not show host paths)."""

    def __init__(self, what: str, reason: str) -> None:
        super().__init__(f"{what} {reason}")
        self.reason = reason


class Missing(SmolbenchError):
    """The rule would allow the file, but it is not there."""


# A file being written here is named by its writer, who holds an flock on it while writing: a
# writer killed mid-write (SIGKILL) leaves it, and the next kernel in this folder removes it
# once no one holds it (sweep_parts). The lock, not the pid, says it is alive: a writer in
# another pid namespace (a container) or on another host (an NFS home) has a pid of its own.
PART = re.compile(r"\.(?P<name>[A-Za-z0-9][A-Za-z0-9._-]{0,63}\.smolcheckpoint)\.(?P<pid>[0-9]{1,10})-(?P<start>[0-9]{1,20})\.part")
PART_AGE = 60.0  # s a part file must be unchanged for before a sweep takes it (its writer locks it at once)


def part_name(fname: str) -> str:
    """The name ``fname`` is written under until it is whole: ``.NAME.smolcheckpoint.PID-START.part``."""
    return f".{fname}.{os.getpid()}-{_procs.start_time(os.getpid())}.part"


def hold_part(fd: int) -> None:
    """Mark a part file open at ``fd`` as being written (until ``fd`` is closed)."""
    with contextlib.suppress(OSError):  # no locks here (some network file systems): the age still counts
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def valid_name(name: str) -> bool:
    """Whether ``name`` is a checkpoint name (what goes before the suffix)."""
    return bool(NAME.fullmatch(name)) and name not in (".", "..")


def suggested_name(text: str) -> str:
    """A name :func:`valid_name` accepts, close to ``text`` (a file's stem someone may rename):
    each run of other characters one ``_``, no leading ``.``/``_``/``-``, at most 64 characters
    ("checkpoint" when nothing is left)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._-")[:64]
    return name if valid_name(name) else "checkpoint"


def file_name(named: object, folder: str = "checkpoints") -> str:
    """The file name (``NAME.smolcheckpoint``) a row's path stands for in the checkpoint folder
    called ``folder``, or PathRefused. Relative paths: ``NAME.smolcheckpoint`` or
    ``checkpoints/NAME.smolcheckpoint``; absolute ones (older ledgers): ``…/checkpoints/NAME.smolcheckpoint``."""
    if not isinstance(named, str) or not named or len(named) > MAX_PATH or "\0" in named:
        raise PathRefused(_show(named), "is not a checkpoint path")
    parts = PurePosixPath(named).parts
    if named.startswith("/"):
        ok = len(parts) >= 3 and parts[-2] == folder
    else:
        ok = len(parts) == 1 or (len(parts) == 2 and parts[0] == folder)
    base = parts[-1] if parts else ""
    if "name" in TEST_WEAKEN:
        return named  # weakened: the path as given, as the code before this rule used it
    if not ok or not base.endswith(SUFFIX) or not valid_name(base[: -len(SUFFIX)]):
        raise PathRefused(_show(named), f"is not a file NAME{SUFFIX} in this folder's checkpoint folder")
    return base


def _show(named: object) -> str:
    text = repr(named) if not isinstance(named, str) else named
    return text if len(text) <= 200 else text[:199] + "…"


@dataclass(frozen=True)
class Opened:
    """A checkpoint file the rule allowed, open for reading."""

    fd: int
    size: int
    name: str  # NAME.smolcheckpoint
    dev_ino: tuple[int, int]

    @property
    def path(self) -> str:
        """A path that reopens exactly this file (this process only), whatever its name becomes."""
        return f"/proc/self/fd/{self.fd}"


class Store:
    """One folder's checkpoint folder (``<folder>/.smolbench/checkpoints``), used only by the rule.

    ``directory`` is absolute; its parent's parent (the notebook's folder) is trusted as the
    place the user works in, and everything below it is walked without following links."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(os.path.abspath(directory))
        self.anchor = self.directory.parent.parent
        self.chain = (self.directory.parent.name, self.directory.name)

    def __repr__(self) -> str:
        return f"Store({str(self.directory)!r})"

    def relative(self, fname: str) -> str:
        """What a ledger row records for ``fname``: its path relative to the ledger's folder."""
        return f"{self.directory.name}/{fname}"

    def absolute(self, fname: str) -> str:
        """``fname``'s path by name (for a backend that writes it, and for messages)."""
        return str(self.directory / fname)

    def shown(self, named: object) -> str:
        """A row's path as messages show it: its file here, or the path as given when refused."""
        try:
            return str(Path(self.chain[0]) / self.chain[1] / file_name(named, self.chain[1]))
        except PathRefused:
            return _show(named)

    def file_name(self, named: object) -> str:
        """The file name a row's path stands for here (PathRefused if the rule refuses it)."""
        return file_name(named, self.chain[1])

    @contextlib.contextmanager
    def _dir(self, make: bool = False) -> Iterator[int]:
        """The checkpoint folder's descriptor, walked from the anchor without following links."""
        try:
            fd = os.open(self.anchor, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise Missing(f"the folder {self.anchor} is gone") from None
        try:
            for part in self.chain:
                if make:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                flags = DIR_FLAGS & ~os.O_NOFOLLOW if "follow" in TEST_WEAKEN else DIR_FLAGS
                try:
                    nxt = os.open(part, flags, dir_fd=fd)
                except FileNotFoundError:
                    raise Missing(f"there is no checkpoint folder {self.directory}") from None
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise PathRefused(str(self.anchor / part), "is a link or not a folder: checkpoints are used "
                                          "only in a plain .smolbench/checkpoints folder") from None
                    raise
                os.close(fd)
                fd = nxt
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The checkpoint folder held against other kernels (an exclusive ``flock`` on the folder
        itself: no lock file, which a copied folder could make a link)."""
        with self._dir(make=True) as dfd:
            with contextlib.suppress(OSError):  # no locks here (some network file systems): unheld
                fcntl.flock(dfd, fcntl.LOCK_EX)
            yield  # closing the descriptor lets go

    def ensure(self) -> None:
        """Make the checkpoint folder (and ``.smolbench``) if needed, refusing links on the way."""
        with self._dir(make=True):
            pass

    @contextlib.contextmanager
    def open(self, named: object) -> Iterator[Opened]:
        """The file a row's path names, open for reading, if the rule allows it (else PathRefused,
        or Missing when it is not there)."""
        fname = self.file_name(named)
        with self._dir() as dfd:
            flags = FILE_FLAGS & ~os.O_NOFOLLOW if "follow" in TEST_WEAKEN else FILE_FLAGS
            try:
                fd = os.open(fname, flags, dir_fd=dfd)
            except FileNotFoundError:
                raise Missing(f"{self.shown(fname)} is missing") from None
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise PathRefused(self.shown(fname), "is a link: refused (a checkpoint is a plain file)") from None
                raise PathRefused(self.shown(fname), f"can't be opened ({exc.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise PathRefused(self.shown(fname), "is not a plain file: refused")
            if st.st_nlink > 1 and "hardlink" not in TEST_WEAKEN:
                raise PathRefused(self.shown(fname), f"is a hard link ({st.st_nlink} names; another may be someone "
                                  "else's file): refused; `cp` it to a new file to make it this folder's own")
            yield Opened(fd, st.st_size, fname, (st.st_dev, st.st_ino))
        finally:
            os.close(fd)

    def usable(self, named: object) -> str | None:
        """None when the file a row names may be read; otherwise why not (one line)."""
        try:
            with self.open(named):
                return None
        except (PathRefused, Missing) as exc:
            return str(exc)

    def remove(self, named: object) -> bool:
        """Delete the file a row's path names when the rule allows it; False when it is not there.

        Only the name in this folder goes (``unlinkat`` of a regular file found without following
        links): a name swapped for a link meanwhile is removed itself, never what it points to."""
        fname = self.file_name(named)
        try:
            with self._dir() as dfd:
                try:
                    st = os.stat(fname, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    return False
                if not stat.S_ISREG(st.st_mode):
                    kind = "a link" if stat.S_ISLNK(st.st_mode) else "not a plain file"
                    raise PathRefused(self.shown(fname), f"is {kind}: left alone")
                os.unlink(fname, dir_fd=dfd)
                return True
        except Missing:
            return False

    def sweep_parts(self) -> list[str]:
        """Remove the part files (see :data:`PART`) whose writer is gone; their names."""
        gone: list[str] = []
        with contextlib.suppress(Missing, PathRefused, OSError), self._dir() as dfd:
            with os.scandir(dfd) as entries:
                found = [e.name for e in entries if PART.fullmatch(e.name) and e.is_file(follow_symlinks=False)]
            for name in found:
                with contextlib.suppress(OSError):
                    fd = os.open(name, FILE_FLAGS, dir_fd=dfd)
                    try:
                        st = os.fstat(fd)
                        if not stat.S_ISREG(st.st_mode) or time.time() - st.st_mtime < PART_AGE:
                            continue
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # its writer holds it: BlockingIOError
                        if os.stat(name, dir_fd=dfd, follow_symlinks=False).st_ino == st.st_ino:
                            os.unlink(name, dir_fd=dfd)
                            gone.append(name)
                    finally:
                        os.close(fd)
        return gone

    def names(self) -> list[str]:
        """The checkpoint files in the folder (plain files named NAME.smolcheckpoint), sorted."""
        return self.some_names(sys.maxsize, (), sys.maxsize)[0]

    def some_names(self, want: int, skip: Container[str | None], limit: int) -> tuple[list[str], int, bool]:
        """Up to ``want`` of :meth:`names` that ``skip`` doesn't hold, from the folder's first
        ``limit`` entries at most (the folder's own order; sorted); how many more of them those
        entries held; and whether the folder has entries past them, not looked at (a copied
        folder's 100,000 files are not all read, nor kept)."""
        found: list[str] = []
        more = 0
        try:
            with self._dir() as dfd, os.scandir(dfd) as entries:
                for seen, e in enumerate(entries):
                    if seen >= limit:
                        return sorted(found), more, True
                    if e.name in skip or not (e.name.endswith(SUFFIX) and valid_name(e.name[: -len(SUFFIX)])) \
                            or not e.is_file(follow_symlinks=False):
                        continue
                    if len(found) < want:
                        found.append(e.name)
                    else:
                        more += 1
        except (Missing, PathRefused, OSError):
            return [], 0, False
        return sorted(found), more, False

    def misnamed(self) -> list[str]:
        """Plain files here that look like checkpoints but that :meth:`names` skips (a browser's
        ``NAME (1).smolcheckpoint``, a changed case), sorted."""
        return self.some_misnamed(None)[0]

    def some_misnamed(self, limit: int | None) -> tuple[list[str], bool]:
        """:meth:`misnamed` from the folder's first ``limit`` entries at most (None: all), and
        whether the folder has entries past them, not looked at."""
        found: list[str] = []
        try:
            with self._dir() as dfd, os.scandir(dfd) as entries:
                for seen, e in enumerate(entries):
                    if limit is not None and seen >= limit:
                        return sorted(found), True
                    if e.name.lower().endswith(SUFFIX) and not (e.name.endswith(SUFFIX) and
                                                                valid_name(e.name[: -len(SUFFIX)])) \
                            and e.is_file(follow_symlinks=False):
                        found.append(e.name)
        except (Missing, PathRefused, OSError):
            return [], False
        return sorted(found), False

    @contextlib.contextmanager
    def create(self, fname: str) -> Iterator[int]:
        """A new file ``fname`` here, written through the yielded descriptor and put in place
        (atomically, never through a link) when the block ends without an error."""
        if not fname.endswith(SUFFIX) or not valid_name(fname[: -len(SUFFIX)]):
            raise PathRefused(repr(fname), "is not a checkpoint file name")
        part = part_name(fname)
        with self._dir(make=True) as dfd:
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            hold_part(fd)
            try:
                yield fd
                os.fsync(fd)
                os.replace(part, fname, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(part, dir_fd=dfd)
                raise
            finally:
                os.close(fd)
