"""Containment inside the bubblewrap sandbox: namespaces, copy-on-write files, no privileges.

Stdlib only (runs on the machine's python3, Linux). The agent uses it when the host
asks (``--contain``). Every machine, the root and each branch, is two processes:

* the *keeper* made the machine's user, mount, pid, IPC and network namespaces (the
  network one holds only a loopback; the host's egress proxy puts its listeners there
  when the policy lets the machine out). It alone keeps capabilities there. It mounts the
  machine's copy-on-write layers and, at each fork, freezes the machine's upper
  layers and gives it fresh ones. It lives outside the machine's pid namespace, so
  cells can't see it, and it answers one command on a socketpair.
* the *agent*, pid 1 of the machine's pid namespace, runs cells with no
  capabilities, no_new_privs and the seccomp filter of ``seccomp.py``.

Files: the workspace and /tmp are overlayfs mounts. Their layers live on the
machine's own tmpfs (sized by the Smolfile's ``disk``) mounted at ``STORE``; a
branch binds its parent's frozen layers read-only into its own store and writes to
its own upper layers. The keeper reaches its store through its cwd only: ``STORE`` and
what lies under each overlay are covered by empty read-only mounts, so cells never
see a layer (issue 17). Fork cost does not depend on how much is stored.
Where overlayfs can't be mounted, a branch copies its parent's files instead, and
says so in ``info()``.

Processes, where no pids cgroup counts them (a user kernel): ``RLIMIT_NPROC``. The kernel
counts a task in its own user namespace and again in every one above it, and checks each
ancestor's count against the soft limit the namespace's creator had when it called
unshare. A branch counts in its parent's machine, so it raises its soft limit to the hard
one just before its unshare (its parent's count keeps room above it for the parent and
its siblings) and lowers both to its own ``pids`` right after, before anything else runs
in it: its fork bomb stops at ``pids``, all it can add to its parent's count. The root's
hard limit is that room (``_limits.nproc_ceiling``); its soft limit is its ``pids`` plus
``pids`` per live branch (:func:`share_nproc`).
"""

import array
import ctypes
import errno
import json
import os
import resource
import select
import signal
import socket
import struct
import sys

from .orphans import children as _children

STORE = "/run/smolbench-layers"  # the machine's layer tmpfs (bwrap makes the mount point)
RUN = "/run/smolbench"  # the machine's own run directory (its socket; its branches' folders)
MAX_LOWERS = 48  # frozen layers per mount before a fork flattens them (overlayfs allows ~500)

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
UMOUNT_NOFOLLOW = 8
PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
O_PATH = getattr(os, "O_PATH", 0o10000000)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0o2000000)
KEEP_CAPS = 0  # tests only (SMOLBENCH_TEST_WEAKEN=net-caps): capabilities the agent keeps

_libc = ctypes.CDLL(None, use_errno=True)


class ContainError(OSError):
    """A containment step failed (the machine must not start without it)."""


def _check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise ContainError(err, "%s: %s" % (what, os.strerror(err)))


def mount(src, target, fstype, flags, data=None):
    """mount(2), raising ContainError. Type and option strings the mount guard allows are
    passed as their addresses in its page (``mountguard.py``): no other string passes it."""
    guard = _guard()
    _check(_libc.mount(src.encode() if src else None, target.encode(), guard.pointer(fstype),
                       ctypes.c_ulong(flags), guard.pointer(data)), "mount %s" % target)


def umount(target):
    _check(_libc.umount2(target.encode(), MNT_DETACH | UMOUNT_NOFOLLOW), "umount %s" % target)


def _fd_path(fd):
    return "/proc/self/fd/%d" % fd


def _write(path, text):
    with open(path, "w") as fh:
        fh.write(text)


# The kernel frees a deleted branch's namespaces after its last process is gone, and later
# still for some (a net namespace in a workqueue, after an RCU grace period): a branch forked
# just after others were deleted can find its machine's count full for a while (measured: up
# to ~0.8 s under 64 fresh sub-envs). It waits for them, a little at a time, ~5 s in all; a
# count that stays full is an error as before.
UNSHARE_WAITS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.5, 1.0, 1.0, 1.0)


