"""A checkpoint file refused for its name says what to rename it to, and `export` of a name
that isn't here says how to make one.

A file copied by a USB stick or Windows as `week1.SMOLCHECKPOINT`, or renamed with a space
(`renamed week1.smolcheckpoint`), was refused with no usable name to rename it to; `%smol
checkpoint export nosuch PATH` advised `restore PATH.smolcheckpoint`, the wrong verb.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ckpthelpers import CK, forged, record, rows

from smolbench.errors import SmolbenchError
from smolbench.gate.ckptpaths import SUFFIX, suggested_name, valid_name
from smolbench.ledger import Ledger
from smolbench.shelf import Shelf, is_path


@pytest.fixture
def shelf(tmp_path: Path) -> Iterator[Shelf]:
    led = Ledger(tmp_path / "student" / ".smolbench" / "ledger.db")
    yield Shelf(led)
    led.close()


def _suggested(line: str) -> str:
    found = re.search(r"rename it to (\S+)" + re.escape(SUFFIX), line)
    assert found is not None, line
    return found.group(1)


@pytest.mark.parametrize(("base", "wanted"), [
    ("week1.SMOLCHECKPOINT", "week1"),
    ("Week1.SmolCheckpoint", "Week1"),
    ("renamed week1.smolcheckpoint", "renamed_week1"),
    ("renamed week1.SMOLCHECKPOINT", "renamed_week1"),
    ("-lesson (1).smolcheckpoint", "lesson_1"),
    ("wöche 1.smolcheckpoint", "w_che_1"),
    ("...smolcheckpoint", "checkpoint"),
    (f"{'x' * 70}.smolcheckpoint", "x" * 64),
])
def test_a_refused_file_name_says_a_valid_name_to_rename_it_to(tmp_path: Path, shelf: Shelf, base: str,
                                                               wanted: str) -> None:
    gift = tmp_path / base
    forged(gift, record(name="week1"))
    assert is_path(gift.name)  # a restore of it by its bare name is a path, in any case
    with pytest.raises(SmolbenchError) as refused:
        shelf.adopt(str(gift), "sandbox")
    line = str(refused.value)
    assert "\n" not in line and _suggested(line) == wanted and valid_name(wanted), line
    ck = tmp_path / "student" / CK
    assert rows(tmp_path / "student") == {} and (not ck.exists() or not any(ck.iterdir()))  # nothing added
    renamed = gift.rename(tmp_path / f"{wanted}{SUFFIX}")  # as it says: then it is added
    assert shelf.adopt(str(renamed), "sandbox").row["name"] == wanted


def test_a_missing_upper_case_file_is_missing(tmp_path: Path, shelf: Shelf) -> None:
    with pytest.raises(SmolbenchError, match=r"^no file .*nowhere\.SMOLCHECKPOINT: check the path"):
        shelf.adopt(str(tmp_path / "nowhere.SMOLCHECKPOINT"), "sandbox")


def test_every_suggestion_is_a_valid_name() -> None:
    for text in ["", " ", "a b", "ü", "-", "._-", "..", "a" * 200, "\x1b[31m", "a/b", "1", "_a", "a.b-c_d",
                 "名前", "x" * 63 + " y"]:
        got = suggested_name(text)
        assert valid_name(got), (text, got)
    assert suggested_name("a.b-c_d") == "a.b-c_d"  # a valid name stays itself


def test_export_of_a_missing_name_says_save_not_restore(tmp_path: Path, shelf: Shelf) -> None:
    with pytest.raises(SmolbenchError) as missing:
        shelf.export("nosuch", str(tmp_path / "out.smolcheckpoint"))
    line = str(missing.value)
    assert line == ("no checkpoint named 'nosuch' to export: saved checkpoints are none (`%smol checkpoint list`); "
                    "save one first: `%smol checkpoint save nosuch`"), line
    assert "restore" not in line
    with pytest.raises(SmolbenchError, match=r"save one first: `%smol checkpoint save NAME`$"):
        shelf.export("no such", str(tmp_path / "out.smolcheckpoint"))
    with pytest.raises(SmolbenchError, match=r"a file elsewhere: `%smol checkpoint restore PATH\.smolcheckpoint`$"):
        shelf.row("nosuch")  # a restore's line is as it was


def test_a_bad_name_to_save_says_one_that_works() -> None:
    from smolbench.checkpoints import _check_name

    with pytest.raises(SmolbenchError, match=r"e\.g\. week_1$"):
        _check_name("week 1")


def test_a_file_dropped_in_under_a_name_that_is_not_one_is_said_with_the_name_to_use(tmp_path: Path,
                                                                                     shelf: Shelf) -> None:
    """A browser saves a second download as `week1 (1).smolcheckpoint`: dropped into the
    checkpoint folder it was left out of every listing without a word, and `restore week1`
    said there was no such checkpoint."""
    ck = tmp_path / "student" / CK
    ck.mkdir(parents=True)
    forged(ck / "week1 (1).smolcheckpoint", record(name="week1"))
    forged(ck / "Lab2.SMOLCHECKPOINT", record(name="lab2"))
    (ck / "\x1b[2Jspoof\u202e.smolcheckpoint").write_bytes(b"x")  # someone else's name: shown escaped
    (ck / "folder (1).smolcheckpoint").mkdir()  # not a file: not a checkpoint either way
    lines = shelf.lines()
    assert lines[0].startswith("smolbench: no checkpoints in ")
    said = [line for line in lines if "is not listed" in line]
    assert len(said) == 3 and all("\n" not in line for line in said)
    assert "smolbench: 'week1 (1).smolcheckpoint' in .smolbench/checkpoints/ is not listed: its name is not a " \
           "checkpoint name (letters, digits, '.', '_' or '-', up to 64, first a letter or digit): rename it to " \
           "week1_1.smolcheckpoint" in said
    assert any(line.startswith("smolbench: 'Lab2.SMOLCHECKPOINT'") and "ends in '.SMOLCHECKPOINT', not " \
               "'.smolcheckpoint': rename it to Lab2.smolcheckpoint" in line for line in said)
    assert all("\x1b" not in line and "\u202e" not in line for line in lines)
    with pytest.raises(SmolbenchError, match=r"is not listed: .*rename it to \S+\.smolcheckpoint$"):
        shelf.row("week1")  # the restore by name says it too
    (ck / "week1 (1).smolcheckpoint").rename(ck / "week1_1.smolcheckpoint")  # as it says: then it is listed
    assert [r["name"] for r in shelf.rows()] == ["week1_1"]
    assert not any("week1" in line for line in shelf.lines() if "is not listed" in line)


def test_a_folder_of_misnamed_files_is_said_in_bounded_lines_and_a_restore_names_the_likely_one(
        tmp_path: Path, shelf: Shelf) -> None:
    ck = tmp_path / "student" / CK
    ck.mkdir(parents=True)
    for k in range(30):
        (ck / f"a{k:02d} (1).smolcheckpoint").write_bytes(b"x")
    (ck / "week1 (2).smolcheckpoint").write_bytes(b"x")
    said = [line for line in shelf.lines() if "not listed" in line]
    assert len(said) == 21 and said[-1] == "smolbench: 11 more files in .smolbench/checkpoints/ are not listed for their names"
    with pytest.raises(SmolbenchError, match=r"; 'week1 \(2\)\.smolcheckpoint' in .* rename it to week1_2\.smolcheckpoint$"):
        shelf.row("week1")  # the one it likely meant, not the first of 31


@pytest.mark.parametrize("backend", ["auto", "sandbox"])
def test_what_a_restore_refuses_without_a_machine_is_refused_before_one_comes_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """A user's kernel: `%smol checkpoint restore lesson1 (1).smolcheckpoint` with nothing up
    booted a machine (and took it down again) before it refused the name; a name with no
    checkpoint here did too on a Session given its backend."""
    import smolbench

    gift = tmp_path / "lesson1 (1).smolcheckpoint"
    forged(gift, record(name="lesson1"))

    def up(self: Any) -> Any:
        raise AssertionError("a machine came up before the refusal")

    monkeypatch.setattr(smolbench.Session, "up", up)
    s = smolbench.Session(backend=backend, ledger=tmp_path / "student" / ".smolbench" / "ledger.db")
    with pytest.raises(SmolbenchError, match=r"rename it to lesson1_1\.smolcheckpoint and restore that; nothing was added$"):
        s.checkpoint_restore(str(gift))
    with pytest.raises(SmolbenchError, match=r"^no checkpoint named 'nosuch': "):
        s.checkpoint_restore("nosuch")
    assert rows(tmp_path / "student") == {} and not s.is_up
