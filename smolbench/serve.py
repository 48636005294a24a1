"""``smolbench serve``: a machine-backed environment over OpenEnv's protocol, until stopped.

``smolbench serve envs.py:make_env`` runs ``envs.py`` in a warm machine (a Session from
the Smolfile), builds the env ``make_env()`` returns there, and serves it with OpenEnv's
own app on loopback; ``smolbench serve --gym CartPole-v1`` serves a registered Gymnasium
env. Each client session gets its own branch of the warm parent; Ctrl-C or SIGTERM stops
the server and deletes every machine it made.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import math
import os
import re
import secrets
import socket
import ssl
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._asgi import loopback_name
from ._uvicorn import backlog
from .errors import RemoteError, SmolbenchError

TARGET = re.compile(r"(?P<file>.+\.py):(?P<name>[A-Za-z_][A-Za-z0-9_]*)")
STOP_WAIT = 5  # s Ctrl-C / SIGTERM lets open requests finish before they are cancelled


def env_for(args: argparse.Namespace) -> tuple[str | None, str | Callable[..., Any]]:
    """The code to run in the warm machine first (None: none), and the env: the name of its
    factory there, or (``--gym``) the factory smolbench.gym sends in for a registered id."""
    if args.gym:
        if args.target:
            raise SmolbenchError("give either FILE.py:NAME or --gym ID, not both")
        from .gym.registered import gymnasium_make

        try:
            return None, gymnasium_make(args.gym)
        except SmolbenchError as exc:
            raise SmolbenchError(f"--gym {exc}") from None
    m = TARGET.fullmatch(args.target or "")
    file, colon, name = (args.target or "").rpartition(":")
    if m is None and colon and file.endswith(".py"):  # a file, and after ':' something that is no plain name
        head = re.match(r"[A-Za-z_][A-Za-z0-9_]*", name)
        like = f"{file}:{head[0] if head else 'make_env'}"
        raise SmolbenchError(f"{args.target}: the part after ':' must be a plain name, a zero-argument callable defined "
                             f"at the top level of {file} that makes the env (e.g. {like}; wrap anything else in a "
                             "function there)")
    if m is None:
        raise SmolbenchError("say what to serve: FILE.py:NAME (a file run in the machine, NAME its zero-argument "
                             "env factory) or --gym ID (e.g. --gym CartPole-v1)")
    path = Path(m["file"])
    if not path.is_file():
        raise SmolbenchError(f"no file {path}: give the Python file that defines {m['name']}")
    return path.read_text(), m["name"]


def check_limits(args: argparse.Namespace) -> None:
    """The server's limits make sense, else a one-line error before anything starts."""
    for opt, value in (("--request-timeout", args.request_timeout), ("--idle-timeout", args.idle_timeout)):
        if not math.isfinite(value) or value <= 0:
            raise SmolbenchError(f"{opt} should be a number of seconds above 0, got {value:g}")
    if args.idle_timeout < args.request_timeout:
        raise SmolbenchError(f"--idle-timeout ({args.idle_timeout:g} s) should be at least --request-timeout "
                             f"({args.request_timeout:g} s): a session would be closed while a step still runs")
    if args.max_message < 1024:
        raise SmolbenchError(f"--max-message should be at least 1024 bytes, got {args.max_message}")
    if args.max_reply < 1024:
        raise SmolbenchError(f"--max-reply should be at least 1024 bytes, got {args.max_reply}")
    if args.max_sessions < 1:
        raise SmolbenchError(f"--max-sessions should be at least 1, got {args.max_sessions}")
    if not 0 <= args.port <= 65535:
        raise SmolbenchError(f"--port should be from 1 to 65535 (or 0: any free one), got {args.port}")


ORIGIN_RE = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\s]+")