def _unshare(flags):
    for wait in UNSHARE_WAITS + (None,):
        if _libc.unshare(flags) == 0:
            return
        if ctypes.get_errno() != errno.ENOSPC or wait is None:
            _check(-1, "unshare")
        select.select([], [], [], wait)


def set_pdeathsig():
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


# -- namespaces and privileges ------------------------------------------------------


def namespace_flags(net):
    """The namespaces a machine gets of its own: user, mount, pid, IPC, and net unless ``net``."""
    return CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | (0 if net else CLONE_NEWNET)


# What a leaf branch (leaves.py) makes itself, after its release, not its maker's clone: a net
# namespace is most of a clone's cost (~0.3 of ~0.6 ms here), and the maker clones one branch
# after another on one core while the released ones set up on all of them; made here, in the
# branch's own cgroup, the namespaces' kernel memory is charged to the branch, not its parent.
LEAF_LATER = CLONE_NEWIPC | CLONE_NEWNET


def new_namespaces(net, nproc=None, cloned=None):
    """Enter a new user, mount, pid and IPC namespace (and net unless ``net``), mapping
    this uid and gid to themselves: not root inside, so an exec never regains
    capabilities. The caller keeps every capability in the new user namespace.
    ``nproc``: a branch's own process count (see the module's docstring). ``cloned``: the
    (uid, gid) of the process that made us in these namespaces already (a leaf branch,
    ``leaves.py``); only the ids are mapped then."""
    if cloned is None:
        uid, gid = os.geteuid(), os.getegid()
        if nproc:  # the kernel records this soft limit as the room the parent's count has for us
            hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
            resource.setrlimit(resource.RLIMIT_NPROC, (hard, hard))
        _unshare(namespace_flags(net))
        if nproc:  # and ours is our own pids, soft and hard, before anything runs here
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    else:
        uid, gid = cloned
        _unshare(namespace_flags(net) & LEAF_LATER)
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", "%d %d 1\n" % (uid, uid))
    _write("/proc/self/gid_map", "%d %d 1\n" % (gid, gid))
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    if not net:
        _loopback_up()


def share_nproc(pids, branches):
    """A machine's soft ``RLIMIT_NPROC``: its own ``pids`` plus ``pids`` per live (or forking)
    branch, whose processes count here too, up to its hard limit (a branch's is its ``pids``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    want = pids * (1 + branches)
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    if want != soft:
        resource.setrlimit(resource.RLIMIT_NPROC, (want, hard))


def _loopback_up():
    SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 1
    import fcntl

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        req = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, SIOCGIFFLAGS, req + b"\0" * 14)[:18])[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | IFF_UP) + b"\0" * 14)
    finally:
        s.close()


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_privileges():
    """No capabilities at all (bounding, ambient, effective, permitted), and no_new_privs."""
    for cap in range(64):
        if KEEP_CAPS & (1 << cap):
            continue
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == 22:  # EINVAL: past the last cap
            break
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    head = _CapHeader(0x20080522, 0)
    data = (_CapData * 2)()
    data[0].effective = data[0].permitted = KEEP_CAPS
    _check(_libc.capset(ctypes.byref(head), data), "capset")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def cap_eff():
    """This process's effective capability mask (0 when contained)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return -1


# -- copy-on-write layers -------------------------------------------------------------


