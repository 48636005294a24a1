"""Gymnasium spaces rebuilt from a machine's description, and what crosses them checked.

A machine describes its env's spaces as data (``smolbench/guest/gymserve.py``); the gate
has already rebuilt that data from JSON and ``.npy`` without running code
(``smolbench/gate/pull.py``). Here it becomes real ``gymnasium.spaces`` objects, within
bounds (shapes, sizes, dtypes, nesting), and every observation a machine sends is checked
against them: its structure, shape and dtype exactly, its values within the space, its
size bounded. Anything else is a :class:`Refused` naming what was wrong.
"""

from __future__ import annotations

import base64
import contextlib
import math
from typing import Any

import numpy as np
from gymnasium import spaces as S

MAX_ITEMS = 1 << 24  # items in one Box/MultiDiscrete/MultiBinary (16 Mi: 64 MiB of float32)
MAX_DIMS = 8
MAX_SUBSPACES = 256
MAX_DEPTH = 8
MAX_TEXT = 1 << 20
# One budget for everything an env's two spaces hold here, rebuilt and, under make_vec, batched
# (gymnasium's batch_space tiles every array num_envs times, deep-copies every Text): without it a
# 200-byte description of a Dict of MultiBinary(2**24) took GBs. Costs are estimates, measured
# with tracemalloc on gymnasium 1.4 (see :func:`cost`).
MAX_SPACE_BYTES = 128 << 20
MAX_LEAVES = 4096  # spaces that are not a Dict or Tuple, in both spaces together
NODE_BYTES, NODE_BYTES_BATCHED, NODE_BYTES_PER_ENV = 1024, 2048, 64  # a space object; its batched form, + per sub-env
CHAR_BYTES, CHAR_BYTES_PER_ENV = 192, 64  # a Text's charset (set, list, index: ~180 B/char), its deep copy
TEXT_BYTES_PER_ENV = 4  # per character of a Text's min_length: make_vec's buffer holds a string that long a sub-env
# What one sample() of a space allocates here, per item (tracemalloc, gymnasium 1.4: a Text 111-114 B a
# character, a Box 20-69 B an item by its dtype and bounds, a MultiDiscrete 16 B, a MultiBinary 1 B;
# batched, both a Box): a machine describes the action space the host samples from
# (env.action_space.sample(), the README's own call).
SAMPLE_BYTES = {"Text": 120, "Box": 72, "MultiDiscrete": 32, "MultiBinary": 8}
CHARSET_SAMPLE_BYTES = 32  # and per character of a Text's charset, each sample (its mask, ~20 B)
# One budget for what one sample() of the action space (make_vec's: batched, num_envs of each) costs
# here, counted as those bytes: it bounds the sample's memory (a Text's are taken a leaf at a time, so
# less) and its time (~0.2 s of one core per 128 MiB counted: a Text's 1.1 Mi characters, a Box's 1.9 Mi
# items). Apart from MAX_SPACE_BYTES, which a space holds as long as its env lives: a sample's is
# given back. Without it a Box of 2**24 bytes took 1 GB and 4.9 s a sample, and 4,080 Text(2**20)
# ~27 s. 256 MiB takes an LLM env's Text(8192) actions at make_vec's most sub-envs (256), a Text of
# MAX_TEXT under make(), and 3.7 Mi Box items; real action spaces are far smaller (Discrete, a few
# floats, MultiDiscrete). The observation space is not sampled here, so not counted.
MAX_SAMPLE_BYTES = 256 << 20
TEST_WEAKEN: set[str] = set()  # "obs-check": tests show their attacks get through without the check
DTYPES = {"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
          "uint64", "bool"}


class Refused(ValueError):
    """What a machine sent does not fit its env's spaces (or no space can be built from it)."""


def _mapping(tree: Any, what: str) -> dict[str, Any]:
    if not isinstance(tree, dict):
        raise Refused(f"{what} is a {type(tree).__name__}, not a description")
    return tree


def _int(value: Any, what: str, lo: int = 0, hi: int = 2**62) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= int(value) <= hi:
        raise Refused(f"{what} should be a whole number from {lo} to {hi}, got {str(value)[:60]!r}")
    return int(value)


def _dtype(name: Any, what: str) -> np.dtype[Any]:
    if not isinstance(name, str) or name not in DTYPES:
        raise Refused(f"{what} has dtype {str(name)[:40]!r}: only plain numeric dtypes are accepted")
    return np.dtype(name)


