"""Sixth audit: a restore of a file from elsewhere, with nothing up, checked the file's workspace
at each step (before the machine came up, adding the file, the backend's restore): ~29 s each
for 50,000 links. Each file is now checked once per restore, its copy found by its hash. Counted:
workspace checks made (``archive.check_members``), never time."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from ckpthelpers import CK, counted_checks

import smolbench
from smolbench.gate import archive

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")

FILES = 2_000  # many files in folders of 40 (the count of checks, not their cost, is what is tested)


def test_an_honest_many_file_workspace_is_checked_once_as_it_is_restored(open_tmp: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    teacher, student = open_tmp / "t", open_tmp / "s"
    with smolbench.Session(backend="sandbox", ledger=teacher / ".smolbench" / "ledger.db") as s:
        s.run(f"import os\nfor i in range({FILES}):\n    os.makedirs(f'lib/pkg{{i // 40}}', exist_ok=True)\n"
              "    open(f'lib/pkg{i // 40}/m{i}.py', 'w').write('x = 1')\n"
              "os.symlink('lib/pkg0', 'first')\nwarm = 41")
        s.checkpoint_save("lesson")
    gift = open_tmp / "gift.smolcheckpoint"
    shutil.copy(teacher / CK / "lesson.smolcheckpoint", gift)
    checks = counted_checks(monkeypatch)
    with smolbench.Session(backend="sandbox", ledger=student / ".smolbench" / "ledger.db") as s:
        s.checkpoint_restore(str(gift))
        assert len(checks) == 1 and checks[0].endswith("gift.smolcheckpoint"), checks  # its copy: found by its hash
        out = s.run("import os\nprint(sum(len(f) for _, _, f in os.walk('lib')), os.readlink('first'), warm + 1)")
        assert out.stdout == f"{FILES} lib/pkg0 42\n", out
        # a second restore of the same file (already here) reads it no more either
        s.checkpoint_restore(str(gift))
    assert len(checks) == 1, checks


def test_a_file_changed_since_its_check_is_checked_again(tmp_path: Path) -> None:
    """The check's result is kept by the hash of the bytes checked: a write after it (which a
    damaged or replaced copy is) makes the next restore read it again."""
    import io
    import tarfile

    path = tmp_path / "a.smolcheckpoint"

    def write(members: int) -> None:
        ws = io.BytesIO()
        with tarfile.open(fileobj=ws, mode="w") as tar:
            for i in range(members):
                tar.addfile(tarfile.TarInfo(f"f{i}"))
        with tarfile.open(path, "w:gz") as tar:
            for name, data in (("namespace.pkl", b"x"), ("workspace.tar", ws.getvalue())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

    write(3)
    assert archive.check_sized(str(path)).namespace == 1
    with open(path, "r+b") as fh:  # the same size, other bytes: damaged in place
        fh.seek(40)
        fh.write(bytes(b ^ 0xFF for b in fh.read(8)))
    os.sync()
    with pytest.raises((archive.UnsafeCheckpoint, tarfile.TarError, EOFError, OSError)):
        archive.check_sized(str(path))
