"""Enforced machine limits: memory, processes and CPUs, one cgroup per machine.

Mechanisms, best first (chosen once per kernel, shown by ``%smol status``):

* ``cgroup v2`` where the kernel's own cgroup delegates ``memory`` and ``pids``
  (we can create children there and enable the controllers);
* ``cgroup v1`` where the ``memory`` and ``pids`` hierarchies are writable
  (root on hosts that mount the v1 controllers);
* ``rlimits`` otherwise: ``RLIMIT_DATA`` per process and ``RLIMIT_NPROC``, which
  new kernels (5.14+) count per user namespace, so inside a sandbox it caps the machine.
  They count a branch's processes in its parent's namespace too, against the limit the
  branch's creator had at its unshare: a sandbox branch sets that to its parent's hard
  limit, then its own to ``pids`` (``guest/contain.py``). So a root machine's hard limit
  is ``nproc_ceiling``: its ``pids`` and room for ``BRANCH_ROOM`` full branches.

Every machine (and every live branch, so one branch's runaway cell can't take
its siblings or its parent down) gets its own cgroup under a group directory
named after the kernel (pid and start time). A machine joins its cgroup before
its first instruction (a ``sh`` prefix writes its pid to ``cgroup.procs`` and
execs), so nothing it starts can escape; deleting the machine kills everything
in the cgroup, waits until it is empty and removes it. Groups of kernels that
died (``kill -9``) are swept at the next start.

``RLIMIT_DATA`` (the memory limit) is applied inside the agent on every
mechanism: a cell that allocates past it gets ``MemoryError`` and the machine
lives on; the cgroup is the hard cap on the whole machine (subprocesses, tmpfs).

Why no library: the cgroup packages on PyPI are either v1-only and unmaintained
(cgroupspy, cgroup-utils, libcgroup bindings) or monitoring-only; what we need
is a few file writes, done here for both versions.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SmolbenchError
from ..spec import MachineSpec
from . import _procs

CGROUP_ROOT = Path("/sys/fs/cgroup")
GROUP_PREFIX = "smolbench-"
V1_CONTROLLERS = ("memory", "pids", "cpu")
V2_CONTROLLERS = ("memory", "pids", "cpu")
CFS_PERIOD = 100_000  # µs
KILL_TIMEOUT = 10.0
MOVE_PRIME_EVERY = 0.003  # s between the no-op moves that keep a fork's moves cheap (well within a grace period)
MOVE_PRIME_MOST = 60.0  # s they go on at most (a fork request answers long before)
# Emptied cgroups kept for the next machines (Limiter.machine), at most this many sets: a
# cgroup's mkdir, limits and rmdir cost ~0.25 ms of this process's CPU per branch (cgroup v1,
# three controllers), and the kernel's work of freeing a memory cgroup after it.
POOL_MOST = 512
POOL_CHARGE_MOST = 4 << 20  # bytes a pooled set may still be charged with (kernel objects, shared pages' cache)
ZOMBIE_WAIT = 0.2  # seconds a pooled set's killed processes get to be collected (then it is removed)
# What gives a machine and each branch their own count of memory, files in memory and processes.
DELEGATE_HINT = "run the kernel as root, or give it a delegated cgroup subtree of its own (memory and pids)"
# Under rlimits, how many full branches (each at its pids) a sandbox root machine's process
# count has room for: past that many at once, they can stop each other and the root.
BRANCH_ROOM = 32
# A test switch (set it in the kernel before `%smol up`): machines then run unlimited, which
# the limit tests use to show their probes do detect an overrun.
ENFORCE = True


def format_mib(mib: int) -> str:
    """2048 -> '2G', 1536 -> '1536M' (the Smolfile's own spelling)."""
    return f"{mib // 1024}G" if mib % 1024 == 0 else f"{mib}M"


THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")


def nproc_ceiling(pids: int) -> int:
    """The hard RLIMIT_NPROC of a sandbox root machine under rlimits: its own ``pids`` and
    ``pids`` for each of ``BRANCH_ROOM`` branches (the kernel counts theirs in the root's user
    namespace too), within this kernel's own limit (the sandbox's count is checked against it)."""
    cap = pids * (1 + BRANCH_ROOM)
    for lim in resource.getrlimit(resource.RLIMIT_NPROC):
        if lim != resource.RLIM_INFINITY:
            cap = min(cap, lim)
    return cap


def thread_env(spec: MachineSpec) -> dict[str, str]:
    """Numeric libraries size their thread pools (and OpenBLAS its per-thread buffers, which
    count against the memory limit) by the host's cores, not the machine's ``cpus``: tell them."""
    return {var: str(spec.cpus) for var in THREAD_VARS}


def out_of_memory_line(spec: MachineSpec, files: bool = False, said: object = None, saving: bool = False) -> str:
    """The one line a cell that ran out of memory gets. ``files``: the machine's files live in
    memory and its cgroup counted them (a sandbox's workspace, /tmp and /dev/shm), so the line
    says so and names ``disk``, whose full store fails writes with ENOSPC instead. ``said``:
    the error a backend gave the cell; that line when it is the files one (compared whole: a
    machine's own error text never passes as ours). ``saving``: it ran out while it saved a
    checkpoint (the line a save's lost machine gets: what a save holds in memory, and what helps)."""
    if not files and said is not None and said == out_of_memory_line(spec, files=True):
        files = True
    if saving:  # its files were there already (a save streams them out: no copy): lowering disk frees nothing
        held = f", its files included: up to disk = {format_mib(spec.files_mib)} of them" if files else ""
        return (f"machine ran out of memory while saving (limit {format_mib(spec.memory)}{held}; pickling a variable "
                "can take a copy of it in memory): delete big variables or files before saving, or raise memory in the Smolfile")
    if not files:
        return f"machine ran out of memory (limit {format_mib(spec.memory)}): raise memory in the Smolfile"
    return (f"machine ran out of memory (limit {format_mib(spec.memory)}, the files it wrote included: up to disk = "
            f"{format_mib(spec.files_mib)} of them): raise memory in the Smolfile, or lower disk so that a full disk "
            "fails writes with ENOSPC first")


MACHINE_MIB = 64  # what a machine's own processes take at least (its agent's Python), beside its files


def _mib(nbytes: int) -> int:
    return -(-nbytes // (1 << 20))


def _up_to(mib: int, step: int = 64) -> int:
    return -(-mib // step) * step


def room_refusal(spec: MachineSpec, files: int, namespace: int, label: str, *, counted: bool) -> str | None:
    """Why a checkpoint (``label``: as the user named it) can't be restored into a new sandbox
    machine of ``spec``, said before one starts; None when it fits. A sandbox keeps its files in
    memory, within ``disk``: ``files`` (bytes its workspace takes unpacked) more than disk fail
    with ENOSPC. Under a cgroup (``counted``) they count as its memory too, with its variables
    (``namespace``: bytes pickled, at least that much once loaded) and its own processes: more
    than memory and it is killed. The fix names both sizes: disk to hold the files, memory at
    twice disk at least (the default's ratio: half of memory is left for the machine itself)."""
    have, ns, disk = _mib(files), _mib(namespace), spec.files_mib
    over_disk = have > disk
    over_memory = counted and have + ns + MACHINE_MIB > spec.memory
    if not over_disk and not over_memory:
        return None
    want_disk = max(disk, _up_to(have + 16)) if over_disk else disk
    want_memory = max(spec.memory, 2 * want_disk, _up_to(have + 2 * ns + MACHINE_MIB))
    fix = (f'set disk = "{format_mib(want_disk)}" and memory = "{format_mib(want_memory)}"' if over_disk else
           f'set memory = "{format_mib(want_memory)}"')
    if over_disk:
        why = f"its files take {have} MiB, more than disk = {format_mib(disk)}"
    else:
        why = (f"its files ({have} MiB) and variables ({ns} MiB) with the machine's own {MACHINE_MIB} MiB are more "
               f"than memory = {format_mib(spec.memory)}, which counts the files a sandbox keeps in memory")
    return (f"checkpoint {label} doesn't fit in a machine of this Smolfile ({why}): {fix} in the Smolfile, or more "
            "(a sandbox keeps its files in memory: memory needs room for them and for the machine); nothing was "
            "started")


def disk_note(spec: MachineSpec, *, counted: bool) -> str | None:
    """One line at up for a Smolfile whose ``disk`` leaves its sandbox machine no memory of its own
    (None otherwise): its files are kept in memory and, under a cgroup (``counted``), counted as
    its memory, so files filling that disk take the machine out of memory before a write fails
    with ENOSPC. A notice, not a refusal: the same Smolfile sizes a microVM's real disk."""
    if not counted or not spec.disk_mib or spec.disk_mib + MACHINE_MIB <= spec.memory:
        return None
    return (f"disk = {format_mib(spec.disk_mib)} leaves memory = {format_mib(spec.memory)} no room: a sandbox keeps its "
            "files in memory, counted as its memory, so files filling the disk would kill the machine for memory "
            f'before a write fails with ENOSPC; set disk = "{format_mib(spec.default_files_mib)}" (half of memory, '
            "the default) or raise memory in the Smolfile")


# What a new branch takes of the host at least (measured by bench/scale.py: about 5 MiB PSS for
# its keeper and agent together), with a margin; and what the host keeps for itself.
BRANCH_HOST_MIB = 8
HOST_RESERVE_MIB = 512


def host_available_mib() -> int | None:
    """MemAvailable of this host in MiB (None where /proc/meminfo doesn't say)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    return None


def _room(free_mib: int) -> int:
    return max(0, (free_mib - HOST_RESERVE_MIB) // BRANCH_HOST_MIB)


def fork_room() -> int | None:
    """How many branches this host's available memory holds now (None: not known)."""
    free = host_available_mib()
    return None if free is None else _room(free)


def check_fork_fits(n: int) -> None:
    """Refuse up front, in one line, a fork of ``n`` branches this host can't hold."""
    free = host_available_mib()
    if free is None:
        return
    fits = _room(free)
    if n > fits:
        raise SmolbenchError(f"fork of {n} refused: this host has {free} MiB of memory available, room for about "
                             f"{fits} branches ({BRANCH_HOST_MIB} MiB each, {HOST_RESERVE_MIB} MiB kept): fork at most {fits}")


# -- finding a writable hierarchy ----------------------------------------------------------


def _own_cgroups() -> dict[str, str]:
    """controller (or '' for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    out: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def _mounts() -> dict[str, Path]:
    """controller (or '' for the v2 hierarchy) -> its mount point, from /proc/self/mountinfo."""
    out: dict[str, Path] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            left, _, right = line.partition(" - ")
            fstype, _, options = (right.split() + ["", "", ""])[:3]
            point = Path(left.split()[4])
            if fstype == "cgroup2":
                out.setdefault("", point)
            elif fstype == "cgroup":
                for opt in options.split(","):
                    if opt in V1_CONTROLLERS:
                        out.setdefault(opt, point)
    return out


def _probe_dir(base: Path) -> bool:
    probe = base / f"{GROUP_PREFIX}probe-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        probe.mkdir()
    except OSError:
        return False
    with contextlib.suppress(OSError):
        probe.rmdir()
    return True


def _v2_base() -> Path | None:
    mounts, own = _mounts(), _own_cgroups()
    if "" not in mounts or "" not in own:
        return None
    base = mounts[""] / own[""].lstrip("/")
    try:
        available = set((base / "cgroup.controllers").read_text().split())
    except OSError:
        return None
    if not {"memory", "pids"} <= available or not _probe_dir(base):
        return None
    try:
        enabled = set((base / "cgroup.subtree_control").read_text().split())
        missing = [c for c in V2_CONTROLLERS if c in available and c not in enabled]
        if missing:  # refused (EBUSY) when our own cgroup holds processes: not delegated to us
            (base / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in missing))
    except OSError:
        return None
    return base


def _v1_bases() -> dict[str, Path] | None:
    mounts, own = _mounts(), _own_cgroups()
    bases = {c: mounts[c] / own.get(c, "/").lstrip("/") for c in V1_CONTROLLERS if c in mounts}
    if "memory" not in bases or "pids" not in bases:
        return None
    if not all(_probe_dir(b) for b in bases.values()):
        bases.pop("cpu", None)  # cpu is a bonus; memory and pids are the point
        if not all(_probe_dir(b) for b in bases.values()):
            return None
    return bases


@dataclass
class Mechanism:
    """Which mechanism applies here, and where its cgroups live."""

    name: str  # "cgroup v2" | "cgroup v1" | "rlimits" | "none"
    bases: dict[str, Path] = field(default_factory=dict)  # controller ('' for v2) -> parent dir


_MECHANISM: Mechanism | None = None


def detect() -> Mechanism:
    """The best mechanism this process can use (probed once)."""
    global _MECHANISM
    if _MECHANISM is None:
        v2 = _v2_base()
        if v2 is not None:
            _MECHANISM = Mechanism("cgroup v2", {"": v2})
        else:
            v1 = _v1_bases()
            _MECHANISM = Mechanism("cgroup v1", v1) if v1 else Mechanism("rlimits")
    return _MECHANISM


# -- one machine's cgroup ----------------------------------------------------------------------


@dataclass
class MachineLimits:
    """The limits of one machine: its cgroup directories (none under rlimits)."""

    spec: MachineSpec
    dirs: list[Path]
    version: int  # 2, 1, or 0 for rlimits only
    enforce: bool = True
    widened: bool = False  # fork_headroom raised its pids.max (not back yet)

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` prefixed so the process joins this machine's cgroups before it runs."""
        if not self.dirs:
            return argv
        join = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
        return ["/bin/sh", "-c", join, "smolbench-limits", *[str(d / "cgroup.procs") for d in self.dirs], "--", *argv]

    def agent_args(self, nproc: int, pids: int | None = None) -> list[str]:
        """Arguments for the guest agent: the rlimits it applies to itself before serving
        (``nproc``: the RLIMIT_NPROC to use when there is no pids cgroup; ``pids``: a contained
        machine's own count below it, and each branch's)."""
        if not self.enforce:
            return []
        args = ["--rlimit", f"DATA={self.spec.memory * 1024 * 1024}"]
        if not self.dirs:  # no pids cgroup: the process cap falls to RLIMIT_NPROC
            args += ["--rlimit", f"NPROC={nproc}"]
            if pids is not None:
                args += ["--pids", str(min(pids, nproc))]
        return args

    def adopt(self, pids: list[int]) -> None:
        """Move processes into this machine's cgroups (a new branch, before it runs anything)."""
        for d in self.dirs:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, OSError):
                    _procs.write(d / "cgroup.procs", str(pid).encode())

    def fork_headroom(self, extra: int) -> None:
        """Let the machine briefly hold ``extra`` more tasks (0: back to its limit): branches it
        forks count here until they are moved into their own cgroups."""
        for d in self.dirs:
            if (d / "pids.max").exists():
                with contextlib.suppress(OSError, ValueError):
                    if extra and int((d / "pids.current").read_text()) >= self.spec.pids:
                        continue  # a machine at its limit can't fork: no headroom for it
                    self.widened = True  # until written back (a failed write back: never reused)
                    (d / "pids.max").write_text(str(self.spec.pids + extra))
                    self.widened = bool(extra)

    def pids(self, first: bool = False) -> set[int]:
        """Every process in this machine's cgroups (``first``: in its first one only)."""
        found: set[int] = set()
        for d in self.dirs[:1] if first else self.dirs:
            with contextlib.suppress(OSError):
                found.update(int(p) for p in _procs.read(d / "cgroup.procs").split())
        return found

    def oom_kills(self) -> int:
        """How many processes the kernel killed here for running out of memory."""
        # v2's one file, v1's in its memory cgroup (the first): twice per cell, never a miss
        names = {2: ("memory.events",), 1: ("memory.oom_control",)}.get(self.version, ("memory.events", "memory.oom_control"))
        for d in self.dirs:
            for name in names:
                with contextlib.suppress(OSError):
                    for line in _procs.read(d / name).splitlines():
                        key, _, value = line.partition(b" ")
                        if key == b"oom_kill":
                            return int(value)
        return 0

    def kill(self) -> bool:
        """SIGKILL everything in the cgroups until they are empty; True if they are."""
        return kill_all([self])[0]

    def _signal(self, left: set[int]) -> None:
        if self.version == 2:
            for d in self.dirs:
                with contextlib.suppress(OSError):
                    (d / "cgroup.kill").write_text("1")
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def remove(self) -> None:
        """Kill what is left and remove the directories."""
        remove_all([self])


def kill_all(machines: list[MachineLimits]) -> list[bool]:
    """:meth:`MachineLimits.kill` of many machines at once (a fork's deletes): one signal round
    for all of them, then one wait for all; whether each emptied."""
    deadline = time.monotonic() + KILL_TIMEOUT
    todo = list(range(len(machines)))
    while todo:
        # every process of a machine is in each of its cgroups (adopt, wrap): while its first one
        # has any, that one alone is read; all of them once it looks empty (one a move missed)
        left = [(i, pids) for i in todo if (pids := machines[i].pids(first=True) or machines[i].pids())]
        todo = [i for i, _ in left]
        if not todo or time.monotonic() > deadline:
            break
        for i, pids in left:
            machines[i]._signal(pids)
        time.sleep(0.005)
    return [i not in todo for i in range(len(machines))]


def remove_all(machines: list[MachineLimits]) -> list[bool]:
    """Kill what is left in many machines' cgroups and remove their directories, all in one
    wait (an rmdir refused for a moment after the last process exits is retried for all)."""
    emptied = kill_all(machines)
    _remove_dirs(machines)
    return emptied


def _remove_dirs(machines: list[MachineLimits]) -> None:
    dirs = [d for m in machines for d in m.dirs]
    for m in machines:
        m.dirs = []
    deadline = time.monotonic() + KILL_TIMEOUT
    while dirs:
        busy = []
        for d in dirs:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:  # EBUSY for a moment after the last process exits
                busy.append(d)
        dirs = busy
        if dirs and time.monotonic() < deadline:
            time.sleep(0.01)
        else:
            break


def _rmdir(d: Path) -> None:
    deadline = time.monotonic() + KILL_TIMEOUT
    while True:
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY for a moment after the last process exits
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)


def _write(path: Path, value: str) -> None:
    with contextlib.suppress(FileNotFoundError):  # a knob this kernel doesn't have
        path.write_text(value)


class Limiter:
    """One per backend: a group directory per controller, a cgroup per machine inside it."""

    def __init__(self) -> None:
        self.enforce = ENFORCE
        self.mechanism = detect() if self.enforce else Mechanism("none")
        self._machines: dict[str, MachineLimits] = {}
        self._groups: dict[str, Path] = {}
        # Emptied cgroups of machines that went (each checked empty then, nothing can join an
        # empty cgroup but by our own write), for the next machines: renamed, reconfigured if
        # their limits differ; removed at close. A set is in here or one live machine's, never both.
        self._pool: dict[str, MachineLimits] = {}  # by their cgroups' name
        self._pool_lock = threading.Lock()
        if self.mechanism.bases:
            sweep_stale_groups(self.mechanism)

    @property
    def version(self) -> int:
        return {"cgroup v2": 2, "cgroup v1": 1}.get(self.mechanism.name, 0)

    def describe(self, spec: MachineSpec, *, nproc_per_machine: bool) -> str:
        """One line for ``%smol status``: what is enforced, and how."""
        mem, cpus = format_mib(spec.memory), spec.cpus
        if self.mechanism.name == "none":
            return "none: limits are switched off (smolbench.backends._limits.ENFORCE = False)"
        if self.version:
            cpu = f", {cpus} cpu{'s' if cpus != 1 else ''}" if "cpu" in self.mechanism.bases or self.version == 2 else ""
            return (f"{self.mechanism.name}: memory {mem}, {spec.pids} processes{cpu} per machine and per branch "
                    f"(a cell past the memory limit fails in one line; the machine lives on)")
        ceiling = nproc_ceiling(spec.pids)
        own = min(spec.pids, ceiling)
        procs = (f"{own} processes per branch, its own branches included; per root machine {own} plus {own} per live "
                 f"branch, at most {ceiling} (RLIMIT_NPROC counts a branch in its parent too): a branch's fork bomb "
                 f"stops at {own} and leaves its parent and siblings theirs, up to {(ceiling - own) // max(own, 1)} "
                 f"full branches at once; a root cell that raises its own limit can take all {ceiling}, its branches' "
                 f"room included" if nproc_per_machine else
                 f"processes not capped per machine (RLIMIT_NPROC {spec.pids} counts all of this user's processes)")
        files = ("; files in memory (tmpfs) are bounded by disk (one store per branch) but not counted as memory, "
                 "and shared memory (shared mappings, memfd, System V) not at all: only a cgroup bounds a machine's "
                 "memory" if nproc_per_machine else "")
        return (f"rlimits (no writable cgroup here): memory {mem} per process (RLIMIT_DATA), {procs}{files}; cpus not "
                f"enforced. For a cgroup: {DELEGATE_HINT}")

    def keep_moves_cheap(self, stop: threading.Event, every: float = MOVE_PRIME_EVERY,
                         most: float = MOVE_PRIME_MOST) -> None:
        """Until ``stop`` (at most ``most`` s): keep moving tasks between cgroups cheap, by
        moving this process into the cgroup it is in already (``0`` is the writer itself: no
        other process's pid, which could be reused meanwhile) every ``every`` s. Every move takes
        the kernel's one cgroup migration lock, whose first writer after a quiet spell waits out
        an RCU grace period: measured ~10 ms here (cgroup v1), once per fork of N branches while
        they waited, forked and held, for their moves. Run beside the fork, it is spent while
        the agent forks, and the moves after it take ~15 us each. Where this process is no
        longer in the cgroup we found it in, or may not write there (cgroup v2 refuses a
        process in a cgroup that hands controllers down), it stops at once: the moves pay as before."""
        if not self.mechanism.bases:
            return
        controller, base = next(iter(self.mechanism.bases.items()))
        own = _own_cgroups().get(controller)
        if own is None or base != _mounts().get(controller, Path("/nonexistent")) / own.lstrip("/"):
            return
        try:
            fd = os.open(base / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            deadline = time.monotonic() + most
            while not stop.is_set() and time.monotonic() < deadline:
                try:
                    os.write(fd, b"0")
                except OSError:
                    return
                stop.wait(every)
        finally:
            os.close(fd)

    def _group(self, controller: str) -> Path:
        group = self._groups.get(controller)
        if group is None:
            group = self.mechanism.bases[controller] / f"{GROUP_PREFIX}{os.getpid()}-{_start_time(os.getpid())}-{uuid.uuid4().hex[:6]}"
            group.mkdir()
            if self.version == 2:
                available = set((group / "cgroup.controllers").read_text().split())
                _write(group / "cgroup.subtree_control", " ".join(f"+{c}" for c in V2_CONTROLLERS if c in available))
            self._groups[controller] = group
        return group

    def machine(self, name: str, spec: MachineSpec) -> MachineLimits:
        """Create the cgroups of a new machine (or branch) named ``name``."""
        self.release(name)
        safe = name.replace("/", "_")
        reused = self._reuse(safe, spec)
        if reused is not None:
            self._machines[name] = reused
            return reused
        dirs: list[Path] = []
        try:
            for controller in self.mechanism.bases:
                d = self._group(controller) / safe
                d.mkdir()
                dirs.append(d)
                self._configure(controller, d, spec)
        except OSError:
            for d in dirs:
                _rmdir(d)
            raise
        limits = MachineLimits(spec, dirs, self.version, self.enforce)
        self._machines[name] = limits
        return limits

    def _reuse(self, safe: str, spec: MachineSpec) -> MachineLimits | None:
        """An emptied set of cgroups from the pool, renamed ``safe`` and set to ``spec``'s
        limits; None if the pool is empty or it could not be (that set is removed)."""
        while True:
            with self._pool_lock:
                if not self._pool:
                    return None
                # one named so already goes first (a branch made again under its name): no two alike
                old = self._pool.pop(safe, None) or self._pool.popitem()[1]
            if self._charged(old) <= POOL_CHARGE_MOST:
                break
            old.remove()  # still charged with memory its last branch left (files it kept): never passed on
        dirs: list[Path] = []
        try:
            for d in old.dirs:
                new = d.with_name(safe)
                os.rename(d, new)  # within its parent: cheap, where mkdir and rmdir are not
                dirs.append(new)
            if old.spec != spec:
                for controller, d in zip(self.mechanism.bases, dirs):
                    self._configure(controller, d, spec)
        except OSError:  # e.g. a lower memory limit than what it still holds: made afresh
            MachineLimits(spec, dirs + old.dirs[len(dirs):], old.version).remove()
            return None
        return MachineLimits(spec, dirs, self.version, self.enforce)

    def _charged(self, m: MachineLimits) -> int:
        """The memory ``m``'s set is still charged with, in bytes (0 without a memory controller).
        A deleted branch's files that outlived it (its run folder's, until they are removed) stay
        charged to its cgroup: pooled, they counted against the next branch's limit (third audit)."""
        for controller, d in zip(self.mechanism.bases, m.dirs):
            name = {"": "memory.current", "memory": "memory.usage_in_bytes"}.get(controller)
            if name is not None:
                try:
                    return int(_procs.read(d / name))
                except (OSError, ValueError):
                    return POOL_CHARGE_MOST + 1
        return 0

    def _configure(self, controller: str, d: Path, spec: MachineSpec) -> None:
        mem = spec.memory * 1024 * 1024
        quota = spec.cpus * CFS_PERIOD
        if controller == "":  # v2: one directory, every controller
            _write(d / "memory.max", str(mem))
            _write(d / "memory.swap.max", "0")
            _write(d / "pids.max", str(spec.pids))
            _write(d / "cpu.max", f"{quota} {CFS_PERIOD}")
        elif controller == "memory":
            (d / "memory.limit_in_bytes").write_text(str(mem))
            with contextlib.suppress(OSError):  # absent without swap accounting
                (d / "memory.memsw.limit_in_bytes").write_text(str(mem))
        elif controller == "pids":
            (d / "pids.max").write_text(str(spec.pids))
        elif controller == "cpu":
            _write(d / "cpu.cfs_period_us", str(CFS_PERIOD))
            _write(d / "cpu.cfs_quota_us", str(quota))

    def get(self, name: str) -> MachineLimits | None:
        """The limits of a live machine, if it has any."""
        return self._machines.get(name)

    def release(self, name: str) -> None:
        """Kill everything left in a machine's cgroups and remove them."""
        self.release_all([name])

    def release_all(self, names: list[str], keep: bool = False) -> list[bool]:
        """:meth:`release` of many machines at once; whether each one's cgroups emptied (True
        where it had none). ``keep``: those that emptied go to the pool for the next machines
        (a fork's branch deletes), not removed."""
        found = [(i, m) for i, name in enumerate(names) if (m := self._machines.pop(name, None)) is not None]
        emptied = kill_all([m for _, m in found])
        out = [True] * len(names)
        kept: list[MachineLimits] = []
        gone: list[MachineLimits] = []
        with self._pool_lock:
            room = POOL_MOST - len(self._pool)
        # the fork's deletes wait for this batch: a parent that collects its children takes ~ms, only
        # one that never does costs the whole wait (its sets are then removed, not pooled)
        deadline = time.monotonic() + ZOMBIE_WAIT
        for (i, m), ok in zip(found, emptied):
            out[i] = ok
            # an emptied set, with the limits it was made with, is kept; as a new object (the
            # old one, that callers may still hold, has no cgroups from now on)
            if keep and ok and m.dirs and not m.widened and len(kept) < room and _no_pids(m, deadline):
                kept.append(MachineLimits(m.spec, m.dirs, m.version, m.enforce))
                m.dirs = []
            else:
                gone.append(m)
        _remove_dirs(gone)
        if kept:
            with self._pool_lock:
                self._pool.update((m.dirs[0].name, m) for m in kept)
        return out

    def close(self) -> None:
        """Release every machine and remove the group directories."""
        for name in list(self._machines):
            self.release(name)
        with self._pool_lock:
            pool, self._pool = list(self._pool.values()), {}
        remove_all(pool)
        for group in self._groups.values():
            _rmdir(group)
        self._groups.clear()


def _no_pids(m: MachineLimits, deadline: float) -> bool:
    """Nothing counts in ``m``'s pids any more, by ``deadline``. An emptied cgroup.procs isn't
    that: a killed process its parent hasn't collected yet (a zombie) still counts in
    pids.current, and a parent rewritten never to collect would pass its count on to the next
    branch (seventh audit). Such a set is removed (rmdir works), never pooled."""
    for d in m.dirs:
        while True:
            try:
                count = _procs.read(d / "pids.current").strip()
            except OSError:
                break  # not the pids controller's folder
            if count == b"0":
                break
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
    return True


def _start_time(pid: int) -> str:
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return ""
    return data[data.rfind(b")") + 2:].split()[19].decode()


def sweep_stale_groups(mechanism: Mechanism) -> list[Path]:
    """Remove group directories of kernels that are gone (killing what is left inside)."""
    removed = []
    version = 2 if mechanism.name == "cgroup v2" else 1
    for base in mechanism.bases.values():
        with contextlib.suppress(OSError):
            for group in base.iterdir():
                parts = group.name[len(GROUP_PREFIX):].split("-")
                if not group.name.startswith(GROUP_PREFIX) or len(parts) != 3 or not parts[0].isdigit():
                    continue
                pid, started = int(parts[0]), parts[1]
                if _start_time(pid) == started:
                    continue  # its kernel is alive: never touch a live owner's machines
                for d in [p for p in group.iterdir() if p.is_dir()]:
                    MachineLimits(MachineSpec(), [d], version).remove()
                _rmdir(group)
                removed.append(group)
    return removed
