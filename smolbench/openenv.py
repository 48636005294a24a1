"""A machine-backed environment served over OpenEnv's protocol (``smolbench serve``).

Built on the OpenEnv package's own server app (``openenv-core``: ``create_fastapi_app``,
its HTTP and WebSocket routes and session handling). The env is built once in a warm
parent machine (``smolbench.gym``); every client session OpenEnv opens gets its own
branch of that parent, and every episode of it a fresh branch (``reset="fresh"``).
Observations reach the client as JSON made from what the gate already checked.
Needs ``pip install 'jupyterlab-smolbench[openenv]'``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import math
import re
import sys
import threading
import uuid
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, NoReturn, TypeVar

import numpy as np
from openenv.core.env_server.exceptions import SessionCapacityError
from openenv.core.env_server.http_server import HTTPEnvServer
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import (
    Action,
    EnvironmentMetadata,
    Observation,
    ResetRequest,
    State,
)
from pydantic import Field
from starlette.websockets import WebSocket

from ._asgi import CLIENT_GONE, ONE_REQUEST
from ._replies import (
    forget,
    json_size,
    reply_room,
    space_json_size,
    spliced,
    to_json,
    to_json_served,
)
from .errors import SmolbenchError
from .gate import frames
from .gym.env import _options, check_seed
from .gym.machines import Machines

__all__ = ["GymAction", "GymObservation", "MachineEnvironment", "app_for", "json_size", "reply_room",
           "space_json_size", "to_json"]

T = TypeVar("T")
REQUEST_TIMEOUT = 120.0  # s one reset or step may take (smolbench serve --request-timeout)
IDLE_TIMEOUT = 600.0  # s a session may go without a request before it is closed (--idle-timeout)
MAX_MESSAGE = 1 << 20  # bytes of an HTTP request body or a WebSocket message (--max-message)
# bytes of JSON one reset's or step's observation and info may take (--max-reply), counted before
# any is made: a reply is held about 3x over while it is sent (its arrays' JSON text, then the
# reply's text; then that text, its bytes and the WebSocket's frame), so 16 MiB is ~50 MiB a session
MAX_REPLY = 16 << 20
GRACE = 30.0  # s a cut request's clean-up, or a session's close, may take on top
# Set once this process's server is stopping (Ctrl-C, SIGTERM): a request cut then was cut by
# the stop, not by its client, and its episode's row and its client's line say so.
STOPPING = threading.Event()
# a session refused at the cap (both kinds: see app_for), as the WebSocket's error and HTTP's 503 say it
AT_CAPACITY = ("the server is at capacity: {active}/{cap} sessions open (smolbench serve --max-sessions {cap}; "
               "each WebSocket session counts, and each HTTP /reset while it runs, each until its machine is "
               "deleted): close a session you hold, "
               "or retry once one has ended (idle ones are closed after --idle-timeout), "
               "or restart the server with a higher --max-sessions")
NO_MCP = "Unknown message type: mcp (this env has no MCP tools; send reset, step, state or close)"
# OpenEnv's HTTP /reset and /step are stateless: each request gets a session (an env from the
# app's factory) of its own, closed after it, so an HTTP step never follows a reset.
STATELESS_STEP = ("no episode to step: OpenEnv's HTTP POST /step is stateless (each request is a session of its own, "
                  "closed after it), so no reset comes before it; reset and step over one WebSocket session (/ws), "
                  "as OpenEnv's client does: GenericEnvClient(base_url=URL).sync()")


class GymAction(Action):
    """An action for the machine's env, as JSON (an int for Discrete, nested lists for arrays,
    a dict or list for Dict and Tuple spaces)."""

    action: Any = Field(description="the action, as JSON")


class GymObservation(Observation):
    """What one reset or step gave: the observation as JSON, and Gymnasium's ends and info."""

    observation: Any = Field(default=None, description="the observation, as JSON")
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = Field(default_factory=dict)
    machine: str | None = Field(default=None, description="this session's name for the machine this episode runs in")


class SeedAsSent(ResetRequest):
    """OpenEnv's HTTP reset body with the seed as the client sent it: its lax ``int`` took
    ``true`` as 1 and ``"1"`` as 1; :func:`check_seed` refuses them in one line, as over the WebSocket."""

    seed: Any = Field(default=None, description="the env's seed: a whole number from 0 to 2**63-1, or null")


