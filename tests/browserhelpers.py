"""A real Jupyter server (JupyterLab or Notebook 7) and headless Debian Chromium for the
browser tests. Everything lives in the test's tmp_path; the server and every process it
started (kernels, machines) are gone when ``jupyter_server`` exits."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
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

from smolbench.backends import _procs

CHROMIUM = "/usr/bin/chromium"
BUILT = Path(__file__).resolve().parent.parent / "smolbench" / "labextension"  # this tree's committed build
ARTIFACTS = Path(__file__).parent / "artifacts"
# Every browser test module: skipped without Debian's chromium; a real server and browser
# on 2 shared cores get a generous limit.
BROWSER_TEST_MARKS = [
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"no Chromium at {CHROMIUM} (apt-get install chromium)"),
    pytest.mark.timeout(600),
]
TAG_VAR = "SMOLBENCH_BROWSER_TAG"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tagged(tag: str) -> list[str]:
    """Every live process (server, kernels, machines) whose environment carries ``tag``."""
    found = []
    for pid, _ in _procs.with_env(TAG_VAR, tag):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found.append(f"{pid} {cmd[:120]}")
    return found


def write_notebook(path: Path, cells: list[str]) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }
    nbformat.write(nb, path)


def _settings(config: Path, plugin: str, values: dict[str, Any]) -> None:
    pkg, name = plugin.split(":")
    d = config / "lab" / "user-settings" / pkg
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.jupyterlab-settings").write_text(json.dumps(values))


@contextlib.contextmanager
def jupyter_server(
    root: Path, app: str = "lab", *, dark: bool = False, subshells: bool = True
) -> Iterator[tuple[str, str]]:
    """JupyterLab (``app="lab"``) or Notebook 7 (``"notebook"``) serving ``root`` on a free
    loopback port; yields (base URL, token). Its own config and data dirs: a fresh server
    that trusts no notebook and remembers nothing."""
    config = root / ".jupyter"
    _settings(config, "@jupyterlab/apputils-extension:notification",
              {"fetchNews": "false", "checkForUpdates": False})
    _settings(config, "@jupyterlab/notebook-extension:tracker", {"autoStartDefaultKernel": True})
    _settings(config, "@jupyterlab/apputils-extension:themes",
              {"theme": "JupyterLab Dark" if dark else "JupyterLab Light"})
    if not subshells:  # a frontend that sends widget messages on the main shell only
        _settings(config, "@jupyterlab/apputils-extension:kernels-settings",
                  {"commsOverSubshells": "disabled"})
    # Kernels run this interpreter (the one running the tests, so they import this tree), not
    # whichever python3 kernelspec the machine has installed elsewhere.
    spec = root / ".jupyter-data" / "kernels" / "python3"
    spec.mkdir(parents=True, exist_ok=True)
    from ipykernel.kernelspec import get_kernel_dict

    kernel = get_kernel_dict()  # ipykernel's own spec (its protocol version: subshells need 5.5)
    kernel["argv"][0] = sys.executable
    (spec / "kernel.json").write_text(json.dumps(kernel))
    # The sidebar as this tree builds it, not the copy `pip install -e` put in the venv (a
    # worktree's or a rebuilt extension would be tested on the installed one): JUPYTER_PATH
    # comes first, and JupyterLab loads the first extension of a name it finds.
    ours = root / ".jupyter-tree"
    shutil.copytree(BUILT, ours / "labextensions" / "smolbench", dirs_exist_ok=True)  # (a second server in one test)
    port, token, tag = free_port(), secrets.token_hex(16), uuid.uuid4().hex
    env = {
        **os.environ,
        TAG_VAR: tag,
        "JUPYTER_CONFIG_DIR": str(config),
        "JUPYTER_DATA_DIR": str(root / ".jupyter-data"),
        "JUPYTER_RUNTIME_DIR": str(root / ".runtime"),
        # In a venv made with --system-site-packages, frontend extensions (plotly's renderer,
        # anywidget) live under the base interpreter's prefix: make them visible.
        "JUPYTER_PATH": os.pathsep.join(
            p for p in (str(ours), os.environ.get("JUPYTER_PATH"), os.path.join(sys.base_prefix, "share", "jupyter"))
            if p
        ),
    }
    # `python -m jupyter lab` would exec whichever `jupyter-lab` script is first on PATH (and
    # its kernels that script's python): run the app's module with this interpreter instead
    module = "jupyterlab" if app == "lab" else "notebook"
    argv = [
        sys.executable, "-m", module, "--no-browser", f"--port={port}",
        f"--ServerApp.token={token}", "--ServerApp.ip=127.0.0.1", f"--ServerApp.root_dir={root}",
        "--ServerApp.open_browser=False", "--expose-app-in-browser",
        # what the installed etc/jupyter/jupyter_server_config.d/smolbench.json enables
        "--ServerApp.jpserver_extensions=smolbench.server=True",
    ]
    if os.geteuid() == 0:
        argv.append("--allow-root")
    log_path = root / f"{app}.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        argv, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for_url(f"{base}/api/status?token={token}", proc, log_path, f"{app} did not start")
        yield base, token
    finally:
        proc.send_signal(signal.SIGTERM)  # the server shuts its kernels down (and their machines)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
        deadline = time.monotonic() + 20
        while tagged(tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = tagged(tag)
        for line in left:
            with contextlib.suppress(OSError):
                os.kill(int(line.split()[0]), signal.SIGKILL)
        assert not left, f"processes left behind: {left}"


def wait_for_url(url: str, proc: subprocess.Popen[bytes], log_path: Path, what: str, timeout: float = 90) -> None:
    """Until ``url`` answers; fails with the tail of ``log_path`` if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log_path.read_text()[-2000:]
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            assert time.monotonic() < deadline, what
            time.sleep(0.1)


