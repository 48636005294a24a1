"""What the egress proxy may hold for one machine tree and for one kernel (issue 25, item 5).

The proxy runs outside every machine's cgroup, so its memory is bounded here, by count:

* per connection and direction, at most ``BUFFER`` bytes wait in the proxy's reader and
  ``BUFFER`` in its writer; the kernel's socket buffers are fixed at ``SOCK_BUFFER`` (no
  autotuning up to megabytes). A side that doesn't read stops the proxy reading the other
  (backpressure), so a machine that sends to a far end that never reads fills nothing more;
* per tree (a root machine and all its branches, counted together: a fork multiplies
  nothing) at most ``TREE_CONNECTIONS`` connections, shared fairly among its machines
  (``_netfair``: each live machine is guaranteed ``MACHINE_FLOOR``, and one above that holds
  at most its part among those holding some, never more than ``MACHINE_CONNECTIONS``),
  ``TREE_HEADS`` request heads being read (each at most ``BUFFER`` bytes and
  ``HEAD_TIMEOUT`` seconds; the others wait unread, in their fixed socket buffers), shared
  among its machines the same way (each guaranteed ``HEAD_FLOOR``, alone ``MACHINE_HEADS``:
  one machine's silent connections never hold another's heads unread), and
  ``TREE_LOOKUPS`` name lookups in flight; per kernel at most ``KERNEL_CONNECTIONS``
  connections, shared the same way among its trees (each guaranteed ``TREE_FLOOR``);
* per tree, new connections are accepted at most ``TREE_RATE`` a second, after a burst of
  ``TREE_BURST`` (a token bucket, ``Bucket``), and per machine half that (so one machine's
  flood never takes its siblings' allowance): past it a connection waits unaccepted in its
  machine's listen backlog, so a flood of requests costs the proxy (which no machine's cgroup
  counts) nothing more than the allowance (eighth audit: refused CONNECTs by the thousand, each
  accepted, parsed and answered on the proxy's one loop);
* relaying takes turns: a connection moves what it holds (at most ``TURN`` bytes) only on its
  machine's turn, the trees waiting to move some taking turns, then the machines of each (``Turns``): what
  the proxy relays (its one loop, CPU capped) is shared per tree and machine, not per
  connection (ninth audit: a sibling pushing through 16 tunnels cut a one-tunnel branch from
  56 to 5.5 MB/s);
* name lookups run on the proxy's own threads, ``TREE_LOOKUPS`` of each tree's own (made at
  its first lookup, ended with its last machine): names that resolve slowly stall only their
  own tree's lookups, never another machine's, however many trees do it at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import _netfair

BUFFER = 16 * 1024  # per connection and direction: the reader's limit (it pauses at 2x) and the writer's high water
SOCK_BUFFER = 16 * 1024  # SO_RCVBUF / SO_SNDBUF of the proxy's sockets (the kernel doubles it)
TREE_CONNECTIONS = 64
MACHINE_CONNECTIONS = TREE_CONNECTIONS // 2  # one machine of a tree (a root or a branch), alone: never the whole tree's
MACHINE_FLOOR = 4  # what each live machine of a tree may always open (while its tree has 4 per machine)
KERNEL_CONNECTIONS = 256
TREE_FLOOR = 16  # what each live tree may always open (while the kernel has 16 per tree)
TURN = 4 * BUFFER  # the most one connection relays on its machine's turn (what it holds now, at once)
TREE_HEADS = 16
MACHINE_HEADS = TREE_HEADS // 2  # one machine, alone (first come let one branch's 16 silent connections hold them all)
HEAD_FLOOR = 2  # what each live machine of a tree may always be reading
HEAD_TIMEOUT = 10.0
TREE_RATE = 64.0  # new connections a second, per tree (the bucket's refill)
TREE_BURST = 128  # and at once, after a quiet while (the bucket's size)
TREE_LOOKUPS = 4
RESOLVE_TIMEOUT = 15.0
# both directions, each: the reader (2x its limit, plus one receive of at most the socket's
# buffer) and the writer (its high water plus one chunk)
PER_CONNECTION = 2 * (2 * BUFFER + 2 * SOCK_BUFFER + 2 * BUFFER)


Lookup = Callable[..., list[Any]]


@dataclass(eq=False)
class Conn:
    """One relayed connection's streams, for counting what they hold."""

    readers: list[asyncio.StreamReader] = field(default_factory=list)
    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    node: Any = None  # the machine it came from
    target: str = ""  # where it asked to go, once known
    in_head: bool = False  # its request head is still being read

    def buffered(self) -> int:
        # the reader's buffer has no public size; it is bounded by its limit (and SOCK_BUFFER)
        held = sum(len(getattr(r, "_buffer", b"")) for r in self.readers)
        return held + sum(w.transport.get_write_buffer_size() for w in self.writers if not w.transport.is_closing())


