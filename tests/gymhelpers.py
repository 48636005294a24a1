"""Shared by the gym tests: a Workbench on the sandbox backend in this process, and envs
defined inside its machine (so the machine, not this process, holds their code)."""

from __future__ import annotations

import functools
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
