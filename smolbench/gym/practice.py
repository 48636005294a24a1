"""Which pages a fresh reset's spare takes ahead, learned from a practice episode.

A spare branch waits for its episode's reset; each page its episode writes first costs a
copy-on-write copy, and each page of code it runs first a mapping. Spares take those pages
ahead while they wait (``guest/gymserve.py`` ``Server.warm``). Which pages: what one
*practice* episode made its own, in a branch of the warm parent that no real episode ever
runs in, reset with a fixed seed and stepped with actions the host samples from a fixed
seed. The list is then a function of the warm parent alone.

Why not learn from a real episode: which pages a spare has present is visible inside it
(``/proc/self/pagemap``, or the time a first touch takes), so a list learned from episode
*k* would tell every later episode what episode *k* touched: a channel between episodes,
which fresh resets promise don't exist. The list is machine data all the same: checked
here (runs of whole numbers, bounded) before any spare is given it, and in the spare it
can only copy or map pages the spare already has.
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import TYPE_CHECKING, Any

from .._aio import _to_the_end
from ..backends.base import MachineRef
from . import episode as E
from . import spaces

if TYPE_CHECKING:
    from .episode import Episode
    from .warmparent import WarmParent

MAX_OWNED = {"w": 4096, "r": 16384}  # pages a spare takes ahead, at most (as guest/gymserve.py's)
MAX_RUNS = 2048  # runs of them, at most (the spare's serving cell carries them)
PRACTICE_SEED = 0  # the practice episode's reset seed, its machine's global seed and its actions' seed
PRACTICE_STEPS = 200  # steps it takes, resetting (without a seed) when an episode ends
PRACTICE_TIMEOUT = 20.0  # seconds it may take in all; past that, spares warm without a list
# An action space whose sample costs more is not practised with (spares warm without a list): the
# machine describes the space, and each sample runs on the event loop (a sample of a Box of 2**24
# bytes, within the spaces' budget, held it 0.75 s, and a practice takes 200).
PRACTICE_SAMPLE_BYTES = 4 << 20


async def practise(m: WarmParent, ep: Episode) -> str | None:
    """Run the practice episode in a new branch of ``m``'s warm parent (as ``ep``, a
    machine-less episode of no sub-env), ask it which pages it made its own, delete it; the
    checked list as JSON (None: it could not say)."""
    if spaces.sample_bytes(m.action_space) > PRACTICE_SAMPLE_BYTES:
        return None
    ref: MachineRef | None = None
    try:
        (ref,) = await m._branch(1)
        ep.ref = ref
        return await asyncio.wait_for(_practice(m, ep), PRACTICE_TIMEOUT)
    except Exception:  # an env that fails its practice still runs: its spares warm without a list
        return None
    finally:  # also when the env's close stops it (cancelled): then no list, and its machine goes
        E.hang_up(ep)
        if ref is not None:
            await _to_the_end(m._delete(ref))


async def _practice(m: WarmParent, ep: Episode) -> str | None:
    await m._serve(ep, None, None, None, learn=True)  # warmed as a spare is, then its pages noted
    actions = copy.deepcopy(m.action_space)
    actions.seed(PRACTICE_SEED)
    reset = json.dumps({"seed": PRACTICE_SEED, "rng": None, "options": None})
    await m._ask(ep, {"op": "reset", "r": reset, "seed": PRACTICE_SEED})
    again = json.dumps({"seed": None, "rng": None, "options": None})
    for _ in range(PRACTICE_STEPS):
        out = await m._ask(ep, {"op": "step", "a": spaces.action_data(m.action_space, actions.sample())})
        if type(out) is dict and (out.get("terminated") is True or out.get("truncated") is True):
            await m._ask(ep, {"op": "reset", "r": again, "seed": None})
    return checked(await m._ask(ep, {"op": "pages"}))


def checked(value: Any) -> str | None:
    """What a practice episode's machine said it made its own (machine data), checked: runs
    ``[first page, count]`` of whole numbers, within bounds; as JSON for the spares'
    serving cells, or None."""
    if not isinstance(value, dict) or not set(value) <= set(MAX_OWNED):
        return None
    out: dict[str, list[list[int]]] = {}
    for kind, cap in MAX_OWNED.items():
        runs = value.get(kind, [])
        if not isinstance(runs, list) or len(runs) > MAX_RUNS:
            return None
        total = 0
        for run in runs:
            if type(run) is not list or len(run) != 2 or type(run[0]) is not int or type(run[1]) is not int \
                    or not 0 <= run[0] < 1 << 52 or not 1 <= run[1] <= cap:
                return None
            total += run[1]
        if total > cap:
            return None
        out[kind] = runs
    return json.dumps(out, separators=(",", ":")) if any(out.values()) else None
