"""Checkpoint rows are signed by this user's key (smolbench.signing): a ledger row only names a
file, and a copied folder carries someone else's ledger. Each test's attack is written beside it;
each failed before rows were signed (6fac255), but the control of own rows after a restart."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickle
import shutil
import sqlite3
import stat
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakesmol import FakeHost, backend, fake_host, run
from smol import SmolError

import smolbench
from smolbench import checkpoints
from smolbench.errors import SmolbenchError
from smolbench.ledger import Ledger
from smolbench.shelf import IMPORTED, Shelf
from smolbench.spec import MachineSpec
from smolbench.workbench import Workbench

HAVE_BWRAP = shutil.which("bwrap") is not None
LEDGER = Path(".smolbench") / "ledger.db"
CK = Path(".smolbench") / "checkpoints"


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHost]:
    """smol's engine, faked at its edge: a restore that reaches it raises (and is counted)."""
    for fake in fake_host(monkeypatch):
        fake.cls.restore_checkpoint.side_effect = SmolError("NOT_FOUND", "the engine was handed the file")
        yield fake


def _state(monkeypatch: pytest.MonkeyPatch, folder: Path) -> Path:
    """This user's state folder (their key) at ``folder``: another user, or the same after a move."""
    folder.mkdir(mode=0o700, exist_ok=True)
    monkeypatch.setenv("SMOLBENCH_STATE", str(folder))
    return folder


def _vm_file(folder: Path, name: str = "vm") -> Path:
    """What a smol checkpoint file is to smolbench: bytes only smol's engine reads (an outsider's here)."""
    (folder / CK).mkdir(parents=True, exist_ok=True)
    path = folder / CK / f"{name}.smolcheckpoint"
    path.write_bytes(b"SMOLVM\0" + b"attacker-chosen snapshot bytes " * 100)
    return path


def _smol_row(folder: Path, name: str = "vm") -> None:
    """A smol checkpoint saved here by this user's kernel (Shelf.add, as a save records it)."""
    path = _vm_file(folder, name)
    led = Ledger(folder / LEDGER)
    try:
        Shelf(led).add(name, "20260101-000000-abcdef", "root", path.name, "smol", path.stat().st_size, 1, [])
    finally:
        led.close()


def _restore_on_smol(folder: Path, name: str = "vm") -> str:
    """Restore ``name`` of ``folder`` on the (fake) smol backend; the one line it said."""
    wb = Workbench(backend(), MachineSpec(), Ledger(folder / LEDGER), checkpoint_dir=str(folder / CK))
    try:
        with pytest.raises(SmolbenchError) as got:
            run(wb.checkpoint_restore(name))
        return str(got.value)
    finally:
        wb.ledger.close()


