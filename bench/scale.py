"""Scale (issue 27): wide forks and many episodes against their floors, all in one run.

    python -m bench.scale [--reps N]   # bench/results/scale.json and its RESULTS.md section
    python -m bench.scale --quick      # fork 16, episodes 16, PSS over 16, once: does it run? (scale.quick.json only)

In one process, side by side, on the sandbox backend at the default Smolfile:

* ``fork N`` (16, 64, 256, 512): the Workbench's whole ``%%smol fork N --keep none`` of a
  trivial cell (branch, run in every branch, ledger, delete every branch), best of ``--reps``
  for 16 and 64, once for 256 and 512; host memory available at its lowest during the fork;
* ``episodes N`` (16, 64, 1000): the whole ``%%smol episodes N`` of the same cell; episodes/s;
* the floors, in a subprocess each: N plain ``os.fork()`` children that exit at once, of a bare
  Python process and of a *kernel-sized* one (it first imports what a Jupyter kernel running
  smolbench holds: ipykernel, IPython, numpy, smolbench's magics; its RSS is recorded): issue
  27's goals are stated against the latter, "N plain os.fork children" side by side in one
  kernel, where each fork copies a kernel's page tables; and the namespace floor: a Python parent forks N children that each unshare user,
  mount, pid, IPC and net namespaces, map their ids, mount a tmpfs and an overlay on it, and
  fork a pid 1 that mounts its own /proc;
* PSS per branch: 64 live branches of a machine, ``(PSS after - PSS before) / 64`` over the
  machine's whole host process tree.

The host is shared with other sessions' work: the load average before and after is recorded,
and only ratios measured in this run are compared.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .common import BENCH_DIR, log, write_json, write_section

BEGIN, END = "<!-- scale:begin -->", "<!-- scale:end -->"
FORKS = (16, 64, 256, 512)
EPISODES = (16, 64, 1000)
PSS_BRANCHES = 64
QUICK = {"forks": (16,), "episodes": (16,), "pss": 16}  # --quick: a check that it runs, no numbers to keep

OS_FORK = r"""
import os, sys, time, json
n, reps = int(sys.argv[1]), int(sys.argv[2])
ts = []
for _ in range(reps):
    t0 = time.perf_counter(); pids = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        pids.append(pid)
    for p in pids:
        os.waitpid(p, 0)
    ts.append(time.perf_counter() - t0)
print(json.dumps(ts))
"""

# The same forks from a process the size of a kernel: what it imports first (issue 27's baseline).
KERNEL_FORK = r"""
import ipykernel.kernelapp, IPython, numpy, smolbench.magics, smolbench.workbench  # noqa
import json, sys
rss = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmRSS:"))
""" + OS_FORK.replace("print(json.dumps(ts))", 'print(json.dumps({"s": ts, "rss_mib": rss / 1024}))')

NS_FLOOR = r"""
import ctypes, os, sys, time, json
libc = ctypes.CDLL(None, use_errno=True)
NEWNS, NEWUSER, NEWPID, NEWIPC, NEWNET = 0x20000, 0x10000000, 0x20000000, 0x08000000, 0x40000000
def mount(src, dst, fs, flags=0, data=None):
    if libc.mount(src.encode() if src else None, dst.encode(), fs.encode() if fs else None, flags,
                  data.encode() if data else None) != 0:
        raise OSError(ctypes.get_errno(), "mount " + dst)
def child():
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(NEWUSER | NEWNS | NEWPID | NEWIPC | NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "unshare")
    open("/proc/self/setgroups", "w").write("deny")
    open("/proc/self/uid_map", "w").write("0 %d 1" % uid)
    open("/proc/self/gid_map", "w").write("0 %d 1" % gid)
    mount(None, "/", None, 0x4000 | (1 << 18))  # MS_REC | MS_PRIVATE
    base = sys.argv[3]
    mount("tmpfs", base, "tmpfs", 0, "size=16m")
    for d in ("l", "u", "w", "m"):
        os.mkdir(os.path.join(base, d))
    mount("overlay", base + "/m", "overlay", 0, "lowerdir=%s/l,upperdir=%s/u,workdir=%s/w,userxattr" % ((base,) * 3))
    pid = os.fork()  # pid 1 of the new pid namespace, with its own /proc
    if pid == 0:
        os.mkdir(base + "/m/proc")
        mount("proc", base + "/m/proc", "proc")
        os._exit(0)
    _, st = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(st))
