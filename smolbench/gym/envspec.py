"""What a machine says of its env besides its spaces (its spec, render modes and fps), kept
where it is plain data within bounds, and the host's ``env.spec`` and ``metadata`` made from it.

The machine sends them with its spaces (``smolbench/guest/gymserve.py``'s ``build``); like
everything it sends they are untrusted: a field of the wrong type or size is dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gymnasium.envs.registration import EnvSpec

MAX_ID = 200  # characters of a spec's id
MAX_MODES, MAX_MODE = 16, 64  # render modes, and characters of each
MAX_STEPS = 2**62


def described(tree: dict[str, Any]) -> dict[str, Any]:
    """The spec and render fields of a machine's description, checked."""
    modes: Any = tree.get("render_modes")
    fps: Any = tree.get("render_fps")
    spec: Any = tree.get("spec")
    out: dict[str, Any] = {
        "render_modes": [m for m in modes[:MAX_MODES] if isinstance(m, str) and len(m) <= MAX_MODE]
        if isinstance(modes, list) else [],
        "render_fps": fps if _number(fps) and 0 < fps <= 10**6 else None,
        "spec": None, "spec_id": None}
    if isinstance(spec, dict) and isinstance(spec.get("id"), str) and 0 < len(spec["id"]) <= MAX_ID:
        steps, threshold = spec.get("max_episode_steps"), spec.get("reward_threshold")
        out["spec"] = {"id": spec["id"],
                       "max_episode_steps": steps if type(steps) is int and 0 < steps <= MAX_STEPS else None,
                       "reward_threshold": threshold if _number(threshold) else None,
                       "nondeterministic": spec.get("nondeterministic") is True}
        out["spec_id"] = spec["id"]
    return out


def _number(value: Any) -> bool:
    return type(value) in (int, float) and abs(value) <= 2**62  # (NaN and inf: False)


def env_spec(described: dict[str, Any], remake: Callable[..., Any] | None) -> EnvSpec | None:
    """The env's ``EnvSpec`` (None where its machine's env has none, as an env made without
    ``gymnasium.make``). ``remake`` is its entry point: ``gymnasium.make(env.spec)``, and
    ``check_env``'s close check, make another machine-backed env of the same kind; never one
    here, in this process, from a name the machine chose."""
    spec = described.get("spec")
    if spec is None:
        return None
    try:
        return EnvSpec(spec["id"], entry_point=remake, reward_threshold=spec["reward_threshold"],
                       nondeterministic=spec["nondeterministic"], max_episode_steps=spec["max_episode_steps"])
    except Exception:  # an id Gymnasium can't parse
        return None


def metadata(described: dict[str, Any]) -> dict[str, Any]:
    """The env's ``metadata``: its ``render_fps``; ``render_modes`` stays empty, as rendering is
    not supported here (check_env renders, with ``env.spec.make(render_mode=...)``, every mode
    listed, and a listed mode tells wrappers the env can render in it)."""
    out: dict[str, Any] = {"render_modes": []}
    if described.get("render_fps") is not None:
        out["render_fps"] = described["render_fps"]
    return out
