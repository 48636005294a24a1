"""Machines that are guest agents started on this host (sandbox and process backends).

What both share: a run folder per machine (socket, log, workspace), the agent's
Unix socket, branching by the agent's ``os.fork()``, checkpoints as the agent's
save/load, enforced limits (``_limits``: a cgroup per machine and per branch),
and deleting a machine so that nothing it started survives. Subclasses say how
the agent is started (:meth:`AgentHostBackend._command`).
"""

from __future__ import annotations

import abc
import asyncio
import builtins
import contextlib
import os
import shutil
import subprocess
import tarfile
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from .. import gate, registry
from .._aio import _made_in_thread, _stop_with_grace, _to_the_end
from ..errors import BackendUnavailable, MachineLost, SmolbenchError
from ..gate import archive
from ..gate.frames import Bound
from ..guest import protocol as P
from ..packages import GuestPython, Installed, host_python
from ..packages import install as install_packages
from ..spec import MachineSpec
from . import _agentend, _limits, _procs, _rundir, _spawn
from ._agentlog import keep_log
from ._channel import Channel
from ._saving import Saving
from ._wire import RequestIds, exec_message, interrupt_message
from .base import Backend, CellRequest, CellResult, MachineRef, OnEvent

T = TypeVar("T")

BOOT_TIMEOUT = 30.0
KILL_TIMEOUT = 10.0  # seconds a root agent gets to confirm a branch is gone
CHUNK = 256 * 1024  # bytes read from an agent's socket at a time (the gate makes frames)


def _not_answering(ref: MachineRef, exc: OSError) -> SmolbenchError:
    """``ref``'s agent could not be reached, or dropped a request it was sent, in one line."""
    head = f"machine {ref.name!r} is not answering ({exc.strerror or type(exc).__name__}): it may have died;"
    return SmolbenchError(f"{head} `%smol down` and `%smol up`", api=f"{head} `Session.down()` and `Session.up()`")


