"""SQLite work cut off in time: ``Connection.interrupt()`` at a deadline, from one watcher thread.

A ledger in a copied folder is its author's file, and some of what SQLite does with one is a
single step of its machine, which no progress handler sees: counting a table walks its
b-tree in one step (an audit's 282 KB ledger, whose b-trees' pages all named one page below,
took days to count), and the schema is parsed whole at its first use (a view of 150,000
CTEs: hours). ``sqlite3_interrupt`` stops both, from any thread. One daemon thread serves
every connection of the process; a use costs a lock and a heap push.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import sqlite3
import threading
import time
from collections.abc import Iterator


class Cut:
    """One use of a connection under a deadline; ``fired`` once it was interrupted."""

    __slots__ = ("conn", "deadline", "fired", "done")

    def __init__(self, conn: sqlite3.Connection, deadline: float) -> None:
        self.conn = conn
        self.deadline = deadline
        self.fired = False
        self.done = False

    def stopped(self, exc: BaseException) -> bool:
        """Whether ``exc`` is SQLite's answer to this cut (not another error of the same use)."""
        return self.fired and isinstance(exc, sqlite3.OperationalError) and "interrupt" in str(exc)


AGAIN = 0.05  # s between interrupts of a use past its deadline

_lock = threading.Lock()
_wake = threading.Condition(_lock)
_due: list[tuple[float, int, Cut]] = []
_order = itertools.count()
_watcher: threading.Thread | None = None


def _watch() -> None:
    with _lock:
        while True:
            while _due and _due[0][2].done:
                heapq.heappop(_due)
            if not _due:
                _wake.wait()
                continue
            left = _due[0][0] - time.monotonic()
            if left > 0:
                _wake.wait(left)
                continue
            cut = heapq.heappop(_due)[2]
            cut.fired = True  # under the lock: a use that has ended (done) is never interrupted
            with contextlib.suppress(sqlite3.ProgrammingError):  # closed meanwhile
                cut.conn.interrupt()
            # and again until the use ends: an interrupt while no statement runs is forgotten
            # when the next one starts, which would then run unbounded
            heapq.heappush(_due, (time.monotonic() + AGAIN, next(_order), cut))


@contextlib.contextmanager
def cut_off(conn: sqlite3.Connection, seconds: float) -> Iterator[Cut]:
    """Interrupt what ``conn`` runs once the block has taken ``seconds``: its statement raises
    ``sqlite3.OperationalError('interrupted')`` (:meth:`Cut.stopped` tells it apart)."""
    global _watcher
    cut = Cut(conn, time.monotonic() + seconds)
    with _lock:
        if _watcher is None:
            _watcher = threading.Thread(target=_watch, name="smolbench-sqlite-deadlines", daemon=True)
            _watcher.start()
        heapq.heappush(_due, (cut.deadline, next(_order), cut))
        if _due[0][2] is cut:
            _wake.notify()
    try:
        yield cut
    finally:
        with _lock:
            cut.done = True


def _after_fork() -> None:  # a child has no watcher thread: it starts its own when it needs one
    global _lock, _wake, _watcher
    _lock = threading.Lock()
    _wake = threading.Condition(_lock)
    _due.clear()
    _watcher = None


os.register_at_fork(after_in_child=_after_fork)
