"""A checkpoint save stopped (Ctrl-C) while the machine writes it: the machine stops its own
save too and is free when the stop returns ("the machine you were saving goes on"), and
nothing of the save is left. Before, the host hung up and returned while the machine went on
pickling: the next cell was told "machine busy" until it ended."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from gymhelpers import needs_bwrap

from smolbench._aio import _stoppable_thread
from smolbench.backends.base import CellRequest
from smolbench.backends.sandbox import SandboxBackend
from smolbench.spec import MachineSpec

# A value whose pickling names the agent's main thread (so the test sees the save there) and
# then takes a minute.
SLOW_TO_PICKLE = '''
import ctypes, time
class Slow:
    def __reduce__(self):
        ctypes.CDLL(None).prctl(15, b"slowpickle", 0, 0, 0)
        time.sleep(60)
        return (int, ())
slow = Slow()
kept = 41
'''


@needs_bwrap
def test_a_save_stopped_stops_the_machine_s_save_and_leaves_it_free(tmp_path: Path) -> None:
    async def main() -> None:
        (tmp_path / "run").mkdir()
        be = SandboxBackend(runtime_dir=str(tmp_path / "run"))
        root = await be.create(MachineSpec(), "root")
        try:
            res = await be.exec_cell(root, CellRequest(SLOW_TO_PICKLE), lambda ev: None)
            assert res.status == "ok", res.error
            pid, out = root.info["host_pid"], tmp_path / "ckpt"
            out.mkdir()
            task = asyncio.ensure_future(be.checkpoint(root, str(out / "c.smolcheckpoint")))

            def saving() -> bool:
                with contextlib.suppress(OSError):
                    return Path(f"/proc/{pid}/comm").read_text().strip() == "slowpickle"
                return False

            deadline = time.monotonic() + 60
            while not saving():
                assert time.monotonic() < deadline and not task.done(), "the machine never started its save"
                await asyncio.sleep(0.02)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            res = await be.exec_cell(root, CellRequest("kept + 1"), lambda ev: None)  # at once: not busy
            assert res.status == "ok", res.error
            assert list(out.iterdir()) == []  # no checkpoint, no part file
            assert not [p for p in Path(root.info["host_dir"]).iterdir() if p.name.startswith("ckpt-")]
        finally:
            await be.close()

    asyncio.run(main())


def test_a_stopped_thread_s_own_error_is_not_left_for_the_loop_to_report() -> None:
    """Its work, stopped, ends in its own error (the pack's PackStopped): read, not logged as
    "Task exception was never retrieved" with a traceback on the user's screen."""
    reported: list[dict[str, Any]] = []
    started = threading.Event()

    def work(stop: threading.Event) -> None:
        started.set()
        stop.wait(60)
        raise RuntimeError("the save was stopped")

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: reported.append(ctx))
        task = asyncio.ensure_future(_stoppable_thread(work))
        await asyncio.to_thread(started.wait, 60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        del task
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(main())
    gc.collect()
    assert not reported, reported




# Code in the machine rewrites its agent's save: a fifo where the stage folder should be.
FIFO_STAGE = '''
import gc, os
agent = next(o for o in gc.get_objects() if type(o).__name__ == "Agent")
def save(path):
    os.mkfifo(path)
    return {"t": "done", "status": "ok", "skipped": [], "saved": []}
agent.save = save
'''


@needs_bwrap
def test_a_fifo_a_machine_puts_for_its_save_s_stage_does_not_hang_the_host(tmp_path: Path) -> None:
    """The stage's removal opened it (``shutil.rmtree``'s first open) and a fifo blocked that
    open for good, on the kernel's event loop thread: the whole kernel hung."""
    (tmp_path / "run").mkdir()
    ended, seen = threading.Event(), dict[str, Any]()

    async def main() -> None:
        be = SandboxBackend(runtime_dir=str(tmp_path / "run"))
        root = await be.create(MachineSpec(), "root")
        seen["stage_dir"] = root.info["host_dir"]
        try:
            res = await be.exec_cell(root, CellRequest(FIFO_STAGE), lambda ev: None)
            assert res.status == "ok", res.error
            with contextlib.suppress(Exception):
                await be.checkpoint(root, str(tmp_path / "c.smolcheckpoint"))
            seen["after"] = await be.exec_cell(root, CellRequest("1 + 1"), lambda ev: None)
        finally:
            await be.close()

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # seen by the test below
            seen["error"] = exc
        finally:
            ended.set()

    threading.Thread(target=run, daemon=True).start()
    if not ended.wait(120):  # hung: open the fifo's other end so the thread can end
        for fifo in Path(seen["stage_dir"]).glob("ckpt-*"):
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        ended.wait(30)
        pytest.fail("the host hung removing the machine's stage (a fifo)")
    assert "error" not in seen, seen["error"]
    assert seen["after"].status == "ok"
    assert not (tmp_path / "c.smolcheckpoint").exists()
