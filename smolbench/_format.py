"""How the magics' tables and messages write sizes and local times for people."""

from __future__ import annotations

import math
import time
from typing import Any


def size_text(n: Any) -> str:
    """Bytes in decimal units with one decimal: ``812 B``, ``5.4 kB``, ``12.3 MB``, ``1.2 GB``."""
    if not isinstance(n, (int, float)) or isinstance(n, bool) or not math.isfinite(n):
        return ""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def time_text(epoch: Any) -> str:
    """Seconds since the epoch as local time, ``2026-11-30 17:04:05`` ('' when unknown)."""
    if not isinstance(epoch, (int, float)) or isinstance(epoch, bool) or not math.isfinite(epoch):
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))
