"""Issue 27: wide forks at the default Smolfile, through a real kernel on the sandbox backend.

Every branch is in its own cgroup before it allocates anything (it waits, a bare fork, until
the host moved it), so a fork of N is bounded by N times the branch's limit, not by the root's:
fork 256 used to die at about 204 branches ("Memory cgroup out of memory" in the root's cgroup).
Speed is measured in ``bench/scale.py``, never here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from nbformat import NotebookNode
from nbhelpers import NotebookSession, agent_processes, error_output, error_text, stream_text

from smolbench import Ledger

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")

AGENT = "/run/smolbench-agent/agent.py"


def ok(cell: NotebookNode) -> NotebookNode:
    err = error_output(cell)
    assert err is None, error_text(cell)
    return cell


@pytest.fixture
def session(open_tmp: Path) -> Iterator[NotebookSession]:
    """A kernel with a sandbox machine up at the default Smolfile (none in the folder)."""
    with NotebookSession(open_tmp, timeout=300, allow_errors=True) as nb:
        ok(nb.run("%load_ext smolbench"))
        ok(nb.run("%smol up --backend sandbox"))
        yield nb


def machines_alive(nb: NotebookSession) -> int:
    """Root machines and branches of this kernel (each agent is pid 1 of its own pid namespace)."""
    return agent_processes(nb)[0]


def statuses(cwd: Path, prefix: str) -> dict[str, str]:
    ledger = Ledger(cwd / ".smolbench" / "ledger.db")
    try:
        df = ledger.nodes()
    finally:
        ledger.close()
    df = df[df["id"].str.startswith(prefix)]
    return dict(zip(df["id"], df["status"]))


def test_fork_256_keep_none_at_the_default_smolfile_every_branch_ok(session: NotebookSession) -> None:
    nb = session
    ok(nb.run("%%smol\nwarm = list(range(100_000))"))
    cell = ok(nb.run("%%smol fork 256 --keep none --quiet\nreward = SEED + len(warm)"))
    assert "256 ok" in stream_text(cell), stream_text(cell)
    got = statuses(nb.cwd, "root.")
    assert len(got) == 256 and set(got.values()) == {"ok"}, {s: list(got.values()).count(s) for s in set(got.values())}
    assert machines_alive(nb) == 1  # --keep none: every branch is gone, the root answers
    assert "answered" in stream_text(ok(nb.run("%%smol\nprint('answered')")))


def test_a_memory_hungry_branch_during_a_big_fork_fails_alone(session: NotebookSession) -> None:
    nb = session
    cell = nb.run("%%smol fork 64 --keep none --allow-errors --quiet\n"
                  "if SEED == 7:\n"
                  "    hog = [bytearray(64 << 20) for _ in range(64)]  # 4 GiB: past the branch's 1G\n"
                  "reward = SEED")
    ok(cell)
    got = statuses(nb.cwd, "root.")
    assert got.pop("root.7") == "error"
    assert len(got) == 63 and set(got.values()) == {"ok"}
    assert machines_alive(nb) == 1
    assert "answered" in stream_text(ok(nb.run("%%smol\nprint('answered')")))


def test_a_fork_that_cant_fit_in_host_memory_is_refused_up_front_in_one_line(session: NotebookSession) -> None:
    nb = session
    # As if each branch took a whole host: none fits (the refusal comes before anything is forked).
    ok(nb.run("import smolbench.backends._limits as L\nL.BRANCH_HOST_MIB = 1 << 30"))
    cell = nb.run("%%smol fork 4 --keep none\npass")
    err = error_output(cell)
    assert err is not None
    line = err.evalue
    assert "\n" not in line and "fork of 4 refused" in line and "fork at most 0" in line, line
    assert machines_alive(nb) == 1


def _kids(pid: int) -> list[int]:
    out: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            out += [int(k) for k in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    return out


def _state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return "gone"
    return stat[stat.rfind(b")") + 2:].split()[0].decode()


def test_a_branch_agent_whose_keeper_died_is_reaped_and_its_siblings_live_on(session: NotebookSession) -> None:
    """A branch's keeper killed from outside: its agent (pid 1 of the branch's namespace) dies
    with it and is reparented to the root's agent, which reaps it (the agent's orphan scan,
    now of its own children only, not every process of the tree); the other branch still runs."""
    nb = session
    ok(nb.run("%%smol fork 3 --keep all\nx = 1"))
    roots = [p for p in nb.processes() if AGENT in p.cmdline and not p.cmdline.split()[0].endswith("bwrap")
             and len(_kids(p.pid)) >= 3]
    assert roots, [p.cmdline for p in nb.processes()]
    root = roots[0].pid
    keepers = [k for k in _kids(root) if AGENT in Path(f"/proc/{k}/cmdline").read_bytes().replace(b"\0", b" ").decode()]
    assert len(keepers) == 3, keepers
    agent = _kids(keepers[0])
    assert agent, "the keeper has no agent below it"
    os.kill(keepers[0], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and ({_state(k) for k in _kids(root)} & {"Z"} or _state(agent[0]) not in ("gone",)):
        time.sleep(0.1)
    assert "Z" not in {_state(k) for k in _kids(root)}, "a dead branch is left a zombie of the root's agent"
    assert _state(agent[0]) == "gone", _state(agent[0])
    ok(nb.run("%smol use root.1"))
    out = nb.run("%%smol\nprint('alive', x)")
    assert "alive 1" in stream_text(out), error_text(out)
