"""Shared by tests of the ledger: can it be read right now (a Workbench's observers), a copied one's rows."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from pathlib import Path

from smolbench.ledger import Ledger


def readable_now(ledger: Ledger, timeout: float = 2.0) -> bool:
    """Whether another thread (the kernel's main thread, reading the ledger while it holds a
    view's lock) can take the ledger's lock now, within ``timeout`` seconds."""
    got: list[bool] = []

    def read() -> None:
        ok = ledger._lock.acquire(timeout=timeout)
        if ok:
            ledger._lock.release()
        got.append(ok)

    reader = threading.Thread(target=read)
    reader.start()
    reader.join()
    return got[0]


def rows_left_out(folder: Path, rows: int = 2500, chars: int = 2000) -> Path:
    """A copied folder's ledger: the newest MAX_ROWS rows a listing shows, and ``rows`` older ones
    with paths of ``chars`` characters, that name no file; five older ones name the files c0..c4,
    which are there (so not dropped ones), and one file is dropped in."""
    from smolbench._shown import MAX_ROWS

    db = folder / ".smolbench" / "ledger.db"
    Ledger(db).close()
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        conn.executemany("INSERT INTO checkpoints (name, path, created) VALUES (?, ?, ?)",
                         [(f"old{i}", f"{i}".rjust(chars, "p"), float(i)) for i in range(rows)])
        conn.executemany("INSERT INTO checkpoints (name, path, created) VALUES (?, ?, ?)",
                         [(f"c{i}", f"checkpoints/c{i}.smolcheckpoint", rows + i) for i in range(5)])
        conn.executemany("INSERT INTO checkpoints (name, path, created) VALUES (?, ?, ?)",
                         [(f"new{i}", f"new{i}.smolcheckpoint", 1e6 + i) for i in range(MAX_ROWS)])
    (db.parent / "checkpoints").mkdir()
    for i in range(5):
        (db.parent / "checkpoints" / f"c{i}.smolcheckpoint").write_bytes(b"x")
    (db.parent / "checkpoints" / "dropped.smolcheckpoint").write_bytes(b"x")
    return db