def _array(value: Any, what: str, kind: str = "") -> np.ndarray[Any, Any]:
    if not isinstance(value, np.ndarray) or value.dtype.hasobject or value.dtype.names is not None:
        raise Refused(f"{what} is not a plain numeric array")
    if kind and value.dtype.kind not in kind:
        raise Refused(f"{what} has dtype {value.dtype}")
    if value.ndim > MAX_DIMS or value.size > MAX_ITEMS:
        raise Refused(f"{what} has shape {value.shape}: at most {MAX_DIMS} dimensions and {MAX_ITEMS:,} items")
    return value


def space_from_data(tree: Any, depth: int = 0) -> S.Space[Any]:
    """A Gymnasium space from its description (Box, Discrete, MultiDiscrete, MultiBinary,
    Dict, Tuple, Text), within the bounds above."""
    if depth > MAX_DEPTH:
        raise Refused(f"a space nested more than {MAX_DEPTH} levels deep")
    tree = _mapping(tree, "a space")
    kind = tree.get("type")
    try:
        if kind == "Box":
            dtype = _dtype(tree.get("dtype"), "a Box")
            low = _array(tree.get("low"), "a Box's low", "fiub")
            high = _array(tree.get("high"), "a Box's high", "fiub")
            if low.shape != high.shape:
                raise Refused(f"a Box whose low {low.shape} and high {high.shape} differ in shape")
            if (low.dtype.kind == "f" and np.isnan(low).any()) or (high.dtype.kind == "f" and np.isnan(high).any()):
                raise Refused("a Box with NaN bounds")
            if dtype.kind in "iub" and "f" in (low.dtype.kind, high.dtype.kind):
                # the guest sends an integer Box's bounds in its dtype; cast, ±inf made garbage
                # (int64's even inside gymnasium), with warnings on the host
                raise Refused(f"a Box of {dtype} whose bounds are not integers")
            cast = dtype.kind == "f"  # an integer Box's bounds as sent: gymnasium refuses those outside its dtype
            return S.Box(low=low.astype(dtype, copy=False) if cast else low,
                         high=high.astype(dtype, copy=False) if cast else high,
                         shape=low.shape, dtype=dtype)
        if kind == "Discrete":
            return S.Discrete(_int(tree.get("n"), "a Discrete's n", 1), start=_int(tree.get("start"), "a Discrete's start", -2**62))
        if kind == "MultiDiscrete":
            nvec = _array(tree.get("nvec"), "a MultiDiscrete's nvec", "iu")
            start = _array(tree.get("start"), "a MultiDiscrete's start", "iu")
            if nvec.shape != start.shape or (nvec < 1).any():
                raise Refused("a MultiDiscrete whose nvec is not positive or whose start differs in shape")
            return S.MultiDiscrete(nvec, dtype=_dtype(tree.get("dtype"), "a MultiDiscrete"), start=start)
        if kind == "MultiBinary":
            shape = tree.get("n")
            if not isinstance(shape, list) or not 1 <= len(shape) <= MAX_DIMS:
                raise Refused("a MultiBinary whose n is not a list of dimensions")
            dims = [_int(d, "a MultiBinary dimension", 1, MAX_ITEMS) for d in shape]
            if math.prod(dims) > MAX_ITEMS:
                raise Refused(f"a MultiBinary of {math.prod(dims):,} items: at most {MAX_ITEMS:,}")
            return S.MultiBinary(dims if len(dims) > 1 else dims[0])
        if kind in ("Dict", "Tuple"):
            subs = tree.get("spaces")
            if not isinstance(subs, list) or len(subs) > MAX_SUBSPACES:
                raise Refused(f"a {kind} with more than {MAX_SUBSPACES} subspaces, or none listed")
            if kind == "Tuple":
                return S.Tuple([space_from_data(s, depth + 1) for s in subs])
            pairs = []
            for pair in subs:
                if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str) and len(pair[0]) <= 200):
                    raise Refused("a Dict whose subspaces are not [name, space] pairs")
                pairs.append((pair[0], space_from_data(pair[1], depth + 1)))
            if len({k for k, _ in pairs}) < len(pairs):
                raise Refused("a Dict with a key twice")
            return S.Dict(pairs)  # in the env's order (a dict given to S.Dict is sorted)
        if kind == "Text":
            charset = tree.get("charset")
            if not isinstance(charset, str) or not 0 < len(charset) <= 1 << 16:
                raise Refused("a Text space without a character set (at most 65,536 characters)")
            top = _int(tree.get("max_length"), "a Text's max_length", 0, MAX_TEXT)
            return S.Text(top, min_length=_int(tree.get("min_length"), "a Text's min_length", 0, top), charset=charset)
    except Refused:
        raise
    except Exception as exc:  # gymnasium refusing the values: still one line
        raise Refused(f"a {str(kind)[:20]} space that can't be built ({type(exc).__name__}: {str(exc)[:200]})") from None
    raise Refused(f"a space of unknown type {str(kind)[:40]!r}")


