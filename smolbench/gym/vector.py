"""``smolbench.gym.make_vec``: a Gymnasium ``VectorEnv`` with one machine per sub-env.

A step is one request per machine, all sent at once on smolbench's loop; the results
are checked, then batched like ``gymnasium.vector.SyncVectorEnv`` batches them, with
the same autoreset semantics (``NEXT_STEP``, ``SAME_STEP`` or ``DISABLED``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from copy import deepcopy
from typing import Any

import numpy as np
from gymnasium.spaces import Discrete
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from .. import _loop
from ..errors import reworded
from . import envspec, spaces
from .env import NO_RENDER, NoRender, _options, check_seed, checked_action
from .episode import EnvError, GymError, Later, Reset, Step, _where
from .info import check_merge
from .machines import Machines


class MachineVectorEnv(VectorEnv[Any, Any, Any]):
    """``num_envs`` machine-backed sub-envs stepped together (see :func:`smolbench.gym.make_vec`)."""

    def __init__(self, machines: Machines, autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
                 remake: Callable[..., Any] | None = None) -> None:
        self._m = machines
        self.num_envs = machines.n
        self.autoreset_mode = AutoresetMode(autoreset_mode) if isinstance(autoreset_mode, str) else autoreset_mode
        self.metadata = {**envspec.metadata(machines.described), "autoreset_mode": self.autoreset_mode,
                         "smolbench_reset": machines.mode}
        self.spec = envspec.env_spec(machines.described, remake)  # its sub-envs' (remake: one of them)
        self.render_mode = None
        self.single_observation_space = machines.observation_space
        self.single_action_space = machines.action_space
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self._obs: Any = create_empty_array(self.single_observation_space, n=self.num_envs, fn=np.zeros)
        self._env_obs: list[Any] = [None] * self.num_envs
        self._rewards = np.zeros((self.num_envs,), dtype=np.float64)
        self._terminations = np.zeros((self.num_envs,), dtype=np.bool_)
        self._truncations = np.zeros((self.num_envs,), dtype=np.bool_)
        self._autoreset = np.zeros((self.num_envs,), dtype=np.bool_)

    def __getstate__(self) -> Any:  # Ray sends a task's arguments and results pickled
        raise TypeError("a smolbench gym env can't be pickled: its machines live in this process; send its id (or "
                        "env.spec) and call smolbench.gym.make_vec inside the task, then close() it there")

    @property
    def machines(self) -> list[str | None]:
        """The machine each sub-env's current episode runs in."""
        return [ep.ref.name if ep.ref is not None else None for ep in self._m.eps]

    def reset(self, *, seed: int | list[int | None] | None = None,
              options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        """Reset every sub-env (or those in ``options["reset_mask"]``), all at once."""
        self._open()
        if seed is None:
            seeds: list[int | None] = [None] * self.num_envs
        elif isinstance(seed, int) and not isinstance(seed, bool):
            seeds = [seed + i for i in range(self.num_envs)]
        elif isinstance(seed, list):
            seeds = list(seed)
        else:
            raise GymError(f"seed should be None, a whole number or a list of {self.num_envs} whole numbers or None")
        if len(seeds) != self.num_envs or any(s is not None and (isinstance(s, bool) or not isinstance(s, int)) for s in seeds):
            raise GymError(f"seed should be None, a whole number or a list of {self.num_envs} whole numbers or None")
        seeds = [check_seed(s) for s in seeds]
        options = dict(options) if options is not None else None
        mask = np.ones(self.num_envs, dtype=np.bool_)
        if options is not None and "reset_mask" in options:
            mask = options.pop("reset_mask")
            if not isinstance(mask, np.ndarray) or mask.shape != (self.num_envs,) or mask.dtype != np.bool_ or not mask.any():
                raise GymError(f"options['reset_mask'] should be a bool array of shape ({self.num_envs},) with a True")
        opts = _options(options)
        which = [i for i in range(self.num_envs) if mask[i]]
        outs = self._run([self._m.reset(i, seeds[i], opts) for i in which], which)
        for i, (obs, _) in zip(which, outs):
            self._env_obs[i] = obs
            self._terminations[i] = self._truncations[i] = self._autoreset[i] = False
        self._obs = concatenate(self.single_observation_space, self._env_obs, self._obs)
        return deepcopy(self._obs), self._infos([(i, info) for i, (_, info) in zip(which, outs)])

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """One step of every sub-env, one request per machine, all at once."""
        self._open()
        acts = _discrete(self.single_action_space, actions, self.num_envs)
        if acts is None:
            acts = self._batch(actions)
        for i, a in enumerate(acts):
            if type(a) is not _OK:
                acts[i] = checked_action(self.single_action_space, a, f"sub-env {i}", "nothing was sent to any sub-env")
        mode = self.autoreset_mode
        if mode == AutoresetMode.DISABLED and self._autoreset.any():
            raise GymError(f"sub-env {int(np.flatnonzero(self._autoreset)[0])} ended and autoreset is disabled: "
                           "reset it (options={'reset_mask': ...}) before stepping")
        resetting = [i for i in range(self.num_envs) if mode == AutoresetMode.NEXT_STEP and self._autoreset[i]]
        stepping = [i for i in range(self.num_envs) if i not in resetting]
        # in-place autoresets go in this thread's batch with the steps; the others run on the
        # loop meanwhile (fresh ones need a new branch)
        batch = self._m.resets_now(resetting)
        loop = [i for i in resetting if i not in batch]
        resets = _loop.submit(_together([self._m.reset(i, None, None) for i in loop])) if loop else None
        try:
            now = self._m.steps_now(stepping, [acts[i] for i in stepping], batch)
            if now is None:  # no held channels (e.g. the process backend): on the loop
                got = self._m.host.run(_together([self._steps(stepping, [acts[i] for i in stepping]),
                                                  *(self._m.reset(i, None, None) for i in batch)]))
                now = (got[0] if isinstance(got[0], list) else [got[0]] * len(stepping)) + got[1:]
            elif any(isinstance(o, (Later, Reset)) for o in now):  # ended or reset: here, unless one needs the loop
                done_here = self._m.finish_now(stepping + batch, now)
                now = done_here if done_here is not None else self._m.host.run(self._m.finish(stepping + batch, now))
        finally:
            done = resets.result() if resets is not None else []
        order = loop + batch + stepping  # resets first: the first failure raised is a reset's, as before
        now = now[len(stepping):] + now[:len(stepping)]
        results = done + now
        if any(isinstance(o, BaseException) for o in results):  # they go with the error: the failed end truncated
            self._raised(results, order, self._step_anyway(order, list(results), mode))
        return self._take(dict(zip(order, results)), mode)

    def _take(self, outs: dict[int, Any], mode: AutoresetMode) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Every sub-env's step (or autoreset) into the batch step() returns."""
        infos: list[tuple[int, dict[str, Any]]] = []  # batched once every sub-env's state is in
        finals: dict[int, tuple[Any, dict[str, Any]]] = {}
        for i in range(self.num_envs):
            out = outs[i]
            if isinstance(out, Step):
                self._env_obs[i], self._rewards[i] = out.obs, out.reward
                self._terminations[i], self._truncations[i] = out.terminated, out.truncated
                info = out.info
                if mode == AutoresetMode.SAME_STEP and (out.terminated or out.truncated):
                    finals[i] = (out.obs, info)
            else:
                self._env_obs[i], info = out
                self._rewards[i] = 0.0
                self._terminations[i] = self._truncations[i] = False
            if i not in finals:
                infos.append((i, info))
        if finals:  # SAME_STEP: the ended sub-envs are reset now, their final obs and info kept
            again = self._run([self._m.reset(i, None, None) for i in finals], list(finals))
            for i, (obs, info) in zip(list(finals), again):
                self._env_obs[i] = obs
                infos.append((i, info))  # the host's final_obs and final_info after it: the host's win
                infos.append((i, {"final_obs": finals[i][0], "final_info": finals[i][1]}))
        self._autoreset = np.logical_or(self._terminations, self._truncations)
        self._obs = concatenate(self.single_observation_space, self._env_obs, self._obs)
        return (deepcopy(self._obs), np.copy(self._rewards), np.copy(self._terminations), np.copy(self._truncations),
                self._infos(infos))

    def _batch(self, actions: Any) -> list[Any]:
        """``actions`` split into one per sub-env, else :class:`WrongBatch`."""
        n, space = self.num_envs, spaces.one_line(self.single_action_space)
        try:  # a Dict's or Tuple's parts of different lengths: zip(strict=True)'s ValueError
            acts = list(iterate(self.action_space, actions))
        except (TypeError, ValueError, KeyError, IndexError) as exc:
            raise WrongBatch(f"actions should be a batch of {n} actions of {space}, one per sub-env "
                             f"({type(exc).__name__}: {' '.join(str(exc).split())[:120]}): nothing was sent") from None
        if len(acts) != n:
            raise WrongBatch(f"{len(acts)} actions for {n} sub-envs: step() takes one action per sub-env "
                             f"(a batch of {n}, e.g. envs.action_space.sample()); nothing was sent")
        return acts

    def _infos(self, each: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
        """The sub-envs' infos batched as Gymnasium batches them; one whose values can't go
        with the others' (a key that was a number there and text here, an int past int64) is
        its sub-env's one-line error, raised once every sub-env's state is in; so are infos
        whose merged form would be past :data:`info.MAX_MERGED` (keys that differ per sub-env
        grow it as num_envs**2), before any is merged."""
        check_merge(each, self.num_envs, lambda i: _where(i, self.num_envs, self._m.eps[i]))
        infos: dict[str, Any] = {}
        for i, info in each:
            try:
                infos = self._add_info(infos, info, i)
            except Exception as exc:
                raise GymError(f"{_where(i, self.num_envs, self._m.eps[i])} sent an info that does not batch with the "
                               f"other sub-envs' ({type(exc).__name__}: {str(exc)[:120]})") from None
        return infos

    async def _steps(self, which: list[int], actions: list[Any]) -> list[Any]:
        return await self._m.steps(which, actions) if which else []

    def _run(self, jobs: list[Any], which: list[int]) -> list[Any]:
        """Run the sub-envs' requests together; the first failure is raised (after all ended)."""
        return self._raised(self._m.host.run(_together(jobs)), which)

    def _raised(self, outs: list[Any], which: list[int], results: Any = None) -> list[Any]:
        """``outs``, or the first failure among them raised (a failed sub-env starts over), with
        ``results`` (a step's, as step() returns them) as its ``results``."""
        errors = [o for o in outs if isinstance(o, BaseException)]
        if errors:
            for i in which:  # a failed sub-env starts over at the next reset
                self._autoreset[i] = self._autoreset[i] or not self._m.eps[i].running
            first = errors[0]
            if isinstance(first, EnvError):  # a new one (its results are this step's), as it is
                first = reworded(first, str(first))
            elif isinstance(first, GymError):
                first = GymError(str(first))
            first.results = results  # type: ignore[attr-defined]
            raise first.with_traceback(None) from None
        return outs

    def _step_anyway(self, order: list[int], outs: list[Any], mode: AutoresetMode) -> Any:
        """A failed step's results as step() would return them: each failed sub-env truncated at
        its last observation with reward 0 and ``info["smolbench_error"]``, the others as they
        stepped (what a loop that catches the error needs to stay in step with them)."""
        for k, out in enumerate(outs):
            if isinstance(out, BaseException):
                i = order[k]
                outs[k] = Step(self._env_obs[i], 0.0, False, True, {"smolbench_error": " ".join(str(out).split())})
        try:
            return self._take(dict(zip(order, outs)), mode)
        except Exception:  # an info that does not batch: the error raised is the step's own
            return None

    def render(self) -> None:
        """Not supported: one line saying so."""
        raise NoRender(NO_RENDER)

    def close_extras(self, **kwargs: Any) -> None:
        """Delete every sub-env's machine and the warm parent."""
        self._m.shutdown()

    def _open(self) -> None:
        if self._m.closed:
            raise GymError("the vector env is closed: make a new one with smolbench.gym.make_vec(...)")


async def _together(jobs: list[Any]) -> list[Any]:
    """Run ``jobs`` together: each one's result, or the exception it raised."""
    if len(jobs) == 1:  # no task for a lone job (a vector step without resets)
        try:
            return [await jobs[0]]
        except Exception as exc:
            return [exc]
    return await asyncio.gather(*jobs, return_exceptions=True)


class WrongBatch(GymError, ValueError):
    """A vector step's actions are not one per sub-env (Gymnasium's vector envs raise ValueError)."""


class _OK(int):
    """An action already found inside a Discrete space (by :func:`_discrete`)."""


def _discrete(space: Any, actions: Any, n: int) -> list[Any] | None:
    """A Discrete space's integer array of actions, all checked at once (each one as
    :class:`_OK`, or left as it is where it is outside, for the one-line error); None for other forms."""
    if type(space) is not Discrete or type(actions) is not np.ndarray or actions.shape != (n,) or actions.dtype.kind not in "iu":
        return None
    start = int(space.start)
    inside = (actions >= start) & (actions < start + int(space.n))
    return [_OK(int(a)) if ok else a for a, ok in zip(actions.tolist(), inside.tolist())]
