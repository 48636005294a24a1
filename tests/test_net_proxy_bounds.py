"""The egress proxy's memory is bounded and counted (issue 25, item 5), its lookups are fair
(issue 25: slow names must not stall other machines), and it needs no import after it drops
privileges (issue 26: a Python in a private home).

The proxy's host side runs here on real sockets: a machine's listener is one on this host's
loopback, the far end a listener on ``127.0.0.17`` (``SMOLBENCH_TEST_FAR`` makes it a far
network's stand-in). Numbers asserted are the proxy's own counts (``stats``) and this
process's RSS, never times. Each bound is shown again with the cap lifted, where it fails.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ipaddress
import os
import re
import resource
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nethelpers import held_sink, proxy_listener, tunnel

from smolbench.backends import _netbudget, _netproxy
from smolbench.netpolicy import NetPolicy

ROOT = Path(__file__).resolve().parent.parent
FAR = "127.0.0.17"


@pytest.fixture(autouse=True)
def far_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMOLBENCH_TEST_FAR", "127.0.0.16/28")


@pytest.fixture(autouse=True)
def descriptors() -> Iterator[None]:
    """256 tunnels take ~1000 descriptors here (client, proxy's two sides, the sink's): a user's
    soft limit is often 1024, so it is raised to the hard one for these tests."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard == resource.RLIM_INFINITY else min(hard, 8192)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def sink() -> Iterator[int]:
    """A far end that accepts and never reads."""
    yield from held_sink(FAR)


def _flood(w: asyncio.StreamWriter) -> int:
    """Send until the kernel takes no more (the proxy stopped reading): how much went."""
    sock = w.get_extra_info("socket")
    sent, block = 0, b"x" * 65536
    while True:
        try:
            sent += os.write(sock.fileno(), block)
        except BlockingIOError:
            return sent
        except OSError:
            return sent


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _settle(proxy: _netproxy.Proxy) -> dict[str, Any]:
    """Stats once the proxy has moved what it will (its buffered count stops growing)."""
    last = -1
    while True:
        await asyncio.sleep(0.3)
        counts = proxy.budget.counts()
        if counts["buffered"] == last:
            return counts
        last = counts["buffered"]


