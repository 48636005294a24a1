"""Fifth audit: a shared checkpoint file made to cost the host memory or CPU, or to break the
folder's checkpoint listing. Each crafted file is built here, small, as the audit built it
(Python 3.11.7, without CVE-2024-6232's fix), and refused in one line before the expensive
step, or read with bounded work.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import tarfile
import tracemalloc
import zlib
from pathlib import Path

import pytest

from smolbench.errors import SmolbenchError
from smolbench.gate import archive, ckptwrite, gzipread
from smolbench.gate.limits import LIMITS
from smolbench.ledger import Ledger
from smolbench.shelf import Shelf

BLOCK = 512


def _header(name: str, size: int = 0, kind: bytes = tarfile.REGTYPE) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type = size, kind
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def _meta(kind: bytes, data: bytes) -> bytes:
    """A pax (or global pax) header holding ``data`` as its own bytes."""
    return _header("././@PaxHeader", len(data), kind) + data + b"\0" * (-len(data) % BLOCK)


def _record(key: bytes, value: bytes = b"") -> bytes:
    """One pax record ``LEN KEY=VALUE\\n``, its length counting itself."""
    body = b" %s=%s\n" % (key, value)
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n = len(str(n)) + len(body)
    return b"%d%s" % (n, body)


def _keys(prefix: bytes, size: int) -> bytes:
    """Pax records of distinct empty keys, ``size`` bytes at most."""
    out, i = b"", 0
    while len(out) + 16 < size:
        out += _record(b"%s%d" % (prefix, i))
        i += 1
    return out


END = b"\0" * BLOCK * 2
RECORD = json.dumps({"kind": "smolbench-checkpoint", "version": 1, "name": "gift", "backend": "sandbox"}).encode()


def _member(name: str, data: bytes) -> bytes:
    return _header(name, len(data)) + data + b"\0" * (-len(data) % BLOCK)


def _checkpoint_tar(first: bytes = b"", namespace: bytes = b"x", file: bytes = b"hi") -> bytes:
    """A checkpoint's tar (``first``: raw headers before its record), as smolbench exports one."""
    ws = _member("hello.txt", file) + END
    return first + _member(archive.RECORD, RECORD) + _member("namespace.pkl", namespace) + \
        _member("workspace.tar", ws) + END


def _damaged(tar: bytes, good: int = BLOCK + 8) -> bytes:
    """``tar`` gzip'd, its deflate data broken after the first ``good`` bytes (an invalid block)."""
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    body = deflate.compress(tar[:good]) + deflate.flush(zlib.Z_FULL_FLUSH) + b"\x07"  # BTYPE 11: reserved
    return b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + body


def _folder(tmp_path: Path, **files: bytes) -> Path:
    ck = tmp_path / ".smolbench" / "checkpoints"
    ck.mkdir(parents=True)
    for name, data in files.items():
        (ck / f"{name}.smolcheckpoint").write_bytes(data)
    return ck


# -- global pax headers, and pax keys kept by every member -------------------------------------


def test_a_global_pax_header_is_refused_before_its_keys_reach_any_member() -> None:
    """tarfile copies a global header's keys into every later member: 32 global headers of
    64 KiB of keys, then 500 empty members (389 kB of gzip) took 1,956 MiB to check, and 5,000
    members were a MemoryError at 4 GB. smolbench never writes a global header. (Smaller
    here: 8 headers and 100 members held 1,000,000 keys, ~100 MB.)"""
    bomb = b"".join(_meta(tarfile.XGLTYPE, _keys(b"k%d_" % g, 12 * 1024)) + _header(f"g{g}") for g in range(8))
    bomb += b"".join(_header(f"f{i}") for i in range(100)) + END
    with pytest.raises(archive.UnsafeCheckpoint) as refused:
        archive.check_workspace(bomb, "checkpoint gift")
    assert str(refused.value) == ("checkpoint gift is not a readable archive (a global pax header (type 'g'), "
                                  "which smolbench never writes)")


