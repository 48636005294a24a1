"""What a Smolfile's packages may cost the host, second audit: each test is its attack scaled down.

A wheel whose module makes its compile print without end (the host kept all of it), one of
folders and empty files (only files' sizes were counted), one ~1,100 folders deep (every walk and
removal recursed), file names carrying terminal escapes into the refusal line, and a watch that
waited ten times its last walk between two measures.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_packages import cache  # noqa: F401 - the fixture

from smolbench import _pipbounds, packages
from smolbench.errors import SmolbenchError

ROOT = Path(__file__).resolve().parent.parent


def _wheel(folder: Path, name: str, files: dict[str, str]) -> Path:
    """A wheel of ``name`` 1.0 holding ``files`` (path: text) beside its metadata."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel, info = folder / f"{name}-1.0-py3-none-any.whl", f"{name}-1.0.dist-info"
    files = {f"{name}/__init__.py": "", **files, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for n, t in files.items():
            z.writestr(n, t)
    return wheel


def _kept(cache: Path) -> list[str]:  # noqa: F811
    root = cache / "packages"
    return sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) if root.is_dir() else []


def _plain(text: str) -> bool:
    return text.isprintable() and "\x1b" not in text


def test_a_module_whose_compile_prints_without_end_costs_the_host_a_fixed_tail(tmp_path: Path) -> None:
    """The attack: a wheel of one line ``y = x is 1 or ...`` (1,500 of them; the audit's 4,000 took
    the host from 31 to 490 MiB): its compile printed a SyntaxWarning quadratic in the line, all of
    it kept by the host. Now the compile's warnings are off and any child's output is read through a
    fixed tail. Run in a child Python of its own, its allocations traced."""
    src = "y = " + " or ".join(["x is 1"] * 1500) + "\n"
    wheel = _wheel(tmp_path / "w", "warnbomb", {"warnbomb/m.py": src})
    code = ("import tracemalloc\nfrom smolbench import packages\ntracemalloc.start()\n"
            f"packages.ensure(('warnbomb @ {wheel.as_uri()}',), packages.host_python()).close()\n"
            "print(tracemalloc.get_traced_memory()[1] >> 20)\n")  # the peak of what the host's Python held
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SMOLBENCH_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    grew = int(done.stdout.splitlines()[-1])
    assert grew < 8, grew  # MiB; the whole output kept (22 MB of it): 65


def test_folders_and_empty_files_count_on_the_disk_and_too_many_are_refused(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The attack: a few KB of wheel made of folders and empty files (the audit's 74 KB became
    74 MB and 18,094 inodes, counted as 0 bytes and kept). With the limit at 1 MB, 400 folders
    are over it; and with the entry cap lowered to 300, 400 empty files in one folder are over
    that. Both refused in one line, nothing kept."""
    monkeypatch.setenv("SMOLBENCH_PACKAGES_LIMIT", "1M")
    folders = _wheel(tmp_path / "w1", "folders", {f"folders/d{i}/x.py": "" for i in range(400)})
    with pytest.raises(SmolbenchError) as err:
        packages.ensure((f"folders @ {folders.as_uri()}",), packages.host_python())
    said = str(err.value)
    assert said.startswith("the Smolfile's packages would take more than 1.0 MB on the host"), said
    assert _kept(cache) == []
    monkeypatch.setenv("SMOLBENCH_PACKAGES_LIMIT", "1G")
    monkeypatch.setattr(_pipbounds, "ENTRIES_MOST", 300, raising=False)
    inodes = _wheel(tmp_path / "w2", "inodes", {f"inodes/f{i}.txt": "" for i in range(400)})
    with pytest.raises(SmolbenchError) as err:
        packages.ensure((f"inodes @ {inodes.as_uri()}",), packages.host_python())
    said = str(err.value)
    assert said.startswith("the Smolfile's packages would make more than 300 files and folders on the host"), said
    assert _kept(cache) == []


def test_a_tree_too_deep_to_walk_is_refused_and_a_deep_leftover_is_pruned(
        cache: Path, tmp_path: Path) -> None:  # noqa: F811
    """The attack: a wheel's path 1,800 folders deep crashed the measure, the removal of the
    install's folder (a ``.tmp`` left each time) and ``prune`` (RecursionError) for good. Now a
    tree deeper than DEPTH_MOST (200; this one 300) is refused in one line with nothing kept, one
    of 1,100 is measured without recursion, and a deep folder an older version left is pruned."""
    deep = _wheel(tmp_path / "w", "deep", {"deep/" + "a/" * 300 + "x.py": ""})
    with pytest.raises(SmolbenchError) as err:
        packages.ensure((f"deep @ {deep.as_uri()}",), packages.host_python())
    said = str(err.value)
    assert said.startswith(f"the Smolfile's packages would make folders more than {_pipbounds.DEPTH_MOST} deep"), said
    assert _kept(cache) == []
    left = cache / "packages" / ".0123456789abcdef01234567.tmp-old"
    left.mkdir()
    fd = os.open(left, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(1100):  # (os.makedirs recurses too)
        os.mkdir("a", dir_fd=fd)
        fd, up = os.open("a", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd), fd
        os.close(up)
    os.close(fd)
    assert _pipbounds.tree_size(left)[0] > 0  # stopped at DEPTH_MOST, no RecursionError
    removed, _ = packages.prune(0)
    assert [p.name for p, _ in removed] == [left.name] and _kept(cache) == []


def test_a_wheels_file_names_reach_a_refusal_escaped_on_one_line(tmp_path: Path) -> None:
    """The attack: a file named with terminal escapes and a line end (retitle the terminal, clear
    it, forge a second line) was put raw into the disk and compile refusals."""
    name = "\x1b]0;PWNED\x07\x1b[2Jinnocent\nsecond line.bin"
    (tmp_path / "bomb").mkdir()
    (tmp_path / "bomb" / name).write_bytes(b"\1" * 65536)
    said = _pipbounds.DiskWatch(tmp_path, (), 1000).check(final=True) or ""
    assert "PWNED" in said and _plain(said), said
    out = f"{_pipbounds.COMPILE_MEMORY} evil/{name}\n"
    said = _pipbounds.compile_refusal(out, 1 << 20, tmp_path)
    assert "PWNED" in said and _plain(said), said


def test_the_watch_measures_again_within_a_bound_however_long_its_last_walk_took(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The suspicion: the watch waited ten times its last walk (a 100 s walk: 1,000 s unwatched
    while pip wrote). A fake clock and walk: after a walk of 100 s, it measures again within
    WAIT_MOST (2 s) of that walk's end, not 1,000 s later (no real time is measured here)."""
    clock, walks = [0.0], []

    def walk(root: Path, skip: tuple[str, ...] = ()) -> object:
        walks.append(clock[0])
        clock[0] += 100.0
        measure = getattr(_pipbounds, "Measure", None)
        return measure(0, 0, "", "") if measure else (0, "")

    monkeypatch.setattr(_pipbounds, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(_pipbounds, "tree_size", walk)
    watch = _pipbounds.DiskWatch(tmp_path, (), 1 << 30)
    assert watch.check() is None and len(walks) == 1
    clock[0] += 2.5
    assert watch.check() is None and len(walks) == 2, walks
