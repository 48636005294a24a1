"""What the magics show in the running cell: events made on smolbench's loop thread (a cell's
output, a fork's branches', the Workbench's notices), queued and shown on the kernel's main
thread, so output lands in the cell that is running whatever thread produced it; and a fork's
progress line and grouped output."""

from __future__ import annotations

import contextvars
import queue
import secrets
import sys
import time
from typing import Any

from IPython.display import clear_output, display, update_display

from . import gate
from .backends import _netproxy
from .backends.base import Event
from .gate import SafeBundle
from .result import ForkResult

PROGRESS_INTERVAL = 0.25


def _notice(line: str) -> None:
    """A Workbench's one-line news, shown in the running cell (output, not an error); a background
    fork's go to its handle instead (``.wait()`` says them, its table keeps them), not under
    whatever cell runs next, where they read as that cell's doing."""
    notes = _BG_NOTES.get()
    if notes is not None:
        notes.append(line)
    else:
        _PENDING.put(("stream", "", Event("stream", "stdout", line + "\n")))


# Events produced on the loop thread, shown on the kernel's main thread (so output lands
# in the cell that is running, whatever thread produced it).
_PENDING: queue.Queue[tuple[str, str, Event]] = queue.Queue()
# the notes of the background fork whose task (and the tasks it made) is running, else None
_BG_NOTES: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("smolbench_bg_notes", default=None)


DRAIN_SLICE = 0.1  # seconds the main thread writes output before it looks at the job again


def _drain(timeout: float) -> None:
    """Show queued events on this thread: runs of text to one stream are written (and
    flushed, one IOPub message) together; a slice of time at most, then back to the caller."""
    try:
        item = _PENDING.get(timeout=timeout) if timeout else _PENDING.get_nowait()
    except queue.Empty:
        return
    deadline = time.monotonic() + DRAIN_SLICE
    run: list[str] = []
    target: Any = None

    def write() -> None:
        if run:
            target.write("".join(run))
            target.flush()
            run.clear()

    while True:
        kind, branch, ev = item
        if kind == "stream":
            stream = sys.stderr if ev.name == "stderr" else sys.stdout
            if stream is not target:
                write()
                target = stream
            if branch:
                run.append(gate.terminal.prefixed(branch, ev.text))
            else:
                run.append(ev.text)
        elif kind == "display" and isinstance(ev.data, SafeBundle) and (ev.data or (ev.display_id and not branch)):
            write()  # ("wake" items only end the wait)
            if branch:
                print(f"[{branch}] display:")
                display(dict(ev.data), raw=True)  # a SafeBundle: checked and sanitised by the gate
            elif ev.display_id is None:
                display(dict(ev.data), raw=True)
            elif ev.update:
                update_display(dict(ev.data), display_id=_DISPLAY_IDS.host(ev.display_id), raw=True)
            else:
                display(dict(ev.data), raw=True, display_id=_DISPLAY_IDS.host(ev.display_id, new=True))
        elif kind == "clear" and not branch:
            write()
            clear_output(wait=ev.wait)
            for note in _NOTES_SHOWN:  # the host's notes about this cell's output outlive the machine's clear
                sys.stderr.write(note)
            sys.stderr.flush()
        if kind == "stream" and ev.note and not branch:
            _NOTES_SHOWN.append(ev.text)
        if time.monotonic() > deadline:
            break
        try:
            item = _PENDING.get_nowait()
        except queue.Empty:
            break
    write()


def show_pending() -> None:
    """Show what is queued now (the notices of a call a line magic made on this thread), in this cell."""
    while not _PENDING.empty():
        _drain(timeout=0)