def test_members_keep_none_of_their_pax_keys() -> None:
    """A pax header of its own for each member, full of keys: tarfile kept every member's keys
    for the whole check (the archive is checked with all its members in hand)."""
    members = 300
    blob = b"".join(_meta(tarfile.XHDTYPE, _keys(b"k", 12 * 1024 - 100)) + _header(f"f{i}")
                    for i in range(members)) + END
    tracemalloc.start()
    try:
        archive.check_workspace(blob, "checkpoint keys")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak >> 20} MiB"  # tarfile's way: 1,200 keys a member, 36+ MiB here


def test_pax_records_have_a_budget_for_the_whole_archive(monkeypatch: pytest.MonkeyPatch) -> None:
    """However many members, parsing their pax records is bounded: 2 GB of tiny records are
    minutes of Python."""
    blob = b"".join(_meta(tarfile.XHDTYPE, _keys(b"k", 4096)) + _header(f"f{i}") for i in range(10)) + END
    archive.check_workspace(blob, "checkpoint keys")
    monkeypatch.setattr(archive, "PAX_RECORDS_LIMIT", 1000)
    with pytest.raises(archive.UnsafeCheckpoint, match=r"\(more than 1,000 pax records in all\)"):
        archive.check_workspace(blob, "checkpoint keys")


# -- pax headers parsed in one pass (CVE-2024-6232) --------------------------------------------


@pytest.mark.parametrize("size, why", [(65535, "a long name or pax header of 66 KB, over 12 KB"),
                                       (12 * 1024, "a pax header that is not pax records (at byte 0 of 12288)")],
                         ids=["the-audit-s-64-KiB", "within-the-limit"])
def test_a_pax_header_that_is_not_records_is_refused_before_tarfile_parses_it(size: int, why: str) -> None:
    """tarfile searched a pax header with a backtracking regex: 8 headers of 65,535 bytes of
    "1" before the record (1,052 bytes of gzip) took 27.8 s of CPU, and the record was
    accepted; the sidebar's listing read it again every 5 s."""
    blob = _meta(tarfile.XHDTYPE, b"1" * size) + _header("f") + END
    with pytest.raises(archive.UnsafeCheckpoint) as refused:
        archive.check_workspace(blob, "checkpoint cve")
    assert str(refused.value) == f"checkpoint cve is not a readable archive ({why})"


@pytest.mark.parametrize("data", [b"5 k=\n" + b"9 k=v\n", b"0 k=\n", b"99999999999 k=v\n", b"5 kv\n\0",
                                  b"6 k=v\n\0\0\0x", b"x6 k=\n", b"-6 k=\n"],
                         ids=["short-by-one", "zero", "11-digits", "no-equals", "garbage-after", "not-digits",
                              "negative"])
def test_pax_records_must_add_up_exactly(data: bytes) -> None:
    with pytest.raises(archive.UnsafeCheckpoint, match="a pax header that is not pax records"):
        archive.check_workspace(_meta(tarfile.XHDTYPE, data) + _header("f") + END, "checkpoint frame")


def test_honest_pax_headers_read_as_tarfile_reads_them() -> None:
    """What Python's tarfile writes, pax or GNU: names and link targets of 4,096 bytes (digits
    too), a name that is not UTF-8 (hdrcharset=BINARY), float times, a big uid."""
    for fmt in (tarfile.PAX_FORMAT, tarfile.GNU_FORMAT):
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
            link = tarfile.TarInfo(("1" * 250 + "/") * 16 + "0" * 80)  # 4,096 bytes
            link.type, link.linkname, link.mtime, link.uname = tarfile.SYMTYPE, "2" * 254 + "/" + "e" * 3841, 1.5, "ü"
            odd = tarfile.TarInfo("caf\udce9-" + "x" * 200)
            odd.size, odd.mtime, odd.uid = 3, 12345.678, 10**9
            tar.addfile(link)
            tar.addfile(odd, io.BytesIO(b"abc"))
        blob = out.getvalue()
        assert len(link.name) == len(link.linkname) == 4096
        archive.check_workspace(blob, "checkpoint honest")
        with archive.open_tar(fileobj=io.BytesIO(blob), mode="r:") as tar:
            got = [(m.name, m.linkname, m.mtime, m.uid, m.uname, m.size, m.offset_data) for m in tar]
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tar:
            assert got == [(m.name, m.linkname, m.mtime, m.uid, m.uname, m.size, m.offset_data) for m in tar]


