"""How much of a ledger's values smolbench sends a browser: one set of cuts for the sidebar's
API (``server/ledgerview.py``) and the notebook's views (``widgets/``).

A ledger may be a copied folder's, and a node's metrics are whatever its machine reported
(the gate lets 1,000 metrics of 200-character names and values through): each view used to
cut them with its own numbers, or not at all (the fork tree sent ~413 KB per branch on every
update, fifth audit).
"""

from __future__ import annotations

import math
from typing import Any

from .tree import STATUSES

ID_CHARS = 200  # an id, a kind, a status, a seed written as text
TEXT_CHARS = 2000  # any other text (an error, a path, a checkpoint's node id)
MAX_ROWS = 500  # rows one listing holds (checkpoints; a page of runs or nodes)
METRICS_SHOWN = 20  # a node's metrics shown (the first ones reported)
METRIC_NAME_CHARS = 60
METRIC_VALUE_CHARS = 200
UNKNOWN = "unknown"  # a status smolbench never writes, as it is sent


def finite(value: Any) -> float | None:
    """``value`` as a finite float, or None (NaN, infinities, bools, text and blobs)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def text(value: Any, limit: int = TEXT_CHARS) -> str | None:
    """``value`` as text of at most ``limit`` characters (and "…"); None stays None."""
    if value is None:
        return None
    out = value if isinstance(value, str) else str(value)
    return out if len(out) <= limit else out[:limit] + "…"


def metrics(value: Any) -> dict[str, Any]:
    """A node's metrics as shown: the first :data:`METRICS_SHOWN`, names cut, text values cut,
    numbers finite or None ({} for anything but a dict)."""
    if not isinstance(value, dict):
        return {}
    out: dict[str, Any] = {}
    for k, v in list(value.items())[:METRICS_SHOWN]:
        out[str(k)[:METRIC_NAME_CHARS]] = text(v, METRIC_VALUE_CHARS) if isinstance(v, str) else finite(v)
    return out


def status(value: Any) -> str:
    """A node's status as sent: one of smolbench's, else "unknown" (the run tree and the
    static copies make it a CSS class name: a copied ledger's ``'ok jp-mod-hidden'`` was two)."""
    return value if isinstance(value, str) and value in STATUSES else UNKNOWN


def sql_cut(col: str, chars: int = ID_CHARS) -> str:
    """SQL for column ``col`` with its text (or blob) cut to ``chars`` where it is read: a copied
    ledger's ids and statuses may be 16 MB each (third audit: a 67 MB ledger made a 400 MB page)."""
    return f"CASE WHEN typeof({col}) IN ('text', 'blob') THEN substr({col}, 1, {chars}) ELSE {col} END"
