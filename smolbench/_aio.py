"""Cancellation-safe asyncio helpers: run coroutines together, finish cleanup despite a cancel."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


async def _gather_cancelling(coros: list[Any]) -> None:
    """Run coroutines together; if we are cancelled, cancel them all and wait for their cleanup."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await _to_the_end(asyncio.gather(*tasks, return_exceptions=True))
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
