"""smolbench.gym.make: a Gymnasium env whose steps run in a sandbox machine.

Gymnasium's own checker passes on it; it steps exactly as the same env in this process;
an env named in the machine works as a callable sent in does; a fresh reset never sees
what the last episode wrote (and an in-place one does: the contrast); a bad action and a
crashed step are one line and the env stays usable; every episode is a ledger row.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gymnasium
import numpy as np
import pytest
from gymhelpers import CARTPOLE, define, needs_bwrap, up_bench
from gymnasium.utils.env_checker import check_env

import smolbench.gym as sgym
from smolbench import SmolbenchError
from smolbench.gym import record
from smolbench.workbench import Workbench

pytestmark = [needs_bwrap, pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(scope="module")
def bench(tmp_path_factory: Any) -> Iterator[Workbench]:
    yield from up_bench(tmp_path_factory)

# An env whose every step writes a file, and whose reset says whether it is already there.
WRITER = '''
import os, gymnasium, numpy as np
from gymnasium import spaces

class Writer(gymnasium.Env):
    observation_space = spaces.Discrete(2)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return int(os.path.exists("/tmp/stepped")), {}

    def step(self, action):
        if action == 1:
            raise RuntimeError("the env refuses action 1 on purpose")
        open("/tmp/stepped", "w").close()
        return 1, 1.0, False, False, {"wrote": "/tmp/stepped"}

def writer():
    return Writer()
'''


def test_check_env_passes_on_a_machine_backed_cartpole(bench: Workbench) -> None:
    env = sgym.make(CARTPOLE, session=bench)
    try:
        assert env.observation_space == gymnasium.make("CartPole-v1").observation_space
        assert env.action_space == gymnasium.spaces.Discrete(2)
        check_env(env, skip_render_check=True)
    finally:
        env.close()
    assert not any(name.startswith(env._m.run_id) for name in bench.machines)


@pytest.mark.parametrize("reset", ["fresh", "in-place"])
def test_steps_are_those_of_the_same_env_here(bench: Workbench, reset: str) -> None:
    env, here = sgym.make(CARTPOLE, session=bench, reset=reset), gymnasium.make("CartPole-v1")
    try:
        a, b = env.reset(seed=7)[0], here.reset(seed=7)[0]
        assert a.dtype == np.float32 and np.array_equal(a, b)
        rng = np.random.default_rng(0)
        episodes = 0
        for _ in range(120):
            act = int(rng.integers(2))
            got, want = env.step(act), here.step(act)
            assert np.array_equal(got[0], want[0]) and got[1:4] == want[1:4]
            if got[2] or got[3]:
                episodes += 1
                assert np.array_equal(env.reset()[0], here.reset()[0])  # no seed: the stream goes on
        assert episodes >= 2
    finally:
        env.close()


def test_an_env_named_in_the_machine_and_isolation_of_fresh_resets(bench: Workbench) -> None:
    define(bench, WRITER)
    fresh = sgym.make("writer", session=bench)
    inplace = sgym.make("writer", session=bench, reset="in-place")
    try:
        for env in (fresh, inplace):
            assert env.reset(seed=1)[0] == 0
            assert env.step(0)[4] == {"wrote": "/tmp/stepped"}
        assert fresh.reset()[0] == 0  # a new branch of the warm parent: the file is not there
        assert inplace.reset()[0] == 1  # the contrast: the same machine still has it
        first = fresh.machine
        fresh.step(0)
        assert fresh.reset()[0] == 0 and fresh.machine != first
        assert first not in bench.machines  # the last episode's machine was deleted
    finally:
        fresh.close()
        inplace.close()


def test_bad_actions_and_crashed_steps_are_one_line_and_the_env_goes_on(bench: Workbench) -> None:
    define(bench, WRITER)
    env = sgym.make("writer", session=bench)
    try:
        env.reset(seed=3)
        with pytest.raises(SmolbenchError) as bad:
            env.step(5)
        assert "not in the action space" in str(bad.value) and "\n" not in str(bad.value)
        assert env.step(0)[1] == 1.0  # nothing was sent: the episode goes on
        with pytest.raises(SmolbenchError) as crashed:
            env.step(1)
        line = str(crashed.value)
        assert "RuntimeError: the env refuses action 1 on purpose" in line and "the env (machine" in line
        assert "\n" not in line
        with pytest.raises(SmolbenchError, match="reset"):
            env.step(0)  # the crashed episode is over
        assert env.reset()[0] == 0 and env.step(0)[1] == 1.0  # usable again after a reset
    finally:
        env.close()


def test_a_step_before_any_reset_is_one_line_naming_no_machine(bench: Workbench) -> None:
    """Before its first reset an episode has no machine: the line said ``the env (machine ?)``
    (and a bad action ``the env (machine None)``), placeholders a user can't act on."""
    define(bench, WRITER)
    for reset in ("fresh", "in-place"):
        env = sgym.make("writer", session=bench, reset=reset)
        try:
            if reset == "fresh":
                with pytest.raises(SmolbenchError) as early:
                    env.step(0)
                assert str(early.value) == "the env: step() before reset() (or after the episode ended): call reset() first"
                with pytest.raises(SmolbenchError) as bad:
                    env.step(5)
                assert str(bad.value).startswith("the env: action 5 is not in the action space"), str(bad.value)
            else:  # in place its machine is made with the env: it is named
                with pytest.raises(SmolbenchError, match=r"^the env \(machine [^)?]+\): step\(\) before reset\(\)"):
                    env.step(0)
            env.reset(seed=1)
            assert env.step(0)[1] == 1.0
        finally:
            env.close()