def origin(value: str) -> str:
    """``--allow-origin``: a web origin as browsers send it (scheme://host[:port]), lower case."""
    value = value.lower().rstrip("/")
    if not ORIGIN_RE.fullmatch(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not an origin: give scheme://host[:port], e.g. https://app.example")
    return value


TOKEN_ENV = "SMOLBENCH_SERVE_TOKEN"
TOKEN_RE = re.compile(r"[A-Za-z0-9_-]{16,128}")
MAX_TOKEN_FILE = 4096  # bytes read of --token-file
IN_ARGV = ("--token TOKEN puts the token in this process's command line, which every local user can read "
           f"(ps, /proc/PID/cmdline): give it as ${TOKEN_ENV} or --token-file PATH instead")


def token_for(value: str | None, file: str | None = None) -> str | None:
    """The URL token clients must use (``--token``, else ``--token-file``, else
    $SMOLBENCH_SERVE_TOKEN, else a new random one); None with ``--token none``."""
    if file is not None:
        if value is not None:
            raise SmolbenchError("give either --token or --token-file, not both")
        value = token_file(file)
    value = value if value is not None else (os.environ.get(TOKEN_ENV) or "auto")
    if value == "none":
        return None
    if value == "auto":
        return secrets.token_urlsafe(24)
    if not TOKEN_RE.fullmatch(value):
        raise SmolbenchError(f"the token should be 16 to 128 letters, digits, '-' or '_' (it goes in the URL), "
                             f"or auto, or none; got {len(value)} characters")
    return value


def token_file(path: str) -> str:
    """``--token-file``'s token: a regular file of the user's own that no one else can read
    (as ssh takes a private key), its one line; else a one-line error naming the fix."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise SmolbenchError(f"can't read --token-file {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise SmolbenchError(f"--token-file {path} is not a regular file: give a file holding the token")
        if st.st_uid != os.getuid():
            raise SmolbenchError(f"--token-file {path} belongs to uid {st.st_uid}, not you (uid {os.getuid()}): "
                                 "give a file of your own")
        if st.st_mode & 0o077:
            raise SmolbenchError(f"--token-file {path} can be read or written by others (mode {st.st_mode & 0o777:04o}): "
                                 f"chmod 600 {path}")
        raw = fh.read(MAX_TOKEN_FILE + 1)
    text = raw.decode("utf-8", "replace").strip() if len(raw) <= MAX_TOKEN_FILE else ""
    if text in ("auto", "none") or "\n" in text:
        raise SmolbenchError(f"--token-file {path} should hold one token: 16 to 128 letters, digits, '-' or '_'")
    return text


def tls_files(args: argparse.Namespace) -> tuple[str, str | None] | None:
    """``--certfile`` and ``--keyfile`` (the key may be in the cert's file), loaded once here so
    a bad pair is one line before anything starts; None for plain HTTP."""
    if args.certfile is None:
        if args.keyfile is not None:
            raise SmolbenchError("--keyfile needs --certfile: give the certificate (PEM) it goes with")
        return None

    def no_passphrase() -> bytes:  # else OpenSSL asks on the terminal, and so would uvicorn
        raise SmolbenchError(f"the private key of --certfile {args.certfile} is encrypted: give one without a "
                             "passphrase (e.g. `openssl pkey -in KEY -out KEY.plain`), readable by you only")

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(args.certfile, args.keyfile, password=no_passphrase)
    except (OSError, ssl.SSLError) as exc:
        key = f" with --keyfile {args.keyfile}" if args.keyfile else " (no --keyfile: the key should be in it)"
        raise SmolbenchError(f"can't use --certfile {args.certfile}{key}: {exc.strerror or exc}; "
                             "give a PEM certificate and its private key") from None
    return args.certfile, args.keyfile


def loopback(host: str) -> bool:
    """Whether ``host`` (``--host``) listens on this host's loopback only."""
    return loopback_name(host)


def url_host(host: str) -> str:
    """``--host`` as a client puts it in the URL: this host's name for every address (the
    name its certificate is for), an IPv6 address in brackets."""
    if host in ("", "0.0.0.0", "::"):
        return socket.gethostname()  # as Jupyter shows it (getfqdn may give "localhost")
    return f"[{host}]" if ":" in host else host


def listening(host: str, port: int) -> list[socket.socket]:
    """Sockets listening on ``host`` and ``port`` as uvicorn's own would (asyncio's
    create_server: every address the name has, SO_REUSEADDR, IPv6 ones IPv6 only), before
    any machine is made; a client that connects meanwhile waits for the server. Listening
    at once, not only bound: with SO_REUSEADDR a second server's bind of the same port
    succeeds until one of them listens (it would boot its machines, then fail).
    Port 0: a free one, the same for every address. A port in use is one line."""
    try:
        infos = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise SmolbenchError(f"can't listen on --host {host}: {exc.strerror}") from None
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(socks) > 1:  # the others on the port the first one got
                addr = (addr[0], socks[0].getsockname()[1], *addr[2:])
            try:
                sock.bind(addr)
                sock.listen(backlog())
            except OSError as exc:
                where, at = str(addr[0]), str(addr[1])
                if exc.errno == errno.EADDRINUSE:
                    raise SmolbenchError(f"port {at} on {where} is in use: {exc}; pick another with --port N "
                                         "(or --port 0 for any free one)") from None
                raise SmolbenchError(f"can't listen on {where} port {at}: {exc}") from None
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def serve(args: argparse.Namespace) -> int:
    """Bind the port, bring a session up, build the env in its warm parent, serve it until stopped."""
    try:
        check_limits(args)
        code, env = env_for(args)
        token = token_for(args.token, args.token_file)
        if args.token not in (None, "auto", "none"):  # still taken, as before: said once
            print(f"smolbench serve: warning: {IN_ARGV}", file=sys.stderr, flush=True)
        os.environ.pop(TOKEN_ENV, None)  # read: no machine (the process backend's) inherits it
        tls = tls_files(args)
        socks = listening(args.host, args.port)  # before any machine: a port in use is one line, nothing made
    except SmolbenchError as exc:
        print(f"smolbench serve: {exc}", file=sys.stderr)
        return 2
    try:
        return _serve(args, code, env, token, tls, socks)
    except (SmolbenchError, RemoteError) as exc:  # e.g. no Smolfile there, or an env the machine can't make
        said = f"{exc.ename}: {exc.evalue}" if isinstance(exc, RemoteError) else str(exc)
        print(f"smolbench serve: {said.splitlines()[0] if said else type(exc).__name__}", file=sys.stderr)
        return 2
    finally:
        for sock in socks:
            sock.close()


def _serve(args: argparse.Namespace, code: str | None, env: str | Callable[..., Any], token: str | None,
           tls: tuple[str, str | None] | None, socks: list[socket.socket]) -> int:
    import uvicorn

    from . import Session
    from ._asgi import BodyLimit, ClientWatch, Origins, SecretPath
    from ._uvicorn import backlog, connection_cap, peer_cap, protocols, too_few_files
    from .gym._host import Host
    from .gym.machines import Machines
    from .openenv import app_for, reply_room

    if (few := too_few_files(args.max_sessions)) is not None:
        print(f"smolbench serve: {few}", file=sys.stderr)
        return 2
    with Session(args.smolfile, backend=args.backend) as session:
        if args.backend == "auto" and session.workbench is not None and session.workbench.backend.name == "process":
            # clients' code would run as this user's plain processes: never chosen for them silently
            print("smolbench serve: no microVM and no bubblewrap here, so clients' machines would be plain "
                  "processes with no isolation: `apt-get install bubblewrap` (or `--backend process` to serve "
                  "without isolation anyway)", file=sys.stderr)
            return 2
        if code is not None:
            session.run(code, check=True)
        wb = session.workbench
        assert wb is not None
        host = Host(wb)
        parent = Machines(host, env, 1, args.reset, None)
        # every session holds one branch at a time; fresh resets' spares are shared (the parent's)
        need = parent.live_branches() + args.max_sessions - 1
        if need > parent.room:
            print(f"smolbench serve: --max-sessions {args.max_sessions} needs {need} live branches of the warm parent "
                  f"at once; it has room for {parent.room}: use at most {parent.room - need + args.max_sessions}",
                  file=sys.stderr)
            return 2
        app: Any = None
        try:
            host.run(parent.start())
            assert parent.parent is not None
            # its spaces are known now: a space no reply of which fits is one line, before serving
            if (some := reply_room(parent.observation_space, args.max_reply)) is not None:
                print(f"smolbench serve: warning: {some}", file=sys.stderr, flush=True)
            port = socks[0].getsockname()[1]  # --port 0: the one it got
            url = f"{'https' if tls else 'http'}://{url_host(args.host)}:{port}" + (f"/{token}" if token else "")
            print(f"smolbench: serving {args.gym or args.target} over OpenEnv (openenv-core) on {url} · "
                  f"{wb.backend.name} · each client session in its own branch of {parent.parent.name}", flush=True)
            if token:
                print(f"smolbench: give clients the whole URL as their base_url (e.g. GenericEnvClient(base_url=\"{url}\")); "
                      f"any other path is refused (${TOKEN_ENV} or --token-file keeps one token across restarts)", flush=True)
            if not loopback(args.host) and not (tls and token):
                why = ("--token none turned the URL's token off: anyone who can connect runs episodes here" if not token
                       else "the URL's token goes over plain HTTP: give --certfile and --keyfile, or put a proxy with TLS in front")
                print(f"smolbench serve: warning: --host {args.host} is reachable from other hosts and {why}",
                      file=sys.stderr, flush=True)
            app = app_for(parent, args.max_sessions, args.request_timeout, args.idle_timeout, args.max_reply)
            served: Any = BodyLimit(ClientWatch(app, args.max_message), args.max_message)
            if token:  # a request without it is refused before its body is read
                served = SecretPath(served, token)
            served = Origins(served, set(args.allow_origin), loopback(args.host))  # outermost: before anything
            cap = connection_cap(args.max_sessions)
            http, ws = protocols(cap, args.request_timeout, peer_cap(cap, args.max_sessions))
            # a stop cancels what still runs after STOP_WAIT s (a step waits at most --request-timeout)
            server = _uvicorn_server()(uvicorn.Config(served, host=args.host, port=args.port, http=http, ws=ws, backlog=backlog(),
                                                      log_level="warning", timeout_graceful_shutdown=STOP_WAIT, loop="asyncio",
                                                      ws_max_size=args.max_message,
                                                      ssl_certfile=tls[0] if tls else None,
                                                      ssl_keyfile=tls[1] if tls else None))
            server.run(sockets=socks)
        finally:
            if app is not None:  # sessions still open (their clients gone, or cut by the stop)
                app.state.smolbench_pool.shutdown(wait=False, cancel_futures=True)
                for m in list(app.state.smolbench_sessions):
                    with contextlib.suppress(Exception):
                        host.run(m.close(), 60)
            host.run(parent.close())
    print("smolbench: stopped; every machine it made is deleted", flush=True)
    return 0


def _uvicorn_server() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, minus raising Ctrl-C / SIGTERM again once it stopped: we go on to
        delete the machines and end the session ourselves. Its listening sockets take
        connections through :class:`_uvicorn`'s gate: each is counted against the caps as it
        is accepted, and over TLS its handshake (at most ``FIRST_BYTE_TIMEOUT`` s) comes after.
        asyncio's own ``create_server(ssl=...)`` hands a connection to its protocol only once
        its handshake is done: a flood of connections that never sent a hello held their
        files uncounted, and ran the server out of them."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            from .openenv import STOPPING

            STOPPING.set()
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

        async def startup(self, sockets: list[Any] | None = None) -> None:
            loop = asyncio.get_running_loop()  # asyncio's own (Config(loop="asyncio")): its method may be shadowed
            create_server = loop.create_server
            accepting = getattr(self.config.http_protocol_class, "accepting", None)  # _uvicorn.protocols()'s

            def gated(make: Any, *args: Any, **kwargs: Any) -> Any:
                if accepting is not None:
                    make = accepting(make, kwargs.pop("ssl", None))
                return create_server(make, *args, **kwargs)

            loop.create_server = gated  # type: ignore[method-assign,assignment]
            try:
                await super().startup(sockets)
            finally:
                del loop.create_server

    return Server


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``serve`` command's options."""
    p = sub.add_parser("serve", help="serve a machine-backed environment over OpenEnv's protocol (pip install 'jupyterlab-smolbench[openenv]')")
    p.add_argument("target", nargs="?", default=None, help="FILE.py:NAME: run FILE.py in the machine, serve the env NAME() makes")
    p.add_argument("--gym", default=None, metavar="ID", help="serve gymnasium.make(ID) instead (e.g. CartPole-v1)")
    p.add_argument("--smolfile", default=None, help="the Smolfile of the warm machine (default: ./Smolfile if there)")
    p.add_argument("--backend", default="auto", choices=["auto", "smol", "sandbox", "process"],
                   help="where the machines run (default auto: a microVM where one boots, else a sandbox; never plain processes unless asked)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free one, named in the URL it prints)")
    p.add_argument("--token", default=None, metavar="auto|none",
                   help=f"the path clients' URLs start with (default: ${TOKEN_ENV}, else a new random one; "
                        "none: any path, so any client that can connect is served; web pages still are not, see --allow-origin). "
                        f"To keep one token across restarts set ${TOKEN_ENV} or give --token-file: a token here is in "
                        "the command line other local users can read")
    p.add_argument("--token-file", default=None, metavar="PATH",
                   help="read the token from PATH: a file of your own no one else can read (chmod 600)")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN", type=origin,
                   help="serve requests a web page at ORIGIN (e.g. https://app.example:8443) makes; "
                        "any other page's are refused (default: none). Repeatable")
    p.add_argument("--certfile", default=None, metavar="PEM",
                   help="serve over TLS (https://, wss://) with this certificate chain; its key in it or --keyfile")
    p.add_argument("--keyfile", default=None, metavar="PEM", help="the private key of --certfile")
    p.add_argument("--reset", default="fresh", choices=["fresh", "in-place"], help="each episode in a fresh branch (default)")
    p.add_argument("--max-sessions", type=int, default=16,
                   help="client sessions open at once, each its own machine: WebSocket sessions, and HTTP resets "
                        "while they run, each until its machine is deleted (default 16)")
    p.add_argument("--request-timeout", type=float, default=120.0, metavar="S",
                   help="seconds one reset or step may take; then its machine is deleted and the client told (default 120)")
    p.add_argument("--max-message", type=int, default=1 << 20, metavar="BYTES",
                   help="bytes an HTTP request body or a WebSocket message may take (default 1 MiB)")
    p.add_argument("--max-reply", type=int, default=16 << 20, metavar="BYTES",
                   help="bytes of JSON one reset's or step's observation and info may take, counted from the arrays' "
                        "sizes and dtypes; past it the episode ends with one line (default 16 MiB; the server holds "
                        "about 3 times a reply while it sends it)")
    p.add_argument("--idle-timeout", type=float, default=600.0, metavar="S",
                   help="seconds a client session may go without a request before it is closed (default 600)")
    p.set_defaults(fn=serve)
