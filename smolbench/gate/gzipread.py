"""gzip data from someone else's file, read with bounded work for what it holds.

Python's gzip reads a header's name or comment field, and zero padding after a member, a byte
at a time, and decompresses members one after another for as long as they come: each is
bounded here (:class:`CheckedGzipReader`), and bytes that decompress to nothing are counted
as they are read (:class:`CountedRaw`), not only what they make.
"""

from __future__ import annotations

import gzip
import io
import re
import struct
import tarfile
import zlib
from typing import IO, Any

from ..errors import SmolbenchError
from .limits import human

GZIP_START = b"\x1f\x8b\x08"  # gzip's magic and its one method, deflate
PREFIX_LIMIT = 1000**2  # a record is looked for in a file's first MB, read and decompressed (it is first)
GZIP_MEMBERS = 4  # gzip members in a checkpoint file (smolbench writes one, or a record's and then its files')
PAD_LIMIT = 64 * 1024  # zero bytes after a gzip member (smolbench writes none; a tape or `dd conv=sync` pads a block)


# What a compressed stream starts with: a workspace archive is a plain tar, and bytes starting so could
# read as one thing plain and as another decompressed (tarfile.open's default tries each of these first)
COMPRESSED = ((re.compile(rb"\x1f\x8b"), "gzip"), (re.compile(rb"BZh[1-9]1AY&SY"), "bzip2"),
              (re.compile(rb"\xfd7zXZ\x00"), "xz"), (re.compile(rb"\x28\xb5\x2f\xfd"), "zstd"))


def compressed(head: bytes) -> str | None:
    """The compression whose magic ``head`` (a stream's first 10 bytes or more) starts with, else None."""
    return next((name for magic, name in COMPRESSED if magic.match(head)), None)


class UnsafeCheckpoint(SmolbenchError):
    """A checkpoint (or a machine's saved files) the host refuses to use."""


class Enough(Exception):
    """Raised by :class:`CountedRaw` past its stop: the check has read as far as it reads."""


class CountedRaw:
    """A gzip file's compressed bytes, counted as gzip reads them; past ``stop`` (when set),
    :class:`Enough`: data that decompresses to nothing (empty members, empty deflate blocks,
    zero padding) is bounded by what it costs to read, not by what it makes."""

    def __init__(self, fh: IO[bytes]) -> None:
        self._fh, self.count = fh, 0
        self.stop: int | None = None

    def read(self, size: int = -1) -> bytes:
        if self.stop is not None and self.count >= self.stop:
            raise Enough
        data = self._fh.read(size)
        self.count += len(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fh, name)


class CheckedGzipReader(gzip._GzipReader):
    """gzip's reader, but each member's header is measured first (:func:`gzip_header_end`) and
    skipped in one step: gzip reads a name or comment field a byte at a time, to the file's end.
    Members are counted (:data:`GZIP_MEMBERS`), and zero padding after one is skipped in one
    read, at most :data:`PAD_LIMIT` bytes of it (gzip skipped a TiB of it a byte at a time)."""

    def __init__(self, fp: Any, what: str) -> None:
        super().__init__(fp)
        self._what = what
        self.used = False  # gzip called us: a Python whose gzip no longer does is refused, not trusted
        self.members = 0
        self.refused: UnsafeCheckpoint | None = None  # said again on every later read

    def read(self, size: int = -1) -> bytes:
        if self.refused is not None:
            raise self.refused
        return super().read(size)

    def _refuse(self, why: str) -> UnsafeCheckpoint:
        self.refused = UnsafeCheckpoint(f"{self._what} {why}: refused")
        return self.refused

    def _read_gzip_header(self) -> bool:
        self.used = True
        fp: Any = self._fp  # type: ignore[attr-defined]
        head, end = b"", None
        while end is None and len(head) < PREFIX_LIMIT and GZIP_START.startswith(head[:3]):
            more = fp.read(min(max(len(head), 1024), PREFIX_LIMIT - len(head)))
            if not more:
                break
            head += more
            end = gzip_header_end(head, self._what)
        fp.prepend(head)  # exactly what was read: gzip's buffer gives it again
        if end is None:  # not a gzip header, or one the file's end cuts short: gzip says which
            return bool(super()._read_gzip_header())  # type: ignore[misc]
        self.members += 1
        if self.members > GZIP_MEMBERS:
            raise self._refuse(f"has more than {GZIP_MEMBERS} gzip members, which no smolbench writes")
        fp.read(end)
        self._last_mtime = int.from_bytes(head[4:8], "little")
        return True

    def _read_eof(self) -> None:
        fp: Any = self._fp  # type: ignore[attr-defined]
        crc, size = struct.unpack("<II", gzip._read_exact(fp, 8))  # type: ignore[attr-defined]
        if crc != self._crc:  # type: ignore[attr-defined]
            raise gzip.BadGzipFile(f"CRC check failed {hex(crc)} != {hex(self._crc)}")  # type: ignore[attr-defined]
        if size != self._stream_size & 0xFFFFFFFF:  # type: ignore[attr-defined]
            raise gzip.BadGzipFile("Incorrect length of data produced")
        more = fp.read(PAD_LIMIT + 1)
        pad = len(more) - len(more.lstrip(b"\0"))
        if pad > PAD_LIMIT:
            raise self._refuse(f"has more than {human(PAD_LIMIT)} of zero bytes after its gzip data, which no "
                               "smolbench writes")
        fp.prepend(more[pad:])  # the next member's first bytes, read again


