"""Run notebook cells in a real ipykernel (through nbclient) and read what they produced.

Shared by the end-to-end tests. Every kernel gets a unique tag in its environment;
the machines it starts inherit it (the sandbox's outer ``bwrap`` process, or the
agent itself without bwrap), and whatever runs inside a sandbox descends from that
process. So "the processes this kernel left behind" is a precise question:

    with NotebookSession(tmp_path) as nb:
        nb.run("%load_ext smolbench")
        nb.run("%smol up --backend sandbox")
        nb.processes()           # the kernel's machines, live right now
    # leaving the block shuts the kernel down and asserts none of them remain

``run_notebook(cells, cwd)`` is the one-shot form.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import shutil
import signal
import tempfile
import time
import uuid
from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType
from typing import Any

import nbformat
import zmq
import zmq.asyncio
from jupyter_client.asynchronous import AsyncKernelClient
from nbclient import NotebookClient
from nbformat import NotebookNode
from traitlets.config import Config

TAG_VAR = "SMOLBENCH_TEST_TAG"
SETTLE_TIMEOUT = 20.0  # seconds for machines to go after their kernel has


class Proc:
    """One host process: pid, parent pid, command line."""

    def __init__(self, pid: int, ppid: int, cmdline: str) -> None:
        self.pid = pid
        self.ppid = ppid
        self.cmdline = cmdline

    def __repr__(self) -> str:
        return f"Proc({self.pid}, ppid={self.ppid}, {self.cmdline[:120]!r})"


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:  # gone, or not ours to read
        return None


def tagged_processes(tag: str, var: str = TAG_VAR) -> list[Proc]:
    """Live processes whose environment carries ``var=tag`` (except kernels), and all their
    descendants: the machines a tagged kernel started, wherever they were reparented."""
    procs: dict[int, Proc] = {}
    marked: set[int] = set()
    needle = f"{var}={tag}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _read(f"/proc/{entry}/stat")
        if stat is None:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if fields[0] == b"Z":  # a zombie is dead; its parent just hasn't reaped it yet
            continue
        pid = int(entry)
        cmd = (_read(f"/proc/{entry}/cmdline") or b"").replace(b"\0", b" ").decode(errors="replace").strip()
        procs[pid] = Proc(pid, int(fields[1]), cmd)
        env = _read(f"/proc/{entry}/environ") or b""
        if needle in env.split(b"\0") and "ipykernel" not in cmd:
            marked.add(pid)
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    found: set[int] = set()
    todo = list(marked)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return [procs[p] for p in sorted(found)]


def wait_for_no_processes(tag: str, timeout: float = SETTLE_TIMEOUT, var: str = TAG_VAR) -> list[Proc]:
    """Poll until no tagged process remains; returns what is still there at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        left = tagged_processes(tag, var)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


class _UnboundedClient(AsyncKernelClient):
    """nbclient's client, whose sockets take in all the kernel sends.

    The kernel publishes IOPub without waiting for anyone (a ZeroMQ PUB socket): when a
    subscriber's queue is full (1,000 messages by default each side) it drops what comes
    next, the cell's error and its idle among them. A test's client parses each message
    in Python; on a loaded host it fell behind a million-display flood and lost its tail
    (CI, 2026-12-07), which no cell output of ours can prevent. Here the socket's own
    thread queues everything, so a test sees what the kernel sent, not how fast it read
    it. (In a browser, Jupyter's server rate limit thins such a flood before it renders.)
    """

    def _context_default(self) -> zmq.asyncio.Context:
        context = super()._context_default()
        context.setsockopt(zmq.RCVHWM, 0)  # 0: no limit
        return context


