"""A gym env's machines as its env steps them: every reset and step of its episodes.

``make`` and ``make_vec`` share this (``warmparent.py`` makes the machines). With
``reset="fresh"`` every episode gets a new branch of the warm parent (made ahead of time
and warmed, so a reset costs about what an in-place one does: ``practice.py`` says which
pages it takes ahead) and the finished episode's machine is deleted; the one thing that
carries over is the env's random generator state, as data, so that ``reset()`` without a
seed continues the stream as one long-lived env would (Gymnasium's seeding). Every
request (``requests.py``) comes back through the gate as data, then is checked against
the rebuilt spaces (``answers.py``). Every episode is a node of the fork tree and a ledger
row (``record.py``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from .. import _loop
from .. import retries as retry
from ..backends._channel import Channel, ask_all, ask_now, askable_now
from ..backends.base import MachineRef
from ..errors import InfraError, SmolbenchError
from ..gate.channel import AnswerError
from ..guest import protocol as P
from . import answers, spaces
from . import episode as E
from .episode import UNSENT, Episode, GymError, Later, OutOfTime, Reset, Step, Unanswered, _where
from .record import quietly
from .requests import RESET_LINE, Budget
from .warmparent import WarmParent


class Machines(WarmParent):
    """One gym env's machines (:class:`WarmParent`) and its sub-envs' episodes on them (runs on
    smolbench's loop; the ``_now`` methods on the caller's thread)."""

    async def reset(self, i: int, seed: int | None, options: dict[str, Any] | None,
                    sent: Any = UNSENT) -> tuple[Any, dict[str, Any]]:
        """Reset sub-env ``i``: in a new branch of the warm parent (fresh) or in its machine
        (``sent``: the answer its first attempt got in a step's batch, see :meth:`steps_now`)."""
        ep = self.eps[i]
        budget = Budget(self.timeout)  # its requests share the env's timeout: a reset is answered within it
        if ep.running:
            if self.mode == "fresh" and (seed is None or self.own_streams) and ep.ref is not None:
                try:  # continue its random streams, as one env would (its own ones, even where seeded)
                    rng = self._request(ep, "rng", "_smolgym_out = _smolgym.rng()", budget.left)
                    got = await budget.spend(rng)
                    ep.rng, ep.own = E.plain_rng(got), E.plain_own(got)
                except OutOfTime:  # the last machine took the reset's whole timeout (it is deleted)
                    ep.rng = ep.own = None
                    raise await self._out_of_time(ep, "reset") from None
                except SmolbenchError:  # not to be had: from the OS's entropy, as a new env's (the
                    ep.rng = ep.own = None  # state the last episode started from would begin it again)
            self.records.end(ep, "reset")
        req = self._reset_request(ep, seed, options)

        old: list[tuple[MachineRef, Channel | None]] = []

        async def asked() -> Any:
            nonlocal sent
            got, sent = sent, UNSENT
            self.records.begin(ep, seed)
            try:
                if isinstance(got, BaseException):
                    raise self._asked(ep, got)
                return got
            except Unanswered as exc:
                if await self._alive(ep):
                    raise
                raise InfraError(str(exc)) from None  # its machine died: rebuilt below, under retries

        async def once(attempt: int) -> Any:
            if sent is not UNSENT:  # asked already, in this machine (a step's batch)
                return await asked()
            if self.mode == "fresh" or ep.ref is None:
                if ep.ref is not None:
                    old.append((ep.ref, ep.chan))
                    ep.chan = None
                E.hang_up(ep)
                ep.ref, ep.chan = await self._spare()
            elif ep.chan is not None and ep.chan.closed:
                # Its last request was cut short (a Ctrl-C mid-step): what its env did there is
                # unknown, so it starts over in a new branch of the warm parent.
                old.append((ep.ref, None))
                E.hang_up(ep)
                (ep.ref,) = await self._branch(1)
            global_seed = self._begin(ep, seed)
            try:
                if ep.chan is not None:  # the machine is seeded first, as for a cell
                    return await budget.spend(self._ask(ep, {"op": "reset", "r": req, "seed": global_seed}, budget.left))
                if self.channels:
                    return await budget.spend(self._serve(ep, req, global_seed, left=budget.left))
                return await budget.spend(self._call(ep, f"_smolgym_out = _smolgym.reset({req!r})", seed=global_seed,
                                                     left=budget.left))
            except Unanswered as exc:
                if await self._alive(ep):
                    raise
                raise InfraError(str(exc)) from None  # its machine died: rebuilt below, under retries

        async def rebuild(attempt: int) -> None:
            await self._lost(ep, attempt)

        try:
            out = await retry.again(self.wb, [self._node_id(ep)], "gym reset", self.retries, once, rebuild)
        except OutOfTime:
            raise await self._out_of_time(ep, "reset") from None
        except GymError as exc:
            self._reset_ended(ep, exc)
            raise
        finally:
            if old or self.mode == "fresh":  # only once the reset returned
                self.pool.retire(old)
        return self._reset_answer(ep, out)

    def reset_now(self, i: int, seed: int | None, options: dict[str, Any] | None) -> tuple[Any, dict[str, Any]] | None:
        """:meth:`reset` on the caller's thread (no hop to the loop, there and back: ~0.2 ms of a
        reset here), where its machine (fresh: the next spare; in place: its own) is ready and
        held, and it needs no request first; the records are written on the loop after, and a
        fresh reset's last machine goes as :meth:`reset` sends it. None, with nothing done,
        otherwise (then :meth:`reset`)."""
        ep = self.eps[i]
        fresh = self.mode == "fresh"
        req = self._reset_request(ep, seed, options)  # one line here if it can't be sent (nothing taken yet)
        if fresh:
            if (ep.running and (seed is None or self.own_streams)) or not self.pool.ready:
                return None
            ref, chan = self.pool.ready[0]
        elif ep.ref is None:
            return None
        else:
            ref, chan = ep.ref, ep.chan
        if chan is None or not askable_now(chan):
            return None
        old = []
        if fresh:
            self.pool.take_now()
            old = [(ep.ref, ep.chan)] if ep.ref is not None else []
        with self.records.deferred():
            if ep.running:
                self.records.end(ep, "reset")
            ep.ref, ep.chan = ref, chan
            got = ask_now([chan], [P.encode({"op": "reset", "r": req, "seed": self._begin(ep, seed)})])
        assert got is not None  # askable, checked above
        if fresh:
            self.pool.leaving(old)  # now, here: retire runs on the loop a moment later
            _loop.get_loop().call_soon_threadsafe(self.pool.retire, old)
        if isinstance(got[0], BaseException):  # the env's reset failed, or its machine: on the loop
            return self.host.run(self._reset_failed(i, seed, options, got[0]))
        return self._reset_answer(ep, got[0])

    def _reset_request(self, ep: Episode, seed: int | None, options: dict[str, Any] | None) -> str:
        """What a reset asks its env: a seed ends the random stream an unseeded fresh reset
        carries on from the last episode."""
        if seed is not None:
            ep.rng = None
        fresh = self.mode == "fresh"
        req = json.dumps({"seed": seed, "rng": ep.rng if fresh else None, "own": ep.own if fresh else None,
                          "options": options})
        E.fits(len(req) + 64, "a reset")  # (its request's own fields: under 64 bytes)
        return req

    def _begin(self, ep: Episode, seed: int | None) -> int | None:
        """Begin ``ep``'s record; the machine's own seed for its reset (``random``, numpy's
        global state): the env's seed, else the next global one for a machine's first reset
        (every fresh one; in place, a sub-env's machine once), else none."""
        self.records.begin(ep, seed)
        first = ep.ref is not None and ep.seeded != ep.ref.name
        if ep.ref is not None:
            ep.seeded = ep.ref.name
        return seed if seed is not None else (self._next_seed() if self.mode == "fresh" or first else None)

    async def _reset_failed(self, i: int, seed: int | None, options: dict[str, Any] | None,
                            exc: BaseException) -> tuple[Any, dict[str, Any]]:
        """A :meth:`reset_now` whose answer was ``exc``: the env's own error in one line, or,
        its machine gone, the episode lost and the reset done again as :meth:`reset` does it."""
        ep = self.eps[i]
        err = self._asked(ep, exc)  # what it stands for, as a step's or a reset's on the loop says it
        if isinstance(err, OutOfTime):
            raise await self._out_of_time(ep, "reset")
        if isinstance(exc, AnswerError):
            self._reset_ended(ep, err)
            raise err
        await self._lost(ep, 1, str(exc))  # (hung up by _asked)
        return await self.reset(i, seed, options)

    def _reset_ended(self, ep: Episode, exc: BaseException) -> None:
        """A reset failed: the episode it began is not running (a step is refused until the next)."""
        if ep.running:
            quietly(self.records.end, ep, "error", str(exc))

    def _reset_answer(self, ep: Episode, out: Any) -> tuple[Any, dict[str, Any]]:
        where = self._where(ep)
        try:
            obs, info = answers.reset_answer(out, self.observation_space, where)
        except Exception as exc:  # whatever the answer held: this sub-env's error, not the others'
            err = exc if isinstance(exc, GymError) else E.unchecked(where, "a reset", exc)
            # its answers may no longer answer its requests (one answer too many): the next
            # request starts a new serving cell, and the episode begun is not running
            E.hang_up(ep)
            self._reset_ended(ep, err)
            raise err from None
        ep.obs = obs
        return obs, info

    async def step(self, i: int, action: Any) -> Step:
        """One step of sub-env ``i`` (its action already checked against the space)."""
        (out,) = await self.steps([i], [action])
        if isinstance(out, BaseException):
            raise out
        return out

    async def steps(self, which: list[int], actions: list[Any]) -> list[Step | BaseException]:
        """One step of each sub-env in ``which`` (actions already checked), all at once: every
        request written, then every answer read (one wait, not a task per sub-env). Each
        result is its Step or the error that sub-env's step raised."""
        outs: list[Any] = [None] * len(which)
        chans: list[int] = []
        cells: list[int] = []
        for k, i in enumerate(which):
            ep = self.eps[i]
            if not ep.running or ep.ref is None:
                outs[k] = GymError(f"{_where(i, self.n, ep)}: step() before reset() (or after the episode ended): "
                                   "call reset() first")
            else:
                (chans if ep.chan is not None else cells).append(k)
        for k in list(chans):
            ep = self.eps[which[k]]
            if ep.chan is not None and ep.chan.closed and await self._alive(ep):  # its last request never answered
                why = f"{self._where(ep)}: its last step was cut short (interrupted): reset() starts a new episode"
                quietly(self.records.end, ep, "error", why)
                outs[k] = GymError(why)
                chans.remove(k)
        if chans:
            lines = [self._action_line(actions[k]) for k in chans]
            got = await ask_all([self.eps[which[k]].chan for k in chans], lines)  # type: ignore[misc]
            for k, out in zip(chans, got):
                outs[k] = out if not isinstance(out, BaseException) else self._asked(self.eps[which[k]], out)
        if cells:  # no kept connections (e.g. the process backend): one cell per step
            async def cell(k: int) -> Any:
                data = json.dumps(spaces.action_data(self.action_space, actions[k]))
                try:
                    return await self._call(self.eps[which[k]], f"_smolgym_out = _smolgym.step({data!r})")
                except Exception as exc:
                    return exc
            for k, out in zip(cells, await asyncio.gather(*(cell(k) for k in cells))):
                outs[k] = out
        done = sorted(chans + cells)
        fits = spaces.inside(self.observation_space, [o.get("obs") if type(o) is dict else None for o in (outs[k] for k in done)])
        for k, fit in zip(done, fits):
            outs[k] = await self._stepped(self.eps[which[k]], outs[k], fit)
        return outs

    def resets_now(self, which: list[int]) -> list[int]:
        """Those of ``which`` whose reset without seed or options can go in :meth:`steps_now`'s
        batch: in place, on an open channel, between episodes (an autoreset)."""
        if self.mode != "in-place":
            return []
        return [i for i in which if (ep := self.eps[i]).chan is not None and not ep.chan.closed and not ep.running
                and ep.ref is not None]

    def steps_now(self, which: list[int], actions: list[Any], resets: list[int] | None = None) -> list[Any] | None:
        """:meth:`steps` with the requests and answers on the caller's thread (no hop to the
        loop): each result is its Step, or, for one that ended, failed or was refused, its
        checked answer or error for :meth:`finish` (the ledger and any rebuild stay on the
        loop). ``resets`` (from :meth:`resets_now`) are reset in the same batch, each result
        after those of ``which`` a :class:`Reset` for :meth:`finish`. None, with nothing sent,
        where a sub-env has no held channel."""
        eps = [self.eps[i] for i in which]
        again = [self.eps[i] for i in resets or ()]
        if not eps and not again:
            return []
        if any(not ep.running or ep.ref is None or ep.chan is None or ep.chan.closed for ep in eps):
            return None  # (a closed channel: a step cut short, or its machine gone: on the loop)
        got = ask_now([ep.chan for ep in eps + again],  # type: ignore[misc]
                      [self._action_line(a) for a in actions] + [RESET_LINE] * len(again))
        if got is None:
            return None
        if again:
            return self._stepped_now(eps, got[:len(eps)]) + [Reset(o) for o in got[len(eps):]]
        return self._stepped_now(eps, got)

    def _stepped_now(self, eps: list[Episode], got: list[Any]) -> list[Any]:
        fits = spaces.inside(self.observation_space, [o.get("obs") if type(o) is dict else None for o in got])
        outs: list[Any] = []
        for ep, out, fit in zip(eps, got, fits):
            if type(out) is dict and not out.get("terminated") and not out.get("truncated") and fit:
                try:
                    st = answers.step_answer(out, self.observation_space, ep, self.n, fit)
                except Exception:  # refused: recorded on the loop, after the others' answers
                    outs.append(Later(out, fit))
                    continue
                self._advance(ep, st)
                outs.append(st)
            else:
                outs.append(Later(out, fit))
        return outs

    async def finish(self, which: list[int], outs: list[Any]) -> list[Any]:
        """What :meth:`steps_now` left to the loop, done as :meth:`steps` does it; a
        :class:`Reset` as :meth:`reset` does it with the answer it got (its result, or the
        exception it raised)."""
        resets = [k for k, out in enumerate(outs) if isinstance(out, Reset)]
        for k, i in enumerate(which):
            out = outs[k]
            if isinstance(out, Later):
                ep = self.eps[i]
                got = out.out if not isinstance(out.out, BaseException) else self._asked(ep, out.out)
                outs[k] = await self._stepped(ep, got, out.fit)
        if resets:
            done = await asyncio.gather(*(self.reset(which[k], None, None, outs[k].out) for k in resets),
                                        return_exceptions=True)
            for k, out in zip(resets, done):
                outs[k] = out
        return outs

    def finish_now(self, which: list[int], outs: list[Any]) -> list[Any] | None:
        """:meth:`finish` on the caller's thread, where nothing needs the loop but the records
        (written after, see ``record.py``): every ended step and in-place autoreset answered
        as data, or an env's own error. None, with nothing done, otherwise."""
        for out in outs:
            got = out.out if isinstance(out, (Later, Reset)) else None
            if isinstance(got, BaseException) and (isinstance(out, Reset) or not isinstance(got, AnswerError)):
                return None  # a machine gone or a channel cut: on the loop (it may rebuild)
        with self.records.deferred():
            for k, i in enumerate(which):
                out, ep = outs[k], self.eps[i]
                if isinstance(out, Later):
                    got = self._asked(ep, out.out) if isinstance(out.out, AnswerError) else out.out
                    outs[k] = self._stepped_here(ep, got, out.fit)
                elif isinstance(out, Reset):
                    self.records.begin(ep, None)
                    try:
                        outs[k] = self._reset_answer(ep, out.out)
                    except GymError as exc:
                        outs[k] = exc
        return outs

    def _advance(self, ep: Episode, st: Step) -> None:
        ep.obs = st.obs
        ep.ret += st.reward
        ep.length += 1

    async def _stepped(self, ep: Episode, out: Any, fit: bool = False) -> Step | BaseException:
        """A sub-env's step answer (or its failure) checked and recorded (``fit``: its
        observation was already found to fit the space)."""
        if isinstance(out, OutOfTime):
            return await self._out_of_time(ep, "step")
        if isinstance(out, (InfraError, Unanswered)):
            if self.retries < 1 or await self._alive(ep):
                self.records.end(ep, "error", str(out))
                return GymError(str(out))
            # the machine died under the step: its episode is cut short (truncated), a new machine takes over
            await self._lost(ep, 1, str(out))
            return Step(ep.obs, 0.0, False, True, {"smolbench_lost": f"{self._where(ep)} died mid-step; a new machine "
                                                                     "from the warm parent takes over at the next reset"})
        return self._stepped_here(ep, out, fit)

    async def _out_of_time(self, ep: Episode, what: str) -> GymError:
        """``ep``'s machine sent no answer to a ``what`` within the env's timeout: its episode
        ends as timed out and the machine is deleted (its env may still be running the request)."""
        why = f"{self._where(ep)}: the {what} took longer than {self.timeout:g} s (timeout={self.timeout:g})"
        await self.abandon(ep.index, why, "timeout")
        return GymError(f"{why}: its machine is deleted; reset() starts a new episode")

    def _stepped_here(self, ep: Episode, out: Any, fit: bool) -> Step | BaseException:
        """:meth:`_stepped` for an answer, or an env's own error (on any thread)."""
        if isinstance(out, BaseException):
            if isinstance(out, GymError):
                self.records.end(ep, "error", str(out))
            return out
        try:
            st = answers.step_answer(out, self.observation_space, ep, self.n, fit)
        except Exception as exc:  # whatever the answer held: this sub-env's error, not the others'
            err = exc if isinstance(exc, GymError) else E.unchecked(self._where(ep), "a step", exc)
            self.records.end(ep, "error", str(err))
            return err
        self._advance(ep, st)
        if st.terminated or st.truncated:
            ep.rng, ep.own = E.plain_rng(out.get("rng")), E.plain_own(out.get("rng"))
            self.records.end(ep, "terminated" if st.terminated else "truncated")
            if self.mode == "fresh":
                _loop.get_loop().call_soon_threadsafe(self.pool.wake)
        return st

    def _next_seed(self) -> int:
        self.seeds = (self.seeds + 1) % 2**31
        return self.seeds

    def _node_id(self, ep: Episode) -> str:
        return ep.node.id if ep.node is not None else (ep.ref.name if ep.ref is not None else f"gym-sub-env-{ep.index}")
