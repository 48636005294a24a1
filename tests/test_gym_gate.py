"""Attacks from inside a machine on smolbench.gym: everything crosses the gate as data.

Each env below is hostile code in the machine: it rewrites the agent's pull encoding to
send a pickle (one that would touch a file here if it were ever unpickled) or an object
array, sends an observation far bigger than its space, of the wrong dtype or structure,
a NaN reward, or describes impossible spaces. The lean form a step's answer takes
is forged too (an object array, a pickled info, unknown fields, flags out of range). Each is
refused in one line naming the env, nothing is unpickled, and the env goes on after a reset (the next episode is a new
branch of the warm parent, which the attack never touched).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gymhelpers import define, needs_bwrap, up_bench

import smolbench.gym as sgym
from smolbench import SmolbenchError
from smolbench.workbench import Workbench

pytestmark = [needs_bwrap, pytest.mark.filterwarnings("ignore::UserWarning")]

HOSTILE = '''
import os, sys, pickle, base64, gymnasium, numpy as np
from gymnasium import spaces

class Boom:
    def __init__(self, path):
        self.path = path
    def __reduce__(self):  # what unpickling it would do: touch a file on the host
        return (os.system, ("touch " + self.path,))

class Hostile(gymnasium.Env):
    observation_space = spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, how):
        self.how = how

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(4, np.float32), {}

    def step(self, action):
        obs, reward, info = np.zeros(4, np.float32), 1.0, {}
        data = sys.modules["_smolbench_guest.pulldata"]
        if self.how == "pickle":
            blob = base64.b64encode(pickle.dumps(Boom(MARKER))).decode()
            data._pull = lambda value, trusted: {"format": "pickle", "data": blob}  # cells' and channels' encoding
            info = {"k": 1}  # (an empty one is written without _pull: guestapi.LEAN_TAIL)
        elif self.how == "object-npy":
            def npy(arr):
                import io
                buf = io.BytesIO()
                np.save(buf, np.array([Boom(MARKER)], dtype=object), allow_pickle=True)
                return base64.b64encode(buf.getvalue()).decode()
            data._npy = npy
        elif self.how == "huge":  # past what any answer of this env takes: refused as it arrives
            obs = np.zeros(2_000_000, np.float32)
        elif self.how == "long":  # within it: refused by the space
            obs = np.zeros(1000, np.float32)
        elif self.how == "float64":
            obs = np.zeros(4, np.float64)
        elif self.how == "dict":
            obs = {"x": np.zeros(4, np.float32)}
        elif self.how == "outside":
            obs = np.full(4, 5.0, np.float32)
        elif self.how == "nan":
            reward = float("nan")
        elif self.how == "bool-reward":  # past the server's own float(): what the host gets is True
            sys._getframe(1).f_globals["_reward"] = lambda value: value
            reward = True
        elif self.how.startswith("lean-"):  # a forged step answer in the lean form, sent instead of the real one
            agent = sys.modules["smolbench_guest"]._agent
            agent.send({"t": "answer", "step": lean(self.how)})
            real = agent.send, agent.send_line
            def instead(*args):  # (one request, one answer: the real one is not sent)
                agent.send, agent.send_line = real
            agent.send = agent.send_line = instead
        return obs, reward, False, False, info

def _npy_of(arr, allow_pickle=False):
    import io
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=allow_pickle)
    return base64.b64encode(buf.getvalue()).decode()

def lean(how):
    ok = {"o": _npy_of(np.zeros(4, np.float32)), "r": 1.0, "f": 0, "i": {"format": "data", "data": {"$": "dict", "v": []}}}
    if how == "lean-object-obs":
        return {**ok, "o": _npy_of(np.array([Boom(MARKER)], dtype=object), allow_pickle=True)}
    if how == "lean-pickle-info":
        return {**ok, "i": {"format": "pickle", "data": base64.b64encode(pickle.dumps(Boom(MARKER))).decode()}}
    if how == "lean-huge-obs":
        return {**ok, "o": _npy_of(np.zeros(2_000_000, np.float32))}
    if how == "lean-long-obs":
        return {**ok, "o": _npy_of(np.zeros(1000, np.float32))}
    if how == "lean-extra":
        return {**ok, "x": 1}
    if how == "lean-flags":
        return {**ok, "f": 7}
    if how == "lean-both":
        return {**ok, "ov": {"format": "data", "data": 1}}
    if how == "lean-nan":
        return {**ok, "r": {"$": "float", "v": "nan"}}
    if how == "lean-bigint":  # a whole number past a float's range (was an OverflowError, not a line)
        return {**ok, "r": 10**400}
    if how == "lean-padding":  # the host's lean fast path's shape, but not base64
        return {**ok, "o": "AAA"}
    if how == "lean-short":  # the fast path's shape and a plain .npy header, one item short
        return {**ok, "o": base64.b64encode(base64.b64decode(ok["o"])[:-4]).decode()}
    return {**ok, "o": 12}  # lean-not-text

def forged(description):
    def factory():
        sys._getframe(1).f_globals["space_data"] = lambda space: description
        return Hostile("none")
    return factory

for _how in ("pickle", "object-npy", "huge", "long", "float64", "dict", "outside", "nan", "bool-reward", "lean-object-obs",
             "lean-pickle-info", "lean-huge-obs", "lean-long-obs", "lean-extra", "lean-flags", "lean-both", "lean-nan", "lean-not-text",
             "lean-bigint", "lean-padding", "lean-short"):
    globals()["hostile_" + _how.replace("-", "_")] = (lambda h: lambda: Hostile(h))(_how)
box_bounds_differ = forged({"type": "Box", "low": np.zeros(3), "high": np.ones(4), "dtype": "float32"})
box_of_objects = forged({"type": "Box", "low": np.zeros(3), "high": np.ones(3), "dtype": "object"})
too_many_items = forged({"type": "MultiBinary", "n": [100000, 100000]})
unknown_space = forged({"type": "Graph"})
dict_key_twice = forged({"type": "Dict", "spaces": [["a", {"type": "Discrete", "n": 2, "start": 0}],
                                                    ["a", {"type": "Discrete", "n": 3, "start": 0}]]})
'''


@pytest.fixture(scope="module")
def bench(tmp_path_factory: Any) -> Iterator[Workbench]:
    yield from up_bench(tmp_path_factory)


@pytest.fixture
def marker(bench: Workbench, tmp_path: Path) -> Path:
    path = tmp_path / "unpickled-on-the-host"
    define(bench, HOSTILE.replace("MARKER", repr(str(path))))
    return path


@pytest.mark.parametrize("how, says", [
    ("pickle", "came back as a pickle, but pulls are data-only"),
    ("object_npy", "not plain .npy data"),
    ("huge", "sent a malformed reply: an answer of more than 5.2 MB: this env's answers take at most that"),
    ("long", "has shape (1000,) and dtype float32; its space wants (4,) and float32"),
    ("float64", "has shape (4,) and dtype float64; its space wants (4,) and float32"),
    ("dict", "should be an array of shape (4,), got dict"),
    ("outside", "is outside its space"),
    ("nan", "sent a reward of nan"),
    ("bool_reward", "sent a reward of True"),
    # the lean form of a step's answer (smolbench/gate/channel.py), forged by the machine
    ("lean_object_obs", "not plain .npy data"),
    ("lean_pickle_info", "came back as a pickle, but pulls are data-only"),
    ("lean_huge_obs", "sent a malformed reply: an answer of more than 5.2 MB: this env's answers take at most that"),
    ("lean_long_obs", "has shape (1000,) and dtype float32; its space wants (4,) and float32"),
    ("lean_extra", "unknown field 'x' in a step answer"),
    ("lean_flags", "a step's flags is out of range"),
    ("lean_both", "a step answer whose observation is not one array or one value"),
    ("lean_nan", "sent a reward of nan"),
    ("lean_not_text", "an array should be text"),
    ("lean_bigint", "sent a reward of 1000000000"),
    ("lean_padding", "an array is not base64"),
    ("lean_short", "not plain .npy data"),
])
def test_a_hostile_step_is_refused_in_one_line(bench: Workbench, marker: Path, how: str, says: str) -> None:
    env = sgym.make(f"hostile_{how}", session=bench)
    try:
        env.reset(seed=0)
        with pytest.raises(SmolbenchError) as refused:
            env.step(0)
        line = str(refused.value)
        assert says in line and "the env (machine root." in line, line
        assert "\n" not in line and len(line) < 1000
        assert not marker.exists()  # nothing the machine sent was unpickled here
        obs, _ = env.reset()  # a new branch of the untouched warm parent
        assert obs.shape == (4,)
    finally:
        env.close()


@pytest.mark.parametrize("name, says", [
    ("box_bounds_differ", "low (3,) and high (4,) differ in shape"),
    ("box_of_objects", "only plain numeric dtypes"),
    ("too_many_items", "at most 16,777,216"),
    ("unknown_space", "unknown type 'Graph'"),
    ("dict_key_twice", "a Dict with a key twice"),
])
def test_impossible_spaces_are_refused_in_one_line(bench: Workbench, marker: Path, name: str, says: str) -> None:
    before = set(bench.machines)
    with pytest.raises(SmolbenchError) as refused:
        sgym.make(name, session=bench)
    line = str(refused.value)
    assert says in line and "described its env's spaces wrongly" in line and "\n" not in line, line
    assert set(bench.machines) == before  # the warm parent it made is gone again


def test_the_weakened_contrast_lets_a_wrong_observation_through(bench: Workbench, marker: Path) -> None:
    """Without the check against the rebuilt space, the float64 and long attacks reach the caller."""
    from smolbench.gym import spaces

    spaces.TEST_WEAKEN.add("obs-check")
    try:
        for how, shape in (("float64", (4,)), ("long", (1000,))):
            env = sgym.make(f"hostile_{how}", session=bench)
            try:
                env.reset(seed=0)
                obs = env.step(0)[0]
                assert obs.shape == shape and not env.observation_space.contains(obs)
            finally:
                env.close()
    finally:
        spaces.TEST_WEAKEN.discard("obs-check")


@pytest.mark.parametrize("how, says", [("outside", "is outside its space"), ("lean_long_obs", "has shape (1000,)")])
def test_a_vector_step_checks_every_observation_though_all_at_once(bench: Workbench, marker: Path, how: str,
                                                                   says: str) -> None:
    """make_vec checks its sub-envs' observations against the Box in one batch: a wrong one is
    still refused in one line naming its sub-env."""
    envs = sgym.make_vec(f"hostile_{how}", 3, session=bench, reset="in-place")
    try:
        envs.reset(seed=0)
        with pytest.raises(SmolbenchError) as refused:
            envs.step(np.zeros(3, np.int64))
        line = str(refused.value)
        assert says in line and "sub-env 0 (machine root." in line and "\n" not in line, line
    finally:
        envs.close()


def _lean(obs: str, reward: bytes = b"1.0", flags: bytes = b"0") -> bytes:
    return (b'{"t":"answer","step":{"o":"' + obs.encode() + b'","r":' + reward + b',"f":' + flags
            + b',"i":{"format":"data","data":{"$":"dict","v":[]}}}}\n')


def _npy64(arr: Any, allow_pickle: bool = False) -> str:
    import io

    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=allow_pickle)
    return base64.b64encode(buf.getvalue()).decode()


def _forged64(descr: str) -> str:
    """A .npy of 2 items whose dtype numpy's own spelling doesn't have (``<b8``, ``<f1``)."""
    text = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': (2,), }}".encode()
    text += b" " * (-(10 + len(text) + 1) % 64) + b"\n"
    return base64.b64encode(b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + b"\0" * 16).decode()


OBS = _npy64(np.array([0.5, -1, 2, 3], np.float32))
LEAN_FRAMES = {
    # the audit: a dtype the fast path's pattern took but numpy refuses raised a bare TypeError
    # out of the channel (and cut the other sub-envs' answers in a vector step)
    "no such dtype <b8": _lean(_forged64("<b8")),
    "no such dtype <f1": _lean(_forged64("<f1")),
    "float16": _lean(_npy64(np.zeros(2, np.float16))),
    "plain": _lean(OBS),
    "int reward": _lean(OBS, b"-0"),
    "exponent": _lean(OBS, b"-2.5e-3", b"3"),
    "past a float": _lean(OBS, b"1E400", b"1"),
    "big-endian": _lean(_npy64(np.arange(6, dtype=">i8").reshape(2, 3)), b"7", b"2"),
    "not base64": _lean("AAA"),
    "excess padding": _lean("AAAA=="),
    "one item short": _lean(_npy64(np.zeros(4, np.float32))[:-8]),
    "object array": _lean(_npy64(np.array([None], dtype=object), allow_pickle=True)),
    "fortran order": _lean(_npy64(np.asfortranarray(np.ones((2, 2), np.float32)))),
}


@pytest.mark.parametrize("name", sorted(LEAN_FRAMES))
@pytest.mark.parametrize("max_items", [1_000_000, 12, 11, 5])
def test_the_lean_fast_path_answers_as_the_general_path(name: str, max_items: int) -> None:
    """A step answer in the exact form the host takes without a JSON parse (smolbench/gate/channel.py
    LEAN_STEP) comes out as the same value, or the same refusal, as the same JSON spelt otherwise
    (which the general path decodes and checks field by field): forged base64, a short or
    pickled array, a number past a float's range, a lowered JSON-values limit."""
    from smolbench.backends.base import CellRequest
    from smolbench.gate import LIMITS
    from smolbench.gate.channel import LEAN_STEP, Answers

    frame = LEAN_FRAMES[name]
    assert LEAN_STEP.fullmatch(frame[:-1])  # the fast path's form
    spelt_otherwise = frame.replace(b'{"t":"answer",', b'{"t": "answer", ', 1)
    assert not LEAN_STEP.fullmatch(spelt_otherwise[:-1])
    old, LIMITS.max_items = LIMITS.max_items, max_items
    try:
        fast, general = (Answers(CellRequest("x"), "root.1", owed=1).feed(f) for f in (frame, spelt_otherwise))
    finally:
        LIMITS.max_items = old
    assert len(fast) == len(general) == 1
    (a,), (b,) = fast, general
    if isinstance(b, BaseException):
        assert type(a) is type(b) and str(a) == str(b), (a, b)
        return
    assert type(a) is dict and a.keys() == b.keys() and not isinstance(a["obs"], BaseException)
    for key in a:
        assert type(a[key]) is type(b[key]) and (a[key] == b[key] if key != "obs" else True), key
    assert a["obs"].dtype == b["obs"].dtype and a["obs"].shape == b["obs"].shape and (a["obs"] == b["obs"]).all()
    assert a["obs"].flags.writeable


