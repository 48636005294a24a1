"""Which node runs which branches: contiguous batches, sized by each node's free machine slots."""

from __future__ import annotations


def split(count: int, free: dict[str, int], prefer: str | None = None) -> dict[str, range]:
    """Indices ``0..count-1`` in one contiguous range per node, proportional to ``free`` slots.

    ``prefer`` (the node holding the warm parent) comes first and takes the rounding
    remainder: its branches need no replica. Nodes with no free slot get nothing unless
    every node is full, when the work is shared by total slots (machines queue there).
    """
    if count <= 0 or not free:
        return {}
    weights = {n: max(0, f) for n, f in free.items()}
    if sum(weights.values()) == 0:
        weights = {n: 1 for n in free}
    order = sorted(weights, key=lambda n: (n != prefer, -weights[n], n))
    total = sum(weights.values())
    shares = {n: count * weights[n] // total for n in order}
    left = count - sum(shares.values())
    for n in order:  # the remainder, parent's node first
        if left == 0:
            break
        if weights[n] > 0:
            shares[n] += 1
            left -= 1
    out: dict[str, range] = {}
    start = 0
    for n in order:
        if shares[n]:
            out[n] = range(start, start + shares[n])
            start += shares[n]
    return out


def least_loaded(free: dict[str, int]) -> str:
    """The node with the most free slots (a fresh episode's machine goes there)."""
    return max(sorted(free), key=lambda n: free[n])
