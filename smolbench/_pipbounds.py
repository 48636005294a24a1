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
import time
import zipfile
from pathlib import Path

from .errors import SmolbenchError
from .gate.limits import GB, human, parse_size

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


def tree_size(root: Path, skip: tuple[str, ...] = ()) -> tuple[int, str]:
    """Bytes of the files under ``root`` (its top-level ``skip`` names left out), and the largest
    file's last two path parts (what a refusal names)."""
    total, big, name = 0, -1, ""
    for dirpath, dirs, files in os.walk(root):
        if dirpath == str(root):
            dirs[:] = [d for d in dirs if d not in skip]
        for f in files:
            with contextlib.suppress(OSError):
                size = os.lstat(os.path.join(dirpath, f)).st_size
                total += size
                if size > big:
                    big, name = size, f"{os.path.basename(dirpath)}/{f}"
    return total, name


class DiskWatch:
    """Measures an install's folder while pip runs, at most ~10% of one core's time on it."""

    def __init__(self, root: Path, skip: tuple[str, ...], limit: int) -> None:
        self.root, self.skip, self.limit, self.due = root, skip, limit, 0.0

    def check(self, final: bool = False) -> str | None:
        """None while within the limit; else what a refusal names (its largest file)."""
        now = time.monotonic()
        if not final and now < self.due:
            return None
        size, name = tree_size(self.root, self.skip)
        self.due = time.monotonic() + max(1.0, 10 * (time.monotonic() - now))
        return f"{human(size)} so far, its largest file {name}" if size > self.limit else None


# The bytecode pip would have made (``compileall``'s, for this interpreter), made by a child
# under the caps, starting no program; a module whose compile runs out of memory is printed and
# ends it (exit 3); one that is not valid Python is skipped, as pip skips it.
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
                print("{COMPILE_MEMORY}", os.path.relpath(path, root), flush=True)
                sys.exit(3)
        except MemoryError:
            print("{COMPILE_MEMORY}", os.path.relpath(path, root), flush=True)
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
    rel = next((ln.split(COMPILE_MEMORY, 1)[1].strip() for ln in out.splitlines() if COMPILE_MEMORY in ln), "?")
    package = _owner(lib, rel)
    return (f"the Smolfile's package {package!r} was refused: compiling its module {rel} to bytecode needs more than "
            f"{human(cap)} of the host's memory (a module made to exhaust it, or a huge generated one); nothing was "
            f"kept: remove it from the Smolfile, or {raise_fix(MEMORY_ENV, cap)}")