class Layers:
    """The overlay layers of one mount point (the workspace, or /tmp) of one machine.

    Layer paths are relative to the keeper's working directory, the machine's own store
    (hidden from the agent by a cover: the keeper reaches it through its cwd only)."""

    def __init__(self, key, target, lowers, weak=()):
        self.key, self.target, self.lowers = key, target, list(lowers)
        self.weak = weak
        self.gen = 0
        self.upper = self.work = None
        self.current = None  # the mount id of the overlay at target now
        self.old = {}  # mount id -> target of every overlay this machine had here before (swapped out)

    def mount(self, keep=()):
        self.gen += 1
        os.makedirs(self.key, exist_ok=True)
        self.upper = os.path.join(self.key, "u%d" % self.gen)
        self.work = os.path.join(self.key, "w%d" % self.gen)
        os.mkdir(self.upper, 0o755)
        os.mkdir(self.work, 0o700)
        opts = "lowerdir=%s,upperdir=%s,workdir=%s,userxattr" % (":".join(self.lowers), self.upper, self.work)
        mount("overlay", self.target, "overlay", MS_NOSUID | MS_NODEV, opts)
        if self.current is not None:
            self.old[self.current] = self.target
        self.current = mount_id(self.target)
        for path, source in keep:  # host paths that live below this mount point (a venv under /tmp)
            os.makedirs(path, exist_ok=True)
            mount(source, path, None, MS_BIND | MS_REC)

    def freeze(self, keep=()):
        """Make what was written since the last fork a read-only lower layer; continue on a
        fresh upper. Returns True when a fork had to flatten the layers (copying).

        The frozen layer is a fresh directory the written entries are moved into, never the
        old upper itself: that one stays the upper of the old overlay, which lives on while
        anything still holds it (a branch's copy of this mount namespace, a cell's open file),
        and overlayfs must not get a lower that is another mount's upper."""
        if not os.listdir(self.upper):
            return False  # nothing written since the last fork: no new layer
        flat = len(self.lowers) + 1 > MAX_LOWERS
        frozen = os.path.join(self.key, "f%d" % self.gen)
        if flat:
            import shutil

            shutil.copytree(self.target, frozen, symlinks=True, ignore=_skip_mounts(keep))
        umount(self.target)  # until the new overlay is up, the target shows an empty read-only cover
        if "layers" in self.weak and not flat:  # the old way: the upper itself becomes a lower
            frozen = self.upper
        elif not flat:
            os.mkdir(frozen, 0o755)
            for name in os.listdir(self.upper):
                os.rename(os.path.join(self.upper, name), os.path.join(frozen, name))
        self.lowers = [frozen] if flat else [frozen] + self.lowers
        self.mount(keep)
        return flat


_LOCKED = os.ST_RDONLY | os.ST_NOSUID | os.ST_NODEV


def read_only(path):
    """Make the bind mount at ``path`` read-only, and check it is. Inherited into a cell's own
    user namespace, the flag is locked: it can't be remounted read-write there. A bind of a
    mount that is read-only, nosuid and nodev already (a parent's layer, through the parent's
    read-only view) copied those flags: it needs no remount (one call fewer per layer, each
    of them a write lock on the parent's store, shared by every sibling setting up at once)."""
    if os.statvfs(path).f_flag & _LOCKED != _LOCKED:
        mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    if not os.statvfs(path).f_flag & os.ST_RDONLY:
        raise ContainError(0, "%s is still writable after a read-only remount" % path)


def cover(path):
    """An empty read-only directory over ``path``: what was below can't be seen or reached.
    A bind of the store's empty ``cover`` folder (the caller's cwd is the store), not a
    filesystem of its own: the mount guard allows no tmpfs but a branch's store."""
    if not os.path.isdir("cover"):
        os.mkdir("cover", 0o555)
    mount("cover", path, None, MS_BIND)
    read_only(path)


def _skip_mounts(keep):
    paths = {p for p, _ in keep}

    def ignore(folder, names):
        return [n for n in names if os.path.join(folder, n) in paths]

    return ignore


def copy_into(layers, keep):
    """No overlayfs: the layers' mount point becomes a private copy on the store."""
    import shutil

    merged = os.path.join(layers.key, "copy")
    shutil.copytree(layers.target, merged, symlinks=True, ignore=_skip_mounts(keep))
    mount(merged, layers.target, None, MS_BIND)
    for path, source in keep:
        mount(source, path, None, MS_BIND | MS_REC)


STATX_MNT_ID = 0x1000
AT_FDCWD = -100


