"""Read-only, paginated queries on a folder's ledger, for the server's REST API.

The database is opened with ``mode=ro`` (a URI), so nothing the server does can change
it. Every string in a ledger may come from a machine (outputs, errors, rewards it
reported): the API returns them as JSON data and the frontend shows them as text.
"""

from __future__ import annotations

import contextlib
import json
import math
import sqlite3
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SPARK_POINTS = 24
CODE_CHARS = 400
TEXT_CHARS = 2000
MAX_LIMIT = 500


class LedgerUnreadable(Exception):
    """A ledger that exists but can't be read as one (corrupt, not SQLite, wrong tables)."""


@contextlib.contextmanager
def open_ro(db: Path) -> Iterator[sqlite3.Connection]:
    """A read-only connection to ``db`` (raises LedgerUnreadable with one line saying why)."""
    uri = "file:" + urllib.parse.quote(str(db)) + "?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=5, check_same_thread=False)
    except sqlite3.Error as exc:
        raise LedgerUnreadable(f"can't open {db} ({exc})") from None
    try:
        yield conn
    except sqlite3.DatabaseError as exc:
        raise LedgerUnreadable(f"{db} is not a readable smolbench ledger ({exc})") from None
    finally:
        conn.close()


def _finite(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _text(value: Any, limit: int = TEXT_CHARS) -> str | None:
    if value is None:
        return None
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _page(limit: int, offset: int) -> tuple[int, int]:
    return max(1, min(int(limit), MAX_LIMIT)), max(0, int(offset))


def spark(sorted_rewards: list[float], points: int = SPARK_POINTS) -> list[float]:
    """At most ``points`` evenly spaced values of a sorted list (its shape, cheaply)."""
    n = len(sorted_rewards)
    if n <= points:
        return sorted_rewards
    return [sorted_rewards[round(i * (n - 1) / (points - 1))] for i in range(points)]


def sessions(db: Path, limit: int = 50, offset: int = 0) -> dict[str, Any]:
    """Kernel sessions (one per ``%smol up``), newest first."""
    limit, offset = _page(limit, offset)
    with open_ro(db) as conn:
        total = conn.execute("SELECT count(*) FROM sessions").fetchone()[0]
        rows = conn.execute(
            "SELECT id, started, backend, isolation, baseline, host, cwd FROM sessions "
            "ORDER BY started DESC LIMIT ? OFFSET ?", (limit, offset)).fetchall()
    keys = ("id", "started", "backend", "isolation", "baseline", "host", "cwd")
    return {"total": total, "offset": offset, "limit": limit,
            "sessions": [{k: (_text(v, 300) if isinstance(v, str) else v) for k, v in zip(keys, r)} for r in rows]}


def runs(db: Path, limit: int = 20, offset: int = 0) -> dict[str, Any]:
    """Forks and episodes, newest first: cell, N, best reward, a reward sparkline, times."""
    limit, offset = _page(limit, offset)
    with open_ro(db) as conn:
        total = conn.execute("SELECT count(*) FROM runs").fetchone()[0]
        rows = conn.execute(
            "SELECT id, session_id, kind, parent_id, substr(code, 1, ?), n, started, ended, status "
            "FROM runs ORDER BY started DESC LIMIT ? OFFSET ?", (CODE_CHARS, limit, offset)).fetchall()
        out = []
        for rid, sid, kind, parent, code, n, started, ended, status in rows:
            # (run_id, reward) is indexed: this reads the run's rewards already sorted
            rewards = [r for (v,) in conn.execute(
                "SELECT reward FROM nodes WHERE run_id = ? AND reward IS NOT NULL ORDER BY reward", (rid,))
                if (r := _finite(v)) is not None]
            best = conn.execute("SELECT id FROM nodes WHERE run_id = ? AND reward IS NOT NULL "
                                "ORDER BY reward DESC LIMIT 1", (rid,)).fetchone() if rewards else None
            out.append({
                "id": rid, "session_id": sid, "kind": kind, "parent_id": parent, "code": code,
                "n": n, "started": started, "ended": ended, "status": status,
                "best_reward": rewards[-1] if rewards else None, "best_node": best[0] if best else None,
                "rewarded": len(rewards),
                "spark": spark(rewards),
            })
    return {"total": total, "offset": offset, "limit": limit, "runs": out}


NODE_KEYS = ("id", "parent_id", "run_id", "seed", "status", "reward", "started", "ended",
             "alive", "kept", "error", "output", "metrics")


def nodes(db: Path, run: str | None = None, session: str | None = None, limit: int = 200,
          offset: int = 0) -> dict[str, Any]:
    """A run's tree (its parent, its branches and every fork nested under them), or a
    whole session's nodes; oldest first."""
    limit, offset = _page(limit, offset)
    with open_ro(db) as conn:
        head: dict[str, Any] | None = None
        if run is not None:
            row = conn.execute("SELECT session_id, parent_id, kind, substr(code, 1, ?), n, started, ended, status "
                               "FROM runs WHERE id = ?", (CODE_CHARS, run)).fetchone()
            if row is None:
                raise KeyError(f"no run {run!r} in this ledger")
            session, parent = row[0], row[1]
            head = dict(zip(("session_id", "parent_id", "kind", "code", "n", "started", "ended", "status"), row))
            head["id"] = run
            where = ("session_id = :s AND (run_id IN sub OR id = :parent)")
            prefix = ("WITH RECURSIVE sub(rid) AS (SELECT :run UNION SELECT r.id FROM sub "
                      "JOIN nodes n ON n.session_id = :s AND n.run_id = sub.rid "
                      "JOIN runs r ON r.session_id = :s AND r.parent_id = n.id) ")
            params: dict[str, Any] = {"s": session, "run": run, "parent": parent}
        elif session is not None:
            where, prefix, params = "session_id = :s", "", {"s": session}
        else:
            raise KeyError("name a run (?run=ID) or a session (?session=ID)")
        total = conn.execute(f"{prefix}SELECT count(*) FROM nodes WHERE {where}", params).fetchone()[0]
        rows = conn.execute(
            f"{prefix}SELECT id, parent_id, run_id, seed, status, reward, started, ended, alive, kept, "
            f"substr(error, 1, {TEXT_CHARS}), substr(output, -{TEXT_CHARS}), metrics FROM nodes WHERE {where} "
            "ORDER BY started, rowid LIMIT :limit OFFSET :offset", {**params, "limit": limit, "offset": offset},
        ).fetchall()
    out = []
    for r in rows:
        rec = dict(zip(NODE_KEYS, r))
        rec["reward"] = _finite(rec["reward"])
        rec["alive"], rec["kept"] = bool(rec["alive"]), bool(rec["kept"])
        try:
            metrics = json.loads(rec["metrics"]) if isinstance(rec["metrics"], str) else None
        except ValueError:
            metrics = None
        rec["metrics"] = {str(k)[:60]: _finite(v) if not isinstance(v, str) else _text(v, 200)
                          for k, v in list(metrics.items())[:20]} if isinstance(metrics, dict) else {}
        out.append(rec)
    return {"total": total, "offset": offset, "limit": limit, "run": head, "session": session, "nodes": out}


def checkpoints(db: Path) -> list[dict[str, Any]]:
    """The checkpoints a ledger records, newest first."""
    with open_ro(db) as conn:
        rows = conn.execute("SELECT name, session_id, node_id, path, backend, created, size, cells "
                            "FROM checkpoints ORDER BY created DESC").fetchall()
    keys = ("name", "session_id", "node_id", "path", "backend", "created", "size", "cells")
    return [dict(zip(keys, r)) for r in rows]
