"""Writing checkpoint files: a machine's saved files packed into one (its workspace archive
streamed out of the machine as it is written), and a checked file streamed into a new
machine's folder or written again as one self-contained file.

Reading and checking them is ``archive.py``'s; what is written here passes through its
checks (``check_members``, the checkpoint limit) on the way.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import select
import shutil
import stat
import tarfile
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, cast

from .archive import (
    FILES,
    OPEN_DIR,
    RECORD,
    TEST_WEAKEN,
    UnsafeCheckpoint,
    _within_limit,
    check_members,
    open_file,
    open_tar,
    parse_record,
    plain_tar,
)
from .limits import LIMITS, human

# gzip level of what is written here: on a 203 MB workspace (numpy arrays and 16 MB of text),
# level 1 took 2.3 s for 100.3 MB, level 6 3.6 s for 98.6 MB, level 9 (tarfile's default) 4.8 s
# for 98.5 MB; its text alone: 32% / 27% / 27% of its size. Any level reads back the same.
LEVEL = 1


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


def open_pipes(run_dir: int, stage: str,
               as_owner: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext) -> dict[str, int]:
    """Make the new folder ``stage`` in the folder descriptor ``run_dir`` (the backend found it
    without following the machine's links) with a fifo for each of the checkpoint's two files
    (:data:`FILES`) in it, where the machine's save writes them for :func:`receive`; their read
    ends (non-blocking), opened now, before the machine is asked to save: what the machine puts
    at those names later is never opened. ``as_owner``: the file access identity they are made
    with. The caller closes what this returns."""
    pipes: dict[str, int] = {}
    try:
        with as_owner():
            os.mkdir(stage, 0o700, dir_fd=run_dir)
            with _dirfd(stage, parent=run_dir) as folder:
                for name in FILES:
                    os.mkfifo(name, 0o600, dir_fd=folder)
                    pipes[name] = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
                    if not stat.S_ISFIFO(os.fstat(pipes[name]).st_mode):  # swapped between the two calls
                        raise UnsafeCheckpoint(f"the machine changed its save's stage ({stage}) as it was made")
    except BaseException:
        for fd in pipes.values():
            os.close(fd)
        raise
    return pipes


# What each of a save's files is called in its refusals: what it sends; what it never wrote.
_SENT = {"namespace.pkl": "variables", "workspace.tar": "a workspace"}
_NONE = {"namespace.pkl": "pickled variables", "workspace.tar": "workspace archive"}


def receive(pipes: dict[str, int], where: str, *, scratch: str | os.PathLike[str], saved: threading.Event,
            stop: threading.Event | None = None) -> dict[str, tuple[IO[bytes], int]]:
    """The files machine ``where`` writes into the fifos whose read ends are ``pipes`` (name: fd,
    non-blocking; the caller closes them once this returned), as they come: each into a new
    unnamed file in ``scratch`` (the checkpoint's folder, never the host's /tmp), together
    counted against the checkpoint limit and stopped there. Streamed, neither its pickled
    variables nor its workspace archive is ever a second copy in the machine's own memory (a
    sandbox keeps its files in memory, and its cgroup counts them: the copy made a full
    workspace's save kill its machine). Returns name: (the file, at its start; its size).

    Each one's end is the machine closing its end of its fifo. ``saved``: its save request
    ended, so they came already (their ends closed: a fifo says hang-up at once) or never will
    (a machine that never opened one, or holds it open). After a failure, closing ``pipes``
    makes a writer's next write fail (EPIPE): an honest machine ends its save there."""
    what = f"the checkpoint machine {where} saved"
    got: dict[str, tuple[IO[bytes], int]] = {name: (tempfile.TemporaryFile(dir=scratch), 0) for name in pipes}
    counted = "size" not in TEST_WEAKEN
    try:
        poll = select.poll()
        open_ = {}
        for name, fd in pipes.items():  # hang-up is reported too: only once a writer came and went
            poll.register(fd, select.POLLIN)
            open_[fd] = name
        while open_:
            if stop is not None and stop.is_set():
                raise PackStopped("the save was stopped")
            late = saved.is_set()  # looked at before the poll: a closed end is seen by then
            events = poll.poll(0 if late else 100)
            if not events:
                if late:
                    missing = " or ".join(_NONE[n] for n in open_.values())
                    raise UnsafeCheckpoint(f"{what} has no {missing} (the machine never wrote it, or kept its end open)")
                continue
            for fd, _ in events:
                name = open_[fd]
                try:
                    block = os.read(fd, 1 << 20)
                except BlockingIOError:  # a writer came back meanwhile
                    continue
                if not block:  # every writer closed its end: all of it came
                    poll.unregister(fd)
                    del open_[fd]
                    continue
                fh, size = got[name]
                got[name] = fh, size + len(block)
                if sum(n for _, n in got.values()) > LIMITS.checkpoint and counted:  # (a few bytes of the other: unsaid)
                    sent = " and ".join(_SENT[n] for n, (_, k) in got.items() if k >= 1 << 20 or n == name)
                    raise UnsafeCheckpoint(f"{what} sends {sent} of more than the checkpoint limit of "
                                           f"{human(LIMITS.checkpoint)} (stopped there): keep less in the machine, or "
                                           "raise it with `%smol config checkpoint-limit 4G`")
                fh.write(block)
    except BaseException:
        for fh, _ in got.values():
            fh.close()
        raise
    for fh, _ in got.values():
        fh.seek(0)
    return got


def pack(out: int, where: str, parts: dict[str, tuple[IO[bytes], int]], *, stop: threading.Event | None = None) -> None:
    """Write checkpoint file descriptor ``out`` from what machine ``where`` saved: its two files
    as :func:`receive` took them (host files the machine can't change; name: (file, size)).

    The two together at most the checkpoint limit; the workspace's members are checked first.
    Written through ``out``, not a path: a save stopped meanwhile removes its part file, and a
    name opened after that would make it again. ``stop`` set (the save was stopped):
    :class:`PackStopped` at the next MB."""
    what = f"the checkpoint machine {where} saved"
    _within_limit({name: size for name, (_, size) in parts.items()}, what)
    ws = parts["workspace.tar"][0]
    ws.seek(0)
    plain_tar(ws.read(16), f"the checkpoint machine {where} saved")
    ws.seek(0)
    try:
        with open_tar(fileobj=ws, mode="r:") as inner:
            check_members(inner, f"machine {where}'s workspace")
    except tarfile.TarError as exc:
        raise UnsafeCheckpoint(f"{what} has a broken workspace archive ({exc})") from None
    with os.fdopen(os.dup(out), "wb") as sink, tarfile.open(fileobj=sink, mode="w:gz", compresslevel=LEVEL) as tar:
        for name in FILES:
            src, size = parts[name]
            src.seek(0)
            info = tarfile.TarInfo(name)
            info.size = size
            tar.addfile(info, cast(IO[bytes], _Stoppable(src, stop)))


class PackStopped(Exception):
    """A checkpoint's packing was stopped (its save was)."""


class _Stoppable:
    """A file read in blocks that raises :class:`PackStopped` once ``stop`` is set."""

    def __init__(self, f: IO[bytes], stop: threading.Event | None) -> None:
        self._f, self._stop = f, stop

    def read(self, n: int = -1) -> bytes:
        if self._stop is not None and self._stop.is_set():
            raise PackStopped("the save was stopped")
        return self._f.read(n)




class _Budget:
    """Bytes a restore may still write: the checkpoint limit, counted as they stream."""

    def __init__(self, what: str) -> None:
        self.left = LIMITS.checkpoint
        self.what = what

    def copy(self, src: IO[bytes], dst: IO[bytes], size: int) -> None:
        left, counted = size, "stream" not in TEST_WEAKEN
        while left:
            block = src.read(min(left, 1 << 20, self.left + 1 if counted else left))
            if not block:
                raise UnsafeCheckpoint(f"{self.what} changed while it was being read")
            if len(block) > self.left and counted:
                raise UnsafeCheckpoint(f"{self.what} unpacks to more than the checkpoint limit of "
                                       f"{human(LIMITS.checkpoint)}: stopped there; raise it with "
                                       "`%smol config checkpoint-limit 4G` if you trust it")
            dst.write(block)
            self.left -= len(block)
            left -= len(block)


def _members(tar: tarfile.TarFile) -> Iterator[tuple[tarfile.TarInfo, IO[bytes]]]:
    """The checkpoint's two files in archive order, one pass (the record, first, is skipped)."""
    while True:
        m = tar.next()
        if m is None:
            return
        if m.name in FILES and m.isfile():
            src = tar.extractfile(m)
            assert src is not None
            yield m, src


def hand_over(path: str, run_dir: int, stage: str,
              as_owner: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext) -> tuple[int, int]:
    """Stream a checked checkpoint's workspace archive into the new folder ``stage`` of the folder
    descriptor ``run_dir`` (the backend found it without following the machine's links), and
    make a fifo there for its namespace, which :func:`send` writes as the machine's load reads
    it (a file of it too was a second copy of the variables in a sandbox's memory). Returns
    (the fifo's end, opened read-write so that writes wait for no reader; non-blocking: the
    caller closes it), the bytes of the checkpoint limit left for the namespace).

    Nothing is unpacked anywhere else (never the host's /tmp): the bytes go from the
    checkpoint straight into the machine's own folder, counted against the checkpoint limit
    as they are decompressed. The folder is made here (never an existing path) and its files
    are created with ``O_EXCL | O_NOFOLLOW``, so nothing the machine placed there is written
    through. ``as_owner``: the file access identity the folder and files are made with (the
    checkpoint itself is opened before, as the caller).
    """
    budget = _Budget(f"checkpoint {Path(path).name}")
    with open_tar(path, what=budget.what) as tar, as_owner():
        os.mkdir(stage, 0o700, dir_fd=run_dir)
        with _dirfd(stage, parent=run_dir) as folder:
            os.mkfifo("namespace.pkl", 0o600, dir_fd=folder)
            pipe = os.open("namespace.pkl", os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
            try:
                for m, src in _members(tar):
                    if m.name == "workspace.tar":
                        fd = os.open(m.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                     dir_fd=folder)
                        with os.fdopen(fd, "wb") as dst:
                            budget.copy(src, dst, m.size)
            except BaseException:
                os.close(pipe)
                raise
    return pipe, budget.left


def send(path: str, pipe: int, left: int, *, loaded: threading.Event, stop: threading.Event | None = None) -> None:
    """Write checked checkpoint ``path``'s namespace into the fifo :func:`hand_over` made (``pipe``,
    its end), as the machine's load reads it, counted against ``left`` bytes. Ends once all of
    it is written, or once ``loaded`` is set (the load ended) and the fifo has no room: a
    machine that reads no more gets no more. ``stop`` set: :class:`PackStopped`."""
    budget = _Budget(f"checkpoint {Path(path).name}")
    budget.left = left
    with open_tar(path, what=budget.what) as tar:
        for m, src in _members(tar):
            if m.name == "namespace.pkl":
                with contextlib.suppress(_Unread):
                    budget.copy(src, cast(IO[bytes], _Fifo(pipe, loaded, stop)), m.size)
                return


class _Unread(Exception):
    """The machine's load ended with bytes of its namespace unread."""


class _Fifo:
    """The write end of a fifo, non-blocking: each write waits for room, as :func:`send` says."""

    def __init__(self, fd: int, loaded: threading.Event, stop: threading.Event | None) -> None:
        self.fd, self.loaded, self.stop = fd, loaded, stop
        self.poll = select.poll()
        self.poll.register(fd, select.POLLOUT)

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            if self.stop is not None and self.stop.is_set():
                raise PackStopped("the restore was stopped")
            late = self.loaded.is_set()  # looked at before the poll, as receive's
            if not self.poll.poll(0 if late else 100):
                if late:
                    raise _Unread
                continue
            try:
                view = view[os.write(self.fd, view):]
            except BlockingIOError:
                continue
        return len(data)


def write_portable(path: str, out: int, record: dict[str, Any], label: str) -> None:
    """Write the checked checkpoint at ``path`` (``label`` in messages) to descriptor ``out`` as one
    self-contained file: its record first, then its two files (streamed, counted against the
    checkpoint limit)."""
    blob = json.dumps(record, sort_keys=True).encode()
    parse_record(blob, f"checkpoint {label}")  # what we write must pass our own reading
    with open_tar(path, what=f"checkpoint {label}") as src:
        first = src.next()
    if first is None or first.name != RECORD:  # a save of this folder: its bytes after a record of their own
        _record_then(path, out, record, blob)
        return
    budget = _Budget(f"checkpoint {label}")
    with open_tar(path, what=f"checkpoint {label}") as src, os.fdopen(os.dup(out), "wb") as raw, \
            tarfile.open(fileobj=raw, mode="w:gz", compresslevel=LEVEL) as tar:
        info = tarfile.TarInfo(RECORD)
        info.size, info.mtime = len(blob), int(record.get("created") or 0)
        tar.addfile(info, io.BytesIO(blob))
        for m, fh in _members(src):
            info = tarfile.TarInfo(m.name)
            info.size, info.mtime = m.size, m.mtime
            tar.addfile(info, _Counted(fh, budget, m.size))


def _record_then(path: str, out: int, record: dict[str, Any], blob: bytes) -> None:
    """The record, as a gzip member of its own holding its tar entry (no end marker), then the
    checked file at ``path`` byte for byte, its compressed data not decompressed and compressed
    again: gzip reads members one after another as one stream, so the two are one archive, the
    record first (as every reader looks for it), then the file's two members and its end. Its
    restore checks all of it again, as any file's."""
    info = tarfile.TarInfo(RECORD)
    info.size, info.mtime = len(blob), int(record.get("created") or 0)
    entry = info.tobuf() + blob + b"\0" * (-len(blob) % tarfile.BLOCKSIZE)
    with os.fdopen(os.dup(out), "wb") as raw, os.fdopen(open_file(path), "rb") as src:
        raw.write(gzip.compress(entry, LEVEL, mtime=info.mtime))
        shutil.copyfileobj(src, raw, 1 << 20)


class _Counted(io.RawIOBase):
    """A member's bytes, read through a budget (tarfile.addfile reads exactly its size)."""

    def __init__(self, src: IO[bytes], budget: _Budget, size: int) -> None:
        self.buf = io.BytesIO()
        self.src, self.budget, self.left = src, budget, size

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        self.buf.seek(0)
        self.buf.truncate()
        self.budget.copy(self.src, self.buf, n)
        self.left -= n
        return self.buf.getvalue()
