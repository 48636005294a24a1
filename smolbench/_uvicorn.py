"""uvicorn's HTTP and WebSocket protocols for ``smolbench serve``, with what uvicorn leaves
to a proxy in front of it: deadlines for a request's headers and for its body, a cap on open
connections, and a bound on a reply its client does not read.

``protocols(cap, send_timeout)`` gives the classes for ``uvicorn.Config(http=..., ws=...)``;
the two share one count, so a WebSocket connection stays counted while it is open.
"""

from __future__ import annotations

import asyncio
import resource
import sys
import time
from typing import Any

# s from a connection's accept (or its previous response) to a request's complete headers.
# A client sends its few hundred bytes of headers in one write as it connects; 10 s is
# ample for a slow link, and short enough that idle or trickling connections (slowloris)
# can't pile up to the open-file limit.
HEADER_TIMEOUT = 10.0
# s from a request's complete headers to its complete body. Bodies here are an action or a
# reset's options, at most --max-message (1 MiB by default): seconds even on a slow link. A
# body that trickles (slowloris after the headers) is cut, and its handler sees its client gone.
BODY_TIMEOUT = 30.0
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
    """The connections one server has open now, HTTP and WebSocket."""

    def __init__(self, cap: int) -> None:
        self.cap, self.count, self.warned = cap, 0, -WARN_EVERY

    def refused(self) -> None:
        now = time.monotonic()
        if now - self.warned >= WARN_EVERY:  # one line per flood, not one per connection
            self.warned = now
            print(f"smolbench serve: warning: {self.count} connections open (the most it takes): "
                  "refusing new ones until some close", file=sys.stderr, flush=True)


def protocols(cap: int, send_timeout: float) -> tuple[type[asyncio.Protocol], type[asyncio.Protocol]]:
    """The HTTP (h11) and WebSocket protocol classes of one server: at most ``cap``
    connections open (the next closed at once), each request's headers complete within
    :data:`HEADER_TIMEOUT` and its body :data:`BODY_TIMEOUT` after them, and a connection
    whose client leaves a reply unread for ``send_timeout`` s aborted (its handler then sees
    its client gone)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

    conns = _Open(cap)

    class Stuck(asyncio.Protocol):
        """Aborts the connection once its writes stayed paused ``send_timeout`` s: asyncio
        pauses them when the client reads no more, and uvicorn's send (and close, and a
        keepalive ping's close) then waits for good."""

        transport: asyncio.Transport
        _stuck: asyncio.TimerHandle | None = None

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

        def connection_made(self, transport: Any) -> None:
            if conns.count >= conns.cap:  # not in uvicorn's state: nothing of it is kept
                self._refused = True
                conns.refused()
                transport.abort()
                return
            conns.count += 1
            super().connection_made(transport)
            self._arm_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            conns.count -= 1
            self._disarm_deadline()
            self._disarm_stuck()
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
            self._upgraded = True  # the connection, and its count, go to the WebSocket protocol
            self._disarm_deadline()
            self._disarm_stuck()
            super().handle_websocket_upgrade(event)

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
            conns.count -= 1
            self._disarm_stuck()
            super().connection_lost(exc)

        async def run_asgi(self) -> None:
            await super().run_asgi()
            if not self.disconnected:  # closing: a client that reads nothing more would keep it open
                self._arm_stuck()

    return Http, WebSocket
