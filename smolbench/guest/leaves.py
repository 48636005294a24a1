"""Leaf branches: a fork whose branches are never forked again, one process each.

Stdlib only (runs on the machine's python3, Linux x86_64). A contained branch is usually two
warm Python processes, its keeper and its agent (``contain.py``): the keeper makes the
namespaces and must stay outside the branch's pid namespace, so the agent, pid 1 there, is
a second fork. A branch made to be deleted after its cell (``--keep none``, an episode, a
gym env's machine) never freezes its files for a fork of its own, so it needs no keeper.

One fork of the agent, the *maker*, then makes every branch of the request with a clone
into new user, mount and pid namespaces: each branch is pid 1 of its own pid namespace from
its first instruction, makes its IPC and net namespaces once released (``contain.LEAF_LATER``:
off the maker's one-at-a-time loop), sets its files up itself (``contain.start_branch`` with
``cloned``), drops every privilege and becomes its agent. The maker only reaps them.
Measured in a warm machine (a fork of 16 with nothing else): the children's CPU went from
~60 ms to ~27 ms, most of it the copy-on-write faults, page-table copies and exits of the
second process.

Why a raw clone is safe here: the maker is single-threaded (a fresh fork), so no lock of
libc or of Python is held by another thread at the clone; its own fork ran every at-fork
handler already, so a branch starts from a consistent post-fork state; the clone sets the
thread id libc keeps (``CLONE_CHILD_SETTID``, as libc's fork does) where it can be found.
The branch's store is a grant the host makes to its own pid namespace, after the clone and
before it is released, so no other process of the tree can spend it.
"""

import ctypes
import errno
import json
import os
import platform
import resource
import select
import sys
import threading

NR_CLONE = 56  # x86_64
SIGCHLD = 17
CLONE_CHILD_SETTID = 0x01000000
_PTHREAD_SCAN = 256  # ints of libc's thread struct searched for its thread id (it sits at 0x2d0 in glibc 2.3x)

_tid_offsets = None  # where this process's main thread keeps its thread id (found in the agent)
_syscall = None  # libc's syscall(), called with the GIL held (made once, in the agent)


def available():
    """Whether leaf branches can be made here (x86_64 Linux: the clone's argument order)."""
    return platform.machine() in ("x86_64", "AMD64")


def _tid_candidates():
    libc = ctypes.CDLL(None)
    libc.pthread_self.restype = ctypes.c_void_p
    base = libc.pthread_self()
    words = (ctypes.c_int * _PTHREAD_SCAN).from_address(base)
    tid = threading.get_native_id()
    return base, {i * 4 for i in range(_PTHREAD_SCAN) if words[i] == tid}


def note_tid():
    """In the agent's main thread, before the maker forks: where libc keeps this thread's id, and
    the syscall() the maker clones with."""
    global _tid_offsets, _syscall
    if _tid_offsets is None:
        _tid_offsets = _tid_candidates()[1]
    if _syscall is None:
        _syscall = ctypes.PyDLL(None, use_errno=True).syscall  # the GIL stays held: nothing else runs
        _syscall.restype = ctypes.c_long


def _tid_address():
    """In the maker: the address of libc's thread id, where both processes have it at the
    same offset (two different ids: not a coincidence); None if it can't be told."""
    base, here = _tid_candidates()
    both = here & (_tid_offsets or set())
    return base + both.pop() if len(both) == 1 else None


def _clone(flags, tid_address, waits):
    """clone(2) into new namespaces: 0 in the child. A count of namespaces that is full
    (ENOSPC: deleted branches' namespaces are freed a little later) is waited for, as
    ``contain._unshare`` does."""
    if tid_address is not None:
        flags |= CLONE_CHILD_SETTID
    for wait in tuple(waits) + (None,):
        pid = _syscall(ctypes.c_long(NR_CLONE), ctypes.c_ulong(flags | SIGCHLD), None, None,
                      ctypes.c_void_p(tid_address) if tid_address else None, None)
        if pid >= 0:
            return pid
        err = ctypes.get_errno()
        if err != errno.ENOSPC or wait is None:
            raise OSError(err, "clone: %s" % os.strerror(err))
        select.select([], [], [], wait)


