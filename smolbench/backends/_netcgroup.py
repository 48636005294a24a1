"""The egress proxy's own cgroup: its CPU capped, though no machine's cgroup counts it.

The proxy accepts, parses and relays for every machine on the host's side, so its CPU was
charged to no one (a gap the eighth audit left: its buckets bound how many connections a
flood makes it take, not what relaying them costs). Where ``_limits`` can make cgroups (v2
delegated, or v1 writable: root here) the proxy starts inside a group of its own, made as a
machine's are (``Limiter.machine``, with ``MachineLimits.wrap``: it joins before its first
instruction, and the helpers it forks join with it), capped at ``CPUS`` of a core; it is
removed, with anything left in it, when the proxy ends. Memory and processes get ceilings
that only a fault of the proxy's reaches (``_netbudget`` bounds what it holds, by count).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from ..spec import MachineSpec
from . import _limits

CPUS = 0.5  # of one core: the whole kernel's egress, every machine's relaying and refusing together
NAME = "egress-proxy"  # not a machine's name (those are root, root.3, ep1.0, ...)
# far above what the proxy holds (_netbudget: ~50 MiB at its caps) and the helpers it forks
# for a fork's branches at once: a ceiling for its faults, never its load
SPEC = MachineSpec(memory=2048, pids=4096, cpus=1)


class ProxyGroup:
    """The proxy process's cgroup (none where cgroups can't be made here, or limits are off)."""

    def __init__(self) -> None:
        self._limiter: _limits.Limiter | None = None
        self.limits: _limits.MachineLimits | None = None

    def make(self) -> None:
        """A new group for a proxy about to start (the last one's, if any, is removed first)."""
        self.close()
        if not _limits.ENFORCE or not _limits.detect().bases:
            return
        try:
            self._limiter = _limits.Limiter()
            self.limits = self._limiter.machine(NAME, SPEC)
            quota = int(CPUS * _limits.CFS_PERIOD)
            for controller, d in zip(self._limiter.mechanism.bases, self.limits.dirs):
                if controller == "":  # v2: every controller in one folder
                    (d / "cpu.max").write_text(f"{quota} {_limits.CFS_PERIOD}")
                elif controller == "cpu":
                    (d / "cpu.cfs_quota_us").write_text(str(quota))
        except OSError:  # the proxy runs as before, uncapped: better than no network at all
            self.close()

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` prefixed so the proxy joins its group before it runs."""
        return self.limits.wrap(argv) if self.limits is not None else argv

    def cpu_dir(self) -> Path | None:
        """The folder holding the group's CPU cap (tests, ``%smol status``)."""
        if self._limiter is None or self.limits is None:
            return None
        for controller, d in zip(self._limiter.mechanism.bases, self.limits.dirs):
            if controller in ("", "cpu"):
                return d
        return None

    def close(self) -> None:
        """Kill what is left in the group (the proxy has ended, or never started) and remove it."""
        limiter, self._limiter, self.limits = self._limiter, None, None
        if limiter is not None:
            with contextlib.suppress(OSError):
                limiter.close()
