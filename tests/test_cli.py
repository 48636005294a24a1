"""The `smolbench` command as a new user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def smolbench(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "smolbench.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env={**os.environ})


def test_demo_runs_the_fork_exploration_notebook_and_prints_its_story(tmp_path: Path) -> None:
    out = smolbench("demo", "--backend", "sandbox", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "up on sandbox" in text and "not a VM" in text
    assert "fork of 16 · 16 ok" in text
    assert "best reward per round" in text
    assert "smolbench: deleted" in text  # everything it started is gone
    assert not (tmp_path / ".smolbench").exists()  # it worked in its own scratch directory


def test_demo_with_a_missing_notebook_says_so_in_one_line(tmp_path: Path) -> None:
    out = smolbench("demo", "--notebook", str(tmp_path / "nope.ipynb"), cwd=tmp_path)
    assert out.returncode != 0
    assert "nope.ipynb" in out.stderr


def test_doctor_explains_each_backend(tmp_path: Path) -> None:
    out = smolbench("doctor", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "microVMs (smol backend)" in text and "/dev/kvm" in text
    assert ("OK:" in text.split("\nsandbox backend\n")[1]) or "apt-get install bubblewrap" in text
    assert "network inside: 'unreachable'" in text or "bubblewrap is not installed" in text


def test_doctor_says_which_network_tools_the_sandbox_lacks(tmp_path: Path) -> None:
    """The sandbox's network policy runs `nft` and `ip` in each machine that lists an address:
    the doctor looks for them as the sandbox does, and says the one install that fixes it."""
    from smolbench.cli import net_tools

    assert net_tools(str(tmp_path)) == [
        "nft: missing", "ip: missing",
        "→ apt-get install nftables iproute2: without them a sandbox machine whose network lists an address or a "
        "network (or is net = true) can't start"]
    (tmp_path / "nft").write_text("#!/bin/sh\n")
    (tmp_path / "nft").chmod(0o755)
    assert net_tools(str(tmp_path))[0] == f"nft: {tmp_path / 'nft'}"
    assert net_tools(str(tmp_path))[2].startswith("→ apt-get install iproute2: ")
    text = smolbench("doctor", cwd=tmp_path).stdout
    assert "\n  nft: " in text.split("\nsandbox backend\n")[1] and "\n  ip: " in text, text


def test_python_dash_m_smolbench_is_the_command(tmp_path: Path) -> None:
    """Where the script is not on PATH (a venv not activated), `python -m smolbench` said "No
    module named smolbench.__main__"."""
    out = subprocess.run([sys.executable, "-m", "smolbench", "serve", "--help"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage: smolbench serve")
