"""Network policy (issue 19): off, on and allow-lists mean the same on the sandbox as on smol,
and a machine never reaches the host's own services. Tried from `%%smol` cells in a real kernel.

Stand-in hosts are loopback addresses of this host only: ``127.0.0.2`` (a listed host, and a
tiny package index), ``127.0.0.3`` (unlisted; the internet's stand-in for ``net = true``,
through the test-only ``SMOLBENCH_TEST_INTERNET``), and the host's own services on
``127.0.0.1``: the kernel's ZMQ ports (Jupyter's default TCP transport, what the audit read
IOPub from) and a bait listener; listed ranges ``127.0.0.16/28`` (listeners on ``.17`` and
``.18``) and ``127.0.0.32/28:port`` (``.33``), for plain sockets. No other address is ever
contacted.

Every refusal is checked again against a deliberately weakened set-up
(``SMOLBENCH_TEST_WEAKEN``): ``net-share`` (the machine shares the host's network, as
before), ``net-open`` (the egress proxy admits everything), ``net-caps`` (the cell keeps
CAP_NET_ADMIN and CAP_NET_RAW in its network namespace), where the same probe must see the leak.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import hashlib
import http.server
import io
import json
import os
import re
import shutil
import sqlite3
import tempfile
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nbhelpers import NotebookSession, error_text, result_text, stream_text

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")

PKG = "smolnetdemo"
WHEEL = f"{PKG}-0.1-py3-none-any.whl"


def _wheel() -> bytes:
    files = {f"{PKG}/__init__.py": "VALUE = 19\n",
             f"{PKG}-0.1.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {PKG}\nVersion: 0.1\n",
             f"{PKG}-0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},{len(text)}"
              for name, text in files.items()] + [f"{PKG}-0.1.dist-info/RECORD,,"]
    files[f"{PKG}-0.1.dist-info/RECORD"] = "\n".join(record) + "\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return buf.getvalue()


class _Handler(http.server.BaseHTTPRequestHandler):
    wheel = _wheel()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.rstrip("/") == f"/simple/{PKG}":
            digest = hashlib.sha256(self.wheel).hexdigest()
            body = f'<html><body><a href="/files/{WHEEL}#sha256={digest}">{WHEEL}</a></body></html>'.encode()
            kind = "text/html"
        elif self.path == f"/files/{WHEEL}":
            body, kind = self.wheel, "application/octet-stream"
        else:
            body, kind = f"hello from {self.server.server_address[0]}".encode(), "text/plain"
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class Hosts:
    """Stand-in servers on this host's loopback (each answers "hello from ADDRESS")."""

    def __init__(self) -> None:
        self.servers = []
        for name, addr in (("bait", "127.0.0.1"), ("listed_bait", "127.0.0.1"), ("allowed", "127.0.0.2"),
                           ("other", "127.0.0.3"), ("range_a", "127.0.0.17"), ("range_b", "127.0.0.17"),
                           ("range_c", "127.0.0.18"), ("port_ok", "127.0.0.33"), ("port_no", "127.0.0.33")):
            server = http.server.ThreadingHTTPServer((addr, 0), _Handler)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self.servers.append(server)
            setattr(self, name, server.server_address[1])

    bait: int
    listed_bait: int
    allowed: int
    other: int
    range_a: int  # 127.0.0.16/28 is listed without a port: any port of .17 and .18
    range_b: int
    range_c: int
    port_ok: int  # 127.0.0.32/28 is listed with this port only
    port_no: int

    def close(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    h = Hosts()
    yield h
    h.close()


# Loaded once into each machine; every probe returns plain data.
PROBES = r'''
import ctypes, fcntl, json, os, socket, struct, subprocess, sys, urllib.error, urllib.request

def raw(host, port):
    """A plain TCP connection (no proxy): did anything answer?"""
    try:
        socket.create_connection((host, port), timeout=3).close()
        return True
    except OSError:
        return False

def http(url):
    """GET through the machine's own proxy settings: the body, or the error."""
    try:
        return urllib.request.urlopen(url, timeout=15).read().decode()
    except urllib.error.HTTPError as exc:
        return "HTTP %d %s" % (exc.code, exc.reason)
    except Exception as exc:
        return "ERR %s %s" % (type(exc).__name__, exc)

def tunnel(host, port):
    """CONNECT through the egress proxy, if the machine has one: did it open the tunnel?"""
    try:
        s = socket.create_connection(("127.0.0.1", 3128), timeout=3)
    except OSError:
        return False
    with s:
        s.sendall(b"CONNECT %s:%d HTTP/1.1\r\nHost: %s:%d\r\n\r\n" % (host.encode(), port, host.encode(), port))
        return s.recv(200).startswith(b"HTTP/1.1 200")

def talk(host, port):
    """A plain socket (no proxy) asks for "/": what answered, or False."""
    try:
        with socket.create_connection((host, port), timeout=5) as s:
            s.settimeout(10)
            s.sendall(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
            data = b""
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return False
    return data.split(b"\r\n\r\n", 1)[-1].decode() if data.startswith(b"HTTP/") else False

def nft_tamper():
    """Rewrite the machine's redirect (in-process, with whatever capabilities the cell has)."""
    try:
        lib = ctypes.CDLL("libnftables.so.1")
    except OSError:
        return "no libnftables"
    lib.nft_ctx_new.restype = ctypes.c_void_p
    lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    ctx = lib.nft_ctx_new(0)
    done = [lib.nft_run_cmd_from_buffer(ctx, cmd) == 0 for cmd in (
        b"add table ip mine", b"delete table ip smolbench", b"flush ruleset")]
    nft = [p for p in ("/usr/sbin/nft", "/sbin/nft") if os.path.exists(p)]
    if nft:  # as root of a user namespace of its own, over the machine's network namespace
        done.append(subprocess.run(["unshare", "-r", nft[0], "flush", "ruleset"], capture_output=True).returncode == 0)
    return any(done)

def answers(host, port):
    return raw(host, port) or tunnel(host, port)

def pip_download(index, trusted=None):
    shutil_dir = "/tmp/dl-%d" % os.getpid()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--disable-pip-version-check",
           "--retries", "0", "--timeout", "10", "-d", shutil_dir, "--index-url", index, "smolnetdemo"]
    if trusted:
        cmd += ["--trusted-host", trusted]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    got = os.path.isdir(shutil_dir) and any(f.startswith("smolnetdemo") for f in os.listdir(shutil_dir))
    return {"ok": r.returncode == 0 and got, "err": (r.stdout + r.stderr)[-600:]}

def in_new_userns(host, port, net):
    """Root of a fresh user namespace (and network namespace): any way out from there?"""
    code = "import socket; socket.create_connection((%r, %d), timeout=3)" % (host, port)
    r = subprocess.run(["unshare", "-rn" if net else "-r", sys.executable, "-c", code], capture_output=True, timeout=60)
    return r.returncode == 0

def raw_socket():
    try:
        socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP).close()
        return True
    except OSError:
        return False

def net_admin():
    """Reconfigure the machine's own interface (what adding routes or addresses needs too)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        req = struct.pack("16sh", b"lo", 0) + b"\0" * 14
        flags = struct.unpack("16sh", fcntl.ioctl(s, 0x8913, req)[:18])[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sh", b"lo", flags) + b"\0" * 14)
        return True
    except OSError:
        return False
    finally:
        s.close()

def ip_route():
    try:
        r = subprocess.run(["ip", "route", "add", "unreachable", "127.99.0.0/16"], capture_output=True)
    except OSError:  # no iproute2 here: the ioctl probe (net_admin) covers the same capability
        return False
    return r.returncode == 0

_held = []
def listen():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    _held.append(s)
    return s.getsockname()[1]
'''


class NetLab:
    """A kernel (TCP transport: its ports are host services) with a machine and two kept branches."""

    def __init__(self, base: Path, hosts: Hosts, smolfile: str, weaken: str = "", up: str = "",
                 env: dict[str, str] | None = None) -> None:
        self.hosts, self.base = hosts, base
        (base / "Smolfile").write_text(smolfile)
        saved = {k: os.environ.get(k) for k in ("SMOLBENCH_TEST_WEAKEN", *(env or {}))}
        os.environ.update({"SMOLBENCH_TEST_WEAKEN": weaken, **(env or {})})
        try:
            self.nb = NotebookSession(base, allow_errors=True, transport="tcp").__enter__()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.ok("%load_ext smolbench")
        self.up_text = stream_text(self.ok("%smol up --backend sandbox " + up))
        self.ok("%%smol\n" + PROBES)
        self.ok("%%smol fork 2 --keep all --quiet\nx = 1")

    def ok(self, source: str) -> Any:
        cell = self.nb.run(source)
        err = error_text(cell)
        assert not err, f"{source[:60]!r} raised:\n{err}"
        return cell

    def probe(self, expr: str, node: str = "root") -> Any:
        self.ok(f"%smol use {node}")
        self.ok(f"%%smol --pull out\nimport json\nout = json.dumps({expr})")
        value = result_text(self.ok("out"))
        assert value is not None
        return json.loads(ast.literal_eval(value))

    def host_services(self, node: str) -> dict[str, bool]:
        """Does any host service on 127.0.0.1 answer, directly or through the proxy?"""
        ports = {"bait": self.hosts.bait, **{f"kernel:{p}": p for p in self.nb.kernel_ports()}}
        expr = "{" + ", ".join(f"{k!r}: [raw('127.0.0.1', {p}), tunnel('127.0.0.1', {p})]" for k, p in ports.items()) + "}"
        got = self.probe(expr, node)
        return {k: any(v) for k, v in got.items()}

    def status(self) -> str:
        return stream_text(self.ok("%smol status"))

    def close(self) -> None:
        self.nb.__exit__(None, None, None)


@contextlib.contextmanager
def _lab(hosts: Hosts, smolfile: str, **kw: Any) -> Iterator[NetLab]:
    base = Path(tempfile.mkdtemp(prefix="smolbench-net-"))
    base.chmod(0o711)
    try:
        lab = NetLab(base, hosts, smolfile, **kw)
        try:
            yield lab
        finally:
            lab.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _allow_smolfile(h: Hosts) -> str:
    """127.0.0.0/31 lists 127.0.0.1 by a range: this host's own address, so still unreachable."""
    return (f'[network]\nallow_hosts = ["index.test:{h.allowed}"]\n'
            f'allow_cidrs = ["127.0.0.2/32:{h.allowed}", "127.0.0.1/32:{h.listed_bait}", "127.0.0.16/28", '
            f'"127.0.0.32/28:{h.port_ok}", "127.0.0.0/31"]\n')


# the listed ranges' stand-ins are far networks: no range reaches this host (test_net_hostonly.py)
RESOLVE = {"SMOLBENCH_TEST_RESOLVE": "index.test=127.0.0.2,other.test=127.0.0.3",
           "SMOLBENCH_TEST_FAR": "127.0.0.16/28,127.0.0.32/28"}


@pytest.fixture(scope="module")
def off(hosts: Hosts) -> Iterator[NetLab]:
    with _lab(hosts, "") as lab:
        yield lab


@pytest.fixture(scope="module")
def on(hosts: Hosts) -> Iterator[NetLab]:
    """`net = true` given by `%smol up --net` over a Smolfile that says off; 127.0.0.3 stands in
    for the internet."""
    with _lab(hosts, "net = false\n", up="--net on", env={"SMOLBENCH_TEST_INTERNET": "127.0.0.3/32", **RESOLVE}) as lab:
        yield lab


@pytest.fixture(scope="module")
def allow(hosts: Hosts) -> Iterator[NetLab]:
    with _lab(hosts, _allow_smolfile(hosts), env=RESOLVE) as lab:
        yield lab


@pytest.fixture(scope="module")
def shared(hosts: Hosts) -> Iterator[NetLab]:
    """Weakened: the machine shares the host's network (how the sandbox was before)."""
    with _lab(hosts, _allow_smolfile(hosts), weaken="net-share", env=RESOLVE) as lab:
        yield lab


@pytest.fixture(scope="module")
def open_proxy(hosts: Hosts) -> Iterator[NetLab]:
    """Weakened: the egress proxy admits every destination."""
    with _lab(hosts, _allow_smolfile(hosts), weaken="net-open", env=RESOLVE) as lab:
        yield lab


@pytest.fixture(scope="module")
def caps(hosts: Hosts) -> Iterator[NetLab]:
    """Weakened: cells keep CAP_NET_ADMIN and CAP_NET_RAW in the machine's network namespace."""
    with _lab(hosts, _allow_smolfile(hosts), weaken="net-caps", env=RESOLVE) as lab:
        yield lab


NODES = ("root", "root.0")


# -- off ------------------------------------------------------------------------------------------


def test_off_reaches_nothing(off: NetLab, shared: NetLab, hosts: Hosts) -> None:
    assert "network off (no network)" in off.up_text
    for node in NODES:
        got = off.probe(f"[raw('127.0.0.2', {hosts.allowed}), raw('127.0.0.3', {hosts.other}), "
                        f"tunnel('127.0.0.2', {hosts.allowed}), 'HTTPS_PROXY' in os.environ]", node)
        assert got == [False, False, False, False], node
        assert not any(off.host_services(node).values()), node
        assert off.probe(f"pip_download('http://127.0.0.2:{hosts.allowed}/simple')", node)["ok"] is False
    # the same probes see the host when the machine shares its network
    assert shared.probe(f"[raw('127.0.0.2', {hosts.allowed}), raw('127.0.0.3', {hosts.other})]") == [True, True]
    assert all(shared.host_services("root").values())


# -- on -------------------------------------------------------------------------------------------


def test_on_reaches_the_internet_but_not_the_host(on: NetLab, open_proxy: NetLab, hosts: Hosts) -> None:
    assert "set by %smol up, overriding" in on.up_text and "off (no network)" in on.up_text
    for node in NODES:
        assert on.probe(f"http('http://127.0.0.3:{hosts.other}/')", node) == "hello from 127.0.0.3"
        assert on.probe(f"http('http://other.test:{hosts.other}/')", node) == "hello from 127.0.0.3"
        refused = on.probe(f"http('http://127.0.0.2:{hosts.allowed}/')", node)  # this host's loopback
        assert refused.startswith("HTTP 403") and f"127.0.0.2:{hosts.allowed}" in refused and "on (the internet" in refused
        assert not any(on.host_services(node).values()), node
        pip = on.probe(f"pip_download('http://127.0.0.3:{hosts.other}/simple')", node)
        assert pip["ok"], pip["err"]
        # plain sockets too: to the internet (its stand-in), never to this host
        assert on.probe(f"[talk('127.0.0.3', {hosts.other}), talk('127.0.0.2', {hosts.allowed})]", node) == [
            "hello from 127.0.0.3", False]
    with contextlib.closing(sqlite3.connect(on.base / ".smolbench" / "ledger.db")) as db:
        (recorded,) = db.execute("SELECT network FROM sessions").fetchone()
    assert recorded.startswith("on (the internet") and "set by %smol up, overriding" in recorded
    # an egress proxy that admits everything: the same probes reach the host
    assert open_proxy.probe(f"http('http://127.0.0.3:{hosts.other}/')") == "hello from 127.0.0.3"
    assert all(open_proxy.host_services("root").values())


def _refused(status: str) -> int:
    found = re.search(r" ([0-9]+) refused", status)
    assert found, status
    return int(found.group(1))


def test_on_a_refused_plain_connection_names_the_host_and_the_policy(on: NetLab, hosts: Hosts) -> None:
    """Under `on` this host's loopback is the machine's own: nothing answers there, at once."""
    on.ok("%smol use root")
    err = error_text(on.nb.run(f"%%smol\nsocket.create_connection(('127.0.0.2', {hosts.allowed}), timeout=30)"))
    assert "ConnectionRefusedError" in err and f"smolbench: 127.0.0.2:{hosts.allowed} is not reachable" in err, err
    assert "network policy is on (the internet; not this host or private networks)" in err


# -- allow-lists ----------------------------------------------------------------------------------


def test_an_allow_list_reaches_only_what_it_lists(allow: NetLab, open_proxy: NetLab, shared: NetLab, hosts: Hosts) -> None:
    for node in NODES:
        got = allow.probe(f"[http('http://index.test:{hosts.allowed}/'), raw('127.0.0.2', {hosts.allowed}), "
                          f"raw('127.0.0.1', {hosts.listed_bait})]", node)
        assert got == ["hello from 127.0.0.2", True, True], node  # listed by name; by address and port
        unlisted = allow.probe(f"[http('http://127.0.0.3:{hosts.other}/'), raw('127.0.0.3', {hosts.other}), "
                               f"tunnel('127.0.0.2', {hosts.other}), http('http://other.test:{hosts.other}/')]", node)
        assert unlisted[0].startswith("HTTP 403") and f"127.0.0.3:{hosts.other}" in unlisted[0]
        assert "allow-list: index.test" in unlisted[0]
        assert unlisted[1:3] == [False, False] and unlisted[3].startswith("HTTP 403"), unlisted
        assert not any(allow.host_services(node).values()), node  # listed 127.0.0.1:port only
        pip = allow.probe(f"pip_download('http://index.test:{hosts.allowed}/simple', 'index.test')", node)
        assert pip["ok"], pip["err"]
        assert allow.probe(f"pip_download('http://127.0.0.3:{hosts.other}/simple')", node)["ok"] is False
    # a refused raw connection: one line inside names the host and the policy
    allow.ok("%smol use root")
    err = error_text(allow.nb.run(f"%%smol\nsocket.create_connection(('127.0.0.3', {hosts.other}), timeout=3)"))
    assert "ConnectionRefusedError" in err and f"smolbench: 127.0.0.3:{hosts.other} is not reachable" in err
    assert "network policy is allow-list: index.test" in err
    status = allow.status()
    assert "allow-list: index.test" in status and "egress proxy" in status
    assert re.search(r" [1-9][0-9]* refused \(last refused: 127\.0\.0\.\d:\d+\)", status), status
    # weakened: the unlisted host and the host's services answer
    assert open_proxy.probe(f"http('http://127.0.0.3:{hosts.other}/')") == "hello from 127.0.0.3"
    assert open_proxy.probe(f"pip_download('http://127.0.0.3:{hosts.other}/simple')")["ok"] is True
    assert shared.probe(f"raw('127.0.0.3', {hosts.other})") is True
    assert all(shared.host_services("root.0").values())


def test_plain_tcp_reaches_listed_networks_on_listed_ports_only(allow: NetLab, open_proxy: NetLab, hosts: Hosts) -> None:
    """Raw TCP to a listed range is redirected inside the machine to the host-side proxy, which
    decides: a range without a port on any port, a range with a port on that port only, and
    127.0.0.1 (this host's own, listed only by the range 127.0.0.0/31) never."""
    h = hosts
    for node in NODES:
        got = allow.probe(f"[talk('127.0.0.17', {h.range_a}), talk('127.0.0.17', {h.range_b}), "
                          f"talk('127.0.0.18', {h.range_c}), talk('127.0.0.33', {h.port_ok})]", node)
        assert got == ["hello from 127.0.0.17"] * 2 + ["hello from 127.0.0.18", "hello from 127.0.0.33"], (node, got)
        kernel = allow.nb.kernel_ports()[0]
        refused = allow.probe(f"[talk('127.0.0.33', {h.port_no}), talk('127.0.0.1', {h.bait}), "
                              f"talk('127.0.0.1', {kernel}), tunnel('127.0.0.1', {h.bait}), talk('127.0.0.3', {h.other})]", node)
        assert refused == [False] * 5, (node, refused)
    assert re.search(r"last refused: 127\.0\.0\.\d+:\d+", allow.status())
    # a refused raw connection fails in connect() itself (the machine's rules refuse it at once,
    # not a reset after the relay accepted), in one line naming the host and the policy; counted
    before = _refused(allow.status())
    allow.ok("%smol use root")
    err = error_text(allow.nb.run(f"%%smol\nsocket.create_connection(('127.0.0.33', {h.port_no}), timeout=30)"))
    assert "No route to host" in err and f"smolbench: 127.0.0.33:{h.port_no} is not reachable" in err, err
    assert "network policy is allow-list: index.test" in err
    assert _refused(allow.status()) == before + 1
    # weakened: a proxy that admits everything lets the unlisted port through the same redirect
    assert open_proxy.probe(f"talk('127.0.0.33', {h.port_no})") == "hello from 127.0.0.33"
    assert open_proxy.probe(f"tunnel('127.0.0.1', {h.bait})") is True


def test_a_branch_cannot_change_the_redirect(allow: NetLab, caps: NetLab, hosts: Hosts) -> None:
    for node in ("root.0", "root.1"):
        assert allow.probe("nft_tamper()", node) is False, node
        assert allow.probe(f"talk('127.0.0.17', {hosts.range_a})", node) == "hello from 127.0.0.17"  # still there
    # weakened: a cell with CAP_NET_ADMIN in its namespace rewrites the rules
    assert caps.probe(f"talk('127.0.0.17', {hosts.range_a})", "root.1") == "hello from 127.0.0.17"
    assert caps.probe("nft_tamper()", "root.1") is True
    assert caps.probe(f"talk('127.0.0.17', {hosts.range_a})", "root.1") is False


# -- a branch can't widen its policy ----------------------------------------------------------------


def test_a_branch_cannot_widen_its_policy(off: NetLab, on: NetLab, allow: NetLab, shared: NetLab, caps: NetLab,
                                          hosts: Hosts) -> None:
    attacks = (f"{{'userns': in_new_userns('127.0.0.1', {hosts.bait}, False), "
               f"'userns+netns': in_new_userns('127.0.0.1', {hosts.bait}, True), "
               f"'raw socket': raw_socket(), 'interface': net_admin(), 'ip route': ip_route(), "
               f"'proxy to its host side': tunnel('127.0.0.1', {hosts.bait}) or tunnel('127.0.0.1', 3128)}}")
    for lab in (off, on, allow):
        for node in ("root.0", "root.1"):
            got = lab.probe(attacks, node)
            assert not any(got.values()), (lab.up_text, node, got)
    # weakened set-ups, where the same attacks get through
    assert shared.probe(attacks, "root.0")["userns"] is True
    leaked = caps.probe(attacks, "root.0")
    assert leaked["raw socket"] is True and leaked["interface"] is True


def test_a_branch_cannot_reach_or_pose_as_another_machine(allow: NetLab, shared: NetLab) -> None:
    port = allow.probe("listen()", "root.0")
    assert allow.probe(f"raw('127.0.0.1', {port})", "root.0") is True  # it is there, for root.0 itself
    assert allow.probe(f"[raw('127.0.0.1', {port}), tunnel('127.0.0.1', {port})]", "root.1") == [False, False]
    port = shared.probe("listen()", "root.0")
    assert shared.probe(f"raw('127.0.0.1', {port})", "root.1") is True  # one shared network: it's there


def test_a_branch_of_a_branch_keeps_the_policy(allow: NetLab, hosts: Hosts) -> None:
    allow.ok("%smol use root.0")
    allow.ok("%%smol fork 1 --keep all --quiet\ny = 2")
    got = allow.probe(f"[http('http://index.test:{hosts.allowed}/'), http('http://127.0.0.3:{hosts.other}/')[:8], "
                      f"raw('127.0.0.1', {hosts.bait})]", "root.0.0")
    assert got == ["hello from 127.0.0.2", "HTTP 403", False]
