"""The live fork-tree widget: one anywidget model per Workbench, its ESM shipped beside it.

One synced list holds every node (not one widget per node). Clicks select a node; the
Use / Fork ×N / Checkpoint / Delete buttons send a custom message that is handled here
by calling the Workbench on smolbench's loop, and answered with a one-line reply.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import traitlets as t

from ._base import WorkbenchView, clean, close_view, view_for
from .checkpoints import _saved_text

HERE = Path(__file__).parent
ACTIONS = ("use", "fork", "checkpoint", "delete")
MAX_FORK = 256  # branches one click may ask for
ERROR_CHARS = 300


def node_record(node: Any) -> dict[str, Any]:
    """A tree node as the plain data the widget shows."""
    wall = node.wall
    return {
        "id": node.id,
        "parent": node.parent,
        "seed": node.seed,
        "status": node.status,
        "reward": clean(node.reward),
        "wall": None if wall is None else round(wall, 3),
        "alive": bool(node.alive),
        "kept": bool(node.kept),
        "checkpoint": node.checkpoint,
        "depth": node.depth,
        "metrics": clean(node.metrics or {}),
        "error": (node.error or "")[:ERROR_CHARS] or None,
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


class TreeWidget(WorkbenchView):
    """The fork tree of a Workbench, live: status colours, rewards, the best path, actions."""

    _esm = HERE / "tree.js"
    _css = HERE / "tree.css"
    actions = ACTIONS
    after_down = "these machines were deleted by `%smol down`: use the tree of the new `%smol up`"

    nodes = t.List(
        t.Dict(),
        help="every node: id, parent, seed, status, reward, wall, alive, kept, "
        "checkpoint, depth, metrics, error, blocked",
    ).tag(sync=True)
    active = t.Unicode(None, allow_none=True, help="the active node").tag(sync=True)
    best_path = t.List(t.Unicode(), help="ids from a root to the best-rewarded node").tag(sync=True)
    selected = t.Unicode("", help="the node the buttons act on (set by clicks)").tag(sync=True)
    can_fork = t.Bool(False, help="a fork ran in this session, so Fork ×N has code to run").tag(
        sync=True
    )
    info = t.Unicode("", help="backend and session, shown in the header").tag(sync=True)

    def snapshot(self) -> dict[str, Any]:
        wb = self.workbench
        nodes = [node_record(n) for n in list(wb.tree.nodes.values())]
        can_fork = self.last_fork() is not None
        busy = set(getattr(wb, "_busy", ()))  # nodes running a cell or being forked right now
        for rec in nodes:
            rec["busy"] = rec["id"] in busy
            rec["blocked"] = blocked_actions(rec, wb.active, can_fork)
        live = sum(1 for n in nodes if n["alive"])
        plural = "s" if live != 1 else ""
        info = f"{wb.backend.name} · session {wb.session} · {live} live machine{plural}"
        if not wb.machines:
            info += " · down: `%smol up` starts a new tree"
        return {
            "nodes": nodes,
            "active": wb.active,
            "best_path": wb.tree.best_path(),
            "can_fork": can_fork,
            "info": info,
        }

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
        return f"smolbench fork tree: {len(nodes)} nodes · {live} live · active {self.active}{tail}"

    def last_fork(self) -> dict[str, Any] | None:
        """The ledger's record of this session's most recent fork (its code and options)."""
        wb = self.workbench
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

    # -- clicks ------------------------------------------------------------------------------

    def handle_action(self, action: str, content: dict[str, Any], request: str) -> None:
        wb = self.workbench
        node_id = str(content.get("node") or self.selected or "")
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
                    f"deleted {', '.join(gone)}" if gone else f"{node_id}: nothing to delete"
                ),
            )
        elif action == "checkpoint":
            self.run_async(request, wb.checkpoint_save(None, node_id), _saved_text)
        else:
            self._fork(node_id, content.get("n"), request)

    def _fork(self, node_id: str, n_raw: Any, request: str) -> None:
        wb = self.workbench
        try:
            n = int(n_raw)
        except (TypeError, ValueError):
            self.reply(request, "error", f"Fork ×N needs a whole number of branches, got {n_raw!r}")
            return
        if not 1 <= n <= MAX_FORK:
            self.reply(request, "error", f"Fork ×N takes 1 to {MAX_FORK} branches, got {n}")
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
        seeds = opts.get("seeds") or [0]
        base = (
            min(int(s) for s in seeds if s is not None) if any(s is not None for s in seeds) else 0
        )
        timeout = opts.get("timeout")
        keep = opts.get("keep") or "best"
        code = str(run["code"])
        label = f"fork {node_id} ×{n}"

        async def fork() -> Any:
            # Laid out and run on the loop, like every Workbench change a click makes (never
            # block on the loop here: the frontend's message handler holds the view's lock).
            result = wb.new_fork(n, None, base, timeout=timeout, keep=keep, parent=node_id)
            self.reply(
                request, "info", f"{label}: running the last fork's cell in {len(result)} branches…"
            )
            await wb.fork(result, code, lambda branch, ev: None, timeout=timeout, keep=keep)
            return result

        def done(result: Any) -> str:
            return result.summary()

        fut = self.run_async(
            request, fork(), done, level=lambda result: "error" if result.failed else "ok"
        )
        self.track(fut, label)


async def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """A sync Workbench method, run on the smolbench loop like the async ones."""
    return fn(*args, **kwargs)


# -- one view model per Workbench ------------------------------------------------------------

_TREES: dict[int, TreeWidget] = {}


def tree_widget(workbench: Any, shell: Any = None) -> TreeWidget:
    """The Workbench's tree widget (made on first use; display it as often as you like)."""
    return view_for(_TREES, TreeWidget, workbench, shell)[0]


def close_tree(workbench: Any) -> None:
    """Detach the Workbench's tree widget (after ``%smol down``); it keeps its last state."""
    close_view(_TREES, workbench)