class AgentHostBackend(Saving, Backend):
    """A guest agent per machine, on this host; branches by ``os.fork()`` inside it."""

    files_in_memory = False  # a machine's files (workspace, /tmp) live in memory its cgroup counts

    def __init__(self, *, runtime_dir: str | None = None) -> None:
        self._runtime_base = runtime_dir
        self._machines: dict[str, MachineRef] = {}
        self._procs: dict[str, _spawn.Spawned] = {}
        self._logs: dict[str, asyncio.Future[None]] = {}  # a root's agent.log writer (it ends with the machine)
        self._booted: dict[str, asyncio.Event] = {}  # set when a root's agent said it is ready (its log)
        self._held: dict[str, Installed] = {}  # a root's packages entry, held (prune skips it) till it is deleted
        self._limiter: _limits.Limiter | None = None
        self._ending: list[tuple[MachineRef, asyncio.Future[str]]] = []  # branch deletes of this moment, batched
        self._going: dict[str, str] = {}  # branch -> its folder, while it is deleted: the name stays taken till it is gone
        self.swept: list[Path] = []  # stale run folders removed at the first create
        self.notes: list[str] = []  # things `%smol status` should say once (a fork flattened layers)
        self._ids = RequestIds()  # what an interrupt names: the cell (or save, fork) it is meant for

    @property
    def limiter(self) -> _limits.Limiter:
        """The limits of this backend's machines (probed at first use)."""
        if self._limiter is None:
            self._limiter = _limits.Limiter()
        return self._limiter

    def limits_status(self, spec: MachineSpec) -> str:
        """One line: which mechanism enforces memory, processes and CPUs, and the values."""
        return self.limiter.describe(spec, nproc_per_machine=self.nproc_per_machine)

    nproc_per_machine = True  # RLIMIT_NPROC counts only this machine (its own user namespace)

    def _nproc(self, spec: MachineSpec) -> int:
        """The RLIMIT_NPROC of a machine without a pids cgroup: ``spec.pids`` for itself and
        room for its branches, which count in its user namespace too (``_limits.nproc_ceiling``)."""
        return _limits.nproc_ceiling(spec.pids)

    @abc.abstractmethod
    def _command(self, spec: MachineSpec, name: str, run_dir: Path, workspace: Path,
                 agent_args: builtins.list[str], packages: Path | None = None) -> tuple[builtins.list[str], str, str]:
        """(argv, the run folder's path inside the machine, the workdir inside) for a new machine;
        ``packages``: the installed tree of the Smolfile's packages (on the host), to put on its sys.path."""

    def _guest_python(self, spec: MachineSpec) -> GuestPython:
        """The Python the machine's agent runs (what the Smolfile's packages are installed for)."""
        return host_python()

    async def _packages(self, spec: MachineSpec) -> Installed | None:
        """The Smolfile's packages, installed on the host (once: later machines reuse the cache)."""
        if not spec.packages:
            return None
        guest = self._guest_python(spec)
        return await install_packages(spec.packages, guest)

    def _packages_path(self, installed: Installed) -> Path:
        """Where the machine's command finds the packages: the entry's path (a process of its own
        resolves it again); a backend binding it from this process binds ``installed.mount``."""
        return installed.lib

    def _layout(self, run_dir: Path, name: str) -> tuple[Path, Path, Path]:
        """(the machine's own host folder, its socket, its ready file) in a new run folder."""
        return run_dir, run_dir / f"{name}.sock", run_dir / f"{name}.ready"

    def _spawn_options(self, name: str) -> dict[str, Any]:
        """Extra keyword arguments for starting the machine (file descriptors to pass)."""
        return {}

    def _spawned(self, name: str) -> None:
        """After the machine's process started (or failed to): release what it was given."""

    def _host_pids(self, ancestor: int, guest_pids: builtins.list[int],
                   tree: dict[int, builtins.list[tuple[int, str]]] | None = None) -> dict[int, int]:
        """guest pid -> host pid of the processes below ``ancestor`` (branches just forked)."""
        return _procs.host_pids(ancestor, guest_pids, tree)

    def _lost_for_memory(self, spec: MachineSpec, saving: bool = False) -> str:
        """The line of a machine its cgroup killed for memory (a cgroup counts what a sandbox
        keeps in memory as files too: its line names ``disk``); ``saving``: during a save."""
        return _limits.out_of_memory_line(spec, files=self.files_in_memory, saving=saving)

    def _makes_leaves(self) -> bool:
        """Whether a fork's ``leaf`` branches are made cheaper here (see ``guest/leaves.py``)."""
        return False

    def _host_env(self, spec: MachineSpec, name: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(_limits.thread_env(spec))
        env.update(spec.env_dict)
        env["SMOLBENCH_MACHINE"] = name
        env[registry.KERNEL_VAR] = registry.kernel_mark()  # whose it is: the server kills only a dead kernel's
        env.pop("PYTHONPATH", None)
        return env

    # -- lifecycle ------------------------------------------------------------------

    async def create(self, spec: MachineSpec, name: str) -> MachineRef:
        if name in self._machines:
            raise SmolbenchError(f"a machine named {name!r} already exists: `%smol down` first or pick another name")
        if not self._machines:
            self.swept += _rundir.sweep(self._runtime_base)
        run_dir = _rundir.make(self._runtime_base)
        workspace = run_dir / "workspace"
        workspace.mkdir()
        host_dir, socket, ready = self._layout(run_dir, name)
        ref = MachineRef(name, self.name, spec, info={"run_dir": str(run_dir), "workspace": str(workspace), "root": name,
                                                      "host_dir": str(host_dir), "contained": False})
        self._machines[name] = ref
        try:
            installed = await self._packages(spec)
            if installed is not None:
                self._held[name] = installed
                ref.info["packages"] = installed.line(spec.packages)
            def prepare() -> tuple[_limits.MachineLimits, builtins.list[str], str, str]:
                limits = self.limiter.machine(name, spec)  # cgroupfs is slow to write to
                args = limits.agent_args(self._nproc(spec), spec.pids if self.nproc_per_machine else None)
                return (limits, *self._command(spec, name, run_dir, workspace, args,
                                               self._packages_path(installed) if installed is not None else None))

            # Off the loop thread, like the spawn: N boots at once don't queue on it.
            prepared = asyncio.ensure_future(asyncio.to_thread(prepare))
            try:
                limits, argv, guest_run, workdir = await asyncio.shield(prepared)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):  # done before the machine is deleted below (a second
                    await _to_the_end(prepared)  # cancel too: its cgroups, made after the delete, stayed)
                raise
            ref.info.update(guest_run=guest_run, workdir=workdir, socket=str(socket))
            from ._bwrap import weakened

            whole_log = "agent-log" in weakened()  # tests only: the old set-up, the log file as fd 1
            try:
                # start_new_session: the kernel's Ctrl-C (SIGINT to its process group) must not
                # reach the machine; we deliver interrupts ourselves. This runs on the workbench's
                # loop thread, which lives as long as the kernel (--die-with-parent / pdeathsig);
                # started from a worker thread of it (_spawn: N boots don't queue on the loop).
                # Its output comes through a pipe, kept up to _agentlog.LOG_LIMIT (a file of the host's
                # would take whatever a cell writes to fd 1).
                # A pipe of our own, not asyncio's: its wait() would wait for every writer to close it.
                read, write = (None, open(run_dir / "agent.log", "wb")) if whole_log else os.pipe()
                try:
                    proc = await _spawn.spawn(
                        limits.wrap(argv), stdin=subprocess.DEVNULL, stdout=write,
                        stderr=subprocess.STDOUT, start_new_session=True, env=self._host_env(spec, name),
                        **self._spawn_options(name))
                except _spawn.Started as started:  # cancelled while it started: deleted below
                    self._procs[name] = started.proc
                    if read is not None:
                        os.close(read)
                    raise
                except BaseException:
                    if read is not None:
                        os.close(read)
                    raise
                finally:
                    if isinstance(write, int):
                        os.close(write)
                    else:
                        write.close()
            finally:
                self._spawned(name)
            if read is not None:
                booted = self._booted[name] = asyncio.Event()
                self._logs[name] = asyncio.ensure_future(keep_log(read, run_dir / "agent.log", booted))
            self._procs[name] = proc
            ref.info["pid"] = proc.pid
            await self._wait_ready(ref, proc, ready)
        except BaseException:
            await _to_the_end(self.delete(ref))  # a second cancel must not leave the machine half deleted
            raise
        return ref

    async def _until_booted(self, ref: MachineRef, proc: _spawn.Spawned, deadline: float) -> None:
        """Until the agent's ready line is in its log (no polling), or raise if it exited or is late.
        Without a log pipe (a test's weakened set-up) returns at once: the caller polls."""
        booted = self._booted.pop(ref.name, None)
        if booted is not None and not booted.is_set():
            said, ended = asyncio.ensure_future(booted.wait()), asyncio.ensure_future(proc.wait())
            try:
                await asyncio.wait([said, ended], timeout=max(0.0, deadline - time.monotonic()),
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                said.cancel()
                ended.cancel()
            if booted.is_set():
                return
        self._check_starting(ref, proc, deadline)

    def _check_starting(self, ref: MachineRef, proc: _spawn.Spawned, deadline: float) -> None:
        if proc.returncode is not None:
            raise _Exited()
        if time.monotonic() > deadline:
            raise BackendUnavailable(f"the {self.name} machine {ref.name!r} did not start within {BOOT_TIMEOUT:.0f} s: {self._log_tail(ref)}")

    async def _wait_ready(self, ref: MachineRef, proc: _spawn.Spawned, ready: Path) -> None:
        deadline = time.monotonic() + BOOT_TIMEOUT
        try:
            await self._until_booted(ref, proc, deadline)
            while not ready.exists():
                self._check_starting(ref, proc, deadline)
                await asyncio.sleep(0.01)
        except _Exited:
            await self._log_written(ref)
            raise BackendUnavailable(f"the {self.name} machine {ref.name!r} exited during start: {self._log_tail(ref)}") from None
        with contextlib.suppress(OSError, ValueError):
            guest = int((archive.read_small(ready, 64) or "").strip() or 0)
            ref.info["host_pid"] = proc.pid if _procs.ns_pids(proc.pid)[-1:] == [guest] else _procs.host_pid(proc.pid, guest)

    async def _log_written(self, ref: MachineRef, timeout: float = 2.0) -> None:
        """Until the root's log writer has everything its machine wrote (it is gone)."""
        task = self._logs.get(ref.info.get("root", ref.name))
        if task is not None:
            with contextlib.suppress(asyncio.TimeoutError, OSError):
                await asyncio.wait_for(asyncio.shield(task), timeout)

    @staticmethod
    def _log_tail(ref: MachineRef) -> str:
        text = archive.read_small(Path(ref.info["run_dir"]) / "agent.log")  # machine-writable: no links
        if text is None:
            return "(no log)"
        text = text.strip()
        return text.splitlines()[-1][:300] if text else "(empty log)"

    async def delete(self, machine: MachineRef) -> None:
        ref = self._machines.pop(machine.name, None)
        if ref is None:
            return
        self._ids.forget(ref.name)
        for child in [m for m in self._machines.values() if m.parent == ref.name]:
            await self.delete(child)
        proc = self._procs.pop(ref.name, None)
        if ref.parent is None:  # a root: everything it started goes, then its folder
            await asyncio.to_thread(self._kill_root, ref, proc)
            if proc is not None:
                await proc.wait()
            await self._log_written(ref)
            self._booted.pop(ref.name, None)
            held = self._held.pop(ref.name, None)
            if held is not None:
                held.close()
            log = self._logs.pop(ref.name, None)
            if log is not None:
                log.cancel()
            shutil.rmtree(ref.info["run_dir"], ignore_errors=True)
            return
        self._going[ref.name] = ref.info["host_dir"]
        try:
            ended = await self._end_in_cgroups(ref)  # killed there, checked gone, its cgroups released
            if ended == "cleared":  # and its folder gone, in the same thread job
                return
            if not ended:
                procs = await asyncio.to_thread(self._kill_branch_tree, ref)
                # The parent forked the branch: the pid is one of the parent's own pid namespace.
                parent = self._machines.get(ref.parent)
                if parent is not None and "guest_pid" in ref.info:
                    # bounded: a parent whose agent a cell rewrote may never answer
                    with contextlib.suppress(OSError, SmolbenchError, asyncio.TimeoutError):
                        await asyncio.wait_for(self._request(parent, {"op": "kill", "pid": ref.info["guest_pid"]}),
                                               KILL_TIMEOUT)
                await asyncio.to_thread(_wait_gone, procs)
                await asyncio.to_thread(self.limiter.release, ref.name)
            await self._branch_gone(ref)
        finally:
            self._going.pop(ref.name, None)

    async def _branch_gone(self, ref: MachineRef) -> None:
        """Once a deleted branch's processes are gone: what it had in its parent's run folder goes."""
        await asyncio.to_thread(self._clear_branch, self._machines.get(ref.parent or ""),
                                os.path.basename(ref.info["host_dir"]) if ref.info.get("contained") else None,
                                ref.info["socket"])

    def _clear_branch(self, parent: MachineRef | None, folder: str | None, socket: str) -> None:
        """A contained branch's own ``folder`` in its parent's run folder (its socket, its keeper's,
        what its cells wrote) goes through :meth:`_remove_below`; with its parent gone or being
        deleted too, it goes with the parent's. Otherwise its ``socket`` in the root's host run folder."""
        if folder is None:
            with contextlib.suppress(OSError):
                os.unlink(socket)
        elif parent is not None:
            self._remove_below(parent, folder)

    async def _end_in_cgroups(self, ref: MachineRef) -> str:
        """Kill a branch through its own cgroups (everything it started is there, from its first
        instruction on), then release them; batched with every branch deleted at this moment (a
        fork's ``--keep none``): one thread job, one wait for them all. "cleared" once its cgroups
        emptied, its own process is gone and so is what it had in its parent's run folder
        (:meth:`_branch_gone`, in the same job); "ended" if that last step failed; "" where it
        has no cgroups (rlimits) or that could not be checked: the caller then kills it the
        other way (its parent, its tree)."""
        limits = self.limiter.get(ref.name)
        if limits is None or not limits.dirs or "host_pid" not in ref.info:
            return ""
        loop = asyncio.get_running_loop()
        if not self._ending:
            loop.call_soon(lambda: asyncio.ensure_future(self._end_batch()))
        done: asyncio.Future[str] = loop.create_future()
        self._ending.append((ref, done))
        return await done

    async def _end_batch(self) -> None:
        batch, self._ending = self._ending, []
        clear = [(self._machines.get(ref.parent or ""), os.path.basename(ref.info["host_dir"])
                  if ref.info.get("contained") else None, ref.info["socket"]) for ref, _ in batch]

        def end() -> builtins.list[str]:
            emptied = self.limiter.release_all([ref.name for ref, _ in batch], keep=True)  # for the next branches
            out = []
            for (ref, _), ok, where in zip(batch, emptied, clear):
                if not ok or _procs.running(ref.info["host_pid"], ref.info.get("host_started", "")):
                    out.append("")
                    continue
                try:
                    self._clear_branch(*where)
                    out.append("cleared")
                except Exception:  # noqa: BLE001 - the delete tries again, on its own
                    out.append("ended")
            return out

        try:
            gone = await asyncio.to_thread(end)
        except BaseException:
            gone = [""] * len(batch)  # each delete then goes the other way
        for (_, done), ok in zip(batch, gone):
            if not done.done():
                done.set_result(ok)

    def _kill_root(self, ref: MachineRef, proc: _spawn.Spawned | None) -> None:
        """Kill the machine's whole process tree and its cgroup's contents, and verify."""
        if proc is not None:
            _procs.kill_tree(proc.pid)
        self.limiter.release(ref.name)

    def _kill_branch_tree(self, ref: MachineRef) -> builtins.list[tuple[int, str]]:
        """Kill what a branch started (its daemons included), before the branch itself goes;
        returns the branch's processes, itself included, to wait for."""
        pid = ref.info.get("host_pid")
        if pid is None or _procs.start_time(pid) != ref.info.get("host_started"):
            return []
        limits = self.limiter.get(ref.name)
        if limits is not None and limits.dirs:  # all it started is in its own cgroup: killed there
            limits.kill()
            return [(pid, ref.info["host_started"])]
        below = [p for p in _procs.descendants(pid) if _procs.running(*p)]
        _procs.kill_all(below)
        return [(pid, ref.info["host_started"]), *below]

    def list(self) -> builtins.list[MachineRef]:
        return list(self._machines.values())

    def gone(self, machines: builtins.list[MachineRef]) -> dict[str, str]:
        """Machines whose agent process exited or was killed (its /proc entry gone, a zombie, or reused)."""
        said = "its agent process ended while it was idle (killed from outside, or out of memory); its state is gone"
        return {ref.name: said for ref in machines if "host_pid" in ref.info and not _procs.running(
            ref.info["host_pid"], ref.info.get("host_started") or _procs.start_time(ref.info["host_pid"]))}

    def host_memory(self) -> tuple[float, float]:
        """(RSS, PSS) in MiB of every process of every live machine (branches included)."""
        pids = [p for proc in self._procs.values() for p in (proc.pid, *(d for d, _ in _procs.descendants(proc.pid)))]
        return _procs.memory_mib(pids)

    async def close(self) -> None:
        await super().close()
        for log in self._logs.values():
            log.cancel()
        self._logs.clear()
        if self._limiter is not None:
            await asyncio.to_thread(self._limiter.close)

    # -- talking to agents ------------------------------------------------------------

    async def _open(self, ref: MachineRef) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await self._connect(ref, asyncio.open_unix_connection)

    @contextlib.contextmanager
    def _socket(self, ref: MachineRef) -> Iterator[str]:
        """The path to connect to ``ref``'s agent at, for as long as the connection is made (a
        backend whose socket sits in a folder the machine can change finds it without
        following the machine's links: every connection, cells' and kept channels', goes here)."""
        yield ref.info["socket"]

    async def _connect(self, ref: MachineRef, how: Callable[[str], Awaitable[T]]) -> T:
        if ref.name not in self._machines:
            raise SmolbenchError(f"machine {ref.name!r} was deleted: pick another with `%smol use` or `%smol up`",
                                 api=f"machine {ref.name!r} was deleted: pick another with `Session.use(node)` or "
                                 "`Session.up()`")
        try:
            with self._socket(ref) as path:
                return await how(path)
        except OSError as exc:
            raise _not_answering(ref, exc) from None

    async def _stream(self, ref: MachineRef, msg: dict[str, Any]) -> AsyncGenerator[bytes, None]:
        """Send one request; yield the agent's raw reply bytes (only the gate decodes them)."""
        reader, writer = await self._open(ref)
        try:
            try:
                writer.write(P.encode(msg))
                await writer.drain()
            except ConnectionError as exc:  # it died between the connect and the request
                raise _not_answering(ref, exc) from None
            while True:
                try:
                    chunk = await reader.read(CHUNK)
                except ConnectionError:  # the agent dropped us: it could not even start a thread
                    head = (f"machine {ref.name!r} dropped the connection: it may be out of processes (pids = "
                            f"{ref.spec.pids}) or memory;")
                    raise SmolbenchError(f"{head} `%smol delete {ref.name}` or raise the limit in the Smolfile",
                                         api=f"{head} `Session.delete({ref.name!r})` or raise the limit in the "
                                         "Smolfile") from None
                if not chunk:
                    return
                yield chunk
        finally:
            if writer.transport.get_write_buffer_size():  # a request the machine stopped reading: closing
                writer.transport.abort()  # would wait to flush it for as long as the machine lives
            else:
                writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _request(self, ref: MachineRef, msg: dict[str, Any]) -> dict[str, Any]:
        async with contextlib.aclosing(self._stream(ref, msg)) as chunks:
            done = await gate.read_control(chunks, ref.name)
        if done.get("status") != "ok":
            err = done.get("error") or {}
            raise SmolbenchError(f"machine {ref.name!r}: {err.get('ename', 'error')}: {err.get('evalue', '')}")
        return done

    async def exec_cell(self, machine: MachineRef, request: CellRequest, on_event: OnEvent) -> CellResult:
        limits = self.limiter.get(machine.name)
        ooms = limits.oom_kills() if limits is not None else 0
        watch = _agentend.Watch(machine.info)  # while the agent runs: if it dies, the kernel says how
        try:
            msg = exec_message(request, self._ids.cell(machine.name))
            async with contextlib.aclosing(self._stream(machine, msg)) as chunks:
                res = await gate.read_cell(chunks, request, on_event, machine.name, scope=machine.token)
        except SmolbenchError as exc:
            if limits is not None and limits.oom_kills() > ooms:  # the kernel killed the machine for memory
                raise MachineLost(f"{self._lost_for_memory(machine.spec)} (machine {machine.name} was lost)") from None
            raise await watch.verdict(exc, machine.name) from None  # its own end is the cell's; else MachineDied
        finally:
            watch.close()
        if res.status != "ok" and limits is not None and limits.oom_kills() > ooms:
            res.error = {"ename": "MemoryError", "evalue": self._lost_for_memory(machine.spec), "traceback": []}
        return res

    async def open_channel(self, machine: MachineRef, request: CellRequest, bound: Bound | None = None) -> Channel:
        """Start a cell that serves a loop of requests on its own connection (see ``_channel``);
        ``bound``: what one of its answers may take, past which it is refused as it arrives."""
        limits = self.limiter.get(machine.name)
        ooms = limits.oom_kills() if limits is not None else 0

        def lost() -> str | None:
            return self._lost_for_memory(machine.spec) if limits is not None and limits.oom_kills() > ooms else None

        loop = asyncio.get_running_loop()
        _, chan = await self._connect(machine, lambda path: loop.create_unix_connection(
            lambda: Channel(machine.name, request, lost, bound), path))
        chan.send(exec_message(request, self._ids.cell(machine.name)))
        return chan

    async def interrupt(self, machine: MachineRef) -> None:
        """Stop the last cell sent to ``machine`` if it still runs: never a later one."""
        rid = self._ids.last(machine.name)
        if rid is None:
            return
        with contextlib.suppress(SmolbenchError, OSError):
            await self._request(machine, interrupt_message(rid))

    async def info(self, machine: MachineRef) -> dict[str, Any]:
        """What the agent says about itself (python version, pid, cells run, ...)."""
        return dict((await self._request(machine, {"op": "ping"}))["info"])

    async def branch(
        self, machine: MachineRef, names: builtins.list[str], seeds: builtins.list[int | None], *, leaf: bool = False
    ) -> builtins.list[MachineRef]:
        if len(names) != len(seeds):
            raise ValueError("one seed per branch name")
        leaf = leaf and self._makes_leaves()
        _limits.check_fork_fits(len(names))
        host_dir, guest_run = Path(machine.info["host_dir"]), machine.info["guest_run"]
        # A contained branch gets a folder of its own (it sees only that one as its run folder).
        nested = bool(machine.info.get("contained"))
        taken = {Path(m.info["host_dir"]).name for m in self._machines.values() if m.parent == machine.name}
        taken |= {Path(d).name for d in self._going.values() if Path(d).parent == host_dir}  # not gone yet
        if nested:  # and never one still there: what a deleted branch left must not be the next one's
            with contextlib.suppress(OSError):
                taken |= set(os.listdir(host_dir))
        dirs = _run_folders(names, taken)
        children = [{"name": n, "seed": s, "dir": d, "socket": f"{guest_run}/{d}/s" if nested else f"{guest_run}/{n}.sock"}
                    for n, s, d in zip(names, seeds, dirs)]
        # the branches' cgroups are made while the agent forks (mkdir on cgroupfs is slow), and
        # the moves into them are kept cheap meanwhile (Limiter.keep_moves_cheap)
        cgroups = asyncio.ensure_future(asyncio.to_thread(self._make_cgroups, machine.spec, names))
        held = self.limiter.get(machine.name)
        if held is not None:  # a branch (keeper, agent, threads) counts here until it is moved
            held.fork_headroom(8 * len(names))
        forked = threading.Event()
        primed = asyncio.ensure_future(asyncio.to_thread(self.limiter.keep_moves_cheap, forked))
        fork_id = self._ids.new()
        forking = asyncio.ensure_future(self._request(machine, {"op": "fork", "id": fork_id, "children": children, "hold": True,
                                                                **({"leaf": True} if leaf else {})}))
        try:
            try:
                try:
                    done = await asyncio.shield(forking)
                except asyncio.CancelledError:  # its answer first (a grace period at most): what it made is
                    await _to_the_end(self._stop_request(machine, forking, fork_id))  # held, not made after the undo
                    raise
            except SmolbenchError as exc:
                if "BlockingIOError" not in str(exc):
                    raise
                raise SmolbenchError(
                    f"machine {machine.name!r} is at its process limit (pids = {machine.spec.pids}) and can't fork: "
                    "end some of its processes, or raise pids in the Smolfile") from None
            finally:
                forked.set()
            if sorted(m["name"] for m in done.get("children", [])) != sorted(names):
                raise gate.malformed(machine.name, "the branches it made are not the ones asked for")
            maker = done.get("maker") if leaf else None
            if leaf and (not done.get("leaf") or type(maker) is not int):
                raise gate.malformed(machine.name, "it did not make the leaf branches asked for")
            limits = await asyncio.shield(cgroups)  # cancelled, it would still make them, for no one to remove
        except BaseException:
            def cleared() -> None:  # their folders (or sockets) go now, not with the root: failed forks add up
                for n, d in zip(names, dirs):
                    self._clear_branch(machine, d if nested else None, str(host_dir / f"{n}.sock"))

            async def undo() -> None:
                if held is not None:
                    held.fork_headroom(0)
                with contextlib.suppress(SmolbenchError, OSError):  # held children exit
                    await self._request(machine, {"op": "release", "go": False})
                await asyncio.to_thread(cleared)
                unused = await cgroups
                for name in unused:
                    await asyncio.to_thread(self.limiter.release, name)

            await _to_the_end(undo())  # a second cancel too: left held, with their cgroups, until down
            raise
        if done.get("flattened"):
            self.notes.append(f"a fork of {machine.name} flattened its file layers ({', '.join(done['flattened'])}): "
                              "past 48 layers a fork copies them into one")
        refs = []
        folder = dict(zip(names, dirs))
        for made in done["children"]:
            mine = host_dir / folder[made["name"]] if nested else host_dir
            info = {**{k: machine.info[k] for k in ("run_dir", "workspace", "root", "guest_run", "workdir", "contained")},
                    "host_dir": str(mine), "guest_pid": made["pid"],
                    "socket": str(mine / "s") if nested else str(host_dir / f"{made['name']}.sock")}
            if leaf:
                info["leaf"] = True
            ref = MachineRef(made["name"], self.name, machine.spec, parent=machine.name, info=info)
            self._machines[ref.name] = ref
            refs.append(ref)
        try:
            # The branches wait, each a bare fork: into their own cgroups, then let them start.
            # (stopped: the moves end before the branches go)
            await _to_the_end(asyncio.to_thread(self._limit_branches, machine, refs, limits, maker))
            await self._request(machine, {"op": "release", "go": True})
        except BaseException:  # the caller never gets them: they go now, not at down
            await _to_the_end(asyncio.gather(*(self.delete(ref) for ref in refs), return_exceptions=True))
            raise
        finally:
            if held is not None:
                held.fork_headroom(0)
            await primed  # ended with the fork's answer
        return refs

    def _make_cgroups(self, spec: MachineSpec, names: builtins.list[str]) -> dict[str, _limits.MachineLimits]:
        if not self.limiter.mechanism.bases:
            return {}
        return {name: self.limiter.machine(name, spec) for name in names}

    def _limit_branches(self, parent: MachineRef, refs: builtins.list[MachineRef],
                        limits: dict[str, _limits.MachineLimits], maker: int | None = None) -> None:
        """Each branch into its own cgroup before it runs anything (it waits, held, until
        released), so its limits and its memory are its own from its first page on.
        ``maker``: a leaf fork's maker (its pid in the parent), whose children the branches are."""
        ancestor = parent.info.get("host_pid") or self._machines[parent.info["root"]].info.get("pid")
        guest = [r.info["guest_pid"] for r in refs]
        if not ancestor:
            found = {}
        elif maker is not None:
            found = _procs.leaf_pids(ancestor, maker, guest)
        else:
            found = self._host_pids(ancestor, guest)
        for ref in refs:
            pid = found.get(ref.info["guest_pid"])
            if pid is None:
                continue
            ref.info.update(host_pid=pid, host_started=_procs.start_time(pid))
            if ref.name in limits:
                limits[ref.name].adopt([pid])
        for name in set(limits) - {r.name for r in refs}:  # asked for, never made
            self.limiter.release(name)

    # -- checkpoints ----------------------------------------------------------------------

    @contextlib.contextmanager
    def _stage_folder(self, machine: MachineRef, stage: str,
                      refused: Callable[[str], str]) -> Iterator[tuple[int, str]]:
        """The folder holding ``stage`` in ``machine``'s run folder, found by :meth:`_below` (an
        O_PATH descriptor, closed after), and ``stage``; where it can't be reached without
        following a link, :class:`~smolbench.gate.archive.UnsafeCheckpoint` saying ``refused(why)``."""
        try:
            fd, name = self._below(machine, stage)
        except OSError as exc:
            raise archive.UnsafeCheckpoint(refused(exc.strerror or str(exc))) from None
        try:
            yield fd, name
        finally:
            os.close(fd)

    def _remove_below(self, machine: MachineRef, name: str) -> None:
        """Remove the folder ``name`` (a stage, a branch's folder: the machine writes in it, and may
        still run) from ``machine``'s run folder, found by :meth:`_below`: relative to descriptors,
        no link followed, nothing but folders opened (a fifo in its place hung ``shutil.rmtree``'s
        first open, and the kernel with it). A link the machine put in its place is left for the
        root's delete. A machine deleted meanwhile took its folder with it: nothing to find (nor
        to look for by its pid)."""
        if machine.name not in self._machines:
            return
        try:
            fd, name = self._below(machine, name)
        except OSError:
            return
        try:
            _rundir.remove_tree(fd, name)
        finally:
            os.close(fd)

    def _below(self, machine: MachineRef, name: str) -> tuple[int, str]:
        """An O_PATH descriptor of ``machine``'s run folder, and ``name`` in it."""
        return os.open(machine.info["host_dir"], os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC), name

    async def _stop_request(self, machine: MachineRef, request: asyncio.Future[Any], rid: int) -> None:
        """Interrupt what ``machine`` does for ``request`` (its id ``rid``: never a later request)
        and wait (a grace period at most) for its answer, so its next request does not find it
        busy; past that, hang up."""
        await _stop_with_grace(lambda: self._request(machine, interrupt_message(rid)), request, gate.LIMITS.grace)

    async def _request_explained(self, ref: MachineRef, msg: dict[str, Any]) -> dict[str, Any]:
        """``_request``, but a machine the kernel killed for memory meanwhile says so (MachineLost)."""
        limits = self.limiter.get(ref.name)
        ooms = limits.oom_kills() if limits is not None else 0
        try:
            return await self._request(ref, msg)
        except SmolbenchError as exc:
            if limits is not None and limits.oom_kills() > ooms:
                said = self._lost_for_memory(ref.spec, saving=msg.get("op") == "save")
                raise MachineLost(f"{said} (machine {ref.name} was lost)") from None
            if ": MemoryError:" in str(exc):  # past its rlimit: the machine lives on
                raise SmolbenchError(_limits.out_of_memory_line(ref.spec)) from None
            raise

    async def restore(self, path: str, name: str, spec: MachineSpec, *, isolated: bool = False) -> MachineRef:
        if isolated and self.name == "process":
            raise SmolbenchError(f"checkpoint {os.path.basename(path)} is not this kernel's own, and the {self.name} "
                                 "backend has no isolation to load its saved state in: restore it on the sandbox backend")
        try:  # checked here, extracted only inside the new machine
            checked = await asyncio.to_thread(archive.check_sized, path, self.name)
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise SmolbenchError(f"checkpoint {path} is corrupt or truncated ({archive.damage(exc) or exc}): delete it "
                                 "with `%smol checkpoint rm`") from None
        except archive.UnsafeCheckpoint as exc:
            raise archive.UnsafeCheckpoint(f"{exc}: refused; delete it with `%smol checkpoint rm`") from None
        room = self._room_refusal(spec, checked, path)
        if room is not None:  # before a machine boots for it (its headers say what it holds)
            raise SmolbenchError(room)
        ref = await self.create(spec, name)
        stage = None
        try:
            try:
                # stopped (a Ctrl-C): the copy ends, and its fifo's end is closed, before the machine goes
                stage, pipe, left = await _made_in_thread(lambda: self._hand_over(path, ref),
                                                          lambda made: os.close(made[1]))
            except OSError as exc:  # the new machine's run folder is sized by its memory and disk
                raise _NoRoom(f"checkpoint {path} doesn't fit in a new machine ({exc.strerror}): raise memory or "
                              "disk in the Smolfile") from None
            done = await self._load(ref, path, stage, pipe, left)  # (it closes pipe)
        except archive.UnsafeCheckpoint:  # stopped while streaming in (over the limit): said as it is
            await self.delete(ref)
            raise
        except SmolbenchError as exc:
            await self.delete(ref)
            if isinstance(exc, (_NoRoom, MachineLost)) or str(exc) == _limits.out_of_memory_line(spec):
                raise SmolbenchError(str(exc) if isinstance(exc, _NoRoom) else f"restoring checkpoint {path}: {exc}") from None
            if ": OSError: [Errno 28] " in str(exc):  # its workspace is more than this machine's disk
                raise SmolbenchError(f"checkpoint {path} doesn't fit in a new machine (No space left on device: its files "
                                     f"are more than disk = {_limits.format_mib(spec.files_mib)}): raise disk in the "
                                     "Smolfile, and memory with it (a sandbox keeps its files in memory)") from None
            why = str(exc).split(": ", 1)[-1]
            raise SmolbenchError(f"checkpoint {path} is corrupt: its saved state can't be loaded ({why}): delete it with `%smol checkpoint rm`") from None
        except BaseException:
            await self.delete(ref)
            raise
        finally:
            if stage is not None:
                await _to_the_end(asyncio.to_thread(self._remove_below, ref, stage))
        if done.get("skipped"):
            ref.info["restore_warnings"] = [f"not restored: {gate.terminal.listed(done['skipped'])}"]
        return ref

    def _room_refusal(self, spec: MachineSpec, checked: archive.Checked, label: str) -> str | None:
        """Why checkpoint ``label`` (``checked``: what its headers say it holds) can't fit in a new
        machine of ``spec``, or None: only where the files are kept in memory (the sandbox's, its
        stores sized by disk), and counted as memory where a cgroup does."""
        if not self.files_in_memory or not self.limiter.enforce:
            return None
        return _limits.room_refusal(spec, checked.files, checked.namespace, label,
                                    counted=bool(self.limiter.mechanism.bases))


class _Exited(Exception):
    """A machine's process ended before its agent was ready."""


class _NoRoom(SmolbenchError):
    """A checkpoint's files don't fit in the new machine."""


def _run_folders(names: builtins.list[str], taken: set[str] | None = None) -> builtins.list[str]:
    """Short folder names for branches (a socket path must stay under 108 bytes), none of them
    ``taken`` by a live sibling (episodes of two runs, ep1.3 and ep2.3, share a zygote)."""
    out: builtins.list[str] = []
    for i, name in enumerate(names):
        last = name.rsplit(".", 1)[-1]
        pick = last if last.isalnum() and len(last) <= 12 else f"b{i}"
        n = 0
        while pick in out or pick in (taken or ()):
            n += 1
            pick = f"b{i}x{n}"
        out.append(pick)
    return out


def _wait_gone(procs: list[tuple[int, str]]) -> None:
    """Return once these processes are gone (a zombie counts as gone), killing any still
    there: a killed process can take a while to exit on a loaded host, and a parent whose
    agent a cell rewrote need not kill anything. Bounded by ``KILL_TIMEOUT``."""
    deadline = time.monotonic() + KILL_TIMEOUT
    while time.monotonic() < deadline:
        alive = [p for p in procs if _procs.running(*p)]
        if not alive:
            return
        _procs.kill_all(alive)
        time.sleep(0.01)
