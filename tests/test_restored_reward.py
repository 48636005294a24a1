"""A node reports the reward its own cells set: a restored machine, and a branch.

A restore brought back the teacher's `reward = 45`, and the student's first plain cell recorded
45 as its node's reward in the tree and the ledger. Likewise a branch whose cell set no reward
reported its parent's (every branch of a fork ranked by the parent's old reward, and the "same
reward" note blamed the seeds). A `reward` a node holds but did not set now counts once a cell
sets one (even to the same value); a replay reports what the line's own cells did.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")


def _ledger_reward(s: object, node: str) -> object:
    wb = s.workbench  # type: ignore[attr-defined]
    return wb.ledger.node(wb.session, node)["reward"]


def test_a_restored_reward_is_not_the_next_cell_s(open_tmp: Path) -> None:
    import smolbench

    with smolbench.Session(backend="sandbox", ledger=open_tmp / ".smolbench" / "ledger.db") as s:
        assert s.run("x = 1").reward is None
        assert s.run("reward = 45").reward == 45.0
        assert s.run("y = 2").reward == 45.0  # a fresh machine: the `reward` its cells set
        s.checkpoint_save("lesson1")
        assert s.checkpoint_restore("lesson1") == "r1-lesson1"
        res = s.run("x = reward + 1")  # the restored value is there to read
        assert res.ok and res.reward is None
        assert s.workbench is not None and s.workbench.tree["r1-lesson1"].reward is None
        assert _ledger_reward(s, "r1-lesson1") is None
        assert s.run("def f():\n    reward = 3\n    return reward\nf()").reward is None  # a function's own
        assert s.run("reward = 45").reward == 45.0  # set by this machine's cell, to the same value
        assert s.run("y = 3").reward == 45.0
        assert s.checkpoint_restore("lesson1") == "r2-lesson1"
        assert s.run("globals()['reward'] = 7.5").reward == 7.5  # set another way
        assert s.checkpoint_restore("lesson1") == "r3-lesson1"
        kept = s.fork(2, "z = SEED", seeds=[1, 2], keep="all")
        assert [r["reward"] for r in kept.rows.values()] == [None, None]
        s.use("r3-lesson1")
        set_ = s.fork(2, "reward = SEED", seeds=[7, 8], keep="all")
        assert sorted(r["reward"] for r in set_.rows.values()) == [7.0, 8.0]


def test_a_replay_from_its_line_s_checkpoint_reports_what_the_line_did(open_tmp: Path) -> None:
    """A fork whose branches set no reward report none (not their parent's); a replay of one,
    started from the parent's checkpoint once the parent is gone, reports none too, and a
    branch that sets one reports its own."""
    import smolbench
    from smolbench._session import _block

    with smolbench.Session(backend="sandbox", ledger=open_tmp / ".smolbench" / "ledger.db") as s:
        s.run("reward = 45").raise_for_error()
        s.checkpoint_save("base")
        fork = s.fork(2, "z = SEED", seeds=[1, 2], keep="all")
        assert [r["reward"] for r in fork.rows.values()] == [None, None]
        assert s.fork(2, "reward = 45 if SEED == 1 else 2", seeds=[1, 2], keep="none").rewards == {
            "root.2": 45.0, "root.3": 2.0}  # its own, even the parent's value
        branch = next(iter(fork.rows))
        s.delete("root")
        assert s.workbench is not None
        said = _block(s.workbench.replay(branch, lambda *_: None))
        assert said["reward"] is None and said["match"], said["message"]
        assert "started from checkpoint base" in said["message"]


@pytest.mark.parametrize("start", ["live", "checkpoint"])
def test_a_replay_of_a_restored_machine_s_branch_reports_what_it_did(open_tmp: Path, start: str) -> None:
    """A branch of a restored machine whose cell sets no reward recorded none (the restored
    `reward` was not its line's); a replay of it, from that machine alive or from the checkpoint
    it was restored from again, reports none too: the restored `reward` is not the line's there."""
    import smolbench
    from smolbench._session import _block

    with smolbench.Session(backend="sandbox", ledger=open_tmp / ".smolbench" / "ledger.db") as s:
        s.run("reward = 45").raise_for_error()
        s.checkpoint_save("lesson")
        assert s.checkpoint_restore("lesson") == "r1-lesson"
        fork = s.fork(2, "z = SEED", seeds=[1, 2], keep="all")
        assert [r["reward"] for r in fork.rows.values()] == [None, None]
        branch = next(iter(fork.rows))
        if start == "checkpoint":
            s.delete("r1-lesson")
        assert s.workbench is not None
        said = _block(s.workbench.replay(branch, lambda *_: None))
        assert said["reward"] is None and said["match"], said["message"]


def test_a_cell_that_fails_before_it_sets_reward_leaves_the_restored_one_not_its_own(open_tmp: Path) -> None:
    """A cell that would set `reward` but fails before it does: the restored value is still not
    the machine's. It was taken for set as soon as the cell's code named it, before it ran:
    a branch that failed reported the checkpoint's reward as its own."""
    import smolbench

    with smolbench.Session(backend="sandbox", ledger=open_tmp / ".smolbench" / "ledger.db") as s:
        s.run("reward = 42.0").raise_for_error()
        s.checkpoint_save("r42")
        assert s.checkpoint_restore("r42") == "r1-r42"
        failed = s.run("1 / 0\nreward = 3.0")
        assert not failed.ok and failed.reward is None
        assert s.run("y = 1").reward is None  # still the restored one, not this machine's
        fork = s.fork(2, "if SEED == 0:\n    raise ValueError('boom')\nreward = SEED", seeds=[0, 1], keep="all",
                      allow_errors=True)
        by_seed = {r["seed"]: r for r in fork.rows.values()}
        assert by_seed[0]["status"] == "error" and by_seed[0]["reward"] is None, by_seed[0]
        assert by_seed[1]["reward"] == 1.0
        assert s.run("reward = 42.0\n1 / 0").reward == 42.0  # set (to another object), then failed: its own
