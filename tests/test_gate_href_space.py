"""A link in a machine's HTML or markdown is absolute as the browser reads it (third audit:
the gate stripped Unicode spaces before its check, kept them in what it returned, and
``\\u00a0https://x/../../api/contents/secret.txt`` was a page-relative link into the server)."""

from __future__ import annotations

import re

import pytest

from smolbench.gate import display

URL_SPACE = "".join(map(chr, range(0x21)))
SPACES = ["\u00a0", "\u3000", "\u2028", "\u2029", "\x85", "\u2003", "\ufeff", "\u200b"]


def _kept(html: str, attr: str = "href") -> list[str]:
    import html as htmllib

    return [htmllib.unescape(v) for v in re.findall(rf'{attr}="([^"]*)"', display.clean_html(html))]


def _absolute_as_a_browser_reads_it(url: str) -> bool:
    """The URL standard: C0 controls and space stripped from both ends, tab and newline removed
    anywhere; then a scheme must come first."""
    url = re.sub("[\t\n\r]", "", url.strip(URL_SPACE))
    return re.match(r"(https?:|mailto:|#)", url, re.IGNORECASE) is not None


@pytest.mark.parametrize("space", SPACES)
@pytest.mark.parametrize("tag", ["a", "area"])
def test_a_unicode_space_before_an_absolute_url_makes_no_relative_link(space: str, tag: str) -> None:
    for value in (f"{space}https://x/../../api/contents/secret.txt", f"https://x/{space}", f"{space}#top"):
        for url in _kept(f'<{tag} href="{value}">docs</{tag}>'):
            assert _absolute_as_a_browser_reads_it(url), (value, url)


def test_what_a_url_parser_strips_is_taken_off_and_the_rest_kept_as_checked() -> None:
    assert _kept('<a href="\x01 https://example.org/a">x</a>') == ["https://example.org/a"]
    assert _kept('<a href="https://example.org/b">x</a>') == ["https://example.org/b"]


@pytest.mark.parametrize("space", SPACES)
def test_markdown_links_too(space: str) -> None:
    html = display.markdown_to_html(f"[docs]({space}https://x/../../api/contents/secret.txt) <{space}https://x/y>")
    for url in [v for v in re.findall(r'href="([^"]*)"', html)]:
        assert _absolute_as_a_browser_reads_it(url), url