# -- the tree of link names -------------------------------------------------------------------


def _links(*names: str, target: str = ".") -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return out.getvalue()


def test_link_names_are_counted_before_their_tree_is_built() -> None:
    """The check looks links up in a tree of their names' parts, built before the walk's budget
    was charged: 3,000 links ``uNNNNNN/x/x/.../l -> .`` (68 kB of gzip) were 6,000,000 nodes,
    1.2 GB, and 31,000 a MemoryError at 3 GB. Here 490 of them, 1,000,580 parts (the old way:
    175 MiB of nodes)."""
    blob = _links(*(f"u{i:06d}/" + "x/" * 2040 + "l" for i in range(490)))
    tracemalloc.start()
    try:
        with pytest.raises(archive.UnsafeCheckpoint) as refused:
            archive.check_workspace(blob, "checkpoint links")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(refused.value) == "checkpoint links has links whose names have more than 1,000,000 parts in all: refused"
    assert peak < 32 << 20, f"{peak >> 20} MiB"
    # many links in a few folders, as node_modules/.bin has them: checked
    archive.check_workspace(_links(*(f"node_modules/.bin/tool{i}" for i in range(20_000)), target="../x"),
                            "checkpoint bins")


# -- one dropped file never breaks the listing -------------------------------------------------


def test_a_bad_file_is_one_line_and_the_listing_still_shows_the_rest(tmp_path: Path) -> None:
    """A pax header ``21 hdrcharset=\\xff\\xfe\\xfd`` before the record raised tarfile's
    UnicodeDecodeError past the listing's catch: the server's checkpoint list, `%smol checkpoint
    list`, restoring any checkpoint of the folder by name all failed, and `restore PATH` of the
    file showed a traceback (that record is 18 bytes, not 21: tarfile didn't check). Damaged
    gzip data (a zlib.error) did the same."""
    audit = _meta(tarfile.XHDTYPE, b"21 hdrcharset=\xff\xfe\xfd\n")
    charset = _meta(tarfile.XHDTYPE, b"18 hdrcharset=\xff\xfe\xfd\n")
    ck = _folder(tmp_path, good=gzip.compress(_checkpoint_tar()), audit=gzip.compress(_checkpoint_tar(audit)),
                 charset=gzip.compress(_checkpoint_tar(charset)), damaged=_damaged(_checkpoint_tar()))
    why = "damaged.smolcheckpoint is cut short or damaged (its compressed data is damaged: Error -3 while " \
          "decompressing data: invalid block type): copy the whole file again from where it came from"
    led = Ledger(tmp_path / ".smolbench" / "ledger.db")
    try:
        shelf = Shelf(led)
        rows = {r["name"]: r for r in shelf.rows()}
        assert rows["good"]["backend"] == "sandbox" and rows["good"]["refused"] is None
        assert rows["audit"]["refused"] == ("audit.smolcheckpoint is not a readable checkpoint (a pax header that "
                                            "is not pax records (at byte 0 of 18)): ask for one made with "
                                            "`%smol checkpoint export NAME PATH`")
        assert rows["charset"]["backend"] == "sandbox"  # a charset tarfile doesn't know is no harm: UTF-8
        assert rows["damaged"]["backend"] is None and rows["damaged"]["refused"] == why
        assert shelf.find("good") is not None
        assert f"  damaged  ?  .smolbench/checkpoints/damaged.smolcheckpoint  dropped in, not in the ledger yet · {why}" \
            in shelf.lines()
        with pytest.raises(archive.UnsafeCheckpoint) as refused:  # `restore PATH` with nothing up
            shelf.backend_for(str(ck / "damaged.smolcheckpoint"))
        assert str(refused.value) == why.replace("damaged.smolcheckpoint", str(ck / "damaged.smolcheckpoint"))
        with pytest.raises(SmolbenchError, match=r"is cut short or damaged \(its compressed data is damaged: .*\): copy "
                                                 r"the whole file again from where it came from; nothing was added$"):
            shelf.adopt(str(ck / "damaged.smolcheckpoint"), None)
    finally:
        led.close()


