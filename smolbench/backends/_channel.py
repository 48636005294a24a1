"""A kept connection to one machine's agent: a cell that answers many small requests.

The cell's request opens it as any cell's does; after that, each request is one JSON
line on the same connection and each answer comes back through the gate
(:mod:`smolbench.gate.channel`), parsed as its bytes arrive (an asyncio protocol: no
stream reader, no task per channel). One request is in flight at a time per channel;
many channels (one per machine) are asked together by :func:`ask_all`, which writes
every request first and then waits once for all the answers.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import MachineLost, SmolbenchError
from ..gate.channel import Answers
from ..guest import protocol as P
from .base import CellRequest


class Channel(asyncio.Protocol):
    """One serving cell's connection: :meth:`send` a request, :meth:`answer` reads its answer."""

    def __init__(self, where: str, request: CellRequest, lost: Callable[[], str | None]) -> None:
        self.where = where
        self._answers = Answers(request, where)
        self._lost = lost  # why the machine was lost (out of memory), if it was
        self._ready: deque[Any] = deque()  # answers (or the exceptions standing for them) not taken yet
        self._wake: Callable[[], None] | None = None
        self._transport: asyncio.Transport | None = None
        self.closed = False

    # -- the protocol (called by the event loop) --------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._ready.extend(self._answers.feed(data))
        if self._answers.broken and self._transport is not None:
            self._transport.close()  # nothing more from it is read
        self._woken()

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost says why there are no more answers

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._answers.broken:
            if isinstance(exc, ConnectionError):  # a request could not be written
                self._answers.close()
                self._ready.append(SmolbenchError(f"machine {self.where} dropped its channel "
                                                  f"({exc.strerror or exc}): it may have died"))
            else:
                self._ready.append(self._answers.end())
        self._answers.close()
        self.closed = True
        self._woken()

    def _woken(self) -> None:
        wake, self._wake = self._wake, None
        if wake is not None and self._ready:
            wake()
        elif wake is not None:
            self._wake = wake

    # -- requests ---------------------------------------------------------------------

    def send(self, msg: dict[str, Any]) -> None:
        """Write one request (many channels' requests go out before any answer is read)."""
        self.send_raw(P.encode(msg))

    def send_raw(self, line: bytes) -> None:
        """Write one request already encoded as a JSON line."""
        if self.closed or self._transport is None:
            raise SmolbenchError(f"machine {self.where}: its channel is closed")
        self._transport.write(line)

    async def answer(self) -> Any:
        """The answer to the request sent last: its value, or :class:`AnswerError`,
        :class:`Ended`, a malformed-reply line, the machine-died line, :class:`MachineLost`."""
        if not self._ready:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()

            def wake() -> None:
                if not waiter.done():
                    waiter.set_result(None)

            self._wake = wake
            try:
                await waiter
            finally:
                self._wake = None
        return self._take()

    def _take(self) -> Any:
        out = self._ready.popleft()
        if isinstance(out, BaseException):
            why = self._lost()
            if why is not None:
                raise MachineLost(f"{why} (machine {self.where} was lost)") from None
            raise out
        return out

    async def ask(self, msg: dict[str, Any]) -> Any:
        """:meth:`send` then :meth:`answer`."""
        self.send(msg)
        return await self.answer()

    def close(self) -> None:
        """Hang up (the cell finishes on its own)."""
        if self.closed:
            return
        self.closed = True
        self._answers.close()
        if self._transport is not None:
            self._transport.close()


async def ask_all(chans: Sequence[Channel], lines: Sequence[bytes]) -> list[Any]:
    """Write ``lines[i]`` to ``chans[i]`` for every i, then wait for every answer; each
    answer is its value or the exception :meth:`Channel.answer` would raise."""
    out: list[Any] = [None] * len(chans)
    waiting: list[int] = []
    for i, (chan, line) in enumerate(zip(chans, lines)):
        try:
            chan.send_raw(line)
        except SmolbenchError as exc:
            out[i] = exc
            continue
        waiting.append(i)
    left = [i for i in waiting if not chans[i]._ready]
    if left:
        done = asyncio.get_running_loop().create_future()
        count = len(left)

        def one() -> None:
            nonlocal count
            count -= 1
            if count == 0 and not done.done():
                done.set_result(None)

        for i in left:
            chans[i]._wake = one
        try:
            await done
        finally:
            for i in left:
                chans[i]._wake = None
    for i in waiting:
        try:
            out[i] = chans[i]._take()
        except BaseException as exc:
            out[i] = exc
    return out
