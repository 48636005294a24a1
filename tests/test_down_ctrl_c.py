"""Ctrl-C twice in a script: the first stops a fork, the second lands while the Session's down
deletes the machines (leaving the ``with`` block, or an explicit ``down()``). The deletion
finishes first, then the KeyboardInterrupt ends the script: no run folder, no process, and the
ledger's rows closed. It used to cancel the deletion, and the exit hook no longer knew the
session (its down had already let it go): the run folder stayed, and root stayed ``idle``."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest
from test_session import Script

import smolbench

SCRIPT = """\
import asyncio, os, signal, smolbench
from smolbench.workbench import Workbench

down = Workbench.down

async def down_with_a_second_ctrl_c(self, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C again, as the machines are being deleted
    await asyncio.sleep(0.5)  # the main thread hears it while it waits for this down
    return await down(self, *args, **kwargs)

Workbench.down = down_with_a_second_ctrl_c

def first_ctrl_c(branch, event):  # a branch is running: Ctrl-C
    if "started" in getattr(event, "text", ""):
        os.kill(os.getpid(), signal.SIGINT)

s = smolbench.Session(backend="sandbox", ledger="ledger.db")
{body}
print("not reached", flush=True)
"""
WITH = """\
with s:
    s.fork(4, "print('started', flush=True); import time; time.sleep(60); reward = SEED", on_output=first_ctrl_c)
"""
DOWN = """\
s.up()
try:
    s.fork(4, "print('started', flush=True); import time; time.sleep(60); reward = SEED", on_output=first_ctrl_c)
finally:
    s.down()
"""


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
@pytest.mark.parametrize("body", [WITH, DOWN], ids=["with", "down"])
def test_a_ctrl_c_during_down_lets_the_deletion_finish(tmp_path: Path, body: str) -> None:
    script = Script(tmp_path, SCRIPT.format(body=body))
    try:
        code, out, err = script.finish()
        assert "KeyboardInterrupt" in err and "not reached" not in out, err
        assert code != 0
        if body == WITH:  # the second Ctrl-C is not a second traceback: the first ends the block
            assert err.count("KeyboardInterrupt") == 1 and "another exception occurred" not in err, err
        assert script.leftovers() == ([], [], []), err  # its run folder stayed
        nodes = smolbench.Ledger(str(tmp_path / "ledger.db")).nodes()
        open_rows = nodes[(nodes["alive"] != 0) | nodes["status"].isin(["idle", "running", "starting"])]
        assert open_rows.empty, open_rows[["id", "status", "alive"]].to_string()  # root stayed idle, alive
        assert set(nodes["id"]) >= {"root", "root.0"}, nodes["id"].tolist()
    finally:
        script.clean()


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_a_cancel_during_adown_lets_the_deletion_finish(here: Path) -> None:
    """The async twin: a cancel of the task awaiting ``adown()`` (Ctrl-C under ``asyncio.run``,
    a trainer's task cancelled) cancelled the deletion itself, and left the machines running."""
    from smolbench import _loop

    async def main() -> Any:
        s = smolbench.Session(backend="sandbox", ledger="ledger.db")
        await s.aup()
        await s.afork(2, "reward = SEED", keep="all")
        down = asyncio.ensure_future(s.adown())
        await asyncio.sleep(0)  # it runs: its deletion started on smolbench's loop
        down.cancel()
        with pytest.raises(asyncio.CancelledError):
            await down
        return s.workbench

    wb = asyncio.run(main())
    try:
        assert wb.closed and not wb.machines, sorted(wb.machines)  # the deletion finished before the cancel went on
        nodes = smolbench.Ledger("ledger.db").nodes()
        assert len(nodes) == 3 and not nodes["alive"].any(), nodes[["id", "status", "alive"]].to_string()
    finally:
        if not wb.closed:
            _loop.run(wb.down(), stoppable=False)


EARLY = """\
import smolbench
from smolbench import _session

s = smolbench.Session(backend="sandbox", ledger="ledger.db")
s.up()
s.run("x = 1")
block = _session._block

def ctrl_c_before_the_wait(coro, **kwargs):  # a Ctrl-C in the bytecodes before down's wait
    coro.close()
    raise KeyboardInterrupt

_session._block = ctrl_c_before_the_wait
try:
    s.down()
except KeyboardInterrupt:
    print("interrupted", flush=True)
_session._block = block
"""


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_a_ctrl_c_before_down_begins_leaves_the_machines_to_the_exit_hook(tmp_path: Path) -> None:
    """Down let the session go before its deletion began: a Ctrl-C landing there left machines
    the exit hook no longer knew of. It lets it go once they are deleted."""
    script = Script(tmp_path, EARLY)
    try:
        code, out, err = script.finish()
        assert "interrupted" in out and code == 0, (out, err)
        assert script.leftovers() == ([], [], []), err
    finally:
        script.clean()
