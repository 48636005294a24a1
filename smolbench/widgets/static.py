"""Static HTML copies of the widgets, carried in every widget output beside the live view.

A saved notebook opened without its kernel (a fresh server, nbconvert, GitHub) shows these
instead of "model not found". Inline styles only (sanitizers drop ``<style>``), every value
escaped (node errors, metrics and names can come from a machine: attacker data).
"""

from __future__ import annotations

import html
from typing import Any

from .._format import size_text
from ..gate.display import INERT_CLASSES
from ..tree import where_text

# Text colours with at least 4.5:1 contrast on white (static copies are shown on light pages).
STATUS_TEXT = {
    "ok": "#1a7f37",
    "error": "#cf222e",
    "timeout": "#9a6700",
    "cancelled": "#59636e",
    "running": "#0969da",
    "starting": "#0969da",
    "idle": "#8250df",
}
# The same statuses on the dark theme (JupyterLab marks it on <body>), as in tree.css.
STATUS_TEXT_DARK = {
    "ok": "#3fb950",
    "error": "#f85149",
    "timeout": "#d29922",
    "cancelled": "#9198a1",
    "running": "#4493f8",
    "starting": "#79c0ff",
    "idle": "#ab7df8",
}
FAN = 12  # a parent with more children than this shows FAN_SHOW of them
FAN_SHOW = 8
NEVER_FOLDED = ("running", "starting", "error", "timeout")  # a fold never hides these
FOLD_RULE = "the lowest rewards are folded; errored and running branches are always shown"
CELL = "padding:1px 8px;text-align:left;white-space:nowrap"


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _num(x: Any, digits: int = 6) -> str:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return ""
    return f"{x:.{digits}g}"


def visible(children: list[dict[str, Any]], keep: set[str]) -> list[dict[str, Any]]:
    """What a large fan shows: every running or errored one, the best path and active, then
    the highest rewards up to FAN_SHOW (the live view's rule too, in tree.js)."""
    if len(children) <= FAN:
        return children
    shown = {c["id"] for c in children if c["id"] in keep or c.get("status") in NEVER_FOLDED}
    ranked = sorted(
        (c for c in children if isinstance(c.get("reward"), (int, float))),
        key=lambda c: -float(c["reward"]),
    )
    for c in ranked + children:
        if len(shown) >= FAN_SHOW:
            break
        shown.add(c["id"])
    return [c for c in children if c["id"] in shown]


def tree_html(
    nodes: list[dict[str, Any]],
    *,
    active: str | None,
    best_path: list[str],
    title: str,
    info: str = "",
    log: str = "",
) -> str:
    """The tree as an indented HTML table: status, seed, reward, wall time, badges."""
    by_id = {n["id"]: n for n in nodes}
    kids: dict[str, list[dict[str, Any]]] = {}
    roots = []
    for n in nodes:
        if n.get("parent") in by_id:
            kids.setdefault(n["parent"], []).append(n)
        else:
            roots.append(n)
    best = set(best_path)
    best_id = best_path[-1] if best_path else None
    keep = best | {active or ""}
    rows: list[str] = []

    def walk(n: dict[str, Any], depth: int) -> None:
        badges = []
        if n["id"] == active:
            badges.append("active")
        if n["id"] == best_id:
            badges.append("<b>&#9733; best</b>")
        if n.get("kept") and n.get("alive"):
            badges.append("kept")
        elif n.get("alive") and n.get("parent"):
            badges.append("alive")
        if n.get("checkpoint"):
            badges.append(f"checkpoint {_e(n['checkpoint'])}")
        if n.get("where"):
            badges.append("node " + _e(where_text(n["where"], n.get("where_kind"), n.get("where_host"), n.get("moved_from"))))
        status = str(n.get("status", ""))
        color = STATUS_TEXT.get(status, "#59636e")
        style = "background:rgba(212,167,44,0.16);" if n["id"] in best else ""
        weight = "font-weight:700;" if n["id"] in (active, best_id) else ""
        seed = "" if n.get("seed") is None else f"seed {_e(n['seed'])}"
        wall = "" if n.get("wall") is None else f"{_num(n['wall'], 3)} s"
        dead = "" if n.get("alive") else " (deleted)"
        title = _e(n.get("error") or "")
        rows.append(
            f'<tr class="sb-node" style="{style}" data-id="{_e(n["id"])}" title="{title}">'
            f'<td style="{CELL};padding-left:{8 + 16 * depth}px;font-family:monospace;{weight}">'
            f"{_e(n['id'])}</td>"
            f'<td style="{CELL}">{seed}</td>'
            f'<td class="sb-st-{_e(status)}" style="{CELL};color:{color}">{_e(status)}{dead}</td>'
            f'<td style="{CELL};text-align:right">{_num(n.get("reward"))}</td>'
            f'<td style="{CELL};text-align:right">{wall}</td>'
            f'<td style="{CELL}">{" · ".join(badges)}</td></tr>'
        )
        children = kids.get(n["id"], [])
        shown = visible(children, keep)
        for c in shown:
            walk(c, depth + 1)
        if len(shown) < len(children):
            rows.append(
                f'<tr><td colspan="6" style="{CELL};padding-left:{24 + 16 * depth}px;color:#59636e">'
                f"… {len(children) - len(shown)} more branches of {_e(n['id'])} ({FOLD_RULE})</td></tr>"
            )

    for r in roots:
        walk(r, 0)
    counts: dict[str, int] = {}
    for n in nodes:
        counts[str(n.get("status"))] = counts.get(str(n.get("status")), 0) + 1
    summary = " · ".join([f"{len(nodes)} nodes", *(f"{v} {k}" for k, v in sorted(counts.items()))])
    if best_id in by_id and by_id[best_id].get("reward") is not None:
        summary += f" · best {_num(by_id[best_id]['reward'])} on {_e(best_id)}"
    head = "".join(
        f'<th style="{CELL}">{h}</th>' for h in ("node", "seed", "status", "reward", "wall", "")
    )
    out = [
        f'<div class="smolbench-static smolbench-tree {INERT_CLASSES}">',
        f"<p><b>{_e(title)}</b> · {summary}<br><small>{_e(info)}</small></p>",
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>",
    ]
    if log:
        out.append(f"<details><summary>log</summary><pre>{_e(log)}</pre></details>")
    out.append("</div>")
    return "".join(out)


