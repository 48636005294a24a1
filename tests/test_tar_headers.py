"""Third audit: tar headers in a checkpoint from someone else are checked before tarfile acts on them.

A 201-byte workspace archive with a negative size (base-256) sent tarfile back onto the same
header forever, memory growing (CVE-2025-8194; this Python has it), and a few MB of gzip
holding one long-name or pax header made GBs of host memory, read whole before any limit ran,
also in the Jupyter server listing the sidebar's checkpoints. Each attack runs against the
checked reader and, where it can be shown safely, against the weakened one (in a subprocess
with a deadline, or counting the memory it took).
"""

from __future__ import annotations

import gzip
import io
import subprocess
import sys
import tarfile
import textwrap
import time
import tracemalloc
from pathlib import Path

import pytest

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


def test_weakened_the_negative_size_loops_forever(tmp_path: Path) -> None:
    blob = tmp_path / "neg.tar"
    blob.write_bytes(negative_size_tar())
    code = textwrap.dedent(f"""
        from smolbench.gate import archive
        archive.TEST_WEAKEN.add("tarheaders")
        archive.check_workspace(open({str(blob)!r}, "rb").read(), "weak")
        print("returned")
    """)
    with pytest.raises(subprocess.TimeoutExpired):  # still appending the same header when stopped
        subprocess.run([sys.executable, "-c", code], timeout=4, capture_output=True)


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
