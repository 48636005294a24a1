"""Frames and field checks: machine bytes -> JSON messages of known shape, or one line why not."""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import SmolbenchError
from .limits import LIMITS, NUMBER_LIMIT, human

NAME_RE = re.compile(r"[A-Za-z0-9_.\-~@]{1,128}")
# A frame is strict UTF-8 (never json.loads(bytes), which guesses UTF-16/32 and passes
# surrogates), so a lone surrogate can only arrive as a JSON escape: look for one first
# (cheap), and walk the decoded message only then.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
ENCODED_SURROGATE = re.compile(rb"\xed[\xa0-\xbf][\x80-\xbf]")
SURROGATE = re.compile("[\ud800-\udfff]")
# JSON strings, skipped when counting a frame's values (their commas are text, not values). One
# never closed runs to the frame's end: a match from every quote always succeeds, so the scan is
# linear. Required to close, ``"\"\"\"…`` failed from each quote after scanning to the end, and
# 80 KB of it held the kernel (every thread: re keeps the GIL) for 52 s (third audit).
JSON_STRING = re.compile(rb'"[^"\\]*(?:\\[\s\S][^"\\]*)*(?:"|\\?\Z)')
# A frame's first strings (at most 4,096) and the text between them, from a position outside any
# string: JSON_STRING's own matches, so the frame is stripped of its strings a part at a time. At
# once, re.sub took ~180 bytes a string (bytes.join's buffer for each piece): 5 MB of empty strings
# (a frame within the default 64 MB limit) held 300 MB, measured, while they were counted.
JSON_TOKENS = re.compile(rb'(?:[^"]+|' + JSON_STRING.pattern + rb'){1,4096}')


class MalformedReply(SmolbenchError):
    """A machine sent something the host does not accept (its agent may have been rewritten)."""


class Bad(Exception):
    """A field check failed; the message says what, for one line."""


def _no_constant(name: str) -> Any:
    raise Bad(f"a non-finite number ({name})")


# made once (json.loads with options makes one per call); _no_constant looked up per use (a test weakens it)
_DECODER = json.JSONDecoder(parse_constant=lambda name: _no_constant(name))


def loads(text: str | bytes) -> Any:
    """JSON from outside (a machine, a client, a copied folder's ledger or file): bytes as strict
    UTF-8, and nesting too deep for json's recursion a ValueError like any other bad JSON. Callers
    that caught ValueError alone let ``"[" * 2000``'s RecursionError through."""
    try:
        return json.loads(text.decode("utf-8") if isinstance(text, bytes) else text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def values_in(frame: bytes, limit: int | None = None) -> int:
    """How many JSON values ``frame`` holds (each costs the kernel tens of bytes once decoded):
    exactly where that matters, past ``limit`` (default: ``LIMITS.max_items``).

    Every value but the outermost follows a ``[``/``{`` or a comma, so there are 1 + commas +
    non-empty containers of them; text inside strings is skipped when that matters.
    """
    rough = frame.count(b",") + frame.count(b"[") + frame.count(b"{") + 1
    if rough <= (LIMITS.max_items if limit is None else limit):
        return rough  # an upper bound, already within the limit
    count, at, view = 1, 0, memoryview(frame)
    while at < len(frame):  # a part at a time (see JSON_TOKENS): "[]" is never cut, strings never
        end = JSON_TOKENS.match(frame, at).end()  # type: ignore[union-attr]  # (a byte at least: always)
        bare = JSON_STRING.sub(b'""', view[at:end])
        count += bare.count(b",") + bare.count(b"[") + bare.count(b"{") - bare.count(b"[]") - bare.count(b"{}")
        at = end
    return count


def _valid_text(msg: Any) -> None:
    """Refuse a message holding a string that is not valid text (a lone surrogate): the
    kernel's own messages to the browser would fail on it, for every later cell."""
    todo = [msg]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            m = SURROGATE.search(v)
            if m:
                raise Bad(f"text that is not valid Unicode (a lone surrogate {m.group()!r})")
        elif isinstance(v, dict):
            todo.extend(v)
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)


def _not_utf8(frame: bytes, at: int) -> str:
    """Why ``frame`` is not UTF-8 at byte ``at``, short (a lone surrogate is named as such)."""
    if ENCODED_SURROGATE.match(frame, at):
        return f"a lone surrogate {frame[at:at + 3].decode('utf-8', 'surrogatepass')!r} at byte {at:,}"
    return f"bytes that are not UTF-8 at byte {at:,}: {frame[at:at + 4]!r}"


