"""A sandbox branch's run folder (a sub-folder of its parent's, inside the root machine's run
folder) goes when the branch is deleted, not only when the root is: a long session forking one
branch per episode kept thousands of empty folders in its root's. The folder is the machine's
to change, so it is removed only through the walk the host uses for a branch's socket
(``sandbox._below_run``: each component opened without following a link) and its tree without
following one: a machine that swaps a branch's folder, or a file in it, for a link to a host
folder never gets that host folder deleted.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import smolbench

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")

LS = "sorted(os.listdir({!r}))"


@pytest.fixture
def s(open_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[smolbench.Session]:
    monkeypatch.chdir(open_tmp)
    with smolbench.Session(backend="sandbox", ledger=open_tmp / "ledger.db") as session:
        session.run("import os")
        yield session


def ls(s: smolbench.Session, folder: str = "/run/smolbench", node: str = "root") -> list[str]:
    """What the root machine (or ``node``) sees in a run folder."""
    return list(s.run(LS.format(folder), node=node, check=True).value)


def test_a_deleted_branch_takes_its_run_folder_while_the_root_lives(s: smolbench.Session) -> None:
    before = ls(s)
    s.fork(2, "reward = SEED", keep="all")  # root.0 and root.1: folders 0 and 1
    assert {"0", "1"} <= set(ls(s)), ls(s)
    s.use("root.1")
    s.fork(1, "reward = SEED", keep="all")  # root.1.0, a branch of a branch: its folder is inside root.1's
    assert "0" in ls(s, "/run/smolbench/1"), ls(s, "/run/smolbench/1")
    s.run("open('/run/smolbench/notes.txt', 'w').write('a file of its own')", node="root.1.0", check=True)
    assert s.delete("root.1.0") == ["root.1.0"]
    assert "0" not in ls(s, "/run/smolbench/1"), ls(s, "/run/smolbench/1")
    assert s.delete("root.0") == ["root.0"]
    assert "0" not in ls(s) and "1" in ls(s), ls(s)
    assert s.run("1 + 1", node="root.1").value == 2  # its sibling goes on
    s.delete("root.1")
    assert ls(s) == before


def test_forks_with_keep_none_leave_no_folders(s: smolbench.Session) -> None:
    """A fork of 8 with keep none (leaf branches) and one with keep all then deleted."""
    before = ls(s)
    for _ in range(3):
        s.fork(8, "reward = SEED", keep="none")
    assert ls(s) == before
    kept = list(s.fork(8, "reward = SEED", keep="all").rows)
    assert len(ls(s)) == len(before) + 8 and len(kept) == 8
    for node in kept:
        s.delete(node)
    assert ls(s) == before


def _victim(open_tmp: Path) -> Path:
    """A host folder outside every machine, with the names a branch's folder holds (``s``)."""
    victim = open_tmp / "victim"
    for rel in ("s", "0/s", "1/s", "1/keep", "file"):
        (victim / rel).parent.mkdir(parents=True, exist_ok=True)
        (victim / rel).write_text("the host's")
    return victim


def _files(victim: Path) -> list[str]:
    return sorted(str(p.relative_to(victim)) for p in victim.rglob("*") if p.is_file())


