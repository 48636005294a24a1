"""A Smolfile's ``packages``: pip on the host, once per list and guest Python, mounted read-only;
and ``pip`` / ``%pip`` inside a machine installing where that machine imports from.

The kernel tests run on a Python in a private (0700) folder (``private_python`` of
tests/test_fresh_machine.py), as on a fresh machine as root, and again as smolci (.ci/run).
``tomli-w`` stands for a real package: small, pure Python, and nowhere on this host, so an
import that works shows where it came from. The one test that leaves the host is
``test_pip_in_a_machine_fetches_a_package_by_name``: its machine may reach the package
index's hosts only (the names pip uses here: ``pip config list`` shows the default index,
pypi.org, whose files are on files.pythonhosted.org).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest
from nbhelpers import NotebookSession, error_text, result_text, stream_text
from test_fresh_machine import _image_cache, private_python  # noqa: F401 - the fixture

from smolbench import packages
from smolbench.errors import SmolbenchError, SmolfileError
from smolbench.smolfile import parse_smolfile
from smolbench.spec import MachineSpec

PKG = "tomli-w==1.2.0"
INDEX_HOSTS = "pypi.org,files.pythonhosted.org"
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The smolbench cache in a folder of this test's own (never ~/.cache)."""
    path = tmp_path / "cache"
    monkeypatch.setenv("SMOLBENCH_CACHE", str(path))
    return path


