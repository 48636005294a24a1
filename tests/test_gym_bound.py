"""Attacks on what the host holds while a vector step waits: every answer within what its spaces allow.

A vector step waits for every sub-env's answer. Each was decoded against the gate's own
limits (64 MB, a million JSON values) and held until the last sub-env answered; only then
was it checked against the observation space. The audit: a Box(4,) env whose sub-envs each
sent an 11.5M-item observation (or an info of ~1M JSON values), one after another so the
gate's in-flight cap never tripped, held ~46 MB (~93 MB) per sub-env: 1 GB at 24 sub-envs.
Now each gym connection holds its answers to what the largest valid one takes on the wire
(``smolbench/gym/answers.py`` ``wire_bound``): one over it is refused as its bytes arrive,
none of it decoded, as that sub-env's one-line error; the env goes on after a reset. And
no valid answer is refused: the largest ones the guest's own encoder writes (every kind of
space and info) pass, whole or in the chunks a socket gives.
"""

from __future__ import annotations

import json
import socket
import tracemalloc
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from gymhelpers import define, needs_bwrap, up_bench

import smolbench.gym as sgym
from smolbench import SmolbenchError
from smolbench.workbench import Workbench

BIG = '''
import time, numpy as np, gymnasium
from gymnasium import spaces

class Big(gymnasium.Env):
    """Box(4,); reset with options {"big": "obs"} (or "info"), its steps answer past what any
    valid answer of it takes: one after another, sub-env i after 0.2 * i s."""
    observation_space = spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = spaces.Discrete(2)
    me = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.me = seed if seed is not None else self.me
        self.how = (options or {}).get("big")
        return np.zeros(4, np.float32), {}

    def step(self, action):
        obs, info = np.full(4, 0.5, np.float32), {}
        if self.how == "obs":  # 10 MB: 13.3 MB as .npy in base64, ~8 MB past the env's bound (5.2 MB)
            obs = np.zeros(2_500_000, np.float32)
        elif self.how == "info":  # 1.9 MB (within the bytes) but 360,000 JSON values (the bound: 263,172)
            info = {"%06d" % j: j for j in range(120_000)}
        time.sleep(0.2 * self.me)
        return obs, 0.0, False, False, info
'''
N = 2


@pytest.fixture(scope="module")
def bench(tmp_path_factory: Any) -> Iterator[Workbench]:
    for wb in up_bench(tmp_path_factory):
        define(wb, BIG)
        yield wb


@pytest.fixture
def decoded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes of machine data decoded here (JSON parsed, base64 decoded), counted as the gate does it."""
    from smolbench.gate import channel, frames, pull

    seen = [0]

    class Counting(json.JSONDecoder):
        def decode(self, s: str, *args: Any, **kwargs: Any) -> Any:
            seen[0] += len(s)
            return super().decode(s, *args, **kwargs)

    strict, b64 = channel._strict_b64, pull._b64

    def counted_strict(data: Any) -> bytes:
        seen[0] += len(data)
        return strict(data)

    def counted_b64(value: Any, what: str) -> bytes:
        seen[0] += len(value) if isinstance(value, str) else 0
        return b64(value, what)

    monkeypatch.setattr(frames, "_DECODER", Counting(parse_constant=frames._DECODER.parse_constant))
    monkeypatch.setattr(channel, "_strict_b64", counted_strict)
    monkeypatch.setattr(pull, "_b64", counted_b64)
    return seen


@needs_bwrap
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("how, says", [("obs", "an answer of more than 5.2 MB: this env's answers take at most that"),
                                       ("info", "an answer of 360,011 JSON values, above 263,172: this env's answers")])
def test_an_answer_past_what_its_spaces_allow_is_refused_as_it_arrives_none_of_it_decoded(
        bench: Workbench, decoded: list[int], how: str, says: str) -> None:
    """Each sub-env of a Box(4,) env sends 13.3 MB (an observation) or 360,000 JSON values (an
    info): before, every answer was decoded and held until the last came (~50 MB here, and
    refused only then); now each is refused at its env's bound, nothing of it decoded."""
    envs = sgym.make_vec("Big", N, session=bench, reset="in-place")
    try:
        envs.reset(seed=0, options={"big": how})
        decoded[0] = 0
        tracemalloc.start()
        try:
            with pytest.raises(SmolbenchError) as refused:
                envs.step(np.zeros(N, np.int64))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert decoded[0] < 10_000, f"{decoded[0]:,} bytes decoded"  # none of the answers (a ping's reply: 852)
        assert peak < 12_000_000, f"{peak:,} bytes held at once while the step waited"  # before: ~50 MB
        line = str(refused.value)
        assert says in line and "sub-env 0 (machine root." in line and "\n" not in line, line
        obs, _ = envs.reset(seed=0)  # the env goes on (a new serving cell in each machine)
        assert obs.shape == (N, 4)
        assert (envs.step(np.zeros(N, np.int64))[0] == 0.5).all()
    finally:
        envs.close()


