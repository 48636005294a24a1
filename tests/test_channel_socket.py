"""A kept channel finds its machine's socket as a cell's connection does (round 4's own audit).

The machine's run folder is the machine's to change: a cell's connection finds the agent's
socket without following a link the machine planted (tests/test_containment.py), but the
connection of a kept channel (gym steps, OpenEnv sessions) followed it: the machine pointed
it at a host socket, which got the host's request (a cell's code and its pushed values) and
whose answers were taken as the machine's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from gymhelpers import define, needs_bwrap, up_bench
from sockethelpers import host_socket

from smolbench import _loop
from smolbench.backends._agenthost import AgentHostBackend
from smolbench.backends.base import CellRequest
from smolbench.backends.sandbox import SandboxBackend
from smolbench.errors import SmolbenchError
from smolbench.workbench import Workbench

pytestmark = needs_bwrap


@pytest.fixture(scope="module")
def bench(tmp_path_factory: Any) -> Iterator[Workbench]:
    yield from up_bench(tmp_path_factory)


def test_a_kept_channel_never_follows_a_socket_link_the_machine_planted(bench: Workbench,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    machine = bench.machines[str(bench.active)]
    request = CellRequest("x = 1", push={"secret": b"s3cret"})
    with host_socket() as (path, got):
        # the machine's last cell: its socket is gone for good (the fixture's teardown needs none)
        define(bench, f"import os\nos.unlink('/run/smolbench/s')\nos.symlink({str(path)!r}, '/run/smolbench/s')")
        with pytest.raises(SmolbenchError, match="not answering"):
            _loop.run(bench.backend.open_channel(machine, request))
        assert got == []
        # weakened: the plain path, as kept channels were opened before
        monkeypatch.setattr(SandboxBackend, "_socket", AgentHostBackend._socket)
        chan = _loop.run(bench.backend.open_channel(machine, request))
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        _loop.run(asyncio.sleep(0))
        chan.close()
        assert got and b"\"op\":\"exec\"" in got[0] and b"czNjcmV0" in got[0]  # the pushed value, base64
