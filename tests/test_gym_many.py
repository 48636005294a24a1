"""Many sub-envs on the sandbox backend (issue 28): 64 work; more than a warm parent has
room for are refused up front, in one line naming the limit and what to do.

Each sub-env is a branch of the env's warm parent, and each branch takes one namespace of
each kind from the parent's count (``guest/uidshares.py``: 128 per branch machine). With
``reset="fresh"`` the parent also holds spares and branches being deleted. Past 28 envs
this used to fail mid-run ("unshare: No space left on device" in a branch's log, and a
"not answering" line on the host).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from gymhelpers import CARTPOLE, needs_bwrap, up_bench

import smolbench.gym as sgym
from smolbench import SmolbenchError
from smolbench.guest.uidshares import BRANCH_NAMESPACES
from smolbench.gym.spares import live
from smolbench.spec import MachineSpec
from smolbench.workbench import Workbench

pytestmark = [needs_bwrap, pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(scope="module")
def bench(tmp_path_factory: Any) -> Iterator[Workbench]:
    # pids for 64 sub-envs where rlimits count every branch's processes in its parent's (a user kernel)
    yield from up_bench(tmp_path_factory, MachineSpec(pids=1024))


def most_envs(bench: Workbench, reset: str) -> int:
    room, _ = bench.backend.branch_room(bench.spec)  # type: ignore[attr-defined]
    return max(k for k in range(1, room + 1) if live(k, reset, room) <= room)


def test_64_fresh_sub_envs_step_through_many_episodes(bench: Workbench) -> None:
    envs = sgym.make_vec(CARTPOLE, 64, session=bench)
    try:
        envs.reset(seed=0)
        machines = set(envs.machines)
        assert len(machines) == 64 and None not in machines
        rng = np.random.default_rng(0)
        ended = 0
        for _ in range(40):  # CartPole's random episodes last ~20 steps: each sub-env gets new machines
            obs, _, terminated, truncated, _ = envs.step(rng.integers(0, 2, 64))
            assert envs.observation_space.contains(obs)
            ended += int(np.sum(terminated | truncated))
        assert ended > 64
        assert len(set(envs.machines)) == 64
    finally:
        envs.close()
    assert {m.name for m in bench.backend.list()} == {bench.active}


@pytest.mark.parametrize("reset", ["fresh", "in-place"])
def test_more_sub_envs_than_a_warm_parent_holds_are_refused_up_front(bench: Workbench, reset: str) -> None:
    most = most_envs(bench, reset)
    assert most >= 64
    before = len(bench.ledger.run_rows())
    with pytest.raises(SmolbenchError) as refused:
        sgym.make_vec(CARTPOLE, most + 1, session=bench, reset=reset)
    line = str(refused.value)
    assert f"num_envs={most + 1}" in line and f"use at most {most} envs" in line and "\n" not in line
    assert "room for" in line and ("namespaces" in line or "raise pids" in line)
    assert {m.name for m in bench.backend.list()} == {bench.active}  # nothing was made
    assert len(bench.ledger.run_rows()) == before


def test_under_rlimits_the_room_is_the_machines_pids(bench: Workbench) -> None:
    """As a user kernel (no cgroup), a branch's processes count in its parent's pids: the
    default 256 holds fewer sub-envs than 64, and the refusal says to raise pids."""
    backend = bench.backend
    room, why = backend.branch_room(MachineSpec(pids=256))  # type: ignore[attr-defined]
    if backend.limiter.mechanism.name != "rlimits":  # type: ignore[attr-defined]
        assert room == BRANCH_NAMESPACES and "namespaces" in why
        return
    assert room < 64 and "raise pids in the Smolfile" in why
