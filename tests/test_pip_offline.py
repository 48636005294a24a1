"""``%pip`` in a ``%%smol`` cell: like IPython's, no ``Out`` value and no raise; in a machine
whose network policy is off, one line says why pip can't reach the package index and how to
allow it (instead of five silent retries of a name lookup), and nothing claims the network is
off when it isn't. Through a real kernel on the sandbox backend (pip of the kernel's own venv)."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from nbhelpers import NotebookSession, error_text, ok, result_text, stream_text

from smolbench.guest import pipsite

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
needs_pip = pytest.mark.skipif(shutil.which("pip", path=str(Path(sys.executable).parent)) is None,
                               reason="the kernel's venv has no pip")
NOTE = "smolbench: this machine has no network (its network policy is off), so pip can't reach the package index"


def test_a_pip_line_is_a_statement_with_the_same_line_numbers() -> None:
    code = "x = 1\n%pip install tomli-w  # a comment\nif x:\n    !pip --version\n"
    lines = pipsite.transform(code).split("\n")
    assert len(lines) == 5 and lines[0] == "x = 1"
    assert lines[1] == "smolbench_guest._pip_line(*['install', 'tomli-w'])"
    assert lines[3] == "    smolbench_guest._pip_line(*['--version'])"


@pytest.mark.parametrize(("policy", "args", "noted"), [
    ("off (no network)", ["install", "tomli-w"], True),
    ("off (no network)", ["-q", "download", "tomli-w"], True),
    ("off (no network)", ["install", "--no-index", "--find-links", "wheels", "tomli-w"], False),  # no index asked
    ("off (no network)", ["uninstall", "-y", "tomli-w"], False),
    ("off (no network)", ["--version"], False),
    ("on (the internet; not this host or private networks)", ["install", "tomli-w"], False),
    ("allow-list: pypi.org, files.pythonhosted.org", ["install", "tomli-w"], False),
    ("", ["install", "tomli-w"], False),  # the process backend: no policy known, none claimed
])
def test_the_offline_note_only_where_the_policy_is_off_and_pip_asked_an_index(policy: str, args: list[str],
                                                                                noted: bool) -> None:
    note = pipsite.offline_note(args, policy)
    assert bool(note) is noted, note
    if noted:
        assert note.startswith(NOTE) and "\n" not in note.strip(), note
        assert "`%smol up --allow pypi.org,files.pythonhosted.org`" in note and "allow_hosts" in note, note
        assert "`packages`" in note, note


@contextmanager
def _session(folder: Path, up: str, smolfile: str = "") -> Iterator[NotebookSession]:
    (folder / "Smolfile").write_text(smolfile)
    with NotebookSession(folder, timeout=300, allow_errors=True) as nb:
        ok(nb.run("%load_ext smolbench"))
        ok(nb.run(f"%smol up --backend sandbox {up}"))
        yield nb


@needs_bwrap
@needs_pip
def test_pip_with_the_network_off_says_so_in_one_line_without_retries_and_no_out(open_tmp: Path) -> None:
    with _session(open_tmp, "") as nb:
        failed = ok(nb.run("%%smol\n%pip install tomli-w"))  # IPython's %pip doesn't raise either
        version = ok(nb.run("%%smol\n%pip --version"))
        bang = ok(nb.run("%%smol\nx = 1\n!pip --version"))
    said = stream_text(failed) + stream_text(failed, "stderr")
    assert NOTE in said and said.count("smolbench:") == 1, said
    assert "Retrying" not in said, said  # no retries of a lookup that can't succeed here
    assert "pip exited with status 1" in said, said
    for cell in (failed, version, bang):
        assert result_text(cell) is None, cell.outputs  # no Out[n]: pip's exit code is not the cell's value
    assert stream_text(version).startswith("pip ") and NOTE not in stream_text(version)


@needs_bwrap
@needs_pip
def test_pip_with_the_index_allowed_never_says_the_network_is_off(open_tmp: Path) -> None:
    with _session(open_tmp, "--allow pypi.org,files.pythonhosted.org") as nb:
        cell = ok(nb.run("%%smol\n%pip install --no-index no-such-package-here"))
    said = stream_text(cell) + stream_text(cell, "stderr")
    assert "pip exited with status 1" in said and "no network" not in said and "smolbench:" not in said, said
    assert result_text(cell) is None, error_text(cell)


# A wheel of 96 MiB of zeros (a few hundred KiB zipped), made in the machine: pip unpacks it on the machine's disk
BIG_WHEEL = """import zipfile
files = {"big/__init__.py": "", "big/zeros.bin": bytes(96 << 20),
         "big-1.0.dist-info/METADATA": "Metadata-Version: 2.1\\nName: big\\nVersion: 1.0\\n",
         "big-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\\nGenerator: hand\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"}
files["big-1.0.dist-info/RECORD"] = "".join(name + ",,\\n" for name in files) + "big-1.0.dist-info/RECORD,,\\n"
with zipfile.ZipFile("big-1.0-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as z:
    for name, data in files.items():
        z.writestr(name, data)
del files, z"""


@needs_bwrap
@needs_pip
def test_pip_that_fills_the_machine_s_disk_names_disk_and_packages(open_tmp: Path) -> None:
    """`disk = "64M"` and `%pip install scipy`: pip's `[Errno 28] No space left on device`, and nothing else."""
    with _session(open_tmp, "", 'memory = "768M"\ndisk = "64M"\n') as nb:
        ok(nb.run("%%smol\n" + BIG_WHEEL))
        cell = ok(nb.run("%%smol\n%pip install -q --no-index ./big-1.0-py3-none-any.whl"))
    said = stream_text(cell) + stream_text(cell, "stderr")
    assert "No space left on device" in said and "pip exited with status 1" in said, said
    assert said.rstrip().endswith(
        "smolbench: pip filled this machine's disk (the Smolfile's `disk`, 64 MiB here): raise `disk` in the "
        "Smolfile, or list the package in the Smolfile's `packages` (installed on the host and mounted read-only: "
        "not on the machine's disk)"), said
    assert NOTE not in said  # not the network's fault
