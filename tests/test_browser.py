"""The fork-tree widget in a real browser: JupyterLab + headless Chromium (Playwright).

Runs a notebook with a 64-branch fork nested four deep (Run All), checks each fork cell's
view shows its own fork and the session view every node, clicks **Use** while a cell is still
running (the click reaches the kernel through a subshell) with the status bar still busy,
checks plots drawn during Run All are not empty and a traceback names the right cell and
line, and saves screenshots to tests/artifacts/.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

from browserhelpers import (
    ARTIFACTS,
    BROWSER_TEST_MARKS,
    browser_page,
    dump_failure,
    jupyter_server,
    kernel_status,
    notebook_url,
    run_all,
    write_notebook,
)

from smolbench.widgets.static import FOLD_RULE

pytestmark = BROWSER_TEST_MARKS

def until(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


CELLS = [
    "%load_ext smolbench",
    "%smol up --backend sandbox",
    "%%smol\nx = 41",
    "%%smol fork 64 --seed-base 100 --out wide\n"
    "reward = (SEED * 37) % 101 + x\n"
    "smolbench_guest.report(steps=SEED % 9)",  # no import: as documented
    "%smol use best",
    "%%smol fork 8\nreward = 200 + (SEED * 13) % 17",
    "%smol use best",
    "%%smol fork 4\nreward = 300 + SEED",
    "%smol use best",
    "%%smol fork 2\nreward = 400 + SEED",
    "%smol checkpoint save warm",
    "%smol checkpoint list",
    "%smol plot",
    "wide.plot()",
    "%smol tree",
    # Runs until the test creates ./go; what it prints shows whether the Use click made
    # meanwhile was applied while it ran (a queued click would apply only after it).
    # (No time limit: this VM's clocks jump; the server's shutdown ends it if the test fails.)
    "import os, time, smolbench\nwb = smolbench._magics.workbench\n"
    "while not os.path.exists('go'):\n    time.sleep(0.05)\n"
    "print('active while this cell ran:', wb.active)",
    # a traceback names the cell's own prompt number and its editor line
    "%%smol\nx = 1\n\nraise ValueError('on editor line 4')",
]


def test_tree_widget_renders_and_use_works_from_the_browser(tmp_path: Path) -> None:
    from playwright.sync_api import expect

    write_notebook(tmp_path / "tree.ipynb", CELLS)
    with jupyter_server(tmp_path, "lab") as (base, token), browser_page() as page:
        try:
            page.goto(notebook_url(base, token, "lab", "tree.ipynb"))
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            run_all(page, len(CELLS))

            # the session view (`%smol tree`): 1 root + 64 + 8 + 4 + 2 nodes, four levels deep
            tree = page.locator(".sbt").last
            expect(tree.locator(".sbt-summary")).to_contain_text(
                "79 nodes · 1 idle · 78 ok", timeout=180_000
            )
            # the 64-branch fan shows its top 8 (best path first) and a row for the other 56
            expect(tree.locator(".sbt-row")).to_have_count(1 + 8 + 8 + 4 + 2)
            more = tree.locator(".sbt-more")
            expect(more).to_have_text(f"… 56 more branches of root ({FOLD_RULE}): show all")
            more.click()
            expect(tree.locator(".sbt-row")).to_have_count(79)
            depth = tree.locator(".sbt-row").evaluate_all(
                "rows => Math.max(...rows.map(r => r.dataset.id.split('.').length - 1))"
            )
            assert depth == 4
            best = tree.locator(".sbt-row.sbt-bestnode")
            expect(best.locator(".sbt-reward")).to_have_text("401")  # root.*.*.*.1: 400 + seed 1
            expect(tree.locator(".sbt-row.sbt-best")).to_have_count(5)  # root and 4 descendants

            # each fork cell's view shows its own fork: the first one root and its 64 branches,
            # with its own best starred; the last one the path to its parent and its 2 branches
            views = page.locator(".sbt")
            first_view, last_view = views.nth(0), views.nth(3)
            expect(first_view.locator(".sbt-title")).to_have_text("fork of 64 from root")
            expect(first_view.locator(".sbt-summary")).to_contain_text("65 nodes")
            expect(first_view.locator(".sbt-row.sbt-bestnode .sbt-reward")).to_have_text("141")
            expect(last_view.locator(".sbt-row")).to_have_count(4 + 2)
            expect(last_view.locator(".sbt-row.sbt-context")).to_have_count(4)  # the path
            # the toggle shows that view the whole session
            last_view.locator(".sbt-scope").click()
            expect(last_view.locator(".sbt-summary")).to_contain_text("79 nodes")
            last_view.locator(".sbt-scope").click()
            expect(last_view.locator(".sbt-row")).to_have_count(6)

            # the blocking cell runs now; the status bar says busy, and stays busy after a
            # click answered on a subshell
            until(lambda: kernel_status(page) == "busy", "the blocking cell to run")
            want = best.get_attribute("data-id")
            assert want is not None
            first = ".".join(want.split(".")[:2])
            row = tree.locator(f".sbt-row[data-id='{first}']")
            row.scroll_into_view_if_needed()
            row.click()
            use = tree.locator("button.sbt-btn-use")
            expect(use).to_be_enabled()
            use.click()
            expect(tree.locator(".sbt-msg")).to_have_text(f"{first} is now the active machine")
            assert kernel_status(page) == "busy"  # the click's own busy/idle did not flip it
            (tmp_path / "go").touch()
            out = page.locator(".jp-OutputArea-output", has_text="active while this cell ran")
            out.wait_for(timeout=60_000)
            expect(out).to_have_text(f"active while this cell ran: {first}")

            # the traceback names this cell's prompt and the editor line of the raise
            failing = page.locator(".jp-Notebook .jp-Cell").last
            expect(failing.locator(".jp-OutputArea-output")).to_contain_text("on editor line 4")
            # its number comes with the execute reply, after the output ("[*]:" until then)
            expect(failing.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]"), timeout=60_000)
            prompt = failing.locator(".jp-InputPrompt").inner_text()
            number = re.search(r"\d+", prompt)
            assert number, prompt
            # (in a branch machine the agent adds which one: <In [17]@root.31>)
            expect(failing.locator(".jp-OutputArea-output")).to_contain_text(
                re.compile(rf'File "<In \[{number.group(0)}\](@{re.escape(first)})?>", line 4')
            )

            # a deleted node's buttons are disabled, with the reason as the tooltip
            dead = tree.locator(".sbt-row.sbt-dead").first
            dead_id = dead.get_attribute("data-id")
            dead.click()
            expect(tree.locator("button.sbt-btn-use")).to_be_disabled()
            expect(tree.locator(".sbt-btnwrap").first).to_have_attribute(
                "title", re.compile(f"{re.escape(str(dead_id))} was deleted")
            )

            ARTIFACTS.mkdir(exist_ok=True)
            tree.locator(f".sbt-row[data-id='{first}']").click()
            fold = tree.locator(".sbt-more", has_text="show only the top 8")
            if fold.count():
                fold.click()
            tree.scroll_into_view_if_needed()
            tree.screenshot(path=str(ARTIFACTS / "tree_widget.png"))
            last_view.scroll_into_view_if_needed()
            last_view.screenshot(path=str(ARTIFACTS / "fork_view.png"))
            page.screenshot(path=str(ARTIFACTS / "tree_notebook.png"))

            panel = page.locator(".sbc").last
            expect(panel.locator(".sbc-row[data-name='warm'] td").nth(1)).to_have_text(
                "root.31.5.3"
            )
            panel.scroll_into_view_if_needed()
            panel.screenshot(path=str(ARTIFACTS / "checkpoint_panel.png"))
            # plots drawn during Run All (mostly out of view then) are not empty
            plots = page.locator(".jp-RenderedPlotly")
            expect(plots).to_have_count(2)
            for i, name in enumerate(("tree_plot", "reward_plot")):
                plot = plots.nth(i)
                plot.scroll_into_view_if_needed()
                expect(plot.locator(".scatterlayer .trace").first).to_be_visible(timeout=60_000)
                box = plot.locator(".main-svg").first.bounding_box()
                assert box is not None and box["width"] > 300 and box["height"] > 200, box
                plot.screenshot(path=str(ARTIFACTS / f"{name}.png"))
            assert page.get_by_text("model not found").count() == 0
        except BaseException:
            dump_failure(page, "tree")
            raise
