"""Issue 25 item 3: plotly text from a machine carries no attributes.

plotly.js draws every text field as pseudo-HTML and reads ``style``, ``href``, ``target`` and
``popup`` after whitespace *or a quote* (``<a x="b"href="/api/contents/secret.txt">``); the
old gate's pattern wanted whitespace first, and its ``url(`` check missed a CSS escape
(``\\75 rl(``). The audit's plot fetched three URLs (cursor, fill, -webkit-mask-image) and kept
a page-relative link in its legend, title and annotation. ``plotly_reads`` reads a string the
way plotly.js 3's svg_text_utils does (its regular expressions, copied); each attack goes
through the gate as it is and as it was (``gatebefore``, the weakened contrast), in every
string field of a figure.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from typing import Any

import gatebefore
import pytest

from smolbench.gate import figures

W = "http://127.0.0.1:1"
# plotly.js src/lib/svg_text_utils.js
SPLIT_TAGS = re.compile(r"(<[^<>]*>)")
ONE_TAG = re.compile(r"<(/?)([^ >]*)(\s+(.*))?>", re.IGNORECASE)
TAG_STYLES = {"sup", "sub", "s", "u", "b", "i", "a", "span", "em"}
ATTRS = {name: re.compile(rf"""(^|[\s"']){name}\s*=\s*("([^"]*)"|'([^']*)')""", re.IGNORECASE)
         for name in ("style", "href", "target", "popup")}
ABSOLUTE = re.compile(r"https?://[^/\s]+(/.*)?", re.IGNORECASE)


def plotly_reads(text: str) -> list[str]:
    """The attributes plotly.js would apply from ``text`` (and links that are not absolute)."""
    found = []
    for part in SPLIT_TAGS.split(re.sub(r"\r\n?|\n", " ", text)):
        m = ONE_TAG.match(part)
        if not m or m.group(2).lower() not in TAG_STYLES or m.group(1):
            continue
        for name, pattern in ATTRS.items():
            a = pattern.search(m.group(4) or "")
            value = a and (a.group(3) or a.group(4))
            if value and not (name == "href" and ABSOLUTE.fullmatch(figures._entities(value))):
                found.append(f"{name}={value}")
    return found


ATTACKS = [
    '<a x="b"href="/api/contents/secret.txt?content=1">secret</a>',
    f'<span x="a"style="cursor:\\75 rl({W}/cursor), auto">c</span>',
    f'<span x="a"style="fill:\\75 rl({W}/fill)">f</span>',
    f"<b x='a'style='-webkit-mask-image:\\000075rl({W}/mask)'>m</b>",
    f'<a href="https://example.org/"x="a"style="cursor:\\75 rl({W}/c2)">l</a>',
    "<a x='b'href='/files/secret.txt'>s</a>", '<a x="b"href="api/contents">r</a>',
    '<a x="b"href="//127.0.0.1:1/x">p</a>', '<span x="a"style="font-size:300px">big</span>',
    '<a href="https://example.org/"x="a"popup="width=10">pop</a>', '<a x="b"target="_self"href="/api/x">t</a>',
    '<a x=""HREF="/api/contents">u</a>', '<a x="b"href="&#47;api/contents/secret.txt">e</a>',
    '<em x="a"style="font-size:300px">em</em>', '<sup x="1"style="fill:red">s</sup>',
]
HELD = [
    '<a href="/api/contents/x">plain</a>', "<a\thref='/api/x'>tab</a>", '<a\nhref="/api/x">newline</a>',
    f'<span style="cursor: url({W}/c)">c</span>', '<a href="javascript:alert(1)">j</a>', '<a href=" /api/x">s</a>',
]
def _figure(s: str) -> dict[str, Any]:
    """A figure with ``s`` in every text field plotly draws."""
    return {
        "data": [{"type": "bar", "x": ["a", "b"], "y": [3, 5], "name": s, "text": [s, s], "hovertext": [s, s],
                  "hovertemplate": s + "<extra></extra>", "texttemplate": s, "meta": [s], "customdata": [[s], [s]],
                  "marker": {"colorbar": {"title": {"text": s}}}}],
        "layout": {"title": {"text": s}, "xaxis": {"title": {"text": s}, "tickvals": ["a"], "ticktext": [s]},
                   "legend": {"title": {"text": s}}, "annotations": [{"text": s, "x": "a", "y": 3}],
                   "updatemenus": [{"buttons": [{"label": s, "method": "relayout", "args": [{}]}]}],
                   "sliders": [{"steps": [{"label": s, "method": "relayout", "args": [{}]}]}],
                   "template": {"layout": {"title": {"text": s}}}},
        "frames": [{"layout": {"title": {"text": s}}}],
    }


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)
    elif isinstance(node, dict):
        for v in node.values():
            yield from _strings(v)


