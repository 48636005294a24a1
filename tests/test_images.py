"""Tests of the sandbox rootfs cache (no real debootstrap here)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from smolbench import images
from smolbench.errors import SmolbenchError
from smolbench.images import (
    build_debian_rootfs,
    cache_dir,
    image_dir,
    list_images,
    resolve_rootfs,
)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache directory in ``$SMOLBENCH_CACHE``."""
    path = tmp_path / "cache"
    monkeypatch.setenv("SMOLBENCH_CACHE", str(path))
    return path


def _fake_rootfs(path: Path) -> Path:
    (path / "usr" / "bin").mkdir(parents=True)
    (path / "usr" / "bin" / "python3").write_text("")
    return path


def _fake_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str | None) -> None:
    """Put only a fake ``debootstrap`` (or nothing) on PATH."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    if script is not None:
        exe = bindir / "debootstrap"
        exe.write_text("#!/bin/sh\nPATH=/usr/bin:/bin\n" + script)
        exe.chmod(0o755)
    monkeypatch.setenv("PATH", str(bindir))


def test_cache_dir(cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert cache_dir() == cache
    monkeypatch.delenv("SMOLBENCH_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "smolbench"


def test_image_dir(cache: Path) -> None:
    assert image_dir("debian:bookworm") == cache / "images" / "debian-bookworm"
    assert image_dir("ghcr.io/org/img:1.0") == cache / "images" / "ghcr.io-org-img-1.0"
    for bad in ("", "..", "../x", "a b"):
        with pytest.raises(SmolbenchError, match="invalid image name"):
            image_dir(bad)


def test_resolve_rootfs_none_and_path(tmp_path: Path) -> None:
    assert resolve_rootfs(None) is None
    root = _fake_rootfs(tmp_path / "rootfs")
    assert resolve_rootfs(str(root)) == root
    bare = tmp_path / "bare"
    (bare / "bin").mkdir(parents=True)
    (bare / "bin" / "python3").symlink_to("/nonexistent/python3.11")  # dangling is fine
    assert resolve_rootfs(str(bare)) == bare


def test_resolve_rootfs_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(SmolbenchError, match="does not exist") as err:
        resolve_rootfs(str(tmp_path / "missing"))
    assert "\n" not in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SmolbenchError, match="has no usr/bin/python3"):
        resolve_rootfs(str(tmp_path / "empty"))


def test_resolve_rootfs_built_name(cache: Path) -> None:
    root = _fake_rootfs(cache / "images" / "debian-bookworm")
    assert resolve_rootfs("debian:bookworm") == root


def test_resolve_rootfs_missing_name(cache: Path) -> None:
    with pytest.raises(SmolbenchError) as err:
        resolve_rootfs("debian:bookworm")
    assert str(err.value) == (
        "image 'debian:bookworm' is not built: run `smolbench image build debian:bookworm`"
    )
    (cache / "images" / "debian-trixie").mkdir(parents=True)  # present but no python3
    with pytest.raises(SmolbenchError, match=r"^image 'debian:trixie' is not built: run `"):
        resolve_rootfs("debian:trixie")
    with pytest.raises(SmolbenchError, match="OCI images need the smol backend"):
        resolve_rootfs("python:3.12-slim")


def test_build_needs_debootstrap(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_bin(tmp_path, monkeypatch, None)
    with pytest.raises(SmolbenchError) as err:
        build_debian_rootfs(log=lambda _line: None)
    message = str(err.value)
    assert "debootstrap is not installed" in message
    assert "install it with: apt-get install debootstrap" in message
    assert "\n" not in message
    assert not (cache / "images").exists()


def test_build_needs_root(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_bin(tmp_path, monkeypatch, "exit 0\n")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SmolbenchError, match="needs root: run `sudo ") as err:
        build_debian_rootfs(log=lambda _line: None)
    assert "\n" not in str(err.value)


def test_build_returns_existing(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _fake_rootfs(cache / "images" / "debian-bookworm")
    _fake_bin(tmp_path, monkeypatch, None)  # would fail if it tried to build
    assert build_debian_rootfs(log=lambda _line: None) == root


def test_build_with_fake_debootstrap(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = 'echo "args: $*"\nmkdir -p "$4/usr/bin" && touch "$4/usr/bin/python3"\n'
    _fake_bin(tmp_path, monkeypatch, script)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    lines: list[str] = []
    root = build_debian_rootfs(log=lines.append)
    assert root == cache / "images" / "debian-bookworm"
    assert (root / "usr" / "bin" / "python3").exists()
    assert oct(root.stat().st_mode & 0o777) == oct(0o755)
    assert "args: --variant=minbase --include=python3,python3-pip bookworm " in "\n".join(lines)
    assert [p.name for p in (cache / "images").iterdir() if p.name.startswith(".")] == []
    meta = json.loads((cache / "images" / "debian-bookworm.json").read_text())
    assert meta["name"] == "debian:bookworm"
    [(name, path, size)] = list_images()
    assert (name, path) == ("debian:bookworm", root)
    assert size >= 0
    # another suite for a built image: one line, not the old tree under a new name
    lab = build_debian_rootfs("lab:py", log=lines.append)
    with pytest.raises(SmolbenchError, match="is built already, from suite bookworm: add --force to build it again "
                                             "from trixie"):
        build_debian_rootfs("lab:py", suite="trixie", log=lines.append)
    assert build_debian_rootfs("lab:py", suite="bookworm", log=lines.append) == lab
    assert build_debian_rootfs(suite="bookworm", log=lines.append) == root
    # force rebuilds and replaces the old tree
    (root / "stale").write_text("x")
    assert build_debian_rootfs(force=True, log=lines.append) == root
    assert not (root / "stale").exists()
    assert [p.name for p in (cache / "images").iterdir() if p.name.startswith(".")] == []


def test_failed_build_leaves_nothing(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = 'mkdir -p "$4/usr"\necho "E: Failed getting release file"\nexit 1\n'
    _fake_bin(tmp_path, monkeypatch, script)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with pytest.raises(SmolbenchError) as err:
        build_debian_rootfs(log=lambda _line: None)
    assert str(err.value).startswith(
        "debootstrap failed for image 'debian:bookworm' (exit 1): E: Failed getting release file;"
    )
    assert list((cache / "images").iterdir()) == []
    assert list_images() == []


def test_list_images(cache: Path) -> None:
    assert list_images() == []
    root = _fake_rootfs(cache / "images" / "debian-bookworm")
    (root / "usr" / "bin" / "python3").write_text("12345")
    (cache / "images" / ".debian-bookworm.build-xyz").mkdir()  # in-progress builds are hidden
    [(name, path, size)] = list_images()
    assert name == "debian-bookworm"  # no metadata: the directory name
    assert path == root
    assert size >= 5


def test_path_image_detection() -> None:
    for image in ("/r", "./r", "../r", "~/r", "~", "."):
        assert images.is_path_image(image)
    for image in ("debian:bookworm", "python:3.12-slim", "rootfs"):
        assert not images.is_path_image(image)


def _can_mount() -> bool:
    return os.geteuid() == 0 and os.path.exists("/proc/self/mountinfo") and os.access("/usr/bin/mount", os.X_OK) and os.access("/usr/bin/umount", os.X_OK)


def _mounted_under(path: Path) -> list[str]:
    root = os.path.realpath(path)
    return [line.split()[4] for line in open("/proc/self/mountinfo") if line.split()[4].startswith(root + "/")]


@pytest.fixture
def no_mounts_left(tmp_path: Path) -> Iterator[None]:
    """Whatever a test mounted under its folder is detached afterwards, pass or fail."""
    try:
        yield
    finally:
        for point in sorted(_mounted_under(tmp_path), key=len, reverse=True):
            subprocess.run(["/usr/bin/umount", "-l", point], check=False)  # PATH may still be the fake one


@pytest.mark.skipif(not _can_mount(), reason="needs root and mount (debootstrap's mounts are the point)")
def test_a_failed_build_detaches_what_debootstrap_mounted_before_removing_it(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_mounts_left: None
) -> None:
    """Attack on the host: debootstrap mounts proc (and sys, and may bind /dev) inside the
    target; a build that fails with them mounted was removed with rmtree, which walks into
    those mounts (the host's /dev nodes) and left the mount and the folder behind. Here a
    tmpfs with a file stands for them: the file must survive (never walked into) and
    nothing may stay mounted or on disk."""
    held = tmp_path / "host-dev"
    held.mkdir()
    (held / "null").write_text("a host device node")
    script = (f'mkdir -p "$4/dev" && /usr/bin/mount --bind {held} "$4/dev" || exit 3\n'
              'echo "E: Couldn\'t download packages"\nexit 1\n')
    _fake_bin(tmp_path, monkeypatch, script)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with pytest.raises(SmolbenchError, match=r"\(exit 1\)"):
        build_debian_rootfs(log=lambda _line: None)
    assert (held / "null").read_text() == "a host device node"  # the bind's source is untouched
    assert _mounted_under(cache) == []
    assert list((cache / "images").iterdir()) == []


@pytest.mark.skipif(not _can_mount(), reason="needs root and mount")
def test_a_killed_builds_folder_is_swept_with_its_mounts_by_the_next_build(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_mounts_left: None
) -> None:
    """A build killed mid-way (SIGKILL: no cleanup ran) left ``.NAME.build-*`` with proc
    mounted in it; the next build removes it, mounts first. A running build's folder (its
    pid alive) is left alone."""
    images_dir = cache / "images"
    dead = images_dir / ".debian-bookworm.build-g9_3n7mm"  # the old naming, no pid: stale
    (dead / "proc").mkdir(parents=True)
    subprocess.run(["/usr/bin/mount", "-t", "tmpfs", "none", str(dead / "proc")], check=True)
    busy = images_dir / f".debian-bookworm.build-{os.getppid()}-abc"  # a live process's
    busy.mkdir()
    script = 'mkdir -p "$4/usr/bin" && touch "$4/usr/bin/python3"\n'
    _fake_bin(tmp_path, monkeypatch, script)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    build_debian_rootfs(log=lambda _line: None)
    assert not dead.exists() and _mounted_under(cache) == []
    assert busy.is_dir()


# A debootstrap that starts a child of its own (as dpkg, chroots) and runs until it is stopped.
SLOW_DEBOOTSTRAP = '''mkdir -p "$4/usr"
echo $$ > "$DEBOOT_PIDS"
sleep 300 &
echo $! >> "$DEBOOT_PIDS"
echo "I: Retrieving Packages"
wait
'''


@pytest.mark.parametrize(("sig", "times"), [("SIGTERM", 1), ("SIGINT", 1), ("SIGHUP", 1), ("SIGTERM", 2),
                                            ("SIGINT", 2)])
def test_a_build_stopped_midway_ends_debootstrap_and_everything_it_started(
        cache: Path, tmp_path: Path, sig: str, times: int) -> None:
    """`smolbench image build` under SIGTERM (a CI job cancelled, systemd stopping it) or SIGHUP
    (its terminal closed) died at once and left debootstrap running into its build folder, which
    stayed until the next build. A second signal (an impatient Ctrl-C) must not cut the clean-up short."""
    import signal
    import sys
    import time

    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "debootstrap").write_text("#!/bin/sh\nPATH=/usr/bin:/bin\n" + SLOW_DEBOOTSTRAP)
    (bindir / "debootstrap").chmod(0o755)
    pids = tmp_path / "pids"
    env = {**os.environ, "PATH": str(bindir), "DEBOOT_PIDS": str(pids), "SMOLBENCH_CACHE": str(cache)}
    as_root = "import os, sys; os.geteuid = lambda: 0; from smolbench.cli import main; sys.exit(main(['image', 'build']))"
    cli = subprocess.Popen([sys.executable, "-c", as_root], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(pids.read_text().split()) < 2 if pids.exists() else True:
            assert time.monotonic() < deadline and cli.poll() is None, cli.communicate()
            time.sleep(0.05)
        started = [int(p) for p in pids.read_text().split()]
        assert all(_runs(p) for p in started)
        for _ in range(times):
            if cli.poll() is None:
                cli.send_signal(getattr(signal, sig))
                time.sleep(0.02)
        out, err = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert cli.returncode == 130, (out, err)
    assert err.strip().endswith("the build of debian:bookworm was stopped: nothing was built, its build folder is removed")
    deadline = time.monotonic() + 10
    while any(_runs(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in started if _runs(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, "debootstrap (or what it started) ran on after the build was stopped"
    assert [p.name for p in (cache / "images").iterdir()] == []  # no build folder left


def _runs(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_the_suite_comes_from_a_debian_name(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `smolbench image build debian:trixie` built bookworm under the name debian:trixie
    script = 'echo "args: $*"\nmkdir -p "$4/usr/bin" && touch "$4/usr/bin/python3"\n'
    _fake_bin(tmp_path, monkeypatch, script)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    lines: list[str] = []
    root = build_debian_rootfs("debian:trixie", log=lines.append)
    assert root == cache / "images" / "debian-trixie"
    assert " trixie " in "\n".join(lines) and " bookworm " not in "\n".join(lines)
    assert json.loads((cache / "images" / "debian-trixie.json").read_text())["suite"] == "trixie"
    with pytest.raises(SmolbenchError, match=r"^image 'debian:sid' names suite sid, not --suite bookworm: drop "
                                             r"--suite, or name the image debian:bookworm$"):
        build_debian_rootfs("debian:sid", suite="bookworm", log=lines.append)
    assert not (cache / "images" / "debian-sid").exists()


# -- the image cache is trusted only as the packages cache is (smolbench/_pkgtrust.py) --------------


def _refused(call: Callable[[], object]) -> str:
    with pytest.raises(SmolbenchError) as err:
        call()
    assert "\n" not in str(err.value), str(err.value)
    return str(err.value)


def _smol_image(image: str) -> str:
    from smolbench.backends.smol_image import smol_image

    return smol_image(image)


def test_a_linked_image_is_refused_on_both_backends_never_the_hosts_root(cache: Path, tmp_path: Path) -> None:
    """Attack: whoever can write the cache plants ``images/debian-bookworm -> /``; the sandbox bound
    every host root entry (/etc, /home) in place of the filtered view, smol booted the host's /.
    A fake host root stands for / here."""
    host = _fake_rootfs(tmp_path / "host-root")
    (cache / "images").mkdir(parents=True)
    (cache / "images" / "debian-bookworm").symlink_to(host)
    for call in (lambda: resolve_rootfs("debian:bookworm"), lambda: _smol_image("debian:bookworm")):
        said = _refused(call)
        assert said.startswith(f"refusing the image 'debian:bookworm' ({cache}/images/debian-bookworm): it is not "
                               "a folder (a link), so another user could have planted or altered it; remove it "), said
    (cache / "images" / "debian-bookworm").unlink()
    (cache / "images").rmdir()
    (cache / "images").symlink_to(tmp_path / "elsewhere")  # the images folder itself, linked
    _fake_rootfs(tmp_path / "elsewhere" / "debian-bookworm")
    for call in (lambda: resolve_rootfs("debian:bookworm"), lambda: _smol_image("debian:bookworm")):
        assert _refused(call).startswith(f"refusing the image cache {cache}/images: it is not a folder (a link)")


def test_a_built_image_is_bound_by_the_descriptor_that_was_checked(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the sandbox binds is the checked folder (``/proc/self/fd/N``), each entry by descriptor,
    not a path a swap could redirect after the check; smol gets the checked folder's real path."""
    from smolbench.backends import _bwrap, _stage
    from smolbench.spec import MachineSpec

    root = _fake_rootfs(cache / "images" / "debian-bookworm")
    (root / "etc").mkdir()
    (root / "bin").symlink_to("usr/bin")
    monkeypatch.setattr(_stage, "readable", lambda *_a: True)  # the sandbox uid's reach is not the point
    with images.held_rootfs("debian:bookworm") as rootfs:
        assert rootfs is not None and str(rootfs).startswith("/proc/self/fd/")
        p = _bwrap.plan(MachineSpec(), "m", "bwrap", rootfs)
        try:
            assert str(root) not in " ".join(p.argv)
            binds = {p.argv[i + 2]: p.paths[f"/proc/self/fd/{p.argv[i + 1]}"]
                     for i, arg in enumerate(p.argv) if arg == "--ro-bind-fd"}
            assert binds["/usr"] == f"{rootfs}/usr" and binds["/etc"] == f"{rootfs}/etc"
            assert "/bin" not in binds and ["--symlink", "usr/bin", "/bin"] == p.argv[p.argv.index("/bin") - 2:][:3]
        finally:
            p.close()
    assert _smol_image("debian:bookworm") == str(root)


