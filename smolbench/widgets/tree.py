"""The fork-tree widget: one anywidget model per display, its ESM shipped beside it.

A fork cell's view shows that fork: the path from the root to its parent, its branches and
whatever was forked from them with this view's Fork ×N button, with the best of *this* fork
starred. A toggle asks for the whole session (``%smol tree`` starts there). Clicks select a
node (in the frontend only); the Use / Fork ×N / Checkpoint / Delete buttons send a custom
message that is handled here by calling the Workbench on smolbench's loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import traitlets as t

from .. import _shown
from ..gate import terminal
from ..tree import Node, best_key
from ._base import WorkbenchView, clean, view_module
from .checkpoints import _saved_text
from .static import tree_html

HERE = Path(__file__).parent
ACTIONS = ("use", "fork", "checkpoint", "delete")
MAX_FORK = 256  # branches one click may ask for
ERROR_CHARS = 300
LOG_CHARS = 32 * 1024  # the Fork ×N log keeps its last 32 kB


def node_record(node: Any) -> dict[str, Any]:
    """A tree node as the plain data the widget shows: its metrics cut as the sidebar's are
    (:func:`smolbench._shown.metrics`; every node is in each update the view sends)."""
    wall = node.wall
    return {
        "id": node.id,
        "parent": node.parent,
        "seed": node.seed,
        "status": _shown.status(node.status),  # a CSS class name in tree.js and the static copy
        "reward": clean(node.reward),
        "wall": None if wall is None else round(wall, 3),
        "alive": bool(node.alive),
        "kept": bool(node.kept),
        "checkpoint": node.checkpoint,
        "depth": node.depth,
        "metrics": _shown.metrics(node.metrics),
        "error": (node.error or "")[:ERROR_CHARS] or None,
        # the Ray node of a cluster machine (None elsewhere): id, backend kind, host, and where it was lost
        "where": getattr(node, "where", None),
        "where_kind": getattr(node, "where_kind", None),
        "where_host": getattr(node, "where_host", None),
        "moved_from": getattr(node, "moved_from", None),
    }


def blocked_actions(node: dict[str, Any], active: str | None, can_fork: bool) -> dict[str, str]:
    """Why each button is disabled for ``node`` (an action missing here is allowed)."""
    nid = node["id"]
    if not node["alive"]:
        why = (
            f"{nid} was deleted (its machine is gone): select a live node, or `%smol replay {nid}`"
        )
        return {"use": why, "fork": why, "checkpoint": why, "delete": f"{nid} is already deleted"}
    out: dict[str, str] = {}
    if node["status"] in ("starting", "running"):
        why = f"{nid} is still running: wait for its fork to finish"
        return {"use": why, "fork": why, "checkpoint": why, "delete": why}
    if node.get("busy"):
        why = f"a cell or fork is running in {nid}: wait for it to finish"
        out.update(fork=why, checkpoint=why, delete=why)
    if nid == active:
        out["use"] = f"{nid} is already the active machine"
    if not can_fork:
        out["fork"] = "no fork has run in this session yet: run a `%%smol fork N` cell first"
    return out


def fork_scope(nodes: dict[str, Node], runs: set[str], parent: str | None) -> list[str]:
    """Ids a fork's view shows: the path from the root to ``parent``, then every node made by
    one of ``runs`` (the fork and those started from its view), parents before children."""
    path: list[str] = []
    cur = parent
    while cur is not None and cur in nodes:
        path.append(cur)
        cur = nodes[cur].parent
    mine = [n.id for n in nodes.values() if n.run_id in runs]
    return path[::-1] + [i for i in mine if i not in path]


def best_in(nodes: dict[str, Node], ids: list[str]) -> list[str]:
    """The path from the root to the best-rewarded ok node among ``ids`` ([] if none)."""
    scored = [nodes[i] for i in ids if nodes[i].status == "ok" and nodes[i].reward is not None]
    if not scored:
        return []
    best = min(scored, key=lambda n: best_key(n.id, n.reward))
    path = []
    cur: str | None = best.id
    while cur is not None and cur in nodes:
        path.append(cur)
        cur = nodes[cur].parent
    return path[::-1]


def next_seed(nodes: dict[str, Node]) -> int | None:
    """Where Fork ×N's automatic seeds start: one past the highest seed used in the session
    (on any node, deleted ones too), so automatic seeds never repeat; None before any seed."""
    seeds = [n.seed for n in nodes.values() if n.seed is not None]
    return max(seeds) + 1 if seeds else None


class TreeWidget(WorkbenchView):
    """A fork tree of a Workbench, live: one fork (or the whole session), status colours,
    rewards, the best path, actions."""

    _esm = view_module("tree.js")
    _css = HERE / "tree.css"
    actions = ACTIONS
    after_down = "these machines were deleted by `%smol down`: use the tree of the new `%smol up`"

    nodes = t.List(
        t.Dict(),
        help="the nodes in scope: id, parent, seed, status, reward, wall, alive, kept, "
        "checkpoint, depth, metrics, error, where (cluster node), where_kind, where_host, moved_from, "
        "blocked, mine, next_seed",
    ).tag(sync=True)
    active = t.Unicode(None, allow_none=True, help="the active node").tag(sync=True)
    best_path = t.List(t.Unicode(), help="ids from a root to the best node in scope").tag(sync=True)
    selected = t.Unicode("", help="the selected node (kept in the frontend)").tag(sync=True)
    can_fork = t.Bool(False, help="a fork ran in this session, so Fork ×N has code to run").tag(
        sync=True
    )
    info = t.Unicode("", help="backend and session, shown in the header").tag(sync=True)
    scope = t.Unicode("session", help="'fork' (this fork) or 'session' (every node)").tag(sync=True)
    title = t.Unicode("fork tree", help="what the header calls this view").tag(sync=True)
    log = t.Unicode("", help="output of forks started from this view (last 32 kB)").tag(sync=True)

    def __init__(self, workbench: Any, *, result: Any = None, shell: Any = None) -> None:
        self.runs: set[str] = set()
        self.fork_parent: str | None = None
        self.fork_code: str | None = None
        if result is not None:
            self.runs.add(result.run_id)
            self.fork_parent = result.parent
        self._scope = "fork" if result is not None else "session"
        self._episodes = result is not None and result.kind == "episodes"  # its nodes: the episodes alone
        self._scope_ids: set[str] = set()
        self._log: list[str] = []
        title = "fork tree"
        if result is not None:
            where = f" from {result.parent}" if result.parent else ""
            title = f"{result.kind} of {len(result)}{where}"
        super().__init__(workbench, shell=shell, scope=self._scope, title=title)

    # -- what this view shows --------------------------------------------------------------

    def _ids(self) -> list[str]:
        nodes = self.workbench.tree.nodes
        if self._scope == "session" or not self.runs:
            return list(nodes)
        return fork_scope(nodes, self.runs, self.fork_parent)

    def snapshot(self) -> dict[str, Any]:
        wb = self.workbench
        all_nodes = dict(wb.tree.nodes)
        ids = self._ids()
        self._scope_ids = set(ids)
        can_fork = self.last_fork() is not None
        # nodes running a cell or being forked right now: shown by the newest view (_base.newest_view);
        # the others' buttons stay as they were, and a click on a busy node is answered with why
        busy = set(getattr(wb, "_busy", ())) if self.shows_busy() else set()
        auto = next_seed(all_nodes)
        base = self._default_base() if auto is None else auto
        records = []
        for i in ids:
            rec = node_record(all_nodes[i])
            rec["busy"] = i in busy
            rec["blocked"] = blocked_actions(rec, wb.active, can_fork)
            rec["mine"] = all_nodes[i].run_id in self.runs
            rec["next_seed"] = base
            records.append(rec)
        if self.runs and self._scope == "fork":
            best = best_in(all_nodes, [i for i in ids if all_nodes[i].run_id in self.runs])
        else:
            best = wb.tree.best_path()
        # a fork's view counts its own nodes' machines: a later fork elsewhere changes nothing here
        whole = self._scope == "session" or not self.runs
        live = sum(1 for n in all_nodes.values() if n.alive) if whole else sum(1 for i in ids if all_nodes[i].alive)
        plural = "s" if live != 1 else ""
        info = f"{wb.backend.name} · session {wb.session} · {live} live machine{plural}" + ("" if whole else " in this view")
        if not wb.machines:
            info += " · down: `%smol up` starts a new tree"
        return {
            "nodes": records,
            "active": wb.active,
            "best_path": best,
            "can_fork": can_fork,
            "info": info,
        }

    def concerns(self, nodes: list[Any]) -> bool:
        if self._scope == "session" or not nodes:
            return True
        return any(n.id in self._scope_ids or n.run_id in self.runs for n in nodes)

    def on_scope(self, content: dict[str, Any]) -> None:
        scope = content.get("scope")
        if scope in ("fork", "session") and (scope == "session" or self.runs):
            with self._lock:
                self._scope = str(scope)
                self.scope = self._scope
            self.flush()

    def static_html(self) -> str:
        return tree_html(
            list(self.nodes),
            active=self.active,
            best_path=list(self.best_path),
            title=f"smolbench {self.title}",
            info=self.info,
            log=self.log,
        )

    def static_text(self) -> str:
        """The whole-session view as an indented text tree; a fork's view as its summary."""
        if self._scope == "session":
            return f"{self!r}\n{self.workbench.tree.render(self.active)}"
        return repr(self)

    def __repr__(self) -> str:
        """What a viewer without widget support shows (also the saved notebook's text)."""
        nodes = list(self.nodes)
        live = sum(1 for n in nodes if n["alive"])
        best = self.best_path[-1] if self.best_path else None
        rec = next((n for n in nodes if n["id"] == best), None)
        tail = (
            f" · best reward {rec['reward']:.6g} on {best}"
            if rec is not None and rec["reward"] is not None
            else ""
        )
        active = f"active machine {self.active}" if self.active else "no active machine"
        if not nodes:  # a fan-out not started yet (episodes have no parent in their view)
            return f"smolbench {self.title}: starting · {active}"
        count = f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}"
        if self._episodes:  # the session's other machines (the active one) are not in this view
            alive = f"{live} of their machines alive" if live else "their machines deleted"
        else:
            alive = f"{live} machine{'s' if live != 1 else ''} alive" if live else "every machine deleted"
        return f"smolbench {self.title}: {count} · {alive} · {active}{tail}"

    def last_fork(self) -> dict[str, Any] | None:
        """The ledger's record of the fork Fork ×N re-runs: this view's own fork, or else the
        session's most recent one (its code and options)."""
        wb = self.workbench
        run_id = next(iter(sorted(self.runs)), None) if self.runs else None
        if run_id is None:
            run_id = next(
                (
                    n.run_id
                    for n in reversed(list(wb.tree.nodes.values()))
                    if n.parent is not None and n.run_id
                ),
                None,
            )  # fork branches have a parent
        if run_id is None:
            return None
        cached: dict[str, Any] | None = getattr(self, "_fork_run", None)
        if cached is None or cached.get("id") != run_id:
            cached = next(
                (r for r in wb.ledger.run_rows() if r.get("id") == run_id and r.get("code")), None
            )
            self._fork_run = cached
        return cached

    def _default_base(self) -> int:
        """Where a Fork ×N of a node without seeded children starts: the fork's own base."""
        run = self.last_fork()
        raw = (run or {}).get("options")
        seeds = [s for s in (raw.get("seeds") or [] if isinstance(raw, dict) else []) if s is not None]
        return min(int(s) for s in seeds) if seeds else 0

    # -- clicks ------------------------------------------------------------------------------

    def handle_action(self, action: str, content: dict[str, Any], request: str) -> None:
        wb = self.workbench
        node_id = str(content.get("node") or "")
        if node_id not in wb.tree:
            self.reply(
                request, "error", f"unknown node {node_id!r}: click a node in the tree first"
            )
            return
        rec = node_record(wb.tree[node_id])
        rec["busy"] = node_id in set(getattr(wb, "_busy", ()))
        why = blocked_actions(rec, wb.active, self.last_fork() is not None).get(action)
        if why:
            self.reply(request, "error", why)
            return
        if action == "use":
            self.run_async(
                request, _call(wb.use, node_id), lambda n: f"{n.id} is now the active machine"
            )
        elif action == "delete":
            self.run_async(
                request,
                wb.delete(node_id),
                lambda gone: (
                    (f"deleted {', '.join(gone)}" + (f"; {wb.moved}" if wb.moved else ""))
                    if gone
                    else f"{node_id}: nothing to delete"
                ),
            )
        elif action == "checkpoint":
            self.run_async(request, wb.checkpoint_save(None, node_id), _saved_text)
        else:
            self._fork(node_id, content.get("n"), content.get("seed_base"), request)

    def _fork(self, node_id: str, n_raw: Any, base_raw: Any, request: str) -> None:
        wb = self.workbench
        try:
            n = int(n_raw)
        except (TypeError, ValueError):
            self.reply(request, "error", f"Fork ×N needs a whole number of branches, got {n_raw!r}")
            return
        if not 1 <= n <= MAX_FORK:
            self.reply(request, "error", f"Fork ×N takes 1 to {MAX_FORK} branches, got {n}")
            return
        if base_raw in (None, ""):
            auto = next_seed(dict(wb.tree.nodes))
            base = self._default_base() if auto is None else auto
        else:
            try:
                base = int(base_raw)
            except (TypeError, ValueError):
                self.reply(request, "error", f"the seed base must be a whole number, got {base_raw!r}")
                return
        run = self.last_fork()
        if run is None:
            self.reply(
                request,
                "error",
                "no fork has run in this session yet: run a `%%smol fork N` cell first",
            )
            return
        raw = run.get("options")
        opts: dict[str, Any] = raw if isinstance(raw, dict) else {}
        timeout = opts.get("timeout")
        keep = opts.get("keep") or "best"
        code = str(run["code"])
        label = f"fork {node_id} ×{n} (seeds {base}..{base + n - 1})"

        def on_event(branch: str, ev: Any) -> None:
            if getattr(ev, "kind", "") == "stream" and ev.text:
                self._append_log(terminal.prefixed(branch, terminal.plain(ev.text)))

        async def fork() -> Any:
            # Laid out and run on the loop, like every Workbench change a click makes (never
            # block on the loop here: the frontend's message handler holds the view's lock).
            result = wb.new_fork(n, None, base, timeout=timeout, keep=keep, parent=node_id)
            self.runs.add(result.run_id)
            self._append_log(f"--- {label}\n")
            self.reply(request, "info", f"{label}: running the fork's cell in {len(result)} branches…")
            await wb.fork(result, code, on_event, timeout=timeout, keep=keep)
            self._append_log(f"--- {result.summary()}\n")
            return result

        def done(result: Any) -> str:
            return str(result.summary())

        fut = self.run_async(
            request, fork(), done, level=lambda result: "error" if result.failed else "ok"
        )
        self.track(fut, label)

    def _append_log(self, text: str) -> None:
        with self._lock:
            self._log.append(text if text.endswith("\n") else text + "\n")
            joined = "".join(self._log)[-LOG_CHARS:]
            self._log = [joined]
            self.log = joined


async def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """A sync Workbench method, run on the smolbench loop like the async ones."""
    return fn(*args, **kwargs)


# -- the views of each Workbench (detached together by `%smol down`) -----------------------

_TREES: dict[int, list[TreeWidget]] = {}


def tree_widget(workbench: Any, shell: Any = None, result: Any = None) -> TreeWidget:
    """A new view of the Workbench's tree: of one fork (``result``) or the whole session."""
    if shell is None:
        try:
            from IPython import get_ipython

            shell = get_ipython()
        except Exception:
            shell = None
    w = TreeWidget(workbench, result=result, shell=shell)
    _TREES.setdefault(id(workbench), []).append(w)
    return w


def close_tree(workbench: Any) -> None:
    """Detach the Workbench's tree views (after ``%smol down``); they keep their last state."""
    for w in _TREES.pop(id(workbench), []):
        w.detach()
