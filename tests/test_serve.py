"""`smolbench serve` through its real command line, in its own process: what it says as it
starts (the port it has, or one line why it has none), how soon it stops, and what its HTTP
routes tell a client (a stateless step, a seed that is not a whole number).
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from gymhelpers import CODE_ENV, WAITING, needs_bwrap, waits
from test_openenv_server import WAIT, free_port, server_env

from smolbench.backends import _procs

pytest.importorskip("openenv.core.env_server.http_server")
pytestmark = [needs_bwrap, pytest.mark.timeout(900), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

# A step that takes 30 s (it names its thread first, so a test sees it has begun): the warm
# parent's practice episode steps it as soon as the server starts, with no client at all.
SLOW_ENV = f'''
import ctypes, time, gymnasium

class Slow(gymnasium.Wrapper):
    def step(self, action):
        ctypes.CDLL(None).prctl(15, {WAITING.encode()!r}, 0, 0, 0)
        time.sleep(30)
        return self.env.step(action)

def slow():
    return Slow(gymnasium.make("CartPole-v1"))
'''
SAYS_URL = re.compile(r"smolbench: serving \S+ over OpenEnv \S+ on (http://127\.0\.0\.1:(\d+)/\S+) ")


class Served:
    def __init__(self, proc: subprocess.Popen[str], lines: list[str]) -> None:
        self.proc, self.lines = proc, lines
        self.url, self.port = "", 0

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def machines(self) -> list[tuple[int, str]]:
        """Every process below the server (its machines')."""
        return _procs.descendants(self.proc.pid)


@contextmanager
def serve(folder: Path, target: str, *options: str) -> Iterator[Served]:
    """``smolbench serve TARGET`` (envs.py holds CODE_ENV and SLOW_ENV) on the sandbox backend,
    once it says its URL; killed at the end if still running."""
    (folder / "envs.py").write_text(CODE_ENV + SLOW_ENV)
    proc = subprocess.Popen([sys.executable, "-m", "smolbench.cli", "serve", target, "--backend", "sandbox", *options],
                            cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=server_env())
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    served = Served(proc, lines)
    try:
        deadline = time.monotonic() + 600  # importing OpenEnv's stack takes long on a loaded 2-core host
        while not (said := SAYS_URL.search(served.out)):
            assert proc.poll() is None and time.monotonic() < deadline, served.out
            time.sleep(0.2)
        served.url, served.port = said[1], int(said[2])
        yield served
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        reader.join(10)


def test_a_port_in_use_is_one_line_before_any_machine_or_url(open_tmp: Path) -> None:
    """On the old code it booted a machine and built the env, printed a URL it did not have
    ("give clients the whole URL ..."), then uvicorn's own ``ERROR: [Errno 98] ...``, exit 3."""
    (open_tmp / "envs.py").write_text(CODE_ENV)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "smolbench.cli", "serve", "envs.py:code_env", "--backend", "sandbox",
                               "--port", str(port)], cwd=open_tmp, capture_output=True, text=True, timeout=WAIT * 5,
                              env=server_env())
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == "", done.stdout  # no URL, no "give clients the whole URL"
    assert done.stderr.splitlines() == [f"smolbench serve: port {port} on 127.0.0.1 is in use: [Errno 98] Address already "
                                        "in use; pick another with --port N (or --port 0 for any free one)"], done.stderr
    assert not (open_tmp / ".smolbench").exists()  # no session, no machine, was started


def test_port_0_serves_on_a_free_port_the_url_it_prints_names(open_tmp: Path) -> None:
    """``--port 0`` (what the port-in-use line suggests; refused on the old code): the URL names
    the port it got, and serves."""
    import httpx

    with serve(open_tmp, "envs.py:code_env", "--port", "0") as server:
        assert server.port != 0
        r = httpx.post(f"{server.url}/reset", json={"seed": 1}, timeout=WAIT)
        assert r.status_code == 200 and r.json()["observation"]["machine"], r.text
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(WAIT) == 0, server.out


def test_over_http_a_step_with_no_episode_and_a_bad_seed_are_told_as_they_are(open_tmp: Path) -> None:
    """OpenEnv's HTTP routes are stateless (a session of its own for each request, closed after
    it): a ``POST /step`` never has an episode. On the old code it said ``the env (machine ?):
    step() before reset() ...``, a placeholder and advice HTTP can't follow. Any seed that is
    not a whole number from 0 to 2**63-1 (``true``, ``1.0``, ``"1"``, ``-1`` too) is smolbench's
    one line, 400 (the README said OpenEnv's 422, taking ``true`` as 1)."""
    import httpx

    with serve(open_tmp, "envs.py:code_env", "--port", "0") as server:
        r = httpx.post(f"{server.url}/step", json={"action": {"action": "x = 1"}}, timeout=WAIT)
        said = r.json()["detail"]
        assert r.status_code == 400 and "?" not in said and "\n" not in said, r.text
        assert said.startswith("no episode to step: OpenEnv's HTTP POST /step is stateless"), said
        assert "WebSocket" in said and "/ws" in said, said
        for seed in (True, 1.0, "1", -1, 2**63, {"x": 1}):
            r = httpx.post(f"{server.url}/reset", json={"seed": seed}, timeout=WAIT)
            assert r.status_code == 400 and r.json()["detail"].startswith("seed should be a whole number"), (seed, r.text)
            assert "\n" not in r.json()["detail"]
        r = httpx.post(f"{server.url}/reset", content=b"{", headers={"content-type": "application/json"}, timeout=WAIT)
        assert r.status_code == 422, r.text  # not JSON at all: OpenEnv's own (FastAPI's) answer
        r = httpx.post(f"{server.url}/reset", json={"seed": 1, "episode_id": 5}, timeout=WAIT)
        assert r.status_code == 422, r.text  # and its model's own fields (the README says which)
        assert httpx.post(f"{server.url}/reset", json={"seed": 1}, timeout=WAIT).status_code == 200
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(WAIT) == 0, server.out


