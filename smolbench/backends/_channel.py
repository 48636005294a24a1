"""A kept connection to one machine's agent: a cell that answers many small requests.

The cell's request opens it as any cell's does; after that, each request is one JSON
line on the same connection and each answer comes back through the gate
(:mod:`smolbench.gate.channel`). One request is in flight at a time per channel; many
channels (one per machine) are asked together by writing every request first, then
reading every answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..errors import MachineLost, SmolbenchError
from ..gate.channel import Answers
from ..guest import protocol as P
from .base import CellRequest

CHUNK = 256 * 1024


class Channel:
    """One serving cell's connection: :meth:`send` a request, :meth:`answer` reads its answer."""

    def __init__(self, where: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 request: CellRequest, lost: Callable[[], str | None]) -> None:
        self.where = where
        self._reader, self._writer = reader, writer
        self._answers = Answers(self._chunks(), request, where)
        self._lost = lost  # why the machine was lost (out of memory), if it was
        self.closed = False

    async def _chunks(self) -> AsyncIterator[bytes]:
        while True:
            try:
                chunk = await self._reader.read(CHUNK)
            except ConnectionError:
                return
            if not chunk:
                return
            yield chunk

    def send(self, msg: dict[str, Any]) -> None:
        """Write one request (buffered: many channels' requests go out before any answer is read)."""
        if self.closed:
            raise SmolbenchError(f"machine {self.where}: its channel is closed")
        self._writer.write(P.encode(msg))

    async def answer(self) -> Any:
        """The answer to the request sent last (see :meth:`Answers.next` for the errors)."""
        try:
            await self._writer.drain()
            return await self._answers.next()
        except (ConnectionError, SmolbenchError) as exc:
            why = self._lost()
            if why is not None:
                raise MachineLost(f"{why} (machine {self.where} was lost)") from None
            if isinstance(exc, ConnectionError):
                raise SmolbenchError(f"machine {self.where} dropped its channel ({exc.strerror or exc}): it may have died") from None
            raise

    async def ask(self, msg: dict[str, Any]) -> Any:
        """:meth:`send` then :meth:`answer`."""
        self.send(msg)
        return await self.answer()

    def close(self) -> None:
        """Hang up (the cell finishes on its own)."""
        if self.closed:
            return
        self.closed = True
        self._writer.close()
