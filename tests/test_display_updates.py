"""A machine's cell redraws what it showed, as a Jupyter kernel's does: ``display_id`` and its
``DisplayHandle.update``/``update_display``, and ``clear_output(wait=True)`` for a live plot.

Before: IPython's ``display`` in a machine dropped ``display_id`` (each update a new output,
``display(..., display_id=True)`` returned None, so ``h.update`` raised), and
``clear_output`` printed terminal escapes: a training loop's live plot became hundreds of
plots, cut at 200 displays. The attacks beside them: a machine's id naming one of the
host's displays (to redraw the host's own output), a clear hiding the gate's notes, updates
leaving more on screen than the cell's output limit, and a later session's ``root`` (or
restore) redrawing what an earlier session's machine of that name showed.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from nbhelpers import notices, plain_texts, run_notebook, stream_text

import smolbench
from smolbench import gate
from smolbench.backends.base import CellRequest, Event
from smolbench.gate.output import REDRAWS, OutputBudget

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def _gate(*messages: dict[str, Any], limit: int = 100_000, where: str = "root",
          scope: str = "t0") -> tuple[Any, list[Event]]:
    events: list[Event] = []

    async def chunks() -> AsyncIterator[bytes]:
        for m in messages:
            yield json.dumps(m).encode() + b"\n"

    request = CellRequest("x", output=OutputBudget(None, limit=limit))
    res = asyncio.run(gate.read_cell(chunks(), request, events.append, where, scope=scope))
    return res, events


DONE = {"t": "done", "status": "ok"}


def test_the_gate_keeps_a_machine_s_display_ids_its_own_and_checks_them() -> None:
    _, events = _gate({"t": "display", "data": {"text/plain": "a"}, "id": "plot"},
                      {"t": "display", "data": {"text/plain": "b"}, "id": "plot", "update": True},
                      {"t": "clear", "wait": True}, DONE, where="root.3", scope="t1")
    shown = [(e.kind, e.display_id, e.update, e.wait) for e in events]
    assert shown == [("display", "root.3/t1/plot", False, False), ("display", "root.3/t1/plot", True, False),
                     ("clear", None, False, True)]
    for bad, why in (({"t": "display", "data": {}, "id": 7}, "display id"),
                     ({"t": "display", "data": {}, "id": "x" * 300}, "display id"),
                     ({"t": "display", "data": {"text/plain": "b"}, "update": True}, "without its id"),
                     ({"t": "clear", "wait": "yes"}, "wait flag"),
                     ({"t": "clear", "wait": True, "more": 1}, "clear message")):
        with pytest.raises(gate.MalformedReply, match=why):
            _gate(bad, DONE)


def test_a_cell_that_clears_and_draws_again_gets_its_room_back_until_its_redraws_run_out() -> None:
    frame = {"t": "display", "data": {"text/plain": "x" * 900}}
    # 300 frames of a live plot, each after a clear: past the 200 displays a cell shows, all shown
    _, events = _gate(*[m for _ in range(300) for m in ({"t": "clear", "wait": True}, frame)], DONE, limit=10**6)
    assert sum(e.kind == "display" for e in events) == 300 and not [e for e in events if e.note]
    # without the clears, the 200 displays it always had
    _, events = _gate(*[frame] * 300, DONE, limit=10**6)
    assert sum(e.kind == "display" for e in events) == 200
    # a loop that redraws for ever ends: REDRAWS times the output limit in all, then said once
    limit = 20_000
    many = (limit * REDRAWS) // 950 + 50
    _, events = _gate(*[m for _ in range(many) for m in ({"t": "clear", "wait": True}, frame)], DONE, limit=limit)
    shown = sum(e.kind == "display" for e in events)
    assert shown < many - 40 and shown > (limit * REDRAWS) // 1000 - 5
    [note] = [e.text for e in events if e.note]
    assert "more displays not shown" in note and "drawn and redrawn in one cell" in note
    # updates in place: the same bound
    updates = [{"t": "display", "data": {"text/plain": "y" * 900}, "id": "p", "update": True}] * many
    _, events = _gate({"t": "display", "data": {"text/plain": "p"}, "id": "p"}, *updates, DONE, limit=limit)
    assert sum(e.kind == "display" for e in events) < many - 40


def _on_screen(events: list[Event]) -> int:
    """Bytes of displays a notebook holds after ``events``: an update redraws the newest display
    with its id, or one an earlier cell showed (counted as one more output)."""
    shown: list[int] = []
    at: dict[str, int] = {}
    for e in events:
        size = len(json.dumps(e.data)) if e.kind == "display" else 0
        if e.kind == "clear":
            shown, at = [], {}
        elif e.kind == "display" and e.update and e.display_id is not None:
            if e.display_id not in at:  # an earlier cell's display
                at[e.display_id] = len(shown)
                shown.append(0)
            shown[at[e.display_id]] = size
        elif e.kind == "display":
            if e.display_id is not None:
                at[e.display_id] = len(shown)
            shown.append(size)
    return sum(shown)


def test_updates_leave_no_more_on_screen_than_the_cell_s_output_limit() -> None:
    # the audit's cell: six empty places, each filled with 15 KB, under a 50 KB limit
    limit, big = 50_000, "x" * 15_000
    places = [{"t": "display", "data": {}, "id": f"slot{i}"} for i in range(6)]
    fills = [{"t": "display", "data": {"text/plain": big}, "id": f"slot{i}", "update": True} for i in range(6)]
    _, events = _gate(*places, *fills, DONE, limit=limit)
    assert _on_screen(events) <= limit
    [note] = [e.text for e in events if e.note]
    assert "3 more displays not shown (past 50 KB of output" in note, note
    # one update bigger than the limit is refused, as a display of that size is
    huge = "x" * (limit + 1)
    for msg in ({"t": "display", "data": {"text/plain": huge}},
                {"t": "display", "data": {"text/plain": huge}, "id": "slot0", "update": True}):
        _, events = _gate(places[0], msg, DONE, limit=limit)
        assert [e.data for e in events if e.kind == "display"] == [{}], msg
    # what an update replaces is given back: a plot redrawn 100 times, each frame 15 KB, all shown
    _, events = _gate(places[0], *[fills[0]] * 50, DONE, limit=limit)
    assert sum(e.kind == "display" for e in events) == 51 and not [e for e in events if e.note]


def test_updates_of_an_earlier_cell_s_displays_count_in_the_cell_that_draws_them() -> None:
    limit, big = 50_000, "x" * 15_000
    # slots shown by an earlier cell: this one fills them; a clear here does not give their room back
    fills = [{"t": "display", "data": {"text/plain": big}, "id": f"slot{i}", "update": True} for i in range(6)]
    clear = {"t": "clear", "wait": True}
    _, events = _gate(fills[0], fills[1], clear, *fills[2:], DONE, limit=limit)
    assert _on_screen(events) + 2 * len(json.dumps({"text/plain": big})) <= limit
    assert sum(e.kind == "display" for e in events) == 3
    # the same slot redrawn again and again replaces itself
    _, events = _gate(*[fills[0]] * 50, DONE, limit=limit)
    assert sum(e.kind == "display" for e in events) == 50


@needs_bwrap
def test_a_session_s_displays_are_what_a_notebook_keeps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("IPython")
    monkeypatch.chdir(tmp_path)
    with smolbench.Session(backend="sandbox", ledger="ledger.db", on_notice=lambda line: None) as s:
        r = s.run("from IPython.display import display, update_display, clear_output, HTML\n"
                  "h = display('first', display_id=True)\n"
                  "h.update('second')\n"
                  "print(type(h).__name__)\n"
                  "display(display_id='later')\n"  # an empty place, filled in later
                  "update_display(HTML('<b>filled</b>'), display_id='later')\n"
                  "update_display('nowhere', display_id='never-shown')")
        assert r.error is None and r.stdout == "DisplayHandle\n", r
        assert [d.get("text/plain") for d in r.displays] == ["'second'", "<IPython.core.display.HTML object>"]
        assert "<b>filled</b>" in r.displays[1]["text/html"]
        # a handle made in one cell redraws in the next one (as in a kernel); clear_output keeps what came after
        r = s.run("h.update('third')\ndisplay('gone')\nclear_output(wait=True)\ndisplay('kept')\n"
                  "display('also', clear=True)")
        assert r.error is None and [d["text/plain"] for d in r.displays] == ["'also'"], r


LIVE_PLOT = """%%smol
from IPython.display import display, clear_output, HTML
for i in range(250):
    clear_output(wait=True)
    display(HTML(f"<b>episode {i}</b>"))
