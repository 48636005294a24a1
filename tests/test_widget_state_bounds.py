"""What smolbench's own widgets send the browser is bounded, whatever a machine reported or a
copied folder's ledger holds (fifth audit: a fork of 32 whose branches reported 1,000 long
metrics sent 1.39 GB of tree state; a copied ledger's 10 checkpoint rows of 2 MB node ids made
20 MB of panel state). Bytes and reads are counted, never timed. Real sandbox machines."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_widgets import until
from widgethelpers import workbench_up

from smolbench import _loop, _shown
from smolbench.ledger import Ledger
from smolbench.shelf import Shelf
from smolbench.widgets import checkpoint_panel, tree_widget
from smolbench.workbench import Workbench

# each branch reports what the gate lets through: 1,000 metrics, names and text values of 200
LOUD = """
import smolbench_guest
smolbench_guest.report(**{("k%03d" % i) + "x" * 196: "v" * 1000 for i in range(1000)})
reward = SEED
"""


@pytest.fixture
def wb(tmp_path: Path) -> Iterator[Workbench]:
    with workbench_up(tmp_path / ".smolbench" / "ledger.db") as bench:
        yield bench


def spy(view: Any) -> list[int]:
    """The size of every message the view sends from now on (its JSON, as the comm carries it)."""
    sizes: list[int] = []
    real = view._send

    def counting(msg: Any, buffers: Any = None) -> Any:
        sizes.append(len(json.dumps(msg, default=str)))
        return real(msg, buffers)

    view._send = counting
    return sizes


def test_a_fork_reporting_the_most_metrics_sends_a_bounded_tree_state(wb: Workbench) -> None:
    view = tree_widget(wb, shell=None)
    sizes = spy(view)
    result = wb.new_fork(4, None, 0)
    _loop.run(wb.fork(result, LOUD, lambda b, e: None), timeout=300)
    until(lambda: len(view.nodes) == 5 and all(n["status"] == "ok" for n in view.nodes if n["id"] != "root"),
          "the fork's final state")
    branch = next(n for n in view.nodes if n["id"] == "root.0")
    # cut where the record is made, as the sidebar cuts them: the first 20, names and values short
    assert len(branch["metrics"]) == _shown.METRICS_SHOWN
    assert all(len(k) <= _shown.METRIC_NAME_CHARS for k in branch["metrics"])
    assert all(len(v) <= _shown.METRIC_VALUE_CHARS + 1 for v in branch["metrics"].values())
    # every node in each update: 5 nodes of ~6 KB at most (was ~413 KB per branch, 1.7 MB a message);
    # what an update of the nodes sends (its messages go out only where a kernel's comm is open)
    sent = [len(json.dumps(view.get_state(key="nodes"), default=str)), *sizes]
    assert max(sent) < 60_000, max(sent)
    assert len(json.dumps(list(view.nodes))) < 40_000


def _copied_rows(db: Path, rows: list[tuple[Any, ...]]) -> None:
    """Rows a copied folder's ledger may hold, written past smolbench (as a copy brings them)."""
    c = sqlite3.connect(db)
    c.executemany("INSERT INTO checkpoints VALUES (?,?,?,?,?,?,?,?,?)", rows)
    c.commit()
    c.close()


def _row(i: int, node: str = "n") -> tuple[Any, ...]:
    return (f"c{i}", "s", node, f"checkpoints/c{i}.smolcheckpoint", "sandbox", time.time() - 10_000 + i, 1, 1, "[]")


def test_a_copied_ledgers_huge_checkpoint_rows_make_a_bounded_panel(wb: Workbench) -> None:
    _copied_rows(Path(wb.ledger.path), [_row(i, "n" * 2_000_000) for i in range(10)])
    panel = checkpoint_panel(wb, shell=None)
    assert len(panel.checkpoints) == 10
    assert all(len(r["node"]) <= _shown.TEXT_CHARS + 1 for r in panel.checkpoints)
    # 10 rows of 2 MB node ids were 20 MB of state and 20 MB of static HTML in the notebook
    assert len(json.dumps(list(panel.checkpoints))) < 100_000
    assert len(panel.static_html()) < 200_000


def test_a_copied_ledgers_many_checkpoints_make_a_panel_of_the_newest_500(wb: Workbench) -> None:
    _copied_rows(Path(wb.ledger.path), [_row(i) for i in range(_shown.MAX_ROWS + 300)])
    panel = checkpoint_panel(wb, shell=None)
    names = [r["name"] for r in panel.checkpoints]
    assert len(names) == _shown.MAX_ROWS and names[0] == f"c{_shown.MAX_ROWS + 299}"  # the newest first
    assert "300 more checkpoints not listed" in panel.more
    assert "300 more" in panel.static_html()


def test_the_panel_reads_the_ledger_again_only_when_checkpoints_change(
        wb: Workbench, monkeypatch: pytest.MonkeyPatch) -> None:
    _copied_rows(Path(wb.ledger.path), [_row(i) for i in range(20)])
    panel = checkpoint_panel(wb, shell=None)
    reads: list[str] = []
    for name in ("rows", "listing"):  # the panel's reads of the ledger, old and new
        real = getattr(Shelf, name, None)
        if real is None:  # (the code before this fix had no listing)
            continue
        monkeypatch.setattr(Shelf, name, lambda self, *a, _real=real, _n=name, **k: reads.append(_n) or _real(self, *a, **k))
    for _ in range(3):  # cells in the active machine: busy, idle, its row written; each cell's end flushes
        _loop.run(wb.run_cell("x = 1", lambda ev: None), timeout=60)
        panel._post_run_cell()
    assert reads == [], reads  # each was a read of every row (10,000 rows: 0.2 s cells took 2-3 s)
    _loop.run(wb.checkpoint_save("fresh", "root"), timeout=120)  # a checkpoint saved: listed again
    until(lambda: bool(panel.checkpoints) and panel.checkpoints[0]["name"] == "fresh", "the new checkpoint listed")
    assert reads and set(reads) == {"listing"}


def test_keeping_badges_true_reads_no_copied_checkpoint_row_whole(wb: Workbench, monkeypatch: pytest.MonkeyPatch) -> None:
    """The badge watcher looked at every checkpoint row's name once a second, and each sync
    read every row, on smolbench's loop: a copied ledger's rows of 2 MB each, every second.
    Now a change is noticed from the rows' count and times, and a sync reads this session's
    rows only. Its badges still follow a save and a delete."""
    _copied_rows(Path(wb.ledger.path), [_row(i, "n" * 2_000_000) for i in range(10)])
    read: list[int] = []
    real = Ledger._rows

    def counting(self: Ledger, *a: Any, **k: Any) -> Any:
        rows = real(self, *a, **k)
        read.append(sum(len(str(v)) for r in rows for v in r.values()))
        return rows

    monkeypatch.setattr(Ledger, "_rows", counting)
    wb.sync_checkpoints()
    assert sum(read) < 100_000, sum(read)  # the 10 rows held 20 MB
    before = wb.ledger.checkpoint_stamp()
    _loop.run(wb.checkpoint_save("mine", "root"), timeout=120)
    assert wb.ledger.checkpoint_stamp() != before
    until(lambda: wb.tree["root"].checkpoint == "mine", "the badge of the checkpoint saved")
    assert sum(read) < 1_000_000, sum(read)  # a watcher's tick or two, and a save's sync
