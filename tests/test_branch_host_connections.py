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
from pathlib import Path

import pytest

from smolbench.backends.base import CellRequest
from smolbench.backends.sandbox import SandboxBackend
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
