"""A served env's replies as JSON: what one can take, counted before any is made, and
its big arrays written straight to JSON text, for ``smolbench serve`` (``openenv.py``)."""

from __future__ import annotations

import base64
import datetime
import json
import math
import re
import threading
import uuid
from typing import Any

import numpy as np

from .errors import SmolbenchError
from .gate.pull import nested_lists

CHUNK = 1 << 16  # items of an array made into Python objects (tolist) at once, to be written as JSON
SPILL = 4096  # items from which a served reply's array is written straight to JSON text
NUMBER_TEXT = 25  # a float's JSON at most, and its comma: -1.7976931348623157e+308 (float32's too: tolist makes doubles)


def to_json(value: Any) -> Any:
    """A checked observation or info as JSON: arrays as nested lists, bytes as
    ``{"base64": ...}``, a complex number as ``[real, imag]``, a date or time as its text
    (a machine's bytes that are not UTF-8 failed the whole response: HTTP 500)."""
    if isinstance(value, np.ndarray):
        return to_json(value.tolist()) if value.dtype.kind not in "biuf" else value.tolist()
    if isinstance(value, np.generic):
        return to_json(value.item())
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"base64": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, complex):
        return [value.real, value.imag]
    if isinstance(value, (datetime.date, datetime.timedelta)):
        return str(value)
    return value


def json_size(value: Any) -> int:
    """The most bytes ``value`` (an observation or info the gate checked) can take as JSON
    once :func:`to_json` made it, or as the Python objects made on the way where those take
    more (:func:`_array_text`), from its arrays' shapes and dtypes (no array is converted:
    a 2 MiB int8 observation took 40 MiB to answer). Its walk is bounded by the gate's: an
    observation has at most 4096 leaves in its space, an info about 256 KiB."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, np.ndarray):
            if v.dtype.kind == "O":  # no gate makes one; counted by its items if it comes
                stack.extend(v.ravel().tolist())
                v = np.empty(v.shape, "u1")
            total += _array_text(v.shape, v.dtype)
        elif isinstance(v, dict):
            total += 2
            for k, sub in v.items():
                total += 6 * len(str(k)) + 4
                stack.append(sub)
        elif isinstance(v, (list, tuple)):
            total += 3
            stack.extend(v)
        elif isinstance(v, str):
            total += 6 * len(v) + 3  # a control character is "\u0001" in JSON
        elif isinstance(v, (bytes, bytearray, memoryview)):
            total += 4 * (len(v) + 2) // 3 + 16  # {"base64": "..."}
        elif isinstance(v, (complex, np.complexfloating)):
            total += 2 * NUMBER_TEXT + 3
        elif isinstance(v, int) and not isinstance(v, bool):
            total += max(NUMBER_TEXT, v.bit_length() * 3 // 10 + 3)  # its digits (str() of a huge one raises)
        else:  # None, a bool, a float, a numpy scalar, a date or time as its text
            total += 2 * NUMBER_TEXT
    return total


LIST_OBJECT = 72  # bytes of the Python list (and its reference) tolist makes for each nested list


def _item_objects(dtype: np.dtype[Any]) -> int:
    """Bytes of the Python objects to_json makes of one item (measured): an int, a float, a
    pair of floats, a date's text, a str; a dict, its text and the bytes for a bytes item."""
    kind, size = dtype.kind, dtype.itemsize
    fixed = {"b": 8, "i": 36, "u": 36, "f": 32, "c": 170, "M": 128, "m": 128}
    return fixed.get(kind) or (200 + 2 * size if kind in "SV" else 80 + size)


def _array_text(shape: tuple[int, ...], dtype: np.dtype[Any]) -> int:
    """What an array of ``shape`` and ``dtype`` costs a reply: its JSON text, or the Python
    objects made of it at once where those take more. A numeric array of ``SPILL`` items or
    more is written as text a chunk at a time; any other is made into Python objects whole
    (``tolist``): a list per nested list and an object or three per item (a 128-byte array
    of shape (5,000,000, 0) took 700 MB; 250 KB of ``S1`` items 50 MB)."""
    lists = nested_lists(shape)  # "[", "]", "," each nested list
    items = math.prod(shape)
    if dtype.kind in "biuf" and items >= SPILL:
        return 3 * lists + items * _item_text(dtype)
    return LIST_OBJECT * lists + items * max(_item_text(dtype), _item_objects(dtype))


def space_json_size(space: Any) -> tuple[int, int]:
    """The fewest and the most bytes :func:`json_size` counts for a reply whose observation
    is in ``space`` and whose info is empty. They differ only by a Text's length (and a
    Discrete's int or numpy int): an array's count is its shape's and dtype's, whatever it
    holds. Every space the gate takes is bounded (a Text by ``spaces.MAX_TEXT``)."""
    from gymnasium import spaces as S

    def walk(sp: Any) -> tuple[int, int]:
        if isinstance(sp, (S.Dict, S.Tuple)):
            named = sp.spaces.items() if isinstance(sp, S.Dict) else ((None, sub) for sub in sp.spaces)
            low = high = 2 if isinstance(sp, S.Dict) else 3
            for key, sub in named:
                lo, hi = walk(sub)
                keyed = 6 * len(str(key)) + 4 if key is not None else 0
                low, high = low + lo + keyed, high + hi + keyed
            return low, high
        if isinstance(sp, S.Text):
            return 6 * sp.min_length + 3, 6 * sp.max_length + 3
        if isinstance(sp, S.Discrete):
            return NUMBER_TEXT, 2 * NUMBER_TEXT  # a Python int; a numpy one
        size = _array_text(tuple(sp.shape), np.dtype(sp.dtype))  # Box, MultiBinary, MultiDiscrete
        return size, size

    low, high = walk(space)
    return 3 + low + 2, 3 + high + 2  # (obs, {})


