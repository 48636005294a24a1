"""Which kept machines stay: a fork's keep policy (best, all, none) and the ``max_alive`` cap on
kept machines, least recently used going first. One mixin of :class:`smolbench.workbench.Workbench`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._wbparts import WorkbenchPart
from .tree import TERMINAL, Node

if TYPE_CHECKING:
    from .result import ForkResult


class KeepingMixin(WorkbenchPart):
    """Kept machines for a Workbench: what a fork keeps, and the cap on how many stay alive."""

    max_alive: int
    on_notice: Callable[[str], None]
    _used: dict[str, float]
    _busy: set[str]

    if TYPE_CHECKING:  # provided by Workbench
        @property
        def active(self) -> str | None: ...
        async def _drop(self, node_id: str, record: bool = True) -> None: ...
        def _record(self, node: Node, **extra: Any) -> None: ...
        def _finish(self, result: ForkResult, node: Node, status: str, *, error: str | None = None,
                    alive: bool | None = None) -> None: ...
        def _record_all(self, nodes: list[Node], **extra: Any) -> None: ...

    def _touch(self, node_id: str) -> None:
        self._used[node_id] = time.monotonic()

    def kept_alive(self) -> list[str]:
        """Live kept machines (fork winners), the ones ``max_alive`` caps."""
        return [n for n in self.machines if n in self.tree and self.tree[n].kept]

    async def enforce_max_alive(self) -> list[str]:
        """Delete least recently used idle kept machines beyond ``max_alive``; never the active
        one, a busy one, or one with live children. Their ledger rows (and so replay) stay."""
        gone: list[str] = []
        while len(self.kept_alive()) > self.max_alive:
            parents = {self.tree[n].parent for n in self.machines if n in self.tree}
            idle = [n for n in self.kept_alive() if n != self.active and n not in self._busy and n not in parents]
            if not idle:
                break
            victim = min(idle, key=lambda n: self._used.get(n, 0.0))
            await self._drop(victim)
            self.tree[victim].kept = False
            self._record(self.tree[victim])
            gone.append(victim)
            self.on_notice(f"smolbench: deleted idle kept machine {victim} (least recently used; more than "
                           f"max_alive = {self.max_alive} kept alive); its ledger row stays, `%smol replay {victim}` rebuilds it")
        return gone

    async def _apply_keep(self, result: ForkResult, nodes: list[Node], keep: str) -> None:
        best = result.best
        for node in nodes:
            if not node.alive:
                continue
            wanted = keep == "all" or (keep == "best" and best is not None and best["branch"] == node.id)
            if wanted and node.status == "ok":
                node.kept = True
                self._touch(node.id)
                node.status = "ok"
                result.kept.append(node.id)
                self._record(node)
        drop = [n.id for n in nodes if n.alive and n.id not in result.kept]
        try:  # in parallel: one round trip each
            await asyncio.gather(*(self._drop(node_id, record=False) for node_id in drop))
        finally:  # after a Ctrl-C too: those that went
            self._record_all([self.tree[n] for n in drop if not self.tree[n].alive])

    def _cancel_unstarted(self, result: ForkResult, nodes: list[Node], alive: bool | None = None) -> None:
        """Record as cancelled the nodes a cancel reached before their task first ran, so never
        ran their own handler (an audit: they stayed "starting" in a run recorded done, and the
        next session on the ledger marked them lost, "its kernel stopped")."""
        for node in nodes:
            if node.status not in TERMINAL:
                self._finish(result, node, "cancelled", error="cancelled", alive=alive)
