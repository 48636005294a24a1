"""Images a machine shows are refused when their declared size would freeze the user's tab.

The attack: a 100-byte PNG (or GIF, JPEG, WebP) whose header says 60,000 x 60,000 makes the
browser allocate 14 GB to decode it; the tab dies, and again each time the saved notebook is
opened. Before: the gate checked only the magic bytes, so every bomb here was shown.
"""

from __future__ import annotations

import base64
import io
import struct
import urllib.parse
import zlib
from typing import Any

import pytest

from smolbench.gate import display, figures

BIG = 60_000


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_bomb(width: int = BIG, height: int = BIG) -> bytes:
    """A valid-looking PNG of a few dozen bytes that declares ``width`` x ``height``."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0")) + _chunk(b"IEND", b"")


def _sof(width: int, height: int) -> bytes:
    return b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, height, width, 3) + b"\x01\x11\x00\x02\x11\x00\x03\x11\x00"


def jpeg_bomb() -> bytes:
    """A JPEG whose APP1 holds a small (thumbnail-like) frame header ahead of the real, huge one:
    a scan for the first ``FF C0`` finds the small one, a walk of the segments the real one."""
    decoy = _sof(16, 16)
    app1 = b"\xff\xe1" + struct.pack(">H", 2 + len(decoy)) + decoy
    return b"\xff\xd8" + app1 + _sof(BIG, BIG) + b"\xff\xda\x00\x08\x01\x01\x00\x00\x3f\x00" + b"\0" * 8 + b"\xff\xd9"


def gif(screen: tuple[int, int], frame: tuple[int, int, int, int]) -> bytes:
    """A GIF with a ``screen`` and one frame (left, top, width, height)."""
    head = b"GIF89a" + struct.pack("<HHBBB", *screen, 0x80, 0, 0) + b"\0\0\0\xff\xff\xff"
    ext = b"\x21\xf9\x04\x00\x00\x00\x00\x00"
    return head + ext + b"\x2c" + struct.pack("<HHHHB", *frame, 0) + b"\x02\x02\x44\x01\x00" + b"\x3b"


def webp_bomb() -> bytes:
    """A WebP whose VP8X canvas is 60,000 x 60,000."""
    vp8x = b"VP8X" + struct.pack("<I", 10) + b"\0" * 4 + (BIG - 1).to_bytes(3, "little") * 2
    return b"RIFF" + struct.pack("<I", 4 + len(vp8x)) + b"WEBP" + vp8x


def real(fmt: str, size: tuple[int, int] = (64, 48), **save: Any) -> bytes:
    from PIL import Image  # a test dependency: the gate itself never decodes pixels

    out = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(out, format=fmt, **save)
    return out.getvalue()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _shown(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    out, dropped = display.bundle(data, trusted=False)
    return out, [str(d) for d in dropped]


def test_a_matplotlib_figure_passes_unchanged_even_a_big_one_at_dpi_300() -> None:
    plt = pytest.importorskip("matplotlib.pyplot")
    for figsize, dpi in (((6.4, 4.8), 100), ((24, 18), 300)):  # 640 x 480; 7,200 x 5,400 (39 MP)
        fig = plt.figure(figsize=figsize)
        fig.gca().plot([1, 3, 2])
        raw = io.BytesIO()
        fig.savefig(raw, format="png", dpi=dpi)
        plt.close(fig)
        value = b64(raw.getvalue())
        assert _shown({"image/png": value, "text/plain": "<Figure>"}) == ({"image/png": value, "text/plain": "<Figure>"}, [])


def test_real_images_of_each_format_pass_unchanged() -> None:
    for mime, raw in (("image/png", real("PNG")), ("image/jpeg", real("JPEG")), ("image/jpeg", real("JPEG", progressive=True)),
                      ("image/gif", real("GIF"))):
        assert _shown({mime: b64(raw)}) == ({mime: b64(raw)}, []), mime
    for fmt, raw in (("webp", real("WEBP")), ("webp", real("WEBP", lossless=True)), ("png", real("PNG")),
                     ("gif", real("GIF")), ("jpeg", real("JPEG"))):
        html = f'<img src="data:image/{fmt};base64,{b64(raw)}" alt="x">'
        assert f'src="data:image/{fmt};base64,{b64(raw)}"' in display.clean_html(html)


@pytest.mark.parametrize(("mime", "raw", "size"), [
    ("image/png", png_bomb(), "60,000 x 60,000 pixels"),
    ("image/png", png_bomb(40_000, 1), "40,000 x 1 pixels"),  # one side past the limit
    ("image/jpeg", jpeg_bomb(), "60,000 x 60,000 pixels"),
    ("image/gif", gif((BIG, BIG), (0, 0, 1, 1)), "60,000 x 60,000 pixels"),  # the logical screen
    ("image/gif", gif((1, 1), (0, 0, 20_000, 20_000)), "20,000 x 20,000 pixels"),  # a frame grows the canvas
], ids=["png", "png-wide", "jpeg", "gif-screen", "gif-frame"])
def test_image_bombs_are_dropped_with_a_note_naming_their_size_and_the_limit(mime: str, raw: bytes, size: str) -> None:
    assert len(raw) < 200
    out, dropped = _shown({mime: b64(raw), "text/plain": "<Image>"})
    assert out == {"text/plain": "<Image>"}  # the rest of the bundle still shows
    assert dropped == [f"{mime} output ({size}, over the limit of 50 megapixels and 32,768 pixels a side)"]


@pytest.mark.parametrize(("mime", "raw", "why"), [
    ("image/png", real("PNG")[:20], "its header is cut short"),
    ("image/png", real("PNG")[:8] + _chunk(b"tEXt", b"a\0b") + real("PNG")[8:], "its first chunk is not IHDR"),
    ("image/jpeg", real("JPEG")[:40], "its segments end before its frame header"),
    ("image/jpeg", b"\xff\xd8\xff\xe0\x00\x02\xff\xda\x00\x02", "it has no frame header before its image data"),
    ("image/gif", real("GIF")[:10], "its header is cut short"),
    ("image/gif", real("GIF")[:-1], "it ends before its trailer"),
], ids=["png-short", "png-not-ihdr", "jpeg-short", "jpeg-no-frame", "gif-short", "gif-no-trailer"])
def test_images_whose_size_cant_be_read_are_dropped(mime: str, raw: bytes, why: str) -> None:
    out, dropped = _shown({mime: b64(raw)})
    assert out == {} and dropped == [f"{mime} output (its size can't be read: {why})"]


BOMBS = {"png": png_bomb(), "jpeg": jpeg_bomb(), "gif": gif((BIG, BIG), (0, 0, 1, 1)), "webp": webp_bomb()}


@pytest.mark.parametrize("fmt", BOMBS)
def test_data_url_bombs_in_html_and_markdown_lose_their_src_with_a_note(fmt: str) -> None:
    raw = BOMBS[fmt]
    good = f"data:image/png;base64,{b64(real('PNG'))}"
    urls = [f"data:image/{fmt};base64,{b64(raw)}",
            f"data:image/gif;base64,{b64(raw)}",  # the browser sniffs the bytes, not the type named
            f"data:image/{fmt},{urllib.parse.quote_from_bytes(raw)}",  # URL-encoded, not base64
            f"data:image/{fmt};base64,{urllib.parse.quote(b64(raw))}"]  # base64, percent-encoded on top
    for url in urls:
        for data in ({"text/html": f'<p><img src="{url}" alt="bomb"><img src="{good}"></p>'},
                     {"text/markdown": f"![bomb]({url}) ![ok]({good})"}):
            out, dropped = _shown(data)
            html = out["text/html"]
            assert html.count("<img") == 2 and html.count("src=") == 1 and f'src="{good}"' in html, (url, html)
            assert dropped == ["an image in its HTML (60,000 x 60,000 pixels, over the limit of 50 megapixels "
                               "and 32,768 pixels a side)"], (url, dropped)


def test_unreadable_data_urls_lose_their_src() -> None:
    for url in ("data:image/png;base64,iVBORw0KGgo=",  # the PNG signature alone
                "data:image/png;base64,!!!!", f"data:image/png;base64,{b64(b'BM' + bytes(60))}"):  # a BMP: not read here
        out, dropped = _shown({"text/html": f'<img src="{url}">'})
        assert "src=" not in out["text/html"] and len(dropped) == 1, url


def test_css_can_not_carry_a_data_image_at_all() -> None:
    url = f"data:image/png;base64,{b64(png_bomb())}"
    for style in (f"background: url({url})", f"background: url('{url}')", f"background-image: image-set('{url}' 1x)"):
        html = display.clean_html(f'<p style="color: red; {style}">x</p>')
        assert "data:" not in html and "color: red" in html, html



def test_a_plotly_image_source_that_is_a_bomb_is_dropped() -> None:
    good = f"data:image/png;base64,{b64(real('PNG'))}"
    fig = {"data": [{"type": "image", "source": f"data:image/png;base64,{b64(png_bomb())}"}],
           "layout": {"images": [{"source": f"data:image/webp;base64,{b64(webp_bomb())}"}, {"source": good}]}}
    out = figures.figure(fig)
    assert "source" not in out["data"][0] and out["layout"]["images"] == [{}, {"source": good}]


def test_a_cells_images_share_one_allowance_so_many_big_ones_cant_add_up() -> None:
    """The attack: 1-pixel <img> tags each naming a 49-megapixel image, all in view at once,
    so the tab decodes each (200 MB) whatever size it is drawn at."""
    url = f"data:image/png;base64,{b64(png_bomb(7_000, 7_000))}"
    out, dropped = _shown({"text/html": f'<img src="{url}" style="width: 1px">' * 6})
    assert out["text/html"].count("src=") == 5  # 245 MP; the sixth would pass 250
    assert dropped == ["an image in its HTML (7,000 x 7,000 pixels: the cell's images pass 250 megapixels in all)"]


def _cell(messages: list[dict[str, Any]], pixels: Any = None) -> tuple[list[Any], list[str]]:
    """What the gate shows of a cell's ``messages``: its displays' bundles and its notes
    (``pixels``: a fork's allowance, shared by its branches)."""
    import asyncio
    import json

    from smolbench.backends.base import CellRequest
    from smolbench.gate import read_cell

    events: list[Any] = []

    async def frames():  # type: ignore[no-untyped-def]
        for m in [*messages, {"t": "done", "status": "ok"}]:
            yield json.dumps(m).encode() + b"\n"

    asyncio.run(read_cell(frames(), CellRequest("x", pixels=pixels), events.append, "root", scope="t"))
    return ([dict(e.data) for e in events if e.kind == "display"],
            [e.text for e in events if e.kind == "stream" and e.note])


def test_the_cells_allowance_is_freed_by_a_clear_and_a_live_plots_updates_replace_its_image() -> None:
    big = {"image/png": b64(png_bomb(7_000, 7_000))}
    live = [{"t": "display", "data": big, "id": "plot", "update": True}] * 20  # a live plot redrawn 20 times
    shown, notes = _cell([*[{"t": "display", "data": big}] * 6, {"t": "clear", "wait": True},
                          {"t": "display", "data": big, "id": "plot"}, *live])
    assert [list(d) for d in shown] == [["image/png"]] * (5 + 1 + 20)  # not the sixth before the clear
    assert notes == ["smolbench: root sent image/png output (7,000 x 7,000 pixels: the cell's images pass 250 "
                     "megapixels in all), which was not shown (a browser tab decodes an image whole); "
                     "`%smol trust on` shows machine output raw\n"]


def _svg_srcs(html: str) -> list[bytes]:
    import re

    return [base64.b64decode(m) for m in re.findall(r'src="data:image/svg\+xml;base64,([^"]*)"', html)]


def test_an_svg_data_url_in_html_or_markdown_is_cleaned_so_it_cant_embed_a_raster_bomb() -> None:
    """The attack: an <img> whose src is a data:image/svg+xml URL passed unchecked, but an SVG
    drawn as an image still decodes the data: rasters its <image> names, at their full size."""
    bomb = f"data:image/png;base64,{b64(png_bomb())}"
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="100" height="100"><rect width="5" height="5" fill="red"/>'
           f'<image width="100" height="100" href="{bomb}" xlink:href="{bomb}"/></svg>')
    for url in (f"data:image/svg+xml;base64,{b64(svg.encode())}", f"data:image/svg+xml,{urllib.parse.quote(svg, safe='')}",
                f"data:image/svg+xml;charset=utf-8;base64,{urllib.parse.quote(b64(svg.encode()))}"):
        for data in ({"text/html": f'<img src="{url}">'}, {"text/markdown": f"![x]({url})"}):
            out, dropped = _shown(data)
            (shown_svg,) = _svg_srcs(out["text/html"])
            assert b"<image" not in shown_svg and b"data:" not in shown_svg and dropped == [], (url, shown_svg)
            assert shown_svg == display.clean_svg(svg).encode() and b'<rect width="5"' in shown_svg