def from_json(space: Any, value: Any) -> Any:
    """A client's JSON action as the env takes it, as ``smolbench.gym`` takes one
    (``spaces.to_action``: a Box's bounds unchecked, as Gymnasium's), else a one-line error."""
    from gymnasium import spaces as S

    from .gym.spaces import Refused, to_action

    try:
        out: Any
        if isinstance(space, S.Dict):
            out = {k: from_json(sub, value[k]) for k, sub in space.spaces.items()}
        elif isinstance(space, S.Tuple):  # zip stops at the shorter: the check below counts them
            out = tuple(from_json(sub, v) for sub, v in zip(space.spaces, value))
        elif isinstance(space, S.Discrete):
            out = np.int64(value) if isinstance(value, int) and not isinstance(value, bool) else value
        elif isinstance(space, S.Text):
            out = value
        else:  # numpy's own dtype for the JSON (ints, floats): to_action decides what casts
            out = np.asarray(value)
    except (TypeError, ValueError, KeyError, IndexError, OverflowError) as exc:  # 2**70 for an int: Overflow
        raise SmolbenchError(f"action {str(value)[:80]} does not fit the action space {space} ({exc})") from None
    try:
        return to_action(space, out)
    except Refused as exc:
        why = f" ({exc})" if str(exc) else ""
        raise SmolbenchError(f"action {str(value)[:80]} is not in the action space {space}{why}") from None


