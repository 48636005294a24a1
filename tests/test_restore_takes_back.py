"""A restore that fails takes down what it brought up, and only that: ``Session.checkpoint_restore``
and ``%smol checkpoint restore`` share one path for it (``Session._restore``).

Two ways the two paths differed: the magic brought its machine up before its ``try``, so a Ctrl-C
that landed as the up's lines were shown left that machine up, unasked for; and the Session's
take-down, when it failed too, replaced the restore's own error with its own (the user lost why
the restore failed). A machine that was up before a failed restore always stays, and stays active.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest
from nbhelpers import NotebookSession, ok, stream_text

import smolbench
from smolbench.errors import SmolbenchError
from smolbench.shelf import Shelf
from smolbench.workbench import Workbench


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _fails_once_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore of a name not here fails once its machine came up (it is refused before any
    machine now: test_checkpoint_name_suggestions.py), as a restore that fails in the machine does."""
    monkeypatch.setattr(Shelf, "refusal_before_up", lambda self, arg, room=None: None)


def _down_that_fails_after(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Workbench.down deletes the machines and then fails (its last ledger write, say)."""
    _fails_once_up(monkeypatch)
    real, calls = Workbench.down, []

    async def down(self: Workbench) -> int:
        calls.append(await real(self))
        raise RuntimeError("database is locked")

    monkeypatch.setattr(Workbench, "down", down)
    return calls


def test_a_take_down_that_fails_too_keeps_the_restores_own_error(here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    notes: list[str] = []
    s = smolbench.Session(backend="process", ledger="ledger.db", on_notice=notes.append)
    calls = _down_that_fails_after(monkeypatch)
    with pytest.raises(SmolbenchError, match=r"^no checkpoint named 'nope'"):
        s.checkpoint_restore("nope")  # its session came up for it, then the restore failed
    assert calls == [0] and not s.is_up  # no machine: the restored one is the session's first
    assert [n for n in notes if "brought up for it" in n] == [  # no machine was left: what failed is said
        "smolbench: no machine brought up for it is left, but ending the session it started failed too "
        "(RuntimeError: database is locked): `Session.down()` tries again"], notes
    monkeypatch.undo()
    s.down()


def test_a_take_down_that_left_the_machine_up_says_so(here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    notes: list[str] = []
    s = smolbench.Session(backend="process", ledger="ledger.db", on_notice=notes.append)
    _fails_once_up(monkeypatch)

    def up_then_fail(self: smolbench.Session, what: str) -> None:  # a machine up, then the restore's failure
        self.up()
        raise SmolbenchError(f"no checkpoint named {what!r}")

    monkeypatch.setattr(smolbench.Session, "_up_restoring", up_then_fail)
    real = Workbench.down

    async def down(self: Workbench) -> int:
        raise RuntimeError("database is locked")  # before any machine went

    monkeypatch.setattr(Workbench, "down", down)
    with pytest.raises(SmolbenchError, match=r"^no checkpoint named 'nope'"):
        s.checkpoint_restore("nope")
    assert [n for n in notes if "brought up for it" in n] == [
        "smolbench: taking down the machine brought up for it failed too (RuntimeError: database is locked): "
        "`Session.down()` deletes what is left"], notes
    monkeypatch.setattr(Workbench, "down", real)
    assert s.down() == 1


def test_the_async_twin_keeps_the_restores_own_error_too(here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    notes: list[str] = []
    s = smolbench.Session(backend="process", ledger="ledger.db", on_notice=notes.append)
    calls = _down_that_fails_after(monkeypatch)

    async def main() -> None:
        with pytest.raises(SmolbenchError, match=r"^no checkpoint named 'nope'"):
            await s.acheckpoint_restore("nope")

    asyncio.run(main())
    assert calls == [0] and not s.is_up
    assert any("no machine brought up for it is left, but ending the session it started failed too" in n
               for n in notes), notes
    monkeypatch.undo()
    s.down()


def test_a_failed_restore_leaves_the_machine_that_was_up_and_says_what_it_took_down(
        here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fails_once_up(monkeypatch)
    notes: list[str] = []
    with smolbench.Session(backend="process", ledger="ledger.db", on_notice=notes.append) as s:
        s.run("x = 1")
        s.checkpoint_save("c")
        with pytest.raises(SmolbenchError, match=r"^no checkpoint named 'nope'"):
            s.checkpoint_restore("nope")
        assert s.is_up and s.active == "root" and s.run("x").value == 1
        assert not [n for n in notes if "brought up for it" in n], notes  # root was up before: nothing taken down
    s = smolbench.Session(backend="process", ledger="ledger.db", on_notice=notes.append)
    with pytest.raises(SmolbenchError, match=r"^no checkpoint named 'nope'"):
        s.checkpoint_restore("nope")
    assert not s.is_up and not [n for n in notes if "brought up for it" in n], notes  # none was: nothing to say


# the first follow_views (the up's lines being shown, after the machine came up) raises
# KeyboardInterrupt, as a Ctrl-C landing there does
CTRL_C_AS_IT_COMES_UP = """\
import smolbench.widgets as w
real = w.follow_views
def follow_views(*a, **k):
    w.follow_views = real
    raise KeyboardInterrupt
w.follow_views = follow_views
"""


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_a_ctrl_c_as_the_machine_comes_up_for_a_restore_takes_it_down(open_tmp: Path) -> None:
    """Brought up before the magic's ``try``, the machine stayed up, idle, unasked for."""
    with NotebookSession(open_tmp, timeout=300, allow_errors=True) as s:
        ok(s.run("%load_ext smolbench"))
        ok(s.run("%smol up --backend sandbox"))
        ok(s.run("%%smol\nx = 41"))
        ok(s.run("%smol checkpoint save c"))
        ok(s.run("%smol down"))
        ok(s.run(CTRL_C_AS_IT_COMES_UP))
        cell: Any = s.run("%smol checkpoint restore c")
        said = stream_text(cell)
        assert any(o.get("ename") == "KeyboardInterrupt" for o in cell.outputs), cell.outputs
        assert "smolbench: nothing is up: bringing up a sandbox machine for this checkpoint" in said, said
        assert "smolbench: took down the machine brought up for it" in said, said
        status = stream_text(ok(s.run("%smol status")))
        ok(s.run("%smol down"))
        assert "no machine is up" in status, status
        # and with nothing in the way, the same restore brings one up and restores
        out = stream_text(ok(s.run("%smol checkpoint restore c")))
        assert "restored c as r1-c (now active)" in out, out
        assert stream_text(ok(s.run("%%smol\nprint(x + 1)"))) == "42\n"
        ok(s.run("%smol down"))
