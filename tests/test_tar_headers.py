"""Third audit: tar headers in a checkpoint from someone else are checked before tarfile acts on them.

A 201-byte workspace archive with a negative size (base-256) sent tarfile back onto the same
header forever, memory growing (CVE-2025-8194; this Python has it), and a few MB of gzip
holding one long-name or pax header made GBs of host memory, read whole before any limit ran,
also in the Jupyter server listing the sidebar's checkpoints. Each attack runs against the
checked reader and, where it can be shown safely, against the weakened one (counting the
members it read or the memory it took).
"""

from __future__ import annotations

import gzip
import io
import tarfile
import time
import tracemalloc
from pathlib import Path

import pytest

from smolbench.errors import SmolbenchError
from smolbench.gate import archive

BLOCK = 512


def _header(name: str, size: int = 0, kind: bytes = tarfile.REGTYPE, raw_size: bytes | None = None) -> bytes:
    """One ustar header, its size field as given (``raw_size``: the 12 bytes exactly)."""
    info = tarfile.TarInfo(name)
    info.size, info.type = max(size, 0), kind
    buf = bytearray(info.tobuf(format=tarfile.USTAR_FORMAT))
    if raw_size is not None:
        buf[124:136] = raw_size
    buf[148:156] = b" " * 8
    buf[148:156] = b"%06o\0 " % sum(buf)
    return bytes(buf)


NEGATIVE = b"\xff" * 10 + b"\xfe\x00"  # base-256 for -512: back onto the same header


def negative_size_tar() -> bytes:
    return _header("a.txt", 1) + b"x".ljust(BLOCK, b"\0") + _header("b.txt", raw_size=NEGATIVE) + b"\0" * BLOCK * 2


def meta_bomb(kind: bytes, size: int) -> bytes:
    """One long-name or pax header claiming ``size`` bytes of its own data (zeros: gzip makes them small)."""
    data = (b"a" * (size - 1) + b"\0") if kind == tarfile.GNUTYPE_LONGNAME else (b"%d x=" % size).ljust(size, b"y")
    pad = -len(data) % BLOCK
    return _header("././@LongLink", size, kind) + data + b"\0" * pad + _header("f", 0) + b"\0" * BLOCK * 2


def test_a_negative_size_is_refused_at_once() -> None:
    t = time.monotonic()
    with pytest.raises(archive.UnsafeCheckpoint, match="negative size"):
        archive.check_workspace(negative_size_tar(), "checkpoint evil")
    assert time.monotonic() - t < 5


def test_weakened_the_negative_size_reads_the_same_header_over_and_over(monkeypatch: pytest.MonkeyPatch) -> None:
    # Weakened, tarfile steps back onto the same header each time: a three-member archive reads
    # as thousands of members until the member count (a second line) stops it. Counted, not
    # timed: a deadline here raced that count on a fast host.
    monkeypatch.setattr(archive, "TEST_WEAKEN", {"tarheaders"})
    monkeypatch.setattr(archive, "MEMBER_LIMIT", 10_000)
    with pytest.raises(archive.UnsafeCheckpoint, match="more than 10,000 files"):
        archive.check_workspace(negative_size_tar(), "weak")


