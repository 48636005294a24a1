"""Fresh resets' spares, warmed with what a practice episode touched (issue 28).

A spare branch waits for its episode's reset; each page its episode writes first costs a
copy (copy-on-write), and each page of code it runs first a mapping. A practice episode,
in a branch no real episode runs in, says which pages it made its own (guest/gymserve.py
``owned_pages``, smolbench/gym/practice.py); spares take those ahead (``_populate``: the
kernel copies or maps them, nothing is written). Shown here: episodes on such spares still
start from the warm parent, memory the last episode wrote included; no real episode's
touches reach the list (a page's presence is visible in a spare: that would be a channel
between episodes); a page list is machine data, checked on the host and harmless in the
spare whatever it names; finished machines are deleted together, and none lingers.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gymhelpers import WAITING, define, needs_bwrap, up_bench, waits
from nbhelpers import tagged_processes
from test_session import Script

import smolbench.gym as sgym
from smolbench import _loop
from smolbench.backends._agenthost import AgentHostBackend
from smolbench.gym import practice, warmparent
from smolbench.workbench import Workbench

pytestmark = [needs_bwrap, pytest.mark.filterwarnings("ignore::UserWarning")]

# Each step scribbles over a MiB of the env's memory (pages a learned list then names);
# reset says whether that memory is still the warm parent's.
SCRIBBLER = '''
import hashlib, gymnasium
from gymnasium import spaces

MEMORY = bytearray(range(256)) * 4096
WARM = hashlib.sha256(MEMORY).hexdigest()

class Scribbler(gymnasium.Env):
    observation_space = spaces.Discrete(3)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return int(hashlib.sha256(MEMORY).hexdigest() != WARM) + 2 * int(MEMORY[0] != 0), {}

    def step(self, action):
        self.t += 1
        for k in range(0, len(MEMORY), 4096):
            MEMORY[k] = (MEMORY[k] + 1) % 256
        return 0, 1.0, self.t >= 2, False, {}

def scribbler():
    return Scribbler()
'''


def _practised(env: Any) -> str | None:
    """The env's page list once its practice episode has ended (a busy host can run 40
    episodes before it does), at most 30 s from now; None if it said nothing."""
    deadline = time.monotonic() + 30
    while env._m._pages is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return env._m._pages


@pytest.fixture(scope="module")
def bench(tmp_path_factory: Any) -> Iterator[Workbench]:
    yield from up_bench(tmp_path_factory)


def test_spares_warmed_with_a_finished_episodes_pages_still_start_from_the_warm_parent(bench: Workbench) -> None:
    define(bench, SCRIBBLER)
    env = sgym.make("scribbler", session=bench)
    try:
        for episode in range(40):  # past two refills: most of these run on spares made after the practice
            assert env.reset(seed=episode)[0] == 0, f"episode {episode} started from another episode's memory"
            while not env.step(0)[2]:
                pass
        learned = json.loads(_practised(env) or "{}")
        # the scribbled MiB is among what the practice episode made its own (256 pages at least)
        assert sum(count for _, count in learned.get("w", [])) >= 256
    finally:
        env.close()


# Scribbles over its MiB only in real episodes (reset with a seed other than the practice's),
# so what a real episode touched is told apart from what the practice did.
TELLER = SCRIBBLER.replace("def scribbler", """
import ctypes, os
ADDRESS = ctypes.addressof((ctypes.c_char * len(MEMORY)).from_buffer(MEMORY)) // os.sysconf("SC_PAGE_SIZE")

class Teller(Scribbler):
    def reset(self, *, seed=None, options=None):
        self.real = seed not in (None, 0) or getattr(self, "real", False) and seed is None
        return super().reset(seed=seed, options=options)

    def step(self, action):
        if self.real:
            return super().step(action)
        self.t += 1
        return 0, 1.0, self.t >= 2, False, {}

def teller():
    return Teller()

