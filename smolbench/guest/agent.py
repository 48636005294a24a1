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


def mime_bundle(value):
    """A Jupyter MIME bundle for ``value`` (text/plain always present)."""
    data = {}
    for mime, meth in MIME_METHODS:
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


class _Stream(io.TextIOBase):
    """sys.stdout / sys.stderr replacement that streams writes to the host.

    Text is sent at each line end (or carriage return, for progress bars) and on
    flush(), so a print() costs one message, not one per argument.
    """

    def __init__(self, agent, name):
        self._agent = agent
        self.name = name
        self._buf = []

    def writable(self):
        return True

    def write(self, text):
        if not isinstance(text, str):
            raise TypeError("write() argument must be str, not %s" % type(text).__name__)
        if text:
            self._buf.append(text)
            if "\n" in text or "\r" in text:
                self.flush()
        return len(text)

    def flush(self):
        if self._buf:
            text, self._buf = "".join(self._buf), []
            self._agent.stream(self.name, text)

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
            self._agent.send({"t": "display", "data": mime_bundle(obj)})

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
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _reap_loop(self):
        me = os.getpid()
        rounds = 0
        while os.getpid() == me:
            rounds += 1
            if self.machine is not None and rounds % 5 == 0:
                contain.reap_orphaned_branches()
            for pid in list(self.children):
                try:
                    done, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    done = pid
                if done:
                    self.children.pop(pid, None)
            time.sleep(0.2)

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
        return {
            "name": self.name,
            "pid": os.getpid(),
            "python": sys.version.split()[0],
            "executable": sys.executable,
            "busy": self._running,
            "seed": self.seed,
            "cells": self.cell_count,
            "workdir": self.workdir,
            "hostname": socket.gethostname(),
            "containment": contain.info(self.machine) if self.machine is not None else None,
        }

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
        with self._send_lock:
            try:
                conn.sendall(P.encode(msg))
            except OSError:
                self._conn = None  # host went away; keep running the cell

    def stream(self, name, text):
        """Stream text written by the cell; keep the tail for the result record."""
        buf = self._out[name]
        buf.append(text)
        self.send({"t": "stream", "name": name, "text": text})

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
        self._out = {"stdout": [], "stderr": []}
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
                    msg["pulled"][name] = P.b64(_dumps(self.ns[name]))
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
                r = float(reward)
                if not math.isfinite(r):
                    raise ValueError("not finite")
                out["reward"] = r
            except (TypeError, ValueError):
                out["reward_error"] = "reward must be a finite number, got %r" % (reward,)
        for key, val in (self.reported.get("metrics") or {}).items():
            if isinstance(val, (int, float, str, bool)) or val is None:
                out["metrics"][key] = val
            else:
                try:
                    out["metrics"][key] = float(val)
                except (TypeError, ValueError):
                    out["metrics"][key] = repr(val)[:200]
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
        made = []
        frozen = contain.ask_freeze(self.machine.chan) if self.machine is not None else None
        if frozen is not None and self.workdir:
            os.chdir(self.workdir)  # re-enter the workspace through its fresh upper layer
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
        self._busy = threading.Lock()
        self._send_lock = threading.Lock()
        self._queue = queue.Queue()
        self._running = False
        self.cell_count = 0
        _set_pdeathsig()
        if frozen is not None:
            self.machine = contain.start_branch(self.machine, frozen["lowers"], _plain_name(child["dir"]))
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
                    if member.name.startswith(("/", "..")) or "/../" in member.name:
                        raise ValueError("unsafe path in checkpoint: %s" % member.name)
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
    return {"ename": etype.__name__ if etype else "Error", "evalue": str(evalue), "traceback": frames}


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
            shutil.copytree(path, copy, symlinks=True)
            _mount(libc, copy, path, None, MS_BIND | MS_REC)
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


def main(argv=None):
    """Start the agent and serve until killed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--name", default="root")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--lib", default=None, help="extra import path appended to sys.path (cloudpickle)")
    ap.add_argument("--ready", default=None, help="file to write once the socket is listening")
    ap.add_argument("--no-mount-ns", action="store_true", help="branches copy the workspace instead of mounting (host process)")
    ap.add_argument("--contain", action="store_true", help="sandbox: own namespaces, copy-on-write files, no privileges")
    ap.add_argument("--disk-mib", type=int, default=None, help="size of the machine's workspace + /tmp store")
    ap.add_argument("--net", action="store_true", help="keep the network (no own net namespace for branches)")
    ap.add_argument("--keep", action="append", default=[], help="host path under /tmp bound in by the sandbox")
    ap.add_argument("--weaken", default="", help="tests only: containment steps to skip (seccomp)")
    args = ap.parse_args(argv)
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
        machine = contain.start_root(args.workdir, args.disk_mib, args.net, args.keep,
                                     seccomp_filter="seccomp" not in args.weaken)
    agent = Agent(args.socket, args.name, args.workdir)
    agent.mount_ns = not args.no_mount_ns
    agent.machine = machine
    if args.ready:
        with open(args.ready, "w") as fh:
            fh.write(str(os.getpid()))
    sys.__stdout__.write("smolbench agent %s ready (pid %d)\n" % (args.name, os.getpid()))
    sys.__stdout__.flush()
    agent.serve_forever()


if __name__ == "__main__":
    main()
