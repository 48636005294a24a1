"""The notebook widgets' Python side, on a real Workbench with sandbox machines.

Clicks are delivered the way ipywidgets delivers an anywidget custom message
(``Widget._handle_msg`` with ``method: custom``); nothing of ours is mocked.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import pytest
from ledgerhelpers import readable_now
from widgethelpers import workbench_up

from smolbench import _loop
from smolbench.result import ForkResult
from smolbench.widgets import (
    CheckpointPanel,
    TreeWidget,
    checkpoint_panel,
    close_views,
    tree_widget,
)
from smolbench.widgets.plots import reward_figure, tree_figure
from smolbench.workbench import Workbench

FORK_CODE = "\n".join(
    [
        "import smolbench_guest",
        "reward = SEED * 2",
        "smolbench_guest.report(steps=SEED % 7, tag='s%d' % SEED)",
    ]
)
NESTED_CODE = "reward = 1000 + SEED"


@pytest.fixture
def wb(tmp_path: Path) -> Iterator[Workbench]:
    with workbench_up(tmp_path / "ledger.db") as bench:
        yield bench


def fork(wb: Workbench, n: int, code: str, seed_base: int = 0) -> ForkResult:
    result = wb.new_fork(n, None, seed_base)
    return _loop.run(wb.fork(result, code, lambda branch, ev: None), timeout=120)


def click(w: TreeWidget | CheckpointPanel, action: str, **content: Any) -> dict[str, Any]:
    """Deliver a button click as the frontend does, wait for its work, return the reply."""
    msg = {
        "content": {
            "data": {
                "method": "custom",
                "content": {"type": "action", "action": action, "id": f"req-{action}", **content},
            }
        },
        "buffers": [],
    }
    w._handle_msg(msg)
    assert w.wait(120), f"{action} did not finish"
    return dict(w.message)


def until(check: Callable[[], bool], what: str, timeout: float = 30) -> None:
    """Wait for the throttled final update (the timeout only bounds a broken run)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def by_id(w: TreeWidget) -> dict[str, dict[str, Any]]:
    return {n["id"]: n for n in w.nodes}


def test_tree_state_after_a_fork_of_8_and_a_nested_fork(wb: Workbench) -> None:
    w = tree_widget(wb)
    assert [n["id"] for n in w.nodes] == ["root"] and w.active == "root"
    assert not w.can_fork and "no fork has run" in by_id(w)["root"]["blocked"]["fork"]

    fork(wb, 8, FORK_CODE, seed_base=100)
    # the final batch: the winner kept and the others deleted (they may arrive in two updates)
    until(lambda: len(w.nodes) == 9 and by_id(w)["root.7"]["kept"] and not by_id(w)["root.3"]["alive"], "the fork of 8")
    nodes = by_id(w)
    assert set(nodes) == {"root"} | {f"root.{i}" for i in range(8)}
    for i in range(8):
        n = nodes[f"root.{i}"]
        assert (n["parent"], n["seed"], n["status"], n["reward"], n["depth"]) == (
            "root",
            100 + i,
            "ok",
            2.0 * (100 + i),
            1,
        )
        assert n["metrics"] == {"steps": (100 + i) % 7, "tag": f"s{100 + i}"}
        assert n["wall"] is not None and n["wall"] >= 0
    assert nodes["root.7"]["alive"] and nodes["root.7"]["kept"]  # --keep best
    assert not nodes["root.3"]["alive"] and not nodes["root.3"]["kept"]
    assert w.best_path == ["root", "root.7"] and w.can_fork
    assert "best reward 214 on root.7" in repr(w)

    wb.use("root.7")
    fork(wb, 3, NESTED_CODE)
    # the final batch (the view sends it after the fork returns; an earlier one may already
    # hold 12 nodes with root.7.2 best and a sibling's reward not in yet)
    until(lambda: len(w.nodes) == 12 and w.best_path[-1:] == ["root.7.2"]
          and all(by_id(w)[f"root.7.{i}"]["reward"] is not None for i in range(3)), "the nested fork")
    nodes = by_id(w)
    assert w.active == "root.7"
    assert [
        (
            nodes[f"root.7.{i}"]["parent"],
            nodes[f"root.7.{i}"]["depth"],
            nodes[f"root.7.{i}"]["reward"],
        )
        for i in range(3)
    ] == [("root.7", 2, 1000.0), ("root.7", 2, 1001.0), ("root.7", 2, 1002.0)]
    assert w.best_path == ["root", "root.7", "root.7.2"]


