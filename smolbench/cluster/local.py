"""A throwaway multi-node Ray cluster on this machine, for trying things out and for class demos.

A head with no CPUs (it schedules no work) plus ``nodes`` worker nodes, each with its own
data folder (``SMOLBENCH_NODE_DIR``), ``slots`` machine slots and a small object store.
Everything lives in one private temporary folder; :meth:`LocalCluster.stop` (or leaving the
``with`` block) stops every Ray process it started and removes the folder.

A cluster's folder records its owner (pid and start time, as a run folder does): when the
process that made it was killed, the next LocalCluster made in the same folder (/tmp) removes it.

Every Ray process a cluster starts carries ``SMOLBENCH_RAY_CLUSTER=<its folder>`` in its
environment (its workers and their children inherit it from the raylet): that, compared
exactly, is what marks a process as this cluster's when its strays are killed.

Ray's own ``Cluster`` starts with no authentication on the host's routable address: anyone on
the network could run tasks as this user. Here every node listens on 127.0.0.1 only and asks
for a token (``RAY_AUTH_MODE=token``) kept in the cluster's folder (mode 0600); this process,
its nodes and kernels it starts use it through ``RAY_AUTH_TOKEN_PATH``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from ..backends import _procs, _rundir
from ..errors import SmolbenchError
from . import SLOTS
from .address import auth_from_env

PREFIX = "sbray-"  # the cluster's folder: its owner file lets the next LocalCluster sweep it once its process is gone
OBJECT_STORE = 100 * 1024 * 1024  # per node: this is a demo on one host, not a data pipeline
LOOPBACK = "127.0.0.1"
AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")
# Ray on Linux swaps a loopback address for the host's routable IP, where this cluster doesn't
# listen; with this off (as on macOS) it keeps loopback: set for this process while the cluster
# lives and for what it starts (nodes, kernels), so a plain `ray.init(address=...)` joins it
SINGLE_HOST_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
BACKENDS = ("auto", "sandbox", "process", "smol")
# set (to the cluster's folder) for every Ray process the cluster starts, and so inherited by
# the workers their raylets start: the only thing that makes a process one of that cluster's
MARK_ENV = "SMOLBENCH_RAY_CLUSTER"
T = TypeVar("T")


@contextlib.contextmanager
def _patient(seconds: float = 180.0) -> Iterator[None]:
    """Give a starting node ``seconds`` to register, not Ray's fixed 30 s.

    ``ray._private.node.Node`` polls ``services.get_node`` and gives up after 30 s, which a
    busy 2-core host can miss while the GCS is still starting. Here each poll keeps trying
    until the node is known or ``seconds`` passed. Only while this throwaway cluster starts.
    """
    import ray._private.services as services

    original = services.get_node

    def get_node(gcs_address: str, node_id: str) -> Any:
        deadline = time.monotonic() + seconds
        while True:
            try:
                return original(gcs_address, node_id)
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    services.get_node = get_node
    node_cls, start_raylet = _ports_told()
    try:
        yield
    finally:
        services.get_node = original
        if node_cls is not None:
            setattr(node_cls, "start_raylet", start_raylet)  # noqa: B010


def _ports_told() -> tuple[Any, Any]:
    """Tell a starting raylet its agents' ports before it starts (returns what to put back).

    The raylet waits a fixed 15 s for its agents to write their ports to files, then aborts
    (``Timed out waiting for file ...metrics_agent_port_...``): the dashboard agent, a Python
    process that imports a lot, misses that on a busy 2-core host. Without ``ray[default]``
    (smolbench's ``ray`` extra) the agent is minimal and writes -1 for its three ports (no
    metrics, no HTTP server); here they are written first. The runtime-env agent is given a
    free port, written first too. The agents still start; the raylet just need not wait.
    """
    try:
        import ray._raylet as raylet
        from ray._private.node import Node
        from ray._private.utils import get_dashboard_dependency_error

        names: Any = [getattr(raylet, f"{n}_PORT_NAME") for n in ("METRICS_AGENT", "METRICS_EXPORT",
                                                                 "DASHBOARD_AGENT_LISTEN", "RUNTIME_ENV_AGENT")]
        persist_port: Any = raylet.persist_port  # type: ignore[attr-defined]
    except (ImportError, AttributeError):  # another Ray: as it is
        return None, None
    if get_dashboard_dependency_error() is None:  # a full agent: its ports are real, waited for
        return None, None
    original = Node.start_raylet

    def start_raylet(node: Any, *args: Any, **kwargs: Any) -> Any:
        with contextlib.suppress(Exception):
            params = node._ray_params
            if not params.runtime_env_agent_port:
                params.runtime_env_agent_port = _free_port()
            for name, port in zip(names, (-1, -1, -1, params.runtime_env_agent_port)):
                persist_port(node._session_dir, node._node_id, name, port)
        return original(node, *args, **kwargs)

    setattr(Node, "start_raylet", start_raylet)  # noqa: B010 - only while a throwaway node starts
    return Node, original


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _again(start: Callable[[], T], cleanup: Callable[[], None] | None = None, tries: int = 3, *,
           mark: str | None = None) -> T:
    """Start a node, again if it still timed out (see :func:`_patient`); with ``mark``, what it
    starts is marked as that cluster's (``MARK_ENV=mark``)."""
    for attempt in range(tries):
        try:
            with _patient(), _marked(mark):
                return start()
        except Exception as exc:
            if "timed out during startup" not in str(exc) or attempt == tries - 1:
                raise
            if cleanup is not None:
                cleanup()
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _marked(mark: str | None) -> Iterator[None]:
    """``MARK_ENV=mark`` in this process's environment while a node starts: Ray starts the head's
    processes (GCS, monitors) and each raylet with this process's environment, and a raylet's
    workers (``ray::IDLE``, node agents, a process node's kernels) inherit the raylet's. Only
    for the start: a kernel or tool this process starts later is not the cluster's."""
    if mark is None:
        yield
        return
    was = os.environ.get(MARK_ENV)
    os.environ[MARK_ENV] = mark
    try:
        yield
    finally:
        if was is None:
            os.environ.pop(MARK_ENV, None)
        else:
            os.environ[MARK_ENV] = was


