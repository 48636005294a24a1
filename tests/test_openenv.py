"""`smolbench serve`: OpenEnv's own client does reset/step round trips on loopback.

The server is the real command in its own process (OpenEnv's FastAPI app under uvicorn,
a sandbox Session behind it); the client is ``openenv``'s ``GenericEnvClient`` over its
WebSocket protocol. Two client sessions at once get their own machines (branches of one
warm parent), steps match gymnasium's own CartPole, a bad action is an error the session
survives, and SIGTERM stops the server with every machine deleted.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import gymnasium
import numpy as np
import pytest
from gymhelpers import needs_bwrap

openenv_client = pytest.importorskip("openenv.core.generic_client")
pytestmark = [needs_bwrap, pytest.mark.timeout(900)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_openenv_client_round_trip_against_smolbench_serve(open_tmp: Path) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "smolbench.cli", "serve", "--gym", "CartPole-v1", "--backend", "sandbox",
                             "--port", str(port)], cwd=open_tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        deadline = time.monotonic() + 600  # importing OpenEnv's stack takes long on a loaded 2-core host
        while not any("serving CartPole-v1 over OpenEnv" in line for line in lines):
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.5)
        said = re.search(rf"on (http://127\.0\.0\.1:{port}/[A-Za-z0-9_-]+) ", "".join(lines))
        assert said, "".join(lines)  # the URL clients use has the server's token in its path
        while True:  # uvicorn listens a moment after the line
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        here = gymnasium.make("CartPole-v1")
        url = said[1]
        with openenv_client.GenericEnvClient(base_url=url).sync() as one, \
                openenv_client.GenericEnvClient(base_url=url).sync() as two:
            first = one.reset(seed=3)
            want, _ = here.reset(seed=3)
            assert np.array_equal(np.float32(first.observation["observation"]), want) and not first.done
            other = two.reset(seed=4)
            assert other.observation["machine"] != first.observation["machine"]  # a branch each
            got = one.step({"action": 1})
            obs, reward, terminated, truncated, _ = here.step(1)
            assert np.array_equal(np.float32(got.observation["observation"]), obs)
            assert got.reward == reward == 1.0 and got.done == (terminated or truncated)
            assert one.state()["step_count"] == 1
            with pytest.raises(Exception, match="not in the action space"):
                one.step({"action": 9})
            assert one.step({"action": 0}).reward == 1.0  # the session goes on
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
        reader.join(10)
    out = "".join(lines)
    assert code == 0, out
    assert "stopped; every machine it made is deleted" in out
