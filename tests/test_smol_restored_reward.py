"""A microVM restored whole from a checkpoint reports a `reward` only once its own cells set one
(fake engine: tests/fakesmol.py, whose restore copies the agent's memory as a snapshot does).

A teacher's checkpoint held `reward = 45`; a student's first cell in the restored machine
was recorded with the teacher's 45 in the tree and the ledger. The namespace restore of the
other backends already said nothing until a cell set one; a whole-machine restore woke the
agent with its memory as it was, so it went on reporting.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fakesmol import FakeHost, backend, fake_host, run

from smolbench.backends.base import CellRequest, CellResult, MachineRef
from smolbench.backends.smol import SmolBackend
from smolbench.spec import MachineSpec


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHost]:
    yield from fake_host(monkeypatch)


async def cell(b: SmolBackend, ref: MachineRef, code: str) -> CellResult:
    res = await b.exec_cell(ref, CellRequest(code=code, cell_name="<cell-1>"), lambda ev: None)
    assert res.status == "ok", res.error
    return res


def test_a_whole_machine_restore_reports_no_reward_until_a_cell_sets_one(host: FakeHost, tmp_path: Path) -> None:
    b = backend()
    store = tmp_path / "store"
    store.mkdir()

    async def main() -> list[Any]:
        try:
            root = await b.create(MachineSpec(), "root")
            assert (await cell(b, root, "reward = 45")).reward == 45
            # smol's own capture: the agent's memory frozen as it is (the fake forks the agent
            # into it), which a restore wakes up whole, as a real microVM snapshot does
            captured = [str(tmp_path / f"capture-{k}") for k in range(2)]
            for path in captured:
                b._handle(root).checkpoint(path, store=str(store))
            back = await b.restore(captured[0], "student", MachineSpec())
            first = await cell(b, back, "x = reward + 1")  # the teacher's value is there to use
            same = await cell(b, back, "reward = 45")  # set here, even to the value restored
            later = await cell(b, back, "y = 2")
            again = await b.restore(captured[1], "student2", MachineSpec())
            other = await cell(b, again, "reward = 3")
            x = (await cell(b, back, "x")).result
            return [first.reward, x and x["text/plain"], same.reward, later.reward, other.reward]
        finally:
            await b.close()

    assert run(main()) == [None, "46", 45, 45, 3]
