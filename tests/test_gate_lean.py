"""The lean step's check (smolbench/gate/channel.py ``_lean_step``) runs no pattern over the
observation's base64: it must take exactly the frames the whole-frame pattern ``LEAN_STEP``
took, and refuse the rest as before. Forged frames (extra fields, bytes that are not base64,
a payload of the wrong length, a header claiming another shape or dtype or a huge size) are
refused by the host exactly as the general path refuses them; mutations of real frames are
taken or left exactly as the whole-frame pattern did. The vector step's Box check for all
sub-envs at once passes exactly what each observation's own check passes. No machine needed."""

from __future__ import annotations

import base64
import binascii
import io
import random
from typing import Any

import numpy as np
import pytest
from gymnasium import spaces as S

from smolbench.backends.base import CellRequest
from smolbench.gate import pull
from smolbench.gate.channel import LEAN_STEP, LEAN_TAIL_MAX, Answers, _lean_step

TAIL = b',"f":0,"i":{"format":"data","data":{"$":"dict","v":[]}}}}'


def _npy(arr: Any) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=arr.dtype.hasobject)
    return buf.getvalue()


def _frame(payload: bytes, reward: bytes = b"1.0", tail: bytes = TAIL) -> bytes:
    return b'{"t":"answer","step":{"o":"' + payload + b'","r":' + reward + tail