def decode(frame: bytes, bound: Bound | None = None) -> dict[str, Any]:
    """One frame as a JSON object (no NaN/Infinity, bounded nesting and value count, valid
    text only), or Bad. ``bound``: a kept channel's own, tighter count (see :class:`Bound`)."""
    most = LIMITS.max_items if bound is None else min(LIMITS.max_items, bound.items)
    count = values_in(frame, most)
    if count > most:
        if bound is not None and most < LIMITS.max_items:
            raise Bad(f"an answer of {count:,} JSON values, above {most:,}: {bound.what}")
        raise Bad(f"a reply of {count:,} JSON values, above the limit of {LIMITS.max_items:,} "
                  "(`%smol config max-items N` raises it)")
    try:
        text = frame.decode("utf-8")  # the wire format is UTF-8 JSON lines: anything else is refused
    except UnicodeDecodeError as exc:
        raise Bad(f"text that is not valid Unicode ({_not_utf8(frame, exc.start)})") from None
    try:
        msg = _DECODER.decode(text)
    except Bad:
        raise
    except RecursionError:
        raise Bad("JSON nested too deeply") from None
    except ValueError as exc:
        raise Bad(f"not a JSON line ({_short(str(exc), 80)})") from None
    if not isinstance(msg, dict):
        raise Bad(f"a JSON {type(msg).__name__} where an object belongs")
    if SURROGATE_ESCAPE.search(frame):
        _valid_text(msg)
    return msg


@dataclass(frozen=True)
class Bound:
    """What one answer on a kept channel may take, worked out from what its answers carry (a
    gym env's: from its spaces, ``smolbench/gym/answers.py``), under the gate's own limits:
    ``size`` bytes and ``items`` JSON values a frame; ``what`` says why, in a refusal's line
    ("this env's answers take at most that (...)"). It holds for every frame but the machine's output
    and its serving cell's end (:data:`OUTPUT_HEADS`), which keep the gate's limits: a frame
    over it is refused as its bytes arrive, before any of it is decoded."""

    size: int
    items: int
    what: str


# How a frame the guest writes for output or a cell's end begins (protocol.encode keeps "t" first):
# these keep the gate's own limits on a bounded channel; anything else is held to its Bound.
OUTPUT_HEADS = (b'{"t":"stream"', b'{"t":"display"', b'{"t":"clear"', b'{"t":"done"')


class _InFlight:
    """Bytes of unfinished frames held for every machine at once, and the splitters holding
    them. Kept channels are fed on callers' threads as well as the loop's, so both change
    under :data:`_LOCK`."""

    held = 0
    holders: weakref.WeakSet[Splitter] = weakref.WeakSet()


_LOCK = threading.Lock()


def _over(total: int, mine: int) -> Bad:
    return Bad(f"replies of {human(total)} still without their line end, from all machines together, above the limit "
               f"of {human(LIMITS.in_flight)}; this machine's ({human(mine)}) was the largest of them "
               "(`%smol config in-flight SIZE` raises the limit)")


