"""Audit (smol backend): what the host reads of a machine, where it writes its captures, and what
a restore lets out. Each attack is beside the test that stops it; each test failed before the fix.

1. The host read a machine's output with no cap: control requests (ping, seed, interrupt, save)
   went through ``exec``, which buffers all stdout, and a save's parts and a log's tail were read
   whole with ``read_file``. A cell that rewrote the guest relay to print without end piled it up
   in the kernel on the next ``%smol status``.
2. ``store`` and ``captures`` in a copied checkpoint folder were followed when links: the VM's RAM
   and disks were written, and pruned, where the folder's author chose.
3. A restore ignored the Smolfile's network rules (the cloud opened egress for any allow-list).
4. A copied cloud pointer's id named a host file, which the SDK uploads.
5. A rewritten relay's stderr reached the terminal unescaped in an error line.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakesmol import FakeHost, backend, fake_host, run

from smolbench.backends import smol as smolmod
from smolbench.backends.base import CellRequest
from smolbench.backends.smol import CLOUD_POINTER, SmolBackend
from smolbench.errors import SmolbenchError
from smolbench.gate.limits import LIMITS
from smolbench.spec import MachineSpec


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHost]:
    yield from fake_host(monkeypatch)


def rewrite_client(host: FakeHost, code: str) -> None:
    """What a cell does in its machine: overwrite the relay every host request runs."""
    Path(host.vms[0].path(smolmod.CLIENT)).write_text(code)


# -- 1. output read with a cap -------------------------------------------------------------------


def test_a_rewritten_relay_flooding_a_control_request_is_stopped_at_the_cap(
    host: FakeHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Attack: the relay prints 64 MB (standing in for "forever") to `%smol status`'s ping.
    monkeypatch.setattr(LIMITS, "max_frame", 64 * 1024)
    done = tmp_path / "flood-finished"
    b = backend()

    async def main() -> str:
        ref = await b.create(MachineSpec(), "root")
        try:
            rewrite_client(host, "import sys\nfor _ in range(4096): sys.stdout.write('x' * 16384)\n"
                                 f"open({str(done)!r}, 'w').close()\n")
            with pytest.raises(SmolbenchError) as err:
                await b.info(ref)
            return str(err.value)
        finally:
            await b.close()

    message = run(main())
    assert "passed 66 KB" in message and "\n" not in message
    assert not done.exists(), "the flooding relay was killed at the cap, not read to its end"
    calls = [c.args[0] for c in host.vms[0].machine.exec.call_args_list]
    assert not [a for a in calls if smolmod.CLIENT in a], "no control request goes through buffering exec"


def test_a_save_reads_the_machines_parts_as_a_stream_stopped_at_the_checkpoint_limit(
    host: FakeHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Attack: a workspace far over the checkpoint limit (a machine smol can't capture whole
    # saves its state): read whole with read_file before the limit was checked.
    (img := tmp_path / "img" / "usr" / "bin").mkdir(parents=True)
    (img / "python3").write_text("")
    monkeypatch.setattr(LIMITS, "checkpoint", 200_000)
    b = backend()
    path = str(tmp_path / "ckpt" / "a.smolcheckpoint")

    async def main() -> str:
        ref = await b.create(MachineSpec(image=str(tmp_path / "img")), "root")
        try:
            await b.exec_cell(ref, CellRequest(code="open('big.bin', 'wb').write(b'z' * 2_000_000)"), lambda e: None)
            with pytest.raises(SmolbenchError) as err:
                await b.checkpoint(ref, path)
            return str(err.value)
        finally:
            await b.close()

    message = run(main())
    assert "checkpoint limit" in message
    host.vms[0].machine.read_file.assert_not_called()
    assert not os.path.exists(path)


def test_an_agent_logs_tail_is_read_from_its_end_only(host: FakeHost) -> None:
    # Attack: a machine's agent log of 5 MB, read whole for one error line.
    b = backend()

    async def main() -> str:
        ref = await b.create(MachineSpec(), "root")
        try:
            log = f"{smolmod.GUEST_RUN}/big.log"  # not the live agent's own log, which it appends to
            Path(host.vms[0].path(log)).write_text("noise\n" * 800_000 + "the last line\n")
            return await b._log_tail(b._handle(ref), log)
        finally:
            await b.close()

    assert run(main()) == "the last line"
    host.vms[0].machine.read_file.assert_not_called()


# -- 2. a checkpoint folder's links ------------------------------------------------------------


def test_a_linked_captures_folder_is_refused(host: FakeHost, tmp_path: Path) -> None:
    # Attack: a copied folder's .smolbench/checkpoints/captures is a link to a folder its
    # author chose: the VM's RAM and disks went there.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "theirs").write_text("kept")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "captures").symlink_to(elsewhere)
    b = backend()

    async def main() -> str:
        ref = await b.create(MachineSpec(), "root")
        try:
            with pytest.raises(SmolbenchError) as err:
                await b.checkpoint(ref, str(folder / "root.smolcheckpoint"))
            return str(err.value)
        finally:
            await b.close()

    assert "is a link or not a folder" in run(main())
    assert sorted(os.listdir(elsewhere)) == ["theirs"]
    host.vms[0].machine.checkpoint.assert_not_called()
    host.cls.prune_checkpoint_store.assert_not_called()


@pytest.mark.parametrize("kind", ["link", "folder"])
def test_a_copied_folders_store_is_never_a_saves_store(host: FakeHost, tmp_path: Path, kind: str) -> None:
    # Attack: a copied folder's .smolbench/checkpoints/store, a link to a folder its author
    # chose (the VM's RAM and disks went there, and prune ran there) or a real folder of
    # objects they planted (smol's capture reuses what a store holds; the export is then
    # signed as this user's own). Each save makes a store of its own and removes it.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "theirs").write_text("kept")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    if kind == "link":
        (folder / "store").symlink_to(elsewhere)
    else:
        (folder / "store").mkdir()
        (folder / "store" / "planted").write_text("theirs")
    b = backend()

    async def main() -> None:
        ref = await b.create(MachineSpec(), "root")
        try:
            await b.checkpoint(ref, str(folder / "root.smolcheckpoint"))
        finally:
            await b.close()

    run(main())
    (_capture,), kwargs = host.vms[0].machine.checkpoint.call_args
    assert os.path.realpath(kwargs["store"]) not in (str(elsewhere), str(folder / "store"))
    assert os.path.dirname(kwargs["store"]) == str(folder / "captures") and not os.path.exists(kwargs["store"])
    assert sorted(os.listdir(elsewhere)) == ["theirs"]
    host.cls.prune_checkpoint_store.assert_not_called()


# -- 3. a restore's network ----------------------------------------------------------------------


def pointer(tmp_path: Path, checkpoint_id: object) -> str:
    path = tmp_path / "c.smolcheckpoint"
    path.write_text(json.dumps({"kind": CLOUD_POINTER, "id": checkpoint_id, "machine": "m", "size": 1}))
    return str(path)


def test_an_allow_listed_machine_is_not_restored_with_other_network_on_the_cloud(
    host: FakeHost, tmp_path: Path
) -> None:
    # Attack: a Smolfile allowing only pypi.org restored with open egress (cloud: network=True,
    # the cloud's private ranges and metadata addresses too). Locally a restored VM keeps the
    # rules its capture was made with (an own save's: its Smolfile's), so it goes on.
    b = SmolBackend(target="cloud", probe=False, session="t")
    spec = MachineSpec(allow_hosts=("pypi.org",))
    with pytest.raises(SmolbenchError, match="can't apply to a restored microVM") as err:
        run(b.restore(pointer(tmp_path, "ckpt-1"), "back", spec))
    assert "\n" not in str(err.value)
    host.cls.restore_checkpoint.assert_not_called()
    with pytest.raises(SmolbenchError, match="can't apply"):  # the internet-only rule is an allow-list too
        run(b.restore(pointer(tmp_path, "ckpt-1"), "back", MachineSpec(net=True)))
    host.cls.restore_checkpoint.assert_not_called()
    local = SmolBackend(target="local", probe=False, session="t")
    (tmp_path / "l.smolcheckpoint").write_bytes(b"not gzip")
    with contextlib.suppress(Exception):  # (the fake engine's answer to bytes it can't restore)
        run(local.restore(str(tmp_path / "l.smolcheckpoint"), "back", spec))
    host.cls.restore_checkpoint.assert_called_once()


# -- 4. a cloud pointer's id ---------------------------------------------------------------------


def test_a_cloud_pointer_naming_a_host_file_is_refused(
    host: FakeHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Attack: a copied pointer's id is "~/.ssh/id_rsa" (made absolute) or a bare name a file in the
    # kernel's folder answers to: the SDK uploads that file to the cloud.
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY")
    monkeypatch.chdir(tmp_path)
    b = SmolBackend(target="cloud", probe=False, session="t")
    for bad in (str(secret), "id_rsa", "../x", "", 7, "a" * 129):
        with pytest.raises(SmolbenchError, match="does not name a smol cloud checkpoint"):
            run(b.restore(pointer(tmp_path, bad), "back", MachineSpec()))
    host.cls.restore_checkpoint.assert_not_called()


# -- 5. machine text in an error line ------------------------------------------------------------


def test_a_relays_stderr_is_escaped_in_its_error_line(host: FakeHost) -> None:
    # Attack: a rewritten relay writes a terminal title escape to stderr and exits 1.
    b = backend()

    async def main() -> str:
        ref = await b.create(MachineSpec(), "root")
        try:
            rewrite_client(host, "import sys\nsys.stderr.write('\\x1b]0;owned\\x07\\x1b[2Jfake ok')\nsys.exit(1)\n")
            with pytest.raises(SmolbenchError) as err:
                await b.exec_cell(ref, CellRequest(code="1"), lambda e: None)
            return str(err.value)
        finally:
            await b.close()

    message = run(main())
    assert "fake ok" in message and "\x1b" not in message and "\x07" not in message
    assert "\\x1b]0;owned" in message
