"""The gate's CSS and plotly-text checks as they were before issue 25, kept only so tests
can show that each attack got past them (the weakened contrast). Never used by smolbench.
"""
# ruff: noqa
from __future__ import annotations

import re

from smolbench.gate.css import PROPERTIES

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


# -- smolbench/gate/figures.py: the pseudo-HTML attribute pattern, before --------------------

ATTR = re.compile(r"""(\s)(style|href|target)\s*=\s*("[^"]*"|'[^']*'|[^\s>]*)""", re.IGNORECASE)
ABSOLUTE_LINK = re.compile(r"(https?://[^\s\"'<>]+|mailto:[^\s\"'<>]+)", re.IGNORECASE)

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


