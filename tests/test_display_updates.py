"""A machine's cell redraws what it showed, as a Jupyter kernel's does: ``display_id`` and its
``DisplayHandle.update``/``update_display``, and ``clear_output(wait=True)`` for a live plot.

Before: IPython's ``display`` in a machine dropped ``display_id`` (each update a new output,
``display(..., display_id=True)`` returned None, so ``h.update`` raised), and
``clear_output`` printed terminal escapes: a training loop's live plot became hundreds of
plots, cut at 200 displays. The attacks beside them: a machine's id naming one of the
host's displays (to redraw the host's own output), and a clear hiding the gate's notes.
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


def _gate(*messages: dict[str, Any], limit: int = 100_000, where: str = "root") -> tuple[Any, list[Event]]:
    events: list[Event] = []

    async def chunks() -> AsyncIterator[bytes]:
        for m in messages:
            yield json.dumps(m).encode() + b"\n"

    request = CellRequest("x", output=OutputBudget(None, limit=limit))
    res = asyncio.run(gate.read_cell(chunks(), request, events.append, where))
    return res, events


DONE = {"t": "done", "status": "ok"}


def test_the_gate_keeps_a_machine_s_display_ids_its_own_and_checks_them() -> None:
    _, events = _gate({"t": "display", "data": {"text/plain": "a"}, "id": "plot"},
                      {"t": "display", "data": {"text/plain": "b"}, "id": "plot", "update": True},
                      {"t": "clear", "wait": True}, DONE, where="root.3")
    shown = [(e.kind, e.display_id, e.update, e.wait) for e in events]
    assert shown == [("display", "root.3/plot", False, False), ("display", "root.3/plot", True, False),
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
