"""Audit: what decompresses to nothing cost a checkpoint check its compressed bytes, unbounded.
Python's gzip skips zero padding after a member a byte at a time (~4.5 MB/s), and the check's
last read, to reach gzip's checksum, was capped by the bytes it decompressed only: a valid
checkpoint followed by 1 TiB of zeros (a sparse file), named by a ledger row, was read for days,
in a thread a Ctrl-C doesn't stop. Each test counts the compressed bytes gzip reads.
"""

from __future__ import annotations

import gzip
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
from ckpthelpers import CK, forged, record

from smolbench.gate import archive
from smolbench.ledger import Ledger
from smolbench.shelf import Shelf

BUDGET = 2 << 20  # compressed bytes any of these checks may read (each file's data is a few kB)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Compressed bytes gzip has read, counted (past BUDGET: the test fails, not the host's days)."""
    seen = [0]
    real = gzip._PaddedFile.read  # type: ignore[attr-defined]

    def read(self: Any, size: int) -> bytes:
        data: bytes = real(self, size)
        seen[0] += len(data)
        assert seen[0] <= BUDGET, f"gzip read {seen[0]:,} compressed bytes"
        return data

    monkeypatch.setattr(gzip._PaddedFile, "read", read)  # type: ignore[attr-defined]
    return seen


def _good(path: Path) -> bytes:
    forged(path, record(name=path.name.split(".")[0]))
    return path.read_bytes()


def test_a_row_s_file_over_the_limit_is_refused_before_any_of_it_is_read(tmp_path: Path, reads: list[int],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "class").mkdir()
    size = len(_good(tmp_path / "class" / "lesson1.smolcheckpoint"))
    folder = tmp_path / "student"
    folder.mkdir()
    monkeypatch.chdir(folder)
    led = Ledger(folder / ".smolbench" / "ledger.db")
    try:
        shelf = Shelf(led)
        shelf.adopt("../class/lesson1.smolcheckpoint", None)
        reads[0] = 0
        os.truncate(folder / CK / "lesson1.smolcheckpoint", size + (1 << 40))  # 1 TiB of zeros after it
        with pytest.raises(archive.UnsafeCheckpoint, match=r"^checkpoint 'lesson1' is 1100 GB, over the checkpoint "
                                                            r"limit of 2\.0 GB: not read"):
            shelf.refusal_before_up("lesson1")
        with pytest.raises(archive.UnsafeCheckpoint, match="over the checkpoint limit"):  # a backend's own check
            archive.check_sized(str(folder / CK / "lesson1.smolcheckpoint"))
    finally:
        led.close()
    assert reads[0] == 0


def test_zero_padding_after_the_gzip_data_is_refused_after_one_read(tmp_path: Path, reads: list[int]) -> None:
    path = tmp_path / "padded.smolcheckpoint"
    size = len(_good(path))
    os.truncate(path, size + (100 << 20))  # within the checkpoint limit
    with pytest.raises(archive.UnsafeCheckpoint, match=r"^checkpoint padded\.smolcheckpoint has more than 66 KB "
                                                       r"of zero bytes after its gzip data, which no smolbench writes"):
        archive.check_sized(str(path))
    assert reads[0] <= size + (64 << 10) + (256 << 10)  # the padding allowed, and gzip's buffer
    os.truncate(path, size + 10240)  # a tape's block of padding: skipped
    assert archive.check(str(path))["name"] == "padded"


def _nothing_blocks(tar: bytes, count: int) -> bytes:
    """``tar`` as one gzip member whose deflate data holds ``count`` empty stored blocks after it:
    bytes that decompress to nothing, and a right checksum at their end."""
    deflate = zlib.compressobj(6, zlib.DEFLATED, -15)
    body = deflate.compress(tar) + deflate.flush(zlib.Z_FULL_FLUSH)  # byte-aligned, no history kept
    body += b"\x00\x00\x00\xff\xff" * count + deflate.flush()
    return b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + body + struct.pack("<II", zlib.crc32(tar), len(tar))


def test_the_checksum_drain_is_capped_by_compressed_bytes_too(tmp_path: Path, reads: list[int]) -> None:
    path = tmp_path / "blocks.smolcheckpoint"
    tar = gzip.decompress(_good(path))
    path.write_bytes(_nothing_blocks(tar, 1_000_000))  # 5 MB
    assert archive.check(str(path))["name"] == "blocks"  # past the drain: unchecked, as a long honest file
    assert reads[0] <= len(tar) + archive.DRAIN_LIMIT + (256 << 10)


def test_more_gzip_members_than_smolbench_writes_are_refused(tmp_path: Path, reads: list[int]) -> None:
    path = tmp_path / "members.smolcheckpoint"
    data = _good(path)
    path.write_bytes(data + gzip.compress(b"") * 10_000)
    with pytest.raises(archive.UnsafeCheckpoint, match=r"^checkpoint members\.smolcheckpoint has more than 4 gzip "
                                                       r"members, which no smolbench writes: refused$"):
        archive.check_sized(str(path))
    forged(path, None)  # two, as an export writes: a record's member, then a save's file as it was
    path.write_bytes(gzip.compress(gzip.decompress(data)[:1024]) + path.read_bytes())
    assert archive.check(str(path))["name"] == "members"
