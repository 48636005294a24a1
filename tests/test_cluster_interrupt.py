"""A cluster machine's interrupt names the driver's id of its cell: it stops that cell, and one
its node hears late (a Ray call comes when it comes) never stops the next cell.

Old code (its message without an id, sent late): the next cell ended in KeyboardInterrupt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from clusterhelpers import machine_processes

from smolbench.backends._wire import interrupt_message
from smolbench.backends.base import CellRequest, Event
from smolbench.spec import MachineSpec


@pytest.fixture(scope="module")
def process_node() -> Iterator[Any]:
    """A local Ray cluster with one process node (its machines share this host's files)."""
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'jupyterlab-smolbench[ray]'")
    from smolbench.cluster import local

    with local.LocalCluster(1, slots=4, backends=["process"]) as c:
        yield c
    assert machine_processes(c) == []


def _waits_for(flag: Path, word: str) -> str:
    return (f"import os, time\nprint({word + ' started'!r}, flush=True)\n"
            f"while not os.path.exists({str(flag)!r}):\n    time.sleep(0.01)\nprint({word + ' done'!r})")


def test_a_cluster_interrupt_stops_its_cell_and_a_late_one_not_the_next(process_node: Any, tmp_path: Path) -> None:
    from smolbench.cluster.backend import ClusterBackend

    cb = ClusterBackend(process_node.address)
    cb.start()
    node = next(iter(cb.nodes.values()))

    async def started(word: str, flag: Path) -> asyncio.Future[Any]:
        """A cell that runs until ``flag`` exists, once it said it started."""
        seen = asyncio.Event()

        def on(ev: Event) -> None:
            if f"{word} started" in ev.text:
                seen.set()

        cell = asyncio.ensure_future(cb.exec_cell(m, CellRequest(_waits_for(flag, word)), on))
        await asyncio.wait_for(seen.wait(), 60)
        return cell

    async def main() -> None:
        nonlocal m
        m = await cb.create(MachineSpec(), "m")
        try:
            cell = await started("first", tmp_path / "never")
            rid = cb._ids.last("m")
            assert rid is not None
            meant = interrupt_message(rid)  # what the driver sends for that cell
            await cb.interrupt(m)
            stopped = await asyncio.wait_for(cell, 60)
            assert (stopped.error or {}).get("ename") == "KeyboardInterrupt" and stopped.stdout == "first started\n"
            nxt = await started("next", tmp_path / "flag")
            await node.agent.control.remote("m", meant)  # the first cell's interrupt, heard (again) late
            (tmp_path / "flag").touch()
            after = await asyncio.wait_for(nxt, 60)
            assert after.status == "ok" and after.stdout == "next started\nnext done\n", after.error
        finally:
            await cb.close()

    m: Any = None
    asyncio.run(main())


# Runs in the machine (the process backend: the agent's own process): it takes every interrupt
# request and never answers one.
SILENT_TO_INTERRUPTS = (
    "import socket, sys\n_ag = sys.modules['smolbench_guest']._agent\n_held, _orig = [], _ag._handle\n"
    "def _h(conn):\n"
    "    if b'\"interrupt\"' in conn.recv(65536, socket.MSG_PEEK):\n"
    "        _held.append(conn)\n        return\n"
    "    return _orig(conn)\n"
    "_ag._handle = _h\n"
)


def test_a_node_agent_asked_to_interrupt_a_silent_machine_answers_within_the_grace(process_node: Any) -> None:
    """The node agent awaited the machine's answer to an interrupt with no limit: a machine that
    takes the request and never answers held that call (and its task on the node) for ever."""
    from smolbench.cluster.backend import ClusterBackend

    cb = ClusterBackend(process_node.address)
    cb.start()
    node = next(iter(cb.nodes.values()))

    async def main() -> None:
        m = await cb.create(MachineSpec(), "silent")
        try:
            done = await cb.exec_cell(m, CellRequest(SILENT_TO_INTERRUPTS), lambda ev: None)
            assert done.status == "ok", done.error
            said = await asyncio.wait_for(node.agent.control.remote("silent", interrupt_message(1)), 30)
            assert said == {"status": "ok"}
        finally:
            await cb.close()

    asyncio.run(main())
