"""The smol backend's checkpoints: a whole VM captured and exported as one file, or its
workspace and namespace alone (a machine smol can't capture whole), and restores of either.

Mixed into :class:`smolbench.backends.smol.SmolBackend`. What a machine sends is read bounded
(its saved parts streamed as base64 lines, counted to the checkpoint limit); a checkpoint
folder's ``captures`` is never a link, and each save captures into a store of its own.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, ParamSpec, TypeVar

from smol import ConnectOptions, ExecResult, Machine, SmolError

from .. import gate
from .._aio import _to_the_end
from ..errors import SmolbenchError
from ..gate import archive
from ..gate.gzipread import UnsafeCheckpoint
from ..gate.limits import LIMITS, human
from ..spec import MachineSpec
from .base import CheckpointInfo, MachineRef
from .smol_errors import HOST_BACKED, detail, translate
from .smol_guest import GUEST_RUN, READ_B64
from .smol_state import PARTS as STATE_PARTS
from .smol_state import STATE_ONLY, is_state, read_state, write_pointer, write_state

_PS = ParamSpec("_PS")
T = TypeVar("T")

B64_LINE = 65536  # characters of one of READ_B64's lines (48 KiB of a file)
STATE_TIMEOUT = 600.0  # seconds for the agent to save or load a namespace and workspace
CLOUD_POINTER = "smolbench-smol-cloud-checkpoint"


def _delete_quietly(handle: Machine) -> None:
    with contextlib.suppress(Exception):
        handle.delete()


class SmolParts:
    """What the checkpoint methods use of a :class:`SmolBackend` (which sets and defines these)."""

    name: ClassVar[str]
    target: str
    conn: ConnectOptions
    unlabelled: Callable[[str], None] | None
    _machines: dict[str, MachineRef]

    def _handle(self, ref: MachineRef) -> Machine:
        raise NotImplementedError

    def _register(self, ref: MachineRef, handle: Machine) -> None:
        raise NotImplementedError

    def _check_new(self, names: Iterable[str]) -> None:
        raise NotImplementedError

    def machine_name(self, name: str) -> str:
        raise NotImplementedError

    async def _ensure_available(self) -> None:
        raise NotImplementedError

    async def create(self, spec: MachineSpec, name: str) -> MachineRef:
        raise NotImplementedError

    async def _delete_after_failure(self, ref: MachineRef) -> None:
        raise NotImplementedError

    async def _request(self, ref: MachineRef, msg: dict[str, Any], timeout: float = ...) -> dict[str, Any]:
        raise NotImplementedError

    async def _run(self, handle: Machine, argv: list[str], where: str, *, timeout: float = ...,
                   cap: int = ..., take: Callable[[str], None] | None = None) -> ExecResult:
        raise NotImplementedError

    @staticmethod
    async def _sdk(fn: Callable[_PS, T], *args: _PS.args, **kwargs: _PS.kwargs) -> T:
        raise NotImplementedError

    @staticmethod
    async def _make(fn: Callable[[], T], undo: Callable[[T], None]) -> T:
        raise NotImplementedError


class SmolCheckpoints(SmolParts):
    """``checkpoint`` and ``restore`` of the smol backend."""

    async def checkpoint(self, machine: MachineRef, path: str) -> CheckpointInfo:
        """Save the live VM (RAM and disks) as a ``.smolcheckpoint`` at ``path``."""
        handle = self._handle(machine)
        path = os.path.abspath(path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if self.target == "cloud":
            # Cloud checkpoints live in smol cloud; the file at ``path`` points at one (stopped: none does, so it goes)
            made = await self._make(handle.checkpoint, lambda done: Machine.delete_checkpoint(done.id, self.conn))
            pointer = {
                "kind": CLOUD_POINTER,
                "id": made.id,
                "machine": machine.name,
                "size": made.size_bytes,
            }
            try:
                write_pointer(path, pointer)
            except BaseException:  # no file points at it: the cloud checkpoint goes too
                with contextlib.suppress(Exception):
                    await _to_the_end(self._sdk(Machine.delete_checkpoint, made.id, self.conn))
                raise
            return CheckpointInfo(path, self.name, int(made.size_bytes))
        # smol captures a machine as a folder (its chunks in a store beside it); what this
        # backend hands back is the one plain file it exports from that folder: the only kind
        # a checkpoint folder holds (gate/ckptpaths.py), and the kind any smol host restores.
        folder = os.path.dirname(path)
        # a store made for this save alone: one already in the folder (a copied folder's) may hold
        # objects its author planted, which smol's capture would take as already stored (seventh audit)
        captures = _own_folder(folder, "captures")
        store = tempfile.mkdtemp(prefix="store-", dir=captures)
        token = secrets.token_hex(6)
        capture = os.path.join(captures, f"{token}.smolcheckpoint")
        part = f"{path}.{token}.part"
        try:
            # Stopped (a Ctrl-C), an SDK call goes on in its thread: its files go once it wrote them.
            try:
                await _to_the_end(asyncio.to_thread(_checked_then, (store, captures), handle.checkpoint,
                                                    capture, store=store))
            except SmolError as exc:
                if HOST_BACKED not in str(exc).lower():
                    raise translate(exc) from exc
                return await self._save_state(machine, path)
            await _to_the_end(self._sdk(Machine.export_checkpoint, capture, part))
            os.replace(part, path)
        finally:
            await asyncio.to_thread(_remove_capture, capture, part, store)
        return CheckpointInfo(path, self.name, os.path.getsize(path))

    async def _save_state(self, machine: MachineRef, path: str) -> CheckpointInfo:
        """The workspace and namespace only, for a machine smol can't capture whole."""
        handle = self._handle(machine)
        stage = f"{GUEST_RUN}/state-{secrets.token_hex(6)}"
        try:
            done = await self._request(machine, {"op": "save", "path": stage}, timeout=STATE_TIMEOUT)
            left = [LIMITS.checkpoint]  # both parts together, counted as they come
            parts = {n: await self._read_part(handle, f"{stage}/{n}", machine.name, left) for n in STATE_PARTS}
            archive.check_workspace(parts["workspace.tar"], f"machine {machine.name}'s workspace")
        finally:
            with contextlib.suppress(Exception):
                await self._run(handle, ["rm", "-rf", stage], f"machine {machine.name!r}")
        size = await _to_the_end(asyncio.to_thread(write_state, path, machine.name, parts))  # stopped: not after the save's undo
        warnings = [STATE_ONLY]
        if done.get("skipped"):
            warnings.append(f"not saved (can't be pickled): {gate.terminal.listed(done['skipped'])}")
        return CheckpointInfo(path, self.name, size, warnings)

    async def _read_part(self, handle: Machine, path: str, machine: str, left: list[int]) -> bytes:
        """A saved file of the machine's, streamed as base64 lines and counted as it comes:
        stopped at the checkpoint limit (``left``, shared by the parts), never read whole first."""
        got, pending, held = bytearray(), [], [0]  # pending: the pieces (held: characters) of a line not ended
        name = os.path.basename(path)
        odd = f"machine {machine}'s saved {name} came in a form smolbench doesn't write: stopped"

        def take(text: str) -> None:
            while text:
                cut = text.find("\n")
                if cut < 0:
                    pending.append(text)
                    held[0] += len(text)
                    if held[0] > B64_LINE:
                        raise SmolbenchError(odd)
                    return
                line, text = "".join(pending) + text[:cut], text[cut + 1:]
                pending.clear()
                held[0] = 0
                try:
                    block = base64.b64decode(line, validate=True)  # (binascii's strict_mode is 3.11's)
                except binascii.Error:
                    raise SmolbenchError(odd) from None
                left[0] -= len(block)
                if left[0] < 0:
                    raise UnsafeCheckpoint(f"machine {machine} sends a checkpoint of more than the checkpoint limit "
                                           f"of {human(LIMITS.checkpoint)} (stopped there): keep less in the machine, "
                                           "or raise it with `%smol config checkpoint-limit 4G`")
                got.extend(block)

        res = await self._run(handle, ["python3", "-c", READ_B64, path], f"machine {machine!r}",
                              timeout=STATE_TIMEOUT, take=take)
        if res.exit_code != 0 or pending:
            raise SmolbenchError(f"machine {machine!r}: reading its saved {name} failed "
                                 f"({detail(res.stderr, 80) or f'exit {res.exit_code}'}): `%smol status`")
        return bytes(got)

    async def _restore_state(self, path: str, name: str, spec: MachineSpec) -> MachineRef:
        """A fresh machine from ``spec`` with a state checkpoint's workspace and namespace."""
        parts = await asyncio.to_thread(read_state, path)
        archive.check_workspace(parts.get("workspace.tar", b""), f"checkpoint {os.path.basename(path)}")
        ref = await self.create(spec, name)
        handle = self._handle(ref)
        stage = f"{GUEST_RUN}/restore-{secrets.token_hex(6)}"
        try:
            await self._run(handle, ["mkdir", "-p", stage], f"machine {name!r}")
            for part, data in parts.items():
                await self._sdk(handle.write_file, f"{stage}/{part}", data, 0o600)
            done = await self._request(ref, {"op": "load", "path": stage}, timeout=STATE_TIMEOUT)
            await self._run(handle, ["rm", "-rf", stage], f"machine {name!r}")
        except BaseException:
            await self._delete_after_failure(ref)
            raise
        ref.info["restore_warnings"] = [STATE_ONLY]
        if done.get("skipped"):
            ref.info["restore_warnings"].append(f"not restored: {gate.terminal.listed(done['skipped'])}")
        return ref

    def _checkpoint_id(self, path: str) -> str:
        if not os.path.exists(path):
            raise SmolbenchError(f"no checkpoint at {path}: list them with `%smol checkpoint list`")
        if self.target == "local":
            return os.path.abspath(path)
        try:
            with open(path, encoding="utf-8") as fh:
                pointer = json.load(fh)
        except (OSError, ValueError, UnicodeDecodeError):
            pointer = None
        if not isinstance(pointer, dict) or pointer.get("kind") != CLOUD_POINTER:
            raise SmolbenchError(
                f"{path} is not a smol cloud checkpoint: restore it with --target local",
                api=f"{path} is not a smol cloud checkpoint: restore it from a Session(target='local')",
            )
        checkpoint_id = pointer.get("id")
        # The SDK uploads an id that names a file on this host (a copied pointer's "~/.ssh/id_rsa"):
        # only an id's own characters, and never one a file in the kernel's folder answers to.
        if not isinstance(checkpoint_id, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,128}", checkpoint_id) or os.path.lexists(checkpoint_id):
            raise SmolbenchError(
                f"{os.path.basename(path)} does not name a smol cloud checkpoint (an id is 1-128 letters, digits, "
                "'-' or '_', and never a file here): restore only pointers smolbench wrote"
            )
        return checkpoint_id

    def _restore_network(self, spec: MachineSpec) -> None:
        """Refuse a cloud restore whose network the SDK can't scope as ``create`` does: its restore
        takes no allow-list there (open or blocked, and open reaches the private ranges ``create``
        leaves out); a machine without network restores blocked. Locally a restored VM keeps the
        rules its capture was made with (a save of this user's, signed: that Smolfile's, applied by
        ``create``; a file from elsewhere is refused unless trusted)."""
        mode = spec.policy.mode
        if self.target == "cloud" and mode in ("allow", "on"):
            scoped = "allows only some hosts" if mode == "allow" else "allows the internet but not private networks"
            raise SmolbenchError(
                f"this Smolfile {scoped}, which smol can't apply to a restored microVM: restore with "
                "net = false (and no allow) in the Smolfile, then `%smol up` a machine with the network you need"
            )

    async def restore(self, path: str, name: str, spec: MachineSpec, *, isolated: bool = False) -> MachineRef:
        """A new live VM from a checkpoint, its agent renamed to ``name``."""
        self._check_new([name])
        checkpoint_id = self._checkpoint_id(path)
        if self.target == "local" and is_state(checkpoint_id):
            return await self._restore_state(checkpoint_id, name, spec)
        await self._ensure_available()
        smol_name = self.machine_name(name)
        conn = self.conn
        self._restore_network(spec)
        if self.target == "cloud":

            def restore() -> Machine:
                if os.path.lexists(checkpoint_id):  # checked again at the SDK's own check: it uploads a file
                    raise SmolbenchError(f"a file named {checkpoint_id!r} is in this folder: restore from elsewhere")
                return Machine.restore_checkpoint(checkpoint_id, smol_name, conn=conn, network=False)
        else:

            def restore() -> Machine:
                return Machine.restore_checkpoint(checkpoint_id, smol_name, conn=conn)

        if self.unlabelled is not None:
            self.unlabelled(smol_name)
        handle = await self._make(restore, _delete_quietly)
        ref = MachineRef(name, self.name, spec)
        self._register(ref, handle)
        try:
            await self._find_agent(ref, handle)
            info = (await self._request(ref, {"op": "ping"}))["info"]
            ref.info["python"] = str(info.get("python", ""))
            # The agent woke up as the checkpointed machine: give it its new name (as the
            # sandbox backend's restore does, this re-applies the seed it had).
            await self._request(ref, {"op": "seed", "seed": info.get("seed"), "name": name, "restored": True})
        except BaseException:
            await self._delete_after_failure(ref)
            raise
        return ref

    async def _find_agent(self, ref: MachineRef, handle: Machine) -> None:
        """Point ``ref`` at the agent socket inside a restored machine (one agent per VM)."""
        res = await self._run(handle, ["ls", "-1", GUEST_RUN], f"machine {ref.name!r}")
        socks = sorted(n for n in res.stdout.split() if n.endswith(".sock"))
        if res.exit_code != 0 or not socks:
            raise SmolbenchError(
                f"the checkpoint restored as {ref.name!r} has no smolbench agent in it: "
                "was it made by the smol backend?"
            )
        base = socks[0][: -len(".sock")]
        ref.info.update(socket=f"{GUEST_RUN}/{socks[0]}", log=f"{GUEST_RUN}/{base}.log")


