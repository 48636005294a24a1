"""Live branches: a fork request makes one ``os.fork()`` child of the agent per branch.

Stdlib only, Python 3.8+: runs inside the machine (see ``agent.py``).
"""

import gc
import os
import queue
import select
import socket
import sys
import threading
import time

from . import leaves
from .output import _Outbox
from .privatefiles import _private_files, _set_pdeathsig


class Branching:
    """The agent's fork (a part of ``serving.Agent``)."""

    def fork(self, req):
        """Fork one live child per requested branch; answer with their pids."""
        frozen = None
        if self.machine is not None:
            from . import contain, openfiles

            if "keeper-agent" in self.machine.weak:  # tests only: the old way, the agent asks, the overlays at hand count
                old = openfiles.mount_ids([p for p in (self.workdir, "/tmp") if p])
                cwd = _getcwd()
                os.chdir("/")
                frozen = contain.take_freeze(self.machine.chan, ask=True)
            else:  # the host ordered the freeze: every overlay this machine ever had counts
                frozen = contain.take_freeze(self.machine.chan)
                old = {int(i): t for i, t in frozen.pop("mounts", {}).items()}
                cwd = openfiles.held_cwd(old)
            frozen["old_mounts"], frozen["cwd"] = old, cwd
            _chdir(cwd, self.workdir)  # re-enter the working folder through the fresh upper layer
            if "layers" not in self.machine.weak:  # files and folders kept open: onto the fresh upper
                openfiles.reopen(openfiles.open_files({i: (t, False) for i, t in old.items()}, self.machine.weak),
                                 contain.STORE)
        try:
            return self._fork_children(req, frozen)
        finally:
            if frozen is not None and frozen.get("view") is not None:  # a branch closed its own
                os.close(frozen["view"])

    def _fork_children(self, req, frozen):
        n, done = len(req["children"]), None
        self._nproc_room(n)
        try:
            done = self._fork_each(req, frozen)
            return done
        finally:
            if done != "child":  # a new branch returns through here too, with a count of its own
                self._nproc_room(-n)

    def _fork_each(self, req, frozen):
        made = []
        warm_for_branches()
        # "hold": each child waits right after its fork, before it touches anything, until the
        # host moved it into its own cgroup and sends "release" (so none is charged to us, and
        # the ones already forked don't compete with this loop for the cores).
        hold = os.pipe() if req.get("hold") else None
        leaf = bool(req.get("leaf")) and frozen is not None and leaves.available()
        if leaf:  # one process per branch, all made by one fork of ours (leaves.py)
            _flush_streams()
            try:
                made = leaves.make(self, req, frozen, hold,
                                   lambda child, listener: self._become_child(child, listener, frozen))
            except BaseException:
                if hold is not None:
                    os.close(hold[0])
                    os.close(hold[1])
                raise
            if made == "child":
                return "child"
            made, maker = made
        try:
            for child in req["children"] if not leaf else ():
                if self._fork_one(child, frozen, hold, made) == "child":
                    return "child"
        except BaseException:  # (a fork at the process limit): the ones made exit, not wait for ever
            if hold is not None:
                os.close(hold[0])
                os.close(hold[1])
            raise
        if hold is not None:
            os.close(hold[0])
            self._hold(hold[1], len(made))
        done = {"t": "done", "status": "ok", "children": made}
        if leaf:
            done["leaf"], done["maker"] = True, maker
        if frozen is not None and frozen["flattened"]:
            done["flattened"] = frozen["flattened"]
        return done

    def _fork_one(self, child, frozen, hold, made):
        os.makedirs(os.path.dirname(child["socket"]), 0o700, exist_ok=True)
        listener = self._listen(child["socket"])
        _flush_streams()
        try:
            pid = os.fork()
        except BaseException:
            listener.close()
            raise
        if pid == 0:
            try:
                if hold is not None:
                    leaves.wait_release(*hold)
                self._become_child(child, listener, frozen)
            except BaseException as exc:
                sys.__stderr__.write("smolbench agent: branch %s failed to start: %s\n" % (child["name"], exc))
                os._exit(70)
            return "child"
        listener.close()
        self.children[pid] = child["name"]
        made.append({"name": child["name"], "pid": pid})
        return None

    def _hold(self, fd, count):
        """Keep the release end of held children until the host's word (a fork before any
        release lets the last go: they exit). A host that left while we forked (stopped: its
        "don't go" came first and found nothing held) never sends it: they exit now."""
        with self._held_lock:
            if _asker_left(self._conn):
                os.close(fd)
                return
            old, self._held = self._held, (fd, count)
        if old is not None:
            os.close(old[0])

    def release(self, go, answer=None):
        """Let the held children of the last fork start (``go``) or exit; how many there were.
        ``answer`` (the host's reply) goes just before they start: once they run, this thread
        shares the cores with all of them, and the reply waited its turn (a child whose word
        never comes exits: ``leaves.wait_release``)."""
        with self._held_lock:
            held, self._held = self._held, None
        try:
            if held is None:
                return 0
            fd, count = held
            try:
                if go and answer is not None:
                    answer, reply = None, answer
                    reply()
                if go:
                    os.write(fd, b"g" * count)  # at most a few KiB: within the pipe's buffer
            finally:
                os.close(fd)
            return count
        finally:
            if answer is not None:  # not released (none held, or told to exit): after it is done
                answer()

    def _become_child(self, child, listener, frozen=None):
        self.close_inherited(listener)  # the parent answers the fork request, and every other one it has
        self._conn = None
        self.listener.close()
        self.listener = listener
        self.sock_path = child["socket"]
        self.children = {}
        self.leaf_counts = {}
        self._held, self._held_lock = None, threading.Lock()
        self._forking, self._nproc_lock = 0, threading.Lock()  # the parent's may be held right now
        self._busy = threading.Lock()
        self._send_lock = threading.Lock()
        self.outbox = _Outbox(self)
        self._queue = queue.Queue()
        self._running, self._running_id, self._cell_lock = False, None, threading.Lock()  # the parent's may be held now
        self.cell_count = 0
        _set_pdeathsig()
        if frozen is not None:
            from . import contain

            view, frozen["view"] = frozen["view"], None
            self.machine = contain.start_branch(self.machine, frozen["lowers"], _plain_name(child["dir"]), view,
                                                frozen.get("old_mounts"), frozen.get("cloned"))
            _chdir(frozen.get("cwd"), self.workdir)  # the parent's working folder, through our own overlay
            self.sock_path = os.path.join(contain.RUN, "s")
        else:
            self.isolation = _private_files(self.workdir, child["name"], mount_ns=self.mount_ns)
        self.apply_seed(child.get("seed"), child["name"])
        _own_std_fds()
        self._start_acceptor(reaper=not getattr(self.machine, "leaf", False))


