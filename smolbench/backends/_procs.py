"""Host process bookkeeping from /proc: trees, start times, namespace pids, killing for sure.

A tree is walked through each process's own ``/proc/PID/task/TID/children`` lists, so its cost
is the size of that tree, not of every process on the host (``children_map``, a full scan, is
the fallback where the kernel has no such lists).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time


def read(path: str | os.PathLike[str]) -> bytes:
    """The whole of a small /proc or cgroupfs file: open, read, close (no buffered file object:
    a fork's host work reads several per branch; raises OSError as ``open`` does)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, 65536)
        if len(data) == 65536:  # more (a long list of pids)
            parts = [data]
            while chunk := os.read(fd, 65536):
                parts.append(chunk)
            data = b"".join(parts)
        return data
    finally:
        os.close(fd)


def write(path: str | os.PathLike[str], data: bytes) -> None:
    """One write of ``data`` to a /proc or cgroupfs file (raises OSError)."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state first), or None if gone."""
    try:
        data = read(f"/proc/{pid}/stat")
    except OSError:
        return None
    return data[data.rfind(b")") + 2:].decode().split()


def start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ('' if gone): pid + this is unique."""
    fields = stat(pid)
    return fields[19] if fields else ""


def children_map() -> dict[int, list[tuple[int, str]]]:
    """parent pid -> [(pid, start time)] of every process now (one scan of /proc)."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = stat(int(entry))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append((int(entry), fields[19]))
    return children


_HAS_CHILDREN = os.path.exists(f"/proc/self/task/{os.getpid()}/children")  # CONFIG_PROC_CHILDREN


def kids(pid: int) -> list[int]:
    """The direct children of ``pid`` (every thread's), from its own /proc lists."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        with contextlib.suppress(OSError, ValueError):
            out += [int(k) for k in read(f"/proc/{pid}/task/{tid}/children").split()]
    return out


def descendants(pid: int, children: dict[int, list[tuple[int, str]]] | None = None) -> list[tuple[int, str]]:
    """(pid, start time) of every process below ``pid``, nearest first (a walk of that tree
    only, unless ``children`` is given or the kernel has no children lists)."""
    if children is None and not _HAS_CHILDREN:
        children = children_map()
    out, todo = [], [pid]
    while todo:
        parent = todo.pop(0)
        if children is not None:
            below = children.get(parent, [])
        else:
            below = [(k, start_time(k)) for k in kids(parent)]
        for kid in below:
            if kid[1]:  # gone meanwhile otherwise
                out.append(kid)
                todo.append(kid[0])
    return out


def running(pid: int, started: str) -> bool:
    """True while that process (not a later one with the same pid) exists and is not a zombie."""
    fields = stat(pid)
    return fields is not None and fields[19] == started and fields[0] not in ("Z", "X")


async def ended(pid: int, started: str, within: float = 5.0) -> bool:
    """True once that process is gone (or a zombie), looked at for up to ``within`` s: a process
    closes its files before it exits, and a pid namespace's first waits for the rest to go."""
    deadline = time.monotonic() + within
    while running(pid, started):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def ns_pids(pid: int) -> list[int]:
    """The process's pid in each pid namespace, outermost first (the NSpid line)."""
    with contextlib.suppress(OSError):
        for line in read(f"/proc/{pid}/status").splitlines():
            if line.startswith(b"NSpid:"):
                return [int(p) for p in line.split()[1:]]
    return []


def host_pid(ancestor: int, guest_pid: int) -> int | None:
    """The host pid of the process below ``ancestor`` that its own namespace calls ``guest_pid``."""
    return host_pids(ancestor, [guest_pid]).get(guest_pid)


def host_pids(ancestor: int, guest_pids: list[int],
              children: dict[int, list[tuple[int, str]]] | None = None) -> dict[int, int]:
    """guest pid -> host pid for processes below ``ancestor`` (one scan of /proc for all),
    the nearest one winning when nested namespaces reuse a number."""
    found: dict[int, int] = {}
    wanted = set(guest_pids)
    for pid, _ in descendants(ancestor, children):
        nspids = ns_pids(pid)
        for guest in wanted.intersection(nspids[1:] or nspids):
            found.setdefault(guest, pid)
        if len(found) == len(wanted):
            break
    return found


def leaf_pids(ancestor: int, maker: int, guest_pids: list[int]) -> dict[int, int]:
    """guest pid -> host pid of a leaf fork's branches: the children of its maker, a child of
    the forking agent (``ancestor`` itself, or the agent below a branch's keeper) that the
    agent's namespace calls ``maker``; each branch is pid 1 of its own namespace, and the
    agent's namespace calls it by the guest pid (the one but last of its NSpid line)."""
    wanted, found = set(guest_pids), dict[int, int]()
    for agent in [ancestor, *kids(ancestor)]:
        level = len(ns_pids(agent))
        for kid in kids(agent):
            nspids = ns_pids(kid)
            if len(nspids) != level or nspids[-1] != maker:
                continue
            for leaf in kids(kid):
                mine = ns_pids(leaf)
                if len(mine) == level + 1 and mine[-1] == 1 and mine[-2] in wanted:
                    found.setdefault(mine[-2], leaf)
            return found
    return found


ENVIRON_LIMIT = 4 << 20  # bytes of a process's environment read, at most (exec's own limit is ~2 MB by default)


def environ_holds(pid: int, entries: list[bytes]) -> set[bytes] | None:
    """Which of ``entries`` (whole ``VAR=value`` strings) the environment of process ``pid``
    holds, in its first :data:`ENVIRON_LIMIT` bytes; None if it can't be read. A process can
    point its /proc/PID/environ at any memory of its own (prctl PR_SET_MM_MAP, no privilege
    needed): a machine's 256 MiB of untouched pages, read whole and split, took a sweep 12 s
    and 2.3 GB (an audit). Read in bounded memory, searched, never split."""
    try:
        fd = os.open(f"/proc/{pid}/environ", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    parts, size = [b"\0"], 0
    try:
        while size < ENVIRON_LIMIT and (chunk := os.read(fd, min(65536, ENVIRON_LIMIT - size))):
            parts.append(chunk)
            size += len(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)
    env = b"".join(parts)  # each entry between NULs (one cut off at the limit has no closing one)
    return {e for e in entries if b"\0" + e + b"\0" in env}


def with_env(var: str, value: str) -> list[tuple[int, str]]:
    """(pid, start time) of live processes whose environment holds ``var=value``."""
    needle = f"{var}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        if environ_holds(int(entry), [needle]):
            fields = stat(int(entry))
            if fields is not None and fields[0] not in ("Z", "X"):
                found.append((int(entry), fields[19]))
    return found


def kill_all(procs: list[tuple[int, str]]) -> None:
    """SIGKILL each (pid, start time) that is still that process."""
    for pid, started in procs:
        if start_time(pid) == started:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def kill_tree(pid: int, timeout: float = 10.0) -> bool:
    """Kill every process below ``pid`` (again and again, so a forking one can't outrun us),
    then ``pid`` itself; True once all are gone."""
    me = (pid, start_time(pid))
    deadline = time.monotonic() + timeout
    seen: list[tuple[int, str]] = []
    while time.monotonic() < deadline:
        below = [p for p in descendants(pid) if running(*p)]  # zombies are dead already
        if not below:
            break
        seen += below
        kill_all(below)
        time.sleep(0.002)
    kill_all([me])
    while time.monotonic() < deadline:
        if not any(running(*p) for p in [*seen, me]):
            return True
        time.sleep(0.005)
    return False


def memory_mib(pids: list[int]) -> tuple[float, float]:
    """(RSS, PSS) of these processes together, in MiB (PSS shares forked pages fairly)."""
    rss = pss = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/smaps_rollup") as fh:
                for line in fh:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1])
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1])
    return rss / 1024, pss / 1024
