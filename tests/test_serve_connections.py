"""`smolbench serve`'s connection layer against untrusted network peers: its real uvicorn
stack (serve's server, ``_uvicorn``'s protocols, ``_asgi``'s guards) around a small app,
in a process of its own with a low open-file limit, so each attack takes seconds and no
machine. The second connection audit's findings, made into tests."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
from websockets.exceptions import ConnectionClosed  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from smolbench._uvicorn import peer  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

TOKEN = "t" * 20
WAIT = 60  # s before a test gives up on something that should happen (hang detection, not speed)

# serve._serve's stack around an app whose HTTP request opens a file (as a step's machine
# would) and whose WebSocket "step" waits until ClientWatch says its client is gone.
# argv: port, sessions, certfile or "", then Python run first (e.g. to lower a deadline).
SERVER = """
import asyncio, os, resource, sys, time
port, sessions, cert, before = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
import smolbench._uvicorn as u
exec(before)
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from smolbench import serve as S
from smolbench._asgi import CLIENT_GONE, BodyLimit, ClientWatch, Origins, SecretPath

async def opens(request):
    try:
        os.close(os.open("/dev/null", os.O_RDONLY))
        return PlainTextResponse("open ok")
    except OSError as e:
        return PlainTextResponse(str(e))

async def step(ws):
    await ws.accept()
    if (await ws.receive())["type"] == "websocket.disconnect":
        return
    start = time.monotonic()
    try:
        await asyncio.wait_for(asyncio.shield(CLIENT_GONE.get()), 20)
        print(f"step cut after {time.monotonic() - start:.1f} s", flush=True)
    except asyncio.TimeoutError:
        print("step not cut", flush=True)

app = Starlette(routes=[Route("/x", opens), WebSocketRoute("/ws", step)])
served = Origins(SecretPath(BodyLimit(ClientWatch(app), 1 << 20), "@TOKEN@"), set(), True)
cap = u.connection_cap(sessions)
http, ws = u.protocols(cap, 120.0, u.peer_cap(cap, sessions))
print("cap", cap, flush=True)
S._uvicorn_server()(uvicorn.Config(served, host="127.0.0.1", port=port, http=http, ws=ws, backlog=u.backlog(),
                                   log_level="warning", loop="asyncio", ws_max_size=1 << 20,
                                   ssl_certfile=cert or None, ssl_keyfile=cert or None)).run(sockets=S.listening("127.0.0.1", port))
""".replace("@TOKEN@", TOKEN)


class Server:
    def __init__(self, proc: subprocess.Popen[str], port: int, tls: ssl.SSLContext | None) -> None:
        self.proc, self.port, self.tls, self.lines = proc, port, tls, []

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def get(self, source: str = "127.0.0.1") -> str:
        """One request on a new connection from ``source``: the app's answer."""
        with self.client(source) as c:
            return request(c)

    @contextmanager
    def client(self, source: str = "127.0.0.1") -> Iterator[socket.socket]:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=WAIT, source_address=(source, 0))
        with contextlib.closing(self.tls.wrap_socket(s, server_hostname="127.0.0.1") if self.tls else s) as c:
            yield c


