"""The node agent: one Ray actor per node, pinned there, owning every machine on that node.

It runs the node's own backend (sandbox or process here; smol where a node has working
KVM) and only moves bytes: a cell's reply stream is yielded raw, chunk by chunk, to the
driver, whose gate decodes it. Checkpoints and smol parents' portable checkpoints are
artifacts (artifact.py): kept by content address, fetched by another node or the driver
as data, and kept there only when their size and hash are right. Control replies (fork,
seed) are checked by the same gate here, on trusted host code, and only plain names cross back. At start it sweeps run
folders of dead owners from its data folder (``SMOLBENCH_NODE_DIR``), and again when it closes; its machines die
with it (``--die-with-parent``), and Ray ends it when the driver (the kernel) dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import sys
import tempfile
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from .._pkgtrust import open_root
from ..backends import _rundir
from ..backends.base import Backend, MachineRef
from ..errors import SmolbenchError
from ..gate import archive as gate_archive
from ..gate import limits as gate_limits
from ..spec import MachineSpec
from . import artifact
from .batch import DATA, END, FAIL, Credit, failure, frame, kind_of

KINDS = ("sandbox", "process", "smol")
BATCH_OPS = ("exec", "create", "delete")
MESSAGE = 1024 * 1024  # frames ready together go back as one message of about this much at most


def node_kind(resources: dict[str, float]) -> str:
    """The backend a node declares (a ``smolbench_backend_KIND`` resource), else ``auto``."""
    for kind in KINDS:
        if resources.get(f"smolbench_backend_{kind}", 0) > 0:
            return kind
    return "auto"


FAKE_SMOL = "SMOLBENCH_TEST_FAKE_SMOL"  # tests only: the folder of tests/fakesmol.py, used in place of smol's engine


NO_BWRAP = ("node {node} ({host}) runs no machines: it has no bubblewrap, so they would be plain processes with "
            "NO isolation; install bubblewrap there (`apt-get install bubblewrap`), or declare the process backend "
            "on purpose (`ray start ... --resources '{{\"smolbench_backend_process\": 1}}'`)")


def refusal(kind: str, node: str) -> str:
    """Why a node runs no machines ('' when it does): an ``auto`` node without bubblewrap would
    run untrusted cells as the Ray worker's user, unlike a local ``auto``, which warns loudly."""
    from ..backends.sandbox import bwrap_path

    if kind == "auto" and not bwrap_path():
        return NO_BWRAP.format(node=node[:8], host=socket.gethostname())
    return ""


def _make_backend(kind: str, data_dir: Path, session: str, own: Path) -> tuple[Backend, Any]:
    """The node's backend, and (tests only) the fake smol engine behind it."""
    from ..backends.process import ProcessBackend
    from ..backends.sandbox import SandboxBackend

    if kind == "auto":  # with bubblewrap (see refusal); a refused node's backend never starts a machine
        kind = "sandbox" if not refusal(kind, "") else "process"
    if kind == "sandbox":
        return SandboxBackend(runtime_dir=str(data_dir)), None
    if kind == "process":
        return ProcessBackend(runtime_dir=str(data_dir)), None
    from ..backends import smol as smolmod
    from ..backends import smol_checkpoints

    fake = None
    if os.environ.get(FAKE_SMOL):  # a Ray worker can't be monkeypatched by the test that started it
        sys.path.insert(0, os.environ[FAKE_SMOL])
        import fakesmol

        (own / "f").mkdir()
        fake = fakesmol.FakeHost(own / "f")
        smolmod.Machine = smol_checkpoints.Machine = fake.cls  # type: ignore[misc]
        smolmod.READY_TIMEOUT = 15.0
    backend = smolmod.SmolBackend(target="local", probe=fake is None, session=f"{session}-{uuid.uuid4().hex[:4]}")
    backend.extra_labels = {AGENT_LABEL: str(own)}
    backend.unlabelled = lambda name: _record(own, name)
    return backend, fake


