"""Eighth audit, 2 and 5: a pass of the check was remembered by the file's stat (inode, size,
mtime, ctime), which doesn't change where timestamps are coarse (ext4 with 128-byte inodes: 1 s;
FUSE, where ctime can follow an mtime set back): someone else's file rewritten with other bytes of
the same size kept its pass, and its copy was restored unchecked. And ``ckptpaths.create``'s
rename changed the copy's ctime, so on ext4 a restore with nothing up checked twice. A pass is now
kept under the SHA-256 of the bytes checked. Counted: checks made, never time."""

from __future__ import annotations

import gzip
import io
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from ckpthelpers import CK, NAMESPACE, counted_checks

import smolbench
from smolbench.gate import archive
from smolbench.ledger import Ledger
from smolbench.shelf import Shelf


def _gift(target: str) -> bytes:
    """A checkpoint whose workspace is one link ``up -> target`` (uncompressed: the same size for
    targets of the same length)."""
    ws = io.BytesIO()
    with tarfile.open(fileobj=ws, mode="w") as tar:
        info = tarfile.TarInfo("up")
        info.type, info.linkname = tarfile.SYMTYPE, target
        tar.addfile(info)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in (("namespace.pkl", NAMESPACE), ("workspace.tar", ws.getvalue())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(out.getvalue(), compresslevel=0, mtime=0)


GOOD, BAD = _gift("a" * 18), _gift("../../../../../etc")


@pytest.fixture
def coarse(monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system whose ctime is its mtime (FUSE; an mtime set back sets both), as os.fstat says."""
    real = os.fstat

    def fstat(fd: int) -> os.stat_result:
        st = real(fd)
        return os.stat_result((*st[:9], st[8]), {"st_atime": st.st_atime, "st_mtime": st.st_mtime,
                                                "st_ctime": st.st_mtime, "st_atime_ns": st.st_atime_ns,
                                                "st_mtime_ns": st.st_mtime_ns, "st_ctime_ns": st.st_mtime_ns})

    monkeypatch.setattr(os, "fstat", fstat)


def _rewrite(path: Path, data: bytes) -> None:
    """Other bytes of the same size, in place, its times set back as they were."""
    st = os.stat(path)
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_file_rewritten_within_its_timestamps_is_checked_again(tmp_path: Path, coarse: None) -> None:
    path = tmp_path / "shared.smolcheckpoint"
    path.write_bytes(GOOD)
    archive.check_sized(str(path))
    _rewrite(path, BAD)
    with pytest.raises(archive.UnsafeCheckpoint, match="points outside"):
        archive.check_sized(str(path))


def test_a_shared_file_rewritten_after_its_check_is_not_restored_unchecked(tmp_path: Path, coarse: None) -> None:
    """The restore's steps (Shelf): checked before a machine comes up, then its owner rewrites it
    before it is copied in; before, its copy took the pass along and the machine got ``up -> /etc``."""
    share, folder = tmp_path / "share", tmp_path / "mine"
    share.mkdir()
    gift = share / "gift.smolcheckpoint"
    gift.write_bytes(GOOD)
    led = Ledger(folder / ".smolbench" / "ledger.db")
    try:
        shelf = Shelf(led)
        shelf.refusal_before_up(str(gift))  # passes: good bytes
        _rewrite(gift, BAD)
        with pytest.raises(archive.UnsafeCheckpoint, match="points outside"):
            shelf.adopt(str(gift), "sandbox")
        assert led.checkpoint_rows() == []
    finally:
        led.close()


def _fs_type(path: Path) -> str:
    """The file system type ``path`` is on (/proc/self/mounts' longest mount point above it)."""
    best, kind = "", "?"
    with open("/proc/self/mounts") as fh:
        for line in fh:
            _, point, fstype = line.split()[:3]
            if (str(path) + "/").startswith(point.rstrip("/") + "/") and len(point) >= len(best):
                best, kind = point, fstype
    return kind


@pytest.fixture
def disk_tmp() -> Iterator[Path]:
    """A folder on disk (next to the tests, not in a tmpfs /tmp) a sandbox's uid can reach: there a
    rename changes a file's ctime, which broke the stat key's "checked once" (eighth audit, 5)."""
    path = Path(tempfile.mkdtemp(prefix=".smolbench-disk-test-", dir=Path(__file__).resolve().parent.parent))
    path.chmod(0o711)
    try:
        if _fs_type(path) in ("tmpfs", "ramfs", "?"):
            pytest.skip(f"{path.parent} is not on a disk file system")
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")
def test_a_restore_with_nothing_up_checks_its_file_once_on_disk(disk_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    teacher = disk_tmp / "t"
    with smolbench.Session(backend="sandbox", ledger=teacher / ".smolbench" / "ledger.db") as s:
        s.run("import os\nos.makedirs('lib')\nopen('lib/m.py', 'w').write('x = 1')\nos.symlink('lib', 'first')\nwarm = 41")
        s.checkpoint_save("lesson")
    gift = disk_tmp / "gift.smolcheckpoint"
    shutil.copy(teacher / CK / "lesson.smolcheckpoint", gift)
    checks = counted_checks(monkeypatch)
    s = smolbench.Session(backend="sandbox", ledger=disk_tmp / "s" / ".smolbench" / "ledger.db")
    try:
        s.checkpoint_restore(str(gift))  # nothing up: checked before the machine comes up, then added and restored
        assert len(checks) == 1, checks
        assert s.run("import os\nprint(os.readlink('first'), warm + 1)").stdout == "lib 42\n"
    finally:
        s.down()
