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


def test_use_best_after_a_fork_whose_branches_all_failed_takes_the_best_live_branch(here: Path) -> None:
    """`use("best")` looked at the last fork only: after one whose branches all failed it said
    "no fork with a rewarded branch yet", though an earlier fork's best was alive."""
    notes: list[str] = []
    with smolbench.Session(backend="process", ledger="ledger.db", on_notice=notes.append) as s:
        s.fork(4, "reward = SEED * 10", seed_base=1)  # root.3 (40) kept
        with pytest.raises(CompositeError):
            s.fork(3, "raise ValueError('no')")
        assert s.use("best") == "root.3" == s.active
        assert notes[-1] == ("smolbench: the fork of 3 under root (run 2) has no rewarded branch (3 error): using the best "
                             "live rewarded branch, root.3 (reward 40), from the fork of 4 under root (run 1)")
        s.fork(2, "reward = SEED", keep="none")  # its best is deleted with the rest
        assert s.use("best") == "root.3"
        assert notes[-1].startswith("smolbench: the last fork's best, root.3.1, was deleted: using the best live "
                                    "rewarded branch, root.3 (reward 40)"), notes[-1]
        f = s.fork(2, "reward = SEED + 100")
        told = len(notes)
        assert s.use("best") == f.best["branch"] == "root.3.3" and len(notes) == told  # the last fork's: said nothing
        s.delete("root.3")
        with pytest.raises(SmolbenchError) as got:
            s.use("best")
        assert str(got.value) == ("no live rewarded branch to use: the last fork's best, root.3.3, was deleted; no other "
                                  "fork's rewarded branch is alive: `Session.replay(node)` rebuilds one, or name a live "
                                  "node (`Session.status()['live_machines']`)")


def test_episodes_that_all_miss_a_name_say_they_start_from_the_baseline(here: Path) -> None:
    """Episodes that used a variable of the active machine failed with a bare NameError."""
    with smolbench.Session(backend="process", ledger="ledger.db", on_notice=lambda line: None) as s:
        s.run("cart = 7")
        with pytest.raises(CompositeError) as got:
            s.episodes(2, "reward = cart")
        assert str(got.value) == ("2 of 2 episodes failed (2 error); first: [ep1.0] error: NameError: name 'cart' is not "
                                  "defined; episodes start fresh from the default spec's baseline, not from the active "
                                  "machine root: `Session.fork(n, code)` branches it")
        with pytest.raises(CompositeError) as got:  # not all of them a NameError: nothing more said
            s.episodes(2, "if SEED: reward = cart\nelse: raise ValueError('no')")
        assert str(got.value).endswith("error: ValueError: no"), got.value
        assert s.fork(2, "reward = cart + SEED", keep="none").best["reward"] == 8


def test_episodes_that_all_miss_a_module_say_pct_pip_installs_stay_in_the_active_machine(here: Path) -> None:
    """`%pip install` in the active machine, then episodes importing it: a bare ModuleNotFoundError."""
    with smolbench.Session(backend="process", ledger="ledger.db", on_notice=lambda line: None) as s:
        with pytest.raises(CompositeError) as got:
            s.episodes(2, "import no_such_module_pip_put_in_root")
        assert str(got.value) == (
            "2 of 2 episodes failed (2 error); first: [ep1.0] error: ModuleNotFoundError: No module named "
            "'no_such_module_pip_put_in_root'; episodes start fresh from the default spec's baseline, without what "
            "`%pip` installed in the active machine root: list the package in a Smolfile's `packages` (installed at "
            "up, which every episode has)")


def _quick_pip(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    """pip stood in for by a program that makes the target folder (no index, no network)."""
    import sys

    from smolbench import packages

    monkeypatch.setenv("SMOLBENCH_CACHE", str(cache))
    monkeypatch.setattr(packages, "pip_command", lambda requirements, guest, target: [
        sys.executable, "-c", f"import os; os.makedirs({str(target)!r})"])


def test_up_says_so_before_it_installs_the_smolfile_s_packages(here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`up` said nothing while pip installed the Smolfile's packages (11 s for scipy and pandas)."""
    _quick_pip(monkeypatch, here / "cache")
    (here / "Smolfile").write_text('packages = ["tomli-w==1.2.0", "six"]\n')
    notes: list[str] = []
    with smolbench.Session(backend="process", ledger="ledger.db", on_notice=notes.append):
        pass
    assert notes == ["smolbench: installing 2 packages from the Smolfile (first time only; cached after) …"], notes
    with smolbench.Session(backend="process", ledger="ledger.db", on_notice=notes.append):
        pass
    assert len(notes) == 1  # cached: nothing to say


def test_a_missing_checkpoint_file_is_relative_to_the_working_directory_in_a_script(here: Path) -> None:
    """A script was told "(it is relative to this notebook's folder)"."""
    s = smolbench.Session(backend="process", ledger="ledger.db", on_notice=lambda line: None)
    try:
        with pytest.raises(SmolbenchError) as got:
            s.checkpoint_restore("../class/x.smolcheckpoint")
    finally:
        s.down()
    assert str(got.value) == (f"no file ../class/x.smolcheckpoint: check the path (it is relative to the working "
                              f"directory, {here})")


def test_use_best_also_takes_a_branch_of_a_fork_made_from_the_tree_view(here: Path) -> None:
    from smolbench._blocking import _block

    notes: list[str] = []
    with smolbench.Session(backend="process", ledger="ledger.db", on_notice=notes.append) as s:
        wb = s.workbench
        assert wb is not None
        made = wb.new_fork(2, None, 5, parent="root")  # what the view's Fork button does
        _block(wb.fork(made, "reward = SEED", lambda branch, event: None))
        with pytest.raises(CompositeError):
            s.fork(2, "raise ValueError('no')")
        assert s.use("best") == "root.1"
        assert notes[-1].endswith("using the best live rewarded branch, root.1 (reward 6), from the fork run1 under root")
