"""Eighth audit: one machine must not take its tree's (or the kernel's) egress from the others.

* A branch that held 80 tunnels took all 64 of its tree's connections, for as long as it
  liked (a relayed tunnel never timed out): its parent and sibling had no network. Now each
  machine has at most ``MACHINE_CONNECTIONS`` (half the tree's) and a tunnel that moves no
  byte either way for ``IDLE_TIMEOUT`` seconds is closed.
* A flood of refused requests cost the proxy CPU that no machine's cgroup counts. Now a tree's
  new connections are accepted at most ``TREE_RATE`` a second (a burst of ``TREE_BURST``),
  one machine's at most half that: past it they wait in the machine's listen backlog,
  unaccepted and unread.

The proxy's host side runs here on real sockets, as in ``test_net_proxy_bounds.py``: a
machine's listener is one on this host's loopback, the far end a listener on ``127.0.0.17``
(``SMOLBENCH_TEST_FAR`` makes it a far network's stand-in). Counts are asserted, never times.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator

import pytest
from nethelpers import held_sink, let_go, proxy_listener, tunnel

from smolbench.backends import _netbudget, _netproxy
from smolbench.netpolicy import NetPolicy

FAR = "127.0.0.17"
POLICY = NetPolicy.from_lists(False, [], ["127.0.0.16/28"])


@pytest.fixture(autouse=True)
def far_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMOLBENCH_TEST_FAR", "127.0.0.16/28")


@pytest.fixture
def sink() -> Iterator[int]:
    """A far end that accepts, holds every connection open and never says anything."""
    yield from held_sink(FAR)


async def _machine(proxy: _netproxy.Proxy, name: str, tree: str) -> int:
    return await proxy_listener(proxy, name, POLICY, tree)


def _ok(answer: bytes) -> bool:
    return answer.startswith(b"HTTP/1.1 200")


def test_a_branch_holding_more_than_its_share_leaves_its_parent_and_sibling_connections(sink: int) -> None:
    """The audit's t2: root.0 asks for 80 tunnels and holds them. Its parent and its sibling
    still each get tunnels; root.0 got at most half the tree's connections."""

    async def main() -> None:
        proxy = _netproxy.Proxy()
        ports = {n: await _machine(proxy, n, "root") for n in ("root", "root.0", "root.1")}
        hog = [await tunnel(ports["root.0"], f"{FAR}:{sink}") for _ in range(80)]
        held = sum(1 for *_, a in hog if _ok(a))
        theirs = [await tunnel(ports[n], f"{FAR}:{sink}") for n in ("root", "root.1") for _ in range(4)]
        try:
            assert held < _netbudget.TREE_CONNECTIONS, held
            assert all(_ok(a) for *_, a in theirs), [a for *_, a in theirs]
            stats = (await proxy.handle({"op": "stats"}))["nodes"]
            assert stats["root"]["open"] == stats["root.1"]["open"] == 4, stats
            assert stats["root.0"]["failed"] == 80 - held
            assert "the most one machine of its tree may" in stats["root.0"]["last_failed"], stats["root.0"]
        finally:
            for _, w, _ in hog + theirs:
                w.transport.abort()
            for n in ports:
                await proxy.detach(n)

    asyncio.run(main())


