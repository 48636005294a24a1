"""The smol backend: every machine is a microVM with its own guest kernel (smolmachines SDK).

A machine is ``smol.Machine.create(...)`` from an OCI image with python3 in it.
The guest agent (``smolbench/guest``) and cloudpickle are copied in with
``write_file`` and the agent is started detached; the host can't reach its
Unix socket inside the VM, so every request goes through ``client.py``, run
with ``exec_stream`` and the request line on stdin, whose stdout is the
agent's reply lines as they arrive.

A live branch is ``Machine.branch_batch``: each child is an independent VM
whose RAM (the warm agent included) is a copy-on-write copy of the parent's,
so its agent still listens on the parent's socket path; it is then given its
own name and seed with a ``seed`` request.

The SDK is synchronous, so every call runs in a worker thread
(``asyncio.to_thread``), the way ``smol.AsyncMachine`` does it; using the
plain ``Machine`` keeps one handle type for create, branch and restore, and
lets a stream's chunks be forwarded to the loop as they arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import os
import re
import secrets
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from smol import (
    ConnectOptions,
    ExecOptions,
    ExecResult,
    Machine,
    MachineConfig,
    MountSpec,
    ResourceSpec,
    SmolError,
)

from .. import gate, signing
from .._aio import _made_in_thread
from ..errors import BackendUnavailable, InfraError, SmolbenchError
from ..gate.limits import LIMITS, human
from ..guest import AGENT_FILES, GUEST_DIR
from ..guest import protocol as P
from ..netpolicy import (
    CidrRule,
    NetPolicy,
    Own,
    internet_cidrs,
    literal,
    own_addresses,
    sdk_cidrs,
)
from ..packages import Installed
from ..packages import install as install_packages
from ..spec import MachineSpec
from ._wire import RequestIds, exec_message, interrupt_message
from .base import Backend, CellRequest, CellResult, MachineRef, OnEvent
from .smol_checkpoints import CLOUD_POINTER as CLOUD_POINTER
from .smol_checkpoints import SmolCheckpoints, _delete_quietly
from .smol_errors import ERROR_HINTS, detail, explain, translate
from .smol_guest import (
    CLIENT,
    GUEST_HOME,
    GUEST_LIB,
    GUEST_PACKAGES,
    GUEST_RUN,
    LAUNCHER,
    PREPARE,
    RELAY_FILE,
    TAIL,
    _cloudpickle_files,
)
from .smol_image import DEFAULT_IMAGE, boot_timeout, image_python, is_local, smol_image

__all__ = ["DEFAULT_IMAGE", "ERROR_HINTS", "SmolBackend", "explain", "translate"]

_PS = ParamSpec("_PS")
T = TypeVar("T")

READY_TIMEOUT = 60.0  # seconds for the agent to start once the VM is up
CONTROL_TIMEOUT = 30.0  # seconds for a ping / seed / interrupt round trip
# a relay's SDK events read ahead of the gate (the reading thread waits beyond), and the end
# of its stderr kept for an error line: a machine's output is never held whole here
RELAY_EVENTS = 16
STDERR_TAIL = 64 * 1024
# what the host holds of a short command's stdout (ls, true, rm, a log's tail): a cell can rewrite
# any program in its machine to print without end, and exec would buffer all of it here
CONTROL_OUTPUT = 1024 * 1024
LOG_TAIL = 4096  # bytes of an agent's log read for an error line
NOT_FOUND = frozenset({"NOT_FOUND", "VM_NOT_FOUND"})
_MAX_NAME = 63  # DNS label: cloud machine names must be DNS-safe

# -- helpers ---------------------------------------------------------------------------


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "m"


def _sdk_allow(policy: NetPolicy, own: Own) -> tuple[list[str], list[str]]:
    """An allow-list as smol takes it: ``allow_hosts`` names (smol scopes by name, not port), and
    ``allow_cidrs`` ranges less this host (``sdk_cidrs``). A host listed as an address (any
    spelling) goes with the ranges, under the one rule: as a name it went to smol whole, and
    ``allow_hosts = ["127.0.0.1"]`` opened this host to the VM (third audit)."""
    names: list[str] = []
    cidrs = list(policy.cidrs)
    for rule in policy.hosts:
        addr = literal(rule.name)
        if addr is None:
            if rule.name not in names:
                names.append(rule.name)
        else:
            cidrs.append(CidrRule(ipaddress.ip_network(addr), rule.port))
    return names, sdk_cidrs(cidrs, own)


async def _capped(chunks: AsyncIterator[bytes], cap: int, what: str) -> AsyncIterator[bytes]:
    """``chunks`` as they come, stopped with one line once more than ``cap`` bytes came."""
    seen = 0
    async for chunk in chunks:
        seen += len(chunk)
        if seen > cap:
            raise SmolbenchError(f"{what} passed {human(cap)}: stopped there (a cell may have rewritten its "
                                 "relay); `%smol down` and `%smol up`")
        yield chunk


# -- the backend -----------------------------------------------------------------------


class SmolBackend(SmolCheckpoints, Backend):
    """Machines as smol microVMs, on this host (``local``) or on smol cloud (``cloud``)."""

    name = "smol"

    def __init__(
        self, target: str = "local", probe: bool = True, *, session: str | None = None
    ) -> None:
        if target not in ("local", "cloud"):
            raise SmolbenchError(
                f"unknown smol target {target!r}: use --target local or --target cloud",
                api=f"unknown smol target {target!r}: use Session(target='local') or Session(target='cloud')",
            )
        self.target = target
        self.conn = (
            ConnectOptions(target="cloud") if target == "cloud" else ConnectOptions(target="local")
        )
        self.session = _slug(session) if session else secrets.token_hex(4)
        self._probe = probe and target == "local"
        self._probed = False
        self._probe_lock: asyncio.Lock | None = None
        self._machines: dict[str, MachineRef] = {}
        self._handles: dict[str, Machine] = {}
        self._held: list[Installed] = []  # the packages entries of this backend's VMs: held (prune skips them) till close
        self._serial = itertools.count(1)
        self._ids = RequestIds()  # what an interrupt names: the cell it is meant for
        self.extra_labels: dict[str, str] = {}  # a cluster node agent's folder (its leftovers are found by it)
        # told a restored VM's smol name before it is made: `restore_checkpoint` takes no labels, so a
        # cluster node agent records it to find it once it is gone (see cluster.agent.sweep_smol)
        self.unlabelled: Callable[[str], None] | None = None

    @property
    def isolation(self) -> str:
        """Plain words for what separates a machine from the host."""
        if self.target == "cloud":
            return "microVM on smol cloud (own guest kernel, hardware virtualisation; not on this host)"
        return "microVM (own guest kernel, hardware virtualisation via KVM)"

    @property
    def labels(self) -> dict[str, str]:
        """Labels on every machine of this backend (``Machine.list(conn, labels)`` finds them)."""
        return {"smolbench": "1", "smolbench-session": self.session, **self.extra_labels}

    # -- SDK calls off the loop ----------------------------------------------------------

    @staticmethod
    async def _sdk(fn: Callable[_PS, T], *args: _PS.args, **kwargs: _PS.kwargs) -> T:
        """Run one blocking SDK call in a thread; SDK errors become one-line SmolbenchErrors."""
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except SmolError as exc:
            raise translate(exc) from exc

    @staticmethod
    async def _make(fn: Callable[[], T], undo: Callable[[T], None]) -> T:
        """Like :meth:`_sdk` for a call that makes machines (or a cloud checkpoint): cancelled while it
        runs, what it made is undone once it ends, before the cancel goes on: nothing outlives the stop."""
        try:
            return await _made_in_thread(fn, undo)
        except SmolError as exc:
            raise translate(exc) from exc

    async def _ensure_available(self) -> None:
        if not self._probe or self._probed:
            return
        if self._probe_lock is None:
            self._probe_lock = asyncio.Lock()
        async with self._probe_lock:
            if self._probed:
                return
            from .probe import probe_smol

            ok, reason = await asyncio.to_thread(probe_smol)
            if not ok:
                raise BackendUnavailable(f"the smol backend is unavailable: {reason}")
            self._probed = True

    # -- names and config ----------------------------------------------------------------

    def machine_name(self, name: str) -> str:
        """A fresh, DNS-safe smol machine name for our machine ``name``."""
        head = f"smolbench-{self.session}-"
        tail = f"-{next(self._serial)}"
        return head + _slug(name)[: _MAX_NAME - len(head) - len(tail)].strip("-") + tail

    def machine_config(self, spec: MachineSpec, name: str, packages: Path | None = None) -> MachineConfig:
        """The smol MachineConfig for ``spec`` (``packages``: the host's installed tree, mounted read-only)."""
        image = smol_image(spec.image)
        if self.target == "cloud" and is_local(image):
            raise SmolbenchError(
                f"image {spec.image!r} is on this host, which smol cloud machines can't boot: "
                f"use a registry image like {DEFAULT_IMAGE!r}, or --target local",
                api=f"image {spec.image!r} is on this host, which smol cloud machines can't boot: "
                f"use a registry image like {DEFAULT_IMAGE!r}, or Session(target='local')",
            )
        if self.target == "cloud" and spec.volumes:
            raise SmolbenchError(
                "Smolfile volumes are host directories, which smol cloud machines can't mount: "
                "remove them, or use --target local",
                api="Smolfile volumes are host directories, which smol cloud machines can't mount: "
                "remove them, or use Session(target='local')",
            )
        policy = spec.policy
        allowed_hosts, allowed_cidrs = (_sdk_allow(policy, own_addresses() if self.target == "local" else frozenset())
                                        if policy.mode == "allow" else ([], []))
        if allowed_hosts or allowed_cidrs:  # allow-lists enable networking, scoped to them
            resources = ResourceSpec(
                cpus=spec.cpus,
                memory_mb=spec.memory,
                allow_hosts=allowed_hosts or None,
                allow_cidrs=allowed_cidrs or None,
            )
        elif policy.mode == "on":  # the internet, never this host or private networks: as CIDRs
            resources = ResourceSpec(cpus=spec.cpus, memory_mb=spec.memory,
                                     allow_cidrs=internet_cidrs(own_addresses() if self.target == "local" else frozenset()))
        else:  # explicit False: the cloud opens egress when network is left unset
            resources = ResourceSpec(cpus=spec.cpus, memory_mb=spec.memory, network=False)
        mounts = []
        for vol in spec.volumes:  # smol's engine mounts by path: the real path checked now, as near the mount as we get
            real = os.path.realpath(vol.host)
            signing.check_volume(real, vol.readonly, vol.guest)
            mounts.append(MountSpec(source=real, target=vol.guest, read_only=vol.readonly))
        if packages is not None:
            mounts.append(MountSpec(source=str(packages), target=GUEST_PACKAGES, read_only=True))
        return MachineConfig(
            name=self.machine_name(name),
            image=image,
            labels={**self.labels, "smolbench-node": _slug(name)},
            resources=resources,
            mounts=mounts or None,
            env=spec.env_dict or None,
            branchable=spec.branch,
            ready_timeout_seconds=boot_timeout(),
        )

    def _register(self, ref: MachineRef, handle: Machine) -> None:
        ref.info.update(machine=handle.name, id=handle.id, target=self.target)
        self._machines[ref.name] = ref
        self._handles[ref.name] = handle

    def _handle(self, ref: MachineRef) -> Machine:
        handle = self._handles.get(ref.name)
        if handle is None:
            raise SmolbenchError(
                f"machine {ref.name!r} was deleted: pick another with `%smol use` or `%smol up`"
            )
        return handle

    def _check_new(self, names: Iterable[str]) -> None:
        seen: set[str] = set()
        for name in names:
            if name in self._machines or name in seen:
                raise SmolbenchError(
                    f"a machine named {name!r} already exists: `%smol down` it or pick another name"
                )
            seen.add(name)

    # -- lifecycle -----------------------------------------------------------------------

    async def create(self, spec: MachineSpec, name: str) -> MachineRef:
        """Boot a microVM from ``spec``, copy the agent in and start it."""
        self._check_new([name])
        installed = await self._packages(spec)
        if installed is not None:  # smol's VMM opens the folder by its path: the path that was checked
            self._held.append(installed)
        config = self.machine_config(spec, name, installed.lib if installed is not None else None)
        await self._ensure_available()
        conn = self.conn
        handle = await self._make(lambda: Machine.create(config, conn), _delete_quietly)
        ref = MachineRef(name, self.name, spec)
        if installed is not None:
            ref.info["packages"] = installed.line(spec.packages)
        self._register(ref, handle)
        try:
            await self._start_agent(ref, handle)
        except BaseException:
            await self._delete_after_failure(ref)
            raise
        return ref

    async def _packages(self, spec: MachineSpec) -> Installed | None:
        """The Smolfile's packages, installed on this host for the image's Python (cached)."""
        if not spec.packages:
            return None
        if self.target == "cloud":
            raise SmolbenchError("Smolfile packages are installed on this host, which smol cloud machines can't "
                                 "mount: remove 'packages' (pip install in a cell with the index's hosts allowed), "
                                 "or use --target local",
                                 api="Smolfile packages are installed on this host, which smol cloud machines can't "
                                 "mount: remove 'packages' (pip install in a cell with the index's hosts allowed), "
                                 "or use Session(target='local')")
        return await install_packages(spec.packages, image_python(smol_image(spec.image)))

    async def _start_agent(self, ref: MachineRef, handle: Machine) -> None:
        spec = ref.spec
        slug = _slug(ref.name)
        sock, ready, log = (f"{GUEST_RUN}/{slug}.{ext}" for ext in ("sock", "ready", "log"))
        ref.info.update(socket=sock, log=log)
        files = [(f"{GUEST_HOME}/{f}", (GUEST_DIR / f).read_bytes()) for f in AGENT_FILES]
        files += [(f"{GUEST_LIB}/cloudpickle/{rel}", data) for rel, data in _cloudpickle_files()]
        dirs = sorted({GUEST_RUN, GUEST_HOME} | {os.path.dirname(path) for path, _ in files})
        res = await self._run(handle, ["python3", "-c", PREPARE, *dirs], f"machine {ref.name!r}")
        if res.exit_code != 0:
            raise SmolbenchError(
                f"image {spec.image or DEFAULT_IMAGE!r} has no working python3 ({detail(res.stderr or res.stdout, 80)}): "
                f"use an image with python3 >= 3.8, like {DEFAULT_IMAGE!r}"
            )
        ref.info["python"] = res.stdout.strip()
        for path, data in files:
            await self._sdk(handle.write_file, path, data, 0o644)
        argv = [
            "python3",
            "-c",
            LAUNCHER,
            GUEST_HOME,
            log,
            "--socket",
            sock,
            "--name",
            ref.name,
            "--workdir",
            spec.workdir,
            "--lib",
            GUEST_LIB,
            "--ready",
            ready,
            *(["--packages", GUEST_PACKAGES] if spec.packages else []),
        ]
        env = {"SMOLBENCH_MACHINE": ref.name, "PYTHONDONTWRITEBYTECODE": "1",
               "SMOLBENCH_NET_POLICY": spec.policy.describe(), **spec.env_dict}
        started = await self._sdk(handle.exec, argv, ExecOptions(background=True, env=env))
        ref.info["agent_pid"] = started.pid
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_TIMEOUT
        while True:
            listing = await self._run(handle, ["ls", "-1", GUEST_RUN], f"machine {ref.name!r}")
            present = set(listing.stdout.split())
            if f"{slug}.ready" in present:
                return
            if f"{slug}.failed" in present:
                raise SmolbenchError(
                    f"the agent in machine {ref.name!r} failed to start "
                    f"({await self._log_tail(handle, log)}): `%smol down` and `%smol up` again"
                )
            if loop.time() > deadline:
                raise InfraError(
                    f"the agent in machine {ref.name!r} did not start within {READY_TIMEOUT:.0f} s "
                    f"({await self._log_tail(handle, log)}): `%smol down` and `%smol up` again"
                )
            await asyncio.sleep(0.1)

    async def _log_tail(self, handle: Machine, log: str) -> str:
        """The last line of an agent's log, from its last :data:`LOG_TAIL` bytes only."""
        try:
            res = await self._run(handle, ["python3", "-c", TAIL, log, str(LOG_TAIL)], "the agent log",
                                  cap=4 * LOG_TAIL)
        except Exception:
            return "no agent log"
        if res.exit_code != 0:
            return "no agent log"
        text = res.stdout.strip()
        return detail(text.splitlines()[-1], 120) if text else "empty agent log"

    async def _run(self, handle: Machine, argv: list[str], where: str, *, timeout: float = CONTROL_TIMEOUT,
                   cap: int = CONTROL_OUTPUT, take: Callable[[str], None] | None = None) -> ExecResult:
        """A command's result, its stdout read through ``exec_stream`` as it comes: at most ``cap``
        characters held (or each piece handed to ``take``, which may raise to stop), the command
        killed past that or past ``timeout``. A cell can rewrite any program in its machine (its
        relay, ``ls``, ``true``) to print without end: ``exec`` would buffer all of it here."""
        stream = await self._sdk(handle.exec_stream, argv, ExecOptions(timeout=timeout))

        def drain() -> ExecResult:
            out: list[str] = []
            held, err, code = 0, "", None
            for event in stream:
                kind = event.get("kind")
                if kind == "stdout":
                    data = event.get("data", "")
                    text = data if isinstance(data, str) else bytes(data).decode(errors="replace")
                    if take is not None:
                        take(text)
                        continue
                    held += len(text)
                    if held > cap:
                        raise SmolbenchError(
                            f"{where} printed more than {human(cap)} for a short command ({argv[0]}): stopped "
                            "there; a cell may have rewritten its programs: `%smol down` and `%smol up`"
                        )
                    out.append(text)
                elif kind == "stderr":
                    err = (err + str(event.get("data", "")))[-STDERR_TAIL:]
                elif kind == "exit":
                    code = event.get("exit_code")
                elif kind == "error":
                    raise SmolError("SMOLVM_ERROR", str(event.get("message", ""))[:STDERR_TAIL])
            return ExecResult(exit_code=-1 if code is None else int(code), stdout="".join(out), stderr=err)

        try:  # the host's own bound: the guest's is its word
            return await asyncio.wait_for(self._sdk(drain), timeout + 5.0)
        except asyncio.TimeoutError:
            raise InfraError(f"{where} did not finish {argv[0]} within {timeout:g} s: the machine is "
                             "overloaded or gone; `%smol status`") from None
        finally:
            stream.kill()  # ends the thread's iteration too

    async def delete(self, machine: MachineRef) -> None:
        """Delete the VM (its branches are VMs of their own and stay); gone already is fine."""
        ref = self._machines.pop(machine.name, None)
        handle = self._handles.pop(machine.name, None)
        self._ids.forget(machine.name)
        if ref is None or handle is None:
            return
        await asyncio.to_thread(self._delete_sync, handle, str(ref.info.get("id") or handle.id))

    def _delete_sync(self, handle: Machine, machine_id: str) -> None:
        try:
            handle.delete()
        except SmolError as exc:
            if exc.code in NOT_FOUND:
                return
            try:  # the handle may be stale: delete by id, which succeeds when it is gone
                Machine.delete_by_name(machine_id, self.conn)
            except SmolError as again:
                if again.code not in NOT_FOUND:
                    raise translate(exc) from exc

    async def _delete_after_failure(self, ref: MachineRef) -> None:
        with contextlib.suppress(Exception):
            await asyncio.shield(self.delete(ref))

    async def close(self) -> None:
        """Delete every machine, branches before their parents (smol refuses to delete a VM
        with live branches), each level in parallel; all of them even when some deletes fail
        (the first error is raised)."""

        def depth(ref: MachineRef) -> int:
            up = self._machines.get(ref.parent or "")
            return 0 if up is None else 1 + depth(up)

        errors: list[BaseException] = []
        levels: dict[int, list[MachineRef]] = {}
        for ref in self.list():
            levels.setdefault(depth(ref), []).append(ref)
        for level in sorted(levels, reverse=True):
            results = await asyncio.gather(*(self.delete(r) for r in levels[level]), return_exceptions=True)
            errors += [r for r in results if isinstance(r, BaseException)]
        if not errors:  # a VM left (a failed delete) may still read its packages
            for installed in self._held:
                installed.close()
            self._held.clear()
        if errors:
            raise errors[0]

    # -- talking to agents ---------------------------------------------------------------

    async def _relay(
        self, ref: MachineRef, msg: dict[str, Any], timeout: float | None = None
    ) -> AsyncGenerator[bytes, None]:
        """Send one request through client.py; yield the agent's raw reply bytes as they arrive.
        With ``timeout``, a control request's: one that ended unanswered is an InfraError."""
        handle = self._handle(ref)
        where = f"machine {ref.name!r}"
        # Always as a file: smol's local exec_stream drops ExecOptions.stdin (the relay
        # would read EOF and wait forever), while write_file and exec deliver bytes.
        request = f"{GUEST_RUN}/request-{secrets.token_hex(6)}.json"
        await self._sdk(handle.write_file, request, P.encode(msg), 0o600)
        argv, opts = ["sh", "-c", RELAY_FILE, CLIENT, ref.info["socket"], request], ExecOptions(timeout=timeout)
        stream = await self._sdk(handle.exec_stream, argv, opts)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(RELAY_EVENTS)
        closed = threading.Event()

        def put(item: tuple[str, Any]) -> bool:
            """Hand ``item`` over, waiting while the queue is full; False once nobody listens."""
            while not closed.is_set():
                try:
                    done = asyncio.run_coroutine_threadsafe(queue.put(item), loop)
                except RuntimeError:  # the loop is gone
                    return False
                while not closed.is_set():
                    with contextlib.suppress(TimeoutError):
                        done.result(timeout=1.0)
                        return True
                done.cancel()
            return False

        def pump() -> None:
            try:
                for event in stream:
                    if not put(("event", event)):
                        return
            except BaseException as exc:
                put(("raise", exc))
            finally:
                put(("end", None))

        threading.Thread(target=pump, name=f"smolbench-relay-{ref.name}", daemon=True).start()
        stderr = ""
        exit_code: int | None = None
        try:
            while True:
                kind, item = await queue.get()
                if kind == "end":
                    break
                if kind == "raise":
                    if isinstance(item, SmolError):
                        raise translate(item) from item
                    raise item
                event_kind = item.get("kind")
                if event_kind == "stdout":
                    data = item.get("data", "")
                    yield data.encode() if isinstance(data, str) else bytes(data)
                elif event_kind == "stderr":
                    stderr = (stderr + str(item.get("data", "")))[-STDERR_TAIL:]
                elif event_kind == "exit":
                    exit_code = item.get("exit_code")
                elif event_kind == "error":
                    raise await self._lost(
                        handle,
                        f"{where}: running the agent relay failed ({detail(str(item.get('message', '')))}): "
                        "`%smol status`, or `%smol down` and `%smol up`",
                    )
            if exit_code and timeout is not None:  # a control request, unanswered: retryable, as before
                raise InfraError(
                    f"{where} gave no answer to its {msg.get('op')} request within {timeout:g} s "
                    f"(relay exit {exit_code}): the machine is overloaded or gone; `%smol status`"
                )
            if exit_code:  # it ended without a final reply, else we would not be here
                tail = stderr.strip().splitlines()
                raise await self._lost(
                    handle,
                    f"{where}: the agent relay exited with code {exit_code}"
                    f" ({detail(tail[-1]) if tail else 'no error output'}): `%smol status`, or `%smol down` and `%smol up`",
                )
        finally:
            closed.set()  # the thread stops handing events over
            stream.kill()
            while not queue.empty():  # a put waiting for room ends
                queue.get_nowait()

    async def _lost(self, handle: Machine, message: str) -> SmolbenchError:
        """The error for a relay that ended without an answer: InfraError (retryable) when the
        VM itself is gone, a plain error when it still runs (the cell took its agent down)."""
        try:
            res = await self._run(handle, ["true"], "the machine", cap=0)
        except InfraError:
            return InfraError(message)
        except SmolbenchError as exc:  # printed where `true` prints nothing: it runs, rewritten
            return SmolbenchError(message) if "printed more" in str(exc) else InfraError(message)
        return SmolbenchError(message) if res.exit_code == 0 else InfraError(message)

    async def _request(
        self, ref: MachineRef, msg: dict[str, Any], timeout: float = CONTROL_TIMEOUT
    ) -> dict[str, Any]:
        """One control request (ping, seed, interrupt) and its final reply; errors raise."""
        where = f"machine {ref.name!r}"
        op = msg.get("op")
        # Through the relay's stream, as a cell: counted as it comes and stopped at the limit of one
        # reply line (exec held all a rewritten relay printed); the host's own clock bounds it.
        async def answer() -> dict[str, Any]:
            async with contextlib.aclosing(self._relay(ref, msg, timeout)) as chunks:
                return await gate.read_control(_capped(chunks, LIMITS.max_frame, f"{where}'s reply to {op}"), ref.name)

        try:
            done = await asyncio.wait_for(answer(), timeout)
        except asyncio.TimeoutError:
            raise InfraError(
                f"{where} gave no answer to its {op} request within {timeout:g} s: "
                "the machine is overloaded or gone; `%smol status`"
            ) from None
        if done.get("status") != "ok":
            err = done.get("error") or {}
            raise SmolbenchError(f"{where}: {err.get('ename', 'error')}: {err.get('evalue', '')}")
        return done

    async def exec_cell(
        self, machine: MachineRef, request: CellRequest, on_event: OnEvent
    ) -> CellResult:
        """Run one cell through client.py, streaming its output as it arrives."""
        msg = exec_message(request, self._ids.cell(machine.name))
        async with contextlib.aclosing(self._relay(machine, msg)) as chunks:
            return await gate.read_cell(chunks, request, on_event, machine.name, scope=machine.token)

    async def interrupt(self, machine: MachineRef) -> None:
        """Raise KeyboardInterrupt in the last cell sent to the machine if it still runs: never
        a later one (the relay's exec can take a while to reach the agent)."""
        rid = self._ids.last(machine.name)
        if rid is None:
            return
        with contextlib.suppress(SmolbenchError):
            await self._request(machine, interrupt_message(rid), timeout=10.0)

    async def info(self, machine: MachineRef) -> dict[str, Any]:
        """What the agent says about itself (python version, pid, cells run, ...)."""
        return dict((await self._request(machine, {"op": "ping"}))["info"])

    # -- branching -----------------------------------------------------------------------

    async def branch(
        self, machine: MachineRef, names: list[str], seeds: list[int | None], *, leaf: bool = False
    ) -> list[MachineRef]:
        """Branch live copy-on-write child VMs with ``branch_batch``, then seed each one."""
        if len(names) != len(seeds):
            raise ValueError("one seed per branch name")
        if not names:
            return []
        if not machine.spec.branch:
            raise SmolbenchError(
                f"machine {machine.name!r} was made with [branch] enabled = false, so it can't branch: "
                "enable it in the Smolfile and `%smol up` again"
            )
        self._check_new(names)
        parent = self._handle(machine)
        smol_names = [self.machine_name(n) for n in names]

        def undo(kids: list[Machine]) -> None:
            for kid in kids:
                _delete_quietly(kid)

        # What each child would import itself (numpy.random, at its seed: 8 ms and ~900 pages
        # a branch), imported once in the parent, and its objects frozen for the children's
        # garbage collector: as the sandbox's agent does before its own forks. An agent that
        # doesn't know the request (an older checkpoint's) just branches without it.
        with contextlib.suppress(SmolbenchError):
            await self._request(machine, {"op": "warm"})
        kids: list[Machine] = await self._make(lambda: parent.branch_batch(names=smol_names), undo)
        if len(kids) != len(names):
            await asyncio.to_thread(undo, kids)
            raise InfraError(
                f"smol made {len(kids)} branches of {machine.name!r}, not {len(names)}: retry"
            )
        refs: list[MachineRef] = []
        for name, kid in zip(names, kids):
            # The child's agent is a RAM copy of the parent's: same socket path, inside the child VM.
            info = {
                "socket": machine.info["socket"],
                "log": machine.info.get("log"),
                "python": machine.info.get("python"),
            }
            ref = MachineRef(name, self.name, machine.spec, parent=machine.name, info=info)
            self._register(ref, kid)
            refs.append(ref)
        try:
            await asyncio.gather(
                *(
                    # A new branch's first answer: as slow as a boot on a slow host.
                    self._request(ref, {"op": "seed", "seed": seed, "name": ref.name}, boot_timeout())
                    for ref, seed in zip(refs, seeds)
                )
            )
        except BaseException:
            for ref in refs:
                await self._delete_after_failure(ref)
            raise
        return refs

    # -- checkpoints ---------------------------------------------------------------------

    def list(self) -> list[MachineRef]:  # last: in this class body "list" then means the method
        """Machines this backend created and has not deleted yet."""
        return list(self._machines.values())
