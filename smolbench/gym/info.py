"""A step's or reset's info from a machine, checked: the guest sends only data (its
``plain``: None, bools, numbers, text, lists, dicts with text keys, arrays of any dtype but
objects), so anything else the gate could rebuild (sets, tuples as keys, complex numbers
or bytes as values, pandas) came from a rewritten guest and is refused, as is an info past
:data:`MAX_INFO` bytes as JSON would spell it, in one line naming the sub-env (never a raw
exception: the other sub-envs' answers still count).
"""

from __future__ import annotations

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
