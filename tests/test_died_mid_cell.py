"""A fork's or an episode's machine killed under its cell (sandbox backend) is made again under
``retries``, each attempt in the ledger; a cell's own exception never is.

Reproduced (audit): an episode's branch of the zygote, or a fork's branch, SIGKILLed from the
host mid-cell ended "error: machine ep1.0 died mid-cell" at its first attempt whatever the
retries: the gate's MachineLost was taken for the cell's own failure (the smol backend said
InfraError for a VM gone mid-relay, and was retried). A cell can't SIGKILL its own machine
(its agent is its pid namespace's init), so the host does it, as the OOM killer would.

A cell can end its machine itself, though (``os._exit`` runs in the agent): that is the cell's
error, never retried. Reproduced (audit): ``os._exit(0)`` in episodes with ``retries=3`` took 4
attempts each, every one in the ``attempts`` table. The host now reads the agent's wait status
from a pidfd (``backends/_agentend.py``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import pytest

from smolbench.backends import _agentend
from smolbench.backends.sandbox import SandboxBackend
from smolbench.ledger import Ledger
from smolbench.result import ForkResult
from smolbench.spec import MachineSpec, Volume
from smolbench.workbench import Workbench

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")

# Each attempt says it is here (a file in the host's folder), then waits until the host lets it
# go on (or kills its machine): attempt n of SEED is /marks/SEED.n, let go by /marks/go.SEED.n.
CELL = """
import os, time
n = len([f for f in os.listdir('/marks') if f.startswith('%d.' % SEED)])
open('/marks/%d.%d' % (SEED, n), 'w').close()
for _ in range(6000):
    if os.path.exists('/marks/go.%d.%d' % (SEED, n)):
        break
    time.sleep(0.01)
