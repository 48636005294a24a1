"""The checkpoint panel: the ledger's checkpoints with Save, Restore and Delete buttons."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import traitlets as t

from ._base import WorkbenchView, clean, close_view, view_for

HERE = Path(__file__).parent
ACTIONS = ("save", "restore", "delete")


def checkpoint_record(row: dict[str, Any], backend: str) -> dict[str, Any]:
    """A ledger checkpoint row as the plain data the panel shows, with why it can't be restored."""
    exists = bool(row.get("path")) and os.path.exists(str(row["path"]))
    why = ""
    if row.get("backend") != backend:
        other = row.get("backend")
        why = f"made by the {other} backend, not {backend}: `%smol up --backend {other}` first"
    elif not exists:
        why = f"its file {row.get('path')} is missing: delete it"
    created = row.get("created")
    return {
        "name": row.get("name"),
        "node": row.get("node_id"),
        "created": clean(created),
        "created_text": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created))
        if created
        else "",
        "size": row.get("size"),
        "backend": row.get("backend"),
        "exists": exists,
        "warnings": clean(row.get("warnings") or []),
        "blocked": {"restore": why} if why else {},
    }


class CheckpointPanel(WorkbenchView):
    """The Workbench's checkpoints (from the ledger): list, save, restore, delete."""

    _esm = HERE / "checkpoints.js"
    _css = HERE / "checkpoints.css"
    actions = ACTIONS
    after_down = "these machines were deleted by `%smol down`: `%smol checkpoint list` again after `%smol up`"

    checkpoints = t.List(t.Dict(), help="name, node, created, size, backend, exists, warnings").tag(
        sync=True
    )
    live_nodes = t.List(t.Unicode(), help="nodes that can be saved").tag(sync=True)
    active = t.Unicode(None, allow_none=True, help="the active node (saved by default)").tag(
        sync=True
    )
    backend = t.Unicode("", help="this Workbench's backend").tag(sync=True)

    def snapshot(self) -> dict[str, Any]:
        wb = self.workbench
        rows = [checkpoint_record(r, wb.backend.name) for r in wb.ledger.checkpoint_rows()]
        live = [n.id for n in list(wb.tree.nodes.values()) if n.id in wb.machines]
        return {
            "checkpoints": rows,
            "live_nodes": live,
            "active": wb.active,
            "backend": wb.backend.name,
        }

    def __repr__(self) -> str:
        """What a viewer without widget support shows."""
        names = ", ".join(str(c["name"]) for c in self.checkpoints) or "none"
        return f"smolbench checkpoints ({self.backend}): {names}"

    def reply(self, request: str, level: str, text: str) -> None:
        """As for every view; the panel's "replace" box is its --force."""
        super().reply(request, level, text.replace("add --force", "tick “replace”"))

    def handle_action(self, action: str, content: dict[str, Any], request: str) -> None:
        wb = self.workbench
        name = str(content.get("name") or "").strip() or None
        if action == "save":
            node = str(content.get("node") or "").strip() or None
            force = bool(content.get("force"))
            self.run_async(request, wb.checkpoint_save(name, node, force), _saved_text)
            return
        if name is None:
            self.reply(request, "error", f"pick a checkpoint to {action} first")
            return
        if action == "restore":
            self.run_async(
                request, wb.checkpoint_restore(name), lambda node: _restored_text(wb, name, node)
            )
        else:
            self.run_async(request, _remove(wb, name), lambda _: f"deleted checkpoint {name}")


async def _remove(wb: Any, name: str) -> None:
    wb.checkpoint_remove(name)


def _restored_text(wb: Any, name: str, node: Any) -> str:
    text = f"restored {name} as {node.id} (now active)"
    ref = wb.machines.get(node.id)
    warnings = ref.info.get("restore_warnings", []) if ref is not None else []
    return text + "".join(f" · warning: {w}" for w in warnings)


def _saved_text(info: dict[str, Any]) -> str:
    text = f"saved checkpoint {info['name']} of {info['node']} ({info['size'] / 1e6:.2f} MB)"
    if info.get("warnings"):
        text += " · warning: " + "; ".join(info["warnings"])
    return text


_PANELS: dict[int, CheckpointPanel] = {}


def checkpoint_panel(workbench: Any, shell: Any = None) -> CheckpointPanel:
    """The Workbench's checkpoint panel (made on first use)."""
    w, new = view_for(_PANELS, CheckpointPanel, workbench, shell)
    if not new:
        w.flush()  # the ledger may have changed without a node changing
    return w


def close_panel(workbench: Any) -> None:
    """Detach the Workbench's checkpoint panel (after ``%smol down``)."""
    close_view(_PANELS, workbench)
