"""Which files the output logs' pool counts and removes: only smolbench's own logs, by name.

A copied project folder's ledger is its author's file: its sessions' ids are any strings. The
pool took ``-<last 6 characters of each id>.log`` for the end of a log's name, so a ledger with a
session ``x-epoch1`` had the user's own ``outputs/train-epoch1.log`` counted as another
session's idle log, and unlinked once this session's logs needed the room (the audit's repro,
below). Only names of smolbench's own log grammar (a node name, ``-``, a session id of
smolbench's own format) are ever counted or removed, and the logs go to a folder smolbench
owns, never a plain ``outputs/`` of the user's.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import pytest

import smolbench
from smolbench.gate.output import LogPool, OutputBudget
from smolbench.ledger import Ledger

MB = 1000**2
CELL = "for _ in range(2500): print('y' * 999)"  # 2.5 MB: past the lowered limit, 2.4 MB of it logged


def _copied_ledger(path: Path, session_id: str) -> None:
    """A ledger as another person's copied folder may hold it: a session row of any id."""
    Ledger(path).close()
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO sessions (id, started) VALUES (?, 0)", (session_id,))
    db.close()


@pytest.mark.parametrize(("crafted", "file"), [("x-epoch1", "train-epoch1.log"),
                                              ("20200101-000000-e0c0a1", "train-20200101-000000-e0c0a1.log")])
def test_a_copied_ledger_s_session_id_never_has_the_user_s_own_file_deleted(
        here: Path, output_limit: int, crafted: str, file: str) -> None:
    """The audit's repro: a ledger beside the user's files (``Session(ledger="ledger.db")``), one
    of its sessions named so that the user's ``outputs/train-<end of that id>.log`` looked like
    that session's log, an hour idle; two cells printing past the limit (the second once the
    folder may be looked at again, 10 s on) had it unlinked to make room. Also with an id of
    smolbench's own format: the user's ``outputs/`` is not the logs' folder."""
    _copied_ledger(here / "ledger.db", crafted)
    users = here / "outputs" / file
    users.parent.mkdir()
    users.write_bytes(b"epoch 1: loss 0.25\n" * 1000)
    hour_ago = time.time() - 3600
    os.utime(users, (hour_ago, hour_ago))
    with smolbench.Session(backend="process", ledger="ledger.db") as s:
        pool = s.workbench.log_pool
        pool.total = pool.left = 3 * MB  # the shared 1 GB lowered, as the audit did
        first = s.run(CELL)
        assert first.output_log is not None
        pool._looked -= 11  # 11 s on: the folder may be looked at again (instead of waiting)
        second = s.run(CELL)
    assert users.read_bytes() == b"epoch 1: loss 0.25\n" * 1000  # was deleted as the other session's oldest idle log
    from smolbench.gate.output import LOG_NAME, SESSION_ID

    log = Path(first.output_log)
    assert log.parent == here / "ledger.db.outputs"  # a folder of smolbench's, named after the ledger beside it
    name = LOG_NAME.fullmatch(log.name)  # what it makes is what it would count: its session id in its own format
    assert name is not None and name["session"] == s.workbench.session and SESSION_ID.fullmatch(s.workbench.session)
    assert "more output not shown" in second.stdout


