"""Machine state that crosses nodes as an artifact: smol replicas and checkpoints of cluster machines.

- A warm smol parent reaches another smol node as a portable checkpoint: its node captures
  it once per parent state (``Machine.checkpoint`` into the node's chunk store, then
  ``Machine.export_checkpoint``), the other node's agent fetches it once by content address,
  restores it as the replica (a branch source) and branches it locally.
- ``%smol checkpoint save`` of a cluster machine saves it on its node and brings the file to
  the driver's checkpoint folder as data; ``restore`` sends it to a node of the right backend.

Every receiver checks size and hash (artifact.py), then the format with the gate's own checks
(``gate.archive`` for sandbox and process checkpoints, ``smol_state`` for a smol machine's
workspace and namespace) before any backend sees it. Nothing here unpickles or extracts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tarfile
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from .._aio import _to_the_end
from ..backends.base import CheckpointInfo, MachineRef
from ..errors import SmolbenchError
from ..gate import archive
from ..spec import MachineSpec
from . import artifact, placement

if TYPE_CHECKING:
    from .backend import ClusterBackend, Node

FITS = {"agenthost": ("sandbox", "process"), "smol-state": ("smol",), "smol": ("smol",)}


def _short(node_id: str) -> str:
    return node_id[:8]


# -- smol replicas ----------------------------------------------------------------------------


def by_checkpoint(home: Node, node: Node) -> bool:
    """True when a replica on ``node`` of a parent on ``home`` ships a portable checkpoint."""
    return home.backend == "smol" and node.backend == "smol"


async def export(cb: ClusterBackend, parent: MachineRef, key: tuple[str, int]) -> dict[str, Any]:
    """The parent's portable checkpoint on its own node, made once per parent state (before it forks:
    a machine serves one request at a time)."""
    home = cb._node_of(parent)
    return dict(await cb._call(home, home.agent.export.remote(parent.name, f"{key[0]}@{key[1]}")))


async def smol_replica(cb: ClusterBackend, parent: MachineRef, node: Node, key: tuple[str, int],
                       want: str) -> dict[str, Any]:
    """The parent restored on ``node`` from its portable checkpoint, checked by state fingerprint:
    the replica's ref, fingerprint, bytes shipped, seconds and content address."""
    home = cb._node_of(parent)
    t0 = time.perf_counter()
    art = await export(cb, parent, key)
    fetching = node.agent.fetch.remote(home.agent, art["digest"], art["size"], f"node {_short(home.id)}")
    async with undone_if_left(node, lambda: _drop_received(cb, node, fetching, art["digest"])):
        shipped = await cb._call(node, fetching)
    name = f"replica-{parent.name}-{_short(node.id)}-{uuid.uuid4().hex[:4]}"
    try:
        ref = await _restore_on(cb, node, art["digest"], name, parent.spec, replica=True)
        try:
            got = await cb.fingerprint(ref)
            if got != want:
                why = ("smol saved only the variables that pickle: a machine booted from a local image"
                       if art["format"] == "smol-state" else "a variable's repr depends on where it runs")
                raise SmolbenchError(f"the checkpoint of {parent.name} restored on node {_short(node.id)} doesn't "
                                     f"match: state fingerprint {got} vs {want} ({why})")
        except BaseException:
            await cb.delete(ref)
            raise
    finally:  # the fetch's use ends: the replica holds the copy while it lives (one that failed made one a try)
        with contextlib.suppress(Exception):
            await _to_the_end(cb._call(node, node.agent.forget.remote(art["digest"])))
    return {"ref": ref, "fingerprint": got, "bytes_shipped": int(shipped), "seconds": time.perf_counter() - t0,
            "digest": art["digest"]}


async def _restore_on(cb: ClusterBackend, node: Node, digest: str, name: str, spec: MachineSpec,
                      replica: bool = False) -> MachineRef:
    node.live.add(name)  # counted while it boots
    restoring = node.agent.restore.remote(digest, name, spec)
    try:
        async with undone_if_left(node, lambda: _undo(cb, node, restoring, name)):
            done = await cb._call(node, restoring)
    except BaseException:
        node.live.discard(name)
        raise
    ref = cb._adopt(node, name, spec, None, **({"replica": True} if replica else {}))
    if done.get("warnings"):
        ref.info["restore_warnings"] = list(done["warnings"])
    return ref


# -- checkpoints of cluster machines -----------------------------------------------------------


