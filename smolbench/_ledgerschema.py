"""The ledger's schema, and the check a ledger's schema passes before anything is read or written.

A ledger in a copied folder is its author's SQLite file, and SQLite runs what its schema
holds: a trigger on the writes that fire it, a view's query on each read, a generated
column's expression on each read of it, a CHECK or DEFAULT expression on each write. One
call of an expensive function (``ltrim`` of a million characters against a million) is one
step of SQLite's machine, which no progress handler cuts off: a 12 KB ledger whose
``checkpoints.path`` was such a generated column held a server thread for 40 minutes. So a
ledger is read only when its schema is what smolbench makes, as SQLite itself reads it.
"""

from __future__ import annotations

import os
import re
import sqlite3

from .errors import SmolbenchError

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY, started REAL, backend TEXT, isolation TEXT, baseline TEXT,
    host TEXT, cwd TEXT, versions TEXT
);
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY, session_id TEXT, kind TEXT, parent_id TEXT, code TEXT, code_hash TEXT,
    n INTEGER, options TEXT, started REAL, ended REAL, status TEXT
);
CREATE TABLE IF NOT EXISTS nodes (
    session_id TEXT, id TEXT, run_id TEXT, parent_id TEXT, machine TEXT, backend TEXT,
    baseline TEXT, seed INTEGER, code TEXT, code_hash TEXT, pushed TEXT, versions TEXT,
    started REAL, ended REAL, status TEXT, reward REAL, metrics TEXT, output TEXT, error TEXT,
    alive INTEGER, kept INTEGER, forked_at INTEGER,
    PRIMARY KEY (session_id, id)
);
CREATE TABLE IF NOT EXISTS cells (
    session_id TEXT, node_id TEXT, seq INTEGER, code TEXT, code_hash TEXT, seed INTEGER,
    pushed TEXT, status TEXT, ts REAL,
    PRIMARY KEY (session_id, node_id, seq)
);
CREATE TABLE IF NOT EXISTS trust (
    session_id TEXT, ts REAL, scope TEXT, detail TEXT
);
CREATE TABLE IF NOT EXISTS attempts (
    session_id TEXT, node_id TEXT, attempt INTEGER, stage TEXT, outcome TEXT, error TEXT, ts REAL,
    PRIMARY KEY (session_id, node_id, attempt)
);
CREATE TABLE IF NOT EXISTS replicas (
    session_id TEXT, parent_id TEXT, host_node TEXT, cells INTEGER, fingerprint TEXT,
    bytes_shipped INTEGER, seconds REAL, ts REAL
);
CREATE TABLE IF NOT EXISTS checkpoints (
    name TEXT PRIMARY KEY, session_id TEXT, node_id TEXT, path TEXT, backend TEXT,
    created REAL, size INTEGER, cells INTEGER, warnings TEXT
);
-- what a checkpoint row says besides (older releases write its nine columns by position): its
-- baseline and machine, a file's source and SHA-256, and when the same file was last added
-- again; for the row of the same name, session, path and size
CREATE TABLE IF NOT EXISTS checkpoint_more (
    name TEXT PRIMARY KEY, session_id TEXT, path TEXT, size INTEGER, baseline TEXT, source TEXT, sha256 TEXT,
    readded REAL, machine TEXT
);
-- for the JupyterLab panel (smolbench.server): newest runs, and a run's rewards, sorted
CREATE INDEX IF NOT EXISTS runs_by_started ON runs (started);
CREATE INDEX IF NOT EXISTS nodes_by_run ON nodes (run_id, reward, id);
"""

# Columns added after the first release: (table, column, type), added to older ledgers on open.
ADDED_COLUMNS = (("nodes", "seen", "REAL"), ("nodes", "host_node", "TEXT"), ("sessions", "pid", "INTEGER"),
                 ("sessions", "pid_start", "TEXT"), ("sessions", "network", "TEXT"), ("runs", "notebook", "TEXT"),
                 ("runs", "cell", "INTEGER"), ("checkpoint_more", "readded", "REAL"), ("checkpoint_more", "machine", "TEXT"),
                 ("checkpoint_more", "mac", "TEXT"))

LENGTH_LIMIT = 16 * 1024 * 1024  # bytes of one string or blob SQLite makes or reads in a ledger
OWN_INDEXES = {" ".join(line.split()).replace(" IF NOT EXISTS", "").rstrip(";")
               for line in SCHEMA.splitlines() if line.startswith("CREATE INDEX")}
# ... and as releases before the index held each branch's id made it (CREATE INDEX IF NOT EXISTS
# never replaced it): refused by the check of SQL of its own since, though it is smolbench's
OWN_INDEXES.add("CREATE INDEX nodes_by_run ON nodes (run_id, reward)")
SCHEMA_ENTRIES = 200  # tables and indexes a ledger may have (smolbench makes 9 and 9)
TABLE_SQL = 8192  # characters of one table's CREATE statement (smolbench's: under 400)
# The declared types a column smolbench (or a later release, a column it adds) makes has.
PLAIN_TYPES = frozenset({"", "TEXT", "REAL", "INTEGER", "BLOB", "NUMERIC"})
# A table's CREATE statement smolbench could have made is in these characters alone: words,
# blanks (SQLite's own: space, tab, newline, return), parentheses and commas. So no comment,
# string, quoted name, number or operator is in it, and telling its words apart takes no
# tokenizer to get wrong: SQLite reads every word as this does.
_TABLE_CHARS = re.compile(r"[A-Za-z0-9_ \t\n\r(),]*")
_TOKEN = re.compile(r"[A-Za-z0-9_]+|[(),]")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _own_tables() -> dict[str, dict[str, tuple[str, int]]]:
    """The tables smolbench makes, as SQLite reads them (``PRAGMA table_xinfo`` of a ledger made
    in memory as :class:`smolbench.ledger.Ledger` makes one): {table: {column: (type, pk)}}."""
    conn = sqlite3.connect(":memory:")
    try:
        conn.executescript(SCHEMA)
        for table, column, kind in ADDED_COLUMNS:
            if column not in {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}:
                conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {t: {str(c[1]).lower(): (str(c[2]).upper(), int(c[5]))
                    for c in conn.execute("SELECT * FROM pragma_table_xinfo(?)", (t,))} for t in tables}
    finally:
        conn.close()


OWN_TABLES = _own_tables()


class UnsafeLedger(SmolbenchError):
    """A ledger whose schema holds SQL of its own: it would run on this process's reads or writes."""

    def __init__(self, where: str | os.PathLike[str], what: str) -> None:
        super().__init__(f"ledger {where} {what}")
        self.what = what


