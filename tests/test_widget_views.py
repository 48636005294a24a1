"""What each widget view shows: per-fork scope, the best per fork, seed continuation for
Fork ×N, static copies for saved notebooks, the checkpoint panel across down / up, ledger
formatting, colour contrast and glyphs. Real sandbox machines; nothing of ours is mocked."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from test_widgets import FORK_CODE, by_id, click, until
from widgethelpers import workbench_up

from smolbench import _loop
from smolbench.backends.sandbox import SandboxBackend
from smolbench.magics import ledger_table
from smolbench.result import STATUS_COLORS, STATUS_COLORS_DARK
from smolbench.spec import MachineSpec
from smolbench.tree import Node
from smolbench.widgets import checkpoint_panel, close_views, follow_views, tree_widget
from smolbench.widgets.static import STATUS_TEXT
from smolbench.widgets.tree import best_in, fork_scope, next_seed
from smolbench.workbench import Workbench

WIDGETS = Path(__file__).parent.parent / "smolbench" / "widgets"


@pytest.fixture
def wb(tmp_path: Path) -> Iterator[Workbench]:
    with workbench_up(tmp_path / "ledger.db") as bench:
        yield bench


def nodes_of(*specs: tuple[str, str | None, int | None, str | None]) -> dict[str, Node]:
    out = {}
    for nid, parent, seed, run in specs:
        out[nid] = Node(nid, parent, seed, status="ok", run_id=run)
    return out


def test_fork_scope_best_and_seed_continuation_as_pure_functions() -> None:
    nodes = nodes_of(
        ("root", None, None, None),
        *((f"root.{i}", "root", 100 + i, "r1") for i in range(4)),
        *((f"root.2.{i}", "root.2", 7 + i, "r2") for i in range(3)),
    )
    for i, n in enumerate(nodes.values()):
        n.reward = float(i)
    # the first fork's view: root and its own branches, not the nested fork under root.2
    assert fork_scope(nodes, {"r1"}, "root") == ["root"] + [f"root.{i}" for i in range(4)]
    # the nested fork's view: the path to its parent, then its branches
    assert fork_scope(nodes, {"r2"}, "root.2") == ["root", "root.2"] + [f"root.2.{i}" for i in range(3)]
    # the best of each fork, not of the session
    assert best_in(nodes, [f"root.{i}" for i in range(4)]) == ["root", "root.3"]
    assert best_in(nodes, [f"root.2.{i}" for i in range(3)]) == ["root", "root.2", "root.2.2"]
    # Fork ×N's automatic seeds continue after the highest seed of the session, on any node
    assert next_seed(nodes) == 104
    assert next_seed({"root": nodes["root"]}) is None  # no seed yet: the view uses its fork's base


def test_each_fork_view_shows_its_own_fork_and_its_own_best(wb: Workbench) -> None:
    first = wb.new_fork(8, None, 100)
    view_a = tree_widget(wb, result=first)
    _loop.run(wb.fork(first, FORK_CODE, lambda b, ev: None), timeout=120)
    wb.use("root.7")
    second = wb.new_fork(3, None, 0)
    view_b = tree_widget(wb, result=second)
    _loop.run(wb.fork(second, "reward = 1000 - SEED", lambda b, ev: None), timeout=120)
    session = tree_widget(wb)
    until(lambda: len(view_b.nodes) == 5 and by_id(view_b)["root.7.2"]["status"] == "ok", "fork B")
    until(lambda: by_id(view_a)["root.7"]["kept"], "fork A")

    assert [n["id"] for n in view_a.nodes] == ["root"] + [f"root.{i}" for i in range(8)]
    assert view_a.best_path == ["root", "root.7"] and view_a.scope == "fork"
    assert view_a.title == "fork of 8 from root"
    assert [n["id"] for n in view_b.nodes] == ["root", "root.7", "root.7.0", "root.7.1", "root.7.2"]
    assert [n["mine"] for n in view_b.nodes] == [False, False, True, True, True]
    assert view_b.best_path == ["root", "root.7", "root.7.0"]  # B's best (1000), not A's
    assert len(session.nodes) == 12 and session.best_path == ["root", "root.7", "root.7.0"]

    # the toggle shows the whole session in that view only
    view_a.on_scope({"scope": "session"})
    assert len(view_a.nodes) == 12 and len(view_b.nodes) == 5
    view_a.on_scope({"scope": "fork"})
    assert len(view_a.nodes) == 9

    # every view has its own messages (a new view does not inherit the last reply)
    click(view_a, "checkpoint", node="root.7.0")
    assert view_a.message["text"].startswith("saved checkpoint root.7.0-") and view_b.message == {}

    # the static copy (saved notebooks) shows the same rows, escaped
    html = view_b.static_html()
    assert html.count("<tr") == 1 + 5 and 'data-id="root.7.0"' in html and "&#9733; best" in html
    data, _ = view_b._repr_mimebundle_()
    assert data["text/html"] == html and "application/vnd.jupyter.widget-view+json" in data


def test_fork_button_continues_seeds_takes_a_seed_base_and_logs_its_output(wb: Workbench) -> None:
    first = wb.new_fork(4, None, 100)
    view = tree_widget(wb, result=first)
    _loop.run(wb.fork(first, "reward = SEED\nprint('seed', SEED)", lambda b, ev: None, keep="all"))
    until(lambda: len(view.nodes) == 5, "the fork")
    # automatic seeds continue after the highest seed of the session, on every node
    assert by_id(view)["root.2"]["next_seed"] == 104 and by_id(view)["root"]["next_seed"] == 104
    reply = click(view, "fork", node="root.2", n=2)
    assert reply["level"] == "ok", reply
    reply = click(view, "fork", node="root.2", n=2)
    assert reply["level"] == "ok", reply
    kids = sorted((n.id, n.seed) for n in wb.tree if n.parent == "root.2")
    assert kids == [("root.2.0", 104), ("root.2.1", 105), ("root.2.2", 106), ("root.2.3", 107)]
    # a sibling forked on "auto" never repeats a seed of the session
    reply = click(view, "fork", node="root.1", n=2)
    assert reply["level"] == "ok" and [wb.tree[f"root.1.{i}"].seed for i in (0, 1)] == [108, 109]
    reply = click(view, "fork", node="root.2", n=1, seed_base=500)
    assert reply["level"] == "ok" and wb.tree["root.2.4"].seed == 500
    assert by_id(view)["root"]["next_seed"] == 501
    reply = click(view, "fork", node="root.2", n=1, seed_base="x")
    assert reply["level"] == "error" and "whole number" in reply["text"]
    # the view's own fork and the branches forked from it; their output is in the log
    until(lambda: "root.2.4" in by_id(view), "the forked branches in the view")
    assert "[root.2.1] seed 105" in view.log and "[root.2.4] seed 500" in view.log
    assert "fork root.2 ×2 (seeds 106..107)" in view.log


def test_checkpoint_panel_stays_live_across_down_and_up(wb: Workbench, tmp_path: Path) -> None:
    panel = checkpoint_panel(wb)
    for name in ("a", "b"):
        assert click(panel, "save", name=name, node="root")["level"] == "ok"
    [row_b, row_a] = panel.checkpoints
    assert re.fullmatch(r"\d+(\.\d)? (B|kB|MB|GB)", row_a["size_text"]), row_a  # one convention
    _loop.run(wb.down())
    close_views(wb)
    assert panel.backend == "" and panel.live_nodes == []
    assert panel.checkpoints[0]["blocked"]["restore"].startswith("no machine is up")
    # deleting works without a machine: the file and the ledger entry go
    path_a = Path(wb.ledger.checkpoint("a")["path"])  # type: ignore[index]
    assert click(panel, "delete", name="a")["text"] == "deleted checkpoint a"
    assert not path_a.exists() and [c["name"] for c in panel.checkpoints] == ["b"]
    assert "no machine is up" in click(panel, "restore", name="b")["text"]

    again = Workbench(SandboxBackend(), MachineSpec(), wb.ledger)
    _loop.run(again.up())
    try:
        follow_views(again)
        assert panel.backend == "sandbox" and panel.live_nodes == ["root"]
        reply = click(panel, "restore", name="b")
        assert reply["text"] == "restored b as r1-b (now active)" and again.active == "r1-b"
        # a later `up` is a new ledger session: both roots keep their own rows
        sessions = wb.ledger.sessions()
        assert list(sessions.id) == [wb.session, again.session]
        roots = wb.ledger.nodes()
        assert len(roots[roots.id == "root"]) == 2
    finally:
        close_views(again)
        _loop.run(again.down(), timeout=60)


def test_ledger_table_shows_local_times_whole_seeds_and_yes_no() -> None:
    df = pd.DataFrame(
        {"id": ["root", "root.0"], "seed": [None, 300.0], "started": [1796049000.5, 1796049001.0],
         "ended": [None, 1796049002.0], "alive": [1, 0]}
    )
    out = ledger_table(df)
    assert str(out.seed.dtype) == "Int64" and out.seed.isna().tolist() == [True, False]
    assert "300.0" not in out.to_string() and " 300 " in out.to_string() + " "
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", out.started[0])
    assert out.ended[0] == "" and list(out.alive) == ["yes", "no"]


# -- colours and glyphs ------------------------------------------------------------------------

# JupyterLab 4's backgrounds behind the widgets (--jp-layout-color0 / -color1)
BACKGROUNDS = {"light": ("#ffffff", "#ffffff"), "dark": ("#111111", "#212121")}


def _luminance(hex_colour: str) -> float:
    h = hex_colour.lstrip("#")
    rgb = [int(h[i : i + 2], 16) / 255 for i in (0, 2, 4)]
    lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def contrast(a: str, b: str) -> float:
    """The WCAG 2 contrast ratio of two colours."""
    hi, lo = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def _vars(css: str, selector_start: str, prefix: str) -> dict[str, str]:
    block = css[css.index(selector_start) :]
    block = block[: block.index("}")]
    return dict(re.findall(rf"--{prefix}-([a-z]+):\s*(#[0-9a-fA-F]{{6}})", block))


def test_status_colours_pass_wcag_aa_on_both_themes() -> None:
    tree_css = (WIDGETS / "tree.css").read_text()
    panel_css = (WIDGETS / "checkpoints.css").read_text()
    themes = {
        "light": {**_vars(tree_css, ".sbt {", "sbt"), **_vars(panel_css, ".sbc {", "sbc")},
        "dark": {
            **_vars(tree_css, 'body[data-jp-theme-light="false"] .sbt', "sbt"),
            **_vars(panel_css, 'body[data-jp-theme-light="false"] .sbc', "sbc"),
        },
    }
    statuses = {"ok", "error", "timeout", "cancelled", "running", "starting", "idle", "accent", "warn"}
    for theme, colours in themes.items():
        assert statuses <= set(colours), (theme, statuses - set(colours))
        for name, colour in colours.items():
            for bg in BACKGROUNDS[theme]:
                ratio = contrast(colour, bg)
                assert ratio >= 4.5, f"{theme} {name} {colour} on {bg}: {ratio:.2f} < 4.5"
    for status, colour in STATUS_TEXT.items():  # the static copy, shown on light pages
        assert contrast(colour, "#ffffff") >= 4.5, status
    for status, colour in STATUS_COLORS.items():  # a ForkResult's table, on each theme
        assert contrast(colour, "#ffffff") >= 4.5, status
        for bg in BACKGROUNDS["dark"]:
            dark = STATUS_COLORS_DARK[status]
            assert contrast(dark, bg) >= 4.5, f"the result table's dark {status} {dark} on {bg}: {contrast(dark, bg):.2f}"


ALLOWED = set("·…×▸▾★“”—")  # all in DejaVu Sans, which Debian installs with any desktop font set


def test_widgets_use_no_glyph_that_needs_an_emoji_font() -> None:
    used: set[str] = set()
    for path in [*WIDGETS.glob("*.js"), *WIDGETS.glob("*.css"), WIDGETS / "static.py"]:
        used |= {c for c in path.read_text() if ord(c) > 127}
    assert used <= ALLOWED, sorted(used - ALLOWED)
    if shutil.which("fc-list"):
        for c in used:
            fonts = subprocess.run(
                ["fc-list", f":charset={ord(c):x}", "family"], capture_output=True, text=True
            ).stdout
            assert "DejaVu Sans" in fonts, f"{c!r} (U+{ord(c):04X}) is not in DejaVu Sans here"


def test_a_fork_cell_returns_its_result_and_smolbench_guest_needs_no_import(tmp_path: Path) -> None:
    from nbhelpers import NotebookSession, result_text, stream_text

    with NotebookSession(tmp_path) as nb:
        nb.run("%load_ext smolbench")
        nb.run("%smol up --backend sandbox")
        cell = nb.run("%%smol fork 3 --seed-base 7\nsmolbench_guest.report(reward=SEED * 2)")
        assert (result_text(cell) or "").startswith("fork of 3 · 3 ok · best reward 18 on root.2")
        same = nb.run("print(type(_).__name__, _.best['branch'], _ is Out[3])")
        assert stream_text(same) == "ForkResult root.2 True\n"
        quiet = nb.run("%%smol fork 2 --quiet --out q\nreward = SEED")
        assert result_text(quiet) is None and stream_text(quiet).startswith("fork of 2 · 2 ok")
        assert stream_text(nb.run("print(len(q))")) == "2\n"
        eps = nb.run("%%smol episodes 2\nsmolbench_guest.report(reward=1)")
        assert (result_text(eps) or "").startswith("episodes of 2 · 2 ok")
        nb.run("%smol down")


def test_a_node_is_not_shown_busy_once_its_cell_ended(wb: Workbench) -> None:
    """A cell that reports a reward updates the view while it runs (busy); its end must
    update it again, even with no `post_run_cell` to flush the view (a background cell)."""
    view = tree_widget(wb)
    res = _loop.run(wb.run_cell("import time\nreward = 1\ntime.sleep(0.3)", lambda ev: None))
    assert res.status == "ok"
    until(lambda: not by_id(view)["root"]["busy"], "root to be shown free again")
    assert "running in root" not in str(by_id(view)["root"]["blocked"])


def test_checkpoint_badges_follow_deletes_made_elsewhere(wb: Workbench) -> None:
    view = tree_widget(wb)
    for name in ("a", "b"):
        _loop.run(wb.checkpoint_save(name, "root"))
    until(lambda: by_id(view)["root"]["checkpoint"] == "b", "the newest checkpoint's badge")
    # the sidebar's Delete (the server removes the file and the ledger row, not this kernel)
    assert wb.ledger.checkpoint("b")["path"] == "checkpoints/b.smolcheckpoint"  # type: ignore[index]  # relative
    (wb.shelf.store.directory / "b.smolcheckpoint").unlink()
    wb.ledger.remove_checkpoint("b")
    until(lambda: by_id(view)["root"]["checkpoint"] == "a", "the badge of the checkpoint left", 10)
    wb.checkpoint_remove("a")
    until(lambda: by_id(view)["root"]["checkpoint"] is None, "no badge", 10)