class MachineEnvironment(Environment[GymAction, GymObservation, State]):
    """One OpenEnv session: its own branches of the served env's warm parent."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, machines: Machines, timeout: float = REQUEST_TIMEOUT,
                 on_close: Callable[[Machines], None] | None = None, *, served: bool = False,
                 pool: concurrent.futures.Executor | None = None, max_reply: int = MAX_REPLY) -> None:
        super().__init__()
        self._m = machines
        self._timeout = timeout
        self._max_reply = max_reply
        self._on_close = on_close
        self._started = False  # its machines are made at its first reset (/metadata, /state need none)
        self._state = State(episode_id=None, step_count=0)
        self._cut: _Cut | None = None  # the request running now, to end early when its client is gone
        self._client_gone = False
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._served = served  # made by app_for: closed on OpenEnv's server loop, which must not wait
        self._pool = pool  # HTTP requests' threads, shared by the app's sessions of one request
        # A machine's own name counts every session's branches of the warm parent: a client
        # sees its session's name for it instead (the ledger's episode rows keep both).
        self._label, self._count = uuid.uuid4().hex[:8], 0
        self._marks: list[str] = []  # the last reply's arrays written as JSON text (see _replies.spliced)
        self._answered_here = True  # False: an HTTP reset's session, its reply sent after its close
        self._names: dict[str, str] = {}
        self._named = re.compile(re.escape(machines.parent.name) + r"\.\d+") if machines.parent else None
        machines.records.client_name = self._client_name

    async def reset_async(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GymObservation:
        """:meth:`reset`, cut as soon as the client's connection is gone (see :class:`ClientWatch`)."""
        return await self._watched(lambda: self.reset(seed, episode_id, **kwargs), "reset")

    async def step_async(self, action: GymAction, timeout_s: float | None = None, **kwargs: Any) -> GymObservation:
        """:meth:`step`, cut as soon as the client's connection is gone: a step that never
        answers then frees its session at once, not after the request timeout."""
        if ONE_REQUEST.get() and not self._started:  # an HTTP request's session: never reset
            raise SmolbenchError(STATELESS_STEP)
        return await self._watched(lambda: self.step(action, timeout_s, **kwargs), "step")

    async def _watched(self, call: Callable[[], GymObservation], what: str) -> GymObservation:
        self._open()  # closed (idle too long): one line, and no thread for it
        gone = CLIENT_GONE.get()
        pool: concurrent.futures.Executor | None = self._pool
        if gone is not None and not ONE_REQUEST.get():
            # A WebSocket session's on a thread of its own (as OpenEnv runs a sync env's): a
            # shared pool's threads could all be held by steps that never answer.
            if self._worker is None:
                self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="smolbench-openenv")
            pool = self._worker
        # HTTP: the app's bounded pool (a thread each would let a flood of requests make
        # threads; the loop's default one is shared with everything else on the loop)
        try:
            running = pool.submit(call) if pool is not None else None
        except RuntimeError:  # closed meanwhile, from the idle sessions' reaper
            self._open()
            raise
        work = asyncio.wrap_future(running) if running is not None else asyncio.ensure_future(asyncio.to_thread(call))
        if gone is None:
            return await work
        either: set[asyncio.Future[Any]] = {work, gone}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            if running is not None and running.cancel():  # still queued: it never holds a thread
                raise SmolbenchError(f"the {what} was cut: {_cut_by()}")
            self._client_gone = True  # before reading _cut: _run sets _cut before reading this
            cut = self._cut
            if cut is not None:
                cut.fire()
        return await work

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GymObservation:
        """A new episode in a fresh branch of the warm parent (a client's seed, options and
        episode id checked first, as ``smolbench.gym.make``'s reset checks them)."""
        with self._told():
            return self._reset(seed, episode_id, **kwargs)

    def step(self, action: GymAction, timeout_s: float | None = None, **kwargs: Any) -> GymObservation:
        """One step in the session's machine, within the server's request timeout (or the
        client's ``timeout_s``, if shorter)."""
        with self._told():
            return self._step(action, timeout_s)

    def _reset(self, seed: int | None, episode_id: str | None, **kwargs: Any) -> GymObservation:
        unknown = sorted(set(kwargs) - {"options"})
        if unknown:
            raise SmolbenchError(f"reset takes seed, episode_id and options; {str(unknown[0])[:40]!r} is not one of them")
        if episode_id is not None and (not isinstance(episode_id, str) or len(episode_id) > 255):
            raise SmolbenchError("episode_id should be a string of at most 255 characters")
        seed = check_seed(seed)
        options = _options(kwargs.get("options"))
        self._open()
        if not self._started:
            reply_room(self._m.observation_space, self._max_reply)  # else every reset fails, a machine made for it
            self._started = True
            self._run(self._m.start_sibling(), "session's start", self._timeout)
        obs, info = self._run(self._m.reset(0, seed, options), "reset", self._timeout)
        self._bounded("reset", obs, info)
        self._state = State(episode_id=episode_id or uuid.uuid4().hex[:12], step_count=0)
        return GymObservation(observation=self._json(obs), info=to_json(info), done=False, reward=None,
                              machine=self._machine())

    def _step(self, action: GymAction, timeout_s: float | None) -> GymObservation:
        limit = self._timeout
        if timeout_s is not None:
            if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
                raise SmolbenchError(f"timeout_s should be a number of seconds above 0, got {str(timeout_s)[:40]}")
            limit = min(limit, float(timeout_s))
        self._open()
        if not self._started:  # no machine yet: the env's own line would name none
            raise SmolbenchError("no episode to step: this session has not been reset; reset() first")
        act = from_json(self._m.action_space, action.action)
        st = self._run(self._m.step(0, act), "step", limit)
        self._bounded("step", st.obs, st.info)
        self._state.step_count += 1
        info = st.info
        if "smolbench_lost" in info:  # smolbench's own words, naming the machine
            info = {**info, "smolbench_lost": self._scrubbed(str(info["smolbench_lost"]))}
        return GymObservation(observation=self._json(st.obs), reward=st.reward, done=st.terminated or st.truncated,
                              terminated=st.terminated, truncated=st.truncated, info=to_json(info),
                              machine=self._machine())

    def _json(self, obs: Any) -> Any:
        """An observation as JSON; served, its big arrays as JSON text already (no list of
        Python objects) and marks in their place, put back as the reply is sent."""
        forget(self._marks)  # the last reply's, never sent (its client gone)
        return to_json_served(obs, self._marks) if self._served else to_json(obs)

    @contextlib.contextmanager
    def _told(self) -> Iterator[None]:
        """A one-line error as this session's client gets it: its machines by its own names."""
        try:
            yield
        except SmolbenchError as exc:
            said = self._scrubbed(str(exc))
            if said == str(exc):
                raise
            raise SmolbenchError(said) from None

    def _client_name(self, name: str) -> str:
        """This session's name for machine ``name``: its id and the machine's number in it."""
        got = self._names.get(name)
        if got is None:
            self._count += 1
            got = self._names[name] = f"{self._label}-{self._count}"
            if len(self._names) > 8:  # older machines are gone: their names no longer come up
                del self._names[next(iter(self._names))]
        return got

    def _scrubbed(self, text: str) -> str:
        """``text`` with the warm parent's branches by this session's names for them."""
        return self._named.sub(lambda m: self._client_name(m[0]), text) if self._named is not None else text

    def _open(self) -> None:
        if self._m.closed:
            raise SmolbenchError("this session is closed (it was idle too long, or the server is stopping): "
                                 "open a new one")

    def _run(self, coro: Coroutine[Any, Any, T], what: str, limit: float) -> T:
        """``coro`` on smolbench's loop, cut after ``limit`` s: then the episode's channel is
        cut and its machine deleted (what runs there is unknown), and the client gets one line."""
        m = self._m
        cut = self._cut = _Cut()
        if self._client_gone:  # a reset's second request, after its client went in the first
            cut.fire()
        try:
            return m.host.run(_within(coro, limit, cut), limit + 2 * GRACE)
        except (_OutOfTime, concurrent.futures.TimeoutError):
            why = f"the {what} took longer than {limit:g} s (smolbench serve --request-timeout)"
            how = "timeout"  # as a gym env's timeout= records it
        except _ClientGone:
            why = f"the {what} was cut: {_cut_by()}"
            how = "cancelled"  # stopped from outside, as a fork's Ctrl-C'd branch: no error of the env's
        finally:
            self._cut = None
        self._abandon(why, how)

    def _abandon(self, why: str, how: str) -> NoReturn:
        """End the episode ``how``, delete its machine, and tell the client in one line."""
        machine = self._machine()  # the one the request was cut in
        with contextlib.suppress(Exception):
            self._m.host.run(self._m.abandon(0, why, how), 2 * GRACE)
        gone = f"machine {machine} is deleted" if machine else "its machine is deleted"
        raise SmolbenchError(f"{why}: {gone}; reset() starts a new episode")

    def _bounded(self, what: str, obs: Any, info: Any) -> None:
        """Refuse, before any of it is converted, a reply past ``--max-reply`` bytes of JSON
        (the env's episode ends: its client never sees where it got to)."""
        size = json_size((obs, info))
        if size > self._max_reply:
            self._abandon(f"the {what}'s observation and info could take {size:,} bytes as JSON, over smolbench "
                          f"serve --max-reply ({self._max_reply:,}): serve it with a higher --max-reply (each reply "
                          "takes about 3 times that in memory as it is sent), or make the env's observations smaller",
                          "error")

    @property
    def state(self) -> State:
        """The episode's id and step count."""
        return self._state

    def get_metadata(self) -> EnvironmentMetadata:
        """What the served env is, for OpenEnv's /metadata."""
        return EnvironmentMetadata(name=self._m.described.get("spec_id") or "smolbench machine env",
                                   description=f"observations {self._m.observation_space}, actions {self._m.action_space}; "
                                               "each session in its own branch of a warm smolbench machine",
                                   version="1.0.0")

    def close(self) -> None:
        """Delete this session's machines (the warm parent stays for the next session).

        OpenEnv's stateless HTTP handlers call this on the server's event loop, where a wait
        holds up every other client: there the close only starts (the episode's record and
        the hand-off of its machine to the warm parent's batched deletions run on smolbench's
        loop), and the session stays listed until it has ended, so the server's shutdown
        waits for it. Called anywhere else, it returns when the machines are gone."""
        try:
            on_the_server_loop = self._served and asyncio.get_running_loop() is not None
        except RuntimeError:
            on_the_server_loop = False
        if on_the_server_loop:
            self._m.host.submit(self._m.close(let_go=True)).add_done_callback(self._closed_there)
            return
        try:
            self._m.host.run(self._m.close(), 2 * GRACE)
        finally:
            self._closed()

    def _closed_there(self, done: concurrent.futures.Future[None]) -> None:
        if not done.cancelled() and done.exception() is not None:  # no caller waits to hear it: say it
            print(f"smolbench serve: closing a session failed ({type(done.exception()).__name__}: "
                  f"{done.exception()})", file=sys.stderr, flush=True)
        self._closed()

    def _closed(self) -> None:
        if self._answered_here:  # a WebSocket session's replies are all sent
            forget(self._marks)
        if self._worker is not None:
            self._worker.shutdown(wait=False)
        if self._on_close is not None:
            self._on_close(self._m)

    def _machine(self) -> str | None:
        ref = self._m.eps[0].ref
        return self._client_name(ref.name) if ref is not None else None


