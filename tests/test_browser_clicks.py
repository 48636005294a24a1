"""Widget clicks in real frontends: JupyterLab and Notebook 7, in Debian's Chromium.

Use, Fork ×N, Checkpoint and Delete are clicked while a cell runs and again while the kernel
is idle, and every effect is checked in the kernel (a cell prints its state) and on disk (the
ledger and the checkpoint files). With comms over subshells (the default in both frontends
with ipykernel 7) clicks apply while the cell runs; with subshells off (like classic Notebook
and VS Code) they queue, the widget says so, and they apply when the cell ends. The queued
case runs in JupyterLab: Notebook 7.6 kept using subshells with the same setting.
"""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
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

pytestmark = BROWSER_TEST_MARKS

CELLS = [
    "%load_ext smolbench",
    "%smol up --backend sandbox",
    "%%smol fork 4 --seed-base 100 --keep all\nprint('seed', SEED)\nreward = SEED",
    # the "a cell is running" phase: blocks until the test creates ./go (no time limit: this
    # VM's clocks jump; the server's shutdown ends it if the test fails)
    "import os, time\nwhile not os.path.exists('go'):\n    time.sleep(0.05)\nprint('waited')",
    "import smolbench\nwb = smolbench._magics.workbench\n"
    "print('STATE', wb.active, ','.join(sorted(n.id for n in wb.tree if n.alive)))",
]


def ledger(root: Path) -> dict[str, Any]:
    """What is on disk now: live node ids, node seeds, checkpoint names whose files exist."""
    db = sqlite3.connect(f"file:{root / '.smolbench' / 'ledger.db'}?mode=ro", uri=True)
    try:
        nodes = db.execute("SELECT id, seed, alive FROM nodes").fetchall()
        ckpts = db.execute("SELECT name, node_id, path FROM checkpoints").fetchall()
    finally:
        db.close()
    return {
        "alive": {i for i, _, a in nodes if a},
        "seeds": {i: s for i, s, _ in nodes},
        "checkpoints": {n: node for n, node, p in ckpts if (root / ".smolbench" / p).is_file()},  # rows are relative to the ledger's folder
    }