class NotebookSession(AbstractContextManager["NotebookSession"]):
    """A real ipykernel started in ``cwd``; ``run()`` executes one cell at a time.

    On exit the kernel is shut down and every machine it started must be gone
    (an AssertionError names the survivors) unless ``check_processes=False``.
    """

    def __init__(self, cwd: Path, timeout: float = 120, allow_errors: bool = False, *,
                 check_processes: bool = True, transport: str = "ipc") -> None:
        self.cwd = Path(cwd)
        self.tag = uuid.uuid4().hex
        self.check_processes = check_processes
        self.nb = nbformat.v4.new_notebook()
        # IPC sockets, not TCP ports: kernels of tests running side by side can't collide.
        self._ipc_dir = tempfile.mkdtemp(prefix="nbk-")
        # (``transport="tcp"``: Jupyter's default, ports on 127.0.0.1, for tests that attack them)
        ip = os.path.join(self._ipc_dir, "k") if transport == "ipc" else "127.0.0.1"
        config = Config({"KernelManager": {"transport": transport, "ip": ip, "client_factory": _UnboundedClient}})
        # iopub_timeout: a flood's last outputs, still queued when the reply came, took nbclient's
        # default 4 s (and once, for 1 s of a display flood at a million displays, over 30 s) to arrive
        # on a loaded host, which then dropped them, the cell's error with them. Waiting as long as a
        # cell may run costs nothing when outputs come on time: the wait ends at the kernel's idle.
        self.client = NotebookClient(self.nb, timeout=int(timeout), kernel_name="python3", config=config,
                                     allow_errors=allow_errors, iopub_timeout=int(timeout),
                                     resources={"metadata": {"path": str(self.cwd)}})
        self._setup: Any = None

    def __enter__(self) -> NotebookSession:
        env = {**os.environ, TAG_VAR: self.tag}
        self._setup = self.client.setup_kernel(env=env, cwd=str(self.cwd))
        self._setup.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self._setup.__exit__(exc_type, exc, tb)
        finally:
            left = wait_for_no_processes(self.tag)
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
        if self.check_processes and left and exc_type is None:
            raise AssertionError(f"processes left behind by the kernel: {left}")

    # -- running cells ------------------------------------------------------------

    def run(self, source: str) -> NotebookNode:
        """Execute one cell and return it (with its outputs)."""
        cell = nbformat.v4.new_code_cell(source)
        self.nb.cells.append(cell)
        return self.client.execute_cell(cell, len(self.nb.cells) - 1)

    def run_counted(self, source: str) -> tuple[NotebookNode, dict[str, int]]:
        """Execute one cell; also count the IOPub messages (by type) heard while it ran, its own
        and any other (a widget's state sent from another thread carries any parent)."""
        kc = self.client.kc
        assert kc is not None
        channel = kc.iopub_channel
        counts: dict[str, int] = {}
        get_msg = channel.get_msg

        async def counted(*args: Any, **kwargs: Any) -> Any:
            msg = get_msg(*args, **kwargs)
            if inspect.isawaitable(msg):
                msg = await msg
            kind = msg["header"]["msg_type"]
            counts[kind] = counts.get(kind, 0) + 1
            return msg

        channel.get_msg = counted  # type: ignore[method-assign]
        try:
            return self.run(source), counts
        finally:
            del channel.get_msg

    # -- the kernel -----------------------------------------------------------------

    @property
    def kernel_pid(self) -> int:
        """The kernel's process id."""
        km = self.client.km
        assert km is not None and km.provisioner is not None
        return int(km.provisioner.process.pid)  # type: ignore[attr-defined]

    def kernel_ports(self) -> list[int]:
        """The kernel's TCP ports (shell, iopub, stdin, control, heartbeat) on 127.0.0.1."""
        km = self.client.km
        assert km is not None
        info = km.get_connection_info()
        return [int(info[k]) for k in ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")]

    def interrupt(self) -> None:
        """Ctrl-C, the way Jupyter sends it (``KernelManager.interrupt_kernel``); any thread."""
        km = self.client.km
        assert km is not None
        asyncio.run(km.interrupt_kernel())

    def kill(self) -> None:
        """kill -9 the kernel process."""
        os.kill(self.kernel_pid, signal.SIGKILL)

    def processes(self) -> list[Proc]:
        """The machines' processes this kernel started that are alive now."""
        return tagged_processes(self.tag)


def run_notebook(cells: list[str], cwd: Path, timeout: float = 120, allow_errors: bool = False, *,
                 check_processes: bool = True) -> NotebookNode:
    """Run ``cells`` in a fresh kernel started in ``cwd``; return the executed notebook.

    The kernel is shut down before this returns, and (unless ``check_processes`` is
    False) no process it started may remain.
    """
    with NotebookSession(cwd, timeout, allow_errors, check_processes=check_processes) as session:
        for source in cells:
            session.run(source)
    return session.nb


# -- reading outputs ------------------------------------------------------------------


def stream_text(cell: NotebookNode, name: str = "stdout") -> str:
    """Everything the cell wrote to one stream."""
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == name)


