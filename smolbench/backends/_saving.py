"""A checkpoint's save on a machine whose agent runs on this host (sandbox and process): the
part of :class:`~smolbench.backends._agenthost.AgentHostBackend` that asks the machine to save
and packs what it saved. Its workspace archive streams out through a fifo the host made and
reads (``gate.ckptwrite.receive``): a sandbox keeps its files in memory, counted as the
machine's, and an archive written into its run folder (memory too) was a second copy of them,
which killed a machine whose files took half its memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
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
        held, rid, ws = -1, self._ids.new(), None
        try:  # the stage goes on every path, even when the machine fails to save
            # The workspace archive comes through a fifo the host made and holds open, read as the
            # machine writes it: never a second copy of its files in its memory (see ckptwrite.receive).
            pipe = await _made_in_thread(lambda: self._open_pipe(machine, stage), os.close)
            saved = threading.Event()
            receiving = asyncio.ensure_future(_stoppable_thread(ckptwrite.receive, pipe, machine.name,
                                                                scratch=scratch, saved=saved))
            saving = asyncio.ensure_future(self._request_explained(
                machine, {"op": "save", "id": rid, "path": f"{machine.info['guest_run']}/{stage}"}))
            try:
                await asyncio.wait({saving, receiving}, return_when=asyncio.FIRST_COMPLETED)
                if receiving.done() and receiving.exception() is not None:  # stopped reading (the limit):
                    os.close(pipe)  # (its thread ended) the machine's next write fails,
                    pipe = -1
                    await _to_the_end(self._stop_request(machine, saving, rid))  # and its save is stopped
                    receiving.result()
                done = await asyncio.shield(saving)
                saved.set()
                ws = await receiving
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
                if pipe >= 0:
                    os.close(pipe)
            held = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            ckptpaths.hold_part(held)  # a sweep by another kernel leaves it while it is written
            # The machine made every path in the stage: the gate reads them without following links
            # (in a thread: a big stage must not stall the kernel).
            # (stopped, a Ctrl-C: the thread stops and ends before its files go)
            await _stoppable_thread(self._pack, machine, stage, held, ws)
            os.replace(part, path)
        finally:
            if ws is not None:
                ws[0].close()
            await _to_the_end(asyncio.to_thread(self._remove_below, machine, stage))
            with contextlib.suppress(OSError):
                os.unlink(part)
            if held >= 0:
                os.close(held)
        warn = [f"not saved (can't be pickled): {gate.terminal.listed(done['skipped'])}"] if done.get("skipped") else []
        return CheckpointInfo(path, self.name, os.path.getsize(path), warn)

    def _open_pipe(self, machine: MachineRef, stage: str) -> int:
        """``ckptwrite.open_pipe``: the new ``stage`` in ``machine``'s run folder, found by :meth:`_below`,
        and the read end of the fifo its save writes its workspace archive into."""
        with self._stage_folder(machine, stage, lambda why: f"machine {machine.name}'s run folder can't be reached "
                                f"without following a link ({why}): nothing was asked of it") as (fd, name):
            return ckptwrite.open_pipe(fd, name, self._as_owner())

    def _as_owner(self) -> Callable[[], contextlib.AbstractContextManager[None]]:
        """The file access identity the host makes files in a machine's run folder with."""
        return contextlib.nullcontext

    def _pack(self, machine: MachineRef, stage: str, out: int, workspace: tuple[Any, int], *,
              stop: threading.Event) -> None:
        """``ckptwrite.pack`` of ``stage`` in ``machine``'s run folder, found by :meth:`_below`
        (its path passes folders the machine can swap for links)."""
        with self._stage_folder(machine, stage, lambda why: f"the checkpoint machine {machine.name} saved is not in "
                                f"its run folder ({why}): a folder on its way was moved or made a link") as (fd, name):
            ckptwrite.pack(fd, name, out, machine.name, workspace, stop=stop)

