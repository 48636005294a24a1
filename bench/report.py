"""bench/results/*.json -> bench/RESULTS.md (tables, goals, and what the numbers mean).

    python -m bench.run --report          # regenerate from the full-run JSON
    python -m bench.run --report --quick  # from the --quick JSON (written to bench/results/quick/RESULTS.md)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .common import BENCH_DIR, RESULTS


def _load(name: str, quick: bool) -> dict[str, Any] | None:
    order = [f"{name}.quick.json"] if quick else [f"{name}.json"]
    for fname in order:
        path = RESULTS / fname
        if path.exists():
            return json.loads(path.read_text())
    return None


def _setup_cpus(runs: dict[str, Any]) -> list[float]:
    xs = [x["setup_cpu_s"] for x in runs.get("a_fork", []) if x.get("setup_cpu_s")]
    xs += [x["local_setup_s"] for x in runs.get("c_loop", []) if x.get("local_setup_s")]
    return xs or [float("nan")]


def _ratio(a: Any, b: Any) -> float | None:
    try:
        return float(a) / float(b)
    except (TypeError, ValueError, ZeroDivisionError):
        return None


def statistics_median(xs: list[float]) -> float | None:
    import statistics

    return statistics.median(xs) if xs else None


def _f(x: Any, nd: int = 1, unit: str = "") -> str:
    if x is None:
        return "n/a"
    try:
        return f"{float(x):.{nd}f}{unit}"
    except (TypeError, ValueError):
        return str(x)


def _g(d: Any, *path: Any, default: Any = None) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return default
        d = d[p]
    return d


def _ok(met: Any) -> str:
    return "**met**" if met else "**not met**"


def _load_note(*stages: Any) -> str:
    shares = [s for s in stages if isinstance(s, (int, float))]
    if not shares:
        return ""
    return f"other processes on this shared host took {min(shares):.0%}-{max(shares):.0%} of the CPU while it ran"


def _machine(d: dict[str, Any]) -> str:
    m = d["machine"]
    return (f"{m['date']} · backend **{m['backend']}** · {m['cores']} cores ({m['cpu']}) · {m['memory_gib']} GiB · "
            f"Python {m['python']} · {m['os']} · KVM {'yes' if m.get('kvm') else 'no'} · {m.get('bwrap') or 'no bwrap'} · "
            f"smolbench {m['versions'].get('smolbench')} @ {m.get('git_commit')}{' (+ uncommitted changes)' if m.get('smolbench_tree_dirty') else ''}")


def b1_section(d: dict[str, Any]) -> list[str]:
    r = d["results_ms"]
    dv = d["derived_ms"]
    ik = r["in_kernel"]
    wi = r["whatif_pump_patched"]
    rows = [
        ("local cell `pass` (kernel round trip)", r["kernel_local"]),
        ("`%%smol` `pass` (kernel round trip)", r["kernel_smol"]),
        ("raw `SandboxBackend.exec_cell` (`_loop.run`, in-process)", r["raw_exec"]),
        ("`%%smol` minus local, paired per cell", r["smol_minus_local_paired"]),
        ("in kernel, no messaging: `run_cell_magic('smol', '', 'pass')`", ik["magic"]),
        ("in kernel, no messaging: `_loop.run(backend.exec_cell(...))`", ik["raw"]),
        ("what-if, pump woken on completion: local cell", wi["kernel_local"]),
        ("what-if, pump woken on completion: `%%smol` cell", wi["kernel_smol_pump_patched"]),
    ]
    out = [
        "## B1 · cell overhead",
        "",
        f"{d['params']['cells']} cells of each kind, interleaved cell by cell (after {d['params']['warmup']} warm-up cells); "
        "kernel rows are execute_request → execute_reply round trips through jupyter_client's BlockingKernelClient. "
        + (_load_note(_g(d, "host_load", "main", "others_cpu_share")) + "." if d.get("host_load") else ""),
        "",
        "| series | n | median ms | p95 ms | min ms |",
        "|---|---:|---:|---:|---:|",
    ]
    out += [f"| {name} | {s['n']} | {_f(s['median'], 2)} | {_f(s['p95'], 2)} | {_f(s['min'], 2)} |" for name, s in rows]
    out += [
        "",
        f"**%%smol over raw exec** = (median `%%smol` − median local) − median raw = **{_f(dv['smol_over_raw_median'], 1)} ms** "
        f"(in-kernel, without messaging: {_f(dv['smol_over_raw_in_kernel_median'], 1)} ms). "
        f"Goal ≤ 10 ms: {_ok(d['goal']['met'])}"
        + (f" (gap {_f(d['goal']['gap_ms'], 1)} ms)." if not d["goal"]["met"] else "."),
        f"What-if with the magic's output pump woken on job completion (monkeypatched in the benchmark kernel only): "
        f"**{_f(dv['smol_over_raw_whatif_pump_patched_median'], 1)} ms**.",
        "",
    ]
    return out


def _osfork_lines(r: dict[str, Any]) -> list[str]:
    if "fork_vs_osfork" not in r:
        return []
    ok = r["fork_vs_osfork"] <= 1.05
    return [
        f"Fork vs plain `os.fork` (issue 27: B2 stays within 5 % of it): **{_f(r['fork_vs_osfork'], 3)}×** the median time "
        "(each fork run against the `os.fork` run beside it: " + ", ".join(_f(x, 3) for x in r["fork_vs_osfork_paired"])
        + f"; against each one's own CPU work / cores: {_f(r['fork_vs_osfork_cpu_ideal'], 3)}×): {_ok(ok)}.",
        "",
    ]


def b2_section(d: dict[str, Any]) -> list[str]:
    r = d["results"]
    p = d["params"]
    med = r["median_total_s"]
    runs = d["runs"]
    fork = med["a_fork"]
    names = {
        "a_fork": "(a) smolbench: `%%smol` setup + `%%smol fork 16`",
        "b_ipyparallel": "(b) ipyparallel, 16 engines, `%%px`-equivalent (each engine redoes setup)",
        "c_loop": f"(c) sequential loop, each episode from scratch (×16, extrapolated from {p['loop_episodes_run']})",
        "d_episodes": "(d) `%%smol episodes 16` (each fresh machine redoes setup)",
        "e_osfork": "(e) plain `os.fork()`: the setup in the kernel, then 16 forks of it (no isolation)",
    }
    out = [
        "## B2 · warm fan-out vs peers",
        "",
        f"Setup S = {p['S_target_s']:g} s of pure-Python CPU building a table, then N = {p['N']} rollouts of r = {p['r_target_s']:g} s CPU, "
        f"on {p['cores']} cores; {p.get('runs', len(p['order']))} runs in the order {' → '.join(x[0] for x in p['order'])} "
        "(interleaved: the fork brackets the peers). "
        f"Measured locally this run: S = {_f(d['measured']['local_setup_s'], 2)} s, r = {_f(d['measured']['local_rollout_s'], 3)} s. "
        f"Every variant returned the same reward for every seed: **{'yes' if r['rewards_agree'] else 'NO'}**.",
        "",
        "| variant | time to all 16 results (median) | each run | × fork | its CPU work / cores (median) | efficiency | others' CPU share | hypervisor steal |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for key, label in names.items():
        if key not in runs:  # a run from before (e) existed
            continue
        per = ", ".join(_f(x["total_s"], 2) for x in runs[key])
        share = ", ".join(_f(_g(x, "host_load", "during", "others_cpu_share", default=None), 2) for x in runs[key])
        steal = ", ".join(_f(_g(x, "host_load", "during", "steal_share", default=None), 2) for x in runs[key])
        out.append(f"| {label} | **{_f(med[key], 2)} s** | {per} | {_f(med[key] / fork, 2)} | "
                   f"{_f(_g(r, 'cpu_ideal_median_s', key), 2)} s | {_f(_g(r, 'efficiency_median', key), 2)} | {share} | {steal} |")
    out += [
        f"| ideal S + N·r/cores (nominal {p['S_target_s']:g} + {p['N']}·{p['r_target_s']:g}/{p['cores']}) | {_f(r['ideal_nominal_s'], 2)} s | | {_f(r['ideal_nominal_s'] / fork, 2)} | | | | |",
        f"| ideal from this run's local S, r (loop (c)) | {_f(r['ideal_measured_s'], 2)} s | | {_f(r['ideal_measured_s'] / fork, 2)} | | | | |",
        "",
        "*Its CPU work / cores*: the CPU seconds the variant's cells actually used (`time.thread_time()` inside the setup and "
        "every rollout, so page faults count and waiting for a core does not), the setup once and the rollouts spread over "
        f"the {p['cores']} cores (the loop: all of it in series). *Efficiency* = that / wall time. The VM's CPU speed drifts "
        f"(this run: the setup, calibrated to S = {p['S_target_s']:g} s of CPU at the start, took "
        f"{_f(min(_setup_cpus(runs)), 2)}-{_f(max(_setup_cpus(runs)), 2)} s of CPU in the variants), so a fixed S is not the same "
        "amount of work in every run; this column compares each variant with its own work, at the same moment.",
        "",
        f"ipyparallel cluster start (`ipp.Cluster(n=16).start_and_connect_sync()` + all engines registered), not in (b): "
        f"**{_f(r['ipp_cluster_start_s'], 1)} s** (each run: {', '.join(_f(x['cluster_start_s'], 1) for x in runs['b_ipyparallel'])}).",
        "",
        f"Fork vs ideal: **{_f(_g(d, 'goal', 'ratio'), 3)}×** its own CPU work / cores, judged on {_g(d, 'goal', 'judged_on')} "
        "(other processes < 10 % of the CPU; each run: "
        + ", ".join(_f(x, 3) for x in r.get("fork_vs_cpu_ideal_per_run", [])) + "), "
        f"{_f(r['fork_vs_ideal_measured'], 3)}× the ideal from the loop's local S and r, "
        f"{_f(r['fork_vs_ideal_nominal'], 3)}× the nominal ideal. "
        f"Goal within 15 %: {_ok(d['goal']['met'])}" + (f" (gap {_f(_g(d, 'goal', 'gap_ratio'), 3)}×)." if not d["goal"]["met"] else ".")
        + f" Fork is {_f(r['speedup_vs']['b_ipyparallel'], 1)}× faster than ipyparallel "
        f"({_f(r['speedup_vs_ipp_incl_cluster_start'], 1)}× counting its cluster start), "
        f"{_f(r['speedup_vs']['c_loop'], 1)}× faster than the loop and {_f(r['speedup_vs']['d_episodes'], 1)}× faster than episodes.",
        "",
        *_osfork_lines(r),
        "Fork breakdown, each run: " + "; ".join(
            f"setup cell {_f(x['setup_cell_s'], 2)} s + fork cell {_f(x['fork_cell_s'], 2)} s (branch wall median {_f(x['branch_wall_median_s'], 2)} s)"
            for x in runs["a_fork"]) + ". Episodes ran at concurrency "
        + f"{runs['d_episodes'][0].get('concurrency')} (the default for fresh machines).",
        "",
    ]
    return out


def b3_section(d: dict[str, Any]) -> list[str]:
    res = d["results"]
    be = res["backend"]
    floor = res["os_fork_floor_ms"]
    mg = res["magic_fork_cell_ms"]
    thp = res.get("whatif_thp")
    out = [
        "## B3 · fork cost (200 MiB warm state)",
        "",
        f"The parent machine holds {d['params']['state_mib']} MiB (a bytearray filled in the parent, all pages resident; "
        f"sandbox tree PSS before the fork {_f(_g(be, 'parent_tree', 'pss_mib'), 1)} MiB). "
        "*fork request*: `backend.branch()` returns (the agent forked N children). *all running*: every branch has also "
        "answered a first cell (`SEED`, checked per branch). Memory: PSS/USS from `/proc/PID/smaps_rollup` summed over bwrap "
        "and all its descendants, after every branch ran a cell; extra per branch = ΔPSS / N.",
        "",
        "| N | fork request ms (median / p95) | all running ms (median / p95) | `%%smol fork N` cell ms (median) | plain `os.fork()`×N of a 200 MiB process ms | delete all ms | extra PSS / branch MiB | branch USS MiB | others' CPU share |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, v in be["per_n"].items():
        mem = v["memory"]
        out.append(
            f"| {n} | {_f(v['fork_request_ms']['median'])} / {_f(v['fork_request_ms']['p95'])} | "
            f"**{_f(v['all_running_ms']['median'])}** / {_f(v['all_running_ms']['p95'])} | {_f(_g(mg, n, 'median'))} | "
            f"{_f(_g(floor, n, 'median'))} | {_f(v['delete_all_ms']['median'])} | **{_f(mem.get('extra_pss_per_branch_mib'), 2)}** | "
            f"{_f(mem.get('branch_uss_median_mib'), 2)} | {_f(_g(v, 'host_load', 'during', 'others_cpu_share'), 2)} |")
    g = d["goal"]
    out += [
        "",
        f"Goal fork 16 ≤ 150 ms and ≤ 25 MiB per branch: {_ok(g['met'])} — all running at N=16 {_f(g['fork16_all_running_ms'])} ms"
        + (f" (gap {_f(g['time_gap_ms'])} ms)" if g.get("time_gap_ms") else "")
        + f", {_f(g['extra_pss_per_branch_mib'], 2)} MiB per branch.",
        "",
    ]
    if thp:
        tb = thp["backend"]
        out += [
            "**What-if: the same machine with its heap in transparent huge pages** (no code change: "
            "`MachineSpec(env=GLIBC_TUNABLES=glibc.malloc.hugetlb=1, volumes=/sys/kernel/mm/transparent_hugepage ro)`; "
            f"parent AnonHugePages {_f(tb.get('parent_anon_huge_mib'), 0)} MiB):",
            "",
            "| N | fork request ms | all running ms (median / p95) | plain `os.fork()`×N, THP ms | delete all ms | extra PSS / branch MiB |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for n, v in tb["per_n"].items():
            out.append(f"| {n} | {_f(v['fork_request_ms']['median'])} | **{_f(v['all_running_ms']['median'])}** / {_f(v['all_running_ms']['p95'])} | "
                       f"{_f(_g(thp, 'os_fork_floor_ms', n, 'median'))} | {_f(v['delete_all_ms']['median'])} | "
                       f"{_f(v['memory'].get('extra_pss_per_branch_mib'), 2)} |")
        out.append("")
    return out


def meaning_section(b1: Any, b2: Any, b3: Any, prof: Any) -> list[str]:
    out = ["## What the numbers mean", ""]
    if b1:
        p1 = _g(prof, "p1_trivial_cell") or {}
        pump = _g(p1, "main_thread_cum_ms_per_cell", "queue.py:get")
        mainc = _g(p1, "main_thread_cum_ms_per_cell") or {}
        loopc = _g(p1, "loop_thread_cum_ms_per_cell") or {}
        over = _g(b1, "derived_ms", "smol_over_raw_median")
        wi = _g(b1, "derived_ms", "smol_over_raw_whatif_pump_patched_median")
        raw = _g(b1, "results_ms", "raw_exec", "median")
        if pump is not None and pump >= 20:
            out += [
                f"**B1: a trivial `%%smol` cell costs ~{_f(over, 0)} ms over raw exec, and almost all of it is one sleep of ours.** "
                f"The backend itself answers a `pass` in {_f(raw, 1)} ms. cProfile of {p1.get('cells', 'n/a')} cells inside the kernel "
                f"(P1, `bench/results/profile_p1_main.txt`): the main thread spends {_f(pump, 1)} ms per cell in `queue.Queue.get` "
                "called from `smolbench/magics.py:_drain`, called from `SmolMagics._pump`, which loops "
                "`while not job.done(): _drain(timeout=PUMP_INTERVAL)`; nothing is put on `_PENDING` when the job finishes, so a "
                "cell that prints nothing waits out the full 50 ms `PUMP_INTERVAL`.",
                "",
                "*Fix (ours, `smolbench/magics.py`, `SmolMagics._pump`)*: wake the pump when the job finishes, e.g. "
                "`job.future.add_done_callback(lambda _f: _PENDING.put(('wake', '', None)))` right after creating the Job. "
                f"Measured as a what-if in the benchmark kernel: {_f(wi, 1)} ms over raw exec (goal 10 ms).",
                "",
            ]
        else:
            out += [
                f"**B1: `%%smol` costs {_f(over, 1)} ms over the backend's raw exec** (goal ≤ 10 ms); the raw exec of a `pass` is "
                f"{_f(raw, 1)} ms and a local cell's kernel round trip {_f(_g(b1, 'results_ms', 'kernel_local', 'median'), 1)} ms. "
                "The magic's output pump now wakes the moment the job ends (`SmolMagics._pump` adds a done-callback that puts a "
                "wake item on `_PENDING`, commit 881bebf); before that every trivial cell slept out the 50 ms `PUMP_INTERVAL` "
                "(50.3 ms over raw at af2be04, see History). The what-if series, which patches the same wake-up in, measures "
                f"{_f(wi, 1)} ms - the same, as it should. Where the remaining time goes (P1, cProfile of {p1.get('cells', 'n/a')} "
                f"cells inside the kernel, cumulative ms per cell): main thread `_pump` waiting for the loop {_f(pump, 2)}, "
                f"`parse_argstring` {_f(mainc.get('magic_arguments.py:parse_argstring'), 2)}; loop thread `Workbench.run_cell` "
                f"{_f(loopc.get('workbench.py:run_cell'), 2)}, `SandboxBackend.exec_cell` {_f(loopc.get('sandbox.py:exec_cell'), 2)} "
                f"(opening the Unix socket `_open` {_f(loopc.get('sandbox.py:_open'), 2)}), `Ledger.add_cell` "
                f"{_f(loopc.get('ledger.py:add_cell'), 2)}. A persistent connection per machine instead of one per request "
                "(`SandboxBackend._stream`) would save the connect and the agent's per-connection thread start; nothing else "
                "stands out.",
                "",
            ]
        br = b1.get("busy_races") or {}
        if br:
            seen = (br.get("back_to_back_raw_with_busy_thread") or 0) + (br.get("kernel_smol_with_busy_thread") or 0) \
                + (br.get("back_to_back_raw_probe") or 0) + (br.get("in_kernel_raw_after_magic") or 0)
            out += [
                ("**B1 also found a race in the agent, which the old 50 ms sleep used to hide.** " if seen else
                 "**The agent's busy-lock race was not observed in this run.** ")
                + "A request sent right after a cell finished can be answered \"machine busy\". Counted here (the benchmark retries "
                f"those calls and does not time them): {br.get('back_to_back_raw_probe')} of {br.get('back_to_back_raw_probe_of')} "
                f"back-to-back `exec_cell` calls on an idle machine; **{br.get('back_to_back_raw_with_busy_thread')} of "
                f"{br.get('back_to_back_raw_with_busy_thread_of')}** when a user thread in the machine keeps the interpreter busy "
                "(a data loader, a simulator, a progress reporter); "
                f"**{br.get('kernel_smol_with_busy_thread')} of {br.get('kernel_smol_with_busy_thread_of')}** back-to-back `%%smol pass` "
                f"cells through the kernel in that case (a fast \"Run All\" fails on them); {br.get('in_kernel_raw_after_magic')} of "
                f"{br.get('in_kernel_raw_after_magic_of')} raw execs issued right after a `%%smol` cell inside the kernel. "
                "Cause (`smolbench/guest/agent.py`, `Agent.serve_forever`): the main thread sends the final `done`, and only in its "
                "`finally` block closes the connection (which releases the GIL), clears `_running` and releases `_busy`; the host "
                "gets `done` and sends the next request, and the agent's handler thread (`Agent._handle`, "
                "`self._busy.acquire(blocking=False)`) can run first - always possible, likely when another thread holds the GIL. "
                "*Fix*: in `serve_forever`, clear `_running` and release `_busy` before sending the final `done` (the main thread is "
                "the only consumer of the request queue, so the next request still waits for it); or have the host retry a busy "
                "answer for a few ms (`SandboxBackend.exec_cell` / `_wire.read_replies`).",
                "",
            ]
    if b2:
        r = b2["results"]
        p = b2["params"]
        fork = r["median_total_s"]["a_fork"]
        a = b2["runs"]["a_fork"]
        eff = r.get("efficiency_median", {})
        cpu = r.get("cpu_ideal_median_s", {})
        out += [
            f"**B2: the fork variant is fast because it does the setup once; the peers are not slow, they do 16× the work.** "
            f"(a) took {_f(fork, 2)} s; the CPU its cells actually used, setup once plus the rollouts over {p['cores']} cores, is "
            f"{_f(cpu.get('a_fork'), 2)} s (efficiency {_f(eff.get('a_fork'), 2)}). What is not compute: hypervisor steal ("
            + ", ".join(_f(_g(x, 'host_load', 'during', 'steal_share'), 2) for x in a)
            + " of the time; the VM's vCPUs lent to other VMs count in wall time, not in a thread's CPU time), two kernel round trips and the "
            "magic's own overhead (B1), one fork of a small state (a few ms, B3), and the imbalance of the last wave of branches "
            f"(branch wall median {_f(statistics_median([x['branch_wall_median_s'] for x in a]), 2)} s at the default fork concurrency of 4 per core). "
            f"ipyparallel runs at efficiency {_f(eff.get('b_ipyparallel'), 2)} against *its* work, {_f(cpu.get('b_ipyparallel'), 1)} s of CPU per core, "
            f"because every engine redoes the setup; it also needs a running cluster ({_f(r['ipp_cluster_start_s'], 1)} s to start 16 engines here). "
            f"`%%smol episodes 16` does the same 16 setups plus a sandbox boot per machine (efficiency {_f(eff.get('d_episodes'), 2)}); "
            f"the loop does them in series. Other processes on this shared host took "
            + ", ".join(_f(_g(x, 'host_load', 'during', 'others_cpu_share'), 2) for x in a)
            + " of the CPU during the fork runs.",
            "",
        ]
        p3 = _g(prof, "p3_fork_rollouts")
        if p3:
            out += [
                f"Host-side orchestration of `%%smol fork 16` (P3, profiled in the kernel): {_f(p3['kernel_cpu_s'], 2)} s of kernel CPU "
                f"for a {_f(p3['wall_s'], 2)} s cell (ideal {_f(p3['ideal_s'], 2)} s of rollouts), i.e. it barely competes with the branches; "
                f"ledger writes (`Workbench._record` {_f(_g(p3, 'loop_thread_cum_ms', 'workbench.py:_record'), 0)} ms cumulative) "
                "and socket round trips are the loop thread's main costs. The first fork cell in a kernel also pays one-off imports "
                "(traitlets/ipywidgets for the progress and tree views).",
                "",
            ]
    if b3:
        be = b3["results"]["backend"]["per_n"]
        thp = _g(b3, "results", "whatif_thp", "backend", "per_n") or {}
        p2 = _g(prof, "p2_fork") or {}
        out += [
            "**B3: fork cost is the kernel copying page tables, N times, one after the other.** Memory is fine: each branch adds "
            f"{_f(_g(be, '16', 'memory', 'extra_pss_per_branch_mib'), 2)} MiB of PSS at N=16 (goal ≤ 25 MiB): copy-on-write shares the "
            "200 MiB state; what a branch owns is its Python heap pages touched after the fork, its thread stacks and page tables. "
            f"Time grows linearly with N: {_f(_g(be, '1', 'all_running_ms', 'median'))} / {_f(_g(be, '4', 'all_running_ms', 'median'))} / "
            f"{_f(_g(be, '16', 'all_running_ms', 'median'))} / {_f(_g(be, '64', 'all_running_ms', 'median'))} ms for N = 1/4/16/64, "
            f"about {_f(_ratio(_g(be, '16', 'all_running_ms', 'median'), _g(b3, 'results', 'os_fork_floor_ms', '16', 'median')), 1)}× "
            "plain `os.fork()` ×N of a Python process holding 200 MiB in a loop "
            f"({_f(_g(b3, 'results', 'os_fork_floor_ms', '16', 'median'))} ms for 16 here; the rest is a listening socket per branch, "
            "the new branches starting up while the parent still forks, and their first cell). Every fork of a 200 MiB process "
            "copies and write-protects ~51,200 page-table entries; on this VM (paravirtualised MMU) that is several ms per fork. "
            f"Inside the guest (P2): one `os.fork()` of the agent with its 200 MiB takes {_f(p2.get('guest_os_fork_median_ms'), 2)} ms "
            f"(median of 16, child exits at once); a branch's own start-up is small (`_set_pdeathsig` {_f(_g(p2, 'branch_startup', 'pdeathsig_ms'), 2)} ms, "
            f"`_private_files` {_f(_g(p2, 'branch_startup', 'private_files_ms'), 2)} ms, mode {_g(p2, 'branch_startup', 'mode')}); the host side "
            f"of `branch()` + first cells is {_f(_g(p2, 'host_loop_cum_ms', 'sandbox.py:branch'), 1)} ms + {_f(_g(p2, 'host_loop_cum_ms', 'sandbox.py:exec_cell'), 1)} ms of loop CPU. "
            "So the sequential fork loop in `Agent.fork` is the cost, and its unit price is set by page-table size.",
            "",
            "*Fix 1 (ours, `smolbench/backends/sandbox.py`, `SandboxBackend._command`)*: start the agent with its heap in "
            "transparent huge pages — add `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` to the `--setenv` list and "
            "`--ro-bind /sys/kernel/mm/transparent_hugepage /sys/kernel/mm/transparent_hugepage` (glibc reads the THP mode there; "
            "only when the host's mode is `madvise` or `always`). Then 200 MiB is ~100 PMD entries instead of ~51,200 PTEs. "
            f"Measured what-if (same code, spec env/volume only): all running at N=16 {_f(_g(thp, '16', 'all_running_ms', 'median'))} ms "
            f"(vs {_f(_g(be, '16', 'all_running_ms', 'median'))}), N=64 {_f(_g(thp, '64', 'all_running_ms', 'median'))} ms "
            f"(vs {_f(_g(be, '64', 'all_running_ms', 'median'))}), extra PSS per branch unchanged "
            f"({_f(_g(thp, '16', 'memory', 'extra_pss_per_branch_mib'), 2)} MiB: a child's write to a huge page splits it and copies 4 KiB). "
            "numpy / torch allocations go through the same malloc, so they benefit too.",
            "",
            "*Fix 2 (ours, `smolbench/guest/agent.py`, `Agent.fork`)*: the N forks run one after the other in the parent while the "
            "first children already compete for the 2 cores. Forking a small tree (the parent forks k helpers that each fork N/k "
            "branches) spreads page-table copying over the cores; not measured here.",
            "",
            "*Fix 3 (ours, `smolbench/workbench.py`)*: `Workbench._apply_keep` / `_drop` delete branches one at a time (a `kill` round "
            "trip to the root agent each: the `delete all` column). Gather them (`asyncio.gather`) or add a batch kill op; and "
            "`Workbench._record` recomputes `self.spec.baseline()` (a `dataclasses.asdict` + sha256) on every ledger write — compute "
            "it once in `__init__` (the spec is frozen).",
            "",
            "The `%%smol fork N` cell column adds to *all running*: running `pass` in every branch, the ledger rows, the keep policy "
            "(here `--keep none`, so N deletions, one `kill` round trip each) and the magic's own overhead from B1.",
            "",
        ]
    return out


def vm_emulated_section(d: dict[str, Any]) -> list[str]:
    """Real smol microVMs, nested in QEMU software emulation (the lane's bench/vm_emulated.py)."""
    m = d.get("machine", {})
    trip = d.get("exec_roundtrip_s", {})
    return [
        "## Real microVM, emulated (not comparable to hardware KVM)", "",
        "Measured by `bench/vm_emulated.py` inside the real-microVM lane (`VMLANE_BENCH=1 bash tests/vm/run.sh`): "
        f"smolbench's smol backend on real smol microVMs, nested in {m.get('what', 'QEMU software emulation')}. "
        "Every instruction of the microVM and of its host is emulated in software, so these numbers are tens of times "
        "slower than on a KVM host and say nothing about smolbench on hardware; they show what works and what the lane costs. "
        f"Machine: {m.get('memory_mib')} MiB, image `{m.get('image')}` (a rootfs directory), {m.get('date', '')}.", "",
        "| step | seconds |", "|---|---:|",
        f"| create (boot + copy in and start the agent) | {_f(d.get('create_s'), 1)} |",
        f"| trivial cell round trip (median of {trip.get('n')}; min {_f(trip.get('min'), 2)}) | {_f(trip.get('median'), 2)} |",
        f"| branch ×4 (one `branch_batch` + a seed request each) | {_f(d.get('branch4_s'), 1)} |",
        f"| first cell in all 4 branches | {_f(d.get('branch4_first_cell_s'), 1)} |",
        f"| delete all 5 machines | {_f(d.get('delete_all_s'), 1)} |", "",
    ]


def write(quick: bool = False) -> Path:
    b1, b2, b3 = _load("b1_overhead", quick), _load("b2_fanout", quick), _load("b3_fork", quick)
    prof = _load("profile", quick)
    first = next((x for x in (b1, b2, b3, prof) if x), None)
    lines = ["# smolbench benchmarks: results", ""]
    lines += ["Generated by `python -m bench.run" + (" --quick" if quick else "") + "` from `bench/results/*" + (".quick" if quick else "")
              + ".json` (regenerate with `python -m bench.run --report`). Timings are measurements, never test assertions.", ""]
    if first:
        lines += [_machine(first), ""]
        if first["machine"].get("backend") != "smol":
            lines += [f"No KVM microVM was used: these numbers are for the **{first['machine']['backend']}** backend "
                      "(bubblewrap sandbox, live branches are `os.fork()` of the warm agent). "
                      "`python -m bench.run --backend smol` runs the same scripts on a KVM host.", ""]
        lines += ["The host is shared: other engineers' test suites (JupyterLab + Chromium, pytest) ran during the benchmark. "
                  "Each stage waits (bounded) for a quiet host and records the share of CPU other processes took while it ran; "
                  "read ratios with that column in mind.", ""]
    run = _load("run", quick)
    if run:
        cs, ce = run.get("code_start", {}), run.get("code_end", {})
        lines += [f"Code measured: commit `{cs.get('git_commit')}`, smolbench sources sha256 `{cs.get('sources_sha256')}`"
                  + (f" - **WARNING: the sources changed during the run (to `{ce.get('git_commit')}` / `{ce.get('sources_sha256')}`), "
                     "the numbers mix code versions**" if run.get("code_changed_during_run") else ", unchanged from start to end of the run")
                  + f"; whole run {_f(run.get('total_s'), 0)} s; processes left behind: {len(run.get('leftover_processes') or [])}.", ""]
    # Summary of goals
    lines += ["## Goals", "", "| benchmark | goal | measured | status |", "|---|---|---|---|"]
    if b1:
        lines.append(f"| B1 cell overhead | `%%smol` ≤ 10 ms median over raw exec | {_f(b1['derived_ms']['smol_over_raw_median'], 1)} ms "
                     f"(p95 of `%%smol` − local: {_f(b1['derived_ms']['smol_minus_local_p95'], 1)} ms); what-if with the pump woken on completion "
                     f"{_f(b1['derived_ms']['smol_over_raw_whatif_pump_patched_median'], 1)} ms | {_ok(b1['goal']['met'])} |")
    if b2:
        r = b2["results"]
        lines.append(f"| B2 warm fan-out | fork within 15 % of S + N·r/cores | {_f(r['median_total_s']['a_fork'], 2)} s = "
                     f"{_f(_g(b2, 'goal', 'ratio'), 3)}× its CPU work / cores on {_g(b2, 'goal', 'judged_on')} "
                     f"({_f(r['fork_vs_ideal_nominal'], 3)}× nominal "
                     f"{_f(r['ideal_nominal_s'], 1)} s); ipyparallel "
                     f"{_f(r['median_total_s']['b_ipyparallel'], 1)} s + {_f(r['ipp_cluster_start_s'], 1)} s start, loop "
                     f"{_f(r['median_total_s']['c_loop'], 1)} s, episodes {_f(r['median_total_s']['d_episodes'], 1)} s | {_ok(b2['goal']['met'])} |")
    if b3:
        g = b3["goal"]
        lines.append(f"| B3 fork cost | fork 16 ≤ 150 ms, ≤ 25 MiB/branch | {_f(g['fork16_all_running_ms'])} ms, "
                     f"{_f(g['extra_pss_per_branch_mib'], 2)} MiB/branch | {_ok(g['met'])}"
                     + (f" (time gap {_f(g['time_gap_ms'])} ms; memory met)" if not g["met"] and not g.get("memory_gap_mib") else "") + " |")
    b4g = (_load("b4_labext", quick) or {}).get("goal")
    if b4g:
        lines.append(f"| B4 sidebar runs endpoint | well under 100 ms on a 100,000-node ledger | HTTP p95 {_f(b4g['runs_endpoint_p95_ms'], 1)} ms, "
                     f"uncached median {_f(b4g.get('cold_median_ms'), 1)} ms (p95 {_f(b4g.get('cold_p95_ms'), 1)} ms) | {_ok(b4g['met'])} |")
    lines.append("")
    if b1:
        lines += b1_section(b1)
    if b2:
        lines += b2_section(b2)
    if b3:
        lines += b3_section(b3)
    lines += meaning_section(b1, b2, b3, prof)
    b4 = _load("b4_labext", quick)
    if b4:
        from .b4_labext import section as b4_section

        lines += b4_section(b4)
    flood = _load("flood", quick)
    if flood:
        from .flood import section as flood_section

        lines += flood_section(flood)
    from .b3_fork import containment_note

    lines += containment_note(b1, b3)
    ws = _load("b3_workspace", quick)
    if ws:
        from .b3_fork import section as ws_section

        lines += ws_section(ws)
    limits = _load("limits", quick)
    if limits:
        from .limits import section as limits_section

        lines += limits_section(limits)
    guard = _load("mountguard", quick)
    if guard:
        from .mountguard import section as guard_section

        lines += guard_section(guard)
    net = _load("netpolicy", quick)
    if net:
        from .netpolicy import section as net_section

        lines += net_section(net)
    pkgs = _load("packages", quick)
    if pkgs:
        from .packages import section as packages_section

        lines += [*packages_section(pkgs).splitlines(), ""]
    scale = _load("scale", quick)
    if scale:
        from .scale import _int_keys
        from .scale import section as scale_section

        lines += [scale_section(json.loads(json.dumps(scale), object_hook=_int_keys)), ""]
    hist = RESULTS / "history.jsonl"
    if hist.exists() and not quick:
        rows = [json.loads(x) for x in hist.read_text().splitlines() if x.strip()]
        lines += ["## History", "", "One line per full run (`bench/results/history.jsonl`).", "",
                  "| date | commit | B1 %%smol over raw ms | B2 fork s | B2 fork / its CPU work | B3 fork 16 all running ms | B3 MiB/branch | note |",
                  "|---|---|---:|---:|---:|---:|---:|---|"]
        for h in rows:
            note = h.get("note") or ("sources changed during the run" if h.get("code_changed_during_run") else "")
            lines.append(f"| {h['date'][:16]} | `{h['git_commit']}` | {_f(h['b1_smol_over_raw_ms'], 1)} | {_f(h['b2_fork_s'], 2)} | "
                         f"{_f(h['b2_fork_vs_cpu_ideal'], 3)} ({h.get('b2_judged_on', '')}) | {_f(h['b3_fork16_all_running_ms'], 1)} | "
                         f"{_f(h['b3_extra_pss_per_branch_mib'], 2)} | {note} |")
        lines.append("")
    vm = None if quick else _load("vm_emulated", False)
    if vm:
        lines += vm_emulated_section(vm)
    lines += ["## Files", "",
              "* `bench/results/b1_overhead.json`, `b2_fanout.json`, `b3_fork.json`, `profile.json`: every number above, with machine info "
              "(cores, CPU, Python, backend, date, commit) and per-stage host load; B1 keeps its raw samples.",
              "* `bench/results/profile_*.txt`: cProfile tables (P1 trivial cell, P2 fork host side and branch start-up, P3 fork of rollouts).",
              "* `--quick` runs write `*.quick.json` and `bench/results/quick/`, and never overwrite the full run.", ""]
    # The scale-out sections (written by their own scripts, which need Ray) come last, from their JSON.
    for name in ("b5_cluster", "b5_dispatch"):
        data = None if quick else _load(name, False)
        if data:
            lines += ["", _section_of(name)(data)] if lines[-1] else [_section_of(name)(data)]
    out = (RESULTS / "quick" / "RESULTS.md") if quick else (BENCH_DIR / "RESULTS.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + ("\n" if lines[-1].endswith("-->") else ""))
    return out


def _section_of(name: str) -> Any:
    import importlib

    return importlib.import_module(f"bench.{name}").section