async def save(cb: ClusterBackend, machine: MachineRef, path: str) -> CheckpointInfo:
    """Save ``machine`` on its node and bring the file to ``path`` as data, checked on arrival."""
    node = cb._node_of(machine)
    saving = node.agent.save.remote(machine.name)
    try:
        art = await cb._call(node, saving)
    except asyncio.CancelledError:  # the node saves on without its caller: what it saved goes once it is saved
        with contextlib.suppress(Exception):
            await _to_the_end(_forget(cb, node, saving))
        raise
    where = f"node {_short(node.id)}"
    part = path + ".part"
    try:
        async with contextlib.aclosing(_pull(cb, node, artifact.chunks_from(node.agent, art["digest"]))) as chunks:
            got = await artifact.receive_file(part, art["digest"], art["size"], chunks, where)
        fmt = await asyncio.to_thread(check, part, f"the checkpoint of {machine.name} sent from {where}")
        if fmt != art["format"]:
            raise artifact.Refused(f"the checkpoint from {where} is a {fmt} checkpoint, not the {art['format']} one "
                                   "its node made: refused")
        os.replace(part, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(part)
        with contextlib.suppress(SmolbenchError):
            await cb._call(node, node.agent.forget.remote(art["digest"]))
    return CheckpointInfo(path, cb.name, got, list(art["warnings"]))


@contextlib.asynccontextmanager
async def undone_if_left(node: Node, undo: Callable[[], Awaitable[Any]]) -> AsyncIterator[None]:
    """The block, and ``undo()`` to its end first if its caller leaves meanwhile (a Ctrl-C, a
    timeout: not an error) while ``node`` is up: the node's call goes on without its caller,
    and nobody else would undo what it makes (a machine, branches, an artifact)."""
    try:
        yield
    except BaseException as exc:
        if not isinstance(exc, Exception) and not node.lost:
            with contextlib.suppress(Exception):
                await _to_the_end(undo())
        raise


async def _undo(cb: ClusterBackend, node: Node, call: Any, *names: str) -> None:
    """Delete on ``node`` the machines an agent call made, once it ended (it may have made none)."""
    with contextlib.suppress(Exception):
        await cb._call(node, call)
    await cb._call(node, node.agent.delete.remote(list(names)))


async def _forget(cb: ClusterBackend, node: Node, saving: Any) -> None:
    """Drop the artifact a save call made, once it made it."""
    art = await cb._call(node, saving)
    await cb._call(node, node.agent.forget.remote(art["digest"]))


async def _pull(cb: ClusterBackend, node: Node, gen: Any) -> AsyncGenerator[object, None]:
    """The items of an agent's streaming generator, as they come (node loss raises InfraError)."""
    import ray

    it = gen.__aiter__()
    try:
        while True:
            try:
                ref = await cb._call(node, it.__anext__())
            except StopAsyncIteration:
                return
            yield await cb._call(node, ref)
    finally:
        with contextlib.suppress(Exception):
            ray.cancel(gen)


def check(path: str, what: str) -> str:
    """The format of a checkpoint file (a key of FITS), refused in one line if it is unsafe."""
    from ..backends import smol_state

    artifact.within_limit(os.path.getsize(path), what)
    if smol_state.is_state(path):
        try:
            archive.check(path)
            return "agenthost"
        except archive.UnsafeCheckpoint:
            raise
        except (SmolbenchError, tarfile.TarError, EOFError, OSError):
            pass
        parts = smol_state.read_state(path)  # one line if it is neither
        archive.check_workspace(parts["workspace.tar"], what)
        return "smol-state"
    return "smol"  # a whole microVM: smol's restore verifies its own checksums and layout


async def restore(cb: ClusterBackend, path: str, name: str, spec: MachineSpec, *,
                  isolated: bool = False) -> MachineRef:
    """A machine from a checkpoint file here, on a live node whose backend restores its format
    (``isolated``: not this kernel's own, so never on a process node, which has no isolation)."""
    try:
        fmt = await asyncio.to_thread(check, path, f"checkpoint {os.path.basename(path)}")
    except archive.UnsafeCheckpoint as exc:
        raise archive.UnsafeCheckpoint(f"{exc}: refused; delete it with `%smol checkpoint rm`") from None
    fits = tuple(k for k in FITS[fmt] if not (isolated and k == "process"))
    free = {n.id: n.slots - len(n.live) for n in cb._alive() if n.backend in fits}
    if not free:
        kinds = " or ".join(fits)
        raise SmolbenchError(f"checkpoint {os.path.basename(path)} needs a {kinds} node and this cluster has none "
                             "up: add one, or restore it without --ray",
                             api=f"checkpoint {os.path.basename(path)} needs a {kinds} node and this cluster has none "
                             "up: add one, or restore it from a Session without ray=")
    node = cb.nodes[placement.least_loaded(free)]
    digest, size = await asyncio.to_thread(artifact.hash_file, path)
    await send(cb, node, path, digest, size)

    async def forget() -> None:
        with contextlib.suppress(SmolbenchError):
            await cb._call(node, node.agent.forget.remote(digest))

    try:
        ref = await _restore_on(cb, node, digest, name, spec)
    except BaseException:
        await _to_the_end(forget())
        raise
    try:  # this use ends; a restored microVM may still read its checkpoint: the node drops it with the machine
        await _to_the_end(forget())
    except asyncio.CancelledError:  # cancelled after the machine came up: its caller never gets it
        await _to_the_end(cb.delete(ref))
        raise
    return ref


async def send(cb: ClusterBackend, node: Node, path: str, digest: str, size: int) -> int:
    """A file's bytes to ``node``, a chunk per call, each sent once the node has room for it (never
    the whole file in the object store at once); the node keeps them if size and hash match."""
    transfer = uuid.uuid4().hex
    receiving = node.agent.receive.remote(transfer, digest, size)

    async def end() -> None:  # the node's receive ends (refused if it is short): none waits for a sender gone
        with contextlib.suppress(Exception):
            await cb._call(node, node.agent.give.remote(transfer, None))

    async def undo() -> None:
        await end()
        await _drop_received(cb, node, receiving, digest)

    async with undone_if_left(node, undo):
        try:
            for block in artifact.read_chunks(path):
                if not await cb._call(node, node.agent.give.remote(transfer, block)):
                    break  # it takes no more (it had the file, or refused it): its answer says
        except Exception:
            await end()
            raise
        await end()
        return int(await cb._call(node, receiving))


async def _drop_received(cb: ClusterBackend, node: Node, receiving: Any, digest: str) -> None:
    """End the use a receive (or fetch) call gave, once it ended: its node drops the artifact if
    nothing else there needs it (it may have had it already)."""
    await cb._call(node, receiving)
    await cb._call(node, node.agent.forget.remote(digest))
