"""``smolbench serve``: a machine-backed environment over OpenEnv's protocol, until stopped.

``smolbench serve envs.py:make_env`` runs ``envs.py`` in a warm machine (a Session from
the Smolfile), builds the env ``make_env()`` returns there, and serves it with OpenEnv's
own app on loopback; ``smolbench serve --gym CartPole-v1`` serves a registered Gymnasium
env. Each client session gets its own branch of the warm parent; Ctrl-C or SIGTERM stops
the server and deletes every machine it made.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from .errors import SmolbenchError

TARGET = re.compile(r"(?P<file>.+\.py):(?P<name>[A-Za-z_][A-Za-z0-9_]*)")
SERVED = "_smolbench_served"


def setup_code(args: argparse.Namespace) -> tuple[str, str]:
    """The code that defines the env in the warm machine, and the factory's name there."""
    if args.gym:
        if args.target:
            raise SmolbenchError("give either FILE.py:NAME or --gym ID, not both")
        return f"import gymnasium\ndef {SERVED}():\n    return gymnasium.make({args.gym!r})\n", SERVED
    m = TARGET.fullmatch(args.target or "")
    if m is None:
        raise SmolbenchError("say what to serve: FILE.py:NAME (a file run in the machine, NAME its zero-argument "
                             "env factory) or --gym ID (e.g. --gym CartPole-v1)")
    path = Path(m["file"])
    if not path.is_file():
        raise SmolbenchError(f"no file {path}: give the Python file that defines {m['name']}")
    return path.read_text(), m["name"]


def serve(args: argparse.Namespace) -> int:
    """Bring a session up, build the env in its warm parent, serve it until stopped."""
    import uvicorn

    from . import Session
    from .gym._host import Host
    from .gym.machines import Machines
    from .openenv import app_for

    try:
        code, name = setup_code(args)
    except SmolbenchError as exc:
        print(f"smolbench serve: {exc}", file=sys.stderr)
        return 2
    with Session(args.smolfile, backend=args.backend) as session:
        session.run(code, check=True)
        wb = session.workbench
        assert wb is not None
        host = Host(wb)
        parent = Machines(host, name, 1, args.reset, None)
        try:
            host.run(parent.start())
            assert parent.parent is not None
            print(f"smolbench: serving {args.gym or args.target} over OpenEnv (openenv-core) on "
                  f"http://{args.host}:{args.port} · {wb.backend.name} · each client session in its own branch of "
                  f"{parent.parent.name}", flush=True)
            server = _uvicorn_server()(uvicorn.Config(app_for(parent, args.max_sessions), host=args.host, port=args.port,
                                            log_level="warning"))
            server.run()
        finally:
            host.run(parent.close())
    print("smolbench: stopped; every machine it made is deleted", flush=True)
    return 0


def _uvicorn_server() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, minus raising Ctrl-C / SIGTERM again once it stopped: we go on to
        delete the machines and end the session ourselves."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    return Server


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``serve`` command's options."""
    p = sub.add_parser("serve", help="serve a machine-backed environment over OpenEnv's protocol (pip install 'jupyterlab-smolbench[openenv]')")
    p.add_argument("target", nargs="?", default=None, help="FILE.py:NAME: run FILE.py in the machine, serve the env NAME() makes")
    p.add_argument("--gym", default=None, metavar="ID", help="serve gymnasium.make(ID) instead (e.g. CartPole-v1)")
    p.add_argument("--smolfile", default=None, help="the Smolfile of the warm machine (default: ./Smolfile if there)")
    p.add_argument("--backend", default="auto", choices=["auto", "smol", "sandbox", "process"])
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--reset", default="fresh", choices=["fresh", "in-place"], help="each episode in a fresh branch (default)")
    p.add_argument("--max-sessions", type=int, default=16, help="client sessions at once (each its own machine)")
    p.set_defaults(fn=serve)
