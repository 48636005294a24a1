"""What a fresh machine's agent costs to start (issue 27 item 5), against the interpreter's own start.

    python -m bench.agentstart [--rounds N] [--against REV]   # bench/results/agentstart.json, its RESULTS.md section

Interleaved rounds, one process each, of: ``python -c pass`` (the floor), ``python -S -c pass``
(what ``-S`` would save: site and the venv's .pth files, which cells need, so the agent keeps
them), and the guest agent from start until its ready file exists (``--no-mount-ns``, the
process backend's way: no namespaces, so only the agent's own Python start-up is measured).
``--against REV`` adds the agent files of git revision REV (``git archive``) side by side, so
a change to the agent's imports is measured against what it replaced in the same run.
"""

from __future__ import annotations

import io
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import BENCH_DIR, REPO, log, write_json, write_section

BEGIN, END = "<!-- agentstart:begin -->", "<!-- agentstart:end -->"
ROUNDS = 30
GUEST = REPO / "smolbench" / "guest"


def _guest_at(rev: str, into: Path) -> Path:
    """The agent's files at git revision ``rev``, extracted into ``into``."""
    data = subprocess.run(["git", "-C", str(REPO), "archive", rev, "smolbench/guest"], check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into / "smolbench" / "guest"


def _agent_ready(guest: Path, base: Path) -> float:
    ready, sock = base / "ready", base / "s"
    ready.unlink(missing_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-u", str(guest / "agent.py"), "--socket", str(sock), "--workdir",
                             str(base / "ws"), "--ready", str(ready), "--no-mount-ns"], stdout=subprocess.DEVNULL)
    try:
        while not ready.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"the agent in {guest} exited with {proc.returncode} before it was ready")
            time.sleep(0.0005)
        return time.perf_counter() - t0
    finally:
        proc.kill()
        proc.wait()


def _run(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, check=True)
    return time.perf_counter() - t0


def run(rounds: int, against: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"rounds": rounds, "python": sys.version.split()[0], "load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="smolbench-agentstart-") as tmp:
        base = Path(tmp)
        sides: dict[str, Any] = {
            "python -c pass": lambda: _run([sys.executable, "-c", "pass"]),
            "python -S -c pass": lambda: _run([sys.executable, "-S", "-c", "pass"]),
            "agent to ready": lambda: _agent_ready(GUEST, base),
        }
        if against:
            old = _guest_at(against, base / "old")
            sides[f"agent to ready at {against}"] = lambda: _agent_ready(old, base)
        times: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(rounds):
            for name, measure in sides.items():
                times[name].append(measure())
        shutil.rmtree(base / "ws", ignore_errors=True)
    out["ms"] = {name: {"median": statistics.median(v) * 1e3, "min": min(v) * 1e3} for name, v in times.items()}
    out["load_after"] = os.getloadavg()
    for name, v in out["ms"].items():
        log(f"agentstart: {name}: median {v['median']:.1f} ms, min {v['min']:.1f} ms")
    return out


def section(d: dict[str, Any]) -> str:
    lines = [BEGIN, "## Agent start-up (issue 27 item 5)", "",
             f"`python -m bench.agentstart`: {d['rounds']} interleaved rounds on Python {d['python']}, one process each; "
             f"host load average {d['load_before'][0]:.1f} before, {d['load_after'][0]:.1f} after "
             "(a shared host: compare the rows with each other, not with another run).", "",
             "| | median | min |", "|---|---|---|"]
    lines += [f"| {name} | {v['median']:.1f} ms | {v['min']:.1f} ms |" for name, v in d["ms"].items()]
    lines += ["", "The agent imports only what its ready path needs (cells, pulls, saves, pip and seeds bring "
              "theirs when first used; a fork imports what its branches use first, before it forks). It keeps "
              "`site`: the cells it runs need the venv's .pth files and the Smolfile's PYTHON* environment, so "
              "`-I -S` is not used for it.", END]
    return "\n".join(lines) + "\n"


def main() -> int:
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
        return 0
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else ROUNDS
    against = sys.argv[sys.argv.index("--against") + 1] if "--against" in sys.argv else None
    data = run(rounds, against)
    print(write_json("agentstart", data, quick=False))
    text = section(data)
    write_section(BENCH_DIR / "RESULTS.md", text, BEGIN, END)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
