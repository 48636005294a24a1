"""A gym env's episodes as the host keeps them, and the errors of their requests: one line each."""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..backends._channel import Channel
from ..backends.base import CellResult, MachineRef
from ..errors import (
    AS_BUILTIN,
    InfraError,
    MachineBusy,
    MachineNotes,
    NoAnswerInTime,
    SmolbenchError,
    remote_error,
)
from ..gate import frames, terminal
from ..gate.channel import AnswerError, Ended, one_line_error
from ..guest import protocol as P
from ..tree import Node

OUT = "_smolgym_out"  # the variable a one-request cell leaves its result in
BUSY_WAIT = 10.0  # s a machine may take to end a serving cell the host hung up on
T = TypeVar("T")


class GymError(SmolbenchError):
    """A sub-env's request failed (a bad action, a crashed step, a refused reply): one line."""

    machine_error: dict[str, Any] | None = None  # a failed cell's error as the machine sent it (compared, not shown)


class EnvError(MachineNotes, GymError):
    """The env's own code raised in its machine: its one line names the sub-env, and it keeps
    what the machine sent of it, checked by the gate as a cell's error is: ``.ename``,
    ``.evalue``, ``.traceback`` (the env's frames: bounded, each line kept to itself), shown
    after the host's frames (a note; IPython: ``_render_traceback_``).

    Made by :func:`env_error`: like a :class:`smolbench.RemoteError`, also an instance of the
    built-in of the machine's exception's name (``except KeyError`` around ``env.step()``
    catches an env's ``KeyError`` as it would a local env's), and ``.remote`` is that
    exception as ``Session.run`` gives it."""

    ename = "Error"
    evalue = ""
    traceback: list[str] = []  # noqa: RUF012 (never changed: an instance has its own)

    def __new__(cls, message: str = "", *args: Any, **kwargs: Any) -> EnvError:
        made: Any = cls  # the __new__ of the built-in whose layout the class has (as RemoteError's)
        while made.__module__ != "builtins":
            made = made.__base__
        return made.__new__(cls, message)

    def __init__(self, message: str, *args: Any, api: str | None = None) -> None:
        BaseException.__init__(self, message)  # not the built-in's: UnicodeDecodeError's wants 5 arguments
        self.api = api
        self.magic_words = message

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""  # the line as it is (KeyError's would repr() it)

    def __reduce__(self) -> tuple[Any, ...]:
        return _env_error, (str(self), {"ename": self.ename, "evalue": self.evalue, "traceback": self.traceback})

    @property
    def remote(self) -> Any:
        """The env's exception as the machine reported it (a :class:`smolbench.RemoteError`)."""
        return remote_error(self.ename, self.evalue, self.traceback)

    def _lines(self) -> list[str]:
        return self.remote.render()[:-1] if self.traceback else []  # (its last: the machine's line, in ours)

    def _render_traceback_(self) -> list[str]:
        return [*self._lines(), f"\x1b[0;31mGymError\x1b[0m: {self}"]

    def _machine_note(self) -> str:
        return "\n".join(self._lines())


# Built-ins an env's error is not also an instance of (besides RemoteError's): IPython shows a
# SyntaxError with its own printer, never ``_render_traceback_``.
_NOT_TWINS = frozenset(name for name, cls in AS_BUILTIN.items() if issubclass(cls, SyntaxError))
_TWINS: dict[str, type[EnvError]] = {}


def env_error(message: str, error: dict[str, Any]) -> EnvError:
    """The GymError for an env's own error (``error``: as the gate checked it) with its one
    line ``message``; its class is also the built-in of the error's name when there is one."""
    ename = str(error.get("ename", "Error"))
    base = AS_BUILTIN.get(ename) if ename not in _NOT_TWINS else None
    cls = EnvError
    if base is not None:
        cls = _TWINS.get(ename) or _TWINS.setdefault(ename, type("GymError", (EnvError, base), {"__module__": __name__}))
    err = cls(terminal.printable(message))  # the env's words, for a trainer's terminal and logs: no escapes
    err.ename, err.evalue = ename, str(error.get("evalue", ""))
    err.traceback = env_frames(error.get("traceback") or [])
    return err


def _env_error(message: str, error: dict[str, Any]) -> EnvError:
    return env_error(message, error)


# A one-request cell's own frame and the env server's (its source runs as "<smolbench gymserve>"):
# the host's requests, not the env's code
_SERVING = re.compile(r'  File "<(?:gym-\d+(?:@[^>"]*)?|smolbench gymserve)>", ')


def env_frames(traceback: list[str]) -> list[str]:
    """An env's error's frames (a cell's or an answer's, gated), from the first of its own:
    without the leading ones of the request's cell and the env server."""
    for i, chunk in enumerate(traceback):
        if not _SERVING.match(chunk):
            return list(traceback[i:])
    return []


