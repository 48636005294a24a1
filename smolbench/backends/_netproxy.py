"""The sandbox's egress proxy: the only way out of a sandbox machine's network namespace.

Every sandbox machine (and every branch) has a network namespace of its own with only a
loopback. When its policy lets it out, this process (one per kernel, started by the
sandbox backend, running as the sandbox uid) puts listening sockets *inside* that
namespace: it forks a child that joins the machine's user and network namespaces, binds
them and hands them back over a socketpair. Cells then reach the outside only through
those sockets, and this process decides on the host side, where no cell can change
anything:

* ``127.0.0.1:3128`` is an HTTP proxy (``HTTP_PROXY``/``HTTPS_PROXY`` point there, so pip
  and requests work unchanged): ``CONNECT host:port`` and ``http://`` URLs are admitted
  by host name and resolved address (``netpolicy.NetPolicy.admits``);
* plain TCP to a listed network (``127.0.0.16/28``, ``10.0.0.0/8:5432``; for ``net =
  true``, anything off the machine's loopback) is redirected inside to ``127.0.0.1:3129``
  (``_netredirect``), whose other side here reads the original destination and decides
  the same way;
* a listed ``127.0.0.1/32:port`` gets a listener at that port inside, relayed to the
  same port outside (127.0.0.1 stays the machine's own otherwise).

A refusal is a ``403`` naming the host and the policy, counted per machine. Nothing
else of a machine's network exists: no route, no DNS, no host loopback. The kernel
talks to this process only over its stdin/stdout (JSON lines), which no machine can
reach.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ipaddress
import json
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from .. import netpolicy
from .._aio import _to_the_end
from ..gate import netreq
from ..netpolicy import (
    IPAddress,
    NetPolicy,
    Own,
    literal,
    own_addresses,
    stand_in_internet,
    stand_in_resolve,
    unmapped,
)
from . import _netbudget, _netcgroup, _netfair, _netredirect
from ._netns import _bind_in, _collect, _refused_in

PROXY_PORT = 3128
PROXY_URL = f"http://127.0.0.1:{PROXY_PORT}"
LINGER = 5.0  # seconds a machine's side may keep sending after the far end closed
IDLE_TIMEOUT = 600.0  # seconds a relayed connection may carry no byte either way before it is closed
CONNECT_TIMEOUT = 30.0
SAID_PER_NODE = 20  # distinct failure lines shown for one machine
REPLY_WAIT = 60.0  # seconds the kernel waits for the proxy's reply to one request
WEAKEN_VAR = "SMOLBENCH_TEST_WEAKEN"  # tests only: netpolicy's knobs ("net-hostonly")


def proxy_env() -> dict[str, str]:
    """What a machine with the network on gets, so pip, requests and curl use the proxy."""
    env = {}
    for key in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        env[key] = PROXY_URL
    return env


# Runs as root until it drops to the sandbox uid, so nothing of the kernel's may come before
# the standard library: isolated (-I: no working folder or script folder on sys.path, no
# PYTHON* variables, no user site), started in "/", the package root given explicitly.
_BOOT = "import sys; sys.path.insert(0, sys.argv[1]); from smolbench.backends._netproxy import main; main(sys.argv[2:])"


def command() -> list[str]:
    """The proxy's argv, less its flags: this package's root first on the path, nothing else added."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return [sys.executable, "-I", "-c", _BOOT, root]