def within_budget(trees: list[Any], num_envs: int = 0) -> None:
    """Refuse, before anything is built, spaces whose rebuilt form (and, with ``num_envs``,
    the batched form make_vec builds) would hold more than :data:`MAX_SPACE_BYTES` here or
    more than :data:`MAX_LEAVES` leaves in all. What is malformed costs nothing here:
    :func:`space_from_data` says what is wrong with it."""
    total, leaves = 0, 0
    for tree in trees:
        cost, n = _cost(tree, num_envs, 0)
        total, leaves = total + cost, leaves + n
    if leaves > MAX_LEAVES:
        raise Refused(f"spaces of {leaves:,} leaves in all: at most {MAX_LEAVES:,} (describe fewer subspaces)")
    if total > MAX_SPACE_BYTES:
        vec = f" and batched for num_envs={num_envs}" if num_envs else ""
        raise Refused(f"spaces that would take about {total / (1 << 20):,.0f} MiB here once rebuilt{vec}: the budget is "
                      f"{MAX_SPACE_BYTES >> 20} MiB for all of an env's spaces (smolbench.gym.spaces.MAX_SPACE_BYTES); "
                      "describe smaller Box/MultiBinary/MultiDiscrete arrays or Text charsets, use fewer sub-envs, or "
                      "(an env you trust) raise that limit")


def _cost(tree: Any, n: int, depth: int) -> tuple[int, int]:
    """Bytes a described space would hold here (itself, and ``n`` batched copies with make_vec's
    observation buffer), and its leaves."""
    if depth > MAX_DEPTH or not isinstance(tree, dict):
        return 0, 0
    kind, node = tree.get("type"), NODE_BYTES + (NODE_BYTES_BATCHED + n * NODE_BYTES_PER_ENV if n else 0)
    if kind in ("Dict", "Tuple"):
        subs = tree.get("spaces")
        if not isinstance(subs, list) or len(subs) > MAX_SUBSPACES:
            return node, 0
        parts = [_cost(s[1] if kind == "Dict" and isinstance(s, list) and len(s) == 2 else s, n, depth + 1) for s in subs]
        return node + sum(c for c, _ in parts), sum(k for _, k in parts)
    if kind == "Text":
        charset, shortest = tree.get("charset"), tree.get("min_length")
        cost = node + (len(charset) * (CHAR_BYTES + n * CHAR_BYTES_PER_ENV) if isinstance(charset, str) else 0)
        if type(shortest) is int and 0 < shortest <= MAX_TEXT:  # past it: space_from_data says so
            cost += n * shortest * TEXT_BYTES_PER_ENV
        return cost, 1
    items, size = 0, 1
    with contextlib.suppress(Exception):
        if kind == "Box":  # low and high in its dtype, bounded_below/above; tiled, and the buffer
            items, size = tree["low"].size, np.dtype(tree["dtype"] if tree["dtype"] in DTYPES else "u1").itemsize
            items = items if items <= MAX_ITEMS else 0  # too many: space_from_data says so
            return node + items * ((2 * size + 2) + n * (3 * size + 2)), 1
        if kind == "MultiDiscrete":  # nvec and start; batched: a Box of its dtype, and the buffer
            items, size = tree["nvec"].size, np.dtype(tree["dtype"] if tree["dtype"] in DTYPES else "u1").itemsize
            items = items if items <= MAX_ITEMS else 0  # too many: space_from_data says so
            return node + items * (2 * size + n * (3 * size + 2)), 1
        if kind == "MultiBinary":  # no arrays itself (its observation: 1 B an item); batched: an int8 Box, the buffer
            dims = tree["n"]
            if isinstance(dims, list) and len(dims) <= MAX_DIMS and all(type(d) is int and d > 0 for d in dims):
                items = math.prod(dims)
            items = items if items <= MAX_ITEMS else 0  # too many: space_from_data says so
            return node + items * (1 + n * 5), 1
    return node, 1