# -- no valid answer is refused: the guest's own encoder, the gate, the gym's checks ----------------


class _Agent:
    """What the guest's channel() needs of its agent: a connection, and where its answers go."""

    seed = None

    def __init__(self) -> None:
        self._conn, self._peer = socket.socketpair()
        self.lines: list[bytes] = []

    def send(self, msg: Any) -> None:
        from smolbench.guest import protocol as P

        self.lines.append(P.encode(msg))

    def send_line(self, data: bytes) -> None:
        self.lines.append(data)

    def apply_seed(self, seed: Any) -> None:
        pass


def _answered(space: Any, write: Any) -> list[Any]:
    """What the gate makes of the answers ``write(answer)`` sends with the guest's own encoder, fed
    in the chunks a socket reads them in (one, if it fits), held to ``space``'s bound."""
    from smolbench.backends._channel import READ
    from smolbench.backends.base import CellRequest
    from smolbench.gate.channel import AnswerError, Answers
    from smolbench.guest.guestapi import GuestAPI
    from smolbench.gym.answers import wire_bound

    agent = _Agent()
    try:
        _, answer = GuestAPI(agent).channel()
        write(answer)
    finally:
        agent._conn.close()
        agent._peer.close()
    bound = wire_bound(space)
    out = []
    for line in agent.lines:
        assert len(line) <= bound.size, (len(line), bound.size)
        answers = Answers(CellRequest("x"), "root.1", bound, owed=1)
        got = [a for k in range(0, len(line), READ) for a in answers.feed(line[k:k + READ])]
        assert len(got) == 1 and (not isinstance(got[0], BaseException) or isinstance(got[0], AnswerError)), got
        out.append(got[0])
    return out


