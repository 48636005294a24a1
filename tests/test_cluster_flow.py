"""Audit: one silent sibling turned off the driver's bound on a batch's output. The pump
paused only while no request waited with an empty queue, so in one fork a flooding branch's
frames kept being read into its queue while a sibling slept (180 MiB held for a slow reader).
Now flow control is per request: each holds at most its share here, and the agent sends a
request no more than the credit its own caller gave back."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from clusterhelpers import agent_batches, resolved_stream

from smolbench.cluster import batch as batch_module
from smolbench.cluster.batch import DATA, END, Batcher, frame

MB = 1 << 20


async def call(aw: Any) -> Any:
    return await aw


async def _flood_with_a_silent_sibling(batcher: Batcher) -> tuple[int, int, bytes]:
    """Request 0 floods and is read slowly; request 1's caller waits all along. The most bytes
    the batch held unread, what the flooder's caller read, and what the sibling got."""
    flood, sibling = batcher.submit("flood", None), batcher.submit("quiet", None)
    quiet = asyncio.ensure_future(_read_all(sibling))
    await asyncio.sleep(0)
    peak = read = 0
    async for chunk in flood.chunks():
        read += len(chunk)
        assert flood.batch is not None
        peak = max(peak, flood.batch.queued)
        await asyncio.sleep(0.001)  # the gate, busy with each chunk
    return peak, read, await quiet


async def _read_all(item: Any) -> bytes:
    return b"".join([c async for c in item.chunks()])


def test_a_flooding_branch_holds_its_share_even_while_a_sibling_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The audit's repro: an agent's stream stood in by 200 x 1 MB frames for request 0 (then its
    end, then request 1's), a slow reader for 0 and a waiting caller for 1."""
    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(cancel=lambda *a, **k: None))

    def start(batch_id: str, items: list[tuple[str, object]]) -> object:
        return resolved_stream([frame(0, DATA, b"x" * MB)] * 200 + [frame(0, END), frame(1, DATA, b"hi"), frame(1, END)])

    peak, read, quiet = asyncio.run(_flood_with_a_silent_sibling(Batcher(start, call, lambda b, i: None)))
    assert read == 200 * MB and quiet == b"hi"
    assert peak <= batch_module.QUEUED_BYTES + MB, f"{peak / MB:.0f} MiB held"  # two shares of 4 MiB, one frame


def test_the_agent_sends_a_request_no_more_than_its_caller_gave_credit_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real agent's run_batch and the real Batcher: a machine printing 200 MB, read slowly,
    is itself read no further ahead than its share, while its sibling's machine stays silent
    then answers (its caller is never held up by the flooder's bound)."""
    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(cancel=lambda *a, **k: None))
    produced = [0]
    let_quiet_speak = asyncio.Event()

    async def flood() -> AsyncIterator[bytes]:
        for i in range(200):
            produced[0] += MB
            yield b"x" * MB
            if i == 150:
                let_quiet_speak.set()

    async def quiet() -> AsyncIterator[bytes]:
        await let_quiet_speak.wait()
        yield b"hi"

    start, grant = agent_batches({"flood": flood, "quiet": quiet})
    read_ahead: list[int] = []

    async def main() -> tuple[int, int, bytes]:
        batcher = Batcher(start, call, lambda b, i: None, grant=grant)
        flood_item, quiet_item = batcher.submit("flood", None), batcher.submit("quiet", None)
        waiting = asyncio.ensure_future(_read_all(quiet_item))
        peak = read = 0
        async for chunk in flood_item.chunks():
            read += len(chunk)
            assert flood_item.batch is not None
            peak = max(peak, flood_item.batch.queued)
            read_ahead.append(produced[0] - read)
            await asyncio.sleep(0.001)
        return peak, read, await waiting

    peak, read, got = asyncio.run(asyncio.wait_for(main(), 120))
    share = batch_module.share(2)
    assert read == 200 * MB and got == b"hi"
    assert peak <= 2 * share, f"{peak / MB:.0f} MiB held"
    assert max(read_ahead) <= 2 * share + MB, f"{max(read_ahead) / MB:.0f} MiB read ahead of the caller"
