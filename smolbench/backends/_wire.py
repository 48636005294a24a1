"""Requests to the agent, shared by every backend (only transport differs).

Replies are never decoded here: backends hand the raw byte stream to
:mod:`smolbench.gate`.
"""

from __future__ import annotations

from typing import Any

from ..guest import protocol as P
from .base import CellRequest


def exec_message(request: CellRequest) -> dict[str, Any]:
    """The agent request for one cell."""
    return {
        "op": "exec",
        "code": request.code,
        "cell": request.cell_name,
        "push": {k: P.b64(v) for k, v in request.push.items()},
        "pull": list(request.pull),
        "pull_trusted": bool(request.trust_pull),
        "seed": request.seed,
        "reseed": bool(request.reseed),
    }
