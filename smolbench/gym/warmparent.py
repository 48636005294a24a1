"""A gym env's warm parent and the branches its sub-envs run in.

``make`` and ``make_vec`` share this. The warm parent is a branch of the session's
active machine in which ``smolbench/guest/gymserve.py`` built the env once; each
sub-env's machine is a branch of that parent: one each in place, and with fresh resets
one per episode, made ahead (``spares.py``) and deleted once its episode ends. A machine
that dies is rebuilt from the parent; closing deletes them all, the parent last.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import retries as retry
from .._aio import _to_the_end
from ..backends._channel import Channel
from ..backends.base import MachineRef
from ..errors import SmolbenchError, reworded
from ..gate import terminal
from ..ledger import code_hash
from ..tree import GYM_RUN, Node
from . import answers, envnames, envspec, sending, spaces
from . import episode as E
from ._host import Host
from .envnames import NAME_RE
from .episode import BadArgument, EnvError, Episode, GymError, OutOfTime
from .practice import practise
from .record import Records, quietly
from .requests import Requests
from .spares import NO_ROOM_LIMIT, NoSpare, Spares, live

if TYPE_CHECKING:
    from typing_extensions import Self

GUEST = Path(__file__).resolve().parent.parent / "guest" / "gymserve.py"
RESETS = ("fresh", "in-place")
BUILD_TIMEOUT = 600.0  # s building the env in its warm parent may take, where make's timeout is set (not that
# timeout: it is each reset's and step's, and a big simulator may load for longer than a step may take)
SETUP = """\
import types as _smolgym_types
_smolgym_mod = _smolgym_types.ModuleType("_smolbench_gymserve")
exec(compile(_smolgym_src, "<smolbench gymserve>", "exec"), _smolgym_mod.__dict__)
_smolgym = _smolgym_mod.Server({factory}, reseed={reseed})
del _smolgym_types, _smolgym_mod, _smolgym_src
_smolgym_out = _smolgym.build()
"""


def check_arguments(env: Any, num_envs: Any, reset: Any, timeout: Any, reseed: Any) -> None:
    """``make``'s and ``make_vec``'s arguments, checked before any machine is made (one line,
    a ValueError, as Gymnasium raises for a bad argument)."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not 0 < timeout < float("inf")):
        raise BadArgument(f"timeout should be a number of seconds above 0 (or None: no limit), got {str(timeout)[:40]}")
    if not isinstance(reseed, bool):
        raise BadArgument(f"reseed should be True or False, got {str(reseed)[:40]}")
    if reset not in RESETS:
        raise BadArgument(f"reset should be 'fresh' or 'in-place', got {reset!r}")
    if isinstance(num_envs, bool) or not isinstance(num_envs, int) or not 1 <= num_envs <= 256:
        raise BadArgument(f"num_envs should be a whole number from 1 to 256, got {num_envs!r}")
    if isinstance(env, str):
        if not NAME_RE.fullmatch(env):
            raise BadArgument(f"env {env!r} is not a Python name: give the name of a zero-argument callable "
                              "defined in the session's machine, a gymnasium id (CartPole-v1), or the callable")
    elif not callable(env):
        raise BadArgument(f"env should be a zero-argument callable or the name of one in the machine, got {type(env).__name__}")


