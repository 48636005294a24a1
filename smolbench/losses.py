"""What a Workbench does when a machine is lost under a cell: it died (MachineLost), or its
cell ignored the interrupt and it was killed. One mixin of :class:`smolbench.workbench.Workbench`."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

from . import gate
from . import retries as retry
from ._aio import _to_the_end
from ._wbparts import WorkbenchPart
from .errors import SmolbenchError
from .tree import Node

if TYPE_CHECKING:
    from .backends.base import MachineRef


class LossesMixin(WorkbenchPart):
    """Lost machines: out of the live set, said in one line (the magics' and the Session's)."""

    retries: int
    last_loss: str | None
    _busy: set[str]

    if TYPE_CHECKING:  # provided by Workbench
        @property
        def active(self) -> str | None: ...
        @active.setter
        def active(self, node_id: str | None) -> None: ...
        async def delete(self, node_id: str) -> list[str]: ...
        async def _init(self, ref: MachineRef) -> None: ...
        async def _drop(self, node_id: str, record: bool = True) -> None: ...
        def _placed(self, ref: MachineRef) -> None: ...
        def _record(self, node: Node, **extra: Any) -> None: ...

    async def _lost(self, node_id: str, why: str) -> SmolbenchError:
        """A machine that died under a request (it exited, crashed or was killed for memory):
        drop it and what was forked from it (a branch lives off its parent's machine and goes
        with it), mark it lost, and say what is active now; the one-line error. A lost root is
        not replaced, as a killed stuck one is: what ended it came from inside it (the cell, its
        memory) and could end a replacement nobody asked for again; ``Session.up()`` makes one."""
        with contextlib.suppress(Exception):
            await self.delete(node_id)
        node = self.tree[node_id]
        node.status, node.ended, node.error, node.alive = "lost", time.time(), why, False
        self._record(node)
        self.last_loss = f"{node_id}: {why}"
        if self.active is not None:
            return SmolbenchError(f"{why}; the active machine is now {self.active}")
        return SmolbenchError(f"{why}: `%smol up` starts a fresh machine (or `%smol checkpoint restore NAME`)",
                              api=f"{why}: `Session.up()` starts a fresh machine (or `Session.checkpoint_restore(name)`)")

    async def notice_gone(self) -> list[str]:
        """Idle machines whose process ended with no request to them (killed from outside, the
        OOM killer): lost now, as a request would find them (the backend checks without one)."""
        idle = [ref for name, ref in self.machines.items() if name not in self._busy]
        gone = self.backend.gone(idle)
        for name, why in gone.items():
            if name in self.machines and name not in self._busy:
                await self._lost(name, f"machine {name} died: {why}")
        return list(gone)

    async def _kill_stuck(self, node_id: str, timeout: float | None) -> SmolbenchError:
        """Delete a machine whose cell ignored the interrupt (after ``timeout`` s; None: a
        Ctrl-C); the one-line error that tells the user. A root is replaced by a fresh machine
        (once: its cell is not run again), as the host, not the machine, ended it."""
        why = "was interrupted" if timeout is None else f"ran longer than --timeout {timeout:g} s"
        api_why = "was interrupted" if timeout is None else f"ran longer than timeout={timeout:g} s"
        plain = "was interrupted" if timeout is None else f"ran longer than its {timeout:g} s timeout"
        await self.delete(node_id)
        node = self.tree[node_id]
        node.status, node.ended = "lost", time.time()
        node.error = f"killed: the cell {why} and ignored the interrupt for {gate.LIMITS.grace:g} s"
        self._record(node)
        self.last_loss = f"{node_id}: killed: its cell {plain} and ignored the interrupt for {gate.LIMITS.grace:g} s"
        grace = f"ignored the interrupt for {gate.LIMITS.grace:g} s, so machine {node_id} was killed: its state is lost"
        head = f"the cell {why} and {grace}"
        api = f"the code {api_why} and {grace}"
        if self.active is not None:
            tail = f"; the active machine is now {self.active} (its state from when {node_id} was forked)"
            return SmolbenchError(head + tail, api=api + tail)
        try:
            fresh = await self._fresh()
        except Exception as exc:
            return SmolbenchError(f"{head}, and a fresh machine did not start ({exc}). `%smol down` then `%smol up` "
                                  "starts one (or `%smol checkpoint restore NAME`)",
                                  api=f"{api}, and a fresh machine did not start ({exc}). `Session.down()` then "
                                  "`Session.up()` starts one (or `Session.checkpoint_restore(name)`)")
        made = "the Smolfile" if self.spec.source else "the default spec (no Smolfile)"  # what `%smol up` read
        tail = f"; a fresh machine {fresh} from {made} is up and active (its variables start empty)"
        return SmolbenchError(head + tail, api=api + tail)

    async def _fresh(self) -> str:
        """A new machine from the spec, made active (after the active one had to be killed)."""
        node_id = f"fresh{sum(1 for n in self.tree if n.id.startswith('fresh') and '.' not in n.id) + 1}"
        ref = await retry.boot(self, self.spec, node_id, self.retries)
        self.machines[node_id] = ref
        node = self.tree.add(Node(node_id, status="idle", started=time.time()))
        self._placed(ref)
        try:
            await self._init(ref)
        except BaseException:
            await _to_the_end(self._drop(node_id))
            raise
        self.active = node_id
        self._record(node)
        return node_id