def _header(descr: str, shape: str) -> bytes:
    text = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}".encode()
    text += b" " * (-(10 + len(text) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text


IMAGE = np.random.default_rng(0).random((3, 84, 84), dtype=np.float32)
GOOD = base64.b64encode(_npy(IMAGE))
SMALL = base64.b64encode(_npy(np.array([0.5, -1, 2, 3], np.float32)))


def reference(frame: bytes) -> dict[str, Any] | None:
    """The lean check as it was: the whole frame matched by LEAN_STEP, then decoded."""
    m = LEAN_STEP.fullmatch(frame)
    if m is None:
        return None
    try:
        raw = base64.b64decode(m[1], validate=True)
    except (binascii.Error, ValueError):
        return None
    obs = pull._plain_npy(raw)
    if obs is None:
        return None
    flags = m[5][0] - 48
    reward = float(m[2]) if m[3] or m[4] else int(m[2])
    return {"obs": obs, "reward": reward, "terminated": bool(flags & 1), "truncated": bool(flags & 2), "info": {}}


def _same(a: Any, b: Any) -> None:
    assert (a is None) == (b is None), (a, b)
    if a is None:
        return
    assert a.keys() == b.keys()
    for key in a:
        if key == "obs":
            assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape
            assert np.array_equal(a[key], b[key], equal_nan=True) and a[key].flags.writeable
        else:
            assert type(a[key]) is type(b[key]) and a[key] == b[key], key


ATTACKS = {
    # fields the lean form does not have, anywhere
    "extra field first": b'{"t":"answer","step":{"x":1,"o":"' + SMALL + b'","r":1.0' + TAIL,
    "extra field after o": _frame(SMALL + b'","x":"AAAA'),
    "extra field after r": _frame(SMALL, b'1.0,"x":1'),
    "extra field in the answer": _frame(SMALL, tail=TAIL[:-1] + b',"x":1}'),
    "a second step's tail in the payload": _frame(SMALL + b'","r":2.0' + TAIL[:-2] + b'","o":"' + SMALL),
    "an info that is not empty": _frame(SMALL, tail=TAIL.replace(b'"v":[]', b'"v":[["k",1]]')),
    "flags out of range": _frame(SMALL, tail=TAIL.replace(b'"f":0', b'"f":7')),
    "a reward of 17 digits": _frame(SMALL, b"1" * 17),
    # bytes that are not base64
    "a quote in the payload": _frame(SMALL[:8] + b'"' + SMALL[9:]),
    "a byte past ASCII": _frame(SMALL[:8] + b"\xff" + SMALL[9:]),
    "a NUL": _frame(SMALL[:8] + b"\x00" + SMALL[9:]),
    "a space": _frame(SMALL[:8] + b" " + SMALL[9:]),
    "a newline": _frame(SMALL[:8] + b"\n" + SMALL[9:]),
    "url-safe alphabet": _frame(GOOD.replace(b"+", b"-").replace(b"/", b"_")),
    "padding in the middle": _frame(SMALL[:8] + b"==" + SMALL[10:]),
    "padding first": _frame(b"====" + SMALL),
    "excess padding": _frame(SMALL + b"===="),
    "three = after a whole quantum": _frame(SMALL + b"==="),
    "two = after a whole quantum": _frame(SMALL + b"=="),
    "a backslash escape": _frame(SMALL[:8] + b"\\u0041" + SMALL[8:]),
    # the wrong length
    "one char short": _frame(GOOD[:-1]),
    "one quantum short": _frame(GOOD[:-4]),
    "one quantum long": _frame(GOOD + b"AAAA"),
    "an empty payload": _frame(b""),
    # a header claiming another shape, dtype or size
    "another shape": _frame(base64.b64encode(_header("<f4", "(3, 84, 83)") + IMAGE.tobytes())),
    "another dtype": _frame(base64.b64encode(_header("<f8", "(3, 84, 84)") + IMAGE.tobytes())),
    "a huge claimed size": _frame(base64.b64encode(_header("<f4", "(1099511627776,)") + IMAGE.tobytes())),
    "a huge shape of many dims": _frame(base64.b64encode(_header("<f4", "(4294967295, 4294967295)") + b"\0" * 16)),
    "an object dtype": _frame(base64.b64encode(_npy(np.array([None], dtype=object)))),
    "fortran order": _frame(base64.b64encode(_npy(np.asfortranarray(np.ones((2, 2), np.float32))))),
    "not .npy at all": _frame(base64.b64encode(b"\x80\x04K\x01." * 8)),
    # taken as before
    "an image": _frame(GOOD),
    "small": _frame(SMALL, b"-2.5e-3", TAIL.replace(b'"f":0', b'"f":3')),
    "the longest reward": _frame(SMALL, b"-" + b"9" * 16 + b"." + b"9" * 17 + b"E-999"),
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_a_forged_lean_step_is_refused_as_before(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each forged frame comes out of the channel as it did with the whole-frame pattern: the
    same value, or the same refusal (the general path's line)."""
    from smolbench.gate import channel

    frame = ATTACKS[name]
    _same(_lean_step(frame), reference(frame))
    now = Answers(CellRequest("x"), "root.1", owed=1).feed(frame + b"\n")
    monkeypatch.setattr(channel, "_lean_step", reference)
    before = Answers(CellRequest("x"), "root.1", owed=1).feed(frame + b"\n")
    assert len(now) == len(before) == 1
    (a,), (b,) = now, before
    if isinstance(b, BaseException) or isinstance(a, BaseException):
        assert type(a) is type(b) and str(a) == str(b), (a, b)
    else:
        _same(a, b)
    # taken by the fast path only where it was: the rest the general path takes or refuses, as ever
    assert (reference(frame) is not None) == (name in ("an image", "small", "the longest reward",
                                                          "two = after a whole quantum"))


def test_mutated_frames_are_taken_exactly_as_the_whole_frame_pattern_took_them() -> None:
    """Random edits of real frames (near the payload's ends, inside it, in the tail; bytes of
    every kind, inserted, replaced, deleted): the new check and the old agree on every one."""
    rng = random.Random(7)
    seeds = [_frame(SMALL), _frame(base64.b64encode(_npy(np.arange(6, dtype=">i8").reshape(2, 3))), b"7"),
             _frame(base64.b64encode(_npy(np.zeros(3, np.float16))), b"-0", TAIL.replace(b'"f":0', b'"f":2')),
             _frame(base64.b64encode(_npy(np.array([True, False]))))]
    alphabet = b'AZaz09+/="\\,:{}[]rfi-.eE \n\x00\xff'
    taken = 0
    for _ in range(20_000):
        frame = bytearray(rng.choice(seeds))
        for _edit in range(rng.randrange(1, 4)):
            # mostly near where the payload meets the fixed text, where a cut in the wrong place would show
            at = rng.choice([rng.randrange(len(frame) + 1), 27 + rng.randrange(-3, 4),
                             len(frame) - LEAN_TAIL_MAX + rng.randrange(-60, 60), frame.find(b'","r":') + rng.randrange(-4, 8)])
            at = min(max(at, 0), len(frame))
            edit = rng.randrange(3)
            if edit == 0:
                frame[at:at] = bytes([rng.choice(alphabet)]) * rng.randrange(1, 3)
            elif edit == 1 and at < len(frame):
                frame[at] = rng.choice(alphabet)
            else:
                del frame[at:at + rng.randrange(1, 5)]
        got, want = _lean_step(bytes(frame)), reference(bytes(frame))
        _same(got, want)
        taken += want is not None
    assert 100 < taken < 19_000  # the edits both kept frames the fast path's and broke them


BOXES = [S.Box(0, 1, (3, 8, 8), np.float32), S.Box(-np.inf, np.inf, (4,), np.float64), S.Box(0, 255, (2, 5), np.uint8),
         S.Box(-3, 3, (6,), np.int64), S.Box(np.array([0.0, -1.0], np.float32), np.array([1.0, 1.0], np.float32), dtype=np.float32),
         S.Box(0, 2**64 - 1, (3,), np.uint64), S.Box(-1.0, 1.0, (0,), np.float32), S.Box(0, 1, (2,), np.float16)]


@pytest.mark.parametrize("k", range(len(BOXES)))
def test_the_batched_bounds_check_fits_exactly_what_each_arrays_own_check_fits(k: int) -> None:
    """spaces.inside (the Box check for all sub-envs of a vector step: a least and a greatest
    item against bounds the same everywhere) passes exactly the arrays spaces.check passes:
    NaN anywhere, an item just past a bound, inf, another dtype or shape are not known to fit."""
    from smolbench.gym import spaces

    space = BOXES[k]
    rng = np.random.default_rng(k)
    values: list[Any] = []
    for _ in range(60):
        v = space.sample()
        if v.size and rng.random() < 0.7:
            flat = v.reshape(-1)
            at = rng.integers(flat.size)
            if v.dtype.kind == "f":
                flat[at] = rng.choice([np.nan, np.inf, -np.inf, -0.0, 1.0, np.nextafter(v.dtype.type(1), v.dtype.type(2)),
                                       space.low.reshape(-1)[at], space.high.reshape(-1)[at], -1e-30, 2.0])
            else:
                info = np.iinfo(v.dtype)
                ints = [int(info.min), int(info.max), 0, 1, 4, -4 if info.min < 0 else 3]
                flat[at] = ints[rng.integers(len(ints))]
        values.append(v)
    values += [np.zeros(space.shape, np.float64 if space.dtype != np.float64 else np.float32), np.zeros((7,), space.dtype), None]
    fits = spaces.inside(space, values)
    for v, fit in zip(values, fits):
        try:
            spaces.check(space, v)
            ok = True
        except spaces.Refused:
            ok = False
        assert fit == ok, (v, fit, ok)
    assert any(fits) and not all(fits)