def notebook_url(base: str, token: str, app: str, name: str) -> str:
    path = f"notebooks/{name}" if app == "notebook" else f"lab/tree/{name}"
    return f"{base}/{path}?token={token}"


@contextlib.contextmanager
def browser_page(width: int = 1400, height: int = 1100) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.set_default_timeout(30_000)
            yield page
        finally:
            browser.close()


def wait_for_kernel(page: Any) -> None:
    """Until the notebook's kernel is idle, accepting a "Select Kernel" dialog if one asks."""
    deadline = time.monotonic() + 90
    idle = ".jp-Notebook-ExecutionIndicator[data-status='idle'], .jp-NotebookKernelStatus-idle"
    while not _kernel_idle(page, idle):
        assert time.monotonic() < deadline, "the notebook's kernel did not start"
        accept = page.locator(".jp-Dialog button.jp-mod-accept")
        if accept.count():
            with contextlib.suppress(Exception):
                accept.first.click(timeout=2_000)
        page.wait_for_timeout(100)
    page.wait_for_timeout(300)
    if page.locator(".jp-Dialog button.jp-mod-accept").count():
        page.locator(".jp-Dialog button.jp-mod-accept").first.click()


def _kernel_idle(page: Any, selector: str) -> bool:
    if page.locator(selector).count():
        return True
    status = page.evaluate(
        "() => { const a = window.jupyterapp; const w = a && a.shell.currentWidget;"
        " const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;"
        " return k ? k.status : null; }"
    )
    return bool(status == "idle")


def kernel_status(page: Any) -> str | None:
    """The kernel status the frontend shows (what its status bar / indicator says)."""
    return page.evaluate(  # type: ignore[no-any-return]
        "() => { const w = window.jupyterapp.shell.currentWidget;"
        " return w && w.sessionContext ? w.sessionContext.kernelDisplayStatus : null; }"
    )


def run_all(page: Any, cells: int) -> None:
    """Run → Run All Cells, once all ``cells`` are loaded (the document arrives in pieces:
    running earlier runs only what is there) and the kernel is ready."""
    from playwright.sync_api import expect

    page.wait_for_function(  # the model, not the DOM: a long notebook renders lazily
        "n => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
        " return !!(w && w.content && w.content.model && w.content.model.cells.length === n); }",
        arg=cells, timeout=60_000,
    )
    first = page.locator(".jp-Notebook .jp-Cell").first.locator(".jp-InputPrompt")
    for _ in range(3):
        wait_for_kernel(page)
        # not awaited: the command's promise ends only when every cell has finished
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
        try:
            expect(first).not_to_have_text(re.compile(r"\[ \]"), timeout=15_000)
        except AssertionError:
            continue  # nothing ran (the session was still settling): nothing runs twice
        finish_run_all(page)
        return
    raise AssertionError("Run All Cells did not start the notebook")


# The code cells of the current notebook, from its model (a long notebook renders lazily):
# [executed, queued or running, has an error output]
_CODE_CELLS = """() => { const w = window.jupyterapp.shell.currentWidget, out = [], cells = w.content.model.cells;
  for (let i = 0; i < cells.length; i++) { const c = cells.get(i); if (c.type !== 'code') continue;
    out.push([i, c.executionCount !== null, c.executionState === 'running',
              c.outputs.toJSON().some(o => o.output_type === 'error')]); }
  return out; }"""


def finish_run_all(page: Any) -> None:
    """Once Run All has started, until its second code cell is queued or has run. A frontend
    race on a loaded host makes Run All run the first cell only; then the kernel goes idle
    with the rest never queued, and this runs the rest (from the second code cell down, so no
    cell runs twice). A first cell that failed stops Run All on purpose: nothing more runs."""
    deadline, stalled = time.monotonic() + 120, 0
    while True:
        cells = page.evaluate(_CODE_CELLS)
        if len(cells) < 2 or cells[1][1] or cells[1][2] or cells[0][3]:
            return
        first_done = cells[0][1] and not cells[0][2]
        stalled = stalled + 1 if first_done and kernel_status(page) == "idle" else 0
        if stalled > 30:  # 3 s idle with only the first cell run: Run All stopped
            page.evaluate("i => { const w = window.jupyterapp.shell.currentWidget; w.content.activeCellIndex = i;"
                          " window.jupyterapp.commands.execute('notebook:run-all-below'); }", cells[1][0])
            stalled = 0
        assert time.monotonic() < deadline, f"Run All Cells stopped after its first cell: {cells}"
        page.wait_for_timeout(100)


def dump_failure(page: Any, name: str) -> None:
    """A screenshot and the notebook's stderr outputs, for a failing browser test."""
    with contextlib.suppress(Exception):
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"failure-{name}.png"))
        errors = page.locator(".jp-OutputArea-output[data-mime-type*='stderr']").all_inner_texts()
        print("stderr outputs in the notebook:", *errors, sep="\n")


# Run code in the open notebook's kernel from the page, as the frontend does; returns its
# stream text and error lines (``page.evaluate(KERNEL_EXEC, code)``).
KERNEL_EXEC = """async (code) => {
  const w = window.jupyterapp.shell.currentWidget;
  const k = w.sessionContext.session.kernel;
  const out = [];
  const f = k.requestExecute({ code, store_history: false, allow_stdin: false });
  f.onIOPub = m => {
    if (m.header.msg_type === 'stream') out.push(m.content.text);
    if (m.header.msg_type === 'error') out.push(m.content.ename + ': ' + m.content.evalue);
  };
  await f.done;
  return out.join('');
}"""
