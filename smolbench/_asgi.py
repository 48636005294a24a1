"""ASGI guards in front of ``smolbench serve``'s app: who may reach it, how big a request
may be, and whether a WebSocket's client is still there while its request runs.

Each wraps OpenEnv's FastAPI app without changing it (``serve.py`` stacks them).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ipaddress
import json
import secrets
from typing import Any

# Set by ClientWatch for a request's handler: done once its client is gone (a future, not
# an Event: a request waits on it with no task of its own).
CLIENT_GONE: contextvars.ContextVar[asyncio.Future[None] | None] = contextvars.ContextVar("smolbench_client_gone",
                                                                                          default=None)
# True for an HTTP request's handler (a session of one request), False for a WebSocket's.
ONE_REQUEST: contextvars.ContextVar[bool] = contextvars.ContextVar("smolbench_one_request", default=False)


class BodyLimit:
    """ASGI middleware: an HTTP request whose body is over ``limit`` bytes gets a 413 with one
    line, refused by its Content-Length before it is read, or once that much streamed in (the
    app then sees the client gone). WebSocket messages are uvicorn's ``ws_max_size``."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        why = f"the request body is over {self.limit:,} bytes (smolbench serve --max-message)"
        for key, value in scope.get("headers", ()):
            if key == b"content-length":
                if not value.isdigit() or int(value) > self.limit:
                    return await _refuse(send, 413, why)
        seen = 0
        refused = started = False

        async def limited() -> dict[str, Any]:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    refused = True
                    if not started:
                        await _refuse(send, 413, why)
                    return {"type": "http.disconnect"}
            return dict(msg)

        async def sending(msg: dict[str, Any]) -> None:
            nonlocal started
            if refused:
                return  # the 413 went out: nothing of the app's answer follows it
            started = True
            await send(msg)

        try:
            await self.app(scope, limited, sending)
        except Exception:
            if not refused:
                raise


class Origins:
    """ASGI middleware: a request with an ``Origin`` header (a browser's: a web page's script
    or form) is refused unless that origin is allowed, and, when ``local``, one whose
    ``Host`` is not a loopback name or address (a DNS rebinding page's). Browsers apply no
    same-origin rule to WebSockets, nor to a form's POST: any page the operator visits could
    reach a server on loopback. OpenEnv's client sends no ``Origin``."""

    def __init__(self, app: Any, allowed: set[str], local: bool) -> None:
        self.app, self.allowed, self.local = app, {o.encode() for o in allowed}, local

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        why = None
        for key, value in scope.get("headers", ()):
            if key == b"origin" and value.lower().rstrip(b"/") not in self.allowed:
                why = "requests from web pages are refused (smolbench serve --allow-origin)"
            elif key == b"host" and self.local and not loopback_host(value):
                why = "this server answers only to a loopback Host (localhost, 127.0.0.1, [::1])"
        if why is None:
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        return await _refuse(send, 403, why)


def loopback_host(value: bytes) -> bool:
    """Whether a ``Host`` header names this host's loopback (any port)."""
    host = value.decode("latin-1")
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return loopback_name(host)


def loopback_name(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this host's loopback."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: whatever it resolves to


class SecretPath:
    """ASGI middleware: only requests under ``/<token>/`` reach the app (the token taken off
    the path); any other gets a 404, or its WebSocket handshake a 403, before the app or a
    body is read. OpenEnv's client sends no credentials but keeps its base URL's path
    (``http://host:port/<token>`` -> ``ws://host:port/<token>/ws``), so the token is the
    URL's, as a Jupyter server's is."""

    def __init__(self, app: Any, token: str) -> None:
        self.app, self.token = app, token.encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        first, _, rest = path[1:].partition("/")
        if not secrets.compare_digest(first.encode("utf-8", "replace"), self.token):
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 1008})
            return await _refuse(send, 404, "not found")
        inner = dict(scope, path="/" + rest, root_path=scope.get("root_path", "") + "/" + first)
        raw = scope.get("raw_path")
        if isinstance(raw, bytes):
            inner["raw_path"] = raw[len(first) + 1:] or b"/"
        await self.app(inner, receive, send)


