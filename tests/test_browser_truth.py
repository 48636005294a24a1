"""The notebook tells the truth in real frontends (issue 18), JupyterLab and Notebook 7 in
Debian's Chromium:

- a notebook run in the browser, saved the ordinary way (Ctrl+S; the frontends don't save
  widget state by default), its kernel shut down, and reopened shows every tree as its
  static copy and the plots, never "model not found" (light and dark, and in Notebook 7);
- the views follow their kernel: after `kill -9` of the kernel they say it is gone, and
  their buttons are disabled saying why.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from browserhelpers import (
    ARTIFACTS,
    BROWSER_TEST_MARKS,
    browser_page,
    dump_failure,
    jupyter_server,
    notebook_url,
    run_all,
    wait_for_kernel,
    write_notebook,
)

pytestmark = BROWSER_TEST_MARKS

CELLS = [
    "%load_ext smolbench",
    "%smol up --backend sandbox",
    "%%smol fork 6 --seed-base 100\nreward = (SEED * 7) % 11",
    "_.plot()",
    "%smol use best",
    "%%smol fork 3\nreward = 20 + SEED",
    "%smol tree",
    "%smol checkpoint save warm",
    "%smol checkpoint list",
    "import os\nprint('KERNEL', os.getpid())",
]
DOCS_IMG = Path(__file__).parent.parent / "docs" / "img"


def run_to_the_end(page: Any, cells: int) -> None:
    """Run All, and make sure every cell ran: on a loaded 2-core host a Run All started while
    the session settles has stopped after the first cell; go on from the first cell not run."""
    run_all(page, cells)
    first_unrun = (
        "() => { const w = window.jupyterapp.shell.currentWidget;"
        " const cs = w.content.model.cells; for (let i = 0; i < cs.length; i++) {"
        " const c = cs.get(i); if (c.type === 'code' && c.executionCount === null) return i; } return -1; }"
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        page.wait_for_timeout(2000)
        i = page.evaluate(first_unrun)
        if i < 0:
            return
        idle = page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status")
        if idle == "idle":
            page.wait_for_timeout(2000)
            if page.evaluate(first_unrun) == i and page.evaluate(
                "() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status"
            ) == "idle":
                page.evaluate(
                    "i => { const w = window.jupyterapp.shell.currentWidget; w.content.activeCellIndex = i;"
                    " window.jupyterapp.commands.execute('notebook:run-all-below'); }", i,
                )
    raise AssertionError("the notebook's cells did not all run")


def visible_text(page: Any, text: str) -> int:
    return int(page.evaluate(
        "t => [...document.querySelectorAll('.jp-OutputArea-output')]"
        ".filter(e => e.offsetParent !== null && e.innerText.includes(t)).length",
        text,
    ))


def check_reopened(page: Any) -> None:
    """Three trees and the checkpoint table as static copies, two plots, no error."""
    from playwright.sync_api import expect

    copies = page.locator(".smolbench-static-copy .smolbench-tree")
    expect(copies).to_have_count(3, timeout=60_000)
    for i in range(3):
        expect(copies.nth(i)).to_be_visible()
    expect(copies.first.locator("tr.sb-node")).to_have_count(7)  # root + 6
    expect(copies.nth(1).locator("tr.sb-node")).to_have_count(2 + 3)  # the path, then 3
    expect(page.locator(".smolbench-static-copy tr.sb-checkpoint")).to_have_text(re.compile("^warm"))
    # the plot: plotly's renderer (its saved snapshot image until it redraws), or the static SVG
    plotted = page.locator(".jp-RenderedPlotly, .jp-OutputArea-output[data-mime-type='image/svg+xml']")
    expect(plotted).to_have_count(1)
    plotted.first.scroll_into_view_if_needed()
    expect(plotted.first.locator("svg, img").first).to_be_visible(timeout=30_000)
    page.wait_for_timeout(1000)  # a late "model not found" would show by now
    assert visible_text(page, "model not found") == 0
    assert visible_text(page, "Error displaying widget") == 0


def test_a_notebook_saved_in_jupyterlab_reopens_with_its_trees(tmp_path: Path) -> None:
    from playwright.sync_api import expect

    write_notebook(tmp_path / "saved.ipynb", CELLS)
    with jupyter_server(tmp_path, "lab") as (base, token), browser_page() as page:
        try:
            page.goto(notebook_url(base, token, "lab", "saved.ipynb"))
            run_to_the_end(page, len(CELLS))
            last = page.locator(".jp-Notebook .jp-Cell").nth(len(CELLS) - 1)
            expect(last.locator(".jp-OutputArea-output")).to_contain_text("KERNEL", timeout=180_000)
            wait_for_kernel(page)
            # live: the views, and no static copy on screen
            expect(page.locator(".sbt")).to_have_count(3)
            assert page.locator(".smolbench-static-copy").count() == 4
            assert visible_text(page, "smolbench fork") == 0
            page.keyboard.press("Control+s")
            page.wait_for_function(
                "() => !window.jupyterapp.shell.currentWidget.context.model.dirty", timeout=30_000
            )
            page.evaluate("() => window.jupyterapp.commands.execute('kernelmenu:shutdown')")
            page.wait_for_timeout(500)
            if page.locator(".jp-Dialog button.jp-mod-accept").count():
                page.locator(".jp-Dialog button.jp-mod-accept").first.click()
            page.wait_for_function(
                "() => { const s = window.jupyterapp.shell.currentWidget.sessionContext;"
                " return !s.session || !s.session.kernel; }", timeout=30_000,
            )
            page.reload()
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
            check_reopened(page)
            page.locator(".jp-Notebook .jp-Cell").nth(2).scroll_into_view_if_needed()
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "saved_notebook_light.png"))
        except BaseException:
            dump_failure(page, "saved-lab")
            raise

    # a fresh server, dark theme; then Notebook 7
    for app, dark in (("lab", True), ("notebook", False)):
        with jupyter_server(tmp_path, app, dark=dark) as (base, token), browser_page() as page:
            try:
                page.goto(notebook_url(base, token, app, "saved.ipynb"))
                page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
                check_reopened(page)
                page.locator(".jp-Notebook .jp-Cell").nth(2).scroll_into_view_if_needed()
                page.screenshot(path=str(ARTIFACTS / f"saved_notebook_{app}{'_dark' if dark else ''}.png"))
            except BaseException:
                dump_failure(page, f"saved-{app}")
                raise


def delete_checkpoint(base: str, token: str, name: str) -> None:
    """What the sidebar's checkpoint Delete does: the server removes the file and ledger row."""
    req = urllib.request.Request(f"{base}/smolbench/api/checkpoints/{name}?path=", method="DELETE",
                                 headers={"Authorization": f"token {token}"})
    urllib.request.urlopen(req, timeout=30).read()


