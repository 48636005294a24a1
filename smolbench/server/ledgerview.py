"""Read-only, paginated queries on a folder's ledger, for the server's REST API.

The database is opened with ``mode=ro`` (a URI), so nothing the server does can change
it. Every string in a ledger may come from a machine (outputs, errors, rewards it
reported): the API returns them as JSON data and the frontend shows them as text.
"""

from __future__ import annotations

import contextlib
import sqlite3
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .. import _shown
from .._ledgerfiles import SUPER_JOURNAL, odd_part
from .._sqlwatch import cut_off
from ..gate import frames
from ..ledger import UnsafeLedger, guard, picked_once
from ..tree import id_key, node_replay_refused, replay_refused

SPARK_POINTS = 24
CODE_CHARS = 400
ID_CHARS = _shown.ID_CHARS
METRICS_CHARS = 64 * 1024  # a node's metrics JSON read at most (longer: shown as none)
TEXT_CHARS = _shown.TEXT_CHARS
MAX_LIMIT = _shown.MAX_ROWS
MAX_NOTEBOOKS = 1000  # notebooks a folder's runs are counted for
READ_SECONDS = 10.0  # one request's reads of one ledger, at most (a 100,000-node ledger: ~50 ms)


class LedgerUnreadable(Exception):
    """A ledger that exists but can't be read as one (corrupt, not SQLite, wrong tables);
    the message continues "<the ledger> ..." (callers name it, relative to the root)."""


def odd_ledger(db: Path) -> str | None:
    """Why the ledger ``db`` is not read (:func:`smolbench._ledgerfiles.odd_part`): "has a fifo at
    ledger.db-journal: ..."; None if it may be."""
    odd = odd_part(db)
    if odd is None:
        return None
    if odd[1] == SUPER_JOURNAL:
        return f"has {odd[1]} at {odd[0].name}: smolbench's ledger never keeps one, so it was put there"
    return f"has {odd[1]} at {odd[0].name}: a ledger is read only as a plain file in a plain folder (as a kernel does)"


@contextlib.contextmanager
def open_ro(db: Path, write: bool = False) -> Iterator[sqlite3.Connection]:
    """A read-only connection to ``db`` (raises LedgerUnreadable with one line saying why):
    its schema checked (:func:`smolbench.ledger.guard`: a view's query would run on each read),
    and each use of it cut off after :data:`READ_SECONDS` (the server's threads are few).
    ``write``: opened to write (the sidebar's delete), checked and cut off the same way."""
    odd = odd_ledger(db)  # before SQLite opens anything by path (a fifo -journal hung the server's threads)
    if odd is not None:
        raise LedgerUnreadable(odd)
    uri = "file:" + urllib.parse.quote(str(db)) + ("?mode=rw" if write else "?mode=ro")
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=10 if write else 5, check_same_thread=False)
    except sqlite3.Error as exc:
        raise LedgerUnreadable(f"can't be opened ({exc})") from None
    # Interrupted at the deadline, whatever runs: a progress handler sees only between steps of
    # SQLite's machine, and one step can be long (a count walking a b-tree whose pages all name
    # one page below; the schema's parse, a view of 150,000 CTEs; one ltrim of a million
    # characters, which only the guard's refusal of the ledger's own expressions keeps out)
    try:
        with cut_off(conn, READ_SECONDS) as cut:
            guard(conn, db)
            yield conn
    except UnsafeLedger as exc:
        raise LedgerUnreadable(exc.what) from None
    except sqlite3.DatabaseError as exc:
        if cut.stopped(exc):
            raise LedgerUnreadable(f"took more than {READ_SECONDS:.0f} s to read: left out") from None
        raise LedgerUnreadable(f"is not a readable smolbench ledger ({exc})") from None
    finally:
        conn.close()


_finite = _shown.finite
_text = _shown.text
_cut = _shown.sql_cut


def _plain(value: Any, chars: int = ID_CHARS) -> Any:
    """A column's value as JSON can carry it: text cut, a finite number, or None (a blob, from a
    copied ledger, failed the whole page's encoding)."""
    if isinstance(value, str):
        return _text(value, chars)
    if value is None or isinstance(value, int):  # (a bool too)
        return value
    return _finite(value)


