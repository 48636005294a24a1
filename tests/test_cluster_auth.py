"""Audit: `smolbench cluster local` started Ray's ``Cluster`` with no authentication on the
host's routable address, so any host on the network (or local user) could run tasks as the
kernel's user. Now it listens on 127.0.0.1 and asks for a token kept in its own folder."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Ray is not installed: pip install 'jupyterlab-smolbench[ray]'")

AUTH = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
# a client that asks the head's GCS for its keys, printing what it got or which error
CLIENT = """
import sys
from ray._raylet import GcsClient
try:
    keys = GcsClient(address=sys.argv[1]).internal_kv_keys(b'', None, timeout=30)
    print('JOINED', len(keys))
except Exception as exc:
    print('REFUSED', type(exc).__name__)
"""


def client(address: str, home: Path, **auth: str) -> str:
    """What a fresh process with only ``auth`` (and no ~/.ray token: its own HOME) gets."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | {"HOME": str(home), **auth}
    done = subprocess.run([sys.executable, "-c", CLIENT, address], env=env, capture_output=True, text=True,
                          timeout=300)
    return (done.stdout.strip().splitlines() or [done.stderr[-2000:]])[-1]


def test_a_local_cluster_is_on_loopback_and_refuses_a_client_without_its_token(tmp_path: Path) -> None:
    from smolbench.cluster import local

    before = {k: os.environ.get(k) for k in AUTH}
    with local.LocalCluster(1, slots=1, backends=["process"]) as c:
        assert client(c.address, tmp_path).startswith("REFUSED AuthenticationError")
        assert c.address.rsplit(":", 1)[0] == "127.0.0.1"
        token = c.token_path
        assert token.parent == c.dir and stat.S_IMODE(token.stat().st_mode) == 0o600
        assert os.environ["RAY_AUTH_MODE"] == "token" and os.environ["RAY_AUTH_TOKEN_PATH"] == str(token)
        wrong = tmp_path / "wrong"
        wrong.write_text("0" * 64)
        assert client(c.address, tmp_path, RAY_AUTH_MODE="token",
                      RAY_AUTH_TOKEN_PATH=str(wrong)).startswith("REFUSED AuthenticationError")
        assert client(c.address, tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token)).startswith("JOINED")
        listening = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True).stdout.splitlines()
        pids = {str(n.all_processes[k][0].process.pid) for n in [c._cluster.head_node, *c.nodes]
                for k in ("gcs_server", "raylet") if k in n.all_processes}
        ours = [line for line in listening if any(f"pid={p}," in line for p in pids)]
        assert ours and all("127.0.0.1" in line.split()[3] for line in ours), ours
    assert not token.exists()
    assert {k: os.environ.get(k) for k in AUTH} == before
