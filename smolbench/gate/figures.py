"""Plotly figures from a machine, without anything that makes the browser fetch or links the page.

plotly.js loads a URL wherever a figure names one: ``layout.images[].source`` and image
traces' ``source``, a ``geojson`` given as a URL, map styles and layer sources (also in
``layout.template`` and animation ``frames``). Its ``config`` can point it at other servers
(``topojsonURL``, ``plotlyServerURL``). So: image sources must be inline ``data:`` images
of a size the tab can decode (``images.py``), geojson inline objects, map styles (of every
map panel: ``map``, ``map2``, ``mapbox3``, ...) one of plotly's names, and ``config`` keeps only display switches (and turns MathJax
typesetting of text off). A key may also be an attribute path (``"images[0].source"``), which
plotly.js expands in frames and in menus' arguments: its names are checked as nested keys.

Every string is also text plotly may draw as its pseudo-HTML (titles, legend, annotations,
hover and tick text, templates, menu labels, ...), where it reads ``style``, ``href``,
``target`` and ``popup`` attributes, even right after a quote (``<a x="b"href="/api/...">``),
and page-relative links. So tags carry no attributes: ``<b> <i> <br> <sup> <sub>`` (and
``<extra>`` for hover templates) stay, written exactly so; a link stays only as
``<a href="...">`` to an absolute http(s) URL, else its tag goes and its text stays; any other
``<`` becomes ``&lt;``, which plotly shows as the same text. A string that names a CSS image
function (``url(``, ``image-set(``, ... even through CSS escapes) is dropped.
"""

from __future__ import annotations

import html
import re
from typing import Any

from . import images
from .css import CSS_IMAGE
from .frames import Bad

DATA_IMAGE = re.compile(r"data:image/(png|jpeg|gif|webp);base64,[A-Za-z0-9+/=\s]*", re.IGNORECASE)
CONFIG = frozenset({"responsive", "displayModeBar", "displaylogo", "scrollZoom", "staticPlot", "showTips",
                    "doubleClick", "modeBarButtonsToRemove", "editable", "autosizable", "fillFrame",
                    "showAxisDragHandles", "showAxisRangeEntryBoxes", "frameMargins", "locale"})
NAMED_STYLE = re.compile(r"[a-z][a-z0-9-]{0,40}")
MAP_PANEL = re.compile(r"(map|mapbox)[0-9]*")  # layout.map, map2, mapbox3, ...
PATH_NAME = re.compile(r"[^.\[\]]+")  # the names in an attribute path such as "images[0].source"
MAX_DEPTH = 64  # as for application/json: deeper breaks the tools that read the notebook

# plotly.js svg_text_utils: how it splits text into tags, reads one tag and its href.
TAG = re.compile(r"<[^<>]*>")
NEWLINES = re.compile(r"\r\n?|\n")
ONE_TAG = re.compile(r"<(/?)([^ >]*)(\s+(.*))?>", re.IGNORECASE | re.DOTALL)
HREF = re.compile(r"""(^|[\s"'])href\s*=\s*("([^"]*)"|'([^']*)')""", re.IGNORECASE)
ENTITY = re.compile(r"&(#\d+|#x[\da-fA-F]+|[a-z]+);")
ENTITIES = {"mu": "\u03bc", "amp": "&", "lt": "<", "gt": ">", "nbsp": "\xa0", "times": "\xd7", "plusmn": "\xb1",
            "deg": "\xb0"}
# Tags plotly draws that carry nothing but formatting ("extra": hovertemplate's second box).
FORMATTING = frozenset({"b", "i", "br", "sup", "sub", "extra"})
# An absolute http(s) URL: a host, then no quote, space, brace (a %{template}), markup or backslash.
ABSOLUTE = re.compile(r"https?://[A-Za-z0-9.\-]+(:[0-9]{1,5})?([/?#][^\s\"'<>\\{}`]*)?", re.IGNORECASE)
CSS_ESCAPE = re.compile(r"\\([0-9A-Fa-f]{1,6})[ \t\n\r\f]?|\\(.)", re.DOTALL)


def _entities(text: str) -> str:
    """Entities decoded as plotly's ``convertEntities`` does."""
    def one(m: re.Match[str]) -> str:
        ref = m.group(1)
        if ref[0] != "#":
            return ENTITIES.get(ref, m.group(0))
        code = int(ref[2:], 16) if ref[1] in "xX" else int(ref[1:])
        return chr(code) if 0 < code <= 0x10FFFF and not 0xD800 <= code < 0xE000 else m.group(0)
    return ENTITY.sub(one, text)


