"""Shared by the gym tests: a Workbench on the sandbox backend in this process, and envs
defined inside its machine (so the machine, not this process, holds their code)."""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium
import pytest

from smolbench import _loop
from smolbench.backends.sandbox import SandboxBackend
from smolbench.ledger import Ledger
from smolbench.spec import MachineSpec
from smolbench.workbench import Workbench

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")
CARTPOLE = functools.partial(gymnasium.make, "CartPole-v1")
# An env whose action is Python code run in its machine (an agent sandbox): what a client
# of `smolbench serve` could make it run. A reset with options {"hang": True} never answers.
CODE_ENV = '''
import string, numpy as np, gymnasium as gym
from gymnasium import spaces as S

class CodeEnv(gym.Env):
    """The action is Python code run in the machine (an agent sandbox)."""
    def __init__(self):
        self.observation_space = S.Box(-1, 1, (1,), np.float32)
        self.action_space = S.Text(4096, charset=string.printable)
    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        if options and options.get("hang"):
            import time
            time.sleep(10**6)
        if options and options.get("mark"):  # tests find this episode's machine by its name
            import ctypes
            ctypes.CDLL(None).prctl(15, b'smolbench-mine', 0, 0, 0)
        return np.zeros(1, np.float32), {}
    def step(self, action):
        ns = {}
        exec(action, ns)
        return np.zeros(1, np.float32), 0.0, False, False, ns.get("info", {})

def code_env():
    return CodeEnv()
'''


def up_bench(tmp_path_factory: Any, spec: MachineSpec | None = None) -> Iterator[Workbench]:
    """A machine up on the sandbox backend, its ledger in a fresh folder; deleted afterwards."""
    folder: Path = tmp_path_factory.mktemp("gym")
    wb = Workbench(SandboxBackend(), spec or MachineSpec(), Ledger(folder / "ledger.db"))
    _loop.run(wb.up())
    try:
        yield wb
    finally:
        _loop.run(wb.down())
        wb.ledger.close()


def define(wb: Workbench, code: str) -> None:
    """Run ``code`` in the session's active machine (an env prototyped there)."""
    res = _loop.run(wb.run_cell(code, lambda e: None))
    assert res.status == "ok", res.error


# The name a thread of a machine takes (prctl) while a test's env call waits there to be
# stopped: a test acts once it sees it, not after a guess at how long the call takes to come.
WAITING = "smolbench-waits"


def waits(procs: list[tuple[int, str]]) -> bool:
    """Whether a thread of ``procs`` is named :data:`WAITING`."""
    for pid, _ in procs:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                if Path(f"/proc/{pid}/task/{task}/comm").read_text().strip() == WAITING:
                    return True
            except OSError:
                continue
    return False
