"""An exported checkpoint names nothing of the exporter's disk or user (audit: a teacher's
export carried ``demo @ file:///home/teacher/...whl``, a path ``image``, a ``baseline`` beginning
with it, and a warning naming the key's folder), and a student's restore still compares the
machine it says with their own sensibly: the same wheel by its file name is the same package."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ckpthelpers import CK, forged

from smolbench.gate import archive, restoring
from smolbench.ledger import Ledger
from smolbench.shelf import Shelf
from smolbench.spec import MachineSpec

LEDGER = ".smolbench/ledger.db"


def test_an_export_names_no_path_of_the_teachers_disk_in_any_field(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home" / "teacher"
    (home / "state").mkdir(parents=True, mode=0o700)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("SMOLBENCH_STATE", str(home / "state"))
    wheel = home / "course" / "wheels" / "demo-1.0-py3-none-any.whl"
    spec = MachineSpec(image=str(home / "course" / "rootfs"), packages=(
        f"demo @ {wheel.as_uri()}", "tok @ https://alice:s3cret@pkgs.example:8443/t-1.0-py3-none-any.whl?k=v#sha256="
        + "a" * 64, "numpy<3"))
    folder = home / "course"
    (folder / CK).mkdir(parents=True)
    forged(folder / CK / "lesson.smolcheckpoint", None)
    led = Ledger(folder / LEDGER)
    try:
        shelf = Shelf(led)
        warning = (f"saved unsigned: no checkpoint key could be made ([Errno 13] Permission denied: "
                   f"'{home}/.local/state/smolbench'), see {folder}/notes.txt and /srv/teacher/x.txt")
        shelf.add("lesson", "20260101-000000-abcdef", "root", "lesson.smolcheckpoint", "sandbox",
                  (folder / CK / "lesson.smolcheckpoint").stat().st_size, 1, [warning],
                  baseline=spec.baseline(), machine=spec.machine())
        out = shelf.export("lesson", str(tmp_path / "lesson.smolcheckpoint"), spec)
    finally:
        led.close()
    record = archive.read_record(out["path"]) or {}
    for key, value in record.items():  # every field the export writes
        said = json.dumps(value)
        assert str(home) not in said and "teacher" not in said and "s3cret" not in said, (key, said)
    assert record["packages"] == ["demo @ demo-1.0-py3-none-any.whl", "tok @ https://pkgs.example:8443/t-1.0-py3-none-"
                                  "any.whl#sha256=" + "a" * 64, "numpy<3"], record["packages"]
    assert record["image"] == "\u2026/rootfs" and "baseline" not in record, record
    assert record["warnings"] == ["saved unsigned: no checkpoint key could be made ([Errno 13] Permission denied: "
                                  "'~/.local/state/smolbench'), see ~/course/notes.txt and \u2026/x.txt"], record["warnings"]
    assert record["parts"]["env"] == spec.parts()["env"] and record["parts"]["packages"] != spec.parts()["packages"]
    assert "demo @ demo-1.0-py3-none-any.whl" in str(out["note"])

    # a student with the same wheel and rootfs in their own folders: the same machine, nothing said
    student = MachineSpec(image="/home/student/rootfs", packages=(
        "demo @ file:///home/student/w/demo-1.0-py3-none-any.whl",
        "tok @ https://bob:x@pkgs.example:8443/t-1.0-py3-none-any.whl#sha256=" + "a" * 64, "numpy<3"))
    assert restoring.baseline_notice("lesson", record.get("baseline"), student.baseline(), True, machine=record,
                                     spec=student) is None
    # one without the wheel is told which, by its file name
    lacking = MachineSpec(image="/home/student/rootfs", packages=("numpy<3",))
    said = restoring.baseline_notice("lesson", None, lacking.baseline(), True, machine=record, spec=lacking) or ""
    assert "this one lacks demo @ demo-1.0-py3-none-any.whl" in said and "its image" not in said, said
    # and one with another rootfs is told that
    other = MachineSpec(image="/srv/other", packages=student.packages)
    said = restoring.baseline_notice("lesson", None, other.baseline(), True, machine=record, spec=other) or ""
    assert "its image \u2026/rootfs, this machine's /srv/other" in said, said


def test_a_students_other_wheel_of_the_same_name_or_a_named_image_is_not_the_same(tmp_path: Path) -> None:
    """The attack (audit): a student's wheel of the teacher's file name but other content, and a
    registry image named ``rootfs`` against the teacher's rootfs folder, were both reported the
    same machine. An export now says a local wheel with its content's hash, and a path image marked."""
    teacher, student = tmp_path / "teacher" / "demo-1.0-py3-none-any.whl", tmp_path / "student" / "demo-1.0-py3-none-any.whl"
    for wheel, text in ((teacher, b"the teacher's"), (student, b"someone else's")):
        wheel.parent.mkdir()
        wheel.write_bytes(text)
    theirs = MachineSpec(image="/srv/course/rootfs", packages=(f"demo @ {teacher.as_uri()}",))
    record = restoring.shared_record({**theirs.machine(), "parts": theirs.parts()})
    assert record["packages"] == ["demo @ demo-1.0-py3-none-any.whl#sha256=" + hashlib.sha256(b"the teacher's").hexdigest()]
    other = MachineSpec(image="/home/s/rootfs", packages=(f"demo @ {student.as_uri()}",))
    said = restoring.baseline_notice("lesson", None, other.baseline(), True, machine=record, spec=other) or ""
    assert "this one lacks demo @ demo-1.0-py3-none-any.whl#sha256=" in said, said
    student.write_bytes(b"the teacher's")  # the same wheel in the student's own folder: the same
    assert restoring.baseline_notice("lesson", None, other.baseline(), True, machine=record, spec=other) is None
    named = MachineSpec(image="rootfs", packages=other.packages)
    said = restoring.baseline_notice("lesson", None, named.baseline(), True, machine=record, spec=named) or ""
    assert "its image \u2026/rootfs, this machine's rootfs" in said, said


def test_the_workspaces_pip_shims_name_no_path_of_the_host(tmp_path: Path) -> None:
    """The attack (audit): an exported workspace's ``.packages/.bin/pip`` said ``exec
    /home/teacher/.venv/bin/python -m pip``. The shims now find the interpreter when they run."""
    from smolbench.guest import pipsite

    pipsite._shims(str(tmp_path))
    for name in ("pip", "pip3"):
        body = (tmp_path / name).read_text()
        assert sys.executable not in body and sys.prefix not in body, body
    env = {"PATH": os.environ.get("PATH", ""), getattr(pipsite, "PYTHON_ENV", "X"): sys.executable}
    done = subprocess.run([str(tmp_path / "pip"), "--version"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("pip "), done.stderr