class _OutOfTime(Exception):
    """A served request ran out of time."""


def _cut_by() -> str:
    return "the server is stopping" if STOPPING.is_set() else "its client disconnected"


class _ClientGone(Exception):
    """A served request's client disconnected while it ran."""


class _Cut:
    """Ends one running request early, from any thread (its client is gone)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fired = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._future: asyncio.Future[None] | None = None

    def arm(self) -> asyncio.Future[None]:
        """On smolbench's loop, as the request starts: done once it is cut."""
        with self._lock:
            self._loop = asyncio.get_running_loop()
            self._future = self._loop.create_future()
            if self._fired:
                self._future.set_result(None)
            return self._future

    def fire(self) -> None:
        with self._lock:
            self._fired = True
            if self._loop is not None and self._future is not None:
                self._loop.call_soon_threadsafe(_end, self._future)


def _end(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _within(coro: Coroutine[Any, Any, T], limit: float, cut: _Cut | None = None) -> T:
    """``coro``'s result, or :class:`_OutOfTime` once it ran ``limit`` s, or :class:`_ClientGone`
    once ``cut`` fires (it is cancelled, and given :data:`GRACE` to clean up: a step's cut
    channel, a reset's spare put back)."""
    task = asyncio.ensure_future(coro)
    stop = cut.arm() if cut is not None else asyncio.get_running_loop().create_future()
    try:
        done, _ = await asyncio.wait({task, stop}, timeout=limit, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.wait({task}, timeout=GRACE)
    raise _ClientGone if stop in done else _OutOfTime


class AtCapacity(SessionCapacityError):
    """A session refused at ``--max-sessions``: one line naming the cap and what to do."""

    def __init__(self, active: int, cap: int) -> None:
        super().__init__(active, cap, AT_CAPACITY.format(active=active, cap=cap))


# an HTTP /reset's slot, handed to the session OpenEnv's handler makes for it (see _reset_route)
_HANDOFF: contextvars.ContextVar[_Handoff | None] = contextvars.ContextVar("_HANDOFF", default=None)


class _Handoff:
    """An HTTP /reset's slot and the session OpenEnv's handler made for it."""

    def __init__(self, release: Callable[[], None]) -> None:
        self.release = release  # frees the slot (from any thread)
        self.env: MachineEnvironment | None = None


class _Slots:
    """``--max-sessions`` over OpenEnv's own count (``held``, on the server's loop), where a
    closed session's slot stays, as ``closing-...``, until its machine is deleted."""

    def __init__(self, held: dict[str, Environment | None], cap: int, hurry: Callable[[], None]) -> None:
        self.held, self.cap, self.hurry = held, cap, hurry
        self.closing: set[str] = set()

    def hold(self) -> str:
        """A slot for a session whose machine is on its way out (on the server's loop)."""
        key = f"closing-{uuid.uuid4()}"
        self.held[key] = None
        self.closing.add(key)
        return key

    def free(self, key: str) -> None:
        self.held.pop(key, None)
        self.closing.discard(key)

    async def room(self) -> None:
        """Wait, at most :data:`GRACE` s, while the cap is reached only because machines are
        still being deleted: one client's close and its next session (an HTTP reset after
        another) wait for the deletion instead of being refused. Past that, or with the cap
        reached by open sessions, the caller's check refuses at once."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + GRACE
        hurried = False
        while len(self.held) >= self.cap and self.closing and loop.time() < deadline:
            if not hurried:  # their batch of deletions starts now, not within spares.FLUSH_AFTER
                hurried = True
                self.hurry()
            await asyncio.sleep(0.02)


class _Sessions(HTTPEnvServer):
    """OpenEnv's server, its WebSocket sessions refused at the cap in smolbench's words, and
    counted (see :class:`_Slots`) until their machines are deleted."""

    slots: _Slots

    async def _create_session(self) -> tuple[str, Environment]:
        await self.slots.room()
        try:
            return await super()._create_session()
        except SessionCapacityError as exc:
            raise AtCapacity(exc.active_sessions, exc.max_sessions) from None

    async def _destroy_session(self, session_id: str) -> None:  # OpenEnv's, its slot held through the close
        async with self._session_lock:
            env = self._sessions.pop(session_id, None)
            executor = self._session_executors.pop(session_id, None)
            stack = self._session_stacks.pop(session_id, None)
            self._session_info.pop(session_id, None)
            key = self.slots.hold() if env is not None else None
        # its close, in its thread, waits for the machine's deletion; a task of its own, so a
        # cancelled handler (its client cut, the server stopping) neither skips the close (the
        # machine ran on, unlisted, until the server stopped) nor frees the slot before it ended
        closing = asyncio.ensure_future(self._cleanup_session_resources(env, executor, stack))
        if key is not None:
            closing.add_done_callback(lambda _: self.slots.free(key))
        await asyncio.shield(closing)


def app_for(parent: Machines, max_sessions: int = 16, timeout: float = REQUEST_TIMEOUT,
            idle: float = IDLE_TIMEOUT, max_reply: int = MAX_REPLY) -> Any:
    """OpenEnv's FastAPI app serving ``parent``'s env: one branch of it per client session,
    each reset or step cut after ``timeout`` s, a session closed after ``idle`` s without a
    request, a reply refused past ``max_reply`` bytes of JSON. ``app.state.smolbench_sessions`` holds the sessions' machines not closed yet,
    ``app.state.smolbench_pool`` the HTTP requests' threads (to shut down with the server).

    ``max_sessions`` caps the sessions open at once, of both kinds: a WebSocket session from
    its connection to its close (OpenEnv's own count), and a stateless HTTP ``POST /reset``
    from its start until it answered (OpenEnv closes that one-request session, its machine
    with it, as the request ends), each until its machine is deleted. A new session that
    finds the cap reached only by those deletions waits for one (:class:`_Slots`), so one
    client's back-to-back resets, over HTTP or in its WebSocket session (each episode
    replacing the last in the session's one slot), are not refused. Past the cap a WebSocket session
    gets OpenEnv's CAPACITY_REACHED error and an HTTP reset a 503, both with one line
    naming the cap. HTTP ``/step``, ``/state`` and ``/metadata`` make no machine and are
    not counted (a stateless step is refused: :data:`STATELESS_STEP`)."""
    from fastapi import FastAPI
    from openenv.core.env_server.types import ConcurrencyConfig

    for name, value in (("request timeout", timeout), ("idle timeout", idle)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise SmolbenchError(f"the {name} should be a number of seconds above 0, got {value!r}")
    reply_room(parent.observation_space, max_reply)
    live: set[Machines] = set()
    # HTTP requests' resets and steps: as many at once as sessions (the rest wait their turn)
    pool = concurrent.futures.ThreadPoolExecutor(max_sessions, thread_name_prefix="smolbench-http")

    def factory() -> MachineEnvironment:  # OpenEnv calls it for every request without a session too
        m = parent.sibling()
        live.add(m)
        handed = _HANDOFF.get()
        if handed is not None and handed.env is not None:
            handed = None  # (OpenEnv's handler makes one session a request)

        def closed(m: Machines) -> None:
            live.discard(m)
            if handed is not None:  # an HTTP reset's slot: freed once its machine is gone
                handed.release()

        env = MachineEnvironment(m, timeout, on_close=closed, served=True, pool=pool, max_reply=max_reply)
        if handed is not None:
            handed.env = env
            env._answered_here = False  # its reply is sent once the session is closed (see _reset_route)
        return env

    config = ConcurrencyConfig(max_concurrent_envs=max_sessions, session_timeout=idle)
    # as OpenEnv's create_fastapi_app, minus the API docs pages: they load scripts from a CDN
    # into a page whose URL holds the server's token
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, swagger_ui_oauth2_redirect_url=None)
    sessions = _Sessions(factory, GymAction, GymObservation, concurrency_config=config)
    sessions.slots = _Slots(sessions._sessions, max_sessions, lambda: _hurry(parent))
    sessions.register_routes(app)
    # the env has no MCP tools: OpenEnv's /mcp routes only let any client open sessions (slots)
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) != "/mcp"]
    _reset_route(app, sessions)
    _no_mcp_messages(app)
    app.state.smolbench_sessions = live
    app.state.smolbench_pool = pool

    async def one_line(request: Any, exc: Exception) -> Any:  # over HTTP too, not "Internal Server Error"
        from fastapi.responses import JSONResponse

        return JSONResponse({"detail": str(exc)}, status_code=400)

    async def full(request: Any, exc: Exception) -> Any:  # what OpenEnv's WebSocket error says, as HTTP says it
        from fastapi.responses import JSONResponse

        assert isinstance(exc, SessionCapacityError)
        return JSONResponse({"detail": str(exc), "code": "CAPACITY_REACHED", "active_sessions": exc.active_sessions,
                             "max_sessions": exc.max_sessions}, status_code=503)

    app.add_exception_handler(SmolbenchError, one_line)
    app.add_exception_handler(SessionCapacityError, full)
    return app


def _hurry(parent: Machines) -> None:
    """Start the warm parent's batch of deletions now (from the server's loop)."""
    async def flush() -> None:
        parent.pool.flush()

    with contextlib.suppress(Exception):
        parent.host.submit(flush())


def _reset_route(app: Any, sessions: _Sessions) -> None:
    """OpenEnv's ``POST /reset``, its body read as :class:`SeedAsSent`, the request counted
    as an open session of ``sessions`` while it runs (see :func:`app_for`)."""
    from fastapi import Body, Response
    from fastapi.routing import APIRoute
    from openenv.core.env_server.types import ResetResponse

    (route,) = [r for r in app.router.routes if isinstance(r, APIRoute) and r.path == "/reset" and "POST" in (r.methods or ())]
    openenv_reset = route.endpoint
    # OpenEnv's own count, on its server loop: a placeholder there (as its WebSocket session
    # has while it is made) is checked and put in with no await between, as OpenEnv does, so
    # neither kind of session can slip past the other's check
    held: dict[str, Environment | None] = sessions._sessions
    cap = sessions.max_concurrent_envs
    slots = sessions.slots

    async def reset(request: SeedAsSent = Body(default_factory=SeedAsSent)) -> Any:  # noqa: B008 (FastAPI reads it)
        await slots.room()
        if len(held) >= cap:
            raise AtCapacity(len(held), cap)
        slot = f"http-reset-{uuid.uuid4()}"
        held[slot] = None
        loop = asyncio.get_running_loop()

        def release() -> None:
            with contextlib.suppress(RuntimeError):  # the server stopped: no slots to free
                loop.call_soon_threadsafe(slots.free, slot)

        handed = _Handoff(release)
        token = _HANDOFF.set(handed)
        try:
            answer = await openenv_reset(request)
            return Response(spliced(answer.model_dump_json()), media_type="application/json")
        finally:  # answered, cut or failed: its one-request session is closing, its slot held until it is
            _HANDOFF.reset(token)
            if handed.env is None:  # no session made (refused before OpenEnv's handler): nothing to wait for
                slots.free(slot)
            else:
                if slot in held:  # (not freed already: its close ended first)
                    slots.closing.add(slot)
                forget(handed.env._marks)  # an answer never made (it failed) leaves none behind

    app.router.routes.remove(route)
    app.post("/reset", response_model=ResetResponse)(reset)


def _no_mcp_messages(app: Any) -> None:
    """OpenEnv's WebSocket ``/ws``, its ``"mcp"`` messages refused as an unknown type's are
    (code UNKNOWN_TYPE; the session goes on): the env has no MCP tools, and OpenEnv's MCP
    methods there open and close sessions by id. OpenEnv reads a message only once it
    answered the one before, so the refusal goes out in its turn."""
    from fastapi.routing import APIWebSocketRoute
    from openenv.core.env_server.types import WSErrorCode, WSErrorResponse

    (route,) = [r for r in app.router.routes if isinstance(r, APIWebSocketRoute) and r.path == "/ws"]
    openenv_ws = route.endpoint
    refusal = WSErrorResponse(data={"message": NO_MCP, "code": WSErrorCode.UNKNOWN_TYPE}).model_dump_json()

    async def ws(websocket: WebSocket) -> None:
        receive_text = websocket.receive_text

        async def without_mcp() -> str:
            while True:
                text = await receive_text()
                try:  # parsed as OpenEnv parses it: "\u006dcp" is "mcp" too
                    message = frames.loads(text)
                except ValueError:
                    return text
                if not (isinstance(message, dict) and message.get("type") == "mcp"):
                    return text
                await websocket.send_text(refusal)

        send_text = websocket.send_text

        async def with_arrays(text: str) -> None:  # a reply's arrays as JSON text (see _replies.spliced)
            await send_text(spliced(text))

        websocket.receive_text = without_mcp  # type: ignore[method-assign]
        websocket.send_text = with_arrays  # type: ignore[method-assign,assignment]
        await openenv_ws(websocket)

    app.router.routes.remove(route)
    app.websocket("/ws")(ws)
