"""uvicorn's HTTP and WebSocket protocols for ``smolbench serve``, with what uvicorn leaves
to a proxy in front of it: deadlines for a connection's first byte, a request's headers and
its body, caps on open connections (in all and per client address), and a bound on a reply
its client does not read.

``protocols(cap, send_timeout, per_peer)`` gives the classes for ``uvicorn.Config(http=...,
ws=...)``; the two share one count, so a WebSocket connection stays counted while it is
open. ``Http.accepting(factory, ssl)`` wraps uvicorn's protocol factory for
``loop.create_server``: a connection is counted (or refused) as soon as it is accepted, and
over TLS its handshake runs after that (``loop.start_tls``), not before it as asyncio's own
``create_server(ssl=...)`` does, where nothing of ours saw a connection until its handshake
was done.
"""

from __future__ import annotations

import asyncio
import ipaddress
import resource
import sys
import time
from typing import Any

# s from a connection's accept (over TLS, its handshake's end; or its previous response) to a
# request's complete headers.
# A client sends its few hundred bytes of headers in one write as it connects; 10 s is
# ample for a slow link, and short enough that idle or trickling connections (slowloris)
# can't pile up to the open-file limit.
HEADER_TIMEOUT = 10.0
# s from a request's complete headers to its complete body. Bodies here are an action or a
# reset's options, at most --max-message (1 MiB by default): seconds even on a slow link. A
# body that trickles (slowloris after the headers) is cut, and its handler sees its client gone.
BODY_TIMEOUT = 30.0
# s from a connection's accept to its first byte; over TLS, to its handshake's end (a client
# sends its hello, or its request, as it connects: a round trip or two even on a slow link).
# A connection that says nothing is closed sooner than by the header deadline.
FIRST_BYTE_TIMEOUT = 5.0
MAX_CONNECTIONS = 1024  # open at once, at most (and at most half the files the sessions leave)
WARN_EVERY = 60.0  # s between two lines saying connections are refused


def _files() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else int(soft)


# Files the server holds besides its clients' connections: its own (Python's, the warm
# parent's connections, the listening socket), and per session. A session was measured at 2
# (its WebSocket, its machine's kept connection); counted twice, for a fresh reset's next machine.
FILES_OWN = 64
FILES_PER_SESSION = 4
MIN_CONNECTIONS = 8