class WarmParent(Requests):
    """The warm parent and ``num_envs`` sub-env machines of one gym env (runs on smolbench's loop)."""

    def __init__(self, host: Host, env: str | Callable[[], Any], num_envs: int, reset: str, retries: int | None,
                 vector: bool = False, timeout: float | None = None, reseed: bool = True) -> None:
        check_arguments(env, num_envs, reset, timeout, reseed)
        self.host = host
        self.wb = host.wb
        self.env = env
        self.n = num_envs
        self.vector = vector  # make_vec: its spaces are batched (spaces.within_budget counts that)
        self.mode = reset
        self.reseed = bool(reseed)  # False: the env's own generators are left alone (make's reseed=False)
        self.own_streams = 0  # generators the env keeps itself (its description says), reseeded or carried on
        self.retries = self.wb.retries if retries is None else retries
        self.timeout = None if timeout is None else float(timeout)
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

    # -- the warm parent ------------------------------------------------------------

    async def start(self) -> None:
        """Branch the session's active machine into the warm parent, build the env there,
        rebuild its spaces here, and make the sub-envs' machines."""
        wb = self.wb
        active = wb.require_up()
        (name,) = wb.tree.next_child_ids(active.name, 1)
        self._runs = f"{wb.session}/{GYM_RUN}-{name}"  # (Workbench.replay knows a gym episode by it: tree.gym_episode)
        self.run_id = self._runs
        what = self.env if isinstance(self.env, str) else getattr(self.env, "__qualname__", type(self.env).__name__)
        wb.ledger.start_run(self.run_id, wb.session, kind=GYM_RUN, parent_id=active.name, code=f"smolbench.gym: {what}",
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
            try:
                push["_smolgym_factory"] = sending.dumps(self.env)
            except Exception as exc:
                raise GymError(f"the env callable can't be sent to the machine ({type(exc).__name__}: "
                               f"{str(exc)[:200]}): make it build what it needs inside, e.g. "
                               "lambda: gymnasium.make('CartPole-v1')") from None
            factory = "_smolgym_factory"
        else:
            factory = self.env
        setup = Episode(-1, ref=ref)
        try:
            described = await self._call(setup, SETUP.format(factory=factory, reseed=self.reseed), push=push,
                                         bounded=self.timeout is not None, left=BUILD_TIMEOUT)
        except OutOfTime:
            raise GymError(f"the env could not be built in machine {name}: building it took longer than "
                           f"{BUILD_TIMEOUT:g} s (smolbench.gym.warmparent.BUILD_TIMEOUT, with timeout= set): its "
                           "machine is deleted") from None
        except GymError as exc:
            misnamed = await self._misnamed(setup, exc)
            why = misnamed or str(exc).split(": ", 1)[-1]
            if (exc.machine_error or {}).get("ename") == "ModuleNotFoundError":
                why = f"{why}: {sending.MISSING_HINT}"
            said = f"the env could not be built in machine {name}: {why}"
            if misnamed is not None or not isinstance(exc, EnvError):  # (a name's fix: gymnasium's frames are noise)
                raise GymError(said) from None
            raise reworded(exc, said) from None
        node.cells += setup.cells
        if isinstance(described, dict) and isinstance(described.get("shared"), str):  # (gymserve's shared_left)
            said = (terminal.printable(described["shared"]).splitlines() or ["?"])[0][:400]
            raise GymError(f"the env could not be built in machine {name}: {said}")
        self._describe(described, name)
        wb._record(node)
        await self.start_sibling()

    async def _misnamed(self, setup: Episode, exc: GymError) -> str | None:
        """The one line for an env name or id the machine does not know, with the closest it
        does (asked of it, in the warm parent the env was not built in); None for another error."""
        what = envnames.unknown(self.env, exc.machine_error)
        if what is None:
            return None
        try:
            names = await self._call(setup, envnames.NAMES_CELL, bounded=False)
        except Exception:  # it can't say: gymnasium's ids here, then
            names = None
        return envnames.misnamed(what, names)

    def sibling(self, num_envs: int = 1) -> Self:
        """Another env on the same warm parent (an OpenEnv client's session): its own
        machines, branched from the parent this one built; closing it leaves the parent."""
        other = type(self)(self.host, self.env, num_envs, self.mode, self.retries, timeout=self.timeout,
                           reseed=self.reseed)
        other.parent, other.run_id, other.described = self.parent, self.run_id, self.described
        other.observation_space, other.action_space = self.observation_space, self.action_space
        other.bound = self.bound
        other.own_streams = self.own_streams
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
            observations = spaces.space_from_data(described.get("observation_space"))
            actions = spaces.space_from_data(described.get("action_space"))
            spaces.sampled_within_budget(actions, self.n if self.vector else 0)  # what sample() costs
            self.observation_space, self.action_space = observations, actions
        except spaces.Refused as exc:
            raise GymError(f"machine {where} described its env's spaces wrongly: {exc}") from None
        self.bound = answers.wire_bound(self.observation_space)  # every channel's answers are held to it
        self.described = envspec.described(described)
        own = described.get("own_streams")
        self.own_streams = own if type(own) is int and 0 <= own <= 10**6 else 0

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

    async def abandon(self, i: int, why: str, how: str = "error") -> None:
        """Sub-env ``i``'s request was cut (out of time): its episode ends ``how``, its machine
        is deleted (what its env did is unknown); the next reset starts in a new branch."""
        ep = self.eps[i]
        E.hang_up(ep)
        ref, ep.ref = ep.ref, None
        if ep.running:
            quietly(self.records.end, ep, how, why)
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
        warm parent's close waits for) instead of being deleted one by one; it still returns
        once they are gone."""
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
        # The practice episode is ours, not the user's: stopped, not waited for (a step that
        # never ends held the close for its whole PRACTICE_TIMEOUT). It deletes its machine.
        practice = self._practice
        if practice is not None:
            practice.cancel()
        own_pool = self.pool.m is self  # a sibling's pool is the warm parent's: it stays for the others
        if own_pool:
            await self.pool.settle()
        if practice is not None:
            await _to_the_end(asyncio.wait({practice}))
        for ep in self.eps:
            if ep.running:
                quietly(self.records.end, ep, "closed")
            if let_go and ep.ref is not None and not own_pool and not self.pool.m.closed:
                old, ep.ref, ep.chan = [(ep.ref, ep.chan)], None, None
                await self.pool.let_go(old)
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
