"""Shared pieces of the benchmarks: machine info, statistics, a side-by-side comparison of
two sandbox backends, a real Jupyter kernel, /proc memory accounting of a sandbox's process
tree, and process hygiene.

Nothing here asserts timings; every number is measured and written to JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import json
import os
import platform
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Set by run.py: how long to wait for a quiet host before each timed stage.
CONFIG: dict[str, Any] = {"quiet_wait": 0.0, "quiet_budget": 0.0}

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"

# --------------------------------------------------------------------------- machine info


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def machine_info(backend: str) -> dict[str, Any]:
    """Where and with what the numbers were taken."""
    cpu = next((ln.split(":", 1)[1].strip() for ln in _read("/proc/cpuinfo").splitlines() if ln.startswith("model name")), platform.processor())
    mem_kb = next((int(ln.split()[1]) for ln in _read("/proc/meminfo").splitlines() if ln.startswith("MemTotal")), 0)
    versions: dict[str, str | None] = {}
    for mod in ("smolbench", "ipykernel", "jupyter_client", "ipyparallel", "IPython", "cloudpickle", "numpy"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:
            versions[mod] = None
    try:
        bwrap = subprocess.run(["bwrap", "--version"], capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:
        bwrap = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "smolbench"], cwd=REPO, capture_output=True, text=True, timeout=5).stdout.strip())
    except Exception:
        commit, dirty = None, None
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "backend": backend,
        "cores": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(mem_kb / 2**20, 1),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "os": f"{platform.system()} {platform.release()}",
        "kvm": os.path.exists("/dev/kvm"),
        "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "bwrap": bwrap,
        "git_commit": commit,
        "smolbench_tree_dirty": dirty,
        "versions": versions,
    }


def code_state() -> dict[str, Any]:
    """The git commit and a hash of the smolbench sources actually on disk (other engineers edit
    them while benchmarks run: a run is only consistent if this is the same at its start and end)."""
    import hashlib

    h = hashlib.sha256()
    for path in sorted((REPO / "smolbench").rglob("*.py")):
        h.update(str(path.relative_to(REPO)).encode())
        with contextlib.suppress(OSError):
            h.update(path.read_bytes())
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:
        commit = None
    return {"git_commit": commit, "sources_sha256": h.hexdigest()[:16], "at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}


# --------------------------------------------------------------------------- statistics


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between order statistics."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary(values_s: list[float], unit: float = 1e3) -> dict[str, Any]:
    """median / p95 / mean / min / max of seconds, in ms by default (unit=1e3)."""
    v = [x * unit for x in values_s]
    if not v:
        return {"n": 0}
    return {
        "n": len(v),
        "median": round(statistics.median(v), 3),
        "p95": round(pct(v, 95), 3),
        "mean": round(statistics.fmean(v), 3),
        "min": round(min(v), 3),
        "max": round(max(v), 3),
    }


# --------------------------------------------------------------------------- two sandboxes, side by side


@dataclass
class Side:
    """One column of a side-by-side comparison of two sandbox backends (bench/limits.py,
    bench/mountguard.py): ``setting()`` is in effect while its backend is made and its
    machine started; ``describe(backend, machine, spec)`` says what that side enforces."""

    label: str
    setting: Callable[[], contextlib.AbstractContextManager[Any]]
    describe: Callable[[Any, Any, Any], Awaitable[str]]


WARM_STATE = "state = bytearray(200 << 20)\nstate[::4096] = b'x' * len(state[::4096])"


async def compare_sandboxes(sides: Sequence[Side], rounds: int, run_dir: str, forks: Sequence[int] = (16,)) -> dict[str, Any]:
    """Two (or more) sandbox backends in one process, a 200 MiB warm machine each, rounds
    interleaved (the order flips every round) so host load hits them alike. Per round and side:
    ``raw_exec``, ten ``exec_cell("pass")`` round trips; for each N in ``forks``, ``forkN``: a
    ``branch`` of N until every branch answered a first cell, and ``deleteN``: deleting them.
    Returns {label: {"mechanism": describe(...), key: {"median_ms", "min_ms", "n"}}}."""
    from smolbench.backends.base import CellRequest
    from smolbench.backends.sandbox import SandboxBackend
    from smolbench.spec import MachineSpec

    spec = MachineSpec(memory=2048)
    keys = ["raw_exec", *(f"{what}{n}" for n in forks for what in ("fork", "delete"))]
    cols: list[dict[str, Any]] = []
    try:
        for side in sides:
            with side.setting():
                backend = SandboxBackend(runtime_dir=run_dir)
                cols.append({"label": side.label, "backend": backend, **{k: [] for k in keys}})
                ref = await backend.create(spec, "root")
                await backend.exec_cell(ref, CellRequest(WARM_STATE), lambda e: None)
                cols[-1].update(ref=ref, mechanism=await side.describe(backend, ref, spec))
        for r in range(rounds):
            for col in (cols if r % 2 == 0 else cols[::-1]):
                b, ref = col["backend"], col["ref"]
                for _ in range(10):
                    t0 = time.perf_counter()
                    await b.exec_cell(ref, CellRequest("pass"), lambda e: None)
                    col["raw_exec"].append((time.perf_counter() - t0) * 1e3)
                for n in forks:
                    t0 = time.perf_counter()
                    kids = await b.branch(ref, [f"root.{r}.{n}.{i}" for i in range(n)], list(range(n)))
                    await asyncio.gather(*(b.exec_cell(k, CellRequest("SEED"), lambda e: None) for k in kids))
                    col[f"fork{n}"].append((time.perf_counter() - t0) * 1e3)
                    t0 = time.perf_counter()
                    await asyncio.gather(*(b.delete(k) for k in kids))
                    col[f"delete{n}"].append((time.perf_counter() - t0) * 1e3)
    finally:
        for col in cols:
            await col["backend"].close()
    out: dict[str, Any] = {}
    for col in cols:
        out[col["label"]] = {"mechanism": col["mechanism"]}
        for key in keys:
            vals = col[key]
            out[col["label"]][key] = {"median_ms": statistics.median(vals), "min_ms": min(vals), "n": len(vals)}
    return out


def run_compare(sides: Sequence[Side], rounds: int, prefix: str, forks: Sequence[int] = (16,)) -> dict[str, Any]:
    """:func:`compare_sandboxes` in a temporary run folder, with machine info and the host's
    1-minute load average before and after."""
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix=prefix) as run_dir:
        results = asyncio.run(compare_sandboxes(sides, rounds, run_dir, forks))
    return {"machine": machine_info("sandbox"), "rounds": rounds, "results": results,
            "load_avg": [load, os.getloadavg()[0]]}


def compare_rows(a: dict[str, Any], b: dict[str, Any], rows: Sequence[tuple[str, str]]) -> list[str]:
    """Table rows ``| what | a median / min | b median / min | a - b medians |`` (ms)."""
    return [f"| {what} | {a[key]['median_ms']:.1f} / {a[key]['min_ms']:.1f} | {b[key]['median_ms']:.1f} / "
            f"{b[key]['min_ms']:.1f} | {a[key]['median_ms'] - b[key]['median_ms']:+.1f} |" for key, what in rows]


# --------------------------------------------------------------------------- output


def write_json(name: str, data: dict[str, Any], quick: bool) -> Path:
    """bench/results/<name>.json (or <name>.quick.json for a --quick run)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / (f"{name}.quick.json" if quick else f"{name}.json")
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def write_section(md: Path, new: str, begin: str, end: str, after: str | None = None) -> None:
    """Put ``new`` (a section that starts with ``begin`` and ends with ``end``) into the markdown
    file ``md``: in place of the old one, else right after the marker ``after``, else at the end."""
    text = md.read_text() if md.exists() else ""
    if begin in text and end in text:
        text = text[: text.index(begin)] + new + text[text.index(end) + len(end):]
    elif after is not None and after in text:
        at = text.index(after) + len(after)
        text = text[:at] + "\n\n" + new + text[at:]
    else:
        text = text.rstrip() + "\n\n" + new + "\n"
    md.write_text(text)


