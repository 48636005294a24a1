"""Joining a Ray cluster as a normal driver (the kernel's host joins it itself)."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any, NoReturn

from ..errors import SmolbenchError

CONNECT_SECONDS = 10.0  # to reach a head's GCS port before Ray is asked to join it
RAY_CLIENT_LINE = ("`ray://` addresses use Ray Client, which can't stream generators (live branch output): "
                   "join the cluster from its own network instead, e.g. `%smol up --ray auto` on a node, "
                   "or `--ray HEAD_IP:6379`")


def _from(source: str | None) -> str:
    return f" (the [cluster] address of {source})" if source else ""


def resolve(address: str | None, source: str | None = None) -> str:
    """The address to join: ``auto``, ``HOST:PORT``, or RAY_ADDRESS when none is given.

    ``source`` names the Smolfile the address came from, for errors (None: `--ray`)."""
    addr = (address or os.environ.get("RAY_ADDRESS") or "auto").strip()
    if addr.startswith("ray://"):
        raise SmolbenchError(RAY_CLIENT_LINE + (f" (in the [cluster] address of {source})" if source else ""))
    if addr != "auto" and (":" not in addr or not addr.rsplit(":", 1)[1].isdigit()):
        raise SmolbenchError(f"bad Ray address {addr!r}{_from(source)}: give HOST:PORT of the head's GCS "
                             "(e.g. 10.0.0.5:6379), `auto`, or set RAY_ADDRESS")
    return addr


def connect(address: str | None, source: str | None = None) -> str:
    """Join the cluster (once per kernel); returns the address joined."""
    try:
        import ray
    except ImportError:
        raise SmolbenchError("Ray is not installed: `pip install 'jupyterlab-smolbench[ray]'`"
                             + (f" (the [cluster] table of {source} asks for a Ray cluster)" if source else "")) from None
    addr = resolve(address, source)
    if ray.is_initialized():
        return addr
    if addr != "auto":  # Ray itself retries a head that isn't there for minutes, printing as it goes
        host, port = addr.rsplit(":", 1)
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_SECONDS).close()
        except OSError as exc:
            _refused(addr, source, f"nothing answered there ({exc.strerror or type(exc).__name__})")
    try:
        # log_to_driver off: Ray's forwarding folds repeated lines; output comes back through the gate
        ray.init(address=addr, namespace="smolbench", log_to_driver=False, logging_level=logging.WARNING,
                 configure_logging=False)
    except ConnectionError as exc:
        _refused(addr, source, " ".join(str(exc).split()).rstrip(" .;:") or type(exc).__name__)
    return addr


def _refused(addr: str, source: str | None, why: str) -> NoReturn:
    fix = (f"fix or delete the [cluster] table in {source} to run machines on this host" if source
           else "fix the address")
    raise SmolbenchError(f"can't join the Ray cluster at {addr}{_from(source)}: {why}; start one "
                         f"(`smolbench cluster local --nodes 3`, or `ray start --head`) or {fix}") from None


def disconnect() -> None:
    """Leave the cluster (the node agents this driver owns go with it)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


def nodes() -> list[dict[str, Any]]:
    """Live nodes that offer machine slots."""
    import ray

    from . import SLOTS

    return [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(SLOTS, 0) > 0]
