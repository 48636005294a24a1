"""A ledger from someone else runs none of its own SQL (round 4's own audit).

A ledger in a copied folder (or a cloned repository) is its author's SQLite file, and SQLite
runs what its schema holds: a trigger on the writes that fire it, a view's query on every
read. A trigger rewrote the code this kernel recorded for a cell (``%smol replay`` then ran
the author's code, on the host with the process backend), and a view of an endless recursive
query held the Jupyter server's threads and its CPU for good. Such a ledger is refused in one
line, by the kernel and by the server, and the server's reads of any ledger are cut off in
time; each attack is shown against the weakened setup too.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sqlite3
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pandas as pd
import pytest

from smolbench import ledger as ledger_module
from smolbench.errors import SmolbenchError
from smolbench.ledger import Ledger, UnsafeLedger
from smolbench.server import ledgerview

SWAP = ("CREATE TRIGGER swap AFTER INSERT ON cells BEGIN "
        "UPDATE cells SET code = 'open(\"/tmp/owned\", \"w\")' WHERE rowid = NEW.rowid; END")
ENDLESS = ("WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) "
           "SELECT 'x' AS name, '' AS session_id, '' AS node_id, '' AS path, '' AS backend, 0 AS created, "
           "0 AS size, 0 AS cells, '' AS warnings FROM r")


def old_checkpoints(extra: str = "") -> str:
    """The checkpoints table as releases before checkpoint_more made it (``extra``: its columns after warnings)."""
    return ("CREATE TABLE checkpoints (name TEXT PRIMARY KEY, session_id TEXT, node_id TEXT, path TEXT, backend TEXT, "
            f"created REAL, size INTEGER, cells INTEGER, warnings TEXT{extra})")


def made(folder: Path, *sql: str, ours: bool = True) -> Path:
    """A ledger as smolbench makes it (``ours``; else an empty file), then changed by its author
    (or an older release) with ``sql``."""
    path = folder / ".smolbench" / "ledger.db"
    if ours:
        Ledger(path).close()
    else:
        path.parent.mkdir(parents=True)
    conn = sqlite3.connect(path)
    with conn:
        for statement in sql:
            conn.execute(statement)
    conn.close()
    return path


def test_a_trigger_in_a_copied_ledger_is_refused_before_the_kernel_writes(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path = made(tmp_path, SWAP)
    with pytest.raises(UnsafeLedger) as refused:
        Ledger(path)
    line = str(refused.value)
    assert "holds SQL of its own (trigger 'swap')" in line and "move it aside" in line and "\n" not in line
    # weakened: with the check gone, the author's trigger rewrites what this kernel recorded
    monkeypatch.setattr(ledger_module, "guard", lambda conn, where: None)
    led = Ledger(path)
    try:
        led.add_cell("s1", "root", 1, "x = 1", None, [], "ok")
        assert led.cells("s1", "root")[0]["code"] == 'open("/tmp/owned", "w")'
    finally:
        led.close()


@pytest.mark.parametrize("sql", [
    SWAP,
    "CREATE VIEW extra AS SELECT 1",
    "CREATE TABLE notes (x TEXT CHECK (length(x) < 10))",
    "CREATE TABLE later (x TEXT, y TEXT AS (upper(x)))",
    "CREATE INDEX ours ON nodes (length(output))",
])
def test_any_sql_of_its_own_is_refused(tmp_path: Path, sql: str) -> None:
    with pytest.raises(UnsafeLedger, match="holds SQL of its own"):
        Ledger(made(tmp_path, sql))


def test_a_ledger_smolbench_made_or_grew_is_still_opened(tmp_path: Path) -> None:
    path = made(tmp_path, "ALTER TABLE nodes ADD COLUMN later_column TEXT")  # as a later release adds columns
    led = Ledger(path)
    led.add_cell("s1", "root", 1, "x = 1", None, [], "ok")
    assert led.cells("s1", "root")[0]["code"] == "x = 1"
    led.close()


def test_a_view_in_a_ledger_never_holds_the_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sidebar lists every folder's checkpoints with no click: a view named like a table
    ran its endless query in the server's threads."""
    path = made(tmp_path, "DROP TABLE checkpoints", f"CREATE VIEW checkpoints AS {ENDLESS}")
    with pytest.raises(ledgerview.LedgerUnreadable, match=r"holds SQL of its own \(view 'checkpoints'\)"):
        ledgerview.checkpoints(path)
    # weakened: with the schema check gone, the read is still cut off in time
    monkeypatch.setattr(ledgerview, "guard", lambda conn, where: None)
    monkeypatch.setattr(ledgerview, "READ_SECONDS", 1.0)
    with pytest.raises(ledgerview.LedgerUnreadable, match="took more than 1 s to read"):
        ledgerview.checkpoints(path)