def test_sigterm_with_no_client_stops_at_once_while_the_practice_episode_waits_on_a_slow_step(open_tmp: Path) -> None:
    """The warm parent's practice episode is the server's own, not a client's: a stop ends it
    and deletes its machine. On the old code the stop waited for it to run out its 20 s
    (``practice.PRACTICE_TIMEOUT``): ~19 s once its 30 s step had begun. The bound is half of
    that; a server whose env steps quickly stops in about a second."""
    with serve(open_tmp, "envs.py:slow", "--port", str(free_port())) as server:
        deadline = time.monotonic() + WAIT
        while not waits(server.machines()):  # the practice episode's step has begun
            assert time.monotonic() < deadline and server.proc.poll() is None, server.out
            time.sleep(0.1)
        machines = server.machines()
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(WAIT)
        took = time.monotonic() - start
    assert code == 0, server.out
    assert "stopped; every machine it made is deleted" in server.out, server.out
    assert took < 10, f"the stop took {took:.1f} s"
    assert not [p for p in machines if _procs.running(*p)], "machines left after the stop"


def test_the_token_is_kept_out_of_the_command_line_other_users_read(open_tmp: Path) -> None:
    """The audit: ``--token TOKEN`` (what the help offered to keep one token) put the secret in
    /proc/PID/cmdline, which every local user reads: the very users a loopback server's token
    keeps out. ``--token-file`` (or $SMOLBENCH_SERVE_TOKEN) keeps it out; a token on the command
    line still works, with one warning line."""
    import httpx

    token = "t0ken-" + "x" * 26
    (open_tmp / "token").write_text(token + "\n")
    (open_tmp / "token").chmod(0o600)
    with serve(open_tmp, "envs.py:code_env", "--port", "0", "--token-file", str(open_tmp / "token")) as server:
        assert server.url.endswith(f"/{token}"), server.out
        cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
        assert token.encode() not in cmdline and b"--token-file" in cmdline
        assert httpx.post(f"{server.url}/reset", json={"seed": 1}, timeout=WAIT).status_code == 200
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(WAIT) == 0, server.out
    assert "warning" not in server.out, server.out

    def refused(*options: str) -> str:  # --keyfile without --certfile: refused after the token, before any machine
        done = subprocess.run([sys.executable, "-m", "smolbench.cli", "serve", "--gym", "CartPole-v1", *options,
                               "--keyfile", "k.pem"], cwd=open_tmp, capture_output=True, text=True, timeout=WAIT * 5,
                              env=server_env())
        assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
        return done.stderr

    said = refused("--token", token)
    assert said.splitlines() == ["smolbench serve: warning: --token TOKEN puts the token in this process's command line, "
                                 "which every local user can read (ps, /proc/PID/cmdline): give it as "
                                 "$SMOLBENCH_SERVE_TOKEN or --token-file PATH instead",
                                 "smolbench serve: --keyfile needs --certfile: give the certificate (PEM) it goes with"]
    assert "warning" not in refused("--token", "none") + refused("--token-file", "token")
    (open_tmp / "token").chmod(0o640)  # others may read it: refused, as ssh refuses such a key
    assert refused("--token-file", "token").splitlines() == [
        "smolbench serve: --token-file token can be read or written by others (mode 0640): chmod 600 token"]
    assert "give either --token or --token-file" in refused("--token", token, "--token-file", "token")


def test_auto_never_serves_clients_from_plain_processes(open_tmp: Path) -> None:
    """With no microVM and no bubblewrap, ``auto`` fell back to the process backend with a
    warning, and served every client from plain processes of this user: the served file's code
    (and each client's actions) ran on the host, its branches able to see each other. Now
    ``auto`` refuses before any of it runs; ``--backend process`` still serves when asked."""
    ran = open_tmp / "ran-on-the-host"
    (open_tmp / "envs.py").write_text(f"open({str(ran)!r}, 'w').close()\n" + CODE_ENV)
    no_bwrap = open_tmp / "bin"  # this Python, and no bwrap
    no_bwrap.mkdir()
    (no_bwrap / "python").symlink_to(sys.executable)
    env = {**server_env(), "PATH": str(no_bwrap), "SMOLBENCH_SMOL_PROBE": "skip"}
    proc = subprocess.Popen([sys.executable, "-m", "smolbench.cli", "serve", "envs.py:code_env", "--port", "0"],
                            cwd=open_tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert proc.stdout is not None
        said = []
        for line in proc.stdout:  # (the old code served: stop at its URL)
            said.append(line)
            if "http://" in line:
                break
        served = "".join(said)
        assert "http://" not in served and proc.wait(timeout=WAIT) == 2, served
    finally:
        proc.kill()
        proc.wait()
    assert "smolbench serve: no microVM and no bubblewrap here, so clients' machines would be plain processes" \
        in served and "--backend process" in served, served
    assert not ran.exists()
