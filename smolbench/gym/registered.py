"""A registered Gymnasium env (an id such as ``CartPole-v1``) as the factory sent into the machine.

The one way ``smolbench.gym.make``/``make_vec`` and ``smolbench serve --gym`` build it:
``gymnasium.make(id, **kwargs)`` run in the machine, by the gymnasium installed there.
"""

from __future__ import annotations

import functools
import re
import weakref
from collections.abc import Callable
from typing import Any

from ..errors import SmolbenchError

# gymnasium's ids, as gymnasium.make parses them: CartPole-v1, ale_py:ALE/Pong-v5 (unversioned: the latest)
ENV_ID = re.compile(r"(?:[A-Za-z0-9_.:-]+/)?[A-Za-z0-9_.:-]+(?:-v\d+)?")
_MADE: weakref.WeakKeyDictionary[Callable[..., Any], str] = weakref.WeakKeyDictionary()  # factory -> its id


def gymnasium_make(env_id: str) -> Callable[..., Any]:
    """The factory ``gymnasium.make(env_id, **kwargs)`` in the machine (cloudpickled by value:
    the machine needs gymnasium, not smolbench); its name in the ledger says so."""
    if not isinstance(env_id, str) or not ENV_ID.fullmatch(env_id):
        raise SmolbenchError(f"{str(env_id)[:100]!r} is not a gymnasium id: give one such as CartPole-v1 "
                             "([NAMESPACE/]NAME-vVERSION)")

    def make_registered(**kwargs: Any) -> Any:  # a nested function: sent by value
        import gymnasium

        return gymnasium.make(env_id, **kwargs)

    make_registered.__qualname__ = make_registered.__name__ = f"gymnasium.make({env_id!r})"  # the ledger's name
    _MADE[make_registered] = env_id
    return make_registered


def env_id_of(env: Any) -> str | None:
    """The gymnasium id ``env`` makes, if it is :func:`gymnasium_make`'s factory (with its
    keyword arguments bound, as ``make`` binds them, or not); else None."""
    if isinstance(env, functools.partial):
        env = env.func
    try:
        return _MADE.get(env)
    except TypeError:  # not weakly referable: not one of ours
        return None
