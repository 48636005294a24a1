"""Checkpoints that travel as one file (issue 26 item 2), through real kernels in separate folders.

A teacher saves and exports; a student in another folder restores the exported file by
path in a fresh kernel, with nothing up first, and forks from it. A plain copy of a saved
checkpoint, and a file dropped into ``.smolbench/checkpoints/``, restore too. A copied
folder deletes its own copy only, whether its ledger rows are relative (now) or absolute
(older ledgers). A file from someone else is untrusted: a record that is not strictly what
smolbench writes, an archive member leading outside, or a record asking for the process
backend changes nothing here but one line.
"""

from __future__ import annotations

import gzip
import json
import shutil
import sqlite3
import tarfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ckpthelpers import CK, NAMESPACE, rows
from ckpthelpers import forged as _forged
from ckpthelpers import record as _record
from ckpthelpers import workspace as _workspace
from nbhelpers import NotebookSession, ok, one_line, stream_text

from smolbench.errors import SmolbenchError
from smolbench.ledger import Ledger

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")


@pytest.fixture
def teacher(open_tmp: Path) -> Iterator[tuple[Path, Path]]:
    """A teacher's folder with a warm checkpoint ``cartpole``, exported to ``shared/``."""
    folder, shared = open_tmp / "teacher", open_tmp / "shared"
    folder.mkdir()
    shared.mkdir()
    with NotebookSession(folder, timeout=300, allow_errors=True) as s:
        ok(s.run("%load_ext smolbench"))
        ok(s.run("%smol up --backend sandbox"))
        ok(s.run("%%smol\nwarm = sum(range(1000))\nopen('notes.txt', 'w').write('from the teacher')"))
        said = stream_text(ok(s.run("%smol checkpoint save cartpole")))
        assert said.startswith("smolbench: saved checkpoint cartpole of root"), said
        said = stream_text(ok(s.run("%smol checkpoint export cartpole ../shared/cartpole.smolcheckpoint")))
        assert said.startswith("smolbench: exported checkpoint cartpole to ../shared/cartpole.smolcheckpoint ("), said
        assert "`%smol checkpoint restore ../shared/cartpole.smolcheckpoint`" in said
        refused = one_line(s.run("%smol checkpoint export cartpole ../shared/cartpole.smolcheckpoint"))
        assert "exists: pick another path or add --force" in refused
        ok(s.run("%smol down"))
    yield folder, shared


def test_a_student_restores_the_exported_file_in_a_fresh_kernel_and_forks(teacher: tuple[Path, Path],
                                                                          open_tmp: Path) -> None:
    folder, shared = teacher
    exported = shared / "cartpole.smolcheckpoint"
    with tarfile.open(exported, "r:gz") as tar:
        first = tar.next()
        assert first is not None and first.name == "smolbench-record.json"
        f = tar.extractfile(first)
        assert f is not None
        record = json.loads(f.read())
    assert record["name"] == "cartpole" and record["backend"] == "sandbox" and record["node"] == "root"
    assert record["cells"] == 1 and "baseline" not in record  # a hash over the teacher's paths: parts say it
    for key in ("packages", "image", "baseline", "warnings"):  # each said by file name at most (test_export_paths)
        assert str(folder) not in json.dumps(record.get(key)), key
    assert str(folder) not in json.dumps(record)  # nothing in it names the teacher's folder

    student = open_tmp / "student"
    student.mkdir()
    original = exported.read_bytes()
    with NotebookSession(student, timeout=300) as s:
        ok(s.run("%load_ext smolbench"))
        out = stream_text(ok(s.run("%smol checkpoint restore ../shared/cartpole.smolcheckpoint")))
        assert "smolbench: nothing is up: bringing up a sandbox machine for this checkpoint" in out, out
        assert ("smolbench: added checkpoint cartpole to this folder (copied into "
                ".smolbench/checkpoints/cartpole.smolcheckpoint)") in out, out
        assert "smolbench: restored cartpole as r1-cartpole (now active)" in out, out
        live = stream_text(ok(s.run("print(*sorted(__import__('smolbench')._magics.workbench.machines))")))
        assert live == "r1-cartpole\n", live  # the machine brought up to restore into was never used: it went
        assert stream_text(ok(s.run("%%smol\nprint(warm, open('notes.txt').read())"))) == "499500 from the teacher\n"
        ok(s.run("%%smol fork 4 --quiet\nreward = SEED + warm"))
        assert stream_text(ok(s.run("%%smol\nprint(warm)"))) == "499500\n"
        # the same file again: already here, no second copy
        out = stream_text(ok(s.run("%smol checkpoint restore ../shared/cartpole.smolcheckpoint")))
        assert "checkpoint cartpole is already in this folder" in out and "r2-cartpole" in out, out
        # deleting it here deletes this folder's copy only
        assert stream_text(ok(s.run("%smol checkpoint rm cartpole"))) == "smolbench: removed checkpoint cartpole\n"
        ok(s.run("%smol down"))
    assert not (student / CK / "cartpole.smolcheckpoint").exists()
    assert exported.read_bytes() == original and (folder / CK / "cartpole.smolcheckpoint").exists()
    assert sorted(p.name for p in (student / CK).iterdir()) == []
    assert rows(student) == {}