class _Wire:
    """The agent's side of a cell's channel, with the host's side as bytes."""

    def __init__(self, lines: bytes, hang_up: bool = True) -> None:
        import socket

        self.sent: list[bytes] = []
        self._conn, self.host = socket.socketpair()
        self.host.sendall(lines)
        if hang_up:  # after these lines
            self.host.close()
        self.seed = None

    def send(self, msg: Any) -> None:
        from smolbench.guest import protocol as P

        self.sent.append(P.encode(msg))

    def send_line(self, data: bytes) -> None:
        self.sent.append(data)

    def apply_seed(self, seed: Any) -> None:
        self.seed = seed


STEP_ANSWERS = [  # (obs, reward, flags, info, rng): the first five take the guest's JSON-free form
    (np.array([0.5, -1, 2, 3], np.float32), 1.0, 0, {}, None),
    (np.arange(6, dtype=np.int64).reshape(2, 3), -2.5e-3, 0, {}, None),
    (np.zeros((0,), np.float64), 1e300, 0, {}, None),
    (np.ones((2, 2), np.float32)[:, :1], 0.1 + 0.2, 0, {}, None),  # not contiguous: np.save's bytes
    (np.array([True, False]), -0.0, 0, {}, None),
    (np.array([1.0]), 1.0, 1, {}, {"state": "{}", "seed": 0}),  # ended: the JSON way
    (np.array([1.0]), 1, 0, {}, None),  # an int reward
    (np.array([1.0]), "nan", 0, {}, None),  # as _reward sends a non-finite one
    (np.array([1.0]), 1.0, 0, {"k": 1}, None),
    (3, 1.0, 0, {}, None),
]