class ProxyClient:
    """The kernel's side: starts the proxy process and asks it to attach or detach machines."""

    def __init__(self, uid: int | None, gid: int | None, open_all: bool = False, capped: bool = True) -> None:
        self.uid, self.gid, self.open_all = uid, gid, open_all
        # its own CPU-capped cgroup, where cgroups can be made: no machine's counts its work
        self.group = _netcgroup.ProxyGroup() if capped else None
        self.proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._said: asyncio.Future[None] | None = None
        self._cluster: set[str] = set()  # the Ray nodes' addresses the proxy counts as this host
        self._owed = 0  # replies to requests that timed out, still to come: read before the next one's

    async def _start(self) -> asyncio.subprocess.Process:
        argv = command()
        if self.uid is not None:
            argv += ["--uid", str(self.uid), "--gid", str(self.gid)]
        if self.open_all:
            argv.append("--open")
        cluster = _cluster_addresses()
        self._cluster = set(cluster)
        if cluster:
            argv += ["--host-only", ",".join(cluster)]
        if self.group is not None:
            await asyncio.to_thread(self.group.make)  # cgroupfs is slow to write to
            argv = self.group.wrap(argv)
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE, start_new_session=True, cwd="/",
                                                    limit=1 << 20)
        assert proc.stdout is not None and proc.stderr is not None
        self._said = asyncio.ensure_future(_say(proc.stderr))
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), REPLY_WAIT)
            if not line.startswith(b'{"ready"'):
                raise OSError("the egress proxy did not start")
        except BaseException:  # stopped too (a Ctrl-C): no one else knows of this process
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await _to_the_end(proc.wait())
            await _to_the_end(self._ungroup())
            raise
        return proc

    async def _ungroup(self) -> None:
        if self.group is not None:
            await asyncio.to_thread(self.group.close)

    async def start(self) -> None:
        """Start the proxy process unless it runs (the sandbox does this while a machine boots)."""
        async with self._lock:
            if self.proc is None or self.proc.returncode is not None:
                self.proc, self._owed = await self._start(), 0

    async def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        await self.start()
        async with self._lock:
            proc = self.proc
            if proc is None or proc.stdin is None or proc.stdout is None or proc.returncode is not None:
                raise OSError("the egress proxy exited")
            stdin, stdout = proc.stdin, proc.stdout

            async def exchange() -> bytes:
                while self._owed:  # a request that timed out: its late reply is not this one's
                    await asyncio.wait_for(stdout.readline(), REPLY_WAIT)
                    self._owed -= 1
                stdin.write(json.dumps(msg).encode() + b"\n")
                await stdin.drain()
                try:
                    return await asyncio.wait_for(stdout.readline(), REPLY_WAIT)
                except asyncio.TimeoutError:
                    self._owed += 1
                    raise

            # stopped once sent (a Ctrl-C), its reply is still read: left in the pipe, the next request took it
            line = await _to_the_end(exchange())
        reply = json.loads((line or b'{"error": "the egress proxy exited"}').decode("utf-8"))
        if "error" in reply:
            raise OSError(str(reply["error"]))
        return dict(reply)

    async def attach(self, machines: list[tuple[str, int]], policy: NetPolicy, tree: str | None = None) -> dict[str, str]:
        """Give each (name, host pid) its listeners, all counted in ``tree`` (a root's name: its
        branches share its caps); the ones that failed, with why."""
        await self.start()
        joined = sorted(set(_cluster_addresses()) - self._cluster)
        if joined:  # a Ray node that joined after the proxy started: its unauthenticated ports are this host's
            await self.call({"op": "host_only", "add": joined})
            self._cluster |= set(joined)
        reply = await self.call({"op": "attach", "machines": [{"node": n, "pid": p} for n, p in machines],
                                 "policy": policy.as_dict(), "tree": tree})
        return dict(reply.get("errors") or {})

    async def detach(self, nodes: list[str]) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                await self.call({"op": "detach", "nodes": nodes})

    async def stats(self) -> dict[str, dict[str, Any]]:
        if self.proc is None or self.proc.returncode is not None:
            return {}
        return dict((await self.call({"op": "stats"}))["nodes"])

    async def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.returncode is None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
        await self._ungroup()  # with whatever it left there (a helper still running)


def _cluster_addresses() -> list[str]:
    """The addresses of the Ray cluster's nodes, when this process is in one (a cluster's node
    agent): Ray's ports (GCS, raylets, dashboard, workers) take code without authentication,
    so for every machine here those hosts are this host: never reached through a range."""
    ray = sys.modules.get("ray")
    try:
        if ray is None or not ray.is_initialized():
            return []
        return sorted({str(n["NodeManagerAddress"]) for n in ray.nodes() if n.get("Alive")})
    except Exception:  # noqa: BLE001 - no cluster to ask: nothing more is host-only
        return []