def checkpoints_html(rows: list[dict[str, Any]], backend: str, more: str = "") -> str:
    """The checkpoint panel as an HTML table (``more``: what it says of rows not listed)."""
    head = "".join(
        f'<th style="{CELL}">{h}</th>' for h in ("name", "node", "created", "size", "backend", "")
    )
    body = []
    for c in rows:
        note = (c.get("blocked") or {}).get("restore") or "; ".join(c.get("warnings") or [])
        body.append(
            f'<tr class="sb-checkpoint" data-name="{_e(c.get("name"))}">'
            f'<td style="{CELL}">{_e(c.get("name"))}</td>'
            f'<td style="{CELL}">{_e(c.get("node"))}</td>'
            f'<td style="{CELL}">{_e(c.get("created_text"))}</td>'
            f'<td style="{CELL};text-align:right">{_e(size_text(c.get("size")))}</td>'
            f'<td style="{CELL}">{_e(c.get("backend"))}</td><td style="{CELL}">{_e(note)}</td></tr>'
        )
    if not body:
        body.append(f'<tr><td colspan="6" style="{CELL}">no checkpoints yet</td></tr>')
    return (
        f'<div class="smolbench-static smolbench-checkpoints {INERT_CLASSES}">'
        f"<p><b>smolbench checkpoints</b> · {len(rows)} saved · this machine: {_e(backend)}"
        f"{' · ' + _e(more) if more else ''}</p>"
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div>"
    )


def static_output(uid: str, body: str) -> str:
    """The static copy of the view ``uid`` as the output shown after its live view.

    Its CSS (JupyterLab and Notebook 7 keep ``<style>`` in the trusted output of a cell the
    user ran) shows one of the two outputs: this copy is hidden while the live view (marked
    ``sbl-<uid>``) is on the page; otherwise the widget output just before it ("model not
    found" once the kernel is gone) is hidden. Untrusted and other viewers drop or ignore the
    CSS and show the copy.
    """
    u = "".join(ch for ch in uid if ch.isalnum())
    child = ".jp-OutputArea-child"
    dark = "".join(
        f'body[data-jp-theme-light="false"] #sbs-{u} .sb-st-{k}{{color:{v} !important}}'
        for k, v in STATUS_TEXT_DARK.items()
    )
    css = (
        f"{child}:has(.sbl-{u}) + {child}:has(#sbs-{u}){{display:none}}"
        # the widget renderer is a lumino Panel (text and HTML outputs are not)
        f"{child}:has(+ {child} #sbs-{u}):has(> .jp-OutputArea-output.lm-Panel)"
        f":not(:has(.sbl-{u})){{display:none}}"
        f"{dark}"
    )
    return f'<div class="smolbench-static-copy {INERT_CLASSES}" id="sbs-{u}"><style>{css}</style>{body}</div>'
