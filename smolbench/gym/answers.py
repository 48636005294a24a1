"""A sub-env's answers checked: a reset's observation and info, a step's five values.

Each answer came through the gate as data; here it is checked against the spaces rebuilt
from the env's description (``spaces.py``) and its info bounded (``info.py``). What does
not fit is a :class:`GymError` of one line naming the sub-env. Before that, the gate holds
each answer to what the largest valid one takes on the wire (:func:`wire_bound`): a vector
step waits for every sub-env's answer, so an answer far bigger than its spaces allow (the
audit: 46 MB each for a Box(4,)) was decoded and held until the last sub-env answered.
"""

from __future__ import annotations

import math
from typing import Any

from gymnasium import spaces as S

from ..gate.frames import Bound
from . import spaces
from .episode import Episode, GymError, Step, _where
from .info import MAX_INFO, checked_info

STEP_KEYS = {"obs", "reward", "terminated", "truncated", "info"}
STEP_KEYS_RNG = STEP_KEYS | {"rng"}
# What an info within MAX_INFO (bytes as JSON would spell it) takes as the guest sends it, at most:
# text escaped as JSON (an astral character is 12 bytes), a dict's pairs tagged as pulled data
# ({"$":"dict","v":[[k, v], ...]}), a number as it prints (a float counted 8, written up to 24), an
# array as its .npy in base64 (its data and ~190 bytes; only an info of tens of thousands of arrays
# of a few bytes each takes more, and is refused). Its JSON values: at most one per byte counted.
INFO_WIRE = 16 * MAX_INFO
# The rest of an answer: its envelope, a step's reward and flags, the env's random states when an
# episode ends (np_random's and up to 16 the env keeps itself, ~8 KB each as a Mersenne Twister's,
# JSON in JSON), a practice episode's page list (20,480 runs at most, ~0.5 MB as pulled data), an
# env's error (its message cut to 2,000 characters, 100 frames of its traceback).
REST_WIRE, REST_ITEMS = 1 << 20, 1024
NPY_HEAD = 256  # an array's .npy header: at most 8 dimensions (spaces.MAX_DIMS), under 200 bytes padded to 64


def reset_answer(out: Any, space: Any, where: str) -> tuple[Any, dict[str, Any]]:
    """``out`` checked as a reset's answer: its observation in ``space``, and its info."""
    if not isinstance(out, dict) or set(out) - {"obs", "info"}:
        raise GymError(f"{where} answered a reset with something other than an observation and an info")
    return observation(space, out.get("obs"), where), checked_info(out.get("info"), where)


def step_answer(out: Any, space: Any, ep: Episode, n: int, fit: bool = False) -> Step:
    """``out`` checked as sub-env ``ep``'s step (of ``n``; ``fit``: its observation was found to
    fit ``space``); its line names the sub-env (made only for an error: this runs for every step)."""
    if not isinstance(out, dict) or (out.keys() != STEP_KEYS and out.keys() != STEP_KEYS_RNG):
        raise GymError(f"{_where(ep.index, n, ep)} answered a step with something other than (obs, reward, "
                       "terminated, truncated, info)")
    reward = out["reward"]
    # abs() first: an integer past a float's range is refused, not an OverflowError in isfinite
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or abs(reward) > 1e300 \
            or not math.isfinite(reward):
        raise GymError(f"{_where(ep.index, n, ep)} sent a reward of {str(reward)[:40]}: rewards must be finite numbers")
    terminated, truncated, info = out["terminated"], out["truncated"], out["info"]
    if type(terminated) is not bool or type(truncated) is not bool:
        key = "terminated" if type(terminated) is not bool else "truncated"
        raise GymError(f"{_where(ep.index, n, ep)} sent {key} = {str(out[key])[:40]}, not True or False")
    obs = out["obs"] if fit else observation(space, out["obs"], _where(ep.index, n, ep))
    if type(info) is not dict or info:  # an empty dict is an info as it is
        info = checked_info(info, _where(ep.index, n, ep))
    if type(reward) is int and abs(reward) > 2**53:  # past a float64's exact ints: np.array(rewards) of objects
        reward = float(reward)
    return Step(obs, reward, terminated, truncated, info)  # an int stays one (the env's own: Taxi's)


def observation(space: Any, value: Any, where: str) -> Any:
    """``value`` checked as an observation in ``space``."""
    try:
        return spaces.check(space, value)
    except spaces.Refused as exc:
        raise GymError(f"{where} sent an observation that does not fit: {exc}") from None


def wire_bound(space: Any) -> Bound:
    """What one answer of an env whose observation space is ``space`` may take on the wire (bytes,
    JSON values): its largest observation as the guest sends it, an info of :data:`INFO_WIRE`, and
    the rest; every valid reset, step, random state, page list and error fits within it."""
    size, items = _wire(space)
    return Bound(size + INFO_WIRE + REST_WIRE, items + MAX_INFO + REST_ITEMS,
                 f"this env's answers take at most that (an observation in its space, an info of at most "
                 f"{MAX_INFO:,} bytes as JSON, and a step's other fields)")


def _wire(space: Any) -> tuple[int, int]:
    """Bytes and JSON values the largest observation of ``space`` takes as the guest sends it, at
    most: an array (and a Discrete's numpy scalar) as .npy in base64, text as JSON writes it or as
    a numpy string's .npy (4 bytes a character); a Dict's or Tuple's parts tagged as pulled data."""
    if isinstance(space, S.Dict):
        parts = [_wire(sub) for sub in space.spaces.values()]
        keys = sum(12 * len(key) + 8 for key in space.spaces)  # ["key", value],
        return 32 + keys + sum(b for b, _ in parts), 4 + sum(3 + k for _, k in parts)
    if isinstance(space, S.Tuple):
        parts = [_wire(sub) for sub in space.spaces]
        return 32 + sum(b + 2 for b, _ in parts), 4 + sum(1 + k for _, k in parts)
    if isinstance(space, S.Text):
        longest = space.max_length
        return 32 + max(2 + _escaped(space.character_set) * longest, _b64(NPY_HEAD + 4 * longest)), 4
    if isinstance(space, S.Discrete):
        return 32 + _b64(NPY_HEAD + 16), 4
    return 32 + _b64(NPY_HEAD + math.prod(space.shape) * space.dtype.itemsize), 4  # (a Box's exact dtype and shape)


def _b64(n: int) -> int:
    return 4 * ((n + 2) // 3)


def _escaped(chars: Any) -> int:
    """Bytes JSON (ASCII only, as the guest writes it) takes for the widest character of ``chars``."""
    codes = [ord(c) for c in chars]
    if max(codes) > 0xFFFF:
        return 12  # a surrogate pair of \\u escapes
    if max(codes) > 0x7E or min(codes) < 0x20:
        return 6
    return 2 if '"' in chars or "\\" in chars else 1
