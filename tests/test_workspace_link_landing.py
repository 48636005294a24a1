"""Eighth audit, 3 and 4: links that land elsewhere than their names say. A hard link to a symlink
(tarfile copies the symlink, its text unchanged, to the new name: ``sub/s -> ../y`` as ``h`` is
``h -> ../y``, outside), and a symlink made through another symlink (``a -> .``, ``a/b -> .``,
``b/x -> ..``, then ``x/ESCAPED``: the host keyed links by name, the machine made them where they
lead). Checked by the host's check and by the machine's own unpacker."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from ckpthelpers import staged_for_the_guest

from smolbench.gate import archive


def _sym(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info


def _hard(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.LNKTYPE, target
    return info


def _dir(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, 0o755
    return info


def _tar(*members: tarfile.TarInfo) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for info in members:
            data = b"pwned\n" if info.isfile() else None
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


HARDSYM = _tar(_dir("sub"), _sym("sub/s", "../y"), _hard("h", "sub/s"))
ALIAS = _tar(_sym("a", "."), _sym("a/b", "."), _sym("b/x", ".."), tarfile.TarInfo("x/ESCAPED"))


def _load(tmp_path: Path, blob: bytes, monkeypatch: pytest.MonkeyPatch, data_filter: bool) -> Path:
    """The machine's own unpacker (guest/saveload.py) on ``blob``, with or without tarfile's data
    filter (a Python before 3.8.17 has none); its folder's parent (what may have escaped to)."""
    from smolbench.guest.saveload import SaveLoad

    stage, work = staged_for_the_guest(tmp_path, blob)
    if not data_filter:
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    machine = SimpleNamespace(workdir=str(work), ns={}, _reward_restored=lambda: None)
    with pytest.raises(ValueError, match="hard link to something not a file before it in checkpoint: h"):
        SaveLoad.load(machine, str(stage))  # type: ignore[arg-type]
    return work


def test_a_hard_link_to_a_symlink_is_refused_by_the_host() -> None:
    with pytest.raises(archive.UnsafeCheckpoint, match=r"a hard link to something not a file before it \(h -> sub/s\)"):
        archive.check_workspace(HARDSYM, "workspace")
    # nor to a file that comes later, or whose name a symlink took since, or through a link
    for blob in (_tar(_hard("h", "f"), tarfile.TarInfo("f")),
                 _tar(tarfile.TarInfo("f"), _sym("f", "../y"), _hard("h", "f")),
                 _tar(_dir("d"), tarfile.TarInfo("d/f"), _sym("e", "d"), _hard("h", "e/f"))):
        with pytest.raises(archive.UnsafeCheckpoint, match="hard link"):
            archive.check_workspace(blob, "workspace")
    archive.check_workspace(_tar(_dir("d"), tarfile.TarInfo("d/f"), _hard("g", "d/f"), _hard("h", "g")), "honest")


@pytest.mark.parametrize("data_filter", [True, False])
def test_a_hard_link_to_a_symlink_is_refused_by_the_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             data_filter: bool) -> None:
    """Before: ``h -> ../y`` was made, with tarfile's data filter too."""
    work = _load(tmp_path, HARDSYM, monkeypatch, data_filter)
    assert not (work / "h").is_symlink()


def test_a_symlink_made_through_another_lands_where_it_leads_for_the_host() -> None:
    with pytest.raises(archive.UnsafeCheckpoint, match=r"a link that points outside it \(b/x -> \.\.\)"):
        archive.check_workspace(ALIAS, "workspace")
    # the same links, each at the name it lands at: refused as it always was
    with pytest.raises(archive.UnsafeCheckpoint, match="outside"):
        archive.check_workspace(_tar(_sym("a", "."), _sym("b", "."), _sym("x", "..")), "workspace")
    # through a link inside, to a folder inside: fine
    archive.check_workspace(_tar(_dir("real"), _sym("a", "real"), _sym("a/b", "c"), tarfile.TarInfo("real/c")),
                            "honest")
