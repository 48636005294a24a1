"""The sandbox backend: the guest agent in a bubblewrap sandbox (no KVM needed).

Namespace isolation, not a VM: the machine has its own root filesystem (the
host's system directories read-only, or a pinned rootfs image), its own /tmp,
/run and workspace, no network unless asked, and no view of the host's home.
It shares the host kernel. A live branch is an ``os.fork()`` of the warm agent
inside the same sandbox, with its own socket and private copies of the
workspace and /tmp.

Without ``bwrap`` on the host the agent runs as a plain process, with a loud
warning: then there is no isolation at all.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import os
import shutil
import signal
import sys
import tarfile
import tempfile
import time
import warnings
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from .. import gate
from ..errors import BackendUnavailable, SmolbenchError
from ..gate import archive
from ..guest import AGENT_FILES, GUEST_DIR
from ..guest import protocol as P
from ..spec import MachineSpec
from ._wire import exec_message
from .base import Backend, CellRequest, CellResult, CheckpointInfo, MachineRef, OnEvent

# Host root entries a default sandbox sees (read-only); the rest (home, /root,
# /mnt, /work, /srv, ...) stays hidden unless a Smolfile volume declares it.
HOST_SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "opt", "var")
# Entries of a rootfs image that are never bound from the image itself.
SPECIAL_DIRS = {"proc", "dev", "sys", "tmp", "run", "lost+found"}
GUEST_RUN = "/run/smolbench"
GUEST_AGENT = "/run/smolbench-agent"
GUEST_LIB = "/run/smolbench-lib"
BOOT_TIMEOUT = 30.0
CHECKPOINT_SUFFIX = ".smolcheckpoint"
CHUNK = 256 * 1024  # bytes read from an agent's socket at a time (the gate makes frames)


def bwrap_path() -> str | None:
    """The bubblewrap binary, if installed."""
    return shutil.which("bwrap")


def _cloudpickle_dir() -> Path | None:
    try:
        import cloudpickle
    except ImportError:
        return None
    return Path(cloudpickle.__file__).resolve().parent


class SandboxBackend(Backend):
    """Machines as bubblewrap sandboxes on this host; branches by ``os.fork()``."""

    name = "sandbox"

    def __init__(self, *, use_bwrap: bool | None = None, runtime_dir: str | None = None) -> None:
        self._bwrap = bwrap_path() if use_bwrap in (None, True) else None
        if use_bwrap and not self._bwrap:
            raise BackendUnavailable("bubblewrap is not installed: apt-get install bubblewrap (or use the plain-process fallback)")
        self._runtime_base = runtime_dir
        self._machines: dict[str, MachineRef] = {}
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        if not self._bwrap:
            warnings.warn(
                "smolbench: bubblewrap (bwrap) is not installed, so machines run as PLAIN PROCESSES "
                "with NO isolation (full access to your files and network). Install it: apt-get install bubblewrap",
                RuntimeWarning,
                stacklevel=2,
            )

    @property
    def isolation(self) -> str:
        if self._bwrap:
            return "bubblewrap sandbox: namespace isolation (own rootfs, /tmp, pid and network namespaces), not a VM; shares the host kernel"
        return "NONE: plain host process (bubblewrap not installed); cells can read and write your files and use the network"

    # -- lifecycle ------------------------------------------------------------------

    async def create(self, spec: MachineSpec, name: str) -> MachineRef:
        if name in self._machines:
            raise SmolbenchError(f"a machine named {name!r} already exists: `%smol down` first or pick another name")
        run_dir = Path(tempfile.mkdtemp(prefix="smolbench-", dir=self._runtime_base))
        os.chmod(run_dir, 0o700)
        workspace = run_dir / "workspace"
        workspace.mkdir()
        ref = MachineRef(name, self.name, spec, info={"run_dir": str(run_dir), "workspace": str(workspace), "root": name})
        argv, guest_run, workdir = self._command(spec, name, run_dir, workspace)
        ref.info.update(guest_run=guest_run, workdir=workdir, socket=str(run_dir / f"{name}.sock"))
        log = open(run_dir / "agent.log", "wb")
        try:
            # start_new_session: the kernel's Ctrl-C (SIGINT to its process group) must not reach
            # the machine; we deliver interrupts ourselves. This runs on the workbench's loop
            # thread, which lives as long as the kernel, so --die-with-parent ties the sandbox
            # to the kernel process.
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                env=self._host_env(spec, name),
            )
        finally:
            log.close()
        self._procs[name] = proc
        self._machines[name] = ref
        ref.info["pid"] = proc.pid
        try:
            await self._wait_ready(ref, proc, run_dir / f"{name}.ready")
        except BaseException:
            await self.delete(ref)
            raise
        return ref

    def _command(self, spec: MachineSpec, name: str, run_dir: Path, workspace: Path) -> tuple[list[str], str, str]:
        from ..images import resolve_rootfs

        rootfs = resolve_rootfs(spec.image)
        cp = _cloudpickle_dir()
        if not self._bwrap:
            python = sys.executable
            agent = str(GUEST_DIR / "agent.py")
            argv = [python, "-u", agent, "--socket", str(run_dir / f"{name}.sock"), "--name", name,
                    "--workdir", str(workspace), "--ready", str(run_dir / f"{name}.ready"), "--no-mount-ns"]
            if cp:
                argv += ["--lib", str(cp.parent)]
            return argv, str(run_dir), str(workspace)
        argv = [self._bwrap, "--unshare-all", "--unshare-user", "--uid", "0", "--gid", "0",
                "--cap-add", "CAP_SYS_ADMIN", "--die-with-parent", "--new-session"]
        if spec.network_enabled:
            argv.append("--share-net")
        if rootfs is None:
            python = sys.executable
            for entry in HOST_SYSTEM_DIRS:
                argv += _bind_entry(Path("/"), entry)
            # The notebook's own Python may live in a hidden place (a home directory):
            # expose just its installation, read-only.
            for prefix in sorted({sys.prefix, sys.base_prefix, str(Path(sys.executable).resolve().parent.parent)}):
                if not any(prefix == f"/{d}" or prefix.startswith(f"/{d}/") for d in HOST_SYSTEM_DIRS):
                    argv += ["--ro-bind", prefix, prefix]
        else:
            python = "/usr/bin/python3"
            for entry in sorted(os.listdir(rootfs)):
                if entry not in SPECIAL_DIRS:
                    argv += _bind_entry(rootfs, entry)
        argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/run",
                 "--bind", str(run_dir), GUEST_RUN, "--bind", str(workspace), spec.workdir]
        for fname in AGENT_FILES:
            argv += ["--ro-bind", str(GUEST_DIR / fname), f"{GUEST_AGENT}/{fname}"]
        if cp:
            argv += ["--ro-bind", str(cp), f"{GUEST_LIB}/cloudpickle"]
        for vol in spec.volumes:
            argv += ["--ro-bind" if vol.readonly else "--bind", vol.host, vol.guest]
        argv += ["--hostname", f"smol-{name}"[:63], "--chdir", spec.workdir, "--clearenv"]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": spec.workdir, "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "SMOLBENCH_MACHINE": name, **spec.env_dict}
        for key, val in env.items():
            argv += ["--setenv", key, val]
        argv += [python, "-u", f"{GUEST_AGENT}/agent.py", "--socket", f"{GUEST_RUN}/{name}.sock",
                 "--name", name, "--workdir", spec.workdir, "--ready", f"{GUEST_RUN}/{name}.ready"]
        if cp:
            argv += ["--lib", GUEST_LIB]
        return argv, GUEST_RUN, spec.workdir

    @staticmethod
    def _host_env(spec: MachineSpec, name: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(spec.env_dict)
        env["SMOLBENCH_MACHINE"] = name  # as inside a sandbox (--setenv)
        env.pop("PYTHONPATH", None)
        return env

    async def _wait_ready(self, ref: MachineRef, proc: asyncio.subprocess.Process, ready: Path) -> None:
        deadline = time.monotonic() + BOOT_TIMEOUT
        while not ready.exists():
            if proc.returncode is not None:
                raise BackendUnavailable(f"the sandbox for {ref.name!r} exited during start: {self._log_tail(ref)}")
            if time.monotonic() > deadline:
                raise BackendUnavailable(f"the sandbox for {ref.name!r} did not start within {BOOT_TIMEOUT:.0f} s: {self._log_tail(ref)}")
            await asyncio.sleep(0.01)

    @staticmethod
    def _log_tail(ref: MachineRef) -> str:
        try:
            text = (Path(ref.info["run_dir"]) / "agent.log").read_text(errors="replace").strip()
        except OSError:
            return "(no log)"
        return text.splitlines()[-1] if text else "(empty log)"

    async def delete(self, machine: MachineRef) -> None:
        ref = self._machines.pop(machine.name, None)
        if ref is None:
            return
        for child in [m for m in self._machines.values() if m.parent == ref.name]:
            await self.delete(child)
        proc = self._procs.pop(ref.name, None)
        if proc is not None:  # a root: the whole sandbox goes with its process group
            # bwrap --new-session puts the machine's own processes in another session, so
            # they are killed by pid, and we wait until they are gone, not just signalled.
            inside = _descendants(proc.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            for pid, _ in inside:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            await proc.wait()
            deadline = time.monotonic() + 10
            while any(_running(*p) for p in inside) and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            shutil.rmtree(ref.info["run_dir"], ignore_errors=True)
            return
        root = self._machines.get(ref.info["root"])
        if root is not None and "guest_pid" in ref.info:
            with contextlib.suppress(OSError, SmolbenchError):
                await self._request(root, {"op": "kill", "pid": ref.info["guest_pid"]})
        with contextlib.suppress(OSError):
            os.unlink(ref.info["socket"])

    def list(self) -> builtins.list[MachineRef]:
        return list(self._machines.values())

    # -- talking to agents ------------------------------------------------------------

    async def _open(self, ref: MachineRef) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if ref.name not in self._machines:
            raise SmolbenchError(f"machine {ref.name!r} was deleted: pick another with `%smol use` or `%smol up`")
        try:
            return await asyncio.open_unix_connection(ref.info["socket"])
        except OSError as exc:
            raise SmolbenchError(f"machine {ref.name!r} is not answering ({exc.strerror}): it may have died; `%smol down` and `%smol up`") from None

    async def _stream(self, ref: MachineRef, msg: dict[str, Any]) -> AsyncGenerator[bytes, None]:
        reader, writer = await self._open(ref)
        try:
            writer.write(P.encode(msg))
            await writer.drain()
            while True:
                chunk = await reader.read(CHUNK)
                if not chunk:
                    return
                yield chunk
        finally:
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
        async with contextlib.aclosing(self._stream(machine, exec_message(request))) as chunks:
            return await gate.read_cell(chunks, request, on_event, machine.name)

    async def interrupt(self, machine: MachineRef) -> None:
        with contextlib.suppress(SmolbenchError, OSError):
            await self._request(machine, {"op": "interrupt"})

    async def info(self, machine: MachineRef) -> dict[str, Any]:
        """What the agent says about itself (python version, pid, cells run, ...)."""
        return dict((await self._request(machine, {"op": "ping"}))["info"])

    async def branch(
        self, machine: MachineRef, names: builtins.list[str], seeds: builtins.list[int | None]
    ) -> builtins.list[MachineRef]:
        if len(names) != len(seeds):
            raise ValueError("one seed per branch name")
        run_dir = Path(machine.info["run_dir"])
        guest_run = machine.info["guest_run"]
        children = [{"name": n, "seed": s, "socket": f"{guest_run}/{n}.sock"} for n, s in zip(names, seeds)]
        done = await self._request(machine, {"op": "fork", "children": children})
        refs = []
        for made in done["children"]:
            info = {**{k: machine.info[k] for k in ("run_dir", "workspace", "root", "guest_run", "workdir")},
                    "socket": str(run_dir / f"{made['name']}.sock"), "guest_pid": made["pid"]}
            ref = MachineRef(made["name"], self.name, machine.spec, parent=machine.name, info=info)
            self._machines[ref.name] = ref
            refs.append(ref)
        return refs

    # -- checkpoints ----------------------------------------------------------------------

    async def checkpoint(self, machine: MachineRef, path: str) -> CheckpointInfo:
        stage = f"ckpt-{os.getpid()}-{time.monotonic_ns()}"
        run_dir = machine.info["run_dir"]
        try:  # the stage goes on every path, even when the machine fails to save
            done = await self._request(machine, {"op": "save", "path": f"{machine.info['guest_run']}/{stage}"})
            # The machine made every path in the stage: the gate reads them without following links.
            archive.pack(run_dir, stage, path + ".part", machine.name)
            os.replace(path + ".part", path)
        finally:
            shutil.rmtree(Path(run_dir) / stage, ignore_errors=True)  # fd-based: never follows links
            with contextlib.suppress(OSError):
                os.unlink(path + ".part")
        warn = [f"not saved (can't be pickled): {', '.join(done['skipped'])}"] if done.get("skipped") else []
        return CheckpointInfo(path, self.name, os.path.getsize(path), warn)

    async def restore(self, path: str, name: str, spec: MachineSpec) -> MachineRef:
        try:
            archive.check(path)  # checked here, extracted only inside the new machine
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise SmolbenchError(f"checkpoint {path} is corrupt or truncated ({exc}): delete it with `%smol checkpoint rm`") from None
        except archive.UnsafeCheckpoint as exc:
            raise archive.UnsafeCheckpoint(f"{exc}: refused; delete it with `%smol checkpoint rm`") from None
        ref = await self.create(spec, name)
        stage = None
        try:
            stage = archive.hand_over(path, ref.info["run_dir"])
            done = await self._request(ref, {"op": "load", "path": f"{ref.info['guest_run']}/{stage}"})
        except SmolbenchError as exc:
            await self.delete(ref)
            why = str(exc).split(": ", 1)[-1]
            raise SmolbenchError(f"checkpoint {path} is corrupt: its saved state can't be loaded ({why}): delete it with `%smol checkpoint rm`") from None
        except BaseException:
            await self.delete(ref)
            raise
        finally:
            if stage is not None:
                shutil.rmtree(Path(ref.info["run_dir"]) / stage, ignore_errors=True)
        if done.get("skipped"):
            ref.info["restore_warnings"] = [f"not restored: {', '.join(done['skipped'])}"]
        return ref


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state first), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2:].decode().split()


def _descendants(pid: int) -> builtins.list[tuple[int, str]]:
    """(pid, start time) of every process below ``pid``."""
    children: dict[int, builtins.list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append((int(entry), fields[19]))
    out, todo = [], [pid]
    while todo:
        for kid in children.get(todo.pop(), []):
            out.append(kid)
            todo.append(kid[0])
    return out


def _running(pid: int, started: str) -> bool:
    """True while that process (not a later one with the same pid) exists and is not a zombie."""
    fields = _stat(pid)
    return fields is not None and fields[19] == started and fields[0] not in ("Z", "X")


def _bind_entry(root: Path, entry: str) -> list[str]:
    src = root / entry
    if src.is_symlink():
        return ["--symlink", os.readlink(src), f"/{entry}"]
    if src.is_dir():
        return ["--ro-bind", str(src), f"/{entry}"]
    return []
