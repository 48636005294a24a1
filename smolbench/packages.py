"""A Smolfile's ``packages``: installed by pip on the host, once per list and guest Python.

The host runs ``pip install --target`` into a content-addressed cache outside every machine
(``cache_dir()/packages/KEY``, KEY covering the requirement list, the guest's Python and its
platform, where pip finds packages (:func:`pip_sources`) and pip's own version) and the backends mount the result
read-only into every machine of that baseline, so machines need no network for them. pip only
ever sees the requirement strings of the user's own Smolfile, never anything a machine made; and
it installs wheels only
(``--only-binary=:all:``), so no package's ``setup.py`` runs on the host. Installs are atomic
(a temporary folder renamed into place) and safe to run from several kernels at once (a lock
file per key). An entry is used only when it and the cache folder are the user's own and nobody
else can write them (:func:`trusted`): another user of a shared cache could plant or alter one.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import fcntl
import hashlib
import json
import os
import platform
import re
import select
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from packaging.requirements import InvalidRequirement, Requirement

from . import _pipbounds
from ._aio import _stoppable_thread
from ._pkgtrust import LIB, META, Held, _close_fds, _complete, _open_entry, open_root, read_plain
from ._pkgwheels import private_copies, wheel_hashes, wheel_path
from .backends._rundir import remove_tree
from .errors import SmolbenchError
from .gate.frames import loads
from .gate.terminal import one_line, plain
from .images import cache_dir

PIP_TIMEOUT = 1800.0  # seconds one install may take
OUTPUT_TAIL = 64 << 10  # bytes of a host child's output kept (its last): pip's error lines fit
WHEELS = ".wheels"  # in an install's temporary folder: the private copies of the wheels it names here
PIP_TMP = ".tmp"  # there too: pip's own temporary files ($TMPDIR), measured with the install
_PY_DIR_RE = re.compile(r"python(3)\.(\d+)")
_GLIBC_RE = re.compile(rb"GLIBC_2\.(\d+)")
_PINNED = re.compile(r"(?:^|&)sha256=[0-9a-f]{64}(?:&|$)")  # a URL's fragment pinning its file, as pip reads it
_MAX_LIBC_READ = 16 << 20
# Where "installing N packages ..." goes before pip runs (the Workbench's notices, set for its up):
# a first install takes seconds to minutes, and the up said nothing meanwhile.
ON_INSTALL: contextvars.ContextVar[Callable[[str], None] | None] = contextvars.ContextVar("smolbench_on_install",
                                                                                         default=None)


def requirement_problem(text: str) -> str | None:
    """Why ``text`` is not a pip requirement string (PEP 508), or None."""
    if not text.strip():
        return "is empty; remove it"
    if text.lstrip().startswith("-"):
        return "is a pip option, not a requirement; write a name like \"gymnasium==1.0.0\""
    if not text.isprintable():  # escapes a terminal would act on where it is shown (packages list, notices)
        return "holds a control or other non-printable character; write it in plain printable text"
    try:
        req = Requirement(text)
    except InvalidRequirement as exc:
        first = str(exc).splitlines()[0] if str(exc) else "invalid"
        return f"is not a requirement ({first}); write a name with an optional version, like \"gymnasium==1.0.0\""
    if req.url and not urllib.parse.unquote(req.url).isprintable():  # %00: a path no file can have (open raises)
        return ("holds an escaped control character in its URL (like %00 or %0a), which no wheel's path or name has; "
                "write the wheel's URL without it")
    if req.url and not urllib.parse.urlsplit(req.url).path.endswith(".whl"):
        # pip builds a URL's source (runs its setup.py) even with --only-binary=:all:
        return ("points at a source archive or folder, which pip would build on the host by running its code; "
                "point it at a .whl file, or name a package of the index")
    if req.url and wheel_path(text) is None and not _PINNED.search(urllib.parse.urlsplit(req.url).fragment):
        # the cache key holds the requirement's text: unpinned, a wheel changed at its URL (or
        # another server answering for it) was never installed, or went in under the old key
        return ("names a wheel by URL without its hash, so what the URL serves could change under one cache entry; "
                "pin it as pip does: add #sha256=HASH to the URL (HASH: `sha256sum` of the wheel), "
                "or name a package of the index")
    return None


@dataclass(frozen=True)
class GuestPython:
    """The Python a machine runs, as far as wheels care: version, ABI and platform."""

    major: int
    minor: int
    machine: str  # x86_64, aarch64
    glibc: tuple[int, int] | None  # None: not known (manylinux wheels up to 2.17 then)
    native: bool  # it is this kernel's own interpreter: pip installs for it as it is

    @property
    def tag(self) -> str:
        libc = f"glibc{self.glibc[0]}.{self.glibc[1]}" if self.glibc else "glibc?"
        return f"cp{self.major}{self.minor}-{self.machine}-{libc}"

    def platforms(self) -> list[str]:
        """The manylinux platform tags this guest accepts, newest first."""
        top = self.glibc[1] if self.glibc and self.glibc[0] == 2 else 17
        tags = [f"manylinux_2_{n}_{self.machine}" for n in range(max(top, 17), 4, -1)]
        return tags + [f"manylinux2014_{self.machine}", f"manylinux2010_{self.machine}",
                       f"manylinux1_{self.machine}", f"linux_{self.machine}"]

    def pip_target_args(self) -> list[str]:
        """pip options that install for this guest from a different interpreter (wheels only)."""
        if self.native:
            return []
        args = ["--python-version", f"{self.major}.{self.minor}", "--implementation", "cp",
                "--abi", f"cp{self.major}{self.minor}", "--abi", "abi3", "--abi", "none"]
        for plat in self.platforms():
            args += ["--platform", plat]
        return args


def host_python() -> GuestPython:
    """This kernel's own interpreter (the sandbox and process backends without an image)."""
    name, version = platform.libc_ver()
    parts = re.match(r"(\d+)\.(\d+)", version) if name == "glibc" else None
    glibc = (int(parts.group(1)), int(parts.group(2))) if parts else None
    return GuestPython(sys.version_info[0], sys.version_info[1], os.uname().machine, glibc, native=True)