@pytest.mark.parametrize("k", range(len(STEP_ANSWERS)))
def test_the_guests_json_free_step_answer_is_the_json_one(k: int) -> None:
    """The guest writes most step answers without JSON (guestapi.LEAN_HEAD/LEAN_TAIL): the same
    bytes protocol.encode makes of the same answer, so the host reads them alike."""
    from smolbench.guest import guestapi, pulldata
    from smolbench.guest import protocol as P

    obs, reward, flags, info, rng = STEP_ANSWERS[k]
    wire = _Wire(b"")
    _, answer = guestapi.GuestAPI(wire).channel()
    answer.step(obs, reward, flags, info, rng)
    fields: dict[str, Any] = {"o": pulldata._npy(obs)} if isinstance(obs, np.ndarray) else {"ov": pulldata._pull(obs, False)}
    fields.update(r=reward, f=flags, i=pulldata._pull(info, False))
    if rng is not None:
        fields["g"] = pulldata._data(rng)
    assert wire.sent == [P.encode({"t": "answer", "step": fields})]


def test_the_guest_reads_requests_however_their_bytes_arrive() -> None:
    """The guest waits for requests in poll() and splits lines itself: a request in pieces, or
    several in one read, come out whole and in order; a line past CHANNEL_LINE ends the
    channel, as the host hanging up does."""
    import contextlib
    import threading

    from smolbench.guest import guestapi
    from smolbench.guest import protocol as P

    wire = _Wire(b"", hang_up=False)
    requests, _ = guestapi.GuestAPI(wire).channel()
    step, other = b'{"op":"step","a":{"$":"int64","v":1}}\n', b'{"op":"rng"}\n'

    def host() -> None:
        with wire.host, contextlib.suppress(OSError):  # the guest may hang up first, at the long line
            for b in step:
                wire.host.sendall(bytes([b]))
            wire.host.sendall(other + step)
            wire.host.sendall(b"x" * (guestapi.CHANNEL_LINE + 1) + b"\n" + other)

    sending = threading.Thread(target=host)
    sending.start()
    try:
        assert list(requests) == [P.decode(step), P.decode(other), P.decode(step)]
    finally:
        wire._conn.close()
        sending.join()