def test_the_packages_key_takes_pip_requirements_and_says_what_is_wrong_in_one_line() -> None:
    spec = parse_smolfile(f'packages = ["{PKG}", "numpy>=1.24; python_version >= \'3.9\'", "{PKG}"]\n')
    assert spec.packages == (PKG, "numpy>=1.24; python_version >= '3.9'")
    assert MachineSpec().baseline() == parse_smolfile("").baseline()  # no key: baselines as before
    assert spec.baseline() != parse_smolfile(f'packages = ["{PKG}"]\n').baseline()
    for text, said in [
        ('packages = "numpy"', "Smolfile line 1: 'packages' must be an array of pip requirement strings like"),
        ("packages = [3]", "Smolfile line 1: 'packages' entry 1 must be a requirement string"),
        ('packages = [\n  "numpy",\n  "numpy>>1",\n]', "Smolfile line 3: 'packages' entry 'numpy>>1' is not a requirement ("),
        ('packages = ["-e ."]', "Smolfile line 1: 'packages' entry '-e .' is a pip option, not a requirement"),
        ('packages = [""]', "Smolfile line 1: 'packages' entry '' is empty; remove it"),
        ('pacakges = ["numpy"]', "did you mean 'packages'?"),
    ]:
        with pytest.raises(SmolfileError) as err:
            parse_smolfile(text)
        assert said in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_an_install_is_made_once_then_reused_even_by_kernels_asking_at_once(cache: Path) -> None:
    guest = packages.host_python()
    results: list[packages.Installed] = []
    threads = [threading.Thread(target=lambda: results.append(packages.ensure((PKG,), guest))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.cached for r in results) == [False, True, True]  # one pip run; the others waited, then reused it
    assert len({r.lib for r in results}) == 1
    lib = results[0].lib
    assert (lib / "tomli_w" / "__init__.py").is_file() and results[0].count == 1
    assert oct(lib.stat().st_mode & 0o777) == "0o755"
    assert [p.name for p in (cache / "packages").iterdir() if ".tmp-" in p.name] == []  # nothing half made
    again = packages.ensure((PKG,), guest)
    assert again.cached and again.lib == lib and again.line((PKG,)).startswith("packages: cached (1 requirement")
    # the key covers the list and the guest's Python: another of either is another entry
    here = packages.pip_sources()
    assert packages.key((PKG, "six"), guest, here) != packages.key((PKG,), guest, here)
    assert packages.key((PKG,), packages.version_python("3.12"), here) != packages.key((PKG,), guest, here)


def test_pip_on_the_host_installs_wheels_only_so_no_setup_py_runs(cache: Path, tmp_path: Path) -> None:
    """The attack: a requirement whose only form is an sdist, its setup.py writing a file when run.
    pip is asked for wheels only, so the install fails in one line and the file never appears."""
    marker = tmp_path / "setup-py-ran"
    src = tmp_path / "evil-0.1"
    src.mkdir()
    (src / "setup.py").write_text(f"open({str(marker)!r}, 'w').close()\nfrom setuptools import setup\nsetup(name='evil', version='0.1')\n")
    sdist = tmp_path / "evil-0.1.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(src, arcname="evil-0.1")
    # pip builds a URL's source even with --only-binary=:all: (seen with the check left out: the
    # marker appeared), so such a requirement never reaches pip: the Smolfile refuses it, in one line
    with pytest.raises(SmolfileError) as bad:
        parse_smolfile(f'packages = ["evil @ file://{sdist}"]\n')
    assert "points at a source archive or folder, which pip would build on the host" in str(bad.value)
    with pytest.raises(SmolbenchError) as err:  # and so does the last check before pip
        packages.ensure((f"evil @ file://{sdist}",), packages.host_python())
    assert "\n" not in str(err.value)
    # a name whose index has only an sdist: --only-binary, so pip finds nothing to install
    index = tmp_path / "index" / "evil"
    index.mkdir(parents=True)
    shutil.copy(sdist, index / sdist.name)
    (index / "index.html").write_text(f'<a href="{sdist.name}">{sdist.name}</a>')
    os.environ["PIP_INDEX_URL"] = f"file://{tmp_path / 'index'}"
    try:
        with pytest.raises(SmolbenchError) as err:
            packages.ensure(("evil==0.1",), packages.host_python())
    finally:
        del os.environ["PIP_INDEX_URL"]
    assert str(err.value).startswith("pip could not install the Smolfile's packages: ") and "\n" not in str(err.value)
    assert "wheels only: no setup.py runs on the host" in str(err.value), str(err.value)
    assert not marker.exists()
    assert [p.name for p in (cache / "packages").iterdir() if not p.name.endswith(".lock")] == []


def test_a_package_the_index_lacks_is_one_plain_line_that_says_check_the_name(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a kernel pip colours its lines (FORCE_COLOR): the error had pip's escapes in it, and
    said "a package without a wheel" of a name no index has."""
    (tmp_path / "index").mkdir()
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("PIP_INDEX_URL", f"file://{tmp_path / 'index'}")
    guest = packages.host_python()
    with pytest.raises(SmolbenchError) as err:
        packages.ensure(("thispkgdoesnotexist-zzz==1.0",), guest)
    assert str(err.value) == (
        "pip could not install the Smolfile's packages: ERROR: No matching distribution found for "
        "thispkgdoesnotexist-zzz==1.0; there is no such package or version, or none with a wheel for this Python "
        f"(cp{guest.major}{guest.minor}; wheels only: no setup.py runs on the host): check the name and version "
        "on pypi.org")


def _carrier(folder: Path, needs: str) -> Path:
    """A wheel of a harmless package whose metadata requires ``needs``."""
    return _wheel(folder, "carrier", "", requires=needs)


def test_a_wheel_that_names_a_source_archive_by_url_gets_nothing_built_on_the_host(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Round 4's own audit: --only-binary=:all: does not hold for a URL a wheel's own metadata
    names, so pip built it and its setup.py ran on the host as the kernel's user (from a wheel
    given by URL, or a name an index the user added answers with such a wheel)."""
    marker = tmp_path / "setup-py-ran"
    src = tmp_path / "evil-0.1"
    src.mkdir()
    (src / "setup.py").write_text(f"open({str(marker)!r}, 'w').close()\nfrom setuptools import setup\n"
                                  "setup(name='evil', version='0.1')\n")
    sdist = tmp_path / "evil-0.1.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(src, arcname="evil-0.1")
    wheel = _carrier(tmp_path, f"evil @ file://{sdist}")
    requirement = f"carrier @ file://{wheel}"
    assert parse_smolfile(f'packages = ["{requirement}"]\n').packages == (requirement,)  # a wheel: allowed
    monkeypatch.setenv("PIP_CACHE_DIR", str(tmp_path / "pip-cache"))  # the weakened run's build stays here
    monkeypatch.chdir(tmp_path)  # the kernel's folder, where a pip/ of its own would be imported first
    (tmp_path / "pip").mkdir()
    (tmp_path / "pip" / "__init__.py").write_text(f"open({str(marker) + '-pip'!r}, 'w').close()\n")
    with pytest.raises(SmolbenchError) as refused:
        packages.ensure((requirement,), packages.host_python())
    line = str(refused.value)
    assert "asked pip to build a source archive (a dependency it names by URL)" in line and "\n" not in line, line
    assert not marker.exists() and not Path(str(marker) + "-pip").exists()
    # weakened: pip without the guard builds it, and the archive's code runs here
    monkeypatch.setattr(packages, "PIP_GUARD", "import runpy, sys\nsys.argv[0] = 'pip'\n"
                                               "runpy.run_module('pip', run_name='__main__', alter_sys=True)\n")
    packages.ensure((requirement,), packages.host_python())
    assert marker.exists()


def test_an_images_python_is_read_from_its_files(tmp_path: Path) -> None:
    root = tmp_path / "rootfs"
    (root / "usr" / "lib" / "python3.11").mkdir(parents=True)
    (root / "usr" / "lib" / "python3.11" / "os.py").write_text("")
    (root / "usr" / "lib" / "python3.9").mkdir()  # a leftover folder without a stdlib in it
    libc = root / "usr" / "lib" / "x86_64-linux-gnu" / "libc.so.6"
    libc.parent.mkdir(parents=True)
    libc.write_bytes(b"\x7fELF...GLIBC_2.17\0GLIBC_2.36\0GLIBC_PRIVATE\0")
    guest = packages.rootfs_python(root)
    assert (guest.major, guest.minor, guest.glibc, guest.native) == (3, 11, (2, 36), False)
    args = guest.pip_target_args()
    assert args[:2] == ["--python-version", "3.11"] and "manylinux_2_36_x86_64" in args or guest.machine != "x86_64"
    with pytest.raises(SmolbenchError, match="can't tell which Python the image"):
        packages.rootfs_python(tmp_path)


def _smolfile(work: Path, text: str) -> None:
    (work / "Smolfile").write_text(text)


@needs_bwrap
def test_smolfile_packages_import_with_the_network_off_read_only_in_every_branch(
        private_python: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    top = private_python
    monkeypatch.setenv("JUPYTER_PATH", str(top / "share" / "jupyter"))
    monkeypatch.setenv("SMOLBENCH_CACHE", str(top / "cache"))  # inside the 0700 folder: staged for a root kernel
    _smolfile(top / "work", f'packages = ["{PKG}"]\n')
    with NotebookSession(top / "work", timeout=300, allow_errors=True) as nb:
        nb.run("%load_ext smolbench")
        up = nb.run("%smol up --backend sandbox")
        said = stream_text(up)
        assert not error_text(up), error_text(up)
        assert "network off" in said and "smolbench: packages: installed in " in said, said
        cell = nb.run("%%smol\nimport tomli_w\ntomli_w.dumps({'a': 1}), tomli_w.__file__")
        assert result_text(cell).startswith("('a = 1\\n', '/run/smolbench-packages/tomli_w/"), error_text(cell)
        # read-only: a cell can't change what every branch (and every later machine) imports
        cell = nb.run("%%smol\nopen('/run/smolbench-packages/tomli_w/__init__.py', 'a')")
        assert "Error: [Errno" in error_text(cell), error_text(cell)  # EROFS, or EACCES first for a root kernel's files
        cell = nb.run("%%smol\n[ln.split()[5].split(',')[0] for ln in open('/proc/self/mountinfo') "
                      "if ln.split()[4] == '/run/smolbench-packages']")
        assert result_text(cell) == "['ro']", result_text(cell) + error_text(cell)
        nb.run("%%smol fork 2 --quiet --out res\nimport tomli_w\nreward = float(len(tomli_w.dumps({'k': SEED})))")
        assert result_text(nb.run("sorted(res.rewards.values())")) == "[6.0, 6.0]"
        nb.run("%smol down")
        up = nb.run("%smol up --backend sandbox")
        assert "smolbench: packages: cached (1 requirement" in stream_text(up), stream_text(up)
        nb.run("%smol down")


@needs_bwrap
def test_packages_on_an_image_with_its_own_python_and_its_pip(
        private_python: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """debian:bookworm's Python 3.11 is read from its files; pip installs for it on the host; the image
    carries pip, and `pip install` there goes to the machine's folder, not to Debian's refusal."""
    top = private_python
    cache = _image_cache(top)
    if cache is None:
        pytest.skip("building debian:bookworm needs root and debootstrap")
    monkeypatch.setenv("JUPYTER_PATH", str(top / "share" / "jupyter"))
    monkeypatch.setenv("SMOLBENCH_CACHE", str(cache))
    _smolfile(top / "work", f'image = "debian:bookworm"\npackages = ["{PKG}"]\n')
    with NotebookSession(top / "work", timeout=300, allow_errors=True) as nb:
        nb.run("%load_ext smolbench")
        up = nb.run("%smol up --backend sandbox")
        assert not error_text(up), error_text(up)
        assert "smolbench: packages: installed in " in stream_text(up), stream_text(up)
        cell = nb.run("%%smol\nimport sys, tomli_w, subprocess\n"
                      "out = subprocess.run(['pip', 'install', '--no-index', 'tomli-w'], capture_output=True, text=True)\n"
                      "(sys.executable, tomli_w.__file__.split('/')[2], 'externally-managed' in out.stderr, "
                      "'No matching distribution' in out.stderr)")
        assert result_text(cell) == "('/usr/bin/python3', 'smolbench-packages', False, True)", error_text(cell)
        nb.run("%smol down")


@needs_bwrap
def test_pip_in_a_machine_fetches_a_package_by_name(private_python: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """`%pip`, `!pip` and a shell's `pip` are this machine's `python -m pip`, installing into its own
    folder on sys.path (Debian's /usr/bin/pip would answer "externally-managed-environment")."""
    top = private_python
    # a venv as people make them, with pip in it (the fixture's has none; pip is pure Python: copied in)
    import pip

    site = subprocess.run([str(top / "venv" / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    shutil.copytree(Path(pip.__file__).parent, Path(site) / "pip", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setenv("JUPYTER_PATH", str(top / "share" / "jupyter"))
    with NotebookSession(top / "work", timeout=600, allow_errors=True) as nb:
        nb.run("%load_ext smolbench")
        up = nb.run(f"%smol up --backend sandbox --allow {INDEX_HOSTS}")
        assert not error_text(up), error_text(up)
        cell = nb.run(f"%%smol\n%pip install --no-cache-dir --progress-bar off {PKG}")
        said = stream_text(cell)
        assert not error_text(cell), error_text(cell) + said
        assert "Successfully installed tomli-w-1.2.0" in said or "Successfully installed tomli_w-1.2.0" in said, said
        cell = nb.run("%%smol\nimport tomli_w, shutil, subprocess, sys\n"
                      "(tomli_w.__file__.startswith('/workspace/.packages/'), shutil.which('pip'),"
                      " subprocess.run(['pip', '--version'], capture_output=True, text=True).stdout.split(' from ')[0][:4])")
        assert result_text(cell) == "(True, '/workspace/.packages/.bin/pip', 'pip ')", error_text(cell)
        cell = nb.run("%%smol fork 2 --quiet --out res\nimport tomli_w\nreward = 1.0")  # branches inherit it
        assert result_text(nb.run("sorted(res.rewards.values())")) == "[1.0, 1.0]", error_text(cell)
        nb.run("%smol down")


def test_the_pip_command_asks_for_wheels_only_and_the_guests_tags() -> None:
    guest = packages.version_python("3.12", (2, 28))
    cmd = packages.pip_command((PKG,), guest, Path("/x"))
    assert cmd[:5] == [sys.executable, "-I", "-c", packages.PIP_GUARD, "install"] and "--only-binary=:all:" in cmd
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and cmd[-2:] == ["--", PKG]
    assert "--platform" in cmd and f"manylinux_2_28_{os.uname().machine}" in cmd
    assert "--python-version" not in packages.pip_command((PKG,), packages.host_python(), Path("/x"))
    assert subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0


def test_a_microvm_mounts_the_packages_installed_for_its_images_python(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """smol: the image's Python is known before it boots (python:3.12-slim: 3.12), pip installs for
    it on the host (wheels for cp312), and the tree is a read-only mount on the agent's sys.path."""
    from fakesmol import fake_host
    from smol import MountSpec

    from smolbench import _loop
    from smolbench.backends.base import CellRequest
    from smolbench.backends.smol import SmolBackend
    from smolbench.backends.smol_image import image_python

    assert image_python("python:3.12-slim").tag.startswith("cp312-")
    with pytest.raises(SmolbenchError, match="can't tell which Python image 'alpine:3' has before it boots"):
        image_python("alpine:3")

    async def boot(b: SmolBackend) -> tuple[dict[str, object], str]:
        ref = await b.create(MachineSpec(packages=(PKG,)), "root")
        try:
            res = await b.exec_cell(ref, CellRequest(code="import tomli_w; tomli_w.dumps({'a': 1})", cell_name="<c>"),
                                    lambda e: None)
            return ref.info, str((res.result or {}).get("text/plain"))
        finally:
            await b.close()

    fake = fake_host(monkeypatch)
    host = next(fake)
    try:
        info, text = _loop.run(boot(SmolBackend(probe=False, session="t")))
    finally:
        fake.close()
    [mount] = host.cls.create.call_args.args[0].mounts
    assert mount == MountSpec(source=mount.source, target="/opt/smolbench-packages", read_only=True)
    assert mount.source.startswith(str(cache / "packages")) and text == "'a = 1\\n'", text
    assert str(info["packages"]).startswith("packages: installed in ")
    cloud = SmolBackend(probe=False, session="t", target="cloud")
    with pytest.raises(SmolbenchError, match="can't mount: remove 'packages'"):
        _loop.run(cloud._packages(MachineSpec(packages=(PKG,))))


def test_an_up_stopped_while_pip_installs_stops_pip_and_leaves_no_half_install(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C during `%smol up` while pip installed the Smolfile's packages came back at once,
    and pip went on in its thread (for up to PIP_TIMEOUT), holding the key's lock: the kernel's
    exit waited for it, and so did the next up of that list."""
    import asyncio
    import contextlib
    import signal
    import time

    from smolbench.backends.process import ProcessBackend

    said = tmp_path / "pip.pid"
    # a pip that builds a package: a child of its own (its output to pip, not to us), which must go with it
    slow_pip = f"import os, subprocess, sys, time; kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); " \
               f"open({str(said)!r} + '.tmp', 'w').write(f'{{os.getpid()}} {{kid.pid}}'); " \
               f"os.rename({str(said)!r} + '.tmp', {str(said)!r}); time.sleep(120)"
    monkeypatch.setattr(packages, "pip_command", lambda requirements, guest, target: [sys.executable, "-c", slow_pip])
    left: list[int] = []

    async def main() -> None:
        backend = ProcessBackend(runtime_dir=str(tmp_path))
        up = asyncio.ensure_future(backend.create(MachineSpec(packages=(PKG,)), "root"))
        while not said.exists():
            await asyncio.sleep(0.01)
        pids = [int(p) for p in said.read_text().split()]
        up.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await up
        try:
            deadline = time.monotonic() + 10  # a killed process's exit: a loaded host takes a while
            while True:
                left[:] = [pid for pid in pids if not _gone(pid)]
                if not left or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)  # the thread's pip ends: asyncio.run waits for its thread
            await backend.close()

    asyncio.run(main())
    assert left == [], "pip (or its build) went on after the up was stopped"
    assert [p.name for p in (cache / "packages").iterdir() if ".tmp-" in p.name] == []  # nothing half made
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("smolbench-")] == []  # no run folder


def _gone(pid: int) -> bool:
    """True for a process that has exited (reaped, or waiting for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except OSError:
        return True


def _waits_for_the_lock() -> bool:
    """True once a thread of this process waits in packages._lock (for another kernel's install)."""
    import sys

    for frame in sys._current_frames().values():
        f = frame
        while f is not None:
            if f.f_code is packages._lock.__code__:
                return True
            f = f.f_back
    return False


def test_an_up_stopped_while_another_kernel_installs_the_same_list_stops_waiting(cache: Path) -> None:
    """A Ctrl-C while this kernel waited for another's install of the same list (its lock) came
    back only once that install was done, up to PIP_TIMEOUT later."""
    import asyncio
    import contextlib
    import fcntl
    import threading
    import time

    guest = packages.host_python()
    root = packages.packages_root()
    root.mkdir(parents=True)
    released = threading.Event()
    with open(root / f".{packages.key((PKG,), guest, packages.pip_sources())}.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the other kernel, installing
        # released 10 s on: a stop that waited for it can't be told from one that didn't by a loaded host's delays
        release = threading.Timer(10.0, lambda: (released.set(), fcntl.flock(held, fcntl.LOCK_UN)))

        async def main() -> None:
            up = asyncio.ensure_future(packages.install((PKG,), guest))
            deadline = time.monotonic() + 60
            while not _waits_for_the_lock():  # its thread waits for the other kernel's lock now
                assert time.monotonic() < deadline, "the install never waited for the lock"
                await asyncio.sleep(0.01)
            release.start()
            up.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await up

        try:
            asyncio.run(main())
            assert not released.is_set(), "the stopped install waited for the other kernel's lock"
        finally:
            release.cancel()  # not needed once the install stopped (the lock goes with the file)
            release.join()
    assert [p.name for p in root.iterdir() if ".tmp-" in p.name] == []


def _file_index(root: Path, wheels: dict[str, Path]) -> str:
    """A PEP 503 index in ``root`` serving ``wheels`` (project name: file); its URL."""
    for name, wheel in wheels.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        shutil.copy(wheel, root / name / wheel.name)
        (root / name / "index.html").write_text(f'<a href="{wheel.name}">{wheel.name}</a>')
    return f"file://{root}"


def test_the_hint_names_a_dependency_without_a_wheel_and_a_conflict_of_pins_not_a_wrong_name(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gymnasium[box2d] needs box2d-py, an sdist only: the error said to check the name on pypi.org.
    numpy==2.4.6 with numpy<2: the error was pip's last line, "ResolutionImpossible: for help visit ..."."""
    src = tmp_path / "evil-0.1"
    src.mkdir()
    (src / "setup.py").write_text("from setuptools import setup\nsetup(name='evil', version='0.1')\n")
    sdist = tmp_path / "evil-0.1.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(src, arcname="evil-0.1")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv("PIP_INDEX_URL", _file_index(tmp_path / "index", {"carrier": _carrier(wheels, "evil==0.1"),
                                                                         "evil": sdist}))
    guest = packages.host_python()
    with pytest.raises(SmolbenchError) as err:
        packages.ensure(("carrier==1.0",), guest)
    said = str(err.value)
    assert "\n" not in said and "check the name" not in said, said
    assert f"evil==0.1, which carrier needs, has no wheel for this Python (cp{guest.major}{guest.minor}" in said, said
    assert "smolbench installs wheels only, as building from source would run the package's own setup code" in said
    with pytest.raises(SmolbenchError) as err:
        packages.ensure(("carrier==1.0", "carrier<1"), guest)
    said = str(err.value)
    assert said == ("pip could not install the Smolfile's packages: ERROR: Cannot install carrier<1 and carrier==1.0 "
                    "because these package versions have conflicting dependencies.: keep one pin per package, or "
                    "loosen one so both can hold"), said


def test_an_index_the_host_cannot_reach_is_said_to_be_the_network_not_the_name(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy that refuses (nothing leaves the host): the error said there was no such package."""
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("PIP_INDEX_URL", "https://pypi.org/simple")
    monkeypatch.setenv("PIP_RETRIES", "1")  # one "Retrying ... NewConnectionError" line, not five
    with pytest.raises(SmolbenchError) as err:
        packages.ensure(("cowsay==6.1",), packages.host_python())
    said = str(err.value)
    assert "\n" not in said and "no such package" not in said and "check the name" not in said, said
    assert "the host could not reach the package index" in said and "HTTPS_PROXY" in said, said


def test_a_full_disk_on_the_host_says_where_to_free_space() -> None:
    tail = ["ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device"]
    said = packages.pip_failure(tail, ("scipy",), packages.host_python())
    assert "the host's disk is full" in said and str(packages.packages_root()) in said and "\n" not in said, said


def _wheel(folder: Path, name: str, text: str, requires: str = "") -> Path:
    """A wheel of a one-module package ``name`` 1.0 whose module is ``text`` (requiring ``requires``)."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-1.0-py3-none-any.whl"
    needs = f"Requires-Dist: {requires}\n" if requires else ""
    files = {f"{name}/__init__.py": text,
             f"{name}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n{needs}",
             f"{name}-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{name}-1.0.dist-info/RECORD"] = "".join(f"{n},,\n" for n in files) + f"{name}-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as z:
        for n, t in files.items():
            z.writestr(n, t)
    return wheel


def test_the_same_requirements_from_another_index_are_another_install(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A private mirror's patched build, then back to the public index: the key left out where pip
    looked, so the second install was the mirror's, reused. A pip.conf is a source as a variable is."""
    name = "smolbench-probe-pkg"
    mirror = _file_index(tmp_path / "mirror", {name: _wheel(tmp_path / "a", "smolbench_probe_pkg", "WHO = 'mirror'\n")})
    public = _file_index(tmp_path / "public", {name: _wheel(tmp_path / "b", "smolbench_probe_pkg", "WHO = 'public'\n")})
    guest, reqs = packages.host_python(), (f"{name}==1.0",)

    def who(installed: packages.Installed) -> str:
        return (installed.lib / "smolbench_probe_pkg" / "__init__.py").read_text().strip()

    monkeypatch.setenv("PIP_INDEX_URL", mirror)
    first = packages.ensure(reqs, guest)
    assert who(first) == "WHO = 'mirror'" and not first.cached
    assert packages.ensure(reqs, guest).cached  # the same sources: reused
    monkeypatch.setenv("PIP_INDEX_URL", public)
    second = packages.ensure(reqs, guest)
    assert who(second) == "WHO = 'public'" and not second.cached, who(second)
    monkeypatch.delenv("PIP_INDEX_URL")
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nindex-url = {mirror}\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    third = packages.ensure(reqs, guest)
    assert who(third) == "WHO = 'mirror'", who(third)
    conf.write_text(f"[install]\nindex-url = {public}\n")
    assert who(packages.ensure(reqs, guest)) == "WHO = 'public'"


def test_pips_configuration_is_read_again_only_when_a_variable_or_a_file_of_it_changed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pip config list`` takes ~0.2 s, and every machine of an up asks."""
    calls: list[str] = []
    real = packages._pip_config
    monkeypatch.setattr(packages, "_pip_config", lambda action: calls.append(action) or real(action))
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nindex-url = https://one.example/simple\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    first = packages.pip_sources()
    assert "global.index-url=https://one.example/simple" in first and calls == ["debug", "list"]
    assert packages.pip_sources() == first and len(calls) == 2  # nothing changed: not asked again
    conf.write_text("[global]\nindex-url = https://second.example/simple\n")
    assert "global.index-url=https://second.example/simple" in packages.pip_sources() and len(calls) == 4
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    assert ":env:.no-index=1" in packages.pip_sources() and len(calls) == 6


def test_a_token_in_an_index_url_is_in_no_key_file_name_or_line(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The key covers the index, not its credentials: another token is the same index, and the
    token is in no file name, packages.json or line of the install."""
    guest = packages.host_python()
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "https://alice:s3cret-token@mirror.invalid/simple")
    alice = packages.pip_sources()
    assert not any("s3cret" in s for s in alice) and ":env:.extra-index-url=https://mirror.invalid/simple" in alice
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "https://bob:other@mirror.invalid/simple")
    assert packages.pip_sources() == alice
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "https://mirror.example/simple")
    assert packages.key((PKG,), guest, packages.pip_sources()) != packages.key((PKG,), guest, alice)
    assert packages.shown_sources((":env:.index-url=https://mirror.example/path-token/simple",)) == [
        ":env:.index-url=https://mirror.example"]
    # an install from a file index, the token-carrying index beside it (unreachable: pip goes on without it)
    name = "smolbench-probe-pkg"
    monkeypatch.setenv("PIP_INDEX_URL", _file_index(tmp_path / "i", {name: _wheel(tmp_path / "w", "smolbench_probe_pkg", "")}))
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "https://alice:s3cret-token@127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    log: list[str] = []
    done = packages.ensure((f"{name}==1.0",), guest, log)
    files = [str(p) for p in (cache / "packages").rglob("*")]
    meta = (done.lib.parent / packages.META).read_text()
    assert "https://127.0.0.1" in meta and not any("s3cret" in t for t in [*files, meta, done.line((name,)), *log])


def test_a_cache_entry_another_user_could_have_planted_or_altered_is_refused(cache: Path) -> None:
    """A shared $SMOLBENCH_CACHE: an entry counted as installed once its packages.json was there,
    whoever made it, and was mounted into machines. Now, as ssh treats its files: the user's own
    (or root's) and writable by nobody else, or refused in one line with the fix."""
    guest = packages.host_python()
    made = packages.ensure((PKG,), guest)
    assert packages.ensure((PKG,), guest).cached  # a normal entry: accepted
    entry, root = made.lib.parent, cache / "packages"

    def refused() -> str:
        with pytest.raises(SmolbenchError) as err:
            packages.ensure((PKG,), guest)
        assert "\n" not in str(err.value), str(err.value)
        return str(err.value)

    module = made.lib / "tomli_w" / "__init__.py"
    module.chmod(0o666)  # altered, or alterable: a file deep in it that others can write
    said = refused()
    assert said.startswith(f"refusing the packages cache entry {entry} ({module}): it is writable by group and others "
                           "(mode 0666), so another user could have planted or altered it; remove it (rm -rf "), said
    module.chmod(0o644)
    entry.chmod(0o775)
    assert "it is writable by group (mode 0775)" in refused()
    entry.chmod(0o755)
    root.chmod(0o777)  # a cache folder others write in: they can plant any entry
    assert refused() == (f"refusing the packages cache {root}: it is writable by group and others (mode 0777), so "
                         f"another user could plant or alter the packages it mounts into machines; chmod go-w {root}")
    root.chmod(0o755)
    assert packages.ensure((PKG,), guest).cached
    if os.getuid() == 0:  # planted: an entry of another user (only root can make one here)
        os.chown(entry, 65534, 65534)
        assert f"refusing the packages cache entry {entry}: it belongs to uid 65534, not you (uid 0)" in refused()
        os.chown(entry, 0, 0)
        os.chown(root, 65534, 65534)
        assert refused().endswith("set $SMOLBENCH_CACHE to a folder of your own")
        os.chown(root, 0, 0)
    assert packages.ensure((PKG,), guest).cached


def test_the_cache_is_listed_and_pruned_of_what_no_up_used_lately(
        cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import fcntl
    import time

    from smolbench import cli

    guest = packages.host_python()
    made = packages.ensure((PKG,), guest)
    made.close()  # no machine runs on it: prune may take it
    entry, root = made.lib.parent, cache / "packages"
    fresh = root / ("f" * 24)
    shutil.copytree(entry, fresh, symlinks=True)
    past = time.time() - 40 * 86400
    os.utime(entry / packages.META, (past, past))
    assert packages.ensure((PKG,), guest).cached  # an up uses it: its last use is now
    assert packages.prune(30, dry_run=True) == ([], [])
    os.utime(entry / packages.META, (past, past))
    killed = root / f".{entry.name}.tmp-x1"  # what a killed install left
    (killed / "lib").mkdir(parents=True)
    busy = root / f".{'b' * 24}.tmp-x2"  # an install under way: its lock is held
    busy.mkdir()
    assert cli.main(["packages", "list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{entry.name}\t") and f"\t{guest.tag}\t{PKG}" in out[0], out
    assert out[1].startswith(f"{fresh.name}\t") and out[2].startswith("2 entries, ") and out[2].endswith(str(root))
    with open(root / f".{'b' * 24}.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert cli.main(["packages", "prune", "--dry-run"]) == 0
        assert capsys.readouterr().out.splitlines()[:2] == [f"would remove {killed} (0 MB)",
                                                            f"would remove {entry} (0 MB)"]
        assert entry.is_dir() and killed.is_dir()
        assert cli.main(["packages", "prune"]) == 0
        assert capsys.readouterr().out.splitlines()[:2] == [f"removed {killed} (0 MB)", f"removed {entry} (0 MB)"]
    assert sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) == sorted([fresh.name, busy.name])
    assert not packages.ensure((PKG,), guest).cached  # installed anew when next needed
    (fresh / "lib").chmod(0o777)  # a refused entry is listed as such, its packages.json unread
    assert cli.main(["packages", "list"]) == 0
    assert f"{fresh.name}\t0 MB\tused " in (out := capsys.readouterr().out) and "\tREFUSED: refusing the packages" in out


def test_a_requirement_with_terminal_escapes_is_refused_and_never_listed_raw(
        cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A Smolfile requirement with escapes in its URL passed the check; after the install
    ``smolbench packages list`` printed it raw (retitling the window, erasing lines). Now the
    Smolfile says so in one line, and the list shows a planted or older entry's escaped."""
    import json

    from smolbench import cli

    req = "evil @ https://attacker.example/\x1b]0;pwned\x07\x1b[2K\x1b[1A/evil-1.0-py3-none-any.whl"
    with pytest.raises(SmolfileError) as err:
        parse_smolfile(f"packages = [{json.dumps(req)}]\n")
    assert "holds a control or other non-printable character" in str(err.value) and "\x1b" not in str(err.value)
    entry = cache / "packages" / ("a" * 24)
    (entry / "lib").mkdir(parents=True)
    for path in (cache, cache / "packages", entry, entry / "lib"):
        path.chmod(0o755)
    (entry / packages.META).write_text(json.dumps({"requirements": [req], "python": "cp311\x1b[2J",
                                                   "sources": ["https://x/\x1b]0;t\x07\nfake line"]}) + "\n")
    assert cli.main(["packages", "list"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and len(out.splitlines()) == 2, out
    assert "evil @ https://attacker.example/\\x1b]0;pwned\\x07\\x1b[2K\\x1b[1A/evil-1.0" in out
    assert "\\nfake line" in out and "cp311\\x1b[2J" in out


def test_the_key_covers_the_installing_pips_version_asked_once_while_its_files_are_unchanged(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another pip may resolve the same list to other versions: an upgrade of the host's pip
    reused what the old one installed. pip's version is asked of it once, then kept while its files are."""
    import importlib.metadata

    calls: list[list[str]] = []
    real = subprocess.run
    monkeypatch.setattr(packages, "_PIP_MEMO", None)

    def run(cmd: list[str], *args: object, **kwargs: object) -> object:
        if packages._PIP_VERSION in cmd:
            calls.append(cmd)
        return real(cmd, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(subprocess, "run", run)
    said = packages.pip_version()
    assert said == importlib.metadata.version("pip") and len(calls) == 1
    assert packages.pip_version() == said and len(calls) == 1  # unchanged: a stat, not a pip run
    guest, here = packages.host_python(), packages.pip_sources()
    assert packages.key((PKG,), guest, here) == packages.key((PKG,), guest, here, said)
    assert packages.key((PKG,), guest, here, "23.0") != packages.key((PKG,), guest, here, said)
    name = "smolbench-probe-pkg"
    monkeypatch.setenv("PIP_INDEX_URL", _file_index(tmp_path / "i", {name: _wheel(tmp_path / "w", "smolbench_probe_pkg", "")}))
    first = packages.ensure((f"{name}==1.0",), guest)
    assert json.loads((first.lib.parent / packages.META).read_text())["pip"] == said
    fake = tmp_path / "pip" / "__init__.py"  # a pip whose files this test can change
    fake.parent.mkdir()
    fake.write_text("")
    monkeypatch.setattr(packages, "_PIP_MEMO", (str(fake), packages._pip_stamp(str(fake)), "1.0-older"))
    assert packages.pip_version() == "1.0-older" and len(calls) == 1  # as if another pip had installed it
    again = packages.ensure((f"{name}==1.0",), guest)
    assert not again.cached and again.lib != first.lib  # another pip: installed anew, not reused
    fake.write_text("__version__ = 'upgraded'\n")  # its files changed: asked again
    assert packages.pip_version() == said


def test_a_wheel_named_by_path_is_keyed_by_its_content_and_installed_from_a_copy(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside audit: ``pkg @ file:///…/x.whl`` was keyed by its text, so a rebuilt wheel was never
    installed; and a wheel in a folder a machine can write (a volume) could be swapped between the
    key and pip's read, the swapped one then mounted into every machine of that list."""
    from smolbench import _pkgwheels

    folder = tmp_path / "volume"
    wheel = _wheel(folder, "smolbench_local_pkg", "WHO = 'first'\n")
    reqs, guest = (f"smolbench-local-pkg @ file://{wheel}",), packages.host_python()

    def who(installed: packages.Installed) -> str:
        assert installed.held is not None
        installed.held.close()  # (held, prune would keep it: nothing here prunes)
        return (installed.lib / "smolbench_local_pkg" / "__init__.py").read_text().strip()

    assert who(packages.ensure(reqs, guest)) == "WHO = 'first'"
    assert who(packages.ensure(reqs, guest)) == "WHO = 'first'"  # the same bytes: the same entry
    wheel.unlink()
    _wheel(folder, "smolbench_local_pkg", "WHO = 'rebuilt'\n")
    assert who(packages.ensure(reqs, guest)) == "WHO = 'rebuilt'"  # new bytes: installed again

    # swapped between the key's hash and pip's read: refused, nothing kept
    real = _pkgwheels.private_copies

    def swap_first(requirements: tuple[str, ...], hashes: dict[str, str], where: Path) -> tuple[str, ...]:
        wheel.unlink()
        _wheel(folder, "smolbench_local_pkg", "WHO = 'swapped'\n")
        return real(requirements, hashes, where)

    wheel.unlink()
    _wheel(folder, "smolbench_local_pkg", "WHO = 'third'\n")
    monkeypatch.setattr(packages, "private_copies", swap_first)
    with pytest.raises(SmolbenchError, match="changed while it was being installed: up again once it is written"):
        packages.ensure(reqs, guest)
    assert not any(p.name.startswith(".") and ".tmp-" in p.name for p in packages.packages_root().iterdir())
    monkeypatch.setattr(packages, "private_copies", real)
    assert who(packages.ensure(reqs, guest)) == "WHO = 'swapped'"  # as it is now, hashed anew

    with pytest.raises(SmolbenchError, match="can't read .*: check the path"):
        packages.ensure((f"smolbench-local-pkg @ file://{tmp_path}/gone-1.0-py3-none-any.whl",), guest)


def test_a_wheel_path_never_waits_on_a_fifo_nor_follows_a_link_a_machine_made(
        cache: Path, tmp_path: Path) -> None:
    """Outside audit: a Smolfile's wheel in a volume a machine writes was opened by path. A fifo
    the machine put at its name hung `%smol up` (and its Ctrl-C: the thread was waited on); a
    link there made the host, root in containers, install and mount a file the machine chose."""
    folder = tmp_path / "volume"
    folder.mkdir()
    guest = packages.host_python()
    fifo = folder / "pkg-1.0-py3-none-any.whl"
    os.mkfifo(fifo)
    done: list[BaseException | None] = []

    def up() -> None:
        try:
            packages.ensure((f"pkg @ file://{fifo}",), guest)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            done.append(exc)
        else:
            done.append(None)

    t = threading.Thread(target=up, daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():  # (the old code: let it go, then fail)
        os.close(os.open(fifo, os.O_WRONLY))
        t.join(30)
        pytest.fail("a fifo at a wheel's path hung the packages install")
    assert isinstance(done[0], SmolbenchError) and "is not a plain file: point it at a .whl file" in str(done[0])

    chosen = _wheel(tmp_path / "not-in-the-volume", "smolbench_local_pkg", "WHO = 'the machine chose'\n")
    (folder / chosen.name).symlink_to(chosen)
    with pytest.raises(SmolbenchError, match=r"on its way is a link .*: name the wheel by its real path, "):
        packages.ensure((f"smolbench-local-pkg @ file://{folder / chosen.name}",), guest)
    (folder / "sub").symlink_to(chosen.parent)  # a folder on the way, too
    with pytest.raises(SmolbenchError, match=r"/sub on its way is a link"):
        packages.ensure((f"smolbench-local-pkg @ file://{folder / 'sub' / chosen.name}",), guest)


def test_a_deeply_nested_entry_record_is_refused_not_a_crash(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Audit: an entry's packages.json of ``"[" * 2000`` (a shared or copied cache) raised RecursionError,
    which `smolbench packages list` (catching ValueError) let through. Now it is bad JSON: the entry is
    listed as refused."""
    from smolbench import cli

    entry = cache / "packages" / ("b" * 24)
    (entry / "lib").mkdir(parents=True)
    for path in (cache, cache / "packages", entry, entry / "lib"):
        path.chmod(0o755)
    (entry / packages.META).write_text("[" * 2000)
    [found] = packages.entries()
    assert found.meta == {} and found.refused == "JSON nested too deeply"
    assert cli.main(["packages", "list"]) == 0
    assert ("b" * 24) in capsys.readouterr().out


def test_a_wheel_named_by_url_must_be_pinned_by_its_hash_and_pip_checks_the_pin(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pkg @ https://…/x.whl`` was keyed by its text: a wheel changed at that URL (or another
    server answering for it) was never installed, the old build served under the same key. Now
    a URL must carry pip's ``#sha256=`` pin (the key holds it, so it holds the content) and pip
    refuses a file that is not the pinned one; a wheel on this host is still hashed by us."""
    import hashlib
    import http.server

    for url in ("https://example.org/w/pkg-1.0-py3-none-any.whl", "http://10.0.0.1/pkg-1.0-py3-none-any.whl",
                "https://example.org/pkg-1.0-py3-none-any.whl#md5=0123", "file://otherhost/pkg-1.0-py3-none-any.whl"):
        with pytest.raises(SmolfileError) as err:  # on the old code: taken, keyed by the URL alone
            parse_smolfile(f'packages = ["pkg @ {url}"]\n')
        said = str(err.value)
        assert "without its hash" in said and "#sha256=" in said and "\n" not in said, said
        with pytest.raises(SmolbenchError, match="without its hash"):  # nor a list the parser never saw
            packages.ensure((f"pkg @ {url}",), packages.host_python())
    assert packages.requirement_problem(f"pkg @ https://example.org/pkg-1.0-py3-none-any.whl#sha256={'a' * 64}") is None
    assert packages.requirement_problem(f"pkg @ file://{tmp_path}/pkg-1.0-py3-none-any.whl") is None

    served = tmp_path / "served"
    wheel = _wheel(served, "smolbench_url_pkg", "WHO = 'first'\n")
    first = hashlib.sha256(wheel.read_bytes()).hexdigest()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a: object, **kw: object) -> None:
            super().__init__(*a, directory=str(served), **kw)  # type: ignore[arg-type]

        def log_message(self, *a: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    url = f"http://127.0.0.1:{server.server_address[1]}/{wheel.name}"
    guest = packages.host_python()

    def who(sha: str) -> str:
        installed = packages.ensure((f"smolbench-url-pkg @ {url}#sha256={sha}",), guest)
        assert installed.held is not None
        installed.held.close()
        return (installed.lib / "smolbench_url_pkg" / "__init__.py").read_text().strip()

    try:
        assert who(first) == "WHO = 'first'"
        wheel.unlink()
        _wheel(served, "smolbench_url_pkg", "WHO = 'rebuilt'\n")  # the file at the URL changes
        rebuilt = hashlib.sha256(wheel.read_bytes()).hexdigest()
        assert who(first) == "WHO = 'first'"  # pinned to the first: its entry, the content it names
        assert who(rebuilt) == "WHO = 'rebuilt'"  # the new pin: another key, installed anew
        monkeypatch.setenv("SMOLBENCH_CACHE", str(tmp_path / "other-cache"))
        with pytest.raises(SmolbenchError):  # pinned to the first, the URL serves another file: pip refuses
            who(first)
        assert not [p for p in packages.packages_root().iterdir() if not p.name.startswith(".")]
    finally:
        server.shutdown()
        thread.join()
        server.server_close()
