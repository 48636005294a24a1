"""What a Session's results do when they travel (a Ray task returns them pickled): a finished
ForkResult arrives whole (rows, kept, what it said), without its live handle; a fork's
CompositeError carries the fork's results; a Session or a gym env refuses in one line that
says what to send instead. And ``status()["lost"]`` is there before anything was lost."""

from __future__ import annotations

import pickle
import shutil
from concurrent.futures import Future
from pathlib import Path

import pytest

import smolbench
import smolbench.gym
from smolbench.errors import CompositeError, SmolbenchError
from smolbench.result import ForkResult

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def _one_line(text: str) -> str:
    assert "\n" not in text, text
    return text


def test_status_says_lost_none_before_a_loss(here: Path) -> None:
    with smolbench.Session(backend="sandbox", ledger="ledger.db") as s:
        assert s.status()["lost"] is None  # was a KeyError until something was lost
    assert s.status() == {"up": False, "lost": None}


def test_a_finished_fork_result_travels_and_a_session_refuses_in_one_line(here: Path) -> None:
    with smolbench.Session(backend="sandbox", ledger="ledger.db") as s:
        f = s.fork(4, "print('hi', SEED)\nreward = SEED", keep="best")
        copy = pickle.loads(pickle.dumps(f))  # was TypeError: cannot pickle '_thread.lock' object
        assert copy.rows == f.rows and copy.kept == f.kept and copy.kind == "fork" and copy.run_id == f.run_id
        assert copy.rewards == {b: r["reward"] for b, r in f.rows.items()} and copy.best == f.best
        assert copy.summary() == f.summary() and copy.done() and copy.wait() is copy
        with pytest.raises(SmolbenchError, match=r"^this ForkResult is a copy \(it was pickled") as said:
            copy.cancel()
        _one_line(str(said.value))
        assert f.wait() is f and f.done()  # the original stays a live handle
        import cloudpickle  # what Ray sends a task's return value with

        assert cloudpickle.loads(cloudpickle.dumps(f)).rows == f.rows

        with pytest.raises(TypeError, match=r"^a Session can't be pickled: .*make a Session inside the task") as said:
            pickle.dumps(s)
        _one_line(str(said.value))


def test_a_composite_error_carries_the_results(here: Path) -> None:
    with smolbench.Session(backend="sandbox", ledger="ledger.db") as s:
        # a fork's failures keep its results: the branches that finished are on the error
        with pytest.raises(CompositeError) as failed:
            s.fork(4, "reward = SEED\nif SEED % 2: 1 / 0", keep="none")
        result = failed.value.result
        assert isinstance(result, ForkResult) and result.kind == "fork"
        assert {r["seed"]: r["reward"] for r in result if r["status"] == "ok"} == {0: 0, 2: 2}
        assert result.counts() == {"ok": 2, "error": 2}
        again = pickle.loads(pickle.dumps(failed.value))  # the error travels too, with its results
        assert str(again) == str(failed.value) and again.result.rewards == result.rewards
        assert [e.ename for e in again.errors] == ["ZeroDivisionError"] * 2
        assert isinstance(again.errors[0], ZeroDivisionError)  # still caught by the built-in's name

        with pytest.raises(CompositeError) as failed:
            s.episodes(3, "reward = SEED\nif SEED == 1: 1 / 0")
        assert failed.value.result.kind == "episodes"
        assert {r["seed"]: r["reward"] for r in failed.value.result if r["status"] == "ok"} == {0: 0, 2: 2}


def test_a_gym_env_refuses_to_pickle_in_one_line(here: Path) -> None:
    with smolbench.Session(backend="sandbox", ledger="ledger.db") as s:
        env = smolbench.gym.make("CartPole-v1", session=s)
        venv = smolbench.gym.make_vec("CartPole-v1", 2, session=s)
        try:
            for e, call in ((env, "make"), (venv, "make_vec")):
                with pytest.raises(TypeError, match=rf"^a smolbench gym env can't be pickled: .*smolbench\.gym\.{call} "
                                                    "inside the task") as said:
                    pickle.dumps(e)
                _one_line(str(said.value))
        finally:
            env.close()
            venv.close()


def test_a_fork_still_running_refuses_to_pickle() -> None:
    f = ForkResult("fork", "s/run1", "root", ["root.0", "root.1"], [0, 1])
    f._attach(Future(), lambda: None)
    with pytest.raises(TypeError, match=r"^a fork still running can't be pickled \(0 of 2 done\): call \.wait\(\) first"):
        pickle.dumps(f)
