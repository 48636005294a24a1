"""Inline CSS from a machine, cut down to declarations that style only their own element.

A ``style`` attribute is parsed with tinycss2 (CSS Syntax Level 3, the tokenizer a browser
uses: a newline ends a string as a bad-string token and parsing goes on after it), and a
declaration is kept only when its property is on an allow-list (colours, fonts, text, box
sizes, borders, tables) and every token of its value is a plain one: an identifier, a
number, a percentage, a length in a unit of ``UNITS``, a hex colour, a string, ``,`` or
``/``, or a colour or gradient function made of the same. So no ``url()``, ``image-set()``,
``var()``, at-rules, blocks, comments, ``!important``, bad strings or bad URLs (nothing is
fetched), no ``position``, ``transform``, ``z-index``, negative margins or viewport units
(nothing is drawn outside the output), and no backslash anywhere in a declaration's source
(an escape can spell any name). What is kept is re-serialized from the checked tokens, so
the browser parses exactly what was checked. ``<style>`` blocks are dropped by the HTML
cleaner: a rule there could style the whole page.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import tinycss2
from tinycss2 import ast

PROPERTIES = frozenset({
    "color", "background-color", "background", "opacity", "visibility",
    "font", "font-family", "font-size", "font-style", "font-weight", "font-variant",
    "text-align", "text-decoration", "text-decoration-line", "text-decoration-color", "text-decoration-style",
    "text-transform", "text-indent", "text-overflow", "vertical-align", "white-space", "word-break", "word-wrap",
    "overflow-wrap", "letter-spacing", "word-spacing", "line-height", "direction", "unicode-bidi",
    "width", "height", "min-width", "max-width", "min-height", "max-height", "box-sizing", "display",
    "overflow", "overflow-x", "overflow-y", "float", "clear",
    "margin", "margin-top", "margin-right", "margin-bottom", "margin-left",
    "padding", "padding-top", "padding-right", "padding-bottom", "padding-left",
    "border", "border-top", "border-right", "border-bottom", "border-left", "border-color", "border-style",
    "border-width", "border-radius", "border-collapse", "border-spacing",
    "border-top-color", "border-right-color", "border-bottom-color", "border-left-color",
    "border-top-style", "border-right-style", "border-bottom-style", "border-left-style",
    "border-top-width", "border-right-width", "border-bottom-width", "border-left-width",
    "list-style-type", "list-style-position", "table-layout", "caption-side", "empty-cells",
    # SVG presentation
    "fill", "fill-opacity", "fill-rule", "stroke", "stroke-width", "stroke-opacity", "stroke-dasharray",
    "stroke-linecap", "stroke-linejoin", "text-anchor", "dominant-baseline", "stop-color", "stop-opacity",
})
# Properties where a negative length would move the element over its neighbours.
NO_NEGATIVE = ("margin", "text-indent", "letter-spacing", "word-spacing")
# Lengths relative to the element, its font or absolute; angles (for hsl() and gradients).
# No viewport units: they size an element by the window, not by its output.
UNITS = frozenset({"px", "em", "rem", "ex", "ch", "pt", "pc", "cm", "mm", "in", "q", "deg", "rad", "grad", "turn"})
COLOURS = frozenset({"rgb", "rgba", "hsl", "hsla"})
GRADIENTS = frozenset({"linear-gradient", "radial-gradient", "repeating-linear-gradient",
                       "repeating-radial-gradient"})
IDENT = re.compile(r"-?[A-Za-z_][A-Za-z0-9_-]*")
HEX = re.compile(r"[0-9A-Fa-f]{3,4}|[0-9A-Fa-f]{6}|[0-9A-Fa-f]{8}")
LIMIT = 16 * 1024  # characters of one style attribute (a long one is dropped whole)
MAX_NESTING = 16  # brackets in a kept style: rgb(...) inside a gradient is 2
# CSS functions that take an image, so a URL, some as a plain string (mask="image-set('...' 1x)"):
# what an SVG attribute or a plotly string must not name (they are CSS values, not declarations)
CSS_IMAGE = re.compile(r"(url|image|image-set|cross-fade|element|src|paint)\(")


def _plain(tokens: Iterable[ast.Node], negative_ok: bool, functions: frozenset[str]) -> bool:
    """Whether every token is one a kept value may hold (``functions``: the calls allowed here)."""
    for t in tokens:
        if isinstance(t, ast.WhitespaceToken | ast.StringToken):
            continue
        if isinstance(t, ast.IdentToken):
            if not IDENT.fullmatch(t.value):
                return False
        elif isinstance(t, ast.NumberToken | ast.PercentageToken | ast.DimensionToken):
            if isinstance(t, ast.DimensionToken) and t.lower_unit not in UNITS:
                return False
            if t.value < 0 and not negative_ok:
                return False
        elif isinstance(t, ast.HashToken):
            if not HEX.fullmatch(t.value):
                return False
        elif isinstance(t, ast.LiteralToken):
            if t.value not in (",", "/"):
                return False
        elif isinstance(t, ast.FunctionBlock):
            inner = COLOURS if t.lower_name in GRADIENTS else frozenset()
            if t.lower_name not in functions or not _plain(t.arguments, True, inner):
                return False
        else:
            return False  # url, bad-string, bad-url, comment, block, at-keyword, unicode-range, ...
    return True


def _depth(css: str) -> int:
    """How deep brackets nest in ``css`` (an over-estimate: brackets in strings count too)."""
    depth = top = 0
    for ch in css:
        if ch in "([{":
            depth += 1
            top = max(top, depth)
        elif ch in ")]}" and depth:
            depth -= 1
    return top


def _offsets(css: str) -> list[int]:
    """Where each line starts in tinycss2's view of ``css`` (its newlines normalised)."""
    return [0, *(i + 1 for i, c in enumerate(css) if c == "\n")]


def _start(lines: list[int], node: ast.Node) -> int:
    """The index in the source where ``node`` starts."""
    return lines[node.source_line - 1] + node.source_column - 1


def declarations(style: str) -> list[tuple[str, str]]:
    """The safe declarations of ``style`` as (property, re-serialized value)."""
    if len(style) > LIMIT or _depth(style) > MAX_NESTING:
        return []  # (tinycss2 and its serializer recurse per bracket: 500 deep was a RecursionError)
    # tinycss2 counts lines and columns after this normalisation; slices must too
    norm = style.replace("\0", "\ufffd").replace("\r\n", "\n").replace("\r", "\n").replace("\f", "\n")
    lines = _offsets(norm)
    nodes = tinycss2.parse_blocks_contents(norm)
    kept = []
    for i, node in enumerate(nodes):
        if not isinstance(node, ast.Declaration):
            continue  # rules, at-rules, comments, errors: never in a style attribute
        end = _start(lines, nodes[i + 1]) if i + 1 < len(nodes) else len(norm)
        raw = norm[_start(lines, node):end]
        name = node.lower_name
        if "\\" in raw or node.important or name not in PROPERTIES:
            continue
        value = tinycss2.serialize(node.value).strip()
        if value and _plain(node.value, not name.startswith(NO_NEGATIVE), COLOURS | GRADIENTS):
            kept.append((name, value))
    return kept


def clean_style(style: str) -> str | None:
    """The safe declarations of a ``style`` attribute, re-serialized, or None when none is left."""
    try:
        return "; ".join(f"{name}: {value}" for name, value in declarations(style)) or None
    except Exception:  # nh3 calls this for every attribute: an error there is printed, not raised
        return None