def test_a_machine_that_links_a_branch_folder_to_a_host_folder_gets_nothing_deleted(
        s: smolbench.Session, open_tmp: Path) -> None:
    victim = _victim(open_tmp)
    whole = _files(victim)
    s.fork(4, "reward = SEED", keep="all")  # root.0 … root.3: folders 0 … 3
    s.use("root.0")
    s.fork(1, "reward = SEED", keep="all")  # root.0.0: folder 0/0
    # the root swaps two of its branches' folders for links to host folders (the host would
    # walk through them: an absolute link below /proc/PID/root resolves on the host)
    s.run(f"os.rename('/run/smolbench/0', '/run/smolbench/was0'); os.symlink({str(victim)!r}, '/run/smolbench/0')\n"
          f"os.rename('/run/smolbench/2', '/run/smolbench/was2'); os.symlink({str(victim / '1')!r}, '/run/smolbench/2')\n"
          "os.rename('/run/smolbench/3', '/run/smolbench/was3'); os.mkfifo('/run/smolbench/3')",  # opened, it waits
          node="root", check=True)
    # a branch plants links in its own folder: to a host file and to a host folder
    s.run(f"os.symlink({str(victim / 'file')!r}, '/run/smolbench/f'); os.symlink({str(victim / '1')!r}, "
          "'/run/smolbench/d'); os.mkfifo('/run/smolbench/p')", node="root.1", check=True)
    assert sorted(s.delete("root.0")) == ["root.0", "root.0.0"]  # root.0.0's folder is 0/0: through the link
    assert s.delete("root.2") == ["root.2"]
    assert s.delete("root.1") == ["root.1"]
    assert s.delete("root.3") == ["root.3"]  # its folder's name is a fifo now: never opened
    assert _files(victim) == whole
    left = ls(s)
    assert "1" not in left, left  # root.1's own folder went, its links and fifo with it (not what they point to)
    assert {"0", "2", "3"} <= set(left), left  # what the root put in its branches' place stays: never followed


def test_a_folder_being_removed_is_not_given_to_a_new_branch(tmp_path: Path) -> None:
    """Episodes of two runs (ep1.3, ep2.3) share a zygote and a folder name: one made while the
    other's folder was still being removed got that folder, and lost its socket with it."""
    from smolbench import _loop
    from smolbench.backends.base import CellRequest
    from smolbench.backends.sandbox import SandboxBackend
    from smolbench.spec import MachineSpec

    async def main() -> None:
        be = SandboxBackend(runtime_dir=str(tmp_path))
        root = await be.create(MachineSpec(), "root")
        try:
            [old] = await be.branch(root, ["ep1.3"], [None])
            assert Path(old.info["host_dir"]).name == "3"
            removing, go = threading.Event(), threading.Event()
            clear = be._clear_branch

            def held(*args: Any) -> None:  # its processes are gone; its folder not yet (a thread job)
                removing.set()
                go.wait(60)
                clear(*args)

            be._clear_branch = held  # type: ignore[method-assign]
            deleting = asyncio.ensure_future(be.delete(old))
            assert await asyncio.to_thread(removing.wait, 60)
            be._clear_branch = clear  # type: ignore[method-assign]
            [new] = await be.branch(root, ["ep2.3"], [None])
            go.set()
            await deleting
            res = await be.exec_cell(new, CellRequest("1 + 1"), lambda ev: None)  # its socket is where it was
            assert res.status == "ok", res.error
            assert Path(new.info["host_dir"]).name != "3", new.info["host_dir"]
        finally:
            await be.delete(root)
            await be.close()

    _loop.run(main())


def test_a_run_folder_a_machine_replaced_in_a_mount_namespace_of_its_own_is_not_followed(tmp_path: Path) -> None:
    """Code in a root can exec its agent (same pid, same start time), make a mount namespace
    of its own with a tmpfs on /run and ``/run/smolbench`` a link to a host folder: an absolute
    link under /proc/PID/root resolves from the host's root, and the walk opened the run
    folder itself following links, so deleting a branch (or a stage) removed a host folder.
    Here a process does the same with unshare(1), and the host's walk must refuse it."""
    import os
    import subprocess
    import time

    from smolbench.backends import _rundir
    from smolbench.backends.sandbox import _below_run

    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    victim = tmp_path / "victim"
    (victim / "16").mkdir(parents=True)
    (victim / "16" / "precious").write_text("host data")
    proc = subprocess.Popen(["unshare", "-Urm", "sh", "-c",
                             f"mount -t tmpfs tmpfs /run && ln -s {victim} /run/smolbench && exec sleep 120"])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if os.readlink(f"/proc/{proc.pid}/root/run/smolbench") == str(victim):
                    break
            except OSError:
                pass
            if proc.poll() is not None:
                pytest.skip("this host can't make a user and mount namespace here (unshare -Urm failed)")
            assert time.monotonic() < deadline, "the stand-in machine never made its link"
            time.sleep(0.02)
        try:
            fd, name = _below_run(f"/proc/{proc.pid}/root/run/smolbench/16")
        except OSError:
            pass  # refused: the run folder is a link
        else:
            try:
                _rundir.remove_tree(fd, name)
            finally:
                os.close(fd)
        assert (victim / "16" / "precious").read_text() == "host data"
    finally:
        proc.kill()
        proc.wait()