def test_an_idle_tunnel_is_closed_and_gives_its_connection_back(sink: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tunnel to a far end that says nothing, from a machine that says nothing, was held
    forever. With IDLE_TIMEOUT lowered, it is closed (the machine reads its end) and the
    tree's count goes back to zero; a tunnel that keeps moving bytes is not."""
    monkeypatch.setattr(_netproxy, "IDLE_TIMEOUT", 0.5, raising=False)

    async def main() -> None:
        proxy = _netproxy.Proxy()
        port = await _machine(proxy, "root.0", "root")
        r, w, answer = await tunnel(port, f"{FAR}:{sink}")
        assert _ok(answer)
        try:
            tail = await asyncio.wait_for(r.read(), 60)  # the end of the stream: closed by the proxy
            assert tail == b""
            for _ in range(200):  # the connection's task ends right after
                if not proxy.budget.counts()["connections"]:
                    break
                await asyncio.sleep(0.05)
            assert proxy.budget.counts()["connections"] == 0
        finally:
            w.transport.abort()
            await proxy.detach("root.0")

    asyncio.run(main())


def test_a_flood_of_refused_requests_is_handled_only_up_to_its_trees_allowance(
        sink: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The audit's t3: 8 threads of a branch sent refused CONNECTs as fast as they could, each
    accepted, parsed and answered 403 on the proxy's one loop. Now a tree's bucket (here 20 at
    once, refilled at a rate no test outlasts), half of it the machine's own, lets the proxy
    take 10; the other 40 wait unaccepted, never parsed. Its sibling still connects (the other
    half), and so does another tree's machine."""
    monkeypatch.setattr(_netbudget, "TREE_BURST", 20, raising=False)
    monkeypatch.setattr(_netbudget, "TREE_RATE", 1e-6, raising=False)

    async def ask(port: int) -> bytes:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        try:
            w.write(b"CONNECT 10.1.2.3:443 HTTP/1.1\r\n\r\n")
            return await r.read()
        finally:
            w.transport.abort()

    async def main() -> None:
        proxy = _netproxy.Proxy()
        flooder = await _machine(proxy, "root.0", "root")
        sibling = await _machine(proxy, "root.1", "root")
        other = await _machine(proxy, "other", "other")
        asks = [asyncio.ensure_future(ask(flooder)) for _ in range(50)]
        try:
            pending: set[asyncio.Future[bytes]] = set(asks)
            while len(asks) - len(pending) < 10:  # the allowance, answered
                _, pending = await asyncio.wait(pending, timeout=60, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.wait(pending, timeout=3)  # a moment for more (the old proxy answered all 50)
            answered = [t.result() for t in asks if t.done()]
            assert len(answered) == 10 and all(a.startswith(b"HTTP/1.1 403") for a in answered), len(answered)
            stats = (await proxy.handle({"op": "stats"}))["nodes"]
            assert stats["root.0"]["refused"] == stats["root.0"]["accepted"] == 10, stats["root.0"]
            for port in (sibling, other):  # its sibling: the tree's other half; another tree: its own
                _, w, answer = await tunnel(port, f"{FAR}:{sink}")
                assert _ok(answer), answer
                w.transport.abort()
        finally:
            for t in asks:
                t.cancel()
            await asyncio.gather(*asks, return_exceptions=True)
            for n in ("root.0", "root.1", "other"):
                await proxy.detach(n)

    asyncio.run(main())


async def _hold_all(port: int, sink: int, most: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]]:
    """As many tunnels as the proxy gives, of ``most`` asked for (the refused ones too)."""
    return [await tunnel(port, f"{FAR}:{sink}") for _ in range(most)]


@pytest.mark.parametrize("hogs", [2, 3])
def test_branches_holding_all_they_can_leave_their_parent_its_floor(sink: int, hogs: int) -> None:
    """A gap the eighth audit left: each machine could hold half its tree's connections, so two branches that
    held all they could filled the tree and their parent had no network. Now ``hogs`` branches
    each ask for 80 tunnels and hold them; the parent still gets MACHINE_FLOOR, and so did
    every branch (the tree's 64 shared among those that want some)."""

    async def main() -> None:
        proxy = _netproxy.Proxy()
        names = ["root"] + [f"root.{i}" for i in range(hogs)]
        ports = {n: await _machine(proxy, n, "root") for n in names}
        held = {n: await _hold_all(ports[n], sink, 80) for n in names[1:]}
        theirs = await _hold_all(ports["root"], sink, _netbudget.MACHINE_FLOOR)
        try:
            got = {n: sum(1 for *_, a in held[n] if _ok(a)) for n in held}
            assert all(_ok(a) for *_, a in theirs), (got, [a for *_, a in theirs])
            assert all(n >= _netbudget.MACHINE_FLOOR for n in got.values()), got
            assert sum(got.values()) + len(theirs) <= _netbudget.TREE_CONNECTIONS, got
            stats = (await proxy.handle({"op": "stats"}))["nodes"]
            assert stats["root"]["open"] == _netbudget.MACHINE_FLOOR, stats["root"]
        finally:
            await let_go(proxy, ports, *held.values(), theirs)

    asyncio.run(main())


def test_trees_holding_all_they_can_leave_another_tree_its_floor(sink: int) -> None:
    """A gap the eighth audit left: four trees of three machines, each machine holding all it could, filled the
    kernel's 256 connections, and a fifth tree (another user's root) had no network. Now the
    kernel's connections are shared among the trees that want some: the fifth still gets
    TREE_FLOOR, and no tree more than its part."""

    async def main() -> None:
        proxy = _netproxy.Proxy()
        trees = [f"t{i}" for i in range(4)]
        ports = {(t, m): await _machine(proxy, f"{t}.{m}" if m else t, t) for t in trees for m in range(3)}
        late = await _machine(proxy, "late", "late")
        held = [await _hold_all(port, sink, 40) for port in ports.values()]
        theirs = await _hold_all(late, sink, _netbudget.TREE_FLOOR)
        try:
            counts = {t.name: len(t.conns) for t in proxy.budget.trees.values()}
            assert all(_ok(a) for *_, a in theirs), (counts, [a for *_, a in theirs])
            assert sum(counts.values()) <= _netbudget.KERNEL_CONNECTIONS, counts
            stats = (await proxy.handle({"op": "stats"}))["nodes"]
            last = [s["last_failed"] for n, s in stats.items() if n.startswith("t3")]
            assert any("kept for its other machine trees" in f or "the most one tree may" in f for f in last), last
        finally:
            for tunnels in [*held, theirs]:
                for _, w, _ in tunnels:
                    w.transport.abort()
            for n in list(proxy.nodes):
                await proxy.detach(n)

    asyncio.run(main())


def test_more_live_machines_than_the_trees_connections_still_leave_one_for_the_parent(sink: int) -> None:
    """Ninth audit: with more than 64 live machines in a tree (a fork may have 1,024 branches)
    each was guaranteed 64 // live = 0, so three branches holding all they could took the
    tree's 64 and their parent (and every idle sibling) had none. Now, 80 branches live, three
    of them ask for 40 tunnels each: they hold one each (the most each may while the others
    lack theirs), and the parent and two idle siblings still get one."""

    async def main() -> None:
        proxy = _netproxy.Proxy()
        names = ["root"] + [f"root.{i}" for i in range(80)]
        ports = {n: await _machine(proxy, n, "root") for n in names}
        held = {n: await _hold_all(ports[n], sink, 40) for n in ("root.0", "root.1", "root.2")}
        theirs = [await tunnel(ports[n], f"{FAR}:{sink}") for n in ("root", "root.5", "root.6")]
        try:
            got = {n: sum(1 for *_, a in held[n] if _ok(a)) for n in held}
            assert all(_ok(a) for *_, a in theirs), (got, [a for *_, a in theirs])
            assert got == {n: 1 for n in held}, got
            stats = (await proxy.handle({"op": "stats"}))["nodes"]
            assert "kept for its other machines" in stats["root.0"]["last_failed"], stats["root.0"]
        finally:
            await let_go(proxy, ports, *held.values(), theirs)

    asyncio.run(main())


def test_more_live_trees_than_the_kernels_connections_still_leave_one_for_another_tree(sink: int) -> None:
    """The same one level up: with more than 256 live trees each was guaranteed 0 of the
    kernel's 256, so ten trees holding all they could filled them. Now, 260 trees live, ten
    ask for 40 tunnels each and hold one each; a late tree still gets one."""

    async def main() -> None:
        proxy = _netproxy.Proxy()
        ports = {f"t{i}": await _machine(proxy, f"t{i}", f"t{i}") for i in range(260)}
        held = [await _hold_all(ports[f"t{i}"], sink, 40) for i in range(10)]
        _, w, answer = await tunnel(ports["t200"], f"{FAR}:{sink}")
        try:
            counts = {t.name: len(t.conns) for t in proxy.budget.trees.values() if t.conns}
            assert _ok(answer), (counts, answer)
            assert counts == {**{f"t{i}": 1 for i in range(10)}, "t200": 1}, counts
            stats = (await proxy.handle({"op": "stats"}))["nodes"]
            assert "kept for its other machine trees" in stats["t0"]["last_failed"], stats["t0"]
        finally:
            w.transport.abort()
            for tunnels in held:
                for _, w2, _ in tunnels:
                    w2.transport.abort()
            for n in list(proxy.nodes):
                await proxy.detach(n)

    asyncio.run(main())


def test_branches_silent_connections_never_hold_their_parents_request_heads(
        sink: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ninth audit: a tree's 16 header-reading slots were one first-come queue, so a branch
    keeping 16 connections open and silent made every request of its parent wait until one
    timed out (HEAD_TIMEOUT, 10 s). Now heads are shared per machine as connections are: two
    branches each keep 16 silent connections (no head ever times out here), and the parent's
    tunnel is answered while they still hold every one of them, reading no more heads than
    their parts."""
    monkeypatch.setattr(_netbudget, "HEAD_TIMEOUT", 600.0)  # the old queue: the parent waited this

    async def main() -> None:
        proxy = _netproxy.Proxy()
        ports = {n: await _machine(proxy, n, "root") for n in ("root", "root.0", "root.1")}
        silent = [await asyncio.open_connection("127.0.0.1", ports[n]) for n in ("root.0", "root.1") for _ in range(16)]
        tree = proxy.budget.trees["root"]
        for _ in range(1200):  # every silent one accepted, and its task at its first wait
            if len(tree.conns) == len(silent):
                break
            await asyncio.sleep(0.05)
        for _ in range(20):
            await asyncio.sleep(0)
        try:
            # well above the fixed proxy's (at once) and well below the old queue's 600 s
            _, w, answer = await asyncio.wait_for(tunnel(ports["root"], f"{FAR}:{sink}"), 60)
            w.transport.abort()
            assert _ok(answer), answer
            stats = (await proxy.handle({"op": "stats"}))["nodes"]
            assert stats["root.0"]["open"] == stats["root.1"]["open"] == 16, stats
            heads = stats["root.0"]["heads"] + stats["root.1"]["heads"]
            assert heads <= _netbudget.TREE_HEADS - _netbudget.HEAD_FLOOR, stats
            assert stats["root.0"]["failed"] == stats["root.1"]["failed"] == 0, stats
        finally:
            for _, w in silent:
                w.transport.abort()
            for n in ports:
                await proxy.detach(n)

    asyncio.run(main())


# Pushes through tunnels from another process (the proxy's loop is then what's short): ``hog``
# tunnels through the first port, one through the second, each to a sink of its own on FAR
# that counts what it receives; when the one tunnel's sink has ``want`` bytes, says both counts.
_PUSH = """
import json, os, socket, sys, threading
first, second, hog, want = map(int, sys.argv[1:5])
got = {"hog": 0, "one": 0}
lock, stop, ready = threading.Lock(), threading.Event(), threading.Barrier(hog + 1)

def sink(who):
    srv = socket.socket()
    srv.bind(("127.0.0.17", 0))
    srv.listen(64)
    def drain(c):
        while True:
            b = c.recv(1 << 20)
            if not b:
                return
            with lock:
                got[who] += len(b)
                if who == "one" and got[who] >= want and not stop.is_set():
                    stop.set()
                    print(json.dumps(got), flush=True)
                    os._exit(0)
    def accept():
        while True:
            threading.Thread(target=drain, args=(srv.accept()[0],), daemon=True).start()
    threading.Thread(target=accept, daemon=True).start()
    return srv.getsockname()[1]

def push(port, target):
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"CONNECT {target} HTTP/1.1\\r\\n\\r\\n".encode())
    head = b""
    while not head.endswith(b"\\r\\n\\r\\n"):
        head += s.recv(1)
    assert head.startswith(b"HTTP/1.1 200"), head
    ready.wait()
    buf = b"x" * 65536
    while True:
        s.sendall(buf)

targets = {"hog": f"127.0.0.17:{sink('hog')}", "one": f"127.0.0.17:{sink('one')}"}
pushers = [threading.Thread(target=push, args=(first, targets["hog"]), daemon=True) for _ in range(hog)]
pushers.append(threading.Thread(target=push, args=(second, targets["one"]), daemon=True))
for t in pushers:
    t.start()
threading.Event().wait()
"""


def test_a_sibling_pushing_through_many_tunnels_takes_no_more_relaying_than_one_tunnel() -> None:
    """Ninth audit: the proxy relayed fairly per connection, so a sibling pushing through 16
    tunnels cut a one-tunnel branch from 56 to 5.5 MB/s. Now chunks move in turns per tree and
    machine: both push as fast as they can (from another process, so the proxy's loop is what's
    short), and by the time the one tunnel has moved 32 MB, the 16 have moved at most 4 times
    that (per connection they moved ~16 times; counted in bytes, never timed)."""
    want = 32 << 20

    async def main() -> None:
        proxy = _netproxy.Proxy()
        ports = {n: await _machine(proxy, n, "root") for n in ("root", "root.0", "root.1")}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _PUSH, str(ports["root.0"]), str(ports["root.1"]), "16", str(want),
            stdout=asyncio.subprocess.PIPE)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), 300)
            got = json.loads(out)
            assert got["one"] >= want and got["hog"] <= 4 * got["one"], got
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            for n in ports:
                await proxy.detach(n)

    asyncio.run(main())
