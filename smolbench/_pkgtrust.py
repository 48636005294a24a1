"""The packages cache's trust, as ssh trusts its files: the cache folder, the folders above it and
every entry must be the user's own (or root's) and writable by nobody else (a folder above may be
if it is sticky, like /tmp). Checked through file descriptors, from / down, without following
links, and a machine mounts the very folder that was checked (:class:`Held`), so a folder swapped
for a link or another folder meanwhile is never what a machine gets."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import weakref
from pathlib import Path
from typing import NoReturn

from .errors import SmolbenchError

LIB = "lib"  # the installed tree inside a cache entry: what machines see
META = "packages.json"


class Held:
    """What a machine holds of its cache entry while it runs: the ``lib`` folder that was checked (an
    O_PATH fd: bound through ``/proc/self/fd``, it is what gets mounted, whatever its path names by
    then) and a shared lock on the entry's key, which ``smolbench packages prune`` leaves alone."""

    def __init__(self, lib_fd: int, lock_fd: int = -1) -> None:
        self.lib_fd = lib_fd  # (an image folder is held this way too, with no lock: images.held_rootfs)
        fds = (lib_fd, lock_fd) if lock_fd >= 0 else (lib_fd,)
        self._close = weakref.finalize(self, _close_fds, fds)  # dropped unclosed: closed then

    @property
    def path(self) -> str:
        """The checked folder, as a path this process can open or bind (not a child's)."""
        return f"/proc/self/fd/{self.lib_fd}"

    def close(self) -> None:
        self._close()


def _close_fds(fds: tuple[int, ...]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def untrusted(st: os.stat_result, above: bool = False) -> str | None:
    """Why another user could have planted or altered a file or folder (its lstat ``st``), or None:
    as ssh does its files, it must be the user's own (or root's) and writable by nobody else.
    ``above``: a folder above the cache, where others may write if it is sticky (like /tmp): they
    can't rename or remove what is not theirs there."""
    if st.st_uid not in (os.getuid(), 0):
        return f"it belongs to uid {st.st_uid}, not you (uid {os.getuid()}) or root"
    if stat.S_ISLNK(st.st_mode) or not st.st_mode & 0o022:  # a link's own mode means nothing
        return None
    if above and st.st_mode & stat.S_ISVTX:
        return None
    who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002)) if st.st_mode & bit)
    return f"it is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}{' and not sticky' if above else ''})"


_DIR = os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC


def open_plain(path: str | os.PathLike[str], dir_fd: int | None = None) -> int:
    """The plain file ``path`` (in ``dir_fd``) opened to read, without following a link at its name
    and without waiting (a fifo or device planted there would hang the open or the read): OSError
    when it is anything else."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a plain file", os.fspath(path))
    return fd


class LinkOnTheWay(OSError):
    """A path's folder or file is a link (its one argument: the link's path)."""


def open_plain_below(path: str | os.PathLike[str]) -> int:
    """:func:`open_plain` of absolute ``path``, reached from / a folder at a time following no link:
    :class:`LinkOnTheWay` names one on its way. A link in a folder a machine writes (a volume) would
    lead a root host to a file the machine chose, and one swapped in after a check fails the open."""
    parts = [p for p in os.path.abspath(path).split("/") if p]
    if not parts:
        raise OSError(errno.EISDIR, "not a plain file", os.fspath(path))
    fd, here = os.open("/", _DIR), "/"
    try:
        for i, part in enumerate(parts):
            try:
                nxt = open_plain(part, dir_fd=fd) if i == len(parts) - 1 else os.open(part, _DIR, dir_fd=fd)
            except OSError as exc:
                try:
                    link = stat.S_ISLNK(os.lstat(part, dir_fd=fd).st_mode)
                except OSError:
                    link = False
                raise LinkOnTheWay(os.path.join(here, part)) if link else exc from None
            if i == len(parts) - 1:
                return nxt
            os.close(fd)
            fd, here = nxt, os.path.join(here, part)
        raise AssertionError("unreachable")
    finally:
        os.close(fd)


def read_plain(path: str | os.PathLike[str], limit: int, dir_fd: int | None = None) -> bytes:
    """At most ``limit`` bytes of the plain file ``path`` (in ``dir_fd``): :func:`open_plain`'s,
    OSError when it is anything but a plain file, or can't be read."""
    fd = open_plain(path, dir_fd)
    try:
        chunks, left = [], limit
        while left > 0:
            block = os.read(fd, min(left, 1 << 16))
            if not block:
                break
            chunks.append(block)
            left -= len(block)
        return b"".join(chunks)
    finally:
        os.close(fd)


def open_root(root: Path, what: str = "packages cache") -> int:
    """The packages folder ``root`` (or the image cache's, ``what``) as an O_PATH fd, or refused in one line with the fix if another
    user could write in it or in a folder above it (up to the user's home, or / outside it): they
    could rename it and put their own in its place. Reached from / a folder at a time without following
    links (a link the user made, like $SMOLBENCH_CACHE's, is resolved first): what is checked is what is used."""
    real = os.path.realpath(root)
    home = os.path.realpath(os.path.expanduser("~"))
    inside = real.startswith(home.rstrip("/") + "/")
    fd = os.open("/", _DIR)
    try:
        here = "/"
        for part in [p for p in real.split("/") if p] + [""]:
            st = os.fstat(fd)
            last = not part
            if last or not inside or here == home or here.startswith(home.rstrip("/") + "/"):
                why = untrusted(st, above=not last)
                if why is not None:
                    _refuse_root(root, "" if last else here, why, st, what)
            if last:
                return fd
            try:
                nxt = os.open(part, _DIR, dir_fd=fd)
            except OSError as exc:
                elsewhere = "set $SMOLBENCH_CACHE to a folder of your own" if what in _HOLDS else "use a folder of your own"
                raise SmolbenchError(f"can't open the {what} {root} ({os.path.join(here, part)}: "
                                     f"{exc.strerror}; did a folder become a link?): check it, or {elsewhere}") from None
            os.close(fd)
            fd, here = nxt, os.path.join(here, part)
    except BaseException:
        os.close(fd)
        raise
    raise AssertionError("unreachable")