def _infos() -> dict[str, dict[str, Any]]:
    """Infos as large as :data:`MAX_INFO` lets them be, each of what takes the most on the wire."""
    from smolbench.gym.info import MAX_INFO

    room = MAX_INFO - 64
    return {
        "astral text": {"t": "\U0001f600" * (room - 8)},  # 12 bytes a character as JSON
        "control text": {"t": "\x01" * (room - 8)},
        "floats": {"f": [-2.2250738585072014e-308] * (room // 9)},
        "big ints": {"i": [-(2**63)] * (room // 17)},
        "empty dicts": {"d": [{}] * (room // 3)},  # the most JSON values an info can hold
        "empty keys": {str(k): "" for k in range(room // 12)},
        "small arrays": {"a": [np.zeros(2)] * (room // 19)},  # each .npy ~190 bytes in base64
        "an image": {"frame": np.zeros((224, 224, 3), np.uint8), "s": "x" * (room - 150_600 - 20)},
        "nested": {"n": [[[[[]]]]] * (room // 12)},
    }


@pytest.mark.parametrize("info", sorted(_infos()))
def test_every_valid_step_and_reset_fits_the_bound(info: str) -> None:
    """A step (lean or not, with the env's random states when it ends) and a reset, each with an
    info at :data:`MAX_INFO`, for spaces whose observations take the most on the wire: a Box,
    a Dict of a Box and a numpy Discrete, a Tuple of astral Text, a Text sent as a numpy string."""
    import random

    from gymnasium import spaces as S

    from smolbench.gym import answers
    from smolbench.gym.episode import Episode
    from smolbench.gym.info import checked_info

    value = _infos()[info]
    assert checked_info(value, "sub-env 0") is value  # valid: within MAX_INFO
    astral = "".join(chr(c) for c in range(0x1F600, 0x1F650))
    cases = [
        (S.Box(-1.0, 1.0, (64, 64, 3), np.float32), np.zeros((64, 64, 3), np.float32)),
        (S.Dict({"x": S.Box(0, 255, (84, 84), np.uint8), "k" * 200: S.Discrete(5)}),
         {"x": np.zeros((84, 84), np.uint8), "k" * 200: np.int64(4)}),
        (S.Tuple([S.Text(1000, charset=astral), S.Text(10, min_length=10)]), (astral[0] * 1000, "a" * 10)),
        (S.Text(5000, charset="ab"), np.str_("a" * 5000)),
    ]
    rng = np.random.Generator(np.random.MT19937(1))
    twister = json.dumps({"kind": "Random", "state": random.Random(2).getstate()})
    states = {"state": json.dumps(rng.bit_generator.state, default=lambda a: a.tolist()), "seed": 1,
              "own": [twister] * 16}
    for space, obs in cases if info in ("astral text", "empty dicts") else cases[:1]:  # (the most bytes, values)
        step, reset = _answered(space, lambda answer, obs=obs: (answer.step(obs, 2, 3, value, states),
                                                                answer({"obs": obs, "info": value})))
        assert answers.step_answer(step, space, Episode(0), 1).info.keys() == value.keys()
        assert answers.reset_answer(reset, space, "sub-env 0")[1].keys() == value.keys()


def test_an_error_a_page_list_and_a_random_state_fit_the_bound() -> None:
    """The answers that carry no observation: an env's error (its message cut at 2,000 characters,
    100 frames), a practice episode's page list at its most, the random states a fresh reset asks for."""
    from gymnasium import spaces as S

    from smolbench.gym.practice import MAX_OWNED

    def fail(answer: Any) -> None:
        try:
            exec(compile("\n" * 5 + "def f(n):\n    return f(n - 1) if n else 1 / 0\nf(200)", "<env>", "exec"), {})
        except ZeroDivisionError as exc:
            exc.args = ("\U0001f600" * 5000,)
            answer(error=exc)

    (err,) = _answered(S.Discrete(2), fail)
    assert err.error["ename"] == "ZeroDivisionError" and err.error["traceback"]
    pages = {kind: [[2 * k + (1 << 51), 1] for k in range(cap)] for kind, cap in MAX_OWNED.items()}  # a run a page
    (got,) = _answered(S.Discrete(2), lambda answer: answer(pages))
    assert got == pages


def test_output_and_a_cells_end_keep_the_gates_own_limits_and_nothing_passes_for_them() -> None:
    """The bound holds for answers: the env's prints (dropped, counted against the output limit)
    and its serving cell's end keep the gate's limits; an answer spelt as either is refused."""
    from smolbench.backends.base import CellRequest
    from smolbench.gate.channel import Answers, Ended
    from smolbench.gate.frames import Bound
    from smolbench.guest import protocol as P

    bound = Bound(1000, 50, "this env's answers take at most that")
    text = "x" * 5000
    assert Answers(CellRequest("x"), "root.1", bound, owed=1).feed(P.encode({"t": "stream", "name": "stdout", "text": text})) == []
    done = P.encode({"t": "done", "status": "error", "error": {"ename": "E", "evalue": text, "traceback": []}})
    (ended,) = Answers(CellRequest("x"), "root.1", bound, owed=1).feed(done)
    assert isinstance(ended, Ended) and "E: xxx" in str(ended)
    for frame in (P.encode({"t": "answer", "value": {"format": "data", "data": text}}),
                  b'{"t":"stream","t":"answer","value":{"format":"data","data":"' + text.encode() + b'"}}\n',
                  P.encode({"t": "answer", "value": {"format": "data", "data": list(range(60))}})):
        (refused,) = Answers(CellRequest("x"), "root.1", bound, owed=1).feed(frame)
        assert isinstance(refused, SmolbenchError) and "malformed" in str(refused), refused
    (ok,) = Answers(CellRequest("x"), "root.1", bound, owed=1).feed(P.encode({"t": "answer", "value": {"format": "data",
                                                                                            "data": "x" * 900}}))
    assert ok == "x" * 900


# -- one request, one answer: what a sub-env sends unasked is never queued ---------------------

def test_an_answer_to_no_request_breaks_the_channel_with_the_answers_of_its_chunk() -> None:
    from smolbench.backends.base import CellRequest
    from smolbench.gate.channel import Answers
    from smolbench.guest import protocol as P

    line = P.encode({"t": "answer", "value": {"format": "data", "data": 1}})
    answers = Answers(CellRequest("x"), "root.1", owed=1)
    assert answers.feed(line) == [1] and not answers.broken and answers.owed == 0
    (refused,) = answers.feed(line)  # asked nothing
    assert isinstance(refused, SmolbenchError) and "an answer to no request" in str(refused) and answers.broken
    answers = Answers(CellRequest("x"), "root.1", owed=1)
    (refused,) = answers.feed(line + line)  # two answers to one request, in one write: neither is taken
    assert "an answer to no request" in str(refused) and answers.broken
    answers = Answers(CellRequest("x"), "root.1", owed=2)
    assert answers.feed(line + line) == [1, 1]
    # a cell's end is the channel's end, asked for or not
    answers = Answers(CellRequest("x"), "root.1", owed=0)
    (ended,) = answers.feed(P.encode({"t": "done", "status": "ok"}))
    assert answers.broken and "no request" not in str(ended)


OUT_OF_STEP = '''
import sys, time, numpy as np, gymnasium
from gymnasium import spaces

def _serving():
    """The guest's serving loop's api and answer (an env that rewrote its agent could write anything)."""
    f = sys._getframe(1)
    while f is not None and not ("answer" in f.f_locals and "api" in f.f_locals):
        f = f.f_back
    return f.f_locals["api"], f.f_locals["answer"]

def _line(answer, api, info):
    """The line the guest's own encoder writes for a step's answer with this info."""
    agent, got = api._agent, []
    send, send_line = agent.send, agent.send_line
    P = answer.step.__globals__["P"]
    agent.send = lambda msg: got.append(P.encode(msg))
    agent.send_line = lambda line: got.append(line)
    try:
        answer.step(np.zeros(1, np.float32), 1.0, 0, info, None)
    finally:
        agent.send, agent.send_line = send, send_line
    return got[0] if got[0].endswith(b"\\n") else got[0] + b"\\n"

class OutOfStep(gymnasium.Env):
    """Sub-env 2 answers its first step twice in one write (reset with options {"twice": True});
    at the second step, sub-env 1 is slow
    while sub-env 0 answers and then goes on answering, ~0.6 MB an answer, 40 times."""
    observation_space = spaces.Box(-100.0, 100.0, (1,), np.float32)
    action_space = spaces.Discrete(2)
    me = -1

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.me = 0, seed if seed is not None else self.me
        self.twice = (options or {}).get("twice", False)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.t += 1
        api, answer = _serving()
        if self.me == 2 and self.t == 1 and self.twice:
            line = _line(answer, api, {})
            api._agent.send_line(line + line)
        if self.me == 1 and self.t == 2:
            time.sleep(3)
        if self.me == 0 and self.t == 2:
            api._agent.send_line(_line(answer, api, {}))
            many = _line(answer, api, {"a": [[]] * 200_000})
            for _ in range(40):
                api._agent.send_line(many)
        return np.zeros(1, np.float32), 1.0, False, False, {}
'''


@needs_bwrap
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_answers_a_sub_env_sends_unasked_are_never_queued_on_the_host(
        bench: Workbench, decoded: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The audit: a vector step read every channel until all had answered, so a fast sub-env's
    answers after its own (each within its bound) were decoded and queued while a slow sibling
    worked: ~16 MB in 8 s held 432 MiB, 26 answers left queued, unbounded with no timeout; and
    a spare answer sent with the first passed for the next step's. Now a channel is read no
    further once its request is answered, and an answer to no request is that sub-env's
    one-line error."""
    define(bench, OUT_OF_STEP)
    envs = sgym.make_vec("OutOfStep", 3, session=bench, reset="in-place")
    try:
        envs.reset(seed=0, options={"twice": True})
        with pytest.raises(SmolbenchError) as refused:
            envs.step(np.zeros(3, np.int64))
        line = str(refused.value)
        assert "sub-env 2 (machine root." in line and "an answer to no request" in line and "\n" not in line, line
        envs.reset(seed=0)  # the env goes on
        envs.step(np.zeros(3, np.int64))
        decoded[0] = 0
        # on the loop (as where a sub-env's channel isn't held, e.g. a request still being written)
        from smolbench.gym import machines
        monkeypatch.setattr(machines, "ask_now", lambda chans, lines: None)
        envs.step(np.zeros(3, np.int64))  # sub-env 0 floods while sub-env 1 sleeps
        assert decoded[0] < 1_000_000, f"{decoded[0]:,} bytes decoded in one step"  # before: ~16 MB
        queued = [len(ep.chan._ready) for ep in envs._m.eps if ep.chan is not None]
        assert queued == [0, 0, 0], queued
    finally:
        envs.close()