def test_the_server_s_delete_fires_no_trigger(tmp_path: Path) -> None:
    from tornado import web

    from smolbench.server.handlers import _delete_checkpoint

    path = made(tmp_path, "INSERT INTO checkpoints (name, path) VALUES ('c', 'c.smolcheckpoint')",
                "CREATE TRIGGER wipe AFTER DELETE ON checkpoints BEGIN DELETE FROM nodes; END")
    with pytest.raises(web.HTTPError) as refused:
        _delete_checkpoint(path, "c", str(tmp_path))
    assert refused.value.status_code == 422 and "holds SQL of its own (trigger 'wipe')" in str(refused.value)


def test_an_older_ledger_gains_the_checkpoint_columns_and_keeps_its_rows(tmp_path: Path) -> None:
    """A checkpoint row now records its baseline, and a file from elsewhere its source and
    SHA-256: kept beside an older ledger's rows when it is opened, its rows kept as they were."""
    path = made(tmp_path, old_checkpoints(), "INSERT INTO checkpoints VALUES ('old', 's0', 'root', "
                "'checkpoints/old.smolcheckpoint', 'sandbox', 1.0, 10, 2, '[]')", ours=False)
    with contextlib.closing(Ledger(path)) as led:
        old = led.checkpoint("old")
        assert old is not None and (old["node_id"], old["cells"], old["warnings"]) == ("root", 2, [])
        assert (old["baseline"], old["source"], old["sha256"]) == (None, None, None)
        led.add_checkpoint("new", "imported", "root.3", "checkpoints/new.smolcheckpoint", "sandbox", 10, 7, [],
                           baseline="host@1", source="/srv/class/new.smolcheckpoint", sha256="ab" * 32)
        new = led.checkpoint("new")
        assert new is not None and (new["baseline"], new["source"], new["sha256"]) == (
            "host@1", "/srv/class/new.smolcheckpoint", "ab" * 32)


OLD = "3b7fef0"  # a release before the checkpoint rows' baseline, source and SHA-256


