"""Issue 20 without a cluster: placement of fork batches, batched agent calls, and which addresses `%smol up --ray` takes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

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


def test_batch_frames_round_trip_and_a_bad_frame_is_refused() -> None:
    from smolbench.cluster.batch import DATA, END, FAIL, error_of, failure, frame, frames
    from smolbench.errors import InfraError

    msg = frame(0, DATA, b"abc") + frame(1, END) + frame(0, FAIL, failure(InfraError("node 1234 was lost")))
    got = frames(msg, 2)
    assert got[:2] == [(0, DATA, b"abc"), (1, END, b"")]
    err = error_of(got[2][2])
    assert type(err) is InfraError and str(err) == "node 1234 was lost"  # retried by the Workbench, as before
    assert str(error_of(failure(ValueError("x")))) == "ValueError: x"
    with pytest.raises(SmolbenchError, match="bad frame"):
        frames(frame(5, DATA, b"x"), 2)
    with pytest.raises(SmolbenchError, match="cut frame header"):
        frames(msg[:5], 2)


def test_requests_made_together_go_as_one_call_and_each_gets_its_own_replies() -> None:
    """The driver's side of batch.py, with the agent's stream stood in by a generator of the
    same frames (the real agent over Ray: tests/test_cluster.py)."""
    import asyncio

    from smolbench.cluster.batch import DATA, END, FAIL, Batcher, failure, frame

    calls: list[list[str]] = []

    def start(batch_id: str, items: list[tuple[str, object]]) -> object:
        calls.append([name for name, _ in items])

        async def gen() -> AsyncIterator[asyncio.Future[bytes]]:
            for i, (name, _) in enumerate(items):
                msg = frame(i, DATA, f"{name} says hi\n".encode())
                msg += frame(i, FAIL, failure(SmolbenchError(f"{name} broke"))) if name == "b" else frame(i, END)
                fut = asyncio.get_running_loop().create_future()
                fut.set_result(msg)
                yield fut

        return gen()

    async def call(aw: Any) -> Any:
        return await aw

    async def one(batcher: Batcher, name: str) -> str:
        out = b""
        try:
            async for chunk in batcher.submit(name, None).chunks():
                out += chunk
        except SmolbenchError as exc:
            return f"{out.decode()}error: {exc}"
        return out.decode()

    async def main(batching: bool) -> list[str]:
        batcher = Batcher(start, call, lambda b, i: None, batching=batching)
        return list(await asyncio.gather(*(one(batcher, n) for n in "abcde")))

    got = asyncio.run(main(True))
    assert calls == [list("abcde")]  # one call for the five
    assert got == ["a says hi\n", "b says hi\nerror: b broke", "c says hi\n", "d says hi\n", "e says hi\n"]
    calls.clear()
    assert asyncio.run(main(False)) == got and len(calls) == 5  # batching off: one call each
