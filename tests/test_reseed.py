"""Branches draw their own random numbers: generators made before a fork are reseeded per branch.

The failure this guards against (issue 26 item 3): a numpy Generator made during the warm-up is
copied into every branch, so `reward = float(rng.normal())` gave one number in all of them,
silently. Through a real kernel and a real sandbox (the default backend here). ``--no-reseed``
is the weakened set-up: the old behaviour, whose identical draws one line points out.
"""

from __future__ import annotations

import json
import random
import shutil
import sqlite3
from pathlib import Path

import pytest
from nbhelpers import NotebookSession, error_text, result_text, stream_text

from smolbench.guest import reseed as guest_reseed

WARM = """%%smol
import random
import numpy as np

class Env:
    def __init__(self):
        self.np_random = np.random.default_rng(5)   # like a Gymnasium env after reset(seed=...)
        self._legacy = np.random.RandomState(3)

rng = np.random.default_rng(0)
r = random.Random(1)
env = Env()
alias = rng                                          # one object, two names: reseeded once
"""
DRAW = "reward = float(rng.normal()) + r.random() + float(env.np_random.normal()) + float(env._legacy.rand())"
backend = "sandbox" if shutil.which("bwrap") else "process"


def test_reseeding_is_per_seed_and_name_and_leaves_other_objects_alone() -> None:
    np = pytest.importorskip("numpy")
    ns = {"a": np.random.default_rng(0), "b": random.Random(0), "c": random.SystemRandom(), "d": [1, 2],
          "__x": random.Random(0)}
    assert guest_reseed.reseed(ns, 7) == ["a", "b"]
    first = (ns["a"].normal(), ns["b"].random())
    guest_reseed.reseed(ns, 7)
    assert (ns["a"].normal(), ns["b"].random()) == first  # the same seed and name: the same stream (replays)
    guest_reseed.reseed(ns, 8)
    assert (ns["a"].normal(), ns["b"].random()) != first
    assert guest_reseed.derived(7, "a") != guest_reseed.derived(7, "b")


def test_a_fork_after_a_generator_is_made_gives_distinct_draws(tmp_path: Path) -> None:
    with NotebookSession(tmp_path, timeout=240, allow_errors=True) as nb:
        nb.run("%load_ext smolbench")
        up = nb.run(f"%smol up --backend {backend}")
        assert not error_text(up), error_text(up)
        warm = nb.run(WARM)
        assert not error_text(warm), error_text(warm)
        fork = nb.run(f"%%smol fork 4 --keep all --out res --quiet\n{DRAW}")
        assert not error_text(fork), error_text(fork)
        rewards = json.loads(result_text(nb.run("import json; json.dumps(sorted(res.rewards.values()))")).strip("'"))
        assert len(set(rewards)) == 4, rewards
        assert "same reward" not in stream_text(fork) + stream_text(fork, "stderr")
        # what was reseeded is in the ledger, per node
        db = sqlite3.connect(tmp_path / ".smolbench" / "ledger.db")
        try:
            rows = db.execute("SELECT id, metrics FROM nodes WHERE id LIKE 'root.%' ORDER BY id").fetchall()
        finally:
            db.close()
        assert [node for node, _ in rows] == ["root.0", "root.1", "root.2", "root.3"]
        for _, metrics in rows:
            assert json.loads(metrics)["reseeded"] == "rng, r, env.np_random, env.legacy", metrics
        replay = nb.run("%smol replay root.2")  # the fork cell reseeds again in the replay: the same draw
        assert "identical" in stream_text(replay), stream_text(replay) + error_text(replay)

        # --no-reseed: the old behaviour, every branch a copy of one stream, and one line says so
        same = nb.run(f"%%smol fork 4 --no-reseed --out same\n{DRAW}")
        said = stream_text(same) + stream_text(same, "stderr") + str(result_text(same))  # once: in its table's summary
        assert not error_text(same), error_text(same)
        assert len(set(json.loads(result_text(nb.run("json.dumps(list(same.rewards.values()))")).strip("'")))) == 1
        lines = [ln for ln in said.splitlines() if "branches reported the same reward" in ln]
        assert len(lines) == 1 and "--no-reseed left the random streams made before the fork as they were" in lines[0], said
        assert "np.random.default_rng(SEED), env.reset(seed=SEED)" in lines[0]
        nb.run("%smol down")