def test_a_plain_copy_and_a_dropped_file_restore_and_are_listed(teacher: tuple[Path, Path], open_tmp: Path) -> None:
    folder, _ = teacher
    student = open_tmp / "student"
    (student / CK).mkdir(parents=True)
    saved = folder / CK / "cartpole.smolcheckpoint"  # as saved: no record inside
    shutil.copyfile(saved, student / "cartpole.smolcheckpoint")
    shutil.copyfile(saved, student / CK / "dropped.smolcheckpoint")
    with NotebookSession(student, timeout=300) as s:
        ok(s.run("%load_ext smolbench"))
        listed = stream_text(ok(s.run("%smol checkpoint list")))  # nothing up: as text
        assert "dropped  ?  .smolbench/checkpoints/dropped.smolcheckpoint  dropped in, not in the ledger yet" in listed
        out = stream_text(ok(s.run("%smol checkpoint restore cartpole.smolcheckpoint")))
        assert "restored cartpole as r1-cartpole (now active)" in out, out
        assert stream_text(ok(s.run("%%smol\nprint(warm)"))) == "499500\n"
        out = stream_text(ok(s.run("%smol checkpoint restore dropped")))
        assert "added checkpoint dropped to this folder (found in .smolbench/checkpoints/dropped.smolcheckpoint)" in out
        assert "restored dropped as r2-dropped" in out, out
        ok(s.run("%smol down"))
    got = rows(student)
    assert got["cartpole"]["path"] == "checkpoints/cartpole.smolcheckpoint"
    assert got["dropped"]["path"] == "checkpoints/dropped.smolcheckpoint"
    assert (student / "cartpole.smolcheckpoint").exists()  # the file the user named stays where it was


@pytest.mark.parametrize("absolute", [False, True], ids=["relative-rows", "absolute-rows-of-an-older-ledger"])
def test_a_copied_folder_deletes_its_own_copy_only(teacher: tuple[Path, Path], open_tmp: Path, absolute: bool) -> None:
    folder, _ = teacher
    if absolute:  # an older ledger: the path as the code before this change wrote it
        db = sqlite3.connect(folder / ".smolbench" / "ledger.db")
        with db:
            db.execute("UPDATE checkpoints SET path = ?", (str((folder / CK / "cartpole.smolcheckpoint").resolve()),))
        db.close()
    copy = open_tmp / "copy"
    shutil.copytree(folder, copy)
    mine = (folder / CK / "cartpole.smolcheckpoint").read_bytes()
    with NotebookSession(copy, timeout=300, allow_errors=True) as s:
        ok(s.run("%load_ext smolbench"))
        ok(s.run("%smol up --backend sandbox"))
        ok(s.run("%smol checkpoint restore cartpole"))
        assert stream_text(ok(s.run("%%smol\nprint(warm)"))) == "499500\n"
        (copy / CK / "cartpole.smolcheckpoint").unlink()  # the copy's own file is the one it uses
        line = one_line(s.run("%smol checkpoint restore cartpole"))
        assert "is missing its file .smolbench/checkpoints/cartpole.smolcheckpoint" in line, line
        shutil.copyfile(folder / CK / "cartpole.smolcheckpoint", copy / CK / "cartpole.smolcheckpoint")
        assert stream_text(ok(s.run("%smol checkpoint rm cartpole"))) == "smolbench: removed checkpoint cartpole\n"
        ok(s.run("%smol down"))
    assert not (copy / CK / "cartpole.smolcheckpoint").exists()
    assert (folder / CK / "cartpole.smolcheckpoint").read_bytes() == mine  # the original's file is untouched
    assert "cartpole" in rows(folder)


