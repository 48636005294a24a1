"""B5 dispatch: what one agent call per node (batched) saves over one call per machine request.

Side by side in one run, rounds interleaved: a fork of N ``pass`` branches on this host's
sandbox (the baseline), then through two local Ray nodes with batching on (one agent call
per node for the cells, one for the deletes) and off (``ClusterBackend(batching=False)``:
one call per branch, as before batching). Both cluster drivers share one Ray connection
and the same two nodes, each with its own agents; every branch runs at once (concurrency
N) and the parent's replica is warm. Dispatch overhead per branch = (cluster − local) / N.
The agents' own counters give the calls each fork made.

``python -m bench.b5_dispatch`` writes ``bench/results/b5_dispatch.json`` and the section
between its markers in ``bench/RESULTS.md``. Needs the ``ray`` extra and bubblewrap.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.b5_cluster import _cell, _fork, _wb
from bench.common import write_section

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
SIZES = (16, 48)
BEGIN, END = "<!-- b5-dispatch:begin -->", "<!-- b5-dispatch:end -->"


def _calls(wb: Any) -> dict[str, int]:
    """Agent calls so far, summed over the nodes, by kind (what `%smol status` shows)."""
    from smolbench import _loop

    _loop.run(wb.backend.poll())
    out: dict[str, int] = {}
    for node in wb.backend.nodes.values():
        for kind, n in node.calls.items():
            out[kind] = out.get(kind, 0) + n
    return out


def measure(rounds: int) -> dict[str, Any]:
    from smolbench import _loop
    from smolbench.backends.sandbox import SandboxBackend
    from smolbench.cluster.backend import ClusterBackend
    from smolbench.cluster.local import LocalCluster

    out: dict[str, Any] = {"rounds": rounds, "sizes": list(SIZES), "load_before": os.getloadavg()}
    folder = tempfile.mkdtemp(prefix="b5d-")
    atexit.register(shutil.rmtree, folder, True)  # its ledgers and run folders go on every exit
    with LocalCluster(2, slots=max(SIZES), backends=["sandbox"]) as cluster:
        wbs = {"local": _wb(SandboxBackend(), folder + "/local")}
        for mode, batching in (("batched", True), ("per_request", False)):
            cb = ClusterBackend(cluster.address, batching=batching)
            cb.start()
            wbs[mode] = _wb(cb, f"{folder}/{mode}")
        for wb in wbs.values():
            _loop.run(wb.up())
            _cell(wb, "x = 1")
        for mode in ("batched", "per_request"):
            _fork(wbs[mode], "pass", 4)  # the replica on the other node, made once
        series: dict[str, list[float]] = {}
        calls: dict[str, dict[str, int]] = {}
        for _ in range(rounds):
            for n in SIZES:
                for mode, wb in wbs.items():
                    before = _calls(wb) if mode != "local" else {}
                    series.setdefault(f"{mode}_{n}", []).append(_fork(wb, "pass", n))
                    if mode != "local":
                        after = _calls(wb)
                        calls[f"{mode}_{n}"] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        for wb in wbs.values():
            _loop.run(wb.down())
    out["load_after"] = os.getloadavg()
    out["series"] = series
    out["median"] = {k: statistics.median(v) for k, v in series.items()}
    out["calls"] = calls
    m = out["median"]
    out["per_branch_ms"] = {f"{mode}_{n}": 1000 * (m[f"{mode}_{n}"] - m[f"local_{n}"]) / n
                            for n in SIZES for mode in ("batched", "per_request")}
    return out


def section(out: dict[str, Any]) -> str:
    m, per, calls = out["median"], out["per_branch_ms"], out["calls"]
    lines = [BEGIN, "### B5 · dispatch per branch, batched vs. one call per request", "",
             f"One run, {out['rounds']} interleaved rounds, medians; a fork of N `pass` branches, every branch at once, "
             "the parent's replica warm; two local Ray nodes (sandbox) shared by both cluster drivers. "
             f"Host load average {out['load_before'][0]:.1f} before, {out['load_after'][0]:.1f} after.", "",
             "| N | local | cluster, batched | cluster, one call per request | dispatch/branch batched | "
             "dispatch/branch per request | agent calls (cells + deletes) batched / per request |",
             "|---|---|---|---|---|---|---|"]
    for n in out["sizes"]:
        b, p = calls.get(f"batched_{n}", {}), calls.get(f"per_request_{n}", {})
        lines.append(f"| {n} | {m[f'local_{n}']:.2f} s | {m[f'batched_{n}']:.2f} s | {m[f'per_request_{n}']:.2f} s | "
                     f"{per[f'batched_{n}']:.1f} ms | {per[f'per_request_{n}']:.1f} ms | "
                     f"{b.get('exec', 0) + b.get('delete', 0)} / {p.get('exec', 0) + p.get('delete', 0)} |")
    saved = ", ".join(f"{1000 * (m[f'per_request_{n}'] - m[f'batched_{n}']) / n:.1f} ms at N = {n}" for n in out["sizes"])
    lines += ["", "Dispatch per branch = (cluster − local) / N: what the cluster path adds per branch on one host "
              "(both sides share its 2 cores; negative where the cluster's two agent processes share host-side "
              f"work the local fork does on one loop thread). Batching saves per branch: **{saved}** "
              "(one call per request − batched, / N). Raw numbers: `bench/results/b5_dispatch.json`.", END]
    return "\n".join(lines)


def write(out: dict[str, Any]) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "b5_dispatch.json").write_text(json.dumps(out, indent=1))
    write_section(ROOT / "RESULTS.md", section(out), BEGIN, END, after="<!-- b5:end -->")  # right after B5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--report", action="store_true", help="rewrite the RESULTS.md section from the JSON")
    args = ap.parse_args()
    t0 = time.perf_counter()
    out = json.loads((RESULTS / "b5_dispatch.json").read_text()) if args.report else measure(args.rounds)
    if not args.report:
        out["wall_s"] = time.perf_counter() - t0
    write(out)
    print(section(out))


if __name__ == "__main__":
    main()
