"""`down()` beside fan-outs from other threads, and fan-outs cancelled before they started.

The attacks (audit, this session), on the sandbox backend through `smolbench.Session`:
* a thread looping `s.episodes(1, ...)` while the main thread called `s.down()`: an episodes
  call that started while down deleted machines booted a new zygote after the zygotes and the
  backend were closed, a live machine nothing ever deleted (down said it succeeded); or down
  raised "dictionary changed size during iteration" and deleted nothing;
* a fork or episodes cancelled a moment after it started: the branch tasks were cancelled
  before their first step, never ran their handlers, and stayed "starting" in a run recorded
  "done"; the next session on that ledger marked them lost ("its kernel stopped").
"""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import smolbench
from smolbench._aio import _gather_cancelling
from smolbench.errors import SmolbenchError

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")


def test_tasks_cancelled_before_their_first_step_are_told_to_the_caller() -> None:
    ran: list[int] = []
    told: list[bool] = []

    async def one(i: int) -> None:
        try:
            ran.append(i)
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            ran.append(-i)
            raise

    async def main() -> None:
        task = asyncio.ensure_future(_gather_cancelling([one(i) for i in (1, 2)], lambda: told.append(True)))
        await asyncio.sleep(0)  # the gather made its tasks; none of them has run yet
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert ran == [] and told == [True], (ran, told)


@needs_bwrap
@pytest.mark.parametrize("delay", [0.0, 0.05, 0.2])
def test_down_beside_episodes_in_another_thread_leaves_no_machine(open_tmp: Path, delay: float) -> None:
    s = smolbench.Session(backend="sandbox", ledger=open_tmp / "ledger.db", max_alive=64).up()
    s.fork(24, "reward = SEED", keep="all")  # down has machines to delete while the thread asks
    said: list[Any] = []
    stop = threading.Event()

    def worker() -> None:  # asks again after a cancel: down may still be deleting
        while not stop.is_set():
            try:
                s.episodes(1, "reward = SEED", allow_errors=True)
            except SmolbenchError as exc:
                said.append(str(exc))
                if "no machine is up" in str(exc):
                    return
            except BaseException as exc:  # noqa: BLE001 - anything else is a failure below
                said.append(type(exc).__name__)

    thread = threading.Thread(target=worker)
    thread.start()
    time.sleep(delay)
    try:
        s.down()
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive()
    assert [m.name for m in s.workbench.backend.list()] == [], said
    # the thread was told in words: refused while down ran, stopped by it, or no machine up after it
    assert said and all(any(w in x for w in ("going down", "no machine is up")) for x in said), said


@needs_bwrap
def test_a_blocking_fork_that_another_threads_down_stops_says_so(open_tmp: Path) -> None:
    s = smolbench.Session(backend="sandbox", ledger=open_tmp / "ledger.db").up()
    said: list[BaseException] = []

    def worker() -> None:
        try:
            s.fork(4, "import time\ntime.sleep(60)\nreward = SEED", keep="none")
        except BaseException as exc:  # noqa: BLE001 - what reached the caller, whatever it is
            said.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    deadline = time.monotonic() + 60
    while sum(n.status == "running" for n in s.workbench.tree) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    s.down()
    thread.join(60)
    assert not thread.is_alive() and len(said) == 1
    # was a bare concurrent.futures.CancelledError, with no words
    assert isinstance(said[0], SmolbenchError), repr(said[0])
    assert "stopped by the session going down" in str(said[0]) and "4 cancelled" in str(said[0]), said[0]


@needs_bwrap
def test_fan_outs_cancelled_as_they_start_record_every_branch_cancelled(open_tmp: Path) -> None:
    db = open_tmp / "ledger.db"

    async def main() -> None:
        async with smolbench.Session(backend="sandbox", ledger=db) as s:
            await s.aepisodes(2, "reward = SEED")  # the zygote is made
            for what in ("episodes", "fork"):
                for i in range(24):
                    coro = (s.aepisodes(20, "reward = SEED", allow_errors=True) if what == "episodes"
                            else s.afork(8, "reward = SEED", keep="none", allow_errors=True))
                    task = asyncio.ensure_future(coro)
                    await asyncio.sleep(i * 0.0003)
                    task.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await task
            assert [m.name for m in s.workbench.backend.list() if m.name != "root" and not m.name.startswith("zygote")] == []

    asyncio.run(asyncio.wait_for(main(), 300))
    with sqlite3.connect(db) as c:
        unfinished = list(c.execute("SELECT run_id, status FROM nodes WHERE status IN ('starting', 'running')"))
        wrong = list(c.execute("SELECT r.id, r.status FROM runs r WHERE r.status = 'done' AND EXISTS "
                               "(SELECT 1 FROM nodes n WHERE n.run_id = r.id AND n.status = 'cancelled')"))
    assert unfinished == [] and wrong == [], (unfinished[:5], wrong[:5])


@needs_bwrap
def test_a_ctrl_c_before_down_is_handed_over_leaves_no_coroutine_unawaited(open_tmp: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import gc
    import warnings

    from smolbench import _blocking

    s = smolbench.Session(backend="sandbox", ledger=open_tmp / "ledger.db").up()

    def interrupted() -> None:
        raise KeyboardInterrupt

    try:
        monkeypatch.setattr(_blocking, "wait_out_sigterm", interrupted)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with pytest.raises(KeyboardInterrupt):
                s.down()
            gc.collect()
        assert not [w for w in seen if "never awaited" in str(w.message)], [str(w.message) for w in seen]
    finally:
        monkeypatch.undo()
        assert s.down() >= 1  # the down that did not begin is still to do, and does it
    assert [m.name for m in s.workbench.backend.list()] == []
