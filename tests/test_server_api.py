"""The jupyter_server extension's REST API (smolbench.server), through pytest-jupyter's
real server (``jp_fetch``): every endpoint, auth, a corrupt ledger, paths outside the root,
live machines of a real kernel, and orphans of a dead one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from ledgerhelpers import rows_left_out
from pytest_jupyter.jupyter_server import *  # noqa: F403  (fixtures, scoped to this module)
from tornado.httpclient import HTTPClientError

from smolbench import registry
from smolbench.ledger import Ledger
from smolbench.server import ledgerview

API = ("smolbench", "api")


@pytest.fixture(autouse=True)
def _current_loop(jp_asyncio_loop: Any) -> Any:
    """pytest-jupyter caches its loop; a test elsewhere that ran asyncio.run() leaves no
    current loop behind, and tornado's client looks for the current one."""
    asyncio.set_event_loop(jp_asyncio_loop)
    return jp_asyncio_loop


@pytest.fixture
def jp_server_config() -> dict[str, Any]:
    return {"ServerApp": {"jpserver_extensions": {"smolbench.server": True}}}


@pytest.fixture
def call(jp_fetch: Any, jp_asyncio_loop: Any) -> Any:
    """``call("machines", method=..., params=...)`` -> (status, JSON body); errors too."""

    def go(*parts: str, method: str = "GET", params: dict[str, Any] | None = None, **kw: Any) -> tuple[int, Any]:
        try:
            resp = jp_asyncio_loop.run_until_complete(
                jp_fetch(*API, *parts, method=method, params=params, allow_nonstandard_methods=True, **kw))
        except HTTPClientError as exc:
            assert exc.response is not None
            return exc.code, json.loads(exc.response.body or b"{}")
        return resp.code, json.loads(resp.body or b"{}")

    return go


def _ledger(folder: Path, runs: int = 3, per_run: int = 5) -> Ledger:
    led = Ledger(folder / ".smolbench" / "ledger.db")
    led.start_session("s1", backend="sandbox", isolation="test", baseline="host@x", host="h", cwd=str(folder))
    led.upsert_node("s1", "root", status="idle", started=1.0, alive=True)
    for r in range(runs):
        rid = f"s1/run{r + 1}"
        parent = "root" if r == 0 else "root.0"
        led.start_run(rid, "s1", kind="fork", parent_id=parent, code=f"reward = SEED * {r + 1}", n=per_run)
        for i in range(per_run):
            nid = f"{parent}.{i + (per_run if r == 2 else 0)}"
            led.upsert_node("s1", nid, run_id=rid, parent_id=parent, seed=i, status="ok", reward=float(i * (r + 1)),
                            started=10.0 * (r + 1) + i, ended=10.0 * (r + 1) + i + 1, alive=False,
                            output="<img src=x onerror=alert(1)>")
        led.end_run(rid, "done")
    return led


# -- ledger ------------------------------------------------------------------------------


def test_ledger_runs_sessions_nodes_paginated(call: Any, jp_root_dir: Path) -> None:
    _ledger(jp_root_dir / "proj").close()
    code, body = call("ledger", "runs", params={"path": "proj", "limit": 2})
    assert code == 200, body
    assert body["total"] == 3 and [r["id"] for r in body["runs"]] == ["s1/run3", "s1/run2"]  # newest first
    top = body["runs"][0]
    assert top["n"] == 5 and top["best_reward"] == 12.0 and top["spark"] == [0.0, 3.0, 6.0, 9.0, 12.0]
    assert top["code"] == "reward = SEED * 3"
    code, body = call("ledger", "runs", params={"path": "proj", "limit": 2, "offset": 2})
    assert [r["id"] for r in body["runs"]] == ["s1/run1"]

    code, body = call("ledger", "sessions", params={"path": "proj"})
    assert code == 200 and body["total"] == 1 and body["sessions"][0]["backend"] == "sandbox"

    # run1 forked root; run2 and run3 forked root.0 (a branch of run1): its tree holds all
    code, body = call("ledger", "nodes", params={"path": "proj", "run": "s1/run1", "limit": 100})
    assert code == 200, body
    assert body["total"] == 1 + 5 + 10 and body["run"]["parent_id"] == "root"
    assert {n["id"] for n in body["nodes"]} >= {"root", "root.0", "root.0.0", "root.0.9"}
    code, body = call("ledger", "nodes", params={"path": "proj", "run": "s1/run2", "limit": 3})
    assert body["total"] == 6 and len(body["nodes"]) == 3  # root.0 and run2's five
    # machine output comes back as data (the panel shows it as text)
    assert body["nodes"][1]["output"] == "<img src=x onerror=alert(1)>"
    code, body = call("ledger", "nodes", params={"path": "proj", "session": "s1", "limit": 500})
    assert body["total"] == 16
    code, body = call("ledger", "nodes", params={"path": "proj", "run": "nope"})
    assert code == 404 and "no run 'nope'" in body["message"]
    code, body = call("ledger", "runs", params={"path": "proj", "limit": "ten"})
    assert code == 400 and "limit='ten' is not a whole number" in body["message"]


