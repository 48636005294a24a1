"""The ledger: a durable record of every run, node and checkpoint, outside every machine.

SQLite in WAL mode at ``.smolbench/ledger.db`` beside the notebook. A node's row
is written when it starts and updated (and committed) the moment it ends, so a
crash of the kernel loses no finished branch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import sqlite3
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._ledgerfiles import refuse_links
from ._ledgerschema import ADDED_COLUMNS, SCHEMA, UnsafeLedger, guard, sound
from ._shown import TEXT_CHARS, sql_cut
from ._sqlwatch import cut_off
from .errors import SmolbenchError

if TYPE_CHECKING:
    import pandas as pd

DEFAULT_PATH = ".smolbench/ledger.db"
OUTPUT_LIMIT = 16 * 1024  # characters of a node's output kept in the ledger

NODE_COLUMNS = (
    "run_id", "parent_id", "machine", "backend", "baseline", "seed", "code", "code_hash",
    "pushed", "versions", "started", "ended", "status", "reward", "metrics", "output", "error",
    "alive", "kept", "forked_at", "host_node",
)
# A checkpoint's baseline (a file's: what its record claims), and for a file from elsewhere the
# path it was added from and its SHA-256 as added: in checkpoint_more, joined to its row.
MORE_COLUMNS = ("baseline", "source", "sha256")
CHECKPOINTS = (f"SELECT c.*, {', '.join(f'm.{c}' for c in MORE_COLUMNS)}, m.readded FROM checkpoints c "
               "LEFT JOIN checkpoint_more m ON m.name = c.name AND m.session_id IS c.session_id "
               "AND m.path IS c.path AND m.size IS c.size")
# ... and what it says of the machine that saved it (a JSON object, MachineSpec.machine; a file's:
# what its record claims), in a column a ledger opened read-only may not have yet
WITH_MACHINE = CHECKPOINTS.replace("m.readded FROM", "m.readded, m.machine FROM")
# ... and its signature (smolbench.signing: this user's kernel wrote it), a newer column still
WITH_MAC = CHECKPOINTS.replace("m.readded FROM", "m.readded, m.machine, m.mac FROM")
# The same rows as a view shows them: each text column cut where it is read (smolbench._shown;
# a copied ledger's 2 MB node ids were the checkpoint panel's 20 MB). JSON columns stay whole
# (decoded within 1 MiB and checked, CHECKPOINT_JSON), and so does the MAC.
_WHOLE = f"SELECT c.*, {', '.join(f'm.{c}' for c in MORE_COLUMNS)}, m.readded"
_CUT = ("SELECT " + ", ".join(f"{sql_cut(f'c.{c}', TEXT_CHARS)} AS {c}" for c in ("name", "session_id", "node_id",
                                                                                 "path", "backend")) +
        ", c.created, c.size, c.cells, c.warnings, " +
        ", ".join(f"{sql_cut(f'm.{c}', TEXT_CHARS)} AS {c}" for c in MORE_COLUMNS) + ", m.readded")
UNFINISHED = ("starting", "running", "idle")
JSON_COLUMNS = {"pushed", "versions", "metrics", "options", "warnings", "machine"}
# A checkpoint row's JSON columns, which a copied ledger may hold anything in: what smolbench
# writes there, and what a row that holds something else reads as (said in its "damaged").
CHECKPOINT_JSON: dict[str, tuple[Callable[[Any], bool], Any]] = {
    "warnings": (lambda v: isinstance(v, list) and len(v) <= 20 and all(isinstance(w, str) for w in v), []),
    "machine": (lambda v: v is None or isinstance(v, dict), None),
}
# characters of one of them, at most: json.loads of 12 MB cost ~300 MB; an honest one is under
# 250 kB (20 imported warnings of 2,000 characters, each \uXXXX-escaped at worst)
JSON_LIMIT = 1 << 20


BUSY_TIMEOUT = 30.0  # seconds a write waits for another kernel's transaction on the same ledger
CHECKPOINT_WAIT = 2.0  # seconds folding the WAL into the file waits for another process's readers
# seconds of SQLite's work an open, a read or a sweep of a ledger may take (a lock's wait for
# another kernel within it): what is one step of SQLite's machine (a copied ledger's b-tree
# that names one page again and again, a schema made to parse for hours) is cut off there
WORK_SECONDS = BUSY_TIMEOUT + 30.0


class SlowLedger(SmolbenchError):
    """A ledger whose open or read took SQLite more than :data:`WORK_SECONDS` (cut off)."""

    def __init__(self, path: str | os.PathLike[str], doing: str) -> None:
        said = (f"ledger {path} took more than {WORK_SECONDS:g} s to {doing}, and SQLite's work on it was cut off: "
                "it may be damaged, or made to be slow (a copied folder's); move it aside (a new one is started)")
        super().__init__(f"{said} or name another with --ledger PATH", api=f"{said} or name another with "
                         "`Session(ledger=PATH)`")


def code_hash(code: str) -> str:
    """A short content hash of a cell's code."""
    return hashlib.sha256(code.encode()).hexdigest()[:16]