h = display('first', display_id=True)
h.update('second')
"""


@needs_bwrap
def test_a_live_plot_redraws_in_place_and_never_redraws_the_host_s_outputs(tmp_path: Path) -> None:
    pytest.importorskip("nbclient")
    nb = run_notebook([
        "%load_ext smolbench",
        "%smol up --backend sandbox",
        # the host's own display, with an id a machine can guess (a tree view's, a progress line's)
        "from IPython.display import display\nvictim = display('host', display_id='victim')",
        LIVE_PLOT,
        # the attack: a machine redraws by the host's id, and clears to hide the gate's note
        "%%smol\nfrom IPython.display import update_display, Javascript, clear_output\n"
        "update_display('pwned', display_id='victim')\n"
        "display(Javascript('alert(1)'))\nclear_output()\nprint('after')",
        "%%smol fork 2 --keep none\nfrom IPython.display import clear_output\nprint('branch', SEED)\n"
        "clear_output()\nreward = 1",
        "%smol down",
    ], tmp_path, timeout=300)
    host, live, attack, fork = nb.cells[2], nb.cells[3], nb.cells[4], nb.cells[5]
    # 250 frames and an update: what is left is the last frame and the updated handle
    assert plain_texts(live) == ["<IPython.core.display.HTML object>", "'second'"], live.outputs
    assert "episode 249" in live.outputs[0]["data"]["text/html"]
    assert "not shown" not in notices(live)
    # the host's display is the host's; the gate's note about the script outlived the clear
    assert plain_texts(host) == ["'host'"], host.outputs
    assert stream_text(attack) == "after\n" and "application/javascript" in notices(attack), attack.outputs
    assert "pwned" not in json.dumps([c.outputs for c in nb.cells])
    # a branch's clear_output clears nothing of the fork's cell (its progress, its tree)
    assert "branch 0" in notices(fork) and "branch 1" in notices(fork), fork.outputs
    assert len(fork.outputs) > 2


@needs_bwrap
def test_a_notebook_holds_no_more_of_a_cell_s_updates_than_its_output_limit(tmp_path: Path) -> None:
    pytest.importorskip("nbclient")
    nb = run_notebook([
        "%load_ext smolbench",
        "%smol up --backend sandbox",
        "%smol config output-limit 1M",
        # the audit's cell: six empty places filled with 300 KB each (1.8 MB under a 1 MB limit)
        "%%smol\nfrom IPython.display import display, update_display\n"
        "for i in range(6): display(display_id=f'slot{i}')\n"
        "for i in range(6): update_display('x' * 300_000, display_id=f'slot{i}')",
        # a later cell redraws them: what it draws counts in its own limit
        "%%smol\nfor i in range(6): update_display('y' * 300_000, display_id=f'slot{i}')",
        # one id on twenty places, then one update: it redraws the newest, not all twenty
        "%%smol\nfor i in range(20): display(display_id='many')\nupdate_display('z' * 300_000, display_id='many')",
        "%smol down",
    ], tmp_path, timeout=300)
    slots, redraw, many = nb.cells[3], nb.cells[4], nb.cells[5]
    size = len(json.dumps([c.outputs for c in nb.cells]))
    assert size < 3 * 1024**2, size  # three cells, each at most its limit
    assert len(json.dumps(slots.outputs)) < 1024**2 and "not shown" in notices(slots), slots.outputs
    assert "not shown" in notices(redraw), redraw.outputs
    assert json.dumps(many.outputs).count("z" * 1000) == 300, many.outputs  # (one 'zzz…' of 300 KB)


@needs_bwrap
def test_a_machine_redraws_only_its_own_displays_whatever_its_name(tmp_path: Path) -> None:
    pytest.importorskip("nbclient")
    rewrite = "%%smol\nfrom IPython.display import display, update_display\nupdate_display('rewritten', display_id='{}')"
    nb = run_notebook([
        "%load_ext smolbench",
        "%smol up --backend sandbox",
        "%%smol\nfrom IPython.display import display\nh = display('final accuracy: 0.71', display_id='status')",
        "%smol checkpoint save warm",
        "%smol checkpoint restore warm",
        "%%smol\nfrom IPython.display import display\nh = display('restored, session 1', display_id='rstatus')",
        "%smol down",
        # a new session: its first machine is named root again, its restore r1-warm again
        "%smol up --backend sandbox",
        rewrite.format("status") + "\nh = display('root, session 2', display_id='own')",
        "%%smol fork 2 --keep all\nreward = SEED",
        "%smol use best",  # a live branch of root: another machine, with root's handles in it
        rewrite.format("own"),
        "%smol use root",
        "%%smol\nupdate_display('root, session 2, redrawn', display_id='own')",  # its own, from a later cell
        "%smol checkpoint restore warm",
        rewrite.format("rstatus"),
        "%smol down",
    ], tmp_path, timeout=300)
    assert "as r1-warm" in stream_text(nb.cells[4]) and "as r1-warm" in stream_text(nb.cells[14])
    outputs = json.dumps([c.outputs for c in nb.cells])
    assert "rewritten" not in outputs
    assert plain_texts(nb.cells[2]) == ["'final accuracy: 0.71'"] and plain_texts(nb.cells[5]) == ["'restored, session 1'"]
    assert plain_texts(nb.cells[8]) == ["'root, session 2, redrawn'"], nb.cells[8].outputs
