"""What every part of a Workbench works on: the attributes the mixins share, typed once."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .backends.base import Backend, MachineRef
    from .ledger import Ledger
    from .spec import MachineSpec
    from .tree import Tree


class WorkbenchPart:
    """A mixin of :class:`smolbench.workbench.Workbench`, which sets these in its ``__init__``."""

    backend: Backend
    spec: MachineSpec
    ledger: Ledger
    session: str
    tree: Tree
    machines: dict[str, MachineRef]

    def live(self, node_id: str) -> MachineRef:
        """A live node's machine, or a one-line error naming the live ones (the Workbench's)."""
        raise NotImplementedError
