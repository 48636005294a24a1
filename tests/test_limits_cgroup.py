"""The cgroup layer on its own: v2 file formats on a stand-in hierarchy (this host mounts the
v1 controllers, so v2 can't run for real here), and v1 for real where it is writable."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from smolbench.backends import _limits
from smolbench.spec import MachineSpec


@pytest.fixture
def fake_v2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A delegated v2 cgroup (the kernel's own) as plain files: what the probe and writes see."""
    root = tmp_path / "cgroup2"
    own = root / "user.slice" / "kernel.scope"
    own.mkdir(parents=True)
    (own / "cgroup.controllers").write_text("cpu memory pids io\n")
    (own / "cgroup.subtree_control").write_text("")
    monkeypatch.setattr(_limits, "_mounts", lambda: {"": root})
    monkeypatch.setattr(_limits, "_own_cgroups", lambda: {"": "/user.slice/kernel.scope"})
    monkeypatch.setattr(_limits, "_MECHANISM", None)
    real_mkdir = Path.mkdir

    def mkdir(self: Path, *args: object, **kwargs: object) -> None:  # cgroupfs fills a new group in
        real_mkdir(self, *args, **kwargs)  # type: ignore[arg-type]
        if str(self).startswith(str(root)):
            (self / "cgroup.controllers").write_text("cpu memory pids io\n")
            (self / "cgroup.procs").write_text("")

    monkeypatch.setattr(Path, "mkdir", mkdir)
    return own


