"""A node id is given out once: forks laid out before either ran, and episodes let go of.

Before, a new child's id was the count of its parent's children: two forks laid out before
the first added its nodes got the same ids, and so would any child after an old one left
memory (the ledger keeps rows by id: a second row would overwrite the first).
"""

from __future__ import annotations

from smolbench.tree import Node, Tree


def tree() -> Tree:
    t = Tree()
    t.add(Node("root", None, None, status="idle"))
    return t


def test_two_layouts_before_either_added_a_node_share_no_id() -> None:
    t = tree()
    first, second = t.next_child_ids("root", 3), t.next_child_ids("root", 2)
    assert first == ["root.0", "root.1", "root.2"] and second == ["root.3", "root.4"]


def test_an_ended_leaf_let_go_of_never_gets_its_id_back() -> None:
    t = tree()
    for name in t.next_child_ids("root", 2):
        t.add(Node(name, "root", None, status="ok"))
    assert t.forget("root.0") and "root.0" not in t
    assert t.next_child_ids("root", 1) == ["root.2"]


def test_ids_added_from_elsewhere_count_and_running_or_parent_nodes_stay() -> None:
    t = tree()
    t.add(Node("root.7", "root", None, status="running"))  # an id not given by this tree (a gym branch)
    assert t.next_child_ids("root", 1) == ["root.8"]
    assert not t.forget("root.7")  # still running
    t["root.7"].status = "ok"
    t.next_child_ids("root.7", 1)  # a fork of it was laid out
    assert not t.forget("root.7") and "root.7" in t