def test_an_image_others_can_write_or_under_a_folder_of_another_user_is_refused(cache: Path, tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A shared cache's other user can write a group-writable image (a trojaned python3), or swap
    what a folder of theirs above the cache holds."""
    root = _fake_rootfs(cache / "images" / "debian-bookworm")
    root.chmod(0o775)
    for call in (lambda: resolve_rootfs("debian:bookworm"), lambda: _smol_image("debian:bookworm")):
        assert "): it is writable by group (mode 0775), so another user could have planted or altered it; " in _refused(call)
    root.chmod(0o755)
    (cache / "images").chmod(0o777)
    assert _refused(lambda: resolve_rootfs("debian:bookworm")).startswith(
        f"refusing the image cache {cache}/images: it is writable by group and others (mode 0777 and not sticky)")
    (cache / "images").chmod(0o755)
    assert resolve_rootfs("debian:bookworm") == root
    if os.getuid() != 0:
        pytest.skip("a folder of another user above the cache: only root can make one here")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.rename(cache, shared / "cache")
    monkeypatch.setenv("SMOLBENCH_CACHE", str(shared / "cache"))
    os.chown(shared, 65534, 65534)
    try:
        said = _refused(lambda: resolve_rootfs("debian:bookworm"))
        assert said.startswith(f"refusing the image cache {shared}/cache: the folder {shared} above it: it belongs to "
                               "uid 65534, not you (uid 0) or root"), said
        assert "the folder" in _refused(lambda: _smol_image("debian:bookworm"))
    finally:
        os.chown(shared, 0, 0)


# -- a root build follows no planted link -------------------------------------------------------------


def test_a_root_build_writes_its_record_never_through_a_planted_link(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: ``debian-bookworm.json -> /etc/shadow`` made the build (as root) overwrite the file
    with JSON. The record is written anew and renamed over the link; the file is left as it was."""
    victim = tmp_path / "victim"
    victim.write_text("root:secret\n")
    (cache / "images").mkdir(parents=True)
    (cache / "images" / "debian-bookworm.json").symlink_to(victim)
    _fake_bin(tmp_path, monkeypatch, 'mkdir -p "$4/usr/bin" && touch "$4/usr/bin/python3"\n')
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    build_debian_rootfs(log=lambda _line: None)
    assert victim.read_text() == "root:secret\n"
    record = cache / "images" / "debian-bookworm.json"
    assert not record.is_symlink() and json.loads(record.read_text())["suite"] == "bookworm"
    assert sorted(p.name for p in (cache / "images").iterdir()) == ["debian-bookworm", "debian-bookworm.json"]


@pytest.mark.skipif(not _can_mount(), reason="needs root and mount (the mount under the link's target is the point)")
def test_a_build_never_sweeps_or_unmounts_through_a_linked_build_folder(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_mounts_left: None
) -> None:
    """Attack: ``.debian-bookworm.build-x -> /`` made the next root build detach every mount under
    its target (all of the host's). A tmpfs under a folder of the test's stands for them."""
    target = tmp_path / "target"
    (target / "mnt").mkdir(parents=True)
    subprocess.run(["/usr/bin/mount", "-t", "tmpfs", "none", str(target / "mnt")], check=True)
    (target / "mnt" / "kept").write_text("a mounted file")
    (target / "file").write_text("a file")
    (cache / "images").mkdir(parents=True)
    link = cache / "images" / ".debian-bookworm.build-x"
    link.symlink_to(target)
    _fake_bin(tmp_path, monkeypatch, 'mkdir -p "$4/usr/bin" && touch "$4/usr/bin/python3"\n')
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    build_debian_rootfs(log=lambda _line: None)
    assert _mounted_under(target) == [str(target / "mnt")]
    assert (target / "mnt" / "kept").read_text() == "a mounted file" and (target / "file").read_text() == "a file"
    assert link.is_symlink()  # left as it is: not ours to remove


def test_a_fifo_planted_at_an_images_record_never_hangs_the_kernel(cache: Path) -> None:
    """Attack: whoever can write in the image cache (a shared $SMOLBENCH_CACHE, a copied one) makes
    an image's record ``NAME.json`` a fifo: reading it (O_NOFOLLOW, but blocking) waited forever
    for a writer, in `smolbench image list`, a build and its suite check. Now it is opened without
    waiting and only a plain file is read: the image is listed by its folder's name."""
    import threading

    root = _fake_rootfs(cache / "images" / "debian-bookworm")
    fifo = cache / "images" / "debian-bookworm.json"
    os.mkfifo(fifo)
    got: list[object] = []
    worker = threading.Thread(target=lambda: got.extend([list_images(), images._built_suite(root)]), daemon=True)
    worker.start()
    worker.join(5)
    if worker.is_alive():  # let the stuck open go (a writer comes and goes) before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(5)
        pytest.fail("reading an image's record waited on a fifo planted there")
    [(name, path, _size)], suite = got
    assert (name, path, suite) == ("debian-bookworm", root, None)


def test_an_image_given_by_path_is_trusted_as_the_cache_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attack: a Smolfile's ``image = "/srv/rootfs"`` (or ``./rootfs``) that another user can write
    in, or under a folder they can write in, lets them plant a trojaned python3 or swap the folder
    for their own (or a link to the host's /) between the check and the bind; the cache's images
    were refused for that, an image given by path was used as it was, by its path. Now it is
    checked as the cache is (the user's own or root's, writable by no one else, the folders above
    too unless sticky; reached without following links) and bound by the descriptor checked."""
    from smolbench.backends import _bwrap, _stage
    from smolbench.spec import MachineSpec

    root = _fake_rootfs(tmp_path / "shared" / "rootfs")
    (root / "etc").mkdir()
    root.chmod(0o777)
    for call in (lambda: resolve_rootfs(str(root)), lambda: _smol_image(str(root))):
        said = _refused(call)
        assert said == (f"refusing the image folder {root}: it is writable by group and others (mode 0777), so "
                        f"another user could plant or alter what is in it; chmod go-w {root}"), said
    root.chmod(0o755)
    (tmp_path / "shared").chmod(0o777)
    for call in (lambda: resolve_rootfs(str(root)), lambda: _smol_image(str(root))):
        assert _refused(call).startswith(f"refusing the image folder {root}: the folder {tmp_path / 'shared'} above "
                                         "it: it is writable by group and others (mode 0777 and not sticky)")
    (tmp_path / "shared").chmod(0o755)
    assert resolve_rootfs(str(root)) == root and _smol_image(str(root)) == str(root)  # the control
    monkeypatch.setattr(_stage, "readable", lambda *_a: True)  # the sandbox uid's reach is not the point
    with images.held_rootfs(str(root)) as rootfs:  # what is bound is the folder checked, by descriptor
        assert rootfs is not None and str(rootfs).startswith("/proc/self/fd/")
        p = _bwrap.plan(MachineSpec(image=str(root)), "m", "bwrap", rootfs)
        try:
            binds = {p.argv[i + 2]: p.paths[f"/proc/self/fd/{p.argv[i + 1]}"]
                     for i, arg in enumerate(p.argv) if arg == "--ro-bind-fd"}
            assert binds["/usr"] == f"{rootfs}/usr" and binds["/etc"] == f"{rootfs}/etc"
        finally:
            p.close()


def test_a_deeply_nested_image_record_is_a_bad_record_not_a_crash(
        cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Audit: an image's record ``NAME.json`` of ``"[" * 2000`` (a shared or copied cache) raised
    RecursionError, which `smolbench image list` and a build's suite check (catching ValueError) let
    through. Now it is bad JSON like any other: the image is listed by its folder's name."""
    from smolbench import cli

    root = _fake_rootfs(cache / "images" / "debian-bookworm")
    (cache / "images" / "debian-bookworm.json").write_text("[" * 2000)
    assert images._built_suite(root) is None
    assert [name for name, _path, _size in list_images()] == ["debian-bookworm"]
    assert cli.main(["image", "list"]) == 0
    assert "debian-bookworm" in capsys.readouterr().out


def test_an_archive_image_given_through_a_link_is_checked_where_it_really_is(tmp_path: Path) -> None:
    """Audit: ``_local`` checked an archive image given through a link by the link's own folder and
    lstat (a link's mode means nothing) while smol used the file it names: another user's 0666 archive,
    or one in a folder others can write in, passed. Now the path is resolved first and the real file
    and its folder are checked, and the real path is what smol gets (``smol_image`` resolved it before
    calling ``_local``; ``_local`` now does so itself)."""
    import tarfile

    from smolbench.backends.smol_image import _local

    shared = tmp_path / "shared"
    shared.mkdir()
    archive = shared / "img.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(_fake_rootfs(tmp_path / "rootfs"), arcname=".")
    mine = tmp_path / "mine"
    mine.mkdir()
    link = mine / "img.tar"
    link.symlink_to(archive)
    archive.chmod(0o666)  # as another user's world-writable file would be
    for call in (lambda: _local(link), lambda: _smol_image(str(link))):
        assert _refused(call) == (f"refusing the image {archive}: it is writable by group and others (mode 0666), "
                                  f"so another user could alter it; chmod go-w {archive}, or use a file of your own")
    archive.chmod(0o644)
    shared.chmod(0o777)  # a folder others can write in: they could swap the archive
    for call in (lambda: _local(link), lambda: _smol_image(str(link))):
        assert _refused(call).startswith(f"refusing the folder of the image img.tar {shared}: it is writable by ")
    shared.chmod(0o755)
    assert _local(link) == _smol_image(str(link)) == str(archive)  # the control: the real file is used
