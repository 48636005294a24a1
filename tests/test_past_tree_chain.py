"""A copied folder's ledger is its author's: its rows can form a chain 20,000 deep, root read
last. Building its tree rescanned every node left per node added (quadratic: 8000 nodes took
9 s), and drawing it made a call per level (RecursionError at ~1000 levels). Work is counted
here, not timed: every way of building or drawing a tree reads each node's ``parent``, and
reads of it stay under a few per node."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from smolbench import pastledger
from smolbench import tree as tree_module
from smolbench.ledger import Ledger
from smolbench.tree import Node, Tree

N = 20_000


class Budget(Exception):
    pass


def counted(budget: int) -> Any:
    """A Node whose ``parent`` reads are counted, raising past ``budget`` (the quadratic code
    fails at once instead of running for minutes)."""

    class Counted(Node):
        reads = 0
        budget = 0

        @property  # type: ignore[override]
        def parent(self) -> str | None:
            Counted.reads += 1
            if Counted.reads > Counted.budget:
                raise Budget(f"more than {Counted.budget} reads of a node's parent")
            return self.__dict__["_parent"]  # type: ignore[no-any-return]

        @parent.setter
        def parent(self, value: str | None) -> None:
            self.__dict__["_parent"] = value

    Counted.budget = budget
    return Counted


def chain_ledger(path: Path, n: int) -> Path:
    """n nodes, node i's parent node i+1: the root is read last."""
    Ledger(path).close()
    with sqlite3.connect(path) as db:
        db.executemany("INSERT INTO nodes (session_id, id, parent_id, started, status) VALUES ('s', ?, ?, ?, 'ok')",
                       [(f"n{i}", f"n{i + 1}" if i < n - 1 else None, float(i)) for i in range(n)])
    db.close()
    return path


def built(path: Path) -> Tree:
    ledger = pastledger.open_past(path)
    assert ledger is not None
    try:
        session, tree = pastledger.past_tree(ledger)
    finally:
        ledger.close()
    assert session == {"id": "s"}
    return tree


def chain_tree(node: Any, n: int) -> Tree:
    tree = Tree()
    tree.add(node("c0", None, status="ok"))
    for i in range(1, n):
        tree.add(node(f"c{i}", f"c{i - 1}", status="ok"))
    return tree


def test_a_20000_node_chain_ledger_read_root_last_builds_in_linear_work_and_renders(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = chain_ledger(tmp_path / "ledger.db", N)
    node = counted(20 * N)
    monkeypatch.setattr(pastledger, "Node", node)
    tree = built(path)
    assert node.reads < 20 * N  # the old build: ~N²/2 reads
    assert list(tree.nodes) == [f"n{i}" for i in range(N - 1, -1, -1)]  # parents first
    assert tree["n0"].parent == "n1" and tree[f"n{N - 1}"].parent is None
    lines = tree.render().splitlines()
    assert len(lines) == N and lines[0] == f"n{N - 1}  ok"
    assert lines[1] == "└─ n19998  ok" and lines[2] == "   └─ n19997  ok"
    indent = tree_module.RENDER_INDENT
    held = "   " * indent + "… "  # below RENDER_INDENT levels the indent stops growing
    assert lines[indent + 1] == "   " * indent + f"└─ n{N - indent - 2}  ok"
    assert lines[indent + 2] == held + f"└─ n{N - indent - 3}  ok"
    assert lines[-1] == held + "└─ n0  ok"


def test_a_20000_deep_tree_renders_and_lists_its_subtree_without_a_call_per_level() -> None:
    tree = chain_tree(Node, N)
    lines = tree.render("c5").splitlines()
    assert len(lines) == N and lines[0] == "c0  ok  alive" and lines[5] == "            └─ c5  ok  alive <- active"
    assert [n.id for n in tree.subtree("c1")] == [f"c{i}" for i in range(1, N)]


def test_rendering_a_wide_tree_reads_each_node_a_few_times() -> None:
    node = counted(100 * N)  # adding: a few reads each
    tree = Tree()
    tree.add(node("root", None, status="idle"))
    for i in range(N - 1):
        tree.add(node(f"root.{i}", "root", status="ok"))
    node.reads, node.budget = 0, 5 * N
    lines = tree.render().splitlines()  # the old render scanned every node for each node's children
    assert node.reads < 5 * N
    assert len(lines) == N and lines[1] == "├─ root.0  ok  alive" and lines[-1] == f"└─ root.{N - 2}  ok  alive"
    node.reads = 0
    assert len(tree.subtree("root")) == N and node.reads < 5 * N


def test_orphans_and_loops_in_a_ledger_still_show_as_roots_in_ledger_order(tmp_path: Path) -> None:
    """As before the one-pass build: a node whose parent the ledger lacks is a root; when only
    nodes under a loop are left, the first of them in ledger order is one, the rest below it."""
    path = tmp_path / "ledger.db"
    Ledger(path).close()
    rows = [("c", "a"), ("a", "b"), ("r.1", "r"), ("b", "a"), ("r", None), ("o", "gone"), ("r.0", "r"), ("d", "c")]
    with sqlite3.connect(path) as db:
        db.executemany("INSERT INTO nodes (session_id, id, parent_id, started, status) VALUES ('s', ?, ?, ?, 'ok')",
                       [(i, p, float(k)) for k, (i, p) in enumerate(rows)])
    db.close()
    tree = built(path)
    assert [(n.id, n.parent) for n in tree] == [
        ("r", None), ("o", None), ("r.1", "r"), ("r.0", "r"),  # roots, then level by level in ledger order
        ("c", None), ("d", "c"),  # "c" hangs from the loop a-b and is first: a root
        ("a", None), ("b", "a"),
    ]
    assert tree.render().splitlines() == [
        "r  ok", "├─ r.1  ok", "└─ r.0  ok", "o  ok", "c  ok", "└─ d  ok", "a  ok", "└─ b  ok"]