def sample_bytes(space: S.Space[Any], num_envs: int = 0) -> int:
    """About what one ``space.sample()`` allocates here, at most (see :data:`SAMPLE_BYTES`);
    with ``num_envs``, one sample of its batched form (make_vec's ``action_space``: gymnasium's
    ``batch_space`` makes a Text ``num_envs`` Texts, a MultiBinary or MultiDiscrete a Box, a
    Discrete a MultiDiscrete): a Box of 2**24 bytes took ~1 GB and 0.75 s a sample."""
    if isinstance(space, S.Dict):
        return sum(sample_bytes(sub, num_envs) for sub in space.spaces.values())
    if isinstance(space, S.Tuple):
        return sum(sample_bytes(sub, num_envs) for sub in space.spaces)
    k = max(num_envs, 1)
    if isinstance(space, S.Text):
        return k * (2 * NODE_BYTES + space.max_length * SAMPLE_BYTES["Text"]
                    + len(space.character_set) * CHARSET_SAMPLE_BYTES)
    items = math.prod(space.shape) if space.shape else 1
    kind = type(space).__name__
    if num_envs:
        kind = {"MultiBinary": "Box", "MultiDiscrete": "Box", "Discrete": "MultiDiscrete"}.get(kind, kind)
    return NODE_BYTES + k * items * SAMPLE_BYTES.get(kind, 0)


def sampled_within_budget(action_space: S.Space[Any], num_envs: int = 0) -> None:
    """Refuse an action space (with ``num_envs``: batched, as make_vec's) one ``sample()`` of
    which would cost more than :data:`MAX_SAMPLE_BYTES` here (:func:`sample_bytes`): the space
    is the machine's word, and sampling it is what a trainer does first. Run on the rebuilt
    space (its build within :func:`within_budget`), before make_vec batches it."""
    cost = sample_bytes(action_space, num_envs)
    if cost > MAX_SAMPLE_BYTES:
        vec = f", batched for num_envs={num_envs}," if num_envs else ""
        raise Refused(f"an action space one sample() of which{vec} would take about {cost / (1 << 20):,.0f} MiB here "
                      f"(a Text's max_length and charset count, every Box item): the budget is {MAX_SAMPLE_BYTES >> 20} MiB "
                      "(smolbench.gym.spaces.MAX_SAMPLE_BYTES); describe a shorter Text max_length or smaller action "
                      "arrays, use fewer sub-envs, or (an env you trust) raise that limit")


def check(space: S.Space[Any], value: Any, what: str = "the observation") -> Any:
    """``value`` as a member of ``space`` (structure, shape, dtype and range), else :class:`Refused`."""
    if "obs-check" in TEST_WEAKEN:
        return value
    if isinstance(space, S.Dict):
        if not isinstance(value, dict) or set(value) != set(space.spaces):
            raise Refused(f"{what} should be a dict with keys {sorted(space.spaces)}")
        return {k: check(space.spaces[k], value[k], f"{what}[{k!r}]") for k in value}  # in the env's order
    if isinstance(space, S.Tuple):
        if not isinstance(value, tuple) or len(value) != len(space.spaces):
            raise Refused(f"{what} should be a tuple of {len(space.spaces)}")
        return tuple(check(sub, v, f"{what}[{i}]") for i, (sub, v) in enumerate(zip(space.spaces, value)))
    if isinstance(space, S.Text):
        if not isinstance(value, str):
            raise Refused(f"{what} should be text, got {type(value).__name__}")
    elif isinstance(space, S.Discrete):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise Refused(f"{what} should be a whole number, got {type(value).__name__}")
        if not int(space.start) <= int(value) < int(space.start) + int(space.n):  # first: 2**100 is no int64
            raise Refused(f"{what} {str(value)[:40]} is outside its space {space}")
        # kept as the env gave it: a Python int (FrozenLake's) came as JSON, a numpy one with its dtype
    else:  # Box, MultiDiscrete, MultiBinary: an array of exactly the space's shape and dtype
        if not isinstance(value, np.ndarray):
            raise Refused(f"{what} should be an array of shape {space.shape}, got {type(value).__name__}")
        if value.shape != space.shape or value.dtype != space.dtype:
            raise Refused(f"{what} has shape {value.shape} and dtype {value.dtype}; its space wants "
                          f"{space.shape} and {space.dtype}")
    if not space.contains(value):
        raise Refused(f"{what} is outside its space {space}")
    return value


