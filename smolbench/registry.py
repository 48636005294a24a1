"""The machine registry: each kernel publishes its live machines for the Jupyter server.

One JSON file per kernel, ``<runtime dir>/smolbench/kernel-<kernel id>.json``, where the
runtime dir is the folder holding the kernel's connection file (so it is the runtime dir of
the server that started the kernel). A Workbench observer rewrites it atomically (temp file +
``os.replace``): at once when machines come or go, at most every ``WRITE_EVERY`` seconds for
status changes. Files, not a socket or a port: they need no server to be up, they
outlive a dead kernel (so its machines can be shown as orphaned), and a reader never sees half
a file. The record holds the kernel's pid and start time so readers can tell a dead kernel (or
a reused pid) from a live one.

Only the kernel writes here; the server (``smolbench.server``) reads and may remove a
record whose kernel and machines are all gone. Anyone who can write the folder can craft a
record, so reading one is bounded (its size, its machines, the files read per listing) and a
machine it names is killable only when that process carries its kernel's own mark
(``started_machine``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .backends import _procs

WRITE_EVERY = 0.2  # seconds between rewrites for status changes (a 64-branch fork: a handful, not 200)
SOON = 0.05  # a machine came or went: write now, unless the last write was this recent
FORMAT = 1
DIRNAME = "smolbench"
# What a crafted record may cost a listing. A kernel holds its kept machines (max_alive: at most
# 1024) and the branches of its forks (gate.limits.MAX_BRANCHES = 1024 each, a fork per machine at once):
# 4096 is four such forks alive together, more than a host holds. A machine's entry is ~350-450
# bytes (a cluster's node ids included), so 512 each is 2 MiB; parsing 2 MiB of the smallest
# containers (`[{},...]`) costs ~33x that, so a record with more `{`/`[` than a real one has is
# refused before it is parsed (the rest, strings and numbers, costs at most ~12x: ~25 MiB, once:
# records are read one at a time). A server has tens of kernels: 256 record files are read per
# listing (the first by name), at most 8 MiB of them (4 full records), out of the first 4096
# names in the folder. Whatever is over a cap is not read and said in ``skipped``.
MAX_MACHINES = 4096  # 4 x MAX_BRANCHES (not imported: the server imports this module alone)
MAX_RECORD_BYTES = MAX_MACHINES * 512
MAX_CONTAINERS = MAX_MACHINES + 64  # `{` and `[` bytes in a record: itself, its list, one per machine (+ text)
MAX_RECORDS = 256
MAX_LISTING_BYTES = 4 * MAX_RECORD_BYTES
MAX_NAMES = 16 * MAX_RECORDS
KERNEL_VAR = "SMOLBENCH_KERNEL"  # in a machine's host process: "<kernel pid>.<its start time>" (kernel_mark)
KERNEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def proc_start(pid: int) -> int | None:
    """A process's start time (clock ticks since boot), or None when it is gone.

    With the pid it names one process for good: a reused pid has another start time.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2:].split()
    if not fields or fields[0] == b"Z":
        return None
    return int(fields[19])


def kernel_mark() -> str:
    """This process's mark for the machines it starts (``KERNEL_VAR``): its pid and start time,
    which a record of it publishes too (``started_machine`` compares them)."""
    return f"{os.getpid()}.{proc_start(os.getpid())}"


