"""A sub-env's machine that dies in the middle of a vector step (issue 28).

The crash is made from the host, the way the kernel's OOM killer or a segfault would:
every process of one sub-env's machine gets SIGKILL while the vector env waits for its
step. With ``retries`` the sub-env's episode is cut short (truncated, an info saying so),
a new machine from the warm parent takes over, and the ledger records the rebuild; with
``retries=0`` the step is one line naming the sub-env. Either way the vector env goes on
stepping, and nothing of the dead machine is left.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator
from typing import Any

import gymnasium
import numpy as np
import pytest
from gymhelpers import WAITING, define, needs_bwrap, up_bench, waits

import smolbench.gym as sgym
from smolbench import SmolbenchError
from smolbench.backends import _procs
from smolbench.backends.base import MachineRef
from smolbench.workbench import Workbench

pytestmark = [needs_bwrap, pytest.mark.filterwarnings("ignore::UserWarning")]

# A sub-env whose step (action 2: a 0 to CartPole) waits, named WAITING, until the host kills its machine.
SLOW = f'''
import ctypes, time, gymnasium

class Slow(gymnasium.Wrapper):
    def __init__(self, env):
        super().__init__(env)
        self.action_space = gymnasium.spaces.Discrete(3)

    def step(self, action):
        if action == 2:  # killed in this step, once it is here
            ctypes.CDLL(None).prctl(15, b"{WAITING}", 0, 0, 0)
            time.sleep(600)
        return self.env.step(int(action) % 2)

def slow_cartpole():
    return Slow(gymnasium.make("CartPole-v1"))
'''
VICTIM = 2
sgym_cartpole = functools.partial(gymnasium.make, "CartPole-v1")


@pytest.fixture(scope="module")
def bench(tmp_path_factory: Any) -> Iterator[Workbench]:
    yield from up_bench(tmp_path_factory)


def machine_procs(ref: MachineRef) -> list[tuple[int, str]]:
    """Every host process of ``ref``'s machine (its keeper and agent and what they started)."""
    pid, started = ref.info["host_pid"], ref.info["host_started"]
    assert _procs.running(pid, started)
    return [(pid, started), *_procs.descendants(pid)]


def step_while_killed(envs: Any, ref: MachineRef, action: int = 0) -> tuple[list[tuple[int, str]], Any]:
    """One vector step (``action`` for every sub-env, 2 for the VICTIM's: it waits in it), with
    every process of ``ref``'s machine killed once the step (or its autoreset) waits there."""
    procs = machine_procs(ref)

    def kill() -> None:
        deadline = time.monotonic() + 120
        while True:
            procs[:] = list(dict.fromkeys([*procs, *_procs.descendants(procs[0][0])]))
            if waits(procs) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        _procs.kill_all(procs)

    killer = threading.Thread(target=kill)
    killer.start()
    actions = np.full(envs.num_envs, action, dtype=np.int64)
    actions[VICTIM] = 2
    try:
        return procs, envs.step(actions)
    finally:
        killer.join()


def gone(procs: list[tuple[int, str]]) -> bool:
    return not any(_procs.running(*p) for p in procs)


@pytest.mark.parametrize("reset", ["fresh", "in-place"])
def test_a_machine_killed_mid_step_is_rebuilt_under_retries_and_recorded(bench: Workbench, reset: str) -> None:
    define(bench, SLOW)
    envs = sgym.make_vec("slow_cartpole", 4, session=bench, reset=reset, retries=1)
    try:
        envs.reset(seed=0)
        envs.step(np.zeros(4, dtype=np.int64))
        victim = envs._m.eps[VICTIM].ref
        assert victim is not None
        procs, (obs, rewards, terminated, truncated, infos) = step_while_killed(envs, victim)
        assert truncated[VICTIM] and not terminated[VICTIM]  # its episode was cut short, not failed
        assert infos["_smolbench_lost"][VICTIM] and f"sub-env {VICTIM}" in infos["smolbench_lost"][VICTIM]
        assert "died mid-step" in infos["smolbench_lost"][VICTIM]
        assert list(rewards[[i for i in range(4) if i != VICTIM]]) == [1.0, 1.0, 1.0]  # the others stepped
        for _ in range(6):  # the next step autoresets it in a new machine; the env goes on
            obs, rewards, terminated, truncated, infos = envs.step(np.ones(4, dtype=np.int64))
            assert envs.observation_space.contains(obs)
        assert envs.machines[VICTIM] not in (None, victim.name)
        assert gone(procs) and victim.name not in bench.machines
        assert victim.name not in {m.name for m in bench.backend.list()}
        attempts = [a for a in bench.ledger.attempt_rows(bench.session) if a["node_id"] == victim.name]
        assert [(a["stage"], a["outcome"]) for a in attempts] == [("gym step", "rebuilt")]
        assert "died" in attempts[0]["error"]
        episode = next(r for r in bench.ledger.node_rows(bench.session)
                       if r["run_id"] == envs._m.run_id and r["id"].split("#")[0] == victim.name
                       and (r["metrics"] or {}).get("ended") == "lost")
        assert episode["status"] == "lost" and episode["metrics"]["sub_env"] == VICTIM
    finally:
        envs.close()
    assert {m.name for m in bench.backend.list()} == {bench.active}  # the session's own machine only


