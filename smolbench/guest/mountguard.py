"""The mount guard: which new filesystems a machine may mount (issue 17, item 7).

Stdlib only (runs on the machine's python3, Linux x86_64). A branch is a live fork of a
machine that has run cells, so the calls that set a branch up (a user namespace, overlay
and proc mounts, the branch's store) are calls a cell can make too. Without a memory
cgroup nothing counts a tmpfs or ramfs a cell mounts in a user namespace of its own, so
mounts of a *new* filesystem are checked here, by their type and options:

* The names allowed (``overlay``, ``proc``, ``tmpfs`` with the store's options) live in
  one page: a sealed memfd (no writes, no resizing, ever) mapped read-only and shared at
  the fixed address :data:`ADDR` before any cell runs; every process of the machine
  inherits it. The seccomp filter (``seccomp.guard_program``) compares the *pointers*
  mount(2) gets with those addresses: any other type or option string is EPERM, and so
  are mmap, munmap, mprotect, mremap, shmat(SHM_REMAP) and remap_file_pages over that
  address, so nothing else can be mapped there while the process lives.
* A matching call goes to the root machine's keeper as a seccomp user notification. The
  keeper lets it go on only if the caller really has the sealed page at :data:`ADDR`
  (``/proc/PID/maps``: same device and inode); a program exec'd from a crafted ELF that
  maps its own bytes there gets EPERM. Since that mapping can't change while the call
  waits, the strings the kernel then reads are ours.
* A ``tmpfs`` (a branch's store, sized by the Smolfile's ``disk``) needs a grant: the host
  writes one per branch it orders to a pipe only the keeper holds, for the pid namespace of
  the machine it asks to fork (where a branch is while it sets itself up), and each store
  mount from that namespace spends one. So the memory in tmpfs is at most ``disk`` per
  branch the host ordered, and no other machine of the tree can take a branch's store.

Bind, move, propagation and bind-remount calls create no filesystem and pass; a plain
remount (new superblock options, such as a larger ``size``) is EPERM.
"""

import ctypes
import errno
import fcntl
import os
import select

ADDR = 0x300000000000  # the page's address in every process of a machine (see seccomp.guard_program)
PAGE = 4096
OVERLAY, PROC, TMPFS, STORE_OPTS = 0, 16, 32, 64  # offsets of the allowed strings in the page

SECCOMP_IOCTL_NOTIF_RECV = 0xC0502100
SECCOMP_IOCTL_NOTIF_SEND = 0xC0182101
SECCOMP_IOCTL_NOTIF_ID_VALID = 0x40082102
SECCOMP_USER_NOTIF_FLAG_CONTINUE = 1
NR_MOUNT = 165
PROT_READ, MAP_SHARED, MAP_FIXED_NOREPLACE = 1, 1, 0x100000
NR_MSEAL = 462
BATCH = 256  # notifications answered in one wake of the keeper, at most (then its other fds)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]

_strings: dict = {}  # allowed string -> its address in the page, once mapped


def store_options(disk_mib):
    return "mode=0700" + (",size=%dm" % disk_mib if disk_mib else "")


