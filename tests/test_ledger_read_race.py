"""A ledger read while nothing is up (``%smol ledger`` after a kernel restart) and a kernel that
starts writing it meanwhile.

With no ``-wal`` beside it the read-only ledger is opened ``immutable=1``: SQLite then takes no
lock and detects no change, so what a writer that started after the open wrote was never seen
(its rows in its ``-wal``, or checkpointed into the file under the reader's cached pages).
"""

from __future__ import annotations

import socket
from pathlib import Path

from smolbench.ledger import Ledger
from smolbench.pastledger import open_past, past_nodes


def _ledger(path: Path, nodes: int) -> None:
    ledger = Ledger(path)
    ledger.start_session("s1", backend="sandbox", host=socket.gethostname(), pid=0, pid_start=None)
    for i in range(nodes):
        ledger.upsert_node("s1", f"n{i}", status="ok", started=float(i))
    ledger.close()


def _write(writer: Ledger, first: int, last: int) -> None:
    with writer.batch():
        for i in range(first, last):
            writer.upsert_node("s1", f"n{i}", status="ok", started=float(i), output="x" * 300)


def test_a_writer_that_came_and_went_after_the_open_is_read(tmp_path: Path) -> None:
    """Old code: 5 rows (the immutable open's cached pages), not 3,000."""
    path = tmp_path / "ledger.db"
    _ledger(path, 5)
    past = open_past(path)
    assert past is not None
    try:
        assert len(past_nodes(past)) == 5
        writer = Ledger(path)  # a kernel's %smol up in this folder, then its down
        _write(writer, 5, 3000)
        writer.close()
        assert len(past_nodes(past)) == 3000
    finally:
        past.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.db"]  # nothing left beside it


def test_a_writer_that_started_after_the_open_is_read_and_keeps_its_files(tmp_path: Path) -> None:
    """Old code: 5 rows (what the writer wrote was in its -wal, which immutable never reads)."""
    path = tmp_path / "ledger.db"
    _ledger(path, 5)
    past = open_past(path)
    assert past is not None
    writer = Ledger(path)
    try:
        _write(writer, 5, 50)
        try:
            assert len(past_nodes(past)) == 50
        finally:
            past.close()
        live = sorted(p.name for p in tmp_path.iterdir())
        assert live == ["ledger.db", "ledger.db-shm", "ledger.db-wal"], live  # the writer's, untouched
        _write(writer, 50, 60)
        assert len(writer.node_rows()) == 60
    finally:
        writer.close()



def test_a_read_that_fails_on_half_a_write_is_read_again(tmp_path: Path) -> None:
    """The review: only a read that succeeded was checked for a writer that came since; one that
    failed on what the writer left half done ("database disk image is malformed": its pages
    changed under the immutable reader) reached the user. SQLite's timing can't be forced here:
    the reader's first query after the writer is answered as SQLite answers a torn page."""
    import sqlite3

    path = tmp_path / "ledger.db"
    _ledger(path, 5)
    past = open_past(path)
    assert past is not None

    class Torn:  # the open connection, whose next query meets half a write
        def __init__(self, db: sqlite3.Connection) -> None:
            self.db, self.torn = db, True

        def execute(self, *args: object) -> sqlite3.Cursor:
            if self.torn:
                self.torn = False
                raise sqlite3.DatabaseError("database disk image is malformed")
            return self.db.execute(*args)  # type: ignore[arg-type]

        def close(self) -> None:
            self.db.close()

    try:
        assert len(past_nodes(past)) == 5
        writer = Ledger(path)
        _write(writer, 5, 40)
        writer.close()
        past._db = Torn(past._db)  # type: ignore[assignment]
        assert len(past_nodes(past)) == 40
    finally:
        past.close()