def _tag(tag: str, links: list[bool]) -> str:
    """One ``<...>`` as plotly would read it, rewritten without attributes (or escaped)."""
    m = ONE_TAG.match(NEWLINES.sub(" ", tag))  # plotly reads newlines as spaces
    name = m.group(2).lower() if m else ""
    extra = (m.group(4) or "").strip() if m else ""
    if m and name in FORMATTING and extra in ("", "/"):
        return "<br>" if name == "br" else f"<{m.group(1)}{name}>"
    if m and name == "a" and m.group(1):
        return "</a>" if links and links.pop() else ""
    if m and name == "a":
        found = HREF.search(m.group(4) or "")
        href = _entities(found.group(3) if found.group(3) is not None else found.group(4)) if found else ""
        links.append(bool(ABSOLUTE.fullmatch(href)))
        return f'<a href="{html.escape(href)}">' if links[-1] else ""
    return tag.replace("<", "&lt;")


def _markup(value: str) -> str:
    out: list[str] = []
    links: list[bool] = []  # per open <a>: whether it was kept (so its </a> is too)
    pos = 0
    for m in TAG.finditer(value):
        out += [value[pos:m.start()].replace("<", "&lt;"), _tag(m.group(0), links)]
        pos = m.end()
    out.append(value[pos:].replace("<", "&lt;"))
    return "".join(out)


def _text(value: str) -> str:
    plain = CSS_ESCAPE.sub(lambda m: chr(int(m.group(1), 16)) if m.group(1) and int(m.group(1), 16) < 0x110000
                           else (m.group(2) or ""), value).lower()
    if CSS_IMAGE.search(plain):
        return ""  # e.g. a colour "url(http://...)": nothing in a figure needs one
    return _markup(value) if "<" in value else value


def _clean(node: Any, key: str, depth: int, pixels: images.Pixels | None) -> Any:
    if depth > MAX_DEPTH:
        raise Bad("a plotly figure nested too deeply")
    if isinstance(node, str):
        return _text(node)
    if isinstance(node, list):
        if key in ("args", "args2") and len(node) >= 2 and isinstance(node[0], str):
            # a menu's or slider's relayout/restyle also takes (path, value) as two items:
            # ["images[0].source", url], ["map", {"style": url}], ["geojson", url, [0]]
            last, parent = _names(node[0], key)
            if not _kept(last, node[1], parent, pixels):
                return []
            return [_text(node[0]), _clean(node[1], last, depth + 1, pixels),
                    *[_clean(v, key, depth + 1, pixels) for v in node[2:]]]
        return [_clean(v, key, depth + 1, pixels) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        last, parent = _names(k, key) if isinstance(k, str) else (k, key)
        if not _kept(last, v, parent, pixels):
            continue
        out[k] = _clean(v, last, depth + 1, pixels)
    return out


def _names(k: str, parent: str) -> tuple[str, str]:
    """A key's last name and the name it is under. A key may be an attribute path
    ("images[0].source", "map2.style"): plotly.js expands these in frames and in menus' and
    sliders' relayout/update arguments, so its last names are checked as nested keys would be."""
    if "." not in k and "[" not in k:
        return k, parent
    names = [n for n in PATH_NAME.findall(k) if not n.isdigit()]
    return (names[-1] if names else k), (names[-2] if len(names) > 1 else parent)


def _decodable(url: str, pixels: images.Pixels | None) -> bool:
    try:
        images.data_url(url, pixels=pixels)
    except images.Refused:
        return False
    return True


def _kept(k: str, v: Any, parent: str, pixels: images.Pixels | None) -> bool:
    """Whether the field ``k`` (in ``parent``) with value ``v`` names nothing to fetch (an image
    source, nothing too big to decode: with ``pixels``, its size is taken from them)."""
    if k == "source" and not (isinstance(v, str) and DATA_IMAGE.fullmatch(v)) and not isinstance(v, dict):
        return False  # an image or map-layer source by URL (or a list of tile URLs)
    if k == "source" and isinstance(v, str) and not _decodable(v, pixels):
        return False  # an image too big for the tab to decode (an image trace draws it into a canvas), or past the cell's
    if k == "geojson" and not isinstance(v, dict):
        return False  # by URL
    if k == "style" and MAP_PANEL.fullmatch(parent) and not (isinstance(v, str) and NAMED_STYLE.fullmatch(v)):
        return False  # a style sheet by URL, or inline with its own source URLs
    return True


def figure(value: Any, pixels: images.Pixels | None = None) -> Any:
    """A plotly figure bundle value with every URL-bearing field dropped; its images' sizes are
    taken from ``pixels`` (the cell's images' allowance; None: only each image's own bound)."""
    if not isinstance(value, dict):
        raise Bad("the application/vnd.plotly.v1+json output should be an object")
    out = {k: _clean(v, k, 1, pixels) for k, v in value.items() if k in ("data", "layout", "frames")}
    config = value.get("config")
    if isinstance(config, dict):
        out["config"] = {k: _clean(v, k, 1, pixels) for k, v in config.items() if k in CONFIG}
    # MathJax, where the page has it, would draw $...$ text with its own links and macros
    out["config"] = {**out.get("config", {}), "typesetMath": False}
    return out
