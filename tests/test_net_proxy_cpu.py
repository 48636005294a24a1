"""A gap the eighth audit left: the egress proxy's CPU was charged to no machine, and capped by
nothing. Its buckets bound how many connections a flood makes it take; what it spends on the
work it does take could still use whole cores of the host. Now, where cgroups can be made
here, the real proxy process starts in a CPU-capped cgroup of its own, removed when it ends.

The proxy is made to work as hard as it can through its one input no machine limits, its
control channel (a stand-in for a flood of work: a machine's are bounded by the buckets before
any CPU is spent). Counts are asserted (the cap, the kernel's count of throttled periods), never times.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from smolbench.backends import _limits, _netproxy

pytestmark = pytest.mark.skipif(not _limits.detect().bases or not (
    _limits.detect().name == "cgroup v2" or "cpu" in _limits.detect().bases), reason="no cpu cgroup can be made here")


def _cpu_group(pid: int) -> Path:
    """The folder of the cgroup that caps ``pid``'s CPU."""
    key = "" if _limits.detect().name == "cgroup v2" else "cpu"
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (controllers.split(",") if controllers else [""]).count(key):
            return _limits._mounts()[key] / path.lstrip("/")
    raise AssertionError(f"process {pid} is in no {key or 'v2'} cgroup")


def _quota(group: Path) -> float | None:
    """The group's CPU cap in cores (None: uncapped)."""
    if (group / "cpu.max").exists():
        quota, period = (group / "cpu.max").read_text().split()
    else:
        quota, period = (group / "cpu.cfs_quota_us").read_text().strip(), (group / "cpu.cfs_period_us").read_text()
    return None if quota in ("max", "-1") else int(quota) / int(period)


def _throttled(group: Path) -> int:
    for line in (group / "cpu.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "nr_throttled":
            return int(value)
    return 0


def _first_in_line(group: Path) -> None:
    """The group's CPU weight at its highest, so on a busy host it gets more than its cap asks."""
    if (group / "cpu.weight").exists():
        (group / "cpu.weight").write_text("10000")
    else:
        (group / "cpu.shares").write_text("262144")


def test_a_proxy_made_to_work_flat_out_is_held_to_its_cpu_cap() -> None:
    """The real proxy process parses requests of 0.8 MB each, in rounds of 50 (each answered in one short
    line) as fast as it can: it runs in a cgroup of its own capped below one core, the kernel
    throttles it there, and the cgroup goes with it."""

    async def main() -> None:
        client = _netproxy.ProxyClient(None, None)
        await client.start()
        proc = client.proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            group = _cpu_group(proc.pid)
            cap = _quota(group)
            assert cap is not None and cap < 1, f"the proxy's cgroup {group} has no CPU cap below a core ({cap})"
            # its group first in line for CPU (a loaded CI host gave it less than its cap, so it
            # was never throttled): what is shown is the cap holding it, not how busy the host is
            _first_in_line(group)
            before = _throttled(group)
            heavy = b'{"op": "work", "pad": [' + b"0," * 400_000 + b"0]}\n"  # 0.8 MB: within its reader's line limit
            for _ in range(20):  # rounds of 50 until the kernel throttles it (at most 1,000 requests)
                for _ in range(50):
                    proc.stdin.write(heavy)
                await proc.stdin.drain()
                for _ in range(50):
                    assert b"unknown op" in await asyncio.wait_for(proc.stdout.readline(), 300)
                if _throttled(group) > before:
                    break
            assert _throttled(group) > before, "the proxy worked flat out and was never held to its cap"
        finally:
            await client.close()
        assert not group.exists(), f"the proxy's cgroup {group} outlived it"

    asyncio.run(main())
