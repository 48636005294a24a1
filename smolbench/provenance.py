"""Where a run came from and what it ran on: the provenance a Workbench's ledger rows record."""

from __future__ import annotations

import os
import platform
import re
from typing import Any

from . import __version__


def versions(guest_python: str | None) -> dict[str, str | None]:
    """smolbench, smolmachines and both Pythons' versions (recorded on every node's row)."""
    try:
        import smol

        smolver: str | None = getattr(smol, "__version__", None)
    except Exception:
        smolver = None
    return {"smolbench": __version__, "smolmachines": smolver, "guest_python": guest_python,
            "host_python": platform.python_version()}


def where(cell_name: str | None) -> dict[str, Any]:
    """Which notebook (the Jupyter server's path, when it started this kernel) and cell
    number (from the magic's ``<In [7]>``) a run came from, for its ledger row."""
    m = re.fullmatch(r"<In \[(\d+)\]>", cell_name or "")
    return {"notebook": os.environ.get("JPY_SESSION_NAME") or None, "cell": int(m.group(1)) if m else None}
