"""Audit: a smol node's relay read a machine's output without limit. Its thread copied every
SDK event into an unbounded queue however slowly the gate read, and every line of the relay's
stderr was kept. Now the thread waits on a bounded queue, and only stderr's tail is kept."""

from __future__ import annotations

import asyncio
import threading
import tracemalloc
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from smolbench.backends.base import MachineRef
from smolbench.backends.smol import SmolBackend
from smolbench.errors import SmolbenchError
from smolbench.spec import MachineSpec


class Stream:
    """An SDK exec stream stood in: its events made as they are read, counted."""

    def __init__(self, events: Iterator[dict[str, Any]]) -> None:
        self.events, self.pulled, self.killed = events, 0, False

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for event in self.events:
            if self.killed:
                return
            self.pulled += 1
            yield event

    def kill(self) -> None:
        self.killed = True


def relay(stream: Stream) -> Any:
    """``SmolBackend._relay`` for one machine whose handle gives ``stream``."""
    handle = SimpleNamespace(write_file=lambda *a: None, exec_stream=lambda argv, opts: stream,
                             exec=lambda argv, opts: SimpleNamespace(exit_code=0))
    b = SmolBackend.__new__(SmolBackend)
    b._handles = {"m": handle}  # type: ignore[dict-item]
    return b._relay(MachineRef("m", "smol", MachineSpec(), info={"socket": "/run/smolbench/m.sock"}), {"op": "exec"})


def relay_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "smolbench-relay-m"]


def test_a_relay_reads_a_flooding_machine_no_further_ahead_than_the_gate() -> None:
    stream = Stream({"kind": "stdout", "data": "x" * 16384} for _ in range(2000))

    async def main() -> int:
        chunks = relay(stream)
        for _ in range(3):
            await chunks.__anext__()
        for _ in range(30):  # the gate busy elsewhere: the thread has all the time it wants
            await asyncio.sleep(0.01)
        ahead = stream.pulled
        await chunks.aclose()
        return ahead

    ahead = asyncio.run(main())
    for t in relay_threads():
        t.join(timeout=30)
    assert ahead <= 32, f"{ahead} events read for 3 taken"  # RELAY_EVENTS (16) queued, one in hand
    assert stream.killed and not relay_threads()  # the reader left: the thread ended too


def test_a_relay_keeps_only_the_tail_of_its_stderr() -> None:
    def events() -> Iterator[dict[str, Any]]:
        for _ in range(400):  # 50 MB
            yield {"kind": "stderr", "data": "e" * 131072}
        yield {"kind": "stderr", "data": "\nfatal: boom\n"}
        yield {"kind": "exit", "exit_code": 1}

    async def main() -> str:
        try:
            async for _ in relay(Stream(events())):
                pass
        except SmolbenchError as exc:
            return str(exc)
        return ""

    tracemalloc.start()
    try:
        error = asyncio.run(main())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "exited with code 1 (fatal: boom)" in error
    assert peak < 12 * 1024 * 1024, f"{peak / 2**20:.0f} MiB held"