def seeds(root: Path) -> dict[str, int]:
    db = sqlite3.connect(f"file:{root / '.smolbench' / 'ledger.db'}?mode=ro", uri=True)
    try:
        return {i: s for i, s in db.execute("SELECT id, seed FROM nodes WHERE seed IS NOT NULL")}
    finally:
        db.close()


@pytest.mark.parametrize("app", ["lab", "notebook"])
def test_views_stay_true_then_say_the_kernel_is_gone_after_kill_9(app: str, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    cells = [CELLS[0], CELLS[1], "%%smol fork 3 --seed-base 100 --keep all\nreward = SEED",
             "%%smol\nimport time\ntime.sleep(1)\nprint('slept in root')",
             "%smol checkpoint save a --node root.2", "%smol checkpoint save b --node root.2",
             "%smol checkpoint list", CELLS[-1]]
    write_notebook(tmp_path / "dies.ipynb", cells)
    with jupyter_server(tmp_path, app) as (base, token), browser_page() as page:
        try:
            page.goto(notebook_url(base, token, app, "dies.ipynb"))
            run_to_the_end(page, len(cells))
            last = page.locator(".jp-Notebook .jp-Cell").nth(len(cells) - 1)
            expect(last.locator(".jp-OutputArea-output")).to_contain_text("KERNEL", timeout=120_000)
            pid = int(re.search(r"KERNEL (\d+)", last.inner_text()).group(1))  # type: ignore[union-attr]
            tree = page.locator(".sbt").first
            msg = tree.locator(".sbt-msg")
            expect(tree.locator(".sbt-live")).to_have_text("live")
            expect(tree.locator(".sbt-info")).to_contain_text("4 live machines")

            # the cell that ran in root has ended: root is not "busy" any more
            tree.locator(".sbt-row[data-id='root']").click()
            expect(tree.locator("button.sbt-btn-fork")).to_be_enabled()
            assert "running in root" not in (tree.locator("button.sbt-btn-fork").get_attribute("title") or "")

            # checkpoint badges follow deletes made elsewhere (the sidebar's Delete)
            badge = tree.locator(".sbt-row[data-id='root.2'] .sbt-b-ckpt")
            expect(badge).to_have_text("ckpt b")
            delete_checkpoint(base, token, "b")
            expect(badge).to_have_text("ckpt a", timeout=10_000)  # its other checkpoint is still there
            delete_checkpoint(base, token, "a")
            expect(badge).to_have_count(0, timeout=10_000)

            # a background Fork ×N (automatic seeds) and a Use: both answers stay on screen
            tree.locator(".sbt-row[data-id='root.0']").click()
            tree.locator("input.sbt-n").fill("2")
            tree.locator("button.sbt-btn-fork").click()
            tree.locator(".sbt-row[data-id='root.1']").click()
            tree.locator("button.sbt-btn-use").click()
            expect(msg).to_contain_text("root.1 is now the active machine", timeout=60_000)
            expect(msg).to_contain_text("fork of 2 · 2 ok", timeout=60_000)
            expect(msg).to_contain_text("root.1 is now the active machine")
            on_disk = seeds(tmp_path)
            assert (on_disk["root.0.0"], on_disk["root.0.1"]) == (103, 104)  # never 100..101 again

            # deleting the parent of the active machine says where the active machine went
            tree.locator(".sbt-row[data-id='root.0.0']").click()
            tree.locator("button.sbt-btn-use").click()
            expect(msg).to_contain_text("root.0.0 is now the active machine", timeout=30_000)
            tree.locator(".sbt-row[data-id='root.0']").click()
            tree.locator("button.sbt-btn-delete").click()
            tree.locator("button.sbt-btn-delete").click()  # Confirm delete
            expect(msg).to_contain_text(
                "root.0.0 was active: the active machine is now root", timeout=30_000
            )
            expect(tree.locator(".sbt-row.sbt-active")).to_have_attribute("data-id", "root")
            ARTIFACTS.mkdir(exist_ok=True)
            tree.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / f"views_true_{app}.png"))

            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            # the server notices within its restarter's poll (3 s), the views at once
            expect(tree.locator(".sbt-live")).to_have_text("kernel gone", timeout=20_000)
            print(f"views said 'kernel gone' {time.monotonic() - t0:.1f} s after kill -9")
            expect(tree.locator(".sbt-info")).to_contain_text("the kernel is gone")
            dialog = page.locator(".jp-Dialog button.jp-mod-accept")  # "Kernel Restarting": OK
            if dialog.count():
                dialog.first.click()
            expect(page.locator(".jp-Dialog")).to_have_count(0)
            tree.locator(".sbt-row[data-id='root.1']").click()
            for action in ("use", "fork", "checkpoint", "delete"):
                button = tree.locator(f"button.sbt-btn-{action}")
                expect(button).to_be_disabled()
                assert "the kernel is gone" in (button.get_attribute("title") or "")
            expect(tree.locator(".sbt-msg")).to_contain_text("the kernel is gone")
            assert "saved copy" not in tree.inner_text()
            panel = page.locator(".sbc").first
            expect(panel.locator(".sbc-msg")).to_contain_text("the kernel is gone")
            for button in panel.locator("button.sbc-btn").all():
                expect(button).to_be_disabled()
            # the kernel behind: that process is gone
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
            ARTIFACTS.mkdir(exist_ok=True)
            tree.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / f"kernel_gone_{app}.png"))
        except BaseException:
            dump_failure(page, f"kernel-gone-{app}")
            raise


