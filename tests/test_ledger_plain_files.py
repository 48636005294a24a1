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
from smolbench._ledgerfiles import odd_part
from smolbench.ledger import Ledger

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


def hot_journal(db: Path, names: str) -> None:
    """A rollback journal beside ``db`` as SQLite writes one for a transaction of several
    databases: a header, no pages, then the super-journal's name, its length, its checksum
    and the journal's magic (what SQLite reads back from the file's last 16 bytes)."""
    magic = bytes.fromhex("d9d505f920a163d7")
    page = 4096
    header = (magic + (0).to_bytes(4, "big") + (1).to_bytes(4, "big") + (1).to_bytes(4, "big")
              + (512).to_bytes(4, "big") + page.to_bytes(4, "big")).ljust(512, b"\0")
    name = names.encode()
    lock_page = 0x40000000 // page + 1  # SQLite's PAGER_SJ_PGNO: the record that holds the name
    tail = (lock_page.to_bytes(4, "big") + name + len(name).to_bytes(4, "big") + (sum(name) & 0xFFFFFFFF).to_bytes(4, "big")
            + magic)
    db.with_name(db.name + "-journal").write_bytes(header + tail)


@pytest.mark.parametrize("opener", ["kernel", "server-delete"])
def test_a_copied_ledger_s_journal_can_t_have_sqlite_delete_the_user_s_files(tmp_path: Path, opener: str,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Fourth audit: a copied folder's ``ledger.db-journal`` naming a super-journal had SQLite
    delete that file (``../thesis.tex``: relative to the kernel's folder, or absolute) as the
    kernel's `%smol up`, or the sidebar's delete of one of that folder's checkpoints, opened
    the ledger to write and rolled the journal back."""
    from smolbench import _ledgerfiles as ledger_module
    from smolbench.server.handlers import _delete_checkpoint

    thesis = tmp_path / "thesis.tex"
    shared = tmp_path / "shared"
    db = shared / ".smolbench" / "ledger.db"
    _ledger(shared).close()

    def open_it() -> None:
        if opener == "kernel":
            Ledger(db).close()
        else:
            _delete_checkpoint(db, "x", str(tmp_path))

    def attack() -> BaseException | None:
        thesis.write_text("four years of work")
        hot_journal(db, str(thesis))
        try:
            open_it()
        except Exception as exc:  # noqa: BLE001 (what the user is told)
            return exc
        return None

    monkeypatch.chdir(shared)
    refused = attack()
    assert thesis.read_text() == "four years of work"
    if opener == "kernel":
        assert isinstance(refused, SmolbenchError) and str(refused) == (
            f"ledger {db} has a rollback journal naming a file for SQLite to delete (a super-journal) at "
            "ledger.db-journal: smolbench's ledger never keeps one (it uses WAL), so it was put there: move "
            "ledger.db-journal aside")
    else:
        assert "a rollback journal naming a file for SQLite to delete" in str(refused), refused
    assert odd_part(db) == (db.with_name("ledger.db-journal"), ledger_module.SUPER_JOURNAL)

    # the attack is real: with the check weakened, the same open deletes the user's file
    monkeypatch.setattr(ledger_module, "_names_a_super_journal", lambda journal, size: False)
    attack()
    assert not thesis.exists()


def test_a_journal_naming_no_super_journal_still_opens(tmp_path: Path) -> None:
    """Only a journal that names a file is refused: an empty one, or one of a crash before
    the ledger was in WAL mode (pages only, no name), is SQLite's to roll back as usual."""
    db = tmp_path / ".smolbench" / "ledger.db"
    _ledger(tmp_path).close()
    journal = db.with_name("ledger.db-journal")
    for content in (b"", bytes.fromhex("d9d505f920a163d7").ljust(512, b"\0")):
        journal.write_bytes(content)
        assert odd_part(db) is None
        Ledger(db).close()