BAD = {  # (a key this version doesn't know is dropped unread: test_checkpoint_file_problems)
    "bad-path-type": (_record(node="/etc/shadow"), "its 'node' is not valid"),
    "dupe-key": (b'{"kind": "smolbench-checkpoint", "version": 1, "name": "gift", "name": "x", "backend": "sandbox"}',
                 "a key appears twice"),
    "bad-name": (_record(name="../../etc"), "its 'name' is not valid"),
    "nan": (b'{"kind": "smolbench-checkpoint", "version": 1, "name": "gift", "backend": "sandbox", "cells": NaN}',
            "NaN is not a number"),
    "not-utf8": (b'{"kind": "\xff"}', "can't decode"),
    "huge": (_record(baseline="x" * 20000), "record is 20 KB, over 16 KB"),
    "backend": (_record(backend="shell"), "its 'backend' is not valid"),
}


def test_a_file_from_someone_else_is_checked_like_machine_bytes(open_tmp: Path) -> None:
    student = open_tmp / "student"
    student.mkdir()
    gifts = open_tmp / "gifts"
    gifts.mkdir()
    for key, (record, _) in BAD.items():
        _forged(gifts / f"{key}.smolcheckpoint", record)
    _forged(gifts / "escape.smolcheckpoint", _record(), [("namespace.pkl", NAMESPACE),
                                                          ("workspace.tar", _workspace("../../escape.txt", b"x"))])
    _forged(gifts / "process.smolcheckpoint", _record(backend="process", name="proc"))
    with NotebookSession(student, timeout=300, allow_errors=True) as s:
        ok(s.run("%load_ext smolbench"))
        ok(s.run("%smol up --backend sandbox"))
        for key, (_, why) in BAD.items():
            line = one_line(s.run(f"%smol checkpoint restore ../gifts/{key}.smolcheckpoint"))
            assert "has a record that can't be used" in line or "record is" in line, (key, line)
            assert why in line and "refused" in line, (key, line)
        line = one_line(s.run("%smol checkpoint restore ../gifts/escape.smolcheckpoint"))
        assert "has a file outside its workspace (../../escape.txt)" in line and "nothing was added" in line, line
        # nothing was added by any of them
        assert sorted(p.name for p in (student / CK).iterdir()) == []
        assert rows(student) == {}
        ok(s.run("%smol down"))
    # a record asking for the process backend (no isolation) gets a sandbox, in a fresh kernel
    with NotebookSession(student, timeout=300, allow_errors=True) as s:
        ok(s.run("%load_ext smolbench"))
        out = stream_text(ok(s.run("%smol checkpoint restore ../gifts/process.smolcheckpoint")))
        assert "bringing up a sandbox machine" in out and "restored process as r1-process" in out, out
        status = stream_text(ok(s.run("import smolbench\nprint(smolbench._magics.workbench.backend.name)")))
        assert status == "sandbox\n"
        ok(s.run("%smol down"))
        # and on a process machine it is refused: it is someone else's code
        ok(s.run("%smol up --backend process"))
        line = one_line(s.run("%smol checkpoint restore process"))
        assert "was not saved in this kernel: its saved state is code" in line, line
        ok(s.run("%smol down"))
    assert not (open_tmp / "escape.txt").exists() and not (open_tmp.parent / "escape.txt").exists()


