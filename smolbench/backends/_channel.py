"""A kept connection to one machine's agent: a cell that answers many small requests.

The cell's request opens it as any cell's does; after that, each request is one JSON
line on the same connection and each answer comes back through the gate
(:mod:`smolbench.gate.channel`), parsed as its bytes arrive (an asyncio protocol: no
stream reader, no task per channel). One request is in flight at a time per channel;
many channels (one per machine) are asked together by :func:`ask_all`, which writes
every request first and then waits once for all the answers. Between requests a channel's
reading is paused, so :func:`ask_now` can do the same on the caller's own thread (one poll
over the sockets, no hop to the loop): only one thread ever reads a socket at a time.
"""

from __future__ import annotations

import asyncio
import os
import select
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import MachineLost, NoAnswerInTime, SmolbenchError
from ..gate.channel import Answers
from ..gate.frames import Bound
from ..guest import protocol as P
from .base import CellRequest


class Channel(asyncio.Protocol):
    """One serving cell's connection: :meth:`send` a request, :meth:`answer` reads its answer."""

    def __init__(self, where: str, request: CellRequest, lost: Callable[[], str | None],
                 bound: Bound | None = None) -> None:
        self.where = where
        self._answers = Answers(request, where, bound)  # bound: what one answer may take (a gym env's)
        self._lost = lost  # why the machine was lost (out of memory), if it was
        self._ready: deque[Any] = deque()  # answers (or the exceptions standing for them) not taken yet
        self._wake: Callable[[], None] | None = None
        self._transport: asyncio.Transport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = -1
        self._held = False  # reading paused: no thread reads it until one asks (see ask_now)
        self.closed = False
        self.timeout: float | None = None  # s an answer may take; then the channel is cut (NoAnswerInTime)

    # -- the protocol (called by the event loop) --------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._loop = asyncio.get_running_loop()
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else -1

    def data_received(self, data: bytes) -> None:
        self._ready.extend(self._answers.feed(data))
        if self._answers.broken and self._transport is not None:
            self._transport.close()  # nothing more from it is read
        elif not self._answers.owed:
            self._hold()  # all answered: nothing is read until the next request
        self._woken()

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost says why there are no more answers

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._answers.broken:
            if isinstance(exc, ConnectionError):  # a request could not be written
                self._answers.close()
                self._ready.append(self._dropped(exc))
            else:
                self._ready.append(self._answers.end())
        self._answers.close()
        self.closed = True
        self._woken()

    def _dropped(self, exc: OSError) -> SmolbenchError:
        return SmolbenchError(f"machine {self.where} dropped its channel ({exc.strerror or exc}): it may have died")

    def _woken(self) -> None:
        wake, self._wake = self._wake, None
        if wake is not None and self._ready:
            wake()
        elif wake is not None:
            self._wake = wake

    def _hold(self) -> None:
        """Pause reading until the next request (on the loop's thread)."""
        if not self.closed and self._transport is not None and not self._held:
            self._transport.pause_reading()
            self._held = True

    def _unhold(self) -> None:
        """Read on the loop again, for an answer awaited there."""
        if self._held and not self.closed and self._transport is not None:
            self._transport.resume_reading()
        self._held = False

    # -- requests ---------------------------------------------------------------------

    def send(self, msg: dict[str, Any]) -> None:
        """Write one request (many channels' requests go out before any answer is read)."""
        self.send_raw(P.encode(msg))

    def send_raw(self, line: bytes) -> None:
        """Write one request already encoded as a JSON line."""
        self.notify(line)
        self._answers.asked()

    def notify(self, line: bytes) -> None:
        """Write one line the machine reads and does not answer (see ``gym.spares``)."""
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
            self._unhold()
            limit = self.timeout
            try:
                await asyncio.wait_for(waiter, limit)
            except asyncio.TimeoutError:
                assert limit is not None  # (it ran out)
                self._late(limit)
            finally:
                self._wake = None
        self._hold()
        return self._take()

    def _late(self, limit: float) -> None:
        """No answer within ``limit`` s (its wait's timeout): cut, so a late answer can't pass
        for the next request's."""
        if not self._ready:
            self._cut(NoAnswerInTime.after(self.where, limit))

    def _take(self) -> Any:
        out = self._ready.popleft()
        if isinstance(out, BaseException):
            why = self._lost()
            if why is not None:
                raise MachineLost(f"{why} (machine {self.where} was lost)") from None
            raise out
        return out

    # -- the caller's own thread (ask_now): the loop reads none of it meanwhile -------------

    def _write(self, data: bytes | memoryview, unsent: dict[int, memoryview]) -> bool:
        """Write what the socket takes now (the rest goes to ``unsent``); False if some is left."""
        if self._ready:
            return True  # it failed already
        try:
            k = os.write(self._fd, data)
        except BlockingIOError:
            k = 0
        except OSError as exc:
            self._cut(self._dropped(exc))
            return True
        if k < len(data):
            unsent[self._fd] = memoryview(data)[k:]
            return False
        return True

    def _read(self) -> bool:
        """One read of what is there now, parsed; False if there was none (or it was cut)."""
        try:
            data = os.read(self._fd, READ)
        except BlockingIOError:
            return False
        except OSError as exc:
            self._cut(self._dropped(exc))
            return False
        if not data:
            self._cut(self._answers.end())
            return False
        self._ready.extend(self._answers.feed(data))
        if self._answers.broken:
            self._cut(None)
            return False
        return True

    def _cut(self, why: BaseException | None) -> None:
        """No more answers (``why`` stands for the one awaited); the loop closes the transport."""
        if why is not None:
            self._ready.append(why)
        self._answers.close()
        self.closed = True
        if self._loop is not None and self._transport is not None:
            self._loop.call_soon_threadsafe(self._transport.close)

    def _drain(self) -> None:
        """Read what the machine sent since its last answer, before the next request goes (held:
        no one else reads it): its prints are dropped, and an answer, to no request, cuts the
        channel. An answer sent ahead would otherwise pass for the next request's."""
        while not self.closed and not self._ready and self._read():
            pass

    def _ready_to_ask(self) -> bool:
        """Drained (if held), and still able to take a request: else its answer is waiting."""
        if self._held:
            self._drain()
        return not self._ready

    async def ask(self, msg: dict[str, Any]) -> Any:
        """:meth:`send` then :meth:`answer`."""
        if not self._ready_to_ask():
            return self._take()
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
        if not chan._ready_to_ask():  # it sent an answer unasked (or died meanwhile): that, as its answer
            waiting.append(i)
            continue
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
            chans[i]._unhold()
        limit = _timeout(chans)
        try:
            await asyncio.wait_for(done, limit)
        except asyncio.TimeoutError:
            assert limit is not None  # (it ran out)
            for i in left:
                chans[i]._late(limit)
        except BaseException:  # cancelled (e.g. KeyboardInterrupt): no answer may pass for a later request
            _abandon(chans, [i for i in waiting if not chans[i]._ready])
            raise
        finally:
            for i in left:
                chans[i]._wake = None
    for i in waiting:
        chans[i]._hold()
        try:
            out[i] = chans[i]._take()
        except BaseException as exc:
            out[i] = exc
    return out


