"""What smolbench's own widgets send the browser is bounded, whatever a machine reported or a
copied folder's ledger holds (fifth audit: a fork of 32 whose branches reported 1,000 long
metrics sent 1.39 GB of tree state; a copied ledger's 10 checkpoint rows of 2 MB node ids made
20 MB of panel state). Bytes and reads are counted, never timed. Real sandbox machines."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_widgets import until

from smolbench import _loop, _shown
from smolbench.backends.sandbox import SandboxBackend
from smolbench.ledger import Ledger
from smolbench.spec import MachineSpec
from smolbench.widgets import close_views, tree_widget
from smolbench.workbench import Workbench

# each branch reports what the gate lets through: 1,000 metrics, names and text values of 200
LOUD = """
import smolbench_guest
smolbench_guest.report(**{("k%03d" % i) + "x" * 196: "v" * 1000 for i in range(1000)})
reward = SEED
"""


@pytest.fixture
def wb(tmp_path: Path) -> Iterator[Workbench]:
    bench = Workbench(SandboxBackend(), MachineSpec(), Ledger(tmp_path / ".smolbench" / "ledger.db"))
    _loop.run(bench.up())
    try:
        yield bench
    finally:
        close_views(bench)
        _loop.run(bench.down(), timeout=60)
        bench.ledger.close()


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
    # every node in each update: 5 nodes of ~6 KB at most (was ~413 KB per branch, 1.7 MB a message)
    assert sizes and max(sizes) < 60_000, max(sizes)
    assert len(json.dumps(list(view.nodes))) < 40_000
