"""The fork-tree widget in a real browser: JupyterLab + headless Chromium (Playwright).

Runs a notebook with a 64-branch fork nested four deep, checks the widget renders every
node with its reward, clicks a node and **Use** while a cell is still running (the click
reaches the kernel through a subshell), and saves a screenshot to tests/artifacts/.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).parent / "artifacts"
TAG_VAR = "SMOLBENCH_BROWSER_TAG"

pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason=f"no Chromium at {CHROMIUM} (apt-get install chromium)"
)

CELLS = [
    "%load_ext smolbench",
    "%smol up --backend sandbox",
    "%%smol\nx = 41",
    "%%smol fork 64 --seed-base 100 --out wide\nimport smolbench_guest\n"
    "reward = (SEED * 37) % 101 + x\n"
    "smolbench_guest.report(steps=SEED % 9)",
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
    # Blocks until the widget's Use click arrives: it can only finish if the click is
    # handled while this cell is still running.
    "import time, smolbench\nwb = smolbench._magics.workbench\nwant = wb.tree.best_path()[1]\n"
    "deadline = time.monotonic() + 120\n"
    "while wb.active != want and time.monotonic() < deadline:\n    time.sleep(0.05)\n"
    "print('active while this cell ran:', wb.active, 'wanted:', want)",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tagged(tag: str) -> list[str]:
    """Every live process (server, kernels, machines) whose environment carries ``tag``."""
    needle = f"{TAG_VAR}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in env and stat[stat.rfind(b")") + 2 :][:1] != b"Z":
            found.append(f"{entry} {cmd[:120]}")
    return found


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A JupyterLab server on a free loopback port, in ``tmp_path``; stopped with its kernels."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }
    nbformat.write(nb, tmp_path / "tree.ipynb")
    settings = (
        tmp_path / ".jupyter" / "lab" / "user-settings" / "@jupyterlab" / "apputils-extension"
    )
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(
        '{"fetchNews": "false", "checkForUpdates": false}'
    )
    tracker = tmp_path / ".jupyter" / "lab" / "user-settings" / "@jupyterlab" / "notebook-extension"
    tracker.mkdir(parents=True)  # start the notebook's kernel without a "Select Kernel" dialog
    (tracker / "tracker.jupyterlab-settings").write_text('{"autoStartDefaultKernel": true}')
    port, token, tag = _free_port(), secrets.token_hex(16), uuid.uuid4().hex
    env = {
        **os.environ,
        TAG_VAR: tag,
        "JUPYTER_CONFIG_DIR": str(tmp_path / ".jupyter"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / ".runtime"),
    }
    argv = [
        sys.executable,
        "-m",
        "jupyter",
        "lab",
        "--no-browser",
        f"--port={port}",
        f"--ServerApp.token={token}",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.root_dir={tmp_path}",
        "--ServerApp.open_browser=False",
    ]
    if os.geteuid() == 0:
        argv.append("--allow-root")
    log = open(tmp_path / "lab.log", "wb")
    proc = subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "lab.log").read_text()[-2000:]
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "JupyterLab did not start"
                time.sleep(0.1)
        yield f"{base}/lab/tree/tree.ipynb?token={token}", tmp_path
    finally:
        proc.send_signal(
            signal.SIGTERM
        )  # the server shuts its kernels down, which delete their machines
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
        deadline = time.monotonic() + 20
        while _tagged(tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _tagged(tag)
        for line in left:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        assert not left, f"processes left behind: {left}"


LAST_TREE = "[...document.querySelectorAll('.sbt')].pop()"


def test_tree_widget_renders_and_use_works_from_the_browser(lab: tuple[str, Path]) -> None:
    from playwright.sync_api import expect, sync_playwright

    url, _ = lab
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        try:
            page.goto(url)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            _run_all(page)

            # 1 root + 64 + 8 + 4 + 2 nodes, four levels deep, all in the last fork's view
            tree = page.locator(".sbt").last
            expect(tree.locator(".sbt-summary")).to_contain_text(
                "79 nodes · 1 idle · 78 ok", timeout=120_000
            )
            # the 64-branch fan shows its top 8 (best path first) and a row for the other 56
            expect(tree.locator(".sbt-row")).to_have_count(1 + 8 + 8 + 4 + 2)
            more = tree.locator(".sbt-more")
            expect(more).to_have_text("… 56 more branches of root: show all")
            more.click()
            expect(tree.locator(".sbt-row")).to_have_count(79)
            expect(tree.locator(".sbt-row[data-id^='root.'][data-status='ok']")).to_have_count(78)
            depth = tree.locator(".sbt-row").evaluate_all(
                "rows => Math.max(...rows.map(r => r.dataset.id.split('.').length - 1))"
            )
            assert depth == 4
            best = tree.locator(".sbt-row.sbt-bestnode")
            expect(best.locator(".sbt-reward")).to_have_text("401")  # root.*.*.*.1: 400 + seed 1
            best_path = tree.locator(".sbt-row.sbt-best")
            expect(best_path).to_have_count(5)  # root and its four descendants

            # the last cell is now running; Use on the best depth-1 node while it runs
            want = best.get_attribute("data-id")
            assert want is not None
            first = ".".join(want.split(".")[:2])
            row = tree.locator(f".sbt-row[data-id='{first}']")
            row.scroll_into_view_if_needed()
            row.click()
            use = tree.locator("button.sbt-btn-use")
            expect(use).to_be_enabled()
            use.click()
            page.wait_for_function(
                f"{LAST_TREE}.querySelector('.sbt-row.sbt-active')?.dataset.id === '{first}'",
                timeout=30_000,
            )
            out = page.locator(".jp-OutputArea-output", has_text="active while this cell ran")
            out.wait_for(timeout=60_000)
            expect(out).to_have_text(f"active while this cell ran: {first} wanted: {first}")
            expect(tree.locator(".sbt-msg")).to_have_text(f"{first} is now the active machine")

            # a deleted node's buttons are disabled, with the reason as the tooltip
            tree.locator(".sbt-row[data-id='root.0']").click()
            expect(tree.locator("button.sbt-btn-use")).to_be_disabled()
            expect(tree.locator(".sbt-btnwrap").first).to_have_attribute(
                "title", re.compile("root.0 was deleted")
            )

            tree.locator(f".sbt-row[data-id='{first}']").click()
            tree.locator(".sbt-more", has_text="show only the top 8").click()
            tree.locator(".sbt-list").evaluate("el => { el.scrollTop = 0; }")
            tree.scroll_into_view_if_needed()
            tree.screenshot(path=str(ARTIFACTS / "tree_widget.png"))
            page.screenshot(path=str(ARTIFACTS / "tree_notebook.png"))

            panel = page.locator(".sbc").last
            expect(panel.locator(".sbc-row[data-name='warm'] td").nth(1)).to_have_text(
                "root.31.5.3"
            )
            panel.scroll_into_view_if_needed()
            panel.screenshot(path=str(ARTIFACTS / "checkpoint_panel.png"))
            plots = page.locator(".js-plotly-plot")
            expect(plots).to_have_count(2)
            for i, name in enumerate(("tree_plot", "reward_plot")):
                plot = plots.nth(i)
                plot.scroll_into_view_if_needed()
                expect(plot.locator(".scatterlayer .trace").first).to_be_visible(timeout=60_000)
                plot.screenshot(path=str(ARTIFACTS / f"{name}.png"))
        except BaseException:
            with contextlib.suppress(Exception):
                page.screenshot(path=str(ARTIFACTS / "failure.png"))
                errors = page.locator(
                    ".jp-OutputArea-output[data-mime-type*='stderr']"
                ).all_inner_texts()
                print("stderr outputs in the notebook:", *errors, sep="\n")
            raise
        finally:
            browser.close()


def _run_all(page: Any) -> None:
    """Run → Run All Cells, once the kernel is ready (again if a click landed too early)."""
    from playwright.sync_api import expect

    first = page.locator(".jp-Notebook .jp-Cell").first.locator(".jp-InputPrompt")
    for _ in range(3):
        _wait_for_kernel(page)
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_text("Run All Cells", exact=True).click()
        try:
            expect(first).not_to_have_text(re.compile(r"\[ \]"), timeout=15_000)
            return
        except AssertionError:
            continue  # nothing ran (the session was still settling): nothing runs twice
    raise AssertionError("Run All Cells did not start the notebook")


def _wait_for_kernel(page: Any) -> None:
    """Until the notebook's kernel is idle, accepting JupyterLab's "Select Kernel" dialog if
    it asks (whether it does depends on timing)."""
    deadline = time.monotonic() + 90
    while not page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").count():
        assert time.monotonic() < deadline, "the notebook's kernel did not start"
        accept = page.locator(".jp-Dialog button.jp-mod-accept")
        if accept.count():
            with contextlib.suppress(Exception):
                accept.first.click(timeout=2_000)
        page.wait_for_timeout(100)
    page.wait_for_timeout(300)
    if page.locator(".jp-Dialog button.jp-mod-accept").count():
        page.locator(".jp-Dialog button.jp-mod-accept").first.click()