# Where the proxy's one-line failures go in the kernel: the magics put them in the running
# cell's stderr (this loop's thread has no cell of its own); without a hook, sys.stderr.
NOTICES: list[Callable[[str], None]] = []


async def _say(stream: asyncio.StreamReader) -> None:
    """The proxy's one-line failures, to NOTICES. Lines are short and few: the proxy says each once."""
    with contextlib.suppress(Exception):
        while line := await stream.readline():
            text = line.decode("utf-8", "replace").strip()[:300]
            if not text:
                continue
            for hook in NOTICES or [lambda t: print(t, file=sys.stderr, flush=True)]:
                hook(text)


# -- the proxy process ------------------------------------------------------------------------


@dataclass(eq=False)  # a key of the fair share's counts: by identity
class Node:
    name: str
    policy: NetPolicy
    tree: _netbudget.Tree
    pid: int = 0  # the machine's host pid, whose namespaces hold its refuse chain (0: none)
    listeners: list[tuple[asyncio.Task[None], socket.socket]] = field(default_factory=list)  # accept loops
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    accepted: int = 0  # connections taken from its listeners (each within its own and its tree's bucket)
    bucket: _netbudget.Bucket = field(default_factory=lambda: _netbudget.Bucket(share=2))
    allowed: int = 0
    refused: int = 0
    last_refused: str = ""
    failed: int = 0  # connections the proxy itself failed (its own error, or over a cap)
    last_failed: str = ""
    said: set[str] = field(default_factory=set)  # the failure lines shown for it (SAID_PER_NODE at most)

    def stats(self) -> dict[str, Any]:
        mine = [c for c in self.tree.conns if c.node is self]
        return {"accepted": self.accepted, "allowed": self.allowed, "refused": self.refused, "last_refused": self.last_refused,
                "failed": self.failed, "last_failed": self.last_failed, "tree": self.tree.name,
                "open": len(mine), "buffered": sum(c.buffered() for c in mine),
                "heads": sum(1 for c in mine if c.in_head)}