@pytest.mark.parametrize("where", ["record", "namespace", "workspace"])
def test_damaged_gzip_data_is_a_tar_error_for_a_restore(where: str, tmp_path: Path) -> None:
    """A restore catches tarfile's errors for its one line; a zlib.error in a member's data (or
    while tarfile skipped one) went past it as a traceback."""
    big = bytes(range(256)) * 400  # 100 KB
    tar = _checkpoint_tar(namespace=big, file=big)
    at = {"record": BLOCK + 8, "namespace": 3 * BLOCK + 50_000, "workspace": 6 * BLOCK + len(big) + 50_000}[where]
    path = tmp_path / "damaged.smolcheckpoint"
    path.write_bytes(_damaged(tar, at))
    # (said as damage, archive.Damaged, where gzip's checksum could be reached to tell)
    with pytest.raises(tarfile.ReadError, match="^(zlib error|its compressed data is damaged): Error -3 while "
                                                "decompressing data: invalid block type$"):
        archive.check(str(path))


def test_the_listing_names_a_file_it_can_t_read_whatever_went_wrong(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _folder(tmp_path, good=gzip.compress(_checkpoint_tar()), odd=gzip.compress(_checkpoint_tar()))
    real = archive.read_record

    def read_record(path: str, label: str | None = None) -> object:
        if label == "odd.smolcheckpoint":
            raise RuntimeError("something no one foresaw")
        return real(path, label)

    monkeypatch.setattr(archive, "read_record", read_record)
    led = Ledger(tmp_path / ".smolbench" / "ledger.db")
    try:
        rows = {r["name"]: r for r in Shelf(led).rows()}
    finally:
        led.close()
    assert rows["good"]["backend"] == "sandbox"
    assert rows["odd"]["refused"] == ".smolbench/checkpoints/odd.smolcheckpoint can't be read (something no one " \
                                     "foresaw): skipped"


# -- what a listing reads of each file ---------------------------------------------------------


def _read_bytes() -> int:
    """Bytes this process has read from files so far (the kernel's count)."""
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))


def test_a_record_is_looked_for_in_a_file_s_first_megabyte_only(tmp_path: Path) -> None:
    """A gzip header whose name field never ends: Python's gzip read it one byte at a time to
    the end of the file (21 MB: 1.2 s of CPU), for every listing of the folder (the sidebar
    polls every 5 s); a file of GBs was minutes each time."""
    path = tmp_path / "endless.smolcheckpoint"
    with open(path, "wb") as fh:
        fh.write(b"\x1f\x8b\x08\x08" + b"\0" * 6)  # FNAME set
        for _ in range(16):
            fh.write(b"a" * (1 << 20))
    before = _read_bytes()
    with pytest.raises(archive.UnsafeCheckpoint) as refused:
        archive.read_record(str(path))
    read = _read_bytes() - before
    assert read < 2 << 20, f"read {read >> 20} MiB of 16"
    assert str(refused.value) == ("endless.smolcheckpoint has a gzip header whose name or comment field doesn't end "
                                  "within its first 1.0 MB, which no gzip writer makes")