def notices(cell: NotebookNode) -> str:
    """The ``smolbench: ...`` news a cell printed (output, not stderr, since the Session's
    magics), with whatever it wrote to stderr."""
    return stream_text(cell) + stream_text(cell, "stderr")


def plain_texts(cell: NotebookNode) -> list[str]:
    """The text/plain of every display and result, in order (updated displays as last shown)."""
    return [str(o["data"]["text/plain"]) for o in cell.outputs
            if o.output_type in ("display_data", "execute_result", "update_display_data") and "text/plain" in o.get("data", {})]


def tree_text(cell: NotebookNode) -> str:
    """The node lines of ``%smol tree``'s text copy (its static copy's text/plain, less the
    summary line on top)."""
    texts = plain_texts(cell)
    return texts[-1].split("\n", 1)[1] if texts and "\n" in texts[-1] else ""


def result_text(cell: NotebookNode) -> str | None:
    """The text/plain of the cell's Out[n], if it has one."""
    outs = [o for o in cell.outputs if o.output_type == "execute_result"]
    return str(outs[0]["data"]["text/plain"]) if outs else None


def error_output(cell: NotebookNode) -> NotebookNode | None:
    """The cell's error output (ename, evalue, traceback), if it raised."""
    errs = [o for o in cell.outputs if o.output_type == "error"]
    return errs[0] if errs else None


def error_text(cell: NotebookNode) -> str:
    """The cell's error traceback as plain text (ANSI colours removed); '' if none."""
    import re

    err = error_output(cell)
    if err is None:
        return ""
    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(err.traceback))


def one_line(cell: NotebookNode) -> str:
    """The cell's error, which must be one line with no traceback of our layers."""
    import re

    err = error_output(cell)
    assert err is not None, f"expected an error, got {cell.outputs}"
    assert len(err.traceback) == 1, err.traceback
    text = re.sub(r"\x1b\[[0-9;]*m", "", err.traceback[0])
    assert "\n" not in text
    return text


def ok(cell: NotebookNode) -> NotebookNode:
    """The cell, asserted to have run without an error."""
    assert error_output(cell) is None, error_text(cell)
    return cell


AGENT = "/run/smolbench-agent/agent.py"


def agent_processes(nb: NotebookSession) -> tuple[int, int]:
    """(machines, other processes running the agent's code) of this kernel's sandbox machines:
    a machine's agent is pid 1 of its own pid namespace; the others are keepers and a leaf
    fork's makers."""
    machines = others = 0
    for p in nb.processes():
        if AGENT not in p.cmdline or p.cmdline.split()[0].endswith("bwrap"):
            continue
        try:
            status = Path(f"/proc/{p.pid}/status").read_text()
        except OSError:
            continue
        nspid = next((ln.split()[1:] for ln in status.splitlines() if ln.startswith("NSpid:")), [])
        if nspid and nspid[-1] == "1":
            machines += 1
        elif nspid:
            others += 1
    return machines, others
