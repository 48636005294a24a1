"""What the mount guard costs (issue 17): the same sandbox work with the guard on and off.

    python -m bench.mountguard [--rounds N]   # 20 rounds by default; writes bench/results/mountguard.json and its RESULTS.md section

Two sandbox backends in one process (bench.common.compare_sandboxes, as bench/limits.py),
one as shipped, one with the test knob ``SMOLBENCH_TEST_WEAKEN=mount-guard`` set while it
is made and its machine starts (the machine's agent then installs no guard); rounds
interleave them so host load hits both alike. With the guard, every overlay, proc and
store mount while a branch sets itself up is a seccomp user notification the root
machine's keeper answers (guest/mountguard.py). Per round, on a machine holding 200 MiB of
warm state:

* ``raw_exec``: ``exec_cell("pass")`` round trip (no mounts: a control);
* ``fork1``: ``branch`` of 1 until it answered a first cell (one branch's set-up);
* ``fork16``: ``branch`` of 16 until every branch answered a first cell (B3's "all running");
* ``delete1``, ``delete16``: deleting those branches.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

from bench.common import BENCH_DIR, Side, compare_rows, run_compare, write_json, write_section  # noqa: E402

BEGIN, END = "<!-- mountguard:begin -->", "<!-- mountguard:end -->"
KNOB = "mount-guard"
ROUNDS = 20  # a round takes a second or two here; a fork of 1 is a small number to see in the noise


def _guard(on: bool) -> Side:
    @contextlib.contextmanager
    def setting() -> Iterator[None]:
        from smolbench.backends._bwrap import WEAKEN_VAR

        # Read by SandboxBackend() and again when a machine's bwrap command is made (it passes
        # --weaken to the agent): in effect for both. "on" clears it, whatever the caller set.
        old = os.environ.pop(WEAKEN_VAR, None)
        if not on:
            os.environ[WEAKEN_VAR] = KNOB
        try:
            yield
        finally:
            os.environ.pop(WEAKEN_VAR, None)
            if old is not None:
                os.environ[WEAKEN_VAR] = old

    async def describe(backend: Any, ref: Any, spec: Any) -> str:
        return str((await backend.info(ref)).get("mounts", "not reported"))

    return Side("on" if on else "off", setting, describe)


def run(rounds: int = ROUNDS) -> dict[str, Any]:
    return run_compare([_guard(True), _guard(False)], rounds, "bench-mountguard-", forks=(1, 16))


def section(d: dict[str, Any]) -> list[str]:
    """The RESULTS.md section for ``mountguard.json`` (between its markers)."""
    on, off = d["results"]["on"], d["results"]["off"]

    def diff(key: str) -> float:
        return float(on[key]["median_ms"] - off[key]["median_ms"])

    return [
        BEGIN, "## Mount guard · what it costs (issue 17)", "",
        f"`python -m bench.mountguard`, {d['machine']['date'][:16]}, {d['rounds']} interleaved rounds, sandbox backend, "
        "a 200 MiB warm machine, host load average {:.1f} before and {:.1f} after on {} cores (other sessions' work "
        "shares this host). Both columns were measured in the same run, interleaved: they are comparable with each "
        "other, not with B3's numbers. Guard on: {}. Guard off (`SMOLBENCH_TEST_WEAKEN=mount-guard`): {}.".format(
            *d.get("load_avg", [0, 0]), d["machine"].get("cores", "?"), on["mechanism"], off["mechanism"]), "",
        "| ms (median / min) | guard on | guard off | difference of medians |", "|---|---:|---:|---:|",
        *compare_rows(on, off, [("raw_exec", "raw `exec_cell('pass')`"), ("fork1", "fork 1, running"),
                                ("delete1", "delete that branch"), ("fork16", "fork 16, all running"),
                                ("delete16", "delete those 16 branches")]), "",
        "A branch's set-up mounts its store (a tmpfs, which spends one of the host's grants), two overlays and "
        "/proc: with the guard each of those is a seccomp user notification the root machine's keeper answers "
        "after reading the caller's `/proc/PID/maps`, and one keeper answers every branch of the tree in turn. "
        f"Difference of medians here: {diff('fork1'):+.1f} ms on a fork of 1, {diff('fork16'):+.1f} ms on a fork of 16 "
        f"({diff('fork16') / 16:+.2f} ms per branch). `exec_cell('pass')` and deletes make no guarded call: their "
        "differences show how far the two columns differ by the host's noise alone.", END, "",
    ]


def main() -> int:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else ROUNDS
    data = run(rounds)
    print(write_json("mountguard", data, quick=False))
    lines = section(data)
    from bench.limits import NOTE

    # in place; else right after the limits section, where bench.report puts it
    write_section(BENCH_DIR / "RESULTS.md", "\n".join(lines[:-1]), BEGIN, END, after=NOTE)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