AGENT_LABEL = "smolbench-agent"  # on a smol node's machines: the folder of the agent that owns them
RESTORED = "restored-vms"  # in an agent's folder: smol names of the VMs it restored (they carry no labels)
SMOL_NAME = re.compile(r"smolbench-[a-z0-9][a-z0-9.-]{0,62}")


def _record(own: Path, name: str) -> None:
    fd = os.open(own / RESTORED, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "a") as f:
        f.write(name + "\n")


def _restored_by_dead_agents(data_dir: Path | None) -> list[str]:
    """The VMs agents whose owner is gone restored in ``data_dir`` (found by name, not label)."""
    names: list[str] = []
    with contextlib.suppress(OSError):
        for folder in (data_dir.iterdir() if data_dir is not None else []):
            if (folder.name.startswith("smolbench-agent-") and not folder.is_symlink() and folder.is_dir()
                    and folder.lstat().st_uid == os.getuid() and _rundir.owner_alive(folder) is False):
                text = gate_archive.read_small(folder / RESTORED, 1024 * 1024) or ""
                names += [n for n in text.split() if SMOL_NAME.fullmatch(n)]
    return names


def sweep_smol(data_dir: Path | None = None) -> list[str]:
    """Delete smol machines whose node agent is gone (its folder's owner died), found by label,
    and those it restored (recorded in its folder in ``data_dir``); branches before their
    parents. Returns their names."""
    from ..backends import smol as smolmod

    conn = smolmod.ConnectOptions(target="local")
    try:
        found = list(smolmod.Machine.list(conn, {"smolbench": "1"}))
    except Exception:  # no engine here (yet): nothing of ours can be left
        return []
    # owner_alive is None for a folder this host doesn't have (a machine restored from another node's
    # checkpoint may carry that node's label): only a recorded owner that is gone counts
    left = [m.name for m in found
            if AGENT_LABEL in (m.labels or {}) and _rundir.owner_alive(Path(m.labels[AGENT_LABEL])) is False]
    restored = set(_restored_by_dead_agents(data_dir))
    if restored:
        with contextlib.suppress(Exception):
            left += [m.name for m in smolmod.Machine.list(conn) if m.name in restored and m.name not in left]
    gone: list[str] = []
    for _ in range(8):  # smol refuses to delete a machine whose branches still exist: they go first
        for name in list(left):
            with contextlib.suppress(Exception):
                smolmod.Machine.delete_by_name(name, conn)
                gone.append(name)
                left.remove(name)
        if not left:
            break
    return gone


def node_dir(node_id: str) -> Path:
    """This node's data folder (``$SMOLBENCH_NODE_DIR``, else one per user and node in the temporary
    folder), made if missing and used only if it is this user's (or root's), writable by no one else,
    reached without a link through folders no other user can swap it in (sticky /tmp will do): a
    folder another local user planted there first would have held its artifacts and captures."""
    chosen = os.environ.get("SMOLBENCH_NODE_DIR")
    base = Path(chosen or Path(tempfile.gettempdir()) / f"smolbench-node-{os.getuid()}-{node_id[:12]}")
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        os.close(open_root(base, what="node folder"))
    except SmolbenchError as exc:
        how = " ($SMOLBENCH_NODE_DIR names it)" if chosen else ", or set $SMOLBENCH_NODE_DIR to a folder of your own"
        raise SmolbenchError(f"{exc}{how}") from None
    return base


