"""A machine lost with its Ray node, rebuilt on a surviving node from its recorded path.

The next use of the machine (a cell in it, a fork of it) finds its node gone and replays
what the ledger recorded for it (replica.py's recipe: the Smolfile's init commands, its
cells, the seeds of the forks on its path) on the least loaded live node, under the same
name. The result is checked against the state fingerprint taken after its last cell; a
replay that doesn't match is kept, and said so. One line tells the user; the ledger gets
an attempt row (stage ``move``); the tree shows the new node and the one it moved from.
Other machines that were on the lost node are marked deleted, their results untouched
(an infrastructure failure is never a reward).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from typing import Any

from ..backends.base import MachineRef
from ..errors import InfraError, SmolbenchError
from .backend import _short


def _node_words(backend: Any, node_id: str) -> str:
    at = backend.where(node_id) or {}
    return f"node {_short(node_id)}" + (f" ({at['backend']})" if at.get("backend") else "")


_LOCKS: weakref.WeakKeyDictionary[Any, dict[str, asyncio.Lock]] = weakref.WeakKeyDictionary()


async def ensure(wb: Any, node_id: str) -> MachineRef | None:
    """``node_id``'s machine as it is now, rebuilt first if its node was lost (once, however
    many branches of a fork find it gone at the same time); None when it has none."""
    lock = _LOCKS.setdefault(wb, {}).setdefault(node_id, asyncio.Lock())
    async with lock:
        ref = wb.machines.get(node_id)
        if ref is None:
            return None
        lost = await wb.backend.lost_node(ref)
        if lost is None:
            return ref
        return await rebuild(wb, node_id, lost)


def _drop_others(wb: Any, keep: str, lost: str) -> list[str]:
    """Every other machine on the lost node: gone (deleted in the tree; results and rewards stay).
    The active machine stays listed (its own next use rebuilds it), and so do running
    branches (their fork runs them again under ``--retries``)."""
    # not those made since on that node, when it lives on with a new agent
    gone = sorted(n for n, r in wb.machines.items() if n not in (keep, wb.active) and r.info.get("node") == lost
                  and not wb.backend.has(n) and not (n in wb.tree and wb.tree[n].status in ("starting", "running")))
    for name in gone:
        wb.machines.pop(name, None)
        if name in wb.tree:
            node = wb.tree[name]
            node.alive, node.kept = False, False
            wb._record(node)
    return gone


def _next_attempt(wb: Any, node_id: str, ref: MachineRef) -> int:
    tried = [int(a["attempt"]) for a in wb.ledger.attempt_rows(wb.session) if a["node_id"] == node_id]
    return max([int(ref.info.get("attempts", 1)), *tried]) + 1


async def _replay(backend: Any, recipe: Any, old: MachineRef, retries: int) -> tuple[MachineRef, str]:
    """The replay, again on the next live node when the one it ran on is lost too."""
    for _ in range(retries):
        try:
            return await backend.replay(recipe, old.spec, old.name)
        except InfraError:
            continue
    return await backend.replay(recipe, old.spec, old.name)


async def rebuild(wb: Any, node_id: str, lost: str) -> MachineRef:
    """Replay ``node_id``'s recorded path on a live node; the one line goes to ``wb.on_notice``."""
    backend = wb.backend
    old = wb.machines[node_id]
    node = wb.tree[node_id]
    was = _node_words(backend, lost)
    others = _drop_others(wb, node_id, lost)
    also = (f"; {len(others)} other machine{'s' if len(others) != 1 else ''} on it went with it "
            f"({', '.join(others[:4])}{', …' if len(others) > 4 else ''}: `%smol replay NODE` rebuilds one)") if others else ""
    attempt = _next_attempt(wb, node_id, old)
    t0 = time.perf_counter()
    try:
        recipe = backend.recipe_for(node_id)
        if recipe.pushed:
            pushed = ", ".join(sorted(set(recipe.pushed)))
            raise SmolbenchError(f"cells of {pushed} used --push, whose values are not recorded",
                                 api=f"cells of {pushed} used push=, whose values are not recorded")
        want = backend.known_fingerprint(recipe.key)
        ref, got = await _replay(backend, recipe, old, wb.retries)
    except SmolbenchError as exc:
        wb.machines.pop(node_id, None)
        node.status, node.alive, node.kept = "lost", False, False
        node.ended, node.error = time.time(), f"lost with {was}"
        wb._record(node)
        if wb.active == node_id:
            wb.active = None
        why = f"{node_id} was lost with {was} and could not be rebuilt from its recorded path"
        line = f"{why} ({exc}){also}: `%smol up` starts a fresh machine"
        wb.ledger.add_attempt(wb.session, node_id, attempt, "move", "gave up", line)
        raise SmolbenchError(line, api=f"{why} ({exc.api or exc}){also}: `%smol up` starts a fresh machine") from None
    ref.info["attempts"] = attempt
    wb.machines[node_id] = ref
    node.moved_from = lost
    wb._placed(ref)
    cells = sum(1 for s in recipe.steps if s[0] == "cell")
    head = (f"{node_id} was lost with {was}; rebuilt on {_node_words(backend, ref.info['node'])} by replaying its "
            f"recorded path ({cells} cell{'s' if cells != 1 else ''}, {time.perf_counter() - t0:.2f} s)")
    if want is None:
        outcome, check = "unchecked", "; no state fingerprint was taken of it, so the replay is unchecked"
    elif got == want:
        outcome, check = "moved", f"; state fingerprint {got} matches"
    else:
        outcome = "mismatch"
        check = (f"; but the replay doesn't match: state fingerprint {got} vs {want} recorded (a cell depends on "
                 "something not recorded: time, randomness without a seed, files from outside): re-run the cells "
                 "that set what differs")
    await backend.restate(node_id, recipe.key, got)
    line = f"{head}{check}{also}"
    wb.ledger.add_attempt(wb.session, node_id, attempt, "move", outcome, line)
    wb._record(node)
    wb.on_notice(f"smolbench: {line}")
    return ref
