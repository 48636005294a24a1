"""What a teacher and students are told of the machine a shared checkpoint needs, through real
sandbox machines.

A teacher's one-session `--allow` made each student's restore (with the identical Smolfile) warn
that the file "was saved on another baseline" and to restore it where its Smolfile is: a false
alarm the student could not fix. A file whose variables need packages the student's machine
lacks said only "not restored: pygame (ModuleNotFoundError …)", then that "its variables and
files are back"; now it names the packages its machine had and this one lacks, and the fix.
"""

from __future__ import annotations

import json
import pickle
import shutil
import tarfile
from pathlib import Path

import pytest
from ckpthelpers import forged, record, workspace

from smolbench.spec import MachineSpec

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")


def _record_of(path: Path) -> dict:
    with tarfile.open(path, "r:gz") as tar:
        first = tar.next()
        assert first is not None and first.name == "smolbench-record.json"
        f = tar.extractfile(first)
        assert f is not None
        return json.loads(f.read())


def test_a_teachers_network_allowance_is_no_other_machine_for_a_student(open_tmp: Path) -> None:
    import smolbench

    teacher, student = open_tmp / "teacher", open_tmp / "student"
    gift = open_tmp / "class" / "withpip.smolcheckpoint"
    gift.parent.mkdir()
    with smolbench.Session(backend="sandbox", allow="pypi.org,files.pythonhosted.org",
                           ledger=teacher / ".smolbench" / "ledger.db") as s:
        s.run("level = 3").raise_for_error()
        s.checkpoint_save("withpip")
        s.down()  # exported with nothing up: the ledger row says what the machine was
        info = s.checkpoint_export("withpip", gift)
    assert info["note"] is None  # a Smolfile that sets nothing: nothing to hand out besides the file
    said = _record_of(gift)
    assert said["parts"] == MachineSpec().parts() and said["packages"] == [] and said["memory"] == 1024
    notices: list[str] = []
    with smolbench.Session(backend="sandbox", ledger=student / ".smolbench" / "ledger.db",
                           on_notice=notices.append) as s:
        assert s.checkpoint_restore(gift) == "r1-withpip"
        assert s.run("print(level)").stdout == "3\n"
    assert not [n for n in notices if "warning" in n], notices


def test_variables_that_need_packages_name_them_and_the_fix(open_tmp: Path) -> None:
    import smolbench

    teacher = MachineSpec(packages=("pygame==2.5.2", "sortedcontainers"), allow_hosts=("pypi.org",))
    namespace = pickle.dumps({"vars": {}, "modules": {"pygame": "pygame", "sc": "sortedcontainers"}, "seed": None,
                              "name": "root"}, protocol=4)
    gift = open_tmp / "maze.smolcheckpoint"
    forged(gift, record(name="maze", baseline=teacher.baseline(), **teacher.machine()),
           [("namespace.pkl", namespace), ("workspace.tar", workspace())])
    notices: list[str] = []
    with smolbench.Session(backend="sandbox", ledger=open_tmp / "s" / ".smolbench" / "ledger.db",
                           on_notice=notices.append) as s:
        s.checkpoint_restore(gift)
    warned = [n.removeprefix("smolbench: warning: ") for n in notices if n.startswith("smolbench: warning: ")]
    assert len(warned) == 2, warned
    assert warned[0].startswith("not restored: pygame (ModuleNotFoundError: No module named 'pygame'), sc "), warned
    assert warned[1] == (
        "the file says maze was saved on a machine unlike this one (its Smolfile's packages differ: the file's "
        "machine had pygame==2.5.2, sortedcontainers, this one lacks pygame==2.5.2, sortedcontainers): the variables "
        "not restored (named above) may need what its machine had; restore it where its Smolfile is: "
        "`Session.down()`, then `Session(smolfile='PATH').up()` and restore again"), warned[1]