def test_v2_is_chosen_and_writes_its_limits(fake_v2: Path) -> None:
    mech = _limits.detect()
    assert mech.name == "cgroup v2" and mech.bases == {"": fake_v2}
    assert (fake_v2 / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    limiter = _limits.Limiter()
    m = limiter.machine("root.3", MachineSpec(memory=512, pids=40, cpus=2))
    (d,) = m.dirs
    assert d.parent.name.startswith(f"smolbench-{os.getpid()}-") and d.name == "root.3"
    assert (d / "memory.max").read_text() == str(512 << 20)
    assert (d / "memory.swap.max").read_text() == "0"
    assert (d / "pids.max").read_text() == "40"
    assert (d / "cpu.max").read_text() == "200000 100000"
    assert (d.parent / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    assert m.wrap(["agent"])[-2:] == ["--", "agent"] and str(d / "cgroup.procs") in m.wrap(["agent"])
    assert m.agent_args(99) == ["--rlimit", f"DATA={512 << 20}"]  # the pids cgroup caps processes
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n")
    assert m.oom_kills() == 2
    assert "cgroup v2: memory 512M, 40 processes, 2 cpus" in limiter.describe(m.spec, nproc_per_machine=True)


def test_v2_not_delegated_falls_back(fake_v2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = Path.write_text

    def write_text(self: Path, data: str, *args: object, **kwargs: object) -> int:
        if self.name == "cgroup.subtree_control":  # our own cgroup holds processes: EBUSY
            raise OSError(16, "Device or resource busy")
        return real_write(self, data, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "write_text", write_text)
    monkeypatch.setattr(_limits, "_v1_bases", lambda: None)
    assert _limits.detect().name == "rlimits"


def test_rlimits_only_name_the_fallbacks() -> None:
    m = _limits.MachineLimits(MachineSpec(memory=256, pids=32), [], 0)
    assert m.wrap(["agent", "x"]) == ["agent", "x"]
    assert m.agent_args(32) == ["--rlimit", f"DATA={256 << 20}", "--rlimit", "NPROC=32"]
    assert _limits.MachineLimits(MachineSpec(), [], 0, enforce=False).agent_args(32) == []


def test_rlimits_give_a_sandbox_root_room_for_its_branches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 17: the kernel counts a branch's processes in its parent's user namespace too, so a
    root machine's RLIMIT_NPROC has room for BRANCH_ROOM full branches; each branch gets pids."""
    m = _limits.MachineLimits(MachineSpec(memory=256, pids=32), [], 0)
    monkeypatch.setattr(_limits.resource, "getrlimit", lambda _: (_limits.resource.RLIM_INFINITY,) * 2)
    assert _limits.nproc_ceiling(32) == 32 * (1 + _limits.BRANCH_ROOM)
    assert m.agent_args(_limits.nproc_ceiling(32), 32)[2:] == ["--rlimit", f"NPROC={32 * 33}", "--pids", "32"]
    monkeypatch.setattr(_limits.resource, "getrlimit", lambda _: (500, 1000))
    assert _limits.nproc_ceiling(32) == 500  # within the kernel's own limit, which counts the sandbox
    assert m.agent_args(_limits.nproc_ceiling(400), 400)[2:] == ["--rlimit", "NPROC=500", "--pids", "400"]
    assert m.agent_args(_limits.nproc_ceiling(600), 600)[2:] == ["--rlimit", "NPROC=500", "--pids", "500"]


@pytest.mark.skipif(_limits.detect().name != "cgroup v1", reason="needs a writable cgroup v1 hierarchy (root on this kind of host)")
def test_v1_for_real_a_process_joins_and_is_killed_and_the_group_goes() -> None:
    limiter = _limits.Limiter()
    m = limiter.machine("root", MachineSpec(memory=128, pids=20))
    proc = subprocess.Popen(m.wrap(["sh", "-c", "sleep 60 & sleep 60 & wait"]))
    try:
        deadline = time.monotonic() + 60  # a loaded host starts sh's children late
        while len(m.pids()) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.pid in m.pids() and len(m.pids()) == 3  # sh and both sleeps, none escaped
        assert (m.dirs[0] / "memory.limit_in_bytes").read_text().strip() == str(128 << 20)
        groups = {d.parent for d in m.dirs}
        limiter.close()
        assert proc.wait(10) == -9
        assert not any(g.exists() for g in groups)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_v2_an_emptied_cgroup_is_reused_renamed_never_shared_and_goes_at_close(
        fake_v2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool (Limiter._reuse): a released machine's emptied cgroup goes to the next one,
    renamed; a live machine's never; one with other limits is set to them; close removes all."""
    real_rmdir = Path.rmdir

    def rmdir(self: Path) -> None:  # cgroupfs removes a group's files with it
        for f in self.iterdir():
            if f.is_file():
                f.unlink()
        real_rmdir(self)

    monkeypatch.setattr(Path, "rmdir", rmdir)
    limiter = _limits.Limiter()
    a = limiter.machine("run1.0", MachineSpec(memory=512, pids=40))
    (old,) = a.dirs
    assert limiter.release_all(["run1.0"], keep=True) == [True]
    assert a.dirs == [] and old.exists()  # kept, empty, and no longer the released machine's
    b = limiter.machine("run2.0", MachineSpec(memory=512, pids=40))
    (d,) = b.dirs
    assert d.name == "run2.0" and d.parent == old.parent and not old.exists()  # the same cgroup, renamed
    c = limiter.machine("run2.1", MachineSpec(memory=256, pids=40))  # b is live: c gets its own
    assert c.dirs[0] != d and (c.dirs[0] / "memory.max").read_text() == str(256 << 20)
    limiter.release_all(["run2.0"], keep=True)
    e = limiter.machine("run3.0", MachineSpec(memory=256, pids=30))  # other limits: written
    assert e.dirs[0].name == "run3.0" and (e.dirs[0] / "memory.max").read_text() == str(256 << 20)
    assert (e.dirs[0] / "pids.max").read_text() == "30"
    (e.dirs[0] / "pids.current").write_text("1")
    e.fork_headroom(16)  # a machine released while it held a fork's headroom is not kept
    limiter.release_all(["run3.0"], keep=True)
    assert limiter._pool == {}
    limiter.release_all(["run2.1"])  # a single release (a root's, or one delete's) removes them
    assert limiter._pool == {} and not c.dirs
    limiter.close()
    assert [p for p in fake_v2.iterdir() if p.is_dir()] == []


@pytest.mark.skipif(_limits.detect().name != "cgroup v1", reason="needs a writable cgroup v1 hierarchy (root on this kind of host)")
def test_v1_for_real_a_reused_cgroup_holds_none_of_its_last_machines_processes() -> None:
    limiter = _limits.Limiter()
    spec = MachineSpec(memory=128, pids=20)
    m = limiter.machine("run1.0", spec)
    proc = subprocess.Popen(m.wrap(["sh", "-c", "sleep 60 & sleep 60 & wait"]))
    try:
        deadline = time.monotonic() + 60
        while len(m.pids()) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(m.pids()) == 3
        dirs = list(m.dirs)
        assert limiter.release_all(["run1.0"], keep=True) == [True]  # killed there, all of them
        assert proc.wait(10) == -9
        n = limiter.machine("run2.0", spec)
        assert [d.parent for d in n.dirs] == [d.parent for d in dirs] and not any(d.exists() for d in dirs)
        assert all(d.name == "run2.0" for d in n.dirs) and n.pids() == set()
        other = limiter.machine("run2.1", spec)  # n is live: never handed out again
        assert not set(other.dirs) & set(n.dirs)
        groups = {d.parent for d in n.dirs}
        limiter.release_all(["run2.0", "run2.1"], keep=True)
        limiter.close()
        assert not any(g.exists() for g in groups)
    finally:
        if proc.poll() is None:
            proc.kill()


def _prime_for(limiter: _limits.Limiter, seconds: float) -> float:
    """Run keep_moves_cheap for about ``seconds``; how long it took to return after its stop."""
    forked = threading.Event()
    t = threading.Thread(target=limiter.keep_moves_cheap, args=(forked, 0.002))
    t.start()
    time.sleep(seconds)
    stopped = time.monotonic()
    forked.set()
    t.join(5)
    assert not t.is_alive(), "keep_moves_cheap went on after its stop"
    return time.monotonic() - stopped


def test_a_forks_moves_are_primed_by_moving_this_process_where_it_is(fake_v2: Path) -> None:
    """Beside a fork, this process is 'moved' into the cgroup it is in (``0``: the writer
    itself), never another pid, which a machine could let the host reuse for another process."""
    (fake_v2 / "cgroup.procs").write_text("")
    limiter = _limits.Limiter()
    assert _prime_for(limiter, 0.05) < 1.0
    written = (fake_v2 / "cgroup.procs").read_text()
    assert written and set(written) == {"0"}


def test_priming_never_moves_this_process_out_of_where_it_is_now(fake_v2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attack on the above: once this process is in another cgroup than the one found at
    start (moved by a service manager), writing ``0`` there would move it into the machines'
    parent cgroup: nothing is written."""
    (fake_v2 / "cgroup.procs").write_text("")
    limiter = _limits.Limiter()
    monkeypatch.setattr(_limits, "_own_cgroups", lambda: {"": "/user.slice/elsewhere.scope"})
    _prime_for(limiter, 0.05)
    assert (fake_v2 / "cgroup.procs").read_text() == ""


@pytest.mark.skipif(_limits.detect().name != "cgroup v1", reason="needs a writable cgroup v1 hierarchy (root on this kind of host)")
def test_v1_for_real_priming_leaves_this_process_where_it_was() -> None:
    before = Path("/proc/self/cgroup").read_text()
    _prime_for(_limits.Limiter(), 0.05)
    assert Path("/proc/self/cgroup").read_text() == before


@pytest.mark.skipif(_limits.detect().name != "cgroup v1" or shutil.which("bwrap") is None,
                    reason="needs a writable cgroup v1 hierarchy and bubblewrap")
def test_v1_for_real_forks_reuse_cgroups_one_per_live_branch_and_down_leaves_none(tmp_path: Path) -> None:
    """Two `fork 4 --keep none` and a kept `fork 3` on the sandbox backend: the second fork's
    branches get the first's emptied cgroups; each live branch's cgroups hold only its own
    processes, no two live branches share one; after down no group of this kernel is left."""
    from smolbench import Ledger
    from smolbench.backends.sandbox import SandboxBackend
    from smolbench.workbench import Workbench

    seen: dict[str, list[set[str]]] = {}

    async def run() -> list[Path]:
        be = SandboxBackend()
        wb = Workbench(be, MachineSpec(), Ledger(tmp_path / "ledger.db"))
        await wb.up()
        real = be.exec_cell

        async def exec_cell(ref, request, on_event):  # type: ignore[no-untyped-def]
            limits = be.limiter.get(ref.name)
            assert limits is not None and limits.dirs
            seen.setdefault(ref.name, []).append({str(d) for d in limits.dirs})
            live = [be.limiter.get(n) for n in be._machines if n != ref.name]
            assert not {str(d) for m in live if m is not None for d in m.dirs} & seen[ref.name][-1]
            assert limits.pids() <= set(_procs_below(ref.info["host_pid"]))  # its own processes, nothing else
            return await real(ref, request, on_event)

        be.exec_cell = exec_cell  # type: ignore[method-assign]
        try:
            first = await wb.fork(wb.new_fork(4, keep="none"), "pass", lambda *a: None, keep="none")
            pooled = {m.dirs[0].stat().st_ino for m in be.limiter._pool.values()}
            assert len(pooled) == 4, pooled
            second = await wb.fork(wb.new_fork(4, keep="none"), "pass", lambda *a: None, keep="none")
            assert sorted(be.limiter._pool) == [f"root.{i}" for i in range(4, 8)]  # renamed, handed out, back
            assert {m.dirs[0].stat().st_ino for m in be.limiter._pool.values()} == pooled  # the same cgroups
            kept = await wb.fork(wb.new_fork(3, keep="all"), "pass", lambda *a: None, keep="all")
            assert [r["status"] for res in (first, second, kept) for r in res.rows.values()] == ["ok"] * 11
            groups = list(be.limiter._groups.values())
        finally:
            await wb.down()
            await be.close()
            wb.ledger.close()
        return groups

    import asyncio

    groups = asyncio.run(run())
    assert len(seen) == 11 and groups
    assert not any(g.exists() for g in groups)
    mine = f"{_limits.GROUP_PREFIX}{os.getpid()}-"
    for base in _limits.detect().bases.values():
        assert not [p for p in base.iterdir() if p.name.startswith(mine)]


def _procs_below(pid: int) -> list[int]:
    from smolbench.backends import _procs

    return [pid, *(p for p, _ in _procs.descendants(pid))]


def test_a_set_whose_pids_still_count_a_process_is_never_pooled(tmp_path: Path) -> None:
    """Seventh audit: a killed process its parent never collects (a zombie: a parent rewritten
    not to) is gone from cgroup.procs but still counts in pids.current; pooled, that count
    went to the next branch, of any tree, which then couldn't fork. Such a set is removed."""
    pids, memory = tmp_path / "pids", tmp_path / "memory"
    pids.mkdir()
    memory.mkdir()
    counted = _limits.MachineLimits(MachineSpec(), [memory, pids], 1, True)
    (pids / "pids.current").write_text("1\n")
    assert not _limits._no_pids(counted, time.monotonic() + 0.05)
    (pids / "pids.current").write_text("0\n")
    assert _limits._no_pids(counted, time.monotonic())


@pytest.mark.skipif(_limits.detect().name != "cgroup v1", reason="needs a writable cgroup v1 hierarchy (root on this kind of host)")
def test_v1_for_real_a_set_still_charged_with_its_last_machines_memory_is_never_reused(tmp_path: Path) -> None:
    """Third audit: a deleted branch's files that outlived it (here: a file it wrote, still
    there) stay charged to its memory cgroup; pooled, that charge counted against the next
    branch's limit, which then ran out of memory. Such a set is removed, not handed out."""
    limiter = _limits.Limiter()
    spec = MachineSpec(memory=128, pids=20)
    m = limiter.machine("run1.0", spec)
    subprocess.run(m.wrap(["sh", "-c", f"head -c {32 << 20} /dev/zero > {tmp_path / 'kept'}"]), check=True)
    assert _charged(m) >= 32 << 20
    dirs = list(m.dirs)
    assert limiter.release_all(["run1.0"], keep=True) == [True]  # emptied: pooled
    n = limiter.machine("run2.0", spec)
    try:
        assert _charged(n) < 8 << 20
        assert not any(d.exists() for d in dirs)  # the charged set went
    finally:
        limiter.release_all(["run2.0"])
        limiter.close()


def _charged(m: _limits.MachineLimits) -> int:
    (usage,) = [d / "memory.usage_in_bytes" for d in m.dirs if (d / "memory.usage_in_bytes").exists()]
    return int(usage.read_text())
