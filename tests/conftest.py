"""Suite-wide guard: the product must never leave machines or processes behind."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

# What our machines look like in `ps`: the sandbox (bwrap running our agent) and the
# agent itself, in a sandbox or as a plain process.
MARKERS = ("/run/smolbench-agent/agent.py", "smolbench/guest/agent.py")


def leftover_machines() -> list[tuple[int, str]]:
    """(pid, command line) of every smolbench machine process still running."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    found = []
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        if any(m in args for m in MARKERS) and int(pid) != os.getpid():
            found.append((int(pid), args))
    return found


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    """Fail the run if any test left a machine running (and then clean it up)."""
    left = leftover_machines()
    if not left:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"\nLEFT BEHIND: {len(left)} smolbench machine process(es) after the suite:", red=True)
        for pid, args in left[:10]:
            reporter.write_line(f"  {pid} {args[:160]}")
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    session.exitstatus = 1
