"""What the network tests share: a tiny HTTP server handler a machine reaches (or must not), a
far end that holds connections, and a machine's proxy listener and tunnels through it."""

from __future__ import annotations

import asyncio
import http.server
import socket
import threading
from collections.abc import Iterator
from typing import Any

from smolbench.backends import _netproxy
from smolbench.netpolicy import NetPolicy


def hello_handler(body: bytes) -> type[http.server.BaseHTTPRequestHandler]:
    """A handler that answers every GET with ``body`` and logs nothing."""

    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    return Hello


def held_sink(host: str) -> Iterator[int]:
    """A far end on ``host`` that accepts, holds every connection open and never reads or says
    anything (a fixture's body: yields its port)."""
    srv = socket.socket()
    srv.bind((host, 0))
    srv.listen(1024)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join()
    for s in held:
        s.close()
    srv.close()


async def proxy_listener(proxy: _netproxy.Proxy, name: str, policy: NetPolicy, tree: str | None = None) -> int:
    """A machine's proxy listener (on this host), in ``tree``: its port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1024)
    port = listener.getsockname()[1]
    await proxy.serve(name, policy, [listener], [("127.0.0.1", port)], tree)
    return int(port)


async def tunnel(port: int, target: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """A CONNECT to ``target`` through the listener at ``port``: the streams and the answer's head."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())
    try:
        answer = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 60)
    except (asyncio.IncompleteReadError, ConnectionError):
        answer = b""
    return r, w, answer


async def let_go(proxy: Any, ports: Any, *tunnel_lists: Any) -> None:
    """Abort every tunnel of ``tunnel_lists`` (each a list of (reader, writer, answer)) and detach
    the machines ``ports`` from ``proxy``: a test's end, whatever it found."""
    for tunnels in tunnel_lists:
        for _, w, _ in tunnels:
            w.transport.abort()
    for n in ports:
        await proxy.detach(n)
