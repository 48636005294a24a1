"""Checkpoint files that passed the check, remembered by the SHA-256 of the bytes checked.

One restore checks the same file at each step (before a machine comes up, its copy added to
this folder, the backend's own check), and a check is seconds of tarfile for a big workspace,
so a pass is remembered. It was remembered by the file's stat (inode, size, mtime, ctime), but
timestamps are coarse on some file systems (ext4 with 128-byte inodes: 1 s; FUSE, where ctime
can follow an mtime set back): someone else's file rewritten with other bytes of the same size
in the same second kept its key, and its copy restored unchecked (eighth audit). Now a pass is
kept under the hash of exactly the bytes the check read (:class:`Hashing`, in the same read)
and found only under a hash a caller made of the file it then uses: no hash, no lookup.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import os
import threading
from collections.abc import Iterator
from typing import IO, Any

KEPT = 16  # passes remembered (one restore needs one)
_PASSED: dict[tuple[object, ...], Any] = {}
_LOCK = threading.Lock()
# (the file's stat key, its hash) a restore made of the file it hands on, for the checks it calls
_KNOWN: contextvars.ContextVar[tuple[tuple[int, ...], str] | None] = contextvars.ContextVar("smolbench_known_hash",
                                                                                           default=None)


def recall(digest: str, limits: tuple[object, ...]) -> Any | None:
    """What passed the check for bytes whose SHA-256 is ``digest`` (under ``limits``), or None."""
    with _LOCK:
        return _PASSED.get((digest, *limits))


def remember(digest: str | None, limits: tuple[object, ...], checked: Any) -> None:
    """Keep ``checked`` for bytes whose SHA-256 is ``digest`` (None: their hash isn't known, kept not)."""
    if digest is None:
        return
    with _LOCK:
        _PASSED[(digest, *limits)] = checked
        while len(_PASSED) > KEPT:
            del _PASSED[next(iter(_PASSED))]


def forget() -> None:
    """Forget every pass (tests that change what a check would say)."""
    with _LOCK:
        _PASSED.clear()


def _stat_key(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


@contextlib.contextmanager
def known(fd: int, digest: str) -> Iterator[None]:
    """Within the block (its threads too: asyncio.to_thread copies it), a check of the file open
    at ``fd``, under any name, looks its pass up under ``digest``: the hash the caller made from
    ``fd`` of the file it is handing on (the restore's own copy, in its own folder)."""
    token = _KNOWN.set((_stat_key(os.fstat(fd)), digest))
    try:
        yield
    finally:
        _KNOWN.reset(token)


def known_for(st: os.stat_result) -> str | None:
    """The hash :func:`known` gave for the file of stat ``st``, else None."""
    given = _KNOWN.get()
    return given[1] if given is not None and given[0] == _stat_key(st) else None


class Hashing:
    """A file's bytes as a check reads them from its start, hashed in that read; :meth:`digest`
    then hashes what the check left unread. A check reads some bytes twice (tarfile going back
    to the workspace makes gzip start over): those are hashed again and must hash as they did
    the first time, else the hash is unknown (the file changed under the check: not remembered)."""

    def __init__(self, fh: IO[bytes]) -> None:
        self._fh, self._sha = fh, hashlib.sha256()
        self._pos = self._hashed = fh.tell()
        self._broken = self._pos != 0
        # a read again from the start: its hash, how far it is, and the first read's hash up to there
        self._again: tuple[Any, int, Any] | None = None

    def read(self, size: int = -1) -> bytes:
        start = self._pos
        data = self._fh.read(size)
        self._pos += len(data)
        if not self._broken:
            self._take(start, data)
        return data

    def _take(self, start: int, data: bytes) -> None:
        if start < self._hashed and start == 0:  # from the start again: the first read's hash so far, to match
            self._again = (hashlib.sha256(), 0, self._sha.copy())
        if self._again is not None:
            again, pos, first = self._again
            if start != pos:
                self._broken = True
                return
            head = data[:self._hashed - pos]
            again.update(head)
            self._again = (again, pos + len(head), first)
            data = data[len(head):]
            start += len(head)
            if pos + len(head) == self._hashed:
                self._settle()
        if not data or self._broken:
            return
        if start != self._hashed or self._again is not None:
            self._broken = True  # (gzip never skips ahead)
            return
        self._sha.update(data)
        self._hashed += len(data)

    def _settle(self) -> None:
        assert self._again is not None
        again, _, first = self._again
        self._again = None
        if again.digest() != first.digest():
            self._broken = True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._pos = self._fh.seek(offset, whence)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def fileno(self) -> int:
        return self._fh.fileno()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fh, name)

    def digest(self) -> str | None:
        """The file's SHA-256 (the bytes checked, then the rest as it is now), or None (see above)."""
        if self._again is not None and not self._broken:  # read again part way: the rest of that, as it is now
            again, pos, first = self._again
            while pos < self._hashed and (chunk := os.pread(self.fileno(), min(1 << 20, self._hashed - pos), pos)):
                again.update(chunk)
                pos += len(chunk)
            self._settle()
        if self._broken:
            return None
        while chunk := os.pread(self.fileno(), 1 << 20, self._hashed):
            self._sha.update(chunk)
            self._hashed += len(chunk)
        return self._sha.hexdigest()
