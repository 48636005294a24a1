"""A kept channel's timeout (gym's ``timeout=``) against a machine that answers slowly on purpose.

The attack: a machine that trickles the bytes of an answer it takes its time to finish. Each
byte woke the caller's poll, and the deadline was looked at only when a poll came back empty,
so the step waited as long as the machine liked and then took its answer. The channel must be
cut at the deadline whatever arrives, and its late answer never read as the next request's.
"""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from smolbench import _loop
from smolbench.backends._channel import Channel, ask_all, ask_now
from smolbench.backends.base import CellRequest
from smolbench.errors import NoAnswerInTime
from smolbench.guest import protocol as P
from smolbench.guest import pulldata
from smolbench.gym.requests import _in_time

ANSWER = P.encode({"t": "answer", "value": pulldata._pull(7, False)})
TIMEOUT = 1.0
LATE = 3.0  # s the machine takes to finish its answer: well past the timeout


@pytest.fixture
def pair() -> Iterator[tuple[Channel, socket.socket]]:
    host, machine = socket.socketpair()
    host.setblocking(False)

    async def connect() -> Channel:
        chan = Channel("m", CellRequest(code="serve"), lambda: None)
        await asyncio.get_running_loop().connect_accepted_socket(lambda: chan, host)
        chan._hold()
        return chan

    chan = _loop.run(connect())
    chan.timeout = TIMEOUT
    try:
        yield chan, machine
    finally:
        _loop.get_loop().call_soon_threadsafe(chan.close)
        machine.close()


def answer_late(machine: socket.socket) -> threading.Thread:
    """The machine: reads the request, sends its answer LATE s later (unless cut by then)."""
    def run() -> None:
        machine.recv(4096)
        time.sleep(LATE)
        try:
            machine.sendall(ANSWER)
        except OSError:
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


class TricklePoll:
    """``select.poll`` as a machine trickling a byte every moment makes it: every wait ends
    within a millisecond with the socket readable (a read then finds the byte, or nothing yet).
    A host's real trickle does this only as fast as the host schedules it; this always does."""

    def __init__(self) -> None:
        self._real = REAL_POLL()
        self._fds: set[int] = set()

    def register(self, fd: int, events: int) -> None:
        self._fds.add(fd)
        self._real.register(fd, events)

    def modify(self, fd: int, events: int) -> None:
        self._real.modify(fd, events)

    def unregister(self, fd: int) -> None:
        self._fds.discard(fd)
        self._real.unregister(fd)

    def poll(self, timeout: Any = None) -> list[tuple[int, int]]:
        got = self._real.poll(1 if timeout is None else min(int(timeout), 1))
        return got or [(fd, select.POLLIN) for fd in self._fds]


REAL_POLL = select.poll


def test_a_machine_that_keeps_bytes_coming_is_cut_at_the_timeout_on_the_caller_s_thread(
        pair: tuple[Channel, socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    chan, machine = pair
    monkeypatch.setattr(select, "poll", TricklePoll)
    t = answer_late(machine)
    got = ask_now([chan], [b'{"op":"step"}\n'])
    t.join(LATE + 10)
    assert got is not None and isinstance(got[0], NoAnswerInTime), got
    assert str(got[0]) == "machine m sent no answer within 1 s"
    assert chan.closed  # its late answer can't pass for the next request's


def test_an_answer_past_the_timeout_is_cut_on_the_loop(pair: tuple[Channel, socket.socket]) -> None:
    chan, machine = pair
    t = answer_late(machine)
    got = _loop.run(ask_all([chan], [b'{"op":"step"}\n']))
    t.join(LATE + 10)
    assert isinstance(got[0], NoAnswerInTime), got
    assert str(got[0]) == "machine m sent no answer within 1 s"
    assert chan.closed


def test_an_answer_in_time_is_taken(pair: tuple[Channel, socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    chan, machine = pair
    monkeypatch.setattr(select, "poll", TricklePoll)

    def answer() -> None:
        machine.recv(4096)
        machine.sendall(ANSWER)

    threading.Thread(target=answer, daemon=True).start()
    got = ask_now([chan], [b'{"op":"step"}\n'])
    assert got == [7] and not chan.closed


def test_a_cell_past_the_timeout_says_the_same_line() -> None:
    """A gym env's request as a cell (no kept connection) says what a channel says."""
    with pytest.raises(NoAnswerInTime) as err:
        _loop.run(_in_time(asyncio.sleep(60), TIMEOUT, "m"))
    assert str(err.value) == "machine m sent no answer within 1 s"
