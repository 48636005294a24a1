"""A machine's host process, started off the event loop's thread.

Starting a process from the kernel (a big one: its heap, its threads) is a fork and exec plus
subprocess's own set-up. On the loop thread, N machines booting at once (``%%smol episodes``)
queue behind each other there, and so does every cell's output meanwhile. Here it runs in one
of a few spawner threads of our own; its end is awaited through a pidfd (no thread per child,
no polling). They are never a pool's workers that come and go: a parent-death signal
(bwrap's ``--die-with-parent``, the process keeper's) fires when the *thread* that started
the process ends, so these live as long as the kernel, as the loop thread does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import queue
import subprocess
import threading
from collections.abc import Callable
from typing import Any

SPAWNERS = 4  # threads that start processes (boots at once beyond this queue here, not on the loop)
_jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
_spawners: list[threading.Thread] = []
_lock = threading.Lock()


def _serve() -> None:
    while True:
        _jobs.get()()


def _forget_spawners() -> None:  # a forked child has none of its parent's threads
    global _jobs, _lock
    _spawners.clear()
    _jobs, _lock = queue.SimpleQueue(), threading.Lock()


os.register_at_fork(after_in_child=_forget_spawners)


def _popen(argv: list[str], options: dict[str, Any]) -> concurrent.futures.Future[subprocess.Popen[bytes]]:
    done: concurrent.futures.Future[subprocess.Popen[bytes]] = concurrent.futures.Future()

    def job() -> None:
        if done.set_running_or_notify_cancel():
            try:
                done.set_result(subprocess.Popen(argv, **options))
            except BaseException as exc:
                done.set_exception(exc)

    with _lock:
        if len(_spawners) < SPAWNERS:
            t = threading.Thread(target=_serve, name=f"smolbench-spawner-{len(_spawners)}", daemon=True)
            t.start()
            _spawners.append(t)
    _jobs.put(job)
    return done


class Spawned:
    """What the backends use of a started process: ``pid``, ``returncode`` and ``await wait()``."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.pid = popen.pid

    @property
    def returncode(self) -> int | None:
        """Its exit status once it ended (reaped then), else None."""
        return self._popen.poll()

    def send_signal(self, sig: int) -> None:
        """Signal it, unless it ended and was reaped (its pid may be another's by now)."""
        self._popen.send_signal(sig)

    def kill(self) -> None:
        self._popen.kill()

    async def wait(self) -> int:
        """Until it ended; its exit status."""
        if self._popen.poll() is not None:
            return self._popen.wait()
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # no pidfd here (before Linux 5.3), or reaped meanwhile
            while self._popen.poll() is None:
                await asyncio.sleep(0.01)
            return self._popen.wait()
        ended: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not ended.done():
                ended.set_result(None)

        loop.add_reader(fd, readable)
        try:
            if self._popen.poll() is None:
                await ended
        finally:
            loop.remove_reader(fd)
            os.close(fd)
        return self._popen.wait()


async def spawn(argv: list[str], **options: Any) -> Spawned:
    """``subprocess.Popen(argv, **options)`` in a worker thread. If the caller is cancelled
    meanwhile, the process still starts: it is returned in the ``Started`` raised, to be killed."""
    made = asyncio.wrap_future(_popen(argv, options))
    try:
        return Spawned(await asyncio.shield(made))
    except asyncio.CancelledError:
        while not made.done():  # a second cancel too: the process still starts, and must be killed
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({made})
        with contextlib.suppress(Exception):
            raise Started(Spawned(made.result())) from None
        raise


class Started(asyncio.CancelledError):
    """A cancellation that came while the process started: ``proc`` is it (kill it)."""

    def __init__(self, proc: Spawned) -> None:
        super().__init__()
        self.proc = proc