def _endless(path: Path, before: bytes = b"") -> None:
    """``before``, then a gzip member header whose name field runs 4 MB to the file's end."""
    with open(path, "wb") as fh:
        fh.write(before + b"\x1f\x8b\x08\x08" + b"\0" * 6)  # FNAME set
        for _ in range(4):
            fh.write(b"a" * (1 << 20))


def _hand_over(path: Path, folder: Path) -> None:
    fd = os.open(folder, os.O_PATH | os.O_DIRECTORY)
    try:
        ckptwrite.hand_over(str(path), fd, "stage")
    finally:
        os.close(fd)


@pytest.mark.parametrize("before", ["nothing", "an-honest-member"])
def test_a_restore_refuses_a_gzip_name_field_that_never_ends(before: str, tmp_path: Path) -> None:
    """A restore (its check, the hand-over, `restore PATH`'s adding) read the file through
    Python's gzip, which reads a header's name field a byte at a time to the end of the file:
    2 GB took ~2 minutes of CPU, and 4 MB here are read whole before a truncation error. The
    listing's rule now holds for every member's header a restore reads: refused in one line
    after the first MB. (An honest first member without the tar's end sends the restore on
    into the second.)"""
    path = tmp_path / "endless.smolcheckpoint"
    _endless(path, b"" if before == "nothing" else gzip.compress(_checkpoint_tar()[:-len(END)]))
    why = "has a gzip header whose name or comment field doesn't end within its first 1.0 MB, which no gzip writer makes"
    for step in (lambda: archive.check(str(path)), lambda: _hand_over(path, tmp_path)):
        start = _read_bytes()
        with pytest.raises(archive.UnsafeCheckpoint) as refused:
            step()
        read = _read_bytes() - start
        assert read < 2 << 20, f"read {read >> 20} MiB of 4"
        assert str(refused.value) == f"checkpoint endless.smolcheckpoint {why}"
    led = Ledger(tmp_path / ".smolbench" / "ledger.db")
    try:
        with pytest.raises(archive.UnsafeCheckpoint) as refused:  # `restore PATH`: the file is added first
            Shelf(led).adopt(str(path), None)
    finally:
        led.close()
    assert str(refused.value) == f"checkpoint {path} {why}; nothing was added"
    assert not list((tmp_path / ".smolbench" / "checkpoints").iterdir())


