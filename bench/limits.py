"""What enforced limits cost (issue 8): the same sandbox work with limits on and off.

    python -m bench.limits [--rounds N]   # writes bench/results/limits.json, regenerates RESULTS.md

Two sandbox backends in one process, one with limits (a cgroup per machine and per
branch where writable, else rlimits), one with ``_limits.ENFORCE = False``; rounds
interleave them so host load hits both alike. Per round, on a machine holding
200 MiB of warm state:

* ``raw_exec``: ``exec_cell("pass")`` round trip (what B1's raw exec times);
* ``fork16``: ``branch`` of 16 until every branch answered a first cell (B3's
  "all running");
* ``delete16``: deleting those 16 branches (with limits: each cgroup emptied and removed).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

from bench.common import RESULTS, machine_info  # noqa: E402


async def _measure(rounds: int, run_dir: str) -> dict[str, Any]:
    from smolbench.backends import _limits
    from smolbench.backends.base import CellRequest
    from smolbench.backends.sandbox import SandboxBackend
    from smolbench.spec import MachineSpec

    spec = MachineSpec(memory=2048)
    sides: dict[str, Any] = {}
    for mode in ("on", "off"):
        _limits.ENFORCE = mode == "on"
        backend = SandboxBackend(runtime_dir=run_dir)
        ref = await backend.create(spec, "root")
        await backend.exec_cell(ref, CellRequest("state = bytearray(200 << 20)\nstate[::4096] = b'x' * len(state[::4096])"),
                                lambda e: None)
        sides[mode] = {"backend": backend, "ref": ref, "raw_exec": [], "fork16": [], "delete16": [],
                       "mechanism": backend.limits_status(spec)}
    _limits.ENFORCE = True
    try:
        for r in range(rounds):
            for side in (list(sides.values()) if r % 2 == 0 else list(sides.values())[::-1]):
                b, ref = side["backend"], side["ref"]
                for _ in range(10):
                    t0 = time.perf_counter()
                    await b.exec_cell(ref, CellRequest("pass"), lambda e: None)
                    side["raw_exec"].append((time.perf_counter() - t0) * 1e3)
                t0 = time.perf_counter()
                kids = await b.branch(ref, [f"root.{r}.{i}" for i in range(16)], list(range(16)))
                await asyncio.gather(*(b.exec_cell(k, CellRequest("SEED"), lambda e: None) for k in kids))
                side["fork16"].append((time.perf_counter() - t0) * 1e3)
                t0 = time.perf_counter()
                await asyncio.gather(*(b.delete(k) for k in kids))
                side["delete16"].append((time.perf_counter() - t0) * 1e3)
    finally:
        for side in sides.values():
            await side["backend"].close()
    out: dict[str, Any] = {}
    for mode, side in sides.items():
        out[mode] = {"mechanism": side["mechanism"]}
        for key in ("raw_exec", "fork16", "delete16"):
            vals = side[key]
            out[mode][key] = {"median_ms": statistics.median(vals), "min_ms": min(vals), "n": len(vals)}
    return out


def run(rounds: int = 12) -> dict[str, Any]:
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-limits-") as run_dir:
        results = asyncio.run(_measure(rounds, run_dir))
    return {"machine": machine_info("sandbox"), "rounds": rounds, "results": results,
            "load_avg": [load, os.getloadavg()[0]]}


def section(d: dict[str, Any]) -> list[str]:
    """The RESULTS.md section for ``limits.json``."""
    on, off = d["results"]["on"], d["results"]["off"]

    def row(key: str, what: str) -> str:
        a, b = on[key], off[key]
        return (f"| {what} | {a['median_ms']:.1f} / {a['min_ms']:.1f} | {b['median_ms']:.1f} / {b['min_ms']:.1f} | "
                f"{a['median_ms'] - b['median_ms']:+.1f} |")

    return [
        "## Limits · what enforcing them costs (issue 8)", "",
        f"`python -m bench.limits`, {d['machine']['date'][:16]}, {d['rounds']} interleaved rounds, sandbox backend, "
        "a 200 MiB warm machine, host load average {:.1f} then {:.1f} on {} cores (other sessions' work: compare "
        "the two columns, not these with B3). Limits on: ".format(*d.get("load_avg", [0, 0]), d["machine"].get("cores", "?"))
        + on["mechanism"] + ".", "",
        "| ms (median / min) | limits on | limits off | difference of medians |", "|---|---:|---:|---:|",
        row("raw_exec", "raw `exec_cell('pass')`"),
        row("fork16", "fork 16, all running"),
        row("delete16", "delete those 16 branches"), "",
        "Each branch gets its own cgroup: they are made while the agent forks, and a branch is moved into its own "
        "before it runs anything; deleting one empties and removes its cgroup and waits for that.", "",
    ]


def main() -> int:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 12
    data = run(rounds)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "limits.json").write_text(json.dumps(data, indent=2))
    from bench import report

    print("\n".join(section(data)))
    print(report.write())
    return 0


if __name__ == "__main__":
    sys.exit(main())
