"""A gym env's machines: its warm parent, one machine per sub-env, and every episode's record.

``make`` and ``make_vec`` share this. The warm parent is a branch of the session's
active machine in which ``smolbench/guest/gymserve.py`` built the env once; each
sub-env's machine is a branch of that parent. With ``reset="fresh"`` every episode gets
a new branch (made ahead of time and warmed, so a reset costs about what an in-place one does:
``practice.py`` says which pages it takes ahead) and
the finished episode's machine is deleted; the one thing that carries over is the env's
random generator state, as data, so that ``reset()`` without a seed continues the
stream as one long-lived env would (Gymnasium's seeding). Every request is a one-line
cell whose result comes back through the gate as data (``--pull``), then is checked
against the rebuilt spaces. Every episode is a node of the fork tree and a ledger row.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import pickle
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gymnasium import spaces as S

from .. import _loop
from .. import retries as retry
from .._aio import _to_the_end
from ..backends._channel import Channel, ask_all, ask_now, askable_now
from ..backends.base import CellRequest, MachineRef
from ..errors import InfraError, SmolbenchError
from ..gate.channel import AnswerError
from ..guest import protocol as P
from ..ledger import code_hash
from ..tree import Node
from . import envspec, spaces
from . import episode as E
from ._host import Host
from .episode import OUT, UNSENT, Episode, GymError, Later, Reset, Step, Unanswered, _where
from .info import checked_info
from .practice import practise
from .record import Records, quietly
from .spares import NO_ROOM_LIMIT, NoSpare, Spares, live

GUEST = Path(__file__).resolve().parent.parent / "guest" / "gymserve.py"
RESETS = ("fresh", "in-place")
NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SETUP = """\
import types as _smolgym_types
_smolgym_mod = _smolgym_types.ModuleType("_smolbench_gymserve")
exec(compile(_smolgym_src, "<smolbench gymserve>", "exec"), _smolgym_mod.__dict__)
_smolgym = _smolgym_mod.Server({factory})
del _smolgym_types, _smolgym_mod, _smolgym_src
_smolgym_out = _smolgym.build()
"""

RESET_LINE = P.encode({"op": "reset", "r": json.dumps({"seed": None, "rng": None, "options": None}), "seed": None})


class Machines:
    """The warm parent and ``num_envs`` sub-env machines of one gym env (runs on smolbench's loop)."""

    def __init__(self, host: Host, env: str | Callable[[], Any], num_envs: int, reset: str, retries: int | None,
                 vector: bool = False) -> None:
        if reset not in RESETS:
            raise SmolbenchError(f"reset should be 'fresh' or 'in-place', got {reset!r}")
        if isinstance(num_envs, bool) or not isinstance(num_envs, int) or not 1 <= num_envs <= 256:
            raise SmolbenchError(f"num_envs should be a whole number from 1 to 256, got {num_envs!r}")
        if isinstance(env, str):
            if not NAME_RE.fullmatch(env):
                raise SmolbenchError(f"env {env!r} is not a Python name: give the name of a zero-argument callable "
                                     "defined in the session's machine, a gymnasium id (CartPole-v1), or the callable")
        elif not callable(env):
            raise SmolbenchError(f"env should be a zero-argument callable or the name of one in the machine, got {type(env).__name__}")
        self.host = host
        self.wb = host.wb
        self.env = env
        self.n = num_envs
        self.vector = vector  # make_vec: its spaces are batched (spaces.within_budget counts that)
        self.mode = reset
        self.retries = self.wb.retries if retries is None else retries
        self.parent: MachineRef | None = None
        self.observation_space: Any = None
        self.action_space: Any = None
        self.described: dict[str, Any] = {}
        self.eps = [Episode(i) for i in range(num_envs)]
        self._branching = asyncio.Lock()  # one fork request at a time on the warm parent (shared by siblings)
        self.owns_parent = True
        self._pages: str | None = None  # what the practice episode made its own (JSON): new spares take it ahead
        self._practice: asyncio.Future[None] | None = None
        self._origin = self  # the env that built the warm parent (and learned the pages)
        self.records = Records(self)
        self.run_id = ""
        self.closed = False
        self._close_done: asyncio.Future[None] | None = None  # done when the first close has ended
        self.seeds = int.from_bytes(os.urandom(4), "little")  # each fresh machine's global seed, when reset has none
        self.room = NO_ROOM_LIMIT  # live branches the warm parent has room for (the backend says)
        self.pool = Spares(self)  # fresh resets' spares
        self.pool.deletions = self._check_room()

    def live_branches(self) -> int:
        """Branches of the warm parent this env holds at most at once: one per sub-env, and with
        fresh resets its spares and as many being deleted."""
        return live(self.n, self.mode, self.room)

    def _check_room(self) -> int:
        """Refuse up front, in one line, more sub-envs than one warm parent has room for; how
        many deletions may run at once (the room left, at most 32: a deleted machine holds its
        namespaces until its processes are gone)."""
        room_of = getattr(self.wb.backend, "branch_room", None)
        if room_of is None:
            return self.pool.count
        room, why = room_of(self.wb.spec)
        self.room = room
        if self.live_branches() <= room:
            spares = self.pool.count
            return min(32, max(spares, room - self.n - spares - 1))
        fits = max([k for k in range(1, room + 1) if live(k, self.mode, room) <= room] or [0])
        raise SmolbenchError(
            f"num_envs={self.n} needs {self.live_branches()} live branches of one warm parent at once; it has room "
            f"for {room} ({why}): use at most {fits} envs per {'make_vec' if self.n > 1 else 'env'} with "
            f"reset={self.mode!r}, or several make_vec envs side by side")

    # -- requests -------------------------------------------------------------------

    async def _call(self, ep: Episode, code: str, *, push: dict[str, bytes] | None = None,
                    seed: int | None = None) -> Any:
        """One request to ``ep``'s machine; its pulled result (data, checked by the gate)."""
        ref = ep.ref
        assert ref is not None
        ep.cells += 1
        req = CellRequest(code, push=push or {}, pull=[OUT], cell_name=f"<gym-{ep.cells}>", seed=seed)
        where = _where(ep.index, self.n, ep)
        try:
            res = await E.when_free(lambda: self.wb.backend.exec_cell(ref, req, _ignore))
        except InfraError:
            raise
        except SmolbenchError as exc:  # refused by the gate, or the machine is gone: one line naming the sub-env
            raise Unanswered(f"{where}: {exc}") from None
        return E.cell_out(res, where)

    @property
    def channels(self) -> bool:
        """Whether each episode keeps one connection to its machine (the agent-host backends)."""
        return hasattr(self.wb.backend, "open_channel")

    async def _serve(self, ep: Episode, reset: str | None, seed: int | None, pages: str | None = None,
                     learn: bool = False) -> Any:
        """Start ``ep``'s serving cell with its episode's reset (None: it waits for one, having
        taken ``pages`` ahead, or noting its own with ``learn``); the reset's answer."""
        ref = ep.ref
        assert ref is not None
        ep.cells += 1
        code = f"_smolgym.serve(smolbench_guest, {reset!r}{f', {pages!r}' if pages else ''}{', learn=True' if learn else ''})"
        req = CellRequest(code, cell_name=f"<gym-{ep.cells}>", seed=seed)
        where = _where(ep.index, self.n, ep)

        async def start() -> Any:
            E.hang_up(ep)
            ep.chan = chan = await self.wb.backend.open_channel(ref, req)  # type: ignore[attr-defined]
            return await chan.answer()
        try:
            return await E.when_free(start)
        except BaseException as exc:
            E.hang_up(ep)
            raise E.failed(exc, where) from None

    async def _ask(self, ep: Episode, msg: dict[str, Any]) -> Any:
        """One request on ``ep``'s channel; its answer (data, checked by the gate)."""
        assert ep.chan is not None
        where = _where(ep.index, self.n, ep)
        try:
            return await ep.chan.ask(msg)
        except AnswerError as exc:
            raise GymError(f"{where}: {exc}") from None
        except BaseException as exc:
            E.hang_up(ep)
            raise E.failed(exc, where) from None

    async def _request(self, ep: Episode, op: str, cell: str, **fields: Any) -> Any:
        """``op`` on ``ep``'s machine: on its channel if one is open, else as the one-line ``cell``."""
        if ep.chan is not None:
            return await self._ask(ep, {"op": op, **fields})
        return await self._call(ep, cell)

    # -- the warm parent ------------------------------------------------------------

    async def start(self) -> None:
        """Branch the session's active machine into the warm parent, build the env there,
        rebuild its spaces here, and make the sub-envs' machines."""
        wb = self.wb
        active = wb.require_up()
        (name,) = wb.tree.next_child_ids(active.name, 1)
        self._runs = f"{wb.session}/gym-{name}"
        self.run_id = self._runs
        what = self.env if isinstance(self.env, str) else getattr(self.env, "__qualname__", type(self.env).__name__)
        wb.ledger.start_run(self.run_id, wb.session, kind="gym", parent_id=active.name, code=f"smolbench.gym: {what}",
                            code_hash=code_hash(str(what)), n=self.n, options={"reset": self.mode, "num_envs": self.n})
        wb._claim(active.name)
        try:
            (ref,) = await retry.branch(wb, active, [name], [None], self.retries)
        finally:
            wb._release(active.name)
        wb.machines[name] = ref
        node = wb.tree.add(Node(name, active.name, None, status="idle", started=time.time(), run_id=self.run_id,
                                forked_at=wb.tree[active.name].cells, kept=True))
        wb._record(node, code=f"smolbench.gym parent: {what}")
        self.parent = ref
        push = {"_smolgym_src": pickle.dumps(GUEST.read_text())}
        if callable(self.env):
            import cloudpickle

            try:
                push["_smolgym_factory"] = cloudpickle.dumps(self.env)
            except Exception as exc:
                raise GymError(f"the env callable can't be sent to the machine ({type(exc).__name__}: "
                               f"{str(exc)[:200]}): make it build what it needs inside, e.g. "
                               "lambda: gymnasium.make('CartPole-v1')") from None
            factory = "_smolgym_factory"
        else:
            factory = self.env
        setup = Episode(-1, ref=ref)
        try:
            described = await self._call(setup, SETUP.format(factory=factory), push=push)
        except GymError as exc:
            raise GymError(f"the env could not be built in machine {name}: {str(exc).split(': ', 1)[-1]}") from None
        node.cells += setup.cells
        self._describe(described, name)
        wb._record(node)
        await self.start_sibling()

    def sibling(self, num_envs: int = 1) -> Machines:
        """Another env on the same warm parent (an OpenEnv client's session): its own
        machines, branched from the parent this one built; closing it leaves the parent."""
        other = Machines(self.host, self.env, num_envs, self.mode, self.retries)
        other.parent, other.run_id, other.described = self.parent, self.run_id, self.described
        other.observation_space, other.action_space = self.observation_space, self.action_space
        other._branching, other.owns_parent = self._branching, False
        other.records.kept = self.records.kept  # the episodes kept in memory: counted for all
        other._origin = self
        if self.mode == "fresh":
            # One pool of spares for every sibling: each is a pristine branch of the same warm
            # parent, taken by one episode. A pool each made 16 branches per OpenEnv session
            # (and per stateless HTTP /reset, deleted right after), 17x the machines.
            other.pool = self._origin.pool
        return other

    async def start_sibling(self) -> None:
        """Make a sibling's own machines (see :meth:`sibling`)."""
        if self.mode == "in-place":
            refs = await self._branch(self.n)
            for ep, r in zip(self.eps, refs):
                ep.ref = r
        else:
            # first, so its branch is forked before the spares; only where spares keep a
            # connection (take pages ahead): elsewhere it was a branch made for nothing
            if self.owns_parent and self.channels:
                self._practice = asyncio.ensure_future(self._learn())
            self.pool.top_up(self.pool.count)

    async def _learn(self) -> None:
        self._pages = await practise(self, Episode(-1))

    def _describe(self, described: Any, where: str) -> None:
        if not isinstance(described, dict):
            raise GymError(f"machine {where} described its env as a {type(described).__name__}")
        try:
            spaces.within_budget([described.get("observation_space"), described.get("action_space")],
                                 self.n if self.vector else 0)
            self.observation_space = spaces.space_from_data(described.get("observation_space"))
            self.action_space = spaces.space_from_data(described.get("action_space"))
        except spaces.Refused as exc:
            raise GymError(f"machine {where} described its env's spaces wrongly: {exc}") from None
        self.described = envspec.described(described)

    # -- machines for episodes --------------------------------------------------------

    async def _branch(self, k: int) -> list[MachineRef]:
        """``k`` new branches of the warm parent (one fork request), in the tree and the ledger."""
        assert self.parent is not None
        wb = self.wb
        async with self._branching:
            names = wb.tree.next_child_ids(self.parent.name, k)  # given out by the tree: never two alike
            refs = await retry.branch(wb, self.parent, names, [None] * k, self.retries, leaf=True)  # never forked
        for r in refs:
            wb.machines[r.name] = r
        return refs

    async def _wait_in(self, ref: MachineRef) -> Channel | None:
        """A serving cell in ``ref`` that waits for its episode's reset (None: the reset starts one)."""
        if not self.channels or self.closed:
            return None
        ep = Episode(-1, ref=ref)
        try:
            await self._serve(ep, None, None, self._origin._pages)
        except asyncio.CancelledError:  # the env is closing (see Spares.settle)
            E.hang_up(ep)
            raise
        except Exception:  # the reset will say what is wrong (and rebuild under retries)
            E.hang_up(ep)
            return None
        return ep.chan

    async def _spare(self) -> tuple[MachineRef, Channel | None]:
        try:
            return await self.pool.take()
        except NoSpare as exc:
            raise GymError(str(exc)) from None

    async def _delete(self, ref: MachineRef) -> None:
        for ep in self.eps:  # its episode's serving cell goes with it
            if ep.ref is ref:
                E.hang_up(ep)
        self.wb.machines.pop(ref.name, None)
        self.pool.gone(ref)
        with contextlib.suppress(Exception):
            await self.wb.backend.delete(ref)

    # -- episodes -----------------------------------------------------------------------

    async def reset(self, i: int, seed: int | None, options: dict[str, Any] | None,
                    sent: Any = UNSENT) -> tuple[Any, dict[str, Any]]:
        """Reset sub-env ``i``: in a new branch of the warm parent (fresh) or in its machine
        (``sent``: the answer its first attempt got in a step's batch, see :meth:`steps_now`)."""
        ep = self.eps[i]
        if ep.running:
            if self.mode == "fresh" and seed is None and ep.ref is not None:
                with contextlib.suppress(SmolbenchError):  # continue its random stream, as one env would
                    ep.rng = E.plain_rng(await self._request(ep, "rng", "_smolgym_out = _smolgym.rng()"))
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
                    return await self._ask(ep, {"op": "reset", "r": req, "seed": global_seed})
                if self.channels:
                    return await self._serve(ep, req, global_seed)
                return await self._call(ep, f"_smolgym_out = _smolgym.reset({req!r})", seed=global_seed)
            except Unanswered as exc:
                if await self._alive(ep):
                    raise
                raise InfraError(str(exc)) from None  # its machine died: rebuilt below, under retries

        async def rebuild(attempt: int) -> None:
            await self._lost(ep, attempt)

        try:
            out = await retry.again(self.wb, [self._node_id(ep)], "gym reset", self.retries, once, rebuild)
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
            if (ep.running and seed is None) or not self.pool.ready:
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
        req = json.dumps({"seed": seed, "rng": ep.rng if self.mode == "fresh" else None, "options": options})
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
        if isinstance(exc, AnswerError):
            err = GymError(f"{self._where(ep)}: {exc}")
            self._reset_ended(ep, err)
            raise err
        E.hang_up(ep)
        await self._lost(ep, 1, str(exc))
        return await self.reset(i, seed, options)

    def _reset_ended(self, ep: Episode, exc: BaseException) -> None:
        """A reset failed: the episode it began is not running (a step is refused until the next)."""
        if ep.running:
            quietly(self.records.end, ep, "error", str(exc))

    def _reset_answer(self, ep: Episode, out: Any) -> tuple[Any, dict[str, Any]]:
        where = self._where(ep)
        try:
            if not isinstance(out, dict) or set(out) - {"obs", "info"}:
                raise GymError(f"{where} answered a reset with something other than an observation and an info")
            obs = self._obs(out.get("obs"), where)
            info = checked_info(out.get("info"), where)
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
        if any(not ep.running or ep.ref is None or ep.chan is None for ep in eps):
            return None
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
                    st = self._step(out, ep, fit)
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
                    got = GymError(f"{self._where(ep)}: {out.out}") if isinstance(out.out, AnswerError) else out.out
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
            return GymError(f"{where}: {exc}")
        E.hang_up(ep)
        return E.failed(exc, where)

    async def _stepped(self, ep: Episode, out: Any, fit: bool = False) -> Step | BaseException:
        """A sub-env's step answer (or its failure) checked and recorded (``fit``: its
        observation was already found to fit the space)."""
        if isinstance(out, (InfraError, Unanswered)):
            if self.retries < 1 or await self._alive(ep):
                self.records.end(ep, "error", str(out))
                return GymError(str(out))
            # the machine died under the step: its episode is cut short (truncated), a new machine takes over
            await self._lost(ep, 1, str(out))
            return Step(ep.obs, 0.0, False, True, {"smolbench_lost": f"{self._where(ep)} died mid-step; a new machine "
                                                                     "from the warm parent takes over at the next reset"})
        return self._stepped_here(ep, out, fit)

    def _stepped_here(self, ep: Episode, out: Any, fit: bool) -> Step | BaseException:
        """:meth:`_stepped` for an answer, or an env's own error (on any thread)."""
        if isinstance(out, BaseException):
            if isinstance(out, GymError):
                self.records.end(ep, "error", str(out))
            return out
        try:
            st = self._step(out, ep, fit)
        except Exception as exc:  # whatever the answer held: this sub-env's error, not the others'
            err = exc if isinstance(exc, GymError) else E.unchecked(self._where(ep), "a step", exc)
            self.records.end(ep, "error", str(err))
            return err
        self._advance(ep, st)
        if st.terminated or st.truncated:
            ep.rng = E.plain_rng(out.get("rng"))
            self.records.end(ep, "terminated" if st.terminated else "truncated")
            if self.mode == "fresh":
                _loop.get_loop().call_soon_threadsafe(self.pool.wake)
        return st

    def _step(self, out: Any, ep: Episode, fit: bool = False) -> Step:
        """``out`` checked as ``ep``'s step (``fit``: its observation was found to fit); its
        line names the sub-env (made only for an error: this runs for every step)."""
        if not isinstance(out, dict) or (out.keys() != STEP_KEYS and out.keys() != STEP_KEYS_RNG):
            raise GymError(f"{self._where(ep)} answered a step with something other than (obs, reward, terminated, "
                           "truncated, info)")
        reward = out["reward"]
        # abs() first: an integer past a float's range is refused, not an OverflowError in isfinite
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or abs(reward) > 1e300 \
                or not math.isfinite(reward):
            raise GymError(f"{self._where(ep)} sent a reward of {str(reward)[:40]}: rewards must be finite numbers")
        terminated, truncated, info = out["terminated"], out["truncated"], out["info"]
        if type(terminated) is not bool or type(truncated) is not bool:
            key = "terminated" if type(terminated) is not bool else "truncated"
            raise GymError(f"{self._where(ep)} sent {key} = {str(out[key])[:40]}, not True or False")
        obs = out["obs"] if fit else self._obs(out["obs"], self._where(ep))
        if type(info) is not dict or info:  # an empty dict is an info as it is
            info = checked_info(info, self._where(ep))
        if type(reward) is int and abs(reward) > 2**53:  # past a float64's exact ints: np.array(rewards) of objects
            reward = float(reward)
        return Step(obs, reward, terminated, truncated, info)  # an int stays one (the env's own: Taxi's)

    def _where(self, ep: Episode) -> str:
        return _where(ep.index, self.n, ep)

    def _obs(self, value: Any, where: str) -> Any:
        try:
            return spaces.check(self.observation_space, value)
        except spaces.Refused as exc:
            raise GymError(f"{where} sent an observation that does not fit: {exc}") from None

    def _next_seed(self) -> int:
        self.seeds = (self.seeds + 1) % 2**31
        return self.seeds

    def _node_id(self, ep: Episode) -> str:
        return ep.node.id if ep.node is not None else (ep.ref.name if ep.ref is not None else f"gym-sub-env-{ep.index}")

    async def _alive(self, ep: Episode) -> bool:
        if ep.ref is None or ep.ref.name not in self.wb.machines:
            return False
        ping = getattr(self.wb.backend, "info", None)
        if ping is None:  # a backend that can't be asked: not taken for dead
            return True
        try:
            await asyncio.wait_for(ping(ep.ref), 10)
        except Exception:
            return False
        return True

    async def _lost(self, ep: Episode, attempt: int, why: str = "") -> None:
        """``ep``'s machine died: record it, and give the sub-env a new branch of the warm parent."""
        old = ep.ref
        if ep.node is not None:
            self.records.end(ep, "lost", why or "the machine died")
        if old is not None:
            await self._delete(old)
            ep.ref = None
        if self.mode == "in-place":
            (ep.ref,) = await self._branch(1)
        if why:
            self.wb.ledger.add_attempt(self.wb.session, old.name if old else "?", attempt, "gym step", "rebuilt", why)

    async def abandon(self, i: int, why: str) -> None:
        """Sub-env ``i``'s request was cut (out of time): its episode ends as an error, its machine
        is deleted (what its env did is unknown); the next reset starts in a new branch."""
        ep = self.eps[i]
        E.hang_up(ep)
        ref, ep.ref = ep.ref, None
        if ep.running:
            quietly(self.records.end, ep, "error", why)
        if ref is not None and ref.name in self.wb.machines:
            await _to_the_end(self._delete(ref))
        if self.mode == "in-place" and not self.closed:
            (ep.ref,) = await self._branch(1)

    def shutdown(self) -> None:
        """``close`` from the caller's thread, then the host (the session, if this env made it)."""
        if not self.closed:
            try:
                self.host.run(self.close())
            finally:
                self.host.close()

    async def close(self, let_go: bool = False) -> None:
        """End every episode and delete every machine of this env (the warm parent too).
        ``let_go``: a sibling's machines go to the shared pool's batched deletions (which the
        warm parent's close waits for) instead of being waited on here."""
        if self.closed:
            if self._close_done is not None:  # a close already running: this one ends with it
                await asyncio.shield(self._close_done)
            return
        self.closed = True
        self._close_done = asyncio.get_running_loop().create_future()
        try:
            await self._close(let_go)
        finally:
            self._close_done.set_result(None)

    async def _close(self, let_go: bool) -> None:
        quietly(self.records.flush)  # no record, written or not, stops the deletions below
        own_pool = self.pool.m is self  # a sibling's pool is the warm parent's: it stays for the others
        if own_pool:
            await self.pool.settle()
        if self._practice is not None:  # it deletes its machine, whatever happens
            await asyncio.gather(self._practice, return_exceptions=True)
        for ep in self.eps:
            if ep.running:
                quietly(self.records.end, ep, "closed")
            if let_go and ep.ref is not None and not own_pool and not self.pool.m.closed:
                old, ep.ref, ep.chan = [(ep.ref, ep.chan)], None, None
                self.pool.retire(old)
            elif ep.ref is not None:
                await _to_the_end(self._delete(ep.ref))
                ep.ref = None
        if own_pool:
            await self.pool.close(lambda r: _to_the_end(self._delete(r)))
        if self.parent is not None and self.owns_parent:
            if self.parent.name in self.wb.tree:  # the warm parent's work is done
                pnode = self.wb.tree[self.parent.name]
                pnode.status, pnode.ended = "ok", time.time()
            with contextlib.suppress(Exception):
                await self.wb.delete(self.parent.name)
        self.parent = None
        if self.run_id and self.owns_parent:
            quietly(self.wb.ledger.end_run, self.run_id, "done")


STEP_KEYS = {"obs", "reward", "terminated", "truncated", "info"}
STEP_KEYS_RNG = STEP_KEYS | {"rng"}


def _ignore(event: Any) -> None:
    """Output of a gym request is not shown (the env's own prints stay in its machine's record)."""