class BadArgument(GymError, ValueError):
    """An argument of ``make``/``make_vec`` that can't be used (refused before any machine is made)."""


class Unanswered(GymError):
    """The machine gave no usable answer (refused by the gate, or gone)."""


class OutOfTime(GymError):
    """The machine gave no answer within the env's ``timeout`` (its machine is then deleted)."""


@dataclass
class Episode:
    """One sub-env's current machine and episode."""

    index: int
    ref: MachineRef | None = None
    node: Node | None = None
    ret: float = 0.0
    length: int = 0
    rng: dict[str, Any] | None = None  # the env's random state to continue from (fresh resets)
    own: list[str | None] | None = None  # those of the generators the env keeps itself (plain_own)
    obs: Any = None
    running: bool = False  # reset and not yet terminated or truncated
    cells: int = 0
    episodes: int = 0  # begun by this sub-env (its in-place episodes' node ids)
    chan: Channel | None = None  # the episode's serving cell (backends that keep connections)
    seeded: str | None = None  # the machine its seed was last given to (in place: once per machine)


@dataclass
class Step:
    """One sub-env's step, checked."""

    obs: Any
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Reset:
    """An autoreset's answer from :meth:`Machines.steps_now`'s batch, for :meth:`Machines.finish`."""

    out: Any


UNSENT: Any = object()  # no answer in hand yet (Machines.reset asks for it)


@dataclass
class Later:
    """A step answer :meth:`Machines.steps_now` leaves to the loop (an ended episode, an error)."""

    out: Any
    fit: bool


def _where(i: int, n: int, ep: Episode) -> str:
    """Sub-env ``i`` of ``n`` (or the env), and its machine if it has one now."""
    where = f"sub-env {i}" if n > 1 else "the env"
    return f"{where} (machine {ep.ref.name})" if ep.ref is not None else where


def plain_rng(value: Any) -> dict[str, Any] | None:
    """A random generator state a machine sent, as the next fresh episode's machine gets it:
    only numpy's PCG64, PCG64DXSM or SFC64 state, its numbers checked and written anew (no
    more of one episode reaches the next than a generator's state), else None."""
    if not isinstance(value, dict) or not isinstance(value.get("state"), str) or len(value["state"]) > 4096:
        return None
    try:
        state = _bit_generator(frames.loads(value["state"]))
    except ValueError:
        return None
    if state is None:
        return None
    seed = value.get("seed")
    return {"state": json.dumps(state), "seed": seed if type(seed) is int and seed >= -1 else None}  # (within the 4 KiB)


MAX_CARRIED = 16  # the env's own generators carried on, at most (guest/gymserve.py's)


OWN_STATE = 16 * 1024  # characters of one carried state (a Mersenne Twister's is ~7,400)


def plain_own(value: Any) -> list[str | None] | None:
    """The states of the generators the env keeps itself (``value["own"]``): a numpy
    Generator's as :func:`plain_rng` takes np_random's, a legacy ``RandomState``'s or a
    ``random.Random``'s (Mersenne Twisters, tagged with their kind), each rebuilt from its
    checked numbers or None; None if none."""
    own = value.get("own") if isinstance(value, dict) else None
    if not isinstance(own, list) or len(own) > MAX_CARRIED:
        return None
    out: list[str | None] = []
    for one in own:
        state: Any = None
        if isinstance(one, str) and len(one) <= OWN_STATE:
            try:
                got = frames.loads(one)
                state = _twister(got) if isinstance(got, dict) and "kind" in got else _bit_generator(got)
            except (ValueError, TypeError, KeyError):
                state = None
        out.append(json.dumps(state) if state is not None else None)
    return out


def _twister(state: dict[str, Any]) -> dict[str, Any] | None:
    """A ``RandomState``'s (numpy's dict form) or ``random.Random``'s state (version 3: 624
    words and a position, then the spare normal draw), rebuilt if it is exactly that."""
    if set(state) != {"kind", "state"}:
        return None
    kind, inner = state["kind"], state["state"]
    if kind == "RandomState" and isinstance(inner, dict) \
            and set(inner) == {"bit_generator", "state", "has_gauss", "gauss"} and inner["bit_generator"] == "MT19937":
        mt, has, gauss = inner["state"], inner["has_gauss"], inner["gauss"]
        if not (isinstance(mt, dict) and set(mt) == {"key", "pos"} and _words(mt["key"]) and _whole(mt["pos"], 10)
                and mt["pos"] <= 624 and type(has) is int and has in (0, 1) and _finite(gauss)):
            return None
        return {"kind": kind, "state": {"bit_generator": "MT19937", "state": {"key": list(mt["key"]), "pos": mt["pos"]},
                                        "has_gauss": has, "gauss": float(gauss)}}
    if kind == "Random" and isinstance(inner, list) and len(inner) == 3 and inner[0] == 3 and type(inner[0]) is int:
        internal, gauss = inner[1], inner[2]
        if not (isinstance(internal, list) and len(internal) == 625 and _words(internal[:624])
                and _whole(internal[624], 10) and internal[624] <= 624 and (gauss is None or _finite(gauss))):
            return None
        return {"kind": kind, "state": [3, list(internal), None if gauss is None else float(gauss)]}
    return None


