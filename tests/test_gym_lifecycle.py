"""A gym env's life outside its steps: dropped without close(), built, refused up front.

An env dropped without ``close()`` is closed by its finalizer, which the garbage collector
runs on whatever thread it ran: there it only schedules the close on smolbench's loop,
which holds the close's task until it ends (a task held by nothing was dropped half done).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gymhelpers import define, needs_bwrap, up_bench
from test_session import Script

import smolbench.gym as sgym
from smolbench.server import ledgerview
from smolbench.workbench import Workbench

pytestmark = [needs_bwrap, pytest.mark.filterwarnings("ignore::UserWarning")]

CORRIDOR = '''
import gymnasium as gym
from gymnasium import spaces as S

class Corridor(gym.Env):
    observation_space = S.Discrete(10)
    action_space = S.Discrete(2)
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.p = 0
        return 0, {}
    def step(self, action):
        self.p = max(0, min(9, self.p + (1 if action else -1)))
        return self.p, float(self.p == 9), self.p == 9, False, {}

def corridor():
    return Corridor()
'''


@pytest.fixture(scope="module")
def bench(tmp_path_factory: Any) -> Iterator[Workbench]:
    for wb in up_bench(tmp_path_factory):
        define(wb, CORRIDOR)
        yield wb


SWEEP = """
import gc, sys, threading, time
import smolbench, smolbench.gym

def collect_elsewhere():
    t = threading.Thread(target=gc.collect)
    t.start()
    t.join()

with smolbench.Session(backend="sandbox", ledger="ledger.db") as s:
    s.run(%r)
    for _ in range(6):
        env = smolbench.gym.make("corridor", session=s)
        collect_elsewhere()
    del env
    collect_elsewhere()
    deadline = time.monotonic() + 90  # (the closes take a second or two)
    while len(s.workbench.backend.list()) > 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    collect_elsewhere()
    print("LEFT", sorted(m.name for m in s.workbench.backend.list()), flush=True)
"""


def test_envs_dropped_in_a_sweep_with_the_collector_on_another_thread_leave_nothing(tmp_path: Path) -> None:
    """The researcher's sweep: `env = make(...)` rebinds the last env, the collector runs on
    another thread. Warm parents and their 16 spares stayed until the session ended, with
    "Task was destroyed but it is pending! ... Spares._make()", "There is no current event
    loop in thread 'Thread-2 (collect)'" and "aclose(): asynchronous generator is already running"."""
    script = Script(tmp_path, SWEEP % CORRIDOR)
    try:
        code, out, err = script.finish(timeout=240)
    finally:
        script.clean()
    assert code == 0, err
    assert "LEFT ['root']" in out, out + err
    for bad in ("Task was destroyed", "no current event loop", "was never awaited", "aclose()", "Traceback"):
        assert bad not in err, err


@pytest.mark.parametrize("reset", ["fresh", "in-place"])
def test_replaying_a_training_episode_says_it_cannot(bench: Workbench, reset: str) -> None:
    """A gym episode is a node of the tree, but its actions are not recorded: replay said
    `reward None vs recorded 1.0: DIFFERENT`."""
    from smolbench import SmolbenchError, _loop

    env = sgym.make("corridor", session=bench, reset=reset)
    try:
        env.reset(seed=3)
        node = env.machine if reset == "fresh" else env._m.eps[0].node.id  # type: ignore[union-attr]
        run, parent = env._m.run_id, env._m.parent.name  # type: ignore[union-attr]
        while not env.step(1)[2]:
            pass
    finally:
        env.close()
    assert node is not None and bench.tree[node].reward == 1.0
    with pytest.raises(SmolbenchError) as err:
        _loop.run(bench.replay(node, lambda *a: None))
    assert str(err.value) == (f"can't replay {node}: it is an episode of a smolbench.gym env, whose actions are not "
                              "recorded (only its seed, return and length)")
    # the sidebar's server says so from the same rule: the run's Replay and the episode's are disabled
    said = {r["id"]: r for r in ledgerview.runs(bench.ledger.path, limit=500)["runs"]}
    assert said[run]["kind"] == "gym" and said[run]["best_node"] == node
    assert (said[run]["replayable"], said[run]["replay_refused"]) == (
        False, "can't replay: its best branch is an episode of a smolbench.gym env, whose actions are not recorded")
    tree = {n["id"]: n for n in ledgerview.nodes(bench.ledger.path, run=run, limit=500)["nodes"]}
    assert tree[node]["replay_refused"] == ("can't replay: it is an episode of a smolbench.gym env, whose actions "
                                            "are not recorded")
    assert tree[parent]["replay_refused"] is None  # the warm parent: not an episode


