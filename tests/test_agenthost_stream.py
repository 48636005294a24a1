"""A request to a machine that stops reading it can still be stopped (a timeout, a Ctrl-C).

The attack: a machine that never reads a request bigger than its socket's buffer (a cell
with a large ``--push``, a gym env's cloudpickled factory). A stop of the request closed
the connection and waited for the unsent bytes to be flushed: for as long as the machine
lived, so the gym env's ``timeout=`` and a Ctrl-C never came back.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from smolbench.backends.base import MachineRef
from smolbench.backends.process import ProcessBackend
from smolbench.spec import MachineSpec


def test_a_request_the_machine_never_reads_stops_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    host, machine = socket.socketpair()  # the machine's end: never read
    b = ProcessBackend()

    async def opened(ref: MachineRef) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_unix_connection(sock=host)

    monkeypatch.setattr(b, "_open", opened)

    async def request() -> None:
        async for _ in b._stream(MachineRef("m", "process", MachineSpec()), {"op": "exec", "code": "x" * (8 << 20)}):
            pass

    async def main() -> str:
        try:
            await asyncio.wait_for(request(), 0.5)  # the stop (the env's timeout here)
        except asyncio.TimeoutError:
            return "stopped"
        return "answered"

    async def watched() -> str:
        return await asyncio.wait_for(main(), 30)  # far past the stop: it did not come back

    try:
        assert asyncio.run(watched()) == "stopped"
    finally:
        machine.close()