def rootfs_python(rootfs: str | os.PathLike[str]) -> GuestPython:
    """The Python of a rootfs image, read from its files (nothing of the image runs here)."""
    root = Path(rootfs)
    found: list[tuple[int, int]] = []
    for lib in ("usr/lib", "usr/local/lib"):
        with contextlib.suppress(OSError):
            for entry in os.listdir(root / lib):
                match = _PY_DIR_RE.fullmatch(entry)
                if match and (root / lib / entry / "os.py").is_file():
                    found.append((int(match.group(1)), int(match.group(2))))
    if not found:
        raise SmolbenchError(f"can't tell which Python the image {str(root)!r} has (no usr/lib/python3.N/os.py): "
                             "install python3 in it, or remove 'packages' from the Smolfile")
    major, minor = max(found)
    return GuestPython(major, minor, os.uname().machine, _rootfs_glibc(root), native=False)


def _rootfs_glibc(root: Path) -> tuple[int, int] | None:
    for rel in ("usr/lib/x86_64-linux-gnu/libc.so.6", "lib/x86_64-linux-gnu/libc.so.6",
                "usr/lib/aarch64-linux-gnu/libc.so.6", "lib/aarch64-linux-gnu/libc.so.6", "usr/lib64/libc.so.6"):
        path = root / rel
        with contextlib.suppress(OSError):
            real = Path(os.path.realpath(path))
            if not str(real).startswith(str(root.resolve()) + "/") or not real.is_file():
                continue  # a link that leaves the image says nothing about it
            data = read_plain(real, _MAX_LIBC_READ)  # a rootfs's: never a fifo planted after is_file
            minors = [int(m) for m in _GLIBC_RE.findall(data)]
            if minors:
                return (2, max(minors))
    return None


def version_python(version: str, glibc: tuple[int, int] | None = None) -> GuestPython:
    """A guest Python known only by its version (a registry image like ``python:3.12-slim``)."""
    major, minor = (int(x) for x in version.split(".")[:2])
    return GuestPython(major, minor, os.uname().machine, glibc, native=False)


def key(requirements: tuple[str, ...], guest: GuestPython, sources: tuple[str, ...], pip: str | None = None,
        wheels: dict[str, str] | None = None) -> str:
    """The cache key: the requirement list (as written, in order), the guest's Python and platform,
    ``sources``, where pip looks for them (:func:`pip_sources`), the version of the pip that
    installs (``pip``; :func:`pip_version` when None): another pip may resolve the list otherwise,
    and the content of the wheels it names on this host (``wheels``: :func:`wheel_hashes`'s)."""
    fields = {"requirements": list(requirements), "python": guest.tag, "native": guest.native,
              "sources": list(sources), "pip": pip_version() if pip is None else pip}
    if wheels:  # (only then: the keys of lists without them stay as they were)
        fields["wheels"] = sorted(wheels.items())
    data = json.dumps(fields, sort_keys=True)
    return hashlib.sha256(data.encode()).hexdigest()[:24]


_PIP_VERSION = "import pip; print(pip.__version__); print(pip.__file__)"
_PIP_MEMO: tuple[str, tuple[object, ...], str] | None = None  # pip's __init__.py, its stamp, its version


