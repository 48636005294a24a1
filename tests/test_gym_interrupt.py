"""Ctrl-C in the middle of a vector step (issue 28): the step's answers are read on the
caller's thread, so a KeyboardInterrupt can land while some answers are still on their way.

The attack on correctness: a late answer to the interrupted step must never be taken as the
answer to the next request (the next episode would start from the last one's state, or a
step would get the wrong observation). Checked against gymnasium's own SyncVectorEnv with
the same seeds and actions after the interrupt; and nothing of the interrupted machines is
left once the env is closed.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from typing import Any

import gymnasium
import numpy as np
import pytest
from gymhelpers import define, needs_bwrap, up_bench

import smolbench.gym as sgym
from smolbench.workbench import Workbench

pytestmark = [needs_bwrap, pytest.mark.filterwarnings("ignore::UserWarning")]

SLOW = '''
import time, gymnasium

class SlowSometimes(gymnasium.Wrapper):
    """CartPole whose steps with action 1 take 0.6 s: long enough for a Ctrl-C mid-step."""
    def step(self, action):
        if int(action) == 1:
            time.sleep(0.6)
        return self.env.step(action)

def slow_cartpole():
    return SlowSometimes(gymnasium.make("CartPole-v1"))
'''


@pytest.fixture(scope="module")
def bench(tmp_path_factory: Any) -> Iterator[Workbench]:
    yield from up_bench(tmp_path_factory)


def interrupt_soon(delay: float = 0.2) -> threading.Timer:
    """SIGINT to this (the main) thread after ``delay`` s, as a Ctrl-C in a terminal or the
    kernel's interrupt would: it breaks the poll the step waits in."""
    main = threading.main_thread().ident
    assert main is not None and threading.get_ident() == main
    timer = threading.Timer(delay, signal.pthread_kill, (main, signal.SIGINT))
    timer.start()
    return timer


@pytest.mark.parametrize("reset", ["fresh", "in-place"])
def test_a_step_interrupted_by_ctrl_c_never_answers_a_later_request(bench: Workbench, reset: str) -> None:
    define(bench, SLOW)
    envs = sgym.make_vec("slow_cartpole", 4, session=bench, reset=reset, autoreset_mode=gymnasium.vector.AutoresetMode.NEXT_STEP)
    ref = gymnasium.vector.SyncVectorEnv([lambda: gymnasium.make("CartPole-v1")] * 4,
                                         autoreset_mode=gymnasium.vector.AutoresetMode.NEXT_STEP)
    try:
        envs.reset(seed=0)
        timer = interrupt_soon()
        try:
            with pytest.raises(KeyboardInterrupt):
                # sub-envs 0 and 1 answer at once, 2 and 3 only after the interrupt
                envs.step(np.array([0, 0, 1, 1], dtype=np.int64))
        finally:
            timer.join()
        # Start over with a known seed: every answer from here on must be the one asked for.
        obs, _ = envs.reset(seed=7)
        want, _ = ref.reset(seed=7)
        np.testing.assert_array_equal(obs, want)
        rng = np.random.default_rng(3)
        for _ in range(40):
            actions = rng.integers(0, 2, 4) * 0  # action 0 only: fast steps
            got = envs.step(actions)
            exp = ref.step(actions)
            for g, e in zip(got[:4], exp[:4]):
                np.testing.assert_array_equal(g, e)
    finally:
        envs.close()
        ref.close()
    assert {m.name for m in bench.backend.list()} == {bench.active}  # the session's own machine only


SLEEPY = '''
import time, gymnasium

class SlowSeeded(gymnasium.Wrapper):
    """CartPole whose reset with seed 99 takes 2 s: long enough for a Ctrl-C while it waits."""
    def reset(self, *, seed=None, options=None):
        if seed == 99:
            time.sleep(2)
        return self.env.reset(seed=seed, options=options)

def slow_reset_cartpole():
    return SlowSeeded(gymnasium.make("CartPole-v1"))
'''


def test_ctrl_c_while_a_vector_reset_waits_stops_it_there(bench: Workbench) -> None:
    """A Ctrl-C while a reset (or make_vec, or a close) waited on smolbench's loop left the work
    running there ("Task was destroyed but it is pending!"): a script that ended on the Ctrl-C
    waited out the exit's 20 s for it, and left a cgroup behind."""
    import asyncio

    from smolbench import _loop

    define(bench, SLEEPY)
    envs = sgym.make_vec("slow_reset_cartpole", 2, session=bench)
    try:
        timer = interrupt_soon(0.5)
        try:
            with pytest.raises(KeyboardInterrupt):
                envs.reset(seed=[99, 99])
        finally:
            timer.join()

        async def pending() -> list[str]:
            here = asyncio.current_task()
            return [t.get_coro().__qualname__ for t in asyncio.all_tasks() if t is not here and not t.done()]

        # stopped, its cleanup done, before the Ctrl-C reached the caller: nothing of it still runs
        assert not [name for name in _loop.run(pending()) if "_together" in name or name.startswith(("Machines.", "WarmParent.", "Requests."))]
        obs, _ = envs.reset(seed=[1, 2])  # and the env goes on
        assert obs.shape == (2, 4)
    finally:
        envs.close()
    assert {m.name for m in bench.backend.list()} == {bench.active}
