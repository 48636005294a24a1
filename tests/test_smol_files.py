"""What the smol backend writes into a checkpoint folder goes to a new file of its own, renamed
into place: never through a link a copied folder holds at the name (or at a part name)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fakesmol import FakeHost, fake_host, run
from smol import PortableCheckpointInfo

from smolbench.backends.smol import SmolBackend
from smolbench.backends.smol_state import read_state, write_state
from smolbench.spec import MachineSpec


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHost]:
    yield from fake_host(monkeypatch)


def test_a_cloud_checkpoint_s_pointer_is_never_written_through_a_link(host: FakeHost, tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("someone's file")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "c.smolcheckpoint").symlink_to(victim)
    b = SmolBackend(target="cloud", session="t")

    async def main() -> None:
        root = await b.create(MachineSpec(net=True), "root")
        host.vms[0].machine.checkpoint.side_effect = lambda output=None, *, store=None: PortableCheckpointInfo(
            id="ckpt-1", machine_id="m", status="available", size_bytes=9, arch="x86_64", created_at="",
            download_url="")
        try:
            await b.checkpoint(root, str(folder / "c.smolcheckpoint"))
        finally:
            await b.close()

    run(main())
    assert victim.read_text() == "someone's file"
    written = folder / "c.smolcheckpoint"
    assert not written.is_symlink() and '"ckpt-1"' in written.read_text()
    assert sorted(p.name for p in folder.iterdir()) == ["c.smolcheckpoint"]


def test_a_state_checkpoint_is_never_written_through_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("someone's file")
    path = tmp_path / "s.smolcheckpoint"
    path.symlink_to(victim)
    (tmp_path / "s.smolcheckpoint.part").symlink_to(victim)  # the name it used for its part file
    write_state(str(path), "root", {"namespace.pkl": b"ns", "workspace.tar": b"ws"})
    assert victim.read_text() == "someone's file"
    assert not path.is_symlink() and read_state(str(path)) == {"namespace.pkl": b"ns", "workspace.tar": b"ws"}