# Code in the root rewrites its agent's fork: the branches are made (their folders with them,
# held), then the fork fails; BROKEN_FORK_STAYS makes it wait instead until the host removed
# their folders (so a test can stop the fork midway, and the machine is free after).
BROKEN_FORK = '''
import gc, os, time
agent = next(o for o in gc.get_objects() if type(o).__name__ == "Agent")
real_fork = agent.fork
def fork(req):
    done = real_fork(req)
    if done == "child":
        return done
    folders = [os.path.dirname(c["socket"]) for c in req["children"]]
    if STAYS:
        deadline = time.monotonic() + 60
        while any(os.path.exists(f) for f in folders) and time.monotonic() < deadline:
            time.sleep(0.005)
        return done
    raise RuntimeError("the fork failed after making its branches")
agent.fork = fork
'''


def test_a_fork_that_fails_midway_leaves_no_branch_folders(s: smolbench.Session) -> None:
    """Its branches were made, held, and told to exit, but their folders stayed in the root's
    run folder until the root was deleted: a long session's failed forks added up."""
    before = ls(s)
    s.run("STAYS = False\n" + BROKEN_FORK, check=True)
    with pytest.raises(smolbench.SmolbenchError, match="the fork failed after making its branches"):
        s.fork(4, "reward = SEED", keep="all")  # made and failed twice: retries=1
    assert ls(s) == before
    s.run("agent.fork = real_fork", check=True)  # the root lives on and forks as before
    assert s.fork(2, "reward = SEED", keep="all").rows["root.5"]["status"] == "ok"
    assert set(ls(s)) == set(before) | {"4", "5"}


def test_a_fork_stopped_midway_leaves_no_branch_folders(tmp_path: Path) -> None:
    """Stopped (a Ctrl-C, an episode cancelled) while the agent had made its branches' folders."""
    import os
    import time

    from smolbench import _loop
    from smolbench.backends.base import CellRequest
    from smolbench.backends.sandbox import SandboxBackend
    from smolbench.errors import MachineBusy
    from smolbench.spec import MachineSpec

    async def run(be: SandboxBackend, ref: Any, code: str) -> None:
        deadline = time.monotonic() + 60
        while True:  # the agent ends its fork once the host removed the folders: at most a moment later
            try:
                res = await be.exec_cell(ref, CellRequest(code), lambda ev: None)
                break
            except MachineBusy:
                assert time.monotonic() < deadline, "the root stayed busy"
                await asyncio.sleep(0.01)
        assert res.status == "ok", res.error

    async def main() -> None:
        be = SandboxBackend(runtime_dir=str(tmp_path))
        root = await be.create(MachineSpec(), "root")
        run_dir = Path(root.info["host_dir"])
        try:
            before = sorted(os.listdir(run_dir))
            await run(be, root, "STAYS = True\n" + BROKEN_FORK)
            task = asyncio.ensure_future(be.branch(root, [f"root.{i}" for i in range(4)], [None] * 4))
            deadline = time.monotonic() + 60
            while len(os.listdir(run_dir)) < len(before) + 4:
                assert time.monotonic() < deadline and not task.done(), "the agent never made the folders"
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert sorted(os.listdir(run_dir)) == before
            await run(be, root, "agent.fork = real_fork")
            [new] = await be.branch(root, ["root.9"], [None])
            await run(be, new, "assert 1 + 1 == 2")
            await be.delete(new)
            assert sorted(os.listdir(run_dir)) == before
        finally:
            await be.delete(root)
            await be.close()

    _loop.run(main())


