"""A cell's output budget: long lines cut, output past a limit saved to a bounded log.

A machine can print without end; the notebook (and the browser behind it) must not
have to hold it. Each cell (each branch of a fork) may show ``LIMITS.output`` bytes;
lines longer than ``LIMITS.line`` characters are cut with a note; past the limit the
rest goes to ``.smolbench/outputs/<node>-<session id>.log`` (:func:`log_folder`, :func:`log_name`;
at most ``LIMITS.log`` bytes; all logs of this ledger's sessions in the folder at most
``SESSION_LOGS``, other sessions' oldest idle ones going first; only names of smolbench's own
log grammar, :data:`LOG_NAME`, of sessions the ledger lists in smolbench's own session-id
format, are counted or removed, never another file there) and the
cell ends with one line saying how much was not shown and where it went. Displays count
against the same bytes, and at most ``LIMITS.displays`` of them are shown; the rest are
counted (never queued for the notebook, so none can land in a later cell). The log is written
only as a plain file in plain folders: where a link (or a fifo) stands instead, the rest is not
saved and the closing line says why.

What was shown of each stream is also kept (:meth:`OutputBudget.text`): a cell's result
carries it, so a script (``Session.run``) gets the same output the notebook shows, with the
same closing line where some was held back. A branch of a fork keeps only the last
``keep`` characters of each stream (:data:`ROW_KEEP`): its row lives as long as the session,
and a fork of 1,024 branches keeping 5 MB each held 5 GB. Once a branch prints more than
that, all of its output (shown or not) goes to its log, and its row ends with one line
saying so.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

from .._ledgerfiles import linked_part
from .archive import NODE_RE
from .limits import LIMITS, human

SESSION_LOGS = 1000**3  # bytes all output logs in one folder may take together (see LogPool)
# A cell that clears its output and draws again (a live plot) may redraw this many times its
# output limit in all (100 MB at the default 5 MB): each display is cleaned by the gate and
# sent to the browser, so a loop that redraws for ever must end somewhere too.
REDRAWS = 20
CLEARS = 10_000  # clears passed on per cell, at most (each makes the page clear and the magics redraw their notes)
ROW_KEEP = 64 * 1024  # characters of each stream a fork's or episodes' row (and its tree node) keeps

# A session's id as Workbench makes it (when it started, then 6 random hex digits). A ledger's
# ids are its author's strings (a copied folder's ledger.db): only ids of this form name logs.
SESSION_ID = re.compile(r"[0-9]{8}-[0-9]{6}-[0-9a-f]{6}", re.ASCII)
# The whole name of an output log (:func:`log_name`), its node's name as the tree makes them
# (``root.7.2``, ``r1-warm``, ``fresh1``: archive.NODE_RE): nothing else is ever counted or removed
LOG_NAME = re.compile(rf"{NODE_RE.pattern}(?:\.cell[0-9]{{1,9}})?-(?P<session>{SESSION_ID.pattern})\.log", re.ASCII)


def log_name(node_id: str, tag: str, session: str) -> str:
    """The log of node ``node_id``'s output past the limit (``tag``: ``.cellN`` for a cell, ""
    for a fork's branch), named with the whole session id: with only its last 6 hex digits two
    sessions of a folder drawing the same had one's ``root.cell1`` empty the other's."""
    return f"{node_id}{tag}-{session}.log"


def log_folder(ledger: Path) -> Path:
    """Where the output logs of the ledger at ``ledger`` go: a folder smolbench owns, never a
    plain ``outputs/`` of the user's (``Session(ledger="ledger.db")`` put them in ``./outputs``,
    whose files a copied ledger could then have removed). ``outputs`` inside ``.smolbench``
    beside the default ``.smolbench/ledger.db``; for any other ledger, a folder named after its
    file beside it (``runs/ledger.db`` -> ``runs/ledger.db.outputs``): one ledger, one folder."""
    if ledger.name == "ledger.db" and ledger.parent.name == ".smolbench":
        return ledger.parent / "outputs"
    return ledger.with_name(ledger.name + ".outputs")


class LogPool:
    """The bytes the output logs in one folder may still take: each cell's and branch's log is
    at most ``LIMITS.log``, and a fork of 256 branches printing without end wrote 200 MB each.
    ``folder``: what other sessions' logs there take counts too (each session started with a
    fresh 1 GB, so a long-used folder grew without end); when this session's logs need the
    room, the oldest of theirs go first, once untouched for ``IDLE`` seconds (a live kernel
    beside this one may still be writing a recent one). ``mine``: this session's id (its own
    logs are counted as they are taken). ``sessions``: the ids of the ledger's sessions, whose
    logs these are; a file is theirs only when its whole name is of :data:`LOG_NAME` with one of
    these ids, and the id is of :data:`SESSION_ID`'s form (a copied ledger's ids are its
    author's strings: one ending ``-epoch1`` had the user's ``train-epoch1.log`` removed)."""

    IDLE = 600.0
    SCAN = 10_000  # log files looked at, at most (a copied folder may hold any number)

    def __init__(self, total: int = SESSION_LOGS, folder: Path | None = None, mine: str = "",
                 sessions: Callable[[], Iterable[str]] = tuple) -> None:
        self.total = total
        self.left = total
        self.folder = folder
        self.mine = mine
        # the sessions whose logs these are: any other file there is never counted nor removed
        self._sessions = sessions
        self._looked = -1.0  # when the folder was last looked at (monotonic), if ever
        self._lock = threading.Lock()  # cells' big messages are checked on the gate's threads

    def take(self, wanted: int) -> int:
        """Bytes of ``wanted`` that may still be logged (taken from what is left)."""
        with self._lock:
            if self.folder is not None and (self._looked < 0 or (wanted > self.left and time.monotonic() - self._looked > 10)):
                self._look(wanted)
            got = max(0, min(wanted, self.left))
            self.left -= got
            return got

    def _look(self, wanted: int) -> None:
        """Count the folder's other logs (plain files only, by their blocks: holes cost nothing)
        against the total, and remove the oldest idle ones until ``wanted`` fits."""
        first = self._looked < 0
        self._looked = time.monotonic()
        assert self.folder is not None
        if linked_part(self.folder, beside=()) is not None:
            return  # a link for the folder (or its own): never looked in, the log's own open says why
        try:
            fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return  # none yet, or not a plain folder: the log's own open says so
        try:
            theirs = []
            try:
                known = {sid for sid in self._sessions() if isinstance(sid, str) and SESSION_ID.fullmatch(sid)}
            except Exception:  # (a ledger closed meanwhile: nothing of others' is counted)
                known = set()
            known.discard(self.mine)
            with os.scandir(fd) as entries:
                for n, entry in enumerate(entries):
                    if n >= self.SCAN:
                        break
                    log = LOG_NAME.fullmatch(entry.name)
                    if log is None or log["session"] not in known:
                        continue
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        theirs.append((st.st_mtime, entry.name, st.st_blocks * 512))
            used = sum(size for _, _, size in theirs)
            if first:
                self.left -= used
            theirs.sort()
            now = time.time()
            for mtime, name, size in theirs:
                if self.left >= wanted or now - mtime < self.IDLE:
                    break
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=fd)  # (a link is removed, never followed)
                    self.left += size
        finally:
            os.close(fd)


class OutputBudget:
    """How much of one cell's output is shown; the rest is counted and logged."""

    def __init__(self, log_path: str | os.PathLike[str] | None, *, limit: int | None = None,
                 line: int | None = None, log_limit: int | None = None, displays: int | None = None,
                 pool: LogPool | None = None, keep: int | None = None) -> None:
        self.log_path = Path(log_path) if log_path is not None else None
        self.pool = pool
        self.limit = LIMITS.output if limit is None else limit
        self.line = LIMITS.line if line is None else line
        self.log_limit = LIMITS.log if log_limit is None else log_limit
        self.displays = LIMITS.displays if displays is None else displays
        self.shown = 0
        self.shown_displays = 0
        self.hidden_displays = 0
        self._display_bytes = 0  # of ``shown``, the displays' (a clear gives them back)
        # of ``shown``, what each display id shows now: of this cell's displays (its newest with
        # that id), and of earlier cells' ones this cell redrew (not this cell's to clear)
        self._ids: dict[str, int] = {}
        self._earlier: dict[str, int] = {}
        self.redrawn = 0  # bytes of every display and update shown, cleared or not (bounded: REDRAWS)
        self.clears = 0  # clears the cell sent that would clear something (bounded: CLEARS)
        self._hidden_why = ""  # why the first display not shown was not: "displays", "redraws" or "output"
        self.hidden = 0  # bytes not shown (past the limit)
        self.hidden_in: dict[str, int] = {}  # of those, per stream
        self.logged = 0  # bytes written to the log
        self.logged_hidden = 0  # of those, bytes that were not shown
        self.keep = keep  # characters of each stream's shown text kept for the result (None: all of it)
        self._shown_text: dict[str, list[str]] = {}  # what was shown, per stream (at most ``limit`` bytes, or its tail)
        self._shown_chars: dict[str, int] = {}  # characters shown, per stream
        self._kept_chars: dict[str, int] = {}  # characters in _shown_text, per stream
        self._shown_bytes = 0  # of all streams' text (displays not counted)
        # with ``keep``: what was shown so far, in order, until the log takes all of the output
        self._pending: list[bytes] | None = [] if keep is not None else None
        self._col: dict[str, int] = {}  # characters since the last line end, per stream
        self._cut: dict[str, int] = {}  # characters cut from the current line, per stream
        self._log: IO[bytes] | None = None
        self.not_saved: str | None = None  # why the log was not written (a link where it goes), if so
        # finish() and a checker thread still at a cancelled cell's last message (gate.OFF_LOOP)
        self._log_lock = threading.Lock()
        self._finished = False
        self._said_past = False  # past_note() said it

    def take(self, name: str, text: str) -> str:
        """The part of ``text`` (written to stream ``name``) that should be shown."""
        if self.shown >= self.limit:
            self._spill(name, text)
            return ""
        text = self._cut_lines(name, text)
        size = len(text.encode("utf-8", "replace"))
        if self.shown + size <= self.limit:
            self.shown += size
            self._keep(name, text)
            return text
        room = self.limit - self.shown
        head = text.encode("utf-8", "replace")[:room].decode("utf-8", "ignore")
        nl = head.rfind("\n")
        head = head[: nl + 1] if nl >= 0 else head  # stop at a line end when there is one
        self.shown = self.limit
        self._keep(name, head)
        self._spill(name, text[len(head):])
        return head

    def past_note(self) -> str | None:
        """Once, when output first went past the limit: one line, at once, saying where the rest
        goes (the cell's closing line says how much went there)."""
        if self._said_past or not self.hidden:
            return None
        self._said_past = True
        past = f"smolbench: output past {human(self.limit)}"
        raise_it = "`%smol config output-limit SIZE` raises it"
        if self.log_path is None:
            return f"{past} is not shown; {raise_it}\n"
        if self.not_saved is not None and not self.logged:
            return f"{past} is not shown (not saved: {self.not_saved}); {raise_it}\n"
        return f"{past} goes to {_where(self.log_path)}; {raise_it}\n"

    def text(self, name: str) -> str:
        """What stream ``name`` showed (with ``keep``: its last ``keep`` characters, from a
        line's start), and the closing line (where the rest went) when some of it was held back."""
        shown = "".join(self._shown_text.get(name, ()))
        cut = self.keep is not None and self._shown_chars.get(name, 0) > self.keep
        if cut:
            shown = shown[-(self.keep or 0):]
            nl = shown.find("\n")
            if 0 <= nl < len(shown) - 1:
                shown = shown[nl + 1:]
        if cut or self.hidden_in.get(name):
            shown += self._text_note(len(shown.encode("utf-8", "replace")) if cut else None) or ""
        return shown

    def _keep(self, name: str, text: str) -> None:
        if not text:
            return
        parts = self._shown_text.setdefault(name, [])
        parts.append(text)
        self._shown_chars[name] = self._shown_chars.get(name, 0) + len(text)
        if self.keep is None:
            return
        data = text.encode("utf-8", "replace")
        self._shown_bytes += len(data)
        self._kept_chars[name] = self._kept_chars.get(name, 0) + len(text)
        if self._kept_chars[name] > 2 * self.keep:  # its tail only (cut now and then, not at every message)
            parts[:] = ["".join(parts)[-self.keep:]]
            self._kept_chars[name] = len(parts[0])
        if self._pending is not None and self._shown_chars[name] <= self.keep:
            self._pending.append(data)
        else:  # more than the result keeps: the log takes all of the output from now on
            self._to_log(data)

    @property
    def saved_to(self) -> str | None:
        """The log's absolute path when it holds some of the cell's output, else None."""
        return str(self.log_path.absolute()) if self.log_path is not None and self.logged else None

    def take_display(self, size: int, ident: str | None = None) -> bool:
        """Whether a display of ``size`` bytes (its reply line) still fits: it counts against
        the same bytes as text, and against the cell's number of displays. ``ident``: its
        display id (a later update of it replaces these bytes)."""
        if self.shown_displays >= self.displays:
            return self._refused("displays")
        if self.shown + size > self.limit:
            return self._refused("output")
        if not self._redraws(size):
            return self._refused("redraws")
        self.shown += size
        self._display_bytes += size
        self.shown_displays += 1
        self.redrawn += size
        if ident is not None:  # the id's newest display: the one an update redraws (an older one stays as it is)
            self._ids[ident] = size
            self._earlier.pop(ident, None)
        return True

    def take_update(self, size: int, ident: str) -> bool:
        """Whether an update of the display with id ``ident`` to ``size`` bytes still fits: it
        replaces what that display showed, and what is then shown counts against the limit as a
        display does. One shown in an earlier cell (its size unknown here) counts in full in this
        cell, as a new display would, and a clear here leaves it counted. Every byte redrawn
        counts too (:data:`REDRAWS`)."""
        here = ident in self._ids
        old = self._ids[ident] if here else self._earlier.get(ident, 0)
        if self.shown - old + size > self.limit:
            return self._refused("output")
        if not self._redraws(size):
            return self._refused("redraws")
        self.shown += size - old
        self.redrawn += size
        if here:
            self._ids[ident] = size
            self._display_bytes += size - old
        else:
            self._earlier[ident] = size
        return True

    def _refused(self, why: str) -> bool:
        self.hidden_displays += 1
        self._hidden_why = self._hidden_why or why
        return False

    def _redraws(self, size: int) -> bool:
        return self.redrawn + size <= REDRAWS * self.limit

    def take_clear(self) -> bool:
        """Whether a clear may still be passed on: at most :data:`CLEARS` a cell, so a loop of
        clears ends somewhere too (third audit); past them a live plot's frames pile up, and the
        displays a cell shows bound them."""
        self.clears += 1
        return self.clears <= CLEARS

    def cleared(self) -> None:
        """The cell's output was cleared (``clear_output``): its displays' room is free again.
        Text keeps its count (what was printed is logged past the limit as before), what this
        cell redrew of earlier cells' displays is still shown, and what was redrawn in all stays
        bounded, so a loop that clears and draws ends somewhere."""
        self.shown -= self._display_bytes
        self._display_bytes = 0
        self.shown_displays = 0
        self._ids.clear()

    def give_back(self, size: int) -> None:
        """A display (without an id) that took its room but was not shown after all (nothing in it passed)."""
        self.shown -= size
        self._display_bytes -= size
        self.shown_displays -= 1
        self.redrawn -= size

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
        self.logged_hidden += self._to_log(data)

    def _to_log(self, data: bytes) -> int:
        """Bytes of ``data`` written to the log (with ``keep``: after what was shown before it)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            for piece in pending:
                self._to_log(piece)
        room = min(len(data), self.log_limit - self.logged)
        if self.log_path is None or room <= 0:
            return 0
        with self._log_lock:
            if self._finished or self.not_saved is not None:  # closed: reopening it would empty it
                return 0
            if self.pool is not None:
                room = self.pool.take(room)
                if room <= 0:
                    if not self.logged:  # else the closing line says how much of it was saved
                        self.not_saved = (f"the output logs in {_where(self.log_path.parent)} already take "
                                          f"{human(self.pool.total)}: delete old ones there")
                    return 0
            if self._log is None:
                try:
                    self._log = _open_log(self.log_path)
                except _NotSaved as exc:
                    self.not_saved = str(exc)
                    return 0
            part = data[:room]
            self._log.write(part)
            self.logged += len(part)
            return len(part)

    def finish(self) -> str | None:
        """The closing note when something was not shown (else None); closes the log."""
        with self._log_lock:
            self._finished = True
            if self._log is not None:
                self._log.close()
                self._log = None
        note = ""
        if self.hidden_displays:
            why = (f"past {self.displays:,} displays in one cell" if self._hidden_why == "displays"
                   else f"past {human(REDRAWS * self.limit)} of displays drawn and redrawn in one cell"
                   if self._hidden_why == "redraws" else f"past {human(self.limit)} of output")
            note = (f"… {self.hidden_displays:,} more displays not shown ({why}; `%smol config displays N` "
                    "or `%smol config output-limit SIZE` raises the limit)\n")
        text = self._text_note()
        return (note + (text or "")) or None

    def _text_note(self, kept: int | None = None) -> str | None:
        """The closing line: how much was not shown (``kept``: and that only the last ``kept``
        bytes of what was shown are kept), and where the rest went."""
        if not self.hidden and kept is None:
            return None
        said = []
        if self.hidden:
            said.append(f"{human(self.hidden)} more output not shown")
        if kept is not None:
            said.append(f"only the last {human(kept)} of {'what was shown' if self.hidden else 'it'} kept here")
        line = "… " + ", and ".join(said)
        if self.log_path is None:
            return line + "\n"
        if self.not_saved is not None and not self.logged:
            return f"{line} (not saved: {self.not_saved})\n"
        where = _where(self.log_path)
        if self.keep is not None and (self.logged_hidden < self.hidden or self.logged < self._shown_bytes + self.hidden):
            return f"{line} (the first {human(self.logged)} of all of it saved to {where})\n"
        if self.keep is not None:
            return f"{line} (all of it saved to {where})\n"
        if self.logged < self.hidden:
            return f"{line} (the first {human(self.logged)} of it saved to {where})\n"
        return f"{line} (saved to {where})\n"


class _NotSaved(Exception):
    """Why a cell's log can't be written where it should go (its message: one clause)."""


def _where(path: Path) -> str:
    try:
        return os.path.relpath(path)
    except ValueError:
        return str(path)


def _why(path: Path, exc: OSError, folder: int | None) -> str:
    """Why the log (or a folder on its way) could not be opened, in one clause."""
    try:  # a fifo without a reader (ENXIO), a link made since the check (ELOOP), …
        mode = os.stat(path.name, dir_fd=folder, follow_symlinks=False).st_mode if folder is not None else None
    except OSError:
        mode = None
    if mode is not None and stat.S_ISLNK(mode):
        return f"{_where(path)} is a symbolic link: move the link aside"
    if mode is not None and not stat.S_ISREG(mode):
        return f"{_where(path)} is not a plain file: move it aside"
    return f"can't write {_where(path)} ({exc.strerror or exc}): move what is there aside"


def _open_log(path: Path) -> IO[bytes]:
    """``path`` emptied and opened for writing, only as a plain file in a plain folder.

    A copied folder is untrusted: its ``.smolbench/outputs/root.cell3.log -> ~/.bashrc`` (or an
    ``outputs`` or ``.smolbench`` that links elsewhere) had that file emptied and filled with
    what a machine printed. Links are refused as the ledger refuses them (:func:`linked_part`),
    and the folders and the file are then opened without following any (so a link made in
    between is refused too); a fifo or anything else that is not a plain file of its own is left
    as it is (a fifo without a reader would have blocked the cell)."""
    folder = path.parent
    linked = linked_part(folder, beside=())
    if linked is None and path.is_symlink():
        linked = path
    if linked is not None:
        try:
            to = f" (to {os.readlink(linked)})"
        except OSError:
            to = ""
        raise _NotSaved(f"{_where(linked)} is a symbolic link{to}: move the link aside")
    if not folder.parent.is_dir():
        folder.parent.mkdir(parents=True, exist_ok=True)
    nofollow = os.O_NOFOLLOW | os.O_CLOEXEC
    fds: list[int] = []
    try:
        try:
            fds.append(os.open(folder.parent, os.O_RDONLY | os.O_DIRECTORY | nofollow))
            try:
                os.mkdir(folder.name, 0o700, dir_fd=fds[-1])
            except FileExistsError:
                pass
            fds.append(os.open(folder.name, os.O_RDONLY | os.O_DIRECTORY | nofollow, dir_fd=fds[-1]))
            # O_NONBLOCK: a fifo opens at once (or fails), it never waits for a reader; not
            # O_TRUNC yet: a file that is not this log alone is refused before it is emptied
            fd = os.open(path.name, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | nofollow, 0o600, dir_fd=fds[-1])
        except OSError as exc:
            raise _NotSaved(_why(path, exc, fds[1] if len(fds) == 2 else None)) from None
        fds.append(fd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            what = "has other names (hard links)" if stat.S_ISREG(st.st_mode) else "is not a plain file"
            raise _NotSaved(f"{_where(path)} {what}: move it aside")
        os.ftruncate(fd, 0)
        os.set_blocking(fd, True)
        log = os.fdopen(fd, "wb")
        fds.pop()
        return log
    finally:
        for f in fds:
            os.close(f)
