"""How a sandbox machine's agent ended under a cell: by its own hand or from outside.

The host is not the agent's parent (its keeper, or a leaf branch's maker, reaps it), so it
can't wait for it; but a pidfd it opened while the agent ran gets the agent's wait status
from the kernel once it is reaped (``PIDFD_GET_INFO``, Linux 6.15+). An exit (``os._exit``,
``sys.exit`` in the agent, its SIGTERM handler) or a fault signal is the machine's own doing:
the cell's error. SIGKILL is from outside: pid 1 of a pid namespace can't get it from inside,
so it came from the host, the kernel's OOM killer or a keeper gone (its parent-death signal).
A status the kernel can't give (an older kernel, not reaped in time) counts as from outside:
retried, as ever, only while ``retries`` last. A hostile cell may make its end look like
either; only honest ends matter here, and neither way retries beyond ``retries``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import struct
import time

from ..errors import MachineDied, MachineLost, SmolbenchError
from . import _procs

PIDFD_GET_INFO = 0xC040FF0B  # _IOWR(0xFF, 11, struct pidfd_info): its first 64 bytes
PIDFD_INFO_EXIT = 1 << 3
_INFO = struct.Struct("Q52xi")  # mask, ..., exit_code (a wait status) at byte 60
REAPED_WITHIN = 5.0  # seconds the agent's reaper has to reap it once it is gone (it waits on it at once)


def wait_status(pidfd: int) -> int | None:
    """The wait status of the process behind ``pidfd`` once it was reaped, None until then;
    raises OSError if it will never be known (ENOTTY, EINVAL: a kernel without it)."""
    buf = bytearray(_INFO.size)
    _INFO.pack_into(buf, 0, PIDFD_INFO_EXIT, 0)
    fcntl.ioctl(pidfd, PIDFD_GET_INFO, buf)
    mask, status = _INFO.unpack_from(buf)
    return int(status) if mask & PIDFD_INFO_EXIT else None


def own_end(status: int | None) -> str | None:
    """What the machine did to end itself, said for the cell's error; None: killed from outside (or unknown)."""
    if status is None or (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
        return None
    if os.WIFEXITED(status):
        code = os.WEXITSTATUS(status)
        return f"its agent exited with status {code}, as os._exit({code}) does"
    if os.WIFSIGNALED(status):
        return f"its agent died of {signal.Signals(os.WTERMSIG(status)).name}"
    return None


class Watch:
    """A pidfd on a machine's agent, opened before a cell runs (a no-op where the agent's
    host pid and start time aren't known, or the kernel has no pidfds)."""

    def __init__(self, info: dict[str, object]) -> None:
        pid, started = info.get("host_pid"), info.get("host_started")
        self.pid, self.started, self.fd = pid if isinstance(pid, int) else 0, str(started or ""), -1
        if self.pid and self.started:
            with contextlib.suppress(OSError, AttributeError):
                self.fd = os.pidfd_open(self.pid)
            if self.fd >= 0 and _procs.start_time(self.pid) != self.started:  # the pid is pinned now: someone else's
                self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    async def verdict(self, exc: SmolbenchError, name: str) -> SmolbenchError:
        """What to raise for ``exc``, a cell's request that failed: a machine whose agent is
        gone says MachineDied (retried by fork and episodes) unless it ended itself, which is
        the cell's error (MachineLost, one line); anything else stays ``exc``."""
        if not isinstance(exc, MachineLost) or not (self.pid and self.started) or not await _procs.ended(self.pid, self.started):
            return exc
        status, deadline = None, time.monotonic() + REAPED_WITHIN
        with contextlib.suppress(OSError):
            while self.fd >= 0 and (status := wait_status(self.fd)) is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        own = own_end(status)
        # The line keeps "machine X died mid-cell" (status lines, a gym env's error read it) and says who did it.
        return MachineLost(f"machine {name} died mid-cell: the cell ended it ({own}); its state is gone") if own \
            else MachineDied(str(exc))
