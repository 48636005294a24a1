"""A kept channel's answers: machine bytes -> one checked value per request, or one line why not.

A cell that serves a loop of small requests on its own connection
(``smolbench_guest.channel()``; ``smolbench.gym`` steps envs this way) sends one
``{"t": "answer", ...}`` frame per request, parsed as the bytes arrive (no task per
channel: a vector step reads many at once). Each frame is bounded and decoded like any
reply (:mod:`.frames`); its value is rebuilt from data by :mod:`.pull` (arrays through the
``.npy`` path, never a pickle). Output the cell prints meanwhile is dropped, up to a
budget per answer; the cell's own ``done`` (it ended) is checked as a cell's is.
"""

from __future__ import annotations

import base64
import binascii
import functools
import logging
import re
import sys
from typing import Any

from ..backends.base import CellRequest, CellResult
from ..errors import MachineBusy, SmolbenchError
from . import _Cell, _error, died, malformed, pull
from .frames import (
    OUTPUT_HEADS,
    Bad,
    Bound,
    Splitter,
    decode,
    each,
    integer,
    known,
    mapping,
    shown,
    values_in,
)
from .limits import LIMITS, human

log = logging.getLogger(__name__)


def one_line_error(error: dict[str, Any]) -> str:
    """A machine's error as one line: its lines can't pass for the host's about another sub-env."""
    return " ".join(f"{error.get('ename', 'Error')}: {str(error.get('evalue', ''))[:500]}".split())


