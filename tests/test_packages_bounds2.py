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

