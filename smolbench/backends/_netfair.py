"""A fair share of a capped count among the members that want it (the egress proxy's connections).

The proxy applies it twice: a tree's connections among its machines, and the kernel's among
its trees. A fixed share (half a tree's per machine, a whole tree's per tree) let two branches
fill their tree and starve their parent and siblings, and four trees fill the kernel's (gaps
the eighth audit left). So:

* every live member is guaranteed ``min(floor, cap // live)``, and at least one: what it
  holds below that is its own, and the others may take a new one only while the count, plus
  what every other live member still lacks of its guarantee, stays within the cap. No set of
  members can starve another of its guarantee; one that arrives when all is held gets it
  from the next released, before anyone above their guarantee may take one again. With more
  live members than the cap (a fork may have 1,024 branches; a tree 64 connections) not all
  can hold one: each then holds at most one, first come, so a member holding none gets one
  while fewer than ``cap`` others hold one (the guarantee was 0, and three branches took all
  64: their parent had none, ninth audit);
* above its guarantee a member may hold at most ``cap // (holders + 1)``, ``holders`` being
  the members holding some now, itself counted (and ``most``): room is always left for one
  more, and the share shrinks as more want some, so the ones that came first can't keep
  more than the later ones will be left.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping
from typing import TypeVar

FULL, SHARE, KEPT = "full", "share", "kept"  # why a member may not take one more
K = TypeVar("K", bound=Hashable)


def guaranteed(cap: int, floor: int, live: int) -> int:
    """What each of ``live`` members may always hold of ``cap`` (one at least: past ``cap``
    live members, what each may hold at all while the others lack theirs)."""
    return max(1, min(floor, cap // max(1, live)))


def share(held: Mapping[K, int], me: K, cap: int, floor: int, live: int, most: int) -> int:
    """The most ``me`` may hold now: its guarantee, or its part among those holding some, and one more."""
    holders = sum(1 for k, n in held.items() if n > 0 and k != me) + 1  # itself, holding or about to
    return max(guaranteed(cap, floor, live), min(most, cap // (holders + 1)))


def refusal(held: Mapping[K, int], live: Collection[K], me: K, cap: int, floor: int,
            most: int) -> str | None:
    """Why ``me`` may not take one more of ``cap`` (``FULL``, ``SHARE`` or ``KEPT``), or None.
    ``held``: what each member holds (members gone may still hold some); ``live``: the members
    that are guaranteed their part; ``most``: what one member may hold at all."""
    total = sum(held.values())
    if total >= cap:
        return FULL
    mine = held.get(me, 0)
    floor_each = guaranteed(cap, floor, len(live))
    if mine < floor_each:
        return None  # its own: the others left room for it
    if mine >= share(held, me, cap, floor, len(live), most):
        return SHARE
    lacking = sum(max(0, floor_each - held.get(k, 0)) for k in live if k != me)
    return KEPT if total + 1 + lacking > cap else None
