"""Every sub-env draws its own random numbers, as gymnasium's own vector envs' do.

A sub-env's machine is a copy of the warm parent, where the env was built: a generator that
existed there (the env's ``np_random`` touched in ``__init__``, one the env keeps itself,
numpy's global state) was copied into every machine unchanged, so every sub-env (and, with
fresh resets, every episode) drew the same numbers. The audit's finding: first observations
``[0.2731 0.2731 0.2731 0.2731]`` where ``SyncVectorEnv`` gives four different ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from gymhelpers import define, needs_bwrap, up_bench

import smolbench.gym as sgym
from smolbench.workbench import Workbench

pytestmark = [needs_bwrap, pytest.mark.timeout(600)]

# The three kinds of generator a branch copies: gymnasium's np_random drawn in __init__, the
# env's own, numpy's global one. The observation is one draw from each; an episode is one step.
STREAMS_ENV = '''
import gymnasium as gym, numpy as np
from gymnasium import spaces as S

class Streams(gym.Env):
    observation_space = S.Box(0, 1, (3,), np.float64)
    action_space = S.Discrete(2)
    def __init__(self):
        self.layout = self.np_random.random()  # a map made at build time: np_random exists now
        self.rng = np.random.default_rng()
    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return np.array([self.np_random.random(), self.rng.random(), np.random.random()]), {}
    def step(self, action):
        return np.zeros(3), 0.0, True, False, {}

def streams():
    return Streams()
'''


@pytest.fixture(scope="module")
def bench(tmp_path_factory: Any) -> Iterator[Workbench]:
    for wb in up_bench(tmp_path_factory):
        define(wb, STREAMS_ENV)
        yield wb


def first_obs(bench: Workbench, reset: str, seed: int | None = None, episodes: int = 3) -> np.ndarray:
    """Each episode's first observation, episode by episode (shape: episodes x sub-envs x 3)."""
    envs = sgym.make_vec("streams", 4, session=bench, reset=reset)
    try:
        out = [envs.reset(seed=seed)[0]]
        for _ in range(episodes - 1):  # each step ends the episode; the next step autoresets it
            envs.step(np.zeros(4, np.int64))
            out.append(envs.step(np.zeros(4, np.int64))[0])
        return np.array(out)
    finally:
        envs.close()


@pytest.mark.parametrize("reset", ["fresh", "in-place"])
def test_sub_envs_reset_without_a_seed_draw_their_own_numbers(bench: Workbench, reset: str) -> None:
    got = first_obs(bench, reset)
    for k, stream in enumerate(["env.np_random", "the env's own rng", "numpy's global"]):
        draws = got[:, :, k]
        assert len(np.unique(draws)) == draws.size, f"{stream} repeats across sub-envs or episodes:\n{draws}"


@pytest.mark.parametrize("reset", ["fresh", "in-place"])
def test_a_seeded_reset_is_gymnasiums_and_replays(bench: Workbench, reset: str) -> None:
    """With a seed, np_random is exactly gymnasium's, and the whole run replays: the env's own
    generator is reseeded from the seed (and, fresh, from the state carried on)."""
    got = first_obs(bench, reset, seed=7)
    want = []
    for i in range(4):  # gymnasium: reset(seed=7 + i), then unseeded resets of the same env
        g = np.random.Generator(np.random.PCG64(np.random.SeedSequence(7 + i)))
        want.append([g.random() for _ in range(3)])
    assert np.array_equal(got[:, :, 0], np.array(want).T)
    assert np.array_equal(first_obs(bench, reset, seed=7)[:, :, :2], got[:, :, :2])  # replays
    own = got[:, :, 1]
    assert len(np.unique(own)) == own.size