def test_only_names_of_smolbench_s_log_grammar_are_ever_counted_or_removed(tmp_path: Path) -> None:
    """Every file below is idle for a day and large, and the ledger lists sessions whose ids end
    the way these names do; none is a log of smolbench's own grammar
    (``<node>[.cellN]-<yyyymmdd-hhmmss-hhhhhh>.log`` of a session of this ledger's, in that
    format), so none is counted against the pool nor removed. Only the one true idle log of
    another session is."""
    sessions = ["x-epoch1", "aaaaaa", "../../etc", "", "20261204-101010-ffffff/x", "20261204-101010-FFFFFF",
                "20261204-101010-bbbbbb", "20261205-090909-cccccc"]
    never = ["train-epoch1.log", "train-aaaaaa.log", "root.cell1-aaaaaa.log", "-20261204-101010-bbbbbb.log",
             ".-20261204-101010-bbbbbb.log", "notes-20261204-101010-bbbbbb.log.bak",
             "root.cell1-20261204-101010-bbbbbb.txt", "root cell1-20261204-101010-bbbbbb.log",
             "root.cell1-20261204-101010-FFFFFF.log", "root.cell1-20261204-101010-bbbbbbb.log",
             "root.cell1-20261204-101010-bbbbb.log", "root.cell1-20261299-101010-ddddd1.log",
             "root.cell1_20261204-101010-bbbbbb.log", "x-etc.log", "root.cell1-etc.log",
             "root.cell1-101010-bbbbbb.log", "root.cell1-bbbbbb.log"]
    for name in never:
        (tmp_path / name).write_bytes(b"u" * 4096)
        os.utime(tmp_path / name, (0, 0))
    theirs = tmp_path / "root.cell2-20261204-101010-bbbbbb.log"  # another session's, idle for long
    theirs.write_bytes(b"o" * 4096)
    os.utime(theirs, (1, 1))
    mine = "20261205-111111-eeeeee"
    pool = LogPool(total=8192, folder=tmp_path, mine=mine, sessions=lambda: [*sessions, mine])
    budget = OutputBudget(tmp_path / f"root.cell1-{mine}.log", limit=10, log_limit=8192, pool=pool)
    budget.take("stdout", "x" * 9000)
    budget.finish()
    for name in never:
        assert (tmp_path / name).read_bytes() == b"u" * 4096, name
    assert not theirs.exists()  # the pool still makes room from other sessions' own logs
    assert (tmp_path / f"root.cell1-{mine}.log").stat().st_size == 8192  # none of the others counted


def test_the_logs_go_to_a_folder_of_smolbench_s_never_the_user_s_outputs() -> None:
    """``outputs/`` beside a ledger kept in the user's own folder is the user's: the logs go to
    one named after the ledger there; beside the default ledger, inside ``.smolbench``."""
    from smolbench.gate.output import log_folder

    assert log_folder(Path(".smolbench/ledger.db")) == Path(".smolbench/outputs")
    assert log_folder(Path("/p/.smolbench/ledger.db")) == Path("/p/.smolbench/outputs")
    assert log_folder(Path("ledger.db")) == Path("ledger.db.outputs")
    assert log_folder(Path("runs/ledger.db")) == Path("runs/ledger.db.outputs")
    assert log_folder(Path(".smolbench/other.db")) == Path(".smolbench/other.db.outputs")
    assert log_folder(Path("runs/outputs")) == Path("runs/outputs.outputs")


def test_two_sessions_with_the_same_random_part_keep_their_own_logs(tmp_path: Path) -> None:
    """Log names carried only the session id's last 6 hex digits (24 bits): two sessions of one
    folder drawing the same had one's root.cell1 empty the other's, and each pool took the
    other's logs for its own (never counted). The whole session id is in the name now."""
    from smolbench.gate.output import log_name

    a, b = "20261204-101010-abcdef", "20261204-101011-abcdef"
    assert log_name("root", ".cell1", a) == f"root.cell1-{a}.log" != log_name("root", ".cell1", b)
    first = OutputBudget(tmp_path / log_name("root", ".cell1", a), limit=10, log_limit=4096)
    first.take("stdout", "a" * 5000)
    first.finish()
    pool = LogPool(total=8192, folder=tmp_path, mine=b, sessions=lambda: [a, b])
    second = OutputBudget(tmp_path / log_name("root", ".cell1", b), limit=10, log_limit=8192, pool=pool)
    second.take("stdout", "b" * 9000)
    second.finish()
    assert (tmp_path / log_name("root", ".cell1", a)).read_bytes() == b"a" * 4096  # not emptied by the other
    assert second.logged == 8192 - 4096  # and counted as the other session's (a recent one: not removed)
