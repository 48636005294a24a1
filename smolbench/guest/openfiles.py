"""Descriptors kept open across a fork: found on the machine's old overlays, reopened on its own.

Stdlib only (runs on the machine's python3, Linux; see ``contain.py``). A file or folder a
cell keeps open across a fork still points into the overlay its parent had; after the
fork that overlay's upper layer is frozen and shared by the parent and every sibling, so
each side reopens such descriptors through its own overlay (:func:`open_files`,
:func:`reopen`), or, where that can't be done, puts a harmless one in its place.
"""

import os
import sys

O_PATH = getattr(os, "O_PATH", 0o10000000)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0o2000000)


def _fdinfo(fd):
    with open("/proc/self/fdinfo/%d" % fd) as fh:
        return dict((k.strip(), v.strip()) for k, v in (line.split(":", 1) for line in fh if ":" in line))


def mount_ids(paths):
    """The mount id of what is mounted at each of ``paths`` (in this mount namespace)."""
    out = {}
    for path in paths:
        fd = os.open(path, O_PATH | os.O_DIRECTORY)
        try:
            out[int(_fdinfo(fd)["mnt_id"])] = path
        finally:
            os.close(fd)
    return out


def held_cwd(mounts):
    """This process's working folder by path, also where it is on a swapped-out overlay of
    ``mounts`` ({mount id: mount point}): the same folder through the overlay there now."""
    try:
        fd = os.open(".", O_PATH | os.O_DIRECTORY)
        try:
            mnt, path = int(_fdinfo(fd)["mnt_id"]), os.readlink("/proc/self/cwd")
        finally:
            os.close(fd)
    except (OSError, KeyError, ValueError):
        return None
    if not path.startswith("/"):
        return None
    return mounts[mnt].rstrip("/") + path if mnt in mounts else path


def open_files(mounts, weak=()):
    """This process's descriptors on the overlay mounts ``mounts`` ({mount id: (mount point,
    still attached here)}), as (fd, path or None, flags, offset, mode) for :func:`reopen`:
    regular files, directories (a directory descriptor creates files whatever its open mode)
    and ``O_PATH`` descriptors of anything (their ``/proc/self/fd`` link opens the file again,
    for writing too). Left as they are: unlinked files (in no layer: only the holders of the
    descriptor reach them) and FIFOs and sockets opened for I/O. ``path`` is None where the
    descriptor has no path left (an unlinked directory): :func:`reopen` makes it harmless.
    ``weak`` ``fd-reopen`` (tests only): regular files only (and a branch leaves its parent's
    ``/dev/shm`` alone), the set-up before issue 17's audit."""
    import stat as _stat

    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            st = os.fstat(fd)
            info = _fdinfo(fd)
            where = mounts.get(int(info["mnt_id"]))
            if where is None:
                continue
            path = os.readlink("/proc/self/fd/%d" % fd)
            flags, pos = int(info["flags"], 8), int(info["pos"])
        except (OSError, KeyError, ValueError):
            continue
        is_dir, opath = _stat.S_ISDIR(st.st_mode), bool(flags & O_PATH)
        if "fd-reopen" in weak and (is_dir or opath):
            continue  # the old way: directories and O_PATH descriptors stay on the old overlay
        if not (is_dir or opath or _stat.S_ISREG(st.st_mode)):
            continue  # a FIFO or socket being read or written: its data is in no layer
        if st.st_nlink == 0 or not path.startswith("/"):
            if not is_dir:
                continue  # an unlinked file: no path to reopen it by, and in no layer
            path = None
        if path is not None and not where[1]:  # a swapped-out overlay: the path is from its own root
            path = where[0].rstrip("/") + path
        found.append((fd, path, flags, pos, st.st_mode))
    return found


def reopen(files, cover):
    """Point each descriptor of :func:`open_files` at its path again (through this machine's own
    overlay now), same flags and offset: a file or directory kept open across a fork then writes
    to this machine's own layer, never to the frozen one its parent and siblings share. One
    that can't be reopened (its path is gone or unreachable) is made harmless: an empty
    read-only directory or ``/dev/null`` takes its place, and the agent's log says so.
    ``cover``: the machine's empty read-only store cover (``contain.STORE``). Returns those as
    (fd, path, what now stands there)."""
    import stat as _stat

    spoiled = []
    for fd, path, flags, pos, mode in files:
        is_dir = _stat.S_ISDIR(mode)
        keep = flags & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC | O_CLOEXEC)
        new = -1
        if path is not None:
            try:
                new = os.open(path, keep)
                if _stat.S_IFMT(os.fstat(new).st_mode) != _stat.S_IFMT(mode):
                    os.close(new)  # something else at that path now: not the file the descriptor was
                    new = -1
            except OSError:
                new = -1
        if new < 0:
            spoiled.append((fd, path, _spoil(fd, flags, is_dir, cover)))
            continue
        try:
            if not flags & O_PATH:
                try:
                    os.lseek(new, pos, os.SEEK_SET)
                except OSError:
                    pass  # a directory's offset is a cookie the new one may not take: from the start
            os.dup2(new, fd, inheritable=not flags & O_CLOEXEC)
        finally:
            os.close(new)
    for fd, path, what in spoiled:
        sys.__stderr__.write("smolbench agent: descriptor %d (%s) could not be reopened through this machine's own "
                             "overlay after a fork; %s stands in its place, so it writes no shared layer\n"
                             % (fd, path or "an unlinked directory", what))
        sys.__stderr__.flush()
    return spoiled


def _spoil(fd, flags, is_dir, cover):
    """Put a harmless descriptor at ``fd``: an empty read-only directory (the store's cover, where
    it is one) for a directory, else ``/dev/null``; closed if neither opens. What it is now."""
    base = O_PATH if flags & O_PATH else os.O_RDONLY
    tries = [(cover, base | os.O_DIRECTORY)] if is_dir and _empty_read_only(cover) else []
    for path, how in tries + [(os.devnull, base)]:
        try:
            new = os.open(path, how)
        except OSError:
            continue
        try:
            os.dup2(new, fd, inheritable=not flags & O_CLOEXEC)
        finally:
            os.close(new)
        return "an empty read-only directory" if path == cover else path
    os.close(fd)
    return "nothing (closed)"


def _empty_read_only(path):
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY) and not os.listdir(path)
    except OSError:
        return False