class CheckedGzip(gzip.GzipFile):
    """A gzip file from elsewhere, its headers read by :class:`CheckedGzipReader`."""

    def __init__(self, path: str | None, fileobj: IO[bytes] | None, what: str) -> None:
        super().__init__(path, "rb", fileobj=fileobj)
        self.raw = CountedRaw(self.fileobj)  # type: ignore[arg-type]
        self.checked = CheckedGzipReader(self.raw, what)
        self._buffer = io.BufferedReader(self.checked)


def gzip_prefix(data: bytes, whole: bool, what: str) -> tuple[bytes, bool]:
    """What a gzip file's first bytes ``data`` (all of it: ``whole``) decompress to, at most
    PREFIX_LIMIT bytes, and whether that is all the file holds. zlib reads gzip's own headers
    (Python's gzip read a name field one byte at a time: 21 MB of one took 1.2 s of CPU), after
    the restore's rule for them (:func:`gzip_header_end`; ``what``: the file in its message).
    Its members are walked by offset, at most :data:`GZIP_MEMBERS` of them (zlib copies what
    follows each: 50,000 empty ones in 1 MB took 1.27 s)."""
    out = bytearray()
    view, pos, members = memoryview(data), 0, 0
    while pos < len(data) and len(out) < PREFIX_LIMIT:
        members += 1
        if members > GZIP_MEMBERS:
            raise UnsafeCheckpoint(f"{what} has more than {GZIP_MEMBERS} gzip members, which no smolbench writes: "
                                   "refused")
        gzip_header_end(data, what, pos)
        unzip = zlib.decompressobj(wbits=31)  # a gzip member, header and trailer checked
        try:
            out += unzip.decompress(view[pos:], PREFIX_LIMIT - len(out))
        except zlib.error as exc:
            if members == 1:
                raise tarfile.ReadError(f"zlib error: {exc}") from None
            return bytes(out), False  # after the first member: what came before is read as it was
        if not unzip.eof:
            return bytes(out), whole and not unzip.unconsumed_tail
        after = NOT_NUL.search(data, len(data) - len(unzip.unused_data))  # gzip allows NULs between members
        pos = after.start() if after is not None else len(data)
    return bytes(out), whole and pos >= len(data)


NOT_NUL = re.compile(rb"[^\0]")


def gzip_header_end(data: bytes, what: str, pos: int = 0) -> int | None:
    """Where the gzip member header at ``pos`` in ``data`` ends, or None (not a gzip header, or
    not ended within ``data``): a listing's and a restore's one rule, that its name and comment
    fields end within PREFIX_LIMIT bytes (else an UnsafeCheckpoint naming ``what``)."""
    if len(data) - pos < 12 or not data.startswith(GZIP_START, pos):
        return None
    flags, end = data[pos + 3], pos + 10
    if flags & gzip.FEXTRA:
        end += 2 + int.from_bytes(data[pos + 10:pos + 12], "little")
    for field in (gzip.FNAME, gzip.FCOMMENT):  # each ends with a NUL
        if flags & field:
            nul = data.find(b"\0", end)
            end = nul + 1 if nul >= 0 else len(data) + 1
    end += 2 if flags & gzip.FHCRC else 0
    if end <= len(data):
        return end - pos
    if len(data) - pos >= PREFIX_LIMIT:
        raise UnsafeCheckpoint(f"{what} has a gzip header whose name or comment field doesn't end within its "
                               f"first {human(PREFIX_LIMIT)}, which no gzip writer makes")
    return None
