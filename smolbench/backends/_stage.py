"""Staging: a root kernel's folders made reachable by its sandbox uid, host permissions unchanged.

A kernel running as root starts bwrap as an unprivileged uid, which can't pass a
folder such as a 0700 home: the kernel's Python (pyenv's, under ``/root``), its
venv in a private checkout, the image cache. So before dropping privileges the
start command enters a private mount namespace (this file, run as a script by the
kernel's Python) that covers each such folder's topmost untraversable ancestor
with a small tmpfs, rebuilds the path to each needed folder inside it (0755) and
binds the folder there: bwrap then finds it at its own path. Nothing above the
needed folders becomes visible, and the host's mounts are unchanged (the namespace
dies with the machine). Standard library only: it runs with ``-I -S``.
"""

from __future__ import annotations

import ctypes
import os
import stat
import sys

CLONE_NEWNS = 0x00020000
MS_BIND, MS_REC, MS_PRIVATE, MS_NOSUID, MS_NODEV = 0x1000, 0x4000, 0x40000, 0x2, 0x4


def _allows(st: os.stat_result, uid: int, gid: int, bits: int) -> bool:
    """Whether mode ``st`` grants ``bits`` (an ``S_IXOTH``-style rwx triple) to uid/gid (no other groups)."""
    if st.st_uid == uid:
        shift = 6
    elif st.st_gid == gid:
        shift = 3
    else:
        shift = 0
    return (st.st_mode >> shift) & bits == bits


def blocker(path: str, uid: int, gid: int) -> str | None:
    """The topmost folder above ``path`` (absolute, resolved) that ``uid`` can't pass, if any."""
    parts = path.strip("/").split("/")[:-1]
    here = ""
    for part in parts:
        here += "/" + part
        if not _allows(os.stat(here), uid, gid, 1):
            return here
    return "/" if not _allows(os.stat("/"), uid, gid, 1) else None


def readable(path: str, uid: int, gid: int, write: bool = False) -> bool:
    """Whether ``uid`` can read ``path`` itself (a folder: list and enter it), and write it if asked."""
    st = os.stat(path)
    return _allows(st, uid, gid, (5 if stat.S_ISDIR(st.st_mode) else 4) | (2 if write else 0))


def plan(paths: list[str], uid: int, gid: int) -> tuple[list[str], list[str]]:
    """The folders to cover and the paths to bind at their own place, for ``paths`` (resolved)
    that ``uid`` can't reach. A path inside another staged path comes with it."""
    covers: set[str] = set()
    staged: list[str] = []
    for path in sorted(set(paths)):
        top = blocker(path, uid, gid)
        if top is None:
            continue
        covers.add(top)
        if not any(path.startswith(s + "/") for s in staged):
            staged.append(path)
    # a cover inside another is rebuilt by the outer one
    outer = sorted(c for c in covers if not any(c != o and c.startswith(o.rstrip("/") + "/") for o in covers))
    return outer, staged


def command(covers: list[str], staged: list[str]) -> list[str]:
    """The argv prefix that stages ``staged`` under ``covers`` and then runs the rest."""
    argv = [sys.executable, "-I", "-S", os.path.abspath(__file__)]
    for c in covers:
        argv += ["--cover", c]
    for s in staged:
        argv += ["--bind", s]
    return [*argv, "--"]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def main(argv: list[str]) -> None:
    covers: list[str] = []
    staged: list[str] = []
    while argv and argv[0] != "--":
        flag, value, argv = argv[0], argv[1], argv[2:]
        (covers if flag == "--cover" else staged).append(value)
    rest = argv[1:]
    libc = ctypes.CDLL(None, use_errno=True)
    mount = libc.mount
    mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    _check(libc.unshare(CLONE_NEWNS), "unshare")
    _check(mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "making / private")
    # Every source opened (in this namespace: a bind takes its source from the caller's own
    # mounts) before anything is covered; bound below from these descriptors.
    fds = {p: os.open(p, os.O_PATH | os.O_CLOEXEC) for p in staged}
    os.umask(0o022)
    for c in covers:
        _check(mount(b"tmpfs", c.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=755,size=1m"), f"covering {c}")
    for p in staged:
        if stat.S_ISDIR(os.fstat(fds[p]).st_mode):
            os.makedirs(p, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(p), exist_ok=True)
            open(p, "a").close()
        _check(mount(f"/proc/self/fd/{fds[p]}".encode(), p.encode(), None, MS_BIND | MS_REC, None), f"binding {p}")
        os.close(fds[p])
    os.chdir("/")
    os.execv(rest[0], rest)


if __name__ == "__main__":
    main(sys.argv[1:])
