"""Audit: a listing's cost in files dropped into the checkpoint folder. Reading a record walked
gzip members by copying the rest of the buffer each time (quadratic): 1 MB of 50,000 empty
members took 1.27 s in ``read_record``, ten such files made one listing take 15 s, and the
sidebar lists them on every poll. Members are counted now, and a listing reads a bounded
number of dropped files.
"""

from __future__ import annotations

import gzip
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import pytest
from ckpthelpers import CK, forged, record
from ledgerhelpers import rows_left_out

from smolbench.gate import archive
from smolbench.ledger import Ledger
from smolbench.shelf import Shelf


def test_many_gzip_members_before_the_record_are_refused_after_a_few(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "members.smolcheckpoint"
    forged(path, record(name="members"))
    good = path.read_bytes()
    path.write_bytes(gzip.compress(b"", mtime=0) * 40_000 + good)  # 800 kB, the record within the first MB
    members = [0]
    real = zlib.decompressobj

    def counted(*args: Any, **kwargs: Any) -> Any:
        members[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(zlib, "decompressobj", counted)
    with pytest.raises(archive.UnsafeCheckpoint, match=r"^members\.smolcheckpoint has more than 4 gzip members, "
                                                       r"which no smolbench writes: refused$"):
        archive.read_record(str(path))
    assert members[0] <= 4
    path.write_bytes(gzip.compress(b"", mtime=0) + b"\0" * 100 + good)  # a few, NULs between: read as before
    assert archive.read_record(str(path))["name"] == "members"


def test_a_listing_reads_a_bounded_number_of_dropped_files_and_says_so(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / CK).mkdir(parents=True)
    for i in range(30):
        forged(tmp_path / CK / f"c{i:02}.smolcheckpoint", record(name=f"c{i:02}"))
    reads: list[str] = []
    real = archive.read_record

    def read_record(path: str, label: str | None = None) -> Any:
        reads.append(str(label))
        return real(path, label)

    monkeypatch.setattr(archive, "read_record", read_record)
    led = Ledger(tmp_path / ".smolbench" / "ledger.db")
    try:
        shelf = Shelf(led)
        lines = shelf.lines()
        assert len(reads) == 20, reads
        assert sum("not read: a listing reads 20 dropped files at most" in line for line in lines) == 10, lines
        reads.clear()
        assert shelf.find("c29")["backend"] == "sandbox"  # one asked for by name is read, alone
        assert reads == ["c29.smolcheckpoint"]
    finally:
        led.close()


def test_the_rows_a_listing_leaves_out_are_read_in_bounded_memory(tmp_path: Path) -> None:
    """Eighth audit: the files of the rows a listing leaves out (not files dropped in) were found
    by reading every such row's path at once (the sidebar's: an 8.9 MB ledger cost 497 MB); the
    rows are read one at a time now, and what is kept is a name per file in the folder."""
    db = rows_left_out(tmp_path)
    led = Ledger.read_only(db)
    assert led is not None
    try:
        tracemalloc.start()
        try:
            rows, total, left = Shelf(led).listing()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    finally:
        led.close()
    assert total == 2500 + 5 + 500
    # the listing's room is the newest rows': the one dropped file is counted, c0..c4 are rows' files
    assert not [r for r in rows if r.get("dropped")] and left is not None and left.startswith("1 more checkpoint file "), left
    assert peak < 2_000_000, peak  # the 2,500 paths left out: 5 MB
