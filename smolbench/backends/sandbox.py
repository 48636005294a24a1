"""The sandbox backend: the guest agent in a bubblewrap sandbox (no KVM needed).

Namespace isolation, not a VM (see docs/security.md): bwrap runs as an
unprivileged uid even when the kernel is root, with the host's system
directories read-only (or a pinned rootfs image), a minimal /etc, its own /tmp,
/run and workspace, no network unless asked, no capabilities and a seccomp
filter. It shares the host kernel. Every machine (and every live branch, an
``os.fork()`` of the warm agent) has its own user, mount, pid and IPC namespaces,
its own run folder and copy-on-write workspace and /tmp (``guest/contain.py``).
Talking to the agent, branching, limits and deleting are shared with the process
backend (``_agenthost``); the command line is ``_bwrap``.

Without ``bwrap`` on the host this backend refuses to start and says how to
install it; the ``process`` backend is the no-isolation alternative.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import ctypes
import errno
import os
import re
import shutil
import socket
import stat
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .._aio import _to_the_end
from ..errors import BackendUnavailable, SmolbenchError
from ..guest import leaves
from ..guest.uidshares import BRANCH_NAMESPACES
from ..packages import GuestPython, Installed, host_python, rootfs_python
from ..spec import MachineSpec
from . import _limits, _procs, _stage
from ._agenthost import BOOT_TIMEOUT, AgentHostBackend, _Exited
from ._bwrap import GUEST_RUN, as_sandbox_uid, plan, sandbox_ids, weakened
from ._netproxy import ProxyClient
from ._spawn import Spawned
from .base import MachineRef

CHECKPOINT_SUFFIX = ".smolcheckpoint"
BRANCH_TASKS = 6  # tasks of a branch doing small requests: keeper, agent and its 2 threads, and 2 for requests in flight
PARENT_TASKS = 16  # what a branch machine keeps of its pids for itself
FREEZE_TIMEOUT = 60.0  # seconds a keeper gets to freeze a machine's layers (a flatten copies them)


def bwrap_path() -> str | None:
    """The bubblewrap binary, if installed."""
    return shutil.which("bwrap")


def _cloudpickle_dir() -> Path | None:
    try:
        import cloudpickle
    except ImportError:
        return None
    return Path(cloudpickle.__file__).resolve().parent


class SandboxBackend(AgentHostBackend):
    """Machines as bubblewrap sandboxes on this host; branches by ``os.fork()``."""

    name = "sandbox"
    files_in_memory = True  # tmpfs stores sized by the Smolfile's disk (see MachineSpec.files_mib)

    def __init__(self, *, runtime_dir: str | None = None) -> None:
        bwrap = bwrap_path()
        if not bwrap:
            raise BackendUnavailable(
                "the sandbox backend needs bubblewrap, which is not installed: "
                "`apt-get install bubblewrap` (Debian/Ubuntu) or `dnf install bubblewrap` (Fedora), "
                "or use `--backend process` (no isolation)")
        super().__init__(runtime_dir=runtime_dir)
        self._bwrap = bwrap
        self._weak = weakened()
        self._contained = "host-root" not in self._weak
        self._fds: dict[str, builtins.list[int]] = {}  # per machine starting now (they start at once)
        self._fd_paths: dict[str, dict[str, str]] = {}
        self._containment: dict[str, Any] | None = None  # what the first machine said about itself
        self._proxy: ProxyClient | None = None  # the egress proxy, started for the first machine with a network
        self._grants: dict[str, int] = {}  # root machine -> its keeper's grants pipe (guest/mountguard.py)

    def branch_room(self, spec: MachineSpec) -> tuple[int, str]:
        """How many live branches one branch machine can hold, and what bounds it (one line's part):
        each takes one of its namespaces of each kind, and under rlimits its processes count in
        the machine's ``pids`` (a gym sub-env's keeper, agent and threads: about ``BRANCH_TASKS``)."""
        room, why = BRANCH_NAMESPACES, "the namespaces a sandbox machine has for its branches"
        if self.limiter.mechanism.name == "rlimits":
            by_pids = max(0, (spec.pids - PARENT_TASKS) // BRANCH_TASKS)
            if by_pids < room:
                room, why = by_pids, (f"its pids = {spec.pids}, counted by rlimits here at about {BRANCH_TASKS} per "
                                      "branch: raise pids in the Smolfile for more")
        return room, why

    @property
    def isolation(self) -> str:
        line = ("bubblewrap sandbox: namespace isolation (own rootfs, /tmp, pid and network namespaces), "
                "not a VM; shares the host kernel")
        if not self._contained:
            return line + "; WEAKENED FOR A TEST: uid 0 inside is host root"
        c = self._containment
        if c and "cap_eff" in c:
            line += (f"; runs as uid {c['uid']} with {'no' if c['cap_eff'] == 0 else 'SOME'} capabilities, "
                     f"seccomp {c['seccomp']}; files: "
                     + ("copy-on-write (overlayfs)" if c["files"] == "overlay" else c["files"])
                     + (f"; mounts: {c['mounts']}" if c.get("mounts") else ""))
        return "; ".join([line, *self.notes])

    async def create(self, spec: MachineSpec, name: str) -> MachineRef:
        # the egress proxy (once per kernel) starts while the machine boots
        starting = asyncio.ensure_future(self.proxy.start()) if self._net_proxied(spec) else None
        try:
            ref = await super().create(spec, name)
        except BaseException:
            if starting is not None:
                with contextlib.suppress(BaseException):
                    await starting
            raise
        ref.info["contained"] = self._contained
        try:
            if self._contained and self._containment is None:
                self._containment = await self.info(ref)
            if self._net_proxied(spec):
                try:
                    assert starting is not None
                    await starting
                    failed = await self.proxy.attach([(name, ref.info["host_pid"])], spec.policy, name)
                    if failed:
                        raise OSError(failed[name])
                except (OSError, asyncio.TimeoutError) as exc:
                    raise BackendUnavailable(f"the sandbox machine {name!r} can't get its network ({exc}): "
                                             "`%smol up --net off` runs it without one") from None
        except BaseException:  # stopped or failed here: the caller never gets it, so it goes now
            await _to_the_end(self.delete(ref))
            raise
        return ref

    # -- the network: an own namespace always; out only through the egress proxy -----------------

    @property
    def proxy(self) -> ProxyClient:
        if self._proxy is None:
            uid, gid = sandbox_ids() if self._contained and os.geteuid() == 0 else (None, None)
            self._proxy = ProxyClient(uid, gid, open_all="net-open" in self._weak)
        return self._proxy

    def _net_proxied(self, spec: MachineSpec) -> bool:
        return spec.policy.enabled and self._contained and "net-share" not in self._weak

    def network_enforced(self) -> str:
        """How the policy is enforced here (for `%smol status`)."""
        if "net-share" in self._weak or not self._contained:
            return "NOT enforced (weakened for a test: the machine shares the host's network)"
        return "own network namespace; out only through the host-side egress proxy"

    async def network_stats(self) -> dict[str, dict[str, Any]]:
        """Per machine: connections the proxy let out and refused (the last refused target)."""
        if self._proxy is None:
            return {}
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            return await self._proxy.stats()
        return {}

    async def branch(self, machine: MachineRef, names: builtins.list[str],
                     seeds: builtins.list[int | None], *, leaf: bool = False) -> builtins.list[MachineRef]:
        if machine.info.get("leaf"):
            raise SmolbenchError(f"machine {machine.name!r} can't be forked: it was made to be deleted after its "
                                 "cell (a leaf branch, with no keeper); fork its parent instead")
        # One branch alone is made the usual way: its maker's round trip (a fork of the agent
        # before the branch's clone, on the way of every request to that machine) costs more
        # than the keeper it saves. Measured side by side: a stream of one-branch requests (a
        # long `%%smol episodes`) 79 episodes/s as a leaf, 102 the usual way; forks of 2 and 4
        # the same either way; a fork of 16 16% faster and 24% less CPU as leaves, 64 22% and 28%.
        leaf = leaf and len(names) >= LEAVES_FROM and self._makes_leaves()
        await self._order_freeze(machine)
        # A leaf's store is granted to its own pid namespace, once it exists (_limit_branches);
        # "leaf-parent-grants" (tests only): also to the parent's, as for a keeper's branches.
        # After the freeze: a branch's keeper answers it only once it made the namespace its
        # branches set up in (a branch just made may still be starting: the grant went to its
        # parent's namespace, and its own branch's store was refused).
        if not leaf or "leaf-parent-grants" in self._weak:
            self._grant(machine, len(names))
        refs = await super().branch(machine, names, seeds, leaf=leaf)
        if self._net_proxied(machine.spec):
            try:
                await self._branches_online(machine, refs)
            except BaseException:  # released and running, but the caller never gets them: they go now
                await _to_the_end(asyncio.gather(*(self.delete(ref) for ref in refs), return_exceptions=True))
                raise
        return refs

    async def _branches_online(self, machine: MachineRef, refs: builtins.list[MachineRef]) -> None:
        """The proxy's listeners in each new branch's own network namespace (its keeper, or the
        leaf itself, makes it once released); a branch that can't have them has no network."""
        async def ready(ref: MachineRef) -> tuple[str, int] | None:
            pid = ref.info.get("host_pid")
            try:
                if pid is None:
                    raise OSError("its host process is not known")
                await _own_netns(pid, machine.info["host_pid"])
            except OSError as exc:
                self._no_net(ref, str(exc))
                return None
            return ref.name, pid

        waiting = await asyncio.gather(*(ready(ref) for ref in refs))
        try:
            failed = await self.proxy.attach([m for m in waiting if m is not None], machine.spec.policy,
                                             machine.info.get("root", machine.name))  # the root's caps, shared
        except (OSError, asyncio.TimeoutError) as exc:
            failed = {ref.name: str(exc) for ref in refs}
        for ref in refs:
            if ref.name in failed:
                self._no_net(ref, failed[ref.name])

    async def _order_freeze(self, machine: MachineRef) -> None:
        """Have ``machine``'s keeper freeze its layers for the fork that follows. Only the host
        orders it, on the keeper's own socket (cells can't: guest/keeper.py ``_host_order``);
        the peer must be that keeper (its host pid), not something a cell bound there."""
        if not self._contained or "keeper-agent" in self._weak:
            return
        keeper = _keeper_pid(machine)
        deadline = time.monotonic() + BOOT_TIMEOUT  # a branch just released may still be starting its keeper
        while True:
            try:
                fd = _socket_fd(f"{machine.info['host_dir']}/k")
                try:
                    reader, writer = await asyncio.open_unix_connection(f"/proc/self/fd/{fd}")
                finally:
                    os.close(fd)
                break
            except OSError as exc:
                dead = self.gone([machine])  # not starting: gone (its keeper never answers again)
                if dead:
                    raise SmolbenchError(f"machine {machine.name!r} can't fork: {dead[machine.name]}") from None
                if exc.errno not in (errno.ENOENT, errno.ECONNREFUSED) or time.monotonic() > deadline:
                    raise SmolbenchError(f"machine {machine.name!r} can't fork: its keeper is not answering "
                                         f"({exc.strerror}); `%smol delete` it and fork another") from None
                await asyncio.sleep(0.01)
        try:
            sock = writer.get_extra_info("socket")
            peer = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
            if keeper is None or peer != keeper:
                raise SmolbenchError(f"machine {machine.name!r} can't fork: something other than its keeper answers "
                                     "on the keeper's socket (a cell replaced it); `%smol delete` it and fork another")
            writer.write(b"freeze\n")
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), FREEZE_TIMEOUT)
        except (OSError, asyncio.TimeoutError):
            line = b""
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        if line != b"ok\n":
            raise SmolbenchError(f"machine {machine.name!r} can't fork: its keeper did not freeze its files; "
                                 "`%smol delete` it and fork another")

    def _grant(self, machine: MachineRef, stores: int) -> None:
        """Let the tree's keeper allow ``stores`` more branch stores, to the pid namespace of
        ``machine``'s agent, where its branches set themselves up (before the fork is asked)."""
        fd, pid = self._grants.get(machine.info.get("root", machine.name)), machine.info.get("host_pid")
        if fd is None or pid is None:
            return
        # a root's host pid is its agent; a branch's, its keeper, which made the branch's namespace
        _write_grant(fd, stores, pid, "pid_for_children")

    def _makes_leaves(self) -> bool:
        return self._contained and "keeper-agent" not in self._weak and leaves.available()

    def _limit_branches(self, parent: MachineRef, refs: builtins.list[MachineRef],
                        limits: dict[str, _limits.MachineLimits], maker: int | None = None) -> None:
        super()._limit_branches(parent, refs, limits, maker)
        if maker is not None:
            self._grant_leaves(parent, refs)

    def _grant_leaves(self, parent: MachineRef, refs: builtins.list[MachineRef]) -> None:
        """One store for each leaf branch, to its own pid namespace (it exists from the clone
        on, and the branch waits, held, until this is written): no other process can spend it."""
        fd = self._grants.get(parent.info.get("root", parent.name))
        if fd is None:
            return
        for ref in refs:
            if ref.info.get("host_pid") is not None:  # one that is gone gets none
                _write_grant(fd, 1, ref.info["host_pid"], "pid")

    def _no_net(self, ref: MachineRef, why: str) -> None:
        ref.info["net_error"] = why
        self.notes.append(f"branch {ref.name} has no network: {why}")

    async def delete(self, machine: MachineRef) -> None:
        await super().delete(machine)
        if machine.parent is None and machine.name not in self._machines:
            self._spawned(machine.name)  # a start that failed before its process ran
            self._fd_paths.pop(machine.name, None)
            fd = self._grants.pop(machine.name, None)
            if fd is not None:
                os.close(fd)
        if self._proxy is not None:
            await self._proxy.detach([machine.name])

    def _below(self, machine: MachineRef, name: str) -> tuple[int, str]:
        if not (self._contained and machine.info.get("contained")):  # a host folder of its own
            return super()._below(machine, name)
        root = self._machines.get(machine.info["root"])
        fd, name = _below_run(f"{machine.info['host_dir']}/{name}")  # the one walk that follows no link of the machine's
        if root is None or _procs.start_time(root.info.get("host_pid") or 0) != root.info.get("host_started"):
            os.close(fd)  # after the open: what it opened was that root's, its pid not another's by now
            raise OSError(errno.ESRCH, "the machine's root is gone")
        return fd, name

    async def close(self) -> None:
        await super().close()
        for fd in self._grants.values():
            os.close(fd)
        self._grants.clear()
        if self._proxy is not None:
            await self._proxy.close()

    # -- how a machine starts -------------------------------------------------------

    # The machine's run folder is a tmpfs inside it; the host reaches it (socket, ready file,
    # checkpoint stages) through /proc/PID/root of a process in the machine's mount namespace.

    async def _wait_ready(self, ref: MachineRef, proc: Spawned, ready: Path) -> None:
        # The agent's ready line says when; then one walk of this machine's own few processes.
        deadline = time.monotonic() + BOOT_TIMEOUT
        try:
            await self._until_booted(ref, proc, deadline)
            while (pid := _agent_below(proc.pid)) is None:
                self._check_starting(ref, proc, deadline)
                await asyncio.sleep(0.01)
        except _Exited:
            await self._log_written(ref)
            raise BackendUnavailable(f"the {self.name} machine {ref.name!r} exited during start: {self._log_tail(ref)}") from None
        self._reach(ref, pid, f"{GUEST_RUN}/s")

    @staticmethod
    def _reach(ref: MachineRef, pid: int, guest_socket: str) -> None:
        """Point ``ref`` at its agent's run folder through host process ``pid`` (the root's agent:
        every branch's folder is inside the root's, so the path exists before the branch runs)."""
        ref.info.update(host_pid=pid, host_started=_procs.start_time(pid),
                        host_dir=f"/proc/{pid}/root{os.path.dirname(guest_socket)}", socket=f"/proc/{pid}/root{guest_socket}")

    def _guest_python(self, spec: MachineSpec) -> GuestPython:
        from ..images import held_rootfs

        with held_rootfs(spec.image) as rootfs:
            return host_python() if rootfs is None else rootfs_python(rootfs)

    def _packages_path(self, installed: Installed) -> Path:
        return Path(installed.mount)  # bwrap binds the folder that was checked, not what its path names now

    def _command(self, spec: MachineSpec, name: str, run_dir: Path, workspace: Path,
                 agent_args: builtins.list[str], packages: Path | None = None) -> tuple[builtins.list[str], str, str]:
        from ..images import held_rootfs

        with held_rootfs(spec.image) as rootfs:  # a built image: the checked folder, bound by descriptor
            p = plan(spec, name, self._bwrap, rootfs, agent_args, sized=self.limiter.enforce, packages=packages)
        self._fds[name], self._fd_paths[name] = p.fds, p.paths
        if p.grants is not None:
            old = self._grants.pop(name, None)
            if old is not None:
                os.close(old)
            self._grants[name] = p.grants
        if not self._contained or os.geteuid() != 0:
            return p.argv, GUEST_RUN, spec.workdir
        # A root kernel's folders under a 0700 home (pyenv's Python, a venv in a private
        # checkout, the image cache) are staged where the sandbox uid finds them.
        covers, staged = _stage.plan(p.sources, *sandbox_ids()) if "no-stage" not in self._weak else ([], [])
        stage = _stage.command(covers, staged) if staged else []
        return [*stage, *as_sandbox_uid(p.argv)], GUEST_RUN, spec.workdir

    def _spawn_options(self, name: str) -> dict[str, Any]:
        return {"pass_fds": self._fds.get(name, [])}

    def _spawned(self, name: str) -> None:
        for fd in self._fds.pop(name, []):
            os.close(fd)

    def _host_pids(self, ancestor: int, guest_pids: builtins.list[int],
                   tree: dict[int, builtins.list[tuple[int, str]]] | None = None) -> dict[int, int]:
        # Pid namespaces nest here, so a number is ambiguous below an ancestor: a new branch's
        # keeper is a direct child of its parent's agent, with that pid in the parent's namespace.
        if not self._contained:
            return super()._host_pids(ancestor, guest_pids, tree)
        # The ancestor is a root's agent, or a branch's keeper (its host pid), whose agent is its
        # child: the new keepers are then one level further down. Read from these processes'
        # own children lists: no scan of the host's processes.
        def below(pid: int) -> builtins.list[int]:
            return [p for p, _ in tree.get(pid, [])] if tree is not None else _procs.kids(pid)

        wanted, found = set(guest_pids), dict[int, int]()
        for parent in [ancestor, *below(ancestor)]:
            for pid in below(parent):
                last = _procs.ns_pids(pid)[-1:]
                if last and last[0] in wanted:
                    found.setdefault(last[0], pid)
            if len(found) == len(wanted):
                break
        return found

    @contextlib.contextmanager
    def _socket(self, ref: MachineRef) -> Iterator[str]:
        # /proc/PID/root is only that machine while PID is still the root agent we found.
        root = self._machines.get(ref.info["root"])
        pid = root.info.get("host_pid") if root is not None else None
        if root is not None and pid is not None and _procs.start_time(pid) != root.info.get("host_started"):
            raise SmolbenchError(f"machine {ref.name!r} is not answering (it died): `%smol down` and `%smol up`",
                                 api=f"machine {ref.name!r} is not answering (it died): `Session.down()` and "
                                 "`Session.up()`")
        if not self._contained:
            yield ref.info["socket"]
            return
        # The folders below the machine's run folder are the machine's to change: find the
        # socket without following a link it planted (it must not send us to a host socket),
        # for cells and for kept channels alike (a channel's connection followed one).
        fd = _socket_fd(ref.info["socket"])
        try:
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)

    def _as_owner(self) -> Callable[[], contextlib.AbstractContextManager[None]]:
        # The machine's folder is a tmpfs of its user namespace, where host root has no uid: what
        # the host makes there (a restore's files streamed straight in, never unpacked anywhere
        # else, issue 25: not in the host's /tmp; a save's stage and fifo) is made as the
        # machine's uid (fsuid).
        if self._contained and os.geteuid() == 0:
            return lambda: _fs_ids(*sandbox_ids())
        return super()._as_owner()

    def _log_tail(self, ref: MachineRef) -> str:  # type: ignore[override]
        last = super()._log_tail(ref)
        m = re.search(r"source path (/proc/self/fd/\d+): Permission denied", last)
        paths = self._fd_paths.get(ref.name, {})
        if m and m.group(1) in paths:
            return (f"the sandbox uid {sandbox_ids()[0]} can't reach {paths[m.group(1)]} (a folder above "
                    f"it is not traversable): `chmod o+x` its parent folders, or put it elsewhere")
        return last


