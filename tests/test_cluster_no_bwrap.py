"""Audit: an ``auto`` node without bubblewrap silently became a ``process`` node, so untrusted
cells ran as the Ray worker's user with no isolation and no warning (a local ``auto`` warns
loudly). Now such a node runs no machines and says why, with the fix, in one line; a node
that declares the process backend still runs them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from smolbench.errors import SmolbenchError

pytest.importorskip("ray", reason="Ray is not installed: pip install 'jupyterlab-smolbench[ray]'")


def test_an_auto_node_without_bubblewrap_runs_no_machines_and_says_how_to_fix_it(tmp_path: Path) -> None:
    from smolbench.cluster import address
    from smolbench.cluster.backend import ClusterBackend
    from smolbench.cluster.local import LocalCluster

    no_bwrap = tmp_path / "bin"  # the node's PATH: its Python, and no bwrap
    no_bwrap.mkdir()
    os.symlink(sys.executable, no_bwrap / "python")
    with LocalCluster(2, slots=2, backends=["auto", "process"], env={"PATH": str(no_bwrap)}) as c:
        backend = ClusterBackend(c.address)
        try:
            backend.start()
            kinds = sorted(n.backend for n in backend.nodes.values())
            usable = {n.backend: n.slots for n in backend._alive()}
        finally:
            address.disconnect()
    assert kinds == ["process", "refused"]
    assert usable == {"process": 2}  # the declared one only
    assert len(backend.refused) == 1
    line = backend.refused[0]
    assert "no bubblewrap" in line and "NO isolation" in line and "smolbench_backend_process" in line
    assert line in backend.notes


def test_a_cluster_of_only_such_nodes_is_refused_in_that_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's side, with the agents stood in: nothing to run machines on is one line."""
    from smolbench.cluster import agent as agent_module
    from smolbench.cluster.backend import ClusterBackend, Node

    monkeypatch.setattr("smolbench.backends.sandbox.shutil.which", lambda name: None)
    line = agent_module.refusal("auto", "abcdef0123")
    assert line.startswith("node abcdef01 (") and "smolbench_backend_process" in line
    assert agent_module.refusal("process", "abcdef0123") == agent_module.refusal("sandbox", "x") == ""
    cb = ClusterBackend("127.0.0.1:1")
    cb.nodes = {"n1": Node("n1", None, 4, backend="starting")}
    cb._described({"node": "n1", "backend": "process", "host": "h", "swept": [], "refused": line})
    cb._described({"node": "n1", "backend": "process", "host": "h", "swept": [], "refused": line})  # a later status
    assert cb._alive() == [] and cb.nodes["n1"].backend == "refused" and cb.refused == [line]
    with pytest.raises(SmolbenchError, match="no bubblewrap"):
        agent_module.NodeAgent._allowed(type("A", (), {"refused": line})())  # type: ignore[arg-type]
