"""B5 scale-out: a fork and episodes on this host's sandbox vs. through local Ray nodes.

Measured side by side in one run, in-process (a Workbench on smolbench's loop, as the
magics drive it), rounds interleaved local / cluster:

* fork 16 of a rollout (~50 ms of CPU each) locally vs. through two local Ray nodes
  (8 slots each: one batch per node, one replica), with the replica made in that fork
  ("cold": the parent just ran a cell) and reused ("warm");
* the cost of a replica: bytes shipped and seconds, for a parent with 1 and with 10 cells;
* dispatch overhead per branch: fork 16 of ``pass``, cluster (warm) minus local, / 16;
* episodes per second: episodes 16 of ``pass``, local vs. cluster;
* a projection to 4, 16 and 64 nodes from the measured per-node costs.

``python -m bench.b5_cluster`` writes ``bench/results/b5_cluster.json`` and the B5 section
of ``bench/RESULTS.md`` (between its markers). Needs the ``ray`` extra and bubblewrap.
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import write_section

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
ROLLOUT = ("import random, time\nt = time.process_time()\nacc = 0\n"
           "while time.process_time() - t < 0.05:\n    acc += random.random()\nreward = random.random()")
N = 16
BEGIN, END = "<!-- b5:begin -->", "<!-- b5:end -->"


def _wb(backend: Any, folder: str) -> Any:
    from smolbench.ledger import Ledger
    from smolbench.spec import MachineSpec
    from smolbench.workbench import Workbench

    return Workbench(backend, MachineSpec(), Ledger(f"{folder}/ledger.db"))


def _timed(coro: Any) -> float:
    from smolbench import _loop

    t0 = time.perf_counter()
    _loop.run(coro)
    return time.perf_counter() - t0


def _fork(wb: Any, code: str, n: int = N) -> float:
    res = wb.new_fork(n)  # every branch at once on both sides (the defaults differ: 4/core locally, slots on a cluster)
    t = _timed(wb.fork(res, code, lambda b, e: None, keep="none", concurrency=n))
    bad = [r for r in res.rows.values() if r["status"] != "ok"]
    assert not bad, bad[:2]
    return t


def _episodes(wb: Any, n: int = N) -> float:
    res = wb.new_episodes(n)
    t = _timed(wb.episodes(res, "pass", lambda b, e: None, concurrency=n))
    assert all(r["status"] == "ok" for r in res.rows.values())
    return t


def _round_trips(wb: Any, count: int = 30) -> list[float]:
    """Seconds per `pass` cell on the active machine, one after another (no fork)."""
    from smolbench import _loop
    from smolbench.backends.base import CellRequest

    ref = wb.machines[wb.active]
    out = []
    for _ in range(count):
        t0 = time.perf_counter()
        _loop.run(wb.backend.exec_cell(ref, CellRequest("pass"), lambda e: None))
        out.append(time.perf_counter() - t0)
    return out


def _cell(wb: Any, code: str) -> None:
    from smolbench import _loop

    res = _loop.run(wb.run_cell(code, lambda e: None))
    assert res.status == "ok", res.error


def measure(rounds: int) -> dict[str, Any]:
    import os

    from smolbench import _loop
    from smolbench.backends.sandbox import SandboxBackend
    from smolbench.cluster.backend import ClusterBackend
    from smolbench.cluster.local import LocalCluster

    out: dict[str, Any] = {"rounds": rounds, "n": N, "rollout_cpu_s": 0.05, "load_before": os.getloadavg()}
    folder = tempfile.mkdtemp(prefix="b5-")
    atexit.register(shutil.rmtree, folder, True)  # its ledgers and run folders go on every exit
    t0 = time.perf_counter()
    with LocalCluster(2, slots=8, backends=["sandbox"]) as cluster:
        out["cluster_start_s"] = time.perf_counter() - t0
        cb = ClusterBackend(cluster.address)
        t1 = time.perf_counter()
        cb.start()
        out["agents_start_s"] = time.perf_counter() - t1
        local = _wb(SandboxBackend(), folder + "/local")
        remote = _wb(cb, folder + "/cluster")
        for wb in (local, remote):
            _loop.run(wb.up())
            _cell(wb, "x = 1")
        series: dict[str, list[float]] = {k: [] for k in (
            "local_fork", "cluster_fork_cold", "cluster_fork_warm", "local_fork_pass", "cluster_fork_pass",
            "local_episodes", "cluster_episodes")}
        for r in range(rounds):
            _cell(local, f"x = {r}")
            _cell(remote, f"x = {r}")  # the parent changed: the next cluster fork makes a new replica
            series["local_fork"].append(_fork(local, ROLLOUT))
            series["cluster_fork_cold"].append(_fork(remote, ROLLOUT))
            series["cluster_fork_warm"].append(_fork(remote, ROLLOUT))
            series["local_fork"].append(_fork(local, ROLLOUT))
            series["cluster_fork_pass"].append(_fork(remote, "pass"))
            series["local_fork_pass"].append(_fork(local, "pass"))
            series["local_episodes"].append(_episodes(local))
            series["cluster_episodes"].append(_episodes(remote))
            series.setdefault("local_cell", []).extend(_round_trips(local))
            series.setdefault("cluster_cell", []).extend(_round_trips(remote))
        reps = remote.ledger.replica_rows(remote.session)
        out["replica_1_cell"] = {"bytes": statistics.median(r["bytes_shipped"] for r in reps),
                                 "seconds": statistics.median(r["seconds"] for r in reps)}
        for i in range(9):  # a parent with 10 more cells of state
            _cell(remote, f"table_{i} = {{k: k * k for k in range(2000)}}")
        _fork(remote, ROLLOUT)
        last = remote.ledger.replica_rows(remote.session)[-1]
        out["replica_10_cells"] = {"bytes": last["bytes_shipped"], "seconds": last["seconds"], "cells": last["cells"]}
        out["series"] = series
        out["median"] = {k: statistics.median(v) for k, v in series.items()}
        for wb in (local, remote):
            _loop.run(wb.down())
    out["load_after"] = os.getloadavg()
    m = out["median"]
    out["ratio_warm"] = m["cluster_fork_warm"] / m["local_fork"]
    out["ratio_cold"] = m["cluster_fork_cold"] / m["local_fork"]
    out["dispatch_per_branch_ms"] = 1000 * (m["cluster_fork_pass"] - m["local_fork_pass"]) / N
    out["dispatch_per_cell_ms"] = 1000 * (m["cluster_cell"] - m["local_cell"])
    out["episodes_per_s"] = {"local": N / m["local_episodes"], "cluster": N / m["cluster_episodes"]}
    out["projection"] = project(out)
    return out


def project(out: dict[str, Any]) -> list[dict[str, Any]]:
    """Time for fork 256 and episodes 10,000 on K nodes, from this run's per-node costs.

    Assumptions: every node is like this host (2 cores, the local fork's per-branch time
    for work placed on it); nodes work in parallel; the driver's serial cost per branch is
    the measured dispatch overhead; one replica per node per parent state, made in
    parallel (its measured seconds, once); network transfer of the replayed cells is
    negligible (bytes, not memory); the head and GCS are not the bottleneck.
    """
    m = out["median"]
    per_branch_node = m["local_fork"] / N  # a branch's share of one 2-core node
    # the driver's serial part: one streamed call per machine (the per-cell dispatch cost), at least
    dispatch = max(0.0, out["dispatch_per_branch_ms"] / 1000, out["dispatch_per_cell_ms"] / 1000)
    replica = out["replica_1_cell"]["seconds"]
    per_episode_node = m["local_episodes"] / N
    rows = []
    for k in (4, 16, 64):
        fork256 = replica + 256 * dispatch + (256 / k) * per_branch_node
        eps = 10_000 * dispatch + (10_000 / k) * per_episode_node
        rows.append({"nodes": k, "fork_256_s": fork256, "episodes_10000_s": eps,
                     "episodes_per_s": 10_000 / eps, "driver_bound_at_nodes": per_episode_node / dispatch if dispatch else None})
    return rows


def section(out: dict[str, Any]) -> str:
    m = out["median"]
    lines = [BEGIN, "## B5 · Scale-out on Ray (local sandbox vs. local Ray nodes, one host)", "",
             f"One run, {out['rounds']} interleaved rounds, medians; in-process Workbench; cluster start "
             f"{out['cluster_start_s']:.0f} s + agents {out['agents_start_s']:.0f} s (not included below). "
             "Both sides share this host's 2 cores, so the cluster can only add overhead here; every branch runs at "
             f"once on both sides (--concurrency 16). Host load average {out['load_before'][0]:.1f} before, "
             f"{out['load_after'][0]:.1f} after (other engineers' jobs): single runs are noisy.", "",
             "| measure | local | cluster (2 nodes) | cluster / local |", "|---|---|---|---|",
             f"| fork 16 of a 50 ms rollout, replica reused | {m['local_fork']:.2f} s | {m['cluster_fork_warm']:.2f} s | "
             f"{out['ratio_warm']:.2f}× (goal ≤ 1.5×) |",
             f"| fork 16, replica made in the fork | {m['local_fork']:.2f} s | {m['cluster_fork_cold']:.2f} s | {out['ratio_cold']:.2f}× |",
             f"| fork 16 of `pass` | {m['local_fork_pass']:.2f} s | {m['cluster_fork_pass']:.2f} s | "
             f"{m['cluster_fork_pass'] / m['local_fork_pass']:.2f}× |",
             f"| episodes 16 of `pass` | {out['episodes_per_s']['local']:.1f} /s | {out['episodes_per_s']['cluster']:.1f} /s | "
             f"{out['episodes_per_s']['local'] / out['episodes_per_s']['cluster']:.2f}× |", "",
             "Ratios are cluster time / local time. Where the cluster comes out faster on one host, a likely reason "
             "(not measured separately) is that a local fork does every branch's host-side machine work (cgroups, "
             "/proc scans, sockets) on the kernel's one loop thread, while on the cluster two agent processes share "
             "it (the gate still runs on the driver); "
             "and with load averages this high, two runs of the same thing differ by 2×.", "",
             f"Dispatch overhead per branch (cluster − local, fork 16 of `pass`, / 16): **{out['dispatch_per_branch_ms']:.1f} ms**; "
             f"per cell on one machine (median of {len(out['series']['local_cell'])} `pass` round trips, cluster "
             f"{1000 * m['cluster_cell']:.1f} ms − local {1000 * m['local_cell']:.1f} ms): **{out['dispatch_per_cell_ms']:.1f} ms** "
             "(a Ray actor call returning a streaming generator, each chunk an object).", "",
             f"Replica cost (sandbox node: replay of the recorded path): parent with 1 cell "
             f"{out['replica_1_cell']['bytes']:.0f} B shipped, {out['replica_1_cell']['seconds']:.2f} s; "
             f"with {out['replica_10_cells']['cells']} cells {out['replica_10_cells']['bytes']} B, "
             f"{out['replica_10_cells']['seconds']:.2f} s (a fresh machine, the cells, and two fingerprints).", "",
             "Projection (assumptions: nodes like this 2-core host; a branch costs a node what it costs here locally; "
             "the driver's serial cost per branch is the dispatch overhead above; one replica per node, made in "
             "parallel; replayed code, not memory, crosses the network; head/GCS not the bottleneck):", "",
             "| nodes | fork 256 | episodes 10,000 | episodes/s |", "|---|---|---|---|"]
    for row in out["projection"]:
        lines.append(f"| {row['nodes']} | {row['fork_256_s']:.1f} s | {row['episodes_10000_s']:.0f} s | {row['episodes_per_s']:.1f} |")
    bound = out["projection"][0]["driver_bound_at_nodes"]
    if bound:
        lines += ["", f"Past about {bound:.0f} nodes the driver's dispatch (one streamed call per machine) is the limit, not the nodes."]
    lines += ["", "Raw numbers: `bench/results/b5_cluster.json`.", END]
    return "\n".join(lines)


def write(out: dict[str, Any]) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "b5_cluster.json").write_text(json.dumps(out, indent=1))
    write_section(ROOT / "RESULTS.md", section(out), BEGIN, END)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--report", action="store_true", help="rewrite the RESULTS.md section from the JSON")
    args = ap.parse_args()
    out = json.loads((RESULTS / "b5_cluster.json").read_text()) if args.report else measure(args.rounds)
    write(out)
    print(section(out))


if __name__ == "__main__":
    main()
