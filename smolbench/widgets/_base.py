"""What the tree widget and the checkpoint panel share: observing a Workbench, throttled and
batched trait updates, replies to clicks, and a static copy of the view in every output.

One model per display: each view has its own selection, messages and scope. The frontend
sends nothing to the kernel unless the user acts (a click), so a rendering view never
flips the kernel's status in the frontend while a cell runs.

Threads: the Workbench calls observers from smolbench's loop thread (and sometimes from
the kernel's main thread); clicks arrive on the kernel's main thread, or on a kernel
subshell's thread when the frontend sends comm messages over subshells (JupyterLab and
Notebook 7 with ipykernel >= 7). Every trait write goes through one lock, and every
Workbench call a click makes runs on the smolbench loop. Where clicks reach the kernel only
on its main shell (classic Notebook, VS Code, subshells off), a click made while a cell runs
waits in the kernel's queue; the frontend says so, and the kernel applies it when the cell ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import math
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

import anywidget
import traitlets as t

from .. import _loop
from ..errors import SmolbenchError
from .static import static_output


def view_module(name: str) -> str:
    """A view's ESM: the shared ``viewkit.js`` (element helper, kernel watch), then the view's
    own file. anywidget loads one module per widget, so the shared part is prepended."""
    here = Path(__file__).parent
    return (here / "viewkit.js").read_text() + "\n" + (here / name).read_text()


THROTTLE_S = 0.1  # at most one trait update per view every 100 ms (plus the final state)
BUSY_TEXT = "a cell is running"
# The kernel's views, oldest first. What is busy (a cell running in the kernel, a machine running
# a cell) is sent to the newest live one alone: sent to every view, each cell cost messages in
# proportion to the views above it (41 fork views: 86 messages for a plain Python cell). The
# others' frontends read a running cell from the kernel's status where they see it (tree.js).
_VIEWS: list[weakref.ref[WorkbenchView]] = []
_views_lock = threading.Lock()


def newest_view() -> WorkbenchView | None:
    """The live view made last in this kernel (None: none is live)."""
    with _views_lock:
        _VIEWS[:] = [r for r in _VIEWS if r() is not None]
        for ref in reversed(_VIEWS):
            view = ref()
            if view is not None and not view._closed:
                return view
    return None


def clean(value: Any) -> Any:
    """``value`` as JSON-safe data (NaN and infinities become None; unknown objects repr)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    try:  # numpy scalars and the like
        return clean(value.item())
    except Exception:
        return repr(value)[:200]


def error_text(exc: BaseException) -> str:
    """One line for an exception a click caused."""
    if isinstance(exc, SmolbenchError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}".strip()


