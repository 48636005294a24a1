"""Attacks from inside a machine on what smolbench.gym's host keeps: memory, and other sub-envs.

The machine's code can rewrite the guest (here: its ``plain`` info check, its space
descriptions), so every byte it sends is attacker data. A small description of spaces
must not make the host build hundreds of MB (one budget over all of an env's spaces,
batched copies included); an info with a non-text key, a set, or a Discrete observation
of 2**100 is refused in one line naming its sub-env, never a raw exception; and one
sub-env's bad answer never makes the host lose another sub-env's answer in the same
vector step (the one that ended there is autoreset next, not stepped past its end). What
one sample() of the action space costs, and a vector step's infos merged, are budgeted too.
"""

from __future__ import annotations

import string
import tracemalloc
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from gymhelpers import define, needs_bwrap, up_bench

import smolbench.gym as sgym
from smolbench import SmolbenchError
from smolbench.gym import envnames
from smolbench.gym.machines import GymError, Machines
from smolbench.workbench import Workbench

pytestmark = [needs_bwrap, pytest.mark.filterwarnings("ignore::UserWarning")]

ENVS = '''
import base64, sys, gymnasium, numpy as np
from gymnasium import spaces

BAD = {"int key": {"a": {1: 2}}, "None key": {"a": {None: 2}}, "set": {"a": set(range(40000))},
       "frozenset key": {"a": {frozenset([1]): 2}}}

class Answers(gymnasium.Env):
    """Obs [t, me]: ``me`` the seed of its first reset (the sub-env, under make_vec's seed=0)."""
    observation_space = spaces.Box(-10.0, 10.0, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, how):
        self.how, self.t, self.me = how, 0, -1

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.me = 0, seed if seed is not None else self.me
        return np.array([0, self.me], np.float32), {}

    def step(self, action):
        self.t += 1
        obs, ended, info = np.array([self.t, self.me], np.float32), False, {}
        if self.how in BAD:  # sub-env 0 sends it at its 2nd step, where sub-env 1 ends
            info = BAD[self.how] if (self.me, self.t) == (0, 2) else {}
            ended = (self.me, self.t) == (1, 2)
        elif self.how == "bad dtype":  # sub-env 0's 2nd answer: a .npy of a dtype numpy has no spelling for
            ended = (self.me, self.t) == (1, 2)
            if (self.me, self.t) == (0, 2):
                forge_dtype(sys._getframe(1).f_locals)
        elif self.how == "mixed":  # both honest data: sub-env 0 ends with a number, sub-env 1 says text
            info = {"a": 1 if self.me == 0 else "x"} if self.t == 2 else {}
            ended = (self.me, self.t) == (0, 2)
        return obs, 1.0, ended, False, info

class Counter(gymnasium.Env):
    observation_space = spaces.Discrete(3)
    action_space = spaces.Discrete(2)

    def __init__(self, where):
        self.where = where

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return (2**100 if self.where == "reset" else 0), {}

    def step(self, action):
        return 2**100, 1.0, False, False, {}

def forge_dtype(serving):  # the serving loop's answer rewritten, as the machine's code can
    api, answer = serving["api"], serving["answer"]
    real = answer.step
    def forged(*args, **kwargs):
        answer.step = real
        head = b"{'descr': '<b8', 'fortran_order': False, 'shape': (2,), }"
        head += b" " * (-(10 + len(head) + 1) % 64) + b"\\n"
        raw = b"\\x93NUMPY\\x01\\x00" + len(head).to_bytes(2, "little") + head + bytes(16)
        api._agent.send_line(b'{"t":"answer","step":{"o":"' + base64.b64encode(raw) + b'","r":1.0,"f":0,'
                             b'"i":{"format":"data","data":{"$":"dict","v":[]}}}}\\n')
    answer.step = forged

class ExtraAnswer(gymnasium.Env):
    """Its first step also answers once more (the serving loop's answer rewritten): every later
    answer then answers the request before it."""
    observation_space = spaces.Box(-100.0, 100.0, (1,), np.float32)
    action_space = spaces.Discrete(2)
    sent = False

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        if options and options.get("fail"):
            raise ValueError("this reset fails")
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.t += 1
        if not ExtraAnswer.sent:
            ExtraAnswer.sent = True
            sys._getframe(1).f_locals["answer"].step(np.full(1, 50, np.float32), 1.0, 0, {}, None)
        return np.full(1, self.t, np.float32), 1.0, False, False, {}

class BigActions(gymnasium.Env):
    """An honest env whose actions are 1 MiB (within the spaces' budget)."""
    observation_space = spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = spaces.MultiBinary((1024, 1024))

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        return np.zeros(1, np.float32), float(action.sum()), False, False, {}

def unchecked(env):  # the guest's info check rewritten away, as the machine's code can
    sys._getframe(2).f_globals["plain"] = lambda value, *args, **kwargs: value
    return env

def answers(how):
    return lambda: unchecked(Answers(how))

for _how in BAD:
    globals()["answers_" + _how.replace(" ", "_")] = answers(_how)
answers_mixed = lambda: Answers("mixed")
answers_bad_dtype = lambda: Answers("bad dtype")
discrete_step = lambda: unchecked(Counter("step"))
discrete_reset = lambda: unchecked(Counter("reset"))

def described(obs_description):  # the observation space as the machine says it is
    def factory():
        env = Answers("none")
        g = sys._getframe(1).f_globals
        real = g["space_data"]
        g["space_data"] = lambda space: obs_description if space is env.observation_space else real(space)
        return env
    return factory

ASTRAL = "".join(chr(c) for c in range(0x10000, 0x20000))
bits_4x16Mi = described({"type": "Dict", "spaces": [["k%d" % i, {"type": "MultiBinary", "n": [1 << 24]}] for i in range(4)]})
texts_12x64Ki = described({"type": "Tuple", "spaces": [{"type": "Text", "charset": ASTRAL, "min_length": 0,
                                                        "max_length": 1} for _ in range(12)]})
long_texts_128 = described({"type": "Tuple", "spaces": [{"type": "Text", "charset": "a", "min_length": 1 << 20,
                                                         "max_length": 1 << 20} for _ in range(128)]})
'''


