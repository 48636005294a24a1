"""smolbench.gym.make_vec: one machine per sub-env, stepped like Gymnasium's own vector envs.

A machine-backed CartPole ``make_vec(..., 4)`` gives the same observations, rewards,
terminations, truncations and autoresets as ``gymnasium.vector.SyncVectorEnv`` for 1,000
steps with the same seeds and actions (NEXT_STEP), and the same under SAME_STEP (final
observations too) and DISABLED; a bad action names its sub-env and the env goes on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from gymhelpers import CARTPOLE, define, needs_bwrap, up_bench
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from ledgerhelpers import readable_now

import smolbench.gym as sgym
from smolbench import SmolbenchError, _loop
from smolbench.gym import record
from smolbench.workbench import Workbench

pytestmark = [needs_bwrap, pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(scope="module")
def bench(tmp_path_factory: Any) -> Iterator[Workbench]:
    yield from up_bench(tmp_path_factory)


def same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    elif isinstance(a, np.ndarray) and a.dtype == object:
        assert a.shape == b.shape
        for x, y in zip(a, b):
            same(x, y)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    else:
        assert a == b


def lockstep(ours: Any, theirs: Any, steps: int, seed: int) -> int:
    """Step both with the same actions; every output equal. Returns how many episodes ended."""
    same(ours.reset(seed=seed), theirs.reset(seed=seed))
    rng = np.random.default_rng(seed)
    ended = 0
    for _ in range(steps):
        actions = rng.integers(0, 2, ours.num_envs)
        got, want = ours.step(actions), theirs.step(actions)
        for a, b in zip(got, want):
            same(a, b)
        ended += int(np.sum(got[2] | got[3]))
    return ended


def test_cartpole_make_vec_4_steps_as_sync_vector_env_for_1000_steps(bench: Workbench) -> None:
    ours = sgym.make_vec(CARTPOLE, 4, session=bench)
    theirs = SyncVectorEnv([CARTPOLE] * 4)
    try:
        assert ours.single_observation_space == theirs.single_observation_space
        assert ours.action_space == theirs.action_space and ours.metadata["autoreset_mode"] == AutoresetMode.NEXT_STEP
        ended = lockstep(ours, theirs, 1000, seed=42)
        assert ended > 40  # random actions end CartPole episodes every ~20 steps: many autoresets were compared
        machines = ours.machines
        assert len(set(machines)) == 4 and all(m in bench.machines for m in machines)
    finally:
        ours.close()
        theirs.close()
    assert not set(machines) & set(bench.machines)
    rows = [r for r in bench.ledger.node_rows(bench.session) if r["run_id"] == ours._m.run_id and r["metrics"].get("ended")]
    assert sum(r["metrics"]["ended"] in ("terminated", "truncated") for r in rows) == ended


def test_every_in_place_episode_is_its_own_ledger_row(bench: Workbench) -> None:
    """In place, a sub-env's episodes share its machine and its serving cell: each is still a
    node and a ledger row of its own (they were one row per machine, each episode overwriting
    the last), autoreset in the step's batch."""
    envs = sgym.make_vec(CARTPOLE, 2, session=bench, reset="in-place")
    ended = 0
    try:
        envs.reset(seed=3)
        for _ in range(150):
            _, _, terminated, truncated, _ = envs.step(np.array([0, 1]))
            ended += int(np.sum(terminated | truncated))
        machines = envs.machines
    finally:
        envs.close()
    rows = [r for r in bench.ledger.node_rows(bench.session) if r["run_id"] == envs._m.run_id and r["metrics"].get("ended")]
    assert ended >= 10 and sum(r["metrics"]["ended"] in ("terminated", "truncated") for r in rows) == ended
    assert sum(r["metrics"]["ended"] == "closed" for r in rows) == 2 and {r["id"].split("#")[0] for r in rows} == set(machines)
    assert sum(r["reward"] for r in rows if r["metrics"]["ended"] != "closed") == sum(
        r["metrics"]["length"] for r in rows if r["metrics"]["ended"] != "closed")


@pytest.mark.parametrize("mode", [AutoresetMode.SAME_STEP, AutoresetMode.DISABLED])
def test_other_autoreset_modes_match_sync_vector_env(bench: Workbench, mode: AutoresetMode) -> None:
    ours = sgym.make_vec(CARTPOLE, 3, session=bench, autoreset_mode=mode, reset="in-place" if mode == AutoresetMode.DISABLED else "fresh")
    theirs = SyncVectorEnv([CARTPOLE] * 3, autoreset_mode=mode)
    try:
        same(ours.reset(seed=5), theirs.reset(seed=5))
        rng = np.random.default_rng(5)
        ended = 0
        for _ in range(150):
            actions = rng.integers(0, 2, 3)
            got, want = ours.step(actions), theirs.step(actions)
            for a, b in zip(got, want):
                same(a, b)
            done = got[2] | got[3]
            ended += int(done.sum())
            if mode == AutoresetMode.DISABLED and done.any():
                same(ours.reset(options={"reset_mask": done}), theirs.reset(options={"reset_mask": done}))
        assert ended >= 5
    finally:
        ours.close()
        theirs.close()