def test_runs_and_nodes_say_whether_replay_can_rebuild_them(call: Any, jp_root_dir: Path) -> None:
    """A smolbench.gym run's episodes can't be replayed (their actions are not recorded):
    the API says so per run and per node, in the words `%smol replay` uses, so the sidebar
    disables those Replay buttons; a fork's stay enabled."""
    led = _ledger(jp_root_dir / "proj", runs=1, per_run=2)
    # as smolbench/gym/warmparent.py and record.py write them: the warm parent, two episodes
    led.start_run("s1/gym-root.2", "s1", kind="gym", parent_id="root", code="smolbench.gym: corridor", n=2)
    led.upsert_node("s1", "root.2", run_id="s1/gym-root.2", parent_id="root", status="idle", started=50.0)
    for i in range(2):
        led.upsert_node("s1", f"root.2.{i}", run_id="s1/gym-root.2", parent_id="root.2", seed=i, status="ok",
                        reward=float(i), started=51.0, ended=52.0, metrics={"sub_env": i, "reset": "fresh"})
    led.end_run("s1/gym-root.2", "done")
    led.close()
    code, body = call("ledger", "runs", params={"path": "proj"})
    assert code == 200, body
    runs = {r["id"]: r for r in body["runs"]}
    gym, fork = runs["s1/gym-root.2"], runs["s1/run1"]
    assert (gym["best_node"], gym["replayable"], gym["replay_refused"]) == (
        "root.2.1", False,
        "can't replay: its best branch is an episode of a smolbench.gym env, whose actions are not recorded")
    assert (fork["best_node"], fork["replayable"], fork["replay_refused"]) == ("root.1", True, None)
    code, body = call("ledger", "nodes", params={"path": "proj", "session": "s1"})
    refused = {n["id"]: n["replay_refused"] for n in body["nodes"]}
    assert refused["root.2.0"] == refused["root.2.1"] == (
        "can't replay: it is an episode of a smolbench.gym env, whose actions are not recorded")
    assert refused["root.2"] is None and refused["root.1"] is None and refused["root"] is None


def test_missing_and_corrupt_ledger_are_one_line(call: Any, jp_root_dir: Path) -> None:
    code, body = call("ledger", "runs", params={"path": ""})
    assert code == 200 and body["runs"] == [] and "no ledger in the root folder yet" in body["note"]
    bad = jp_root_dir / "broken" / ".smolbench"
    bad.mkdir(parents=True)
    (bad / "ledger.db").write_bytes(b"this is not sqlite at all" * 100)
    for what in ("runs", "sessions", "nodes"):
        code, body = call("ledger", what, params={"path": "broken", "run": "x"})
        assert code == 422, body
        assert body["message"] == ("broken/.smolbench/ledger.db is not a readable smolbench ledger "
                                   "(file is not a database): move it aside; `%smol up` starts a new one")
        assert str(jp_root_dir) not in body["message"]  # no host paths in messages
    code, body = call("checkpoints")
    assert code == 200 and body["problems"] == ["broken: the ledger is not a readable smolbench ledger (file is not a database)"]


def test_the_server_never_writes_a_ledger_it_reads(call: Any, jp_root_dir: Path) -> None:
    _ledger(jp_root_dir).close()
    db = jp_root_dir / ".smolbench" / "ledger.db"
    os.chmod(db, 0o444)
    before = db.read_bytes()
    for what in ("runs", "sessions"):
        assert call("ledger", what)[0] == 200
    assert call("ledger", "nodes", params={"session": "s1"})[0] == 200
    assert db.read_bytes() == before


def test_runs_name_their_notebook_and_cell_and_filter_by_notebook(call: Any, jp_root_dir: Path) -> None:
    """A kernel records its notebook as an absolute path (JPY_SESSION_NAME); the API gives
    it back relative to the root, filters by it, and counts the runs of each notebook."""
    led = _ledger(jp_root_dir / "proj", runs=0)
    for i, (nb, cell) in enumerate([("proj/a.ipynb", 4), ("proj/b.ipynb", 2), ("proj/a.ipynb", 7)]):
        led.start_run(f"s1/r{i}", "s1", kind="fork", code="reward = SEED", n=2,
                      notebook=str(jp_root_dir / nb), cell=cell)
    led.start_run("s1/old", "s1", kind="episodes", code="reward = 1", n=3)  # before notebooks were recorded
    led.close()
    code, body = call("ledger", "runs", params={"path": "proj", "notebook": "proj/a.ipynb"})
    assert code == 200, body
    assert [(r["notebook"], r["cell"]) for r in body["runs"]] == [("proj/a.ipynb", 7), ("proj/a.ipynb", 4)]
    assert body["total"] == 2
    assert sorted(body["notebooks"], key=lambda n: n["notebook"] or "") == [
        {"notebook": None, "runs": 1}, {"notebook": "proj/a.ipynb", "runs": 2}, {"notebook": "proj/b.ipynb", "runs": 1}]
    code, body = call("ledger", "runs", params={"path": "proj", "notebook": ""})
    assert [r["id"] for r in body["runs"]] == ["s1/old"] and body["runs"][0]["notebook"] is None
    assert call("ledger", "runs", params={"path": "proj"})[1]["total"] == 4