class NodeAgent:
    """Machines on one Ray node (wrapped with ``ray.remote`` by the driver)."""

    def __init__(self, session: str, kind: str = "auto", max_starts: int = 2,
                 limits: dict[str, float] | None = None) -> None:
        import ray

        if limits:  # the kernel's `%smol config`, not this process's defaults
            gate_limits.apply(limits)
        self.session = session
        self.node_id = ray.get_runtime_context().get_node_id()
        self.data_dir = node_dir(self.node_id)
        # this agent's own folder (artifacts, smol captures), swept like a run folder once it is gone
        self.own = _rundir.make(str(self.data_dir), prefix="smolbench-agent-")
        self.refused = refusal(kind, self.node_id)
        self.backend, self._fake = _make_backend(kind, self.data_dir, session, self.own)
        # leftovers of sessions whose agent died (kernel killed, node restarted): their microVMs (found
        # by their agent's folder, so before those go), then their run folders
        self.swept_machines = sweep_smol(self.data_dir) if self.backend.name == "smol" else []
        self.swept = [str(p) for p in _rundir.sweep(str(self.data_dir))]
        self.store = artifact.Store(self.own)
        self.exports: dict[tuple[str, str], dict[str, Any]] = {}  # (machine, parent state) -> its artifact
        self.sources: dict[str, str] = {}  # machine -> the artifact it was restored from (a microVM reads it)
        # the driver's uses of each artifact (a save, receive or fetch each gives one, ``forget`` ends
        # it): two uses of the same bytes share one content address, so none drops it under another
        self.uses: Counter[str] = Counter()
        self._save_lock: asyncio.Lock | None = None
        self.refs: dict[str, MachineRef] = {}
        self.max_starts = max_starts
        self._starts: asyncio.Semaphore | None = None
        # what `%smol status` shows: agent calls by kind, and how many machine requests they carried
        self.calls: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        self._batches: dict[str, dict[int, asyncio.Future[None]]] = {}
        self._credits: dict[str, Credit] = {}
        self._incoming: dict[str, asyncio.Queue[bytes | None]] = {}  # transfers from the driver (receive)
        self._closed: set[str] = set()
        self._booting: dict[str, asyncio.Future[None]] = {}  # machine -> the batch request booting it
        self._forking: dict[str, asyncio.Lock] = {}

    def _count(self, op: str, requests: int = 1) -> None:
        self.calls[op] += 1
        self.requests[op] += requests

    def _gate(self) -> asyncio.Semaphore:
        if self._starts is None:  # made on the actor's own event loop
            self._starts = asyncio.Semaphore(self.max_starts)
        return self._starts

    def _allowed(self) -> None:
        if self.refused:
            raise SmolbenchError(self.refused)

    def _ref(self, name: str) -> MachineRef:
        ref = self.refs.get(name)
        if ref is None:
            raise SmolbenchError(f"machine {name!r} is not on node {self.node_id[:8]} (deleted, or its node restarted)")
        return ref

    async def limits(self, spec: MachineSpec) -> str:
        """This node's limits for ``spec``, in its backend's own words (``%smol status``)."""
        describe = getattr(self.backend, "limits_status", None)
        if describe is not None:
            return str(describe(spec))
        from ..status import _vm_limits

        return _vm_limits(spec)

    async def set_limits(self, limits: dict[str, float]) -> None:
        """The kernel's limits changed (``%smol config``): this node's checks follow."""
        gate_limits.apply(limits)

    async def describe(self) -> dict[str, Any]:
        """What ``%smol status`` shows about this node."""
        return {"refused": self.refused, "limits": gate_limits.snapshot(), "node": self.node_id, "host": socket.gethostname(), "pid": os.getpid(), "backend": self.backend.name,
                "isolation": self.backend.isolation, "data_dir": str(self.data_dir), "live": sorted(self.refs),
                "swept": list(self.swept), "swept_machines": list(self.swept_machines), "calls": dict(self.calls),
                "requests": dict(self.requests)}

    async def run_batch(self, batch_id: str, op: str, items: list[tuple[str, Any]]) -> AsyncIterator[bytes]:
        """Requests for many machines in one call (see batch.py): run side by side, their replies
        framed by index and sent as they come; ``cancel_requests`` stops some of them."""
        if op not in BATCH_OPS:
            raise SmolbenchError(f"unknown batch request {op!r}: one of {', '.join(BATCH_OPS)}")
        self._count(op, len(items))
        out: asyncio.Queue[bytes] = asyncio.Queue()
        # per request, bytes sent and not yet taken by its caller (``grant``): a machine's stream
        # is read no faster than its own caller takes it, never into an unbounded queue here or
        # on the driver, whatever its siblings do (end frames are not counted: they never wait)
        credit = self._credits[batch_id] = Credit(len(items))

        async def one(i: int, name: str, arg: Any) -> None:
            end = frame(i, END)
            try:
                if op == "exec":
                    stream = self._transport()
                    async with contextlib.aclosing(stream(self._ref(name), arg)) as chunks:
                        async for chunk in chunks:
                            for piece in credit.pieces(bytes(chunk)):
                                await credit.spend(i, len(piece))
                                out.put_nowait(frame(i, DATA, piece))
                elif op == "create":
                    await self._create(arg, name)
                else:
                    await self._delete([name])
            except BaseException as exc:
                end = frame(i, FAIL, failure(exc))
                if not isinstance(exc, Exception):
                    raise
            finally:
                out.put_nowait(end)

        tasks: dict[int, asyncio.Future[None]] = {i: asyncio.ensure_future(one(i, name, arg)) for i, (name, arg) in enumerate(items)}
        self._batches[batch_id] = tasks
        if op == "create":  # before anything else runs: a delete that comes meanwhile finds the boot
            self._booting.update({name: tasks[i] for i, (name, _) in enumerate(items)})
        try:
            left = len(items)
            while left:
                ready = [await out.get()]
                while not out.empty() and sum(map(len, ready)) < MESSAGE:
                    ready.append(out.get_nowait())
                left -= sum(1 for f in ready if kind_of(f) != DATA)
                yield b"".join(ready)
        finally:
            self._batches.pop(batch_id, None)
            self._credits.pop(batch_id, None)
            for i, (name, _) in enumerate(items):
                if self._booting.get(name) is tasks[i]:
                    del self._booting[name]
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)

    async def cancel_requests(self, batch_id: str, indices: list[int]) -> None:
        """Stop some requests of a running batch (their callers left: Ctrl-C, a timeout)."""
        tasks = self._batches.get(batch_id, {})
        for i in indices:
            if i in tasks:
                tasks[i].cancel()

    async def grant(self, batch_id: str, index: int, n: int) -> None:
        """The caller of a running batch's request took ``n`` more of its bytes: it may send on."""
        credit = self._credits.get(batch_id)
        if credit is not None:
            credit.grant(index, n)

    def _transport(self) -> Any:
        """The backend's raw request transport: agent-host backends' socket, smol's relay through client.py."""
        return getattr(self.backend, "_stream", None) or getattr(self.backend, "_relay")  # noqa: B009

    async def create(self, spec: MachineSpec, name: str) -> dict[str, Any]:
        """Boot one machine."""
        self._count("create")
        return await self._create(spec, name)

    async def _create(self, spec: MachineSpec, name: str) -> dict[str, Any]:
        """Boot one machine (at most ``max_starts`` boot at once on this node)."""
        self._allowed()
        async with self._gate():
            ref = await self.backend.create(spec, name)
        self.refs[name] = ref
        return {"node": self.node_id, "backend": self.backend.name}

    async def branch(self, parent: str, names: list[str], seeds: list[int | None]) -> list[str]:
        """Live copy-on-write branches of a machine on this node: one batch, one fork."""
        self._count("branch", len(names))
        # one fork at a time per parent (a machine serves one request at a time): branches lost
        # with another node are branched again from here concurrently, one request each
        lock = self._forking.setdefault(parent, asyncio.Lock())
        async with lock, self._gate():
            refs = await self.backend.branch(self._ref(parent), names, seeds)
        for ref in refs:
            self.refs[ref.name] = ref
        return [ref.name for ref in refs]

    async def stream(self, name: str, msg: dict[str, Any]) -> AsyncIterator[bytes]:
        """One request to a machine; its raw reply bytes, as they come (the driver's gate decodes them)."""
        self._count("exec")
        ref = self._ref(name)
        stream = self._transport()
        async for chunk in stream(ref, msg):
            yield bytes(chunk)

    async def control(self, name: str, msg: dict[str, Any]) -> dict[str, Any]:
        """A control request (seed, interrupt), checked by the gate on this node; plain data back."""
        self._count("control")
        request = getattr(self.backend, "_request")  # noqa: B009
        if msg.get("op") == "interrupt":  # it names the driver's id of its cell: sent as it is
            # (an agent that takes it and never answers costs a grace period, not a task for ever)
            with contextlib.suppress(SmolbenchError, OSError, asyncio.TimeoutError):
                await asyncio.wait_for(request(self._ref(name), msg), gate_limits.LIMITS.grace)
            return {"status": "ok"}
        done = await request(self._ref(name), msg)
        return {"status": str(done.get("status"))}

    async def delete(self, names: list[str]) -> int:
        """Delete machines (and their branches); unknown names are not an error."""
        self._count("delete", len(names))
        return await self._delete(names)

    async def _delete(self, names: list[str]) -> int:
        count = 0
        for name in names:
            boot = self._booting.get(name)
            if boot is not None:  # its caller left while it booted: stop the boot, then delete what it made
                boot.cancel()
                await asyncio.gather(boot, return_exceptions=True)
            ref = self.refs.pop(name, None)
            self._forking.pop(name, None)
            if ref is not None:
                await self.backend.delete(ref)
                count += 1
        for name in [n for n in self.refs if n not in {r.name for r in self.backend.list()}]:
            self.refs.pop(name, None)  # branches that went with a deleted parent
        self._drop_files(names)
        return count

    def _drop_files(self, names: list[str]) -> None:
        """The artifacts only deleted machines needed: their exports and what they were restored
        from (each up to the checkpoint limit, on this node's disk until the session ended)."""
        gone = set(names)
        dropped = {self.exports.pop(k)["digest"] for k in [k for k in self.exports if k[0] in gone]}
        dropped |= {self.sources.pop(n) for n in names if n in self.sources}
        for digest in dropped:
            self._release(digest)

    def _release(self, digest: str) -> None:
        """Drop an artifact once nothing needs it: no machine restored from it, no export, no
        driver's use (the same bytes saved, received or fetched twice are one file here)."""
        held = set(self.sources.values()) | {v["digest"] for v in self.exports.values()}
        if digest not in held and not self.uses.get(digest):
            self.store.drop(digest)

    async def close(self) -> int:
        """Delete every machine on this node."""
        n = len(self.refs)
        try:
            await self.backend.close()
        finally:
            self.refs.clear()
            if self._fake is not None:
                self._fake.cleanup()
            _rmtree(self.own)
            # and what agents that died meanwhile left (their machines went with them): a node's
            # later agent may be a long way off
            with contextlib.suppress(Exception):
                if self.backend.name == "smol":
                    sweep_smol(self.data_dir)
                _rundir.sweep(str(self.data_dir))
        return n

    # -- artifacts: checkpoints that cross the cluster as data ---------------------------

    async def save(self, name: str) -> dict[str, Any]:
        """Checkpoint a machine here into the store: its content address, size, format and warnings
        (one use of it, until the driver's ``forget``).

        A smol checkpoint is one portable file already (the backend exports smol's capture),
        which any smol node restores."""
        art = await self._save(name)
        self.uses[art["digest"]] += 1
        return art

    async def _save(self, name: str) -> dict[str, Any]:
        ref = self._ref(name)
        captures = self.own / "captures"
        captures.mkdir(mode=0o700, exist_ok=True)
        async with self._saving():
            path = str(captures / f"{uuid.uuid4().hex[:12]}.smolcheckpoint")
            try:
                info = await self.backend.checkpoint(ref, path)
                fmt = _format(self.backend.name, path)
                digest, size = await asyncio.to_thread(self.store.add, path)
            finally:
                _unlink(path)
        return {"digest": digest, "size": size, "format": fmt, "warnings": list(info.warnings),
                "backend": self.backend.name}

    def _saving(self) -> asyncio.Lock:
        if self._save_lock is None:  # one capture at a time: pruning must not race a capture
            self._save_lock = asyncio.Lock()
        return self._save_lock

    async def export(self, name: str, state: str) -> dict[str, Any]:
        """A portable checkpoint of a warm parent, made once per parent state (``state``)."""
        key = (name, state)
        if key not in self.exports or not self.store.has(self.exports[key]["digest"]):
            for old in [k for k in self.exports if k[0] == name]:
                self._release(self.exports.pop(old)["digest"])
            self.exports[key] = await self._save(name)
        return self.exports[key]

    async def chunks(self, digest: str) -> AsyncIterator[bytes]:
        """An artifact's bytes (a Ray streaming generator: another node or the driver fetches it)."""
        if not self.store.has(digest):
            raise SmolbenchError(f"node {self.node_id[:8]} no longer has artifact {digest[:12]}…")
        for block in self.store.chunks(digest):
            yield block

    async def fetch(self, source: Any, digest: str, size: int, where: str) -> int:
        """Fetch an artifact from another node's agent once; the bytes received (0: had it). One use
        of it either way, until the driver's ``forget``."""
        async def stream() -> AsyncIterator[object]:
            async for ref in artifact.chunks_from(source, digest):
                yield await ref

        got = await self.store.receive(digest, size, stream(), where)
        self.uses[digest] += 1
        return got

    async def receive(self, transfer: str, digest: str, size: int) -> int:
        """An artifact the driver sends (a checkpoint to restore here), a chunk per ``give`` call,
        each call waiting while AHEAD chunks wait here; kept if its size and hash are right."""
        queue = self._incoming.setdefault(transfer, asyncio.Queue(artifact.AHEAD))

        async def stream() -> AsyncIterator[object]:
            while (block := await queue.get()) is not None:
                yield block

        try:
            got = await self.store.receive(digest, size, stream(), "the driver")
            self.uses[digest] += 1  # until the driver's forget
            return got
        finally:
            self._closed.add(transfer)
            self._incoming.pop(transfer, None)
            while not queue.empty():  # a give waiting for room ends
                queue.get_nowait()

    async def give(self, transfer: str, block: bytes | None) -> bool:
        """One chunk of what ``receive`` takes (None: the end); False once it takes no more."""
        if transfer in self._closed:
            return False
        await self._incoming.setdefault(transfer, asyncio.Queue(artifact.AHEAD)).put(block)
        return transfer not in self._closed

    async def restore(self, digest: str, name: str, spec: MachineSpec) -> dict[str, Any]:
        """A machine from an artifact in the store (checked by this node's backend's restore)."""
        path = str(self.store.path(digest))
        if not self.store.has(digest):
            raise SmolbenchError(f"node {self.node_id[:8]} has no artifact {digest[:12]}…: fetch it first")
        self._allowed()
        async with self._gate():
            ref = await self.backend.restore(path, name, spec)
        self.refs[name] = ref
        if _format(self.backend.name, path) == "smol":  # a microVM may read it while it lives: dropped with it
            self.sources[name] = digest
        return {"node": self.node_id, "backend": self.backend.name,
                "warnings": list(ref.info.get("restore_warnings") or [])}

    async def forget(self, digest: str) -> None:
        """The driver's use of an artifact (a save, receive or fetch) ended: dropped if nothing else needs it."""
        if self.uses.get(digest):
            self.uses[digest] -= 1
        self._release(digest)


def _format(backend: str, path: str) -> str:
    """What kind of checkpoint a backend wrote: ``agenthost`` (sandbox, process), ``smol-state``
    (a smol machine's workspace and namespace) or ``smol`` (a whole microVM)."""
    if backend != "smol":
        return "agenthost"
    from ..backends.smol_state import is_state

    return "smol-state" if is_state(path) else "smol"


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