def until(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def click(tree: Any, node: str, action: str, **fields: str) -> None:
    tree.locator(f".sbt-row[data-id='{node}']").click()
    for name, value in fields.items():
        tree.locator(f"input.sbt-{name}").fill(value)
    button = tree.locator(f"button.sbt-btn-{action}")
    button.click()
    if action == "delete":  # asks first
        from playwright.sync_api import expect

        expect(tree.locator(".sbt-msg")).to_contain_text(f"delete {node}")
        expect(button).to_have_text("Confirm delete")
        button.click()


CASES = {
    "lab": ("lab", True),
    "notebook7": ("notebook", True),
    "lab-no-subshells": ("lab", False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_widget_clicks_complete_while_a_cell_runs_and_when_idle(case: str, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    app, subshells = CASES[case]
    write_notebook(tmp_path / "clicks.ipynb", CELLS)
    with jupyter_server(tmp_path, app, subshells=subshells, dark=app == "notebook") as (base, token):
        with browser_page(1300, 1000) as page:
            try:
                page.goto(notebook_url(base, token, app, "clicks.ipynb"))
                page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
                run_all(page, len(CELLS))
                tree = page.locator(".sbt").first
                expect(tree.locator(".sbt-row[data-status='ok']")).to_have_count(4, timeout=120_000)
                expect(tree.locator(".sbt-title")).to_have_text("fork of 4 from root")
                until(lambda: kernel_status(page) == "busy", "the blocking cell to run")

                # -- while a cell runs ----------------------------------------------------
                msg = tree.locator(".sbt-msg")
                steps: list[tuple[str, str, dict[str, str], str]] = [
                    ("root.1", "use", {}, "root.1 is now the active machine"),
                    ("root.2", "checkpoint", {}, "saved checkpoint root.2-"),
                    ("root.3", "fork", {"n": "2", "seed-base": ""}, "fork of 2 · 2 ok"),
                    ("root.0", "delete", {}, "deleted root.0"),
                ]
                for node, action, fields, done in steps:
                    click(tree, node, action, **fields)
                    if subshells:  # answered on a subshell while the cell keeps running
                        expect(msg).to_contain_text(done, timeout=60_000)
                    else:
                        expect(msg).to_contain_text("queued: the kernel is running a cell")
                on_disk = ledger(tmp_path)
                if subshells:
                    assert on_disk["alive"] == {"root", "root.1", "root.2", "root.3", "root.3.0", "root.3.1"}
                    assert list(on_disk["checkpoints"].values()) == ["root.2"]
                    # automatic seeds never repeat in a session: after the highest so far (103)
                    assert (on_disk["seeds"]["root.3.0"], on_disk["seeds"]["root.3.1"]) == (104, 105)
                    # the status bar still says busy: clicks did not flip the kernel's status
                    assert kernel_status(page) == "busy"
                else:  # nothing applied yet: the clicks wait in the kernel's queue
                    assert on_disk["alive"] == {"root", "root.0", "root.1", "root.2", "root.3"}
                    assert on_disk["checkpoints"] == {}
                (tmp_path / "go").touch()
                # ... and applied once the cell has finished (the fork's reply may come last)
                def applied() -> bool:
                    now = ledger(tmp_path)
                    return bool(now["checkpoints"]) and "root.3.1" in now["alive"] and "root.0" not in now["alive"]

                until(applied, "the queued clicks")
                on_disk = ledger(tmp_path)
                assert on_disk["alive"] == {"root", "root.1", "root.2", "root.3", "root.3.0", "root.3.1"}
                assert list(on_disk["checkpoints"].values()) == ["root.2"]
                expect(tree.locator(".sbt-row.sbt-active")).to_have_attribute("data-id", "root.1")
                until(lambda: kernel_status(page) == "idle", "the kernel to go idle")

                # -- while the kernel is idle ----------------------------------------------
                for node, action, fields, done in [
                    ("root.2", "use", {}, "root.2 is now the active machine"),
                    ("root.1", "fork", {"n": "2", "seed-base": "500"}, "fork of 2 · 2 ok"),
                    ("root.3.0", "checkpoint", {}, "saved checkpoint root.3.0-"),
                    ("root.2", "delete", {}, "deleted root.2"),
                ]:
                    click(tree, node, action, **fields)
                    expect(msg).to_contain_text(done, timeout=60_000)
                on_disk = ledger(tmp_path)
                assert (on_disk["seeds"]["root.1.0"], on_disk["seeds"]["root.1.1"]) == (500, 501)
                assert sorted(on_disk["checkpoints"].values()) == ["root.2", "root.3.0"]
                assert "root.2" not in on_disk["alive"]
                # the kernel agrees: re-run the state cell
                state = page.locator(".jp-Notebook .jp-Cell").nth(4)
                state.locator(".jp-InputArea-editor").click()
                page.keyboard.press("Control+Enter")
                expect(state.locator(".jp-OutputArea-output")).to_have_text(
                    re.compile(r"STATE root root,root\.1,root\.1\.0,root\.1\.1,root\.3,root\.3\.0,root\.3\.1"),
                    timeout=60_000,
                )
                # Fork ×N's output is in the widget's log
                log = tree.locator(".sbt-log")
                log.locator("summary").click()
                expect(log.locator(".sbt-log-text")).to_contain_text("[root.1.0] seed 500")
                tree.scroll_into_view_if_needed()
                ARTIFACTS.mkdir(exist_ok=True)
                tree.screenshot(path=str(ARTIFACTS / f"clicks-{case}.png"))
            except BaseException:
                dump_failure(page, f"clicks-{case}")
                raise
