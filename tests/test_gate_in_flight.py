"""Unfinished reply lines of all machines together are bounded, and the bound is fair.

A machine's bytes without their line end are held by the host until the line ends, counted
toward one limit for every machine at once (``%smol config in-flight``). The attack: a
machine drips lines that never end, to hold the host's memory or to get other machines'
honest answers refused. The count must be exact (it drifted: finishing a line took off
more than was counted, so the limit stopped holding; refused bytes stayed counted, so
every later long answer of every machine was refused), and when it is full, the machine
holding the most is the one refused.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator

import pytest

from smolbench.gate import frames
from smolbench.gate.frames import Bad, Splitter
from smolbench.gate.limits import LIMITS

KB = 1000


@pytest.fixture(autouse=True)
def small_limits(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(LIMITS, "in_flight", 600 * KB)
    monkeypatch.setattr(LIMITS, "max_frame", 400 * KB)
    before = frames._InFlight.held
    yield
    assert frames._InFlight.held == before, "the test's splitters left bytes counted"


def answer(size: int, reads: int) -> list[bytes]:
    """One reply line of ``size`` bytes, as it arrives in ``reads`` reads."""
    line = b'{"t": "stream", "text": "' + b"x" * (size - 28) + b'"}\n'
    step = -(-len(line) // reads)
    return [line[i:i + step] for i in range(0, len(line), step)]


def test_finished_lines_leave_nothing_counted() -> None:
    held = frames._InFlight.held
    s = Splitter()
    for _ in range(200):
        got = [f for chunk in answer(300 * KB, 3) for f in s.feed(chunk)]
        assert len(got) == 1 and len(got[0]) == 300 * KB - 1
    assert frames._InFlight.held == held  # it was 120 MB below: the limit no longer held
    s.close()


def test_refused_bytes_are_not_left_counted() -> None:
    held = frames._InFlight.held
    others = [Splitter(), Splitter()]
    for o in others:
        o.feed(b"o" * 150 * KB)
    for _ in range(20):
        s = Splitter()
        with pytest.raises(Bad, match=r"this machine's \(400 KB\) was the largest"):  # 700 KB held: past 600
            for _ in range(4):
                s.feed(b"x" * 100 * KB)
        s.close()
    for o in others:
        o.close()
    assert frames._InFlight.held == held
    honest = Splitter()  # with the refused bytes left counted, this one was refused too
    assert len([f for chunk in answer(390 * KB, 4) for f in honest.feed(chunk)]) == 1
    honest.close()


def test_when_full_the_machine_holding_most_is_refused_not_the_one_that_came_last() -> None:
    drips = [Splitter() for _ in range(3)]
    for d, size in zip(drips, (100, 150, 250)):
        d.feed(b"x" * size * KB)  # 500 KB held, lines never ended
    honest = Splitter()
    got = [f for chunk in answer(300 * KB, 6) for f in honest.feed(chunk)]
    assert len(got) == 1  # the honest machine's long answer went through
    with pytest.raises(Bad, match=r"above the limit of 600 KB; this machine's \(250 KB\) was the largest"):
        drips[2].feed(b"x")  # the drip holding the most was refused, its bytes let go
    assert drips[0].feed(b"x\n") and drips[1].feed(b"x\n")  # the others keep their lines
    for s in (*drips, honest):
        s.close()


def test_machines_fed_on_two_threads_at_once_keep_the_count_exact() -> None:
    """Kept channels are read on callers' threads as well as on the loop's."""
    held = frames._InFlight.held

    def feed_many() -> None:
        s = Splitter()
        for _ in range(300):
            for chunk in answer(3 * KB, 3):
                s.feed(chunk)
        s.close()

    threads = [threading.Thread(target=feed_many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert frames._InFlight.held == held


def test_a_chunk_of_many_small_frames_is_split_in_order_and_lets_the_loop_serve_others() -> None:
    """A transport may hand over one big chunk (a node's stdout, a relay): its frames were taken
    with pop(0) (quadratic: 16 MB of small frames held the loop 46 s) and all in one go."""
    import asyncio

    from smolbench.gate.frames import split_frames

    frames = [b'{"t":"stream","n":%d}\n' % i for i in range(100_000)]
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    async def main() -> list[bytes]:
        async def one_chunk() -> AsyncIterator[bytes]:
            yield b"".join(frames)

        t = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        ticks_before = ticks
        got = [f async for f in split_frames(one_chunk())]
        t.cancel()
        assert ticks - ticks_before >= 50  # others ran while the chunk was split (every 1,024 frames)
        return got

    assert asyncio.run(main()) == [f.rstrip(b"\n") for f in frames]
