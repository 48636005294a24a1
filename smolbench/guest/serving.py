"""The agent: one machine's persistent namespace and the socket server that runs requests.

Stdlib only, Python 3.8+: runs inside the machine (see ``agent.py``). Cells run one at a
time on the main thread; a request that arrives while a cell runs gets a "machine busy"
reply at once.
"""

import builtins
import collections
import os
import queue
import signal
import socket
import stat
import sys
import threading
import time
import types

from . import figures, ipydisplay, orphans
from . import protocol as P
from .branching import Branching, _wait_exited, warm_for_branches
from .cells import Cells, _plain_error
from .guestapi import GuestAPI
from .output import OUTPUT_KEEP, _Outbox
from .saveload import SaveLoad
from .seeds import Seeds

BUSY = "machine busy: a cell is already running in this machine; wait for it or interrupt it"


def _on_sigint(signum, frame):
    """SIGINT on the main thread: KeyboardInterrupt only where a request's own work runs (a
    cell's code, a save); anywhere else (the agent ending a request, sending its answer,
    waiting for the next) the signal is late, its request gone, and it is dropped."""
    while frame is not None:
        if frame.f_code in INTERRUPTIBLE:
            raise KeyboardInterrupt
        frame = frame.f_back


INTERRUPTIBLE = {Cells._cell_body.__code__, SaveLoad.save.__code__}


