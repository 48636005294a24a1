"""The sidebar's reads of a ledger someone else made (a copied folder): every value it sends
is bounded text, a finite number or null (third audit: ids, kinds and statuses were sent
whole, up to 16 MB each, and one BLOB id made the whole runs page fail to encode)."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from pathlib import Path

from smolbench import ledger
from smolbench.server import ledgerview
from smolbench.tree import STATUSES

BIG = 1 << 20  # characters of each crafted value


def _copied(tmp_path: Path) -> Path:
    db = tmp_path / "ledger.db"
    c = sqlite3.connect(db)
    c.executescript(ledger.SCHEMA)
    c.execute("INSERT INTO runs(id, session_id, kind, status, started, code) VALUES ('good', 's', 'fork', 'ok', 3, 'x')")
    c.execute("INSERT INTO runs(id, session_id, kind, status, started, code) VALUES (x'00ff', 's', 'fork', 'ok', 1, 'x')")
    c.execute("INSERT INTO runs(id, session_id, kind, parent_id, status, started, code) VALUES (?, 's', ?, ?, ?, 2, 'x')",
              ("r" * BIG, "k" * BIG, "p" * BIG, "s" * BIG))
    c.execute("INSERT INTO nodes(id, session_id, run_id, seed, status, reward, started, metrics) "
              "VALUES (?, 's', 'good', ?, ?, 1.0, 1, ?)", ("n" * BIG, "7" * BIG, "o" * BIG, json.dumps({"m": "v" * BIG})))
    c.execute("INSERT INTO nodes(id, session_id, run_id, seed, status, reward, started) "
              "VALUES (x'00ff', 's', 'good', x'01', x'02', 2.0, 2)")
    c.execute("INSERT INTO nodes(id, session_id, run_id, seed, status, reward, started, metrics) "
              "VALUES ('root.0', 's', 'good', 0, 'ok', 3.0, 3, '{\"loss\": 0.5}')")
    c.commit()
    c.close()
    return db


def _values(page: object) -> list[object]:
    if isinstance(page, dict):
        return [v for x in page.values() for v in _values(x)]
    if isinstance(page, list):
        return [v for x in page for v in _values(x)]
    return [page]


def test_a_copied_ledgers_runs_page_is_bounded_and_encodes(tmp_path: Path) -> None:
    page = ledgerview.runs(_copied(tmp_path), 50, 0)
    text = json.dumps(page)  # a BLOB id made this raise: the good runs weren't shown either
    assert len(text) < 20_000, len(text)
    assert "good" in [r["id"] for r in page["runs"]]


def test_a_copied_ledgers_nodes_page_is_bounded_and_encodes(tmp_path: Path) -> None:
    page = ledgerview.nodes(_copied(tmp_path), run="good")
    text = json.dumps(page)
    assert len(text) < 40_000, len(text)
    assert all(not isinstance(v, bytes) for v in _values(page))
    honest = [n for n in page["nodes"] if n["id"] == "root.0"]
    assert honest and honest[0]["seed"] == 0 and honest[0]["metrics"] == {"loss": 0.5}


def test_a_copied_ledgers_statuses_and_ids_reach_the_run_tree_as_its_own_words(tmp_path: Path) -> None:
    """tree.ts builds ``sb-st-${status}`` into a row's class names and splits each node's id:
    a status is one of smolbench's or "unknown", and every id is text (fifth audit: a status
    ``'ok jp-mod-hidden sb-best'`` reached the browser whole; a blob id came back null)."""
    db = _copied(tmp_path)
    c = sqlite3.connect(db)
    c.execute("INSERT INTO nodes(id, session_id, run_id, parent_id, status, started) "
              "VALUES ('root.1', 's', 'good', 'root.0', 'ok jp-mod-hidden sb-best', 4)")
    c.execute("INSERT INTO nodes(id, session_id, run_id, parent_id, status, started) VALUES (5, 's', 'good', 6, 'ok', 5)")
    c.commit()
    c.close()
    page = ledgerview.nodes(db, run="good")
    by_id = {n["id"]: n for n in page["nodes"]}
    assert all(isinstance(n["id"], str) for n in page["nodes"]), [n["id"] for n in page["nodes"]]
    assert by_id["root.1"]["status"] == "unknown"
    assert by_id["x'00ff'"]["status"] == "unknown"  # (a blob status)
    assert by_id["5"]["parent_id"] == "6" and by_id["5"]["status"] == "ok"
    assert {n["status"] for n in page["nodes"]} <= {*STATUSES, "unknown"}
    runs = ledgerview.runs(db, 50, 0)["runs"]
    assert all(isinstance(r["id"], str) for r in runs), [r["id"] for r in runs]


def test_a_run_s_sparkline_is_picked_in_sqlite(tmp_path: Path) -> None:
    """Eighth audit: a run's summary read every reward of it into Python to show 24 of them (a
    copied ledger's run of 6M branches cost 508 MB per runs page); SQLite picks the 24 now."""
    import random
    import tracemalloc

    db = tmp_path / "ledger.db"
    rnd = random.Random(7)
    rewards = [rnd.uniform(-9, 9) for _ in range(60_000)]
    with contextlib.closing(sqlite3.connect(db)) as c, c:
        c.executescript(ledger.SCHEMA)
        c.execute("INSERT INTO runs(id, session_id, kind, status, started) VALUES ('big', 's', 'fork', 'ok', 1)")
        c.executemany("INSERT INTO nodes(session_id, id, run_id, status, reward) VALUES ('s', ?, 'big', 'ok', ?)",
                      ((f"root.{i}", r) for i, r in enumerate(rewards)))
    tracemalloc.start()
    try:
        run = ledgerview.runs(db, 50, 0)["runs"][0]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    ranked = sorted(rewards)
    assert run["rewarded"] == len(rewards) and run["best_reward"] == ranked[-1]
    assert run["spark"] == [ranked[k] for k in ledgerview.spark_ranks(len(rewards))]
    assert peak < 1_000_000, peak  # every reward in Python: ~5 MB
