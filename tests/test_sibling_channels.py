"""Branches share no open file: a flag one sets on its fds 0-2 is seen by no sibling, nor by
its parent (third audit: they were the root machine's, one pipe and one ``/dev/null`` for the
whole tree, and an open file's flags are everyone's who holds it: a sibling read a secret
out of O_NONBLOCK toggled on fd 1)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import smolbench

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")

# SEED 0 sets O_NONBLOCK on its fds 0-2 and holds it; SEED 1 looks for it on its own for as long
SIGNAL = (
    "import fcntl, os, time\n"
    "def flagged():\n"
    "    return [fd for fd in (0, 1, 2) if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK]\n"
    "seen = []\n"
    "if SEED == 0:\n"
    "    for fd in (0, 1, 2):\n"
    "        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)\n"
    "    time.sleep(2.5)\n"
    "else:\n"
    "    end = time.monotonic() + 2.0\n"
    "    while not seen and time.monotonic() < end:\n"
    "        seen = flagged()\n"
    "        time.sleep(0.01)\n"
    "reward = len(seen)\n"
)


@pytest.fixture
def s(open_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[smolbench.Session]:
    monkeypatch.chdir(open_tmp)
    with smolbench.Session(backend="sandbox", ledger=open_tmp / "ledger.db") as session:
        session.run("import fcntl, os", check=True)
        yield session


@pytest.mark.parametrize("keep", ["none", "all"])  # leaf branches (one clone each) and two-process ones
def test_a_flag_a_branch_sets_on_its_std_fds_reaches_no_sibling_nor_its_parent(s: smolbench.Session, keep: str) -> None:
    got = s.fork(2, SIGNAL, keep=keep)
    assert [(b["status"], b["reward"]) for b in got] == [("ok", 0), ("ok", 0)], [b["error"] for b in got]
    parent = s.run("[fd for fd in (0, 1, 2) if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK]", check=True)
    assert parent.value == []


def test_concurrent_episodes_share_no_std_fds(s: smolbench.Session) -> None:
    got = s.episodes(2, SIGNAL, concurrency=2)
    assert [(b["status"], b["reward"]) for b in got] == [("ok", 0), ("ok", 0)], [b["error"] for b in got]
