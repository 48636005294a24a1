"""Audit: artifacts crossing the cluster could run ahead of their reader into the object store.
An agent's ``chunks`` generator was called without Ray's backpressure (a 2 GB artifact could all
be produced ahead), and sending a checkpoint to a node ``ray.put`` the whole file at once. Now a
generator runs at most AHEAD chunks ahead, and a file goes a chunk per call as the node takes it."""

from __future__ import annotations

import asyncio
import hashlib
import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from clusterhelpers import Remote

from smolbench.cluster import artifact, shipping
from smolbench.cluster.agent import NodeAgent

KB = 1024


def _agent(tmp_path: Path) -> Any:
    agent = NodeAgent.__new__(NodeAgent)
    agent.store = artifact.Store(tmp_path / "store")
    agent._incoming, agent._closed, agent.uses = {}, set(), Counter()
    return agent


def test_a_checkpoint_goes_to_a_node_a_few_chunks_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(artifact, "CHUNK", 64 * KB)
    (tmp_path / "store").mkdir()
    path = tmp_path / "ckpt"
    path.write_bytes(bytes(range(256)) * 64 * 4 * 64)  # 64 chunks
    digest, size = hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_size
    agent = _agent(tmp_path)
    counts = {"sent": 0, "taken": 0, "peak": 0}

    def sent(n: int) -> None:
        counts["sent"] += n
        counts["peak"] = max(counts["peak"], counts["sent"] - counts["taken"])

    def put(block: bytes) -> Any:  # what the old code did: the whole file into the object store
        sent(len(block))
        done = asyncio.get_running_loop().create_future()
        done.set_result(block)
        return done

    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(put=put, exceptions=SimpleNamespace(
        RayTaskError=type("RayTaskError", (Exception,), {}), RayError=type("RayError", (Exception,), {}))))
    real_give = getattr(NodeAgent, "give", None)
    if real_give is not None:
        async def give(transfer: str, block: bytes | None) -> bool:
            sent(len(block or b""))
            return bool(await real_give(agent, transfer, block))
        agent.give = give
    store_receive = agent.store.receive

    async def receive(digest: str, size: int, chunks: AsyncIterator[object], where: str) -> int:
        async def counted() -> AsyncIterator[object]:
            async for chunk in chunks:
                counts["taken"] += len(chunk)  # type: ignore[arg-type]
                yield chunk
        return await store_receive(digest, size, counted(), where)

    agent.store.receive = receive
    node = SimpleNamespace(id="n1", lost=False, agent=Remote(agent))
    cb = SimpleNamespace(_call=lambda node, aw: _awaited(aw))
    got = asyncio.run(shipping.send(cb, node, str(path), digest, size))  # type: ignore[arg-type]
    assert got == size and agent.store.has(digest)
    assert counts["peak"] <= 4 * 64 * KB, f"{counts['peak'] // KB} KiB ahead of the node"  # AHEAD (2) waiting, one in each hand
    # a node that had it (or refused it) takes nothing more: the driver stops sending
    counts.update(sent=0, taken=0)
    assert asyncio.run(shipping.send(cb, node, str(path), digest, size)) == 0  # type: ignore[arg-type]
    assert counts["sent"] <= 64 * KB and agent._incoming == {}


async def _awaited(aw: Any) -> Any:
    return await aw


def test_an_artifact_is_fetched_with_ray_s_backpressure(tmp_path: Path) -> None:
    asked: list[dict[str, Any]] = []
    data = b"x" * 1000

    class Chunks:
        def options(self, **kw: Any) -> Chunks:
            asked.append(kw)
            return self

        def remote(self, digest: str) -> Any:
            async def gen() -> AsyncIterator[Any]:
                done = asyncio.get_running_loop().create_future()
                done.set_result(data)
                yield done
            return gen()

    (tmp_path / "store").mkdir()
    agent = _agent(tmp_path)
    digest = hashlib.sha256(data).hexdigest()
    got = asyncio.run(agent.fetch(SimpleNamespace(chunks=Chunks()), digest, len(data), "node x"))
    assert got == len(data)
    assert asked == [{"_generator_backpressure_num_objects": 2}]  # artifact.AHEAD
