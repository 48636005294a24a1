"""smolbench's own loop: a call that waits on it and is stopped stops the work there too.

The magics' checkpoint save and restore, the CLI's checks and a gym env's own session wait
with ``_loop.run``. A Ctrl-C there used to reach the caller while the work went on on the
loop: a save went on beside the next cell, a restore made its machine after the error.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time

import pytest

from smolbench import _loop


def _work(started: threading.Event, cleaned: threading.Event, cleanup_s: float = 0.3) -> object:
    async def work() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        finally:  # a cleanup that takes a while, as deleting a machine does
            await asyncio.sleep(cleanup_s)
            cleaned.set()

    return work()


def _waits_in_run(thread: int) -> bool:
    """True once ``thread`` waits in run() for its Job's result."""
    frame = sys._current_frames().get(thread)
    while frame is not None:
        if frame.f_code is _loop.Job.result.__code__:
            return True
        frame = frame.f_back
    return False


def test_a_ctrl_c_while_run_waits_stops_the_work_and_waits_for_its_cleanup() -> None:
    started, cleaned = threading.Event(), threading.Event()
    main = threading.main_thread().ident
    assert main is not None and threading.get_ident() == main

    def ctrl_c() -> None:
        started.wait(10)
        # once the caller waits in run() (not still in Job(): its coroutine starts first)
        deadline = time.monotonic() + 30
        while not _waits_in_run(main) and time.monotonic() < deadline:
            time.sleep(0.01)
        signal.pthread_kill(main, signal.SIGINT)

    t = threading.Thread(target=ctrl_c)
    t.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            _loop.run(_work(started, cleaned))  # type: ignore[arg-type]
    finally:
        t.join()
    assert cleaned.is_set(), "the Ctrl-C reached the caller while the work still ran on smolbench's loop"
    assert not _loop.running()


def test_a_run_that_times_out_stops_the_work_and_waits_for_its_cleanup() -> None:
    started, cleaned = threading.Event(), threading.Event()
    with pytest.raises(TimeoutError):
        _loop.run(_work(started, cleaned), timeout=0.5)  # type: ignore[arg-type]
    assert started.is_set() and cleaned.is_set()
    assert not _loop.running()


def test_run_returns_the_result_and_raises_the_error() -> None:
    async def ok() -> int:
        await asyncio.sleep(0)
        return 7

    async def bad() -> None:
        raise ValueError("no")

    assert _loop.run(ok()) == 7
    with pytest.raises(ValueError, match="no"):
        _loop.run(bad())
    assert not _loop.running()


def test_a_sigterm_s_stop_lets_a_run_marked_unstoppable_finish() -> None:
    """A SIGTERM stops running calls (``cancel_all``) before it deletes the machines; a down (a gym
    env's own session's) is left to finish, as Session.down is."""
    import concurrent.futures

    started = threading.Event()

    async def down() -> str:
        started.set()
        await asyncio.sleep(0.3)
        return "done"

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        result = pool.submit(_loop.run, down(), stoppable=False)
        assert started.wait(10)
        _loop.cancel_all(10)
        assert result.result(10) == "done"
    assert not _loop.running()


class _CtrlCAsItStarts:
    """smolbench's loop, whose next ``call_soon_threadsafe`` (a Job's start) meets a Ctrl-C
    just after (or, ``before=True``, just before) it schedules: the microseconds between the
    submit and the caller's ``try`` where a Ctrl-C left the work running unattended."""

    def __init__(self, loop: asyncio.AbstractEventLoop, before: bool = False) -> None:
        self._loop, self._before, self.fired = loop, before, False

    def __getattr__(self, name: str) -> object:
        return getattr(self._loop, name)

    def call_soon_threadsafe(self, *args: object, **kwargs: object) -> object:
        if self.fired:
            return self._loop.call_soon_threadsafe(*args, **kwargs)  # type: ignore[arg-type]
        self.fired = True
        if self._before:
            raise KeyboardInterrupt
        handle = self._loop.call_soon_threadsafe(*args, **kwargs)  # type: ignore[arg-type]
        raise KeyboardInterrupt
        return handle


def _ctrl_c_as_it_starts(monkeypatch: pytest.MonkeyPatch, before: bool = False) -> _CtrlCAsItStarts:
    proxy = _CtrlCAsItStarts(_loop.get_loop(), before)
    monkeypatch.setattr(_loop, "get_loop", lambda: proxy)
    return proxy


@pytest.mark.parametrize("how", ["run", "session"])
def test_a_ctrl_c_that_lands_as_the_work_is_submitted_still_stops_it_and_waits(
        monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    from smolbench import _session

    started, cleaned = threading.Event(), threading.Event()
    proxy = _ctrl_c_as_it_starts(monkeypatch)
    block = _loop.run if how == "run" else _session._block
    with pytest.raises(KeyboardInterrupt):
        block(_work(started, cleaned))  # type: ignore[arg-type]
    assert proxy.fired
    assert cleaned.is_set(), "the Ctrl-C reached the caller while the work ran on, unattended"
    assert not _loop.running()


def test_a_ctrl_c_before_the_work_reached_the_loop_leaves_nothing_running(monkeypatch: pytest.MonkeyPatch) -> None:
    started, cleaned = threading.Event(), threading.Event()
    proxy = _ctrl_c_as_it_starts(monkeypatch, before=True)
    with pytest.raises(KeyboardInterrupt):
        _loop.run(_work(started, cleaned))  # type: ignore[arg-type]
    assert proxy.fired and not _loop.running()  # no job waited on for ever (a SIGTERM's cancel_all would)
    for _ in range(3):  # the loop has run what was scheduled before: a start would have set started
        _loop.run(asyncio.sleep(0))
    assert not started.is_set()  # and it never ran
