"""Artifacts that cross the cluster as data: content-addressed, received by size and hash.

A node keeps what it made or fetched (a smol parent's portable checkpoint, a machine's
saved checkpoint) in ``<node dir>/artifacts/<sha256>``. What a machine's state became is
untrusted, so a receiver (another node's agent, or the driver) never takes its sender's
word: it writes the bytes to a new file next to the store (never the host's /tmp), stops
at the size it was told and at the checkpoint limit, and keeps the file only if its
SHA-256 is the address it was asked for. Nothing here unpickles or extracts anything;
the format checks (``gate.archive``, ``smol_state``) run on the received file.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import stat
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from .._filehash import sha256_fd
from ..gate import archive
from ..gate.limits import LIMITS, human

CHUNK = 4 * 1024 * 1024  # bytes per Ray message: well under a small object store
AHEAD = 2  # chunks of an artifact on their way, in the object store, ahead of what the receiver took
DIGEST = re.compile(r"[0-9a-f]{64}")


class Refused(archive.UnsafeCheckpoint):
    """An artifact that is not what it claims to be (hash, size, kind)."""


def check_digest(digest: object) -> str:
    if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
        raise Refused(f"{str(digest)[:80]!r} is not a content address (64 hex digits of SHA-256)")
    return digest


def within_limit(size: int, what: str) -> None:
    if size > LIMITS.checkpoint and "size" not in archive.TEST_WEAKEN:
        raise Refused(f"{what} is {human(size)}, over the checkpoint limit of {human(LIMITS.checkpoint)}: refused; "
                      "raise it with `%smol config checkpoint-limit 4G`")


def hash_file(path: str | os.PathLike[str]) -> tuple[str, int]:
    """(sha256, size) of a plain file, read without following a link."""
    fd = archive.open_file(path)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Refused(f"{path} is not a plain file")
        return sha256_fd(fd)
    finally:
        os.close(fd)


def read_chunks(path: str | os.PathLike[str]) -> Iterator[bytes]:
    """A plain file's bytes, CHUNK at a time, not through a link."""
    fd = archive.open_file(path)
    with os.fdopen(fd, "rb") as fh:
        while block := fh.read(CHUNK):
            yield block


class Store:
    """A node's (or the driver's) content-addressed artifacts."""

    def __init__(self, base: str | os.PathLike[str]) -> None:
        self.dir = Path(base) / "artifacts"
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    def path(self, digest: str) -> Path:
        return self.dir / check_digest(digest)

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def add(self, path: str | os.PathLike[str]) -> tuple[str, int]:
        """Move a file this host wrote into the store; (digest, size)."""
        digest, size = hash_file(path)
        os.replace(path, self.path(digest))
        return digest, size

    def chunks(self, digest: str) -> Iterator[bytes]:
        """The bytes of an artifact, CHUNK at a time."""
        return read_chunks(self.path(digest))

    def drop(self, digest: str) -> None:
        with contextlib.suppress(OSError, archive.UnsafeCheckpoint):
            os.unlink(self.path(digest))

    async def receive(self, digest: str, size: int, chunks: AsyncIterator[object], where: str) -> int:
        """Write an artifact that arrives as ``chunks``; kept only if it is ``size`` bytes with this
        ``digest``. Returns the bytes received (0: the store had it already)."""
        if self.has(check_digest(digest)):
            return 0
        return await receive_file(self.path(digest), digest, size, chunks, where)


def chunks_from(agent: Any, digest: str) -> Any:
    """An agent's ``chunks`` generator of an artifact, at most AHEAD chunks ahead of its reader
    (without Ray's backpressure a 2 GB artifact could all run ahead into the object store)."""
    return agent.chunks.options(_generator_backpressure_num_objects=AHEAD).remote(digest)


async def receive_file(dest: str | os.PathLike[str], digest: str, size: int, chunks: AsyncIterator[object],
                       where: str) -> int:
    """Write ``chunks`` to ``dest`` if they are exactly ``size`` bytes hashing to ``digest``; else
    nothing is left and the refusal is one line."""
    check_digest(digest)
    if not isinstance(size, int) or size < 0:
        raise Refused(f"the artifact from {where} has no size")
    within_limit(size, f"the artifact from {where}")
    dest = Path(dest)
    fd, tmp = tempfile.mkstemp(prefix=".part-", dir=dest.parent)
    got, h = 0, hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            async for chunk in chunks:
                if not isinstance(chunk, bytes):
                    raise Refused(f"{where} sent {type(chunk).__name__}, not bytes")
                got += len(chunk)
                if got > size:
                    raise Refused(f"the artifact from {where} is longer than the {size} bytes it claimed: refused")
                h.update(chunk)
                out.write(chunk)
        if got != size:
            raise Refused(f"the artifact from {where} ended at {got} of {size} bytes: refused, try again")
        if h.hexdigest() != digest and "digest" not in archive.TEST_WEAKEN:
            raise Refused(f"the artifact from {where} doesn't match its content address (sha256 {h.hexdigest()[:12]}… "
                          f"vs {digest[:12]}…): it changed on the way or at rest; refused")
        os.replace(tmp, dest)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return got