def test_a_copied_folders_smol_row_never_reaches_smols_engine(host: FakeHost, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Attack: a colleague's folder (ledger and files copied, or a tarball unpacked) holds a row
    saying smol made ``vm``; restoring it had smol's engine, a host process, parse a snapshot the
    colleague wrote. Now a row not signed by this user's key is refused before the engine runs."""
    _state(monkeypatch, tmp_path / "theirs-state")
    theirs = tmp_path / "theirs"
    _smol_row(theirs)  # their kernel's own save, signed by their key
    said = _restore_on_smol(theirs)
    assert "the engine was handed the file" in said  # the control: their own row reaches their engine
    host.cls.restore_checkpoint.reset_mock()

    mine = tmp_path / "mine"
    shutil.copytree(theirs, mine)
    _state(monkeypatch, tmp_path / "my-state")  # this user: another key
    said = _restore_on_smol(mine)
    assert said.startswith("checkpoint 'vm' is not signed as your own save"), said
    assert said.endswith("if you saved it yourself, `%smol checkpoint trust vm` signs it"), said
    host.cls.restore_checkpoint.assert_not_called()
    led = Ledger(mine / LEDGER)
    try:
        shelf = Shelf(led)
        with pytest.raises(SmolbenchError, match="is not signed as your own save"):
            shelf.refusal_before_up("vm")  # nothing up: refused before a microVM boots for it
        assert [r["foreign"] is not None for r in shelf.rows()] == [True]
        assert any("  vm  smol  " in line and "foreign: not signed as your own save" in line and
                   "`%smol checkpoint trust vm` if you saved it" in line for line in shelf.lines()), shelf.lines()
        # the fix, on this user's word: signed, then their engine reads it
        assert shelf.trust("vm", "s").startswith("signed checkpoint vm as your own: smol's engine reads its file")
        assert [r["foreign"] for r in shelf.rows()] == [None]
        assert any(r["scope"] == "checkpoint" for r in led.trust_rows())
    finally:
        led.close()
    assert "the engine was handed the file" in _restore_on_smol(mine)


def test_a_forged_mac_on_a_smol_row_is_refused(host: FakeHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attack: the copied ledger's row carries a MAC of its author's choosing (one copied from
    another row, or made up); only one made with this user's key verifies."""
    _state(monkeypatch, tmp_path / "state")
    folder = tmp_path / "f"
    _smol_row(folder, "good")
    _vm_file(folder, "evil")
    db = sqlite3.connect(folder / LEDGER)
    with db:
        have = {r[1] for r in db.execute("PRAGMA table_info(checkpoint_more)")}
        if "mac" not in have:  # the start commit's ledger: the author adds whatever column they like
            db.execute("ALTER TABLE checkpoint_more ADD COLUMN mac TEXT")
        good = db.execute("SELECT mac, sha256 FROM checkpoint_more WHERE name = 'good'").fetchone()
        size = (folder / CK / "evil.smolcheckpoint").stat().st_size
        for name, mac in (("evil", good[0]), ("evil2", "0" * 64)):
            db.execute("INSERT INTO checkpoints VALUES (?, '20260101-000000-abcdef', 'root', "
                       "'checkpoints/evil.smolcheckpoint', 'smol', 1, ?, 1, '[]')", (name, size))
            db.execute("INSERT INTO checkpoint_more (name, session_id, path, size, sha256, mac) VALUES "
                       "(?, '20260101-000000-abcdef', 'checkpoints/evil.smolcheckpoint', ?, ?, ?)",
                       (name, size, hashlib.sha256((folder / CK / "evil.smolcheckpoint").read_bytes()).hexdigest(), mac))
    db.close()
    for name in ("evil", "evil2"):
        assert "is not signed as your own save" in _restore_on_smol(folder, name)
    host.cls.restore_checkpoint.assert_not_called()
    assert "the engine was handed the file" in _restore_on_smol(folder, "good")


class _RunsOnTheHost:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"echo ran > {self.marker}",))


def _evil_archive(path: Path, marker: Path) -> None:
    """A well-formed checkpoint file whose saved state runs a command where it is unpickled."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in (("namespace.pkl", pickle.dumps(_RunsOnTheHost(marker))), ("workspace.tar", b"\0" * 1024)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_a_file_swapped_after_its_row_was_signed_is_refused(here: Path) -> None:
    """Attack: the row is this user's own (this very kernel's, on the process backend: its state is
    unpickled here), but its file was replaced since (a shared folder, a sync tool, a colleague
    with write access). The process backend loaded whatever file the row's name led to."""
    marker = here / "ran-on-the-host"
    with smolbench.Session(backend="process", ledger=str(here / LEDGER), on_notice=lambda line: None) as s:
        s.run("x = 1")
        s.checkpoint_save("warm")
        _evil_archive(here / CK / "warm.smolcheckpoint", marker)
        with pytest.raises(SmolbenchError) as got:
            s.checkpoint_restore("warm")
        assert "warm" in str(got.value) and "is not the file saved as it" in str(got.value), got.value
        assert "`Session.checkpoint_rm('warm')` forgets it" in str(got.value)
    assert not marker.exists()


