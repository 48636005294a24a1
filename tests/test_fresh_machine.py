"""A fresh machine: the kernel's Python, its venv and the image cache in a private (0700)
folder, as with pyenv's python3 under /root; and CI refusing a machine opened up by hand.

The 0700 situation is built here, not taken from the host: a folder made by ``mkdtemp``
holds a base interpreter (a copy of a Python binary that needs nothing from its own
prefix, its standard library linked from the system) and a venv made from it, so the
kernel's ``sys.base_prefix`` lives where an unprivileged uid can't pass. Against the old
set-up (``SMOLBENCH_TEST_WEAKEN=no-stage``: a root kernel doesn't stage those folders for
its sandbox) `%smol up` fails, naming the folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from nbhelpers import NotebookSession, error_text, result_text, stream_text

from smolbench.backends._bwrap import SANDBOX_UID
from smolbench.images import build_debian_rootfs

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = ("/usr/", "/bin/", "/lib/", "/lib64/")
VERSION = f"python{sys.version_info.major}.{sys.version_info.minor}"

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")


def _relocatable_python() -> tuple[str, str] | None:
    """(binary, stdlib) of an interpreter of this version whose binary links only system
    libraries and whose standard library is in a system folder: a copy of it elsewhere,
    next to a link to that library, is a base interpreter with its prefix there."""
    probe = "import sys, sysconfig; print(sys.executable); print(sysconfig.get_paths()['stdlib'])"
    for cand in dict.fromkeys([os.path.realpath(getattr(sys, "_base_executable", sys.executable)),
                               f"/usr/bin/{VERSION}", f"/usr/local/bin/{VERSION}"]):
        if not os.access(cand, os.X_OK):
            continue
        out = subprocess.run([cand, "-I", "-c", probe], capture_output=True, text=True)
        libs = subprocess.run(["ldd", cand], capture_output=True, text=True).stdout
        if out.returncode or not out.stdout.strip().endswith(VERSION):
            continue
        stdlib = out.stdout.split()[-1]
        needed = [w for w in libs.split() if w.startswith("/")]
        if stdlib.startswith(SYSTEM) and all(w.startswith(SYSTEM) for w in needed):
            return os.path.realpath(cand), stdlib
    return None


@pytest.fixture
def private_python() -> Iterator[Path]:
    """A 0700 folder with ``base/`` (the base interpreter), ``venv/`` (made from it, seeing this
    venv's packages), ``share/jupyter/kernels/python3`` (a kernel on that venv) and ``work/``."""
    found = _relocatable_python()
    if found is None:
        pytest.skip(f"no {VERSION} here links only system libraries with its stdlib in /usr (Debian's does)")
    binary, stdlib = found
    # 0700, like a home or `mktemp -d`; under /tmp, which is the machine's own too (as in CI)
    top = Path(tempfile.mkdtemp(prefix="smolbench-private-", dir="/tmp"))
    try:
        (top / "base" / "bin").mkdir(parents=True)
        (top / "base" / "lib").mkdir()
        shutil.copy2(binary, top / "base" / "bin" / VERSION)
        (top / "base" / "lib" / VERSION).symlink_to(stdlib)
        subprocess.run([str(top / "base" / "bin" / VERSION), "-m", "venv", "--without-pip", str(top / "venv")], check=True)
        py = top / "venv" / "bin" / "python"
        site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        # the kernel's packages (ipykernel, this checkout's editable smolbench) come from this venv
        here = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
        (Path(site) / "smolbench-test-deps.pth").write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in here))
        spec = top / "share" / "jupyter" / "kernels" / "python3"
        spec.mkdir(parents=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [str(py), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "private python", "language": "python"}))
        (top / "work").mkdir()
        yield top
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _image_cache(top: Path) -> Path | None:
    """A Smolfile image cache inside ``top`` holding debian:bookworm (built once, as the
    sandbox isolation tests do, then hard-linked in), or None where it can't be built."""
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        return None
    built = build_debian_rootfs("debian:bookworm", log=lambda *a: None)
    cache = top / "cache"
    (cache / "images").mkdir(parents=True)
    subprocess.run(["cp", "-al", str(built), str(cache / "images" / built.name)], check=True)
    return cache


