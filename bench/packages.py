"""What a Smolfile's ``packages`` cost at ``up``: the first (pip installs) vs. a cached up.

    python -m bench.packages [--rounds N] [--requirement REQ ...]
    # writes bench/results/packages.json and a RESULTS.md section

One process, sandbox backend, rounds interleaved so host load hits every kind alike. Per
round: an ``up`` without packages, an ``up`` with them into an empty cache (pip runs on the
host: downloads from the index or pip's own HTTP cache, then installs), and an ``up`` with
them again (the cache reused). Each up is timed to its first cell (``import`` of the first
package), then the machine goes down.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

from bench.common import RESULTS  # noqa: E402

DEFAULT = ("gymnasium==1.4.0",)
BEGIN, END = "<!-- packages:begin -->", "<!-- packages:end -->"


def _up(folder: Path, requirements: tuple[str, ...], cache: Path) -> tuple[float, str]:
    from smolbench import Session

    os.environ["SMOLBENCH_CACHE"] = str(cache)
    smolfile = folder / "Smolfile"
    smolfile.write_text(f"packages = {json.dumps(list(requirements))}\n" if requirements else "")
    module = requirements[0].split("=")[0].split("<")[0].split(">")[0].strip().replace("-", "_") if requirements else "sys"
    t0 = time.perf_counter()
    session = Session(smolfile, backend="sandbox", ledger=folder / "ledger.db", on_notice=lambda line: None)
    try:
        session.up()
        session.run(f"import {module}")
        took = time.perf_counter() - t0
        wb = session.workbench
        said = str(wb.machines["root"].info.get("packages", "")) if wb is not None else ""
    finally:
        session.down()
    return took, said


def measure(rounds: int, requirements: tuple[str, ...]) -> dict[str, Any]:
    kinds: dict[str, list[float]] = {"no packages": [], "first up (pip installs)": [], "cached up": []}
    lines: list[str] = []
    top = Path(tempfile.mkdtemp(prefix="bench-packages-"))
    try:
        for r in range(rounds):
            folder, cache = top / f"r{r}", top / f"cache{r}"
            folder.mkdir()
            kinds["no packages"].append(_up(folder, (), cache)[0])
            took, said = _up(folder, requirements, cache)
            kinds["first up (pip installs)"].append(took)
            lines.append(said)
            took, said = _up(folder, requirements, cache)
            kinds["cached up"].append(took)
            lines.append(said)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    return {"requirements": list(requirements), "rounds": rounds, "seconds": kinds, "lines": lines,
            "median": {k: statistics.median(v) for k, v in kinds.items()}, "load": os.getloadavg()[0],
            "when": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def section(data: dict[str, Any]) -> str:
    med = data["median"]
    rows = "\n".join(f"| {k} | {v:.2f} s | {', '.join(f'{x:.2f}' for x in data['seconds'][k])} |" for k, v in med.items())
    first, cached, bare = med["first up (pip installs)"], med["cached up"], med["no packages"]
    return (f"{BEGIN}\n### Packages · first up vs. cached up\n\n"
            f"One run, {data['rounds']} interleaved rounds, sandbox backend, `packages = {json.dumps(data['requirements'])}`; "
            f"each up timed to its first cell importing the package. Host load average {data['load']:.1f}.\n\n"
            f"| up | median | rounds |\n|---|---|---|\n{rows}\n\n"
            f"The cache saves **{first - cached:.1f} s** per up ({first / cached:.1f}× faster); a cached up costs "
            f"{cached - bare:+.2f} s over one without packages (the read-only bind and the import). "
            f"Raw numbers: `bench/results/packages.json`.\n{END}\n")


def write(data: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "packages.json").write_text(json.dumps(data, indent=1) + "\n")
    md = RESULTS.parent / "RESULTS.md"
    text = md.read_text() if md.exists() else ""
    new = section(data)
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + new + rest.split(END, 1)[1].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + new
    md.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requirement", action="append", default=None)
    args = ap.parse_args()
    data = measure(args.rounds, tuple(args.requirement or DEFAULT))
    write(data)
    print(section(data))


if __name__ == "__main__":
    main()