class Proxy:
    """The proxy's state: machines (nodes), their listeners and counters."""

    def __init__(self, open_all: bool = False, budget: _netbudget.Budget | None = None,
                 host_only: frozenset[IPAddress] = frozenset()) -> None:
        self.nodes: dict[str, Node] = {}
        self.host_only = host_only  # more hosts that count as this one (the Ray cluster's nodes)
        self.open_all = open_all  # test-only weakening: admit every destination
        self.internet = stand_in_internet()
        self.resolve_map = stand_in_resolve()
        self.budget = budget or _netbudget.Budget()
        self._own: tuple[float, Own] = (0.0, frozenset())

    def own(self) -> Own:
        if time.monotonic() - self._own[0] > 2.0:
            self._own = (time.monotonic(), own_addresses() | self.host_only)
        return self._own[1]

    async def attach(self, machines: list[tuple[str, int]], policy: NetPolicy, tree: str | None = None) -> dict[str, str]:
        """Listeners for each (name, host pid), all in ``tree`` (default: each its own): the
        helpers bind in parallel. Errors by name."""
        addrs = self.addresses(policy)
        nets = _netredirect.networks(policy)
        # the at-once refusals only narrow; a proxy weakened to admit everything has none
        refuse = [] if self.open_all else _netredirect.refusals(policy, self.own(), self.internet)
        redirect = (nets, self.internet, refuse) if nets != [] else None
        started = []
        for name, pid in machines:
            await self.detach(name)
            started.append((name, _bind_in(pid, addrs, redirect)))
        errors = {}
        for name, helper in started:
            try:
                socks = await asyncio.to_thread(_collect, *helper)
            except OSError as exc:
                errors[name] = str(exc)
                continue
            await self.serve(name, policy, socks, addrs, tree or name)
            if refuse and redirect is not None:
                self.nodes[name].pid = dict(machines)[name]
        return errors

    @staticmethod
    def addresses(policy: NetPolicy) -> list[tuple[str, int]]:
        """Where a machine's listeners go: the proxy port, the redirect's relay (when it has one),
        then each listed ``127.0.0.1:port`` (the redirect leaves 127.0.0.1 to the machine)."""
        addrs = [("127.0.0.1", PROXY_PORT)]
        if _netredirect.networks(policy) != []:
            addrs.append(("127.0.0.1", _netredirect.RELAY_PORT))
        fwd: dict[tuple[str, int], IPAddress] = {}
        for addr, port in [(r.single(), r.port) for r in policy.cidrs] + [(literal(h.name), h.port) for h in policy.hosts]:
            if addr is not None and port is not None and str(addr) == "127.0.0.1" and (str(addr), port) not in addrs:
                fwd[(str(addr), port)] = addr
        return addrs + list(fwd)

    async def serve(self, name: str, policy: NetPolicy, socks: list[socket.socket], addrs: list[tuple[str, int]],
                    tree: str | None = None) -> None:
        node = Node(name, policy, self.budget.tree(tree or name))
        self.nodes[name] = node
        node.tree.members.add(node)
        for sock in socks:  # accepted sockets inherit the listener's small, fixed buffers
            _netbudget.bounded(sock)
        self._listen(node, socks[0], lambda r, w: self._spawn(node, self.proxied, r, w))
        for sock, (host, port) in zip(socks[1:], addrs[1:]):
            if (host, port) == addrs[1] and port == _netredirect.RELAY_PORT:
                self._listen(node, sock, lambda r, w: self._spawn(node, self.redirected, r, w))
                continue
            target = ipaddress.ip_address(host)

            def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, t: IPAddress = target, p: int = port) -> None:
                self._spawn(node, lambda c, n, r2, w2: self.forwarded(c, n, t, p, r2, w2), r, w)

            self._listen(node, sock, handler)

    def _listen(self, node: Node, sock: socket.socket,
                take: Callable[[asyncio.StreamReader, asyncio.StreamWriter], None]) -> None:
        node.listeners.append((asyncio.ensure_future(self._accept(node, sock, take)), sock))

    async def _accept(self, node: Node, sock: socket.socket,
                      take: Callable[[asyncio.StreamReader, asyncio.StreamWriter], None]) -> None:
        """One listener's accept loop. A connection is accepted only when the machine's tree has
        a token (``_netbudget.Bucket``): past the tree's rate it waits in the listen backlog, in
        the machine's namespace, unaccepted and unread (a flood of refused requests was each
        accepted, parsed and answered on this one loop, which no machine's cgroup counts). The
        machine has a bucket of its own, half its tree's: one machine's flood never takes all
        of its siblings' allowance."""
        loop = asyncio.get_running_loop()
        sock.setblocking(False)
        buckets = (node.bucket, node.tree.bucket)
        while True:
            while (wait := max(b.wait() for b in buckets)) > 0:
                await asyncio.sleep(wait)
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as exc:  # out of descriptors, or a connection gone before its accept
                self.fail(node, "a new connection", f"accept: {exc.strerror or exc}")
                await asyncio.sleep(0.1)
                continue
            for b in buckets:
                b.take()
            node.accepted += 1
            try:
                reader, writer = await asyncio.open_connection(sock=conn, limit=_netbudget.BUFFER)
            except OSError:
                conn.close()
                continue
            take(reader, writer)

    def _spawn(self, node: Node, handler: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        full = self.budget.full(node.tree, node)
        if full is not None:  # over the machine's, the tree's or the kernel's cap: dropped at once, counted
            self.fail(node, "a new connection", full)
            writer.transport.abort()
            return
        writer.transport.set_write_buffer_limits(high=_netbudget.BUFFER)
        conn = _netbudget.Conn([reader], [writer], node=node)
        node.tree.conns.add(conn)
        task = asyncio.ensure_future(handler(conn, node, reader, writer))
        node.tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            node.tasks.discard(t)
            node.tree.conns.discard(conn)
            if not t.cancelled() and t.exception() is not None:  # a bug of ours: one line, never a traceback
                self.fail(node, conn.target or "a connection", f"{type(t.exception()).__name__}: {t.exception()}")

        task.add_done_callback(done)

    def fail(self, node: Node, target: str, why: str) -> str:
        """A connection the proxy itself failed: counted, and one line on its stderr (the
        kernel's: it shows in the running cell), naming the machine, once per distinct line
        and at most :data:`SAID_PER_NODE` a machine (a cap for all let one machine's distinct
        targets silence every other's)."""
        node.failed += 1
        line = f"smolbench egress proxy: {target} failed: {why}"[:300]
        node.last_failed = line.split(": ", 1)[1]
        if line not in node.said and len(node.said) < SAID_PER_NODE:
            node.said.add(line)
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(f"{line} (machine {node.name})\n")
                sys.stderr.flush()
        return line

    async def detach(self, name: str) -> None:
        node = self.nodes.pop(name, None)
        if node is None:
            return
        node.tree.members.discard(node)
        node.tree.wake_heads()  # what it was guaranteed is the others' now
        self.budget.turns.forget(node=node)
        for task, _ in node.listeners:
            task.cancel()
        await asyncio.gather(*(t for t, _ in node.listeners), return_exceptions=True)
        for _, sock in node.listeners:
            sock.close()
        for task in list(node.tasks):
            task.cancel()
        if node.tasks:
            await asyncio.wait(list(node.tasks), timeout=LINGER)
        if not any(n.tree is node.tree for n in self.nodes.values()):
            self.budget.end(node.tree.name)

    # -- one connection ---------------------------------------------------------------------

    async def decide(self, node: Node, host: str, port: int) -> tuple[IPAddress | None, str]:
        """The address ``host:port`` may be reached at, or None and, when there is more to say
        than the policy's refusal, why (a listed name resolved into a LAN, a failed lookup)."""
        lit = literal(host)
        if lit is not None:
            candidates = [lit]
        elif host in self.resolve_map:
            candidates = [unmapped(ipaddress.ip_address(self.resolve_map[host]))]
        elif node.policy.may_resolve(host, port) or self.open_all:
            try:
                infos = await self.budget.resolve(node.tree, host, port)
            except socket.gaierror as exc:
                return None, f"was not reached: the name {host} could not be looked up ({exc.strerror or exc})"
            candidates = [unmapped(ipaddress.ip_address(str(i[4][0]).split("%")[0])) for i in infos]
        else:
            candidates = []
        own = self.own()
        for addr in candidates:
            if self.open_all or node.policy.admits(host, port, addr, own, self.internet):
                return addr, ""
        said = next((w for a in candidates if (w := node.policy.private_refusal(host, port, a, own))), "")
        return None, f"is not allowed: {said}" if said else ""

    def refuse(self, node: Node, target: str, why: str = "") -> bytes:
        node.refused += 1
        node.last_refused = target
        # ``why``: a listed name refused for where it resolved, or not found (said, with the fix)
        why = f"smolbench: {target} {why}" if why else (
            f"smolbench: {target} is not allowed by this machine's network policy ({node.policy.describe()})")
        return (f"HTTP/1.1 403 {why}\r\nContent-Type: text/plain\r\nContent-Length: {len(why) + 1}\r\n"
                f"Connection: close\r\n\r\n{why}\n").encode("ascii", "replace")

    async def proxied(self, conn: _netbudget.Conn, node: Node, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        tree = node.tree
        try:
            # unfinished heads: bounded in count (the others wait, unread), size and time, and
            # shared among the tree's machines: one's silent connections never hold another's
            why = await tree.take_head(node)
            if why is not None:
                self.fail(node, "a new request", f"{_HEADS_FULL[why]} for {_netbudget.HEAD_TIMEOUT:.0f} s")
                writer.transport.abort()
                return
            conn.in_head = True
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _netbudget.HEAD_TIMEOUT)
                req = netreq.parse(head)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ConnectionError):
                return
            except netreq.BadRequest as exc:
                line = f"smolbench proxy: bad request: {exc}"
                writer.write(f"HTTP/1.1 400 {line}\r\nConnection: close\r\nContent-Length: 0\r\n\r\n".encode("ascii", "replace"))
                return
            finally:
                tree.give_head(node)
                conn.in_head = False
            conn.target = req.target
            try:
                addr, why = await self.decide(node, req.host, req.port)
            except OSError as exc:  # our own lookup's failure (slow, or our threads): not the policy's
                writer.write(_bad_gateway(self.fail(node, req.target, str(exc))))
                return
            if addr is None:
                writer.write(self.refuse(node, req.target, why))
                return
            up = await self._connect(conn, addr, req.port, writer)
            if up is None:
                return
            node.allowed += 1
            if req.tunnel:
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                up[1].write(req.forward)
            await _relay(reader, writer, *up, turn=self._turn(node))
        except Exception as exc:  # noqa: BLE001 - the proxy's own failure: one line, the machine sees a 502
            line = self.fail(node, conn.target or "a request", f"{type(exc).__name__}: {exc}")
            with contextlib.suppress(Exception):
                writer.write(_bad_gateway(line))
        finally:
            await _close(writer)

    async def redirected(self, conn: _netbudget.Conn, node: Node, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        """A plain connection the machine's redirect sent here: decided by where it was headed."""
        try:
            addr, port = _netredirect.original_destination(writer.get_extra_info("socket"))
        except (OSError, struct.error):
            await _close(writer)
            return
        await self.forwarded(conn, node, addr, port, reader, writer)

    async def forwarded(self, conn: _netbudget.Conn, node: Node, addr: IPAddress, port: int,
                        reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn.target = f"{addr}:{port}"
        try:
            if not (self.open_all or node.policy.admits(str(addr), port, addr, self.own(), self.internet)):
                node.refused += 1
                node.last_refused = conn.target
                _reset(writer)
                return
            up = await self._connect(conn, addr, port, None)
            if up is not None:
                node.allowed += 1
                await _relay(reader, writer, *up, turn=self._turn(node))
        except Exception as exc:  # noqa: BLE001 - the proxy's own failure: one line
            self.fail(node, conn.target, f"{type(exc).__name__}: {exc}")
        finally:
            await _close(writer)

    def _turn(self, node: Node) -> Turn:
        """``node``'s turns to relay (``_netbudget.Turns``): wait for one, then say what moved."""
        turns, tree = self.budget.turns, node.tree.name
        return lambda: turns.turn(tree, node), lambda n: turns.moved(tree, node, n)

    async def _connect(self, conn: _netbudget.Conn, addr: IPAddress, port: int,
                       writer: asyncio.StreamWriter | None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        sock = _netbudget.bounded(socket.socket(socket.AF_INET6 if addr.version == 6 else socket.AF_INET, socket.SOCK_STREAM))
        try:
            sock.setblocking(False)
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (str(addr), port)), CONNECT_TIMEOUT)
            r, w = await asyncio.open_connection(sock=sock, limit=_netbudget.BUFFER)
        except (OSError, asyncio.TimeoutError) as exc:
            sock.close()
            if writer is not None:
                why = f"smolbench proxy: can't reach {addr}:{port} ({getattr(exc, 'strerror', None) or 'timed out'})"
                writer.write(f"HTTP/1.1 502 {why}\r\nConnection: close\r\nContent-Length: 0\r\n\r\n".encode("ascii", "replace"))
            return None
        w.transport.set_write_buffer_limits(high=_netbudget.BUFFER)
        conn.readers.append(r)
        conn.writers.append(w)
        return r, w

    # -- the control channel (the kernel, over stdin/stdout) -------------------------------------

    async def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if op == "attach":
            machines = [(str(m["node"]), int(m["pid"])) for m in msg["machines"]]
            tree = msg.get("tree")
            return {"ok": True, "errors": await self.attach(machines, NetPolicy.from_dict(msg["policy"]),
                                                             str(tree) if tree else None)}
        if op == "detach":
            for name in msg.get("nodes", []):
                await self.detach(str(name))
            return {"ok": True}
        if op == "host_only":  # Ray nodes that joined since: this host's for every machine from now on
            self.host_only = self.host_only | frozenset(ipaddress.ip_address(str(a)) for a in msg.get("add", []))
            self._own = (0.0, frozenset())
            return {"ok": True}
        if op == "stats":
            nodes = {n: node.stats() for n, node in self.nodes.items()}
            # plus the ones the machine's own rules refused at once, read in its namespaces: off
            # this loop, as a branch that kept its capabilities can make that read slow (its rules)
            counted = [(n, node.pid) for n, node in self.nodes.items() if node.pid]
            # one after another, on one thread: each forks a helper, and forks from many threads at once ask for trouble
            counts = await asyncio.to_thread(lambda: [_refused_in(pid) for _, pid in counted])
            for (n, _), count in zip(counted, counts):
                nodes[n]["refused"] += count
            return {"ok": True, "nodes": nodes, "kernel": self.budget.counts()}
        return {"error": f"unknown op {op!r}"}


_HEADS_FULL = {  # why a machine's request head waited unread, by _netfair's reason
    _netfair.FULL: f"this machine tree has had {_netbudget.TREE_HEADS} request heads unfinished",
    _netfair.SHARE: "this machine has had its part of its tree's request heads unfinished",
    _netfair.KEPT: "the rest of this machine tree's request heads have been kept for its other machines"}


def _bad_gateway(line: str) -> bytes:
    return (f"HTTP/1.1 502 {line}\r\nContent-Type: text/plain\r\nContent-Length: {len(line) + 1}\r\n"
            f"Connection: close\r\n\r\n{line}\n").encode("ascii", "replace")


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, seen: list[float] | None = None,
                turn: Turn | None = None) -> None:
    """One direction, with backpressure: nothing more is read from ``src`` while ``dst``'s
    buffer is over its high water (the far side doesn't read), so ``src``'s sender stalls.
    ``seen[0]``: when a byte last moved (either way, shared by both directions); ``turn``:
    waited for before each move (its machine's turn): a move is what ``src`` holds now, up to
    ``_netbudget.TURN`` bytes, while ``dst`` is under its high water, all without yielding (a
    turn a chunk cost a lone tunnel's relaying ~1/4 more CPU; a turn spent later is unfair)."""
    try:
        while True:
            data = await src.read(_netbudget.BUFFER)
            if not data:
                break
            if turn is not None:
                await turn[0]()
            if seen is not None:
                seen[0] = time.monotonic()
            dst.write(data)
            moved = len(data)
            while (moved < _netbudget.TURN and _held(src)
                   and dst.transport.get_write_buffer_size() <= _netbudget.BUFFER):
                data = await src.read(_netbudget.BUFFER)  # at once: it holds some
                dst.write(data)
                moved += len(data)
            if turn is not None:
                turn[1](moved)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
    except (ConnectionError, OSError):
        dst.transport.abort()