class ClientWatch:
    """ASGI middleware: a WebSocket connection's messages are read as they come, so its
    handler learns the client is gone (:data:`CLIENT_GONE`) while a step still runs. OpenEnv's
    handler reads the next message only once a step returned: a client gone mid-step held its
    session, and its slot, until the request timeout. Read ahead: at most :attr:`QUEUED`
    messages and ``limit`` bytes (``--max-message``) in all; one more, and the connection is
    closed (1008, :attr:`TOO_MANY`) and its step cut. Waiting for room instead would stop
    reading the connection (uvicorn reads the next frame only once one is taken), and so
    noticing its client leave. OpenEnv's client sends one message and waits for its answer.
    An HTTP request's connection is watched once its body is read (uvicorn then says
    ``http.disconnect`` when it closes)."""

    QUEUED = 256  # messages read ahead at most
    TOO_MANY = "too many messages in flight"

    def __init__(self, app: Any, limit: int = 1 << 20) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            return await self._http(scope, receive, send)
        if scope["type"] != "websocket":
            return await self.app(scope, receive, send)
        gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def went() -> None:
            _settle(gone)

        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        last: dict[str, Any] = {}
        held = 0  # bytes of the messages in the queue

        async def pump() -> None:
            nonlocal held
            while True:
                try:
                    msg = await receive()
                except Exception:  # the connection broke some other way: to the handler, it is gone
                    msg = {"type": "websocket.disconnect", "code": 1006}
                if msg["type"] == "websocket.disconnect":
                    went()
                elif queue.qsize() >= self.QUEUED or held + _size(msg) > self.limit:
                    went()  # the client is cut: nobody is there for the answers to what it sent
                    with contextlib.suppress(Exception):
                        await send({"type": "websocket.close", "code": 1008, "reason": self.TOO_MANY})
                    while not queue.empty():
                        queue.get_nowait()
                    held, msg = 0, {"type": "websocket.disconnect", "code": 1008, "reason": self.TOO_MANY}
                held += _size(msg)
                queue.put_nowait(msg)
                if msg["type"] == "websocket.disconnect":
                    return

        async def received() -> dict[str, Any]:
            nonlocal held
            if last:  # the handler asks again after the disconnect: it stays disconnected
                return last
            msg = await queue.get()
            held -= _size(msg)
            if msg["type"] == "websocket.disconnect":
                last.update(msg)
            return msg

        async def sending(msg: dict[str, Any]) -> None:
            if gone.done():
                return  # nobody to send to: the handler's answer to a cut step, its close
            try:
                await send(msg)
            except OSError:  # uvicorn's ClientDisconnected: gone before the reader saw it
                went()

        reader = asyncio.ensure_future(pump())
        token = CLIENT_GONE.set(gone)
        try:
            await self.app(scope, received, sending)
        finally:
            CLIENT_GONE.reset(token)
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader

    async def _http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        watch: asyncio.Future[dict[str, Any]] | None = None

        async def watching() -> dict[str, Any]:
            msg = dict(await receive())
            if msg["type"] == "http.disconnect":
                _settle(gone)
            return msg

        async def received() -> dict[str, Any]:
            nonlocal watch
            if watch is not None:  # the body is in: what comes next is the watch's (a disconnect)
                return dict(await asyncio.shield(watch))
            msg = await watching()
            if msg["type"] != "http.disconnect" and not msg.get("more_body", False):
                watch = asyncio.ensure_future(watching())
            return msg

        token, one = CLIENT_GONE.set(gone), ONE_REQUEST.set(True)
        try:
            await self.app(scope, received, send)
        finally:
            ONE_REQUEST.reset(one)
            CLIENT_GONE.reset(token)
            if watch is not None:
                watch.cancel()
                with contextlib.suppress(BaseException):
                    await watch


def _size(msg: dict[str, Any]) -> int:
    """A WebSocket message's payload, in characters or bytes."""
    return len(msg.get("text") or "") + len(msg.get("bytes") or b"")


def _settle(gone: asyncio.Future[None]) -> None:
    """Its client is gone (said once)."""
    if not gone.done():
        gone.set_result(None)


async def _refuse(send: Any, status: int, why: str) -> None:
    body = json.dumps({"detail": why}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
