"""A restore with nothing up starts the restored machine only: it booted a root beside it first,
then deleted it, unused (a second machine's boot, and a root row in the ledger, for nothing)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from nbhelpers import NotebookSession, ok, stream_text

import smolbench
from smolbench.ledger import DEFAULT_PATH, Ledger


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _saved(here: Path) -> None:
    with smolbench.Session(backend="process", on_notice=lambda line: None) as s:
        s.run("x = 41")
        s.checkpoint_save("warm")


def _machines_of(session: str) -> list[str]:
    ledger = Ledger(DEFAULT_PATH)
    try:
        return sorted(row["id"] for row in ledger.node_rows(session))
    finally:
        ledger.close()


def test_a_restore_with_nothing_up_makes_one_machine(here: Path) -> None:
    _saved(here)
    s = smolbench.Session(backend="process", on_notice=lambda line: None)
    try:
        node = s.checkpoint_restore("warm")
        assert s.workbench is not None
        assert node == "r1-warm" and s.active == node and list(s.workbench.machines) == [node]
        assert _machines_of(s.workbench.session) == [node]  # no root came up beside it
        assert s.run("x + 1").value == 42
        assert s.status()["active"] == node
    finally:
        s.down()


def test_the_async_twin_makes_one_machine_too(here: Path) -> None:
    _saved(here)
    s = smolbench.Session(backend="process", on_notice=lambda line: None)

    async def main() -> None:
        try:
            node = await s.acheckpoint_restore("warm")
            assert s.workbench is not None and list(s.workbench.machines) == [node]
            assert _machines_of(s.workbench.session) == [node]
            assert (await s.arun("x + 1")).value == 42
        finally:
            await s.adown()

    asyncio.run(main())


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_the_magic_restores_with_nothing_up_into_one_machine(here: Path) -> None:
    _saved(here)
    with NotebookSession(here, timeout=300) as nb:
        ok(nb.run("%load_ext smolbench"))
        out = stream_text(ok(nb.run("%smol checkpoint restore warm")))
        assert "restored warm as r1-warm (now active)" in out, out
        assert stream_text(ok(nb.run("%%smol\nprint(x + 1)"))) == "42\n"
        rows = stream_text(ok(nb.run("import smolbench; wb = smolbench.session().workbench\n"
                                     "print(sorted(wb.machines), sorted(r['id'] for r in wb.ledger.node_rows(wb.session)))")))
        assert rows == "['r1-warm'] ['r1-warm']\n", rows
        ok(nb.run("%smol down"))