reward = n
"""


def workbench(folder: Path) -> Workbench:
    marks = folder / "marks"
    marks.mkdir()
    marks.chmod(0o777)  # a root kernel's sandboxes run as another uid
    spec = MachineSpec(volumes=(Volume(str(marks), "/marks", readonly=False),))
    return Workbench(SandboxBackend(), spec, Ledger(folder / "ledger.db"), retries=1)


async def killing(wb: Workbench, result: ForkResult, run: Awaitable[Any], kills: dict[int, int]) -> None:
    """Await ``run``, SIGKILLing from the host the machine of each attempt of seed S that is
    here while ``kills[S]`` is left; every other attempt is let go on."""
    marks = Path(wb.spec.volumes[0].host)
    by_seed = {row["seed"]: name for name, row in result.rows.items()}
    task, seen = asyncio.ensure_future(run), set()
    while not task.done():
        for mark in sorted(p.name for p in marks.iterdir() if not p.name.startswith("go.")):
            if mark in seen:
                continue
            seen.add(mark)
            seed = int(mark.split(".")[0])
            if kills.get(seed, 0) > 0:
                kills[seed] -= 1
                os.kill(wb.machines[by_seed[seed]].info["host_pid"], signal.SIGKILL)
            else:
                (marks / f"go.{mark}").touch()
        await asyncio.wait([task], timeout=0.02)
    await task


def attempts(wb: Workbench) -> list[tuple[str, int, str, str]]:
    return [(r["node_id"], r["attempt"], r["stage"], r["outcome"]) for r in wb.ledger.attempt_rows()]


def test_killed_episodes_and_fork_branches_are_made_again_and_give_up_when_retries_run_out(open_tmp: Path) -> None:
    wb = workbench(open_tmp)

    async def main() -> tuple[ForkResult, ...]:
        await wb.up()
        try:
            episodes = wb.new_episodes(2, seed_base=10)  # both killed once: each ok at its second attempt
            await killing(wb, episodes, wb.episodes(episodes, CELL, lambda b, e: None), {10: 1, 11: 1})
            given_up = wb.new_episodes(1, seed_base=20)  # killed at both attempts it has
            await killing(wb, given_up, wb.episodes(given_up, CELL, lambda b, e: None), {20: 2})
            fork = wb.new_fork(2, seed_base=30, keep="none")
            await killing(wb, fork, wb.fork(fork, CELL, lambda b, e: None, keep="none"), {31: 1})
            return episodes, given_up, fork
        finally:
            await wb.down()

    episodes, given_up, fork = asyncio.run(asyncio.wait_for(main(), 240))
    assert [(r["status"], r["attempts"], r["reward"]) for r in episodes.rows.values()] == [("ok", 2, 1), ("ok", 2, 1)]
    assert "ok (retried: attempt 2)" in repr(episodes)
    (row,) = given_up.rows.values()
    assert row["status"] == "error" and row["error"].endswith("(gave up after 2 attempts)"), row
    assert "died mid-cell" in row["error"]
    assert [(r["status"], r["attempts"]) for r in fork.rows.values()] == [("ok", 1), ("ok", 2)]
    assert sorted(attempts(wb)) == [
        ("ep1.0", 1, "episode", "retried"), ("ep1.0", 2, "episode", "ok"),
        ("ep1.1", 1, "episode", "retried"), ("ep1.1", 2, "episode", "ok"),
        ("ep2.0", 1, "episode", "retried"), ("ep2.0", 2, "episode", "gave up"),
        ("root.1", 1, "run", "retried"), ("root.1", 2, "run", "ok"),
    ]
    assert wb.backend.list() == []


def test_a_cells_own_exception_is_never_retried(open_tmp: Path) -> None:
    wb = workbench(open_tmp)

    async def main() -> ForkResult:
        await wb.up()
        try:
            result = wb.new_episodes(2)
            await wb.episodes(result, "if SEED == 1:\n    raise ValueError('mine')", lambda b, e: None, retries=3)
            return result
        finally:
            await wb.down()

    result = asyncio.run(asyncio.wait_for(main(), 240))
    assert [(r["status"], r["attempts"]) for r in result.rows.values()] == [("ok", 1), ("error", 1)]
    assert "ValueError: mine" in result.rows["ep1.1"]["error"]
    assert attempts(wb) == []


def test_a_cell_that_ends_its_own_machine_is_its_error_not_retried(open_tmp: Path) -> None:
    wb = workbench(open_tmp)
    ends = "import os\nprint('here')\nif SEED % 2 == 0:\n    os._exit(0)\nreward = 1"
    by_thread = "import os, threading\nif SEED == 1:\n    threading.Thread(target=os._exit, args=(3,)).start()\n    threading.Event().wait()"

    async def main() -> tuple[ForkResult, ForkResult]:
        await wb.up()
        try:
            episodes = wb.new_episodes(3, seed_base=0)
            await wb.episodes(episodes, ends, lambda b, e: None, retries=3)
            fork = wb.new_fork(2, seed_base=0, keep="all")  # branches with keepers; episodes' are leaves (a maker reaps them)
            await wb.fork(fork, by_thread, lambda b, e: None, keep="all", retries=3)
            return episodes, fork
        finally:
            await wb.down()

    episodes, fork = asyncio.run(asyncio.wait_for(main(), 240))
    rows = {name: (r["status"], r["attempts"]) for name, r in episodes.rows.items()}
    assert rows == {"ep1.0": ("error", 1), "ep1.1": ("ok", 1), "ep1.2": ("error", 1)}, rows
    for name in ("ep1.0", "ep1.2"):
        assert episodes.rows[name]["error"] == (f"machine {name} died mid-cell: the cell ended it (its agent exited "
                                                "with status 0, as os._exit(0) does); its state is gone")
    assert [(r["status"], r["attempts"]) for r in fork.rows.values()] == [("ok", 1), ("error", 1)]
    assert "exited with status 3" in fork.rows["root.1"]["error"]
    assert attempts(wb) == []
    assert wb.backend.list() == []


def test_how_an_agent_ended_says_whose_doing_it_was() -> None:
    """A wait status: an exit or a fault is the machine's own; SIGKILL, or none known, is from outside."""
    assert _agentend.own_end(0) == "its agent exited with status 0, as os._exit(0) does"
    assert _agentend.own_end(3 << 8) == "its agent exited with status 3, as os._exit(3) does"
    assert _agentend.own_end(signal.SIGSEGV) == "its agent died of SIGSEGV"
    assert _agentend.own_end(signal.SIGKILL) is None
    assert _agentend.own_end(None) is None
