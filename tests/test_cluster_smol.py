"""Issue 20 on smol nodes: a warm parent reaches another node as a portable checkpoint.

A throwaway cluster (a head with 0 CPUs plus two nodes declared ``smol``, 4 machine slots
each, each with its own data folder) whose node agents run the fake smol engine
(``tests/fakesmol.py``: ``create_autospec`` doubles of the real SDK, its VMs real agent
processes in folders of the node's data folder). A Ray worker can't be monkeypatched by
this test, so the nodes get the tests-only switch ``SMOLBENCH_TEST_FAKE_SMOL`` (the folder of
fakesmol.py) in their environment, which the node agent reads where it makes its backend.
The fake's export is a portable file its restore reads in another process: the VM's folder
and its agent's saved namespace (what pickles), so state crosses nodes as bytes only.
The real SDK's round trip is checked by tests/test_smol_real_vm.py on real microVMs.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from clusterhelpers import machine_processes, ok
from nbhelpers import NotebookSession, notices, stream_text

from smolbench import Ledger
from smolbench.errors import SmolbenchError

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'jupyterlab-smolbench[ray]'")
pytestmark = pytest.mark.timeout(900)  # the first test includes starting the cluster

CELL = "import random\nprint('seed', SEED, flush=True)\nreward = x + random.random()"


def expected(seed: int, base: float = 41) -> float:
    """What a branch with ``seed`` reports on any backend: its seed is applied before the cell runs
    (tests/test_cluster.py checks a local fork against the same numbers)."""
    return base + random.Random(seed).random()


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    from smolbench.cluster.agent import FAKE_SMOL
    from smolbench.cluster.local import LocalCluster

    t0 = time.monotonic()
    with LocalCluster(2, slots=4, backends=["smol"], env={FAKE_SMOL: str(Path(__file__).parent)}) as c:
        print(f"\ncluster up in {time.monotonic() - t0:.1f} s")
        yield c
    assert machine_processes(c) == []




def artifacts(c: object) -> list[list[Path]]:
    """Per node, the artifacts its agents hold (portable checkpoints made or fetched)."""
    return [sorted(d.glob("smolbench-agent-*/artifacts/*")) for d in c.node_dirs]  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def nb(cluster: object) -> Iterator[NotebookSession]:
    cwd = Path(tempfile.mkdtemp(prefix="smolbench-smolcluster-"))
    cwd.chmod(0o711)
    try:
        with NotebookSession(cwd, timeout=300, allow_errors=True) as session:
            ok(session.run("%load_ext smolbench"))
            up = ok(session.run(f"%smol up --ray {cluster.address}"))  # type: ignore[attr-defined]
            assert "cluster: 2 nodes, 8 machine slots" in stream_text(up)
            ok(session.run("%%smol\nx = 41"))
            yield session
    finally:
        shutil.rmtree(cwd, ignore_errors=True)



def ledger_rows(cwd: Path) -> tuple[object, list[dict[str, object]]]:
    led = Ledger(cwd / ".smolbench" / "ledger.db")
    try:
        return led.nodes().set_index("id"), led.replica_rows()
    finally:
        led.close()


def test_a_fork_across_smol_nodes_ships_the_parent_once_per_state_as_a_portable_checkpoint(
        nb: NotebookSession, cluster: object) -> None:
    cell = ok(nb.run(f"%%smol fork 8 --keep none\n{CELL}"))
    df, reps = ledger_rows(nb.cwd)
    run = df.loc[[f"root.{k}" for k in range(8)]]  # type: ignore[attr-defined]
    why = notices(cell) + stream_text(nb.run("%smol status"))
    assert list(run.status) == ["ok"] * 8 and run.host_node.nunique() == 2, why  # both nodes ran a batch
    assert list(run.seed) == list(range(8))  # seeds assigned globally, wherever a branch ran
    assert run.reward.tolist() == pytest.approx([expected(k) for k in range(8)])
    assert len(reps) == 1 and reps[0]["parent_id"] == "root"
    assert reps[0]["bytes_shipped"] > 0 and reps[0]["seconds"] > 0 and reps[0]["fingerprint"]
    assert "replicated to node" in notices(cell) and "from its portable checkpoint" in notices(cell)
    status = stream_text(ok(nb.run("%smol status")))
    assert status.count(" smol: up, 4 slots") == 2
    assert f"replica of root ({reps[0]['bytes_shipped']} B shipped as a portable checkpoint" in status
    held = artifacts(cluster)
    assert sorted(len(h) for h in held) == [1, 1]  # exported once on the parent's node, fetched once
    assert {h[0].name for h in held} == {held[0][0].name}  # the same content address on both
    assert sum(h[0].stat().st_size for h in held) == 2 * reps[0]["bytes_shipped"]

    # cached until the parent runs another cell: nothing is shipped again
    ok(nb.run(f"%%smol fork 8 --keep none\n{CELL}"))
    assert len(ledger_rows(nb.cwd)[1]) == 1 and artifacts(cluster) == held
    ok(nb.run("%%smol\nx = 100"))
    ok(nb.run(f"%%smol fork 8 --keep none\n{CELL}"))
    df, reps = ledger_rows(nb.cwd)
    assert len(reps) == 2 and reps[1]["cells"] == reps[0]["cells"] + 1
    run = df.loc[[f"root.{k}" for k in range(16, 24)]]  # type: ignore[attr-defined]
    assert run.reward.tolist() == pytest.approx([expected(k, 100) for k in range(8)])
    now = artifacts(cluster)
    assert sorted(len(h) for h in now) == [1, 1] and now != held  # the old state's copies were dropped
    ok(nb.run("%%smol\nx = 41"))


def test_a_checkpoint_of_a_smol_cluster_machine_comes_to_the_driver_and_restores_on_a_node(
        nb: NotebookSession) -> None:
    ok(nb.run("%%smol\nsaved = 'before'"))
    out = stream_text(ok(nb.run("%smol checkpoint save s1")))
    assert "saved checkpoint s1 of root" in out
    path = nb.cwd / ".smolbench" / "checkpoints" / "s1.smolcheckpoint"
    assert path.is_file() and path.stat().st_size > 0  # here, on the driver, as a file
    ok(nb.run("%%smol\nsaved = 'after'"))
    ok(nb.run("%smol checkpoint restore s1"))
    assert stream_text(ok(nb.run("%%smol\nprint(saved, x)"))).strip() == "before 41"
    df, _ = ledger_rows(nb.cwd)
    assert df.loc["r1-s1"].host_node  # type: ignore[attr-defined]  # restored onto a node
    ok(nb.run("%smol use root"))


def test_a_tampered_portable_checkpoint_is_refused_in_one_line(cluster: object) -> None:
    """The attack: the parent's artifact changes after its node took its content address (at rest
    or on the way). The other node's agent refuses it in one line and keeps nothing. This test
    is a second driver of its own; archive.TEST_WEAKEN's ``digest`` switch (tests/test_cluster_units.py)
    shows the same bytes kept when the check is off."""
    from smolbench.backends.base import CellRequest
    from smolbench.cluster import shipping
    from smolbench.cluster.backend import ClusterBackend
    from smolbench.spec import MachineSpec

    cb = ClusterBackend(cluster.address, session="tamper")  # type: ignore[attr-defined]
    cb.start()

    async def go() -> str:
        a, b = list(cb.nodes.values())
        try:
            ref = await cb.create(MachineSpec(), "t", node_id=a.id)
            await cb.exec_cell(ref, CellRequest("x = 1"), lambda ev: None)
            art = await shipping.export(cb, ref, ("t", 1))
            [victim] = [p for h in artifacts(cluster) for p in h if p.name == art["digest"]]
            data = bytearray(victim.read_bytes())
            data[len(data) // 2] ^= 1
            victim.write_bytes(bytes(data))
            with pytest.raises(SmolbenchError) as refused:
                await cb._call(b, b.agent.fetch.remote(a.agent, art["digest"], art["size"], f"node {a.id[:8]}"))
            kept = [p for h in artifacts(cluster) for p in h if p.name == art["digest"] or p.name.startswith(".part")]
            assert kept == [victim]  # the other node kept nothing, not even a part
            return str(refused.value)
        finally:
            await cb.close()

    try:
        line = asyncio.run(go())
    finally:
        ray.shutdown()
    assert "doesn't match its content address" in line and "refused" in line and "\n" not in line, line


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    from fakesmol import fake_host

    yield from fake_host(monkeypatch)


def test_a_smol_node_agent_deletes_microvms_of_dead_agents_found_by_label(host: object, tmp_path: Path) -> None:
    """A killed kernel takes its node agents with it (Ray ends them) but not their microVMs: smol
    runs those apart from the process that made them. Each carries the label of its agent's folder;
    the next agent on the node deletes those whose folder's owner is gone, branches first, and
    leaves a live agent's alone."""
    from smolbench.backends import _rundir
    from smolbench.backends.smol import SmolBackend
    from smolbench.cluster.agent import AGENT_LABEL, sweep_smol
    from smolbench.spec import MachineSpec

    host.cls.delete_by_name.side_effect = host.delete_named  # type: ignore[attr-defined]
    dead = _rundir.make(str(tmp_path), prefix="smolbench-agent-")
    (dead / "owner").write_text("1 0\n")  # pid 1 did not start at 0: this owner is gone
    alive = _rundir.make(str(tmp_path), prefix="smolbench-agent-")

    async def go() -> tuple[list[str], list[str], list[str]]:
        old, mine = SmolBackend(probe=False, session="old"), SmolBackend(probe=False, session="mine")
        old.extra_labels, mine.extra_labels = {AGENT_LABEL: str(dead)}, {AGENT_LABEL: str(alive)}
        try:
            root = await old.create(MachineSpec(), "root")
            kid = (await old.branch(root, ["root.0"], [0]))[0]
            keep = await mine.create(MachineSpec(), "keep")
            gone = await asyncio.to_thread(sweep_smol)
            left = [m.name for m in host.list()]  # type: ignore[attr-defined]
            return gone, [kid.info["machine"], root.info["machine"], keep.info["machine"]], left
        finally:
            await mine.close()
            await old.close()  # what is gone already is not an error

    gone, (kid, root, keep), left = asyncio.run(go())
    assert gone == [kid, root]  # the branch first: smol refuses a parent whose branches exist
    assert left == [keep]
