"""The Backend protocol: how smolbench creates, runs, branches and deletes machines.

Small on purpose, like jupyter_client's provisioner ABC: a backend knows how to
make a machine from a :class:`~smolbench.spec.MachineSpec`, reach the guest
agent inside it, copy it into live branches, and delete it. Everything else
(the tree, the ledger, scheduling, timeouts) lives in the Workbench.

Lifecycle of one machine::

    ref = await backend.create(spec, "root")
    result = await backend.exec_cell(ref, CellRequest(code="x = 1"), on_event)
    kids = await backend.branch(ref, ["root.0", "root.1"], seeds=[0, 1])
    await backend.delete(kids[0]); ...; await backend.delete(ref)
"""

from __future__ import annotations

import abc
import builtins
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..spec import MachineSpec


@dataclass
class MachineRef:
    """A live machine this kernel created (a handle, not the machine itself)."""

    name: str
    backend: str
    spec: MachineSpec
    parent: str | None = None
    created: float = field(default_factory=time.time)
    info: dict[str, Any] = field(default_factory=dict)  # backend-specific details
    # this machine's alone for the kernel's life, as its name is not (every session's first is
    # root): the display ids its cells give are scoped by it (gate.read_cell)
    token: str = field(default_factory=lambda: secrets.token_hex(8), repr=False, compare=False)


@dataclass
class Event:
    """Something a running cell produced before it finished."""

    kind: str  # "stream" | "display" | "clear"
    name: str = ""  # "stdout" | "stderr" for streams
    text: str = ""
    data: dict[str, Any] | None = None  # MIME bundle for displays
    note: bool = False  # the host's own line about the output (the gate's), said in the magics' words
    display_id: str | None = None  # a display's id, in the machine's words (the magics map it to one of theirs)
    update: bool = False  # a display that replaces the one shown with its display_id
    wait: bool = False  # a clear: when the next output comes


OnEvent = Callable[[Event], None]


@dataclass
class CellRequest:
    """One cell to run in a machine."""

    code: str
    push: dict[str, bytes] = field(default_factory=dict)  # name -> pickled value
    pull: list[str] = field(default_factory=list)
    cell_name: str = "<cell>"
    seed: int | None = None  # applied before the cell runs (fresh episodes)
    reseed: bool = False  # a branch's first cell: reseed the random streams in its namespace (guest/reseed.py)
    trust_pull: bool = False  # --pull-trusted / %smol trust on: pulled pickles may be loaded
    trust_display: bool = False  # %smol trust on: display bundles are shown raw
    output: Any = None  # the cell's gate.OutputBudget (None: the default limits, no log)
    pixels: Any = None  # a fork's gate images.Allowance its branches share (None: the cell's own)


@dataclass
class CellResult:
    """What a cell left behind once it finished (or failed)."""

    status: str  # "ok" | "error"
    result: dict[str, Any] | None = None  # MIME bundle of the last expression
    error: dict[str, Any] | None = None  # {"ename", "evalue", "traceback"}
    pulled: dict[str, Any] = field(default_factory=dict)  # values rebuilt by the gate
    reward: Any = None
    metrics: dict[str, Any] = field(default_factory=dict)
    stdout: str = ""  # what the cell printed, up to its output limit (then the line saying where the rest went)
    stderr: str = ""
    started: float = 0.0
    ended: float = 0.0
    pull_error: str | None = None  # a --pull refused by the gate (one line)
    output_log: str | None = None  # the log holding the output past the limit (absolute path), if any


@dataclass
class CheckpointInfo:
    """A saved machine on disk."""

    path: str
    backend: str
    size: int
    warnings: list[str] = field(default_factory=list)


class Backend(abc.ABC):
    """Creates and drives machines. One instance per Workbench."""

    name: ClassVar[str]

    @property
    @abc.abstractmethod
    def isolation(self) -> str:
        """Plain words for what separates a machine from the host."""

    @abc.abstractmethod
    async def create(self, spec: MachineSpec, name: str) -> MachineRef:
        """Boot a machine from ``spec`` and start its guest agent."""

    @abc.abstractmethod
    async def exec_cell(self, machine: MachineRef, request: CellRequest, on_event: OnEvent) -> CellResult:
        """Run one cell in the machine's persistent namespace, streaming events."""

    @abc.abstractmethod
    async def branch(
        self, machine: MachineRef, names: builtins.list[str], seeds: builtins.list[int | None], *, leaf: bool = False
    ) -> builtins.list[MachineRef]:
        """Make live copy-on-write children of a warm machine, one per name.

        Each child keeps the parent's state and gets its seed applied
        (``SEED``, ``random``, ``numpy`` and ``SMOLBENCH_SEED``). ``leaf``: the children will
        be deleted without ever being forked themselves (a backend may make them cheaper then;
        forking one is refused).
        """

    @abc.abstractmethod
    async def interrupt(self, machine: MachineRef) -> None:
        """Raise KeyboardInterrupt in the cell running in the machine, if any."""

    @abc.abstractmethod
    async def delete(self, machine: MachineRef) -> None:
        """Delete the machine; deleting one that is already gone is not an error."""

    @abc.abstractmethod
    def list(self) -> builtins.list[MachineRef]:
        """Machines this backend created and has not deleted yet."""

    @abc.abstractmethod
    async def checkpoint(self, machine: MachineRef, path: str) -> CheckpointInfo:
        """Save the whole machine to ``path``."""

    @abc.abstractmethod
    async def restore(self, path: str, name: str, spec: MachineSpec, *, isolated: bool = False) -> MachineRef:
        """Create a new machine from a checkpoint made by this backend. ``isolated``: it is not
        this kernel's own (a file or a ledger row from elsewhere), so its saved state, which is
        code, may only be loaded in a machine that isolates it (never the process backend's)."""

    def gone(self, machines: builtins.list[MachineRef]) -> dict[str, str]:
        """Of ``machines`` (not deleted), those whose process is gone, and why: checked without
        a request (``%smol status`` asks it of idle ones). Default: none known."""
        return {}

    async def close(self) -> None:
        """Delete every machine this backend still has."""
        for ref in reversed(self.list()):
            await self.delete(ref)