def test_a_bad_action_names_its_sub_env_and_nothing_is_sent(bench: Workbench) -> None:
    envs = sgym.make_vec(CARTPOLE, 2, session=bench)
    try:
        envs.reset(seed=0)
        with pytest.raises(SmolbenchError) as bad:
            envs.step(np.array([0, 7]))
        assert str(bad.value).startswith("sub-env 1: action 7 is not in the action space") and "\n" not in str(bad.value)
        obs, *_ = envs.step(np.array([0, 1]))
        assert obs.shape == (2, 4)
    finally:
        envs.close()


def test_a_batch_of_the_wrong_size_is_one_line_and_nothing_is_sent(bench: Workbench) -> None:
    """2 actions for 3 sub-envs was a bare IndexError, 4 stepped 3 and dropped one. Gymnasium
    raises ValueError: so does this, in one line."""
    ours, theirs = sgym.make_vec(CARTPOLE, 3, session=bench, reset="in-place"), SyncVectorEnv([CARTPOLE] * 3)
    try:
        same(ours.reset(seed=1), theirs.reset(seed=1))
        for wrong in (np.zeros(2, np.int64), np.zeros(4, np.int64), [0, 1, 0, 1]):
            with pytest.raises(ValueError):
                theirs.step(wrong)
            with pytest.raises(ValueError) as refused:
                ours.step(wrong)
            line = str(refused.value)
            assert isinstance(refused.value, SmolbenchError) and "\n" not in line, line
            assert "one action per sub-env" in line and "3 sub-envs" in line, line
        theirs.reset(seed=1)
        for a, b in zip(ours.step(np.array([0, 1, 0])), theirs.step(np.array([0, 1, 0]))):  # nothing was sent
            same(a, b)
    finally:
        ours.close()
        theirs.close()


FLAKY_RESET = '''
import gymnasium

class FlakyReset(gymnasium.Wrapper):
    resets = 0
    def reset(self, **kwargs):
        FlakyReset.resets += 1
        if FlakyReset.resets == 2:  # this machine's first autoreset
            raise RuntimeError("reset failed once")
        return self.env.reset(**kwargs)

def flaky_reset_cartpole():
    return FlakyReset(gymnasium.make("CartPole-v1"))
'''


def test_an_autoreset_that_fails_names_its_sub_env_and_the_env_goes_on(bench: Workbench) -> None:
    """In place, an ended sub-env is reset in the next step's batch; its env's reset raising
    (each machine's first autoreset here) is one line naming the sub-env, and the next step
    resets it again."""
    define(bench, FLAKY_RESET)
    envs = sgym.make_vec("flaky_reset_cartpole", 2, session=bench, reset="in-place")
    lines: list[str] = []
    try:
        envs.reset(seed=0)
        for _ in range(300):
            try:
                envs.step(np.zeros(2, np.int64))
            except SmolbenchError as exc:
                lines.append(str(exc))
            if len(lines) == 2:
                break
        assert len(lines) == 2
        for line in lines:
            assert "(machine root." in line and "RuntimeError: reset failed once" in line and "\n" not in line, line
        assert sorted(line.split(" (")[0] for line in lines) == ["sub-env 0", "sub-env 1"]
        for _ in range(30):  # both reset again, and go on (their later autoresets succeed)
            obs, *_ = envs.step(np.zeros(2, np.int64))
            assert envs.observation_space.contains(obs)
    finally:
        envs.close()


def test_views_hear_of_training_episodes_after_their_commit_never_while_the_ledger_is_held(bench: Workbench) -> None:
    """Episodes' rows are written just after a step, in one commit; the views (a tree in the
    notebook) are told after it, never while the loop holds the ledger's lock (a view's
    observer takes its own lock, which the main thread may hold while it reads the ledger:
    see test_widgets' fork test). Every finished episode is heard of, as the ledger has it."""
    held: list[bool] = []
    heard: dict[str, str] = {}

    def observer(wb: Workbench, nodes: list[Any]) -> None:
        held.append(not readable_now(wb.ledger))
        heard.update((n.id, n.status) for n in nodes)

    envs = sgym.make_vec(CARTPOLE, 2, session=bench, reset="in-place")
    bench.observe(observer)
    try:
        envs.reset(seed=3)
        for _ in range(60):
            envs.step(np.array([0, 0]))
        _loop.run(asyncio.sleep(2 * record.GATHER))  # the last steps' records are written on the loop soon after
    finally:
        bench.unobserve(observer)
        envs.close()
    assert held and not any(held), f"{sum(held)} of {len(held)} observer calls ran while the ledger was held"
    ended = {r["id"]: r["status"] for r in bench.ledger.node_rows(bench.session)  # closed ones: after unobserve
             if r["id"] in heard and (r["metrics"] or {}).get("ended") in ("terminated", "truncated")}
    assert len(ended) >= 4 and {k: heard[k] for k in ended} == ended


