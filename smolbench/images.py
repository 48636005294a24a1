"""The sandbox backend's cache of root filesystems (built with debootstrap).

An image *name* such as ``debian:bookworm`` lives in
``cache_dir()/images/debian-bookworm``; an image *path* (``/``, ``./``,
``../`` or ``~`` first) is a rootfs directory used as it is.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

from smolbench._pkgtrust import Held, Untrusted, open_dir, open_root, read_plain
from smolbench.errors import SmolbenchError
from smolbench.gate.frames import loads

DEFAULT_IMAGE = "debian:bookworm"
PATH_IMAGE = "image folder"  # what _pkgtrust's lines call a rootfs folder an image names by path
IMAGE_PACKAGES = ("python3", "python3-pip")  # pip: `pip install` in a machine works on an image too

_PATH_PREFIXES = ("/", "./", "../", "~")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")
_PYTHONS = ("usr/bin/python3", "bin/python3")



SUITE_RE = re.compile(r"[a-z][a-z0-9-]{1,30}")  # bookworm, trixie, stable, sid: never an option or a path

def home_path(text: str, what: str) -> Path:
    """``text`` as a path with ``~`` (or ``~user``) expanded; one line for a user there is none of."""
    try:
        return Path(text).expanduser()
    except RuntimeError:  # pathlib: "Could not determine home directory."
        user = text[1:].split("/", 1)[0]
        raise SmolbenchError(f"{what} {text!r}: no user {user!r} for {text.split('/', 1)[0]}: write the full path") from None

def is_path_image(image: str) -> bool:
    """True when ``image`` names a rootfs directory rather than an image name."""
    return image in (".", "..") or image.startswith(_PATH_PREFIXES)


def is_valid_image_name(name: str) -> bool:
    """True when ``name`` is a plausible image name (``debian:bookworm``, an OCI ref)."""
    return _NAME_RE.fullmatch(name) is not None


def has_python(rootfs: str | os.PathLike[str]) -> bool:
    """True when the directory ``rootfs`` contains ``usr/bin/python3`` or ``bin/python3``.

    Uses ``lexists`` because a rootfs's own symlinks may point at absolute
    paths that only make sense inside the machine.
    """
    root = Path(rootfs)
    return root.is_dir() and any(os.path.lexists(root / rel) for rel in _PYTHONS)


def cache_dir() -> Path:
    """The cache directory: ``$SMOLBENCH_CACHE``, else ``$XDG_CACHE_HOME/smolbench``, else
    ``~/.cache/smolbench`` (images, the Smolfile packages)."""
    env = os.environ.get("SMOLBENCH_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):  # the XDG spec: a relative value is ignored
        return Path(xdg) / "smolbench"
    return Path.home() / ".cache" / "smolbench"


def image_dir(name: str) -> Path:
    """Where the rootfs of image ``name`` lives (``debian:bookworm`` -> ``.../debian-bookworm``)."""
    if not is_valid_image_name(name):
        raise SmolbenchError(
            f"invalid image name {name!r}: use letters, digits and . _ : / @ + - "
            "(like 'debian:bookworm')"
        )
    return cache_dir() / "images" / name.replace(":", "-").replace("/", "-")


def _meta_path(dest: Path) -> Path:
    return dest.parent / f"{dest.name}.json"


def _read_meta(dest: Path) -> object:
    """The record of image ``dest`` (its ``NAME.json``), read without following a link or waiting (a fifo
    there hung the kernel), a plain file only; raises OSError, ValueError (too deep nesting too: "[" * 2000
    was a RecursionError that broke `smolbench image list`)."""
    return loads(read_plain(_meta_path(dest), 65536))


def _write_meta(dest: Path, meta: dict[str, str]) -> None:
    """The record of image ``dest``, written to a new file (O_EXCL|O_NOFOLLOW) renamed into place: a link
    planted at its name (or at the temporary one) is replaced, never written through (a build runs as root)."""
    path = _meta_path(dest)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{os.urandom(4).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(meta) + "\n")
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _built_suite(dest: Path) -> str | None:
    """The suite an image in the cache was built from, as its record says (None: unknown)."""
    try:
        meta = _read_meta(dest)
    except (OSError, ValueError):
        return None
    got = meta.get("suite") if isinstance(meta, dict) else None
    return got if isinstance(got, str) else None


def _suite_of(name: str) -> str | None:
    """The Debian suite an image name says (``debian:trixie`` -> ``trixie``), if it says one."""
    distro, sep, tag = name.partition(":")
    return tag if sep and distro == "debian" and SUITE_RE.fullmatch(tag) else None


def build_debian_rootfs(
    name: str = DEFAULT_IMAGE,
    suite: str | None = None,
    force: bool = False,
    log: Callable[[str], object] = print,
    mirror: str | None = None,
) -> Path:
    """Build a minimal Debian rootfs with python3 and pip into the cache; return its path.

    Runs ``debootstrap --variant=minbase --include=python3,python3-pip SUITE TMPDIR`` in a
    temporary directory next to the destination and renames it into place
    only when it succeeded, so a failed build leaves nothing half-made. An
    image already built is returned as is unless ``force`` (or a different ``suite`` was asked
    for: then one line says to add ``--force``). ``suite``: the one a ``debian:SUITE`` name says,
    else bookworm.
    """
    if suite is not None and not SUITE_RE.fullmatch(suite):
        raise SmolbenchError(f"--suite {suite!r} is not a Debian suite name: e.g. --suite bookworm")
    named = _suite_of(name)
    if suite is not None and named is not None and suite != named:
        raise SmolbenchError(f"image {name!r} names suite {named}, not --suite {suite}: drop --suite, or name the "
                             f"image debian:{suite}")
    suite = suite or named
    dest = image_dir(name)
    if has_python(dest) and not force:
        built = _built_suite(dest)
        if suite is not None and built is not None and built != suite:
            raise SmolbenchError(f"image {name!r} is built already, from suite {built}: add --force to build it "
                                 f"again from {suite}")
        log(f"image {name!r} already built at {dest}")
        return dest
    suite = suite or "bookworm"
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None:
        raise SmolbenchError(
            "debootstrap is not installed (or not on PATH): "
            "install it with: apt-get install debootstrap"
        )
    if os.geteuid() != 0:
        raise SmolbenchError(
            f"building image {name!r} with debootstrap needs root: run "
            f"`sudo env SMOLBENCH_CACHE={cache_dir()} smolbench image build {name}`"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    _sweep_builds(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.build-{os.getpid()}-", dir=dest.parent))
    try:
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:  # mkdtemp makes it 0700: the rootfs's "/" must be readable (by descriptor: never through a link)
            os.fchmod(fd, 0o755)
        finally:
            os.close(fd)
        cmd = [debootstrap, "--variant=minbase", f"--include={','.join(IMAGE_PACKAGES)}", suite, str(tmp)]
        if mirror:
            cmd.append(mirror)
        log(f"building image {name!r}: {' '.join(cmd)}")
        tail: deque[str] = deque(maxlen=20)
        # its own session: a stop (Ctrl-C, SIGTERM) ends debootstrap and what it started (dpkg,
        # chroots) as one group before the folder goes, where they ran on into a removed tree
        with subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            start_new_session=True,
        ) as proc:
            assert proc.stdout is not None
            try:
                for line in proc.stdout:
                    line = line.rstrip("\n")
                    if line.strip():
                        tail.append(line.strip())
                        log(line)
                code = proc.wait()
            except BaseException:
                _end_group(proc)
                raise
        if code != 0:
            last = tail[-1] if tail else "no output"
            raise SmolbenchError(
                f"debootstrap failed for image {name!r} (exit {code}): {last}; "
                "fix the problem above and run the build again"
            )
        if not has_python(tmp):
            raise SmolbenchError(
                f"debootstrap finished but image {name!r} has no usr/bin/python3 (does suite {suite!r} "
                "include python3?): check the suite and run `smolbench image build` again"
            )
        old: Path | None = None
        if dest.exists() or dest.is_symlink():
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
            os.rename(dest, old)
        os.rename(tmp, dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        _remove_build(tmp)
        raise
    meta = {"name": name, "suite": suite, "built": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    _write_meta(dest, meta)
    log(f"image {name!r} built at {dest}")
    return dest


STOP_WAIT = 10.0  # s a stopped debootstrap's group gets after SIGTERM before SIGKILL


def _end_group(proc: subprocess.Popen[str]) -> None:
    """End ``proc``'s process group (SIGTERM, then SIGKILL) and reap ``proc``."""
    for sig, wait in ((signal.SIGTERM, STOP_WAIT), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    deadline = time.monotonic() + STOP_WAIT  # the group's others (its leader is reaped already)
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(0.05)


def _mounts_under(path: Path) -> list[str]:
    """Mount points at or below ``path`` in this mount namespace, deepest first."""
    root = os.path.realpath(path)
    found = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
            if point == root or point.startswith(root + "/"):
                found.append(point)
    return sorted(found, key=lambda p: p.count("/"), reverse=True)


def _remove_build(tmp: Path) -> None:
    """A build folder, gone. What debootstrap mounted in it (``proc``, ``sys``, binds of the
    host's ``/dev``) is detached first: removing the tree must never reach into them. If a
    mount can't be detached the folder stays (it names itself ``.NAME.build-PID-...``).
    Only a real folder where its name says (held by an O_PATH descriptor, no link followed):
    anything else in its place (a planted link to a folder with mounts) is left alone."""
    try:
        fd = os.open(tmp, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return  # gone, or not a folder: nothing of ours
    try:
        held = f"/proc/self/fd/{fd}"
        real = os.readlink(held)
        if real != os.path.join(os.path.realpath(tmp.parent), tmp.name):
            return  # a folder above it was swapped meanwhile
        libc = ctypes.CDLL(None, use_errno=True)
        # through the held folder, and the mount point itself never followed (10: MNT_DETACH|UMOUNT_NOFOLLOW)
        stuck = [p for p in _mounts_under(Path(real))
                 if libc.umount2((held + p[len(real):]).encode(), 2 if p == real else 10) != 0]
        if not stuck:
            shutil.rmtree(tmp, ignore_errors=True)  # it refuses a link in the folder's place
    finally:
        os.close(fd)


def _sweep_builds(dest: Path) -> None:
    """Build folders of ``dest`` left by a build that was killed (its process is gone, or it
    predates the pid in the name): removed, their mounts detached first. Anything of that name
    that is not a real folder (a planted link) is skipped."""
    for old in dest.parent.glob(f".{dest.name}.build-*"):
        with contextlib.suppress(OSError):
            if not stat.S_ISDIR(os.lstat(old).st_mode):
                continue
        pid = old.name[len(f".{dest.name}.build-"):].split("-", 1)[0]
        if pid.isdigit() and pid != str(os.getpid()) and os.path.exists(f"/proc/{pid}"):
            continue  # another build of this image is running
        _remove_build(old)


def open_image(name: str) -> Held | None:
    """The built image ``name``'s folder, held (:class:`~smolbench._pkgtrust.Held`: an O_PATH descriptor,
    its ``path`` the checked folder itself), or None when it is not built. Checked as the packages cache
    is (:mod:`smolbench._pkgtrust`): the cache and every folder above it, ``images`` and the image
    folder are the user's own (or root's) and writable by nobody else, and ``images`` and the image are
    reached without following a link. Another user able to write there could plant a link to the host's
    ``/`` or a trojaned python3; refused in one line, with the fix."""
    dest = image_dir(name)
    if not os.path.lexists(dest):
        return None
    cache_fd = open_root(dest.parent.parent, what="image cache")
    try:
        where = dest.parent
        try:
            images_fd = open_dir(cache_fd, dest.parent.name, above=True)
            if images_fd is None:
                return None
            try:
                where = dest
                fd = open_dir(images_fd, dest.name)
            finally:
                os.close(images_fd)
        except Untrusted as exc:
            if where == dest:
                raise SmolbenchError(f"refusing the image {name!r} ({dest}): {exc}, so another user could have "
                                     f"planted or altered it; remove it (rm -rf {dest}) and run `smolbench image "
                                     f"build {name}`, or set $SMOLBENCH_CACHE to a folder of your own") from None
            raise SmolbenchError(f"refusing the image cache {where}: {exc}, so another user could plant or swap its "
                                 f"images; remove it (rm -rf {where}) and build them again, or set $SMOLBENCH_CACHE "
                                 "to a folder of your own") from None
    finally:
        os.close(cache_fd)
    return None if fd is None else Held(fd)


@contextlib.contextmanager
def held_rootfs(image: str | None) -> Iterator[Path | None]:
    """The root filesystem directory for ``image`` on the sandbox backend, for the ``with`` block.

    ``None`` means the host's own root (yields ``None``); a path is a rootfs directory used as it
    is; a name must have been built into the cache, and is the checked folder itself
    (``/proc/self/fd/N``, :func:`open_image`) until the block ends: bind it, or read it, there.
    """
    if image is None:
        yield None
        return
    if is_path_image(image):
        path = home_path(image, "the image").resolve()
        if not path.is_dir():
            raise SmolbenchError(
                f"rootfs directory {str(path)!r} does not exist: create it or fix the image path"
            )
        if not has_python(path):
            raise SmolbenchError(
                f"rootfs directory {str(path)!r} has no usr/bin/python3: "
                "install python3 in it or use a built image like 'debian:bookworm'"
            )
        # trusted as the cache is, and bound by the descriptor checked (a swap after this binds nothing else)
        rootfs = Held(open_root(path, what=PATH_IMAGE))
        try:
            yield Path(rootfs.path)
        finally:
            rootfs.close()
        return
    held = open_image(image)
    try:
        if held is not None and has_python(held.path):
            yield Path(held.path)
            return
    finally:
        if held is not None:
            held.close()
    if image.startswith("debian:"):
        raise SmolbenchError(f"image {image!r} is not built: run `smolbench image build {image}`")
    raise SmolbenchError(
        f"image {image!r} is not built: the sandbox backend only builds Debian images "
        f"(run `smolbench image build {DEFAULT_IMAGE}`); OCI images need the smol backend"
    )


def resolve_rootfs(image: str | None) -> Path | None:
    """The root filesystem directory for ``image`` on the sandbox backend, by its name (for messages
    and checks: a machine binds :func:`held_rootfs`'s). ``None`` means the host's own root."""
    with held_rootfs(image) as path:
        if path is None or image is None:
            return path
        return home_path(image, "the image").resolve() if is_path_image(image) else image_dir(image)


def _tree_size(root: Path) -> int:
    total = 0
    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(root, onerror=lambda _err: None):
        for entry in (*dirnames, *filenames):
            try:
                st = os.lstat(os.path.join(dirpath, entry))
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if key in seen:
                continue
            seen.add(key)
            total += st.st_size
    return total


def list_images() -> list[tuple[str, Path, int]]:
    """The images in the cache as ``(name, path, size in bytes)``, sorted by name."""
    root = cache_dir() / "images"
    if not root.is_dir():
        return []
    images: list[tuple[str, Path, int]] = []
    for path in sorted(root.iterdir()):
        if path.name.startswith(".") or path.is_symlink() or not path.is_dir():
            continue
        name = path.name
        try:
            meta = _read_meta(path)
            if isinstance(meta, dict) and isinstance(meta.get("name"), str):
                name = meta["name"]
        except (OSError, ValueError):
            pass
        images.append((name, path, _tree_size(path)))
    images.sort(key=lambda item: item[0])
    return images
