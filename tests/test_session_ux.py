"""What a teacher and students met through the Session (the magics sit on it): a namespace the
up left things in, `use("best")` after a fork whose branches all failed, episodes that fail
with a bare NameError, a silent install of the Smolfile's packages, a checkpoint path said
relative to "this notebook's folder" in a script."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import smolbench
from smolbench import CompositeError, SmolbenchError

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("backend", ["process", pytest.param("sandbox", marks=needs_bwrap)])
def test_a_fresh_machine_s_namespace_holds_nothing_of_the_up(here: Path, backend: str) -> None:
    """The Python-version probe ran as a cell in the user's namespace: `_` was '3.11.7' and
    `_s` was sys in every fresh machine."""
    with smolbench.Session(backend=backend, ledger="ledger.db", on_notice=lambda line: None) as s:
        names = s.run("sorted(k for k in globals() if not k.startswith('__'))").value
        assert names == ["_", "display", "smolbench_guest"], names  # `_`: run() brings the value back in it
        assert s.run("repr(_)").value == "None"  # (run() set it before the code), never '3.11.7'
        assert s.status()["guest_python"].startswith("3."), s.status()


def test_a_backend_that_can_t_ask_its_agent_still_leaves_the_namespace_alone(here: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster's backend has no ``info``: the version is printed by a cell, nothing assigned."""
    from smolbench.backends._agenthost import AgentHostBackend

    monkeypatch.delattr(AgentHostBackend, "info")
    with smolbench.Session(backend="process", ledger="ledger.db", on_notice=lambda line: None) as s:
        names = s.run("sorted(k for k in globals() if not k.startswith('__'))").value
        assert names == ["_", "display", "smolbench_guest"], names
        assert s.status()["guest_python"].startswith("3."), s.status()
