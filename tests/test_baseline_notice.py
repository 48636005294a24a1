"""A restore of a checkpoint saved on another baseline says, in its one line, what differs
and how to restore it where it matches: it named two opaque hashes (`host@b4a6…` vs
`host@9a0f…`) and no way on."""

from __future__ import annotations

from smolbench.gate import restoring
from smolbench.spec import MachineSpec

FIX = "; restore it where its Smolfile is: `%smol down`, then `%smol up --smolfile PATH` and restore again"


def test_the_baseline_warning_ends_with_the_fix_and_names_what_differs() -> None:
    same_image = restoring.baseline_notice("lesson1", "host@b4a6c0ffee00", "host@9a0f12345678", True)
    assert same_image == (
        "the file says lesson1 was saved on baseline host@b4a6c0ffee00, not this machine's host@9a0f12345678 "
        "(the same image host: its packages, env, init, network allowance or limits differ, and its record, an older "
        "smolbench's, doesn't say which): its variables and files are back, but what its cells installed or relied "
        "on may differ" + FIX)
    other = restoring.baseline_notice("lesson1", "python:3.12@b4a6c0ffee00", "host@9a0f12345678", False)
    assert other is not None and other.startswith("its ledger row says lesson1 ")
    assert "(its image python:3.12, this machine's host):" in other and other.endswith(FIX)
    # a claim that is not IMAGE@HASH says nothing of what differs; text from a file stays one line
    odd = restoring.baseline_notice("x", "\x1b]0;t\x07@\n" + "a" * 300, "host@9a0f12345678", True)
    assert odd is not None and odd.isprintable() and len(odd) < 600 and odd.endswith(FIX), odd
    assert "\\x1b]0;t\\x07" in odd
    assert restoring.baseline_notice("x", "host@9a0f12345678", "host@9a0f12345678", True) is None


TEACHER = MachineSpec(allow_hosts=("pypi.org", "files.pythonhosted.org"), memory=2048, cpus=2)


def test_a_sessions_network_allowance_or_limits_are_not_another_machine() -> None:
    """The teacher's one-session `--allow` (and a bigger machine) made the student's restore, with
    the identical Smolfile, warn of "another baseline" and ask for a Smolfile the student had."""
    student = MachineSpec()
    assert TEACHER.baseline() != student.baseline()  # the ledger's baseline still says all of it
    said = restoring.baseline_notice("withpip", TEACHER.baseline(), student.baseline(), True,
                                     machine=TEACHER.machine(), spec=student)
    assert said is None
    # what a namespace needs is compared: the image, packages, env, init, workdir, volumes
    for other, differs in ((MachineSpec(image="python:3.12"), "its image python:3.12, this machine's host"),
                           (MachineSpec(env=(("LEVEL", "3"),)), "its Smolfile's env differs"),
                           (MachineSpec(init=("make",), workdir="/w"), "its Smolfile's init and workdir differ")):
        said = restoring.baseline_notice("x", other.baseline(), student.baseline(), False, machine=other.machine(),
                                         spec=student)
        assert said is not None and said.startswith(f"its ledger row says x was saved on a machine unlike this one "
                                                    f"({differs}") and said.endswith(FIX), said


def test_what_differs_is_named_and_nothing_claims_variables_are_back_when_they_are_not() -> None:
    teacher = MachineSpec(packages=("pygame==2.5.2", "sortedcontainers", "numpy<3"), memory=2048)
    student = MachineSpec(packages=("numpy<3",))
    said = restoring.baseline_notice("maze", teacher.baseline(), student.baseline(), True, machine=teacher.machine(),
                                     spec=student, failed=True)
    assert said == ("the file says maze was saved on a machine unlike this one (its Smolfile's packages differ: the "
                    "file's machine had pygame==2.5.2, sortedcontainers, numpy<3, this one lacks pygame==2.5.2, "
                    "sortedcontainers; the file's machine had memory 2G, this one 1G): the variables not restored "
                    "(named above) may need what its machine had" + FIX)
    assert "are back" not in said
    old = restoring.baseline_notice("maze", "host@b4a6c0ffee00", "host@9a0f12345678", True, failed=True)
    assert old is not None and "are back" not in old and "may need what its machine had" in old


NOT_RESTORED = ["not restored: pygame (ModuleNotFoundError: No module named 'pygame'), SortedList "
                "(ModuleNotFoundError: No module named 'sortedcontainers'), maze (NameError: x)"]


def test_variables_that_want_a_module_name_the_packages_this_machine_lacks() -> None:
    teacher = MachineSpec(packages=("pygame==2.5.2", "Sorted_Containers>=2"))
    student = MachineSpec(packages=("Sorted_Containers>=2",))
    said = restoring.modules_notice("maze", NOT_RESTORED, teacher.machine(), student, None)
    assert said == ("variables of maze need modules this machine doesn't have (pygame, sortedcontainers): the file's "
                    "machine's Smolfile had packages pygame==2.5.2, which this one lacks: add them to this machine's "
                    "Smolfile (`packages = [...]`), then `%smol down`, `%smol up` and restore again (a `%pip "
                    "install` in a cell brings the module, not the variables)")
    # said once: the line saying the machine differs names them already
    differs = restoring.baseline_notice("maze", teacher.baseline(), student.baseline(), True,
                                        machine=teacher.machine(), spec=student, failed=True)
    assert differs is not None and "this one lacks pygame==2.5.2" in differs
    assert restoring.modules_notice("maze", NOT_RESTORED, teacher.machine(), student, differs) is None
    # a record from before: no package list to name, and the fix
    old = restoring.modules_notice("maze", NOT_RESTORED, {"memory": 1024}, student, None)
    assert old is not None and "the file doesn't say which packages its machine had" in old
    assert restoring.modules_notice("maze", ["not restored: f (TypeError: x)"], teacher.machine(), student, None) is None


def test_what_a_row_or_record_says_of_its_machine_is_only_what_a_record_may_carry() -> None:
    """A copied folder's ledger row may hold anything in its machine column."""
    claims = restoring.machine_claims({"parts": {"env": "x" * 5000}, "packages": ["a\x1b[2Kb"], "memory": -1,
                                       "cpus": 2, "image": None, "shell": "rm -rf /"})
    assert claims == {"cpus": 2, "image": None}
    assert restoring.machine_claims("not a dict", None, [1]) == {}
    said = restoring.baseline_notice("x", "host@b4a6c0ffee00", "host@9a0f12345678", False,
                                     machine={"parts": "no", "memory": 4096}, spec=MachineSpec())
    assert said is not None and "its machine had memory 4G, this one 1G" in said  # an old row's comparison
