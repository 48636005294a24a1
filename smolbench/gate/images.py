"""Images from a machine, refused when a browser tab decoding them could run out of memory.

A browser decodes an image into width x height x 4 bytes whatever its file size: a 100-byte
PNG whose header says 60,000 x 60,000 asks the tab for 14 GB, and a notebook that saved the
output freezes the tab again each time it is opened. So each image's declared size is read
from its header and refused past ``MAX_PIXELS`` or ``MAX_SIDE``, and so is one whose header
can't be read. A cell's images also share ``CELL_PIXELS``: each of a thousand 1-pixel
``<img>`` tags may name a 50-megapixel image, and the tab decodes every one in view.

Only the header fields are read, here in Python, rather than handing attacker bytes to a big
C image library on the host (Pillow's decoders have had memory-safety CVEs; nothing here
needs pixels). The fields are those browsers size their buffers by: PNG's IHDR, which must be
the first chunk (APNG frames must lie inside it, else browsers refuse the file); a JPEG's
first SOFn, found by walking its segments strictly (libjpeg refuses a second SOF); a GIF's
logical screen and every image descriptor (a frame past the screen grows the canvas); a
WebP's VP8, VP8L or VP8X (canvas) header. A ``data:`` URL's payload is decoded here, its
format told by its bytes (as browsers sniff it, whatever type the URL names) and it is
written back as base64 of exactly the bytes checked.
"""

from __future__ import annotations

import base64
import binascii
import re
import struct
import threading
import urllib.parse
from typing import Protocol

# 50 megapixels is 200 MB decoded (RGBA): a tab survives it, and matplotlib's largest
# everyday output (a 24 x 18 inch figure at dpi 300: 7,200 x 5,400, 39 MP) fits.
MAX_PIXELS = 50_000_000
# A side past 2^15 is past what browsers' graphics surfaces take in one piece; no plot needs it.
MAX_SIDE = 32_768
# What one cell's images may declare in all (1 GB decoded; clear_output frees it again):
# 200 displays of everyday plots (640 x 480) are 61 MP.
CELL_PIXELS = 250_000_000
LIMIT = f"the limit of {MAX_PIXELS // 1_000_000} megapixels and {MAX_SIDE:,} pixels a side"
MAGIC = {"png": b"\x89PNG\r\n\x1a\n", "jpeg": b"\xff\xd8\xff", "gif": b"GIF8", "webp": b"RIFF"}
DATA_URL = re.compile(r"data:([^,]*),(.*)", re.IGNORECASE | re.DOTALL)
BASE64 = re.compile(rb"[A-Za-z0-9+/]*")
# JPEG markers: SOFn (C4 DHT, C8 JPG and CC DAC share the range but are not frames), and those without a length
SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
NO_LENGTH = frozenset({0x01, *range(0xD0, 0xD8)})


class Refused(ValueError):
    """An image not shown; the message names it, its size if known, and why."""


class Allowance:
    """Pixels one cell's images may still declare: a cell's own, or one a fork's branches share
    (they show in one output area: 16 branches each at the cell's allowance were 16 GB decoded).
    Taken from the gate's checker threads, so under a lock."""

    def __init__(self, left: int = CELL_PIXELS) -> None:
        self.left = left
        self._lock = threading.Lock()

    def take(self, pixels: int) -> bool:
        with self._lock:
            if pixels > self.left:
                return False
            self.left -= pixels
            return True

    def give_back(self, pixels: int) -> None:
        """Images that were taken from it are off the page again (a display an update redrew)."""
        with self._lock:
            self.left += pixels


class Pixels(Protocol):
    """What a bundle's images take their sizes from: an :class:`Allowance`, or a :class:`Tally` of one."""

    def take(self, pixels: int) -> bool: ...


class Tally:
    """What one display's images took of ``of`` (its cell's allowance), counted: an update of
    the display gives that back, as its images are then off the page."""

    def __init__(self, of: Pixels) -> None:
        self.of = of
        self.taken = 0

    def take(self, pixels: int) -> bool:
        if not self.of.take(pixels):
            return False
        self.taken += pixels
        return True


class Unreadable(ValueError):
    """A header that can't be read (one line: what is wrong)."""


def _png(raw: bytes) -> tuple[int, int]:
    if len(raw) < 33:
        raise Unreadable("its header is cut short")
    length, kind = struct.unpack(">I4s", raw[8:16])
    if kind != b"IHDR" or length != 13:
        raise Unreadable("its first chunk is not IHDR")
    return struct.unpack(">II", raw[16:24])


def _jpeg(raw: bytes) -> tuple[int, int]:
    at = 2
    while True:
        if at >= len(raw) or raw[at] != 0xFF:
            raise Unreadable("its segments end before its frame header" if at >= len(raw) else "a segment is malformed")
        while at < len(raw) and raw[at] == 0xFF:  # fill bytes before a marker
            at += 1
        if at >= len(raw):
            raise Unreadable("its segments end before its frame header")
        marker = raw[at]
        at += 1
        if marker in NO_LENGTH:
            continue
        if marker in (0x00, 0xD8, 0xD9, 0xDA):  # stuffed byte, a second SOI, EOI or scan data before any frame
            raise Unreadable("it has no frame header before its image data")
        if at + 2 > len(raw):
            raise Unreadable("its segments end before its frame header")
        (length,) = struct.unpack(">H", raw[at:at + 2])
        if length < 2:
            raise Unreadable("a segment is malformed")
        if marker in SOF:
            if length < 8 or at + 7 > len(raw):
                raise Unreadable("its frame header is cut short")
            height, width = struct.unpack(">HH", raw[at + 3:at + 7])
            return width, height
        at += length