@pytest.fixture(scope="module")
def bench(tmp_path_factory: Any) -> Iterator[Workbench]:
    for wb in up_bench(tmp_path_factory):
        define(wb, ENVS)
        yield wb


def one_line(exc: BaseException, names: str) -> str:
    line = str(exc)
    assert isinstance(exc, SmolbenchError) and names in line and "\n" not in line and len(line) < 1000, line
    return line


# -- 1. one budget for all of an env's spaces ---------------------------------------------

@pytest.mark.parametrize("name, vec", [("bits_4x16Mi", True), ("texts_12x64Ki", False), ("long_texts_128", True)])
def test_a_small_description_of_huge_spaces_is_refused_before_the_host_builds_them(bench: Workbench, name: str,
                                                                                 vec: bool) -> None:
    """4 MultiBinary(2**24) are ~300 bytes described; make_vec's batched form of them took
    ~335 MB here. 12 Text spaces of 65,536-character charsets (~9 MB described) took ~140 MB
    under plain make(). Both are refused in one line naming the budget, with the host's
    own allocations (tracemalloc, numpy's included) staying far below what they would take.
    128 Text spaces of a 1 MiB min_length (~10 KB described): make_vec's observation buffer
    holds a string that long for each and every sub-env (570 MiB at 4 sub-envs)."""
    before = set(bench.machines)
    tracemalloc.start()
    try:
        with pytest.raises(SmolbenchError) as refused:
            sgym.make_vec(name, 1, session=bench, reset="in-place") if vec else sgym.make(name, session=bench)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    line = one_line(refused.value, "described its env's spaces wrongly")
    assert "MAX_SPACE_BYTES" in line and "MiB" in line, line
    assert peak < 64 << 20, f"the host allocated {peak >> 20} MiB"
    assert set(bench.machines) == before


def _describe(observation: Any, num_envs: int, vector: bool = True, action: Any = None) -> Any:
    m = SimpleNamespace(n=num_envs, vector=vector)
    Machines._describe(m, {"observation_space": observation,  # type: ignore[arg-type]
                           "action_space": action or {"type": "Discrete", "n": 2, "start": 0}}, "root.1")
    return m


