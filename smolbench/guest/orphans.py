"""Pid 1 of a machine reaps its orphans, and never a child the machine's own code waits for.

Stdlib only, Python 3.8+: runs inside the machine (see ``agent.py``).

In the sandbox the agent is pid 1 of the machine's pid namespace (a leaf branch's agent too):
every process whose parent exits first (``sh -c 'sleep 1 &'``, a daemon, a grandchild) is
re-parented to it. No one else will ever wait for those: unreaped, each stays a zombie and
holds one of the machine's ``pids``, and a few dozen of them brick a machine.

The agent can't simply wait for any child: the cell's own code (subprocess.Popen, os.fork,
multiprocessing, pip) runs in this same process, and a child reaped under it makes its
``Popen.wait()`` see ECHILD and report returncode 0. So the pids this process creates are
recorded (``os.fork``, ``os.forkpty``, ``os.posix_spawn[p]``, subprocess's
``_posixsubprocess.fork_exec``; ``os.spawn*`` and ``pty`` go through those), and only a
zombie child outside that record (nor one of the agent's branches) is reaped. A fork
records its pid under the lock the reaper holds, so a child that exits at once is never
mistaken for an orphan. ``os.system`` waits in C for a child it never names: while one
runs, nothing is reaped. A record of a pid its owner waited for is dropped once the pid
is no longer our child (pids come back only after the whole pid space went round).

A thread waits for any child's end without reaping it (``waitid`` with ``WNOWAIT``), then
reaps what is ours to; while a zombie of the cell's own code waits for its owner it looks
again every ``TICK`` seconds. It starts only once the machine has made a process: an orphan
descends from a child of the agent, and most branches (a fork's ``--keep none``, an episode)
never make one, so they don't pay for a thread (~0.3 ms of CPU and ~90 page faults a branch,
measured). A recorded fork starts it; a child made in C is found at its cell's end
(:func:`after_cell`), and its orphans are reaped from then on. Where the agent is not pid 1 (the process backend, whose
keeper is the machine's subreaper, and a smol microVM, where the agent is started
detached under the VM's own init) none of this is installed. Out of reach: a fork made
in C (ctypes, an extension's own fork) is not recorded, and its child, once it ends, may be
reaped before its own code waits for it.
"""

import os
import threading
import time

TICK = 0.2  # seconds between looks while a zombie waits for its own code's wait

_lock = threading.Lock()  # held by a recorded fork from before it until its pid is recorded, and by a sweep
_mine = set()  # type: set[int]  # pids this process created (its code will wait for them), while they are its children
_owner = None  # the pid of the process that reaps (the agent, pid 1); None in any other process
_blind = 0  # os.system calls running: their child is waited for by libc, unnamed
_installed = False
_agent = None  # the agent whose orphans are reaped (its thread starts with the first child)
_reaping = False  # the reaper thread runs (in this process)
reaped = 0  # orphans reaped by this agent (tests, ``%smol status``)


def start(agent):
    """In an agent that is pid 1 of its pid namespace (a machine, a branch, a leaf): record
    its own children from now on and reap every other child that ends (a thread, started
    with the first child)."""
    global _owner, _mine, _lock, _blind, _agent, _reaping
    if os.getpid() != 1:
        return
    _install()
    _lock, _mine, _blind = threading.Lock(), set(), 0
    _owner, _agent, _reaping = os.getpid(), agent, False


def _reap_from_now():
    """Start the reaper thread, once, in the agent that reaps."""
    global _reaping
    if _reaping or _owner != os.getpid() or _agent is None:
        return
    _reaping = True
    threading.Thread(target=_loop, args=(_agent,), daemon=True, name="smolbench-orphans").start()


def after_cell():
    """At a cell's end: a child made in C (not recorded) still starts the reaper."""
    if _reaping or _owner != os.getpid():
        return
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # never a child: nothing can be orphaned here yet
        return
    except OSError:
        pass
    _reap_from_now()


