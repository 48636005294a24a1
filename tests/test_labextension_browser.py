"""The smolbench sidebar in a real JupyterLab (headless Debian Chromium, Playwright).

One JupyterLab, two notebooks: machines appear in the sidebar after ``%smol up`` and a
fork, and go after ``%smol down``; a checkpoint is listed and restored from the sidebar
into a fresh kernel (its variable comes back); a past run's tree opens from the ledger;
a killed kernel's machines leave the list; an orphan (a machine whose kernel is dead) is
shown and killed. Screenshots, light and dark, go to tests/artifacts/.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from browserhelpers import (
    ARTIFACTS,
    BROWSER_TEST_MARKS,
    browser_page,
    finish_run_all,
    jupyter_server,
    write_notebook,
)

from smolbench import registry

pytestmark = BROWSER_TEST_MARKS

NOTEBOOK_A = [
    "%load_ext smolbench",
    "%smol up --backend sandbox",
    "%%smol\nx = 41",
    "%%smol fork 3 --keep all --seed-base 10 --quiet\nreward = SEED + x\n"
    "print('<img src=x onerror=\"document.title=`pwned`\">')",  # machine output: attacker data
    "%smol checkpoint save warm",
]
NOTEBOOK_B = ["%%smol\nprint('x came back:', x)"]


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """JupyterLab (this venv's Python, so kernels import this tree) on a free loopback port."""
    root = tmp_path / "root"
    root.mkdir()
    write_notebook(root / "a.ipynb", NOTEBOOK_A)
    write_notebook(root / "b.ipynb", NOTEBOOK_B)
    (root / "broken" / ".smolbench").mkdir(parents=True)  # a corrupt ledger beside a notebook
    (root / "broken" / ".smolbench" / "ledger.db").write_bytes(b"not a database, just bytes " * 64)
    write_notebook(root / "broken" / "c.ipynb", ["1 + 1"])
    with jupyter_server(root, "lab") as (base, token):
        yield {"base": base, "token": token, "root": root, "runtime": root / ".runtime", "log": root / "lab.log"}


def _wait_for_kernel(page: Any) -> None:
    """Until the visible notebook's kernel is idle; accepts JupyterLab's "Select Kernel" dialog,
    and asks for a kernel when the notebook settled with "No Kernel" (a start-up race)."""
    deadline = time.monotonic() + 90
    nudge = time.monotonic() + 15
    while not page.locator(".jp-NotebookPanel:visible .jp-Notebook-ExecutionIndicator[data-status='idle']").count():
        assert time.monotonic() < deadline, "the notebook's kernel did not start"
        accept = page.locator(".jp-Dialog button.jp-mod-accept")
        if accept.count():
            with contextlib.suppress(Exception):
                accept.first.click(timeout=2_000)
        elif time.monotonic() > nudge:
            nudge = time.monotonic() + 15
            name = page.locator(".jp-NotebookPanel:visible .jp-KernelName")
            if name.count() and "No Kernel" in name.first.inner_text():
                with contextlib.suppress(Exception):
                    name.first.click(timeout=2_000)  # opens the kernel dialog, accepted above
        page.wait_for_timeout(100)
    page.wait_for_timeout(300)


def _run_all(page: Any) -> None:
    from playwright.sync_api import expect

    first = page.locator(".jp-NotebookPanel:visible .jp-Cell").first.locator(".jp-InputPrompt")
    for _ in range(3):
        _wait_for_kernel(page)
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_text("Run All Cells", exact=True).click()
        try:
            expect(first).not_to_have_text(re.compile(r"\[ \]"), timeout=15_000)
        except AssertionError:
            continue
        finish_run_all(page)  # the rest of the notebook too, even after a frontend race
        return
    raise AssertionError("Run All Cells did not start the notebook")


def _wait_idle(page: Any, cells: int, timeout: float = 180) -> None:
    """Until the visible notebook's last of ``cells`` cells has an execution count."""
    last = page.locator(".jp-NotebookPanel:visible .jp-Cell").nth(cells - 1).locator(".jp-InputPrompt")
    from playwright.sync_api import expect

    expect(last).to_have_text(re.compile(r"\[\d+\]"), timeout=timeout * 1000)


def _open(page: Any, lab: dict[str, Any], name: str) -> None:
    """Open ``name`` alone (``reset``: the other notebooks' tabs close; their kernels stay)."""
    page.goto(f"{lab['base']}/lab/tree/{name}?reset&token={lab['token']}")
    page.wait_for_selector(".jp-NotebookPanel:visible .jp-Cell", timeout=60_000)


def _append_and_run(page: Any, source: str) -> Any:
    """Add a cell at the end of the visible notebook, run it, return its output area."""
    nb = page.locator(".jp-NotebookPanel:visible")
    nb.locator(".jp-Cell").last.click()
    page.keyboard.press("Escape")
    page.keyboard.press("b")
    editor = nb.locator(".jp-Cell").last.locator(".cm-content")
    editor.click()
    page.keyboard.insert_text(source)
    page.keyboard.press("Shift+Enter")
    cell = nb.locator(".jp-Cell").nth(nb.locator(".jp-Cell").count() - 2)
    from playwright.sync_api import expect

    expect(cell.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]"), timeout=120_000)
    return cell.locator(".jp-OutputArea")


def _machine_ids(page: Any) -> list[str]:
    return list(page.locator("#smolbench-panel .sb-machine").evaluate_all("rows => rows.map(r => r.dataset.id)"))


def _theme(page: Any, name: str) -> None:
    page.get_by_role("menuitem", name="Settings", exact=True).click()
    page.get_by_text("Theme", exact=True).click()
    page.get_by_text(name, exact=True).click()
    page.wait_for_function(
        f"document.body.dataset.jpThemeName === {json.dumps(name)}", timeout=30_000)
    page.wait_for_timeout(500)


def test_sidebar_machines_checkpoints_runs_and_orphans(lab: dict[str, Any]) -> None:
    from playwright.sync_api import expect

    ARTIFACTS.mkdir(exist_ok=True)
    timings: dict[str, float] = {}
    with browser_page(1500, 1000) as page:
        console_errors: list[str] = []
        page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
        try:
            _open(page, lab, "a.ipynb")
            status = page.locator(".jp-smolbench-status")
            expect(status).to_have_text("smol: idle · 0 machines", timeout=30_000)
            status.click()  # the status-bar item opens the sidebar
            panel = page.locator("#smolbench-panel")
            expect(panel).to_be_visible()
            expect(panel.locator(".sb-machines .sb-empty")).to_contain_text("No machines")
            expect(panel.locator(".sb-runs .sb-empty")).to_contain_text("no ledger in the root folder yet")

            # %smol up, a fork (kept), a checkpoint: the machines appear
            _run_all(page)
            _wait_idle(page, len(NOTEBOOK_A))
            t0 = time.monotonic()
            expect(panel.locator(".sb-machine")).to_have_count(4, timeout=10_000)
            timings["fork_to_sidebar_s"] = time.monotonic() - t0
            assert sorted(_machine_ids(page)) == ["root", "root.0", "root.1", "root.2"]
            group = panel.locator(".sb-group").first
            expect(group.locator(".sb-group-title")).to_contain_text("a.ipynb")
            expect(group.locator(".sb-group-title")).to_contain_text("sandbox")
            expect(panel.locator(".sb-machine.sb-active")).to_have_attribute("data-id", "root")
            expect(panel.locator(".sb-machine[data-id='root'] .sb-mem")).to_have_text(re.compile(r"^\d+ MiB/1 GiB$"))
            expect(status).to_have_text("smol: sandbox · 4 machines")

            # the checkpoint and the run are listed
            ck = panel.locator(".sb-checkpoint[data-name='warm']")
            expect(ck).to_be_visible(timeout=10_000)
            expect(ck.locator(".sb-node")).to_have_text("root")
            expect(ck.locator(".sb-backend")).to_have_text("sandbox")
            run = panel.locator(".sb-run").first
            expect(run.locator(".sb-cell")).to_have_text("reward = SEED + x")
            expect(run.locator(".sb-kind")).to_have_text("fork ×3")
            expect(run.locator(".sb-run-cellno")).to_have_text("[4]")
            expect(run.locator(".sb-best")).to_have_text("53")  # seed 12 + 41
            expect(run.locator(".sb-spark polyline")).to_have_count(1)
            panel.screenshot(path=str(ARTIFACTS / "labext_sidebar_light.png"))

            # Delete from the sidebar asks first, then asks the owning kernel
            panel.locator(".sb-machine[data-id='root.1'] .sb-delete").click()
            expect(page.locator(".jp-Dialog")).to_contain_text("Delete machine root.1 of a.ipynb?")
            page.locator(".jp-Dialog button.jp-mod-warn").click()
            expect(panel.locator(".sb-msg")).to_contain_text("deleted root.1", timeout=30_000)
            expect(panel.locator(".sb-machine")).to_have_count(3, timeout=10_000)

            # a past run's tree, read-only, from the ledger
            run.click()
            tree = page.locator(".jp-smolbench-tree")
            expect(tree).to_be_visible(timeout=10_000)
            expect(tree.locator(".sb-tree-row")).to_have_count(4)
            expect(tree.locator(".sb-tree-row[data-id='root.2'] .sb-reward")).to_have_text("53")
            expect(tree.locator(".sb-tree-row.sb-best")).to_have_count(2)  # root and root.2
            tree.locator(".sb-tree-row[data-id='root.0']").click()
            expect(tree.locator(".sb-tree-detail")).to_contain_text("root.0 · ok · reward 51 · seed 10")
            # a machine's output is shown as text, never as markup
            expect(tree.locator(".sb-tree-output")).to_contain_text('<img src=x onerror="document.title=`pwned`">')
            assert tree.locator("img").count() == 0 and page.title() != "pwned"
            page.screenshot(path=str(ARTIFACTS / "labext_run_tree_light.png"))
            page.locator(".lm-TabBar-tab.lm-mod-current .lm-TabBar-tabCloseIcon").last.click()

            # %smol down in the notebook: they go
            page.locator(".jp-NotebookPanel:visible .jp-Cell").first.click()
            out = _append_and_run(page, "%smol down")
            t0 = time.monotonic()
            expect(out).to_contain_text("deleted 3 machines")
            expect(panel.locator(".sb-machine")).to_have_count(0, timeout=10_000)
            timings["down_to_sidebar_s"] = time.monotonic() - t0
            expect(status).to_have_text("smol: idle · 0 machines")

            # restore the checkpoint from the sidebar into a fresh kernel (notebook b)
            _open(page, lab, "b.ipynb")
            _wait_for_kernel(page)
            panel = page.locator("#smolbench-panel")
            if not panel.is_visible():
                page.locator(".jp-smolbench-status").click()
            restore = panel.locator(".sb-checkpoint[data-name='warm'] .sb-restore")
            expect(restore).to_be_enabled(timeout=10_000)
            restore.click()
            expect(panel.locator(".sb-msg")).to_contain_text("restored warm as r1-warm (now active)", timeout=60_000)
            expect(panel.locator(".sb-machine")).to_have_count(2, timeout=10_000)  # root and r1-warm
            expect(panel.locator(".sb-group-title").first).to_contain_text("b.ipynb")
            page.locator(".jp-NotebookPanel:visible .jp-Cell").first.click()
            page.keyboard.press("Shift+Enter")
            expect(page.locator(".jp-NotebookPanel:visible .jp-OutputArea-output").first).to_have_text(
                "x came back: 41", timeout=60_000)

            # Replay inserts a cell into the active notebook (a.ipynb's run: b has none)
            expect(panel.locator(".sb-runs .sb-empty")).to_contain_text("No runs of this notebook yet")
            panel.locator(".sb-runs-filter").select_option(label="a.ipynb · 1")
            expect(panel.locator(".sb-run .sb-run-nb")).to_have_text("a.ipynb")
            panel.locator(".sb-run").first.locator(".sb-replay").click()
            expect(page.locator(".jp-NotebookPanel:visible .jp-Cell .cm-content", has_text="%smol replay root.2")).to_have_count(1)

            # dark theme
            _theme(page, "JupyterLab Dark")
            panel.screenshot(path=str(ARTIFACTS / "labext_sidebar_dark.png"))
            page.screenshot(path=str(ARTIFACTS / "labext_lab_dark.png"))

            # kill -9 notebook b's kernel: its machines die with it (pdeathsig) and leave the list
            recs = list(registry.read_records(lab["runtime"] / registry.DIRNAME))
            assert len(recs) == 1, recs
            kernel_pid = recs[0][1]["pid"]
            machine_pids = {m["pid"] for m in recs[0][1]["machines"]}
            os.kill(kernel_pid, signal.SIGKILL)
            expect(panel.locator(".sb-machine")).to_have_count(0, timeout=15_000)
            expect(panel.locator(".sb-msg")).to_contain_text(
                re.compile(r"b\.ipynb: kernel \w{8} died; its 2 machines died with it"))
            died = page.locator(".jp-Dialog", has_text="appears to have died")
            died.wait_for(timeout=30_000)  # JupyterLab says so, and restarts the kernel
            died.locator("button").last.click()
            assert not [pid for pid in machine_pids if registry.proc_start(pid)]

            # an orphan: a machine whose host process outlived its dead kernel (as a microVM
            # run by its own engine can). A real process stands in for it, marked as a machine is.
            dead = subprocess.Popen([sys.executable, "-c", "pass"])  # its kernel
            dead_start = registry.proc_start(dead.pid)
            dead.wait()
            orphan = subprocess.Popen(["sleep", "300"], start_new_session=True, env={
                **os.environ, "SMOLBENCH_MACHINE": "root", "SMOLBENCH_KERNEL": f"{dead.pid}.{dead_start}"})
            try:
                registry.write_atomic(lab["runtime"] / registry.DIRNAME / "kernel-0rphan.json", {
                    "format": 1, "kernel_id": "0rphan", "pid": dead.pid, "pid_start": dead_start,
                    "cwd": str(lab["root"]), "backend": "process", "session": "s", "active": "root",
                    "machines": [{"id": "root", "backend": "process", "created": time.time() - 60,
                                  "memory_mib": 512, "pid": orphan.pid,
                                  "pid_start": registry.proc_start(orphan.pid)}]})
                row = panel.locator(".sb-orphaned .sb-machine[data-id='root']")
                expect(row).to_be_visible(timeout=10_000)
                expect(row.locator(".sb-status")).to_have_text("orphaned")
                expect(panel.locator(".sb-orphaned .sb-group-title")).to_contain_text("kernel 0rphan is dead")
                expect(page.locator(".jp-smolbench-status")).to_contain_text("1 orphaned")
                panel.screenshot(path=str(ARTIFACTS / "labext_orphan_dark.png"))
                _theme(page, "JupyterLab Light")
                panel.screenshot(path=str(ARTIFACTS / "labext_orphan_light.png"))
                row.locator(".sb-kill").click()
                expect(panel.locator(".sb-msg")).to_contain_text("killed orphaned root (host process", timeout=15_000)
                assert orphan.wait(10) == -signal.SIGKILL
                expect(panel.locator(".sb-orphaned")).to_have_count(0, timeout=10_000)
            finally:
                orphan.kill()
                orphan.wait()

            # a registry file over the cap (anyone who can write the folder can make one): not
            # read, and said in one line above the machines, not a blank or a hung list
            huge = lab["runtime"] / registry.DIRNAME / "kernel-huge.json"
            huge.write_bytes(b" " * (registry.MAX_RECORD_BYTES + 1))
            try:
                expect(panel.locator(".sb-machines .sb-problem")).to_have_text(
                    f"machine registry: kernel-huge.json: over {registry.MAX_RECORD_BYTES >> 20} MiB, not read",
                    timeout=15_000)
            finally:
                huge.unlink()
            expect(panel.locator(".sb-machines .sb-problem")).to_have_count(0, timeout=15_000)

            # a corrupt ledger: one line in the panel, nothing blank
            _open(page, lab, "broken/c.ipynb")
            panel = page.locator("#smolbench-panel")
            if not panel.is_visible():
                page.locator(".jp-smolbench-status").click()
            expect(panel.locator(".sb-runs .sb-section-title")).to_have_text("Runs in broken/", timeout=15_000)
            problem = panel.locator(".sb-runs .sb-problem")
            expect(problem).to_have_text("broken/.smolbench/ledger.db is not a readable smolbench ledger (file is not "
                                         "a database): move it aside; `%smol up` starts a new one (HTTP 422)")
            assert "\n" not in problem.inner_text()
            expect(panel.locator(".sb-checkpoints .sb-problem")).to_contain_text("broken:")
            # warm lives in the root folder's ledger: this notebook's kernel couldn't find it by name
            restore = panel.locator(".sb-checkpoint[data-name='warm'] .sb-restore")
            expect(restore).to_be_disabled()
            expect(restore).to_have_attribute("title", re.compile("open a notebook there to restore it"))
            panel.screenshot(path=str(ARTIFACTS / "labext_corrupt_ledger_light.png"))

            # Delete a checkpoint: it asks first; Cancel keeps it, Delete removes it and its file
            ck_file = lab["root"] / ".smolbench" / "checkpoints" / "warm.smolcheckpoint"
            assert ck_file.exists()
            panel.locator(".sb-checkpoint[data-name='warm'] .sb-delete").click()
            dialog = page.locator(".jp-Dialog")
            expect(dialog).to_contain_text('Delete checkpoint "warm"')
            dialog.locator("button", has_text="Cancel").click()
            expect(panel.locator(".sb-checkpoint[data-name='warm']")).to_be_visible()
            panel.locator(".sb-checkpoint[data-name='warm'] .sb-delete").click()
            page.locator(".jp-Dialog button.jp-mod-warn").click()
            expect(panel.locator(".sb-msg")).to_have_text("deleted checkpoint warm and its file")
            expect(panel.locator(".sb-checkpoint[data-name='warm']")).to_have_count(0)
            assert not ck_file.exists()
            bad = [e for e in console_errors if "smolbench" in e.lower()]
            assert not bad, bad
        except BaseException:
            with contextlib.suppress(Exception):
                page.screenshot(path=str(ARTIFACTS / "labext_failure.png"))
                print(lab["log"].read_text()[-3000:])
            raise
        finally:
            (ARTIFACTS / "labext_timings.json").write_text(json.dumps(timings, indent=1))
