"""The egress proxy's bounds seen from a real kernel (issue 25, item 5): a machine and its
branch flood tunnels to a far end that never reads (a listener on 127.0.0.17, a far
network's stand-in through ``SMOLBENCH_TEST_FAR``); `%smol status` shows what the proxy
holds, and the tree's cap holds across the fork. The unit-level floods, with the caps lifted
as the contrast, are in tests/test_net_proxy_bounds.py."""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Iterator

import pytest
from test_netpolicy import NetLab, _lab

from smolbench.backends import _netbudget

pytestmark = pytest.mark.skipif(not __import__("shutil").which("bwrap"), reason="bubblewrap is not installed")


class Sink:
    """Accepts on 127.0.0.17 and never reads."""

    def __init__(self) -> None:
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.17", 0))
        self.srv.listen(1024)
        self.srv.settimeout(0.2)
        self.port = self.srv.getsockname()[1]
        self.bait = self.port
        self.held: list[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                self.held.append(self.srv.accept()[0])
            except OSError:
                continue

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for s in self.held:
            s.close()
        self.srv.close()


@pytest.fixture(scope="module")
def lab() -> Iterator[tuple[NetLab, Sink]]:
    sink = Sink()
    try:
        with _lab(sink, '[network]\nallow_cidrs = ["127.0.0.16/28"]\n',  # type: ignore[arg-type]
                  env={"SMOLBENCH_TEST_FAR": "127.0.0.16/28"}) as lab:
            yield lab, sink
    finally:
        sink.close()


FLOOD = r'''
import socket
def flood(port, n=256):
    """n tunnels through the proxy, each sent into until the kernel takes no more: how many opened."""
    global _tunnels
    _tunnels = []
    opened = 0
    for _ in range(n):
        try:
            s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
            s.sendall(b"CONNECT 127.0.0.17:%d HTTP/1.1\r\n\r\n" % port)
            s.settimeout(10)
            if s.recv(100).startswith(b"HTTP/1.1 200"):
                opened += 1
                _tunnels.append(s)
            else:
                s.close()
        except OSError:
            pass
    for s in _tunnels:
        s.setblocking(False)
        try:
            while True:
                s.send(b"x" * 65536)
        except OSError:
            pass
    return opened
'''


def _held(status: str) -> tuple[int, int, int]:
    m = re.search(r"the proxy holds (\d+) connections?, (\d+) KiB buffered, (\d+) unfinished request heads", status)
    assert m, status
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def test_a_flood_of_tunnels_is_capped_per_tree_and_counted(lab: tuple[NetLab, Sink]) -> None:
    nl, sink = lab
    nl.ok("%smol use root")
    nl.ok("%%smol\n" + FLOOD)
    opened = nl.probe(f"flood({sink.port})", "root")
    cap = _netbudget.MACHINE_CONNECTIONS  # one machine: half its tree's
    assert opened == cap
    held, kib, heads = _held(nl.status())
    assert held == cap and heads == 0
    assert kib * 1024 <= cap * _netbudget.PER_CONNECTION, kib
    assert re.search(rf"(\d+) failed in the proxy \(last: a new connection failed: this machine has "
                     rf"{cap} connections open", nl.status())
    # its branch is in the same tree: it gets its part of the tree's while its parent holds some
    # (a third, leaving room for one more machine), never the rest of it
    nl.ok("%smol use root.0")
    nl.ok("%%smol\n" + FLOOD)
    theirs = _netbudget.TREE_CONNECTIONS // 3
    assert nl.probe(f"flood({sink.port}, 64)", "root.0") == theirs
    assert _held(nl.status())[0] == cap + theirs
    nl.ok("%smol use root")
    nl.ok("%%smol\nfor s in _tunnels: s.close()")