# a machine's turns to relay: wait for one; say how many bytes moved on it
Turn = tuple[Callable[[], Awaitable[None]], Callable[[int], None]]


def _held(reader: asyncio.StreamReader) -> bool:
    """Whether ``reader`` holds bytes not read yet (its buffer has no public size)."""
    return bool(getattr(reader, "_buffer", b""))


async def _relay(r1: asyncio.StreamReader, w1: asyncio.StreamWriter, r2: asyncio.StreamReader, w2: asyncio.StreamWriter,
                 turn: Turn | None = None) -> None:
    """Both ways until the far end is done; then the machine's side gets a few seconds to
    finish (an idle client that never closes must not hold a connection slot forever). A
    connection that moves no byte either way for IDLE_TIMEOUT seconds is closed: tunnels held
    open and silent kept their tree's connections forever (eighth audit). ``turn``: see ``_pipe``."""
    seen = [time.monotonic()]
    to_far = asyncio.ensure_future(_pipe(r1, w2, seen, turn))
    to_machine = asyncio.ensure_future(_pipe(r2, w1, seen, turn))
    try:
        while not to_machine.done():
            left = seen[0] + IDLE_TIMEOUT - time.monotonic()
            if left <= 0:  # idle both ways: let both sides go at once
                w1.transport.abort()
                w2.transport.abort()
                return
            await asyncio.wait([to_machine], timeout=left)
        to_machine.result()  # a failure of ours is raised here, as before
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(to_far), LINGER)
    finally:
        to_far.cancel()
        to_machine.cancel()
        await _close(w2)


