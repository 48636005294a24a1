"""``smolbench.gym.make``: one Gymnasium env whose every step runs in a machine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium

from ..errors import SmolbenchError
from . import envspec, spaces
from .episode import GymError, Later, Step, _where
from .machines import Machines


class MachineEnv(gymnasium.Env[Any, Any]):
    """A ``gymnasium.Env`` backed by a machine (see :func:`smolbench.gym.make`).

    Its spaces are rebuilt from the machine's description; every observation is checked
    against them. ``reset()`` runs in a fresh branch of the warm parent (``reset="fresh"``)
    or in the same machine (``"in-place"``). ``close()`` deletes its machines. ``spec`` and
    ``metadata["render_fps"]`` are the machine's env's (``gymnasium.make(env.spec)`` makes
    another env like it); it does not render.
    """

    def __init__(self, machines: Machines, remake: Callable[..., Any] | None = None) -> None:
        self._m = machines
        self.observation_space = machines.observation_space
        self.action_space = machines.action_space
        self.metadata = {**envspec.metadata(machines.described), "smolbench_reset": machines.mode}
        self.spec = envspec.env_spec(machines.described, remake)
        self.render_mode = None

    def __getstate__(self) -> Any:  # Ray sends a task's arguments and results pickled
        raise TypeError("a smolbench gym env can't be pickled: its machines live in this process; send its id (or "
                        "env.spec) and call smolbench.gym.make inside the task, then close() it there")

    @property
    def machine(self) -> str | None:
        """The machine the current episode runs in."""
        ref = self._m.eps[0].ref
        return ref.name if ref is not None else None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        """Start an episode (in a new branch of the warm parent, with ``reset="fresh"``)."""
        seed = check_seed(seed)
        super().reset(seed=seed)  # the host's own np_random (samplers); the machine's env is seeded there
        self._open()
        opts = _options(options)
        got = self._m.reset_now(0, seed, opts)  # on this thread where it can: no hop to the loop
        return got if got is not None else self._m.host.run(self._m.reset(0, seed, opts))

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        """One step in the machine; the action is checked against the action space first."""
        self._open()
        action = checked_action(self.action_space, action, _where(0, 1, self._m.eps[0]), "nothing was sent")
        now = self._m.steps_now([0], [action])  # on this thread: no hop to the loop
        if now is None:
            st = self._m.host.run(self._m.step(0, action))
        else:
            if isinstance(now[0], Later):  # the episode ended (or failed): here, unless it needs the loop
                done = self._m.finish_now([0], now)
                now = done if done is not None else self._m.host.run(self._m.finish([0], now))
            out = now[0]
            if isinstance(out, BaseException):
                raise out
            assert isinstance(out, Step)
            st = out
        return st.obs, st.reward, st.terminated, st.truncated, st.info

    def render(self) -> None:
        """Not supported: one line saying so."""
        raise NoRender(NO_RENDER)

    def close(self) -> None:
        """Delete this env's machines (and its session, if it made its own)."""
        self._m.shutdown()

    def _open(self) -> None:
        if self._m.closed:
            raise GymError("the env is closed: make a new one with smolbench.gym.make(...)")


def checked_action(space: Any, action: Any, where: str, after: str) -> Any:
    """``action`` as the machine's env gets it (see :func:`spaces.to_action`), else one line."""
    try:
        return spaces.to_action(space, action)
    except spaces.Refused as exc:
        why = f" ({exc})" if str(exc) else ""
        raise GymError(f"{where}: action {' '.join(str(action).split())[:80]} is not in the action space "
                       f"{spaces.one_line(space)}{why}: {after}") from None


class NoRender(GymError, NotImplementedError):
    """``render()``, which a machine-backed env does not do (Gymnasium's default raises NotImplementedError)."""


NO_RENDER = ("render() is not supported: the env runs in a machine that sends back only data; put frames in "
             "the observation or the info instead")


MAX_SEED = 2**63 - 1  # what a ledger row (SQLite INTEGER) and numpy's seeding both take


def check_seed(seed: Any) -> int | None:
    """A reset's seed: a whole number from 0 to 2**63-1, or None; else a one-line error."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise GymError(f"seed should be a whole number or None, got {type(seed).__name__} {_shown(seed)}")
    if not 0 <= seed <= MAX_SEED:
        raise GymError(f"seed should be a whole number from 0 to 2**63-1, got {str(seed)[:40]}")
    return seed


def _shown(value: Any) -> str:
    """A client's value in a line: quoted as Python writes it (a string '1' is not the number 1), cut at 40."""
    try:
        said = repr(value)
    except Exception:
        said = f"<{type(value).__name__}>"
    return said if len(said) <= 40 else said[:39] + "…"


def _options(options: Any) -> dict[str, Any] | None:
    """Reset options travel as JSON: plain data only."""
    if options is None:
        return None
    import json

    try:
        json.dumps(options, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise SmolbenchError(f"reset options must be plain JSON data (they go to the machine as JSON): {exc}") from None
    if not isinstance(options, dict):
        raise SmolbenchError(f"reset options should be a dict, got {type(options).__name__}")
    return options


__all__ = ["GymError", "MachineEnv", "NoRender", "check_seed", "checked_action", "spaces"]
