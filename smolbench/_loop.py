"""Our own asyncio loop in a daemon thread (no nest-asyncio, never the kernel's loop).

Magics run on the kernel's main thread and block on coroutines submitted here
with ``run_coroutine_threadsafe(...).result()``. Machines are spawned from this
thread, which lives as long as the kernel, so a sandbox's --die-with-parent
ties it to the kernel process itself.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def get_loop() -> asyncio.AbstractEventLoop:
    """The process-wide smolbench loop, started on first use."""
    global _loop
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


def run(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on the smolbench loop and block until it finishes."""
    return submit(coro).result(timeout)


def in_loop_thread() -> bool:
    """True when called from the smolbench loop's own thread."""
    return _loop is not None and threading.current_thread().name == "smolbench-loop"