def _own_std_fds():
    """A branch's fds 0, 1 and 2 on an open file of its own (``/dev/null``), before any cell
    runs. They were the root machine's, shared by the whole tree, and an open file's flags are
    the same for everyone who holds it: a branch setting O_NONBLOCK on fd 1 was seen by its
    siblings, a channel between branches (third audit). What a branch's processes write
    there went only to the root's log, which no one is shown for a branch."""
    _flush_streams()
    null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    try:
        for fd in (0, 1, 2):
            os.dup2(null, fd)
    finally:
        os.close(null)

def warm_for_branches():
    """Before this machine is forked (here, or as a microVM by the host): what its branches
    would each import, imported once, and every object moved to the permanent generation, so
    the branches' garbage collector never walks (and so never copies) the warm state's pages."""
    warm()
    gc.freeze()


def warm():
    """Import what a new branch uses first, in the parent, before it forks: the agent imports
    these lazily (not on a fresh machine's ready path), and a module imported in a branch
    would cost every branch its time and its own private pages."""
    import random  # noqa: F401  (seeds.apply_seed)
    import shutil  # noqa: F401  (privatefiles, a branch's copy of its files)
    import traceback  # noqa: F401  (a branch's first failing cell)

    from . import pulldata, reseed  # noqa: F401  (a branch's first cell; a kept channel's answers)

    np = sys.modules.get("numpy")
    if np is not None:  # numpy imports numpy.random at its first use: seeding a branch would, in each
        try:  # (measured: 8 ms of CPU and ~900 page faults a branch, most of a branch's set-up)
            np.random.seed  # noqa: B018
        except Exception:
            pass


def _flush_streams():
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except Exception:
            pass


def _getcwd():
    try:
        return os.getcwd()
    except OSError:
        return None  # removed: nothing to come back to


def _chdir(path, fallback):
    """Into ``path`` by its name (so through the overlay mounted there now, never the swapped-out
    one a held working directory would keep), else ``fallback``."""
    for where in (path, fallback):
        if where:
            try:
                os.chdir(where)
                return
            except OSError:
                continue


def _plain_name(name):
    """A branch's run folder name: one plain path component (the host chooses it)."""
    name = str(name)
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise ValueError("bad run folder name %r" % name)
    return name


def _wait_exited(pid, timeout):
    """Wait until process ``pid`` has exited (a zombie no longer runs), at most ``timeout`` s."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with open("/proc/%d/stat" % pid, "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in (b"Z", b"X"):
            return
        time.sleep(0.002)


def _asker_left(conn):
    """Whether the host that sent this request has closed its end (it sends nothing after
    its request's line, so anything to read is the end)."""
    if conn is None:
        return False
    try:
        poll = select.poll()
        poll.register(conn, select.POLLIN | getattr(select, "POLLRDHUP", 0))
        events = poll.poll(0)
    except (OSError, ValueError):
        return True
    if not events:
        return False
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