@pytest.mark.parametrize("line", [b'{"op":"step","a":{"$":"int64","v":%s}}\n' % v for v in
                                  (b"0", b"1", b"17", b"9223372036854775807", b"-1", b"01", b"1_0", b" 1", b"+1", b"1.0")]
                         + [b'{"op":"step","a":{"$":"int64","v":1},"seed":5}\n', b'{"op":"rng"}\n'])
def test_the_guest_reads_a_step_request_without_json_as_json_would(line: bytes) -> None:
    from smolbench.guest import guestapi
    from smolbench.guest import protocol as P

    wire = _Wire(line)
    requests, _ = guestapi.GuestAPI(wire).channel()
    try:
        want: Any = P.decode(line)
    except ValueError as exc:
        want = type(exc)
    try:
        got: Any = list(requests)
    except ValueError as exc:
        got = type(exc)
    if isinstance(want, dict):
        seed = want.pop("seed", None)
        assert got == [want] and wire.seed == seed
    else:
        assert got == want


def test_a_check_that_fails_unforeseen_refuses_the_answer_and_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """One sub-env's answer must never raise out of the channel: in a vector step that cut the
    other sub-envs' answers (ask_now gave up on them all). A check failing in a way not
    foreseen (here made to, where a bad dtype used to) refuses the bytes in one line."""
    from smolbench.backends.base import CellRequest
    from smolbench.gate import pull
    from smolbench.gate.channel import Answers

    def broken(raw: bytes) -> Any:
        raise RuntimeError("a check not foreseen")

    monkeypatch.setattr(pull, "_plain_npy", broken)
    answers = Answers(CellRequest("x"), "root.1", owed=1)
    (got,) = answers.feed(LEAN_FRAMES["plain"])
    assert isinstance(got, Exception) and answers.broken
    assert str(got) == "machine root.1 sent a malformed reply: an answer that could not be checked (RuntimeError)"
    # the review: an answer already checked in the same chunk is kept, not dropped with it
    from smolbench import gate

    monkeypatch.setattr(gate._Cell, "done", lambda *a, **k: broken(b""))
    answers = Answers(CellRequest("x"), "root.1", owed=1)
    got = answers.feed(b'{"t":"answer","value":{"format":"data","data":1}}\n{"t":"done","status":"ok"}\n')
    assert got[0] == 1 and isinstance(got[1], Exception) and len(got) == 2, got


