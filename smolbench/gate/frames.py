"""Frames and field checks: machine bytes -> JSON messages of known shape, or one line why not."""

from __future__ import annotations

import json
import math
import re
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from ..errors import SmolbenchError
from .limits import LIMITS, NUMBER_LIMIT, human

NAME_RE = re.compile(r"[A-Za-z0-9_.\-~@]{1,128}")


class MalformedReply(SmolbenchError):
    """A machine sent something the host does not accept (its agent may have been rewritten)."""


class Bad(Exception):
    """A field check failed; the message says what, for one line."""


def _no_constant(name: str) -> Any:
    raise Bad(f"a non-finite number ({name})")


def decode(frame: bytes) -> dict[str, Any]:
    """One frame as a JSON object (no NaN/Infinity, bounded nesting), or Bad."""
    try:
        msg = json.loads(frame, parse_constant=_no_constant)
    except Bad:
        raise
    except RecursionError:
        raise Bad("JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise Bad(f"not a JSON line ({_short(str(exc), 80)})") from None
    if not isinstance(msg, dict):
        raise Bad(f"a JSON {type(msg).__name__} where an object belongs")
    return msg


async def split_frames(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Split raw chunks into newline-terminated frames of at most ``LIMITS.max_frame`` bytes.

    A frame that grows past the limit is refused as soon as it does (the host never holds
    more than one limit's worth); bytes after the last newline are a truncated frame.
    """
    limit = LIMITS.max_frame
    buf = bytearray()
    async for chunk in chunks:
        if not chunk:
            continue
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            if nl < 0:
                break
            if len(buf) + nl - start > limit:
                raise Bad(f"a frame longer than {human(limit)} (`%smol config max-frame SIZE` raises the limit)")
            if buf:
                buf += chunk[start:nl]
                frame = bytes(buf)
                buf.clear()
            else:
                frame = chunk[start:nl]
            start = nl + 1
            if frame.strip():
                yield frame
        buf += chunk[start:]
        if len(buf) > limit:
            raise Bad(f"a frame longer than {human(limit)} (`%smol config max-frame SIZE` raises the limit)")
    if buf.strip():
        raise Bad(f"a truncated frame ({human(len(buf))} with no line end before the stream closed)")


# -- field checks -----------------------------------------------------------------------------


def _short(text: str, n: int = 60) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= n else text[: n - 1] + "…"


def shown(value: Any) -> str:
    """A machine value, quoted short, safe to put in one line."""
    try:
        text = repr(value)
    except Exception:  # a value decoded from JSON always has a repr; belt and braces
        text = type(value).__name__
    return _short(text, 60)


def string(value: Any, what: str, limit: int) -> str:
    if not isinstance(value, str):
        raise Bad(f"{what} should be text, got a {type(value).__name__}")
    if len(value) > limit:
        raise Bad(f"{what} is {len(value)} characters, above its limit of {limit}")
    return value


def opt_string(value: Any, what: str, limit: int) -> str | None:
    return None if value is None else string(value, what, limit)


def integer(value: Any, what: str, lo: int = -(2**63), hi: int = 2**63 - 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise Bad(f"{what} should be a whole number, got {shown(value)}")
    if not lo <= value <= hi:
        raise Bad(f"{what} is out of range ({shown(value)})")
    return value


def number(value: Any, what: str) -> float:
    """A finite float within +-1e300; bool is refused (True is not a reward)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Bad(f"{what} must be a number, got {shown(value)}")
    if isinstance(value, int) and abs(value) > NUMBER_LIMIT:
        raise Bad(f"{what} must be within ±1e300, got an integer of {len(str(abs(value)))} digits")
    f = float(value)
    if not math.isfinite(f) or abs(f) > NUMBER_LIMIT:
        raise Bad(f"{what} must be a finite number within ±1e300, got {shown(value)}")
    return f


def boolean(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise Bad(f"{what} should be true or false, got {shown(value)}")
    return value


def string_list(value: Any, what: str, items: int = 10_000, each: int = 4096) -> list[str]:
    if not isinstance(value, list):
        raise Bad(f"{what} should be a list, got a {type(value).__name__}")
    if len(value) > items:
        raise Bad(f"{what} has {len(value)} items, above its limit of {items}")
    return [string(v, f"an item of {what}", each) for v in value]


def mapping(value: Any, what: str, items: int = 10_000) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Bad(f"{what} should be an object, got a {type(value).__name__}")
    if len(value) > items:
        raise Bad(f"{what} has {len(value)} entries, above its limit of {items}")
    return value


def known(msg: dict[str, Any], allowed: set[str] | frozenset[str], what: str) -> None:
    extra = sorted(set(msg) - set(allowed))
    if extra:
        raise Bad(f"unknown field {shown(extra[0])} in {what}")


def name(value: Any, what: str) -> str:
    text = string(value, what, 128)
    if not NAME_RE.fullmatch(text):
        raise Bad(f"{what} is not a name: {shown(text)}")
    return text


def scalar(value: Any, what: str, text_limit: int = 4096) -> Any:
    """None, a bool, a bounded number or a bounded string (machine self-descriptions)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return number(value, what) if isinstance(value, float) else integer(value, what)
    return string(value, what, text_limit)


def each(checks: dict[str, Callable[[Any, str], Any]], msg: dict[str, Any], what: str) -> Iterator[tuple[str, Any]]:
    """Run the check for every field present in ``msg`` (unknown fields refused first)."""
    known(msg, set(checks), what)
    for key, check in checks.items():
        if key in msg:
            yield key, check(msg[key], key)