# The head's GCS declares a node dead after `health_check_failure_threshold` failed checks in a
# row (Ray's defaults: 3 s apart, 10 s each, 5 misses). On a loaded host a healthy raylet can
# miss that many. Here a check may take 30 s and 10 in a row must fail, yet a node whose raylet
# is gone (refused at once) is still declared dead in ~10 x 1 s.
HEALTH_CHECK = {"health_check_period_ms": 1000, "health_check_timeout_ms": 30_000, "health_check_failure_threshold": 10}


class LocalCluster:
    """``nodes`` Ray nodes on this host; ``address`` is what ``%smol up --ray`` takes."""

    def __init__(self, nodes: int = 3, *, slots: int = 8, cpus: int = 1, backends: list[str] | None = None,
                 base: str | None = None, env: dict[str, str] | None = None) -> None:
        if not 1 <= nodes <= 16:
            raise SmolbenchError(f"--nodes must be from 1 to 16 on one host, got {nodes}")
        if not 1 <= slots <= 256:
            raise SmolbenchError(f"--slots must be from 1 to 256 machines per node, got {slots}")
        backends = list(backends or ["auto"])
        bad = [b for b in backends if b not in BACKENDS]
        if bad:
            raise SmolbenchError(f"unknown node backend {bad[0]!r}: use one of {', '.join(BACKENDS)}")
        try:
            from ray.cluster_utils import Cluster
        except ImportError:
            raise SmolbenchError("Ray is not installed: `pip install 'jupyterlab-smolbench[ray]'`") from None
        # short: Ray's Unix socket paths live below it and must stay under 108 characters
        base = base or ("/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir())
        self.swept = sweep_killed(base)
        self.dir = _rundir.make(base, prefix=PREFIX)  # its owner recorded (pid and start time) for that sweep
        self.mark = _mark_of(self.dir)
        self._old_tmp = os.environ.get("RAY_TMPDIR")
        os.environ["RAY_TMPDIR"] = str(self.dir)  # Ray's `auto` address file goes here, not to a shared /tmp/ray
        (self.dir / "ray").mkdir()
        self.token_path = self.dir / "auth_token"
        self._old_auth: dict[str, str | None] | None = {k: os.environ.get(k) for k in AUTH_ENV}
        _write_token(self.token_path)
        self._old_single: tuple[str | None, bool] | None = _single_host(("0", False))
        auth_from_env({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path), "RAY_AUTH_TOKEN": None})
        self.node_dirs: list[Path] = []
        self.nodes: list[Any] = []
        self._asked: dict[str, tuple[int, int, str]] = {}  # node id: (slots, cpus, backend), to replace it
        self.env = dict(env or {})  # more environment for every node's processes (tests: a fake smol engine)
        self._cluster: Any = None
        atexit.register(self.stop)  # a kernel that exits (or is shut down) mid-notebook still cleans up
        try:
            self._cluster = _again(lambda: Cluster(initialize_head=True, head_node_args={
                "num_cpus": 0, "node_ip_address": LOOPBACK, "temp_dir": str(self.dir / "ray"), "object_store_memory": OBJECT_STORE,
                "include_dashboard": False, "resources": {}, "_system_config": HEALTH_CHECK}), self._kill_strays, mark=self.mark)
            for i in range(nodes):
                self.add_node(slots=slots, cpus=cpus, backend=backends[i % len(backends)])
            self.replace_lost()
        except BaseException:
            self.stop()
            raise
        _sweep_stopped()

    @property
    def address(self) -> str:
        """The head's GCS address (HOST:PORT)."""
        return str(self._cluster.address)

    def add_node(self, *, slots: int = 8, cpus: int = 1, backend: str = "auto") -> Any:
        """One more worker node with its own data folder; returns Ray's node handle."""
        folder = self.dir / f"node{len(self.node_dirs)}"
        folder.mkdir(mode=0o700)
        resources: dict[str, float] = {SLOTS: float(slots)}
        if backend != "auto":
            resources[f"smolbench_backend_{backend}"] = 1.0
        node = _again(lambda: self._cluster.add_node(num_cpus=cpus, node_ip_address=LOOPBACK, resources=resources,
                                                     object_store_memory=OBJECT_STORE,
                                                     env_vars={**self.env, "SMOLBENCH_NODE_DIR": str(folder)}), mark=self.mark)
        self.node_dirs.append(folder)
        self.nodes.append(node)
        self._asked[node.node_id] = (slots, cpus, backend)
        return node

    def lost(self) -> dict[Any, str]:
        """Nodes of this cluster that are gone (their raylet exited, or the head declared them
        dead), each with why, as far as this host can tell."""
        alive = {n["NodeID"] for n in self._cluster.global_state.node_table() if n.get("Alive")}
        out = {}
        for node in self.nodes:
            exited = [p.returncode for kind, p in node.dead_processes() if kind == "raylet"]
            if exited:
                out[node] = f"its raylet exited with code {exited[0]}"
            elif node.node_id not in alive:
                out[node] = "the head declared it dead"
        return out

    def replace_lost(self) -> list[str]:
        """Put a new node in place of each lost one (same slots and backend); what was done, a
        line each. On a busy host a raylet can die while the cluster starts; a throwaway
        cluster for a demo just needs the nodes it was asked for."""
        notes = []
        for node, why in self.lost().items():
            slots, cpus, backend = self._asked[node.node_id]
            with contextlib.suppress(Exception):
                self.remove_node(node)
            if node in self.nodes:
                self.nodes.remove(node)
            new = self.add_node(slots=slots, cpus=cpus, backend=backend)
            notes.append(f"node {node.node_id[:8]} was lost ({why}; Ray's logs: {node.get_logs_dir_path()}): "
                         f"replaced by node {new.node_id[:8]}")
        for line in notes:
            print(f"smolbench cluster local: {line}", file=sys.stderr, flush=True)
        return notes

    def remove_node(self, node: Any) -> None:
        """Take a node away, as if its host was lost (its processes are killed)."""
        self._cluster.remove_node(node, allow_graceful=False)
        self.nodes.remove(node)
        self._asked.pop(node.node_id, None)
        # until the head has declared it dead: a driver that joins before then would still
        # place an agent on it (which then dies with "missing too many heartbeats")
        self._cluster.wait_for_nodes(timeout=120)

    def stop(self) -> None:
        """Stop every Ray process this cluster started and remove its folder."""
        if self._cluster is not None:
            with contextlib.suppress(Exception):  # a driver in this process (a notebook's %smol up) leaves first
                import ray

                if ray.is_initialized() and ray.get_runtime_context().gcs_address == self.address:
                    ray.shutdown()
            with contextlib.suppress(Exception):
                self._cluster.shutdown()
            self._cluster = None
        self._kill_strays()
        if self._old_tmp is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = self._old_tmp
        if self._old_auth is not None:
            auth_from_env(self._old_auth)
            self._old_auth = None
        if self._old_single is not None:
            _single_host(self._old_single)
            self._old_single = None
        shutil.rmtree(self.dir, ignore_errors=True)
        _STOPPED.append(self.dir)
        _sweep_stopped()
        atexit.unregister(self.stop)

    def _kill_strays(self) -> None:
        """Ray processes of this cluster that outlived it (a node that timed out while starting)."""
        _kill_marked(self.mark)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def sweep_killed(base: str) -> list[Path]:
    """Remove the folders in ``base`` of local clusters whose process is gone (kill -9: no stop,
    no atexit), their Ray processes still dying first; a live owner's, another user's, or one
    without an owner record (made before owners were recorded) is never touched."""
    return _rundir.sweep(base, prefix=PREFIX, before=lambda folder: _kill_marked(_mark_of(folder)))


