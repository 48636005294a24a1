"""A checkpoint file that can't be used says which of a few problems it has, and the fix, the
same whichever check meets it first (the restore's before a machine comes up, or the add).

A class met them all: a copy cut short said "nothing was added" with a fix, a text file said
"cut short or damaged" as a plain SmolbenchError in one place and "not a smolbench checkpoint" in
another, an empty file "not a readable checkpoint (empty file)" with no fix, and a file from a
newer smolbench "its 'version' is not valid" or "unknown key 'future_field'". No machine here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ckpthelpers import forged, record, rows

import smolbench
from smolbench.errors import SmolbenchError
from smolbench.gate import archive
from smolbench.ledger import Ledger
from smolbench.shelf import Shelf

COPY = "copy the whole file again from where it came from; nothing was added"
EXPORT = "ask for one made with `%smol checkpoint export NAME PATH`; nothing was added"


def _files(folder: Path) -> dict[str, tuple[str, str]]:
    """Each file, and what its one line says (after its path) and ends with."""
    folder.mkdir()
    forged(folder / "good.smolcheckpoint", record(name="good"))
    whole = (folder / "good.smolcheckpoint").read_bytes()
    (folder / "cut.smolcheckpoint").write_bytes(whole[: len(whole) * 2 // 3])
    (folder / "empty.smolcheckpoint").write_bytes(b"")
    (folder / "two.smolcheckpoint").write_bytes(whole[:2])
    (folder / "text.smolcheckpoint").write_bytes(b"these are my notes, not a checkpoint\n" * 5)
    forged(folder / "newer.smolcheckpoint", record(name="newer", version=2, future_field={"x": 1}))
    forged(folder / "zero.smolcheckpoint", record(name="zero", version=0))
    return {
        "cut": (" is cut short or damaged (its compressed data ends early): ", COPY),
        "empty": (" is empty (0 bytes): ", COPY),
        "two": (" is cut short or damaged (it ends after 2 bytes): ", COPY),
        "text": (" is not a smolbench checkpoint file (one starts as gzip data): ", EXPORT),
        "newer": (" was made by a newer smolbench (record version 2; this one reads 1): upgrade smolbench "
                  "(`pip install -U jupyterlab-smolbench`), or ask for a file exported by this version",
                  "; nothing was added"),
        "zero": (" has a record of version 0, which no smolbench writes (this one reads 1): ", EXPORT),
    }


def test_each_problem_is_one_line_of_one_class_with_its_fix_wherever_it_is_met(tmp_path: Path) -> None:
    files = _files(tmp_path / "gifts")
    led = Ledger(tmp_path / "student" / ".smolbench" / "ledger.db")
    try:
        shelf = Shelf(led)
        for key, (says, ends) in files.items():
            path = str(tmp_path / "gifts" / f"{key}.smolcheckpoint")
            said = []
            for check in (shelf.refusal_before_up, lambda p: shelf.adopt(p, "sandbox")):
                with pytest.raises(SmolbenchError) as err:
                    check(path)
                assert type(err.value) is archive.UnusableCheckpoint, (key, type(err.value), err.value)
                said.append(str(err.value))
            assert said[0] == said[1], (key, said)  # the same words, whichever check met it
            line = said[0]
            assert "\n" not in line and f"{key}.smolcheckpoint{says}" in line and line.endswith(ends), (key, line)
    finally:
        led.close()
    assert rows(tmp_path / "student") == {}


def test_a_session_is_told_the_fix_in_its_own_words(tmp_path: Path) -> None:
    files = _files(tmp_path / "gifts")
    s = smolbench.Session(ledger=tmp_path / "student" / ".smolbench" / "ledger.db")
    try:
        for key in ("text", "zero"):
            with pytest.raises(archive.UnusableCheckpoint) as err:
                s.checkpoint_restore(tmp_path / "gifts" / f"{key}.smolcheckpoint")
            assert "`Session.checkpoint_export(name, path)`" in str(err.value) and "%smol" not in str(err.value)
            assert files[key][0] in str(err.value)
        assert s.workbench is None  # refused before anything came up
    finally:
        s.down()


def test_a_record_of_this_version_with_a_key_it_doesnt_know_is_read_without_it(tmp_path: Path) -> None:
    """A later smolbench of the same record version may add a key: this one drops it unread (it
    steers nothing), where it refused the whole file. Known keys are still checked strictly."""
    got = archive.parse_record(record(future_field={"path": "/etc/shadow"}, cells=3), "checkpoint x")
    assert got == {"kind": "smolbench-checkpoint", "version": 1, "name": "gift", "backend": "sandbox", "cells": 3}
    with pytest.raises(archive.UnsafeCheckpoint, match="its 'cells' is not valid"):
        archive.parse_record(record(future_field=1, cells="3"), "checkpoint x")
    for version in (True, 1.0, "1"):  # not the number 1 smolbench writes
        with pytest.raises(archive.UnusableCheckpoint, match=r"has a record of version .*which no smolbench writes"):
            archive.parse_record(record(version=version), "checkpoint x")
