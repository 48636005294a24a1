"""A branch holds none of its parent agent's connections from the host.

The attack (audit, this session): a branch, leaf or not, kept every host connection its parent
agent had open at the fork (a ping, an interrupt, a kill or a release still being served, or
a request queued): it found the socket among its descriptors and wrote a forged answer, which
the host's request to the parent received, or could read the host's request line first. Now a
fork's children close them all (``serving.Agent.close_inherited``).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from smolbench.backends.base import CellRequest
from smolbench.backends.sandbox import SandboxBackend
from smolbench.errors import SmolbenchError
from smolbench.ledger import Ledger
from smolbench.spec import MachineSpec
from smolbench.workbench import Workbench

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")

# In the branch: every connected stream socket but its own (request, listener, keeper) gets a forged answer.
FORGE = r'''
import os, socket, json
agent = smolbench_guest._agent
keeper = getattr(agent.machine, "chan", None)  # a branch's own keeper's end (not a leaf's: it has none)
mine = {os.readlink("/proc/self/fd/%d" % s.fileno()) for s in (agent._conn, agent.listener, keeper) if s is not None}
forged = []
for fd in sorted(int(f) for f in os.listdir("/proc/self/fd")):
    try:
        link = os.readlink("/proc/self/fd/%d" % fd)
    except OSError:
        continue
    if fd <= 2 or not link.startswith("socket:") or link in mine:
        continue
    s = socket.socket(fileno=os.dup(fd))
    try:
        if s.type == socket.SOCK_STREAM and s.family == socket.AF_UNIX:
            try:
                s.getpeername()
                os.write(fd, b'{"t": "done", "status": "ok", "info": {"forged": true}}\n')
                forged.append(fd)
            except OSError:
                pass
    finally:
        s.close()
print(json.dumps(forged))
'''


@pytest.mark.parametrize("leaf", [True, False])
def test_a_branch_cannot_answer_the_hosts_requests_to_its_parent(open_tmp: Path, leaf: bool) -> None:
    wb = Workbench(SandboxBackend(), MachineSpec(), Ledger(open_tmp / "ledger.db"))
    be = wb.backend
    assert isinstance(be, SandboxBackend)

    async def main() -> tuple[list[list[int]], bytes]:
        await wb.up()
        pending = socket.socket(socket.AF_UNIX)
        try:
            root = wb.require_up()
            with be._socket(root) as path:
                pending.connect(path)  # a request to the parent in flight: its line not sent yet
            await asyncio.sleep(0.3)  # the parent's handler thread holds it
            refs = await be.branch(root, ["root.a", "root.b"], [1, 2], leaf=leaf)
            forged = []
            for ref in refs:
                res = await be.exec_cell(ref, CellRequest(FORGE), lambda e: None)
                assert res.status == "ok", res.error
                forged.append(json.loads(res.stdout.strip().splitlines()[-1]))
            pending.settimeout(1.0)
            try:
                heard = pending.recv(200)
            except TimeoutError:
                heard = b""
            for ref in refs:
                await be.delete(ref)
            return forged, heard
        finally:
            pending.close()
            await wb.down()

    forged, heard = asyncio.run(asyncio.wait_for(main(), 180))
    assert heard == b"" and forged == [[], []], (forged, heard)


# In the branch: how many of its sockets have the parent's listener's address (the host's connections to it).
HELD = r'''
import os, socket
held = 0
for fd in map(int, os.listdir("/proc/self/fd")):
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        continue
    try:
        if s.family == socket.AF_UNIX and s.getsockname() == PARENT:
            held += 1
    except OSError:
        pass
    finally:
        s.close()
reward = held
'''


def test_no_branch_holds_a_connection_the_host_made_while_it_forked(open_tmp: Path) -> None:
    """The attack (the second audit of the fix above): the host's connections accepted a moment
    before the fork, or closed by the agent while a handler's reader still held them, were in
    no list the agent kept: branches still held them. Four threads keep pinging the parent
    while it forks leaves and branches (a race: the fix before failed it in 3 runs of 3)."""
    wb = Workbench(SandboxBackend(), MachineSpec(), Ledger(open_tmp / "ledger.db"))
    be = wb.backend
    assert isinstance(be, SandboxBackend)
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            try:
                with be._socket(wb.machines["root"]) as path, socket.socket(socket.AF_UNIX) as c:
                    c.connect(path)
                    c.sendall(b'{"op": "ping"}\n')
                    while c.recv(65536):
                        pass
            except (OSError, SmolbenchError):
                pass

    async def main() -> list[Any]:
        await wb.up()
        threads = [threading.Thread(target=hammer) for _ in range(4)]
        try:
            root = wb.require_up()
            res = await be.exec_cell(root, CellRequest("print(smolbench_guest._agent.listener.getsockname())"), lambda e: None)
            parent = res.stdout.strip()
            assert parent.endswith("/s"), parent
            for t in threads:
                t.start()
            held = []
            for i in range(24):
                keep = "none" if i % 4 else "all"  # leaves, and branches with a keeper (kept; max_alive evicts them)
                result = wb.new_fork(8, keep=keep)
                await wb.fork(result, f"PARENT = {parent!r}\n" + HELD, lambda b, e: None, keep=keep)
                held += [(r["status"], r["reward"]) for r in result.rows.values()]
            return held
        finally:
            stop.set()
            for t in threads:
                t.join(30)
            await wb.down()

    held = asyncio.run(asyncio.wait_for(main(), 240))
    assert held and all(h == ("ok", 0.0) for h in held), held


def test_a_branch_of_a_branch_keeps_its_own_listener(open_tmp: Path) -> None:
    """A branch's branch binds its listener at its own run folder's ``N/s``, the same path string
    its parent bound in the root's namespace: closing by address closed the new branch's own
    listener too (it was lost at its first request; a gym env's in-place machine was rebuilt)."""
    wb = Workbench(SandboxBackend(), MachineSpec(), Ledger(open_tmp / "ledger.db"))

    async def main() -> list[Any]:
        await wb.up()
        try:
            first = wb.new_fork(1, keep="all")
            await wb.fork(first, "reward = 1", lambda b, e: None, keep="all")
            (child,) = first.rows
            out = []
            for keep in ("all", "none"):  # branches with a keeper, then leaves
                result = wb.new_fork(3, keep=keep, parent=child)
                await wb.fork(result, "reward = SEED", lambda b, e: None, keep=keep)
                out += [(r["status"], r["error"]) for r in result.rows.values()]
            return out
        finally:
            await wb.down()

    assert asyncio.run(asyncio.wait_for(main(), 180)) == [("ok", None)] * 6