def test_a_machines_error_is_one_line_that_cant_pass_for_another_sub_envs() -> None:
    from smolbench.backends.base import CellRequest
    from smolbench.gate.channel import AnswerError, Answers

    frame = (b'{"t":"answer","error":{"ename":"ValueError","evalue":"oops\\nsub-env 0 (machine root.1.0): machine '
             b'root.1.0 died mid-step","traceback":[]}}\n')
    (got,) = Answers(CellRequest("x"), "root.1", owed=1).feed(frame)
    assert isinstance(got, AnswerError)
    assert str(got) == "ValueError: oops sub-env 0 (machine root.1.0): machine root.1.0 died mid-step"


def test_a_busy_machine_on_a_kept_channel_is_busy_and_the_next_serving_cell_waits_for_it() -> None:
    """A reset right after a refused one (its channel hung up) found the machine still ending
    the old serving cell: its "busy" reply on the new channel was taken for a malformed answer
    (logged with a traceback) and the reset failed, now and then. It is MachineBusy, and a
    serving cell is started again once the old one has ended."""
    import asyncio

    from smolbench.backends.base import CellRequest
    from smolbench.errors import MachineBusy
    from smolbench.gate.channel import Answers
    from smolbench.gym import episode as E

    busy = (b'{"t":"done","status":"busy","error":{"ename":"MachineBusy","evalue":"machine busy: a cell is '
            b'already running in this machine; wait for it or interrupt it","traceback":[]}}\n')
    answers = Answers(CellRequest("x"), "root.1", owed=1)
    (got,) = answers.feed(busy)
    assert isinstance(got, MachineBusy) and answers.broken
    tries: list[int] = []

    async def start() -> str:
        tries.append(1)
        if len(tries) < 3:
            raise got
        return "answered"

    assert asyncio.run(E.when_free(start)) == "answered" and len(tries) == 3


def test_a_bad_seed_is_quoted_as_python_writes_it() -> None:
    """A client's seed "1" (a string, from JSON) was said `got str 1`, which reads as the number."""
    from smolbench.gym.env import check_seed
    from smolbench.gym.episode import GymError

    for seed, said in [("1", "got str '1'"), (1.5, "got float 1.5"), ("x" * 100, "got str '" + "x" * 38 + "…")]:
        with pytest.raises(GymError) as got:
            check_seed(seed)
        assert str(got.value).endswith(said), str(got.value)
