"""Whether a ledger's files are what a ledger is made of, checked before SQLite opens them.

A ledger in a copied folder is its author's file, and SQLite opens by path and follows
what it finds there: links, devices, fifos and a journal naming a file to delete.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import SmolbenchError

SIDE_FILES = ("-wal", "-shm", "-journal")  # what SQLite keeps beside a ledger


def linked_part(path: Path, beside: tuple[str, ...] = SIDE_FILES) -> Path | None:
    """The part of a ledger that is a symbolic link (its folder, itself or SQLite's files beside
    it), or None: a ledger is used only as what it says it is, by the kernel and the server.
    With ``beside=()``, the same for any path and its folder (the cells' output logs' folder)."""
    for p in (path.parent, path, *(path.with_name(path.name + s) for s in beside)):
        if p.is_symlink():
            return p
    return None


def odd_part(path: Path) -> tuple[Path, str] | None:
    """The first part of a ledger that is not what a ledger is made of, and what it is instead;
    None if all are: its folder a plain folder, the ledger and SQLite's files beside it each
    absent or a plain file of one name, and the journal none that names a file to delete.
    Checked before SQLite opens any of them (it opens by path, and follows what it finds): a
    copied folder's ``ledger.db`` that is a device had SQLite write a new database's pages
    onto that disk before it failed, a fifo ``-journal`` hung the kernel (and the server's
    threads) in ``open()`` beyond Ctrl-C, and a ``-journal`` naming a super-journal had
    SQLite delete that file (any of the user's) as it rolled the journal back."""
    folder = path.parent
    for p in (folder, path, *(path.with_name(path.name + s) for s in SIDE_FILES)):
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        except OSError as exc:
            return p, f"a path that can't be looked at ({exc.strerror})"
        if stat.S_ISLNK(st.st_mode):
            return p, "a symbolic link"
        if p is folder:
            if not stat.S_ISDIR(st.st_mode):
                return p, "something that is not a folder"
            continue
        if not stat.S_ISREG(st.st_mode):
            kind = ("a fifo" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                    else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "a folder"
                    if stat.S_ISDIR(st.st_mode) else "something that is not a plain file")
            return p, kind
        if st.st_nlink != 1:
            return p, f"a file with {st.st_nlink} names (hard links)"
        if p.name.endswith("-journal") and _names_a_super_journal(p, st.st_size):
            return p, SUPER_JOURNAL
    return None


# SQLite's rollback journal ends with a "super-journal" name when it has one: the name, its
# length and checksum, then this magic. Rolling back a hot journal (any read-write open of its
# database, before a statement runs) deletes the file that name gives, wherever it is: a copied
# folder's journal named the user's files. smolbench's ledger is in WAL mode and never has one.
JOURNAL_MAGIC = bytes.fromhex("d9d505f920a163d7")
SUPER_JOURNAL = "a rollback journal naming a file for SQLite to delete (a super-journal)"


def _names_a_super_journal(journal: Path, size: int) -> bool:
    """Whether ``journal`` (a plain file, checked) ends as one naming a super-journal does
    (its last 16 bytes as SQLite reads them); True too if it can't be read to tell."""
    if size < 16:
        return False
    try:
        fd = os.open(journal, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return True
    try:
        return os.pread(fd, 8, size - 8) == JOURNAL_MAGIC
    except OSError:
        return True
    finally:
        os.close(fd)


def refusal(path: Path) -> str | None:
    """Why the ledger at ``path`` is not opened (:func:`odd_part`), in one line; None if it may be."""
    odd = odd_part(path)
    if odd is None:
        return None
    p, what = odd
    if what == "a symbolic link":
        try:
            to = f" (to {os.readlink(p)})"
        except OSError:
            to = ""
        return (f"ledger {path} has a symbolic link at {p.name}{to}: a ledger is opened only as a plain file in a "
                "plain folder; replace the link with the file itself")
    if what == SUPER_JOURNAL:
        return (f"ledger {path} has {what} at {p.name}: smolbench's ledger never keeps one (it uses WAL), so it was "
                f"put there: move {p.name} aside")
    return (f"ledger {path} has {what} at {p.name}: a ledger is opened only as a plain file in a plain folder; "
            f"move {p.name} aside")


def refuse_links(path: Path) -> None:
    """A ledger (and SQLite's files beside it, and its folder) only as what it says it is: a
    copied folder's ``.smolbench/ledger.db`` that links elsewhere would have this kernel write
    (or make) a database wherever the link points; one that is a device, onto that disk."""
    why = refusal(path)
    if why is not None:
        raise SmolbenchError(why)