def _reset(writer: asyncio.StreamWriter) -> None:
    """A refusal the machine sees at once: the connection is reset, not just closed."""
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def _close(writer: asyncio.StreamWriter) -> None:
    """Close after what's buffered is sent; a side that doesn't read it within LINGER seconds
    (or a cancelled connection) is let go at once, never waited on."""
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), LINGER)
    except asyncio.CancelledError:
        writer.transport.abort()
        raise
    except Exception:  # noqa: BLE001 - timed out or broken: either way, let go
        writer.transport.abort()


def prepare() -> _netbudget.Budget:
    """Everything the proxy needs after it drops privileges, loaded now: as the sandbox uid it
    can't import from a Python in a private (0700) home (issue 26). The lookup threads'
    module, the codecs a host name's lookup uses, and the budget (its thread pool)."""
    import concurrent.futures.thread  # noqa: F401 - loop.getaddrinfo's default would import it lazily
    import encodings.idna  # noqa: F401 - socket.getaddrinfo encodes a str host with it
    import stringprep  # noqa: F401 - encodings.idna's
    import unicodedata  # noqa: F401 - encodings.idna's (a C extension in lib-dynload)

    "x.test".encode("idna")
    return _netbudget.Budget()


def _drop(uid: int, gid: int) -> None:
    """Root starts us (its Python may be under /root); we run as the sandbox uid."""
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)