def older_ledger(tmp_path: Path, release: str = OLD) -> ModuleType:
    """smolbench's ledger module as ``release`` had it (from git), imported by path."""
    repo = Path(__file__).resolve().parents[1]
    shown = subprocess.run(["git", "-C", str(repo), "show", f"{release}:smolbench/ledger.py"], capture_output=True)
    if shown.returncode:
        pytest.skip(f"no git history here to take release {release}'s ledger from")
    path = tmp_path / f"ledger_{release}.py"
    path.write_bytes(shown.stdout)
    spec = importlib.util.spec_from_file_location(f"smolbench._ledger_{release}", path)  # its `from .errors`
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_older_release_saves_checkpoints_into_a_ledger_this_one_made(tmp_path: Path) -> None:
    """A copied folder opened by an older install: its save wrote a checkpoint row's nine values
    by position, and a ledger this version made had twelve columns ("table checkpoints has 12
    columns but 9 values were supplied"). The three live in their own table; what the older
    code writes never takes a claim that isn't its row's."""
    path = tmp_path / ".smolbench" / "ledger.db"
    led = Ledger(path)
    led.add_checkpoint("gift", "imported", "root.3", "checkpoints/gift.smolcheckpoint", "sandbox", 10, 7, [],
                       baseline="f" * 64, source="/srv/class/gift.smolcheckpoint", sha256="ab" * 32)
    led.close()
    old = older_ledger(tmp_path).Ledger(path)
    try:
        old.add_checkpoint("mine", "s0", "root", "checkpoints/mine.smolcheckpoint", "sandbox", 10, 2, [])
        old.touch_checkpoint("gift")  # the same file added again
        assert sorted(r["name"] for r in old.checkpoint_rows()) == ["gift", "mine"]
    finally:
        old.close()
    led = Ledger(path)
    try:
        mine, gift = led.checkpoint("mine"), led.checkpoint("gift")
        assert mine is not None and (mine["cells"], mine["baseline"], mine["source"], mine["sha256"]) == (2, None, None, None)
        assert gift is not None and (gift["baseline"], gift["sha256"]) == ("f" * 64, "ab" * 32)
    finally:
        led.close()
    old = older_ledger(tmp_path).Ledger(path)
    try:  # the older install saves its own "gift" over the file's (--force)
        old.add_checkpoint("gift", "s0", "root", "checkpoints/gift.smolcheckpoint", "sandbox", 12, 3, [])
        old.remove_checkpoint("mine")
    finally:
        old.close()
    led = Ledger(path)
    try:
        gift = led.checkpoint("gift")
        assert gift is not None and (gift["session_id"], gift["baseline"], gift["source"], gift["sha256"]) == (
            "s0", None, None, None)
        assert [r["name"] for r in led.checkpoint_rows()] == ["gift"]
    finally:
        led.close()


def test_a_ledger_with_the_claims_in_its_checkpoints_table_is_opened_as_older_releases_write_it(
        tmp_path: Path) -> None:
    """A ledger this version had given the three columns keeps what they say, and an older install
    saves into it again."""
    path = made(tmp_path, old_checkpoints(", baseline TEXT, source TEXT, sha256 TEXT"),
                "INSERT INTO checkpoints VALUES ('gift', 'imported', 'root.3', 'checkpoints/gift.smolcheckpoint', "
                "'sandbox', 1.0, 10, 7, '[]', 'host@1', '/srv/class/gift.smolcheckpoint', 'abab')", ours=False)
    with contextlib.closing(Ledger(path)) as led:
        gift = led.checkpoint("gift")
        assert gift is not None and (gift["cells"], gift["baseline"], gift["source"], gift["sha256"]) == (
            7, "host@1", "/srv/class/gift.smolcheckpoint", "abab")
    old = older_ledger(tmp_path).Ledger(path)
    try:
        old.add_checkpoint("mine", "s0", "root", "checkpoints/mine.smolcheckpoint", "sandbox", 10, 2, [])
    finally:
        old.close()
    led = Ledger(path)
    try:
        assert sorted(r["name"] for r in led.checkpoint_rows()) == ["gift", "mine"]
        assert (led.checkpoint("gift") or {})["sha256"] == "abab"
    finally:
        led.close()


WITH_COLUMNS = "18306ed"  # the release that kept a checkpoint's claims as columns of its row


def claims(led: Ledger, name: str) -> tuple[Any, ...]:
    row = led.checkpoint(name) or {}
    return row.get("baseline"), row.get("source"), row.get("sha256")