def test_a_python_whose_gzip_skips_our_header_check_is_refused_not_trusted(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The check rides on CPython's own gzip reader (its header method): a Python whose gzip
    stopped calling it would read headers unchecked, silently. It is refused in one line."""
    path = tmp_path / "honest.smolcheckpoint"
    path.write_bytes(gzip.compress(_checkpoint_tar()))
    archive.check(str(path))  # read as it is, here
    monkeypatch.setattr(gzipread.CheckedGzipReader, "_read_gzip_header", gzip._GzipReader._read_gzip_header)
    with pytest.raises(archive.UnsafeCheckpoint, match="this Python's gzip module reads files in a way smolbench "
                                                       "can't check"):
        archive.check(str(path))


def test_a_record_first_in_a_big_checkpoint_is_read(tmp_path: Path) -> None:
    """As exported (tarfile's gzip, its name field set): the record first, then 3 MB of namespace."""
    path = tmp_path / "big.smolcheckpoint"
    with tarfile.open(path, "w:gz") as tar:
        for name, data in ((archive.RECORD, RECORD), ("namespace.pkl", random.Random(0).randbytes(3_000_000)),
                           ("workspace.tar", _member("hello.txt", b"hi") + END)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert path.stat().st_size > 1_000_000
    assert archive.read_record(str(path)) == json.loads(RECORD)
    cut = tmp_path / "cut.smolcheckpoint"  # one cut short within the record: what is there is wrong
    cut.write_bytes(path.read_bytes()[:40])
    with pytest.raises(archive.UnsafeCheckpoint, match=r"^cut.smolcheckpoint is not a readable checkpoint \("):
        archive.read_record(str(cut))


def test_the_listing_names_a_file_over_the_checkpoint_limit_and_reads_none_of_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LIMITS, "checkpoint", 100_000)
    big = gzip.compress(_checkpoint_tar(namespace=bytes(range(256)) * 800), compresslevel=0)
    assert len(big) > 200_000
    _folder(tmp_path, good=gzip.compress(_checkpoint_tar()), big=big)
    led = Ledger(tmp_path / ".smolbench" / "ledger.db")
    try:
        before = _read_bytes()
        rows = {r["name"]: r for r in Shelf(led).rows()}
        read = _read_bytes() - before
    finally:
        led.close()
    assert rows["good"]["backend"] == "sandbox"
    assert rows["big"]["backend"] is None and rows["big"]["refused"] == (
        "big.smolcheckpoint is 210 KB, over the checkpoint limit of 100 KB: not read (raise it with "
        "`%smol config checkpoint-limit 4G` if you trust it)")
    assert read < 100_000, read


def test_a_header_changed_on_its_way_is_said_to_be_damage_when_gzip_s_checksum_fails(tmp_path: Path) -> None:
    """A sector of another file landing in a checkpoint on its way (a failing stick) can be a
    well-formed tar header: it read as "leads outside its workspace" or "not a sandbox
    checkpoint", for a file whose gzip checksum says it is not the one that was written. Where
    the checksum is in reach, the refusal says it is damaged, and to copy it again."""
    ws = _member("hello.txt", b"hi") + END
    tar = _member(archive.RECORD, RECORD) + _member("namespace.pkl", b"x") + _member("workspace.tar", ws) + END
    at = tar.index(b"hello.txt")
    for other in (_header("../../outside.txt", 2), _header("hello.txt", 0, tarfile.CHRTYPE)):
        changed = tar[:at] + other + tar[at + BLOCK:]
        written = gzip.compress(tar)
        path = tmp_path / "damaged.smolcheckpoint"
        path.write_bytes(gzip.compress(changed)[:-8] + written[-8:])  # the checksum of what was written
        with pytest.raises(archive.Damaged, match="^its data fails gzip's checksum$"):
            archive.check(str(path))
        path.write_bytes(gzip.compress(changed))  # made so, with its own checksum: refused for what it is
        with pytest.raises(archive.UnsafeCheckpoint):
            archive.check(str(path))


def test_a_notebooks_views_of_a_folder_of_dropped_files_are_bounded(tmp_path: Path) -> None:
    """The sidebar's listing was bounded (audit: 100,000 dropped files); the kernel's own views
    (`%smol checkpoint list`, the panel, a refusal naming the checkpoints here) still listed
    every dropped file, each refusal line naming them all. They list the newest rows and
    dropped files within one room, and say what they left out in one line."""
    from smolbench import shelf as shelf_module

    ck = tmp_path / ".smolbench" / "checkpoints"
    ck.mkdir(parents=True)
    for i in range(3000):
        os.close(os.open(ck / f"d{i}.smolcheckpoint", os.O_CREAT | os.O_WRONLY, 0o644))
    led = Ledger(tmp_path / ".smolbench" / "ledger.db")
    try:
        shelf = Shelf(led)
        rows, total, left = shelf.listing()
        assert len(rows) == shelf_module.MAX_ROWS and all(r["dropped"] for r in rows) and total == 0
        assert left is not None and "more checkpoint files dropped into" in left and "not listed" in left, left
        lines = shelf.lines()
        assert len(lines) == shelf_module.MAX_ROWS + 2 and left in lines[1], lines[:2]
        refusal = shelf.missing_line("nope")
        assert len(refusal) < 1000 and ", …" in refusal, refusal[:300]
    finally:
        led.close()
