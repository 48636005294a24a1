"""What a cluster leaves on a host's disk, without Ray: a killed ``smolbench cluster local``'s
folder is swept by the next one (only a dead owner's), and a node's artifacts stay while any
machine or call still needs them (one content address, many uses)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from clusterhelpers import Remote

from smolbench.backends._procs import start_time
from smolbench.cluster import local
from smolbench.errors import SmolbenchError


def _owned_by(folder: Path, pid: int) -> Path:
    folder.mkdir(mode=0o700)
    (folder / "auth_token").write_text("x" * 64)
    (folder / "ray" / "session_1" / "logs").mkdir(parents=True)
    (folder / "owner").write_text(f"{pid} {start_time(pid)}\n")
    return folder


def test_a_killed_local_clusters_folder_goes_with_its_ray_processes_never_a_live_ones(tmp_path: Path) -> None:
    """The audit: a ``smolbench cluster local`` killed with kill -9 left its ``sbray-*`` folder
    (token, Ray's logs, nodes' run folders) for good. Its owner is recorded now, as a run folder's."""
    dead_owner = subprocess.Popen([sys.executable, "-c", "pass"])
    dead = _owned_by(tmp_path / "sbray-dead0001", dead_owner.pid)
    dead_owner.wait()  # gone: its pid and start time no longer match a process
    live_owner = subprocess.Popen(["sleep", "600"])
    # a Ray process of the killed cluster, still dying: marked as its own, as a LocalCluster marks them
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", f"{dead}/ray/raylet"],
                             env={**os.environ, local.MARK_ENV: local._mark_of(dead)})
    try:
        live = _owned_by(tmp_path / "sbray-live0001", live_owner.pid)
        older = tmp_path / "sbray-older001"  # made before owners were recorded: whose, nobody knows
        older.mkdir()
        other = _owned_by(tmp_path / "smolbench-run0001", dead_owner.pid)  # not a cluster's
        assert local.sweep_killed(str(tmp_path)) == [dead]
        assert not dead.exists() and (live / "auth_token").exists() and older.exists() and other.exists()
        assert stray.wait(timeout=10) == -9  # killed before its folder went
    finally:
        for p in (live_owner, stray):
            p.kill()
            p.wait()


# what a LocalCluster marks its Ray processes with (local.MARK_ENV), written out: the test below
# reads the same against a smolbench from before the mark (its strays would live if they differed)
MARK_ENV = "SMOLBENCH_RAY_CLUSTER"


def _as(procs: list[subprocess.Popen[bytes]], argv0: str, *, mark: str | None = None,
        then: tuple[str, ...] = ("sleep", "600")) -> subprocess.Popen[bytes]:
    """A process (added to ``procs``) whose command line starts with ``argv0`` (``exec -a``),
    marked as the cluster in ``mark``'s, as a LocalCluster's Ray processes are, when given."""
    env = {k: v for k, v in os.environ.items() if k != MARK_ENV}
    if mark is not None:
        env[MARK_ENV] = mark
    procs.append(subprocess.Popen(["bash", "-c", 'exec -a "$0" "$@"', argv0, *then], env=env))
    deadline = time.monotonic() + 10
    while not Path(f"/proc/{procs[-1].pid}/cmdline").read_bytes().startswith(argv0.encode() + b"\0"):
        assert time.monotonic() < deadline, "bash did not exec"
        time.sleep(0.01)
    return procs[-1]


