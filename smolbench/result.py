"""What a Session brings back: a ForkResult, the handle a fork (or a batch of episodes) returns
(like ipyparallel's AsyncResult), and a RunResult, one cell's."""

from __future__ import annotations

import html
import math
import time
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import CompositeError, RemoteError, SmolbenchError, remote_error, session_phrases
from .gate import SafeBundle, images, terminal
from .gate.display import INERT_CLASSES
from .tree import TERMINAL, best_key

if TYPE_CHECKING:
    import pandas as pd

    from .backends.base import CellResult, Event

COLUMNS = ("branch", "seed", "status", "reward", "wall", "metrics", "output", "output_log", "error", "attempts")
VALUE = "_"  # the agent keeps a cell's last expression here; pulled back as the result's value
REASON_CHARS = 160  # a failed branch's reason in the table and summary (the full text is in .failed)
# Status colours with at least 4.5:1 contrast: on white, and on JupyterLab's dark theme
# (``body[data-jp-theme-light="false"]``, as widgets/static.py does for the tree).
STATUS_COLORS = {"ok": "#1a7f37", "error": "#cf222e", "timeout": "#9a6700", "cancelled": "#59636e"}
STATUS_COLORS_DARK = {"ok": "#3fb950", "error": "#f85149", "timeout": "#d29922", "cancelled": "#9198a1"}


def reason(row: dict[str, Any]) -> str:
    """Why a branch failed, as one short line (its error's last line: ``MemoryError: ...``), as
    plain text: it goes inside host lines (a summary), where a style it started, cut short,
    would colour the rest."""
    lines = [ln.strip() for ln in terminal.plain(str(row.get("error") or "")).splitlines() if ln.strip()]
    text = lines[-1] if lines else str(row.get("status") or "")
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 1] + "…"


def _status(row: dict[str, Any]) -> str:
    """A row's status, saying when its machine had to be retried."""
    tries = row.get("attempts", 1)
    return f"{row['status']} (retried: attempt {tries})" if tries > 1 else str(row["status"])