def scribbler""")


def _runs_cover(runs: list[list[int]], first: int, count: int) -> int:
    return sum(max(0, min(a + n, first + count) - max(a, first)) for a, n in runs)


def test_no_real_episode_tells_the_spares_what_it_touched(bench: Workbench) -> None:
    """The page list comes from the practice episode only: a real episode that writes a MiB
    (256 pages) leaves no trace in what later spares take ahead."""
    define(bench, TELLER)
    res = _loop.run(bench.run_cell("print(ADDRESS, len(MEMORY) // os.sysconf('SC_PAGE_SIZE'))", lambda e: None))
    first, count = map(int, res.stdout.split())
    env = sgym.make("teller", session=bench)
    try:
        for episode in range(1, 41):  # real episodes (seeds 1..40) scribble; past two refills
            env.reset(seed=episode)
            while not env.step(0)[2]:
                pass
        learned = json.loads(_practised(env) or "{}")
        assert learned.get("w"), "the practice episode said nothing"
        assert _runs_cover(learned["w"], first, count) < 16, "a real episode's pages reached the spares' list"
    finally:
        env.close()


# gymnasium.make wraps an env in a PassiveEnvChecker, which checks its first reset and steps,
# once. reset's info says whether the checker had checked already (then it does not again).
CHECKED = '''
import gymnasium
from gymnasium.wrappers.common import PassiveEnvChecker

class SaysChecked(gymnasium.Wrapper):
    def reset(self, **kwargs):
        checker = self.env
        while not isinstance(checker, PassiveEnvChecker):
            checker = checker.env
        before = checker.checked_reset
        obs, info = self.env.reset(**kwargs)
        return obs, {"checked_before": before}

class FailsPractice(gymnasium.Wrapper):  # the practice episode's reset (seed 0) fails
    def reset(self, *, seed=None, options=None):
        if seed == 0:
            raise RuntimeError("no practice here")
        return self.env.reset(seed=seed, options=options)

def checked_cartpole():
    return SaysChecked(gymnasium.make("CartPole-v1"))

def unpractised_cartpole():
    return SaysChecked(FailsPractice(gymnasium.make("CartPole-v1")))
'''


def _checked_before(env: Any, episodes: range) -> list[bool]:
    seen = []
    for episode in episodes:  # past two refills: the later ones run on spares made after the practice
        seen.append(env.reset(seed=episode)[1]["checked_before"])
        while not any(env.step(0)[2:4]):
            pass
    return seen


def test_gymnasiums_env_checker_runs_once_per_env_not_once_per_fresh_episode(bench: Workbench) -> None:
    """Every fresh episode is a copy of the warm parent's never-reset env, so gymnasium's
    passive checker ran again in each (~0.2 ms of a fresh reset). The practice episode ran it
    on the same env: spares made after it count it as done, as one long-lived env would."""
    define(bench, CHECKED)
    env = sgym.make("checked_cartpole", session=bench)
    try:
        assert _practised(env) is not None, "the practice episode said nothing"
        seen = _checked_before(env, range(1, 41))
        assert all(seen[-8:]), f"spares after the practice checked again: {seen}"
    finally:
        env.close()


def test_a_practice_that_failed_never_lets_a_spare_skip_the_checks(bench: Workbench) -> None:
    """The attack on the above: an env whose practice fails gives its spares no page list,
    and so no word that the checks passed: each episode's checker runs."""
    define(bench, CHECKED)
    env = sgym.make("unpractised_cartpole", session=bench)
    try:
        seen = _checked_before(env, range(1, 41))
        assert env._m._pages is None
        assert not any(seen), f"a spare skipped checks no practice passed: {seen}"
    finally:
        env.close()