def test_use_checkpoint_and_delete_clicks_change_the_workbench_the_ledger_and_the_widget(
    wb: Workbench,
) -> None:
    w = tree_widget(wb)
    fork(wb, 8, FORK_CODE, seed_base=100)

    reply = click(w, "use", node="root.7")
    assert reply["level"] == "ok" and reply["text"] == "root.7 is now the active machine"
    assert wb.active == "root.7" and w.active == "root.7"
    assert "already the active machine" in by_id(w)["root.7"]["blocked"]["use"]

    reply = click(w, "checkpoint", node="root.7")
    assert reply["level"] == "ok" and reply["text"].startswith("saved checkpoint root.7-")
    name = wb.tree["root.7"].checkpoint
    assert name is not None and by_id(w)["root.7"]["checkpoint"] == name
    rec = wb.ledger.checkpoint(name)
    assert rec is not None and rec["node_id"] == "root.7"
    assert (wb.ledger.path.parent / rec["path"]).is_file()  # rows are relative to the ledger's folder

    reply = click(w, "delete", node="root.7")
    assert reply == {
        "level": "ok",
        "text": "deleted root.7; root.7 was active: the active machine is now root",
        "seq": reply["seq"],
        "request": "req-delete",
    }
    assert "root.7" not in wb.machines and wb.active == "root"
    row = wb.ledger.node(wb.session, "root.7")
    assert row is not None and row["alive"] == 0
    gone = by_id(w)["root.7"]
    assert not gone["alive"] and w.active == "root"
    # every button of a deleted node is disabled, each with the reason as its tooltip
    assert set(gone["blocked"]) == {"use", "fork", "checkpoint", "delete"}
    assert (
        "root.7 was deleted" in gone["blocked"]["use"]
        and "%smol replay root.7" in gone["blocked"]["fork"]
    )
    assert gone["blocked"]["delete"] == "root.7 is already deleted"
    # ... and a click that gets through anyway is refused with the same reason
    reply = click(w, "use", node="root.7")
    assert reply["level"] == "error" and "root.7 was deleted" in reply["text"]
    assert wb.active == "root"
    reply = click(w, "use", node="root.99")
    assert reply["level"] == "error" and "unknown node 'root.99'" in reply["text"]


def test_fork_button_reruns_the_last_fork_cell_below_the_selected_node_in_the_background(
    wb: Workbench,
) -> None:
    w = tree_widget(wb)
    reply = click(w, "fork", node="root", n=2)
    assert reply["level"] == "error" and "no fork has run" in reply["text"]

    fork(wb, 8, FORK_CODE, seed_base=100)
    reply = click(w, "fork", node="root.7", n="lots")
    assert reply["level"] == "error" and "whole number" in reply["text"]

    reply = click(w, "fork", node="root.7", n=4)
    assert reply["level"] == "ok" and reply["text"].startswith("fork of 4 · 4 ok")
    until(lambda: not w.jobs, "the fork job to leave the jobs list")
    assert wb.active == "root"  # forking the selected node does not change the active one
    kids = [n for n in wb.tree if n.parent == "root.7"]
    # automatic seeds continue after the session's highest (107): never a repeat of root.0..7
    assert [(k.id, k.seed, k.reward) for k in kids] == [
        (f"root.7.{i}", 108 + i, 2.0 * (108 + i)) for i in range(4)
    ]
    until(lambda: {"root.7.0", "root.7.3"} <= set(by_id(w)), "the new branches in the widget")
    run = w.last_fork()
    assert run is not None and run["code"] == FORK_CODE and run["parent_id"] == "root.7"


def test_updates_are_batched_and_throttled_and_always_end_on_the_final_state(wb: Workbench) -> None:
    w = tree_widget(wb)
    fork(wb, 4, "reward = SEED", seed_base=0)
    wb.use("root.3")
    until(lambda: w.active == "root.3", "the first update")
    seen: list[Any] = []
    w.observe(lambda change: seen.append(change["new"]), names="active")

    async def burst() -> (
        None
    ):  # 200 changes in one go on the loop thread, where the Workbench lives
        for i in range(200):
            wb.use("root" if i % 2 else "root.3")
        wb.use("root")

    _loop.run(burst())
    until(lambda: w.active == "root", "the final state")
    assert 1 <= len(seen) <= 2, seen  # one update now (maybe), one trailing: not 201
    assert seen[-1] == "root"


