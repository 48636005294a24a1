"""A notebook executed headless (nbclient), saved, and opened in a fresh JupyterLab shows the
fork tree and the plots: static copies when the notebook is not trusted, the restored widget
state when it is; never "model not found". Also what nbconvert's HTML shows."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
from browserhelpers import (
    ARTIFACTS,
    BROWSER_TEST_MARKS,
    browser_page,
    dump_failure,
    jupyter_server,
    notebook_url,
)
from nbhelpers import NotebookSession

pytestmark = BROWSER_TEST_MARKS

CELLS = [
    "%load_ext smolbench",
    "%smol up --backend sandbox",
    "%%smol fork 8 --seed-base 100\nreward = (SEED * 7) % 11",
    "_.plot()",
    "%smol use best",
    "%%smol fork 3\nreward = 20 + SEED",
    "%smol plot",
    "%smol tree",
    "%smol checkpoint save warm",
    "%smol checkpoint list",
]


def execute_and_save(path: Path) -> nbformat.NotebookNode:
    with NotebookSession(path.parent) as s:
        for source in CELLS:
            s.run(source)
        s.client.set_widgets_metadata()  # what `jupyter nbconvert --execute` stores too
    nb = s.nb
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return nb


def test_saved_notebook_shows_the_tree_and_the_plots_in_a_fresh_server(tmp_path: Path) -> None:
    from playwright.sync_api import expect

    nb = execute_and_save(tmp_path / "saved.ipynb")
    # every widget output carries a static copy, every plot a static SVG
    outputs = [o for c in nb.cells for o in c.get("outputs", []) if "data" in o]
    views = [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o["data"]]
    copies = [o for o in outputs if "smolbench-static-copy" in o["data"].get("text/html", "")]
    assert len(views) == 4 and len(copies) == 4 and all("<table>" in o["data"]["text/html"] for o in copies)
    plots = [o for o in outputs if "application/vnd.plotly.v1+json" in o["data"]]
    assert len(plots) == 2 and all(o["data"]["image/svg+xml"].startswith("<svg") for o in plots)
    # the first fork's copy was refreshed when its cell ended: 8 finished branches
    first = copies[0]["data"]["text/html"]
    assert first.count('data-id="root.') == 8 and 'class="sb-st-running"' not in first

    # nbconvert's HTML of the notebook without its widget state (with it, nbconvert embeds the
    # widgets and loads their JS from a CDN; GitHub ignores the state): the tables and SVGs
    bare = nbformat.read(tmp_path / "saved.ipynb", as_version=4)
    bare.metadata.pop("widgets", None)
    nbformat.write(bare, tmp_path / "bare.ipynb")
    subprocess.run(
        [sys.executable, "-m", "jupyter", "nbconvert", "--to", "html", str(tmp_path / "bare.ipynb")],
        check=True, capture_output=True, cwd=tmp_path,
    )
    html = (tmp_path / "bare.html").read_text()
    (tmp_path / "bare.ipynb").unlink()
    assert html.count('class="smolbench-static smolbench-tree ') >= 3
    assert html.count('data-mime-type="image/svg+xml"') == 2  # the plots, as static SVG

    ARTIFACTS.mkdir(exist_ok=True)
    for dark in (False, True):
        theme = "dark" if dark else "light"
        with jupyter_server(tmp_path, "lab", dark=dark) as (base, token), browser_page() as page:
            try:
                page.goto(notebook_url(base, token, "lab", "saved.ipynb"))
                page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
                trees = page.locator(".smolbench-tree")
                expect(trees).to_have_count(3, timeout=30_000)
                expect(trees.first.locator("tr.sb-node")).to_have_count(9)  # root + 8
                expect(trees.nth(1).locator("tr.sb-node")).to_have_count(2 + 3)  # path + 3
                expect(page.locator(".smolbench-checkpoints tr.sb-checkpoint")).to_have_text(
                    re.compile("^warm")
                )
                plotted = page.locator(".jp-RenderedPlotly")
                expect(plotted).to_have_count(2)
                for i in range(2):
                    plotted.nth(i).scroll_into_view_if_needed()
                    expect(plotted.nth(i).locator(".scatterlayer .trace").first).to_be_visible()
                assert page.get_by_text("model not found").count() == 0
                page.locator(".jp-Notebook .jp-Cell").nth(2).scroll_into_view_if_needed()
                page.screenshot(path=str(ARTIFACTS / f"saved_notebook_{theme}.png"))
            except BaseException:
                dump_failure(page, f"saved-{theme}")
                raise

    # trusted (as if the user had run it): the live views come back from the stored widget state
    env = {**os.environ, "JUPYTER_DATA_DIR": str(tmp_path / ".jupyter-data")}
    subprocess.run([sys.executable, "-m", "jupyter", "trust", str(tmp_path / "saved.ipynb")],
                   check=True, capture_output=True, env=env)
    with jupyter_server(tmp_path, "lab") as (base, token), browser_page() as page:
        try:
            page.goto(notebook_url(base, token, "lab", "saved.ipynb"))
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
            views = page.locator(".sbt")
            expect(views).to_have_count(3, timeout=60_000)
            expect(views.first.locator(".sbt-row")).to_have_count(9)
            expect(page.locator(".jp-RenderedPlotly .scatterlayer .trace").first).to_be_visible()
            assert page.get_by_text("model not found").count() == 0
        except BaseException:
            dump_failure(page, "saved-trusted")
            raise
