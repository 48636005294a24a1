"""The guest agent: runs inside a machine and executes notebook cells.

Stdlib only and Python 3.8+, because it runs on the machine's own python3.
Started once per machine; it keeps one persistent namespace (the machine's
``__main__``) and serves requests on a Unix socket, one JSON line per request
(see ``protocol.py``). Cells run one at a time on the main thread; a request
that arrives while a cell runs gets a "machine busy" reply at once.

A live branch is an ``os.fork()`` of this process: the child inherits the warm
namespace, gets its own socket, its own copy of the workspace and /tmp (a
private mount namespace where the kernel allows it) and its seed.

Usage: python3 agent.py --socket PATH --name NAME [--workdir DIR] [--lib DIR]
"""

import argparse
import ast
import collections
import ctypes
import gc
import importlib.util
import io
import linecache
import math
import os
import pickle
import queue
import random
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
import types

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load_protocol(name="protocol"):
    # Loaded under a private name so user code can still have a module called "protocol".
    spec = importlib.util.spec_from_file_location("_smolbench_" + name, os.path.join(_HERE, name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


P = _load_protocol()
contain = None  # guest/contain.py, loaded by main() when the host asks for containment
pipsite = None  # guest/pipsite.py, loaded by main(): the Smolfile's packages and pip in the machine

BUSY = "machine busy: a cell is already running in this machine; wait for it or interrupt it"
MIME_METHODS = (
    ("text/html", "_repr_html_"),
    ("image/svg+xml", "_repr_svg_"),
    ("image/png", "_repr_png_"),
    ("image/jpeg", "_repr_jpeg_"),
    ("text/markdown", "_repr_markdown_"),
    ("text/latex", "_repr_latex_"),
    ("application/json", "_repr_json_"),
)
OUTPUT_KEEP = 64 * 1024  # characters of stdout/stderr kept for the result record
BATCH_CHARS = 64 * 1024  # stream text sent per message at most
BATCH_SECONDS = 0.005  # how long output gathers before it is sent
NUMBER_LIMIT = 1e300  # rewards and metrics: finite numbers within +-1e300


PLOTLY_MIME = "application/vnd.plotly.v1+json"


def _plotly_json(value):
    # A plotly figure as JSON data (its HTML form is a script, which the host won't show).
    to_json = getattr(value, "to_json", None)
    if to_json is None or not hasattr(value, "to_plotly_json") or isinstance(value, type):
        return None
    try:
        import json

        return json.loads(to_json())
    except Exception:
        return None


def mime_bundle(value):
    """A Jupyter MIME bundle for ``value`` (text/plain always present)."""
    data = {}
    fig = _plotly_json(value)
    if fig is not None:
        data[PLOTLY_MIME] = fig
    for mime, meth in MIME_METHODS:
        if fig is not None and mime == "text/html":
            continue
        fn = getattr(value, meth, None)
        if fn is None or isinstance(value, type):
            continue
        try:
            out = fn()
        except Exception:
            continue
        if out is None:
            continue
        if isinstance(out, tuple):  # (data, metadata)
            out = out[0]
        if isinstance(out, bytes):
            out = P.b64(out)
        data[mime] = out
    try:
        data["text/plain"] = repr(value)
    except Exception as exc:  # a broken __repr__ must not lose the cell
        data["text/plain"] = "<unrepresentable %s: %s>" % (type(value).__name__, exc)
    return data


class _Outbox:
    """Batches a cell's stream output: one message per ~5 ms or 64 KiB, not one per print.

    Writers append; a flusher thread sends what has gathered. A writer that gets
    far ahead of the host (its socket full) sends itself, so it waits for the host
    instead of buffering without bound.
    """

    def __init__(self, agent):
        self._agent = agent
        self._parts = []  # [name, [texts]] in order
        self._size = 0
        self._lock = threading.Lock()
        self._sending = threading.Lock()
        self._wake = threading.Event()
        self._pid = None

    def write(self, name, text):
        if self._pid != os.getpid():  # a new process (a branch): its own flusher thread
            self._pid = os.getpid()
            threading.Thread(target=self._flusher, daemon=True).start()
        with self._lock:
            if self._parts and self._parts[-1][0] == name:
                self._parts[-1][1].append(text)
            else:
                self._parts.append([name, [text]])
            self._size += len(text)
            big = self._size >= BATCH_CHARS
        if big:
            self.flush()
        else:
            self._wake.set()

    def flush(self):
        # One flush at a time, whole: whatever a flush took is sent before another (or the
        # cell's final reply, which follows a flush) can go.
        with self._sending:
            with self._lock:
                parts, self._parts, self._size = self._parts, [], 0
            for name, texts in parts:
                text = "".join(texts)
                for i in range(0, len(text), BATCH_CHARS):  # a huge write goes in bounded frames
                    self._agent.send({"t": "stream", "name": name, "text": text[i:i + BATCH_CHARS]})

    def _flusher(self):
        me = os.getpid()
        while os.getpid() == me:
            self._wake.wait()
            time.sleep(BATCH_SECONDS)
            self._wake.clear()
            try:
                self.flush()
            except Exception:  # the host went away: the cell goes on
                pass


class _Stream(io.TextIOBase):
    """sys.stdout / sys.stderr replacement that streams writes to the host (batched)."""

    def __init__(self, agent, name):
        self._agent = agent
        self.name = name

    def writable(self):
        return True

    def write(self, text):
        if not isinstance(text, str):
            raise TypeError("write() argument must be str, not %s" % type(text).__name__)
        n = len(text)
        if text and not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate (e.g. a non-UTF-8 file name): shown escaped,
                text = text.encode("utf-8", "backslashreplace").decode("utf-8")  # as Python's stderr does
        if text:
            self._agent.stream(self.name, text)
        return n

    def flush(self):
        self._agent.outbox.flush()

    def isatty(self):
        return False


class GuestAPI(types.ModuleType):
    """The ``smolbench_guest`` module that cells can import inside the machine."""

    def __init__(self, agent):
        super().__init__("smolbench_guest", "Talk to smolbench from inside a machine.")
        self._agent = agent

    def report(self, reward=None, **metrics):
        """Record this branch's reward and any extra metrics (numbers or short strings)."""
        if reward is not None:
            self._agent.reported["reward"] = reward
        self._agent.reported.setdefault("metrics", {}).update(metrics)

    def display(self, *objs):
        """Show objects in the notebook, like IPython's display()."""
        for obj in objs:
            self._agent.outbox.flush()  # text printed before the display shows before it
            self._agent.send({"t": "display", "data": mime_bundle(obj)})

    def pip(self, *args):
        """Run ``python -m pip ARGS`` in this machine (installs go to its own folder on sys.path)."""
        return (pipsite or _load_protocol("pipsite")).run(args)

    @property
    def node(self):
        """This machine's node id in the fork tree (e.g. ``root.3``)."""
        return self._agent.name

    @property
    def seed(self):
        """This branch's seed, or None on a machine that was never seeded."""
        return self._agent.seed


class Agent:
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
        self._forking = 0  # branches being forked now (they count in our RLIMIT_NPROC already)
        self._nproc_lock = threading.Lock()
        self.reported = {}
        self._conn = None  # connection of the running request
        self._send_lock = threading.Lock()
        self._busy = threading.Lock()
        self._queue = queue.Queue()
        self._running = False
        self.sock_path = sock_path
        self.main = types.ModuleType("__main__")
        self.main.__dict__["__builtins__"] = __builtins__
        self.ns = self.main.__dict__
        self.guest = GuestAPI(self)
        sys.modules["smolbench_guest"] = self.guest
        sys.modules["__main__"] = self.main
        self.ns["display"] = self.guest.display
        self.ns["smolbench_guest"] = self.guest  # as documented: usable without an import
        self.outbox = _Outbox(self)
        self._out = {"stdout": collections.deque(), "stderr": collections.deque()}
        self._out_size = {"stdout": 0, "stderr": 0}
        self.listener = listener or self._listen(sock_path)
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

    def _start_acceptor(self):
        t = threading.Thread(target=self._accept_loop, args=(self.listener,), daemon=True)
        t.start()
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
                contain.reap_orphaned_branches()
            gone = False
            for pid in list(self.children):
                try:
                    done, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    done = pid
                if done:
                    self.children.pop(pid, None)
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
        with self._nproc_lock:
            self._forking += forking
            contain.share_nproc(nproc, max(0, len(self.children) + self._forking))

    def _handle(self, conn):
        try:
            f = conn.makefile("rb")
            line = f.readline()
            if not line:
                conn.close()
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
            if self._running:
                os.kill(os.getpid(), signal.SIGINT)
            self._reply(conn, {"t": "done", "status": "ok", "interrupted": self._running})
        elif op == "kill":
            pid = int(req["pid"])
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _wait_exited(pid, 10.0)  # answer once the branch is gone, not merely signalled
            self._reply(conn, {"t": "done", "status": "ok"})
        elif op == "shutdown":
            self._reply(conn, {"t": "done", "status": "ok"})
            os._exit(0)
        else:
            self._reply(conn, {"t": "done", "status": "error", "error": _plain_error("BadRequest", "unknown op %r" % op)})

    @staticmethod
    def _reply(conn, msg):
        try:
            conn.sendall(P.encode(msg))
        except OSError:
            pass
        finally:
            conn.close()

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
            info.update(contain.info(self.machine))
        return info

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
                    done = {"t": "done", "status": "ok", "info": self.info()}
                elif op == "save":
                    done = self.save(req["path"])
                elif op == "load":
                    done = self.load(req["path"])
            except KeyboardInterrupt:
                done = {"t": "done", "status": "error", "error": _plain_error("KeyboardInterrupt", "")}
            except BaseException as exc:  # the agent itself must survive anything a request does
                done = {"t": "done", "status": "error", "error": _plain_error(type(exc).__name__, str(exc))}
            # Free the machine *before* answering: a host that sends its next request the
            # moment it reads this answer must never be told the machine is busy.
            self._running = False
            if self._busy.locked():
                self._busy.release()
            if done is not None:
                self.send(done)
            if self._conn is not None:
                try:
                    self._conn.close()
                except OSError:
                    pass
            self._conn = None

    def send(self, msg):
        """Send one message to the host on the current request's connection."""
        conn = self._conn
        if conn is None:
            return
        data = P.encode(msg)
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

    # -- cells ---------------------------------------------------------------

    def run_cell(self, req):
        """Execute one cell; return the final ``done`` message."""
        self.cell_count += 1
        filename = req.get("cell") or "<cell-%d>" % self.cell_count
        if self.name != self.started_as:
            # A branch inherited its ancestors' cells in linecache under the same names
            # ("<cell-1>"): name its own cells after it, so tracebacks show the right lines.
            filename = "<%s@%s>" % (filename.strip("<>"), self.name)
        code = req.get("code", "")
        self.reported = {}
        self._out = {"stdout": collections.deque(), "stderr": collections.deque()}
        self._out_size = {"stdout": 0, "stderr": 0}
        started = time.time()
        msg = {"t": "done", "status": "ok", "result": None, "error": None, "pulled": {}}
        old = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Stream(self, "stdout"), _Stream(self, "stderr")
        self._running = True
        try:
            if req.get("seed") is not None:
                self.apply_seed(req["seed"])
            for name, blob in (req.get("push") or {}).items():
                self.ns[name] = _loads(P.unb64(blob))
            value = self._execute(code, filename)
            if value is not None:
                msg["result"] = mime_bundle(value)
                self.ns["_"] = value
        except KeyboardInterrupt:
            self._running = False
            msg["status"] = "error"
            msg["error"] = _error_from_exc(filename)
        except BaseException:
            self._running = False
            msg["status"] = "error"
            msg["error"] = _error_from_exc(filename)
        finally:
            self._running = False
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            sys.stdout, sys.stderr = old
        if msg["status"] == "ok":
            for name in req.get("pull") or []:
                if name not in self.ns:
                    msg["status"] = "error"
                    msg["error"] = _plain_error("NameError", "--pull %s: no variable named %r in the machine" % (name, name))
                    break
                try:
                    msg["pulled"][name] = _pull(self.ns[name], bool(req.get("pull_trusted")))
                except Exception as exc:
                    msg["status"] = "error"
                    msg["error"] = _plain_error(
                        "PicklingError", "--pull %s: the value can't be pickled (%s: %s)" % (name, type(exc).__name__, exc)
                    )
                    break
        msg.update(self._reward_and_metrics())
        msg["stdout"] = "".join(self._out["stdout"])[-OUTPUT_KEEP:]
        msg["stderr"] = "".join(self._out["stderr"])[-OUTPUT_KEEP:]
        msg["started"] = started
        msg["ended"] = time.time()
        return msg

    def _execute(self, code, filename):
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        if pipsite is not None:
            code = pipsite.transform(code)  # %pip / !pip lines (the cache above keeps what was typed)
        tree = ast.parse(code, filename, "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        if tree.body:
            exec(compile(tree, filename, "exec"), self.ns)
        if last is not None:
            return eval(compile(last, filename, "eval"), self.ns)
        return None

    def _reward_and_metrics(self):
        reward = self.reported.get("reward", self.ns.get("reward"))
        out = {"reward": None, "metrics": {}, "reward_error": None}
        if reward is not None:
            try:
                out["reward"] = _finite_number(reward, "reward")
            except ValueError as exc:
                out["reward_error"] = str(exc)
        for key, val in (self.reported.get("metrics") or {}).items():
            key = str(key)[:200]
            if val is None or (isinstance(val, str) and len(val) <= 1000):
                out["metrics"][key] = val
                continue
            try:
                out["metrics"][key] = _finite_number(val, "metric %r" % key)
            except ValueError as exc:
                out["reward_error"] = out["reward_error"] or str(exc)
        return out

    def apply_seed(self, seed, name=None):
        """Seed this machine: ``SEED``, random, numpy (if imported), SMOLBENCH_SEED."""
        if name:
            self.name = name
        self.seed = seed
        self.ns["SEED"] = seed
        if seed is None:
            return
        os.environ["SMOLBENCH_SEED"] = str(seed)
        random.seed(seed)
        np = sys.modules.get("numpy")
        if np is not None:
            try:
                np.random.seed(seed % (2**32))
            except Exception:
                pass
        torch = sys.modules.get("torch")
        if torch is not None:
            try:
                torch.manual_seed(seed)
            except Exception:
                pass

    # -- branching -------------------------------------------------------------

    def fork(self, req):
        """Fork one live child per requested branch; answer with their pids."""
        frozen = None
        if self.machine is not None:
            old = contain.mount_ids([p for p in (self.workdir, "/tmp") if p])  # the overlays about to be swapped
            cwd = _getcwd()
            os.chdir("/")  # hold nothing of the overlay that the keeper swaps
            frozen = contain.ask_freeze(self.machine.chan)
            frozen["old_mounts"], frozen["cwd"] = old, cwd
            _chdir(cwd, self.workdir)  # re-enter the working folder through the fresh upper layer
            if "layers" not in self.machine.weak:  # files and folders kept open: onto the fresh upper
                contain.reopen(contain.open_files({i: (t, False) for i, t in old.items()}, self.machine.weak))
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
        # Move every object to the permanent generation: the branches' garbage collector
        # then never walks (and so never copies) the warm state's pages.
        gc.freeze()
        for child in req["children"]:
            os.makedirs(os.path.dirname(child["socket"]), 0o700, exist_ok=True)
            listener = self._listen(child["socket"])
            for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
                try:
                    stream.flush()
                except Exception:
                    pass
            pid = os.fork()
            if pid == 0:
                try:
                    self._become_child(child, listener, frozen)
                except BaseException as exc:
                    sys.__stderr__.write("smolbench agent: branch %s failed to start: %s\n" % (child["name"], exc))
                    os._exit(70)
                return "child"
            listener.close()
            self.children[pid] = child["name"]
            made.append({"name": child["name"], "pid": pid})
        done = {"t": "done", "status": "ok", "children": made}
        if frozen is not None and frozen["flattened"]:
            done["flattened"] = frozen["flattened"]
        return done

    def _become_child(self, child, listener, frozen=None):
        try:
            self._conn.close()  # the parent answers the fork request
        except OSError:
            pass
        self._conn = None
        self.listener.close()
        self.listener = listener
        self.sock_path = child["socket"]
        self.children = {}
        self._forking, self._nproc_lock = 0, threading.Lock()  # the parent's may be held right now
        self._busy = threading.Lock()
        self._send_lock = threading.Lock()
        self.outbox = _Outbox(self)
        self._queue = queue.Queue()
        self._running = False
        self.cell_count = 0
        _set_pdeathsig()
        if frozen is not None:
            view, frozen["view"] = frozen["view"], None
            self.machine = contain.start_branch(self.machine, frozen["lowers"], _plain_name(child["dir"]), view,
                                                frozen.get("old_mounts"))
            _chdir(frozen.get("cwd"), self.workdir)  # the parent's working folder, through our own overlay
            self.sock_path = os.path.join(contain.RUN, "s")
        else:
            self.isolation = _private_files(self.workdir, child["name"], mount_ns=self.mount_ns)
        self.apply_seed(child.get("seed"), child["name"])
        self._start_acceptor()

    # -- checkpoints -------------------------------------------------------------

    def save(self, path):
        """Save the namespace (what pickles) and the workspace files into directory ``path``."""
        import tarfile

        state, modules, skipped = {}, {}, []
        for key, val in list(self.ns.items()):
            if key.startswith("__") or key in ("display", "_"):
                continue
            if isinstance(val, types.ModuleType):
                modules[key] = val.__name__
                continue
            try:
                state[key] = _dumps(val)
            except Exception as exc:
                skipped.append("%s (%s)" % (key, type(exc).__name__))
        os.makedirs(path, exist_ok=True)
        blob = pickle.dumps({"vars": state, "modules": modules, "seed": self.seed, "name": self.name}, protocol=4)
        with open(os.path.join(path, "namespace.pkl"), "wb") as fh:
            fh.write(blob)
        with tarfile.open(os.path.join(path, "workspace.tar"), "w") as tar:
            if self.workdir and os.path.isdir(self.workdir):
                for entry in sorted(os.listdir(self.workdir)):
                    tar.add(os.path.join(self.workdir, entry), arcname=entry)
        return {"t": "done", "status": "ok", "skipped": skipped, "saved": sorted(state) + sorted(modules)}

    def load(self, path):
        """Bring back what :meth:`save` wrote: workspace files, then variables."""
        import tarfile

        ws = os.path.join(path, "workspace.tar")
        if self.workdir and os.path.exists(ws):
            with tarfile.open(ws) as tar:
                for member in tar.getmembers():
                    if member.name.startswith("/") or ".." in member.name.split("/"):  # "..." is a name
                        raise ValueError("unsafe path in checkpoint: %s" % member.name)
                if hasattr(tarfile, "data_filter"):  # Python 3.8.17+/3.12: links can't leave the workspace
                    tar.extractall(self.workdir, filter="data")
                else:
                    tar.extractall(self.workdir)
        with open(os.path.join(path, "namespace.pkl"), "rb") as fh:
            data = pickle.loads(fh.read())
        failed = []
        for key, modname in data.get("modules", {}).items():
            try:
                self.ns[key] = __import__(modname, fromlist=["_"])
            except Exception as exc:
                failed.append("%s (%s: %s)" % (key, type(exc).__name__, exc))
        for key, val in data["vars"].items():
            try:
                self.ns[key] = _loads(val)
            except Exception as exc:
                failed.append("%s (%s: %s)" % (key, type(exc).__name__, exc))
        if data.get("seed") is not None:
            self.apply_seed(data["seed"])
        return {"t": "done", "status": "ok", "skipped": failed, "saved": sorted(data["vars"]) + sorted(data.get("modules", {}))}


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


def _finite_number(value, what):
    """``value`` as a float, or ValueError with one line (bool, non-finite, beyond +-1e300)."""
    if isinstance(value, bool):
        raise ValueError("%s must be a number, not a bool (%r): use 1.0 / 0.0 if you mean it" % (what, value))
    try:
        f = float(value)
    except OverflowError:
        raise ValueError("%s must be a finite number within +-1e300, got one too large for a float (%s)"
                         % (what, type(value).__name__)) from None
    except (TypeError, ValueError):
        raise ValueError("%s must be a finite number, got %s" % (what, _short_repr(value))) from None
    if not math.isfinite(f) or abs(f) > NUMBER_LIMIT:
        raise ValueError("%s must be a finite number within +-1e300, got %s" % (what, _short_repr(value)))
    return f


def _short_repr(value):
    try:
        text = repr(value)
    except Exception:
        text = "a %s" % type(value).__name__
    return text if len(text) <= 60 else text[:59] + "..."


class _NotData(Exception):
    """A value that has no data-only form (its type name is the message)."""


def _type_name(value):
    t = type(value)
    return "%s.%s" % (t.__module__, t.__qualname__) if t.__module__ != "builtins" else t.__qualname__


def _npy(arr):
    np = sys.modules["numpy"]
    if arr.dtype.hasobject:
        raise _NotData("numpy array of Python objects")
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return P.b64(buf.getvalue())


def _pd_column(values, dtype):
    np = sys.modules["numpy"]
    arr = np.asarray(values)
    if not arr.dtype.hasobject and arr.dtype.kind != "O":
        return {"dtype": str(dtype), "values": {"$": "npy", "v": _npy(arr)}}
    pd = sys.modules["pandas"]
    items = [None if (not isinstance(x, (list, tuple, dict)) and pd.isna(x)) else x for x in list(values)]
    return {"dtype": str(dtype), "values": [_data(x, 1) for x in items]}


def _pd_index(index):
    pd = sys.modules["pandas"]
    if type(index) is pd.RangeIndex:
        return {"$": "range", "start": index.start, "stop": index.stop, "step": index.step, "name": _data(index.name, 1)}
    if isinstance(index, pd.MultiIndex):
        raise _NotData("pandas MultiIndex")
    return {"values": _pd_column(index, index.dtype), "name": _data(index.name, 1)}


def _data(value, depth=0):
    """``value`` as a JSON data tree the host rebuilds without running code (see smolbench/gate/pull.py)."""
    if depth > 100:
        raise _NotData("value nested more than 100 levels deep")
    t = type(value)
    if value is None or t in (bool, str, int):
        return value
    if t is float:
        return value if math.isfinite(value) else {"$": "float", "v": repr(value)}
    if t is list:
        return [_data(v, depth + 1) for v in value]
    if t in (tuple, set, frozenset):
        items = list(value)
        return {"$": t.__name__, "v": [_data(v, depth + 1) for v in items]}
    if t is dict:
        return {"$": "dict", "v": [[_data(k, depth + 1), _data(v, depth + 1)] for k, v in value.items()]}
    if t in (bytes, bytearray):
        return {"$": "bytes", "v": P.b64(bytes(value))}
    if t is complex:
        return {"$": "complex", "v": [value.real, value.imag]}
    np = sys.modules.get("numpy")
    if np is not None and t is np.ndarray:
        return {"$": "npy", "v": _npy(value)}
    if np is not None and isinstance(value, np.generic):
        return {"$": "npscalar", "v": _npy(np.asarray(value))}
    pd = sys.modules.get("pandas")
    if pd is not None and t is pd.Series:
        return {"$": "series", "values": _pd_column(value.array, value.dtype), "index": _pd_index(value.index),
                "name": _data(value.name, depth + 1)}
    if pd is not None and t is pd.DataFrame:
        if isinstance(value.columns, pd.MultiIndex):
            raise _NotData("pandas DataFrame with MultiIndex columns")
        return {"$": "dataframe", "columns": [_data(c, depth + 1) for c in value.columns],
                "index": _pd_index(value.index),
                "data": [_pd_column(value.iloc[:, i].array, value.dtypes.iloc[i]) for i in range(value.shape[1])]}
    raise _NotData(_type_name(value))


def _pull(value, trusted):
    """A ``--pull`` value in its wire form: data if it can be, else a pickle (trusted) or a refusal."""
    try:
        return {"format": "data", "data": _data(value)}
    except _NotData as exc:
        if trusted:
            return {"format": "pickle", "data": P.b64(_dumps(value))}
        return {"format": "refused", "type": str(exc)[:200]}


def _dumps(value):
    try:
        import cloudpickle  # shipped beside the agent; pickles cell-defined functions
    except ImportError:
        return pickle.dumps(value, protocol=4)
    return cloudpickle.dumps(value, protocol=4)


def _loads(blob):
    return pickle.loads(blob)


def _plain_error(ename, evalue):
    return {"ename": ename, "evalue": evalue, "traceback": []}


def _error_from_exc(filename):
    etype, evalue, tb = sys.exc_info()
    # Drop the agent's own frames: the traceback starts at the cell.
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    frames = traceback.format_tb(tb) if tb is not None else []
    if etype is not None and issubclass(etype, SyntaxError):
        frames = traceback.format_exception_only(etype, evalue)[:-1]
    return {"ename": etype.__name__ if etype else "Error", "evalue": str(evalue) + _net_note(evalue), "traceback": frames}


# -- the network policy, said where a connection fails ------------------------------------

_NET_ERRNOS = (111, 101, 113, 99)  # ECONNREFUSED, ENETUNREACH, EHOSTUNREACH, EADDRNOTAVAIL
_last_connect = threading.local()


def _audit(event, args):
    if event == "socket.connect":
        _last_connect.addr = args[1]


def watch_connects():
    """Remember each thread's last connect() target (an audit hook): a refused connection's
    error can then name the host, next to the machine's network policy."""
    if os.environ.get("SMOLBENCH_NET_POLICY"):
        sys.addaudithook(_audit)


def _net_note(exc):
    policy = os.environ.get("SMOLBENCH_NET_POLICY")
    seen = 0
    while exc is not None and policy and seen < 8:
        seen += 1
        if isinstance(exc, OSError) and exc.errno in _NET_ERRNOS:
            addr = getattr(_last_connect, "addr", None)
            where = "%s:%s" % addr[:2] if isinstance(addr, tuple) and len(addr) >= 2 else "that host"
            return ("\n(smolbench: %s is not reachable from this machine; its network policy is %s: "
                    "this host's own services and anything not listed are out of reach)" % (where, policy))
        exc = getattr(exc, "reason", None) if isinstance(getattr(exc, "reason", None), BaseException) else (
            exc.__cause__ or exc.__context__)
    return ""


# -- per-branch private files (Linux) --------------------------------------------

CLONE_NEWNS = 0x00020000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_BIND = 4096
PR_SET_PDEATHSIG = 1


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _set_pdeathsig():
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


# -- limits the host asked for (rlimits; cgroups are the host's business) ----------


def _apply_rlimits(rlimits):
    """Lower this process's rlimits, for good (inherited by everything it starts)."""
    import resource

    for item in rlimits:
        name, _, value = item.partition("=")
        limit = int(value)
        resource.setrlimit(getattr(resource, "RLIMIT_" + name), (limit, limit))


def main(argv=None):
    """Start the agent and serve until killed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--name", default="root")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--lib", default=None, help="extra import path appended to sys.path (cloudpickle)")
    ap.add_argument("--packages", default=None, help="the Smolfile's packages (a read-only folder) for sys.path")
    ap.add_argument("--ready", default=None, help="file to write once the socket is listening")
    ap.add_argument("--no-mount-ns", action="store_true", help="branches copy the workspace instead of mounting (host process)")
    ap.add_argument("--contain", action="store_true", help="sandbox: own namespaces, copy-on-write files, no privileges")
    ap.add_argument("--disk-mib", type=int, default=None, help="size of the machine's workspace + /tmp store")
    ap.add_argument("--net", action="store_true", help="tests only: share the host's network (SMOLBENCH_TEST_WEAKEN=net-share)")
    ap.add_argument("--keep", action="append", default=[], help="host path under /tmp bound in by the sandbox")
    ap.add_argument("--weaken", default="", help="tests only: containment steps to skip (seccomp, layers, branch-nproc, mount-guard, guard-maps, fd-reopen)")
    ap.add_argument("--grants-fd", type=int, default=None, help="contained: the host's pipe of branch store grants (mountguard.py)")
    ap.add_argument("--rlimit", action="append", default=[], help="NAME=VALUE, e.g. DATA=1073741824 (repeatable)")
    ap.add_argument("--pids", type=int, default=None,
                    help="contained, with RLIMIT_NPROC as the process cap: the machine's own count (and each branch's)")
    args = ap.parse_args(argv)
    weak = [w for w in args.weaken.split(",") if w]
    rlimits = list(args.rlimit)
    if args.pids and ("branch-nproc" in weak or not args.contain):  # no room for branches (tests: the old set-up)
        rlimits = [r for r in rlimits if not r.startswith("NPROC=")] + ["NPROC=%d" % args.pids]
    _apply_rlimits(rlimits)
    if args.lib:
        sys.path.append(args.lib)
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
        os.chdir(args.workdir)
    sys.path.insert(0, args.workdir or os.getcwd())
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    _set_pdeathsig()
    machine = None
    if args.contain:
        global contain
        contain = _load_protocol("contain")
        if "net-caps" in args.weaken:  # tests only: keep CAP_NET_ADMIN and CAP_NET_RAW in the machine's netns
            contain.KEEP_CAPS = (1 << 12) | (1 << 13)
        machine = contain.start_root(args.workdir, args.disk_mib, args.net, args.keep, weak=weak, nproc=args.pids,
                                     grants_fd=args.grants_fd)
    global pipsite
    pipsite = _load_protocol("pipsite")
    pipsite.setup(args.packages, args.workdir)  # after containment: its folder is in the machine's own workspace
    watch_connects()
    agent = Agent(args.socket, args.name, args.workdir)
    agent.mount_ns = not args.no_mount_ns
    agent.machine = machine
    agent._nproc_room(0)  # the root's hard limit has room for its branches; its soft, for itself
    if args.ready:
        with open(args.ready, "w") as fh:
            fh.write(str(os.getpid()))
    sys.__stdout__.write("smolbench agent %s ready (pid %d)\n" % (args.name, os.getpid()))
    sys.__stdout__.flush()
    agent.serve_forever()


if __name__ == "__main__":
    main()