def _gif(raw: bytes) -> tuple[int, int]:
    if len(raw) < 13 or raw[:6] not in (b"GIF87a", b"GIF89a"):
        raise Unreadable("its header is cut short" if len(raw) < 13 else "it is not GIF87a or GIF89a")
    width, height, flags = struct.unpack("<HHB", raw[6:11])
    at = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    while True:
        if at >= len(raw):
            raise Unreadable("it ends before its trailer")
        block = raw[at]
        if block == 0x3B:
            return width, height
        if block == 0x2C:
            if at + 10 > len(raw):
                raise Unreadable("an image descriptor is cut short")
            left, top, w, h, flags = struct.unpack("<HHHHB", raw[at + 1:at + 10])
            width, height = max(width, left + w), max(height, top + h)  # a frame past the screen grows it
            at += 10 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0) + 1  # colour table, LZW code size
        elif block == 0x21:
            at += 2  # introducer and label
        else:
            raise Unreadable(f"an unknown block {block:#04x}")
        while True:  # sub-blocks up to an empty one
            if at >= len(raw):
                raise Unreadable("it ends before its trailer")
            if raw[at] == 0:
                at += 1
                break
            at += 1 + raw[at]


def _webp(raw: bytes) -> tuple[int, int]:
    if len(raw) < 25 or raw[8:12] != b"WEBP":
        raise Unreadable("its header is cut short" if len(raw) < 25 else "it is a RIFF file but not WebP")
    kind, body = raw[12:16], raw[20:30]
    if kind != b"VP8L" and len(body) < 10:
        raise Unreadable("its header is cut short")
    if kind == b"VP8 " and body[3:6] == b"\x9d\x01\x2a":
        w, h = struct.unpack("<HH", body[6:10])
        return w & 0x3FFF, h & 0x3FFF
    if kind == b"VP8L" and body[0] == 0x2F:
        (bits,) = struct.unpack("<I", body[1:5])
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if kind == b"VP8X":
        return 1 + int.from_bytes(body[4:7], "little"), 1 + int.from_bytes(body[7:10], "little")
    raise Unreadable("its first chunk is not a VP8, VP8L or VP8X header")


READERS = {"png": _png, "jpeg": _jpeg, "gif": _gif, "webp": _webp}


def sniff(raw: bytes) -> str | None:
    """The format a browser would decode ``raw`` as (of those read here), or None."""
    return next((fmt for fmt, magic in MAGIC.items() if raw.startswith(magic)), None)


def check(raw: bytes, what: str, pixels: Pixels | None = None) -> None:
    """Refused unless ``raw`` (an image of a format ``sniff`` knows) declares a size a tab can
    decode, and (with ``pixels``) one the cell's allowance still has; ``what`` names it."""
    fmt = sniff(raw)
    if fmt is None:
        raise Refused(f"{what} (not a PNG, JPEG, GIF or WebP image)")
    try:
        width, height = READERS[fmt](raw)
    except Unreadable as exc:
        raise Refused(f"{what} (its size can't be read: {exc})") from None
    if width == 0 or height == 0:
        raise Refused(f"{what} (its size can't be read: it declares {width:,} x {height:,} pixels)")
    if width * height > MAX_PIXELS or width > MAX_SIDE or height > MAX_SIDE:
        raise Refused(f"{what} ({width:,} x {height:,} pixels, over {LIMIT})")
    if pixels is not None and not pixels.take(width * height):
        raise Refused(f"{what} ({width:,} x {height:,} pixels: the cell's images pass "
                      f"{CELL_PIXELS // 1_000_000} megapixels in all)")


def _forgiving_base64(text: bytes) -> bytes | None:
    """Bytes of base64 ``text`` as a browser reads a data: URL's (spaces dropped, padding optional)."""
    text = re.sub(rb"[\t\n\f\r ]", b"", text)
    if len(text) % 4 == 0 and text.endswith(b"="):
        text = text[:-2] if text.endswith(b"==") else text[:-1]
    if len(text) % 4 == 1 or not BASE64.fullmatch(text):
        return None
    try:
        return base64.b64decode(text + b"=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        return None


def data_bytes(url: str, what: str) -> bytes:
    """The bytes of ``url``, a ``data:`` URL, as a browser reads them (Refused when it can't)."""
    m = DATA_URL.fullmatch(url.strip())
    if m is None:
        raise Refused(f"{what} (not a data: URL)")
    body = urllib.parse.unquote_to_bytes(m.group(2))
    raw = _forgiving_base64(body) if m.group(1).strip().lower().endswith(";base64") else body
    if raw is None:
        raise Refused(f"{what} (its base64 is malformed)")
    return raw


def data_url(url: str, what: str = "an image in a data: URL", pixels: Pixels | None = None) -> str:
    """``url``, a ``data:`` image URL, as base64 of the bytes checked (Refused when they are
    not an image of a size a tab can decode, or can't be read)."""
    raw = data_bytes(url, what)
    check(raw, what, pixels)
    return f"data:image/{sniff(raw)};base64,{base64.b64encode(raw).decode()}"
