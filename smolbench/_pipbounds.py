"""What the host's pip may cost for a Smolfile's packages: memory, disk and time, all bounded.

A Smolfile, or a package it names, is anyone's: a 9 KB wheel of 8 MB of ``x=1`` lines cost
pip 3.4 GB to byte-compile, and a 1 MB wheel of zeros became 1.1 GB in the cache (audit). So
pip runs under an address-space cap (``RLIMIT_AS``, set by its guard before pip is imported;
it starts no program, so one process's cap bounds all of it) and a file-size cap
(``RLIMIT_FSIZE``), with its temporary files inside the install's own folder, which is
measured while it runs and after. pip compiles nothing (``--no-compile``): the bytecode is made
after it, by a child of its own under the same caps (:data:`COMPILE`), so machines still import
from ``.pyc`` files in their read-only mount, and a file too costly to compile is refused in one
line naming it. Both limits are the host user's (environment variables), never a Smolfile's:
the Smolfile is what they guard against.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
import zipfile
from pathlib import Path
from typing import NamedTuple

from .errors import SmolbenchError
from .gate.limits import GB, human, parse_size
from .gate.terminal import one_line

MEMORY_ENV = "SMOLBENCH_PIP_MEMORY"  # address space of the host's pip, and of its bytecode compile
DISK_ENV = "SMOLBENCH_PACKAGES_LIMIT"  # what one package list's install may take on the host's disk
DEFAULT_MEMORY = 2 * GB  # pip itself peaks at ~60 MB; compiling a 1 MB module of `x=1` lines, ~430 MB
DEFAULT_DISK = 8 * GB  # torch with its CUDA wheels installs to ~5 GB
CAPS_ENV = "SMOLBENCH_PIP_CAPS"  # how :data:`packages.PIP_GUARD` and :data:`COMPILE` learn the caps
COMPILE_MEMORY = "smolbench-compile: out of memory in"  # what :data:`COMPILE` prints before exit 3


def _limit(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return parse_size(text)
    except SmolbenchError as exc:
        raise SmolbenchError(f"${name} {exc}") from None


def memory_cap() -> int:
    """Bytes of address space the host's pip (and its compile) may use: ``$SMOLBENCH_PIP_MEMORY``, else 2 GB."""
    return _limit(MEMORY_ENV, DEFAULT_MEMORY)


def disk_limit() -> int:
    """Bytes one package list's install may take: ``$SMOLBENCH_PACKAGES_LIMIT``, else 8 GB."""
    return _limit(DISK_ENV, DEFAULT_DISK)


def caps_env() -> dict[str, str]:
    """The variable that tells pip's guard and the compile child their caps."""
    return {CAPS_ENV: f"{memory_cap()} {disk_limit()}"}


def raise_fix(name: str, value: int) -> str:
    """How the user raises a limit (the fix of a refusal that names a package they trust)."""
    return f"if you trust it, raise the limit in the kernel's environment ({name}={human(value * 2).replace(' ', '')})"


def over_disk(what: str, limit: int) -> SmolbenchError:
    """The one line refusing a package list over the disk limit (``what``: which file or entry)."""
    return SmolbenchError(f"the Smolfile's packages would take more than {human(limit)} on the host ({what}), the "
                          f"limit for one package list; nothing was kept: remove that package from the Smolfile, or "
                          f"{raise_fix(DISK_ENV, limit)}")


def check_wheels(pairs: list[tuple[str, str]], limit: int) -> None:
    """Before pip: the local wheels' unpacked sizes (their zip directories), each and together,
    within ``limit`` (``pairs``: the Smolfile entry, the wheel's path). The directory is the
    wheel's own word, so what lands on disk is measured too (:func:`tree_size`)."""
    total = 0
    for text, path in pairs:
        try:
            with zipfile.ZipFile(path) as z:
                size = sum(max(0, i.file_size) for i in z.infolist())
        except (OSError, zipfile.BadZipFile, ValueError):
            continue  # not a zip: pip says so, in its own line
        total += size
        if total > limit:
            raise over_disk(f"Smolfile packages entry {text!r} unpacks to {human(size)}, its wheel's directory says",
                            limit)


ENTRY_COST = 1024  # bytes charged per file, folder or link besides its blocks: its inode and directory entry
ENTRIES_MOST = 1_000_000  # files and folders one install may make (torch with its CUDA wheels: ~40,000)
DEPTH_MOST = 200  # folders deep below the install's folder (pip's temporary paths are ~20)
WAIT_MOST = 2.0  # seconds between two measures while pip runs, however long the last one took
NAME_TEXT = 200  # characters of a wheel's file name a refusal shows (escaped: the name is the wheel's)


class Measure(NamedTuple):
    """What a tree takes: bytes (blocks, and :data:`ENTRY_COST` each entry), entries, its largest
    file's last two path parts, and why the walk stopped early (too many entries, too deep) or ''."""

    size: int
    entries: int
    largest: str
    stopped: str


