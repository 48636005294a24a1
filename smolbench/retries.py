"""Doing a machine's work again after an infrastructure failure (InfraError).

A machine that failed to boot or died under a cell is booted (or branched) again, up to
``retries`` times; a cell's own exception never reaches here (it comes back as a result).
Each attempt of a retried machine is a row of the ledger's ``attempts`` table.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from .backends.base import MachineRef
from .errors import InfraError
from .spec import MachineSpec

T = TypeVar("T")


async def again(wb: Any, node_ids: list[str], stage: str, retries: int, once: Callable[[int], Awaitable[T]],
                before_retry: Callable[[int], Awaitable[None]] | None = None, first: int = 1) -> T:
    """``await once(attempt)``, again after an InfraError while attempts are left.

    ``wb`` is the Workbench (its ledger and session). ``before_retry(attempt)`` cleans up a
    failed attempt. When the attempts run out, the last InfraError is raised, saying so.
    """
    attempt = first
    while True:
        try:
            out = await once(attempt)
        except InfraError as exc:
            last = attempt > retries
            for node_id in node_ids:
                wb.ledger.add_attempt(wb.session, node_id, attempt, stage, "gave up" if last else "retried", str(exc))
            if last:
                raise InfraError(f"{exc} (gave up after {attempt} attempts)") from None
            if before_retry is not None:
                await before_retry(attempt)
            attempt += 1
            continue
        if attempt > 1:
            for node_id in node_ids:
                wb.ledger.add_attempt(wb.session, node_id, attempt, stage, "ok")
        return out


async def boot(wb: Any, spec: MachineSpec, name: str, retries: int) -> MachineRef:
    """``backend.create`` with retries; the machine's ``info["attempts"]`` says how many it took."""

    async def once(attempt: int) -> MachineRef:
        ref: MachineRef = await wb.backend.create(spec, name)
        ref.info["attempts"] = attempt
        return ref

    return await again(wb, [name], "boot", retries, once)


async def branch(wb: Any, parent: MachineRef, names: list[str], seeds: list[int | None], retries: int,
                 first: int = 1, leaf: bool = False) -> list[MachineRef]:
    """``backend.branch`` with retries (of the whole batch); ``leaf``: see ``Backend.branch``."""

    async def once(attempt: int) -> list[MachineRef]:
        refs: list[MachineRef] = await wb.backend.branch(parent, names, seeds, leaf=leaf)
        for ref in refs:
            ref.info["attempts"] = attempt
        return refs

    return await again(wb, names, "branch", retries, once, first=first)
