"""Third audit: MathJax and plotly attribute paths made the browser fetch from machine data.

JupyterLab and Notebook 7 run MathJax over every HTML output, and MathJax's TeX fetches on
its own (``\\mmlToken{mglyph}[src=...]``, ``\\style{cursor:url(...)}``, safe mode or not). nh3
sees only text there, so cleaning can't help: HTML that holds a machine's text is wrapped in
the classes MathJax skips, and a machine can't put the class that switches it back on. plotly.js
also expands attribute paths (``"images[0].source"``) in frames and menu arguments, and draws
a style sheet for every map panel (``map2``, ...): both now go through the URL checks. The
browser half (the fetches themselves, and that MathJax does fetch where the wrapper is missing)
is in test_browser_xss.py.
"""

from __future__ import annotations

import html.parser
from typing import Any

import pytest

from smolbench.gate import display, figures
from smolbench.result import ForkResult
from smolbench.widgets.static import checkpoints_html, static_output, tree_html

W = "http://127.0.0.1:1"
MATH = rf'$\mmlToken{{mglyph}}[src="{W}/mglyph"]{{}}$ and $\style{{cursor:url({W}/cursor),auto}}{{x}}$'
# a 1 x 1 PNG (an image whose size can't be read is dropped: tests/test_gate_images.py)
IMAGE = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="


