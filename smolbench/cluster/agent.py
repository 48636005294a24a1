"""The node agent: one Ray actor per node, pinned there, owning every machine on that node.

It runs the node's own backend (sandbox or process here; smol where a node has working
KVM) and only moves bytes: a cell's reply stream is yielded raw, chunk by chunk, to the
driver, whose gate decodes it. Control replies (fork, seed) are checked by the same gate
here, on trusted host code, and only plain names cross back. At start it sweeps run
folders of dead owners from its data folder (``SMOLBENCH_NODE_DIR``); its machines die
with it (``--die-with-parent``), and Ray ends it when the driver (the kernel) dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import tempfile
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ..backends import _rundir
from ..backends.base import Backend, MachineRef
from ..errors import SmolbenchError
from ..spec import MachineSpec
from .batch import DATA, END, FAIL, failure, frame, kind_of

KINDS = ("sandbox", "process", "smol")
BATCH_OPS = ("exec", "create", "delete")
MESSAGE = 1024 * 1024  # frames ready together go back as one message of about this much at most


def node_kind(resources: dict[str, float]) -> str:
    """The backend a node declares (a ``smolbench_backend_KIND`` resource), else ``auto``."""
    for kind in KINDS:
        if resources.get(f"smolbench_backend_{kind}", 0) > 0:
            return kind
    return "auto"


def _make_backend(kind: str, data_dir: Path) -> Backend:
    from ..backends.process import ProcessBackend
    from ..backends.sandbox import SandboxBackend, bwrap_path

    if kind == "auto":
        kind = "sandbox" if bwrap_path() else "process"
    if kind == "sandbox":
        return SandboxBackend(runtime_dir=str(data_dir))
    if kind == "process":
        return ProcessBackend(runtime_dir=str(data_dir))
    raise SmolbenchError("smol nodes are not supported by this node agent yet: declare the node "
                         "`smolbench_backend_sandbox` (or leave it auto)")


class NodeAgent:
    """Machines on one Ray node (wrapped with ``ray.remote`` by the driver)."""

    def __init__(self, session: str, kind: str = "auto", max_starts: int = 2) -> None:
        import ray

        self.session = session
        self.node_id = ray.get_runtime_context().get_node_id()
        base = os.environ.get("SMOLBENCH_NODE_DIR") or str(Path(tempfile.gettempdir()) / f"smolbench-node-{self.node_id[:12]}")
        self.data_dir = Path(base)
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        # leftovers of sessions whose agent died (kernel killed, node restarted): their run folders
        self.swept = [str(p) for p in _rundir.sweep(str(self.data_dir))]
        self.backend = _make_backend(kind, self.data_dir)
        self.refs: dict[str, MachineRef] = {}
        self.max_starts = max_starts
        self._starts: asyncio.Semaphore | None = None
        # what `%smol status` shows: agent calls by kind, and how many machine requests they carried
        self.calls: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        self._batches: dict[str, dict[int, asyncio.Future[None]]] = {}

    def _count(self, op: str, requests: int = 1) -> None:
        self.calls[op] += 1
        self.requests[op] += requests

    def _gate(self) -> asyncio.Semaphore:
        if self._starts is None:  # made on the actor's own event loop
            self._starts = asyncio.Semaphore(self.max_starts)
        return self._starts

    def _ref(self, name: str) -> MachineRef:
        ref = self.refs.get(name)
        if ref is None:
            raise SmolbenchError(f"machine {name!r} is not on node {self.node_id[:8]} (deleted, or its node restarted)")
        return ref

    async def describe(self) -> dict[str, Any]:
        """What ``%smol status`` shows about this node."""
        return {"node": self.node_id, "host": socket.gethostname(), "pid": os.getpid(), "backend": self.backend.name,
                "isolation": self.backend.isolation, "data_dir": str(self.data_dir), "live": sorted(self.refs),
                "swept": list(self.swept), "calls": dict(self.calls), "requests": dict(self.requests)}

    async def run_batch(self, batch_id: str, op: str, items: list[tuple[str, Any]]) -> AsyncIterator[bytes]:
        """Requests for many machines in one call (see batch.py): run side by side, their replies
        framed by index and sent as they come; ``cancel_requests`` stops some of them."""
        if op not in BATCH_OPS:
            raise SmolbenchError(f"unknown batch request {op!r}: one of {', '.join(BATCH_OPS)}")
        self._count(op, len(items))
        out: asyncio.Queue[bytes] = asyncio.Queue()

        async def one(i: int, name: str, arg: Any) -> None:
            end = frame(i, END)
            try:
                if op == "exec":
                    stream = getattr(self.backend, "_stream")  # noqa: B009 - the agent-host backends' raw transport
                    async with contextlib.aclosing(stream(self._ref(name), arg)) as chunks:
                        async for chunk in chunks:
                            out.put_nowait(frame(i, DATA, bytes(chunk)))
                elif op == "create":
                    await self._create(arg, name)
                else:
                    await self._delete([name])
            except BaseException as exc:
                end = frame(i, FAIL, failure(exc))
                if not isinstance(exc, Exception):
                    raise
            finally:
                out.put_nowait(end)

        tasks: dict[int, asyncio.Future[None]] = {i: asyncio.ensure_future(one(i, name, arg)) for i, (name, arg) in enumerate(items)}
        self._batches[batch_id] = tasks
        try:
            left = len(items)
            while left:
                ready = [await out.get()]
                while not out.empty() and sum(map(len, ready)) < MESSAGE:
                    ready.append(out.get_nowait())
                left -= sum(1 for f in ready if kind_of(f) != DATA)
                yield b"".join(ready)
        finally:
            self._batches.pop(batch_id, None)
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)

    async def cancel_requests(self, batch_id: str, indices: list[int]) -> None:
        """Stop some requests of a running batch (their callers left: Ctrl-C, a timeout)."""
        tasks = self._batches.get(batch_id, {})
        for i in indices:
            if i in tasks:
                tasks[i].cancel()

    async def create(self, spec: MachineSpec, name: str) -> dict[str, Any]:
        """Boot one machine."""
        self._count("create")
        return await self._create(spec, name)

    async def _create(self, spec: MachineSpec, name: str) -> dict[str, Any]:
        """Boot one machine (at most ``max_starts`` boot at once on this node)."""
        async with self._gate():
            ref = await self.backend.create(spec, name)
        self.refs[name] = ref
        return {"node": self.node_id, "backend": self.backend.name}

    async def branch(self, parent: str, names: list[str], seeds: list[int | None]) -> list[str]:
        """Live copy-on-write branches of a machine on this node: one batch, one fork."""
        self._count("branch", len(names))
        async with self._gate():
            refs = await self.backend.branch(self._ref(parent), names, seeds)
        for ref in refs:
            self.refs[ref.name] = ref
        return [ref.name for ref in refs]

    async def stream(self, name: str, msg: dict[str, Any]) -> AsyncIterator[bytes]:
        """One request to a machine; its raw reply bytes, as they come (the driver's gate decodes them)."""
        self._count("exec")
        ref = self._ref(name)
        stream = getattr(self.backend, "_stream")  # noqa: B009 - the agent-host backends' raw transport
        async for chunk in stream(ref, msg):
            yield bytes(chunk)

    async def control(self, name: str, msg: dict[str, Any]) -> dict[str, Any]:
        """A control request (seed, interrupt), checked by the gate on this node; plain data back."""
        self._count("control")
        if msg.get("op") == "interrupt":
            await self.backend.interrupt(self._ref(name))
            return {"status": "ok"}
        request = getattr(self.backend, "_request")  # noqa: B009
        done = await request(self._ref(name), msg)
        return {"status": str(done.get("status"))}

    async def delete(self, names: list[str]) -> int:
        """Delete machines (and their branches); unknown names are not an error."""
        self._count("delete", len(names))
        return await self._delete(names)

    async def _delete(self, names: list[str]) -> int:
        count = 0
        for name in names:
            ref = self.refs.pop(name, None)
            if ref is not None:
                await self.backend.delete(ref)
                count += 1
        for name in [n for n in self.refs if n not in {r.name for r in self.backend.list()}]:
            self.refs.pop(name, None)  # branches that went with a deleted parent
        return count

    async def close(self) -> int:
        """Delete every machine on this node."""
        n = len(self.refs)
        await self.backend.close()
        self.refs.clear()
        return n
