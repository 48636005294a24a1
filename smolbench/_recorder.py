"""A Workbench's record of its nodes: their ledger rows, and the observers told of each change (a mixin)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ._wbparts import WorkbenchPart
from .tree import Node

Observer = Callable[[Any, list[Node]], None]  # (the workbench, the nodes that changed)


class RecorderMixin(WorkbenchPart):
    """Writes nodes' rows and tells observers (the registry the sidebar reads, the views)."""

    baseline: str
    versions: dict[str, str | None]
    _observers: list[Observer]
    _heard: tuple[int, list[Node]] | None

    def observe(self, fn: Observer) -> None:
        """Call ``fn(workbench, changed_nodes)`` whenever nodes change."""
        self._observers.append(fn)

    def unobserve(self, fn: Observer) -> None:
        """Stop calling ``fn``."""
        with contextlib.suppress(ValueError):
            self._observers.remove(fn)

    def _changed(self, *nodes: Node) -> None:
        for fn in list(self._observers):
            with contextlib.suppress(Exception):  # a broken view must never break a run
                fn(self, list(nodes))

    def _record(self, node: Node, **extra: Any) -> None:
        self._write_row(node, **extra)
        if self._heard is not None and self._heard[0] == threading.get_ident():
            self._heard[1].append(node)  # told once the batch is committed (see recording)
        else:
            self._changed(node)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Rows recorded inside (on this thread) go in one commit; observers hear of their
        nodes after it, never while this thread holds the ledger's lock (a view's observer
        takes its own lock, which the main thread may hold while it reads the ledger)."""
        if self._heard is not None:  # nested, or another thread's batch: as it comes
            yield
            return
        self._heard = (threading.get_ident(), [])
        try:
            with self.ledger.batch():
                yield
        finally:
            heard, self._heard = self._heard[1], None
            if heard:
                self._changed(*{id(n): n for n in heard}.values())

    def _record_all(self, nodes: list[Node], **extra: Any) -> None:
        """:meth:`_record` each of ``nodes`` (see :meth:`recording`)."""
        with self.recording():
            for node in nodes:
                self._record(node, **extra)

    def _write_row(self, node: Node, **extra: Any) -> None:
        if self.versions:
            extra.setdefault("versions", self.versions)
        self.ledger.upsert_node(
            self.session, node.id, run_id=node.run_id, parent_id=node.parent, machine=node.id,
            backend=self.backend.name, baseline=self.baseline, seed=node.seed,
            started=node.started, ended=node.ended, status=node.status, reward=node.reward,
            metrics=node.metrics, output=node.output, error=node.error, alive=node.alive,
            kept=node.kept, forked_at=node.forked_at, host_node=node.where, **extra,
        )