def reply_room(space: Any, max_reply: int) -> str | None:
    """Refuse, in one line, an observation space no reply of which fits ``max_reply``
    (every reset would fail); a warning when only some do (a long Text), else None."""
    from .gym.spaces import one_line

    low, high = space_json_size(space)
    if low > max_reply:
        raise SmolbenchError(f"the env's observations take at least {low:,} bytes as JSON (its observation space "
                             f"{one_line(space)[:120]}), over smolbench serve --max-reply ({max_reply:,}): every reset "
                             f"would be refused; serve it with --max-reply {high} or more (the server holds about "
                             "3 times a reply while it sends it), or make its observations smaller")
    if high > max_reply:
        return (f"the env's observations may take up to {high:,} bytes as JSON, over --max-reply ({max_reply:,}): "
                f"an episode whose reply is larger ends with one line; --max-reply {high} serves them all")
    return None


def _item_text(dtype: np.dtype[Any]) -> int:
    """The most JSON characters (and the comma) one item of an array of ``dtype`` takes."""
    if dtype.kind == "b":
        return 6  # false,
    if dtype.kind in "iu":
        return len(str(np.iinfo(dtype).min if dtype.kind == "i" else np.iinfo(dtype).max)) + 1
    if dtype.kind == "c":
        return 2 * NUMBER_TEXT + 3
    if dtype.kind == "U":
        return 6 * (dtype.itemsize // 4) + 3
    if dtype.kind in "SV":  # bytes: {"base64": "..."}
        return 4 * (dtype.itemsize + 2) // 3 + 16
    if dtype.kind in "Mm":  # a date or time as its text, or a whole number
        return 48
    return NUMBER_TEXT  # floats


MARK = re.compile(r'"smolbench-json:([0-9a-f]{32})"')
_TEXTS: dict[str, list[str]] = {}  # served replies' arrays as JSON text, by the mark standing in for each
_TEXTS_LOCK = threading.Lock()


def array_json(a: np.ndarray[Any, Any]) -> list[str]:
    """A numeric array's JSON as pieces of text, ``CHUNK`` items at a time: what ``tolist``
    and pydantic make of it (NaN and infinities as null), without a Python object per item
    (tolist's lists and model_dump's copy held 5 to 12 times a reply's text)."""
    out: list[str] = []
    _pieces(a, out)
    return out


def _pieces(a: np.ndarray[Any, Any], out: list[str]) -> None:
    if a.ndim == 0 or a.size <= CHUNK:
        out.append(_dumps(a.tolist(), a.dtype.kind == "f"))
        return
    row = a.size // len(a)
    out.append("[")
    if row > CHUNK:  # rows bigger than a chunk: each its own
        for i in range(len(a)):
            if i:
                out.append(",")
            _pieces(a[i], out)
    else:
        step = CHUNK // max(1, row)
        for i in range(0, len(a), step):
            if i:
                out.append(",")
            out.append(_dumps(a[i:i + step].tolist(), a.dtype.kind == "f")[1:-1])
    out.append("]")


def _dumps(items: Any, floats: bool) -> str:
    text = json.dumps(items, separators=(",", ":"))
    if floats and ("N" in text or "I" in text):  # NaN, Infinity: not JSON (pydantic writes null)
        text = re.sub(r"-?Infinity|NaN", "null", text)
    return text


def to_json_served(value: Any, marks: list[str]) -> Any:
    """:func:`to_json`, but each numeric array of at least ``SPILL`` items written to JSON
    text now and a mark put in its place, for :func:`spliced` to put it back as the reply
    is sent; its mark is added to ``marks``."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf" and value.size >= SPILL:
        mark = uuid.uuid4().hex
        with _TEXTS_LOCK:
            _TEXTS[mark] = array_json(value)
        marks.append(mark)
        return f"smolbench-json:{mark}"
    if isinstance(value, dict):
        return {str(k): to_json_served(v, marks) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_served(v, marks) for v in value]
    return to_json(value)


def forget(marks: list[str]) -> None:
    """Drop the texts of a reply never sent (its client gone, or the session closed)."""
    with _TEXTS_LOCK:
        for mark in marks:
            _TEXTS.pop(mark, None)
    marks.clear()


def spliced(text: str) -> str:
    """A reply's JSON ``text`` with each mark by its array's JSON text, each text dropped as
    it is used (its pieces and the whole: twice the reply, until they are dropped)."""
    if "smolbench-json:" not in text:
        return text
    parts: list[str] = []
    at = 0
    for m in MARK.finditer(text):
        with _TEXTS_LOCK:
            pieces = _TEXTS.pop(m[1], None)
        if pieces is None:  # not one of ours (or sent already): left as it is
            continue
        parts.append(text[at:m.start()])
        parts.extend(pieces)
        at = m.end()
    parts.append(text[at:])
    return "".join(parts)