def alive(pid: Any, start: Any) -> bool:
    """True when ``pid`` runs and is the process that started at ``start`` (without a start
    time there is no telling a reused pid from the original: not alive, never killed)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1 or not isinstance(start, int):
        return False
    return proc_start(pid) == start


def memory_mib(pid: Any, start: Any) -> tuple[float | None, str]:
    """How much memory the process ``pid`` holds, in MiB, and what was measured: its PSS
    (shared copy-on-write pages split between the branches sharing them) where /proc lets
    us read it, else its RSS (which counts shared pages in full)."""
    if not alive(pid, start):
        return None, ""
    for name, key in (("smaps_rollup", "Pss:"), ("status", "VmRSS:")):
        try:
            with open(f"/proc/{pid}/{name}") as fh:
                for line in fh:
                    if line.startswith(key):
                        return round(int(line.split()[1]) / 1024, 1), "PSS" if key == "Pss:" else "RSS"
        except OSError:
            continue
    return None, ""


def _connection_file() -> str | None:
    try:
        from ipykernel.connect import get_connection_file

        return str(get_connection_file())
    except Exception:  # not in a kernel (plain IPython, a script)
        return None


def kernel_identity() -> tuple[str, Path] | None:
    """This kernel's id and the registry folder its Jupyter server reads, or None when this
    is not a kernel a Jupyter server started (its connection file is not kernel-<id>.json):
    no server would ever list it, so it publishes nothing."""
    conn = _connection_file()
    if not conn:
        return None
    name = Path(conn).name
    kid = name[len("kernel-"):-len(".json")]
    if not (name.startswith("kernel-") and name.endswith(".json") and KERNEL_ID.fullmatch(kid)):
        return None
    return kid, Path(conn).resolve().parent / DIRNAME


def _where(workbench: Any, ref: Any) -> dict[str, Any]:
    """The cluster node of a machine (id, host, backend kind, lost); all None off a cluster."""
    node = ref.info.get("node")
    find = getattr(workbench.backend, "where", None)
    where = find(node) if node and find is not None else None
    return {"node": node, "node_host": (where or {}).get("host"),
            "node_backend": (where or {}).get("backend") or ref.info.get("node_backend"),
            "node_lost": bool((where or {}).get("lost"))}


def record(workbench: Any, kernel_id: str) -> dict[str, Any]:
    """What a kernel publishes about its workbench (plain JSON)."""
    machines = []
    pids: dict[int, Any] = {}
    for name, ref in list(workbench.machines.items()):
        pid = ref.info.get("pid")
        if not isinstance(pid, int):  # a branch lives inside its root machine's process
            root = workbench.machines.get(ref.info.get("root", ""))
            pid = root.info.get("pid") if root is not None else None
        if isinstance(pid, int) and pid not in pids:
            pids[pid] = proc_start(pid)
        node = workbench.tree[name] if name in workbench.tree else None
        agent = ref.info.get("host_pid")  # the machine's own agent process, as the host sees it
        machines.append({
            "id": name, "parent": ref.parent, "backend": ref.backend, "created": ref.created,
            "memory_mib": ref.spec.memory, "cpus": ref.spec.cpus,
            "pid": pid if isinstance(pid, int) else None, "pid_start": pids.get(pid),
            "agent_pid": agent if isinstance(agent, int) else None,
            **_where(workbench, ref),  # its Ray node (cluster backend), else None
            "agent_start": proc_start(agent) if isinstance(agent, int) else None,
            "status": node.status if node is not None else None,
            "reward": node.reward if node is not None and isinstance(node.reward, (int, float)) else None,
        })
    return {
        "format": FORMAT, "kernel_id": kernel_id, "pid": os.getpid(), "pid_start": proc_start(os.getpid()),
        "cwd": os.getcwd(), "notebook": os.environ.get("JPY_SESSION_NAME"),
        "backend": workbench.backend.name, "session": workbench.session,
        "ledger": str(Path(workbench.ledger.path).resolve()), "active": workbench.active,
        "updated": time.time(), "machines": machines,
    }


def write_atomic(path: Path, data: dict[str, Any]) -> None:
    """Replace ``path`` with ``data`` as JSON; readers see the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class Publisher:
    """A Workbench observer that keeps this kernel's registry file current."""

    def __init__(self, workbench: Any, folder: Path, kernel_id: str) -> None:
        self.kernel_id = kernel_id
        self.path = folder / f"kernel-{kernel_id}.json"
        _set_aside(self.path)
        self.workbench = workbench
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._written: set[str] = set()
        self._written_active: str | None = None
        self._at = 0.0
        workbench.observe(self._on_change)

    def _on_change(self, workbench: Any, nodes: Any) -> None:
        # machines came or went (up, fork, delete, down) or the active one moved (use, restore,
        # a deleted parent): the sidebar should know at once
        came_or_went = set(workbench.machines) != self._written and time.monotonic() - self._at > SOON
        if not workbench.machines or came_or_went or workbench.active != self._written_active:
            self.flush()
            return
        with self._lock:
            if self._timer is not None:
                return
            self._timer = threading.Timer(WRITE_EVERY, self.flush)
            self._timer.daemon = True
            self._timer.start()

    def flush(self) -> None:
        """Write the record now (or remove it when no machine is left)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._written, self._at = set(self.workbench.machines), time.monotonic()
            self._written_active = self.workbench.active
            try:
                if self.workbench.machines:
                    write_atomic(self.path, record(self.workbench, self.kernel_id))
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.path)
            except OSError:
                pass  # the registry is a convenience: a full disk must never break a run

    def close(self) -> None:
        """Stop observing and remove the record."""
        self.workbench.unobserve(self._on_change)
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def publish(workbench: Any) -> Publisher | None:
    """Start publishing ``workbench``'s machines, when a Jupyter server started this kernel
    (never raises: the registry is optional)."""
    try:
        who = kernel_identity()
        return Publisher(workbench, who[1], who[0]) if who else None
    except Exception:
        return None


def _set_aside(path: Path) -> None:
    """Keep an earlier record under this name (a restarted kernel keeps its id) when its
    process is dead but machines of it may live: renamed, the server still shows them."""
    old = _read_json(path)
    pid = old.get("pid") if isinstance(old, dict) else None
    if isinstance(pid, int) and pid != os.getpid() and not alive(pid, old.get("pid_start")):
        with contextlib.suppress(OSError):
            os.replace(path, path.with_name(f"{path.stem}~{pid}.json"))


def _read_json(path: Path) -> Any:
    """A record file's JSON, or None (see ``_read_bytes`` and ``_parse``)."""
    data = _read_bytes(path, [])
    return None if data is None else _parse(path.name, data, [])


