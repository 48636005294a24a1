"""A step's or reset's info from a machine, checked: the guest sends only data (its
``plain``: None, bools, numbers, text, lists, dicts with text keys, arrays of any dtype but
objects), so anything else the gate could rebuild (sets, tuples as keys, complex numbers
or bytes as values, pandas) came from a rewritten guest and is refused, as is an info past
:data:`MAX_INFO` bytes as JSON would spell it, in one line naming the sub-env (never a raw
exception: the other sub-envs' answers still count). A vector step's infos are merged only
within :data:`MAX_MERGED` (:func:`check_merge`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .episode import GymError

MAX_INFO = 256 * 1024  # bytes an info may take (about its JSON)
MAX_DEPTH = 20
KINDS = "None, bools, numbers, text, lists, dicts with text keys and arrays"
# Keys whose values a trainer takes as the host's word: a vector env's checked final observation
# and info (SAME_STEP), and smolbench's own notes (``smolbench_lost``, ``smolbench_error``). An env
# that sent them passed a NaN array for a final observation its space refused, or a fake note.
VECTOR_KEYS = frozenset({"final_obs", "final_info"})
OWN_PREFIX = "smolbench_"


class _Bad(Exception):
    pass


def checked_info(value: Any, where: str) -> dict[str, Any]:
    """``value`` if it is an info the guest could have sent and at most :data:`MAX_INFO` bytes."""
    if type(value) is not dict:
        raise GymError(f"{where} sent an info that is not a dict with string keys")
    try:
        size = _size(value, 0)
    except _Bad as exc:
        raise GymError(f"{where} sent an info {exc}: infos hold {KINDS}") from None
    if size > MAX_INFO:
        raise GymError(f"{where} sent an info of about {size:,} bytes: at most {MAX_INFO:,}")
    for key in value:
        name = key[1:] if key.startswith("_") else key  # (and the masks Gymnasium batches beside them)
        if name in VECTOR_KEYS or name.startswith(OWN_PREFIX):
            whose = "smolbench's own" if name.startswith(OWN_PREFIX) else "the vector env's own (SAME_STEP autoreset)"
            raise GymError(f"{where} sent an info with the key {key!r}, which is {whose}: rename it in the env")
    return value


def _size(value: Any, depth: int) -> int:
    """About the bytes ``value`` takes; :class:`_Bad` for what an info can't hold. Stops
    counting past :data:`MAX_INFO` (the rest is not walked)."""
    if depth > MAX_DEPTH:
        raise _Bad(f"nested more than {MAX_DEPTH} levels deep")
    # counted as JSON spells it, at least: quotes, commas, colons, brackets (an info of
    # 990,000 empty strings counted 0 bytes, and reached clients as 3 MB)
    kind = type(value)
    if kind is str:
        return len(value) + 2
    if value is None or kind is bool or kind is float:
        return 8
    if kind is int:
        return 8 + value.bit_length() // 8
    if kind is dict:
        total = 2
        for k, v in value.items():
            if type(k) is not str:
                key = repr(k)[:40] if k is None or type(k) in (int, float, bool) else f"of type {type(k).__name__}"
                raise _Bad(f"with a key {key}, not text")
            total += len(k) + 4 + _size(v, depth + 1)
            if total > MAX_INFO:
                break
        return total
    if kind is list or kind is tuple:
        total = 2
        for v in value:
            total += 1 + _size(v, depth + 1)
            if total > MAX_INFO:
                break
        return total
    if kind is np.ndarray and not value.dtype.hasobject and value.dtype.names is None:
        return 2 + int(value.nbytes)  # its bytes (in process an image stays an array: 150 KB is 150 KB)
    raise _Bad(f"holding a {kind.__name__}")


# A vector step's infos merged (gymnasium's ``VectorEnv._add_info``): every distinct key of any
# sub-env's info, nested keys counted, becomes two arrays of ``num_envs`` (its values and its
# ``_key`` mask), about 330 bytes a key plus 10 a slot (tracemalloc, gymnasium 1.4). So infos of
# keys that differ per sub-env grow as num_envs**2: 32 sub-envs of 11,000 such keys each (each
# info within MAX_INFO) merged into 620 MB and 2 s a step. The budget is in slots, a key costing
# ``num_envs + KEY_SLOTS``: at MAX_MERGED the merge takes ~20 MiB and 0.1 s whatever num_envs,
# and real infos (a few to a few hundred keys, the same at every sub-env) are far below it: at
# make_vec's most sub-envs (256) it still takes 7,281 distinct keys.
MAX_MERGED = 1 << 21
KEY_SLOTS = 32  # a key's own cost (its name, its mask's, two array headers) in slots


def check_merge(each: list[tuple[int, dict[str, Any]]], num_envs: int, where: Callable[[int], str]) -> None:
    """Refuse, before they are merged, infos whose merged form is past :data:`MAX_MERGED`: one
    line naming the sub-envs that brought the most keys (``where(i)`` names sub-env ``i``).
    Stops growing what it counts at the budget; the walk is the infos' own size."""
    room = MAX_MERGED // (num_envs + KEY_SLOTS)
    seen: dict[str, Any] = {}
    count = [0]
    brought: dict[int, int] = {}
    for i, info in each:
        brought[i] = brought.get(i, 0) + _new_keys(seen, info, count, room)
    if count[0] <= room:
        return
    top = sorted(brought, key=lambda i: -brought[i])
    named = ", ".join(f"{where(i)}: {brought[i]:,}" for i in top[:3])
    more = sum(1 for i in top[3:] if brought[i])
    raise GymError(f"the sub-envs' infos hold more than {room:,} different keys (nested keys counted), too many "
                   f"to batch for {num_envs} sub-envs (keys x (num_envs + {KEY_SLOTS}) <= smolbench.gym.info.MAX_MERGED, "
                   f"{MAX_MERGED:,}); most came from {named}" + (f" and {more} more sub-envs" if more else "")
                   + ": send the same few keys from every sub-env at every step (what varies goes in values, not in "
                   "key names), or use fewer sub-envs")


def _new_keys(seen: dict[str, Any], info: dict[str, Any], count: list[int], room: int) -> int:
    """Keys of ``info`` (nested too, as ``_add_info`` nests them) not yet in ``seen``, which
    takes them while ``count`` is within ``room``."""
    new = 0
    for key, value in info.items():
        sub = seen.get(key)
        if sub is None:
            new += 1
            count[0] += 1
            sub = {}
            if count[0] <= room:
                seen[key] = sub
        if isinstance(value, dict) and key != "final_obs":  # (final_obs: one object array)
            new += _new_keys(sub, value, count, room)
    return new
