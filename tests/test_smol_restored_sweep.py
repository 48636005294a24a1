"""Audit: a smol VM a node agent restored (``restore_checkpoint`` takes no labels) carried no
label of its agent, so once that agent died (its kernel killed) the next agent's sweep never
found it. An agent now records each one's name in its own folder before it is made, and the
sweep deletes those of agents whose owner is gone."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakesmol import FakeHost, fake_host


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHost]:
    yield from fake_host(monkeypatch)


def test_a_vm_a_dead_agent_restored_is_swept_by_the_next_agent(host: FakeHost, tmp_path: Path) -> None:
    from smolbench.backends import _rundir
    from smolbench.backends.smol import SmolBackend
    from smolbench.cluster import agent
    from smolbench.spec import MachineSpec

    host.cls.delete_by_name.side_effect = host.delete_named  # type: ignore[attr-defined]
    dead = _rundir.make(str(tmp_path), prefix="smolbench-agent-")
    alive = _rundir.make(str(tmp_path), prefix="smolbench-agent-")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()

    async def go() -> tuple[list[str], str, str, list[str]]:
        old, mine = SmolBackend(probe=False, session="old"), SmolBackend(probe=False, session="mine")
        for b, own in ((old, dead), (mine, alive)):
            b.extra_labels = {agent.AGENT_LABEL: str(own)}
            b.unlabelled = lambda name, own=own: agent._record(own, name)
        try:
            root = await old.create(MachineSpec(), "root")
            await old.checkpoint(root, str(ckpt / "a.smolcheckpoint"))
            await old.checkpoint(root, str(ckpt / "b.smolcheckpoint"))
            back = await old.restore(str(ckpt / "a.smolcheckpoint"), "back", MachineSpec())
            keep = await mine.restore(str(ckpt / "b.smolcheckpoint"), "keep", MachineSpec())
            (dead / "owner").write_text("1 0\n")  # pid 1 did not start at 0: this agent is gone
            gone = await asyncio.to_thread(agent.sweep_smol, tmp_path)
            left = [m.name for m in host.list()]  # type: ignore[attr-defined]
            return gone, back.info["machine"], keep.info["machine"], left
        finally:
            await mine.close()
            await old.close()

    gone, back, keep, left = asyncio.run(go())
    assert not host.list({"smolbench-agent": str(dead)}) and back in gone  # type: ignore[attr-defined]
    assert left == [keep]  # a live agent's restored VM stays
    assert (dead / agent.RESTORED).read_text().split() == [back]