def test_a_release_that_adds_the_columns_back_empty_leaves_the_claims_as_they_were(tmp_path: Path) -> None:
    """That release opens a folder this one saved into and adds its three columns back, empty:
    the move on the next open copied those NULLs over the claims, and a file's claimed baseline
    (its restore's warning) was gone."""
    path = tmp_path / ".smolbench" / "ledger.db"
    led = Ledger(path)
    led.add_checkpoint("gift", "imported", "", "checkpoints/gift.smolcheckpoint", "sandbox", 10, 7, [],
                       baseline="B-file", source="/srv/class/gift.smolcheckpoint", sha256="ab" * 32)
    led.close()
    between = older_ledger(tmp_path, WITH_COLUMNS).Ledger(path)
    between.add_checkpoint("theirs", "s1", "root", "checkpoints/theirs.smolcheckpoint", "sandbox", 5, 1, [],
                           baseline="B-here")
    between.close()
    for _ in range(2):
        led = Ledger(path)
        try:
            assert claims(led, "gift") == ("B-file", "/srv/class/gift.smolcheckpoint", "ab" * 32)
            assert claims(led, "theirs") == ("B-here", None, None)  # what that release wrote, moved
        finally:
            led.close()


def test_a_column_that_cant_be_dropped_is_moved_once_and_never_again(tmp_path: Path) -> None:
    """A copied ledger whose checkpoints.baseline is UNIQUE (SQLite won't drop it; nor does one
    older than 3.35 drop any): the column stayed, and each open copied it over the claim this
    kernel recorded since, so a file's claimed baseline vanished at the next kernel's start."""
    path = made(tmp_path, old_checkpoints(", baseline TEXT UNIQUE, source TEXT, sha256 TEXT"), ours=False)
    Ledger(path).close()
    led = Ledger(path)
    led.add_checkpoint("lesson", "imported", "", "checkpoints/lesson.smolcheckpoint", "sandbox", 10, 7, [],
                       baseline="B-other", source="/srv/lesson.smolcheckpoint", sha256="cd" * 32)
    led.close()
    led = Ledger(path)
    try:
        assert claims(led, "lesson") == ("B-other", "/srv/lesson.smolcheckpoint", "cd" * 32)
    finally:
        led.close()


def test_a_copied_ledger_with_an_unkeyed_claims_table_is_refused(tmp_path: Path) -> None:
    """Made ahead without its key, the table kept a planted row beside the one this kernel wrote:
    a file's source and SHA-256 as this machine recorded them read as the author's."""
    path = made(tmp_path, "CREATE TABLE checkpoint_more (name TEXT, session_id TEXT, path TEXT, size INTEGER, "
                "baseline TEXT, source TEXT, sha256 TEXT, readded REAL)",
                "INSERT INTO checkpoint_more VALUES ('lesson1', 'imported', 'checkpoints/lesson1.smolcheckpoint',"
                " 10, NULL, '/home/staff/official/lesson1.smolcheckpoint', '55555555', NULL)", ours=False)
    with pytest.raises(SmolbenchError) as refused:
        Ledger(path)
    assert "checkpoint_more table keyed otherwise" in str(refused.value) and "\n" not in str(refused.value)


