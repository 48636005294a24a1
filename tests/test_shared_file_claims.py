"""What restoring a checkpoint file from someone else says, and what it leaves (the fifth audit).

A shared file is its author's bytes, and so is everything its machine sends back: the names
of the variables a restore skipped reach a host line, and a save's reach the ledger too.
A refused restore leaves nothing in this folder. What the file's record claims (its
node, baseline and warnings) is shown and kept as its claim, beside what this folder knows
of it (where it came from, its SHA-256); no message steers anyone to the process backend.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
from ckpthelpers import CK, forged, record, rows, workspace
from nbhelpers import NotebookSession, ok, stream_text

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")

# a name that, printed raw, sets the terminal's title, writes the clipboard (OSC 52), and
# overwrites the line above with a fake verdict
EVIL = ("\x1b]0;pwned\x07\x1b]52;c;cHduZWQ=\x07\r\x1b[2K\x1b[1A"
        "smolbench: restored lesson1 from the course staff … verified")


STAFF = "verified by the course staff: built from your Smolfile (baseline matches)"


def _shown_safely(text: str) -> None:
    for line in text.splitlines():
        assert line.isprintable(), repr(line[:200])


def test_a_shared_namespace_s_names_reach_no_terminal_and_stay_short(open_tmp: Path) -> None:
    """Audit A: a namespace (plain data, no code) with a variable named like a terminal
    command, and 7,000 names of 4,000 characters (61 kB of gzip), made a restore print the
    name raw and one warning line of 28 million characters; a save's warning, kept in the
    ledger, was the same. Each name is now one escaped line of at most 256 characters, and
    a warning lists the first 20 and how many more."""
    names = {EVIL: b"not a pickle"} | {f"v{i:04d}" + "x" * 3995: b"not a pickle" for i in range(7000)}
    blob = pickle.dumps({"vars": names, "modules": {}, "seed": None, "name": "root"}, protocol=4)
    gift = open_tmp / "lesson1.smolcheckpoint"
    forged(gift, record(name="lesson1"), [("namespace.pkl", blob), ("workspace.tar", workspace())])
    assert gift.stat().st_size < 200_000
    student = open_tmp / "student"
    student.mkdir()
    with NotebookSession(student, timeout=300) as s:
        ok(s.run("%load_ext smolbench"))
        ok(s.run("%smol up --backend sandbox"))
        cell = ok(s.run(f"%smol checkpoint restore {gift}"))
        warning = stream_text(cell, "stderr")
        _shown_safely(warning)
        assert warning.startswith("smolbench: warning: not restored: \\x1b]0;pwned\\x07\\x1b]52;c;"), warning[:300]
        assert warning.count("\n") == 1 and len(warning) < 8_000, len(warning)
        assert warning.rstrip("\n").endswith("… and 6981 more"), warning[-300:]
        assert "smolbench: restored lesson1 as r1-lesson1 (now active)" in stream_text(cell)
        # a save's warning, which the ledger keeps
        ok(s.run(f"%%smol\nimport threading\nglobals()[{EVIL!r}] = threading.Lock()"))
        cell = ok(s.run("%smol checkpoint save mine"))
        warning = stream_text(cell, "stderr")
        _shown_safely(warning)
        assert warning.startswith("smolbench: warning: not saved (can't be pickled): \\x1b]0;pwned"), warning[:300]
        ok(s.run("%smol down"))
    kept = rows(student)["mine"]["warnings"]
    assert len(kept) == 1 and kept[0].isprintable() and len(kept[0]) < 8_000, kept
    assert sorted(p.name for p in (student / CK).iterdir()) == ["lesson1.smolcheckpoint", "mine.smolcheckpoint"]


@pytest.mark.parametrize(("backend", "made", "why"), [
    # smol's checkpoints never travel as a file: a record saying so was written by hand (it
    # advised bringing up a microVM for it, and with nothing up said it was bringing one up)
    ("sandbox", "smol", "says the smol backend made it, but smol's checkpoints never travel as a file"),
    ("process", "sandbox", "was not saved in this kernel: its saved state is code"),
])
def test_a_refused_file_leaves_nothing_here(open_tmp: Path, backend: str, made: str, why: str) -> None:
    """Audit B: a file refused for its backend (a microVM's on the sandbox; anyone's on the
    process backend, which has no isolation) was refused after it was copied in, and left
    its copy and an 'imported' row: the folder then listed a checkpoint nothing restored."""
    import smolbench
    from smolbench.errors import SmolbenchError

    student = open_tmp / "student"
    student.mkdir()
    gift = open_tmp / "gift.smolcheckpoint"
    forged(gift, record(name="gift", backend=made))
    with smolbench.Session(backend=backend, ledger=student / ".smolbench" / "ledger.db") as s:
        with pytest.raises(SmolbenchError) as refused:
            s.checkpoint_restore(str(gift))
        assert sorted(p.name for p in (student / CK).iterdir()) == []
        assert rows(student) == {}
        line = str(refused.value)
        assert why in line and line.endswith("; nothing was added") and "--backend process" not in line, line
        assert s.run("print(1)").stdout == "1\n"  # the session's machine is still there
    assert gift.exists()


def test_a_file_s_claims_are_kept_as_its_claims(open_tmp: Path) -> None:
    """Audit C: a record's node, cells, baseline and warnings became this folder's facts (a
    warning "verified by the course staff" read as smolbench's own), nothing said where the
    file came from or which bytes it was, and the restored machine took this session's
    baseline with no word that the file claimed another."""
    import hashlib

    import smolbench
    from smolbench.ledger import Ledger

    student = open_tmp / "student"
    student.mkdir()
    gift = open_tmp / "lesson1.smolcheckpoint"
    forged(gift, record(name="lesson1", node="root.3", cells=7, baseline="f" * 64, warnings=[STAFF]))
    notices: list[str] = []
    with smolbench.Session(backend="sandbox", ledger=student / ".smolbench" / "ledger.db",
                           on_notice=notices.append) as s:
        assert s.checkpoint_restore(str(gift)) == "r1-lesson1"
        assert s.workbench is not None
        said = [n for n in notices if "was saved on baseline" in n]
        assert f"smolbench: warning: the file says: {STAFF}" in notices  # said as its claim
        assert said == [f"smolbench: warning: the file says lesson1 was saved on baseline {'f' * 64}, not this "
                        f"machine's {s.workbench.baseline}: its variables and files are back, but what its cells "
                        "installed or relied on may differ; restore it where its Smolfile is: `Session.down()`, then "
                        "`Session(smolfile='PATH').up()` and restore again"], notices  # in the Session's words
        row = rows(student)["lesson1"]
        assert (row["session_id"], row["node_id"], row["cells"], row["baseline"]) == ("imported", "root.3", 7, "f" * 64)
        assert row["warnings"] == [f"the file says: {STAFF}"]
        assert row["source"] == str(gift) and row["sha256"] == hashlib.sha256(gift.read_bytes()).hexdigest()
        led = Ledger(student / ".smolbench" / "ledger.db")
        try:
            [trust] = [t for t in led.trust_rows() if t["scope"] == "restore"]
        finally:
            led.close()
        assert trust["detail"].startswith(f"r1-lesson1: checkpoint lesson1 from a file (sha256 {row['sha256']}, "
                                          f"added from {gift}); the file says lesson1 was saved on baseline fff")


def test_the_panel_shows_a_file_s_claims_and_never_advises_the_process_backend(open_tmp: Path) -> None:
    """Audit C: the panel showed a file's node and warnings as smolbench's own, and for a file whose
    record said "process" it blocked Restore with "`%smol up --backend process` first":
    steering a student to the backend with no isolation, for someone else's pickle."""
    import smolbench
    from smolbench.widgets.checkpoints import checkpoint_record

    student = open_tmp / "student"
    student.mkdir()
    gift, other = open_tmp / "lesson1.smolcheckpoint", open_tmp / "proc.smolcheckpoint"
    forged(gift, record(name="lesson1", node="root.3", warnings=[STAFF]))
    forged(other, record(name="proc", backend="process"))
    with smolbench.Session(backend="sandbox", ledger=student / ".smolbench" / "ledger.db") as s:
        s.checkpoint_restore(str(gift))
        assert s.checkpoint_restore(str(other)) == "r2-proc"  # the sandbox restores it
        assert s.workbench is not None
        # the panel's rows, as its snapshot makes them (no widget: one would outlive this session)
        panel = {c["name"]: c for c in (checkpoint_record(r, "sandbox") for r in s.workbench.shelf.rows())}
        assert panel["lesson1"]["warnings"] == [f"the file says: {STAFF}"]
        assert panel["lesson1"]["node"] == "root.3 (the file says)"  # not this session's root.3
        assert panel["proc"]["blocked"] == {} and panel["lesson1"]["blocked"] == {}
        proc = {**rows(student)["proc"], "exists": True}
        for backend in ("smol", "process", "cluster", "sandbox"):
            why = checkpoint_record(proc, backend)["blocked"].get("restore", "")
            assert "--backend process" not in why, (backend, why)
        assert "`%smol up --backend sandbox` to restore it" in checkpoint_record(proc, "smol")["blocked"]["restore"]
        assert "was not saved in this kernel" in checkpoint_record(proc, "process")["blocked"]["restore"]
        # a copied ledger's row may say anything for its backend: named as text, escaped
        odd = checkpoint_record({**proc, "backend": "\x1b]0;x\x07"}, "sandbox")["blocked"]["restore"]
        assert odd.endswith("made by a backend called \\x1b]0;x\\x07, which smolbench doesn't have"), odd
        assert "called 5," in checkpoint_record({**proc, "backend": 5}, "sandbox")["blocked"]["restore"]


class _Raises:
    """Unpickled, raises an error whose message sets the terminal's title, then runs on for 900,000 characters."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import builtins

        return (builtins.exec, ("raise ValueError('\\x1b]0;pwned\\x07\\r\\x1b[2K' + 'y' * 900_000)",))


def test_a_shared_namespace_s_error_is_one_short_line(open_tmp: Path) -> None:
    """A namespace that raises as it loads (its pickle runs code in the machine, as any may)
    chose the message of the restore's failure: escapes and 900,000 characters in one host line."""
    import smolbench
    from smolbench.errors import SmolbenchError

    student = open_tmp / "student"
    student.mkdir()
    gift = open_tmp / "boom.smolcheckpoint"
    forged(gift, record(name="boom"), [("namespace.pkl", pickle.dumps(_Raises(), protocol=4)),
                                       ("workspace.tar", workspace())])
    with smolbench.Session(backend="sandbox", ledger=student / ".smolbench" / "ledger.db") as s:
        with pytest.raises(SmolbenchError) as failed:
            s.checkpoint_restore(str(gift))
    line = str(failed.value)
    assert line.isprintable() and len(line) < 1_000, (len(line), line[:300])
    assert "its saved state can't be loaded (ValueError: \\x1b]0;pwned\\x07" in line and line.endswith("nothing was added")
    assert rows(student) == {}


def test_a_re_export_carries_the_file_s_claims_as_its_claims(tmp_path: Path) -> None:
    """Audit C, one hop on: a file restored here and exported again lost the baseline its record
    claimed (the export took this folder's node's, which an imported row has none of), so the
    next person's restore warned of nothing; a claim equal to this machine's baseline took this
    machine's image and size, and the file's time became the time it was added here. A re-export
    now carries the claims as they were, says where it came from (the SHA-256 it was added with),
    and the next folder's row and baseline warning are the first's."""
    import hashlib

    from smolbench.gate import archive, restoring
    from smolbench.ledger import Ledger
    from smolbench.shelf import Shelf
    from smolbench.spec import MachineSpec

    spec = MachineSpec()
    claims = {"node": "root.3", "cells": 7, "baseline": "f" * 64, "warnings": [STAFF], "created": 1000.0}
    gift = tmp_path / "lesson1.smolcheckpoint"
    forged(gift, record(name="lesson1", **claims))
    same = tmp_path / "same.smolcheckpoint"  # a claim of this machine's very baseline, with its own image
    forged(same, record(name="same", baseline=spec.baseline(), image="their/image:1", memory=64))
    said: dict[str, dict[str, object]] = {}
    for folder, file in (("student", gift), ("friend", tmp_path / "shared" / "lesson1.smolcheckpoint")):
        led = Ledger(tmp_path / folder / ".smolbench" / "ledger.db")
        try:
            shelf = Shelf(led)
            said[folder] = row = shelf.adopt(str(file), "sandbox").row
            if folder == "student":  # restored here, then shared again
                (tmp_path / "shared").mkdir()
                out = shelf.export("lesson1", str(tmp_path / "shared" / "lesson1.smolcheckpoint"), spec)
                shelf.adopt(str(same), "sandbox")
                again = shelf.export("same", str(tmp_path / "shared" / "same.smolcheckpoint"), spec)["record"]
        finally:
            led.close()
        assert row["baseline"] == "f" * 64
        assert restoring.baseline_notice("lesson1", row["baseline"], spec.baseline(), True) == (
            f"the file says lesson1 was saved on baseline {'f' * 64}, not this machine's {spec.baseline()}: its "
            "variables and files are back, but what its cells installed or relied on may differ; restore it where "
            "its Smolfile is: `%smol down`, then `%smol up --smolfile PATH` and restore again")
    inside = archive.read_record(out["path"]) or {}
    assert {k: inside[k] for k in claims} == {**claims, "warnings": [
        f"re-exported: added to its folder from a checkpoint file (sha256 "
        f"{hashlib.sha256(gift.read_bytes()).hexdigest()}) that said what this record says", f"the file says: {STAFF}"]}
    assert (said["friend"]["node_id"], said["friend"]["cells"]) == ("root.3", 7)
    assert said["friend"]["warnings"][1] == f"the file says: {STAFF}"
    assert (again["baseline"], again["image"], again["memory"]) == (spec.baseline(), "their/image:1", 64)


def test_a_re_export_says_where_it_came_from_first_and_claims_no_time_the_file_did_not(tmp_path: Path) -> None:
    """A file with the most warnings a record holds pushed the re-export's own line out (it came
    last), and one that claimed no time was re-exported with the time it was added here, as if
    the file had said so. The line names the SHA-256 of the bytes added, read from them."""
    import hashlib

    from smolbench.gate import archive
    from smolbench.ledger import Ledger
    from smolbench.shelf import Shelf

    full = tmp_path / "full.smolcheckpoint"
    forged(full, record(name="full", warnings=[f"{STAFF} ({i})" for i in range(20)]))
    led = Ledger(tmp_path / "here" / ".smolbench" / "ledger.db")
    try:
        shelf = Shelf(led)
        shelf.adopt(str(full), "sandbox")
        row = led.checkpoint("full") or {}
        out = shelf.export("full", str(tmp_path / "out.smolcheckpoint"))
        led.add_checkpoint("full", "imported", "", row["path"], "sandbox", full.stat().st_size, 0, row["warnings"],
                           sha256="0" * 64, baseline="b" * 64)  # rows an older install left beside another file
        older = shelf.export("full", str(tmp_path / "older.smolcheckpoint"))
    finally:
        led.close()
    digest = hashlib.sha256(full.read_bytes()).hexdigest()
    inside = archive.read_record(out["path"]) or {}
    assert inside["warnings"][0] == (f"re-exported: added to its folder from a checkpoint file (sha256 {digest}) "
                                     "that said what this record says")
    assert len(inside["warnings"]) == 20 and "created" not in inside and "baseline" not in inside
    # an older install's row is not signed: exported as someone else's, its file named first all the same
    said = archive.read_record(older["path"]) or {}
    assert said["warnings"][0].startswith("re-exported from a checkpoint row not signed as the exporter's own save")
    assert f"its file's sha256 {digest}" in said["warnings"][0]
    assert len(said["warnings"]) == 20 and "created" not in said and "baseline" not in said


def test_a_file_claiming_smol_is_one_line_before_anything_comes_up(open_tmp: Path) -> None:
    """Explorer: with nothing up, a file whose record said the smol backend made it printed
    "bringing up a smol machine for this checkpoint", then "... is not a smol checkpoint":
    two lines that contradict each other, and a microVM started for a file no smol made."""
    gift = open_tmp / "gift.smolcheckpoint"
    forged(gift, record(name="gift", backend="smol"))
    with NotebookSession(open_tmp, allow_errors=True) as s:
        ok(s.run("%load_ext smolbench"))
        cell = s.run(f"%smol checkpoint restore {gift}")
        said = stream_text(cell)
        assert "bringing up" not in said, said
        error = [o for o in cell.outputs if o.output_type == "error"]
        assert len(error) == 1 and error[0].evalue == (
            f"checkpoint {gift} says the smol backend made it, but smol's checkpoints never travel as a file (this "
            "one was written or changed by hand): ask for one made with `%smol checkpoint export NAME PATH`; "
            "nothing was added"), cell.outputs
        assert "no machine is up" in stream_text(s.run("%smol status"))