def connection_cap(sessions: int) -> int:
    """The connections open at once the server takes: at most half of RLIMIT_NOFILE once
    ``sessions`` sessions' machines have theirs, so those files and the listening socket's
    accept() always have room."""
    left = _files() - FILES_OWN - FILES_PER_SESSION * sessions
    return max(1, min(MAX_CONNECTIONS, left // 2))


def peer_cap(cap: int, sessions: int) -> int:
    """The connections one client address (an IPv6 /64) may have open at once: an eighth of
    ``cap``, and at least room for all ``sessions`` sessions and a few requests besides (a
    trainer's workers behind one address)."""
    return min(cap, max(cap // 8, sessions + MIN_CONNECTIONS))


def peer(transport: Any) -> str | None:
    """The address a connection is counted under: its IPv4 address, or its IPv6 /64 (one
    host's usual share). None, counted only in all, for loopback (this host's own clients,
    all 127.0.0.1: many workers of a local trainer, or a proxy in front) and an unknown peer."""
    name = transport.get_extra_info("peername")
    try:
        ip = ipaddress.ip_address(str(name[0]).partition("%")[0])
    except (TypeError, ValueError, IndexError):
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def too_few_files(sessions: int) -> str | None:
    """One line if RLIMIT_NOFILE can't hold ``sessions`` sessions and a few connections."""
    need = FILES_OWN + FILES_PER_SESSION * sessions + 2 * MIN_CONNECTIONS
    if _files() >= need:
        return None
    return (f"--max-sessions {sessions} needs about {need} open files and this process may have {_files()}: "
            f"raise the limit (`ulimit -n {max(1024, 2 * need)}`) or give fewer --max-sessions")


def backlog() -> int:
    """uvicorn's ``backlog``: asyncio accepts that many connections at once before any
    protocol sees one, so a few such batches must fit in the files the cap leaves."""
    return max(8, min(2048, _files() // 16))


class _Open:
    """The connections one server has open now, HTTP and WebSocket, in all and per address."""

    def __init__(self, cap: int, per_peer: int) -> None:
        self.cap, self.per_peer, self.count = cap, per_peer, 0
        self.by_peer: dict[str, int] = {}
        self.warned = {"all": -WARN_EVERY, "peer": -WARN_EVERY}

    def admit(self, transport: Any) -> _Ticket | None:
        """A new connection's ticket, or None when it is one too many (then closed at once)."""
        key = peer(transport)
        if self.count >= self.cap:
            self._warn("all", f"{self.count} connections open (the most it takes): refusing new ones until some close")
            return None
        if key is not None and self.by_peer.get(key, 0) >= self.per_peer:
            self._warn("peer", f"{key} has {self.per_peer} connections open (the most one address may have): "
                               "refusing its new ones until some close")
            return None
        self.count += 1
        if key is not None:
            self.by_peer[key] = self.by_peer.get(key, 0) + 1
        return _Ticket(self, key)

    def _warn(self, kind: str, what: str) -> None:
        now = time.monotonic()
        if now - self.warned[kind] >= WARN_EVERY:  # one line per flood, not one per connection
            self.warned[kind] = now
            print(f"smolbench serve: warning: {what}", file=sys.stderr, flush=True)


class _Ticket:
    """One open connection's place in the count: given back once, by whichever protocol
    (the gate, HTTP, or the WebSocket it became) sees the connection end."""

    def __init__(self, conns: _Open, key: str | None) -> None:
        self.conns, self.key, self.held = conns, key, True

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        self.conns.count -= 1
        if self.key is not None:
            left = self.conns.by_peer[self.key] - 1
            if left:
                self.conns.by_peer[self.key] = left
            else:
                del self.conns.by_peer[self.key]


def protocols(cap: int, send_timeout: float,
              per_peer: int | None = None) -> tuple[type[asyncio.Protocol], type[asyncio.Protocol]]:
    """The HTTP (h11) and WebSocket protocol classes of one server: at most ``cap``
    connections open, and ``per_peer`` from one address (see :func:`peer`; default ``cap``),
    the next closed at once; each connection's first byte within :data:`FIRST_BYTE_TIMEOUT`,
    each request's headers within :data:`HEADER_TIMEOUT` and its body :data:`BODY_TIMEOUT`
    after them, and a connection whose client leaves a reply unread for ``send_timeout`` s
    aborted (its handler then sees its client gone)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

    conns = _Open(cap, cap if per_peer is None else per_peer)

    class Gate(asyncio.Protocol):
        """A connection from its accept: counted, or refused and closed, at once; then given
        to uvicorn's protocol, over TLS once its handshake is done (within
        :data:`FIRST_BYTE_TIMEOUT`: else start_tls closes it)."""

        def __init__(self, make: Any, tls: Any) -> None:
            self.make, self.tls = make, tls
            self.ticket: _Ticket | None = None
            self.early: list[bytes] = []
            self.ended = False
            self.handshake: asyncio.Future[None] | None = None

        def connection_made(self, transport: Any) -> None:
            self.ticket = conns.admit(transport)
            if self.ticket is None:
                transport.abort()
            elif self.tls is None:
                self._hand(transport)
            else:
                self.handshake = asyncio.ensure_future(self._start_tls(transport))

        async def _start_tls(self, transport: Any) -> None:
            assert self.ticket is not None
            tls = None
            try:
                tls = await asyncio.get_running_loop().start_tls(transport, self, self.tls, server_side=True,
                                                                 ssl_handshake_timeout=FIRST_BYTE_TIMEOUT)
            except Exception:
                pass  # start_tls closed it: no hello in time, not TLS, or its client left
            finally:
                if tls is None:  # (or the server stopping cancelled the handshake)
                    self.ticket.release()
            if tls is None:
                return
            if self.ended or tls.is_closing():  # gone between its handshake's end and now
                self.ticket.release()
                tls.abort()
                return
            self._hand(tls)

        def _hand(self, transport: Any) -> None:
            protocol = self.make()
            protocol._ticket = self.ticket
            transport.set_protocol(protocol)
            protocol.connection_made(transport)
            if self.early:  # what came with its handshake's last message
                protocol.data_received(b"".join(self.early))

        def data_received(self, data: bytes) -> None:
            self.early.append(data)

        def connection_lost(self, exc: Exception | None) -> None:
            self.ended = True
            if self.ticket is not None:
                self.ticket.release()

    class Stuck(asyncio.Protocol):
        """Aborts the connection once its writes stayed paused ``send_timeout`` s: asyncio
        pauses them when the client reads no more, and uvicorn's send (and close, and a
        keepalive ping's close) then waits for good."""

        transport: asyncio.Transport
        _stuck: asyncio.TimerHandle | None = None
        _ticket: _Ticket | None = None

        def pause_writing(self) -> None:
            super().pause_writing()
            self._arm_stuck()

        def resume_writing(self) -> None:
            super().resume_writing()
            self._disarm_stuck()

        def _arm_stuck(self) -> None:
            if self._stuck is None:
                self._stuck = asyncio.get_running_loop().call_later(send_timeout, self.transport.abort)

        def _disarm_stuck(self) -> None:
            if self._stuck is not None:
                self._stuck.cancel()
                self._stuck = None

    class Http(Stuck, H11Protocol):
        _refused = _upgraded = _in_body = False
        _deadline: asyncio.TimerHandle | None = None
        _first: asyncio.TimerHandle | None = None

        @staticmethod
        def accepting(make: Any, tls: Any) -> Any:
            """For ``loop.create_server(..., ssl=None)`` in place of ``make`` and ``ssl=tls``."""
            return lambda: Gate(make, tls)

        def connection_made(self, transport: Any) -> None:
            if self._ticket is None:  # not through accepting(): counted here (never over TLS: see Gate)
                self._ticket = conns.admit(transport)
                if self._ticket is None:  # not in uvicorn's state: nothing of it is kept
                    self._refused = True
                    transport.abort()
                    return
            super().connection_made(transport)
            self._arm_headers()
            self._first = self.loop.call_later(FIRST_BYTE_TIMEOUT, self.transport.abort)

        def data_received(self, data: bytes) -> None:
            if self._first is not None:
                self._first.cancel()
                self._first = None
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            assert self._ticket is not None
            self._ticket.release()
            self._disarm_deadline()
            self._disarm_stuck()
            if self._first is not None:
                self._first.cancel()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self._upgraded or self.conn.their_state is h11.IDLE:
                return
            if self.conn.their_state is h11.SEND_BODY:  # its headers are in, its body is coming
                if not self._in_body:
                    self._in_body = True
                    self._disarm_deadline()
                    self._arm(BODY_TIMEOUT)
            else:  # the whole request is in (or the connection is ending)
                self._in_body = False
                self._disarm_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm_headers()  # the next request's (keep-alive's own timer stops at its first byte)

        def handle_websocket_upgrade(self, event: Any) -> None:
            self._upgraded = True  # the connection, and its ticket, go to the WebSocket protocol
            self._disarm_deadline()
            self._disarm_stuck()
            super().handle_websocket_upgrade(event)
            ws = self.transport.get_protocol()
            if isinstance(ws, WebSocket):
                ws._ticket = self._ticket

        def _arm_headers(self) -> None:
            self._arm(HEADER_TIMEOUT)

        def _arm(self, seconds: float) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(seconds, self._too_slow)

        def _disarm_deadline(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            self.transport.abort()  # nothing to say: no request came, or not all of it

    class WebSocket(Stuck, WebSocketsSansIOProtocol):
        """Made only by :class:`Http`'s upgrade, so its connection is counted already."""

        def connection_lost(self, exc: Exception | None) -> None:
            if self._ticket is not None:
                self._ticket.release()
            self._disarm_stuck()
            super().connection_lost(exc)

        async def run_asgi(self) -> None:
            await super().run_asgi()
            if not self.disconnected:  # closing: a client that reads nothing more would keep it open
                self._arm_stuck()

    return Http, WebSocket
