"""The checkpoint panel: the ledger's checkpoints with Save, Restore and Delete buttons.

A panel follows the kernel's Workbench across ``%smol down`` / ``up``: while nothing is up
it still lists (and deletes) checkpoints from the ledger; the next ``up`` binds it again.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import traitlets as t

from .. import _shown
from .._format import size_text, time_text
from .._shelflist import foreign, more_line
from ..checkpoints import SESSIONS_HERE
from ..gate import restoring
from ..shelf import IMPORTED, Shelf
from ._base import WorkbenchView, clean, view_module
from .static import checkpoints_html

HERE = Path(__file__).parent
ACTIONS = ("save", "restore", "delete")
DOWN = "no machine is up: `%smol up` first (deleting a checkpoint works without one)"


def checkpoint_record(row: dict[str, Any], backend: str) -> dict[str, Any]:
    """A ledger checkpoint row as the plain data the panel shows, with why it can't be restored."""
    exists = bool(row.get("exists"))  # the gate's rule lets its file be read (smolbench._shelflist.describe)
    why = ""
    if not backend:
        why = DOWN.split(" (")[0]
    elif refused := restoring.refusal(str(row.get("name")), row.get("backend"), backend,
                                      row.get("session_id") in SESSIONS_HERE and not row.get("foreign")):
        why = refused  # as the restore would say it (never the process backend for someone else's)
    elif row.get("foreign") and "smol" in (row.get("backend"), backend):  # not signed as this user's
        why = foreign(row.get("name"), "smol")
    elif row.get("refused"):
        why = str(row["refused"])
    elif not exists:
        why = f"its file {row.get('file') or row.get('path')} is missing: delete it"
    created = row.get("created")
    warnings = [str(_shown.text(w)) for w in row["warnings"]] if isinstance(row.get("warnings"), list) else []
    theirs = row.get("dropped") or row.get("session_id") == IMPORTED  # a file's own words (its record's)
    shown = clean(restoring.claimed(warnings) if theirs else warnings)
    if row.get("foreign") and not why:  # said first: a row not signed as this user's (_shelflist.describe)
        shown = [f"foreign: {row['foreign']}; `%smol checkpoint trust {row.get('name')}` if you saved it", *shown]
    return {
        "name": row.get("name"),
        "node": f"{row['node_id']} (the file says)" if theirs and row.get("node_id") else row.get("node_id"),
        "created": clean(created),
        "created_text": time_text(created),
        "size": row.get("size"),
        "size_text": size_text(row.get("size")),
        "backend": row.get("backend"),
        "exists": exists,
        "warnings": shown,
        "blocked": {"restore": why} if why else {},
    }