def test_bool_bounds_of_a_float64_box_count_at_float64_for_every_sub_env() -> None:
    """2 MB of bool bounds said dtype float64: 18 MB rebuilt, and make_vec(32) tiled it to 600 MB
    more. The budget counts what the rebuilt and batched spaces hold, not what was sent."""
    box = {"type": "Box", "low": np.zeros(1 << 20, bool), "high": np.ones(1 << 20, bool), "dtype": "float64"}
    assert _describe(box, 1, vector=False).observation_space.shape == (1 << 20,)  # make(): 18 MiB, within
    with pytest.raises(GymError) as refused:
        _describe(box, 32)
    line = one_line(refused.value, "batched for num_envs=32")
    assert "fewer sub-envs" in line


def test_the_leaves_of_all_spaces_are_counted_together() -> None:
    """A Tuple of 256 Tuples of 256 Discrete passed every per-node bound (65,536 spaces built here)."""
    inner = {"type": "Tuple", "spaces": [{"type": "Discrete", "n": 2, "start": 0}] * 256}
    with pytest.raises(GymError) as refused:
        _describe({"type": "Tuple", "spaces": [inner] * 256}, 1, vector=False)
    one_line(refused.value, "65,537 leaves in all: at most 4,096")


def test_a_dtype_that_is_not_plain_is_refused_as_such_not_priced() -> None:
    """The budget prices only the dtypes a space may have: a void dtype of 100 MB an item is
    refused for what it is."""
    box = {"type": "Box", "low": np.zeros(4), "high": np.ones(4), "dtype": "V100000000"}
    with pytest.raises(GymError) as refused:
        _describe(box, 1, vector=False)
    one_line(refused.value, "only plain numeric dtypes")


def test_real_sized_spaces_fit_the_budget_at_256_sub_envs() -> None:
    """Atari frames and stacked float frames, batched for make_vec's most sub-envs, still fit."""
    for shape, dtype, top in (((210, 160, 3), "uint8", 255), ((4, 84, 84), "float32", 1)):
        box = {"type": "Box", "low": np.zeros(shape, dtype), "high": np.full(shape, top, dtype), "dtype": dtype}
        assert _describe(box, 256).observation_space.shape == shape


def _box(shape: Any, dtype: str, top: float) -> dict[str, Any]:
    return {"type": "Box", "low": np.zeros(shape, dtype), "high": np.full(shape, top, dtype), "dtype": dtype}


def _text(longest: int, shortest: int = 0, charset: str = "".join(chr(c) for c in range(32, 127))) -> dict[str, Any]:
    return {"type": "Text", "charset": charset, "min_length": shortest, "max_length": longest}


@pytest.mark.parametrize("case", ["4,080 Text(2**20)", "Box of 2**24 bytes", "make_vec(4) of 5.5 M Box items"])
def test_an_action_space_whose_sample_costs_more_than_the_budget_is_refused_when_rebuilt(case: str) -> None:
    """The audit: ``action_space.sample()`` (the README's own call) was not in the spaces' budget.
    16 Dicts of 255 Text(2**20, min_length=2**20) were accepted (a Text's max_length was never
    counted) and a sample would take ~27 s; a Box of 2**24 bytes under make() took 1 GB and 4.9 s a
    sample; make_vec(4) of a Box of 5.5 M items (within the build budget) 1.3 GB. Each is now
    refused as it is rebuilt, in one line naming the budget, and never sampled."""
    from gymnasium import spaces as S

    texts = {"type": "Dict", "spaces": [[f"t{i}", _text(1 << 20, 1 << 20, "ab")] for i in range(255)]}
    action, n = {"4,080 Text(2**20)": ({"type": "Tuple", "spaces": [texts] * 16}, 0),
                 "Box of 2**24 bytes": (_box((1 << 24,), "uint8", 255), 0),
                 "make_vec(4) of 5.5 M Box items": (_box((5_500_000,), "uint8", 255), 4)}[case]
    sampled: list[Any] = []
    real = S.Space.sample
    with pytest.MonkeyPatch.context() as mp:  # (none is: a sample of any space would be noted)
        for kind in (S.Box, S.Text, S.Dict, S.Tuple):
            mp.setattr(kind, "sample", lambda self, *a, **k: sampled.append(self) or real(self, *a, **k))
        with pytest.raises(GymError) as refused:
            _describe({"type": "Discrete", "n": 2, "start": 0}, n, vector=bool(n), action=action)
    line = one_line(refused.value, "an action space one sample() of which")
    assert "MAX_SAMPLE_BYTES" in line and "max_length" in line and not sampled, line
    assert ("batched for num_envs=4" in line) == bool(n), line


