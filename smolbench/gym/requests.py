"""A gym env's requests to its sub-envs' machines, and their failures as one line naming the sub-env.

A request is a one-line cell whose result comes back through the gate as data (``--pull``),
or, on backends that keep a connection open, a JSON line on the episode's serving cell
(``guest/gymserve.py``'s ``Server.serve``), answered in the same encoding. Either way what
comes back is data the gate checked; ``answers.py`` checks it against the env's spaces.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

from gymnasium import spaces as S

from ..backends.base import CellRequest
from ..errors import InfraError, NoAnswerInTime, SmolbenchError
from ..gate.channel import AnswerError
from ..gate.frames import Bound
from ..guest import protocol as P
from . import episode as E
from . import spaces
from .episode import OUT, Episode, OutOfTime, Unanswered, _where

if TYPE_CHECKING:
    from ..workbench import Workbench

RESET_LINE = P.encode({"op": "reset", "r": json.dumps({"seed": None, "rng": None, "options": None}), "seed": None})
T = TypeVar("T")


class Budget:
    """What is left of the env's timeout for one reset's requests, which share it (a fresh
    reset's request for the last episode's random state, then its reset): the time the
    machines take to answer them, not the time smolbench takes to make a machine."""

    def __init__(self, timeout: float | None) -> None:
        self.left = timeout  # s (None: no limit)

    async def spend(self, work: Awaitable[T]) -> T:
        """``work`` (a request given :attr:`left`), its time taken from what is left."""
        start = time.monotonic()
        try:
            return await work
        finally:
            if self.left is not None:
                self.left = max(0.0, self.left - (time.monotonic() - start))


class Requests:
    """Requests to the machines of one gym env's sub-envs (what :class:`WarmParent` sends with)."""

    wb: Workbench
    n: int  # the sub-envs: an error names one only where there are several
    action_space: Any
    timeout: float | None  # s a machine may take to answer one reset or step (None: as long as it takes)
    bound: Bound | None = None  # what one answer may take on the wire (answers.wire_bound, from the spaces)

    async def _call(self, ep: Episode, code: str, *, push: dict[str, bytes] | None = None,
                    seed: int | None = None, bounded: bool = True, left: float | None = None) -> Any:
        """One request to ``ep``'s machine; its pulled result (data, checked by the gate).
        ``bounded``: within the env's timeout (a reset's or step's; the env's build is not),
        or ``left`` s (what a reset's earlier request left of it)."""
        ref = ep.ref
        assert ref is not None
        ep.cells += 1
        req = CellRequest(code, push=push or {}, pull=[OUT], cell_name=f"<gym-{ep.cells}>", seed=seed)
        where = _where(ep.index, self.n, ep)
        try:
            res = await E.when_free(lambda: _in_time(self.wb.backend.exec_cell(ref, req, _ignore),
                                                     self._limit(left) if bounded else None, ref.name))
        except InfraError:
            raise
        except NoAnswerInTime as exc:
            raise OutOfTime(f"{where}: {exc}") from None
        except SmolbenchError as exc:  # refused by the gate, or the machine is gone: one line naming the sub-env
            raise Unanswered(f"{where}: {exc}") from None
        return E.cell_out(res, where)

    @property
    def channels(self) -> bool:
        """Whether each episode keeps one connection to its machine (the agent-host backends)."""
        return hasattr(self.wb.backend, "open_channel")

    async def _serve(self, ep: Episode, reset: str | None, seed: int | None, pages: str | None = None,
                     learn: bool = False, left: float | None = None) -> Any:
        """Start ``ep``'s serving cell with its episode's reset (None: it waits for one, having
        taken ``pages`` ahead, or noting its own with ``learn``); the reset's answer (within
        ``left`` s, if a reset's earlier request left less than the env's timeout)."""
        ref = ep.ref
        assert ref is not None
        ep.cells += 1
        code = f"_smolgym.serve(smolbench_guest, {reset!r}{f', {pages!r}' if pages else ''}{', learn=True' if learn else ''})"
        req = CellRequest(code, cell_name=f"<gym-{ep.cells}>", seed=seed)
        where = _where(ep.index, self.n, ep)

        async def start() -> Any:
            E.hang_up(ep)
            ep.chan = chan = await self.wb.backend.open_channel(ref, req, bound=self.bound)  # type: ignore[attr-defined]
            # a reset's answer is bounded by the env's timeout; a spare's warming (no reset) is not
            chan.timeout = self._limit(left) if reset is not None else None
            got = await chan.answer()
            chan.timeout = self.timeout  # every request on it from here is a reset or a step
            return got
        try:
            return await E.when_free(start)
        except BaseException as exc:
            E.hang_up(ep)
            raise E.failed(exc, where) from None

    async def _ask(self, ep: Episode, msg: dict[str, Any], left: float | None = None) -> Any:
        """One request on ``ep``'s channel; its answer (data, checked by the gate), within
        ``left`` s if a reset's earlier request left less than the env's timeout."""
        chan = ep.chan
        assert chan is not None
        where = _where(ep.index, self.n, ep)
        kept = chan.timeout
        if left is not None:
            chan.timeout = left
        try:
            return await chan.ask(msg)
        except AnswerError as exc:
            raise E.env_error(f"{where}: {exc}", exc.error) from None
        except BaseException as exc:
            E.hang_up(ep)
            raise E.failed(exc, where) from None
        finally:
            chan.timeout = kept

    async def _request(self, ep: Episode, op: str, cell: str, left: float | None = None, **fields: Any) -> Any:
        """``op`` on ``ep``'s machine (within ``left`` s, as :meth:`_ask`): on its channel if
        one is open, else as the one-line ``cell``."""
        if ep.chan is not None:
            return await self._ask(ep, {"op": op, **fields}, left)
        return await self._call(ep, cell, left=left)

    def _limit(self, left: float | None) -> float | None:
        """A reset's or step's request's timeout: the env's, or ``left`` of it."""
        return self.timeout if left is None else left

    def _action_line(self, action: Any) -> bytes:
        """A step request as its JSON line (a Discrete action's without building a dict)."""
        if self._discrete:
            return b'{"op":"step","a":{"$":"int64","v":%d}}\n' % int(action)
        line = P.encode({"op": "step", "a": spaces.action_data(self.action_space, action)})
        E.fits(len(line), "an action", "use a smaller action space")
        return line

    @property
    def _discrete(self) -> bool:
        return type(self.action_space) is S.Discrete

    def _asked(self, ep: Episode, exc: BaseException) -> BaseException:
        """What a failed answer on ``ep``'s channel stands for (as :meth:`_ask` says it)."""
        where = _where(ep.index, self.n, ep)
        if isinstance(exc, AnswerError):
            return E.env_error(f"{where}: {exc}", exc.error)
        E.hang_up(ep)
        return E.failed(exc, where)

    def _where(self, ep: Episode) -> str:
        return _where(ep.index, self.n, ep)


async def _in_time(work: Any, timeout: float | None, name: str) -> Any:
    """``work``'s result, or :class:`NoAnswerInTime` after ``timeout`` s (a cell: no kept connection)."""
    try:
        return await asyncio.wait_for(work, timeout)
    except asyncio.TimeoutError:
        assert timeout is not None  # (it ran out)
        raise NoAnswerInTime.after(name, timeout) from None


def _ignore(event: Any) -> None:
    """Output of a gym request is not shown (the env's own prints stay in its machine's record)."""

