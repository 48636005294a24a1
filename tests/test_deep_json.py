"""JSON nested deeper than json's recursion, sent by a machine or found in a copied folder.

``json.loads("[" * 2000)`` raises RecursionError, not ValueError: a parser that caught
ValueError alone let it through. A gym env's machine that sent it as its random state (under
the 4 KiB cap) broke the whole vector step, left its episode ``running`` in the ledger and
failed every later reset; a copied folder's ledger row broke the sidebar's node listing. Every
such text now goes through the gate's one JSON reader (``gate.frames.loads``).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gymhelpers import define, up_bench

import smolbench.gym as sgym
from smolbench.cluster.batch import error_of
from smolbench.gate import frames
from smolbench.ledger import Ledger
from smolbench.server import ledgerview
from smolbench.widgets import plots
from smolbench.workbench import Workbench

DEEP = "[" * 2000

HOSTILE_RNG = r'''
import numpy as np, gymnasium, __main__
from gymnasium import spaces

class Deep(gymnasium.Env):
    observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = spaces.Discrete(2)
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}
    def step(self, a):
        if a == 1:  # the attack: the random state this machine sends on is 2,000 nested arrays
            __main__._smolgym.rng = lambda: {"state": "[" * 2000, "seed": None}
            return np.zeros(2, np.float32), 1.0, True, False, {}
        return np.zeros(2, np.float32), 0.0, False, False, {}

def deep():
    return Deep()
'''


def test_the_gate_reads_too_deep_json_as_bad_json() -> None:
    with pytest.raises(ValueError, match="nested too deeply"):
        frames.loads(DEEP)
    with pytest.raises(ValueError, match="nested too deeply"):
        frames.loads(DEEP.encode())
    with pytest.raises(ValueError):
        frames.loads(b'"\xff"')  # strict UTF-8, never a guessed encoding
    assert frames.loads(b'{"a": [1]}') == {"a": [1]}


@pytest.fixture(scope="module")
def bench(tmp_path_factory: Any) -> Iterator[Workbench]:
    for wb in up_bench(tmp_path_factory):
        define(wb, HOSTILE_RNG)
        yield wb


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_machine_sending_a_too_deep_random_state_ends_only_its_episode(bench: Workbench) -> None:
    env = sgym.make_vec("deep", num_envs=2, session=bench)
    try:
        env.reset(seed=1)
        _, rewards, terminated, _, _ = env.step(np.array([0, 1]))  # sub-env 1 ends, sending the deep state
        assert list(rewards) == [0.0, 1.0] and list(terminated) == [False, True]
        _, rewards, _, _, _ = env.step(np.array([0, 0]))  # its autoreset: a new stream, from a new branch
        assert list(rewards) == [0.0, 0.0]
        env.reset()  # and every later reset works
    finally:
        env.close()
    rows = bench.ledger.nodes()
    episodes = [(m["sub_env"], m.get("ended"), status) for m, status in zip(rows["metrics"], rows["status"])
                if isinstance(m, dict) and "sub_env" in m]
    assert (1, "terminated", "ok") in episodes  # the hostile episode ended as it did, in the ledger
    assert len([e for e in episodes if e[0] == 1]) >= 2 and all(e[2] == "ok" for e in episodes), episodes


def test_a_copied_ledgers_too_deep_metrics_leave_the_node_listing_working(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    Ledger(db).close()
    with sqlite3.connect(db) as conn:
        cols = [r[1] for r in conn.execute("PRAGMA table_info(nodes)")]
        row: dict[str, Any] = dict.fromkeys(cols)
        row.update(id="root", session_id="s1", status="ok", metrics=DEEP, alive=0, kept=0)
        conn.execute(f"INSERT INTO nodes ({','.join(row)}) VALUES ({','.join('?' * len(row))})", list(row.values()))
    listed = ledgerview.nodes(db, session="s1")
    assert [(n["id"], n["metrics"]) for n in listed["nodes"]] == [("root", {})]
    assert "[[[" in plots._metrics_text(DEEP)  # shown as the text it is, cut short


def test_a_node_agents_too_deep_error_is_an_unreadable_error() -> None:
    assert "unreadable" in str(error_of(('{"type": "x", "error": ' + DEEP).encode()))