def test_an_svg_data_url_whose_bytes_are_a_raster_image_is_refused() -> None:
    for raw in (png_bomb(), real("PNG"), jpeg_bomb(), gif((BIG, BIG), (0, 0, 1, 1)), webp_bomb()):
        out, dropped = _shown({"text/html": f'<img src="data:image/svg+xml;base64,{b64(raw)}" alt="x">'})
        assert "src=" not in out["text/html"] and len(dropped) == 1, dropped
        assert str(dropped[0]).startswith("an SVG image in its HTML (its bytes are a "), dropped


def test_a_plotly_figures_images_take_from_the_cells_allowance() -> None:
    """The attack: a figure's layout.images were checked one by one, never against the cell's
    allowance, so one figure carried 200 images of 49 megapixels (39 GB decoded)."""
    url = f"data:image/png;base64,{b64(png_bomb(7_000, 7_000))}"
    fig = {"data": [{"type": "image", "source": url}],
           "layout": {"images": [{"source": url, "x": 0, "y": 0, "sizex": 1, "sizey": 1} for _ in range(200)]}}
    out, dropped = display.bundle({"text/html": f'<img src="{url}">', "application/vnd.plotly.v1+json": fig},
                                  trusted=False)
    shown = out["application/vnd.plotly.v1+json"]
    kept = ["source" in shown["data"][0], *("source" in im for im in shown["layout"]["images"])]
    assert kept.count(True) + out["text/html"].count("src=") == 5, kept  # 245 MP in all, the figure's and the HTML's
    assert kept[:4] == [True] * 4 and kept[4:] == [False] * 197 and "src=" in out["text/html"]


