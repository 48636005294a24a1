"""Joining a Ray cluster as a normal driver (the kernel's host joins it itself)."""

from __future__ import annotations

import contextlib
import importlib
import ipaddress
import logging
import os
import socket
import weakref
from collections.abc import Iterator
from typing import Any, NoReturn

from ..errors import SmolbenchError

CONNECT_SECONDS = 10.0  # to reach a head's GCS port before Ray is asked to join it
RAY_CLIENT_LINE = ("`ray://` addresses use Ray Client, which can't stream generators (live branch output): "
                   "join the cluster from its own network instead, e.g. `%smol up --ray auto` on a node, "
                   "or `--ray HEAD_IP:6379`")

_joined: tuple[str, str] | None = None  # (GCS address, job id) of the cluster connect() joined, while joined
_users: weakref.WeakSet[Any] = weakref.WeakSet()  # cluster backends on it (joined_by)


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
    """Join the cluster; returns the GCS address joined (HOST:PORT, also for ``auto``).

    Ray joins one cluster per process. Joined already: that cluster is used when it is the one
    asked for (or ``auto`` in a kernel whose own ``ray.init()`` joined it); another one is joined
    instead when the old one is smolbench's and holds none of our machines (after ``%smol down``),
    once it answers; otherwise one line refuses (our machines are there, or the Ray is the user's,
    which is never shut down). Never an address this process is not joined to."""
    global _joined
    try:
        import ray
    except ImportError:
        raise SmolbenchError("Ray is not installed: `pip install 'jupyterlab-smolbench[ray]'`"
                             + (f" (the [cluster] table of {source} asks for a Ray cluster)" if source else "")) from None
    addr = resolve(address, source)
    if ray.is_initialized():
        here, job = _joined_now(ray)
        ours = _joined == (here, job)
        if _same(addr, here) or (addr == "auto" and not ours):
            return here
        if not ours:
            raise SmolbenchError(f"this kernel already joined the Ray cluster at {here} (its own `ray.init()`), and Ray "
                                 f"joins one cluster per process: `ray.shutdown()` first to join {addr}{_from(source)}, "
                                 f"or use that one (`%smol up --ray {here}`)")
        if any(user.holds_machines() for user in list(_users)):
            raise SmolbenchError(f"this kernel's machines are on the Ray cluster at {here}, and Ray joins one cluster "
                                 f"per process: `%smol down` first to join {addr}{_from(source)}")
        _answers(addr, source)  # the cluster we are on is left only for one that answers
        ray.shutdown()
        _joined = None
    _answers(addr, source)
    auth_from_env()
    try:
        # log_to_driver off: Ray's forwarding folds repeated lines; output comes back through the gate
        with _loopback(addr):
            ray.init(address=addr, namespace="smolbench", log_to_driver=False, logging_level=logging.WARNING,
                     configure_logging=False)
    except ConnectionError as exc:
        _refused(addr, source, " ".join(str(exc).split()).rstrip(" .;:") or type(exc).__name__)
    _joined = _joined_now(ray)
    return _joined[0]


@contextlib.contextmanager
def _loopback(addr: str) -> Iterator[None]:
    """Let ``ray.init`` join a cluster that listens on loopback only (``smolbench cluster local``).

    On Linux Ray swaps a loopback address for this host's routable IP, where such a cluster
    doesn't listen; it keeps loopback where it takes a host for a single-host one (macOS,
    Windows: ``ENABLE_RAY_CLUSTER`` off), so that is what it is told while it joins one."""
    from ray._private import ray_constants, services

    raw = addr
    if addr == "auto":
        with contextlib.suppress(Exception):
            raw = services.get_ray_address_from_environment(addr, None) or ""
    host = raw.rsplit(":", 1)[0].strip("[]")
    try:
        loop = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loop = False
    if not loop:
        yield
        return
    was = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = was


def auth_from_env(env: dict[str, str | None] | None = None) -> None:
    """Set (None: unset) Ray's auth variables in ``env``, and make this process's Ray read them
    all again: Ray reads ``RAY_AUTH_MODE`` once, so one set later (``%env``, or a
    ``smolbench cluster local`` in this process) would not be used by the next ``ray.init``."""
    for key, value in (env or {}).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    with contextlib.suppress(ImportError, AttributeError):  # an older Ray: it reads them when it starts
        raylet: Any = importlib.import_module("ray._raylet")
        raylet.Config.initialize("")
        raylet.AuthenticationTokenLoader.instance().reset_cache()


def joined_by(user: Any) -> None:
    """``user`` (a ClusterBackend, with ``holds_machines()``) runs machines on the cluster joined:
    while it holds some, :func:`connect` won't leave that cluster for another."""
    _users.add(user)


def _joined_now(ray: Any) -> tuple[str, str]:
    """(the GCS address, the driver's job id) of the cluster this process is joined to: each
    ``ray.init`` is a job of its own, so a ``ray.init`` of the user's is never taken for ours."""
    ctx = ray.get_runtime_context()
    return str(ctx.gcs_address), str(ctx.get_job_id())


def _same(addr: str, here: str) -> bool:
    """Whether ``addr`` (HOST:PORT or ``auto``) names the cluster at ``here``, as Ray resolves it
    (``auto``: RAY_ADDRESS or the cluster started last on this host; a local host: the node's IP)."""
    if addr == here:
        return True
    with contextlib.suppress(Exception):  # Ray's own helper (private): no answer is "not the same"
        from ray._private.services import canonicalize_bootstrap_address

        if canonicalize_bootstrap_address(addr) == here:
            return True
    if addr == "auto":
        return False
    (host, port), (here_host, here_port) = addr.rsplit(":", 1), here.rsplit(":", 1)
    return port == here_port and bool(_ips(host) & _ips(here_host))


def _ips(host: str) -> set[str]:
    try:
        return {str(a[4][0]) for a in socket.getaddrinfo(host.strip("[]"), None)}
    except OSError:
        return set()


def _answers(addr: str, source: str | None) -> None:
    """Refuse at once when nothing answers at ``addr`` (Ray itself retries a head that isn't
    there for minutes, printing as it goes)."""
    if addr == "auto":
        return
    host, port = addr.rsplit(":", 1)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_SECONDS).close()
    except OSError as exc:
        _refused(addr, source, f"nothing answered there ({exc.strerror or type(exc).__name__})")


def _refused(addr: str, source: str | None, why: str) -> NoReturn:
    fix = (f"fix or delete the [cluster] table in {source} to run machines on this host" if source
           else "fix the address")
    raise SmolbenchError(f"can't join the Ray cluster at {addr}{_from(source)}: {why}; start one "
                         f"(`smolbench cluster local --nodes 3`, or `ray start --head`) or {fix}") from None


def disconnect() -> None:
    """Leave the cluster (the node agents this driver owns go with it)."""
    global _joined
    import ray

    if ray.is_initialized():
        ray.shutdown()
    _joined = None


def nodes() -> list[dict[str, Any]]:
    """Live nodes that offer machine slots."""
    import ray

    from . import SLOTS

    return [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(SLOTS, 0) > 0]
