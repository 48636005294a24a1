"""A run folder is never left without an owner the next sweep can attribute.

Reproduced (audit): a kernel SIGKILLed between ``_rundir.make``'s mkdir and its write of
``owner`` left a ``smolbench-*`` folder that every later sweep skipped (no owner record), so
it stayed in $TMPDIR for good. Each kill point is made in a child process that patches it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from smolbench.backends import _rundir

REPO = str(Path(__file__).resolve().parents[1])

PATCHES = {  # kill this process at that point of make()
    "mkdir": "real = tempfile.mkdtemp\n"
             "def mkdtemp(*a, **k):\n    real(*a, **k)\n    os.kill(os.getpid(), signal.SIGKILL)\n"
             "tempfile.mkdtemp = mkdtemp\n",
    "owner written": "_rundir._rename_new = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n",
    "live": "real = tempfile.mkdtemp\n"
            "def mkdtemp(*a, **k):\n    print(real(*a, **k), flush=True)\n    time.sleep(600)\n"
            "tempfile.mkdtemp = mkdtemp\n",
}


def child(base: Path, at: str) -> subprocess.Popen[str]:
    code = ("import os, signal, sys, tempfile, time\nfrom smolbench.backends import _rundir\n" + PATCHES[at]
            + "_rundir.make(sys.argv[1])\n")
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.Popen([sys.executable, "-c", code, str(base)], env=env, stdout=subprocess.PIPE, text=True)


def ours(base: Path) -> list[str]:
    return sorted(p.name for p in base.iterdir() if p.name.startswith(_rundir.PREFIX))


@pytest.mark.parametrize("at", ["mkdir", "owner written"])
def test_a_kernel_killed_while_making_its_run_folder_leaves_nothing_the_next_sweep_keeps(
        tmp_path: Path, at: str) -> None:
    proc = child(tmp_path, at)
    assert proc.wait(60) == -signal.SIGKILL
    assert ours(tmp_path)  # it got as far as the folder
    _rundir.sweep(str(tmp_path))
    assert ours(tmp_path) == []


def test_a_live_owners_folder_is_never_swept_even_while_it_is_made(tmp_path: Path) -> None:
    mine = _rundir.make(str(tmp_path))
    proc = child(tmp_path, "live")
    try:
        assert proc.stdout is not None
        making = Path(proc.stdout.readline().strip())  # made, its owner not written yet
        assert making.is_dir()
        assert _rundir.sweep(str(tmp_path)) == []
        assert mine.is_dir() and making.is_dir()
    finally:
        proc.kill()
        proc.wait(60)
    assert _rundir.sweep(str(tmp_path)) == [making]  # its owner is gone now
    assert ours(tmp_path) == [mine.name] and (mine / _rundir.OWNER).read_text().split()[0] == str(os.getpid())