class Splitter:
    """Raw chunks -> newline-terminated frames of at most ``LIMITS.max_frame`` bytes (and,
    given a :class:`Bound`, its ``size`` for any frame but output), fed one chunk at a time
    (no event loop needed: a kept channel feeds it from its protocol).

    A frame that grows past the limit is refused as soon as it does (the host never holds
    more than one limit's worth); :meth:`end` refuses bytes after the last newline (a
    truncated frame). Unfinished bytes count toward every machine's in-flight total until
    :meth:`close`. When a chunk would take that total past its limit, the machine holding
    the most is refused, its bytes let go: one machine's drip can't get another one's
    answer refused in its place.
    """

    def __init__(self, bound: Bound | None = None) -> None:
        self._buf = bytearray()
        self._error: Bad | None = None  # raised after the frames before it were taken
        self.bound = bound
        self._most = bound.size if bound is not None else 1 << 62  # bytes of a frame, but output

    def feed(self, chunk: bytes) -> list[bytes]:
        """The frames ``chunk`` finishes (blank lines skipped), or Bad (once the frames before
        the bad one were returned)."""
        frames: list[bytes] = []
        with _LOCK:
            if self._error is not None:
                raise self._error
            try:
                self._feed(chunk, frames)
            except Bad as exc:
                if not frames:
                    raise
                self._error = exc
        return frames

    def whole(self, chunk: bytes) -> bytes | None:
        """``chunk`` as the one frame it is, when it is exactly one line within the limit and
        nothing is held (a kept channel's answer, read at once): what :meth:`feed` would
        return for it, without its bookkeeping; None otherwise (nothing taken)."""
        if self._buf or self._error is not None or chunk.find(b"\n") != len(chunk) - 1 \
                or len(chunk) - 1 > LIMITS.max_frame or len(chunk) - 1 > self._most:
            return None
        return chunk[:-1]

    def _feed(self, chunk: bytes, frames: list[bytes]) -> None:
        limit, buf = LIMITS.max_frame, self._buf
        most = min(limit, self._most)
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            if nl < 0:
                break
            if len(buf) + nl - start > most:
                self._too_long(len(buf) + nl - start, chunk, start)
            if buf:
                held = len(buf)  # what was counted: this chunk's part of the frame never was
                buf += chunk[start:nl]
                frame = bytes(buf)
                self._let_go(held)
                buf.clear()
            else:
                frame = chunk[start:nl]
            start = nl + 1
            if frame.strip():
                frames.append(frame)
        if len(buf) + len(chunk) - start > most:
            self._too_long(len(buf) + len(chunk) - start, chunk, start)
        if start < len(chunk):
            self._make_room(len(chunk) - start)
            buf += chunk[start:]
            _InFlight.holders.add(self)

    def _too_long(self, size: int, chunk: bytes, start: int) -> None:
        """Bad for a frame of ``size`` bytes (so far) that begins at ``chunk[start:]``, or at the
        bytes held, unless it is output or a cell's end within the gate's own limit."""
        limit, bound = LIMITS.max_frame, self.bound
        if size > limit:
            raise Bad(f"a frame longer than {human(limit)} (`%smol config max-frame SIZE` raises the limit)")
        if bound is None:
            return
        head = (bytes(self._buf[:16]) + chunk[:16])[:16] if self._buf else chunk[start:start + 16]
        if not head.startswith(OUTPUT_HEADS):
            raise Bad(f"an answer of more than {human(bound.size)}: {bound.what} (refused as it arrived)")

    def _make_room(self, more: int) -> None:
        """Count ``more`` bytes this splitter is about to hold; past the limit, the largest
        holder is refused first (this one, if none holds more: Bad, nothing counted)."""
        while _InFlight.held + more > LIMITS.in_flight:
            total, mine = _InFlight.held + more, len(self._buf) + more
            largest = max(_InFlight.holders, key=lambda s: len(s._buf), default=None)
            if largest is None or largest is self or len(largest._buf) <= mine:
                raise _over(total, mine)
            largest._error = _over(total, len(largest._buf))
            largest._let_go(len(largest._buf))
            largest._buf.clear()  # its owner is not feeding it: that takes the lock this one holds
        _InFlight.held += more

    def _let_go(self, held: int) -> None:
        _InFlight.held -= held
        if held:
            _InFlight.holders.discard(self)

    def end(self) -> None:
        """The stream closed: Bad if it closed inside a frame."""
        with _LOCK:
            if self._error is not None:
                raise self._error
            if self._buf.strip():
                raise Bad(f"a truncated frame ({human(len(self._buf))} with no line end before the stream closed)")

    def close(self) -> None:
        """Let go of any unfinished frame (it no longer counts as in flight)."""
        with _LOCK:
            self._let_go(len(self._buf))
            self._buf.clear()


async def split_frames(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Split raw chunks into frames (see :class:`Splitter`)."""
    splitter = Splitter()
    try:
        async for chunk in chunks:
            if not chunk:
                continue
            frames = splitter.feed(chunk)
            del chunk  # not held while the next one is awaited
            frames.reverse()  # taken from the end: pop(0) made a chunk of many small frames quadratic
            while frames:
                yield frames.pop()
                if len(frames) % 1024 == 1023:  # a chunk of many frames lets the loop serve others between
                    await asyncio.sleep(0)
        splitter.end()
    finally:
        splitter.close()


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
