"""This host is never reachable through a range (issue 25, item 1). Tried from `%%smol` cells
in real kernels (ZMQ on TCP: the kernel's ports are host services), root and a branch.

The audit reached listeners on this host through `allow_cidrs = ["0.0.0.0/0", "::/0"]` and
the README's lane example `["127.0.0.0/8"]`: `CONNECT 0.0.0.0:PORT`, `GET http://0.0.0.0:PORT/`,
`127.0.0.2`, `127.1.2.3`, `[::]`, plain sockets through the redirect, and a relay to the
kernel's IOPub port. Here the same attacks and more spellings (IPv4-mapped and -compatible
IPv6, decimal, octal and hex numbers, a listed name that resolves to 127.x) go at:

* a dual-stack listener bound on ``::`` (all addresses, IPv4 too): the stand-in for a
  service bound on ``0.0.0.0`` (Jupyter in Docker, Ray's ports);
* the kernel's own ZMQ ports (IOPub among them) on 127.0.0.1.

Each must be refused, counted as refused and never as let out; an address listed singly with
its port still answers, and so does a far network (``SMOLBENCH_TEST_FAR`` makes
``127.0.0.16/28`` stand in for one). Against the old rule (``SMOLBENCH_TEST_WEAKEN=net-hostonly``:
only this host's interface addresses count as this host) the same probes get through.
"""

from __future__ import annotations

import http.server
import re
import socket
import threading
from collections.abc import Iterator

import pytest
from nethelpers import hello_handler
from test_netpolicy import NetLab, _lab

pytestmark = pytest.mark.skipif(not __import__("shutil").which("bwrap"), reason="bubblewrap is not installed")


_Hello = hello_handler(b"hello from the host")


