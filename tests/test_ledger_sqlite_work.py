"""Attacks: a copied ledger that passes the schema check but makes SQLite's own work endless.

Some of what SQLite does is one step of its machine, which the server's progress handler
never sees, and the kernel had no time limit at all (an audit):

- a b-tree whose interior pages' ~510 child pointers all name the same page below (282 KB
  with smolbench's own schema): counting a table visits its one leaf 510**5 times (days); a
  scan reads its rows again and again (the kernel's ``%smol up`` grew by a GiB in 10 s);
- a view of 150,000 CTEs in the schema: SQLite parses it whole at the schema's first use,
  inside the schema check's own first query (hours).

Now every use of a ledger is interrupted at its deadline (``smolbench._sqlwatch``: the
server's 10 s, the kernel's ``WORK_SECONDS``), and the kernel opens a ledger only once
SQLite's own check (``PRAGMA quick_check``) finds its b-trees sound.
"""

from __future__ import annotations

import os
import sqlite3
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from smolbench import SmolbenchError
from smolbench.ledger import Ledger
from smolbench.server import ledgerview


def dag_ledger(folder: Path, levels: int = 5) -> Path:
    """A ledger made by smolbench, with a row in each table, whose tables' and indexes' b-trees
    are then made DAGs ``levels`` deep (each interior page's child pointers all one page)."""
    db = folder / "ledger.db"
    Ledger(db).close()
    c = sqlite3.connect(db, isolation_level=None)
    c.execute("PRAGMA journal_mode=DELETE")
    c.execute("INSERT INTO checkpoints (name, session_id, node_id, path, backend, created, size, cells, warnings) "
              "VALUES ('a', 's', 'n', 'checkpoints/a.smolcheckpoint', 'process', 1.0, 1, 1, '[]')")
    c.execute("INSERT INTO sessions (id, started, host) VALUES ('s', 1.0, 'elsewhere')")
    c.execute("INSERT INTO runs (id, session_id, kind, n, started, status) VALUES ('r', 's', 'fork', 1, 1.0, 'ok')")
    c.execute("INSERT INTO nodes (session_id, id, run_id, status, reward, started) VALUES ('s', 'n', 'r', 'ok', 1.0, 1.0)")
    roots = dict(c.execute("SELECT name, rootpage FROM sqlite_master WHERE rootpage > 0").fetchall())
    ps = c.execute("PRAGMA page_size").fetchone()[0]
    c.close()
    data = bytearray(db.read_bytes())
    npages = len(data) // ps

    def interior(child: int, leaf: bytes) -> bytes:
        if leaf[0] == 0x0D:  # a table's: the child and a rowid
            def cell(i: int) -> bytes:
                return struct.pack(">I", child) + bytes([0x81, i & 0x7F])
            flag = 0x05
        else:  # an index's: the child and the leaf's first key again
            off = struct.unpack(">H", leaf[8:10])[0]
            key = bytes(leaf[off:off + 1 + leaf[off]])

            def cell(i: int) -> bytes:
                return struct.pack(">I", child) + key
            flag = 0x02
        width = len(cell(0))
        n = (ps - 12) // (width + 2)
        cells = b"".join(cell(i) for i in range(n))
        start = ps - len(cells)
        head = bytes([flag]) + struct.pack(">HHHBI", 0, n, start, 0, child) + \
            b"".join(struct.pack(">H", start + width * i) for i in range(n))
        return head + bytes(start - len(head)) + cells

    for root in roots.values():
        leaf = bytes(data[(root - 1) * ps:root * ps])
        if leaf[0] not in (0x0D, 0x0A) or struct.unpack(">H", leaf[3:5])[0] == 0:
            continue  # empty: left as it is
        data += leaf  # the one-row leaf, moved to a new page
        npages += 1
        below = npages
        for _ in range(levels - 1):
            data += interior(below, leaf)
            npages += 1
            below = npages
        data[(root - 1) * ps:root * ps] = interior(below, leaf)
    data[28:32] = struct.pack(">I", npages)
    db.write_bytes(bytes(data))
    return db


def cte_ledger(folder: Path, n: int = 150_000) -> Path:
    """A ledger made by smolbench, plus a view of ``n`` CTEs written into its schema."""
    db = folder / "ledger.db"
    Ledger(db).close()
    c = sqlite3.connect(db, isolation_level=None)
    c.execute("PRAGMA journal_mode=DELETE")
    c.execute("PRAGMA writable_schema=ON")
    body = ",".join(f"a{i} AS(SELECT 1)" for i in range(n))
    c.execute("INSERT INTO sqlite_master VALUES('view', 'v', 'v', 0, ?)", (f"CREATE VIEW v AS WITH {body} SELECT 1",))
    c.close()
    return db


