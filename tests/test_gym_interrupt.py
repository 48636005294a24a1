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
import time
from collections.abc import Iterator
from typing import Any

import gymnasium
import numpy as np
import pytest
from gymhelpers import WAITING, define, needs_bwrap, up_bench, waits

import smolbench.gym as sgym
from smolbench.backends import _procs
from smolbench.workbench import Workbench

pytestmark = [needs_bwrap, pytest.mark.filterwarnings("ignore::UserWarning")]

SLOW = f'''
import ctypes, time, gymnasium

class SlowSometimes(gymnasium.Wrapper):
    """CartPole whose steps with action 1 take 3 s (named {WAITING}: the Ctrl-C comes once they are
    here), then answer: late, after the interrupt."""
    def step(self, action):
        if int(action) == 1:
            ctypes.CDLL(None).prctl(15, b"{WAITING}", 0, 0, 0)
            time.sleep(3)
        return self.env.step(action)

def slow_cartpole():
    return SlowSometimes(gymnasium.make("CartPole-v1"))
'''


@pytest.fixture(scope="module")
def bench(tmp_path_factory: Any) -> Iterator[Workbench]:
    yield from up_bench(tmp_path_factory)


def interrupt_once_waiting(envs: Any, which: list[int]) -> threading.Thread:
    """SIGINT to this (the main) thread, as a Ctrl-C in a terminal or the kernel's interrupt
    would (it breaks the poll the call waits in), once sub-envs ``which`` each wait in their
    slow call (a thread of their machine named WAITING)."""
    main = threading.main_thread().ident
    assert main is not None and threading.get_ident() == main

    def there(i: int) -> bool:
        ref = envs._m.eps[i].ref
        if ref is None or "host_pid" not in ref.info:
            return False
        pid = ref.info["host_pid"]
        return waits([(pid, ""), *_procs.descendants(pid)])

    def send() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(there(i) for i in which):
            time.sleep(0.01)
        signal.pthread_kill(main, signal.SIGINT)

    sender = threading.Thread(target=send)
    sender.start()
    return sender


@pytest.mark.parametrize("reset", ["fresh", "in-place"])
def test_a_step_interrupted_by_ctrl_c_never_answers_a_later_request(bench: Workbench, reset: str) -> None:
    define(bench, SLOW)
    envs = sgym.make_vec("slow_cartpole", 4, session=bench, reset=reset, autoreset_mode=gymnasium.vector.AutoresetMode.NEXT_STEP)
    ref = gymnasium.vector.SyncVectorEnv([lambda: gymnasium.make("CartPole-v1")] * 4,
                                         autoreset_mode=gymnasium.vector.AutoresetMode.NEXT_STEP)
    try:
        envs.reset(seed=0)
        sender = interrupt_once_waiting(envs, [2, 3])
        try:
            with pytest.raises(KeyboardInterrupt):
                # sub-envs 0 and 1 answer at once, 2 and 3 only after the interrupt
                envs.step(np.array([0, 0, 1, 1], dtype=np.int64))
        finally:
            sender.join()
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


SLEEPY = f'''
import ctypes, time, gymnasium

class SlowSeeded(gymnasium.Wrapper):
    """CartPole whose reset with seed 99 takes 3 s (named {WAITING}: the Ctrl-C comes once it is here)."""
    def reset(self, *, seed=None, options=None):
        if seed == 99:
            ctypes.CDLL(None).prctl(15, b"{WAITING}", 0, 0, 0)
            time.sleep(3)
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
        practice = envs._m._practice  # the env's own practice episode, begun by make_vec: over first
        deadline = time.monotonic() + 120
        while practice is not None and not practice.done():
            assert time.monotonic() < deadline, "the practice episode never ended"
            time.sleep(0.05)
        sender = interrupt_once_waiting(envs, [0, 1])
        try:
            with pytest.raises(KeyboardInterrupt):
                envs.reset(seed=[99, 99])
        finally:
            sender.join()

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


def test_a_step_after_a_ctrl_c_step_says_it_was_cut_short(bench: Workbench) -> None:
    """Stepping on after a Ctrl-C'd step said `sub-env 2 (machine root.0.14): machine root.0.14:
    its channel is closed`."""
    import re

    define(bench, SLOW)
    envs = sgym.make_vec("slow_cartpole", 4, session=bench, reset="in-place")
    try:
        envs.reset(seed=0)
        sender = interrupt_once_waiting(envs, [2, 3])
        try:
            with pytest.raises(KeyboardInterrupt):
                envs.step(np.array([0, 0, 1, 1], dtype=np.int64))
        finally:
            sender.join()
        with pytest.raises(sgym.GymError) as err:
            envs.step(np.array([0, 0, 0, 0], dtype=np.int64))
        # sub-env 2, or one stepped quickly whose answer a loaded host hadn't read by the Ctrl-C
        assert re.fullmatch(r"sub-env \d \(machine root\.[\d.]+\): its last step was cut short \(interrupted\): "
                            r"reset\(\) starts a new episode", str(err.value)), str(err.value)
        envs.reset(seed=1)
        envs.step(np.array([0, 0, 0, 0], dtype=np.int64))  # and it goes on after a reset
    finally:
        envs.close()
