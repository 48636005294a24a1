"""Issue 9 in a real browser: script from a machine never runs in JupyterLab.

Machine cells emit each script vector (``<script>``, ``<img onerror>``, SVG ``onload``
inline and as image/svg+xml, ``application/javascript``, a ``javascript:`` link, and the
same in a cell's Out[n]). Each tries to set ``window.__pwned`` and to fetch a URL on a
local server this test watches. Nothing may run, while a pandas table, a PNG and a plotly
figure (sent as JSON data) made in the machine still render. Then the same kind of vector is run with ``%smol trust on``
(the weakened host): it runs, which shows the test would see an escape. Screenshots go
to tests/artifacts/.
"""

from __future__ import annotations

import http.server
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from browserhelpers import ARTIFACTS, CHROMIUM, wait_for_kernel  # noqa: E402
from browserhelpers import free_port as _free_port  # noqa: E402
from browserhelpers import tagged as _tagged  # noqa: E402

TAG_VAR = "SMOLBENCH_BROWSER_TAG"

pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason=f"no Chromium at {CHROMIUM} (apt-get install chromium)"
)

SETUP = '''%%smol
import base64, struct, sys, zlib
class H:
    def __init__(self, **d): self.d = d
    def _repr_html_(self): return self.d.get('html')
    def _repr_svg_(self): return self.d.get('svg')
    def _repr_markdown_(self): return self.d.get('md')
    def _repr_png_(self): return self.d.get('png')
    def __repr__(self): return 'H'
def hit(name):
    return "window.__pwned='%s';fetch('http://127.0.0.1:{port}/%s')" % (name, name)
def png(w, h):
    row = b'\\x00' + b'\\xd0\\x20\\x20' * w
    chunk = lambda t, d: struct.pack('>I', len(d)) + t + d + struct.pack('>I', zlib.crc32(t + d))
    return (b'\\x89PNG\\r\\n\\x1a\\n' + chunk(b'IHDR', struct.pack('>IIBBBBB', w, h, 8, 2, 0, 0, 0))
            + chunk(b'IDAT', zlib.compress(row * h)) + chunk(b'IEND', b''))
agent = sys.modules['smolbench_guest']._agent
'''
VECTORS = '''%%smol
import pandas as pd
display(H(html='<p class="v-script">script</p><script>' + hit('safe-script') + '</script>'))
display(H(html='<img class="v-img" src="x" onerror="' + hit('safe-img') + '">'))
display(H(html='<svg class="v-svg" onload="' + hit('safe-svg-inline') + '"><rect width="5" height="5"/></svg>'))
display(H(svg='<svg xmlns="http://www.w3.org/2000/svg" onload="' + hit('safe-svg') + '"><rect width="5" height="5"/></svg>'))
display(H(html='<a id="jslink" href="javascript:' + hit('safe-link') + '">click me</a>'))
display(H(md='**md** [mdlink](javascript:' + hit('safe-md') + ')'))
agent.send({'t': 'display', 'data': {'application/javascript': hit('safe-js'), 'text/plain': 'js'}})
display(pd.DataFrame({'alpha': [1, 2], 'beta': ['x', 'y']}))
display(H(png=png(40, 30)))
import plotly.graph_objects as go
display(go.Figure(go.Bar(x=['a', 'b'], y=[3, 5])))
H(html='<b class="v-result">result</b><script>' + hit('safe-result') + '</script>')
'''
TRUSTED = '''%%smol
display(H(html='<img class="v-trusted" src="x" onerror="' + hit('trusted-img') + '">'))
'''


class _Watcher(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self.hits.append(self.path)
        self.send_response(204)
        self.send_header("Access-Control-Allow-Origin", "*")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def watched() -> Iterator[tuple[int, list[str]]]:
    """A local server that records every request a page makes to it."""
    hits: list[str] = []
    handler = type("Watcher", (_Watcher,), {"hits": hits})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1], hits
    finally:
        server.shutdown()
        server.server_close()


def _run_all(page: Any) -> None:
    """Run → Run All Cells from the menu, once the kernel is ready (again if a click landed
    too early); this server does not expose ``window.jupyterapp`` to the page."""
    from playwright.sync_api import expect

    first = page.locator(".jp-Notebook .jp-Cell").first.locator(".jp-InputPrompt")
    for _ in range(3):
        wait_for_kernel(page)
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_text("Run All Cells", exact=True).click()
        try:
            expect(first).not_to_have_text(re.compile(r"\[ \]"), timeout=15_000)
            return
        except AssertionError:
            continue  # nothing ran (the session was still settling): nothing runs twice
    raise AssertionError("Run All Cells did not start the notebook")


