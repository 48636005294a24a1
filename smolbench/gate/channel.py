"""A kept channel's answers: machine bytes -> one checked value per request, or one line why not.

A cell that serves a loop of small requests on its own connection
(``smolbench_guest.channel()``; ``smolbench.gym`` steps envs this way) sends one
``{"t": "answer", ...}`` frame per request. Each frame is bounded and decoded like any
reply (:mod:`.frames`); its value is rebuilt from data by :mod:`.pull` (arrays through the
``.npy`` path, never a pickle). Output the cell prints meanwhile is dropped, up to a
budget per answer; the cell's own ``done`` (it ended) is checked as a cell's is.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from ..backends.base import CellRequest, CellResult
from ..errors import SmolbenchError
from . import _Cell, _error, died, malformed, pull
from .frames import Bad, decode, each, shown, split_frames
from .limits import LIMITS, human


class AnswerError(SmolbenchError):
    """The request failed in the machine (its error, as the machine named it)."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(f"{error.get('ename', 'Error')}: {str(error.get('evalue', ''))[:500]}")
        self.error = error


class Ended(SmolbenchError):
    """The serving cell ended (its result says how); the channel answers no more."""

    def __init__(self, result: CellResult) -> None:
        err = result.error or {}
        super().__init__(f"{err.get('ename', 'Error')}: {str(err.get('evalue', ''))[:500]}" if result.status != "ok"
                         else "the serving cell ended")
        self.result = result


class Answers:
    """The answers on one kept connection, read one at a time (one request in flight)."""

    def __init__(self, chunks: AsyncIterator[bytes], request: CellRequest, where: str) -> None:
        self._frames = split_frames(chunks)
        self.request = request
        self.where = where

    async def next(self) -> Any:
        """The next answer's value; :class:`AnswerError`, :class:`Ended`, a malformed-reply
        line, or the machine-died line otherwise."""
        dropped = 0
        try:
            async for frame in self._frames:
                msg = decode(frame)
                kind = msg.get("t")
                if kind == "answer":
                    return self._answer(msg)
                if kind == "done":
                    raise Ended(_Cell(self.request, None, self.where).done(msg))
                if kind not in ("stream", "display"):
                    raise Bad(f"a message of unknown type {shown(kind)} on a kept channel")
                dropped += len(frame)  # the env's own prints: not shown (as for a cell's)
                if dropped > LIMITS.output:
                    raise Bad(f"more than {human(LIMITS.output)} of output while answering one request")
        except Bad as exc:
            raise malformed(self.where, exc) from None
        raise died(self.where)

    def _answer(self, msg: dict[str, Any]) -> Any:
        f = dict(each({"t": lambda v, k: v, "value": lambda v, k: v, "error": _error}, msg, "an answer"))
        if f.get("error") is not None:
            raise AnswerError(f["error"])
        if "value" not in f:
            raise Bad("an answer with neither a value nor an error")
        try:
            return pull.pulled("the answer", f["value"], False, pull.Budget())
        except Bad:
            raise
        except SmolbenchError as exc:  # refused (not data): one line, the channel goes on
            raise AnswerError({"ename": "NotData", "evalue": str(exc)}) from None
        except Exception as exc:  # e.g. numpy refusing a hostile header: still one line
            raise Bad(f"an answer that can't be used ({type(exc).__name__})") from None

    async def aclose(self) -> None:
        """Let go of any unfinished frame the channel held."""
        closer = getattr(self._frames, "aclose", None)
        if closer is not None:
            await closer()
