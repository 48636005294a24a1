"""Our own asyncio loop in a daemon thread (no nest-asyncio, never the kernel's loop).

Magics run on the kernel's main thread and block on coroutines submitted here
with ``run_coroutine_threadsafe(...).result()``. Machines are spawned from this
thread, which lives as long as the kernel, so a sandbox's --die-with-parent
ties it to the kernel process itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future, InvalidStateError
from typing import Any, TypeVar, cast

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_jobs: set[Job] = set()  # running Jobs: what a SIGTERM stops before it deletes the machines
CLEANUP_WAIT = 60.0  # seconds a stopped ``run`` waits for its coroutine's cleanup (deleting what it made)


def get_loop() -> asyncio.AbstractEventLoop:
    """The process-wide smolbench loop, started on first use."""
    global _loop
    loop = _loop
    if loop is not None and not loop.is_closed():  # no lock once it runs: a signal handler may call this
        return loop
    with _lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            threading.Thread(target=run, name="smolbench-loop", daemon=True).start()
            ready.wait()
            _loop = loop
        return _loop


def submit(coro: Coroutine[Any, Any, T]) -> Future[T]:
    """Schedule ``coro`` on the smolbench loop; returns a concurrent Future."""
    return asyncio.run_coroutine_threadsafe(coro, get_loop())


def run(coro: Coroutine[Any, Any, T], timeout: float | None = None, *, stoppable: bool = True) -> T:
    """Run ``coro`` on the smolbench loop and block until it finishes. A Ctrl-C (or the
    timeout) here stops it there and waits for its cleanup before it reaches the caller:
    left running, a checkpoint save went on beside the next cell, and a make_vec went on
    making machines beside the close that followed. ``stoppable=False`` (a down): a SIGTERM
    meanwhile lets it finish (:func:`cancel_all`)."""
    job = Job(coro, stoppable=stoppable)
    try:
        return cast(T, job.start().result(timeout))
    except BaseException:
        job.stop(CLEANUP_WAIT)
        raise


class Job:
    """A coroutine running on the smolbench loop that the main thread can cancel and await.

    Unlike a bare ``run_coroutine_threadsafe`` future, ``cancel()`` followed by
    ``wait_finished()`` waits for the coroutine's own cleanup (deleting
    machines, writing the ledger) to complete. Made first and started inside the caller's
    ``try`` (``job = Job(coro)``, then ``job.start()``): a Ctrl-C that lands while it starts
    is the caller's to handle too (:meth:`stop` finds whether it reached the loop), where
    before it could land between the submit and the ``try``, and the work ran on unattended.
    """

    def __init__(self, coro: Coroutine[Any, Any, Any], *, stoppable: bool = True) -> None:
        self.stoppable = stoppable  # False: cancel_all waits for it but lets it finish (a down)
        self.stopped = False  # cancel_all cancelled it
        self.future: Future[Any] = Future()  # its outcome (settled before done()); cancel() stops it
        self._coro: Coroutine[Any, Any, Any] | None = coro
        self._finished = threading.Event()
        self._task: asyncio.Task[Any] | None = None
        self._task_set = threading.Event()
        self._started = False
        self._lock = threading.Lock()  # whether it begins on the loop or is dropped: decided once, under it
        self._begun = self._dropped = False

    def start(self) -> Job:
        """Submit it to the smolbench loop."""
        assert not self._started and self._coro is not None, "a Job starts once"
        self._started = True
        _jobs.add(self)
        get_loop().call_soon_threadsafe(self._begin, self._coro)
        self._coro = None  # (kept until now: a Ctrl-C before the line above leaves it for reached() to close)
        return self

    def _begin(self, coro: Coroutine[Any, Any, Any]) -> None:
        with self._lock:
            if self._begun:  # submitted again by finish() (a Ctrl-C inside start): it runs once
                return
            if self._dropped:  # stopped before it got here: it never runs
                coro.close()
                return
            self._begun = True
        asyncio.get_running_loop().create_task(self._run(coro))

    async def _run(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._task = asyncio.current_task()
        self._task_set.set()  # here, not where the task is made: a cancel before its first step would skip the cleanup
        try:
            value = await coro
        except asyncio.CancelledError:
            self._end(None, cancelled=True)
        except BaseException as exc:  # the caller's to see (its result), never the loop's
            self._end(exc)
        else:
            self._end(None, value)

    def _end(self, error: BaseException | None, value: Any = None, cancelled: bool = False) -> None:
        _jobs.discard(self)  # first: who wakes on the future finds it no longer running
        if not self.future.done():  # (cancelled from outside: the way to stop it is cancel())
            with contextlib.suppress(InvalidStateError):
                if cancelled:
                    self.future.cancel()
                elif error is not None:
                    self.future.set_exception(error)
                else:
                    self.future.set_result(value)
        self._finished.set()  # last: who waited for the cleanup finds the outcome settled

    def done(self) -> bool:
        """True once the coroutine finished (including its cleanup)."""
        return self._finished.is_set()

    def reached(self) -> bool:
        """Whether the coroutine got to the loop; False: it never will (a Ctrl-C inside
        :meth:`start`, or before it), and it counts as done. Decided under the lock its start
        on the loop takes: no guess from how long the loop took to get there."""
        if not self._task_set.is_set():
            with self._lock:
                if not self._begun:
                    self._dropped = True
            if self._dropped:
                if self._coro is not None:  # never submitted
                    self._coro.close()
                    self._coro = None
                self._end(None, cancelled=True)
                return False
            self._task_set.wait(CLEANUP_WAIT)  # begun: its task's first step is queued on the loop
        return True

    def cancel(self) -> None:
        """Ask the coroutine to stop (it gets CancelledError on the loop; not begun yet: it never runs)."""
        if self.reached() and self._task is not None:
            get_loop().call_soon_threadsafe(self._task.cancel)

    def stop(self, wait: float) -> None:
        """Cancel it, wherever it got to, and wait (up to ``wait`` s) for its cleanup."""
        if self.done() or not self.reached():
            return
        self.cancel()
        self.wait_finished(wait)

    def finish(self, wait: float) -> None:
        """Let it run to its end (a down's deletions: never cut short), waiting up to ``wait``
        s through any Ctrl-C meanwhile; one that landed inside :meth:`start`, before the work
        was submitted, submits it now. Past ``wait`` it goes on alone."""
        deadline = time.monotonic() + wait
        while True:
            try:
                coro = self._coro
                if coro is not None:  # never submitted
                    self._started = True
                    _jobs.add(self)
                    get_loop().call_soon_threadsafe(self._begin, coro)
                    self._coro = None
                left = deadline - time.monotonic()
                if self.done() or left <= 0 or self.wait_finished(min(0.2, left)):
                    return
            except KeyboardInterrupt:
                continue

    def wait_finished(self, timeout: float | None = None) -> bool:
        """Block until the coroutine's cleanup finished; False on timeout."""
        return self._finished.wait(timeout)

    def result(self, timeout: float | None = None) -> Any:
        """The coroutine's result (re-raises its exception)."""
        return self.future.result(timeout)


def running() -> bool:
    """True while any Job runs (lock-free: a signal handler asks)."""
    return bool(_jobs)


def cancel_all(timeout: float) -> None:
    """Cancel every running stoppable Job and wait (up to ``timeout`` in all) for all of them to end."""
    jobs = list(_jobs)
    for job in jobs:
        if job.stoppable:
            job.stopped = True
            job.cancel()
    deadline = time.monotonic() + timeout
    for job in jobs:
        job.wait_finished(max(0.0, deadline - time.monotonic()))
