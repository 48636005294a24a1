"""A sandbox machine's pid 1 (its agent) reaps the orphans re-parented to it, and only them.

Before, a process whose parent exited first (``sh -c 'sleep 0.1 &'``, a daemon) stayed a
zombie for ever, each holding one of the machine's ``pids``: with ``pids = 64`` a short
fork bomb left the machine unable to start any process (BlockingIOError) or to be forked,
until a new machine. The cell's own children keep their exit status for its own waits.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import smolbench

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

# In the machine: its zombies (state Z in its own /proc); and what is left of its other
# processes, zombies or alive, once those that can go are gone.
ZOMBIES = """
import os, time

def processes(zombies_only=False):
    out = []
    for p in os.listdir('/proc'):
        if p.isdigit():
            try:
                with open('/proc/%s/stat' % p) as fh:
                    if not zombies_only or fh.read().rsplit(')', 1)[1].split()[0] == 'Z':
                        out.append(int(p))
            except OSError:
                pass
    return out

def zombies():
    return processes(zombies_only=True)

def settled(keep=()):
    # orphans end 0.05-0.1 s after their parent, then are reaped: wait until the processes left
    # (alive or zombies) are only us and `keep`. Not the zombies only: an orphan still asleep
    # holds one of the machine's pids too, and is a zombie to reap a moment later.
    deadline = time.monotonic() + 10
    while True:
        left = [p for p in processes() if p != os.getpid() and p not in keep]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)
"""

ORPHANS = "import subprocess\nfor i in range(20): subprocess.run('sleep 0.05 &', shell=True)\ntime.sleep(0.2)\n"


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Smolfile").write_text("pids = 64\n")
    with smolbench.Session("Smolfile", backend="sandbox", ledger="ledger.db", on_notice=lambda line: None) as s:
        s.run(ZOMBIES)
        yield s


def test_orphans_are_reaped_and_the_cell_s_own_children_keep_their_exit_status(sandbox: smolbench.Session) -> None:
    s = sandbox
    r = s.run(ORPHANS + "[len(settled()), os.getpid()]")
    assert r.error is None and r.value == [0, 1], (r.value, r.error)  # 20 orphans of pid 1: none left

    # the cell's own children, ended long before their code waits: each keeps its status
    r = s.run(
        "import multiprocessing, subprocess, sys\n"
        "codes = [subprocess.run(['false']).returncode]\n"
        "p = subprocess.Popen(['sh', '-c', 'exit 3'])\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(7)\n"
        "mp = multiprocessing.get_context('fork').Process(target=sys.exit, args=(5,))\n"
        "mp.start()\n"
        "while len(zombies()) < 3:\n"
        "    time.sleep(0.01)\n"
        + ORPHANS  # orphans end meanwhile, and are reaped around the cell's own zombies
        + "left = settled(keep=(p.pid, pid, mp.pid))\n"
        "time.sleep(1)\n"
        "mp.join()\n"
        "codes += [p.wait(), os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), mp.exitcode, len(left)]\n"
        "codes"
    )
    assert r.error is None and r.value == [1, 3, 7, 5, 0], (r.value, r.error)
    # os.system and os.fork still pickle by reference (a __reduce__ naming them, a Pool sending them)
    r = s.run("import pickle\n[pickle.loads(pickle.dumps(f)) is f for f in (os.system, os.fork, os.posix_spawn)]")
    assert r.error is None and r.value == [True, True, True], (r.value, r.error)


def test_a_fork_bomb_of_orphans_leaves_the_machine_usable(sandbox: smolbench.Session) -> None:
    s = sandbox
    r = s.run(
        "import subprocess\n"
        "refused = 0\n"
        "for i in range(200):\n"
        "    try:\n"
        "        subprocess.run(['sh', '-c', 'sleep 0.1 &'])\n"
        "    except OSError:\n"
        "        refused += 1\n"
        # the bomb ends with the machine at its pids, ~57 orphans asleep: all of them end and are reaped
        "left = settled()\n"
        "[len(left), subprocess.run(['sh', '-c', 'echo still here'], capture_output=True, text=True).stdout]"
    )
    assert r.error is None and r.value == [0, "still here\n"], (r.value, r.error)
    r = s.run("procs = [subprocess.Popen(['sleep', '0.2']) for _ in range(12)]\n[p.wait() for p in procs]")
    assert r.error is None and r.value == [0] * 12, (r.value, r.error)  # 12 at once: every pid is back
    # branches can still be made, and each (pid 1 of its own) reaps its own orphans
    f = s.fork(2, ORPHANS + "reward = len(settled())", keep="all")
    assert sorted(f.rewards.values()) == [0.0, 0.0]
    e = s.episodes(2, ZOMBIES + ORPHANS + "reward = len(settled())")  # fresh from the baseline: leaf branches
    assert sorted(e.rewards.values()) == [0.0, 0.0]


def test_children_the_cell_makes_one_after_another_keep_their_exit_status(sandbox: smolbench.Session) -> None:
    """The review: the reaper read the children list, then dropped every recorded child not in
    it; a child forked in between was dropped, and reaped as an orphan once it exited, so its
    `subprocess.run(...).returncode` read 0 (21 of 29,128 runs of `exit 3` in 20 s)."""
    r = sandbox.run("import subprocess, time\nend = time.monotonic() + 4\nwrong = runs = 0\n"
                    "while time.monotonic() < end:\n"
                    "    runs += 1\n"
                    "    wrong += subprocess.run(['/bin/sh', '-c', 'exit 3']).returncode != 3\n"
                    "[wrong, runs]")
    assert r.error is None, r.error
    wrong, runs = r.value
    assert runs > 100 and wrong == 0, (wrong, runs)


REAPER = "import threading\n[t.name for t in threading.enumerate() if t.name == 'smolbench-orphans']"
C_CHILD = ("import ctypes, time\nlibc = ctypes.CDLL(None)\nlibc.fork.restype = ctypes.c_int\n"
           "if libc.fork() == 0:\n    libc.system(b'sleep 0.05 &')\n    libc._exit(0)\ntime.sleep(0.3)")


def test_the_reaper_starts_with_the_machine_s_first_child_and_only_then(sandbox: smolbench.Session) -> None:
    """A branch that never makes a process (a fork's --keep none, an episode) starts no reaper
    thread: ~0.3 ms of CPU and ~90 page faults a branch. A process made any way starts it,
    one made in C (not recorded) at its cell's end, and the orphans are reaped from then on."""
    s = sandbox
    fork = s.fork(3, "import threading\nreward = sum(t.name == 'smolbench-orphans' for t in threading.enumerate())",
                  keep="all")
    assert sorted(r["reward"] for r in fork.rows.values()) == [0.0, 0.0, 0.0], fork
    first, second, third = sorted(fork.rows)
    for node in (first, second):
        s.use(node)
        assert s.run(REAPER).value == [], node
        s.run("import subprocess\nsubprocess.run(['true'])")
        assert s.run(REAPER).value == ["smolbench-orphans"], node
        s.run(ORPHANS)
        assert s.run("settled()").value == [], node
    s.use(third)  # a child made in C: its cell's end starts the reaper, which reaps its orphan
    assert s.run(C_CHILD).error is None
    assert s.run(REAPER).value == ["smolbench-orphans"]
    assert s.run("settled()").value == []