def _seal() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: after the uid change, which clears it


def _one_line(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Anything that escapes a handler: one line on stderr, never a traceback in a cell."""
    exc = context.get("exception")
    what = f"{type(exc).__name__}: {exc}" if exc is not None else str(context.get("message", "?"))
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"smolbench egress proxy: {what}"[:300] + "\n")


async def _serve(proxy: Proxy) -> None:
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(_one_line)
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = sys.stdout
    out.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    out.flush()
    while True:
        line = await reader.readline()
        if not line:
            return  # the kernel is gone
        try:
            reply = await proxy.handle(json.loads(line))
        except Exception as exc:  # noqa: BLE001 - one line back to the kernel
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="smolbench-netproxy")
    ap.add_argument("--uid", type=int, default=None)
    ap.add_argument("--gid", type=int, default=None)
    ap.add_argument("--open", action="store_true", help="tests only: admit every destination (a weakened set-up)")
    ap.add_argument("--host-only", default="", help="addresses that count as this host (the Ray cluster's nodes)")
    args = ap.parse_args(argv)
    host_only = frozenset(ipaddress.ip_address(a) for a in args.host_only.split(",") if a)
    netpolicy.TEST_WEAKEN.update(w for w in os.environ.get(WEAKEN_VAR, "").split(",") if w)
    budget = prepare() if "net-lazy-imports" not in netpolicy.TEST_WEAKEN else _netbudget.Budget(lazy=True)
    if args.uid is not None and os.geteuid() == 0:
        _drop(args.uid, args.gid if args.gid is not None else args.uid)
    _seal()
    asyncio.run(_serve(Proxy(open_all=args.open, budget=budget, host_only=host_only)))


if __name__ == "__main__":
    main()