class CheckpointPanel(WorkbenchView):
    """The ledger's checkpoints: list, save, restore, delete."""

    _esm = view_module("checkpoints.js")
    _css = HERE / "checkpoints.css"
    actions = ACTIONS

    checkpoints = t.List(t.Dict(), help="name, node, created, size, backend, exists, warnings").tag(
        sync=True
    )
    live_nodes = t.List(t.Unicode(), help="nodes that can be saved").tag(sync=True)
    active = t.Unicode(None, allow_none=True, help="the active node (saved by default)").tag(
        sync=True
    )
    backend = t.Unicode("", help="this Workbench's backend ('' while nothing is up)").tag(sync=True)
    more = t.Unicode("", help="how many checkpoints are not listed ('' when all are)").tag(sync=True)

    def __init__(self, workbench: Any, *, shell: Any = None) -> None:
        self.ledger = workbench.ledger
        # The listing, read again only when checkpoints may have changed (a cell's busy and idle
        # changes read a copied folder's 10,000 rows on smolbench's loop: 0.2 s cells took 2-3 s).
        self._stale = True
        self._listed: tuple[Any, list[dict[str, Any]], str] | None = None  # (backend, records, more)
        self._seen: tuple[Any, ...] | None = None  # what the panel showed of the tree (see concerns)
        super().__init__(workbench, shell=shell)

    def snapshot(self) -> dict[str, Any]:
        wb = self.workbench
        backend = wb.backend.name if wb is not None and wb.machines else ""
        if self._stale or self._listed is None or self._listed[0] != backend:
            self._stale = False  # before the read: a change made during it marks it stale again
            shelf = wb.shelf if wb is not None else Shelf(self.ledger)
            rows, total, left = shelf.listing()
            more = " ".join(line for line in (more_line(total) if total > _shown.MAX_ROWS else "", left or "") if line)
            self._listed = (backend, [checkpoint_record(r, backend) for r in rows], more)
        live = [n.id for n in list(wb.tree.nodes.values()) if n.id in wb.machines] if wb else []
        self._seen = self._tree_state()
        return {
            "checkpoints": self._listed[1],
            "more": self._listed[2],
            "live_nodes": live,
            "active": wb.active if wb is not None else None,
            "backend": backend,
        }

    def _tree_state(self) -> tuple[Any, ...]:
        """What the panel shows that a node's change can alter: the live nodes, the active one,
        each node's checkpoint badge (a save or a restore made elsewhere sets it)."""
        wb = self.workbench
        if wb is None:
            return ()
        nodes = list(wb.tree.nodes.values())
        return (wb.active, tuple(sorted(wb.machines)), tuple((n.id, n.checkpoint) for n in nodes))

    def concerns(self, nodes: list[Any]) -> bool:
        """A change with no nodes is the checkpoint watcher's (the ledger's rows or the folder
        changed): list them again. A node's change concerns the panel only when it changed
        what the panel shows of the tree; a badge that moved lists the checkpoints again."""
        if not nodes:
            self._stale = True
            return True
        now = self._tree_state()
        if now == self._seen:
            return False
        if self._seen is None or len(now) < 3 or now[2] != self._seen[2]:
            self._stale = True
        return True

    def static_html(self) -> str:
        return checkpoints_html(list(self.checkpoints), self.backend or "none up", self.more)

    def __repr__(self) -> str:
        """What a viewer without widget support shows."""
        names = ", ".join(str(c["name"]) for c in self.checkpoints) or "none"
        return f"smolbench checkpoints ({self.backend or 'none up'}): {names}"

    def reply(self, request: str, level: str, text: str) -> None:
        """As for every view; the panel's "replace" box is its --force."""
        super().reply(request, level, text.replace("add --force", "tick “replace”"))

    # -- following the kernel's Workbench ----------------------------------------------------

    def pause(self) -> None:
        """The Workbench went down: keep listing from the ledger until the next ``up``."""
        if self.workbench is not None:
            self.workbench.unobserve(self._on_change)
        self.workbench = None
        self._stale = True
        self.flush(resend=True)

    def follow(self, workbench: Any) -> None:
        """Bind to the kernel's new Workbench (after ``%smol up``)."""
        if self.workbench is workbench:
            return
        self.pause()
        self.workbench = workbench
        self.ledger = workbench.ledger
        self._stale = True
        workbench.observe(self._on_change)
        self.flush(resend=True)

    # -- clicks ------------------------------------------------------------------------------

    def run_async(self, request: str, coro: Any, done: Any, level: Any = None) -> Any:
        """As for every view; the listing is read again after the action (it saved, restored or
        deleted a checkpoint)."""

        async def then_list() -> Any:
            try:
                return await coro
            finally:
                self._stale = True

        return super().run_async(request, then_list(), done, level)

    def handle_action(self, action: str, content: dict[str, Any], request: str) -> None:
        wb = self.workbench
        name = str(content.get("name") or "").strip() or None
        if action == "delete":
            if name is None:
                self.reply(request, "error", "pick a checkpoint to delete first")
                return
            self.run_async(request, _remove(wb, self.ledger, name), lambda _: f"deleted checkpoint {name}")
            return
        if wb is None or not wb.machines:
            self.reply(request, "error", DOWN)
            return
        if action == "save":
            node = str(content.get("node") or "").strip() or None
            force = bool(content.get("force"))
            self.run_async(request, wb.checkpoint_save(name, node, force), _saved_text)
            return
        if name is None:
            self.reply(request, "error", "pick a checkpoint to restore first")
            return
        self.run_async(
            request, wb.checkpoint_restore(name), lambda node: _restored_text(wb, name, node)
        )


async def _remove(wb: Any, ledger: Any, name: str) -> None:
    if wb is not None:
        wb.checkpoint_remove(name)
        return
    Shelf(ledger).remove(name)  # its file only as the gate's rule allows


def _restored_text(wb: Any, name: str, node: Any) -> str:
    text = f"restored {name} as {node.id} (now active)"
    ref = wb.machines.get(node.id)
    warnings = ref.info.get("restore_warnings", []) if ref is not None else []
    return text + "".join(f" · warning: {w}" for w in warnings)


def _saved_text(info: dict[str, Any]) -> str:
    text = f"saved checkpoint {info['name']} of {info['node']} ({size_text(info['size'])})"
    if info.get("warnings"):
        text += " · warning: " + "; ".join(info["warnings"])
    return text


_PANELS: list[CheckpointPanel] = []


def checkpoint_panel(workbench: Any, shell: Any = None) -> CheckpointPanel:
    """A new checkpoint panel (each display its own selection); it follows down / up."""
    if shell is None:
        with contextlib.suppress(Exception):
            from IPython import get_ipython

            shell = get_ipython()
    p = CheckpointPanel(workbench, shell=shell)
    _PANELS.append(p)
    return p


def close_panel(workbench: Any) -> None:
    """The Workbench went down: its panels keep listing from the ledger."""
    for p in list(_PANELS):
        if p.workbench is workbench:
            try:
                p.pause()
            except Exception:
                _PANELS.remove(p)


def follow_panels(workbench: Any) -> None:
    """A new Workbench is up: every open panel binds to it."""
    for p in list(_PANELS):
        try:
            p.follow(workbench)
        except Exception:  # a closed view, or one left over from a ledger that was closed
            _PANELS.remove(p)