@pytest.mark.parametrize("weaken", ["", "no-stage"])
def test_a_kernel_on_a_python_in_a_private_folder_runs_cells_forks_and_images(
        private_python: Path, weaken: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if weaken and os.geteuid() != 0:
        pytest.skip("staging is what a root kernel does: a user's sandbox runs as that user")
    top = private_python
    monkeypatch.setenv("JUPYTER_PATH", str(top / "share" / "jupyter"))  # the kernel on the private Python
    monkeypatch.setenv("SMOLBENCH_TEST_WEAKEN", weaken)
    cache = _image_cache(top) if not weaken else None
    if cache is not None:
        monkeypatch.setenv("SMOLBENCH_CACHE", str(cache))
    with NotebookSession(top / "work", timeout=180, allow_errors=True) as nb:
        nb.run("%load_ext smolbench")
        up = nb.run("%smol up --backend sandbox")
        if weaken:  # the old set-up: the sandbox uid can't pass a 0700 folder (this one, or the
            # checkout's own if it is in one too: whichever bwrap meets first)
            said = error_text(up) + stream_text(up) + stream_text(up, "stderr")
            assert f"the sandbox uid {SANDBOX_UID} can't reach " in said and "is not traversable" in said, said
            return
        assert not error_text(up), error_text(up)
        # the staging mounts live in the machine's own mount namespace, never the host's
        assert not [ln for ln in Path("/proc/self/mountinfo").read_text().splitlines() if str(top) in ln]
        cell = nb.run("%%smol\nimport sys, os\n(sys.base_prefix, sys.prefix, os.getuid() != 0)")
        assert result_text(cell) == repr((str(top / "base"), str(top / "venv"), True)), error_text(cell)
        base = str(top / "base")
        forked = nb.run(f"%%smol fork 4 --quiet --out res\nimport sys\nreward = SEED * 10 + (sys.base_prefix == {base!r})")
        assert not error_text(forked), error_text(forked)
        rewards = nb.run("sorted(res.rewards.values())")
        assert result_text(rewards) == "[1.0, 11.0, 21.0, 31.0]", result_text(rewards)
        if cache is not None:
            nb.run("%smol down")
            up = nb.run("%smol up --backend sandbox --image debian:bookworm")
            assert not error_text(up), error_text(up)
            cell = nb.run("%%smol\nimport sys\n(sys.executable, open('/etc/debian_version').read()[:2])")
            assert result_text(cell) == "('/usr/bin/python3', '12')", error_text(cell)
        nb.run("%smol down")


def test_a_venv_under_tmp_bigger_than_memory_is_not_copied_into_a_branch(
        private_python: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A branch of an uncontained machine (the host-root set-up the containment tests compare
    against) gets private copies of the workspace and /tmp: a venv bound below /tmp stays a
    mount, never copied into the branch's memory (CI's checkout under `mktemp -d` ran every
    such branch out of memory)."""
    if os.geteuid() != 0:
        pytest.skip("the host-root set-up needs a root kernel")
    top = private_python
    with open(top / "venv" / "big.bin", "wb") as fh:  # sparse on disk, 384 MiB once copied
        fh.truncate(384 << 20)
    (top / "work" / "Smolfile").write_text('memory = "256M"\n')
    monkeypatch.setenv("JUPYTER_PATH", str(top / "share" / "jupyter"))
    monkeypatch.setenv("SMOLBENCH_TEST_WEAKEN", "host-root")
    with NotebookSession(top / "work", timeout=180, allow_errors=True) as nb:
        nb.run("%load_ext smolbench")
        up = nb.run("%smol up --backend sandbox")
        assert not error_text(up), error_text(up)
        venv = str(top / "venv")
        forked = nb.run(f"%%smol fork 2 --quiet --out res\nimport sys, json\nreward = float(sys.prefix == {venv!r})")
        assert not error_text(forked), error_text(forked)
        assert result_text(nb.run("sorted(res.rewards.values())")) == "[1.0, 1.0]"
        nb.run("%smol down")


def test_ci_refuses_a_root_home_opened_up_by_hand(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the check is for CI running as root")
    home = tmp_path / "root-home"
    home.mkdir(mode=0o755)
    home.chmod(0o755)
    env = {**os.environ, "CI": "true", "SMOLBENCH_CI_ROOT_HOME": str(home)}
    out = subprocess.run(["bash", str(ROOT / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip() == (f"CI: {home} is mode 755, not 700 as on a fresh machine: this machine was "
                                  f"changed by hand; `chmod 700 {home}` and rerun")


def test_a_volume_the_sandbox_uid_cannot_read_is_named_in_one_line(open_tmp: Path) -> None:
    """Staging opens the way to a folder, never into one: another user's private folder stays shut."""
    from smolbench import _loop
    from smolbench.backends.sandbox import SandboxBackend
    from smolbench.errors import SmolbenchError
    from smolbench.smolfile import parse_smolfile

    if os.geteuid() != 0:
        pytest.skip("needs root to make a folder owned by another user")
    private = open_tmp / "theirs"
    private.mkdir(mode=0o700)
    os.chown(private, 12345, 12345)
    spec = parse_smolfile('[[volumes]]\nhost = "theirs"\nguest = "/data"\n', base_dir=str(open_tmp))
    b = SandboxBackend()
    try:
        with pytest.raises(SmolbenchError) as err:
            _loop.run(b.create(spec, "root"))
    finally:
        _loop.run(b.close())
    assert str(err.value) == (f"the sandbox uid {SANDBOX_UID} can't read {private} (owner uid 12345, mode 0700): "
                              "make it readable to others (`chmod o+rX`), or put it elsewhere")
