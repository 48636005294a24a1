"""Smolfile requirements that name a wheel on this host (``name @ file:///…/x.whl``), by content.

The cache key holds each such wheel's SHA-256, so a rebuilt wheel is installed again (keyed
by its text alone, it never was). pip installs a private copy whose hash is the key's: a
wheel in a folder a machine can write (a volume) could otherwise be swapped between the key
and the install, and the swapped one mounted into every machine of that list.
"""

from __future__ import annotations

import errno
import os
import shutil
import urllib.parse
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

from ._filehash import sha256_fd
from ._pkgtrust import LinkOnTheWay, open_plain_below
from .errors import SmolbenchError

_CHUNK = 1 << 20
_MEMO: dict[str, tuple[tuple[int, ...], str]] = {}  # path: (its stat, its SHA-256)


def wheel_path(requirement: str) -> str | None:
    """The local file ``requirement`` names by a ``file:`` URL, else None."""
    try:
        url = Requirement(requirement).url
    except InvalidRequirement:
        return None
    parts = urllib.parse.urlsplit(url or "")
    if parts.scheme != "file" or parts.netloc not in ("", "localhost"):
        return None
    return urllib.parse.unquote(parts.path)


def _stamp(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _open_wheel(requirement: str, path: str) -> int:
    """The wheel at ``path`` opened once, hashed and copied from that descriptor: never through a link
    made after its real path was taken, nor a fifo (its folder may be a volume a machine writes)."""
    try:
        return open_plain_below(path)
    except LinkOnTheWay as link:
        raise SmolbenchError(f"Smolfile packages entry {requirement!r}: {link.args[0]} on its way is a link (a link "
                             f"in a folder a machine writes would choose the file): name the wheel by its real path, "
                             f"{os.path.realpath(path)}") from None
    except ValueError:  # a NUL in the path (the parser refuses it: this is a list it did not check)
        raise SmolbenchError(f"Smolfile packages entry {requirement!r}: its path holds a NUL character: write the "
                             "wheel's path without it") from None
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EISDIR):
            raise SmolbenchError(f"Smolfile packages entry {requirement!r}: {path} is not a plain file: point it "
                                 "at a .whl file") from None
        raise SmolbenchError(f"Smolfile packages entry {requirement!r}: can't read {path} ({exc.strerror}): "
                             "check the path") from None


def wheel_hashes(requirements: tuple[str, ...]) -> dict[str, str]:
    """Each local wheel's SHA-256, by its requirement (hashed again only when its stat changed)."""
    hashes: dict[str, str] = {}
    for text in requirements:
        path = wheel_path(text)
        if path is None:
            continue
        fd = _open_wheel(text, path)
        try:
            stamp = _stamp(os.fstat(fd))
            memo = _MEMO.get(path)
            if memo is None or memo[0] != stamp:
                memo = _MEMO[path] = (stamp, sha256_fd(fd)[0])
            hashes[text] = memo[1]
        finally:
            os.close(fd)
    return hashes


def private_copies(requirements: tuple[str, ...], hashes: dict[str, str], folder: Path) -> tuple[str, ...]:
    """``requirements`` with each local wheel replaced by a copy in ``folder`` (made here) whose
    SHA-256 is the one in ``hashes`` (the key's); one line if a wheel changed since."""
    out = []
    for text in requirements:
        path = wheel_path(text)
        if path is None:
            out.append(text)
            continue
        folder.mkdir(mode=0o700, exist_ok=True)
        copy = folder / f"{len(out)}" / os.path.basename(path)  # pip reads the wheel's name: kept
        copy.parent.mkdir(mode=0o700)
        fd = _open_wheel(text, path)
        try:
            with open(fd, "rb", closefd=False) as src, open(copy, "xb") as dst:
                shutil.copyfileobj(src, dst, _CHUNK)
        finally:
            os.close(fd)
        with open(copy, "rb") as mine:
            if sha256_fd(mine.fileno())[0] != hashes.get(text):
                raise SmolbenchError(f"Smolfile packages entry {text!r}: {path} changed while it was being installed: "
                                     "up again once it is written")
        req = Requirement(text)
        req.url = copy.as_uri()
        out.append(str(req))
    return tuple(out)
