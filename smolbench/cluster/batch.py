"""One agent call per node for many machines: a fork's cells, boots and deletes, batched.

A branch's cell is still one coroutine on the driver (its own timeout, retries and ledger
row), but the requests that reach a node together travel as one Ray streaming call
(``NodeAgent.run_batch``). The agent runs them side by side and sends back one stream of
frames, each tagged with the request's index in the batch: raw reply bytes, as they come
(output streams live into the cell), then the request's end, so each branch finishes on
its own. A frame's payload is a machine's raw bytes: only the gate decodes those.

Frame: index (4 bytes), kind (1 byte), payload length (4 bytes), payload.

Flow control is per request: the agent sends a request no more than its :func:`share` of
bytes its caller has not taken yet (:class:`Credit`); the driver gives credit back as the
caller takes them (``grant``). A request flooding output while a sibling waits for its own
then holds at most its share here, and the stream still moves for the sibling.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import InfraError, MachineBusy, MachineDied, MachineLost, SmolbenchError
from ..gate.frames import loads as json_loads

HEAD = struct.Struct(">IBI")
DATA, END, FAIL = 0, 1, 2
ERRORS: dict[str, type[SmolbenchError]] = {c.__name__: c for c in (SmolbenchError, InfraError, MachineLost, MachineDied, MachineBusy)}
SETTLE = 3  # loop turns with no new request before a batch goes (the fan-out's tasks all reach here by then)
MAX_TURNS = 50  # ... but a steady trickle of requests still goes out
GRACE = 2.0  # seconds a request whose caller left may take to end by itself before it is cancelled on the node
# Reply bytes a batch holds here that its callers (the gate) have not taken yet: past it, the batch
# reads no more from its node until they do, so a machine printing fast waits for the gate, as a
# local machine's socket makes it wait (an unbounded queue held 239 MB for a slow kernel).
QUEUED_BYTES = 8 * 1024 * 1024
MIN_SHARE = 256 * 1024  # one request's share however many share a batch
# Messages a node agent's batch may send ahead of what was read here (Ray's generator backpressure).
MESSAGES_AHEAD = 8


def frame(index: int, kind: int, payload: bytes = b"") -> bytes:
    return HEAD.pack(index, kind, len(payload)) + payload


def share(n: int) -> int:
    """Reply bytes one of ``n`` requests in a batch may have sent and not yet taken by its caller."""
    return max(QUEUED_BYTES // max(n, 1), MIN_SHARE)


class Credit:
    """The agent's side of per-request flow control: bytes each request sent and its caller has
    not taken yet (``grant`` gives them back); a request at its share waits for credit."""

    def __init__(self, n: int) -> None:
        self.limit = share(n)
        self.owed = [0] * n
        self._room = [asyncio.Event() for _ in range(n)]

    def pieces(self, data: bytes) -> list[bytes]:
        """``data`` in pieces of at most a share (a request's bytes out stay under two shares)."""
        return [data[at:at + self.limit] for at in range(0, len(data), self.limit)] or [data]

    async def spend(self, i: int, n: int) -> None:
        while self.owed[i] >= self.limit:
            self._room[i].clear()
            await self._room[i].wait()
        self.owed[i] += n

    def grant(self, i: int, n: int) -> None:
        if 0 <= i < len(self.owed):
            self.owed[i] = max(0, self.owed[i] - n)
            self._room[i].set()


def kind_of(message: bytes) -> int:
    """The kind of the frame that starts ``message``."""
    return message[4]


def failure(exc: BaseException) -> bytes:
    """A FAIL frame's payload: the error's class (one of smolbench's) and its one line."""
    kind = type(exc).__name__ if type(exc).__name__ in ERRORS else "SmolbenchError"
    text = str(exc) if isinstance(exc, SmolbenchError) else f"{type(exc).__name__}: {exc}"
    return json.dumps({"type": kind, "error": text}).encode()


def frames(data: bytes, size: int) -> list[tuple[int, int, bytes]]:
    """Split one message of the agent's stream (its own framing, checked anyway)."""
    out, at = [], 0
    while at < len(data):
        if len(data) - at < HEAD.size:
            raise SmolbenchError("a node agent sent a cut frame header")
        index, kind, length = HEAD.unpack_from(data, at)
        at += HEAD.size
        if index >= size or kind not in (DATA, END, FAIL) or at + length > len(data):
            raise SmolbenchError(f"a node agent sent a bad frame (index {index} of {size}, kind {kind}, {length} B)")
        out.append((index, kind, data[at:at + length]))
        at += length
    return out


def error_of(payload: bytes) -> SmolbenchError:
    try:
        got = json_loads(payload)  # strict: never UTF-16/32 guessed from bytes
        return ERRORS.get(str(got["type"]), SmolbenchError)(str(got["error"]))
    except (ValueError, KeyError, TypeError):
        return SmolbenchError("a node agent sent an unreadable error")


@dataclass
class Item:
    """One machine's request in a batch; its replies arrive on ``queue``."""

    name: str
    arg: Any
    queue: asyncio.Queue[tuple[int, Any]] = field(default_factory=asyncio.Queue)
    batch: Batch | None = None
    index: int = 0
    finished: bool = False  # its end (or error) arrived
    left: bool = False  # its caller is gone
    cancelled: bool = False
    waiting: bool = False  # its caller waits on its empty queue
    queued: int = 0  # DATA bytes on its queue
    taken: int = 0  # bytes its caller took that the node was not told of yet (credit to give back)

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """The request's raw reply bytes, as they come; leaving before its end (Ctrl-C, a timeout,
        a reply read to its last message) lets it end by itself, else it is cancelled on the node."""
        try:
            while True:
                kind, payload = await self._next()
                if kind == DATA:
                    if self.batch is not None:
                        self.batch.took(len(payload), self)
                    yield payload
                    continue
                self.finished = True
                if kind == FAIL:
                    raise payload
                return
        finally:
            self.left = True
            if not self.finished and self.batch is not None:
                self.batch.abandon(self)

    async def _next(self) -> tuple[int, Any]:
        if not self.queue.empty():
            return await self.queue.get()
        self.waiting = True  # its caller waits for bytes not here yet: its batch must read on for it
        if self.batch is not None:
            self.batch.room.set()
        try:
            return await self.queue.get()
        finally:
            self.waiting = False

    async def result(self) -> None:
        """Wait for the request's end (a boot, a delete); raise its error."""
        async for _ in self.chunks():
            pass


class Batch:
    """Requests sent to one node in one call."""

    def __init__(self, items: list[Item], start: Callable[[str, list[tuple[str, Any]]], Any],
                 call: Callable[[Any], Any], cancel: Callable[[str, list[int]], None], on_bytes: Callable[[int], None],
                 grant: Callable[[str, int, int], None] | None = None) -> None:
        self.id = uuid.uuid4().hex[:12]
        self.items = items
        self.share = share(len(items))
        for i, item in enumerate(items):
            item.batch, item.index = self, i
        self._call = call
        self._cancel = cancel
        self._on_bytes = on_bytes
        self._grant = grant
        self._gen = start(self.id, [(it.name, it.arg) for it in items])
        self.queued = 0  # DATA bytes handed to items and not taken yet
        self.room = asyncio.Event()
        self._pump = asyncio.ensure_future(self.pump())

    def took(self, n: int, item: Item) -> None:
        """``n`` of ``item``'s bytes were taken by its caller (or let go with it)."""
        self.queued -= n
        item.queued -= n
        if self.queued <= QUEUED_BYTES // 2 or item.queued <= self.share:
            self.room.set()
        self._give(item, n)

    def _give(self, item: Item, n: int) -> None:
        """Credit back to the node for ``item``, half a share at a time (one small call each)."""
        item.taken += n
        if self._grant is not None and item.taken >= self.share // 2 and not item.finished:
            with contextlib.suppress(Exception):
                self._grant(self.id, item.index, item.taken)
            item.taken = 0

    def _full(self) -> bool:
        """Read no more for now: past the batch's bound, unless a caller waits for bytes still on
        their way (callers that read one request after another); or an item is past two shares,
        which an agent that keeps to its credit never sends."""
        if any(it.queued > 2 * self.share for it in self.items):
            return True
        return self.queued > QUEUED_BYTES and not any(it.waiting and it.queue.empty() for it in self.items)

    async def pump(self) -> None:
        """Hand each frame to its request; a lost node (or agent) fails every request still open."""
        it = self._gen.__aiter__()
        try:
            while True:
                try:
                    ref = await self._call(it.__anext__())
                except StopAsyncIteration:
                    break
                data = await self._call(ref)
                if not isinstance(data, bytes):
                    raise SmolbenchError(f"a node agent sent {type(data).__name__}, not bytes")
                self._on_bytes(len(data))
                for index, kind, payload in frames(data, len(self.items)):
                    item = self.items[index]
                    if kind != DATA:
                        item.finished = True
                    elif item.left:
                        self._give(item, len(payload))  # its caller is gone: nobody takes it
                        continue
                    else:
                        self.queued += len(payload)
                        item.queued += len(payload)
                    item.queue.put_nowait((FAIL, error_of(payload)) if kind == FAIL else (kind, payload))
                while self._full():  # the gate reads slower than the node sends: wait for it
                    self.room.clear()
                    await self.room.wait()
            why: SmolbenchError = SmolbenchError("a node agent ended a batch before every request did")
        except SmolbenchError as exc:  # InfraError when the node was lost: the Workbench may retry
            why = exc
        except asyncio.CancelledError:
            why = SmolbenchError("cancelled")
        except Exception as exc:  # still one line for every request of the call
            why = SmolbenchError(f"a node agent's batch failed: {type(exc).__name__}: {exc}")
        for item in self.items:
            if not item.finished:
                item.queue.put_nowait((FAIL, type(why)(str(why))))  # one exception each: raised in its own task

    def _idle(self) -> bool:
        return all(it.left or it.finished for it in self.items)

    def abandon(self, item: Item) -> None:
        """A request whose caller left before its end: the whole call is cancelled when nobody
        listens any more (Ctrl-C), else this request after a grace period unless it ended."""
        while not item.queue.empty():  # what it left unread no longer holds the others back
            kind, payload = item.queue.get_nowait()
            if kind == DATA:
                self.took(len(payload), item)
        if self._idle():
            self._pump.cancel()  # first: a cancelled call read on would look like a lost node
            with contextlib.suppress(Exception):
                import ray

                ray.cancel(self._gen)
        else:
            asyncio.get_running_loop().call_later(GRACE, self._send_cancel)

    def _send_cancel(self) -> None:
        late = [it for it in self.items if it.left and not it.finished and not it.cancelled]
        if late and not self._pump.done():
            for it in late:
                it.cancelled = True
            with contextlib.suppress(Exception):
                self._cancel(self.id, [it.index for it in late])


class Batcher:
    """Collects a node's requests of one kind made in the same moment; sends them as one call."""

    def __init__(self, start: Callable[[str, list[tuple[str, Any]]], Any], call: Callable[[Any], Any],
                 cancel: Callable[[str, list[int]], None], on_bytes: Callable[[int], None] = lambda n: None,
                 batching: bool = True, grant: Callable[[str, int, int], None] | None = None) -> None:
        self._start, self._callf, self._cancel, self._on_bytes = start, call, cancel, on_bytes
        self._grant = grant  # credit back to the node (the agent's ``grant``): see Credit
        self.batching = batching  # off: one call per request (what bench/ compares against)
        self._pending: list[Item] = []
        self._flusher: asyncio.Future[None] | None = None
        self.calls = 0

    def submit(self, name: str, arg: Any) -> Item:
        item = Item(name, arg)
        if not self.batching:
            self._send([item])
            return item
        self._pending.append(item)
        if self._flusher is None:
            self._flusher = asyncio.ensure_future(self._flush())
        return item

    async def _flush(self) -> None:
        try:
            quiet = turns = 0
            while quiet < SETTLE and turns < MAX_TURNS:  # while requests keep arriving (a fan-out's tasks start together)
                seen = len(self._pending)
                await asyncio.sleep(0)
                turns += 1
                quiet = quiet + 1 if len(self._pending) == seen else 0
        finally:
            self._flusher = None
            items, self._pending = self._pending, []
        self._send([it for it in items if not it.left])

    def _send(self, items: list[Item]) -> None:
        if items:
            self.calls += 1
            try:
                Batch(items, self._start, self._callf, self._cancel, self._on_bytes, self._grant)
            except Exception as exc:  # the call could not even be made: every request fails
                err = exc if isinstance(exc, SmolbenchError) else SmolbenchError(f"{type(exc).__name__}: {exc}")
                for it in items:
                    it.queue.put_nowait((FAIL, err))
