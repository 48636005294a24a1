"""``%smol`` and ``%%smol``: parse options, call the Session (and its Workbench), show what comes back."""

from __future__ import annotations

import contextlib
import os
import sys
import time
import types
from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display

from . import _loop, gate
from ._didyoumean import cell_word_error, line_word_error
from ._format import size_text, time_text
from ._magicargs import (
    HELP,
    _cell_args,
    _checkpoint_args,
    _fork_args,
    _ledger_args,
    _node_args,
    _split_names,
    _up_args,
    out_name,
    parse_argstring,
    parse_seeds,
    strip_comment,
)
from ._magicout import (
    _BG_NOTES,
    _NOTES_SHOWN,
    _drain,
    _Dropped,
    _flush_grouped,
    _notice,
    _Progress,
    _show_event,
    show_pending,
)
from ._magicout import _PENDING as _PENDING  # where tests and bench/ reach the queue
from ._session import Session, pickled
from ._session import choose_backend as choose_backend  # where bench/ and tests import it from
from .backends.base import Event
from .errors import SmolbenchError, reworded, shown_by_ipython
from .gate import SafeBundle
from .result import ForkResult

PUMP_INTERVAL = 0.05
NO_ARGUMENTS = ("status", "down", "tree", "plot")  # extra words there were silently dropped


