"""What a folder's ledger says while nothing is up: ``%smol ledger``, ``tree`` and ``plot``
after a kernel restart (what was lost), or before the first ``%smol up``.

The ledger is the one ``%smol up`` would use, opened read-only (:meth:`Ledger.read_only`:
SQLite's ``mode=ro``, no ledger made where there is none) and checked as every ledger is (a
plain file in a plain folder, smolbench's own schema). A session whose kernel is gone shows
its unfinished nodes as ``lost`` and none alive, as the next ``%smol up`` records them
(:meth:`Ledger.mark_lost`); nothing is written. A ledger's strings are its author's (a
copied folder): node ids and statuses are shown escaped, rewards only as finite numbers.
The tree is the text one (the live view needs a Workbench: its buttons act on machines).
"""

from __future__ import annotations

import math
import os
from typing import Any

from ._format import time_text
from .ledger import UNFINISHED, Ledger
from .tree import STATUSES, Node, Tree

ID_CHARS = 200  # of a node id or status from a ledger, shown


def open_past(path: str | os.PathLike[str]) -> Ledger | None:
    """The ledger at ``path``, read-only (None where there is none)."""
    return Ledger.read_only(path)


def no_ledger_line(path: str | os.PathLike[str]) -> str:
    return f"smolbench: nothing is up: this folder has no ledger yet ({path}): `%smol up` starts one"


def past_nodes(ledger: Ledger) -> list[dict[str, Any]]:
    """Every node row, oldest first; a gone kernel's as the next ``%smol up`` records them."""
    dead = set(ledger.dead_sessions())
    rows = ledger.node_rows()
    for row in rows:
        if row.get("session_id") in dead:
            if row.get("status") in UNFINISHED:
                row["status"] = "lost"
                row["ended"] = row.get("ended") or row.get("seen") or row.get("started")
            row["alive"] = 0
    return rows


def past_tree(ledger: Ledger) -> tuple[dict[str, Any] | None, Tree]:
    """The last session's row (the session of the newest node) and its nodes as a Tree."""
    rows = past_nodes(ledger)
    tree = Tree()
    if not rows:
        return None, tree
    last = rows[-1].get("session_id")
    sessions = ledger._rows("SELECT * FROM sessions WHERE id IS ?", (last,))
    nodes: dict[str, Node] = {}
    for row in rows:
        if row.get("session_id") == last:
            node = _node(row)
            nodes.setdefault(node.id, node)
    kids: dict[str, list[Node]] = {}
    for node in nodes.values():
        if node.parent not in nodes:
            node.parent = None
        else:
            kids.setdefault(node.parent, []).append(node)
    order = {node_id: i for i, node_id in enumerate(nodes)}
    # Parents first, in one pass (a copied folder's ledger is its author's: a chain of its rows,
    # root read last, took a rescan of every node left per node added): level by level from the
    # roots, each level in ledger order. A node whose parent the ledger lacks shows as a root;
    # so does, when only nodes under a loop of parents are left, the first of them in ledger
    # order, and the rest follow from it.
    level = [node for node in nodes.values() if node.parent is None]
    left = iter(nodes.values())
    while True:
        while level:
            for node in level:
                tree.add(node)
            level = sorted((kid for node in level for kid in kids.get(node.id, ()) if kid.id not in tree),
                           key=lambda kid: order[kid.id])
        cut = next((node for node in left if node.id not in tree), None)
        if cut is None:
            break
        cut.parent = None
        level = [cut]
    return (sessions[0] if sessions else {"id": last}), tree


def nodes_view(path: str | os.PathLike[str]) -> tuple[Any, str]:
    """(every node as a DataFrame, or None; the line that says what it is) for ``%smol ledger``."""
    import pandas as pd

    ledger = open_past(path)
    if ledger is None:
        return None, no_ledger_line(path)
    try:
        rows = past_nodes(ledger)
    finally:
        ledger.close()
    if not rows:
        return None, f"smolbench: nothing is up, and the ledger {path} has no nodes yet"
    df = pd.DataFrame(rows)
    if "seed" in df:
        df["seed"] = pd.array([None if pd.isna(v) else int(v) for v in df["seed"]], dtype="Int64")
    return df, (f"smolbench: nothing is up: the ledger {path} as last written (read-only; a session whose kernel "
                "is gone shows its unfinished nodes lost and none alive)")


def tree_view(path: str | os.PathLike[str], what: str) -> tuple[Tree | None, str]:
    """(the last session's tree, or None; the line that says what it is) for ``%smol tree`` and
    ``%smol plot`` (``what``: "tree", "rewards")."""
    ledger = open_past(path)
    if ledger is None:
        return None, no_ledger_line(path)
    try:
        session, tree = past_tree(ledger)
    finally:
        ledger.close()
    if session is None:
        return None, f"smolbench: nothing is up, and the ledger {path} has no nodes yet"
    started = session.get("started")
    when = f", started {time_text(started)}" if isinstance(started, (int, float)) else ""
    return tree, (f"smolbench: nothing is up: the last session's {what} from the ledger {path} (session "
                  f"{_shown(session.get('id'))}{when}; read-only: `%smol up` starts a live one)")


def _node(row: dict[str, Any]) -> Node:
    status = row.get("status")
    seed = row.get("seed")
    parent = row.get("parent_id")
    metrics = row.get("metrics")
    return Node(
        _shown(row.get("id")),
        None if parent is None else _shown(parent),
        seed if isinstance(seed, int) and not isinstance(seed, bool) else None,
        status if status in STATUSES else _shown(status),
        alive=row.get("alive") == 1,
        kept=row.get("kept") == 1,
        reward=_finite(row.get("reward")),
        metrics=metrics if isinstance(metrics, dict) else {},
        started=_finite(row.get("started")),
        ended=_finite(row.get("ended")),
        run_id=row.get("run_id") if isinstance(row.get("run_id"), str) else None,
    )


def _finite(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _shown(value: Any) -> str:
    """A ledger's string as one printable line (escaped), at most ID_CHARS."""
    text = str(value)[:ID_CHARS]
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)
