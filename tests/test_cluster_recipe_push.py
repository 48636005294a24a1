"""A cell's recorded pushes are the user's only (audit: every ``Session.run`` was recorded as
using push, so no warm parent could be replayed on another node, nor rebuilt when its node was lost).

``Session.run`` (and ``%%smol``, which runs through ``Session.cell``) sets the result's value
slot ``_`` to None before each cell: smolbench's own placeholder, not a value the ledger lacks.
A real push is still recorded, and still keeps the parent from being replayed elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import smolbench
from smolbench._blocking import _block
from smolbench._session import pickled
from smolbench.cluster.replica import recipe


def _pushed(s: smolbench.Session, node: str) -> list[list[str]]:
    wb = s._wb()
    return [list(c["pushed"]) for c in wb.ledger.cells(wb.session, node)]


def test_the_value_placeholder_is_not_a_push_and_a_real_push_still_is(here: Path) -> None:
    with smolbench.Session(backend="process", ledger="ledger.db") as s:
        assert s.run("x = 1\nx + 1").value == 2
        assert s.run("y = 3").value is None  # the placeholder still does its job: no stale value
        assert _pushed(s, "root") == [[], []]
        assert recipe(s._wb(), "root").pushed == []  # replayable: the cells are the whole path

        assert s.run("z = d * 2\nz", push={"d": 5}).value == 10
        assert _pushed(s, "root")[-1] == ["d"]
        assert recipe(s._wb(), "root").pushed == ["root"]  # a value the ledger lacks: not replayed

    with smolbench.Session(backend="process", ledger="ledger2.db") as s:
        # the magics' way (%%smol: Session.cell with no value slot) records the same
        _block(s.cell("v = 1", value=False))
        _block(s.cell("v = e", push=pickled({"e": 2}), value=False))
        assert _pushed(s, "root") == [[], ["e"]]

    with smolbench.Session(backend="process", ledger="ledger3.db") as s:
        # a user's own push named `_` is theirs, recorded as such
        assert s.run("w = _", push={"_": 7}).value is None
        assert _pushed(s, "root") == [["_"]]