COUNTER = '''
import gymnasium as gym
from gymnasium import spaces as S

class Counter(gym.Env):
    """obs = reward = t; the sub-env reset with seed 0 raises at its third step."""
    observation_space = S.Discrete(100)
    action_space = S.Discrete(2)
    def reset(self, *, seed=None, options=None):
        self.t, self.crash = 0, seed == 0
        return 0, {}
    def step(self, action):
        self.t += 1
        if self.crash and self.t == 3:
            raise RuntimeError("sub-env 0 crashes at t=3")
        return self.t, float(self.t), False, False, {}

def counter():
    return Counter()
'''


@pytest.mark.parametrize("reset", ["fresh", "in-place"])
def test_a_failed_vector_step_carries_the_steps_results(bench: Workbench, reset: str) -> None:
    """Sub-env 0 raised at t=3: the step's error lost sub-env 1's step 3 (stepping on gave it
    t=4), and sub-env 0 started over at the next step with no flag on the step before. The
    error now carries the step's results: the failed sub-env truncated at its last observation,
    its info's smolbench_error the line; the next step autoresets it, as after any truncation."""
    define(bench, COUNTER)
    envs = sgym.make_vec("counter", 2, session=bench, reset=reset)
    try:
        envs.reset(seed=[0, 1])
        envs.step(np.array([0, 0]))
        assert list(envs.step(np.array([0, 0]))[0]) == [2, 2]
        with pytest.raises(SmolbenchError, match="sub-env 0 crashes at t=3") as failed:
            envs.step(np.array([0, 0]))
        obs, rewards, terminated, truncated, infos = failed.value.results  # type: ignore[attr-defined]
        assert (list(obs), list(rewards), list(terminated), list(truncated)) == ([2, 3], [0.0, 3.0], [False] * 2,
                                                                                [True, False])
        assert "sub-env 0 crashes at t=3" in infos["smolbench_error"][0] and list(infos["_smolbench_error"]) == [
            True, False]
        obs, rewards, terminated, truncated, _ = envs.step(np.array([0, 0]))
        assert (list(obs), list(rewards), list(terminated), list(truncated)) == ([0, 4], [0.0, 4.0], [False] * 2,
                                                                                [False] * 2)
    finally:
        envs.close()


def test_an_env_dropped_without_close_deletes_its_machines(bench: Workbench) -> None:
    """A sweep that rebinds `env = make(...)` without close() kept every old env's machines (~19
    processes each) until the session ended, towards its process limit."""
    import gc
    import time

    define(bench, COUNTER)
    for make in (lambda: sgym.make("counter", session=bench), lambda: sgym.make_vec("counter", 2, session=bench)):
        env: Any = make()
        env.reset(seed=1)
        assert len(bench.backend.list()) > 1
        del env
        gc.collect()
        deadline = time.monotonic() + 60
        while len(bench.backend.list()) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert {m.name for m in bench.backend.list()} == {bench.active}



FAKE_FINALS = '''
import gymnasium as gym
import numpy as np
from gymnasium import spaces as S

class FakeFinals(gym.Env):
    """Every step ends the episode; each reset but the first claims, in its info, the final
    observation (NaN, the wrong shape) and info; action 1's step sends one of smolbench's notes."""
    observation_space = S.Box(-1.0, 1.0, (2,), np.float32)
    action_space = S.Discrete(2)
    resets = 0
    def reset(self, *, seed=None, options=None):
        FakeFinals.resets += 1
        fake = {"final_obs": np.full((7, 7), np.nan), "final_info": {"episode": {"r": 1e9}}}
        return np.zeros(2, np.float32), fake if FakeFinals.resets > 1 else {}
    def step(self, action):
        info = {"smolbench_lost": "sub-env 1 died mid-step"} if action == 1 else {}
        return np.zeros(2, np.float32), 0.0, True, False, info

def fake_finals():
    return FakeFinals()
'''


def test_an_env_cannot_pass_its_info_for_the_final_observation_or_smolbench_s_notes(bench: Workbench) -> None:
    """Attack: under SAME_STEP an autoreset's info merged after the host's checked final_obs and
    final_info, so a trainer bootstrapping from ``final_obs`` got a NaN (7, 7) array its space
    refuses; an info could also carry a fake ``smolbench_lost``. Both are one line naming the key."""
    define(bench, FAKE_FINALS)
    envs = sgym.make_vec("fake_finals", 2, session=bench, reset="in-place", autoreset_mode=AutoresetMode.SAME_STEP)
    try:
        envs.reset(seed=0)
        with pytest.raises(SmolbenchError, match="sent an info with the key 'final_obs', which is the vector env's own"):
            envs.step(np.zeros(2, np.int64))  # each ends, and is reset in the same step
    finally:
        envs.close()
    env = sgym.make("fake_finals", session=bench, reset="in-place")
    try:
        env.reset(seed=0)
        with pytest.raises(SmolbenchError, match="the key 'smolbench_lost', which is smolbench's own"):
            env.step(1)
    finally:
        env.close()
