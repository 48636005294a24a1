"""Display bundles from a machine, made safe for the user's browser.

JupyterLab treats output of a cell the user ran as trusted, so script in it would run
next to the Jupyter server's token, and anything that fetches a URL would fetch it with the
user's cookies (a page-relative URL reads the Jupyter server itself). So only MIME types on
an allow-list pass (``ALLOWED``; docs/security.md says why each is safe), each made safe
its own way; anything else is dropped with a note. Markup goes through nh3 (the ammonia
sanitiser): no script, event handlers, ``<style>`` blocks, relative or ``javascript:``
links, or resources from elsewhere; ``style`` attributes are parsed and re-serialized
by the CSS pipeline (``css.py``); ids are prefixed and page classes dropped, so nothing
styles or stands in for the page around the output. Markdown is rendered to HTML here (cmark-gfm, in C: linear
time, so made-up markdown costs the loop little) and cleaned like HTML, at most
``MARKDOWN_LIMIT`` characters of it per cell. Images, as bundles or ``data:`` URLs in markup,
are refused past a size a browser tab can decode (``images.py``). Plotly figures lose their
URL-bearing fields (``figures.py``). Vega and Vega-Lite specs are refused: their renderer loads data from any URL the spec names.
``%smol trust on`` shows bundles raw.
"""

from __future__ import annotations

import base64
import binascii
import re
import threading
from typing import Any

import nh3

from . import figures, images
from .css import CSS_IMAGE, clean_style
from .frames import Bad, mapping, shown, string

TEXT_LIMIT = 64 * 1024 * 1024
MARKDOWN_LIMIT = 256 * 1024  # characters of markdown rendered per cell (past it, markdown shows as its text/plain)
# JSON deeper than this breaks the tools that read the notebook (nbformat recurses per level).
MAX_DEPTH = 64
MIME_RE = re.compile(r"[a-z]+/[A-Za-z0-9.+\-]{1,100}")
IMAGES = {"image/png": b"\x89PNG\r\n\x1a\n", "image/jpeg": b"\xff\xd8\xff", "image/gif": b"GIF8"}
PLOTLY = "application/vnd.plotly.v1+json"
# Everything a machine may show; the rest (application/javascript, Vega, Vega-Lite, GeoJSON,
# PDF, LaTeX, widget views, ...) is dropped with a note.
ALLOWED = frozenset({"text/plain", "application/json", PLOTLY, "text/html", "text/markdown", "image/svg+xml",
                     *IMAGES})
# Class names the page's own style sheets use (JupyterLab, Lumino, CodeMirror, MathJax,
# widgets, smolbench): a machine's markup can't borrow them to cover the page.
PAGE_CLASS = re.compile(r"(jp|lm|p|cm|mjx|widget|jupyter|smolbench|smol|bk|ipywidgets|lab|nb)-|MathJax|tex2jax|"
                        r"CodeMirror", re.IGNORECASE)
# JupyterLab and Notebook 7 run MathJax over every HTML output, and its TeX makes the browser
# fetch (``\mmlToken{mglyph}[src=...]``, ``\style{cursor:url(...)}``, safe mode or not): HTML
# that holds a machine's text is wrapped in these classes, which MathJax 3 and 2 skip
# (``mathjax_process``/``tex2jax_process`` inside would switch it back on: PAGE_CLASS drops them).
INERT_CLASSES = "mathjax_ignore tex2jax_ignore"
CLASS = re.compile(r"[A-Za-z_][\w-]{0,63}")
ID_PREFIX = "smolbench-output-"

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
HTML_TAGS = set(nh3.ALLOWED_TAGS) | {"font", "label", "caption", "tfoot"}
HTML_ATTRS: dict[str, set[str]] = {k: set(v) for k, v in nh3.ALLOWED_ATTRIBUTES.items()}
HTML_ATTRS["*"] = {"class", "style", "title", "id", "lang", "dir", "align", "valign", "width", "height"}
HTML_ATTRS.setdefault("table", set()).update({"border", "cellpadding", "cellspacing"})
HTML_ATTRS.setdefault("font", set()).update({"color", "size", "face"})
SAFE_IMG_SRC = re.compile(r"data:image/(png|jpeg|gif|webp|svg\+xml)[;,][^\s]*", re.IGNORECASE)
URL_SPACE = "".join(map(chr, range(0x21)))  # what the URL standard strips from a URL's ends (C0 and space)
SAFE_HREF = re.compile(r"(https?://|mailto:)\S+|#[\w.\-]*", re.IGNORECASE)
LOCAL_REF = re.compile(r"url\(\s*#[\w.\-]+\s*\)")
TEXT_ATTRS = frozenset({"title", "alt", "summary", "abbr"})  # shown as text, never parsed as CSS


