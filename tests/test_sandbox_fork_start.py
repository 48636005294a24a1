"""A sandbox fork's branches start whatever state their parent is in: a branch forked at once,
before it ran any cell (its keeper may still be setting it up), and a fork that fails part
way at the machine's process limit, whose branches already made must not wait for ever."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from smolbench import _loop
from smolbench.backends.base import CellRequest
from smolbench.backends.sandbox import SandboxBackend
from smolbench.errors import SmolbenchError
from smolbench.spec import MachineSpec

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")


async def _ok(be: SandboxBackend, ref: Any, code: str) -> Any:
    res = await be.exec_cell(ref, CellRequest(code), lambda ev: None)
    assert res.status == "ok", res.error
    return (res.result or {}).get("text/plain")


def test_a_branch_forked_before_it_ran_a_cell_can_be_forked(tmp_path: Path) -> None:
    """Its store's grant went to the pid namespace its keeper had not left yet (its parent's):
    the grandchild's store was refused and it died at start ("dropped the connection")."""
    async def main() -> None:
        be = SandboxBackend(runtime_dir=str(tmp_path))
        root = await be.create(MachineSpec(), "root")
        try:
            for _ in range(3):
                [mid] = await be.branch(root, ["root.1"], [None])
                [leaf] = await be.branch(mid, ["root.1.0"], [None])  # at once: mid ran nothing yet
                assert await _ok(be, leaf, "1 + 1") == "2"
                assert await _ok(be, mid, "2 + 2") == "4"
                await be.delete(mid)
        finally:
            await be.delete(root)
            await be.close()

    _loop.run(main())


# Code in the root fills its process cap while its agent forks: after the first branch is made
# (held), every process it may have is taken, so the next os.fork() fails (BlockingIOError).
FILL_AT_SECOND = '''
import gc, subprocess
agent = next(o for o in gc.get_objects() if type(o).__name__ == "Agent")
real_listen = agent._listen
fillers, calls = [], []
def listen(path):
    calls.append(path)
    if len(calls) == 2:
        while True:
            try:
                fillers.append(subprocess.Popen(["sleep", "600"]))
            except OSError:
                break
    return real_listen(path)
agent._listen = listen
'''

# The agent's live children (not zombies), seen from the root: held branches are among them.
LIVE_KIDS = '''
import os
def live_kids():
    kids = []
    for task in os.listdir("/proc/1/task"):
        with open("/proc/1/task/%s/children" % task) as fh:
            kids += fh.read().split()
    out = []
    for k in kids:
        try:
            with open("/proc/%s/stat" % k) as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    out.append(int(k))
        except OSError:
            pass
    return sorted(out)
'''

WAIT_NONE = '''
import time
deadline = time.monotonic() + 30
while live_kids() and time.monotonic() < deadline:
    time.sleep(0.02)
live_kids()
'''


def test_a_fork_failing_part_way_at_the_process_limit_leaves_no_held_branch(tmp_path: Path) -> None:
    """The branches forked before the failure waited for a release that never came, each
    keeping its processes (out of the root's cap) until the root was deleted."""
    async def main() -> None:
        be = SandboxBackend(runtime_dir=str(tmp_path))
        root = await be.create(MachineSpec(pids=64), "root")
        try:
            await _ok(be, root, LIVE_KIDS + "live_kids()")
            assert await _ok(be, root, "live_kids()") == "[]"
            await _ok(be, root, FILL_AT_SECOND)
            with pytest.raises(SmolbenchError, match="process limit"):
                await be.branch(root, ["root.0", "root.1", "root.2"], [None] * 3)
            await _ok(be, root, "agent._listen = real_listen\nfor p in fillers: p.kill(); p.wait()\nlen(calls)")
            assert await _ok(be, root, WAIT_NONE) == "[]"  # the branch made before the failure is gone
            [kid] = await be.branch(root, ["root.3"], [None])  # the root forks as before
            assert await _ok(be, kid, "1 + 1") == "2"
        finally:
            await be.delete(root)
            await be.close()

    _loop.run(main())


def test_a_root_whose_pid_is_not_the_one_that_started_is_gone_and_its_folder_refused(tmp_path: Path) -> None:
    """A root's start time is recorded with its pid when it is ready: a pid the kernel gave to
    another process (here: the recorded start time differs) is reported gone, and no walk
    below its run folder is taken."""
    import errno

    async def main() -> None:
        be = SandboxBackend(runtime_dir=str(tmp_path))
        root = await be.create(MachineSpec(), "root")
        try:
            started = root.info.get("host_started")
            assert started, root.info
            assert be.gone([root]) == {}
            root.info["host_started"] = str(int(started) + 1)
            assert list(be.gone([root])) == ["root"]
            with pytest.raises(OSError) as refused:
                be._below(root, "s")
            assert refused.value.errno == errno.ESRCH
            root.info["host_started"] = started
            assert await _ok(be, root, "1 + 1") == "2"
        finally:
            await be.delete(root)
            await be.close()

    _loop.run(main())
