"""Display bundles from a machine, made safe for the user's browser.

JupyterLab treats output of a cell the user ran as trusted, so script in it would run
next to the Jupyter server's token. Only data types pass as they are; markup goes
through nh3 (the ammonia sanitiser), keeping tables, inline styles and inline images
but no script, event handlers, ``javascript:`` links or resources fetched from elsewhere;
anything else is dropped with a note (``text/latex`` too: MathJax macros can make links).
Markdown is rendered to HTML here (mistune) and cleaned like HTML, because the frontend
would render its raw HTML and links unchecked. ``%smol trust on`` shows bundles raw.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import re
from typing import Any

import nh3

from .frames import Bad, mapping, shown, string

TEXT_LIMIT = 64 * 1024 * 1024
MIME_RE = re.compile(r"[a-z]+/[A-Za-z0-9.+\-]{1,100}")
IMAGES = {"image/png": b"\x89PNG\r\n\x1a\n", "image/jpeg": b"\xff\xd8\xff", "image/gif": b"GIF8"}
# Rendered by Jupyter as data, never as code.
DATA_TYPES = {"text/plain", "application/json", "application/vnd.plotly.v1+json", "application/geo+json",
              "application/vnd.vega.v5+json", "application/vnd.vegalite.v5+json"}
MARKUP = {"text/html", "text/markdown", "image/svg+xml"}

SVG_TAGS = {"svg", "g", "path", "rect", "circle", "ellipse", "line", "polyline", "polygon", "text", "tspan",
            "defs", "lineargradient", "radialgradient", "stop", "clippath", "title", "desc", "marker", "pattern",
            "mask", "symbol", "linearGradient", "radialGradient", "clipPath"}
SVG_ATTRS = {"viewbox", "xmlns", "width", "height", "x", "y", "x1", "y1", "x2", "y2", "cx", "cy", "r", "rx", "ry",
             "d", "points", "fill", "fill-opacity", "fill-rule", "stroke", "stroke-width", "stroke-opacity",
             "stroke-linecap", "stroke-linejoin", "stroke-dasharray", "opacity", "transform", "font-size",
             "font-family", "font-weight", "text-anchor", "dominant-baseline", "offset", "stop-color",
             "stop-opacity", "gradientunits", "gradienttransform", "clip-path", "clip-rule", "preserveaspectratio",
             "version", "id", "class", "style", "dx", "dy", "marker-end", "marker-start", "markerwidth",
             "markerheight", "refx", "refy", "orient", "patternunits", "mask", "viewBox", "gradientUnits",
             "gradientTransform", "preserveAspectRatio", "markerWidth", "markerHeight", "refX", "refY",
             "patternUnits"}
HTML_TAGS = set(nh3.ALLOWED_TAGS) | {"style", "font", "label", "caption", "tfoot"}
HTML_ATTRS: dict[str, set[str]] = {k: set(v) for k, v in nh3.ALLOWED_ATTRIBUTES.items()}
HTML_ATTRS["*"] = {"class", "style", "title", "id", "lang", "dir", "align", "valign", "width", "height"}
HTML_ATTRS.setdefault("table", set()).update({"border", "cellpadding", "cellspacing"})
HTML_ATTRS.setdefault("font", set()).update({"color", "size", "face"})
# Values that could fetch from elsewhere or run something, in CSS or in a URL.
UNSAFE_CSS = re.compile(r"url\s*\(|@import|expression\s*\(|javascript:|behavior\s*:|-moz-binding|\\|<", re.IGNORECASE)
SAFE_IMG_SRC = re.compile(r"data:image/(png|jpeg|gif|webp|svg\+xml)[;,]", re.IGNORECASE)
SAFE_HREF = re.compile(r"(https?:|mailto:|#)", re.IGNORECASE)
LOCAL_REF = re.compile(r"url\(\s*#[\w.\-]+\s*\)")
STYLE_BLOCK = re.compile(r"<style>(.*?)</style>", re.DOTALL | re.IGNORECASE)


class SafeBundle(dict[str, Any]):
    """A MIME bundle that passed the gate: the only kind the magics display."""


def _attribute_filter(tag: str, attr: str, value: str) -> str | None:
    v = value.strip()
    if attr == "style":
        return None if UNSAFE_CSS.search(v) else value
    if attr in ("src", "srcset") or (tag == "img" and attr == "href"):
        return value if SAFE_IMG_SRC.match(v) else None
    if attr in ("href", "xlink:href", "action", "formaction", "cite", "longdesc", "background", "poster"):
        return value if SAFE_HREF.match(v) else None
    if "url(" in v.lower() and not LOCAL_REF.fullmatch(v):
        return None  # e.g. fill="url(http://...)": a fetch from elsewhere
    return value


def _safe_style_blocks(html: str) -> str:
    # nh3 keeps <style> text as is (it only filters attributes): keep the blocks that
    # can't fetch or run anything, like the one pandas puts before its tables.
    return STYLE_BLOCK.sub(lambda m: m.group(0) if not UNSAFE_CSS.search(m.group(1)) else "", html)


def clean_html(html: str) -> str:
    """HTML without script, handlers, unsafe URLs or CSS that fetches."""
    out = nh3.clean(html, tags=HTML_TAGS, clean_content_tags={"script"}, attributes=HTML_ATTRS,
                    attribute_filter=_attribute_filter, url_schemes={"http", "https", "mailto", "data"},
                    link_rel="noopener noreferrer nofollow", strip_comments=True)
    return _safe_style_blocks(out)


def clean_svg(svg: str) -> str:
    """SVG shapes and text only: no script, handlers, links, foreignObject or animation."""
    attrs = {t: set(SVG_ATTRS) for t in SVG_TAGS}
    out = nh3.clean(svg, tags=SVG_TAGS | {"style"}, clean_content_tags={"script"}, attributes=attrs,
                    attribute_filter=_attribute_filter, url_schemes=set(), strip_comments=True)
    return _safe_style_blocks(out)


def markdown_to_html(text: str) -> str:
    """Markdown rendered here (so its links and raw HTML can be cleaned), then cleaned."""
    import mistune

    md = mistune.create_markdown(escape=False, plugins=["table", "strikethrough"])
    return clean_html(str(md(text)))


def _image(mime: str, value: Any) -> str:
    text = string(value, f"the {mime} output", TEXT_LIMIT)
    try:
        raw = base64.b64decode(text.replace("\n", ""), validate=True)
    except (binascii.Error, ValueError):
        raise Bad(f"the {mime} output is not base64") from None
    if not raw.startswith(IMAGES[mime]):
        raise Bad(f"the {mime} output is not a {mime.split('/')[1].upper()} image")
    return text


def _json_size(value: Any) -> int:
    return len(json.dumps(value))


def bundle(data: Any, trusted: bool) -> tuple[dict[str, Any], list[str]]:
    """Check a MIME bundle and make it safe; returns (bundle, MIME types dropped)."""
    data = mapping(data, "a display bundle", 64)
    out: dict[str, Any] = {}
    dropped: list[str] = []
    for mime, value in data.items():
        if not isinstance(mime, str) or not MIME_RE.fullmatch(mime):
            raise Bad(f"a display bundle has a bad MIME type {shown(mime)}")
        if trusted:
            out[mime] = value if not isinstance(value, str) else string(value, mime, TEXT_LIMIT)
        elif mime in IMAGES:
            out[mime] = _image(mime, value)
        elif mime in DATA_TYPES:
            if mime == "text/plain":
                out[mime] = string(value, "the text/plain output", TEXT_LIMIT)
            else:
                out[mime] = copy.deepcopy(value) if isinstance(value, (dict, list)) else value
        elif mime == "text/html":
            out[mime] = clean_html(string(value, "the text/html output", TEXT_LIMIT))
        elif mime == "text/markdown":
            html = markdown_to_html(string(value, "the text/markdown output", TEXT_LIMIT))
            out.setdefault("text/html", html)
        elif mime == "image/svg+xml":
            out[mime] = clean_svg(string(value, "the image/svg+xml output", TEXT_LIMIT))
        else:
            dropped.append(mime)
    if "text/html" in out and "text/markdown" in data and "text/html" in data and not trusted:
        out["text/html"] = clean_html(string(data["text/html"], "the text/html output", TEXT_LIMIT))
    return out, dropped
