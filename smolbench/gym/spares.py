"""Fresh resets' spare machines: branches of the warm parent made ahead, one per episode.

A refill forks several at once (one fork request, cheaper per branch); each starts its
serving cell and warms (guest/gymserve.py ``Server.warm``, with the pages the practice
episode named, ``practice.py``) while it waits for its episode's reset. A finished episode's
machine is deleted with others, in one batch, beside a refill or within ``FLUSH_AFTER``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from .._aio import _to_the_end
from ..backends._channel import Channel
from ..backends.base import MachineRef
from ..errors import SmolbenchError
from ..guest import protocol as P

if TYPE_CHECKING:
    from .warmparent import WarmParent

FLUSH_AFTER = 0.5  # seconds a finished episode's machine waits at most for others to be deleted with
WAKE_LINE = P.encode({"op": "wake"})  # read by a spare and not answered (see Spares.wake)
NO_ROOM_LIMIT = 1 << 20


class NoSpare(SmolbenchError):
    """No machine could be made for the next episode."""


class Spares:
    """The spare branches of one fresh-reset env (on smolbench's loop)."""

    def __init__(self, m: WarmParent) -> None:
        self.m = m
        self.ready: list[tuple[MachineRef, Channel | None]] = []  # with their serving cells, already waiting
        self._refill: asyncio.Future[None] | None = None
        self._warming: dict[asyncio.Future[None], MachineRef] = {}  # new spares starting their serving cells
        self._added = asyncio.Event()  # a spare was added
        self._deleting: set[asyncio.Future[Any]] = set()
        self._retiring: set[asyncio.Future[None]] = set()  # last episodes' machines on their way to deletion
        self._awake: set[str] = set()  # spares woken ahead of their episodes (see wake)
        self._finished: list[MachineRef] = []  # finished episodes' machines, to be deleted together
        self._gone: dict[str, asyncio.Future[None]] = {}  # closing siblings' machines, done once deleted
        self._flush_at: asyncio.TimerHandle | None = None
        self.deletions = self.count  # deletions under way at once, at most (WarmParent sets it from the room)

    @property
    def count(self) -> int:
        """Spare branches kept ready: 16, one per sub-env past that, at most 32, fewer (down to
        8) where the warm parent has little room (a fork's start-up outlasts a short episode,
        so with few spares resets wait for them; a refill forks half of them at once, which
        costs less each)."""
        return spare_count(self.m.n, self.m.room)

    def top_up(self, low: int | None = None) -> None:
        """Keep spare branches ready (fresh resets take one): once at most ``low`` are left or
        on their way (half, unless told), refill them all with one fork request."""
        if self.m.closed or (self._refill is not None and not self._refill.done()):
            return
        have = len(self.ready) + len(self._warming)
        want = self.count - have
        if want > 0 and have <= (self.count // 2 if low is None else low):
            self._refill = asyncio.ensure_future(self._make(want))
            self.flush()  # the finished ones' deletion in the same burst of background work

    async def _make(self, k: int) -> None:
        m = self.m
        refs = await m._branch(k)  # cancelled (the env closed), the backend deletes what it made
        if m.closed:
            await _to_the_end(asyncio.gather(*(m._delete(r) for r in refs)))
            return
        # each spare's serving cell starts (and warms) on its own, so the next fork need not
        # wait for them; each is a spare once it waits for its episode's reset
        for r in refs:
            task = asyncio.ensure_future(self._ready(r))
            self._warming[task] = r
            task.add_done_callback(self._warmed)

    def _warmed(self, task: asyncio.Future[None]) -> None:
        self._warming.pop(task, None)

    async def _ready(self, ref: MachineRef) -> None:
        chan = await self.m._wait_in(ref)
        if self.m.closed:
            if chan is not None:
                chan.close()
            await self.m._delete(ref)
            return
        self.ready.append((ref, chan))
        self._added.set()

    async def take(self) -> tuple[MachineRef, Channel | None]:
        """The next spare (waiting for one if none is ready)."""
        while not self.ready:
            refill = self._refill
            if refill is not None and refill.done() and not refill.cancelled() and refill.exception() is not None:
                exc, self._refill = refill.exception(), None
                raise NoSpare(f"no machine for the next episode: {exc}")
            if not self._warming and (refill is None or refill.done()):
                self.top_up(self.count)
                if self._refill is refill:  # none could start
                    raise NoSpare("no machine for the next episode: the env is closed")
            self._added.clear()
            added = asyncio.ensure_future(self._added.wait())
            try:
                pending = {added} | ({self._refill} if self._refill is not None and not self._refill.done() else set())
                await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            finally:
                added.cancel()
        ref, chan = self.ready.pop(0)  # the refill starts once the reset is answered (see retire)
        self._awake.discard(ref.name)
        return ref, chan

    def take_now(self) -> tuple[MachineRef, Channel | None]:
        """The next spare, ready (``Machines.reset_now``, on the caller's thread)."""
        ref, chan = self.ready.pop(0)
        self._awake.discard(ref.name)
        return ref, chan

    def wake(self) -> None:
        """An episode ended, so a reset is near: wake the spare it will take, with a line the
        spare reads and doesn't answer (nothing of the env runs). Here a process idle for tens
        of ms took ~0.5 ms longer to answer a request than one that ran a moment before (the
        same machine, measured by idle time: its vCPU asleep, its caches cold), most of what a
        fresh reset cost over an in-place one. On the loop's thread."""
        if self.m.closed:
            return
        for ref, chan in self.ready:
            if ref.name not in self._awake:
                self._awake.add(ref.name)
                if chan is not None and not chan.closed:
                    with contextlib.suppress(SmolbenchError):
                        chan.notify(WAKE_LINE)
                return

    def gone(self, ref: MachineRef) -> None:
        """``ref`` is being deleted."""
        self._awake.discard(ref.name)

    def retire(self, old: list[tuple[MachineRef, Channel | None]]) -> None:
        """After a reset returned: its last machines go (see :meth:`delete_later`) and spares
        are refilled. Done before the reset was answered, both took the CPU its first request
        needed (a fresh reset measured 2-3x slower while a refill forked beside it)."""
        self.leaving(old)
        task = asyncio.ensure_future(self._retire(old))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def let_go(self, old: list[tuple[MachineRef, Channel | None]]) -> None:
        """A closing sibling's last machines: deleted with the next batch (see :meth:`delete_later`);
        returns once they are gone, so a served session's slot is held until then."""
        self.leaving(old)
        loop = asyncio.get_running_loop()
        gone = [self._gone.setdefault(ref.name, loop.create_future()) for ref, _ in old]
        for ref, chan in old:
            await self.delete_later(ref, chan)
        await asyncio.gather(*gone)

    def leaving(self, old: list[tuple[MachineRef, Channel | None]]) -> None:
        """The last machines of a reset: their names leave the env's machines now (on any thread)."""
        for ref, _ in old:
            self.m.wb.machines.pop(ref.name, None)

    async def _retire(self, old: list[tuple[MachineRef, Channel | None]]) -> None:
        for ref, chan in old:
            await self.delete_later(ref, chan)
        if self.m.mode == "fresh":
            self.top_up()

    async def delete_later(self, ref: MachineRef, chan: Channel | None = None) -> None:
        """Delete ``ref`` (already gone from the env's machines, see :meth:`leaving`) in the
        background, with the other finished ones (see :meth:`flush`), hanging up its episode's
        channel ``chan``."""
        if chan is not None:
            chan.close()
        while self._deleting and len(self._deleting) + len(self._finished) >= self.deletions:  # the warm parent's room
            await asyncio.wait(set(self._deleting), return_when=asyncio.FIRST_COMPLETED)
        self._finished.append(ref)
        if len(self._finished) >= max(1, self.count // 2) or self.m.closed:
            self.flush()
        elif self._flush_at is None:
            self._flush_at = asyncio.get_running_loop().call_later(FLUSH_AFTER, self.flush)

    def flush(self) -> None:
        """Delete the finished episodes' machines, all at once: the backend ends them in one
        batch (one wait for them all, cheaper each), and the CPU it takes (their processes'
        exit, their namespaces) comes once every few episodes, beside a refill, not after
        every reset, where it slowed the next episode's first steps ~3x."""
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        batch, self._finished = self._finished, []
        for ref in batch:
            task = self._started(self.m._delete(ref))
            gone = self._gone.pop(ref.name, None)
            if gone is not None:
                task.add_done_callback(_resolve(gone))

    def _started(self, deletion: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
        task = asyncio.ensure_future(deletion)
        self._deleting.add(task)
        task.add_done_callback(self._deleting.discard)
        return task

    async def settle(self) -> None:
        """The env is closed: wait for what is under way to end (each deletes its machine).
        Spares still starting their serving cells are not waited for: a warm parent's code
        can keep them from ever answering (the audit: the env's close waited forever)."""
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)
        if self._refill is not None:  # stopped, not waited for: its branches are deleted (see _make)
            self._refill.cancel()
            await _to_the_end(asyncio.wait({self._refill}))
        if self._warming:
            warming = dict(self._warming)
            for task in warming:
                task.cancel()
            await asyncio.gather(*warming, return_exceptions=True)
            for task, ref in warming.items():
                if task.cancelled():
                    await self.m._delete(ref)
        self._added.set()  # a reset waiting for a spare looks again: there will be none

    async def close(self, delete: Any) -> None:
        """Delete every spare (with ``delete``, which sees it to the end) and the finished ones."""
        for r, chan in self.ready:
            if chan is not None:
                chan.close()
            await delete(r)
        self.ready.clear()
        self.flush()
        if self._deleting:
            await asyncio.gather(*self._deleting, return_exceptions=True)


def _resolve(future: asyncio.Future[None]) -> Callable[[Any], None]:
    def done(_: Any) -> None:
        if not future.done():
            future.set_result(None)
    return done


def spare_count(n: int, room: int = NO_ROOM_LIMIT) -> int:
    """16, one per sub-env past that, at most 32; fewer, down to 8, where the warm parent's
    room would otherwise hold fewer sub-envs than with 8 (the practice branch counts too)."""
    return max(8, min(32, max(16, n), (room - n - 1) // 2))


def live(n: int, mode: str, room: int = NO_ROOM_LIMIT) -> int:
    """Branches of the warm parent at once, at most: the sub-envs and, with fresh resets,
    their spares, as many being deleted, and the practice episode's branch."""
    return n + (2 * spare_count(n, room) + 1 if mode == "fresh" else 0)