def picked_once(rows: Iterable[Sequence[Any]], pick: Callable[[Any], Any]) -> list[Any]:
    """Each value ``pick`` gives (not None) for the first column of ``rows``, once, the rows read
    one at a time (a copied ledger's rows may be millions; what is kept is what ``pick`` names)."""
    picked: dict[Any, None] = {}
    for row in rows:
        if (value := pick(row[0])) is not None:
            picked[value] = None
    return list(picked)

class Ledger:
    """The durable record of a notebook's exploration (safe to use from any thread)."""

    _still: tuple[Any, ...] | None = None  # a read-only open's file as it was (immutable: see read_only)
    _writes = False  # opened to write (not read_only): its WAL is folded into the file by fold_wal()

    def __init__(self, path: str | os.PathLike[str] = DEFAULT_PATH) -> None:
        self.path = Path(path)
        if not self.path.name or self.path.is_dir():
            raise SmolbenchError(f"ledger {path} is a folder: name a file, e.g. {self.path / 'ledger.db'}")
        refuse_links(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._writes = True
        self._node_sql: dict[tuple[str, ...], tuple[str, tuple[int, ...]]] = {}  # upsert_node's, by its columns
        try:
            self._db = sqlite3.connect(str(self.path), check_same_thread=False, timeout=BUSY_TIMEOUT,
                                       isolation_level=None)
        except sqlite3.Error as exc:
            raise SmolbenchError(f"can't open the ledger {path} ({exc}): check the path and its permissions") from None
        try:
            with self._in_time("open"):
                guard(self._db, self.path)
                sound(self._db, self.path)
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=NORMAL")
                self._db.executescript(SCHEMA)
                for table, column, kind in ADDED_COLUMNS:
                    have = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
                    if column not in have:
                        self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
                self._move_checkpoint_columns()
        except sqlite3.DatabaseError as exc:
            self._db.close()
            if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
                raise SmolbenchError(f"ledger {path} stayed locked by another program for {BUSY_TIMEOUT:g} s ({exc}): "
                                     "try again once it is done, or name another with --ledger PATH",
                                     api=f"ledger {path} stayed locked by another program for {BUSY_TIMEOUT:g} s ({exc}): "
                                     "try again once it is done, or name another with `Session(ledger=PATH)`") from None
            raise SmolbenchError(f"ledger {path} is not a smolbench ledger ({exc}): move it aside (a new one is "
                                 "started) or name another with --ledger PATH",
                                 api=f"ledger {path} is not a smolbench ledger ({exc}): move it aside (a new one is "
                                 "started) or name another with `Session(ledger=PATH)`") from None
        except BaseException:
            self._db.close()
            raise
        _closed_at_exit(self)

    @classmethod
    def read_only(cls, path: str | os.PathLike[str] = DEFAULT_PATH) -> Ledger | None:
        """The ledger at ``path`` to read (nothing written, no table added, no ledger made), or
        None where there is none. Checked as every ledger is opened: a plain file in a plain
        folder, a schema of smolbench's own tables (a copied folder's ledger is its author's file).
        Nothing is removed in its folder, and nothing made but the ``-shm`` SQLite needs to read a
        ``-wal`` that has none (see :meth:`_open_to_read`).
        Immutable means no locks and no change detection: a writer that starts meanwhile (a
        kernel's ``%smol up`` in that folder) would be read half-written or not at all, so each
        read checks the file is as it was at the open, else opens again and reads again."""
        self = cls.__new__(cls)
        self.path = Path(path)
        if not self.path.name or self.path.is_dir():
            raise SmolbenchError(f"ledger {path} is a folder: name a file, e.g. {self.path / 'ledger.db'}")
        refuse_links(self.path)
        if not self.path.exists():
            return None
        self._lock = threading.RLock()
        self._open_to_read()
        return self

    def _open_to_read(self, tries: int = 3) -> None:
        """Open (again) to read, checked, and see the schema. With no ``-wal`` (no writer): the
        file itself, ``immutable=1``, while no writer came since (``_still``). With a ``-wal``, and
        on the last try: ``mode=ro``, SQLite's own locks. A ``-wal`` without its ``-shm`` (a copied
        folder, a dead writer's log) then gets one, which is left: removing it at close took it
        from a writer that came meanwhile (their locking broken), and a private copy of the
        files would cost the host what a sparse ``-wal`` claims."""
        for left in range(tries - 1, -1, -1):
            before = self._stamp()
            query, self._still = "?mode=ro", None
            if not os.path.lexists(self._side("-wal")) and left:
                query, self._still = "?mode=ro&immutable=1", before
            uri = "file:" + urllib.parse.quote(str(self.path.absolute())) + query
            try:
                self._db = sqlite3.connect(uri, uri=True, check_same_thread=False, timeout=BUSY_TIMEOUT,
                                           isolation_level=None)
            except sqlite3.Error as exc:
                raise SmolbenchError(f"can't open the ledger {self.path} to read ({exc}): check the path and its "
                                     "permissions") from None
            try:
                with self._in_time("open"):
                    guard(self._db, self.path)
                    sound(self._db, self.path)
                    self._db.execute("SELECT session_id, id FROM nodes LIMIT 1").fetchall()
            except (UnsafeLedger, sqlite3.DatabaseError) as exc:
                if self._changed():
                    self.close()
                    continue
                self.close()
                if isinstance(exc, UnsafeLedger):
                    raise SmolbenchError(str(exc)) from None
                raise SmolbenchError(f"ledger {self.path} is not a readable smolbench ledger ({exc})") from None
            except BaseException:
                self.close()
                raise
            if not self._changed():
                return
            self.close()
        raise AssertionError("unreachable: the last try opens mode=ro")

    @contextlib.contextmanager
    def _in_time(self, doing: str) -> Iterator[None]:
        """SQLite's work on the ledger in the block, cut off after :data:`WORK_SECONDS` (SlowLedger)."""
        with cut_off(self._db, WORK_SECONDS) as cut:
            try:
                yield
            except sqlite3.OperationalError as exc:
                if cut.stopped(exc):
                    raise SlowLedger(self.path, doing) from None
                raise

    def _side(self, end: str) -> Path:
        return self.path.with_name(self.path.name + end)

    def _stamp(self) -> tuple[Any, ...]:
        """What says a writer came: its ``-wal``, ``-shm`` or ``-journal``, and the inode, size and
        times of the file and of its ``-wal``."""
        stamp: list[Any] = [os.path.lexists(self._side("-shm")), os.path.lexists(self._side("-journal"))]
        for p in (self.path, self._side("-wal")):
            try:
                st = os.lstat(p)
            except OSError:
                stamp.append(None)
                continue
            stamp.append((st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        return tuple(stamp)

    def _changed(self) -> bool:
        """Whether an immutable open's file changed since (what it read may be half a write)."""
        return self._still is not None and self._stamp() != self._still

    def _move_checkpoint_columns(self) -> None:
        """MORE_COLUMNS that a version before added to the checkpoints table go to checkpoint_more,
        and are dropped (SQLite 3.35 drops columns): older releases write a checkpoint row's nine
        values by position ("table checkpoints has 12 columns but 9 values were supplied"). Never
        destructive: a value only replaces one of the same row if it is not NULL (that version
        adds the columns back, empty, to a ledger this one wrote), and a column that can't be
        dropped is emptied once moved, so the next open has nothing to move."""
        def moved() -> list[str]:
            return [r[1] for r in self._db.execute("PRAGMA table_info(checkpoints)") if r[1] in MORE_COLUMNS]

        if not moved():
            return
        self._db.execute("BEGIN IMMEDIATE")  # another kernel opening it meanwhile waits, then finds them moved
        try:
            columns = moved()
            if columns:
                same = ("checkpoint_more.session_id IS excluded.session_id AND checkpoint_more.path IS excluded.path "
                        "AND checkpoint_more.size IS excluded.size")
                sets = ", ".join(f"{c} = CASE WHEN {same} THEN COALESCE(excluded.{c}, checkpoint_more.{c}) "
                                 f"ELSE excluded.{c} END" for c in columns)
                listed = ", ".join(columns)
                # the key last: the CASEs above compare the row as it was
                self._db.execute(f"INSERT INTO checkpoint_more (name, session_id, path, size, {listed}) SELECT name, "
                                 f"session_id, path, size, {listed} FROM checkpoints WHERE true ON CONFLICT (name) DO "
                                 f"UPDATE SET {sets}, readded = CASE WHEN {same} THEN checkpoint_more.readded END, "
                                 "session_id = excluded.session_id, path = excluded.path, size = excluded.size")
            for column in columns:
                try:
                    self._db.execute(f"ALTER TABLE checkpoints DROP COLUMN {column}")
                except sqlite3.OperationalError:  # an older SQLite, or a constraint on it: emptied, unread
                    self._db.execute(f"UPDATE checkpoints SET {column} = NULL")
        except BaseException:
            self._db.execute("ROLLBACK")  # all moved or none: a half-moved column would lose its values
            raise
        self._db.execute("COMMIT")

    def close(self) -> None:
        """Close the database connection."""
        with self._lock:
            self._db.close()
        _OPEN.discard(self)

    def fold_wal(self, wait: float = CHECKPOINT_WAIT) -> bool:
        """Fold the WAL into the ledger file and empty it (``PRAGMA wal_checkpoint(TRUNCATE)``),
        so that ``ledger.db`` alone holds everything written so far: a copy, a download or a
        ``git add`` of that one file is the whole ledger. (SQLite does this itself when the last
        connection closes; a kernel that exits without closing, or beside another process's
        open ledger, left it all in ``ledger.db-wal``.) Waits ``wait`` seconds at most for
        another process's readers; True when all of it went in. Read-only: nothing to do."""
        if not self._writes:
            return True
        with self._lock:
            try:
                self._db.execute(f"PRAGMA busy_timeout = {int(wait * 1000)}")
                try:
                    busy, _, _ = self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
                finally:
                    self._db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT * 1000)}")
            except sqlite3.Error:  # closed, or another process's lock held past the wait: next time
                return False
            return not busy

    # -- writing -----------------------------------------------------------------

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Write what is done inside in one transaction (one commit for many rows; other
        threads' writes wait for it)."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                yield
            finally:
                self._db.execute("COMMIT")

    def _write(self, sql: str, params: Iterable[Any]) -> None:
        with self._lock:
            self._db.execute(sql, tuple(params))

    @staticmethod
    def _enc(key: str, value: Any) -> Any:
        if key in JSON_COLUMNS and value is not None and not isinstance(value, str):
            return json.dumps(value, default=repr)
        if isinstance(value, bool):
            return int(value)
        return value

    def start_session(self, session_id: str, **fields: Any) -> None:
        """Record a kernel session (one ``%smol up``)."""
        fields = {"pid": os.getpid(), "pid_start": _process_start(os.getpid()), **fields}
        cols = ["id", "started", *fields]
        vals = [session_id, time.time(), *(self._enc(k, v) for k, v in fields.items())]
        self._write(f"INSERT OR REPLACE INTO sessions ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})", vals)

    def start_run(self, run_id: str, session_id: str, **fields: Any) -> None:
        """Record a fork, episodes or replay request."""
        cols = ["id", "session_id", "started", *fields]
        vals = [run_id, session_id, time.time(), *(self._enc(k, v) for k, v in fields.items())]
        self._write(f"INSERT OR REPLACE INTO runs ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})", vals)

    def update_run(self, run_id: str, **fields: Any) -> None:
        """Change columns of a recorded run (its options, once known)."""
        sets = ", ".join(f"{k} = ?" for k in fields)
        self._write(f"UPDATE runs SET {sets} WHERE id = ?", [*(self._enc(k, v) for k, v in fields.items()), run_id])

    def end_run(self, run_id: str, status: str) -> None:
        """Mark a run finished."""
        self._write("UPDATE runs SET ended = ?, status = ? WHERE id = ?", (time.time(), status, run_id))

    def upsert_node(self, session_id: str, node_id: str, **fields: Any) -> None:
        """Insert a node or update the given columns of it (committed at once)."""
        if "output" in fields and isinstance(fields["output"], str):
            fields["output"] = fields["output"][-OUTPUT_LIMIT:]
        fields["seen"] = time.time()  # when a dead kernel's unfinished rows were last seen alive
        # A fork writes ~5 rows per branch, always with the same columns: the statement, and
        # which of its values are JSON, are made once per set of columns (what _enc does, inline).
        keys = tuple(fields)
        made = self._node_sql.get(keys)
        if made is None:
            unknown = set(fields) - set(NODE_COLUMNS) - {"seen"}
            if unknown:
                raise KeyError(f"unknown node columns: {sorted(unknown)}")
            cols = ["session_id", "id", *keys]
            updates = ", ".join(f"{k} = excluded.{k}" for k in keys)
            made = (f"INSERT INTO nodes ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))}) "
                    f"ON CONFLICT (session_id, id) DO UPDATE SET {updates}",
                    tuple(i for i, k in enumerate(keys) if k in JSON_COLUMNS))
            self._node_sql[keys] = made
        sql, json_at = made
        vals = list(fields.values())
        for i in json_at:
            if vals[i] is not None and not isinstance(vals[i], str):
                vals[i] = json.dumps(vals[i], default=repr)
        self._write(sql, [session_id, node_id, *(int(v) if v.__class__ is bool else v for v in vals)])

    def add_cell(self, session_id: str, node_id: str, seq: int, code: str, seed: int | None,
                 pushed: list[str], status: str) -> None:
        """Record one cell run on a node (what replay re-runs)."""
        self._write(
            "INSERT OR REPLACE INTO cells VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (session_id, node_id, seq, code, code_hash(code), seed, json.dumps(pushed), status, time.time()),
        )

    def add_replica(self, session_id: str, parent_id: str, host_node: str, cells: int, fingerprint: str,
                    bytes_shipped: int, seconds: float) -> None:
        """Record a warm parent copied to another cluster node (what it cost)."""
        self._write("INSERT INTO replicas VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (session_id, parent_id, host_node, cells, fingerprint, bytes_shipped, seconds, time.time()))

    def replica_rows(self, session_id: str | None = None) -> list[dict[str, Any]]:
        """Replicas made (by session, oldest first)."""
        if session_id is None:
            return self._rows("SELECT * FROM replicas ORDER BY ts")
        return self._rows("SELECT * FROM replicas WHERE session_id = ? ORDER BY ts", (session_id,))

    def add_checkpoint(self, name: str, session_id: str, node_id: str, path: str, backend: str,
                       size: int, cells: int, warnings: list[str], *, baseline: str | None = None,
                       source: str | None = None, sha256: str | None = None,
                       machine: dict[str, Any] | None = None, mac: str | None = None) -> None:
        """Record a saved checkpoint (``sha256``: its file's; ``source``: a file added from
        elsewhere's path; ``machine``: what it says of the machine that saved it,
        MachineSpec.machine; ``mac``: the row's signature, smolbench.signing)."""
        with self.batch():
            self._write("INSERT OR REPLACE INTO checkpoints (name, session_id, node_id, path, backend, created, size, "
                        "cells, warnings) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (name, session_id, node_id, path, backend, time.time(), size, cells, json.dumps(warnings)))
            self._write("INSERT OR REPLACE INTO checkpoint_more (name, session_id, path, size, baseline, source, sha256, "
                        "machine, mac) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (name, session_id, path, size, baseline, source, sha256,
                         None if machine is None else json.dumps(machine), mac))

    def sign_checkpoint(self, name: str, sha256: str, mac: str) -> None:
        """Give checkpoint ``name``'s row its file's ``sha256`` and a signature (``%smol checkpoint
        trust``); what else its checkpoint_more row says stays, when it is that row's."""
        with self.batch():
            self._write("DELETE FROM checkpoint_more WHERE name = ? AND NOT EXISTS (SELECT 1 FROM checkpoints c "
                        "WHERE c.name = checkpoint_more.name AND c.session_id IS checkpoint_more.session_id "
                        "AND c.path IS checkpoint_more.path AND c.size IS checkpoint_more.size)", (name,))
            self._write("INSERT INTO checkpoint_more (name, session_id, path, size, sha256, mac) SELECT name, session_id, "
                        "path, size, ?, ? FROM checkpoints WHERE name = ? ON CONFLICT (name) DO UPDATE SET "
                        "sha256 = excluded.sha256, mac = excluded.mac", (sha256, mac, name))

    def add_trust(self, session_id: str, scope: str, detail: str) -> None:
        """Record a trusted-mode opt-in (``%smol trust on``, ``--pull-trusted``) or its end."""
        self._write("INSERT INTO trust VALUES (?, ?, ?, ?)", (session_id, time.time(), scope, detail))

    def trust_rows(self) -> list[dict[str, Any]]:
        """Every trusted-mode change, oldest first."""
        return self._rows("SELECT * FROM trust ORDER BY ts")

    def mark_lost(self, current: str) -> int:
        """Mark unfinished rows of sessions whose kernel died (on this host) ``lost``; how many.

        Their machines died with their kernel; ``ended`` becomes the time the row was
        last written (``seen``).
        """
        dead = self.dead_sessions(current)
        count = 0
        marks = ", ".join("?" * len(UNFINISHED))
        with self._lock, self._in_time("mark the rows of dead kernels lost"):
            for sid in dead:
                rows = self._db.execute(
                    f"SELECT id, seen, started FROM nodes WHERE session_id = ? AND status IN ({marks})", (sid, *UNFINISHED)
                ).fetchall()
                for node_id, seen, started in rows:
                    last = seen or started or time.time()
                    self._db.execute(
                        "UPDATE nodes SET status = 'lost', alive = 0, ended = ?, error = ? WHERE session_id = ? AND id = ?",
                        (last, "lost: its kernel stopped before it finished (last seen "
                         + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last)) + ")", sid, node_id))
                count += len(rows)
                self._db.execute("UPDATE nodes SET alive = 0 WHERE session_id = ? AND alive = 1", (sid,))
                self._db.execute("UPDATE runs SET status = 'lost', ended = COALESCE(ended, ?) "
                                 "WHERE session_id = ? AND ended IS NULL", (time.time(), sid))
        return count

    def dead_sessions(self, current: str | None = None) -> list[str]:
        """Sessions (but ``current``) whose kernel, on this host, is gone: their machines went with it."""
        host = socket.gethostname()
        return [r["id"] for r in self._rows("SELECT id, host, pid, pid_start FROM sessions WHERE id IS NOT ?", (current,))
                if r["host"] == host and not _alive(r["pid"], r["pid_start"])]

    def touch_checkpoint(self, name: str) -> None:
        """Record that checkpoint ``name``'s file was added again (``readded``, which a take-back
        of the first adding sees); its ``created`` stays, which an export writes into the file."""
        with self.batch():
            self._write("DELETE FROM checkpoint_more WHERE name = ? AND NOT EXISTS (SELECT 1 FROM checkpoints c "
                        "WHERE c.name = checkpoint_more.name AND c.session_id IS checkpoint_more.session_id "
                        "AND c.path IS checkpoint_more.path AND c.size IS checkpoint_more.size)", (name,))
            self._write("INSERT INTO checkpoint_more (name, session_id, path, size, readded) SELECT name, session_id, "
                        "path, size, ? FROM checkpoints WHERE name = ? ON CONFLICT (name) DO UPDATE SET "
                        "readded = excluded.readded", (time.time(), name))

    def remove_checkpoint(self, name: str) -> None:
        """Forget a checkpoint."""
        with self.batch():
            self._write("DELETE FROM checkpoints WHERE name = ?", (name,))
            self._write("DELETE FROM checkpoint_more WHERE name = ?", (name,))

    # -- reading -------------------------------------------------------------------

    def _read(self, sql: str, params: Iterable[Any],
              pick: Callable[[Any], Any] | None = None) -> tuple[list[str], list[Any]]:
        with self._in_time("read"):
            try:
                cur = self._db.execute(sql, tuple(params))
                names = [d[0] for d in cur.description]
                if pick is None:
                    return names, cur.fetchall()
                return names, [(value,) for value in picked_once(cur, pick)]
            except sqlite3.DatabaseError:
                if not self._changed():
                    raise
                return [], []  # half a write read immutable ("malformed"): read again below

    def _rows(self, sql: str, params: Iterable[Any] = (), checkpoints: bool = False,
              pick: Callable[[Any], Any] | None = None) -> list[dict[str, Any]]:
        """The rows ``sql`` reads, JSON columns decoded (``checkpoints``: a checkpoint query's,
        whose JSON columns are checked, :data:`CHECKPOINT_JSON`: another table's ``machine`` is
        a machine's name, not JSON; ``pick``: only what it gives, not None, for each row's first
        column, each once)."""
        with self._lock:
            names, rows = self._read(sql, params, pick)
            for tries in (2, 1):  # a writer came while an immutable open read: open and read again
                if not self._changed():
                    break
                self.close()
                self._open_to_read(tries)  # the last time mode=ro: SQLite's own locks, no more checks
                names, rows = self._read(sql, params, pick)
        out = []
        for row in rows:
            rec = dict(zip(names, row))
            for key in sorted(JSON_COLUMNS & rec.keys()):
                if isinstance(rec[key], str):
                    rec[key], wrong = _decoded(key, rec[key], checkpoints)
                    if wrong is not None and "damaged" not in rec:
                        rec["damaged"] = f"its ledger row's {key} {wrong}"
            out.append(rec)
        return out

    def node_rows(self, session_id: str | None = None) -> list[dict[str, Any]]:
        """Node records as dicts, oldest first."""
        if session_id is None:
            return self._rows("SELECT * FROM nodes ORDER BY started, rowid")
        return self._rows("SELECT * FROM nodes WHERE session_id = ? ORDER BY started, rowid", (session_id,))

    def node(self, session_id: str, node_id: str) -> dict[str, Any] | None:
        """One node record."""
        rows = self._rows("SELECT * FROM nodes WHERE session_id = ? AND id = ?", (session_id, node_id))
        return rows[0] if rows else None

    def cells(self, session_id: str, node_id: str) -> list[dict[str, Any]]:
        """The cells run on a node, in order."""
        return self._rows("SELECT * FROM cells WHERE session_id = ? AND node_id = ? ORDER BY seq", (session_id, node_id))

    def add_attempt(self, session_id: str, node_id: str, attempt: int, stage: str, outcome: str,
                    error: str | None = None) -> None:
        """Record one attempt at a machine that infrastructure failures made retry (boot/run)."""
        self._write("INSERT OR REPLACE INTO attempts VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (session_id, node_id, attempt, stage, outcome, error, time.time()))

    def attempt_rows(self, session_id: str | None = None) -> list[dict[str, Any]]:
        """Attempts of retried machines, oldest first."""
        if session_id is None:
            return self._rows("SELECT * FROM attempts ORDER BY ts")
        return self._rows("SELECT * FROM attempts WHERE session_id = ? ORDER BY ts", (session_id,))

    def checkpoint_rows(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Saved checkpoints, newest first (``limit``: the newest ``limit``, their text cut as a
        view shows it, :data:`smolbench._shown.TEXT_CHARS`)."""
        if limit is None:
            return self._checkpoints("ORDER BY c.created DESC")
        return self._checkpoints("ORDER BY c.created DESC LIMIT ?", (max(0, limit),), cut=True)

    def checkpoint_rows_of(self, session_id: str) -> list[dict[str, Any]]:
        """This session's saved checkpoints, newest first (a copied ledger's rows not read)."""
        return self._checkpoints("WHERE c.session_id = ? ORDER BY c.created DESC", (session_id,))

    def checkpoint_stamp(self) -> tuple[Any, ...]:
        """What changes when a checkpoint row is added or deleted, read without reading any
        row's text (typeof reads a value's type from the record's header)."""
        rows = self._rows("SELECT count(*) AS n, total(CASE WHEN typeof(created) = 'real' THEN created END) AS t "
                          "FROM checkpoints")
        return (rows[0]["n"], rows[0]["t"]) if rows else ()

    def checkpoint_count(self) -> int:
        """How many checkpoint rows the ledger holds."""
        rows = self._rows("SELECT count(*) AS n FROM checkpoints")
        return int(rows[0]["n"]) if rows else 0

    def checkpoint_paths(self, skip: int, file_of: Callable[[Any], str | None]) -> list[Any]:
        """The files that checkpoint rows after the newest ``skip`` name, each once (``file_of``:
        the file a row's path, cut as a view's are, stands for in the checkpoint folder, if there;
        :func:`smolbench._shelflist.files_there`): the files of a listing's rows it does not show."""
        rows = self._rows(f"SELECT {sql_cut('path', TEXT_CHARS)} AS path FROM checkpoints ORDER BY created DESC "
                          "LIMIT -1 OFFSET ?", (max(0, skip),), pick=file_of)
        return [r["path"] for r in rows]

    def checkpoint(self, name: str) -> dict[str, Any] | None:
        """One checkpoint record."""
        rows = self._checkpoints("WHERE c.name = ?", (name,))
        return rows[0] if rows else None

    def _checkpoints(self, tail: str, params: tuple[Any, ...] = (), cut: bool = False) -> list[dict[str, Any]]:
        for query in (WITH_MAC, WITH_MACHINE):
            try:
                return self._rows(f"{query.replace(_WHOLE, _CUT, 1) if cut else query} {tail}", params,
                                  checkpoints=True)
            except sqlite3.OperationalError as exc:  # an older ledger, read-only: no mac or machine column to add
                if "no such column" not in str(exc):
                    raise
        return self._rows(f"{CHECKPOINTS.replace(_WHOLE, _CUT, 1) if cut else CHECKPOINTS} {tail}", params,
                          checkpoints=True)

    def run_rows(self) -> list[dict[str, Any]]:
        """Runs (forks, episodes, replays), newest first."""
        return self._rows("SELECT * FROM runs ORDER BY started DESC")

    def nodes(self, session_id: str | None = None) -> pd.DataFrame:
        """Every node as a pandas DataFrame (one row per branch, newest last)."""
        return _frame(self.node_rows(session_id))

    def runs(self) -> pd.DataFrame:
        """Every fork / episodes / replay run as a DataFrame."""
        return _frame(self.run_rows())

    def checkpoints(self) -> pd.DataFrame:
        """Every checkpoint as a DataFrame."""
        return _frame(self.checkpoint_rows())

    def session_ids(self) -> list[str]:
        """Every session's id in this ledger."""
        return [str(r["id"]) for r in self._rows("SELECT id FROM sessions")]

    def sessions(self) -> pd.DataFrame:
        """Every recorded session as a DataFrame."""
        return _frame(self._rows("SELECT * FROM sessions ORDER BY started"))


def _decoded(key: str, text: str, checkpoint: bool = False) -> tuple[Any, str | None]:
    """Column ``key``'s JSON ``text`` decoded, and None; or, for a checkpoint row's column holding
    what smolbench never writes there (:data:`CHECKPOINT_JSON`), its stand-in and what is wrong.
    Text that isn't JSON in another column stays as it is."""
    shape = CHECKPOINT_JSON.get(key) if checkpoint else None
    if shape is not None and len(text) > JSON_LIMIT:
        return shape[1], f"is {len(text):,} characters, over {JSON_LIMIT:,}"
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # "[" * 200000: too deep for json's recursion
        return (text, None) if shape is None else (shape[1], "is not JSON")
    if shape is not None and not shape[0](value):
        return shape[1], "is not what smolbench writes there"
    return value, None


_OPEN: weakref.WeakSet[Ledger] = weakref.WeakSet()  # this process's ledgers opened to write
_at_exit_lock = threading.Lock()
_at_exit_registered = False


def _closed_at_exit(ledger: Ledger) -> None:
    """``ledger`` is checkpointed and closed when the interpreter exits (:func:`close_all`)."""
    global _at_exit_registered
    _OPEN.add(ledger)
    with _at_exit_lock:
        if not _at_exit_registered:
            import atexit

            atexit.register(close_all)  # after smolbench's own exit hook (_lifetime), which writes the last rows
            _at_exit_registered = True


def close_all(wait: float = 5.0) -> None:
    """Checkpoint and close every ledger this process opened to write (the kernel's or the
    interpreter's exit, the extension's unload): ``ledger.db`` is then the whole ledger, and its
    ``-wal`` and ``-shm`` go with the last connection. One held by a stuck thread is left as it is."""
    for ledger in list(_OPEN):
        if not ledger._lock.acquire(timeout=wait):
            continue
        try:
            ledger.fold_wal()
            ledger.close()
        except Exception:  # noqa: S110 - at exit: nothing to tell, and the next ledger still closes
            pass
        finally:
            ledger._lock.release()


def _process_start(pid: int) -> str | None:
    """A process's start time (clock ticks since boot), which tells a pid's reuse apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2:].split()[19].decode()


def _alive(pid: int | None, started: str | None) -> bool:
    """Whether the kernel that wrote a session row still runs."""
    if not pid:
        return False
    now = _process_start(int(pid))
    return now is not None and (started is None or now == started)


def _frame(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Rows as a DataFrame; seeds stay whole numbers (pandas' nullable Int64, not 100.0)."""
    import pandas as pd

    rows = list(rows)
    df = pd.DataFrame(rows)
    if "seed" in df:  # from the rows, not the frame's column: a float64 there rounds seeds past 2**53
        df["seed"] = pd.array([r.get("seed") for r in rows], dtype="Int64")
    return df