class WorkbenchView(anywidget.AnyWidget):
    """Base of smolbench's widgets: kept current by observing a Workbench."""

    busy = t.Unicode("", help="non-empty while a cell runs (clicks may wait for it)").tag(sync=True)
    message = t.Dict({}, help="the last reply to a click: level, text, seq").tag(sync=True)
    jobs = t.List(t.Unicode(), help="background actions still running").tag(sync=True)
    live = t.Bool(True, help="still updated from a running Workbench").tag(sync=True)
    static_id = t.Unicode("", help="names this view's static copy (the output after it)").tag(
        sync=True
    )

    actions: tuple[str, ...] = ()  # what the buttons may ask for
    after_down = "these machines were deleted by `%smol down`"  # said to clicks on a closed view

    def __init__(self, workbench: Any, *, shell: Any = None, **kwargs: Any) -> None:
        self.workbench = workbench
        self._lock = threading.RLock()
        self._ready = False
        kwargs.setdefault("static_id", uuid.uuid4().hex[:16])
        super().__init__(**{**self.snapshot(), **kwargs})  # the comm opens with the full state
        self._last_flush = 0.0
        self._timer_pending = False
        self._seq = 0
        self._futures: list[Future[Any]] = []
        self._closed = False
        self._shell = shell
        self._handles: list[Any] = []  # display handles of the static copies
        self._shown_version = -1
        self._version = 0
        self.on_msg(self._on_custom_msg)
        _route_to_frontend_subshell(self.comm)
        if workbench is not None:
            workbench.observe(self._on_change)
        if shell is not None:
            shell.events.register("pre_run_cell", self._pre_run_cell)
            shell.events.register("post_run_cell", self._post_run_cell)
        with _views_lock:
            _VIEWS.append(weakref.ref(self))
        self._ready = True

    # -- state ---------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The synced traits' values for the Workbench as it is now (subclasses)."""
        raise NotImplementedError

    def static_html(self) -> str:
        """The view as plain HTML, for saved notebooks and viewers without widgets (subclasses)."""
        raise NotImplementedError

    def flush(self, resend: bool = False) -> None:
        """Push the current state to the frontend now, in one batched update.

        ``resend``: send it even where unchanged, from this thread. Updates sent from
        smolbench's loop thread carry whichever cell was current then; a client that files
        comm messages by cell (nbclient, when it records widget state) needs the final state
        sent again during a cell.
        """
        with self._lock:
            self._last_flush = time.monotonic()
            state = self.snapshot()
            with self.hold_sync():
                for key, value in state.items():
                    if getattr(self, key) != value:
                        setattr(self, key, value)
                        self._version += 1
            if resend:
                self.send_state(key=[*state, "live", "busy"])

    def _on_change(self, workbench: Any, nodes: list[Any]) -> None:
        if self._closed or not self.concerns(nodes):
            return
        with self._lock:
            if self._timer_pending:
                return  # a flush is already due; it will read the latest state
            wait = self._last_flush + THROTTLE_S - time.monotonic()
            if wait > 0:
                self._timer_pending = True
                loop = _loop.get_loop()
                loop.call_soon_threadsafe(loop.call_later, wait, self._timer_flush)
                return
        self.flush()

    def concerns(self, nodes: list[Any]) -> bool:
        """Whether a change to ``nodes`` can change this view (subclasses narrow it)."""
        return True

    def _timer_flush(self) -> None:
        with self._lock:
            self._timer_pending = False
        if not self._closed:
            self.flush()

    # -- display: the live view plus a static copy -------------------------------------------

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        """The live view; displayed by hand (not through ``show``) it also carries the static
        copy as text/html, which viewers without widgets show."""
        out = super()._repr_mimebundle_(**kwargs)  # anywidget: (data, metadata)
        data = out[0] if isinstance(out, tuple) else out
        if isinstance(data, dict):
            data["text/plain"] = repr(self)
            if not getattr(self, "_showing", False):
                with contextlib.suppress(Exception):  # a broken static copy must not hide the view
                    data["text/html"] = self.static_html()
        return out

    def show(self) -> None:
        """Display the live view, then its static copy as an output of its own.

        A saved notebook keeps both outputs. JupyterLab and Notebook 7 render a widget output
        whose model is gone as "model not found" (they never fall back to another type in its
        bundle, and don't save widget state by default), so the static copy is a separate
        output whose own CSS shows exactly one of the two: the live view while its model lives
        (it marks itself with ``static_id``), else the static table, hiding the widget
        output just before it. Viewers without that CSS (nbconvert, GitHub) show the table.
        """
        from IPython.display import display

        self._showing = True
        try:
            display(self)
        finally:
            self._showing = False
        handle = display(self._static_bundle(), raw=True, display_id=True)
        if handle is not None:
            self._handles.append(handle)
        self._shown_version = self._version

    def _static_bundle(self) -> dict[str, Any]:
        try:
            body = self.static_html()
        except Exception as exc:  # a broken static copy must not hide the view
            body = f"<p>static copy unavailable: {html.escape(error_text(exc))}</p>"
        try:
            text = self.static_text()
        except Exception:
            text = repr(self)
        return {"text/html": static_output(self.static_id, body), "text/plain": text}

    def static_text(self) -> str:
        """The static copy as text (viewers that show text only); subclasses may say more."""
        return repr(self)

    def refresh_static(self) -> None:
        """Re-send the displayed static copies so they match the live state.

        Called on the kernel's main thread at the end of a cell (the output then belongs to
        a known cell); a saved notebook keeps this copy.
        """
        if self._shown_version == self._version:
            return
        self.flush(resend=True)
        self._shown_version = self._version
        bundle = self._static_bundle()
        for handle in self._handles:
            with contextlib.suppress(Exception):
                handle.update(bundle, raw=True)

    # -- cells running in the kernel -----------------------------------------------------

    def shows_busy(self) -> bool:
        """Whether this view is the one told what is busy (the newest live view)."""
        return newest_view() is self

    def _pre_run_cell(self, info: Any = None) -> None:
        if not self._closed and self.shows_busy():
            with self._lock:
                self.busy = BUSY_TEXT

    def _post_run_cell(self, result: Any = None) -> None:
        with self._lock:
            self.busy = ""
        if not self._closed:
            self.flush()
        self.refresh_static()

    # -- clicks ----------------------------------------------------------------------------

    def _handle_msg(self, msg: dict[str, Any]) -> None:
        # Frontend messages may be handled on a subshell thread while the loop thread flushes.
        with self._lock:
            super()._handle_msg(msg)

    def _on_custom_msg(self, widget: Any, content: Any, buffers: Any = None) -> None:
        if not isinstance(content, dict):
            return
        if content.get("type") == "scope":
            self.on_scope(content)
            return
        if content.get("type") != "action":
            return
        request = str(content.get("id", ""))
        with contextlib.suppress(Exception):  # the frontend stops saying "waiting for the kernel"
            self.send({"type": "ack", "id": request})
        action = str(content.get("action", ""))
        if action not in self.actions:
            self.reply(request, "error", f"unknown action {action!r}: one of {', '.join(self.actions)}")
            return
        if self._closed:
            self.reply(request, "error", self.after_down)
            return
        try:
            self.handle_action(action, content, request)
        except Exception as exc:
            self.reply(request, "error", error_text(exc))

    def on_scope(self, content: dict[str, Any]) -> None:
        """The frontend asked for a different scope (subclasses)."""

    def handle_action(self, action: str, content: dict[str, Any], request: str) -> None:
        """Act on one click (subclasses)."""
        raise NotImplementedError

    def reply(self, request: str, level: str, text: str) -> None:
        """Show ``text`` in the widget (level: info, ok or error) and answer the click."""
        with self._lock:
            self._seq += 1
            self.message = {"level": level, "text": text, "seq": self._seq, "request": request}
        with contextlib.suppress(Exception):
            self.send({"type": "reply", "id": request, "level": level, "text": text})

    def run_async(
        self,
        request: str,
        coro: Coroutine[Any, Any, Any],
        done: Callable[[Any], str],
        level: Callable[[Any], str] | None = None,
    ) -> Future[Any]:
        """Run ``coro`` on the smolbench loop; reply with ``done(result)`` or the error."""

        async def wrapped() -> Any:
            try:
                value = await coro
            except asyncio.CancelledError:
                self.reply(request, "error", "cancelled")
                raise
            except Exception as exc:
                self.reply(request, "error", error_text(exc))
                return None
            try:
                text, lvl = done(value), (level(value) if level is not None else "ok")
            except Exception as exc:
                text, lvl = error_text(exc), "error"
            self.flush()
            self.reply(request, lvl, text)
            return value

        fut = _loop.submit(wrapped())
        with self._lock:
            self._futures = [f for f in self._futures if not f.done()] + [fut]
        return fut

    def track(self, fut: Future[Any], label: str) -> None:
        """Show ``label`` among the running jobs until ``fut`` finishes."""
        with self._lock:
            self.jobs = [*self.jobs, label]
            self._futures = [f for f in self._futures if not f.done()] + [fut]

        def finished(_: Future[Any]) -> None:
            with self._lock:
                jobs = list(self.jobs)
                if label in jobs:
                    jobs.remove(label)
                self.jobs = jobs

        fut.add_done_callback(finished)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every action started from the widget finished; False on timeout."""
        with self._lock:
            pending = list(self._futures)
        _, not_done = wait_futures(pending, timeout)
        return not not_done

    # -- lifecycle ---------------------------------------------------------------------------

    def detach(self) -> None:
        """Stop observing (the Workbench went down); the last state stays on screen."""
        if self._closed:
            return
        self._closed = True
        if self.workbench is not None:
            self.workbench.unobserve(self._on_change)
        with self._lock:
            self.busy = ""
            self.live = False
        self.flush(resend=True)
        self._version += 1
        if self._shell is not None:
            for event, fn in (("pre_run_cell", self._pre_run_cell),):
                with contextlib.suppress(ValueError):
                    self._shell.events.unregister(event, fn)
            # post_run_cell stays until the static copy shows the final state once
            self._shell.events.register("post_run_cell", self._final_refresh)

    def _final_refresh(self, result: Any = None) -> None:
        self.refresh_static()
        if self._shell is not None:
            for fn in (self._post_run_cell, self._final_refresh):
                with contextlib.suppress(ValueError):
                    self._shell.events.unregister("post_run_cell", fn)


def _route_to_frontend_subshell(comm: Any) -> None:
    """Let clicks reach us while a cell runs, when the frontend sends comms over a subshell.

    JupyterLab and Notebook 7 (setting "Kernel Comms over subshells") send widget messages
    on a kernel subshell, so ipykernel (>= 7) can handle them on another thread while the
    main shell runs a cell. ipykernel 7.4 instead routes a comm's incoming messages to the
    shell that last *published* on it, which for us is the cell that started a fork, so
    clicks would queue behind it. Our handlers are thread-safe (one lock; Workbench calls go
    to the smolbench loop), so for our own comm we take the subshell the frontend asked for.
    """
    if comm is not None and callable(getattr(comm, "_reply_subshell_for", None)):
        comm._reply_subshell_for = lambda data, default: default
