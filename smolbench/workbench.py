"""The Workbench: one per kernel. The active machine, the fork tree, fan-out (checkpoints: checkpoints.py; status: status.py;
which kept machines stay: keeping.py).

All of its async methods run on smolbench's own loop thread (``_loop``); the
magics block on them. Widgets observe it through :meth:`Workbench.observe` and
never call a backend themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import socket
import time
import uuid
import weakref
from collections.abc import Callable, Collection, Coroutine
from pathlib import Path
from typing import Any

from . import _args, gate, packages, signing
from . import retries as retry
from ._aio import Waves, _gather_cancelling, _stop_with_grace, _to_the_end
from ._recorder import Observer, RecorderMixin
from ._smolfilewatch import SmolfileWatch
from .backends._limits import disk_note, out_of_memory_line
from .backends.base import Backend, CellRequest, CellResult, Event, MachineRef
from .checkpoints import SESSIONS_HERE, BranchEvent, CheckpointsMixin
from .errors import LIVE, NOT_UP, InfraError, MachineDied, MachineLost, SmolbenchError, remote_error
from .keeping import KeepingMixin
from .ledger import Ledger, code_hash
from .losses import LossesMixin
from .provenance import versions as _versions
from .provenance import where as _where
from .result import ForkResult
from .shelf import Shelf
from .spec import MachineSpec
from .status import StatusMixin
from .tree import TERMINAL, Node, Tree
from .zygote import Zygotes

MAX_BRANCHES = gate.limits.MAX_BRANCHES
KEEP_POLICIES = _args.KEEP_POLICIES
FANOUT_STOP_WAIT = 60.0  # seconds down() waits for running fan-outs to record their cancel before it deletes

FanOut = Callable[..., Coroutine[Any, Any, ForkResult]]


def _stopped_by_down(method: FanOut) -> FanOut:
    """A fan-out that :meth:`Workbench.down` cancels first (its task's), so its branches are
    recorded as cancelled: deleted under it, they read as machines that died mid-cell."""
    @functools.wraps(method)
    async def tracked(self: Workbench, *args: Any, **kwargs: Any) -> ForkResult:
        if self.closing:  # asked for from another thread while down() deletes (audit: its zygote outlived down)
            raise SmolbenchError("this session is going down (`%smol down`): nothing more runs in it; `%smol up` "
                                 "starts another")
        task = asyncio.current_task()
        self._fanouts.add(task)  # type: ignore[arg-type]  # always one: it runs on our loop
        try:
            return await method(self, *args, **kwargs)
        finally:
            self._fanouts.discard(task)

    return tracked


class Workbench(RecorderMixin, CheckpointsMixin, StatusMixin, LossesMixin, KeepingMixin):
    """A kernel's machines and their fork tree, recorded in a ledger."""

    def __init__(self, backend: Backend, spec: MachineSpec, ledger: Ledger, *, checkpoint_dir: str | None = None,
                 retries: int = 1) -> None:
        if retries < 0:
            raise SmolbenchError(f"--retries must be 0 or more, got {retries}", api=f"retries must be 0 or more, got {retries}")
        ckpt_dir = Path(os.path.abspath(checkpoint_dir or Path(ledger.path).parent / "checkpoints"))
        signing.guard(Path(ledger.path).parent, ckpt_dir)  # (checked again at each machine's bind)
        for vol in spec.volumes:  # a machine never reaches the key, nor writes where signed rows' files are
            signing.check_volume(vol.host, vol.readonly, vol.guest)
        self.retries = retries  # boots again after an infrastructure failure (InfraError), never a cell's error
        self.backend = backend
        self.spec = spec
        self.baseline = spec.baseline()  # the spec is frozen: hash it once, not on every ledger write
        self.ledger = ledger
        self.session = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        SESSIONS_HERE.add(self.session)
        self.tree = Tree()
        self.machines: dict[str, MachineRef] = {}
        self._active: str | None = None
        self.started = time.time()
        self.checkpoint_dir = ckpt_dir
        self.shelf = Shelf(ledger, self.checkpoint_dir)  # every checkpoint file goes through its rule
        self.restore_notes: list[str] = []
        self.guest_info: dict[str, Any] = {}
        self.versions: dict[str, str | None] = {}  # recorded on every node's ledger row
        self._observers: list[Observer] = []
        self._heard: tuple[int, list[Node]] | None = None  # a batch's thread and the nodes it recorded (RecorderMixin)
        # open gym envs' records (gym/record.py Records): ended and written first by down
        self.unwritten: weakref.WeakSet[Any] = weakref.WeakSet()
        self._runs = 0
        self._busy: set[str] = set()
        self._fanouts: set[asyncio.Task[Any]] = set()  # tasks running a fork or episodes (down stops them first)
        self.cancelled_fanouts = 0  # how many of them the last down() cancelled
        self.max_alive = spec.max_alive
        self._used: dict[str, float] = {}  # node -> when it was last used (least recently used go first)
        self.on_notice: Callable[[str], None] = lambda line: None  # the magics print these lines
        self.trusted = False  # %smol trust on: pulls unpickled and displays raw (recorded in the ledger)
        self.net_note: str | None = None  # `%smol up --net/--allow` overrode the Smolfile's network policy
        self.disk_note: str | None = None  # the Smolfile's disk leaves a sandbox machine no memory (said at up)
        self.smolfile_watch: SmolfileWatch | None = None  # the Session's: the Smolfile edited since up (said once)
        self.net_stats: dict[str, dict[str, Any]] = {}  # per machine: connections let out / refused
        self.outputs_dir = gate.log_folder(Path(ledger.path))  # smolbench's own folder, never the user's outputs/
        self.log_pool = gate.LogPool(folder=self.outputs_dir, mine=self.session,  # what logs there may take
                                     sessions=lambda: self.ledger.session_ids())
        self._watcher: asyncio.Future[None] | None = None  # checkpoints deleted elsewhere (while up)
        self.moved = ""  # the last delete's line about the active machine moving
        self.last_loss: str | None = None  # the last machine lost under a request, and why (status says it)
        self.closed = False  # down() ran: its backend is closed
        self.closing = False  # down() started: no fan-out starts any more
        self.zygotes = Zygotes(backend, self._init,  # episodes branch a pristine machine of the baseline
                               lambda name, retries, once: retry.again(self, [name], "boot", retries, once))
        if hasattr(backend, "recipe_for"):  # the cluster backend replays a parent's recorded path on other nodes
            from .cluster.replica import recipe

            setattr(backend, "recipe_for", lambda node_id: recipe(self, node_id))  # noqa: B010
            setattr(backend, "on_replica", self._replicated)  # noqa: B010

    def _replicated(self, parent: str, host_node: str, rep: Any) -> None:
        self.ledger.add_replica(self.session, parent, host_node, rep.key[1], rep.fingerprint, rep.bytes_shipped, rep.seconds)
        how = ("from its portable checkpoint" if getattr(rep, "how", "") == "checkpoint"
               else "by replaying its recorded path")
        self.on_notice(f"smolbench: {parent} replicated to node {host_node[:8]} {how} "
                       f"({rep.bytes_shipped} B shipped, {rep.seconds:.2f} s, state fingerprint {rep.fingerprint})")

    async def _rebuilt_if_lost(self, node_id: str) -> MachineRef | None:
        """The machine ``node_id`` as it is now: on a cluster, rebuilt on another node from its
        recorded path first if its node was lost (cluster/recover.py); None off a cluster."""
        if not hasattr(self.backend, "lost_node"):
            return None
        from .cluster.recover import ensure

        return await ensure(self, node_id)

    async def _remember_state(self, ref: MachineRef) -> None:
        """On a cluster: the state fingerprint a rebuild of ``ref`` is checked against."""
        remember = getattr(self.backend, "remember_state", None)
        if remember is not None:
            with contextlib.suppress(SmolbenchError):  # no recorded path (a restored checkpoint): nothing to check
                await remember(ref)

    def _placed(self, ref: MachineRef) -> None:
        """Note which cluster node a machine runs on (None off a cluster)."""
        if ref.name in self.tree:
            node = self.tree[ref.name]
            node.where = ref.info.get("node")
            find = getattr(self.backend, "where", None)
            at = (find(node.where) if find is not None and node.where else None) or {}
            node.where_kind = at.get("backend") or ref.info.get("node_backend")
            node.where_host = at.get("host")

    # -- observers ------------------------------------------------------------------

    @property
    def active(self) -> str | None:
        """The node cells run in (None: no machine is up, or the active one was deleted)."""
        return self._active

    @active.setter
    def active(self, node_id: str | None) -> None:
        # observers (the registry the sidebar reads, the views) learn of every move
        old, self._active = self._active, node_id
        if old != node_id:
            self._changed(*(self.tree[n] for n in (old, node_id) if n is not None and n in self.tree))

    # -- lifecycle -------------------------------------------------------------------

    async def up(self, restore: str | None = None) -> Node:
        """Start the root machine from the spec and run its init commands; or, given ``restore``
        (a checkpoint's name or path), start with that checkpoint's machine as the only one."""
        if self.active is not None:
            raise SmolbenchError(f"already up ({self.backend.name}, active {self.active}): `%smol down` first to start over",
                                 api=f"already up ({self.backend.name}, active {self.active}): `Session.down()` first "
                                 "to start over")
        installing = packages.ON_INSTALL.set(lambda line: self.on_notice(line))  # a first install says so
        try:
            return await self._up(restore)
        finally:
            packages.ON_INSTALL.reset(installing)

    async def _up(self, restore: str | None) -> Node:
        if restore is not None:  # nothing made if it fails: the caller's down() closes the backend
            node = await self.checkpoint_restore(restore)
            ref = self.machines[node.id]
        else:
            ref = await retry.boot(self, self.spec, "root", self.retries)
            self.machines["root"] = ref
            node = self.tree.add(Node("root", status="idle", started=time.time()))
            self._placed(ref)
            self.active = "root"
        try:
            if restore is None:  # a checkpoint's machine ran its init commands before it was saved
                await self._init(ref)
            self.guest_info = {"python": await self._guest_python(ref)}
        except BaseException:
            await _to_the_end(self.down())  # a second Ctrl-C must not leave the machine half deleted
            raise
        self.versions = _versions(self.guest_info.get("python"))
        limiter = getattr(self.backend, "limiter", None) if getattr(self.backend, "files_in_memory", False) else None
        if limiter is not None:
            self.disk_note = disk_note(self.spec, counted=bool(limiter.mechanism.bases))
        await self._remember_state(ref)
        self.lost = self.ledger.mark_lost(self.session)
        self.shelf.store.sweep_parts()  # checkpoints a killed kernel was writing here
        self.ledger.start_session(
            self.session, backend=self.backend.name, isolation=self.backend.isolation,
            baseline=self.baseline, host=socket.gethostname(), cwd=os.getcwd(),
            versions=self.versions, network=self.spec.policy.describe() + (f"; {self.net_note}" if self.net_note else ""),
        )
        self._record(node)
        self._watcher = asyncio.ensure_future(self.watch_checkpoints())
        return node

    async def _guest_python(self, ref: MachineRef) -> str:
        """The machine's Python version, as its agent says it (``ping``), never from a cell in the
        user's namespace: that left ``_`` ('3.11.7') and ``_s`` (sys) in every fresh machine."""
        info = getattr(self.backend, "info", None)
        if info is not None:
            return str((await info(ref)).get("python") or "")
        # a backend that can't ask the agent (a cluster's): printed, so nothing is left behind
        res = await self.backend.exec_cell(ref, CellRequest("print(__import__('sys').version.split()[0])",
                                                            cell_name="<probe>"), lambda e: None)
        return res.stdout.strip()

    async def _init(self, ref: MachineRef) -> None:
        """The Smolfile's init commands, all within ``init_timeout`` seconds."""
        current = ""

        async def run_all() -> None:
            nonlocal current
            for cmd in self.spec.init:
                current = cmd
                res = await self.backend.exec_cell(ref, CellRequest(_init_code(cmd), cell_name="<init>"), lambda e: None)
                if res.status != "ok":
                    err = res.error or {}
                    raise SmolbenchError(f"Smolfile init command failed: {cmd!r}: {err.get('evalue', '')}: fix the command or the image")

        if not self.spec.init:
            return
        try:
            await asyncio.wait_for(run_all(), self.spec.init_timeout)
        except asyncio.TimeoutError:
            raise SmolbenchError(
                f"Smolfile init did not finish within {self.spec.init_timeout:g} s (still running {current!r}): "
                "fix the command, or raise init_timeout in the Smolfile") from None

    async def down(self) -> int:
        """Delete every machine this workbench created. Returns how many."""
        self.closing = True
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        before = set(self.machines)  # also those a cancelled fan-out deletes itself
        await _to_the_end(self._stop_fanouts())
        gone: set[str] = set()
        for records in list(self.unwritten):  # before the rows below, which they must not come after
            with contextlib.suppress(Exception):  # a record that can't be written never keeps a machine
                records.session_down()
        await _to_the_end(self.zygotes.close())
        for _ in range(3):  # again for machines made meanwhile (a gym env's spares already on their way)
            names = sorted(self.machines, key=lambda n: -n.count("."))
            for name in names:
                ref = self.machines.pop(name, None)
                if ref is None:  # deleted meanwhile (a gym env closing beside this)
                    continue
                with contextlib.suppress(Exception):
                    await self.backend.delete(ref)
                gone.add(name)
                if name in self.tree:
                    node = self.tree[name]
                    node.alive = False
                    if node.status in ("idle", "running", "starting"):
                        node.status = "ok" if node.status == "idle" else "cancelled"
                        node.ended = node.ended or time.time()
                    self._record(node)
            if not self.machines:
                break
        with contextlib.suppress(Exception):
            await self.backend.close()
        self.active = None
        self.closed = True
        self.ledger.fold_wal()  # ledger.db alone is then the whole ledger (a copy of it, a download)
        return len(before | gone)

    async def _stop_fanouts(self) -> None:
        """Cancel the forks and episodes still running (a --bg fork, one in another thread or
        started from a view) and wait for them to record their branches as cancelled."""
        me = asyncio.current_task()
        running = [task for task in self._fanouts if task is not me and not task.done()]
        self.cancelled_fanouts = len(running)
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running, timeout=FANOUT_STOP_WAIT)

    def require_up(self) -> MachineRef:
        """The active machine, or a clear error when there is none."""
        if self.active is None or self.active not in self.machines:
            raise SmolbenchError("no machine is up: run `%smol up` first", api=NOT_UP)
        return self.machines[self.active]

    def live(self, node_id: str) -> MachineRef:
        """A live node's machine, or a one-line error naming the live ones."""
        if node_id not in self.tree:
            known = ", ".join(n.id for n in self.tree if n.alive) or "none"
            raise SmolbenchError(f"unknown node {node_id!r}: live nodes are {known} (see `%smol tree`)",
                                 api=f"unknown node {node_id!r}: live nodes are {known} (see {LIVE})")
        if node_id not in self.machines:
            raise SmolbenchError(f"node {node_id!r} was deleted: use a live node, or `%smol replay {node_id}` to rebuild it",
                                 api=f"node {node_id!r} was deleted: use a live node (see {LIVE})")
        return self.machines[node_id]

    def use(self, node_id: str) -> Node:
        """Make a live node the active machine."""
        self.live(node_id)
        self.active = node_id
        self._touch(node_id)
        self._changed(self.tree[node_id])
        return self.tree[node_id]

    async def delete(self, node_id: str) -> list[str]:
        """Delete a node's machine and every live machine below it. When that took the active
        machine, ``moved`` says where the active machine went ("" otherwise)."""
        if node_id not in self.tree:
            raise SmolbenchError(f"unknown node {node_id!r}: see `%smol tree`", api=f"unknown node {node_id!r}: see {LIVE}")
        self.moved = ""
        gone = []
        for node in reversed(self.tree.subtree(node_id)):
            ref = self.machines.pop(node.id, None)
            if ref is None:
                continue
            await self.backend.delete(ref)
            node.alive = False
            node.kept = False
            self._record(node)
            gone.append(node.id)
        if self.active is not None and self.active not in self.machines:
            was = self.active
            self.active = self.tree[node_id].parent if self.tree[node_id].parent in self.machines else None
            self.moved = active_moved(was, self.active, left=bool(self.machines))
            self._changed(*(self.tree[n] for n in (was, self.active) if n is not None and n in self.tree))
        return gone

    # -- cells --------------------------------------------------------------------------

    def _claim(self, node_id: str) -> None:
        if node_id in self._busy:
            raise SmolbenchError(f"{node_id} is busy with another cell or fork: wait for it (or its --bg handle) to finish",
                                 api=f"{node_id} is busy with another run or fork: wait for it to finish")
        self._busy.add(node_id)
        self._busy_changed(node_id)

    def _release(self, node_id: str) -> None:
        """The node is free again; views stop saying it is busy (observers hear of it)."""
        if node_id in self._busy:
            self._busy.discard(node_id)
            self._busy_changed(node_id)

    def _busy_changed(self, node_id: str) -> None:
        if node_id in self.tree:
            self._changed(self.tree[node_id])

    def set_trust(self, on: bool, scope: str = "session") -> None:
        """Turn trusted mode on or off; every change is recorded in the ledger."""
        if scope == "session":
            self.trusted = on
        self.ledger.add_trust(self.session, scope, "on" if on else "off")

    def _budget(self, node_id: str, tag: str = "", keep: int | None = None) -> gate.OutputBudget:
        # the session's whole id: a later session's (or a kernel's beside it) root.cell1 is another log
        return gate.OutputBudget(self.outputs_dir / gate.log_name(node_id, tag, self.session), pool=self.log_pool, keep=keep)

    async def run_cell(self, code: str, on_event: Callable[[Event], None], *, push: dict[str, bytes] | None = None,
                       pull: list[str] | None = None, timeout: float | None = None,
                       cell_name: str | None = None, first_line: int = 1, pull_trusted: bool = False,
                       node_id: str | None = None, own: Collection[str] = ()) -> CellResult:
        """Run a cell in the active machine, or in the live ``node_id`` (its state persists).

        ``cell_name`` is what tracebacks call the cell (the magic passes ``<In [n]>``);
        ``first_line`` is the editor line the code starts on (2 below a ``%%smol`` line);
        ``own``: names in ``push`` that smolbench set itself (the value slot), not recorded as pushed.
        A cell that ignores the interrupt (Ctrl-C or ``timeout``) for ``LIMITS.grace``
        seconds has its machine killed, and the error says so.
        """
        timeout = gate.seconds(timeout)
        ref = self.require_up() if node_id is None else self.live(node_id)
        node = self.tree[ref.name]
        self._claim(ref.name)
        self._touch(ref.name)
        try:
            ref = await self._rebuilt_if_lost(ref.name) or ref
            node.cells += 1
            if pull_trusted and pull:
                self.ledger.add_trust(self.session, "pull", f"{ref.name}: --pull-trusted {','.join(pull)}")
            req = CellRequest(_at_line(code, first_line), push=push or {}, pull=pull or [], cell_name=cell_name or f"<cell-{node.cells}>",
                              trust_pull=pull_trusted or self.trusted, trust_display=self.trusted,
                              output=self._budget(ref.name, f".cell{node.cells}"))
            task = asyncio.ensure_future(self.backend.exec_cell(ref, req, on_event))
            try:
                res = await asyncio.wait_for(asyncio.shield(task), timeout)
            except MachineLost as exc:
                raise await _to_the_end(self._lost(ref.name, str(exc))) from None
            except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
                timed_out = isinstance(exc, asyncio.TimeoutError)
                if not await _to_the_end(self._stop(ref, task)):
                    raise await _to_the_end(self._kill_stuck(ref.name, timeout if timed_out else None)) from None
                if timed_out:
                    raise SmolbenchError(f"the cell ran longer than --timeout {timeout:g} s and was interrupted",
                                         api=f"the code ran longer than timeout={timeout:g} s and was interrupted") from None
                raise
            # a recorded push is a value the ledger lacks (a replay can't make it): smolbench's own aren't
            pushed = sorted(n for n in req.push if n not in own)
            self.ledger.add_cell(self.session, ref.name, node.cells, code, None, pushed, res.status)
            if _out_of_memory(res):  # the machine lives on, and so does what its variables hold
                raise SmolbenchError(out_of_memory_line(ref.spec, said=(res.error or {}).get("evalue")) + KEPT_HELD)
            await self._remember_state(ref)
            if res.reward is not None:
                node.reward = res.reward
                self._record(node)
            return res
        finally:
            self._release(ref.name)

    async def _stop(self, ref: MachineRef, task: asyncio.Future[Any]) -> bool:
        """Interrupt the cell in ``ref``; True once it stopped, False if it ignored us for the grace period."""
        return await _stop_with_grace(lambda: self.backend.interrupt(ref), task, gate.LIMITS.grace)

    # -- fan-out -----------------------------------------------------------------------------

    def default_concurrency(self, n: int, boots: bool = False) -> int:
        """How many branches run at once when not told: live forks are cheap, so all of them
        (up to 4 per core); fresh machines (``boots``) cost a boot each, so 2 per core."""
        cores = os.cpu_count() or 1
        slots = getattr(self.backend, "slots", None)
        if slots is not None:  # a cluster: every node's machine slots
            return max(1, min(n, slots()))
        live = self.backend.name in ("sandbox", "process") and not boots
        return max(1, min(n, 4 * cores if live else 2 * cores))

    def new_fork(self, n: Any, seeds: list[int] | None = None, seed_base: int = 0, *, timeout: float | None = None,
                 concurrency: int | None = None, keep: str = "best", parent: str | None = None,
                 reseed: bool = True) -> ForkResult:
        """Validate a fork request and lay out its branches (run it with :meth:`fork`).

        Forks the active node, or the live node ``parent`` (the tree widget's Fork button).
        ``reseed``: each branch's first cell reseeds the random streams it inherited (guest/reseed.py).
        """
        n = _args.fanout(n, seeds, seed_base, timeout, concurrency, keep)
        if parent is not None and parent not in self.machines:
            raise SmolbenchError(f"{parent} is not alive, so it can't be forked: pick a live node (`%smol tree`)")
        ref = self.require_up() if parent is None else self.machines[parent]
        if not self.spec.branch:
            raise SmolbenchError("branching is off for this machine ([branch] enabled = false in the Smolfile): turn it on, "
                                 "or use `%%smol episodes`", api="branching is off for this machine ([branch] enabled = "
                                 "false in the Smolfile): turn it on, or use `Session.episodes(n, code)`")
        seeds_ = list(seeds[:n]) if seeds is not None else [seed_base + i for i in range(n)]
        names = self.tree.next_child_ids(ref.name, n)
        self._runs += 1
        result = ForkResult("fork", f"{self.session}/run{self._runs}", ref.name, names, list(seeds_))
        result.keep = keep
        result.reseed = reseed
        return result

    def new_episodes(self, n: Any, seeds: list[int] | None = None, seed_base: int = 0, *, timeout: float | None = None,
                     concurrency: int | None = None, reseed: bool = True) -> ForkResult:
        """Validate an episodes request and lay out its machines (run it with :meth:`episodes`)."""
        n = _args.fanout(n, seeds, seed_base, timeout, concurrency, "none", kind="episodes")
        if self.active is None:
            raise SmolbenchError("no machine is up: run `%smol up` first (episodes boot from its baseline)",
                                 api=f"{NOT_UP} (episodes boot from its baseline)")
        seeds_ = list(seeds[:n]) if seeds is not None else [seed_base + i for i in range(n)]
        self._runs += 1
        names = [f"ep{self._runs}.{i}" for i in range(n)]
        result = ForkResult("episodes", f"{self.session}/run{self._runs}", None, names, list(seeds_))
        result.reseed = reseed
        return result

    @_stopped_by_down
    async def fork(self, result: ForkResult, code: str, on_event: BranchEvent, *, timeout: float | None = None,
                   concurrency: int | None = None, keep: str = "best", push: dict[str, bytes] | None = None,
                   retries: int | None = None, cell_name: str | None = None, first_line: int = 1) -> ForkResult:
        """Branch the active machine, run ``code`` in every branch with its seed, keep per policy.

        A branch whose machine fails to come up or dies (InfraError) is branched again, up to
        ``retries`` times (default: the workbench's); a cell's own error never is.
        ``cell_name`` / ``first_line``: what tracebacks call the cell, and its first editor line."""
        retries = self.retries if retries is None else retries
        parent_id = result.parent
        assert parent_id is not None
        parent = self.machines.get(parent_id)
        if parent is None:
            raise SmolbenchError(f"{parent_id} is no longer alive: `%smol use` a live node",
                                 api=f"{parent_id} is no longer alive: `Session.use(node)` a live node")
        pnode = self.tree[parent_id]
        self._claim(parent_id)
        try:
            parent = await self._rebuilt_if_lost(parent_id) or parent
        except BaseException:
            self._release(parent_id)
            raise
        names = list(result.rows)
        seeds = [result.rows[n]["seed"] for n in names]
        nodes: list[Node] = []
        try:  # the claim (and the tree's new nodes) go with anything that fails before the branches exist
            self.ledger.start_run(result.run_id, self.session, kind="fork", parent_id=parent_id, code=code,
                                  code_hash=code_hash(code), n=len(names), **_where(cell_name),
                                  options={"seeds": seeds, "timeout": timeout, "keep": keep,
                                           "concurrency": concurrency, "reseed": result.reseed})
            for name, seed in zip(names, seeds):
                nodes.append(self.tree.add(Node(name, parent_id, seed, run_id=result.run_id, forked_at=pnode.cells)))
            self._record_all(nodes, code=code, code_hash=code_hash(code), pushed=sorted(push or {}))
        except BaseException:
            for node in nodes:
                node.status = "error"  # never started: it leaves the tree
                self.tree.forget(node.id)
            self._release(parent_id)
            raise
        try:
            # --keep none: every branch is deleted once its cell ran, never forked (a leaf)
            branching = asyncio.ensure_future(retry.branch(self, parent, names, seeds, retries, leaf=keep == "none"))
            try:
                refs = await _to_the_end(branching)
            except BaseException as exc:
                if branching.done() and not branching.cancelled() and branching.exception() is None:
                    for ref in branching.result():  # cancelled while branching: the copies exist, delete them
                        await _to_the_end(self.backend.delete(ref))
                stopped = isinstance(exc, asyncio.CancelledError)  # a cancel says so, as a later one does
                for node in nodes:
                    self._finish(result, node, "cancelled" if stopped else "error",
                                 error="cancelled" if stopped else f"branching failed: {exc}", alive=False)
                raise
            for ref in refs:
                self.machines[ref.name] = ref
                self._placed(ref)
            self._record_all([self.tree[ref.name] for ref in refs])
            self._release(parent_id)  # the parent is free again once its children exist
            try:
                for ref in refs:
                    result.rows[ref.name]["attempts"] = ref.info.get("attempts", 1)
                await self._fan_out(result, refs, code, on_event, timeout=timeout,
                                    concurrency=concurrency or self.default_concurrency(len(refs)), push=push,
                                    parent=parent, retries=retries, cell_name=cell_name, first_line=first_line)
            finally:  # also after Ctrl-C: branches that finished ok follow the keep policy
                await _to_the_end(self._apply_keep(result, nodes, keep))
                self._release(parent_id)
                self._touch(parent_id)
                await _to_the_end(self.enforce_max_alive())
        finally:
            self._release(parent_id)
            status = "cancelled" if any(n.status == "cancelled" for n in nodes) else "done"
            self.ledger.end_run(result.run_id, status)
            result.ended = time.time()
        return result

    @_stopped_by_down
    async def episodes(self, result: ForkResult, code: str, on_event: BranchEvent, *, timeout: float | None = None,
                       concurrency: int | None = None, push: dict[str, bytes] | None = None,
                       retries: int | None = None, cell_name: str | None = None, first_line: int = 1) -> ForkResult:
        """Run ``code`` once per seed, each in a fresh machine from the baseline, deleted afterwards.

        An episode whose machine fails to boot or dies (InfraError) gets a new machine, up to
        ``retries`` times (default: the workbench's); a cell's own error is never retried."""
        retries = self.retries if retries is None else retries
        names = list(result.rows)
        seeds = [result.rows[n]["seed"] for n in names]
        # Each episode a branch of this baseline's pristine zygote, or (its init commands differ
        # from boot to boot, the Smolfile says so, or the backend can't fork live) a boot of its own.
        # The run is recorded first: a zygote that fails to boot (after its retries) is the run's error.
        options = {"seeds": seeds, "timeout": timeout}
        self.ledger.start_run(result.run_id, self.session, kind="episodes", parent_id=None, code=code,
                              code_hash=code_hash(code), n=len(names), **_where(cell_name), options=options)
        nodes = [self.tree.add(Node(name, None, seed, run_id=result.run_id)) for name, seed in zip(names, seeds)]
        self._record_all(nodes, code=code, code_hash=code_hash(code), pushed=sorted(push or {}))
        try:
            verdict = await self.zygotes.verdict(self.spec, self.baseline, retries)
        except BaseException as exc:
            stopped = isinstance(exc, asyncio.CancelledError)
            for node in nodes:
                self._finish(result, node, "cancelled" if stopped else "error",
                             error="cancelled" if stopped else f"the episodes' zygote failed: {exc}", alive=False)
            self.ledger.end_run(result.run_id, "cancelled" if stopped else "done")
            result.ended = time.time()
            raise
        zygote, result.fresh = verdict.zygote, verdict.fresh
        if verdict.note:
            self.on_notice(verdict.note)
        self.ledger.update_run(result.run_id, options={**options, "fresh": verdict.fresh})
        at_once = concurrency or self.default_concurrency(len(nodes), boots=zygote is None)
        # Cells run ``at_once``; a zygote's branches (cheap, forked together) are made ahead, so
        # the next ones wait when a cell ends: at most 3 x at_once alive, let in 2 x at_once at a
        # time, each such wave one fork of the zygote (let in one by one, each was forked alone:
        # 35-47 episodes/s at 64 and 200, against 96-120 in waves, side by side).
        sem: Waves | asyncio.Semaphore = Waves(3 * at_once, 2 * at_once) if zygote is not None else asyncio.Semaphore(at_once)
        run_sem = asyncio.Semaphore(at_once)

        # An episode is never branched: a plain machine boots without smol's branch-source setup.
        episode_spec = dataclasses.replace(self.spec, branch=False)

        async def one(node: Node) -> None:
            made: list[MachineRef] = []

            async def once(attempt: int) -> None:  # boot, init, run; ``made`` holds the machine
                result.rows[node.id]["attempts"] = attempt
                source = zygote
                if source is not None and attempt > 1:  # the zygote may have died: then this makes a new one
                    source = (await self.zygotes.verdict(self.spec, self.baseline, retries)).zygote
                if source is not None:
                    made.append(await self.zygotes.branch(source, node.id, node.seed))
                else:
                    made.append(await self.backend.create(episode_spec, node.id))
                self.machines[node.id] = made[-1]
                self._placed(made[-1])
                if source is None:
                    await self._init(made[-1])
                async with run_sem:
                    await self._run_branch(result, node, made[-1], code, on_event, timeout, push, seed=node.seed,
                                           cell_name=cell_name, first_line=first_line)

            async def drop(attempt: int) -> None:  # the failed machine goes before the next boot
                while made:
                    self.machines.pop(node.id, None)
                    await _to_the_end(self.backend.delete(made.pop()))

            try:
                async with sem:  # a cancel while queued here still marks the episode cancelled
                    await retry.again(self, [node.id], "episode", retries, once, drop)
            except asyncio.CancelledError:
                self._finish(result, node, "cancelled", error="cancelled")
                raise
            except Exception as exc:
                if node.status not in TERMINAL:
                    self._finish(result, node, "error", error=str(exc))
            finally:
                try:
                    if made:  # every terminal path deletes the episode's machine
                        self.machines.pop(node.id, None)
                        await _to_the_end(self.backend.delete(made.pop()))
                finally:  # recorded even when a second cancel arrived during the delete
                    node.alive = False
                    self._record(node)

        try:
            await _gather_cancelling([one(n) for n in nodes], lambda: self._cancel_unstarted(result, nodes, alive=False))
        finally:
            self.ledger.end_run(result.run_id, "cancelled" if any(n.status == "cancelled" for n in nodes) else "done")
            result.ended = time.time()
            self.tree.let_go_ended(n.id for n in nodes)  # a training loop's episodes: the newest stay in memory
        return result

    async def _fan_out(self, result: ForkResult, refs: list[MachineRef], code: str, on_event: BranchEvent, *,
                       timeout: float | None, concurrency: int, push: dict[str, bytes] | None,
                       parent: MachineRef | None = None, retries: int = 0,
                       cell_name: str | None = None, first_line: int = 1) -> None:
        sem = asyncio.Semaphore(concurrency)

        async def run_retrying(node: Node, ref: MachineRef) -> None:
            async def once(attempt: int) -> None:
                result.rows[node.id]["attempts"] = attempt
                await self._run_branch(result, node, self.machines[node.id], code, on_event, timeout, push,
                                       cell_name=cell_name, first_line=first_line)

            async def rebranch(attempt: int) -> None:  # a new copy of the (still live) parent
                await _to_the_end(self._drop(node.id))
                if parent is None or parent.name not in self.machines:
                    raise SmolbenchError(f"{node.id}'s machine died and its parent is gone: it can't be branched again")
                source = await self._rebuilt_if_lost(parent.name) or self.machines[parent.name]  # lost with the branch
                (new,) = await retry.branch(self, source, [node.id], [node.seed], 0, leaf=bool(ref.info.get("leaf")))
                self.machines[new.name] = new
                self._placed(new)
                node.alive = True

            await retry.again(self, [node.id], "run", retries, once, rebranch, first=int(ref.info.get("attempts", 1)))

        async def one(ref: MachineRef) -> None:
            node = self.tree[ref.name]
            try:
                async with sem:  # a cancel while queued here still marks the branch cancelled
                    await run_retrying(node, ref)
            except asyncio.CancelledError:
                self._finish(result, node, "cancelled", error="cancelled")
                await _to_the_end(self._drop(node.id))
                raise
            except Exception as exc:
                if node.status not in TERMINAL:
                    self._finish(result, node, "error", error=str(exc))
            if node.status != "ok":  # a failed branch's machine is of no further use
                await _to_the_end(self._drop(node.id))

        await _gather_cancelling([one(r) for r in refs],
                                 lambda: self._cancel_unstarted(result, [self.tree[r.name] for r in refs]))

    async def _run_branch(self, result: ForkResult, node: Node, ref: MachineRef, code: str, on_event: BranchEvent,
                          timeout: float | None, push: dict[str, bytes] | None, seed: int | None = None,
                          cell_name: str | None = None, first_line: int = 1) -> None:
        node.status = "running"
        node.started = time.time()
        result.rows[node.id]["status"] = "running"
        self._record(node)
        node.cells += 1
        req = CellRequest(_at_line(code, first_line), push=dict(push or {}),
                          cell_name=cell_name or f"<cell-{node.cells}>", seed=seed, reseed=result.reseed,
                          trust_display=self.trusted, output=self._budget(node.id, keep=gate.ROW_KEEP),
                          pixels=result.pixels)
        try:
            res = await asyncio.wait_for(self.backend.exec_cell(ref, req, lambda ev: on_event(node.id, ev)), timeout)
        except asyncio.TimeoutError:
            self._finish(result, node, "timeout", error=f"timed out after {timeout:g} s")
            return
        except InfraError:
            raise  # the machine failed, not the cell: the caller may retry it
        except MachineDied as exc:  # so did this one (not for memory): the fork's or episode's retry makes another
            raise InfraError(str(exc)) from None
        except SmolbenchError as exc:
            self._finish(result, node, "error", error=str(exc))
            return
        self.ledger.add_cell(self.session, node.id, node.cells, code, node.seed, sorted(req.push), res.status)
        if _out_of_memory(res):  # the one line, not a traceback into the allocation
            res.error = {"ename": "MemoryError", "evalue": out_of_memory_line(ref.spec, said=(res.error or {}).get("evalue")), "traceback": []}
        output = res.stdout + (("\n[stderr]\n" + res.stderr) if res.stderr else "")  # as shown, then where the rest went
        if res.status == "ok" and res.metrics.get("reward_error"):
            self._finish(result, node, "error", error=str(res.metrics["reward_error"]), output=output, res=res)
        elif res.status == "ok":
            self._finish(result, node, "ok", output=output, res=res)
        else:
            err = res.error or {}
            result.remote_errors[node.id] = remote_error(err.get("ename", "Error"), err.get("evalue", ""),
                                                         err.get("traceback", []), node.id)
            self._finish(result, node, "error", error=f"{err.get('ename')}: {err.get('evalue')}", output=output, res=res)

    def _finish(self, result: ForkResult, node: Node, status: str, *, error: str | None = None, output: str = "",
                res: CellResult | None = None, alive: bool | None = None) -> None:
        node.status = status
        node.ended = time.time()
        if node.started is None:
            node.started = node.ended
        node.error = error
        node.output = output
        if res is not None:
            node.reward = res.reward
            node.metrics = {k: v for k, v in res.metrics.items() if k != "reward_error"}
        if alive is not None:
            node.alive = alive
        row = result.rows[node.id]
        row.update(status=status, reward=node.reward, wall=node.wall, metrics=dict(node.metrics), output=output, error=error,
                   output_log=res.output_log if res is not None else None)
        self._record(node)  # committed now: survives a kernel crash a moment later

    async def _drop(self, node_id: str, record: bool = True) -> None:
        """Delete ``node_id``'s machine and mark its node gone (``record``: its row written
        here; else the caller writes it, with others)."""
        ref = self.machines.pop(node_id, None)
        if ref is not None:
            with contextlib.suppress(Exception):
                await self.backend.delete(ref)
        node = self.tree[node_id]
        if node.alive:
            node.alive = False
            if record:
                self._record(node)


KEPT_HELD = "; the machine is up and its variables still hold what they did: `del` the big ones to free it"


def _out_of_memory(res: CellResult) -> bool:
    return res.status != "ok" and (res.error or {}).get("ename") in ("MemoryError", "_ArrayMemoryError")


def _at_line(code: str, first_line: int) -> str:
    """``code`` padded so its line numbers are the editor's (the ``%%smol`` line is line 1)."""
    return "\n" * max(0, first_line - 1) + code


def _init_code(cmd: str) -> str:
    return (
        "import subprocess as _sp\n"
        f"_r = _sp.run({cmd!r}, shell=True)\n"
        "if _r.returncode: raise RuntimeError('exit status %d' % _r.returncode)\n"
        "del _sp, _r"
    )


def active_moved(was: str, now: str | None, left: bool = True) -> str:
    """What to say when deleting took the active machine ``was`` (as `%smol delete` says it; ``left``: others live)."""
    if now is None:
        return f"{was} was active: " + ("no machine is active now (`%smol use NODE` picks one)" if left
                                        else "no machine is left (`%smol up` starts one)")
    return f"{was} was active: the active machine is now {now}"
