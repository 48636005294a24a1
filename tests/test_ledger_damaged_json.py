"""Audit: a copied ledger's JSON columns broke the checkpoint commands. json.loads caught only
ValueError: a row's ``warnings`` of ``"[" * 200000`` raised RecursionError from
``Ledger.checkpoint`` and ``Shelf.rows()`` (`%smol checkpoint list/rm`, the panel), and a 12 MB
value cost ~300 MB to decode. Such a row reads as damaged, in one line, and can be removed.
"""

from __future__ import annotations

import json
import sqlite3
import tracemalloc
from pathlib import Path

import pytest

from smolbench.ledger import Ledger
from smolbench.shelf import Shelf


def _ledger(tmp_path: Path, **columns: str) -> Path:
    """A ledger with checkpoint rows ``ok`` and ``bad``, ``bad``'s JSON columns set to ``columns``."""
    path = tmp_path / ".smolbench" / "ledger.db"
    led = Ledger(path)
    try:
        for name in ("ok", "bad"):
            led.add_checkpoint(name, "s1", "root", f"checkpoints/{name}.smolcheckpoint", "sandbox", 10, 1,
                               ["a warning"], machine={"memory": 512})
    finally:
        led.close()
    with sqlite3.connect(path) as db:
        for column, value in columns.items():
            table = "checkpoint_more" if column == "machine" else "checkpoints"
            db.execute(f"UPDATE {table} SET {column} = ? WHERE name = 'bad'", (value,))
    return path


@pytest.mark.parametrize("columns", [
    {"warnings": "[" * 200_000},  # RecursionError in json
    {"machine": "{\"a\":" * 100_000},
    {"warnings": json.dumps("not a list")},
    {"warnings": json.dumps([f"w{i}" for i in range(21)])},
    {"warnings": json.dumps([1, 2])},
    {"machine": json.dumps([1])},
    {"warnings": "not json"},
], ids=["deep-warnings", "deep-machine", "str", "21", "ints", "machine-list", "not-json"])
def test_a_damaged_row_is_one_line_and_can_be_removed(tmp_path: Path, columns: dict[str, str]) -> None:
    led = Ledger(_ledger(tmp_path, **columns))
    try:
        rec = led.checkpoint("bad")
        assert rec is not None and rec["warnings"] in ([], ["a warning"]) and rec["damaged"].startswith(
            "its ledger row's "), rec
        assert led.checkpoint("ok")["warnings"] == ["a warning"] and "damaged" not in led.checkpoint("ok")
        shelf = Shelf(led)
        rows = {r["name"]: r for r in shelf.rows()}
        assert rows["bad"]["refused"].startswith("damaged: its ledger row's "), rows["bad"]
        assert rows["ok"]["refused"] is None
        lines = shelf.lines()
        assert len(lines) == 3 and sum("  bad  sandbox  .smolbench/checkpoints/bad.smolcheckpoint  damaged: its "
                                       "ledger row's " in line for line in lines) == 1, lines
        assert shelf.remove("bad").startswith("removed checkpoint bad")
        assert [r["name"] for r in shelf.rows()] == ["ok"]
    finally:
        led.close()


def test_a_big_json_column_is_not_decoded(tmp_path: Path) -> None:
    led = Ledger(_ledger(tmp_path, warnings="[" + "[]," * 1_000_000 + "[]]"))  # 3 MB
    try:
        tracemalloc.start()
        try:
            rec = led.checkpoint("bad")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    finally:
        led.close()
    assert rec is not None and rec["warnings"] == [] and rec["damaged"] == \
        "its ledger row's warnings is 3,000,004 characters, over 1,048,576"
    assert peak < 20 << 20, f"{peak:,} bytes"
