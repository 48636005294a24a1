"""Host side of the agent protocol, shared by every backend (only transport differs)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from ..errors import MachineBusy, SmolbenchError
from ..guest import protocol as P
from .base import CellRequest, CellResult, Event, OnEvent


def exec_message(request: CellRequest) -> dict[str, Any]:
    """The agent request for one cell."""
    return {
        "op": "exec",
        "code": request.code,
        "cell": request.cell_name,
        "push": {k: P.b64(v) for k, v in request.push.items()},
        "pull": list(request.pull),
        "seed": request.seed,
    }


async def read_replies(lines: AsyncIterator[bytes], on_event: OnEvent | None, where: str) -> dict[str, Any]:
    """Consume reply lines, forwarding events, and return the final ``done`` message."""
    async for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            msg = P.decode(line)
        except ValueError:
            # Not ours (e.g. a stray print from a relay): show it rather than lose it.
            if on_event is not None:
                on_event(Event("stream", "stderr", line.decode(errors="replace") + "\n"))
            continue
        kind = msg.get("t")
        if kind == "done":
            if msg.get("status") == "busy":
                raise MachineBusy(f"{where} is busy running another cell: wait for it, or interrupt it with Ctrl-C")
            return msg
        if on_event is None:
            continue
        if kind == "stream":
            on_event(Event("stream", msg.get("name", "stdout"), msg.get("text", "")))
        elif kind == "display":
            on_event(Event("display", data=msg.get("data") or {}))
    raise SmolbenchError(
        f"{where} died mid-cell: its process exited before finishing (os._exit, a crash, "
        "out of memory, or the machine was deleted); its state is gone"
    )


def to_result(done: dict[str, Any]) -> CellResult:
    """A ``done`` message as a CellResult."""
    metrics = dict(done.get("metrics") or {})
    if done.get("reward_error"):
        metrics["reward_error"] = done["reward_error"]
    return CellResult(
        status=done.get("status", "error"),
        result=done.get("result"),
        error=done.get("error"),
        pulled={k: P.unb64(v) for k, v in (done.get("pulled") or {}).items()},
        reward=done.get("reward"),
        metrics=metrics,
        stdout=done.get("stdout", ""),
        stderr=done.get("stderr", ""),
        started=float(done.get("started") or 0.0),
        ended=float(done.get("ended") or 0.0),
    )