@dataclass(eq=False)
class Bucket:
    """An allowance of new connections: TREE_BURST at once, refilled at TREE_RATE a second, for
    a tree; a ``share`` of that (half, for one machine of it). Both read when used: tests lower them."""

    share: int = 1
    tokens: float = 0.0
    at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.tokens = TREE_BURST / self.share  # full, at first

    def wait(self) -> float:
        """Seconds until a connection may be accepted (0: now)."""
        now, size, rate = time.monotonic(), TREE_BURST / self.share, TREE_RATE / self.share
        self.tokens = min(size, self.tokens + (now - self.at) * rate)
        self.at = now
        return 0.0 if self.tokens >= 1 else (1 - self.tokens) / rate

    def take(self) -> None:
        self.tokens -= 1  # a listener that was waiting too may take one more: never more than one each


@dataclass(eq=False)
class Tree:
    """A root machine and its branches: what they hold in the proxy together."""

    name: str
    conns: set[Conn] = field(default_factory=set)
    heads: int = 0
    heads_of: dict[Any, int] = field(default_factory=dict)  # heads being read, by machine
    head_waiters: list[asyncio.Future[None]] = field(default_factory=list)  # woken when one is done
    lookups: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(TREE_LOOKUPS))
    bucket: Bucket = field(default_factory=Bucket)
    members: set[Any] = field(default_factory=set)  # its live machines: each guaranteed MACHINE_FLOOR
    # its own lookup threads: a shared pool let 8 trees' hanging lookups (4 each) stall every other tree's
    executor: concurrent.futures.ThreadPoolExecutor | None = None

    def buffered(self) -> int:
        return sum(c.buffered() for c in self.conns)

    def head_refusal(self, node: Any) -> str | None:
        """Why ``node`` may not start reading one more request head now (``_netfair``), or None."""
        return _netfair.refusal(self.heads_of, self.members or [node], node, TREE_HEADS, HEAD_FLOOR, MACHINE_HEADS)

    async def take_head(self, node: Any) -> str | None:
        """Wait, at most HEAD_TIMEOUT seconds, until ``node`` may read one more head, and take
        it (None); or why it still may not. Every waiter is woken when a head is done and
        checks again: a machine's own waiters never stand before another's turn."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + HEAD_TIMEOUT
        while (why := self.head_refusal(node)) is not None:
            if (left := deadline - loop.time()) <= 0:
                return why
            fut: asyncio.Future[None] = loop.create_future()
            self.head_waiters.append(fut)
            try:
                await asyncio.wait_for(fut, left)
            except asyncio.TimeoutError:
                return why
        self.heads_of[node] = self.heads_of.get(node, 0) + 1
        self.heads += 1
        return None

    def give_head(self, node: Any) -> None:
        """A head taken by ``node`` is done (read, failed, or its connection gone)."""
        self.heads -= 1
        self.heads_of[node] -= 1
        if not self.heads_of[node]:
            del self.heads_of[node]
        self.wake_heads()

    def wake_heads(self) -> None:
        """Every machine waiting to read a head checks again (one was done, or a machine left)."""
        waiters, self.head_waiters = self.head_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)


class Turns:
    """Whose connection relays next: each round (a pass of the proxy's loop while one waits),
    every tree with credit and a connection waiting moves one, of its machines' with credit in
    turn, each machine's first come. A tree or machine earns ``BUFFER`` bytes a round, never
    banking more, and pays what it moved (so bytes are shared, not turns: a waiting connection's
    reader is full); one in debt waits rounds out even when no one else waits at that moment
    (a one-tunnel machine waits a few passes for its next bytes, and was outrun 4 to 1)."""

    def __init__(self) -> None:
        self.waiting: dict[str, dict[Any, deque[asyncio.Future[None]]]] = {}  # by tree, then machine
        self.trees: dict[str, tuple[int, int]] = {}  # credit in bytes, at round
        self.machines: dict[Any, tuple[int, int]] = {}
        self.rounds = 0
        self.round: asyncio.Handle | None = None

    async def turn(self, tree: str, node: Any) -> None:
        """Wait for ``node``'s turn (in ``tree``) to relay; say what it moved with ``moved``."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self.waiting.setdefault(tree, {}).setdefault(node, deque()).append(fut)
        if self.round is None:  # one round per loop pass: the connections it let go run first
            self.round = loop.call_soon(self._round)
        await fut

    def moved(self, tree: str, node: Any, n: int) -> None:
        self.trees[tree] = (self._credit(self.trees, tree) - n, self.rounds)
        self.machines[node] = (self._credit(self.machines, node) - n, self.rounds)

    def forget(self, tree: str | None = None, node: Any = None) -> None:
        """A tree or machine gone: its credit (or debt) with it."""
        self.trees.pop(tree or "", None)
        self.machines.pop(node, None)

    def _credit(self, credit: dict[Any, tuple[int, int]], key: Any) -> int:
        n, at = credit.get(key, (BUFFER, 0))
        return min(BUFFER, n + (self.rounds - at) * BUFFER)

    def _round(self) -> None:
        self.rounds += 1
        self.round = None
        for tree in list(self.waiting):
            machines = self.waiting[tree]
            if self._credit(self.trees, tree) > 0:
                self._grant(machines)
            if not machines:
                del self.waiting[tree]
        if self.waiting:
            self.round = asyncio.get_running_loop().call_soon(self._round)

    def _grant(self, machines: dict[Any, deque[asyncio.Future[None]]]) -> None:
        """Let the next of ``machines`` with credit move one connection (each goes last after)."""
        for _ in range(len(machines)):
            node = next(iter(machines))
            queue = machines.pop(node)
            while queue and queue[0].done():  # cancelled (its connection went): no turn
                queue.popleft()
            if not queue:
                continue
            machines[node] = queue
            if self._credit(self.machines, node) > 0:
                queue.popleft().set_result(None)
                if not queue:
                    del machines[node]
                return


class Budget:
    """The kernel's proxy: its trees, their caps, and each tree's lookup threads."""

    def __init__(self, lookup: Lookup = socket.getaddrinfo, *, lazy: bool = False) -> None:
        self.trees: dict[str, Tree] = {}
        self.turns = Turns()
        self.lookup = lookup
        # the threads' module is loaded before the proxy drops privileges: it can't be imported
        # after (issue 26); ``lazy`` (tests only, SMOLBENCH_TEST_WEAKEN=net-lazy-imports) loads it
        # at the first lookup, as the proxy once did
        self._threads: type[concurrent.futures.ThreadPoolExecutor] | None = (
            None if lazy else concurrent.futures.ThreadPoolExecutor)

    def _executor(self, tree: Tree) -> concurrent.futures.ThreadPoolExecutor:
        if tree.executor is None:
            threads = self._threads or concurrent.futures.ThreadPoolExecutor
            tree.executor = threads(TREE_LOOKUPS, thread_name_prefix=f"smolbench-resolve-{tree.name}"[:48])
        return tree.executor

    def tree(self, name: str) -> Tree:
        if name not in self.trees:
            self.trees[name] = Tree(name)
        return self.trees[name]

    def end(self, name: str) -> None:
        """Forget tree ``name`` (its last machine is gone): its idle lookup threads end; one still
        in a lookup ends when that returns."""
        tree = self.trees.pop(name, None)
        self.turns.forget(tree=name)
        if tree is not None and tree.executor is not None:
            tree.executor.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        for name in list(self.trees):
            self.end(name)

    def connections(self) -> int:
        return sum(len(t.conns) for t in self.trees.values())

    def full(self, tree: Tree, node: Any = None) -> str | None:
        """Why one more connection of ``tree`` (from machine ``node``) can't be taken (None: it
        can): the tree's share of the kernel's, then the machine's of its tree's (``_netfair``)."""
        trees = {name: len(t.conns) for name, t in self.trees.items()}
        why = _netfair.refusal(trees, list(self.trees), tree.name, KERNEL_CONNECTIONS, TREE_FLOOR, KERNEL_CONNECTIONS)
        if why is not None:
            return {_netfair.FULL: f"this kernel's machines have {KERNEL_CONNECTIONS} connections open (the most they may)",
                    _netfair.SHARE: f"this machine tree has {len(tree.conns)} connections open (the most one tree may "
                                    f"while {sum(1 for n in trees.values() if n)} trees hold the kernel's "
                                    f"{KERNEL_CONNECTIONS})",
                    _netfair.KEPT: f"the rest of this kernel's {KERNEL_CONNECTIONS} connections are kept for its other "
                                   "machine trees"}[why]
        machines: dict[Any, int] = {}
        for c in tree.conns:
            machines[c.node] = machines.get(c.node, 0) + 1
        why = _netfair.refusal(machines, tree.members or [node], node, TREE_CONNECTIONS, MACHINE_FLOOR,
                               MACHINE_CONNECTIONS)
        if why is not None:
            return {_netfair.FULL: f"this machine tree has {TREE_CONNECTIONS} connections open (the most it may)",
                    _netfair.SHARE: f"this machine has {machines.get(node, 0)} connections open (the most one machine "
                                    f"of its tree may while {sum(1 for n in machines.values() if n)} of its machines "
                                    "hold some)",
                    _netfair.KEPT: "the rest of this machine tree's connections are kept for its other machines"}[why]
        return None

    async def resolve(self, tree: Tree, host: str, port: int) -> list[Any]:
        """``getaddrinfo`` on the proxy's threads, at most TREE_LOOKUPS of ``tree`` at once: a
        slot is held until its thread returns (a timed-out lookup still holds one)."""
        try:
            await asyncio.wait_for(tree.lookups.acquire(), RESOLVE_TIMEOUT)
        except asyncio.TimeoutError:
            raise OSError(f"{TREE_LOOKUPS} name lookups of this machine tree are still running") from None
        loop = asyncio.get_running_loop()
        try:
            fut = loop.run_in_executor(self._executor(tree), self.lookup, host, port, 0, socket.SOCK_STREAM)
        except BaseException:
            tree.lookups.release()
            raise
        fut.add_done_callback(lambda _: tree.lookups.release())
        try:
            return list(await asyncio.wait_for(asyncio.shield(fut), RESOLVE_TIMEOUT))
        except asyncio.TimeoutError:
            raise OSError(f"looking up {host} took more than {RESOLVE_TIMEOUT:.0f} s") from None

    def counts(self) -> dict[str, int]:
        return {"connections": self.connections(), "buffered": sum(t.buffered() for t in self.trees.values()),
                "heads": sum(t.heads for t in self.trees.values())}


def bounded(sock: socket.socket) -> socket.socket:
    """Fixed, small kernel buffers for one of the proxy's sockets."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUFFER)
    return sock