def _words(values: Any) -> bool:
    return isinstance(values, list) and len(values) == 624 and all(_whole(v, 32) for v in values)


def _finite(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _whole(v: Any, bits: int) -> bool:
    return type(v) is int and 0 <= v < 1 << bits


def _bit_generator(state: Any) -> dict[str, Any] | None:
    """``state`` rebuilt if it is exactly one of the bit generators' states named above."""
    if not isinstance(state, dict) or set(state) != {"bit_generator", "state", "has_uint32", "uinteger"}:
        return None
    kind, inner, has, spare = state["bit_generator"], state["state"], state["has_uint32"], state["uinteger"]
    if has not in (0, 1) or type(has) is not int or not _whole(spare, 32) or not isinstance(inner, dict):
        return None
    if kind in ("PCG64", "PCG64DXSM") and set(inner) == {"state", "inc"} \
            and _whole(inner["state"], 128) and _whole(inner["inc"], 128):
        rebuilt: dict[str, Any] = {"state": inner["state"], "inc": inner["inc"]}
    elif kind == "SFC64" and set(inner) == {"state"} and isinstance(inner["state"], list) \
            and len(inner["state"]) == 4 and all(_whole(x, 64) for x in inner["state"]):
        rebuilt = {"state": list(inner["state"])}
    else:
        return None
    return {"bit_generator": kind, "state": rebuilt, "has_uint32": has, "uinteger": spare}


def unchecked(where: str, what: str, exc: Exception) -> GymError:
    """An answer whose check failed in a way not foreseen, as the sub-env's one line."""
    return GymError(f"{where} answered {what} with data that could not be checked ({type(exc).__name__}: {str(exc)[:200]})")


def failed(exc: BaseException, where: str) -> BaseException:
    """What a request that failed stands for: the env's error in one line, the machine's loss
    (refused by the gate, or gone) as :class:`Unanswered`, anything else as it is."""
    if isinstance(exc, AnswerError):  # the env failed (not the machine): one line, and its traceback
        return env_error(f"{where}: {exc}", exc.error)
    if isinstance(exc, Ended):
        return env_error(f"{where}: {exc}", exc.result.error) if exc.result.error else GymError(f"{where}: {exc}")
    if isinstance(exc, (NoAnswerInTime, OutOfTime)):
        return exc if isinstance(exc, OutOfTime) else OutOfTime(f"{where}: {exc}")
    if isinstance(exc, InfraError) or not isinstance(exc, SmolbenchError):
        return exc
    # "the env (machine root.2.3): machine root.2.3 died mid-cell": the machine named once, a request not a cell
    said = re.sub(r"^machine \S+ died mid-cell", "its machine died mid-request", str(exc)) if "machine" in where else str(exc)
    return Unanswered(f"{where}: {said}")


def hang_up(ep: Episode) -> None:
    """End ``ep``'s kept connection (its serving cell finishes on its own)."""
    if ep.chan is not None:
        ep.chan.close()
        ep.chan = None


async def when_free(start: Callable[[], Awaitable[T]]) -> T:
    """``start()`` a request, again while the machine says it is busy (for at most
    :data:`BUSY_WAIT` s): a serving cell the host hung up on ends on its own, moments later,
    and a reset right after a refused one found its machine still busy with it."""
    delay, waited = 0.01, 0.0
    while True:
        try:
            return await start()
        except MachineBusy:  # refused before anything ran: safe to ask again
            if waited >= BUSY_WAIT:
                raise
            await asyncio.sleep(delay)
            waited += delay
            delay = min(2 * delay, 0.5)


def cell_out(res: CellResult, where: str) -> Any:
    """A one-request cell's pulled result, or its failure as one line naming the sub-env."""
    if res.status != "ok":
        err = env_error(f"{where}: {one_line_error(res.error or {})}", res.error or {})
        err.machine_error = res.error
        raise err
    if res.pull_error:
        raise GymError(f"{where}: {res.pull_error}")
    if OUT not in res.pulled:
        raise GymError(f"{where} sent no result")
    return res.pulled[OUT]


def fits(size: int, what: str, fix: str = "send less") -> None:
    """One line, before anything is sent, for a request over what a machine reads: it stopped
    reading (its serving cell ended), which said only that the channel was dropped."""
    if size > P.CHANNEL_LINE:
        raise GymError(f"{what} of {size:,} bytes as a request is more than the {P.CHANNEL_LINE:,} a machine reads: {fix}")
