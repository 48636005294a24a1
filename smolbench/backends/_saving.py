"""A checkpoint's save and load on a machine whose agent runs on this host (sandbox and
process): the part of :class:`~smolbench.backends._agenthost.AgentHostBackend` that asks the
machine to save and packs what it saved, and hands a checkpoint to a new machine to load. Its pickled variables and its workspace archive stream out through
fifos the host made and reads (``gate.ckptwrite.receive``): a sandbox keeps its files in
memory, counted as the machine's, and a file written into its run folder (memory too) was a
second copy of them, which killed a machine whose files or variables took half its memory.
A load reads its variables the same way, from a fifo the host writes (``ckptwrite.send``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from .. import gate
from .._aio import _made_in_thread, _stoppable_thread, _to_the_end
from ..gate import ckptpaths, ckptwrite
from ._wire import RequestIds
from .base import CheckpointInfo, MachineRef


class Saving:
    """``checkpoint`` of :class:`~smolbench.backends._agenthost.AgentHostBackend` (a mixin)."""

    name: ClassVar[str]
    _ids: RequestIds

    if TYPE_CHECKING:  # provided by AgentHostBackend
        def _stage_folder(self, machine: MachineRef, stage: str,
                          refused: Callable[[str], str]) -> contextlib.AbstractContextManager[tuple[int, str]]: ...
        async def _request_explained(self, ref: MachineRef, msg: dict[str, Any]) -> dict[str, Any]: ...
        async def _stop_request(self, machine: MachineRef, request: asyncio.Future[Any], rid: int) -> None: ...
        def _remove_below(self, machine: MachineRef, name: str) -> None: ...

    async def checkpoint(self, machine: MachineRef, path: str) -> CheckpointInfo:
        stage = f"ckpt-{os.getpid()}-{time.monotonic_ns()}"
        part = os.path.join(os.path.dirname(path), ckptpaths.part_name(os.path.basename(path)))
        scratch = os.path.dirname(part)
        held, rid, parts = -1, self._ids.new(), None
        try:  # the stage goes on every path, even when the machine fails to save
            # Both files come through fifos the host made and holds open, read as the machine writes
            # them: never a second copy of its variables or files in its memory (see ckptwrite.receive).
            pipes = await _made_in_thread(lambda: self._open_pipes(machine, stage), _close_all)
            saved = threading.Event()
            receiving = asyncio.ensure_future(_stoppable_thread(ckptwrite.receive, pipes, machine.name,
                                                                scratch=scratch, saved=saved))
            saving = asyncio.ensure_future(self._request_explained(
                machine, {"op": "save", "id": rid, "path": f"{machine.info['guest_run']}/{stage}"}))
            try:
                await asyncio.wait({saving, receiving}, return_when=asyncio.FIRST_COMPLETED)
                if receiving.done() and receiving.exception() is not None:  # stopped reading (the limit):
                    _close_all(pipes)  # (its thread ended) the machine's next write fails,
                    pipes = {}
                    await _to_the_end(self._stop_request(machine, saving, rid))  # and its save is stopped
                    receiving.result()
                done = await asyncio.shield(saving)
                saved.set()
                parts = await receiving
            except asyncio.CancelledError:  # the machine stops its save too, and is free before we go on
                await _to_the_end(self._stop_request(machine, saving, rid))
                raise
            finally:
                saved.set()
                if not receiving.done():  # (stopped: the thread ends before we go on)
                    receiving.cancel()
                await _to_the_end(asyncio.wait({receiving}))
                if not receiving.cancelled():
                    receiving.exception()  # read: the save's own error is the one said
                _close_all(pipes)
            held = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            ckptpaths.hold_part(held)  # a sweep by another kernel leaves it while it is written
            # In a thread: a big checkpoint must not stall the kernel.
            # (stopped, a Ctrl-C: the thread stops and ends before its files go)
            await _stoppable_thread(ckptwrite.pack, held, machine.name, parts)
            os.replace(part, path)
        finally:
            for fh, _ in (parts or {}).values():
                fh.close()
            await _to_the_end(asyncio.to_thread(self._remove_below, machine, stage))
            with contextlib.suppress(OSError):
                os.unlink(part)
            if held >= 0:
                os.close(held)
        warn = [f"not saved (can't be pickled): {gate.terminal.listed(done['skipped'])}"] if done.get("skipped") else []
        return CheckpointInfo(path, self.name, os.path.getsize(path), warn)

    def _hand_over(self, path: str, machine: MachineRef) -> tuple[str, int, int]:
        """``ckptwrite.hand_over`` into a new stage folder of ``machine``'s run folder, found by
        :meth:`_below` (the machine can swap its folders for links): (the stage's name, its
        namespace fifo's end, the bytes of the checkpoint limit left for it)."""
        stage = f"restore-{secrets.token_hex(6)}"
        with self._stage_folder(machine, stage, lambda why: f"machine {machine.name}'s run folder can't be reached "
                                f"without following a link ({why}): the checkpoint was not copied in") as (fd, name):
            return (stage, *ckptwrite.hand_over(path, fd, name, self._as_owner()))

    async def _load(self, ref: MachineRef, path: str, stage: str, pipe: int, left: int) -> dict[str, Any]:
        """Ask ``ref`` to load the checkpoint :meth:`_hand_over` put in ``stage``, its namespace sent
        into the fifo whose end is ``pipe`` (closed here) as the machine reads it: never a whole
        file of it in the machine's memory beside the variables it makes."""
        pipes = {"namespace.pkl": pipe}
        loaded = threading.Event()
        sending = asyncio.ensure_future(_stoppable_thread(ckptwrite.send, path, pipe, left, loaded=loaded))
        loading = asyncio.ensure_future(self._request_explained(
            ref, {"op": "load", "path": f"{ref.info['guest_run']}/{stage}"}))
        try:
            await asyncio.wait({sending, loading}, return_when=asyncio.FIRST_COMPLETED)
            if sending.done() and sending.exception() is not None:  # (the limit, damage): said as it is;
                _close_all(pipes)  # the machine's read ends (no writer left), and so does its load
                pipes = {}
                await asyncio.wait({loading})
                sending.result()
            done = await asyncio.shield(loading)
        finally:
            loaded.set()
            if not loading.done():  # (cancelled: the machine goes with its restore)
                loading.cancel()
            await _to_the_end(asyncio.wait({sending}))
            if not loading.cancelled():
                loading.exception()  # read: a failed send's error is the one said
            _close_all(pipes)
        sending.result()
        return done

    def _open_pipes(self, machine: MachineRef, stage: str) -> dict[str, int]:
        """``ckptwrite.open_pipes``: the new ``stage`` in ``machine``'s run folder, found by :meth:`_below`,
        and the read ends of the fifos its save writes its two files into."""
        with self._stage_folder(machine, stage, lambda why: f"machine {machine.name}'s run folder can't be reached "
                                f"without following a link ({why}): nothing was asked of it") as (fd, name):
            return ckptwrite.open_pipes(fd, name, self._as_owner())

    def _as_owner(self) -> Callable[[], contextlib.AbstractContextManager[None]]:
        """The file access identity the host makes files in a machine's run folder with."""
        return contextlib.nullcontext


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        os.close(fd)