def pip_version() -> str:
    """The version of the pip that installs (``python -I -m pip``'s), asked of it once and kept
    while the interpreter and pip's files (its ``__init__.py`` and the folder it is installed in,
    which an upgrade rewrites) are unchanged: a stat or two per call."""
    global _PIP_MEMO
    memo = _PIP_MEMO
    if memo is not None and _pip_stamp(memo[0]) == memo[1]:
        return memo[2]
    try:
        done = subprocess.run([sys.executable, "-I", "-c", _PIP_VERSION], env=_pip_env(), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, errors="replace", timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SmolbenchError(f"can't ask the host's pip its version ({exc}): check that {sys.executable} has pip") from None
    lines = done.stdout.split("\n")
    if done.returncode != 0 or len(lines) < 2:
        raise SmolbenchError(f"the host's Python ({sys.executable}) has no pip to install the Smolfile's packages "
                             f"with: `{sys.executable} -m ensurepip`, or remove 'packages' from the Smolfile")
    _PIP_MEMO = (lines[1], _pip_stamp(lines[1]), lines[0].strip())
    return lines[0].strip()


def _pip_stamp(init: str) -> tuple[object, ...]:
    return (sys.executable, *_stats([init, os.path.dirname(os.path.dirname(init))]))


def _stats(paths: list[str]) -> list[tuple[object, ...]]:
    """Each path with what changes when its file is rewritten (None: not there), to compare later."""
    stats: list[tuple[object, ...]] = []
    for path in paths:
        try:
            st = os.stat(path)
            stats.append((path, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        except OSError:
            stats.append((path, None))
    return stats


# pip's options that decide which distributions an install resolves to (not how it connects: cert,
# proxy, timeout, retries). The same requirements from another index are other packages: a private
# mirror's patched build is not PyPI's.
_SOURCE_OPTIONS = frozenset({
    "index-url", "extra-index-url", "find-links", "no-index", "constraint", "pre", "only-binary", "no-binary",
    "prefer-binary", "no-deps", "ignore-requires-python", "use-feature", "use-deprecated", "platform",
    "python-version", "implementation", "abi"})
_SOURCE_SECTIONS = frozenset({"global", "install", ":env:"})  # what `pip install` reads
_CONFIG_LINE = re.compile(r"(?P<section>[^.=\s]*)\.(?P<name>[a-z0-9_-]+)=(?P<value>'.*'|\".*\")")
_USERINFO = re.compile(r"(?<=://)[^/@\s]*@")  # user:token@ in a URL


def redact(text: str) -> str:
    """``text`` without the ``user:password@`` of any URL in it (an index URL may carry a token)."""
    return _USERINFO.sub("", text)


def _pip_env() -> dict[str, str]:
    """The environment of the host's pip: the kernel's own, without what would install elsewhere."""
    env = dict(os.environ)
    env.pop("PIP_TARGET", None)
    env.pop("PYTHONPATH", None)
    return env


def pip_sources() -> tuple[str, ...]:
    """Where the host's pip would find packages: the options of :data:`_SOURCE_OPTIONS` that its
    configuration sets, every pip.conf (PIP_CONFIG_FILE, site, user, venv) and PIP_* variable alike,
    as ``section.name=value`` (sorted), each URL without its ``user:password@``; and a constraint
    file's content (its hash). Asked of pip itself (``pip config list``, the pip that installs):
    only pip knows every file it reads in every version. That costs ~0.2 s, so the answer is kept
    while the variables and the files pip said it reads (``pip config debug``) are unchanged: the
    machines of one up ask once."""
    global _SOURCES_MEMO
    memo = _SOURCES_MEMO
    if memo is not None and _fingerprint(memo[0]) == memo[1]:
        return memo[2]
    files = [m["path"] for m in map(_FILE_LINE.fullmatch, _pip_config("debug").splitlines()) if m]
    seen = _fingerprint(files)  # before the values are read: a change meanwhile is read again next time
    found: set[str] = set()
    for line in _pip_config("list").splitlines():
        match = _CONFIG_LINE.fullmatch(line.strip())
        if not match or match["section"] not in _SOURCE_SECTIONS or match["name"] not in _SOURCE_OPTIONS:
            continue
        value = redact(str(ast.literal_eval(match["value"])))
        found.add(f"{match['section']}.{match['name']}={value}")
        if match["name"] == "constraint":  # its lines decide versions as the requirements do
            for item in value.split():
                path = item.removeprefix("file://")
                seen += _fingerprint([path])[2:]
                with contextlib.suppress(OSError):
                    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
                    found.add(f"constraint-file={item} sha256:{digest}")
                files.append(path)
    sources = tuple(sorted(found))
    _SOURCES_MEMO = (files, seen, sources)
    return sources


_FILE_LINE = re.compile(r"\s+(?P<path>/.*), exists: (?:True|False)")  # a file `pip config debug` reads
_MEMO_ENV = ("HOME", "XDG_CONFIG_HOME", "XDG_CONFIG_DIRS", "VIRTUAL_ENV")  # they move pip's files
_SOURCES_MEMO: tuple[list[str], tuple[object, ...], tuple[str, ...]] | None = None


def _fingerprint(files: list[str]) -> tuple[object, ...]:
    """What :func:`pip_sources` depends on, cheaply: the interpreter, pip's variables, its files' stats."""
    env = tuple(sorted((k, v) for k, v in _pip_env().items() if k.startswith("PIP_") or k in _MEMO_ENV))
    return (sys.executable, env, *_stats(files))


def _pip_config(action: str) -> str:
    """``pip config ACTION``'s output, from the pip that installs, in its environment."""
    cmd = [sys.executable, "-I", "-m", "pip", "config", action]
    try:
        done = subprocess.run(cmd, env=_pip_env(), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              errors="replace", timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SmolbenchError(f"can't read pip's configuration (pip config {action}: {exc}): the host's pip decides "
                             f"where the Smolfile's packages come from; check that {sys.executable} has pip") from None
    if done.returncode != 0:
        last = (plain(done.stderr).strip().splitlines() or ["no output"])[-1]
        raise SmolbenchError(f"can't read pip's configuration (pip config {action}: {redact(last)[:300]}): fix the "
                             "pip.conf or PIP_* variable it names; it decides where the Smolfile's packages come from")
    return done.stdout


def shown_sources(sources: tuple[str, ...]) -> list[str]:
    """``sources`` as packages.json keeps them: an http(s) URL as scheme://host only (a path may carry a token)."""
    def shown(item: str) -> str:
        parts = urllib.parse.urlsplit(item)
        return f"{parts.scheme}://{parts.hostname or ''}" if parts.scheme in ("http", "https") else item

    said = []
    for line in sources:
        name, _, value = line.partition("=")
        said.append(f"{name}={' '.join(shown(v) for v in value.split())}")
    return said


@dataclass(frozen=True)
class Installed:
    """A cache entry: ``lib`` goes on the guest's sys.path."""

    lib: Path
    cached: bool
    seconds: float  # this call's install time (0 when cached)
    count: int  # distributions in it
    held: Held | None = field(default=None, compare=False, repr=False)

    @property
    def mount(self) -> str:
        """What a backend binding from this process mounts: the checked folder itself (:class:`Held`)."""
        return self.held.path if self.held is not None else str(self.lib)

    def close(self) -> None:
        """The machine using it is gone: prune may take the entry again."""
        if self.held is not None:
            self.held.close()

    def line(self, requirements: tuple[str, ...]) -> str:
        """What ``up`` says about it (one line)."""
        what = (f"{len(requirements)} requirement{'s' if len(requirements) != 1 else ''}, "
                f"{self.count} distribution{'s' if self.count != 1 else ''}")
        if self.cached:
            return f"packages: cached ({what}; {self.lib.parent})"
        return f"packages: installed in {self.seconds:.1f} s ({what}; cached in {self.lib.parent}, reused by later ups)"


def packages_root() -> Path:
    """Where installed package lists live (one folder per key)."""
    return cache_dir() / "packages"


async def install(requirements: tuple[str, ...], guest: GuestPython) -> Installed:
    """:func:`ensure` off the loop. Stopped (a Ctrl-C during ``%smol up``), its pip is killed and
    the thread waited for: left on, it installed on for up to PIP_TIMEOUT after the stop, holding
    the key's lock (the next up of the list waited for it, and so did the kernel's exit)."""
    return await _stoppable_thread(ensure, requirements, guest)


def ensure(requirements: tuple[str, ...], guest: GuestPython, log: list[str] | None = None,
           stop: threading.Event | None = None) -> Installed:
    """The installed tree for ``requirements`` on ``guest``: from the cache, else pip installs it now
    (``stop`` set meanwhile: pip is killed, nothing is kept, and SmolbenchError says so). It comes
    held (:class:`Held`): checked through file descriptors, and kept from prune until closed."""
    for text in requirements:  # a list the parser did not check (an unpinned URL: no key covers its content)
        if (problem := requirement_problem(text)) is not None:
            raise SmolbenchError(f"Smolfile packages entry {text!r} {problem}")
    root = packages_root()
    sources, pip, wheels = pip_sources(), pip_version(), wheel_hashes(requirements)
    digest = key(requirements, guest, sources, pip, wheels)
    if not root.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o755)  # the sandbox uid reads it; and not group-writable under a umask of 002
    root_fd = open_root(root)  # another user able to write in it could swap the install while pip runs
    lock = -1
    try:
        lock = os.open(f".{digest}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=root_fd)
        took: float | None = None
        while True:
            _lock(lock, stop, fcntl.LOCK_SH)  # shared with other machines; an install or a prune waits
            found = _open_entry(root_fd, root / digest)
            if found is not None:
                entry_fd, lib_fd = found
                with contextlib.suppress(OSError):  # its last use, for `smolbench packages prune`
                    os.utime(META, dir_fd=entry_fd, follow_symlinks=False)
                os.close(entry_fd)
                held, lock = Held(lib_fd, lock), -1
                return Installed(root / digest / LIB, took is None, took or 0.0, _count(Path(held.path)), held)
            fcntl.flock(lock, fcntl.LOCK_UN)
            _lock(lock, stop)  # another kernel installing the same list: wait for it, then reuse
            if not _complete(root_fd, digest):
                took = _install(requirements, guest, root, root_fd, digest, sources, pip, wheels, log, stop)
    finally:
        if lock >= 0:
            os.close(lock)
        os.close(root_fd)


def _install(requirements: tuple[str, ...], guest: GuestPython, root: Path, root_fd: int, digest: str,
             sources: tuple[str, ...], pip: str, wheels: dict[str, str], log: list[str] | None,
             stop: threading.Event | None) -> float:
    """pip installs into a temporary folder, renamed into place whole (the key's lock held); its seconds."""
    tell = ON_INSTALL.get()
    if tell is not None:
        tell(f"smolbench: installing {len(requirements)} package{'s' if len(requirements) != 1 else ''} from the "
             "Smolfile (first time only; cached after) …")
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{digest}.tmp-", dir=root))
    try:
        copies = private_copies(requirements, wheels, tmp / WHEELS)
        _pipbounds.check_wheels([(text, path) for text, copy in zip(requirements, copies)
                                 if (path := wheel_path(copy)) is not None and wheel_path(text) is not None],
                                _pipbounds.disk_limit())
        _pip(copies, guest, tmp / LIB, log, stop)
        _remove(tmp / WHEELS)
        _readable(tmp)
        took = time.monotonic() - started
        meta = {"requirements": list(requirements), "python": guest.tag, "pip": pip, "seconds": round(took, 2),
                "installed": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "sources": shown_sources(sources)}
        (tmp / META).write_text(json.dumps(meta) + "\n")
        if (root / digest).exists():  # a half-made entry of an older version: replaced whole
            remove_tree(root_fd, digest)
        os.rename(tmp.name, digest, src_dir_fd=root_fd, dst_dir_fd=root_fd)
    except BaseException:
        remove_tree(root_fd, tmp.name)  # however deep a wheel made it (shutil.rmtree's recursion failed)
        raise
    return took


@dataclass(frozen=True)
class Entry:
    """A cache entry as ``smolbench packages list`` shows it."""

    path: Path
    size: int  # bytes
    used: float  # when an up last used it (packages.json's mtime)
    meta: dict[str, object]  # its packages.json ({} when refused: a planted file's text is not shown)
    refused: str | None  # why an up would refuse it (:func:`trusted`), or None


def entries() -> list[Entry]:
    """The cache's complete entries, least recently used first."""
    root = packages_root()
    if not root.is_dir():
        return []
    root_fd = open_root(root)
    try:
        found = []
        for name in os.listdir(root):
            path = root / name
            if name.startswith(".") or not _complete(root_fd, name):
                continue  # a lock, an install under way or left by a killed one (prune takes those)
            refused: str | None = None
            try:
                _close_fds(_open_entry(root_fd, path) or ())
                meta = loads(read_plain(f"{name}/{META}", 1 << 20, dir_fd=root_fd))  # no fifo, no RecursionError
            except (SmolbenchError, OSError, ValueError) as exc:
                refused, meta = str(exc), {}
            found.append(Entry(path, _size(path), os.stat(path / META).st_mtime, meta if isinstance(meta, dict) else {},
                               refused))
    finally:
        os.close(root_fd)
    return sorted(found, key=lambda e: e.used)


def prune(days: float, dry_run: bool = False) -> tuple[list[tuple[Path, int]], list[Path]]:
    """Remove the entries no up used in ``days`` days, and folders a killed install left: the
    removed (or, ``dry_run``, removable) folders and their sizes, and the entries kept because a
    running machine holds them (:class:`Held`). One whose install or prune runs elsewhere is left."""
    root = packages_root()
    if not root.is_dir():
        return [], []
    os.close(open_root(root))
    cutoff = time.time() - days * 86400
    removed, in_use = [], []
    for name in sorted(os.listdir(root)):
        path = root / name
        if name.startswith("."):
            if ".tmp-" not in name and ".prune-" not in name:
                continue  # a lock file: kept (a kernel may hold it)
            digest = name[1:].split(".", 1)[0]
        else:
            digest = name
            with contextlib.suppress(OSError):
                if os.stat(path / META).st_mtime >= cutoff:
                    continue
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue  # not a folder of the user's to remove
        try:  # the key's lock, never through a link planted at its name (nor a fifo's open waited on)
            lock_fd = os.open(root / f".{digest}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK |
                              os.O_CLOEXEC, 0o644)
        except OSError:
            continue
        if not stat.S_ISREG(os.fstat(lock_fd).st_mode):
            os.close(lock_fd)
            continue
        with os.fdopen(lock_fd, "a+") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not name.startswith(".") and _only_shared(lock):
                    in_use.append(path)  # else installing (a temporary folder in use) or another prune
                continue
            if not path.exists():
                continue
            size = _size(path)
            if not dry_run:
                gone = path if ".prune-" in name else root / f".{digest}.prune-{os.getpid()}"
                os.rename(path, gone)  # out of ensure's sight at once, then removed
                _remove(gone)
            removed.append((path, size))
    return removed, in_use


def _only_shared(lock: IO[str]) -> bool:
    """Whether the key's lock is held shared only: machines running on its entry."""
    try:
        fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(lock, fcntl.LOCK_UN)
    return True


def _size(tree: Path) -> int:
    """What ``tree`` takes on disk (:func:`_pipbounds.tree_size`: no recursion, however deep a leftover is)."""
    return _pipbounds.tree_size(tree).size


def _remove(tree: Path) -> None:
    """Remove ``tree`` (an install's own folder) without recursion or following a link: :func:`remove_tree`."""
    with contextlib.suppress(OSError):
        parent = os.open(tree.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            remove_tree(parent, tree.name)
        finally:
            os.close(parent)


# pip's --only-binary=:all: does not hold for a URL a wheel's own metadata names (Requires-Dist:
# evil @ https://.../evil.tar.gz, from a wheel or an index the user trusted too far): pip builds
# it, running its setup.py here. A wheel-only install runs no program at all, so pip runs with
# an audit hook (PEP 578) that refuses to start one: a build fails, in one line, before it runs.
NO_PROGRAMS = "smolbench: pip on the host starts no program"
PIP_GUARD = f"""
import os, resource, runpy, sys
caps = os.environ.pop("{_pipbounds.CAPS_ENV}", "").split()
if caps:  # its memory and the size of any file it writes (_pipbounds), before pip is imported
    resource.setrlimit(resource.RLIMIT_AS, (int(caps[0]), int(caps[0])))
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(caps[1]), int(caps[1])))
def refuse(event, args):
    if event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty"):
        raise PermissionError("{NO_PROGRAMS} (it was about to run " + repr(args)[:300] + ")")
sys.addaudithook(refuse)
sys.argv[0] = "pip"
runpy.run_module("pip", run_name="__main__", alter_sys=True)
"""


def _lock(lock: int, stop: threading.Event | None, how: int = fcntl.LOCK_EX) -> None:
    """Take the key's lock (``how``), waiting for the kernel that holds it; ``stop`` set meanwhile: stop waiting."""
    if stop is None:
        fcntl.flock(lock, how)
        return
    while True:
        try:
            fcntl.flock(lock, how | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if stop.wait(0.1):
                raise SmolbenchError("the install of the Smolfile's packages was stopped") from None


def pip_command(requirements: tuple[str, ...], guest: GuestPython, target: Path) -> list[str]:
    """The host's pip call: wheels only, into ``target``, never asking anything, starting no
    program (:data:`PIP_GUARD`), isolated (``-I``: nothing imported from the folder it runs in),
    compiling nothing (:func:`_compile` does, bounded)."""
    return [sys.executable, "-I", "-c", PIP_GUARD, "install", "--target", str(target), "--only-binary=:all:",
            "--no-input", "--disable-pip-version-check", "--no-warn-script-location", "--quiet", "--no-compile",
            *guest.pip_target_args(), "--", *requirements]


def _pip(requirements: tuple[str, ...], guest: GuestPython, target: Path, log: list[str] | None,
         stop: threading.Event | None = None) -> None:
    """pip installs ``requirements`` into ``target``, then their bytecode is made (:func:`_compile`):
    both within :data:`PIP_TIMEOUT` and the memory and disk caps of :mod:`._pipbounds`."""
    for text in requirements:  # the parser checked them; this is the last line before pip
        problem = requirement_problem(text)
        if problem:
            raise SmolbenchError(f"Smolfile packages entry {text!r} {problem}")
    folder = target.parent
    (folder / PIP_TMP).mkdir(mode=0o700, exist_ok=True)
    # pip unpacks into a temporary folder before it moves the files into --target: that one is
    # inside the install's folder too, so its size is measured (and a kill leaves nothing elsewhere)
    env = {**_pip_env(), **_pipbounds.caps_env(), "TMPDIR": str(folder / PIP_TMP)}
    watch = _pipbounds.DiskWatch(folder, (WHEELS,), _pipbounds.disk_limit())
    deadline = time.monotonic() + PIP_TIMEOUT
    code, output = _run(pip_command(requirements, guest, target), folder, env, stop, deadline, watch)
    # pip's own lines, without the colours it adds in a kernel (FORCE_COLOR): the error is one plain line
    tail = deque((ln.strip() for ln in plain(output).splitlines() if ln.strip()), maxlen=40)
    if log is not None:
        log.extend(tail)
    if code != 0 and any("[Errno 27]" in ln or "File too large" in ln for ln in tail):  # RLIMIT_FSIZE
        raise watch.refusal(watch.check(final=True) or "one of its files grew past that")
    if code != 0 and any(NO_PROGRAMS in ln for ln in tail):
        raise SmolbenchError("pip could not install the Smolfile's packages: a package asked pip to build a source "
                             "archive (a dependency it names by URL), which would run that archive's code on the host; "
                             "smolbench installs wheels only: pick versions whose dependencies are wheels, or pip "
                             "install it inside a machine")
    if code != 0:
        raise SmolbenchError(pip_failure(list(tail), requirements, guest))
    _remove(folder / PIP_TMP)
    # what landed, whatever the wheels' directories said: before the compile walks it too (its walk
    # of a tree too deep to measure failed less clearly), and after
    over = watch.check(final=True)
    if over is None and (guest.major, guest.minor) == sys.version_info[:2]:  # a .pyc of another version is never read
        _compile(target, env, stop, deadline, watch)
        over = watch.check(final=True)
    if over is not None:
        raise watch.refusal(over)


def _compile(lib: Path, env: dict[str, str], stop: threading.Event | None, deadline: float,
             watch: _pipbounds.DiskWatch) -> None:
    """The bytecode pip would have made, made by a child under the same caps (machines import
    from a read-only mount, where no ``.pyc`` can be written later); one line naming a module
    that needs more memory than the cap to compile."""
    code, output = _run([sys.executable, "-I", "-W", "ignore", "-c", _pipbounds.COMPILE, str(lib)], lib.parent, env,
                        stop, deadline, watch)
    if code == 3 and _pipbounds.COMPILE_MEMORY in output:
        raise SmolbenchError(_pipbounds.compile_refusal(output, _pipbounds.memory_cap(), lib))
    if code != 0:
        last = one_line((plain(output).strip().splitlines() or [f"exit status {code}"])[-1], 300)
        raise SmolbenchError(f"compiling the Smolfile's packages to bytecode on the host failed ({last}); nothing was "
                             "kept: remove the package it names from the Smolfile")


def _run(cmd: list[str], cwd: Path, env: dict[str, str], stop: threading.Event | None, deadline: float,
         watch: _pipbounds.DiskWatch) -> tuple[int, str]:
    """``cmd``'s exit status and the last :data:`OUTPUT_TAIL` bytes of its output (stdout and
    stderr together: a package's files can make a child print without end, and the whole was
    kept here, 490 MiB of the host's for a 749-byte wheel); killed (its process group: its own
    children go with it) when ``stop`` is set, ``deadline`` passes or ``watch`` finds the install
    over its disk limit."""
    tail = bytearray()
    with subprocess.Popen(cmd, stdin=subprocess.DEVNULL, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          env=env, start_new_session=True) as proc:
        assert proc.stdout is not None
        fd, reading = proc.stdout.fileno(), True
        while True:
            wait = max(0.0, min(0.1, deadline - time.monotonic()))
            if reading and select.select([fd], [], [], wait)[0]:
                chunk = os.read(fd, 1 << 16)
                reading = bool(chunk)
                tail += chunk
                del tail[:-OUTPUT_TAIL]  # a fixed window: never more than this of any child's output
            elif not reading:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(wait)
            if not reading and proc.poll() is not None:
                return proc.returncode, tail.decode(errors="replace").replace("\r\n", "\n")
            stopped = stop is not None and stop.is_set()
            over = None if stopped else watch.check()
            if not stopped and over is None and time.monotonic() < deadline:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if stopped:
                raise SmolbenchError("the install of the Smolfile's packages was stopped") from None
            if over is not None:
                raise watch.refusal(over) from None
            raise SmolbenchError(f"pip did not install the Smolfile's packages within {PIP_TIMEOUT:.0f} s: "
                                 "check the host's network to the package index, or shorten the list") from None


# pip's lines when it could not reach the index: retries of a connection (a proxy, DNS, a refused or
# timed-out connect). Its last ERROR then reads "No matching distribution", as of a name the index lacks.
_NETWORK = re.compile(r"Retrying \(Retry\(.*(?:ProxyError|ConnectionError|NewConnectionError|ConnectTimeout"
                      r"|ReadTimeout|Max retries|Failed to establish|Name or service not known|name resolution)")
_CONFLICT = re.compile(r"ERROR: Cannot install .* because these package versions have conflicting dependencies")
_NOT_FOUND = re.compile(r"No matching distribution found for (?P<req>\S+)(?: \(from (?P<by>[^)]*)\))?")
# pip before 23.1 names who needs it on the line before only
_NO_VERSION = re.compile(r"satisfies the requirement (?P<req>\S+) \(from (?P<by>(?!versions:)[^)]*)\)")


def pip_failure(tail: list[str], requirements: tuple[str, ...], guest: GuestPython) -> str:
    """The one line saying why pip (its last lines ``tail``) could not install ``requirements``, and the fix."""
    errors = [ln for ln in tail if ln.startswith("ERROR")] or list(tail) or ["no output"]
    head = "pip could not install the Smolfile's packages: "
    if any("[Errno 28]" in ln or "No space left on device" in ln for ln in tail):
        return (f"{head}[Errno 28] No space left on device: the host's disk is full; free space where smolbench "
                f"keeps packages ({packages_root()}; $SMOLBENCH_CACHE moves it), where pip's temporary files are too")
    conflict = next((ln for ln in errors if _CONFLICT.search(ln)), None)
    if conflict is not None:  # not "ResolutionImpossible: for help visit ...", pip's last line
        return f"{head}{conflict[:300]}: keep one pin per package, or loosen one so both can hold"
    why = errors[-1][:300]
    if any(_NETWORK.search(ln) for ln in tail):
        return (f"{head}{why}; the host could not reach the package index (pip's connections failed: "
                "check the host's network and its proxy settings, HTTPS_PROXY), so this says nothing about the name")
    found = _NOT_FOUND.search(why)
    if found is None and "Could not find a version" not in why:
        return f"{head}{why}; fix the Smolfile's packages (or the host's network to the package index)"
    wheels = (f"for this Python (cp{guest.major}{guest.minor}, {guest.machine} Linux); smolbench installs wheels "
              "only, as building from source would run the package's own setup code on the host")
    wanted = {_name(r) for r in requirements}
    needer = found and (found["by"] or next((m["by"] for m in map(_NO_VERSION.search, errors)
                                             if m and m["req"] == found["req"]), None))
    if found is not None and (needer or _name(found["req"]) not in wanted):
        by = f", which {needer} needs," if needer else " (a dependency)"
        return (f"{head}{why}; {found['req']}{by} has no wheel {wheels}: pick versions whose dependencies have "
                "wheels, or `%pip install` it inside a machine (pip there may build it from source)")
    # pip says the same of a name or version the index lacks and of one with no wheel for this Python
    return (f"{head}{why}; there is no such package or version, or none with a wheel for this Python (cp{guest.major}"
            f"{guest.minor}; wheels only: no setup.py runs on the host): check the name and version on pypi.org")


def _name(requirement: str) -> str:
    """The canonical project name of a requirement string ('' if it has none)."""
    try:
        return re.sub(r"[-_.]+", "-", Requirement(requirement).name).lower()
    except InvalidRequirement:
        return re.sub(r"[-_.]+", "-", re.split(r"[\s\[<>=!~;@(]", requirement, maxsplit=1)[0]).lower()


def _readable(tree: Path) -> None:
    """Folders 0755 and files 0644 (or 0755): the sandbox uid reads them, whatever the kernel's umask."""
    for dirpath, _dirs, filenames in os.walk(tree):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                mode = os.stat(path).st_mode
                os.chmod(path, 0o755 if mode & 0o100 else 0o644)


def _count(lib: Path) -> int:
    try:
        return sum(1 for name in os.listdir(lib) if name.endswith(".dist-info"))
    except OSError:
        return 0
