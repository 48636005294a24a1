"""What the tree widget and the checkpoint panel share: observing a Workbench, throttled and
batched trait updates, the "a cell is running" notice, and replies to clicks.

Threads: the Workbench calls observers from smolbench's loop thread (and sometimes from
the kernel's main thread); clicks arrive on the kernel's main thread, or on a kernel
subshell's thread when the frontend sends comm messages over subshells (JupyterLab >= 4.4
with ipykernel >= 7). Every trait write goes through one lock, and every Workbench call a
click makes runs on the smolbench loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any, TypeVar

import anywidget
import traitlets as t

from .. import _loop
from ..errors import SmolbenchError

THROTTLE_S = 0.1  # at most one trait update per view every 100 ms (plus the final state)
BUSY_TEXT = "a cell is running: clicks will apply when it finishes"


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
    """Base of smolbench's widgets: one model per Workbench, kept current by observing it."""

    busy = t.Unicode("", help="non-empty while a cell blocks the kernel").tag(sync=True)
    message = t.Dict({}, help="the last reply to a click: level, text, seq").tag(sync=True)
    jobs = t.List(t.Unicode(), help="background actions still running").tag(sync=True)

    actions: tuple[str, ...] = ()  # what the buttons may ask for
    after_down = "these machines were deleted by `%smol down`"  # said to clicks on a closed view

    def __init__(self, workbench: Any, *, shell: Any = None, **kwargs: Any) -> None:
        self.workbench = workbench
        self._lock = threading.RLock()
        super().__init__(**{**self.snapshot(), **kwargs})  # the comm opens with the full state
        self.live_clicks = False  # the frontend's messages reach us on a subshell's thread
        self._last_flush = 0.0
        self._timer_pending = False
        self._seq = 0
        self._futures: list[Future[Any]] = []
        self._closed = False
        self._shell = shell
        self._main = threading.main_thread()
        self.on_msg(self._on_custom_msg)
        _route_to_frontend_subshell(self.comm)
        workbench.observe(self._on_change)
        if shell is not None:
            shell.events.register("pre_run_cell", self._pre_run_cell)
            shell.events.register("post_run_cell", self._post_run_cell)
        self.flush()

    # -- state ---------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The synced traits' values for the Workbench as it is now (subclasses)."""
        raise NotImplementedError

    def flush(self) -> None:
        """Push the current state to the frontend now, in one batched update."""
        with self._lock:
            self._last_flush = time.monotonic()
            state = self.snapshot()
            with self.hold_sync():
                for key, value in state.items():
                    setattr(self, key, value)

    def _on_change(self, workbench: Any, nodes: list[Any]) -> None:
        if self._closed:
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

    def _timer_flush(self) -> None:
        with self._lock:
            self._timer_pending = False
        if not self._closed:
            self.flush()

    # -- the busy notice -------------------------------------------------------------------

    def mark_busy(self, text: str = BUSY_TEXT) -> None:
        """Say in the widget that a cell is running (so clicks wait for it)."""
        if self._closed or self.live_clicks:
            return  # clicks reach us through a subshell: no need to warn
        with self._lock:
            self.busy = text

    def clear_busy(self) -> None:
        """The kernel is free again: final state, no notice."""
        with self._lock:
            self.busy = ""
        if not self._closed:
            self.flush()

    def _pre_run_cell(self, info: Any = None) -> None:
        self.mark_busy()

    def _post_run_cell(self, result: Any = None) -> None:
        self.clear_busy()

    # -- clicks ----------------------------------------------------------------------------

    def _handle_msg(self, msg: dict[str, Any]) -> None:
        # Frontend messages may be handled on a subshell thread while the loop thread flushes.
        with self._lock:
            super()._handle_msg(msg)

    def _on_custom_msg(self, widget: Any, content: Any, buffers: Any = None) -> None:
        if not isinstance(content, dict):
            return
        # A message handled off the main thread came through a kernel subshell: this frontend's
        # clicks reach us even while a cell runs, so the busy notice would be wrong. Every view
        # says "hello" when it renders, so we know before the first click.
        live = threading.current_thread() is not self._main
        if live != self.live_clicks:
            self.live_clicks = live
            if live:
                with self._lock:
                    self.busy = ""
        if content.get("type") != "action":
            return
        request = str(content.get("id", ""))
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
            self.reply(request, lvl, text)
            self.flush()
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
        self.flush()
        self._closed = True
        self.workbench.unobserve(self._on_change)
        if self._shell is not None:
            for event, fn in (
                ("pre_run_cell", self._pre_run_cell),
                ("post_run_cell", self._post_run_cell),
            ):
                with contextlib.suppress(ValueError):
                    self._shell.events.unregister(event, fn)
        with self._lock:
            self.busy = ""


V = TypeVar("V", bound="WorkbenchView")


def view_for(registry: dict[int, V], cls: type[V], workbench: Any, shell: Any = None) -> tuple[V, bool]:
    """The Workbench's one ``cls`` view in ``registry`` (made on first use); True when new."""
    w = registry.get(id(workbench))
    if w is not None and w.workbench is workbench and not w._closed:
        return w, False
    if shell is None:
        with contextlib.suppress(Exception):
            from IPython import get_ipython

            shell = get_ipython()
    w = cls(workbench, shell=shell)
    registry[id(workbench)] = w
    return w, True


def close_view(registry: dict[int, V], workbench: Any) -> None:
    """Detach the Workbench's view in ``registry``; it keeps its last state."""
    w = registry.pop(id(workbench), None)
    if w is not None:
        w.detach()


def _route_to_frontend_subshell(comm: Any) -> None:
    """Let clicks reach us while a cell runs, when the frontend sends comms over a subshell.

    JupyterLab (>= 4.4, setting "Kernel Comms over subshells") sends widget messages on a
    kernel subshell, so ipykernel (>= 7) can handle them on another thread while the main
    shell runs a cell. ipykernel 7.4 instead routes a comm's incoming messages to the shell
    that last *published* on it, which for us is the cell that started a fork, so clicks
    would queue behind it. Our handlers are thread-safe (one lock; Workbench calls go to
    the smolbench loop), so for our own comm we take the subshell the frontend asked for.
    """
    if comm is not None and callable(getattr(comm, "_reply_subshell_for", None)):
        comm._reply_subshell_for = lambda data, default: default