# Start tags in one HTML, SVG or rendered-markdown value. html5ever checks an element's scope by
# walking the open elements, so nh3's time grows with tags x depth: 64,000 nested <ol> (256 KiB)
# took 18 s, and markdown's ">" x 262,000 (nested blockquotes) ten minutes. Text can't make
# elements, so counting `<` + letter bounds both: 8,192 nested take ~0.15 s. A 700-row table
# (pandas shows 60) is about that many.
MARKUP_ELEMENTS = 8_192
_START_TAG = re.compile(r"<[A-Za-z]")


class TooMuchMarkup(ValueError):
    """A value with more elements than :data:`MARKUP_ELEMENTS` (not shown; the cell goes on)."""


def _bounded(markup: str, what: str) -> str:
    n = len(_START_TAG.findall(markup))
    if n > MARKUP_ELEMENTS:
        raise TooMuchMarkup(f"{what} ({n:,} elements, over {MARKUP_ELEMENTS:,})")
    return markup


# The bundle being cleaned: its cell's image allowance, the images refused by the attribute
# filter (nh3 calls it on this thread) for the cell's notes, and the elements its SVG images may still have.
_IMAGES = threading.local()


def _image_src(value: str) -> str | None:
    """A ``data:`` image URL re-written from the bytes checked, or None (noted) when refused."""
    try:
        return images.data_url(value, "an image in its HTML", getattr(_IMAGES, "pixels", None))
    except images.Refused as exc:
        _refused(exc)
        return None


def _svg_src(value: str) -> str | None:
    """A ``data:image/svg+xml`` URL re-written as base64 of its SVG cleaned as an
    ``image/svg+xml`` bundle is (no ``<image>``: an SVG drawn as an ``<img>`` still decodes
    the ``data:`` rasters it embeds, at their full size), or None (noted) when refused."""
    what = "an SVG image in its HTML"
    try:
        raw = images.data_bytes(value, what)
        fmt = images.sniff(raw)
        if fmt is not None:  # not SVG; shown as SVG or not, it is nothing to show
            raise images.Refused(f"{what} (its bytes are a {fmt.upper()} image, not SVG)")
        try:
            svg = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise images.Refused(f"{what} (not UTF-8 text)") from None
        # a bundle's SVG images share one value's elements: each is cleaned by nh3 as a value
        # is (1,500 of 8,192 nested <ol> fit a frame, 0.3 s each)
        n, left = len(_START_TAG.findall(svg)), getattr(_IMAGES, "svg_elements", None)
        left = MARKUP_ELEMENTS if left is None else left  # (outside a bundle: each its own)
        if n > left:
            raise TooMuchMarkup(f"{what} ({n:,} elements, past the {MARKUP_ELEMENTS:,} of a bundle's SVG images in all)")
        _IMAGES.svg_elements = left - n
        cleaned = clean_svg(svg, what)
    except (images.Refused, TooMuchMarkup) as exc:
        _refused(exc)
        return None
    return f"data:image/svg+xml;base64,{base64.b64encode(cleaned.encode()).decode()}"


def _refused(exc: images.Refused | TooMuchMarkup) -> None:
    refused = getattr(_IMAGES, "refused", None)
    if refused is not None:
        refused.append(exc)


class SafeBundle(dict[str, Any]):
    """A MIME bundle that passed the gate: the only kind the magics display."""


