"""A machine-backed environment served over OpenEnv's protocol (``smolbench serve``).

Built on the OpenEnv package's own server app (``openenv-core``: ``create_fastapi_app``,
its HTTP and WebSocket routes and session handling). The env is built once in a warm
parent machine (``smolbench.gym``); every client session OpenEnv opens gets its own
branch of that parent, and every episode of it a fresh branch (``reset="fresh"``).
Observations reach the client as JSON made from what the gate already checked.
Needs ``pip install 'jupyterlab-smolbench[openenv]'``.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, EnvironmentMetadata, Observation, State
from pydantic import Field

from .errors import SmolbenchError
from .gym.env import _options, check_seed
from .gym.machines import Machines

__all__ = ["GymAction", "GymObservation", "MachineEnvironment", "app_for"]


class GymAction(Action):
    """An action for the machine's env, as JSON (an int for Discrete, nested lists for arrays,
    a dict or list for Dict and Tuple spaces)."""

    action: Any = Field(description="the action, as JSON")


class GymObservation(Observation):
    """What one reset or step gave: the observation as JSON, and Gymnasium's ends and info."""

    observation: Any = Field(default=None, description="the observation, as JSON")
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = Field(default_factory=dict)
    machine: str | None = Field(default=None, description="the smolbench machine this episode runs in")


def to_json(value: Any) -> Any:
    """A checked observation or info as JSON (arrays as nested lists)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value


def from_json(space: Any, value: Any) -> Any:
    """A client's JSON action as a member of ``space``, else a one-line error."""
    from gymnasium import spaces as S

    try:
        if isinstance(space, S.Dict):
            return {k: from_json(sub, value[k]) for k, sub in space.spaces.items()}
        if isinstance(space, S.Tuple):
            return tuple(from_json(sub, v) for sub, v in zip(space.spaces, value))
        if isinstance(space, S.Discrete):
            out: Any = np.int64(value) if isinstance(value, int) and not isinstance(value, bool) else value
        elif isinstance(space, S.Text):
            out = value
        else:
            out = np.asarray(value, dtype=space.dtype)
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        raise SmolbenchError(f"action {str(value)[:80]} does not fit the action space {space} ({exc})") from None
    if not space.contains(out):
        raise SmolbenchError(f"action {str(value)[:80]} is not in the action space {space}")
    return out


class MachineEnvironment(Environment[GymAction, GymObservation, State]):
    """One OpenEnv session: its own branches of the served env's warm parent."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, machines: Machines) -> None:
        super().__init__()
        self._m = machines
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GymObservation:
        """A new episode in a fresh branch of the warm parent (a client's seed, options and
        episode id checked first, as ``smolbench.gym.make``'s reset checks them)."""
        unknown = sorted(set(kwargs) - {"options"})
        if unknown:
            raise SmolbenchError(f"reset takes seed, episode_id and options; {str(unknown[0])[:40]!r} is not one of them")
        if episode_id is not None and (not isinstance(episode_id, str) or len(episode_id) > 255):
            raise SmolbenchError("episode_id should be a string of at most 255 characters")
        seed = check_seed(seed)
        options = _options(kwargs.get("options"))
        obs, info = self._m.host.run(self._m.reset(0, seed, options))
        self._state = State(episode_id=episode_id or uuid.uuid4().hex[:12], step_count=0)
        return GymObservation(observation=to_json(obs), info=to_json(info), done=False, reward=None,
                              machine=self._machine())

    def step(self, action: GymAction, timeout_s: float | None = None, **kwargs: Any) -> GymObservation:
        """One step in the session's machine."""
        act = from_json(self._m.action_space, action.action)
        st = self._m.host.run(self._m.step(0, act), timeout_s)
        self._state.step_count += 1
        return GymObservation(observation=to_json(st.obs), reward=st.reward, done=st.terminated or st.truncated,
                              terminated=st.terminated, truncated=st.truncated, info=to_json(st.info),
                              machine=self._machine())

    @property
    def state(self) -> State:
        """The episode's id and step count."""
        return self._state

    def get_metadata(self) -> EnvironmentMetadata:
        """What the served env is, for OpenEnv's /metadata."""
        return EnvironmentMetadata(name=self._m.described.get("spec_id") or "smolbench machine env",
                                   description=f"observations {self._m.observation_space}, actions {self._m.action_space}; "
                                               "each session in its own branch of a warm smolbench machine",
                                   version="1.0.0")

    def close(self) -> None:
        """Delete this session's machines (the warm parent stays for the next session)."""
        self._m.host.run(self._m.close())

    def _machine(self) -> str | None:
        ref = self._m.eps[0].ref
        return ref.name if ref is not None else None


def app_for(parent: Machines, max_sessions: int = 16) -> Any:
    """OpenEnv's FastAPI app serving ``parent``'s env: one branch of it per client session."""
    from openenv.core.env_server.http_server import create_fastapi_app

    def factory() -> MachineEnvironment:
        m = parent.sibling()
        parent.host.run(m.start_sibling())
        return MachineEnvironment(m)

    return create_fastapi_app(factory, GymAction, GymObservation, max_concurrent_envs=max_sessions)
