"""Checkpoint archives without following a machine's links.

A machine saves its checkpoint into a folder the host can see; the machine made
every path in it, so the host opens them only through directory descriptors with
``O_NOFOLLOW`` (a link, fifo or device there is refused, never read through). The
workspace archive inside is checked member by member, resolving its own links the way
extraction would: a link that leads outside the archive (``/``, ``/etc/shadow``,
``..``), an absolute or ``..`` path, or a device is refused with one line. The host
never extracts an archive: restoring hands the checked files to the new machine,
whose agent extracts them itself (with tarfile's ``data`` filter where it has one).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import re
import stat
import sys
import tarfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, Literal, NamedTuple, cast

from ..errors import SmolbenchError
from . import passes
from .gzipread import (
    GZIP_START,
    PREFIX_LIMIT,
    CheckedGzip,
    Enough,
    UnsafeCheckpoint,
    compressed,
    gzip_prefix,
)
from .limits import LIMITS, human

FILES = ("namespace.pkl", "workspace.tar")
PAGE = 4096  # what a tmpfs keeps of a file, at least (its size is counted in these)
LINK_HOPS = 40  # like the kernel's limit on symlinks followed in one lookup
OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# Tests weaken the checks here to show what they stop (never set outside tests).
TEST_WEAKEN: set[str] = set()
# a long name's or pax header's own bytes, at most (tarfile reads them whole): a name and a link
# target of PATH_LIMIT each, and a few short records (an honest 4,096-byte name needs < 5 KiB)
HEADER_LIMIT = 12 * 1024
# Limits of a workspace archive, each with room over an honest one: a venv of 55,600 entries has
# 4 links, 4.3 MB of names and ~8 parts a name (a Python install: 59,700, 14 links); each member
# costs tarfile ~70 us of headers here, and the machine's unpacking more.
MEMBER_LIMIT = 200_000  # members (tarfile parses each; the machine makes each)
META_RUN = 8  # such headers in a row, at most (a pax, a long name and a long link make 3)
PAX_RECORDS_LIMIT = 4_000_000  # pax records in one archive (an honest one: a few a member)
PATH_LIMIT = 4096  # bytes of a member's name or link target, at most (PATH_MAX: no file system makes longer)
NAME_MAX = 255  # bytes of one part of a name (no file system makes longer: the machine can't make it)
NAMES_LIMIT = 32 * 1000**2  # bytes of all members' names (or links) together (the check keeps them)
WALK_LIMIT = 5_000_000  # name parts the check walks in all, following links (an honest workspace: ~10 a file)
LINK_LIMIT = 25_000  # symlinks and hard links (node_modules/.bin: hundreds; a pnpm tree: thousands)
LINK_PARTS_LIMIT = 1_000_000  # name parts of all links together, each a node of the link tree (~180 bytes)
META_TYPES = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE,
              tarfile.SOLARIS_XHDTYPE)


class UnusableCheckpoint(UnsafeCheckpoint):
    """A checkpoint file that can't be used as it is, through no one's design: empty, cut short
    or damaged on its way, not a checkpoint file at all, or written by another smolbench version.
    Its one line names which, and the fix (copy it again, ask for an exported one, upgrade)."""


class Damaged(tarfile.ReadError):
    """A checkpoint archive that ends before its files: bytes cut short or damaged (a copy that did
    not finish, a failing stick), which tarfile reads as an early end. Its message says where."""


def damage(exc: BaseException) -> str | None:
    """What reading a checkpoint file that raised ``exc`` found, in words for one line, when the
    file looks damaged or cut short (its fix: copy it again); None for any other failure."""
    if isinstance(exc, Damaged):
        return str(exc)
    if isinstance(exc, EOFError):  # gzip: "Compressed file ended before the end-of-stream marker was reached"
        return "its compressed data ends early"
    if isinstance(exc, gzip.BadGzipFile) and "check failed" in str(exc):  # its CRC-32 or length: bytes changed
        return "its data fails gzip's checksum"
    if isinstance(exc, tarfile.ReadError) and str(exc) in ("truncated header", "unexpected end of data"):
        return "it ends in the middle of its data"
    if isinstance(exc, tarfile.ReadError) and str(exc) == "bad checksum":
        return "an archive header fails its checksum"
    if isinstance(exc, tarfile.ReadError) and str(exc).startswith("zlib error"):
        return f"its compressed data is damaged: {reason(exc).removeprefix('zlib error: ')}"
    return None


class BadHeader(tarfile.HeaderError):
    """A tar header refused before tarfile acts on it."""


class CheckedInfo(tarfile.TarInfo):
    """Tar headers from someone else, checked before tarfile acts on them. tarfile reads a long
    name or a pax header whole into memory (a few MB of gzip made GBs of host memory), and a
    negative size (base-256) sends it back onto the same header forever (CVE-2025-8194, fixed
    in Python 3.11.14/3.12.12, not in every Python a kernel runs). Sparse members are refused:
    nothing smolbench writes has them, and their maps are read whole too. A global pax header
    is refused (nothing smolbench writes has one, and tarfile copied its keys into every later
    member: 389 kB made 2 GB), pax headers are parsed here in one pass (tarfile's regex took
    seconds per header before CVE-2024-6232's fix), and a member keeps none of its pax keys
    (the host reads names, links, types and sizes only)."""

    @classmethod
    def fromtarfile(cls, tf: tarfile.TarFile) -> CheckedInfo:
        try:
            return super().fromtarfile(tf)
        except (tarfile.TarError, OSError, EOFError, zlib.error, MemoryError, SmolbenchError):
            raise  # (tarfile.next makes a zlib.error a ReadError)
        except Exception as exc:  # tarfile's own parsing of crafted bytes: one line, not a traceback
            if "tarheaders" in TEST_WEAKEN:
                raise
            raise BadHeader(f"a header tarfile can't read ({type(exc).__name__}: {str(exc)[:200]})") from None

    def _proc_member(self, tf: tarfile.TarFile) -> tarfile.TarInfo:
        if "tarheaders" not in TEST_WEAKEN:
            # tarfile reads the member a long name or pax header belongs to by recursing: a
            # chain of thousands of them was a RecursionError, not a refusal
            run = getattr(tf, "_smolbench_meta_run", 0) + 1 if self.type in META_TYPES else 0
            tf._smolbench_meta_run = run  # type: ignore[attr-defined]
            if run > META_RUN:
                raise BadHeader(f"more than {META_RUN} long-name or pax headers in a row")
            if self.type == tarfile.XGLTYPE:
                raise BadHeader("a global pax header (type 'g'), which smolbench never writes")
            if self.size < 0:
                raise BadHeader(f"member {self.name[:100]!r} claims a negative size")
            if self.type in META_TYPES and self.size > HEADER_LIMIT:
                raise BadHeader(f"a long name or pax header of {human(self.size)}, over {human(HEADER_LIMIT)}")
            if self.type == tarfile.GNUTYPE_SPARSE:
                raise BadHeader(f"member {self.name[:100]!r} is sparse")
        return super()._proc_member(tf)  # type: ignore[misc]

    def _proc_pax(self, tf: tarfile.TarFile) -> tarfile.TarInfo:
        """tarfile's own, for one member's pax header (never a global one), its records parsed
        in one pass and counted against the archive's budget."""
        if "tarheaders" in TEST_WEAKEN or self.type == tarfile.XGLTYPE:
            return super()._proc_pax(tf)  # type: ignore[misc]
        assert tf.fileobj is not None
        records = pax_records(tf.fileobj.read(self._block(self.size))[:self.size])  # type: ignore[attr-defined]
        seen = getattr(tf, "_smolbench_pax", 0) + len(records)
        tf._smolbench_pax = seen  # type: ignore[attr-defined]
        if seen > PAX_RECORDS_LIMIT:
            raise BadHeader(f"more than {PAX_RECORDS_LIMIT:,} pax records in all")
        # names are UTF-8 unless the header says hdrcharset=BINARY (then the archive's encoding)
        charset = next((v for k, v in records if k == b"hdrcharset"), None)
        names = tf.encoding if charset == b"BINARY" else "utf-8"
        pax: dict[str, str] = {}
        for raw_key, raw_value in records:  # decoded as tarfile does, never raising (surrogateescape)
            key = self._decode_pax_field(raw_key, "utf-8", "utf-8", tf.errors)  # type: ignore[attr-defined]
            name = key in tarfile.PAX_NAME_FIELDS
            pax[key] = self._decode_pax_field(raw_value, names if name else "utf-8",  # type: ignore[attr-defined]
                                              tf.encoding if name else "utf-8", tf.errors)
        try:
            member = self.fromtarfile(tf)
        except tarfile.HeaderError as exc:
            raise tarfile.SubsequentHeaderError(str(exc)) from None  # type: ignore[attr-defined]
        member._apply_pax_info(pax, tf.encoding, tf.errors)
        member.offset = self.offset
        if "size" in pax:  # the member's data starts where tarfile would have put it
            offset = member.offset_data
            if member.isreg() or member.type not in tarfile.SUPPORTED_TYPES:
                offset += member._block(member.size)  # type: ignore[attr-defined]
            tf.offset = offset
        return member

    def _apply_pax_info(self, pax_headers: dict[str, str], encoding: str, errors: str) -> None:
        if "tarheaders" not in TEST_WEAKEN and any(k.startswith("GNU.sparse") for k in pax_headers):
            raise BadHeader(f"member {self.name[:100]!r} is sparse")
        super()._apply_pax_info(pax_headers, encoding, errors)  # type: ignore[misc]
        if "tarheaders" not in TEST_WEAKEN:
            if self.size < 0:
                raise BadHeader(f"member {self.name[:100]!r} claims a negative size")
            self.pax_headers = {}  # applied: kept for every member, they were the archive's keys many times

    def _proc_gnusparse_00(self, *args: Any) -> None:
        raise BadHeader(f"member {self.name[:100]!r} is sparse")

    _proc_gnusparse_01 = _proc_gnusparse_10 = _proc_gnusparse_00


def pax_records(buf: bytes) -> list[tuple[bytes, bytes]]:
    """A pax header's ``LEN KEY=VALUE\\n`` records, each length a short decimal and all of them
    adding up to the header exactly (trailing NULs aside), in one pass; else BadHeader."""
    records, pos, end = [], 0, len(buf)
    while pos < end and buf[pos]:
        space = buf.find(b" ", pos, pos + 11)  # at most 10 digits
        length = int(buf[pos:space]) if space > pos and buf[pos:space].isdigit() else 0
        stop = pos + length
        if length < 5 or stop > end or buf[stop - 1] != 0x0A:  # the shortest: b"5 k=\n"
            raise BadHeader(f"a pax header that is not pax records (at byte {pos} of {end})")
        key, eq, value = buf[space + 1:stop - 1].partition(b"=")
        if not key or not eq:
            raise BadHeader(f"a pax header that is not pax records (at byte {pos} of {end})")
        records.append((key, value))
        pos = stop
    if buf.count(0, pos) != end - pos:
        raise BadHeader(f"a pax header that is not pax records (at byte {pos} of {end})")
    return records


@contextlib.contextmanager
def _zlib_as_tar_error() -> Iterator[None]:
    try:
        yield
    except zlib.error as exc:  # tarfile says so only for a header's bytes
        raise tarfile.ReadError(f"zlib error: {exc}") from None


class _CheckedFile(tarfile.ExFileObject):
    """A member's bytes: damaged gzip data is a tarfile.ReadError like the rest, not a zlib.error
    past every caller."""

    def read(self, size: int | None = -1) -> bytes:
        with _zlib_as_tar_error():
            return super().read(size)

    def read1(self, size: int = -1) -> bytes:
        with _zlib_as_tar_error():
            return super().read1(size)

    def readinto(self, buffer: Any) -> int:
        with _zlib_as_tar_error():
            return super().readinto(buffer)


class _CheckedTar(tarfile.TarFile):
    """Someone else's archive: headers read by :class:`CheckedInfo`, and whatever tarfile, gzip
    or zlib raise on its bytes is a tarfile.TarError, EOFError or OSError (one line for every
    caller), never another exception."""

    tarinfo = CheckedInfo
    fileobject = _CheckedFile

    def next(self) -> tarfile.TarInfo | None:
        with _zlib_as_tar_error():  # tarfile seeks to the next header before its own handling
            return super().next()


def open_tar(path: str | None = None, mode: Literal["r:gz", "r:"] = "r:gz",
             fileobj: IO[bytes] | None = None, what: str | None = None) -> tarfile.TarFile:
    """An archive from elsewhere (a machine, another person), read with :class:`CheckedInfo`
    (and gzip's headers with :class:`CheckedGzip`); ``what``: it in messages."""
    if mode != "r:gz":
        return _CheckedTar.open(path, mode, fileobj=fileobj)
    gz = CheckedGzip(path, fileobj, what or f"checkpoint {Path(path or '').name}")
    try:
        tar = _CheckedTar.open(path, "r:", fileobj=gz)
    except OSError as exc:  # as tarfile's own gzip opening says it
        gz.close()
        raise tarfile.ReadError("not a gzip file") from exc
    except BaseException:
        gz.close()
        raise
    tar._extfileobj = False  # type: ignore[attr-defined]  # closing the archive closes the gzip file
    if not gz.checked.used:  # this Python's gzip reads its headers another way: not checked, not read
        tar.close()
        raise UnsafeCheckpoint(f"{what or Path(path or '').name}: this Python's gzip module reads files in a way "
                               f"smolbench can't check (Python {sys.version.split()[0]}): use Python 3.10 to 3.13")
    return tar


def reason(exc: BaseException) -> str:
    """Why reading failed, as part of one line (quoted when it is not plain text)."""
    text = str(exc) or type(exc).__name__
    return text if text.isprintable() and len(text) <= 200 else repr(text[:200])


def _within_limit(sizes: dict[str, int], what: str) -> None:
    """One line if ``sizes`` (name -> bytes) add up to more than the checkpoint limit."""
    total = sum(sizes.values())
    if total > LIMITS.checkpoint and "size" not in TEST_WEAKEN:
        parts = ", ".join(f"{n} {human(v)}" for n, v in sizes.items())
        raise UnsafeCheckpoint(f"{what} holds {human(total)} ({parts}), over the checkpoint limit of "
                               f"{human(LIMITS.checkpoint)}: keep less in the machine, or raise it with "
                               "`%smol config checkpoint-limit 4G`")


REOPEN = re.compile(r"/proc/self/fd/\d+")  # gate/ckptpaths.Opened.path: a file the one rule already opened


def open_file(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor for ``path``, never through a link it names; except the one
    magic link ``/proc/self/fd/N`` of a file the checkpoint rule already opened and checked,
    which is reopened (its own offset) rather than refused."""
    flags = OPEN_FILE & ~os.O_NOFOLLOW if REOPEN.fullmatch(os.fspath(path)) else OPEN_FILE
    return os.open(path, flags)


def read_small(path: str | os.PathLike[str], limit: int = 64 * 1024) -> str | None:
    """The text of a small file a machine may have made (its last ``limit`` bytes), or None.

    Never through a link, never blocking on a fifo: a run folder is writable from inside
    the machine, so its ``owner``, ``ready`` and log files are machine-made too.
    """
    try:
        fd = os.open(path, OPEN_FILE)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            return None
        if st.st_size > limit:
            fh.seek(st.st_size - limit)
        return fh.read(limit).decode("utf-8", "replace")


_TARGET = "\0"  # the key of a link's target in the tree of link names (no name part holds a NUL)


def _link_parts(links: dict[str, str], where: str) -> None:
    """Refuse links whose names have more than LINK_PARTS_LIMIT parts in all, before any node of
    their tree is made: 3,000 links of 2,000 parts each under their own folder (68 kB of gzip)
    were 6,000,000 nodes, 1.2 GB. (Each part is a node of the tree a lookup walks, one step a part.)"""
    if sum(name.count("/") + 1 for name in links) > LINK_PARTS_LIMIT:
        raise UnsafeCheckpoint(f"{where} has links whose names have more than {LINK_PARTS_LIMIT:,} parts in all: "
                               "refused")


Kept = tuple[str, list[str], "tarfile.TarInfo | None"]  # a member: its name, its name's parts, itself if a link


class _Walk:
    """Name parts a workspace's check may still walk, following its links: each of 500,000
    names of 4 KB through 40 hops of links is linear, and all of them together is hours."""

    def __init__(self, where: str) -> None:
        self.left, self.where = WALK_LIMIT, where

    def take(self, steps: int) -> None:
        self.left -= steps
        if self.left < 0:
            raise UnsafeCheckpoint(f"{self.where} has names and links that take more than {WALK_LIMIT:,} steps "
                                   "to follow: refused")


def _resolve(path: list[str], tree: dict[str, Any], walk: _Walk, hops: int = 0) -> list[str] | None:
    """``path``'s components after following the archive's own links; None if it leaves the archive.
    Parts are looked at one by one only while a link may lie ahead: below every link's folder,
    with no ``..`` left to climb back, the rest is taken as it is (each name's parts one by
    one, in Python, were most of a 50,000-link archive's 17 s)."""
    parts: list[str] = []
    nodes: list[dict[str, Any] | None] = []  # the link tree's node for each prefix (None: no link below)
    walk.take(len(path))
    up = len(path) - path[::-1].index("..") if ".." in path else 0  # past the last "..": nothing climbs back
    for i, part in enumerate(path):
        above = nodes[-1] if nodes else tree
        if above is None and i >= up:
            return parts + [p for p in path[i:] if p not in ("", ".")]
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                return None
            parts.pop()
            nodes.pop()
            continue
        node = above.get(part) if above is not None else None
        parts.append(part)
        nodes.append(node)
        target = node.get(_TARGET) if node is not None else None
        if target is not None:
            if hops >= LINK_HOPS or target.startswith("/"):
                return None
            return _resolve([*parts[:-1], *target.split("/"), *path[i + 1:]], tree, walk, hops + 1)
    return parts


def _shown(name: str) -> str:
    """A member's name for a message: as it is when plain, else quoted (no escapes reach a terminal)."""
    return name if name.isprintable() and len(name) <= 200 else repr(name[:200])


def _header_checked(m: tarfile.TarInfo, where: str) -> list[str]:
    """What one member's header alone says is wrong (one line), else its name's parts."""
    name, link = m.name, m.linkname
    if max(len(name), len(link)) > PATH_LIMIT // 4 or not (name + link).isascii():  # (bytes: only when they may be over)
        if max(len(name.encode("utf-8", "surrogateescape")), len(link.encode("utf-8", "surrogateescape"))) > PATH_LIMIT:
            raise UnsafeCheckpoint(f"{where} has a name or link longer than {PATH_LIMIT:,} bytes, which no file "
                                   f"system makes ({_shown(name[:60])}...)")
    parts = name.split("/")
    if name.startswith("/") or ".." in parts:
        raise UnsafeCheckpoint(f"{where} has a file outside its workspace ({_shown(name)})")
    if not (m.isfile() or m.isdir() or m.issym() or m.islnk()):
        raise UnsafeCheckpoint(f"{where} has a device or fifo ({_shown(name)})")
    if len(name) > NAME_MAX and any(len(p.encode("utf-8", "surrogateescape")) > NAME_MAX for p in parts):
        # the machine can't make it, and tarfile then looked each such link up among every member
        raise UnsafeCheckpoint(f"{where} has a name with a part longer than {NAME_MAX} bytes, which no file "
                               f"system makes ({_shown(name[:60])}...)")
    if (m.issym() or m.islnk()) and link.startswith("/"):
        kind = "hard link" if m.islnk() else "link"
        raise UnsafeCheckpoint(f"{where} has a {kind} that points outside it ({_shown(name)} -> {_shown(link)})")
    return parts


def plain_tar(head: bytes, where: str) -> None:
    """Refuse a workspace archive whose first bytes ``head`` are a compression's magic: the host
    reads it as the plain tar it must be, and a reader that tries gzip first (tarfile.open's
    default) read the same bytes as a gzip of another archive, every check skipped (eighth audit)."""
    kind = compressed(head)
    if kind is not None and "magic" not in TEST_WEAKEN:
        raise UnsafeCheckpoint(f"{where} has a workspace archive that starts as {kind} data, which smolbench never "
                               "writes (a plain tar to one reader and another archive to the next): refused")


def check_members(tar: tarfile.TarFile, where: str) -> int:
    """Refuse a workspace archive whose members could land or point outside it. Returns the
    bytes its files take unpacked (each file's size in whole pages, as a tmpfs keeps them).

    One pass over the headers checks each alone and charges every budget as it comes (a crafted
    archive is refused where it goes over, not after all of it is read), keeping only names;
    then links are followed for the members that a link may lead through."""
    kept: list[Kept] = []
    links: dict[str, str] = {}
    files: set[str] = set()  # names a file (or a hard link to one) was last at
    names = footprint = count = linked = walked = 0
    while (m := tar.next()) is not None:
        tar.members.clear()  # type: ignore[attr-defined]  # tarfile keeps every header it reads: this check keeps names only
        count += 1
        if count > MEMBER_LIMIT:
            raise UnsafeCheckpoint(f"{where} has more than {MEMBER_LIMIT:,} files: refused")
        parts = _header_checked(m, where)
        names += max(len(m.name), len(m.linkname))
        if names > NAMES_LIMIT:
            raise UnsafeCheckpoint(f"{where} has names of more than {human(NAMES_LIMIT)} in all: refused")
        # the walk below takes at least each name's and link's parts: said now, not after reading all
        walked += len(parts) + (m.linkname.count("/") + 1 if m.issym() or m.islnk() else 0)
        if walked > WALK_LIMIT:
            _Walk(where).take(walked)
        if m.isfile():
            footprint += -(-m.size // PAGE) * PAGE
        if m.issym() or m.islnk():
            linked += 1
            if linked > LINK_LIMIT:
                raise UnsafeCheckpoint(f"{where} has more than {LINK_LIMIT:,} links: refused")
            if m.issym():
                links[m.name.strip("/")] = m.linkname
        kept.append((m.name, parts, m if m.issym() or m.islnk() else None))
        # a hard link only to a file before it: tarfile copies a symlink there to the new name, its
        # text unchanged (`sub/s -> ../y` hard-linked as `h` was `h -> ../y`, outside; eighth audit)
        clean = "/".join(p for p in parts if p not in ("", "."))
        if m.islnk() and (m.linkname not in files or any(p in ("", ".", "..") for p in m.linkname.split("/"))):
            raise UnsafeCheckpoint(f"{where} has a hard link to something not a file before it ({_shown(m.name)} -> "
                                   f"{_shown(m.linkname)}): refused")
        (files.add if m.isfile() or m.islnk() else files.discard)(clean)
    if not links and not linked:
        return footprint  # no link to follow: every name stays where it says
    _link_parts(links, where)
    tree: dict[str, Any] = {}
    walk = _Walk(where)
    folders = iter(_place_links(kept, tree, walk, where))
    for name, parts, link in kept:
        if link is not None and link.issym():  # made where its folder leads, never followed
            if _resolve([*next(folders), *link.linkname.split("/")], tree, walk) is None:
                raise UnsafeCheckpoint(f"{where} has a link that points outside it ({_shown(name)} -> "
                                       f"{_shown(link.linkname)})")
            continue
        if link is not None:  # its target's path as written: through no link, to no link (then it is a file)
            target = link.linkname.split("/")
            if _resolve(target, tree, walk) != target:
                raise UnsafeCheckpoint(f"{where} has a hard link that points outside it or through a link "
                                       f"({_shown(name)} -> {_shown(link.linkname)})")
        # a path that goes through one of the archive's links must stay inside too
        if tree and _resolve(parts, tree, walk) is None:
            raise UnsafeCheckpoint(f"{where} has a file reached through a link outside it ({_shown(name)})")
    return footprint


def _place_links(kept: list[Kept], tree: dict[str, Any], walk: _Walk, where: str) -> list[list[str]]:
    """Put each symlink in ``tree`` where it lands, in the archive's order: in its folder as
    reached through the links made before it. A link made through another lands where that one
    leads, not at its name (``a -> .``, ``a/b -> .``, ``b/x -> ..`` make ``x -> ..``; eighth
    audit: keyed by name, ``x/ESCAPED`` was let through). Each one's folder, in order."""
    folders: list[list[str]] = []
    nodes = 0
    for name, parts, link in kept:
        if link is None or not link.issym():
            continue
        clean = [p for p in parts if p not in ("", ".")]
        # (no link made yet at its first part: nothing to follow, and no call)
        folder = _resolve(clean[:-1], tree, walk) if len(clean) > 1 and clean[0] in tree else clean[:-1]
        if folder is None:
            raise UnsafeCheckpoint(f"{where} has a link reached through a link outside it ({_shown(name)})")
        folders.append(folder)
        nodes += len(folder) + 1
        if nodes > LINK_PARTS_LIMIT:
            raise UnsafeCheckpoint(f"{where} has links whose names have more than {LINK_PARTS_LIMIT:,} parts in all: "
                                   "refused")
        node = tree
        for part in [*folder, *clean[-1:]]:
            node = node.setdefault(part, {})
        node[_TARGET] = link.linkname
    return folders


def check_workspace(blob: bytes, where: str) -> None:
    """Refuse a workspace archive (bytes a machine sent) with links or paths leading outside it."""
    plain_tar(blob[:16], where)
    try:
        with open_tar(fileobj=io.BytesIO(blob), mode="r:") as tar:
            check_members(tar, where)
    except tarfile.TarError as exc:
        raise UnsafeCheckpoint(f"{where} is not a readable archive ({exc})") from None


class Checked(NamedTuple):
    """What :func:`check_sized` found in a checkpoint file it let through."""

    record: dict[str, Any] | None  # its record (checked), or None
    files: int  # bytes its workspace's files take unpacked (in pages): what a machine's disk must hold
    namespace: int  # bytes of its pickled variables


def check(path: str, backend: str = "sandbox", label: str | None = None,
          sha256: str | None = None) -> dict[str, Any] | None:
    """Refuse a checkpoint file that is not exactly two plain files with a safe workspace (and,
    first, at most one record of its own), or that claims more than the checkpoint limit
    (refused before any of it is unpacked). Returns its record (checked), or None.
    ``label``: the file's name in messages (default: ``path``'s); ``sha256``: see :func:`check_sized`."""
    return check_sized(path, backend, label, sha256).record


def check_sized(path: str, backend: str = "sandbox", label: str | None = None, sha256: str | None = None) -> Checked:
    """:func:`check`, and what the file would take in a machine (from its headers, as read).
    A file is not checked again while it has the same bytes (gate/passes.py): its pass is found
    by ``sha256``, the caller's hash of the file it then uses (or one passes.known gives)."""
    label = label or Path(path).name
    limits = (LIMITS.checkpoint, hash(frozenset(TEST_WEAKEN)))  # a lowered limit checks again
    with open(path, "rb") as fh:
        digest = sha256 or passes.known_for(os.fstat(fh.fileno()))
        checked = passes.recall(digest, limits) if digest is not None else None
        if checked is None:
            read = passes.Hashing(fh)  # kept under the hash of the very bytes checked
            checked = _check_sized(cast(IO[bytes], read), backend, label)
            passes.remember(read.digest(), limits, checked)
    return checked


def _check_sized(fh: IO[bytes], backend: str, label: str) -> Checked:
    record = None
    with open_tar(fileobj=_not_over_limit(fh, label), what=f"checkpoint {label}") as tar:
        members: list[tarfile.TarInfo] = []
        sizes: dict[str, int] = {}
        try:
            while True:
                m = tar.next()  # one header at a time: a huge claimed size is refused before its data is read
                if m is None:
                    break
                if record is None and not members and m.name == RECORD and m.isfile():  # the first header only
                    record = _read_record(tar, m, label)  # (a million records were all kept)
                    continue
                members.append(m)
                if m.name in FILES and m.isfile():
                    sizes[m.name] = m.size
                    _within_limit(sizes, f"checkpoint {label}")
                if len(members) > len(FILES):
                    break
            names = sorted(m.name for m in members)
            if set(names) < set(FILES) and (members or record is not None) and all(m.isfile() for m in members):
                last = members[-1].name if members else RECORD  # a file cut short (tarfile reads damage as an end)
                raise Damaged(f"it ends after {last}, without {', '.join(f for f in FILES if f not in names)}")
            if names != sorted(FILES) or not all(m.isfile() for m in members):
                raise SmolbenchError(f"checkpoint {label} is not a {backend} checkpoint (has {names[:5]})")
            blob = tar.extractfile("workspace.tar")
            assert blob is not None
            plain_tar(cast(Any, blob).peek(16)[:16], f"checkpoint {label}")  # (its buffer: not read twice)
            with open_tar(fileobj=blob, mode="r:") as inner:
                files = check_members(inner, f"checkpoint {label}")
        except (SmolbenchError, tarfile.TarError) as exc:
            said = None if isinstance(exc, Damaged) else _damage_found(tar)
            if said is not None:  # a changed byte can make a header wrong: gzip's checksum says it was that
                raise Damaged(said) from None
            raise
        said = _damage_found(tar, quiet=False)
        if said is not None:
            raise Damaged(said)
    return Checked(record, files, sizes.get("namespace.pkl", 0))


def _not_over_limit(fh: IO[bytes], label: str) -> IO[bytes]:
    """``fh``, unless its file is over the checkpoint limit (then an UnsafeCheckpoint naming ``label``):
    none of it is read, whoever named it (a copied ledger's row too)."""
    size = os.fstat(fh.fileno()).st_size
    if size > LIMITS.checkpoint and "size" not in TEST_WEAKEN:
        raise UnsafeCheckpoint(f"{label} is {human(size)}, over the checkpoint limit of {human(LIMITS.checkpoint)}: "
                               "not read (raise it with `%smol config checkpoint-limit 4G` if you trust it)")
    return fh


def _damage_found(tar: tarfile.TarFile, quiet: bool = True) -> str | None:
    """What :func:`_crc_checked` finds wrong with the data, in :func:`damage`'s words (None:
    nothing); any other error it meets is raised (``quiet``: ignored, for the caller's own)."""
    try:
        _crc_checked(tar)
    except (SmolbenchError, tarfile.TarError, EOFError, OSError) as exc:
        said = damage(exc)
        if said is None and not quiet:
            raise
        return said
    return None


DRAIN_LIMIT = 1024 * 1024  # bytes read past what the check needed, to reach gzip's checksum (an honest file: ~20 KB)


def _crc_checked(tar: tarfile.TarFile) -> None:
    """Read a checked archive's gzip data to its end, so that gzip compares its checksum: tarfile
    stops at the archive's end marker, before it, so a byte changed on the way (a failing stick)
    restored as different variables or files. Past :data:`DRAIN_LIMIT` bytes, decompressed or
    compressed (what decompresses to nothing costs reading too), it stops unchecked: the checksum
    finds accidents, and a made file can carry a right one anyway."""
    gz = tar.fileobj
    if not isinstance(gz, CheckedGzip):
        return
    left = DRAIN_LIMIT
    gz.raw.stop = gz.raw.count + DRAIN_LIMIT
    with _zlib_as_tar_error(), contextlib.suppress(Enough):
        while left > 0:
            got = len(gz.read(min(left, 64 * 1024)))
            if not got:
                return
            left -= got


def _read_record(tar: tarfile.TarFile, member: tarfile.TarInfo, label: str) -> dict[str, Any]:
    if member.size > RECORD_LIMIT:
        raise UnsafeCheckpoint(f"checkpoint {label}'s record is {human(member.size)}, over "
                               f"{human(RECORD_LIMIT)}: refused")
    src = tar.extractfile(member)
    assert src is not None
    return parse_record(src.read(RECORD_LIMIT + 1), f"checkpoint {label}")


def read_record(path: str, label: str | None = None) -> dict[str, Any] | None:
    """The record inside a checkpoint file (checked), or None when it has none; only its first
    member is read, from the file's first PREFIX_LIMIT bytes (see :func:`gzip_prefix`), and a
    file over the checkpoint limit not at all. Whatever is wrong with the file is an
    UnsafeCheckpoint of one line naming it: a listing reads every file dropped into a folder
    (the sidebar's, every 5 s), and one can't break it for the rest or cost it more."""
    label = label or Path(path).name
    try:
        with open(path, "rb") as fh:
            size = os.fstat(_not_over_limit(fh, label).fileno()).st_size
            data = fh.read(PREFIX_LIMIT)
            wrong = first_bytes(data[:len(GZIP_START)], label)
            if wrong is not None:
                raise wrong
            head, whole = gzip_prefix(data, size <= PREFIX_LIMIT, label)
        try:
            with open_tar(fileobj=io.BytesIO(head), mode="r:") as tar:
                m = tar.next()
                if m is None or m.name != RECORD or not m.isfile():
                    return None
                return _read_record(tar, m, label)
        except (tarfile.TarError, EOFError) as exc:
            if whole:
                raise
            raise UnsafeCheckpoint(f"{label} has no record within its first {human(PREFIX_LIMIT)} ({reason(exc)}), "
                                   "where smolbench puts it: refused") from None
    except (SmolbenchError, MemoryError):
        raise
    except Exception as exc:  # tarfile, gzip or zlib on someone else's bytes
        raise unusable(label, exc) from None


COPY_AGAIN = "copy the whole file again from where it came from"
EXPORTED = "ask for one made with `%smol checkpoint export NAME PATH`"


def unusable(label: str, exc: BaseException) -> UnusableCheckpoint:
    """Why checkpoint file ``label`` can't be read (``exc``: what reading it raised), in one line
    with the fix: cut short or damaged (copy it again), else not a checkpoint that can be read."""
    cut = damage(exc)
    if cut is not None:
        return UnusableCheckpoint(f"{label} is cut short or damaged ({cut}): {COPY_AGAIN}")
    return UnusableCheckpoint(f"{label} is not a readable checkpoint ({reason(exc)}): {EXPORTED}")


def first_bytes(head: bytes, label: str) -> UnusableCheckpoint | None:
    """Why a file whose first bytes are ``head`` (at least 3 when it has them) can't be a
    checkpoint file (each one is gzip data), in one line with the fix; None when it may be one."""
    if not head:
        return UnusableCheckpoint(f"{label} is empty (0 bytes): {COPY_AGAIN}")
    if len(head) < len(GZIP_START) and GZIP_START.startswith(head):
        return UnusableCheckpoint(f"{label} is cut short or damaged (it ends after {len(head)} byte"
                                  f"{'s' if len(head) > 1 else ''}): {COPY_AGAIN}")
    if not head.startswith(GZIP_START[:2]):
        return UnusableCheckpoint(f"{label} is not a smolbench checkpoint file (one starts as gzip data): {EXPORTED}")
    return None


# -- the record a portable checkpoint carries ------------------------------------------------

RECORD = "smolbench-record.json"
RECORD_LIMIT = 16 * 1024
RECORD_KIND = "smolbench-checkpoint"
RECORD_VERSION = 1  # the record this smolbench writes and reads; a reader of 1 can't use a 2
# Backends whose checkpoints travel as a file: smol's never do (`checkpoint export` refuses them),
# so a record claiming smol was written by hand and would send a restore to bring up a microVM.
BACKENDS = ("sandbox", "process")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
NODE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
PART_RE = re.compile(r"[a-z]{1,20}")
HASH_RE = re.compile(r"[0-9a-f]{12}")
PACKAGES, PACKAGE_TEXT = 64, 200  # a record's packages, at most, and characters of each (more: not listed)


def _text(limit: int) -> Callable[[object], bool]:
    return lambda v: isinstance(v, str) and len(v) <= limit and v.isprintable()


def _whole(lo: int, hi: int) -> Callable[[object], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


RECORD_FIELDS: dict[str, Callable[[object], bool]] = {
    "kind": lambda v: v == RECORD_KIND,
    "version": lambda v: type(v) is int and v == RECORD_VERSION,
    "name": lambda v: isinstance(v, str) and bool(NAME_RE.fullmatch(v)),
    "backend": lambda v: v in BACKENDS,
    "node": lambda v: isinstance(v, str) and bool(NODE_RE.fullmatch(v)),
    "cells": _whole(0, 10**9),
    "size": _whole(0, 1 << 50),
    "created": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e11,
    "baseline": _text(200),
    "image": lambda v: v is None or _text(200)(v),
    "memory": _whole(1, 1 << 20),
    "cpus": _whole(1, 1024),
    "warnings": lambda v: isinstance(v, list) and len(v) <= 20 and all(_text(2000)(w) for w in v),
    # the machine's Smolfile packages as written, and a short hash of each part of it a restore
    # compares (MachineSpec.parts): said by a restore on another machine, never installed
    "packages": lambda v: isinstance(v, list) and len(v) <= PACKAGES and all(_text(PACKAGE_TEXT)(p) for p in v),
    "parts": lambda v: isinstance(v, dict) and len(v) <= 16 and all(
        isinstance(k, str) and PART_RE.fullmatch(k) and isinstance(h, str) and HASH_RE.fullmatch(h) for k, h in v.items()),
}
REQUIRED = ("kind", "version", "name", "backend")


def parse_record(blob: bytes, where: str) -> dict[str, Any]:
    """A checkpoint's record from bytes someone else may have written: strict UTF-8 JSON, one
    object of known keys with checked values (no duplicates, no NaN). Nothing in it names a
    path; what it says only informs (the backend to bring up, names shown)."""
    def no_dupes(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise ValueError("a key appears twice")
        return dict(pairs)

    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not a number")

    try:
        if len(blob) > RECORD_LIMIT:
            raise ValueError(f"it is over {human(RECORD_LIMIT)}")
        data = json.loads(blob.decode("utf-8"), object_pairs_hook=no_dupes, parse_constant=no_constant)
        if not isinstance(data, dict):
            raise ValueError("it is not an object")
        _same_version(data, where)
        if data.get("backend") == "smol":
            raise UnusableCheckpoint(f"{where} says the smol backend made it, but smol's checkpoints never travel as a "
                                     f"file (this one was written or changed by hand): {EXPORTED}")
        # a key this version doesn't know (a later smolbench's, of the same version) is dropped
        # here, unread: nothing but the known keys, checked, reaches any caller
        data = {k: v for k, v in data.items() if k in RECORD_FIELDS}
        missing = [k for k in REQUIRED if k not in data]
        if missing:
            raise ValueError(f"it has no {missing[0]!r}")
        bad = next((k for k, v in data.items() if not RECORD_FIELDS[k](v)), None)
        if bad is not None:
            raise ValueError(f"its {bad!r} is not valid")
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise UnsafeCheckpoint(f"{where} has a record that can't be used ({exc}): refused") from None
    return data


def _same_version(data: dict[str, Any], where: str) -> None:
    """An UnusableCheckpoint when record ``data`` (of ``where``) is smolbench's but of another
    version than :data:`RECORD_VERSION`: said as a version problem, with the fix."""
    version = data.get("version")
    if data.get("kind") != RECORD_KIND or "version" not in data or (type(version) is int and version == RECORD_VERSION):
        return
    if isinstance(version, int) and not isinstance(version, bool) and version > RECORD_VERSION:
        raise UnusableCheckpoint(f"{where} was made by a newer smolbench (record version {min(version, 10**6)}; this "
                                 f"one reads {RECORD_VERSION}): upgrade smolbench (`pip install -U "
                                 "jupyterlab-smolbench`), or ask for a file exported by this version")
    shown = repr(version)[:20] if isinstance(version, (int, float, str)) else type(version).__name__
    raise UnusableCheckpoint(f"{where} has a record of version {shown!s}, which no smolbench writes (this one "
                             f"reads {RECORD_VERSION}): {EXPORTED}")
