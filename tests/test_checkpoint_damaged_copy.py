"""A checkpoint file of this folder that was damaged after it was added (a full disk, a failing
stick): `%smol checkpoint list` said "ok" of it (it never read it), its restore said to copy the
whole file again "from where it came from" without saying where that was (this folder's ledger
knows) and "nothing was added" (it is this folder's), and restoring that source again added a
second checkpoint `lesson1-2` beside the damaged one. No machine here.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from ckpthelpers import CK, NAMESPACE, forged, record, rows, workspace

import smolbench
from smolbench.gate import archive
from smolbench.ledger import Ledger
from smolbench.shelf import Shelf


@pytest.fixture
def student(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A student's folder (the working folder), with ``../class/lesson1.smolcheckpoint`` added to it
    and then damaged here: its second half zeros (its record still reads)."""
    (tmp_path / "class").mkdir()
    forged(tmp_path / "class" / "lesson1.smolcheckpoint", record(name="lesson1"),
           [("namespace.pkl", NAMESPACE), ("workspace.tar", workspace("data.bin", random.Random(1).randbytes(200_000)))])
    folder = tmp_path / "student"
    folder.mkdir()
    monkeypatch.chdir(folder)
    led = Ledger(folder / ".smolbench" / "ledger.db")
    try:
        Shelf(led).adopt("../class/lesson1.smolcheckpoint", None)
    finally:
        led.close()
    copy = folder / CK / "lesson1.smolcheckpoint"
    data = copy.read_bytes()
    copy.write_bytes(data[: len(data) // 2] + bytes(len(data) - len(data) // 2))
    return folder


def test_the_list_claims_nothing_it_did_not_check(student: Path) -> None:
    led = Ledger(student / ".smolbench" / "ledger.db")
    try:
        lines = Shelf(led).lines()
    finally:
        led.close()
    assert lines[1] == "  lesson1  sandbox  .smolbench/checkpoints/lesson1.smolcheckpoint", lines
    assert not any(line.endswith("ok") for line in lines), lines


def test_its_restore_names_where_it_came_from_and_the_restore_that_puts_a_whole_copy_back(student: Path) -> None:
    led = Ledger(student / ".smolbench" / "ledger.db")
    try:
        with pytest.raises(archive.UnusableCheckpoint) as err:
            Shelf(led).refusal_before_up("lesson1")
    finally:
        led.close()
    line = str(err.value)
    assert line.startswith("checkpoint 'lesson1' is cut short or damaged ("), line
    assert line.endswith("): copy the whole file again from where it came from; this folder's ledger says it came "
                         "from ../class/lesson1.smolcheckpoint: `%smol checkpoint restore "
                         "../class/lesson1.smolcheckpoint` puts a whole copy in its place"), line
    assert "nothing was added" not in line
    s = smolbench.Session(ledger=student / ".smolbench" / "ledger.db")
    try:  # the Session's words, refused before anything comes up
        with pytest.raises(archive.UnusableCheckpoint) as err:
            s.checkpoint_restore("lesson1")
        assert "`Session.checkpoint_restore('../class/lesson1.smolcheckpoint')` puts a whole copy" in str(err.value)
        assert s.workbench is None
    finally:
        s.down()


def test_restoring_its_source_again_replaces_the_damaged_copy(student: Path) -> None:
    source = (student.parent / "class" / "lesson1.smolcheckpoint").read_bytes()
    led = Ledger(student / ".smolbench" / "ledger.db")
    try:
        shelf = Shelf(led)
        # a damaged source is refused, and the damaged copy here stays as it was
        damaged = (student / CK / "lesson1.smolcheckpoint").read_bytes()
        (student / "cut.smolcheckpoint").write_bytes(source[: len(source) // 2])
        (student / "other").mkdir()
        (student / "other" / "lesson1.smolcheckpoint").write_bytes(source[: len(source) // 2])
        with pytest.raises(archive.UnusableCheckpoint, match="is cut short or damaged"):
            shelf.adopt("other/lesson1.smolcheckpoint", None)
        assert (student / CK / "lesson1.smolcheckpoint").read_bytes() == damaged
        added = shelf.adopt("../class/lesson1.smolcheckpoint", None)
        assert added.note.startswith("replaced this folder's copy of checkpoint lesson1 (.smolbench/checkpoints/"
                                     "lesson1.smolcheckpoint, cut short or damaged: "), added.note
        assert added.note.endswith(") with ../class/lesson1.smolcheckpoint"), added.note
        assert not added.new_row and added.copied is None  # kept, whatever the restore does next
        assert sorted(p.name for p in (student / CK).iterdir()) == ["lesson1.smolcheckpoint"]
        assert (student / CK / "lesson1.smolcheckpoint").read_bytes() == source
        shelf.refusal_before_up("lesson1")  # whole now
        # a whole copy of the same name is not replaced: another file of that name is added beside it
        forged(student / "other" / "lesson1.smolcheckpoint", record(name="lesson1", cells=7))
        assert shelf.adopt("other/lesson1.smolcheckpoint", None).row["name"] == "lesson1-2"
    finally:
        led.close()
    assert sorted(rows(student)) == ["lesson1", "lesson1-2"]
