"""A cell's output budget: long lines cut, output past a limit saved to a bounded log.

A machine can print without end; the notebook (and the browser behind it) must not
have to hold it. Each cell (each branch of a fork) may show ``LIMITS.output`` bytes;
lines longer than ``LIMITS.line`` characters are cut with a note; past the limit the
rest goes to ``.smolbench/outputs/<node>.log`` (at most ``LIMITS.log`` bytes) and the
cell ends with one line saying how much was not shown and where it went. Displays count
against the same bytes, and at most ``LIMITS.displays`` of them are shown; the rest are
counted (never queued for the notebook, so none can land in a later cell).

What was shown of each stream is also kept (:meth:`OutputBudget.text`): a cell's result
carries it, so a script (``Session.run``, a fork's rows) gets the same output the notebook
shows, with the same closing line where some was held back.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import IO

from .limits import LIMITS, human

SESSION_LOGS = 1000**3  # bytes all of a session's output logs may take together


class LogPool:
    """The bytes all of one session's output logs may still take: each cell's and branch's log
    is at most ``LIMITS.log``, and a fork of 256 branches printing without end wrote 200 MB each."""

    def __init__(self, total: int = SESSION_LOGS) -> None:
        self.left = total
        self._lock = threading.Lock()  # cells' big messages are checked on the gate's threads

    def take(self, wanted: int) -> int:
        """Bytes of ``wanted`` that may still be logged (taken from what is left)."""
        with self._lock:
            got = max(0, min(wanted, self.left))
            self.left -= got
            return got


class OutputBudget:
    """How much of one cell's output is shown; the rest is counted and logged."""

    def __init__(self, log_path: str | os.PathLike[str] | None, *, limit: int | None = None,
                 line: int | None = None, log_limit: int | None = None, displays: int | None = None,
                 pool: LogPool | None = None) -> None:
        self.log_path = Path(log_path) if log_path is not None else None
        self.pool = pool
        self.limit = LIMITS.output if limit is None else limit
        self.line = LIMITS.line if line is None else line
        self.log_limit = LIMITS.log if log_limit is None else log_limit
        self.displays = LIMITS.displays if displays is None else displays
        self.shown = 0
        self.shown_displays = 0
        self.hidden_displays = 0
        self.hidden = 0  # bytes not shown (past the limit)
        self.hidden_in: dict[str, int] = {}  # of those, per stream
        self.logged = 0
        self._shown_text: dict[str, list[str]] = {}  # what was shown, per stream (at most ``limit`` bytes)
        self._col: dict[str, int] = {}  # characters since the last line end, per stream
        self._cut: dict[str, int] = {}  # characters cut from the current line, per stream
        self._log: IO[bytes] | None = None
        # finish() and a checker thread still at a cancelled cell's last message (gate.OFF_LOOP)
        self._log_lock = threading.Lock()
        self._finished = False

    def take(self, name: str, text: str) -> str:
        """The part of ``text`` (written to stream ``name``) that should be shown."""
        if self.shown >= self.limit:
            self._spill(name, text)
            return ""
        text = self._cut_lines(name, text)
        size = len(text.encode("utf-8", "replace"))
        if self.shown + size <= self.limit:
            self.shown += size
            self._shown_text.setdefault(name, []).append(text)
            return text
        room = self.limit - self.shown
        head = text.encode("utf-8", "replace")[:room].decode("utf-8", "ignore")
        nl = head.rfind("\n")
        head = head[: nl + 1] if nl >= 0 else head  # stop at a line end when there is one
        self.shown = self.limit
        self._shown_text.setdefault(name, []).append(head)
        self._spill(name, text[len(head):])
        return head

    def text(self, name: str) -> str:
        """What stream ``name`` showed, and the closing line (where the rest went) when some of
        it was held back."""
        shown = "".join(self._shown_text.get(name, ()))
        if self.hidden_in.get(name):
            shown += self._text_note() or ""
        return shown

    @property
    def saved_to(self) -> str | None:
        """The log's absolute path when it holds some of the cell's output, else None."""
        return str(self.log_path.absolute()) if self.log_path is not None and self.logged else None

    def take_display(self, size: int) -> bool:
        """Whether a display of ``size`` bytes (its reply line) still fits: it counts against
        the same bytes as text, and against the cell's number of displays."""
        if self.shown_displays >= self.displays or self.shown + size > self.limit:
            self.hidden_displays += 1
            return False
        self.shown += size
        self.shown_displays += 1
        return True

    def give_back(self, size: int) -> None:
        """A display that took its room but was not shown after all (nothing in it passed)."""
        self.shown -= size
        self.shown_displays -= 1

    def _cut_lines(self, name: str, text: str) -> str:
        col, cut = self._col.get(name, 0), self._cut.get(name, 0)
        if col + len(text) <= self.line and "\n" not in text and not cut:
            self._col[name] = col + len(text)
            return text
        out = []
        for piece in text.splitlines(True):
            ends = piece.endswith(("\n", "\r"))
            body = piece[:-1] if ends else piece
            keep = max(0, self.line - col)
            if len(body) > keep:
                cut += len(body) - keep
                body = body[:keep]
            col += len(body)
            out.append(body)
            if ends:
                if cut:
                    out.append(f" … [line cut: {cut:,} more characters]")
                out.append(piece[-1])
                col, cut = 0, 0
        self._col[name], self._cut[name] = col, cut
        return "".join(out)

    def _spill(self, name: str, text: str) -> None:
        data = text.encode("utf-8", "replace")
        self.hidden += len(data)
        self.hidden_in[name] = self.hidden_in.get(name, 0) + len(data)
        room = min(len(data), self.log_limit - self.logged)
        if self.log_path is None or room <= 0:
            return
        with self._log_lock:
            if self._finished:  # the log is closed: reopening it ("wb") would empty it
                return
            if self.pool is not None:
                room = self.pool.take(room)
                if room <= 0:
                    return
            if self._log is None:
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in finish()
            part = data[:room]
            self._log.write(part)
            self.logged += len(part)

    def finish(self) -> str | None:
        """The closing note when something was not shown (else None); closes the log."""
        with self._log_lock:
            self._finished = True
            if self._log is not None:
                self._log.close()
                self._log = None
        note = ""
        if self.hidden_displays:
            why = (f"past {self.displays:,} displays in one cell" if self.shown_displays >= self.displays
                   else f"past {human(self.limit)} of output")
            note = (f"… {self.hidden_displays:,} more displays not shown ({why}; `%smol config displays N` "
                    "or `output-limit SIZE` raises the limit)\n")
        text = self._text_note()
        return (note + (text or "")) or None

    def _text_note(self) -> str | None:
        if not self.hidden:
            return None
        if self.log_path is None:
            return f"… {human(self.hidden)} more output not shown\n"
        where = str(self.log_path)
        try:
            where = os.path.relpath(self.log_path)
        except ValueError:
            pass
        if self.logged < self.hidden:
            return (f"… {human(self.hidden)} more output not shown (the first {human(self.logged)} of it "
                    f"saved to {where})\n")
        return f"… {human(self.hidden)} more output not shown (saved to {where})\n"
