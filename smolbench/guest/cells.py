"""Running one cell: its code, output, pushes and pulls, reward and metrics.

Stdlib only, Python 3.8+: runs inside the machine (see ``agent.py``).
"""

import ast
import collections
import linecache
import math
import os
import sys
import time

from . import figures, orphans
from . import protocol as P
from .netnote import _net_note
from .output import OUTPUT_KEEP, _Stream, mime_bundle
from .pipsite import transform

NUMBER_LIMIT = 1e300  # rewards and metrics: finite numbers within +-1e300


class Cells:
    """The agent's cell runner (a part of ``serving.Agent``)."""

    def run_cell(self, req):
        """Execute one cell; return the final ``done`` message."""
        self.cell_count += 1
        filename = req.get("cell") or "<cell-%d>" % self.cell_count
        if self.name != self.started_as:
            # A branch inherited its ancestors' cells in linecache under the same names
            # ("<cell-1>"): name its own cells after it, so tracebacks show the right lines.
            filename = "<%s@%s>" % (filename.strip("<>"), self.name)
        self.reported = {}
        self._out = {"stdout": collections.deque(), "stderr": collections.deque()}
        self._out_size = {"stdout": 0, "stderr": 0}
        started = time.time()
        msg = {"t": "done", "status": "ok", "result": None, "error": None, "pulled": {}}
        old = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Stream(self, "stdout"), _Stream(self, "stderr")
        self._begin(req)
        try:
            msg["result"] = self._cell_body(req, filename)
        except BaseException:  # KeyboardInterrupt too: an interrupt lands only in _cell_body
            msg["status"] = "error"
            msg["error"] = _error_from_exc(filename)
        finally:
            self._end()
            orphans.after_cell()
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            sys.stdout, sys.stderr = old
        if msg["status"] == "ok" and req.get("pull"):
            from . import pulldata

            for name in req["pull"]:
                if name not in self.ns:
                    msg["status"] = "error"
                    msg["error"] = _plain_error("NameError", "no variable named %r in the machine to pull" % (name,))
                    break
                try:
                    msg["pulled"][name] = pulldata._pull(self.ns[name], bool(req.get("pull_trusted")))
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

    def _cell_body(self, req, filename):
        """The cell's own work, the one place an interrupt request stops (``serving._on_sigint``):
        its pushes, seed and code; its last expression's MIME bundle."""
        if req.get("push"):
            from . import pulldata  # only then: pickle and its kin are not on the ready path
        if req.get("seed") is not None:
            self.apply_seed(req["seed"])
        for name, blob in (req.get("push") or {}).items():
            self.ns[name] = pulldata._loads(P.unb64(blob))
        if req.get("reseed") and self.seed is not None:  # a branch's first cell: its own random streams
            from .reseed import reseed

            names = reseed(self.ns, self.seed)
            if names:
                self.reported["metrics"] = {"reseeded": ", ".join(names)[:1000]}  # recorded in the ledger
        value = None
        try:
            value = self._execute(req.get("code", ""), filename)
        finally:
            if "matplotlib.pyplot" in sys.modules:  # figures left open are shown, as Jupyter's inline backend does
                figures.flush(value)
        if value is None:
            return None
        self.ns["_"] = value
        return mime_bundle(value)

    def _execute(self, code, filename):
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        tree = ast.parse(transform(code), filename, "exec")  # %pip / !pip lines; the cache above keeps what was typed
        sets_reward = self.inherited_reward is not None and _binds(tree, "reward")
        last, value = None, None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        if tree.body:
            exec(compile(tree, filename, "exec"), self.ns)
        if last is not None:
            value = eval(compile(last, filename, "eval"), self.ns)
        if sets_reward:  # it ran to its end: set here, even to the value restored (45 is 45); a
            self.inherited_reward = None  # cell that failed first set one only if it changed (see below)
        return value

    def _reward_and_metrics(self):
        # A node's reward is the `reward` its own cells set (or report()): one a restore brought
        # back, or a branch had from its parent, is not, until a cell here sets one.
        stale = self.inherited_reward
        if stale is not None and self.ns.get("reward", stale) is not stale[0]:
            self.inherited_reward = stale = None
        reward = self.reported.get("reward", self.ns.get("reward") if stale is None else None)
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


def _binds(tree, name):
    """Whether a cell's module-level code binds (or deletes) ``name``: an assignment, an import
    as it, a ``for`` or ``with`` target... (a function's own locals are not the namespace's)."""
    todo = list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            if getattr(node, "name", None) == name:
                return True
            continue
        if isinstance(node, ast.comprehension):  # its own targets are its locals; a := is not
            todo.append(node.iter)
            todo.extend(node.ifs)
            continue
        if isinstance(node, ast.Name) and node.id == name and not isinstance(node.ctx, ast.Load):
            return True
        if isinstance(node, ast.alias) and (node.asname or node.name.split(".")[0]) == name:
            return True
        if isinstance(node, ast.ExceptHandler) and node.name == name:
            return True
        todo.extend(ast.iter_child_nodes(node))
    return False


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



def _plain_error(ename, evalue):
    return {"ename": ename, "evalue": evalue, "traceback": []}


def _error_from_exc(filename):
    import traceback

    etype, evalue, tb = sys.exc_info()
    # Drop the agent's own frames: the traceback starts at the cell.
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    entries = traceback.extract_tb(tb) if tb is not None else []
    if etype is KeyboardInterrupt:
        # the interrupt lands wherever the cell's thread is, also in the agent's own code under it
        # (its signal handler, writing a print's output): the user's last line is where it stopped
        here = os.path.dirname(os.path.abspath(__file__))
        for i, entry in enumerate(entries):
            if i and os.path.dirname(os.path.abspath(entry.filename)) == here:
                entries = entries[:i]
                break
    frames = traceback.format_list(entries)
    if etype is not None and issubclass(etype, SyntaxError):
        frames = traceback.format_exception_only(etype, evalue)[:-1]
    return {"ename": etype.__name__ if etype else "Error", "evalue": str(evalue) + _net_note(evalue), "traceback": frames}

