"""A restore says the warnings its checkpoint was saved with, once, as whose word they are.

The teacher's variable ``f`` could not be pickled: the save warned, the ledger and the panel
kept the warning, and the exported file's record carried it, but a student's restore said
nothing of it, so the student met a NameError later. The warnings come from someone else's
file (or a copied folder's ledger): each is one escaped line of bounded length.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from ckpthelpers import CK, forged, record, rows
from nbhelpers import NotebookSession, ok, stream_text

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")

ESCAPES = "\x1b]0;pwned\x07\x1b[2K\r\x1b[1Asmolbench: restored from the course staff … verified\n"


def test_a_student_s_restore_says_what_the_teacher_s_save_could_not_keep(open_tmp: Path) -> None:
    """The walkthrough: `%smol checkpoint restore FILE` printed no word of the variable the
    teacher's save left out; now one line says it, as the file's claim."""
    import smolbench

    teacher, student = open_tmp / "teacher", open_tmp / "student"
    teacher.mkdir()
    student.mkdir()
    with smolbench.Session(backend="sandbox", ledger=teacher / ".smolbench" / "ledger.db") as s:
        s.run("import threading\nf = threading.Lock()\nlevel = 3").raise_for_error()
        assert s.checkpoint_save("lesson1")["warnings"] == ["not saved (can't be pickled): f (TypeError)"]
        s.workbench.shelf.export("lesson1", str(open_tmp / "lesson1.smolcheckpoint"))  # type: ignore[union-attr]
    with NotebookSession(student, timeout=300) as nb:
        ok(nb.run("%load_ext smolbench"))
        cell = ok(nb.run(f"%smol checkpoint restore {open_tmp / 'lesson1.smolcheckpoint'}"))
        said = stream_text(cell, "stderr").splitlines()
        assert said == ["smolbench: warning: the file says: not saved (can't be pickled): f (TypeError)"], said
        assert "restored lesson1 as r1-lesson1 (now active)" in stream_text(cell)
        ok(nb.run("%smol down"))


def test_a_file_s_and_a_copied_ledger_s_warnings_are_shown_as_one_short_line_each(open_tmp: Path) -> None:
    """A file's record may carry 20 warnings of 2,000 printable characters (one dressed as
    smolbench's own verdict); a copied folder's ledger row anything at all: escapes that set
    the terminal's title or write over the line above, line ends, 100,000 characters. Each is
    said once, one line after whose word it is, escaped, at most 500 characters of it."""
    import smolbench
    from smolbench.gate import archive
    from smolbench.ledger import Ledger

    student = open_tmp / "student"
    student.mkdir()
    gift = open_tmp / "lesson1.smolcheckpoint"
    long = "smolbench: restored lesson1: verified by the course staff " + "z" * 1900
    forged(gift, record(name="lesson1", warnings=["not saved (can't be pickled): f", long]))
    bad = open_tmp / "bad.smolcheckpoint"
    forged(bad, record(name="bad", warnings=[ESCAPES]))
    with pytest.raises(archive.UnsafeCheckpoint, match="its 'warnings' is not valid"):
        archive.check(str(bad), "sandbox", "bad")  # a file's record can't carry escapes at all
    (student / CK).mkdir(parents=True)
    forged(student / CK / "old.smolcheckpoint", record(name="old"))
    led = Ledger(student / ".smolbench" / "ledger.db")
    try:  # a row of a copied folder's ledger (another kernel's session), as it was copied
        led.add_checkpoint("old", "their-session", "root", "checkpoints/old.smolcheckpoint", "sandbox", 100, 2,
                           [ESCAPES + "y" * 100_000, "one\ntwo"])
    finally:
        led.close()
    notices: list[str] = []
    with smolbench.Session(backend="sandbox", ledger=student / ".smolbench" / "ledger.db",
                           on_notice=notices.append) as s:
        assert s.checkpoint_restore(str(gift)) == "r1-lesson1"
        warned = [n for n in notices if n.startswith("smolbench: warning:")]
        assert warned[0] == "smolbench: warning: the file says: not saved (can't be pickled): f"
        assert warned[1].startswith("smolbench: warning: the file says: smolbench: restored lesson1: verified")
        assert len(warned) == 2 and warned[1].isprintable() and warned[1].endswith("z…"), warned
        assert len(warned[1]) == len("smolbench: warning: the file says: ") + 500
        notices.clear()
        assert s.checkpoint_restore("old") == "r2-old"
        warned = [n for n in notices if n.startswith("smolbench: warning:")]
        assert len(warned) == 2, warned
        for line in warned:
            assert line.isprintable() and "\x1b" not in line and len(line) <= 20 + 21 + 500, line[:300]
        assert warned[0].startswith("smolbench: warning: its ledger row says: \\x1b]0;pwned\\x07\\x1b[2K\\r"), warned[0]
        assert warned[1] == "smolbench: warning: its ledger row says: one\\ntwo"
    assert rows(student)["lesson1"]["warnings"][0] == "the file says: not saved (can't be pickled): f"
