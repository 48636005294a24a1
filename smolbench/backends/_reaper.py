"""The process backend's keeper: ``python _reaper.py KERNEL_PID -- AGENT ARGV...``.

Stdlib only (it starts before anything else of the machine). It makes itself a
child subreaper, so every process the machine starts stays its descendant, even
a double-forked ``setsid`` daemon with a scrubbed environment; it reaps what it
adopts; and when the kernel dies (``kill -9`` included: a parent-death signal),
when it is told to stop (SIGTERM), or when the agent exits, it kills every
descendant, again and again until none is left, and exits.
"""

import ctypes
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _children_of():
    tree = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        fields = data[data.rfind(b")") + 2:].split()
        if fields[0] not in (b"Z", b"X"):
            tree.setdefault(int(fields[1]), []).append(int(entry))
    return tree


def _kids(pid):
    """The live children of ``pid`` from its own /proc lists (every thread's), or None where the
    kernel keeps no such lists (then the whole of /proc is read)."""
    out = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out  # gone meanwhile
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as fh:
                out += [int(k) for k in fh.read().split()]
        except FileNotFoundError:
            if tid == str(pid):
                return None
        except (OSError, ValueError):
            continue
    return [k for k in out if _alive(k)]


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return False
    return data[data.rfind(b")") + 2:].split()[0] not in (b"Z", b"X")


def _below(pid):
    """Every process below ``pid``: a walk of this machine's own tree (we are its subreaper,
    so all it started is there), not a scan of every process on the host."""
    tree, out, todo = None, [], [pid]
    while todo:
        parent = todo.pop()
        kids = _kids(parent) if tree is None else tree.get(parent, [])
        if kids is None:
            tree = _children_of()
            kids = tree.get(parent, [])
        for kid in kids:
            out.append(kid)
            todo.append(kid)
    return out


def _kill_everything(deadline=10.0):
    me = os.getpid()
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        left = _below(me)
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        _reap()
        time.sleep(0.002)


def _reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


class _Stop(Exception):
    pass


def _stop(*_):
    raise _Stop  # out of a blocking waitpid (PEP 475 would retry it after a handler that returns)


def main(argv):
    kernel, argv = int(argv[0]), argv[2:]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    signal.signal(signal.SIGTERM, _stop)
    status = 0
    try:
        if os.getppid() != kernel:  # the kernel died before we could ask to be told
            return 1
        agent = os.fork()
        if agent == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.execv(argv[0], argv)
        while True:
            try:
                pid, code = os.waitpid(-1, 0)  # the agent, or an orphan we adopted
            except ChildProcessError:
                break
            if pid == agent:
                status = os.waitstatus_to_exitcode(code)
                break
    except _Stop:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _kill_everything()
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