def test_a_ledger_another_program_keeps_locked_is_not_called_foreign(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel holding the ledger's lock past the wait (while it moves old columns, say) made
    the next one say "not a smolbench ledger: move it aside": advice to set the user's record aside."""
    path = made(tmp_path, old_checkpoints(", baseline TEXT, source TEXT, sha256 TEXT"), ours=False)
    monkeypatch.setattr(ledger_module, "BUSY_TIMEOUT", 0.1)
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as other:
        other.execute("BEGIN EXCLUSIVE")
        with pytest.raises(SmolbenchError) as refused:
            Ledger(path)
        other.execute("COMMIT")
    said = str(refused.value)
    assert "stayed locked by another program for 0.1 s" in said and "move it aside" not in said and "\n" not in said


def test_up_in_a_folder_whose_ledger_holds_sql_says_so_in_its_own_line(open_tmp: Path) -> None:
    """The magic re-raised each of our errors as ``type(exc)(str(exc))``: an error whose
    constructor takes more than a message (this one: where and what) became a TypeError about
    its arguments, and the user never read why the ledger was refused."""
    from nbhelpers import NotebookSession, ok

    made(open_tmp, "CREATE VIEW planted AS SELECT 1")
    with NotebookSession(open_tmp, timeout=120, allow_errors=True) as nb:
        ok(nb.run("%load_ext smolbench"))
        cell = nb.run("%smol up --backend process")
    errors = [o for o in cell["outputs"] if o["output_type"] == "error"]
    assert errors and errors[0]["ename"] == "UnsafeLedger", errors
    assert "holds SQL of its own (view 'planted')" in errors[0]["evalue"], errors


def test_a_reworded_error_says_its_new_text_in_both_interfaces_words() -> None:
    """The restore rewords the machine-side error to name the user's file, not the descriptor
    it read; the copy kept the old text as its magics' wording, which `%smol` shows."""
    from smolbench.errors import SmolbenchError, reworded

    old = SmolbenchError("checkpoint /proc/self/fd/7 is corrupt", api="checkpoint /proc/self/fd/7 (Session)")
    new = reworded(old, "checkpoint lesson1.smolcheckpoint is corrupt")
    assert type(new) is SmolbenchError and str(new) == new.for_magics() == "checkpoint lesson1.smolcheckpoint is corrupt"
    assert str(new.in_session_words()) == "checkpoint lesson1.smolcheckpoint is corrupt"
    ledger = reworded(UnsafeLedger("x.db", "holds SQL"), "ledger elsewhere holds SQL")
    assert isinstance(ledger, UnsafeLedger) and ledger.what == "holds SQL" and ledger.for_magics() == "ledger elsewhere holds SQL"


def test_nodes_keep_every_seed_a_fork_may_have(tmp_path: Path) -> None:
    """Seeds run from 0 to 2**63 - 1: nodes() built the seed column through floats, so a seed
    past 2**53 came back one less and 2**63 - 1 raised OverflowError for the whole folder."""
    ledger = Ledger(tmp_path / "ledger.db")
    try:
        ledger.start_session("s1")
        for i, seed in enumerate([None, 7, 2**53 + 1, 2**63 - 1]):
            ledger.upsert_node("s1", f"root.{i}", seed=seed, status="ok")
        got = ledger.nodes().set_index("id")["seed"]
        assert [None if v is pd.NA else int(v) for v in got[[f"root.{i}" for i in range(4)]]] == [None, 7, 2**53 + 1,
                                                                                                 2**63 - 1]
    finally:
        ledger.close()


def test_upsert_node_refuses_unknown_columns_every_time_and_encodes_as_before(tmp_path: Path) -> None:
    """upsert_node makes its statement once per set of columns: an unknown column is refused
    each time (never cached), JSON columns and bools are written as they were."""
    from smolbench.ledger import Ledger

    led = Ledger(tmp_path / "l.db")
    try:
        for _ in range(2):
            with pytest.raises(KeyError, match="nope"):
                led.upsert_node("s", "root", status="ok", nope=1)
        for alive in (True, False):
            led.upsert_node("s", "root", status="ok", alive=alive, metrics={"a": 1}, versions=None, output="x" * 10)
            row = led._db.execute("SELECT alive, typeof(alive), metrics, versions, output FROM nodes").fetchone()
            assert row == (int(alive), "integer", '{"a": 1}', None, "x" * 10)
    finally:
        led.close()


# -- a table's own SQL, however it is written (eighth audit) ---------------------------------

# ltrim of a string against a set of as many characters compares each with each, in one step of
# SQLite's machine, which no progress handler cuts off: at a million characters (a 12 KB ledger)
# one read of the row held a server thread for 40 minutes. Here a few thousand: fast either way.
LTRIM = ("ltrim(replace(hex(zeroblob(2000 + length(name) * 0)), '0', 'a'), "
         "replace(hex(zeroblob(2000)), '0', 'b') || 'a')")
GENERATED_PATH = ("CREATE TABLE checkpoints (name TEXT PRIMARY KEY, session_id TEXT, node_id TEXT, backend TEXT, "
                  f"created REAL, size INTEGER, cells INTEGER, warnings TEXT, path TEXT GENERATED ALWAYS AS /**/ ({LTRIM}))")


@pytest.mark.parametrize("sql", [
    "CREATE TABLE notes (id TEXT, c TEXT CHECK --x\n(length(id) > 0))",
    "CREATE TABLE notes (id TEXT DEFAULT/**/(hex(randomblob(8))))",
    "CREATE TABLE notes (id TEXT, c GENERATED ALWAYS AS /**/ (upper(id)) STORED)",
    "CREATE TABLE notes (id TEXT, c AS/*(*/(upper(id)))",
    "CREATE TABLE notes (id TEXT, CONSTRAINT c CHECK\t/**/(id <> ''))",
])
def test_sql_behind_a_comment_in_a_table_is_refused(tmp_path: Path, sql: str) -> None:
    """The check looked for ``CHECK (``, ``DEFAULT (`` and ``AS (`` in the statement's text, which
    keeps its comments: one between the word and its expression hid it."""
    with pytest.raises(UnsafeLedger, match=r"holds SQL of its own \(table 'notes'\)"):
        Ledger(made(tmp_path, sql))


def test_a_generated_checkpoint_path_never_runs_in_the_server_nor_the_kernel(tmp_path: Path) -> None:
    """The audit's ledger: ``checkpoints.path`` generated by an expression behind ``/**/``, read by
    the sidebar's poll of every folder's checkpoints, with no click; and by its delete, which had
    no time limit at all."""
    from tornado import web

    from smolbench.server.handlers import _delete_checkpoint

    path = made(tmp_path, "DROP TABLE checkpoints", GENERATED_PATH,
                "INSERT INTO checkpoints (name, created) VALUES ('c', 1)")
    with pytest.raises(ledgerview.LedgerUnreadable, match=r"holds SQL of its own \(table 'checkpoints'\)"):
        ledgerview.checkpoints(path)
    with pytest.raises(ledgerview.LedgerUnreadable, match=r"holds SQL of its own \(table 'checkpoints'\)"):
        ledgerview.unlisted_paths(path, 0, lambda p: None)
    with pytest.raises(web.HTTPError) as refused:
        _delete_checkpoint(path, "c", str(tmp_path))
    assert refused.value.status_code == 422 and "holds SQL of its own (table 'checkpoints')" in str(refused.value)
    with pytest.raises(SmolbenchError, match=r"holds SQL of its own \(table 'checkpoints'\)"):
        Ledger.read_only(path)
    with pytest.raises(UnsafeLedger, match=r"holds SQL of its own \(table 'checkpoints'\)"):
        Ledger(path)


CHECKPOINT_COLUMNS = "name TEXT PRIMARY KEY, session_id TEXT, node_id TEXT, backend TEXT, created REAL, size INTEGER"


@pytest.mark.parametrize(("sql", "said"), [
    (f"CREATE TABLE checkpoints ({CHECKPOINT_COLUMNS}, path BLOB)", "checkpoints table whose column 'path' is BLOB"),
    (f"CREATE TABLE checkpoints ({CHECKPOINT_COLUMNS}, path TEXT UNIQUE)", "UNIQUE column smolbench doesn't make (path)"),
    (f"CREATE TABLE checkpoints ({CHECKPOINT_COLUMNS}, path TEXT COLLATE NOCASE)", "holds SQL of its own"),
    (f"CREATE TABLE checkpoints ({CHECKPOINT_COLUMNS}, \"path\" TEXT)", "holds SQL of its own"),
    (f"CREATE TABLE checkpoints ({CHECKPOINT_COLUMNS}, path TEXT) WITHOUT ROWID", "holds SQL of its own"),
    ("CREATE TABLE checkpoints (name TEXT, path TEXT)", "checkpoints table keyed otherwise than smolbench makes it "
                                                       "(by name)"),
    (f"CREATE TABLE checkpoints ({CHECKPOINT_COLUMNS.replace('name TEXT', 'name TEXT NOT NULL')}, path TEXT)",
     "holds SQL of its own"),
])
def test_only_tables_as_smolbench_makes_them_are_read(tmp_path: Path, sql: str, said: str) -> None:
    """A table is read as SQLite reads it (``PRAGMA table_xinfo``) and only when it is as smolbench
    makes it: its columns' types and key, nothing but PRIMARY KEY on them."""
    path = made(tmp_path, "DROP TABLE checkpoints", sql)
    with pytest.raises(UnsafeLedger) as refused:
        Ledger(path)
    assert said in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ledgerview.LedgerUnreadable, match="move it aside"):
        ledgerview.checkpoints(path)