@pytest.fixture
def lab(tmp_path: Path, watched: tuple[int, list[str]]) -> Iterator[tuple[str, list[str]]]:
    port_w, hits = watched
    # every cell can run twice (Run All is retried when a loaded host made JupyterLab drop it)
    cells = ["%load_ext smolbench", "%smol down\n%smol up --backend sandbox", SETUP.replace("{port}", str(port_w)),
             VECTORS, "%smol trust on", TRUSTED, "print('ALL' + ' DONE')"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nbformat.write(nb, tmp_path / "xss.ipynb")
    base_settings = tmp_path / ".jupyter" / "lab" / "user-settings" / "@jupyterlab"
    (base_settings / "apputils-extension").mkdir(parents=True)
    (base_settings / "apputils-extension" / "notification.jupyterlab-settings").write_text(
        '{"fetchNews": "false", "checkForUpdates": false}')
    (base_settings / "notebook-extension").mkdir(parents=True)
    (base_settings / "notebook-extension" / "tracker.jupyterlab-settings").write_text('{"autoStartDefaultKernel": true}')
    port, token, tag = _free_port(), secrets.token_hex(16), uuid.uuid4().hex
    # In a venv made with --system-site-packages, the frontend extensions (plotly's renderer)
    # live under the base interpreter's prefix: make them visible.
    data_path = os.pathsep.join(p for p in (os.environ.get("JUPYTER_PATH"), os.path.join(sys.base_prefix, "share", "jupyter")) if p)
    env = {**os.environ, TAG_VAR: tag, "JUPYTER_CONFIG_DIR": str(tmp_path / ".jupyter"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / ".runtime"), "JUPYTER_PATH": data_path}
    argv = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", f"--ServerApp.token={token}",
            "--ServerApp.ip=127.0.0.1", f"--ServerApp.root_dir={tmp_path}", "--ServerApp.open_browser=False"]
    if os.geteuid() == 0:
        argv.append("--allow-root")
    # `python -m jupyterlab`, not `jupyter lab`: the latter execs whichever jupyter-lab is first
    # on PATH, whose interpreter (and so the kernel's smolbench) may not be this one.
    log = open(tmp_path / "lab.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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
        yield f"{base}/lab/tree/xss.ipynb?token={token}", hits
    finally:
        proc.send_signal(signal.SIGTERM)  # the server shuts its kernels down, which delete their machines
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


def test_machine_output_cannot_run_script_in_jupyterlab(lab: tuple[str, list[str]]) -> None:
    from playwright.sync_api import expect, sync_playwright

    url, hits = lab
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                                          "--disable-component-update", "--disable-sync", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1400, "height": 1600})
        try:
            page.goto(url)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            for attempt in range(3):
                _run_all(page)
                try:
                    expect(page.locator(".jp-OutputArea-output", has_text="ALL DONE")).to_be_visible(timeout=90_000)
                    break
                except AssertionError:
                    if attempt == 2:
                        raise
            vectors = page.locator(".jp-Notebook .jp-Cell").nth(3)
            # what must still render: the pandas table, the PNG, the harmless markup
            table = vectors.locator("table.dataframe")
            expect(table).to_be_visible()
            expect(table.locator("th", has_text="alpha")).to_be_visible()
            img = vectors.locator("img[src^='data:image/png']")
            expect(img).to_be_visible()
            assert img.evaluate("el => [el.naturalWidth, el.naturalHeight]") == [40, 30]
            expect(vectors.locator(".js-plotly-plot .bars path")).to_have_count(2, timeout=30_000)  # plotly JSON
            expect(vectors.locator("p.v-script")).to_have_text("script")
            expect(vectors.locator("b.v-result")).to_have_text("result")
            expect(vectors.locator("strong", has_text="md")).to_be_visible()
            expect(vectors.locator(".jp-OutputArea-output", has_text="application/javascript output")).to_be_visible()
            # the links lost their javascript: targets; clicking them does nothing
            for name in ("click me", "mdlink"):
                vectors.locator(".jp-OutputArea a", has_text=name).click()
            page.wait_for_timeout(1500)  # time for any fetch to land
            vectors.screenshot(path=str(ARTIFACTS / "xss_machine_output.png"))
            safe = [h for h in hits if "safe-" in h]
            assert safe == [], f"machine script ran in the browser: {safe}"
            # Weakened: trusted mode shows output raw, and its script does run
            expect(page.locator("img.v-trusted")).to_be_attached()
            page.wait_for_function("() => window.__pwned === 'trusted-img'", timeout=30_000)
            deadline = time.monotonic() + 10
            while "/trusted-img" not in hits and time.monotonic() < deadline:
                time.sleep(0.1)
            assert set(hits) == {"/trusted-img"}, hits
            page.screenshot(path=str(ARTIFACTS / "xss_notebook.png"), full_page=True)
        except BaseException:
            page.screenshot(path=str(ARTIFACTS / "xss_failure.png"), full_page=True)
            raise
        finally:
            browser.close()
