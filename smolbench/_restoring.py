"""How a Session restores a checkpoint (``Session.checkpoint_restore`` and ``%smol checkpoint
restore`` share it): with nothing up, a session of the checkpoint's backend brought up with the
restored machine as its only one, what its restore would refuse refused before that up, and
that up taken down again when the restore fails. One mixin of :class:`smolbench.Session`
(which backend may restore which checkpoint: gate/restoring.py)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from . import _args
from ._blocking import _block

if TYPE_CHECKING:
    from .gate.archive import Checked
    from .workbench import Workbench


def _restorable(name_or_path: Any) -> str:
    got = _args.path(name_or_path, "name_or_path", "checkpoint_restore('lesson') or a .smolcheckpoint file's path")
    assert got is not None
    if isinstance(name_or_path, os.PathLike) and "/" not in got:
        got = os.path.join(".", got)  # a Path is a file, even one named like a checkpoint of this folder
    return got


def _taken_back(took: int | Exception, told: Callable[[str, bool], None], wb: Workbench | None) -> None:
    """What a failed restore's take-down of the machine brought up for it says: ``took`` is how
    many machines went (none: the up itself had failed, and deleted its own), or its error
    (``wb``: the session's, whose machines are what that left up)."""
    if isinstance(took, Exception) and wb is not None and not wb.machines:  # its machines went: the rest failed
        told(f"smolbench: no machine brought up for it is left, but ending the session it started failed too "
             f"({type(took).__name__}: {took}): `%smol down` tries again", False)
    elif isinstance(took, Exception):
        told(f"smolbench: taking down the machine brought up for it failed too ({type(took).__name__}: {took}): "
             "`%smol down` deletes what is left", False)
    elif took:
        told("smolbench: took down the machine brought up for it", True)


class RestoringMixin:
    """A Session's one restore, and the up it brings for it with nothing up."""

    backend_kind: str
    ray: str | bool | None
    ledger_path: str | None
    workbench: Workbench | None
    fallback: str
    on_notice: Callable[[str], None]

    if TYPE_CHECKING:  # provided by Session
        @property
        def is_up(self) -> bool: ...
        def _wb(self) -> Workbench: ...
        def build(self, announce: Callable[[str], None] | None = None) -> Workbench: ...
        def boot(self, restore: str | None = None, *, waiting: Callable[[], None] | None = None) -> Any: ...
        def down(self) -> int: ...
        def _room(self, checked: Checked, label: str) -> str | None: ...
        def _notice_line(self, line: str) -> None: ...

    def _restore(self, what: str, up: Callable[[str], object] | None = None,
                 told: Callable[[str, bool], None] | None = None) -> str:
        """The one restore, :meth:`checkpoint_restore`'s and ``%smol checkpoint restore``'s; the
        restored node's id. With nothing up, ``up(what)`` (default :meth:`_up_restoring`) brings
        up a session of the checkpoint's backend whose one machine is the restored one. If that
        fails (an error, or a Ctrl-C, even one landing as that up comes back), what it brought up
        is taken down again; a machine that was up before never is (the backend deletes the one
        it was restoring into). ``told(line, gone)`` (default: a notice) hears how that went."""
        started = not self.is_up
        try:
            if started:
                with self._backend_for(what):
                    (up or self._up_restoring)(what)
                node = self._wb().active
                assert node is not None
            else:
                node = _block(self._wb().checkpoint_restore(what)).id
        except BaseException:
            if started:
                try:
                    took: int | Exception = self.down()
                except Exception as exc:  # the restore's own error is the one raised: this goes beside it
                    took = exc
                _taken_back(took, told or self._notice, self.workbench)
            raise
        return node

    def _up_restoring(self, what: str) -> None:
        """:meth:`up`, its one machine restored from checkpoint ``what`` (no root booted beside it)."""
        self.down()  # what is left of a session whose root was lost
        self.build()
        if self.fallback:
            self.on_notice(self.fallback)
        self.boot(restore=what)

    def _notice(self, line: str, gone: bool) -> None:
        self._notice_line(line)

    @contextlib.contextmanager
    def _backend_for(self, checkpoint: str) -> Iterator[None]:
        """Before the up for restoring ``checkpoint``: what its restore would refuse with no machine
        is refused now, before one boots (a file's name that can't be a checkpoint's, a name not
        here). ``backend="auto"``: the backend ``checkpoint`` was made on (never the process backend
        on a file's or a row's word), for the up inside this block only: a later up() chooses as
        the Session was asked. A backend given to the Session stays."""
        from .ledger import DEFAULT_PATH, Ledger
        from .shelf import Shelf

        asked = self.backend_kind
        ledger = Ledger(self.ledger_path or DEFAULT_PATH)
        try:
            shelf = Shelf(ledger)
            # a sandbox's files are in memory, within disk: a checkpoint too big for this Smolfile's is said now
            sandbox = asked in ("auto", "sandbox") and self.ray in (None, False)
            shelf.refusal_before_up(checkpoint, self._room if sandbox else None)
            if asked == "auto" and self.ray in (None, False):
                self.backend_kind = shelf.backend_for(checkpoint)
        finally:
            ledger.close()
        try:
            yield
        finally:
            self.backend_kind = asked

    def _restored(self, node: str, wb: Workbench | None = None) -> str:
        wb = wb or self._wb()
        for note in getattr(wb, "restore_notes", []):
            self._notice_line(f"smolbench: {note}")
        for warning in wb.machines[node].info.get("restore_warnings", []):
            self._notice_line(f"smolbench: warning: {warning}")
        return node