def test_a_ledger_of_many_tables_is_refused_after_a_few(tmp_path: Path) -> None:
    """Its schema is read to check it: what is read of it is bounded (200 tables and indexes;
    smolbench makes 18)."""
    path = made(tmp_path, *(f"CREATE TABLE t{i} (x TEXT)" for i in range(200)))
    with pytest.raises(UnsafeLedger, match="has more than 200 tables and indexes"):
        Ledger(path)


# each release whose ledger differs from the one before (its tables, columns or indexes)
RELEASES = ("8bc3488", "77b236c", "b54020f", "9ae71d1", "fc5f43c", "7eeb62c", "e88ecbd", "f2690f8", "2bf45f3",
            "2da97c1", "5584a31", "697d05b", "e0de1ad", "36cc3b9", "60087ad", OLD, WITH_COLUMNS, "9c40bc1",
            "bb066f4", "16472bb", "26ca937")


def test_every_release_s_ledger_passes_the_check_and_is_read(tmp_path: Path) -> None:
    """A ledger each release made (one checkpoint saved) is opened by this one, the kernel's and the
    server's way, before and after this kernel adds its columns. (Two releases' index of a run's
    rewards, ``(run_id, reward)``, was refused as SQL of its own since the check came.)"""
    for release in RELEASES:
        path = tmp_path / release / ".smolbench" / "ledger.db"
        old = older_ledger(tmp_path, release).Ledger(path)
        old.add_checkpoint("c", "s0", "root", "checkpoints/c.smolcheckpoint", "sandbox", 10, 2, [])
        old.close()
        for _ in range(2):
            view = Ledger.read_only(path)
            assert view is not None
            with contextlib.closing(view):
                assert view.checkpoint_count() == 1 and view.node_rows() == [], release
            assert [r["name"] for r in ledgerview.checkpoints(path)[0]] == ["c"], release
            assert ledgerview.runs(path)["runs"] == [], release
            with contextlib.closing(Ledger(path)) as led:
                assert (led.checkpoint("c") or {}).get("cells") == 2, release


def test_the_server_s_delete_is_cut_off_in_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sidebar's delete read and wrote a ledger with no time limit; it is cut off as its reads
    are. Shown with the schema check weakened, a view's long query standing in for what it refuses."""
    from tornado import web

    from smolbench.server import handlers

    long = ENDLESS.replace("FROM r) SELECT 'x'", "FROM r WHERE i < 1000000) SELECT 'c' || i")
    path = made(tmp_path, "DROP TABLE checkpoints", f"CREATE VIEW checkpoints AS {long}")
    monkeypatch.setattr(ledgerview, "guard", lambda conn, where: None)
    monkeypatch.setattr(handlers, "guard", lambda conn, where: None, raising=False)  # (where it was)
    monkeypatch.setattr(ledgerview, "READ_SECONDS", 1e-9)  # past at SQLite's first look at the time
    with pytest.raises(web.HTTPError) as refused:
        handlers._delete_checkpoint(path, "c", str(tmp_path))
    assert refused.value.status_code == 422 and "took more than" in str(refused.value), refused.value
