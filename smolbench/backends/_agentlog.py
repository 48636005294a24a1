"""A machine's own output (its fds 1 and 2), kept in its agent.log up to a bound, and the
agent's ready line noticed in it."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

LOG_LIMIT = 8 << 20  # bytes of a machine's own output kept in its agent.log

READY_LINE = re.compile(rb"(?:^|\n)smolbench agent \S+ ready \(pid \d+\)\n")  # guest/agent.py main()


async def keep_log(fd: int, path: Path, booted: asyncio.Event | None = None) -> None:
    """Write a machine's output (pipe ``fd``, ours to close) to ``path`` up to LOG_LIMIT, then
    read on and drop the rest (the machine must never block on a full pipe), with one line
    saying so. ``booted`` is set once the agent's ready line came (before any cell ran, only
    the agent writes here)."""
    out = asyncio.StreamReader()
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(out), os.fdopen(fd, "rb", buffering=0))
    written, cut, head = 0, False, b""
    try:
        with open(path, "wb", buffering=0) as log:
            while data := await out.read(256 * 1024):
                if booted is not None and not booted.is_set():
                    head = (head + data)[-4096:]
                    if READY_LINE.search(head):
                        booted.set()
                part = data[: max(0, LOG_LIMIT - written)]
                if part:
                    log.write(part)
                    written += len(part)
                if len(part) < len(data) and not cut:
                    cut = True
                    log.write(b"\n[smolbench: this log stops at %d MiB; the machine wrote more, dropped]\n" % (LOG_LIMIT >> 20))
    finally:
        transport.close()
