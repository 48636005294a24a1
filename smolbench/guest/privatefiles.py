"""A branch's own workspace and /tmp without containment (the process backend), and
the parent-death signal.

Stdlib only, Python 3.8+: runs inside the machine (see ``agent.py``).
"""

import ctypes
import os
import signal
import sys

CLONE_NEWNS = 0x00020000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_BIND = 4096
PR_SET_PDEATHSIG = 1
PDEATHSIG = True  # off where the agent must outlive its launcher (smol backend: agent.py --no-pdeathsig)


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _set_pdeathsig():
    if not PDEATHSIG:
        return
    try:
        _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:
        pass


def _mount(libc, src, target, fstype, flags, data=None):
    rc = libc.mount(
        src.encode() if src else None,
        target.encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, "mount %s: %s" % (target, os.strerror(err)))


O_PATH_FLAG = getattr(os, "O_PATH", 0o10000000) | os.O_CLOEXEC


def _mounts_below(path):
    """The topmost mount points strictly below ``path`` (from /proc/self/mountinfo)."""
    prefix = path.rstrip("/") + "/"
    points = []
    try:
        with open("/proc/self/mountinfo") as fh:
            for line in fh:
                point = line.split()[4].replace("\\040", " ")
                if point.startswith(prefix) and point not in points:
                    points.append(point)
    except OSError:
        return []
    return [p for p in points if not any(p.startswith(q + "/") for q in points)]


def _skip(points):
    def ignore(folder, names):
        return [n for n in names if os.path.join(folder, n) in points]

    return ignore


def _private_files(workdir, name, mount_ns=True):
    """Give this branch its own copy of the workspace and /tmp.

    In a private mount namespace the copies are bind-mounted over the shared
    paths, so the parent and the siblings keep seeing their own files. Where the
    kernel refuses (no privileges: the plain-process fallback), the branch works
    in a private copy of the workspace instead and says so.
    """
    import shutil  # imported by the parent before it forks (branching.warm): shared, not per branch

    libc = _libc()
    safe = name.replace("/", "_")
    try:
        if not mount_ns:
            raise OSError("not in a sandbox")
        if libc.unshare(CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), "unshare")
        _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
        base = "/run/.smolbench-branch-" + safe
        os.makedirs(base, exist_ok=True)
        _mount(libc, "tmpfs", base, "tmpfs", 0, "mode=0755")
        for path in (workdir, "/tmp"):
            if not path or not os.path.isdir(path):
                continue
            copy = os.path.join(base, path.strip("/").replace("/", "_") or "root")
            # Mounts below (a venv bound under /tmp) are not copied, which could take more than
            # the machine's memory: they are bound again on top of the copy.
            below = _mounts_below(path)
            held = [(p, os.open(p, O_PATH_FLAG)) for p in below]
            try:
                shutil.copytree(path, copy, symlinks=True, ignore=_skip(below))
                _mount(libc, copy, path, None, MS_BIND)
                for point, fd in held:
                    if not os.path.lexists(point):
                        if os.path.isdir("/proc/self/fd/%d" % fd):
                            os.makedirs(point)
                        else:
                            os.makedirs(os.path.dirname(point), exist_ok=True)
                            open(point, "a").close()
                    _mount(libc, "/proc/self/fd/%d" % fd, point, None, MS_BIND | MS_REC)
            finally:
                for _, fd in held:
                    os.close(fd)
        if workdir and os.path.isdir(workdir):
            os.chdir(workdir)  # re-enter the directory through the new mount
        return "mount-namespace"
    except (OSError, shutil.Error) as exc:
        if workdir and os.path.isdir(workdir):
            copy = workdir.rstrip("/") + ".branch-" + safe
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(workdir, copy, symlinks=True)
            os.chdir(copy)
        sys.__stderr__.write(
            "smolbench agent: branch %s has no private mount namespace (%s); it works in a copy "
            "of the workspace, but absolute paths are shared with its siblings\n" % (name, exc)
        )
        return "copy"