def runs_away(code: str, db: Path, within: float = 6.0) -> bool:
    """Whether ``code`` (``db`` as DB) is still running after ``within`` s, in a process of its own
    (killed then): what a weakened setup does, never left to run in the test's own process."""
    proc = subprocess.Popen([sys.executable, "-c", f"from pathlib import Path\nDB = Path({str(db)!r})\n{code}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        proc.wait(within)
        return False
    except subprocess.TimeoutExpired:
        return True
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("craft", ["dag", "cte"])
def test_the_servers_reads_of_a_crafted_ledger_are_cut_off_at_their_deadline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, craft: str) -> None:
    db = dag_ledger(tmp_path) if craft == "dag" else cte_ledger(tmp_path)
    monkeypatch.setattr(ledgerview, "READ_SECONDS", 1.0)
    t0 = time.monotonic()
    with pytest.raises(ledgerview.LedgerUnreadable) as cut:
        ledgerview.checkpoints(db)
    took = time.monotonic() - t0
    assert "took more than 1 s to read: left out" in str(cut.value), cut.value
    assert took < 30, took  # not a timing goal: the weakened run below never ends
    weakened = ("import contextlib\nfrom smolbench.server import ledgerview\n"
                "ledgerview.cut_off = lambda *a: contextlib.nullcontext()\nledgerview.checkpoints(DB)")
    assert runs_away(weakened, db), "the progress handler alone should not stop this ledger's read"


def test_the_kernel_refuses_a_ledger_whose_b_trees_are_not_trees(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = dag_ledger(tmp_path)
    for open_it in (Ledger, Ledger.read_only):
        with pytest.raises(SmolbenchError) as refused:
            open_it(db)
        line = str(refused.value)
        assert "is damaged (SQLite's own check says: *** in database main *** On tree page" in line, line
        assert "move it aside" in line and "\n" not in line, line
    weakened = "from smolbench import ledger\nledger.sound = lambda *a: None\nledger.Ledger(DB).checkpoint_count()"
    assert runs_away(weakened, db), "a count of this ledger's rows should run for days without the check"


def test_the_kernels_open_of_a_ledger_whose_schema_parses_for_hours_is_cut_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from smolbench import ledger

    db = cte_ledger(tmp_path)
    monkeypatch.setattr(ledger, "WORK_SECONDS", 1.0)
    for open_it in (Ledger, Ledger.read_only):
        with pytest.raises(ledger.SlowLedger) as cut:
            open_it(db)
        line = str(cut.value)
        assert "took more than 1 s to open, and SQLite's work on it was cut off" in line and "--ledger PATH" in line, line
    assert os.path.getsize(db) < 4 << 20
    weakened = "from smolbench import ledger\nledger.cut_off = lambda *a: __import__('contextlib').nullcontext()\n" \
               "ledger.Ledger.read_only(DB)"
    assert runs_away(weakened, db), "the schema's parse should run for hours without the cut"


def test_a_sound_ledger_opens_and_a_cut_that_ended_interrupts_nothing_after_it(tmp_path: Path) -> None:
    from smolbench import _sqlwatch

    led = Ledger(tmp_path / "ledger.db")
    try:
        led.start_session("s", started=1.0)
        assert led.session_ids() == ["s"]
        with _sqlwatch.cut_off(led._db, 0.05) as cut:
            pass
        time.sleep(0.2)
        assert not cut.fired and led.session_ids() == ["s"]
        with pytest.raises(sqlite3.OperationalError) as stopped, _sqlwatch.cut_off(led._db, 0.2) as cut:
            led._db.execute("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c")
        assert cut.stopped(stopped.value)
        assert led.session_ids() == ["s"]  # the connection goes on
    finally:
        led.close()


def test_a_statement_begun_after_the_deadline_is_stopped_too(tmp_path: Path) -> None:
    """SQLite forgets an interrupt that lands while no statement runs (the next one clears it):
    a read begun after its use's deadline ran unbounded. The watcher interrupts again until the
    use ends (the server's delete read and wrote after its deadline had passed)."""
    from smolbench import _sqlwatch

    conn = sqlite3.connect(tmp_path / "x.db")
    try:
        with pytest.raises(sqlite3.OperationalError) as stopped, _sqlwatch.cut_off(conn, 0.05) as cut:
            time.sleep(0.3)  # past the deadline, with nothing running
            conn.execute("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c")
        assert cut.stopped(stopped.value)
    finally:
        conn.close()