def test_no_practice_branch_where_spares_keep_no_connection(bench: Workbench, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend with no kept connections (smol, a Ray cluster: a cell per request) can't
    give spares pages ahead, so no practice episode runs there: on smol a branch is a VM."""
    monkeypatch.delattr(AgentHostBackend, "open_channel")  # as the smol and cluster backends have none
    made: list[str] = []
    branch = bench.backend.branch

    async def counted(machine: Any, names: list[str], *args: Any, **kwargs: Any) -> Any:
        made.extend(names)
        return await branch(machine, names, *args, **kwargs)

    monkeypatch.setattr(bench.backend, "branch", counted)
    define(bench, SCRIBBLER)
    env = sgym.make("scribbler", session=bench)
    try:
        for episode in range(3):  # on spares, each a cell per request
            assert env.reset(seed=episode)[0] == 0
            while not env.step(0)[2]:
                pass
        assert len(made) == 1 + env._m.pool.count, made  # the warm parent and its spares, nothing else
    finally:
        env.close()


def test_finished_episodes_machines_are_deleted_together_and_none_lingers(bench: Workbench) -> None:
    define(bench, SCRIBBLER)
    env = sgym.make("scribbler", session=bench)
    try:
        env.reset(seed=0)
        first = env.machine
        env.step(0)
        env.reset(seed=1)  # one finished machine: not a batch, so deleted after a short wait
        assert first not in bench.machines
        deadline = time.monotonic() + 30
        while first in {m.name for m in bench.backend.list()} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first not in {m.name for m in bench.backend.list()}
    finally:
        env.close()


@pytest.mark.parametrize("bad", [
    None, [], "w", {"x": []}, {"w": "0 1"}, {"w": [[1]]}, {"w": [[1, 2, 3]]}, {"w": [[True, 1]]}, {"w": [[1, 0]]},
    {"w": [[-1, 1]]}, {"w": [[1 << 52, 1]]}, {"w": [[1.0, 1]]}, {"w": [[0, practice.MAX_OWNED["w"] + 1]]},
    {"w": [[4 * k, 3] for k in range(practice.MAX_OWNED["w"] // 3 + 1)]},  # more pages in all than a spare takes
    {"r": [[k, 1] for k in range(0, 4 * (practice.MAX_RUNS + 1), 4)]},  # more runs than a serving cell carries
])
def test_a_page_list_from_a_machine_is_checked(bad: Any) -> None:
    assert practice.checked(bad) is None


def test_a_checked_page_list_is_plain_json() -> None:
    assert json.loads(practice.checked({"w": [[10, 2], [20, 1]], "r": [[5, 100]]}) or "") == {"w": [[10, 2], [20, 1]],
                                                                                          "r": [[5, 100]]}


# In a process of its own: take ahead every page of every mapping it has (and some it has
# not), as a hostile list would name them; its memory reads the same afterwards.
POPULATE_ALL = '''
import hashlib, importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("gymserve", sys.argv[1])
g = importlib.util.module_from_spec(spec)
spec.loader.exec_module(g)
data = bytearray(os.urandom(1 << 20))
before = hashlib.sha256(data).hexdigest()
size = os.sysconf("SC_PAGE_SIZE")
runs = {"w": [], "r": []}
for line in open("/proc/self/maps"):
    fields = line.split()
    lo, hi = (int(x, 16) // size for x in fields[0].split("-"))
    runs["w" if "w" in fields[1] else "r"].append([lo, hi - lo])
runs["w"] += [[0, 16], [(1 << 47) // size - 8, 4], [1 << 40, 1 << 20]]  # unmapped: skipped
g._populate(json.loads(json.dumps(runs)))
print(json.dumps([hashlib.sha256(data).hexdigest() == before, len(runs["w"]) + len(runs["r"])]))
'''


def test_taking_pages_ahead_never_changes_them() -> None:
    out = subprocess.run([sys.executable, "-c", POPULATE_ALL, str(warmparent.GUEST)], capture_output=True, text=True,
                         timeout=120, check=True)
    same, mappings = json.loads(out.stdout)
    assert same and mappings > 10


# The action space is the machine's description, and the practice episode samples it on
# smolbench's event loop: a Box of 2**24 bytes, within the spaces' budget, took ~1 GB and
# 0.75 s a sample, 200 times.
ACTIONS = '''
import gymnasium, numpy as np
from gymnasium import spaces

class Actions(gymnasium.Env):
    observation_space = spaces.Discrete(2)

    def __init__(self, items):
        self.action_space = spaces.Box(0, 255, (items,), np.uint8)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return 0, {}

    def step(self, action):
        return int(action.sum() % 2), 1.0, True, False, {}

def costly_actions():
    return Actions(1 << 17)  # 8 MiB a sample here: twice practice.PRACTICE_SAMPLE_BYTES

def cheap_actions():
    return Actions(1 << 10)
'''


def test_an_action_space_costly_to_sample_is_never_sampled_for_practice(bench: Workbench,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import gymnasium

    define(bench, ACTIONS)
    sampled: list[tuple[int, ...]] = []
    real = gymnasium.spaces.Box.sample
    monkeypatch.setattr(gymnasium.spaces.Box, "sample",
                        lambda self, *a, **k: sampled.append(self.shape) or real(self, *a, **k))
    for name, items in (("cheap_actions", 1 << 10), ("costly_actions", 1 << 17)):
        env = sgym.make(name, session=bench)
        try:
            deadline = time.monotonic() + 60
            while not env._m._practice.done() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert env._m._practice.done()
            practised = (items,) in sampled
            assert practised == (items == 1 << 10), f"{name}: sampled {sampled.count((items,))} times for practice"
            assert (env._m._pages is not None) == practised
            env.reset(seed=1)
            assert env.step(np.ones(items, np.uint8))[1] == 1.0  # the env runs all the same, on unwarmed spares
        finally:
            env.close()


# An env whose step never ends (it names its thread first, so a test sees it stuck there):
# only the practice episode steps it below, the user's episode is reset and never stepped.
HANG = f'''
import ctypes, gymnasium

class Hang(gymnasium.Wrapper):
    def step(self, action):
        ctypes.CDLL(None).prctl(15, {WAITING.encode()!r}, 0, 0, 0)
        while True:
            pass

def hang():
    return Hang(gymnasium.make("CartPole-v1"))
'''


def test_close_stops_a_practice_episode_stuck_in_its_step_and_deletes_its_machine(tmp_path: Path) -> None:
    """The practice episode is smolbench's, not the user's: ``close()`` stops it and deletes
    its machine. On the old code close waited for it to run out its own 20 s
    (``practice.PRACTICE_TIMEOUT``): closed here once its step is stuck, that is ~19 s;
    the bound below is less than half of that, and far above what a close takes."""
    script = Script(tmp_path, f"""\
import os, time, smolbench, smolbench.gym
with smolbench.Session(backend="sandbox", ledger="ledger.db") as s:
    s.run({HANG!r})
    e = smolbench.gym.make("hang", session=s)
    e.reset(seed=0)
    print("reset", flush=True)
    while not os.path.exists("close"):
        time.sleep(0.05)
    start = time.monotonic()
    e.close()
    print(f"closed in {{time.monotonic() - start:.1f}} s", flush=True)
    print("machines", sorted(m.name for m in s.workbench.backend.list()) == [s.workbench.active], flush=True)
    while not os.path.exists("end"):
        time.sleep(0.05)
""")
    try:
        script.wait_for_line("reset")

        def stuck() -> bool:
            return waits([(p.pid, "") for p in tagged_processes(script.tag)])
        deadline = time.monotonic() + 120
        while not stuck():  # the practice episode's step has begun, and never ends
            assert time.monotonic() < deadline and script.proc.poll() is None, "the practice episode never stepped"
            time.sleep(0.1)
        (tmp_path / "close").touch()
        assert script.proc.stdout is not None
        closed, machines = script.proc.stdout.readline(), script.proc.stdout.readline()  # (or "" if it died)
        assert not stuck(), "the practice episode's machine still spins after close()"
    finally:
        (tmp_path / "end").touch()
    code, out, err = script.finish()
    assert code == 0, closed + machines + out + err
    took = re.fullmatch(r"closed in ([0-9.]+) s\n", closed)
    assert took and float(took[1]) < 8, closed + err
    assert machines == "machines True\n", machines + err  # close left only the session's own machine
    assert script.leftovers() == ([], [], [])
