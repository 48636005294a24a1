"""A sub-env's answers checked: a reset's observation and info, a step's five values.

Each answer came through the gate as data; here it is checked against the spaces rebuilt
from the env's description (``spaces.py``) and its info bounded (``info.py``). What does
not fit is a :class:`GymError` of one line naming the sub-env.
"""

from __future__ import annotations

import math
from typing import Any

from . import spaces
from .episode import Episode, GymError, Step, _where
from .info import checked_info

STEP_KEYS = {"obs", "reward", "terminated", "truncated", "info"}
STEP_KEYS_RNG = STEP_KEYS | {"rng"}


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