def plain_table(sql: str) -> bool:
    """Whether ``sql``, a table's CREATE statement, holds nothing smolbench never writes there:
    column names, each with one of :data:`PLAIN_TYPES` and PRIMARY KEY or UNIQUE, and a PRIMARY
    KEY of names; no CHECK, DEFAULT, generated column, COLLATE, foreign key or table option,
    whether or not a comment stands in the middle of one (the check before this one looked
    for ``CHECK (`` in the text: ``CHECK --x\\n(`` and ``AS /**/ (`` went through)."""
    if len(sql) > TABLE_SQL or not _TABLE_CHARS.fullmatch(sql):
        return False
    words = [w.upper() for w in _TOKEN.findall(sql)]
    if words[:2] != ["CREATE", "TABLE"] or len(words) < 6 or not _NAME.fullmatch(words[2]) or words[3] != "(" \
            or words[-1] != ")":
        return False
    items: list[list[str]] = [[]]
    depth = 0
    for word in words[4:-1]:
        depth += (word == "(") - (word == ")")
        if depth < 0:
            return False
        if word == "," and depth == 0:
            items.append([])
        else:
            items[-1].append(word)
    return depth == 0 and all(_plain_item(item) for item in items)


def _plain_item(item: list[str]) -> bool:
    """One column of a plain table (``name [TYPE] [PRIMARY KEY | UNIQUE]...``), or its key
    (``PRIMARY KEY (name, ...)``)."""
    if item[:3] == ["PRIMARY", "KEY", "("]:
        names = item[3:-1]
        return item[-1] == ")" and len(names) % 2 == 1 and \
            all(_NAME.fullmatch(w) if i % 2 == 0 else w == "," for i, w in enumerate(names))
    if not item or not _NAME.fullmatch(item[0]):
        return False
    rest = item[1:]
    if rest and rest[0] in PLAIN_TYPES:
        rest = rest[1:]
    while rest:
        if rest[:2] == ["PRIMARY", "KEY"]:
            rest = rest[2:]
        elif rest[0] == "UNIQUE":
            rest = rest[1:]
        else:
            return False
    return True