def map_page(disk_mib):
    """Make the sealed page and map it at ADDR in this process; returns its memfd (the keeper
    keeps it to recognise the page in a caller's maps). Raises OSError where it can't be had."""
    texts = {OVERLAY: "overlay", PROC: "proc", TMPFS: "tmpfs", STORE_OPTS: store_options(disk_mib)}
    page = bytearray(PAGE)
    for off, text in texts.items():
        page[off:off + len(text)] = text.encode()
    fd = os.memfd_create("smolbench-mounts", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.write(fd, bytes(page))
        seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        # Sealed before it is mapped: a shared mapping of a write-sealed memfd can never be
        # made writable (mprotect), nor written through /proc/self/mem.
        got = _libc.mmap(ADDR, PAGE, PROT_READ, MAP_SHARED | MAP_FIXED_NOREPLACE, fd, 0)
        if got != ADDR:
            err = ctypes.get_errno()
            raise OSError(err or errno.EEXIST, "mapping the mount page at 0x%x: %s" % (ADDR, os.strerror(err or errno.EEXIST)))
        _libc.syscall(NR_MSEAL, ctypes.c_ulong(ADDR), ctypes.c_ulong(PAGE), 0)  # where the kernel has it (6.10+)
    except BaseException:
        os.close(fd)
        raise
    _strings.update((text, ADDR + off) for off, text in texts.items())
    return fd


def pointer(text):
    """The address of ``text`` in the page (a ctypes pointer), or its bytes where it isn't there."""
    if text is None:
        return None
    addr = _strings.get(text)
    return ctypes.c_void_p(addr) if addr is not None else text.encode()


class _Data(ctypes.Structure):
    _fields_ = [("nr", ctypes.c_int), ("arch", ctypes.c_uint32), ("ip", ctypes.c_uint64), ("args", ctypes.c_uint64 * 6)]


class _Notif(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("pid", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("data", _Data)]


class _Resp(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("val", ctypes.c_int64), ("error", ctypes.c_int32), ("flags", ctypes.c_uint32)]


class Keeper:
    """The root keeper's side: answers the guard's notifications, counts the host's grants."""

    def __init__(self, page_fd, proc_fd, grants_fd, check_maps=True):
        st = os.fstat(page_fd)
        self.page = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
        self.proc_fd = proc_fd  # this keeper's own /proc (pids in notifications are of its pid namespace)
        self.grants_fd = grants_fd
        self.check_maps = check_maps
        self.listener = None
        self.grants = {}  # pid namespace (inode) -> stores the host granted there
        self.refused = 0
        self._pending = b""
        if grants_fd is not None:
            os.set_blocking(grants_fd, False)

    def fds(self):
        return [fd for fd in (self.listener, self.grants_fd) if fd is not None]

    def ready(self, fd):
        if fd == self.listener:
            self.answer_pending()
        elif fd == self.grants_fd:
            self.read_grants()

    def answer_pending(self, most=BATCH):
        """Answer the notifications waiting now, up to ``most``, in one wake of the keeper: a
        fork of N sets up N branches at once, each with several mounts (4N notifications),
        and one poll round per notification made them queue."""
        waiting = select.poll()
        waiting.register(self.listener, select.POLLIN)
        for _ in range(most):
            # POLLIN only: a listener whose machine is gone says POLLHUP, and a receive would block
            if not any(events & select.POLLIN for _, events in waiting.poll(0)):
                return
            self.answer()

    def read_grants(self):
        """Add what the host granted (lines "N NS": N stores to pid namespace NS); a closed
        pipe grants nothing more."""
        if self.grants_fd is None:
            return
        while True:
            try:
                data = os.read(self.grants_fd, 4096)
            except BlockingIOError:
                return
            if not data:
                os.close(self.grants_fd)
                self.grants_fd = None
                return
            self._pending += data
            *lines, self._pending = self._pending.split(b"\n")
            for line in lines:
                fields = line.split()
                if len(fields) == 2 and all(f.isdigit() for f in fields):
                    ns = int(fields[1])
                    self.grants[ns] = self.grants.get(ns, 0) + int(fields[0])

    def answer(self):
        notif = _Notif()
        if _libc.ioctl(self.listener, ctypes.c_ulong(SECCOMP_IOCTL_NOTIF_RECV), ctypes.byref(notif)) != 0:
            return  # the caller is gone (ENOENT) or was interrupted
        ok = notif.data.nr == NR_MOUNT and (not self.check_maps or self._has_page(notif.pid))
        if ok and notif.data.args[2] == ADDR + TMPFS:
            self.read_grants()  # the host writes the grant before it orders the fork
            ns = self._pid_ns(notif.pid)
            ok = self.grants.get(ns, 0) > 0
            if ok:
                self.grants[ns] -= 1
        # The maps we read were the caller's only if its notification is still pending.
        if ok and _libc.ioctl(self.listener, ctypes.c_ulong(SECCOMP_IOCTL_NOTIF_ID_VALID), ctypes.byref(ctypes.c_uint64(notif.id))) != 0:
            return
        if not ok:
            self.refused += 1
        resp = _Resp(notif.id, 0, 0 if ok else -errno.EPERM, SECCOMP_USER_NOTIF_FLAG_CONTINUE if ok else 0)
        _libc.ioctl(self.listener, ctypes.c_ulong(SECCOMP_IOCTL_NOTIF_SEND), ctypes.byref(resp))

    def _pid_ns(self, pid):
        try:
            link = os.readlink("%d/ns/pid" % pid, dir_fd=self.proc_fd)  # "pid:[4026532123]"
            return int(link.split("[", 1)[1].rstrip("]"))
        except (OSError, IndexError, ValueError):
            return None

    def _has_page(self, pid):
        """Is the sealed page what process ``pid`` has mapped at ADDR?"""
        try:
            fd = os.open("%d/maps" % pid, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.proc_fd)
        except OSError:
            return False
        try:
            line = _maps_line(fd)
        except OSError:
            return False
        finally:
            os.close(fd)
        if line is None:
            return False
        fields = line.split()
        if len(fields) < 5 or fields[1] != b"r--s":
            return False
        try:
            major, minor = (int(x, 16) for x in fields[3].split(b":"))
            return (major, minor, int(fields[4])) == self.page
        except ValueError:
            return False


_HEAD = b"\n" + ("%x-%x " % (ADDR, ADDR + PAGE)).encode()


def _maps_line(fd):
    """The line of maps file ``fd`` that starts with the page's range (None if none), searched
    as bytes in small reads, stopping there: the lines are in address order and the page's is
    first or nearly (ADDR is below the program and its libraries), and the kernel makes only
    the lines a read asks for."""
    data = b"\n"
    while True:
        chunk = os.read(fd, 512)
        at = (data + chunk).find(_HEAD)
        data += chunk
        if at >= 0:
            end = data.find(b"\n", at + 1)
            if end >= 0 or not chunk:
                return data[at + 1:end if end >= 0 else len(data)]
            continue
        if not chunk:
            return None
        data = data[-len(_HEAD):]  # a line cut between two reads is found in the next


def send_listener(chan, fd):
    """Agent: hand the guard's listener to the keeper (before any cell runs), and close ours."""
    import array
    import socket

    chan.sendmsg([b"guard\n"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    os.close(fd)
