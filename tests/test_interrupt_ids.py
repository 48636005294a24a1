"""An interrupt names the request it is meant for: one the machine hears late (its cell over,
the next one begun) stops nothing.

The host sent ``{"op": "interrupt"}`` alone: a Ctrl-C (or a timeout) at a cell's end whose
connection the agent took after the next cell had begun stopped that next cell.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import pytest

from smolbench.backends.base import CellRequest, CellResult, Event, MachineRef
from smolbench.backends.process import ProcessBackend
from smolbench.spec import MachineSpec


class HeldInterrupts(ProcessBackend):
    """The seam: an interrupt's connection is made only once ``go`` is set (a loaded machine
    whose agent takes it late)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.go = asyncio.Event()

    async def _stream(self, ref: MachineRef, msg: dict[str, Any]) -> AsyncGenerator[bytes, None]:
        if msg.get("op") == "interrupt":
            await self.go.wait()
        async for chunk in super()._stream(ref, msg):
            yield chunk


def _waits_for(flag: Path, word: str) -> str:
    """A cell that says ``word`` started, then runs until ``flag`` exists (the process backend
    shares the host's files)."""
    return (f"import os, time\nprint({word + ' started'!r}, flush=True)\n"
            f"while not os.path.exists({str(flag)!r}):\n    time.sleep(0.01)\nprint({word + ' done'!r})")


def test_an_interrupt_heard_after_its_cell_ended_does_not_stop_the_next_cell(tmp_path: Path) -> None:
    """Old code: the next cell ended in KeyboardInterrupt, its work cut short."""
    flag = tmp_path / "flag"

    async def main() -> tuple[CellResult, CellResult]:
        be = HeldInterrupts(runtime_dir=str(tmp_path))
        machine = await be.create(MachineSpec(), "m")
        try:
            first = await be.exec_cell(machine, CellRequest("6 * 7"), lambda e: None)
            late = asyncio.ensure_future(be.interrupt(machine))  # meant for the cell above
            started = asyncio.Event()

            def seen(ev: Event) -> None:
                if "next started" in ev.text:
                    started.set()

            nxt = asyncio.ensure_future(be.exec_cell(machine, CellRequest(_waits_for(flag, "next")), seen))
            await asyncio.wait_for(started.wait(), 60)
            be.go.set()  # the agent now takes the interrupt, the next cell running
            await asyncio.wait_for(late, 60)  # answered: it was handled
            flag.touch()
            return first, await asyncio.wait_for(nxt, 60)
        finally:
            await be.delete(machine)
            await be.close()

    first, nxt = asyncio.run(main())
    assert first.status == "ok" and first.result == {"text/plain": "42"}
    assert nxt.status == "ok", nxt.error
    assert nxt.stdout == "next started\nnext done\n"


def test_an_interrupt_still_stops_the_cell_it_names(tmp_path: Path) -> None:
    async def main() -> tuple[CellResult, CellResult]:
        be = HeldInterrupts(runtime_dir=str(tmp_path))
        be.go.set()
        machine = await be.create(MachineSpec(), "m")
        try:
            started = asyncio.Event()

            def seen(ev: Event) -> None:
                if "cell started" in ev.text:
                    started.set()

            cell = asyncio.ensure_future(be.exec_cell(machine, CellRequest(_waits_for(tmp_path / "never", "cell")), seen))
            await asyncio.wait_for(started.wait(), 60)
            await be.interrupt(machine)
            stopped = await asyncio.wait_for(cell, 60)
            return stopped, await be.exec_cell(machine, CellRequest("6 * 7"), lambda e: None)
        finally:
            await be.delete(machine)
            await be.close()

    stopped, after = asyncio.run(main())
    assert (stopped.error or {}).get("ename") == "KeyboardInterrupt"
    assert stopped.stdout == "cell started\n"
    assert after.status == "ok" and after.result == {"text/plain": "42"}
    # it ends at the cell's line, not in the agent: the wait (line 4), or its print (line 2) when the
    # interrupt came while the agent still sent that line's output (seen in CI under load)
    frames = (stopped.error or {}).get("traceback") or []
    assert frames and frames[-1].startswith(('  File "<cell>", line 4', '  File "<cell>", line 2')), frames
    assert "serving.py" not in "".join(frames)


def test_an_interrupt_that_lands_in_a_print_ends_the_traceback_at_the_cell_s_line(tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C while the cell printed landed in the agent's writer (which holds SIGINT back while
    it sends a message): the traceback went on through serving.py and signal.py. (CI, loaded.)"""
    import smolbench

    monkeypatch.chdir(tmp_path)
    with smolbench.Session(backend="process", ledger="ledger.db", on_notice=lambda line: None) as s:
        # a SIGINT waiting for the cell's thread, delivered when the writer lets it through
        r = s.run("import signal, threading\nsignal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])\n"
                  "signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)\nprint('x', flush=True)\n")
    assert r.error is not None and r.error.ename == "KeyboardInterrupt"
    assert len(r.error.traceback) == 1 and r.error.traceback[0].startswith('  File "<cell-1>", line 4'), r.error.traceback
