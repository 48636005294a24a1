"""Cancellation-safe asyncio helpers: run coroutines together, finish cleanup despite a cancel,
and threads that a cancel stops or undoes before it goes on (a thread itself can't be stopped)."""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def _gather_cancelling(coros: list[Any], on_cancel: Callable[[], object] | None = None) -> None:
    """Run coroutines together; if we are cancelled, cancel them all and wait for their cleanup,
    then call ``on_cancel`` (a task cancelled before its first step never ran its own handler)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    except BaseException as exc:
        for t in tasks:
            t.cancel()
        await _to_the_end(asyncio.gather(*tasks, return_exceptions=True))
        if on_cancel is not None and isinstance(exc, asyncio.CancelledError):
            on_cancel()
        raise


async def _to_the_end(aw: Awaitable[T]) -> T:
    """Await ``aw`` to completion even if we are cancelled meanwhile, then re-raise the cancel.

    For cleanup (deleting machines): a bare ``await asyncio.shield(...)`` gives up at a
    second cancel (gather() cancels its children, and so do we), leaving the shielded
    task unreferenced; the loop may then drop it half done and leak the machine.
    """
    task = asyncio.ensure_future(aw)
    cancelled = False
    while True:
        try:
            out = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():  # the cleanup itself was cancelled (not just us)
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return out


async def _made_in_thread(make: Callable[[], T], undo: Callable[[T], object]) -> T:
    """``make()`` on a thread. Cancelled meanwhile: what it makes is undone (``undo``, on a
    thread too) once it ends, before the cancel goes on: left to a later callback, it
    outlived the Ctrl-C, and a kernel that exited first never undid it."""
    work = asyncio.ensure_future(asyncio.to_thread(make))

    async def undone() -> None:
        try:
            made = await work
        except Exception:  # it made nothing
            return
        await asyncio.to_thread(undo, made)

    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        try:
            await _to_the_end(undone())
        except Exception:  # an undo that failed must not replace the cancel
            pass
        raise


async def _stoppable_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, stop=Event, **kwargs)`` on a thread. Cancelled meanwhile: ``stop`` is set and
    the thread waited for (``fn`` stops at its next check, its own cleanup done) before the cancel
    goes on, so the caller's cleanup never races it."""
    stop = threading.Event()
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args, stop=stop, **kwargs))
    try:
        return await asyncio.shield(work)
    finally:
        if not work.done():
            stop.set()
            await _to_the_end(asyncio.wait({work}))
        if not work.cancelled():
            work.exception()  # read: a stopped work's own error is not news (nor a traceback on the screen)


async def _stop_with_grace(interrupt: Callable[[], Awaitable[object]], task: asyncio.Future[Any],
                           grace: float) -> bool:
    """Stop ``task`` (a machine's cell or request): ``interrupt()`` the machine (its own failure
    ignored, within ``grace``), wait ``grace`` for ``task`` to end, then cancel it. True when it
    ended in time; its own end (an interrupted request's error) is not news, never raised."""
    if not task.done():
        try:
            await asyncio.wait_for(interrupt(), grace)
        except Exception:  # a machine that can't be told still gets its grace period
            pass
        await asyncio.wait({task}, timeout=grace)
    stopped = task.done()
    if not stopped:
        task.cancel()
    try:
        await task
    except BaseException:
        pass
    return stopped


class Waves:
    """An admission of waiting tasks in waves: at most ``cap`` inside at once, and once full,
    none let in until ``wave`` places are free again; then all that fit go in together.

    For episodes from a zygote: tasks let in together ask for their branches in the same loop
    turn, so the zygote forks them in one request (leaf branches, made together), where a
    plain semaphore lets one in per episode that ends, and each is forked alone."""

    def __init__(self, cap: int, wave: int) -> None:
        self.cap = max(1, cap)
        self.wave = max(1, min(wave, self.cap))
        self._inside = 0
        self._open = True
        self._queue: collections.deque[asyncio.Future[None]] = collections.deque()

    async def __aenter__(self) -> None:
        if self._open and not self._queue and self._inside < self.cap:
            self._take()
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # let in and cancelled at once: its place goes back
                self._leave()
            elif fut in self._queue:
                self._queue.remove(fut)
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._leave()

    def _take(self) -> None:
        self._inside += 1
        if self._inside >= self.cap:
            self._open = False

    def _leave(self) -> None:
        self._inside -= 1
        if self._inside <= self.cap - self.wave:
            self._open = True
        while self._open and self._queue and self._inside < self.cap:
            fut = self._queue.popleft()
            if not fut.done():
                fut.set_result(None)
                self._take()
