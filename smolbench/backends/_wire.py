"""Requests to the agent, shared by every backend (only transport differs).

Replies are never decoded here: backends hand the raw byte stream to
:mod:`smolbench.gate`.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from ..guest import protocol as P
from .base import CellRequest


class RequestIds:
    """Ids for the exec and save requests a host sends, and the last cell sent to each machine.

    An interrupt names its request's id, so one handled late (its request over, the next
    begun) stops nothing. Ids start at random: a cluster's driver and a node's backend number
    requests to the same agent. The agent may ignore an id; that harms only its own cells.
    """

    def __init__(self) -> None:
        self._next = itertools.count(int.from_bytes(os.urandom(5), "big") << 16)
        self._cells: dict[str, int] = {}

    def new(self) -> int:
        """A fresh id (a save's, a fork's)."""
        return next(self._next)

    def cell(self, machine: str) -> int:
        """A fresh id for a cell sent to ``machine``: the one :meth:`last` names from now on."""
        self._cells[machine] = rid = next(self._next)
        return rid

    def last(self, machine: str) -> int | None:
        """The id of the last cell sent to ``machine`` (None: none was)."""
        return self._cells.get(machine)

    def forget(self, machine: str) -> None:
        self._cells.pop(machine, None)


def interrupt_message(rid: int) -> dict[str, Any]:
    """The agent request that stops the exec or save ``rid`` if it still runs, and nothing else."""
    return {"op": "interrupt", "id": rid}


def exec_message(request: CellRequest, rid: int) -> dict[str, Any]:
    """The agent request for one cell, ``rid`` its id (an interrupt names it)."""
    return {
        "op": "exec",
        "id": rid,
        "code": request.code,
        "cell": request.cell_name,
        "push": {k: P.b64(v) for k, v in request.push.items()},
        "pull": list(request.pull),
        "pull_trusted": bool(request.trust_pull),
        "seed": request.seed,
        "reseed": bool(request.reseed),
    }
