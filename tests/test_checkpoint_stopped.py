"""A checkpoint save stopped (Ctrl-C) while the machine writes it: the machine stops its own
save too and is free when the stop returns ("the machine you were saving goes on"), and
nothing of the save is left. Before, the host hung up and returned while the machine went on
pickling: the next cell was told "machine busy" until it ended."""

from __future__ import annotations

import asyncio
import contextlib
import gc
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