def test_an_in_place_episode_that_ended_is_in_the_ledger_when_close_returns(bench: Workbench, monkeypatch: Any) -> None:
    """In place, episodes' records are gathered for a moment (record.GATHER) before they are
    written: close() writes what was gathered, so nothing a training loop did is missing after it."""
    monkeypatch.setattr(record, "GATHER", 600.0)  # so only close() can have written them
    env = sgym.make(CARTPOLE, session=bench, reset="in-place")
    try:
        env.reset(seed=5)
        length = 1
        while not any(env.step(0)[2:4]):
            length += 1
    finally:
        env.close()
    rows = [r for r in bench.ledger.node_rows(bench.session) if r["run_id"] == env._m.run_id and r["seed"] == 5]
    assert [(r["status"], r["metrics"]["ended"], r["metrics"]["length"]) for r in rows] == [("ok", "terminated", length)]


def test_every_episode_is_in_the_ledger(bench: Workbench) -> None:
    env = sgym.make(CARTPOLE, session=bench)
    try:
        env.reset(seed=11)
        length = 0
        while True:
            length += 1
            if any(env.step(0)[2:4]):
                break
        env.reset(seed=12)
        env.step(0)
    finally:
        env.close()
    rows = {r["id"]: r for r in bench.ledger.node_rows(bench.session) if r["run_id"] == env._m.run_id}
    eps = [r for r in rows.values() if r["seed"] in (11, 12)]
    assert len(eps) == 2
    done = next(r for r in eps if r["seed"] == 11)
    assert done["reward"] == float(length) and done["status"] == "ok"
    assert done["metrics"]["length"] == length and done["metrics"]["ended"] == "terminated"
    closed = next(r for r in eps if r["seed"] == 12)
    assert closed["metrics"] == {"sub_env": 0, "reset": "fresh", "length": 1, "ended": "closed"}
    assert all(r["alive"] in (0, False) for r in rows.values())


@pytest.mark.parametrize("reset", ["fresh", "in-place"])
def test_a_long_run_keeps_the_newest_episodes_in_memory_and_every_one_in_the_ledger(
        bench: Workbench, monkeypatch: Any, reset: str) -> None:
    """Each ended episode stayed in the kernel's tree (~0.8 KiB each): a run of millions grew
    without bound. Past record.KEPT_IN_MEMORY the oldest leave the tree, never the ledger,
    and no episode's id is given out twice."""
    monkeypatch.setattr(record, "KEPT_IN_MEMORY", 20)
    env = sgym.make_vec(CARTPOLE, 4, session=bench, reset=reset)
    assert env._m.parent is not None
    parent = env._m.parent.name
    try:
        env.reset(seed=0)
        rng = np.random.default_rng(0)
        ended = 0
        while ended < 80:
            _, _, terminated, truncated, _ = env.step(rng.integers(0, 2, 4))
            ended += int(np.sum(terminated | truncated))
    finally:
        env.close()
    run = env._m.run_id
    rows = [r for r in bench.ledger.node_rows(bench.session) if r["run_id"] == run and r["id"] != parent]
    in_tree = [n for n in bench.tree if n.parent == parent]
    assert len(rows) >= ended and len({r["id"] for r in rows}) == len(rows)  # every one, each its own id
    assert len(in_tree) <= 20 + 4, len(in_tree)  # the newest (and in place, each machine's own node)
    assert {n.id for n in in_tree} <= {r["id"] for r in rows}


def test_bad_arguments_are_one_line(bench: Workbench) -> None:
    with pytest.raises(SmolbenchError, match="reset should be"):
        sgym.make(CARTPOLE, session=bench, reset="sometimes")
    with pytest.raises(SmolbenchError, match="not a Python name"):
        sgym.make("no such env", session=bench)
    with pytest.raises(SmolbenchError, match="could not be built.*'not_defined_anywhere' is not defined in the session's machine"):
        sgym.make("not_defined_anywhere", session=bench)


def test_gathered_records_are_written_before_a_session_goes_down_without_close(open_tmp: Any, monkeypatch: Any) -> None:
    """An env never closed: the session's down writes its gathered in-place records first, then
    marks the machines gone (never after: a late record would say a deleted machine is alive)."""
    import smolbench
    from smolbench.ledger import Ledger

    monkeypatch.setattr(record, "GATHER", 600.0)  # so only down can have written them
    with smolbench.Session(backend="sandbox", ledger=str(open_tmp / "ledger.db")) as s:
        env = sgym.make(CARTPOLE, session=s, reset="in-place")
        env.reset(seed=9)
        length = 1
        while not any(env.step(0)[2:4]):
            length += 1
        assert s.workbench is not None
        session, run_id = s.workbench.session, env._m.run_id
    rows = [r for r in Ledger(str(open_tmp / "ledger.db")).node_rows(session) if r["run_id"] == run_id]
    ended = [r for r in rows if r["seed"] == 9]
    assert [(r["metrics"].get("ended"), r["metrics"].get("length")) for r in ended] == [("terminated", length)], rows
    assert all(r["alive"] in (0, False) for r in rows), rows


def test_a_session_from_a_plain_script(open_tmp: Any) -> None:
    """The API as a training script uses it: a Session, make_vec on it, nothing left after."""
    import smolbench

    with smolbench.Session(backend="sandbox", ledger=str(open_tmp / "ledger.db")) as s:
        envs = sgym.make_vec(CARTPOLE, 2, session=s)
        obs, _ = envs.reset(seed=0)
        assert obs.shape == (2, 4)
        envs.step(np.array([0, 1]))
        envs.close()
        assert s.workbench is not None and set(s.workbench.machines) == {"root"}
