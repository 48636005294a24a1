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