def test_a_file_from_elsewhere_is_copied_and_checked_off_the_event_loop(open_tmp: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Adding a file copies it and reads it whole through gzip (seconds for a big one, and an
    attacker's file is made to be slow): on the event loop, every machine's output and every
    other request waited for it."""
    import asyncio

    import smolbench
    from smolbench.shelf import Shelf

    teacher, student = open_tmp / "t", open_tmp / "s"
    with smolbench.Session(backend="sandbox", ledger=teacher / ".smolbench" / "ledger.db") as s:
        s.run("warm = 41")
        s.checkpoint_save("lesson")
    shutil.copy(teacher / CK / "lesson.smolcheckpoint", open_tmp / "gift.smolcheckpoint")
    on_a_loop: list[bool] = []
    real = Shelf.adopt

    def adopt(self: Shelf, *args: Any) -> Any:
        try:
            on_a_loop.append(asyncio.get_running_loop() is not None)
        except RuntimeError:
            on_a_loop.append(False)
        return real(self, *args)

    monkeypatch.setattr(Shelf, "adopt", adopt)
    with smolbench.Session(backend="sandbox", ledger=student / ".smolbench" / "ledger.db") as s:
        s.checkpoint_restore(str(open_tmp / "gift.smolcheckpoint"))
        assert s.run("print(warm + 1)").stdout == "42\n"
    assert on_a_loop == [False]


def test_a_restore_with_nothing_up_leaves_the_restored_machine_only(open_tmp: Path) -> None:
    """A user's kernel: a restore with nothing up left the root machine it brought up (to
    restore beside, never used) alive next to r1-…; the Session's restore and its async twin."""
    import asyncio

    import smolbench

    with smolbench.Session(backend="sandbox", ledger=open_tmp / "t" / ".smolbench" / "ledger.db") as s:
        s.run("warm = 41")
        s.checkpoint_save("lesson")
    gift = str(shutil.copy(open_tmp / "t" / CK / "lesson.smolcheckpoint", open_tmp / "gift.smolcheckpoint"))
    for twin in ("sync", "async"):
        s = smolbench.Session(ledger=open_tmp / twin / ".smolbench" / "ledger.db")
        try:
            node = s.checkpoint_restore(gift) if twin == "sync" else asyncio.run(s.acheckpoint_restore(gift))
            assert node == s.active == "r1-gift" and sorted(s.workbench.machines) == ["r1-gift"], twin
            assert s.run("print(warm + 1)").stdout == "42\n"
        finally:
            s.down()


def test_a_cut_short_file_is_refused_before_a_machine_comes_up_for_it(open_tmp: Path) -> None:
    """A student's copy that stopped half way: the restore with nothing up said "nothing is up:
    bringing up a sandbox machine for this checkpoint", booted it, then refused the file."""
    import smolbench

    gift = open_tmp / "gift.smolcheckpoint"
    _forged(gift, _record(name="gift"), [("namespace.pkl", NAMESPACE), ("workspace.tar", _workspace())])
    whole = gift.read_bytes()
    gift.write_bytes(whole[: len(whole) * 2 // 3])
    told: list[str] = []
    s = smolbench.Session(ledger=open_tmp / "student" / ".smolbench" / "ledger.db", on_notice=told.append)
    try:
        with pytest.raises(SmolbenchError) as err:
            s.checkpoint_restore(str(gift))
        line = str(err.value)
        assert "is cut short or damaged" in line and line.endswith("nothing was added"), line
        assert told == [] and not s.is_up and s.workbench is None  # no machine, no backend, no notice
    finally:
        s.down()
    assert rows(open_tmp / "student") == {}


def test_a_file_that_cant_make_a_machine_leaves_nothing_here(open_tmp: Path) -> None:
    """A file that passes the host's checks but whose saved state the machine can't load (here:
    a namespace that is not a pickle) fails its restore in one line; the copy and the row it
    was given go again, so the folder does not list a checkpoint that can never restore. A file
    someone put in the checkpoint folder themselves stays theirs: only its row goes."""
    import smolbench

    student = open_tmp / "student"
    (student / CK).mkdir(parents=True)
    gift = open_tmp / "broken.smolcheckpoint"
    _forged(gift, _record(name="broken"), [("namespace.pkl", b"not a pickle at all"),
                                                   ("workspace.tar", _workspace())])
    shutil.copy(gift, student / CK / "dropped.smolcheckpoint")
    with smolbench.Session(backend="sandbox", ledger=student / ".smolbench" / "ledger.db") as s:
        for arg in (str(gift), "dropped"):
            with pytest.raises(SmolbenchError) as err:
                s.checkpoint_restore(arg)
            line = str(err.value)
            assert "its saved state can't be loaded" in line and line.endswith("nothing was added"), line
        assert s.run("print(1)").stdout == "1\n"  # the session's machine is still there
    assert sorted(p.name for p in (student / CK).iterdir()) == ["dropped.smolcheckpoint"]
    assert rows(student) == {}
    assert gift.exists()


def test_taking_back_an_added_file_takes_only_what_is_still_its_own(open_tmp: Path) -> None:
    """The review of round 4's change: taking back an added file went by name. A checkpoint
    another kernel saved under that name meanwhile (after `rm` of the first) was deleted, row
    and file; and adding a dropped file replaced a row of the same name that named another file."""
    from smolbench.shelf import Shelf

    folder = open_tmp / "f"
    (folder / CK).mkdir(parents=True)
    gift = open_tmp / "gift.smolcheckpoint"
    _forged(gift, _record(name="gift"))
    led = Ledger(folder / ".smolbench" / "ledger.db")
    try:
        shelf = Shelf(led)
        added = shelf.adopt(str(gift), "sandbox")
        assert added.new_row and added.copied == "gift.smolcheckpoint"
        # meanwhile another kernel: rm gift, then a new save under the same name
        shelf.remove("gift")
        (folder / CK / "gift.smolcheckpoint").write_bytes(b"another kernel's save")
        shelf.add("gift", "other-session", "root", "gift.smolcheckpoint", "sandbox", 21, 3, [])
        shelf.unadopt(added)
        assert (folder / CK / "gift.smolcheckpoint").read_bytes() == b"another kernel's save"
        assert led.checkpoint("gift") is not None and led.checkpoint("gift")["session_id"] == "other-session"
        # a dropped file named like a row that names another file: the row is not replaced
        shutil.copy(gift, folder / CK / "mine.smolcheckpoint")
        shelf.add("mine", "s", "root", "gift.smolcheckpoint", "sandbox", 21, 3, [])
        with pytest.raises(SmolbenchError, match="a checkpoint named mine already names another file"):
            shelf.adopt(str(folder / CK / "mine.smolcheckpoint"), "sandbox")
        assert led.checkpoint("mine")["path"].endswith("gift.smolcheckpoint")
    finally:
        led.close()


def test_a_file_another_kernel_was_told_is_here_is_not_taken_back(open_tmp: Path) -> None:
    """Two kernels restore the same new file from elsewhere: the first copies it in, the second
    is told it is "already in this folder"; the first's restore then fails in its machine and
    takes back what it added. That took the row and the copy the second kernel was told about.
    Now the second's use is recorded in the row, and a row that changed keeps its file."""
    import threading

    from smolbench.shelf import Shelf

    folder = open_tmp / "f"
    (folder / CK).mkdir(parents=True)
    gift = open_tmp / "gift.smolcheckpoint"
    _forged(gift, _record(name="gift"))
    first, second = (Ledger(folder / ".smolbench" / "ledger.db") for _ in range(2))  # two kernels' ledgers
    try:
        added = Shelf(first).adopt(str(gift), "sandbox")
        assert added.new_row and added.copied == "gift.smolcheckpoint"
        told = Shelf(second).adopt(str(gift), "sandbox")
        assert "is already in this folder" in told.note and not told.new_row
        Shelf(first).unadopt(added)  # the first kernel's restore failed
        assert second.checkpoint("gift") is not None
        assert (folder / CK / "gift.smolcheckpoint").read_bytes() == gift.read_bytes()
        # the other order: taken back before the second kernel came, it copies the file in anew
        Shelf(first).remove("gift")
        added = Shelf(first).adopt(str(gift), "sandbox")
        Shelf(first).unadopt(added)
        assert rows(folder) == {} and not (folder / CK / "gift.smolcheckpoint").exists()
        again = Shelf(second).adopt(str(gift), "sandbox")
        assert again.new_row and again.copied == "gift.smolcheckpoint"
        # adding and taking back hold the folder: one kernel waits while another adds
        shelf = Shelf(second)
        with shelf.store.locked():
            waiter = threading.Thread(target=Shelf(first).unadopt, args=(again,))
            waiter.start()
            waiter.join(0.5)
            assert waiter.is_alive()  # waits for the folder
            assert second.checkpoint("gift") is not None
        waiter.join(10)
        assert not waiter.is_alive() and rows(folder) == {}
    finally:
        first.close()
        second.close()


def test_adding_a_file_again_keeps_when_it_was_added(open_tmp: Path) -> None:
    """A file added again ("already in this folder") renewed its row's ``created``: the date the
    listing shows and orders by, and the ``created`` an export writes into the file. Its row now
    records when it was added again (``readded``, what a take-back sees) beside it."""
    from smolbench.gate import archive
    from smolbench.shelf import Shelf

    folder = open_tmp / "f"
    (folder / CK).mkdir(parents=True)
    gift = open_tmp / "gift.smolcheckpoint"
    _forged(gift, _record(name="gift", created=1000.0))
    led = Ledger(folder / ".smolbench" / "ledger.db")
    try:
        shelf = Shelf(led)
        added = shelf.adopt(str(gift), "sandbox").row
        again = shelf.adopt(str(gift), "sandbox").row
        assert again["created"] == added["created"], (added, again)
        out = shelf.export("gift", str(open_tmp / "out.smolcheckpoint"))
        assert (archive.read_record(out["path"]) or {})["created"] == 1000.0  # the file's own, not when it came
        assert added.get("readded", 0) is None and again.get("readded", 0) > added["created"], (added, again)
    finally:
        led.close()


def test_an_interrupted_add_takes_back_what_its_thread_added_before_the_ctrl_c_returns(
        open_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Copying a file in runs on a thread: it finished after the restore was interrupted and left
    its copy and row behind. Then they were taken back by a daemon thread, after the Ctrl-C had
    come back: listed meanwhile (restorable by name, then gone under that restore), and left for
    good by a kernel that exited first. Now the interrupted restore waits for the copy and takes
    it back before it returns."""
    import asyncio
    import contextlib
    import threading
    import time

    from smolbench.checkpoints import CheckpointsMixin
    from smolbench.shelf import Shelf

    folder = open_tmp / "f"
    (folder / CK).mkdir(parents=True)
    gift = open_tmp / "gift.smolcheckpoint"
    _forged(gift, _record(name="gift"))
    led = Ledger(folder / ".smolbench" / "ledger.db")
    copying, go, returned = threading.Event(), threading.Event(), threading.Event()
    added_after_return: list[bool] = []
    real = Shelf.adopt

    def slow(self: Shelf, *args: Any) -> Any:
        copying.set()
        go.wait(60)  # still copying when the Ctrl-C comes: held until it came back, or had 5 s to
        try:
            return real(self, *args)
        finally:
            added_after_return.append(returned.is_set())

    monkeypatch.setattr(Shelf, "adopt", slow)

    class Kernel:
        shelf = Shelf(led)
        backend = type("B", (), {"name": "sandbox"})()

    async def main() -> None:
        task = asyncio.ensure_future(CheckpointsMixin._adopt(Kernel(), str(gift)))  # type: ignore[arg-type]
        while not copying.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        deadline = time.monotonic() + 5  # one that does not wait for the copy comes back well within this
        while not task.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if task.done():  # came back while the copy is held
            returned.set()
        go.set()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        returned.set()
        assert list((folder / CK).iterdir()) == [] and led.checkpoint("gift") is None
        for _ in range(100):  # had the thread gone on, what it added would come and go from here
            if added_after_return:
                return
            await asyncio.sleep(0.05)

    try:
        asyncio.run(main())
        assert added_after_return == [False], "the add went on after the Ctrl-C came back"
        assert list((folder / CK).iterdir()) == [] and led.checkpoint("gift") is None
    finally:
        led.close()


def test_a_checkpoint_a_killed_kernel_was_writing_is_swept_by_the_next(open_tmp: Path) -> None:
    """The leak hunt: SIGKILL during `checkpoint save` left `NAME.smolcheckpoint.part` (58 MB)
    in the checkpoint folder for good. A part file is now named by its writer and locked
    (flock) while written; the next kernel in the folder removes one no one holds once it
    is a minute old, and nothing else: not one being written, even by a writer whose pid
    means nothing here (another pid namespace, another host: the review's case), not a
    new one (its writer locks it a moment after making it), not another name, not a link."""
    import os
    import time

    from smolbench.gate.ckptpaths import PART, Store, hold_part, part_name

    store = Store(open_tmp / ".smolbench" / "checkpoints")
    store.ensure()
    folder = open_tmp / CK
    dead = ".lesson.smolcheckpoint.123456-1.part"  # its writer was killed
    elsewhere = ".other.smolcheckpoint.2-5347926.part"  # a writer in a container: pid 2 of its own
    new = part_name("new.smolcheckpoint")  # just made, not yet locked
    for name in (dead, elsewhere, new, ".notes.part", "lesson.smolcheckpoint"):
        (folder / name).write_bytes(b"x" * 1000)
    assert all(PART.fullmatch(n) for n in (dead, elsewhere, new))
    old = time.time() - 3600
    for name in (dead, elsewhere, ".notes.part"):
        os.utime(folder / name, (old, old))
    (folder / ".linked.smolcheckpoint.1-1.part").symlink_to(folder / "lesson.smolcheckpoint")
    writing = os.open(folder / elsewhere, os.O_WRONLY)
    try:
        hold_part(writing)  # its writer holds it
        assert store.sweep_parts() == [dead]
    finally:
        os.close(writing)
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [elsewhere, new, ".notes.part", "lesson.smolcheckpoint", ".linked.smolcheckpoint.1-1.part"])
    assert store.sweep_parts() == [elsewhere]  # let go (its writer is gone too): old, unheld


def _random_lesson(open_tmp: Path) -> Path:
    """A checkpoint ``lesson`` saved in a folder of its own (``open_tmp/t``), holding 60 kB of random
    bytes (a variable and a workspace file) so that its compressed data is large: a cut or a
    changed byte lands inside it."""
    import smolbench

    teacher = open_tmp / "t"
    with smolbench.Session(backend="sandbox", ledger=teacher / ".smolbench" / "ledger.db") as s:
        s.run("import random\nrandom.seed(7)\nwarm = random.randbytes(30000)\n"
              "open('notes.bin', 'wb').write(random.randbytes(30000))")
        s.checkpoint_save("lesson")
    return teacher / CK / "lesson.smolcheckpoint"


def _refused_as_damaged(open_tmp: Path, student: Path, files: dict[str, bytes]) -> None:
    """Each of ``files`` (written as KEY.smolcheckpoint) is refused by a restore in ``student`` in
    one line saying it is cut short or damaged and to copy it again; the machine goes on."""
    import smolbench

    for key, data in files.items():
        (open_tmp / f"{key}.smolcheckpoint").write_bytes(data)
    with smolbench.Session(backend="sandbox", ledger=student / ".smolbench" / "ledger.db") as s:
        for key in files:
            with pytest.raises(SmolbenchError) as err:
                s.checkpoint_restore(str(open_tmp / f"{key}.smolcheckpoint"))
            line = str(err.value)
            assert line.startswith(f"{open_tmp / key}.smolcheckpoint is cut short or damaged ("), (key, line)
            assert line.endswith("): copy the whole file again from where it came from; nothing was added"), (key, line)
            assert "\n" not in line and "end-of-stream marker" not in line and "not a smolbench checkpoint" not in line
        assert s.run("print(1)").stdout == "1\n"


def test_a_file_cut_short_or_damaged_on_its_way_says_so_and_how_to_fix_it(open_tmp: Path) -> None:
    """A class's files travel on USB sticks and through mail: a copy cut short said "not a readable
    checkpoint (Compressed file ended before the end-of-stream marker was reached)", gzip's own
    words, and one whose bytes were damaged mid-way said "is not a smolbench checkpoint (has
    ['namespace.pkl'])", as if it were some other kind of file (tarfile reads damage as an early
    end). Each now says it is cut short or damaged, and to copy the whole file again."""
    student = open_tmp / "s"
    whole = _random_lesson(open_tmp).read_bytes()
    assert len(whole) > 60000
    half = len(whole) // 2
    files = {"cut": whole[:half], "tiny": whole[:100], "zeroed": whole[:half] + bytes(len(whole) - half)}
    _refused_as_damaged(open_tmp, student, files)
    assert not (student / CK).exists() or sorted((student / CK).iterdir()) == []
    assert rows(student) == {}


def test_a_byte_changed_on_its_way_is_found_by_gzip_s_checksum(open_tmp: Path) -> None:
    """tarfile stops reading at the archive's end marker, before gzip's checksum and length at the
    file's end: a file with one byte changed inside its data (a failing stick) restored as other
    variables and files, and one that lost its last bytes restored too. The check now reads the
    gzip data to its end (at most DRAIN_LIMIT past what it needed), so gzip compares them."""
    from smolbench.gate import archive

    student = open_tmp / "s"
    path = _random_lesson(open_tmp)
    assert archive.check(str(path)) is None  # its own save: no record, and whole
    whole = path.read_bytes()
    # One changed byte anywhere past the gzip header (in data, in a tar header: the checksum
    # tells), unless it changes nothing the file holds: in a run of zeros (a tar's padding) a
    # match's distance can point at other zeros (seen at gzip level 1), and gzip then gives
    # the very same bytes, which its checksum rightly passes.
    inflated = gzip.decompress(whole)
    refused = 0
    for at in range(30, len(whole) - 8, len(whole) // 60):
        flipped = bytearray(whole)
        flipped[at] ^= 0x01
        (open_tmp / "flipped.smolcheckpoint").write_bytes(bytes(flipped))
        try:
            archive.check(str(open_tmp / "flipped.smolcheckpoint"))
        except (SmolbenchError, tarfile.TarError, EOFError, OSError) as exc:
            assert archive.damage(exc) is not None, (at, exc)
            refused += 1
            continue
        assert gzip.decompress(bytes(flipped)) == inflated, f"a byte changed at {at} passed as other data"
    assert refused > 40, refused  # (the random data: nearly every change lands there)
    files = {"trailer": whole[:-4]}
    for near in (len(whole) // 4, len(whole) // 2, len(whole) * 3 // 4):
        at, flipped = _changed_near(whole, near, inflated)
        files[f"flipped{at}"] = flipped
    _refused_as_damaged(open_tmp, student, files)
    assert rows(student) == {}


def _changed_near(whole: bytes, near: int, inflated: bytes) -> tuple[int, bytes]:
    """``whole`` with one bit changed at the first place from ``near`` on where that changes what
    it holds (not a match's distance into a run of zeros, which gives the same bytes)."""
    for at in range(near, len(whole) - 8):
        flipped = bytearray(whole)
        flipped[at] ^= 0x01
        try:
            if gzip.decompress(bytes(flipped)) == inflated:
                continue
        except (OSError, EOFError, zlib.error):
            pass
        return at, bytes(flipped)
    raise AssertionError(f"no change past {near} changes what the file holds")


def _damaged_lesson(open_tmp: Path) -> tuple[Path, Path]:
    """A checkpoint ``lesson`` saved in a folder of its own, and a copy whose second half is zeros
    (its record reads, the rest doesn't: it fails once a restore is under way)."""
    whole = _random_lesson(open_tmp)
    data = whole.read_bytes()
    damaged = open_tmp / "damaged.smolcheckpoint"
    damaged.write_bytes(data[:len(data) // 2] + bytes(len(data) - len(data) // 2))
    return whole, damaged


def test_a_session_with_nothing_up_restores_as_the_magic_does_and_takes_back_a_failed_one(open_tmp: Path) -> None:
    """``Session().checkpoint_restore(path)`` said "no machine is up" where ``%smol checkpoint
    restore`` brings one up for the checkpoint; and a restore that failed (a file damaged past
    its record) left the machine brought up for it idle, unasked for."""
    import smolbench

    whole, damaged = _damaged_lesson(open_tmp)
    cut = open_tmp / "cut.smolcheckpoint"
    cut.write_bytes(whole.read_bytes()[:100])
    s = smolbench.Session(ledger=open_tmp / "s" / ".smolbench" / "ledger.db")  # backend "auto": the file's
    with pytest.raises(SmolbenchError, match="is cut short or damaged"):
        s.checkpoint_restore(cut)  # refused on its record, before any machine
    assert s.workbench is None
    with pytest.raises(SmolbenchError, match="is cut short or damaged"):
        s.checkpoint_restore(damaged)  # refused once a machine was up for it: taken down
    assert not s.is_up and s.status() == {"up": False, "lost": None}
    assert s.backend_kind == "auto"  # the next up() chooses as asked, not as that file's record said
    try:
        node = s.checkpoint_restore(whole)
        assert s.is_up and node == "r1-lesson" and s.run("len(warm)").value == 30000
        assert s.workbench is not None and s.workbench.backend.name == "sandbox"
        assert s.backend_kind == "auto"  # for this up only: a later down() and up() chooses again
    finally:
        s.down()


def test_a_restore_with_nothing_up_that_fails_takes_down_the_machine_it_brought_up(open_tmp: Path) -> None:
    _, damaged = _damaged_lesson(open_tmp)
    student = open_tmp / "s"
    student.mkdir()
    with NotebookSession(student, timeout=300, allow_errors=True) as s:
        ok(s.run("%load_ext smolbench"))
        cell = s.run(f"%smol checkpoint restore {damaged}")
        assert "is cut short or damaged" in one_line(cell)
        said = stream_text(cell)
        # a file cut short is refused before anything comes up for it (it used to boot first)
        assert "bringing up" not in said and "took down" not in said, said
        assert "no machine is up" in stream_text(ok(s.run("%smol status")))