def test_what_a_sample_is_counted_at_is_at_least_what_it_takes() -> None:
    """:func:`spaces.sample_bytes` prices a sample (batched as make_vec's action space) at no
    less than what it allocates here (tracemalloc), so the budget bounds the real cost."""
    from gymnasium import spaces as S
    from gymnasium.vector.utils import batch_space

    from smolbench.gym.spaces import sample_bytes

    for space, n in ((S.Box(0, 255, (1 << 16,), np.uint8), 4), (S.Box(-1.0, 1.0, (1 << 16,), np.float64), 0),
                     (S.Text(4096, min_length=4096, charset=string.printable), 8), (S.Text(1, charset="ab"), 0),
                     (S.Text(16, charset="".join(chr(c) for c in range(0x100, 0x10000))), 0), (S.MultiBinary(1 << 16), 4),
                     (S.MultiBinary(1 << 16), 0), (S.MultiDiscrete(np.full(1 << 16, 7)), 2),
                     (S.Dict({"a": S.Discrete(5), "b": S.Box(0, 9, (4096,), np.int64)}), 16)):
        sampling = batch_space(space, n) if n else space
        sampling.seed(0)
        sampling.sample()
        tracemalloc.start()
        try:
            sampling.sample()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak <= sample_bytes(space, n), (space, n, peak, sample_bytes(space, n))


def test_real_action_spaces_are_within_the_sample_budget_at_256_sub_envs() -> None:
    """What RL users step with: Atari frames (210x160x3) and 84x84x4 frame stacks with Discrete
    actions, MuJoCo's float actions, an LLM env's Text(8192) actions and prompts, a Dict of
    MultiDiscrete and text; all at make_vec's most sub-envs, and a Text of MAX_TEXT under make()."""
    from smolbench.gym.spaces import MAX_TEXT

    discrete = {"type": "Discrete", "n": 18, "start": 0}
    for obs, action in ((_box((210, 160, 3), "uint8", 255), discrete), (_box((84, 84, 4), "uint8", 255), discrete),
                        (_box((376,), "float64", 1e9), _box((17,), "float32", 0.4)),
                        (_text(32_000), _text(8192)),
                        (_box((8,), "float32", 1), {"type": "Dict", "spaces": [
                            ["move", {"type": "MultiDiscrete", "nvec": np.array([3, 4]), "start": np.zeros(2, np.int64),
                                      "dtype": "int64"}], ["say", _text(2048)]]})):
        assert _describe(obs, 256, action=action).action_space is not None
    assert _describe(_box((1,), "float32", 1), 1, vector=False, action=_text(MAX_TEXT)).action_space.max_length == MAX_TEXT


# -- 2, 3. malformed answers: one line naming the sub-env ---------------------------------

@pytest.mark.parametrize("name, says", [
    ("answers_int_key", "an info with a key 1, not text"),
    ("answers_None_key", "an info with a key None, not text"),
    ("answers_frozenset_key", "an info with a key of type frozenset, not text"),
    ("answers_set", "an info holding a set"),  # counted as 8 bytes before: 400,000 ints let through (now past
    # the env's bound of JSON values, refused before they are decoded: tests/test_gym_bound.py)
    ("discrete_step", "is outside its space Discrete(3)"),
    ("discrete_reset", "is outside its space Discrete(3)"),
])
def test_a_malformed_answer_is_one_line_naming_the_env(bench: Workbench, name: str, says: str) -> None:
    env = sgym.make(name, session=bench, reset="in-place")
    try:
        with pytest.raises(SmolbenchError) as refused:
            env.reset(seed=0)
            for _ in range(2):
                env.step(0)
        one_line(refused.value, says)
        assert "the env (machine root." in str(refused.value)
        if name != "discrete_reset":
            assert env.reset(seed=0)[0] is not None  # the env goes on
    finally:
        env.close()


@pytest.mark.parametrize("reset", ["in-place", "fresh"])
@pytest.mark.parametrize("name, blamed, ended", [("answers_int_key", 0, 1), ("answers_mixed", 1, 0),
                                                 ("answers_bad_dtype", 0, 1)])