def _mark_of(folder: Path) -> str:
    """The value of MARK_ENV for the cluster in ``folder``: its absolute path, links in its base
    resolved (a cluster made under a relative or linked base is found by a sweep of the real
    one), never in its own name (a swept folder swapped for a link to another cluster's would
    name that one)."""
    return os.path.join(os.path.realpath(folder.parent), folder.name)


def _kill_marked(mark: str) -> None:
    """Kill this user's processes marked as the cluster's (``MARK_ENV=mark`` in their environment,
    compared exactly) and wait until they are gone: a worker still dying may write its session
    folder again. Nothing else is: not a process of another cluster whose folder's name starts
    with this one's (``sbray-q`` and ``sbray-qlivecl1``), nor one that merely names a file in the
    folder on its command line (``tail -f``, an editor); matching the folder's path as a plain
    substring of command lines and environments killed both (an audit)."""
    killed = [(pid, started) for pid, started in _procs.with_env(MARK_ENV, mark)
              if pid != os.getpid() and _owned(pid)]
    _procs.kill_all(killed)
    deadline = time.monotonic() + 10
    while killed and time.monotonic() < deadline:
        killed = [p for p in killed if _procs.running(*p)]
        time.sleep(0.02)


def _owned(pid: int) -> bool:
    """Whether process ``pid`` is this user's (never another user's, though root reads its environment)."""
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def _single_host(to: tuple[str | None, bool]) -> tuple[str | None, bool] | None:
    """Set SINGLE_HOST_ENV (None: unset) and Ray's flag in this process; what they were."""
    try:
        from ray._private import ray_constants
    except ImportError:
        return None
    was = (os.environ.get(SINGLE_HOST_ENV), bool(ray_constants.ENABLE_RAY_CLUSTER))
    if to[0] is None:
        os.environ.pop(SINGLE_HOST_ENV, None)
    else:
        os.environ[SINGLE_HOST_ENV] = to[0]
    ray_constants.ENABLE_RAY_CLUSTER = to[1]
    return was


def _write_token(path: Path) -> None:
    """A new random token, readable by this user only (the folder is 0700 too)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


# Ray remembers a stopped cluster's session in the process that started it, and the next
# cluster started (or stopped) there makes that session's folder again, empty: swept then.
_STOPPED: list[Path] = []


def _sweep_stopped() -> None:
    for folder in _STOPPED:
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
