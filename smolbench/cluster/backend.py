"""ClusterBackend: the Backend protocol on the driver, machines on Ray nodes.

Each machine lives on one node and is driven by that node's agent (agent.py). A fork
is split into one contiguous batch per node (placement.py); nodes other than the warm
parent's get a replica of it first (replica.py), cached until the parent runs another
cell. A cell's reply arrives as raw byte chunks of a Ray streaming generator and goes to
:func:`smolbench.gate.read_cell` here, so output streams live and nothing a machine made
is unpickled on the driver. A node that is lost raises InfraError, so the Workbench
re-runs its branches elsewhere under ``--retries``.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import gate
from .._aio import _to_the_end
from ..backends._wire import RequestIds, exec_message, interrupt_message
from ..backends.base import Backend, CellRequest, CellResult, CheckpointInfo, MachineRef, OnEvent
from ..errors import InfraError, SmolbenchError
from ..spec import MachineSpec
from . import SLOTS, address, placement, shipping
from .agent import NodeAgent, node_kind
from .batch import MESSAGES_AHEAD, Batcher
from .replica import FINGERPRINT_CODE, Recipe

FINGERPRINT = re.compile(r"[0-9a-f]{16}")  # what replica.FINGERPRINT_CODE prints


@dataclass
class Replica:
    """A copy of a warm parent's state on another node."""

    ref: MachineRef
    key: tuple[str, int]
    fingerprint: str
    bytes_shipped: int
    seconds: float
    children: set[str] = field(default_factory=set)
    stale: bool = False
    how: str = "replay"  # or "checkpoint": a smol parent's portable checkpoint, restored there
    digest: str = ""  # the checkpoint's content address (how == "checkpoint")


@dataclass
class Node:
    """One Ray node with an agent."""

    id: str
    agent: Any
    slots: int
    backend: str = "?"
    host: str = ""
    live: set[str] = field(default_factory=set)
    lost: bool = False
    calls: dict[str, int] = field(default_factory=dict)  # the agent's calls by kind (as of the last status)
    requests: dict[str, int] = field(default_factory=dict)  # ... and the machine requests they carried
    limits: dict[str, float] | None = None  # the kernel's gate limits this agent was last given
    reviving: bool = False  # a new agent on a node whose agent was lost: lost until it answers


def _short(node_id: str) -> str:
    return node_id[:8]