def test_an_old_ledger_without_notebook_columns_is_read_and_migrated(call: Any, jp_root_dir: Path) -> None:
    import sqlite3

    db = jp_root_dir / ".smolbench" / "ledger.db"
    db.parent.mkdir()
    conn = sqlite3.connect(db)
    conn.executescript("CREATE TABLE runs (id TEXT PRIMARY KEY, session_id TEXT, kind TEXT, parent_id TEXT, code TEXT, "
                       "code_hash TEXT, n INTEGER, options TEXT, started REAL, ended REAL, status TEXT);"
                       "CREATE TABLE nodes (session_id TEXT, id TEXT, run_id TEXT, reward REAL, PRIMARY KEY (session_id, id));"
                       "INSERT INTO runs (id, kind, code, n, started) VALUES ('r1', 'fork', 'reward = SEED', 2, 1.0);")
    conn.close()
    code, body = call("ledger", "runs", params={"notebook": "a.ipynb"})
    assert code == 200 and body["runs"] == [], body  # read-only: no column, so no run of a.ipynb
    code, body = call("ledger", "runs")
    assert body["runs"][0]["notebook"] is None and body["notebooks"] == [{"notebook": None, "runs": 1}]
    Ledger(db).close()  # a kernel opening it adds the columns
    conn = sqlite3.connect(db)
    assert {"notebook", "cell"} <= {r[1] for r in conn.execute("PRAGMA table_info(runs)")}
    conn.close()


# -- paths -------------------------------------------------------------------------------


