"""A ledger is opened only as plain files in a plain folder: checked before SQLite opens
anything by path (round 4's third audit).

A copied folder (a colleague's tarball, unpacked as root) can hold device nodes and fifos
where the ledger's files go. SQLite opens what it finds: a ``ledger.db`` that was a device
had a new database's pages written to it (on a disk: its first 12 KB, the partition table)
before the open failed; a ``ledger.db-journal`` fifo hung the kernel in ``open()``, Ctrl-C
or not, and each poll of the sidebar took one of the Jupyter server's threads for ever.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_server_api import _ledger

from smolbench import SmolbenchError
from smolbench.ledger import Ledger, odd_part

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root (as `tar x` as root does)")


def opened_within(target: Callable[[], Any], seconds: float = 20.0) -> tuple[bool, BaseException | None]:
    """Run ``target`` in a thread: (whether it returned in time, what it raised)."""
    got: list[BaseException | None] = []

    def run() -> None:
        try:
            target()
            got.append(None)
        except BaseException as exc:  # noqa: BLE001 (reported to the test)
            got.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return bool(got), (got[0] if got else None)


def unblock(fifo: Path) -> None:
    """Let an open() blocked on ``fifo`` go (the old code's), so no thread stays behind."""
    for flags in (os.O_RDONLY | os.O_NONBLOCK, os.O_WRONLY | os.O_NONBLOCK):
        try:
            os.close(os.open(fifo, flags))
        except OSError:
            pass


@pytest.mark.parametrize("reader", ["kernel", "read-only"])
def test_a_fifo_beside_a_copied_ledger_is_refused_not_waited_on(tmp_path: Path, reader: str) -> None:
    db = tmp_path / ".smolbench" / "ledger.db"
    _ledger(tmp_path).close()
    if reader == "read-only":  # a -wal makes SQLite look for a hot journal
        db.with_name("ledger.db-wal").write_bytes(b"")
    fifo = db.with_name("ledger.db-journal")
    os.mkfifo(fifo)
    try:
        opened, raised = opened_within(lambda: Ledger(db).close() if reader == "kernel" else Ledger.read_only(db))
    finally:
        unblock(fifo)
    assert opened, "the ledger's open hung on a fifo"
    assert isinstance(raised, SmolbenchError) and "has a fifo at ledger.db-journal" in str(raised), raised
    assert "move ledger.db-journal aside" in str(raised)


@needs_root
def test_a_device_as_a_copied_ledger_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    db = tmp_path / ".smolbench" / "ledger.db"
    db.parent.mkdir()
    # /dev/full's numbers: every write fails with ENOSPC, so a write reaching it can be told
    # from none (the attacker's would be a disk: `b 8 0`)
    os.mknod(db, 0o644 | stat.S_IFCHR, os.makedev(1, 7))
    with pytest.raises(SmolbenchError, match=r"has a device at ledger\.db: a ledger is opened only as a plain file"):
        Ledger(db)
    os.unlink(db)
    _ledger(tmp_path).close()
    os.mknod(db.with_name("ledger.db-wal"), 0o644 | stat.S_IFCHR, os.makedev(1, 7))
    with pytest.raises(SmolbenchError, match=r"has a device at ledger\.db-wal"):
        Ledger(db)
    with pytest.raises(SmolbenchError, match=r"has a device at ledger\.db-wal"):
        Ledger.read_only(db)


def test_only_plain_files_of_one_name_pass(tmp_path: Path) -> None:
    db = tmp_path / ".smolbench" / "ledger.db"
    assert odd_part(db) is None  # nothing there yet: a ledger is made
    _ledger(tmp_path).close()
    assert odd_part(db) is None
    os.link(db, tmp_path / "second-name")
    assert odd_part(db) == (db, "a file with 2 names (hard links)")
    os.unlink(tmp_path / "second-name")
    (db.parent / "ledger.db-shm").mkdir()
    assert odd_part(db) == (db.parent / "ledger.db-shm", "a folder")
