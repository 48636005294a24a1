"""Every gym episode's record: a node of the fork tree and a ledger row.

Written on smolbench's loop. A vector step's episode ends and autoresets, found on the
caller's thread (``Machines.finish_now``), are noted there and written on the loop after the
step returns, in one ledger transaction: the step doesn't wait for the loop (that wait was
~15% of an in-place step at 16 sub-envs). A fresh episode is a branch: its records are
written straight after the step, as a fork's are. In place, where an episode is not a
machine, they are gathered for at most :data:`GATHER` with those of the steps in between, so
the loop is woken and commits once per gathering, not once per step (those were ~20% of this
process's CPU in an in-place step at 16). The episode's own state (running, return, length)
changes at once; only the record comes a moment later, in order: a record written straight
away (on the loop) writes those gathered before it first.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .. import _loop
from ..tree import KEPT_ENDED, Node

if TYPE_CHECKING:
    from .episode import Episode
    from .warmparent import WarmParent

log = logging.getLogger(__name__)
GATHER = 0.01  # s: how long after a step its episodes' records may wait, to go with later ones
# Ended episodes an env (with its OpenEnv siblings) keeps in the kernel's tree, the newest:
# each takes ~0.8 KiB there, and a long training run ends millions. Older ones leave the tree
# (`%smol tree`, the plots) and stay in the ledger (the sidebar, `Ledger`), ~0.5 KiB a row.
KEPT_IN_MEMORY = KEPT_ENDED
ENDS = {"terminated": "ok", "truncated": "ok", "reset": "ok", "closed": "ok"}  # how an episode ended -> its status


def quietly(fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)``, a record's write, logged if it fails: a record that can't be written must
    not stop the others, a reset, or a close's deletions."""
    try:
        fn(*args)
    except Exception:
        log.exception("smolbench.gym: a record was not written")


class Records:
    """The episodes' records of one gym env's machines."""

    def __init__(self, m: WarmParent) -> None:
        self.m = m
        self._later: list[tuple[Callable[..., None], tuple[Any, ...]]] | None = None
        self._owner = 0  # the thread noting into _later
        self._lock = threading.Lock()
        self._gathered: list[tuple[Callable[..., None], tuple[Any, ...]]] = []  # not empty: a write is on its way
        m.wb.unwritten.add(self)  # the workbench's down writes them first
        self.kept: collections.deque[str] = collections.deque()  # ended episodes' nodes in the tree, oldest first
        self.client_name: Callable[[str], str] | None = None  # a served session's name for a machine

    def begin(self, ep: Episode, seed: int | None) -> None:
        """``ep``'s new episode: its node, running."""
        m = self.m
        assert ep.ref is not None and m.parent is not None
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            seed = None  # checked before it gets here (env.check_seed); a row could not hold another
        node = Node(ep.ref.name, m.parent.name, seed, status="running", started=time.time(), run_id=m.run_id,
                    forked_at=m.wb.tree[m.parent.name].cells)
        node.metrics = {"sub_env": ep.index, "reset": m.mode}
        if self.client_name is not None:  # what the client of `smolbench serve` calls its machine
            node.metrics["client_name"] = self.client_name(ep.ref.name)
        ep.episodes += 1
        ep.node, ep.ret, ep.length, ep.running = node, 0.0, 0, True
        # in place, the same machine's next episode gets its own node (on a channel its
        # cells stay the same: they were its id)
        self._note(self._add, node, f"{ep.ref.name}#{ep.episodes}")

    def end(self, ep: Episode, how: str, error: str | None = None) -> None:
        """``ep``'s episode ended ``how``: its return, length and how it ended."""
        node, ep.node = ep.node, None
        ep.running = False
        if node is None:
            return
        alive = self.m.mode == "in-place" and ep.ref is not None and ep.ref.name in self.m.wb.machines
        self._note(self._ended, node, how, ep.ret, ep.length, error, alive, time.time())

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """On the caller's thread: what is noted inside is written on the loop afterwards."""
        self._later, self._owner = [], threading.get_ident()
        try:
            yield
        finally:
            later, self._later, self._owner = self._later, None, 0
            if later and self.m.mode != "in-place":  # episodes that are branches: written at once
                _loop.get_loop().call_soon_threadsafe(self._write, later)
            elif later:
                with self._lock:
                    asked = bool(self._gathered)
                    self._gathered.extend(later)
                if not asked:
                    loop = _loop.get_loop()
                    loop.call_soon_threadsafe(loop.call_later, GATHER, self.flush)

    def session_down(self) -> None:
        """The session goes down with this env open (a script that never closed it, a
        SIGTERM): it makes no more spares, and each running episode ends as closed, its
        return kept; its machines go with the session's (``Workbench.down``)."""
        m = self.m
        if m.closed:
            return
        m.closed = True  # its own close (later, by its user) has nothing left to do
        for ep in m.eps:
            if ep.running:
                quietly(self.end, ep, "closed")
        self.flush()
        if m.run_id and m.owns_parent:
            quietly(m.wb.ledger.end_run, m.run_id, "done")

    def flush(self) -> None:
        """Write what was gathered (on the loop; ``WarmParent.close`` does it first)."""
        with self._lock:
            later, self._gathered = self._gathered, []
        if later:
            self._write(later)

    def _note(self, fn: Callable[..., None], *args: Any) -> None:
        if self._later is not None and threading.get_ident() == self._owner:
            self._later.append((fn, args))
        else:
            self.flush()  # in order: an episode's begin before its end
            quietly(fn, *args)

    def _write(self, later: list[tuple[Callable[..., None], tuple[Any, ...]]]) -> None:
        with self.m.wb.recording():  # one commit; the views hear of it after
            for fn, args in later:
                quietly(fn, *args)

    def _add(self, node: Node, other_id: str) -> None:
        wb = self.m.wb
        if node.id in wb.tree:
            node.id = other_id
        wb.tree.add(node)
        wb._record(node)

    def _ended(self, node: Node, how: str, ret: float, length: int, error: str | None, alive: bool, at: float) -> None:
        node.status = ENDS.get(how, how)
        node.reward = ret
        node.metrics = {**node.metrics, "length": length, "ended": how}
        node.ended = at
        node.error = error
        node.alive = alive
        self.m.wb._record(node)
        self._let_go(node.id)

    def _let_go(self, node_id: str) -> None:
        """Keep the newest :data:`KEPT_IN_MEMORY` ended episodes in the tree (written: on the loop)."""
        self.kept.append(node_id)
        wb = self.m.wb
        while len(self.kept) > KEPT_IN_MEMORY:
            old = self.kept.popleft()
            if old not in wb.machines:  # a machine's own node (in place: its first episode's) stays
                wb.tree.forget(old)