def test_paths_outside_the_root_are_refused(call: Any, jp_root_dir: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    _ledger(outside).close()
    (jp_root_dir / "link").symlink_to(outside)
    for path in ("..", "../elsewhere", "/../elsewhere", "link", "a/../../elsewhere", "link/.."):
        code, body = call("ledger", "runs", params={"path": path})
        assert code == 403, (path, body)
        assert "outside the server's root directory" in body["message"]
    assert call("checkpoints", params={"path": "link"})[0] == 403
    # a ledger.db inside the root that is a symlink to one outside; and (round 4's audit) one to
    # another project's ledger inside the root, which was listed, and deleted in, as this folder's
    (jp_root_dir / "sneaky" / ".smolbench").mkdir(parents=True)
    (jp_root_dir / "sneaky" / ".smolbench" / "ledger.db").symlink_to(outside / ".smolbench" / "ledger.db")
    _ledger(jp_root_dir / "other").close()
    (jp_root_dir / "copycat").mkdir()
    (jp_root_dir / "copycat" / ".smolbench").symlink_to(jp_root_dir / "other" / ".smolbench")
    for where in ("sneaky", "copycat"):
        code, body = call("ledger", "runs", params={"path": where})
        assert code == 403 and "has a symbolic link at " in body["message"], body
        assert "a ledger is read only as a plain file" in body["message"]
    assert sorted(call("checkpoints")[1]["problems"]) == [
        f"{where}: the ledger has a symbolic link at {part}: a ledger is read only as a plain file in a plain folder "
        "(as a kernel does)" for where, part in (("copycat", ".smolbench"), ("sneaky", "ledger.db"))]
    assert call("checkpoints", "warm", method="DELETE", params={"path": "../elsewhere"})[0] == 403


# -- checkpoints -------------------------------------------------------------------------


def test_checkpoints_listed_under_the_root_and_deleted(call: Any, jp_root_dir: Path, tmp_path: Path) -> None:
    led = _ledger(jp_root_dir / "a" / "b")
    cdir = jp_root_dir / "a" / "b" / ".smolbench" / "checkpoints"
    cdir.mkdir()
    (cdir / "warm.smolcheckpoint").write_bytes(b"x" * 1234)
    led.add_checkpoint("warm", "s1", "root.0", str(cdir / "warm.smolcheckpoint"), "sandbox", 1234, 2, [])
    # a ledger row pointing outside the root: listed without the outside path, never deleted
    victim = tmp_path / "precious.smolcheckpoint"
    victim.write_text("keep me")
    led.add_checkpoint("evil", "s1", "root", str(victim), "sandbox", 7, 1, [])
    led.close()

    code, body = call("checkpoints")
    assert code == 200, body
    by_name = {c["name"]: c for c in body["checkpoints"]}
    assert by_name["warm"]["dir"] == "a/b" and by_name["warm"]["node_id"] == "root.0"
    assert by_name["warm"]["size"] == 1234 and by_name["warm"]["exists"] is True
    assert by_name["warm"]["path"] == "a/b/.smolbench/checkpoints/warm.smolcheckpoint"
    assert by_name["evil"]["path"] == "precious.smolcheckpoint"  # no host path leaks out
    assert by_name["evil"]["exists"] is False and str(tmp_path) not in json.dumps(body)
    assert by_name["warm"]["folder"] == "a/b" and by_name["warm"]["dropped"] is False
    assert call("checkpoints", params={"path": "a/b"})[1]["checkpoints"][0]["dir"] == "a/b"
    assert call("checkpoints", params={"path": "a"})[1]["checkpoints"] == []

    code, body = call("checkpoints", "warm", method="DELETE", params={"path": "a/b"})
    assert code == 200 and body["message"] == "deleted checkpoint warm and its file"
    assert not (cdir / "warm.smolcheckpoint").exists()
    with contextlib.closing(sqlite3.connect(jp_root_dir / "a" / "b" / ".smolbench" / "ledger.db")) as db:
        assert db.execute("SELECT count(*) FROM checkpoint_more WHERE name = 'warm'").fetchone() == (0,)
    code, body = call("checkpoints", "evil", method="DELETE", params={"path": "a/b"})
    assert code == 200 and body["message"] == (
        "deleted checkpoint evil; its row named a path that is not a file NAME.smolcheckpoint in this "
        "folder's checkpoint folder, so that path was left alone")
    assert victim.read_text() == "keep me"
    code, body = call("checkpoints", "warm", method="DELETE", params={"path": "a/b"})
    assert code == 404 and "no checkpoint named 'warm'" in body["message"]


def test_a_checkpoint_file_the_sidebar_cannot_list_is_a_problem_naming_the_fix(call: Any, jp_root_dir: Path) -> None:
    """A second download saved as `warm (1).smolcheckpoint` was left out of the sidebar without a word."""
    _ledger(jp_root_dir / "a").close()
    cdir = jp_root_dir / "a" / ".smolbench" / "checkpoints"
    cdir.mkdir()
    (cdir / "warm (1).smolcheckpoint").write_bytes(b"x" * 10)
    code, body = call("checkpoints")
    assert code == 200 and body["checkpoints"] == []
    assert body["problems"] == ["a: 'warm (1).smolcheckpoint' in .smolbench/checkpoints/ is not listed: its name is not a "
                                "checkpoint name (letters, digits, '.', '_' or '-', up to 64, first a letter or digit): "
                                "rename it to warm_1.smolcheckpoint"]


# -- auth --------------------------------------------------------------------------------


def test_a_copied_folders_huge_ledger_is_listed_within_bounds(call: Any, jp_root_dir: Path) -> None:
    """Seventh audit: a copied folder's ledger with 50,000 checkpoint rows made every sidebar
    poll (each 5 s) read them all, open a file per row and send 43 MB of JSON to every tab.
    A listing now holds at most MAX_LIMIT rows over all ledgers, each text cut short and each
    number checked, and says how many it left out."""
    led = _ledger(jp_root_dir / "copied")
    led.close()
    db = jp_root_dir / "copied" / ".smolbench" / "ledger.db"
    conn = sqlite3.connect(str(db))
    cols = [r[1] for r in conn.execute("PRAGMA table_info(checkpoints)")]
    rows = [{"name": f"c{i}", "session_id": "s1", "node_id": "root", "path": f"c{i}.smolcheckpoint",
             "backend": "sandbox", "created": float(i), "size": 1, "cells": 1} for i in range(ledgerview.MAX_LIMIT + 99)]
    rows.append({"name": "n" * 1_000_000, "session_id": "s1", "node_id": "root", "path": "p" * 1_000_000,
                 "backend": "sandbox", "created": "yesterday", "size": "big", "cells": 1})
    for r in rows:
        names = [c for c in r if c in cols]
        conn.execute(f"INSERT INTO checkpoints ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
                     [r[c] for c in names])
    conn.commit()
    conn.close()
    store = db.parent / "checkpoints"
    store.mkdir(exist_ok=True)
    for i in range(5):  # the files of rows past the listing's are theirs, not files dropped in
        (store / f"c{i}.smolcheckpoint").write_bytes(b"x")
    code, body = call("checkpoints")
    assert code == 200, body
    listed = body["checkpoints"]
    assert len(listed) == ledgerview.MAX_LIMIT
    assert not [c for c in listed if c.get("dropped")], [c["name"] for c in listed if c.get("dropped")]
    assert len(json.dumps(body)) < 2_000_000
    assert all(len(str(c["name"])) <= ledgerview.TEXT_CHARS for c in listed)
    assert any("100 more checkpoints not listed" in p for p in body["problems"]), body["problems"]
    assert listed[0]["name"] == f"c{ledgerview.MAX_LIMIT + 98}"  # the newest first



def _counted_scandir(monkeypatch: pytest.MonkeyPatch, keep: Any) -> tuple[list[Any], list[str]]:
    """os.scandir, counted: the folders it was called on, and the entries it yielded that ``keep`` takes."""
    calls: list[Any] = []
    entries: list[str] = []
    real = os.scandir

    class Counted:
        def __init__(self, it: Any) -> None:
            self.it = it

        def __enter__(self) -> Any:
            return self

        def __exit__(self, *exc: Any) -> None:
            self.it.close()

        def __iter__(self) -> Any:
            return self

        def __next__(self) -> Any:
            e = next(self.it)
            if keep(e.name):
                entries.append(e.name)
            return e

        def close(self) -> None:
            self.it.close()

    def scandir(*args: Any) -> Counted:
        calls.append(args[0] if args else ".")
        return Counted(real(*args))

    monkeypatch.setattr(os, "scandir", scandir)
    return calls, entries


def test_files_dropped_into_a_checkpoint_folder_are_listed_within_the_listings_room(
        call: Any, jp_root_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Audit (dropped files): 100,000 empty files dropped into a copied folder's checkpoint
    folder were each listed, on every poll: 37.8 MB of JSON, 7.6-11.6 s, +300 MB, its sort and
    encoding on the server's loop (every request waited up to 1.78 s). A listing takes dropped
    files up to its room, looks at a bounded number of the folder's entries, says in one line
    what it left out, and does all of it off the server's loop."""
    import threading

    from tornado import escape

    from smolbench.gate.ckptpaths import Store
    from smolbench.server import handlers

    cdir = jp_root_dir / "copied" / ".smolbench" / "checkpoints"
    cdir.mkdir(parents=True)
    for i in range(3000):
        os.close(os.open(cdir / f"c{i}.smolcheckpoint", os.O_CREAT | os.O_WRONLY, 0o644))
    monkeypatch.setattr(handlers, "DROPPED_SCAN", 100, raising=False)  # entries looked at past the room
    _, looked = _counted_scandir(monkeypatch, lambda name: name.startswith("c") and name.endswith(".smolcheckpoint"))
    opened: list[Any] = []
    real_open = Store.open
    monkeypatch.setattr(Store, "open", lambda self, named: (opened.append(named), real_open(self, named))[1])
    on_loop: list[bool] = []  # for each listing encoded: whether on the server's loop (this thread)
    real_encode = escape.json_encode

    def encode(value: Any) -> str:
        if isinstance(value, dict) and "checkpoints" in value:
            on_loop.append(threading.current_thread() is threading.main_thread())
        return real_encode(value)

    monkeypatch.setattr(escape, "json_encode", encode)
    room = ledgerview.MAX_LIMIT
    for params in ({"path": "copied"}, None):
        looked.clear(), opened.clear(), on_loop.clear()
        code, body = call("checkpoints", params=params)
        assert code == 200, body
        assert len(body["checkpoints"]) == room and all(c["dropped"] for c in body["checkpoints"])
        assert len(opened) == room  # each listed file opened once, no other
        # its scan for dropped files and for misnamed ones, each one entry past to tell the folder has more
        assert len(looked) <= 2 * (room + 100 + 1), len(looked)
        assert body["problems"] == [
            f"copied: {room - 20} dropped checkpoint files not read (a listing reads 20 at most)",
            "copied: at least 100 more checkpoint files dropped into .smolbench/checkpoints/ are not listed (a listing "
            f"shows {room} checkpoints at most and looks at {room + 100} entries of a checkpoint folder): "
            "`%smol checkpoint restore NAME` there still finds one by name"], body["problems"]
        assert on_loop == [False]


def test_the_walk_for_ledgers_stops_at_its_bounds_and_says_so(call: Any, jp_root_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Audit (max_dirs): find_ledgers' max_dirs only stopped it descending: a copied folder's
    60,000 folders were all walked (60,002 folders, 2.2 s) by the sidebar's listing. The walk
    stops once it has looked into max_dirs folders or at MAX_ENTRIES entries (one huge folder's
    files too), and the listing says it stopped short."""
    from smolbench.server import paths

    for i in range(300):
        (jp_root_dir / "copied" / f"d{i:03}").mkdir(parents=True)
    (jp_root_dir / "copied" / "d299" / ".smolbench" / "checkpoints").mkdir(parents=True)
    flat = jp_root_dir / "flat"
    flat.mkdir()
    for i in range(3000):
        os.close(os.open(flat / f"f{i}.txt", os.O_CREAT | os.O_WRONLY, 0o644))
    calls, entries = _counted_scandir(monkeypatch, lambda name: True)
    result = paths.find_ledgers(jp_root_dir / "copied", max_dirs=50)
    assert len(calls) <= 50, len(calls)
    found, cut = result
    assert found == [] and cut is not None and "(50 folders" in cut, cut
    monkeypatch.setattr(paths, "MAX_ENTRIES", 1000, raising=False)
    calls.clear(), entries.clear()
    assert paths.find_ledgers(flat)[1] is not None
    assert len(entries) <= 1000 + 1, len(entries)  # one past, to tell there are more
    assert paths.find_ledgers(jp_root_dir / "copied" / "d000") == ([], None)  # within its bounds: not cut
    code, body = call("checkpoints")
    assert code == 200 and any("more than a listing looks through for ledgers" in p for p in body["problems"]), body


def test_the_rows_a_listing_leaves_out_cost_the_server_what_the_folder_s_files_do(call: Any, jp_root_dir: Path) -> None:
    """Eighth audit: the sidebar's poll read the path of every row its listing leaves out, at once,
    to tell their files from files dropped in (an 8.9 MB ledger: +497 MB per poll); it reads them
    one at a time and keeps a name per file in the folder."""
    rows_left_out(jp_root_dir / "copied")
    tracemalloc.start()
    try:
        code, body = call("checkpoints")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert code == 200, body
    # the listing's room is the newest rows': the one dropped file is counted, c0..c4 are rows' files
    assert not [c for c in body["checkpoints"] if c.get("dropped")]
    assert any(": 1 more checkpoint file dropped into" in p for p in body["problems"]), body["problems"]
    assert any("2505 more checkpoints not listed" in p for p in body["problems"]), body["problems"]
    assert peak < 4_000_000, peak  # the 2,500 paths left out: 5 MB

ENDPOINTS = [("GET", "machines"), ("DELETE", "machines/k1/root"), ("GET", "checkpoints"),
             ("DELETE", "checkpoints/warm"), ("GET", "ledger/runs"), ("GET", "ledger/sessions"),
             ("GET", "ledger/nodes")]


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
def test_every_endpoint_needs_auth(method: str, path: str, http_server_client: Any, jp_base_url: str,
                                   jp_serverapp: Any, jp_asyncio_loop: Any, jp_root_dir: Path) -> None:
    _ledger(jp_root_dir).close()
    url = f"{jp_base_url}smolbench/api/{path}"
    with pytest.raises(HTTPClientError) as err:
        jp_asyncio_loop.run_until_complete(http_server_client.fetch(url, method=method, allow_nonstandard_methods=True))
    assert err.value.code == 403
    # a wrong token is no better than none
    with pytest.raises(HTTPClientError) as err:
        jp_asyncio_loop.run_until_complete(http_server_client.fetch(
            url, method=method, headers={"Authorization": "token wrong"}, allow_nonstandard_methods=True))
    assert err.value.code == 403
    assert (jp_root_dir / ".smolbench" / "ledger.db").exists()


def test_a_cookie_session_needs_the_xsrf_token_to_delete(call: Any, jp_fetch: Any, jp_asyncio_loop: Any,
                                                          jp_root_dir: Path, jp_serverapp: Any) -> None:
    """A browser request (cookie auth, no token) must carry _xsrf: a page on another site
    can't make the user's browser delete things."""
    _ledger(jp_root_dir).close()
    resp = jp_asyncio_loop.run_until_complete(jp_fetch("api", "contents"))
    login = "; ".join(c.split(";")[0] for c in resp.headers.get_list("Set-Cookie"))
    assert login.startswith("username-")
    browser = {"Authorization": "", "Cookie": login}
    resp = jp_asyncio_loop.run_until_complete(jp_fetch(*API, "ledger", "runs", headers=dict(browser)))
    assert resp.code == 200  # the cookie alone is a valid login for reading
    with pytest.raises(HTTPClientError) as err:
        jp_asyncio_loop.run_until_complete(jp_fetch(*API, "checkpoints", "warm", method="DELETE", headers=dict(browser)))
    assert err.value.code == 403 and b"_xsrf" in (err.value.response.body if err.value.response else b"")
    # with the token JupyterLab sends (cookie + header), the request gets through to the handler
    with_xsrf = {"Authorization": "", "Cookie": f"{login}; _xsrf=feedface", "X-XSRFToken": "feedface"}
    with pytest.raises(HTTPClientError) as err:
        jp_asyncio_loop.run_until_complete(jp_fetch(*API, "checkpoints", "warm", method="DELETE", headers=with_xsrf))
    assert err.value.code == 404  # no such checkpoint: the handler ran


# -- machines ----------------------------------------------------------------------------


def _dead_pid() -> tuple[int, int | None]:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    start = registry.proc_start(proc.pid)
    proc.wait()
    return proc.pid, start


def test_orphans_of_a_dead_kernel_are_shown_and_killed(call: Any, jp_serverapp: Any, tmp_path: Path) -> None:
    folder = Path(jp_serverapp.kernel_manager.connection_dir) / registry.DIRNAME
    kpid, kstart = _dead_pid()
    machine = subprocess.Popen(["sleep", "300"], start_new_session=True,  # stands in for a sandbox of that kernel
                               env={**os.environ, "SMOLBENCH_MACHINE": "root", "SMOLBENCH_KERNEL": f"{kpid}.{kstart}"})
    child = subprocess.Popen(["sleep", "301"], start_new_session=False)
    try:
        mstart = registry.proc_start(machine.pid)
        rec = {"format": 1, "kernel_id": "deadbeef-0000", "pid": kpid, "pid_start": kstart, "cwd": "/x",
               "backend": "process", "session": "s9", "active": "root", "updated": time.time(),
               "machines": [
                   {"id": "root", "parent": None, "backend": "process", "created": time.time() - 5,
                    "memory_mib": 1024, "cpus": 1, "pid": machine.pid, "pid_start": mstart},
                   {"id": "root.0", "parent": "root", "backend": "process", "created": time.time(),
                    "memory_mib": 1024, "cpus": 1, "pid": machine.pid, "pid_start": mstart},
                   # a machine whose process is already gone is not shown
                   {"id": "ghost", "backend": "process", "pid": kpid, "pid_start": kstart}]}
        # a microVM (no host process to check): listed as unverified, not killable
        registry.write_atomic(folder / "kernel-vm.json", {**rec, "kernel_id": "vm", "backend": "smol", "machines": [
            {"id": "root", "backend": "smol", "created": time.time(), "memory_mib": 2048, "pid": None,
             # a cluster machine's node, as data: capped, strings only, markup passed as text
             "node": "f" * 200, "node_host": "<img src=x onerror=alert(1)>", "node_backend": 5, "node_lost": "yes"}]})
        registry.write_atomic(folder / "kernel-deadbeef-0000.json", rec)
        # a live kernel that is not this server's is none of its business
        registry.write_atomic(folder / "kernel-other.json", {**rec, "kernel_id": "other", "pid": os.getpid(),
                                                              "pid_start": registry.proc_start(os.getpid())})
        (folder / "kernel-garbage.json").write_text("{not json")

        code, body = call("machines")
        assert code == 200, body
        assert [g["kernel_id"] for g in body["kernels"]] == ["deadbeef-0000", "vm"]
        vm = body["kernels"][1]["machines"][0]
        assert vm["orphaned"] and vm["unverified"] and not vm["killable"]
        assert (vm["node"], vm["node_host"], vm["node_backend"], vm["node_lost"]) == (
            "f" * 128, "<img src=x onerror=alert(1)>", None, False)
        code, reply = call("machines", "vm", "root", method="DELETE")
        assert code == 409 and reply["message"] == "root's backend published no host process, so it can't be killed from here"
        (folder / "kernel-vm.json").unlink()
        body["kernels"] = body["kernels"][:1]
        body["orphaned"] -= 1
        group = body["kernels"][0]
        assert group["orphaned"] and not group["kernel_alive"]
        assert [m["id"] for m in group["machines"]] == ["root", "root.0"]
        assert all(m["orphaned"] and m["killable"] for m in group["machines"])
        assert all(m["node"] is None and m["node_host"] is None and not m["node_lost"] for m in group["machines"])
        assert group["machines"][0]["uptime_s"] >= 5 and group["machines"][0]["memory_mib"] == 1024
        assert body["machines"] == 0 and body["orphaned"] == 2

        code, body = call("machines", "deadbeef-0000", "root.0", method="DELETE")
        assert code == 200 and body["action"] == "killed", body
        assert "killed orphaned root, root.0" in body["message"] and "is dead" in body["message"]
        assert machine.wait(10) == -signal.SIGKILL
        assert child.poll() is None  # only the machine's process group, nothing else
        assert call("machines")[1]["kernels"] == []
        assert not (folder / "kernel-deadbeef-0000.json").exists()
        code, body = call("machines", "deadbeef-0000", "root", method="DELETE")
        assert code == 404 and "has no machine 'root'" in body["message"]
    finally:
        for p in (machine, child):
            p.kill()
            p.wait()


def test_a_reused_pid_is_never_killed(call: Any, jp_serverapp: Any) -> None:
    """A record's pid that now names another process (start time differs) is left alone."""
    folder = Path(jp_serverapp.kernel_manager.connection_dir) / registry.DIRNAME
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        kpid, kstart = _dead_pid()
        rec = {"format": 1, "kernel_id": "k2", "pid": kpid, "pid_start": kstart, "machines": [
            {"id": "root", "backend": "process", "pid": bystander.pid,
             "pid_start": (registry.proc_start(bystander.pid) or 0) - 1}]}
        registry.write_atomic(folder / "kernel-k2.json", rec)
        assert call("machines")[1]["kernels"] == []  # not alive as far as the record goes
        registry.write_atomic(folder / "kernel-k2.json", rec)
        code, body = call("machines", "k2", "root", method="DELETE")
        assert code == 200 and body["message"] == "root was already gone"
        time.sleep(0.2)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def _execute(km: Any, loop: Any, code: str) -> str:
    client = km.client()
    client.start_channels()
    out: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if msg["header"]["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        if msg["header"]["msg_type"] == "error":
            out.append("\n".join(msg["content"]["traceback"]))

    try:
        reply = loop.run_until_complete(client.execute_interactive(code, timeout=120, output_hook=hook))
    finally:
        client.stop_channels()
    assert reply["content"]["status"] == "ok", "".join(out)
    return "".join(out)


def _wait_for_machines(call: Any, want: list[str], timeout: float = 5) -> Any:
    """The machines listing once it shows ``want`` (kernels rewrite their record at most
    every 0.2 s), or the last one seen."""
    deadline = time.monotonic() + timeout
    while True:
        code, body = call("machines")
        assert code == 200, body
        ids = sorted(m["id"] for g in body["kernels"] for m in g["machines"])
        if ids == want or time.monotonic() > deadline:
            assert ids == want, body
            return body
        time.sleep(0.05)


def test_live_machines_of_a_real_kernel_and_delete_through_it(call: Any, jp_serverapp: Any,
                                                              jp_asyncio_loop: Any, jp_root_dir: Path) -> None:
    mkm = jp_serverapp.kernel_manager
    kid = jp_asyncio_loop.run_until_complete(mkm.start_kernel(kernel_name="python3", path=""))
    try:
        km = mkm.get_kernel(kid)
        _execute(km, jp_asyncio_loop, "%load_ext smolbench\n%smol up --backend sandbox")
        _execute(km, jp_asyncio_loop, "%%smol fork 3 --keep all --quiet\nreward = SEED")
        body = _wait_for_machines(call, ["root", "root.0", "root.1", "root.2"])
        group = body["kernels"][0]
        assert group["kernel_id"] == kid and group["kernel_alive"] and not group["orphaned"]
        assert group["backend"] == "sandbox" and body["backends"] == ["sandbox"] and body["machines"] == 4
        assert Path(group["cwd"]).resolve() == jp_root_dir.resolve()
        root = next(m for m in group["machines"] if m["id"] == "root")
        assert root["active"] and root["memory_mib"] == 1024 and root["uptime_s"] >= 0
        # measured: the agent's PSS (readable here), a few MiB of a Python process, well under the limit
        assert root["memory_measure"] in ("PSS", "RSS") and 1 < root["memory_used_mib"] < 1024, root

        code, body = call("machines", kid, "root.1", method="DELETE")
        assert code == 200, body
        assert body["action"] == "asked-kernel" and body["message"].endswith("smolbench: deleted root.1")
        _wait_for_machines(call, ["root", "root.0", "root.2"])
        code, body = call("machines", kid, "root.1", method="DELETE")
        assert code == 404

        # a busy kernel: the server doesn't hang; the delete runs when the cell ends
        busy = km.client()
        busy.start_channels()
        busy.execute("import time; time.sleep(4)")
        deadline = time.monotonic() + 10
        while km.execution_state != "busy" and time.monotonic() < deadline:
            jp_asyncio_loop.run_until_complete(asyncio.sleep(0.05))
        t0 = time.monotonic()
        code, body = call("machines", kid, "root.2", method="DELETE")
        assert code == 202 and body["queued"] and "it is busy" in body["message"], body
        assert time.monotonic() - t0 < 10
        _wait_for_machines(call, ["root", "root.0"], timeout=20)
        busy.stop_channels()

        _execute(km, jp_asyncio_loop, "%smol down")
        assert call("machines")[1] == {"kernels": [], "machines": 0, "orphaned": 0, "backends": [], "dead": [],
                                     "skipped": []}
    finally:
        jp_asyncio_loop.run_until_complete(mkm.shutdown_kernel(kid))


def test_a_restarted_kernel_keeps_its_dead_predecessors_record(tmp_path: Path) -> None:
    """A kernel restarted by Jupyter keeps its id; the first record of the new process must
    not overwrite the old one, whose machines may still be alive (they'd vanish from view)."""
    kpid, kstart = _dead_pid()
    path = tmp_path / "kernel-k1.json"
    registry.write_atomic(path, {"format": 1, "kernel_id": "k1", "pid": kpid, "pid_start": kstart, "machines": []})
    registry._set_aside(path)
    assert not path.exists() and (tmp_path / f"kernel-k1~{kpid}.json").exists()
    assert [r["pid"] for _, r in registry.read_records(tmp_path)] == [kpid]
    # our own record (a second %smol up in the same kernel) is simply replaced later
    registry.write_atomic(path, {"format": 1, "kernel_id": "k1", "pid": os.getpid(), "machines": []})
    registry._set_aside(path)
    assert path.exists()


def test_the_path_probe_catches_a_weakened_check(call: Any, jp_root_dir: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The attack above, against a deliberately weakened server (paths joined without the
    containment check): it now reads a ledger outside the root, so the probe is real."""
    import smolbench.server.handlers as handlers

    _ledger(tmp_path / "elsewhere").close()
    assert call("ledger", "runs", params={"path": "../elsewhere"})[0] == 403
    monkeypatch.setattr(handlers._Base, "ledger", lambda self: (
        Path(self.root) / self.get_query_argument("path", "") / ".smolbench" / "ledger.db", ""))
    code, body = call("ledger", "runs", params={"path": "../elsewhere"})
    assert code == 200 and body["total"] == 3  # leaked: exactly what the real check refuses


def test_a_ledger_s_notebook_paths_are_never_looked_up_on_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Round 4's audit: each distinct notebook path of a ledger's runs was resolved on disk, on
    the server's loop (60,000 deep ones from an 8 KB ledger held it 44 s). They are the ledger
    author's strings: turned into API paths as strings, off the loop."""
    from types import SimpleNamespace

    from smolbench.server.handlers import LedgerHandler

    looked: list[str] = []
    real = Path.resolve
    monkeypatch.setattr(Path, "resolve", lambda self, *a, **k: looked.append(str(self)) or real(self, *a, **k))
    stub = SimpleNamespace(root="/srv/notes", settings={})
    deep = "/srv/notes/" + "a/" * 500 + "x.ipynb"
    data = {"runs": [{"notebook": deep}, {"notebook": "/elsewhere/y.ipynb"}, {"notebook": "rel.ipynb"}],
            "notebooks": [{"notebook": f"/srv/notes/n{i}.ipynb", "runs": 1} for i in range(1000)]
            + [{"notebook": "/srv/notes/../notes/n0.ipynb", "runs": 2}]}
    LedgerHandler.relative_notebooks(stub, data)  # type: ignore[arg-type]
    assert [r["notebook"] for r in data["runs"]] == ["a/" * 500 + "x.ipynb", "y.ipynb", "rel.ipynb"]
    assert len(data["notebooks"]) == 1000 and {"notebook": "n0.ipynb", "runs": 3} in data["notebooks"]
    assert len(looked) <= 1, looked[:3]  # the root alone


def test_the_sidebar_lists_a_fifo_ledger_as_a_problem_and_never_waits_on_it(call: Any, jp_root_dir: Path) -> None:
    """Round 4's third audit: a copied folder's fifo -journal took one of the server's threads
    for ever at each poll of the sidebar (all of them after ~30 s)."""
    import threading
    import time

    from test_ledger_plain_files import unblock

    _ledger(jp_root_dir / "copied").close()
    db = jp_root_dir / "copied" / ".smolbench" / "ledger.db"
    db.with_name("ledger.db-wal").write_bytes(b"")
    fifo = db.with_name("ledger.db-journal")
    os.mkfifo(fifo)
    watchdog = threading.Timer(20, unblock, (fifo,))  # the old code's blocked open() goes, late
    watchdog.start()
    try:
        t0 = time.monotonic()
        listed = call("checkpoints")
        code, body = call("ledger", "runs", params={"path": "copied"})
        took = time.monotonic() - t0
    finally:
        watchdog.cancel()
        unblock(fifo)
    assert took < 15, f"the server waited {took:.0f} s on a fifo"
    assert listed[1]["problems"] == ["copied: the ledger has a fifo at ledger.db-journal: a ledger is read only as a "
                                     "plain file in a plain folder (as a kernel does)"], listed
    assert code == 403 and "has a fifo at ledger.db-journal" in body["message"], body