class _Dropped:
    """Output still queued when Ctrl-C came: dropped (not shown) and counted; the host's own notes
    on it (where output past the limit went, a few at most) are kept, and said after the count."""

    NOTES = 20

    def __init__(self) -> None:
        self.bytes = 0
        self.displays = 0
        self.notes: list[tuple[str, str]] = []  # (branch, text) of the notes kept

    def discard(self) -> None:
        while True:
            try:
                kind, branch, ev = _PENDING.get_nowait()
            except queue.Empty:
                return
            if kind == "stream" and ev.note and len(self.notes) < self.NOTES:
                self.notes.append((branch, ev.text))
            elif kind == "stream":
                self.bytes += len(ev.text.encode("utf-8", "replace"))
            elif kind == "display":
                self.displays += 1

    def say(self) -> None:
        parts = [f"{gate.human(self.bytes)} of output"] if self.bytes else []
        parts += [f"{self.displays:,} displays"] if self.displays else []
        if parts:
            print(f"smolbench: {' and '.join(parts)} after Ctrl-C not shown", file=sys.stderr)
        for branch, text in self.notes:  # e.g. "… 36 MB more output not shown (saved to …)"
            sys.stderr.write(gate.terminal.prefixed(branch, text) if branch else text)
        sys.stderr.flush()


def _show_event(ev: Event) -> None:
    _PENDING.put((ev.kind if ev.kind in ("stream", "clear") else "display", "", ev))


class _DisplayIds:
    """The kernel's display id for each id a machine gave a display (``machine/id``): fresh
    random ones, so a machine's update can only redraw what a machine showed, never the
    host's own displays (a tree view, a progress line). An update redraws the newest display
    with its id (``new``: a display made now, the id's from now on), never every one a machine
    made with it: the gate counts one display's bytes per id. The newest :data:`MAX` are kept."""

    MAX = 4096

    def __init__(self) -> None:
        self._ids: dict[str, str] = {}

    def host(self, machine_id: str, new: bool = False) -> str:
        got = self._ids.pop(machine_id, None)
        if new or got is None:
            got = f"smolbench-machine-{secrets.token_hex(12)}"
        self._ids[machine_id] = got  # (newest last)
        while len(self._ids) > self.MAX:
            del self._ids[next(iter(self._ids))]
        return got


_DISPLAY_IDS = _DisplayIds()
# The gate's notes shown in the running cell: a machine's clear_output must not hide them, so
# they are shown again after it (emptied when a cell starts).
_NOTES_SHOWN: list[str] = []


# the sandbox's egress proxy: its one-line failures show in the running cell
_netproxy.NOTICES[:] = [lambda line: _show_event(Event("stream", "stderr", line + "\n"))]


def _flush_grouped(buffers: dict[str, list[tuple[str, str]]], mode: str) -> None:
    """A fork's output after it ends, each line after its branch's name (a line a branch
    writes can't pass for another's): by branch, or all of stdout and then all of stderr."""
    if mode == "branch":
        for branch in sorted(buffers, key=_branch_key):
            for name, text in buffers[branch]:
                (sys.stderr if name == "stderr" else sys.stdout).write(gate.terminal.prefixed(branch, text))
        return
    for want in ("stdout", "stderr"):
        for branch in sorted(buffers, key=_branch_key):
            text = "".join(t for n, t in buffers[branch] if n == want)
            if text:
                (sys.stderr if want == "stderr" else sys.stdout).write(gate.terminal.prefixed(branch, text))


def _branch_key(branch: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in branch.replace("-", ".").split(".")]


class _Progress:
    """A one-line progress display, updated in place while branches run."""

    def __init__(self, result: ForkResult) -> None:
        self.result = result
        self.handle: Any = None
        self.last = 0.0
        self.text = ""

    def tick(self, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.last < PROGRESS_INTERVAL:
            return
        self.last = now
        done, total = self.result.progress
        counts = self.result.counts()
        running = counts.get("running", 0)
        bits = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()) if k not in ("running", "starting"))
        text = f"{self.result.kind}: {done}/{total} done" + (f", {running} running" if running else "") + (f" ({bits})" if bits else "")
        if text == self.text:
            return
        self.text = text
        if self.handle is None:
            self.handle = display({"text/plain": text}, raw=True, display_id=True)
        else:
            self.handle.update({"text/plain": text}, raw=True)