def guard(conn: sqlite3.Connection, where: str | os.PathLike[str]) -> None:
    """Refuse a ledger whose schema runs SQL of its own, before anything is read or written.

    A ledger in a copied folder is its author's file. SQLite runs a trigger on the writes
    that fire it and a view's query on every read of it: a trigger rewrote the code this
    kernel recorded for a cell (which ``%smol replay`` then ran), and a view of an endless
    recursive query hung the Jupyter server. Only tables and indexes smolbench could have
    made are accepted: each table's CREATE statement plain (:func:`plain_table`), and as
    SQLite reads it (``PRAGMA table_xinfo``) no column generated, with a default or NOT NULL;
    smolbench's own tables with their columns' types and keys (older releases' tables lack
    columns, a later release's may have more, plain ones); the indexes smolbench makes.
    What the schema may still call is limited to innocuous functions, and every string to
    :data:`LENGTH_LIMIT`."""
    conn.execute("PRAGMA trusted_schema=OFF")
    if hasattr(conn, "setlimit"):  # Python 3.11
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, LENGTH_LIMIT)
    entries = conn.execute("SELECT type, name, sql FROM sqlite_master LIMIT ?", (SCHEMA_ENTRIES + 1,)).fetchall()
    if len(entries) > SCHEMA_ENTRIES:
        raise UnsafeLedger(where, f"has more than {SCHEMA_ENTRIES} tables and indexes, which smolbench never makes: "
                                  "move it aside, and a new ledger is started")
    for kind, name, sql in entries:
        text = " ".join(str(sql or "").split())
        if kind == "table":
            plain = isinstance(sql, str) and plain_table(sql) and _plain_columns(conn, str(name))
        elif kind == "index":
            plain = text in OWN_INDEXES if sql is not None else str(name).startswith("sqlite_autoindex_")
        else:
            plain = False  # a trigger, a view
        if not plain:
            raise UnsafeLedger(where, f"holds SQL of its own ({kind} {str(name)[:60]!r}), which would run here: "
                                      "smolbench doesn't use it (move it aside, and a new ledger is started)")
        own = OWN_TABLES.get(str(name).lower()) if kind == "table" else None
        if own is not None:
            _own_columns(conn, where, str(name), own)


def sound(conn: sqlite3.Connection, where: str | os.PathLike[str]) -> None:
    """Refuse a ledger whose pages SQLite's own check finds wrong (``PRAGMA quick_check``, linear
    in the file: ~0.3 s for 170 MB). A b-tree whose pages all name one page below is read by a
    scan as if it held that page's rows 510**depth times (an audit's 282 KB ledger: days for a
    count, a GiB of rows in 10 s); the check visits each page once and finds it out of order
    or referenced twice."""
    said = conn.execute("PRAGMA quick_check(1)").fetchone()
    if not said or said[0] != "ok":
        what = " ".join(str(said[0] if said else "nothing").split())[:160]
        raise UnsafeLedger(where, f"is damaged (SQLite's own check says: {what}): move it aside, and a new "
                                  "ledger is started")


def _plain_columns(conn: sqlite3.Connection, table: str) -> bool:
    """Whether every column of ``table``, as SQLite reads it, is a plain stored one: not
    generated (hidden), without a default, not NOT NULL."""
    return all(hidden == 0 and default is None and not notnull for notnull, default, hidden in conn.execute(
        'SELECT "notnull", dflt_value, hidden FROM pragma_table_xinfo(?)', (table,)))


def _own_columns(conn: sqlite3.Connection, where: str | os.PathLike[str], table: str,
                 own: dict[str, tuple[str, int]]) -> None:
    """Refuse one of smolbench's tables whose columns smolbench reads or writes are not as it
    makes them: a type other than its own, another key (a checkpoint's claims are joined to it
    by name: a checkpoint_more made ahead without that key kept a planted row beside the one
    this kernel writes), a UNIQUE one (a save of one row would replace another)."""
    key = sorted((pk, column) for column, (_, pk) in own.items() if pk)
    have_key = []
    for _, column, kind, _, _, pk, _ in conn.execute("SELECT * FROM pragma_table_xinfo(?)", (table,)):
        column = str(column).lower()
        want = own.get(column)
        if pk:
            have_key.append((pk, column))
        if str(kind).upper() != want[0] if want is not None else str(kind).upper() not in PLAIN_TYPES:
            raise UnsafeLedger(where, f"has a {table} table whose column {column[:60]!r} is {str(kind)[:60]}, not "
                                      "as smolbench makes it: move it aside, and a new ledger is started")
    if sorted(have_key) != key:
        raise UnsafeLedger(where, f"has a {table} table keyed otherwise than smolbench makes it (by "
                                  f"{', '.join(c for _, c in key) or 'none'}): move it aside, and a new ledger is started")
    for index, origin in conn.execute("SELECT name, origin FROM pragma_index_list(?)", (table,)):
        unique = {str(r[0]).lower() for r in conn.execute("SELECT name FROM pragma_index_info(?)", (index,))}
        if origin == "u" and unique & own.keys():
            raise UnsafeLedger(where, f"has a {table} table with a UNIQUE column smolbench doesn't make "
                                      f"({', '.join(sorted(unique & own.keys()))[:60]}): move it aside, and a new "
                                      "ledger is started")