def mount_id(path):
    """The mount id of what is mounted at ``path``, by statx: a keeper's /proc, once its agent
    mounted its own, is no longer the keeper's (no /proc/self there)."""
    if not hasattr(_libc, "statx"):  # glibc before 2.28: /proc (a keeper's is right until its agent starts)
        return next(iter(_files.mount_ids([path])))
    buf = ctypes.create_string_buffer(256)
    if _libc.statx(AT_FDCWD, path.encode(), 0, STATX_MNT_ID, buf) != 0:
        _check(-1, "statx %s" % path)
    mask, = struct.unpack_from("I", buf, 0)
    if not mask & STATX_MNT_ID:
        raise ContainError(0, "this kernel gives no mount id (statx, Linux 5.8+)")
    return struct.unpack_from("Q", buf, 0x90)[0]


# -- one machine --------------------------------------------------------------------------


class Machine:
    """Sets up this machine's namespaces and files, then splits into keeper and agent."""

    def __init__(self, workdir, disk_mib, net, keep, nproc=None):
        self.workdir, self.disk_mib, self.net = workdir, disk_mib, net
        self.nproc = nproc  # its own process count under RLIMIT_NPROC (None: a pids cgroup counts)
        self.keep_paths = [p for p in keep if p.startswith("/tmp/") or p == "/tmp"]
        self.files = "overlay"
        self.layers = []
        self.chan = None
        self.keeper_pid = None
        self.weak = ()
        self.view = None
        self.guard = None  # a root keeper's mountguard.Keeper
        self.is_branch = False
        self.keeper_fds = []  # descriptors only the keeper keeps
        self.mounts = "not guarded"
        self.leaf = False  # made with no keeper (leaves.py): it can't be forked

    def _open_dirs(self, paths):
        return [os.open(p, O_PATH | os.O_DIRECTORY) for p in paths]

    def setup(self, lowers=None, run_sub=None, view_fd=None, old_mounts=None, branch=False, cloned=None):
        """Root, or a ``branch`` whose parent froze ``lowers`` for it; ``view_fd`` is the
        parent's read-only view of its store, where those layer paths resolve. ``cloned``: a
        leaf branch, made in its namespaces already (``leaves.py``: the ids to map, and the
        mounts its parent has now, which it read before the clone)."""
        self.is_branch = branch
        sets = (("ws", self.workdir), ("tmp", "/tmp"))
        cow = self.files == "overlay"
        inherited = []
        if cow and lowers and "layers" not in self.weak:
            # Files the parent kept open, on its overlays (seen from its namespace, still ours here).
            mounts = {int(i): (t, False) for i, t in (old_mounts or {}).items()}
            here = cloned["mounts"] if cloned else parent_mounts(self.workdir, self.weak)
            mounts.update((i, (t, True)) for i, t in here.items())
            inherited = _files.open_files(mounts, self.weak)
        if view_fd is not None:
            if cloned is None:
                os.fchdir(view_fd)  # unshare moves the cwd to this namespace's copy of the view
            os.close(view_fd)  # (a leaf's maker moved there before the clone, which did the same)
        new_namespaces(self.net, self.nproc if branch and "branch-nproc" not in self.weak else None,
                       cloned and cloned["ids"])
        # Opened in the new mount namespace (a copy of the parent's), relative to the parent's
        # view, before covering them: a bind mount's source must be in the caller's namespace.
        lower_fds = {key: self._open_dirs(lowers.get(key, [])) for key, _ in sets} if cow and lowers else {}
        keep = [(p, fd) for p, fd in zip(self.keep_paths, self._open_dirs(self.keep_paths))]
        run_fd = os.open(os.path.join(RUN, run_sub), O_PATH | os.O_DIRECTORY) if run_sub else None
        # A branch's store spends one of the host's grants (mountguard.py).
        mount("tmpfs", STORE, "tmpfs", MS_NOSUID | MS_NODEV, _guard().store_options(self.disk_mib))
        # From here the keeper names everything in its store relative to its cwd: the store's
        # path is covered before cells run, so they never see a layer.
        os.chdir(STORE)
        for i, (path, fd) in enumerate(keep):
            held = os.path.join("keep", str(i))
            os.makedirs(held)
            mount(_fd_path(fd), held, None, MS_BIND | MS_REC)
            os.close(fd)
            keep[i] = (path, held)
        n = 0
        for key, target in sets:
            layer = Layers(key, target, [], self.weak)
            sub = keep if target == "/tmp" else ()
            if cow:
                for fd in lower_fds.get(key, []):
                    path = os.path.join("l", str(n))
                    n += 1
                    os.makedirs(path)
                    mount(_fd_path(fd), path, None, MS_BIND | MS_REC)
                    os.close(fd)
                    if "layers" not in self.weak:
                        read_only(path)
                    layer.lowers.append(path)
                if not layer.lowers:
                    layer.lowers = ["empty"]
                    os.makedirs("empty", exist_ok=True)
                if "layers" not in self.weak:
                    cover(target)  # what shows while a fork swaps the overlay: never the parent's
                try:
                    layer.mount(sub)
                except OSError as exc:
                    if lowers:
                        raise  # the root could mount overlays: a branch must too
                    self.files = "copy (overlayfs can't be mounted here: %s)" % exc.strerror
                    cow = False
                    if "layers" not in self.weak:
                        umount(target)
            if not cow:
                copy_into(layer, sub)
            self.layers.append(layer)
        os.mkdir("shm", 0o1777)
        os.chmod("shm", 0o1777)  # past the umask
        mount("shm", "/dev/shm", None, MS_BIND)  # shared memory is files in the store, within its size
        if run_fd is not None:
            mount(_fd_path(run_fd), RUN, None, MS_BIND)
            os.close(run_fd)
        self.keep = keep
        # The store as branches get it: a read-only view (the keeper hands a forking agent a
        # descriptor of it), then covered, so cells see no layer at all.
        mount(".", STORE, None, MS_BIND | MS_REC)
        if "layers" not in self.weak:
            read_only(STORE)
        self.view = os.open(STORE, O_PATH | os.O_DIRECTORY)
        if "layers" not in self.weak:
            cover(STORE)
        # Last: one that can't be reopened gets the store's empty read-only cover in its place.
        _files.reopen(inherited, STORE)

    def split(self):
        """Fork: the child becomes the agent (pid 1 here, no privileges) and returns; this
        process stays the keeper and never returns."""
        keeper = _sibling("keeper")  # before the fork: a branch's keeper finds it loaded
        keeper_end, agent_end = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            keeper_end.close()
            self.become_agent(agent_end)
            return
        agent_end.close()
        keeper.keep(self, keeper_end, pid, RUN)

    def become_agent(self, chan):
        """This process (pid 1 of the machine's pid namespace) gives up the keeper's part:
        its descriptors, /proc of its own, then every privilege. ``chan``: its keeper's end
        (None: a leaf branch, which has no keeper)."""
        if self.view is not None:
            os.close(self.view)
        self.view = None
        for fd in self.keeper_fds:  # the guard's page, /proc and grants are the keeper's
            os.close(fd)
        self.keeper_fds = []
        set_pdeathsig()
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        if "ucounts" not in self.weak:
            shares = _sibling("uidshares")
            shares.limit_ucounts(shares.BRANCH_UCOUNTS if self.is_branch else shares.ROOT_UCOUNTS)
        drop_privileges()
        os.chdir(self.workdir)
        self.chan = chan

    def freeze(self):
        flattened = []
        if self.files == "overlay":
            for layer in self.layers:
                if layer.freeze(self.keep if layer.target == "/tmp" else ()):
                    flattened.append(layer.target)
        lowers = {layer.key: list(layer.lowers) for layer in self.layers} if self.files == "overlay" else {}
        # Every overlay generation this machine had: a descriptor on any of them is reopened.
        old = {str(i): t for layer in self.layers for i, t in layer.old.items()}
        return {"lowers": lowers, "flattened": flattened, "mounts": old}


