"""Issue 20 without a cluster: placement of fork batches, and which addresses `%smol up --ray` takes."""

from __future__ import annotations

import pytest

from smolbench.cluster import address, placement
from smolbench.errors import SmolbenchError


def test_a_fork_is_one_contiguous_batch_per_node_by_free_slots_parent_node_first() -> None:
    plan = placement.split(12, {"a": 7, "b": 8, "c": 8}, prefer="a")
    assert plan == {"a": range(0, 4), "b": range(4, 8), "c": range(8, 12)}
    assert placement.split(1, {"a": 3, "b": 8}, prefer="a") == {"a": range(0, 1)}  # a lone retry stays home
    assert placement.split(5, {"a": 0, "b": 4}, prefer="a") == {"b": range(0, 5)}  # a full node gets none
    full = placement.split(6, {"a": 0, "b": 0}, prefer="b")  # all full: shared, machines queue there
    assert sum(len(r) for r in full.values()) == 6 and list(full) == ["b", "a"]
    assert placement.least_loaded({"a": 1, "b": 5, "c": 5}) in ("b", "c")


def test_ray_address_auto_env_and_ray_client_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert address.resolve(None) == "auto"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert address.resolve(None) == "10.0.0.5:6379"
    assert address.resolve("auto") == "auto"
    with pytest.raises(SmolbenchError, match="^`ray://` addresses use Ray Client, which can't stream generators"):
        address.resolve("ray://head:10001")
    with pytest.raises(SmolbenchError, match="bad Ray address 'head'"):
        address.resolve("head")


def test_where_a_machine_runs_is_said_short_and_a_host_name_is_escaped_in_html() -> None:
    from smolbench.tree import Node, Tree, where_text
    from smolbench.widgets.static import tree_html
    from smolbench.widgets.tree import node_record

    nid = "3f2a9c1b" + "0" * 48
    assert where_text(nid, "sandbox", "h1") == "3f2a9c1b (sandbox on h1)"
    assert where_text(nid, "process", None, "0a1b2c3d" + "f" * 48) == "3f2a9c1b (process; moved from 0a1b2c3d)"
    assert where_text(nid) == "3f2a9c1b"
    tree = Tree()
    tree.add(Node("root", status="idle", where=nid, where_kind="sandbox", where_host="<b>h</b>", moved_from="0a1b2c3d"))
    tree.add(Node("root.0", "root", seed=0, status="ok"))  # a local machine: no node
    lines = tree.render("root").splitlines()
    assert "@3f2a9c1b (sandbox on <b>h</b>; moved from 0a1b2c3d)" in lines[0] and "@" not in lines[1]
    html = tree_html([node_record(n) for n in tree], active="root", best_path=[], title="t")
    assert "node 3f2a9c1b (sandbox on &lt;b&gt;h&lt;/b&gt;; moved from 0a1b2c3d)" in html and "<b>h</b>" not in html
    assert node_record(tree["root.0"])["where"] is None
