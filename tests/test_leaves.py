"""Leaf branches (issue 27): a fork whose branches are deleted after their cell (``--keep none``,
episodes, gym machines) makes each branch one process, cloned into its own namespaces by one
maker, with no keeper (``smolbench/guest/leaves.py``). What must hold: each is still a machine
of its own (pid 1 of its own pid namespace, no privileges, the seccomp filter, its own files),
Python and libc work in it as in a fork child, nothing is left behind, and a leaf can't be
forked. The grants of their stores are in ``test_mount_guard.py``. Speed is in ``bench/scale.py``.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from nbhelpers import NotebookSession, agent_processes, error_output, error_text, stream_text

from smolbench import Session, _loop
from smolbench.errors import SmolbenchError

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")

# Run in each branch: every fact a machine of its own must have, asserted (a branch whose
# assertion fails is an error), then a sleep so the host can count the processes meanwhile.
FACTS = r'''
import ctypes, os, subprocess, threading, time
import numpy as np
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
assert os.getpid() == 1 and threading.get_native_id() == 1, (os.getpid(), threading.get_native_id())
assert sorted(int(p) for p in os.listdir("/proc") if p.isdigit()) == [1], os.listdir("/proc")
assert int(status["CapEff"], 16) == 0 and int(status["CapBnd"], 16) == 0, status["CapEff"]
assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2", status["Seccomp"]
assert open("/workspace/parent.txt").read() == "parent"
assert [n for n in sorted(os.listdir("/workspace")) if n[0] != "."] == ["parent.txt"], os.listdir("/workspace")  # no sibling's
open("/workspace/mine-%d.txt" % SEED, "w").write("x")
# libc's own record of this thread's id (the clone set it, as libc's fork does): found where a
# new thread (made by libc, so its record is right) keeps its id, and that is 1 here
libc = ctypes.CDLL(None)
libc.pthread_self.restype = ctypes.c_void_p
def tid_at(value):
    words = (ctypes.c_int * 256).from_address(libc.pthread_self())
    return {i for i in range(256) if words[i] == value}
seen = {}
t = threading.Thread(target=lambda: seen.update(at=tid_at(threading.get_native_id()))); t.start(); t.join()
assert seen["at"] & tid_at(1), "libc keeps another thread id for this one"
# what a cell does: threads, a fork, a subprocess, numpy's BLAS
t = threading.Thread(target=lambda: None); t.start(); t.join()
pid = os.fork()
if pid == 0:
    os._exit(7)
assert os.waitpid(pid, 0)[1] >> 8 == 7
assert subprocess.run(["sh", "-c", "exit 3"]).returncode == 3
assert float((warm @ warm).sum()) == 200.0 ** 3
time.sleep(HOLD)
reward = SEED
'''


@pytest.fixture
def nb(open_tmp: Path) -> Iterator[NotebookSession]:
    with NotebookSession(open_tmp, timeout=300, allow_errors=True) as session:
        assert error_output(session.run("%load_ext smolbench")) is None
        assert error_output(session.run("%smol up --backend sandbox")) is None
        yield session


def test_a_keep_none_branch_is_one_process_and_still_a_machine_of_its_own(nb: NotebookSession) -> None:
    cell = nb.run("%%smol\nimport numpy as np\nwarm = np.ones((200, 200))\nHOLD = 4\n"
                  "open('/workspace/parent.txt', 'w').write('parent')")
    assert error_output(cell) is None, error_text(cell)
    assert agent_processes(nb) == (1, 1)  # the root and its keeper
    cell = nb.run("%%smol fork 4 --keep none --bg --out bg\n" + FACTS)
    assert error_output(cell) is None, error_text(cell)
    deadline = time.monotonic() + 60
    while (counts := agent_processes(nb))[0] < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    # A branch's own os.fork() child runs the agent's code for a moment too (CI caught (5, 3)):
    # the fewest others seen while the 4 branches hold is the count of the steady ones.
    seen = [counts]
    for _ in range(20):
        time.sleep(0.05)
        seen.append(agent_processes(nb))
    counts = (max(c[0] for c in seen), min((c[1] for c in seen if c[0] == 5), default=-1))
    # 4 branches, each one process, and one maker for all of them (before: a keeper each)
    assert counts == (5, 2), seen
    done = nb.run("print(bg.wait().summary())")
    assert error_output(done) is None, error_text(done)
    assert "4 ok" in stream_text(done), stream_text(done)
    deadline = time.monotonic() + 30
    while agent_processes(nb) != (1, 1) and time.monotonic() < deadline:  # the maker ends once it reaped them
        time.sleep(0.05)
    assert agent_processes(nb) == (1, 1)  # every branch and the maker gone
    after = nb.run("%%smol\nimport os\nprint([n for n in sorted(os.listdir('/workspace')) if n[0] != '.'])")
    assert stream_text(after).strip() == "['parent.txt']"


def test_a_leaf_cannot_be_forked(tmp_path: Path) -> None:
    with Session(backend="sandbox", ledger=str(tmp_path / "ledger.db")) as s:
        wb = s._wb()
        root = wb.machines["root"]
        backend = wb.backend
        one = _loop.run(backend.branch(root, ["root.one"], [0], leaf=True))
        leaf, other = _loop.run(backend.branch(root, ["root.leaf", "root.other"], [0, 1], leaf=True))
        try:
            assert leaf.info.get("leaf") is True and other.info.get("leaf") is True
            # a branch alone is made the usual way (the maker would cost more than it saves)
            assert [r.info.get("leaf") for r in one] == [None]
            with pytest.raises(SmolbenchError, match="can't be forked: it was made to be deleted after its cell"):
                _loop.run(backend.branch(leaf, ["root.leaf.0", "root.leaf.1"], [0, 1]))
        finally:
            for ref in (*one, leaf, other):
                _loop.run(backend.delete(ref))


@pytest.mark.parametrize("weaken", ["", "leaf-tid"])
def test_libc_knows_a_leafs_thread_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, weaken: str) -> None:
    """The clone sets the thread id libc keeps, as libc's own fork does; a clone that leaves the
    maker's there (``leaf-tid``, tests only) is caught by the branch's own check above."""
    monkeypatch.setenv("SMOLBENCH_TEST_WEAKEN", weaken)
    with Session(backend="sandbox", ledger=str(tmp_path / "ledger.db")) as s:
        s.run("import numpy as np\nwarm = np.ones((200, 200))\nHOLD = 0\nopen('/workspace/parent.txt', 'w').write('parent')")
        f = s.fork(2, FACTS, keep="none", allow_errors=True)
        errors = {name: str(row.get("error") or "") for name, row in f.rows.items()}
        if weaken:
            assert all("libc keeps another thread id" in e for e in errors.values()), errors
        else:
            assert errors == {"root.0": "", "root.1": ""}, errors


def test_a_branch_imports_nothing_its_parent_had_not(tmp_path: Path) -> None:
    """A module a branch imports while it sets up, seeds or starts its first cell is imported in
    every branch (its CPU and its private pages, each time); the agent imports them in the
    parent just before it forks. numpy loads numpy.random at its first use, which seeding a
    branch is: ~8 ms and ~900 page faults of every branch of a parent that imported numpy, until
    the parent took it too."""
    with Session(backend="sandbox", ledger=str(tmp_path / "ledger.db")) as s:
        s.run("import numpy")
        f = s.fork(2, "import sys\nsmolbench_guest.report(mods=len(sys.modules))\nreward = 1", keep="none")
        parent = s.run("import sys\nlen(sys.modules)").value
        mods = [row["m.mods"] for row in f.to_pandas().to_dict("records")]
        assert mods and all(n <= parent for n in mods), (mods, parent)
