"""A create or a branch stopped, then stopped again while its cleanup runs (an impatient second
Ctrl-C), on the sandbox backend: nothing of that machine may stay (its cgroups, run folder,
processes), not even until `down`. Each second cancel lands at a fixed stage (hooks), where
it landed before by chance."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from gymhelpers import needs_bwrap

from smolbench.backends import _procs
from smolbench.backends.base import CellRequest
from smolbench.backends.sandbox import SandboxBackend
from smolbench.errors import MachineBusy
from smolbench.spec import MachineSpec

pytestmark = needs_bwrap


def _gone(pids: list[tuple[int, str]]) -> bool:
    return not any(_procs.running(*p) for p in pids)


def _none_kept(be: SandboxBackend, dirs: list[Path]) -> bool:
    """No cgroup of those is left but empty in the limiter's pool (for the next branches)."""
    pooled = {d for m in be.limiter._pool.values() for d in m.dirs}
    return all(not d.exists() or (d in pooled and not (d / "cgroup.procs").read_text().split()) for d in dirs)


def test_a_create_stopped_twice_leaves_nothing(tmp_path: Path) -> None:
    """Stopped while it boots, then again as its delete starts: the delete finishes anyway.
    It gave up at its first await, leaving the cgroups, the processes and the run folder
    (the run folder even after down: the machine was no longer the backend's)."""

    async def main() -> None:
        be = SandboxBackend(runtime_dir=str(tmp_path))
        booting, seen = asyncio.Event(), dict[str, Any]()

        async def hang(ref: Any, proc: Any, ready: Path) -> None:  # the first cancel lands here
            seen.update(dirs=be.limiter.get(ref.name).dirs if be.limiter.get(ref.name) else [],
                        run_dir=Path(ref.info["run_dir"]), procs=[(proc.pid, _procs.start_time(proc.pid))])
            booting.set()
            await asyncio.Event().wait()

        be._wait_ready = hang  # type: ignore[method-assign]
        delete = be.delete

        async def delete_stopped(ref: Any) -> None:  # the second, as the cleanup starts
            task.cancel()
            await delete(ref)

        be.delete = delete_stopped  # type: ignore[method-assign]
        task = asyncio.ensure_future(be.create(MachineSpec(), "m"))
        try:
            await asyncio.wait_for(booting.wait(), 30)
            seen["procs"] += _procs.descendants(seen["procs"][0][0])
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.2)  # a thread the old code left behind ends
            assert be.limiter.get("m") is None and not any(d.exists() for d in seen["dirs"])
            assert not seen["run_dir"].exists()
            assert _gone(seen["procs"]), seen["procs"]
            assert be.list() == []
        finally:
            await be.close()

    asyncio.run(main())


