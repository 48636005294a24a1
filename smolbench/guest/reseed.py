"""Reseeding the random streams a branch inherited: each branch draws its own numbers.

Stdlib only, Python 3.8+ (numpy and torch only if a cell imported them). A branch is a copy
of its parent, so a ``random.Random`` or numpy ``Generator`` made before the fork would give
every branch the same draws. The first cell of a branch reseeds every such object reachable
from the namespace, from ``SEED`` and the object's name (``rng``, ``env.np_random``): at top
level, as attributes of top-level objects, and of a Gymnasium-style ``obj.unwrapped``. The
same seed and name give the same stream again (replays match); other names, other streams.
"""

import hashlib
import random
import sys

MAX_OBJECTS = 10000  # namespace entries and attributes looked at, at most (a huge namespace stays quick)


def derived(seed, name):
    """A 64-bit seed from the branch's ``seed`` and an object's ``name`` (stable across runs)."""
    return int.from_bytes(hashlib.sha256(("%s:%s" % (seed, name)).encode()).digest()[:8], "big")


def _seed_random(obj, seed):
    obj.seed(seed)


def _seed_generator(obj, seed):
    bits = obj.bit_generator
    bits.state = type(bits)(seed).state  # in place: every reference to it sees the new stream


def _seed_random_state(obj, seed):
    obj.seed(seed % (2**32))


def _seed_torch(obj, seed):
    obj.manual_seed(seed % (2**63))


def _reseeder(obj):
    """How to reseed ``obj`` if it is a random stream, else None: the one table of kinds."""
    if isinstance(obj, random.Random):
        return None if isinstance(obj, random.SystemRandom) else _seed_random  # SystemRandom: the OS's
    np = sys.modules.get("numpy")
    if np is not None:
        if isinstance(obj, np.random.Generator):
            return _seed_generator
        if isinstance(obj, np.random.RandomState):
            return _seed_random_state
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, getattr(torch, "Generator", ())):
        return _seed_torch
    return None


def _reseed_one(obj, seed):
    """Reseed ``obj`` in place if it is a random stream; True if it was."""
    how = _reseeder(obj)
    if how is None:
        return False
    how(obj, seed)
    return True


def _safely(obj, seed):
    try:
        return _reseed_one(obj, seed)
    except Exception:  # an odd subclass that refuses: left as it is
        return False


def _attrs(obj):
    """(name, value) of an object's own attributes, and of its ``unwrapped`` env's (Gymnasium)."""
    seen = []
    own = getattr(obj, "__dict__", None)
    if isinstance(own, dict):
        seen.append(("", own))
    if getattr(type(obj), "unwrapped", None) is not None:  # a class-level property, not a __getattr__ answer
        try:
            inner = obj.unwrapped
        except Exception:
            inner = None
        inner_dict = getattr(inner, "__dict__", None)
        if inner is not obj and isinstance(inner_dict, dict):
            seen.append(("unwrapped.", inner_dict))
    for prefix, attrs in seen:
        for key, value in list(attrs.items()):
            yield prefix + key, value


def streams_of(obj, name):
    """(name, stream) of the random streams among ``obj``'s attributes and its ``unwrapped``'s,
    named as :func:`reseed` names them when ``obj`` is ``name`` in a namespace."""
    found = []
    for attr, inner in _attrs(obj):
        if len(found) >= MAX_OBJECTS:
            break
        try:
            if _reseeder(inner) is not None:
                found.append((name + "." + attr, inner))
        except Exception:
            continue
    return found


def reseed_streams(found, seed):
    """Reseed each (name, stream) of ``found`` from ``seed`` and its name (as :func:`reseed`)."""
    for name, obj in found:
        _safely(obj, derived(seed, name))


def reseed(ns, seed):
    """Reseed every random stream reachable from namespace ``ns``; the names reseeded, in order."""
    done, ids, looked = [], set(), 0
    for name, value in list(ns.items()):
        if name.startswith("__") or isinstance(value, type) or type(value).__name__ == "module":
            continue
        looked += 1
        if looked > MAX_OBJECTS:
            break
        if id(value) not in ids and _safely(value, derived(seed, name)):
            ids.add(id(value))
            done.append(name)
            continue
        for attr, inner in _attrs(value):
            looked += 1
            if looked > MAX_OBJECTS:
                break
            shown = name + "." + attr.replace("unwrapped._", "").replace("unwrapped.", "").lstrip("_")
            if id(inner) not in ids and _safely(inner, derived(seed, name + "." + attr)):
                ids.add(id(inner))
                done.append(shown)
    return done