# -- the agent's side -------------------------------------------------------------------------


FREEZE_WAIT = 30.0  # seconds the agent waits for the keeper's freeze (the host ordered it first)


def take_freeze(chan, ask=False):
    """Agent: the keeper's freeze of this machine's layers, which the host ordered before its
    fork request (``ask``, tests only: ask for it, the old way): the lower layers a branch
    gets (paths relative to ``reply["view"]``, a descriptor of the store's read-only view that
    the caller closes once its branches are forked) and ``reply["mounts"]``, every overlay the
    machine had before. A freeze whose fork never came is older: the newest reply wins."""
    if ask:
        chan.sendall(b"freeze\n")
    replies, buf, fds = [], b"", []
    p = select.poll()
    p.register(chan.fileno(), select.POLLIN)
    while True:
        wait = 0 if replies and not buf else FREEZE_WAIT  # then only what is there already
        if not p.poll(wait * 1000):
            if replies and not buf:
                break
            raise ContainError(0, "the machine's keeper sent no freeze (the host orders it before a fork)")
        part, anc, _, _ = chan.recvmsg(65536, socket.CMSG_SPACE(4 * 4))
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
        if not part:
            raise ContainError(0, "the machine's keeper is gone")
        buf += part
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            replies.append(json.loads(line))
    reply = replies[-1]
    if "error" in reply or not fds:
        for fd in fds:
            os.close(fd)
        raise ContainError(0, "freezing the files failed: %s" % reply.get("error", "no view of the layers"))
    for fd in fds[:-1]:  # the views of older freezes
        os.close(fd)
    reply["view"] = fds[-1]
    return reply


