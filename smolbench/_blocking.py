"""Blocking on smolbench's own loop (a Session method) and awaiting it from the caller's (its a-twin)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from . import _lifetime, _loop
from ._lifetime import wait_out_sigterm
from .errors import SmolbenchError
from .result import ForkResult

T = TypeVar("T")


def _block(coro: Coroutine[Any, Any, T], result: ForkResult | None = None, *, stoppable: bool = True,
           waiting: Callable[[], None] | None = None) -> T:
    """Run ``coro`` on smolbench's loop and wait. Ctrl-C (or an exception in this thread)
    cancels it and waits for its cleanup (deleting machines) before it goes on; one that is not
    ``stoppable`` (a down) is let finish instead, through more Ctrl-Cs, before it goes on. ``waiting``:
    called on this thread every 0.2 s meanwhile (the magics show the notices it queued)."""
    if _on_our_loop():
        coro.close()
        raise SmolbenchError("a blocking Session method was called on smolbench's own loop: await its a-twin (e.g. arun)")
    try:
        wait_out_sigterm()
        job = _loop.Job(coro, stoppable=stoppable)
    except BaseException:  # a Ctrl-C before it was handed over: it never runs, and is closed as such
        coro.close()
        raise
    if result is not None:
        result._attach(job.future, job.cancel)
    try:
        job.start()
        while not job.wait_finished(0.2):
            if waiting is not None:
                waiting()
        wait_out_sigterm()
    except BaseException:
        if stoppable:
            job.stop(120)
        else:  # a down: a Ctrl-C (or another) doesn't cut the deletion short; it is raised after it
            job.finish(120)
        raise
    return _result(job, result)


async def _bridge(coro: Coroutine[Any, Any, T], result: ForkResult | None = None, *, stoppable: bool = True) -> T:
    """Await ``coro`` from the caller's loop while it runs on smolbench's (never a nested
    loop); a cancel of the caller's task cancels it and waits for its cleanup (one that is not
    ``stoppable``, a down, it lets finish)."""
    if _on_our_loop():
        return await coro
    try:
        while _lifetime.stopping():
            await asyncio.sleep(0.05)
    except BaseException:  # cancelled before it was handed over: it never runs
        coro.close()
        raise
    job = _loop.Job(coro, stoppable=stoppable).start()
    if result is not None:
        result._attach(job.future, job.cancel)
    done = asyncio.wrap_future(job.future)
    try:
        await asyncio.wait({done})  # its end, whatever it is (a cancel of ours raises here)
        while _lifetime.stopping():  # a SIGTERM stopped it: its handler ends the program once the machines are gone
            await asyncio.sleep(0.05)
    except asyncio.CancelledError:
        if not job.done():
            if stoppable:  # a down is never cut short: it finishes, then the cancel goes on
                job.cancel()
            while not job.done():
                with contextlib.suppress(BaseException):
                    await asyncio.shield(done)
        raise
    return _result(job, result)


def _result(job: _loop.Job, result: ForkResult | None = None) -> Any:
    """``job``'s result, its error said in the Session's words."""
    if job.stopped and job.future.cancelled():
        raise SmolbenchError("stopped by SIGTERM: this program's machines were deleted")
    if job.future.cancelled():  # from another thread: the session's down(), or the fork's own handle
        what = f"this {result.kind}" if result is not None else "this call"
        how = ("its handle's cancel()" if result is not None and result.cancelled_by_handle
               else "the session going down (down() from elsewhere)")
        ended = f": {result.summary(reasons=False)}" if result is not None else ""
        raise SmolbenchError(f"{what} was stopped by {how} before it ended; its machines were deleted{ended}")
    try:
        return job.result()
    except SmolbenchError as exc:
        exc.in_session_words()
        raise


def _on_our_loop() -> bool:
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        return False
    return running is _loop.get_loop()
