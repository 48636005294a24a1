"""Live machines of this server's kernels, read from the registry; deleting one.

A live kernel is asked to delete its own machine (the server runs ``%smol delete NODE``
in it, silently, through the kernel manager), so its Workbench, tree and ledger stay
true. A machine whose kernel is dead has no Workbench left to ask: the server kills the
host process the kernel published for it (after checking, by start time, that the pid
still names that process, and that smolbench started it for that machine of that kernel,
now dead: ``registry.started_machine``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

from .. import registry

NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
UNVERIFIED_KEEP_S = 24 * 3600  # how long a dead kernel's pid-less machines stay listed
ASK_TIMEOUT = 20.0  # seconds to wait for an idle kernel to answer `%smol delete`
BUSY_TIMEOUT = 2.0  # a busy kernel runs it after its current cell: don't hold the request that long
DEAD_KEEP_S = 60.0  # how long a kernel that died with all its machines is reported (the sidebar says so once)


class NotFound(LookupError):
    """No such kernel record or machine."""


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _whole(value: Any) -> int | None:
    """An int of a record (a pid, a start time), else None: a key of the look-ups kept per listing."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _node(m: dict[str, Any]) -> dict[str, Any]:
    """A cluster machine's node (id, host, backend kind, lost) as the record says; None off a cluster."""
    def text(key: str, limit: int) -> str | None:
        value = m.get(key)
        return value[:limit] if isinstance(value, str) and value else None

    node = text("node", 128)
    return {"node": node, "node_host": text("node_host", 255) if node else None,
            "node_backend": text("node_backend", 32) if node else None,
            "node_lost": bool(node and m.get("node_lost") is True)}


