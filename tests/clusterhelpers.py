"""What the cluster tests share: finding a local Ray cluster's machines among the host's processes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def machine_processes(c: Any) -> list[str]:
    """Command lines of every machine (or fake microVM) on any node of the local cluster ``c``:
    each node's data folder is on its machines' command lines."""
    marks = [str(d).encode() for d in c.node_dirs]
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if any(m in cmd for m in marks):
            found.append(cmd.replace(b"\0", b" ").decode(errors="replace"))
    return found
