"""A fork cancelled while its branches come online on the network leaves nothing running.

The attack (audit, this session): with a network allow-list, `SandboxBackend.branch` made and
released the branches, then waited for each one's own network namespace and the proxy's
listeners in it; a cancel there (Ctrl-C of `%%smol episodes`, whose zygote forks are not
waited out) left the released branches running, in no list the host keeps: 244 live leaves
after 30 interrupted runs, deleted only at `down`. Now they are deleted before the cancel goes on.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from smolbench.backends import _procs
from smolbench.backends.sandbox import SandboxBackend
from smolbench.ledger import Ledger
from smolbench.spec import MachineSpec
from smolbench.workbench import Workbench

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")


@pytest.mark.parametrize("leaf", [True, False])
def test_a_fork_cancelled_while_its_branches_come_online_deletes_them(open_tmp: Path, leaf: bool) -> None:
    wb = Workbench(SandboxBackend(), MachineSpec(allow_cidrs=("127.0.0.2/32",)), Ledger(open_tmp / "ledger.db"))
    be = wb.backend
    assert isinstance(be, SandboxBackend)

    async def main() -> tuple[list[str], list[Any]]:
        await wb.up()
        try:
            root = wb.require_up()
            assert be._net_proxied(root.spec)
            real, reached = be.proxy.attach, asyncio.Event()

            async def stuck(*args: Any, **kw: Any) -> Any:  # the branches exist, released: the cancel lands here
                reached.set()
                await asyncio.Event().wait()
                return await real(*args, **kw)

            be.proxy.attach = stuck  # type: ignore[method-assign]
            before = {m.name for m in be.list()}
            task = asyncio.ensure_future(be.branch(root, ["root.a", "root.b", "root.c"], [0, 1, 2], leaf=leaf))
            await asyncio.wait_for(reached.wait(), 60)
            pids = [(m.info["host_pid"], m.info["host_started"]) for m in be._machines.values() if m.name not in before]
            assert len(pids) == 3 and all(_procs.running(*p) for p in pids), pids
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            be.proxy.attach = real  # type: ignore[method-assign]
            left = sorted(m.name for m in be.list() if m.name not in before)
            return left, [p for p in pids if _procs.running(*p)]
        finally:
            await wb.down()

    left, running = asyncio.run(asyncio.wait_for(main(), 180))
    assert left == [] and running == [], (left, running)