def snapshot(folder: Path, known: set[str], notebooks: dict[str, str],
             dead: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Every machine of this server's live kernels, plus orphans of dead kernels.

    ``known`` is the kernel ids the server runs, ``notebooks`` maps kernel id to the path
    of the notebook its session belongs to. Records of dead kernels whose machines are
    all gone are removed, and remembered in ``dead`` (the server's own dict, kept between
    calls) for DEAD_KEEP_S, so the sidebar can say that kernel died. Records are read one
    at a time, within ``registry``'s caps; what was not read is said in ``skipped``.
    """
    dead = {} if dead is None else dead
    now = time.time()
    groups: list[dict[str, Any]] = []
    skipped: list[str] = []
    measured: dict[tuple[Any, Any], tuple[float | None, str]] = {}  # a crafted record names one process 4096 times
    for path, rec in registry.read_records(folder, skipped):
        group = _group(path, rec, known, notebooks, dead, now, measured)
        del rec  # (not held while the next one is parsed)
        if group is not None:
            groups.append(group)
    groups.sort(key=lambda g: (g["orphaned"], g["notebook"] or g["cwd"], g["kernel_id"]))
    live = [m for g in groups if not g["orphaned"] for m in g["machines"]]
    backends = sorted({g["backend"] for g in groups if not g["orphaned"] and g["machines"]})
    for name in [n for n, d in dead.items() if now - d["at"] > DEAD_KEEP_S]:
        del dead[name]
    for name in sorted(dead, key=lambda n: dead[n]["at"])[:max(0, len(dead) - registry.MAX_RECORDS)]:
        del dead[name]  # (kept between listings: crafted records swept at every listing add up)
    return {"kernels": groups, "machines": len(live), "orphaned": sum(len(g["machines"]) for g in groups if g["orphaned"]),
            "backends": backends, "dead": sorted(dead.values(), key=lambda d: d["at"]), "skipped": skipped}


def _group(path: Path, rec: dict[str, Any], known: set[str], notebooks: dict[str, str],
           dead: dict[str, dict[str, Any]], now: float,
           measured: dict[tuple[Any, Any], tuple[float | None, str]]) -> dict[str, Any] | None:
    """One record's kernel and machines for the listing (None: not shown)."""
    kid = str(rec.get("kernel_id", ""))[:128]
    kernel_alive = registry.alive(rec.get("pid"), rec.get("pid_start"))
    if kernel_alive and kid not in known:
        return None  # another server's kernel (or a kernel outside Jupyter): not ours to show
    orphaned = not kernel_alive
    sharing = _by_pid(rec)
    killable: dict[tuple[Any, Any], bool] = {}  # one look at each host process, not one per machine it holds
    machines = []
    for m in rec["machines"]:
        if not isinstance(m, dict) or not isinstance(m.get("id"), str):
            continue
        # A machine with no host process of its own (a microVM run by smol's engine) can't be
        # checked from here: listed as "unverified" for a day after its kernel died, not killable.
        unverified = orphaned and not isinstance(m.get("pid"), int)
        if unverified and now - (_num(rec.get("updated")) or 0) > UNVERIFIED_KEEP_S:
            continue
        if orphaned and not unverified and not registry.alive(m.get("pid"), m.get("pid_start")):
            continue
        host = (_whole(m.get("pid")), _whole(m.get("pid_start")))
        if orphaned and not unverified and host not in killable:
            killable[host] = registry.started_machine(m["pid"], host[1], sharing.get(m["pid"], set()),
                                                      rec.get("pid"), rec.get("pid_start"))
        agent = (_whole(m.get("agent_pid")), _whole(m.get("agent_start")))
        if agent not in measured:
            measured[agent] = registry.memory_mib(*agent)
        used, how = measured[agent]
        created = _num(m.get("created"))
        machines.append({
            "id": m["id"][:128], "parent": m.get("parent") if isinstance(m.get("parent"), str) else None,
            "backend": str(m.get("backend", ""))[:32], "uptime_s": round(now - created, 1) if created else None,
            "memory_mib": _num(m.get("memory_mib")), "cpus": _num(m.get("cpus")),
            "memory_used_mib": used, "memory_measure": how,
            "status": str(m.get("status") or "")[:16], "reward": _num(m.get("reward")),
            "active": m["id"] == rec.get("active"), "orphaned": orphaned, "unverified": unverified,
            "killable": orphaned and not unverified and killable[host], **_node(m),
        })
    notebook = rec.get("notebook")
    recorded_nb = notebook[:1000] if isinstance(notebook, str) else None
    if orphaned and not machines:
        with contextlib.suppress(OSError):
            path.unlink()  # its kernel and every machine are gone: nothing left to show
            dead[path.name] = {"kernel_id": kid, "notebook": recorded_nb, "cwd": str(rec.get("cwd", ""))[:1000],
                               "machines": len(rec["machines"]), "at": now}
        return None
    active = rec.get("active") if isinstance(rec.get("active"), str) else None
    return {
        "kernel_id": kid, "record": path.name, "notebook": notebooks.get(kid) if kernel_alive else recorded_nb,
        "active": active if any(m["id"] == active for m in machines) else None,
        "cwd": str(rec.get("cwd", ""))[:1000], "backend": str(rec.get("backend", ""))[:32],
        "session": str(rec.get("session", ""))[:64], "kernel_alive": kernel_alive,
        "orphaned": orphaned, "updated": _num(rec.get("updated")), "machines": machines,
    }


def find(folder: Path, kernel_id: str, node_id: str,
         orphaned: bool | None = None) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """The record and machine entry for ``node_id`` of ``kernel_id``: of its live process, or
    of a dead one (a restarted kernel keeps its id) when ``orphaned``; None: live first."""
    if not NODE_ID.fullmatch(node_id):
        raise NotFound(f"{node_id!r} is not a machine id (like root or root.7.2)")
    hit = None  # the first of a dead kernel's records, kept (one record: never all of them) until a live one
    for path, rec in registry.read_records(folder):
        if rec.get("kernel_id") != kernel_id:
            continue
        kernel_alive = registry.alive(rec.get("pid"), rec.get("pid_start"))
        if orphaned is not None and orphaned == kernel_alive:
            continue
        machine = next((m for m in rec["machines"] if isinstance(m, dict) and m.get("id") == node_id), None)
        if machine is not None and kernel_alive:
            return path, rec, machine
        if machine is not None and hit is None:
            hit = (path, rec, machine)
    if hit is None:
        raise NotFound(f"kernel {kernel_id} has no machine {node_id!r} (it may be gone already: refresh)")
    return hit


def ledger_owner(folder: Path, known: set[str], ledger: Path) -> str | None:
    """The live kernel of this server whose Workbench writes ``ledger`` (None: no such kernel)."""
    want = str(ledger.resolve())
    for _path, rec in registry.read_records(folder):
        kid = str(rec.get("kernel_id", ""))
        if kid in known and rec.get("ledger") == want and registry.alive(rec.get("pid"), rec.get("pid_start")):
            return kid
    return None


async def ask_kernel(kernel_manager: Any, kernel_id: str, node_id: str, command: str | None = None) -> dict[str, Any]:
    """Run ``%smol delete NODE`` (or ``command``, a ``%smol`` line naming ``node_id``) in the
    live kernel; what it printed or raised."""
    command = command or f"%smol delete {node_id}"
    verb = "remove checkpoint" if command.startswith("%smol checkpoint rm") else "delete"
    km = kernel_manager.get_kernel(kernel_id)
    busy = getattr(km, "execution_state", "") == "busy"
    client = km.client()
    client.start_channels()
    out: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if msg["header"]["msg_type"] == "stream":
            out.append(msg["content"].get("text", ""))

    try:
        reply = await client.execute_interactive(
            command, silent=True, store_history=False, allow_stdin=False,
            timeout=BUSY_TIMEOUT if busy else ASK_TIMEOUT, output_hook=hook)
    except TimeoutError:
        return {"action": "asked-kernel", "ok": False, "queued": True,
                "message": f"asked kernel {kernel_id[:8]} to {verb} {node_id}; it is busy, so it happens "
                           "when its current cell finishes"}
    finally:
        client.stop_channels()
    content = reply.get("content", {})
    if content.get("status") != "ok":
        why = f"{content.get('ename', 'error')}: {content.get('evalue', '')}".strip()
        return {"action": "asked-kernel", "ok": False, "message": f"kernel {kernel_id[:8]} could not {verb} {node_id}: {why}"}
    said = " ".join(line.strip() for line in "".join(out).splitlines() if line.strip())
    return {"action": "asked-kernel", "ok": True,
            "message": f"asked kernel {kernel_id[:8]} to {verb} {node_id}: {said or 'done'}"}


def _by_pid(rec: dict[str, Any]) -> dict[int, set[str]]:
    """The ids of a record's machines by the host process holding them (a root and its
    branches share one): built once per record (once per machine was quadratic)."""
    out: dict[int, set[str]] = {}
    for m in rec["machines"]:
        if isinstance(m, dict) and isinstance(m.get("id"), str) and isinstance(m.get("pid"), int):
            out.setdefault(m["pid"], set()).add(m["id"])
    return out


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(b")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


async def kill_orphan(path: Path, rec: dict[str, Any], machine: dict[str, Any]) -> dict[str, Any]:
    """Kill the host process holding an orphaned machine (and so every machine inside it)."""
    pid, start = machine.get("pid"), machine.get("pid_start")
    if not isinstance(pid, int):
        return {"action": "none", "ok": False,
                "message": f"{machine['id']}'s backend published no host process, so it can't be killed from here"}
    if pid in (os.getpid(), 1) or not registry.alive(pid, start):
        gone = True
    elif not registry.started_machine(pid, start, _by_pid(rec).get(pid, set()), rec.get("pid"), rec.get("pid_start")):
        return {"action": "none", "ok": False,
                "message": f"{machine['id']}'s host process {pid} is not a machine smolbench started (its record "
                           "names another process): left alone"}
    else:
        gone = False
        inside = _descendants(pid)
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
        for p in [pid, *inside]:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while registry.alive(pid, start) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    held = [m["id"] for m in rec["machines"] if isinstance(m, dict) and m.get("pid") == pid]
    rest = [m for m in rec["machines"] if not (isinstance(m, dict) and m.get("pid") == pid)]
    with contextlib.suppress(OSError):
        if rest:
            registry.write_atomic(path, {**rec, "machines": rest})
        else:
            path.unlink()
    if gone:
        return {"action": "none", "ok": True, "message": f"{machine['id']} was already gone"}
    return {"action": "killed", "ok": True,
            "message": f"killed orphaned {', '.join(held)} (host process {pid}; kernel {str(rec.get('kernel_id'))[:8]} is dead)"}