def _forget():
    """A new process (a fork of ours): none of its children are known yet, and it reaps nothing
    unless it becomes an agent (``start``)."""
    global _owner, _mine, _lock, _blind, _agent, _reaping
    _owner, _mine, _lock, _blind, _agent, _reaping = None, set(), threading.Lock(), 0, None, False


def _install():
    global _installed
    if _installed:
        return
    _installed = True
    import _posixsubprocess
    import posix

    os.register_at_fork(after_in_child=_forget)
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        real = getattr(posix, name, None)
        if real is not None:  # one wrapper in both modules: pickled by reference as posix.NAME, it is found
            wrapper = _blinding(real) if name == "system" else _recording(real)
            os.__dict__[name] = posix.__dict__[name] = wrapper
    _posixsubprocess.fork_exec = _recording(_posixsubprocess.fork_exec)


def _recording(real):
    """``real`` (which makes a child and returns its pid, or (pid, fd)), its child recorded."""

    def made(*args, **kwargs):
        if os.getpid() != _owner:
            return real(*args, **kwargs)
        with _lock:
            got = real(*args, **kwargs)
            pid = got[0] if isinstance(got, tuple) else got
            if pid and os.getpid() == _owner:  # (0: we are the new child)
                _mine.add(pid)
        if not _reaping:
            _reap_from_now()
        return got

    return _named(made, real)


def _named(wrapper, real):
    """``wrapper`` under ``real``'s names, so pickle finds it where ``real`` was (posix.fork)."""
    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        try:
            setattr(wrapper, attr, getattr(real, attr))
        except (AttributeError, TypeError):
            pass
    return wrapper


def _blinding(real):
    """``os.system``: nothing is reaped while it runs (libc waits for a child it never names)."""

    def system(command):
        global _blind
        if os.getpid() != _owner:
            return real(command)
        _reap_from_now()
        with _lock:
            _blind += 1
        try:
            return real(command)
        finally:
            with _lock:
                _blind -= 1

    return _named(system, real)


def _loop(agent):
    me = os.getpid()
    while _owner == me and os.getpid() == me:
        try:
            ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)  # a child ended (not reaped)
        except ChildProcessError:  # no child at all
            ended = None
        except OSError:
            ended = None
        pid = ended.si_pid if ended is not None else None
        if pid is None or pid in _mine or pid in agent.children or _blind:
            time.sleep(TICK)  # its own code waits for it (or none): look again soon, not at once
        sweep(agent)


def sweep(agent):
    """Reap every zombie child that is no child of our own code's nor a branch."""
    global reaped
    me = os.getpid()
    if _owner != me:
        return 0
    n = 0
    with _lock:  # (a fork records its child under it: never between the list and the reaping)
        kids = children(me)
        # a recorded child is forgotten once it is no child of ours (its own code reaped it), each
        # checked by itself: not by its absence from the children list, which misses a child
        # forked a moment before it was read, and which the kernel cuts at a page
        for pid in list(_mine):
            try:
                os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                _mine.discard(pid)
            except OSError:
                pass
        if _blind:
            return 0
        known = _mine | set(agent.children)
        for pid in (kids if kids is not None else _all_pids()):
            if pid in known or not _zombie_child(pid, me):
                continue
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    n += 1
            except ChildProcessError:
                pass
    reaped += n
    return n


def _zombie_child(pid, me):
    try:
        with open("/proc/%d/stat" % pid, "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        return fields[0] == b"Z" and int(fields[1]) == me
    except (OSError, IndexError, ValueError):
        return False


def children(pid):
    """The children of ``pid`` (every thread's, zombies too) from its own /proc lists; None where
    the kernel keeps no such lists."""
    out = []
    try:
        tids = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return None
    for tid in tids:
        try:
            with open("/proc/%d/task/%s/children" % (pid, tid), "rb") as fh:
                out += [int(k) for k in fh.read().split()]
        except FileNotFoundError:
            if tid == str(pid):
                return None  # no CONFIG_PROC_CHILDREN
        except (OSError, ValueError):
            continue
    return out


def _all_pids():
    try:
        return [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