class AnswerError(SmolbenchError):
    """The request failed in the machine (its error, as the machine named it)."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(one_line_error(error))
        self.error = error


class Ended(SmolbenchError):
    """The serving cell ended (its result says how); the channel answers no more."""

    def __init__(self, result: CellResult) -> None:
        err = result.error or {}
        super().__init__(one_line_error(err) if result.status != "ok" else "the serving cell ended")
        self.result = result


class Answers:
    """The answers on one kept connection, parsed as its bytes arrive (one request in flight).

    :meth:`feed` takes the raw bytes; each answer comes out as its value, or as the
    exception that stands for it: :class:`AnswerError` (the request failed; the channel
    goes on), :class:`Ended`, a malformed-reply line or the machine-died line (the channel
    answers no more: :attr:`broken` is set). With a ``bound`` (a gym env's, from its spaces)
    an answer over it is refused as its bytes arrive, none of it decoded (see :class:`Bound`).
    One request, one answer: the connection's owner says when it asks (:meth:`asked`), and an
    answer to no request breaks the channel (an env that answered ahead, or again and again
    while a sibling's step was slow, had every extra answer decoded and queued, unbounded).
    """

    def __init__(self, request: CellRequest, where: str, bound: Bound | None = None, owed: int = 0) -> None:
        self._split = Splitter(bound)
        self.bound = bound
        self.request = request
        self.where = where
        self._dropped = 0
        self.broken = False
        self.owed = owed  # requests sent (the cell's own first) not answered yet

    def asked(self) -> None:
        """A request went out: one answer more is owed."""
        self.owed += 1

    def feed(self, chunk: bytes) -> list[Any]:
        """The answers ``chunk`` completes (values, or exceptions as above), each to a request
        asked (:meth:`asked`); never raises: a check that fails in a way not foreseen refuses
        the machine's bytes from there on like any other (one sub-env's answer must never cut
        the others', see ``ask_now``), and is logged with its traceback (a bug of ours must not
        pass for the machine's fault unseen)."""
        out = self._feed(chunk)
        for k, answer in enumerate(out):
            if self.broken and k == len(out) - 1 and isinstance(answer, BaseException):
                self.owed = 0  # the channel's end (a cell that ended, a refused frame): owed or not
            elif self.owed:
                self.owed -= 1
            else:  # this chunk's answers with it: the machine is out of step
                return [self._break(malformed(self.where, "an answer to no request (one request is "
                                                          "answered once, and only once asked)"))]
        return out

    def _feed(self, chunk: bytes) -> list[Any]:
        if self.broken:
            return []
        out: list[Any] = []
        try:
            frame = self._split.whole(chunk)
            if frame is not None:  # the common case: one whole answer, a plain lean step
                lean = _lean_step(frame)
                if lean is not None:
                    self._dropped = 0
                    return [lean]
            for frame in self._split.feed(chunk):
                answer = self._frame(frame)
                if answer is not _NONE:
                    out.append(answer)
                    if self.broken:
                        break
        except Bad as exc:
            out.append(self._break(malformed(self.where, exc)))
        except Exception as exc:
            log.warning("an answer from machine %s could not be checked", self.where, exc_info=True)
            out.append(self._break(malformed(self.where, f"an answer that could not be checked ({type(exc).__name__})")))
        return out

    def end(self) -> BaseException:
        """The connection closed: why there are no more answers."""
        if self.broken:
            return died(self.where)
        try:
            self._split.end()
        except Bad as exc:
            return self._break(malformed(self.where, exc))
        return self._break(died(self.where))

    def close(self) -> None:
        """Let go of any unfinished frame the channel held."""
        self.broken = True
        self._split.close()

    def _break(self, exc: BaseException) -> BaseException:
        self.close()
        return exc

    def _frame(self, frame: bytes) -> Any:
        lean = _lean_step(frame)
        if lean is not None:
            self._dropped = 0
            return lean
        output = self.bound is not None and frame.startswith(OUTPUT_HEADS)  # (the gate's own limits)
        msg = decode(frame, None if output else self.bound)
        kind = msg.get("t")
        if kind == "answer":
            if output:  # '{"t":"done","t":"answer",...}': JSON takes the last; never the guest's spelling
                raise Bad("an answer spelt as output or a cell's end (its first field says so)")
            self._dropped = 0
            try:
                return self._answer(msg)
            except AnswerError as exc:
                return exc
        if kind == "done":
            try:
                ended: BaseException = Ended(_Cell(self.request, None, self.where, "").done(msg))  # (shows no display)
            except MachineBusy as exc:  # the cell never ran (its last one still ending): that, in one line
                ended = exc
            return self._break(ended)
        if kind not in ("stream", "display", "clear"):
            raise Bad(f"a message of unknown type {shown(kind)} on a kept channel")
        self._dropped += len(frame)  # the env's own prints: not shown (as for a cell's)
        if self._dropped > LIMITS.output:
            raise Bad(f"more than {human(LIMITS.output)} of output while answering one request")
        return _NONE

    def _answer(self, msg: dict[str, Any]) -> Any:
        f = dict(each(ANSWER, msg, "an answer"))
        if f.get("error") is not None:
            raise AnswerError(f["error"])
        if ("value" in f) == ("step" in f):
            raise Bad("an answer with neither a value nor an error" if "value" not in f else "an answer with a value and a step")
        try:
            if "step" in f:
                return _step(f["step"], pull.Budget())
            return pull.pulled("the answer", f["value"], False, pull.Budget())
        except Bad:
            raise
        except SmolbenchError as exc:  # refused (not data): one line, the channel goes on
            raise AnswerError({"ename": "NotData", "evalue": str(exc)}) from None
        except Exception as exc:  # e.g. numpy refusing a hostile header: still one line
            raise Bad(f"an answer that can't be used ({type(exc).__name__})") from None


# a lean step's observation: binascii's strict mode where there is one (3.11), else base64's check
_strict_b64 = functools.partial(binascii.a2b_base64, strict_mode=True) if sys.version_info >= (3, 11) else \
    functools.partial(base64.b64decode, validate=True)
_NONE = object()  # a frame that is not an answer (output, dropped)
ANSWER = {"t": lambda v, k: v, "value": lambda v, k: v, "step": lambda v, k: v, "error": _error}
STEP = frozenset({"o", "ov", "r", "f", "i", "g"})


# A step's answer in its lean form as the guest writes it while the episode goes on with an
# empty info (smolbench/guest/guestapi.py; CartPole's every step). Matched whole, such a frame
# holds only fixed text, base64, a bounded JSON number and a flag digit: it is taken without
# a JSON parse and its fields need no checks beyond the match. Any other frame, or one whose
# base64 or array the general path would refuse, goes the general way (which says why).
LEAN_STEP = re.compile(rb'\{"t":"answer","step":\{"o":"([A-Za-z0-9+/]*={0,2})",'
                       rb'"r":(-?(?:0|[1-9][0-9]{0,15})(\.[0-9]{1,17})?([eE][-+]?[0-9]{1,3})?),"f":([0-3]),'
                       rb'"i":\{"format":"data","data":\{"\$":"dict","v":\[\]\}\}\}\}')
# LEAN_STEP as it is checked (the same frames: tests/test_gym_gate.py), with no pattern run over
# the observation's base64 (an image's ~100 KB took a third of the host's time a step): the fixed
# head, the tail matched from the last '","r":' of the frame's last LEAN_TAIL_MAX bytes (the
# base64 holds no quote, and the tail no second '","r":'), and the base64 between them decoded
# by binascii in strict mode, which refuses all that [A-Za-z0-9+/]*={0,2} does not match (a
# byte outside the alphabet, a quote among them; padding not at the end) but more than two '='
# after a whole quantum (Python 3.11: checked here).
LEAN_HEAD = b'{"t":"answer","step":{"o":"'
LEAN_TAIL = re.compile(LEAN_STEP.pattern[LEAN_STEP.pattern.index(b'","r":'):])
LEAN_TAIL_MAX = len(b'","r":-' + b"1" * 16 + b"." + b"1" * 17 + b"e+111,\"f\":0,"
                    b'"i":{"format":"data","data":{"$":"dict","v":[]}}}}')

LEAN_VALUES = values_in(b'{"t":"answer","step":{"o":"","r":0,"f":0,"i":{"format":"data","data":{"$":"dict","v":[]}}}}')


def _lean_step(frame: bytes) -> dict[str, Any] | None:
    """``frame`` as :func:`_step` would return it, if it is a plain lean step (see
    :data:`LEAN_STEP`: checked as :data:`LEAN_HEAD` says); else None (then the general path decides)."""
    if not frame.startswith(LEAN_HEAD) or LIMITS.max_items < LEAN_VALUES:  # (a fixed count: see LEAN_STEP)
        return None
    head = len(LEAN_HEAD)
    cut = frame.rfind(b'","r":', max(head, len(frame) - LEAN_TAIL_MAX))
    m = LEAN_TAIL.fullmatch(frame, cut) if cut >= 0 else None
    if m is None or frame.endswith(b"===", head, cut):  # (3.11's strict mode takes "AAAA===", the pattern not)
        return None
    try:
        raw = _strict_b64(memoryview(frame)[head:cut])  # what pull.npy does with it
    except (binascii.Error, ValueError):
        return None
    obs = pull._plain_npy(raw)
    if obs is None:
        return None
    flags = m[4][0] - 48
    reward = float(m[1]) if m[2] or m[3] else int(m[1])  # as json reads the number
    return {"obs": obs, "reward": reward, "terminated": bool(flags & 1), "truncated": bool(flags & 2), "info": {}}


def _step(tree: Any, budget: pull.Budget) -> dict[str, Any]:
    """A gym step's answer in its lean form, as the dict its generic form pulls to:
    ``{"o": .npy (base64)}`` or ``{"ov": a pulled value}`` (the observation), ``"r"`` the
    reward (data; the gym checks it is a finite number), ``"f"`` 1 terminated | 2 truncated,
    ``"i"`` the info (a pulled value), ``"g"`` the env's random state (data, when it ended).
    Only the shapes above; the values are rebuilt from data like any pull."""
    f = mapping(tree, "a step answer", len(STEP))
    known(f, STEP, "a step answer")
    if ("o" in f) == ("ov" in f):
        raise Bad("a step answer whose observation is not one array or one value")
    if "i" not in f:
        raise Bad("a step answer without its info")
    obs = pull.npy(f["o"]) if "o" in f else pull.pulled("the observation", f["ov"], False, budget)
    flags = integer(f.get("f"), "a step's flags", 0, 3)
    out = {"obs": obs, "reward": pull.data_value(f.get("r"), 1, budget), "terminated": bool(flags & 1),
           "truncated": bool(flags & 2), "info": pull.pulled("the info", f["i"], False, budget)}
    if "g" in f:
        out["rng"] = pull.data_value(f["g"], 1, budget)
    return out
