"""Booting or branching a machine again after an infrastructure failure (InfraError).

A machine that failed to boot or died under a cell is retried up to ``retries`` times;
a cell's own exception never reaches here (it comes back as a result). Each attempt of
a retried machine is a row of the ledger's ``attempts`` table.
"""

from __future__ import annotations

from .backends.base import Backend, MachineRef
from .errors import InfraError
from .ledger import Ledger
from .spec import MachineSpec


def failed(ledger: Ledger, session: str, node_id: str, attempt: int, stage: str, exc: InfraError,
           retries: int) -> None:
    """Record a failed attempt: retried, or the last one (gave up)."""
    outcome = "retried" if attempt <= retries else "gave up"
    ledger.add_attempt(session, node_id, attempt, stage, outcome, str(exc))


async def boot(backend: Backend, ledger: Ledger, session: str, spec: MachineSpec, name: str,
               retries: int) -> MachineRef:
    """``backend.create``, booting again up to ``retries`` times after an InfraError."""
    attempt = 1
    while True:
        try:
            ref = await backend.create(spec, name)
        except InfraError as exc:
            failed(ledger, session, name, attempt, "boot", exc, retries)
            if attempt > retries:
                raise InfraError(f"{exc} (gave up after {attempt} attempts)") from None
            attempt += 1
            continue
        if attempt > 1:
            ledger.add_attempt(session, name, attempt, "boot", "ok")
        ref.info["attempts"] = attempt
        return ref


async def branch(backend: Backend, ledger: Ledger, session: str, parent: MachineRef, names: list[str],
                 seeds: list[int | None], retries: int) -> list[MachineRef]:
    """``backend.branch``, branching again up to ``retries`` times after an InfraError."""
    attempt = 1
    while True:
        try:
            refs = await backend.branch(parent, names, seeds)
        except InfraError as exc:
            for name in names:
                failed(ledger, session, name, attempt, "branch", exc, retries)
            if attempt > retries:
                raise InfraError(f"{exc} (gave up after {attempt} attempts)") from None
            attempt += 1
            continue
        for ref in refs:
            ref.info["attempts"] = attempt
            if attempt > 1:
                ledger.add_attempt(session, ref.name, attempt, "branch", "ok")
        return refs