# A sub-env whose reset after a step of action 2 (a 0 to CartPole) waits, named WAITING, until the
# host kills its machine.
SLOW_RESET = f'''
import ctypes, time, gymnasium

class SlowReset(gymnasium.Wrapper):
    def __init__(self, env):
        super().__init__(env)
        self.action_space = gymnasium.spaces.Discrete(3)
        self.marked = False

    def step(self, action):
        self.marked = action == 2
        return self.env.step(int(action) % 2)

    def reset(self, **kwargs):
        if self.marked:  # killed in this reset, once it is here
            self.marked = False
            ctypes.CDLL(None).prctl(15, b"{WAITING}", 0, 0, 0)
            time.sleep(600)
        return self.env.reset(**kwargs)

def slow_reset_cartpole():
    return SlowReset(gymnasium.make("CartPole-v1"))
'''


def test_a_machine_killed_in_its_autoreset_is_rebuilt_and_the_episode_starts_there(bench: Workbench) -> None:
    """In place, an ended sub-env is reset in the next step's batch: its machine dying under
    that reset is rebuilt under retries (recorded), and the episode starts in the new one."""
    define(bench, SLOW_RESET)
    envs = sgym.make_vec("slow_reset_cartpole", 4, session=bench, reset="in-place", retries=1)
    try:
        envs.reset(seed=0)
        marked = np.zeros(4, dtype=np.int64)
        marked[VICTIM] = 2  # a 0 whose episode's end makes the next reset wait to be killed
        for _ in range(500):  # until the victim's episode ends: its autoreset is the next step's
            ended = envs.step(marked)
            if ended[2][VICTIM] or ended[3][VICTIM]:
                break
        victim = envs._m.eps[VICTIM].ref
        assert victim is not None and not envs._m.eps[VICTIM].running
        procs, (obs, rewards, terminated, truncated, infos) = step_while_killed(envs, victim)
        assert envs.observation_space.contains(obs) and rewards[VICTIM] == 0.0  # reset, in a new machine
        assert not terminated[VICTIM] and not truncated[VICTIM]
        assert envs.machines[VICTIM] not in (None, victim.name) and gone(procs)
        attempts = [a for a in bench.ledger.attempt_rows(bench.session) if a["node_id"] == victim.name]
        assert [(a["stage"], a["outcome"]) for a in attempts] == [("gym reset", "retried"), ("gym reset", "ok")]
        assert "died" in attempts[0]["error"]
        for _ in range(3):
            obs, *_ = envs.step(np.ones(4, dtype=np.int64))
            assert envs.observation_space.contains(obs)
    finally:
        envs.close()
    assert {m.name for m in bench.backend.list()} == {bench.active}  # the session's own machine only


def test_without_retries_a_machine_killed_mid_step_is_one_line_naming_the_sub_env(bench: Workbench) -> None:
    define(bench, SLOW)
    envs = sgym.make_vec("slow_cartpole", 4, session=bench, retries=0)
    try:
        envs.reset(seed=0)
        victim = envs._m.eps[VICTIM].ref
        assert victim is not None
        with pytest.raises(SmolbenchError) as died:
            step_while_killed(envs, victim)
        line = str(died.value)
        assert f"sub-env {VICTIM} (machine {victim.name})" in line and "\n" not in line
        assert line.count(victim.name) == 1 and "mid-cell" not in line, line  # named once; a step is no cell
        for _ in range(4):  # the failed sub-env starts over in a new machine; the others go on
            obs, *_ = envs.step(np.ones(4, dtype=np.int64))
            assert envs.observation_space.contains(obs)
        assert envs.machines[VICTIM] != victim.name
    finally:
        envs.close()
    assert {m.name for m in bench.backend.list()} == {bench.active}  # the session's own machine only


