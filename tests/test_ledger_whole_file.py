"""`.smolbench/ledger.db` alone is the whole ledger once a session is down or its kernel has
exited: a kernel's ledger was never closed, so after a normal shutdown ledger.db was 4096
bytes with no tables and ledger.db-wal held everything, and a copy, a download or a `git add`
of ledger.db alone was an empty ledger."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
from nbhelpers import NotebookSession, ok

import smolbench
from smolbench.pastledger import open_past

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def _copied_alone(folder: Path, tmp: Path) -> dict[str, list[str]]:
    """The sessions and node ids in a copy of ``folder``'s ledger.db alone (no -wal beside it)."""
    tmp.mkdir(exist_ok=True)
    copy = tmp / "ledger.db"
    shutil.copyfile(folder / "ledger.db", copy)
    db = sqlite3.connect(copy)
    try:
        have = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "nodes" not in have:
            return {}
        out: dict[str, list[str]] = {}
        for session, node in db.execute("SELECT session_id, id FROM nodes ORDER BY session_id, id"):
            out.setdefault(session, []).append(node)
        return out
    finally:
        db.close()
        copy.unlink()


def test_after_a_session_is_down_ledger_db_alone_holds_its_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with smolbench.Session(backend="process", ledger="runs/ledger.db", on_notice=lambda line: None) as s:
        s.fork(2, "reward = SEED", keep="all")
    assert list(_copied_alone(tmp_path / "runs", tmp_path / "copy").values()) == [["root", "root.0", "root.1"]]
    s.up()  # the same Session again: its new ledger writes on as before
    s.run("x = 1")
    s.down()
    assert sorted(len(v) for v in _copied_alone(tmp_path / "runs", tmp_path / "copy").values()) == [1, 3]


@needs_bwrap
def test_after_a_kernel_shuts_down_ledger_db_alone_is_the_whole_ledger(tmp_path: Path) -> None:
    here = tmp_path / ".smolbench"
    with NotebookSession(tmp_path, timeout=300) as nb:
        ok(nb.run("%load_ext smolbench"))
        ok(nb.run("%smol up --backend sandbox"))
        ok(nb.run("%%smol fork 2 --keep all --quiet\nreward = SEED"))
        ok(nb.run("%smol checkpoint save warm"))
        ok(nb.run("%smol down"))
        # the kernel is still running: `%smol down` folded what it wrote into the file
        assert list(_copied_alone(here, tmp_path / "copy").values()) == [["root", "root.0", "root.1"]]
        assert _checkpoints_alone(here, tmp_path / "copy") == ["warm"]
        ok(nb.run("%smol checkpoint rm warm"))  # written after the down: the kernel's exit folds it in
    assert _checkpoints_alone(here, tmp_path / "copy") == []
    with NotebookSession(tmp_path, timeout=300) as nb:
        ok(nb.run("%load_ext smolbench"))
        ok(nb.run("%smol up --backend sandbox"))
        ok(nb.run("%%smol\nx = 1"))
    # shut down with a machine up: its exit deleted it, recorded that and closed the ledger
    seen = _copied_alone(here, tmp_path / "copy")
    assert sorted(len(v) for v in seen.values()) == [1, 3], seen
    wal = here / "ledger.db-wal"
    assert not wal.exists() or wal.stat().st_size == 0
    past = open_past(here / "ledger.db")  # the read-only view reads it as before
    assert past is not None
    try:
        rows = past.node_rows()
    finally:
        past.close()
    assert sorted(r["id"] for r in rows) == ["root", "root", "root.0", "root.1"]
    assert all(r["alive"] == 0 for r in rows), rows


def _checkpoints_alone(folder: Path, tmp: Path) -> list[str]:
    """The checkpoint names in a copy of ``folder``'s ledger.db alone."""
    tmp.mkdir(exist_ok=True)
    copy = tmp / "ledger.db"
    shutil.copyfile(folder / "ledger.db", copy)
    db = sqlite3.connect(copy)
    try:
        return [r[0] for r in db.execute("SELECT name FROM checkpoints ORDER BY name")]
    finally:
        db.close()
        copy.unlink()
