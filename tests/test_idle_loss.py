"""A machine killed while idle (its agent SIGKILLed from outside: the OOM killer, a user's
`kill`) is shown lost by ``Session.status()`` at once, with why: it stayed listed alive until a
request to it failed."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

import smolbench
from smolbench.backends import _procs

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _kill(s: smolbench.Session, node: str) -> None:
    assert s.workbench is not None
    pid = s.workbench.machines[node].info["host_pid"]  # the agent, as the host sees it
    os.kill(pid, signal.SIGKILL)
    for _ in range(1000):  # reaped by its keeper (in the machine), not by us: until it is no longer running
        if not _procs.running(pid, _procs.start_time(pid)):
            return
        os.sched_yield()


def test_a_branch_killed_while_idle_is_lost_in_status(here: Path) -> None:
    with smolbench.Session(backend="sandbox", ledger="ledger.db", on_notice=lambda line: None) as s:
        s.run("x = 1")
        s.fork(2, "reward = SEED", keep="all")
        _kill(s, "root.1")
        st = s.status()
        assert st["lost"].startswith("root.1: machine root.1 died: its agent process ended while it was idle"), st
        assert st["live_machines"].startswith("2 (root, root.0)"), st
        assert s.run("x + 1").value == 2 and s.run("SEED", node="root.0").value == 0  # the others work on


def test_a_root_killed_while_idle_is_lost_and_up_starts_a_fresh_one(here: Path) -> None:
    with smolbench.Session(backend="sandbox", ledger="ledger.db", on_notice=lambda line: None) as s:
        s.run("x = 1")
        _kill(s, "root")
        st = s.status()
        assert st["up"] is False and st["lost"].startswith("root: machine root died: its agent process ended"), st
        assert s.workbench is not None and s.workbench.tree["root"].status == "lost"
        s.up()
        assert s.run("1 + 1").value == 2