def _reads(fig: Any) -> list[str]:
    return [r for s in _strings(fig) for r in plotly_reads(s)]


@pytest.mark.parametrize("attack", ATTACKS)
def test_plotly_text_keeps_no_attribute_after_a_quote_or_an_escape(
        attack: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fig = _figure(attack)
    out = figures.figure(copy.deepcopy(fig))
    assert _reads(out) == [], out
    assert isinstance(out["layout"]["title"]["text"], str) and out["data"][0]["text"][1] == out["data"][0]["text"][0]
    for s in _strings(out):
        assert "/api/" not in s and "/files/" not in s and "127.0.0.1" not in s, s
    # Weakened: the same figure through the old text check keeps what plotly reads
    monkeypatch.setattr(figures, "_text", gatebefore._text)
    assert _reads(figures.figure(copy.deepcopy(fig))), "the old gate held this: not a contrast"


@pytest.mark.parametrize("attack", HELD)
def test_links_and_styles_the_old_gate_held_stay_held(attack: str) -> None:
    assert _reads(figures.figure(_figure(attack))) == []


@pytest.mark.parametrize(("text", "shown"), [
    ("<b>bold</b> <i>it</i><br>x<sup>2</sup> y<sub>i</sub>", "<b>bold</b> <i>it</i><br>x<sup>2</sup> y<sub>i</sub>"),
    ("<B>up</B><br /><BR>", "<b>up</b><br><br>"),
    ('<a href="https://example.org/a?b=1&amp;c=2" target="_self" style="fill:red">docs</a>',
     '<a href="https://example.org/a?b=1&amp;c=2">docs</a>'),
    ('<a x="b"href="/api/contents/secret.txt">secret</a> after', "secret after"),
    ('<span style="color:red">red</span>', '&lt;span style="color:red">red&lt;/span>'),
    ("a < b and c > d", "a &lt; b and c > d"),
    ("<script>x</script>", "&lt;script>x&lt;/script>"),
    ("%{y:.2f}<extra>%{x}</extra>", "%{y:.2f}<extra>%{x}</extra>"),
    ('<a href="https://ok.org/%{customdata[0]}">t</a>', "t"),  # no template substitution inside a tag
    ("</a>stray", "stray"),
    ("plain text & more", "plain text & more"),
])
def test_formatting_stays_exactly_and_everything_else_is_text(text: str, shown: str) -> None:
    assert figures._text(text) == shown


@pytest.mark.parametrize("value", [
    f"\\75 rl({W}/a)", f"\\000075rl({W}/a)", f"u\\rl({W}/a)", f"URL({W}/a)", f"image-set('{W}/a' 1x)",
    f"-webkit-image-set(url({W}/a) 1x)", f"\\69 mage-set('{W}/a' 1x)", f"cross-fade(url({W}/a))",
])
def test_strings_naming_a_css_image_are_dropped_wherever_they_are(value: str) -> None:
    fig = {"data": [{"type": "scatter", "marker": {"color": value, "symbol": value}, "line": {"dash": value}}],
           "layout": {"font": {"family": value}, "paper_bgcolor": value, "images": [{"source": f"{W}/i"}],
                      "template": {"layout": {"font": {"family": value}}}}}
    out = figures.figure(fig)
    assert W not in str(out), out
    assert out["layout"]["images"] == [{}]


def test_config_turns_math_typesetting_off_and_keeps_only_display_switches() -> None:
    out = figures.figure({"data": [], "config": {"topojsonURL": f"{W}/t", "typesetMath": True, "responsive": True}})
    assert out["config"] == {"responsive": True, "typesetMath": False}