def _own_folder(parent: str, name: str) -> str:
    """``parent/name``, made if missing, and a folder of its own: never a link (a copied folder's
    ``store`` or ``captures`` linked elsewhere had a VM's RAM and disks written, and pruned, there)."""
    path = os.path.join(parent, name)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    _checked_then((path,), lambda: None)
    return path


def _checked_then(folders: Iterable[str], fn: Callable[_PS, T], *args: _PS.args, **kwargs: _PS.kwargs) -> T:
    """``fn(...)`` once each of ``folders`` is a folder reached without following its last link."""
    for folder in folders:
        try:
            os.close(os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC))
        except OSError:
            raise SmolbenchError(
                f"{folder} is a link or not a folder: smolbench keeps a machine's captures only in a "
                "folder of its own; remove it and save again"
            ) from None
    return fn(*args, **kwargs)


def _remove_capture(capture: str, part: str, store: str) -> None:
    """A capture folder once exported, its store, and a half export."""
    if os.path.isdir(capture) and not os.path.islink(capture):
        shutil.rmtree(capture, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(capture)
    with contextlib.suppress(OSError):
        os.unlink(part)
    if os.path.isdir(store) and not os.path.islink(store):  # this save's own (mkdtemp's): it goes whole
        shutil.rmtree(store, ignore_errors=True)
