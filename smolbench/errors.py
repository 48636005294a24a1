"""Errors a user sees: one line naming the problem and the fix."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, TypeVar


class SmolbenchError(Exception):
    """A problem the user can fix; its message is one line that says how.

    IPython shows it without a traceback (see ``magics``), because the
    traceback of our own layers never helps the user.
    """

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self}"]


class SmolfileError(SmolbenchError):
    """A Smolfile that cannot be used."""


class BackendUnavailable(SmolbenchError):
    """The chosen backend cannot run on this host."""


class InfraError(SmolbenchError):
    """A machine failed to boot or died for reasons of the infrastructure, not of the user's code.

    Fan-outs and ``%smol up`` retry these (``--retries``); a cell's own exception never is one.
    """


class MachineLost(SmolbenchError):
    """The machine died under a request (the kernel killed it for memory): its state is gone."""


class MachineBusy(SmolbenchError):
    """The machine is already running a cell."""


class NoAnswerInTime(SmolbenchError):
    """A request (on a kept connection, or a gym env's cell) had no answer within its timeout:
    a connection is cut (what the machine does with the request is unknown, so its user
    deletes the machine)."""

    @classmethod
    def after(cls, machine: str, timeout: float) -> NoAnswerInTime:
        """Its one line for ``machine``'s request unanswered after ``timeout`` s (both kinds say it here)."""
        return cls(f"machine {machine} sent no answer within {timeout:g} s")


class RemoteError(Exception):
    """An exception raised by user code inside a machine.

    Rendered in the notebook like a local exception, with the remote
    traceback pointing at the cell's own lines.
    """

    def __init__(self, ename: str, evalue: str, traceback: Sequence[str], node: str = "") -> None:
        super().__init__(evalue)
        self.ename = ename
        self.evalue = evalue
        self.traceback = list(traceback)
        self.node = node

    def render(self) -> list[str]:
        """The remote traceback as display lines (with ANSI colour)."""
        head = f"[{self.node}] " if self.node else ""
        if not self.traceback:  # no frames (e.g. `--pull x` of a name the machine lacks): the line alone
            return [f"\x1b[0;31m{head}{self.ename}\x1b[0m: {self.evalue}"]
        lines = [f"\x1b[0;31m{head}Traceback (most recent call last) inside the machine:\x1b[0m"]
        for chunk in self.traceback:
            lines.extend(chunk.rstrip("\n").split("\n"))
        lines.append(f"\x1b[0;31m{self.ename}\x1b[0m: {self.evalue}")
        return lines

    def _render_traceback_(self) -> list[str]:
        return self.render()


class CompositeError(Exception):
    """Several branches failed; shows the first few remote tracebacks.

    Like ipyparallel's ``CompositeError``: one failing branch never hides the
    others, and the full list is in ``.errors`` (and in the ForkResult). Identical
    errors (the same exception, message and traceback but for the branch's own name)
    are shown once, naming their branches: "the same error in 4 episodes: ...".
    """

    shown = 4  # distinct errors shown
    named = 8  # branches named for one of them

    def __init__(self, message: str, errors: Sequence[RemoteError | Any], unit: str = "branches") -> None:
        super().__init__(message)
        self.errors = list(errors)
        self.unit = unit

    def groups(self) -> list[list[RemoteError | Any]]:
        """The errors, identical ones together, in the order they first appear."""
        out: dict[tuple[str, ...], list[RemoteError | Any]] = {}
        for err in self.errors:
            out.setdefault(_same(err), []).append(err)
        return list(out.values())

    def _names(self, errors: Sequence[RemoteError | Any]) -> str:
        names = [_node_of(e) for e in errors]
        more = len(names) - self.named
        return ", ".join(names[: self.named]) + (f" and {more} more" if more > 0 else "")

    def _render_traceback_(self) -> list[str]:
        lines = [f"\x1b[0;31mCompositeError\x1b[0m: {self}"]
        groups = self.groups()
        for group in groups[: self.shown]:
            if len(group) > 1:
                lines.append(f"the same error in {len(group)} {self.unit}: {self._names(group)}")
            first = group[0]
            lines.extend(first.render() if isinstance(first, RemoteError) else [str(first)])
            lines.append("")
        rest = [err for group in groups[self.shown:] for err in group]
        if rest:
            lines.append(f"... {len(rest)} more ({self._names(rest)})")
        return lines


_NODE = re.compile(r"^\[([^\]]*)\] ")


def _node_of(err: RemoteError | Any) -> str:
    if isinstance(err, RemoteError):
        return err.node
    match = _NODE.match(str(err))
    return match.group(1) if match else "?"


def _same(err: RemoteError | Any) -> tuple[str, ...]:
    """What makes two branches' errors the same one: all of it but the branch's own name (its
    cell's file name, ``<In [3]@root.2>``, and the ``[root.2]`` a line starts with)."""
    if isinstance(err, RemoteError):
        own = f"@{err.node}>"
        return (err.ename, err.evalue, *(chunk.replace(own, "@>") for chunk in err.traceback))
    return ("", _NODE.sub("", str(err), count=1))


E = TypeVar("E", bound=BaseException)


def reworded(exc: E, text: str) -> E:
    """``exc`` again, as its own type and with its attributes, saying ``text`` (raised ``from
    None``: no traceback of our layers). Its constructor is not called: some take more than a
    message (``UnsafeLedger(where, what)``), and calling it with one became a TypeError."""
    new = type(exc).__new__(type(exc), text)
    new.__dict__.update(exc.__dict__)
    return new
