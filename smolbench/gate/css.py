"""Inline CSS from a machine, cut down to properties that style only their own element.

A ``style`` attribute keeps only declarations whose property is on an allow-list (colours,
fonts, text, box sizes, borders, tables) and whose value calls no function but colours and
gradients: no ``url()``, ``image-set()``, ``@import``, escapes or comments (so nothing is
fetched), no ``position``, ``transform``, ``z-index`` or negative margins (so nothing is
drawn outside the output). ``<style>`` blocks are dropped by the HTML cleaner: a rule there
could style the whole page.
"""

from __future__ import annotations

import re

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
FUNCTIONS = frozenset({"rgb", "rgba", "hsl", "hsla", "linear-gradient", "radial-gradient",
                       "repeating-linear-gradient", "repeating-radial-gradient"})
FUNCTION = re.compile(r"([A-Za-z_-][\w-]*)\s*\(")
# Never in a kept value: escapes (they can spell any name), comments, at-rules, markup, braces.
FORBIDDEN = re.compile(r"[\\<>@{}!]|/\*|&#", re.ASCII)
PROPERTY = re.compile(r"-?[a-z][a-z-]*")


def _split(style: str) -> list[str]:
    """Declarations separated by ``;`` outside quotes and parentheses."""
    out: list[str] = []
    cur: list[str] = []
    depth, quote = 0, ""
    for ch in style:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(0, depth - 1)
        elif ch == ";" and depth == 0:
            out.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    out.append("".join(cur))
    return out


def declaration(prop: str, value: str) -> bool:
    """Whether ``prop: value`` styles only its own element and fetches nothing."""
    if prop not in PROPERTIES or FORBIDDEN.search(value):
        return False
    if any(f.lower() not in FUNCTIONS for f in FUNCTION.findall(value)):
        return False  # url(), image-set(), -webkit-image-set(), image(), element(), var(), ...
    if "url" in value.lower() and "(" in value:
        return False  # belt and braces: u\rl( is refused above, url ( here
    return not (prop.startswith(NO_NEGATIVE) and "-" in value)


def clean_style(style: str) -> str | None:
    """The safe declarations of a ``style`` attribute, or None when none is left."""
    if len(style) > 64 * 1024:
        return None
    kept = []
    for decl in _split(style):
        prop, sep, value = decl.partition(":")
        prop, value = prop.strip().lower(), value.strip()
        if sep and value and PROPERTY.fullmatch(prop) and declaration(prop, value):
            kept.append(f"{prop}: {value}")
    return "; ".join(kept) or None
