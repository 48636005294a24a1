"""smolbench.gym against plain Gymnasium: what an env and a vector env take and give back.

Continuous actions are taken as Gymnasium's envs take them (a float64 action for a float32
Box, values outside its bounds: Pendulum clips them), in the action space's dtype; a wrong
shape or a float for an integer space is still one line. Spaces keep the env's own order (a
Dict's keys, a Text's characters): observations, batches, flattening and sampling match. An
env's spec and render fps are its machine's env's (checked as data); it does not render.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import gymnasium
import numpy as np
import pytest
from gymhelpers import CARTPOLE, define, needs_bwrap, up_bench
from gymnasium.vector import SyncVectorEnv
from gymnasium.wrappers import ClipAction, FlattenObservation, RecordEpisodeStatistics, TimeLimit

import smolbench.gym as sgym
from smolbench import SmolbenchError
from smolbench.gym import envspec
from smolbench.workbench import Workbench

pytestmark = [needs_bwrap, pytest.mark.filterwarnings("ignore::UserWarning")]

PENDULUM = functools.partial(gymnasium.make, "Pendulum-v1")
# float64 actions, and float32 ones outside the Box's [-2, 2] (Pendulum clips them)
ACTIONS = [np.array([0.5]), np.array([-1.3]), np.array([3.0], np.float32), np.array([-7.5], np.float32),
           np.array([0.1]), np.array([9.0])]
# An env whose action space holds integers (a float action is refused, as Box.contains did)
COUNTER = '''
import numpy as np, gymnasium as gym
from gymnasium import spaces as S

class Counter(gym.Env):
    observation_space = S.Box(-100, 100, (2,), np.int64)
    action_space = S.MultiDiscrete([3, 4])

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.at = np.zeros(2, np.int64)
        return self.at.copy(), {}

    def step(self, action):
        self.at += np.asarray(action, np.int64)
        return self.at.copy(), float(self.at.sum()), False, False, {}

def counter():
    return Counter()
'''

# Spaces in an order of their own: Dicts built from pairs not in sorted order, Texts whose
# characters are not sorted. Defined here too, for plain Gymnasium.
ORDERED = '''
import numpy as np, gymnasium as gym
from gymnasium import spaces as S

class Ordered(gym.Env):
    metadata = {"render_modes": None, "render_fps": np.int64(24)}  # as some envs have them

    def __init__(self):
        self.observation_space = S.Dict([("zeta", S.Box(-1, 1, (2,), np.float32)), ("alpha", S.Discrete(3)),
                                         ("mid", S.Text(6, charset="zyxcba"))])
        self.action_space = S.Dict([("move", S.MultiDiscrete([3, 4])), ("say", S.Text(4, charset="zyxcba"))])

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self._obs(), {}

    def step(self, action):
        return self._obs(), float(action["move"].sum() + len(action["say"])), False, False, {}

    def _obs(self):
        rng = self.np_random
        return {"zeta": rng.uniform(-1, 1, 2).astype(np.float32), "alpha": int(rng.integers(3)),
                "mid": "".join(rng.choice(list("zyxcba"), 5))}

def ordered():
    return Ordered()
'''
HERE: dict[str, Any] = {}
exec(ORDERED, HERE)


@pytest.fixture(scope="module")
def bench(tmp_path_factory: Any) -> Iterator[Workbench]:
    yield from up_bench(tmp_path_factory)


def one_line(exc: BaseException, says: str) -> None:
    assert says in str(exc) and "\n" not in str(exc), str(exc)


def test_continuous_actions_are_taken_as_gymnasium_takes_them(bench: Workbench) -> None:
    """A float64 action and one outside the bounds were refused ("is not in the action
    space"), through ClipAction too. They reach the machine's env in the Box's dtype: its
    steps are exactly Gymnasium's given float32, and within float32's precision of
    Gymnasium's given the float64 itself."""
    ours, clipped = sgym.make(PENDULUM, session=bench), ClipAction(sgym.make(PENDULUM, session=bench))
    exact, plain, plain_clipped = PENDULUM(), PENDULUM(), ClipAction(PENDULUM())
    try:
        for env in (ours, clipped, exact, plain, plain_clipped):
            env.reset(seed=3)
        for a in ACTIONS:
            got, want, near = ours.step(a), exact.step(a.astype(np.float32)), plain.step(a)
            assert np.array_equal(got[0], want[0]) and got[1:4] == want[1:4]
            assert got[1] == pytest.approx(near[1], rel=1e-5, abs=1e-6)
            assert clipped.step(a)[1] == pytest.approx(plain_clipped.step(a)[1], rel=1e-5, abs=1e-6)
        with pytest.raises(SmolbenchError) as wrong_shape:
            ours.step(np.array([0.5, 0.5]))
        one_line(wrong_shape.value, "is not in the action space")
        assert ours.step(np.array([0.5]))[1] == exact.step(np.array([0.5], np.float32))[1]  # nothing was sent
    finally:
        for env in (ours, clipped, exact, plain, plain_clipped):
            env.close()


def test_a_vector_env_takes_a_batch_of_continuous_actions_as_sync_vector_env(bench: Workbench) -> None:
    """Out-of-bound float32 actions were refused for the whole batch."""
    ours, theirs = sgym.make_vec(PENDULUM, 2, session=bench, reset="in-place"), SyncVectorEnv([PENDULUM] * 2)
    try:
        ours.reset(seed=5)
        theirs.reset(seed=5)
        for a in ACTIONS:
            batch = np.stack([a, -a])
            got, want = ours.step(batch), theirs.step(batch.astype(np.float32))
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    finally:
        ours.close()
        theirs.close()


def test_a_float_action_for_an_integer_space_is_still_one_line(bench: Workbench) -> None:
    define(bench, COUNTER)
    env = sgym.make("counter", session=bench, reset="in-place")
    try:
        env.reset(seed=0)
        with pytest.raises(SmolbenchError) as refused:
            env.step(np.array([1.0, 2.0]))
        one_line(refused.value, "is not in the action space")
        assert env.step([1, 2])[1] == 3.0 and env.step(np.array([5, 0], np.int8))[1] == 8.0  # outside nvec: as gymnasium
    finally:
        env.close()


def same(got: Any, want: Any) -> bool:
    """Equal, and of the same types all the way down (a tuple's items too)."""
    if isinstance(want, tuple):
        return type(got) is tuple and len(got) == len(want) and all(map(same, got, want))
    if isinstance(want, np.ndarray):
        return type(got) is np.ndarray and got.dtype == want.dtype and np.array_equal(got, want)
    return type(got) is type(want) and got == want


@pytest.mark.parametrize("env_id", ["FrozenLake-v1", "Taxi-v4", "Blackjack-v1"])
def test_discrete_observations_and_rewards_come_back_as_the_env_gives_them(bench: Workbench, env_id: str) -> None:
    """FrozenLake's and Taxi's observations are Python ints, Blackjack's a tuple of them; Taxi's
    rewards are ints. They came back as np.int64 and floats."""
    ours, theirs = sgym.make(functools.partial(gymnasium.make, env_id), session=bench), gymnasium.make(env_id)
    pick = np.random.default_rng(0)
    try:
        for seed in range(3):
            got, want = ours.reset(seed=seed), theirs.reset(seed=seed)
            assert same(got[0], want[0]), (got[0], want[0])
            for _ in range(40):
                action = int(pick.integers(theirs.action_space.n))
                got, want = ours.step(action), theirs.step(action)
                assert all(same(g, w) for g, w in zip(got[:4], want[:4])), (got[:4], want[:4])
                if want[2] or want[3]:
                    break
    finally:
        ours.close()
        theirs.close()


NUMPY_INTS = '''
import numpy as np, gymnasium as gym
from gymnasium import spaces as S

class NumpyInts(gym.Env):
    observation_space = S.Tuple((S.Discrete(5), S.Discrete(5)))
    action_space = S.Discrete(2)
    def reset(self, seed=None, options=None):
        return (np.int32(1), np.int64(2)), {}
    def step(self, action):
        return (np.int32(3), 4), np.float64(0.5), False, False, {}

def numpy_ints():
    return NumpyInts()

class BigRewards(gym.Env):
    observation_space = S.Discrete(2)
    action_space = S.Discrete(2)
    def reset(self, seed=None, options=None):
        return 0, {}
    def step(self, action):
        return 0, (2**64 if action else -(2**53)), False, False, {}

def big_rewards():
    return BigRewards()
'''


def test_numpy_discrete_observations_keep_their_dtype_and_a_numpy_reward_is_a_float(bench: Workbench) -> None:
    define(bench, NUMPY_INTS)
    env = sgym.make("numpy_ints", session=bench, reset="in-place")
    try:
        assert same(env.reset(seed=0)[0], (np.int32(1), np.int64(2)))
        obs, reward, *_ = env.step(0)
        assert same(obs, (np.int32(3), 4)) and same(reward, 0.5)  # np.float64's value, as a float (README)
    finally:
        env.close()


def test_an_int_reward_past_a_floats_exact_range_is_a_float(bench: Workbench) -> None:
    """A machine's int reward is kept as an int only where a float64 holds it exactly: 2**64 came
    back as a Python int, which made a user's np.array of rewards an object array (and int64 fail)."""
    define(bench, NUMPY_INTS)
    env = sgym.make("big_rewards", session=bench, reset="in-place")
    try:
        env.reset(seed=0)
        big, edge = env.step(1)[1], env.step(0)[1]
        assert same(big, float(2**64)) and np.array([big]).dtype == np.float64
        assert same(edge, -(2**53))  # within it: the env's own int
    finally:
        env.close()


def test_a_gymnasium_id_is_made_in_the_machine_as_gymnasium_makes_it(bench: Workbench) -> None:
    """A new user's first try, `make("CartPole-v1")`, was refused as "not a Python name" (while
    `smolbench serve --gym CartPole-v1` served it); keyword arguments go to gymnasium.make."""
    ours, theirs = sgym.make("CartPole-v1", session=bench, max_episode_steps=5), gymnasium.make("CartPole-v1",
                                                                                              max_episode_steps=5)
    vec, their_vec = sgym.make_vec("CartPole-v1", 2, session=bench), SyncVectorEnv([lambda: gymnasium.make("CartPole-v1")] * 2)
    try:
        assert np.array_equal(ours.reset(seed=4)[0], theirs.reset(seed=4)[0])
        for _ in range(5):
            assert all(np.array_equal(a, b) for a, b in zip(ours.step(0)[:4], theirs.step(0)[:4]))
        assert ours.spec is not None and ours.spec.id == "CartPole-v1" and ours.spec.max_episode_steps == 5
        assert np.array_equal(vec.reset(seed=[1, 2])[0], their_vec.reset(seed=[1, 2])[0])
        assert all(np.array_equal(a, b) for a, b in zip(vec.step(np.array([0, 1]))[:4], their_vec.step(np.array([0, 1]))[:4]))
        with pytest.raises(SmolbenchError, match="a gymnasium id"):
            sgym.make("Cart Pole", session=bench)
    finally:
        for env in (ours, theirs, vec, their_vec):
            env.close()


def test_a_mistyped_env_name_or_id_is_one_line_with_the_closest_one_the_machine_knows(bench: Workbench) -> None:
    """make("CartPol") said only the machine's "NameError: name 'CartPol' is not defined", and
    make("CartPol-v1") gymnasium's NameNotFound, whose "Did you mean: `CartPole`?" make takes
    for a name defined in the machine: now one line with the fix, from the names defined in
    the machine and its gymnasium's ids."""
    define(bench, "def cartpole_env():\n    import gymnasium\n    return gymnasium.make('CartPole-v1')\n")
    before = set(bench.machines)
    for asked, fix in (("CartPol", "CartPole-v1"), ("cartpole_ev", "cartpole_env"), ("CartPol-v1", "CartPole-v1"),
                       ("CartPole-v9", "CartPole-v1"), ("Acrobot", "Acrobot-v1")):
        with pytest.raises(SmolbenchError) as got:
            sgym.make(asked, session=bench)
        line = str(got.value)
        assert "\n" not in line and repr(asked) in line and line.endswith(f"did you mean {fix!r}?"), line
    with pytest.raises(SmolbenchError, match=r"did you mean 'CartPole-v1'\?$"):
        sgym.make_vec("cartpole-v1", 2, session=bench)
    with pytest.raises(SmolbenchError, match=r"has no env 'Zzzz-v0': give one registered there"):
        sgym.make("Zzzz-v0", session=bench)  # nothing close: how to name one
    assert set(bench.machines) == before


def test_spaces_keep_the_envs_own_order(bench: Workbench) -> None:
    """A Dict came back with its keys sorted and a Text with its characters sorted: the
    observations' keys, FlattenObservation's layout and a seeded sample() all differed."""
    define(bench, ORDERED)
    ours, theirs = sgym.make("ordered", session=bench), HERE["ordered"]()
    flat, their_flat = FlattenObservation(sgym.make("ordered", session=bench)), FlattenObservation(HERE["ordered"]())
    try:
        for a, b in ((ours.observation_space, theirs.observation_space), (ours.action_space, theirs.action_space)):
            assert list(a.spaces) == list(b.spaces) and a == b
        assert ours.observation_space["mid"].character_list == tuple("zyxcba")
        obs, their_obs = ours.reset(seed=2)[0], theirs.reset(seed=2)[0]
        assert list(obs) == list(their_obs) and obs["mid"] == their_obs["mid"]
        assert np.array_equal(flat.reset(seed=2)[0], their_flat.reset(seed=2)[0])
        ours.action_space.seed(0)
        theirs.action_space.seed(0)
        for _ in range(3):
            act, their_act = ours.action_space.sample(), theirs.action_space.sample()
            assert list(act) == list(their_act) and act["say"] == their_act["say"]
            assert np.array_equal(act["move"], their_act["move"])
            assert list(ours.step(act)[0]) == list(theirs.step(their_act)[0])
    finally:
        for env in (ours, theirs, flat, their_flat):
            env.close()


def test_a_vector_envs_batches_keep_the_envs_own_order(bench: Workbench) -> None:
    define(bench, ORDERED)
    ours, theirs = sgym.make_vec("ordered", 2, session=bench), SyncVectorEnv([HERE["ordered"]] * 2)
    try:
        assert list(ours.observation_space.spaces) == list(theirs.observation_space.spaces)
        obs, their_obs = ours.reset(seed=4)[0], theirs.reset(seed=4)[0]
        assert list(obs) == list(their_obs) and obs["mid"] == their_obs["mid"]
    finally:
        ours.close()
        theirs.close()


def spec_fields(spec: Any) -> tuple[Any, ...]:
    return (spec.id, spec.max_episode_steps, spec.reward_threshold, spec.nondeterministic,
            [w.name for w in spec.additional_wrappers])


def test_an_envs_spec_and_metadata_are_its_machines_envs(bench: Workbench) -> None:
    """env.spec was None and metadata had no render_fps: wrappers that read the spec had none
    to read, gymnasium.make(env.spec) nothing to make. Rendering stays unsupported."""
    ours, theirs = sgym.make(CARTPOLE, session=bench, reset="in-place"), CARTPOLE()
    short, their_short = RecordEpisodeStatistics(TimeLimit(ours, 3)), RecordEpisodeStatistics(TimeLimit(theirs, 3))
    again = None
    try:
        assert spec_fields(ours.spec) == spec_fields(theirs.spec) and ours.spec.max_episode_steps == 500
        assert spec_fields(short.spec) == spec_fields(their_short.spec) and short.spec.max_episode_steps == 3
        assert ours.metadata["render_fps"] == theirs.metadata["render_fps"] == 50
        assert short.reset(seed=0)[0].shape == (4,) and [short.step(0)[3] for _ in range(3)] == [False, False, True]
        again = gymnasium.make(ours.spec)  # another machine-backed CartPole, as the spec says
        assert np.array_equal(again.reset(seed=9)[0], theirs.reset(seed=9)[0]) and again.unwrapped is not ours
        assert ours.render_mode is None and ours.metadata["render_modes"] == []
        with pytest.raises(SmolbenchError) as no_render:
            ours.render()
        one_line(no_render.value, "render() is not supported")
    finally:
        for env in (short, their_short, *((again,) if again is not None else ())):
            env.close()


def test_a_vector_envs_spec_and_metadata_are_its_sub_envs(bench: Workbench) -> None:
    ours, theirs = sgym.make_vec(CARTPOLE, 2, session=bench), gymnasium.make_vec("CartPole-v1", 2)
    try:
        assert (ours.spec.id, ours.spec.max_episode_steps) == (theirs.spec.id, theirs.spec.max_episode_steps)
        assert ours.metadata["render_fps"] == theirs.metadata["render_fps"] and "CartPole-v1" in str(ours)
        with pytest.raises(SmolbenchError) as no_render:
            ours.render()
        one_line(no_render.value, "render() is not supported")
    finally:
        ours.close()
        theirs.close()


def test_an_env_without_a_spec_has_none_as_in_gymnasium(bench: Workbench) -> None:
    """An env whose render_modes were None could not be made at all."""
    define(bench, ORDERED)
    env = sgym.make("ordered", session=bench)
    try:
        assert env.spec is None and HERE["ordered"]().spec is None
        assert env.metadata["render_fps"] == 24 and type(env.metadata["render_fps"]) is int
    finally:
        env.close()


@pytest.mark.parametrize("sent", [
    {"spec": {"id": "x" * 201}}, {"spec": {"id": "not an id!"}}, {"spec": {"id": 7}}, {"spec": "CartPole-v1"},
])
def test_a_spec_a_machine_sends_that_is_not_plain_data_within_bounds_is_none(sent: dict[str, Any]) -> None:
    assert envspec.env_spec(envspec.described(sent), None) is None


def test_a_machines_spec_and_render_fields_are_kept_only_where_they_are_plain_data_within_bounds() -> None:
    sent = {"render_modes": ["rgb_array", 3, "m" * 65, *["human"] * 40], "render_fps": float("nan"),
            "spec": {"id": "Mine-v2", "max_episode_steps": True, "reward_threshold": float("inf"),
                     "nondeterministic": "yes"}}
    kept = envspec.described(sent)
    assert kept["render_modes"] == ["rgb_array", *["human"] * 13]  # of the first 16 and kept["render_fps"] is None
    spec = envspec.env_spec(kept, None)
    assert spec is not None and (spec.id, spec.version, spec.max_episode_steps, spec.reward_threshold,
                                 spec.nondeterministic) == ("Mine-v2", 2, None, None, False)
    assert envspec.metadata(envspec.described({"render_fps": 2**70})) == {"render_modes": []}
    assert envspec.metadata(envspec.described({"render_fps": 30})) == {"render_modes": [], "render_fps": 30}