def _timeout(chans: Sequence[Channel]) -> float | None:
    """The shortest of ``chans``' timeouts (one batch waits once for all)."""
    limits = [c.timeout for c in chans if c.timeout is not None]
    return min(limits) if limits else None


def _abandon(chans: Sequence[Channel], unanswered: list[int]) -> None:
    """A batch whose caller is gone: the answers already in are dropped (the channel is in
    step again: one request, one answer), and a channel still owing one is cut, so its late
    answer can't pass for the next request's."""
    for i, chan in enumerate(chans):
        if i in unanswered:
            chan._cut(SmolbenchError(f"machine {chan.where}: its request was interrupted"))
        else:
            chan._ready.clear()
            chan._hold()


READ = 256 * 1024  # bytes read at once (asyncio's own size; the gate bounds each frame)
_IN, _OUT = select.POLLIN | select.POLLHUP | select.POLLERR | select.POLLNVAL, select.POLLOUT


def askable_now(chan: Channel) -> bool:
    """Whether :func:`ask_now` may ask ``chan``: open and held (its reading paused on the
    loop), no answer waiting, nothing waiting to be written."""
    t = chan._transport
    return not (not chan._held or chan.closed or t is None or t.is_closing() or chan._fd < 0 or chan._ready
                or t.get_write_buffer_size())


def ask_now(chans: Sequence[Channel], lines: Sequence[bytes]) -> list[Any] | None:
    """:func:`ask_all` on the calling thread: every request written, then one poll over the
    sockets until every answer is parsed (the same gate, the same answers and errors).
    None, with nothing sent, unless every channel is open and held (its reading paused on
    the loop, nothing waiting to be written): then the caller uses :func:`ask_all`."""
    if not all(map(askable_now, chans)):
        return None
    out: list[Any] = [None] * len(chans)
    left: dict[int, int] = {}  # fd -> its channel's index, until its answer is in
    unsent: dict[int, memoryview] = {}
    poll = select.poll()
    limit = _timeout(chans)
    deadline = None if limit is None else time.monotonic() + limit
    try:
        for i, chan in enumerate(chans):
            left[chan._fd] = i
            poll.register(chan._fd, _IN)
        for fd, _ in poll.poll(0):  # sent since its last answer (one poll for all): read first
            if not chans[left[fd]]._ready_to_ask():  # an answer to no request (or its end): its answer, nothing sent
                poll.unregister(fd)
                del left[fd]
        for chan, line in zip(chans, lines):
            if chan._fd not in left:
                continue
            chan._answers.asked()
            if not chan._write(line, unsent):
                poll.modify(chan._fd, _IN | _OUT)
        while left:
            if deadline is not None and time.monotonic() >= deadline:  # checked on every pass: a machine
                assert limit is not None  # trickling bytes of an answer it never ends keeps the poll busy
                for i in left.values():
                    chans[i]._late(limit)
                break
            wait = None if deadline is None else int(max(0.0, deadline - time.monotonic()) * 1000) + 1
            for fd, ev in poll.poll(wait):
                i = left.get(fd, -1)
                if i < 0:
                    continue
                chan = chans[i]
                if ev & _OUT and fd in unsent and chan._write(unsent.pop(fd), unsent):
                    poll.modify(fd, _IN)
                if ev & _IN and not chan._ready:
                    chan._read()
                if chan._ready:
                    poll.unregister(fd)
                    del left[fd]
    except BaseException:  # cut short (e.g. KeyboardInterrupt): no answer may pass for a later request
        _abandon(chans, list(left.values()))
        raise
    for i, chan in enumerate(chans):
        try:
            out[i] = chan._take()
        except BaseException as exc:
            out[i] = exc
    return out
