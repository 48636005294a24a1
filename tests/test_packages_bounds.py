"""What a Smolfile's packages may cost the host: its pip's memory and disk are bounded.

Each test is the audit's attack scaled down, with the cap lowered to match (the defaults, 2 GB
of memory and 8 GB of disk, would need the real bombs): a wheel of a module of ``x=1`` lines
(pip byte-compiled it: 8 MB of them cost the host 3.4 GB), a wheel of zeros (1 GiB of them was
kept in the cache), by path and from an index, and a requirement whose URL holds ``%00``.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from test_packages import _file_index, _wheel, cache  # noqa: F401 - the fixture

from smolbench import packages
from smolbench.errors import SmolbenchError, SmolfileError
from smolbench.smolfile import parse_smolfile

ROOT = Path(__file__).resolve().parent.parent


def _big_wheel(folder: Path, name: str, member: str, chunk: bytes, mib: int) -> Path:
    """A wheel of ``name`` 1.0 whose ``member`` is ``chunk`` repeated to ``mib`` MiB (streamed, never held)."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel, info = folder / f"{name}-1.0-py3-none-any.whl", f"{name}-1.0.dist-info"
    block = chunk * ((1 << 20) // len(chunk))
    digest = hashlib.sha256()
    for _ in range(mib):
        digest.update(block)
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
    tag = "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    sha = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
    record = f"{name}/{member},sha256={sha},{len(block) * mib}\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        with z.open(f"{name}/{member}", "w", force_zip64=True) as f:
            for _ in range(mib):
                f.write(block)
        z.writestr(f"{info}/METADATA", meta)
        z.writestr(f"{info}/WHEEL", tag)
        z.writestr(f"{info}/RECORD", record)
    return wheel


def _kept(cache: Path) -> list[str]:  # noqa: F811
    """The cache's entries and leftovers (its lock files aside)."""
    root = cache / "packages"
    return sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) if root.is_dir() else []


def test_a_module_made_to_exhaust_memory_when_compiled_is_refused_within_the_cap(
        cache: Path, tmp_path: Path) -> None:  # noqa: F811
    """The attack: a 2 KB wheel of 1 MiB of ``x=1`` lines, which pip byte-compiled on the host for
    ~430 MB (8 MiB of them: 3.4 GB). With the cap at 200 MB, the install is refused in one line
    naming the package and the fix, the host's children never went past the cap, nothing is kept.
    Run in a child Python of its own, so its peak is this install's alone."""
    wheel = _big_wheel(tmp_path / "w", "pybomb", "big.py", b"x=1\n", 1)
    assert wheel.stat().st_size < 4096
    code = ("import resource, sys\nfrom smolbench import packages\n"
            f"try:\n    packages.ensure(('pybomb @ {wheel.as_uri()}',), packages.host_python())\n"
            "    print('installed')\nexcept Exception as exc:\n    print(type(exc).__name__, exc)\n"
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SMOLBENCH_PIP_MEMORY": "200M"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    said, peak = done.stdout.splitlines()[0], int(done.stdout.splitlines()[-1])
    assert said.startswith("SmolbenchError the Smolfile's package 'pybomb' was refused: compiling its module "
                           "pybomb/big.py to bytecode needs more than 200 MB"), done.stdout + done.stderr
    assert "SMOLBENCH_PIP_MEMORY=" in said and len(done.stdout.splitlines()) == 2
    assert peak < 200, peak  # MiB of resident memory; uncapped, its compile took ~430
    assert _kept(cache) == []


def test_packages_still_come_with_their_bytecode_made_on_the_host(cache: Path, tmp_path: Path) -> None:  # noqa: F811
    """pip compiles nothing now; the capped compile after it makes the same .pyc files, so a
    machine importing from its read-only mount never compiles them again, each time."""
    assert "--no-compile" in packages.pip_command(("x",), packages.host_python(), Path("/x"))
    wheel = _wheel(tmp_path / "w", "smolbench_probe_pkg", "X = 1\n")
    got = packages.ensure((f"smolbench_probe_pkg @ {wheel.as_uri()}",), packages.host_python())
    try:
        tag = f"cpython-{sys.version_info[0]}{sys.version_info[1]}"
        assert (got.lib / "smolbench_probe_pkg" / "__pycache__" / f"__init__.{tag}.pyc").is_file()
        assert not (got.lib.parent / packages.PIP_TMP).exists()
    finally:
        got.close()


def test_a_wheel_of_zeros_over_the_limit_is_refused_before_pip_unpacks_it(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The attack: a wheel of a few KB that unpacks to 64 MiB of zeros (the audit's: 1 MB of wheel,
    1.1 GB kept in the cache). With the limit at 16 MB its zip directory says so before pip runs:
    one line naming the entry and the fix, nothing kept."""
    monkeypatch.setenv("SMOLBENCH_PACKAGES_LIMIT", "16M")
    wheel = _big_wheel(tmp_path / "w", "bomb", "big.bin", b"\0", 64)
    entry = f"bomb @ {wheel.as_uri()}"
    with pytest.raises(SmolbenchError) as err:
        packages.ensure((entry,), packages.host_python())
    said = str(err.value)
    assert said.startswith("the Smolfile's packages would take more than 16 MB on the host (Smolfile packages entry "
                           f"{entry!r} unpacks to 67 MB"), said
    assert "SMOLBENCH_PACKAGES_LIMIT=" in said and "\n" not in said
    assert _kept(cache) == []


def test_a_wheel_of_zeros_from_an_index_is_stopped_while_pip_writes_it(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The same wheel named from an index: pip downloads it, so no directory is read before; the
    bound holds while pip writes (no file past the limit, its temporary files inside the install's
    folder, measured) and nothing is kept."""
    wheel = _big_wheel(tmp_path / "w", "bomb", "big.bin", b"\0", 64)
    monkeypatch.setenv("PIP_INDEX_URL", _file_index(tmp_path / "index", {"bomb": wheel}))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # only that index
    monkeypatch.setenv("SMOLBENCH_PACKAGES_LIMIT", "16M")
    with pytest.raises(SmolbenchError) as err:
        packages.ensure(("bomb==1.0",), packages.host_python())
    said = str(err.value)
    assert said.startswith("the Smolfile's packages would take more than 16 MB on the host"), said
    assert "SMOLBENCH_PACKAGES_LIMIT=" in said and "\n" not in said
    assert _kept(cache) == []


def test_a_nul_escaped_in_a_wheels_url_is_refused_at_parse_in_one_line(cache: Path) -> None:  # noqa: F811
    """``file:///tmp/a%00b.whl`` passed the check and ended the up in a bare ``ValueError: embedded
    null byte``; now the Smolfile says which entry, and so does the last check before pip."""
    entry = "x @ file:///tmp/a%00b.whl"
    with pytest.raises(SmolfileError) as bad:
        parse_smolfile(f'packages = ["{entry}"]\n')
    said = str(bad.value)
    assert f"'packages' entry {entry!r} holds an escaped control character in its URL" in said and "\n" not in said
    with pytest.raises(SmolbenchError) as err:
        packages.ensure((entry,), packages.host_python())
    assert str(err.value).startswith(f"Smolfile packages entry {entry!r} holds an escaped control character")