def inside(space: S.Space[Any], values: list[Any]) -> list[bool]:
    """For each value, whether it is an array that :func:`check` would pass for a Box
    ``space`` (its exact shape and dtype, within its bounds), checked for all at once;
    False means only "not known to fit": :func:`check` then says why."""
    if type(space) is not S.Box or "obs-check" in TEST_WEAKEN or len(values) < 2:
        return [False] * len(values)
    rows = [k for k, v in enumerate(values) if type(v) is np.ndarray and v.shape == space.shape and v.dtype == space.dtype]
    out = [False] * len(values)
    if rows:
        try:
            low, high = space.low, space.high
            if low.size and (lo := low.min()) == low.max() and (hi := high.max()) == high.min():
                # bounds the same everywhere (an image's 0..1): each array's least and greatest item
                # against them, no batch or masks (np.min/max carry a NaN, which fits no bound)
                for k in rows:
                    out[k] = bool(values[k].min() >= lo and values[k].max() <= hi)
                return out
            batch = np.stack([values[k] for k in rows])
            fits = np.asarray(((batch >= space.low) & (batch <= space.high)).reshape(len(rows), -1).all(axis=1)).tolist()
        except Exception:  # each is checked on its own (and refused in one line)
            return out
        for k, ok in zip(rows, fits):
            out[k] = bool(ok)
    return out


def to_action(space: S.Space[Any], value: Any, what: str = "action") -> Any:
    """``value`` as an action the machine's env takes, as Gymnasium's envs take it, else
    :class:`Refused` saying why. A Box, MultiDiscrete or MultiBinary takes an array of its
    shape whose dtype casts to its own (float64 to float32: yes; float to int: no), within
    no bounds (Gymnasium checks none: Pendulum clips); it is cast here, as it crosses the
    wire in the space's dtype. Other spaces are checked as ``contains`` checks them."""
    if isinstance(space, S.Dict):
        if not isinstance(value, dict) or value.keys() != space.spaces.keys():
            raise Refused(f"{what} should be a dict with keys {list(space.spaces)}")
        return {k: to_action(sub, value[k], f"{what}[{k!r}]") for k, sub in space.spaces.items()}
    if isinstance(space, S.Tuple):
        value = tuple(value) if isinstance(value, (list, np.ndarray)) else value
        if not isinstance(value, tuple) or len(value) != len(space.spaces):
            raise Refused(f"{what} should be a tuple of {len(space.spaces)}")
        return tuple(to_action(sub, v, f"{what}[{i}]") for i, (sub, v) in enumerate(zip(space.spaces, value)))
    if not isinstance(space, (S.Box, S.MultiDiscrete, S.MultiBinary)):
        if not space.contains(value):
            raise Refused(f"{what} is not in {one_line(space)}" if what != "action" else "")  # (the caller names the space)
        return value
    try:
        arr = np.asarray(value)
    except Exception:  # a ragged list, an object numpy refuses
        raise Refused(f"{what} is not an array") from None
    want = np.dtype(space.dtype)
    if arr.shape != space.shape:
        raise Refused(f"{what} has shape {arr.shape}, not {space.shape}")
    if arr.dtype.kind not in "biuf" or not (np.can_cast(arr.dtype, want, casting="same_kind")
                                            or (arr.dtype.kind in "biu" and want.kind in "iu")):
        raise Refused(f"{what} has dtype {arr.dtype}, which does not cast to {want}")
    if want.kind in "iu" and arr.size and arr.dtype.kind in "iu":  # a cast would wrap them round
        held = np.iinfo(want)
        if arr.min() < held.min or arr.max() > held.max:
            raise Refused(f"{what} has values outside what {want} holds ({held.min} to {held.max})")
    with np.errstate(over="ignore"):  # float64 past float32's range: inf, as the env would clip it
        return arr.astype(want, copy=False)


def one_line(space: S.Space[Any]) -> str:
    """A space as one short line (a Box's bounds print as rows)."""
    return " ".join(str(space).split())[:200]


def action_data(space: S.Space[Any], action: Any) -> Any:
    """An action (already checked against ``space``) in the JSON form the machine decodes."""
    if isinstance(space, S.Dict):
        return {"$": "dict", "v": [[k, action_data(sub, action[k])] for k, sub in space.spaces.items()]}
    if isinstance(space, S.Tuple):
        return {"$": "tuple", "v": [action_data(sub, a) for sub, a in zip(space.spaces, action)]}
    if isinstance(space, S.Text):
        return str(action)
    if isinstance(space, S.Discrete):
        return {"$": "int64", "v": int(action)}
    arr = np.asarray(action, dtype=space.dtype)
    return {"$": "array", "dtype": str(arr.dtype), "shape": list(arr.shape),
            "data": base64.b64encode(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()).decode("ascii")}
