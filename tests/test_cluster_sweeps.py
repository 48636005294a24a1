"""What a cluster leaves on a host's disk, without Ray: a killed ``smolbench cluster local``'s
folder is swept by the next one (only a dead owner's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from smolbench.backends._procs import start_time
from smolbench.cluster import local


def _owned_by(folder: Path, pid: int) -> Path:
    folder.mkdir(mode=0o700)
    (folder / "auth_token").write_text("x" * 64)
    (folder / "ray" / "session_1" / "logs").mkdir(parents=True)
    (folder / "owner").write_text(f"{pid} {start_time(pid)}\n")
    return folder


def test_a_killed_local_clusters_folder_goes_with_its_ray_processes_never_a_live_ones(tmp_path: Path) -> None:
    """The audit: a ``smolbench cluster local`` killed with kill -9 left its ``sbray-*`` folder
    (token, Ray's logs, nodes' run folders) for good. Its owner is recorded now, as a run folder's."""
    dead_owner = subprocess.Popen([sys.executable, "-c", "pass"])
    dead = _owned_by(tmp_path / "sbray-dead0001", dead_owner.pid)
    dead_owner.wait()  # gone: its pid and start time no longer match a process
    live_owner = subprocess.Popen(["sleep", "600"])
    # a Ray process of the killed cluster, still dying: its folder is on its command line
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", f"{dead}/ray/raylet"])
    try:
        live = _owned_by(tmp_path / "sbray-live0001", live_owner.pid)
        older = tmp_path / "sbray-older001"  # made before owners were recorded: whose, nobody knows
        older.mkdir()
        other = _owned_by(tmp_path / "smolbench-run0001", dead_owner.pid)  # not a cluster's
        assert local.sweep_killed(str(tmp_path)) == [dead]
        assert not dead.exists() and (live / "auth_token").exists() and older.exists() and other.exists()
        assert stray.wait(timeout=10) == -9  # killed before its folder went
    finally:
        for p in (live_owner, stray):
            p.kill()
            p.wait()