def test_one_sub_envs_bad_answer_never_loses_anothers_end(bench: Workbench, reset: str, name: str, blamed: int,
                                                          ended: int) -> None:
    """At step 2 sub-env ``ended`` terminates while sub-env ``blamed`` sends an info that can't
    be taken: a non-text key, or (both honest data) text where the other sent a number, which
    Gymnasium's info batching can't hold. The step is that sub-env's one-line error, and the
    ended sub-env's end was still taken: the next step autoresets it (t back to 0, reward 0)
    rather than stepping its env past its end (t = 3). Before, the raw TypeError/ValueError
    left the host thinking it still ran."""
    envs = sgym.make_vec(name, 2, session=bench, reset=reset)
    try:
        envs.reset(seed=0)
        envs.step(np.zeros(2, np.int64))
        with pytest.raises(Exception) as refused:
            envs.step(np.zeros(2, np.int64))
        obs, rewards, terminated, truncated, _ = envs.step(np.zeros(2, np.int64))
        assert obs[ended, 0] == 0 and rewards[ended] == 0.0 and not terminated[ended], (obs, rewards)
        if name == "answers_mixed":  # its step was fine: it goes on
            assert obs[blamed, 0] == 3 and rewards[blamed] == 1.0
        one_line(refused.value, f"sub-env {blamed} (machine root.")
    finally:
        envs.close()


def test_one_answer_too_many_breaks_the_sub_env_only_until_its_next_reset(bench: Workbench) -> None:
    """The audit: a machine that answers once more than asked (its serving loop rewritten) had
    every later answer answer the request before it, so every reset was refused, for good; a
    later audit: its extra answers were queued on the host, as many as it sent. An answer to
    no request is refused when it is read with its step's answer or before the next request
    goes; one that comes later passes for the next step's (the machine's data is its own to
    lie about) until a reset's check refuses it. Either way one line, and the next reset
    starts a new serving cell, in step again."""
    env = sgym.make("ExtraAnswer", session=bench, reset="in-place")
    try:
        env.reset(seed=0)
        refused: list[BaseException] = []
        for _ in range(2):
            try:
                env.step(0)
            except SmolbenchError as exc:
                refused.append(exc)
                break
        if not refused:
            with pytest.raises(SmolbenchError) as at_reset:
                env.reset(seed=0)
            refused.append(at_reset.value)
        line = str(refused[0])
        assert "an answer to no request" in line or "answered a reset with something other than an observation" in line, line
        one_line(refused[0], "")
        obs, _ = env.reset(seed=0)
        assert obs[0] == 0
        assert [env.step(0)[0][0] for _ in range(3)] == [1, 2, 3]  # each answer is its own step's
    finally:
        env.close()


def test_a_reset_that_raises_begins_no_episode(bench: Workbench) -> None:
    """An honest env whose reset raises: the step after it is refused (as before any reset),
    not sent to an env in an unknown state as if its episode ran."""
    env = sgym.make("ExtraAnswer", session=bench, reset="in-place")
    try:
        with pytest.raises(SmolbenchError) as failed:
            env.reset(seed=0, options={"fail": True})
        one_line(failed.value, "ValueError: this reset fails")
        with pytest.raises(SmolbenchError, match="call reset"):
            env.step(0)
        assert env.reset(seed=0)[0][0] == 0
    finally:
        env.close()


def test_an_action_too_big_for_the_machine_to_read_is_one_line_before_it_is_sent(bench: Workbench) -> None:
    """The audit: a request line over what the machine reads ended its serving cell, and the
    step said only that the serving cell ended (the episode was lost)."""
    env = sgym.make("BigActions", session=bench, reset="in-place")
    try:
        env.reset(seed=0)
        with pytest.raises(SmolbenchError) as refused:
            env.step(env.action_space.sample())
        one_line(refused.value, "bytes as a request is more than the 1,048,576 a machine reads")
        assert env.reset(seed=0)[0][0] == 0  # nothing was sent: its serving cell goes on
    finally:
        env.close()


@pytest.mark.parametrize("reset", ["fresh", "in-place"])
def test_a_reset_too_big_for_the_machine_to_read_is_one_line_before_it_is_sent(bench: Workbench, reset: str) -> None:
    """The review: the same for a reset's options (a fresh reset's spare was lost with it)."""
    env = sgym.make("BigActions", session=bench, reset=reset)
    try:
        env.reset(seed=0)
        with pytest.raises(SmolbenchError) as refused:
            env.reset(seed=1, options={"x": "a" * 1_100_000})
        one_line(refused.value, "a reset of 1,100,")
        assert env.reset(seed=0)[0][0] == 0
    finally:
        env.close()


