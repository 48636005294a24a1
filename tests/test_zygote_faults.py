"""Episodes' zygote when things go wrong (sandbox backend, through the Workbench): a zygote whose
process died, a zygote that fails to boot, and init commands that leave what a branch can't have.

Reproduced (audit): a zygote killed from outside was reused by every later `%%smol episodes`
(its liveness came from the host's list), each fork of it failing after a 30 s wait with a plain
error, never retried; a zygote whose boot failed was not retried and left no run in the ledger;
init that left a file in /dev/shm or a process running gave booted episodes what zygote episodes
(branches) never saw.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from smolbench.backends.base import MachineRef
from smolbench.backends.sandbox import SandboxBackend
from smolbench.errors import InfraError
from smolbench.ledger import Ledger
from smolbench.result import ForkResult
from smolbench.spec import MachineSpec
from smolbench.workbench import Workbench

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")


def workbench(folder: Path, spec: MachineSpec | None = None, retries: int = 1) -> Workbench:
    return Workbench(SandboxBackend(), spec or MachineSpec(),
                     Ledger(folder / "ledger.db"), retries=retries)


def run(wb: Workbench, main: Callable[[], Awaitable[Any]]) -> Any:
    async def whole() -> Any:
        await wb.up()
        try:
            return await main()
        finally:
            await wb.down()

    return asyncio.run(asyncio.wait_for(whole(), 240))


async def episodes(wb: Workbench, n: int, code: str, **kw: Any) -> ForkResult:
    result = wb.new_episodes(n, concurrency=kw.pop("concurrency", None))
    await wb.episodes(result, code, lambda b, e: None, **kw)
    return result


def statuses(result: ForkResult) -> list[tuple[str, str | None]]:
    return [(r["status"], r["error"]) for r in result.rows.values()]


def zygote(wb: Workbench) -> MachineRef:
    verdict = wb.zygotes._made[wb.baseline]
    assert verdict.zygote is not None, verdict.fresh
    return verdict.zygote


def kill_agent(ref: MachineRef) -> None:
    """SIGKILL the machine's agent from outside (as the OOM killer would), and wait until it is gone."""
    os.kill(ref.info["host_pid"], signal.SIGKILL)
    for _ in range(500):
        try:
            with open(f"/proc/{ref.info['host_pid']}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] in "ZX":
                    return
        except OSError:
            return
        time.sleep(0.01)


def test_a_dead_zygote_is_made_again_and_the_episode_retried(open_tmp: Path) -> None:
    wb = workbench(open_tmp)

    async def main() -> tuple[list[Any], ...]:
        first = await episodes(wb, 1, "reward = 1")
        names = [zygote(wb).name]
        kill_agent(zygote(wb))  # between two runs: the next one makes a new zygote
        between = await episodes(wb, 2, "reward = 2")
        names.append(zygote(wb).name)
        real = wb.backend.branch

        async def dying(machine: MachineRef, *args: Any, **kw: Any) -> Any:  # it dies as it is forked
            if machine.name == names[1]:
                kill_agent(machine)
            return await real(machine, *args, **kw)

        wb.backend.branch = dying  # type: ignore[method-assign]
        during = await episodes(wb, 2, "reward = 3", concurrency=1)
        names.append(zygote(wb).name)
        return statuses(first), statuses(between), statuses(during), names

    first, between, during, names = run(wb, main)
    assert first == [("ok", None)]
    assert between == [("ok", None)] * 2
    assert during == [("ok", None)] * 2
    assert len(set(names)) == 3  # a new zygote each time the last died
    attempts = [(a["stage"], a["outcome"], a["error"] or "") for a in wb.ledger.attempt_rows()]
    retried = [a for a in attempts if a[:2] == ("episode", "retried")]
    assert retried and all(f"zygote {names[1]} died" in a[2] for a in retried), attempts
    assert ("episode", "ok", "") in attempts, attempts
    assert [m.name for m in wb.backend.list()] == []  # every zygote, dead or not, was deleted


def test_a_zygote_that_fails_to_boot_is_retried_and_the_run_recorded(open_tmp: Path) -> None:
    wb = workbench(open_tmp, retries=2)

    async def main() -> tuple[Any, ...]:
        real, failing = wb.backend.create, [1]

        async def flaky(spec: MachineSpec, name: str) -> MachineRef:
            if failing[0] > 0:
                failing[0] -= 1
                raise InfraError(f"{name}: boot failed (transient, injected)")
            return await real(spec, name)

        wb.backend.create = flaky  # type: ignore[method-assign]
        retried = await episodes(wb, 2, "reward = 1")
        wb.zygotes._made.clear()  # the next run makes a zygote again: it fails more often than the retries
        failing[0] = 10
        with pytest.raises(InfraError, match="boot failed"):
            await episodes(wb, 2, "reward = 2", retries=0)
        failing[0] = 0
        return (statuses(retried),)

    (retried,) = run(wb, main)
    assert retried == [("ok", None)] * 2
    attempts = [(a["node_id"], a["stage"], a["outcome"]) for a in wb.ledger.attempt_rows()]
    assert ("zygote1", "boot", "retried") in attempts and ("zygote1", "boot", "ok") in attempts, attempts
    runs = wb.ledger.run_rows()
    assert sorted(r["status"] for r in runs) == ["done", "done"], runs
    nodes = wb.ledger.nodes().set_index("id")
    failed = nodes[nodes.run_id == runs[0]["id"]]  # the newest
    assert list(failed.status) == ["error", "error"]
    assert all("boot failed" in e for e in failed.error)


SEEN = r"""
import os, json, time, smolbench_guest
deadline = time.monotonic() + 20
while True:  # init's `nohup sleep &` may still be a shell or nohup, not yet sleep, on a busy host
    procs = []
    for pid in os.listdir('/proc'):
        try:
            procs.append(open('/proc/%s/cmdline' % pid, 'rb').read().split(b'\0')[:2])
        except OSError:
            pass
    if time.monotonic() > deadline or not any(p[0].rsplit(b'/', 1)[-1] in (b'sh', b'nohup') for p in procs if p):
        break
    time.sleep(0.05)
smolbench_guest.report(seen=json.dumps({'shm': sorted(os.listdir('/dev/shm')),
                                         'sleeping': [b'sleep', b'1000'] in procs}))
"""


@pytest.mark.parametrize("init, said, seen", [
    ("echo hello > /dev/shm/r", "files in /dev/shm (r)", {"shm": ["r"], "sleeping": False}),
    # seen as "nohup" if the check comes before nohup's exec of sleep (a busy host)
    ("nohup sleep 1000 >/dev/null 2>&1 &", ("a process running (sleep)", "a process running (nohup)"),
     {"shm": [], "sleeping": True}),
])
def test_init_that_leaves_what_a_branch_lacks_boots_each_episode(open_tmp: Path, init: str, said: str | tuple[str, ...],
                                                                 seen: dict[str, Any]) -> None:
    wb = workbench(open_tmp, MachineSpec(init=(init,)))
    notes: list[str] = []
    wb.on_notice = notes.append

    async def main() -> ForkResult:
        return await episodes(wb, 2, SEEN)

    result = run(wb, main)
    assert [r["status"] for r in result.rows.values()] == ["ok", "ok"], statuses(result)
    assert [json.loads(r["metrics"]["seen"]) for r in result.rows.values()] == [seen, seen]
    told = [said] if isinstance(said, str) else list(said)
    assert result.fresh.startswith("boot") and any(t in result.fresh for t in told), result.fresh
    assert len(notes) == 1 and any(t in notes[0] for t in told) and "boot" in notes[0]
    (row,) = wb.ledger.run_rows()
    assert row["options"]["fresh"] == result.fresh