n, reps = int(sys.argv[1]), int(sys.argv[2])
ts = []
for _ in range(reps):
    t0 = time.perf_counter(); pids = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            try:
                child()
            except BaseException as exc:
                sys.stderr.write("ns floor: %s\n" % exc)
                os._exit(1)
        pids.append(pid)
    bad = 0
    for p in pids:
        bad += os.waitpid(p, 0)[1] != 0
    ts.append(time.perf_counter() - t0)
    if bad:
        raise SystemExit("%d of %d children failed" % (bad, n))
print(json.dumps(ts))
"""


def floor(script: str, n: int, reps: int) -> Any:
    with tempfile.TemporaryDirectory(prefix="smolbench-scale-") as tmp:
        os.chmod(tmp, 0o777)
        out = subprocess.run([sys.executable, "-c", script, str(n), str(reps), tmp], capture_output=True, text=True,
                             timeout=600, check=False)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip()[-300:])
    return json.loads(out.stdout.strip().splitlines()[-1])


class LowestAvailable:
    """The lowest MemAvailable while it runs, sampled every 20 ms (a thread)."""

    def __init__(self) -> None:
        from smolbench.backends._limits import host_available_mib

        self._read = host_available_mib
        self.before = self._read() or 0
        self.lowest = self.before
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.lowest = min(self.lowest, self._read() or self.lowest)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.before - self.lowest


async def smolbench_series(reps: int, forks: tuple[int, ...] = FORKS, episodes: tuple[int, ...] = EPISODES,
                           pss_n: int = PSS_BRANCHES) -> dict[str, Any]:
    from smolbench import Ledger
    from smolbench.backends import _procs
    from smolbench.backends.sandbox import SandboxBackend
    from smolbench.spec import MachineSpec
    from smolbench.workbench import Workbench

    out: dict[str, Any] = {"fork": {}, "episodes": {}}
    with tempfile.TemporaryDirectory(prefix="smolbench-scale-") as tmp:
        be = SandboxBackend()
        wb = Workbench(be, MachineSpec(), Ledger(Path(tmp) / "ledger.db"))
        await wb.up()

        def quiet(*_: Any) -> None:
            pass

        try:
            for n in forks:
                times, ok, used = [], 0, 0
                for _ in range(reps if n <= 64 else 1):
                    mem = LowestAvailable()
                    t0 = time.perf_counter()
                    res = await wb.fork(wb.new_fork(n, keep="none"), "pass", quiet, keep="none")
                    times.append(time.perf_counter() - t0)
                    used = max(used, mem.stop())
                    ok = sum(r["status"] == "ok" for r in res.rows.values())
                out["fork"][n] = {"s": times, "ok": ok, "host_mib_used_peak": used}
                log(f"scale: fork {n}: {min(times):.3f} s, {ok} ok, peak {used} MiB of host memory")
            for n in episodes:
                times, ok = [], 0
                for _ in range(reps if n <= 16 else 1):
                    t0 = time.perf_counter()
                    res = await wb.episodes(wb.new_episodes(n), "pass", quiet)
                    times.append(time.perf_counter() - t0)
                    ok = sum(r["status"] == "ok" for r in res.rows.values())
                out["episodes"][n] = {"s": times, "ok": ok, "per_s": n / min(times),
                                      "fresh": getattr(res, "fresh", None)}
                log(f"scale: episodes {n}: {min(times):.3f} s ({n / min(times):.1f}/s), {ok} ok")
            # PSS per branch: 64 live branches over the machine's whole host tree
            root = wb.machines["root"]
            top = root.info["pid"]

            def pss() -> float:
                return _procs.memory_mib([top, *(p for p, _ in _procs.descendants(top))])[1]

            before = pss()
            refs = await be.branch(root, [f"pss.{i}" for i in range(pss_n)], list(range(pss_n)))
            from smolbench.backends.base import CellRequest

            await asyncio.gather(*(be.exec_cell(r, CellRequest("SEED"), lambda e: None) for r in refs))
            after = pss()
            await asyncio.gather(*(be.delete(r) for r in refs))
            out["pss_per_branch_mib"] = (after - before) / pss_n
            log(f"scale: PSS per branch {out['pss_per_branch_mib']:.2f} MiB")
        finally:
            await wb.down()
            await be.close()
            wb.ledger.close()
    return out


def run(reps: int, quick: bool = False) -> dict[str, Any]:
    load0 = os.getloadavg()
    forks, episodes, pss_n = (QUICK["forks"], QUICK["episodes"], QUICK["pss"]) if quick else (FORKS, EPISODES, PSS_BRANCHES)
    data: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "cores": os.cpu_count(), "reps": reps}
    floors: dict[str, dict[int, list[float]]] = {"os_fork": {}, "kernel_fork": {}, "namespaces": {}}
    for n in forks:
        floors["os_fork"][n] = floor(OS_FORK, n, reps)
        kernel = floor(KERNEL_FORK, n, reps)
        floors["kernel_fork"][n] = kernel["s"]
        data["kernel_rss_mib"] = max(data.get("kernel_rss_mib", 0.0), kernel["rss_mib"])
        floors["namespaces"][n] = floor(NS_FLOOR, n, reps if n <= 64 else 1)
    data["floors"] = floors
    data.update(asyncio.run(smolbench_series(reps, forks, episodes, pss_n)))
    data["load_avg"] = [load0[0], os.getloadavg()[0]]
    best = {n: min(v["s"]) for n, v in data["fork"].items()}
    ratios = {}
    for n in (16, 64):
        if n in best:
            ratios[f"fork{n}/os_fork{n}"] = best[n] / min(floors["os_fork"][n])
            ratios[f"fork{n}/kernel_fork{n}"] = best[n] / min(floors["kernel_fork"][n])
            ratios[f"fork{n}/ns_floor{n}"] = best[n] / min(floors["namespaces"][n])
    if 16 in best and 16 in data["episodes"]:
        ratios["episodes16/fork16"] = min(data["episodes"][16]["s"]) / best[16]
    data["ratios"] = ratios
    return data


def section(d: dict[str, Any]) -> str:
    r, f, e, fl = d["ratios"], d["fork"], d["episodes"], d["floors"]

    def ms(xs: list[float]) -> str:
        return f"{min(xs) * 1e3:,.0f}"

    kf = fl.get("kernel_fork", {})

    def over(n: int, base: dict[int, list[float]]) -> str:
        return f"{min(f[n]['s']) / min(base[n]):.1f}×" if n in base else "?"

    rows = [f"| fork {n} | {ms(f[n]['s'])} | {f[n]['ok']}/{n} | {ms(kf[n]) if n in kf else '?'} | {ms(fl['os_fork'][n])} | "
            f"{ms(fl['namespaces'][n])} | {over(n, kf)} | {over(n, fl['os_fork'])} | {over(n, fl['namespaces'])} | "
            f"{f[n]['host_mib_used_peak']:,} |" for n in sorted(f, key=int)]
    eps = [f"| episodes {n} | {ms(e[n]['s'])} | {e[n]['ok']}/{n} | {e[n]['per_s']:.1f} | {e[n].get('fresh') or '?'} |"
           for n in sorted(e, key=int)]
    goal = [("fork 16 / 16 × os.fork of a kernel-sized process", r.get("fork16/kernel_fork16", float("nan")), "≤ 2.5×"),
            ("fork 64 / 64 × os.fork of a kernel-sized process", r.get("fork64/kernel_fork64", float("nan")), "≤ 3×"),
            ("fork 64 / namespace floor 64", r["fork64/ns_floor64"], "about 1.5× (the issue's estimate for 3× os.fork)"),
            ("episodes 16 / fork 16", r["episodes16/fork16"], "≤ 1.5×"),
            ("(stricter) fork 16 / 16 × os.fork of a bare python", r["fork16/os_fork16"], "none: for scale"),
            ("(stricter) fork 64 / 64 × os.fork of a bare python", r["fork64/os_fork64"], "none: for scale")]
    return "\n".join([
        BEGIN, "## Scale · wide forks and many episodes (issue 27)", "",
        f"`python -m bench.scale`, {d['date'][:16]}, sandbox backend, default Smolfile, a trivial cell, `--keep none`; "
        f"best of {d['reps']} for 16 and 64, one run for 256, 512 and the episodes. Host load average "
        f"{d['load_avg'][0]:.1f} before and {d['load_avg'][1]:.1f} after on {d['cores']} cores (the figure after "
        "includes this run's own fork 512): compare the ratios, measured side by side in this run, not the times with other runs.", "",
        "The goals compare with N plain `os.fork` children *of a kernel-sized process*, as issue 27 measured them "
        "(side by side in one kernel): a Python that first imported ipykernel, IPython, numpy and smolbench's magics "
        f"(RSS {d.get('kernel_rss_mib', 0):.0f} MiB here), whose forks copy a kernel's page tables. The bare-Python "
        "column (a fresh interpreter, about 9 MiB) is kept for scale: it is several times stricter.", "",
        "| ms | smolbench | ok | N × `os.fork`, kernel-sized | N × `os.fork`, bare python | namespace floor | "
        "/ kernel os.fork | / bare os.fork | / floor | peak host MiB used |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *rows, "",
        "| | ms | ok | episodes/s | fresh from |", "|---|---:|---:|---:|---|", *eps, "",
        "| goal | measured | target |", "|---|---:|---|",
        *[f"| {name} | {val:.2f}× | {target} |" for name, val, target in goal], "",
        f"PSS per live branch (64 branches, the machine's whole host tree): {d['pss_per_branch_mib']:.2f} MiB.", "",
        "Where a fork's time goes (profiled 2026-12-02, fork 64 of `pass` on this 2-core host at load 2-10, by CPU "
        "accounting: a cpuacct cgroup around the kernel and its machines, /proc/PID/stat of the root's agent and "
        "keeper, the agent's reaped children for the branches; stage timestamps in the guest): a fork of 64 uses "
        "about 2.0-2.4 s of CPU, so on 2 cores it can't take less than about 1.1 s of wall: it is CPU-bound, and only "
        "less CPU makes it faster. Of that CPU: **the branches themselves 1.3-1.6 s** (20-25 ms each: about 10 ms "
        "for the keeper's set-up, most of it page faults copying the pages Python's reference counts write after the "
        "fork, 5 namespaces (a network one: 1 ms of kernel work) and ~20 mount calls; about 7 ms for the agent, forked "
        "a second time, to its first cell's end; the rest their exit); **the kernel process 0.3-0.45 s** (0.67 s "
        "before deletes were batched: cgroups made, filled and removed, a request per branch, 5 ledger rows per "
        "branch); **the root's agent 0.12-0.2 s** (its fork loop: 2-3 ms per fork, growing with the children forked "
        "already); **the root's keeper 0.03-0.04 s** (the mount guard's 4 notifications per branch, 0.11 ms of CPU "
        "each: answering them is not a cost; their waits are a busy host's scheduling). Across all of it (perf), 58% "
        "is kernel time: page faults 22% (copy-on-write 14%), fork 9%, unshare 3%, mount 2%. In wall time (load 5): "
        "the fork request 190 ms (the agent forks 64 held children; their cgroups are made meanwhile), moving them "
        "into their cgroups 35 ms and the release, then the set-ups overlap (release to serving: median 390 ms), "
        "the first cells, and the deletes (290-360 ms: one batch, now mostly the kernel tearing down 128 processes, "
        "their memory and their ~90-mount namespaces; 425 ms before). Mount calls also serialize on the kernel's "
        "namespace lock, which a loaded host makes longer. Measured again 2026-12-03 on a quiet host, fork 16 by "
        "phase: the fork request to the release 31 ms, of which 13 ms were the moves into cgroups, held up by the "
        "first one waiting out an RCU grace period of the kernel's cgroup migration lock (~10 ms; the other 47 "
        "moves ~15 us each); since 893f68a that wait is spent beside the fork (backends/_limits.py "
        "`keep_moves_cheap`) and the phase takes 21 ms; then the set-ups and first cells 55-65 ms and the deletes "
        "~15 ms (the kernel's exits: polling sooner finds nothing gone sooner). A fork of 16 now keeps both cores "
        "~90% busy from its request to its end (~165 ms of CPU in ~91 ms of wall), so what is left to win is CPU, "
        "in the branch: two forks of a warm Python and the namespaces each branch makes. Episodes are branches of "
        "a pristine zygote (one fork request for all the episodes that wait), so they cost what a fork does. "
        "Where a branch's CPU goes, counted 2026-12-03 (minor faults of each process of a fork of 8, phases marked "
        "in the guest; perf over 40 forks of 16): page faults are 28% of a fork's CPU (the copy 3%, the PTE lock 5%, "
        "at ~3.7 us each on this VM), Python 29%, the rest of the kernel's work (exits 9%, unshare 3%, mounts 2%). "
        "A branch's keeper takes ~730 copy-on-write faults and its agent ~720, about 5 ms of the branch's ~10. The "
        "keeper: ~270 before any of smolbench's code runs, in Python's own after-fork hooks (threading's alone ~125: "
        "its new objects land in pages the parent shares; a bare interpreter takes 68), its set-up ~340 "
        "(namespaces, mounts), ~120 after it. The agent, forked again from it: ~390 to the end of its own set-up "
        "(the same hooks, its /proc, dropping privileges), its start ~170 and its first cell ~160. The kernel "
        "process spends ~43 ms of "
        "CPU on a fork of 16 (2.5 ms less since a fork's ledger rows go in one commit per batch). "
        "Since 61bf85e a fork of 2 or more whose branches are deleted after their cell (`--keep none`, as here; "
        "episodes; gym machines) makes *leaf* branches (guest/leaves.py): one fork of the agent clones each branch "
        "straight into its namespaces, so a branch is one warm process with no keeper, and skips the second "
        "process's after-fork hooks, page-table copy and exit. Side by side, interleaved in one session "
        "(2026-12-03 20:20): a fork of 16 ran 153 branches/s as leaves against 132 the two-process way, with "
        "10.0 against 13.1 ms of host CPU per branch; a fork of 64 163 against 133 (10.0 against 13.9 ms); forks "
        "of 2 and 4 the same either way; a stream of one-branch requests (a long `%%smol episodes`) slower as leaves "
        "(79 against 102 episodes/s: the maker's round trip is on the way of every request), so one branch alone "
        "is made the usual way. This whole bench on the code before (d0d0b00) and after, within 10 minutes: fork 16 "
        "119 -> 96-98 ms (5.95x -> 5.2x), fork 64 459 -> 345-365 ms (6.0x -> 4.7-5.1x), fork 256 2.0 -> 1.6 s, fork "
        "512 6.1 -> 3.4 s (peak 1,720 -> ~1,000 MiB). Episodes from the zygote are made a wave ahead of their cells "
        "since 5c14b27 (2 x --concurrency alive), so episodes 16 costs what a fork of 16 does. A leaf's own CPU, "
        "counted by phase (getrusage at marked points, fork 16 of a parent that imported numpy): 8.0 of its ~13 ms "
        "went to seeding numpy, which imported numpy.random (numpy loads it at first use) in every branch; since "
        "6683069 the forking agent imports it first, and such a fork of 16 ran 147-150 branches/s at 10.0 ms of host "
        "CPU each, against 91-97 at 17-18 ms (this bench's parent imports nothing, so its rows don't show it). What "
        "is left of a leaf to its first cell's end is ~5 ms: its first Python after the clone (1.2 ms, ~280 faults: "
        "first touches of shared pages), namespaces and mounts 1.1 ms, /proc and dropping privileges 0.4 ms, seeding "
        "and its acceptor 0.6 ms, the host's connection and the cell 1.1 ms; then its exit (~1.3 ms of the kernel's), "
        "its clone's page-table copy (~1 ms, the maker's) and ~2.5 ms of the kernel process. "
        "Measured 2026-12-03 22:20-22:40 on a quiet host (CPU of everything from /proc/stat, the kernel "
        "process's own from getrusage, 15 forks of 16 and 5 of 64 per series): a branch costs 7.8-8.1 ms of "
        "CPU in all at 16 and 7.6-8.2 ms at 64, of which the kernel process 1.3-1.4 ms; a fork of 512 9.4-9.8 ms. "
        "Sampled every 0.5 ms (perf, all CPUs), a fork of 16 keeps both cores busy except at its two ends: "
        "its first ~20 ms, where the maker clones the branches one after another (~1.05 ms each: 0.8 the "
        "clone, a net namespace half of it, 0.2 the branch's listening socket) while the other core mostly "
        "waits, and its last ~10 ms (the deletes). Since 2c11d4d a leaf makes its IPC and net namespaces "
        "itself once released (a clone in the maker's loop 0.82 -> 0.48 ms; their kernel memory is "
        "charged to the branch's cgroup): interleaved A/B, the same wall time at 16, 64 and 512 (the CPU "
        "moved, it did not shrink). Tried and not kept: deleting each `--keep none` branch as soon as its "
        "cell ends, to fill the last ~10 ms: +0.6-0.8 ms of the kernel process's CPU per branch (deletes "
        "no longer batched), fork 64 305 -> 325 ms. Two runs of this bench 3 minutes apart on the same code "
        "(2c11d4d): fork 16 81 and 88 ms (4.5x, 5.1x), fork 64 277 and 307 ms (4.3x, 4.7x), fork 512 3.8 "
        "and 2.6 s: on a quiet host this VM runs the same code faster than at 21:00 (5.7x, 5.05x). "
        "2026-12-04 (the rows above; the fork path unchanged since): counted per process (on-CPU time "
        "from /proc/PID/schedstat), a leaf of a fork of 16 has used 3.4-3.7 ms at its trivial cell's end "
        "(~705 minor faults); adding 48 mounts to the machine (74 now, 90 in a branch) left the CPU per "
        "branch as it was (6.9-7.4 ms at 16 and 64 both ways); more makers in parallel would not help at "
        "the default Smolfile, as the maker runs in the warm parent's cgroup (cpus = 1). "
        "2026-12-06 (issue 27, the kernel process's share): a fork of 16 profiled in the kernel process "
        '(cProfile on thread CPU time, the loop thread and every thread job; strace -c) spent its host CPU on '
        "a mkdir, five limit writes and an rmdir of three cgroups per branch (~0.25 ms, and the kernel's "
        'freeing of a memory cgroup after it), ~5 ledger rows per branch (~30 us each), buffered opens of '
        '/proc and cgroupfs files (~6 syscalls each), a thread job per deleted branch for its run folder, and '
        '~170 futex calls per branch (the GIL passed between the loop and the thread jobs). Since then a '
        "deleted branch's emptied cgroups (its fork's batched deletes) go to the next branch, renamed "
        '(Limiter._reuse; one set per live machine, never shared, removed at down), its run folder is cleared in the same thread job as its '
        'cgroups, those files are read and written with os.read/os.write, and upsert_node makes its statement '
        'once per set of columns. Interleaved A/B (old 6fac255 against new, 10 rounds of 5 forks of 16 and 64 '
        "each, alternating, CPU of the whole tree from a cpuacct cgroup around it) on a host this session's own VM lane and tests "
        'loaded to a load average of 12-24: the kernel process 2.67 -> 1.78 ms per branch at 16 and 2.41 -> '
        '1.53 at 64 (context switches 7.5 -> 5.0 and 5.6 -> 3.1 per branch), all CPU 11.97 -> 10.95 ms per '
        'branch at 16 and 11.65 -> 10.73 at 64; the wall time, against kernel-sized os.fork measured in the '
        "same rounds, 4.57x -> 4.74x at 16 and 4.53x -> 3.96x at 64, within that load's noise (fork 64 ranged "
        '377-654 ms on either code). Not tried for lack of time: releasing each branch as soon as it is in '
        'its cgroup needs the maker to report each clone as it is made and a hold pipe per branch (the '
        'branches now wait on one pipe, where any byte would release any of them), so that the other core '
        'runs branches while the maker clones.'
        ' 2026-12-06, later: tried (b5c6286..428c200), measured, not kept (reverted in 3b63c11). Each leaf was '
        "released as soon as it was in its cgroup: the maker named each clone on the fork's connection, the "
        'host moved it and granted its store and answered "g INDEX", and the maker wrote that branch\'s own '
        "hold pipe (a branch closed the others' before it waited; a test saw each leaf still held at its "
        "move, and caught a maker weakened to release early). It needed two more things: the parent's CPU "
        "weight raised while the maker clones (each released branch is a cgroup as heavy as the parent's: "
        "without it the maker made one branch per 20-30 ms instead of per ~1 ms), and the branches' cgroups "
        'made by the thread that moves them (two busy Python threads took turns for the GIL at every syscall). '
        'Interleaved A/B against c266793 (3 series of 8 rounds, '
        "each of 5 forks of 16 and 5 of 64 per side, the side first alternating; CPU of each side's whole "
        'tree from a cpuacct cgroup around it; kernel-sized os.fork measured in every round; medians, not '
        'bests). On a quiet host (kernel-sized os.fork of 16: 30 ms): fork 16 132 -> 129 ms (4.35x -> 4.24x; '
        'new/old per round 0.88-1.15, median 0.96), fork 64 478 -> 465 ms (4.09x -> 3.98x; 0.89-1.04, median '
        "0.98), and CPU per branch 12.58 -> 13.31 ms at 16 and 12.18 -> 12.71 at 64 (the kernel process's "
        "share 2.21 -> 2.39 and 1.88 -> 2.13). With other sessions' work on the host (its os.fork of 16: "
        '35-87 ms): new/old per round median 0.84-0.97, ranging 0.53-2.2, and +0.6-1.4 ms of CPU per branch. '
        'A fork of 16 already keeps both cores busy most of the time: what the overlap won in the first ~20 '
        'ms it paid back in CPU, 0.2-0.3 ms per branch in the kernel process (a message and a reply per branch) '
        "and the rest in the guest (not pinned down; likely the maker's clones and the released branches' "
        'set-ups contending in the kernel).'
        ' 2026-12-06 22:44: this bench again, on the code with the third audit\'s fixes (a '
        "deleted branch's folder removed however deep, each branch's fds 0-2 its own, cgroup sets still charged "
        'not reused): fork 16 3.94x, fork 64 4.49x, episodes 16 / fork 16 1.64x, and 1,000 episodes at 47/s against '
        '125/s at 00:56. The code before those fixes (dcedd1d) and after, run alternately 2 times each in one '
        'session (episodes 200, then fork 64, of a trivial cell), measured the same: episodes 200 in 4.1-5.2 s '
        'against 4.1-5.3 s, fork 64 in 0.51-0.60 against 0.48-0.56 s. The host had 686 memory cgroups then, all '
        "but its root dying (removed, still holding the page cache of the day's test files); a probe with about "
        '960 and about 650 of them measured the same (and a Session leaves none: its branches\' files go with '
        "them), so that is not why; the cause of the slower evening is not pinned down. 2026-12-07 04:15 (the rows above), after this session's audit fixes: fork 16 5.46x, fork 64 5.20x, episodes 16 / fork 16 1.50x; against the namespace floor measured beside them the same as before (4.4x at 16, 4.6x at 64): the kernel-sized os.fork ran faster (24 against 30 ms for 16). Episodes 64 on the code before the session (be9972f) and after, alternately, 3 runs each twice: 564-1,382 against 568-1,406 ms, the same. "
        "2026-12-07, the next session: episodes at a fork's cost again. Counting the zygote's fork requests showed episodes asking for "
        "their branches one at a time: at 200 episodes 126 of 138 requests made one branch (and one branch alone is made the slow, "
        "two-process way), which is why episodes ran at 35-47/s since 2026-12-06 while a fork made ~120 branches/s; a semaphore let one "
        "episode in per episode that ended. Episodes are now let in by waves (`_aio.Waves`: at most 3 x --concurrency alive, let in "
        "2 x at a time) and the zygote forks each wave in one request, no bigger than the host's memory holds. Interleaved, the code "
        "before (b3ab09d) and after, 3 runs each: episodes 16 201-202 -> 124-162 ms, 64 767-1,363 -> 420-660 ms, 200 4,449-5,474 -> "
        "1,324-1,928 ms. Where a fork's CPU goes now (perf on all CPUs over 30 forks of 16, each sample given to its process by the "
        "fork events): the leaves 60% of the busy CPU (71% of theirs in the kernel: page faults 30%, exit 15.5%, unshare 7%, mount "
        "5%; their own Python 29%), the kernel process 16% (two thirds Python), the maker 11% (its clones' page-table copies 52% of "
        "that), kworkers and the rest 10%, the root agent 2%: no one part is big enough to close the fork goals. CPU per branch was "
        "12-13 ms that morning, the same on 2c11d4d measured alternately (the host's speed, not the code). The rows above are the "
        "first of three runs of this bench within four minutes at the session's end (07:19, load 0.4 before it; the next two started "
        "at load 18.8 and 2.9, left by the run before): fork 16 104-141 ms = 3.3-5.3x its kernel-sized os.fork (4.3-4.5x the "
        "namespace floor), fork 64 353-481 ms = 2.9-4.1x (2.7-4.0x the floor), episodes 16 / fork 16 0.79-1.39x, 106-130 "
        "episodes/s at 64 and 110-128 at 1,000, 4.84-4.85 MiB PSS per branch: one run's ratio is not a verdict.", END,
    ])


def main() -> int:
    if {"-h", "--help"} & set(sys.argv[1:]):  # a full run takes long: never by accident
        print(__doc__)
        return 0
    if "--quick" in sys.argv:
        data = run(1, quick=True)
        print(write_json("scale", data, quick=True))
        print(json.dumps(data["ratios"], indent=2))
        return 0
    reps = int(sys.argv[sys.argv.index("--reps") + 1]) if "--reps" in sys.argv else 3
    data = run(reps)
    print(write_json("scale", data, quick=False))
    text = section(json.loads(json.dumps(data, default=str), object_hook=_int_keys))
    write_section(BENCH_DIR / "RESULTS.md", text, BEGIN, END)
    print(text)
    return 0


def _int_keys(d: dict[str, Any]) -> dict[Any, Any]:
    return {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in d.items()}


if __name__ == "__main__":
    sys.exit(main())