def start_root(workdir, disk_mib, net, keep, weak=(), nproc=None, grants_fd=None):
    """Contain the root machine; returns the Machine (we are now its agent). ``weak``: test
    knobs that leave a step out (``seccomp``, ``layers``, ``branch-nproc``, ``mount-guard``,
    ``guard-maps``, ``fd-reopen``, ``keeper-nofile``, ``ucounts``); ``nproc``: its own process
    count when RLIMIT_NPROC is what counts (the caller set the hard limit); ``grants_fd``: the
    host's pipe of store grants."""
    m = Machine(workdir, disk_mib, net, keep, nproc)
    m.weak = tuple(weak)
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    if "keeper-nofile" not in m.weak and nofile[1] != resource.RLIM_INFINITY:
        # The kernel checks a sender's own soft limit: the keeper's is all it may have.
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile[1], nofile[1]))
    if grants_fd is not None:
        m.keeper_fds.append(grants_fd)
    listen = _guard_page(m, grants_fd)
    m.setup()
    m.split()
    if "seccomp" not in m.weak:
        m.seccomp = _sibling("seccomp").install(m.weak)
    else:
        m.seccomp = "off (test knob)"
    if listen:
        guard = _guard()
        try:
            fd = _sibling("seccomp").install_guard(guard.ADDR, [guard.ADDR + guard.OVERLAY, guard.ADDR + guard.PROC],
                                                   guard.ADDR + guard.TMPFS, guard.ADDR + guard.STORE_OPTS)
        except OSError as exc:
            m.mounts = "NOT guarded (the kernel refused the filter: %s): a cell can mount tmpfs/ramfs" % exc.strerror
        else:
            guard.send_listener(m.chan, fd)
    if "keeper-nofile" not in m.weak:
        _sibling("uidshares").lower_nofile(nofile)  # after the listener went: until then this process had its keeper's limit
    return m