class Agent(Cells, Seeds, Branching, SaveLoad):
    """One machine's cell executor and socket server."""

    def __init__(self, sock_path, name, workdir, listener=None):
        self.name = name
        self.started_as = name  # a branch is renamed (see apply_seed); its parent keeps this name
        self.workdir = workdir
        self.seed = None
        self.mount_ns = True
        self.machine = None  # contain.Machine when contained (sandbox backend)
        self.cell_count = 0
        self.children = {}  # pid -> name, for reaping
        self.leaf_counts = {}  # a leaf fork's maker (one of children) -> the branches it made (leaves.py)
        self._forking = 0  # branches being forked now (they count in our RLIMIT_NPROC already)
        self._nproc_lock = threading.Lock()
        self.reported = {}
        self.inherited_reward = None  # (the value,) of a `reward` a restore or a fork brought, until a cell sets one
        self._conn = None  # connection of the running request
        self._held, self._held_lock = None, threading.Lock()  # a held fork's release end (branching.py)
        self._send_lock = threading.Lock()
        self._busy = threading.Lock()
        self._queue = queue.Queue()
        self._running = False  # a cell (or save) is running: an interrupt request signals it
        self._running_id = None  # the host's id of that request (an interrupt naming another misses)
        self._cell_lock = threading.Lock()  # held to change _running, and to signal while it is set
        self.sock_path = sock_path
        self.main = types.ModuleType("__main__")
        self.main.__dict__["__builtins__"] = builtins
        self.ns = self.main.__dict__
        self.guest = GuestAPI(self)
        sys.modules["smolbench_guest"] = self.guest
        sys.modules["__main__"] = self.main
        self.ns["display"] = self.guest.display
        self.ns["smolbench_guest"] = self.guest  # as documented: usable without an import
        figures.watch(self)  # a cell's pyplot gets the agent's backend: plt.show() displays
        ipydisplay.watch(self)  # and IPython's display, once a cell imports it, is ours
        self.outbox = _Outbox(self)
        self._out = {"stdout": collections.deque(), "stderr": collections.deque()}
        self._out_size = {"stdout": 0, "stderr": 0}
        self.listener = listener or self._listen(sock_path)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, _on_sigint)
        self._start_acceptor()

    # -- serving -------------------------------------------------------------

    @staticmethod
    def _listen(path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)
        os.chmod(path, 0o600)
        s.listen(64)
        return s

    def _start_acceptor(self, reaper=True):
        """The thread that takes the host's connections, and (``reaper``) the one that reaps
        this machine's branches; a leaf branch (``leaves.py``) makes none to reap."""
        t = threading.Thread(target=self._accept_loop, args=(self.listener,), daemon=True)
        t.start()
        orphans.start(self)  # pid 1 of its machine (a leaf too): reaps the orphans re-parented to it
        if reaper:
            r = threading.Thread(target=self._reap_loop, daemon=True)
            r.start()

    def _accept_loop(self, listener):
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            if listener is not self.listener:  # we are a fork child holding the parent's socket
                conn.close()
                return
            try:
                threading.Thread(target=self._handle, args=(conn,), daemon=True).start()
            except RuntimeError:  # no thread left (the machine is at its pids limit): serve it here
                self._handle(conn)

    def _reap_loop(self):
        me = os.getpid()
        rounds = 0
        while os.getpid() == me:
            rounds += 1
            if self.machine is not None and rounds % 5 == 0:
                from . import contain

                contain.reap_orphaned_branches(self.children)
            gone = False
            for pid in list(self.children):
                try:
                    done, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    done = pid
                if done:
                    self.children.pop(pid, None)
                    self.leaf_counts.pop(pid, None)
                    gone = True
            if gone:
                self._nproc_room(0)
            time.sleep(0.2)

    def _nproc_room(self, forking):
        """Under RLIMIT_NPROC (no pids cgroup), our soft limit has room for our own processes
        and for each live branch's, which the kernel counts here too (``contain.share_nproc``)."""
        nproc = getattr(self.machine, "nproc", None)
        if not nproc:
            return
        from . import contain

        with self._nproc_lock:
            self._forking += forking
            live = len(self.children) + sum(n - 1 for n in self.leaf_counts.values() if n > 0)
            contain.share_nproc(nproc, max(0, live + self._forking))

    def _handle(self, conn):
        try:
            f = conn.makefile("rb")
            line = f.readline()
            f.close()  # the socket's own close then closes its descriptor (one request line a connection)
            if not line:
                self._close(conn)
                return
            req = P.decode(line)
        except Exception as exc:
            self._reply(conn, {"t": "done", "status": "error", "error": _plain_error("BadRequest", str(exc))})
            return
        op = req.get("op")
        if op in ("exec", "fork", "seed", "save", "load"):
            if not self._busy.acquire(blocking=False):
                self._reply(conn, {"t": "done", "status": "busy", "error": _plain_error("MachineBusy", BUSY)})
                return
            self._queue.put((req, conn))
            return
        if op == "ping":
            self._reply(conn, {"t": "done", "status": "ok", "info": self.info()})
        elif op == "interrupt":
            # Under the lock the main thread takes to end a request: the signal reaches the
            # request this one meant to stop, never the next (see _end). An interrupt naming a
            # request (its "id") misses any other; one naming none stops whatever runs.
            want = req.get("id")
            with self._cell_lock:
                hit = self._running and (want is None or want == self._running_id)
                if hit:
                    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            self._reply(conn, {"t": "done", "status": "ok", "interrupted": hit})
        elif op == "kill":
            pid = int(req["pid"])
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _wait_exited(pid, 10.0)  # answer once the branch is gone, not merely signalled
            self._reply(conn, {"t": "done", "status": "ok"})
        elif op == "warm":  # a microVM fork of this machine comes next (backends/smol.py)
            warm_for_branches()
            self._reply(conn, {"t": "done", "status": "ok"})
        elif op == "release":
            self.release(bool(req.get("go")), lambda: self._reply(conn, {"t": "done", "status": "ok"}))
        elif op == "shutdown":
            self._reply(conn, {"t": "done", "status": "ok"})
            os._exit(0)
        else:
            self._reply(conn, {"t": "done", "status": "error", "error": _plain_error("BadRequest", "unknown op %r" % op)})

    def _reply(self, conn, msg):
        try:
            conn.sendall(P.encode(msg))
        except OSError:
            pass
        finally:
            self._close(conn)

    @staticmethod
    def _close(conn):
        try:
            conn.close()
        except OSError:
            pass

    def close_inherited(self, new_listener=None):
        """In a child of a fork of this agent (a branch, a leaf, their maker): close every host
        connection the agent had open, served, queued or just accepted. Only the agent answers
        them; a child that kept one could read the host's requests to it and answer them as it
        (audits: a leaf's forged answer reached the host's request to its parent). Found by
        descriptor, each socket whose own address is the agent's listener's: a list the agent
        keeps misses one accepted a moment before the fork, and one whose object was closed
        while a handler's ``makefile`` still held its descriptor. ``new_listener``: the child's
        own, kept: its path can be the same string in another mount namespace (a branch's
        branch binds its own run folder's ``N/s``, as its parent did in the root's)."""
        try:
            ours = self.listener.getsockname()
            names = os.listdir("/proc/self/fd")
        except OSError:
            return
        keep = {self.listener.fileno(), new_listener.fileno() if new_listener is not None else -1}
        for name in names:
            fd = int(name)
            if fd in keep or fd <= 2:
                continue
            try:
                if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                    continue
                probe = socket.socket(fileno=fd)
                try:
                    here = probe.getsockname()
                finally:
                    probe.detach()
            except (OSError, ValueError):
                continue
            if here == ours:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def info(self):
        """What the host shows in ``%smol status``."""
        info = {
            "name": self.name,
            "pid": os.getpid(),
            "python": sys.version.split()[0],
            "executable": sys.executable,
            "busy": self._running,
            "seed": self.seed,
            "cells": self.cell_count,
            "workdir": self.workdir,
            "hostname": socket.gethostname(),
        }
        if self.machine is not None:
            from . import contain

            info.update(contain.info(self.machine))
        return info

    def _begin(self, req):
        """A cell or save starts: interrupt requests (naming its ``id``, or none) signal the
        main thread from now on."""
        with self._cell_lock:
            self._running, self._running_id = True, req.get("id")

    def _end(self):
        """It ended: no interrupt request signals it any more, and one already sent (to the
        main thread, under the lock) is handled here, outside it: dropped (_on_sigint)."""
        with self._cell_lock:
            self._running, self._running_id = False, None
        signal.pthread_sigmask(signal.SIG_BLOCK, [])  # runs the Python handlers of signals that came

    def serve_forever(self):
        """Run requests on the main thread, one at a time."""
        while True:
            try:
                req, conn = self._queue.get()
            except KeyboardInterrupt:  # a late interrupt that missed its cell
                continue
            self._conn = conn
            done = None
            try:
                op = req["op"]
                if op == "exec":
                    done = self.run_cell(req)
                elif op == "fork":
                    done = self.fork(req)
                    if done == "child":
                        continue  # we are now a branch; the parent answers the request
                elif op == "seed":
                    self.apply_seed(req.get("seed"), req.get("name"))
                    if req.get("restored"):  # woke up as a whole-machine checkpoint: as a load does
                        self.restored_as_saved()
                    done = {"t": "done", "status": "ok", "info": self.info()}
                elif op == "save":
                    self._begin(req)  # an interrupt stops it (the host removes what it wrote)
                    try:
                        done = self.save(req["path"])
                    finally:
                        self._end()
                elif op == "load":
                    done = self.load(req["path"])
            except KeyboardInterrupt:
                done = {"t": "done", "status": "error", "error": _plain_error("KeyboardInterrupt", "")}
            except BaseException as exc:  # the agent itself must survive anything a request does
                done = {"t": "done", "status": "error", "error": _plain_error(type(exc).__name__, str(exc))}
            # Free the machine *before* answering: a host that sends its next request the
            # moment it reads this answer must never be told the machine is busy.
            self._end()
            if self._busy.locked():
                self._busy.release()
            if done is not None:
                self.send(done)
            if self._conn is not None:
                self._close(self._conn)
            self._conn = None

    def send(self, msg):
        """Send one message to the host on the current request's connection."""
        if self._conn is not None:
            self.send_line(P.encode(msg))

    def send_line(self, data):
        """Send one message already encoded (a line of bytes, as :func:`protocol.encode` makes)."""
        conn = self._conn
        if conn is None:
            return
        # An interrupt (SIGINT -> KeyboardInterrupt) must not cut a message in half: the
        # host would rightly refuse the rest of the reply. Held off until it is sent.
        main = threading.current_thread() is threading.main_thread()
        if main:
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
        try:
            with self._send_lock:
                try:
                    conn.sendall(data)
                except OSError:
                    self._conn = None  # host went away; keep running the cell
        finally:
            if main:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])

    def stream(self, name, text):
        """Stream text written by the cell; keep the tail for the result record."""
        tail = self._out[name]
        tail.append(text[-OUTPUT_KEEP:])
        self._out_size[name] += len(tail[-1])
        while self._out_size[name] - len(tail[0]) >= OUTPUT_KEEP:
            self._out_size[name] -= len(tail.popleft())
        self.outbox.write(name, text)
