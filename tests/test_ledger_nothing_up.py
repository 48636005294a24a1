"""`%smol ledger`, `%smol tree` and `%smol plot` with nothing up read this folder's ledger (the
one `%smol up` would use), read-only: after a kernel restart, what was lost. A folder with no
ledger gets one line and no ledger made; a ledger that links elsewhere or holds SQL of its own
is refused as every ledger is."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import socket
import sqlite3
import tempfile
from pathlib import Path

import pytest
from nbhelpers import NotebookSession, ok, one_line, plain_texts, result_text, stream_text

from smolbench.ledger import Ledger

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
NOTHING_UP = "smolbench: nothing is up:"


def _ledger_files(folder: Path) -> dict[str, bytes]:
    """The ledger and its write-ahead log as bytes (SQLite's -shm is an index readers share)."""
    return {p.name: p.read_bytes() for p in (folder / ".smolbench").iterdir() if not p.name.endswith("-shm")}


@needs_bwrap
def test_after_the_kernel_died_ledger_tree_and_plot_show_what_the_ledger_has(
        open_tmp: Path, request: pytest.FixtureRequest) -> None:
    with NotebookSession(open_tmp, timeout=300, allow_errors=True) as nb:
        ok(nb.run("%load_ext smolbench"))
        ok(nb.run("%smol up --backend sandbox"))
        ok(nb.run("%%smol fork 3 --keep all --seed-base 10 --quiet\nreward = SEED"))
        killed = str(nb.kernel_pid)
        nb.kill()  # kill -9: its machines die with it, its rows still say alive
    # its run folder, left for the next `%smol up` to sweep (none comes here): removed below
    left = [p for p in Path(tempfile.gettempdir()).glob("smolbench-*")
            if (p / "owner").is_file() and (p / "owner").read_text().split()[:1] == [killed]]
    request.addfinalizer(lambda: [shutil.rmtree(p, ignore_errors=True) for p in left])
    before = _ledger_files(open_tmp)
    with NotebookSession(open_tmp, timeout=300, allow_errors=True) as nb:
        ok(nb.run("%load_ext smolbench"))
        ledger = ok(nb.run("%smol ledger"))
        tree = ok(nb.run("%smol tree"))
        plot = ok(nb.run("%smol plot"))
        status = stream_text(ok(nb.run("%smol status")))
    assert _ledger_files(open_tmp) == before  # read, never written
    said = stream_text(ledger)
    assert said.startswith(NOTHING_UP) and "read-only" in said and said.count("\n") == 1, said
    table = str(result_text(ledger))
    for node in ("root", "root.0", "root.1", "root.2"):
        assert node in table, table
    assert "lost" in table and "yes" not in table, table  # its kernel is gone: nothing is alive
    text = stream_text(tree)
    head, rest = text.split("\n", 1)
    assert head.startswith(NOTHING_UP) and "last session" in head and "`%smol up`" in head, head
    assert "root  lost" in rest and "root.2  seed=12  ok  reward=12 *" in rest and "alive" not in rest, rest
    said = stream_text(plot)
    assert said.startswith(NOTHING_UP) and "last session" in said, said
    assert any("reward by depth · 3 of 4 nodes rewarded" in t for t in plain_texts(plot)), plain_texts(plot)
    assert "no machine is up" in status


def test_with_no_ledger_here_each_says_so_and_makes_none(open_tmp: Path) -> None:
    with NotebookSession(open_tmp, timeout=120, allow_errors=True) as nb:
        ok(nb.run("%load_ext smolbench"))
        said = [stream_text(ok(nb.run(f"%smol {cmd}"))) for cmd in ("ledger", "tree", "plot")]
    for line in said:
        assert line == f"{NOTHING_UP} this folder has no ledger yet (.smolbench/ledger.db): `%smol up` starts one\n", line
    assert not (open_tmp / ".smolbench").exists()


def test_a_copied_ledger_that_links_elsewhere_or_holds_sql_is_refused(open_tmp: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    Ledger(outside / "ledger.db").close()
    (open_tmp / ".smolbench").mkdir()
    (open_tmp / ".smolbench" / "ledger.db").symlink_to(outside / "ledger.db")
    with NotebookSession(open_tmp, timeout=120, allow_errors=True) as nb:
        ok(nb.run("%load_ext smolbench"))
        linked = one_line(nb.run("%smol ledger"))
        (open_tmp / ".smolbench" / "ledger.db").unlink()
        Ledger(open_tmp / ".smolbench" / "ledger.db").close()
        with sqlite3.connect(open_tmp / ".smolbench" / "ledger.db") as db:
            db.execute("CREATE VIEW planted AS SELECT 1")
        planted = one_line(nb.run("%smol tree"))
    assert "has a symbolic link at ledger.db" in linked and "a ledger is opened only as a plain file" in linked, linked
    assert "holds SQL of its own (view 'planted')" in planted, planted


def test_the_past_view_reads_without_writing_and_shows_dead_kernels_rows_as_lost(tmp_path: Path) -> None:
    from smolbench.pastledger import open_past, past_nodes, past_tree

    path = tmp_path / "ledger.db"
    assert open_past(path) is None and not path.exists()  # none made
    ledger = Ledger(path)
    ledger.start_session("s1", backend="sandbox", host=socket.gethostname(), pid=0, pid_start=None)  # a kernel gone
    ledger.upsert_node("s1", "root", status="idle", alive=1, started=1.0)
    ledger.upsert_node("s1", "root.0", parent_id="root", seed=3, status="ok", reward=2.5, alive=1, started=2.0)
    ledger.upsert_node("s1", "root.\x1b[31m", parent_id="root", status="ok", alive=0, started=3.0)
    ledger.close()
    past = open_past(path)
    assert past is not None
    try:
        rows = {r["id"]: r for r in past_nodes(past)}
        assert rows["root"]["status"] == "lost" and rows["root"]["alive"] == 0
        assert rows["root.0"]["status"] == "ok" and rows["root.0"]["alive"] == 0
        session, tree = past_tree(past)
        assert session is not None and session["id"] == "s1"
        assert tree["root.0"].reward == 2.5 and not tree["root.0"].alive
        assert "\x1b" not in tree.render() and "root.\\x1b[31m" in tree.render()  # a ledger's strings are its author's
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            past._db.execute("DELETE FROM nodes")
    finally:
        past.close()


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_the_past_view_of_a_wal_ledger_leaves_the_folders_files_as_they_were(tmp_path: Path) -> None:
    """A WAL ledger opened `mode=ro` got a ledger.db-shm and ledger.db-wal it left behind: the
    view said nothing is written, and the folder had two files more."""
    import subprocess
    import sys

    from smolbench.pastledger import open_past, past_tree

    path = tmp_path / "ledger.db"
    ledger = Ledger(path)
    ledger.start_session("s1", backend="sandbox", host=socket.gethostname(), pid=0, pid_start=None)
    ledger.upsert_node("s1", "root", status="idle", alive=1, started=1.0)
    ledger.close()
    before = _names(tmp_path)
    assert before == ["ledger.db"], before

    def viewed() -> None:
        past = open_past(path)
        assert past is not None
        try:
            session, tree = past_tree(past)
            assert session is not None and "root" in tree
        finally:
            past.close()

    viewed()
    assert _names(tmp_path) == before  # no -wal: opened immutable, nothing made
    writer = Ledger(path)  # a live writer elsewhere: its -wal and -shm are its own
    try:
        writer.upsert_node("s1", "root.0", parent_id="root", status="ok", alive=1, started=2.0)
        live = _names(tmp_path)
        assert live == ["ledger.db", "ledger.db-shm", "ledger.db-wal"], live
        viewed()
        assert _names(tmp_path) == live
        writer.upsert_node("s1", "root.1", parent_id="root", status="ok", alive=1, started=3.0)  # still its to write
    finally:
        writer.close()
    # a copied folder: a dead writer's -wal, no -shm; the view reads it with the -shm SQLite needs,
    # left there (removed at close, it was taken from a writer that came meanwhile), nothing else
    subprocess.run([sys.executable, "-c", "import os, sys\nfrom smolbench.ledger import Ledger\n"
                    "l = Ledger(sys.argv[1])\nl.upsert_node('s1', 'root.2', parent_id='root', status='ok', alive=1, "
                    "started=4.0)\nos._exit(0)", str(path)], check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    (tmp_path / "ledger.db-shm").unlink()
    copied = _names(tmp_path)
    assert copied == ["ledger.db", "ledger.db-wal"], copied
    viewed()
    assert _names(tmp_path) == sorted([*copied, "ledger.db-shm"])


def test_a_writer_that_comes_while_a_copied_folder_s_ledger_is_viewed_keeps_its_shm(tmp_path: Path) -> None:
    """A view of a -wal with no -shm (a copied folder) opened `mode=ro` beside it, which made a
    -shm, and removed it at close: a kernel that came meanwhile had taken it as its own, and
    lost it under its open connection (two writers' -shm apart: SQLite's locking broken).
    (Reading a private copy instead cost the host a sparse -wal's claimed size in /tmp.)"""
    import subprocess
    import sys

    path = tmp_path / "ledger.db"
    ledger = Ledger(path)
    ledger.start_session("s1", backend="sandbox", host=socket.gethostname(), pid=0, pid_start=None)
    ledger.close()
    subprocess.run([sys.executable, "-c", "import os, sys\nfrom smolbench.ledger import Ledger\n"
                    "l = Ledger(sys.argv[1])\nl.upsert_node('s1', 'root', status='ok', alive=1, started=1.0)\n"
                    "os._exit(0)", str(path)], check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    (tmp_path / "ledger.db-shm").unlink()
    view = Ledger.read_only(path)
    assert view is not None
    assert [r["id"] for r in view._rows("SELECT id FROM nodes")] == ["root"]  # the dead writer's log is read
    writer = Ledger(path)  # a kernel's %smol up in that folder, while the view is open
    try:
        writer.upsert_node("s1", "root.0", parent_id="root", status="ok", alive=1, started=2.0)
        shm = (tmp_path / "ledger.db-shm").stat()
        view.close()
        assert (tmp_path / "ledger.db-shm").exists() and (tmp_path / "ledger.db-shm").stat().st_ino == shm.st_ino
        writer.upsert_node("s1", "root.1", parent_id="root", status="ok", alive=1, started=3.0)
        other = Ledger(path)  # another connection sees every row the writer committed
        try:
            assert sorted(r["id"] for r in other._rows("SELECT id FROM nodes")) == ["root", "root.0", "root.1"]
        finally:
            other.close()
    finally:
        writer.close()


def test_a_copied_folder_s_sparse_wal_costs_the_view_nothing(tmp_path: Path) -> None:
    """A -wal of 2 GiB of holes (84 KB on disk, in a folder handed over): a view that copied
    the ledger's files to read them wrote its claimed size into the host's /tmp (12 s, 2 GiB)."""
    path = tmp_path / "ledger.db"
    ledger = Ledger(path)
    ledger.start_session("s1", backend="sandbox", host=socket.gethostname(), pid=0, pid_start=None)
    ledger.upsert_node("s1", "root", status="ok", alive=1, started=1.0)
    ledger.close()
    with open(tmp_path / "ledger.db-wal", "wb") as f:
        f.truncate(2 << 30)
    # what this process may write to any file meanwhile: far below what the -wal claims
    old_limit, old_handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, old_limit[1]))
    try:
        view = Ledger.read_only(path)  # (a copy past the limit fails: EFBIG)
        assert view is not None
        try:
            assert [r["id"] for r in view._rows("SELECT id FROM nodes")] == ["root"]  # not a log SQLite can read
        finally:
            view.close()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert (tmp_path / "ledger.db-wal").stat().st_blocks == 0  # left as it came


def test_a_copied_ledger_s_texts_are_shown_escaped_in_the_ledger_table() -> None:
    """Seventh audit: `%smol ledger` showed a copied ledger's ids and statuses raw, so an OSC 52
    escape in a node id wrote the clipboard of the terminal a script printed the table on.
    Every text of the table is one escaped line now; numbers stay numbers."""
    import pandas as pd

    from smolbench.magics import ledger_table

    evil = "root\x1b]52;c;ZXZpbA==\x07\u202e.0"
    df = pd.DataFrame([{"session_id": "s\x1b[2J", "id": evil, "parent_id": None, "seed": 3, "status": "ok\r\nlost",
                        "reward": 1.5, "started": 1.0, "ended": 2.0, "alive": 0}])
    shown = ledger_table(df)
    text = shown.to_string()
    assert "\x1b" not in text and "\u202e" not in text and "\r" not in text, repr(text)
    assert shown["id"][0] == "root\\x1b]52;c;ZXZpbA==\\x07\\u202e.0" and shown["status"][0] == "ok\\r\\nlost"
    assert shown["reward"][0] == 1.5 and shown["seed"][0] == 3 and shown["alive"][0] == "no"