def _classes(value: str) -> str | None:
    kept = [c for c in value.split() if CLASS.fullmatch(c) and not PAGE_CLASS.match(c)]
    return " ".join(kept) or None


def _attribute_filter(tag: str, attr: str, value: str) -> str | None:
    v = value.strip()
    if attr == "style":
        return clean_style(v)
    if attr == "class":
        return _classes(v)
    if attr == "src" or (tag == "img" and attr == "href"):
        u = value.strip(URL_SPACE)
        m = SAFE_IMG_SRC.fullmatch(u)
        if m is None:
            return None
        # (an SVG is drawn at the size its <img> is laid out at, not decoded whole; what it holds is cleaned)
        return _svg_src(u) if m.group(1).lower() == "svg+xml" else _image_src(u)
    if attr in ("href", "xlink:href"):
        # Only what a URL parser strips from its ends, and the URL checked is the one kept: str.strip()
        # also took U+00A0 or U+3000, which a browser keeps, and "\u00a0https://x/../../api/contents/f"
        # passed as absolute and was a page-relative link into the Jupyter server (third audit).
        u = value.strip(URL_SPACE)
        if u.startswith("#"):
            return "#" + ID_PREFIX + u[1:] if u[1:] else u  # to the (prefixed) id it names
        return u if SAFE_HREF.fullmatch(u) else None  # absolute links only: no page-relative URL
    if attr in ("action", "formaction", "cite", "longdesc", "background", "poster", "srcset", "ping"):
        return None
    if "\\" in v and attr not in TEXT_ATTRS:
        return None  # an SVG presentation attribute is parsed as CSS, where an escape spells any name
    if ("url" in v.lower() or CSS_IMAGE.search(v.lower())) and not LOCAL_REF.fullmatch(v):
        return None  # e.g. fill="url(http://...)", mask="image-set('http://...' 1x)": a fetch from elsewhere
    return value


def clean_html(html: str, what: str = "text/html") -> str:
    """HTML without script, handlers, style blocks, unsafe URLs or CSS that fetches or escapes
    (TooMuchMarkup past :data:`MARKUP_ELEMENTS`, naming ``what`` the HTML came as)."""
    return nh3.clean(_bounded(html, what), tags=HTML_TAGS, clean_content_tags={"script", "style"}, attributes=HTML_ATTRS,
                     attribute_filter=_attribute_filter, url_schemes={"http", "https", "mailto", "data"},
                     link_rel="noopener noreferrer nofollow", strip_comments=True, id_prefix=ID_PREFIX)


def clean_svg(svg: str, what: str = "image/svg+xml") -> str:
    """SVG shapes and text only: no script, handlers, links, images, style blocks or animation
    (TooMuchMarkup past :data:`MARKUP_ELEMENTS`, naming ``what`` the SVG came as)."""
    attrs = {t: set(SVG_ATTRS) for t in SVG_TAGS}
    return nh3.clean(_bounded(svg, what), tags=SVG_TAGS, clean_content_tags={"script", "style"}, attributes=attrs,
                     attribute_filter=_attribute_filter, url_schemes=set(), strip_comments=True)


class MarkdownAllowance:
    """Characters of markdown one cell may still have rendered here."""

    def __init__(self, left: int = MARKDOWN_LIMIT) -> None:
        self.left = left

    def take(self, text: str) -> bool:
        if len(text) > self.left:
            return False
        self.left -= len(text)
        return True


def markdown_to_html(text: str) -> str:
    """Markdown rendered here as GitHub does (so its links and raw HTML can be cleaned), then
    cleaned. Raw HTML passes the renderer whole (not GFM's tag filter, which escapes a
    ``<style>`` into visible text) only to meet nh3 next, which drops it with its content."""
    import cmarkgfm
    from cmarkgfm.cmark import Options

    html = cmarkgfm.markdown_to_html_with_extensions(text, options=Options.CMARK_OPT_UNSAFE,
                                                     extensions=["table", "strikethrough", "autolink"])
    return clean_html(html, "text/markdown")


def inert(html: str) -> str:
    """``html`` (already safe markup) wrapped so that MathJax leaves its text alone."""
    return f'<div class="{INERT_CLASSES}">{html}</div>'