class ForkResult:
    """Results of a fan-out, live while it runs.

    One row per branch: ``branch``, ``seed``, ``status`` (ok / error / timeout /
    cancelled, or running), ``reward``, ``wall`` seconds, ``metrics``, ``output`` (its
    stdout, then ``[stderr]`` and its stderr, as a ``%%smol`` cell shows them but only the
    last 64 KiB of each (``gate.ROW_KEEP``: rows live as long as the session), then the line
    saying what was not kept or shown and where it went) and ``output_log`` (that log's
    absolute path: all of the branch's output once it printed more than a row keeps; None
    when nothing was held back). Shown as a table;
    ``.to_pandas()`` for analysis.
    """

    def __init__(self, kind: str, run_id: str, parent: str | None, branches: list[str], seeds: list[int | None]) -> None:
        self.kind = kind
        self.run_id = run_id
        self.parent = parent
        self.rows: dict[str, dict[str, Any]] = {
            b: {"branch": b, "seed": s, "status": "starting", "reward": None, "wall": None,
                "metrics": {}, "output": "", "output_log": None, "error": None, "attempts": 1}
            for b, s in zip(branches, seeds)
        }
        self.remote_errors: dict[str, RemoteError] = {}
        self.kept: list[str] = []
        self.keep: str | None = None  # the keep policy of a fork ("best", "all", "none")
        self.fresh: str | None = None  # episodes: "zygote" or "boot (why)" (smolbench/zygote.py)
        self.fresh_hint = ""  # episodes: that they start from the baseline, not the active machine (said on NameErrors)
        self.fresh_module_hint = ""  # and so without the active machine's %pip installs (said on ImportErrors)
        self.reseed = True  # branches reseed the random streams they inherited (--no-reseed: False)
        # the pixels its branches' images may declare in all: they show in one output area
        self.pixels = images.Allowance()
        self.magic_words = True  # its lines name the magics' options; a Session's fork: its arguments
        self.started = time.time()
        self.ended: float | None = None
        # what it said while it ran in the background (--bg), e.g. a kept machine it deleted over
        # max_alive: said by .wait() (once) and kept in its table, never under an unrelated cell
        self.notes: list[str] = []
        self._told = 0
        self.name: str | None = None  # the variable the magics put it in (--out), named by a wait's Ctrl-C
        self._future: Future[Any] | None = None
        self._cancel: Any = None
        self.cancelled_by_handle = False  # its cancel() was called (a blocking call stopped says by what)
        self._copy = False  # unpickled (a Ray task's return value): no live handle

    # -- live handle ---------------------------------------------------------------

    def _attach(self, future: Future[Any], cancel: Any) -> None:
        self._future = future
        self._cancel = cancel

    def done(self) -> bool:
        """True once every branch reached a terminal status."""
        return self._future is None or self._future.done()

    def wait(self, timeout: float | None = None) -> ForkResult:
        """Block until the fan-out is finished (or ``timeout`` seconds pass).

        After :meth:`cancel` (or a ``down`` that cancelled it) it returns once every branch is
        cleaned up (their status says ``cancelled``), rather than raising. Ctrl-C stops the
        wait, not the fan-out: it goes on in the background, and says so.
        """
        try:
            if self._future is not None:
                try:
                    self._future.result(timeout)
                except CancelledError:
                    pass
                except KeyboardInterrupt:
                    if self.done():
                        raise
                    done, total = self.progress
                    handle = f"`{self.name}.cancel()`" if self.name else "its handle's `.cancel()`"
                    raise _interrupted(f"stopped waiting; the {self.kind} goes on in the background ({done} of {total} "
                                       f"done): {handle} stops it") from None
        finally:
            self._tell()
        return self

    def _tell(self) -> None:
        """Print the notes not said yet (in the cell that waits for the fork)."""
        told, self._told = self._told, len(self.notes)
        for line in self.notes[told:self._told]:
            print(line, flush=True)

    def cancel(self) -> None:
        """Cancel every running branch (their machines are deleted)."""
        if self._copy:
            raise SmolbenchError(f"this ForkResult is a copy (it was pickled, e.g. returned from a Ray task): its {self.kind} "
                                 "had ended, so there is nothing to cancel; call .cancel() on the handle where it ran")
        if self._cancel is not None and not self.done():
            self.cancelled_by_handle = True
            self._cancel()

    # -- pickling (a Ray task returns one) ------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """Its rows and what it says, without the live parts (the run's future and cancel,
        the branches' pixel allowance): only a finished one travels."""
        if not self.done():
            done, total = self.progress
            raise TypeError(f"a {self.kind} still running can't be pickled ({done} of {total} done): "
                            "call .wait() first, then send its result")
        state = dict(self.__dict__)
        for live in ("_future", "_cancel", "pixels"):
            state.pop(live, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._future = None  # done() is True, wait() returns it
        self._cancel = None
        self._copy = True
        self.pixels = images.Allowance(0)  # its branches showed what they showed where it ran

    @property
    def progress(self) -> tuple[int, int]:
        """(branches finished, branches in all)."""
        return sum(r["status"] in TERMINAL for r in self.rows.values()), len(self.rows)

    # -- results ----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, branch: str) -> dict[str, Any]:
        return self.rows[branch]

    def __iter__(self) -> Any:
        return iter(self.rows.values())

    @property
    def rewards(self) -> dict[str, float | None]:
        """Reward per branch."""
        return {b: r["reward"] for b, r in self.rows.items()}

    @property
    def best(self) -> dict[str, Any] | None:
        """The row with the highest reward among branches that finished ok."""
        ok = [r for r in self.rows.values() if r["status"] == "ok" and r["reward"] is not None]
        return min(ok, key=lambda r: best_key(r["branch"], r["reward"])) if ok else None

    @property
    def failed(self) -> list[dict[str, Any]]:
        """Rows of branches that errored, timed out or were cancelled."""
        return [r for r in self.rows.values() if r["status"] in ("error", "timeout", "cancelled")]

    def counts(self) -> dict[str, int]:
        """How many branches ended in each status."""
        out: dict[str, int] = {}
        for r in self.rows.values():
            out[r["status"]] = out.get(r["status"], 0) + 1
        return out

    def summary(self, *, reasons: bool = True) -> str:
        """One line: n ok / failed, best reward and its branch (``reasons``: and the first
        failure's error, the machine's words)."""
        c = self.counts()
        parts = [f"{self.kind} of {len(self)}"]
        parts += [f"{n} {s}" for s, n in sorted(c.items())]
        retried = sum(r.get("attempts", 1) > 1 for r in self.rows.values())
        if retried:
            parts.append(f"{retried} retried after a machine failure")
        best = self.best
        if best is not None:
            parts.append(f"best reward {best['reward']:.6g} on {best['branch']} (seed {best['seed']})")
        if self.ended is not None:
            parts.append(f"in {self.ended - self.started:.2f} s")
        if self.kept:
            parts.append(f"kept alive: {', '.join(self.kept)}")
        failed = [r for r in self.failed if r["status"] != "cancelled"]  # a cancel says nothing more
        if failed:
            first = failed[0]
            more = f" (and {len(failed) - 1} more: see the table)" if len(failed) > 1 else ""
            parts.append(f"failed: [{first['branch']}]" + (f" {reason(first)}" if reasons else "") + more)
        if self.unrewarded:
            parts.append(self.unrewarded)
        if self.same_reward:
            parts.append(self.same_reward)
        return " · ".join(parts)

    @property
    def same_reward(self) -> str:
        """What to say when every branch of a fork reported one and the same reward ("" otherwise)."""
        rewards = [r["reward"] for r in self.rows.values() if r["status"] == "ok" and r["reward"] is not None]
        if self.kind != "fork" or len(rewards) < 2 or len(rewards) < len(self.rows) or len(set(rewards)) != 1:
            return ""
        no_reseed = "--no-reseed" if self.magic_words else "reseed=False"
        why = (f"{no_reseed} left the random streams made before the fork as they were"
               if not self.reseed else "their random streams may not depend on SEED")
        return (f"all {len(rewards)} branches reported the same reward {rewards[0]:.6g}: {why} "
                "(seed yours from SEED: np.random.default_rng(SEED), env.reset(seed=SEED))")

    @property
    def unrewarded(self) -> str:
        """What to say when branches finished ok but none reported a reward ("" otherwise)."""
        if self.best is not None or not self.counts().get("ok"):
            return ""
        text = "no branch reported a reward (set `reward = ...` or call `smolbench_guest.report(reward=...)`)"
        if self.kind == "fork" and self.keep == "best" and self.ended is not None:
            best, keep_all = ("`--keep best`", "`--keep all`") if self.magic_words else ("keep='best'", "keep='all'")
            text += f", so {best} kept none: every branch was deleted ({keep_all} keeps them)"
        return text

    def composite_error(self) -> CompositeError | None:
        """An aggregated error for every failed branch (this result as its ``.result``), or None if all are ok."""
        failed = self.failed
        if not failed:
            return None
        errors: list[Any] = []
        for r in failed:
            errors.append(self.remote_errors.get(r["branch"])
                          or f"[{r['branch']}] {r['status']}: {terminal.printable(str(r['error'] or ''))}")
        counts = ", ".join(f"{v} {k}" for k, v in sorted(self.counts().items()) if k in ("error", "timeout", "cancelled"))
        first = failed[0]
        unit = "episodes" if self.kind == "episodes" else "branches"
        # every episode missing a name: most likely one the active machine has, which they never saw
        missing = len(failed) == len(self) and all(str(r["error"] or "").startswith("NameError") for r in failed)
        hint = f"; {self.fresh_hint}" if self.fresh_hint and missing else ""
        # ... or a module: most likely one `%pip` installed there (episodes see the Smolfile's packages only)
        if self.fresh_module_hint and len(failed) == len(self) and all(
                str(r["error"] or "").startswith(("ModuleNotFoundError", "ImportError")) for r in failed):
            hint = f"; {self.fresh_module_hint}"
        said = terminal.printable(str(first["error"] or ""))  # the machine's words: a script prints them raw
        return CompositeError(f"{len(failed)} of {len(self)} {unit} failed ({counts}); first: "
                              f"[{first['branch']}] {first['status']}: {said}{hint}", errors, unit, self)

    def raise_for_errors(self) -> None:
        """Raise a CompositeError if any branch failed."""
        err = self.composite_error()
        if err is not None:
            raise err

    def to_pandas(self) -> pd.DataFrame:
        """One row per branch, metrics expanded into their own columns."""
        import pandas as pd

        rows = []
        for r in self.rows.values():
            rec = {k: r[k] for k in COLUMNS if k != "metrics"}
            for mk, mv in (r["metrics"] or {}).items():
                rec[f"m.{mk}"] = mv
            rows.append(rec)
        return pd.DataFrame(rows, columns=None)

    def plot(self, **kwargs: Any) -> Any:
        """Reward plots for this fan-out (see ``smolbench.widgets.plots``)."""
        from .widgets.plots import reward_figure

        return reward_figure(self, **kwargs)

    # -- display ----------------------------------------------------------------------

    def __repr__(self) -> str:
        lines = [self.summary(), *self.notes]
        for r in self.rows.values():
            rew = "" if r["reward"] is None else f"{r['reward']:.6g}"
            wall = "" if r["wall"] is None else f"{r['wall']:.2f}s"
            why = f"  {reason(r)}" if r["status"] in ("error", "timeout", "cancelled") else ""
            lines.append(f"  {r['branch']:<14} seed={r['seed']!s:<6} {_status(r):<9} {rew:>12} {wall:>8}{why}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        best = self.best
        failed = bool(self.failed)
        cols = ("branch", "seed", "status", "reward", "wall (s)", "metrics") + (("why it failed",) if failed else ())
        head = "".join(f"<th>{c}</th>" for c in cols)
        body = []
        for r in self.rows.values():
            style = ' style="font-weight:bold"' if best is not None and r["branch"] == best["branch"] else ""
            rew = "" if r["reward"] is None or (isinstance(r["reward"], float) and math.isnan(r["reward"])) else f"{r['reward']:.6g}"
            wall = "" if r["wall"] is None else f"{r['wall']:.2f}"
            metrics = ", ".join(f"{k}={v}" for k, v in (r["metrics"] or {}).items())
            status = str(r["status"])
            color = STATUS_COLORS.get(status, "inherit")
            why = ""
            if failed:
                why = f"<td>{html.escape(reason(r))}</td>" if status in ("error", "timeout", "cancelled") else "<td></td>"
            body.append(
                f"<tr{style}><td>{html.escape(r['branch'])}</td><td>{html.escape(str(r['seed']))}</td>"
                f"<td class='sb-st-{html.escape(status)}' style='color:{color}'>{html.escape(_status(r))}</td>"
                f"<td>{rew}</td><td>{wall}</td><td>{html.escape(metrics)}</td>{why}</tr>"
            )
        dark = "".join(f'body[data-jp-theme-light="false"] .smolbench-forkresult .sb-st-{k}{{color:{v} !important}}'
                       for k, v in STATUS_COLORS_DARK.items())
        return (
            f"<div class='smolbench-forkresult {INERT_CLASSES}'><style>{dark}</style><p>{html.escape(self.summary())}</p>"
            + "".join(f"<p>{html.escape(note)}</p>" for note in self.notes) +
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div>"
        )


def _interrupted(message: str) -> KeyboardInterrupt:
    """A KeyboardInterrupt that IPython shows as one line (as the magics' ``interrupted``)."""
    cls = type("KeyboardInterrupt", (KeyboardInterrupt,), {"_render_traceback_": lambda self: [f"KeyboardInterrupt: {self}"]})
    return cls(message)


@dataclass
class RunResult:
    """What :meth:`Session.run` brings back from the machine.

    ``stdout`` and ``stderr`` are what the code printed, as a ``%%smol`` cell shows it: all of
    it up to the cell's output limit (5 MB: ``smolbench.gate.limits.configure("output-limit",
    "20M")`` sets it, as ``%smol config output-limit 20M`` does; lines over 256 KiB are cut
    with a note). Past the limit the rest goes to a log under ``.smolbench/outputs/`` (beside
    another ledger, ``<ledger file>.outputs/``), the stream that lost some ends with the cell's
    line ``… 47 MB more output not shown (saved to
    .smolbench/outputs/root.cell3-20261204-101010-1a2b3c.log)``, and ``output_log`` is that log's absolute path
    (None when nothing was held back).

    ``value`` is the cell's last expression rebuilt as data (builtins, numpy arrays, pandas
    objects; None when it was something else: ``display`` still has its text). ``error`` is the
    exception the code raised in the machine (None when it ran to the end): a
    :class:`~smolbench.RemoteError` that is also an instance of the built-in exception of its
    name (``except ZeroDivisionError`` catches it; see :func:`smolbench.errors.remote_error`).

    ``displays`` are what the code displayed (``display(...)``, IPython's ``display``, a
    matplotlib figure: ``plt.show()`` and figures left open at the end, as PNG), each bundle
    checked by the gate as a ``%%smol`` cell shows it, as a notebook would keep them at the
    end (a display updated through its ``display_id`` holds its last drawing; ``clear_output``
    leaves only what was displayed after it); ``notes`` are the host's own lines about the output
    (what was not shown, and why: too many displays, a script or HTML the gate dropped)."""

    node: str
    stdout: str = ""
    stderr: str = ""
    value: Any = None
    error: RemoteError | None = None
    pulled: dict[str, Any] = field(default_factory=dict)
    reward: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    display: SafeBundle | None = None  # the last expression's MIME bundle, checked by the gate
    pull_error: str | None = None  # a pull the gate refused (one line; run() raises it)
    reward_error: str | None = None  # a reward that was not a finite number: said, not recorded
    output_log: str | None = None  # where the output past the cell's limit went (absolute path), if any
    displays: list[SafeBundle] = field(default_factory=list)  # what the code displayed, checked by the gate
    notes: list[str] = field(default_factory=list)  # the host's lines on output not shown, in the Session's words

    @property
    def ok(self) -> bool:
        """True when the code ran to the end."""
        return self.error is None

    def raise_for_error(self) -> RunResult:
        """Raise the machine's exception (a RemoteError named after it, and an instance of the
        built-in exception of that name when there is one) if there was one."""
        if self.error is not None:
            raise self.error
        return self


class Seen:
    """What a cell showed besides its text, as its events came (:meth:`Session.run` has no view):
    its displays, and the gate's notes in the Session's words."""

    def __init__(self) -> None:
        self.displays: list[SafeBundle] = []
        self.notes: list[str] = []
        self._ids: dict[str, int] = {}  # a display's id -> its place in ``displays``

    def __call__(self, ev: Event) -> None:
        if ev.kind == "display" and isinstance(ev.data, SafeBundle):
            at = self._ids.get(ev.display_id) if ev.display_id is not None else None
            if ev.update:  # redrawn in place (an id never shown: nothing to redraw, as in a notebook)
                if at is not None:
                    self.displays[at] = ev.data
                return
            if ev.display_id is not None:
                self._ids[ev.display_id] = len(self.displays)
            self.displays.append(ev.data)
        elif ev.kind == "clear":  # what the cell shows is what it drew since
            self.displays.clear()
            self._ids.clear()
        elif ev.note:
            self.notes.append(session_phrases(ev.text).rstrip("\n"))


def run_result(node: str, res: CellResult, value: bool, wanted: list[str], seen: Seen | None = None) -> RunResult:
    """The RunResult of a cell's checked result ``res`` (``seen``: its displays and notes)."""
    pulled = dict(res.pulled)
    val = pulled.pop(VALUE, None) if value else None
    err = None
    if res.status != "ok":
        e = res.error or {}
        err = remote_error(e.get("ename", "Error"), e.get("evalue", ""), e.get("traceback", []), node)
    pull_error = None
    missing = [n for n in wanted if n not in res.pulled]
    if res.pull_error and missing:  # the last expression's own refusal is no error: value stays None
        pull_error = (res.pull_error if not res.pull_error.startswith(f"--pull {VALUE}:")
                      else f"--pull {missing[0]}: refused by the gate (not plain data)")
    display = res.result if isinstance(res.result, SafeBundle) else None
    return RunResult(node, res.stdout, res.stderr, val, err, pulled, res.reward,
                     {k: v for k, v in res.metrics.items() if k != "reward_error"}, display, pull_error,
                     res.metrics.get("reward_error") or None, res.output_log,
                     list(seen.displays) if seen else [], list(seen.notes) if seen else [])
