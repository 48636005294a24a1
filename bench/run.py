"""Run the smolbench benchmarks and write bench/results/*.json and bench/RESULTS.md.

    python -m bench.run                    # full run (~6-8 min on 2 cores)
    python -m bench.run --quick            # smoke run (~2 min): fewer cells, S = 1 s
    python -m bench.run --backend smol     # on a KVM host with smolmachines
    python -m bench.run --only b1,b3       # a subset
    python -m bench.run --report           # only regenerate RESULTS.md from the JSON

``python bench/run.py ...`` works too.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

if __package__ in (None, ""):  # python bench/run.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

import json  # noqa: E402

from bench.common import RESULTS, code_state, log, reap_leftovers, write_json  # noqa: E402

ALL = ("b1", "b2", "b3", "profile", "b4")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: fewer cells and branches, S = 1 s")
    ap.add_argument("--backend", default="sandbox", choices=["sandbox", "smol", "process"],
                    help="smolbench backend to measure (smol needs a KVM host with smolmachines)")
    ap.add_argument("--only", default=",".join(ALL), help=f"comma-separated subset of {','.join(ALL)}")
    ap.add_argument("--quiet-wait", type=float, default=None,
                    help="before each timed stage, wait up to this many seconds for the shared host to be idle "
                         "(default 15, --quick 2); the total wait is capped at 6x this")
    ap.add_argument("--report", action="store_true", help="only regenerate bench/RESULTS.md from bench/results/*.json")
    args = ap.parse_args(argv)

    from bench import report
    from bench.common import CONFIG

    if args.report:
        print(report.write(quick=args.quick))
        return 0
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    bad = [w for w in wanted if w not in ALL]
    if bad:
        ap.error(f"unknown benchmark(s) {bad}: choose from {', '.join(ALL)}")
    start_code = code_state()
    qw = args.quiet_wait if args.quiet_wait is not None else (2.0 if args.quick else 15.0)
    CONFIG.update(quiet_wait=qw, quiet_budget=6 * qw)
    t0 = time.monotonic()
    failed = []
    try:
        for name in wanted:
            t = time.monotonic()
            try:
                if name == "b1":
                    from bench import b1_overhead
                    b1_overhead.run(args.backend, args.quick)
                elif name == "b2":
                    from bench import b2_fanout
                    b2_fanout.run(args.backend, args.quick)
                elif name == "b3":
                    from bench import b3_fork
                    b3_fork.run(args.backend, args.quick)
                elif name == "b4":
                    from bench import b4_labext
                    b4_labext.run(args.backend, args.quick)
                elif name == "profile":
                    from bench import profile_stages
                    profile_stages.run(args.backend, args.quick)
            except Exception:
                failed.append(name)
                log(f"{name} FAILED:\n{traceback.format_exc()}")
            log(f"{name}: {time.monotonic() - t:.1f} s")
    finally:
        left = reap_leftovers()
        if left:
            log(f"WARNING: {len(left)} leftover process(es) killed: {left}")
        else:
            log("no leftover processes")
    end_code = code_state()
    changed = start_code["sources_sha256"] != end_code["sources_sha256"]
    if changed:
        log(f"WARNING: smolbench's sources changed during this run ({start_code} -> {end_code}): "
            "the results mix code versions; run again")
    write_json("run", {"benchmarks": wanted, "failed": failed, "backend": args.backend, "quick": args.quick,
                       "code_start": start_code, "code_end": end_code, "code_changed_during_run": changed,
                       "leftover_processes": left, "total_s": round(time.monotonic() - t0, 1)}, args.quick)
    if not args.quick and not failed and set(wanted) >= {"b1", "b2", "b3"}:
        _append_history(start_code, changed)
    try:
        path = report.write(quick=args.quick)
    except Exception:
        log(f"writing RESULTS.md FAILED:\n{traceback.format_exc()}")
        return 1
    log(f"total {time.monotonic() - t0:.1f} s; wrote {path}")
    return 1 if failed else 0


def _append_history(code: dict[str, object], changed: bool) -> None:
    """One line per full run in bench/results/history.jsonl: the headline numbers over time."""
    def load(name: str) -> dict:
        return json.loads((RESULTS / f"{name}.json").read_text())

    b1, b2, b3 = load("b1_overhead"), load("b2_fanout"), load("b3_fork")
    row = {
        "date": b1["machine"]["date"], "git_commit": code["git_commit"], "sources_sha256": code["sources_sha256"],
        "code_changed_during_run": changed, "backend": b1["machine"]["backend"],
        "b1_smol_over_raw_ms": b1["derived_ms"]["smol_over_raw_median"],
        "b2_fork_s": b2["results"]["median_total_s"]["a_fork"], "b2_fork_vs_cpu_ideal": b2["goal"]["ratio"],
        "b2_judged_on": b2["goal"]["judged_on"],
        "b3_fork16_all_running_ms": b3["goal"]["fork16_all_running_ms"],
        "b3_extra_pss_per_branch_mib": b3["goal"]["extra_pss_per_branch_mib"],
    }
    with open(RESULTS / "history.jsonl", "a") as fh:
        fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
