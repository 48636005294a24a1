"""Eighth audit, 1: the host checked a workspace archive as a plain tar, and the machine opened it
with ``tarfile.open(ws)``, which tries gzip (bz2, xz) first: one set of bytes was a harmless tar to
the host and a gzip of any other tar to the machine (30,000 links and a hidden file restored, every
check skipped). The machine now opens the plain tar the host checked, and the host refuses a
workspace that starts as compressed data."""

from __future__ import annotations

import io
import shutil
import struct
import tarfile
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
from ckpthelpers import NAMESPACE, forged, record, staged_for_the_guest

from smolbench.gate import archive, gzipread


def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def polyglot() -> bytes:
    """The audit's file: a plain tar of one file ("fine") whose first header is also a gzip header
    (its name field gzip's magic, its FEXTRA field the whole tar), followed by deflate data of
    another tar (``hidden.txt``), which only a reader trying gzip sees."""
    hidden = _tar([_file("hidden.txt", b"never seen by the host\n")])

    def plain(extra: int) -> bytes:
        raw = bytearray(_tar([_file("x", b"fine\n")]))
        head = raw[:512]
        head[0:12] = b"\x1f\x8b\x08\x04AAAAAA" + struct.pack("<H", extra)
        head[148:156] = b"        "
        head[148:156] = b"%06o\0 " % sum(head)
        raw[:512] = head
        return bytes(raw)

    first = plain(0)
    first = plain(len(first) - 12)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    return first + deflate.compress(hidden) + deflate.flush() + struct.pack("<II", zlib.crc32(hidden), len(hidden))


@pytest.fixture
def weakened() -> object:
    archive.TEST_WEAKEN.add("magic")
    yield
    archive.TEST_WEAKEN.discard("magic")


def test_the_file_is_two_archives_one_plain_one_gzip() -> None:
    """(What the attack is: each reader sees its own archive.)"""
    blob = polyglot()
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tar:
        (only,) = tar.getmembers()
        assert only.name.startswith("\x1f") and tar.extractfile(only).read() == b"fine\n"  # type: ignore[union-attr]
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        assert tar.getnames() == ["hidden.txt"]


def test_the_host_refuses_a_workspace_that_starts_as_compressed_data(tmp_path: Path) -> None:
    blob = polyglot()
    with pytest.raises(archive.UnsafeCheckpoint, match="starts as gzip data"):
        archive.check_workspace(blob, "workspace")
    gift = tmp_path / "gift.smolcheckpoint"
    forged(gift, record(), [("namespace.pkl", NAMESPACE), ("workspace.tar", blob)])
    with pytest.raises(archive.UnsafeCheckpoint, match=r"gift.smolcheckpoint has a workspace archive that starts as "
                                                       r"gzip data.*: refused$"):
        archive.check(str(gift))
    for head, kind in ((b"BZh91AY&SY" + bytes(6), "bzip2"), (b"\xfd7zXZ\x00" + bytes(10), "xz"),
                       (b"\x28\xb5\x2f\xfd" + bytes(12), "zstd")):
        assert gzipread.compressed(head) == kind
    # a plain tar whose first name merely starts like one is a tar
    assert gzipread.compressed(_tar([_file("BZh9 notes.txt", b"")])[:16]) is None
    archive.check_workspace(_tar([_file("BZh9 notes.txt", b"")]), "workspace")


def _load(tmp_path: Path, blob: bytes) -> Path:
    """The machine's own unpacker (guest/saveload.py) on a workspace archive ``blob``; its folder."""
    from smolbench.guest.saveload import SaveLoad

    stage, work = staged_for_the_guest(tmp_path, blob)
    machine = SimpleNamespace(workdir=str(work), ns={}, _reward_restored=lambda: None)
    SaveLoad.load(machine, str(stage))  # type: ignore[arg-type]
    return work


def test_the_machine_unpacks_the_plain_tar_the_host_checked(tmp_path: Path) -> None:
    work = _load(tmp_path, polyglot())
    (only,) = work.iterdir()  # (before: hidden.txt, from the gzip reading)
    assert only.read_bytes() == b"fine\n"


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")
def test_a_sandbox_restore_of_the_polyglot_gets_only_what_was_checked(open_tmp: Path, weakened: object) -> None:
    """Through a real restore, the host's refusal of compressed data weakened: what the machine
    unpacks is what the host checked (before: ``hidden.txt``, from the gzip reading)."""
    import smolbench

    gift = open_tmp / "gift.smolcheckpoint"
    forged(gift, record(), [("namespace.pkl", NAMESPACE), ("workspace.tar", polyglot())])
    with smolbench.Session(backend="sandbox", ledger=open_tmp / "s" / ".smolbench" / "ledger.db") as s:
        s.checkpoint_restore(str(gift))
        out = s.run("import os\nnames = [n for n in os.listdir('.') if not n.startswith('.')]\n"
                    "print(len(names), 'hidden.txt' in names, open(names[0]).read())")
    assert out.stdout == "1 False fine\n\n", out