_HOLDS = {"packages cache": "packages", "image cache": "root filesystems"}


def _refuse_root(root: Path, above: str, why: str, st: os.stat_result, what: str = "packages cache") -> None:
    folder = above or str(root)
    cache = what in _HOLDS
    elsewhere = "set $SMOLBENCH_CACHE to a folder of your own" if cache else "use a folder of your own"
    fix = f"chmod go-w {folder}" if st.st_uid == os.getuid() else elsewhere
    if above:
        raise SmolbenchError(f"refusing the {what} {root}: the folder {above} above it: {why}, so another user "
                             f"could rename it and put their own in its place; {fix} (or chmod +t {above}), or "
                             f"{elsewhere}")
    held = f"the {_HOLDS[what]} it mounts into machines" if cache else "what is in it"
    raise SmolbenchError(f"refusing the {what} {root}: {why}, so another user could plant or alter {held}; {fix}")


class Untrusted(Exception):
    """A folder another user could have planted or altered; its one argument says why, in words."""


def open_dir(dir_fd: int, name: str, above: bool = False) -> int | None:
    """The folder ``name`` in the folder ``dir_fd`` as an O_PATH fd, reached without following a link,
    or None when there is none. Raises :class:`Untrusted` if it is a link or not a folder, or another
    user could write in it (:func:`untrusted`; ``above``: a folder above what is used, sticky will do)."""
    try:
        fd = os.open(name, _DIR, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ENOTDIR (O_PATH|O_NOFOLLOW opens a link itself), ELOOP: a link or a file in its place
        with contextlib.suppress(OSError):
            if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                raise Untrusted("it is not a folder (a link)") from None
        raise Untrusted(f"it is not a folder ({exc.strerror})") from None
    why = untrusted(os.fstat(fd), above)
    if why is not None:
        os.close(fd)
        raise Untrusted(why)
    return fd


def _complete(root_fd: int, name: str) -> bool:
    """Whether the entry ``name`` has its packages.json (an install finished it)."""
    try:
        return stat.S_ISREG(os.stat(f"{name}/{META}", dir_fd=root_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _open_entry(root_fd: int, entry: Path) -> tuple[int, int] | None:
    """The complete cache entry ``entry`` (in ``root_fd``) as O_PATH fds of itself and its ``lib``, or
    None when there is none; refused (in one line, with the fix) if another user could have planted or
    altered it: it, its files and folders, reached without following links, must all be the user's own
    (or root's) and writable by nobody else. pip made them so (:func:`_readable`); a shared cache's other
    user can't, nor can anyone change them after. Checked before every mount (~7 ms a thousand files)."""
    try:
        fd = os.open(entry.name, _DIR, dir_fd=root_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP, ENOTDIR: a link or a file in its place
        _refuse(entry, entry, f"it is not a folder ({exc.strerror})")
    fds = [fd]
    try:
        found = untrusted(os.fstat(fd))
        if found is not None:
            _refuse(entry, entry, found)
        try:
            meta = os.stat(META, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            _close_fds(tuple(fds))
            return None  # half made: an install replaces it
        why = untrusted(meta)
        if why is not None:
            _refuse(entry, entry / META, why)
        try:
            fds.append(os.open(LIB, _DIR, dir_fd=fd))
        except OSError as exc:
            _refuse(entry, entry / LIB, f"it can't be read ({exc.strerror})")
        bad = untrusted(os.fstat(fds[1])) or _walk(fds[1], entry / LIB)
        if bad is not None:
            _refuse(entry, entry / LIB if isinstance(bad, str) else bad[0], bad if isinstance(bad, str) else bad[1])
        return fds[0], fds[1]
    except BaseException:
        _close_fds(tuple(fds))
        raise


def _walk(lib_fd: int, lib: Path) -> tuple[Path, str] | None:
    """The first file or folder below the folder ``lib_fd`` another user could have altered, and why."""
    def fail(exc: OSError) -> None:
        raise exc

    try:
        for dirpath, dirnames, filenames, dir_fd in os.fwalk(".", dir_fd=lib_fd, onerror=fail):
            for name in dirnames + filenames:
                why = untrusted(os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
                if why:
                    return Path(os.path.normpath(lib / dirpath / name)), why
    except OSError as exc:
        return Path(exc.filename or lib), f"it can't be read ({exc.strerror})"
    return None


def _refuse(entry: Path, path: Path, why: str) -> NoReturn:
    where = "" if path == entry else f" ({path})"
    raise SmolbenchError(f"refusing the packages cache entry {entry}{where}: {why}, so another user could have "
                         f"planted or altered it; remove it (rm -rf {entry}: the next up installs it anew), "
                         "or set $SMOLBENCH_CACHE to a folder of your own")