def test_an_integer_box_described_with_float_bounds_is_refused_in_one_line() -> None:
    """The audit: an integer Box described with infinite float bounds was cast before
    gymnasium saw it: rebuilt as Box(0, 0) with RuntimeWarnings on the host (int64's even
    inside gymnasium, the review found), so every observation was then refused as outside
    it. The guest sends an integer Box's bounds in its own dtype: anything else is refused."""
    import warnings

    from gymnasium import spaces as S

    from smolbench.gym.spaces import Refused, space_from_data

    def box(low: Any, high: Any, dtype: str) -> dict[str, Any]:
        return {"type": "Box", "dtype": dtype, "low": np.array([low]), "high": np.array([high])}

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for dtype in ("int8", "int64", "uint8"):
            with pytest.raises(Refused, match=f"a Box of {dtype} whose bounds are not integers"):
                space_from_data(box(-np.inf, np.inf, dtype))
        with pytest.raises(Refused, match="out of bounds of the dtype range"):
            space_from_data(box(-1000, 0, "int8"))
        with pytest.raises(Refused, match="NaN bounds"):
            space_from_data(box(np.nan, 0.0, "float32"))
        assert space_from_data(box(-3, 4, "int8")) == S.Box(-3, 4, (1,), np.int8)


def test_what_carries_over_to_the_next_fresh_episode_is_a_generator_state_only() -> None:
    """A fresh episode's machine continues the last one's random stream, from a state that
    machine sent: any text of up to 4 KiB went on to the next episode's machine (a channel
    between episodes, which fresh resets must not have). Now only a PCG64, PCG64DXSM or
    SFC64 state passes, rebuilt from its checked numbers; anything else starts a new stream."""
    import json

    from smolbench.gym.episode import plain_rng

    for gen in (np.random.PCG64(1), np.random.PCG64DXSM(2), np.random.SFC64(3)):
        sent = json.dumps(gen.state, default=lambda v: v.tolist() if hasattr(v, "tolist") else int(v))
        kept = plain_rng({"state": sent, "seed": 7})
        assert kept is not None and json.loads(kept["state"]) == json.loads(sent) and kept["seed"] == 7
    pcg = json.loads(json.dumps(np.random.PCG64(1).state))
    for smuggled in ({**pcg, "note": "to the next episode"}, {**pcg, "state": {**pcg["state"], "x": 1}},
                     {**pcg, "uinteger": "a message"}, {**pcg, "has_uint32": True}, {**pcg, "bit_generator": "Mine"},
                     {**pcg, "state": {"state": 1 << 128, "inc": 1}}, "plain text"):
        assert plain_rng({"state": json.dumps(smuggled), "seed": 1}) is None, smuggled
    assert plain_rng({"state": json.dumps(pcg), "seed": "a message"})["seed"] is None  # type: ignore[index]
    assert plain_rng({"state": json.dumps(pcg), "seed": 2**127})["seed"] == 2**127  # type: ignore[index]


def test_an_info_is_bounded_by_what_it_takes_as_json() -> None:
    """The serve audit: empty strings and containers counted 0 bytes, so an info of 990,000
    empty strings passed the 256 KiB bound and reached each client as 3 MB of JSON."""
    from smolbench.gym.info import MAX_INFO, checked_info

    for flood in ({"e": [""] * 990_000}, {"e": [{}] * 200_000}, {"e": [[]] * 200_000}):
        with pytest.raises(GymError, match=f"bytes: at most {MAX_INFO:,}"):
            checked_info(flood, "sub-env 0")
    honest = {"x": np.zeros(1000, np.float32), "names": ["a", "b"], "nested": {"k": 1.5, "t": None},
              "frame": np.zeros((224, 224, 3), np.uint8)}  # an image: counted at its 150 KB (the review)
    assert checked_info(honest, "sub-env 0") is honest


