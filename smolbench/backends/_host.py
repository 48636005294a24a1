"""What this host has: the upper bounds a Smolfile's limits are checked against."""

from __future__ import annotations

import os


def host_cpus() -> int:
    """CPU cores this host has (not only the ones this process may use)."""
    return os.cpu_count() or 1


def host_memory_mib() -> int:
    """This host's RAM in MiB."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // (1024 * 1024))
    except (ValueError, OSError):  # pragma: no cover - every Linux has both
        return 1 << 20
