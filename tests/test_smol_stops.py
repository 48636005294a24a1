"""A smol backend call stopped midway (a Ctrl-C, a timeout) ends what its SDK thread made before
the cancel goes on: nothing it made outlives the stop (fake engine: tests/fakesmol.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fakesmol import FakeHost, backend, fake_host, run
from smol import PortableCheckpointInfo

from smolbench.backends.smol import SmolBackend
from smolbench.spec import MachineSpec


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHost]:
    yield from fake_host(monkeypatch)


async def stopped_once(call: Any, started: threading.Event, go: threading.Event | None = None) -> None:
    """Run ``call`` and cancel it once ``started`` (its SDK call is under way), as a Ctrl-C would;
    return when the cancel has gone through. ``go``: the SDK call waits for it, and it is set
    only if the stopped call has not come back within 3 s (one that does not wait for its SDK
    call comes back well within that): one that came back early did so while the SDK call was
    still under way, which the caller then sees (and sets ``go`` itself)."""
    task = asyncio.ensure_future(call)
    while not started.is_set():
        await asyncio.sleep(0.01)
    task.cancel()
    if go is not None:
        deadline = time.monotonic() + 3
        while not task.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if not task.done():
            go.set()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def test_a_stopped_create_deletes_the_machine_smol_made_before_it_returns(host: FakeHost) -> None:
    """A Ctrl-C during `%smol up` came back while smol's create went on in its thread; the VM it
    then booted was deleted later, by a daemon thread: after `%smol down` had listed nothing, and
    not at all if the kernel exited first."""
    b = backend()
    creating, go, made = threading.Event(), threading.Event(), threading.Event()
    create = host.create

    def slow_create(config: Any = None, conn: Any = None) -> Any:
        creating.set()
        go.wait(60)  # under way until the stop has waited for it (see stopped_once)
        vm = create(config, conn)
        made.set()
        return vm

    host.cls.create.side_effect = slow_create
    seen: list[tuple[bool, list[str]]] = []

    async def main() -> None:
        await stopped_once(b.create(MachineSpec(), "root"), creating, go)
        seen.append((made.is_set(), [vm.name for vm in host.vms if not vm.deleted]))
        go.set()
        await b.close()

    run(main())
    assert seen == [(True, [])], f"the stopped create came back before its machine was made and deleted: {seen}"


def test_a_stopped_cloud_checkpoint_deletes_the_checkpoint_smol_cloud_made(host: FakeHost, tmp_path: Path) -> None:
    """A Ctrl-C during a save on the cloud target came back while smol went on capturing: the
    durable cloud checkpoint it made had no pointer file here, nor any row, and stayed in the
    cloud account for good."""
    b = SmolBackend(target="cloud", session="t")
    capturing, go = threading.Event(), threading.Event()

    def slow_cloud_checkpoint(output: str | None = None, *, store: str | None = None) -> PortableCheckpointInfo:
        capturing.set()
        go.wait(60)  # under way until the stop has waited for it (see stopped_once)
        return PortableCheckpointInfo(id="ckpt-123", machine_id="m", status="available", size_bytes=99,
                                      arch="x86_64", created_at="", download_url="")

    seen: list[list[Any]] = []

    async def main() -> None:
        root = await b.create(MachineSpec(net=True), "root")
        host.vms[0].machine.checkpoint.side_effect = slow_cloud_checkpoint
        try:
            await stopped_once(b.checkpoint(root, str(tmp_path / "c.smolcheckpoint")), capturing, go)
            seen.append([c.args[0] for c in host.cls.delete_checkpoint.call_args_list])
        finally:
            go.set()
            await b.close()

    run(main())
    assert seen == [["ckpt-123"]], f"the stopped save left its cloud checkpoint: {seen}"
    assert list(tmp_path.iterdir()) == []


def test_a_stopped_checkpoint_removes_its_files_once_the_sdk_has_written_them(host: FakeHost, tmp_path: Path) -> None:
    """A Ctrl-C during a save removed the capture and the part file at once, while smol's export
    (a thread, which can't be stopped) went on and wrote the part file afterwards: left in the
    checkpoint folder, under a name no sweep knows."""
    b = backend()
    folder = tmp_path / "ckpt"
    exporting, exported = threading.Event(), threading.Event()
    export = host.export_checkpoint

    def slow_export(source: str, output: str) -> int:
        exporting.set()
        time.sleep(0.5)
        try:
            return export(source, output)
        finally:
            exported.set()

    host.cls.export_checkpoint.side_effect = slow_export

    async def main() -> None:
        root = await b.create(MachineSpec(), "root")
        try:
            await stopped_once(b.checkpoint(root, str(folder / "root.smolcheckpoint")), exporting)
            deadline = time.monotonic() + 60  # past the export's end, had it been left running
            while not exported.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        finally:
            await b.close()

    run(main())
    assert not [p.name for p in folder.iterdir() if p.is_file()], "the stopped save left a file behind"
    assert os.listdir(folder / "captures") == []
