"""The sidebar tells the truth, in JupyterLab and Notebook 7 (headless Debian Chromium).

One notebook forks a small tree, saves two checkpoints and makes a grandchild active;
another notebook in the same folder records a run of its own. Then, from the sidebar at
its default width: the active machine is the kernel's (registry file, ``%smol status``)
after ``use``, a delete of its parent and a restore; Delete asks first, naming the machine,
whether it is active and what goes with it; nothing is clipped; runs say notebook, cell,
kind and time, and show this notebook's by default; deleting a checkpoint takes its badge
and only its badge; a killed kernel is said to have died. Each step checks the screen and
the kernel's state behind it (registry file, ``%smol status``, ledger).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from browserhelpers import (
    ARTIFACTS,
    BROWSER_TEST_MARKS,
    KERNEL_EXEC,
    browser_page,
    dump_failure,
    jupyter_server,
    notebook_url,
    run_all,
    wait_for_kernel,
    write_notebook,
)

from smolbench import registry

pytestmark = BROWSER_TEST_MARKS

DOCS_IMG = Path(__file__).resolve().parent.parent / "docs" / "img"
CKPT = "before-tuning-223457"  # a long name: its restored machine is r1-before-tuning-223457
NOTEBOOK_A = [
    "%load_ext smolbench",
    "%smol up --backend process",
    "%%smol\nx = 1",
    "%%smol fork 2 --keep all\nreward = SEED",
    "%smol use root.0",
    "%%smol fork 2 --keep all\nreward = SEED",
    f"%smol checkpoint save {CKPT} --node root",
    "%smol checkpoint save side --node root.1",
    "%smol use root.0.1",
]
NOTEBOOK_B = [
    "%load_ext smolbench",
    "%smol up --backend process",
    "%%smol fork 2 --keep none\nreward = SEED",
    "%smol down",
]

# elements whose text is wider than their box (clipped), or that stick out of the panel
CLIPPED = """panel => {
  const right = panel.getBoundingClientRect().right + 1;
  const out = [];
  if (panel.scrollWidth > panel.clientWidth + 1) out.push('the panel scrolls sideways');
  for (const e of panel.querySelectorAll('.sb-machines *, .sb-runs .sb-run-label *, .sb-checkpoints .sb-btn')) {
    if (e.closest('svg') || e.classList.contains('sb-name-head') || e.classList.contains('sb-name')) continue;
    if (e.offsetParent === null) continue;
    const r = e.getBoundingClientRect();
    if (e.scrollWidth > e.clientWidth + 1 || r.right > right) out.push(`${e.className}: ${e.textContent}`);
  }
  return out;
}"""


@pytest.fixture(params=["lab", "notebook"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    root = tmp_path / "root"
    root.mkdir()
    write_notebook(root / "a.ipynb", NOTEBOOK_A)
    write_notebook(root / "b.ipynb", NOTEBOOK_B)
    with jupyter_server(root, request.param) as (base, token):
        yield {"app": request.param, "base": base, "token": token, "root": root,
               "registry": root / ".runtime" / registry.DIRNAME}


def _open(page: Any, srv: dict[str, Any], name: str, cells: int) -> None:
    url = notebook_url(srv["base"], srv["token"], srv["app"], name)
    page.goto(url.replace("?", "?reset&") if srv["app"] == "lab" else url)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    run_all(page, cells)
    from playwright.sync_api import expect

    last = page.locator(".jp-Notebook .jp-Cell").nth(cells - 1).locator(".jp-InputPrompt")
    expect(last).to_have_text(re.compile(r"\[\d+\]"), timeout=240_000)
    wait_for_kernel(page)


def _kernel(page: Any, code: str) -> str:
    return str(page.evaluate(KERNEL_EXEC, code))


def _status_active(page: Any) -> str:
    out = _kernel(page, "%smol status")
    m = re.search(r"^active\s+(.+)$", out, re.M)
    assert m, out
    return m.group(1).strip()


def _registry_active(srv: dict[str, Any], want: Any = ...) -> Any:
    """The active machine the kernel's registry file names (``want``: once it names that,
    waiting up to 5 s: the kernel rewrites it right after the change)."""
    deadline = time.monotonic() + 5
    while True:
        recs = [r for _, r in registry.read_records(srv["registry"]) if r["machines"]]
        assert len(recs) == 1, recs
        if want is ... or recs[0]["active"] == want or time.monotonic() > deadline:
            return recs[0]["active"]
        time.sleep(0.05)


def _active_row(panel: Any) -> Any:
    return panel.locator(".sb-machine.sb-active")


def _ledger(srv: dict[str, Any], sql: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(str(srv["root"] / ".smolbench" / "ledger.db"))
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def _badges(page: Any) -> set[str]:
    return set(page.locator(".jp-Notebook .sbt-b-ckpt").all_inner_texts())


def test_the_sidebar_follows_the_kernel(server: dict[str, Any]) -> None:
    from playwright.sync_api import expect

    srv = server
    ARTIFACTS.mkdir(exist_ok=True)
    timings: dict[str, float] = {}
    with browser_page(1400, 1000) as page:
        try:
            _open(page, srv, "b.ipynb", len(NOTEBOOK_B))  # a run of another notebook in the folder
            _open(page, srv, "a.ipynb", len(NOTEBOOK_A))
            if srv["app"] == "notebook":  # no status bar there: View → Show the smolbench sidebar
                page.get_by_role("menuitem", name="View", exact=True).click()
                page.get_by_text("Show the smolbench sidebar", exact=True).click()
            else:
                page.locator(".jp-smolbench-status").click()
            panel = page.locator("#smolbench-panel")
            expect(panel).to_be_visible()

            # item 2: the active machine is the kernel's (after `%smol use root.0.1`)
            expect(panel.locator(".sb-machine")).to_have_count(5, timeout=15_000)
            expect(_active_row(panel)).to_have_attribute("data-id", "root.0.1")
            expect(_active_row(panel).locator(".sb-active-mark")).to_have_text("active")
            assert _registry_active(srv, "root.0.1") == "root.0.1" == _status_active(page)

            # item 4: runs say notebook, cell, kind and time; this notebook's by default
            runs = panel.locator(".sb-run")
            expect(runs).to_have_count(2, timeout=15_000)
            expect(runs.nth(0).locator(".sb-run-cellno")).to_have_text("[6]")
            expect(runs.nth(1).locator(".sb-run-cellno")).to_have_text("[4]")
            for i in range(2):
                expect(runs.nth(i).locator(".sb-kind")).to_have_text("fork ×2")
                expect(runs.nth(i).locator(".sb-when")).to_have_text(re.compile(r"^\d\d:\d\d:\d\d$"))
                expect(runs.nth(i).locator(".sb-cell")).to_have_text("reward = SEED")
            filt = panel.locator(".sb-runs-filter")
            expect(filt.locator("option:checked")).to_have_text("this notebook (a.ipynb) · 2")
            assert [(os.path.relpath(nb, srv["root"]), c) for nb, c in _ledger(srv, "SELECT notebook, cell FROM runs ORDER BY started")] == [
                ("b.ipynb", 3), ("a.ipynb", 4), ("a.ipynb", 6)]
            filt.select_option(label="all notebooks · 3")
            expect(runs).to_have_count(3)
            expect(runs.nth(2).locator(".sb-run-nb")).to_have_text("b.ipynb")
            expect(runs.nth(2).locator(".sb-run-cellno")).to_have_text("[3]")
            filt.select_option(label="this notebook (a.ipynb) · 2")
            expect(runs).to_have_count(2)

            # item 5: Delete asks, naming the machine, that the active one goes, and its branches
            panel.locator(".sb-machine[data-id='root.0'] .sb-delete").click()
            dialog = page.locator(".jp-Dialog")
            expect(dialog).to_contain_text(
                "Delete machine root.0 of a.ipynb and the 2 branches below it (root.0.0, root.0.1)? "
                "The active machine root.0.1 goes with it: root becomes active.")
            dialog.locator("button", has_text="Cancel").click()
            expect(dialog).to_have_count(0)
            page.wait_for_timeout(1500)
            expect(panel.locator(".sb-machine")).to_have_count(5)
            assert _registry_active(srv) == "root.0.1"

            # item 12: deleting the parent of the active machine says the active machine moved
            panel.locator(".sb-machine[data-id='root.0'] .sb-delete").click()
            page.locator(".jp-Dialog button.jp-mod-warn").click()
            t0 = time.monotonic()
            msg = panel.locator(".sb-msg")
            expect(msg).to_contain_text("root.0.1 was active: the active machine is now root", timeout=30_000)
            expect(_active_row(panel)).to_have_attribute("data-id", "root", timeout=5_000)
            timings["delete_to_sidebar_s"] = time.monotonic() - t0
            expect(panel.locator(".sb-machine")).to_have_count(2)
            assert _registry_active(srv, "root") == "root" == _status_active(page)

            # item 2: a restore from the sidebar moves the active machine, and the sidebar follows
            restore = panel.locator(f".sb-checkpoint[data-name='{CKPT}'] .sb-restore")
            restore.click()
            expect(msg).to_contain_text(f"restored {CKPT} as r1-{CKPT} (now active)", timeout=60_000)
            expect(_active_row(panel)).to_have_attribute("data-id", f"r1-{CKPT}", timeout=5_000)
            assert _registry_active(srv, f"r1-{CKPT}") == f"r1-{CKPT}" == _status_active(page)
            # and a `%smol use` typed in the kernel shows within about a second, in words
            page.wait_for_timeout(1600)  # (a note right after an action's own answer waits)
            _kernel(page, "%smol use root")
            t0 = time.monotonic()
            expect(_active_row(panel)).to_have_attribute("data-id", "root", timeout=5_000)
            timings["use_to_sidebar_s"] = time.monotonic() - t0
            expect(msg).to_contain_text(f"a.ipynb: the active machine is now root (was r1-{CKPT})")
            _kernel(page, f"%smol use r1-{CKPT}\n")
            _kernel(page, "%%smol fork 2 --keep all --quiet\nreward = SEED")
            expect(panel.locator(".sb-machine")).to_have_count(5, timeout=15_000)

            # item 3: nothing that matters is clipped at the default width
            width = panel.evaluate("p => p.getBoundingClientRect().width")
            clipped = panel.evaluate(CLIPPED)
            assert not clipped, (width, clipped)
            tails = panel.locator(".sb-machine .sb-name-tail").all_inner_texts()
            assert len(set(tails)) == len(tails), tails  # r1-…-223457 and r1-…-223457.1 differ on screen
            for row in panel.locator(".sb-machine").all():
                mid = row.get_attribute("data-id")
                expect(row.locator(".sb-name")).to_have_attribute("title", str(mid))
                expect(row.locator(".sb-delete")).to_have_attribute("aria-label", f"Delete machine {mid}")
            expect(panel.locator(".sb-group-title")).to_contain_text("a.ipynb")
            expect(panel.locator(".sb-group-title")).to_contain_text("process")
            shot = ARTIFACTS / f"sidebar_default_width_{srv['app']}.png"
            panel.screenshot(path=str(shot))
            if srv["app"] == "lab" and os.environ.get("SMOLBENCH_UPDATE_DOCS_IMG") == "1":
                # only on request: a test run must not change tracked files
                panel.screenshot(path=str(DOCS_IMG / "sidebar.png"))

            # item 12: a checkpoint's badge goes with it, and only its badge
            expect(page.locator(".jp-Notebook .sbt-b-ckpt", has_text="ckpt side").first).to_be_visible()
            panel.locator(".sb-checkpoint[data-name='side'] .sb-delete").click()
            page.locator(".jp-Dialog button.jp-mod-warn").click()
            expect(msg).to_contain_text("removed checkpoint side", timeout=30_000)
            expect(page.locator(".jp-Notebook .sbt-b-ckpt", has_text="ckpt side")).to_have_count(0, timeout=5_000)
            assert f"ckpt {CKPT}" in _badges(page)
            got = _kernel(page, "wb = __import__('smolbench')._magics.workbench\n"
                                "print(wb.tree['root.1'].checkpoint, wb.tree['root'].checkpoint)")
            assert got.split() == ["None", CKPT]
            assert _ledger(srv, "SELECT name FROM checkpoints") == [(CKPT,)]
            panel.locator(f".sb-checkpoint[data-name='{CKPT}'] .sb-delete").click()
            page.locator(".jp-Dialog button.jp-mod-warn").click()
            expect(msg).to_contain_text(f"removed checkpoint {CKPT}", timeout=30_000)
            expect(page.locator(".jp-Notebook .sbt-b-ckpt")).to_have_count(0, timeout=5_000)
            assert _ledger(srv, "SELECT name FROM checkpoints") == []

            # deleting the active machine (a restored one: no parent) says none is active now
            panel.locator(f".sb-machine[data-id='r1-{CKPT}'] .sb-delete").click()
            dialog = page.locator(".jp-Dialog")
            expect(dialog).to_contain_text(
                f"Delete machine r1-{CKPT} of a.ipynb and the 2 branches below it "
                f"(r1-{CKPT}.0, r1-{CKPT}.1)? r1-{CKPT} is the active machine: no machine will be active")
            page.locator(".jp-Dialog button.jp-mod-warn").click()
            expect(msg).to_contain_text(f"r1-{CKPT} was active: no machine is active now", timeout=30_000)
            expect(panel.locator(".sb-machine")).to_have_count(2, timeout=5_000)
            expect(_active_row(panel)).to_have_count(0)
            expect(panel.locator(".sb-group .sb-note")).to_have_text("no machine is active: `%smol use NODE` picks one")
            assert _registry_active(srv, None) is None
            assert _status_active(page).startswith("none")

            # a killed kernel: the sidebar says it died, and its machines went with it
            pid = next(r for _, r in registry.read_records(srv["registry"]) if r["machines"])["pid"]
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            expect(msg).to_contain_text(re.compile(r"a\.ipynb: kernel \w{8} died; its 2 machines died with it"),
                                        timeout=15_000)
            timings["kill_to_sidebar_s"] = time.monotonic() - t0
            expect(panel.locator(".sb-machine")).to_have_count(0)
        except BaseException:
            dump_failure(page, f"sidebar-{srv['app']}")
            raise
        finally:
            (ARTIFACTS / f"sidebar_timings_{srv['app']}.json").write_text(json.dumps(timings, indent=1))
