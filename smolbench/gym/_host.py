"""Where a gym env's machines come from: a Session (or the notebook's), else one of its own.

The one place that knows how to reach the Workbench under a session, so the rest of
``smolbench.gym`` works on its backend, fork tree and ledger the same way whichever
made it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from .. import _loop
from ..errors import SmolbenchError
from ..workbench import Workbench

T = TypeVar("T")


class Host:
    """A Workbench the gym env runs its machines on, and whether the env owns it."""

    def __init__(self, wb: Workbench, owner: Any = None) -> None:
        self.wb = wb
        self.owner = owner  # a Session (or Workbench) this env started: closed with the env

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None, *, stoppable: bool = True) -> T:
        """Run ``coro`` on smolbench's loop (where the Workbench lives) and wait for it; a
        Ctrl-C (or the timeout) stops it there first (``_loop.run``)."""
        return _loop.run(coro, timeout, stoppable=stoppable)

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Start ``coro`` on smolbench's loop without waiting for it."""
        return _loop.submit(coro)

    def close(self) -> None:
        """Take down what this env started itself (a session given to it stays up)."""
        owner, self.owner = self.owner, None
        if owner is None:
            return
        with contextlib.suppress(Exception):
            if isinstance(owner, Workbench):
                self.run(owner.down(), stoppable=False)  # a SIGTERM meanwhile lets it finish
            else:  # a smolbench.Session
                owner.__exit__(None, None, None)


def _workbench_of(session: Any) -> Workbench | None:
    if isinstance(session, Workbench):
        return session
    for attr in ("workbench", "wb", "_wb", "_workbench"):
        wb = getattr(session, attr, None)
        if isinstance(wb, Workbench):
            return wb
    return None


def host_for(session: Any = None, smolfile: str | None = None) -> Host:
    """The machines for a new env: ``session``'s; else the notebook's (``%smol up``); else a
    session of the env's own from ``smolfile`` (or the defaults), closed with the env."""
    if session is not None:
        wb = _workbench_of(session)
        if wb is None and type(session).__name__ == "Session" and hasattr(session, "is_up"):
            raise SmolbenchError("the session is not up: use it in a `with smolbench.Session() as s:` block "
                                 "(or call s.up()) first")
        if wb is None:
            raise SmolbenchError(f"session should be a smolbench.Session, got {type(session).__name__}")
        if wb.active is None:
            raise SmolbenchError("the session has no machine up: start it (`with smolbench.Session() as s:`) first")
        return Host(wb)
    if smolfile is None:
        current = _current()
        if current is not None:
            return Host(current)
    return _own(smolfile)


def _current() -> Workbench | None:
    """The notebook's Workbench, when ``%smol up`` made one in this process."""
    import smolbench

    finder = getattr(smolbench, "session", None)
    if callable(finder):
        with contextlib.suppress(Exception):
            wb = _workbench_of(finder())
            if wb is not None and wb.active is not None:
                return wb
    magics = getattr(smolbench, "_magics", None)
    wb = getattr(magics, "workbench", None)
    return wb if isinstance(wb, Workbench) and wb.active is not None else None


def _own(smolfile: str | None) -> Host:
    """A session of the env's own (Session when there is one, else a Workbench brought up here)."""
    import smolbench

    session_cls = getattr(smolbench, "Session", None)
    if session_cls is not None:
        session = session_cls(smolfile)
        session.__enter__()
        wb = _workbench_of(session)
        if wb is None:
            session.__exit__(None, None, None)
            raise SmolbenchError("this smolbench.Session has no Workbench to run gym machines on")
        return Host(wb, owner=session)
    import os

    from ..ledger import DEFAULT_PATH, Ledger
    from ..magics import choose_backend
    from ..smolfile import load_smolfile
    from ..spec import MachineSpec

    path = smolfile or ("Smolfile" if os.path.exists("Smolfile") else None)
    if smolfile and not os.path.exists(smolfile):
        raise SmolbenchError(f"no Smolfile at {smolfile}: check the path, or leave smolfile out to use the defaults")
    spec = load_smolfile(path) if path else MachineSpec()
    backend, _ = choose_backend("auto", "local")
    wb = Workbench(backend, spec, Ledger(DEFAULT_PATH))
    _loop.run(wb.up())
    return Host(wb, owner=wb)