def test_display_updates_take_from_the_cells_allowance_and_give_back_what_they_replace() -> None:
    """The attack: each update was checked against an allowance of its own, so a cell made 200
    empty displays with ids and updated each to a 49-megapixel image: 9.8 GP (39 GB) at once."""
    big = {"image/png": b64(png_bomb(7_000, 7_000))}
    empty = [{"t": "display", "data": {"text/plain": "."}, "id": f"d{i}"} for i in range(200)]
    bombs = [{"t": "display", "data": big, "id": f"d{i}", "update": True} for i in range(200)]
    shown, notes = _cell([*empty, *bombs])
    assert sum("image/png" in d for d in shown) == 5 and len(notes) == 1  # 245 MP; the rest are past 250
    # an update gives back what its display showed: five images off the page, five more fit
    again = [*[{"t": "display", "data": {"text/plain": "."}, "id": f"d{i}", "update": True} for i in range(5)],
             *[{"t": "display", "data": big, "id": f"d{i}", "update": True} for i in range(5, 11)]]
    shown, notes = _cell([*empty, *bombs, *again])
    assert sum("image/png" in d for d in shown) == 10 and "image/png" not in shown[-1]
    # an update of an earlier cell's display, redrawn again here, gives back its own drawing only
    redraws = [{"t": "display", "data": big, "id": "old", "update": True}] * 20
    shown, notes = _cell([*redraws, *[{"t": "display", "data": big}] * 5])
    assert sum("image/png" in d for d in shown) == 20 + 4 and len(notes) == 1
    # a branch's update shows as a new display (the one it names stays): it gives nothing back
    from smolbench.gate import images

    shown, notes = _cell(redraws, pixels=images.Allowance())
    assert sum("image/png" in d for d in shown) == 5 and len(notes) == 1
    # and a clear here leaves it on the page, counted
    shown, notes = _cell([*redraws, {"t": "clear", "wait": False}, *[{"t": "display", "data": big}] * 5])
    assert sum("image/png" in d for d in shown) == 20 + 4 and len(notes) == 1


def test_a_bundles_svg_images_share_one_values_elements() -> None:
    """Each SVG data: URL in HTML is cleaned by nh3, whose time grows with tags x depth: a
    frame held ~1,500 SVGs of 8,192 nested <ol> (0.3 s each)."""
    def url(n: int) -> str:
        return f"data:image/svg+xml;base64,{b64(('<svg>' + '<ol>' * n + '</svg>').encode())}"
    out, dropped = _shown({"text/html": f'<img src="{url(5_000)}">' * 3 + f'<img src="{url(3_000)}">'})
    assert out["text/html"].count("src=") == 2 and len(dropped) == 2  # 5,000 + 3,000 of 8,192
    assert str(dropped[0]) == ("an SVG image in its HTML (5,001 elements, past the 8,192 of a bundle's SVG images "
                               "in all)")
