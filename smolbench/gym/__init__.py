"""Gymnasium environments whose every step runs inside a smolbench machine.

``make(env)`` gives a ``gymnasium.Env``, ``make_vec(env, n)`` a ``gymnasium.vector.VectorEnv``
with one machine per sub-env. ``env`` is a zero-argument callable (sent into the machine
with cloudpickle, as ``--push`` sends values), the name of one already defined in the
session's machine (what a notebook prototyped in ``%%smol`` cells), or a registered
gymnasium id (``"CartPole-v1"``: ``gymnasium.make`` in the machine). Everything the
machine sends back crosses the gate as data and is checked against spaces rebuilt from
data; nothing it sends is unpickled here. Needs ``pip install 'jupyterlab-smolbench[gym]'``.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from gymnasium.vector import AutoresetMode

from .. import _loop
from ..errors import SmolbenchError
from ._host import host_for
from .env import MachineEnv
from .envnames import NAME_RE
from .machines import GymError, Machines
from .registered import ENV_ID, gymnasium_make
from .vector import MachineVectorEnv
from .warmparent import check_arguments

__all__ = ["GymError", "MachineEnv", "MachineVectorEnv", "make", "make_vec"]


def _registered(env: Any) -> Any:
    """A gymnasium id (``"CartPole-v1"``) as the factory ``gymnasium.make(id)`` in the machine, as
    ``smolbench serve --gym`` serves one; a name defined in the machine, or a callable, as it is."""
    if not isinstance(env, str) or NAME_RE.fullmatch(env) or not ENV_ID.fullmatch(env):
        return env
    return gymnasium_make(env)


def _start(env: str | Callable[[], Any], num_envs: int, session: Any, smolfile: str | None, reset: str,
           retries: int | None, timeout: float | None, vector: bool = False, reseed: bool = True) -> Machines:
    check_arguments(env, num_envs, reset, timeout, reseed)  # before a machine is made (or a notice printed)
    host = host_for(session, smolfile)
    try:
        machines = Machines(host, env, num_envs, reset, retries, vector, timeout, reseed)
        host.run(machines.start())
    except BaseException:
        if "machines" in locals():
            try:
                host.run(machines.close())
            except Exception:
                pass
        host.close()
        raise
    return machines


def make(env: str | Callable[[], Any], *, session: Any = None, smolfile: str | None = None, reset: str = "fresh",
         retries: int | None = None, timeout: float | None = None, reseed: bool = True, **kwargs: Any) -> MachineEnv:
    """A ``gymnasium.Env`` that runs ``env`` in a machine.

    ``env``: a zero-argument callable returning a ``gymnasium.Env`` (cloudpickled into the
    machine; one from a module file of your own, not installed, goes by value), the name of such a callable defined in the session's machine, or a registered
    gymnasium id (``"CartPole-v1"``: ``gymnasium.make`` in the machine).
    ``session``: the ``smolbench.Session`` to use (default: the notebook's, else one of the
    env's own from ``smolfile``, closed with the env). ``reset="fresh"`` runs every episode
    in a new branch of the warm parent (nothing an episode does reaches the next one's
    start); ``"in-place"`` calls the env's own reset in the same machine. ``retries``: how
    often a machine that dies is rebuilt (default: the session's). ``timeout``: seconds the
    env in its machine may take to answer one ``reset()`` or ``step()`` (default: no limit);
    past it that call raises a one-line error, the episode is recorded as timed out, its
    machine is deleted (the env may still be running the call) and the next ``reset()``
    starts in a new branch of the warm parent; with it set, building the env in the warm
    parent is bounded by ``warmparent.BUILD_TIMEOUT`` (600 s) instead. ``reseed=False``: the generators the env
    keeps itself (``self.rng``) are left alone (every sub-env's and fresh episode's start
    where the warm parent's did); else one its code seeded (``default_rng(1234)``) is never
    reseeded, an entropy-seeded one gets each machine its own stream, and fresh episodes
    carry their states on. Extra keyword arguments are given to a callable ``env``.
    A bad argument is a :class:`GymError` that is also a ``ValueError``, raised before any
    machine is made.
    """
    def remake(**more: Any) -> MachineEnv:  # its spec's entry point (a function: a spec is deep-copied)
        return make(env, session=session, smolfile=smolfile, reset=reset, retries=retries, timeout=timeout,
                    reseed=reseed, **{**kwargs, **more})

    factory = env = _registered(env)
    if kwargs:
        if isinstance(env, str):
            raise SmolbenchError("keyword arguments go to a callable env; an env named in the machine takes none")
        import functools

        factory = functools.partial(env, **kwargs)
    return _let_go_when_dropped(MachineEnv(_start(factory, 1, session, smolfile, reset, retries, timeout,
                                                  reseed=reseed), remake))


def make_vec(env: str | Callable[[], Any], num_envs: int, *, session: Any = None, smolfile: str | None = None,
             autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP, reset: str = "fresh",
             retries: int | None = None, timeout: float | None = None, reseed: bool = True) -> MachineVectorEnv:
    """A ``gymnasium.vector.VectorEnv`` of ``num_envs`` copies of ``env``, one machine each.

    A step sends one request to every machine at once. Autoreset follows Gymnasium's
    ``autoreset_mode`` (``NEXT_STEP`` by default, ``SAME_STEP``, ``DISABLED``). The other
    arguments are :func:`make`'s; a sub-env past its ``timeout`` fails that step as one
    whose env raised does (the error's ``results`` hold the others' steps, that sub-env
    truncated), and it starts over in a new machine at its next reset (with ``NEXT_STEP``, the next step).
    """
    try:
        mode = AutoresetMode(autoreset_mode)
    except ValueError:
        raise SmolbenchError(f"autoreset_mode must be one of {', '.join(m.value for m in AutoresetMode)}, got "
                             f"{autoreset_mode!r}: e.g. autoreset_mode='NextStep'") from None
    def remake(**more: Any) -> MachineEnv:  # its spec's entry point: one sub-env, as gymnasium.make_vec's spec has
        return make(env, session=session, smolfile=smolfile, reset=reset, retries=retries, timeout=timeout,
                    reseed=reseed, **more)

    return _let_go_when_dropped(MachineVectorEnv(_start(_registered(env), num_envs, session, smolfile, reset, retries,
                                                        timeout, vector=True, reseed=reseed), mode, remake))


E = TypeVar("E", MachineEnv, MachineVectorEnv)


def _let_go_when_dropped(env: E) -> E:
    """An env dropped without close() (a sweep that rebinds ``env = make(...)``) still deletes its
    machines: they stayed, ~19 processes each, until the session ended."""
    finalizer = weakref.finalize(env, _close_soon, env._m)
    finalizer.atexit = False  # at exit the session's own end deletes every machine
    return env


_closing: set[asyncio.Future[None]] = set()  # closes begun by a finalizer, held until they end


def _close_soon(machines: Machines) -> None:
    """The finalizer: the garbage collector runs it on whatever thread it ran (the user's, an
    executor's, smolbench's loop's), so it only schedules the close on smolbench's loop. Run
    there, the close's task was held by nothing (a task awaiting a socket is only weakly
    held by asyncio): the collector then dropped it half done, with the env's refills,
    closing their coroutines on its own thread, and the warm parent and its spares stayed."""
    with contextlib.suppress(RuntimeError):  # the loop is gone (the interpreter is exiting)
        _loop.get_loop().call_soon_threadsafe(_begin_close, machines)


def _begin_close(machines: Machines) -> None:
    """On smolbench's loop: close ``machines``, the task held here until it ends."""
    if machines.closed:
        return
    task = asyncio.ensure_future(machines.close())
    _closing.add(task)
    task.add_done_callback(_closed)


def _closed(task: asyncio.Future[None]) -> None:
    _closing.discard(task)
    if not task.cancelled():
        task.exception()  # (retrieved: a close that failed has nothing left to tell anyone)
