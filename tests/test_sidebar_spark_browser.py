"""The sidebar's reward sparkline draws extreme rewards (real JupyterLab, headless Chromium).

Rewards of -1.7e308 and 1.7e308 made ``hi - lo`` overflow to Infinity in the sparkline, every
point NaN, and the line vanished (session 33's known gap, after the static plots were fixed the
same way). Now the share of each value is computed in halves where the difference overflows.
The ledger is written beforehand; no kernel runs.
"""

from __future__ import annotations

import math
from pathlib import Path

from browserhelpers import BROWSER_TEST_MARKS, browser_page, jupyter_server, write_notebook

from smolbench.ledger import Ledger

pytestmark = BROWSER_TEST_MARKS

RUNS = {"s1/run1": [1.0, 2.0, 3.0], "s1/run2": [-1.7e308, 0.0, 1.7e308], "s1/run3": [0.0, 5e-324, 1.0]}


def _ledger(root: Path) -> None:
    led = Ledger(root / ".smolbench" / "ledger.db")
    led.start_session("s1", backend="sandbox", isolation="test", baseline="host@x", host="h", cwd=str(root))
    led.upsert_node("s1", "root", status="idle", started=1.0, alive=False)
    for r, (rid, rewards) in enumerate(RUNS.items()):
        led.start_run(rid, "s1", kind="fork", parent_id="root", code=f"reward = {rid!r}", n=len(rewards))
        for i, reward in enumerate(rewards):
            led.upsert_node("s1", f"root.{r * 10 + i}", run_id=rid, parent_id="root", seed=i, status="ok",
                            reward=reward, started=10.0 * r + i, ended=10.0 * r + i + 1, alive=False)
        led.end_run(rid, "done")
    led.close()


def test_the_sparkline_draws_rewards_whose_difference_overflows(tmp_path: Path) -> None:
    from playwright.sync_api import expect

    root = tmp_path / "root"
    root.mkdir()
    _ledger(root)
    write_notebook(root / "a.ipynb", ["1 + 1"])
    with jupyter_server(root, "lab") as (base, token), browser_page(1400, 900) as page:
        page.goto(f"{base}/lab/tree/a.ipynb?reset&token={token}")
        page.wait_for_selector(".jp-NotebookPanel:visible .jp-Cell", timeout=60_000)
        page.locator(".jp-smolbench-status").click()
        panel = page.locator("#smolbench-panel")
        expect(panel.locator(".sb-runs-filter")).to_be_visible(timeout=30_000)
        panel.locator(".sb-runs-filter").select_option(label="all notebooks · 3")  # not recorded with a notebook
        expect(panel.locator(".sb-run")).to_have_count(3, timeout=30_000)
        for code, rewards in zip(["reward = 's1/run1'", "reward = 's1/run2'", "reward = 's1/run3'"], RUNS.values()):
            run = panel.locator(".sb-run", has=page.locator(".sb-cell", has_text=code))
            points = run.locator(".sb-spark polyline").get_attribute("points") or ""
            ys = [float(p.split(",")[1]) for p in points.split()]
            assert len(ys) == len(rewards) and all(math.isfinite(y) for y in ys), (code, points)
            assert ys[0] > ys[-1], (code, points)  # lowest reward at the bottom, highest at the top