@pytest.mark.parametrize("kind", [tarfile.GNUTYPE_LONGNAME, tarfile.XHDTYPE])
def test_a_huge_long_name_or_pax_header_is_refused_before_it_is_read(kind: bytes, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    size = 8 << 20
    path = tmp_path / "evil.smolcheckpoint"
    path.write_bytes(gzip.compress(meta_bomb(kind, size)))
    assert path.stat().st_size < size // 100  # what the sender ships is small

    def peak(check: bool) -> int:
        tracemalloc.start()
        try:
            with pytest.raises((archive.UnsafeCheckpoint, tarfile.TarError, archive.SmolbenchError)) as got:
                archive.check(str(path))
            if check:
                assert "long name or pax header of 8.4 MB, over" in str(got.value), got.value
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    assert peak(True) < size // 4
    monkeypatch.setattr(archive, "TEST_WEAKEN", {"tarheaders"})
    assert peak(False) >= size  # weakened: the whole header read into memory first


def test_sparse_members_and_negative_pax_sizes_are_refused() -> None:
    pax = io.BytesIO()
    with tarfile.open(fileobj=pax, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("s.bin")
        info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": "s.bin"}
        tar.addfile(info, io.BytesIO())
    with pytest.raises(archive.UnsafeCheckpoint, match="sparse"):
        archive.check_workspace(pax.getvalue(), "checkpoint evil")
    neg = io.BytesIO()
    with tarfile.open(fileobj=neg, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("n.bin")
        info.pax_headers = {"size": "-512"}
        tar.addfile(info, io.BytesIO())
    with pytest.raises(archive.UnsafeCheckpoint, match="negative size"):
        archive.check_workspace(neg.getvalue(), "checkpoint evil")


def test_an_ordinary_workspace_still_passes() -> None:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("a.txt", "d/" + "n" * 200 + ".txt"):  # a long name: a pax header of its own
            data = name.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    archive.check_workspace(out.getvalue(), "checkpoint fine")


def test_more_members_than_the_limit_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(archive, "MEMBER_LIMIT", 10)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for i in range(11):
            tar.addfile(tarfile.TarInfo(f"f{i}"), io.BytesIO())
    with pytest.raises(archive.UnsafeCheckpoint, match="more than 10 files"):
        archive.check_workspace(out.getvalue(), "checkpoint many")


# -- audit of round 4: a shared checkpoint file's structure ----------------------------------


def longname_chain(n: int) -> bytes:
    """``n`` GNU long-name headers in a row, then a member: tarfile recurses once for each."""
    data = b"x" * 10 + b"\0"
    head = _header("././@LongLink", len(data), tarfile.GNUTYPE_LONGNAME) + data.ljust(BLOCK, b"\0")
    return head * n + _header("f", 0) + b"\0" * BLOCK * 2


def test_a_chain_of_long_name_headers_is_one_line_not_a_recursion_error(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """20 KB of 5,000 chained headers raised RecursionError: past every caller, so a file dropped
    into a folder's checkpoints broke its listing (the sidebar's too) instead of being refused."""
    chain = longname_chain(5000)
    with pytest.raises(archive.UnsafeCheckpoint, match="more than 8 long-name or pax headers in a row"):
        archive.check_workspace(chain, "checkpoint evil")
    dropped = tmp_path / "evil.smolcheckpoint"
    dropped.write_bytes(gzip.compress(chain))
    with pytest.raises(archive.UnsafeCheckpoint, match="in a row"):  # the listing's one line for the file
        archive.read_record(str(dropped))
    archive.check_workspace(longname_chain(3), "checkpoint fine")  # a few in a row, as tar writes them
    monkeypatch.setattr(archive, "TEST_WEAKEN", {"tarheaders"})
    with pytest.raises(RecursionError):
        archive.check_workspace(chain, "checkpoint evil")


def _checkpoint(path: Path, records: int) -> None:
    """A checkpoint file with ``records`` records first, then its two files."""
    record = b'{"kind": "smolbench-checkpoint", "version": 1, "name": "gift", "backend": "sandbox"}'
    ws = io.BytesIO()
    with tarfile.open(fileobj=ws, mode="w"):
        pass
    with tarfile.open(path, "w:gz") as tar:
        for name, data in [(archive.RECORD, record)] * records + [("namespace.pkl", b"x"),
                                                                  ("workspace.tar", ws.getvalue())]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_a_checkpoint_file_has_one_record_at_most(tmp_path: Path) -> None:
    """A million copies of a valid record (4 MB of gzip) were all accepted, tarfile keeping a
    header object for each: 500 MB of the restoring process, growing with the file."""
    _checkpoint(tmp_path / "one.smolcheckpoint", 1)
    assert (archive.check(str(tmp_path / "one.smolcheckpoint")) or {})["name"] == "gift"
    _checkpoint(tmp_path / "two.smolcheckpoint", 2)
    with pytest.raises(SmolbenchError, match=r"is not a sandbox checkpoint \(has \['namespace.pkl', "
                                             r"'smolbench-record.json', 'workspace.tar'\]\)"):
        archive.check(str(tmp_path / "two.smolcheckpoint"))


def _workspace(*members: tuple[str, bytes, str]) -> bytes:
    """A workspace archive of (name, type, link target) members."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, target in members:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, target
            tar.addfile(info, io.BytesIO())
    return out.getvalue()


def test_names_deeper_than_any_file_system_makes_are_refused() -> None:
    """A 370-byte gzip of a link ``b/.../a -> .`` and a name of 30,000 parts took 97 s to check:
    each part's lookup joined every part before it, for each of 40 link hops."""
    deep = "b/" * 30000 + "a/" * 39 + "f"
    with pytest.raises(archive.UnsafeCheckpoint, match="pax header of 60 KB, over 12 KB"):  # its pax header
        archive.check_workspace(_workspace(("b/" * 100 + "a", tarfile.SYMTYPE, "."), (deep, tarfile.REGTYPE, "")),
                                "checkpoint deep")
    deep = "b/" * 3000 + "a/" * 39 + "f"  # within a pax header's limit, past PATH_MAX
    with pytest.raises(archive.UnsafeCheckpoint, match="longer than 4,096 bytes"):
        archive.check_workspace(_workspace(("b/" * 100 + "a", tarfile.SYMTYPE, "."), (deep, tarfile.REGTYPE, "")),
                                "checkpoint deep")
    # as deep as a file system allows, through 39 hops of a link: checked; past 40 hops, refused
    loop = ("b/" * 2000 + "a", tarfile.SYMTYPE, ".")
    archive.check_workspace(_workspace(loop, ("b/" * 2000 + "a/" * 39 + "f", tarfile.REGTYPE, "")), "checkpoint near")
    with pytest.raises(archive.UnsafeCheckpoint, match="reached through a link outside it"):
        archive.check_workspace(_workspace(loop, ("b/" * 2000 + "a/" * 41 + "f", tarfile.REGTYPE, "")),
                                "checkpoint near")


def test_all_names_and_their_walks_through_links_are_bounded_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each name is now checked in steps linear in its parts, but 500,000 members of 4 KB
    names through 39 hops each (a few MB of gzip) would still be hours, and their names 2 GB
    kept by tarfile: both have a budget for the whole archive."""
    loop = ("b/" * 2000 + "a", tarfile.SYMTYPE, ".")
    many = [loop] + [("b/" * 2000 + "a/" * 39 + f"f{i}", tarfile.REGTYPE, "") for i in range(30)]
    archive.check_workspace(_workspace(*many), "checkpoint fine")  # within both at their defaults
    monkeypatch.setattr(archive, "WALK_LIMIT", 1_000_000)  # ~80,000 steps a name here
    with pytest.raises(archive.UnsafeCheckpoint, match="take more than 1,000,000 steps to follow"):
        archive.check_workspace(_workspace(*many), "checkpoint slow")
    monkeypatch.setattr(archive, "NAMES_LIMIT", 100_000)
    with pytest.raises(archive.UnsafeCheckpoint, match="names of more than 100 KB in all"):
        archive.check_workspace(_workspace(*many), "checkpoint names")


def test_a_member_s_name_reaches_the_user_quoted_never_as_terminal_escapes() -> None:
    fake = "/\x1b]0;pwned\x07\x1b[2K\rsmolbench: restored lesson as r1-lesson (now active)\nx"
    with pytest.raises(archive.UnsafeCheckpoint) as refused:
        archive.check_workspace(_workspace((fake, tarfile.REGTYPE, "")), "checkpoint evil")
    line = str(refused.value)
    assert line.isprintable() and "has a file outside its workspace ('/\\x1b]0;pwned\\x07" in line, line
    with pytest.raises(archive.UnsafeCheckpoint, match=r"points outside it \(shadow -> /etc/shadow\)"):
        archive.check_workspace(_workspace(("shadow", tarfile.SYMTYPE, "/etc/shadow")), "checkpoint plain")
