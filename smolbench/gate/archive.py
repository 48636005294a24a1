"""Checkpoint archives without following a machine's links.

A machine saves its checkpoint into a folder the host can see; the machine made
every path in it, so the host opens them only through directory descriptors with
``O_NOFOLLOW`` (a link, fifo or device there is refused, never read through). The
workspace archive inside is checked member by member, resolving its own links the way
extraction would: a link that leads outside the archive (``/``, ``/etc/shadow``,
``..``), an absolute or ``..`` path, or a device is refused with one line. The host
never extracts an archive: restoring hands the checked files to the new machine,
whose agent extracts them itself (with tarfile's ``data`` filter where it has one).
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import stat
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import IO

from ..errors import SmolbenchError
from .limits import LIMITS, human

FILES = ("namespace.pkl", "workspace.tar")
LINK_HOPS = 40  # like the kernel's limit on symlinks followed in one lookup
OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# Tests weaken the checks here to show what they stop (never set outside tests).
TEST_WEAKEN: set[str] = set()


class UnsafeCheckpoint(SmolbenchError):
    """A checkpoint (or a machine's saved files) the host refuses to use."""


@contextlib.contextmanager
def _dirfd(path: str | os.PathLike[str], name: str | None = None, parent: int | None = None) -> Iterator[int]:
    try:
        fd = os.open(name if name is not None else path, OPEN_DIR, dir_fd=parent)
    except OSError as exc:
        raise UnsafeCheckpoint(f"{name or path} is not a plain folder ({exc.strerror})") from None
    try:
        yield fd
    finally:
        os.close(fd)


def _open_plain(name: str, dir_fd: int, what: str) -> tuple[int, int]:
    """(fd, size) of a regular file ``name`` in ``dir_fd``, not through a link, and with no
    holes: a machine's sparse file would cost the host its whole claimed size in zeros."""
    flags = OPEN_FILE & ~os.O_NOFOLLOW if "follow" in TEST_WEAKEN else OPEN_FILE
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        raise UnsafeCheckpoint(f"{what}: {name} is not a plain file ({exc.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafeCheckpoint(f"{what}: {name} is not a plain file")
    if "sparse" not in TEST_WEAKEN and st.st_size and _has_holes(fd, st.st_size):
        os.close(fd)
        raise UnsafeCheckpoint(f"{what}: {name} is a sparse file ({human(st.st_size)} claimed, with holes); "
                               "a machine's save never makes one")
    return fd, st.st_size


def _has_holes(fd: int, size: int) -> bool:
    try:
        return os.lseek(fd, 0, os.SEEK_HOLE) < size
    except OSError:  # no SEEK_HOLE here: a file system without holes
        return False
    finally:
        os.lseek(fd, 0, os.SEEK_SET)


def _within_limit(sizes: dict[str, int], what: str) -> None:
    """One line if ``sizes`` (name -> bytes) add up to more than the checkpoint limit."""
    total = sum(sizes.values())
    if total > LIMITS.checkpoint and "size" not in TEST_WEAKEN:
        parts = ", ".join(f"{n} {human(v)}" for n, v in sizes.items())
        raise UnsafeCheckpoint(f"{what} holds {human(total)} ({parts}), over the checkpoint limit of "
                               f"{human(LIMITS.checkpoint)}: keep less in the machine, or raise it with "
                               "`%smol config checkpoint-limit 4G`")


def read_small(path: str | os.PathLike[str], limit: int = 64 * 1024) -> str | None:
    """The text of a small file a machine may have made (its last ``limit`` bytes), or None.

    Never through a link, never blocking on a fifo: a run folder is writable from inside
    the machine, so its ``owner``, ``ready`` and log files are machine-made too.
    """
    try:
        fd = os.open(path, OPEN_FILE)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            return None
        if st.st_size > limit:
            fh.seek(st.st_size - limit)
        return fh.read(limit).decode("utf-8", "replace")


def _copy_exact(src: IO[bytes], dst: IO[bytes], size: int, what: str) -> None:
    left = size
    while left:
        block = src.read(min(left, 1 << 20))
        if not block:
            raise UnsafeCheckpoint(f"{what} changed while it was being read")
        dst.write(block)
        left -= len(block)


def _resolve(path: PurePosixPath, links: dict[str, str], hops: int = 0) -> list[str] | None:
    """``path``'s components after following the archive's own links; None if it leaves the archive."""
    parts: list[str] = []
    for i, part in enumerate(path.parts):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                return None
            parts.pop()
            continue
        parts.append(part)
        target = links.get("/".join(parts))
        if target is not None:
            if hops >= LINK_HOPS or target.startswith("/"):
                return None
            rest = PurePosixPath(*path.parts[i + 1:]) if i + 1 < len(path.parts) else PurePosixPath(".")
            return _resolve(PurePosixPath(*parts[:-1], target, rest), links, hops + 1)
    return parts


def check_members(tar: tarfile.TarFile, where: str) -> None:
    """Refuse a workspace archive whose members could land or point outside it."""
    members = tar.getmembers()
    links = {m.name.strip("/"): m.linkname for m in members if m.issym()}
    for m in members:
        name = PurePosixPath(m.name)
        if m.name.startswith("/") or ".." in name.parts:
            raise UnsafeCheckpoint(f"{where} has a file outside its workspace ({m.name})")
        if not (m.isfile() or m.isdir() or m.issym() or m.islnk()):
            raise UnsafeCheckpoint(f"{where} has a device or fifo ({m.name})")
        if m.issym() or m.islnk():
            target = PurePosixPath(m.linkname) if m.islnk() else name.parent / m.linkname
            if m.linkname.startswith("/") or _resolve(target, links) is None:
                kind = "hard link" if m.islnk() else "link"
                raise UnsafeCheckpoint(f"{where} has a {kind} that points outside it ({m.name} -> {m.linkname})")
        # a path that goes through one of the archive's links must stay inside too
        if _resolve(name, links) is None:
            raise UnsafeCheckpoint(f"{where} has a file reached through a link outside it ({m.name})")


def check_workspace(blob: bytes, where: str) -> None:
    """Refuse a workspace archive (bytes a machine sent) with links or paths leading outside it."""
    try:
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tar:
            check_members(tar, where)
    except tarfile.TarError as exc:
        raise UnsafeCheckpoint(f"{where} is not a readable archive ({exc})") from None


def pack(run_dir: str | os.PathLike[str], stage: str, out: str, where: str) -> None:
    """Write checkpoint ``out`` from the files machine ``where`` saved in ``run_dir/stage``.

    Each file is read by its real size, at most the checkpoint limit, and never held in
    memory: the workspace archive is checked in a copy next to ``out`` (never the host's
    /tmp) so the machine can't change it after the check, the namespace goes straight in."""
    what = f"the checkpoint machine {where} saved"
    with _dirfd(run_dir) as root, _dirfd(run_dir, stage, root) as folder, contextlib.ExitStack() as stack:
        opened = {}
        for name in FILES:
            fd, size = _open_plain(name, folder, what)
            opened[name] = (stack.enter_context(os.fdopen(fd, "rb")), size)
        _within_limit({name: size for name, (_, size) in opened.items()}, what)
        ws = stack.enter_context(tempfile.TemporaryFile(dir=os.path.dirname(os.path.abspath(out))))
        src, size = opened["workspace.tar"]
        _copy_exact(src, ws, size, what)
        ws.seek(0)
        try:
            with tarfile.open(fileobj=ws, mode="r:") as inner:
                check_members(inner, f"machine {where}'s workspace")
        except tarfile.TarError as exc:
            raise UnsafeCheckpoint(f"{what} has a broken workspace archive ({exc})") from None
        ws.seek(0)
        with tarfile.open(out, "w:gz") as tar:
            src, nsize = opened["namespace.pkl"]
            info = tarfile.TarInfo("namespace.pkl")
            info.size = nsize
            try:
                tar.addfile(info, src)
            except OSError as exc:  # tarfile: "unexpected end of data"
                raise UnsafeCheckpoint(f"{what} changed while it was being read ({exc})") from None
            info = tarfile.TarInfo("workspace.tar")
            info.size = size
            tar.addfile(info, ws)


def check(path: str, backend: str = "sandbox") -> None:
    """Refuse a checkpoint file that is not exactly two plain files with a safe workspace,
    or that claims more than the checkpoint limit (refused before any of it is unpacked)."""
    with tarfile.open(path, "r:gz") as tar:
        members, sizes = [], {}
        while True:
            m = tar.next()  # one header at a time: a huge claimed size is refused before its data is read
            if m is None:
                break
            members.append(m)
            if m.name in FILES and m.isfile():
                sizes[m.name] = m.size
                _within_limit(sizes, f"checkpoint {Path(path).name}")
            if len(members) > len(FILES):
                break
        names = sorted(m.name for m in members)
        if names != sorted(FILES) or not all(m.isfile() for m in members):
            raise SmolbenchError(f"checkpoint {path} is not a {backend} checkpoint (has {names[:5]})")
        blob = tar.extractfile("workspace.tar")
        assert blob is not None
        with tarfile.open(fileobj=blob, mode="r:") as inner:
            check_members(inner, f"checkpoint {Path(path).name}")


def hand_over(path: str, run_dir: str | os.PathLike[str]) -> str:
    """Copy a checked checkpoint's two files into a new folder of ``run_dir``; the folder's name.

    The folder is made here (never an existing path) and the files are created with
    ``O_EXCL | O_NOFOLLOW``, so nothing the machine placed there is written through.
    """
    stage = f"restore-{secrets.token_hex(6)}"
    with _dirfd(run_dir) as root:
        os.mkdir(stage, 0o700, dir_fd=root)
        with _dirfd(run_dir, stage, root) as folder, tarfile.open(path, "r:gz") as tar:
            for name in FILES:
                src = tar.extractfile(name)
                assert src is not None
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=folder)
                with os.fdopen(fd, "wb") as dst:
                    _copy_exact(src, dst, tar.getmember(name).size, f"checkpoint {path}")
    return stage