PLANT = (  # a branch's files 40 folders down (the host's walk went 32), and its socket's name made such a folder
    "import os\n"
    "deep = '/run/smolbench/deep' + '/d' * 40\n"
    "os.makedirs(deep)\n"
    "open(deep + '/secret', 'w').write('left by %d' % SEED)\n"
    "os.makedirs('/run/smolbench/s.tmp' + '/d' * 40)\n"
    "os.unlink('/run/smolbench/s')\n"
    "os.rename('/run/smolbench/s.tmp', '/run/smolbench/s')\n"
    "reward = SEED\n"
)
LOOK = (
    "import os\n"
    "seen = [os.path.join(d, f) for d, _, files in os.walk('/run/smolbench') for f in files]\n"
    "reward = len([p for p in seen if p.endswith('secret')])\n"
)


@pytest.mark.parametrize("way", ["fork", "episodes"])
def test_what_a_deleted_branch_left_however_deep_never_reaches_the_next(s: smolbench.Session, way: str) -> None:
    """Third audit: a deleted branch's folder was removed 32 folders deep, the rest stayed, and
    the next branch given the same folder name saw it (an episode saw an earlier one's files);
    a socket name made a deep folder broke every later episode of the zygote."""
    before = ls(s)
    make = (lambda code: s.fork(2, code, keep="none")) if way == "fork" else (lambda code: s.episodes(2, code))
    planted = make(PLANT)
    assert [b["status"] for b in planted] == ["ok", "ok"], [b["error"] for b in planted]
    for _ in range(2):
        looked = make(LOOK)
        assert [(b["status"], b["reward"]) for b in looked] == [("ok", 0), ("ok", 0)], [b["error"] for b in looked]
    if way == "fork":
        assert ls(s) == before  # all of it went, not only the top 32 folders


def test_a_tree_of_any_depth_is_removed_following_no_link(tmp_path: Path) -> None:
    import os

    from smolbench.backends import _rundir

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("the host's")
    top = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.mkdir("x", dir_fd=top)
        cur = os.open("x", os.O_RDONLY | os.O_DIRECTORY, dir_fd=top)
        for _ in range(1000):  # deeper than any path the host could name (PATH_MAX)
            os.symlink(str(outside), "link", dir_fd=cur)
            os.mkfifo("fifo", dir_fd=cur)
            os.mkdir("d", dir_fd=cur)
            nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=cur)
            os.close(cur)
            cur = nxt
        os.close(cur)
        _rundir.remove_tree(top, "x")
    finally:
        os.close(top)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside"]
    assert (outside / "keep").read_text() == "the host's"


def test_a_dead_owners_run_folder_is_swept_however_deep_with_a_fifo_in_it(tmp_path: Path) -> None:
    """The next ``%smol up`` removes run folders of kernels that were killed: what their machines
    wrote there (a fifo, a deep tree) neither holds the sweep up nor stays."""
    import os

    from smolbench.backends import _rundir

    dead = tmp_path / "smolbench-dead"
    (dead / "d").mkdir(parents=True)
    (dead / _rundir.OWNER).write_text("1 0\n")  # pid 1 never started at tick 0: gone
    os.mkfifo(dead / "fifo")
    deep = dead / "d"
    for _ in range(60):
        deep = deep / "d"
    deep.mkdir(parents=True)
    os.mkfifo(deep / "fifo")
    assert _rundir.sweep(str(tmp_path)) == [dead]
    assert list(tmp_path.iterdir()) == []