class _DualStack(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


class Listeners:
    """``everywhere``: bound on ``::`` (every address); ``far``: on 127.0.0.17 (a far network's
    stand-in); ``single``: on 127.0.0.2, listed singly with its port."""

    def __init__(self) -> None:
        self.servers = [_DualStack(("::", 0), _Hello), http.server.ThreadingHTTPServer(("127.0.0.17", 0), _Hello),
                        http.server.ThreadingHTTPServer(("127.0.0.2", 0), _Hello)]
        for s in self.servers:
            threading.Thread(target=s.serve_forever, daemon=True).start()
        self.everywhere, self.far, self.single = (s.server_address[1] for s in self.servers)
        self.bait = self.everywhere  # NetLab.host_services' bait

    def close(self) -> None:
        for s in self.servers:
            s.shutdown()
            s.server_close()


@pytest.fixture(scope="module")
def ls() -> Iterator[Listeners]:
    h = Listeners()
    yield h
    h.close()


def _smolfile(h: Listeners, cidrs: list[str]) -> str:
    listed = ", ".join(f'"{c}"' for c in [*cidrs, f"127.0.0.2/32:{h.single}"])
    return f'[network]\nallow_hosts = ["rebind.test", "rebind6.test"]\nallow_cidrs = [{listed}]\n'


ENV = {"SMOLBENCH_TEST_FAR": "127.0.0.16/28", "SMOLBENCH_TEST_RESOLVE": "rebind.test=127.0.0.3,rebind6.test=::1"}
WIDE = ["0.0.0.0/0", "::/0"]
LANE = ["127.0.0.0/8"]


@pytest.fixture(scope="module")
def wide(ls: Listeners) -> Iterator[NetLab]:
    with _lab(ls, _smolfile(ls, WIDE), env=ENV) as lab:  # type: ignore[arg-type]
        yield lab


@pytest.fixture(scope="module")
def lane(ls: Listeners) -> Iterator[NetLab]:
    with _lab(ls, _smolfile(ls, LANE), env=ENV) as lab:  # type: ignore[arg-type]
        yield lab


@pytest.fixture(scope="module")
def weak(ls: Listeners) -> Iterator[NetLab]:
    """Weakened: the old rule, where only this host's interface addresses were this host."""
    with _lab(ls, _smolfile(ls, WIDE + LANE), weaken="net-hostonly", env=ENV) as lab:  # type: ignore[arg-type]
        yield lab


def _attacks(port: int, lab_range: list[str]) -> dict[str, str]:
    """Every way to this host's listener at ``port``: probe name -> expression (True: reached)."""
    a = {f"CONNECT {h}": f"tunnel({h!r}, {port})" for h in (
        "0.0.0.0", "127.0.0.2", "127.1.2.3", "127.255.255.254", "[::]", "[::ffff:127.0.0.2]", "[::ffff:0.0.0.0]",
        "[::127.0.0.2]", "2130706434", "0x7f.2", "017700000002", "0x7f000002", "127.2", "rebind.test")}
    a["GET http://0.0.0.0"] = f"http('http://0.0.0.0:{port}/') == 'hello from the host'"
    a["GET http://[::]"] = f"http('http://[::]:{port}/') == 'hello from the host'"
    a["GET http://0x7f.2"] = f"http('http://0x7f.2:{port}/') == 'hello from the host'"
    a["GET http://rebind.test"] = f"http('http://rebind.test:{port}/') == 'hello from the host'"
    # plain sockets, through the machine's redirect (IPv4 ranges)
    a["socket 127.0.0.2"] = f"talk('127.0.0.2', {port}) == 'hello from the host'"
    a["socket 127.1.2.3"] = f"talk('127.1.2.3', {port}) == 'hello from the host'"
    if "0.0.0.0/0" in lab_range:
        a["CONNECT rebind6.test"] = f"tunnel('rebind6.test', {port})"
    return a


def _reached(lab: NetLab, attacks: dict[str, str], node: str) -> dict[str, bool]:
    got = lab.probe("{" + ", ".join(f"{k!r}: bool({v})" for k, v in attacks.items()) + "}", node)
    return {k: v for k, v in got.items() if v}


def _counts(status: str) -> tuple[int, int]:
    m = re.search(r"(\d+) connections? let out, (\d+) refused", status)
    assert m, status
    return int(m.group(1)), int(m.group(2))


@pytest.mark.parametrize("which", ["wide", "lane"])
def test_no_range_reaches_a_listener_on_this_host(which: str, request: pytest.FixtureRequest, ls: Listeners) -> None:
    lab: NetLab = request.getfixturevalue(which)
    attacks = _attacks(ls.everywhere, WIDE if which == "wide" else LANE)
    for node in ("root", "root.0"):
        before = _counts(lab.status())
        assert _reached(lab, attacks, node) == {}, (which, node)
        let_out, refused = _counts(lab.status())
        assert let_out == before[0], "a refused connection was counted as let out"
        assert refused >= before[1] + len(attacks), (before, refused)
        # what the list does reach: a far network through the range, the single on its port
        assert lab.probe(f"[http('http://127.0.0.17:{ls.far}/'), talk('127.0.0.17', {ls.far}), "
                         f"http('http://127.0.0.2:{ls.single}/'), talk('127.0.0.2', {ls.single})]", node) == [
            "hello from the host"] * 4
    # a refused name-to-this-host says so in one line, naming it and the policy
    lab.ok("%smol use root")
    said = lab.probe(f"http('http://rebind.test:{ls.everywhere}/')")
    assert said.startswith(f"HTTP 403 smolbench: rebind.test:{ls.everywhere} is not allowed by this machine's network policy")


@pytest.mark.parametrize("which", ["wide", "lane"])
def test_no_range_reaches_the_kernels_ports(which: str, request: pytest.FixtureRequest) -> None:
    """The audit subscribed to IOPub through `CONNECT 0.0.0.0:<iopub port>`."""
    lab: NetLab = request.getfixturevalue(which)
    ports = lab.nb.kernel_ports()
    probes = {f"{h}:{p}": f"tunnel({h!r}, {p}) or raw({h.strip('[]')!r}, {p})"
              for p in ports for h in ("0.0.0.0", "127.0.0.2", "[::]", "[::ffff:127.0.0.1]")}
    for node in ("root", "root.0"):
        assert _reached(lab, probes, node) == {}, (which, node)


def test_the_same_probes_get_through_the_old_rule(weak: NetLab, ls: Listeners) -> None:
    attacks = _attacks(ls.everywhere, WIDE)
    kept = {k: v for k, v in attacks.items() if "rebind6" not in k}  # ::1 is an interface's address: refused then too
    assert set(_reached(weak, kept, "root.0")) == set(kept)
    before = _counts(weak.status())
    assert weak.probe(f"tunnel('0.0.0.0', {weak.nb.kernel_ports()[0]})", "root") is True  # the IOPub relay's way in
    assert _counts(weak.status())[0] == before[0] + 1
