"""What ``%smol status`` (and ``Session.status()``) shows about a Workbench: one mixin."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ._wbparts import WorkbenchPart
from .tree import Node, where_text

if TYPE_CHECKING:
    from .backends.base import MachineRef
    from .spec import MachineSpec


class StatusMixin(WorkbenchPart):
    """The status dict and its lines, for a Workbench."""

    baseline: str
    started: float
    guest_info: dict[str, Any]
    max_alive: int
    trusted: bool
    net_note: str | None
    net_stats: dict[str, dict[str, Any]]

    if TYPE_CHECKING:  # provided by Workbench
        @property
        def active(self) -> str | None: ...
        def kept_alive(self) -> list[str]: ...

    def _live_text(self) -> str:
        names = sorted(self.machines, key=lambda n: [int(p) if p.isdigit() else p for p in n.split(".")])
        shown = ", ".join(names[:12]) + (f", … {len(names) - 12} more" if len(names) > 12 else "")
        usage = getattr(self.backend, "host_memory", lambda: None)()
        mem = f"; host memory RSS {usage[0]:.0f} MiB, PSS {usage[1]:.0f} MiB" if usage else ""
        return (f"{len(names)} ({shown}); kept {len(self.kept_alive())} of max_alive {self.max_alive}{mem}")

    async def refresh_network(self) -> None:
        """Fetch the backend's per-machine connection counters (shown by ``status``); a cluster
        also looks for new nodes and asks each node agent for its counts."""
        poll = getattr(self.backend, "poll", None)
        if poll is not None:
            await poll()
        stats = getattr(self.backend, "network_stats", None)
        if stats is not None:
            self.net_stats = await stats()

    def _network_text(self) -> str:
        policy = self.spec.policy
        line = policy.describe()
        if self.net_note:
            line += " (set for this session as it came up)"
        enforced = getattr(self.backend, "network_enforced", None)
        if enforced is not None and policy.enabled:
            line += f"; {enforced()}"
        if self.backend.name == "smol" and (any(h.port for h in policy.hosts) or any(c.port for c in policy.cidrs)):
            line += "; ports are not enforced by smol (it scopes by host and CIDR)"
        if self.backend.name == "process" and policy.enabled:
            line += "; NOT enforced: the process backend shares the host's network"
        if self.net_stats:
            refused = sum(s.get("refused", 0) for s in self.net_stats.values())
            allowed = sum(s.get("allowed", 0) for s in self.net_stats.values())
            last = [s["last_refused"] for s in self.net_stats.values() if s.get("last_refused")]
            line += f"; {allowed} connection{'s' if allowed != 1 else ''} let out, {refused} refused"
            if last:
                line += f" (last refused: {last[-1]})"
            line += _proxy_text(list(self.net_stats.values()))
        return line

    def _limits_text(self) -> str:
        describe = getattr(self.backend, "limits_status", None)
        text = describe(self.spec) if describe is not None else _vm_limits(self.spec)
        disk = _disk_text(self.backend, self.spec)
        return f"{text}; {disk}" if disk else text

    def _cluster_text(self) -> dict[str, str]:
        """The cluster's nodes, one per line (cluster backend only)."""
        describe = getattr(self.backend, "describe", None)
        if describe is None:
            return {}
        return {"cluster": "\n  ".join(["", *describe(), *getattr(self.backend, "notes", [])[-5:]])}

    def status(self) -> dict[str, Any]:
        """What ``%smol status`` shows."""
        ref = self.machines.get(self.active or "")
        return {
            "backend": self.backend.name,
            "isolation": self.backend.isolation,
            "active": self.active,
            "machine": _machine_text(self.tree[ref.name] if ref and ref.name in self.tree else None, ref),
            "image": self.spec.image or getattr(self.backend, "image_default", None) or _default_image(self.backend.name),
            "baseline": self.baseline,
            "network": self._network_text(),
            "trusted": "ON: pulls unpickled, output raw (`%smol trust off`)" if self.trusted else "off",
            "limits": self._limits_text(),
            "uptime_s": round(time.time() - self.started, 1),
            "live_machines": self._live_text(),
            "nodes": len(self.tree),
            "guest_python": self.guest_info.get("python"),
            "ledger": str(self.ledger.path),
            "session": self.session,
            **self._cluster_text(),
        }


def _machine_text(node: Node | None, ref: MachineRef | None) -> str | None:
    """The active machine, and on a cluster the node it runs on."""
    if ref is None:
        return None
    if node is None or not node.where:
        return ref.name
    return f"{ref.name} on node {where_text(node.where, node.where_kind, node.where_host, node.moved_from)}"


def _disk_text(backend: Any, spec: MachineSpec) -> str:
    """The Smolfile's ``disk`` as this backend takes it (the sandbox: files held in memory)."""
    from .backends._limits import format_mib

    if getattr(backend, "files_in_memory", False):
        said = "the Smolfile's" if spec.disk_mib else "default: half of memory"
        return f"disk {format_mib(spec.files_mib)} ({said}: the workspace and /tmp, held in memory)"
    if backend.name == "process":
        return "disk not limited (the process backend writes to the host's own folders)"
    return ""  # a microVM's disk is its image's (the key sizes the sandbox's in-memory files)


def _vm_limits(spec: MachineSpec) -> str:
    return f"the microVM's own: memory {spec.memory} MiB, {spec.cpus} cpu{'s' if spec.cpus != 1 else ''}"


def _default_image(backend: str) -> str | None:
    if backend == "smol":
        from .backends.smol_image import DEFAULT_IMAGE

        return f"(backend default: {DEFAULT_IMAGE})"
    return {"sandbox": "(backend default: host system, read-only)", "process": "(none: the host itself)"}.get(backend)


def _proxy_text(stats: list[dict[str, Any]]) -> str:
    """The egress proxy's own failures and what it holds now (its bounds: backends/_netbudget.py)."""
    from .backends import _netbudget

    text = ""
    failed = sum(s.get("failed", 0) for s in stats)
    if failed:
        last = [s["last_failed"] for s in stats if s.get("last_failed")]
        text += f", {failed} failed in the proxy" + (f" (last: {last[-1]})" if last else "")
    if any("open" in s for s in stats):
        held = sum(s.get("open", 0) for s in stats)
        text += (f"; the proxy holds {held} connection{'s' if held != 1 else ''}, "
                 f"{sum(s.get('buffered', 0) for s in stats) // 1024} KiB buffered, "
                 f"{sum(s.get('heads', 0) for s in stats)} unfinished request heads (at most "
                 f"{_netbudget.TREE_CONNECTIONS} connections and {_netbudget.TREE_HEADS} heads per machine tree, "
                 f"{_netbudget.KERNEL_CONNECTIONS} connections per kernel)")
    return text

