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
import re
import shutil
import signal
import sys
import tarfile
import tempfile
import time
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ..errors import BackendUnavailable, SmolbenchError
from ..guest import GUEST_DIR
from ..guest import protocol as P
from ..spec import MachineSpec
from ._bwrap import GUEST_RUN, plan, sandbox_ids, weakened
from ._wire import exec_message, read_replies, to_result
from .base import Backend, CellRequest, CellResult, CheckpointInfo, MachineRef, OnEvent

BOOT_TIMEOUT = 30.0
CHECKPOINT_SUFFIX = ".smolcheckpoint"


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
        self._containment: dict[str, Any] | None = None  # what the first machine said about itself
        self._notes: builtins.list[str] = []
        self._fd_paths: dict[str, str] = {}
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
            line = ("bubblewrap sandbox: namespace isolation (own rootfs, /tmp, pid and network namespaces), "
                    "not a VM; shares the host kernel")
            if "host-root" in weakened():
                return line + "; WEAKENED FOR A TEST: uid 0 inside is host root"
            c = self._containment
            if c:
                line += (f"; runs as uid {c['uid']} with {'no' if c['cap_eff'] == 0 else 'SOME'} capabilities, "
                         f"seccomp {c['seccomp']}; files: "
                         + ("copy-on-write (overlayfs)" if c["files"] == "overlay" else c["files"]))
            return "; ".join([line, *self._notes])
        return "NONE: plain host process (bubblewrap not installed); cells can read and write your files and use the network"

    # -- lifecycle ------------------------------------------------------------------

    async def create(self, spec: MachineSpec, name: str) -> MachineRef:
        if name in self._machines:
            raise SmolbenchError(f"a machine named {name!r} already exists: `%smol down` first or pick another name")
        run_dir = Path(tempfile.mkdtemp(prefix="smolbench-", dir=self._runtime_base))
        # Traversable, not listable: bwrap (as the sandbox uid) resolves the files bound from here.
        os.chmod(run_dir, 0o711 if self._bwrap else 0o700)
        host_dir = run_dir / "m"  # the machine's own folder: its socket, its branches' folders
        host_dir.mkdir(mode=0o700)
        contained = bool(self._bwrap) and "host-root" not in weakened()
        if contained and os.geteuid() == 0:
            os.chown(host_dir, *sandbox_ids())  # the machine writes here, as its own uid
        ref = MachineRef(name, self.name, spec, info={
            "run_dir": str(run_dir), "host_dir": str(host_dir), "root": name, "contained": contained,
            "guest_dir": GUEST_RUN if self._bwrap else str(host_dir), "socket": str(host_dir / "s"),
            "workdir": spec.workdir if self._bwrap else str(run_dir / "workspace")})
        argv, fds, self._fd_paths = self._command(spec, name, run_dir)
        log = open(run_dir / "agent.log", "wb")
        try:
            # start_new_session: the kernel's Ctrl-C (SIGINT to its process group) must not reach
            # the machine; we deliver interrupts ourselves. This runs on the workbench's loop
            # thread, which lives as long as the kernel, so --die-with-parent ties the sandbox
            # to the kernel process. As root, bwrap starts as the unprivileged sandbox uid.
            uid, gid = sandbox_ids()
            as_user: dict[str, Any] = {}
            if self._bwrap and os.geteuid() == 0 and "host-root" not in weakened():
                as_user = {"user": uid, "group": gid, "extra_groups": []}
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                env=self._host_env(spec, name),
                pass_fds=fds,
                **as_user,
            )
        finally:
            log.close()
            for fd in fds:
                os.close(fd)
        self._procs[name] = proc
        self._machines[name] = ref
        ref.info["pid"] = proc.pid
        try:
            await self._wait_ready(ref, proc, host_dir / "ready")
            if contained and self._containment is None:
                self._containment = (await self.info(ref)).get("containment")
        except BaseException:
            await self.delete(ref)
            raise
        return ref

    def _command(self, spec: MachineSpec, name: str, run_dir: Path) -> tuple[list[str], list[int], dict[str, str]]:
        from ..images import resolve_rootfs

        rootfs = resolve_rootfs(spec.image)
        host_dir = run_dir / "m"
        if not self._bwrap:
            workspace = run_dir / "workspace"
            workspace.mkdir()
            argv = [sys.executable, "-u", str(GUEST_DIR / "agent.py"), "--socket", str(host_dir / "s"), "--name", name,
                    "--workdir", str(workspace), "--ready", str(host_dir / "ready"), "--no-mount-ns"]
            cp = _cloudpickle_dir()
            if cp:
                argv += ["--lib", str(cp.parent)]
            return argv, [], {}
        p = plan(spec, name, self._bwrap, run_dir, rootfs)
        return p.argv, p.fds, p.paths

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

    def _log_tail(self, ref: MachineRef) -> str:
        try:
            text = (Path(ref.info["run_dir"]) / "agent.log").read_text(errors="replace").strip()
        except OSError:
            return "(no log)"
        last = text.splitlines()[-1] if text else "(empty log)"
        m = re.search(r"source path (/proc/self/fd/\d+): Permission denied", last)
        if m and m.group(1) in self._fd_paths:
            host = self._fd_paths[m.group(1)]
            return (f"the sandbox uid {sandbox_ids()[0]} can't reach {host} (a folder above it is not "
                    f"traversable): `chmod o+x` its parent folders, or put it elsewhere")
        return last

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
        # The parent forked the branch: the pid is one of its own pid namespace.
        parent = self._machines.get(ref.parent or "")
        if parent is not None and "guest_pid" in ref.info:
            with contextlib.suppress(OSError, SmolbenchError):
                await self._request(parent, {"op": "kill", "pid": ref.info["guest_pid"]})
        with contextlib.suppress(OSError):
            os.unlink(ref.info["socket"])

    def list(self) -> builtins.list[MachineRef]:
        return list(self._machines.values())

    # -- talking to agents ------------------------------------------------------------

    async def _open(self, ref: MachineRef) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if ref.name not in self._machines:
            raise SmolbenchError(f"machine {ref.name!r} was deleted: pick another with `%smol use` or `%smol up`")
        try:
            return await asyncio.open_unix_connection(ref.info["socket"], limit=2**26)
        except OSError as exc:
            raise SmolbenchError(f"machine {ref.name!r} is not answering ({exc.strerror}): it may have died; `%smol down` and `%smol up`") from None

    async def _stream(self, ref: MachineRef, msg: dict[str, Any]) -> AsyncIterator[bytes]:
        reader, writer = await self._open(ref)
        try:
            writer.write(P.encode(msg))
            await writer.drain()
            while True:
                line = await reader.readline()
                if not line:
                    return
                yield line
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _request(self, ref: MachineRef, msg: dict[str, Any]) -> dict[str, Any]:
        done = await read_replies(self._stream(ref, msg), None, f"machine {ref.name!r}")
        if done.get("status") != "ok":
            err = done.get("error") or {}
            raise SmolbenchError(f"machine {ref.name!r}: {err.get('ename', 'error')}: {err.get('evalue', '')}")
        return done

    async def exec_cell(self, machine: MachineRef, request: CellRequest, on_event: OnEvent) -> CellResult:
        done = await read_replies(self._stream(machine, exec_message(request)), on_event, f"machine {machine.name!r}")
        return to_result(done)

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
        host_dir, guest_dir = Path(machine.info["host_dir"]), machine.info["guest_dir"]
        dirs = _run_folders(names)
        children = [{"name": n, "seed": s, "dir": d, "socket": f"{guest_dir}/{d}/s"} for n, s, d in zip(names, seeds, dirs)]
        done = await self._request(machine, {"op": "fork", "children": children})
        if done.get("flattened"):
            self._notes.append(f"fork of {machine.name}: too many file layers, so "
                               f"{', '.join(done['flattened'])} were flattened (copied once)")
        refs = []
        by_name = dict(zip(names, dirs))
        for made in done["children"]:
            d = by_name[made["name"]]
            mine = host_dir / d
            info = {**{k: machine.info[k] for k in ("run_dir", "root", "workdir", "contained")},
                    "host_dir": str(mine), "guest_dir": guest_dir if machine.info["contained"] else str(mine),
                    "socket": str(mine / "s"), "guest_pid": made["pid"]}
            ref = MachineRef(made["name"], self.name, machine.spec, parent=machine.name, info=info)
            self._machines[ref.name] = ref
            refs.append(ref)
        return refs

    # -- checkpoints ----------------------------------------------------------------------

    async def checkpoint(self, machine: MachineRef, path: str) -> CheckpointInfo:
        stage = f"ckpt-{os.getpid()}-{time.monotonic_ns()}"
        host_stage = Path(machine.info["host_dir"]) / stage
        try:  # the stage goes on every path, even when the machine fails to save
            done = await self._request(machine, {"op": "save", "path": f"{machine.info['guest_dir']}/{stage}"})
            tmp = path + ".part"
            with tarfile.open(tmp, "w:gz") as tar:
                tar.add(host_stage / "namespace.pkl", arcname="namespace.pkl")
                tar.add(host_stage / "workspace.tar", arcname="workspace.tar")
            os.replace(tmp, path)
        finally:
            shutil.rmtree(host_stage, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.unlink(path + ".part")
        warn = [f"not saved (can't be pickled): {', '.join(done['skipped'])}"] if done.get("skipped") else []
        return CheckpointInfo(path, self.name, os.path.getsize(path), warn)

    async def restore(self, path: str, name: str, spec: MachineSpec) -> MachineRef:
        stage = tempfile.mkdtemp(prefix="smolbench-restore-")
        try:
            try:
                with tarfile.open(path, "r:gz") as tar:
                    names = set(tar.getnames())
                    if names != {"namespace.pkl", "workspace.tar"}:
                        raise SmolbenchError(f"checkpoint {path} is not a sandbox checkpoint (has {sorted(names)})")
                    tar.extractall(stage)
            except (tarfile.TarError, EOFError, OSError) as exc:
                raise SmolbenchError(f"checkpoint {path} is corrupt or truncated ({exc}): delete it with `%smol checkpoint rm`") from None
            ref = await self.create(spec, name)
            host_stage = Path(ref.info["host_dir"]) / "restore"
            shutil.copytree(stage, host_stage)
            if ref.info["contained"] and os.geteuid() == 0:
                _chown_tree(host_stage, *sandbox_ids())  # the machine reads it as its own uid
            try:
                done = await self._request(ref, {"op": "load", "path": f"{ref.info['guest_dir']}/restore"})
            except SmolbenchError as exc:
                await self.delete(ref)
                why = str(exc).split(": ", 1)[-1]
                raise SmolbenchError(f"checkpoint {path} is corrupt: its saved state can't be loaded ({why}): delete it with `%smol checkpoint rm`") from None
            except BaseException:
                await self.delete(ref)
                raise
            finally:
                shutil.rmtree(host_stage, ignore_errors=True)
            if done.get("skipped"):
                ref.info["restore_warnings"] = [f"not restored: {', '.join(done['skipped'])}"]
            return ref
        finally:
            shutil.rmtree(stage, ignore_errors=True)


def _run_folders(names: builtins.list[str]) -> builtins.list[str]:
    """Short folder names for branches (a socket path must stay under 108 bytes)."""
    out = []
    for i, name in enumerate(names):
        last = name.rsplit(".", 1)[-1]
        out.append(last if last.isalnum() and len(last) <= 12 and last not in out else f"b{i}")
    return out


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    for folder, dirs, files in os.walk(root):
        for entry in [folder, *(os.path.join(folder, n) for n in dirs + files)]:
            os.chown(entry, uid, gid, follow_symlinks=False)


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