@pytest.mark.parametrize("capped", [True, False])
def test_tunnels_to_a_far_end_that_never_reads_hold_bounded_memory(
        capped: bool, sink: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The audit's 256 tunnels to a listed host that never reads: +278 MiB of proxy RSS and
    ~2 GiB of host memory. Now at most MACHINE_CONNECTIONS tunnels open per machine (and
    TREE_CONNECTIONS per tree), each holding at most PER_CONNECTION bytes in the proxy
    (backpressure stops reading the machine), kernel socket buffers fixed; with the caps
    lifted (the old proxy) the same flood holds more."""
    bound = _netbudget.MACHINE_CONNECTIONS * _netbudget.PER_CONNECTION
    if not capped:
        monkeypatch.setattr(_netbudget, "MACHINE_CONNECTIONS", 10_000)
        monkeypatch.setattr(_netbudget, "TREE_CONNECTIONS", 10_000)
        monkeypatch.setattr(_netbudget, "KERNEL_CONNECTIONS", 10_000)

    async def main() -> tuple[dict[str, Any], int, int]:
        proxy = _netproxy.Proxy()
        port = await proxy_listener(proxy, "m", NetPolicy.from_lists(False, [], ["127.0.0.16/28"]))
        before = _rss()
        tunnels = [await tunnel(port, f"{FAR}:{sink}") for _ in range(256)]
        opened = sum(1 for _, _, a in tunnels if a.startswith(b"HTTP/1.1 200"))
        for _ in range(3):  # again once the proxy has moved what it would
            for _, w, a in tunnels:
                if a:
                    _flood(w)
            counts = await _settle(proxy)
        grown = _rss() - before
        stats = (await proxy.handle({"op": "stats"}))["nodes"]["m"]
        assert stats["open"] == counts["connections"] and stats["buffered"] == counts["buffered"]
        for _, w, _ in tunnels:
            w.transport.abort()
        await proxy.detach("m")
        return counts, opened, grown

    counts, opened, grown = asyncio.run(main())
    if capped:
        assert opened == counts["connections"] == _netbudget.MACHINE_CONNECTIONS
        assert 0 < counts["buffered"] <= bound, counts
        print(f"capped: {opened} tunnels, {counts['buffered']} bytes buffered (bound {bound}), RSS +{grown}")
        assert grown < bound + (64 << 20), grown
    else:  # the same flood through a proxy without the tree's cap
        assert opened == 256 and counts["buffered"] > bound, counts
        print(f"uncapped: {opened} tunnels, {counts['buffered']} bytes buffered, RSS +{grown}")


def test_a_fork_multiplies_nothing_beyond_its_trees_cap(sink: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Branches are counted in their root's tree: a root and three branches together get the
    tree's connections; another tree still gets its own."""
    monkeypatch.setattr(_netbudget, "TREE_CONNECTIONS", 20)

    async def main() -> None:
        proxy = _netproxy.Proxy()
        policy = NetPolicy.from_lists(False, [], ["127.0.0.16/28"])
        ports = [await proxy_listener(proxy, n, policy, "root") for n in ("root", "root.0", "root.1", "root.0.0")]
        other = await proxy_listener(proxy, "other", policy, "other")
        tunnels = [await tunnel(p, f"{FAR}:{sink}") for p in ports for _ in range(10)]
        assert sum(1 for *_, a in tunnels if a.startswith(b"HTTP/1.1 200")) == 20
        theirs = [await tunnel(other, f"{FAR}:{sink}") for _ in range(5)]
        assert all(a.startswith(b"HTTP/1.1 200") for *_, a in theirs)
        stats = (await proxy.handle({"op": "stats"}))["nodes"]
        assert sum(stats[n]["open"] for n in ("root", "root.0", "root.1", "root.0.0")) == 20
        assert sum(stats[n]["failed"] for n in ("root", "root.0", "root.1", "root.0.0")) == 20
        assert "connections open (the most it may)" in stats["root.0.0"]["last_failed"]
        for _, w, _ in tunnels + theirs:
            w.transport.abort()
        for n in ("root", "root.0", "root.1", "root.0.0", "other"):
            await proxy.detach(n)

    asyncio.run(main())


def test_unfinished_request_heads_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The audit held 256 unfinished 256 KiB heads (+71 MiB, 30 s each). Now a machine alone
    has at most MACHINE_HEADS heads being read (its tree TREE_HEADS), each at most the reader's
    limit; the others wait unread (their bytes in fixed socket buffers) and past the machine's
    cap are dropped at once."""
    # no head times out while a loaded host accepts them all (it would free slots and count failures)
    monkeypatch.setattr(_netbudget, "HEAD_TIMEOUT", 600.0)

    async def main() -> None:
        proxy = _netproxy.Proxy()
        port = await proxy_listener(proxy, "m", NetPolicy.from_lists(False, [], ["127.0.0.16/28"]))
        conns = []
        for _ in range(_netbudget.MACHINE_CONNECTIONS + 16):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"CONNECT " + b"a" * 60 + b".test:443 HTTP/1.1\r\nX: " + b"y" * 8000)  # no end
            conns.append((r, w))
        deadline = time.monotonic() + 60  # every connection accepted or dropped: a loaded host takes a while
        while proxy.budget.counts()["connections"] + proxy.nodes["m"].failed < len(conns):
            assert time.monotonic() < deadline, (proxy.budget.counts(), proxy.nodes["m"].failed)
            await asyncio.sleep(0.05)
        for _ in range(20):  # and each accepted one's task has run to its first wait (a head read, or a slot)
            await asyncio.sleep(0)
        counts = proxy.budget.counts()
        assert counts["heads"] == _netbudget.MACHINE_HEADS, counts
        assert counts["connections"] == _netbudget.MACHINE_CONNECTIONS, counts
        assert counts["buffered"] <= _netbudget.MACHINE_HEADS * 2 * _netbudget.BUFFER, counts
        stats = (await proxy.handle({"op": "stats"}))["nodes"]["m"]
        assert stats["failed"] == 16 and "connections open" in stats["last_failed"], stats
        assert stats["heads"] == _netbudget.MACHINE_HEADS
        reading = [(r, w) for r, w in conns if w.transport.get_extra_info("socket") is not None]
        big_r, big_w = reading[0]
        with contextlib.suppress(ConnectionError):  # past the reader's limit: dropped, not held
            big_w.write(b"z" * (4 * _netbudget.BUFFER))
            await big_w.drain()
            await asyncio.wait_for(big_r.read(), 60)
        for _, w in conns:
            w.transport.abort()
        await proxy.detach("m")

    asyncio.run(main())


def _hanging_resolver() -> tuple[Any, list[str], threading.Event]:
    """A fake getaddrinfo whose lookups of ``slow*`` names hang until released (no DNS), the
    names it was asked, and the release."""
    release = threading.Event()
    asked: list[str] = []

    def lookup(host: str, port: int, *rest: Any) -> list[Any]:
        asked.append(host)
        if host.startswith("slow"):
            release.wait(120)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (FAR, port))]

    return lookup, asked, release


@pytest.mark.parametrize("fair", [True, False])
def test_slow_names_stall_only_their_own_trees_lookups(fair: bool, sink: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine asks for 40 names whose lookup hangs (a fake resolver here: no DNS). Another
    machine's lookup still runs at once. With one shared pool and no per-tree bound (as the
    old proxy used the loop's default executor), it waits behind them."""
    shared = concurrent.futures.ThreadPoolExecutor(32)
    if not fair:
        monkeypatch.setattr(_netbudget, "TREE_LOOKUPS", 10_000)
        monkeypatch.setattr(_netbudget.Budget, "_executor", lambda self, tree: shared)
    lookup, asked, release = _hanging_resolver()

    async def main() -> None:
        proxy = _netproxy.Proxy(budget=_netbudget.Budget(lookup))
        slow = NetPolicy.from_lists(False, [f"slow{i}.test" for i in range(40)], [])
        slow_port = await proxy_listener(proxy, "greedy", slow)
        fast_port = await proxy_listener(proxy, "other", NetPolicy.from_lists(False, ["fast.test"], []))
        stuck = [asyncio.ensure_future(tunnel(slow_port, f"slow{i}.test:{sink}")) for i in range(40)]
        fast = None
        try:
            while len(asked) < min(40, _netbudget.TREE_LOOKUPS, 32):
                await asyncio.sleep(0.05)
            fast = asyncio.ensure_future(tunnel(fast_port, f"fast.test:{sink}"))
            if fair:
                _, w, answer = await fast  # while the greedy machine's lookups are all still hanging
                assert answer.startswith(b"HTTP/1.1 200") and not release.is_set()
                assert sum(1 for h in asked if h.startswith("slow")) == _netbudget.TREE_LOOKUPS
                w.close()
            else:
                done, _ = await asyncio.wait([fast], timeout=3)
                assert not done and "fast.test" not in asked  # queued behind the hanging lookups
        finally:
            release.set()
        for t in [*stuck, *([fast] if fast else [])]:
            _, w, _ = await t
            w.close()
        for n in ("greedy", "other"):
            await proxy.detach(n)

    asyncio.run(main())
    shared.shutdown()


@pytest.mark.parametrize("own_threads", [True, False])
def test_many_trees_of_slow_names_never_stall_another_trees_lookup(own_threads: bool, sink: int,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Seventh audit: 8 machine trees (students' root machines) each ask for their 4 names whose
    lookups hang. A ninth machine's lookup still runs at once: each tree has its own lookup
    threads. With one pool of 32 shared by all trees (the old proxy), the 32 hanging lookups
    filled it and the ninth waited (15 s with real DNS)."""
    if not own_threads:  # the old design: every tree's lookups on one shared pool of 32 threads
        shared = concurrent.futures.ThreadPoolExecutor(32)
        monkeypatch.setattr(_netbudget.Budget, "_executor", lambda self, tree: shared)
    lookup, asked, release = _hanging_resolver()

    async def main() -> None:
        proxy = _netproxy.Proxy(budget=_netbudget.Budget(lookup))
        n = _netbudget.TREE_LOOKUPS
        ports = [await proxy_listener(proxy, f"student{t}", NetPolicy.from_lists(False, [f"slow{t}-{i}.test" for i in range(n)], []))
                 for t in range(8)]
        fast_port = await proxy_listener(proxy, "other", NetPolicy.from_lists(False, ["fast.test"], []))
        stuck = [asyncio.ensure_future(tunnel(port, f"slow{t}-{i}.test:{sink}"))
                 for t, port in enumerate(ports) for i in range(n)]
        fast = None
        try:
            while len(asked) < 8 * n:
                await asyncio.sleep(0.05)
            fast = asyncio.ensure_future(tunnel(fast_port, f"fast.test:{sink}"))
            done, _ = await asyncio.wait([fast], timeout=10 if own_threads else 3)
            if own_threads:
                assert done and fast.result()[2].startswith(b"HTTP/1.1 200") and not release.is_set()
            else:
                assert not done and "fast.test" not in asked  # queued behind the 32 hanging lookups
        finally:
            release.set()
        for t in [*stuck, *([fast] if fast else [])]:
            _, w, _ = await t
            w.close()
        trees = proxy.budget.trees
        executors = [trees[f"student{t}"].executor for t in range(8)] if own_threads else []
        for name in [f"student{t}" for t in range(8)] + ["other"]:
            await proxy.detach(name)
        assert proxy.budget.trees == {}  # a tree's threads end with its last machine
        assert all(e is not None and e._shutdown for e in executors)

    asyncio.run(main())
    if not own_threads:
        shared.shutdown()


@pytest.mark.parametrize("off_the_loop", [True, False])
def test_a_slow_count_in_a_machines_namespaces_never_stops_the_proxy(off_the_loop: bool, sink: int,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Seventh audit: a branch that kept its capabilities filled its refuse chain with 500,000
    rules, so `%smol status`'s count of them (nft, in the machine's namespaces) took ~30 s,
    and the proxy read it on its one loop: every machine's egress stopped meanwhile. Here the
    count hangs; another machine's connection goes through while it does. Read on the loop
    (the old proxy), the connection is not answered until the count ends."""
    entered, release = threading.Event(), threading.Event()
    answer: list[bytes] = []

    def slow_count(pid: int) -> int:
        entered.set()
        release.wait(60)
        return 3

    monkeypatch.setattr(_netproxy, "_refused_in", slow_count)
    if not off_the_loop:  # the old proxy: the count read on the loop thread
        async def on_the_loop(func: Any, *args: Any) -> Any:
            return func(*args)
        monkeypatch.setattr(_netproxy.asyncio, "to_thread", on_the_loop)

    def client(port: int) -> None:  # another machine's connection, while the count runs
        entered.wait(10)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            c.sendall(f"CONNECT {FAR}:{sink} HTTP/1.1\r\n\r\n".encode())
            c.settimeout(3)
            with contextlib.suppress(OSError):
                answer.append(c.recv(100))
        release.set()

    async def main() -> int:
        proxy = _netproxy.Proxy(budget=_netbudget.Budget())
        await proxy_listener(proxy, "branch", NetPolicy.from_lists(False, [], []))
        proxy.nodes["branch"].pid = os.getpid()  # (the count is faked above: no namespace is entered)
        port = await proxy_listener(proxy, "other", NetPolicy.from_lists(False, [], [f"{FAR}/32:{sink}"]))
        thread = threading.Thread(target=client, args=(port,))
        thread.start()
        stats = asyncio.ensure_future(proxy.handle({"op": "stats"}))
        while thread.is_alive():
            await asyncio.sleep(0.05)
        refused = int((await stats)["nodes"]["branch"]["refused"])
        for name in ("branch", "other"):
            await proxy.detach(name)
        return refused

    assert asyncio.run(main()) == 3
    went = bool(answer) and answer[0].startswith(b"HTTP/1.1 200")
    assert went == off_the_loop, answer


NS_WITH_RULES = """
nft 'add table ip smolbench'
nft 'add chain ip smolbench refuse { type filter hook output priority 0 ; }'
nft 'add rule ip smolbench refuse ip daddr 10.9.9.9 counter packets 7 bytes 420 reject'
echo ready
exec sleep 60
"""


@pytest.mark.parametrize("memory", ["bounded", "tiny"])
def test_the_count_in_a_machines_namespaces_runs_nft_within_its_limits(memory: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The count is read by nft in the machine's own user and network namespaces (here made by
    `unshare -rn`, a refuse chain that counted 7): within its memory limit it reads 7; with the
    limit made tiny it reads nothing (0), so the limit does reach nft: a machine's 500,000
    rules can't make it take a gigabyte outside every cgroup."""
    from smolbench.backends import _netns, _netredirect

    if _netredirect.found("nft") is None:
        pytest.skip("nft is not installed (apt-get install nftables)")
    proc = subprocess.Popen(["unshare", "-rn", "sh", "-c", NS_WITH_RULES], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            pytest.skip("no user and network namespace of our own here (unshare -rn)")
        if memory == "tiny":
            monkeypatch.setattr(_netredirect, "TOOL_MEMORY", 1 << 20)
        assert _netns._refused_in(proc.pid) == (7 if memory == "bounded" else 0)
    finally:
        proc.kill()
        proc.wait()


# -- nothing is imported after the privilege drop ------------------------------------------------

LAZY = re.compile(r"ModuleNotFoundError|imported after the drop|LookupError: unknown encoding")
AUDIT = textwrap.dedent('''
    import asyncio, socket, sys
    from smolbench.backends import _netproxy, _netbudget
    from smolbench.netpolicy import NetPolicy

    budget = _netproxy.prepare() if sys.argv[1] == "prepared" else _netbudget.Budget(lazy=True)

    class AfterTheDrop:
        """As the sandbox uid under a 0700 home: no module can be found any more."""
        def find_spec(self, name, path=None, target=None):
            raise ModuleNotFoundError(f"No module named {name!r} (imported after the drop)")

    async def main():
        async def answer(r, w):
            w.write(b"hi " + await r.readline())
            await w.drain()
            w.close()
        far = await asyncio.start_server(answer, "127.0.0.1", 0)
        fport = far.sockets[0].getsockname()[1]
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        proxy = _netproxy.Proxy(budget=budget)
        policy = NetPolicy.from_lists(False, [f"localhost:{fport}", f"refused.test"], [f"127.0.0.1/32:{fport}"])
        await proxy.serve("m", policy, [listener], [("127.0.0.1", port)])
        sys.meta_path.insert(0, AfterTheDrop())
        out = []
        for head in (f"CONNECT localhost:{fport} HTTP/1.1\\r\\n\\r\\nping\\n", f"GET http://localhost:{fport}/ HTTP/1.1\\r\\n\\r\\n",
                     "CONNECT refused.test:1 HTTP/1.1\\r\\n\\r\\n", "CONNECT 127.0.0.2:1 HTTP/1.1\\r\\n\\r\\n"):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(head.encode())
            out.append((await asyncio.wait_for(r.read(), 30)).split(b"\\r\\n")[0].decode())
            w.close()
        stats = (await proxy.handle({"op": "stats"}))["nodes"]["m"]
        print(repr((out, stats["allowed"], stats["failed"], stats["last_failed"])))
        await proxy.detach("m")
        far.close()

    asyncio.run(main())
''')


@pytest.mark.parametrize("prepared", [True, False])
def test_the_proxy_imports_nothing_after_it_drops_privileges(prepared: bool) -> None:
    """Issue 26: as the sandbox uid the proxy imported concurrent.futures.thread from pyenv's
    0700 /root, so every connection by host name died, as tracebacks in the running cell.
    Here any import after the point the proxy drops privileges fails; connections by name
    still work when the proxy prepared first. Without that (the old order) the failure is one
    line naming the host, a 502 for the machine and a count in the stats."""
    r = subprocess.run([sys.executable, "-c", AUDIT, "prepared" if prepared else "lazy"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    out, allowed, failed, last = eval(r.stdout.strip().splitlines()[-1])  # noqa: S307 - our own child's repr
    if prepared:
        assert out[:2] == ["HTTP/1.1 200 Connection established", "hi GET / HTTP/1.1"], out
        assert out[2].startswith("HTTP/1.1 403") and out[3].startswith("HTTP/1.1 403")
        assert (allowed, failed) == (2, 0) and r.stderr == "", r.stderr
    else:
        # which lazy load fails first depends on what smolbench imported already (the gate's threads
        # load concurrent.futures' now): a lookup thread's module, or the idna codec
        assert out[0].startswith("HTTP/1.1 502 smolbench egress proxy: localhost:") and LAZY.search(out[0]), out[0]
        assert failed == 3 and LAZY.search(last), last  # both names, and the unknown one
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert [ln.split(" failed: ")[0].rsplit(":", 1)[0] for ln in lines] == [  # one line per host, naming it
            "smolbench egress proxy: localhost", "smolbench egress proxy: refused.test"], r.stderr
        assert "Traceback" not in r.stderr and "never retrieved" not in r.stderr


def test_a_ray_clusters_nodes_are_this_host_for_every_machine(sink: int) -> None:
    """Ray's ports take code without authentication: on a cluster's node the proxy counts every
    node's address as this host (``_cluster_addresses``), so a range listing the cluster's
    network never reaches them; without that, the same range does."""

    async def main() -> None:
        policy = NetPolicy.from_lists(False, [], ["127.0.0.16/28"])
        for cluster, expect in ((frozenset({ipaddress.ip_address(FAR)}), b"HTTP/1.1 403"), (frozenset(), b"HTTP/1.1 200")):
            proxy = _netproxy.Proxy(host_only=cluster)
            port = await proxy_listener(proxy, "m", policy)
            _, w, answer = await tunnel(port, f"{FAR}:{sink}")
            assert answer.startswith(expect), (cluster, answer)
            w.close()
            await proxy.detach("m")

    asyncio.run(main())


def test_a_ray_node_that_joins_later_is_this_host_too(sink: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Round 4's audit: the proxy took the cluster's nodes once, when it started; a node added
    later (the cluster grew) was reachable through a range, with Ray's ports. The kernel's side
    tells the proxy of nodes that joined before it attaches a machine."""

    async def main() -> None:
        policy = NetPolicy.from_lists(False, [], ["127.0.0.16/28"])
        proxy = _netproxy.Proxy()
        port = await proxy_listener(proxy, "m", policy)
        _, w, answer = await tunnel(port, f"{FAR}:{sink}")
        assert answer.startswith(b"HTTP/1.1 200")  # not a node yet: in the range
        w.close()
        sent: list[dict[str, Any]] = []
        client = _netproxy.ProxyClient(None, None)

        async def call(msg: dict[str, Any]) -> dict[str, Any]:
            sent.append(msg)
            return await proxy.handle(msg)

        async def started() -> None:
            return None

        monkeypatch.setattr(client, "call", call)
        monkeypatch.setattr(client, "start", started)
        monkeypatch.setattr(_netproxy, "_cluster_addresses", lambda: [FAR])  # the node joined
        await client.attach([("m2", 0)], policy)
        assert sent[0] == {"op": "host_only", "add": [FAR]}
        _, w, answer = await tunnel(port, f"{FAR}:{sink}")
        assert answer.startswith(b"HTTP/1.1 403"), answer  # every machine's, the old one's too
        w.close()
        await client.attach([("m3", 0)], policy)
        assert [m["op"] for m in sent] == ["host_only", "attach", "attach"]  # said once
        for name in ("m", "m2", "m3"):
            await proxy.detach(name)

    asyncio.run(main())


def test_one_machine_s_failures_never_silence_another_s(capsys: pytest.CaptureFixture[str]) -> None:
    """Round 4's audit: the proxy showed 100 distinct failure lines for the whole kernel, so
    one machine naming 100 targets left every other machine's failures unsaid. Each machine
    now has its own lines, each naming it."""
    from smolbench.netpolicy import NetPolicy

    proxy = _netproxy.Proxy()
    noisy, quiet = (_netproxy.Node(name, NetPolicy("off"), proxy.budget.tree(name)) for name in ("root.1", "root.2"))
    for i in range(150):
        proxy.fail(noisy, f"host{i}.test:443", "ConnectionRefusedError")
    proxy.fail(quiet, "pypi.org:443", "TimeoutError")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == _netproxy.SAID_PER_NODE + 1 and noisy.failed == 150
    assert lines[-1] == "smolbench egress proxy: pypi.org:443 failed: TimeoutError (machine root.2)"


# A stand-in for the proxy process: each request noted in a file, answered (with its op) once the
# test has made the file "go" (after it stopped the first request): its reply is always late.
SLOW_PROXY = """
import json, os, sys, time
print('{"ready": true}', flush=True)
for line in sys.stdin:
    op = json.loads(line)["op"]
    with open(os.path.join(sys.argv[1], "got"), "a") as fh:
        fh.write(op + "\\n")
    while not os.path.exists(os.path.join(sys.argv[1], "go")):
        time.sleep(0.01)
    print(json.dumps({"op": op}), flush=True)
"""


def test_a_request_to_the_proxy_stopped_midway_leaves_no_reply_for_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request stopped after it was sent (a Ctrl-C during `%smol up`'s attach) left its reply in
    the pipe: the next request read it as its own, and every one after read the one before's."""
    monkeypatch.setattr(_netproxy, "command", lambda: [sys.executable, "-c", SLOW_PROXY, str(tmp_path)])

    async def main() -> dict[str, Any]:
        client = _netproxy.ProxyClient(None, None)
        try:
            first = asyncio.ensure_future(client.call({"op": "attach"}))
            while not (tmp_path / "got").exists():
                await asyncio.sleep(0.01)
            first.cancel()
            (tmp_path / "go").touch()  # its reply comes only now, after the stop
            with contextlib.suppress(asyncio.CancelledError):
                await first
            return await client.call({"op": "stats"})
        finally:
            await client.close()

    assert asyncio.run(main()) == {"op": "stats"}


def test_a_proxy_start_stopped_before_it_is_ready_ends_that_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A start stopped while the proxy came up (a Ctrl-C during the first `%smol up` with a network
    policy) left its process running, known to no one: no close ever ended it."""
    late = ("import os, sys, time; open(os.path.join(sys.argv[1], 'pid'), 'w').write(str(os.getpid())); "
            "time.sleep(60); print('{\"ready\": true}', flush=True); sys.stdin.read()")  # ready long after the stop
    monkeypatch.setattr(_netproxy, "command", lambda: [sys.executable, "-c", late, str(tmp_path)])
    pid_file = tmp_path / "pid"

    async def main() -> bool:
        client = _netproxy.ProxyClient(None, None)
        start = asyncio.ensure_future(client.start())
        while not pid_file.exists() or not pid_file.read_text():
            await asyncio.sleep(0.01)
        pid = int(pid_file.read_text())
        start.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await start
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
            await client.close()

    alive = asyncio.run(main())
    assert not alive, "the stopped start left the proxy process running"


# A stand-in whose first reply comes after the client stopped waiting for it (REPLY_WAIT), and
# half a wait into the next request's: a loaded host's delays of under a second change neither.
LATE_WAIT = 2.0
LATE_PROXY = f"""
import json, sys, time
print('{{"ready": true}}', flush=True)
for k, line in enumerate(sys.stdin):
    op = json.loads(line)["op"]
    time.sleep({1.5 * LATE_WAIT} if k == 0 else 0)
    print(json.dumps({{"op": op}}), flush=True)
"""


def test_a_reply_that_came_after_its_request_timed_out_is_not_the_next_one_s(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request whose reply was late (REPLY_WAIT) failed; its reply, when it came, was read by
    the next request as its own (an attach took a detach's, stats an attach's)."""
    monkeypatch.setattr(_netproxy, "command", lambda: [sys.executable, "-c", LATE_PROXY])
    monkeypatch.setattr(_netproxy, "REPLY_WAIT", LATE_WAIT)

    async def main() -> dict[str, Any]:
        client = _netproxy.ProxyClient(None, None)
        try:
            await client.start()  # started apart: a slow start must not eat the first request's wait
            with pytest.raises(asyncio.TimeoutError):
                await client.call({"op": "detach"})
            return await client.call({"op": "stats"})
        finally:
            await client.close()

    assert asyncio.run(main()) == {"op": "stats"}


def test_a_listed_name_that_resolves_into_a_lan_is_refused_saying_where_and_the_fix() -> None:
    """Fourth audit: `--allow pypi.org` admitted pypi.org at any address not this host's, on any
    port, so a rebound (or split-horizon) answer reached the LAN, Docker's gateway (172.17.0.1)
    and a Ray cluster's peers. A name listed without a port now reaches the internet only; the
    403 says where it resolved and how to list a private service. A lookup that fails says so,
    not that the policy refused it."""
    answers = {"pypi.test": "172.17.0.1"}

    def lookup(host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        if host not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (answers[host], port))]

    async def main() -> tuple[bytes, bytes]:
        proxy = _netproxy.Proxy(budget=_netbudget.Budget(lookup))
        port = await proxy_listener(proxy, "m", NetPolicy.from_lists(False, ["pypi.test", "gone.test"], []))
        _, w1, rebound = await tunnel(port, "pypi.test:6379")
        _, w2, missing = await tunnel(port, "gone.test:443")
        for w in (w1, w2):
            w.close()
        await proxy.detach("m")
        return rebound, missing

    rebound, missing = asyncio.run(main())
    assert rebound.startswith(b"HTTP/1.1 403 smolbench: pypi.test:6379 is not allowed: pypi.test resolved to 172.17.0.1, "
                              b"a private address, and a name listed without a port reaches the internet only: list it "
                              b"with its port (pypi.test:6379) to reach it there\r\n"), rebound
    assert missing.startswith(b"HTTP/1.1 403 smolbench: gone.test:443 was not reached: the name gone.test could not be "
                              b"looked up (Name or service not known)\r\n"), missing
