"""Issue 20 without a cluster: placement of fork batches, which addresses `%smol up --ray` takes, and
the checks on artifacts (checkpoints) that cross the cluster."""

from __future__ import annotations

import asyncio
import io
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from smolbench.cluster import address, artifact, placement, shipping
from smolbench.errors import SmolbenchError
from smolbench.gate import archive
from smolbench.gate.limits import LIMITS


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


# -- artifacts: bytes that cross the cluster as data -----------------------------------------


def _feed(blocks: list[bytes]) -> AsyncIterator[object]:
    async def gen() -> AsyncIterator[object]:
        for b in blocks:
            yield b

    return gen()


def test_an_artifact_is_kept_only_with_the_size_and_hash_it_was_asked_for(tmp_path: Path) -> None:
    """A node's artifact (a smol parent's portable checkpoint) reaches another node as chunks: the
    receiver keeps it only if it hashes to its content address. The attack: bytes changed at rest
    or on the way (a flipped byte, a longer file)."""
    src, dst = artifact.Store(tmp_path / "a"), artifact.Store(tmp_path / "b")
    made = tmp_path / "a" / "made"
    made.write_bytes(b"warm parent " * 100_000)
    digest, size = src.add(made)
    assert src.has(digest) and size == 1_200_000
    good = list(src.chunks(digest))
    assert asyncio.run(dst.receive(digest, size, _feed(good), "node a")) == size
    assert asyncio.run(dst.receive(digest, size, _feed(good), "node a")) == 0  # fetched once: it has it

    other = artifact.Store(tmp_path / "c")
    tampered = [good[0][:-1] + b"X", *good[1:]]
    with pytest.raises(artifact.Refused) as refused:
        asyncio.run(other.receive(digest, size, _feed(tampered), "node a"))
    assert "doesn't match its content address" in str(refused.value) and "\n" not in str(refused.value)
    assert not other.has(digest) and list(other.dir.iterdir()) == []  # nothing kept, not even a part
    with pytest.raises(artifact.Refused, match="longer than the 1200000 bytes it claimed"):
        asyncio.run(other.receive(digest, size, _feed([*good, b"more"]), "node a"))
    with pytest.raises(artifact.Refused, match="ended at"):
        asyncio.run(other.receive(digest, size, _feed(good[:-1] or [b""]), "node a"))
    old = LIMITS.checkpoint
    LIMITS.checkpoint = 1000
    try:
        with pytest.raises(artifact.Refused, match="over the checkpoint limit of 1.0 KB"):
            asyncio.run(other.receive(digest, size, _feed(good), "node a"))
    finally:
        LIMITS.checkpoint = old
    # the check is what stops it: switched off, the tampered bytes are kept under the good address
    archive.TEST_WEAKEN.add("digest")
    try:
        asyncio.run(other.receive(digest, size, _feed(tampered), "node a"))
    finally:
        archive.TEST_WEAKEN.discard("digest")
    assert other.has(digest) and artifact.hash_file(other.path(digest))[0] != digest


def _tar(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _workspace(links: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, target in links.items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return buf.getvalue()


def test_a_checkpoint_brought_from_a_node_is_checked_by_the_gate_before_any_backend_sees_it(tmp_path: Path) -> None:
    """The driver names a received checkpoint's format with the gate's own checks. The attack: a
    machine's workspace with a link to the host's /etc/shadow, in either checkpoint format."""
    from smolbench.backends import smol_state

    ok = tmp_path / "ok.smolcheckpoint"
    _tar(ok, {"namespace.pkl": b"x", "workspace.tar": _workspace({"here": "there"})})
    assert shipping.check(str(ok), "test") == "agenthost"
    evil = tmp_path / "evil.smolcheckpoint"
    _tar(evil, {"namespace.pkl": b"x", "workspace.tar": _workspace({"shadow": "/etc/shadow"})})
    with pytest.raises(archive.UnsafeCheckpoint, match=r"has a link that points outside it \(shadow -> /etc/shadow\)"):
        shipping.check(str(evil), "test")
    state = tmp_path / "state.smolcheckpoint"
    smol_state.write_state(str(state), "root", {"namespace.pkl": b"x", "workspace.tar": _workspace({})})
    assert shipping.check(str(state), "test") == "smol-state"
    evil_state = tmp_path / "evil-state.smolcheckpoint"
    smol_state.write_state(str(evil_state), "root", {"namespace.pkl": b"x", "workspace.tar": _workspace({"s": "/etc/shadow"})})
    with pytest.raises(archive.UnsafeCheckpoint, match="points outside it"):
        shipping.check(str(evil_state), "test")
    whole = tmp_path / "whole.smolcheckpoint"
    whole.write_bytes(b"smol's own layout")
    assert shipping.check(str(whole), "test") == "smol"  # smol's restore verifies its own checksums