GRID_MODULE = '''
import gymnasium as gym
from gymnasium import spaces as S

SIZE = 4

class Grid(gym.Env):
    observation_space = S.Discrete(SIZE)
    action_space = S.Discrete(2)
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.p = 0
        return 0, {}
    def step(self, action):
        self.p = min(SIZE - 1, self.p + int(action))
        return self.p, 1.0, self.p == SIZE - 1, False, {}
'''


def test_an_env_class_from_the_users_own_module_beside_the_script(bench: Workbench, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`make(myenvs.Grid)` with myenvs.py beside the script failed: "the env could not be built
    in machine root.0: ModuleNotFoundError: No module named 'myenvs'" (cloudpickle sends an
    importable class by reference). The user's own module goes by value."""
    import importlib

    import cloudpickle

    name = f"myenvs_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(GRID_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    myenvs = importlib.import_module(name)
    for reset in ("fresh", "in-place"):
        env = sgym.make(myenvs.Grid, session=bench, reset=reset)
        try:
            assert env.reset(seed=0)[0] == 0
            assert env.step(1)[:3] == (1, 1.0, False)
        finally:
            env.close()
    assert name not in cloudpickle.list_registry_pickle_by_value()  # by value only while it was sent


def test_an_env_that_imports_what_the_machine_lacks_says_how_to_fix_it(bench: Workbench) -> None:
    def needs_a_module() -> Any:
        import smolbench_no_such_module  # type: ignore[import-not-found]  # noqa: F401

    with pytest.raises(sgym.GymError) as err:
        sgym.make(needs_a_module, session=bench)
    assert str(err.value).endswith("ModuleNotFoundError: No module named 'smolbench_no_such_module': the machine "
                                   "can't import it: define the env in the session's machine (s.run(code), or a "
                                   "%%smol cell) and make it by name, or install the module there (the Smolfile)")


def test_a_timeout_bounds_the_envs_constructor(bench: Workbench, monkeypatch: pytest.MonkeyPatch) -> None:
    """`make(..., timeout=2)` of an env whose __init__ never returns waited for ever. With a
    timeout set, the build is bounded by BUILD_TIMEOUT (600 s; 3 s here)."""
    from smolbench.gym import warmparent

    monkeypatch.setattr(warmparent, "BUILD_TIMEOUT", 3.0, raising=False)
    define(bench, '''
import time
def builds_for_ever():
    time.sleep(3600)
''')
    with pytest.raises(sgym.GymError) as err:
        sgym.make("builds_for_ever", session=bench, timeout=2)
    assert str(err.value).endswith(": building it took longer than 3 s (smolbench.gym.warmparent.BUILD_TIMEOUT, "
                                   "with timeout= set): its machine is deleted")
    assert str(err.value).startswith("the env could not be built in machine root.")
    assert {m.name for m in bench.backend.list()} == {bench.active}


@pytest.mark.parametrize("call", [lambda: sgym.make_vec("corridor", 0), lambda: sgym.make_vec(len, 2, reset="bogus"),
                                  lambda: sgym.make("corridor", timeout=-1), lambda: sgym.make(42)])
def test_bad_arguments_are_refused_before_anything_is_made(call: Any, capfd: pytest.CaptureFixture[str],
                                                           tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`make_vec("corridor", 0)` (no session: one of the env's own) booted a machine, and printed
    the sandbox fallback notice, before refusing the argument."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as err:
        call()
    assert isinstance(err.value, sgym.GymError)
    assert capfd.readouterr() == ("", "")
    assert not (tmp_path / ".smolbench").exists()
