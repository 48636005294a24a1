"""Episodes from a zygote are forked in waves, not one by one (issue 27: episodes at fork cost).

Before: a semaphore let one episode in per episode that ended, and each asked the zygote for
its branch alone: a stream of one-branch forks, each the slow way (two processes, a round trip
to the zygote per episode), 35-47 episodes/s at 64 and 200 where a fork of 64 made 118
branches/s. Now :class:`smolbench._aio.Waves` lets them in by waves and the zygote forks each
wave's branches in one request.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from smolbench._aio import Waves
from smolbench.backends.base import MachineRef
from smolbench.backends.sandbox import SandboxBackend
from smolbench.ledger import Ledger
from smolbench.spec import MachineSpec
from smolbench.workbench import Workbench


async def _admissions(waves: Waves, n: int, finish_order: list[int]) -> list[list[int]]:
    """Start ``n`` tasks through ``waves``; end the ones inside in ``finish_order``; the groups let in together."""
    inside: list[int] = []
    groups: list[list[int]] = []
    go = {i: asyncio.Event() for i in range(n)}

    async def task(i: int) -> None:
        async with waves:
            inside.append(i)
            await go[i].wait()

    tasks = [asyncio.ensure_future(task(i)) for i in range(n)]
    seen = 0
    for i in [*finish_order, None]:
        await asyncio.sleep(0.01)
        if len(inside) > seen:
            groups.append(inside[seen:])
            seen = len(inside)
        if i is not None:
            go[i].set()
    await asyncio.gather(*tasks)
    return groups


def test_waves_let_in_at_most_cap_then_a_whole_wave_at_a_time() -> None:
    groups = asyncio.run(_admissions(Waves(6, 4), 14, list(range(14))))
    assert groups == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 12, 13]], groups


def test_a_plain_semaphore_lets_in_one_by_one() -> None:
    """What the waves replace (the test above, with a semaphore: it must differ)."""

    class Sem(Waves):  # a wave of 1 is a semaphore
        def __init__(self, cap: int) -> None:
            super().__init__(cap, 1)

    groups = asyncio.run(_admissions(Sem(6), 8, list(range(8))))
    assert groups == [[0, 1, 2, 3, 4, 5], [6], [7]], groups


def test_a_cancelled_waiter_leaves_no_place_taken_and_no_place_lost() -> None:
    async def main() -> list[int]:
        waves = Waves(2, 2)
        hold = asyncio.Event()
        order: list[int] = []

        async def task(i: int) -> None:
            async with waves:
                order.append(i)
                await hold.wait()

        first = [asyncio.ensure_future(task(i)) for i in (0, 1)]
        queued = [asyncio.ensure_future(task(i)) for i in (2, 3, 4)]
        await asyncio.sleep(0.01)
        queued[0].cancel()  # cancelled while it waits
        await asyncio.sleep(0.01)
        hold.set()
        for t in first:
            t.cancel()  # cancelled inside: the places go back
        await asyncio.gather(*first, *queued, return_exceptions=True)
        async with waves:  # nothing is held: a newcomer goes straight in
            order.append(5)
        return order

    order = asyncio.run(asyncio.wait_for(main(), 10))
    assert order[:2] == [0, 1] and sorted(order[2:]) == [3, 4, 5], order


def _zygote_forks(folder: Path, n: int, concurrency: int, code: str) -> tuple[dict[str, Any], list[int], list[str]]:
    """Run ``n`` episodes through a Workbench; their rows, the size of each fork of the zygote
    (its fingerprint's left out), and the machines left after down."""
    wb = Workbench(SandboxBackend(), MachineSpec(), Ledger(folder / "ledger.db"))
    sizes: list[int] = []
    real = wb.backend.branch

    async def counting(machine: MachineRef, names: list[str], seeds: list[int | None], **kw: Any) -> Any:
        if machine.name.startswith("zygote") and names != ["fp"]:
            sizes.append(len(names))
        return await real(machine, names, seeds, **kw)

    wb.backend.branch = counting  # type: ignore[method-assign]

    async def main() -> dict[str, Any]:
        await wb.up()
        try:
            result = wb.new_episodes(n, concurrency=concurrency)
            await wb.episodes(result, code, lambda b, e: None, concurrency=concurrency)
            return result.rows
        finally:
            await wb.down()

    rows = asyncio.run(asyncio.wait_for(main(), 240))
    return rows, sizes, [m.name for m in wb.backend.list()]


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")
def test_episodes_from_the_zygote_are_forked_a_wave_per_request(open_tmp: Path) -> None:
    rows, sizes, left = _zygote_forks(open_tmp, 30, 3, "import time\ntime.sleep(0.05)\nreward = SEED")
    assert [(r["status"], r["reward"]) for r in rows.values()] == [("ok", float(i)) for i in range(30)], rows
    assert sum(sizes) == 30 and sizes[0] == 9, sizes  # 3 x concurrency at first
    assert all(s >= 6 for s in sizes[:-1]), sizes  # then a wave of 2 x concurrency per fork
    assert left == []


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")
def test_a_loop_of_episodes_keeps_the_newest_in_memory_and_every_one_in_the_ledger(
        open_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A training loop of `Session.episodes` grew the kernel's tree by a node per episode,
    without bound (an audit: 5,000 episodes, 5,000 nodes); now the newest ended ones stay."""
    import smolbench
    from smolbench import tree

    monkeypatch.setattr(tree, "KEPT_ENDED", 10)
    with smolbench.Session(backend="sandbox", ledger=open_tmp / "ledger.db") as s:
        results = [s.episodes(4, "reward = SEED", seed_base=4 * i) for i in range(5)]
        in_memory = [n.id for n in s._wb().tree if n.run_id is not None]
        assert len(in_memory) == 10 and set(in_memory) == {*results[-1].rows, *results[-2].rows, *list(results[-3].rows)[2:]}
        assert [r.rows[k]["reward"] for r in results for k in r.rows] == [float(i) for i in range(20)]
        rows = [n for n in s.ledger().node_rows() if n["run_id"] is not None]
    assert len(rows) == 20 and {r["status"] for r in rows} == {"ok"}, rows


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")
def test_a_wave_bigger_than_the_host_holds_is_forked_in_parts(open_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attack (audit): on a host with room for 20 branches, 30 episodes at concurrency 10
    asked for a wave of 30 in one fork, refused up front ("fork of 30 refused"), and every
    episode of it failed, naming a fork the user never asked for."""
    from smolbench.backends import _limits

    monkeypatch.setattr(_limits, "host_available_mib", lambda: _limits.HOST_RESERVE_MIB + _limits.BRANCH_HOST_MIB * 20)
    rows, sizes, left = _zygote_forks(open_tmp, 30, 10, "reward = SEED")
    assert [(r["status"], r["reward"]) for r in rows.values()] == [("ok", float(i)) for i in range(30)], rows
    assert max(sizes) <= 20 and sum(sizes) == 30 and left == [], sizes