def test_clicks_are_acknowledged_at_once_and_cells_mark_the_view_busy(wb: Workbench) -> None:
    """The frontend says "queued" when a click gets no acknowledgement while ``busy`` is set
    (the kernel's main shell is running a cell); a subshell's thread answers at once."""
    w = tree_widget(wb)
    sent: list[dict[str, Any]] = []
    w.send = lambda content, buffers=None: sent.append(content)  # type: ignore[method-assign]
    w._pre_run_cell()
    assert w.busy == "a cell is running"
    msg = {
        "content": {
            "data": {
                "method": "custom",
                "content": {"type": "action", "action": "use", "node": "root", "id": "r1"},
            }
        },
        "buffers": [],
    }
    t = threading.Thread(target=w._handle_msg, args=(msg,))  # as a kernel subshell delivers it
    t.start()
    t.join()
    assert w.wait(30)
    assert sent[0] == {"type": "ack", "id": "r1"}
    assert sent[-1]["type"] == "reply" and "already the active machine" in sent[-1]["text"]
    w._post_run_cell()
    assert w.busy == ""


def test_checkpoint_panel_saves_restores_and_deletes(wb: Workbench) -> None:
    _loop.run(wb.run_cell("x = 41\nopen('notes.txt', 'w').write('warm')", lambda ev: None))
    p = checkpoint_panel(wb)
    assert p.checkpoints == [] and p.live_nodes == ["root"] and p.backend == "sandbox"

    reply = click(p, "save", name="warm", node="root")
    assert reply["level"] == "ok" and reply["text"].startswith("saved checkpoint warm of root")
    [row] = p.checkpoints
    assert (row["name"], row["node"], row["backend"], row["exists"], row["blocked"]) == (
        "warm",
        "root",
        "sandbox",
        True,
        {},
    )
    assert row["size"] > 0 and row["created_text"]

    reply = click(p, "save", name="warm", node="root")
    assert reply["level"] == "error" and "exists" in reply["text"] and "replace" in reply["text"]
    reply = click(p, "save", name="warm", node="root", force=True)
    assert reply["level"] == "ok"

    reply = click(p, "restore", name="warm")
    assert reply["level"] == "ok" and reply["text"] == "restored warm as r1-warm (now active)"
    assert wb.active == "r1-warm" and "r1-warm" in p.live_nodes and p.active == "r1-warm"
    res = _loop.run(wb.run_cell("print(x, open('notes.txt').read())", lambda ev: None))
    assert res.stdout == "41 warm\n"

    reply = click(p, "restore", name="nope")
    assert reply["level"] == "error" and "no checkpoint named 'nope'" in reply["text"]
    reply = click(p, "delete", name="warm")
    assert reply["level"] == "ok" and p.checkpoints == [] and wb.ledger.checkpoint("warm") is None
    assert not list(wb.checkpoint_dir.glob("warm*"))


def test_views_detach_when_the_workbench_goes_down(wb: Workbench) -> None:
    w = tree_widget(wb)
    assert tree_widget(wb) is not w  # one model per display: own selection and messages
    fork(wb, 2, "reward = SEED")
    assert w.live
    _loop.run(wb.down())
    close_views(wb)
    assert not any(n["alive"] for n in w.nodes) and "down" in w.info and not w.live
    reply = click(w, "use", node="root")
    assert reply["level"] == "error" and "%smol down" in reply["text"]


