"""`smolbench doctor --allow HOST:PORT` checks the path that failed on a fresh machine (issue
26): a sandbox machine asks the egress proxy for a host by name, and the proxy (as the
sandbox uid, when doctor runs as root) resolves and connects. ``localhost`` stands in for a
package index's name (this host resolves it from /etc/hosts: nothing leaves the host); its
address is listed singly with the port, since a name resolving to this host needs that."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def _doctor(cwd: Path, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "smolbench.cli", "doctor", *args], capture_output=True, text=True,
                         cwd=cwd, timeout=600, env={**os.environ, "SMOLBENCH_TEST_WEAKEN": ""})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_doctor_checks_that_a_listed_host_resolves_and_connects(open_tmp: Path) -> None:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        port = srv.getsockname()[1]
        text = _doctor(open_tmp, "--allow", f"localhost:{port},127.0.0.1/32:{port}")
        assert f"OK: localhost:{port} resolved and connected through the egress proxy" in text, text
        # a name listed without its address: resolving to this host is refused, and doctor says so
        text = _doctor(open_tmp, "--allow", f"localhost:{port}")
        assert f"FAILED: localhost:{port} through the egress proxy: HTTP/1.1 403 smolbench: localhost:{port} is not " \
               "allowed" in text, text
    assert "network by name: not checked (`smolbench doctor --allow pypi.org:443`" in _doctor(open_tmp)