class ClusterBackend(Backend):
    """Machines on the nodes of a Ray cluster, one node agent each."""

    name = "cluster"

    def __init__(self, ray_address: str | None = None, *, session: str | None = None, max_starts: int = 2,
                 batching: bool = True, source: str | None = None) -> None:
        self.source = source  # the Smolfile that named the address (its errors say so), None for --ray
        self.address = address.resolve(ray_address, source)
        self.session = session or uuid.uuid4().hex[:8]
        self.max_starts = max_starts
        self.nodes: dict[str, Node] = {}
        self._machines: dict[str, MachineRef] = {}
        self.replicas: dict[tuple[str, str], Replica] = {}  # (parent, node) -> replica
        self._fingerprints: dict[tuple[str, int], str] = {}
        self.recipe_for: Callable[[str], Recipe] | None = None  # set by the Workbench: a node's recorded path
        self.on_replica: Callable[[str, str, Replica], None] = lambda parent, node, rep: None
        self.notes: list[str] = []
        self.refused: list[str] = []  # nodes that run no machines, why (an `auto` node without bubblewrap)
        self.bytes_in = 0
        self._looked = 0.0
        self._limits: dict[str, tuple[MachineSpec, str]] = {}  # node -> (spec, its limits line)
        self._pushing: asyncio.Future[Any] | None = None  # the gate limits on their way to agents
        self._batchers: dict[tuple[str, str], Batcher] = {}
        self._agents_started: dict[str, int] = {}  # node -> agents started there after its first was lost
        self._ids = RequestIds()  # the cells' ids, numbered here: an interrupt names the one it is meant for
        self.batching = batching  # off: one agent call per machine request (bench/ measures the difference)

    # -- joining ----------------------------------------------------------------------

    def start(self) -> None:
        """Join the cluster and start one agent per node that offers machine slots."""
        import ray

        self.address = address.connect(self.address, self.source)  # where it is joined, as Ray names it
        address.joined_by(self)
        new = self._new_agents()
        if not new:
            raise SmolbenchError(f"the Ray cluster at {self.address} has no node with `{SLOTS}`: start nodes with "
                                 f"`ray start --address ... --resources '{{\"{SLOTS}\": 8}}'` (or `smolbench cluster local`)")
        for d in ray.get([n.agent.describe.remote() for n in new], timeout=300):
            self._described(d)
        if not self._alive():
            raise SmolbenchError(self.refused[0] if self.refused else f"no node of the Ray cluster at {self.address} "
                                 "runs machines")

    def _new_agents(self, lost_only: bool = False) -> builtins.list[Node]:
        """An agent on every live node with slots that has none yet (pinned there: hard node affinity),
        and a new one on a node whose agent was lost while Ray still counts the node alive (its agent
        died, not its raylet): it sweeps what the dead one left, and runs machines there again.
        ``lost_only``: only those."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._looked = time.monotonic()
        actor = ray.remote(NodeAgent)
        new = []
        for n in address.nodes():
            nid = n["NodeID"]
            old = self.nodes.get(nid)
            # not a node refused, nor one whose agent never started (it would fail again)
            again = old is not None and old.lost and old.backend not in ("refused", "starting")
            if (old is None and lost_only) or (old is not None and not again):
                continue
            name = f"smolbench-{self.session}-{_short(nid)}"
            if old is not None:
                with contextlib.suppress(Exception):  # it may live on unheard (a lost call): it goes, and its machines
                    ray.kill(old.agent)
                for key in [k for k in self._batchers if k[0] == nid]:  # they call the old agent
                    self._batchers.pop(key)
                self._limits.pop(nid, None)
                self._agents_started[nid] = self._agents_started.get(nid, 0) + 1
                name += f"-{self._agents_started[nid]}"  # the old name may not be free yet
                self.notes.append(f"node {_short(nid)} is still up: a new agent there deletes what the lost one "
                                  "left and runs machines again")
            handle = actor.options(
                num_cpus=0, max_restarts=0, name=name,
                scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False),
            ).remote(self.session, node_kind(n.get("Resources", {})), self.max_starts, limits := gate.limits.snapshot())
            # a node lost a moment ago may still count as alive (Ray notices a dead node after
            # seconds): it stays listed, and LOST, until its new agent answers
            self.nodes[nid] = Node(nid, handle, int(n["Resources"][SLOTS]), backend="starting", limits=limits,
                                   host=old.host if old is not None else "", lost=old is not None,
                                   reviving=old is not None)
            new.append(self.nodes[nid])
        return new

    async def _limits_to_agents(self) -> None:
        """Every agent checks what its machines send with the kernel's limits: after a
        ``%smol config``, the next request to any node carries them there first (a node a
        push failed for, or whose caller was interrupted, is given them by the next one)."""
        if self._pushing is not None and not self._pushing.done():  # one push at a time (shielded: see below)
            await asyncio.shield(self._pushing)
        now = gate.limits.snapshot()
        behind = [n for n in self._alive() if n.limits != now]
        if not behind:
            return

        async def give(node: Node) -> None:
            await self._call(node, node.agent.set_limits.remote(now))
            node.limits = now

        # shielded: a caller's Ctrl-C must not cancel the push every later request relies on
        self._pushing = asyncio.ensure_future(asyncio.gather(*(give(n) for n in behind), return_exceptions=True))
        await asyncio.shield(self._pushing)

    def _described(self, d: dict[str, Any]) -> None:
        node = self.nodes[d["node"]]
        node.backend, node.host = d["backend"], d["host"]
        if node.reviving:  # its new agent answered: the node runs machines again
            node.reviving = node.lost = False
        if d.get("refused"):  # never given a machine (`%smol status` lists it as LOST)
            node.backend = "refused"
            if not node.lost:
                node.lost = True
                self.refused.append(str(d["refused"]))
                self.notes.append(str(d["refused"]))
        node.calls, node.requests = dict(d.get("calls", {})), dict(d.get("requests", {}))
        if d["swept"]:
            self.notes.append(f"node {_short(node.id)} deleted {len(d['swept'])} leftover run folder(s) of dead sessions")
        if d.get("swept_machines"):
            self.notes.append(f"node {_short(node.id)} deleted {len(d['swept_machines'])} leftover microVM(s) of "
                              "dead sessions")

    async def refresh(self, every: float = 5.0) -> None:
        """Nodes that joined since we looked get an agent (at most every ``every`` seconds; a fork
        and ``%smol status`` look every time, so a node added by then is used and listed)."""
        if time.monotonic() - self._looked < every:
            return
        new = await asyncio.to_thread(self._new_agents)
        await asyncio.gather(*(self._describe(node, joined=True) for node in new))

    async def _describe(self, node: Node, joined: bool = False) -> None:
        try:
            self._described(await self._call(node, node.agent.describe.remote()))
        except SmolbenchError as exc:  # a lost node is marked lost by _call
            if joined:
                self._lose(node)
                self.notes.append(f"node {_short(node.id)} has no agent: {exc}")

    async def poll(self, timeout: float = 30.0) -> None:
        """Before ``%smol status``: agents for new nodes, every agent's counts, lost nodes found."""
        await self.refresh(every=0)
        with contextlib.suppress(asyncio.TimeoutError):  # a node that doesn't answer is shown as it was
            await asyncio.wait_for(asyncio.gather(*(self._describe(n) for n in self._alive())), timeout)

    def _alive(self) -> list[Node]:
        return [n for n in self.nodes.values() if not n.lost and n.backend != "starting"]

    def free(self) -> dict[str, int]:
        """Free machine slots per live node."""
        return {n.id: n.slots - len(n.live) for n in self._alive()}

    def slots(self) -> int:
        """Machine slots of the live nodes together (how many branches run at once by default)."""
        return sum(n.slots for n in self._alive())

    def _kinds(self) -> dict[str, int]:
        """Live nodes per backend kind."""
        out: dict[str, int] = {}
        for n in self._alive():
            out[n.backend] = out.get(n.backend, 0) + 1
        return dict(sorted(out.items()))

    @property
    def isolation(self) -> str:
        kinds = self._kinds()
        return "per node: " + (", ".join(f"{k} on {v} node{'s' if v != 1 else ''}" for k, v in kinds.items())
                               or "no live node")

    @property
    def image_default(self) -> str:
        """What ``%smol status`` says for the image when the Smolfile names none."""
        from ..status import _default_image

        parts = [f"{k}: {(_default_image(k) or 'its default').strip('()').removeprefix('backend default: ')}"
                 for k in self._kinds()]
        return f"(each node's backend default: {'; '.join(parts) or 'no live node'})"

    def limits_status(self, spec: MachineSpec) -> str:
        """The limits each live node enforces for ``spec`` (asked of its agent once per spec)."""
        import ray

        alive = self._alive()
        todo = [n for n in alive if self._limits.get(n.id, (None, ""))[0] != spec]
        if todo:
            try:
                texts = ray.get([n.agent.limits.remote(spec) for n in todo], timeout=30)
            except Exception as exc:  # a slow or lost node: say so, ask again next time
                return f"per node: not known ({type(exc).__name__}: {exc})"
            for n, text in zip(todo, texts):
                self._limits[n.id] = (spec, str(text))
        by_text: dict[str, list[Node]] = {}
        for n in alive:
            by_text.setdefault(self._limits[n.id][1], []).append(n)
        if len(by_text) == 1:
            (text, nodes), = by_text.items()
            kinds = ", ".join(sorted({n.backend for n in nodes}))
            return f"on each of the {len(nodes)} {kinds} node{'s' if len(nodes) != 1 else ''}: {text}"
        return "; ".join(f"node{'s' if len(ns) != 1 else ''} {', '.join(_short(n.id) for n in ns)} "
                         f"({ns[0].backend}): {text}" for text, ns in by_text.items()) or "no live node"

    # -- calling agents -----------------------------------------------------------------

    async def _call(self, node: Node, ref: Any) -> Any:
        import ray

        try:
            return await ref
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(getattr(exc, "cause", None), BaseException) else None
            if isinstance(cause, SmolbenchError):
                raise type(cause)(str(cause)) from None
            raise SmolbenchError(f"node {_short(node.id)}: {cause or exc}") from None
        except ray.exceptions.RayError as exc:
            self._lose(node)
            raise InfraError(f"node {_short(node.id)} was lost ({type(exc).__name__})") from None

    def _lose(self, node: Node) -> None:
        if not node.lost:
            node.lost = True
            self.notes.append(f"node {_short(node.id)} ({node.backend}) was lost; its machines are gone")
            for ref in [m for m in self._machines.values() if m.info.get("node") == node.id]:
                self._machines.pop(ref.name, None)
            for key in [k for k in self.replicas if k[1] == node.id]:
                self.replicas.pop(key, None)
            node.live.clear()

    def _node_of(self, machine: MachineRef) -> Node:
        node = self.nodes.get(machine.info.get("node", ""))
        if node is None or node.lost or machine.name not in self._machines:
            raise InfraError(f"machine {machine.name} is gone with its node "
                             f"{_short(machine.info.get('node', '?'))}")
        return node

    def _adopt(self, node: Node, name: str, spec: MachineSpec, parent: str | None, **info: Any) -> MachineRef:
        ref = MachineRef(name, self.name, spec, parent=parent,
                         info={"node": node.id, "node_backend": node.backend, "root": name if parent is None else None, **info})
        self._machines[name] = ref
        node.live.add(name)
        return ref

    def _batcher(self, node: Node, op: str) -> Batcher:
        """Requests of kind ``op`` to ``node`` made in the same moment go as one agent call (batch.py)."""
        key = (node.id, op)
        if key not in self._batchers:
            def start(batch_id: str, items: builtins.list[tuple[str, Any]]) -> Any:
                return node.agent.run_batch.options(_generator_backpressure_num_objects=MESSAGES_AHEAD).remote(
                    batch_id, op, items)

            def cancel(batch_id: str, indices: builtins.list[int]) -> None:
                node.agent.cancel_requests.remote(batch_id, indices)

            def grant(batch_id: str, index: int, n: int) -> None:
                node.agent.grant.remote(batch_id, index, n)

            async def call(ref: Any) -> Any:
                return await self._call(node, ref)

            def count(n: int) -> None:
                self.bytes_in += n

            self._batchers[key] = Batcher(start, call, cancel, count, batching=self.batching, grant=grant)
        return self._batchers[key]

    # -- the Backend protocol -------------------------------------------------------------

    async def create(self, spec: MachineSpec, name: str, node_id: str | None = None) -> MachineRef:
        await self._limits_to_agents()
        if node_id is None:
            await self.refresh()
        free = self.free()
        if not free:
            raise InfraError("no live Ray node offers machine slots")
        node = self.nodes[node_id or placement.least_loaded(free)]
        node.live.add(name)  # counted while it boots
        try:
            # its caller gone, the node boots on (within the grace, or the boot ended first): its
            # delete stops the boot or deletes what it made
            async with shipping.undone_if_left(node, lambda: self._call(node, node.agent.delete.remote([name]))):
                await self._batcher(node, "create").submit(name, spec).result()
        except BaseException:
            node.live.discard(name)
            raise
        return self._adopt(node, name, spec, None)

    async def exec_cell(self, machine: MachineRef, request: CellRequest, on_event: OnEvent) -> CellResult:
        await self._limits_to_agents()
        node = self._node_of(machine)
        item = self._batcher(node, "exec").submit(machine.name, exec_message(request, self._ids.cell(machine.name)))
        async with contextlib.aclosing(item.chunks()) as chunks:
            return await gate.read_cell(chunks, request, on_event, machine.name, scope=machine.token)

    async def interrupt(self, machine: MachineRef) -> None:
        """Stop the last cell sent to ``machine`` if it still runs when its node's agent hears
        of it (a Ray call may come late): never a later one."""
        rid = self._ids.last(machine.name)
        if rid is None:
            return
        with contextlib.suppress(SmolbenchError):
            node = self._node_of(machine)
            await self._call(node, node.agent.control.remote(machine.name, interrupt_message(rid)))

    async def delete(self, machine: MachineRef) -> None:
        ref = self._machines.pop(machine.name, None)
        if ref is None:
            return
        self._ids.forget(ref.name)
        node = self.nodes.get(ref.info.get("node", ""))
        for child in [m for m in self._machines.values() if m.parent == ref.name]:
            await self.delete(child)
        if node is not None:
            node.live.discard(ref.name)
            if not node.lost:
                with contextlib.suppress(SmolbenchError):
                    await self._batcher(node, "delete").submit(ref.name, None).result()
        for key, rep in list(self.replicas.items()):
            rep.children.discard(ref.name)
            if key[0] == ref.name:  # the parent went: so does every replica of it
                rep.stale = True
            if rep.stale and not rep.children:
                self.replicas.pop(key, None)
                await self.delete(rep.ref)  # its node drops the checkpoint it was restored from with it

    def list(self) -> builtins.list[MachineRef]:
        return [m for m in self._machines.values() if not m.info.get("replica")]

    def holds_machines(self) -> bool:
        """Whether machines of ours (replicas too) are on the cluster: it is not left for another meanwhile."""
        return bool(self._machines)

    async def close(self) -> None:
        import ray

        for ref in reversed(builtins.list(self._machines.values())):
            with contextlib.suppress(Exception):
                await self.delete(ref)
        self.replicas.clear()
        # a node whose agent died (kill -9, an OOM) but which lives gets one more agent, which
        # deletes the run folders the dead one left (at its start, and at its close below)
        with contextlib.suppress(Exception):
            revived = await asyncio.to_thread(self._new_agents, True)
            await asyncio.wait_for(asyncio.gather(*(self._describe(n, joined=True) for n in revived)), 120)
        for node in self.nodes.values():  # the agents go too: a later `%smol up --ray` starts its own
            if not node.lost:
                with contextlib.suppress(Exception):  # its own folder (artifacts) goes with it
                    await asyncio.wait_for(self._call(node, node.agent.close.remote()), 60)
            with contextlib.suppress(Exception):
                ray.kill(node.agent)
        self.nodes.clear()
        self._batchers.clear()

    async def checkpoint(self, machine: MachineRef, path: str) -> CheckpointInfo:
        """Saved on the machine's node, brought here as data and checked (shipping.save)."""
        await self._limits_to_agents()
        return await shipping.save(self, machine, path)

    async def restore(self, path: str, name: str, spec: MachineSpec, *, isolated: bool = False) -> MachineRef:
        """Checked here, sent to a node whose backend restores it (shipping.restore); with
        ``isolated``, never to a process node."""
        if name in self._machines:
            raise SmolbenchError(f"a machine named {name!r} already exists: `%smol down` it or pick another name")
        await self._limits_to_agents()
        return await shipping.restore(self, path, name, spec, isolated=isolated)

    # -- forks across nodes ---------------------------------------------------------------

    async def branch(self, machine: MachineRef, names: builtins.list[str],
                     seeds: builtins.list[int | None], *, leaf: bool = False) -> builtins.list[MachineRef]:
        """One batch per node: the parent's node branches the parent, the others a replica of it."""
        await self._limits_to_agents()
        home = self._node_of(machine)
        await self.refresh(every=0)  # a node added since the last fork takes part in this one
        free = self.free()
        plan = placement.split(len(names), free, prefer=home.id)
        made: builtins.list[MachineRef] = []
        if any(n != home.id for n in plan):
            try:  # before the parent forks: one request at a time reaches a machine
                await self._parent_fingerprint(machine)
                await self._parent_export(machine, home, [self.nodes[n] for n in plan if n != home.id])
            except SmolbenchError as exc:
                self.notes.append(f"all {len(names)} branches ran on {_short(home.id)}: {exc}")
                plan = {home.id: range(len(names))}

        async def on(node_id: str, idx: range) -> builtins.list[MachineRef]:
            node = self.nodes[node_id]
            batch, bseeds = [names[i] for i in idx], [seeds[i] for i in idx]
            source = machine if node_id == home.id else (await self._replica(machine, node)).ref
            for n in batch:
                node.live.add(n)
            branching = node.agent.branch.remote(source.name, batch, bseeds)
            try:
                async with shipping.undone_if_left(node, lambda: shipping._undo(self, node, branching, *batch)):
                    got = await self._call(node, branching)
            except BaseException:
                for n in batch:
                    node.live.discard(n)
                raise
            refs = [self._adopt(node, n, machine.spec, machine.name, source=source.name) for n in got]
            if source is not machine:
                self.replicas[(machine.name, node_id)].children.update(got)
            made.extend(refs)
            return refs

        try:
            results = await asyncio.gather(*(on(n, idx) for n, idx in plan.items()), return_exceptions=True)
        except BaseException:  # cancelled: each node's batch undid its own fork; those that ended go too
            for ref in made:
                await _to_the_end(self.delete(ref))
            raise
        failed = [(n, idx, r) for (n, idx), r in zip(plan.items(), results) if isinstance(r, BaseException)]
        for node_id, idx, why in failed:  # that node's batch goes home (its replica didn't work out)
            if isinstance(why, asyncio.CancelledError) or home.lost:
                for ref in made:
                    await self.delete(ref)
                raise why
            self.notes.append(f"{len(idx)} branch(es) meant for node {_short(node_id)} ran on {_short(home.id)}: {why}")
            try:
                await on(home.id, idx)
            except BaseException:
                for ref in made:
                    await self.delete(ref)
                raise
        order = {n: i for i, n in enumerate(names)}
        return sorted(made, key=lambda r: order[r.name])

    async def fingerprint(self, machine: MachineRef) -> str:
        """The state fingerprint of a machine (replica.FINGERPRINT_CODE), through the gate."""
        res = await self.exec_cell(machine, CellRequest(FINGERPRINT_CODE, cell_name="<fingerprint>"), lambda ev: None)
        if res.status != "ok":
            raise SmolbenchError(f"the state fingerprint of {machine.name} failed: {(res.error or {}).get('evalue', '')}")
        said = str((res.result or {}).get("text/plain", "")).strip("'\"")
        if not FINGERPRINT.fullmatch(said):  # machine text: it goes into notices, the ledger and errors
            raise SmolbenchError(f"the state fingerprint of {machine.name} is not one (16 hex digits), so its "
                                 "state can't be compared across nodes: its code replaced what computes it")
        return said

    async def _parent_fingerprint(self, parent: MachineRef) -> str:
        """The warm parent's fingerprint, once per state (recipe key)."""
        if self.recipe_for is None:
            raise SmolbenchError("no recorded path to replay (this backend is driven without a Workbench)")
        key = self.recipe_for(parent.name).key
        if key not in self._fingerprints:
            self._fingerprints[key] = await self.fingerprint(parent)
        return self._fingerprints[key]

    async def _parent_export(self, parent: MachineRef, home: Node, nodes: builtins.list[Node]) -> None:
        """A smol parent's portable checkpoint, once per state, if a smol node needs a new replica."""
        key = self.recipe_for(parent.name).key if self.recipe_for is not None else None
        if key is not None and any(shipping.by_checkpoint(home, n) and getattr(
                self.replicas.get((parent.name, n.id)), "key", None) != key for n in nodes):
            await shipping.export(self, parent, key)

    async def _replica(self, parent: MachineRef, node: Node) -> Replica:
        """The warm parent on ``node``: cached while the parent's state is unchanged, else replayed."""
        if self.recipe_for is None:
            raise SmolbenchError("no recorded path to replay (this backend is driven without a Workbench)")
        recipe = self.recipe_for(parent.name)
        have = self.replicas.get((parent.name, node.id))
        if have is not None and have.key == recipe.key and not have.stale and not node.lost:
            return have
        if have is not None:  # the parent ran another cell: the old copy is no good for new branches
            have.stale = True
            if not have.children:
                self.replicas.pop((parent.name, node.id), None)
                await self.delete(have.ref)  # and, on its node, the checkpoint it was restored from
        if shipping.by_checkpoint(self._node_of(parent), node):
            made = await shipping.smol_replica(self, parent, node, recipe.key, await self._parent_fingerprint(parent))
            rep = Replica(key=recipe.key, how="checkpoint", **made)
            self.replicas[(parent.name, node.id)] = rep
            self.on_replica(parent.name, node.id, rep)
            return rep
        if recipe.pushed:
            pushed = ", ".join(sorted(set(recipe.pushed)))
            raise SmolbenchError(f"cells of {pushed} used --push, whose values are not recorded, so the parent can't "
                                 "be replayed on another node", api=f"cells of {pushed} used push=, whose values are not "
                                 "recorded, so the parent can't be replayed on another node")
        want = await self._parent_fingerprint(parent)
        t0 = time.perf_counter()
        name = f"replica-{parent.name}-{_short(node.id)}-{uuid.uuid4().hex[:4]}"
        ref, got = await self.replay(recipe, parent.spec, name, node.id, replica=True)
        if got != want:
            await self.delete(ref)
            differs = (f"the replay of {parent.name} on node {_short(node.id)} doesn't match: state fingerprint "
                       f"{got} vs {want} (a cell depends on something not recorded: time, files from outside, ")
            raise SmolbenchError(differs + "--push)", api=differs + "push=)")
        rep = Replica(ref, recipe.key, got, recipe.code_bytes, time.perf_counter() - t0)
        self.replicas[(parent.name, node.id)] = rep
        self.on_replica(parent.name, node.id, rep)
        return rep

    async def replay(self, recipe: Recipe, spec: MachineSpec, name: str, node_id: str | None = None,
                     **info: Any) -> tuple[MachineRef, str]:
        """A new machine ``name`` rebuilt from ``recipe`` (on ``node_id``, else the least loaded
        live node) and its state fingerprint; nothing is left behind when it fails."""
        ref = await self.create(spec, name, node_id=node_id)
        ref.info.update(info)
        node = self.nodes[ref.info["node"]]
        try:
            for step in recipe.steps:
                if step[0] == "seed":
                    await self._call(node, node.agent.control.remote(name, {"op": "seed", "seed": step[1], "name": name}))
                    continue
                await self.exec_cell(ref, CellRequest(step[1], seed=step[2], cell_name="<replay>"), lambda ev: None)
            return ref, await self.fingerprint(ref)
        except BaseException:
            await self.delete(ref)
            raise

    # -- a machine lost with its node (recover.py rebuilds it) -------------------------------

    async def lost_node(self, machine: MachineRef) -> str | None:
        """The node ``machine`` was lost with, or None while it lives (asks the node's agent)."""
        node = self.nodes.get(machine.info.get("node", ""))
        if node is None:
            return None
        if machine.name not in self._machines:  # lost with its node's agent (the node may have a new one)
            return node.id
        if not node.lost:
            await self._describe(node)  # a lost node is marked lost
        return node.id if node.lost else None

    def has(self, name: str) -> bool:
        """Whether machine ``name`` is still one of ours (not lost with its node or its agent)."""
        return name in self._machines

    async def remember_state(self, machine: MachineRef) -> str:
        """Take (once per state) the fingerprint a rebuild of ``machine`` is checked against."""
        return await self._parent_fingerprint(machine)

    def known_fingerprint(self, key: tuple[str, int]) -> str | None:
        """The fingerprint taken of a machine's state ``key`` (node, cells run), if any was."""
        return self._fingerprints.get(key)

    async def restate(self, name: str, key: tuple[str, int], fingerprint: str) -> None:
        """``name`` was rebuilt with state ``fingerprint``: replicas of another state go."""
        self._fingerprints[key] = fingerprint
        for (parent, node_id), rep in list(self.replicas.items()):
            if parent == name and rep.fingerprint != fingerprint:
                rep.stale = True
                if not rep.children:
                    self.replicas.pop((parent, node_id), None)
                    await self.delete(rep.ref)

    # -- status ---------------------------------------------------------------------------

    def describe(self) -> builtins.list[str]:
        """One line per node (what ``%smol status`` lists)."""
        lines = []
        for n in self.nodes.values():
            live = sorted(m for m in n.live if not self._machines.get(m, MachineRef(m, "", MachineSpec())).info.get("replica"))
            reps = [(k[0], r) for k, r in self.replicas.items() if k[1] == n.id]
            rep_text = "; ".join(f"replica of {p} ({r.bytes_shipped} B shipped"
                                 f"{' as a portable checkpoint' if r.how == 'checkpoint' else ''}, {r.seconds:.2f} s, fingerprint "
                                 f"{r.fingerprint}{', stale' if r.stale else ''})" for p, r in reps)
            shown = ", ".join(live[:8]) + (f", … {len(live) - 8} more" if len(live) > 8 else "")
            lines.append(f"{_short(n.id)} {n.host} {n.backend}: {'LOST' if n.lost else 'up'}, {n.slots} slots, "
                         f"{len(live)} live ({shown or 'none'})" + (f"; {rep_text}" if rep_text else "")
                         + (f"; agent {_calls_text(n)}" if n.calls else ""))
        return lines


    def where(self, node_id: str | None) -> dict[str, Any] | None:
        """The node a machine runs on, for views: id, host, backend kind, lost (None: unknown)."""
        n = self.nodes.get(node_id or "")
        if n is None:
            return None
        return {"node": n.id, "host": n.host, "backend": n.backend, "lost": n.lost}

CALL_KINDS = {"exec": "cells", "branch": "branches", "create": "boots", "delete": "deletes"}


def _calls_text(node: Node) -> str:
    """How many machine requests the node's agent took in how many calls (batching, visible)."""
    parts = []
    for kind, label in CALL_KINDS.items():
        calls = node.calls.get(kind, 0)
        if calls:
            parts.append(f"{node.requests.get(kind, 0)} {label} in {calls} call{'s' if calls != 1 else ''}")
    return ", ".join(parts) or "idle"