def _id(value: Any) -> str | None:
    """An id as text, never None for a value that is there: the run tree splits a node's id and
    keys a run's view by its id (a copied ledger's blob id came back null, a number as a number);
    a blob is written as SQL writes one, ``x'00ff'``."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = f"x'{value.hex()}'"
    return _text(value if isinstance(value, str) else str(value), ID_CHARS)


def _page(limit: int, offset: int) -> tuple[int, int]:
    return max(1, min(int(limit), MAX_LIMIT)), max(0, int(offset))


FINITE = "reward BETWEEN -1.7e308 AND 1.7e308"  # finite rewards only (and it keeps the index range)


def spark_ranks(count: int, points: int = SPARK_POINTS) -> list[int]:
    """Which ranks (0-based, in sorted order) a sparkline of ``count`` sorted values shows."""
    if count <= points:
        return list(range(count))
    return sorted({round(i * (count - 1) / (points - 1)) for i in range(points)})


_SUMMARIES: dict[tuple[str, str, float], dict[str, Any]] = {}  # finished runs never change their rewards
_SUMMARY_CACHE = 20_000


def _summary(conn: sqlite3.Connection, db: str, run_id: str, ended: Any) -> dict[str, Any]:
    """A run's best reward and node, how many branches have one, and a sparkline of the sorted
    rewards (at most SPARK_POINTS evenly spaced values).

    A finished run's summary is remembered.
    """
    key = (db, run_id, ended) if isinstance(ended, (int, float)) else None
    if key is not None and key in _SUMMARIES:
        return _SUMMARIES[key]
    # counted, then the sparkline's ranks picked, straight off the (run_id, reward, id) index:
    # only SPARK_POINTS values leave SQLite (all of a copied ledger's 6M-branch run, read into
    # Python to pick 24 of them, cost 508 MB per runs page)
    count = conn.execute(f"SELECT count(*) FROM nodes WHERE run_id = ? AND {FINITE}", (run_id,)).fetchone()[0]
    ranks = spark_ranks(count)
    picked = [r[0] for r in conn.execute(
        f"SELECT reward FROM (SELECT reward, row_number() OVER (ORDER BY reward) - 1 AS k FROM nodes "
        f"WHERE run_id = ? AND {FINITE}) WHERE k IN ({', '.join('?' * len(ranks))}) ORDER BY k",
        (run_id, *ranks))] if ranks else []
    # the top reward's branches; a tie goes to the first in natural order (tree.best_key)
    tied = [r[0] for r in conn.execute(
        f"SELECT id FROM nodes WHERE run_id = ? AND status = 'ok' AND reward = "
        f"(SELECT max(reward) FROM nodes WHERE run_id = ? AND status = 'ok' AND {FINITE})",
        (run_id, run_id)).fetchall()] if count else []
    best = (min(tied, key=lambda i: id_key(str(i))),) if tied else None
    spark = [v for r in picked if (v := _finite(r)) is not None]
    out = {"best_reward": spark[-1] if spark else None, "best_node": best[0] if best else None,
           "rewarded": count, "spark": spark}
    if key is not None:
        if len(_SUMMARIES) >= _SUMMARY_CACHE:
            _SUMMARIES.clear()
        _SUMMARIES[key] = out
    return out


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


def runs(db: Path, limit: int = 20, offset: int = 0, notebook: list[str] | None = None) -> dict[str, Any]:
    """Forks and episodes, newest first: notebook, cell, N, best reward, a reward sparkline,
    times, and whether Replay can rebuild its best branch (``replayable``; if not,
    ``replay_refused`` says why in one line). ``notebook``: only runs of one of these notebook
    paths ([""]: runs that name none, as in ledgers older than the notebook column);
    ``notebooks`` counts the runs of each."""
    limit, offset = _page(limit, offset)
    with open_ro(db) as conn:
        have = {row[1] for row in conn.execute("PRAGMA table_info(runs)")}
        where_cols = "notebook, cell" if {"notebook", "cell"} <= have else "NULL, NULL"
        counts = conn.execute(f"SELECT substr({where_cols.split(',')[0]}, 1, 1000), count(*) FROM runs GROUP BY 1 "
                              f"ORDER BY 1 LIMIT {MAX_NOTEBOOKS}").fetchall()
        args: tuple[str, ...] = ()
        if notebook is None:
            cond = "1"
        elif notebook == [""]:
            cond = "notebook IS NULL" if "notebook" in have else "1"
        elif "notebook" in have:
            cond, args = f"notebook IN ({', '.join('?' * len(notebook))})", tuple(notebook)
        else:
            cond = "0"
        total = conn.execute(f"SELECT count(*) FROM runs WHERE {cond}", args).fetchone()[0]
        nb_col, cell_col = where_cols.split(", ")
        rows = conn.execute(
            f"SELECT {_cut('id')}, {_cut('session_id')}, {_cut('kind')}, {_cut('parent_id')}, "
            f"{_cut('code', CODE_CHARS)}, n, started, ended, {_cut('status')}, {_cut(nb_col, 1000)}, {cell_col} "
            f"FROM runs WHERE {cond} ORDER BY started DESC LIMIT ? OFFSET ?", (*args, limit, offset)).fetchall()
        out = []
        for row in rows:
            rid, sid, kind, parent, code, n, started, ended, status, nb, cell = (_plain(v, 1000) for v in row)
            if row[0] is None:  # (a run with no id: nothing can ask for its tree)
                continue
            rid = str(_id(row[0]))
            refused = replay_refused(kind)
            out.append({
                "id": rid, "session_id": sid, "kind": kind, "parent_id": parent, "code": code,
                "n": n, "started": started, "ended": ended, "status": status,
                "notebook": nb, "cell": cell if isinstance(cell, int) else None,
                "replayable": refused is None, "replay_refused": refused,
                **_summary(conn, str(db), rid, ended),
            })
    return {"total": total, "offset": offset, "limit": limit, "runs": out,
            "notebooks": [{"notebook": _text(nb, 1000), "runs": k} for nb, k in counts]}


NODE_KEYS = ("id", "parent_id", "run_id", "seed", "status", "reward", "started", "ended",
             "alive", "kept", "error", "output", "metrics", "host_node")


def nodes(db: Path, run: str | None = None, session: str | None = None, limit: int = 200,
          offset: int = 0) -> dict[str, Any]:
    """A run's tree (its parent, its branches and every fork nested under them), or a
    whole session's nodes; in the order they were recorded. A node replay refuses (a gym
    episode) has ``replay_refused``: why, in one line (else None)."""
    limit, offset = _page(limit, offset)
    with open_ro(db) as conn:
        head: dict[str, Any] | None = None
        host = "host_node" in {row[1] for row in conn.execute("PRAGMA table_info(nodes)")}  # older ledgers lack it
        cols = (f"{_cut('id')}, {_cut('parent_id')}, {_cut('run_id')}, {_cut('seed')}, {_cut('status')}, reward, "
                f"started, ended, alive, kept, {_cut('error', TEXT_CHARS)}, "
                f"CASE WHEN typeof(output) IN ('text', 'blob') THEN substr(output, -{TEXT_CHARS}) ELSE output END, "
                f"CASE WHEN length(metrics) <= {METRICS_CHARS} THEN metrics END, "
                f"{_cut('host_node', 128) if host else 'NULL'}")
        rows: list[Any] = []
        if run is not None:
            row = conn.execute(f"SELECT session_id, parent_id, {_cut('kind')}, {_cut('code', CODE_CHARS)}, n, started, "
                               f"ended, {_cut('status')} FROM runs WHERE id = ?", (run,)).fetchone()
            if row is None:
                raise KeyError(f"no run {run!r} in this ledger")
            session, parent = row[0], row[1]  # (matched as they are)
            row = tuple(_plain(v, CODE_CHARS) for v in row)
            head = dict(zip(("session_id", "parent_id", "kind", "code", "n", "started", "ended", "status"), row))
            head["id"] = run
            # the run, and every run forked (at any depth) from one of its branches
            sub = [r for (r,) in conn.execute(
                "WITH RECURSIVE sub(rid) AS (SELECT :run UNION SELECT r.id FROM sub JOIN runs r ON r.session_id = :s "
                "JOIN nodes n ON n.session_id = :s AND n.id = r.parent_id AND n.run_id = sub.rid) SELECT rid FROM sub",
                {"run": run, "s": session})]
            marks = ", ".join("?" * len(sub))
            top = conn.execute(f"SELECT {cols} FROM nodes WHERE session_id = ? AND id = ?", (session, parent)).fetchall() \
                if parent is not None else []
            # run ids are the runs table's primary key, so run_id alone picks the nodes (index only)
            total = len(top) + conn.execute(f"SELECT count(*) FROM nodes WHERE run_id IN ({marks})", sub).fetchone()[0]
            rows = top[offset:offset + limit]
            if len(rows) < limit:
                # a page of rowids off the run_id index (insertion order: when each branch was laid out)
                rows += conn.execute(
                    f"SELECT {cols} FROM nodes WHERE rowid IN (SELECT rowid FROM nodes WHERE run_id IN ({marks}) "
                    "ORDER BY rowid LIMIT ? OFFSET ?) ORDER BY rowid",
                    (*sub, limit - len(rows), max(0, offset - len(top)))).fetchall()
        elif session is not None:
            total = conn.execute("SELECT count(*) FROM nodes WHERE session_id = ?", (session,)).fetchone()[0]
            rows = conn.execute(f"SELECT {cols} FROM nodes WHERE session_id = ? ORDER BY rowid LIMIT ? OFFSET ?",
                                (session, limit, offset)).fetchall()
        else:
            raise KeyError("name a run (?run=ID) or a session (?session=ID)")
    out = []
    for r in rows:
        rec = {k: v if k == "metrics" else _plain(v, TEXT_CHARS) for k, v in zip(NODE_KEYS, r)}
        if r[0] is None:  # a node with no id (a copied ledger's): nothing to draw it by
            continue
        rec.update(id=_id(r[0]), parent_id=_id(r[1]), run_id=_id(r[2]))
        rec["status"] = _shown.status(rec["status"])  # tree.ts makes it a class name: smolbench's own or "unknown"
        rec["reward"] = _finite(rec["reward"])
        rec["alive"], rec["kept"] = bool(rec["alive"]), bool(rec["kept"])
        try:
            metrics = frames.loads(rec["metrics"]) if isinstance(rec["metrics"], str) else None
        except ValueError:
            metrics = None
        rec["replay_refused"] = node_replay_refused(metrics if isinstance(metrics, dict) else None, rec["run_id"])
        rec["metrics"] = _shown.metrics(metrics)
        out.append(rec)
    return {"total": total, "offset": offset, "limit": limit, "run": head, "session": session, "nodes": out}


def checkpoints(db: Path, limit: int = MAX_LIMIT) -> tuple[list[dict[str, Any]], int]:
    """The newest ``limit`` checkpoints a ledger records (at most MAX_LIMIT, each text cut to
    TEXT_CHARS, numbers finite or None: a copied ledger's rows are anyone's), and how many it
    records in all."""
    limit = max(0, min(limit, MAX_LIMIT))
    with open_ro(db) as conn:
        total = int(conn.execute("SELECT count(*) FROM checkpoints").fetchone()[0])
        rows = conn.execute(
            "SELECT " + ", ".join(f"substr({c}, 1, {TEXT_CHARS})" for c in ("name", "session_id", "node_id", "path",
                                                                          "backend")) +
            ", created, size, cells FROM checkpoints ORDER BY created DESC LIMIT ?", (limit,)).fetchall()
    keys = ("name", "session_id", "node_id", "path", "backend", "created", "size", "cells")
    out: list[dict[str, Any]] = []
    for r in rows:
        rec = dict(zip(keys, r))
        for k in ("created", "size", "cells"):  # (an int stays one: a size is shown as written)
            rec[k] = rec[k] if isinstance(rec[k], int) and not isinstance(rec[k], bool) else _finite(rec[k])
        out.append(rec)
    return out, total


def unlisted_paths(db: Path, skip: int, file_of: Callable[[Any], str | None]) -> list[str]:
    """The files that checkpoint rows after the newest ``skip`` name (``file_of``: the file in
    the checkpoint folder a row's path stands for, if it is there; see
    :func:`smolbench._shelflist.files_there`): the files of rows a listing leaves out, which are not
    files dropped into the folder. Each file once: a copied ledger's 8.9 MB of rows, all read
    at once, cost 497 MB; these are as many as the folder's files at most."""
    with open_ro(db) as conn:
        return picked_once(conn.execute(f"SELECT substr(path, 1, {TEXT_CHARS}) FROM checkpoints ORDER BY created "
                                        "DESC LIMIT -1 OFFSET ?", (max(0, skip),)), file_of)