def tree_size(root: Path, skip: tuple[str, ...] = ()) -> Measure:
    """What the tree under ``root`` takes on disk (its top-level ``skip`` names left out): each
    entry's blocks (``st_blocks``, not ``st_size``: folders and sparse tails take disk too) and
    :data:`ENTRY_COST`; walked without recursion and stopped past :data:`ENTRIES_MOST` entries or
    :data:`DEPTH_MOST` folders deep (a wheel's 1,800 levels crashed the recursive walk)."""
    total, entries, big, name = 0, 0, -1, ""
    todo: list[tuple[str, int]] = [(str(root), 0)]
    while todo:
        folder, depth = todo.pop()
        try:
            listing = os.scandir(folder)
        except OSError:
            continue
        with listing:
            for entry in listing:
                if depth == 0 and entry.name in skip:
                    continue
                entries += 1
                if entries > ENTRIES_MOST:
                    return Measure(total, entries, name, f"more than {ENTRIES_MOST:,} files and folders")
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                total += st.st_blocks * 512 + ENTRY_COST
                if stat.S_ISDIR(st.st_mode):
                    if depth + 1 > DEPTH_MOST:
                        return Measure(total, entries, name, f"folders more than {DEPTH_MOST} deep")
                    todo.append((entry.path, depth + 1))
                elif st.st_size > big:
                    big, name = st.st_size, f"{os.path.basename(folder)}/{entry.name}"
    return Measure(total, entries, name, "")


class DiskWatch:
    """Measures an install's folder while pip runs: at most ~10% of one core's time on it, and
    at least every :data:`WAIT_MOST` seconds (a walk's cost is bounded by :data:`ENTRIES_MOST`)."""

    def __init__(self, root: Path, skip: tuple[str, ...], limit: int) -> None:
        self.root, self.skip, self.limit, self.due, self.shape = root, skip, limit, 0.0, False

    def check(self, final: bool = False) -> str | None:
        """None while within the limit; else what a refusal names (its largest file, escaped)."""
        now = time.monotonic()
        if not final and now < self.due:
            return None
        got = tree_size(self.root, self.skip)
        took = time.monotonic() - now
        self.due = now + took + min(WAIT_MOST, max(1.0, 10 * took))
        largest = one_line(got.largest, NAME_TEXT)
        self.shape = bool(got.stopped)
        if got.stopped:
            return got.stopped
        return f"{human(got.size)} so far, its largest file {largest}" if got.size > self.limit else None

    def refusal(self, what: str) -> SmolbenchError:
        """The one line refusing the install :meth:`check` found over (``what``: its answer)."""
        if not self.shape:
            return over_disk(what, self.limit)
        return SmolbenchError(f"the Smolfile's packages would make {what} on the host, more than one package list "
                              f"may (a wheel made to use up the disk's inodes, or to break what walks it); nothing "
                              f"was kept: remove that package from the Smolfile")


# The bytecode pip would have made (``compileall``'s, for this interpreter), made by a child
# under the caps, starting no program, its warnings off (``-W ignore``: a module of 4,000 ``x is 1``
# printed megabytes of SyntaxWarning); a module whose compile runs out of memory is printed (its
# name escaped, one line) and ends it (exit 3); one that is not valid Python is skipped, as pip skips it.
COMPILE = f"""
import os, py_compile, resource, sys
mem, size = (int(x) for x in os.environ.pop("{CAPS_ENV}").split())
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
def refuse(event, args):
    if event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty"):
        raise PermissionError("smolbench: the compile starts no program")
sys.addaudithook(refuse)
root = sys.argv[1]
for dirpath, dirs, files in os.walk(root):
    dirs.sort()
    for name in sorted(files):
        if not name.endswith(".py"):
            continue
        path = os.path.join(dirpath, name)
        try:
            py_compile.compile(path, doraise=True)
        except py_compile.PyCompileError as exc:
            if isinstance(exc.exc_value, MemoryError):
                print("{COMPILE_MEMORY}", os.path.relpath(path, root).encode("unicode_escape").decode(), flush=True)
                sys.exit(3)
        except MemoryError:
            print("{COMPILE_MEMORY}", os.path.relpath(path, root).encode("unicode_escape").decode(), flush=True)
            sys.exit(3)
        except (OSError, ValueError, RecursionError, SyntaxError):
            pass
"""


def _owner(lib: Path, rel: str) -> str:
    """The distribution whose RECORD lists ``rel`` (its dist-info folder's name), else ``rel``'s top folder."""
    for info in sorted(lib.glob("*.dist-info")):
        with contextlib.suppress(OSError, UnicodeDecodeError):
            with open(info / "RECORD", encoding="utf-8", errors="replace") as record:  # the wheel's: read bounded
                if any(line.split(",", 1)[0] == rel for line in record.read(4 << 20).splitlines()):
                    return info.name.split("-", 1)[0]
    return rel.split("/", 1)[0]


def compile_refusal(out: str, cap: int, lib: Path) -> str:
    """The one line refusing a package whose module costs more than ``cap`` to compile (``out``: the child's)."""
    said = next((ln.split(COMPILE_MEMORY, 1)[1].strip() for ln in out.splitlines() if COMPILE_MEMORY in ln), "?")
    try:  # the child escaped it (one line); RECORD has it as it is
        package = one_line(_owner(lib, said.encode("ascii").decode("unicode_escape")), NAME_TEXT)
    except UnicodeError:
        package = "?"
    rel = one_line(said, NAME_TEXT)  # the wheel's own file name: no escape, no line end reaches the host's line
    return (f"the Smolfile's package {package!r} was refused: compiling its module {rel} to bytecode needs more than "
            f"{human(cap)} of the host's memory (a module made to exhaust it, or a huge generated one); nothing was "
            f"kept: remove it from the Smolfile, or {raise_fix(MEMORY_ENV, cap)}")