@magics_class
class SmolMagics(Magics):
    """The ``%smol`` / ``%%smol`` magics (one Workbench per kernel)."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.session: Session | None = None  # what `%smol up` made; smolbench.session() returns it
        self._publisher: Any = None  # smolbench.registry.Publisher of the current workbench
        self.warned_trust = False
        # The session's own exit hook deletes its machines when the kernel ends (_session.py).

    @property
    def workbench(self) -> Any:
        """The current session's Workbench (None before the first `%smol up`)."""
        return None if self.session is None else self.session.workbench

    @property
    def last_result(self) -> ForkResult | None:
        """The last fork or episodes (``%smol use best``)."""
        return None if self.session is None else self.session.last_result

    @last_result.setter
    def last_result(self, result: ForkResult | None) -> None:
        if self.session is not None:
            self.session.last_result = result

    # -- entry point ------------------------------------------------------------------

    @line_cell_magic
    def smol(self, line: str, cell: str | None = None) -> Any:
        try:
            if cell is None:
                return self._line(line)
            return self._cell(line, cell)
        except SmolbenchError as exc:
            # One line, no traceback of our layers (the exception renders itself), in the
            # magics' words also when the Session (or a layer below) had it in its own.
            raise reworded(exc, exc.for_magics()) from None

    smol.__doc__ = HELP

    def _line(self, line: str) -> Any:
        words = strip_comment(line).split(None, 1)
        if not words:
            print(HELP)
            return None
        sub, rest = words[0], (words[1] if len(words) > 1 else "")
        if sub in ("help", "--help", "-h"):
            print(HELP)
            return None
        if sub in NO_ARGUMENTS and rest.strip():
            raise UsageError(f"%smol {sub} takes no arguments, got {rest.strip()!r}: `%smol {sub}`")
        handler = getattr(self, f"_do_{sub}", None)
        if handler is None:
            raise UsageError(line_word_error(sub))
        return handler(rest)

    def _cell(self, line: str, cell: str) -> Any:
        line = strip_comment(line)
        words = line.split(None, 1)
        if words and words[0] in ("fork", "episodes"):
            return self._fanout(words[0], words[1] if len(words) > 1 else "", cell)
        typo = cell_word_error(line)
        if typo:
            raise UsageError(typo)
        return self._run_cell(line, cell)

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def _user_ns(self) -> dict[str, Any]:
        assert self.shell is not None
        return self.shell.user_ns

    def _wb(self) -> Any:
        if self.workbench is None:
            raise SmolbenchError("no machine is up: run `%smol up` first")
        return self.workbench

    def _do_up(self, rest: str) -> None:
        args = parse_argstring(_up_args, rest, "%smol up")
        if self.session is not None and self.session.is_up:
            wb = self.session.workbench
            assert wb is not None
            if wb.active is not None:
                raise SmolbenchError(f"already up ({wb.backend.name}, active {wb.active}): `%smol down` first to start over")
            # none active (it was deleted), others live: never taken down behind the user's back
            live = list(wb.machines)
            pick = "root" if "root" in wb.machines else live[0]
            shown = ", ".join(live[:5]) + (f", … {len(live)} in all" if len(live) > 5 else "")
            raise SmolbenchError(f"machines are still up ({shown}): `%smol use {pick}`, or `%smol down` first")
        self._boot(_session_of(args))

    def _boot(self, session: Session, restore: str | None = None, ran: str = "%smol up") -> None:
        """Start ``session``'s machine as `%smol up` does (published first; ``restore``: its one
        machine is that checkpoint's, as `Session.boot` takes it), make it this kernel's, say so
        (``ran``: what the user ran, named if it is interrupted).
        The session it replaces, which has no machine left (its root was lost, or every machine
        deleted), goes first: what is left of it (its backend's cgroups, proxy, run folders)."""
        old = self.session
        if old is not None and old is not session and not old.is_up:
            old.down()
        wb = session.build(announce=lambda msg: print(msg, flush=True))
        if session.fallback:
            print(session.fallback)
        self._publish(wb)
        t0 = time.perf_counter()
        try:
            session.boot(restore, waiting=show_pending)  # e.g. "installing 3 packages …" while it does
            self.session = session  # at once: a Ctrl-C from here on leaves it to `%smol down`
        except KeyboardInterrupt:  # boot() deleted what its up made (machine, run folder, proxy) before it ended
            raise interrupted(f"`{ran}` was interrupted: its machine was deleted and nothing is left behind") from None
        finally:
            show_pending()
        path, net_note = session.spec_path, wb.net_note
        backend: Any = wb.backend
        with contextlib.suppress(Exception):  # open checkpoint panels follow the new machine
            from .widgets import follow_views

            follow_views(wb)
        st = wb.status()
        first = wb.machines[wb.active or "root"].info  # the root, or the restored machine
        tries = first.get("attempts", 1)
        print(f"smolbench: up on {st['backend']} in {time.perf_counter() - t0:.2f} s · machine {st['machine']} · "
              f"python {st['guest_python']} · network {st['network']} · {path or 'default spec'}"
              + (f" · booted on attempt {tries} (earlier boots failed: `%smol ledger` lists them)" if tries > 1 else ""))
        if first.get("packages"):  # the Smolfile's packages: installed now (how long), or cached
            print(f"smolbench: {first['packages']}")
        if wb.lost:
            print(f"smolbench: {wb.lost} node{'s were' if wb.lost != 1 else ' was'} left unfinished by a kernel that "
                  "died earlier: marked lost in the ledger")
        if net_note:
            print(f"smolbench: {net_note}")
        if wb.disk_note:
            print(f"smolbench: note: {wb.disk_note}")
        if backend.name == "cluster":
            print(f"cluster: {len(backend.describe())} nodes, {backend.slots()} machine slots at {backend.address}; "
                  f"{wb.active} on node {str(first.get('node'))[:8]}")
            for line in getattr(backend, "refused", []):
                print(f"smolbench: WARNING: {line}", file=sys.stderr)
        if backend.name != "smol":
            print(f"isolation: {backend.isolation}")

    def _restore(self, name: str) -> None:
        """``%smol checkpoint restore NAME``: the Session's restore (nothing up: a machine as
        `%smol up` brings one up, of the checkpoint's backend, taken down again if it fails)."""
        up_now = self.session is not None and self.session.is_up
        session = self.session if up_now and self.session is not None else _session_of(parse_argstring(_up_args, ""))

        def up(what: str) -> None:  # inside the Session's take-down: a Ctrl-C as its lines show takes it down too
            print(f"smolbench: nothing is up: bringing up a {session.backend_kind} machine for this checkpoint")
            self._boot(session, restore=what, ran=f"%smol checkpoint restore {name}")

        def told(line: str, gone: bool) -> None:
            if gone:
                self._close_views()
            print(line, file=sys.stdout if gone else sys.stderr)

        node = session._restore(name, up, told)
        wb = session.workbench
        assert wb is not None
        for note in wb.restore_notes:
            print(f"smolbench: {note}")
        info = wb.machines[node].info
        print(f"smolbench: restored {info.get('restored_from', wb.tree[node].checkpoint)} as {node} (now active)")
        for w in info.get("restore_warnings", []):
            print(f"smolbench: warning: {w}", file=sys.stderr)

    def _publish(self, wb: Any) -> None:
        """Tell the Jupyter server's smolbench panel about this workbench's machines."""
        from .registry import publish

        if self._publisher is not None:
            self._publisher.close()
        self._publisher = publish(wb)

    def _do_down(self, rest: str) -> None:
        if self.session is None or self.workbench is None:
            print("smolbench: nothing is up")
            return
        n = self.session.down()  # a fork still running (--bg) is cancelled first: its branches say so
        stopped = self.workbench.cancelled_fanouts
        if stopped:
            print(f"smolbench: cancelled {stopped} running fan-out{'s' if stopped != 1 else ''} first "
                  "(their unfinished branches are recorded as cancelled)")
        print(f"smolbench: deleted {n} machine{'s' if n != 1 else ''}")
        self._close_views()

    def shutdown(self) -> None:
        """Delete every machine and close the ledgers (extension unload; the kernel's exit: the
        session's own hook, and the ledger's)."""
        if self.session is not None and self.session.is_up:
            with contextlib.suppress(Exception):
                self.session.down()
        for ledger in (getattr(self.workbench, "ledger", None), getattr(getattr(self, "_own_shelf", None), "ledger", None)):
            if ledger is not None:
                ledger.fold_wal()
                ledger.close()

    def _close_views(self) -> None:
        """Detach the Workbench's widgets; they keep showing its last state."""
        if self.workbench is not None:
            from .widgets import close_views

            close_views(self.workbench)

    def _do_status(self, rest: str) -> dict[str, Any] | None:
        st: dict[str, Any] = self.session.status() if self.session is not None else {"up": False}
        if not st.pop("up"):
            print("smolbench: no machine is up (`%smol up` starts one)")
            if st.get("lost"):
                print(f"smolbench: lost {st['lost']}")
            return None
        if st["active"] is None:  # its active machine was deleted, others live
            st["active"] = "none (`%smol use NODE` picks one)"
        width = max(len(k) for k in st)
        for k, v in st.items():
            print(f"{k:<{width}}  {v}")  # the cluster's nodes come one per line
        return None

    def _do_use(self, rest: str) -> None:
        args = parse_argstring(_node_args, rest, "%smol use")
        self._wb()
        assert self.session is not None
        node = self.workbench.tree[self.session.use(args.node)]  # `best`: the kept winner of the last fork
        show_pending()  # (or, that gone, which fork's best it took)
        print(f"smolbench: active machine is now {node.id}" + (f" (seed {node.seed}, reward {node.reward if node.reward is None else format(node.reward, '.6g')})" if node.seed is not None else ""))

    def _do_delete(self, rest: str) -> None:
        args = parse_argstring(_node_args, rest, "%smol delete")
        wb = self._wb()
        assert self.session is not None
        gone = self.session.delete(args.node)  # where the active machine went, if it did: wb.moved
        print(f"smolbench: deleted {', '.join(gone) if gone else 'nothing (already gone)'}" + (f"; {wb.moved}" if wb.moved else ""))

    def _ledger_path(self) -> str:
        """The ledger `%smol up` would use (read while nothing is up: see ``pastledger``)."""
        from .ledger import DEFAULT_PATH

        return (self.session.ledger_path if self.session is not None else None) or DEFAULT_PATH

    def _do_tree(self, rest: str) -> Any:
        """One tree: the live view (its static copy is what a saved notebook shows); the text
        tree only where the widget can't be made. Nothing up: the ledger's last session, as text."""
        if self.workbench is None:
            from .pastledger import tree_view

            tree, line = tree_view(self._ledger_path(), "tree")
            print(line if tree is None else f"{line}\n{tree.render()}")
            return None
        wb = self._wb()
        try:
            from .widgets import tree_widget

            tree_widget(wb, self.shell).show()  # the whole session
        except Exception as exc:  # a broken view must never break the workbench
            print(wb.tree.render(wb.active))
            print(f"smolbench: the tree widget is unavailable ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None

    def _do_ledger(self, rest: str) -> Any:
        args = parse_argstring(_ledger_args, rest, "%smol ledger")
        if args.n < 1:
            raise UsageError(f"-n must be at least 1, got {args.n}: e.g. %smol ledger -n 20")
        if self.workbench is None:  # this folder's ledger, read-only
            from .pastledger import nodes_view

            df, line = nodes_view(self._ledger_path())
            print(line)
            if df is None:
                return None
        else:
            df = self.workbench.ledger.nodes()
        if df.empty:
            print("smolbench: the ledger is empty")
            return None
        cols = [c for c in ("session_id", "id", "parent_id", "seed", "status", "reward", "started", "ended", "alive") if c in df]
        return ledger_table(df[cols].tail(args.n))

    def _do_checkpoint(self, rest: str) -> Any:
        args = parse_argstring(_checkpoint_args, rest, "%smol checkpoint")
        if args.path is not None and args.action != "export":
            raise UsageError(f"%smol checkpoint {args.action} takes one name, got also {args.path!r}"
                             + (" (a path with spaces goes in quotes)" if args.action == "restore" else ""))
        if args.action == "save":
            wb = self._wb()
            info = _loop.run(wb.checkpoint_save(args.name, args.node, args.force))
            print(f"smolbench: saved checkpoint {info['name']} of {info['node']} ({size_text(info['size'])})")
            for w in info["warnings"]:
                print(f"smolbench: warning: {w}", file=sys.stderr)
            return None
        if args.action == "restore":
            if not args.name:
                raise UsageError("name the checkpoint to restore: %smol checkpoint restore NAME (or PATH.smolcheckpoint)")
            self._restore(args.name)
            return None
        if args.action in ("rm", "export", "trust") and not args.name:
            raise UsageError(f"name the checkpoint: %smol checkpoint {args.action} NAME" + (" PATH" if args.action == "export" else ""))
        if args.action == "rm":
            print(f"smolbench: {self._shelf().remove(args.name) if self.workbench is None else self.workbench.checkpoint_remove(args.name)}")
            return None
        if args.action == "trust":
            wb = self.workbench
            print(f"smolbench: {self._shelf().trust(args.name, '') if wb is None else wb.checkpoint_trust(args.name)}")
            return None
        if args.action == "export":
            if not args.path:
                raise UsageError(f"say where to write it: %smol checkpoint export {args.name} PATH.smolcheckpoint")
            spec = self.workbench.spec if self.workbench is not None else None
            info = self._shelf().export(args.name, args.path, spec, args.force)
            print(f"smolbench: exported checkpoint {args.name} to {args.path} ({size_text(info['size'])}), its record inside: "
                  f"anyone can `%smol checkpoint restore {args.path}` in any folder" + (f"\nsmolbench: {info['note']}" if info.get("note") else ""))
            return None
        if self.workbench is None:
            for line in self._shelf().lines():
                print(line)
            return None
        from ._shelflist import misnamed_lines

        for line in misnamed_lines(self.workbench.shelf.store):  # files the panel can't list, and why
            print(f"smolbench: {line}")
        # The panel is the one view (its saved form is a static table): no second DataFrame.
        # `smolbench.Ledger(...).checkpoints()` is the DataFrame for analysis.
        from .widgets import checkpoint_panel

        checkpoint_panel(self.workbench, self.shell).show()
        return None

    def _shelf(self) -> Any:
        """This folder's checkpoints (the Workbench's, or the default ledger's while none is up)."""
        if self.workbench is not None:
            return self.workbench.shelf
        here = os.getcwd()  # (a notebook that changed folder: that folder's, as a restore finds them)
        own = getattr(self, "_own_shelf", None)
        if own is None or own[0] != here:
            from .ledger import DEFAULT_PATH, Ledger
            from .shelf import Shelf

            if own is not None:
                own[1].ledger.close()
            own = self._own_shelf = (here, Shelf(Ledger(DEFAULT_PATH)))
        return own[1]

    def _do_replay(self, rest: str) -> Any:
        args = parse_argstring(_node_args, rest, "%smol replay")
        wb = self._wb()
        report = self._pump(wb.replay(args.node, self._branch_printer("order", {})))
        print(report["message"])
        return None

    def _warn_trust(self) -> None:
        if not self.warned_trust:
            self.warned_trust = True
            print("smolbench: warning: trusted mode: objects pulled from the machine are unpickled here and its "
                  "output is shown raw, so code in the machine can run code in this kernel and in your browser. "
                  "Use it only for machines running code you trust; `%smol trust off` ends it", file=sys.stderr)

    def _do_trust(self, rest: str) -> None:
        word = rest.strip()
        if word not in ("on", "off"):
            state = "on" if self.workbench is not None and self.workbench.trusted else "off"
            said = f"{word!r} is not a trust setting" if word else f"trusted mode is {state}"
            raise UsageError(f"{said}: `%smol trust on` or `%smol trust off`" + (f" (trusted mode is {state})" if word else ""))
        wb = self._wb()
        wb.set_trust(word == "on")
        if word == "on":
            self._warn_trust()
        print(f"smolbench: trusted mode {word} (recorded in the ledger)")

    def _do_config(self, rest: str) -> None:
        words = rest.split()
        if not words:
            print(gate.limits.describe())
            return
        if len(words) != 2:
            raise UsageError("usage: %smol config KEY VALUE, e.g. %smol config output-limit 20M (`%smol config` lists them)")
        print(gate.limits.configure(words[0], words[1]))

    def _do_plot(self, rest: str) -> Any:
        from .widgets.plots import tree_figure

        if self.workbench is None:  # the ledger's last session, read-only
            from .pastledger import tree_view

            tree, line = tree_view(self._ledger_path(), "rewards")
            print(line)
            return None if tree is None else tree_figure(types.SimpleNamespace(tree=tree))
        return tree_figure(self._wb())

    # -- cells ------------------------------------------------------------------------------------

    def _pushed(self, names: list[str]) -> dict[str, bytes]:
        for name in names:
            if name not in self._user_ns:
                raise SmolbenchError(f"--push {name}: no variable named {name!r} in the notebook")
        return pickled({name: self._user_ns[name] for name in names})

    def _run_cell(self, line: str, cell: str) -> Any:
        args = parse_argstring(_cell_args, line, "%%smol")
        wb = self._wb()
        push = self._pushed(_split_names(args.push))
        pull = _split_names(args.pull)

        # Tracebacks name the notebook's own cell, like a local one: File "<In [7]>", line 3
        if args.pull_trusted and pull and not wb.trusted:  # trusted mode said its own warning
            print(f"smolbench: warning: --pull-trusted: what this cell pulls ({', '.join(pull)}) is unpickled here "
                  "when it is not plain data, so code in the machine can run code in this kernel; use it only "
                  "for machines running code you trust", file=sys.stderr)
        assert self.session is not None and wb is self.session.workbench
        res = self._pump(self.session.cell(cell, push=push, pull=pull, timeout=args.timeout, on_event=_show_event,
                                           cell_name=self._cell_name(), first_line=2, pull_trusted=args.pull_trusted,
                                           value=False))
        if res.error is not None:
            # no [node] head; a syntax error as a local cell's, not through IPython's own printer
            raise shown_by_ipython(type(res.error)(res.error.ename, res.error.evalue, res.error.traceback)) from None
        if res.reward_error:  # e.g. reward = True or 10**400: said, not recorded
            print(f"smolbench: {res.reward_error}: not recorded", file=sys.stderr)
        self._user_ns.update(res.pulled)  # rebuilt from data by the gate (or unpickled: trusted only)
        if res.pull_error:
            raise SmolbenchError(res.pull_error)
        if res.display is not None:
            return RemoteValue(res.display)  # becomes the cell's Out[n], like a local cell
        return None

    def _cell_name(self) -> str:
        """What tracebacks call the running cell, like a local one: ``<In [7]>``."""
        return f"<In [{cell_number(self.shell)}]>"

    def _fanout(self, kind: str, line: str, cell: str) -> Any:
        args = parse_argstring(_fork_args, line, f"%%smol {kind}")
        try:
            n = int(args.n)
        except ValueError:
            raise SmolbenchError(f"the number of branches must be a whole number, got {args.n!r}: e.g. `%%smol {kind} 16`") from None
        seeds = parse_seeds(args.seeds) if args.seeds else None
        out_name(args.out)
        if kind == "episodes" and args.keep != "best":
            raise UsageError("--keep is for forks: every episode's machine is deleted after its cell (use `%%smol fork N "
                             f"--keep {args.keep}` to keep branches)")
        if seeds is not None and len(set(seeds[:n])) < len(seeds[:n]):
            print("smolbench: warning: --seeds repeats a seed; those branches will likely give the same result", file=sys.stderr)
        self._wb()
        assert self.session is not None
        result, coro_for = self.session.fan_out(
            kind, n, cell, seeds=seeds, seed_base=args.seed_base, keep=args.keep, timeout=args.timeout,
            concurrency=args.concurrency, retries=args.retries, push=self._pushed(_split_names(args.push)),
            cell_name=self._cell_name(), first_line=2, reseed=not args.no_reseed)  # the %%smol line is line 1
        buffers: dict[str, list[tuple[str, str]]] = {}
        printer = self._branch_printer("quiet" if args.quiet else args.group_outputs, buffers)

        if not args.quiet:
            self._show_views(result)
        if args.bg:
            async def in_background() -> ForkResult:  # each row keeps its output when it ends
                _BG_NOTES.set(result.notes)  # its notices are the handle's, not the next cell's (_notice)
                return await coro_for(lambda b, ev: None)

            job = _loop.Job(in_background()).start()
            result._attach(job.future, job.cancel)
            if args.out:
                self._user_ns[args.out] = result
                result.name = args.out  # what a Ctrl-C of its .wait() says to cancel it
            self.last_result = result
            print(f"smolbench: {kind} of {n} running in the background; the handle has .wait(), .done(), .progress, .cancel()")
            return result
        try:
            self._pump(coro_for(printer), result=result, show_progress=not args.quiet)
        finally:
            if args.group_outputs in ("branch", "type") and not args.quiet:
                _flush_grouped(buffers, args.group_outputs)
            if args.out:
                self._user_ns[args.out] = result
            self.last_result = result
        if result.unrewarded:  # said on every path, also with --quiet
            print(f"smolbench: warning: {result.unrewarded}", file=sys.stderr)
        err = None if args.allow_errors else result.composite_error()
        if err is not None:
            display(result)  # the table, then the error (a cell that raises has no Out[n])
            raise err
        if args.quiet:  # --quiet: one summary line and no Out[n] (loops, scripts); --out keeps the handle
            print(result.summary())
            return None
        return result  # the cell's value: Out[n] and `_`, shown as the table

    def _show_views(self, result: ForkResult) -> None:
        """Show this fork's live tree view above the run (its static copy is refreshed when
        the cell ends, so a saved notebook shows the finished fork)."""
        try:
            from .widgets import tree_widget

            tree_widget(self._wb(), self.shell, result=result).show()
        except Exception as exc:  # a broken view must never break a run
            print(f"smolbench: the tree widget is unavailable ({type(exc).__name__}: {exc})", file=sys.stderr)

    def _branch_printer(self, mode: str, buffers: dict[str, list[tuple[str, str]]]) -> Callable[[str, Event], None]:
        def on_event(branch: str, ev: Event) -> None:
            if mode == "quiet":
                return
            if ev.kind == "clear" or (ev.kind == "display" and ev.update):
                return  # a branch's output is not one cell's to clear or redraw: its new displays show
            if ev.kind == "display":
                if mode == "order":
                    _PENDING.put(("display", branch, ev))
                return
            if mode == "order":
                _PENDING.put(("stream", branch, ev))
            else:
                buffers.setdefault(branch, []).append((ev.name, ev.text))

        return on_event

    def _pump(self, coro: Any, *, result: ForkResult | None = None, show_progress: bool = True) -> Any:
        """Run ``coro`` on the loop; show its events on this (the kernel's) thread as they come.

        Ctrl-C interrupts the running cell, or cancels every branch of a fan-out;
        either way we wait for the cleanup before handing control back.
        """
        job = _loop.Job(coro)
        _NOTES_SHOWN.clear()
        # Wake the waiting loop below the moment the job ends, instead of at its next poll.
        job.future.add_done_callback(lambda _: _PENDING.put(("wake", "", Event("wake"))))
        progress = _Progress(result) if result is not None and show_progress else None
        try:
            job.start()
            while not job.done():
                _drain(timeout=PUMP_INTERVAL)
                if progress is not None:
                    progress.tick()
            while not _PENDING.empty():  # all of this cell's output shows in this cell, none later
                _drain(timeout=0)
        except KeyboardInterrupt:
            if not job.reached():  # stopped as it started: it never ran
                raise interrupted("the cell was interrupted before it started; nothing ran") from None
            job.cancel()
            dropped = _Dropped()  # output still queued: don't make Ctrl-C wait for it to print
            dropped.discard()
            while not job.wait_finished(PUMP_INTERVAL):
                dropped.discard()
            dropped.discard()
            dropped.say()
            if progress is not None:
                progress.tick(final=True)
            failure = job.future.exception() if job.future.done() and not job.future.cancelled() else None
            if isinstance(failure, SmolbenchError):  # e.g. the machine had to be killed: say that instead
                raise type(failure)(str(failure)) from None
            if result is not None:
                print(f"smolbench: interrupted: {result.summary()}", file=sys.stderr)
                raise interrupted("every unfinished branch was cancelled and its machine deleted") from None
            raise interrupted("the cell was interrupted inside the machine; the machine and its state are kept") from None
        if progress is not None:
            progress.tick(final=True)
        return job.result()


def ledger_table(df: Any) -> Any:
    """Ledger rows for people: local times, whole-number seeds, alive as yes/no, and its texts
    (ids, statuses: a copied folder's ledger is its author's) as one escaped line each."""
    import pandas as pd

    out = df.copy()
    for col in out.columns:
        if pd.api.types.is_object_dtype(out[col]) or pd.api.types.is_string_dtype(out[col]):
            out[col] = [gate.terminal.one_line(v, 200) if isinstance(v, str) else v for v in out[col]]
    for col in ("started", "ended"):
        if col in out:
            out[col] = [time_text(v) for v in out[col]]
    if "seed" in out:
        out["seed"] = pd.array([None if pd.isna(v) else int(v) for v in out["seed"]], dtype="Int64")
    if "alive" in out:
        out["alive"] = ["yes" if v == 1 else "no" for v in out["alive"]]
    return out


class RemoteValue:
    """The last expression of a machine cell, displayed through its MIME bundle."""

    def __init__(self, data: SafeBundle) -> None:
        self.data = data

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        return self.data

    def __repr__(self) -> str:
        return str(self.data.get("text/plain", ""))


def cell_number(shell: Any) -> Any:
    """The running cell's number: IPython 9 counts up before a cell runs, 8 after, so ask
    the running cell's own result first."""
    running = getattr(getattr(shell, "displayhook", None), "exec_result", None)
    count = getattr(running, "execution_count", None)
    return count if count is not None else getattr(shell, "execution_count", "?")


def _session_of(args: Any) -> Session:
    """The Session ``%smol up ARGS`` makes (not yet up)."""
    session = Session(args.smolfile, backend=args.backend, ray=args.ray, ledger=args.ledger, target=args.target,
                      image=args.image, net=args.net, allow=args.allow, max_alive=args.max_alive,
                      retries=args.retries, on_notice=_notice)
    session.magic_words = True
    return session


def interrupted(message: str) -> KeyboardInterrupt:
    """A KeyboardInterrupt that IPython shows as one line (our frames help nobody)."""
    cls = type("KeyboardInterrupt", (KeyboardInterrupt,), {"_render_traceback_": lambda self: [f"KeyboardInterrupt: {self}"]})
    return cls(message)

