"""A fake smol engine behind ``create_autospec`` doubles of the real ``smol.Machine``.

A call that drifts from the SDK's real signatures fails here. Behind the doubles,
each fake VM is a directory standing in for the guest's root filesystem: commands
run as real host processes with every absolute path argument mapped into it, so
the real guest agent, launcher and ``client.py`` do the work, and ``exec_stream``
returns a real ``smol.ExecStream`` whose stdout chunks split lines on purpose.
A branch or a checkpoint copies the agent's RAM the only way a process can: the
fake asks the agent to ``os.fork()`` itself into the copy's directory.

Where the real local SDK (smolmachines 1.32.2, seen on real microVMs) differs
from its docs, the fake does what the real one does:

- ``exec_stream`` drops ``ExecOptions.stdin``: the command reads EOF (``exec``
  delivers it);
- a ``branchable`` machine is started by ``start_forkable()``, which waits a fixed
  180 s for the guest agent whatever ``ready_timeout_seconds`` says;
- ``checkpoint()`` refuses a machine booted from a host-backed image (a rootfs
  directory or a ``docker save`` archive) with CONFIG_ERROR;
- ``delete()`` refuses a machine whose branches still exist ("delete descendants first").

``Machine.export_checkpoint`` makes a portable file that a fake engine in another process
(another Ray node's agent) restores: the VM's directory plus its agent's saved namespace,
loaded into a freshly started agent (a process's RAM can't travel; what pickles does).

The agent runs with ``--no-mount-ns`` (its mode for a plain host process), so a
branch copies only its own workspace inside the fake VM's directory, never the
host's /tmp.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import io
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock, create_autospec

import pytest
from smol import (
    ConnectOptions,
    ExecOptions,
    ExecResult,
    ExecStream,
    Machine,
    MachineConfig,
    MachineSummary,
    PortableCheckpointInfo,
    SmolError,
    wrap_native_error,
)

from smolbench.backends import smol as smolmod
from smolbench.backends import smol_checkpoints
from smolbench.guest import protocol as P

CHUNK = 23  # bytes per stdout chunk of the fake exec_stream: splits reply lines mid-line
FORKABLE_AGENT_WAIT = 180.0  # start_forkable()'s fixed wait for the guest agent, in seconds
AGENT_NOT_READY = (
    "Agent error (start machine): agent operation failed: wait for ready: "
    "agent did not become ready within 180 seconds"
)
HOST_BACKED = (
    "[CONFIG_ERROR] Config (checkpoint machine): the initial portable checkpoint profile does "
    "not support host-backed image layers; stop or detach these resources before capture"
)


def _ignore_sockets(directory: str, names: list[str]) -> list[str]:
    return [
        n
        for n in names
        if not os.path.isfile(os.path.join(directory, n))
        and not os.path.isdir(os.path.join(directory, n))
    ]


def _host_backed(image: str | None) -> bool:
    return bool(image) and str(image).startswith("/")


class FakeHost:
    """Plays smol's engine for the tests: makes fake VMs and remembers every call.

    ``ready_seconds(config)`` is how long the guest agent of a new machine takes to
    come up (0 by default); past the SDK's limits, create fails as the real one does.
    """

    def __init__(self, base: Path) -> None:
        self.base = base
        self.vms: list[FakeVM] = []
        self.popens: list[subprocess.Popen[bytes]] = []
        self.checkpoints: dict[str, tuple[Path, int]] = {}
        self.chunks: list[str] = []
        self.ready_seconds: Callable[[MachineConfig], float] = lambda config: 0.0
        # Called before every write_file (the relay writes each cell's request): a test can
        # make a machine die there, as a VM lost to the host would.
        self.before_write: Callable[[FakeVM, str], None] = lambda vm, path: None
        self._serial = itertools.count(1)
        self.cls = create_autospec(Machine)
        self.cls.create.side_effect = self.create
        self.cls.restore_checkpoint.side_effect = self.restore_checkpoint
        self.cls.export_checkpoint.side_effect = self.export_checkpoint
        self.cls.prune_checkpoint_store.side_effect = lambda store: 0
        self.cls.list.side_effect = self.list
        self.launches: dict[str, tuple[list[str], dict[str, str], str | None]] = {}  # stored checkpoint -> agent
        self.cls.delete_by_name.side_effect = lambda machine_id, conn=None, drain_secs=None: None

    def new_root(self) -> Path:
        root = self.base / f"vm{next(self._serial)}"
        root.mkdir()
        return root

    def create(
        self, config: MachineConfig | None = None, conn: ConnectOptions | None = None
    ) -> Any:
        assert config is not None and config.name
        ready = self.ready_seconds(config)
        if config.branchable and ready > FORKABLE_AGENT_WAIT:
            raise wrap_native_error(RuntimeError(f"[SMOLVM_ERROR] {AGENT_NOT_READY}"))
        if not config.branchable and ready > config.ready_timeout_seconds:
            raise SmolError(
                "TIMEOUT",
                f"machine '{config.name}' did not become ready within "
                f"{config.ready_timeout_seconds:g}s",
            )
        vm = FakeVM(self, config.name, self.new_root(), config.image)
        vm.labels = dict(config.labels or {})
        for mount in config.mounts or []:  # a host folder at its guest path (read-only is not enforced here)
            at = Path(vm.path(mount.target))
            at.parent.mkdir(parents=True, exist_ok=True)
            at.symlink_to(mount.source)
        return vm.machine

    def restore_checkpoint(
        self,
        checkpoint_id: str,
        name: str,
        conn: ConnectOptions | None = None,
        network: bool | None = None,
        cache_disk: Any = None,
    ) -> Any:
        if checkpoint_id not in self.checkpoints and os.path.isfile(checkpoint_id):
            return self.restore_portable(checkpoint_id, name)
        if checkpoint_id not in self.checkpoints:
            raise SmolError("NOT_FOUND", f"no checkpoint at {checkpoint_id}")
        root, pid = self.checkpoints.pop(checkpoint_id)
        vm = FakeVM(self, name, root, None)
        vm.agent_pid, vm.agent_sock = pid, self.sock_of(root)
        vm.launch = self.launches.get(checkpoint_id)
        return vm.machine

    def list(self, conn: ConnectOptions | None = None, labels: dict[str, str] | None = None) -> list[MachineSummary]:
        """Live fake VMs carrying every one of ``labels``, as ``Machine.list`` reports them."""
        want = (labels or {}).items()
        return [MachineSummary(id=vm.name, name=vm.name, state="running", labels=dict(vm.labels))
                for vm in self.vms if not vm.deleted and want <= vm.labels.items()]

    def delete_named(self, machine_id: str, conn: ConnectOptions | None = None, drain_secs: float | None = None) -> None:
        """``Machine.delete_by_name`` that deletes (a test wires it in where it needs that)."""
        for vm in self.vms:
            if vm.name == machine_id and not vm.deleted:
                vm.delete()

    def export_checkpoint(self, source: str, output: str) -> int:
        """One portable file: the frozen VM's directory and its agent's saved namespace."""
        if source not in self.checkpoints:
            raise SmolError("NOT_FOUND", f"no stored checkpoint at {source}")
        root, _ = self.checkpoints[source]
        launch = self.launches[source]
        sock = self.sock_of(root)
        assert sock is not None
        replies = talk(sock, {"op": "save", "path": f"{root}/.fakestate"})
        assert replies[-1]["status"] == "ok", replies
        meta = {"argv": launch[0], "env": launch[1], "image": launch[2]}
        with tarfile.open(output, "w") as tar:  # not gzip: that is smolbench's own state checkpoint
            blob = json.dumps(meta).encode()
            info = tarfile.TarInfo("fakevm.json")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
            tar.add(root, arcname="root", filter=lambda m: m if m.isfile() or m.isdir() else None)
        return os.path.getsize(output)

    def restore_portable(self, path: str, name: str) -> Any:
        """A fresh agent in a new fake VM, loaded with an exported checkpoint's namespace."""
        try:
            with tarfile.open(path, "r:") as tar:
                meta = json.loads(tar.extractfile("fakevm.json").read())  # type: ignore[union-attr]
                stage = Path(tempfile.mkdtemp(dir=self.base))
                # Debian 12's Python 3.11.2 has no extraction filters (3.11.4+ has)
                tar.extractall(stage, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        except (tarfile.TarError, KeyError, OSError, ValueError) as exc:
            raise SmolError("INVALID_CONFIG", f"restore checkpoint: not a checkpoint layout ({exc})") from None
        root = self.new_root()
        root.rmdir()
        (stage / "root").rename(root)
        shutil.rmtree(stage)
        argv = list(meta["argv"])
        ready = Path(f"{root}{argv[argv.index('--ready') + 1]}")
        for stale in ready.parent.glob("*.ready"):
            stale.unlink()
        vm = FakeVM(self, name, root, meta["image"])
        vm.exec(argv, ExecOptions(background=True, env=meta["env"]))
        deadline = time.monotonic() + 15
        while not ready.exists():
            assert time.monotonic() < deadline, "the restored agent never got ready"
            time.sleep(0.05)
        replies = talk(vm.agent_sock or "", {"op": "load", "path": f"{root}/.fakestate"})
        assert replies[-1]["status"] == "ok", replies
        return vm.machine

    @staticmethod
    def sock_of(root: Path) -> str | None:
        run = root / "run" / "smolbench"
        socks = sorted(run.glob("*.sock")) if run.is_dir() else []
        return str(socks[0]) if socks else None

    def agent_fork(self, parent: FakeVM, root: Path) -> int:
        """Copy ``parent``'s agent (its "RAM") into ``root``, listening on the same guest path."""
        assert parent.agent_sock is not None
        guest_sock = "/" + os.path.relpath(parent.agent_sock, parent.root)
        shutil.copytree(parent.root, root, ignore=_ignore_sockets, dirs_exist_ok=True)
        name = f"smolfake{os.getpid()}x{next(self._serial)}"
        msg = {
            "op": "fork",
            "children": [{"name": name, "seed": None, "socket": f"{root}{guest_sock}"}],
        }
        replies = talk(parent.agent_sock, msg)
        assert replies[-1]["status"] == "ok", replies
        return int(replies[-1]["children"][0]["pid"])

    def cleanup(self) -> None:
        for vm in self.vms:
            vm.kill()
        for _, pid in self.checkpoints.values():  # frozen copies never restored
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.popens:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def talk(sock: str, msg: dict[str, Any]) -> list[dict[str, Any]]:
    """Send one request straight to an agent socket and read all replies."""
    import socket as socketlib

    with socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(sock)
        s.sendall(P.encode(msg))
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return [P.decode(line) for line in data.splitlines() if line.strip()]


class FakeVM:
    """One fake machine: an autospec'd ``smol.Machine`` whose methods act on a directory."""

    def __init__(self, host: FakeHost, name: str, root: Path, image: str | None) -> None:
        self.host, self.name, self.root, self.image = host, name, root, image
        self.agent_pid: int | None = None
        self.agent_sock: str | None = None
        self.source: FakeVM | None = None  # the VM this one was branched from
        self.launch: tuple[list[str], dict[str, str], str | None] | None = None  # how its agent was started
        self.labels: dict[str, str] = {}
        self.deleted = False
        self.fail_delete: SmolError | None = None
        m = create_autospec(Machine, instance=True)
        m.name, m.id = name, name
        m.exec.side_effect = self.exec
        m.exec_stream.side_effect = self.exec_stream
        m.write_file.side_effect = self.write_file
        m.read_file.side_effect = self.read_file
        m.branch_batch.side_effect = self.branch_batch
        m.checkpoint.side_effect = self.checkpoint
        m.delete.side_effect = self.delete
        self.machine: MagicMock = m
        host.vms.append(self)

    def path(self, guest: str) -> str:
        return f"{self.root}{guest}" if guest.startswith("/") else guest

    def argv(self, command: list[str]) -> list[str]:
        assert all(isinstance(a, str) for a in command), command
        head = sys.executable if command[0] == "python3" else command[0]
        return [head, *(self.path(a) for a in command[1:])]

    def _alive(self) -> None:
        if self.deleted:
            raise SmolError("NOT_FOUND", f"machine {self.name} not found")

    def exec(self, command: list[str], opts: ExecOptions | None = None) -> ExecResult:
        self._alive()
        opts = opts or ExecOptions()
        env = {**os.environ, **(opts.env or {})}
        if opts.background:
            # The agent is a plain host process here: its no-mount-namespace mode.
            proc = subprocess.Popen(
                [*self.argv(command), "--no-mount-ns"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            self.host.popens.append(proc)
            self.agent_pid = proc.pid
            self.agent_sock = self.path(command[command.index("--socket") + 1])
            self.launch = (list(command), dict(opts.env or {}), self.image)
            return ExecResult(exit_code=0, stdout=f"pid={proc.pid}\n", stderr="", pid=proc.pid)
        stdin = opts.stdin.encode() if isinstance(opts.stdin, str) else opts.stdin
        if stdin and command[1:2] == [smolmod.CLIENT]:
            stdin = self.guest_request(stdin)
        try:
            res = subprocess.run(
                self.argv(command),
                input=stdin or b"",
                capture_output=True,
                env=env,
                timeout=opts.timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise SmolError("TIMEOUT", f"command timed out: {command}") from exc
        return ExecResult(
            exit_code=res.returncode, stdout=res.stdout.decode(), stderr=res.stderr.decode()
        )

    def guest_request(self, line: bytes) -> bytes:
        """A request as the agent in this VM would see it: its guest paths inside the VM."""
        msg = P.decode(line)
        if isinstance(msg.get("path"), str):
            msg["path"] = self.path(msg["path"])
        return P.encode(msg)

    def exec_stream(self, command: list[str], opts: ExecOptions | None = None) -> ExecStream:
        self._alive()
        # Like smol 1.32.2's local engine: ExecOptions.stdin is silently dropped.
        proc = subprocess.Popen(
            self.argv(command),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdout is not None and proc.stderr is not None
        out, err = proc.stdout, proc.stderr
        chunks = self.host.chunks

        def events() -> Iterator[dict[str, Any]]:
            decoder = codecs.getincrementaldecoder("utf-8")()
            try:
                while data := os.read(out.fileno(), CHUNK):
                    text = decoder.decode(data)
                    if text:
                        chunks.append(text)
                        yield {"kind": "stdout", "data": text}
                tail = err.read().decode()
                if tail:
                    yield {"kind": "stderr", "data": tail}
                yield {"kind": "exit", "exit_code": proc.wait()}
            finally:
                out.close()
                err.close()
                if proc.poll() is None:
                    proc.kill()
                proc.wait()

        return ExecStream(events(), proc.kill)

    def write_file(self, path: str, data: bytes | str, mode: int | None = None) -> None:
        self._alive()
        self.host.before_write(self, path)
        self._alive()
        host = Path(self.path(path))
        if os.path.basename(path).startswith("request-") and path.startswith(smolmod.GUEST_RUN + "/"):
            data = self.guest_request(data.encode() if isinstance(data, str) else data)  # a relay's request file
        if not host.parent.is_dir():  # like a guest without the directory
            raise SmolError("SMOLVM_ERROR", f"write {path}: no such directory")
        host.write_bytes(data.encode() if isinstance(data, str) else data)
        if mode is not None:
            host.chmod(mode)

    def read_file(self, path: str) -> bytes:
        self._alive()
        try:
            return Path(self.path(path)).read_bytes()
        except OSError as exc:
            raise SmolError("SMOLVM_ERROR", f"read {path}: {exc.strerror}") from None

    def branch_batch(
        self,
        count: int | None = None,
        *,
        names: list[str] | None = None,
        name_prefix: str | None = None,
        ports: Any = None,
        freeze_source: bool = False,
    ) -> list[Any]:
        self._alive()
        assert names, "smolbench names every branch"
        kids = []
        for name in names:
            root = self.host.new_root()
            pid = self.host.agent_fork(self, root)
            kid = FakeVM(self.host, name, root, self.image)
            kid.source = self
            kid.launch, kid.labels = self.launch, dict(self.labels)
            kid.agent_pid, kid.agent_sock = (
                pid,
                f"{root}/{os.path.relpath(self.agent_sock or '', self.root)}",
            )
            kids.append(kid.machine)
        return kids

    def checkpoint(
        self, output: str | None = None, *, store: str | None = None
    ) -> PortableCheckpointInfo:
        self._alive()
        assert output is not None and store is not None
        if _host_backed(self.image):
            raise wrap_native_error(RuntimeError(HOST_BACKED))
        root = self.host.new_root()
        pid = self.host.agent_fork(self, root)  # frozen "RAM": an idle copy of the agent
        Path(output).write_text(json.dumps({"fake": str(root)}))
        Path(store, "chunk-0").write_bytes(b"x" * 100)
        self.host.checkpoints[output] = (root, pid)
        assert self.launch is not None
        self.host.launches[output] = self.launch
        return PortableCheckpointInfo(
            id=output,
            machine_id=self.name,
            status="available",
            size_bytes=4242,
            arch="x86_64",
            created_at="",
            download_url="",
            path=output,
        )

    def die(self) -> None:
        """The VM goes away on its own (its engine died): later calls say NOT_FOUND."""
        self.deleted = True
        self.kill()

    def kill(self) -> None:
        if self.agent_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.agent_pid, signal.SIGKILL)

    def delete(self, include_usage: bool = False, drain_secs: float | None = None) -> None:
        if self.fail_delete is not None:
            raise self.fail_delete
        self._alive()
        kids = [vm.name for vm in self.host.vms if vm.source is self and not vm.deleted]
        if kids:
            raise wrap_native_error(RuntimeError(
                f"[SMOLVM_ERROR] Agent error (delete machine): machine '{self.name}' has dependent "
                f"fork(s) ({', '.join(kids)}); delete descendants first"
            ))
        self.deleted = True
        self.kill()


def fake_host(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHost]:
    """For a ``host`` fixture: a fake smol engine patched in where smolbench looks Machine
    up; kills what it started.

    Its VMs live in one fresh directory of this test's own (short: Unix socket paths are)."""
    base = Path(tempfile.mkdtemp(prefix="sbsm"))
    fake = FakeHost(base)
    monkeypatch.setattr(smolmod, "Machine", fake.cls)
    monkeypatch.setattr(smol_checkpoints, "Machine", fake.cls)  # its checkpoints' part looks it up there
    monkeypatch.setattr(smolmod, "READY_TIMEOUT", 15.0)
    try:
        yield fake
    finally:
        fake.cleanup()
        shutil.rmtree(base, ignore_errors=True)
        pids = [vm.agent_pid for vm in fake.vms if vm.agent_pid]
        assert all_gone(pids), f"agent processes left running: {pids}"


def run(coro: Any) -> Any:
    """Run one backend coroutine to its end (at most 120 s)."""
    return asyncio.run(asyncio.wait_for(coro, 120))


def backend(**kw: Any) -> smolmod.SmolBackend:
    """A SmolBackend on the fake engine, without the boot probe."""
    return smolmod.SmolBackend(probe=False, session="t", **kw)


def all_gone(pids: list[int], wait: float = 5.0) -> bool:
    """True once none of ``pids`` runs (zombies count as gone), waiting up to ``wait`` s."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if not [p for p in pids if _running(p)]:
            return True
        time.sleep(0.05)
    return False


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