def test_names_a_machine_sends_for_a_did_you_mean_are_checked_and_bounded(bench: Workbench) -> None:
    """A mistyped env name's "did you mean" comes from the names the machine says it has: a
    name made to fit the line (a newline and a line of its own, characters no name has) is
    never suggested, however close, and only so many names, so long, are looked at."""
    define(bench, "globals()['CartPol\\nsmolbench: ok'] = globals()['CartPol\\n'] = globals()['CartPole!'] = "
                  "lambda: None\n")
    with pytest.raises(SmolbenchError) as got:
        sgym.make("CartPol", session=bench)
    assert str(got.value).endswith("did you mean 'CartPole-v1'?"), got.value  # not 'CartPol\n' (closer)
    many = {"names": ["CartPol\n", "x" * 101, 7, *(f"n{i}" for i in range(10**6))], "ids": ["Cart Pole-v1", "CartPole-v1"]}
    names, ids = envnames.known(many)
    assert names[:2] == ["n0", "n1"] and len(names) == envnames.MOST - 3 and ids == ["CartPole-v1"]
    assert envnames.known({"names": "CartPole", "ids": None}) == ([], None)  # not a list: nothing, ids from the host


def test_a_carried_mersenne_twister_is_its_words_only() -> None:
    """A legacy RandomState's and a random.Random's state carry on too (fresh episodes drew
    the warm parent's next number every time): only as a Mersenne Twister's 624 words, its
    position and its spare normal draw, rebuilt from those checked numbers; anything else
    (a message beside it, a word past 32 bits, a position past 624) starts a new stream."""
    import json
    import random

    from smolbench.gym.episode import plain_own

    rs = np.random.RandomState(5)
    rs.standard_normal()  # (a spare normal draw kept)
    legacy = {"kind": "RandomState", "state": json.loads(json.dumps(rs.get_state(legacy=False),
                                                                     default=lambda v: v.tolist()))}
    plain = {"kind": "Random", "state": json.loads(json.dumps(random.Random(5).getstate()))}
    [a, b] = plain_own({"own": [json.dumps(legacy), json.dumps(plain)]}) or []
    assert a is not None and json.loads(a) == legacy and b is not None and json.loads(b) == plain
    key = legacy["state"]["state"]["key"]
    words = plain["state"][1]
    for smuggled in ({**legacy, "note": "to the next episode"},
                     {**legacy, "state": {**legacy["state"], "gauss": "a message"}},
                     {**legacy, "state": {**legacy["state"], "state": {"key": [*key[:-1], 1 << 32], "pos": 3}}},
                     {**legacy, "state": {**legacy["state"], "state": {"key": key, "pos": 625}}},
                     {**legacy, "state": {**legacy["state"], "state": {"key": key + [1], "pos": 3}}},
                     {**plain, "state": [3, [*words[:-1], 700], None]}, {**plain, "state": [2, words, None]},
                     {**plain, "state": [3, words, "text"]}, {**plain, "kind": "Mine"}, {"kind": "Random"}):
        assert plain_own({"own": [json.dumps(smuggled)]}) == [None], smuggled
    assert plain_own({"own": ["x" * 20_000]}) == [None]


# -- 4. a vector step's infos merged within a budget ---------------------------------------

class _Vec:
    """What MachineVectorEnv._infos needs: num_envs, gymnasium's own _add_info, the sub-envs."""

    def __init__(self, n: int) -> None:
        from gymnasium.vector import VectorEnv

        from smolbench.gym.episode import Episode
        from smolbench.gym.vector import MachineVectorEnv

        self.num_envs, self._m = n, SimpleNamespace(eps=[Episode(i) for i in range(n)])
        self._add_info = VectorEnv._add_info.__get__(self)
        self.infos = MachineVectorEnv._infos.__get__(self)


def test_infos_whose_keys_differ_per_sub_env_are_refused_before_they_are_merged() -> None:
    """The audit: gymnasium's _add_info makes two arrays of num_envs for every key any sub-env
    sent, so 32 sub-envs each sending ~11,000 keys of their own (each info within MAX_INFO)
    merged into 620 MB and 2 s a step, growing as num_envs**2. Now the distinct keys (nested
    ones counted) are budgeted before anything is merged: one line naming the sub-env that
    brought the most and the fix, with the host's allocations a fraction of the merge's."""
    from smolbench.gym.info import checked_info

    n = 16
    each = [(i, {f"{i:x}.{j:x}": 0 for j in range(11_000)}) for i in range(n)]
    each[5][1].update({f"n{j}": {"a": 1.5} for j in range(600)})  # nested: sub-env 5 brought the most
    assert all(checked_info(info, "sub-env") is info for _, info in each)  # each info alone is fine
    tracemalloc.start()
    try:
        with pytest.raises(GymError) as refused:
            _Vec(n).infos(each)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    line = one_line(refused.value, "different keys (nested keys counted), too many to batch for 16 sub-envs")
    assert "most came from sub-env 5: 12,200, sub-env 0: 11,000" in line and "and 13 more sub-envs" in line, line
    assert "send the same few keys from every sub-env" in line and "MAX_MERGED" in line, line
    assert peak < 8 << 20, f"the host allocated {peak >> 20} MiB"  # merged: ~75 MiB