def test_a_row_edited_to_name_another_file_is_refused(here: Path) -> None:
    """Attack: the ledger is edited (a copied folder's author, a tool) so that this user's own row
    ``a`` names another file (``b``'s, or one planted): its signature covers the path, so the row is
    no longer this user's, and the process backend (no isolation) refuses it."""
    with smolbench.Session(backend="process", ledger=str(here / LEDGER), on_notice=lambda line: None) as s:
        s.run("who = 'a'")
        s.checkpoint_save("a")
        s.run("who = 'b'")
        s.checkpoint_save("b")
        db = sqlite3.connect(here / LEDGER)
        with db:
            size = (here / CK / "b.smolcheckpoint").stat().st_size
            for table in ("checkpoints", "checkpoint_more"):
                db.execute(f"UPDATE {table} SET path = 'checkpoints/b.smolcheckpoint', size = ? WHERE name = 'a'",
                           (size,))
            with contextlib.suppress(sqlite3.OperationalError):  # (no sha256 of own saves at the start commit)
                db.execute("UPDATE checkpoint_more SET sha256 = (SELECT sha256 FROM checkpoint_more WHERE name = 'b') "
                           "WHERE name = 'a'")
        db.close()
        with pytest.raises(SmolbenchError, match="was not saved in this kernel"):
            s.checkpoint_restore("a")
        assert [r["name"] for r in s.checkpoints() if r["foreign"]] == ["a"]
        node = s.checkpoint_restore("b")  # the row left alone is still this user's own
        assert s.run("print(who)", node=node).stdout.strip() == "b"


@pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap is not installed")
def test_own_rows_restore_after_a_kernel_restart(here: Path) -> None:
    """The control (it passed before too): a new kernel of the same user (same key, a new session)
    restores its saves on the sandbox; a row it did not sign beside them is checked as a file
    from elsewhere, and a damaged one of those is refused as such."""
    ledger = str(here / LEDGER)
    with smolbench.Session(backend="sandbox", ledger=ledger, on_notice=lambda line: None) as s:
        s.run("kept = 41")
        s.checkpoint_save("warm")
    before = set(checkpoints.SESSIONS_HERE)
    checkpoints.SESSIONS_HERE.clear()  # a new kernel: none of its sessions saved these
    try:
        with smolbench.Session(backend="sandbox", ledger=ledger, on_notice=lambda line: None) as s:
            node = s.checkpoint_restore("warm")
            assert s.run("print(kept + 1)", node=node).stdout.strip() == "42"
            assert [r["foreign"] for r in s.checkpoints()] == [None]
    finally:
        checkpoints.SESSIONS_HERE.update(before)


