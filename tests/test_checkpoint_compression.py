"""Checkpoint files are compressed at gzip level 1 (it was 9, tarfile's default: a 200 MB
workspace took 5.1 s to save and 4.6 s to export), and an export writes the saved file's bytes
as they are after a record of its own (it decompressed and compressed them all again, to add a
few hundred bytes). Files written the old way still restore."""

from __future__ import annotations

import shutil
import tarfile
from pathlib import Path

import pytest

import smolbench

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
FAST = 4  # gzip's XFL byte (the header's 9th): 4 says "fastest" (level 1), 2 "best" (level 9)


def _restored(folder: Path, path: Path) -> tuple[str, str]:
    """Restore ``path`` with nothing up in ``folder``: the node and what its machine holds."""
    folder.mkdir()
    s = smolbench.Session(backend="sandbox", ledger=folder / "ledger.db", on_notice=lambda line: None)
    try:
        node = s.checkpoint_restore(str(path))
        return node, s.run("print(x, open('notes.txt').read()[:5])").stdout
    finally:
        s.down()


@needs_bwrap
def test_save_is_fast_and_export_keeps_the_saved_bytes_after_its_record(open_tmp: Path) -> None:
    home = open_tmp / "teacher"
    home.mkdir()
    with smolbench.Session(backend="sandbox", ledger=home / "ledger.db", on_notice=lambda line: None) as s:
        s.run("x = 41\nopen('notes.txt', 'w').write('hello ' * 100_000)")
        saved = Path(s.checkpoint_save("warm")["path"])
        assert saved.read_bytes()[8] == FAST
        exported = open_tmp / "class" / "warm.smolcheckpoint"
        exported.parent.mkdir()
        s.checkpoint_export("warm", exported)
    data, kept = exported.read_bytes(), saved.read_bytes()
    assert data.endswith(kept) and len(data) - len(kept) < 1024, (len(data), len(kept))  # not compressed again
    with tarfile.open(exported) as tar:  # one archive: the record first, then the saved file's two
        assert tar.getnames() == ["smolbench-record.json", "namespace.pkl", "workspace.tar"]
    assert _restored(open_tmp / "student", exported) == ("r1-warm", "41 hello\n")

    # a file that carries a record already (added here from elsewhere) is written again whole, its record replaced
    with smolbench.Session(backend="sandbox", ledger=open_tmp / "student" / "ledger.db", on_notice=lambda line: None) as s:
        again = open_tmp / "again.smolcheckpoint"
        s.checkpoint_export("warm", again)
    with tarfile.open(again) as tar:
        assert tar.getnames() == ["smolbench-record.json", "namespace.pkl", "workspace.tar"]
    assert again.read_bytes()[8] == FAST
    assert _restored(open_tmp / "third", again) == ("r1-again", "41 hello\n")

    # written as before (one gzip stream at level 9): still restores
    old = open_tmp / "old.smolcheckpoint"
    with tarfile.open(exported) as src, tarfile.open(old, "w:gz") as dst:
        for member in src:
            dst.addfile(member, src.extractfile(member))
    assert old.read_bytes()[8] == 2
    assert _restored(open_tmp / "fourth", old) == ("r1-old", "41 hello\n")