def request(c: socket.socket) -> str:
    """The app's answer to one kept-alive request on ``c``."""
    c.sendall(f"GET /{TOKEN}/x HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    got = b""
    while True:
        head, _, body = got.partition(b"\r\n\r\n")
        length = [int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
        if length and len(body) >= length[0]:
            return body.decode()
        chunk = c.recv(4096)
        if not chunk:
            raise ConnectionResetError(got)
        got += chunk


@contextmanager
def serving(folder: Path, sessions: int = 4, tls: bool = False, before: str = "") -> Iterator[Server]:
    cert = ""
    ctx = None
    if tls:
        import trustme

        ca = trustme.CA()
        issued = ca.issue_cert("127.0.0.1")
        cert = str(folder / "both.pem")
        issued.private_key_and_cert_chain_pem.write_to_path(cert)
        ctx = ssl.create_default_context()
        ca.configure_trust(ctx)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(sessions), cert, before], cwd=folder,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    server = Server(proc, port, ctx)
    reader = threading.Thread(target=lambda: server.lines.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        deadline = time.monotonic() + WAIT
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, server.out
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        yield server
    finally:
        proc.kill()
        proc.wait(30)
        reader.join(10)


def silent(port: int, n: int, source: str = "127.0.0.1") -> list[socket.socket]:
    """``n`` connections that send nothing, paced so the small listen queue never overflows."""
    made = []
    for _ in range(n):
        s = socket.socket()
        s.bind((source, 0))
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        made.append(s)
        time.sleep(0.004)
    return made


def closed(s: socket.socket) -> bool:
    """Whether the server closed ``s`` (without waiting)."""
    if not select.select([s], [], [], 0)[0]:
        return False
    try:
        return s.recv(1) == b""
    except OSError:
        return True


def test_over_tls_silent_connections_are_counted_from_their_accept_so_the_server_keeps_its_files(tmp_path: Path) -> None:
    """Audit: asyncio hands a TLS connection to uvicorn's protocol (and the cap) only once
    its handshake is done: connections that never sent a hello were uncounted and ran the
    server out of files (an open() in a live request failed, accept() errors in a loop)."""
    with serving(tmp_path, tls=True, before="u.FIRST_BYTE_TIMEOUT = 30.0") as server:
        cap = int(server.out.split("cap ")[1].split()[0])  # (128 - 64 - 4 x 4) / 2 = 24
        with server.client() as kept:
            assert request(kept) == "open ok"
            flood = silent(server.port, 150)
            time.sleep(2)
            assert request(kept) == "open ok"  # the server still has the files it needs
            open_now = [s for s in flood if not closed(s)]
            assert len(open_now) <= cap, (len(open_now), cap)  # the rest closed at once
        for s in flood:
            s.close()
        assert server.get() == "open ok"
    assert "Too many open files" not in server.out and "Traceback" not in server.out, server.out


@pytest.mark.parametrize("tls", [False, True])
def test_a_connection_that_sends_nothing_is_closed_by_the_first_byte_deadline(tmp_path: Path, tls: bool) -> None:
    """Audit: a silent connection was kept for the whole header deadline (10 s), so one peer
    could hold many for long. It now has FIRST_BYTE_TIMEOUT (1 s here) for its first byte
    (over TLS, its whole handshake); one that started a request has the header deadline."""
    with serving(tmp_path, tls=tls, before="u.FIRST_BYTE_TIMEOUT = 1.0\nu.HEADER_TIMEOUT = 30.0") as server:
        quiet, started = silent(server.port, 1)[0], socket.create_connection(("127.0.0.1", server.port))
        started.sendall(b"\x16\x03\x01\x02\x00\x01" if tls else b"GET ")
        t = time.monotonic()
        while not closed(quiet):
            assert time.monotonic() - t < 15, "a silent connection outlived the first-byte deadline"
            time.sleep(0.1)
        if not tls:  # over TLS the whole handshake has the first-byte deadline
            time.sleep(1.5)
            assert not closed(started)
        assert server.get() == "open ok"
        quiet.close()
        started.close()


def test_one_address_cannot_hold_every_connection_but_this_host_s_clients_are_not_capped_apart(tmp_path: Path) -> None:
    """Audit: one peer filled the whole cap with silent connections, held for the header
    deadline, and every other client was refused. Now one address has at most
    ``peer_cap`` (12 here, of 24); loopback's clients (a local trainer's many workers, all
    127.0.0.1) count only in all. Here 127.0.0.2 and 127.0.0.3 stand for two remote hosts."""
    remote = ("def peer(transport, _peer=u.peer):\n"
              "    host = transport.get_extra_info('peername')[0]\n"
              "    return host if host in ('127.0.0.2', '127.0.0.3') else _peer(transport)\n"
              "u.peer = peer\nu.FIRST_BYTE_TIMEOUT = 30.0\nu.HEADER_TIMEOUT = 30.0\n")
    with serving(tmp_path, before=remote) as server:
        flood = silent(server.port, 40, source="127.0.0.2")
        time.sleep(2)
        held = [s for s in flood if not closed(s)]
        assert len(held) == 12, len(held)
        assert server.get("127.0.0.3") == "open ok"  # another host is served
        local = silent(server.port, 11)  # loopback: past the per-address cap, within the cap in all
        time.sleep(1)
        assert not any(closed(s) for s in local)
        assert server.get() == "open ok"
        for s in flood + local:
            s.close()
        time.sleep(0.5)
        assert server.get("127.0.0.2") == "open ok"  # its connections closed: it is served again
    assert server.out.count("127.0.0.2 has 12 connections open") == 1, server.out


def test_peers_are_counted_by_address_and_ipv6_hosts_by_their_64() -> None:
    class T:
        def __init__(self, name: Any) -> None:
            self.name = name

        def get_extra_info(self, key: str) -> Any:
            return self.name

    assert peer(T(("203.0.113.9", 5))) == "203.0.113.9"
    assert peer(T(("::ffff:203.0.113.9", 5, 0, 0))) == "203.0.113.9"
    assert peer(T(("2001:db8:1:2:aaaa::1", 5, 0, 0))) == peer(T(("2001:db8:1:2:ffff::9", 6, 0, 0))) == "2001:db8:1:2::/64"
    assert peer(T(("2001:db8:1:3::1", 5, 0, 0))) != peer(T(("2001:db8:1:2::1", 5, 0, 0)))
    assert peer(T(("fe80::1%eth0", 5, 0, 2))) == "fe80::/64"
    for local in (("127.0.0.1", 5), ("127.9.0.1", 5), ("::1", 5, 0, 0), ("::ffff:127.0.0.1", 5, 0, 0)):
        assert peer(T(local)) is None
    assert peer(T(None)) is None and peer(T("/run/sock")) is None


@pytest.mark.parametrize("then", ["leaves", "waits", "sends big ones"])
def test_a_step_is_cut_when_its_client_sent_more_during_it_and_left_or_too_much(tmp_path: Path, then: str) -> None:
    """Audit: a client that sent more than 4 messages during a step and then left was never
    seen to leave: ClientWatch's reader waited for room in its queue, reading nothing more,
    so the step ran its whole request timeout holding a machine. Now it reads on: a client
    gone is seen at once, and one with more in flight than it may queue (256 messages, or
    --max-message bytes in all) is closed (1008) and its step cut."""
    with serving(tmp_path) as server:
        ws = connect(f"ws://127.0.0.1:{server.port}/{TOKEN}/ws", max_size=None)
        ws.send('{"type": "step", "data": {"action": 0}}')
        time.sleep(0.5)  # the step runs
        if then == "leaves":
            for _ in range(6):
                ws.send('{"type": "state"}')
            time.sleep(0.2)
            ws.socket.close()
        else:
            for _ in range(300 if then == "waits" else 3):
                ws.send('{"type": "state"}' if then == "waits" else "x" * 600_000)
            with pytest.raises(ConnectionClosed) as closing:
                ws.recv(WAIT)
            assert closing.value.rcvd is not None and closing.value.rcvd.code == 1008
            assert closing.value.rcvd.reason == "too many messages in flight"
        t = time.monotonic()
        while "step " not in server.out:
            assert time.monotonic() - t < 30, server.out
            time.sleep(0.1)
        assert "step cut after" in server.out, server.out
        assert float(server.out.split("step cut after ")[1].split()[0]) < 5, server.out
        ws.close()