def test_the_key_is_the_users_own_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attack: a key another user can read lets them sign rows as this user (a copied folder's
    smol row then reaches smol's engine); a key file that is a link, or not the user's, may be
    theirs. The key is made 0600 with O_EXCL|O_NOFOLLOW, and refused in one line otherwise."""
    from smolbench import signing

    state = _state(monkeypatch, tmp_path / "state")
    made = signing.key()
    key = state / "checkpoint.key"
    assert made is not None and len(made) == 32 and signing.key() == made
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and key.stat().st_uid == os.geteuid()
    assert sorted(os.listdir(state)) == ["checkpoint.key"]  # no part file left

    key.chmod(0o640)
    with pytest.raises(SmolbenchError, match=r"^refusing the checkpoint key .*: others can read or change it "
                                             r"\(mode 0640\).*`chmod 600 "):
        signing.key()
    key.chmod(0o600)

    theirs = tmp_path / "planted.key"
    theirs.write_bytes(b"k" * 32)
    theirs.chmod(0o600)
    key.unlink()
    key.symlink_to(theirs)
    with pytest.raises(SmolbenchError, match=r"^refusing the checkpoint key .*: it is a symbolic link.*`rm "):
        signing.key()
    with pytest.raises(SmolbenchError, match="it is a symbolic link"):  # a save is refused before it begins
        signing.key(create=False)
    key.unlink()

    if os.geteuid() == 0:  # (only root can give a file away)
        key.write_bytes(b"k" * 32)
        key.chmod(0o600)
        os.chown(key, 12345, -1)
        with pytest.raises(SmolbenchError, match=r"it belongs to uid 12345, not you"):
            signing.key()
        key.unlink()
    assert signing.key(create=False) is None and signing.key() != made  # none: a new one


def test_a_listing_never_makes_a_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Listing (the sidebar polls it) reads the key if there is one; with none, every row is foreign."""
    state = _state(monkeypatch, tmp_path / "state")
    led = Ledger(tmp_path / LEDGER)
    try:
        led.add_checkpoint("old", "20250101-000000-abcdef", "root", "checkpoints/old.smolcheckpoint", "sandbox", 1, 0, [])
        assert [r["foreign"] is not None for r in Shelf(led).rows()] == [True]
    finally:
        led.close()
    assert os.listdir(state) == []


def test_the_panel_says_which_rows_are_foreign(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint panel (what `%smol checkpoint list` shows with a machine up) says a row is
    not this user's, and its Restore of a foreign smol row is blocked with the restore's line."""
    from smolbench.widgets.checkpoints import checkpoint_record

    _state(monkeypatch, tmp_path / "state")
    _smol_row(tmp_path, "mine")
    _vm_file(tmp_path, "theirs")
    led = Ledger(tmp_path / LEDGER)
    try:
        led.add_checkpoint("theirs", "x", "root", "checkpoints/theirs.smolcheckpoint", "smol", 1, 0, [])
        led.add_checkpoint("old", "x", "root", "checkpoints/theirs.smolcheckpoint", "sandbox", 1, 0, [])
        rows = {r["name"]: checkpoint_record(r, "smol") for r in Shelf(led).rows()}
        on_sandbox = {r["name"]: checkpoint_record(r, "sandbox") for r in Shelf(led).rows()}
    finally:
        led.close()
    assert rows["mine"]["blocked"] == {} and rows["mine"]["warnings"] == []
    assert rows["theirs"]["blocked"]["restore"].startswith("checkpoint 'theirs' is not signed as your own save")
    said = on_sandbox["old"]["warnings"]
    assert said[0].startswith("foreign: not signed as your own save") and on_sandbox["old"]["blocked"] == {}, said
    assert said[0].endswith("`%smol checkpoint trust old` if you saved it")


@pytest.mark.parametrize("writable", ["file", "folder", "above"])
def test_an_own_smol_checkpoint_others_could_change_is_refused_before_smols_engine(
        host: FakeHost, tmp_path: Path, writable: str) -> None:
    """Seventh audit: smol's engine opens a checkpoint by name, after smolbench hashed and
    checked it through its descriptor. Where another user can write the file, its folder or a
    folder above (a shared project folder), they swap or edit it in between: the crafted
    snapshot the signature was to keep out reaches the engine. Such a restore is refused first."""
    folder = tmp_path / "project"
    folder.mkdir()
    _smol_row(folder)
    assert "the engine was handed the file" in _restore_on_smol(folder)  # as it is: the engine gets it
    target = {"file": folder / CK / "vm.smolcheckpoint", "folder": folder / CK, "above": folder}[writable]
    target.chmod(target.stat().st_mode | 0o022)
    said = _restore_on_smol(folder)
    assert host.cls.restore_checkpoint.call_count == 1, said  # never reached the engine again
    assert "it is writable by group and others" in said and "chmod go-w" in said, said


def test_a_save_where_no_key_can_be_made_is_kept_unsigned_and_restores_as_a_file_from_elsewhere(
        here: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seventh audit: with no writable home or state folder (HOME=/nonexistent, a read-only
    home: some containers), a save that worked before the key failed. It is saved unsigned now,
    says so, and restores as a file from elsewhere (checked as one); a bad key file that is
    there is still refused."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv("SMOLBENCH_STATE", str(blocker / "state"))  # can't be made
    ledger = str(here / LEDGER)
    with smolbench.Session(backend="sandbox", ledger=ledger, on_notice=lambda line: None) as s:
        s.run("kept = 41")
        saved = s.checkpoint_save("warm")
        assert any(w.startswith("saved unsigned: no checkpoint key could be made") for w in saved["warnings"]), saved
        assert [r["foreign"] is not None for r in s.checkpoints()] == [True]
        node = s.checkpoint_restore("warm")
        assert s.run("print(kept + 1)", node=node).stdout.strip() == "42"


def test_a_script_trusts_a_foreign_row_through_the_session(here: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The public API as a plain script uses it: a row saved unsigned (no key could be made then)
    is foreign; `Session.checkpoint_trust` checks its file as one from elsewhere and signs it, and
    it is then this user's own."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv("SMOLBENCH_STATE", str(blocker / "state"))
    ledger = str(here / LEDGER)
    with smolbench.Session(backend="sandbox", ledger=ledger, on_notice=lambda line: None) as s:
        s.run("kept = 41")
        s.checkpoint_save("warm")
        assert [r["foreign"] is not None for r in s.checkpoints()] == [True]
        _state(monkeypatch, tmp_path / "state")  # a key can be made now
        said = s.checkpoint_trust("warm")
        assert said.startswith("signed checkpoint warm as your own"), said
        assert [r["foreign"] for r in s.checkpoints()] == [None]
        node = s.checkpoint_restore("warm")
        assert s.run("print(kept + 1)", node=node).stdout.strip() == "42"


def test_an_export_of_a_foreign_row_stays_foreign(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attack: a copied folder's ledger holds a sandbox row (unsigned: foreign) whose baseline and
    machine are its author's choice, with a warning of theirs. `%smol checkpoint export` wrote it as
    this user's own save: the row's baseline, its machine (or, for a baseline equal to this one's,
    the machine up now), its warnings as the exporter's, and nothing saying where it came from; the
    file then travels as the exporter's. Now a foreign row's export carries only what its file said,
    says so first, and keeps the row's words as its row's; trusted, it exports as the user's own."""
    from ckpthelpers import forged

    from smolbench.gate import archive

    _state(monkeypatch, tmp_path / "state")
    spec = MachineSpec()
    folder = tmp_path / "copied"
    (folder / CK).mkdir(parents=True)
    forged(folder / CK / "theirs.smolcheckpoint", None)  # a machine's archive: no record of its own
    led = Ledger(folder / LEDGER)
    try:
        led.add_checkpoint("theirs", "20260101-000000-abcdef", "root", "checkpoints/theirs.smolcheckpoint", "sandbox",
                           (folder / CK / "theirs.smolcheckpoint").stat().st_size, 3, ["verified by the course staff"],
                           baseline=spec.baseline(), machine={"image": "their/image:1"})
        shelf = Shelf(led)
        assert [r["foreign"] is not None for r in shelf.rows()] == [True]
        out = shelf.export("theirs", str(tmp_path / "out.smolcheckpoint"), spec)
        inside = archive.read_record(out["path"]) or {}
        digest = hashlib.sha256((folder / CK / "theirs.smolcheckpoint").read_bytes()).hexdigest()
        assert "baseline" not in inside and "image" not in inside and "parts" not in inside, inside
        assert "created" not in inside, inside  # the row's time was its author's word too
        assert inside["warnings"] == [
            f"re-exported from a checkpoint row not signed as the exporter's own save (a copied folder's, another "
            f"user's, or from before rows were signed; its file's sha256 {digest}): this record says only what that "
            "row and file said", "its ledger row says: verified by the course staff"], inside["warnings"]
        assert out["note"] == ("checkpoint theirs is not signed as your own save, so it was exported as someone "
                               "else's (its record says only what its file said); if you saved it yourself, "
                               "`%smol checkpoint trust theirs`, then export it again"), out["note"]
        # a copied row that says it was imported (an own import's row is signed): foreign all the same
        forged(folder / CK / "posing.smolcheckpoint", None)
        led.add_checkpoint("posing", IMPORTED, "root", "checkpoints/posing.smolcheckpoint", "sandbox",
                           (folder / CK / "posing.smolcheckpoint").stat().st_size, 3, ["verified by the course staff"])
        posing = shelf.export("posing", str(tmp_path / "posing.smolcheckpoint"), spec)
        said = (archive.read_record(posing["path"]) or {})["warnings"]
        assert said[0].startswith("re-exported from a checkpoint row not signed as the exporter's own save"), said
        assert said[1:] == ["its ledger row says: verified by the course staff"] and "trust posing" in posing["note"]
        # the fix, on this user's word: signed, it exports as their own
        assert shelf.trust("theirs", "s").startswith("signed checkpoint theirs as your own")
        own = archive.read_record(shelf.export("theirs", str(tmp_path / "own.smolcheckpoint"), spec)["path"]) or {}
        assert own["parts"] == spec.parts() and own["warnings"] == ["verified by the course staff"], own
        assert "baseline" not in own  # never exported: a hash over the exporter's paths (test_export_paths)
    finally:
        led.close()