@pytest.mark.parametrize("stage", ["cgroups", "moves"])
def test_a_branch_stopped_twice_leaves_nothing(tmp_path: Path, stage: str) -> None:
    """Stopped once the agent forked: while the branches' cgroups are still being made
    (``cgroups``; again as the held branches are told to exit), or while the branches are moved
    into them (``moves``; again as they are deleted). The cgroups made after the cancel stayed
    (it reached the thread's future, which the cleanup then no longer waited for), and the
    branches stopped once they were the backend's stayed, alive and unknown to the caller,
    until down."""

    async def main() -> None:
        be = SandboxBackend(runtime_dir=str(tmp_path))
        root = await be.create(MachineSpec(), "root")
        names = ["root.0", "root.1"]
        forked, seen = asyncio.Event(), dict[str, Any]()
        loop = asyncio.get_running_loop()
        make, limit, request, delete = be._make_cgroups, be._limit_branches, be._request, be.delete

        def slow_cgroups(spec: MachineSpec, names: list[str]) -> dict[str, Any]:
            if stage == "cgroups":
                time.sleep(0.5)  # the first cancel lands at the wait for them
            out = make(spec, names)
            seen["dirs"] = [d for m in out.values() for d in m.dirs]
            return out

        def moves(parent: Any, refs: list[Any], limits: dict[str, Any], maker: int | None = None) -> None:
            limit(parent, refs, limits, maker)
            if stage == "moves":
                loop.call_soon_threadsafe(forked.set)  # the first cancel lands at the wait for this
                time.sleep(0.3)

        async def requests(ref: Any, msg: dict[str, Any]) -> dict[str, Any]:
            if msg["op"] == "release" and not msg["go"]:
                task.cancel()  # the second, as the cleanup talks to the agent
            out = await request(ref, msg)
            if msg["op"] == "fork":
                seen["procs"] = [(p, _procs.start_time(p)) for p, _ in _procs.descendants(root.info["host_pid"])
                                 if p not in before_pids]
                if stage == "cgroups":
                    forked.set()
            return out

        async def deleted(ref: Any) -> None:
            if ref.name in names:
                task.cancel()  # the second, as the branches go
            await delete(ref)

        be._make_cgroups = slow_cgroups  # type: ignore[method-assign]
        be._limit_branches = moves  # type: ignore[method-assign]
        be._request = requests  # type: ignore[method-assign]
        be.delete = deleted  # type: ignore[method-assign]
        before = set(be.limiter._machines)
        before_pids = {p for p, _ in _procs.descendants(root.info["host_pid"])}
        task = asyncio.ensure_future(be.branch(root, names, [0, 1]))
        try:
            await asyncio.wait_for(forked.wait(), 30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(1.0)  # threads the old code left behind end
            assert [r.name for r in be.list()] == ["root"]
            assert set(be.limiter._machines) == before
            assert seen["dirs"] and _none_kept(be, seen["dirs"])
            assert seen["procs"] and _gone(seen["procs"]), seen["procs"]
        finally:
            await be.close()
        assert not any(d.exists() for d in seen.get("dirs", []))  # the pool's too, at close

    asyncio.run(main())


# The root's agent stops in its fork (an at-fork hook on its main thread, which names the
# thread so the test can see it there) until SIGUSR1.
STALL_NEXT_FORK = '''
import ctypes, os, signal
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
_stalled = []
def _stall():
    if _stalled:
        return
    _stalled.append(1)
    libc = ctypes.CDLL(None)
    libc.prctl(15, b"forkstalled", 0, 0, 0)
    signal.sigtimedwait({signal.SIGUSR1}, 120)
    libc.prctl(15, b"python3", 0, 0, 0)
os.register_at_fork(before=_stall)
'''


@pytest.mark.parametrize("leaf", [False, True])
def test_a_branch_stopped_while_its_parent_still_forks_leaves_no_held_children(tmp_path: Path, leaf: bool) -> None:
    """Stopped once while the parent's agent is still in the fork: the cleanup's "release,
    don't go" came before the fork ended, found nothing held, and the fork then held its
    children for good: sleeping processes inside the parent, until its next fork or its end."""

    async def main() -> None:
        be = SandboxBackend(runtime_dir=str(tmp_path))
        root = await be.create(MachineSpec(), "root")
        try:
            res = await be.exec_cell(root, CellRequest(STALL_NEXT_FORK), lambda ev: None)
            assert res.status == "ok", res.error
            pid = root.info["host_pid"]
            before = {p for p, _ in _procs.descendants(pid)}
            task = asyncio.ensure_future(be.branch(root, ["root.0", "root.1"], [0, 1], leaf=leaf))

            def stalled() -> int | None:
                for p in [pid] + [p for p, _ in _procs.descendants(pid)]:
                    with contextlib.suppress(OSError):
                        if Path(f"/proc/{p}/comm").read_text().strip() == "forkstalled":
                            return p
                return None

            deadline = time.monotonic() + 60
            while (forking := stalled()) is None:
                assert time.monotonic() < deadline and not task.done(), "the agent never reached its fork"
                await asyncio.sleep(0.02)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # the fork goes on, for a host that has left (to that thread: another would take it)
            assert ctypes.CDLL(None, use_errno=True).tgkill(forking, forking, signal.SIGUSR1) == 0
            deadline = time.monotonic() + 60
            while True:  # the parent serves on, once its fork has ended
                try:
                    res = await be.exec_cell(root, CellRequest("x = 1"), lambda ev: None)
                    break
                except MachineBusy:
                    assert time.monotonic() < deadline, "the parent's fork never ended"
                    await asyncio.sleep(0.05)
            assert res.status == "ok", res.error
            while (left := {p for p, _ in _procs.descendants(pid)} - before):
                assert time.monotonic() < deadline, f"held children left in the parent: {sorted(left)}"
                await asyncio.sleep(0.1)
            assert [r.name for r in be.list()] == ["root"]
        finally:
            await be.close()

    asyncio.run(main())
