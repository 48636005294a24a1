"""The trust gate: the only host code that decodes what a machine sends.

Code in a machine can rewrite its guest agent, so every byte from a machine is
attacker data. Backends only move bytes; they hand the raw reply stream to
:func:`read_cell` or :func:`read_control`, which split it into bounded frames,
decode each as strict UTF-8 JSON, check every field (known names, types, sizes, finite numbers
within ±1e300), sanitise display bundles, rebuild pulled values from data without
running code, and cut floods down to a per-cell budget. Anything else is refused
with one line: ``machine root.3 sent a malformed reply: ...``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..backends.base import CellRequest, CellResult, Event, OnEvent
from ..errors import MachineBusy, MachineLost, SmolbenchError
from . import display, images, pull, terminal
from .display import SafeBundle
from .frames import (
    Bad,
    MalformedReply,
    boolean,
    decode,
    each,
    integer,
    mapping,
    name,
    number,
    opt_string,
    scalar,
    shown,
    split_frames,
    string,
    string_list,
)
from .limits import LIMITS, Limits, human, seconds
from .output import ROW_KEEP, LogPool, OutputBudget, log_folder, log_name

__all__ = ["LIMITS", "ROW_KEEP", "Limits", "LogPool", "MalformedReply", "OutputBudget", "SafeBundle", "human", "log_folder",
           "log_name", "read_cell", "read_control", "seconds"]

TEXT = 1024 * 1024
TRACEBACK = 256 * 1024  # characters of an error's traceback kept (its end)
METRIC_TEXT = 200  # characters of a text metric kept
DISPLAY_ID = 256  # characters of a display's id (IPython's own are 32)
NOTES = 16  # MIME types a cell's notes name one by one (then one note for the rest)
STREAMS = ("stdout", "stderr")
STATUSES = ("ok", "error", "busy")
# A message this big is checked on the gate's own threads, not the event loop: its checks cost
# by the byte (5 MB of styled HTML is ~2 s of cleaning, a branch's whole output budget), and
# the loop serves every other machine and Ctrl-C meanwhile. nh3 and cmark-gfm let go of the
# GIL while they work, so the loop runs beside them.
OFF_LOOP = 256 * 1024  # (an output batch, 64K characters, stays on the loop: a thread hop doubled its cost)
# Displays and results hold markup, whose cleaning costs by its elements more than by its bytes
# (display.MARKUP_ELEMENTS): past this they go to the checkers too (a small one stays: ~1 ms).
MARKUP_OFF_LOOP = 4 * 1024
_CHECKERS = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="smolbench-gate")


def malformed(where: str, why: object) -> MalformedReply:
    """The one line for a reply the host refuses."""
    return MalformedReply(f"machine {where} sent a malformed reply: {why}")


def died(where: str) -> MachineLost:
    """The line for a machine whose reply ended before the cell did: it is gone (the Workbench
    takes it out of the live set, as a machine killed for memory)."""
    return MachineLost(
        f"machine {where} died mid-cell: its process exited before finishing (os._exit, a crash, "
        "out of memory, or the machine was deleted); its state is gone")


async def _messages(chunks: AsyncIterator[bytes]) -> AsyncIterator[tuple[dict[str, Any], int]]:
    """Each frame decoded, with its size in bytes (what a display costs the cell's budget)."""
    async for frame in split_frames(chunks):
        yield decode(frame), len(frame)


def _error(value: Any, key: str) -> dict[str, Any] | None:
    if value is None:
        return None
    err = mapping(value, "the error", 3)
    checks: dict[str, Callable[[Any, str], Any]] = {
        # a name goes inside host lines (a fork's summary): plain text, no escapes or controls
        "ename": lambda v, k: terminal.plain(string(v, "the error name", 200)).replace("\n", " "),
        "evalue": lambda v, k: terminal.kept_to_lines(string(v, "the error message", TEXT)),
        # cut to its end before the terminal handling, which costs by the character (64 MB: 2.6 s)
        "traceback": lambda v, k: _tail([terminal.kept_to_lines(t) for t in _tail(string_list(v, "the traceback", 1000,
                                                                                              64 * 1024))]),
    }
    out = dict(each(checks, err, "the error"))
    out.setdefault("ename", "Error")
    out.setdefault("evalue", "")
    out.setdefault("traceback", [])
    return out


def _tail(lines: list[str]) -> list[str]:
    """A traceback's last :data:`TRACEBACK` characters (its end says what failed): 1,000 lines
    of 64 KiB each were 64 MB a branch, kept by a fork and rendered whole."""
    kept: list[str] = []
    total = 0
    for line in reversed(lines):
        total += len(line)
        if total > TRACEBACK:
            kept.append(f"... ({len(lines) - len(kept)} earlier lines of the traceback not shown: over "
                        f"{TRACEBACK // 1024} KiB)\n")
            break
        kept.append(line)
    return kept[::-1]


def _metrics(value: Any, key: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in mapping(value, "the metrics", 1000).items():
        string(k, "a metric name", 200)
        if v is None:
            out[k] = None
        elif isinstance(v, str):  # kept in the ledger and the tree's state for every node: short
            text = string(v, f"metric {shown(k)}", 1000)
            out[k] = text if len(text) <= METRIC_TEXT else text[:METRIC_TEXT - 1] + "…"
        else:
            out[k] = number(v, f"metric {shown(k)}")
    return out


def _status(value: Any, key: str) -> str:
    if value not in STATUSES:
        raise Bad(f"status should be one of {', '.join(STATUSES)}, got {shown(value)}")
    return str(value)


def _kind(value: Any, key: str) -> str:
    return string(value, "the message type", 20)


class _Cell:
    """One exec request's replies: streams and displays go out as events, ``done`` is checked."""

    def __init__(self, request: CellRequest, on_event: OnEvent | None, where: str, scope: str) -> None:
        self.request = request
        self.on_event = on_event
        self.where = where
        self.scope = scope
        self.budget = request.output if request.output is not None else OutputBudget(None)
        self.noted: set[str] = set()
        self.markdown = display.MarkdownAllowance()  # all of the cell's markdown, rendered by the gate
        # what the images the cell shows may declare in all (a fork's: what all its branches may)
        self.pixels = request.pixels if request.pixels is not None else images.Allowance()
        # of those, what each display id's images take now: of this cell's displays (its newest
        # with that id), and of earlier cells' ones this cell redrew (as OutputBudget's bytes)
        self._pixels_of: dict[str, int] = {}
        self._earlier_pixels: dict[str, int] = {}
        self._loop_thread = threading.get_ident()
        self._held: list[Event] = []  # events made on a checker thread: emitted from the loop
        # what the last clear passed on left: None (none yet), "empty" or "wait" (cleared at the
        # next output); set back to None by anything shown after it
        self._cleared: str | None = None

    def emit(self, ev: Event) -> None:
        if ev.kind != "clear":
            self._cleared = None
        if self.on_event is None:
            return
        if threading.get_ident() != self._loop_thread:
            self._held.append(ev)  # on_event belongs to the loop (queues, widgets)
            return
        self.on_event(ev)

    async def checked(self, handle: Callable[[dict[str, Any], int], Any], msg: dict[str, Any], size: int,
                      off_loop: int = OFF_LOOP) -> Any:
        """``handle(msg, size)``, on a checker thread when the message is over ``off_loop``
        bytes; its events come out on the loop, in order (none after a cancel: the thread's
        work is then dropped)."""
        if size <= off_loop:
            return handle(msg, size)
        got = await asyncio.get_running_loop().run_in_executor(_CHECKERS, handle, msg, size)
        held, self._held = self._held, []
        for ev in held:
            self.emit(ev)
        return got

    def note_dropped(self, dropped: list[display.Dropped]) -> None:
        for item in dropped:
            what = str(item)
            if what in self.noted or len(self.noted) > NOTES:
                continue
            self.noted.add(what)
            if len(self.noted) > NOTES:  # the notes are the host's, outside the cell's budget: a few
                self.emit(Event("stream", "stderr", f"smolbench: {self.where} sent output of more types, which were "
                                "not shown either\n", note=True))
                continue
            if isinstance(item, images.Refused):  # e.g. a tiny PNG whose header says 60,000 x 60,000
                self.emit(Event("stream", "stderr", f"smolbench: {self.where} sent {what}, which was not shown "
                                "(a browser tab decodes an image whole); `%smol trust on` shows machine output raw\n", note=True))
                continue
            if isinstance(item, display.TooMuchMarkup):  # a type that is shown, but not this big
                self.emit(Event("stream", "stderr", f"smolbench: {self.where} sent {what}, which was not shown: "
                                "too many elements to clean (`%smol trust on` shows machine output raw)\n", note=True))
                continue
            self.emit(Event("stream", "stderr", f"smolbench: {self.where} sent {what} output, which was not shown "
                            "(it could run in your browser); `%smol trust on` shows machine output raw\n", note=True))

    def _result_fits(self, result: Any) -> bool:
        """Whether the cell's result (its Out[]) still fits the cell's output, as a display
        would: cleaning it costs the loop time by the byte (2 MB of markdown held it 9 s)."""
        size = sum(len(v) if isinstance(v, str) else 1024 for v in result.values()) if isinstance(result, dict) else 0
        if self.budget.take_display(size):
            return True
        self.budget.hidden_displays -= 1  # said here, not again as one of the displays not shown
        if self.budget.shown_displays >= self.budget.displays:
            why = f"passed its limit of {self.budget.displays:,} displays (`%smol config displays N` raises it)"
        else:
            why = "passed its limit (`%smol config output-limit SIZE` raises it)"
        self.emit(Event("stream", "stderr", f"smolbench: {self.where}'s result was not shown: the cell's output "
                        f"{why}\n", note=True))
        return False

    def stream(self, msg: dict[str, Any], size: int = 0) -> None:
        fields = dict(each({"t": _kind, "name": lambda v, k: string(v, "the stream name", 10),
                            "text": lambda v, k: string(v, "the stream text", LIMITS.max_frame)}, msg, "a stream message"))
        if fields.get("name") not in STREAMS:
            raise Bad(f"a stream named {shown(fields.get('name'))} (stdout or stderr)")
        text = self.budget.take(fields["name"], fields.get("text", ""))
        if text:
            self.emit(Event("stream", fields["name"], terminal.closed(text)))
        past = self.budget.past_note()  # at once, not only when the cell ends (a Ctrl-C, a flood that runs on)
        if past:
            self.emit(Event("stream", "stderr", past, note=True))

    def display(self, msg: dict[str, Any], size: int) -> None:
        known = dict(each({"t": _kind, "data": lambda v, k: v,
                           "id": lambda v, k: string(v, "a display id", DISPLAY_ID),
                           "update": lambda v, k: boolean(v, "a display's update flag")}, msg, "a display message"))
        # a machine's ids are its own: one machine never names what another one showed, nor one
        # of the same name in an earlier session (its MachineRef's token, not only its name)
        ident = f"{self.where}/{self.scope}/{known['id']}" if known.get("id") else None
        update = bool(known.get("update"))
        if update and ident is None:
            raise Bad("an update of a display without its id")
        if not (self.budget.take_update(size, ident) if ident is not None and update else self.budget.take_display(size, ident)):
            return  # counted, not shown (and not worth cleaning)
        taken = images.Tally(self.pixels)
        if update and ident is not None and self.request.pixels is None:  # (a branch's shows as a new display)
            # an update replaces what its display showed (a live plot redraws without end): that
            # goes back to the cell's allowance, and what it shows is taken from it
            here = ident in self._pixels_of
            self.pixels.give_back(self._pixels_of.get(ident, 0) if here else self._earlier_pixels.get(ident, 0))
            data, dropped = display.bundle(known.get("data"), self.request.trust_display, self.markdown, taken)
            (self._pixels_of if here else self._earlier_pixels)[ident] = taken.taken
        else:
            data, dropped = display.bundle(known.get("data"), self.request.trust_display, self.markdown, taken)
            if ident is not None:  # the id's newest display: the one an update redraws
                self._pixels_of[ident] = taken.taken
                self._earlier_pixels.pop(ident, None)
        self.note_dropped(dropped)
        if data or ident is not None:  # (an empty display with an id: a place to update later, as IPython makes)
            self.emit(Event("display", data=SafeBundle(data), display_id=ident, update=update))
        elif not update:
            self.budget.give_back(size)

    def clear(self, msg: dict[str, Any], size: int = 0) -> None:
        known = dict(each({"t": _kind, "wait": lambda v, k: boolean(v, "a clear's wait flag")}, msg, "a clear message"))
        wait = bool(known.get("wait"))
        if self._cleared == "empty" or (self._cleared == "wait" and wait):
            # nothing shown since the last clear: this one would clear nothing (third audit: 2 MB of
            # clears, each passed on, held a cell for minutes and grew the kernel without bound)
            return
        if not self.budget.take_clear():
            return
        self._cleared = "wait" if wait else "empty"
        self.budget.cleared()
        if self.request.pixels is None:  # (a branch's clear is ignored: its images stay shown)
            # the cell's images shown are gone from the page; earlier cells' ones it redrew stay
            self.pixels = images.Allowance(max(0, images.CELL_PIXELS - sum(self._earlier_pixels.values())))
            self._pixels_of.clear()
        self.emit(Event("clear", wait=wait))

    def done(self, msg: dict[str, Any], size: int = 0) -> CellResult:
        checks: dict[str, Callable[[Any, str], Any]] = {
            "t": _kind, "status": _status, "error": _error, "metrics": _metrics,
            "result": lambda v, k: v,
            "pulled": lambda v, k: mapping(v, "the pulled values", 1000),
            "reward": lambda v, k: None if v is None else number(v, "the reward"),
            "reward_error": lambda v, k: opt_string(v, "the reward error", 2000),
            "stdout": lambda v, k: string(v, "the stdout record", TEXT),
            "stderr": lambda v, k: string(v, "the stderr record", TEXT),
            "started": lambda v, k: number(v, "the start time"),
            "ended": lambda v, k: number(v, "the end time"),
        }
        f = dict(each(checks, msg, "the final reply"))
        if f.get("status") == "busy":
            raise MachineBusy(f"machine {self.where} is busy running another cell: wait for it, or interrupt it with Ctrl-C")
        result = None
        if f.get("result") is not None and self._result_fits(f["result"]):
            data, dropped = display.bundle(f["result"], self.request.trust_display, self.markdown, self.pixels)
            self.note_dropped(dropped)
            result = SafeBundle(data) if data else None
        values, pull_error = {}, None
        wanted = set(self.request.pull)
        budget = pull.Budget()  # what the reply's pulled values may build beyond its JSON
        for key, enc in (f.get("pulled") or {}).items():
            if key not in wanted:
                raise Bad(f"a pulled value {shown(key)} that was not asked for")
            try:
                values[key] = pull.pulled(key, enc, self.request.trust_pull, budget)
            except Bad:
                raise
            except SmolbenchError as exc:
                pull_error = pull_error or str(exc)
        metrics = dict(f.get("metrics") or {})
        if f.get("reward_error"):
            metrics["reward_error"] = f["reward_error"]
        # stdout and stderr as the cell showed them (up to its output limit, then where the rest
        # went), not the machine's own record of them: that keeps only their last 64 KiB
        return CellResult(status=f.get("status", "error"), result=result, error=f.get("error"), pulled=values,
                          reward=f.get("reward"), metrics=metrics, stdout=self.budget.text("stdout"),
                          stderr=self.budget.text("stderr"), started=f.get("started", 0.0), ended=f.get("ended", 0.0),
                          pull_error=pull_error, output_log=self.budget.saved_to)


async def read_cell(chunks: AsyncIterator[bytes], request: CellRequest, on_event: OnEvent | None,
                    where: str, *, scope: str) -> CellResult:
    """Read one exec request's raw reply stream: events out, the checked result back.
    ``where``: the machine's name; ``scope``: its :attr:`MachineRef.token`, which its display
    ids are made under (a later session's ``root`` is another machine)."""
    cell = _Cell(request, on_event, where, scope)
    try:
        async for msg, size in _messages(chunks):
            kind = msg.get("t")
            try:
                if kind == "stream":
                    await cell.checked(cell.stream, msg, size)
                elif kind == "display":
                    await cell.checked(cell.display, msg, size, MARKUP_OFF_LOOP)
                elif kind == "clear":
                    await cell.checked(cell.clear, msg, size)
                elif kind == "done":
                    return await cell.checked(cell.done, msg, size, MARKUP_OFF_LOOP)
                else:
                    raise Bad(f"a message of unknown type {shown(kind)}")
            except (Bad, SmolbenchError):
                raise
            except Exception as exc:  # e.g. pandas refusing a hostile column: still one line
                raise Bad(f"a {shown(kind)} message that can't be used ({type(exc).__name__})") from None
    except Bad as exc:
        raise malformed(where, exc) from None
    finally:
        note = cell.budget.finish()
        if note:
            cell.emit(Event("stream", "stderr", note, note=True))
    raise died(where)


def _children(value: Any, key: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or len(value) > 4096:
        raise Bad("children should be a list of at most 4096 branches")
    out = []
    for kid in value:
        kid = dict(each({"name": lambda v, k: name(v, "a branch name"),
                         "pid": lambda v, k: integer(v, "a branch pid", 1, 2**31)}, mapping(kid, "a branch", 2), "a branch"))
        if set(kid) != {"name", "pid"}:
            raise Bad("a branch without its name and pid")
        out.append(kid)
    return out


def _info(value: Any, key: str) -> dict[str, Any]:
    return {string(k, "an info key", 64): scalar(v, f"info {shown(k)}") for k, v in mapping(value, "the info", 64).items()}


def _names(what: str) -> Callable[[Any, str], list[str]]:
    """A save's or load's list of variable names (each with why it failed, for ``skipped``):
    the machine's text, shown in a host line and kept in the ledger, so each is one short
    line with nothing a terminal acts on (a restored namespace's names are its author's)."""
    return lambda v, k: [terminal.one_line(s) for s in string_list(v, what, 100_000, 4096)]


def _control_error(value: Any, key: str) -> dict[str, Any] | None:
    """A control request's error (a save's, a load's, a fork's), which reaches the user only
    inside a host line ("checkpoint x is corrupt: … (ValueError: …)"): its message one line,
    escaped and cut as names are. A shared namespace's pickle raised one of 1 MB, escapes in it."""
    err = _error(value, key)
    if err is not None:
        err["evalue"] = terminal.one_line(err["evalue"], CONTROL_ERROR)
    return err


CONTROL_ERROR = 500  # characters of a control request's error message kept

CONTROL: dict[str, Callable[[Any, str], Any]] = {
    "t": _kind, "status": _status, "error": _control_error, "info": _info,
    "interrupted": lambda v, k: boolean(v, "interrupted"),
    "children": _children,
    "skipped": _names("the skipped list"),  # shown with terminal.listed: the first few, then a count
    "saved": _names("the saved list"),
    "flattened": lambda v, k: string_list(v, "the flattened list", 8, 4096),  # sandbox fork: layers copied
    "leaf": lambda v, k: boolean(v, "leaf"),  # sandbox fork: leaf branches, made by one maker
    "maker": lambda v, k: integer(v, "the maker's pid", 1, 2**31),
}


async def read_control(chunks: AsyncIterator[bytes], where: str) -> dict[str, Any]:
    """Read a control request's raw reply stream (ping, fork, seed, save, ...): its checked ``done``."""
    try:
        async for msg, _ in _messages(chunks):
            if msg.get("t") != "done":
                raise Bad(f"a {shown(msg.get('t'))} message in reply to a control request")
            try:
                reply = dict(each(CONTROL, msg, "the reply"))
            except Bad:
                raise
            except Exception as exc:
                raise Bad(f"a reply that can't be used ({type(exc).__name__})") from None
            if reply.get("status") == "busy":
                raise MachineBusy(f"machine {where} is busy running another cell: wait for it, or interrupt it with Ctrl-C")
            return reply
    except Bad as exc:
        raise malformed(where, exc) from None
    head = f"machine {where} closed the connection without answering: it may have died;"
    raise SmolbenchError(f"{head} `%smol down` and `%smol up`", api=f"{head} `Session.down()` and `Session.up()`")
