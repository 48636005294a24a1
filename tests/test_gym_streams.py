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


# A fixed level set on purpose: the env seeds its own generator in __init__ (Gymnasium never
# touches it). Each reset's observation is the next level; an episode is one step.
MAZE_ENV = '''
import gymnasium as gym, numpy as np
from gymnasium import spaces as S

class Maze(gym.Env):
    observation_space = S.Discrete(10**6)
    action_space = S.Discrete(2)
    def __init__(self):
        self.layout_rng = np.random.default_rng(1234)
    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return int(self.layout_rng.integers(10**6)), {}
    def step(self, action):
        return 0, 0.0, True, False, {}

def maze():
    return Maze()
'''


# The same with numpy's legacy RandomState, which older envs keep (``seed()`` methods):
# fresh episodes drew the warm parent's next number every time (it was never carried on).
LEGACY_MAZE_ENV = MAZE_ENV.replace("np.random.default_rng(1234)", "np.random.RandomState(1234)").replace(
    "self.layout_rng.integers(10**6)", "self.layout_rng.randint(10**6)")


def plain_maze(source: str = MAZE_ENV) -> Any:
    ns: dict[str, Any] = {}
    exec(source, ns)
    return ns["maze"]()


@pytest.mark.parametrize("reset", ["fresh", "in-place"])
@pytest.mark.parametrize("source", [MAZE_ENV, LEGACY_MAZE_ENV], ids=["Generator", "RandomState"])
def test_a_generator_the_env_seeded_itself_is_never_reseeded(bench: Workbench, reset: str, source: str) -> None:
    """`self.layout_rng = np.random.default_rng(1234)` drew 979350, 976699, 987940 in a plain
    env and in SyncVectorEnv, but 473429, 580023, 359843 fresh and 473429, 349230, 239361 in
    place: reseeded as if the env had drawn its seed from the OS. Now it draws what it does
    in Gymnasium: its own stream, carried from one fresh episode's machine to the next."""
    from gymnasium.vector import SyncVectorEnv

    define(bench, source)
    local = plain_maze(source)
    want = [local.reset(seed=s)[0] for s in (1, 2, 3)]
    env = sgym.make("maze", session=bench, reset=reset)
    try:
        got = []
        for s in (1, 2, 3):
            got.append(env.reset(seed=s)[0])
            env.step(0)
        got.append(env.reset()[0])  # unseeded: the stream goes on
    finally:
        env.close()
    assert got == want + [local.reset()[0]]

    theirs = SyncVectorEnv([lambda: plain_maze(source)] * 2)
    envs = sgym.make_vec("maze", 2, session=bench, reset=reset)
    try:
        ours_seen, theirs_seen = [envs.reset(seed=5)[0].tolist()], [theirs.reset(seed=5)[0].tolist()]
        for _ in range(4):  # an ending step, then its autoreset
            ours_seen.append(envs.step(np.zeros(2, np.int64))[0].tolist())
            theirs_seen.append(theirs.step(np.zeros(2, np.int64))[0].tolist())
    finally:
        envs.close()
    assert ours_seen == theirs_seen


def test_reseed_false_leaves_the_envs_own_generators_alone(bench: Workbench) -> None:
    """`reseed=False`: an entropy-seeded generator the env keeps is left as the warm parent
    made it, so every sub-env draws the same (np_random is still each sub-env's own)."""
    envs = sgym.make_vec("streams", 3, session=bench, reset="in-place", reseed=False)
    try:
        obs = envs.reset()[0]
    finally:
        envs.close()
    assert len(set(obs[:, 1].tolist())) == 1, obs
    assert len(set(obs[:, 0].tolist())) == 3, obs


# random.Random can't say how it was seeded: a sub-env's first episode reseeds it (its own
# numbers); from then on fresh episodes carry it on, as one long-lived env's would. The info
# says where the Mersenne Twister is in its 624 words: one word further each draw when it is
# carried on, back at the start of a new seed's when reseeded (as every fresh episode did).
# getrandbits(19) takes one word; randrange(10**6) took two when it rejected a draw (1 in 21).
RANDOM_ENV = MAZE_ENV.replace("import gymnasium as gym, numpy as np", "import gymnasium as gym, numpy as np, random").replace(
    "np.random.default_rng(1234)", "random.Random(1234)").replace(
    "return int(self.layout_rng.integers(10**6)), {}",
    "return int(self.layout_rng.getrandbits(19)), {'pos': self.layout_rng.getstate()[1][-1]}")


def test_fresh_episodes_carry_a_random_random_on(bench: Workbench) -> None:
    define(bench, RANDOM_ENV)
    env = sgym.make("maze", session=bench, reset="fresh")
    try:
        seen = []
        for _ in range(5):
            obs, info = env.reset()
            seen.append((obs, info["pos"]))
            env.step(0)
    finally:
        env.close()
    assert len({obs for obs, _ in seen}) == 5
    first = seen[0][1]
    assert [pos for _, pos in seen] == [first + k for k in range(5)], seen
