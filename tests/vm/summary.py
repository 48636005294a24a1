"""The lane's verdict over all its boots of L1 (stdlib only; run by run.sh on the host).

  summary.py passed OUT           ids that passed in any boot so far (for the next boot)
  summary.py line OUT SECS BUILD  the summary line; its exit status is the lane's

Each boot leaves OUT/attempt-N/ with collected.txt and outcomes.txt (written test by test by
guest/vmlane_results.py, so a boot that stalled keeps what ran), deselected.txt (tests the
boot's selection, VMLANE_SELECT, left out: counted apart, never "not run") and verdict (the
host's word on how the boot ended). A test's result is the one from the last boot that ran it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def attempts(out: Path) -> list[Path]:
    found = [p for p in out.glob("attempt-*") if p.name.split("-")[1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def lines(path: Path) -> list[str]:
    try:
        return [x for x in path.read_text().splitlines() if x.strip()]
    except OSError:
        return []


def merge(out: Path) -> tuple[list[str], set[str], dict[str, str], list[tuple[str, int, str]]]:
    collected: list[str] = []
    deselected: set[str] = set()
    results: dict[str, str] = {}
    boots = []
    for a in attempts(out):
        deselected.update(lines(a / "deselected.txt"))
        for t in lines(a / "collected.txt") + lines(a / "deselected.txt"):
            if t not in collected:
                collected.append(t)
        ran = 0
        for line in lines(a / "outcomes.txt"):
            test, _, outcome = line.rpartition(" ")
            results[test] = outcome
            ran += 1
        verdict = (lines(a / "verdict") or ["broken: no verdict"])[0]
        boots.append((a.name.split("-")[1], ran, verdict))
    return collected, deselected - results.keys(), results, boots


def main(argv: list[str]) -> int:
    out = Path(argv[2])
    collected, deselected, results, boots = merge(out)
    if argv[1] == "passed":
        print("\n".join(t for t, r in results.items() if r == "passed"))
        return 0
    secs, build = argv[3], argv[4]
    passed = sum(r == "passed" for r in results.values())
    failed = sum(r in ("failed", "error") for r in results.values())
    skipped = sum(r == "skipped" for r in results.values())
    selected = [t for t in collected if t not in deselected]
    not_run = len([t for t in selected if t not in results])
    stalls = sum(v.startswith("stall") for _, _, v in boots)
    parts = [f"boot {n}{' (retry)' * (n != '1')}: {ran} test{'s' * (ran != 1)} then {v}"
             for n, ran, v in boots]
    note = (out / "no-retry.txt").read_text().strip() if (out / "no-retry.txt").exists() else ""
    if note:
        parts.append(f"no retry: {note}")
    chosen = (f", {len(deselected)} deselected (VMLANE_SELECT={os.environ.get('VMLANE_SELECT', '')})"
              if deselected else "")
    line = (f"vm lane: {passed} passed, {failed} failed, {skipped} skipped, {not_run} not run{chosen}"
            f" in {secs} s (build {build} s; {len(boots)} boot{'s' * (len(boots) != 1)},"
            f" {stalls} stall{'s' * (stalls != 1)}; " + "; ".join(parts) + ")")
    print(line)
    last = boots[-1][2] if boots else "broken: no boot"
    if failed:
        return 1
    if selected and passed == len(selected) and not skipped:
        return 0
    if last.startswith("stall"):
        return 75
    if stalls and last.startswith(("timeout", "broken")):
        # a retry after a stall that ran out of budget or lost L1: still the nested stack
        return 75
    if last.startswith(("hang", "pytest", "timeout")) or skipped:
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