def _read_bytes(path: Path, refused: list[str]) -> bytes | None:
    """A record file's bytes, or None: read only from a plain file (never through a link, never
    blocking on a fifo) of at most MAX_RECORD_BYTES (a larger one is said in ``refused``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):
                return None
            data = fh.read(MAX_RECORD_BYTES + 1) if st.st_size <= MAX_RECORD_BYTES else None
    except OSError:
        return None
    if data is None or len(data) > MAX_RECORD_BYTES:
        refused.append(f"{path.name}: over {MAX_RECORD_BYTES >> 20} MiB, not read")
        return None
    return data


def _parse(name: str, data: bytes, refused: list[str]) -> Any:
    """A record's JSON, or None: malformed, or holding more objects and lists (MAX_CONTAINERS)
    than a record of MAX_MACHINES has (said in ``refused``: parsed, `[{},{},...]` costs ~33x its size)."""
    if data.count(b"{") + data.count(b"[") > MAX_CONTAINERS:
        refused.append(f"{name}: more than the {MAX_MACHINES} machines a kernel has, not read")
        return None
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def started_machine(pid: int, start: Any, names: set[str], kernel_pid: Any, kernel_start: Any) -> bool:
    """Whether process ``pid`` (started at ``start``) is one smolbench started for one of the
    machines ``names`` of the kernel ``kernel_pid`` (started at ``kernel_start``), now dead: a
    session of its own, and ``SMOLBENCH_MACHINE=NAME`` and ``SMOLBENCH_KERNEL=PID.START`` in the
    environment it was started with (the sandbox's bwrap and the process backend's keeper get
    both, and never change them). A record's pid and start time alone named any process of the
    user's; its machine name alone (every kernel's first machine is ``root``) named another,
    live, kernel's machine."""
    numbers = all(isinstance(n, int) and not isinstance(n, bool) for n in (kernel_pid, kernel_start))
    if not numbers or alive(kernel_pid, kernel_start) or not alive(pid, start):
        return False  # (a live kernel's pid as text is not alive(), and would spell its mark)
    try:
        if os.getsid(pid) != pid:
            return False
    except OSError:
        return False
    own = f"{KERNEL_VAR}={kernel_pid}.{kernel_start}".encode()
    env = _procs.environ_holds(pid, [own, *(f"SMOLBENCH_MACHINE={n}".encode() for n in names)])
    marked = env is not None and own in env and any(e != own for e in env)  # and one of the machines' names
    return marked and alive(pid, start)  # (still that process once read)


def _names(folder: Path, skipped: list[str]) -> list[str]:
    """The names of the first MAX_RECORDS record files in ``folder`` (by name), of its first MAX_NAMES entries."""
    names: list[str] = []
    try:
        with os.scandir(folder) as entries:
            for i, entry in enumerate(entries):
                if i == MAX_NAMES:
                    skipped.append(f"the folder holds more than {MAX_NAMES} entries: the rest were not looked at")
                    break
                if entry.name.startswith("kernel-") and entry.name.endswith(".json"):
                    names.append(entry.name)
    except OSError:
        return []
    names.sort()
    if len(names) > MAX_RECORDS:
        skipped.append(f"{len(names) - MAX_RECORDS} record files past the first {MAX_RECORDS} (by name) were not read")
    return names[:MAX_RECORDS]


def read_records(folder: Path, skipped: list[str] | None = None) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every well-formed record in ``folder``, one at a time (a caller that drops each before
    the next holds one record at most; malformed ones and other than plain files are skipped).
    Within the caps (MAX_RECORDS files, MAX_LISTING_BYTES in all, MAX_MACHINES each): what is
    over one is not read, and said in ``skipped``."""
    skipped = [] if skipped is None else skipped
    spent = 0
    for name in _names(folder, skipped):
        raw = _read_bytes(folder / name, skipped)
        if raw is None:
            continue
        spent += len(raw)
        if spent > MAX_LISTING_BYTES:
            skipped.append(f"{name} and the records after it: past the {MAX_LISTING_BYTES >> 20} MiB a listing reads")
            return
        data = _parse(name, raw, skipped)
        del raw
        if isinstance(data, dict) and data.get("format") == FORMAT and isinstance(data.get("machines"), list):
            if len(data["machines"]) > MAX_MACHINES:
                skipped.append(f"{name}: more than the {MAX_MACHINES} machines a kernel has, not read")
            else:
                yield folder / name, data
        del data  # (not held while the next one is parsed)
