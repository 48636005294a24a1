"""What the cluster tests share: checking cells, reading the ledger, and finding a local Ray
cluster's machines among the host's processes."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pandas as pd
from nbformat import NotebookNode
from nbhelpers import error_output, error_text

from smolbench import Ledger


def machine_processes(c: Any) -> list[str]:
    """Command lines of every machine (or fake microVM) on any node of the local cluster ``c``:
    each node's data folder is on its machines' command lines."""
    marks = [str(d).encode() for d in c.node_dirs]
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if any(m in cmd for m in marks):
            found.append(cmd.replace(b"\0", b" ").decode(errors="replace"))
    return found


def ok(cell: NotebookNode) -> NotebookNode:
    """The cell, after checking it raised nothing."""
    err = error_output(cell)
    assert err is None, f"{cell.source!r} raised {err.ename}: {err.evalue}\n{error_text(cell)}"
    return cell


def ledger_nodes(cwd: Path) -> pd.DataFrame:
    """The nodes table of the ledger beside the notebook in ``cwd``, by id."""
    led = Ledger(cwd / ".smolbench" / "ledger.db")
    try:
        return led.nodes().set_index("id")
    finally:
        led.close()


def agent_batches(streams: dict[str, Any]) -> tuple[Any, Any]:
    """A real NodeAgent's ``run_batch`` and ``grant`` on a fake transport, as a Batcher's
    ``start`` and ``grant``: ``streams[name]()`` is the async iterator of that machine's reply
    chunks. Ray's part (a generator's messages as object refs) is stood in by done futures."""
    import asyncio
    from collections import Counter
    from types import SimpleNamespace

    from smolbench.backends.base import MachineRef
    from smolbench.cluster.agent import NodeAgent

    agent = NodeAgent.__new__(NodeAgent)
    agent.calls, agent.requests = Counter(), Counter()
    agent._batches, agent._credits, agent._booting = {}, {}, {}
    agent.refs = {name: MachineRef(name, "fake", None) for name in streams}  # type: ignore[arg-type]
    agent.backend = SimpleNamespace(_stream=lambda ref, arg: streams[ref.name]())  # type: ignore[assignment]

    def start(batch_id: str, items: list[tuple[str, Any]]) -> Any:
        async def refs() -> Any:
            async for message in agent.run_batch(batch_id, "exec", items):
                done = asyncio.get_running_loop().create_future()
                done.set_result(message)
                yield done
        return refs()

    def grant(batch_id: str, index: int, n: int) -> None:
        asyncio.ensure_future(agent.grant(batch_id, index, n))

    return start, grant


def resolved_stream(messages: Iterable[bytes]) -> Any:
    """A node agent's stream stood in: each message as a Ray reference already resolved."""
    import asyncio

    async def gen() -> AsyncIterator[asyncio.Future[bytes]]:
        for msg in messages:
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(msg)
            yield fut

    return gen()


class Remote:
    """A node agent's handle stood in: ``h.method.remote(...)`` runs the real method as a task."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._agent, name)
        return SimpleNamespace(remote=lambda *a: asyncio.ensure_future(method(*a)))