PICKY = '''
import gymnasium

class Picky(gymnasium.Wrapper):
    def reset(self, *, seed=None, options=None):
        if seed == 13:
            raise ValueError("unlucky seed")
        return self.env.reset(seed=seed, options=options)

def picky_cartpole():
    return Picky(gymnasium.make("CartPole-v1"))
'''


def test_a_fresh_reset_whose_spare_died_is_done_again_in_another(bench: Workbench) -> None:
    """A fresh reset is asked on the caller's thread (Machines.reset_now); its spare killed
    before it answers, the reset is done again in a new branch, and that is recorded."""
    define(bench, PICKY)
    env = sgym.make("picky_cartpole", session=bench)
    try:
        env.reset(seed=0)
        m = env._m  # type: ignore[attr-defined]
        deadline = time.monotonic() + 120  # a spare is ready: a loaded host takes a while to fork them
        while not m.pool.ready and time.monotonic() < deadline:
            time.sleep(0.05)
        spare = m.pool.ready[0][0]
        procs = machine_procs(spare)
        _procs.kill_all(procs)
        obs, _ = env.reset(seed=5)
        assert env.observation_space.contains(obs) and env.machine != spare.name
        assert gone(procs)
        assert any(r["node_id"] == spare.name and r["outcome"] == "rebuilt" for r in bench.ledger.attempt_rows(bench.session))
        with pytest.raises(SmolbenchError) as failed:  # the env's own error: one line, and it goes on
            env.reset(seed=13)
        assert "unlucky seed" in str(failed.value) and "\n" not in str(failed.value)
        assert env.observation_space.contains(env.reset(seed=14)[0])
    finally:
        env.close()
    assert {m.name for m in bench.backend.list()} == {bench.active}


def test_an_in_place_reset_whose_machine_died_starts_over_in_a_new_branch(bench: Workbench) -> None:
    env = sgym.make(sgym_cartpole, session=bench, reset="in-place")
    try:
        env.reset(seed=0)
        dead = bench.machines[env.machine]  # type: ignore[index]
        procs = machine_procs(dead)
        _procs.kill_all(procs)
        obs, _ = env.reset(seed=1)  # on the caller's thread first (Machines.reset_now), then the loop's way
        assert env.observation_space.contains(obs) and env.machine != dead.name and gone(procs)
        assert any(r["node_id"] == dead.name and r["outcome"] == "rebuilt" for r in bench.ledger.attempt_rows(bench.session))
    finally:
        env.close()
    assert {m.name for m in bench.backend.list()} == {bench.active}


HANGING = '''
import sys, time, gymnasium

def hanging_spares():
    server = sys._getframe(1).f_locals["self"]  # the warm parent's gym server, as the env's code can reach it
    real = server.serve
    def serve(api, first, pages=None, learn=False):
        if first is None:  # a spare (or the practice episode): it never answers
            time.sleep(10**6)
        return real(api, first, pages, learn)
    server.serve = serve
    return gymnasium.make("CartPole-v1")
'''


def test_spares_that_never_answer_hold_neither_the_reset_nor_the_close(bench: Workbench) -> None:
    """The audit: the warm parent's code made every spare branch sleep before its first answer.
    A fresh reset then waited for a spare forever, and so did the env's close (it waited for
    the spares to start), and the session's down raised KeyError beside it. Now the close
    deletes the spares still starting, the waiting reset ends in one line, and nothing of
    the env is left."""
    define(bench, HANGING)
    before = set(bench.machines)
    env = sgym.make("hanging_spares", session=bench)
    said: list[BaseException] = []

    def reset() -> None:
        try:
            env.reset()
        except BaseException as exc:  # noqa: BLE001 - what the blocked reset ends with
            said.append(exc)

    waiting = threading.Thread(target=reset, daemon=True)
    waiting.start()
    waiting.join(3)
    assert waiting.is_alive()  # no spare ever answers: it waits (Ctrl-C would end it)
    closing = threading.Thread(target=env.close, daemon=True)
    closing.start()
    closing.join(120)  # a guard against the old hang, not a time being measured
    assert not closing.is_alive(), "the env's close waited for spares that never answer"
    waiting.join(60)
    assert not waiting.is_alive() and len(said) == 1 and "\n" not in str(said[0]), said
    assert isinstance(said[0], SmolbenchError) and "the env is closed" in str(said[0]), said[0]
    assert set(bench.machines) == before  # every branch it made is deleted