class _TextOutsideIgnore(html.parser.HTMLParser):
    """Text nodes with TeX in them that MathJax would typeset (no skipping class above them)."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[bool] = []  # per open element: whether it or one above carries the class
        self.exposed: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        classes = (dict(attrs).get("class") or "").split()
        inert = bool(self.stack and self.stack[-1]) or "mathjax_ignore" in classes
        if tag not in ("br", "img", "hr", "input", "meta", "link"):
            self.stack.append(inert)

    def handle_endtag(self, tag: str) -> None:
        if self.stack and tag not in ("br", "img", "hr", "input", "meta", "link"):
            self.stack.pop()

    def handle_data(self, data: str) -> None:
        if "$" in data and not (self.stack and self.stack[-1]):
            self.exposed.append(data)


def exposed(markup: str) -> list[str]:
    p = _TextOutsideIgnore()
    p.feed(markup)
    return p.exposed


def test_tex_survives_cleaning_so_the_wrapper_is_what_stops_it() -> None:
    assert MATH in display.clean_html(f"<p>{MATH}</p>")  # nh3 sees text: the weak setup
    assert exposed(display.clean_html(f"<p>{MATH}</p>")) != []


@pytest.mark.parametrize("mime", ["text/html", "text/markdown"])
def test_html_and_markdown_from_a_machine_are_shown_where_mathjax_skips_them(mime: str) -> None:
    out, _ = display.bundle({mime: f"<p>{MATH}</p>" if mime == "text/html" else f"md {MATH}"}, trusted=False)
    shown = out["text/html"]
    assert shown.startswith('<div class="mathjax_ignore tex2jax_ignore">') and shown.endswith("</div>")
    assert "mglyph" in shown and exposed(shown) == []


def test_trust_on_shows_the_markup_as_it_came() -> None:
    out, _ = display.bundle({"text/html": f"<p>{MATH}</p>"}, trusted=True)
    assert out["text/html"] == f"<p>{MATH}</p>"


@pytest.mark.parametrize("cls", ["mathjax_process", "tex2jax_process", "MathJax_Preview", "TEX2JAX_PROCESS x"])
def test_a_machine_cannot_switch_mathjax_back_on_inside_the_wrapper(cls: str) -> None:
    out, _ = display.bundle({"text/html": f'<span class="{cls} kept">{MATH}</span>'}, trusted=False)
    inner = out["text/html"].removeprefix('<div class="mathjax_ignore tex2jax_ignore">')
    assert "process" not in inner.lower() and "mathjax" not in inner.lower() and "kept" in inner


def test_host_tables_that_hold_machine_text_are_inert() -> None:
    r = ForkResult("fork", "run", "root", ["root.1", "root.2"], [1, 2])
    r.rows["root.1"].update(status="error", error=f"ValueError: {MATH}")
    r.rows["root.2"].update(status="ok", reward=1.0, metrics={"note": MATH})
    assert exposed(r._repr_html_()) == []
    node = {"id": "root.1", "parent": None, "status": "error", "seed": 1, "error": MATH, "label": MATH}
    tree = tree_html([node], active=None, best_path=[], title=MATH, info=MATH, log=MATH)
    ckpt = checkpoints_html([{"name": MATH, "node": MATH, "backend": MATH, "warnings": [MATH]}], MATH)
    for markup in (tree, ckpt, static_output("u1", f"<p>{MATH}</p>")):
        assert exposed(markup) == [], markup


# -- plotly -----------------------------------------------------------------------------


def _kept(fig: dict[str, Any]) -> str:
    return repr(figures.figure(fig))


@pytest.mark.parametrize("panel", ["map", "map2", "map12", "mapbox", "mapbox3"])
def test_every_map_panel_style_is_checked(panel: str) -> None:
    for where in ({"layout": {panel: {"style": f"{W}/style.json"}}},
                  {"layout": {"template": {"layout": {panel: {"style": f"{W}/style.json"}}}}},
                  {"frames": [{"layout": {panel: {"style": {"version": 8, "sources": {"t": {"tiles": [W]}}}}}}]}):
        assert W not in _kept(where), where
    assert "'style': 'dark'" in _kept({"layout": {panel: {"style": "dark"}}})


ATTACK_PATHS = [
    {"frames": [{"name": "f", "layout": {"images[0].source": f"{W}/frame-img.png"}}]},
    {"frames": [{"layout": {"images[0]": {"source": f"{W}/frame-img.png"}}}]},
    {"frames": [{"layout": {"map2.style": f"{W}/style.json"}}]},
    {"frames": [{"layout": {"mapbox.layers[0].source": [f"{W}/tiles/{{z}}"]}}]},
    {"frames": [{"data": [{"geojson": f"{W}/geo.json"}], "layout": {"layout.images[1].source": f"{W}/x.png"}}]},
    {"layout": {"updatemenus": [{"buttons": [{"method": "relayout", "args": [{"images[0].source": f"{W}/btn.png"}]}]}]}},
    {"layout": {"sliders": [{"steps": [{"method": "update", "args": [{}, {"map3.style": f"{W}/s.json"}]}]}]}},
    # relayout/restyle also take (path, value) as two items of args (round 4's own audit: a click fetched)
    {"layout": {"updatemenus": [{"buttons": [{"method": "relayout", "args": ["images[0].source", f"{W}/i.png"]}]}]}},
    {"layout": {"updatemenus": [{"buttons": [{"method": "relayout", "args": ["map", {"style": f"{W}/s.json"}]}]}]}},
    {"layout": {"updatemenus": [{"buttons": [{"method": "restyle", "args": ["geojson", "/api/contents/x", [0]]}]}]}},
    {"layout": {"updatemenus": [{"buttons": [{"method": "relayout", "args2": ["map2.style", f"{W}/s.json"]}]}]}},
    {"layout": {"sliders": [{"steps": [{"method": "relayout", "args": ["mapbox.layers[0].source", [f"{W}/{{z}}"]]}]}]}},
]


@pytest.mark.parametrize("fig", ATTACK_PATHS)
def test_attribute_paths_are_checked_as_the_nested_keys_they_expand_to(fig: dict[str, Any]) -> None:
    assert W not in _kept(fig) and "/api/" not in _kept(fig)


def test_attribute_paths_that_fetch_nothing_stay() -> None:
    fig = {"frames": [{"layout": {"xaxis.range": [0, 1], "images[0].source": IMAGE, "map2.style": "dark"}}],
           "layout": {"updatemenus": [{"buttons": [{"method": "relayout", "args": [{"yaxis.type": "log"}]}]}]}}
    fig["layout"]["updatemenus"][0]["buttons"] += [{"method": "relayout", "args": ["yaxis.type", "log"]},
                                                    {"method": "restyle", "args": ["marker.color", "red", [0]]},
                                                    {"method": "relayout", "args": ["images[0].source", IMAGE]}]
    kept = figures.figure(fig)
    assert kept["frames"][0]["layout"] == {"xaxis.range": [0, 1], "images[0].source": IMAGE, "map2.style": "dark"}
    assert [b["args"] for b in kept["layout"]["updatemenus"][0]["buttons"]] == [
        [{"yaxis.type": "log"}], ["yaxis.type", "log"], ["marker.color", "red", [0]], ["images[0].source", IMAGE]]