def make(agent, req, frozen, hold, become):
    """In the agent: fork the maker, which clones one branch per requested child; returns the
    ``made`` list (name, pid) for the fork's answer, or, in a branch, "child" after
    ``become(child, listener)`` set it up. ``hold``: the pipe the branches wait on."""
    from . import contain

    note_tid()
    report = os.pipe()
    maker = os.fork()
    if maker == 0:
        try:
            os.close(report[0])
            got = _make(agent, req, frozen, hold, report[1], become)
        except BaseException as exc:  # the maker's own failure: the agent answers it
            _tell(report[1], {"error": "%s: %s" % (type(exc).__name__, exc)})
            os._exit(70)
        if got == "child":
            return "child"
        _reap_all()
    os.close(report[1])
    with os.fdopen(report[0], "rb") as fh:
        line = fh.readline(1 << 20)
    told = json.loads(line) if line.strip() else {"error": "the branch maker died before it answered"}
    agent.children[maker] = "maker"
    agent.leaf_counts[maker] = len(told.get("pids", []))
    if "error" in told:
        raise contain.ContainError(0, "making the branches failed: %s" % told["error"])
    return [{"name": c["name"], "pid": pid} for c, pid in zip(req["children"], told["pids"])], maker


def _make(agent, req, frozen, hold, report, become):
    from . import contain

    contain.set_pdeathsig()
    m = agent.machine
    # What every branch needs from here, read once: the mounts it reopens files on (as this
    # namespace has them; a branch's are copies with other ids), and the ids it maps.
    cloned = {"ids": (os.geteuid(), os.getegid()),
              "mounts": {} if "layers" in m.weak else contain.parent_mounts(m.workdir, m.weak)}
    os.fchdir(frozen["view"])  # a clone's cwd moves to its new namespace's copy of the view
    nproc = m.nproc if "branch-nproc" not in m.weak else None
    if nproc:  # the kernel records this soft limit as the room our count has for each branch
        hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
        resource.setrlimit(resource.RLIMIT_NPROC, (hard, hard))
    flags = contain.namespace_flags(m.net) & ~contain.LEAF_LATER  # the rest the branch makes itself
    tid = _tid_address() if "leaf-tid" not in m.weak else None
    pids = []
    for child in req["children"]:
        os.makedirs(os.path.dirname(child["socket"]), 0o700, exist_ok=True)
        listener = agent._listen(child["socket"])
        pid = _clone(flags, tid, contain.UNSHARE_WAITS)
        if pid == 0:
            try:
                contain.set_pdeathsig()  # the maker ends only once its branches did, or with the agent
                if nproc:  # our own pids, soft and hard, before anything runs here
                    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
                os.close(report)
                if hold is not None:
                    wait_release(*hold)
                frozen["cloned"] = cloned
                become(child, listener)
            except BaseException as exc:
                sys.__stderr__.write("smolbench agent: branch %s failed to start: %s\n" % (child["name"], exc))
                os._exit(70)
            return "child"
        listener.close()
        pids.append(pid)
    _tell(report, {"pids": pids})
    for fd in (hold or ()):
        os.close(fd)
    # The agent's descriptors the branches closed on their own: the host's connections (their
    # answers are the agent's), its listener, its keeper's end.
    agent.close_inherited()
    for sock in (agent.listener, m.chan):
        try:
            if sock is not None:
                sock.close()
        except OSError:
            pass
    return None


def _tell(fd, msg):
    try:
        os.write(fd, json.dumps(msg).encode() + b"\n")
    finally:
        os.close(fd)


def wait_release(read, write):
    """A held branch: wait for the agent's word; exit if it never comes (the agent is gone,
    or the host called the fork off)."""
    os.close(write)
    try:
        word = os.read(read, 1)
    except OSError:
        word = b""
    os.close(read)
    if word != b"g":
        os._exit(0)


def _reap_all():
    """The maker, once the branches are made: reap them as they end, then end too."""
    while True:
        try:
            os.wait()
        except ChildProcessError:
            os._exit(0)
        except InterruptedError:
            continue
        except KeyboardInterrupt:
            continue
