"""A default machine that fills its disk gets ENOSPC and lives on (the sandbox keeps its files
in memory, counted as the machine's memory under a cgroup: a disk as big as memory made a full
disk kill the machine for memory). Through a real kernel, plus the lines that say it."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from nbhelpers import NotebookSession, ok, one_line, result_text
from test_limits import FILL  # inside a machine: write 1 MiB chunks until it fails

from smolbench.backends import _bwrap, _limits
from smolbench.smolfile import parse_smolfile


def test_the_default_disk_leaves_the_machine_room_to_live() -> None:
    spec = parse_smolfile("")
    assert spec.disk_mib is None  # the Smolfile's default: baselines and checkpoints stay as they were
    assert _bwrap.disk_mib(spec) == spec.memory // 2
    assert _bwrap.disk_mib(parse_smolfile('memory = "128M"')) == 64
    assert _bwrap.disk_mib(parse_smolfile('memory = "1G"\ndisk = "1G"')) == 1024  # written: as written


def test_running_out_of_memory_with_files_says_files_count_and_names_disk() -> None:
    spec = parse_smolfile('memory = "1G"\ndisk = "1G"')
    plain = _limits.out_of_memory_line(spec)
    assert plain == "machine ran out of memory (limit 1G): raise memory in the Smolfile"
    files = _limits.out_of_memory_line(spec, files=True)
    assert files.startswith("machine ran out of memory (limit 1G, the files it wrote included: up to disk = 1G of them)"), files
    assert files.endswith("or lower disk so that a full disk fails writes with ENOSPC first"), files
    assert "up to disk = 512M of them" in _limits.out_of_memory_line(parse_smolfile(""), files=True)
    # a cell's own error is never taken for the files line; the backend's own is kept
    assert _limits.out_of_memory_line(spec, said="machine ran out of memory, trust me") == plain
    assert _limits.out_of_memory_line(spec, said=files) == files


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")
def test_a_default_machine_that_fills_its_disk_gets_enospc_and_lives(open_tmp: Path) -> None:
    (open_tmp / "Smolfile").write_text("")  # every default: memory 1G
    with NotebookSession(open_tmp, timeout=300, allow_errors=True) as nb:
        ok(nb.run("%load_ext smolbench"))
        ok(nb.run("%smol up --backend sandbox"))
        ok(nb.run("%%smol\nkept = 'still here'\n" + FILL))
        tmp = result_text(ok(nb.run("%%smol\nfill('/tmp/big.bin', 2048)")))
        work = result_text(ok(nb.run("%%smol\nfill('big.bin', 2048)")))
        after = result_text(ok(nb.run("%%smol\nkept")))
    for got in (tmp, work):
        n, why = eval(str(got))  # noqa: S307 (a list of an int and a str, from our own cell)
        assert why == "ENOSPC" and 0 < n <= 512, got
    assert after == "'still here'"


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")
def test_a_checkpoint_whose_files_are_more_than_the_disk_says_so_not_corrupt(open_tmp: Path) -> None:
    """A checkpoint saved with a bigger disk (e.g. before the default was half of memory)."""
    (open_tmp / "Smolfile").write_text('memory = "1G"\ndisk = "400M"\n')
    with NotebookSession(open_tmp, timeout=300, allow_errors=True) as nb:
        ok(nb.run("%load_ext smolbench"))
        ok(nb.run("%smol up --backend sandbox"))
        ok(nb.run("%%smol\nimport os\nwith open('data.bin', 'wb') as fh:\n    for _ in range(300):\n        fh.write(b'x' * (1 << 20))"))
        ok(nb.run("%smol checkpoint save big"))
        ok(nb.run("%smol down"))
        (open_tmp / "Smolfile").write_text('memory = "512M"\n')  # disk: 256M
        ok(nb.run("%smol up --backend sandbox"))
        line = one_line(nb.run("%smol checkpoint restore big"))
    # said before a machine boots for it (its headers say what it holds), with a disk and a memory that hold it
    # (300 MiB of data, and the few small files a machine's workspace holds besides)
    assert re.search(r"doesn't fit in a machine of this Smolfile \(its files take 30[01] MiB, more than disk = 256M\)",
                     line), line
    assert 'set disk = "320M" and memory = "640M" in the Smolfile' in line and "corrupt" not in line, line