def test_reward_plots_show_branches_seeds_metrics_and_the_tree(wb: Workbench) -> None:
    result = fork(wb, 8, FORK_CODE, seed_base=100)
    fig = reward_figure(result, widget=False)
    assert isinstance(fig, go.Figure) and not isinstance(fig, go.FigureWidget)
    bars = fig.data[0]
    assert list(bars.x) == [f"root.{i}" for i in range(7, -1, -1)]  # best first
    assert list(bars.y) == [2.0 * (100 + i) for i in range(7, -1, -1)]
    assert (
        "<b>root.7</b>" in bars.hovertext[0]
        and "seed: 107" in bars.hovertext[0]
        and "steps: 2" in bars.hovertext[0]
    )
    scatter = fig.data[1]
    assert sorted(scatter.x) == list(range(100, 108))
    plot = result.plot()
    assert isinstance(plot, go.Figure) and not isinstance(plot, go.FigureWidget)
    bundle = plot._repr_mimebundle_()
    # plotly's own MIME type (the figure travels in the output) plus a static SVG copy
    spec = bundle["application/vnd.plotly.v1+json"]
    assert [t["type"] for t in spec["data"]][:2] == ["bar", "scatter"]
    assert spec["layout"]["paper_bgcolor"] == "rgba(0,0,0,0)"  # follows the page's theme
    assert spec["layout"]["font"]["family"].startswith("smolbench")
    svg = bundle["image/svg+xml"]
    assert svg.startswith("<svg") and svg.count("<rect") == 1 + 8 and "root.7" in svg
    assert isinstance(reward_figure(result, widget=True), go.FigureWidget)

    wb.use("root.7")
    fork(wb, 3, NESTED_CODE)
    tf = tree_figure(wb, widget=False)
    names = [t.name for t in tf.data]
    assert "best path" in names and "ok" in names
    best = tf.data[names.index("best path")]
    assert list(best.y) == [214.0, 1002.0]  # root.7 then root.7.2 (root has no reward)
    assert sum(len(t.x) for t in tf.data if t.name in ("ok", "idle")) == 11
    svg = tf._repr_mimebundle_()["image/svg+xml"]
    assert svg.count("<circle") == 11 and "<polyline" in svg


def test_observers_hear_of_a_forks_rows_after_their_commit_never_while_the_ledger_is_held(wb: Workbench) -> None:
    """A fork writes its branches' rows in batches (one commit each). A view's observer takes
    the view's own lock, and the main thread may hold that lock while it reads the ledger:
    told inside a batch (the loop thread holding the ledger's lock), the two threads waited
    for each other and a ``%%smol fork --bg`` cell hung (2 runs in 6 here). Here every
    observer call checks, from another thread, that the ledger can be read at that moment;
    and the observers still hear of every branch, to its last state."""
    held: list[bool] = []
    heard: dict[str, tuple[str, bool]] = {}

    def observer(bench: Workbench, nodes: list[Any]) -> None:
        held.append(not readable_now(bench.ledger))
        heard.update((n.id, (n.status, n.alive)) for n in nodes)

    wb.observe(observer)
    try:
        res = _loop.run(wb.fork(wb.new_fork(8, keep="none"), "reward = SEED", lambda b, e: None, keep="none"),
                        timeout=120)
    finally:
        wb.unobserve(observer)
    assert held and not any(held), f"{sum(held)} of {len(held)} observer calls ran while the ledger was held"
    assert {name: heard.get(name) for name in res.rows} == {name: ("ok", False) for name in res.rows}
    rows = {r["id"]: (r["status"], bool(r["alive"])) for r in wb.ledger.node_rows(wb.session) if r["id"] in res.rows}
    assert rows == {name: ("ok", False) for name in res.rows}  # and the ledger says the same


def test_a_branch_s_error_in_the_plot_s_title_is_drawn_as_text(wb: Workbench) -> None:
    """A failed branch's error (machine text) is in the summary that titles the reward plot,
    which plotly draws as its own markup: a ``<span style="cursor:url(...)">`` there made the
    browser fetch as soon as the plot was drawn (round 4's own audit). Plots go through the
    gate's figure check, the widget form too."""
    code = ("if SEED == 1:\n"
            "    raise Exception('<span style=\"cursor:url(http://127.0.0.1:1/leak), auto\">x</span>"
            "<a href=\"/api/contents/secret\">s</a>')\nreward = 1.0")
    result = fork(wb, 2, code)
    assert "<span style=" in result.summary()  # the machine's text, as it sent it
    for plot in (result.plot(), reward_figure(result, widget=True)):
        spec = plot._repr_mimebundle_()["application/vnd.plotly.v1+json"] if not isinstance(plot, go.FigureWidget) \
            else json.loads(plot.to_json())
        title = spec["layout"]["title"]["text"]
        assert "failed: [root.1]" in title and "127.0.0.1" not in title and "span" not in title, title
        drawn = json.dumps(spec)
        assert "<span" not in drawn and "127.0.0.1" not in drawn and "/api/" not in drawn  # hover text too