def _image(mime: str, value: Any, pixels: images.Pixels) -> str:
    text = string(value, f"the {mime} output", TEXT_LIMIT)
    try:
        raw = base64.b64decode(text.replace("\n", ""), validate=True)
    except (binascii.Error, ValueError):
        raise Bad(f"the {mime} output is not base64") from None
    if not raw.startswith(IMAGES[mime]):
        raise Bad(f"the {mime} output is not a {mime.split('/')[1].upper()} image")
    images.check(raw, f"{mime} output", pixels)
    return text


def _shallow(value: Any, mime: str) -> Any:
    """``value`` if it nests at most MAX_DEPTH levels, else Bad."""
    todo = [(value, 0)]
    while todo:
        v, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise Bad(f"the {mime} output is nested deeper than {MAX_DEPTH} levels")
        if isinstance(v, dict):
            todo.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            todo.extend((x, depth + 1) for x in v)
    return value


# a MIME type not shown at all, a value of one too big to clean, or an image too big to decode
Dropped = str | TooMuchMarkup | images.Refused


def bundle(data: Any, trusted: bool, markdown: MarkdownAllowance | None = None,
           pixels: images.Pixels | None = None) -> tuple[dict[str, Any], list[Dropped]]:
    """Check a MIME bundle and make it safe; returns (bundle, what was dropped).
    ``markdown``, ``pixels``: what the cell may still have rendered, and its images still
    declare (None: one bundle's worth)."""
    data = mapping(data, "a display bundle", 64)
    out: dict[str, Any] = {}
    dropped: list[Dropped] = []
    refused: list[images.Refused | TooMuchMarkup] = []
    _IMAGES.refused, _IMAGES.pixels, _IMAGES.svg_elements = refused, pixels or images.Allowance(), MARKUP_ELEMENTS
    try:
        for mime, value in data.items():
            if not isinstance(mime, str) or not MIME_RE.fullmatch(mime):
                raise Bad(f"a display bundle has a bad MIME type {shown(mime)}")
            try:
                _one(out, dropped, mime, value, trusted, markdown)
            except (TooMuchMarkup, images.Refused) as exc:
                dropped.append(exc)
        if "text/html" in out and "text/markdown" in data and "text/html" in data and not trusted:
            try:
                out["text/html"] = clean_html(string(data["text/html"], "the text/html output", TEXT_LIMIT))
            except TooMuchMarkup as exc:
                del out["text/html"]
                dropped.append(exc)
    finally:
        _IMAGES.refused = _IMAGES.pixels = _IMAGES.svg_elements = None
    dropped.extend(refused)
    if "text/html" in out and not trusted:
        out["text/html"] = inert(out["text/html"])
    return out, dropped


def _one(out: dict[str, Any], dropped: list[Dropped], mime: str, value: Any, trusted: bool,
         markdown: MarkdownAllowance | None) -> None:
    """One MIME type of a bundle, checked into ``out`` (or named in ``dropped``)."""
    if trusted:
        out[mime] = value if not isinstance(value, str) else string(value, mime, TEXT_LIMIT)
    elif mime not in ALLOWED:
        dropped.append(mime)
    elif mime in IMAGES:
        out[mime] = _image(mime, value, _IMAGES.pixels)
    elif mime == "text/plain":
        out[mime] = string(value, "the text/plain output", TEXT_LIMIT)
    elif mime == "application/json":
        out[mime] = _shallow(value, mime)  # a JSON tree: text only (decoded fresh, bounded by the frame)
    elif mime == PLOTLY:
        out[mime] = figures.figure(value, _IMAGES.pixels)
    elif mime == "text/html":
        out[mime] = clean_html(string(value, "the text/html output", TEXT_LIMIT))
    elif mime == "text/markdown":
        text = string(value, "the text/markdown output", TEXT_LIMIT)
        if (markdown or MarkdownAllowance()).take(text):
            out.setdefault("text/html", markdown_to_html(text))
    elif mime == "image/svg+xml":
        out[mime] = clean_svg(string(value, "the image/svg+xml output", TEXT_LIMIT))