def log(*args: Any) -> None:
    print(time.strftime("[%H:%M:%S]"), *args, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- a real kernel


class KernelError(RuntimeError):
    pass


@dataclass
class Reply:
    """One executed cell: execute_request -> execute_reply round trip, and what it printed."""

    elapsed: float
    status: str
    stdout: str = ""
    stderr: str = ""
    error: dict[str, Any] | None = None
    results: list[dict[str, Any]] = field(default_factory=list)


class Kernel:
    """An ipykernel started through jupyter_client, driven with a BlockingKernelClient.

    ``execute`` times the execute_request -> execute_reply round trip on the shell
    channel (the iopub outputs are collected afterwards, untimed).
    """

    def __init__(self, cwd: str, env: dict[str, str] | None = None) -> None:
        from jupyter_client import KernelManager

        self.km = KernelManager(kernel_name="python3")
        kenv = dict(os.environ)
        kenv.update(env or {})
        self.km.start_kernel(cwd=cwd, env=kenv)
        self.kc = self.km.client()
        self.kc.start_channels()
        try:
            self.kc.wait_for_ready(timeout=90)
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int | None:
        prov = getattr(self.km, "provisioner", None)
        proc = getattr(prov, "process", None)
        return getattr(proc, "pid", None)

    def _drain_iopub(self) -> None:
        while True:
            try:
                self.kc.get_iopub_msg(timeout=0)
            except Exception:
                return

    def execute(self, code: str, timeout: float = 900, allow_error: bool = False) -> Reply:
        self._drain_iopub()
        t0 = time.perf_counter()
        msg_id = self.kc.execute(code, store_history=False, allow_stdin=False)
        deadline = time.monotonic() + timeout
        while True:
            try:
                reply = self.kc.get_shell_msg(timeout=1.0)
            except queue.Empty:
                if not self.km.is_alive():
                    raise KernelError(f"the kernel died while running:\n{code[:300]}") from None
                if time.monotonic() > deadline:
                    raise KernelError(f"no reply within {timeout} s to:\n{code[:300]}") from None
                continue
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        elapsed = time.perf_counter() - t0
        out = Reply(elapsed, reply["content"]["status"])
        # Collect this cell's outputs (until the kernel goes idle for it).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                msg = self.kc.get_iopub_msg(timeout=10)
            except Exception:
                break
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                if content["name"] == "stderr":
                    out.stderr += content["text"]
                else:
                    out.stdout += content["text"]
            elif kind in ("execute_result", "display_data"):
                out.results.append(content.get("data", {}))
            elif kind == "error":
                out.error = {"ename": content["ename"], "evalue": content["evalue"], "traceback": content["traceback"]}
            elif kind == "status" and content["execution_state"] == "idle":
                break
        if out.status != "ok" and not allow_error:
            err = out.error or reply["content"]
            tb = "\n".join(err.get("traceback", []))[-3000:]
            raise KernelError(f"cell failed: {err.get('ename')}: {err.get('evalue')}\n--- cell ---\n{code[:800]}\n--- traceback ---\n{tb}\n--- stderr ---\n{out.stderr[-2000:]}")
        return out

    def eval_json(self, expr: str, timeout: float = 900) -> Any:
        """Evaluate ``expr`` in the kernel and return it (through JSON)."""
        rep = self.execute(f"import json as _bj\nprint('@@BENCH@@' + _bj.dumps({expr}, default=str))", timeout=timeout)
        for line in reversed(rep.stdout.splitlines()):
            if line.startswith("@@BENCH@@"):
                return json.loads(line[len("@@BENCH@@"):])
        raise KernelError(f"no JSON from {expr!r}: stdout={rep.stdout[-500:]!r} stderr={rep.stderr[-500:]!r}")

    def close(self) -> None:
        """Shut the kernel down (its atexit deletes its machines); kill it if it won't go."""
        with contextlib.suppress(Exception):
            self.kc.stop_channels()
        with contextlib.suppress(Exception):
            self.km.shutdown_kernel(now=False)
        with contextlib.suppress(Exception):
            if self.km.is_alive():
                self.km.shutdown_kernel(now=True)
        with contextlib.suppress(Exception):
            self.km.cleanup_resources()


SMOL_UP = "%load_ext smolbench\n%smol up --backend {backend} --ledger {ledger}"
SMOL_DOWN = "%smol down"


def smol_kernel(workdir: str, backend: str) -> Kernel:
    """A kernel with smolbench loaded and a machine up (its ledger in ``workdir``)."""
    k = Kernel(cwd=workdir)
    try:
        k.execute(SMOL_UP.format(backend=backend, ledger=os.path.join(workdir, "ledger.db")), timeout=180)
    except BaseException:
        k.close()
        raise
    return k


def close_smol_kernel(k: Kernel) -> None:
    with contextlib.suppress(Exception):
        k.execute(SMOL_DOWN, timeout=120, allow_error=True)
    k.close()


# --------------------------------------------------------------------------- /proc accounting


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (all its threads), host pids."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        text = _read(f"/proc/{pid}/task/{tid}/children")
        out.extend(int(x) for x in text.split())
    return out


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (breadth first)."""
    seen, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        if p in seen:
            continue
        seen.append(p)
        todo.extend(children(p))
    return seen


def smaps_rollup(pid: int) -> dict[str, int] | None:
    """The kB fields of /proc/PID/smaps_rollup (None if the process is gone)."""
    text = _read(f"/proc/{pid}/smaps_rollup")
    if not text:
        return None
    out: dict[str, int] = {}
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 2 and parts[0].endswith(":"):
            with contextlib.suppress(ValueError):
                out[parts[0][:-1]] = int(parts[1])
    return out


def cmdline(pid: int) -> str:
    return _read(f"/proc/{pid}/cmdline").replace("\0", " ").strip()


def tree_memory(root_pid: int) -> dict[str, Any]:
    """PSS / USS / RSS (MiB) of ``root_pid`` and its descendants, per process and summed."""
    procs = []
    for pid in descendants(root_pid):
        sm = smaps_rollup(pid)
        if sm is None:
            continue
        uss = sm.get("Private_Clean", 0) + sm.get("Private_Dirty", 0)
        procs.append({"pid": pid, "cmd": cmdline(pid)[:80], "pss_mib": sm.get("Pss", 0) / 1024,
                      "uss_mib": uss / 1024, "rss_mib": sm.get("Rss", 0) / 1024})
    return {
        "processes": len(procs),
        "pss_mib": sum(p["pss_mib"] for p in procs),
        "uss_mib": sum(p["uss_mib"] for p in procs),
        "rss_mib": sum(p["rss_mib"] for p in procs),
        "per_process": procs,
    }


# --------------------------------------------------------------------------- process hygiene


def _ppid(pid: int) -> int | None:
    text = _read(f"/proc/{pid}/stat")
    if not text:
        return None
    try:
        return int(text.rsplit(")", 1)[1].split()[1])
    except (IndexError, ValueError):
        return None


def our_descendants() -> list[int]:
    """Every live process below this one (kernels, sandboxes, ipyparallel engines...)."""
    return [p for p in descendants(os.getpid()) if p != os.getpid() and _state(p) not in (None, "Z", "X")]


def _state(pid: int) -> str | None:
    text = _read(f"/proc/{pid}/stat")
    try:
        return text.rsplit(")", 1)[1].split()[0] if text else None
    except IndexError:
        return None


def reap_leftovers(grace: float = 5.0) -> list[dict[str, Any]]:
    """Report (and kill, by pid) any process this benchmark started that is still alive."""
    deadline = time.monotonic() + grace
    left = our_descendants()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = our_descendants()
    found = [{"pid": p, "cmd": cmdline(p)[:120]} for p in left]
    for p in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)
    return found


# --------------------------------------------------------------------------- other tenants' CPU

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _proc_ticks() -> dict[int, int]:
    """utime + stime + cutime + cstime (clock ticks) of every process on the host: its own CPU
    and that of the children it reaped, so short-lived processes (a test run's subprocesses)
    are counted through their parent."""
    out: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        text = _read(f"/proc/{name}/stat")
        if not text:
            continue
        try:
            fields = text.rsplit(")", 1)[1].split()
            out[int(name)] = int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
        except (IndexError, ValueError):
            continue
    return out


def _host_ticks() -> tuple[int, int, int]:
    """(busy, total, steal) jiffies from /proc/stat (steal: time the hypervisor gave our vCPUs
    to someone else)."""
    vals = [int(x) for x in _read("/proc/stat").splitlines()[0].split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    steal = vals[7] if len(vals) > 7 else 0
    return sum(vals) - idle, sum(vals), steal


class CpuWatch:
    """How much of the host's CPU went to processes that are not this benchmark's.

    The machine is shared (other engineers run test suites on it); every timed
    stage records the share of CPU other processes took while it ran. Processes
    that exited inside the window count through the parent that reaped them; those reaped
    by a parent that also exited are missed, so it is a lower bound. ``steal_share`` is the
    share of vCPU time the hypervisor gave to other VMs (it slows everything alike).
    """

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.p0 = _proc_ticks()
        self.h0 = _host_ticks()

    def result(self) -> dict[str, float]:
        wall = time.monotonic() - self.t0
        p1 = _proc_ticks()
        h1 = _host_ticks()
        ours = set(descendants(os.getpid()))
        others = sum(max(0, t - self.p0.get(pid, 0)) for pid, t in p1.items() if pid not in ours)
        cores = os.cpu_count() or 1
        busy, total, steal = h1[0] - self.h0[0], h1[1] - self.h0[1], h1[2] - self.h0[2]
        return {"wall_s": round(wall, 3),
                "others_cpu_share": round(others / CLK_TCK / max(wall * cores, 1e-9), 3),
                "host_busy_share": round(busy / total, 3) if total else 0.0,
                "steal_share": round(steal / total, 3) if total else 0.0}


def host_busy(window: float = 1.0) -> float:
    """Fraction of all cores busy over ``window`` seconds."""
    b0, t0, _ = _host_ticks()
    time.sleep(window)
    b1, t1, _ = _host_ticks()
    return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0


def wait_quiet(max_wait: float | None = None, threshold: float = 0.25, label: str = "") -> dict[str, Any]:
    """Wait (up to ``max_wait`` s) until the host is mostly idle, so other tenants' test
    runs disturb the numbers less. Returns what was seen."""
    if max_wait is None:
        max_wait = float(CONFIG["quiet_wait"])
    max_wait = min(max_wait, max(0.0, float(CONFIG["quiet_budget"])))  # a bounded total across the run
    t0 = time.monotonic()
    busy = host_busy(1.0)
    while busy > threshold and time.monotonic() - t0 < max_wait:
        busy = host_busy(2.0)
    waited = time.monotonic() - t0
    CONFIG["quiet_budget"] = float(CONFIG["quiet_budget"]) - max(0.0, waited - 1.0)
    if busy > threshold:
        log(f"{label}: host still {busy:.0%} busy after waiting {waited:.0f} s; measuring anyway")
    return {"waited_s": round(waited, 1), "host_busy_share_at_start": round(busy, 3), "quiet": busy <= threshold}
