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

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

from bench.common import RESULTS, Side, compare_rows, run_compare  # noqa: E402

# The section's last paragraph (bench/mountguard.py puts its section right after it).
NOTE = ("Each branch gets its own cgroup: they are made while the agent forks, and a branch is moved into its own "
        "before it runs anything; deleting one empties and removes its cgroup and waits for that.")


def _enforcing(on: bool) -> Side:
    @contextlib.contextmanager
    def setting() -> Iterator[None]:
        from smolbench.backends import _limits

        _limits.ENFORCE = on  # read when the backend probes its limits (its first machine)
        try:
            yield
        finally:
            _limits.ENFORCE = True

    async def describe(backend: Any, ref: Any, spec: Any) -> str:
        return str(backend.limits_status(spec))

    return Side("on" if on else "off", setting, describe)


def run(rounds: int = 12) -> dict[str, Any]:
    return run_compare([_enforcing(True), _enforcing(False)], rounds, "bench-limits-")


def section(d: dict[str, Any]) -> list[str]:
    """The RESULTS.md section for ``limits.json``."""
    on, off = d["results"]["on"], d["results"]["off"]
    return [
        "## Limits · what enforcing them costs (issue 8)", "",
        f"`python -m bench.limits`, {d['machine']['date'][:16]}, {d['rounds']} interleaved rounds, sandbox backend, "
        "a 200 MiB warm machine, host load average {:.1f} then {:.1f} on {} cores (other sessions' work: compare "
        "the two columns, not these with B3). Limits on: ".format(*d.get("load_avg", [0, 0]), d["machine"].get("cores", "?"))
        + on["mechanism"] + ".", "",
        "| ms (median / min) | limits on | limits off | difference of medians |", "|---|---:|---:|---:|",
        *compare_rows(on, off, [("raw_exec", "raw `exec_cell('pass')`"), ("fork16", "fork 16, all running"),
                                ("delete16", "delete those 16 branches")]), "",
        NOTE, "",
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