LEAVES_FROM = 2  # branches in one request, at least, to make them leaves (see SandboxBackend.branch)


def _write_grant(fd: int, stores: int, pid: int, link: str) -> None:
    """Grant ``stores`` stores to the pid namespace ``/proc/PID/ns/LINK`` names, on the root
    keeper's pipe ``fd``; a process that is gone grants nothing."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        ns = int(os.readlink(f"/proc/{pid}/ns/{link}").split("[", 1)[1].rstrip("]"))
        os.write(fd, b"%d %d\n" % (stores, ns))


async def _own_netns(pid: int, parent: int, timeout: float = 10.0) -> None:
    """Wait until branch process ``pid`` left its parent's network namespace (its keeper
    unshares it right after the fork, and the fork's reply doesn't wait for that)."""
    theirs = os.readlink(f"/proc/{parent}/ns/net")
    deadline = time.monotonic() + timeout
    while os.readlink(f"/proc/{pid}/ns/net") == theirs:
        if time.monotonic() > deadline:
            raise OSError("it never got a network namespace of its own")
        await asyncio.sleep(0.002)


def _keeper_pid(machine: MachineRef) -> int | None:
    """The host pid of the keeper of ``machine``: a branch's host pid is its keeper; a root's
    is its agent, whose parent is the keeper."""
    pid = machine.info.get("host_pid")
    if pid is None or machine.parent is not None:
        return pid
    fields = _procs.stat(pid)
    return int(fields[1]) if fields else None


def _agent_below(pid: int) -> int | None:
    """The host pid of the machine's agent once it is serving: the deepest process below
    ``pid`` whose root holds the ready file (its keeper shares the mount namespace, so the
    agent, pid 1 of the innermost pid namespace, is the deeper one)."""
    found = []
    for kid, _ in _procs.descendants(pid):
        if os.path.exists(f"/proc/{kid}/root{GUEST_RUN}/ready"):
            found.append((len(_procs.ns_pids(kid)), kid))
    return max(found)[1] if found else None


@contextlib.contextmanager
def _fs_ids(uid: int, gid: int) -> Iterator[None]:
    """File access as ``uid``/``gid`` for this thread only (setfsuid), then back."""
    libc = ctypes.CDLL(None, use_errno=True)
    old_gid, old_uid = libc.setfsgid(gid), libc.setfsuid(uid)
    try:
        yield
    finally:
        libc.setfsuid(old_uid)
        libc.setfsgid(old_gid)


def _below_run(path: str) -> tuple[int, str]:
    """The one walk to a path below a machine's run folder (``/proc/PID/root/run/smolbench/A/…/NAME``),
    whose folders are the machine's to change: an O_PATH descriptor of the folder holding NAME,
    each component after ``/proc/PID/root`` opened without following links (the run folder's
    too: code that execs its agent can mount its own /run, whose absolute links would resolve
    from the host's root), and NAME (never ``..``)."""
    top, sep, rest = path.partition(GUEST_RUN + "/")
    parts = GUEST_RUN.strip("/").split("/") + rest.split("/")
    if not sep or not top.endswith("/root") or any(part in ("", ".", "..") for part in parts):
        raise OSError(errno.EINVAL, "not a path below a machine's run folder")
    fd = os.open(top, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)  # the machine's root (a /proc magic link)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd, parts[-1]


def _socket_fd(path: str) -> int:
    """An O_PATH descriptor of the agent socket at ``/proc/PID/root/run/smolbench/...``, found by
    :func:`_below_run` and checked to be a socket."""
    fd, name = _below_run(path)
    try:
        sock = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)
    if not stat.S_ISSOCK(os.fstat(sock).st_mode):
        os.close(sock)
        raise OSError(errno.ENOTSOCK, "not a socket")
    return sock