def test_real_infos_merge_as_gymnasium_merges_them_at_256_sub_envs() -> None:
    """Within the budget nothing changes: Atari's and RecordEpisodeStatistics' infos, 40 metrics
    and SAME_STEP's final infos, and 20 keys that name their own sub-env, at 256 sub-envs."""
    from gymnasium.vector import VectorEnv

    n = 256
    each: list[tuple[int, dict[str, Any]]] = []
    for i in range(n):
        info: dict[str, Any] = {"lives": 3, "episode_frame_number": i, "episode": {"r": 1.0, "l": 7, "t": 0.5},
                                **{f"metric/{k}": float(k) for k in range(40)}, **{f"env{i}/x{k}": k for k in range(20)}}
        each.append((i, info))
        if i % 3 == 0:
            each.append((i, {"final_obs": np.zeros(4), "final_info": dict(info)}))
    got = _Vec(n).infos(each)

    class Plain(VectorEnv):  # type: ignore[type-arg]
        num_envs = n

    want: dict[str, Any] = {}
    for i, info in each:
        want = Plain()._add_info(want, info, i)
    assert len(got) == 2 * (3 + 40 + 20 * n + 2)
    finals = got.pop("final_obs"), want.pop("final_obs")
    assert [x is None for x in finals[0]] == [x is None for x in finals[1]] == [i % 3 != 0 for i in range(n)]
    np.testing.assert_equal(got, want)


KEY_FLOOD = '''
import gymnasium, numpy as np
from gymnasium import spaces

class KeyFlood(gymnasium.Env):
    """Obs [t, me]; at step 2 each sub-env's info is 11,000 keys of its own (sub-env 3's 11,500),
    each info within MAX_INFO, and the last sub-env ends."""
    observation_space = spaces.Box(-10.0, 10.0, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.me = 0, seed if seed is not None else self.me
        return np.array([0, self.me], np.float32), {"episode": {"r": 0.0}}

    def step(self, action):
        self.t += 1
        info = {"lives": 3}
        if self.t == 2:
            info = {"%x.%x" % (self.me, j): 0 for j in range(11_000 + 500 * (self.me == 3))}
        return np.array([self.t, self.me], np.float32), 1.0, (self.me, self.t) == (7, 2), False, info
'''


def test_a_vector_step_whose_infos_would_merge_past_the_budget_is_one_line_and_the_env_goes_on(
        bench: Workbench) -> None:
    """End to end, 8 sub-envs each sending 11,000 keys of its own (88,500 in all) at step 2,
    where sub-env 7 ends: the step is one line naming the problem, sub-env 3 (the most keys) and
    the fix; every sub-env's state was taken, so the next step autoresets sub-env 7 and steps
    the others on (as for any info that does not batch)."""
    define(bench, KEY_FLOOD)
    envs = sgym.make_vec("KeyFlood", 8, session=bench, reset="in-place")
    try:
        envs.reset(seed=0)
        assert envs.step(np.zeros(8, np.int64))[4]["lives"].tolist() == [3] * 8
        with pytest.raises(SmolbenchError) as refused:
            envs.step(np.zeros(8, np.int64))
        line = one_line(refused.value, "different keys (nested keys counted), too many to batch for 8 sub-envs")
        assert "most came from sub-env 3 (machine root." in line and ": 11,500, sub-env 0 (machine root." in line, line
        assert "and 5 more sub-envs: send the same few keys from every sub-env" in line, line
        obs, rewards, terminated, _, infos = envs.step(np.zeros(8, np.int64))
        assert obs[:, 0].tolist() == [3] * 7 + [0] and rewards.tolist() == [1.0] * 7 + [0.0], (obs, rewards)
        assert infos["_lives"].tolist() == [True] * 7 + [False] and infos["_episode"].tolist() == [False] * 7 + [True]
    finally:
        envs.close()