@pytest.mark.parametrize("app", ["lab", "notebook"])
def test_the_shipped_notebooks_open_unmodified(app: str, tmp_path: Path) -> None:
    """Opening a shipped notebook (its kernel starts) must not mark it modified: its
    metadata is what the frontend writes for an ipykernel kernel."""
    import shutil

    shipped = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
    assert len(shipped) >= 4
    here = "{}.{}.{}".format(*sys.version_info[:3])
    for nb in shipped:
        shutil.copy(nb, tmp_path / nb.name)
        # The frontend records the kernel's exact Python version, which a shipped notebook can
        # match on one Python only: give the copies this kernel's (the servers run kernels on
        # this interpreter), so anything else that makes them dirty still fails the test.
        doc = json.loads((tmp_path / nb.name).read_text())
        assert doc["metadata"]["language_info"]["version"].startswith("3.")
        doc["metadata"]["language_info"]["version"] = here
        (tmp_path / nb.name).write_text(json.dumps(doc, indent=1) + "\n")
    dirty = "() => { const w = window.jupyterapp.shell.currentWidget; return w.context.model.dirty; }"
    with jupyter_server(tmp_path, app) as (base, token), browser_page() as page:
        for nb in shipped:
            try:
                page.goto(notebook_url(base, token, app, nb.name))
                page.wait_for_function(  # this notebook (earlier ones stay open in hidden tabs)
                    "n => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
                    " return !!(w && w.context && w.context.path.endsWith(n) && w.content.model"
                    " && w.content.model.cells.length > 0); }",
                    arg=nb.name, timeout=90_000,
                )
                wait_for_kernel(page)
                # a moment while the document loads is not "modified"; staying so is
                page.wait_for_function(f"{dirty.replace('return w', 'return !w')}", timeout=10_000)
                page.wait_for_timeout(2000)
                assert page.evaluate(dirty) is False, (
                    f"{nb.name} is marked modified on open: give it the metadata of the others "
                    "(kernelspec 'Python 3 (ipykernel)' and ipykernel's full language_info)")
            except BaseException:
                dump_failure(page, f"dirty-{app}-{nb.stem}")
                raise
