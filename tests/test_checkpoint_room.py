"""A sandbox keeps a machine's files in memory (within ``disk``) and its cgroup counts them as its
memory. A save copied the whole workspace into an archive in the machine's run folder, memory
too: a machine whose disk was full was killed by its own save (the save now streams the archive
to the host through a fifo). A checkpoint too big for the Smolfile's machine booted one, copied
for a while and failed naming a file the failure had removed (now refused before any machine
starts, naming the file given, with a disk and a memory that fit). A disk that leaves memory no
room is said at up."""

from __future__ import annotations

import gzip
import io
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from ckpthelpers import NAMESPACE

import smolbench
from smolbench.backends import _limits
from smolbench.backends.sandbox import SandboxBackend
from smolbench.errors import SmolbenchError

pytestmark = [
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)"),
    pytest.mark.skipif(not _limits.detect().bases, reason="needs a writable cgroup: only a cgroup counts files as memory"),
]

FILL = "with open('big.bin', 'wb') as f:\n    for i in range(2000):\n        f.write(b'x' * (1 << 20))"


@pytest.fixture
def here(open_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.chdir(open_tmp)
    yield open_tmp


def test_a_machine_whose_disk_is_full_saves_a_checkpoint_and_lives(here: Path) -> None:
    (here / "Smolfile").write_text('memory = "256M"\n')  # disk: 128M, its files counted in the 256M
    notes: list[str] = []
    with smolbench.Session(backend="sandbox", on_notice=notes.append) as s:
        s.run("kept = 'still here'")
        full = s.run(FILL)
        assert full.error is not None and "No space left on device" in str(full.error), full
        size = s.run("import os; os.path.getsize('big.bin')").value
        assert size > 100 << 20, size
        # before: "machine ran out of memory (limit 256M, ...) (machine root was lost)", every later cell "no machine is up"
        saved = s.checkpoint_save("full")
        assert saved["name"] == "full", saved
        assert s.run("kept").value == "still here"  # the machine saved is the machine kept
        node = s.checkpoint_restore("full")  # and what was saved comes back whole
        assert s.run("os.path.getsize('big.bin'), kept", node=node).value == (size, "still here")
    assert not [n for n in notes if "disk =" in n], notes  # the default disk: nothing to say at up


def _big_checkpoint(path: Path, mib: int) -> None:
    """A checkpoint file whose workspace holds one file of ``mib`` MiB (zeros: a small file)."""
    ws = io.BytesIO()
    with tarfile.open(fileobj=ws, mode="w:") as tar:
        info = tarfile.TarInfo("data.bin")
        info.size = mib << 20
        tar.addfile(info, io.BytesIO(bytes(info.size)))
    with gzip.open(path, "wb", compresslevel=1) as gz, tarfile.open(fileobj=gz, mode="w|") as tar:
        for name, data in (("namespace.pkl", NAMESPACE), ("workspace.tar", ws.getvalue())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.fixture
def no_boot(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the machines the sandbox backend was asked to start."""
    booted: list[str] = []
    create = SandboxBackend.create

    async def counted(self: SandboxBackend, spec: object, name: str) -> object:
        booted.append(name)
        return await create(self, spec, name)  # type: ignore[arg-type]

    monkeypatch.setattr(SandboxBackend, "create", counted)
    return booted


def test_a_checkpoint_too_big_for_the_smolfile_is_refused_before_a_machine_starts(here: Path, no_boot: list[str]) -> None:
    given = here / "class" / "big150.smolcheckpoint"
    given.parent.mkdir()
    _big_checkpoint(given, 150)
    (here / "Smolfile").write_text('memory = "256M"\n')  # disk: 128M
    fix = 'set disk = "192M" and memory = "384M" in the Smolfile'
    copies = here / ".smolbench" / "checkpoints"

    # nothing up: refused before the restore's machine (or any) comes up
    s = smolbench.Session(backend="sandbox", on_notice=lambda line: None)
    try:
        with pytest.raises(SmolbenchError) as refused:
            s.checkpoint_restore(str(given))
        assert not s.is_up and no_boot == []
    finally:
        s.down()
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith(f"checkpoint {given} doesn't fit in a machine of this Smolfile (its files take 150 MiB, "
                           "more than disk = 128M): "), line
    assert fix in line and "nothing was started" in line, line
    assert not copies.exists() or list(copies.glob("*.smolcheckpoint")) == []

    # something up: refused before the new machine starts, named as given (its copy here is gone)
    with smolbench.Session(backend="sandbox", on_notice=lambda line: None) as s:
        with pytest.raises(SmolbenchError) as refused:
            s.checkpoint_restore(str(given))
        assert no_boot == ["root"] and s.workbench is not None and list(s.workbench.machines) == ["root"]
    line = str(refused.value)
    assert line.startswith(f"checkpoint {given} doesn't fit"), line
    assert ".smolbench/checkpoints" not in line and fix in line, line
    assert list(copies.glob("*.smolcheckpoint")) == []

    # the fix it names is one that works
    (here / "Smolfile").write_text('memory = "384M"\ndisk = "192M"\n')
    with smolbench.Session(backend="sandbox", on_notice=lambda line: None) as s:
        node = s.checkpoint_restore(str(given))
        assert s.run("import os; os.path.getsize('data.bin')", node=node).value == 150 << 20
        assert s.checkpoint_save("again")["name"] == "again"  # and its next save too


def test_a_disk_that_leaves_memory_no_room_is_said_at_up(here: Path) -> None:
    (here / "Smolfile").write_text('memory = "256M"\ndisk = "256M"\n')
    notes: list[str] = []
    with smolbench.Session(backend="sandbox", on_notice=notes.append) as s:
        assert s.run("1 + 1").value == 2  # a notice, not a refusal
    said = [n for n in notes if "disk =" in n]
    assert said == ["smolbench: note: disk = 256M leaves memory = 256M no room: a sandbox keeps its files in memory, "
                    "counted as its memory, so files filling the disk would kill the machine for memory before a "
                    'write fails with ENOSPC; set disk = "128M" (half of memory, the default) or raise memory in the '
                    "Smolfile"], notes
