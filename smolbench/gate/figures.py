"""Plotly figures from a machine, without anything that makes the browser fetch.

plotly.js loads a URL wherever a figure names one: ``layout.images[].source`` and image
traces' ``source``, a ``geojson`` given as a URL, map styles and layer sources (also in
``layout.template`` and animation ``frames``), and CSS ``url()`` in the ``style`` of its
pseudo-HTML text. Its ``config`` can point it at other servers (``topojsonURL``,
``plotlyServerURL``). So: image sources must be inline ``data:`` images, geojson inline
objects, map styles one of plotly's names, text styles pass the CSS allow-list, links
must be absolute http(s)/mailto, and ``config`` keeps only display switches.
"""

from __future__ import annotations

import re
from typing import Any

from .css import clean_style
from .frames import Bad

DATA_IMAGE = re.compile(r"data:image/(png|jpeg|gif|webp);base64,[A-Za-z0-9+/=\s]*", re.IGNORECASE)
CONFIG = frozenset({"responsive", "displayModeBar", "displaylogo", "scrollZoom", "staticPlot", "showTips",
                    "doubleClick", "modeBarButtonsToRemove", "editable", "autosizable", "fillFrame",
                    "showAxisDragHandles", "showAxisRangeEntryBoxes", "frameMargins", "locale"})
# plotly.js pseudo-HTML: <a href=...>, <span style=...> (and target, class) inside text.
ATTR = re.compile(r"""(\s)(style|href|target)\s*=\s*("[^"]*"|'[^']*'|[^\s>]*)""", re.IGNORECASE)
ABSOLUTE_LINK = re.compile(r"(https?://[^\s\"'<>]+|mailto:[^\s\"'<>]+)", re.IGNORECASE)
NAMED_STYLE = re.compile(r"[a-z][a-z0-9-]{0,40}")
MAX_DEPTH = 64  # as for application/json: deeper breaks the tools that read the notebook


def _attr(m: re.Match[str]) -> str:
    space, name, quoted = m.group(1), m.group(2).lower(), m.group(3)
    value = quoted[1:-1] if quoted[:1] in "\"'" and len(quoted) >= 2 else quoted
    if name == "style":
        kept = clean_style(value)
        return f'{space}style="{kept}"' if kept and '"' not in kept else ""
    if name == "href":
        return f'{space}href="{value}"' if ABSOLUTE_LINK.fullmatch(value) else ""
    return f'{space}target="_blank"'


def _text(value: str) -> str:
    if "<" in value:
        value = ATTR.sub(_attr, value)
    low = value.lower()
    if "url(" in low or "image-set" in low or "url (" in low:
        return ""  # e.g. a colour "url(http://...)": nothing in a figure needs one
    return value


def _clean(node: Any, key: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise Bad("a plotly figure nested too deeply")
    if isinstance(node, str):
        return _text(node)
    if isinstance(node, list):
        return [_clean(v, key, depth + 1) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k == "source" and not (isinstance(v, str) and DATA_IMAGE.fullmatch(v)) and not isinstance(v, dict):
            continue  # an image or map-layer source by URL (or a list of tile URLs)
        if k == "geojson" and not isinstance(v, dict):
            continue  # by URL
        if k == "style" and key in ("mapbox", "map") and not (isinstance(v, str) and NAMED_STYLE.fullmatch(v)):
            continue  # a style sheet by URL, or inline with its own source URLs
        out[k] = _clean(v, k, depth + 1)
    return out


def figure(value: Any) -> Any:
    """A plotly figure bundle value with every URL-bearing field dropped."""
    if not isinstance(value, dict):
        raise Bad("the application/vnd.plotly.v1+json output should be an object")
    out = {k: _clean(v, k, 1) for k, v in value.items() if k in ("data", "layout", "frames")}
    config = value.get("config")
    if isinstance(config, dict):
        out["config"] = {k: _clean(v, k, 1) for k, v in config.items() if k in CONFIG}
    return out
