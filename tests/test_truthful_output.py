"""What the magics print is what happened (issue 18, kernel side), through a real kernel:
a fork without rewards says so and what the keep policy did; `--quiet` is one line;
`%smol` help lists every fork option; `%smol tree` shows one tree; the ledger shows whole
seeds; a replay that matched never says it "may differ"; trailing comments on magic lines."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from nbhelpers import NotebookSession, error_text, result_text, stream_text

from smolbench.widgets.svgplot import CHAR_W, bars_and_scatter, depth_scatter

WIDGET = "application/vnd.jupyter.widget-view+json"


def displays(cell: object) -> list[dict[str, object]]:
    return [o for o in cell.outputs if o.output_type == "display_data"]  # type: ignore[attr-defined]


def test_the_magics_say_what_happened(tmp_path: Path) -> None:
    with NotebookSession(tmp_path) as s:
        s.run("%load_ext smolbench")
        up = s.run("%smol up --backend sandbox          # a warm parent machine")
        assert "smolbench: up on sandbox" in stream_text(up), error_text(up)

        # a fork whose cell reports no reward: said, with what --keep best did
        silent = s.run("%%smol fork 4   # no reward here\nx = SEED * 2")
        warning = stream_text(silent, "stderr")
        assert "no branch reported a reward" in warning, warning
        assert "--keep best` kept none: every branch was deleted" in warning
        assert "no branch reported a reward" in (result_text(silent) or "")
        status = stream_text(s.run("%smol status"))
        assert re.search(r"1 \(root\)", status), status  # every branch went, as said

        # --quiet: exactly one line, no tree, no progress, no Out[n]
        quiet = s.run("%%smol fork 3 --seed-base 100 --quiet\nreward = SEED")
        assert [o.output_type for o in quiet.outputs] == ["stream"], quiet.outputs
        assert re.fullmatch(r"fork of 3 · 3 ok · best reward 102 on root\.6 \(seed 102\) · in [\d.]+ s"
                            r" · kept alive: root\.6\n", stream_text(quiet)), stream_text(quiet)

        # the help lists every fork option
        helped = stream_text(s.run("%smol"))
        for option in ("--quiet", "--retries K", "--keep best|all|none", "--bg"):
            assert option in helped, option

        # one tree: the live view and its static copy, no second (text) tree that could disagree
        tree = s.run("%smol tree")
        assert stream_text(tree) == "" and [o.output_type for o in tree.outputs] == ["display_data"] * 2
        view, copy = displays(tree)
        assert WIDGET in view["data"] and "text/html" not in view["data"]  # type: ignore[operator]
        html = copy["data"]["text/html"]  # type: ignore[index]
        assert 'data-id="root.6"' in html and "&#9733; best" in html
        text = copy["data"]["text/plain"]  # type: ignore[index]
        assert "root.6  seed=102  ok" in text and "root  idle" in text  # the same tree, as text

        # the ledger: whole-number seeds in the table and in the DataFrame
        ledger = result_text(s.run("%smol ledger"))
        assert ledger is not None and re.search(r"root\.6\s+root\s+102\s+ok\s+102\.0", ledger), ledger
        frame = result_text(s.run("import smolbench\nsmolbench.Ledger('.smolbench/ledger.db').nodes().seed.tolist()"))
        assert frame is not None and "102" in frame and "102.0" not in frame, frame

        # a replay that matched says so, and names what ran since without "may differ"
        s.run("%%smol\ny = 1")
        replay = stream_text(s.run("%smol replay root.6"))
        assert "reward 102.0 vs recorded 102.0: identical" in replay, replay
        assert "may differ" not in replay and "root ran 1 more cell(s) after the fork" in replay
        s.run("%smol down")


def test_the_reward_plot_keeps_axis_titles_clear_of_tick_labels() -> None:
    bars = [(f"root.7.{i}.12", -123456.5 + i, "#1a7f37", i == 0) for i in range(20)]
    svg = bars_and_scatter(bars, [(float(i), b[1], b[2]) for i, b in enumerate(bars)], None, "t")
    # the y title of the left panel sits left of its widest tick label
    ticks = re.findall(r'<text x="([\d.]+)" y="[\d.]+" text-anchor="end">([^<]+)</text>', svg)
    left_ticks = [(float(x), label) for x, label in ticks if float(x) < 100]
    widest = max(len(label) for _, label in left_ticks) * CHAR_W
    title_x = float(re.findall(r'translate\(([\d.-]+),[\d.]+\) rotate\(-90\)', svg)[0])
    assert title_x < left_ticks[0][0] - widest, (title_x, left_ticks[0], widest)
    # the x title of the bars goes below their rotated branch labels
    xtitle_y = float(re.search(r'y="([\d.]+)" text-anchor="middle">branch</text>', svg).group(1))  # type: ignore[union-attr]
    label_y = float(re.findall(r'translate\([\d.]+,([\d.]+)\) rotate\(45\)', svg)[0])
    assert xtitle_y > label_y + len("root.7.19.12") * 5.3 * 0.7


@pytest.mark.parametrize("rewards", [[0.0, 5e-324], [-1.7e308, 1.7e308], [1.7e308, 1.79e308], [-1.79e308, 0.0]])
def test_the_static_plots_draw_extreme_rewards_at_real_coordinates(rewards: list[float]) -> None:
    """Rewards a machine reports may be any finite float: 0 and 5e-324 raised in the y ticks
    (log10 of 0: the notebook's static copy of the plots was dropped), and -1.7e308 with
    1.7e308 overflowed every difference, so every mark was drawn at NaN (last audit of round 4)."""
    svg = bars_and_scatter([(f"b{i}", r, "#000", i == 0) for i, r in enumerate(rewards)],
                           [(float(i), r, "#000") for i, r in enumerate(rewards)], (0.0, rewards[0]), "t")
    svg += depth_scatter([(float(i), r, "#000", True) for i, r in enumerate(rewards)],
                         [(0.0, rewards[0], 1.0, rewards[1])], [(0.0, rewards[0]), (1.0, rewards[1])], "t")
    coords = re.findall(r'\b(?:x|y|x1|x2|y1|y2|cx|cy|width|height)="([^"]*)"', svg)
    assert coords and all(math.isfinite(float(c)) for c in coords), [c for c in coords if not math.isfinite(float(c))][:5]
    assert svg.count("<circle") == 2 * len(rewards) + 1
