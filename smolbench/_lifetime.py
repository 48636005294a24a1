"""Live sessions, and their end: the one :func:`smolbench.session` returns, and the deletion of
every machine at the interpreter's exit or on SIGTERM/SIGHUP (a watcher thread does the work,
never the signal handler)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from . import _loop
from .errors import SmolbenchError

if TYPE_CHECKING:
    from .workbench import Workbench


class Live(Protocol):
    """What this module needs of a session (``_session.Session``)."""

    workbench: Workbench | None
    on_notice: Callable[[str], None]

    @property
    def is_up(self) -> bool: ...


_LIVE: list[Live] = []  # strong: a live session whose handle was dropped still has machines to delete
_hooks_lock = threading.Lock()
_hooks_installed = False
_hooks_pid = 0  # the process the hooks are for: a forked child never deletes its parent's machines
_down_lock = threading.Lock()  # one shutdown_all at a time (the SIGTERM watcher, the exit hook)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # a terminal closing ends a script as SIGTERM does
_previous_handlers: dict[int, Any] = {}  # each stop signal's handler before ours
_sigterm_installed = False
_said_off_main = False
_term_signal: int = signal.SIGTERM  # the stop signal being handled (the program ends by it)
STOP_TIMEOUT = 20.0  # seconds a SIGTERM waits for running calls to stop before it deletes the machines
# A SIGTERM's work is done by a watcher thread, never in the handler: the handler runs on the
# main thread wherever it was, perhaps holding a lock the deletion needs (a Job's Event, the
# ledger's, an import's), and waiting there deadlocked (issue 28). 0: no SIGTERM; 1: the
# watcher is stopping calls and deleting machines; 2: it is done and the handler runs again.
_term_state = 0
_term_wake = -1  # the pipe's write end: all the handler does is write a byte to it


def live(s: Live) -> None:
    _install_hooks()  # first: one that can't be installed (the program is exiting) starts nothing
    gone(s)
    _LIVE.append(s)


def gone(s: Live) -> None:
    _LIVE[:] = [x for x in _LIVE if x is not s]


def current() -> Live:
    """The live session made last: in a notebook, the one ``%smol up`` made."""
    for s in reversed(_LIVE):
        if s.is_up:
            return s
    raise SmolbenchError("no session is up: run `%smol up` in the notebook, or start one with "
                         "`with smolbench.Session() as s:` in a script")


def shutdown_all(timeout: float = 30) -> None:
    """Delete every live session's machines (the interpreter's exit, SIGTERM). A session whose
    deletion failed stays listed, for the exit hook to try again."""
    if _hooks_pid and os.getpid() != _hooks_pid:
        return
    with _down_lock:
        failed = [s for s in list(reversed(_LIVE)) if s.workbench is not None and not _down_through(s.workbench, timeout)]
        _LIVE[:] = failed[::-1]  # also one whose up() a SIGTERM stopped: its backend's cgroups went too


def _down_through(wb: Workbench, timeout: float) -> bool:
    """``wb.down()``, waited for through Ctrl-C: a second Ctrl-C at exit cut the wait short
    and left machines running. False if it ended with an error (to be tried again); one
    still running past ``timeout`` goes on alone, never beside a second."""
    job = _loop.Job(wb.down(), stoppable=False).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if job.wait_finished(0.2):
                break
        except KeyboardInterrupt:
            continue
    return not job.done() or (not job.future.cancelled() and job.future.exception() is None)


def _at_exit() -> None:
    """The interpreter's exit: calls still running (a fork in a thread) stop first, so their
    branches are recorded as cancelled, not as machines that died; then every machine goes."""
    if _hooks_pid and os.getpid() != _hooks_pid:
        return
    _wait_for_program_threads()
    before: Any = None
    if (_LIVE or _loop.running()) and threading.current_thread() is threading.main_thread():
        with contextlib.suppress(ValueError, OSError):  # Ctrl-C again here left machines running
            before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if _loop.running():
            with contextlib.suppress(BaseException):
                _loop.cancel_all(STOP_TIMEOUT)
        shutdown_all()
    finally:
        if before is not None:  # Python then joins the program's own threads: Ctrl-C may stop that
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(signal.SIGINT, before)


def _wait_for_program_threads() -> None:
    """Let the program's own threads end first, as Python would have: its exit hooks run before
    it joins them, and a fork in a non-daemon thread was cancelled as "stopped by SIGTERM" when
    the main thread returned (third audit). Not a thread pool's workers (their pool's own exit
    hook ends them, after this one), nor daemon threads; a Ctrl-C stops the wait."""
    from concurrent.futures import thread as pool

    me = threading.current_thread()
    try:
        for t in threading.enumerate():
            if t is not me and not t.daemon and getattr(t, "_target", None) is not pool._worker:
                t.join()
    except BaseException:  # noqa: BLE001 - a Ctrl-C here: their calls stop now, and the machines go
        pass


def _install_hooks() -> None:
    global _hooks_installed, _hooks_pid
    with _hooks_lock:
        if _hooks_installed:
            _install_sigterm()  # a first session from another thread could not: the main thread can
            return
        # Run before concurrent.futures' own exit hook: after it, asyncio.to_thread (which every
        # delete uses) refuses new work, and the machines' folders and cgroups stayed behind.
        # Those hooks run last registered first, so its own is registered (imported) before ours.
        register = getattr(threading, "_register_atexit", None)
        try:
            if register is not None:
                import concurrent.futures.thread  # noqa: F401

                register(_at_exit)
            else:  # pragma: no cover - Python < 3.9
                import atexit

                atexit.register(_at_exit)
        except RuntimeError:  # "can't register atexit after shutdown": nothing would delete them
            raise SmolbenchError("this program is exiting (its main thread ended): a Session can't start now; "
                                 "start it before the main thread ends, or join this thread there") from None
        _hooks_installed = True
        _hooks_pid = os.getpid()
    _install_sigterm()
    _say_if_sigterm_is_not_ours()


def _say_if_sigterm_is_not_ours() -> None:
    """Once: a Session made off the main thread, where Python can't set a signal handler (a
    SIGTERM then ends the program before anything deletes its machines)."""
    global _said_off_main
    if _sigterm_installed or _said_off_main or threading.current_thread() is threading.main_thread() or _in_kernel():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:  # the program handles it (or ignores it) itself
        return
    _said_off_main = True
    print("smolbench: warning: this Session was made off the main thread, where Python can't catch SIGTERM: a "
          "SIGTERM now ends the program without deleting its machines (its exit and close() still do); make a "
          "Session in the main thread first, and it catches SIGTERM for every one", file=sys.stderr)


def _in_kernel() -> bool:
    """True inside a Jupyter kernel, whose own signal handling we leave alone."""
    if "ipykernel" not in sys.modules:
        return False
    with contextlib.suppress(Exception):
        from IPython import get_ipython

        return getattr(get_ipython(), "kernel", None) is not None
    return False


def _install_sigterm() -> None:
    """SIGTERM (and SIGHUP) stops running calls and deletes every machine, then does what it
    did before (by default: ends the process with that signal's status). Only from the main
    thread, never in a Jupyter kernel, never over a handler that ignores the signal (``nohup``
    ignores SIGHUP), and SIGHUP only where it still ends the program (a daemon's own SIGHUP
    handler often means "reload")."""
    global _sigterm_installed, _term_wake
    if _sigterm_installed or threading.current_thread() is not threading.main_thread() or _in_kernel():
        return
    ours: dict[int, Any] = {}
    for sig in STOP_SIGNALS:
        previous = signal.getsignal(sig)
        if previous is signal.SIG_IGN or previous is None:  # ignored, or set outside Python: not ours
            continue
        if sig != signal.SIGTERM and previous is not signal.SIG_DFL:  # a SIGHUP of its own: often "reload"
            continue
        ours[sig] = previous
    if not ours:
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    threading.Thread(target=_watch, args=(read,), name="smolbench-sigterm", daemon=True).start()
    _term_wake = write
    _previous_handlers.update(ours)
    for number in ours:
        signal.signal(number, _on_sigterm)
    _sigterm_installed = True


def _on_sigterm(signum: int, frame: Any) -> None:
    """Lock-free: wakes the watcher (first stop signal), waits it out (another one meanwhile),
    or does what was there before (once the watcher is done and signals the main thread again)."""
    global _term_state, _term_signal
    if os.getpid() != _hooks_pid:  # a forked child: its parent's machines are not its own
        _previous(signum, frame)
    elif _term_state == 0 and not _LIVE and not _loop.running():
        # Nothing to delete: what was there before, here and now (as without smolbench). A
        # second delivery could land where Python ignores a handler's exception (a weakref
        # callback of the import system), and a handler's sys.exit would be lost there.
        _previous(signum, frame)
    elif _term_state == 0:
        _term_state, _term_signal = 1, signum
        try:
            os.write(_term_wake, b"t")
        except OSError:  # pragma: no cover - the watcher is gone: end as before
            _term_state = 0
            _previous(signum, frame)
    elif _term_state == 2 and signum == _term_signal:
        _term_state = 0
        _previous(signum, frame)
    # 1: a second stop signal while the machines are deleted: the first one's end follows that


def _previous(signum: int, frame: Any) -> None:
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _watch(read: int) -> None:
    """The SIGTERM watcher thread: on each wake, stop the running calls (an up, a cell, a fork
    clean up after themselves), delete every session's machines, then signal the main thread."""
    global _term_state
    while os.read(read, 1):
        try:
            told: list[Any] = []  # each place a notice goes hears it once, however many sessions share it
            for s in list(_LIVE):
                if s.on_notice in told:
                    continue
                told.append(s.on_notice)
                with contextlib.suppress(Exception):
                    s.on_notice(f"smolbench: {signal.Signals(_term_signal).name}: stopping and deleting this "
                                "program's machines")
            _loop.cancel_all(STOP_TIMEOUT)
            shutdown_all()
        finally:
            _term_state = 2
            try:
                signal.pthread_kill(threading.main_thread().ident or 0, _term_signal)
            except (OSError, ValueError):  # pragma: no cover - the main thread is gone
                os.kill(os.getpid(), _term_signal)


def wait_out_sigterm() -> None:
    """While a SIGTERM's watcher works, start nothing and return nothing: the program ends
    (its handler runs on the main thread) once the machines are gone."""
    while _term_state and os.getpid() == _hooks_pid:
        time.sleep(0.05)


def stopping() -> bool:
    """Whether a SIGTERM's watcher is stopping calls and deleting machines right now."""
    return _term_state != 0