def test_a_crafted_cluster_folder_kills_no_process_but_the_dead_clusters_own(tmp_path: Path) -> None:
    """The audit: an ``sbray-q`` folder whose owner is gone made the sweep SIGKILL every process of
    this user whose command line held its path as a plain substring (a live cluster's raylet in
    ``sbray-qlivecl1``, a ``tail -f`` of a file in the folder), and every ``ray::`` worker whose
    environment did. Only a process marked as exactly that cluster's (MARK_ENV) dies now."""
    base = Path(os.path.realpath(tmp_path))
    dead = base / "sbray-q"
    dead.mkdir(mode=0o700)
    (dead / "log").write_text("a dead cluster's log\n")
    (dead / "owner").write_text("999999 12345\n")  # a pid and start time that are no process
    procs: list[subprocess.Popen[bytes]] = []
    try:
        live = _owned_by(base / "sbray-qlivecl1", _as(procs, "sleep").pid)  # a live cluster: its name starts with sbray-q
        spared = [
            _as(procs, f"raylet --temp-dir={live}/ray", mark=str(live)),  # the live cluster's raylet and worker
            _as(procs, "ray::IDLE", mark=str(live)),
            _as(procs, "tail", then=("tail", "-f", str(dead / "log"))),  # names a file in the dead folder
            _as(procs, f"vi --file={dead}/log"),
            _as(procs, str(dead)),  # its first argument is the dead folder itself
            _as(procs, "ray::IDLE", mark=f"{dead}/ray"),  # marked as another folder than the dead one
        ]
        strays = [_as(procs, f"raylet --temp-dir={dead}/ray", mark=str(dead)), _as(procs, "ray::IDLE", mark=str(dead))]
        assert local.sweep_killed(str(base)) == [dead]
        assert not dead.exists() and live.exists()
        assert [p.poll() for p in spared] == [None] * len(spared), "the sweep killed a process not its own"
        assert [p.wait(timeout=10) for p in strays] == [-9, -9]  # the dead cluster's own still die
    finally:
        for p in procs:
            p.kill()
            p.wait()


async def _awaited(aw: Any) -> Any:
    return await aw


def test_two_restores_of_the_same_bytes_on_one_node_share_a_file_that_stays_while_either_needs_it(
        tmp_path: Path) -> None:
    """The suspected case, real: two uses of identical bytes on a node share a content address,
    and the driver's ``forget`` after a restore that failed (here the second restore of one smol
    checkpoint) dropped the file the first restored microVM still reads. Uses are counted now."""
    from smolbench.backends.base import MachineRef
    from smolbench.cluster import artifact, shipping
    from smolbench.cluster.agent import NodeAgent
    from smolbench.spec import MachineSpec

    class Backend:
        name = "smol"

        def __init__(self) -> None:
            self.read_from: dict[str, str] = {}

        async def restore(self, path: str, name: str, spec: MachineSpec) -> MachineRef:
            if name == "broken":
                raise SmolbenchError("the restore failed")
            self.read_from[name] = path
            return MachineRef(name, "smol", spec)

        async def delete(self, ref: MachineRef) -> None:
            self.read_from.pop(ref.name, None)

        def list(self) -> list[MachineRef]:
            return [MachineRef(n, "smol", MachineSpec()) for n in self.read_from]

    (tmp_path / "store").mkdir()
    agent = NodeAgent.__new__(NodeAgent)
    agent.store = artifact.Store(tmp_path / "store")
    agent._incoming, agent._closed, agent.refs, agent.sources, agent.exports = {}, set(), {}, {}, {}
    agent.uses, agent._booting, agent._forking = Counter(), {}, {}
    agent.refused, agent.max_starts, agent._starts, agent.node_id = "", 2, None, "n1" * 8
    agent.calls, agent.requests = Counter(), Counter()
    agent.backend = Backend()
    node = SimpleNamespace(id="n1", lost=False, backend="smol", slots=4, live=set(), agent=Remote(agent))

    def adopt(node: Any, name: str, spec: MachineSpec, parent: Any, **info: Any) -> MachineRef:
        node.live.add(name)
        return MachineRef(name, "cluster", spec, info={"node": node.id, **info})

    cb = SimpleNamespace(_call=lambda node, aw: _awaited(aw), _alive=lambda: [node], nodes={"n1": node}, _adopt=adopt)
    ckpt = tmp_path / "warm.smolcheckpoint"
    ckpt.write_bytes(b"a whole microVM, as smol exports it" * 100)
    digest = artifact.hash_file(ckpt)[0]

    async def main() -> None:
        await shipping.restore(cb, str(ckpt), "a", MachineSpec())  # type: ignore[arg-type]
        assert agent.store.has(digest)  # the microVM reads it while it lives
        with pytest.raises(SmolbenchError, match="the restore failed"):
            await shipping.restore(cb, str(ckpt), "broken", MachineSpec())  # type: ignore[arg-type]
        assert agent.store.has(digest), "a's checkpoint was dropped under it"
        await shipping.restore(cb, str(ckpt), "b", MachineSpec())  # type: ignore[arg-type]
        await agent.delete(["a"])
        assert agent.store.has(digest)  # b still reads it
        await agent.delete(["b"])
        assert not agent.store.has(digest) and agent.uses.get(digest, 0) == 0  # nothing needs it: gone

    asyncio.run(main())