def _guard_page(m, grants_fd):
    """Root, before set-up: map the guard's page and make the keeper's side; False where the
    guard can't be had here (``m.mounts`` says why)."""
    if "mount-guard" in m.weak:
        m.mounts = "NOT guarded (test knob): a cell can mount tmpfs/ramfs of its own"
        return False
    guard = _guard()
    try:
        page = guard.map_page(m.disk_mib)
    except OSError as exc:
        m.mounts = "NOT guarded (%s): a cell can mount tmpfs/ramfs" % exc.strerror
        return False
    proc = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY | O_CLOEXEC)  # ours: the agent mounts its own over it
    m.keeper_fds += [page, proc]
    m.guard = guard.Keeper(page, proc, grants_fd, check_maps="guard-maps" not in m.weak)
    m.mounts = ("overlay and proc only, and one store per branch the host orders (tmpfs/ramfs refused%s)"
                % ("; WEAKENED FOR A TEST: the keeper doesn't check the page" if "guard-maps" in m.weak else ""))
    return True


def start_branch(parent, lowers, run_sub, view_fd, old_mounts=None, cloned=None):
    """In a freshly forked child of ``parent``'s agent: become a contained branch (its keeper
    stays behind in this process). ``cloned``: a leaf branch, made in its own namespaces by a
    clone (``leaves.py``), which becomes the agent with no keeper."""
    if parent.chan is not None:
        try:
            parent.chan.close()
        except OSError:
            pass
    m = Machine(parent.workdir, parent.disk_mib, parent.net, parent.keep_paths, parent.nproc)
    m.seccomp, m.files, m.weak, m.mounts = parent.seccomp, parent.files, parent.weak, parent.mounts
    m.leaf = cloned is not None
    m.setup(lowers, run_sub, view_fd, old_mounts, branch=True, cloned=cloned)
    if cloned is None:
        m.split()
    else:
        m.become_agent(None)
    return m


def parent_mounts(workdir, weak=()):
    """The mount ids of this machine's workspace and /tmp overlays and (unless weakened) its
    /dev/shm, as its own mount namespace has them: a branch reopens files kept open there."""
    here = _files.mount_ids([workdir, "/tmp"])
    if "fd-reopen" not in weak:  # its /dev/shm: a branch's is a fresh one, the names there are its parent's
        here.update(_files.mount_ids(["/dev/shm"]))
    return here


def _nspid_depth(pid):
    with open("/proc/%d/status" % pid) as fh:
        for line in fh:
            if line.startswith("NSpid:"):
                return len(line.split()) - 1
    return 0


def reap_orphaned_branches(known=()):
    """Agent (pid 1 here): reap branch agents whose keeper died before them. They are
    reparented to us, and no one else waits for them. A cell's own children are left to it.
    Only our own children are looked at (not every process of the machine's tree: a fork of
    512 has some 1,500), less ``known``, the branch keepers the agent reaps itself."""
    me = os.getpid()
    try:
        mine = _nspid_depth(me)
        kids = _children(me)
        entries = os.listdir("/proc") if kids is None else [str(k) for k in kids if k not in known]
        for entry in entries:
            if not entry.isdigit():
                continue
            try:
                with open("/proc/%s/stat" % entry, "rb") as fh:
                    fields = fh.read().rsplit(b")", 1)[1].split()
                if fields[0] == b"Z" and int(fields[1]) == me and _nspid_depth(int(entry)) > mine:
                    os.waitpid(int(entry), os.WNOHANG)
            except (OSError, IndexError, ValueError):
                continue
    except OSError:
        pass


_guard_mod = None


def _guard():
    global _guard_mod
    if _guard_mod is None:
        _guard_mod = _sibling("mountguard")
    return _guard_mod


def _sibling(name):
    # A module beside this one, in the agent's own package (agent.py: a user's module of that
    # name still imports); by file under a private name where this one was loaded by file.
    import importlib

    if __package__:
        return importlib.import_module("%s.%s" % (__package__, name))
    import importlib.util

    spec = importlib.util.spec_from_file_location("_smolbench_" + name, os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_files = _sibling("openfiles")  # descriptors across a fork (loaded here, before any namespace changes)


def info(m):
    """What ``%smol status`` shows about containment."""
    return {"uid": os.getuid(), "cap_eff": cap_eff(), "files": m.files, "seccomp": m.seccomp, "mounts": m.mounts}


if __name__ == "__main__":  # pragma: no cover
    sys.exit("contain.py is a library for the agent")
